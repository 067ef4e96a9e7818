"""Activation functions as PyTorch defines them: gelu (erf and tanh forms), softplus, elu,
log_sigmoid, and erf and erfc, which gelu and its exact gradient are built from.

Each forward matches ``torch.nn.functional`` of the same name (and its defaults); the gradients
follow PyTorch's backward formulas, including its choice at elu's kink and softplus's threshold.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from opgrad import ops
from opgrad.ir import Call, Expr
from opgrad.op import Attr, Attrs, Case, Input, Interval, Kink, Operator

from ._common import distance_to_zero, erfc_scalar, place_on_zero, same_as_first, tanh_scalar

if TYPE_CHECKING:  # types only: the compiler and the checker sit above the registry
    from opgrad.checks.strategies import CaseDraw
    from opgrad.compiler.builder import KernelBuilder
    from opgrad.compiler.views import Scalar, View

_SQRT1_2 = 1.0 / math.sqrt(2.0)
_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_TANH_SCALE = math.sqrt(2.0 / math.pi)  # gelu's tanh form: tanh(sqrt(2/pi) (x + 0.044715 x^3))
_TANH_CUBIC = 0.044715

_erf_scalar = np.vectorize(math.erf, otypes=[np.float64])
_erfc_scalar = np.vectorize(math.erfc, otypes=[np.float64])


def _finite_float(value: Any) -> float:
    number = float(value)
    if not np.isfinite(number):
        raise ValueError("expected a finite number")
    return number


def _positive_float(value: Any) -> float:
    number = _finite_float(value)
    if number <= 0:
        raise ValueError("expected a number > 0")
    return number


# ----- erf -----

erf = Operator("erf", inputs=[Input("data")], doc="The error function 2/sqrt(pi) * integral_0^data exp(-t^2) dt "
               "(torch.erf, math.erf).")
erf.shape_rule(same_as_first)


@erf.reference
def _erf_forward(data: np.ndarray) -> np.ndarray:
    # math.erf in float64 is correctly rounded to a few ulp; float32 rounds that result once.
    return np.asarray(_erf_scalar(data).astype(data.dtype, copy=False).reshape(data.shape))


@erf.gradient
def _erf_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = grad * 2/sqrt(pi) * exp(-data^2)"""
    return [ops.multiply(grad, _gaussian(call.args[0], _TWO_OVER_SQRT_PI))]


def _gaussian(data: Expr, scale: float) -> Expr:
    """scale * exp(-data^2): erf's derivative with scale 2/sqrt(pi), erfc's with -2/sqrt(pi)."""
    return ops.multiply(ops.exp(ops.negative(ops.multiply(data, data))), scale)


@erf.mutant("missing the 2/sqrt(pi) factor")
def _erf_unscaled(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.multiply(grad, _gaussian(call.args[0], 1.0))]


@erf.lowering
def _erf_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = erf(data) (libm erf / erff)"""
    kb.elementwise(out, [data], lambda s, v: s.libm("erf", v[0]))


# ----- erfc -----

erfc = Operator("erfc", inputs=[Input("data")], doc="The complementary error function 1 - erf(data) (torch.erfc, "
                "math.erfc), accurate where erf(data) is close to 1, with no cancellation.")
erfc.shape_rule(same_as_first)


@erfc.reference
def _erfc_forward(data: np.ndarray) -> np.ndarray:
    return np.asarray(_erfc_scalar(data).astype(data.dtype, copy=False).reshape(data.shape))


@erfc.gradient
def _erfc_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = -grad * 2/sqrt(pi) * exp(-data^2)"""
    return [ops.multiply(grad, _gaussian(call.args[0], -_TWO_OVER_SQRT_PI))]


@erfc.mutant("the sign of erf's gradient")
def _erfc_as_erf(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.multiply(grad, _gaussian(call.args[0], _TWO_OVER_SQRT_PI))]


