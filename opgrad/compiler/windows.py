"""Pooling primitives for :class:`~opgrad.compiler.builder.KernelBuilder`: window reductions over
NCHW views, the argmax gather, and the scatter (adjoint) of both.

Each primitive is one loop over the ``N*C`` planes, split over threads by planes, so every output
element is written by exactly one thread in a fixed order (deterministic for any thread count;
overlapping windows of a scatter stay inside one plane). Inside a plane the loops are plain
``for`` nests; when there is no padding the bounds checks are omitted at compile time, which is
what lets LLVM vectorize the common non-overlapping 2x2 case.

Semantics follow ``registry/_pooling.py`` (PyTorch's): padding never wins a max (it is skipped),
counts as zero in an average whose divisor is ``kh*kw`` or, with ceil mode or without
``count_include_pad``, the window clipped as PyTorch clips it, and ties go to the first maximum in
row-major window order. A ceil-mode window that overhangs the input is bounds-checked like padding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .gemm import masked_load, masked_store
from .irtext import BYTES, LLVM_TYPE, FunctionEmitter, concatenate, prefix_mask
from .target import current_target
from .views import Scalar, VectorScalar, View, elem_type

if TYPE_CHECKING:  # the builder imports this module; the type is all this one needs of it
    from .builder import KernelBuilder


@dataclass(frozen=True)
class Window2d:
    """Pool window ``(kh, kw)``, strides ``(sh, sw)``, symmetric padding ``(ph, pw)``, PyTorch's
    ``ceil_mode`` and (averages only) ``count_include_pad``."""

    pool: tuple[int, int]
    strides: tuple[int, int]
    padding: tuple[int, int]
    ceil_mode: bool = False
    count_include_pad: bool = True

    def out_hw(self, h: int, w: int) -> tuple[int, int]:
        def size(n: int, k: int, s: int, p: int) -> int:
            out = (n + 2 * p - k + (s - 1 if self.ceil_mode else 0)) // s + 1
            return out - 1 if self.ceil_mode and (out - 1) * s >= n + p else out

        (kh, kw), (sh, sw), (ph, pw) = self.pool, self.strides, self.padding
        return size(h, kh, sh, ph), size(w, kw, sw, pw)

    def overhangs(self, hw: tuple[int, ...]) -> bool:
        """Whether some window reaches outside the input (padding or a ceil-mode overhang)."""
        out = self.out_hw(hw[0], hw[1])
        return any(self.padding) or any((out[i] - 1) * self.strides[i] + self.pool[i] > hw[i] for i in range(2))

    def constant_divisor(self, hw: tuple[int, ...]) -> bool:
        """Whether every window of an average divides by ``kh*kw``."""
        if not self.count_include_pad:
            return not self.overhangs(hw)
        out = self.out_hw(hw[0], hw[1])
        return all((out[i] - 1) * self.strides[i] + self.pool[i] <= hw[i] + 2 * self.padding[i] for i in range(2))


class _Planes:
    """Scaffolding shared by the primitives: one function over planes ``[lo, hi)`` of 4-D views."""

    def __init__(self, kb: KernelBuilder, kind: str, views: list[View]) -> None:
        self.kb, self.views = kb, [v if v.is_memory else kb.contiguous(v) for v in views]
        self.name = kb.fresh(kind)
        self.f: FunctionEmitter = kb.loop_function(self.name, len(views))
        self.s = Scalar(self.f, views[0].dtype)
        self.channels = views[0].shape[1]

    def planes(self) -> list[str]:
        """Open the plane loop; returns each view's base pointer for the current (n, c) plane."""
        f = self.f
        self._loop = f.loop("%lo", "%hi", hint="pl")
        plane = self._loop.__enter__()
        n = f.val(f"udiv i64 {plane}, {self.channels}")
        c = f.val(f"urem i64 {plane}, {self.channels}")
        bases = []
        for i, v in enumerate(self.views):
            off = f.add(f.add(f.mul(n, v.strides[0]), f.mul(c, v.strides[1])), v.offset)
            bases.append(f.gep(elem_type(v.dtype), f"%p{i}", off))
        return bases

    def close(self) -> None:
        self._loop.__exit__(None, None, None)
        self.f.ret_void()
        self.f.finish()
        out, reads = self.views[0], self.views[1:]
        work = max(v.size for v in self.views)
        self.kb.add_parallel(self.name, [v.buffer for v in self.views], out.shape[0] * out.shape[1], work,
                             [v.buffer for v in reads], [out.buffer])

    def at(self, base: str, v: View, h: str, w: str) -> str:
        """Pointer to element (h, w) of the plane of ``v`` starting at ``base``."""
        f = self.f
        return f.gep(LLVM_TYPE[v.dtype], base, f.add(f.mul(h, v.strides[2]), f.mul(w, v.strides[3])))


