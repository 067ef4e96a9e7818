"""Reductions over axes with keepdims, like ``sum``: mean, max, min, prod, logsumexp, and the
index reductions argmax, argmin.

Semantics are numpy's (``np.mean``, ``np.amax``, ``np.prod``, ``np.argmax``, and
``scipy.special.logsumexp``); they agree with PyTorch's ``mean``, ``amax``, ``prod``,
``logsumexp`` and ``argmax``. max/min propagate NaN; their gradient splits evenly among tied
maxima, as PyTorch's ``amax`` (declared as a ``Kink``). argmax/argmin return int64 indices,
the first occurrence on ties and the first NaN if there is one (numpy's rule), and are not
differentiable.

prod and the index reductions need a loop the builder's sum/max/min reductions cannot express
(a product; an index carried beside the best value), so ``_fold`` below emits it through the
builder's extension points (``loop_function``, ``add_parallel``).
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from opgrad import ops
from opgrad.dtypes import TensorType
from opgrad.ir import Call, Expr
from opgrad.op import Attr, Attrs, Case, Input, Interval, Kink, KinkDistance, KinkPlacer, Operator, Subgradient, require

from ._common import LOGITS, axes_attr, bool_attr, dense_reshape

if TYPE_CHECKING:  # types only: the compiler and the checker sit above the registry
    from opgrad.checks.strategies import CaseDraw
    from opgrad.compiler.builder import KernelBuilder
    from opgrad.compiler.views import Scalar, View


def _reduce_attrs() -> list[Attr]:
    return [
        Attr("axis", default=None, convert=axes_attr, uses_types=True, doc="int, tuple of ints, or None for all axes"),
        Attr("keepdims", default=False, convert=bool_attr, doc="keep reduced axes as size 1"),
    ]


def _reduced_shape(shape: Sequence[int], axes: Sequence[int], keepdims: bool) -> tuple[int, ...]:
    if keepdims:
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def _reduce_shape(data: TensorType, attrs: Attrs) -> TensorType:
    return TensorType(_reduced_shape(data.shape, attrs["axis"], attrs["keepdims"]), data.dtype)


def _nonempty_reduce_shape(data: TensorType, attrs: Attrs) -> TensorType:
    reduced = [data.shape[a] for a in attrs["axis"]]
    require(all(d > 0 for d in reduced), f"cannot reduce a zero-size axis of shape {data.shape} "
            f"(axis={attrs['axis']}): the result has no identity element")
    return _reduce_shape(data, attrs)


def _kept(call: Call) -> tuple[int, ...]:
    """The output's shape with the reduced axes kept as 1: gradients broadcast from it."""
    return _reduced_shape(call.args[0].shape, call.attrs["axis"], True)


def _reduce_cases(d: CaseDraw) -> Case:
    shape = d.shape(min_rank=1, max_rank=4)
    axes = d.subset([a - len(shape) if d.bool() else a for a in range(len(shape))])  # some negative
    axis = (axes[0] if len(axes) == 1 and d.bool() else axes) if d.int(0, 3) else None
    return Case([shape], {"axis": axis, "keepdims": d.bool()})


def _rows(data: np.ndarray, axes: Sequence[int]) -> np.ndarray:
    """(kept elements, reduced elements): each row is one reduced slice."""
    n = int(np.prod([data.shape[a] for a in axes], dtype=np.int64))
    moved = np.moveaxis(data, list(axes), list(range(data.ndim - len(axes), data.ndim)))
    return moved.reshape(-1, n)


def _unrows(rows: np.ndarray, like: np.ndarray, axes: Sequence[int]) -> np.ndarray:
    moved_shape = [d for i, d in enumerate(like.shape) if i not in axes] + [like.shape[a] for a in axes]
    moved = rows.reshape(moved_shape)
    return np.moveaxis(moved, list(range(like.ndim - len(axes), like.ndim)), list(axes))


# ----- mean -----

mean = Operator(
    "mean",
    inputs=[Input("data")],
    attrs=_reduce_attrs(),
    doc="Mean of data over `axis` (np.mean, torch.mean).",
    jointly_linear=True,
)
mean.shape_rule(_nonempty_reduce_shape)


@mean.reference
def _mean_forward(data: np.ndarray, axis: tuple[int, ...], keepdims: bool) -> np.ndarray:
    return np.asarray(np.mean(data, axis=axis, keepdims=keepdims), dtype=data.dtype)


