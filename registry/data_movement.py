"""Data movement without arithmetic: flip, take, pad, strided_slice, space_to_depth and
depth_to_space, with the backward operators that scatter gradients back (take_backward,
pad_backward, strided_slice_backward).

Semantics are numpy's (``numpy.flip``, ``numpy.take``, ``numpy.pad``, basic slicing) and, for the
NCHW block moves, PyTorch's ``pixel_unshuffle`` / ``pixel_shuffle``. Every forward is linear in its
float input, and each backward operator is the adjoint of its forward: the two are each other's
gradient, so gradients of any order stay registered ops.

Kernels are copies through strided views (negative strides for flips and reversed slices, zero
strides for edge padding), materialized into the output so that no consumer ever receives a
negative-stride view. ``take`` compares indices with an iota rather than using them as addresses
(the compiler's rule for integer inputs), so its kernel costs O(axis size) per output element.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from opgrad import ops
from opgrad.dtypes import TensorType
from opgrad.ir import Call, Expr
from opgrad.op import Attr, Case, Input, Operator, require

from ._common import same_as_first, shape_tuple

if TYPE_CHECKING:  # types only: the compiler and the checker sit above the registry
    from opgrad.checks.strategies import CaseDraw
    from opgrad.compiler.builder import KernelBuilder
    from opgrad.compiler.views import Body, Scalar, View


def _copy(s: Scalar, v: list[str]) -> str:
    return v[0]


def _normalized_axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for a rank-{ndim} data")
    return axis % ndim


# ----- flip -----


def _flip_axes(value: Any, types: Sequence[TensorType], _attrs: Any = None) -> tuple[int, ...]:
    ndim = types[0].ndim if types else 0
    if value is None:
        return tuple(range(ndim))
    items = (value,) if isinstance(value, (int, np.integer)) and not isinstance(value, bool) else value
    try:
        axes = sorted(_normalized_axis(int(a), ndim) for a in items)
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
    kb.elementwise(out, [_reversed_view(data, call.attrs["axis"])], _copy)


# ----- take and take_backward -----


def _take_axis(value: Any, types: Sequence[TensorType], _attrs: Any = None) -> int:
    return _normalized_axis(int(value), types[0].ndim if types else 0)


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
def _take_shape(data: TensorType, indices: TensorType, attrs: Any) -> TensorType:
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
    """out[pre, i, post] = sum over k of (data[pre, k, post] if indices[i] == k else 0): a compare, never an address"""
    axis, size = call.attrs["axis"], call.attrs["axis_size"]
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
    return _normalized_axis(int(value), ndim)


def _positive(value: Any) -> int:
    if int(value) != value or int(value) < 1:
        raise ValueError("expected a positive int")
    return int(value)


take_backward = Operator(
    "take_backward",
    inputs=[
        Input("grad", doc="shaped like take's output: pre + indices.shape + post"),
        Input("indices", kind="int", int_range=(0, "axis_size"), doc="the indices take used"),
    ],
    attrs=[
        Attr("axis", default=0, convert=_take_backward_axis, uses_types=True, doc="take's axis"),
        Attr("axis_size", convert=_positive, doc="take's data.shape[axis]"),
    ],
    doc="Gradient of take: zeros of shape pre + (axis_size,) + post with each grad slice added at its "
        "index (a scatter-add: repeated indices accumulate).",
    linear_in=("grad",),
)


@take_backward.shape_rule
def _take_backward_shape(grad: TensorType, indices: TensorType, attrs: Any) -> TensorType:
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


# ----- pad and pad_backward -----

PAD_MODES = ("constant", "reflect", "edge")


def _pad_width(value: Any, types: Sequence[TensorType], _attrs: Any = None) -> tuple[tuple[int, int], ...]:
    ndim = types[0].ndim if types else 0
    try:
        pairs = np.broadcast_to(np.asarray(value, dtype=np.int64), (ndim, 2))
    except (ValueError, TypeError):
        raise ValueError(f"expected an int, a (before, after) pair or {ndim} pairs (numpy.pad's forms)") from None
    if np.any(np.asarray(value) != np.asarray(value, dtype=np.int64)):
        raise ValueError("pad widths must be ints")
    if (pairs < 0).any():
        raise ValueError("pad widths must be >= 0")
    return tuple((int(b), int(a)) for b, a in pairs)


def _mode(value: Any) -> str:
    if value not in PAD_MODES:
        raise ValueError(f"expected one of {', '.join(PAD_MODES)}")
    return str(value)


def _pad_value(value: Any, _types: Any, attrs: dict[str, Any]) -> float:
    v = float(value)
    if attrs["mode"] != "constant" and v != 0.0:
        raise ValueError(f"value is the fill of mode 'constant'; mode {attrs['mode']!r} takes none")
    return v


def _pad_attrs(with_value: bool) -> list[Attr]:
    attrs = [
        Attr("pad_width", convert=_pad_width, uses_types=True,
             doc="numpy.pad's forms: an int, (before, after), or one pair per axis"),
        Attr("mode", default="constant", convert=_mode, doc="constant, reflect or edge (numpy.pad's modes)"),
    ]
    if with_value:
        attrs.append(Attr("value", default=0.0, convert=_pad_value, uses_types=True, doc="fill of mode constant"))
    return attrs


def source_index(n: int, before: int, after: int, mode: str) -> list[int]:
    """For each padded position along one axis, the input index it copies (-1: the constant).

    reflect is numpy's: a triangle wave of period 2 (n - 1) that never repeats the edge, so pads
    wider than the axis keep reflecting; a length-1 axis repeats its only element.
    """
    out = []
    for p in range(before + n + after):
        q = p - before
        if 0 <= q < n:
            out.append(q)
        elif mode == "constant":
            out.append(-1)
        elif mode == "edge" or n == 1:
            out.append(min(max(q, 0), n - 1))
        else:
            period = 2 * (n - 1)
            r = q % period
            out.append(r if r < n else period - r)
    return out


def _runs(src: list[int]) -> list[tuple[int, int, int, int]]:
    """Split a source map into runs ``(first position, length, first source, step)`` in which the
    source moves by a constant step of -1, 0 or 1 (each a strided view); source -1 marks the constant."""
    runs, p = [], 0
    while p < len(src):
        step = src[p + 1] - src[p] if p + 1 < len(src) and (src[p] < 0) == (src[p + 1] < 0) else 0
        if src[p] < 0 or abs(step) > 1:
            step = 0
        q = p + 1
        while q < len(src) and (src[q] < 0) == (src[p] < 0) and (src[p] < 0 or src[q] - src[q - 1] == step):
            q += 1
        runs.append((p, q - p, src[p], step))
        p = q
    return runs


def _slice_view(view: View, axis: int, start: int, length: int, step: int) -> View:
    """Positions start, start + step, ... (length of them) along one axis of ``view``."""
    strides = list(view.strides)
    shape = list(view.shape)
    offset = view.offset + start * strides[axis]
    strides[axis] *= step
    shape[axis] = length
    return replace(view, shape=tuple(shape), strides=tuple(strides), offset=offset)


pad = Operator(
    "pad",
    inputs=[Input("data")],
    attrs=_pad_attrs(with_value=True),
    doc="numpy.pad(data, pad_width, mode) for modes constant (filled with `value`), reflect (mirrored, "
        "edge not repeated) and edge (edge repeated).",
)


@pad.shape_rule
def _pad_shape(data: TensorType, attrs: Any) -> TensorType:
    if attrs["mode"] != "constant":
        for axis, (n, (b, a)) in enumerate(zip(data.shape, attrs["pad_width"])):
            require(n > 0 or b + a == 0,
                    f"mode {attrs['mode']!r} cannot pad axis {axis} of length 0 (nothing to copy from)")
    return TensorType(tuple(n + b + a for n, (b, a) in zip(data.shape, attrs["pad_width"])), data.dtype)


@pad.reference
def _pad_forward(data: np.ndarray, pad_width: Any, mode: str, value: float) -> np.ndarray:
    if mode == "constant":
        return np.pad(data, pad_width, mode="constant", constant_values=value)
    return np.pad(data, pad_width, mode="reflect" if mode == "reflect" else "edge")


@pad.gradient
def _pad_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = pad_backward(grad): the padded border added back onto the elements it copies"""
    return [ops.pad_backward(grad, pad_width=call.attrs["pad_width"], mode=call.attrs["mode"])]


