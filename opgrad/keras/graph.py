"""Turning a :class:`~opgrad.keras.files.ModelSpec` into an ``opgrad.nn.Model`` with Keras' weights.

Layout: Keras tensors are channels-last, opgrad's images NCHW. Every Keras tensor with three axes
per example (an image, ``(H, W, C)``) is held as opgrad ``(C, H, W)`` (layout ``channels_first``);
every other tensor keeps Keras' axis order (``keras``). A ``Flatten`` of an image flattens the
opgrad tensor in C, H, W order (layout ``flat_chw``): the ``Dense`` that reads it gets its kernel
rows reordered from Keras' H, W, C order instead, so no transpose runs; any other reader gets the
values in Keras' order first (:meth:`LayerCall.to_keras_order`).

Each layer kind has one converter, found by class name in a table; a converter reads the config
fields it understands through :class:`LayerCall` and :meth:`LayerCall.finish` refuses any other
field that is set to something, naming the layer, the field and its value.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from opgrad.errors import ShapeError
from opgrad.keras.files import MODEL_CLASSES, KerasImportError, LayerSpec, ModelSpec, WeightStore
from opgrad.nn.layers import Flatten, Input, Layer, SymbolicTensor
from opgrad.nn.model import Model
from opgrad.nn.reshaping import Permute, Reshape

__all__ = ["Converter", "LayerCall", "Tensor", "build_model"]

Shape = tuple[int, ...]
_MISSING = object()
#: Config fields that change nothing in the imported model: names, initializers (the weights are
#: loaded), seeds, the trainable flag (each opgrad layer takes it in :meth:`LayerCall.add`) and dtype
#: (checked).
_ALWAYS_IGNORED = {"name", "trainable", "dtype", "seed", "build_config", "input_length", "batch_input_shape",
                   "batch_shape"}
#: Float dtype policies; the imported model computes in float32 whatever the policy.
_FLOAT_POLICIES = ("float32", "float16", "bfloat16", "float64", "mixed_float16", "mixed_bfloat16")
#: Said of a layer that reads a Keras mask: why it is refused, and how its model imports instead.
MASKING_ADVICE = ("the importer does not support masking: rebuild the model with mask_zero=False to import it; the "
                  "layers that read the mask then compute over the padding too (a masked GlobalAveragePooling1D "
                  "averages over every step), so their outputs differ from the masked model's until it is retrained")


@dataclass(frozen=True)
class Tensor:
    """A Keras tensor as it exists in the opgrad model (see the module docstring for ``layout``)."""

    sym: SymbolicTensor
    layout: str
    keras_shape: Shape
    #: For ``flat_chw``: the ``(C, H, W)`` image that was flattened.
    chw: Shape | None = None
    #: The ``Embedding(mask_zero=True)`` whose mask Keras attaches to this tensor: to the
    #: embedding's output and to what Keras' layers that support masking compute from it.
    keras_mask: str | None = None

    @property
    def keras_rank(self) -> int:
        return len(self.keras_shape)


def _safe_name(name: str) -> str:
    cleaned = re.sub(r"[./:]", "_", name)
    return cleaned or "layer"


class LayerCall:
    """What a converter works with: one Keras layer's config and weights, and the graph being built."""

    def __init__(self, builder: Builder, spec: LayerSpec) -> None:
        self.builder, self.spec = builder, spec
        self.config = spec.config
        self.used: set[str] = set()
        self.added = 0

    # ----- config -----

    def take(self, key: str, default: Any = _MISSING) -> Any:
        """The value of config field ``key`` (``default`` when absent), marked as understood."""
        self.used.add(key)
        if key in self.config:
            return self.config[key]
        if default is _MISSING:
            raise self.fail(f"its config has no {key!r} field")
        return default

    def choose(self, key: str, allowed: Sequence[Any], default: Any = _MISSING) -> Any:
        value = self.take(key, default)
        if value not in allowed:
            raise self.unsupported(key, value, ", ".join(repr(a) for a in allowed))
        return value

    def pair(self, key: str, default: Any = _MISSING) -> tuple[int, int]:
        value = self.take(key, default)
        items = [value, value] if isinstance(value, int) and not isinstance(value, bool) else value
        if not isinstance(items, (list, tuple)) or len(items) != 2 or \
                not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in items):
            raise self.unsupported(key, value, "one or two positive ints")
        return int(items[0]), int(items[1])

    def one_input(self, inputs: list[Tensor]) -> Tensor:
        """The input of a layer that takes one tensor."""
        if len(inputs) != 1:
            raise self.fail(f"takes one input, got {len(inputs)}")
        return inputs[0]

    def channels_last(self) -> None:
        self.choose("data_format", ("channels_last", None), None)

    def fail(self, problem: str) -> KerasImportError:
        return KerasImportError(f"{self.builder.path}: layer {self.spec.name!r} ({self.spec.class_name}): {problem}")

    def unsupported(self, key: str, value: Any, supported: str) -> KerasImportError:
        return self.fail(f"{key}={value!r} is not supported; supported: {supported}")

    def refuse_mask(self, inputs: list[Tensor], effect: str) -> None:
        """Refuse an input that carries a Keras mask, which this layer applies (``effect`` says how)."""
        for index, tensor in enumerate(inputs):
            if tensor.keras_mask is not None:
                raise self.fail(f"input {index} carries the mask of Embedding {tensor.keras_mask!r} (mask_zero=True), "
                                f"which Keras' {self.spec.class_name} applies ({effect}); {MASKING_ADVICE}")

    def note(self, text: str) -> None:
        self.builder.notes.append(f"layer {self.spec.name!r} ({self.spec.class_name}): {text}")

    def finish(self) -> None:
        """Refuse every config field no converter step understood, unless it is unset (None/False/0/empty)."""
        dtype = self.config.get("dtype")
        policy = dtype.get("config", {}).get("name") if isinstance(dtype, Mapping) else dtype
        if "dtype" not in self.used and policy is not None and policy not in _FLOAT_POLICIES:
            raise self.unsupported("dtype", policy, ", ".join(_FLOAT_POLICIES) + " (computed in float32 here)")
        if "dtype" not in self.used and policy not in (None, "float32"):
            self.builder.policies.setdefault(policy, []).append(self.spec.name)
        for key, value in self.config.items():
            if key in self.used or key in _ALWAYS_IGNORED or key.endswith("_initializer"):
                continue
            if key.endswith(("_regularizer", "_constraint")):
                if value is not None:
                    self.note(f"{key} is ignored: it only acts while training in Keras")
                continue
            if value is None or value is False or value == 0 or value in ([], {}, ""):
                continue
            raise self.fail(f"config field {key}={value!r} is not supported by the importer")

    # ----- weights -----

    def weights(self, expected: Mapping[str, Shape], *, counts: Sequence[str] = ()) -> dict[str, np.ndarray]:
        """The layer's variables in order, named and shaped as ``expected``, as float32; those named
        in ``counts`` may be integers (a count of examples seen), the others must be floats."""
        found = self.builder.store.variables(self.spec.name, integers=bool(counts))
        self.builder.read_layers.add(self.spec.name)
        if len(found) != len(expected):
            raise self.fail(f"the file holds {len(found)} variable(s) {[label for label, _ in found]}, expected "
                            f"{len(expected)}: {', '.join(f'{k} {v}' for k, v in expected.items())}")
        out = {}
        for (label, array), (name, shape) in zip(found, expected.items()):
            if tuple(array.shape) != tuple(shape):
                raise self.fail(f"variable {name} ({label}) has shape {tuple(array.shape)}, expected {tuple(shape)} "
                                "from the layer's config and input")
            if array.dtype.kind != "f" and name not in counts:
                raise self.fail(f"variable {name} ({label}) has dtype {array.dtype}; supported: float16, float32, "
                                "float64 weights (a quantized model is not)")
            if not np.all(np.isfinite(array)):
                raise self.fail(f"variable {name} ({label}) holds nan or infinite values")
            out[name] = np.ascontiguousarray(array, dtype=np.float32)
        return out

    def set_param(self, layer: Layer, local: str, value: np.ndarray) -> None:
        self.builder.params[f"{layer.name}.{local}"] = np.ascontiguousarray(value, dtype=np.float32)

    def set_buffer(self, layer: Layer, local: str, value: np.ndarray) -> None:
        self.builder.buffers[f"{layer.name}.{local}"] = np.ascontiguousarray(value, dtype=np.float32)

    # ----- graph -----

    def add(self, layer: Layer, inputs: Tensor | list[Tensor], layout: str, keras_shape: Sequence[int],
            *, suffix: str = "", chw: Shape | None = None) -> Tensor:
        """Call opgrad ``layer`` on ``inputs``; the layer is named after the Keras layer (plus ``suffix``)."""
        base = _safe_name(self.spec.name)
        layer.name = self.builder.unique(base if not suffix and self.added == 0 else f"{base}_{suffix or 'op'}")
        self.added += 1
        # A layer frozen in Keras stays frozen: each opgrad layer it becomes keeps its weights.
        layer.trainable = self.config.get("trainable") is not False
        try:
            sym = layer([t.sym for t in inputs] if isinstance(inputs, list) else inputs.sym)
        except (ShapeError, ValueError, TypeError) as exc:
            message = str(exc)
            named = f"layer {layer.describe()}: "  # the opgrad layer's own prefix names the Keras layer too
            raise self.fail(message[len(named):] if message.startswith(named) else message) from None
        return Tensor(sym, layout, tuple(int(d) for d in keras_shape), chw)

    def to_keras_order(self, tensor: Tensor) -> Tensor:
        """``tensor`` with its values in Keras' axis order (a transpose where the layouts differ)."""
        if tensor.layout == "channels_first":
            return self.add(Permute((2, 3, 1)), tensor, "keras", tensor.keras_shape, suffix="to_nhwc")
        if tensor.layout == "flat_chw":
            assert tensor.chw is not None
            c, h, w = tensor.chw
            image = self.add(Reshape(tensor.chw), tensor, "channels_first", (h, w, c), suffix="unflatten")
            hwc = self.add(Permute((2, 3, 1)), image, "keras", (h, w, c), suffix="to_nhwc")
            return self.add(Flatten(), hwc, "keras", tensor.keras_shape, suffix="flatten_hwc")
        return tensor

    def canonical(self, tensor: Tensor) -> Tensor:
        """A Keras-ordered result in the importer's layout: a three-axis (image) tensor becomes NCHW."""
        if tensor.layout == "keras" and tensor.keras_rank == 3:
            return self.add(Permute((3, 1, 2)), tensor, "channels_first", tensor.keras_shape, suffix="to_nchw")
        return tensor

    def opgrad_axis(self, tensor: Tensor, axis: int) -> int:
        """Keras axis ``axis`` (batch = 0, may be negative) as the axis of the opgrad tensor."""
        rank = tensor.keras_rank + 1
        if not -rank <= axis < rank or axis % rank == 0:
            raise self.unsupported("axis", axis, f"a non-batch axis of the {rank}-d input: 1..{rank - 1} "
                                                 f"or -{rank - 1}..-1")
        axis %= rank
        if tensor.layout == "channels_first":
            return {1: 2, 2: 3, 3: 1}[axis]
        return axis


