"""Normalization layers: batch_norm (batch statistics), batch_norm_inference (running statistics),
layer_norm (statistics over trailing axes) and prelu (a per-channel leaky slope).

Semantics follow PyTorch where it names the same thing: ``batch_norm`` is
``torch.nn.functional.batch_norm(x, None, None, gamma, beta, training=True, eps=epsilon)`` (the
biased variance normalizes), ``batch_norm_inference`` the same with ``training=False`` and given
running statistics, ``layer_norm`` is ``torch.nn.functional.layer_norm(x, x.shape[axis:], gamma,
beta, epsilon)`` and ``prelu`` is ``torch.nn.functional.prelu``.

batch_norm and layer_norm share one gradient: with ``xhat = (x - mean) * s``, ``s = 1 / sqrt(var +
epsilon)`` over the reduced axes and ``g = d_xhat``,

    d_x = s * (g - mean(g) - xhat * mean(g * xhat))

which is exact for any epsilon (the mean and variance depend on x, so neither is a constant).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from opgrad import ops
from opgrad.dtypes import TensorType
from opgrad.ir import Call, Expr
from opgrad.op import Attr, Attrs, Case, Input, Kink, Operator, require

from ._common import POSITIVE, axis_attr, distance_to_zero, place_on_zero

if TYPE_CHECKING:  # types only: the compiler and the checker sit above the registry
    from opgrad.checks.strategies import CaseDraw
    from opgrad.compiler.builder import KernelBuilder
    from opgrad.compiler.views import Scalar, View


def _epsilon(value: Any) -> float:
    epsilon = float(value)
    if not (np.isfinite(epsilon) and epsilon > 0):
        raise ValueError("expected a finite epsilon > 0 (it keeps 1/sqrt(var + epsilon) finite)")
    return epsilon


def _axis_attrs(default_axis: int, axis_doc: str) -> list[Attr]:
    return [
        Attr("axis", default=default_axis, convert=axis_attr, uses_types=True, doc=axis_doc),
        Attr("epsilon", default=1e-5, convert=_epsilon, doc="added to the variance before the square root"),
    ]


def _others(ndim: int, axis: int) -> tuple[int, ...]:
    return tuple(i for i in range(ndim) if i != axis)


def _kept(shape: Sequence[int], axes: Sequence[int]) -> tuple[int, ...]:
    """``shape`` with the reduced ``axes`` set to 1 (keepdims)."""
    return tuple(1 if i in axes else d for i, d in enumerate(shape))


def _channel(values: np.ndarray, ndim: int, axis: int) -> np.ndarray:
    """A 1-D per-channel array laid along ``axis`` of a rank-``ndim`` tensor (numpy broadcasting)."""
    return values.reshape((1,) * axis + (values.shape[0],) + (1,) * (ndim - axis - 1))


def _channel_expr(values: Expr, ndim: int, axis: int) -> Expr:
    shape = (1,) * axis + (values.shape[0],) + (1,) * (ndim - axis - 1)
    return ops.reshape(values, shape=shape)


def _per_channel_shape(name: str, t: TensorType, data: TensorType, axis: int) -> None:
    require(
        t.ndim == 1 and t.shape[0] == data.shape[axis],
        f"{name} has shape {t.shape} but data has {data.shape[axis]} channel(s) along axis {axis}; "
        f"expected {name} shape ({data.shape[axis]},)",
    )


def _normalize_np(data: np.ndarray, axes: tuple[int, ...], epsilon: float) -> np.ndarray:
    """(data - mean) / sqrt(var + epsilon) over ``axes``, with the biased (1/m) variance.

    The mean is taken of the data shifted by each group's first element, so a constant group
    centers to exactly 0 whatever the mean's rounding (as the lowering and the gradient do)."""
    with np.errstate(invalid="ignore", divide="ignore"):  # an empty reduction gives an empty output
        shifted = data - data[tuple(slice(0, 1) if i in axes else slice(None) for i in range(data.ndim))]
        centered = shifted - shifted.mean(axis=axes, keepdims=True)
        var = (centered * centered).mean(axis=axes, keepdims=True)
        return np.asarray(centered / np.sqrt(var + data.dtype.type(epsilon)))