@pad.mutant("border gradient dropped: a crop instead of a scatter-add (right only for constant)")
def _pad_crop_only(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.pad_backward(grad, pad_width=call.attrs["pad_width"], mode="constant")]


@pad.mutant("pad widths swapped (after, before)")
def _pad_swapped(call: Call, grad: Expr) -> list[Expr | None]:
    swapped = tuple((a, b) for b, a in call.attrs["pad_width"])
    return [ops.pad_backward(grad, pad_width=swapped, mode=call.attrs["mode"])]


def _draw_pad_case(d: CaseDraw, padded_input: bool) -> Case:
    shape = d.shape(min_rank=1, max_rank=3)
    mode = d.choice(PAD_MODES)
    pairs = tuple((d.int(0, 2 * n if mode == "reflect" else 3), d.int(0, 3)) for n in shape)
    form = d.int(0, 2)
    if form == 0 and len({p for p in pairs}) == 1 and pairs[0][0] == pairs[0][1]:
        width: Any = pairs[0][0]  # numpy's int form
    elif form == 1 and len(set(pairs)) == 1:
        width = pairs[0]  # one (before, after) pair for every axis
    else:
        width = pairs
    attrs: dict[str, Any] = {"pad_width": width, "mode": mode}
    if padded_input:
        return Case([tuple(n + b + a for n, (b, a) in zip(shape, pairs))], attrs)
    if mode == "constant":
        attrs["value"] = d.choice([0.0, 1.5])
    return Case([shape], attrs)


