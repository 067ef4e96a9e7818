"""conv2d (NCHW data, OIHW weight), its two backward operators, and conv2d_transpose.

Semantics are PyTorch's: ``conv2d`` is F.conv2d with ``groups`` (weight (O, C/groups, KH, KW)) and
``conv2d_transpose`` is F.conv_transpose2d (weight (C_in, C_out/groups, KH, KW)). Padding is stored
as (top, left, bottom, right), ONNX's pads order; an int or (ph, pw) mean PyTorch's symmetric
padding, and asymmetric padding equals F.pad(x, (left, right, top, bottom)) before an unpadded conv.

The backward operators are operators in their own right, with gradients of their own, so that
second-order differentiation and the compiler treat them like any other op:

    y  = conv2d(x, w)
    dx = conv2d_backward_input(dy, w)     (the transposed convolution)
    dw = conv2d_backward_weight(dy, x)    (the correlation of dy with x)

Both backward ops are bilinear; their gradients follow from <c, dx> = <conv2d(c, w), dy> and
<c, dw> = <conv2d(x, c), dy>. ``conv2d_transpose(x, w)`` is ``conv2d_backward_input(x, w)`` with
the output size given by PyTorch's formula, so its gradients are conv2d(c, w) for x and
conv2d_backward_weight(x, c) for w: x plays the output gradient and c the forward input.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from opgrad import ops
from opgrad.dtypes import TensorType
from opgrad.ir import Call, Expr
from opgrad.op import Attr, Attrs, Case, Input, Operator, int_tuple, require, whole

from ._common import ieee_contract

if TYPE_CHECKING:  # types only: the compiler and the checker sit above the registry
    from opgrad.checks.strategies import CaseDraw
    from opgrad.compiler.builder import KernelBuilder
    from opgrad.compiler.views import View


def conv_output_size(size: int, kernel: int, stride: int, pad_total: int, dilation: int) -> int:
    """Output length along one axis with ``pad_total`` zeros (both sides together); may be <= 0
    when the kernel does not fit."""
    return (size + pad_total - dilation * (kernel - 1) - 1) // stride + 1


def conv_padding(value: Any) -> tuple[int, int, int, int]:
    """Padding as (top, left, bottom, right), ONNX's pads order (x1_begin, x2_begin, x1_end, x2_end).

    Accepts an int (every side), (ph, pw) (PyTorch's symmetric form: ph rows on top and bottom,
    pw columns left and right) or the four sides in that order.
    """
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        items: tuple[int, ...] = (int(value),) * 4
    else:
        try:
            items = tuple(whole(v) for v in value)
        except TypeError:
            raise ValueError("expected an int, (ph, pw) or (top, left, bottom, right)") from None
        if len(items) == 2:
            items = (items[0], items[1], items[0], items[1])
        elif len(items) != 4:
            raise ValueError(f"expected an int, (ph, pw) or (top, left, bottom, right), got {len(items)} ints")
    if any(v < 0 for v in items):
        raise ValueError("every pad must be >= 0")
    return items  # type: ignore[return-value]


def _groups(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"expected an int >= 1, got {value!r}")
    return int(value)


def _window_attrs() -> list[Attr]:
    return [
        Attr("strides", default=(1, 1), convert=int_tuple(2, minimum=1), doc="(sh, sw)"),
        Attr("padding", default=(0, 0, 0, 0), convert=conv_padding,
             doc="zeros added: an int, (ph, pw) on both sides, or (top, left, bottom, right) as ONNX's pads"),
        Attr("dilation", default=(1, 1), convert=int_tuple(2, minimum=1), doc="(dh, dw)"),
        Attr("groups", default=1, convert=_groups,
             doc="channel groups: input and output channels split into this many independent convolutions"),
    ]


def _window(attrs: Attrs) -> dict[str, Any]:
    """The attributes shared by conv2d and its backward operators."""
    return {k: attrs[k] for k in ("strides", "padding", "dilation", "groups")}


def _pad_total(padding: Sequence[int], axis: int) -> int:
    return padding[axis] + padding[axis + 2]


def _output_hw(hw: Sequence[int], khw: Sequence[int], attrs: Attrs) -> tuple[int, int]:
    out = tuple(
        conv_output_size(hw[i], khw[i], attrs["strides"][i], _pad_total(attrs["padding"], i), attrs["dilation"][i])
        for i in range(2)
    )
    require(
        out[0] >= 1 and out[1] >= 1,
        f"the {khw[0]}x{khw[1]} kernel (dilation {attrs['dilation']}) does not fit the "
        f"{hw[0]}x{hw[1]} input with padding {attrs['padding']} (top, left, bottom, right): "
        f"output would be {out[0]}x{out[1]}",
    )
    return out  # type: ignore[return-value]


def _check_groups(channels: int, what: str, groups: int) -> None:
    require(channels % groups == 0, f"{what} has {channels} channel(s), which groups={groups} does not divide")


def _windows(data: np.ndarray, khw: tuple[int, int], strides: Any, padding: Any, dilation: Any,
             out_hw: tuple[int, int]) -> np.ndarray:
    """View (N, C, OH, OW, KH, KW) of the padded input's receptive fields."""
    top, left, bottom, right = padding
    padded = np.pad(data, ((0, 0), (0, 0), (top, bottom), (left, right)))
    span = (dilation[0] * (khw[0] - 1) + 1, dilation[1] * (khw[1] - 1) + 1)
    view = sliding_window_view(padded, span, axis=(2, 3))
    view = view[:, :, :: strides[0], :: strides[1], :: dilation[0], :: dilation[1]]
    return view[:, :, : out_hw[0], : out_hw[1]]


