"""max_pool2d, its backward operator, and the gather that is the backward's adjoint.

Where a window holds several equal maxima (a kink), the whole gradient goes to the first of
them in row-major window order (as PyTorch and TVM do). The argmax is recomputed from the data
by the backward operator, so no index tensor has to flow through the graph.

    y  = max_pool2d(x)
    dx = max_pool2d_backward(dy, x)     scatter dy to each window's argmax
         max_pool2d_gather(c, x)        read c at each window's argmax (the adjoint in dy)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from opgrad import ops
from opgrad.dtypes import TensorType
from opgrad.ir import Call, Expr
from opgrad.op import Attrs, Case, Input, Kink, Operator, require

from ._pooling import (
    draw_pool_case,
    pool_attrs,
    pool_shape,
    pooled_hw,
    pooled_pair_shape,
    scatter_windows,
    windows,
)

if TYPE_CHECKING:  # types only: the compiler and the checker sit above the registry
    from opgrad.checks.strategies import CaseDraw
    from opgrad.compiler.builder import KernelBuilder
    from opgrad.compiler.views import View


def argmax_positions(data: np.ndarray, pool_size: Any, strides: Any, padding: Any,
                     ceil_mode: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) inside each window of its first maximum; padding never wins, even over -inf data.

    A NaN is the maximum, as in PyTorch; of several NaNs in one window the first wins, as in
    np.argmax (PyTorch's CPU kernel takes the last: the value is NaN either way). A window whose
    data is all -inf picks its first element that is not padding.
    """
    taps = pool_size[0] * pool_size[1]  # not -1: a reshape cannot infer it for an empty batch
    win = windows(data, pool_size, strides, padding, -np.inf, ceil_mode)
    flat = win.reshape(*win.shape[:4], taps)
    valid = windows(np.ones(data.shape, bool), pool_size, strides, padding, False, ceil_mode)
    valid = valid.reshape(*valid.shape[:4], taps)
    index = np.argmax(flat, axis=-1)  # numpy returns the first of equal maxima, or the first NaN
    best = np.take_along_axis(flat, index[..., None], -1)[..., 0]
    index = np.where(best == -np.inf, np.argmax(valid, axis=-1), index)
    return index // pool_size[1], index % pool_size[1]


def _gap_to_runner_up(inputs: Sequence[np.ndarray], attrs: Attrs) -> float:
    win = windows(inputs[0], attrs["pool_size"], attrs["strides"], attrs["padding"], -np.inf, attrs["ceil_mode"])
    flat = np.sort(win.reshape(*win.shape[:4], -1), axis=-1)
    if flat.shape[-1] < 2 or flat.size == 0:
        return float("inf")
    gaps = flat[..., -1] - flat[..., -2]
    return float(np.min(gaps))


def _place_ties(rng: np.random.Generator, inputs: list[np.ndarray], attrs: Attrs) -> list[np.ndarray]:
    """Copy each window's maximum onto another element of the window, making exact ties."""
    data = inputs[0].copy()
    (kh, kw), (sh, sw), (ph, pw) = attrs["pool_size"], attrs["strides"], attrs["padding"]
    if kh * kw < 2:
        return [data]
    rows, cols = argmax_positions(data, attrs["pool_size"], attrs["strides"], attrs["padding"], attrs["ceil_mode"])
    n, c, oh, ow = rows.shape
    for index in np.ndindex(n, c, oh, ow):
        if rng.random() < 0.5:
            continue
        r0, c0 = index[2] * sh - ph, index[3] * sw - pw
        best = data[index[0], index[1], r0 + rows[index], c0 + cols[index]]
        i, j = int(rng.integers(kh)), int(rng.integers(kw))
        if 0 <= r0 + i < data.shape[2] and 0 <= c0 + j < data.shape[3]:
            data[index[0], index[1], r0 + i, c0 + j] = best
    return [data]


def _max_pool_subgradient(inputs: Sequence[np.ndarray], cotangent: np.ndarray, attrs: Attrs) -> list[np.ndarray | None]:
    return [_scatter_to_argmax(cotangent, inputs[0], **attrs)]