@pad.sampler
def _pad_cases(d: CaseDraw) -> Case:
    return _draw_pad_case(d, padded_input=False)


@pad.lowering
def _pad_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = data copied into the middle; the border filled (constant) or copied through reflected views"""
    widths, mode = call.attrs["pad_width"], call.attrs["mode"]
    interior = out
    for axis, (n, (b, _)) in enumerate(zip(data.shape, widths)):
        interior = _slice_view(interior, axis, b, n, 1)
    if mode == "constant":
        if interior.shape != out.shape:
            kb.elementwise(out, [], lambda s, v: s.const(call.attrs["value"]))
        if data.size:
            kb.elementwise(interior, [data], _copy)
        return
    # reflect / edge: one strided copy per block of runs (a run per border and one for the middle)
    per_axis = [_runs(source_index(n, b, a, mode)) for n, (b, a) in zip(data.shape, widths)]
    for block in itertools.product(*per_axis):
        target, source = out, data
        for axis, (p, length, first, step) in enumerate(block):
            target = _slice_view(target, axis, p, length, 1)
            source = _slice_view(source, axis, first, length, step)
        kb.elementwise(target, [source], _copy)


def _unpadded_shape(grad: TensorType, attrs: Any) -> tuple[int, ...]:
    return tuple(g - b - a for g, (b, a) in zip(grad.shape, attrs["pad_width"]))


pad_backward = Operator(
    "pad_backward",
    inputs=[Input("grad", doc="gradient of pad's output")],
    attrs=_pad_attrs(with_value=False),
    doc="Gradient of pad: each padded position's grad added onto the input element it copied (a crop "
        "for mode constant).",
    jointly_linear=True,
)


@pad_backward.shape_rule
def _pad_backward_shape(grad: TensorType, attrs: Any) -> TensorType:
    shape = _unpadded_shape(grad, attrs)
    low = 0 if attrs["mode"] == "constant" else 1
    require(all(n >= low for n in shape),
            f"grad of shape {grad.shape} is smaller than the pad widths {attrs['pad_width']} "
            f"(the padded input would have shape {shape})")
    return TensorType(shape, grad.dtype)


@pad_backward.reference
def _pad_backward_forward(grad: np.ndarray, pad_width: Any, mode: str) -> np.ndarray:
    out = grad
    for axis, (b, a) in enumerate(pad_width):
        n = out.shape[axis] - b - a
        src = np.array(source_index(n, b, a, mode))
        keep = src >= 0
        moved = np.moveaxis(out, axis, 0)
        summed = np.zeros((n, *moved.shape[1:]), dtype=grad.dtype)
        np.add.at(summed, src[keep], moved[keep])
        out = np.moveaxis(summed, 0, axis)
    return out


@pad_backward.gradient
def _pad_backward_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_grad = pad(c, pad_width, mode): the adjoint of the scatter-add is the copy"""
    return [ops.pad(grad, pad_width=call.attrs["pad_width"], mode=call.attrs["mode"])]