#: A converter turns one Keras layer call (its inputs) into the opgrad tensor it produces.
Converter = Callable[[LayerCall, list[Tensor]], Tensor]


class Builder:
    """State of one import: the file, its weights, the names taken, and what was set along the way."""

    def __init__(self, path: str, store: WeightStore, keras2: bool = False) -> None:
        self.path, self.store = path, store
        #: Written by Keras 2, whose activations differ from Keras 3's by name (hard_sigmoid).
        self.keras2 = keras2
        self.notes: list[str] = []
        self.params: dict[str, np.ndarray] = {}
        self.buffers: dict[str, np.ndarray] = {}
        self.names: set[str] = set()
        self.read_layers: set[str] = set()
        #: id of a softmax's output tensor -> (its input, the Keras layer's name).
        self.softmax_inputs: dict[int, tuple[Tensor, str]] = {}
        #: Float dtype policies other than float32 -> the layers that have them (noted once per policy).
        self.policies: dict[str, list[str]] = {}

    def unique(self, name: str) -> str:
        candidate, n = name, 1
        while candidate in self.names:
            n += 1
            candidate = f"{name}_{n}"
        self.names.add(candidate)
        return candidate


def _input_tensor(builder: Builder, spec: LayerSpec, layout: str) -> tuple[SymbolicTensor, Tensor]:
    """The model input and the tensor the layers read (NCHW, through a transpose for ``layout="NHWC"``)."""
    call = LayerCall(builder, spec)
    shape = call.take("batch_shape", None)
    if shape is None:
        shape = call.take("batch_input_shape", None)
    if shape is None and call.config.get("shape") is not None:
        shape = [None, *call.take("shape")]
    if not isinstance(shape, list) or len(shape) < 2:
        raise call.fail(f"the input shape {shape!r} is not (batch, ...) with at least one axis per example")
    dims = shape[1:]
    if not all(d is None or (isinstance(d, int) and not isinstance(d, bool) and d >= 1) for d in dims):
        raise call.fail(f"input shape {shape!r} is not a list of positive ints")
    if None in dims:
        raise call.fail(f"input shape {shape} has an unknown dimension; opgrad models have fixed per-example "
                        "shapes: give keras.Input a full shape")
    dtype = call.take("dtype", "float32")
    dtype = dtype.get("config", {}).get("name") if isinstance(dtype, Mapping) else dtype
    if dtype in ("int32", "int64", "uint8", "int16", "uint16", "uint32"):
        kind = "int64"
    elif dtype in _FLOAT_POLICIES or dtype is None:
        kind = "float"
    else:
        raise call.unsupported("dtype", dtype, "float16/32/64 or integer inputs")
    call.take("sparse", False), call.take("ragged", False), call.take("optional", False)
    call.finish()
    name = builder.unique(_safe_name(spec.name))
    keras_shape = tuple(int(d) for d in dims)
    if len(dims) == 3 and kind == "float" and layout == "NCHW":
        h, w, c = keras_shape
        image = Input((c, h, w), name=name)
        return image, Tensor(image, "channels_first", keras_shape)
    raw = Input(keras_shape, dtype=kind, name=name)
    tensor = Tensor(raw, "keras", keras_shape)
    return raw, call.canonical(tensor) if len(dims) == 3 and kind == "float" else tensor


