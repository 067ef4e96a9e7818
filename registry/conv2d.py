"""conv2d (NCHW data, OIHW weight) and its two backward operators.

The backward operators are operators in their own right, with gradients of their own, so that
second-order differentiation and the compiler treat them like any other op:

    y  = conv2d(x, w)
    dx = conv2d_backward_input(dy, w)     (the transposed convolution)
    dw = conv2d_backward_weight(dy, x)    (the correlation of dy with x)

Both backward ops are bilinear; their gradients follow from <c, dx> = <conv2d(c, w), dy> and
<c, dw> = <conv2d(x, c), dy>.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from opgrad import ops
from opgrad.dtypes import TensorType
from opgrad.op import Attr, Case, Input, Operator, int_tuple, require


def conv_output_size(size: int, kernel: int, stride: int, pad: int, dilation: int) -> int:
    """Output length along one axis; may be <= 0 when the kernel does not fit."""
    return (size + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1


def _window_attrs() -> list[Attr]:
    return [
        Attr("strides", default=(1, 1), convert=int_tuple(2, minimum=1), doc="(sh, sw)"),
        Attr("padding", default=(0, 0), convert=int_tuple(2, minimum=0), doc="(ph, pw) zeros on each side"),
        Attr("dilation", default=(1, 1), convert=int_tuple(2, minimum=1), doc="(dh, dw)"),
    ]


def _output_hw(hw: Sequence[int], khw: Sequence[int], attrs: Any) -> tuple[int, int]:
    out = tuple(
        conv_output_size(hw[i], khw[i], attrs["strides"][i], attrs["padding"][i], attrs["dilation"][i])
        for i in range(2)
    )
    require(
        out[0] >= 1 and out[1] >= 1,
        f"the {khw[0]}x{khw[1]} kernel (dilation {attrs['dilation']}) does not fit the "
        f"{hw[0]}x{hw[1]} input with padding {attrs['padding']}: output would be {out[0]}x{out[1]}",
    )
    return out  # type: ignore[return-value]


def _windows(data: np.ndarray, khw: tuple[int, int], strides: Any, padding: Any, dilation: Any,
             out_hw: tuple[int, int]) -> np.ndarray:
    """View (N, C, OH, OW, KH, KW) of the padded input's receptive fields."""
    ph, pw = padding
    padded = np.pad(data, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    span = (dilation[0] * (khw[0] - 1) + 1, dilation[1] * (khw[1] - 1) + 1)
    view = sliding_window_view(padded, span, axis=(2, 3))
    view = view[:, :, :: strides[0], :: strides[1], :: dilation[0], :: dilation[1]]
    return view[:, :, : out_hw[0], : out_hw[1]]


# ----- conv2d -----

conv2d = Operator(
    "conv2d",
    inputs=[
        Input("data", dims=("N", "C", "H", "W"), doc="NCHW"),
        Input("weight", dims=("O", "C", "KH", "KW"), doc="OIHW"),
    ],
    attrs=_window_attrs(),
    doc="2-D cross-correlation, NCHW data and OIHW weight, with strides, padding and dilation.",
    linear_in=("data", "weight"),
)


@conv2d.shape_rule
def _conv2d_shape(data: TensorType, weight: TensorType, attrs: Any) -> TensorType:
    require(data.ndim == 4, f"data must be 4-D NCHW, got shape {data.shape}")
    require(weight.ndim == 4, f"weight must be 4-D OIHW, got shape {weight.shape}")
    require(
        weight.shape[1] == data.shape[1],
        f"weight has {weight.shape[1]} input channel(s) but data has {data.shape[1]}; expected weight "
        f"shape ({weight.shape[0]}, {data.shape[1]}, KH, KW) -- is the weight HWIO (Keras) instead of OIHW?",
    )
    oh, ow = _output_hw(data.shape[2:], weight.shape[2:], attrs)
    return TensorType((data.shape[0], weight.shape[0], oh, ow), data.dtype)


@conv2d.reference
def _conv2d_forward(data: np.ndarray, weight: np.ndarray, strides: Any, padding: Any, dilation: Any) -> np.ndarray:
    khw = weight.shape[2:]
    out_hw = _output_hw(data.shape[2:], khw, {"strides": strides, "padding": padding, "dilation": dilation})
    win = _windows(data, khw, strides, padding, dilation, out_hw)
    out = np.tensordot(win, weight, axes=([1, 4, 5], [1, 2, 3]))  # (N, OH, OW, O)
    return np.ascontiguousarray(out.transpose(0, 3, 1, 2))


@conv2d.gradient
def _conv2d_gradient(call, grad):
    """d_data = conv2d_backward_input(grad, weight) ; d_weight = conv2d_backward_weight(grad, data)"""
    data, weight = call.args
    window = dict(call.attrs)
    return [
        ops.conv2d_backward_input(grad, weight, input_size=data.shape[2:], **window),
        ops.conv2d_backward_weight(grad, data, kernel_size=weight.shape[2:], **window),
    ]


def draw_conv_geometry(d: Any) -> dict[str, Any]:
    """Checker cases: small sizes, strides/padding/dilation drawn first, then an input the kernel fits."""
    n, c, o = d.int(1, 2), d.int(1, 3), d.int(1, 3)
    kernel = (d.int(1, 3), d.int(1, 3))
    window = {"strides": (d.int(1, 3), d.int(1, 3)), "padding": (d.int(0, 2), d.int(0, 2)),
              "dilation": (d.int(1, 2), d.int(1, 2))}
    hw = tuple(max(1, window["dilation"][i] * (kernel[i] - 1) + 1 - 2 * window["padding"][i]) + d.int(0, 4)
               for i in range(2))
    out = _output_hw(hw, kernel, window)
    return {"n": n, "c": c, "o": o, "hw": hw, "kernel": kernel, "out": out, "window": window}


@conv2d.sampler
def _conv2d_cases(d):
    g = draw_conv_geometry(d)
    return Case([(g["n"], g["c"], *g["hw"]), (g["o"], g["c"], *g["kernel"])], g["window"])


@conv2d.lowering
def _conv2d_lowering(kb, call, out, data, weight):
    """out = W @ im2col(data) as one GEMM; im2col is gathered while packing, never stored"""
    kb.conv2d_forward(out, data, weight, **call.attrs)


# ----- conv2d_backward_input -----

conv2d_backward_input = Operator(
    "conv2d_backward_input",
    inputs=[
        Input("grad", dims=("N", "O", "OH", "OW"), doc="gradient of conv2d's output"),
        Input("weight", dims=("O", "C", "KH", "KW")),
    ],
    attrs=[*_window_attrs(), Attr("input_size", convert=int_tuple(2, minimum=1),
                                  doc="(H, W) of the forward data: strides make it ambiguous")],
    doc="Gradient of conv2d with respect to its data: the transposed convolution of grad by weight.",
    linear_in=("grad", "weight"),
)


@conv2d_backward_input.shape_rule
def _conv2d_backward_input_shape(grad: TensorType, weight: TensorType, attrs: Any) -> TensorType:
    require(grad.ndim == 4 and weight.ndim == 4, f"grad and weight must be 4-D, got {grad.shape} and {weight.shape}")
    require(
        grad.shape[1] == weight.shape[0],
        f"grad has {grad.shape[1]} channel(s) but weight has {weight.shape[0]} output channel(s)",
    )
    expect = _output_hw(attrs["input_size"], weight.shape[2:], attrs)
    require(
        grad.shape[2:] == expect,
        f"grad's spatial size {grad.shape[2:]} is not conv2d's output size {expect} for input_size "
        f"{attrs['input_size']}",
    )
    return TensorType((grad.shape[0], weight.shape[1], *attrs["input_size"]), grad.dtype)


@conv2d_backward_input.reference
def _conv2d_backward_input_forward(grad: np.ndarray, weight: np.ndarray, strides: Any, padding: Any,
                                   dilation: Any, input_size: Any) -> np.ndarray:
    n, _, oh, ow = grad.shape
    _, c, kh, kw = weight.shape
    (sh, sw), (ph, pw), (dh, dw) = strides, padding, dilation
    padded = np.zeros((n, c, input_size[0] + 2 * ph, input_size[1] + 2 * pw), dtype=grad.dtype)
    for i in range(kh):
        for j in range(kw):
            contribution = np.tensordot(grad, weight[:, :, i, j], axes=([1], [0]))  # (N, OH, OW, C)
            rows = slice(i * dh, i * dh + sh * (oh - 1) + 1, sh)
            cols = slice(j * dw, j * dw + sw * (ow - 1) + 1, sw)
            padded[:, :, rows, cols] += contribution.transpose(0, 3, 1, 2)
    return padded[:, :, ph : ph + input_size[0], pw : pw + input_size[1]]


@conv2d_backward_input.gradient
def _conv2d_backward_input_gradient(call, grad):
    """d_grad = conv2d(c, weight) ; d_weight = conv2d_backward_weight(grad_in, c), c = incoming cotangent"""
    dy, weight = call.args
    window = {k: call.attrs[k] for k in ("strides", "padding", "dilation")}
    return [
        ops.conv2d(grad, weight, **window),
        ops.conv2d_backward_weight(dy, grad, kernel_size=weight.shape[2:], **window),
    ]


@conv2d_backward_input.sampler
def _conv2d_backward_input_cases(d):
    g = draw_conv_geometry(d)
    return Case([(g["n"], g["o"], *g["out"]), (g["o"], g["c"], *g["kernel"])], {**g["window"], "input_size": g["hw"]})


@conv2d_backward_input.lowering
def _conv2d_backward_input_lowering(kb, call, out, grad, weight):
    """out = col2im(W^T @ grad)"""
    window = {k: call.attrs[k] for k in ("strides", "padding", "dilation")}
    kb.conv2d_backward_data(out, grad, weight, **window)


# ----- conv2d_backward_weight -----

conv2d_backward_weight = Operator(
    "conv2d_backward_weight",
    inputs=[
        Input("grad", dims=("N", "O", "OH", "OW"), doc="gradient of conv2d's output"),
        Input("data", dims=("N", "C", "H", "W"), doc="conv2d's data"),
    ],
    attrs=[*_window_attrs(), Attr("kernel_size", convert=int_tuple(2, minimum=1), doc="(KH, KW)")],
    doc="Gradient of conv2d with respect to its weight: correlate grad with data.",
    linear_in=("grad", "data"),
)


@conv2d_backward_weight.shape_rule
def _conv2d_backward_weight_shape(grad: TensorType, data: TensorType, attrs: Any) -> TensorType:
    require(grad.ndim == 4 and data.ndim == 4, f"grad and data must be 4-D, got {grad.shape} and {data.shape}")
    require(grad.shape[0] == data.shape[0], f"grad has batch {grad.shape[0]} but data has {data.shape[0]}")
    expect = _output_hw(data.shape[2:], attrs["kernel_size"], attrs)
    require(
        grad.shape[2:] == expect,
        f"grad's spatial size {grad.shape[2:]} is not conv2d's output size {expect} for data "
        f"{data.shape} and kernel_size {attrs['kernel_size']}",
    )
    return TensorType((grad.shape[1], data.shape[1], *attrs["kernel_size"]), grad.dtype)


@conv2d_backward_weight.reference
def _conv2d_backward_weight_forward(grad: np.ndarray, data: np.ndarray, strides: Any, padding: Any,
                                    dilation: Any, kernel_size: Any) -> np.ndarray:
    win = _windows(data, tuple(kernel_size), strides, padding, dilation, grad.shape[2:])
    return np.tensordot(grad, win, axes=([0, 2, 3], [0, 2, 3]))  # (O, C, KH, KW)


@conv2d_backward_weight.gradient
def _conv2d_backward_weight_gradient(call, grad):
    """d_grad = conv2d(data, c) ; d_data = conv2d_backward_input(grad_in, c), c = incoming cotangent"""
    dy, data = call.args
    window = {k: call.attrs[k] for k in ("strides", "padding", "dilation")}
    return [
        ops.conv2d(data, grad, **window),
        ops.conv2d_backward_input(dy, grad, input_size=data.shape[2:], **window),
    ]


@conv2d_backward_weight.sampler
def _conv2d_backward_weight_cases(d):
    g = draw_conv_geometry(d)
    return Case([(g["n"], g["o"], *g["out"]), (g["n"], g["c"], *g["hw"])], {**g["window"], "kernel_size": g["kernel"]})


@conv2d_backward_weight.lowering
def _conv2d_backward_weight_lowering(kb, call, out, grad, data):
    """out = grad @ im2col(data)^T as one GEMM"""
    window = {k: call.attrs[k] for k in ("strides", "padding", "dilation")}
    kb.conv2d_backward_weight(out, grad, data, **window)
