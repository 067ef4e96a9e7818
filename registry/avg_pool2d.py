"""avg_pool2d and its backward operator, with PyTorch's ceil_mode and count_include_pad.

Padding counts as zeros. Each window's divisor is PyTorch's: with count_include_pad (the default)
the window clipped to the padded input (kh*kw except for a ceil-mode window overhanging the
bottom/right padding), without it the input elements in the window. The divisors depend on
shapes only, so the operator is linear with a simple adjoint: avg_pool2d_backward spreads
grad / divisor over each window.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from opgrad import ops
from opgrad.dtypes import TensorType
from opgrad.ir import Call, Expr
from opgrad.op import Attrs, Case, Input, Operator

from ._pooling import avg_divisors, draw_pool_case, pool_attrs, pool_shape, pooled_pair_shape, scatter_windows, windows

if TYPE_CHECKING:  # types only: the compiler and the checker sit above the registry
    from opgrad.checks.strategies import CaseDraw
    from opgrad.compiler.builder import KernelBuilder
    from opgrad.compiler.views import View

avg_pool2d = Operator(
    "avg_pool2d",
    inputs=[Input("data", dims=("N", "C", "H", "W"), doc="NCHW")],
    attrs=pool_attrs(avg=True),
    doc="Mean over each pool window (NCHW), as PyTorch's F.avg_pool2d with ceil_mode and count_include_pad.",
    jointly_linear=True,
)
avg_pool2d.shape_rule(pool_shape)


@avg_pool2d.reference
def _avg_pool2d_forward(data: np.ndarray, pool_size: Any, strides: Any, padding: Any, ceil_mode: bool,
                        count_include_pad: bool) -> np.ndarray:
    total = windows(data, pool_size, strides, padding, 0.0, ceil_mode).sum(axis=(4, 5))
    divisors = avg_divisors(data.shape[2:], pool_size, strides, padding, ceil_mode, count_include_pad)
    return np.asarray((total / divisors).astype(data.dtype, copy=False))


@avg_pool2d.gradient
def _avg_pool2d_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = avg_pool2d_backward(grad, data): grad / divisor spread over each window"""
    return [ops.avg_pool2d_backward(grad, call.args[0], **call.attrs)]


@avg_pool2d.mutant("count_include_pad flipped in the gradient")
def _avg_pool2d_count_flipped(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.avg_pool2d_backward(grad, call.args[0], **{**call.attrs,
                                                           "count_include_pad": not call.attrs["count_include_pad"]})]


@avg_pool2d.mutant("sum-pool gradient (not divided by the window size)")
def _avg_pool2d_sum_pool(call: Call, grad: Expr) -> list[Expr | None]:
    kh, kw = call.attrs["pool_size"]
    return [ops.avg_pool2d_backward(grad, call.args[0], **call.attrs) * float(kh * kw)]


@avg_pool2d.mutant("strides ignored")
def _avg_pool2d_strides_ignored(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.avg_pool2d_backward(grad, call.args[0], **{**call.attrs, "strides": (1, 1)})]


@avg_pool2d.sampler
def _avg_pool2d_cases(d: CaseDraw) -> Case:
    return draw_pool_case(d, "data", avg=True)


@avg_pool2d.lowering
def _avg_pool2d_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = sum of each window / its divisor"""
    kb.pool2d(out, data, call.attrs["pool_size"], call.attrs["strides"], call.attrs["padding"], "avg",
              ceil_mode=call.attrs["ceil_mode"], count_include_pad=call.attrs["count_include_pad"])


avg_pool2d_backward = Operator(
    "avg_pool2d_backward",
    inputs=[
        Input("grad", dims=("N", "C", "OH", "OW"), doc="gradient of avg_pool2d's output"),
        Input("data", differentiable=False, dims=("N", "C", "H", "W"), doc="only its shape is read"),
    ],
    attrs=pool_attrs(avg=True),
    doc="Gradient of avg_pool2d: spread grad / divisor (avg_pool2d's) over each window of data's shape.",
    jointly_linear=True,
)


@avg_pool2d_backward.shape_rule
def _avg_pool2d_backward_shape(grad: TensorType, data: TensorType, attrs: Attrs) -> TensorType:
    return pooled_pair_shape("avg_pool2d", grad, data, attrs, "grad")


@avg_pool2d_backward.reference
def _avg_pool2d_backward_forward(grad: np.ndarray, data: np.ndarray, pool_size: Any, strides: Any,
                                 padding: Any, ceil_mode: bool, count_include_pad: bool) -> np.ndarray:
    share = grad / avg_divisors(data.shape[2:], pool_size, strides, padding, ceil_mode, count_include_pad)
    spread = np.broadcast_to(share.astype(grad.dtype, copy=False)[..., None, None], (*grad.shape, *pool_size))
    return scatter_windows(spread, None, data.shape, pool_size, strides, padding, ceil_mode)


@avg_pool2d_backward.gradient
def _avg_pool2d_backward_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_grad = avg_pool2d(c): the adjoint of spreading is averaging"""
    return [ops.avg_pool2d(grad, **call.attrs), None]


@avg_pool2d_backward.mutant("d_grad ignores padding")
def _avg_pool2d_backward_padding_ignored(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.avg_pool2d(grad, **{**call.attrs, "padding": (0, 0)}), None]


@avg_pool2d_backward.sampler
def _avg_pool2d_backward_cases(d: CaseDraw) -> Case:
    return draw_pool_case(d, "pooled,data", avg=True)


@avg_pool2d_backward.lowering
def _avg_pool2d_backward_lowering(kb: KernelBuilder, call: Call, out: View, grad: View, data: View) -> None:
    """out = grad / divisor spread over each window"""
    kb.pool2d_scatter(out, grad, None, call.attrs["pool_size"], call.attrs["strides"], call.attrs["padding"],
                      ceil_mode=call.attrs["ceil_mode"], count_include_pad=call.attrs["count_include_pad"])