def _per_group(fn: Any, groups: int, first: np.ndarray, first_axis: int, second: np.ndarray, second_axis: int,
               out_axis: int) -> np.ndarray:
    """``fn`` on each group's slices of both operands, concatenated along ``out_axis``."""
    if groups == 1:
        return np.asarray(fn(first, second))
    parts = [fn(a, b) for a, b in zip(np.split(first, groups, axis=first_axis),
                                      np.split(second, groups, axis=second_axis), strict=True)]
    return np.ascontiguousarray(np.concatenate(parts, axis=out_axis))


# ----- conv2d -----

conv2d = Operator(
    "conv2d",
    inputs=[
        Input("data", dims=("N", "C", "H", "W"), doc="NCHW"),
        Input("weight", dims=("O", "CG", "KH", "KW"), doc="OIHW: (O, C/groups, KH, KW)"),
    ],
    attrs=_window_attrs(),
    doc="2-D cross-correlation as PyTorch's F.conv2d: NCHW data, OIHW weight (O, C/groups, KH, KW), "
        "strides, padding (top, left, bottom, right), dilation and groups (O divisible by groups; "
        "groups = C with O = C is a depthwise convolution).",
    linear_in=("data", "weight"),
)


@conv2d.shape_rule
def _conv2d_shape(data: TensorType, weight: TensorType, attrs: Attrs) -> TensorType:
    require(data.ndim == 4, f"data must be 4-D NCHW, got shape {data.shape}")
    require(weight.ndim == 4, f"weight must be 4-D OIHW, got shape {weight.shape}")
    g = attrs["groups"]
    _check_groups(data.shape[1], "data", g)
    require(weight.shape[0] % g == 0,
            f"weight has {weight.shape[0]} output channel(s), which groups={g} does not divide")
    if g == 1:
        require(
            weight.shape[1] == data.shape[1],
            f"weight has {weight.shape[1]} input channel(s) but data has {data.shape[1]}; expected weight shape "
            f"({weight.shape[0]}, {data.shape[1]}, KH, KW) -- is the weight HWIO (Keras) instead of OIHW?",
        )
    else:
        require(
            weight.shape[1] * g == data.shape[1],
            f"weight has {weight.shape[1]} input channel(s) per group but data's {data.shape[1]} channels in "
            f"groups={g} give {data.shape[1] // g}; expected weight shape ({weight.shape[0]}, {data.shape[1] // g}, "
            "KH, KW)",
        )
    oh, ow = _output_hw(data.shape[2:], weight.shape[2:], attrs)
    return TensorType((data.shape[0], weight.shape[0], oh, ow), data.dtype)