def batch_statistics(data: Expr, axes: tuple[int, ...]) -> tuple[Expr, Expr, Expr]:
    """(mean, centered, squares) over ``axes`` as graph expressions (keepdims): centered = data -
    mean and squares = sum(centered ** 2), so the biased variance is squares / m.

    The data is shifted by each group's first element before the mean (see :func:`_normalize_np`),
    so a constant group centers to exactly 0. batch_norm's gradient and ``BatchNorm2D``'s running
    statistics both build them here, as the same expressions, so that a compiled training step
    computes them once. Each elementwise value is built anew for each of its readers (the
    compiler computes such a value again rather than share it): so it fuses into every pass that
    reads it, and no pass writes the shifted or centered data to memory."""
    inv_m = 1.0 / max(1, math.prod(data.shape[a] for a in axes))
    first = ops.stop_gradient(ops.strided_slice(
        data, begin=[0] * data.ndim, end=[1 if i in axes else n for i, n in enumerate(data.shape)]))
    shifted_mean = ops.multiply(ops.sum(ops.subtract(data, first), axis=axes, keepdims=True), inv_m)

    def centered() -> Expr:
        return ops.subtract(ops.subtract(data, first), shifted_mean)

    squares = ops.sum(ops.square(centered()), axis=axes, keepdims=True)
    return ops.add(first, shifted_mean), centered(), squares


def _normalized(data: Expr, axes: tuple[int, ...], epsilon: float) -> tuple[Expr, Expr]:
    """(xhat, s) as graph expressions: xhat = (data - mean) * s, s = 1 / sqrt(var + epsilon) (keepdims).

    The shift of :func:`batch_statistics` cancels from xhat, so it carries no gradient. Call it
    once per reader of xhat, as :func:`batch_statistics` builds its values."""
    inv_m = 1.0 / max(1, math.prod(data.shape[a] for a in axes))
    _, centered, squares = batch_statistics(data, axes)
    s = ops.divide(1.0, ops.sqrt(ops.add(ops.multiply(squares, inv_m), epsilon)))
    return ops.multiply(centered, s), s


def _normalize_backward(g: Expr, xhat: Expr, s: Expr, axes: tuple[int, ...]) -> Expr:
    """d_x = s * (g - mean(g) - xhat * mean(g * xhat)) for the normalization over ``axes``."""
    return _normalize_backward_from_sums(g, xhat, s, ops.sum(g, axis=axes, keepdims=True),
                                         ops.sum(ops.multiply(g, xhat), axis=axes, keepdims=True), axes)


def _normalize_backward_from_sums(g: Expr, xhat: Expr, s: Expr, sum_g: Expr, sum_gx: Expr,
                                  axes: tuple[int, ...]) -> Expr:
    """d_x = s * (g - sum_g / m - xhat * sum_gx / m), given sum(g) and sum(g * xhat) over ``axes``
    (keepdims; m values each)."""
    inv_m = 1.0 / max(1, math.prod(g.shape[a] for a in axes))
    return ops.multiply(s, ops.subtract(ops.subtract(g, ops.multiply(sum_g, inv_m)),
                                        ops.multiply(xhat, ops.multiply(sum_gx, inv_m))))


