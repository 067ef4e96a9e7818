"""Keras activations: the names Dense and the convolutions take, and the activation layers.

Each Keras activation becomes opgrad layers computing Keras' formula; ``relu``, ``sigmoid`` and
``tanh`` fuse into opgrad's Dense/Conv layers (:data:`FUSED`), the others follow the layer as
separate opgrad layers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from opgrad.keras.graph import LayerCall, Tensor
from opgrad.nn.layers import (
    ELU,
    GELU,
    Add,
    Hardsigmoid,
    Hardswish,
    LeakyReLU,
    PReLU,
    ReLU,
    Sigmoid,
    SiLU,
    Softmax,
    Softplus,
    Tanh,
)
from opgrad.nn.ops_layers import Arithmetic, Clip, Elementwise, Unary, Where

__all__ = ["ACTIVATIONS", "FUSED", "activate", "activation", "activation_name", "fused", "leaky_relu", "prelu",
           "relu", "softmax"]

#: Keras activation names the importer maps; ``relu``/``sigmoid``/``tanh`` fuse into Dense/Conv.
ACTIVATIONS = ("linear", "relu", "sigmoid", "tanh", "gelu", "leaky_relu", "softmax", "silu", "swish", "elu",
               "softplus", "relu6", "hard_sigmoid", "hard_silu", "hard_swish", "mish", "selu", "softsign")
FUSED = ("relu", "sigmoid", "tanh")
#: Activations that :func:`activate` builds from several opgrad layers (hard_sigmoid: Keras 2's).
_COMPOSITE = ("softmax", "mish", "hard_sigmoid", "selu", "softsign")
#: selu's constants as PyTorch and JAX (which Keras calls) have them; Keras' docs round them to
#: 1.67326324 and 1.05070098, the same float32 numbers.
SELU_ALPHA = 1.6732632423543772848170429916717
SELU_SCALE = 1.0507009873554804934193349852946


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


def _keeping_shape(call: LayerCall, layer: Any, inputs: Tensor | list[Tensor], suffix: str = "") -> Tensor:
    """``layer`` on ``inputs``; its output has the (first) input's Keras shape and layout."""
    first = inputs[0] if isinstance(inputs, list) else inputs
    return call.add(layer, inputs, first.layout, first.keras_shape, suffix=suffix, chw=first.chw)


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
    if name == "selu":  # scale * elu(x, alpha), as torch.nn.functional.selu
        elu = _keeping_shape(call, ELU(SELU_ALPHA), tensor, "elu")
        return _keeping_shape(call, Arithmetic("multiply", operand=SELU_SCALE), elu, name)
    if name == "softsign":  # x / (1 + |x|)
        size = _keeping_shape(call, Unary("abs"), tensor, "abs")
        denominator = _keeping_shape(call, Arithmetic("add", operand=1.0), size, "plus_one")
        return _keeping_shape(call, Elementwise("divide"), [tensor, denominator], name)
    return call.add(_activation_layer(name), tensor, tensor.layout, tensor.keras_shape, suffix=name, chw=tensor.chw)


def _activation_layer(name: str) -> Any:
    """The opgrad layer of Keras activation ``name`` (one of :data:`ACTIVATIONS` but linear and the composites)."""
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
    if name in _COMPOSITE:
        return activate(call, tensor, name)
    return call.add(_activation_layer(name), tensor, tensor.layout, tensor.keras_shape, chw=tensor.chw)


def _number(call: LayerCall, key: str, default: float | None) -> float | None:
    """Config field ``key``: None or a number >= 0 (Keras' ReLU refuses a negative one)."""
    value = call.take(key, default)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
        raise call.unsupported(key, value, "None or a number >= 0" if default is None else "a number >= 0")
    return None if value is None else float(value)


