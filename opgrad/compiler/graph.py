"""``opgrad.compile``: a whole Function -> one LLVM module -> one native call per invocation.

Pipeline (see ``docs/compiler.md``):

1. walk the graph in topological order; every value gets a :class:`View` into a *virtual buffer*
   (a parameter, a baked constant, a result array, or an internal intermediate);
2. each call's operator lowers itself (``op.lowering_fn(kb, call, out, *inputs)``) onto the
   :class:`KernelBuilder`; a lowering may instead return a view of an input (reshape, transpose,
   broadcast_to cost nothing), and the compiler copies only where a result needs its own array;
3. :meth:`KernelBuilder.fuse` inlines elementwise producers into their consumers;
4. :func:`plan_arena` gives the remaining internal buffers offsets in one arena, reusing memory
   of buffers whose lifetimes (first to last step touching them) do not overlap;
5. the module is optimized for the host, each kernel by the pipeline it asks for (or loaded from the
   object cache), and called through a pointer table that is built once; a call only patches
   argument and result addresses.

Arguments are validated in Python before the native call (count, dtype, shape; integer inputs
against their declared ``int_range``), so no input can make the native code read out of bounds.
"""

from __future__ import annotations

import ctypes
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from opgrad.env import plan_cache_setting
from opgrad.errors import ArgumentError
from opgrad.ir import Call, Const, Expr, Function, Var, children, topological_order
from opgrad.locks import ForkSafeLock
from opgrad.reference import check_arguments
from opgrad.replicas import raise_pending

from .builder import KernelBuilder
from .hostcall import register_host_symbols
from .inplace import update_in_place
from .irtext import ModuleEmitter
from .jit import CompileTimes, NativeModule, ObjectMissing
from .plancache import PlanCache, attribute_key, plan_key
from .steploop import LOOP_NAN, LOOP_RANGE, STATUS_WORDS, STOP_ON_NAN, LoopCheck, LoopStopped, StepLoop, emit_step_loop
from .threads import pool
from .views import ELEMENT_BYTES, View, identity

_ALIGN = 64
#: The compiled entry's name (``void opgrad_graph(ptr bufs, ptr ws)``).
_ENTRY = "opgrad_graph"


@dataclass
class Buffer:
    """A virtual buffer: ``kind`` is ``param``, ``const``, ``result`` or ``internal``."""

    kind: str
    shape: tuple[int, ...]
    dtype: str
    index: int = -1  # parameter or result position

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ELEMENT_BYTES[self.dtype]


@dataclass(frozen=True)
class RangeCheck:
    """An integer parameter that must lie in ``[low, high)`` because ``op``'s ``input`` says so."""

    param: int
    op: str
    input: str
    low: int
    high: int