def _lower_normalize(kb: KernelBuilder, out: View, data: View, axes: tuple[int, ...], epsilon: float,
                    scale: View, shift: View) -> None:
    """out = (data - mean) / sqrt(var + epsilon) * scale + shift; mean and var in two reductions.

    As in :func:`_normalize_np`, the mean is taken of data - first (each group's first element),
    so a constant group centers to exactly 0. The square root and the division run once per
    group (as torch's invstd), times the scale where that is one per group too."""
    kept = _kept(data.shape, axes)
    inv_m = 1.0 / max(1, math.prod(data.shape[a] for a in axes))
    first = data.pinned(axes)  # never read where data is empty
    shifted_mean = kb.temporary(kept, out.dtype)
    kb.map_reduce(shifted_mean, [data, first], axes, "sum", body=lambda s, v: s.sub(v[0], v[1]), scale=inv_m)
    shifted_mean_b = shifted_mean.broadcast_to(data.shape)
    var = kb.temporary(kept, out.dtype)

    def centered(s: Scalar, v: list[str]) -> str:
        return s.sub(s.sub(v[0], v[1]), v[2])

    def squared(s: Scalar, v: list[str]) -> str:
        d = centered(s, v)
        return s.mul(d, d)

    kb.map_reduce(var, [data, first, shifted_mean_b], axes, "sum", body=squared, scale=inv_m)
    factor = kb.temporary(kept, out.dtype)
    per_group = all(scale.strides[a] == 0 for a in axes)  # batch_norm's gamma: folded into the factor

    def inverse_std(s: Scalar, v: list[str]) -> str:
        return s.div(v[1] if per_group else s.const(1.0), s.call("sqrt", s.add(v[0], s.const(epsilon))))

    def body(s: Scalar, v: list[str]) -> str:
        normalized = s.mul(centered(s, v), v[3])
        return s.add(normalized if per_group else s.mul(normalized, v[5]), v[4])

    kb.elementwise(factor, [var, scale.first_along(axes)] if per_group else [var], inverse_std)
    kb.elementwise(out, [data, first, shifted_mean_b, factor.broadcast_to(data.shape), shift,
                         *([] if per_group else [scale])], body)


# ----- batch_norm -----

batch_norm = Operator(
    "batch_norm",
    inputs=[Input("data"), Input("gamma", doc="1-D, one scale per channel"),
            Input("beta", doc="1-D, one shift per channel")],
    attrs=_axis_attrs(1, "the channel axis; statistics run over every other axis"),
    doc="Batch normalization in training mode: (data - mean) / sqrt(var + epsilon) * gamma + beta with "
        "the batch mean and biased variance over every axis but `axis` (as torch.nn.functional.batch_norm "
        "with training=True).",
)


@batch_norm.shape_rule
def _batch_norm_shape(data: TensorType, gamma: TensorType, beta: TensorType, attrs: Attrs) -> TensorType:
    require(data.ndim >= 2, f"data must have a batch and a channel axis (rank >= 2), got shape {data.shape}")
    _per_channel_shape("gamma", gamma, data, attrs["axis"])
    _per_channel_shape("beta", beta, data, attrs["axis"])
    return data


@batch_norm.reference
def _batch_norm_forward(data: np.ndarray, gamma: np.ndarray, beta: np.ndarray, axis: int,
                        epsilon: float) -> np.ndarray:
    xhat = _normalize_np(data, _others(data.ndim, axis), epsilon)
    return np.asarray(xhat * _channel(gamma, data.ndim, axis) + _channel(beta, data.ndim, axis))