@mean.gradient
def _mean_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = broadcast_to(reshape(grad, kept dims), data.shape) / (elements per reduced slice)"""
    data = call.args[0]
    # Elements per slice from the reduced axes: the sizes' ratio is 0 where the output is empty.
    count = math.prod(data.shape[a] for a in call.attrs["axis"])
    spread = ops.broadcast_to(ops.reshape(grad, shape=_kept(call)), shape=data.shape)
    return [ops.multiply(spread, 1.0 / builtins.max(count, 1))]  # no elements, no gradient to scale


@mean.mutant("sum's gradient: forgets to divide by the count")
def _mean_as_sum(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.broadcast_to(ops.reshape(grad, shape=_kept(call)), shape=call.args[0].shape)]


mean.sampler(_reduce_cases)


@mean.lowering
def _mean_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = sum(data, axis) / count"""
    count = math.prod(data.shape[a] for a in call.attrs["axis"])
    kb.reduce(out, data, call.attrs["axis"], "sum", scale=1.0 / count)


# ----- max / min -----


def _extreme_rows(data: np.ndarray, axes: Sequence[int], larger: bool) -> np.ndarray:
    rows = _rows(data, axes)
    return np.asarray(rows.max(axis=1, keepdims=True) if larger else rows.min(axis=1, keepdims=True))


def _gap_distance(larger: bool) -> KinkDistance:
    def distance(inputs: Sequence[np.ndarray], attrs: Attrs) -> float:
        rows = np.sort(_rows(inputs[0], attrs["axis"]), axis=1)
        if rows.shape[1] < 2 or rows.size == 0:
            return float("inf")
        gaps = rows[:, -1] - rows[:, -2] if larger else rows[:, 1] - rows[:, 0]
        return float(np.min(gaps))

    return distance


def _place_ties(larger: bool) -> KinkPlacer:
    def place(rng: np.random.Generator, inputs: list[np.ndarray], attrs: Attrs) -> list[np.ndarray]:
        data, axes = inputs[0], attrs["axis"]
        rows = _rows(data, axes).copy()
        best = np.argmax(rows, axis=1) if larger else np.argmin(rows, axis=1)
        for r in range(rows.shape[0]):
            if rows.shape[1] < 2 or rng.random() < 0.3:
                continue
            for j in rng.choice(rows.shape[1], rng.integers(1, rows.shape[1]), replace=False):
                rows[r, j] = rows[r, best[r]]
        return [np.ascontiguousarray(_unrows(rows, data, axes))]

    return place


def _split_subgradient(larger: bool) -> Subgradient:
    def subgradient(inputs: Sequence[np.ndarray], cotangent: np.ndarray, attrs: Attrs) -> list[np.ndarray | None]:
        data, axes = inputs[0], attrs["axis"]
        rows = _rows(data, axes)
        ties = rows == _extreme_rows(data, axes, larger)
        share = ties / ties.sum(axis=1, keepdims=True)
        kept = np.reshape(cotangent, (-1, 1))
        return [_unrows(share * kept, data, axes)]

    return subgradient


def _extreme_gradient(call: Call, grad: Expr, larger: bool) -> list[Expr | None]:
    """d_data = grad * tie / (number of ties), tie = (data == the slice's max), grad broadcast from
    kept dims; NaN over a slice whose max is NaN, as PyTorch's amax/amin give. Over no axes the
    op is the identity: d_data = grad, NaN and infinities included."""
    data = call.args[0]
    if not call.attrs["axis"]:
        return [ops.reshape(grad, shape=data.shape)]
    kept = _kept(call)
    top = ops.reshape(call, shape=kept)
    beaten = ops.greater(top, data) if larger else ops.greater(data, top)
    # A NaN max beats nothing, so every element would tie: 0 * clip(top) adds NaN there, and +0
    # (a clipped infinity stays finite) everywhere else.
    nan_where_nan = ops.multiply(ops.clip(top, lo=-1.0, hi=1.0), 0.0)
    tie = ops.add(ops.subtract(1.0, beaten), nan_where_nan)
    count = ops.sum(tie, axis=call.attrs["axis"], keepdims=True)
    return [ops.multiply(tie, ops.divide(ops.reshape(grad, shape=kept), count))]


def _extreme_kink(larger: bool, name: str) -> Kink:
    return Kink(
        convention=f"ties for the {name} of a slice share its gradient evenly, as PyTorch's a{name}",
        distance=_gap_distance(larger),
        place=_place_ties(larger),
        subgradient=_split_subgradient(larger),
    )