def _scatter_to_argmax(grad: np.ndarray, data: np.ndarray, pool_size: Any, strides: Any, padding: Any,
                       ceil_mode: bool = False) -> np.ndarray:
    positions = argmax_positions(data, pool_size, strides, padding, ceil_mode)
    return scatter_windows(grad, positions, data.shape, pool_size, strides, padding, ceil_mode)


# ----- max_pool2d -----

max_pool2d = Operator(
    "max_pool2d",
    inputs=[Input("data", dims=("N", "C", "H", "W"), doc="NCHW")],
    attrs=pool_attrs(),
    doc="Maximum over each pool window (NCHW), as PyTorch's F.max_pool2d with ceil_mode; padding never wins.",
    kinks=Kink(
        convention="ties inside a window: the whole gradient goes to the first maximum in row-major order",
        distance=_gap_to_runner_up,
        place=_place_ties,
        subgradient=_max_pool_subgradient,
    ),
)
max_pool2d.shape_rule(pool_shape)


@max_pool2d.reference
def _max_pool2d_forward(data: np.ndarray, pool_size: Any, strides: Any, padding: Any, ceil_mode: bool) -> np.ndarray:
    return np.asarray(windows(data, pool_size, strides, padding, -np.inf, ceil_mode).max(axis=(4, 5)))


@max_pool2d.gradient
def _max_pool2d_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = max_pool2d_backward(grad, data): grad scattered to each window's argmax"""
    return [ops.max_pool2d_backward(grad, call.args[0], **call.attrs)]


@max_pool2d.mutant("ceil_mode's extra last windows dropped from the gradient")
def _max_pool2d_ceil_windows_dropped(call: Call, grad: Expr) -> list[Expr | None]:
    data = call.args[0]
    floor = {**call.attrs, "ceil_mode": False}
    oh, ow = pooled_hw(data.shape[2:], floor)
    kept = ops.strided_slice(grad, begin=(0, 0, 0, 0), end=(grad.shape[0], grad.shape[1], oh, ow))
    return [ops.max_pool2d_backward(kept, data, **floor)]


@max_pool2d.mutant("gradient spread over the window (avg_pool's rule)")
def _max_pool2d_spread(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.avg_pool2d_backward(grad, call.args[0], **call.attrs)]


@max_pool2d.mutant("off-by-one pool window")
def _max_pool2d_window_plus_one(call: Call, grad: Expr) -> list[Expr | None]:
    kh, kw = call.attrs["pool_size"]
    return [ops.max_pool2d_backward(grad, call.args[0], **{**call.attrs, "pool_size": (kh + 1, kw),
                                                           "padding": (0, 0)})]


@max_pool2d.mutant("padding ignored")
def _max_pool2d_padding_ignored(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.max_pool2d_backward(grad, call.args[0], **{**call.attrs, "padding": (0, 0)})]


@max_pool2d.mutant("strides ignored (taken as the pool size)")
def _max_pool2d_strides_ignored(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.max_pool2d_backward(grad, call.args[0], **{**call.attrs, "strides": call.attrs["pool_size"]})]


@max_pool2d.sampler
def _max_pool2d_cases(d: CaseDraw) -> Case:
    return draw_pool_case(d, "data")


@max_pool2d.lowering
def _max_pool2d_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = max of each window (padding skipped)"""
    kb.pool2d(out, data, call.attrs["pool_size"], call.attrs["strides"], call.attrs["padding"], "max",
              ceil_mode=call.attrs["ceil_mode"])


# ----- max_pool2d_backward -----


max_pool2d_backward = Operator(
    "max_pool2d_backward",
    inputs=[
        Input("grad", dims=("N", "C", "OH", "OW"), doc="gradient of max_pool2d's output"),
        Input("data", differentiable=False, dims=("N", "C", "H", "W"),
              doc="the forward input; argmax is piecewise constant in it"),
    ],
    attrs=pool_attrs(),
    doc="Gradient of max_pool2d: scatter grad to the first maximum of each window of data.",
    linear_in=("grad",),
    kinks=Kink(  # its data is the second input, so max_pool2d's kink functions are shifted by one
        convention="ties inside a window of data: grad goes to the first maximum in row-major order",
        distance=lambda inputs, attrs: _gap_to_runner_up(inputs[1:], attrs),
        place=lambda rng, inputs, attrs: [inputs[0], *_place_ties(rng, inputs[1:], attrs)],
        subgradient=lambda inputs, cot, attrs: [
            _max_pool2d_gather_forward(cot, inputs[1], **attrs), None  # type: ignore[has-type]  # defined below
        ],
    ),
)


@max_pool2d_backward.shape_rule
def _max_pool2d_backward_shape(grad: TensorType, data: TensorType, attrs: Attrs) -> TensorType:
    return pooled_pair_shape("max_pool2d", grad, data, attrs, "grad")


max_pool2d_backward.reference(_scatter_to_argmax)


@max_pool2d_backward.gradient
def _max_pool2d_backward_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_grad = max_pool2d_gather(c, data): c read at each window's argmax"""
    return [ops.max_pool2d_gather(grad, call.args[1], **call.attrs), None]


