"""Tensors made from another's shape or from integer labels: zeros_like, ones_like, one_hot.

Their inputs are read only for shape (or as indices), so none is differentiable.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from opgrad.dtypes import FLOAT_DTYPES, TensorType
from opgrad.op import Attr, Case, Input, Operator, require

zeros_like = Operator(
    "zeros_like",
    inputs=[Input("like", differentiable=False, doc="only its shape and dtype are read")],
    doc="Zeros with the shape and dtype of `like`.",
)


@zeros_like.shape_rule
def _like_shape(like: TensorType, attrs: Any) -> TensorType:
    return like


@zeros_like.reference
def _zeros_like_forward(like: np.ndarray) -> np.ndarray:
    return np.zeros_like(like)


@zeros_like.lowering
def _zeros_like_lowering(kb, call, out, like):
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
def _ones_like_lowering(kb, call, out, like):
    """out = 1 (a constant view: consumers fold it, no memory is written)"""
    return kb.scalar(1.0, out.dtype, out.shape)


def _float_dtype(value: Any) -> str:
    name = np.dtype(value).name
    if name not in FLOAT_DTYPES:
        raise ValueError(f"expected one of {', '.join(FLOAT_DTYPES)}")
    return name


def _positive_int(value: Any) -> int:
    if int(value) != value or int(value) < 1:
        raise ValueError("expected a positive int")
    return int(value)


one_hot = Operator(
    "one_hot",
    inputs=[Input("labels", kind="int", dims=("N",), int_range=(0, "depth"))],
    attrs=[
        Attr("depth", convert=_positive_int, doc="number of classes C"),
        Attr("dtype", default="float32", convert=_float_dtype),
    ],
    doc="(N,) integer labels in [0, depth) -> (N, depth) float rows with a single 1.0.",
)


@one_hot.shape_rule
def _one_hot_shape(labels: TensorType, attrs: Any) -> TensorType:
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
def _one_hot_cases(d):
    return Case([(d.size(),)], {"depth": d.size(), "dtype": d.choice(["float32", "float64"])})


@one_hot.lowering
def _one_hot_lowering(kb, call, out, labels):
    """out[n, c] = 1.0 if labels[n] == c else 0.0 (compared, never used as an address)"""
    rows = labels.expand_dims(1).broadcast_to(out.shape)
    kb.elementwise(out, [rows, kb.iota(out.shape, 1)], lambda s, v: s.mask(s.cmp("oeq", v[0], v[1])))
