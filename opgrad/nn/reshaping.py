"""Layers that move data without parameters: ``Reshape``, ``Permute``, ``ZeroPadding2D``.

They carry Keras' names and arguments (``target_shape`` and ``dims`` are per example, without
the batch axis; ``Permute`` counts axes from 1), so a model written for Keras, or imported from
it, reads the same here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from opgrad import ops
from opgrad.ir import Expr
from opgrad.nn.layers import ForwardContext, Layer, as_int, is_int

__all__ = ["Permute", "Reshape", "ZeroPadding2D"]

Shape = tuple[int, ...]


class Reshape(Layer):
    """The same elements per example in a new shape ``target_shape`` (row-major, one entry may be -1)."""

    kind = "reshape"

    def __init__(self, target_shape: Sequence[int], *, name: str | None = None) -> None:
        super().__init__(name)
        dims = tuple(as_int(d, "Reshape target_shape entries") for d in target_shape)
        if not dims or any(d == 0 or d < -1 for d in dims) or dims.count(-1) > 1:
            raise ValueError(f"Reshape target_shape must be positive ints with at most one -1, got {target_shape!r}")
        self.target_shape = dims

    def get_config(self) -> dict[str, Any]:
        return {"target_shape": list(self.target_shape)}

    def config(self) -> str:
        return ", ".join(map(str, self.target_shape))

    def output_shape_for(self, input_shape: Shape) -> Shape:
        size = int(np.prod(input_shape, dtype=np.int64))
        known = int(np.prod([d for d in self.target_shape if d != -1], dtype=np.int64))
        if -1 in self.target_shape:
            if size % known:
                raise self._shape_error(input_shape, f"{size} values do not fill target shape {self.target_shape}")
            return tuple(size // known if d == -1 else d for d in self.target_shape)
        if known != size:
            raise self._shape_error(input_shape, f"{size} values do not fit target shape {self.target_shape} "
                                                 f"({known} values)")
        return self.target_shape

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        assert self.output_shape is not None, "build() first"
        return ops.reshape(x, shape=(x.shape[0], *self.output_shape))


class Permute(Layer):
    """Per-example axes reordered: ``dims`` is a permutation of ``1..rank`` (Keras' ``Permute``).

    ``Permute((2, 3, 1))`` turns NCHW into NHWC and ``Permute((3, 1, 2))`` turns NHWC into NCHW.
    """

    kind = "permute"

    def __init__(self, dims: Sequence[int], *, name: str | None = None) -> None:
        super().__init__(name)
        axes = tuple(as_int(d, "Permute dims") for d in dims)
        if sorted(axes) != list(range(1, len(axes) + 1)):
            raise ValueError(f"Permute dims must be a permutation of 1..{len(axes)} (axis 0 is the batch), "
                             f"got {dims!r}")
        self.dims = axes

    def get_config(self) -> dict[str, Any]:
        return {"dims": list(self.dims)}

    def config(self) -> str:
        return ", ".join(map(str, self.dims))

    def output_shape_for(self, input_shape: Shape) -> Shape:
        if len(input_shape) != len(self.dims):
            raise self._shape_error(input_shape, f"Permute{self.dims} needs rank {len(self.dims)} per example")
        return tuple(input_shape[d - 1] for d in self.dims)

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        return ops.transpose(x, axes=(0, *self.dims))


class ZeroPadding2D(Layer):
    """Zeros around an NCHW image: ``padding`` is an int, ``(rows, cols)`` or ``((top, bottom), (left, right))``."""

    kind = "zeropadding"

    def __init__(self, padding: int | Sequence[int] | Sequence[Sequence[int]] = 1, *,
                 name: str | None = None) -> None:
        super().__init__(name)
        self.padding = self._normalize(padding)

    @staticmethod
    def _normalize(padding: Any) -> tuple[tuple[int, int], tuple[int, int]]:
        problem = f"ZeroPadding2D padding must be an int, two ints or two pairs of ints >= 0, got {padding!r}"
        try:
            if is_int(padding):
                p = int(padding)
                pads = ((p, p), (p, p))
            else:
                items = list(padding)
                if len(items) != 2:
                    raise ValueError(problem)
                if all(is_int(i) for i in items):
                    pads = ((int(items[0]), int(items[0])), (int(items[1]), int(items[1])))
                else:
                    rows, cols = (tuple(item) for item in items)
                    if len(rows) != 2 or len(cols) != 2 or not all(is_int(v) for v in (*rows, *cols)):
                        raise ValueError(problem)
                    pads = ((int(rows[0]), int(rows[1])), (int(cols[0]), int(cols[1])))
        except TypeError:
            raise ValueError(problem) from None
        if min(*pads[0], *pads[1]) < 0:
            raise ValueError(problem)
        return pads

    def get_config(self) -> dict[str, Any]:
        return {"padding": [list(self.padding[0]), list(self.padding[1])]}

    def config(self) -> str:
        return str(self.padding)

    def output_shape_for(self, input_shape: Shape) -> Shape:
        if len(input_shape) != 3:
            raise self._shape_error(input_shape, "ZeroPadding2D needs (channels, height, width)")
        c, h, w = input_shape
        (top, bottom), (left, right) = self.padding
        return (c, h + top + bottom, w + left + right)

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        return ops.pad(x, pad_width=((0, 0), (0, 0), *self.padding))