@erfc.lowering
def _erfc_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = erfc(data): float32 from exp and a Chebyshev fit (erfc_scalar), float64 libm erfc"""
    kb.elementwise(out, [data], lambda s, v: erfc_scalar(s, v[0]))


# ----- gelu -----


def _approximate(value: Any) -> str:
    if value not in ("none", "tanh"):
        raise ValueError("expected 'none' (the exact erf form) or 'tanh' (PyTorch's approximation)")
    return str(value)


gelu = Operator(
    "gelu",
    inputs=[Input("data", domain=(Interval(-4.0, 4.0),))],  # wide enough to reach both flat tails
    attrs=[Attr("approximate", default="none", convert=_approximate,
                doc="'none': data * Phi(data) with the normal CDF Phi (erf form, PyTorch's default); "
                    "'tanh': 0.5 data (1 + tanh(sqrt(2/pi) (data + 0.044715 data^3)))")],
    doc="Gaussian error linear unit, as torch.nn.functional.gelu: 0.5 data (1 + erf(data / sqrt(2))), "
        "or its tanh approximation.",
)
gelu.shape_rule(same_as_first)


def _gelu_tanh_inner(data: np.ndarray) -> np.ndarray:
    return np.asarray(_TANH_SCALE * (data + _TANH_CUBIC * data * data * data))


@gelu.reference
def _gelu_forward(data: np.ndarray, approximate: str) -> np.ndarray:
    if approximate == "tanh":
        return np.asarray((0.5 * data * (1.0 + np.tanh(_gelu_tanh_inner(data)))).astype(data.dtype, copy=False))
    cdf = 0.5 * _erfc_scalar(-data * _SQRT1_2).reshape(data.shape)
    return np.asarray((data * cdf).astype(data.dtype, copy=False))


@gelu.gradient
def _gelu_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = grad * (Phi(x) + x phi(x)) ('none'); grad * (0.5 (1 + t) + 0.5 x (1 - t^2) u'(x)) ('tanh')

    Phi(x) = erfc(-x / sqrt 2) / 2 (= (1 + erf(x / sqrt 2)) / 2 without its cancellation far below
    zero, where both terms are tiny), phi(x) = exp(-x^2 / 2) / sqrt(2 pi);
    t = tanh(u), u = sqrt(2/pi) (x + 0.044715 x^3), u'(x) = sqrt(2/pi) (1 + 3 * 0.044715 x^2).
    """
    x = call.args[0]
    square = ops.multiply(x, x)
    if call.attrs["approximate"] == "tanh":
        t = ops.tanh(ops.multiply(ops.add(x, ops.multiply(ops.multiply(square, x), _TANH_CUBIC)), _TANH_SCALE))
        du = ops.multiply(ops.add(ops.multiply(square, 3.0 * _TANH_CUBIC), 1.0), _TANH_SCALE)
        slope = ops.add(ops.multiply(ops.add(t, 1.0), 0.5),
                        ops.multiply(ops.multiply(x, 0.5), ops.multiply(ops.subtract(1.0, ops.multiply(t, t)), du)))
        return [ops.multiply(grad, slope)]
    cdf = ops.multiply(ops.erfc(ops.multiply(x, -_SQRT1_2)), 0.5)
    pdf = ops.multiply(ops.exp(ops.multiply(square, -0.5)), _INV_SQRT_2PI)
    return [ops.multiply(grad, ops.add(cdf, ops.multiply(x, pdf)))]


@gelu.mutant("drops the x * phi(x) term (treats Phi as constant)")
def _gelu_cdf_only(call: Call, grad: Expr) -> list[Expr | None]:
    x = call.args[0]
    if call.attrs["approximate"] == "tanh":
        inner = ops.multiply(ops.add(x, ops.multiply(ops.multiply(ops.multiply(x, x), x), _TANH_CUBIC)), _TANH_SCALE)
        return [ops.multiply(grad, ops.multiply(ops.add(ops.tanh(inner), 1.0), 0.5))]
    return [ops.multiply(grad, ops.multiply(ops.erfc(ops.multiply(x, -_SQRT1_2)), 0.5))]


@gelu.sampler
def _gelu_cases(d: CaseDraw) -> Case:
    return Case([d.shape()], {"approximate": d.choice(["none", "tanh"])})


