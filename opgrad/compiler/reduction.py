"""Reduction loops: a map-reduce step (``KernelBuilder.map_reduce``) as native loops.

The kept axes run outermost and the reduced axes inside them, each group merged into as few
loops as its memory layout allows. Where the innermost reduced run is contiguous in every input
(a channel's pixels in NCHW, a row's features), it is read by whole vectors into a few vector
accumulators, the run's last part under a lane mask, and the accumulators carry across the
outer reduced loops, so one output element is one lane-wise sum folded to a scalar once. LLVM's
loop vectorizer does not do that on its own: it folds its vectors into the scalar after every
inner run, and where a run is shorter than its interleaved vector body (a 7 x 7 plane is 49
elements, its body 64) it runs the whole run in the scalar remainder loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from .gemm import masked_load
from .irtext import BYTES, LLVM_TYPE, FunctionEmitter, prefix_mask
from .target import current_target
from .views import CONSTANT, IOTA, Scalar, VectorScalar, body_vectorizes, collapse, load

if TYPE_CHECKING:  # the builder imports this module; the type is all this one needs of it
    from .builder import Step

#: The shortest innermost run read by vectors: below it the scalar loop is as fast.
VECTOR_RUN_MIN = 8
#: Vector accumulators of a long run: enough independent adds to hide the add latency.
VECTOR_ACCUMULATORS = 4
#: A sum's accumulators take this many rounds (one vector each) before they are added into the
#: next level's and restart from zero; :data:`CASCADE_LEVELS` levels in all. Each lane then adds
#: at most about this many terms per level, so the rounding error grows with the levels, not with
#: the element count (numpy's pairwise sum has the same property): summing 2**24 copies of 0.1f
#: sequentially per lane drifts by 2.5e-3 of the total.
CASCADE_ROUNDS = 16
CASCADE_LEVELS = 5

_INIT = {"sum": 0.0, "max": -math.inf, "min": math.inf}


def loop_runs(dims: list[int], shape: tuple[int, ...],
              strides: list[tuple[int, ...]]) -> list[tuple[int, list[int]]]:
    """Loops ``(extent, stride per view)`` over ``dims`` in order, dims contiguous in every view
    merged into one (:func:`collapse`; a single loop of extent 1 when there are none)."""
    extents, per_view = collapse(tuple(shape[d] for d in dims), [tuple(v[d] for d in dims) for v in strides])
    return [(extent, list(run)) for extent, run in zip(extents, zip(*per_view, strict=True), strict=True)]


def emit_reduction(f: FunctionEmitter, st: Step, ptrs: dict[int, str], base: list[str], first_dim: int,
                   by_vectors: bool = True) -> int:
    """Emit reduction step ``st`` into ``f`` over its axes from ``first_dim`` on (``base``: each
    view's offset, ``ptrs``: each memory view's pointer, by position in ``[out, *inputs]``);
    returns the extent of its outermost kept run, which runs over ``[%lo, %hi)`` when
    ``first_dim`` is 0 (axes before ``first_dim`` are kept and fixed by ``base``);
    ``by_vectors=False`` keeps the scalar loop.

    Where every view is contiguous along the innermost kept run (a column sum, the batch sum
    of a bias gradient), the kept run is the innermost loop: each reduced row is added into
    the output, one vectorized pass over contiguous memory, every output element summed in
    row order. Otherwise the reduced runs are innermost and each output element is one loop's
    result: by vectors where the innermost reduced run is contiguous (:func:`reduces_by_vectors`),
    else a scalar loop with reassociation allowed, so that LLVM may vectorize it.
    """
    out = st.out
    assert out is not None
    shape = st.inputs[0].shape
    keep = [d for d in range(len(shape)) if d not in st.axes]
    views = [out, *st.inputs]
    mem = [i for i, v in enumerate(views) if v.is_memory]
    init = _INIT[st.op]
    strides = _strides_over_input(st)
    kept = loop_runs([d for d in keep if d >= first_dim], shape, strides)
    reduced = loop_runs(list(st.axes), shape, strides)
    split = first_dim == 0
    t = LLVM_TYPE[out.dtype]
    s = Scalar(f, out.dtype)

    def combine(cur: str, v: str, reassociate: bool) -> str:
        if st.op != "sum":
            return str(getattr(s, st.op)(cur, v))
        return s.accumulate(cur, v) if reassociate else s.add(cur, v)

    def values(offs: list[str]) -> str:
        return st.body(s, [load(s, v, ptrs.get(i + 1), offs[i + 1]) for i, v in enumerate(st.inputs)])

    def nest(runs: list[tuple[int, list[int]]], offs: list[str], body: Callable[[list[str]], None],
             hint: str, split: bool = False) -> None:
        """Loops over ``runs`` (the first over ``[lo, hi)`` when ``split``), then ``body(offsets)``."""
        if not runs:
            body(offs)
            return
        (extent, run_strides), rest = runs[0], runs[1:]
        lo, hi = ("%lo", "%hi") if split else ("0", str(extent))
        with f.loop(lo, hi, hint=hint) as i:
            nest(rest, [f.add(o, f.mul(i, d)) for o, d in zip(offs, run_strides, strict=True)], body, hint)

    vertical = all(kept[-1][1][i] == 1 for i in mem) and kept[-1][0] > 1

    def vertical_rows(offs: list[str]) -> None:
        """The innermost kept run: out = init; out = op(out, row) for each reduced row; scale."""
        extent, run_strides = kept[-1]
        lo, hi = ("%lo", "%hi") if split and len(kept) == 1 else ("0", str(extent))

        def along(row: list[str], body: Callable[[list[str], str], None]) -> None:
            with f.loop(lo, hi, hint="v") as j:
                at = [f.add(o, f.mul(j, d)) for o, d in zip(row, run_strides, strict=True)]
                body(at, f.gep(t, ptrs[0], at[0]))

        along(offs, lambda _, at: f.store(t, s.const(init), at))
        nest(reduced, offs, lambda row: along(
            row, lambda o, at: f.store(t, combine(f.load(t, at), values(o), False), at)), "r")
        if st.scale != 1.0:
            along(offs, lambda _, at: f.store(t, s.mul(f.load(t, at), s.const(st.scale)), at))

    lanes = current_target().vector_width(BYTES[out.dtype])
    by_vectors = by_vectors and reduces_by_vectors(st)

    def horizontal(offs: list[str]) -> None:
        """One output element: op over the reduced runs, innermost."""
        if by_vectors:
            res = _reduce_by_vectors(f, st, ptrs, reduced, offs, lanes)
        else:
            acc = f.alloca(t, "acc")
            f.store(t, s.const(init), acc)
            nest(reduced, offs, lambda o: f.store(t, combine(f.load(t, acc), values(o), True), acc), "r")
            res = f.load(t, acc)
        if st.scale != 1.0:
            res = s.mul(res, s.const(st.scale))
        f.store(t, res, f.gep(t, ptrs[0], offs[0]))

    if vertical:
        nest(kept[:-1], base, vertical_rows, "o", split=split and len(kept) > 1)
    else:
        nest(kept, base, horizontal, "o", split=split)
    return kept[0][0]


def _strides_over_input(st: Step) -> list[tuple[int, ...]]:
    """Each view's strides of ``[out, *inputs]`` over the input's axes (0 along reduced axes for
    the output)."""
    out = st.out
    assert out is not None
    shape = st.inputs[0].shape
    keep = [d for d in range(len(shape)) if d not in st.axes]
    return [tuple(out.strides[keep.index(d)] if d in keep else 0 for d in range(len(shape))),
            *(v.strides for v in st.inputs)]


def reduces_by_vectors(st: Step) -> bool:
    """Whether reduction ``st``'s innermost reduced run is read by the host's vectors: long
    enough, every input of the output's float type read along it contiguously or as one broadcast
    value (stride 0), and a body with a vector form. Its loops then need no vectorizer."""
    out = st.out
    assert out is not None
    lanes = current_target().vector_width(BYTES[out.dtype])
    extent, run_strides = loop_runs(list(st.axes), st.inputs[0].shape, _strides_over_input(st))[-1]
    if extent < VECTOR_RUN_MIN or out.dtype not in ("float32", "float64") or lanes < 2:
        return False
    for v, stride in zip(st.inputs, run_strides[1:], strict=True):
        if v.buffer == IOTA or (v.is_memory and (v.dtype != out.dtype or stride not in (0, 1))):
            return False
    return body_vectorizes(st.body, out.dtype, lanes, len(st.inputs))


def _reduce_by_vectors(f: FunctionEmitter, st: Step, ptrs: dict[int, str], reduced: list[tuple[int, list[int]]],
                       offs: list[str], lanes: int) -> str:
    """``st``'s op over its reduced runs from offsets ``offs``, the innermost run by vectors
    (:func:`reduces_by_vectors`); returns the scalar result.

    The run's whole vectors go round-robin to up to :data:`VECTOR_ACCUMULATORS` accumulators, its
    last part to the first one (lanes past the run hold the op's identity); the accumulators are
    then combined in order and their lanes folded by halves. A sum of more than
    :data:`CASCADE_ROUNDS` rounds cascades: every that many rounds the accumulators are added
    into a second set and cleared, and so on up the levels. The order depends only on the
    shapes, so every thread count gives the same bits."""
    out = st.out
    assert out is not None
    v = VectorScalar(f, out.dtype, lanes)
    elem = v.element
    esize = BYTES[out.dtype]
    init = v.const(_INIT[st.op])
    extent, run_strides = reduced[-1]
    full, rest = divmod(extent, lanes)
    count = max(1, min(VECTOR_ACCUMULATORS, full))
    accs = [f.var(v.t, init, "vacc") for _ in range(count)]
    rounds_per_run = full // count + (1 if full % count or rest else 0)
    cascades = st.op == "sum" and math.prod(n for n, _ in reduced[:-1]) * rounds_per_run > CASCADE_ROUNDS
    # levels[0] is ``accs``; each higher level has its round counter.
    levels = [accs] + ([[f.var(v.t, init, "vsum") for _ in range(count)] for _ in range(CASCADE_LEVELS - 1)]
                       if cascades else [])
    counters = [f.var("i64", "0", "rounds") for _ in levels[:-1]]

    def combine(a: str, b: str) -> str:
        return v.accumulate(a, b) if st.op == "sum" else str(getattr(v, st.op)(a, b))

    def counted(level: int) -> None:
        """One more round into ``levels[level]``: after :data:`CASCADE_ROUNDS` of them, add them
        into the next level and clear them (the top level takes every round)."""
        if level + 1 >= len(levels):
            return
        n = f.add(f.load("i64", counters[level]), 1)
        f.store("i64", n, counters[level])
        with f.if_then(f.icmp("eq", n, CASCADE_ROUNDS), "cascade"):
            f.store("i64", "0", counters[level])
            for low, high in zip(levels[level], levels[level + 1], strict=True):
                f.store(v.t, combine(f.load(v.t, high), f.load(v.t, low)), high)
                f.store(v.t, init, low)
            counted(level + 1)

    def chunk(row: list[str], start: str, acc: str, valid: int) -> None:
        """Fold ``valid`` elements of the run from element ``start`` into accumulator ``acc``."""
        mask = prefix_mask(lanes, valid)
        values = []
        for i, view in enumerate(st.inputs):
            if not view.is_memory:
                assert view.buffer == CONSTANT, "an index input keeps the scalar loop"
                values.append(v.const(view.constant))
                continue
            if run_strides[i + 1] == 0:
                values.append(f.splat(lanes, elem, f.load(elem, f.gep(elem, ptrs[i + 1], row[i + 1]))))
                continue
            at = f.gep(elem, ptrs[i + 1], f.add(row[i + 1], start))
            if valid == lanes:
                values.append(f.load(v.t, at, align=esize))
            else:
                values.append(f.call(v.t, masked_load(f.module, lanes, elem),
                                     [("ptr", at), ("i32", str(esize)), (f"<{lanes} x i1>", mask), (v.t, "poison")]))
        value = st.body(v, values)
        if valid < lanes:
            value = v.select(mask, value, init)
        f.store(v.t, combine(f.load(v.t, acc), value), acc)

    def run(row: list[str]) -> None:
        rounds, extra = divmod(full, count)
        if rounds:
            with f.loop(0, rounds, hint="vr") as r:
                first = f.mul(r, count * lanes)
                for k, acc in enumerate(accs):
                    chunk(row, f.add(first, k * lanes), acc, lanes)
                counted(0)
        for k in range(extra):
            chunk(row, str((rounds * count + k) * lanes), accs[k], lanes)
        if rest:
            chunk(row, str(full * lanes), accs[0], rest)
        if extra or rest:
            counted(0)

    def nest(runs: list[tuple[int, list[int]]], row: list[str]) -> None:
        if not runs:
            run(row)
            return
        (n, run_step), inner = runs[0], runs[1:]
        with f.loop(0, n, hint="r") as i:
            nest(inner, [f.add(o, f.mul(i, d)) for o, d in zip(row, run_step, strict=True)])

    nest(reduced[:-1], offs)
    # Each accumulator's levels from the top down, then the accumulators in order.
    sums = []
    for k in range(count):
        part = f.load(v.t, levels[-1][k])
        for level in reversed(levels[:-1]):
            part = combine(part, f.load(v.t, level[k]))
        sums.append(part)
    total = sums[0]
    for part in sums[1:]:
        total = combine(total, part)
    width = lanes
    while width > 1:
        width //= 2
        half = VectorScalar(f, out.dtype, width)
        vt = f"<{2 * width} x {elem}>"
        low = f.val(f"shufflevector {vt} {total}, {vt} poison, <{width} x i32> "
                    f"<{', '.join(f'i32 {i}' for i in range(width))}>", "lo")
        high = f.val(f"shufflevector {vt} {total}, {vt} poison, <{width} x i32> "
                     f"<{', '.join(f'i32 {i}' for i in range(width, 2 * width))}>", "hi")
        total = half.accumulate(low, high) if st.op == "sum" else str(getattr(half, st.op)(low, high))
    return f.val(f"extractelement <1 x {elem}> {total}, i32 0", "red")
