"""Backends for check g: a backend is ``backend(fn) -> callable(*arrays)``.

The numpy reference (``opgrad.evaluate``) is the ground truth. ``llvm`` is ``opgrad.compile``;
it is looked up when asked for, so the checker works before (and without) the compiler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opgrad.ir import Function, calls

Backend = Callable[[Function], Callable[..., Any]]


class LLVMBackend:
    """``opgrad.compile`` as a checker backend; graphs with an op that has no lowering are skipped."""

    name = "llvm"

    def __init__(self) -> None:
        from opgrad.compiler import compile as compile_fn  # ImportError without llvmlite

        self._compile = compile_fn

    def supports(self, fn: Function) -> bool:
        return all(call.op.lowering_fn is not None for call in calls(fn.outputs))

    def __call__(self, fn: Function) -> Callable[..., Any]:
        # Planned afresh: a check is of the lowering as it is now (a mutant patches it in place).
        return self._compile(fn, plan_cache=False)


BACKENDS = ("reference", "llvm")


def resolve_backend(name: str) -> Backend | None:
    """``None`` for the reference (check g then compares the reference with itself, which still
    checks every forward's shape and dtype against its shape rule); a callable otherwise."""
    if name == "reference":
        return None
    if name == "llvm":
        try:
            return LLVMBackend()
        except ImportError as exc:
            raise ValueError(f"the llvm backend is unavailable: opgrad.compile cannot be imported ({exc})") from None
    raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
