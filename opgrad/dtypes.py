"""Tensor types: a static shape and one of four dtypes.

opgrad keeps the dtype set small on purpose: every operator must have a numpy reference and an
LLVM kernel for each dtype it accepts, and the verification tooling checks all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FLOAT_DTYPES: tuple[str, ...] = ("float32", "float64")
INT_DTYPES: tuple[str, ...] = ("int32", "int64")
ALL_DTYPES: tuple[str, ...] = FLOAT_DTYPES + INT_DTYPES

Shape = tuple[int, ...]


def canonical_dtype(dtype: object) -> str:
    """Return the canonical name of a supported dtype, or raise ``TypeError`` naming the choices."""
    try:
        name = np.dtype(dtype).name  # type: ignore[call-overload]
    except TypeError as exc:
        raise TypeError(f"unsupported dtype {dtype!r}; expected one of {', '.join(ALL_DTYPES)}") from exc
    if name not in ALL_DTYPES:
        raise TypeError(f"unsupported dtype {name!r}; expected one of {', '.join(ALL_DTYPES)}")
    return name


@dataclass(frozen=True)
class TensorType:
    """The static type of an expression: its shape and dtype."""

    shape: Shape
    dtype: str

    def __post_init__(self) -> None:
        shape = tuple(int(d) for d in self.shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"negative dimension in shape {shape}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

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
