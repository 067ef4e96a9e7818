"""``save``: an ``opgrad.nn.Model`` with its weights -> a standard ONNX graph (opset 17, or 20 for GELU).

One emitter per layer kind, found in :data:`EMITTERS` (the mirror of the import table): it
writes the ONNX nodes that compute the layer in inference mode (dropout off, BatchNorm with
its running statistics). Parameters and buffers become initializers named like opgrad's
(``conv1.weight``), so an exported and re-imported model keeps them; the batch axis is the
symbolic dimension ``N``. The graph passes ``onnx.checker`` before it is written atomically.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from opgrad.nn.layers import Layer
from opgrad.nn.model import Model
from opgrad.onnx.converters.activations import UNARY_NODES
from opgrad.onnx.table import OnnxError, require_onnx

__all__ = ["EMITTERS", "GELU_OPSET", "OPSET", "OPSETS", "emitter", "save", "to_onnx", "uses_gelu"]

#: The default-domain opset written (LayerNormalization needs 17); a model with GELU gets 20, the
#: first with a Gelu node (at 17 it is written as its erf formula, which onnxruntime runs but
#: opgrad's importer does not read back).
OPSET = 17
GELU_OPSET = 20
OPSETS = range(17, 21)
INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
Shape = tuple[int, ...]


class GraphBuilder:
    """Collects nodes and initializers; every name it hands out is unique."""

    def __init__(self, onnx: Any, dtype: np.dtype, opset: int) -> None:
        self.onnx, self.dtype, self.opset = onnx, dtype, opset
        #: The ONNX element type of the model's float data.
        self.float_type = onnx.TensorProto.DOUBLE if dtype == np.float64 else onnx.TensorProto.FLOAT
        self.nodes: list[Any] = []
        self.initializers: dict[str, Any] = {}
        self.taken: set[str] = set()
        self.weights: dict[str, np.ndarray] = {}

    def fresh(self, hint: str) -> str:
        name, n = hint, 1
        while name in self.taken:
            n += 1
            name = f"{hint}_{n}"
        self.taken.add(name)
        return name

    def constant(self, value: Any, hint: str, dtype: Any = None) -> str:
        """A fixed value as a ``Constant`` node: initializers are the weights, which an importer may train."""
        array = np.asarray(value, dtype=self.dtype if dtype is None else dtype)
        name = self.fresh(hint)
        tensor = self.onnx.numpy_helper.from_array(array, name)
        self.nodes.append(self.onnx.helper.make_node("Constant", [], [name], name=self.fresh(f"{hint}_const"),
                                                     value=tensor))
        return name

    def weight(self, layer: Layer, local: str, arrange: Callable[[np.ndarray], np.ndarray] | None = None) -> str:
        """The initializer of a layer's weight, as ``arrange`` lays it out where given; a weight tied
        to another layer's (``Dense(weight_from=...)``) is that layer's initializer, or laid out anew."""
        tied = layer.tied_params().get(local)
        if tied is not None:
            owner, owned = tied
            if arrange is None:
                return self.weight(owner, owned)
            return self.derived_weight(layer, local, arrange(np.asarray(self.weights[f"{owner.name}.{owned}"])))
        name = f"{layer.name}.{local}"
        if name not in self.initializers:
            self.taken.add(name)
            array = np.asarray(self.weights[name], dtype=self.dtype)
            array = array if arrange is None else np.ascontiguousarray(arrange(array))
            self.initializers[name] = self.onnx.numpy_helper.from_array(array, name)
        return name

    def derived_weight(self, layer: Layer, name: str, array: np.ndarray) -> str:
        """An initializer ``<layer>.<name>`` holding ``array``, made from the layer's weights in
        another layout (ONNX's LSTM directions stacked, an attention projection cut from its
        stacked weight)."""
        full = f"{layer.name}.{name}"
        self.taken.add(full)
        self.initializers[full] = self.onnx.numpy_helper.from_array(np.ascontiguousarray(array, dtype=self.dtype), full)
        return full

    def node(self, op_type: str, inputs: list[str], output: str | None = None, hint: str = "", **attrs: Any) -> str:
        out = output or self.fresh(f"{hint or op_type}_out")
        self.nodes.append(self.onnx.helper.make_node(op_type, inputs, [out], name=self.fresh(hint or op_type),
                                                     **attrs))
        return out


#: ``(builder, layer, input names, per-example input shapes, output name) -> None``.
Emitter = Callable[[GraphBuilder, Any, list[str], list[Shape], str], None]
#: layer kind -> the function that writes its ONNX nodes.
EMITTERS: dict[str, Emitter] = {}


def emitter(*kinds: str) -> Callable[[Emitter], Emitter]:
    def register(fn: Emitter) -> Emitter:
        for kind in kinds:
            EMITTERS[kind] = fn
        return fn

    return register


def _activation(b: GraphBuilder, x: str, activation: str | None, out: str, hint: str) -> None:
    if activation is None:
        b.node("Identity", [x], out, hint)
    elif activation == "relu":
        b.node("Relu", [x], out, hint)
    elif activation == "leaky_relu":
        b.node("LeakyRelu", [x], out, hint, alpha=0.01)
    elif activation == "sigmoid":
        b.node("Sigmoid", [x], out, hint)
    elif activation == "tanh":
        b.node("Tanh", [x], out, hint)
    elif activation == "gelu":
        _gelu(b, x, "none", out, hint)
    elif activation == "silu":
        b.node("Mul", [x, b.node("Sigmoid", [x], hint=hint)], out, hint)
    elif activation == "elu":
        b.node("Elu", [x], out, hint, alpha=1.0)
    elif activation == "softplus":
        b.node("Softplus", [x], out, hint)
    elif activation == "relu6":
        b.node("Clip", [x, b.constant(0.0, f"{hint}.min"), b.constant(6.0, f"{hint}.max")], out, hint)
    elif activation == "hard_sigmoid":
        b.node("HardSigmoid", [x], out, hint, alpha=1.0 / 6.0, beta=0.5)
    elif activation == "hard_swish":
        b.node("HardSwish", [x], out, hint)
    else:
        raise OnnxError(f"activation {activation!r} has no ONNX export")


def _gelu(b: GraphBuilder, x: str, approximate: str, out: str, hint: str) -> None:
    if b.opset >= GELU_OPSET:
        b.node("Gelu", [x], out, hint, approximate=approximate)
        return
    # Before opset 20 there is no Gelu node: the formula, as PyTorch exports it.
    half = b.constant(0.5, f"{hint}.half")
    one = b.constant(1.0, f"{hint}.one")
    if approximate == "tanh":
        cube = b.node("Mul", [x, b.node("Mul", [x, x], hint=hint)], hint=hint)
        inner = b.node("Add", [x, b.node("Mul", [cube, b.constant(0.044715, f"{hint}.c")], hint=hint)], hint=hint)
        scaled = b.node("Mul", [inner, b.constant(math.sqrt(2.0 / math.pi), f"{hint}.k")], hint=hint)
        gate = b.node("Tanh", [scaled], hint=hint)
    else:
        gate = b.node("Erf", [b.node("Div", [x, b.constant(math.sqrt(2.0), f"{hint}.sqrt2")], hint=hint)], hint=hint)
    b.node("Mul", [b.node("Mul", [x, half], hint=hint), b.node("Add", [gate, one], hint=hint)], out, hint)


@emitter("dense")
def _dense(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    if len(shapes[0]) > 1:  # rows of features: MatMul broadcasts over the leading axes, Gemm does not
        final = None if layer.activation else out
        y = b.node("MatMul", [x[0], b.weight(layer, "weight", np.transpose)], None if layer.use_bias else final,
                   layer.name)
        if layer.use_bias:
            y = b.node("Add", [y, b.weight(layer, "bias")], final, layer.name)
        if layer.activation:
            _activation(b, y, layer.activation, out, layer.name)
        return
    inputs = [x[0], b.weight(layer, "weight")] + ([b.weight(layer, "bias")] if layer.use_bias else [])
    y = b.node("Gemm", inputs, None if layer.activation else out, layer.name, transB=1)
    if layer.activation:
        _activation(b, y, layer.activation, out, layer.name)


@emitter("conv")
def _conv(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    (top, bottom), (left, right) = layer.pads(shapes[0][1], shapes[0][2])
    inputs = [x[0], b.weight(layer, "weight")] + ([b.weight(layer, "bias")] if layer.use_bias else [])
    y = b.node("Conv", inputs, None if layer.activation else out, layer.name, kernel_shape=list(layer.kernel_size),
               strides=list(layer.strides), dilations=list(layer.dilation_rate), group=layer.groups,
               pads=[top, left, bottom, right])
    if layer.activation:
        _activation(b, y, layer.activation, out, layer.name)


@emitter("lstm", "gru")
def _recurrent(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    """ONNX's LSTM / GRU, sequence first (onnxruntime runs no other layout): the input transposed in
    and the outputs out; the gate blocks reordered from PyTorch's (i, f, g, o / r, z, n) to ONNX's
    (i, o, f, c / z, r, h), each direction's input and recurrent biases side by side (a missing
    recurrent bias as zeros), and GRU with ``linear_before_reset=1``, PyTorch's form."""
    lstm, units = layer.kind == "lstm", layer.units
    blocks = (0, 3, 1, 2) if lstm else (1, 0, 2)

    def onnx_order(array: np.ndarray) -> np.ndarray:
        return np.concatenate([array[k * units:(k + 1) * units] for k in blocks])

    def param(local: str) -> np.ndarray:
        return np.asarray(b.weights[f"{layer.name}.{local}"])

    weights, recurrent, biases = [], [], []
    for suffix in layer.directions:
        weights.append(onnx_order(param(f"weight_ih{suffix}")))
        recurrent.append(onnx_order(param(f"weight_hh{suffix}")))
        bias_ih = param(f"bias_ih{suffix}")
        bias_hh = param(f"bias_hh{suffix}") if layer.recurrent_bias else np.zeros_like(bias_ih)
        biases.append(np.concatenate([onnx_order(bias_ih), onnx_order(bias_hh)]))
    length, directions = shapes[0][0], len(layer.directions)
    sequence_first = b.node("Transpose", [x[0]], None, f"{layer.name}_in", perm=[1, 0, 2])
    every, last = b.fresh(f"{layer.name}_Y"), b.fresh(f"{layer.name}_Y_h")
    attrs: dict[str, Any] = {"hidden_size": units, "direction": "bidirectional" if layer.bidirectional else "forward"}
    if not lstm:
        attrs["linear_before_reset"] = 1
    b.nodes.append(b.onnx.helper.make_node(
        "LSTM" if lstm else "GRU",
        [sequence_first, b.derived_weight(layer, "W", np.stack(weights)),
         b.derived_weight(layer, "R", np.stack(recurrent)), b.derived_weight(layer, "B", np.stack(biases))],
        [every, last], name=b.fresh(layer.name), **attrs))
    if layer.return_sequences:  # Y (length, directions, N, units) -> (N, length, directions * units)
        batch_first = b.node("Transpose", [every], None, f"{layer.name}_out", perm=[2, 0, 1, 3])
        shape = b.constant([0, length, directions * units], f"{layer.name}.shape", np.int64)
    else:  # Y_h (directions, N, units) -> (N, directions * units), forward first
        batch_first = b.node("Transpose", [last], None, f"{layer.name}_out", perm=[1, 0, 2])
        shape = b.constant([0, directions * units], f"{layer.name}.shape", np.int64)
    b.node("Reshape", [batch_first, shape], out, layer.name)