@gelu.lowering
def _gelu_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = 0.5 x erfc(-x / sqrt 2) or 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))"""
    if call.attrs["approximate"] == "tanh":
        def body(s: Scalar, v: list[str]) -> str:
            x = v[0]
            cube = s.mul(s.mul(x, x), x)
            inner = s.mul(s.const(_TANH_SCALE), s.add(x, s.mul(s.const(_TANH_CUBIC), cube)))
            return s.mul(s.mul(s.const(0.5), x), s.add(s.const(1.0), tanh_scalar(s, inner)))
    else:
        def body(s: Scalar, v: list[str]) -> str:
            x = v[0]
            cdf = s.mul(s.const(0.5), erfc_scalar(s, s.mul(x, s.const(-_SQRT1_2))))
            return s.mul(x, cdf)
    kb.elementwise(out, [data], body)


# ----- softplus -----


def _softplus_distance(inputs: Sequence[np.ndarray], attrs: Attrs) -> float:
    data = inputs[0]
    return float(np.min(np.abs(data - attrs["threshold"] / attrs["beta"]))) if data.size else float("inf")


def _softplus_place(rng: np.random.Generator, inputs: list[np.ndarray], attrs: Attrs) -> list[np.ndarray]:
    data = inputs[0].copy()
    data[rng.random(data.shape) < 0.5] = attrs["threshold"] / attrs["beta"]
    return [data]


def _softplus_subgradient(inputs: Sequence[np.ndarray], cotangent: np.ndarray, attrs: Attrs) -> list[np.ndarray | None]:
    z = attrs["beta"] * inputs[0]
    return [cotangent * np.where(z > attrs["threshold"], 1.0, 1.0 / (1.0 + np.exp(-z)))]


softplus = Operator(
    "softplus",
    inputs=[Input("data")],
    attrs=[
        Attr("beta", default=1.0, convert=_positive_float, doc="sharpness: log(1 + exp(beta x)) / beta"),
        Attr("threshold", default=20.0, convert=_finite_float,
             doc="above it (beta x > threshold) the op is linear: data"),
    ],
    doc="log(1 + exp(beta data)) / beta, and data itself where beta data > threshold, as "
        "torch.nn.functional.softplus (defaults beta=1, threshold=20).",
    kinks=Kink(
        convention="at beta x == threshold the softplus side applies (sigmoid(beta x)), as PyTorch: "
                   "the switch to the linear side is strict",
        distance=_softplus_distance,
        place=_softplus_place,
        subgradient=_softplus_subgradient,
    ),
)
softplus.shape_rule(same_as_first)


@softplus.reference
def _softplus_forward(data: np.ndarray, beta: float, threshold: float) -> np.ndarray:
    z = data * beta
    # exp reads z clamped at the threshold: those elements take the linear side, so no overflow.
    smooth = np.log1p(np.exp(np.minimum(z, threshold))) / beta
    return np.where(z > threshold, data, smooth).astype(data.dtype, copy=False)


@softplus.gradient
def _softplus_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = grad if beta x > threshold else grad * sigmoid(beta x)"""
    z = ops.multiply(call.args[0], call.attrs["beta"])
    linear = ops.greater(z, ops.add(ops.zeros_like(z), call.attrs["threshold"]))
    return [ops.where(linear, grad, ops.multiply(grad, ops.sigmoid(z)))]


@softplus.mutant("forgets beta inside the sigmoid")
def _softplus_no_beta(call: Call, grad: Expr) -> list[Expr | None]:
    x = call.args[0]
    linear = ops.greater(ops.multiply(x, call.attrs["beta"]), ops.add(ops.zeros_like(x), call.attrs["threshold"]))
    return [ops.where(linear, grad, ops.multiply(grad, ops.sigmoid(x)))]


@softplus.sampler
def _softplus_cases(d: CaseDraw) -> Case:
    # Powers of two keep beta * (threshold / beta) == threshold exact, so check f lands on the switch;
    # small thresholds put the linear side inside the drawn range [-2, 2].
    return Case([d.shape()], {"beta": d.choice([1.0, 0.5, 2.0]), "threshold": d.choice([20.0, 1.0, 0.5, -1.0])})


