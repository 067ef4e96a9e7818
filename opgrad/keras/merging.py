"""Keras' merge layers: several tensors combined element by element, or concatenated.

Keras combines the inputs of ``Add``, ``Subtract``, ``Multiply``, ``Average``, ``Maximum`` and
``Minimum`` with numpy's broadcasting of their per-example shapes, after giving an input of
lower rank leading axes of size 1: a ``(C,)`` vector against an ``(H, W, C)`` image is
``(1, 1, C)``, squeeze-and-excitation's channel weights. The importer reshapes such an input
the same way, so every input is in the layout of the others and one opgrad layer combines them.

Keras attaches the mask of an ``Embedding(mask_zero=True)`` to the tensors computed from it
(:attr:`Tensor.keras_mask`). ``Multiply``, ``Maximum`` and ``Minimum`` apply it, so they refuse
such an input; the other merges pass it on as Keras does: when every input carries one
(``Concatenate``: when any does).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from opgrad.keras.graph import LayerCall, Tensor
from opgrad.nn.layers import Add, Concatenate
from opgrad.nn.ops_layers import Arithmetic, Elementwise
from opgrad.nn.reshaping import Reshape

__all__ = ["add", "average", "concatenate", "elementwise", "maximum", "minimum", "multiply", "subtract"]


def _same_layout(call: LayerCall, inputs: list[Tensor]) -> list[Tensor]:
    if len(inputs) < 2:
        raise call.fail(f"takes two or more inputs, got {len(inputs)}")
    if len({(t.layout, t.chw) for t in inputs}) == 1:
        return inputs
    # A flattened image in Keras' order; an integer input's or an embedding's three axes as NCHW.
    return [call.canonical(call.to_keras_order(t) if t.layout == "flat_chw" else t) for t in inputs]


def _broadcastable(call: LayerCall, inputs: list[Tensor]) -> tuple[list[Tensor], tuple[int, ...]]:
    """``inputs`` in one layout, those of lower rank with Keras' leading axes of size 1, and the
    Keras shape they broadcast to."""
    if len(inputs) < 2:
        raise call.fail(f"takes two or more inputs, got {len(inputs)}")
    rank = max(t.keras_rank for t in inputs)
    expanded = []
    for t in inputs:
        if t.keras_rank < rank:
            shape = (1,) * (rank - t.keras_rank) + t.keras_shape
            t = call.canonical(call.add(Reshape(shape), call.to_keras_order(t), "keras", shape, suffix="expand"))
        expanded.append(t)
    tensors = _same_layout(call, expanded)
    try:
        shape = np.broadcast_shapes(*(t.keras_shape for t in tensors))
    except ValueError:
        raise call.fail(f"input shapes {', '.join(str(t.keras_shape) for t in inputs)} do not broadcast together "
                        "(Keras' rule: numpy's, on the shapes without the batch axis)") from None
    return tensors, tuple(int(d) for d in shape)


def _all_masked(inputs: list[Tensor]) -> str | None:
    """The mask Keras' merges attach to their output: one when every input carries one."""
    return inputs[0].keras_mask if all(t.keras_mask is not None for t in inputs) else None


def elementwise(call: LayerCall, inputs: list[Tensor], op: str) -> Tensor:
    """``op`` of the broadcast inputs, folded from the left as Keras does: nn.Add for a sum of one shape."""
    tensors, shape = _broadcastable(call, inputs)
    same = all(t.keras_shape == shape for t in tensors)
    layer = Add() if op == "add" and same else Elementwise(op)
    first = tensors[0]
    return call.add(layer, tensors, first.layout, shape, chw=first.chw)


def add(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    return dataclasses.replace(elementwise(call, inputs, "add"), keras_mask=_all_masked(inputs))


def subtract(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    if len(inputs) != 2:
        raise call.fail(f"takes exactly two inputs, got {len(inputs)}")
    return dataclasses.replace(elementwise(call, inputs, "subtract"), keras_mask=_all_masked(inputs))


def average(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    """``(x0 + x1 + ...) / n``, Keras' sum then division (not a mean of n-th parts)."""
    total = elementwise(call, inputs, "add")
    out = call.add(Arithmetic("divide", operand=float(len(inputs))), total, total.layout, total.keras_shape,
                   suffix="mean", chw=total.chw)
    return dataclasses.replace(out, keras_mask=_all_masked(inputs))


def multiply(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    call.refuse_mask(inputs, "a masked step of an input counts as 1, a step masked in every input is 0")
    return elementwise(call, inputs, "multiply")


def maximum(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    call.refuse_mask(inputs, "a masked step takes the other inputs' value")
    return elementwise(call, inputs, "maximum")


def minimum(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    call.refuse_mask(inputs, "a masked step takes the other inputs' value")
    return elementwise(call, inputs, "minimum")


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
    mask = next((t.keras_mask for t in inputs if t.keras_mask is not None), None)
    return Tensor(out.sym, out.layout, tuple(shape), keras_mask=mask)