max = Operator(  # shadows the builtin on purpose: the op is called max, as in numpy
    "max",
    inputs=[Input("data")],
    attrs=_reduce_attrs(),
    doc="Largest element over `axis` (np.amax, torch.amax); NaN if the slice has a NaN.",
    kinks=_extreme_kink(True, "max"),
)
max.shape_rule(_nonempty_reduce_shape)


@max.reference
def _max_forward(data: np.ndarray, axis: tuple[int, ...], keepdims: bool) -> np.ndarray:
    return np.asarray(np.amax(data, axis=axis, keepdims=keepdims), dtype=data.dtype)


@max.gradient
def _max_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = grad * (data == max) / count(data == max), grad broadcast from the kept dims"""
    return _extreme_gradient(call, grad, larger=True)


@max.mutant("every tied maximum gets the whole gradient (no split)")
def _max_no_split(call: Call, grad: Expr) -> list[Expr | None]:
    kept = _kept(call)
    tie = ops.subtract(1.0, ops.greater(ops.reshape(call, shape=kept), call.args[0]))
    return [ops.multiply(tie, ops.reshape(grad, shape=kept))]


@max.mutant("min's mask: the gradient goes to the smallest element")
def _max_as_min(call: Call, grad: Expr) -> list[Expr | None]:
    data = call.args[0]
    lowest = ops.reshape(ops.min(data, axis=call.attrs["axis"]), shape=_kept(call))
    tie = ops.subtract(1.0, ops.greater(data, lowest))
    count = ops.sum(tie, axis=call.attrs["axis"], keepdims=True)
    return [ops.multiply(tie, ops.divide(ops.reshape(grad, shape=_kept(call)), count))]


max.sampler(_reduce_cases)


@max.lowering
def _max_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = max(data, axis), NaN-propagating"""
    kb.reduce(out, data, call.attrs["axis"], "max")


min = Operator(  # shadows the builtin on purpose: the op is called min, as in numpy
    "min",
    inputs=[Input("data")],
    attrs=_reduce_attrs(),
    doc="Smallest element over `axis` (np.amin, torch.amin); NaN if the slice has a NaN.",
    kinks=_extreme_kink(False, "min"),
)
min.shape_rule(_nonempty_reduce_shape)


@min.reference
def _min_forward(data: np.ndarray, axis: tuple[int, ...], keepdims: bool) -> np.ndarray:
    return np.asarray(np.amin(data, axis=axis, keepdims=keepdims), dtype=data.dtype)


@min.gradient
def _min_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = grad * (data == min) / count(data == min), grad broadcast from the kept dims"""
    return _extreme_gradient(call, grad, larger=False)


@min.mutant("all the gradient to every element (sum's rule)")
def _min_as_sum(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.broadcast_to(ops.reshape(grad, shape=_kept(call)), shape=call.args[0].shape)]


min.sampler(_reduce_cases)


@min.lowering
def _min_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = min(data, axis), NaN-propagating"""
    kb.reduce(out, data, call.attrs["axis"], "min")


# ----- prod -----

prod = Operator(
    "prod",
    # Exact zeros are drawn on purpose (one or several in a slice): the gradient's own derivatives
    # must hold there too, which a p / data form with zero masks does not give.
    inputs=[Input("data", domain=(Interval(-2.0, 2.0), Interval(0.0, 0.0)))],
    attrs=_reduce_attrs(),
    doc="Product of data over `axis` (np.prod, torch.prod); 1 over an empty axis.",
)
prod.shape_rule(_reduce_shape)


@prod.reference
def _prod_forward(data: np.ndarray, axis: tuple[int, ...], keepdims: bool) -> np.ndarray:
    return np.asarray(np.prod(data, axis=axis, keepdims=keepdims), dtype=data.dtype)


def _shifted(rows: Expr, step: int) -> Expr:
    """rows[:, j - step] along the last axis, 1 where j < step (the empty product)."""
    m, n = rows.shape
    if step >= n:
        return ops.ones_like(rows)
    kept = ops.strided_slice(rows, begin=(0, 0), end=(m, n - step))
    return ops.pad(kept, pad_width=((0, 0), (step, 0)), value=1.0)


def _exclusive_prefix_products(rows: Expr) -> Expr:
    """out[:, j] = product of rows[:, :j]: an inclusive scan by doubling shifts (log2(n) multiplies),
    then shifted by one."""
    scan, step = rows, 1
    while step < rows.shape[1]:
        scan = ops.multiply(scan, _shifted(scan, step))
        step *= 2
    return _shifted(scan, 1)