def _conv2d_one_group(data: np.ndarray, weight: np.ndarray, strides: Any, padding: Any, dilation: Any) -> np.ndarray:
    khw = weight.shape[2:]
    out_hw = _output_hw(data.shape[2:], khw, {"strides": strides, "padding": padding, "dilation": dilation})
    win = _windows(data, khw, strides, padding, dilation, out_hw)
    out = ieee_contract("nchwyx,ocyx->nhwo", win, weight,
                        lambda x, w: np.tensordot(x, w, axes=([1, 4, 5], [1, 2, 3])))  # (N, OH, OW, O)
    return np.ascontiguousarray(out.transpose(0, 3, 1, 2))


@conv2d.reference
def _conv2d_forward(data: np.ndarray, weight: np.ndarray, strides: Any, padding: Any, dilation: Any,
                    groups: int) -> np.ndarray:
    return _per_group(lambda x, w: _conv2d_one_group(x, w, strides, padding, dilation), groups, data, 1, weight, 0, 1)


def _conv2d_grads(call: Call, grad: Expr, data_window: dict[str, Any] | None = None,
                  weight_window: dict[str, Any] | None = None, batch: int | None = None) -> tuple[Expr, Expr]:
    """(d_data, d_weight) as the gradient builds them; the mutants below change one piece:
    ``data_window`` and ``weight_window`` replace window attributes of d_data and d_weight,
    ``batch`` limits d_weight's samples."""
    data, weight = call.args
    window = _window(call.attrs)
    grad_w, data_w = grad, data
    if batch is not None:
        grad_w, data_w = (ops.strided_slice(x, begin=(0,), end=(batch,)) for x in (grad, data))
    return (
        ops.conv2d_backward_input(grad, weight, input_size=data.shape[2:], **{**window, **(data_window or {})}),
        ops.conv2d_backward_weight(grad_w, data_w, kernel_size=weight.shape[2:], **{**window, **(weight_window or {})}),
    )