@batch_norm.gradient
def _batch_norm_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = s * gamma * (grad - mean(grad) - xhat * mean(grad * xhat)); d_gamma = sum(grad*xhat); d_beta = sum(grad)

    This is the shared formula s * (g - mean(g) - xhat * mean(g * xhat)) with g = grad * gamma:
    gamma is one value per channel, constant over the means' axes, so it leaves both means as a
    factor. The two channel sums d_beta and d_gamma then serve d_data as well, and one pass over
    the data computes both. Sums run over every axis but ``axis``; xhat and s are recomputed from
    data, xhat once for each pass that reads it (see :func:`batch_statistics`).
    """
    data, gamma, _ = call.args
    axis = call.attrs["axis"]
    axes = _others(data.ndim, axis)
    xhat, s = _normalized(data, axes, call.attrs["epsilon"])
    sum_g = ops.sum(grad, axis=axes, keepdims=True)
    sum_gx = ops.sum(ops.multiply(grad, xhat), axis=axes, keepdims=True)
    scale = ops.multiply(s, _channel_expr(gamma, data.ndim, axis))
    xhat_again, _ = _normalized(data, axes, call.attrs["epsilon"])
    d_data = _normalize_backward_from_sums(grad, xhat_again, scale, sum_g, sum_gx, axes)
    return [d_data, ops.reshape(sum_gx, shape=gamma.shape), ops.reshape(sum_g, shape=gamma.shape)]


@batch_norm.mutant("d_data treats the batch mean and variance as constants")
def _batch_norm_constant_stats(call: Call, grad: Expr) -> list[Expr | None]:
    data, gamma, _ = call.args
    axis = call.attrs["axis"]
    axes = _others(data.ndim, axis)
    xhat, s = _normalized(data, axes, call.attrs["epsilon"])
    return [ops.multiply(ops.multiply(grad, _channel_expr(gamma, data.ndim, axis)), s),
            ops.sum(ops.multiply(grad, xhat), axis=axes), ops.sum(grad, axis=axes)]


@batch_norm.mutant("d_gamma sums grad * (data - mean), forgetting the 1/sqrt(var + epsilon)")
def _batch_norm_unscaled_gamma(call: Call, grad: Expr) -> list[Expr | None]:
    data = call.args[0]
    axis = call.attrs["axis"]
    axes = _others(data.ndim, axis)
    centered = ops.subtract(data, ops.multiply(ops.sum(data, axis=axes, keepdims=True),
                                               1.0 / math.prod(data.shape[a] for a in axes)))
    right = _batch_norm_gradient(call, grad)
    return [right[0], ops.sum(ops.multiply(grad, centered), axis=axes), right[2]]


def _draw_channel_case(d: CaseDraw, rank: tuple[int, int]) -> tuple[tuple[int, ...], int]:
    shape = d.shape(min_rank=rank[0], max_rank=rank[1])
    axis = 1 if d.bool() else d.int(-len(shape), len(shape) - 1)
    return shape, axis


@batch_norm.sampler
def _batch_norm_cases(d: CaseDraw) -> Case:
    shape, axis = _draw_channel_case(d, (2, 4))
    c = (shape[axis],)
    return Case([shape, c, c], {"axis": axis, "epsilon": d.choice([1e-5, 1e-3, 0.1])})


@batch_norm.lowering
def _batch_norm_lowering(kb: KernelBuilder, call: Call, out: View, data: View, gamma: View, beta: View) -> None:
    """out = (data - mean) / sqrt(var + epsilon) * gamma + beta, statistics over every axis but axis"""
    axis = call.attrs["axis"]
    _lower_normalize(kb, out, data, _others(data.ndim, axis), call.attrs["epsilon"],
                     gamma.along(axis, out.shape), beta.along(axis, out.shape))


# ----- batch_norm_inference -----

batch_norm_inference = Operator(
    "batch_norm_inference",
    inputs=[Input("data"), Input("gamma", doc="1-D, one scale per channel"),
            Input("beta", doc="1-D, one shift per channel"),
            Input("mean", doc="1-D running mean per channel"),
            Input("var", domain=POSITIVE, doc="1-D running variance per channel (>= 0)")],
    attrs=_axis_attrs(1, "the channel axis"),
    doc="Batch normalization with given statistics: (data - mean) / sqrt(var + epsilon) * gamma + beta "
        "per channel along `axis` (as torch.nn.functional.batch_norm with training=False). mean and var are "
        "differentiable too, so running statistics can be fine-tuned or checked like any input.",
)


@batch_norm_inference.shape_rule
def _batch_norm_inference_shape(data: TensorType, *rest: Any) -> TensorType:
    *channels, attrs = rest
    require(data.ndim >= 2, f"data must have a batch and a channel axis (rank >= 2), got shape {data.shape}")
    for name, t in zip(("gamma", "beta", "mean", "var"), channels):
        _per_channel_shape(name, t, data, attrs["axis"])
    return data


@batch_norm_inference.reference
def _batch_norm_inference_forward(data: np.ndarray, gamma: np.ndarray, beta: np.ndarray, mean: np.ndarray,
                                  var: np.ndarray, axis: int, epsilon: float) -> np.ndarray:
    def ch(v: np.ndarray) -> np.ndarray:
        return _channel(v, data.ndim, axis)

    return np.asarray((data - ch(mean)) / np.sqrt(ch(var) + data.dtype.type(epsilon)) * ch(gamma) + ch(beta))


@batch_norm_inference.gradient
def _batch_norm_inference_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = grad * gamma * s ; d_gamma = sum(grad * (data - mean) * s) ; d_beta = sum(grad) ; d_mean, d_var below

    d_mean = -gamma * s * sum(grad) ; d_var = -gamma * s^3 / 2 * sum(grad * (data - mean)), with
    s = 1 / sqrt(var + epsilon) and sums over every axis but ``axis``.
    """
    data, gamma, _, mean, var = call.args
    axis = call.attrs["axis"]
    axes = _others(data.ndim, axis)
    s = ops.divide(1.0, ops.sqrt(ops.add(var, call.attrs["epsilon"])))
    gs = ops.multiply(gamma, s)
    centered = ops.subtract(data, _channel_expr(mean, data.ndim, axis))
    sum_g = ops.sum(grad, axis=axes)
    sum_gc = ops.sum(ops.multiply(grad, centered), axis=axes)
    d_var = ops.multiply(ops.multiply(gs, ops.multiply(s, s)), ops.multiply(sum_gc, -0.5))
    return [ops.multiply(grad, _channel_expr(gs, data.ndim, axis)), ops.multiply(sum_gc, s), sum_g,
            ops.negative(ops.multiply(gs, sum_g)), d_var]


