"""Add, Sub, Mul, Div, Max, Min with ONNX (numpy) broadcasting, between tensors or against a constant."""

from __future__ import annotations

import numpy as np

from opgrad.nn.layers import Add
from opgrad.nn.ops_layers import Arithmetic, Elementwise
from opgrad.onnx.table import NodeContext, StaticValue, Value, converter

__all__ = ["FIXED_OPERAND_LIMIT", "operation"]

#: A constant operand that is no initializer is kept in the model description up to this many
#: elements (a scale, a mean); a larger one becomes a parameter so the description stays small.
FIXED_OPERAND_LIMIT = 4096
_OPS = {"Add": "add", "Sub": "subtract", "Mul": "multiply", "Div": "divide", "Max": "maximum", "Min": "minimum"}


def binary(ctx: NodeContext) -> list[Value]:
    return [operation(ctx, _OPS[ctx.op_type], 0, 1)]


def operation(ctx: NodeContext, op: str, first: int, second: int) -> Value:
    """``op`` (one of :data:`opgrad.nn.ops_layers.ARITHMETIC`) of the node's inputs ``first`` and
    ``second``, in that order: an :class:`Elementwise` layer of two tensors, or an
    :class:`Arithmetic` one of a tensor and a constant."""
    a, b = ctx.value(first), ctx.value(second)
    if not isinstance(a, StaticValue) and not isinstance(b, StaticValue):
        if op == "add" and a.shape == b.shape:
            return ctx.layer(ctx.new(Add), [a, b])
        if len(a.shape) != len(b.shape):
            raise ctx.error(f"inputs (N, {', '.join(map(str, a.shape))}) and (N, {', '.join(map(str, b.shape))}) "
                            "differ in rank; supported: tensors of one rank (their batch axes align), or a "
                            "constant operand of any rank")
        return ctx.layer(ctx.new(Elementwise, op), [a, b])
    if isinstance(a, StaticValue) and isinstance(b, StaticValue):
        raise ctx.error("both operands are constants; supported: at least one computed from the input")
    reverse = isinstance(a, StaticValue)
    constant, tensor = (a, b) if reverse else (b, a)
    assert isinstance(constant, StaticValue) and not isinstance(tensor, StaticValue)
    index = first if reverse else second
    array = ctx.static_floats(index, "operand")
    rank = len(tensor.shape) + 1
    if array.ndim > rank:
        raise ctx.error(f"constant operand of shape {list(array.shape)} has a higher rank than the data "
                        f"(N, {', '.join(map(str, tensor.shape))}); supported: operands that broadcast against it")
    if array.ndim == rank:
        if array.shape[0] != 1:
            raise ctx.error(f"constant operand of shape {list(array.shape)} varies along the batch axis; "
                            "supported: size 1 on the batch axis")
        array = array[0]
    if constant.initializer is not None or array.size > FIXED_OPERAND_LIMIT:
        layer = ctx.new(Arithmetic, op, operand_shape=array.shape, reverse=reverse)
        return ctx.layer(layer, tensor, {"operand": np.asarray(array, dtype=np.float32)})
    return ctx.layer(ctx.new(Arithmetic, op, operand=array.tolist(), reverse=reverse), tensor)


def extremum(ctx: NodeContext) -> list[Value]:
    """Max and Min take one or more inputs: one is itself, two as the binary operations, more
    (tensors of one rank) fold from the left."""
    count = ctx.input_count
    if count == 1:
        return [ctx.value(0)]
    if count == 2:
        return binary(ctx)
    tensors = [ctx.tensor(i, f"data_{i}") for i in range(count)]
    if len({len(t.shape) for t in tensors}) != 1:
        raise ctx.error("inputs differ in rank; supported: more than two inputs of one rank")
    return [ctx.layer(ctx.new(Elementwise, _OPS[ctx.op_type]), tensors)]


for _op_type in ("Add", "Sub", "Mul", "Div"):
    converter(_op_type, since=7)(binary)
for _op_type in ("Max", "Min"):
    converter(_op_type, since=8)(extremum)
