"""Reading Keras model files: the architecture as plain data and the weights per layer.

Two containers hold a whole model:

* Keras 3's ``.keras``: a zip with ``config.json`` (the architecture) and ``model.weights.h5``
  (each layer's variables under ``layers/<name>/vars/<i>``, in the layer's own order);
* the legacy HDF5 ``.h5`` (Keras 2 / tf.keras, and Keras 3's ``save("x.h5")``): the architecture
  as JSON in the root attribute ``model_config``, the variables under ``model_weights/<name>``,
  listed in order by that group's ``weight_names`` attribute.

Both architectures are brought to one form, :class:`ModelSpec`: layers with their config and the
tensors each call reads, the model's inputs and outputs. Keras 2's and Keras 3's spellings
(``batch_input_shape`` vs ``batch_shape``, nested-list vs ``__keras_tensor__`` inbound nodes,
``Model`` vs ``Functional``) differ only here. h5py reads HDF5; nothing else is parsed by hand.
"""

from __future__ import annotations

import io
import itertools
import json
import lzma
import os
import re
import struct
import zipfile
import zlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from opgrad.errors import UserError

__all__ = ["KerasImportError", "LayerSpec", "ModelSpec", "TensorRef", "WeightStore", "read_model_file"]

#: A config.json larger than this is not a model description (it would be read into memory whole).
MAX_CONFIG_BYTES = 64 << 20
MODEL_CLASSES = ("Sequential", "Functional", "Model")
#: What zipfile and its decompressors raise for a damaged archive: a bit flip can break the zip
#: structure (BadZipFile, EOFError, struct.error, OSError), invent a zip version or compression
#: method (NotImplementedError), mark a member encrypted (RuntimeError), break the compressed data
#: (zlib.error, lzma.LZMAError), a member name (UnicodeDecodeError, a ValueError) or a declared
#: size (MemoryError, OverflowError).
_DAMAGED_ZIP_ERRORS = (
    zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, struct.error, OSError, NotImplementedError, RuntimeError,
    zlib.error, lzma.LZMAError, ValueError, MemoryError, OverflowError,
)
#: What h5py raises for a damaged HDF5 file: the HDF5 library's errors arrive as OSError,
#: RuntimeError or KeyError ("bad heap free list", "addr overflow"), a damaged datatype as
#: ValueError ("Insufficient precision") or TypeError (no NumPy equivalent), a name that is not
#: UTF-8 as a UnicodeError (a ValueError).
_DAMAGED_HDF5_ERRORS = (OSError, RuntimeError, KeyError, ValueError, TypeError)


class KerasImportError(UserError, ValueError):
    """A Keras file cannot be imported; the message names the file, the layer and what is supported."""


@contextmanager
def _hdf5_damage_reported(path: str, what: str) -> Iterator[None]:
    """Turn h5py's errors for damaged bytes into one :class:`KerasImportError` naming ``path``.

    The HDF5 library reads a file's structure lazily, so damage surfaces on whichever group,
    attribute or dataset is first touched, each time as another exception type.
    """
    try:
        yield
    except KerasImportError:
        raise
    except _DAMAGED_HDF5_ERRORS as exc:
        raise KerasImportError(f"{path}: the file is corrupt: {what} cannot be read "
                               f"({type(exc).__name__}: {exc})") from None


@dataclass(frozen=True)
class TensorRef:
    """The ``index``-th output of the ``node``-th call of layer ``layer`` (Keras' ``keras_history``)."""

    layer: str
    node: int = 0
    index: int = 0


