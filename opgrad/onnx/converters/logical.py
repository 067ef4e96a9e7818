"""Comparisons, boolean logic and Where, on opgrad's float 0/1 masks.

ONNX's boolean tensors become float masks (1.0 true, 0.0 false), as the registry's ``greater``
gives them: ``Greater``/``Less`` are ``greater`` (operands swapped for ``Less``), ``Not`` is
``1 - m``, ``And`` a product and ``Or`` a maximum of masks, and ``Where`` the :class:`Where` layer,
whose branches may be tensors or scalar constants (infinities included: PyTorch's
``masked_fill(mask, -inf)``). A ``Cast`` to BOOL of computed data is true for every value but
+-0, NaN included, as ONNX casts. ``Equal`` and the ``...OrEqual`` comparisons are not read:
built of ``greater`` they would call NaN equal.
"""

from __future__ import annotations

import numpy as np

from opgrad.nn.ops_layers import Arithmetic, Elementwise, Unary, Where
from opgrad.onnx.converters.elementwise import operation
from opgrad.onnx.table import NodeContext, StaticValue, Value, converter

__all__ = ["as_mask"]


@converter("Greater", since=7)
def greater(ctx: NodeContext) -> list[Value]:
    return [operation(ctx, "greater", 0, 1)]


@converter("Less", since=7)
def less(ctx: NodeContext) -> list[Value]:
    return [operation(ctx, "greater", 1, 0)]  # a < b is b > a, NaN false on both sides


@converter("Not", since=1)
def logical_not(ctx: NodeContext) -> list[Value]:
    return [ctx.layer(ctx.new(Arithmetic, "subtract", operand=1.0, reverse=True), ctx.tensor(0, "X"))]


@converter("And", since=7)
def logical_and(ctx: NodeContext) -> list[Value]:
    return [operation(ctx, "multiply", 0, 1)]


@converter("Or", since=7)
def logical_or(ctx: NodeContext) -> list[Value]:
    return [operation(ctx, "maximum", 0, 1)]


def as_mask(ctx: NodeContext, value: Value) -> Value:
    """Computed data cast to BOOL, as a float mask: ``max(|x| > 0, 1 - (|x| > -1))``, true for every
    value but +-0; the second term is 1 exactly for NaN, which compares false with everything."""
    if isinstance(value, StaticValue):
        return StaticValue(np.asarray(value.array != 0))
    magnitude = ctx.layer(ctx.new(Unary, "abs"), value)
    nonzero = ctx.layer(ctx.new(Arithmetic, "greater", operand=0.0), magnitude)
    ordered = ctx.layer(ctx.new(Arithmetic, "greater", operand=-1.0), magnitude)
    nan = ctx.layer(ctx.new(Arithmetic, "subtract", operand=1.0, reverse=True), ordered)
    return ctx.layer(ctx.new(Elementwise, "maximum"), [nonzero, nan])


@converter("Where", since=9)
def where(ctx: NodeContext) -> list[Value]:
    condition = ctx.tensor(0, "condition")
    fixed: dict[str, float] = {}
    tensors = [condition]
    for index, (what, key) in enumerate((("X", "true_value"), ("Y", "false_value")), start=1):
        branch = ctx.value(index)
        if isinstance(branch, StaticValue):
            array = ctx.static_floats(index, what)
            if array.size != 1:
                raise ctx.error(f"input {index} ({what}) is a constant of shape {list(array.shape)}; supported: a "
                                "scalar constant or data computed from the input")
            fixed[key] = float(array.reshape(()))
        else:
            tensors.append(branch)
    ranks = {len(t.shape) for t in tensors}
    if len(ranks) != 1:
        raise ctx.error("inputs differ in rank; supported: tensors of one rank (their batch axes align) and "
                        "scalar constants")
    return [ctx.layer(ctx.new(Where, **fixed), tensors)]
