"""flip: numpy.flip, data read backwards along the chosen axes; its own gradient.

Its kernel is a copy through a view with negative strides, materialized into the output so that
no consumer ever receives a negative-stride view.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from opgrad import ops
from opgrad.dtypes import TensorType
from opgrad.ir import Call, Expr
from opgrad.op import Attr, Case, Input, Operator

from ._common import copy_element, normalized_axis, same_as_first

if TYPE_CHECKING:  # types only: the compiler and the checker sit above the registry
    from opgrad.checks.strategies import CaseDraw
    from opgrad.compiler.builder import KernelBuilder
    from opgrad.compiler.views import View


def _flip_axes(value: Any, types: Sequence[TensorType], _attrs: Any = None) -> tuple[int, ...]:
    ndim = types[0].ndim if types else 0
    if value is None:
        return tuple(range(ndim))
    items = (value,) if isinstance(value, (int, np.integer)) and not isinstance(value, bool) else value
    try:
        axes = sorted(normalized_axis(int(a), ndim) for a in items)
    except TypeError:
        raise ValueError("expected None, an int or a tuple of ints") from None
    if len(set(axes)) != len(axes):
        raise ValueError(f"axis {value} repeats an axis")
    return tuple(axes)


def _reversed_view(view: View, axes: Sequence[int]) -> View:
    """``view`` read backwards along ``axes``: negative strides from the last element."""
    offset = view.offset + sum((view.shape[a] - 1) * view.strides[a] for a in axes)
    strides = tuple(-s if a in axes else s for a, s in enumerate(view.strides))
    return replace(view, strides=strides, offset=offset)


flip = Operator(
    "flip",
    inputs=[Input("data")],
    attrs=[Attr("axis", default=None, convert=_flip_axes, uses_types=True,
                doc="an int or a tuple of ints; None reverses every axis")],
    doc="Reverse the order of elements along `axis` (numpy.flip).",
    jointly_linear=True,
)
flip.shape_rule(same_as_first)


@flip.reference
def _flip_forward(data: np.ndarray, axis: tuple[int, ...]) -> np.ndarray:
    return np.asarray(np.flip(data, axis).copy())


@flip.gradient
def _flip_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = flip(grad, axis): a reversal is its own adjoint"""
    return [ops.flip(grad, axis=call.attrs["axis"])]


@flip.mutant("gradient not flipped back")
def _flip_identity(call: Call, grad: Expr) -> list[Expr | None]:
    return [grad]


@flip.sampler
def _flip_cases(d: CaseDraw) -> Case:
    shape = d.shape(min_rank=1, max_rank=4)
    axes = d.subset([a - len(shape) if d.bool() else a for a in range(len(shape))])
    axis = None if d.int(0, 4) == 0 else (axes[0] if len(axes) == 1 and d.bool() else axes)
    return Case([shape], {"axis": axis})


@flip.lowering
def _flip_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = data read through negative strides along axis"""
    kb.elementwise(out, [_reversed_view(data, call.attrs["axis"])], copy_element)
