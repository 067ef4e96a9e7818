"""take (numpy.take along one axis) and take_backward, which scatters a gradient back.

Each is the other's gradient (take is linear in data, take_backward in grad), so gradients of
any order stay registered ops. The kernels compare indices with an iota rather than using them
as addresses (the compiler's rule for integer inputs), so they cost O(axis size) per output element.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from opgrad import ops
from opgrad.dtypes import TensorType
from opgrad.ir import Call, Expr
from opgrad.op import Attr, Attrs, Case, Input, Operator, require, whole

from ._common import normalized_axis, positive_int

if TYPE_CHECKING:  # types only: the compiler and the checker sit above the registry
    from opgrad.checks.strategies import CaseDraw
    from opgrad.compiler.builder import KernelBuilder
    from opgrad.compiler.views import Scalar, View


def _take_axis(value: Any, types: Sequence[TensorType], _attrs: Any = None) -> int:
    return normalized_axis(whole(value), types[0].ndim if types else 0)


def _axis_size(value: Any, types: Sequence[TensorType], attrs: dict[str, Any]) -> int:
    size = types[0].shape[attrs["axis"]]
    if value is not None and int(value) != size:
        raise ValueError(f"axis_size is derived from data ({size} along axis {attrs['axis']}); got {value}")
    return int(size)


take = Operator(
    "take",
    inputs=[
        Input("data"),
        Input("indices", kind="int", int_range=(0, "axis_size"),
              doc="any shape; each in [0, data.shape[axis]) (negative indices are an error, not wrapped)"),
    ],
    attrs=[
        Attr("axis", default=0, convert=_take_axis, uses_types=True, doc="the axis indices select along"),
        Attr("axis_size", default=None, convert=_axis_size, uses_types=True,
             doc="derived: data.shape[axis], the bound the indices are checked against"),
    ],
    doc="numpy.take(data, indices, axis): the output is data.shape[:axis] + indices.shape + "
        "data.shape[axis + 1:]; an embedding lookup with axis=0. Repeated indices are allowed.",
    linear_in=("data",),
)


@take.shape_rule
def _take_shape(data: TensorType, indices: TensorType, attrs: Attrs) -> TensorType:
    axis = attrs["axis"]
    return TensorType(data.shape[:axis] + indices.shape + data.shape[axis + 1:], data.dtype)


def _check_indices(indices: np.ndarray, size: int, op: str) -> None:
    if indices.size and (indices.min() < 0 or indices.max() >= size):
        raise ValueError(f"{op}: indices must lie in [0, {size}), got values in [{indices.min()}, {indices.max()}]")


@take.reference
def _take_forward(data: np.ndarray, indices: np.ndarray, axis: int, axis_size: int) -> np.ndarray:
    _check_indices(indices, axis_size, "take")
    return np.take(data, indices, axis=axis)


@take.gradient
def _take_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = take_backward(grad, indices): grad added back at each index (repeats accumulate)"""
    indices = call.args[1]
    return [ops.take_backward(grad, indices, axis=call.attrs["axis"], axis_size=call.attrs["axis_size"]), None]


@take.mutant("repeated indices overwrite instead of accumulating (mean of the repeats)")
def _take_no_accumulation(call: Call, grad: Expr) -> list[Expr | None]:
    indices = call.args[1]
    axis, size = call.attrs["axis"], call.attrs["axis_size"]
    counts = ops.take_backward(ops.ones_like(grad), indices, axis=axis, axis_size=size)
    summed = ops.take_backward(grad, indices, axis=axis, axis_size=size)
    return [ops.divide(summed, ops.add(counts, ops.multiply(ops.greater(ops.ones_like(counts), counts), 1.0))),
            None]


@take.sampler
def _take_cases(d: CaseDraw) -> Case:
    shape = d.shape(min_rank=1, max_rank=3)
    axis = d.int(-len(shape), len(shape) - 1)
    return Case([shape, d.shape(max_rank=2)], {"axis": axis})


@take.lowering
def _take_lowering(kb: KernelBuilder, call: Call, out: View, data: View, indices: View) -> None:
    """out[pre, i, post] = data[pre, indices[i], post]: rows by address along axis 0 (kb.gather_rows), else
    the sum over k of (data[pre, k, post] if indices[i] == k else 0), a compare and no address"""
    axis, size = call.attrs["axis"], call.attrs["axis_size"]
    if axis == 0 and kb.gather_rows(out, data, indices):  # an embedding lookup: rows copied by address
        return
    ni = indices.ndim
    pre, post = data.shape[:axis], data.shape[axis + 1:]
    full = (*pre, *indices.shape, *post, size)
    zeros_i, zeros_p = (0,) * ni, (0,) * len(post)
    values = replace(data, shape=full, strides=(*data.strides[:axis], *zeros_i, *data.strides[axis + 1:],
                                                data.strides[axis]))
    picks = replace(indices, shape=full, strides=((0,) * axis + indices.strides + zeros_p + (0,)))
    kb.map_reduce(out, [values, picks, kb.iota(full, len(full) - 1)], (len(full) - 1,), "sum",
                  body=lambda s, v: s.select(s.cmp("oeq", v[1], v[2]), v[0], s.const(0.0)))