def _taps(p: _Planes, win: Window2d, hw: tuple[int, ...], oh: str, ow: str,
          visit: Callable[[str, str], None]) -> None:
    """Call ``visit(h, w)`` for each in-bounds tap of window (oh, ow), in row-major order."""
    f = p.f
    (kh, kw), (sh, sw), (ph, pw) = win.pool, win.strides, win.padding
    checked = win.overhangs(hw)
    with f.loop(0, kh, hint="ki") as ki, f.loop(0, kw, hint="kj") as kj:
        h = f.add(f.mul(oh, sh), f.sub(ki, ph) if ph else ki)
        w = f.add(f.mul(ow, sw), f.sub(kj, pw) if pw else kj)
        if checked:
            ok = f.val(f"and i1 {f.icmp('ult', h, hw[0])}, {f.icmp('ult', w, hw[1])}")
            with f.if_then(ok, "tap"):
                visit(h, w)
        else:
            visit(h, w)


def _argmax(p: _Planes, data: View, base: str, win: Window2d, oh: str, ow: str) -> tuple[str, str]:
    """(h, w) of the first maximum of window (oh, ow) of ``data``; padding is skipped."""
    f, s = p.f, p.s
    best = f.var(s.t, s.const(float("-inf")), "best")
    bh, bw, seen = f.var("i64", "0", "bh"), f.var("i64", "0", "bw"), f.var("i1", "false", "seen")

    def visit(h: str, w: str) -> None:
        v = f.load(s.t, p.at(base, data, h, w))
        first = f.val(f"xor i1 {f.load('i1', seen)}, true")
        # As np.argmax: a NaN is the maximum and the first NaN wins ("ugt" is true for a NaN v).
        cur = f.load(s.t, best)
        beats = f.val(f"and i1 {s.cmp('ugt', v, cur)}, {s.cmp('ord', cur, cur)}")
        better = f.val(f"or i1 {beats}, {first}")
        # Selects, not a branch: which tap wins is data, and a mispredicted branch per tap made the
        # keras-mnist step's max_pool2d_backward 23 % of the step.
        f.store(s.t, f.select(better, s.t, v, cur), best)
        f.store("i64", f.select(better, "i64", h, f.load("i64", bh)), bh)
        f.store("i64", f.select(better, "i64", w, f.load("i64", bw)), bw)
        f.store("i1", "true", seen)

    _taps(p, win, data.shape[2:], oh, ow, visit)
    return f.load("i64", bh), f.load("i64", bw)


def _divisor(p: _Planes, win: Window2d, hw: tuple[int, ...], oh: str, ow: str) -> str | None:
    """The average's divisor of window (oh, ow) as a float, or None when it is ``kh*kw`` for every window.

    As PyTorch: the window clipped to the padded input, and also to the input itself without
    ``count_include_pad``.
    """
    if win.constant_divisor(hw):
        return None
    f, s = p.f, p.s
    counts = []
    for o, k, st, pad, n in zip((oh, ow), win.pool, win.strides, win.padding, hw, strict=True):
        start = f.sub(f.mul(o, st), pad)
        end = f.smin(f.add(start, k), n + pad)
        if not win.count_include_pad:
            start = f.select(f.icmp("slt", start, "0"), "i64", "0", start)
            end = f.smin(end, n)
        counts.append(f.sub(end, start))
    return f.val(f"sitofp i64 {f.mul(counts[0], counts[1])} to {s.t}")


