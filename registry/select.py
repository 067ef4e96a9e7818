"""Comparisons and selection: greater (a float 0/1 mask) and where.

Masks are float tensors of the operands' dtype (1.0 true, 0.0 false) rather than a bool dtype:
they multiply straight into gradients (relu' = grad * mask) and every kernel stays float.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from opgrad import ops
from opgrad.ir import Call, Expr
from opgrad.op import Input, Interval, Operator

from ._common import broadcast_rule

if TYPE_CHECKING:  # types only: the compiler and the checker sit above the registry
    from opgrad.compiler.builder import KernelBuilder
    from opgrad.compiler.views import View

# ----- greater -----

greater = Operator(
    "greater",
    inputs=[
        Input("lhs", differentiable=False, doc="piecewise constant: zero gradient almost everywhere"),
        Input("rhs", differentiable=False),
    ],
    doc="1.0 where lhs > rhs else 0.0, broadcasting; a float mask in the operands' dtype.",
    broadcast=True,
)
greater.shape_rule(broadcast_rule)


@greater.reference
def _greater_forward(lhs: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    return (lhs > rhs).astype(np.result_type(lhs, rhs))


@greater.lowering
def _greater_lowering(kb: KernelBuilder, call: Call, out: View, lhs: View, rhs: View) -> None:
    """out = 1.0 where lhs > rhs else 0.0"""
    kb.elementwise(out, [lhs, rhs], lambda s, v: s.mask(s.cmp("ogt", v[0], v[1])), broadcast=True)


# ----- where -----

where = Operator(
    "where",
    inputs=[
        Input("condition", differentiable=False, domain=(Interval(0.0, 0.0), Interval(1.0, 1.0)),
              doc="a float mask: nonzero selects on_true"),
        Input("on_true"),
        Input("on_false"),
    ],
    doc="on_true where condition != 0 else on_false, broadcasting all three.",
    broadcast=True,
    jointly_linear=True,  # linear in (on_true, on_false) together; each alone is only affine
)
where.shape_rule(broadcast_rule)


@where.reference
def _where_forward(condition: np.ndarray, on_true: np.ndarray, on_false: np.ndarray) -> np.ndarray:
    return np.where(condition != 0, on_true, on_false)


@where.gradient
def _where_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_on_true = where(c, grad, 0) ; d_on_false = where(c, 0, grad)"""
    condition = call.args[0]
    zeros = ops.zeros_like(grad)
    return [None, ops.where(condition, grad, zeros), ops.where(condition, zeros, grad)]


@where.mutant("branches swapped")
def _where_branches_swapped(call: Call, grad: Expr) -> list[Expr | None]:
    condition = call.args[0]
    return [None, ops.where(condition, ops.zeros_like(grad), grad), ops.where(condition, grad, ops.zeros_like(grad))]


@where.lowering
def _where_lowering(kb: KernelBuilder, call: Call, out: View, condition: View, on_true: View, on_false: View) -> None:
    """out = on_true where condition != 0 else on_false"""
    kb.elementwise(out, [condition, on_true, on_false],
                   lambda s, v: s.select(s.cmp("une", v[0], s.const(0.0)), v[1], v[2]), broadcast=True)