@pad_backward.mutant("pads with zeros whatever the mode (right for constant; edge and reflect differ at borders)")
def _pad_backward_constant_only(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.pad(grad, pad_width=call.attrs["pad_width"], mode="constant")]


@pad_backward.sampler
def _pad_backward_cases(d: CaseDraw) -> Case:
    return _draw_pad_case(d, padded_input=True)


@pad_backward.lowering
def _pad_backward_lowering(kb: KernelBuilder, call: Call, out: View, grad: View) -> None:
    """out = grad folded back one axis at a time: per output segment, the sum of the runs copying it"""
    widths, mode = call.attrs["pad_width"], call.attrs["mode"]
    padded = [axis for axis, (b, a) in enumerate(widths) if b or a]
    current = grad
    for axis in range(out.ndim):
        b, a = widths[axis]
        if axis not in padded:
            continue
        n = out.shape[axis]
        shape = (*current.shape[:axis], n, *current.shape[axis + 1:])
        last = axis == padded[-1]
        target = out if last else kb.temporary(shape, out.dtype)
        # contributions: (first target index, length, view of current over those targets)
        parts = []
        for p, length, first, step in _runs(source_index(n, b, a, mode)):
            if first < 0:
                continue
            if step == 0 and length > 1:  # edge: a whole run lands on one element, summed first
                kept = (*shape[:axis], 1, *shape[axis + 1:])
                total = kb.temporary(kept, out.dtype)
                kb.reduce(total, _slice_view(current, axis, p, length, 1), (axis,), "sum")
                parts.append((first, 1, total))
            elif step >= 0:
                parts.append((first, length, _slice_view(current, axis, p, length, 1)))
            else:  # reflected run: target first - k reads position p + k, so read it backwards
                parts.append((first - length + 1, length, _slice_view(current, axis, p + length - 1, length, -1)))
        cuts = sorted({0, n, *(t for t, _, _ in parts), *(t + m for t, m, _ in parts)})
        for lo, hi in itertools.pairwise(cuts):
            views = [_slice_view(v, axis, lo - t, hi - lo, 1) for t, m, v in parts if t <= lo and hi <= t + m]
            kb.elementwise(_slice_view(target, axis, lo, hi - lo, 1), views, _sum_body(len(views)))
        current = target
    if not padded:
        kb.elementwise(out, [grad], _copy)


def _sum_body(count: int) -> Body:
    def body(s: Scalar, v: list[str]) -> str:
        total = v[0] if count else s.const(0.0)
        for x in v[1:]:
            total = s.add(total, x)
        return total

    return body


# ----- strided_slice and strided_slice_backward -----


def _index_list(value: Any) -> tuple[int | None, ...]:
    items = (value,) if value is None or isinstance(value, (int, np.integer)) else value
    try:
        return tuple(None if v is None else int(v) for v in items)
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


def resolved_slices(shape: Sequence[int], attrs: Any) -> list[tuple[int, int, int]]:
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


