"""Keras activations: the names Dense and the convolutions take, and the activation layers.

Each Keras activation becomes opgrad layers computing Keras' formula; ``relu``, ``sigmoid`` and
``tanh`` fuse into opgrad's Dense/Conv layers (:data:`FUSED`), the others follow the layer as
separate opgrad layers.
"""

from __future__ import annotations

from typing import Any

from opgrad.keras.graph import LayerCall, Tensor
from opgrad.nn.layers import ELU, GELU, Hardsigmoid, Hardswish, LeakyReLU, ReLU, Sigmoid, SiLU, Softmax, Softplus, Tanh
from opgrad.nn.ops_layers import Arithmetic, Clip, Elementwise

__all__ = ["ACTIVATIONS", "FUSED", "activate", "activation", "activation_name", "fused", "leaky_relu", "relu",
           "softmax"]

#: Keras activation names the importer maps; ``relu``/``sigmoid``/``tanh`` fuse into Dense/Conv.
ACTIVATIONS = ("linear", "relu", "sigmoid", "tanh", "gelu", "leaky_relu", "softmax", "silu", "swish", "elu",
               "softplus", "relu6", "hard_sigmoid", "hard_silu", "hard_swish", "mish")
FUSED = ("relu", "sigmoid", "tanh")


def activation_name(call: LayerCall, key: str = "activation") -> str:
    value = call.take(key, "linear")
    if isinstance(value, dict):  # a serialized function: {"class_name": "function", "config": "relu", ...}
        value = value.get("config")
    if value is None:
        value = "linear"
    if value not in ACTIVATIONS:
        raise call.unsupported(key, value, ", ".join(ACTIVATIONS))
    return str(value)


def fused(name: str) -> str | None:
    """``name`` where opgrad's Dense and Conv layers apply it themselves, else None."""
    return name if name in FUSED else None


def activate(call: LayerCall, tensor: Tensor, name: str) -> Tensor:
    """``tensor`` through Keras activation ``name`` as separate opgrad layers (after a fused-free layer)."""
    if name == "linear":
        return tensor
    layer: Any
    if name == "softmax":
        layer = Softmax(call.opgrad_axis(tensor, -1))
        out = call.add(layer, tensor, tensor.layout, tensor.keras_shape, suffix="softmax", chw=tensor.chw)
        call.builder.softmax_inputs[id(out.sym)] = (tensor, call.spec.name)
        return out
    if name == "hard_sigmoid" and call.builder.keras2:  # Keras 2's: clip(0.2 x + 0.5, 0, 1)
        scaled = call.add(Arithmetic("multiply", operand=0.2), tensor, tensor.layout, tensor.keras_shape,
                          suffix="scale", chw=tensor.chw)
        shifted = call.add(Arithmetic("add", operand=0.5), scaled, tensor.layout, tensor.keras_shape, suffix="shift",
                           chw=tensor.chw)
        return call.add(Clip(0.0, 1.0), shifted, tensor.layout, tensor.keras_shape, suffix=name, chw=tensor.chw)
    if name == "mish":  # x * tanh(softplus(x)), as keras.activations.mish
        gate = call.add(Tanh(), call.add(Softplus(), tensor, tensor.layout, tensor.keras_shape, suffix="softplus",
                                         chw=tensor.chw), tensor.layout, tensor.keras_shape, suffix="tanh",
                        chw=tensor.chw)
        return call.add(Elementwise("multiply"), [tensor, gate], tensor.layout, tensor.keras_shape, suffix=name,
                        chw=tensor.chw)
    return call.add(_activation_layer(name), tensor, tensor.layout, tensor.keras_shape, suffix=name, chw=tensor.chw)


def _activation_layer(name: str) -> Any:
    """The opgrad layer of Keras activation ``name`` (one of :data:`ACTIVATIONS` but linear, softmax, mish)."""
    simple = {"relu": ReLU, "sigmoid": Sigmoid, "tanh": Tanh, "silu": SiLU, "swish": SiLU, "elu": ELU,
              "softplus": Softplus, "hard_sigmoid": Hardsigmoid, "hard_silu": Hardswish,
              "hard_swish": Hardswish}.get(name)
    if simple is not None:
        return simple()
    if name == "gelu":
        return GELU("none")  # keras.activations.gelu's default is the exact (erf) form
    if name == "relu6":
        return Clip(0.0, 6.0)
    return LeakyReLU(0.2)  # keras.activations.leaky_relu's default slope


# ----- activation layers -----


def activation(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    tensor = call.one_input(inputs)
    name = activation_name(call)
    if name == "linear":
        return tensor
    if name in ("softmax", "mish", "hard_sigmoid"):
        return activate(call, tensor, name)
    return call.add(_activation_layer(name), tensor, tensor.layout, tensor.keras_shape, chw=tensor.chw)


def relu(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    tensor = call.one_input(inputs)
    ceiling = call.take("max_value", None)
    if ceiling is not None and (isinstance(ceiling, bool) or not isinstance(ceiling, (int, float)) or ceiling < 0):
        raise call.unsupported("max_value", ceiling, "None or a number >= 0")
    call.choose("threshold", (0, 0.0), 0.0)
    slope = float(call.take("negative_slope", 0.0))
    if ceiling is not None and not slope:  # ReLU(max_value=6) is MobileNet's relu6
        return call.add(Clip(0.0, float(ceiling)), tensor, tensor.layout, tensor.keras_shape, chw=tensor.chw)
    layer = LeakyReLU(slope) if slope else ReLU()
    out = call.add(layer, tensor, tensor.layout, tensor.keras_shape, chw=tensor.chw)
    if ceiling is None:
        return out
    return call.add(Clip(None, float(ceiling)), out, out.layout, out.keras_shape, suffix="max", chw=out.chw)


def leaky_relu(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    tensor = call.one_input(inputs)
    keras2 = "alpha" in call.config and "negative_slope" not in call.config
    slope = float(call.take("alpha", 0.3) if keras2 else call.take("negative_slope", 0.3))
    return call.add(LeakyReLU(slope), tensor, tensor.layout, tensor.keras_shape, chw=tensor.chw)


def softmax(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    call.refuse_mask(inputs, "it leaves the masked positions out")  # Keras 2 passes it without writing it
    tensor = call.one_input(inputs)
    axis = call.take("axis", -1)
    if not isinstance(axis, int):
        raise call.unsupported("axis", axis, "one axis")
    out = call.add(Softmax(call.opgrad_axis(tensor, axis)), tensor, tensor.layout, tensor.keras_shape, chw=tensor.chw)
    if axis % (tensor.keras_rank + 1) == tensor.keras_rank:
        call.builder.softmax_inputs[id(out.sym)] = (tensor, call.spec.name)
    return out


