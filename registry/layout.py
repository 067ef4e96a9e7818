"""Memory layouts of 4-D image data: layout_transform between NCHW, NHWC and the channel-blocked
NCHW{c}c; yolo2_reorg (Darknet's reorg); and conv2d_nchwc, NNVM's ``_contrib_conv2d_NCHWc``
written as layout_transform + conv2d + layout_transform.

Each op is a permutation of its input's elements, so its gradient is the inverse permutation
(layout_transform back, or reshapes and transposes of registered ops) and its kernel is one copy
through a strided view.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import numpy as np

from opgrad import ops
from opgrad.dtypes import TensorType
from opgrad.ir import Call, Expr
from opgrad.op import Attr, Attrs, Case, Input, Operator, composite, require

from ._common import positive_int

if TYPE_CHECKING:  # types only: the compiler and the checker sit above the registry
    from opgrad.checks.strategies import CaseDraw
    from opgrad.compiler.builder import KernelBuilder
    from opgrad.compiler.views import View

_BLOCKED = re.compile(r"NCHW([1-9][0-9]*)c")


def _layout(value: Any) -> str:
    if not isinstance(value, str) or not (value in ("NCHW", "NHWC") or _BLOCKED.fullmatch(value)):
        raise ValueError("expected 'NCHW', 'NHWC' or 'NCHW{c}c' with a positive block size c (e.g. 'NCHW8c')")
    return value


def block_of(layout: str) -> int:
    """The channel block c of 'NCHW{c}c'; 0 for the unblocked layouts."""
    match = _BLOCKED.fullmatch(layout)
    return int(match.group(1)) if match else 0


def _dims(layout: str, shape: tuple[int, ...]) -> tuple[int, int, int, int] | None:
    """(N, C, H, W) of data of ``shape`` in ``layout``, or None if the shape does not fit it."""
    b = block_of(layout)
    if b:
        if len(shape) != 5 or shape[4] != b:
            return None
        n, co, h, w, _ = shape
        return n, co * b, h, w
    if len(shape) != 4:
        return None
    if layout == "NHWC":
        n, h, w, c = shape
        return n, c, h, w
    n, c, h, w = shape
    return n, c, h, w


def _shape_in(layout: str, n: int, c: int, h: int, w: int) -> tuple[int, ...]:
    b = block_of(layout)
    if b:
        return (n, c // b, h, w, b)
    return (n, h, w, c) if layout == "NHWC" else (n, c, h, w)


def to_nchw(x: np.ndarray, layout: str) -> np.ndarray:
    b = block_of(layout)
    if b:
        n, co, h, w, _ = x.shape
        return np.asarray(x.transpose(0, 1, 4, 2, 3).reshape(n, co * b, h, w))
    return x.transpose(0, 3, 1, 2) if layout == "NHWC" else x


def from_nchw(x: np.ndarray, layout: str) -> np.ndarray:
    b = block_of(layout)
    if b:
        n, c, h, w = x.shape
        return np.asarray(x.reshape(n, c // b, b, h, w).transpose(0, 1, 3, 4, 2))
    return x.transpose(0, 2, 3, 1) if layout == "NHWC" else x


def _canonical(view: View, layout: str, g: int, nchw: tuple[int, int, int, int]) -> View:
    """``view`` (data in ``layout``) seen as the 5-D (N, C/g, g, H, W) array of channel q*g + r;
    a blocked layout's block must be g."""
    from dataclasses import replace

    n, c, h, w = nchw
    s = view.strides
    if block_of(layout):
        strides = (s[0], s[1], s[4], s[2], s[3])
    elif layout == "NHWC":
        strides = (s[0], g * s[3], s[3], s[1], s[2])
    else:
        strides = (s[0], g * s[1], s[1], s[2], s[3])
    return replace(view, shape=(n, c // g, g, h, w), strides=strides)


# ----- layout_transform -----

layout_transform = Operator(
    "layout_transform",
    inputs=[Input("data", doc="4-D (NCHW, NHWC) or 5-D (NCHW{c}c) image data in layout src")],
    attrs=[
        Attr("src", convert=_layout, doc="the data's layout: NCHW, NHWC or NCHW{c}c"),
        Attr("dst", convert=_layout, doc="the result's layout: NCHW, NHWC or NCHW{c}c"),
    ],
    doc="The same image data in another layout. NCHW{c}c is (N, C/c, H, W, c): channel k lives at "
        "[n, k // c, h, w, k % c] (NNVM's __layout_transform__); NHWC is numpy's transpose (0, 2, 3, 1).",
    jointly_linear=True,
)


@layout_transform.shape_rule
def _layout_transform_shape(data: TensorType, attrs: Attrs) -> TensorType:
    src, dst = attrs["src"], attrs["dst"]
    nchw = _dims(src, data.shape)
    b = block_of(src)
    require(nchw is not None, f"data of shape {data.shape} is not in layout {src}: expected "
            + (f"5-D (N, C/{b}, H, W, {b})" if b else "4-D " + src))
    assert nchw is not None
    n, c, h, w = nchw
    k = block_of(dst)
    require(not k or c % k == 0, f"{dst} needs the {c} channels in whole blocks of {k}")
    return TensorType(_shape_in(dst, n, c, h, w), data.dtype)


@layout_transform.reference
def _layout_transform_forward(data: np.ndarray, src: str, dst: str) -> np.ndarray:
    return np.ascontiguousarray(from_nchw(to_nchw(data, src), dst))


@layout_transform.gradient
def _layout_transform_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = layout_transform(grad, src=dst, dst=src): the inverse permutation"""
    return [ops.layout_transform(grad, src=call.attrs["dst"], dst=call.attrs["src"])]


@layout_transform.mutant("gradient reshaped to the input's shape instead of transformed back")
def _layout_transform_reshaped(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.reshape(grad, shape=call.args[0].shape)]


@layout_transform.sampler
def _layout_transform_cases(d: CaseDraw) -> Case:
    n, h, w = d.int(1, 2), d.int(1, 3), d.int(1, 3)
    blocks = (d.int(1, 3), d.int(1, 3))
    c = blocks[0] * blocks[1] * d.int(1, 2)
    layouts = ["NCHW", "NHWC", f"NCHW{blocks[0]}c", f"NCHW{blocks[1]}c"]
    src, dst = d.choice(layouts), d.choice(layouts)
    return Case([_shape_in(src, n, c, h, w)], {"src": src, "dst": dst})


@layout_transform.lowering
def _layout_transform_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = data read through the strided (N, C/c, c, H, W) view both layouts share"""
    src, dst = call.attrs["src"], call.attrs["dst"]
    nchw = _dims(src, data.shape)
    assert nchw is not None
    bs, bd = block_of(src), block_of(dst)
    if bs and bd and bs != bd:  # two block sizes: through NCHW
        middle = kb.temporary(nchw, out.dtype)
        kb.elementwise(_canonical(middle, "NCHW", bs, nchw), [_canonical(data, src, bs, nchw)], lambda s, v: v[0])
        data, src, bs = middle, "NCHW", 0
    g = bs or bd or 1
    kb.elementwise(_canonical(out, dst, g, nchw), [_canonical(data, src, g, nchw)], lambda s, v: v[0])


# ----- yolo2_reorg -----


def _reorg_axes(shape: tuple[int, ...], s: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the 6-D view of the input, the 6-D shape of the output) of Darknet's reorg."""
    b, c, h, w = shape
    return (b, c // (s * s), h, s, w, s), (b, s, s, c // (s * s), h, w)


_REORG_PERM = (0, 3, 5, 1, 2, 4)
_REORG_INVERSE = (0, 3, 4, 1, 5, 2)

yolo2_reorg = Operator(
    "yolo2_reorg",
    inputs=[Input("data", doc="NCHW; C a multiple of stride**2, H and W multiples of stride")],
    attrs=[Attr("stride", convert=positive_int, doc="s")],
    doc="Darknet's reorg layer (NNVM's yolo2_reorg, TVM's reorg_python): (B, C, H, W) -> (B, C*s*s, H/s, W/s). "
        "The input's elements, read as a (B, C/s², H*s, W*s) array X, become a (B, C, H, W) array Y with "
        "Y[b, k, j, i] = X[b, k % (C/s²), j*s + (k // (C/s²)) // s, i*s + (k // (C/s²)) % s], which is then "
        "reshaped to the output shape. It is a space_to_depth of the regrouped data, not of the data itself.",
    jointly_linear=True,
)


@yolo2_reorg.shape_rule
def _yolo2_reorg_shape(data: TensorType, attrs: Attrs) -> TensorType:
    s = attrs["stride"]
    require(data.ndim == 4, f"data must be 4-D NCHW, got shape {data.shape}")
    b, c, h, w = data.shape
    require(c % (s * s) == 0, f"C={c} must be a multiple of stride**2={s * s}")
    require(h % s == 0 and w % s == 0, f"H={h} and W={w} must be multiples of stride={s}")
    return TensorType((b, c * s * s, h // s, w // s), data.dtype)


@yolo2_reorg.reference
def _yolo2_reorg_forward(data: np.ndarray, stride: int) -> np.ndarray:
    b, c, h, w = data.shape
    six, _ = _reorg_axes(data.shape, stride)
    out = data.reshape(six).transpose(_REORG_PERM)
    return np.asarray(out.reshape(b, c * stride * stride, h // stride, w // stride))


@yolo2_reorg.gradient
def _yolo2_reorg_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = reshape(transpose(reshape(grad, 6-D), inverse permutation), data.shape)"""
    data, s = call.args[0], call.attrs["stride"]
    _, moved = _reorg_axes(data.shape, s)
    return [ops.reshape(ops.transpose(ops.reshape(grad, shape=moved), axes=_REORG_INVERSE), shape=data.shape)]


@yolo2_reorg.mutant("the two stride offsets swapped (column offset taken as the row offset)")
def _yolo2_reorg_swapped(call: Call, grad: Expr) -> list[Expr | None]:
    data, s = call.args[0], call.attrs["stride"]
    _, moved = _reorg_axes(data.shape, s)
    swapped = ops.transpose(ops.reshape(grad, shape=moved), axes=(0, 2, 1, 3, 4, 5))
    return [ops.reshape(ops.transpose(swapped, axes=_REORG_INVERSE), shape=data.shape)]


@yolo2_reorg.sampler
def _yolo2_reorg_cases(d: CaseDraw) -> Case:
    s = d.int(1, 3)
    return Case([(d.int(1, 2), s * s * d.int(1, 2), s * d.int(1, 2), s * d.int(1, 2))], {"stride": s})


@yolo2_reorg.lowering
def _yolo2_reorg_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out (as 6-D (B, s, s, C/s², H, W)) = data (as 6-D (B, C/s², H, s, W, s)) transposed"""
    six, moved = _reorg_axes(data.shape, call.attrs["stride"])
    source = kb.contiguous(data).reshape(six)
    target = out.reshape(moved)
    assert source is not None and target is not None
    kb.elementwise(target, [source.permute(_REORG_PERM)], lambda s, v: v[0])


# ----- conv2d_nchwc -----


@composite("layout_transform", "transpose", "reshape", "conv2d")
def conv2d_nchwc(data: Expr, weight: Expr, strides: Any = 1, padding: Any = 0, dilation: Any = 1) -> Expr:
    """NNVM's _contrib_conv2d_NCHWc: data NCHW{i}c (N, C/i, H, W, i), weight OIHW{i}i{o}o
    (O/o, C/i, KH, KW, i, o), result NCHW{o}c; it is conv2d between two layout_transforms, with
    the weight regrouped to OIHW by a transpose and a reshape."""
    for name, value in (("data", data), ("weight", weight)):
        if not isinstance(value, Expr):
            raise TypeError(f"opgrad.ops.conv2d_nchwc: {name} must be an opgrad expression, got "
                            f"{type(value).__name__}")
    if data.ndim != 5 or weight.ndim != 6:
        raise ValueError(f"opgrad.ops.conv2d_nchwc: expected data (N, C/i, H, W, i) and weight (O/o, C/i, KH, KW, "
                         f"i, o), got shapes {data.shape} and {weight.shape}")
    oo, ci, kh, kw, ib, ob = weight.shape
    if ib != data.shape[4] or ci != data.shape[1]:
        raise ValueError(f"opgrad.ops.conv2d_nchwc: weight {weight.shape} (OIHW{ib}i{ob}o) does not match data "
                         f"{data.shape} (NCHW{data.shape[4]}c): expected weight[1] == data[1] and weight[4] == data[4]")
    x = ops.layout_transform(data, src=f"NCHW{ib}c", dst="NCHW")
    w = ops.reshape(ops.transpose(weight, axes=(0, 5, 1, 4, 2, 3)), shape=(oo * ob, ci * ib, kh, kw))
    y = ops.conv2d(x, w, strides=strides, padding=padding, dilation=dilation)
    return ops.layout_transform(y, src="NCHW", dst=f"NCHW{ob}c")