def _check_slice_attrs(ndim: int, attrs: Any) -> None:
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
def _strided_slice_shape(data: TensorType, attrs: Any) -> TensorType:
    _check_slice_attrs(data.ndim, attrs)
    return TensorType(tuple(length for _, _, length in resolved_slices(data.shape, attrs)), data.dtype)


def _slices(shape: Sequence[int], attrs: Any) -> tuple[slice, ...]:
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
        view = _slice_view(view, axis, start, length, step)
    kb.elementwise(out, [view], _copy)


strided_slice_backward = Operator(
    "strided_slice_backward",
    inputs=[Input("grad", doc="gradient of strided_slice's output")],
    attrs=[Attr("input_shape", convert=shape_tuple, doc="strided_slice's data.shape"), *_slice_attrs()],
    doc="Gradient of strided_slice: zeros of input_shape with grad written at the sliced positions.",
    jointly_linear=True,
)


@strided_slice_backward.shape_rule
def _strided_slice_backward_shape(grad: TensorType, attrs: Any) -> TensorType:
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
        view = _slice_view(view, axis, start, length, step)
    if view.size != out.size:
        kb.elementwise(out, [], lambda s, v: s.const(0.0))
    if view.size:
        kb.elementwise(view, [grad], _copy)


# ----- space_to_depth and depth_to_space -----


