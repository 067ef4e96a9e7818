"""BatchNormalization (inference form; fine-tuning then uses batch statistics as PyTorch does) and
LayerNormalization."""

from __future__ import annotations

import math

import numpy as np

from opgrad.nn.layers import BatchNorm2D, LayerNorm
from opgrad.onnx.table import NodeContext, Value, converter

__all__: list[str] = []


def _batch_norm(ctx: NodeContext) -> list[Value]:
    x = ctx.tensor(0, "X")
    if len(x.shape) not in (1, 2, 3):
        raise ctx.error(f"input X has shape (N, {', '.join(map(str, x.shape))}); supported: (N, C, H, W), (N, C, L) "
                        f"or (N, C)")
    if int(ctx.attr("training_mode", 0)):
        raise ctx.unsupported("training_mode", 1, "0 (an inference graph; opgrad's training step updates the "
                                                  "running statistics itself)")
    epsilon = float(ctx.attr("epsilon", 1e-5))
    momentum = float(ctx.attr("momentum", 0.9))
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise ctx.unsupported("epsilon", epsilon, "a finite number > 0")
    if not 0.0 <= momentum <= 1.0:
        raise ctx.unsupported("momentum", momentum, "a number in [0, 1]")
    names = ("weight", "bias", "running_mean", "running_var")
    weights = {}
    for index, (name, what) in enumerate(zip(names, ("scale", "B", "input_mean", "input_var")), start=1):
        array = ctx.static_floats(index, what)
        if array.shape != (x.shape[0],):
            raise ctx.error(f"{what} has shape {list(array.shape)}; expected ({x.shape[0]},), one per channel")
        weights[name] = array
    # ONNX weighs the old running value by `momentum`, PyTorch and opgrad the new batch statistic.
    layer = ctx.new(BatchNorm2D, momentum=round(1.0 - momentum, 12), epsilon=epsilon)
    return [ctx.layer(layer, x, weights)]


converter("BatchNormalization", since=9, attributes=("epsilon", "momentum"))(_batch_norm)
converter("BatchNormalization", since=14, attributes=("epsilon", "momentum", "training_mode"))(_batch_norm)


@converter("LayerNormalization", since=17, attributes=("axis", "epsilon", "stash_type"))
def layer_normalization(ctx: NodeContext) -> list[Value]:
    x = ctx.tensor(0, "X")
    rank = len(x.shape) + 1
    axis = int(ctx.attr("axis", -1))
    first = ctx.example_axis(axis, rank)
    if int(ctx.attr("stash_type", 1)) != 1:
        raise ctx.unsupported("stash_type", ctx.attr("stash_type"), "1 (statistics in float32)")
    epsilon = float(ctx.attr("epsilon", 1e-5))
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise ctx.unsupported("epsilon", epsilon, "a finite number > 0")
    normalized = x.shape[first:]
    weights = {}
    for index, (name, what) in enumerate((("weight", "Scale"), ("bias", "B")), start=1):
        array = ctx.static_floats(index, what) if ctx.has_input(index) else np.zeros(normalized)
        try:
            weights[name] = np.broadcast_to(array, normalized).copy()
        except ValueError:
            raise ctx.error(f"{what} has shape {list(array.shape)}; expected one that broadcasts to "
                            f"{list(normalized)}") from None
    return [ctx.layer(ctx.new(LayerNorm, axis % rank, epsilon), x, weights)]
