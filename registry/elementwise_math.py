"""Elementwise math with numpy semantics: abs, square, rsqrt, clip, maximum, minimum, power,
and the two ops that only route values: stop_gradient and cast.

maximum and minimum broadcast like add and propagate NaN like np.maximum/np.minimum. Where these
ops are not differentiable (abs at 0, clip at its bounds, ties of maximum/minimum) each declares
the subgradient it uses as a ``Kink``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from opgrad import ops
from opgrad.dtypes import FLOAT_DTYPES, TensorType
from opgrad.ir import Call, Expr
from opgrad.op import Attr, Attrs, Case, Input, Kink, Operator, Subgradient, require

from ._common import (
    POSITIVE,
    broadcast_rule,
    distance_to_zero,
    place_on_zero,
    same_as_first,
    smooth_unary,
)
from .collapse_sum_like import sum_to_shape

if TYPE_CHECKING:  # types only: the compiler and the checker sit above the registry
    from opgrad.checks.strategies import CaseDraw
    from opgrad.compiler.builder import KernelBuilder
    from opgrad.compiler.views import Scalar, View


def _sign(data: Expr) -> Expr:
    """sign(data) as registered ops: 1, -1, or 0 at exactly 0 (NaN gives 0)"""
    zeros = ops.zeros_like(data)
    return ops.subtract(ops.greater(data, zeros), ops.greater(zeros, data))


# ----- abs -----


def _abs_subgradient(inputs: Sequence[np.ndarray], cotangent: np.ndarray, attrs: Attrs) -> list[np.ndarray | None]:
    return [cotangent * np.sign(inputs[0])]


abs = Operator(  # shadows the builtin on purpose: the op is called abs, as in numpy
    "abs",
    inputs=[Input("data")],
    doc="|data| (np.abs, torch.abs).",
    kinks=Kink(
        convention="abs'(0) = 0 (sign(0) = 0), as PyTorch",
        distance=distance_to_zero,
        place=place_on_zero,
        subgradient=_abs_subgradient,
    ),
)
abs.shape_rule(same_as_first)


@abs.reference
def _abs_forward(data: np.ndarray) -> np.ndarray:
    return np.asarray(np.abs(data))


@abs.gradient
def _abs_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = grad * sign(data), sign(0) = 0"""
    return [ops.multiply(grad, _sign(call.args[0]))]


@abs.mutant("subgradient 1 at 0 (data >= 0 taken as positive)")
def _abs_one_at_zero(call: Call, grad: Expr) -> list[Expr | None]:
    data = call.args[0]
    negative = ops.greater(ops.zeros_like(data), data)
    return [ops.multiply(grad, ops.subtract(1.0, ops.multiply(negative, 2.0)))]