@batch_norm_inference.mutant("d_var without the -1/2 of the derivative of var^(-1/2)")
def _batch_norm_inference_var_factor(call: Call, grad: Expr) -> list[Expr | None]:
    right = list(_batch_norm_inference_gradient(call, grad))
    return [*right[:4], ops.multiply(right[4], -2.0)]


@batch_norm_inference.sampler
def _batch_norm_inference_cases(d: CaseDraw) -> Case:
    shape, axis = _draw_channel_case(d, (2, 4))
    c = (shape[axis],)
    return Case([shape, c, c, c, c], {"axis": axis, "epsilon": d.choice([1e-5, 1e-3, 0.1])})


@batch_norm_inference.lowering
def _batch_norm_inference_lowering(kb: KernelBuilder, call: Call, out: View, data: View, gamma: View, beta: View,
                                   mean: View, var: View) -> None:
    """out = (data - mean) / sqrt(var + epsilon) * gamma + beta, per channel along axis"""
    axis, epsilon = call.attrs["axis"], call.attrs["epsilon"]
    channels = [v.along(axis, out.shape) for v in (mean, var, gamma, beta)]

    def body(s: Scalar, v: list[str]) -> str:
        std = s.call("sqrt", s.add(v[2], s.const(epsilon)))
        return s.add(s.mul(s.div(s.sub(v[0], v[1]), std), v[3]), v[4])

    kb.elementwise(out, [data, *channels], body)


# ----- layer_norm -----

layer_norm = Operator(
    "layer_norm",
    inputs=[Input("data"), Input("gamma", doc="shaped data.shape[axis:]"),
            Input("beta", doc="shaped data.shape[axis:]")],
    attrs=_axis_attrs(-1, "the first normalized axis: statistics run over data.shape[axis:]"),
    doc="Layer normalization over the trailing axes from `axis` on, with elementwise gamma and beta of "
        "shape data.shape[axis:] (as torch.nn.functional.layer_norm with normalized_shape = "
        "data.shape[axis:]; biased variance).",
)


@layer_norm.shape_rule
def _layer_norm_shape(data: TensorType, gamma: TensorType, beta: TensorType, attrs: Attrs) -> TensorType:
    normalized = data.shape[attrs["axis"]:]
    for name, t in (("gamma", gamma), ("beta", beta)):
        require(
            t.shape == normalized,
            f"{name} has shape {t.shape} but layer_norm from axis {attrs['axis']} of data {data.shape} "
            f"normalizes over {normalized}; expected {name} shape {normalized}",
        )
    return data


