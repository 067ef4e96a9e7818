"""Shape rules and converters shared by several operator files (not an operator module)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from opgrad.dtypes import TensorType, broadcast_shapes
from opgrad.op import DEFAULT_DOMAIN, Attrs, Input, Interval, Operator, require, whole

if TYPE_CHECKING:
    from opgrad.compiler.builder import KernelBuilder
    from opgrad.compiler.views import Body, Scalar, View
    from opgrad.ir import Call, Expr

POSITIVE = (Interval(0.2, 3.0),)
AWAY_FROM_ZERO = (Interval(-3.0, -0.5), Interval(0.5, 3.0))
#: Logits for softmax-like ops: ordinary ones, and some near 1e3 where exp overflows (even in
#: float64, past 709) unless the formula subtracts the max: a naive rule fails there and nowhere
#: else. Not higher: central differences of outputs near 1e4 carry round-off near the tolerance.
LOGITS = (Interval(-3.0, 3.0), Interval(996.0, 1000.0))


def broadcast_rule(*types_and_attrs: Any) -> TensorType:
    """Numpy broadcasting of every input; the dtype is the (shared) float dtype."""
    types: Sequence[TensorType] = types_and_attrs[:-1]
    shape = broadcast_shapes(*(t.shape for t in types))
    require(
        shape is not None,
        "shapes " + ", ".join(str(t.shape) for t in types) + " do not broadcast together "
        "(numpy rules: trailing dimensions must be equal or 1)",
    )
    assert shape is not None
    return TensorType(shape, types[0].dtype)


def same_as_first(first: TensorType, *rest: Any) -> TensorType:
    return first


def normalize_axis(axis: int, ndim: int, what: str = "axis") -> int:
    require(-ndim <= axis < ndim if ndim else False, f"{what}={axis} is out of range for a rank-{ndim} input")
    return axis % ndim


def optional_axes(value: Any) -> tuple[int, ...] | None:
    """Converter for ``axis``: None (all axes), an int, or a sequence of ints."""
    if value is None:
        return None
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return (int(value),)
    try:
        return tuple(whole(v) for v in value)
    except TypeError:
        raise ValueError("expected None, an int or a sequence of ints") from None


def shape_tuple(value: Any) -> tuple[int, ...]:
    try:
        return tuple(whole(v) for v in value)
    except TypeError:
        raise ValueError("expected a sequence of ints") from None


def resolve_axes(attrs: Attrs, ndim: int, key: str = "axis") -> tuple[int, ...]:
    """The attribute's axes made non-negative and sorted; None means all axes."""
    axes = attrs[key]
    if axes is None:
        return tuple(range(ndim))
    resolved = sorted(normalize_axis(a, ndim, key) for a in axes)
    require(len(set(resolved)) == len(resolved), f"{key}={axes} repeats an axis")
    return tuple(resolved)


# ----- attribute converters (``Attr(..., convert=..., uses_types=True)``) -----


def axis_attr(value: Any, types: Sequence[TensorType], _attrs: Any = None) -> int:
    """One axis of the first input, negative counting from the end -> its non-negative index."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError("expected an int")
    ndim = types[0].ndim if types else 0
    if not -ndim <= int(value) < ndim:
        raise ValueError(f"axis {value} is out of range for a rank-{ndim} input")
    return int(value) % ndim


def axes_attr(value: Any, types: Sequence[TensorType], _attrs: Any = None) -> tuple[int, ...]:
    """None (every axis), an int or a sequence of ints -> sorted non-negative axes of the first input."""
    ndim = types[0].ndim if types else 0
    axes = optional_axes(value)
    if axes is None:
        return tuple(range(ndim))
    resolved = []
    for a in axes:
        if not -ndim <= a < ndim:
            raise ValueError(f"axis {a} is out of range for a rank-{ndim} input")
        resolved.append(a % ndim)
    if len(set(resolved)) != len(resolved):
        raise ValueError("an axis is repeated")
    return tuple(sorted(resolved))


def bool_attr(value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError("expected True or False")
    return bool(value)


# ----- kinks at zero of the first input (relu, leaky_relu, abs, elu, prelu, ...) -----


def distance_to_zero(inputs: Sequence[np.ndarray], attrs: Attrs) -> float:
    """How far the first input's elements are from the kink at 0."""
    data = inputs[0]
    return float(np.min(np.abs(data))) if data.size else float("inf")