@dataclass
class LayerSpec:
    """One Keras layer: its class, its config, and for each of its calls the tensors it reads."""

    name: str
    class_name: str
    config: dict[str, Any]
    calls: list[list[TensorRef]] = field(default_factory=list)
    #: Why its calls cannot be read, said once the class is known to be one the importer reads.
    call_error: str | None = None
    #: The layer whose output a call passes as ``mask=``: Keras 3 writes the mask of an
    #: ``Embedding(mask_zero=True)`` so, for the layers whose ``call`` takes one.
    mask_from: str | None = None
    #: A ``keras.ops`` operation (``x + 3.0``, ``ops.multiply(a, b)``), which Keras saves among the
    #: layers under its class name (``Add``, as the merge layer) but calls with positional arguments.
    operation: bool = False
    #: An operation's positional arguments: the tensors it reads and the numbers it was given.
    arguments: list[TensorRef | float] = field(default_factory=list)


@dataclass
class ModelSpec:
    name: str
    layers: list[LayerSpec]
    inputs: list[TensorRef]
    outputs: list[TensorRef]
    #: The keys of a model built with a dict of inputs (outputs), in the order of ``inputs``
    #: (``outputs``): Keras' flatten order, the sorted keys.
    input_names: list[str] | None = None
    output_names: list[str] | None = None


def _h5py(path: str) -> Any:
    try:
        import h5py
    except ImportError:
        raise KerasImportError(f"{path}: reading Keras files needs h5py (the HDF5 reader): "
                               "pip install 'opgrad[interop]'") from None
    return h5py


class WeightStore:
    """Each layer's variables, read from an open HDF5 file on demand.

    Only hard links to plain datasets are followed: an external or soft link, or a virtual or
    externally stored dataset, would make a hostile file read other files.
    """

    def __init__(self, path: str, h5file: Any, layout: str, spec: ModelSpec) -> None:
        self.path, self.file, self.layout = path, h5file, layout
        self.groups = _keras3_weight_paths(spec) if layout == "keras" else {}

    def _child(self, group: Any, name: str, where: str) -> Any:
        h5py = _h5py(self.path)
        link = group.get(name, getlink=True)
        if link is None:
            return None
        if not isinstance(link, h5py.HardLink):
            raise KerasImportError(f"{self.path}: {where}/{name} is a {type(link).__name__}; a model file keeps "
                                   "its weights in itself")
        return group[name]

    def variables(self, layer: str, *, integers: bool = False) -> list[tuple[str, np.ndarray]]:
        """``(label, array)`` for each variable of ``layer``, in the layer's order; [] if it has none.

        Integer variables are refused (a quantized model) unless ``integers`` (a layer that keeps
        a count, as ``Normalization``, whose caller checks which one is an integer).
        """
        with _hdf5_damage_reported(self.path, f"the weights of layer {layer!r}"):
            return self._read_variables(layer, integers)

    def _read_variables(self, layer: str, integers: bool) -> list[tuple[str, np.ndarray]]:
        if self.layout == "keras":
            stored = self.groups.get(layer, layer)
            layers = self._child(self.file, "layers", "")
            owner = self._child(layers, stored, "layers") if layers is not None else None
            where = f"layers/{stored}"
            if owner is None:
                return []
            # A Bidirectional wrapper keeps its two layers' weights apart, forward first (as a
            # legacy .h5 lists them); a TimeDistributed wrapper its layer's under "layer".
            parts = [part for part in ("forward_layer", "backward_layer", "layer")
                     if self._child(owner, part, where) is not None]
            out = []
            for part in parts or [""]:
                group, at = (owner, where) if not part else (self._child(owner, part, where), f"{where}/{part}")
                out += self._keras_vars(group, at, layer, integers)
            return out
        weights = self._child(self.file, "model_weights", "")
        base = self._child(weights, layer, "model_weights") if weights is not None else None
        if base is None:
            return []
        listed = base.attrs.get("weight_names", [])
        names = [(_text(n), f"model_weights/{layer}/{_text(n)}") for n in np.asarray(listed).ravel()]
        return self._datasets(base, names, layer, integers)

    def _keras_vars(self, owner: Any, where: str, layer: str, integers: bool) -> list[tuple[str, np.ndarray]]:
        """The variables of the .keras layer group ``owner`` (at ``where``): its ``vars``, or for a
        recurrent layer its cell's (``cell/vars``)."""
        group = self._child(owner, "vars", where)
        cell = self._child(owner, "cell", where) if not (group and len(group)) else None
        if cell is not None:
            where = f"{where}/cell"
            group = self._child(cell, "vars", where)
        if group is None:
            return []
        keys = sorted(group.keys(), key=lambda k: int(k) if k.isdigit() else -1)
        if any(not k.isdigit() for k in keys) or [int(k) for k in keys] != list(range(len(keys))):
            raise KerasImportError(f"{self.path}: {where}/vars holds {keys}; expected variables "
                                   "named 0, 1, 2, ...")
        return self._datasets(group, [(k, f"{where}/vars/{k}") for k in keys], layer, integers)

    def _datasets(self, base: Any, names: list[tuple[str, str]], layer: str,
                  integers: bool) -> list[tuple[str, np.ndarray]]:
        """The float datasets at ``names`` (``(key under base, label)``), checked."""
        h5py = _h5py(self.path)
        out = []
        for key, label in names:
            node: Any = base
            for part in key.split("/"):
                node = self._child(node, part, label) if isinstance(node, h5py.Group) else None
                if node is None:
                    raise KerasImportError(f"{self.path}: layer {layer!r} lists variable {key!r}, which the "
                                           "file does not hold")
            if not isinstance(node, h5py.Dataset) or node.is_virtual or node.external:
                raise KerasImportError(f"{self.path}: {label} is not a plain dataset")
            if node.dtype.kind != "f" and not (integers and node.dtype.kind in "iu"):
                raise KerasImportError(f"{self.path}: layer {layer!r} variable {label} has dtype {node.dtype}; "
                                       "supported: float16, float32, float64 weights (a quantized model is not)")
            out.append((label, np.asarray(node[()])))
        return out