@emitter("multiheadattention")
def _attention(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    """Self-attention as MatMul, Softmax and reshapes: each projection's weight cut from the stacked
    ``in_proj_weight`` and transposed for MatMul, the heads split into ``(N, heads, length, d)``,
    the causal mask a constant and the padding mask ``(1 - mask) * MASKED`` added to the scores
    (the layer's own arithmetic, so onnxruntime computes what opgrad does)."""
    length, embed = shapes[0]
    source, keys = (x[1], shapes[1][0]) if layer.key_value else (x[0], length)  # keys and values read this
    heads, d = layer.num_heads, embed // layer.num_heads
    weight = np.asarray(b.weights[f"{layer.name}.in_proj_weight"])
    bias = np.asarray(b.weights[f"{layer.name}.in_proj_bias"]) if layer.use_bias else None

    def projected(part: int, name: str, perm: list[int]) -> str:
        rows = slice(part * embed, (part + 1) * embed)
        of, steps = (x[0], length) if part == 0 else (source, keys)
        split_heads = b.constant([0, steps, heads, d], f"{layer.name}.{name}_heads", np.int64)
        y = b.node("MatMul", [of, b.derived_weight(layer, f"{name}_weight", weight[rows].T)], None,
                   f"{layer.name}_{name}")
        if bias is not None:
            y = b.node("Add", [y, b.derived_weight(layer, f"{name}_bias", bias[rows])], None,
                       f"{layer.name}_{name}_bias")
        return b.node("Transpose", [b.node("Reshape", [y, split_heads], None, f"{layer.name}_{name}_heads")], None,
                      f"{layer.name}_{name}_t", perm=perm)

    q = projected(0, "q", [0, 2, 1, 3])
    k = projected(1, "k", [0, 2, 3, 1])  # (N, heads, d, length): q @ k is the scores
    v = projected(2, "v", [0, 2, 1, 3])
    scores = b.node("Mul", [b.node("MatMul", [q, k], None, f"{layer.name}_scores"),
                            b.constant(1.0 / math.sqrt(d), f"{layer.name}.scale")], None, f"{layer.name}_scaled")
    if layer.causal:
        hidden = np.triu(np.full((length, length), layer.MASKED), k=1)
        scores = b.node("Add", [scores, b.constant(hidden, f"{layer.name}.causal")], None, f"{layer.name}_causal")
    if layer.padding_mask:  # the keys' mask (N, keys): 1 for a token, 0 for padding
        padding = b.node("Mul", [b.node("Sub", [b.constant(1.0, f"{layer.name}.one"), x[-1]], None,
                                        f"{layer.name}_padding"),
                                 b.constant(layer.MASKED, f"{layer.name}.masked")], None, f"{layer.name}_masked")
        per_key = b.node("Reshape", [padding, b.constant([0, 1, 1, keys], f"{layer.name}.keys", np.int64)], None,
                         f"{layer.name}_keys")
        scores = b.node("Add", [scores, per_key], None, f"{layer.name}_padded")
    attended = b.node("MatMul", [b.node("Softmax", [scores], None, f"{layer.name}_softmax", axis=-1), v], None,
                      f"{layer.name}_attended")
    merged = b.node("Reshape", [b.node("Transpose", [attended], None, f"{layer.name}_merge", perm=[0, 2, 1, 3]),
                                b.constant([0, length, embed], f"{layer.name}.merged", np.int64)], None,
                    f"{layer.name}_merged")
    out_weight = b.weight(layer, "out_proj_weight", np.transpose)
    if layer.use_bias:
        y = b.node("MatMul", [merged, out_weight], None, f"{layer.name}_out")
        b.node("Add", [y, b.weight(layer, "out_proj_bias")], out, layer.name)
    else:
        b.node("MatMul", [merged, out_weight], out, layer.name)


@emitter("conv1d")
def _conv1d(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    _, (left, right) = layer.pads(1, shapes[0][1])
    inputs = [x[0], b.weight(layer, "weight")] + ([b.weight(layer, "bias")] if layer.use_bias else [])
    y = b.node("Conv", inputs, None if layer.activation else out, layer.name, kernel_shape=[layer.kernel_size[1]],
               strides=[layer.strides[1]], dilations=[layer.dilation_rate[1]], group=layer.groups, pads=[left, right])
    if layer.activation:
        _activation(b, y, layer.activation, out, layer.name)


@emitter("convtranspose")
def _conv_transpose(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    (top, left, bottom, right), extra, (rows, columns) = layer.crops()
    # Zero rows appended (an output_padding past the stride, which ConvTranspose does not take) get
    # the bias too, as in PyTorch, so it is added after the Pad.
    bias = layer.use_bias and bool(rows or columns)
    inputs = [x[0], b.weight(layer, "weight")] + ([b.weight(layer, "bias")] if layer.use_bias and not bias else [])
    final = None if layer.activation else out
    y = b.node("ConvTranspose", inputs, None if rows or columns else final, layer.name,
               kernel_shape=list(layer.kernel_size), strides=list(layer.strides), dilations=list(layer.dilation_rate),
               group=layer.groups, pads=[top, left, bottom, right], output_padding=list(extra))
    if rows or columns:
        pads = b.constant([0, 0, 0, 0, 0, 0, rows, columns], f"{layer.name}.pads", np.int64)
        y = b.node("Pad", [y, pads], None if bias else final, layer.name, mode="constant")
    if bias:
        y = b.node("Add", [y, b.weight(layer, "bias", lambda v: v.reshape(-1, 1, 1))], final, layer.name)
    if layer.activation:
        _activation(b, y, layer.activation, out, layer.name)


def _resize(b: GraphBuilder, name: str, x: str, size: tuple[int, int], method: str, align_corners: bool,
            out: str) -> None:
    # Sizes, not scales: the output size is then exact, as opgrad's; the batch and channel
    # entries come from the data's own shape, so the batch axis stays symbolic.
    leading = b.node("Shape", [x], hint=name, start=0, end=2)
    sizes = b.node("Concat", [leading, b.constant(list(size), f"{name}.size", np.int64)], hint=name, axis=0)
    if method == "nearest":
        attrs = {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}
    else:
        attrs = {"mode": "linear",
                 "coordinate_transformation_mode": "align_corners" if align_corners else "half_pixel"}
    b.node("Resize", [x, "", "", sizes], out, name, **attrs)


@emitter("upsampling")
def _upsampling(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    _, h, w = shapes[0]
    _resize(b, layer.name, x[0], (h * layer.size, w * layer.size), layer.interpolation, False, out)


@emitter("resize")
def _resize_layer(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    _resize(b, layer.name, x[0], layer.size, layer.method, layer.align_corners, out)


@emitter("maxpool1d", "avgpool1d")
def _pool1d(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    # The 2-D pool's attributes for a (channels, 1, length) view, its width entries kept.
    attrs = _pool_attributes(layer, (shapes[0][0], 1, shapes[0][1]))
    attrs.update(kernel_shape=attrs["kernel_shape"][1:], strides=attrs["strides"][1:],
                 pads=[attrs["pads"][1], attrs["pads"][3]])
    b.node("MaxPool" if layer.kind == "maxpool1d" else "AveragePool", [x[0]], out, layer.name, **attrs)


@emitter("maxpool", "avgpool")
def _pool(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    attrs = _pool_attributes(layer, shapes[0])
    b.node("MaxPool" if layer.kind == "maxpool" else "AveragePool", [x[0]], out, layer.name, **attrs)


def _pool_attributes(layer: Any, shape: Shape) -> dict[str, Any]:
    """MaxPool's or AveragePool's attributes for a 2-D pool ``layer`` on a ``(C, H, W)`` input."""
    averages = hasattr(layer, "count_include_pad")
    one_d = layer.kind.endswith("1d")  # its (channels, 1, length) view: the height never pools
    shapes = [shape]
    (top, bottom), (left, right) = layer.pads(shapes[0][1], shapes[0][2])
    attrs: dict[str, Any] = {"kernel_shape": list(layer.pool_size), "strides": list(layer.strides),
                             "pads": [top, left, bottom, right]}
    count_include_pad = getattr(layer, "count_include_pad", True)
    if layer.ceil_mode:
        # Where PyTorch's rule drops a last window that would start in the padding, the size is
        # the floor's, which ONNX's shape inference gives only with ceil_mode 0 (the same windows).
        pads = ((top, bottom), (left, right))
        floor = [(n + a + b - k) // s + 1 for n, (a, b), k, s in zip(shapes[0][1:], pads, layer.pool_size,
                                                                     layer.strides, strict=True)]
        sizes = ([1, layer.output_shape_for((shape[0], shape[2]))[1]] if one_d
                 else list(layer.output_shape_for(shape)[1:]))
        extra = [size - low for size, low in zip(sizes, floor, strict=True)]
        if all(extra[1:] if one_d else extra):
            attrs["ceil_mode"] = 1
        elif any(extra):
            # ONNX's ceil_mode takes both axes; where PyTorch's rule keeps the last window of one
            # axis only, that window is padded out on that axis instead (ceil_mode 0). Padding never
            # wins a max, and an average without count_include_pad does not count it; one with it
            # would, which PyTorch does not.
            if averages and layer.count_include_pad and not any((top, bottom, left, right)):
                count_include_pad = False  # no padding to count: the same divisors without it
            elif averages and layer.count_include_pad:
                raise OnnxError(f"layer {layer.describe()}: ceil_mode keeps a last window on one axis of the "
                                f"{shapes[0][1]}x{shapes[0][2]} input only, which ONNX's AveragePool with "
                                "count_include_pad=1 cannot express (its ceil_mode takes both axes, and padding "
                                "it would count); use count_include_pad=False or ceil_mode=False")
            ends = [(size - 1) * s + k - (n + a + b) if more else 0
                    for size, more, n, (a, b), k, s in zip(sizes, extra, shapes[0][1:], pads, layer.pool_size,
                                                           layer.strides, strict=True)]
            attrs["pads"] = [top, left, bottom + ends[0], right + ends[1]]
    if averages:
        attrs["count_include_pad"] = int(count_include_pad)
    return attrs


@emitter("globalavgpool")
def _global_avg_pool(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    b.node("Flatten", [b.node("GlobalAveragePool", [x[0]], hint=layer.name)], out, layer.name, axis=1)


@emitter("globalpool")
def _global_pool(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    b.node("GlobalAveragePool" if layer.op == "avg" else "GlobalMaxPool", [x[0]], out, layer.name)


@emitter("flatten")
def _flatten(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    b.node("Flatten", [x[0]], out, layer.name, axis=1)


@emitter("relu", "sigmoid", "tanh", "activation", "leakyrelu", "gelu")
def _activation_layer(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    if layer.kind == "leakyrelu":
        b.node("LeakyRelu", [x[0]], out, layer.name, alpha=layer.negative_slope)
    elif layer.kind == "gelu":
        _gelu(b, x[0], layer.approximate, out, layer.name)
    else:
        _activation(b, x[0], layer.activation if layer.kind == "activation" else layer.kind, out, layer.name)


@emitter("silu", "hardsigmoid", "hardswish")
def _named_activation(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    _activation(b, x[0], {"silu": "silu", "hardsigmoid": "hard_sigmoid", "hardswish": "hard_swish"}[layer.kind],
                out, layer.name)


@emitter("elu")
def _elu(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    b.node("Elu", [x[0]], out, layer.name, alpha=layer.alpha)


@emitter("softplus")
def _softplus(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    # ONNX's Softplus has neither beta nor PyTorch's linear region past the threshold. From
    # PyTorch's default threshold 20 on, the two differ by at most log1p(exp(-20)) / beta, 2e-9
    # times 1 / beta, below float32's resolution there; a lower threshold is written as a Where.
    smooth = final = out if layer.threshold >= 20.0 else None
    if layer.beta == 1.0:
        scaled, smooth = x[0], b.node("Softplus", [x[0]], smooth, layer.name)
    else:
        beta = b.constant(layer.beta, f"{layer.name}.beta")
        scaled = b.node("Mul", [x[0], beta], hint=layer.name)
        smooth = b.node("Div", [b.node("Softplus", [scaled], hint=layer.name), beta], smooth, layer.name)
    if final is None:
        linear = b.node("Greater", [scaled, b.constant(layer.threshold, f"{layer.name}.threshold")], hint=layer.name)
        b.node("Where", [linear, x[0], smooth], out, layer.name)


@emitter("prelu")
def _prelu(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    # The slopes run along axis 1; ONNX broadcasts them from the right, so (C,) becomes (C, 1, ...).
    slopes = b.weight(layer, "weight", lambda w: w.reshape(layer.num_parameters, *([1] * (len(shapes[0]) - 1))))
    b.node("PRelu", [x[0], slopes], out, layer.name)


_ONNX_UNARY = {op: node for node, op in UNARY_NODES.items()}


@emitter("unary")
def _unary(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    if layer.op == "rsqrt":
        b.node("Reciprocal", [b.node("Sqrt", [x[0]], hint=layer.name)], out, layer.name)
    elif layer.op == "square":
        b.node("Mul", [x[0], x[0]], out, layer.name)
    else:
        b.node(_ONNX_UNARY[layer.op], [x[0]], out, layer.name)


@emitter("dropout")
def _dropout(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    b.node("Identity", [x[0]], out, layer.name)  # inference: dropout is off


@emitter("batchnorm")
def _batch_norm(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    inputs = [x[0], *(b.weight(layer, k) for k in ("weight", "bias", "running_mean", "running_var"))]
    # ONNX has no cumulative average (momentum=None); the attribute only matters in training mode.
    momentum = {} if layer.momentum is None else {"momentum": 1.0 - layer.momentum}
    b.node("BatchNormalization", inputs, out, layer.name, epsilon=layer.epsilon, **momentum)


@emitter("layernorm")
def _layer_norm(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    axis = layer.axis % (len(shapes[0]) + 1)  # validated against the rank when the layer was built
    b.node("LayerNormalization", [x[0], b.weight(layer, "weight"), b.weight(layer, "bias")], out, layer.name,
           axis=axis, epsilon=layer.epsilon)


@emitter("embedding")
def _embedding(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    b.node("Gather", [b.weight(layer, "weight"), x[0]], out, layer.name, axis=0)


@emitter("add")
def _add(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    _fold(b, "add", x, out, layer.name)


_ONNX_ARITHMETIC = {"add": "Add", "subtract": "Sub", "multiply": "Mul", "divide": "Div", "maximum": "Max",
                    "minimum": "Min", "greater": "Greater"}


def _binary(b: GraphBuilder, op: str, pair: list[str], out: str | None, hint: str) -> str:
    """One binary operation; a comparison's boolean result is cast to the model's float type, the
    0/1 mask opgrad computes."""
    if op != "greater":
        return b.node(_ONNX_ARITHMETIC[op], pair, out, hint)
    return b.node("Cast", [b.node("Greater", pair, hint=hint)], out, hint, to=b.float_type)


def _fold(b: GraphBuilder, op: str, x: list[str], out: str, hint: str) -> None:
    """``op`` (an opgrad name) of several inputs, from the left."""
    total = x[0]
    for i, other in enumerate(x[1:], start=2):
        total = _binary(b, op, [total, other], out if i == len(x) else None, hint)


@emitter("elementwise")
def _elementwise(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    _fold(b, layer.op, x, out, layer.name)


@emitter("arithmetic")
def _arithmetic(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    operand = b.weight(layer, "operand") if layer.operand is None else b.constant(layer.operand,
                                                                                 f"{layer.name}.operand")
    _binary(b, layer.op, [operand, x[0]] if layer.reverse else [x[0], operand], out, layer.name)


@emitter("where")
def _where(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    condition = b.node("Cast", [x[0]], hint=layer.name, to=b.onnx.TensorProto.BOOL)  # nonzero (and NaN): true
    branches = iter(x[1:])
    on_true = next(branches) if layer.true_value is None else b.constant(layer.true_value, f"{layer.name}.true")
    on_false = next(branches) if layer.false_value is None else b.constant(layer.false_value, f"{layer.name}.false")
    b.node("Where", [condition, on_true, on_false], out, layer.name)


@emitter("concat")
def _concat(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    b.node("Concat", x, out, layer.name, axis=layer.axis % (len(shapes[0]) + 1))


@emitter("reshape")
def _reshape(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    shape = b.constant([0, *layer.output_shape], f"{layer.name}.shape", np.int64)  # 0: keep the batch axis
    b.node("Reshape", [x[0], shape], out, layer.name)


@emitter("permute")
def _permute(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    b.node("Transpose", [x[0]], out, layer.name, perm=[0, *layer.dims])


@emitter("zeropadding")
def _zero_padding(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    (top, bottom), (left, right) = layer.padding
    pads = b.constant([0, 0, top, left, 0, 0, bottom, right], f"{layer.name}.pads", np.int64)
    b.node("Pad", [x[0], pads], out, layer.name, mode="constant")


@emitter("rescaling")
def _rescaling(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    scaled = b.node("Mul", [x[0], b.constant(layer.scale, f"{layer.name}.scale")], None if layer.offset else out,
                    layer.name)
    if layer.offset:
        b.node("Add", [scaled, b.constant(layer.offset, f"{layer.name}.offset")], out, layer.name)


@emitter("softmax", "logsoftmax")
def _softmax(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    axis = layer.axis % (len(shapes[0]) + 1)
    b.node("Softmax" if layer.kind == "softmax" else "LogSoftmax", [x[0]], out, layer.name, axis=axis)


@emitter("clip")
def _clip(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    bounds = ["" if v is None else b.constant(v, f"{layer.name}.{k}")
              for k, v in (("min", layer.min_value), ("max", layer.max_value))]
    b.node("Clip", [x[0], *bounds], out, layer.name)


@emitter("pad")
def _pad(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    pads = b.constant([0, *(p[0] for p in layer.pads), 0, *(p[1] for p in layer.pads)], f"{layer.name}.pads",
                      np.int64)
    inputs = [x[0], pads] + ([b.constant(layer.value, f"{layer.name}.value")] if layer.mode == "constant" else [])
    b.node("Pad", inputs, out, layer.name, mode=layer.mode)


@emitter("slice")
def _slice(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    starts, ends, axes, steps = [], [], [], []
    for axis, (begin, end, step) in enumerate(zip(layer.begin, layer.end, layer.steps)):
        start, stop, step = slice(begin, end, step).indices(shapes[0][axis])
        starts.append(start)
        ends.append(INT64_MIN if stop < 0 else stop)  # ONNX reads -1 as "the last", numpy's indices as "before 0"
        axes.append(axis + 1)
        steps.append(step)
    inputs = [b.constant(v, f"{layer.name}.{k}", np.int64)
              for k, v in (("starts", starts), ("ends", ends), ("axes", axes), ("steps", steps))]
    b.node("Slice", [x[0], *inputs], out, layer.name)


@emitter("reduce")
def _reduce(b: GraphBuilder, layer: Any, x: list[str], shapes: list[Shape], out: str) -> None:
    axes = [a % (len(shapes[0]) + 1) for a in layer.axes]
    op_type = {"mean": "ReduceMean", "sum": "ReduceSum", "max": "ReduceMax"}[layer.op]
    if op_type == "ReduceSum" or b.opset >= 18:  # axes are an input from opset 13 (ReduceSum), 18 (the others)
        b.node(op_type, [x[0], b.constant(axes, f"{layer.name}.axes", np.int64)], out, layer.name,
               keepdims=int(layer.keepdims))
    else:
        b.node(op_type, [x[0]], out, layer.name, axes=axes, keepdims=int(layer.keepdims))


def uses_gelu(model: Model) -> bool:
    return any(layer.kind == "gelu" or getattr(layer, "activation", None) == "gelu" for layer in model.layers)


def to_onnx(model: Model, *, opset: int | None = None) -> Any:
    """The ``onnx.ModelProto`` of ``model`` with its current weights (checked by ``onnx.checker``).

    ``opset`` defaults to 17, or 20 when the model uses GELU; 17 to 20 can be asked for.
    """
    onnx = require_onnx()
    if opset is None:
        opset = GELU_OPSET if uses_gelu(model) else OPSET
    if opset not in OPSETS:
        raise OnnxError(f"opset {opset} is not written; opgrad writes opsets {OPSETS[0]} to {OPSETS[-1]}")
    weights = {**model.params, **model.buffers}
    dtype = next(iter(weights.values())).dtype if weights else np.dtype(np.float32)
    elem = onnx.TensorProto.DOUBLE if dtype == np.float64 else onnx.TensorProto.FLOAT
    b = GraphBuilder(onnx, dtype, opset)
    b.weights = weights
    names: dict[int, str] = {}
    graph_inputs = []
    for i, tensor in enumerate(model.inputs):
        name = b.fresh(model.input_names[i] if model.input_names else str(tensor.name))
        names[id(tensor)] = name
        kind = onnx.TensorProto.INT64 if tensor.dtype == "int64" else elem
        graph_inputs.append(onnx.helper.make_tensor_value_info(name, kind, ["N", *tensor.shape]))
    default_names = [f"output{i + 1}" if len(model.outputs) > 1 else "output" for i in range(len(model.outputs))]
    output_names = [n for n in model.output_names or default_names if n not in names.values()]
    if len(output_names) != len(model.outputs):  # an output named as an input: the default names
        output_names = [b.fresh(name) for name in default_names]  # made distinct from the inputs' too
    # A tensor listed as several outputs is computed under its first output's name; each later
    # position gets an Identity of it, so that every graph output has a name of its own.
    final: dict[int, str] = {}
    for tensor, name in zip(model.outputs, output_names):
        final.setdefault(id(tensor), name)
        b.taken.add(name)
    for node in model.nodes:
        layer = node.layer
        try:
            fn = EMITTERS.get(layer.registered_kind())
        except TypeError as exc:  # a subclass would be written as its parent
            raise OnnxError(f"model {model.name!r}: {exc}") from None
        if fn is None:
            raise OnnxError(f"model {model.name!r}: layer {layer.describe()} (kind {layer.kind!r}) has no ONNX "
                            f"export; exportable kinds: {', '.join(sorted(EMITTERS))}")
        out = final.get(id(node.output)) or b.fresh(str(layer.name))
        fn(b, layer, [names[id(t)] for t in node.inputs], [t.shape for t in node.inputs], out)
        names[id(node.output)] = out
    outputs = []
    for tensor, name in zip(model.outputs, output_names):
        if names[id(tensor)] != name:  # an input, or a tensor listed again: copied under this output's name
            b.node("Identity", [names[id(tensor)]], name, "output")
        outputs.append(onnx.helper.make_tensor_value_info(name, elem, ["N", *tensor.shape]))
    graph = onnx.helper.make_graph(b.nodes, model.name, graph_inputs, outputs, list(b.initializers.values()))
    # The IR version each opset needs: 8 up to opset 18, 9 for 19 and 20 (onnx.helper.VERSION_TABLE).
    proto = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)],
                                   producer_name="opgrad", ir_version=9 if opset >= 19 else 8)
    try:
        onnx.checker.check_model(proto, full_check=True)
    except Exception as exc:  # a bug in an emitter, reported with the checker's words
        raise OnnxError(f"model {model.name!r}: the ONNX graph written fails onnx.checker: {exc}") from None
    return proto


def save(model: Model, path: str | os.PathLike[str], *, opset: int | None = None) -> None:
    """Write ``model`` (its current ``params`` and ``buffers``) to ``path`` as ONNX, atomically.

    The result runs in onnxruntime with opgrad's outputs (inference mode: dropout off, BatchNorm
    with its running statistics). A layer kind without an emitter is an :class:`OnnxError`.
    """
    from opgrad.atomic import atomic_writer

    data = to_onnx(model, opset=opset).SerializeToString()
    with atomic_writer(path, what="the ONNX model") as handle:
        handle.write(data)
