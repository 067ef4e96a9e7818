"""Verification tooling for registered gradients (see docs/checking.md).

    >>> from opgrad.checks import check_op
    >>> check_op("dense", max_examples=20).passed
    True

The names below are imported lazily: ``opgrad ops`` and every pytest run of anyone who installs
opgrad import this package (through the CLI and the pytest plugin), and neither should pay for
hypothesis strategies or the registry unless a check actually runs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names as type checkers and editors see them (``as``: re-exported); at run time each
    # loads on first use (__getattr__ below)
    from .backends import resolve_backend as resolve_backend
    from .function import assert_function as assert_function
    from .function import check_function as check_function
    from .profiles import register_profiles as register_profiles
    from .report import CHECK_NAMES as CHECK_NAMES
    from .report import Failure as Failure
    from .report import OpReport as OpReport
    from .report import format_table as format_table
    from .runner import NothingToCheckError as NothingToCheckError
    from .runner import assert_op as assert_op
    from .runner import check_op as check_op
    from .runner import check_ops as check_ops
    from .runner import parse_checks as parse_checks
    from .strategies import CaseDraw as CaseDraw
    from .strategies import Example as Example
    from .strategies import cases as cases
    from .strategies import draw_values as draw_values
    from .strategies import inputs as inputs
    from .strategies import make_inputs as make_inputs
    from .strategies import op_cases as op_cases
    from .strategies import op_examples as op_examples
    from .tolerances import KINK_MARGIN as KINK_MARGIN
    from .tolerances import TOLERANCES as TOLERANCES
    from .tolerances import Tolerance as Tolerance

_EXPORTS: dict[str, str] = {
    "check_op": "runner",
    "check_ops": "runner",
    "assert_op": "runner",
    "parse_checks": "runner",
    "NothingToCheckError": "runner",
    "check_function": "function",
    "assert_function": "function",
    "OpReport": "report",
    "Failure": "report",
    "CHECK_NAMES": "report",
    "format_table": "report",
    "CaseDraw": "strategies",
    "Example": "strategies",
    "op_cases": "strategies",
    "cases": "strategies",
    "inputs": "strategies",
    "op_examples": "strategies",
    "draw_values": "strategies",
    "make_inputs": "strategies",
    "TOLERANCES": "tolerances",
    "Tolerance": "tolerances",
    "KINK_MARGIN": "tolerances",
    "resolve_backend": "backends",
    "register_profiles": "profiles",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'opgrad.checks' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted(_EXPORTS)


__all__ = sorted(_EXPORTS)