def _snake_case(name: str) -> str:
    """Keras' ``naming.to_snake_case``: ``Conv2DTranspose`` -> ``conv2d_transpose``, ``ReLU`` -> ``re_lu``."""
    name = re.sub(r"\W+", "", name)
    name = re.sub("(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub("([a-z])([A-Z])", r"\1_\2", name).lower()


def _keras3_weight_paths(spec: ModelSpec) -> dict[str, str]:
    """Layer name -> its group under ``layers/`` in a ``.keras`` weights file.

    Keras 3 does not store a layer's variables under its name (often generated, so not
    reproducible) but under its class in snake case, numbered in the order of ``model.layers``
    (``dense``, ``dense_1``, ...), which is the order of the config's layer list.
    """
    used: dict[str, int] = {}
    paths = {}
    # keras.ops operations are not in model.layers and hold no variables.
    for layer in (layer for layer in spec.layers if not layer.operation):
        base = _snake_case(layer.class_name)
        if base in used:
            used[base] += 1
            paths[layer.name] = f"{base}_{used[base]}"
        else:
            used[base] = 0
            paths[layer.name] = base
    return paths


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _json(path: str, text: str | bytes, what: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise KerasImportError(f"{path}: {what} is not valid JSON ({exc})") from None
    except RecursionError:
        raise KerasImportError(f"{path}: {what} is nested too deeply to be a model description") from None


def read_model_file(path: str | os.PathLike[str]) -> tuple[ModelSpec, WeightStore, dict[str, str]]:
    """The architecture, the weights and facts about the file (``format``, ``keras_version``).

    The caller closes ``store.file``. Every problem is a :class:`KerasImportError` naming the file.
    """
    name = os.fspath(path)
    if os.path.isdir(name):
        raise KerasImportError(f"{name}: is a directory, expected a Keras model file (.keras or .h5)")
    if not os.path.isfile(name):
        raise KerasImportError(f"{name}: no such file")
    try:
        with open(name, "rb") as handle:
            magic = handle.read(8)
    except OSError as exc:
        raise KerasImportError(f"{name}: cannot read the file: {exc.strerror or exc}") from None
    if magic.startswith(b"PK"):
        return _read_keras_zip(name)
    if magic == b"\x89HDF\r\n\x1a\n":
        return _read_legacy_h5(name)
    raise KerasImportError(f"{name}: neither a Keras 3 .keras file (a zip) nor a legacy Keras .h5 file (HDF5); "
                           f"the file starts with {magic!r}")


def _read_keras_zip(path: str) -> tuple[ModelSpec, WeightStore, dict[str, str]]:
    h5py = _h5py(path)
    try:
        with zipfile.ZipFile(path) as archive:
            entries = {info.filename: info for info in archive.infolist()}
            if "config.json" not in entries:
                raise KerasImportError(f"{path}: the .keras archive has no config.json (it holds "
                                       f"{sorted(entries)[:8]}); it is not a whole saved model")
            if entries["config.json"].file_size > MAX_CONFIG_BYTES:
                raise KerasImportError(f"{path}: config.json is {entries['config.json'].file_size} bytes; "
                                       f"a model description is far smaller (limit {MAX_CONFIG_BYTES})")
            config = _json(path, archive.read("config.json"), "config.json")
            metadata = _json(path, archive.read("metadata.json"), "metadata.json") \
                if "metadata.json" in entries else {}
            if "model.weights.h5" not in entries:
                raise KerasImportError(f"{path}: the .keras archive has no model.weights.h5")
            weights = archive.read("model.weights.h5")
    except KerasImportError:
        raise
    except _DAMAGED_ZIP_ERRORS as exc:
        raise KerasImportError(f"{path}: not a readable .keras archive: it is corrupt or truncated "
                               f"({type(exc).__name__}: {exc})") from None
    try:
        h5file = h5py.File(io.BytesIO(weights), "r")
    except _DAMAGED_HDF5_ERRORS as exc:
        raise KerasImportError(f"{path}: model.weights.h5 inside the archive is not a readable HDF5 file: it is "
                               f"corrupt ({type(exc).__name__}: {exc})") from None
    spec = _model_spec(path, config)
    version = str(metadata.get("keras_version", "")) if isinstance(metadata, Mapping) else ""
    return spec, WeightStore(path, h5file, "keras", spec), {"format": ".keras", "keras_version": version}


def _read_legacy_h5(path: str) -> tuple[ModelSpec, WeightStore, dict[str, str]]:
    h5py = _h5py(path)
    try:
        h5file = h5py.File(path, "r")
    except _DAMAGED_HDF5_ERRORS as exc:
        raise KerasImportError(f"{path}: not a readable HDF5 file: it is corrupt or truncated "
                               f"({type(exc).__name__}: {exc})") from None
    try:
        with _hdf5_damage_reported(path, "the model description"):
            config, version = _legacy_h5_config(path, h5file)
        spec = _model_spec(path, config)
    except BaseException:
        h5file.close()
        raise
    return spec, WeightStore(path, h5file, "h5", spec), {"format": ".h5", "keras_version": version}


def _legacy_h5_config(path: str, h5file: Any) -> tuple[Any, str]:
    """The architecture (the parsed ``model_config`` attribute) and ``keras_version`` of a legacy ``.h5``."""
    raw = h5file.attrs.get("model_config")
    if raw is None:
        what = "weights only (saved with save_weights)" if "layer_names" in h5file.attrs \
            or "layers" in h5file or "model_weights" in h5file else "no Keras model"
        raise KerasImportError(f"{path}: the file holds {what}: it has no model_config attribute, so the "
                               "architecture is unknown; save the whole model with model.save(...)")
    config = _json(path, _text(raw), "the model_config attribute")
    if "model_weights" not in h5file:
        raise KerasImportError(f"{path}: the file has no model_weights group")
    return config, _text(h5file.attrs.get("keras_version", ""))


# ----- the architecture -----


def _model_spec(path: str, config: Any) -> ModelSpec:
    if not isinstance(config, Mapping) or "class_name" not in config:
        raise KerasImportError(f"{path}: the architecture is not a Keras model config (no class_name)")
    kind = config["class_name"]
    body = config.get("config")
    try:
        if kind == "Sequential":
            return _sequential(path, body)
        if kind in ("Functional", "Model"):
            return _functional(path, body)
    except KerasImportError:
        raise
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:
        raise KerasImportError(f"{path}: malformed {kind} config ({type(exc).__name__}: {exc})") from None
    raise KerasImportError(f"{path}: the model is a {kind!r}; supported: Sequential and functional models "
                           "(a subclassed model's Python code is not in the file)")


def _layer(entry: Mapping[str, Any]) -> LayerSpec:
    config = dict(entry.get("config") or {})
    name = str(entry.get("name") or config.get("name") or "")
    return LayerSpec(name=name, class_name=str(entry["class_name"]), config=config, operation=_is_operation(entry))


def _is_operation(entry: Mapping[str, Any]) -> bool:
    """Whether a functional model's ``entry`` is a ``keras.ops`` operation rather than a layer.

    A ``.keras`` file names the operation's module (``keras.src.ops.numpy``); a Keras 3 ``.h5``
    does not, but an operation's config holds its name only, where every Keras layer's also has
    ``trainable`` and ``dtype``.
    """
    module = entry.get("module")
    if isinstance(module, str):
        return module.startswith("keras.src.ops")
    config = entry.get("config")
    nodes = entry.get("inbound_nodes") or []
    keras3_calls = bool(nodes) and all(isinstance(node, Mapping) for node in nodes)
    return keras3_calls and isinstance(config, Mapping) and set(config) <= {"name"}


def _sequential(path: str, body: Any) -> ModelSpec:
    # Keras 2.1 wrote a Sequential config as the bare list of layers.
    entries = body if isinstance(body, list) else body["layers"]
    name = "sequential" if isinstance(body, list) else str(body.get("name", "sequential"))
    layers = [_layer(e) for e in entries]
    if not layers:
        raise KerasImportError(f"{path}: the Sequential model has no layers")
    if layers[0].class_name != "InputLayer":
        first = layers[0].config
        shape = first.get("batch_input_shape") or first.get("batch_shape") \
            or (None if isinstance(body, list) else body.get("build_input_shape"))
        if shape is None:
            raise KerasImportError(f"{path}: the Sequential model records no input shape (it was never built); "
                                   "build it, or start it with keras.Input(shape), before saving")
        dtype = first.get("dtype") if isinstance(first.get("dtype"), str) else "float32"
        layers.insert(0, LayerSpec(name="input", class_name="InputLayer",
                                   config={"batch_shape": shape, "dtype": dtype}))
    for previous, layer in itertools.pairwise(layers):
        layer.calls = [[TensorRef(previous.name)]]
    return ModelSpec(name=name, layers=layers, inputs=[TensorRef(layers[0].name)],
                     outputs=[TensorRef(layers[-1].name)])


def _refs(value: Any) -> tuple[list[TensorRef], list[str] | None]:
    """``[["conv", 0, 0], ...]`` or one ``["conv", 0, 0]`` (Keras 3 writes a lone input unnested),
    or Keras 3's dict ``{"image": ["conv", 0, 0], ...}``, with its keys: in Keras' flatten order
    (``keras.tree.flatten`` sorts a dict's keys), which is the order of ``model.inputs``."""
    if isinstance(value, Mapping):
        keys = sorted(str(key) for key in value)
        return _refs([value[key] for key in keys])[0], keys
    if isinstance(value, list) and value and isinstance(value[0], str):
        value = [value]
    return [TensorRef(str(v[0]), int(v[1]), int(v[2])) for v in value], None


def _operation_arguments(path: str, layer: str, class_name: str, node: Any) -> list[TensorRef | float]:
    """The positional arguments of a ``keras.ops`` operation's call: tensors and numbers."""
    args, kwargs = (node.get("args", []), node.get("kwargs") or {}) if isinstance(node, Mapping) else ([], {})
    extra = [key for key, value in kwargs.items() if value is not None]
    if extra:
        raise KerasImportError(f"{path}: layer {layer!r} is the keras.ops operation {class_name} called with keyword "
                               f"arguments {', '.join(extra)}; the importer reads it with positional arguments only")
    out: list[TensorRef | float] = []
    for value in args:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out.append(float(value))
        else:
            out.append(_keras3_tensor(path, layer, value))
    return out


def _keras3_tensor(path: str, layer: str, value: Any) -> TensorRef:
    if not (isinstance(value, Mapping) and value.get("class_name") == "__keras_tensor__"):
        raise KerasImportError(f"{path}: layer {layer!r} is called with {str(value)[:80]!r}; the importer reads "
                               "calls whose arguments are tensors of the model")
    history = value["config"]["keras_history"]
    return TensorRef(str(history[0]), int(history[1]), int(history[2]))


def _call_inputs(path: str, layer: str, node: Any) -> list[TensorRef]:
    if isinstance(node, Mapping):  # Keras 3: {"args": [...], "kwargs": {...}}
        args, kwargs = node.get("args", []), node.get("kwargs", {}) or {}
        extra = {k: v for k, v in kwargs.items() if v is not None and k != "training"}
        if len(args) != 1 or extra:
            given = f"{len(args)} positional argument(s)" + (f" and keyword arguments {', '.join(extra)}" if extra
                                                               else "")
            raise KerasImportError(f"{path}: layer {layer!r} is called with {given}; the importer reads calls on "
                                   "one tensor or one list of tensors")
        first = args[0]
        items = first if isinstance(first, list) else [first]
        return [_keras3_tensor(path, layer, item) for item in items]
    refs = []  # Keras 2: [[layer, node, index, kwargs], ...]
    for item in node:
        if len(item) > 3 and item[3]:
            raise KerasImportError(f"{path}: layer {layer!r} is called with keyword arguments {item[3]}; the "
                                   "importer reads plain calls")
        refs.append(TensorRef(str(item[0]), int(item[1]), int(item[2])))
    return refs


def _mask_source(node: Any) -> str | None:
    """The layer whose output a Keras 3 call node passes as ``mask=``, if any."""
    kwargs = node.get("kwargs") if isinstance(node, Mapping) else None
    mask = kwargs.get("mask") if isinstance(kwargs, Mapping) else None
    config = mask.get("config") if isinstance(mask, Mapping) and mask.get("class_name") == "__keras_tensor__" else None
    if isinstance(config, Mapping):
        history = config.get("keras_history")
        if isinstance(history, list) and history:
            return str(history[0])
    return None


def _functional(path: str, body: Any) -> ModelSpec:
    layers = []
    for entry in body["layers"]:
        layer = _layer(entry)
        nodes = entry.get("inbound_nodes") or []
        layer.mask_from = next(filter(None, map(_mask_source, nodes)), None)
        try:
            if layer.operation:
                # Keras makes an operation per call, so it has one node.
                layer.arguments = [arg for node in nodes[:1]
                                   for arg in _operation_arguments(path, layer.name, layer.class_name, node)]
                layer.calls = [[arg for arg in layer.arguments if isinstance(arg, TensorRef)]] * len(nodes)
            else:
                layer.calls = [_call_inputs(path, layer.name, node) for node in nodes]
        except KerasImportError as exc:  # a class the importer does not read is the first thing to say
            layer.call_error = str(exc)
        layers.append(layer)
    inputs, input_names = _refs(body["input_layers"])
    outputs, output_names = _refs(body["output_layers"])
    return ModelSpec(name=str(body.get("name", "model")), layers=layers, inputs=inputs, outputs=outputs,
                     input_names=input_names, output_names=output_names)
