"""The native multi-step loop: N calls of a compiled step in one native call (infeed/outfeed).

Why in the module, in LLVM IR: the loop then runs the same machine code in-process (through
the JIT, :meth:`opgrad.compiler.CompiledFunction.run_steps`) and in an exported library
(:mod:`opgrad.deploy`), and Python pays one call per N steps instead of one per step.

A :class:`StepLoop` says which parameters and results of a step function the loop drives:

* **streams**: parameters read from batch-major arrays, one slice per step (``images[N*B, ...]``,
  ``labels[N*B]``, a per-step learning rate ``lr[N]``, dropout masks ``mask[N*B, ...]``); the
  loop points the parameter's pointer-table slot at slice ``i`` before step ``i``;
* **outfeeds**: results written to per-step arrays (``loss[N]``), the same way;
* **carry**: ``(parameter, result)`` pairs whose result of step ``i`` is the parameter of step
  ``i + 1`` (weights, optimizer state). The loop swaps the two slots' pointers after each step,
  so nothing is copied; afterwards the parameter slot points at the newest values;
* **nan_check**: a scalar float result (the loss) that stops the loop when it is not finite (NaN
  or an infinity: a diverged step either way) and the caller passed :data:`STOP_ON_NAN`; the
  step's updates are then not swapped in, so the carried parameter slots still hold the values
  before that step.

Integer parameters with a declared ``int_range`` (labels) are checked in the loop, for each
step's slice, *before* that step runs, so a bad label never reaches a kernel even when no
Python validated the arrays.

Entry (for a step entry ``@E``)::

    i32 @E_steps(ptr bufs, ptr ws, i64 n, i32 flags, ptr status)

``status`` is ``i64[5]``: steps completed, then for a failure the step, the index in that
step's slice, the offending value and which range check failed. Return codes:
:data:`LOOP_OK`, :data:`LOOP_RANGE` and :data:`LOOP_NAN`. Before returning, the streamed and
outfed slots are set back to the base addresses the caller put there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opgrad.errors import OpgradError
from opgrad.ir import Function

from .irtext import LLVM_TYPE, FunctionEmitter, ModuleEmitter, not_finite
from .views import INT_TYPE

__all__ = [
    "LOOP_NAN",
    "LOOP_OK",
    "LOOP_RANGE",
    "STATUS_WORDS",
    "STOP_ON_NAN",
    "LoopStopped",
    "StepLoop",
    "emit_step_loop",
]

LOOP_OK = 0
LOOP_RANGE = 1
LOOP_NAN = 2
#: ``flags`` bit: stop at the first step whose ``nan_check`` result is NaN or infinite.
STOP_ON_NAN = 1
STATUS_WORDS = 5


class LoopStopped(OpgradError, FloatingPointError):
    """The multi-step loop stopped at a NaN or infinite loss because the caller asked it to.

    ``step`` is the step whose loss was not finite; ``outputs`` holds what the loop produced up
    to it: the per-step outfeeds of steps ``0..step`` (the last one not finite) and the carried
    values as they were *before* that step.
    """

    def __init__(self, message: str, step: int, outputs: tuple[Any, ...]) -> None:
        super().__init__(message)
        self.step = step
        self.outputs = outputs


@dataclass(frozen=True)
class StepLoop:
    """Which parameters/results of a step function the native loop streams, outfeeds and carries
    (indices into ``Function.params`` and ``Function.outputs``)."""

    streams: tuple[int, ...] = ()
    outfeeds: tuple[int, ...] = ()
    carry: tuple[tuple[int, int], ...] = ()
    nan_check: int | None = None

    def validate(self, fn: Function) -> None:
        """Raise ValueError when the indices do not fit ``fn``."""
        params, outs = fn.params, fn.outputs

        def param(i: int, what: str) -> None:
            if not 0 <= i < len(params):
                raise ValueError(f"StepLoop: {what} {i} is not a parameter index (the function has {len(params)})")

        def result(i: int, what: str) -> None:
            if not 0 <= i < len(outs):
                raise ValueError(f"StepLoop: {what} {i} is not a result index (the function has {len(outs)})")

        for i in self.streams:
            param(i, "stream")
        for i in self.outfeeds:
            result(i, "outfeed")
        for p, r in self.carry:
            param(p, "carried parameter")
            result(r, "carried result")
            if (params[p].shape, params[p].dtype) != (outs[r].shape, outs[r].dtype):
                raise ValueError(f"StepLoop: parameter {params[p].name!r} ({params[p].dtype}{list(params[p].shape)}) "
                                 f"cannot carry result {r} ({outs[r].dtype}{list(outs[r].shape)})")
        carried_p = [p for p, _ in self.carry]
        carried_r = [r for _, r in self.carry]
        if len(set(self.streams) | set(carried_p)) != len(self.streams) + len(carried_p):
            raise ValueError("StepLoop: a parameter is streamed or carried twice")
        if len(set(self.outfeeds) | set(carried_r)) != len(self.outfeeds) + len(carried_r):
            raise ValueError("StepLoop: a result is outfed or carried twice")
        if self.nan_check is not None:
            result(self.nan_check, "nan_check")
            out = outs[self.nan_check]
            if out.shape != () or out.dtype not in LLVM_TYPE:
                raise ValueError(f"StepLoop: nan_check result {self.nan_check} must be a float scalar, "
                                 f"got {out.dtype}{list(out.shape)}")
            if self.nan_check in carried_r:
                raise ValueError("StepLoop: nan_check must not be a carried result")


@dataclass(frozen=True)
class LoopCheck:
    """A range check the loop runs: ``count`` ints of ``dtype`` in slot ``slot`` within [low, high)."""

    slot: int
    count: int
    dtype: str
    low: int
    high: int
    per_step: bool


def emit_step_loop(m: ModuleEmitter, entry: str, loop: StepLoop, param_slots: Sequence[int],
                   result_slots: Sequence[int], slot_bytes: Mapping[int, int], checks: Sequence[LoopCheck],
                   nan_dtype: str | None, in_place: Sequence[tuple[int, int]] = (), guarded: str = "") -> str:
    """Emit ``i32 @<entry>_steps(bufs, ws, n, flags, status)`` into ``m`` (a C identifier, so an
    exported library can call it); returns its name.

    ``in_place``: carried pairs the step updates in the parameter's slot (:mod:`.inplace`), which
    the loop does not swap. ``guarded``: the step's entry that returns before the first of those
    updates when the loss is not finite, called instead of ``entry`` when the caller asks to stop there."""
    name = f"{entry}_steps"
    f = FunctionEmitter(m, name, [("ptr", "bufs"), ("ptr", "ws"), ("i64", "n"), ("i32", "flags"),
                                  ("ptr", "status")], ret="i32")
    moving = [param_slots[i] for i in loop.streams] + [result_slots[i] for i in loop.outfeeds]
    slot_ptr = {s: f.gep("ptr", "%bufs", str(s), hint="slot") for s in
                {*moving, *(c.slot for c in checks), *(param_slots[p] for p, _ in loop.carry),
                 *(result_slots[r] for _, r in loop.carry),
                 *([result_slots[loop.nan_check]] if loop.nan_check is not None else [])}}
    bases = {s: f.load("ptr", slot_ptr[s], hint="base") for s in moving}
    status = [f.gep("i64", "%status", str(k), hint="st") for k in range(STATUS_WORDS)]
    for word in status:
        f.store("i64", "0", word)
    fail_range, fail_nan = f.label("fail.range"), f.label("fail.nan")

    def check(k: int, c: LoopCheck, step: str) -> None:
        it = INT_TYPE[c.dtype]
        data = f.load("ptr", slot_ptr[c.slot], hint="chk")
        with f.loop(0, c.count, hint="j") as j:
            v = f.val(f"sext {it} {f.load(it, f.gep(it, data, j))} to i64") if it != "i64" else \
                f.load("i64", f.gep("i64", data, j))
            bad = f.val(f"or i1 {f.icmp('slt', v, c.low)}, {f.icmp('sge', v, c.high)}")
            record, ok = f.label("bad"), f.label("ok")
            f.cbr(bad, record, ok)
            f.block(record)
            for word, value in zip(status[1:], (step, j, v, str(k)), strict=True):
                f.store("i64", value, word)
            f.br(fail_range)
            f.block(ok)

    for k, c in enumerate(checks):  # parameters that stay the same in every step: checked once
        if not c.per_step:
            check(k, c, "0")
    with f.loop(0, "%n", hint="step") as i:
        for s in moving:
            f.store("ptr", f.gep("i8", bases[s], f.mul(i, slot_bytes[s])), slot_ptr[s])
        for k, c in enumerate(checks):
            if c.per_step:
                check(k, c, i)
        # noinline: the loop runs the very machine code that a single call runs, so N steps give
        # bitwise the results of N calls (an inlined copy could be vectorized differently).
        if guarded:
            plain, checked, ran = f.label("plain"), f.label("guarded"), f.label("ran")
            f.cbr(f.icmp("ne", f.val("and i32 %flags, 1"), "0", "i32"), checked, plain)
            f.block(checked)
            f.emit(f"call i32 @{guarded}(ptr %bufs, ptr %ws) noinline")
            f.br(ran)
            f.block(plain)
            f.emit(f"call void @{entry}(ptr %bufs, ptr %ws) noinline")
            f.br(ran)
            f.block(ran)
        else:
            f.emit(f"call void @{entry}(ptr %bufs, ptr %ws) noinline")
        if loop.nan_check is not None and nan_dtype is not None:
            t = LLVM_TYPE[nan_dtype]
            wanted = f.icmp("ne", f.val("and i32 %flags, 1"), "0", "i32")
            value = f.load(t, f.load("ptr", slot_ptr[result_slots[loop.nan_check]]))
            diverged = f.val(f"and i1 {wanted}, {not_finite(f, t, value)}")
            record, ok = f.label("nan"), f.label("finite")
            f.cbr(diverged, record, ok)
            f.block(record)
            f.store("i64", i, status[1])
            f.br(fail_nan)
            f.block(ok)
        for p, r in loop.carry:
            if (p, r) in in_place:
                continue
            ps, rs = slot_ptr[param_slots[p]], slot_ptr[result_slots[r]]
            new, old = f.load("ptr", rs), f.load("ptr", ps)
            f.store("ptr", new, ps)
            f.store("ptr", old, rs)
        f.store("i64", f.add(i, 1), status[0])

    def restore() -> None:
        for s in moving:
            f.store("ptr", bases[s], slot_ptr[s])

    restore()
    f.emit("ret i32 0")
    for label, code in ((fail_range, LOOP_RANGE), (fail_nan, LOOP_NAN)):
        f.block(label)
        restore()
        f.emit(f"ret i32 {code}")
    f.finish()
    return name