@abs.lowering
def _abs_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = fabs(data)"""
    kb.elementwise(out, [data], lambda s, v: s.call("fabs", v[0]))


# ----- square -----

square = smooth_unary(
    "square", "data * data (np.square, torch.square).", forward=np.square,
    gradient=("d_data = 2 grad data", lambda call, grad: ops.multiply(grad, ops.multiply(call.args[0], 2.0))),
    lowering=("out = data * data", lambda s, v: s.mul(v[0], v[0])),
)


@square.mutant("forgets the factor 2")
def _square_no_two(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.multiply(grad, call.args[0])]


# ----- rsqrt -----

rsqrt = smooth_unary(
    "rsqrt", "1 / sqrt(data) (torch.rsqrt); inf at 0 and NaN below, as numpy's 1 / np.sqrt.",
    forward=lambda data: 1 / np.sqrt(data), domain=POSITIVE,
    gradient=("d_data = -grad * out^3 / 2, out = rsqrt(data)",
              lambda call, grad: ops.multiply(grad, ops.multiply(ops.multiply(call, ops.multiply(call, call)), -0.5))),
    lowering=("out = 1 / sqrt(data)", lambda s, v: s.div(s.const(1.0), s.call("sqrt", v[0]))),
)


@rsqrt.mutant("d/dx of sqrt instead of 1/sqrt: grad * out / 2")
def _rsqrt_sqrt_rule(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.multiply(grad, ops.multiply(call, 0.5))]


# ----- clip -----


def _bound(default: float) -> Callable[[Any], float]:
    def convert(value: Any) -> float:
        if value is None:
            return default
        bound = float(value)
        if np.isnan(bound):
            raise ValueError("expected a number or None (no bound), got NaN")
        return bound

    return convert


def _upper_bound(value: Any, types: Sequence[TensorType], attrs: Attrs) -> float:
    hi = _bound(np.inf)(value)
    if hi < attrs["lo"]:
        raise ValueError(f"expected hi >= lo = {attrs['lo']}")
    return hi


def _clip_distance(inputs: Sequence[np.ndarray], attrs: Attrs) -> float:
    data = inputs[0]
    if not data.size:
        return float("inf")
    return float(np.min(np.minimum(np.abs(data - attrs["lo"]), np.abs(data - attrs["hi"]))))


def _clip_place(rng: np.random.Generator, inputs: list[np.ndarray], attrs: Attrs) -> list[np.ndarray]:
    data = inputs[0].copy()
    pick = rng.random(data.shape)
    if np.isfinite(attrs["lo"]):
        data[pick < 0.3] = attrs["lo"]
    if np.isfinite(attrs["hi"]):
        data[pick > 0.7] = attrs["hi"]
    return [data]


def _clip_subgradient(inputs: Sequence[np.ndarray], cotangent: np.ndarray, attrs: Attrs) -> list[np.ndarray | None]:
    data = inputs[0]
    return [cotangent * ((data > attrs["lo"]) & (data < attrs["hi"]))]


clip = Operator(
    "clip",
    inputs=[Input("data")],
    attrs=[
        Attr("lo", default=None, convert=_bound(-np.inf), doc="lower bound; None: no lower bound"),
        Attr("hi", default=None, convert=_upper_bound, uses_types=True,
             doc="upper bound (>= lo); None: no upper bound"),
    ],
    doc="np.clip(data, lo, hi): min(max(data, lo), hi); NaN stays NaN.",
    kinks=Kink(
        convention="clip'(lo) = clip'(hi) = 0: the gradient is 1 only strictly inside (lo, hi) "
                   "(PyTorch's clamp passes it at the bounds too)",
        distance=_clip_distance,
        place=_clip_place,
        subgradient=_clip_subgradient,
    ),
)
clip.shape_rule(same_as_first)


@clip.reference
def _clip_forward(data: np.ndarray, lo: float, hi: float) -> np.ndarray:
    return np.asarray(np.clip(data, lo, hi).astype(data.dtype, copy=False))


@clip.gradient
def _clip_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = grad * (lo < data < hi)"""
    data = call.args[0]
    zeros = ops.zeros_like(data)
    above = ops.greater(data, ops.add(zeros, call.attrs["lo"]))
    below = ops.greater(ops.add(zeros, call.attrs["hi"]), data)
    return [ops.multiply(grad, ops.multiply(above, below))]


@clip.mutant("passes the gradient at and beyond the upper bound")
def _clip_ignores_hi(call: Call, grad: Expr) -> list[Expr | None]:
    data = call.args[0]
    return [ops.multiply(grad, ops.greater(data, ops.add(ops.zeros_like(data), call.attrs["lo"])))]


@clip.sampler
def _clip_cases(d: CaseDraw) -> Case:
    lo = d.choice([-1.0, -0.5, 0.0, None])
    hi = d.choice([h for h in (0.5, 1.0, -0.5, None) if h is None or lo is None or h >= lo])
    return Case([d.shape()], {"lo": lo, "hi": hi})


