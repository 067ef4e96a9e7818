"""Sliding-window conv2d kernels for layers with few input taps (an image's first layer).

With ``C * KH * KW`` small (a 3x3 kernel over one or three channels: 9 or 27 taps), the im2col
GEMM spends its time packing and in the per-tile overhead of a reduction only a few steps long.
Here the output is computed where it lies instead: vectors run along an output row, each tap is one
unaligned load of the input row shifted by the tap, and a register tile of ``PV`` such vectors by
``OB`` output channels takes an FMA per tap and channel with the weight broadcast from memory.

* ``forward``: one task per image. Padding is applied by copying the image's planes into a
  zero-bordered plane of the thread's own scratch; without padding the input is read in place. The
  last vector of a row starts at ``OW - VL`` and overlaps the one before: every output is the same
  sum in the same tap order wherever it is computed, so the overlap stores equal values (as does a
  partial channel block, which repeats the last channel). Each output is one FMA chain over the
  taps in (c, kh, kw) order, the im2col GEMM's own order. An epilogue runs on each finished block
  of channels while it is in cache.
* ``backward_weight``: ``dW[o, tap] = sum over (n, h, w) of dY[n, o, h, w] * x[n, c, h + kh, w + kw]``.
  Images are split in groups fixed by the shapes; a group's task adds its images in order into
  its own partial ``O x taps`` sums (each image's lanes added as a fixed tree), and a last task
  adds the groups' partials in order, so the result does not depend on the thread count. The
  overlapping last vector of a row masks its repeated lanes to zero in both factors (a repeated
  infinity must not meet a zero). With a prologue, dY is computed as it is read from the inputs
  of the elementwise step that would have written it (a relu's gradient, ``grad * (y > 0)``),
  and each image's per-channel sum of it (a bias gradient's partials) is stored beside.

Both need stride 1, dilation 1, one group and rows at least one vector wide (:func:`sliding_applies`).
"""

from __future__ import annotations

from collections.abc import Callable

from .conv import Conv2dGeometry, ConvEntry, output_matrix
from .gemm import Epilogue, Operand, call_epilogue, emit_epilogue, round_up
from .irtext import BYTES, LLVM_TYPE, FunctionEmitter, ModuleEmitter, float_const
from .target import current_target
from .views import VectorScalar
from .winograd import emit_guarded_entry, parallel_task, thread_share

__all__ = ["SLIDING_MAX_TAPS", "emit_sliding", "sliding_applies", "vector_lanes"]

#: Taps (``C * KH * KW``) up to which the sliding window replaces the im2col GEMM: a 5x5 kernel over
#: three channels. Measured on AVX2 (AMD EPYC, znver3, 2 threads; forward with bias and relu, then
#: weight gradient, ms): 1 channel 3x3 on 32x28x28 (the seed CNN's first layer) 0.22 -> 0.16 and
#: 0.30 -> 0.14; 3 channels 3x3 pad 1 on 32x32x32 to 64 channels 1.07 -> 0.82 and 1.36 -> 1.08;
#: 3 channels 5x5 on 8x64x64 1.17 -> 1.00 and 1.76 -> 1.29; a 7x7 kernel over three channels (147
#: taps) ran its forward slower (6.7 -> 8.2).
SLIDING_MAX_TAPS = 75
#: Image groups of the weight gradient: each has its own partial sums, added in order at the end.
WEIGHT_GROUPS = 16


def vector_lanes(dtype: str) -> int:
    """Lanes of the vectors the sliding window computes on (the target's widest for ``dtype``)."""
    return current_target().vector_width(BYTES[dtype])


