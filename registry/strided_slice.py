"""strided_slice (numpy's basic slicing: begin, end, steps per axis) and strided_slice_backward.

The backward op writes a gradient into the sliced positions of zeros; each is the other's
gradient. Kernels are copies through strided views (negative strides for reversed slices),
materialized into the output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from opgrad import ops
from opgrad.dtypes import TensorType
from opgrad.ir import Call, Expr
from opgrad.op import Attr, Attrs, Case, Input, Operator, require, whole

from ._common import copy_element, shape_tuple, slice_view

if TYPE_CHECKING:  # types only: the compiler and the checker sit above the registry
    from opgrad.checks.strategies import CaseDraw
    from opgrad.compiler.builder import KernelBuilder
    from opgrad.compiler.views import View


def _index_list(value: Any) -> tuple[int | None, ...]:
    items = (value,) if value is None or isinstance(value, (int, np.integer)) else value
    try:
        return tuple(None if v is None else whole(v) for v in items)
    except TypeError:
        raise ValueError("expected an int, None, or a sequence of ints and Nones") from None


def _step_list(value: Any) -> tuple[int | None, ...] | None:
    if value is None:
        return None
    steps = _index_list(value)
    if any(s == 0 for s in steps):
        raise ValueError("a slice step cannot be zero")
    return steps


def _slice_attrs() -> list[Attr]:
    return [
        Attr("begin", convert=_index_list, doc="start per axis (numpy slice semantics: negative counts from the "
                                                "end, None is the default)"),
        Attr("end", convert=_index_list, doc="stop per axis, exclusive; as begin"),
        Attr("strides", default=None, convert=_step_list, doc="step per axis (negative reverses); None is 1"),
    ]


def resolved_slices(shape: Sequence[int], attrs: Attrs) -> list[tuple[int, int, int]]:
    """(start, step, length) per axis: numpy's data[begin[0]:end[0]:strides[0], ...]; axes past the
    given ones are taken whole."""
    begin, end, steps = attrs["begin"], attrs["end"], attrs["strides"]
    steps = steps if steps is not None else (None,) * len(begin)
    out = []
    for axis, n in enumerate(shape):
        if axis < len(begin):
            start, stop, step = slice(begin[axis], end[axis], steps[axis]).indices(n)
        else:
            start, stop, step = 0, n, 1
        out.append((start, step, len(range(start, stop, step))))
    return out


def _check_slice_attrs(ndim: int, attrs: Attrs) -> None:
    begin, end, steps = attrs["begin"], attrs["end"], attrs["strides"]
    require(len(begin) == len(end) and (steps is None or len(steps) == len(begin)),
            f"begin, end and strides must have one entry per sliced axis; got {len(begin)}, {len(end)} and "
            f"{'None' if steps is None else len(steps)}")
    require(len(begin) <= ndim, f"{len(begin)} axes sliced but data has rank {ndim}")


strided_slice = Operator(
    "strided_slice",
    inputs=[Input("data")],
    attrs=_slice_attrs(),
    doc="data[begin[0]:end[0]:strides[0], ...] with numpy's slicing semantics per axis (negative "
        "indices count from the end, negative strides walk backwards); unlisted axes are whole.",
    jointly_linear=True,
)


@strided_slice.shape_rule
def _strided_slice_shape(data: TensorType, attrs: Attrs) -> TensorType:
    _check_slice_attrs(data.ndim, attrs)
    return TensorType(tuple(length for _, _, length in resolved_slices(data.shape, attrs)), data.dtype)


def _slices(shape: Sequence[int], attrs: Attrs) -> tuple[slice, ...]:
    begin, end, steps = attrs["begin"], attrs["end"], attrs["strides"]
    steps = steps if steps is not None else (None,) * len(begin)
    return tuple(slice(b, e, s) for b, e, s in zip(begin, end, steps))


@strided_slice.reference
def _strided_slice_forward(data: np.ndarray, begin: Any, end: Any, strides: Any) -> np.ndarray:
    return np.asarray(data[_slices(data.shape, {"begin": begin, "end": end, "strides": strides})].copy())


@strided_slice.gradient
def _strided_slice_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = strided_slice_backward(grad): grad written at the sliced positions of zeros"""
    return [ops.strided_slice_backward(grad, input_shape=call.args[0].shape, **call.attrs)]


@strided_slice.mutant("negative steps ignored: the gradient lands at the forward positions")
def _strided_slice_forward_positions(call: Call, grad: Expr) -> list[Expr | None]:
    attrs = dict(call.attrs)
    if attrs["strides"] is not None:
        attrs["strides"] = tuple(None if s is None else abs(s) for s in attrs["strides"])
    return [ops.strided_slice_backward(grad, input_shape=call.args[0].shape, **attrs)]


