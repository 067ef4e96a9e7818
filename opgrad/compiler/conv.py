"""conv2d (NCHW input, OIHW weight) forward, backward-data and backward-weight on the GEMM engine.

Forward and backward-weight are single GEMMs whose im2col operand is an index map with a padding
window: the gather happens while packing, so the im2col matrix never exists in memory.

Backward-data is ``col = W^T @ dY`` followed by col2im (a scatter-add). The direct "transposed
convolution" GEMM would multiply by zeros wherever the output is smaller than the kernel (the
seed CNN's 12x12 conv on a 12x12 input does ~150x the useful work that way), so instead the batch
is cut into fixed segments of images whose ``col`` fits in ~2 MB; each segment runs a parallel
GEMM and then a parallel col2im split over (image, channel) planes. Segments depend only on the
shapes, so results are bitwise identical for any thread count.

Grouped convolutions (PyTorch's ``groups``) run one GEMM kernel per pass, called once per group on
pointers offset to that group's channels: every group has the same shapes and strides, so the index
maps are the same and only the base addresses move. ``groups == 1`` emits exactly the ungrouped code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .gemm import Epilogue, GemmSpec, IndexMap, Operand, emit_gemm, masked_load, masked_store, round_up
from .irtext import BYTES, LLVM_TYPE, FunctionEmitter, ModuleEmitter, iota_const
from .target import current_target
from .threads import PARALLEL_FOR

_COL_BUDGET_BYTES = 2 << 20


def _pair(v: int | Sequence[int]) -> tuple[int, int]:
    if isinstance(v, int):
        return v, v
    a, b = v
    return int(a), int(b)


@dataclass(frozen=True)
class Conv2dGeometry:
    """Shapes and attributes of one conv2d; ``pads`` = (top, bottom, left, right).

    ``c`` and ``o`` count all channels; with ``groups`` > 1 each group maps ``c / groups`` input
    channels to ``o / groups`` output channels, and the GEMM shapes (``ckk``) are per group.
    """

    n: int
    c: int
    h: int
    w: int
    o: int
    kh: int
    kw: int
    stride: tuple[int, int] = (1, 1)
    pads: tuple[int, int, int, int] = (0, 0, 0, 0)
    dilation: tuple[int, int] = (1, 1)
    dtype: str = "float32"
    groups: int = 1

    @staticmethod
    def make(
        x_shape: tuple[int, ...], w_shape: tuple[int, ...], stride: int | Sequence[int] = 1,
        padding: int | Sequence[int] = 0, dilation: int | Sequence[int] = 1, dtype: str = "float32",
        groups: int = 1,
    ) -> Conv2dGeometry:
        """``w_shape`` is OIHW (O, C/groups, KH, KW); ``padding`` an int, (ph, pw) or
        (top, left, bottom, right) (ONNX's order, as the registry stores it)."""
        n, c, h, w = x_shape
        o, cg, kh, kw = w_shape
        assert c == cg * groups and o % groups == 0, f"weight {w_shape} does not fit data {x_shape} in {groups} groups"
        if isinstance(padding, int):
            pads = (padding,) * 4
        elif len(padding) == 2:
            pads = (padding[0], padding[0], padding[1], padding[1])
        else:
            top, left, bottom, right = (int(p) for p in padding)
            pads = (top, bottom, left, right)
        geom = Conv2dGeometry(n, c, h, w, o, kh, kw, _pair(stride), pads, _pair(dilation), dtype,
                              groups)
        assert geom.oh >= 1 and geom.ow >= 1, "empty output"
        return geom

    @property
    def oh(self) -> int:
        return (self.h + self.pads[0] + self.pads[1] - self.dilation[0] * (self.kh - 1) - 1) // self.stride[0] + 1

    @property
    def ow(self) -> int:
        return (self.w + self.pads[2] + self.pads[3] - self.dilation[1] * (self.kw - 1) - 1) // self.stride[1] + 1

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        return self.n, self.o, self.oh, self.ow

    @property
    def cg(self) -> int:
        """Input channels per group."""
        return self.c // self.groups

    @property
    def og(self) -> int:
        """Output channels per group."""
        return self.o // self.groups

    @property
    def ckk(self) -> int:
        """The GEMMs' reduction (forward) length: one group's input channels times the kernel taps."""
        return self.cg * self.kh * self.kw

    def describe(self) -> str:
        """The shapes in one line, e.g. ``conv x32x32x26x26 w64x32x3x3`` (plus stride/pads/groups if set)."""
        text = f"conv x{self.n}x{self.c}x{self.h}x{self.w} w{self.o}x{self.cg}x{self.kh}x{self.kw}"
        if self.stride != (1, 1):
            text += f" s{self.stride[0]}x{self.stride[1]}"
        if any(self.pads):
            text += " p" + ",".join(map(str, self.pads))
        if self.groups > 1:
            text += f" g{self.groups}"
        return text

    def group_offsets(self) -> list[tuple[int, int, int]]:
        """Element offsets of each group's first (input channel, weight row, output channel)."""
        return [(g * self.cg * self.h * self.w, g * self.og * self.ckk, g * self.og * self.oh * self.ow)
                for g in range(self.groups)]

    def flops(self) -> int:
        """Multiply-adds x 2 of one pass (all three passes cost the same)."""
        return 2 * self.n * self.o * self.oh * self.ow * self.ckk

    # ----- index maps of the implicit im2col matrix [C*KH*KW, N*OH*OW] -----

    def window(self) -> tuple[int, int] | None:
        """The im2col operand's zero-padding window, or None when no tap can leave the input: without
        padding, ``oh``/``ow`` keep every ``(h, w)`` in range, and packing needs no bounds masks."""
        return (self.h, self.w) if any(self.pads) else None

    def patch_map(self) -> IndexMap:
        """(c, kh, kw) -> offset inside an input image and the tap's (h, w) displacement."""
        dh, dw = self.dilation
        return IndexMap((self.cg, self.kh, self.kw), (self.h * self.w, dh * self.w, dw), 0,
                        (0, dh, 0), 0, (0, 0, dw), 0)

    def pixel_map(self) -> IndexMap:
        """(n, oh, ow) -> offset of the window's top-left input pixel and its (h, w) position."""
        sh, sw = self.stride
        top, left = self.pads[0], self.pads[2]
        return IndexMap(
            (self.n, self.oh, self.ow), (self.c * self.h * self.w, sh * self.w, sw), -(top * self.w + left),
            (0, sh, 0), -top, (0, 0, sw), -left,
        )

    def output_pixels(self, images: int | None = None) -> IndexMap:
        """(n, oh*ow) -> offset in an NCHW tensor with ``o`` channels (dY or Y)."""
        p = self.oh * self.ow
        return IndexMap((images or self.n, p), (self.o * p, 1))


@dataclass(frozen=True)
class ConvEntry:
    """An emitted entry ``void entry(ptr, ptr, ptr, ptr ws)`` and its scratch need per thread."""

    entry: str
    workspace_per_thread: int


def emit_conv2d_forward(m: ModuleEmitter, g: Conv2dGeometry, name: str, epilogue: Epilogue | None = None) -> ConvEntry:
    """``conv2d_forward(x, w, y, e..., ws)``: Y[o, (n,p)] = W[o, (c,kh,kw)] @ im2col(X), then the
    ``epilogue`` (its operands index Y as (image, channel) x pixel; without groups only) as the
    GEMM's, with its memory inputs ``e...``."""
    assert epilogue is None or g.groups == 1, "a grouped convolution takes no epilogue"
    p = g.oh * g.ow
    spec = GemmSpec(
        g.og, g.n * p, g.ckk,
        a=Operand.matrix(g.og, g.ckk, g.ckk, 1),
        b=Operand(g.patch_map(), g.pixel_map(), g.window()),
        c=Operand(IndexMap.strided(g.og, p), g.output_pixels()),
        dtype=g.dtype,
        epilogue=_in_gemm_coordinates(epilogue) if epilogue else None,
    )
    plan = emit_gemm(m, spec, name + ".gemm")
    offsets = [{"x": x, "w": w, "y": y} for x, w, y in g.group_offsets()]
    extras = tuple(ptr for _, ptr in epilogue.pointers) if epilogue else ()
    for group in offsets:
        group.update(dict.fromkeys(extras, 0))
    _emit_forwarder(m, name, plan.names["entry"], ("x", "w", "y", *extras), ("w", "x", "y", *extras), g.dtype,
                    offsets)
    return ConvEntry(name, plan.workspace_per_thread)


def output_matrix(n: int, channels: int, pixels: int) -> Operand:
    """A contiguous NCHW output of ``pixels`` = H x W as the matrix (image, channel) x pixel, the
    coordinates of a convolution's epilogue."""
    return Operand(IndexMap.strided(n * channels, pixels), IndexMap.strided(pixels, 1))


def _in_gemm_coordinates(epilogue: Epilogue) -> Epilogue:
    """An epilogue over (image, channel) x pixel moved to the forward GEMM's channel x (image, pixel):
    each operand's rows map has the digits (image, channel)."""
    def moved(x: Operand) -> Operand:
        (_, channels), (image_stride, channel_stride) = x.rows.radices, x.rows.strides
        cols = IndexMap((x.rows.radices[0], *x.cols.radices), (image_stride, *x.cols.strides))
        return Operand(IndexMap.strided(channels, channel_stride, x.rows.base), cols)

    return Epilogue(epilogue.body, tuple(moved(x) if isinstance(x, Operand) else x for x in epilogue.inputs))


def emit_conv2d_backward_weight(m: ModuleEmitter, g: Conv2dGeometry, name: str) -> ConvEntry:
    """``conv2d_backward_weight(x, dy, dw, ws)``: dW[o, (c,kh,kw)] = dY[o, (n,p)] @ im2col(X)^T."""
    p = g.oh * g.ow
    spec = GemmSpec(
        g.og, g.ckk, g.n * p,
        a=Operand(IndexMap.strided(g.og, p), g.output_pixels()),
        b=Operand(g.pixel_map(), g.patch_map(), g.window()),
        c=Operand.matrix(g.og, g.ckk, g.ckk, 1),
        dtype=g.dtype,
    )
    plan = emit_gemm(m, spec, name + ".gemm")
    offsets = [{"x": x, "dy": y, "dw": w} for x, w, y in g.group_offsets()]
    _emit_forwarder(m, name, plan.names["entry"], ("x", "dy", "dw"), ("dy", "x", "dw"), g.dtype, offsets)
    return ConvEntry(name, plan.workspace_per_thread)


def _emit_forwarder(m: ModuleEmitter, name: str, target: str, params: tuple[str, ...], order: tuple[str, ...],
                    dtype: str, offsets: list[dict[str, int]]) -> None:
    """``name(params..., ws)`` calls ``target(order..., ws)`` once per group, each pointer moved by
    that group's element offset (one call, unmoved, without groups)."""
    f = FunctionEmitter(m, name, [("ptr", p) for p in (*params, "ws")])
    t = LLVM_TYPE[dtype]
    for group in offsets:
        args = [("ptr", f.gep(t, "%" + a, str(group[a])) if group[a] else "%" + a) for a in order]
        f.call("void", "@" + target, [*args, ("ptr", "%ws")])
    f.ret_void()
    f.finish()


def emit_conv2d_backward_data(m: ModuleEmitter, g: Conv2dGeometry, name: str) -> ConvEntry:
    """``conv2d_backward_data(dy, w, dx, ws)``: per image segment, col = W^T @ dY, then col2im."""
    esize, t = BYTES[g.dtype], LLVM_TYPE[g.dtype]
    p = g.oh * g.ow
    rows = g.c * g.kh * g.kw  # col rows of all groups: group i fills rows [i*ckk, (i+1)*ckk)
    per_image = rows * p * esize
    seg = max(1, min(g.n, _COL_BUDGET_BYTES // per_image))
    sizes = sorted({seg, g.n % seg} - {0}, reverse=True)
    gemms = {}
    for imgs in sizes:
        spec = GemmSpec(
            g.ckk, imgs * p, g.og,
            a=Operand.matrix(g.ckk, g.og, 1, g.ckk),
            b=Operand(IndexMap.strided(g.og, p), g.output_pixels(imgs)),
            c=Operand.matrix(g.ckk, imgs * p, imgs * p, 1),
            dtype=g.dtype,
        )
        gemms[imgs] = emit_gemm(m, spec, f"{name}.gemm{imgs}")
    col_bytes = round_up(rows * seg * p * esize, 64)
    gemm_ws = max(plan.workspace_per_thread for plan in gemms.values())
    col2im = _emit_col2im(m, g, name + ".col2im", t)
    # The col buffer is shared by all threads, so it sits before the per-thread GEMM scratch.
    # Workspace per thread is reported as (col + gemm) so ``ws_per_thread * nthreads`` covers it.
    f = FunctionEmitter(m, name, [("ptr", "dy"), ("ptr", "w"), ("ptr", "dx"), ("ptr", "ws")])
    col = "%ws"
    ws = f.gep("i8", "%ws", str(col_bytes))
    ctx = f.alloca("[3 x ptr]", "ctx", align=8)
    nimg = f.alloca("i64", "nimg")
    start = 0
    while start < g.n:
        imgs = min(seg, g.n - start)
        dy = f.gep(t, "%dy", str(start * g.o * p))
        for group, (_, w_off, y_off) in enumerate(g.group_offsets()):
            col_off = group * g.ckk * imgs * p
            args = [f.gep(t, "%w", str(w_off)) if w_off else "%w", f.gep(t, dy, str(y_off)) if y_off else dy,
                    f.gep(t, col, str(col_off)) if col_off else col]
            f.call("void", "@" + gemms[imgs].names["entry"], [*(("ptr", a) for a in args), ("ptr", ws)])
        f.store("ptr", col, f.gep("ptr", ctx, "0"))
        f.store("ptr", f.gep(t, "%dx", str(start * g.c * g.h * g.w)), f.gep("ptr", ctx, "1"))
        f.store("i64", str(imgs), nimg)
        f.store("ptr", nimg, f.gep("ptr", ctx, "2"))
        f.call("void", "@" + PARALLEL_FOR, [("ptr", "@" + col2im), ("ptr", ctx)])
        start += imgs
    f.ret_void()
    f.finish()
    return ConvEntry(name, col_bytes + gemm_ws)


def _emit_col2im(m: ModuleEmitter, g: Conv2dGeometry, name: str, t: str) -> str:
    """Task: dx planes (image, channel) of this thread = sum over taps of the matching col rows."""
    p = g.oh * g.ow
    sh, sw = g.stride
    dh, dw = g.dilation
    top, left = g.pads[0], g.pads[2]
    add_row = _emit_add_strided(m, name + ".row", t, sw)
    f = FunctionEmitter(m, name, [("ptr", "ctx"), ("i32", "tid"), ("i32", "nt")], linkage="internal",
                        pipeline="streaming")
    col = f.load("ptr", f.gep("ptr", "%ctx", "0"))
    dx = f.load("ptr", f.gep("ptr", "%ctx", "1"))
    imgs = f.load("i64", f.load("ptr", f.gep("ptr", "%ctx", "2")))
    tid, nt = f.val("sext i32 %tid to i64"), f.val("sext i32 %nt to i64")
    planes = f.mul(imgs, g.c)
    lo = f.val(f"udiv i64 {f.mul(tid, planes)}, {nt}")
    hi = f.val(f"udiv i64 {f.mul(f.add(tid, 1), planes)}, {nt}")
    ld_col = f.mul(imgs, p)
    with f.loop(lo, hi, hint="pl") as plane:
        img = f.val(f"udiv i64 {plane}, {g.c}")
        ch = f.val(f"urem i64 {plane}, {g.c}")
        dplane = f.gep(t, dx, f.mul(plane, g.h * g.w))
        f.emit(f"call void @llvm.memset.p0.i64(ptr align 4 {dplane}, i8 0, i64 {g.h * g.w * BYTES[g.dtype]}, i1 false)")
        with f.loop(0, g.kh, hint="kh") as kh, f.loop(0, g.kw, hint="kw") as kw:
            row = f.add(f.mul(f.add(f.mul(ch, g.kh), kh), g.kw), kw)
            crow = f.gep(t, col, f.add(f.mul(row, ld_col), f.mul(img, p)))
            # valid ow: 0 <= ow*sw + kw*dw - left < W
            num = f.sub(str(left), f.mul(kw, dw))
            lo_ow = f.select(f.icmp("sle", num, "0"), "i64", "0", f.val(f"sdiv i64 {f.add(num, sw - 1)}, {sw}"))
            num2 = f.add(num, g.w - 1)
            last = f.smin(f.add(f.val(f"sdiv i64 {num2}, {sw}"), 1), g.ow)
            hi_ow = f.select(f.icmp("slt", num2, "0"), "i64", "0", last)
            cnt = f.sub(hi_ow, lo_ow)
            with f.if_then(f.icmp("sgt", cnt, "0"), "any"):
                iw0 = f.sub(f.add(f.mul(lo_ow, sw), f.mul(kw, dw)), left)
                with f.loop(0, g.oh, hint="oh") as oh:
                    ih = f.sub(f.add(f.mul(oh, sh), f.mul(kh, dh)), top)
                    ok = f.val(f"icmp ult i64 {ih}, {g.h}")
                    with f.if_then(ok, "ihok"):
                        dst = f.gep(t, dplane, f.add(f.mul(ih, g.w), iw0))
                        src = f.gep(t, crow, f.add(f.mul(oh, g.ow), lo_ow))
                        f.call("void", add_row, [("ptr", dst), ("ptr", src), ("i64", cnt)])
    f.ret_void()
    f.finish()
    m.declare("llvm.memset.p0.i64", "declare void @llvm.memset.p0.i64(ptr, i8, i64, i1)")
    return name


def _emit_add_strided(m: ModuleEmitter, name: str, t: str, stride: int) -> str:
    """``dst[i*stride] += src[i]``; noalias (kept as scope metadata when inlined) lets it vectorize.

    A stride of 2 up to half a vector runs by whole vectors of ``dst``: the source's ``vl/stride``
    values are spread to every stride-th lane, and the sum is stored under a mask of those lanes.
    LLVM's vectorizer leaves such a loop scalar (a strided read-modify-write, and a row of a
    small image is shorter than its vector body), which made col2im most of a stride-2 pass."""
    f = FunctionEmitter(
        m, name, [("ptr noalias", "dst"), ("ptr noalias", "src"), ("i64", "n")],
        linkage="internal", attrs="nounwind alwaysinline", pipeline="streaming",
    )
    esize = 4 if t == "float" else 8
    vl = current_target().vector_width(esize)
    per = vl // stride
    if stride == 1 or per < 2:
        with f.loop(0, "%n", hint="i") as i:
            d = f.gep(t, "%dst", f.mul(i, stride))
            s = f.gep(t, "%src", i)
            f.store(t, f.val(f"fadd {t} {f.load(t, d)}, {f.load(t, s)}"), d)
        f.ret_void()
        f.finish()
        return "@" + name
    vt, st, it, sit = f"<{vl} x {t}>", f"<{per} x {t}>", f"<{vl} x i32>", f"<{per} x i32>"
    load_src, load_dst, store_dst = masked_load(m, per, t), masked_load(m, vl, t), masked_store(m, vl, t)
    # Lane L of the spread vector holds source value L / stride where L % stride == 0, else a zero.
    spread = ", ".join(f"i32 {lane // stride if lane % stride == 0 else per}" for lane in range(vl))
    # The other lanes get an index no count reaches, so they are never loaded or stored.
    lane_of = ", ".join(f"i32 {lane // stride if lane % stride == 0 else 1 << 30}" for lane in range(vl))
    with f.loop(0, "%n", per, hint="i") as i:
        rest = f.val(f"trunc i64 {f.sub('%n', i)} to i32")
        src_ok = f.val(f"icmp slt {sit} {iota_const(per)}, {f.splat(per, 'i32', rest)}")
        values = f.call(st, load_src, [("ptr", f.gep(t, "%src", i)), ("i32", str(esize)), (f"<{per} x i1>", src_ok),
                                       (st, "zeroinitializer")])
        spread_values = f.val(f"shufflevector {st} {values}, {st} zeroinitializer, <{vl} x i32> <{spread}>")
        # A lane is written where it is a stride-th one and its source value exists.
        dst_ok = f.val(f"icmp slt {it} <{lane_of}>, {f.splat(vl, 'i32', rest)}")
        dst = f.gep(t, "%dst", f.mul(i, stride))
        mask = (f"<{vl} x i1>", dst_ok)
        old = f.call(vt, load_dst, [("ptr", dst), ("i32", str(esize)), mask, (vt, "zeroinitializer")])
        f.call("void", store_dst, [(vt, f.val(f"fadd {vt} {old}, {spread_values}")), ("ptr", dst), ("i32", str(esize)),
                                   mask])
    f.ret_void()
    f.finish()
    return "@" + name
