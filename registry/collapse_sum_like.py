"""collapse_sum_like: the adjoint of broadcasting.

If ``like`` broadcasts to ``data``'s shape, collapse_sum_like(data, like) sums ``data`` over
the axes that broadcasting added or stretched, giving ``like``'s shape. Autodiff applies it to
every gradient whose shape differs from its input's, which is why elementwise rules may ignore
broadcasting (the seed-003 forum thread shows users unsure what it is for: this is what).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from opgrad import ops
from opgrad.dtypes import TensorType, collapses_to
from opgrad.ir import Call, Expr
from opgrad.op import Attrs, Case, Input, Operator, require

from ._common import dense_reshape

if TYPE_CHECKING:  # types only: the compiler and the checker sit above the registry
    from opgrad.checks.strategies import CaseDraw
    from opgrad.compiler.builder import KernelBuilder
    from opgrad.compiler.views import View


def sum_to_shape(data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum ``data`` down to ``shape`` (the inverse of numpy broadcasting)."""
    lead = data.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, d in enumerate(shape) if d == 1 and data.shape[lead + i] != 1
    )
    return data.sum(axis=axes, keepdims=True).reshape(shape) if axes else data.reshape(shape)


collapse_sum_like = Operator(
    "collapse_sum_like",
    inputs=[Input("data"), Input("like", differentiable=False, doc="only its shape is read")],
    doc="Sum data down to like's shape (like must broadcast to data's shape).",
    jointly_linear=True,
)


@collapse_sum_like.shape_rule
def _collapse_sum_like_shape(data: TensorType, like: TensorType, attrs: Attrs) -> TensorType:
    require(
        collapses_to(data.shape, like.shape),
        f"like's shape {like.shape} does not broadcast to data's shape {data.shape}, "
        "so data cannot be summed down to it",
    )
    return TensorType(like.shape, data.dtype)


@collapse_sum_like.reference
def _collapse_sum_like_forward(data: np.ndarray, like: np.ndarray) -> np.ndarray:
    return sum_to_shape(data, like.shape)


@collapse_sum_like.gradient
def _collapse_sum_like_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = broadcast_to(grad, data.shape)"""
    return [ops.broadcast_to(grad, shape=call.args[0].shape), None]


@collapse_sum_like.mutant("forgets to broadcast the gradient back")
def _collapse_sum_like_not_broadcast(call: Call, grad: Expr) -> list[Expr | None]:
    return [grad, None]


@collapse_sum_like.mutant("broadcast gradient scaled by 2")
def _collapse_sum_like_doubled(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.broadcast_to(grad * 2.0, shape=call.args[0].shape), None]


@collapse_sum_like.sampler
def _collapse_sum_like_cases(d: CaseDraw) -> Case:
    shape = d.shape(max_rank=4)
    return Case([shape, d.broadcastable_to(shape)])


@collapse_sum_like.lowering
def _collapse_sum_like_lowering(kb: KernelBuilder, call: Call, out: View, data: View, like: View) -> None:
    """out = sum of data over the axes broadcasting added or stretched"""
    lead = data.ndim - like.ndim
    kept = tuple(1 if i < lead else like.shape[i - lead] for i in range(data.ndim))
    axes = [i for i in range(data.ndim) if kept[i] == 1 and data.shape[i] != 1]
    kb.reduce(dense_reshape(out, kept), data, axes, "sum")
