"""Activations and pass-through nodes: Relu, LeakyRelu, Sigmoid, Tanh, Gelu, Softmax, LogSoftmax,
Clip, Dropout, Identity, Cast."""

from __future__ import annotations

import math

from opgrad.nn.layers import GELU, Dropout, LeakyReLU, ReLU, Sigmoid, Softmax, Tanh
from opgrad.nn.ops_layers import Clip, LogSoftmax
from opgrad.nn.reshaping import Reshape
from opgrad.onnx.table import NodeContext, StaticValue, Value, converter

__all__: list[str] = []

_SIMPLE = {"Relu": ReLU, "Sigmoid": Sigmoid, "Tanh": Tanh}
_FLOAT_CASTS = {1: "FLOAT", 10: "FLOAT16", 11: "DOUBLE", 16: "BFLOAT16"}


def simple(ctx: NodeContext) -> list[Value]:
    return [ctx.layer(ctx.new(_SIMPLE[ctx.op_type]), ctx.tensor(0, "X"))]


for _op_type in _SIMPLE:
    converter(_op_type, since=6)(simple)


@converter("LeakyRelu", since=6, attributes=("alpha",))
def leaky_relu(ctx: NodeContext) -> list[Value]:
    alpha = float(ctx.attr("alpha", 0.01))
    if not (math.isfinite(alpha) and alpha >= 0):
        raise ctx.unsupported("alpha", alpha, "a finite slope >= 0")
    return [ctx.layer(ctx.new(LeakyReLU, alpha), ctx.tensor(0, "X"))]


@converter("Gelu", since=20, attributes=("approximate",))
def gelu(ctx: NodeContext) -> list[Value]:
    approximate = ctx.attr("approximate", "none")
    if approximate not in ("none", "tanh"):
        raise ctx.unsupported("approximate", approximate, "none, tanh")
    return [ctx.layer(ctx.new(GELU, approximate), ctx.tensor(0, "X"))]


def _softmax(ctx: NodeContext, coerced: bool) -> list[Value]:
    x = ctx.tensor(0, "input")
    rank = len(x.shape) + 1
    cls = Softmax if ctx.op_type == "Softmax" else LogSoftmax
    axis = int(ctx.attr("axis", 1 if coerced else -1))
    example = ctx.example_axis(axis, rank)
    if not coerced or example == len(x.shape) - 1:
        return [ctx.layer(ctx.new(cls, axis % rank), x)]
    # Before opset 13 the axes from `axis` on are flattened into one: reshape, normalize, reshape back.
    inner = math.prod(x.shape[example:])
    flat = ctx.layer(ctx.new(Reshape, (*x.shape[:example], inner)), x)
    return [ctx.layer(ctx.new(Reshape, x.shape), ctx.layer(ctx.new(cls, -1), flat))]


for _op_type in ("Softmax", "LogSoftmax"):
    converter(_op_type, since=1, attributes=("axis",))(lambda ctx: _softmax(ctx, True))
    converter(_op_type, since=13, attributes=("axis",))(lambda ctx: _softmax(ctx, False))


@converter("Clip", since=11)
def clip(ctx: NodeContext) -> list[Value]:
    x = ctx.tensor(0, "input")
    bounds: list[float | None] = []
    for index, what in ((1, "min"), (2, "max")):
        if ctx.has_input(index):
            value = ctx.static_floats(index, what)
            if value.size != 1:
                raise ctx.error(f"{what} has shape {list(value.shape)}; supported: a scalar bound")
            bounds.append(float(value.reshape(())))
        else:
            bounds.append(None)
    if bounds == [None, None]:
        return [x]
    return [ctx.layer(ctx.new(Clip, bounds[0], bounds[1]), x)]


def _dropout(ctx: NodeContext, ratio: float) -> list[Value]:
    x = ctx.tensor(0, "data")
    if ratio == 0.0:
        return [x]
    return [ctx.layer(ctx.new(Dropout, ratio), x)]


@converter("Dropout", since=10, attributes=("ratio", "seed"))
def dropout_10(ctx: NodeContext) -> list[Value]:
    return _dropout(ctx, float(ctx.attr("ratio", 0.5)))


@converter("Dropout", since=12, attributes=("seed",))
def dropout_12(ctx: NodeContext) -> list[Value]:
    if ctx.has_input(2) and ctx.static_ints(2, "training_mode") != [0]:
        raise ctx.error("input training_mode is true; supported: an inference graph (training_mode false)")
    ratio = float(ctx.static_floats(1, "ratio").reshape(())) if ctx.has_input(1) else 0.5
    return _dropout(ctx, ratio)


@converter("Identity", since=1)
def identity(ctx: NodeContext) -> list[Value]:
    return [ctx.value(0)]


@converter("Cast", since=6, attributes=("saturate", "to"))
def cast(ctx: NodeContext) -> list[Value]:
    value = ctx.value(0)
    to = int(ctx.attr("to", 0))
    if to not in _FLOAT_CASTS and not isinstance(value, StaticValue):
        raise ctx.unsupported("to", to, "float types (FLOAT, DOUBLE, FLOAT16: the model computes in its own float "
                                        "type) for data computed from the input")
    return [value]