@conv2d.gradient
def _conv2d_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = conv2d_backward_input(grad, weight) ; d_weight = conv2d_backward_weight(grad, data)"""
    return list(_conv2d_grads(call, grad))


@conv2d.mutant("d_data with the row stride on both axes (right when the strides are equal)")
def _conv2d_square_strides(call: Call, grad: Expr) -> list[Expr | None]:
    rows = call.attrs["strides"][0]
    return list(_conv2d_grads(call, grad, data_window={"strides": (rows, rows)}))


@conv2d.mutant("d_weight from the first sample of the batch only (right for batch 1)")
def _conv2d_weight_first_sample(call: Call, grad: Expr) -> list[Expr | None]:
    return list(_conv2d_grads(call, grad, batch=1))


@conv2d.mutant("d_data with top and bottom padding swapped")
def _conv2d_pads_swapped(call: Call, grad: Expr) -> list[Expr | None]:
    top, left, bottom, right = call.attrs["padding"]
    return list(_conv2d_grads(call, grad, data_window={"padding": (bottom, left, top, right)}))


@conv2d.mutant("d_weight correlates every group's grad with the first group's data")
def _conv2d_weight_first_group(call: Call, grad: Expr) -> list[Expr | None]:
    data, weight = call.args
    g = call.attrs["groups"]
    cg = data.shape[1] // g
    first = ops.strided_slice(data, begin=(0, 0), end=(data.shape[0], cg))
    window = _window(call.attrs)
    return [
        ops.conv2d_backward_input(grad, weight, input_size=data.shape[2:], **window),
        ops.conv2d_backward_weight(grad, ops.concatenate([first] * g, axis=1), kernel_size=weight.shape[2:],
                                   **window),
    ]


@conv2d.mutant("d_data ignores strides")
def _conv2d_data_strides_ignored(call: Call, grad: Expr) -> list[Expr | None]:
    return list(_conv2d_grads(call, grad, data_window={"strides": (1, 1)}))


@conv2d.mutant("d_data ignores padding")
def _conv2d_data_padding_ignored(call: Call, grad: Expr) -> list[Expr | None]:
    return list(_conv2d_grads(call, grad, data_window={"padding": (0, 0, 0, 0)}))


@conv2d.mutant("d_weight ignores dilation")
def _conv2d_weight_dilation_ignored(call: Call, grad: Expr) -> list[Expr | None]:
    return list(_conv2d_grads(call, grad, weight_window={"dilation": (1, 1)}))


@conv2d.mutant("d_weight with the cotangent ignored (ones)")
def _conv2d_weight_ones_cotangent(call: Call, grad: Expr) -> list[Expr | None]:
    return [_conv2d_grads(call, grad)[0], _conv2d_grads(call, ops.ones_like(grad))[1]]


@conv2d.mutant("d_data with the wrong sign")
def _conv2d_data_negated(call: Call, grad: Expr) -> list[Expr | None]:
    d_data, d_weight = _conv2d_grads(call, grad)
    return [ops.negative(d_data), d_weight]


def draw_conv_geometry(d: CaseDraw) -> dict[str, Any]:
    """Checker cases: small sizes, groups, strides/padding (four sides)/dilation drawn first, then
    an input the kernel fits."""
    groups = d.choice([1, 1, 2, 3, 9])  # 9 > 8 groups: the compiler's direct (depthwise) loops
    per_group = 1 if groups > 8 else 2
    n, c, o = d.int(1, 2), groups * d.int(1, per_group), groups * d.int(1, per_group)
    kernel = (d.int(1, 3), d.int(1, 3))
    window = {"strides": (d.int(1, 3), d.int(1, 3)), "padding": (d.int(0, 2), d.int(0, 2), d.int(0, 2), d.int(0, 2)),
              "dilation": (d.int(1, 2), d.int(1, 2)), "groups": groups}
    hw = tuple(max(1, window["dilation"][i] * (kernel[i] - 1) + 1 - _pad_total(window["padding"], i)) + d.int(0, 4)
               for i in range(2))
    out = _output_hw(hw, kernel, window)
    return {"n": n, "c": c, "o": o, "hw": hw, "kernel": kernel, "out": out, "window": window, "groups": groups}


@conv2d.sampler
def _conv2d_cases(d: CaseDraw) -> Case:
    g = draw_conv_geometry(d)
    return Case([(g["n"], g["c"], *g["hw"]), (g["o"], g["c"] // g["groups"], *g["kernel"])], g["window"])


@conv2d.lowering
def _conv2d_lowering(kb: KernelBuilder, call: Call, out: View, data: View, weight: View) -> None:
    """out = W @ im2col(data) as one GEMM per group (im2col gathered while packing, never stored);
    many groups (depthwise) run as a direct loop instead"""
    kb.conv2d_forward(out, data, weight, **call.attrs)


# ----- conv2d_backward_input -----

conv2d_backward_input = Operator(
    "conv2d_backward_input",
    inputs=[
        Input("grad", dims=("N", "O", "OH", "OW"), doc="gradient of conv2d's output"),
        Input("weight", dims=("O", "CG", "KH", "KW"), doc="OIHW: (O, C/groups, KH, KW)"),
    ],
    attrs=[*_window_attrs(), Attr("input_size", convert=int_tuple(2, minimum=1),
                                  doc="(H, W) of the forward data: strides make it ambiguous")],
    doc="Gradient of conv2d with respect to its data: the transposed convolution of grad by weight "
        "(PyTorch's conv_transpose2d with the output size given).",
    linear_in=("grad", "weight"),
)


def _check_backward_input(grad: TensorType, weight: TensorType, attrs: Attrs, grad_name: str) -> tuple[int, ...]:
    require(grad.ndim == 4 and weight.ndim == 4,
            f"{grad_name} and weight must be 4-D, got {grad.shape} and {weight.shape}")
    g = attrs["groups"]
    require(
        grad.shape[1] == weight.shape[0],
        f"{grad_name} has {grad.shape[1]} channel(s) but weight has {weight.shape[0]} (its first axis)",
    )
    require(weight.shape[0] % g == 0,
            f"weight has {weight.shape[0]} channel(s) on its first axis, which groups={g} does not divide")
    expect = _output_hw(attrs["input_size"], weight.shape[2:], attrs)
    require(
        grad.shape[2:] == expect,
        f"{grad_name}'s spatial size {grad.shape[2:]} is not conv2d's output size {expect} for input_size "
        f"{attrs['input_size']}",
    )
    return (grad.shape[0], weight.shape[1] * g, *attrs["input_size"])


@conv2d_backward_input.shape_rule
def _conv2d_backward_input_shape(grad: TensorType, weight: TensorType, attrs: Attrs) -> TensorType:
    return TensorType(_check_backward_input(grad, weight, attrs, "grad"), grad.dtype)


def _backward_input_one_group(grad: np.ndarray, weight: np.ndarray, strides: Any, padding: Any, dilation: Any,
                              input_size: Any) -> np.ndarray:
    n, _, oh, ow = grad.shape
    _, c, kh, kw = weight.shape
    (sh, sw), (dh, dw) = strides, dilation
    top, left, bottom, right = padding
    padded = np.zeros((n, c, input_size[0] + top + bottom, input_size[1] + left + right), dtype=grad.dtype)
    for i in range(kh):
        for j in range(kw):
            contribution = ieee_contract("nohw,oc->nhwc", grad, weight[:, :, i, j],
                                         lambda g, w: np.tensordot(g, w, axes=([1], [0])))  # (N, OH, OW, C)
            rows = slice(i * dh, i * dh + sh * (oh - 1) + 1, sh)
            cols = slice(j * dw, j * dw + sw * (ow - 1) + 1, sw)
            padded[:, :, rows, cols] += contribution.transpose(0, 3, 1, 2)
    return padded[:, :, top : top + input_size[0], left : left + input_size[1]]


@conv2d_backward_input.reference
def _conv2d_backward_input_forward(grad: np.ndarray, weight: np.ndarray, strides: Any, padding: Any,
                                   dilation: Any, groups: int, input_size: Any) -> np.ndarray:
    return _per_group(lambda dy, w: _backward_input_one_group(dy, w, strides, padding, dilation, input_size),
                      groups, grad, 1, weight, 0, 1)


@conv2d_backward_input.gradient
def _conv2d_backward_input_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_grad = conv2d(c, weight) ; d_weight = conv2d_backward_weight(grad_in, c), c = incoming cotangent"""
    dy, weight = call.args
    window = _window(call.attrs)
    return [
        ops.conv2d(grad, weight, **window),
        ops.conv2d_backward_weight(dy, grad, kernel_size=weight.shape[2:], **window),
    ]


