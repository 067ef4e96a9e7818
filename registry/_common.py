"""Shape rules and converters shared by several operator files (not an operator module)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opgrad.dtypes import TensorType, broadcast_shapes
from opgrad.op import Attrs, Interval, require

POSITIVE = (Interval(0.2, 3.0),)
AWAY_FROM_ZERO = (Interval(-3.0, -0.5), Interval(0.5, 3.0))


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
    if isinstance(value, int) and not isinstance(value, bool):
        return (int(value),)
    try:
        return tuple(int(v) for v in value)
    except TypeError:
        raise ValueError("expected None, an int or a sequence of ints") from None


def shape_tuple(value: Any) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in value)
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