def plan_arena(sizes: dict[int, int], lifetimes: dict[int, tuple[int, int]]) -> tuple[dict[int, int], int]:
    """Offsets for buffers so that two buffers live at the same step never overlap in memory.

    Greedy by size (largest first), each placed at the lowest offset that clears every already
    placed buffer whose lifetime intersects its own; returns (offsets, arena bytes).
    """
    placed: list[tuple[int, int, int, int]] = []  # (offset, end, first, last)
    offsets: dict[int, int] = {}
    for b in sorted(sizes, key=lambda b: (-sizes[b], b)):
        first, last = lifetimes[b]
        size = -(-sizes[b] // _ALIGN) * _ALIGN or _ALIGN
        conflicts = sorted((o, e) for o, e, f0, l0 in placed if f0 <= last and first <= l0)
        offset = 0
        for o, e in conflicts:
            if offset + size <= o:
                break
            offset = max(offset, e)
        offsets[b] = offset
        placed.append((offset, offset + size, first, last))
    return offsets, max((e for _, e, _, _ in placed), default=0)


class _Lowering:
    """Turns a Function into KernelBuilder steps over virtual buffers."""

    def __init__(self, fn: Function, name: str = "opgrad_graph") -> None:
        self.fn = fn
        self.buffers: list[Buffer] = []
        self.consts: dict[int, np.ndarray] = {}
        self.kb = KernelBuilder(name, allocate=lambda shape, dtype: self.new("internal", shape, dtype),
                                constant=self._table)
        self.checks: list[RangeCheck] = []

    def new(self, kind: str, shape: tuple[int, ...], dtype: str, index: int = -1) -> int:
        self.buffers.append(Buffer(kind, tuple(shape), dtype, index))
        return len(self.buffers) - 1

    def run(self) -> list[int]:
        fn = self.fn
        views: dict[int, View] = {}
        for i, p in enumerate(fn.params):
            views[p._uid] = View.contiguous(self.new("param", p.shape, p.dtype, i), p.shape, p.dtype)
        result_of: dict[int, int] = {}
        results = []
        for i, out in enumerate(fn.outputs):
            results.append(self.new("result", out.shape, out.dtype, i))
            if isinstance(out, Call):
                result_of.setdefault(out._uid, results[-1])
        same = SameValues()
        for node in topological_order(_shallowest_first(fn.outputs)):
            if node._uid in views:
                continue
            if isinstance(node, Const):
                views[node._uid] = self._const(node)
                same.note_const(node)
            elif isinstance(node, Call):
                earlier = same.earlier_call(node)
                if earlier is not None:  # the same op of the same inputs, lowered before
                    views[node._uid] = views[earlier]
                    continue
                first = len(self.kb.steps)
                views[node._uid] = self._call(node, views, result_of.get(node._uid))
                same.note_call(node, all(st.kind == "ew" for st in self.kb.steps[first:])
                               and len(self.kb.steps) > first)
            else:
                raise TypeError(f"unexpected node {node!r}")
        for i, out in enumerate(fn.outputs):  # results not computed in place: copy (rarely needed)
            target = View.contiguous(results[i], out.shape, out.dtype)
            if views[out._uid] != target:
                self.kb.elementwise(target, [views[out._uid]], identity)
        return results

    def _const(self, node: Const) -> View:
        value = node.value
        if value.size == 1 and value.dtype.kind == "f":
            return View.scalar(float(value.reshape(-1)[0]), node.dtype, node.shape)
        index = self.new("const", node.shape, node.dtype)
        self.consts[index] = np.ascontiguousarray(value)
        return View.contiguous(index, node.shape, node.dtype)

    def _table(self, array: np.ndarray) -> int:
        """A constant buffer a lowering computed at compile time (``KernelBuilder.constant``)."""
        index = self.new("const", array.shape, array.dtype.name)
        self.consts[index] = array
        return index

    def _call(self, call: Call, views: dict[int, View], result: int | None) -> View:
        lower = call.op.lowering_fn
        if lower is None and call.op.lowering_reason:
            raise NotImplementedError(
                f"opgrad.compile: operator {call.op.name!r} has no lowering: it is reference only "
                f"({call.op.lowering_reason}); evaluate graphs that use it with opgrad.evaluate"
            )
        if lower is None:
            raise NotImplementedError(
                f"opgrad.compile: operator {call.op.name!r} has no lowering; add '@{call.op.name}.lowering' "
                f"in {call.op.source} (see docs/compiler.md)"
            )
        self._range_checks(call)
        index = result if result is not None else self.new("internal", call.shape, call.dtype)
        out = View.contiguous(index, call.shape, call.dtype)
        if call.type.size == 0:
            return out
        first = len(self.kb.steps)
        aliased = lower(self.kb, call, out, *(views[a._uid] for a in call.args))
        for step in self.kb.steps[first:]:
            step.label = call.op.name
        return aliased if aliased is not None else out

    def _range_checks(self, call: Call) -> None:
        for spec, arg in zip(call.specs, call.args, strict=True):
            if spec.kind != "int" or spec.int_range is None:
                continue
            low, high = spec.int_range[0], _resolve(call, spec.int_range[1])
            if isinstance(arg, Var):
                self.checks.append(RangeCheck(self.fn.params.index(arg), call.op.name, spec.name, low, high))
            elif isinstance(arg, Const):
                _check_range(arg.value, RangeCheck(-1, call.op.name, spec.name, low, high), "a constant")
            else:
                raise NotImplementedError(f"{call.op.name}: integer input {spec.name!r} computed in the graph "
                                          "cannot be range-checked before the call")


class SameValues:
    """Finds calls that compute what an earlier call computed: the same operator, attributes and
    inputs, where inputs are the same parameter, equal small constants or again such calls.

    A gradient recomputes what the forward pass computed (batch_norm's gradient the batch's mean
    and variance, which the layer's running statistics take too); reusing the earlier result saves
    the passes over the data. Calls that lower to elementwise steps only are recognised (so that
    what reads them can be) but computed again: each copy fuses into its own reader, where one
    shared result would be written to memory and read back twice.
    """

    #: Constants up to this many bytes are compared by value (larger ones by identity).
    CONST_BYTES = 4096

    def __init__(self) -> None:
        self._class: dict[int, int] = {}  # node uid -> uid of the first node computing the same value
        self._first: dict[tuple[Any, ...], int] = {}
        self._recompute: set[int] = set()  # classes whose calls lower to elementwise steps only

    def _key(self, node: Call) -> tuple[Any, ...] | None:
        try:
            attrs = tuple(sorted((name, attribute_key(value)) for name, value in node.attrs.items()))
        except TypeError:  # an attribute this comparison does not know: never the same
            return None
        return (node.op.name, node.dtype, node.shape, attrs, tuple(self._class.get(a._uid, a._uid) for a in node.args))

    def note_const(self, node: Const) -> None:
        if node.value.nbytes <= self.CONST_BYTES:
            key = ("const", node.value.dtype.str, node.value.shape, node.value.tobytes())
            self._class[node._uid] = self._first.setdefault(key, node._uid)

    def earlier_call(self, node: Call) -> int | None:
        """The uid of an earlier call whose result ``node`` may reuse, or None (lower it); either
        way ``node`` is recorded, as the first of its kind or as a repeat."""
        key = self._key(node)
        if key is None:
            return None
        first = self._class[node._uid] = self._first.setdefault(key, node._uid)
        return None if first == node._uid or first in self._recompute else first

    def note_call(self, node: Call, elementwise_only: bool) -> None:
        """After lowering ``node``: ``elementwise_only`` (it emitted only elementwise steps) makes
        its repeats compute it again."""
        if elementwise_only and self._class.get(node._uid) == node._uid:
            self._recompute.add(node._uid)


def _resolve(call: Call, bound: int | str) -> int:
    """An ``int_range`` bound: an int, an attribute name, or a dims symbol of another input."""
    if isinstance(bound, int):
        return bound
    if bound in call.attrs:
        return int(call.attrs[bound])
    for spec, arg in zip(call.specs, call.args, strict=True):
        if spec.dims and bound in spec.dims:
            return arg.shape[spec.dims.index(bound)]
    raise ValueError(f"{call.op.name}: cannot resolve int_range bound {bound!r}")


def _check_range(arr: np.ndarray, check: RangeCheck, what: str) -> None:
    if arr.size == 0:
        return
    lo, hi = arr.min(), arr.max()
    if lo < check.low or hi >= check.high:
        bad = int(lo) if lo < check.low else int(hi)
        where = int(np.flatnonzero((arr < check.low) | (arr >= check.high))[0])
        raise ArgumentError(
            f"opgrad.compile: {what} feeds input {check.input!r} of {check.op} with value {bad} "
            f"(at flat index {where}); valid range is [{check.low}, {check.high})"
        )


@dataclass(frozen=True)
class StepCost:
    """What one native step of a plan does, for per-kernel reports: ``flops`` counts the multiply-adds
    of GEMM/conv steps as 2 (0 elsewhere), ``bytes`` the sizes of the buffers it reads and writes."""

    label: str
    detail: str
    flops: int
    bytes: int
    #: The pointer-table slots it reads and writes (see :attr:`GraphPlan.buffers`).
    reads: tuple[int, ...] = ()
    writes: tuple[int, ...] = ()


@dataclass
class GraphPlan:
    """Everything about a compiled graph except its machine code: the pointer table's slots
    (``buffers``, with ``params``/``results`` giving each argument's and result's slot), the arena
    offsets of internal slots, constants, range checks, per-thread workspace and the LLVM IR.

    The JIT (:class:`CompiledFunction`) and the exporter (:mod:`opgrad.deploy`) both run a plan:
    one fills the table from numpy arrays, the other from C. A plan loaded from the plan cache
    (:meth:`from_record`) has no IR: ``module`` is None and ``ir`` empty.
    """

    function: Function
    name: str
    buffers: list[Buffer]
    params: list[int]
    results: list[int]
    offsets: dict[int, int]
    arena_bytes: int
    consts: dict[int, np.ndarray]
    checks: list[RangeCheck]
    workspace_per_thread: int
    steps: int
    fused: int
    step_labels: list[str]
    kernel_labels: dict[str, str]
    module: ModuleEmitter | None
    ir: str
    loop: StepLoop | None = None
    loop_entry: str = ""
    loop_checks: list[LoopCheck] = field(default_factory=list)
    step_costs: list[StepCost] = field(default_factory=list)
    #: Steps that call back into this process (``cross_replica_sum``'s reducer), described.
    host_calls: list[str] = field(default_factory=list)
    #: ``(parameter, result)`` index pairs whose result is computed over the parameter's slot
    #: (:mod:`.inplace`): the caller hands the result's array in that slot, the result's is unused.
    in_place: list[tuple[int, int]] = field(default_factory=list)

    def emitter(self) -> ModuleEmitter:
        """The module the plan's IR was emitted into; a plan from the plan cache has none."""
        if self.module is None:
            raise ValueError(f"plan {self.name!r} came from the plan cache and has no IR module; "
                             "build one with plan_graph")
        return self.module

    def record(self) -> tuple[dict[str, Any], dict[int, np.ndarray]]:
        """What the plan cache stores: every field but the function, the loop and the IR, as JSON
        values, and the constants."""
        fields = {
            "name": self.name,
            "buffers": [[b.kind, list(b.shape), b.dtype, b.index] for b in self.buffers],
            "params": self.params, "results": self.results,
            "offsets": [[slot, offset] for slot, offset in self.offsets.items()],
            "arena_bytes": self.arena_bytes,
            "checks": [[c.param, c.op, c.input, c.low, c.high] for c in self.checks],
            "workspace_per_thread": self.workspace_per_thread, "steps": self.steps, "fused": self.fused,
            "step_labels": self.step_labels, "kernel_labels": self.kernel_labels,
            "loop_entry": self.loop_entry,
            "loop_checks": [[c.slot, c.count, c.dtype, c.low, c.high, c.per_step] for c in self.loop_checks],
            "step_costs": [[c.label, c.detail, c.flops, c.bytes, list(c.reads), list(c.writes)]
                           for c in self.step_costs],
            "host_calls": self.host_calls,
            "in_place": [list(pair) for pair in self.in_place],
        }
        return fields, self.consts

    @classmethod
    def from_record(cls, fn: Function, loop: StepLoop | None, fields: dict[str, Any],
                    consts: dict[int, np.ndarray]) -> GraphPlan:
        """The plan :meth:`record` stored for ``fn`` (and ``loop``), without its IR. Raises
        KeyError, TypeError or ValueError on a record that does not fit ``fn``."""
        buffers = [Buffer(str(kind), tuple(int(d) for d in shape), str(dtype), int(index))
                   for kind, shape, dtype, index in fields["buffers"]]
        params, results = [int(b) for b in fields["params"]], [int(b) for b in fields["results"]]
        wanted = [(p.shape, p.dtype) for p in fn.params] + [(o.shape, o.dtype) for o in fn.outputs]
        if [(buffers[b].shape, buffers[b].dtype) for b in params + results] != wanted:
            raise ValueError("its parameters and results are not the function's")
        if sorted(consts) != [b for b, buffer in enumerate(buffers) if buffer.kind == "const"] or any(
                consts[b].shape != buffers[b].shape or consts[b].dtype.name != buffers[b].dtype for b in consts):
            raise ValueError("its constants are not its constant slots")
        offsets = {int(slot): int(offset) for slot, offset in fields["offsets"]}
        arena_bytes = int(fields["arena_bytes"])
        if any(buffers[b].kind != "internal" or not 0 <= offset <= arena_bytes - buffers[b].nbytes
               for b, offset in offsets.items()):
            raise ValueError("its arena offsets do not fit its arena")
        return cls(
            fn, str(fields["name"]), buffers, params, results, offsets, arena_bytes, consts,
            [RangeCheck(int(param), str(op), str(name), int(low), int(high))
             for param, op, name, low, high in fields["checks"]],
            int(fields["workspace_per_thread"]), int(fields["steps"]), int(fields["fused"]),
            [str(label) for label in fields["step_labels"]],
            {str(k): str(v) for k, v in fields["kernel_labels"].items()}, None, "", loop, str(fields["loop_entry"]),
            [LoopCheck(int(slot), int(count), str(dtype), int(low), int(high), bool(per_step))
             for slot, count, dtype, low, high, per_step in fields["loop_checks"]],
            [StepCost(str(label), str(detail), int(flops), int(nbytes), tuple(reads), tuple(writes))
             for label, detail, flops, nbytes, reads, writes in fields["step_costs"]],
            [str(call) for call in fields["host_calls"]],
            _check_in_place(fn, [(int(p), int(r)) for p, r in fields["in_place"]], loop),
        )


def plan_graph(fn: Function, *, name: str = "opgrad_graph", step_entries: bool = False,
               loop: StepLoop | None = None, in_place: Sequence[tuple[int, int]] = ()) -> GraphPlan:
    """Lower, fuse and plan ``fn`` into one module with entry ``void name(ptr bufs, ptr ws)``.

    Code is generated for the current target (:func:`opgrad.compiler.target.use_target`; the
    host by default). ``loop`` adds ``i32 name_steps(...)`` (:mod:`.steploop`). ``in_place``:
    ``(parameter, result)`` index pairs whose result may be computed over the parameter's array
    (:mod:`.inplace`); the plan's ``in_place`` lists those it honours.
    """
    if loop is not None:
        loop.validate(fn)
    pairs = _check_in_place(fn, in_place, loop)
    low = _Lowering(fn, name)
    results = low.run()
    kb = low.kb
    internal = {i for i, b in enumerate(low.buffers) if b.kind == "internal"}
    kb.drop_unread(internal)
    fused = kb.fuse(internal) + kb.fuse_reductions() + kb.fuse_prologues(internal) + kb.fuse_outputs()
    params = [i for i, b in enumerate(low.buffers) if b.kind == "param"]
    checked = loop.nan_check if loop is not None else None
    honoured = [pairs[n] for n in update_in_place(kb.steps, [(params[p], results[r]) for p, r in pairs],
                                                  after=results[checked] if checked is not None else None)]
    guard = None
    if honoured and checked is not None:  # the loop's stop at a non-finite loss: before the first weight is overwritten
        overwritten = {params[p] for p, _ in honoured}
        first = min(s for s, step in enumerate(kb.steps) if overwritten & set(step.writes))
        guard = (first, results[checked], fn.outputs[checked].dtype)
    internal = {i for i, b in enumerate(low.buffers) if b.kind == "internal"}  # and the partial sums
    lifetimes: dict[int, tuple[int, int]] = {}
    for s, step in enumerate(kb.steps):
        for b in (*step.reads, *step.writes):
            if b in internal:
                first, _ = lifetimes.get(b, (s, s))
                lifetimes[b] = (first, s)
    offsets, arena_bytes = plan_arena({b: low.buffers[b].nbytes for b in lifetimes}, lifetimes)
    step_labels = [step.label or "copy" for step in kb.steps]
    step_costs = [StepCost(label, step.detail, step.flops,
                           sum(low.buffers[b].nbytes for b in {*step.reads, *step.writes}),
                           tuple(step.reads), tuple(step.writes))
                  for label, step in zip(step_labels, kb.steps, strict=True)]
    ir = kb.finish(step_entries, guard)
    loop_entry = ""
    loop_checks: list[LoopCheck] = []
    if loop is not None:
        streamed = {params[i] for i in loop.streams}
        loop_checks = [LoopCheck(params[c.param], math.prod(fn.params[c.param].shape), fn.params[c.param].dtype,
                                 c.low, c.high, params[c.param] in streamed) for c in low.checks]
        nan_dtype = fn.outputs[loop.nan_check].dtype if loop.nan_check is not None else None
        loop_entry = emit_step_loop(kb.m, name, loop, params, results,
                                    {b: low.buffers[b].nbytes for b in range(len(low.buffers))},
                                    loop_checks, nan_dtype, in_place=honoured,
                                    guarded=f"{name}.guarded" if guard else "")
        ir = kb.m.text()
    return GraphPlan(fn, name, low.buffers, params, results, offsets, arena_bytes, low.consts, low.checks,
                     kb.workspace_per_thread, len(kb.steps), fused, step_labels, kb.kernel_labels, kb.m, ir,
                     loop, loop_entry, loop_checks, step_costs, list(kb.host_calls), honoured)


def _check_in_place(fn: Function, pairs: Sequence[tuple[int, int]], loop: StepLoop | None) -> list[tuple[int, int]]:
    """``pairs`` as ``(parameter, result)`` ints, or ValueError naming what does not fit ``fn``."""
    checked: list[tuple[int, int]] = []
    expected = "in_place: expected a sequence of (parameter index, result index) pairs"
    if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Sequence):
        raise ValueError(f"{expected}, got {pairs!r}")
    for pair in pairs:
        if not (isinstance(pair, Sequence) and len(pair) == 2 and all(
                isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in pair)):
            raise ValueError(f"{expected}, got {pair!r} in it")
        p, r = int(pair[0]), int(pair[1])
        if not (0 <= p < len(fn.params) and 0 <= r < len(fn.outputs)):
            raise ValueError(f"in_place: ({p}, {r}) is not a (parameter, result) pair of a function with "
                             f"{len(fn.params)} parameters and {len(fn.outputs)} results")
        param, out = fn.params[p], fn.outputs[r]
        if (param.shape, param.dtype) != (out.shape, out.dtype):
            raise ValueError(f"in_place: parameter {param.name!r} ({param.dtype}{list(param.shape)}) cannot hold "
                             f"result {r} ({out.dtype}{list(out.shape)})")
        if any(p == q or r == s for q, s in checked):
            raise ValueError(f"in_place: parameter {p} or result {r} is paired twice")
        if loop is not None and (p, r) not in loop.carry:
            raise ValueError(f"in_place: ({p}, {r}) is not a carried pair of the loop; a loop updates in place "
                             "only what it carries")
        checked.append((p, r))
    return checked


