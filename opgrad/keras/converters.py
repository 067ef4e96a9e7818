"""One converter per Keras layer class, found by class name in :data:`CONVERTERS`.

A converter reads the config fields it understands (``call.take``/``choose``/``pair``), checks the
input it is given, reads the layer's variables with the shapes the config implies, converts
them to opgrad's layouts (HWIO -> OIHW kernels, ``(in, units)`` -> ``(units, in)`` dense kernels)
and adds the opgrad layers. Anything it does not map is refused with the field and what is
supported, or recorded as a note when it only matters to Keras' own training.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from opgrad.keras.activations import (
    FUSED,
    activate,
    activation,
    activation_name,
    fused,
    leaky_relu,
    prelu,
    relu,
    softmax,
)
from opgrad.keras.files import LayerSpec
from opgrad.keras.graph import Converter, LayerCall, Shape, Tensor
from opgrad.keras.merging import add, average, concatenate, maximum, minimum, multiply, subtract
from opgrad.keras.preprocessing import PREPROCESSING
from opgrad.nn.layers import (
    AvgPool1D,
    AvgPool2D,
    BatchNorm2D,
    Conv1D,
    Conv2D,
    Conv2DTranspose,
    Dense,
    Dropout,
    Embedding,
    Flatten,
    GlobalAvgPool2D,
    LayerNorm,
    MaxPool1D,
    MaxPool2D,
    Rescaling,
    UpSampling2D,
)
from opgrad.nn.ops_layers import GlobalPool2D, Pad, Reduce, Resize, Slice
from opgrad.nn.recurrent import GRU, LSTM
from opgrad.nn.reshaping import Permute, Reshape, ZeroPadding2D

__all__ = ["CONVERTERS"]


def _image(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    tensor = call.one_input(inputs)
    if tensor.layout != "channels_first":
        raise call.fail(f"needs an image input (height, width, channels), got shape {tensor.keras_shape}")
    return tensor


def _image_out(tensor: Tensor) -> Tensor:
    """``tensor`` with its Keras shape ``(H, W, C)`` read off the NCHW opgrad tensor."""
    c, h, w = tensor.sym.shape
    return Tensor(tensor.sym, "channels_first", (h, w, c))


def _padding(call: LayerCall) -> str:
    return str(call.choose("padding", ("valid", "same"), "valid"))


def _use_bias(call: LayerCall) -> bool:
    return bool(call.take("use_bias", True))


# ----- dense and convolutions -----


def dense(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    tensor = call.one_input(inputs)
    if tensor.keras_rank > 1:  # Keras' Dense runs over the last axis: take the values in Keras' order
        tensor = call.to_keras_order(tensor)
    units, use_bias, act = int(call.take("units")), _use_bias(call), activation_name(call)
    call.choose("lora_rank", (None, 0), None)
    features = tensor.keras_shape[-1]
    expected = {"kernel": (features, units), **({"bias": (units,)} if use_bias else {})}
    weights = call.weights(expected)
    kernel = weights["kernel"]
    if tensor.layout == "flat_chw":
        # Keras flattened (H, W, C); the opgrad tensor is flattened (C, H, W): reorder the kernel rows.
        assert tensor.chw is not None
        c, h, w = tensor.chw
        weight = kernel.reshape(h, w, c, units).transpose(3, 2, 0, 1).reshape(units, features)
    else:
        weight = kernel.T
    layer = Dense(units, activation=act if act in FUSED else None, use_bias=use_bias)
    out = call.add(layer, tensor, "keras", (*tensor.keras_shape[:-1], units))
    call.set_param(layer, "weight", weight)
    if use_bias:
        call.set_param(layer, "bias", weights["bias"])
    return call.canonical(out if act in FUSED else activate(call, out, act))


def _conv_common(call: LayerCall) -> dict[str, Any]:
    call.channels_last()
    return {"kernel_size": call.pair("kernel_size"), "strides": call.pair("strides", 1), "padding": _padding(call),
            "dilation_rate": call.pair("dilation_rate", 1)}


def conv2d(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    tensor = _image(call, inputs)
    c = tensor.keras_shape[2]
    common = _conv_common(call)
    filters, groups = int(call.take("filters")), int(call.take("groups", 1))
    use_bias, act = _use_bias(call), activation_name(call)
    call.choose("lora_rank", (None, 0), None)
    if groups < 1 or c % groups or filters % groups:
        raise call.fail(f"groups={groups} does not divide {c} input channels and {filters} filters")
    kh, kw = common["kernel_size"]
    weights = call.weights({"kernel": (kh, kw, c // groups, filters), **({"bias": (filters,)} if use_bias else {})})
    layer = Conv2D(filters, **common, groups=groups, activation=fused(act), use_bias=use_bias)
    out = _image_out(call.add(layer, tensor, "channels_first", (1, 1, filters)))
    call.set_param(layer, "weight", weights["kernel"].transpose(3, 2, 0, 1))  # HWIO -> OIHW
    if use_bias:
        call.set_param(layer, "bias", weights["bias"])
    return activate(call, out, act) if act not in FUSED else out


def depthwise_conv2d(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    tensor = _image(call, inputs)
    c = tensor.keras_shape[2]
    common = _conv_common(call)
    multiplier = int(call.take("depth_multiplier", 1))
    use_bias, act = _use_bias(call), activation_name(call)
    kh, kw = common["kernel_size"]
    filters = c * multiplier
    weights = call.weights({"depthwise_kernel": (kh, kw, c, multiplier), **({"bias": (filters,)} if use_bias else {})})
    layer = Conv2D(filters, **common, groups=c, activation=fused(act), use_bias=use_bias)
    out = _image_out(call.add(layer, tensor, "channels_first", (1, 1, filters)))
    # Keras' output channel c * multiplier + m comes from input channel c: the grouped conv's order.
    weight = weights["depthwise_kernel"].transpose(2, 3, 0, 1).reshape(filters, 1, kh, kw)
    call.set_param(layer, "weight", weight)
    if use_bias:
        call.set_param(layer, "bias", weights["bias"])
    return activate(call, out, act) if act not in FUSED else out


def separable_conv2d(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    """A depthwise convolution then a 1x1 convolution: two opgrad Conv2D layers (the bias on the second)."""
    tensor = _image(call, inputs)
    c = tensor.keras_shape[2]
    common = _conv_common(call)
    filters, multiplier = int(call.take("filters")), int(call.take("depth_multiplier", 1))
    use_bias, act = _use_bias(call), activation_name(call)
    kh, kw = common["kernel_size"]
    weights = call.weights({"depthwise_kernel": (kh, kw, c, multiplier),
                            "pointwise_kernel": (1, 1, c * multiplier, filters),
                            **({"bias": (filters,)} if use_bias else {})})
    depthwise = Conv2D(c * multiplier, **common, groups=c, use_bias=False)
    mid = _image_out(call.add(depthwise, tensor, "channels_first", (1, 1, c * multiplier)))
    call.set_param(depthwise, "weight",
                   weights["depthwise_kernel"].transpose(2, 3, 0, 1).reshape(c * multiplier, 1, kh, kw))
    pointwise = Conv2D(filters, 1, activation=fused(act), use_bias=use_bias)
    out = _image_out(call.add(pointwise, mid, "channels_first", (1, 1, filters), suffix="pointwise"))
    call.set_param(pointwise, "weight", weights["pointwise_kernel"].transpose(3, 2, 0, 1))
    if use_bias:
        call.set_param(pointwise, "bias", weights["bias"])
    return activate(call, out, act) if act not in FUSED else out


def _same_padding_output_size(tensor: Tensor, common: dict[str, Any], output_padding: Any) -> str:
    """Why Conv2DTranspose(padding="same") with an output_padding, even 0, is refused: its output size."""
    pads = [output_padding] * 2 if isinstance(output_padding, int) else output_padding
    given = "the size"
    if isinstance(pads, (list, tuple)) and len(pads) == 2 and all(isinstance(p, int) for p in pads):
        sizes = [(n - 1) * s + ((k - 1) * d + 1) % 2 + p for n, s, k, d, p in
                 zip(tensor.keras_shape[:2], common["strides"], common["kernel_size"], common["dilation_rate"], pads)]
        given = f"{sizes[0]}x{sizes[1]} here"
    plain = "x".join(str(n * s) for n, s in zip(tensor.keras_shape[:2], common["strides"]))
    return (f"output_padding={output_padding!r} is not supported with padding='same': Keras then sizes the output "
            f"(in - 1) * stride + kernel % 2 + output_padding ({given}), where output_padding=None gives "
            f"in * stride ({plain} here), so 0 is not the same as None; supported: output_padding=None with "
            "padding='same', any output_padding with padding='valid'")


def conv2d_transpose(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    tensor = _image(call, inputs)
    c = tensor.keras_shape[2]
    common = _conv_common(call)
    filters = int(call.take("filters"))
    call.choose("groups", (1, None), 1)
    use_bias, act = _use_bias(call), activation_name(call)
    output_padding = call.take("output_padding", None)
    kh, kw = common["kernel_size"]
    (sh, sw), (dh, dw) = common["strides"], common["dilation_rate"]
    if output_padding is not None:
        if common["padding"] == "same":
            raise call.fail(_same_padding_output_size(tensor, common, output_padding))
        extra = call.pair("output_padding") if output_padding != [0, 0] else (0, 0)
    elif common["padding"] == "valid":
        # Keras' "valid" output is in * stride + max(kernel - stride, 0): a kernel smaller than its
        # stride leaves rows that PyTorch's formula does not count.
        extra = tuple(max(s - (d * (k - 1) + 1), 0) for k, s, d in zip((kh, kw), (sh, sw), (dh, dw)))
    else:
        extra = (0, 0)
    weights = call.weights({"kernel": (kh, kw, filters, c), **({"bias": (filters,)} if use_bias else {})})
    layer = Conv2DTranspose(filters, **common, output_padding=extra, activation=fused(act), use_bias=use_bias)
    out = _image_out(call.add(layer, tensor, "channels_first", (1, 1, filters)))
    call.set_param(layer, "weight", weights["kernel"].transpose(3, 2, 0, 1))  # (KH, KW, out, in) -> (in, out, KH, KW)
    if use_bias:
        call.set_param(layer, "bias", weights["bias"])
    return activate(call, out, act) if act not in FUSED else out


# ----- sequences: Keras' (steps, channels), opgrad's 1-D layers' (channels, length) -----


def _sequence(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    tensor = call.to_keras_order(call.one_input(inputs))
    if tensor.keras_rank != 2:
        raise call.fail(f"needs a sequence input (steps, channels), got shape {tensor.keras_shape}")
    call.channels_last()
    return tensor


def _single(call: LayerCall, key: str, default: Any = None) -> int:
    value = call.take(key) if default is None else call.take(key, default)
    items = value if isinstance(value, (list, tuple)) else [value]
    if len(items) != 1 or not isinstance(items[0], int) or isinstance(items[0], bool) or items[0] < 1:
        raise call.unsupported(key, value, "one positive int")
    return int(items[0])


def _on_channels(call: LayerCall, tensor: Tensor, layers: list[Any]) -> Tensor:
    """``layers`` (opgrad's 1-D layers, over ``(channels, length)``) applied to the ``(steps, channels)``
    ``tensor`` between two transposes; the result is in Keras' order again."""
    steps, channels = tensor.keras_shape
    # Between the transposes the opgrad tensor is (channels, length); no other converter sees it.
    x = call.add(Permute((2, 1)), tensor, "keras", (channels, steps), suffix="to_ncl")
    for layer in layers:
        x = call.add(layer, x, "keras", (0,), suffix=layer.kind)
    out_channels, length = x.sym.shape
    return call.add(Permute((2, 1)), x, "keras", (length, out_channels), suffix="to_nlc")


def conv1d(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    tensor = _sequence(call, inputs)
    c = tensor.keras_shape[1]
    k, stride, dilation = _single(call, "kernel_size"), _single(call, "strides", 1), _single(call, "dilation_rate", 1)
    padding = call.choose("padding", ("valid", "same", "causal"), "valid")
    filters, groups = int(call.take("filters")), int(call.take("groups", 1))
    use_bias, act = _use_bias(call), activation_name(call)
    call.choose("lora_rank", (None, 0), None)
    if groups < 1 or c % groups or filters % groups:
        raise call.fail(f"groups={groups} does not divide {c} input channels and {filters} filters")
    weights = call.weights({"kernel": (k, c // groups, filters), **({"bias": (filters,)} if use_bias else {})})
    layers: list[Any] = []
    if padding == "causal":  # zeros before the sequence only: output t sees inputs up to t
        layers.append(Pad([(0, 0), (dilation * (k - 1), 0)]))
    conv = Conv1D(filters, k, stride, "valid" if padding == "causal" else padding, dilation_rate=dilation,
                  groups=groups, activation=fused(act), use_bias=use_bias)
    layers.append(conv)
    out = _on_channels(call, tensor, layers)
    call.set_param(conv, "weight", weights["kernel"].transpose(2, 1, 0))  # (k, in, out) -> (out, in, k)
    if use_bias:
        call.set_param(conv, "bias", weights["bias"])
    return activate(call, out, act) if act not in FUSED else out


def _recurrent_options(call: LayerCall, kind: type[LSTM] | type[GRU], go_backwards: bool = False) -> tuple[int, bool]:
    """``(units, return_sequences)`` of Keras' ``LSTM`` / ``GRU`` config in ``call``, the fields
    opgrad's layer cannot follow refused (``go_backwards`` is the backward half of a Bidirectional)."""
    units = int(call.take("units"))
    call.choose("activation", ("tanh",), "tanh")
    call.choose("recurrent_activation", ("sigmoid",), "sigmoid")
    call.choose("use_bias", (True,), True)
    for flag in ("return_state", "stateful"):
        call.choose(flag, (False,), False)
    call.choose("go_backwards", (go_backwards,), False)
    call.take("unroll", False)  # how Keras runs the loop; opgrad always unrolls it
    for key in ("dropout", "recurrent_dropout"):
        if call.take(key, 0.0):
            call.note(f"{key} is ignored: it only acts while training in Keras")
    call.take("unit_forget_bias", True)  # an initializer's choice; the weights are loaded
    call.take("zero_output_for_mask", False)  # what masked steps output; a masked input is refused
    if kind is GRU:
        call.choose("reset_after", (True,), True)
    return units, bool(call.take("return_sequences", False))


def _recurrent_weights(kind: type[LSTM] | type[GRU], features: int, units: int, suffix: str = "") -> dict[str, Shape]:
    """The variables of one Keras recurrent layer, named for ``suffix``'s direction."""
    gates = 4 if kind is LSTM else 3
    return {f"kernel{suffix}": (features, gates * units), f"recurrent_kernel{suffix}": (units, gates * units),
            f"bias{suffix}": (2, gates * units) if kind is GRU else (gates * units,)}


def _set_recurrent_weights(call: LayerCall, layer: LSTM | GRU, weights: Mapping[str, np.ndarray],
                           suffix: str = "") -> None:
    """Keras' kernels transposed into ``layer``'s ``suffix`` direction: GRU's gate blocks z, r, h
    reordered to PyTorch's r, z, n with its two bias rows; an LSTM's one bias as ``bias_ih``."""
    kernel, recurrent, bias = (weights[f"kernel{suffix}"].T, weights[f"recurrent_kernel{suffix}"].T,
                               weights[f"bias{suffix}"])
    if isinstance(layer, GRU):
        units = layer.units
        order = np.concatenate([np.arange(units) + block * units for block in (1, 0, 2)])
        kernel, recurrent, bias = kernel[order], recurrent[order], bias[:, order]
        call.set_param(layer, f"bias_hh{suffix}", np.ascontiguousarray(bias[1]))
        bias = bias[0]
    for name, value in (("weight_ih", kernel), ("weight_hh", recurrent), ("bias_ih", bias)):
        call.set_param(layer, f"{name}{suffix}", np.ascontiguousarray(value))


def _recurrent(kind: type[LSTM] | type[GRU]) -> Converter:
    """Keras' ``LSTM`` / ``GRU`` as opgrad's (PyTorch's formulas); Keras' LSTM has one bias per
    gate, so its opgrad twin has no recurrent bias (a second one that always adds to the first
    would train the sum at twice Keras' rate)."""

    def convert(call: LayerCall, inputs: list[Tensor]) -> Tensor:
        tensor = _sequence(call, inputs)
        call.refuse_mask(inputs, "it skips the masked steps")
        steps, features = tensor.keras_shape
        units, sequences = _recurrent_options(call, kind)
        weights = call.weights(_recurrent_weights(kind, features, units))
        layer = kind(units, return_sequences=sequences, recurrent_bias=kind is GRU)
        out = call.add(layer, tensor, "keras", (steps, units) if sequences else (units,))
        _set_recurrent_weights(call, layer, weights)
        return out

    return convert


def bidirectional(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    """``Bidirectional(LSTM(...))`` / ``(GRU(...))`` with ``merge_mode="concat"``: opgrad's layer with
    ``bidirectional=True``, the forward layer's weights and the backward one's as ``_reverse``."""
    tensor = _sequence(call, inputs)
    call.refuse_mask(inputs, "it skips the masked steps")
    call.choose("merge_mode", ("concat",), "concat")
    halves = [call.take("layer"), call.take("backward_layer", None)]
    kinds: dict[str, type[LSTM] | type[GRU]] = {"LSTM": LSTM, "GRU": GRU}
    options = []
    for half, backward in zip(halves, (False, True)):
        if half is None:  # Keras builds the backward half from the forward one's config
            continue
        class_name = half.get("class_name") if isinstance(half, Mapping) else None
        if class_name not in kinds or not isinstance(half.get("config"), Mapping):
            raise call.unsupported("layer", class_name, "LSTM, GRU")
        inner = LayerCall(call.builder, LayerSpec(f"{call.spec.name}/{'backward' if backward else 'forward'}",
                                                  str(class_name), dict(half["config"])))
        options.append((kinds[str(class_name)], *_recurrent_options(inner, kinds[str(class_name)], backward)))
        inner.finish()
    if len(set(options)) != 1:
        raise call.fail(f"its forward and backward layers differ ({options}); opgrad's bidirectional layer runs "
                        "one kind and size both ways")
    kind, units, sequences = options[0]
    steps, features = tensor.keras_shape
    weights = call.weights({**_recurrent_weights(kind, features, units),
                            **_recurrent_weights(kind, features, units, "_reverse")})
    layer = kind(units, return_sequences=sequences, bidirectional=True, recurrent_bias=kind is GRU)
    out = call.add(layer, tensor, "keras", (steps, 2 * units) if sequences else (2 * units,))
    for suffix in ("", "_reverse"):
        _set_recurrent_weights(call, layer, weights, suffix)
    return out


def time_distributed(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    """``TimeDistributed(Dense(...))``: Keras' Dense already runs over the last axis, so it is that
    Dense (named after the wrapper, whose weight group holds the Dense's variables)."""
    inner = call.take("layer")
    class_name = inner.get("class_name") if isinstance(inner, Mapping) else None
    if class_name != "Dense" or not isinstance(inner.get("config"), Mapping):
        raise call.unsupported("layer", class_name, "Dense (the importer reads TimeDistributed of a Dense only)")
    if call.one_input(inputs).keras_rank < 2:
        raise call.fail(f"needs an input with a time axis, got shape {inputs[0].keras_shape}")
    dense_call = LayerCall(call.builder, LayerSpec(call.spec.name, "Dense", dict(inner["config"])))
    out = dense(dense_call, inputs)
    dense_call.finish()
    return out


def _pool1d(kind: type[MaxPool1D] | type[AvgPool1D]) -> Converter:
    def convert(call: LayerCall, inputs: list[Tensor]) -> Tensor:
        tensor = _sequence(call, inputs)
        size = _single(call, "pool_size", 2)
        stride = size if call.take("strides", None) is None else _single(call, "strides")
        return _on_channels(call, tensor, [kind(size, strides=stride, padding=_padding(call))])
    return convert


def _global_pooling1d(op: str) -> Converter:
    def convert(call: LayerCall, inputs: list[Tensor]) -> Tensor:
        if op == "mean":  # Keras 2 passes the mask without writing it in the file
            call.refuse_mask(inputs, "it averages over the unmasked steps only")
        tensor = _sequence(call, inputs)
        keepdims = bool(call.take("keepdims", False))
        c = tensor.keras_shape[1]
        # Over Keras' steps axis, which the (steps, channels) tensor holds as its first example axis.
        return call.add(Reduce(op, [1], keepdims=keepdims), tensor, "keras", (1, c) if keepdims else (c,))
    return convert


# ----- pooling and resizing -----


def _pool(kind: type[MaxPool2D] | type[AvgPool2D]) -> Converter:
    def convert(call: LayerCall, inputs: list[Tensor]) -> Tensor:
        tensor = _image(call, inputs)
        call.channels_last()
        size = call.pair("pool_size", 2)
        strides = size if call.take("strides", None) is None else call.pair("strides")
        layer = kind(size, strides=strides, padding=_padding(call))
        return _image_out(call.add(layer, tensor, "channels_first", tensor.keras_shape))
    return convert


def global_average_pooling2d(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    tensor = _image(call, inputs)
    call.channels_last()
    keepdims = bool(call.take("keepdims", False))
    c = tensor.keras_shape[2]
    out = call.add(GlobalAvgPool2D(), tensor, "keras", (c,))
    if keepdims:
        return call.add(Reshape((c, 1, 1)), out, "channels_first", (1, 1, c), suffix="keepdims")
    return out


def global_max_pooling2d(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    tensor = _image(call, inputs)
    call.channels_last()
    keepdims = bool(call.take("keepdims", False))
    c = tensor.keras_shape[2]
    out = call.add(GlobalPool2D("max"), tensor, "channels_first", (1, 1, c))
    return out if keepdims else call.add(Flatten(), out, "keras", (c,), suffix="drop_axes")


def upsampling2d(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    tensor = _image(call, inputs)
    call.channels_last()
    (a, b), interpolation = call.pair("size", 2), call.choose("interpolation", ("nearest", "bilinear"), "nearest")
    h, w, c = tensor.keras_shape
    # Keras repeats rows a times and columns b times (nearest), or interpolates to (a h, b w) with
    # half-pixel centers: PyTorch's interpolate (legacy nearest, bilinear without align_corners).
    layer = UpSampling2D(a, interpolation=interpolation) if a == b else Resize((h * a, w * b), method=interpolation)
    return call.add(layer, tensor, "channels_first", (h * a, w * b, c))


def _crop_pairs(call: LayerCall) -> tuple[tuple[int, int], tuple[int, int]]:
    """Keras' ``cropping``: an int, ``(rows, cols)`` or ``((top, bottom), (left, right))``, as the last."""
    value = call.take("cropping", ((0, 0), (0, 0)))

    def is_count(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    axes = [value, value] if is_count(value) else value
    if isinstance(axes, (list, tuple)) and len(axes) == 2:
        pairs = [[a, a] if is_count(a) else a for a in axes]
        if all(isinstance(p, (list, tuple)) and len(p) == 2 and all(map(is_count, p)) for p in pairs):
            (top, bottom), (left, right) = pairs
            return (int(top), int(bottom)), (int(left), int(right))
    raise call.unsupported("cropping", value, "an int, (rows, cols) or ((top, bottom), (left, right)), all >= 0")


def cropping2d(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    tensor = _image(call, inputs)
    call.channels_last()
    (top, bottom), (left, right) = _crop_pairs(call)
    h, w, c = tensor.keras_shape
    if top + bottom >= h or left + right >= w:
        raise call.fail(f"cropping ({top}, {bottom}), ({left}, {right}) leaves nothing of the {h}x{w} image")
    layer = Slice([None, top, left], [None, h - bottom, w - right])
    return call.add(layer, tensor, "channels_first", (h - top - bottom, w - left - right, c))


def zero_padding2d(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    tensor = _image(call, inputs)
    call.channels_last()
    padding = call.take("padding", 1)
    try:
        layer = ZeroPadding2D(padding)
    except ValueError as exc:
        raise call.fail(str(exc)) from None
    (top, bottom), (left, right) = layer.padding
    h, w, c = tensor.keras_shape
    return call.add(layer, tensor, "channels_first", (h + top + bottom, w + left + right, c))


# ----- normalization -----


def _axes(call: LayerCall, tensor: Tensor, default: Any) -> list[int]:
    value = call.take("axis", default)
    items = value if isinstance(value, list) else [value]
    rank = tensor.keras_rank + 1
    if not items or not all(isinstance(a, int) and -rank <= a < rank and a % rank for a in items):
        raise call.unsupported("axis", value, f"non-batch axes of the {rank}-d input")
    return sorted(a % rank for a in items)


def batch_normalization(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    tensor = call.to_keras_order(call.one_input(inputs)) if inputs[0].layout == "flat_chw" else call.one_input(inputs)
    if tensor.keras_rank == 2:  # a sequence (steps, channels): Keras' Conv1D output
        tensor = call.to_keras_order(tensor)
    axes = _axes(call, tensor, -1)
    if tensor.keras_rank not in (1, 2, 3) or axes != [tensor.keras_rank]:
        raise call.fail(f"axis {axes} of input {tensor.keras_shape}: supported: the channel (last) axis of an "
                        "image, a sequence or flat features")
    momentum, epsilon = float(call.take("momentum", 0.99)), float(call.take("epsilon", 1e-3))
    center, scale = bool(call.take("center", True)), bool(call.take("scale", True))
    call.choose("renorm", (False,), False)
    call.take("renorm_momentum", None), call.take("renorm_clipping", None)  # used by renorm only
    if call.take("synchronized", False):
        call.note("synchronized is ignored: it only changes how Keras trains on several devices")
    c = tensor.keras_shape[-1]
    expected = {**({"gamma": (c,)} if scale else {}), **({"beta": (c,)} if center else {}),
                "moving_mean": (c,), "moving_variance": (c,)}
    weights = call.weights(expected)
    # Keras keeps `momentum` of the old statistic, PyTorch (and opgrad) weights the new batch by it.
    layer = BatchNorm2D(momentum=1.0 - momentum, epsilon=epsilon)
    if tensor.keras_rank == 2:  # over (channels, length) between two transposes, as the 1-D layers
        out = _on_channels(call, tensor, [layer])
    else:
        out = call.add(layer, tensor, tensor.layout, tensor.keras_shape)
    call.set_param(layer, "weight", weights.get("gamma", np.ones(c)))
    call.set_param(layer, "bias", weights.get("beta", np.zeros(c)))
    call.set_buffer(layer, "running_mean", weights["moving_mean"])
    call.set_buffer(layer, "running_var", weights["moving_variance"])
    if not (center and scale):
        call.note("has no " + " or ".join(n for n, on in (("gamma", scale), ("beta", center)) if not on)
                  + ": opgrad's BatchNorm2D starts it at its neutral value and trains it")
    return out


def layer_normalization(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    tensor = call.to_keras_order(inputs[0]) if call.one_input(inputs).layout == "flat_chw" else inputs[0]
    axes = _axes(call, tensor, -1)
    epsilon = float(call.take("epsilon", 1e-3))
    center, scale = bool(call.take("center", True)), bool(call.take("scale", True))
    call.choose("rms_scaling", (False,), False)
    rank = tensor.keras_rank
    if axes != list(range(axes[0], rank + 1)):
        raise call.unsupported("axis", axes, "the last axes of the input, e.g. -1")
    shape = tuple(tensor.keras_shape[a - 1] for a in axes)
    weights = call.weights({**({"gamma": shape} if scale else {}), **({"beta": shape} if center else {})})
    gamma, beta = weights.get("gamma", np.ones(shape)), weights.get("beta", np.zeros(shape))
    work = tensor
    if tensor.layout == "channels_first" and axes == [1, 2, 3]:
        gamma, beta = gamma.transpose(2, 0, 1), beta.transpose(2, 0, 1)  # normalized (H, W, C) -> (C, H, W)
        first = 1
    elif tensor.layout == "channels_first":
        work, first = call.to_keras_order(tensor), axes[0]  # channels only: normalize NHWC's last axis
    else:
        first = axes[0]
    layer = LayerNorm(axis=first, epsilon=epsilon)
    out = call.add(layer, work, work.layout, work.keras_shape)
    call.set_param(layer, "weight", gamma)
    call.set_param(layer, "bias", beta)
    return call.canonical(out)


# ----- shapes -----


def flatten(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    tensor = call.one_input(inputs)
    call.channels_last()
    size = int(np.prod(tensor.keras_shape))
    if tensor.layout == "channels_first":
        h, w, c = tensor.keras_shape
        return call.add(Flatten(), tensor, "flat_chw", (size,), chw=(c, h, w))
    if tensor.keras_rank == 1:
        return tensor
    return call.add(Flatten(), tensor, "keras", (size,))


def reshape(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    tensor = call.to_keras_order(call.one_input(inputs))
    target = call.take("target_shape")
    try:
        layer = Reshape(target)
    except (TypeError, ValueError) as exc:
        raise call.fail(str(exc)) from None
    out = call.add(layer, tensor, "keras", (1,))
    return call.canonical(Tensor(out.sym, "keras", out.sym.shape))


def permute(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    tensor = call.to_keras_order(call.one_input(inputs))
    try:
        layer = Permute(call.take("dims"))
    except (TypeError, ValueError) as exc:
        raise call.fail(str(exc)) from None
    out = call.add(layer, tensor, "keras", (1,))
    return call.canonical(Tensor(out.sym, "keras", out.sym.shape))


def embedding(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    tensor = call.one_input(inputs)
    if tensor.sym.dtype != "int64":
        raise call.fail("needs integer token ids: give its keras.Input dtype='int32' or 'int64'")
    input_dim, output_dim = int(call.take("input_dim")), int(call.take("output_dim"))
    mask_zero = bool(call.take("mask_zero", False))
    weights = call.weights({"embeddings": (input_dim, output_dim)})
    layer = Embedding(input_dim, output_dim)
    out = call.add(layer, tensor, "keras", (*tensor.keras_shape, output_dim))
    call.set_param(layer, "weight", weights["embeddings"])
    if not mask_zero:
        return out
    # The layers that would apply the mask refuse a tensor that carries it, so an import that
    # succeeds computes what Keras does.
    call.note("mask_zero is ignored: no layer of the model applies the mask, so the outputs are Keras'")
    return dataclasses.replace(out, keras_mask=call.spec.name)


# ----- regularization and rescaling -----


def dropout(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    tensor = call.one_input(inputs)
    rate = float(call.take("rate"))
    if call.take("noise_shape", None) is not None:
        call.note("noise_shape is ignored: opgrad's Dropout draws one mask value per element while training")
    return call.add(Dropout(rate), tensor, tensor.layout, tensor.keras_shape, chw=tensor.chw)


def rescaling(call: LayerCall, inputs: list[Tensor]) -> Tensor:
    tensor = call.one_input(inputs)
    scale, offset = call.take("scale", 1.0), call.take("offset", 0.0)
    for key, value in (("scale", scale), ("offset", offset)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise call.unsupported(key, value, "one number (not one per channel)")
    return call.add(Rescaling(scale, offset), tensor, tensor.layout, tensor.keras_shape, chw=tensor.chw)


def _keeps_mask(convert: Converter) -> Converter:
    """``convert`` of a Keras layer that supports masking: its output carries its input's mask."""
    def keeping(call: LayerCall, inputs: list[Tensor]) -> Tensor:
        out = convert(call, inputs)
        mask = inputs[0].keras_mask if inputs else None
        return out if mask is None else dataclasses.replace(out, keras_mask=mask)
    return keeping


CONVERTERS: dict[str, Converter] = {
    "Activation": _keeps_mask(activation),
    "Add": add,
    "Average": average,
    "AveragePooling1D": _pool1d(AvgPool1D),
    "AveragePooling2D": _pool(AvgPool2D),
    "BatchNormalization": _keeps_mask(batch_normalization),
    "Bidirectional": bidirectional,
    "Concatenate": concatenate,
    "Conv1D": conv1d,
    "Cropping2D": cropping2d,
    "Conv2D": conv2d,
    "Conv2DTranspose": conv2d_transpose,
    "DepthwiseConv2D": depthwise_conv2d,
    "Dense": _keeps_mask(dense),
    "Dropout": _keeps_mask(dropout),
    "Embedding": embedding,
    "Flatten": flatten,
    "GlobalAveragePooling1D": _global_pooling1d("mean"),
    "GlobalAveragePooling2D": global_average_pooling2d,
    "GlobalMaxPooling1D": _global_pooling1d("max"),
    "GlobalMaxPooling2D": global_max_pooling2d,
    "GRU": _recurrent(GRU),
    "LSTM": _recurrent(LSTM),
    "LayerNormalization": _keeps_mask(layer_normalization),
    "LeakyReLU": _keeps_mask(leaky_relu),
    "MaxPooling1D": _pool1d(MaxPool1D),
    "MaxPooling2D": _pool(MaxPool2D),
    "Maximum": maximum,
    "Minimum": minimum,
    "Multiply": multiply,
    "PReLU": _keeps_mask(prelu),
    "Permute": permute,
    "ReLU": _keeps_mask(relu),
    "Rescaling": _keeps_mask(rescaling),
    "Reshape": reshape,
    "SeparableConv2D": separable_conv2d,
    "Softmax": softmax,
    "Subtract": subtract,
    "TimeDistributed": _keeps_mask(time_distributed),
    "UpSampling2D": upsampling2d,
    "ZeroPadding2D": zero_padding2d,
    **PREPROCESSING,
}