def relu(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    tensor = call.one_input(inputs)
    ceiling = _number(call, "max_value", None)
    threshold, slope = _number(call, "threshold", 0.0), _number(call, "negative_slope", 0.0)
    if threshold:
        return _thresholded_relu(call, tensor, float(threshold), ceiling, float(slope or 0.0))
    if ceiling is not None and not slope:  # ReLU(max_value=6) is MobileNet's relu6
        return call.add(Clip(0.0, float(ceiling)), tensor, tensor.layout, tensor.keras_shape, chw=tensor.chw)
    layer = LeakyReLU(slope) if slope else ReLU()
    out = call.add(layer, tensor, tensor.layout, tensor.keras_shape, chw=tensor.chw)
    if ceiling is None:
        return out
    return call.add(Clip(None, float(ceiling)), out, out.layout, out.keras_shape, suffix="max", chw=out.chw)


def _thresholded_relu(call: LayerCall, x: Tensor, threshold: float, ceiling: float | None, slope: float) -> Tensor:
    """Keras' ReLU with a threshold t: ``clip(x if x > t else 0, 0, max_value) - slope * relu(t - x)``
    (the clip only with a max_value, the last term only with a negative_slope)."""
    above = _keeping_shape(call, Arithmetic("greater", operand=threshold), x, "above")
    kept = _keeping_shape(call, Where(false_value=0.0), [above, x], "kept")
    if ceiling is not None:
        kept = _keeping_shape(call, Clip(0.0, ceiling), kept, "max")
    if not slope:
        return kept
    gap = _keeping_shape(call, Arithmetic("subtract", operand=threshold, reverse=True), x, "below")
    below = _keeping_shape(call, Arithmetic("multiply", operand=slope), _keeping_shape(call, ReLU(), gap, "relu"),
                           "slope")
    return _keeping_shape(call, Elementwise("subtract"), [kept, below], "relu")


def leaky_relu(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    tensor = call.one_input(inputs)
    keras2 = "alpha" in call.config and "negative_slope" not in call.config
    slope = float(call.take("alpha", 0.3) if keras2 else call.take("negative_slope", 0.3))
    return call.add(LeakyReLU(slope), tensor, tensor.layout, tensor.keras_shape, chw=tensor.chw)


def _opgrad_order(tensor: Tensor, alpha: np.ndarray) -> np.ndarray:
    """Keras' per-element ``alpha`` (the input's shape, shared axes of size 1) in the opgrad tensor's order."""
    if tensor.layout == "channels_first":
        return np.transpose(alpha, (2, 0, 1))  # (H, W, C) -> (C, H, W)
    if tensor.layout == "flat_chw" and alpha.size > 1:
        assert tensor.chw is not None
        c, h, w = tensor.chw
        return np.transpose(alpha.reshape(h, w, c), (2, 0, 1)).reshape(-1)
    return alpha


def prelu(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    """``x if x > 0 else alpha * x`` with a learned ``alpha`` of the input's shape, of size 1 on Keras'
    ``shared_axes``: ``nn.PReLU`` where alpha is one slope or one per channel of the opgrad tensor's
    first axis, else ``relu(x) + alpha * min(x, 0)`` with alpha broadcast (the same numbers)."""
    tensor = call.one_input(inputs)
    rank = tensor.keras_rank
    shared = call.take("shared_axes", None)
    axes = [] if shared is None else shared if isinstance(shared, (list, tuple)) else [shared]
    if not all(isinstance(a, int) and not isinstance(a, bool) and 1 <= a <= rank for a in axes):
        raise call.unsupported("shared_axes", shared, f"None or axes 1..{rank} of the {rank + 1}-d input")
    shape = tuple(1 if axis in axes else d for axis, d in enumerate(tensor.keras_shape, start=1))
    alpha = _opgrad_order(tensor, call.weights({"alpha": shape})["alpha"])
    if alpha.size == 1 or alpha.size == alpha.shape[0]:  # one slope, or one per channel (axis 1)
        layer = PReLU(alpha.size)
        out = _keeping_shape(call, layer, tensor)
        call.set_param(layer, "weight", alpha.reshape(-1))
        return out
    positive = _keeping_shape(call, ReLU(), tensor)
    negative = _keeping_shape(call, Clip(None, 0.0), tensor, "negative")
    scale = Arithmetic("multiply", operand_shape=alpha.shape)
    scaled = _keeping_shape(call, scale, negative, "alpha")
    call.set_param(scale, "operand", alpha)
    return _keeping_shape(call, Add(), [positive, scaled], "sum")


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


