"""Spatial resizing of NCHW data: resize (to a size) with its adjoint resize_backward, and
upsampling (by an integer factor) as a composite of resize.

Semantics are ``torch.nn.functional.interpolate`` on 4-D input:

* ``method="nearest"`` is PyTorch's legacy ``mode="nearest"``: output index ``o`` reads input
  index ``min(floor(o * scale), n_in - 1)`` with ``scale = float32(n_in) / n_out`` computed in
  float32 as PyTorch does (``o`` itself when the sizes are equal, ``o >> 1`` when the output is
  exactly twice the input).
* ``method="bilinear"`` is ``mode="bilinear"``: with ``align_corners=False`` the source position
  is ``(o + 0.5) * n_in / n_out - 0.5`` clamped below at 0; with ``align_corners=True`` it is
  ``o * (n_in - 1) / (n_out - 1)`` (0 for a single output). The two taps are ``floor(src)``
  (at most ``n_in - 1``) and the next index (the same one at the last row), weighted
  ``1 - frac`` and ``frac``.

Both methods are linear in the data and separable: each axis is a *table* listing, for every
output index, its taps (source index, weight), computed once from the sizes and attributes (in
exact rational arithmetic, so the tables are exactly periodic). The reference applies the height
table, then the width table; a tap of weight exactly 0 is not read and two taps on one index are
one tap of weight 1, so a NaN or inf in the input reaches exactly the outputs that sample it.
``resize_backward`` applies the transposed tables (a scatter-add), and each op is the other's
gradient.

Kernels read each tap through a strided view: output indices with the same weights and evenly
spaced sources (one phase of the sizes' ratio) form one loop with the weights folded in as
constants, so an integer upsampling by ``s`` costs ``s`` loops per axis. Ratios with many phases
(say 7 -> 1000) instead reduce over the source axis against the table baked as a constant
buffer, selecting only the taps, at O(n_in) per output element; so does the gradient of a
strong downsampling, whose inputs each collect many outputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from fractions import Fraction
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

from opgrad import ops
from opgrad.dtypes import TensorType
from opgrad.ir import Call, Expr
from opgrad.op import Attr, Attrs, Case, Input, Operator, composite, require, whole

from ._common import slice_view

if TYPE_CHECKING:  # types only: the compiler and the checker sit above the registry
    from opgrad.checks.strategies import CaseDraw
    from opgrad.compiler.builder import KernelBuilder
    from opgrad.compiler.views import Body, Scalar, View

METHODS = ("nearest", "bilinear")
#: Loops per axis, and taps per output, above which a kernel reduces against a constant table instead.
MAX_PHASE_LOOPS = 24
MAX_LOOP_TAPS = 8

Taps = tuple[tuple[int, float], ...]
Table = tuple[Taps, ...]


# ----- tables -----


def _nearest_index(o: int, n_in: int, n_out: int) -> int:
    if n_out == n_in:
        return o
    if n_out == 2 * n_in:
        return o >> 1
    scale = np.float32(n_in) / np.float32(n_out)
    return min(int(np.floor(np.float32(o) * scale)), n_in - 1)


def _bilinear_taps(o: int, n_in: int, n_out: int, align_corners: bool) -> Taps:
    if n_out == n_in:
        return ((o, 1.0),)
    if align_corners:
        src = Fraction(n_in - 1, n_out - 1) * o if n_out > 1 else Fraction(0)
    else:
        src = max(Fraction(n_in, n_out) * (Fraction(o) + Fraction(1, 2)) - Fraction(1, 2), Fraction(0))
    i0 = min(math.floor(src), n_in - 1)
    frac = min(max(src - i0, Fraction(0)), Fraction(1))
    i1 = i0 + 1 if i0 < n_in - 1 else i0
    if i1 == i0:
        return ((i0, 1.0),)
    return tuple((i, float(w)) for i, w in ((i0, 1 - frac), (i1, frac)) if w != 0)


@lru_cache(maxsize=256)
def axis_table(n_in: int, n_out: int, method: str, align_corners: bool) -> Table:
    """For each output index along one axis, its taps ``(input index, weight)`` in index order."""
    if method == "nearest":
        return tuple(((_nearest_index(o, n_in, n_out), 1.0),) for o in range(n_out))
    return tuple(_bilinear_taps(o, n_in, n_out, align_corners) for o in range(n_out))


@lru_cache(maxsize=256)
def transposed(table: Table, n_in: int) -> Table:
    """The adjoint table: for each input index, the outputs that read it and their weights."""
    rows: list[list[tuple[int, float]]] = [[] for _ in range(n_in)]
    for o, taps in enumerate(table):
        for i, w in taps:
            rows[i].append((o, w))
    return tuple(tuple(r) for r in rows)


def _is_identity(table: Table, n_in: int) -> bool:
    return len(table) == n_in and all(taps == ((o, 1.0),) for o, taps in enumerate(table))


def apply_table(x: np.ndarray, axis: int, table: Table) -> np.ndarray:
    """out[..., o, ...] = sum over the taps (i, w) of table[o] of w * x[..., i, ...] (numpy)."""
    width = max((len(t) for t in table), default=0)
    shape = list(x.shape)
    shape[axis] = len(table)
    out = np.zeros(shape, dtype=x.dtype)
    if x.shape[axis] == 0 or width == 0:
        return out
    for k in range(width):
        valid = np.array([len(t) > k for t in table])
        index = np.array([t[k][0] if len(t) > k else 0 for t in table], dtype=np.int64)
        weight = np.array([t[k][1] if len(t) > k else 0.0 for t in table]).astype(x.dtype)
        where = [1] * x.ndim
        where[axis] = len(table)
        term = np.where(valid.reshape(where), np.take(x, index, axis=axis) * weight.reshape(where),
                        np.zeros((), x.dtype))
        out = term if k == 0 else out + term
    return out.astype(x.dtype, copy=False)


# ----- kernels -----


def _phase_steps(n_in: int, n_out: int) -> list[int]:
    """Candidate spacings of output indices that share their weights: 1 and the periods of the
    sizes' ratios (the tables repeat with a period of n_out / gcd(n_in, n_out) outputs, or of the
    (n - 1) ratio with align_corners)."""
    steps = {1}
    for a, b in ((n_in, n_out), (n_in - 1, n_out - 1)):
        if a > 0 and b > 0:
            f = Fraction(a, b)
            steps.update((f.numerator, f.denominator))
    return sorted(steps)


def phase_groups(table: Table, steps: Sequence[int]) -> list[tuple[int, int, int, list[tuple[int, int]], list[float]]]:
    """Targets split into loops ``(first, step, count, [(first source, source step) per tap], weights)``:
    every target of a loop has the same weights and each tap's source moves by a fixed step."""
    n = len(table)
    done = [False] * n
    groups = []

    def extend(r: int, d: int) -> tuple[list[int], list[int]]:
        taps = table[r]
        members = [r]
        deltas: list[int] = []
        k = r + d
        while k < n and not done[k] and len(table[k]) == len(taps):
            if any(w2 != w for (_, w), (_, w2) in zip(taps, table[k])):
                break
            step = [s2 - s1 for (s1, _), (s2, _) in zip(table[members[-1]], table[k])]
            if deltas and step != deltas:
                break
            deltas = step
            members.append(k)
            k += d
        return members, deltas or [0] * len(taps)

    for r in range(n):
        if done[r]:
            continue
        best, best_step, best_deltas = [r], 1, [0] * len(table[r])
        for d in steps:
            members, deltas = extend(r, d)
            if len(members) > len(best):
                best, best_step, best_deltas = members, d, deltas
        for k in best:
            done[k] = True
        groups.append((r, best_step, len(best), [(s, dd) for (s, _), dd in zip(table[r], best_deltas)],
                       [w for _, w in table[r]]))
    return groups