@clip.lowering
def _clip_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = lo if data < lo else hi if data > hi else data (NaN fails both compares and stays)"""
    lo, hi = call.attrs["lo"], call.attrs["hi"]

    def body(s: Scalar, v: list[str]) -> str:
        upper = s.select(s.cmp("ogt", v[0], s.const(hi)), s.const(hi), v[0])
        return s.select(s.cmp("olt", v[0], s.const(lo)), s.const(lo), upper)

    kb.elementwise(out, [data], body)


# ----- maximum / minimum -----


def _pair_distance(inputs: Sequence[np.ndarray], attrs: Attrs) -> float:
    lhs, rhs = np.broadcast_arrays(*inputs)
    return float(np.min(np.abs(lhs - rhs))) if lhs.size else float("inf")


def _place_ties(rng: np.random.Generator, inputs: list[np.ndarray], attrs: Attrs) -> list[np.ndarray]:
    """Copy lhs into rhs at random output positions (each position maps to one element of each)."""
    lhs, rhs = inputs[0].copy(), inputs[1].copy()
    shape = np.broadcast_shapes(lhs.shape, rhs.shape)
    lhs_b, rhs_index = np.broadcast_to(lhs, shape), np.broadcast_to(
        np.arange(rhs.size).reshape(rhs.shape), shape)
    picked = rng.random(shape) < 0.5
    rhs.flat[rhs_index[picked]] = lhs_b[picked]
    return [lhs, rhs]


def _tie_weights(lhs: np.ndarray, rhs: np.ndarray, larger: bool) -> np.ndarray:
    """The lhs share of the gradient: 1 where lhs wins, 0 where rhs wins, 1/2 at ties."""
    wins, loses = (lhs > rhs, lhs < rhs) if larger else (lhs < rhs, lhs > rhs)
    return np.where(wins, 1.0, np.where(loses, 0.0, 0.5))


def _extremum_subgradient(larger: bool) -> Subgradient:
    def subgradient(inputs: Sequence[np.ndarray], cotangent: np.ndarray, attrs: Attrs) -> list[np.ndarray | None]:
        lhs, rhs = inputs
        lhs_b, rhs_b = np.broadcast_arrays(lhs, rhs)
        w = _tie_weights(lhs_b, rhs_b, larger)
        return [sum_to_shape(cotangent * w, lhs.shape), sum_to_shape(cotangent * (1.0 - w), rhs.shape)]

    return subgradient


def _split(call: Call, grad: Expr, larger: bool) -> list[Expr | None]:
    """[grad * w, grad * (1 - w)] with w = (1 + (lhs wins) - (rhs wins)) / 2: the tie splits evenly"""
    lhs, rhs = call.args
    first, second = (lhs, rhs) if larger else (rhs, lhs)
    wins = ops.subtract(ops.greater(first, second), ops.greater(second, first))
    w = ops.multiply(ops.add(wins, 1.0), 0.5)
    return [ops.multiply(grad, w), ops.multiply(grad, ops.subtract(1.0, w))]


maximum = Operator(
    "maximum",
    inputs=[Input("lhs"), Input("rhs")],
    doc="Elementwise larger of lhs and rhs, broadcasting; NaN if either is NaN (np.maximum, torch.maximum).",
    broadcast=True,
    kinks=Kink(
        convention="at a tie lhs == rhs each input gets half the gradient, as PyTorch",
        distance=_pair_distance,
        place=_place_ties,
        subgradient=_extremum_subgradient(larger=True),
    ),
)
maximum.shape_rule(broadcast_rule)


@maximum.reference
def _maximum_forward(lhs: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    return np.asarray(np.maximum(lhs, rhs))


@maximum.gradient
def _maximum_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_lhs = grad * w ; d_rhs = grad * (1 - w), w = 1 where lhs > rhs, 0 where lhs < rhs, 1/2 at ties"""
    return _split(call, grad, larger=True)


@maximum.mutant("the whole gradient to lhs at ties (lhs >= rhs)")
def _maximum_tie_to_lhs(call: Call, grad: Expr) -> list[Expr | None]:
    lhs, rhs = call.args
    rhs_wins = ops.greater(rhs, lhs)
    return [ops.multiply(grad, ops.subtract(1.0, rhs_wins)), ops.multiply(grad, rhs_wins)]


@maximum.mutant("gradients of lhs and rhs swapped")
def _maximum_swapped(call: Call, grad: Expr) -> list[Expr | None]:
    return list(reversed(_split(call, grad, larger=True)))


@maximum.lowering
def _maximum_lowering(kb: KernelBuilder, call: Call, out: View, lhs: View, rhs: View) -> None:
    """out = max(lhs, rhs), NaN-propagating"""
    kb.elementwise(out, [lhs, rhs], lambda s, v: s.max(v[0], v[1]), broadcast=True)


minimum = Operator(
    "minimum",
    inputs=[Input("lhs"), Input("rhs")],
    doc="Elementwise smaller of lhs and rhs, broadcasting; NaN if either is NaN (np.minimum, torch.minimum).",
    broadcast=True,
    kinks=Kink(
        convention="at a tie lhs == rhs each input gets half the gradient, as PyTorch",
        distance=_pair_distance,
        place=_place_ties,
        subgradient=_extremum_subgradient(larger=False),
    ),
)
minimum.shape_rule(broadcast_rule)


