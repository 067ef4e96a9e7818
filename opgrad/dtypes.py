"""Tensor types: a static shape and one of four dtypes.

opgrad keeps the dtype set small on purpose: every operator must have a numpy reference and an
LLVM kernel for each dtype it accepts, and the verification tooling checks all of them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from opgrad.errors import DimensionTypeError, ShapeError

FLOAT_DTYPES: tuple[str, ...] = ("float32", "float64")
INT_DTYPES: tuple[str, ...] = ("int32", "int64")
ALL_DTYPES: tuple[str, ...] = FLOAT_DTYPES + INT_DTYPES

Shape = tuple[int, ...]

#: Largest byte size (and so element count) of a tensor: offsets and strides are int64.
INT64_MAX = 2**63 - 1


def canonical_dtype(dtype: object) -> str:
    """Return the canonical name of a supported dtype, or raise ``TypeError`` naming the choices."""
    try:
        name = np.dtype(dtype).name  # type: ignore[call-overload]
    except TypeError as exc:
        raise TypeError(f"unsupported dtype {dtype!r}; expected one of {', '.join(ALL_DTYPES)}") from exc
    if name not in ALL_DTYPES:
        raise TypeError(f"unsupported dtype {name!r}; expected one of {', '.join(ALL_DTYPES)}")
    return str(name)


def as_shape(shape: object) -> Shape:
    """``shape`` as a tuple of ints >= 0; a single integer means a 1-D shape, as in numpy.

    Dimensions must be Python or numpy integers: a float (even ``3.0``), a bool or a string is a
    ``DimensionTypeError`` (a ``TypeError``), a negative one a ``ShapeError``.
    """
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        dims: Sequence[object] = (shape,)
    elif isinstance(shape, (str, bytes)) or not isinstance(shape, (Sequence, np.ndarray)):
        raise DimensionTypeError(
            f"shape must be a sequence of integers such as (2, 3), got {type(shape).__name__} {shape!r}"
        )
    else:
        dims = tuple(shape)
    shown = "(" + ", ".join(str(d) for d in dims) + ("," if len(dims) == 1 else "") + ")"
    out = []
    for axis, d in enumerate(dims):
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
            raise DimensionTypeError(
                f"shape {shown}: dimension {axis} is {type(d).__name__} {d!r}; "
                "dimensions must be integers (Python int or numpy integer)"
            )
        if d < 0:
            raise ShapeError(f"shape {shown}: dimension {axis} is {d}; dimensions must be >= 0")
        out.append(int(d))
    return tuple(out)


@dataclass(frozen=True)
class TensorType:
    """The static type of an expression: its shape and dtype."""

    shape: Shape
    dtype: str

    def __post_init__(self) -> None:
        shape = as_shape(self.shape)
        dtype = canonical_dtype(self.dtype)
        # numpy's rule: the product of the non-zero dimensions, in bytes, must fit in int64, so
        # every stride and offset of the tensor does too (a zero dimension does not shrink them).
        itemsize = np.dtype(dtype).itemsize
        limit = INT64_MAX // itemsize
        count = math.prod(d for d in shape if d)
        if count > limit:
            what = f"has {count} elements" if all(shape) else f"has non-zero dimensions multiplying to {count}"
            raise ShapeError(
                f"shape {shape} {what}; a {dtype} tensor may have at most {limit} "
                f"(its size in bytes and its strides must fit in int64)"
            )
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(str(d) for d in self.shape)}]"


def broadcast_shapes(*shapes: Shape) -> Shape | None:
    """Numpy broadcasting of ``shapes``; ``None`` when they are incompatible."""
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        return None


def collapses_to(source: Shape, target: Shape) -> bool:
    """True when ``target`` broadcasts to ``source``, i.e. ``source`` can be summed down to it."""
    return broadcast_shapes(source, target) == tuple(source)