def _take_backward_axis(value: Any, types: Sequence[TensorType], _attrs: Any = None) -> int:
    ndim = types[0].ndim - types[1].ndim + 1 if len(types) == 2 else 0
    if ndim < 1:
        raise ValueError(f"grad of rank {types[0].ndim} cannot hold indices of rank {types[1].ndim}")
    return normalized_axis(whole(value), ndim)


take_backward = Operator(
    "take_backward",
    inputs=[
        Input("grad", doc="shaped like take's output: pre + indices.shape + post"),
        Input("indices", kind="int", int_range=(0, "axis_size"), doc="the indices take used"),
    ],
    attrs=[
        Attr("axis", default=0, convert=_take_backward_axis, uses_types=True, doc="take's axis"),
        Attr("axis_size", convert=positive_int, doc="take's data.shape[axis]"),
    ],
    doc="Gradient of take: zeros of shape pre + (axis_size,) + post with each grad slice added at its "
        "index (a scatter-add: repeated indices accumulate).",
    linear_in=("grad",),
)


@take_backward.shape_rule
def _take_backward_shape(grad: TensorType, indices: TensorType, attrs: Attrs) -> TensorType:
    axis, ni = attrs["axis"], indices.ndim
    require(
        grad.shape[axis:axis + ni] == indices.shape,
        f"grad has shape {grad.shape} but take along axis {axis} with indices {indices.shape} gives "
        f"axes {axis}..{axis + ni - 1} of shape {indices.shape}",
    )
    return TensorType(grad.shape[:axis] + (attrs["axis_size"],) + grad.shape[axis + ni:], grad.dtype)


@take_backward.reference
def _take_backward_forward(grad: np.ndarray, indices: np.ndarray, axis: int, axis_size: int) -> np.ndarray:
    _check_indices(indices, axis_size, "take_backward")
    ni = indices.ndim
    pre, post = grad.shape[:axis], grad.shape[axis + ni:]
    moved = np.moveaxis(grad.reshape(*pre, indices.size, *post), axis, 0)
    out = np.zeros((axis_size, *pre, *post), dtype=grad.dtype)
    np.add.at(out, indices.reshape(-1), moved)
    return np.moveaxis(out, 0, axis)


@take_backward.gradient
def _take_backward_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_grad = take(c, indices): the adjoint of a scatter-add is the gather"""
    return [ops.take(grad, call.args[1], axis=call.attrs["axis"]), None]


@take_backward.mutant("gathers along the last axis whatever the axis (right when axis is the last)")
def _take_backward_last_axis(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.take(grad, call.args[1], axis=-1), None]


@take_backward.mutant("off by 1e-4 relative")
def _take_backward_slightly_off(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.multiply(ops.take(grad, call.args[1], axis=call.attrs["axis"]), 1.0001), None]


@take_backward.sampler
def _take_backward_cases(d: CaseDraw) -> Case:
    shape = d.shape(min_rank=1, max_rank=3)
    axis = d.int(0, len(shape) - 1)
    ishape = d.shape(max_rank=2)
    return Case([shape[:axis] + ishape + shape[axis + 1:], ishape], {"axis": axis, "axis_size": shape[axis]})


@take_backward.lowering
def _take_backward_lowering(kb: KernelBuilder, call: Call, out: View, grad: View, indices: View) -> None:
    """out[pre, k, post] = sum over i of (grad[pre, i, post] if indices[i] == k else 0)"""
    axis, size, ni = call.attrs["axis"], call.attrs["axis_size"], indices.ndim
    if axis == 0 and kb.scatter_add_rows(out, grad, indices):  # rows added by address, picks in order
        return
    pre, post = out.shape[:axis], out.shape[axis + 1:]
    full = (*pre, size, *post, *indices.shape)
    values = replace(grad, shape=full, strides=(*grad.strides[:axis], 0, *grad.strides[axis + ni:],
                                                *grad.strides[axis:axis + ni]))
    picks = replace(indices, shape=full, strides=(0,) * (len(out.shape)) + indices.strides)
    reduced = tuple(range(out.ndim, len(full)))

    def body(s: Scalar, v: list[str]) -> str:
        return s.select(s.cmp("oeq", v[1], v[2]), v[0], s.const(0.0))

    if reduced:
        kb.map_reduce(out, [values, picks, kb.iota(full, axis)], reduced, "sum", body=body)
    else:  # a scalar index: one slice of the output receives grad, the rest is zero
        kb.elementwise(out, [values, picks, kb.iota(full, axis)], body)