@minimum.reference
def _minimum_forward(lhs: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    return np.asarray(np.minimum(lhs, rhs))


@minimum.gradient
def _minimum_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_lhs = grad * w ; d_rhs = grad * (1 - w), w = 1 where lhs < rhs, 0 where lhs > rhs, 1/2 at ties"""
    return _split(call, grad, larger=False)


@minimum.mutant("maximum's rule: the gradient goes to the larger input")
def _minimum_as_maximum(call: Call, grad: Expr) -> list[Expr | None]:
    return _split(call, grad, larger=True)


@minimum.lowering
def _minimum_lowering(kb: KernelBuilder, call: Call, out: View, lhs: View, rhs: View) -> None:
    """out = min(lhs, rhs), NaN-propagating"""
    kb.elementwise(out, [lhs, rhs], lambda s, v: s.min(v[0], v[1]), broadcast=True)


# ----- power -----

power = Operator(
    "power",
    inputs=[
        Input("base", domain=POSITIVE,
              doc="the exponent's gradient base^exponent log(base) needs base > 0; the base's needs base != 0 "
                  "where exponent < 1"),
        Input("exponent"),
    ],
    doc="base ** exponent elementwise, broadcasting (np.power, torch.pow): NaN for a negative base with a "
        "non-integer exponent. Gradients are defined for base > 0; at base == 0 the exponent's gradient is "
        "NaN here where PyTorch masks it to 0.",
    broadcast=True,
)
power.shape_rule(broadcast_rule)


@power.reference
def _power_forward(base: np.ndarray, exponent: np.ndarray) -> np.ndarray:
    out = np.power(base, exponent)
    # numpy takes sqrt for an exponent of 0.5 that it broadcasts (stride 0), which differs from C's pow
    # at base -inf (NaN, not +inf) and -0.0 (-0.0, not +0.0); pow's results hold for every layout here
    return np.asarray(np.where((exponent == 0.5) & ((base == -np.inf) | (base == 0)), np.sqrt(np.abs(base)), out))


@power.gradient
def _power_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_base = grad * exponent * base^(exponent - 1) ; d_exponent = grad * out * log(base)"""
    base, exponent = call.args
    d_base = ops.multiply(grad, ops.multiply(exponent, ops.power(base, ops.subtract(exponent, 1.0))))
    return [d_base, ops.multiply(grad, ops.multiply(call, ops.log(base)))]


@power.mutant("d_base without the exponent factor: base^(exponent - 1)")
def _power_no_factor(call: Call, grad: Expr) -> list[Expr | None]:
    base, exponent = call.args
    return [ops.multiply(grad, ops.power(base, ops.subtract(exponent, 1.0))),
            ops.multiply(grad, ops.multiply(call, ops.log(base)))]


@power.mutant("d_exponent as exponent * base^(exponent - 1) (the base's rule)")
def _power_exponent_as_base(call: Call, grad: Expr) -> list[Expr | None]:
    base, exponent = call.args
    d_base = ops.multiply(grad, ops.multiply(exponent, ops.power(base, ops.subtract(exponent, 1.0))))
    return [d_base, d_base]


@power.lowering
def _power_lowering(kb: KernelBuilder, call: Call, out: View, base: View, exponent: View) -> None:
    """out = pow(base, exponent)"""
    kb.elementwise(out, [base, exponent], lambda s, v: s.call("pow", v[0], v[1]), broadcast=True)


# ----- stop_gradient -----

stop_gradient = Operator(
    "stop_gradient",
    inputs=[Input("data", differentiable=False,
                  doc="declared non-differentiable: autodiff sends no gradient through, i.e. zero")],
    doc="data unchanged; its gradient is zero (jax.lax.stop_gradient, torch's detach).",
)
stop_gradient.shape_rule(same_as_first)


@stop_gradient.reference
def _stop_gradient_forward(data: np.ndarray) -> np.ndarray:
    return np.asarray(data.copy())


@stop_gradient.lowering
def _stop_gradient_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> View | None:
    """the input's own view: nothing is copied"""
    return data


# ----- cast -----


def _float_dtype(value: Any) -> str:
    try:
        name = np.dtype(value).name
    except TypeError:
        raise ValueError(f"expected one of {', '.join(FLOAT_DTYPES)}") from None
    if name not in FLOAT_DTYPES:
        raise ValueError(f"expected one of {', '.join(FLOAT_DTYPES)}")
    return str(name)


cast = Operator(
    "cast",
    inputs=[Input("data")],
    attrs=[Attr("dtype", convert=_float_dtype, doc="float32 or float64")],
    doc="data converted to dtype (ndarray.astype): float32 <-> float64, rounding to nearest.",
    jointly_linear=True,
)


@cast.shape_rule
def _cast_shape(data: TensorType, attrs: Attrs) -> TensorType:
    require(data.dtype in FLOAT_DTYPES, f"cast converts between float dtypes; data is {data.dtype}")
    return TensorType(data.shape, attrs["dtype"])


@cast.reference
def _cast_forward(data: np.ndarray, dtype: str) -> np.ndarray:
    return data.astype(dtype)


@cast.gradient
def _cast_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = cast(grad, data.dtype)"""
    return [ops.cast(grad, dtype=call.args[0].dtype)]


@cast.mutant("gradient not cast back to the input's dtype")
def _cast_not_back(call: Call, grad: Expr) -> list[Expr | None]:
    return [grad]


@cast.sampler
def _cast_cases(d: CaseDraw) -> Case:
    # Always to float64: the checker's finite differences run in float64, and a float32 output would
    # round them away. Check g still casts float32 inputs up; tests/test_ops_torch_a.py casts down.
    return Case([d.shape()], {"dtype": "float64"})


@cast.lowering
def _cast_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = fpext / fptrunc(data) (loads convert to the output's type)"""
    kb.elementwise(out, [data], lambda s, v: v[0])
