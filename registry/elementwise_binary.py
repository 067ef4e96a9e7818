"""Elementwise binary arithmetic with numpy broadcasting: add, subtract, multiply, divide.

Every gradient here may keep the broadcast shape: autodiff sums it back to each input's shape
with collapse_sum_like, so these rules never un-broadcast by hand.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from opgrad import ops
from opgrad.ir import Call, Expr
from opgrad.op import Input, Operator

from ._common import AWAY_FROM_ZERO, broadcast_rule

if TYPE_CHECKING:  # types only: the compiler and the checker sit above the registry
    from opgrad.compiler.builder import KernelBuilder
    from opgrad.compiler.views import View

# ----- add -----

add = Operator(
    "add",
    inputs=[Input("lhs"), Input("rhs")],
    doc="lhs + rhs, broadcasting.",
    jointly_linear=True,
    broadcast=True,
)
add.shape_rule(broadcast_rule)


@add.reference
def _add_forward(lhs: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    return np.asarray(lhs + rhs)


@add.gradient
def _add_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_lhs = grad ; d_rhs = grad"""
    return [grad, grad]


@add.mutant("d_rhs negated (subtract's rule)")
def _add_as_subtract(call: Call, grad: Expr) -> list[Expr | None]:
    return [grad, ops.negative(grad)]


@add.mutant("d_lhs off by 1e-7 relative: inside finite differences' noise, not the adjoint test's round-off")
def _add_slightly_off(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.multiply(grad, 1.0000001), grad]


@add.lowering
def _add_lowering(kb: KernelBuilder, call: Call, out: View, lhs: View, rhs: View) -> None:
    """out = lhs + rhs, one loop over the broadcast views"""
    kb.elementwise(out, [lhs, rhs], lambda s, v: s.add(v[0], v[1]), broadcast=True)


# ----- subtract -----

subtract = Operator(
    "subtract",
    inputs=[Input("lhs"), Input("rhs")],
    doc="lhs - rhs, broadcasting.",
    jointly_linear=True,
    broadcast=True,
)
subtract.shape_rule(broadcast_rule)


@subtract.reference
def _subtract_forward(lhs: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    return np.asarray(lhs - rhs)


@subtract.gradient
def _subtract_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_lhs = grad ; d_rhs = -grad"""
    return [grad, ops.negative(grad)]


@subtract.mutant("d_rhs not negated")
def _subtract_rhs_not_negated(call: Call, grad: Expr) -> list[Expr | None]:
    return [grad, grad]


@subtract.lowering
def _subtract_lowering(kb: KernelBuilder, call: Call, out: View, lhs: View, rhs: View) -> None:
    """out = lhs - rhs, one loop over the broadcast views"""
    kb.elementwise(out, [lhs, rhs], lambda s, v: s.sub(v[0], v[1]), broadcast=True)


# ----- multiply -----

multiply = Operator(
    "multiply",
    inputs=[Input("lhs"), Input("rhs")],
    doc="lhs * rhs elementwise, broadcasting.",
    linear_in=("lhs", "rhs"),
    broadcast=True,
)
multiply.shape_rule(broadcast_rule)


@multiply.reference
def _multiply_forward(lhs: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    return np.asarray(lhs * rhs)


@multiply.gradient
def _multiply_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_lhs = grad * rhs ; d_rhs = grad * lhs"""
    lhs, rhs = call.args
    return [ops.multiply(grad, rhs), ops.multiply(grad, lhs)]


@multiply.mutant("each input gets its own value instead of the other's")
def _multiply_own_value(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.multiply(grad, call.args[0]), ops.multiply(grad, call.args[1])]


@multiply.mutant("a stretched d_rhs summed over every axis, not only those it was stretched along")
def _multiply_sums_every_axis(call: Call, grad: Expr) -> list[Expr | None]:
    lhs, rhs = call.args
    d_rhs = ops.multiply(grad, lhs)
    if rhs.shape != call.shape:
        d_rhs = ops.broadcast_to(ops.sum(d_rhs), shape=rhs.shape)
    return [ops.multiply(grad, rhs), d_rhs]


@multiply.lowering
def _multiply_lowering(kb: KernelBuilder, call: Call, out: View, lhs: View, rhs: View) -> None:
    """out = lhs * rhs, one loop over the broadcast views"""
    kb.elementwise(out, [lhs, rhs], lambda s, v: s.mul(v[0], v[1]), broadcast=True)


# ----- divide -----

divide = Operator(
    "divide",
    inputs=[Input("lhs"), Input("rhs", domain=AWAY_FROM_ZERO)],
    doc="lhs / rhs elementwise, broadcasting.",
    linear_in=("lhs",),
    broadcast=True,
)
divide.shape_rule(broadcast_rule)


@divide.reference
def _divide_forward(lhs: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    return np.asarray(lhs / rhs)


@divide.gradient
def _divide_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_lhs = grad / rhs ; d_rhs = -grad * out / rhs"""
    _, rhs = call.args
    d_lhs = ops.divide(grad, rhs)
    return [d_lhs, ops.negative(ops.multiply(d_lhs, call))]


@divide.mutant("d_rhs with the wrong sign")
def _divide_rhs_sign(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.divide(grad, call.args[1]), ops.multiply(ops.divide(grad, call.args[1]), call)]


@divide.lowering
def _divide_lowering(kb: KernelBuilder, call: Call, out: View, lhs: View, rhs: View) -> None:
    """out = lhs / rhs, one loop over the broadcast views"""
    kb.elementwise(out, [lhs, rhs], lambda s, v: s.div(v[0], v[1]), broadcast=True)
