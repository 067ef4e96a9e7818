"""relu: max(data, 0), with the subgradient 0 at the kink data == 0 (as PyTorch, JAX, TF)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from opgrad import ops
from opgrad.ir import Call, Expr
from opgrad.op import Attrs, Input, Kink, Operator

from ._common import distance_to_zero, place_on_zero, same_as_first

if TYPE_CHECKING:  # types only: the compiler and the checker sit above the registry
    from opgrad.compiler.builder import KernelBuilder
    from opgrad.compiler.views import View


def _relu_subgradient(inputs: Sequence[np.ndarray], cotangent: np.ndarray, attrs: Attrs) -> list[np.ndarray | None]:
    return [cotangent * (inputs[0] > 0)]


relu = Operator(
    "relu",
    inputs=[Input("data")],
    doc="max(data, 0).",
    kinks=Kink(
        convention="relu'(0) = 0: the gradient at exactly zero is zero",
        distance=distance_to_zero,
        place=place_on_zero,
        subgradient=_relu_subgradient,
    ),
)
relu.shape_rule(same_as_first)


@relu.reference
def _relu_forward(data: np.ndarray) -> np.ndarray:
    return np.asarray(np.maximum(data, 0).astype(data.dtype, copy=False))


@relu.gradient
def _relu_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = grad * (data > 0), computed as grad * (relu(data) > 0)"""
    # Reading the output rather than the input gives the same mask and leaves the input with a
    # single reader, so the compiler can fuse relu into its producer (bias_add after a conv).
    return [ops.multiply(grad, ops.greater(call, ops.zeros_like(call)))]


@relu.mutant("subgradient 1 at the kink (data >= 0)")
def _relu_one_at_kink(call: Call, grad: Expr) -> list[Expr | None]:
    data = call.args[0]
    return [ops.multiply(grad, ops.subtract(1.0, ops.greater(ops.zeros_like(data), data)))]


@relu.lowering
def _relu_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = max(data, 0)"""
    kb.elementwise(out, [data], lambda s, v: s.max(v[0], s.const(0.0)))
