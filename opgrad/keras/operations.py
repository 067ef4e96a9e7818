"""``keras.ops`` arithmetic in functional models: ``x + 3.0``, ``x * (1 / 6)``, ``ops.add(a, b)``.

Keras 3 records an operation applied to a symbolic tensor as an entry among the layers, under the
operation's class name (``Add``, ``Subtract``, ``Multiply``, ``Divide``, ``TrueDivide``: ``x / 2``
is ``TrueDivide``), called with its positional arguments: the tensors and the Python numbers it was
given. MobileNetV3's hard sigmoid is ``ReLU(6.)(x + 3.) * (1. / 6.)`` written so.

A number operand becomes a fixed operand of ``nn.ops_layers.Arithmetic`` (``reverse`` when it comes
first, ``3.0 - x``), in float32 as Keras computes it. Two tensors of the same rank combine as the
merge layers do; numpy broadcasts tensors of different ranks with their batch axes misaligned,
which no per-example layer computes, so those are refused.
"""

from __future__ import annotations

from opgrad.keras.graph import Converter, LayerCall, Tensor
from opgrad.keras.merging import elementwise
from opgrad.nn.ops_layers import Arithmetic

__all__ = ["OPERATIONS"]


def _binary(op: str) -> Converter:
    def convert(call: LayerCall, inputs: list[Tensor]) -> Tensor:
        arguments = call.spec.arguments
        if len(arguments) != 2:
            raise call.fail(f"takes two arguments, got {len(arguments)}")
        call.refuse_mask(inputs, "an operation drops it")
        if any(t.sym.dtype != "float" for t in inputs):
            raise call.fail("needs float inputs (integer inputs are promoted by Keras' dtype rules)")
        if len(inputs) == 2:
            if inputs[0].keras_rank != inputs[1].keras_rank:
                raise call.fail(f"input shapes {inputs[0].keras_shape} and {inputs[1].keras_shape} differ in rank; "
                                "numpy's broadcasting would align the batch axis of one with an example axis of the "
                                "other: supported: tensors of one rank, or a tensor and a number")
            return elementwise(call, inputs, op)
        tensor = call.one_input(inputs)
        number = next(arg for arg in arguments if isinstance(arg, float))
        layer = Arithmetic(op, operand=number, reverse=isinstance(arguments[0], float))
        return call.add(layer, tensor, tensor.layout, tensor.keras_shape, chw=tensor.chw)

    return convert


#: Converters of the ``keras.ops`` operations, by the class name Keras saves.
OPERATIONS: dict[str, Converter] = {
    "Add": _binary("add"),
    "Subtract": _binary("subtract"),
    "Multiply": _binary("multiply"),
    "Divide": _binary("divide"),
    "TrueDivide": _binary("divide"),
}