def build_model(spec: ModelSpec, builder: Builder, converters: Mapping[str, Converter],
                operations: Mapping[str, Converter], *, layout: str, keep_softmax: bool) -> Model:
    """The opgrad model of ``spec`` with its weights; notes go to ``builder.notes``.

    ``converters`` convert Keras layers by class name, ``operations`` the ``keras.ops`` operations
    (which Keras saves under class names the merge layers share: ``Add``, ``Multiply``).
    """
    by_name = {layer.name: layer for layer in spec.layers}
    if len(by_name) != len(spec.layers):
        raise KerasImportError(f"{builder.path}: two layers share a name; Keras layer names are unique")
    tensors: dict[str, Tensor] = {}
    inputs = []
    for ref in spec.inputs:
        layer = by_name.get(ref.layer)
        if layer is None or layer.class_name != "InputLayer":
            raise KerasImportError(f"{builder.path}: model input {ref.layer!r} is not an InputLayer of the model")
        try:
            raw, tensors[ref.layer] = _input_tensor(builder, layer, layout)
        except KerasImportError:
            raise
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise KerasImportError(f"{builder.path}: input layer {layer.name!r}: malformed config "
                                   f"{json.dumps(layer.config, default=str)[:300]}: {exc}") from None
        inputs.append(raw)
    pending = [layer for layer in spec.layers if layer.class_name != "InputLayer"]
    for layer in pending:
        # Before the class check, which would name the layer computing the mask (Keras' NotEqual),
        # a layer the user never wrote.
        if layer.mask_from is not None:
            raise KerasImportError(_mask_reader_error(builder, spec, layer))
    for layer in pending:
        if layer.operation and layer.class_name not in operations:
            raise KerasImportError(_operation_error(builder, layer, operations))
        if layer.class_name in MODEL_CLASSES:
            raise KerasImportError(f"{builder.path}: layer {layer.name!r} is itself a model ({layer.class_name}); "
                                   "the importer reads flat models: rebuild it in Keras with the inner model's "
                                   "layers called directly")
        if not layer.operation and layer.class_name not in converters:
            raise KerasImportError(f"{builder.path}: layer {layer.name!r} has class {layer.class_name!r}, which the "
                                   f"importer does not support; supported: {', '.join(sorted(converters))}")
        if layer.call_error is not None:
            raise KerasImportError(layer.call_error)
        if len(layer.calls) > 1:
            raise KerasImportError(f"{builder.path}: layer {layer.name!r} ({layer.class_name}) is called "
                                   f"{len(layer.calls)} times (a shared layer); the importer supports layers "
                                   "called once")
        for ref in (ref for call in layer.calls for ref in call):
            if ref.node != 0 or ref.index != 0:
                raise KerasImportError(f"{builder.path}: layer {layer.name!r} reads output {ref.index} of call "
                                       f"{ref.node} of layer {ref.layer!r}; the importer supports layers with one "
                                       "output, called once")
    pending = [layer for layer in pending if layer.calls]
    while pending:
        ready = [layer for layer in pending if all(ref.layer in tensors for ref in layer.calls[0])]
        if not ready:
            missing = sorted({ref.layer for layer in pending for ref in layer.calls[0] if ref.layer not in tensors})
            raise KerasImportError(f"{builder.path}: layer {pending[0].name!r} reads tensors of {missing}, which "
                                   "no model input leads to")
        for layer in ready:
            call = LayerCall(builder, layer)
            args = [tensors[ref.layer] for ref in layer.calls[0]]
            convert = (operations if layer.operation else converters)[layer.class_name]
            try:
                out = convert(call, args)
            except KerasImportError:
                raise
            except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
                # A config value of the wrong kind ("units": "ten", "kernel_size": {}) in a hand-edited
                # or damaged file.
                raise call.fail(f"malformed config {json.dumps(layer.config, default=str)[:300]}: "
                                f"{type(exc).__name__}: {exc}") from None
            call.finish()
            leftover = builder.store.variables(layer.name) if layer.name not in builder.read_layers else []
            if leftover:
                raise call.fail(f"the file holds variables {[label for label, _ in leftover]} for a layer that "
                                "has none here")
            tensors[layer.name] = out
        pending = [layer for layer in pending if layer not in ready]
    for policy, names in builder.policies.items():
        shown = ", ".join(repr(name) for name in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        builder.notes.append(f"layers {shown} have the dtype policy {policy!r}; the imported model computes and "
                             "trains in float32, so its outputs differ from Keras' by that policy's rounding")
    outputs = []
    for ref in spec.outputs:
        tensor = tensors.get(ref.layer)
        if tensor is None or ref.node != 0 or ref.index != 0:
            raise KerasImportError(f"{builder.path}: model output {ref} is not produced by the model's layers")
        outputs.append(_output(builder, by_name[ref.layer], tensor, layout, keep_softmax))
    try:
        model = Model(inputs, [t.sym for t in outputs], name=_safe_name(spec.name), input_names=spec.input_names,
                      output_names=spec.output_names)
        # Layers no output depends on are not in the model; their weights are left behind.
        model.params = {name: builder.params[name] for name in model.param_shapes()}
        model.buffers = {name: builder.buffers[name] for name in model.buffer_shapes()}
    except (TypeError, ValueError, KeyError) as exc:  # ShapeError included
        raise KerasImportError(f"{builder.path}: the model's wiring does not form an opgrad model: {exc}") from None
    return model


def _operation_error(builder: Builder, layer: LayerSpec, operations: Mapping[str, Converter]) -> str:
    """Why the ``keras.ops`` operation ``layer`` is refused: which operation, and which ones import."""
    return (f"{builder.path}: layer {layer.name!r} is the keras.ops operation {layer.class_name!r}, which the "
            f"importer does not support; supported keras.ops operations: {', '.join(sorted(operations))} of a "
            "tensor and a number or of two tensors (x + 3.0, x * y); write the others as Keras layers")


def _mask_reader_error(builder: Builder, spec: ModelSpec, reader: LayerSpec) -> str:
    """Why ``reader``, which Keras calls with ``mask=``, is refused, and what to do instead."""
    classes = {layer.name: layer.class_name for layer in spec.layers}
    embeddings = [repr(layer.name) for layer in spec.layers
                  if layer.class_name == "Embedding" and layer.config.get("mask_zero")]
    if len(embeddings) == 1:
        mask = f"the mask of Embedding {embeddings[0]} (mask_zero=True)"
    elif embeddings:
        mask = f"the mask of an Embedding with mask_zero=True ({', '.join(embeddings)})"
    else:
        mask = "a Keras mask"
    source = f"{reader.mask_from!r} ({classes.get(str(reader.mask_from), 'no layer of the model')})"
    return (f"{builder.path}: layer {reader.name!r} ({reader.class_name}) reads {mask}, which Keras computes in "
            f"layer {source}; {MASKING_ADVICE}")


def _output(builder: Builder, spec: LayerSpec, tensor: Tensor, layout: str, keep_softmax: bool) -> Tensor:
    call = LayerCall(builder, LayerSpec(f"{spec.name}_output", spec.class_name, {}))
    logits = builder.softmax_inputs.get(id(tensor.sym))
    if logits is not None and not keep_softmax and tensor.keras_rank == 1:
        builder.notes.append(f"layer {logits[1]!r}: the final softmax is left out: the model outputs logits "
                             "(opgrad trains classifiers with softmax cross-entropy on logits); softmax of the "
                             "output is Keras' prediction. keep_softmax=True keeps it")
        tensor = logits[0]
    if tensor.layout == "flat_chw" or (tensor.layout == "channels_first" and layout == "NHWC"):
        return call.to_keras_order(tensor)
    return tensor
