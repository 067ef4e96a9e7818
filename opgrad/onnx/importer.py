"""``load``: an ONNX file -> an ``opgrad.nn.Model`` with its weights.

The file is parsed by the ``onnx`` package (never by hand) without following external-data
references, checked (opset, dtypes, shapes, wiring, sizes), then walked in dependency order:
every node goes to its converter (see :mod:`opgrad.onnx.table`), which adds ordinary
``opgrad.nn`` layers. Nodes whose inputs are all known when reading (initializers, constants,
shapes) are evaluated right away with ``onnx.reference`` instead, which is how the
``Shape -> Gather -> Concat -> Reshape`` chains of exporters become a plain reshape.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from opgrad.nn.layers import Input, Layer, Softmax, SymbolicTensor
from opgrad.nn.model import Model
from opgrad.onnx import converters  # noqa: F401  (registers the converters)
from opgrad.onnx.converters.shape import fold_batch_shape
from opgrad.onnx.table import (
    BATCH,
    NodeContext,
    OnnxError,
    StaticValue,
    Value,
    find_converter,
    require_onnx,
    supported_op_types,
)

__all__ = ["MAX_ELEMENTS", "MIN_OPSET", "check", "parse", "read"]

#: The oldest default-domain opset read; older files can be upgraded with ``onnx.version_converter``.
MIN_OPSET = 11
#: The largest tensor (elements) read or folded: a declared size above it is a hostile or broken file.
MAX_ELEMENTS = 1 << 28
_FLOAT_TYPES = {1: "float32", 10: "float16", 11: "float64", 16: "bfloat16"}


def _folded_size(op_type: str, inputs: list[np.ndarray | None]) -> float:
    """The element count of a constant an op would make, for the ops whose inputs say it (0 for others).

    Checked before evaluating, so a hostile file cannot make the evaluator allocate it.
    """
    def number(i: int) -> np.ndarray:
        value = inputs[i] if i < len(inputs) else None
        return np.zeros(1) if value is None or value.dtype == object else np.abs(value.astype(np.float64))

    if op_type == "ConstantOfShape":
        return float(np.prod(number(0)))
    if op_type == "Expand":
        return float(np.prod(number(1))) * max(1.0, float(number(0).size))
    if op_type == "Tile":
        return float(np.prod(number(1))) * float(number(0).size)
    if op_type == "Range":
        start, limit, delta = (float(number(i).ravel()[0]) if number(i).size else 0.0 for i in range(3))
        return abs(limit - start) / delta if delta else math.inf
    return 0.0


#: Inputs of a node that are its weights (by position), which a file with parameters stores as initializers.
_WEIGHT_SLOTS = {"Conv": (1, 2), "ConvTranspose": (1, 2), "Gemm": (1,), "BatchNormalization": (1, 2, 3, 4),
                 "InstanceNormalization": (1, 2), "LayerNormalization": (1, 2), "PRelu": (1,)}


def _safe_name(name: str, fallback: str) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9_-]+", "_", name).strip("_")
    return cleaned or fallback


#: Ops whose rule before opset 13 works on the input flattened to 2-D at ``axis``.
_FLATTENED_BEFORE_13 = ("Softmax", "LogSoftmax", "Hardmax")


def _flattened_softmax(op_type: str, x: np.ndarray, axis: int) -> np.ndarray:
    """``op_type`` by its rule before opset 13: over all the axes from ``axis`` on, taken together."""
    axis %= max(x.ndim, 1)
    flat = np.asarray(x, dtype=np.float64).reshape(int(np.prod(x.shape[:axis], dtype=np.int64)), -1)
    if op_type == "Hardmax":
        out = np.zeros_like(flat)
        out[np.arange(len(flat)), np.argmax(flat, axis=1)] = 1.0
    else:
        shifted = flat - flat.max(axis=1, keepdims=True)
        log_sum = np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        out = shifted - log_sum if op_type == "LogSoftmax" else np.exp(shifted - log_sum)
    return out.reshape(x.shape).astype(x.dtype)


def _undecodable_text(message: Any, where: str) -> tuple[str, bytes] | None:
    """The first text field in ``message`` (or a message inside it) that is not valid UTF-8, as
    ``(field path, raw bytes)``, or None.

    protobuf hands out such a field of a proto2 message, which ONNX's are, as bytes instead of
    failing to parse it.
    """
    for field, value in message.ListFields():
        if field.type not in (field.TYPE_STRING, field.TYPE_MESSAGE):
            continue
        single = isinstance(value, (str, bytes)) or hasattr(value, "ListFields")
        for index, item in enumerate([value] if single else value):
            label = f"{where}.{field.name}" if single else f"{where}.{field.name}[{index}]"
            if isinstance(item, bytes):
                return label, item
            if field.type == field.TYPE_MESSAGE:
                found = _undecodable_text(item, label)
                if found is not None:
                    return found
    return None


def _attributes(onnx: Any, node: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for attr in node.attribute:
        value = onnx.helper.get_attribute_value(attr)
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        elif isinstance(value, (list, tuple)) or type(value).__name__.startswith("Repeated"):
            value = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in value]
        out[attr.name] = value
    return out


class _Reader:
    def __init__(self, onnx: Any, model: Any, source: str) -> None:
        self.onnx, self.model, self.source = onnx, model, source
        self.graph = model.graph
        self.values: dict[str, Value] = {}
        #: The file's names of the data inputs, in order (the model's inputs get identifiers).
        self.input_names: list[str] = []
        self.weights: dict[str, dict[str, np.ndarray]] = {}
        self.layer_names: set[str] = set()
        self.batch: int | None = None
        self.opset = self._opset()
        #: What the import changed, for the user (a final softmax left out).
        self.notes: list[str] = []

    # ----- checks of the file as a whole -----

    def _opset(self) -> int:
        versions = {imp.domain: imp.version for imp in self.model.opset_import}
        opset = versions.get("", versions.get("ai.onnx"))
        if opset is None:
            raise OnnxError(f"{self.source}: the model imports no version of the default ONNX operator set "
                            "(opset_import)")
        newest = self.onnx.defs.onnx_opset_version()
        if not MIN_OPSET <= opset <= newest:
            raise OnnxError(f"{self.source}: opset {opset} is not supported; supported: opsets {MIN_OPSET} to "
                            f"{newest} (upgrade an older model with onnx.version_converter.convert_version)")
        return int(opset)

    def tensor_array(self, tensor: Any, what: str) -> np.ndarray:
        if tensor.data_location == self.onnx.TensorProto.EXTERNAL:
            raise OnnxError(f"{self.source}: {what} {tensor.name!r} keeps its data in an external file; "
                            "supported: weights stored inside the .onnx file (onnx.load then onnx.save without "
                            "save_as_external_data)")
        count = math.prod(int(d) for d in tensor.dims) if len(tensor.dims) else 1
        if any(int(d) < 0 for d in tensor.dims) or count > MAX_ELEMENTS:
            raise OnnxError(f"{self.source}: {what} {tensor.name!r} declares shape {list(tensor.dims)} "
                            f"({count:,} elements); supported: at most {MAX_ELEMENTS:,} elements")
        try:
            array = self.onnx.numpy_helper.to_array(tensor)
        except Exception as exc:  # malformed payload: wrong byte count, unknown data type
            raise OnnxError(f"{self.source}: {what} {tensor.name!r} (shape {list(tensor.dims)}) cannot be read: "
                            f"{exc}") from None
        if array.dtype.kind == "f" and array.dtype != np.float64:
            array = array.astype(np.float32)
        return np.asarray(array)

    def read_initializers(self) -> None:
        if len(self.graph.sparse_initializer):
            raise OnnxError(f"{self.source}: sparse initializers are not supported; supported: dense initializers")
        for tensor in self.graph.initializer:
            self.values[tensor.name] = StaticValue(self.tensor_array(tensor, "initializer"), initializer=tensor.name)

    def read_inputs(self) -> list[SymbolicTensor]:
        self.refuse_weights_as_inputs()
        inputs: list[SymbolicTensor] = []
        taken: set[str] = set()
        for info in self.graph.input:
            if info.name in self.values:  # IR < 4 lists initializers among the inputs
                continue
            where = f"{self.source}: input {info.name!r}"
            if info.type.WhichOneof("value") != "tensor_type":
                raise OnnxError(f"{where} is not a tensor; supported: float tensors (N, C, H, W) or (N, features)")
            elem = info.type.tensor_type.elem_type
            if elem not in _FLOAT_TYPES:
                name = self.onnx.TensorProto.DataType.Name(elem) if elem in self.onnx.TensorProto.DataType.values() \
                    else elem
                raise OnnxError(f"{where} has dtype {name}; supported: float inputs (FLOAT, DOUBLE, FLOAT16)")
            if not info.type.tensor_type.HasField("shape"):
                raise OnnxError(f"{where} declares no shape; supported: a fixed shape with a batch axis first")
            dims = info.type.tensor_type.shape.dim
            if len(dims) < 2:
                raise OnnxError(f"{where} has rank {len(dims)}; supported: a batch axis first, then one or more "
                                "axes (NCHW or (N, features))")
            first = dims[0]
            if first.HasField("dim_value") and first.dim_value > 0:
                if self.batch is not None and self.batch != first.dim_value:
                    raise OnnxError(f"{where}: batch size {first.dim_value} differs from another input's "
                                    f"{self.batch}")
                self.batch = int(first.dim_value)
            shape = []
            for axis, dim in enumerate(dims[1:], start=1):
                if not dim.HasField("dim_value") or dim.dim_value < 1:
                    label = dim.dim_param or "unknown"
                    raise OnnxError(f"{where}: axis {axis} is dynamic ({label!r}); supported: a dynamic batch "
                                    "axis (axis 0) only; export the model with fixed sizes for the other axes")
                shape.append(int(dim.dim_value))
            if math.prod(shape) > MAX_ELEMENTS:
                raise OnnxError(f"{where} declares shape {shape} per example; supported: at most "
                                f"{MAX_ELEMENTS:,} elements")
            name = _safe_name(info.name, f"input{len(inputs) + 1}")
            while name in taken:
                name += "_"
            taken.add(name)
            tensor = Input(tuple(shape), name=name)
            self.values[info.name] = tensor
            self.input_names.append(info.name)
            inputs.append(tensor)
        if not inputs:
            raise OnnxError(f"{self.source}: the graph has no data input (every input is an initializer)")
        return inputs

    def refuse_weights_as_inputs(self) -> None:
        """A weight that is a graph input rather than an initializer: a file exported without its
        parameters (``torch.onnx.export(..., export_params=False)``), which would otherwise fail on
        the weight's shape as if it were data."""
        inputs = {info.name for info in self.graph.input} - set(self.values)
        for node in self.graph.node:
            slots = _WEIGHT_SLOTS.get(node.op_type, ())
            missing = [node.input[i] for i in slots if i < len(node.input) and node.input[i] in inputs]
            if missing:
                raise OnnxError(f"{self.source}: node {node.name or node.op_type!r} ({node.op_type}) takes its "
                                f"weight {missing[0]!r} as a graph input, not an initializer: the file holds no "
                                "weights (exported with export_params=False?); export it with its parameters")

    def node_order(self) -> list[Any]:
        """The nodes in dependency order; a missing producer or a cycle is an error naming the node."""
        nodes = list(self.graph.node)
        producer: dict[str, int] = {}
        for i, node in enumerate(nodes):
            for out in node.output:
                if not out:
                    continue
                if out in producer or out in self.values:
                    raise OnnxError(f"{self.source}: node {node.name!r} ({node.op_type}) writes {out!r}, which "
                                    "another node, an input or an initializer already defines")
                producer[out] = i
        waiting = [0] * len(nodes)
        users: dict[int, list[int]] = {}
        for i, node in enumerate(nodes):
            for name in node.input:
                if not name or name in self.values:
                    continue
                if name not in producer:
                    raise OnnxError(f"{self.source}: node {node.name!r} ({node.op_type}) reads {name!r}, which is "
                                    "neither a graph input, an initializer nor the output of a node")
                waiting[i] += 1
                users.setdefault(producer[name], []).append(i)
        ready = [i for i, n in enumerate(waiting) if n == 0]
        order: list[int] = []
        while ready:
            i = ready.pop(0)
            order.append(i)
            for j in users.get(i, []):
                waiting[j] -= 1
                if waiting[j] == 0:
                    ready.append(j)
        if len(order) != len(nodes):
            stuck = [f"{nodes[i].name!r} ({nodes[i].op_type})" for i in range(len(nodes)) if waiting[i]]
            raise OnnxError(f"{self.source}: the graph has a cycle through node(s) {', '.join(stuck[:5])}; "
                            "supported: acyclic graphs")
        return [nodes[i] for i in order]

    # ----- building -----

    def add_layer(self, node: Any, layer: Layer, tensors: list[SymbolicTensor],
                  weights: dict[str, np.ndarray]) -> SymbolicTensor:
        base = _safe_name(node.name, node.op_type.lower())
        name, n = base, 1
        while name in self.layer_names:
            n += 1
            name = f"{base}_{n}"
        self.layer_names.add(name)
        layer.name = name
        out = layer(tensors if layer.multi_input else tensors[0])
        if math.prod(out.shape) > MAX_ELEMENTS:
            raise ValueError(f"its output {out.shape} has more than {MAX_ELEMENTS:,} elements per example")
        specs = {**{k: s.shape for k, s in layer.param_specs().items()},
                 **{k: s.shape for k, s in layer.buffer_specs().items()}}
        if set(specs) != set(weights):
            raise ValueError(f"layer {layer.describe()} needs weights {sorted(specs)}, the node gives "
                             f"{sorted(weights)}")
        for key, shape in specs.items():
            if tuple(weights[key].shape) != shape:
                raise ValueError(f"weight {key} has shape {tuple(weights[key].shape)}, the layer needs {shape}")
        # np.array, not np.ascontiguousarray, which turns a 0-d weight into shape (1,).
        self.weights[name] = {k: np.array(v, dtype=np.float32, order="C") for k, v in weights.items()}
        return out

    def fold(self, node: Any, attributes: dict[str, Any], where: str) -> list[StaticValue]:
        """Evaluate a node whose inputs are all known now (``onnx.reference``; shapes holding the batch by hand)."""
        inputs = [self.values[name].array if name else None for name in node.input]  # type: ignore[union-attr]
        if any(a is not None and a.dtype == object for a in inputs):
            try:
                shapes = [np.asarray(a, dtype=object) for a in fold_batch_shape(node, attributes, inputs, self.opset,
                                                                               where)]
            except OnnxError:
                raise
            except (IndexError, ValueError, TypeError, OverflowError) as exc:  # an index or axis out of range
                raise OnnxError(f"{where}: cannot evaluate it on its constant inputs: {type(exc).__name__}: "
                                f"{exc}") from None
            return [StaticValue(a if any(v is BATCH for v in a.ravel()) else a.astype(np.int64)) for a in shapes]
        if _folded_size(node.op_type, inputs) > MAX_ELEMENTS:
            raise OnnxError(f"{where}: computes a constant larger than {MAX_ELEMENTS:,} elements")
        if node.op_type in _FLATTENED_BEFORE_13 and self.opset < 13 and inputs[0] is not None:
            # onnx.reference knows only opset 13's rule (along one axis), whatever the opset.
            return [StaticValue(_flattened_softmax(node.op_type, inputs[0], int(attributes.get("axis", 1))))]
        try:
            from onnx.reference import ReferenceEvaluator

            # A bare node is evaluated by each op's newest version whatever opsets= says (Softmax's
            # per-axis rule for an opset-11 file, Unsqueeze reading axes from an input): the node goes
            # into a one-node model that imports the file's opset.
            helper = self.onnx.helper
            graph = helper.make_graph(
                [node], "fold",
                [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(a.dtype), None)
                 for name, a in zip(node.input, inputs) if name and a is not None],
                [helper.make_tensor_value_info(name, 0, None) for name in node.output if name])
            opsets = [helper.make_opsetid("", self.opset)]
            evaluator = ReferenceEvaluator(helper.make_model(graph, opset_imports=opsets))
            feeds = {name: a for name, a in zip(node.input, inputs) if name}
            results = evaluator.run(None, feeds)
        except Exception as exc:
            raise OnnxError(f"{where}: cannot evaluate it on its constant inputs: {type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
        out = []
        for result in results:
            array = np.asarray(result)
            if array.size > MAX_ELEMENTS:
                raise OnnxError(f"{where}: computes a constant of {array.size:,} elements; supported: at most "
                                f"{MAX_ELEMENTS:,}")
            out.append(StaticValue(array))
        return out

    def convert(self, node: Any) -> None:
        label = repr(node.name) if node.name else f"producing {node.output[0]!r}" if node.output else "(unnamed)"
        where = f"{self.source}: node {label} ({node.op_type})"
        if node.domain not in ("", "ai.onnx"):
            raise OnnxError(f"{where}: domain {node.domain!r} is not supported; supported: the default ONNX domain")
        attributes = _attributes(self.onnx, node)
        given = [name for name in node.input if name]
        if given and all(isinstance(self.values[name], StaticValue) for name in given):
            results: Sequence[Value] = self.fold(node, attributes, where)
        else:
            found = find_converter(node.op_type, self.opset)
            if found is None:
                if node.op_type in supported_op_types():
                    raise OnnxError(f"{where}: not supported at opset {self.opset}")
                raise OnnxError(f"{where}: op type {node.op_type} is not supported; supported op types: "
                                f"{', '.join(supported_op_types())}")
            unknown = sorted(set(attributes) - found.attributes)
            if unknown:
                known = ", ".join(sorted(found.attributes)) or "none"
                raise OnnxError(f"{where}: attribute {unknown[0]}={attributes[unknown[0]]!r} is not supported; "
                                f"supported attributes: {known}")
            ctx = NodeContext(node, self.opset, self.values, self.source,
                              lambda layer, tensors, weights: self.add_layer(node, layer, tensors, weights),
                              self.batch, attributes)
            results = found.fn(ctx)
        outputs = list(node.output)
        for index, name in enumerate(outputs):
            if not name:
                continue
            if index >= len(results):
                raise OnnxError(f"{where}: output {index} ({name!r}) is not supported; supported: the first "
                                f"{len(results)} output(s)")
            self.values[name] = results[index]

    def build(self, inputs: list[SymbolicTensor], order: list[Any], keep_softmax: bool = False) -> Model:
        for position, node in enumerate(order):
            try:
                self.convert(node)
            except OnnxError as exc:
                # The first refusal may be a detail of a model whose real obstacle comes later
                # (a Transpose feeding a GRU): name every op type the rest of it has no converter for.
                missing = sorted({later.op_type for later in order[position + 1:]
                                  if later.domain in ("", "ai.onnx") and later.op_type != node.op_type
                                  and find_converter(later.op_type, self.opset) is None})
                if not missing:
                    raise
                raise OnnxError(f"{exc}; the model also has op type(s) {', '.join(missing)}, which this importer "
                                f"does not convert") from None
        outputs = []
        for info in self.graph.output:
            value = self.values.get(info.name)
            if value is None:
                raise OnnxError(f"{self.source}: graph output {info.name!r} is not produced by any node")
            if isinstance(value, StaticValue):
                raise OnnxError(f"{self.source}: graph output {info.name!r} is a constant; supported: outputs "
                                "computed from the model input")
            producer = value.node
            if (not keep_softmax and producer is not None and type(producer.layer) is Softmax
                    and len(value.shape) == 1):
                # A classifier exported for deployment ends in probabilities; training needs logits.
                self.notes.append(f"node {producer.layer.name!r}: the final Softmax is left out: output "
                                  f"{info.name!r} gives logits (opgrad trains classifiers with softmax "
                                  "cross-entropy on logits); their softmax is the file's output. keep_softmax=True "
                                  "keeps it")
                value = producer.inputs[0]
            outputs.append(value)
        if not outputs:
            raise OnnxError(f"{self.source}: the graph has no outputs")
        # The file's name, which the user chose, rather than the exporter's graph name ("main_graph").
        name = _safe_name(Path(self.source).stem, _safe_name(self.graph.name, "onnx-model"))
        try:
            model = Model(inputs, outputs, name=name, input_names=list(self.input_names),
                          output_names=[info.name for info in self.graph.output])
        except (ValueError, TypeError) as exc:
            raise OnnxError(f"{self.source}: {exc}") from None
        params: dict[str, np.ndarray] = {}
        buffers: dict[str, np.ndarray] = {}
        for layer in model.layers:
            assert layer.name is not None
            for key, array in self.weights.get(layer.name, {}).items():
                full = f"{layer.name}.{key}"
                (buffers if key in layer.buffer_specs() else params)[full] = array
        model.params = params
        model.buffers = buffers
        return model


def parse(data: bytes, source: str) -> Any:
    """The ``ModelProto`` in ``data``; anything that is not a usable ONNX model is an :class:`OnnxError`."""
    onnx = require_onnx()
    from google.protobuf.message import DecodeError

    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise OnnxError(f"{source}: not an ONNX model (the protobuf cannot be decoded: {exc}); a truncated "
                        "download or another file type") from None
    if model.ir_version < 3 or not model.HasField("graph") or not len(model.graph.output):
        raise OnnxError(f"{source}: not an ONNX model (no IR version, graph or outputs)")
    # Refused rather than decoded with replacement characters: names are how the graph wires
    # tensors together, and two different damaged names could decode to one and silently rewire
    # the model. ONNX text is UTF-8, so text that is not means the file is damaged.
    undecodable = _undecodable_text(model, "model")
    if undecodable is not None:
        field, raw = undecodable
        raise OnnxError(f"{source}: corrupt ONNX file: {field} is not valid UTF-8 text ({raw[:40]!r}); ONNX "
                        "stores names and text as UTF-8")
    return model


def check(onnx: Any, model: Any, source: str) -> None:
    """``onnx.checker`` on the parsed model, its message made one line and attributed to the file."""
    try:
        onnx.checker.check_model(model)
    except Exception as exc:
        message = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        raise OnnxError(f"{source}: not a valid ONNX model: {message}") from None


def read(path: str | os.PathLike[str], *, keep_softmax: bool = False) -> tuple[Model, list[str]]:
    """The ONNX model at ``path`` as an ``opgrad.nn.Model`` holding its weights (``model.params``/``buffers``),
    and notes on what the import changed.

    Inputs must be float tensors with the batch axis first (symbolic or fixed) and fixed other
    axes. Everything opgrad cannot represent exactly is an :class:`OnnxError` naming the file,
    the node, its op type and the attribute, with what is supported. A ``Softmax`` that gives a
    graph output of one axis per example (a classifier's probabilities) is left out unless
    ``keep_softmax``, as :func:`opgrad.keras.load` does: the model outputs logits, which opgrad's
    training step needs (a note says so).
    """
    onnx = require_onnx()
    source = str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise OnnxError(f"{source}: cannot read the file: {exc.strerror or exc}") from None
    model = parse(data, source)
    # opgrad's own checks first: they name the node and say what is supported, where the checker's
    # messages are vaguer (and a hostile size must be refused before anything allocates it).
    reader = _Reader(onnx, model, source)
    reader.read_initializers()
    inputs = reader.read_inputs()
    order = reader.node_order()
    check(onnx, model, source)
    built = reader.build(inputs, order, keep_softmax=bool(keep_softmax))
    return built, reader.notes