def pool2d(kb: KernelBuilder, out: View, data: View, win: Window2d, op: str) -> None:
    """``out[n,c,oh,ow]`` = max or mean (``op`` = ``max`` | ``avg``) of each window of ``data``."""
    p = _Planes(kb, "pool", [out, data])
    out, data = p.views
    f, s = p.f, p.s
    pout, pin = p.planes()
    scale = 1.0 / (win.pool[0] * win.pool[1])
    if _pool_rows_vectorized(p, out, data, win, op, pout, pin):
        p.close()
        return
    with f.loop(0, out.shape[2], hint="oh") as oh, f.loop(0, out.shape[3], hint="ow") as ow:
        acc = f.var(s.t, s.const(float("-inf") if op == "max" else 0.0), "acc")

        def visit(h: str, w: str) -> None:
            v = f.load(s.t, p.at(pin, data, h, w))
            cur = f.load(s.t, acc)
            f.store(s.t, s.max(cur, v) if op == "max" else s.add(cur, v), acc)

        _taps(p, win, data.shape[2:], oh, ow, visit)
        res = f.load(s.t, acc)
        if op == "avg":
            divisor = _divisor(p, win, data.shape[2:], oh, ow)
            res = s.mul(res, s.const(scale)) if divisor is None else s.div(res, divisor)
        f.store(s.t, res, p.at(pout, out, oh, ow))
    p.close()


def _pool_rows_vectorized(p: _Planes, out: View, data: View, win: Window2d, op: str, pout: str, pin: str) -> bool:
    """The windows of every output row, ``VL`` output columns at a time, where windows sit side
    by side along a row (stride = width) inside the input and rows are contiguous; False (nothing
    emitted) where this does not apply.

    One wide load of ``kw * VL`` input columns holds ``VL`` windows' columns; window column ``j``
    of them is every ``kw``-th lane from ``j``. A row's last, shorter piece loads and stores under
    a lane mask. The sums run in the scalar loop's order, so the results are the same bits.
    LLVM's own vectorizer sees the strided reads of the scalar loop and keeps it scalar: measured
    on AMD Zen 5, the seed CNN's 2x2 average pool read 24 GB/s that way, a fifth of what a copy
    reaches."""
    (kh, kw), (sh, sw) = win.pool, win.strides
    esize = BYTES[out.dtype]
    vl = current_target().vector_width(esize)
    if win.overhangs(data.shape[2:]) or sw != kw or data.strides[3] != 1 or out.strides[3] != 1:
        return False
    f = p.f
    v = VectorScalar(f, out.dtype, vl)
    t = p.s.t
    wide = f"<{kw * vl} x {t}>"
    full, rest = divmod(out.shape[3], vl)

    def windows(oh: str, col: str, lanes: int) -> None:
        acc = v.const(float("-inf") if op == "max" else 0.0)
        for ki in range(kh):
            ptr = p.at(pin, data, f.add(f.mul(oh, sh), ki), f.mul(col, kw))
            if lanes == vl:
                window_cols = f.load(wide, ptr, align=esize)
            else:
                mask = prefix_mask(kw * vl, kw * lanes)
                window_cols = f.call(wide, masked_load(f.module, kw * vl, t),
                                     [("ptr", ptr), ("i32", str(esize)), (f"<{kw * vl} x i1>", mask), (wide, "poison")])
            for kj in range(kw):
                picks = ", ".join(f"i32 {i * kw + kj}" for i in range(vl))
                column = f.val(f"shufflevector {wide} {window_cols}, {wide} poison, <{vl} x i32> <{picks}>", "wc")
                acc = v.max(acc, column) if op == "max" else v.add(acc, column)
        if op == "avg":
            acc = v.mul(acc, v.const(1.0 / (kh * kw)))
        ptr = p.at(pout, out, oh, col)
        if lanes == vl:
            f.store(v.t, acc, ptr, align=esize)
        else:
            f.call("void", masked_store(f.module, vl, t),
                   [(v.t, acc), ("ptr", ptr), ("i32", str(esize)), (f"<{vl} x i1>", prefix_mask(vl, lanes))])

    with f.loop(0, out.shape[2], hint="voh") as oh:
        if full:
            with f.loop(0, full, hint="vow") as chunk:
                windows(oh, f.mul(chunk, vl), vl)
        if rest:
            windows(oh, str(full * vl), rest)
    return True