@max_pool2d_backward.mutant("d_grad is a max-pool of the cotangent instead of a gather")
def _max_pool2d_backward_pooled(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.max_pool2d(grad, **call.attrs), None]


@max_pool2d_backward.sampler
def _max_pool2d_backward_cases(d: CaseDraw) -> Case:
    return draw_pool_case(d, "pooled,data")


@max_pool2d_backward.lowering
def _max_pool2d_backward_lowering(kb: KernelBuilder, call: Call, out: View, grad: View, data: View) -> None:
    """out = grad added at the first maximum of each window of data"""
    kb.pool2d_scatter(out, grad, data, call.attrs["pool_size"], call.attrs["strides"], call.attrs["padding"],
                      ceil_mode=call.attrs["ceil_mode"])


# ----- max_pool2d_gather -----

max_pool2d_gather = Operator(
    "max_pool2d_gather",
    inputs=[
        Input("values", dims=("N", "C", "H", "W"), doc="read at the argmax positions"),
        Input("data", differentiable=False, dims=("N", "C", "H", "W"), doc="decides the argmax"),
    ],
    attrs=pool_attrs(),
    doc="values at the first maximum of each pool window of data (the adjoint of max_pool2d_backward).",
    linear_in=("values",),
    kinks=Kink(
        convention="ties inside a window: read at the first maximum in row-major order",
        distance=lambda inputs, attrs: _gap_to_runner_up(inputs[1:], attrs),
        place=lambda rng, inputs, attrs: [inputs[0], *_place_ties(rng, inputs[1:], attrs)],
        subgradient=lambda inputs, cot, attrs: [_scatter_to_argmax(cot, inputs[1], **attrs), None],
    ),
)


@max_pool2d_gather.shape_rule
def _max_pool2d_gather_shape(values: TensorType, data: TensorType, attrs: Attrs) -> TensorType:
    require(values.shape == data.shape, f"values {values.shape} and data {data.shape} must have one shape")
    return pool_shape(data, attrs)


@max_pool2d_gather.reference
def _max_pool2d_gather_forward(values: np.ndarray, data: np.ndarray, pool_size: Any, strides: Any,
                               padding: Any, ceil_mode: bool = False) -> np.ndarray:
    rows, cols = argmax_positions(data, pool_size, strides, padding, ceil_mode)
    win = windows(values, pool_size, strides, padding, 0.0, ceil_mode)
    return np.take_along_axis(win.reshape(*win.shape[:4], -1), (rows * pool_size[1] + cols)[..., None], -1)[..., 0]


@max_pool2d_gather.gradient
def _max_pool2d_gather_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_values = max_pool2d_backward(grad, data)"""
    return [ops.max_pool2d_backward(grad, call.args[1], **call.attrs), None]


@max_pool2d_gather.mutant("d_values with the wrong sign")
def _max_pool2d_gather_negated(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.negative(ops.max_pool2d_backward(grad, call.args[1], **call.attrs)), None]


@max_pool2d_gather.sampler
def _max_pool2d_gather_cases(d: CaseDraw) -> Case:
    return draw_pool_case(d, "data,data")


@max_pool2d_gather.lowering
def _max_pool2d_gather_lowering(kb: KernelBuilder, call: Call, out: View, values: View, data: View) -> None:
    """out = values at the first maximum of each window of data"""
    kb.pool2d_argmax_gather(out, values, data, call.attrs["pool_size"], call.attrs["strides"], call.attrs["padding"],
                            ceil_mode=call.attrs["ceil_mode"])
