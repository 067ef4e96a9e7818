"""matmul (2-D, numpy's ``a @ b``) and batch_matmul ((B, M, K) @ (B, K, N), a batch of 1 broadcasts).

Unlike ``dense`` (data @ weight.T), neither operand is transposed. Transposed operands in the
gradients are strides of the GEMM, never copies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from opgrad import ops
from opgrad.dtypes import TensorType
from opgrad.ir import Call, Expr
from opgrad.op import Attrs, Case, Input, Operator, require

from ._common import ieee_contract

if TYPE_CHECKING:  # types only: the compiler and the checker sit above the registry
    from opgrad.checks.strategies import CaseDraw
    from opgrad.compiler.builder import KernelBuilder
    from opgrad.compiler.views import View

# ----- matmul -----

matmul = Operator(
    "matmul",
    inputs=[Input("a", dims=("M", "K"), doc="(M, K)"), Input("b", dims=("K", "N"), doc="(K, N)")],
    doc="a @ b for 2-D a (M, K) and b (K, N) -> (M, N) (np.matmul, torch.mm).",
    linear_in=("a", "b"),
)


@matmul.shape_rule
def _matmul_shape(a: TensorType, b: TensorType, attrs: Attrs) -> TensorType:
    require(a.ndim == 2 and b.ndim == 2,
            f"matmul multiplies 2-D matrices, got a of rank {a.ndim} and b of rank {b.ndim}; "
            "use batch_matmul for (B, M, K) @ (B, K, N)")
    require(a.shape[1] == b.shape[0],
            f"a has {a.shape[1]} columns but b has {b.shape[0]} rows; expected b shape ({a.shape[1]}, N)")
    return TensorType((a.shape[0], b.shape[1]), a.dtype)


@matmul.reference
def _matmul_forward(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return ieee_contract("mk,kn->mn", a, b, np.matmul)


@matmul.gradient
def _matmul_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_a = grad @ b.T ; d_b = a.T @ grad"""
    a, b = call.args
    return [ops.matmul(grad, ops.transpose(b)), ops.matmul(ops.transpose(a), grad)]


@matmul.mutant("d_b = grad.T @ a (the transpose of the right answer)")
def _matmul_transposed_db(call: Call, grad: Expr) -> list[Expr | None]:
    a, b = call.args
    return [ops.matmul(grad, ops.transpose(b)), ops.transpose(ops.matmul(ops.transpose(a), grad))]


@matmul.mutant("d_a ignores the cotangent (ones)")
def _matmul_ones(call: Call, grad: Expr) -> list[Expr | None]:
    a, b = call.args
    return [ops.matmul(ops.ones_like(grad), ops.transpose(b)), ops.matmul(ops.transpose(a), grad)]


@matmul.lowering
def _matmul_lowering(kb: KernelBuilder, call: Call, out: View, a: View, b: View) -> None:
    """out = a @ b as one GEMM"""
    kb.matmul(out, a, b)


# ----- batch_matmul -----

batch_matmul = Operator(
    "batch_matmul",
    inputs=[Input("a", doc="(B or 1, M, K)"), Input("b", doc="(B or 1, K, N)")],
    doc="a[i] @ b[i] for each batch entry: (B, M, K) x (B, K, N) -> (B, M, N); a batch dim of 1 "
        "broadcasts (np.matmul, torch.bmm with broadcasting).",
    linear_in=("a", "b"),
)


@batch_matmul.shape_rule
def _batch_matmul_shape(a: TensorType, b: TensorType, attrs: Attrs) -> TensorType:
    require(a.ndim == 3 and b.ndim == 3,
            f"batch_matmul needs 3-D (B, M, K) and (B, K, N), got a of rank {a.ndim} and b of rank {b.ndim}")
    require(a.shape[2] == b.shape[1],
            f"a has {a.shape[2]} columns per matrix but b has {b.shape[1]} rows; expected b shape "
            f"(B, {a.shape[2]}, N)")
    batch_a, batch_b = a.shape[0], b.shape[0]
    require(batch_a == batch_b or 1 in (batch_a, batch_b),
            f"batch sizes {batch_a} and {batch_b} differ and neither is 1 (a batch of 1 broadcasts)")
    batch = batch_a if batch_b == 1 else batch_b
    return TensorType((batch, a.shape[1], b.shape[2]), a.dtype)


@batch_matmul.reference
def _batch_matmul_forward(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return ieee_contract("...mk,...kn->...mn", a, b, np.matmul)


@batch_matmul.gradient
def _batch_matmul_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_a = grad @ b^T per batch ; d_b = a^T @ grad per batch (autodiff sums a broadcast batch of 1)"""
    a, b = call.args
    swap = (0, 2, 1)
    return [ops.batch_matmul(grad, ops.transpose(b, axes=swap)), ops.batch_matmul(ops.transpose(a, axes=swap), grad)]


@batch_matmul.mutant("d_b = grad^T @ a per batch (the transpose of a^T @ grad)")
def _batch_matmul_transposed_db(call: Call, grad: Expr) -> list[Expr | None]:
    a, b = call.args
    swap = (0, 2, 1)
    return [ops.batch_matmul(grad, ops.transpose(b, axes=swap)), ops.batch_matmul(ops.transpose(grad, axes=swap), a)]


@batch_matmul.mutant("d_a from the cotangent summed over the batch, for every entry")
def _batch_matmul_summed_batch(call: Call, grad: Expr) -> list[Expr | None]:
    a, b = call.args
    swap = (0, 2, 1)
    summed = ops.broadcast_to(ops.sum(grad, axis=0, keepdims=True), shape=grad.shape)
    return [ops.batch_matmul(summed, ops.transpose(b, axes=swap)), ops.batch_matmul(ops.transpose(a, axes=swap), grad)]


@batch_matmul.sampler
def _batch_matmul_cases(d: CaseDraw) -> Case:
    batch, m, k, n = d.size(), d.size(), d.size(), d.size()
    batch_a, batch_b = d.choice([(batch, batch), (1, batch), (batch, 1), (1, 1)])
    return Case([(batch_a, m, k), (batch_b, k, n)])


@batch_matmul.lowering
def _batch_matmul_lowering(kb: KernelBuilder, call: Call, out: View, a: View, b: View) -> None:
    """out[i] = a[i or 0] @ b[i or 0]: one GEMM kernel looping over the batch"""
    kb.batch_matmul(out, a, b)
