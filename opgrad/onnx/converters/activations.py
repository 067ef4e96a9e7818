"""Activations and pass-through nodes: Relu, LeakyRelu, Sigmoid, Tanh, Gelu, Elu, Softplus, PRelu,
HardSigmoid, HardSwish, Mish, Softmax, LogSoftmax, Clip, Dropout, Identity, Cast, and the
one-input math nodes Abs, Erf, Exp, Log, Neg, Sqrt, Reciprocal and Pow by a constant."""

from __future__ import annotations

import math

import numpy as np

from opgrad.nn.layers import (
    ELU,
    GELU,
    Dropout,
    Hardsigmoid,
    Hardswish,
    LeakyReLU,
    PReLU,
    ReLU,
    Sigmoid,
    Softmax,
    Softplus,
    Tanh,
)
from opgrad.nn.ops_layers import Arithmetic, Clip, Elementwise, LogSoftmax, Unary
from opgrad.nn.reshaping import Reshape
from opgrad.onnx.converters.logical import as_mask
from opgrad.onnx.table import NodeContext, StaticValue, Value, converter

__all__ = ["UNARY_NODES"]

_SIMPLE = {"Relu": ReLU, "Sigmoid": Sigmoid, "Tanh": Tanh, "Softplus": Softplus, "HardSwish": Hardswish}
#: ONNX's one-input math nodes and the opgrad operator of each (:class:`~opgrad.nn.Unary`'s op),
#: read by the importer and written back by the exporter.
UNARY_NODES = {"Abs": "abs", "Erf": "erf", "Exp": "exp", "Log": "log", "Neg": "negative", "Sqrt": "sqrt"}
_FLOAT_CASTS = {1: "FLOAT", 10: "FLOAT16", 11: "DOUBLE", 16: "BFLOAT16"}
_BOOL_CAST = 9  # TensorProto.BOOL


def simple(ctx: NodeContext) -> list[Value]:
    return [ctx.layer(ctx.new(_SIMPLE[ctx.op_type]), ctx.tensor(0, "X"))]


for _op_type in _SIMPLE:
    converter(_op_type, since=6)(simple)


def unary(ctx: NodeContext) -> list[Value]:
    return [ctx.layer(ctx.new(Unary, UNARY_NODES[ctx.op_type]), ctx.tensor(0, "X"))]


for _op_type in UNARY_NODES:
    converter(_op_type, since=6)(unary)


@converter("Reciprocal", since=6)
def reciprocal(ctx: NodeContext) -> list[Value]:
    return [ctx.layer(ctx.new(Arithmetic, "divide", operand=1.0, reverse=True), ctx.tensor(0, "X"))]


#: Constant exponents of Pow that are one registered operator (a LayerNorm exported before opset
#: 17 squares its deviations; an RMS norm takes their reciprocal square root).
_POWERS = {2.0: "square", 0.5: "sqrt", -0.5: "rsqrt"}


@converter("Pow", since=7)
def power(ctx: NodeContext) -> list[Value]:
    x = ctx.tensor(0, "X")
    exponent = ctx.static_floats(1, "Y")
    if exponent.size != 1:
        raise ctx.error(f"exponent has shape {list(exponent.shape)}; supported: one constant exponent")
    value = float(exponent.reshape(()))
    if value == 1.0:
        return [x]
    if value == -1.0:
        return list(reciprocal(ctx))
    if value not in _POWERS:
        raise ctx.error(f"exponent {value:g} is not supported; supported: constant exponents 1, -1, 2, 0.5, -0.5")
    return [ctx.layer(ctx.new(Unary, _POWERS[value]), x)]


@converter("Elu", since=6, attributes=("alpha",))
def elu(ctx: NodeContext) -> list[Value]:
    return [ctx.layer(ctx.new(ELU, float(ctx.attr("alpha", 1.0))), ctx.tensor(0, "X"))]


@converter("HardSigmoid", since=6, attributes=("alpha", "beta"))
def hard_sigmoid(ctx: NodeContext) -> list[Value]:
    x = ctx.tensor(0, "X")
    alpha, beta = float(ctx.attr("alpha", 0.2)), float(ctx.attr("beta", 0.5))
    if math.isclose(alpha, 1 / 6, rel_tol=1e-6) and beta == 0.5:  # PyTorch's and Keras 3's
        return [ctx.layer(ctx.new(Hardsigmoid), x)]
    scaled = ctx.layer(ctx.new(Arithmetic, "multiply", operand=alpha), x)
    shifted = ctx.layer(ctx.new(Arithmetic, "add", operand=beta), scaled)
    return [ctx.layer(ctx.new(Clip, 0.0, 1.0), shifted)]


@converter("Mish", since=18)
def mish(ctx: NodeContext) -> list[Value]:
    x = ctx.tensor(0, "X")
    gate = ctx.layer(ctx.new(Tanh), ctx.layer(ctx.new(Softplus), x))
    return [ctx.layer(ctx.new(Elementwise, "multiply"), [x, gate])]


@converter("PRelu", since=9)
def prelu(ctx: NodeContext) -> list[Value]:
    x = ctx.tensor(0, "X")
    slope = ctx.static_floats(1, "slope")
    channels = x.shape[0] if x.shape else 1
    # One shared slope, or one per channel of axis 1 (shape (C,) on (N, C), else (C, 1, ...)).
    per_channel = (channels, *([1] * (len(x.shape) - 1)))
    if slope.size == 1:
        count = 1
    elif slope.shape == per_channel:
        count = channels
    else:
        raise ctx.error(f"slope has shape {list(slope.shape)}; supported: one slope, or one per channel of axis 1 "
                        f"(shape {list(per_channel)}) for data (N, {', '.join(map(str, x.shape))})")
    weights = {"weight": np.asarray(slope.reshape(count), dtype=np.float32)}
    return [ctx.layer(ctx.new(PReLU, count), x, weights)]


@converter("LeakyRelu", since=6, attributes=("alpha",))
def leaky_relu(ctx: NodeContext) -> list[Value]:
    alpha = float(ctx.attr("alpha", 0.01))
    if not math.isfinite(alpha):
        raise ctx.unsupported("alpha", alpha, "a finite slope")
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
    # training_mode is a BOOL tensor in the spec (some writers store an integer).
    if ctx.has_input(2) and np.asarray(ctx.static(2, "training_mode").array).astype(bool).any():
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
    if to == _BOOL_CAST:
        return [as_mask(ctx, value)]
    if to not in _FLOAT_CASTS and not isinstance(value, StaticValue):
        raise ctx.unsupported("to", to, "float types (FLOAT, DOUBLE, FLOAT16: the model computes in its own float "
                                        "type) and BOOL (a 0/1 mask) for data computed from the input")
    return [value]