def _weighted_sum(weights: Sequence[float]) -> Body:
    def body(s: Scalar, v: list[str]) -> str:
        terms = [x if w == 1.0 else s.mul(s.const(w), x) for w, x in zip(weights, v)]
        total = terms[0] if terms else s.const(0.0)
        for t in terms[1:]:
            total = s.add(total, t)
        return total

    return body


def lower_table(kb: KernelBuilder, out: View, inp: View, axis: int, table: Table, steps: Sequence[int]) -> None:
    """out = inp with ``table`` applied along ``axis`` (the numpy form is :func:`apply_table`)."""
    groups = phase_groups(table, steps) if max(map(len, table), default=0) <= MAX_LOOP_TAPS else []
    if groups and len(groups) <= MAX_PHASE_LOOPS:
        for first, step, count, taps, weights in groups:
            target = slice_view(out, axis, first, count, step)
            views = [slice_view(inp, axis, src, count, delta) for src, delta in taps]
            kb.elementwise(target, views, _weighted_sum(weights))
        return
    n_out, n_in = len(table), inp.shape[axis]
    dense = np.zeros((n_out, n_in), dtype=out.dtype)
    for o, row in enumerate(table):
        for i, w in row:
            dense[o, i] = w
    matrix = kb.constant(dense)
    full = (*out.shape, n_in)
    rank = out.ndim
    data = replace(inp, shape=full, strides=tuple(0 if a == axis else s for a, s in enumerate(inp.strides))
                   + (inp.strides[axis],))
    rows = replace(matrix, shape=full, strides=tuple(n_in if a == axis else 0 for a in range(rank)) + (1,))
    kb.map_reduce(out, [data, rows], (rank,), "sum",
                  body=lambda s, v: s.select(s.cmp("one", v[1], s.const(0.0)), s.mul(v[1], v[0]), s.const(0.0)))