def place_on_zero(rng: np.random.Generator, inputs: list[np.ndarray], attrs: Attrs) -> list[np.ndarray]:
    """The inputs with about half of the first input's elements set exactly to the kink at 0."""
    data = inputs[0].copy()
    data[rng.random(data.shape) < 0.5] = 0.0
    return [data, *inputs[1:]]


#: Below this |x|, float32's tanh is its odd Taylor polynomial through x^9 (its error there under
#: 1e-13 of tanh), where (1 - e) / (1 + e) would lose digits to the cancellation in 1 - e.
TANH_SERIES_BELOW = 1.0 / 16.0


def tanh_scalar(s: Any, x: str) -> str:
    """tanh(x) from the emitter ``s``. In float32 ``copysign((1 - e) / (1 + e), x)``,
    ``e = exp(-2 |x|)``, and the Taylor polynomial below :data:`TANH_SERIES_BELOW`: within 6
    float32 ulps of tanh (just above 1/16, where 1 - e cancels; 2.4 above 0.5), +-1 at +-inf,
    NaN for NaN, -0 for -0, and several times faster than the C library's tanhf, a slow call
    per element (an LSTM's gates spent half its step there). float64 keeps the C library's
    tanh, the checker's precision."""
    if s.dtype == "float64":
        return s.call("tanh", x)  # type: ignore[no-any-return]
    a = s.call("fabs", x)
    e = s.call("exp", s.mul(s.const(-2.0), a))
    ratio = s.call("copysign", s.div(s.sub(s.const(1.0), e), s.add(s.const(1.0), e)), x)
    x2 = s.mul(x, x)
    poly = s.const(62.0 / 2835.0)
    for coefficient in (-17.0 / 315.0, 2.0 / 15.0, -1.0 / 3.0):
        poly = s.add(s.mul(poly, x2), s.const(coefficient))
    series = s.call("copysign", s.add(s.mul(s.mul(poly, x2), x), x), x)  # tanh(-0) is -0
    return s.select(s.cmp("olt", a, s.const(TANH_SERIES_BELOW)), series, ratio)  # type: ignore[no-any-return]


#: The Chebyshev fit of erfc in Press et al., Numerical Recipes (``erfcc``): ``erfc(z) = t *
#: exp(-z^2 + P(t))``, ``t = 1 / (1 + z / 2)``, for z >= 0, with a fractional error below 1.2e-7
#: everywhere; P's coefficients from t^0 up.
ERFC_FIT = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807, -1.13520398, 1.48851587,
            -0.82215223, 0.17087277)


def erfc_scalar(s: Any, x: str) -> str:
    """erfc(x) from the emitter ``s``. In float32 :data:`ERFC_FIT` at |x| (``2 - erfc(|x|)`` for
    negative x), with e^-z^2 split so that the rounding of z^2 stays out of the exponent: within
    7 float32 ulps of erfc, built from exp, which vectorizes where the C
    library's erfcf is a call per element (exact GELU spent most of a transformer's step there);
    0 at +inf, 2 at -inf, NaN for NaN. float64 keeps the C library's erfc."""
    if s.dtype == "float64":
        return s.libm("erfc", x)  # type: ignore[no-any-return]
    z = s.call("fabs", x)
    t = s.div(s.const(1.0), s.add(s.const(1.0), s.mul(s.const(0.5), z)))
    poly = s.const(ERFC_FIT[-1])
    for coefficient in reversed(ERFC_FIT[:-1]):
        poly = s.add(s.mul(poly, t), s.const(coefficient))
    # e^(P - z^2) as e^(-h^2) e^(P - (z - h)(z + h)), h = z to 12 significant bits: h^2 is exact,
    # and the rest small, so neither exponent carries float32's rounding of z^2 (4e-6 of e^-81).
    # Past 10.06 erfc is below float32's smallest value (and z - h would be inf - inf at inf).
    h = s.high_bits(z, 11)
    rest = s.sub(poly, s.mul(s.sub(z, h), s.add(z, h)))
    tail = s.mul(t, s.mul(s.call("exp", s.neg(s.mul(h, h))), s.call("exp", rest)))
    tail = s.select(s.cmp("ogt", z, s.const(10.06)), s.const(0.0), tail)
    return s.select(s.cmp("oge", x, s.const(0.0)), tail, s.sub(s.const(2.0), tail))  # type: ignore[no-any-return]


