"""concatenate (a variadic op: any number of tensors joined along an axis) and split (its inverse).

``concatenate(xs, axis)`` is ``np.concatenate`` / ``torch.cat``; ``split(x, sections_or_indices,
axis)`` is ``np.split``: an int cuts the axis into that many equal parts, a list of indices cuts at
those positions. ``split`` is a composite (a tuple of ``strided_slice`` calls), so each part is an
ordinary expression with the slice's checked gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from opgrad import ops
from opgrad.dtypes import TensorType
from opgrad.ir import Call, Expr
from opgrad.op import Attr, Case, Input, Operator, composite, require

from ._common import axis_attr

if TYPE_CHECKING:  # types only: the compiler and the checker sit above the registry
    from opgrad.checks.strategies import CaseDraw
    from opgrad.compiler.builder import KernelBuilder
    from opgrad.compiler.views import View

concatenate = Operator(
    "concatenate",
    inputs=[Input("xs", variadic=True, doc="tensors of one rank, equal except along axis")],
    attrs=[Attr("axis", default=0, convert=axis_attr, uses_types=True, doc="the axis to join along (negative counts "
                                                                       "from the end)")],
    doc="The tensors xs joined along axis, as np.concatenate and torch.cat.",
    jointly_linear=True,
)


@concatenate.shape_rule
def _concatenate_shape(*types_and_attrs: Any) -> TensorType:
    *types, attrs = types_and_attrs
    axis, first = attrs["axis"], types[0]
    for i, t in enumerate(types[1:], start=1):
        require(t.ndim == first.ndim, f"xs[{i}] has rank {t.ndim} but xs[0] has rank {first.ndim}")
        differ = [d for d in range(first.ndim) if d != axis and t.shape[d] != first.shape[d]]
        require(not differ, f"xs[{i}] has shape {t.shape} but xs[0] has {first.shape}; they may differ only along "
                            f"axis {axis}")
    total = sum(t.shape[axis] for t in types)
    return TensorType((*first.shape[:axis], total, *first.shape[axis + 1 :]), first.dtype)


@concatenate.reference
def _concatenate_forward(*xs: np.ndarray, axis: int) -> np.ndarray:
    return np.concatenate(xs, axis=axis)


def _offsets(call: Any) -> list[int]:
    axis = call.attrs["axis"]
    starts = [0]
    for x in call.args:
        starts.append(starts[-1] + x.shape[axis])
    return starts


def _part(grad: Expr, axis: int, start: int, stop: int) -> Expr:
    """grad[..., start:stop, ...] along ``axis``."""
    begin = [0] * grad.ndim
    end = list(grad.shape)
    begin[axis], end[axis] = start, stop
    return ops.strided_slice(grad, begin=begin, end=end)


@concatenate.gradient
def _concatenate_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_xs[i] = grad[..., start_i : start_i + xs[i].shape[axis], ...] along axis"""
    axis, starts = call.attrs["axis"], _offsets(call)
    return [_part(grad, axis, starts[i], starts[i + 1]) for i in range(len(call.args))]


@concatenate.mutant("every input gets the gradient's first slice")
def _first_slice_for_all(call: Call, grad: Expr) -> list[Expr | None]:
    axis = call.attrs["axis"]
    return [_part(grad, axis, 0, x.shape[axis]) for x in call.args]


@concatenate.mutant("slices taken in reverse input order")
def _reversed_slices(call: Call, grad: Expr) -> list[Expr | None]:
    axis, starts = call.attrs["axis"], _offsets(call)
    total = starts[-1]
    return [_part(grad, axis, total - starts[i + 1], total - starts[i]) for i in range(len(call.args))]


@concatenate.sampler
def _concatenate_cases(d: CaseDraw) -> Case:
    rank = d.int(1, 3)
    base = list(d.shape(rank, rank))
    axis = d.int(0, rank - 1)
    shapes = []
    for _ in range(d.int(1, 4)):
        shape = list(base)
        shape[axis] = d.size()
        shapes.append(tuple(shape))
    return Case(shapes, {"axis": axis - rank if d.bool() else axis})


@concatenate.lowering
def _concatenate_lowering(kb: KernelBuilder, call: Call, out: View, *xs: View) -> None:
    """out[..., start_i : start_i + n_i, ...] = xs[i] along axis"""
    from dataclasses import replace

    axis, starts = call.attrs["axis"], _offsets(call)
    for x, start in zip(xs, starts):
        if x.size == 0:
            continue
        target = replace(out, shape=x.shape, offset=out.offset + start * out.strides[axis])
        kb.elementwise(target, [x], lambda s, v: v[0])


@composite("strided_slice")
def split(data: Expr, sections_or_indices: int | Sequence[int], axis: int = 0) -> tuple[Expr, ...]:
    """data cut along axis into a tuple of parts, as np.split: an int N gives N equal parts (the axis
    must divide evenly); a list of indices cuts at those positions (empty parts allowed)."""
    if not isinstance(data, Expr):
        raise TypeError(f"opgrad.ops.split: data must be an opgrad expression, got {type(data).__name__}")
    ndim = data.ndim
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or not -ndim <= int(axis) < ndim:
        raise ValueError(f"opgrad.ops.split: axis={axis!r} is out of range for data of shape {data.shape}")
    axis = int(axis) % ndim
    n = data.shape[axis]
    if isinstance(sections_or_indices, (int, np.integer)) and not isinstance(sections_or_indices, bool):
        parts = int(sections_or_indices)
        if parts < 1 or n % parts:
            raise ValueError(f"opgrad.ops.split: {parts} sections do not divide axis {axis} of shape {data.shape} "
                             "equally; pass split indices instead")
        cuts = [n // parts * i for i in range(1, parts)]
    else:
        try:
            cuts = [int(i) for i in sections_or_indices]  # type: ignore[union-attr]  # a bool fails here too
        except TypeError:
            raise TypeError("opgrad.ops.split: sections_or_indices must be an int or a list of ints, got "
                            f"{type(sections_or_indices).__name__}") from None
    bounds = [0, *(min(max(c if c >= 0 else c + n, 0), n) for c in cuts), n]
    return tuple(_part(data, axis, bounds[i], max(bounds[i], bounds[i + 1])) for i in range(len(bounds) - 1))
