"""Keras' merge layers: several tensors combined into one."""

from __future__ import annotations

from opgrad.keras.graph import LayerCall, Tensor
from opgrad.nn.layers import Add, Concatenate

__all__ = ["add", "concatenate"]


def _same_layout(call: LayerCall, inputs: list[Tensor]) -> list[Tensor]:
    if len(inputs) < 2:
        raise call.fail(f"takes two or more inputs, got {len(inputs)}")
    if len({(t.layout, t.chw) for t in inputs}) == 1:
        return inputs
    return [call.to_keras_order(t) if t.layout == "flat_chw" else t for t in inputs]


def add(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    tensors = _same_layout(call, inputs)
    first = tensors[0]
    return call.add(Add(), tensors, first.layout, first.keras_shape, chw=first.chw)


def concatenate(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    tensors = _same_layout(call, inputs)
    if tensors[0].layout == "flat_chw":
        tensors = [call.to_keras_order(t) for t in tensors]
    axis = call.take("axis", -1)
    if not isinstance(axis, int):
        raise call.unsupported("axis", axis, "one axis")
    layer = Concatenate(call.opgrad_axis(tensors[0], axis))
    out = call.add(layer, tensors, tensors[0].layout, tensors[0].keras_shape)
    keras_axis = axis % (tensors[0].keras_rank + 1) - 1
    shape = list(tensors[0].keras_shape)
    shape[keras_axis] = sum(t.keras_shape[keras_axis] for t in tensors)
    return Tensor(out.sym, out.layout, tuple(shape))