def product_of_others(data: Expr, axes: Sequence[int]) -> Expr:
    """For each element, the product of the other elements of its slice over ``axes``.

    The exclusive prefix product times the exclusive suffix product: a polynomial in ``data``
    built from multiplies, pads and slices, so autodiff's derivatives of it are exact at zeros
    (one zero in a slice or several), where ``p / data`` divides by zero.
    """
    kept_axes = [a for a in range(data.ndim) if a not in axes]
    order = (*kept_axes, *axes)
    moved = ops.transpose(data, axes=order)
    m = math.prod(data.shape[a] for a in kept_axes)
    n = math.prod(data.shape[a] for a in axes)
    rows = ops.reshape(moved, shape=(m, n))
    if m == 0 or n == 0:
        return ops.ones_like(data)
    before = _exclusive_prefix_products(rows)
    after = ops.flip(_exclusive_prefix_products(ops.flip(rows, axis=1)), axis=1)
    others = ops.reshape(ops.multiply(before, after), shape=moved.shape)
    return ops.transpose(others, axes=tuple(int(i) for i in np.argsort(order)))


@prod.gradient
def _prod_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = grad * (product of the slice's other elements) = grad * prefix * suffix, with
    prefix and suffix the exclusive cumulative products from either side of the slice"""
    return [ops.multiply(ops.reshape(grad, shape=_kept(call)), product_of_others(call.args[0], call.attrs["axis"]))]


@prod.mutant("p / data with zero masks: first order exact at zeros, second order not (the masks are constants)")
def _prod_masked_quotient(call: Call, grad: Expr) -> list[Expr | None]:
    data = call.args[0]
    axes = call.attrs["axis"]
    zeros = ops.zeros_like(data)
    is_zero = ops.subtract(1.0, ops.add(ops.greater(data, zeros), ops.greater(zeros, data)))
    nonzero = ops.add(data, is_zero)  # exact zeros become ones
    partial = ops.prod(nonzero, axis=axes, keepdims=True)
    count = ops.sum(is_zero, axis=axes, keepdims=True)
    no_zero = ops.subtract(1.0, ops.greater(count, 0.5))
    one_zero = ops.subtract(ops.greater(count, 0.5), ops.greater(count, 1.5))
    others = ops.multiply(partial, ops.add(ops.divide(no_zero, nonzero), ops.multiply(is_zero, one_zero)))
    return [ops.multiply(ops.reshape(grad, shape=_kept(call)), others)]


@prod.mutant("the product itself instead of the product of the others")
def _prod_whole(call: Call, grad: Expr) -> list[Expr | None]:
    kept = _kept(call)
    return [ops.multiply(ops.reshape(grad, shape=kept), ops.reshape(call, shape=kept))]


@prod.mutant("sum's gradient: cotangent spread unscaled")
def _prod_as_sum(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.broadcast_to(ops.reshape(grad, shape=_kept(call)), shape=call.args[0].shape)]


prod.sampler(_reduce_cases)


def _fold(kb: KernelBuilder, out: View, data: View, axes: Sequence[int], kind: str) -> None:
    """One loop per output element over the reduced axes in row-major order.

    ``kind`` ``prod``: out = product; ``argmax``/``argmin``: out = the row-major index, within the
    reduced axes, of the first largest/smallest element, or of the first NaN (numpy's rule).
    Split over threads by the first kept axis; no thread splits a slice.
    """
    from opgrad.compiler.irtext import LLVM_TYPE
    from opgrad.compiler.views import Scalar

    if out.size == 0:
        return
    if not data.is_memory:
        data = kb.contiguous(data)
    shape = data.shape
    kept = [d for d in range(len(shape)) if d not in axes]
    kshape = [shape[d] for d in kept] or [1]
    kstrides = [data.strides[d] for d in kept] or [0]
    ostrides = [math.prod(kshape[i + 1:]) for i in range(len(kshape))]
    name = kb.fresh(kind)
    f = kb.loop_function(name, 2)
    t = LLVM_TYPE[data.dtype]
    s = Scalar(f, data.dtype)
    src = f.gep(t, "%p0", str(data.offset))
    out_t = t if kind == "prod" else "i64"
    dst = f.gep(out_t, "%p1", str(out.offset))
    acc = f.alloca(t, "acc")
    index = f.alloca("i64", "best")
    counter = f.alloca("i64", "k")
    beats = "ogt" if kind == "argmax" else "olt"

    def inner(level: int, off: str) -> None:
        if level == len(axes):
            value = f.load(t, f.gep(t, src, off))
            if kind == "prod":
                f.store(t, s.mul(f.load(t, acc), value), acc)
                return
            best, k = f.load(t, acc), f.load("i64", counter)
            first_nan = f.val(f"and i1 {s.cmp('uno', value, value)}, {s.cmp('ord', best, best)}", "nan")
            take = f.val(f"or i1 {s.cmp(beats, value, best)}, {first_nan}", "take")
            f.store(t, s.select(take, value, best), acc)
            f.store("i64", f.select(take, "i64", k, f.load("i64", index)), index)
            f.store("i64", f.add(k, 1), counter)
            return
        axis = axes[level]
        with f.loop(0, shape[axis], hint=f"r{level}") as i:
            inner(level + 1, f.add(off, f.mul(i, data.strides[axis])))

    def outer(level: int, off: str, out_off: str) -> None:
        if level == len(kshape):
            if kind == "prod":
                f.store(t, s.const(1.0), acc)
            else:
                f.store(t, f.load(t, f.gep(t, src, off)), acc)
                f.store("i64", "0", index)
                f.store("i64", "0", counter)
            inner(0, off)
            result = f.load(t, acc) if kind == "prod" else f.load("i64", index)
            f.store(out_t, result, f.gep(out_t, dst, out_off))
            return
        lo, hi = ("%lo", "%hi") if level == 0 else ("0", str(kshape[level]))
        with f.loop(lo, hi, hint=f"o{level}") as i:
            outer(level + 1, f.add(off, f.mul(i, kstrides[level])), f.add(out_off, f.mul(i, ostrides[level])))

    outer(0, "0", "0")
    f.ret_void()
    f.finish()
    kb.add_parallel(name, [data.buffer, out.buffer], kshape[0], builtins.max(data.size, 1),
                    reads=[data.buffer], writes=[out.buffer])


@prod.lowering
def _prod_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = product of data over axis (a loop per output element)"""
    _fold(kb, out, data, call.attrs["axis"], "prod")


# ----- logsumexp -----


def _shift(top: np.ndarray) -> np.ndarray:
    """The max where it is finite, else 0: all -inf gives -inf, an inf gives inf, NaN stays NaN."""
    return np.where(np.isfinite(top), top, np.zeros_like(top))


logsumexp = Operator(
    "logsumexp",
    inputs=[Input("data", domain=LOGITS)],
    attrs=_reduce_attrs(),
    doc="log(sum(exp(data), axis)), computed as m + log(sum(exp(data - m))) with m the max "
        "(scipy.special.logsumexp, torch.logsumexp): no overflow, float32 keeps its digits at 1e4.",
)
logsumexp.shape_rule(_nonempty_reduce_shape)


@logsumexp.reference
def _logsumexp_forward(data: np.ndarray, axis: tuple[int, ...], keepdims: bool) -> np.ndarray:
    shift = _shift(np.amax(data, axis=axis, keepdims=True))
    with np.errstate(divide="ignore"):  # log(0) = -inf when every element is -inf
        out = np.log(np.sum(np.exp(data - shift), axis=axis, keepdims=True)) + shift
    if not keepdims:
        out = out.reshape(_reduced_shape(data.shape, axis, False))
    return np.asarray(out, dtype=data.dtype)


@logsumexp.gradient
def _logsumexp_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = grad * exp(data - logsumexp(data)) (the softmax over axis), grad broadcast from kept dims

    Over no axes the op is the identity: d_data = grad (exp(inf - inf) would be NaN)."""
    if not call.attrs["axis"]:
        return [ops.reshape(grad, shape=call.args[0].shape)]
    kept = _kept(call)
    weights = ops.exp(ops.subtract(call.args[0], ops.reshape(call, shape=kept)))
    return [ops.multiply(ops.reshape(grad, shape=kept), weights)]


@logsumexp.mutant("exp(data) unnormalized (forgets to subtract the output)")
def _logsumexp_unnormalized(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.multiply(ops.reshape(grad, shape=_kept(call)), ops.exp(call.args[0]))]


@logsumexp.mutant("weights exp(data) / sum(exp(data)) unshifted: overflows at large logits")
def _logsumexp_naive(call: Call, grad: Expr) -> list[Expr | None]:
    axes, kept = call.attrs["axis"], _kept(call)
    e = ops.exp(call.args[0])
    return [ops.multiply(ops.reshape(grad, shape=kept), ops.divide(e, ops.sum(e, axis=axes, keepdims=True)))]


logsumexp.sampler(_reduce_cases)


@logsumexp.lowering
def _logsumexp_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """m = max(data, axis); out = shift + log(sum(exp(data - shift))), shift = m if finite else 0"""
    axes, kept = call.attrs["axis"], _kept(call)
    top = kb.temporary(kept, data.dtype)
    kb.reduce(top, data, axes, "max")

    def shift(s: Scalar, m: str) -> str:
        return s.select(s.cmp("olt", s.call("fabs", m), s.const(math.inf)), m, s.const(0.0))

    total = kb.temporary(kept, data.dtype)
    kb.map_reduce(total, [data, top.broadcast_to(data.shape)], axes, "sum",
                  lambda s, v: s.call("exp", s.sub(v[0], shift(s, v[1]))))
    kb.elementwise(dense_reshape(out, kept), [top, total], lambda s, v: s.add(s.call("log", v[1]), shift(s, v[0])))


# ----- argmax / argmin -----


def _one_axis(value: Any, types: Sequence[TensorType], _attrs: Any = None) -> int | None:
    """None (the flattened array) or one int axis, made non-negative."""
    ndim = types[0].ndim if types else 0
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError("expected None (the flattened array) or one int axis, as numpy's argmax")
    if not -ndim <= value < ndim:
        raise ValueError(f"axis {value} is out of range for a rank-{ndim} input")
    return int(value) % ndim


def _index_shape(data: TensorType, attrs: Attrs) -> TensorType:
    axes = tuple(range(data.ndim)) if attrs["axis"] is None else (attrs["axis"],)
    require(all(data.shape[a] > 0 for a in axes) and (attrs["axis"] is not None or data.size > 0),
            f"cannot take the index of an extremum over a zero-size axis of shape {data.shape}")
    if attrs["axis"] is None and not attrs["keepdims"]:
        return TensorType((), "int64")
    return TensorType(_reduced_shape(data.shape, axes, attrs["keepdims"]), "int64")


def _index_attrs() -> list[Attr]:
    return [
        Attr("axis", default=None, convert=_one_axis, uses_types=True,
             doc="one int axis, or None for an index into the flattened array"),
        Attr("keepdims", default=False, convert=bool_attr, doc="keep reduced axes as size 1"),
    ]


def _index_cases(d: CaseDraw) -> Case:
    shape = d.shape(min_rank=1, max_rank=4)
    axis = d.int(-len(shape), len(shape) - 1) if d.int(0, 3) else None
    return Case([shape], {"axis": axis, "keepdims": d.bool()})


def _index_axes(call: Call) -> tuple[int, ...]:
    axis = call.attrs["axis"]
    return tuple(range(call.args[0].ndim)) if axis is None else (axis,)


argmax = Operator(
    "argmax",
    inputs=[Input("data", differentiable=False, doc="piecewise constant: the index does not vary smoothly")],
    attrs=_index_attrs(),
    doc="int64 index of the largest element along `axis` (np.argmax, torch.argmax): the first on ties, "
        "the first NaN if any; axis=None indexes the flattened array.",
)
argmax.shape_rule(_index_shape)


@argmax.reference
def _argmax_forward(data: np.ndarray, axis: int | None, keepdims: bool) -> np.ndarray:
    return np.asarray(np.argmax(data, axis=axis, keepdims=keepdims), dtype=np.int64)


argmax.sampler(_index_cases)


@argmax.lowering
def _argmax_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = index of the first maximum (or first NaN) along axis"""
    _fold(kb, out, data, _index_axes(call), "argmax")


argmin = Operator(
    "argmin",
    inputs=[Input("data", differentiable=False, doc="piecewise constant: the index does not vary smoothly")],
    attrs=_index_attrs(),
    doc="int64 index of the smallest element along `axis` (np.argmin, torch.argmin): the first on ties, "
        "the first NaN if any; axis=None indexes the flattened array.",
)
argmin.shape_rule(_index_shape)


@argmin.reference
def _argmin_forward(data: np.ndarray, axis: int | None, keepdims: bool) -> np.ndarray:
    return np.asarray(np.argmin(data, axis=axis, keepdims=keepdims), dtype=np.int64)


argmin.sampler(_index_cases)


@argmin.lowering
def _argmin_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = index of the first minimum (or first NaN) along axis"""
    _fold(kb, out, data, _index_axes(call), "argmin")