def _shallowest_first(outputs: Sequence[Expr]) -> list[Expr]:
    """``outputs`` ordered by depth (the longest path from a leaf), shallowest first (stable).

    The step order is the depth-first order from the outputs in this order, so an output that
    needs little of the graph is computed as soon as its inputs are: a batch norm's running
    statistics right after its forward pass, while the activation they read is in cache, and a
    layer's weight update right after the gradient of its output, before the backward pass goes
    on to the layers below (in the given order the first layer's update would come first and pull
    the whole backward pass ahead of every other update, leaving each gradient to be read again
    from memory at the end)."""
    depth: dict[int, int] = {}
    for node in topological_order(outputs):
        depth[node._uid] = 1 + max((depth[c._uid] for c in children(node)), default=0)
    return [out for _, _, out in sorted((depth[out._uid], i, out) for i, out in enumerate(outputs))]


class CompiledFunction:
    """A Function compiled to one native entry; call it like ``opgrad.evaluate(fn, ...)``.

    Attributes: ``compile_seconds`` (wall time of ``opgrad.compile``), ``cache_hit`` (the object
    came from the on-disk cache), ``plan_cache_hit`` (the plan did too: :mod:`.plancache`),
    ``plan_seconds`` (building the plan, or reading the stored one), ``times``
    (parse/optimize/codegen/load split), ``ir`` (the unoptimized LLVM IR text), ``arena_bytes``,
    ``steps`` and ``fused`` (plan statistics).

    Arguments must match the parameters' dtype and shape exactly (no silent casts); arrays that
    are not C-contiguous or not in native byte order are copied first (documented, not an error).
    Calls on one object are serialized by a lock: the intermediate arena is shared.
    """

    def __init__(self, fn: Function, step_entries: bool = False, loop: StepLoop | None = None,
                 plan_cache: bool | None = None, in_place: Sequence[tuple[int, int]] = ()) -> None:
        t0 = time.perf_counter()
        self.function = fn
        self._step_entries = step_entries
        register_host_symbols()
        in_place = _check_in_place(fn, in_place, loop)
        use_plans = plan_cache_setting() if plan_cache is None else plan_cache
        key = plan_key(fn, name=_ENTRY, step_entries=step_entries, loop=loop, in_place=in_place) \
            if use_plans else None
        plans = PlanCache() if key is not None else None
        keyed = time.perf_counter() - t0
        loaded = self._load_stored(fn, loop, plans, key) if plans is not None and key else None
        self.plan_cache_hit = loaded is not None
        if loaded is None:
            plan = plan_graph(fn, name=_ENTRY, step_entries=step_entries, loop=loop, in_place=in_place)
            self.plan_seconds = time.perf_counter() - t0  # lowering, fusion, buffer plan and IR text
            # The thread pool's module (which the step calls) is built after the step's objects, in a
            # worker already started for them, rather than first and waiting for a worker of its own.
            module = NativeModule(plan.ir, what=_describe(fn), kernel_labels=plan.kernel_labels, before_load=pool)
            if plans is not None and key:
                fields, consts = plan.record()
                plans.store(key, {**fields, "object_key": module.key, "declared": module.declared}, consts)
        else:
            plan, module, read_seconds = loaded
            self.plan_seconds = keyed + read_seconds  # the key (graph fingerprint) and the stored record
        self.plan = plan
        self._module = module
        self.fused, self.arena_bytes, self.steps = plan.fused, plan.arena_bytes, plan.steps
        self.step_labels = plan.step_labels
        nthreads = pool().nthreads
        self.times: CompileTimes = self._module.times
        self.cache_hit = self.times.cache_hit
        self._fn = self._module.cfunc(plan.name, None, ctypes.c_void_p, ctypes.c_void_p)
        self._arena = np.zeros(self.arena_bytes + _ALIGN, np.uint8)
        self._ws = np.zeros(plan.workspace_per_thread * nthreads + _ALIGN, np.uint8)
        self._consts = plan.consts
        self._table = (ctypes.c_void_p * max(1, len(plan.buffers)))()
        self._table_addr = ctypes.addressof(self._table)
        arena = _aligned(self._arena)
        for b, off in plan.offsets.items():
            self._table[b] = arena + off
        for b, arr in self._consts.items():
            self._table[b] = arr.ctypes.data
        self._params = plan.params
        self._results = plan.results
        self._result_types = [(o.shape, np.dtype(o.dtype)) for o in fn.outputs]
        self._param_types = [(p.shape, np.dtype(p.dtype)) for p in fn.params]  # native byte order
        self._checks = plan.checks
        #: The ``(parameter, result)`` pairs computed in place (see :meth:`__call__`).
        self.in_place: list[tuple[int, int]] = list(plan.in_place)
        self._ws_addr = _aligned(self._ws)
        self._lock = ForkSafeLock()
        self._calls_host = bool(plan.host_calls)
        self._profile: list[list[float]] | None = None
        self._profile_clock: Callable[[], float] = time.perf_counter
        #: With :meth:`profile_parallel`: each step's simulated parallel seconds, run by run.
        self._profile_parallel: list[list[float]] | None = None
        self._step_fns = [self._module.cfunc(f"{plan.name}.step{i}", None, ctypes.c_void_p, ctypes.c_void_p)
                          for i in range(self.steps)] if step_entries else []
        self._loop_fn = (self._module.cfunc(plan.loop_entry, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p,
                                            ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p)
                         if plan.loop_entry else None)
        self.compile_seconds = time.perf_counter() - t0

    @staticmethod
    def _load_stored(fn: Function, loop: StepLoop | None, plans: PlanCache,
                     key: str) -> tuple[GraphPlan, NativeModule, float] | None:
        """The stored plan of ``key``, its loaded object and the seconds the plan took to read;
        None when either is missing (a plan that does not fit is reported and deleted)."""
        t0 = time.perf_counter()
        record = plans.load(key)
        if record is None:
            return None
        fields, consts = record
        try:
            plan = GraphPlan.from_record(fn, loop, fields, consts)
            object_key, declared = str(fields["object_key"]), [str(name) for name in fields["declared"]]
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            plans.discard(key, f"not a plan of this function ({type(exc).__name__}: {exc})")
            return None
        seconds = time.perf_counter() - t0
        try:
            module = NativeModule("", key=object_key, declared=declared, what=_describe(fn),
                                  kernel_labels=plan.kernel_labels, before_load=pool)
        except ObjectMissing:
            return None
        return plan, module, seconds

    @property
    def ir(self) -> str:
        """The unoptimized LLVM IR text (planned again on first use after a plan-cache hit)."""
        if not self.plan.ir:
            self.plan.ir = plan_graph(self.function, name=_ENTRY, step_entries=self._step_entries,
                                      loop=self.plan.loop).ir
        return self.plan.ir

    def __call__(self, *arrays: Any, donate: bool = False) -> np.ndarray | tuple[np.ndarray, ...]:
        """The results for ``arrays`` (the function's parameters, in order).

        For each pair of :attr:`in_place`, the result is computed in the parameter's memory:
        with ``donate=True`` in the array passed (which is then returned as that result; the
        caller gives it up, as with JAX's donated buffers), unless it is read-only or overlaps
        another argument; otherwise in a copy of it, so the arrays passed are never modified.
        """
        if donate is not False and donate is not True:  # "no" would be truthy and give the arrays up
            raise TypeError(f"opgrad.compile(...): donate must be True or False, got {donate!r}")
        checked = list(arrays)
        if len(arrays) != len(self._param_types) or not all(
            type(a) is np.ndarray and a.shape == shape and a.dtype == dtype and a.flags.c_contiguous
            and a.flags.aligned
            for a, (shape, dtype) in zip(arrays, self._param_types, strict=False)
        ):  # slow path: the reference backend's validator names what is wrong; then fix layout
            checked = check_arguments(self.function, arrays, who="opgrad.compile(...)")
            for i, arr in enumerate(checked):
                if not (arr.flags.c_contiguous and arr.dtype.isnative and arr.flags.aligned):
                    checked[i] = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("="))
        for check in self._checks:
            _check_range(checked[check.param], check, f"argument {self.function.params[check.param].name!r}")
        outs = [np.empty(shape, dtype) for shape, dtype in self._result_types]
        if self.in_place:
            kept = _donated(checked, [p for p, _ in self.in_place]) if donate else set()
            for p, r in self.in_place:
                if p in kept:
                    outs[r] = checked[p]
                else:
                    np.copyto(outs[r], checked[p])
                    checked[p] = outs[r]
        with self._lock:
            table = self._table
            for b, arr in zip(self._params, checked, strict=True):
                table[b] = arr.ctypes.data
            for b, arr in zip(self._results, outs, strict=True):
                table[b] = arr.ctypes.data
            self._fn(self._table_addr, self._ws_addr)
            if self._calls_host:  # a reducer that failed stopped the step: raise its error here
                raise_pending()
            if self._profile is not None:  # rerun each step alone on the same buffers, timed
                clock = self._profile_clock
                parallel = self._profile_parallel
                for i, step in enumerate(self._step_fns):
                    if parallel is not None:
                        pool().share_totals()  # clears what the full call added
                    t = clock()
                    step(self._table_addr, self._ws_addr)
                    took = clock() - t
                    self._profile[i].append(took)
                    if parallel is not None:
                        parallel[i].append(pool().share_totals().parallel_seconds(took))
        return tuple(outs) if self.function.returns_tuple else outs[0]

    def run_steps(self, steps: int, *arrays: Any, stop_on_nan: bool = False,
                  validate: bool = True) -> np.ndarray | tuple[np.ndarray, ...]:
        """Run ``steps`` calls as ONE native call through the loop compiled in (``loop=``).

        ``arrays`` follow the function's parameters. A streamed parameter of shape ``(B, ...)`` is
        given batch-major as ``(steps * B, ...)`` (a scalar as ``(steps,)``); a carried parameter
        as its initial value (never modified); the rest as for a single call. Returns the results
        like a call does, except that each outfeed is stacked to ``(steps, *shape)`` and each
        carried result holds the values after the last step. The results equal ``steps``
        single calls bitwise: the loop calls the same machine code. With ``steps = 0`` a carried
        result is its initial value and any other result, computed by no step, is NaN (0 for an
        integer result).

        Integer inputs are range-checked here first (``validate=False`` leaves that to the
        native loop, which checks each step before running it). ``stop_on_nan=True`` stops at the
        first NaN or infinite ``nan_check`` result and raises :class:`LoopStopped`.
        """
        loop = self.plan.loop
        if self._loop_fn is None or loop is None:
            raise ValueError("run_steps needs the native loop: compile with opgrad.compile(fn, loop=StepLoop(...))")
        if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 0:
            raise ValueError(f"run_steps: steps must be an int >= 0, got {steps!r}")
        steps = int(steps)
        fn = self.function
        who = "opgrad.compile(...).run_steps"
        if len(arrays) != len(fn.params):
            names = ", ".join(p.name for p in fn.params)
            raise ArgumentError(f"{who}: expected {len(fn.params)} arrays ({names}), got {len(arrays)}")
        streamed = set(loop.streams)
        checked: list[np.ndarray] = []
        for i, (var, a) in enumerate(zip(fn.params, arrays, strict=True)):
            shape = ((steps * var.shape[0], *var.shape[1:]) if var.shape else (steps,)) if i in streamed else var.shape
            arr = a if isinstance(a, np.ndarray) else np.asarray(a)
            if arr.shape != shape or arr.dtype != np.dtype(var.dtype):
                how = f" ({steps} steps of {var.dtype}{list(var.shape)}, batch-major)" if i in streamed else ""
                raise ArgumentError(f"{who}: argument {var.name!r} expects {var.dtype}{list(shape)}{how}, "
                                    f"got {arr.dtype}{list(arr.shape)}")
            if not (arr.flags.c_contiguous and arr.dtype.isnative and arr.flags.aligned):
                arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("="))
            checked.append(arr)
        if validate:
            for check in self._checks:
                _check_range(checked[check.param], check, f"argument {fn.params[check.param].name!r} of run_steps")
        outs: list[np.ndarray] = []
        carried = {r for _, r in loop.carry}
        for r, (shape, dtype) in enumerate(self._result_types):
            if r in loop.outfeeds:
                outs.append(np.empty((steps, *shape), dtype))
            elif steps == 0 and r not in carried:  # no step computed it: NaN (0 for integers), not garbage
                outs.append(np.full(shape, np.nan if np.dtype(dtype).kind == "f" else 0, dtype))
            else:
                outs.append(np.empty(shape, dtype))
        spare = {r: np.array(checked[p], copy=True) for p, r in loop.carry}  # the caller's arrays stay as given
        status = np.zeros(STATUS_WORDS, np.int64)
        with self._lock:
            table = self._table
            for b, arr in zip(self._params, checked, strict=True):
                table[b] = arr.ctypes.data
            for b, arr in zip(self._results, outs, strict=True):
                table[b] = arr.ctypes.data
            for p, r in loop.carry:
                table[self._params[p]] = spare[r].ctypes.data
            code = self._loop_fn(self._table_addr, self._ws_addr, steps, STOP_ON_NAN if stop_on_nan else 0,
                                 status.ctypes.data)
            for p, r in loop.carry:  # the newest values are wherever the parameter slot points now
                if table[self._params[p]] == spare[r].ctypes.data:
                    outs[r] = spare[r]
            if self._calls_host:
                raise_pending()
        result = tuple(outs) if fn.returns_tuple else outs[0]
        if code == LOOP_RANGE:
            step, index, value, k = (int(x) for x in status[1:])
            check = self._checks[k]
            bad = fn.params[check.param]
            per_step = math.prod(bad.shape)
            raise ArgumentError(
                f"{who}: argument {bad.name!r} feeds input {check.input!r} of {check.op} with value {value} at step "
                f"{step} (index {index} of that step, flat index {step * per_step + index}); valid range is "
                f"[{check.low}, {check.high}); no step from {step} on ran"
            )
        if code == LOOP_NAN:
            step = int(status[1])
            for r in loop.outfeeds:
                outs[r] = outs[r][: step + 1]
            raise LoopStopped(
                f"{who}: result {loop.nan_check} is NaN or infinite at step {step}; stopped as asked (stop_on_nan), "
                f"carried values are those before step {step}", step, tuple(outs))
        if code != 0:
            raise RuntimeError(f"{who}: the native loop returned unknown code {code}")
        return result

    def profile(self, *arrays: Any, runs: int = 5, best: bool = False,
                clock: Callable[[], float] = time.perf_counter) -> list[tuple[str, float]]:
        """Median (``best``: fastest) milliseconds of each step, labelled with the op(s) it came from.

        Needs ``opgrad.compile(fn, step_entries=True)``; each step is re-run alone after a full call,
        so it sees warm caches and valid inputs. Use it to find where a graph spends its time; on a
        shared machine the fastest run is the steadier figure (others' jobs only add time), and with
        one thread ``clock=time.thread_time`` leaves out the time other jobs held the core.
        """
        serial, _ = self._step_runs(arrays, runs, clock, parallel=False)
        timings = [1e3 * float(np.min(t) if best else np.median(t)) for t in serial]
        return list(zip(self.step_labels, timings, strict=True))

    def profile_parallel(self, *arrays: Any, runs: int = 5) -> list[tuple[str, float, float]]:
        """``(label, serial ms, parallel ms)`` of each step, the fastest of ``runs``: its time with
        the thread pool's ``nthreads`` shares of every job run one after another on this thread,
        and the time with those shares run in parallel, each as fast as it ran alone
        (:meth:`.threads.ThreadPool.simulate`). It tests how a step splits over more cores than
        the machine has: set ``OPGRAD_NUM_THREADS`` before the pool starts, since the kernels are
        planned and their scratch sized for that many threads. Needs ``step_entries=True``.

        Dispatch cost and contention for shared caches and memory are not in the parallel time,
        so it is an upper bound of the speed-up."""
        serial, parallel = self._step_runs(arrays, runs, time.perf_counter, parallel=True)
        return [(label, 1e3 * min(s), 1e3 * min(p))
                for label, s, p in zip(self.step_labels, serial, parallel, strict=True)]

    def _step_runs(self, arrays: tuple[Any, ...], runs: int, clock: Callable[[], float],
                   parallel: bool) -> tuple[list[list[float]], list[list[float]]]:
        """Each step's seconds re-run alone after each of ``runs`` full calls, and with ``parallel``
        (the pool simulating its shares) each step's simulated parallel seconds."""
        if not self._step_fns:
            raise ValueError("compile with opgrad.compile(fn, step_entries=True) to profile steps")
        if isinstance(runs, bool) or not isinstance(runs, (int, np.integer)) or runs < 1:
            raise ValueError(f"profile: runs must be an int >= 1 (calls timed per step), got {runs!r}")
        threads = pool() if parallel else None
        self._profile = [[] for _ in self._step_fns]
        self._profile_parallel = [[] for _ in self._step_fns] if parallel else None
        self._profile_clock = clock
        if threads is not None:
            threads.simulate(True)
        try:
            for _ in range(runs):
                self(*arrays)
            return self._profile, self._profile_parallel or []
        finally:
            if threads is not None:
                threads.simulate(False)
            self._profile = self._profile_parallel = None

    def __repr__(self) -> str:
        return (f"<CompiledFunction {len(self.function.params)} params -> {len(self._results)} results, "
                f"{self.steps} steps ({self.fused} fused), arena {self.arena_bytes} B, "
                f"compiled in {self.compile_seconds:.3f} s{' (cache hit)' if self.cache_hit else ''}>")


