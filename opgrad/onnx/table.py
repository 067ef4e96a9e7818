"""The converter table: one function per ONNX node kind, keyed by op type and the opset it starts at.

A converter is registered with :func:`converter`, naming the attributes it understands; the
importer refuses any other attribute before the converter runs, so a converter only validates
the *values* of the attributes it declared. It receives a :class:`NodeContext` and returns one
value per node output: a :class:`~opgrad.nn.SymbolicTensor` (data that depends on the model's
input) or a :class:`StaticValue` (a weight or constant known when the file is read).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from opgrad.errors import UserError
from opgrad.nn.layers import Layer, SymbolicTensor

__all__ = [
    "BATCH",
    "BATCH_ARITHMETIC",
    "CONVERTERS",
    "Converter",
    "NodeContext",
    "OnnxError",
    "StaticValue",
    "Value",
    "converter",
    "find_converter",
    "require_onnx",
    "supported_op_types",
]


class OnnxError(UserError, ValueError):
    """An ONNX file opgrad cannot read or a model it cannot write; the message names file, node and attribute."""


def require_onnx() -> Any:
    """The ``onnx`` module, or an :class:`OnnxError` saying how to install it."""
    try:
        import onnx
    except ImportError:
        raise OnnxError("ONNX support needs the onnx package: pip install 'opgrad[interop]'") from None
    return onnx


class _Batch:
    """The batch size inside a shape computed from a tensor (``Shape(x)[0]``): known only at run time."""

    def __repr__(self) -> str:
        return "N"


#: The batch entry of a shape value taken from data (object arrays hold it among plain ints).
BATCH = _Batch()
#: What a node computing with the batch size is told.
BATCH_ARITHMETIC = ("computes with the batch size (from Shape of the data); supported: the batch size passed through "
                    "Gather, Unsqueeze, Squeeze, Concat, Slice or Cast into a Reshape")


@dataclass
class StaticValue:
    """A value known when the model is read: an initializer, a ``Constant``, or one folded from them.

    ``initializer`` names the initializer it is (trainable weights come from initializers),
    else None. ``array`` is an object array when it holds :data:`BATCH`.
    """

    array: np.ndarray
    initializer: str | None = None

    @property
    def has_batch(self) -> bool:
        return self.array.dtype == object and any(v is BATCH for v in self.array.ravel())


Value = SymbolicTensor | StaticValue


@dataclass(frozen=True)
class Converter:
    op_type: str
    since: int
    attributes: frozenset[str]
    fn: Callable[[NodeContext], Sequence[Value]]


#: op type -> converters, by the opset each starts at (ascending).
CONVERTERS: dict[str, list[Converter]] = {}


def converter(op_type: str, *, since: int = 11, attributes: Iterable[str] = ()) -> Callable[
        [Callable[[NodeContext], Sequence[Value]]], Callable[[NodeContext], Sequence[Value]]]:
    """Register ``fn`` as the converter of ``op_type`` for opsets ``since`` and later (until a newer one)."""

    def register(fn: Callable[[NodeContext], Sequence[Value]]) -> Callable[[NodeContext], Sequence[Value]]:
        entries = CONVERTERS.setdefault(op_type, [])
        if any(c.since == since for c in entries):
            raise RuntimeError(f"two ONNX converters for {op_type} from opset {since}")
        entries.append(Converter(op_type, since, frozenset(attributes), fn))
        entries.sort(key=lambda c: c.since)
        return fn

    return register


def find_converter(op_type: str, opset: int) -> Converter | None:
    """The converter for ``op_type`` in a model of ``opset`` (the newest one starting at or before it)."""
    matches = [c for c in CONVERTERS.get(op_type, []) if c.since <= opset]
    return matches[-1] if matches else None


def supported_op_types() -> list[str]:
    return sorted(CONVERTERS)


class NodeContext:
    """What a converter sees of one node: its inputs and attributes, and how to add layers and report errors."""

    def __init__(self, node: Any, opset: int, values: dict[str, Value], source: str,
                 add_layer: Callable[[Layer, list[SymbolicTensor], dict[str, np.ndarray]], SymbolicTensor],
                 batch: int | None, attributes: dict[str, Any]) -> None:
        self.node = node
        self.op_type: str = node.op_type
        self.name: str = node.name
        self.opset = opset
        self.source = source
        self._values = values
        self._add_layer = add_layer
        #: The batch size the file declares for its input, or None when it is symbolic.
        self.batch = batch
        self.attributes = attributes

    # ----- errors -----

    def where(self) -> str:
        label = repr(self.name) if self.name else f"producing {self.node.output[0]!r}" if self.node.output else ""
        return f"{self.source}: node {label} ({self.op_type})"

    def error(self, problem: str) -> OnnxError:
        return OnnxError(f"{self.where()}: {problem}")

    def unsupported(self, attribute: str, value: Any, supported: str) -> OnnxError:
        return self.error(f"attribute {attribute}={value!r} is not supported; supported: {supported}")

    # ----- attributes -----

    def attr(self, name: str, default: Any = None) -> Any:
        return self.attributes.get(name, default)

    def ints(self, name: str, default: Sequence[int]) -> tuple[int, ...]:
        value = self.attributes.get(name)
        return tuple(int(v) for v in (default if value is None else value))

    # ----- inputs -----

    @property
    def input_count(self) -> int:
        """Inputs given, not counting trailing optional ones left empty."""
        names = list(self.node.input)
        while names and not names[-1]:
            names.pop()
        return len(names)

    def has_input(self, index: int) -> bool:
        return index < len(self.node.input) and bool(self.node.input[index])

    def value(self, index: int) -> Value:
        return self._values[self.node.input[index]]

    def tensor(self, index: int, what: str = "data", rank: int | None = None) -> SymbolicTensor:
        """Input ``index`` as data flowing from the model input; ``rank`` counts the batch axis."""
        value = self.value(index)
        if isinstance(value, StaticValue):
            raise self.error(f"input {index} ({what}, {self.node.input[index]!r}) is a constant; opgrad imports "
                             f"this node with {what} computed from the model input")
        if rank is not None and len(value.shape) + 1 != rank:
            raise self.error(f"input {index} ({what}) has shape (N, {', '.join(map(str, value.shape))}); "
                             f"supported: rank {rank} (NCHW with the batch axis)")
        return value

    def static(self, index: int, what: str) -> StaticValue:
        """Input ``index`` as a value known when reading the file (an initializer or a constant)."""
        value = self.value(index)
        if not isinstance(value, StaticValue):
            raise self.error(f"input {index} ({what}, {self.node.input[index]!r}) is computed from the model input; "
                             f"supported: an initializer or a constant {what}")
        return value

    def static_floats(self, index: int, what: str) -> np.ndarray:
        value = self.static(index, what)
        if value.has_batch:
            raise self.error(f"input {index} ({what}) {BATCH_ARITHMETIC}")
        if value.array.dtype.kind not in "fiu":
            raise self.error(f"input {index} ({what}) holds {value.array.dtype} values; supported: numbers")
        return np.asarray(value.array, dtype=np.float64)

    def static_ints(self, index: int, what: str) -> list[int]:
        value = self.static(index, what)
        if value.has_batch or value.array.dtype.kind not in "iu":
            raise self.error(f"input {index} ({what}) must be constant integers, got {value.array.dtype} "
                             f"{value.array.tolist()!r}")
        return [int(v) for v in value.array.ravel()]

    def is_static(self, index: int) -> bool:
        return isinstance(self.value(index), StaticValue)

    # ----- output -----

    def new(self, cls: Callable[..., Layer], *args: Any, **kwargs: Any) -> Layer:
        """``cls(*args, **kwargs)``, a refused argument reported against this node."""
        try:
            return cls(*args, **kwargs)
        except (ValueError, TypeError) as exc:
            raise self.error(str(exc)) from None

    def layer(self, layer: Layer, inputs: SymbolicTensor | list[SymbolicTensor],
              weights: dict[str, np.ndarray] | None = None) -> SymbolicTensor:
        """Call ``layer`` on ``inputs`` (named after this node) with ``weights`` for its parameters."""
        tensors = [inputs] if isinstance(inputs, SymbolicTensor) else list(inputs)
        try:
            return self._add_layer(layer, tensors, weights or {})
        except (ValueError, TypeError) as exc:
            raise self.error(str(exc)) from None

    def example_axis(self, axis: int, rank: int, attribute: str = "axis") -> int:
        """ONNX ``axis`` of a rank-``rank`` tensor (batch axis 0) as a per-example axis; refuses the batch axis."""
        if not -rank <= axis < rank:
            raise self.error(f"attribute {attribute}={axis} is out of range for a rank-{rank} input")
        if axis % rank == 0:
            raise self.error(f"attribute {attribute}={axis} names the batch axis; supported: axes 1..{rank - 1} "
                             "(opgrad models keep the batch axis)")
        return axis % rank - 1
