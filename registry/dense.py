"""dense: a fully connected layer, data @ weight.T with weight shaped (units, in_features).

This is Relay's/TVM's convention (and Keras' kernel transposed). Its gradient was wrong in TVM
for a year because every test shape contained a 1; the checker draws non-square shapes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from opgrad import ops
from opgrad.dtypes import TensorType
from opgrad.ir import Call, Expr
from opgrad.op import Attrs, Input, Operator, require

from ._common import ieee_contract

if TYPE_CHECKING:  # types only: the compiler and the checker sit above the registry
    from opgrad.compiler.builder import KernelBuilder
    from opgrad.compiler.views import View

dense = Operator(
    "dense",
    inputs=[
        Input("data", dims=("N", "K"), doc="(batch, in_features)"),
        Input("weight", dims=("U", "K"), doc="(units, in_features)"),
    ],
    doc="data @ weight.T: (N, K) x (U, K) -> (N, U).",
    linear_in=("data", "weight"),
)


@dense.shape_rule
def _dense_shape(data: TensorType, weight: TensorType, attrs: Attrs) -> TensorType:
    require(data.ndim == 2, f"data must be 2-D (batch, in_features), got shape {data.shape}")
    require(weight.ndim == 2, f"weight must be 2-D (units, in_features), got shape {weight.shape}")
    require(
        data.shape[1] == weight.shape[1],
        f"data has {data.shape[1]} features but weight expects {weight.shape[1]}; "
        f"expected weight shape (units, {data.shape[1]}) -- note opgrad's weight is (units, in), "
        "the transpose of a Keras kernel",
    )
    return TensorType((data.shape[0], weight.shape[0]), data.dtype)


@dense.reference
def _dense_forward(data: np.ndarray, weight: np.ndarray) -> np.ndarray:
    return ieee_contract("nk,uk->nu", data, weight, lambda x, w: x @ w.T)


@dense.gradient
def _dense_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = grad @ weight ; d_weight = grad.T @ data"""
    data, weight = call.args
    return [
        ops.dense(grad, ops.transpose(weight)),
        ops.dense(ops.transpose(grad), ops.transpose(data)),
    ]


@dense.mutant("d_data missing the transpose of weight")
def _dense_data_untransposed(call: Call, grad: Expr) -> list[Expr | None]:
    data, weight = call.args
    return [ops.dense(grad, weight), ops.dense(ops.transpose(grad), ops.transpose(data))]


@dense.mutant("d_weight transposed (grad.T @ data transposed)")
def _dense_weight_transposed(call: Call, grad: Expr) -> list[Expr | None]:
    data, weight = call.args
    return [ops.dense(grad, ops.transpose(weight)), ops.dense(ops.transpose(data), ops.transpose(grad))]


@dense.mutant("gradients of the two inputs swapped")
def _dense_swapped(call: Call, grad: Expr) -> list[Expr | None]:
    data, weight = call.args
    return [ops.dense(ops.transpose(grad), ops.transpose(data)), ops.dense(grad, ops.transpose(weight))]


@dense.mutant("d_weight scaled by 2")
def _dense_weight_doubled(call: Call, grad: Expr) -> list[Expr | None]:
    data, weight = call.args
    return [ops.dense(grad, ops.transpose(weight)), ops.dense(ops.transpose(grad), ops.transpose(data)) * 2.0]


@dense.mutant("cotangent ignored (ones instead)")
def _dense_ones_cotangent(call: Call, grad: Expr) -> list[Expr | None]:
    data, weight = call.args
    ones = ops.ones_like(grad)
    return [ops.dense(ones, ops.transpose(weight)), ops.dense(ops.transpose(ones), ops.transpose(data))]


@dense.lowering
def _dense_lowering(kb: KernelBuilder, call: Call, out: View, data: View, weight: View) -> None:
    """out = data @ weight.T as one GEMM; transposed operands (as in the gradient) are strides"""
    kb.matmul(out, data, weight.T)