def _describe(fn: Function) -> str:
    """The function in one line: its parameters and the ops of its outputs."""
    params = ", ".join(f"{p.name}: {p.dtype}{list(p.shape)}" for p in fn.params)
    outs = ", ".join(o.op.name if isinstance(o, Call) else type(o).__name__.lower() for o in fn.outputs)
    return f"function ({params}) -> ({outs})"


def _donated(arrays: Sequence[np.ndarray], offered: Sequence[int]) -> set[int]:
    """The indices in ``offered`` whose array may be written: writeable and sharing no memory with
    any other of ``arrays`` (a weight passed twice, or a view of another argument)."""
    spans = sorted((arr.ctypes.data, arr.ctypes.data + arr.nbytes, i) for i, arr in enumerate(arrays) if arr.nbytes)
    overlapping: set[int] = set()
    end, last = -1, -1
    for lo, hi, i in spans:
        if lo < end:
            overlapping.update((i, last))
        if hi > end:
            end, last = hi, i
    return {i for i in offered if arrays[i].flags.writeable and i not in overlapping}


def _aligned(arr: np.ndarray) -> int:
    addr = arr.ctypes.data
    return addr + (-addr) % _ALIGN


def compile(fn: Function, *, step_entries: bool = False, loop: StepLoop | None = None,
            plan_cache: bool | None = None, in_place: Sequence[tuple[int, int]] = ()) -> CompiledFunction:
    """Compile ``fn`` (any Function, including those ``opgrad.grad`` returns) to native code.

    ``step_entries=True`` also exports one entry per step for :meth:`CompiledFunction.profile`;
    ``loop`` adds the native multi-step loop that :meth:`CompiledFunction.run_steps` calls.
    ``plan_cache`` (default: ``$OPGRAD_PLAN_CACHE``, on) loads the plan stored by an earlier
    compile of the same graph here, skipping lowering and IR (:mod:`opgrad.compiler.plancache`);
    False plans afresh, as a check of a patched lowering must. ``in_place``: ``(parameter,
    result)`` index pairs, such as a weight and its update, whose result may be computed in the
    parameter's memory (:mod:`opgrad.compiler.inplace`; with a loop, carried pairs only); the
    compiled function's ``in_place`` lists those the plan allows, and a call with
    ``donate=True`` writes them into the arrays passed.
    """
    if not isinstance(fn, Function):
        raise TypeError(f"opgrad.compile expects an opgrad.Function, got {type(fn).__name__}")
    return CompiledFunction(fn, step_entries, loop, plan_cache, in_place)


__all__ = ["CompiledFunction", "GraphPlan", "StepCost", "compile", "plan_arena", "plan_graph"]