@conv2d_backward_input.mutant("d_grad with left and right padding swapped")
def _conv2d_backward_input_pads_swapped(call: Call, grad: Expr) -> list[Expr | None]:
    dy, weight = call.args
    top, left, bottom, right = call.attrs["padding"]
    window = _window(call.attrs)
    return [
        ops.conv2d(grad, weight, **{**window, "padding": (top, right, bottom, left)}),
        ops.conv2d_backward_weight(dy, grad, kernel_size=weight.shape[2:], **window),
    ]


@conv2d_backward_input.mutant("d_grad ignores strides")
def _conv2d_backward_input_strides_ignored(call: Call, grad: Expr) -> list[Expr | None]:
    dy, weight = call.args
    window = _window(call.attrs)
    return [
        ops.conv2d(grad, weight, **{**window, "strides": (1, 1)}),
        ops.conv2d_backward_weight(dy, grad, kernel_size=weight.shape[2:], **window),
    ]


@conv2d_backward_input.mutant("d_weight with the wrong sign")
def _conv2d_backward_input_weight_negated(call: Call, grad: Expr) -> list[Expr | None]:
    dy, weight = call.args
    window = _window(call.attrs)
    return [
        ops.conv2d(grad, weight, **window),
        ops.negative(ops.conv2d_backward_weight(dy, grad, kernel_size=weight.shape[2:], **window)),
    ]