@softplus.lowering
def _softplus_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = data if beta data > threshold else log1p(exp(beta data)) / beta"""
    beta, threshold = call.attrs["beta"], call.attrs["threshold"]

    def body(s: Scalar, v: list[str]) -> str:
        z = s.mul(v[0], s.const(beta))
        # exp may overflow to inf above the threshold; the select discards those elements.
        smooth = s.div(s.libm("log1p", s.call("exp", z)), s.const(beta))
        return s.select(s.cmp("ogt", z, s.const(threshold)), v[0], smooth)

    kb.elementwise(out, [data], body)


# ----- elu -----


def _elu_subgradient(inputs: Sequence[np.ndarray], cotangent: np.ndarray, attrs: Attrs) -> list[np.ndarray | None]:
    data = inputs[0]
    return [cotangent * np.where(data > 0, 1.0, attrs["alpha"] * np.exp(np.minimum(data, 0.0)))]


elu = Operator(
    "elu",
    inputs=[Input("data")],
    attrs=[Attr("alpha", default=1.0, convert=_finite_float,
                doc="the negative side saturates at -alpha (any finite value, as PyTorch and ONNX)")],
    doc="data if data > 0 else alpha (exp(data) - 1), as torch.nn.functional.elu.",
    kinks=Kink(
        convention="elu'(0) = alpha: at exactly zero the negative side's slope, as PyTorch",
        distance=distance_to_zero,
        place=place_on_zero,
        subgradient=_elu_subgradient,
    ),
)
elu.shape_rule(same_as_first)


@elu.reference
def _elu_forward(data: np.ndarray, alpha: float) -> np.ndarray:
    return np.where(data > 0, data, alpha * np.expm1(np.minimum(data, 0))).astype(data.dtype, copy=False)


@elu.gradient
def _elu_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = grad if data > 0 else grad * alpha * exp(data)"""
    data = call.args[0]
    positive = ops.greater(data, ops.zeros_like(data))
    return [ops.where(positive, grad, ops.multiply(grad, ops.multiply(ops.exp(data), call.attrs["alpha"])))]


@elu.mutant("negative side's slope without alpha (exp(data))")
def _elu_no_alpha(call: Call, grad: Expr) -> list[Expr | None]:
    data = call.args[0]
    return [ops.where(ops.greater(data, ops.zeros_like(data)), grad, ops.multiply(grad, ops.exp(data)))]


@elu.sampler
def _elu_cases(d: CaseDraw) -> Case:
    return Case([d.shape()], {"alpha": d.choice([1.0, 0.5, 2.0, -0.5])})


@elu.lowering
def _elu_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = data if data > 0 else alpha * expm1(data)"""
    alpha = call.attrs["alpha"]
    kb.elementwise(out, [data], lambda s, v: s.select(s.cmp("ogt", v[0], s.const(0.0)), v[0],
                                                      s.mul(s.const(alpha), s.libm("expm1", v[0]))))


# ----- log_sigmoid -----

log_sigmoid = Operator(
    "log_sigmoid",
    inputs=[Input("data", domain=(Interval(-6.0, 6.0),))],
    doc="log(sigmoid(data)) = min(data, 0) - log1p(exp(-|data|)), stable for large |data|, as "
        "torch.nn.functional.logsigmoid.",
)
log_sigmoid.shape_rule(same_as_first)


@log_sigmoid.reference
def _log_sigmoid_forward(data: np.ndarray) -> np.ndarray:
    return np.asarray((np.minimum(data, 0) - np.log1p(np.exp(-np.abs(data)))).astype(data.dtype, copy=False))


@log_sigmoid.gradient
def _log_sigmoid_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = grad * sigmoid(-data)"""
    return [ops.multiply(grad, ops.sigmoid(ops.negative(call.args[0])))]


@log_sigmoid.mutant("sigmoid(data) instead of sigmoid(-data)")
def _log_sigmoid_wrong_sign(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.multiply(grad, ops.sigmoid(call.args[0]))]


@log_sigmoid.lowering
def _log_sigmoid_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = min(data, 0) - log1p(exp(-|data|))"""
    kb.elementwise(out, [data], lambda s, v: s.sub(s.min(v[0], s.const(0.0)),
                                                   s.libm("log1p", s.call("exp", s.neg(s.call("fabs", v[0]))))))