def _lower_separable(kb: KernelBuilder, out: View, data: View, tables: Sequence[tuple[Table, int, list[int]]]) -> None:
    """Apply the (height, width) tables in turn; identity tables are skipped."""
    todo = [(axis, table, steps) for axis, (table, n_in, steps) in zip((2, 3), tables)
            if not _is_identity(table, n_in)]
    if not todo:
        kb.elementwise(out, [data], lambda s, v: v[0])
        return
    current = data
    for k, (axis, table, steps) in enumerate(todo):
        shape = tuple(len(table) if a == axis else n for a, n in enumerate(current.shape))
        target = out if k == len(todo) - 1 else kb.temporary(shape, out.dtype)
        lower_table(kb, target, current, axis, table, steps)
        current = target


# ----- attributes -----


def _method(value: Any) -> str:
    if value not in METHODS:
        raise ValueError(f"expected one of {', '.join(METHODS)}")
    return str(value)


def _size(value: Any) -> tuple[int, int]:
    items = (value, value) if isinstance(value, (int, np.integer)) and not isinstance(value, bool) else value
    try:
        size = tuple(whole(v) for v in items)
    except TypeError:
        raise ValueError("expected an int or an (out_height, out_width) pair") from None
    if len(size) != 2 or any(v < 1 for v in size) or any(isinstance(v, bool) for v in items):
        raise ValueError("expected an int or an (out_height, out_width) pair of positive ints")
    return size[0], size[1]


def _align(value: Any, _types: Any, attrs: dict[str, Any]) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError("expected True or False")
    if value and attrs["method"] == "nearest":
        raise ValueError("align_corners applies to method 'bilinear' only (as in torch interpolate)")
    return bool(value)


def _resize_attrs(size_name: str, size_doc: str) -> list[Attr]:
    return [
        Attr(size_name, convert=_size, doc=size_doc),
        Attr("method", default="nearest", convert=_method, doc="nearest (PyTorch's legacy 'nearest') or bilinear"),
        Attr("align_corners", default=False, convert=_align, uses_types=True,
             doc="bilinear only: corner pixels' centres map onto each other (torch's align_corners)"),
    ]


def _tables(n_in: Sequence[int], n_out: Sequence[int], method: str, align: bool) -> list[Table]:
    return [axis_table(n_in[k], n_out[k], method, align) for k in range(2)]


def _check_nchw(t: TensorType, what: str) -> None:
    require(t.ndim == 4, f"{what} must be 4-D NCHW, got shape {t.shape}")
    require(t.shape[2] >= 1 and t.shape[3] >= 1, f"{what} has an empty {t.shape[2]}x{t.shape[3]} plane; there "
                                                 "is nothing to interpolate from")


# ----- resize -----

resize = Operator(
    "resize",
    inputs=[Input("data", doc="NCHW")],
    attrs=_resize_attrs("size", "(out_height, out_width), or one int for both"),
    doc="(N, C, H, W) -> (N, C, *size) by nearest or bilinear interpolation: "
        "torch.nn.functional.interpolate(data, size, mode=method, align_corners=...) (legacy 'nearest').",
    jointly_linear=True,
)


@resize.shape_rule
def _resize_shape(data: TensorType, attrs: Attrs) -> TensorType:
    _check_nchw(data, "data")
    return TensorType((data.shape[0], data.shape[1], *attrs["size"]), data.dtype)


@resize.reference
def _resize_forward(data: np.ndarray, size: tuple[int, int], method: str, align_corners: bool) -> np.ndarray:
    th, tw = _tables(data.shape[2:], size, method, align_corners)
    return apply_table(apply_table(data, 2, th), 3, tw)


@resize.gradient
def _resize_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = resize_backward(grad): each output's cotangent added back to its taps, times their weights"""
    data = call.args[0]
    return [ops.resize_backward(grad, input_size=data.shape[2:], method=call.attrs["method"],
                                align_corners=call.attrs["align_corners"])]


@resize.mutant("bilinear gradient scattered with nearest's taps")
def _resize_nearest_taps(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.resize_backward(grad, input_size=call.args[0].shape[2:], method="nearest")]


