"""pad (numpy.pad, modes constant, reflect and edge) and pad_backward, its adjoint.

pad is linear in data and pad_backward sums each padded cell back onto the input cell it copies,
so each is the other's gradient. Kernels are copies through strided views (zero strides for edge
padding, negative ones for reflection).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from opgrad import ops
from opgrad.dtypes import TensorType
from opgrad.ir import Call, Expr
from opgrad.op import Attr, Attrs, Case, Input, Operator, require

from ._common import copy_element, slice_view

if TYPE_CHECKING:  # types only: the compiler and the checker sit above the registry
    from opgrad.checks.strategies import CaseDraw
    from opgrad.compiler.builder import KernelBuilder
    from opgrad.compiler.views import Body, Scalar, View


PAD_MODES = ("constant", "reflect", "edge")


def _pad_width(value: Any, types: Sequence[TensorType], _attrs: Any = None) -> tuple[tuple[int, int], ...]:
    ndim = types[0].ndim if types else 0
    if ndim == 0 and np.asarray(value).size <= 2:  # a scalar has no axis to pad (numpy.pad returns it)
        value = np.zeros((0, 2), np.int64)
    try:
        pairs = np.broadcast_to(np.asarray(value, dtype=np.int64), (ndim, 2))
    except (ValueError, TypeError):
        raise ValueError(f"expected an int, a (before, after) pair or {ndim} pairs (numpy.pad's forms)") from None
    given = np.asarray(value)
    flags = any(isinstance(v, (bool, np.bool_)) for v in np.asarray(value, dtype=object).ravel())
    if given.size and (flags or not np.issubdtype(given.dtype, np.integer)):
        raise ValueError("pad widths must be ints")  # as numpy.pad: a float width is refused, not truncated
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


pad = Operator(
    "pad",
    inputs=[Input("data")],
    attrs=_pad_attrs(with_value=True),
    doc="numpy.pad(data, pad_width, mode) for modes constant (filled with `value`), reflect (mirrored, "
        "edge not repeated) and edge (edge repeated).",
)


@pad.shape_rule
def _pad_shape(data: TensorType, attrs: Attrs) -> TensorType:
    if attrs["mode"] != "constant":
        for axis, (n, (b, a)) in enumerate(zip(data.shape, attrs["pad_width"])):
            require(n > 0 or b + a == 0,
                    f"mode {attrs['mode']!r} cannot pad axis {axis} of length 0 (nothing to copy from)")
    return TensorType(tuple(n + b + a for n, (b, a) in zip(data.shape, attrs["pad_width"])), data.dtype)


@pad.reference
def _pad_forward(data: np.ndarray, pad_width: Any, mode: str, value: float) -> np.ndarray:
    if data.ndim == 0:
        return np.array(data, copy=True)
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
        interior = slice_view(interior, axis, b, n, 1)
    if mode == "constant":
        if interior.shape != out.shape:
            kb.elementwise(out, [], lambda s, v: s.const(call.attrs["value"]))
        if data.size:
            kb.elementwise(interior, [data], copy_element)
        return
    # reflect / edge: one strided copy per block of runs (a run per border and one for the middle)
    per_axis = [_runs(source_index(n, b, a, mode)) for n, (b, a) in zip(data.shape, widths)]
    for block in itertools.product(*per_axis):
        target, source = out, data
        for axis, (p, length, first, step) in enumerate(block):
            target = slice_view(target, axis, p, length, 1)
            source = slice_view(source, axis, first, length, step)
        kb.elementwise(target, [source], copy_element)


def _unpadded_shape(grad: TensorType, attrs: Attrs) -> tuple[int, ...]:
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
def _pad_backward_shape(grad: TensorType, attrs: Attrs) -> TensorType:
    shape = _unpadded_shape(grad, attrs)
    # Edge and reflect copy from the axis they pad, which must hold an element; an unpadded axis may be empty.
    low = 0 if attrs["mode"] == "constant" else 1
    require(all(n >= low or widths == (0, 0) for n, widths in zip(shape, attrs["pad_width"])),
            f"grad of shape {grad.shape} is smaller than the pad widths {attrs['pad_width']} "
            f"(the padded input would have shape {shape})")
    return TensorType(shape, grad.dtype)


@pad_backward.reference
def _pad_backward_forward(grad: np.ndarray, pad_width: Any, mode: str) -> np.ndarray:
    out = grad
    for axis, (b, a) in enumerate(pad_width):
        n = out.shape[axis] - b - a
        src = np.array(source_index(n, b, a, mode), dtype=np.int64)
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
                kb.reduce(total, slice_view(current, axis, p, length, 1), (axis,), "sum")
                parts.append((first, 1, total))
            elif step >= 0:
                parts.append((first, length, slice_view(current, axis, p, length, 1)))
            else:  # reflected run: target first - k reads position p + k, so read it backwards
                parts.append((first - length + 1, length, slice_view(current, axis, p + length - 1, length, -1)))
        cuts = sorted({0, n, *(t for t, _, _ in parts), *(t + m for t, m, _ in parts)})
        for lo, hi in itertools.pairwise(cuts):
            views = [slice_view(v, axis, lo - t, hi - lo, 1) for t, m, v in parts if t <= lo and hi <= t + m]
            kb.elementwise(slice_view(target, axis, lo, hi - lo, 1), views, _sum_body(len(views)))
        current = target
    if not padded:
        kb.elementwise(out, [grad], copy_element)


def _sum_body(count: int) -> Body:
    def body(s: Scalar, v: list[str]) -> str:
        total = v[0] if count else s.const(0.0)
        for x in v[1:]:
            total = s.add(total, x)
        return total

    return body