def sliding_applies(g: Conv2dGeometry, pass_: str) -> bool:
    """Whether ``pass_`` of ``g`` runs as a sliding window: the forward or weight-gradient pass of a
    stride-1, undilated, ungrouped convolution with at most :data:`SLIDING_MAX_TAPS` taps whose
    output rows hold a whole vector."""
    return (pass_ in ("forward", "backward_weight") and g.groups == 1 and g.stride == (1, 1)
            and g.dilation == (1, 1) and g.ckk <= SLIDING_MAX_TAPS and g.ow >= vector_lanes(g.dtype)
            and g.n >= 1 and g.o >= 1)


class _Sliding:
    """Shapes, register tile and the shared emission helpers of one sliding-window pass."""

    def __init__(self, mod: ModuleEmitter, g: Conv2dGeometry) -> None:
        self.mod, self.g = mod, g
        self.t = LLVM_TYPE[g.dtype]
        self.esize = BYTES[g.dtype]
        self.vl = vector_lanes(g.dtype)
        self.vt = f"<{self.vl} x {self.t}>"
        self.fma = mod.fma(self.vt)
        top, bottom, left, right = g.pads
        self.padded = any(g.pads)
        self.hp, self.wp = g.h + top + bottom, g.w + left + right
        self.plane = self.hp * self.wp
        #: Vectors per output row, the last one ending at the row's end (overlapping the one before).
        self.vectors = -(-g.ow // self.vl)
        self.taps = [(c, kh, kw) for c in range(g.c) for kh in range(g.kh) for kw in range(g.kw)]

    @property
    def plane_bytes(self) -> int:
        """This thread's zero-bordered copy of an image's planes (none without padding)."""
        return round_up(self.g.c * self.plane * self.esize, 64) if self.padded else 0

    def image_planes(self, f: FunctionEmitter, x: str, image: str, scratch: str) -> str:
        """The image's input planes as rows of ``wp`` elements with the padding around them: ``x``
        itself, or the thread's copy with zero borders."""
        g, t = self.g, self.t
        src = f.gep(t, x, f.mul(image, g.c * g.h * g.w))
        if not self.padded:
            return src
        top, left = g.pads[0], g.pads[2]
        f.call("void", "@llvm.memset.p0.i64", [("ptr", scratch), ("i8", "0"), ("i64", str(self.plane_bytes)),
                                                ("i1", "false")])
        with f.loop(0, g.c * g.h, hint="prow") as row:
            channel, y = f.val(f"udiv i64 {row}, {g.h}"), f.val(f"urem i64 {row}, {g.h}")
            dst = f.add(f.mul(channel, self.plane), f.add(f.mul(f.add(y, top), self.wp), left))
            f.call("void", "@llvm.memcpy.p0.p0.i64", [("ptr", f.gep(t, scratch, dst)),
                                                       ("ptr", f.gep(t, src, f.mul(row, g.w))),
                                                       ("i64", str(g.w * self.esize)), ("i1", "false")])
        return scratch

    def row_vector(self, f: FunctionEmitter, planes: str, tap: tuple[int, int, int], h: str, start: str) -> str:
        """The input vector that tap ``(c, kh, kw)`` meets at output row ``h``, columns ``start ..``."""
        c, kh, kw = tap
        at = f.add(f.add(f.mul(f.add(h, kh), self.wp), c * self.plane + kw), start)
        return f.load(self.vt, f.gep(self.t, planes, at), align=self.esize)

    def keep_lanes(self, f: FunctionEmitter, value: str, keep: str) -> str:
        """``value`` with the lanes where the constant mask ``keep`` is false set to zero."""
        return f.val(f"select <{self.vl} x i1> {keep}, {self.vt} {value}, {self.vt} zeroinitializer", "keep")

    def splat_weight(self, f: FunctionEmitter, w: str, o: str, tap: int) -> str:
        """Weight ``w[o, tap]`` (OIHW, taps flattened) in every lane."""
        return f.splat(self.vl, self.t, f.load(self.t, f.gep(self.t, w, f.add(f.mul(o, self.g.ckk), tap))))

    def accumulate_taps(self, f: FunctionEmitter, accs: list[str], taps: list[int], grad: Callable[[str], str],
                        planes: str, h: str, start: str, keep: str | None, total: str | None = None) -> None:
        """``accs[i] += dY vector * input vector of tap taps[i]`` at output row ``h``, columns
        ``start ..`` (``grad(start)`` gives the dY vector of the row); lanes outside the constant
        mask ``keep`` count zero in both factors. With ``total``, that accumulator adds the dY
        vector too (its per-channel sum, a bias gradient)."""
        vt = self.vt
        dv = grad(start)
        if keep is not None:
            dv = self.keep_lanes(f, dv, keep)
        if total is not None:
            f.store(vt, f.val(f"fadd {vt} {f.load(vt, total)}, {dv}"), total)
        for acc, k in zip(accs, taps, strict=True):
            xv = self.row_vector(f, planes, self.taps[k], h, start)
            if keep is not None:
                xv = self.keep_lanes(f, xv, keep)
            f.store(vt, f.call(vt, self.fma, [(vt, dv), (vt, xv), (vt, f.load(vt, acc))]), acc)


def _forward_task(s: _Sliding, name: str, scratch_stride: int, epilogue_fn: str | None, n_inputs: int) -> str:
    g, t, vt, vl = s.g, s.t, s.vt, s.vl
    regs = current_target().vector_registers
    pv = 2 if s.vectors > 1 else 1
    # As many channels as the accumulators allow, spread evenly over the blocks that takes: a
    # last block short of channels would compute copies of the last one (32 channels in blocks
    # of 14 computed 42).
    blocks = -(-g.o // max(1, min(g.o, (regs - pv - 2) // pv)))
    ob = -(-g.o // blocks)
    pairs = -(-s.vectors // pv)
    f, (x, w, y, scratch, *inputs), tid, nt = parallel_task(s.mod, name, 4 + n_inputs)
    lo, hi = thread_share(f, tid, nt, g.n)
    own = f.gep("i8", scratch, f.mul(tid, scratch_stride))
    p = g.oh * g.ow
    with f.loop(lo, hi, hint="img") as image:
        planes = s.image_planes(f, x, image, own)
        with f.loop(0, blocks, hint="ob") as block:
            o0 = f.mul(block, ob)
            channels = [f.smin(f.add(o0, j), g.o - 1) for j in range(ob)]
            outs = [f.gep(t, y, f.mul(f.add(f.mul(image, g.o), o), p)) for o in channels]
            with f.loop(0, g.oh, hint="oh") as h, f.loop(0, pairs, hint="pair") as pair:
                cols = [f.smin(f.mul(f.add(f.mul(pair, pv), i), vl), g.ow - vl) for i in range(pv)]
                accs = [["zeroinitializer"] * ob for _ in cols]
                for k, tap in enumerate(s.taps):
                    xs = [s.row_vector(f, planes, tap, h, start) for start in cols]
                    for j, o in enumerate(channels):
                        wv = s.splat_weight(f, w, o, k)
                        for i, xv in enumerate(xs):
                            accs[i][j] = f.call(vt, s.fma, [(vt, xv), (vt, wv), (vt, accs[i][j])])
                row = f.mul(h, g.ow)
                for i, start in enumerate(cols):
                    for j in range(ob):
                        f.store(vt, accs[i][j], f.gep(t, outs[j], f.add(row, start)), align=s.esize)
            if epilogue_fn is not None:
                valid = f.smin(f.sub(str(g.o), o0), ob)
                call_epilogue(f, epilogue_fn, y, inputs, f.add(f.mul(image, g.o), o0), valid, "0", str(p))
    f.ret_void()
    f.finish()
    return name


def _weight_task(s: _Sliding, name: str, scratch_stride: int, groups: int, prologue: Epilogue | None,
                 sums: bool) -> str:
    """The groups' partial sums of dW; dY is ``prologue`` applied to its memory inputs where there
    is one, and with ``sums`` each image's per-channel sum of dY is stored too."""
    g, t, vt, vl = s.g, s.t, s.vt, s.vl
    regs = current_target().vector_registers
    per_pass = max(1, regs - 4 - int(sums))
    n_inputs = len(prologue.operands) if prologue is not None else 1
    f, pointers, tid, nt = parallel_task(s.mod, name, 3 + n_inputs + int(sums))
    x, partials, scratch, grads = pointers[0], pointers[1], pointers[2], pointers[3 : 3 + n_inputs]
    image_sums = pointers[-1] if sums else ""
    lo, hi = thread_share(f, tid, nt, groups)
    own = f.gep("i8", scratch, f.mul(tid, scratch_stride))
    taps = len(s.taps)
    whole = g.ow // vl  # vectors at 0, VL, 2 VL, ...
    tail = g.ow - vl if g.ow % vl else None
    # Lanes of the overlapping last vector that the whole vectors before it already counted.
    repeated = whole * vl - (g.ow - vl)
    keep = "<" + ", ".join(f"i1 {'true' if lane >= repeated else 'false'}" for lane in range(vl)) + ">"
    reduce_fn = s.mod.intrinsic("vector.reduce.fadd", t, [t, vt], f"v{vl}{'f32' if t == 'float' else 'f64'}")
    with f.loop(lo, hi, hint="grp") as group:
        first = f.val(f"udiv i64 {f.mul(group, g.n)}, {groups}")
        last = f.val(f"udiv i64 {f.mul(f.add(group, 1), g.n)}, {groups}")
        part = f.gep(t, partials, f.mul(group, g.o * taps))
        f.call("void", "@llvm.memset.p0.i64", [("ptr", part), ("i8", "0"), ("i64", str(g.o * taps * s.esize)),
                                                ("i1", "false")])
        with f.loop(first, last, hint="img") as image:
            planes = s.image_planes(f, x, image, own)
            with f.loop(0, g.o, hint="o") as o:
                plane = f.mul(f.add(f.mul(image, g.o), o), g.oh * g.ow)
                for t0 in range(0, taps, per_pass):
                    chunk = list(range(t0, min(taps, t0 + per_pass)))
                    accs = [f.var(vt, "zeroinitializer", "wacc") for _ in chunk]
                    total = f.var(vt, "zeroinitializer", "dysum") if sums and t0 == 0 else None
                    with f.loop(0, g.oh, hint="oh") as h:
                        rows = [f.gep(t, ptr, f.add(plane, f.mul(h, g.ow))) for ptr in grads]
                        grad = _grad_vectors(s, f, rows, prologue)
                        with f.loop(0, whole, hint="vec") as v:
                            s.accumulate_taps(f, accs, chunk, grad, planes, h, f.mul(v, vl), None, total)
                        if tail is not None:
                            s.accumulate_taps(f, accs, chunk, grad, planes, h, str(tail), keep, total)
                    # The lanes add as a tree (reassoc): a fixed order, log2(VL) shuffles and adds
                    # deep; in lane order they were a chain of VL dependent adds, a fifth of the
                    # pass on AVX-512.
                    def lane_sum(vector: str) -> str:
                        return f.call(t, reduce_fn, [(t, float_const(-0.0, t)), (vt, f.load(vt, vector))],
                                      flags="reassoc")

                    for acc, k in zip(accs, chunk, strict=True):
                        slot = f.gep(t, part, f.add(f.mul(o, taps), k))
                        f.store(t, f.val(f"fadd {t} {f.load(t, slot)}, {lane_sum(acc)}"), slot)
                    if total is not None:
                        f.store(t, lane_sum(total), f.gep(t, image_sums, f.add(f.mul(image, g.o), o)))
    f.ret_void()
    f.finish()
    return name


def _grad_vectors(s: _Sliding, f: FunctionEmitter, rows: list[str], prologue: Epilogue | None) -> Callable[[str], str]:
    """The dY vector at a column of one output row: loaded from ``rows[0]``, or ``prologue``'s
    body over its inputs' vectors there (``rows``: each memory input's row, laid out as dY)."""
    def load(row: str, start: str) -> str:
        return f.load(s.vt, f.gep(s.t, row, start), align=s.esize)

    if prologue is None:
        return lambda start: load(rows[0], start)
    vector = VectorScalar(f, s.g.dtype, s.vl)

    def value(start: str) -> str:
        memory = iter(rows)
        values = [load(next(memory), start) if isinstance(x, Operand) else vector.const(x) for x in prologue.inputs]
        return prologue.body(vector, values)

    return value


def _weight_sum_task(s: _Sliding, name: str, groups: int) -> str:
    """``dW = ((P0 + P1) + P2) + ...`` over the groups' partials, split over the weights."""
    g, t = s.g, s.t
    total = g.o * g.ckk
    f, (partials, dw), tid, nt = parallel_task(s.mod, name, 2, pipeline="lean")
    lo, hi = thread_share(f, tid, nt, total)
    with f.loop(lo, hi, hint="wi") as i:
        acc = f.load(t, f.gep(t, partials, i))
        for group in range(1, groups):
            acc = f.val(f"fadd {t} {acc}, {f.load(t, f.gep(t, partials, f.add(i, group * total)))}")
        f.store(t, acc, f.gep(t, dw, i))
    f.ret_void()
    f.finish()
    return name


def emit_sliding(mod: ModuleEmitter, g: Conv2dGeometry, pass_: str, name: str,
                 epilogue: Epilogue | None = None, prologue: Epilogue | None = None, sums: bool = False) -> ConvEntry:
    """``name(x, w, y, e..., ws)`` (forward, then ``epilogue`` on y seen as (image, channel) x pixel)
    or ``name(x, dy, dw, ws)`` (backward_weight) as a sliding window; see the module docstring.

    The weight gradient with a ``prologue`` computes dY as its body over its memory inputs (each
    laid out as dY): ``name(x, p0, dw, p1, ..., ws)``, and with ``sums`` it also writes each
    image's per-channel sum of dY, ``(N, O)`` row-major, to one more pointer after them."""
    assert sliding_applies(g, pass_), f"{pass_} of {g.describe()} is not a sliding-window pass"
    s = _Sliding(mod, g)
    scratch_stride = s.plane_bytes
    if pass_ == "forward":
        inputs = [ptr for _, ptr in epilogue.pointers] if epilogue else []
        epilogue_fn = None
        if epilogue is not None:
            epilogue_fn = name + ".epilogue"
            emit_epilogue(mod, epilogue_fn, output_matrix(g.n, g.o, g.oh * g.ow), epilogue, g.dtype)
        task = _forward_task(s, name + ".images", scratch_stride, epilogue_fn, len(inputs))
        return emit_guarded_entry(mod, name, ("x", "w", "y", *inputs), 0, scratch_stride,
                                  [(task, ["x", "w", "y", "scratch", *inputs])], [])
    assert epilogue is None, "the weight gradient takes no epilogue"
    assert prologue is not None or not sums, "the per-channel sums come with a prologue"
    groups = min(g.n, WEIGHT_GROUPS)
    partial_bytes = round_up(groups * g.o * g.ckk * s.esize, 64)
    grads = [f"p{i}" for i in range(len(prologue.operands))] if prologue is not None else ["dy"]
    extra = [*grads[1:], *(["sums"] if sums else [])]
    task = _weight_task(s, name + ".groups", scratch_stride, groups, prologue, sums)
    phases = [(task, ["x", "shared", "scratch", *grads, *(["sums"] if sums else [])]),
              (_weight_sum_task(s, name + ".sum", groups), ["shared", "dw"])]
    return emit_guarded_entry(mod, name, ("x", grads[0], "dw", *extra), partial_bytes, scratch_stride, phases, [])