def _argmax_scatter_vectorized(p: _Planes, out: View, grad: View, data: View, win: Window2d, pout: str,
                               pgrad: str, pdata: str) -> bool:
    """max_pool2d's gradient where the windows tile the input (strides = pool size, inside it,
    rows contiguous): each input element lies in one window, so it is ``grad`` where it is its
    window's first maximum and 0 elsewhere, written once, ``VL`` windows of a row at a time; False
    (nothing emitted) where this does not apply.

    Each window row is one wide load, its columns every ``kw``-th lane (as :func:`pool2d`); the
    taps are compared in row-major order with :func:`_argmax`'s rule (a NaN wins, the first of
    equals wins), as selects over the lanes. The scalar loop took a mispredicted branch per tap:
    on AMD Zen 4 the keras-mnist step's max_pool2d_backward (32 x 64 x 24 x 24) took 4.6 ms on
    one thread, 23 % of the step."""
    (kh, kw), (sh, sw) = win.pool, win.strides
    if (win.overhangs(data.shape[2:]) or (sh, sw) != (kh, kw)
            or data.strides[3] != 1 or grad.strides[3] != 1 or out.strides[3] != 1):
        return False
    f, t = p.f, p.s.t
    esize = BYTES[out.dtype]
    vl = current_target().vector_width(esize)
    oh_count, ow_count = grad.shape[2], grad.shape[3]
    h, w = out.shape[2], out.shape[3]
    vt, wide, it = f"<{vl} x {t}>", f"<{kw * vl} x {t}>", f"<{vl} x i32>"
    full, rest = divmod(ow_count, vl)

    def splat_int(value: int) -> str:
        return "<" + ", ".join([f"i32 {value}"] * vl) + ">"

    def windows(oh: str, col: str, lanes: int) -> None:
        def load(ptr: str, n: int, ty: str) -> str:
            if lanes == vl:
                return f.load(ty, ptr, align=esize)
            return f.call(ty, masked_load(f.module, n, t), [("ptr", ptr), ("i32", str(esize)),
                                                            (f"<{n} x i1>", prefix_mask(n, n // vl * lanes)),
                                                            (ty, "poison")])

        def store(value: str, ptr: str, n: int, ty: str) -> None:
            if lanes == vl:
                f.store(ty, value, ptr, align=esize)
            else:
                f.call("void", masked_store(f.module, n, t), [(ty, value), ("ptr", ptr), ("i32", str(esize)),
                                                             (f"<{n} x i1>", prefix_mask(n, n // vl * lanes))])

        g = load(p.at(pgrad, grad, oh, col), vl, vt)
        best, index = "", splat_int(0)
        for ki in range(kh):
            row = load(p.at(pdata, data, f.add(f.mul(oh, kh), ki), f.mul(col, kw)), kw * vl, wide)
            for kj in range(kw):
                picks = ", ".join(f"i32 {i * kw + kj}" for i in range(vl))
                tap = f.val(f"shufflevector {wide} {row}, {wide} poison, <{vl} x i32> <{picks}>", "tap")
                if not best:
                    best = tap
                    continue
                beats = f.val(f"and <{vl} x i1> {f.val(f'fcmp ugt {vt} {tap}, {best}')}, "
                              f"{f.val(f'fcmp ord {vt} {best}, {best}')}", "beats")
                best = f.val(f"select <{vl} x i1> {beats}, {vt} {tap}, {vt} {best}", "best")
                index = f.val(f"select <{vl} x i1> {beats}, {it} {splat_int(ki * kw + kj)}, {it} {index}", "arg")
        for ki in range(kh):
            parts = [f.val(f"select <{vl} x i1> {f.val(f'icmp eq {it} {index}, {splat_int(ki * kw + kj)}')}, "
                           f"{vt} {g}, {vt} zeroinitializer", "to") for kj in range(kw)]
            joined = concatenate(f, parts, vl, t)
            order = ", ".join(f"i32 {(i % kw) * vl + i // kw}" for i in range(kw * vl))
            width = vl * (1 << (kw - 1).bit_length())
            row = f.val(f"shufflevector <{width} x {t}> {joined}, <{width} x {t}> poison, <{kw * vl} x i32> <{order}>",
                        "orow")
            store(row, p.at(pout, out, f.add(f.mul(oh, kh), ki), f.mul(col, kw)), kw * vl, wide)

    with f.loop(0, oh_count, hint="soh") as oh:
        if full:
            with f.loop(0, full, hint="sow") as chunk:
                windows(oh, f.mul(chunk, vl), vl)
        if rest:
            windows(oh, str(full * vl), rest)
        if w > ow_count * kw:  # columns past the last window take no gradient
            for ki in range(kh):
                with f.loop(ow_count * kw, w, hint="scol") as x:
                    f.store(t, p.s.const(0.0), p.at(pout, out, f.add(f.mul(oh, kh), ki), x))
    if h > oh_count * kh:  # so do rows past the last window
        with f.loop(oh_count * kh, h, hint="srow") as y, f.loop(0, w, hint="sx") as x:
            f.store(t, p.s.const(0.0), p.at(pout, out, y, x))
    return True


def pool2d_argmax_gather(kb: KernelBuilder, out: View, values: View, data: View, win: Window2d) -> None:
    """``out[n,c,oh,ow] = values`` at the first maximum of window (oh, ow) of ``data``."""
    p = _Planes(kb, "poolgather", [out, values, data])
    out, values, data = p.views
    f, s = p.f, p.s
    pout, pval, pdata = p.planes()
    with f.loop(0, out.shape[2], hint="oh") as oh, f.loop(0, out.shape[3], hint="ow") as ow:
        h, w = _argmax(p, data, pdata, win, oh, ow)
        f.store(s.t, f.load(s.t, p.at(pval, values, h, w)), p.at(pout, out, oh, ow))
    p.close()


def pool2d_scatter(kb: KernelBuilder, out: View, grad: View, data: View | None, win: Window2d) -> None:
    """The adjoint of a window reduction, written into ``out`` (the input's shape).

    ``data=None``: each ``grad`` value spread as ``grad / (kh*kw)`` over its window (average);
    otherwise added at the first maximum of the window of ``data`` (max).
    """
    (kh, kw), (images, channels, rows, cols) = win.pool, grad.shape
    spread = out.refine((images, channels, rows, kh, cols, kw))
    if data is None and win.strides == win.pool and win.padding == (0, 0) and spread is not None:
        # Windows that tile the input: each input element takes its window's share, an elementwise
        # step over (n, c, oh, kh, ow, kw) that fusion can fold into its reader (a relu gradient).
        window_grad = grad.expand_dims(3).expand_dims(5).broadcast_to(spread.shape)
        kb.elementwise(spread, [window_grad], lambda s, v: s.mul(v[0], s.const(1.0 / (kh * kw))))
        return
    views = [out, grad] + ([data] if data is not None else [])
    p = _Planes(kb, "poolscatter", views)
    out, grad = p.views[:2]
    data = p.views[2] if data is not None else None
    f, s = p.f, p.s
    bases = p.planes()
    pout, pgrad = bases[0], bases[1]
    if data is not None and _argmax_scatter_vectorized(p, out, grad, data, win, pout, pgrad, bases[2]):
        p.close()
        return
    with f.loop(0, out.shape[2], hint="h") as h, f.loop(0, out.shape[3], hint="w") as w:
        f.store(s.t, s.const(0.0), p.at(pout, out, h, w))
    scale = 1.0 / (win.pool[0] * win.pool[1])
    with f.loop(0, grad.shape[2], hint="oh") as oh, f.loop(0, grad.shape[3], hint="ow") as ow:
        g = f.load(s.t, p.at(pgrad, grad, oh, ow))

        def add(h: str, w: str, value: str) -> None:
            ptr = p.at(pout, out, h, w)
            f.store(s.t, s.add(f.load(s.t, ptr), value), ptr)

        if data is None:
            divisor = _divisor(p, win, out.shape[2:], oh, ow)
            share = s.mul(g, s.const(scale)) if divisor is None else s.div(g, divisor)
            _taps(p, win, out.shape[2:], oh, ow, lambda h, w: add(h, w, share))
        else:
            h, w = _argmax(p, data, bases[2], win, oh, ow)
            add(h, w, g)
    p.close()


__all__ = ["Window2d", "pool2d", "pool2d_argmax_gather", "pool2d_scatter"]
