"""leaky_relu: data where data > 0, else alpha * data.

This is the worked example of docs/contributing-an-operator.md: one file, and the checker
derives everything else (shapes, values away from the kink at 0, alpha values) from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from opgrad import ops
from opgrad.ir import Call, Expr
from opgrad.op import Attr, Attrs, Case, Input, Kink, Operator

from ._common import distance_to_zero, place_on_zero, same_as_first

if TYPE_CHECKING:  # types only: the compiler and the checker sit above the registry
    from opgrad.checks.strategies import CaseDraw
    from opgrad.compiler.builder import KernelBuilder
    from opgrad.compiler.views import View


def _alpha(value: Any) -> float:
    """Any finite slope, negative ones too, as PyTorch's LeakyReLU and ONNX's LeakyRelu take."""
    alpha = float(value)
    if not np.isfinite(alpha):
        raise ValueError("expected a finite slope")
    return alpha


def _subgradient(inputs: Sequence[np.ndarray], cotangent: np.ndarray, attrs: Attrs) -> list[np.ndarray | None]:
    return [cotangent * np.where(inputs[0] > 0, 1.0, attrs["alpha"])]


leaky_relu = Operator(
    "leaky_relu",
    inputs=[Input("data")],
    attrs=[Attr("alpha", default=0.01, convert=_alpha, doc="slope for data <= 0")],
    doc="data if data > 0 else alpha * data.",
    kinks=Kink(
        convention="leaky_relu'(0) = alpha: at exactly zero the slope of the negative side",
        distance=distance_to_zero,
        place=place_on_zero,
        subgradient=_subgradient,
    ),
)
leaky_relu.shape_rule(same_as_first)


@leaky_relu.reference
def _leaky_relu_forward(data: np.ndarray, alpha: float) -> np.ndarray:
    return np.where(data > 0, data, alpha * data).astype(data.dtype, copy=False)


@leaky_relu.gradient
def _leaky_relu_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = grad * (1 if data > 0 else alpha)"""
    data = call.args[0]
    positive = ops.greater(data, ops.zeros_like(data))
    return [ops.where(positive, grad, ops.multiply(grad, call.attrs["alpha"]))]


@leaky_relu.mutant("alpha on the positive side instead of the negative one")
def _leaky_relu_sides_swapped(call: Call, grad: Expr) -> list[Expr | None]:
    data = call.args[0]
    positive = ops.greater(data, ops.zeros_like(data))
    return [ops.where(positive, ops.multiply(grad, call.attrs["alpha"]), grad)]


@leaky_relu.mutant("relu's rule: zero gradient on the negative side")
def _leaky_relu_as_relu(call: Call, grad: Expr) -> list[Expr | None]:
    data = call.args[0]
    return [ops.where(ops.greater(data, ops.zeros_like(data)), grad, ops.zeros_like(grad))]


@leaky_relu.mutant("slope 1 at exactly zero (data >= 0) against the declared alpha")
def _leaky_relu_kink_side(call: Call, grad: Expr) -> list[Expr | None]:
    data = call.args[0]
    negative = ops.greater(ops.zeros_like(data), data)
    return [ops.where(negative, ops.multiply(grad, call.attrs["alpha"]), grad)]


@leaky_relu.sampler
def _leaky_relu_cases(d: CaseDraw) -> Case:
    return Case([d.shape()], {"alpha": d.choice([0.01, 0.2, 0.5, -0.3])})


@leaky_relu.lowering
def _leaky_relu_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = data if data > 0 else alpha * data"""
    alpha = kb.scalar(call.attrs["alpha"], out.dtype)
    kb.elementwise(out, [data, alpha], lambda s, v: s.select(s.cmp("ogt", v[0], s.const(0.0)), v[0],
                                                             s.mul(v[1], v[0])), broadcast=True)
