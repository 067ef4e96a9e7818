"""Smooth elementwise unary functions: negative, exp, log, sqrt, sigmoid, tanh.

Their gradients reuse the forward's output (``call``) where that is cheaper, as frameworks do:
exp' = exp, sigmoid' = s (1 - s), tanh' = 1 - t^2, sqrt' = 1 / (2 sqrt). A smooth op whose
reference and lowering are one numpy/libm call is one ``smooth_unary`` declaration.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from opgrad import ops
from opgrad.ir import Call, Expr
from opgrad.op import Input, Operator

from ._common import POSITIVE, same_as_first, smooth_unary, tanh_scalar

if TYPE_CHECKING:  # types only: the compiler and the checker sit above the registry
    from opgrad.compiler.builder import KernelBuilder
    from opgrad.compiler.views import Scalar, View

# ----- negative -----

negative = Operator("negative", inputs=[Input("data")], doc="-data.", jointly_linear=True)
negative.shape_rule(same_as_first)


@negative.reference
def _negative_forward(data: np.ndarray) -> np.ndarray:
    return -data


@negative.gradient
def _negative_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = -grad"""
    return [ops.negative(grad)]


@negative.mutant("gradient not negated")
def _negative_identity(call: Call, grad: Expr) -> list[Expr | None]:
    return [grad]


@negative.mutant("off by 1e-4 relative")
def _negative_slightly_off(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.multiply(grad, -1.0001)]


@negative.lowering
def _negative_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = -data"""
    kb.elementwise(out, [data], lambda s, v: s.neg(v[0]))


# ----- exp -----

exp = smooth_unary(
    "exp", "e ** data.", forward=np.exp,
    gradient=("d_data = grad * exp(data)", lambda call, grad: ops.multiply(grad, call)),
    lowering=("out = exp(data)", lambda s, v: s.call("exp", v[0])),
)


@exp.mutant("a 1e-8 bias: grad * exp(data) + 1e-8, below finite differences' noise, nonzero for a zero cotangent")
def _exp_biased(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.add(ops.multiply(grad, call), 1e-8)]


@exp.mutant("gradient of the wrong input (grad * data)")
def _exp_times_data(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.multiply(grad, call.args[0])]


# ----- log -----

log = smooth_unary(
    "log", "Natural logarithm (data > 0).", forward=np.log, domain=POSITIVE,
    gradient=("d_data = grad / data", lambda call, grad: ops.divide(grad, call.args[0])),
    lowering=("out = log(data)", lambda s, v: s.call("log", v[0])),
)


@log.mutant("1 / data^2")
def _log_squared(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.divide(grad, ops.multiply(call.args[0], call.args[0]))]


# ----- sqrt -----

sqrt = smooth_unary(
    "sqrt", "Square root (data > 0); used by Adam.", forward=np.sqrt, domain=POSITIVE,
    gradient=("d_data = grad / (2 sqrt(data))", lambda call, grad: ops.divide(ops.multiply(grad, 0.5), call)),
    lowering=("out = sqrt(data)", lambda s, v: s.call("sqrt", v[0])),
)


@sqrt.mutant("the 1/2 forgotten: grad / sqrt(data)")
def _sqrt_no_half(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.divide(grad, call)]


@sqrt.mutant("sqrt(data) held constant: right first order, wrong second (grad(grad(sqrt)) = 0)")
def _sqrt_frozen_output(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.divide(ops.multiply(grad, 0.5), ops.stop_gradient(call))]


# ----- sigmoid -----

sigmoid = Operator("sigmoid", inputs=[Input("data")], doc="1 / (1 + e ** -data).")
sigmoid.shape_rule(same_as_first)


@sigmoid.reference
def _sigmoid_forward(data: np.ndarray) -> np.ndarray:
    # Two branches so that neither exp overflows for large |data|.
    out = np.empty_like(data)
    pos = data >= 0
    out[pos] = 1.0 / (1.0 + np.exp(-data[pos]))
    e = np.exp(data[~pos])
    out[~pos] = e / (1.0 + e)
    return out


@sigmoid.gradient
def _sigmoid_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = grad * s * (1 - s), s = sigmoid(data)"""
    return [ops.multiply(grad, ops.multiply(call, ops.subtract(1.0, call)))]


@sigmoid.mutant("s instead of s (1 - s)")
def _sigmoid_s_only(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.multiply(grad, call)]


@sigmoid.lowering
def _sigmoid_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = 1 / (1 + e) if data >= 0 else e / (1 + e), e = exp(-|data|): no overflow either side"""

    def body(s: Scalar, v: list[str]) -> str:
        e = s.call("exp", s.neg(s.call("fabs", v[0])))
        d = s.add(s.const(1.0), e)
        return s.select(s.cmp("oge", v[0], s.const(0.0)), s.div(s.const(1.0), d), s.div(e, d))

    kb.elementwise(out, [data], body)


# ----- tanh -----

tanh = smooth_unary(
    "tanh", "Hyperbolic tangent.", forward=np.tanh,
    gradient=("d_data = grad * (1 - t^2), t = tanh(data)",
              lambda call, grad: ops.multiply(grad, ops.subtract(1.0, ops.multiply(call, call)))),
    lowering=("out = tanh(data), from exp (tanh_scalar)", lambda s, v: tanh_scalar(s, v[0])),
)


@tanh.mutant("1 - t instead of 1 - t^2")
def _tanh_not_squared(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.multiply(grad, ops.subtract(1.0, call))]


@tanh.mutant("cotangent ignored (TVM's all-ones blind spot)")
def _tanh_cotangent_ignored(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.subtract(1.0, ops.multiply(call, call))]