def _draw_slice(d: CaseDraw, shape: tuple[int, ...]) -> dict[str, Any]:
    k = d.int(1, len(shape))
    begin, end, steps = [], [], []
    for n in shape[:k]:
        begin.append(None if d.int(0, 3) == 0 else d.int(-n - 1, n))
        end.append(None if d.int(0, 3) == 0 else d.int(-n - 1, n + 1))
        steps.append(d.choice([1, -1, 2, -2, 3, None]))
    return {"begin": tuple(begin), "end": tuple(end), "strides": None if d.int(0, 3) == 0 else tuple(steps)}


@strided_slice.sampler
def _strided_slice_cases(d: CaseDraw) -> Case:
    shape = d.shape(min_rank=1, max_rank=3)
    return Case([shape], _draw_slice(d, shape))


@strided_slice.lowering
def _strided_slice_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = data through a view: offset at each start, strides scaled by each step (negative ones too)"""
    view = data
    for axis, (start, step, length) in enumerate(resolved_slices(data.shape, call.attrs)):
        view = slice_view(view, axis, start, length, step)
    kb.elementwise(out, [view], copy_element)


strided_slice_backward = Operator(
    "strided_slice_backward",
    inputs=[Input("grad", doc="gradient of strided_slice's output")],
    attrs=[Attr("input_shape", convert=shape_tuple, doc="strided_slice's data.shape"), *_slice_attrs()],
    doc="Gradient of strided_slice: zeros of input_shape with grad written at the sliced positions.",
    jointly_linear=True,
)


@strided_slice_backward.shape_rule
def _strided_slice_backward_shape(grad: TensorType, attrs: Attrs) -> TensorType:
    shape = attrs["input_shape"]
    _check_slice_attrs(len(shape), attrs)
    sliced = tuple(length for _, _, length in resolved_slices(shape, attrs))
    require(grad.shape == sliced, f"grad has shape {grad.shape} but slicing input_shape {shape} gives {sliced}")
    return TensorType(shape, grad.dtype)


@strided_slice_backward.reference
def _strided_slice_backward_forward(grad: np.ndarray, input_shape: Any, begin: Any, end: Any,
                                    strides: Any) -> np.ndarray:
    out = np.zeros(input_shape, dtype=grad.dtype)
    out[_slices(input_shape, {"begin": begin, "end": end, "strides": strides})] = grad
    return out


@strided_slice_backward.gradient
def _strided_slice_backward_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_grad = strided_slice(c): the adjoint of writing into zeros is reading back"""
    attrs = {k: call.attrs[k] for k in ("begin", "end", "strides")}
    return [ops.strided_slice(grad, **attrs)]


@strided_slice_backward.mutant("reads back at the slice's positions shifted by one step (right only at stride 1 "
                               "from the start)")
def _strided_slice_backward_shifted(call: Call, grad: Expr) -> list[Expr | None]:
    begin = tuple(None if b is None else b + (1 if s is None or s > 0 else -1)
                  for b, s in zip(call.attrs["begin"], call.attrs["strides"] or (None,) * len(call.attrs["begin"])))
    return [ops.strided_slice(grad, begin=begin, end=call.attrs["end"], strides=call.attrs["strides"])]


@strided_slice_backward.mutant("strides taken as 1 (right only when every step is 1)")
def _strided_slice_backward_unit_steps(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.strided_slice(grad, begin=call.attrs["begin"], end=call.attrs["end"])]


@strided_slice_backward.sampler
def _strided_slice_backward_cases(d: CaseDraw) -> Case:
    shape = d.shape(min_rank=1, max_rank=3)
    attrs = _draw_slice(d, shape)
    sliced = tuple(length for _, _, length in resolved_slices(shape, attrs))
    return Case([sliced], {"input_shape": shape, **attrs})


@strided_slice_backward.lowering
def _strided_slice_backward_lowering(kb: KernelBuilder, call: Call, out: View, grad: View) -> None:
    """out = 0, then grad copied into out's sliced view"""
    view = out
    for axis, (start, step, length) in enumerate(resolved_slices(out.shape, call.attrs)):
        view = slice_view(view, axis, start, length, step)
    if view.size != out.size:
        kb.elementwise(out, [], lambda s, v: s.const(0.0))
    if view.size:
        kb.elementwise(view, [grad], copy_element)
