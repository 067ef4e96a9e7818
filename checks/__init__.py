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
from typing import Any

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
