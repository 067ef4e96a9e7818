"""sum over axes (with keepdims); the reduction the losses and bias gradients need."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from opgrad import ops
from opgrad.dtypes import TensorType
from opgrad.ir import Call, Expr
from opgrad.op import Attr, Attrs, Case, Input, Operator

from ._common import axes_attr, bool_attr

if TYPE_CHECKING:  # types only: the compiler and the checker sit above the registry
    from opgrad.checks.strategies import CaseDraw
    from opgrad.compiler.builder import KernelBuilder
    from opgrad.compiler.views import View

sum = Operator(  # shadows the builtin on purpose: the op is called sum, as in numpy
    "sum",
    inputs=[Input("data")],
    attrs=[
        Attr("axis", default=None, convert=axes_attr, uses_types=True,
             doc="int, tuple of ints, or None for all axes"),
        Attr("keepdims", default=False, convert=bool_attr),
    ],
    doc="Sum of data over `axis`.",
    jointly_linear=True,
)


@sum.shape_rule
def _sum_shape(data: TensorType, attrs: Attrs) -> TensorType:
    axes = attrs["axis"]
    if attrs["keepdims"]:
        shape = tuple(1 if i in axes else d for i, d in enumerate(data.shape))
    else:
        shape = tuple(d for i, d in enumerate(data.shape) if i not in axes)
    return TensorType(shape, data.dtype)


@sum.reference
def _sum_forward(data: np.ndarray, axis: tuple[int, ...], keepdims: bool) -> np.ndarray:
    return np.asarray(np.sum(data, axis=axis, keepdims=keepdims))


@sum.gradient
def _sum_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = broadcast_to(reshape(grad, kept dims), data.shape)"""
    data = call.args[0]
    kept = tuple(1 if i in call.attrs["axis"] else d for i, d in enumerate(data.shape))
    return [ops.broadcast_to(ops.reshape(grad, shape=kept), shape=data.shape)]


@sum.mutant("restores the reduced axes at the front instead of in place")
def _sum_axes_in_front(call: Call, grad: Expr) -> list[Expr | None]:
    shape, axes = call.args[0].shape, call.attrs["axis"]
    reduced_first = (1,) * len(axes) + tuple(d for i, d in enumerate(shape) if i not in axes)
    return [ops.broadcast_to(ops.reshape(grad, shape=reduced_first), shape=shape)]


@sum.sampler
def _sum_cases(d: CaseDraw) -> Case:
    shape = d.shape(min_rank=1, max_rank=4)
    axes = d.subset([a - len(shape) if d.bool() else a for a in range(len(shape))])  # some negative
    axis = (axes[0] if len(axes) == 1 and d.bool() else axes) if d.int(0, 3) else None
    return Case([shape], {"axis": axis, "keepdims": d.bool()})


@sum.lowering
def _sum_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = sum(data, axis) (keepdims or not: the output view says which)"""
    kb.reduce(out, data, call.attrs["axis"], "sum")