def _trailing(ndim: int, axis: int) -> tuple[int, ...]:
    return tuple(range(axis, ndim))


@layer_norm.reference
def _layer_norm_forward(data: np.ndarray, gamma: np.ndarray, beta: np.ndarray, axis: int,
                        epsilon: float) -> np.ndarray:
    return np.asarray(_normalize_np(data, _trailing(data.ndim, axis), epsilon) * gamma + beta)


@layer_norm.gradient
def _layer_norm_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = s * (g - mean(g) - xhat * mean(g * xhat)), g = grad * gamma ; d_gamma = grad * xhat ; d_beta = grad

    Means run over the trailing axes from ``axis`` on; autodiff sums d_gamma and d_beta over the
    leading axes (they broadcast to data's shape).
    """
    data, gamma, _ = call.args
    axes = _trailing(data.ndim, call.attrs["axis"])
    xhat, s = _normalized(data, axes, call.attrs["epsilon"])
    return [_normalize_backward(ops.multiply(grad, gamma), xhat, s, axes), ops.multiply(grad, xhat), grad]


@layer_norm.mutant("d_data drops the mean(g * xhat) term (treats the variance as a constant)")
def _layer_norm_no_variance_term(call: Call, grad: Expr) -> list[Expr | None]:
    data, gamma, _ = call.args
    axes = _trailing(data.ndim, call.attrs["axis"])
    xhat, s = _normalized(data, axes, call.attrs["epsilon"])
    g = ops.multiply(grad, gamma)
    inv_m = 1.0 / math.prod(data.shape[a] for a in axes)
    d_data = ops.multiply(s, ops.subtract(g, ops.multiply(ops.sum(g, axis=axes, keepdims=True), inv_m)))
    return [d_data, ops.multiply(grad, xhat), grad]


@layer_norm.sampler
def _layer_norm_cases(d: CaseDraw) -> Case:
    shape = d.shape(min_rank=1, max_rank=4)
    axis = d.int(-len(shape), len(shape) - 1)
    trailing = shape[axis:]
    return Case([shape, trailing, trailing], {"axis": axis, "epsilon": d.choice([1e-5, 1e-3, 0.1])})


@layer_norm.lowering
def _layer_norm_lowering(kb: KernelBuilder, call: Call, out: View, data: View, gamma: View, beta: View) -> None:
    """out = (data - mean) / sqrt(var + epsilon) * gamma + beta, statistics over data.shape[axis:]"""
    _lower_normalize(kb, out, data, _trailing(data.ndim, call.attrs["axis"]), call.attrs["epsilon"],
                     gamma.broadcast_to(out.shape), beta.broadcast_to(out.shape))


# ----- prelu -----


def _alpha_np(alpha: np.ndarray, data: np.ndarray, axis: int) -> np.ndarray:
    """alpha broadcast against data: per channel along axis, or one value for every element."""
    if alpha.ndim == 1 and alpha.shape[0] == data.shape[axis]:
        return _channel(alpha, data.ndim, axis)
    return alpha.reshape(())


def _alpha_expr(alpha: Expr, data: Expr, axis: int) -> Expr:
    if alpha.ndim == 1 and alpha.shape[0] == data.shape[axis]:
        return _channel_expr(alpha, data.ndim, axis)
    return ops.reshape(alpha, shape=())


def _prelu_subgradient(inputs: Sequence[np.ndarray], cotangent: np.ndarray, attrs: Attrs) -> list[np.ndarray | None]:
    data, alpha = inputs
    a = _alpha_np(alpha, data, attrs["axis"])
    negative_side = np.where(data > 0, 0.0, cotangent * data)
    if alpha.ndim == 1 and alpha.shape[0] == data.shape[attrs["axis"]]:
        d_alpha = negative_side.sum(axis=_others(data.ndim, attrs["axis"]))
    else:
        d_alpha = negative_side.sum().reshape(alpha.shape)
    return [cotangent * np.where(data > 0, 1.0, a), d_alpha]


prelu = Operator(
    "prelu",
    inputs=[Input("data"), Input("alpha", doc="slopes for data <= 0: shape (C,) along axis, or one value "
                                              "(shape () or (1,))")],
    attrs=[Attr("axis", default=1, convert=axis_attr, uses_types=True, doc="the channel axis alpha runs along")],
    doc="data where data > 0, else alpha * data, alpha per channel along `axis` or shared "
        "(as torch.nn.functional.prelu).",
    kinks=Kink(
        convention="prelu'(0) = alpha, as PyTorch: at exactly zero the slope of the negative side",
        distance=distance_to_zero,
        place=place_on_zero,
        subgradient=_prelu_subgradient,
    ),
)


@prelu.shape_rule
def _prelu_shape(data: TensorType, alpha: TensorType, attrs: Attrs) -> TensorType:
    channels = data.shape[attrs["axis"]]
    require(
        alpha.ndim <= 1 and alpha.size in (1, channels),
        f"alpha has shape {alpha.shape}; expected ({channels},) for one slope per channel along axis "
        f"{attrs['axis']}, or a single slope of shape () or (1,)",
    )
    return data


@prelu.reference
def _prelu_forward(data: np.ndarray, alpha: np.ndarray, axis: int) -> np.ndarray:
    return np.where(data > 0, data, _alpha_np(alpha, data, axis) * data)


@prelu.gradient
def _prelu_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = grad if data > 0 else alpha * grad ; d_alpha = sum(grad * data where data <= 0)

    d_alpha sums over every axis but ``axis`` for per-channel slopes, over all axes for a single one.
    """
    data, alpha = call.args
    axis = call.attrs["axis"]
    positive = ops.greater(data, ops.zeros_like(data))
    d_data = ops.where(positive, grad, ops.multiply(grad, _alpha_expr(alpha, data, axis)))
    negative_side = ops.where(positive, ops.zeros_like(grad), ops.multiply(grad, data))
    if alpha.ndim == 1 and alpha.shape[0] == data.shape[axis]:
        return [d_data, ops.sum(negative_side, axis=_others(data.ndim, axis))]
    return [d_data, ops.reshape(ops.sum(negative_side), shape=alpha.shape)]


@prelu.mutant("d_alpha from the positive side (grad * data where data > 0)")
def _prelu_positive_side(call: Call, grad: Expr) -> list[Expr | None]:
    data, alpha = call.args
    d_data = _prelu_gradient(call, grad)[0]
    positive_side = ops.where(ops.greater(data, ops.zeros_like(data)), ops.multiply(grad, data), ops.zeros_like(grad))
    if alpha.ndim == 1 and alpha.shape[0] == data.shape[call.attrs["axis"]]:
        return [d_data, ops.sum(positive_side, axis=_others(data.ndim, call.attrs["axis"]))]
    return [d_data, ops.reshape(ops.sum(positive_side), shape=alpha.shape)]


@prelu.sampler
def _prelu_cases(d: CaseDraw) -> Case:
    shape, axis = _draw_channel_case(d, (1, 4))
    axis = axis if -len(shape) <= axis < len(shape) else 0
    alpha = d.choice([(shape[axis],), (1,), ()])
    return Case([shape, alpha], {"axis": axis})


@prelu.lowering
def _prelu_lowering(kb: KernelBuilder, call: Call, out: View, data: View, alpha: View) -> None:
    """out = data if data > 0 else alpha * data"""
    axis = call.attrs["axis"]
    if alpha.ndim == 1 and alpha.shape[0] == out.shape[axis]:
        slopes = alpha.along(axis, out.shape)
    else:
        slopes = alpha.broadcast_to(out.shape)
    kb.elementwise(out, [data, slopes],
                   lambda s, v: s.select(s.cmp("ogt", v[0], s.const(0.0)), v[0], s.mul(v[1], v[0])))
