"""bias_add: add a 1-D bias along one axis (the channel axis 1 of NCHW by default)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from opgrad import ops
from opgrad.dtypes import TensorType
from opgrad.ir import Call, Expr
from opgrad.op import Attr, Attrs, Case, Input, Operator, require

from ._common import axis_attr

if TYPE_CHECKING:  # types only: the compiler and the checker sit above the registry
    from opgrad.checks.strategies import CaseDraw
    from opgrad.compiler.builder import KernelBuilder
    from opgrad.compiler.views import View

bias_add = Operator(
    "bias_add",
    inputs=[Input("data"), Input("bias", doc="1-D, length data.shape[axis]")],
    attrs=[Attr("axis", default=1, convert=axis_attr, uses_types=True, doc="the axis bias runs along")],
    doc="data + bias broadcast along `axis`.",
    jointly_linear=True,
)


@bias_add.shape_rule
def _bias_add_shape(data: TensorType, bias: TensorType, attrs: Attrs) -> TensorType:
    axis = attrs["axis"]
    require(bias.ndim == 1, f"bias must be 1-D, got shape {bias.shape}")
    require(
        bias.shape[0] == data.shape[axis],
        f"bias has length {bias.shape[0]} but data has {data.shape[axis]} entries along axis {axis}; "
        f"expected bias shape ({data.shape[axis]},)",
    )
    return data


def _along(bias: np.ndarray, ndim: int, axis: int) -> np.ndarray:
    shape = [1] * ndim
    shape[axis] = bias.shape[0]
    return bias.reshape(shape)


@bias_add.reference
def _bias_add_forward(data: np.ndarray, bias: np.ndarray, axis: int) -> np.ndarray:
    return np.asarray(data + _along(bias, data.ndim, axis))


@bias_add.gradient
def _bias_add_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = grad ; d_bias = sum(grad, all axes but axis)"""
    axis = call.attrs["axis"]
    others = tuple(i for i in range(grad.ndim) if i != axis)
    return [grad, ops.sum(grad, axis=others)]


def _bias_sum(call: Call, grad: Expr) -> Expr:
    """d_bias: grad summed over every axis but attrs['axis']."""
    return ops.sum(grad, axis=tuple(i for i in range(grad.ndim) if i != call.attrs["axis"]))


@bias_add.mutant("d_bias summed over every axis")
def _bias_add_sum_all(call: Call, grad: Expr) -> list[Expr | None]:
    return [grad, ops.sum(grad)]


@bias_add.mutant("d_bias reduces the last axis, ignoring attrs['axis']")
def _bias_add_last_axis(call: Call, grad: Expr) -> list[Expr | None]:
    return [grad, ops.sum(grad, axis=tuple(range(grad.ndim - 1)))]


@bias_add.mutant("d_bias is the mean instead of the sum")
def _bias_add_mean(call: Call, grad: Expr) -> list[Expr | None]:
    return [grad, _bias_sum(call, grad) * (call.args[1].shape[0] / call.type.size)]


@bias_add.mutant("d_data forgotten (zeros)")
def _bias_add_data_forgotten(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.zeros_like(grad), _bias_sum(call, grad)]


@bias_add.sampler
def _bias_add_cases(d: CaseDraw) -> Case:
    shape = d.shape(min_rank=1, max_rank=4)
    axis = d.int(-len(shape), len(shape) - 1)
    return Case([shape, (shape[axis],)], {"axis": axis})


@bias_add.lowering
def _bias_add_lowering(kb: KernelBuilder, call: Call, out: View, data: View, bias: View) -> None:
    """out = data + bias laid along axis"""
    kb.elementwise(out, [data, bias.along(call.attrs["axis"], out.shape)], lambda s, v: s.add(v[0], v[1]))
