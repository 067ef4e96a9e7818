"""Direct loops for convolutions with many groups (depthwise and the like).

With many groups each group's GEMM is tiny (a depthwise 3x3 is a 1 x 9 by 9 x N*P product), so
the packed GEMM spends its time packing and padding register tiles. These loops compute the three
conv2d passes straight from NCHW / OIHW memory instead, each split over threads by whole output
planes (or whole output channels for the weight gradient), so every element is written by one
thread in a fixed order and results do not depend on the thread count.

NaN and inf follow the numpy reference: the forward and the weight gradient multiply padding as
zeros (``0 * inf`` is NaN there too), while backward-data, like the reference's col2im, adds only
the products of real taps that land inside the input.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .conv import Conv2dGeometry
from .irtext import FunctionEmitter
from .views import Scalar, View

if TYPE_CHECKING:  # the builder imports this module; the type is all this one needs of it
    from .builder import KernelBuilder


def _tap(f: FunctionEmitter, g: Conv2dGeometry, oh: str, ow: str, ki: str, kj: str) -> tuple[str, str, str | None]:
    """Input (h, w) of tap (ki, kj) of output pixel (oh, ow), and whether it is inside the input
    (None when the conv has no padding, so every tap is)."""
    (sh, sw), (dh, dw) = g.stride, g.dilation
    top, left = g.pads[0], g.pads[2]
    ih = f.sub(f.add(f.mul(oh, sh), f.mul(ki, dh)), top)
    iw = f.sub(f.add(f.mul(ow, sw), f.mul(kj, dw)), left)
    if not any(g.pads):
        return ih, iw, None
    ok = f.val(f"and i1 {f.icmp('ult', ih, g.h)}, {f.icmp('ult', iw, g.w)}")
    return ih, iw, ok


def _padded_load(f: FunctionEmitter, s: Scalar, base: str, index: str, ok: str | None) -> str:
    """``base[index]`` where ``ok``, else 0 (never reading outside the plane)."""
    if ok is None:
        return f.load(s.t, f.gep(s.t, base, index))
    safe = f.select(ok, "i64", index, "0")
    return s.select(ok, f.load(s.t, f.gep(s.t, base, safe)), s.const(0.0))


def _forward(f: FunctionEmitter, s: Scalar, g: Conv2dGeometry) -> None:
    """y[n, o] = sum over the group's input channels and taps of x * w; one (n, o) plane per iteration."""
    hw, p, taps = g.h * g.w, g.oh * g.ow, g.kh * g.kw
    with f.loop("%lo", "%hi", hint="pl") as plane:
        img, oc = f.val(f"udiv i64 {plane}, {g.o}"), f.val(f"urem i64 {plane}, {g.o}")
        grp = f.val(f"udiv i64 {oc}, {g.og}")
        xb = f.gep(s.t, "%p1", f.mul(f.add(f.mul(img, g.c), f.mul(grp, g.cg)), hw))
        wb = f.gep(s.t, "%p2", f.mul(oc, g.cg * taps))
        yb = f.gep(s.t, "%p0", f.mul(plane, p))
        with f.loop(0, g.oh, hint="oh") as oh, f.loop(0, g.ow, hint="ow") as ow:
            acc = f.var(s.t, s.const(0.0), "acc")
            with f.loop(0, g.cg, hint="ci") as ci, f.loop(0, g.kh, hint="ki") as ki, f.loop(0, g.kw, hint="kj") as kj:
                ih, iw, ok = _tap(f, g, oh, ow, ki, kj)
                v = _padded_load(f, s, xb, f.add(f.mul(ci, hw), f.add(f.mul(ih, g.w), iw)), ok)
                wv = f.load(s.t, f.gep(s.t, wb, f.add(f.mul(f.add(f.mul(ci, g.kh), ki), g.kw), kj)))
                f.store(s.t, s.add(f.load(s.t, acc), s.mul(v, wv)), acc)
            f.store(s.t, f.load(s.t, acc), f.gep(s.t, yb, f.add(f.mul(oh, g.ow), ow)))