def _block_views(nchw_shape: Sequence[int], strides: Sequence[int], r: int, kind: str) -> tuple[tuple[int, ...],
                                                                                                   tuple[int, ...]]:
    """(shape, strides) of the 6-D (N, C, r, r, H, W) view that pairs the two layouts.

    ``kind="spatial"`` views an (N, C, H*r, W*r) tensor, ``kind="depth"`` an (N, C*r*r, H, W) one,
    both at element (n, c, i, j, h, w) = spatial[n, c, h*r + i, w*r + j] = depth[n, c*r*r + i*r + j, h, w].
    """
    s0, s1, s2, s3 = strides
    if kind == "spatial":
        n, c, hr, wr = nchw_shape
        return (n, c, r, r, hr // r, wr // r), (s0, s1, s2, s3, s2 * r, s3 * r)
    n, crr, h, w = nchw_shape
    return (n, crr // (r * r), r, r, h, w), (s0, s1 * r * r, s1 * r, s1, s2, s3)


def _block_move(kb: KernelBuilder, out: View, data: View, r: int, out_kind: str, data_kind: str) -> None:
    oshape, ostrides = _block_views(out.shape, out.strides, r, out_kind)
    dshape, dstrides = _block_views(data.shape, data.strides, r, data_kind)
    assert oshape == dshape, (oshape, dshape)
    kb.elementwise(replace(out, shape=oshape, strides=ostrides), [replace(data, shape=dshape, strides=dstrides)],
                   _copy)


space_to_depth = Operator(
    "space_to_depth",
    inputs=[Input("data", doc="NCHW, H and W multiples of block_size")],
    attrs=[Attr("block_size", convert=_positive, doc="r: each r x r block becomes r*r channels")],
    doc="(N, C, H*r, W*r) -> (N, C*r*r, H, W): out[n, c*r*r + i*r + j, h, w] = data[n, c, h*r + i, w*r + j] "
        "(torch.nn.functional.pixel_unshuffle).",
    jointly_linear=True,
)


@space_to_depth.shape_rule
def _space_to_depth_shape(data: TensorType, attrs: Any) -> TensorType:
    r = attrs["block_size"]
    require(data.ndim == 4, f"data must be 4-D NCHW, got shape {data.shape}")
    n, c, h, w = data.shape
    require(h % r == 0 and w % r == 0, f"H={h} and W={w} must be multiples of block_size={r}")
    return TensorType((n, c * r * r, h // r, w // r), data.dtype)


@space_to_depth.reference
def _space_to_depth_forward(data: np.ndarray, block_size: int) -> np.ndarray:
    n, c, h, w = data.shape
    r = block_size
    blocks = data.reshape(n, c, h // r, r, w // r, r).transpose(0, 1, 3, 5, 2, 4)
    return np.asarray(blocks.reshape(n, c * r * r, h // r, w // r))


@space_to_depth.gradient
def _space_to_depth_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = depth_to_space(grad, block_size): the inverse permutation"""
    return [ops.depth_to_space(grad, block_size=call.attrs["block_size"])]


def _swap_block_axes(x: Expr, r: int) -> Expr:
    """The channel order c*r*r + j*r + i instead of c*r*r + i*r + j (rows and columns of a block swapped)."""
    n, crr, h, w = x.shape
    six = ops.reshape(x, shape=(n, crr // (r * r), r, r, h, w))
    return ops.reshape(ops.transpose(six, axes=(0, 1, 3, 2, 4, 5)), shape=x.shape)


@space_to_depth.mutant("block rows and columns swapped in the channel order")
def _space_to_depth_swapped(call: Call, grad: Expr) -> list[Expr | None]:
    r = call.attrs["block_size"]
    return [ops.depth_to_space(_swap_block_axes(grad, r), block_size=r)]


def _block_case(d: CaseDraw, layout: str) -> Case:
    r = d.int(1, 3)
    n, c, h, w = d.int(1, 2), d.int(1, 3), d.int(1, 3), d.int(1, 3)
    shape = (n, c, h * r, w * r) if layout == "spatial" else (n, c * r * r, h, w)
    return Case([shape], {"block_size": r})


@space_to_depth.sampler
def _space_to_depth_cases(d: CaseDraw) -> Case:
    return _block_case(d, "spatial")


@space_to_depth.lowering
def _space_to_depth_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = data through the 6-D (N, C, r, r, H, W) view that regroups each block into channels"""
    _block_move(kb, out, data, call.attrs["block_size"], "depth", "spatial")


depth_to_space = Operator(
    "depth_to_space",
    inputs=[Input("data", doc="NCHW, C a multiple of block_size**2")],
    attrs=[Attr("block_size", convert=_positive, doc="r: each r*r channels become an r x r block")],
    doc="(N, C*r*r, H, W) -> (N, C, H*r, W*r): out[n, c, h*r + i, w*r + j] = data[n, c*r*r + i*r + j, h, w] "
        "(torch.nn.functional.pixel_shuffle).",
    jointly_linear=True,
)


@depth_to_space.shape_rule
def _depth_to_space_shape(data: TensorType, attrs: Any) -> TensorType:
    r = attrs["block_size"]
    require(data.ndim == 4, f"data must be 4-D NCHW, got shape {data.shape}")
    n, c, h, w = data.shape
    require(c % (r * r) == 0, f"C={c} must be a multiple of block_size**2={r * r}")
    return TensorType((n, c // (r * r), h * r, w * r), data.dtype)


@depth_to_space.reference
def _depth_to_space_forward(data: np.ndarray, block_size: int) -> np.ndarray:
    n, c, h, w = data.shape
    r = block_size
    blocks = data.reshape(n, c // (r * r), r, r, h, w).transpose(0, 1, 4, 2, 5, 3)
    return np.asarray(blocks.reshape(n, c // (r * r), h * r, w * r))


@depth_to_space.gradient
def _depth_to_space_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = space_to_depth(grad, block_size): the inverse permutation"""
    return [ops.space_to_depth(grad, block_size=call.attrs["block_size"])]


@depth_to_space.mutant("block rows and columns swapped in the channel order")
def _depth_to_space_swapped(call: Call, grad: Expr) -> list[Expr | None]:
    r = call.attrs["block_size"]
    return [_swap_block_axes(ops.space_to_depth(grad, block_size=r), r)]


@depth_to_space.sampler
def _depth_to_space_cases(d: CaseDraw) -> Case:
    return _block_case(d, "depth")


@depth_to_space.lowering
def _depth_to_space_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = data through the 6-D (N, C, r, r, H, W) view that spreads channels into blocks"""
    _block_move(kb, out, data, call.attrs["block_size"], "spatial", "depth")