def smooth_unary(name: str, doc: str, *, forward: Callable[[np.ndarray], np.ndarray],
                 gradient: tuple[str, Callable[[Call, Expr], Expr]], lowering: tuple[str, Body],
                 domain: tuple[Interval, ...] = DEFAULT_DOMAIN, jointly_linear: bool = False) -> Operator:
    """Declare an elementwise op ``out = forward(data)``, smooth on ``domain``, in one call.

    ``gradient`` is ``(formula, rule)``: ``rule(call, grad)`` builds ``d_data`` from registered
    ops and ``formula`` documents it (``"d_data = grad * exp(data)"``). ``lowering`` is
    ``(formula, body)``: ``body(s, v)`` computes one element from ``v[0]`` with the builder's
    scalar emitter ``s`` (``s.call("exp", v[0])``). Mutants are planted on the returned op as usual.
    """
    op = Operator(name, inputs=[Input("data", domain=domain)], doc=doc, jointly_linear=jointly_linear)
    op.shape_rule(same_as_first)
    gradient_doc, rule = gradient
    lowering_doc, body = lowering

    def reference(data: np.ndarray) -> np.ndarray:
        return np.asarray(forward(data), dtype=data.dtype)

    def gradient_rule(call: Call, grad: Expr) -> list[Expr | None]:
        return [rule(call, grad)]

    def lower(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
        kb.elementwise(out, [data], body)

    gradient_rule.__doc__, lower.__doc__ = gradient_doc, lowering_doc
    op.reference(reference)
    op.gradient(gradient_rule)
    op.lowering(lower)
    return op


def dense_reshape(view: View, shape: Sequence[int]) -> View:
    """``view.reshape(shape)`` of a view known to be dense (an output buffer, a temporary)."""
    reshaped = view.reshape(shape)
    if reshaped is None:
        raise AssertionError(f"a dense view was expected, got strides {view.strides} for shape {view.shape}")
    return reshaped


def ieee_contract(subscripts: str, a: np.ndarray, b: np.ndarray,
                  blas: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> np.ndarray:
    """``np.einsum(subscripts, a, b)``: by ``blas(a, b)``, a BLAS-backed form of the same product
    (``@``, ``tensordot``), when both operands are finite, by einsum's own loops otherwise.

    BLAS may skip zero operands, so NaN * 0 and inf * 0 can come out 0 there, where IEEE
    arithmetic (einsum's loops, the compiled kernels) gives NaN. The references of the products
    (dense, matmul, batch_matmul, the conv2d family) go through here.
    """
    if np.isfinite(a).all() and np.isfinite(b).all():
        return np.asarray(blas(a, b))
    return np.asarray(np.einsum(subscripts, a, b, optimize=False))


def copy_element(s: Scalar, v: list[str]) -> str:
    """The elementwise body of a copy: the input's value."""
    return v[0]


def normalized_axis(axis: int, ndim: int) -> int:
    """``axis`` in ``[0, ndim)``; negative axes count from the end; a ``ValueError`` names one out of range."""
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for a rank-{ndim} data")
    return axis % ndim


def slice_view(view: View, axis: int, start: int, length: int, step: int) -> View:
    """Positions start, start + step, ... (length of them) along one axis of ``view``."""
    strides = list(view.strides)
    shape = list(view.shape)
    offset = view.offset + start * strides[axis]
    strides[axis] *= step
    shape[axis] = length
    return replace(view, shape=tuple(shape), strides=tuple(strides), offset=offset)


def positive_int(value: Any) -> int:
    """An attribute that is a whole number >= 1 (a bool is refused, though Python counts it as an int)."""
    if whole(value) < 1:
        raise ValueError("expected a positive int")
    return int(value)