@resize.mutant("gradient taps placed with the other align_corners convention")
def _resize_flipped_corners(call: Call, grad: Expr) -> list[Expr | None]:
    method, align = call.attrs["method"], call.attrs["align_corners"]
    return [ops.resize_backward(grad, input_size=call.args[0].shape[2:], method=method,
                                align_corners=(not align) if method == "bilinear" else False)]


def _resize_case(d: CaseDraw, backward: bool) -> Case:
    n, c = d.int(1, 2), d.int(1, 2)
    h, w = d.size(1, 5), d.size(1, 5)
    oh, ow = d.size(1, 7), d.size(1, 7)
    method = d.choice(METHODS)
    align = method == "bilinear" and d.bool()
    attrs = {"method": method, "align_corners": align}
    if backward:
        return Case([(n, c, oh, ow)], {"input_size": (h, w), **attrs})
    return Case([(n, c, h, w)], {"size": (oh, ow), **attrs})


@resize.sampler
def _resize_cases(d: CaseDraw) -> Case:
    return _resize_case(d, backward=False)


@resize.lowering
def _resize_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = the height table, then the width table, applied tap by tap (weights folded in per phase)"""
    n_in, n_out = data.shape[2:], out.shape[2:]
    tables = _tables(n_in, n_out, call.attrs["method"], call.attrs["align_corners"])
    _lower_separable(kb, out, data, [(t, n_in[k], _phase_steps(n_in[k], n_out[k])) for k, t in enumerate(tables)])


# ----- resize_backward -----

resize_backward = Operator(
    "resize_backward",
    inputs=[Input("grad", doc="NCHW, shaped like resize's output")],
    attrs=_resize_attrs("input_size", "resize's (in_height, in_width)"),
    doc="Gradient of resize: zeros of shape (N, C, *input_size) with each grad element added to the "
        "taps its output read, times their weights (the transpose of resize's interpolation).",
    jointly_linear=True,
)


@resize_backward.shape_rule
def _resize_backward_shape(grad: TensorType, attrs: Attrs) -> TensorType:
    _check_nchw(grad, "grad")
    return TensorType((grad.shape[0], grad.shape[1], *attrs["input_size"]), grad.dtype)


@resize_backward.reference
def _resize_backward_forward(grad: np.ndarray, input_size: tuple[int, int], method: str,
                             align_corners: bool) -> np.ndarray:
    th, tw = _tables(input_size, grad.shape[2:], method, align_corners)
    return apply_table(apply_table(grad, 2, transposed(th, input_size[0])), 3, transposed(tw, input_size[1]))


@resize_backward.gradient
def _resize_backward_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_grad = resize(c, size=grad's H, W): the adjoint of the scatter is the interpolation"""
    return [ops.resize(grad, size=call.args[0].shape[2:], method=call.attrs["method"],
                       align_corners=call.attrs["align_corners"])]


@resize_backward.mutant("interpolates with nearest's taps")
def _resize_backward_nearest(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.resize(grad, size=call.args[0].shape[2:], method="nearest")]


@resize_backward.sampler
def _resize_backward_cases(d: CaseDraw) -> Case:
    return _resize_case(d, backward=True)


@resize_backward.lowering
def _resize_backward_lowering(kb: KernelBuilder, call: Call, out: View, grad: View) -> None:
    """out = the transposed height table, then the transposed width table (each input row sums its readers)"""
    n_in, n_out = out.shape[2:], grad.shape[2:]
    tables = _tables(n_in, n_out, call.attrs["method"], call.attrs["align_corners"])
    _lower_separable(kb, out, grad, [(transposed(t, n_in[k]), n_out[k], _phase_steps(n_in[k], n_out[k]))
                                     for k, t in enumerate(tables)])


# ----- upsampling -----


@composite("resize")
def upsampling(data: Expr, scale: int, method: str = "nearest") -> Expr:
    """data (N, C, H, W) enlarged to (N, C, H*scale, W*scale): resize to that size, which is
    torch.nn.functional.interpolate(data, scale_factor=scale, mode=method) (align_corners=False)
    for an integer scale, and NNVM's upsampling(scale, method)."""
    if not isinstance(data, Expr):
        raise TypeError(f"opgrad.ops.upsampling: data must be an opgrad expression, got {type(data).__name__}")
    if isinstance(scale, bool) or not isinstance(scale, (int, np.integer)) or scale < 1:
        raise ValueError(f"opgrad.ops.upsampling: scale={scale!r} must be a positive int (for other factors, "
                         "resize to the size you want)")
    if data.ndim != 4:
        raise ValueError(f"opgrad.ops.upsampling: data must be 4-D NCHW, got shape {data.shape}")
    return ops.resize(data, size=(data.shape[2] * int(scale), data.shape[3] * int(scale)), method=method)
