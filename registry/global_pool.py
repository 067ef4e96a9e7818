"""Global pooling over each whole NCHW plane: (N, C, H, W) -> (N, C, 1, 1), as NNVM's
global_avg_pool2d / global_max_pool2d and PyTorch's adaptive pools with output size 1.

global_max_pool2d propagates NaN like numpy.max (a plane holding a NaN pools to NaN). Where a plane
holds several equal maxima, the whole gradient goes to the first of them in row-major order, the
rule of max_pool2d, whose backward operator it reuses with one window covering the plane.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from opgrad import ops
from opgrad.dtypes import TensorType
from opgrad.ir import Call, Expr
from opgrad.op import Attrs, Input, Kink, Operator, require

if TYPE_CHECKING:  # types only: the compiler and the checker sit above the registry
    from opgrad.compiler.builder import KernelBuilder
    from opgrad.compiler.views import View


def _global_shape(data: TensorType, attrs: Attrs) -> TensorType:
    require(data.ndim == 4, f"data must be 4-D NCHW, got shape {data.shape}")
    require(data.shape[2] >= 1 and data.shape[3] >= 1,
            f"data has an empty {data.shape[2]}x{data.shape[3]} plane; a global pool of nothing has no value")
    return TensorType((data.shape[0], data.shape[1], 1, 1), data.dtype)


def _plane_window(data: Any) -> dict[str, tuple[int, int]]:
    """max_pool2d's attributes for one window covering each whole plane."""
    h, w = data.shape[2], data.shape[3]
    return {"pool_size": (h, w), "strides": (h, w), "padding": (0, 0)}


# ----- global_avg_pool2d -----

global_avg_pool2d = Operator(
    "global_avg_pool2d",
    inputs=[Input("data", dims=("N", "C", "H", "W"), doc="NCHW")],
    doc="Mean of each H x W plane: (N, C, H, W) -> (N, C, 1, 1).",
    jointly_linear=True,
)
global_avg_pool2d.shape_rule(_global_shape)


@global_avg_pool2d.reference
def _global_avg_pool2d_forward(data: np.ndarray) -> np.ndarray:
    return np.asarray(data.mean(axis=(2, 3), keepdims=True))


@global_avg_pool2d.gradient
def _global_avg_pool2d_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = broadcast_to(grad / (H * W), data.shape)"""
    data = call.args[0]
    return [ops.broadcast_to(ops.multiply(grad, 1.0 / (data.shape[2] * data.shape[3])), shape=data.shape)]


@global_avg_pool2d.mutant("forgets to divide by the plane size H * W")
def _global_avg_pool2d_sum_rule(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.broadcast_to(grad, shape=call.args[0].shape)]


@global_avg_pool2d.lowering
def _global_avg_pool2d_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = sum of each plane / (H * W)"""
    kb.reduce(out, data, (2, 3), "sum", scale=1.0 / (data.shape[2] * data.shape[3]))


# ----- global_max_pool2d -----


def _first_argmax(data: np.ndarray) -> np.ndarray:
    """One-hot (N, C, H, W) mask of each plane's first maximum in row-major order."""
    n, c, h, w = data.shape
    flat = data.reshape(n, c, h * w)
    mask = np.zeros_like(flat)
    if flat.size:
        np.put_along_axis(mask, np.argmax(flat, axis=-1)[..., None], 1.0, axis=-1)
    return mask.reshape(data.shape)


def _gap_to_runner_up(inputs: Sequence[np.ndarray], attrs: Attrs) -> float:
    data = inputs[0]
    n, c, h, w = data.shape
    if h * w < 2 or data.size == 0:
        return float("inf")
    top = np.sort(data.reshape(n, c, h * w), axis=-1)
    return float(np.min(top[..., -1] - top[..., -2]))


def _place_ties(rng: np.random.Generator, inputs: list[np.ndarray], attrs: Attrs) -> list[np.ndarray]:
    """Copy the maximum of about half the planes onto another element of the plane: an exact tie."""
    data = inputs[0].copy()
    n, c, h, w = data.shape
    for i, j in np.ndindex(n, c):
        if h * w >= 2 and rng.random() < 0.5:
            plane = data[i, j].reshape(-1)
            plane[int(rng.integers(h * w))] = plane.max()
    return [data]


def _max_subgradient(inputs: Sequence[np.ndarray], cotangent: np.ndarray, attrs: Attrs) -> list[np.ndarray | None]:
    return [_first_argmax(inputs[0]) * cotangent]


global_max_pool2d = Operator(
    "global_max_pool2d",
    inputs=[Input("data", dims=("N", "C", "H", "W"), doc="NCHW")],
    doc="Maximum of each H x W plane: (N, C, H, W) -> (N, C, 1, 1); NaN propagates as in numpy.max.",
    kinks=Kink(
        convention="ties in a plane: the whole gradient goes to the first maximum in row-major order "
                   "(as max_pool2d)",
        distance=_gap_to_runner_up,
        place=_place_ties,
        subgradient=_max_subgradient,
    ),
)
global_max_pool2d.shape_rule(_global_shape)


@global_max_pool2d.reference
def _global_max_pool2d_forward(data: np.ndarray) -> np.ndarray:
    return np.asarray(data.max(axis=(2, 3), keepdims=True))


@global_max_pool2d.gradient
def _global_max_pool2d_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = max_pool2d_backward(grad, data) with one window per plane: grad at each plane's first maximum"""
    data = call.args[0]
    return [ops.max_pool2d_backward(grad, data, **_plane_window(data))]


@global_max_pool2d.mutant("gradient spread over the plane (global_avg_pool2d's rule)")
def _global_max_pool2d_spread(call: Call, grad: Expr) -> list[Expr | None]:
    return list(_global_avg_pool2d_gradient(call, grad))


@global_max_pool2d.lowering
def _global_max_pool2d_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = max of each plane (Scalar.max: NaN propagates)"""
    kb.reduce(out, data, (2, 3), "max")
