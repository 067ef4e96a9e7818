"""Keras' preprocessing and noise layers: what they compute when the model predicts.

The augmentation layers (``RandomFlip``, ``RandomRotation``, ...) and the noise layers
(``GaussianNoise``, ``GaussianDropout``, ``AlphaDropout``) change their input only while Keras
trains (``training=True``); at inference each returns its input as it is. The importer leaves them
out, with a note: opgrad does not apply them when the imported model trains.

``Normalization`` is fixed arithmetic with its adapted (or given) ``mean`` and ``variance``:
``(x - mean) / max(sqrt(variance), 1e-7)`` (``1e-7``: ``keras.config.epsilon()``'s default), two
opgrad ``Arithmetic`` layers with fixed operands, which Keras does not train either.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from opgrad.keras.graph import Converter, LayerCall, Tensor
from opgrad.nn.ops_layers import Arithmetic

__all__ = ["PREPROCESSING"]

#: Keras' default ``keras.config.epsilon()``, Normalization's floor on the standard deviation.
EPSILON = 1e-7

#: Layers that return their input at inference, with the config fields that only act in training.
_IDENTITY_AT_INFERENCE: dict[str, tuple[str, ...]] = {
    "RandomFlip": ("mode", "data_format"),
    "RandomRotation": ("factor", "fill_mode", "fill_value", "interpolation", "data_format"),
    "RandomZoom": ("height_factor", "width_factor", "fill_mode", "fill_value", "interpolation", "data_format"),
    "RandomTranslation": ("height_factor", "width_factor", "fill_mode", "fill_value", "interpolation",
                          "data_format"),
    "RandomContrast": ("factor", "value_range", "data_format"),
    "RandomBrightness": ("factor", "value_range", "data_format"),
    "GaussianNoise": ("stddev",),
    "GaussianDropout": ("rate",),
    "AlphaDropout": ("rate", "noise_shape"),
}


def _float_input(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    tensor = call.one_input(inputs)
    if tensor.sym.dtype != "float":
        raise call.fail("needs a float input (Keras casts an integer one to float, which the importer does not)")
    return tensor


def _identity_at_inference(fields: tuple[str, ...]) -> Converter:
    def convert(call: LayerCall, inputs: list[Tensor]) -> Tensor:
        tensor = _float_input(call, inputs)
        for key in fields:
            call.take(key, None)
        call.note("left out: Keras applies it only while training, and opgrad does not apply it when the imported "
                  "model trains")
        return tensor

    return convert


def random_crop(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    """``RandomCrop`` to the input's own size, which returns its input at inference."""
    tensor = _float_input(call, inputs)
    call.take("data_format", None)
    size = (call.take("height"), call.take("width"))
    if tensor.keras_rank != 3 or tuple(tensor.keras_shape[:2]) != size:
        raise call.fail(f"crops {tensor.keras_shape} to {size[0]}x{size[1]}; at inference Keras does not crop "
                        "(its torch backend returns the image whole, where the model's output shape says "
                        f"{size[0]}x{size[1]}), so the importer supports only a RandomCrop to the input's own size; "
                        "use CenterCrop or Resizing for a fixed crop")
    call.note("left out: it crops only while Keras trains, and opgrad does not apply it when the imported model "
              "trains")
    return tensor


def _keras_shaped(call: LayerCall, key: str, values: Any, keep: list[int], shape: tuple[int, ...]) -> np.ndarray:
    """Normalization's ``values`` (a number, or one per kept axis' entries, aligned to the last kept
    axes as Keras reshapes them) broadcast to ``shape``: the per-example shape, 1 off the kept axes."""
    array = np.asarray(values, dtype=np.float32)
    if array.ndim > len(keep):
        raise call.unsupported(key, values, f"a number or an array of rank <= {len(keep)} (the normalized axes)")
    expanded = [1] * len(shape)
    for i in range(1, array.ndim + 1):
        expanded[keep[-i] - 1] = array.shape[-i]
    try:
        return np.broadcast_to(array.reshape(expanded), shape)
    except ValueError:
        raise call.fail(f"{key} of shape {array.shape} does not fit the normalized axes {keep} of input "
                        f"{shape}") from None


def normalization(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    """``(x - mean) / max(sqrt(variance), 1e-7)``, or with ``invert`` ``mean + x * max(sqrt(variance), 1e-7)``."""
    tensor = _float_input(call, inputs)
    if tensor.layout == "flat_chw":
        tensor = call.to_keras_order(tensor)
    axis = call.take("axis", -1)
    axes = [] if axis is None else axis if isinstance(axis, list) else [axis]
    rank = tensor.keras_rank + 1
    if not all(isinstance(a, int) and not isinstance(a, bool) and -rank <= a < rank and a % rank for a in axes):
        raise call.unsupported("axis", axis, f"None or non-batch axes of the {rank}-d input")
    keep = sorted({a % rank for a in axes})
    shape = tuple(tensor.keras_shape[a - 1] if a in keep else 1 for a in range(1, rank))
    invert = bool(call.take("invert", False))
    given_mean, given_variance = call.take("mean", None), call.take("variance", None)
    if (given_mean is None) != (given_variance is None):
        raise call.fail("its config gives one of mean and variance; Keras takes both or neither")
    if given_mean is None:
        stats = tuple(tensor.keras_shape[a - 1] for a in keep)
        weights = call.weights({"mean": stats, "variance": stats, "count": ()}, counts=("count",))
        given_mean, given_variance = weights["mean"].reshape(stats), weights["variance"].reshape(stats)
    else:
        call.weights({})
    mean = _keras_shaped(call, "mean", given_mean, keep, shape)
    variance = _keras_shaped(call, "variance", given_variance, keep, shape)
    if np.any(variance < 0):
        raise call.fail("its variance has negative entries")
    std = np.maximum(np.sqrt(variance), np.float32(EPSILON))
    if tensor.layout == "channels_first":  # (H, W, C) operands for the NCHW tensor: (C, H, W)
        mean, std = mean.transpose(2, 0, 1), std.transpose(2, 0, 1)
    steps = [("multiply", std, "scale"), ("add", mean, "shift")] if invert else \
        [("subtract", mean, "center"), ("divide", std, "scale")]
    out = tensor
    for op, operand, suffix in steps:
        out = call.add(Arithmetic(op, operand=operand), out, out.layout, out.keras_shape, suffix=suffix, chw=out.chw)
    return out


#: Converters of the preprocessing and noise layers, by Keras class name.
PREPROCESSING: dict[str, Converter] = {
    **{name: _identity_at_inference(fields) for name, fields in _IDENTITY_AT_INFERENCE.items()},
    "Normalization": normalization,
    "RandomCrop": random_crop,
}
