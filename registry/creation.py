"""Tensors made from nothing, from another's shape or from integer labels: full, zeros, ones,
zeros_like, ones_like, one_hot.

Their inputs are read only for shape (or as indices), so none is differentiable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from opgrad.dtypes import FLOAT_DTYPES, TensorType
from opgrad.ir import Call
from opgrad.op import Attr, Attrs, Case, Input, Operator, require, whole

from ._common import positive_int

if TYPE_CHECKING:  # types only: the compiler and the checker sit above the registry
    from opgrad.checks.strategies import CaseDraw
    from opgrad.compiler.builder import KernelBuilder
    from opgrad.compiler.views import View

zeros_like = Operator(
    "zeros_like",
    inputs=[Input("like", differentiable=False, doc="only its shape and dtype are read")],
    doc="Zeros with the shape and dtype of `like`.",
)


@zeros_like.shape_rule
def _like_shape(like: TensorType, attrs: Attrs) -> TensorType:
    return like


@zeros_like.reference
def _zeros_like_forward(like: np.ndarray) -> np.ndarray:
    return np.zeros_like(like)


@zeros_like.lowering
def _zeros_like_lowering(kb: KernelBuilder, call: Call, out: View, like: View) -> View | None:
    """out = 0 (a constant view: consumers fold it, no memory is written)"""
    return kb.scalar(0.0, out.dtype, out.shape)


ones_like = Operator(
    "ones_like",
    inputs=[Input("like", differentiable=False, doc="only its shape and dtype are read")],
    doc="Ones with the shape and dtype of `like`.",
)
ones_like.shape_rule(_like_shape)


@ones_like.reference
def _ones_like_forward(like: np.ndarray) -> np.ndarray:
    return np.ones_like(like)


@ones_like.lowering
def _ones_like_lowering(kb: KernelBuilder, call: Call, out: View, like: View) -> View | None:
    """out = 1 (a constant view: consumers fold it, no memory is written)"""
    return kb.scalar(1.0, out.dtype, out.shape)


def _float_dtype(value: Any) -> str:
    name = np.dtype(value).name
    if name not in FLOAT_DTYPES:
        raise ValueError(f"expected one of {', '.join(FLOAT_DTYPES)}")
    return str(name)


one_hot = Operator(
    "one_hot",
    inputs=[Input("labels", kind="int", dims=("N",), int_range=(0, "depth"))],
    attrs=[
        Attr("depth", convert=positive_int, doc="number of classes C"),
        Attr("dtype", default="float32", convert=_float_dtype),
    ],
    doc="(N,) integer labels in [0, depth) -> (N, depth) float rows with a single 1.0.",
)


@one_hot.shape_rule
def _one_hot_shape(labels: TensorType, attrs: Attrs) -> TensorType:
    require(labels.ndim == 1, f"labels must be 1-D (N,), got shape {labels.shape}")
    return TensorType((labels.shape[0], attrs["depth"]), attrs["dtype"])


@one_hot.reference
def _one_hot_forward(labels: np.ndarray, depth: int, dtype: str) -> np.ndarray:
    if labels.size and (labels.min() < 0 or labels.max() >= depth):
        raise ValueError(
            f"one_hot: labels must lie in [0, {depth}), got values in [{labels.min()}, {labels.max()}]"
        )
    out = np.zeros((labels.shape[0], depth), dtype=dtype)
    out[np.arange(labels.shape[0]), labels] = 1.0
    return out


@one_hot.sampler
def _one_hot_cases(d: CaseDraw) -> Case:
    return Case([(d.size(),)], {"depth": d.size(), "dtype": d.choice(["float32", "float64"])})


@one_hot.lowering
def _one_hot_lowering(kb: KernelBuilder, call: Call, out: View, labels: View) -> None:
    """out[n, c] = 1.0 if labels[n] == c else 0.0 (compared, never used as an address)"""
    rows = labels.expand_dims(1).broadcast_to(out.shape)
    kb.elementwise(out, [rows, kb.iota(out.shape, 1)], lambda s, v: s.mask(s.cmp("oeq", v[0], v[1])))


# ----- full, zeros, ones: no inputs at all -----


def _shape(value: Any) -> tuple[int, ...]:
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        value = (value,)
    try:
        shape = tuple(whole(d) for d in value)
    except TypeError:
        raise ValueError("expected an int or a sequence of ints") from None
    if any(d < 0 for d in shape):
        raise ValueError("every dimension must be >= 0")
    return shape


def _fill_value(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError("expected a number") from None


def _created_shape(attrs: Attrs) -> TensorType:
    return TensorType(attrs["shape"], attrs["dtype"])


def _creation_cases(d: CaseDraw, value: bool) -> Case:
    attrs = {"shape": d.shape(), "dtype": d.choice(["float32", "float64"])}
    if value:
        attrs["value"] = d.choice([0.0, -1.5, 3.25, 1e30])  # the checker counts inf and nan as mismatches
    return Case([], attrs)


full = Operator(
    "full",
    inputs=[],
    attrs=[
        Attr("shape", convert=_shape, doc="an int or a tuple of ints"),
        Attr("value", convert=_fill_value, doc="every element's value (inf and nan included)"),
        Attr("dtype", default="float32", convert=_float_dtype),
    ],
    doc="A tensor of `shape` filled with `value` (numpy.full); it has no inputs, so no gradient.",
)
full.shape_rule(_created_shape)


@full.reference
def _full_forward(shape: tuple[int, ...], value: float, dtype: str) -> np.ndarray:
    return np.full(shape, value, dtype=dtype)


@full.sampler
def _full_cases(d: CaseDraw) -> Case:
    return _creation_cases(d, value=True)


@full.lowering
def _full_lowering(kb: KernelBuilder, call: Call, out: View) -> View | None:
    """out = value (a constant view: consumers fold it, no memory is written)"""
    return kb.scalar(call.attrs["value"], out.dtype, out.shape)


zeros = Operator(
    "zeros",
    inputs=[],
    attrs=[Attr("shape", convert=_shape, doc="an int or a tuple of ints"),
           Attr("dtype", default="float32", convert=_float_dtype)],
    doc="A tensor of `shape` filled with 0 (numpy.zeros); it has no inputs, so no gradient.",
)
zeros.shape_rule(_created_shape)


@zeros.reference
def _zeros_forward(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    return np.zeros(shape, dtype=dtype)


@zeros.sampler
def _zeros_cases(d: CaseDraw) -> Case:
    return _creation_cases(d, value=False)


@zeros.lowering
def _zeros_lowering(kb: KernelBuilder, call: Call, out: View) -> View | None:
    """out = 0 (a constant view)"""
    return kb.scalar(0.0, out.dtype, out.shape)


ones = Operator(
    "ones",
    inputs=[],
    attrs=[Attr("shape", convert=_shape, doc="an int or a tuple of ints"),
           Attr("dtype", default="float32", convert=_float_dtype)],
    doc="A tensor of `shape` filled with 1 (numpy.ones); it has no inputs, so no gradient.",
)
ones.shape_rule(_created_shape)


@ones.reference
def _ones_forward(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    return np.ones(shape, dtype=dtype)


@ones.sampler
def _ones_cases(d: CaseDraw) -> Case:
    return _creation_cases(d, value=False)


@ones.lowering
def _ones_lowering(kb: KernelBuilder, call: Call, out: View) -> View | None:
    """out = 1 (a constant view)"""
    return kb.scalar(1.0, out.dtype, out.shape)