def _backward_weight(f: FunctionEmitter, s: Scalar, g: Conv2dGeometry) -> None:
    """dw[o, ci, ki, kj] = sum over images and output pixels of dy[n, o] * x at the tap; one o per iteration."""
    hw, p, taps = g.h * g.w, g.oh * g.ow, g.kh * g.kw
    with f.loop("%lo", "%hi", hint="oc") as oc:
        grp = f.val(f"udiv i64 {oc}, {g.og}")
        with f.loop(0, g.cg, hint="ci") as ci, f.loop(0, g.kh, hint="ki") as ki, f.loop(0, g.kw, hint="kj") as kj:
            acc = f.var(s.t, s.const(0.0), "acc")
            with f.loop(0, g.n, hint="img") as img:
                xb = f.gep(s.t, "%p1", f.mul(f.add(f.add(f.mul(img, g.c), f.mul(grp, g.cg)), ci), hw))
                dyb = f.gep(s.t, "%p2", f.mul(f.add(f.mul(img, g.o), oc), p))
                with f.loop(0, g.oh, hint="oh") as oh, f.loop(0, g.ow, hint="ow") as ow:
                    ih, iw, ok = _tap(f, g, oh, ow, ki, kj)
                    v = _padded_load(f, s, xb, f.add(f.mul(ih, g.w), iw), ok)
                    dy = f.load(s.t, f.gep(s.t, dyb, f.add(f.mul(oh, g.ow), ow)))
                    f.store(s.t, s.add(f.load(s.t, acc), s.mul(dy, v)), acc)
            index = f.add(f.mul(f.add(f.mul(oc, g.cg), ci), taps), f.add(f.mul(ki, g.kw), kj))
            f.store(s.t, f.load(s.t, acc), f.gep(s.t, "%p0", index))


def _backward_data(f: FunctionEmitter, s: Scalar, g: Conv2dGeometry) -> None:
    """dx[n, c] = sum over the group's output channels and taps of dy * w, scattered to the taps
    that land inside the input; one (n, c) plane per iteration."""
    hw, p, taps = g.h * g.w, g.oh * g.ow, g.kh * g.kw
    (sh, sw), (dh, dw) = g.stride, g.dilation
    top, left = g.pads[0], g.pads[2]
    with f.loop("%lo", "%hi", hint="pl") as plane:
        img, ch = f.val(f"udiv i64 {plane}, {g.c}"), f.val(f"urem i64 {plane}, {g.c}")
        grp, ci = f.val(f"udiv i64 {ch}, {g.cg}"), f.val(f"urem i64 {ch}, {g.cg}")
        dxb = f.gep(s.t, "%p0", f.mul(plane, hw))
        with f.loop(0, hw, hint="z") as z:
            f.store(s.t, s.const(0.0), f.gep(s.t, dxb, z))
        with f.loop(0, g.og, hint="j") as j:
            oc = f.add(f.mul(grp, g.og), j)
            dyb = f.gep(s.t, "%p1", f.mul(f.add(f.mul(img, g.o), oc), p))
            wb = f.gep(s.t, "%p2", f.mul(f.add(f.mul(oc, g.cg), ci), taps))
            with f.loop(0, g.kh, hint="ki") as ki, f.loop(0, g.kw, hint="kj") as kj:
                wv = f.load(s.t, f.gep(s.t, wb, f.add(f.mul(ki, g.kw), kj)))
                with f.loop(0, g.oh, hint="oh") as oh:
                    ih = f.sub(f.add(f.mul(oh, sh), f.mul(ki, dh)), top)
                    with f.if_then(f.icmp("ult", ih, g.h), "ihok"), f.loop(0, g.ow, hint="ow") as ow:
                        iw = f.sub(f.add(f.mul(ow, sw), f.mul(kj, dw)), left)
                        with f.if_then(f.icmp("ult", iw, g.w), "iwok"):
                            dst = f.gep(s.t, dxb, f.add(f.mul(ih, g.w), iw))
                            dy = f.load(s.t, f.gep(s.t, dyb, f.add(f.mul(oh, g.ow), ow)))
                            f.store(s.t, s.add(f.load(s.t, dst), s.mul(dy, wv)), dst)


def conv2d_direct(kb: KernelBuilder, pass_: str, g: Conv2dGeometry, out: View, first: View, second: View) -> None:
    """One conv pass as direct loops on dense views: ``forward`` (x, w) -> y, ``backward_data``
    (dy, w) -> dx, ``backward_weight`` (x, dy) -> dw (the argument order of ``KernelBuilder.conv``)."""
    name = kb.fresh("gconv")
    f = kb.loop_function(name, 3)
    s = Scalar(f, out.dtype)
    emit, outer = {
        "forward": (_forward, g.n * g.o),
        "backward_data": (_backward_data, g.n * g.c),
        "backward_weight": (_backward_weight, g.o),
    }[pass_]
    emit(f, s, g)
    f.ret_void()
    f.finish()
    work = g.n * g.o * g.oh * g.ow * g.ckk
    kb.add_parallel(name, [out.buffer, first.buffer, second.buffer], outer, work,
                    [first.buffer, second.buffer], [out.buffer])


__all__ = ["conv2d_direct"]
