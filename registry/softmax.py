"""softmax and log_softmax along one axis, computed stably (max subtracted)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from opgrad import ops
from opgrad.ir import Call, Expr
from opgrad.op import Attr, Case, Input, Operator

from ._common import LOGITS, axis_attr, same_as_first

if TYPE_CHECKING:  # types only: the compiler and the checker sit above the registry
    from opgrad.checks.strategies import CaseDraw
    from opgrad.compiler.builder import KernelBuilder
    from opgrad.compiler.views import View


def stable_log_softmax(data: np.ndarray, axis: int) -> np.ndarray:
    shifted = data - np.max(data, axis=axis, keepdims=True, initial=-np.inf)  # an empty axis has no max
    with np.errstate(divide="ignore"):  # the sum is >= 1 except over an empty axis, whose log is never used
        return np.asarray(shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True)))


softmax = Operator(
    "softmax",
    inputs=[Input("data", domain=LOGITS)],
    attrs=[Attr("axis", default=-1, convert=axis_attr, uses_types=True)],
    doc="exp(data) / sum(exp(data), axis).",
)
softmax.shape_rule(same_as_first)


@softmax.reference
def _softmax_forward(data: np.ndarray, axis: int) -> np.ndarray:
    return np.asarray(np.exp(stable_log_softmax(data, axis)))


@softmax.gradient
def _softmax_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = y * (grad - sum(grad * y, axis, keepdims)), y = softmax(data)"""
    axis = call.attrs["axis"]
    inner = ops.sum(ops.multiply(grad, call), axis=axis, keepdims=True)
    return [ops.multiply(call, ops.subtract(grad, inner))]


def naive_softmax(data: Expr, axis: int) -> Expr:
    """exp(data) / sum(exp(data)) without the max subtracted: inf / inf = NaN at logits near 1e3."""
    e = ops.exp(data)
    return ops.divide(e, ops.sum(e, axis=axis, keepdims=True))


@softmax.mutant("y recomputed naively as exp(data) / sum(exp(data)): overflows at large logits")
def _softmax_naive(call: Call, grad: Expr) -> list[Expr | None]:
    y = naive_softmax(call.args[0], call.attrs["axis"])
    return [ops.multiply(y, ops.subtract(grad, ops.sum(ops.multiply(grad, y), axis=call.attrs["axis"],
                                                                keepdims=True)))]


@softmax.mutant("drops the sum term: y * grad")
def _softmax_no_sum_term(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.multiply(call, grad)]


@softmax.sampler
def _softmax_cases(d: CaseDraw) -> Case:
    shape = d.shape(min_rank=1)
    return Case([shape], {"axis": d.int(-len(shape), len(shape) - 1)})


def softmax_row_stats(kb: KernelBuilder, data: View, axis: int) -> tuple[View, View]:
    """(max, sum(exp(data - max))) along axis, keepdims, broadcast back to data's shape"""
    kept = tuple(1 if i == axis else d for i, d in enumerate(data.shape))
    top = kb.temporary(kept, data.dtype)
    kb.reduce(top, data, [axis], "max")
    top = top.broadcast_to(data.shape)
    total = kb.temporary(kept, data.dtype)
    kb.map_reduce(total, [data, top], [axis], "sum", lambda s, v: s.call("exp", s.sub(v[0], v[1])))
    return top, total.broadcast_to(data.shape)


@softmax.lowering
def _softmax_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = exp(data - max) / sum(exp(data - max)) along axis"""
    top, total = softmax_row_stats(kb, data, call.attrs["axis"])
    kb.elementwise(out, [data, top, total], lambda s, v: s.div(s.call("exp", s.sub(v[0], v[1])), v[2]))


log_softmax = Operator(
    "log_softmax",
    inputs=[Input("data", domain=LOGITS)],
    attrs=[Attr("axis", default=-1, convert=axis_attr, uses_types=True)],
    doc="data - log(sum(exp(data), axis)).",
)
log_softmax.shape_rule(same_as_first)


@log_softmax.reference
def _log_softmax_forward(data: np.ndarray, axis: int) -> np.ndarray:
    return stable_log_softmax(data, axis)


@log_softmax.gradient
def _log_softmax_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = grad - exp(y) * sum(grad, axis, keepdims), y = log_softmax(data)"""
    axis = call.attrs["axis"]
    total = ops.sum(grad, axis=axis, keepdims=True)
    return [ops.subtract(grad, ops.multiply(ops.exp(call), total))]


@log_softmax.mutant("exp(y) * grad instead of exp(y) * sum(grad): right only when the axis has length 1")
def _log_softmax_no_sum(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.subtract(grad, ops.multiply(ops.exp(call), grad))]


@log_softmax.mutant("softmax recomputed naively as exp(data) / sum(exp(data)): overflows at large logits")
def _log_softmax_naive(call: Call, grad: Expr) -> list[Expr | None]:
    axis = call.attrs["axis"]
    return [ops.subtract(grad, ops.multiply(naive_softmax(call.args[0], axis), ops.sum(grad, axis=axis,
                                                                                        keepdims=True)))]


log_softmax.sampler(_softmax_cases)


@log_softmax.lowering
def _log_softmax_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = data - max - log(sum(exp(data - max))) along axis"""
    top, total = softmax_row_stats(kb, data, call.attrs["axis"])
    kb.elementwise(out, [data, top, total], lambda s, v: s.sub(s.sub(v[0], v[1]), s.call("log", v[2])))