@conv2d_backward_input.sampler
def _conv2d_backward_input_cases(d: CaseDraw) -> Case:
    g = draw_conv_geometry(d)
    return Case([(g["n"], g["o"], *g["out"]), (g["o"], g["c"] // g["groups"], *g["kernel"])],
                {**g["window"], "input_size": g["hw"]})


@conv2d_backward_input.lowering
def _conv2d_backward_input_lowering(kb: KernelBuilder, call: Call, out: View, grad: View, weight: View) -> None:
    """out = col2im(W^T @ grad), one GEMM per group; many groups run as a direct loop"""
    kb.conv2d_backward_data(out, grad, weight, **_window(call.attrs))


# ----- conv2d_backward_weight -----

conv2d_backward_weight = Operator(
    "conv2d_backward_weight",
    inputs=[
        Input("grad", dims=("N", "O", "OH", "OW"), doc="gradient of conv2d's output"),
        Input("data", dims=("N", "C", "H", "W"), doc="conv2d's data"),
    ],
    attrs=[*_window_attrs(), Attr("kernel_size", convert=int_tuple(2, minimum=1), doc="(KH, KW)")],
    doc="Gradient of conv2d with respect to its weight: correlate grad with data, per group; the "
        "result is OIHW (O, C/groups, KH, KW).",
    linear_in=("grad", "data"),
)


def _check_backward_weight(grad: TensorType, data: TensorType, attrs: Attrs, grad_name: str,
                           data_name: str) -> tuple[int, ...]:
    require(grad.ndim == 4 and data.ndim == 4,
            f"{grad_name} and {data_name} must be 4-D, got {grad.shape} and {data.shape}")
    require(grad.shape[0] == data.shape[0],
            f"{grad_name} has batch {grad.shape[0]} but {data_name} has {data.shape[0]}")
    g = attrs["groups"]
    _check_groups(data.shape[1], data_name, g)
    _check_groups(grad.shape[1], grad_name, g)
    expect = _output_hw(data.shape[2:], attrs["kernel_size"], attrs)
    require(
        grad.shape[2:] == expect,
        f"{grad_name}'s spatial size {grad.shape[2:]} is not conv2d's output size {expect} for {data_name} "
        f"{data.shape} and kernel_size {attrs['kernel_size']}",
    )
    return (grad.shape[1], data.shape[1] // g, *attrs["kernel_size"])


@conv2d_backward_weight.shape_rule
def _conv2d_backward_weight_shape(grad: TensorType, data: TensorType, attrs: Attrs) -> TensorType:
    return TensorType(_check_backward_weight(grad, data, attrs, "grad", "data"), grad.dtype)


@conv2d_backward_weight.reference
def _conv2d_backward_weight_forward(grad: np.ndarray, data: np.ndarray, strides: Any, padding: Any,
                                    dilation: Any, groups: int, kernel_size: Any) -> np.ndarray:
    def one_group(dy: np.ndarray, x: np.ndarray) -> np.ndarray:
        win = _windows(x, tuple(kernel_size), strides, padding, dilation, dy.shape[2:])
        return ieee_contract("nohw,nchwyx->ocyx", dy, win,
                             lambda g, w: np.tensordot(g, w, axes=([0, 2, 3], [0, 2, 3])))  # (O, C, KH, KW)

    return _per_group(one_group, groups, grad, 1, data, 1, 0)


@conv2d_backward_weight.gradient
def _conv2d_backward_weight_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_grad = conv2d(data, c) ; d_data = conv2d_backward_input(grad_in, c), c = incoming cotangent"""
    dy, data = call.args
    window = _window(call.attrs)
    return [
        ops.conv2d(data, grad, **window),
        ops.conv2d_backward_input(dy, grad, input_size=data.shape[2:], **window),
    ]


@conv2d_backward_weight.mutant("d_data ignores groups: each group's grad read against group 0's cotangent")
def _conv2d_backward_weight_groups_ignored(call: Call, grad: Expr) -> list[Expr | None]:
    dy, data = call.args
    g = call.attrs["groups"]
    og = dy.shape[1] // g
    first = ops.strided_slice(grad, begin=(0,), end=(og,))
    window = _window(call.attrs)
    return [
        ops.conv2d(data, grad, **window),
        ops.conv2d_backward_input(dy, ops.concatenate([first] * g, axis=0), input_size=data.shape[2:], **window),
    ]


@conv2d_backward_weight.mutant("d_grad ignores padding")
def _conv2d_backward_weight_padding_ignored(call: Call, grad: Expr) -> list[Expr | None]:
    dy, data = call.args
    window = _window(call.attrs)
    return [
        ops.conv2d(data, grad, **{**window, "padding": (0, 0, 0, 0)}),
        ops.conv2d_backward_input(dy, grad, input_size=data.shape[2:], **window),
    ]


@conv2d_backward_weight.mutant("d_data scaled by 0.5")
def _conv2d_backward_weight_data_halved(call: Call, grad: Expr) -> list[Expr | None]:
    dy, data = call.args
    window = _window(call.attrs)
    return [
        ops.conv2d(data, grad, **window),
        ops.conv2d_backward_input(dy, grad, input_size=data.shape[2:], **window) * 0.5,
    ]


@conv2d_backward_weight.sampler
def _conv2d_backward_weight_cases(d: CaseDraw) -> Case:
    g = draw_conv_geometry(d)
    return Case([(g["n"], g["o"], *g["out"]), (g["n"], g["c"], *g["hw"])], {**g["window"], "kernel_size": g["kernel"]})


@conv2d_backward_weight.lowering
def _conv2d_backward_weight_lowering(kb: KernelBuilder, call: Call, out: View, grad: View, data: View) -> None:
    """out = grad @ im2col(data)^T as one GEMM per group; many groups run as a direct loop"""
    kb.conv2d_backward_weight(out, grad, data, **_window(call.attrs))


# ----- conv2d_transpose -----


def transpose_output_size(size: int, kernel: int, stride: int, pad_total: int, dilation: int,
                          output_padding: int) -> int:
    """PyTorch's ConvTranspose2d output length: (size - 1) * stride - pads + dilation * (kernel - 1)
    + output_padding + 1."""
    return (size - 1) * stride - pad_total + dilation * (kernel - 1) + output_padding + 1


conv2d_transpose = Operator(
    "conv2d_transpose",
    inputs=[
        Input("data", dims=("N", "CI", "H", "W"), doc="NCHW"),
        Input("weight", dims=("CI", "OG", "KH", "KW"), doc="PyTorch's layout (C_in, C_out/groups, KH, KW)"),
    ],
    attrs=[
        Attr("strides", default=(1, 1), convert=int_tuple(2, minimum=1), doc="(sh, sw)"),
        Attr("padding", default=(0, 0, 0, 0), convert=conv_padding,
             doc="cropped from the output: an int, (ph, pw) or (top, left, bottom, right) as ONNX's pads"),
        Attr("output_padding", default=(0, 0), convert=int_tuple(2, minimum=0),
             doc="(oph, opw) extra rows/columns at the bottom/right, each < its stride"),
        Attr("dilation", default=(1, 1), convert=int_tuple(2, minimum=1), doc="(dh, dw)"),
        Attr("groups", default=1, convert=_groups, doc="channel groups, as conv2d's"),
    ],
    doc="Transposed 2-D convolution as PyTorch's F.conv_transpose2d: NCHW data, weight (C_in, C_out/groups, "
        "KH, KW), output size (H - 1) * sh - top - bottom + dh * (KH - 1) + oph + 1. It is the gradient of "
        "conv2d(·, weight) with respect to its data; output_padding must be smaller than the stride "
        "(PyTorch also accepts it below the dilation).",
    linear_in=("data", "weight"),
)


def _transpose_output_hw(data: TensorType, weight: TensorType, attrs: Attrs) -> tuple[int, int]:
    for i, axis in enumerate(("rows", "columns")):
        require(
            attrs["output_padding"][i] < attrs["strides"][i],
            f"output_padding {attrs['output_padding']} must be smaller than strides {attrs['strides']} "
            f"({axis}): extra {axis} beyond a stride are not reached by any input element's window",
        )
    out = tuple(
        transpose_output_size(data.shape[2 + i], weight.shape[2 + i], attrs["strides"][i],
                              _pad_total(attrs["padding"], i), attrs["dilation"][i], attrs["output_padding"][i])
        for i in range(2)
    )
    require(
        out[0] >= 1 and out[1] >= 1,
        f"padding {attrs['padding']} (top, left, bottom, right) crops the whole output: it would be "
        f"{out[0]}x{out[1]}",
    )
    return out  # type: ignore[return-value]


@conv2d_transpose.shape_rule
def _conv2d_transpose_shape(data: TensorType, weight: TensorType, attrs: Attrs) -> TensorType:
    require(data.ndim == 4, f"data must be 4-D NCHW, got shape {data.shape}")
    require(weight.ndim == 4, f"weight must be 4-D (C_in, C_out/groups, KH, KW), got shape {weight.shape}")
    g = attrs["groups"]
    require(
        weight.shape[0] == data.shape[1],
        f"weight's first axis has {weight.shape[0]} channel(s) but data has {data.shape[1]}; expected weight "
        f"shape ({data.shape[1]}, C_out/groups, KH, KW) (PyTorch's ConvTranspose2d layout)",
    )
    _check_groups(data.shape[1], "data", g)
    out_hw = _transpose_output_hw(data, weight, attrs)
    return TensorType((data.shape[0], weight.shape[1] * g, *out_hw), data.dtype)


@conv2d_transpose.reference
def _conv2d_transpose_forward(data: np.ndarray, weight: np.ndarray, strides: Any, padding: Any,
                              output_padding: Any, dilation: Any, groups: int) -> np.ndarray:
    size = tuple(transpose_output_size(data.shape[2 + i], weight.shape[2 + i], strides[i], _pad_total(padding, i),
                                       dilation[i], output_padding[i]) for i in range(2))
    return _conv2d_backward_input_forward(data, weight, strides, padding, dilation, groups, size)


def _transpose_window(attrs: Attrs) -> dict[str, Any]:
    return {k: attrs[k] for k in ("strides", "padding", "dilation", "groups")}


@conv2d_transpose.gradient
def _conv2d_transpose_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = conv2d(c, weight) ; d_weight = conv2d_backward_weight(data, c): conv2d's weight gradient
    with data in the role of the output gradient and c in the role of the forward input"""
    data, weight = call.args
    window = _transpose_window(call.attrs)
    return [
        ops.conv2d(grad, weight, **window),
        ops.conv2d_backward_weight(data, grad, kernel_size=weight.shape[2:], **window),
    ]


@conv2d_transpose.mutant("d_data reads the cotangent from the top-left, as if output_padding were leading")
def _conv2d_transpose_output_padding_leading(call: Call, grad: Expr) -> list[Expr | None]:
    data, weight = call.args
    oph, opw = call.attrs["output_padding"]
    shifted = ops.strided_slice(grad, begin=(0, 0, oph, opw), end=grad.shape)
    window = _transpose_window(call.attrs)
    return [
        ops.conv2d(shifted, weight, **window),
        ops.conv2d_backward_weight(data, grad, kernel_size=weight.shape[2:], **window),
    ]


@conv2d_transpose.mutant("d_weight ignores dilation")
def _conv2d_transpose_dilation_ignored(call: Call, grad: Expr) -> list[Expr | None]:
    data, weight = call.args
    window = _transpose_window(call.attrs)
    return [
        ops.conv2d(grad, weight, **window),
        ops.conv2d_backward_weight(data, grad, kernel_size=weight.shape[2:], **{**window, "dilation": (1, 1)}),
    ]


@conv2d_transpose.sampler
def _conv2d_transpose_cases(d: CaseDraw) -> Case:
    g = draw_conv_geometry(d)
    window = g["window"]
    output_padding = []
    for i in range(2):
        # the transposed output without output_padding is conv2d's input less the rows its last window skipped
        base = transpose_output_size(g["out"][i], g["kernel"][i], window["strides"][i],
                                     _pad_total(window["padding"], i), window["dilation"][i], 0)
        output_padding.append(max(d.int(0, window["strides"][i] - 1), 1 - base))
    return Case([(g["n"], g["c"], *g["out"]), (g["c"], g["o"] // g["groups"], *g["kernel"])],
                {**window, "output_padding": tuple(output_padding)})


@conv2d_transpose.lowering
def _conv2d_transpose_lowering(kb: KernelBuilder, call: Call, out: View, data: View, weight: View) -> None:
    """out = col2im(W^T @ data): conv2d's backward-data pass"""
    kb.conv2d_backward_data(out, data, weight, **_transpose_window(call.attrs))
