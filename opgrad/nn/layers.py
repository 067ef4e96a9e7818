"""Layers: functional building blocks that emit registered operators.

Why functional: a layer never holds arrays. It declares its parameters (name, shape,
initializer) once its input shape is known, and ``apply`` turns input expressions plus
parameter expressions into an output expression made only of registered ops. The training step
can then differentiate, optimize and compile the whole thing as *one* graph, and the same model
can be evaluated with any parameter values (a checkpoint, a parity test's weights) without
copying them into objects.

Layers are wired Keras-style: calling a layer on a :class:`SymbolicTensor` (from
:func:`Input` or another layer call) builds it for that input's shape and returns its output::

    inp = nn.Input((1, 28, 28))
    x = nn.Conv2D(16, 3, padding="same", activation="relu")(inp)
    y = nn.Add()([x, nn.Conv2D(16, 1)(inp)])

``opgrad.nn.model.Model`` then collects the calls into a graph. One layer object called twice
is one set of parameters (a shared layer), so its input shapes must agree.

Shapes are per example, without the batch axis (Keras' convention); a wrong wiring fails at the
call, naming the layer, instead of deep inside a step. Layout is NCHW with OIHW convolution
weights and ``(units, in)`` dense weights, as the operators expect. An ``axis`` argument counts
the batch axis as 0, as in Keras and PyTorch (``Concatenate(axis=1)`` joins NCHW channels).

Non-trainable state (``BatchNorm2D``'s running statistics) is declared by ``buffer_specs`` and
threaded through :meth:`Layer.call`, which returns the updated values; the training step makes
them extra outputs, so they are updated inside the compiled step.

Every layer's constructor arguments round-trip through :meth:`Layer.get_config` (plain JSON), and
its class is found again by ``kind`` in :data:`LAYERS`, which is how a checkpoint rebuilds a model
without the code that built it.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from opgrad import ops
from opgrad.errors import ShapeError
from opgrad.ir import Expr, const
from opgrad.nn.init import Initializer, get_initializer, initializer_name, ones, zeros
from opgrad.registry._pooling import pool_padding_problem, pooled_hw
from opgrad.registry.conv2d import conv_output_size, transpose_output_size
from opgrad.registry.normalization import batch_statistics

__all__ = [
    "ACTIVATIONS",
    "ELU",
    "GELU",
    "LAYERS",
    "Activation",
    "Add",
    "AvgPool1D",
    "AvgPool2D",
    "BatchNorm2D",
    "BufferSpec",
    "Concatenate",
    "Conv1D",
    "Conv2D",
    "Conv2DTranspose",
    "Dense",
    "Dropout",
    "Embedding",
    "Flatten",
    "ForwardContext",
    "GlobalAvgPool2D",
    "Hardsigmoid",
    "Hardswish",
    "Input",
    "Layer",
    "LayerNorm",
    "LeakyReLU",
    "MaxPool1D",
    "MaxPool2D",
    "MultiHeadAttention",
    "Node",
    "PReLU",
    "ParamSpec",
    "ReLU",
    "Rescaling",
    "SiLU",
    "Sigmoid",
    "Softmax",
    "Softplus",
    "SymbolicTensor",
    "Tanh",
    "UpSampling2D",
    "hard_sigmoid",
    "hard_swish",
]

Shape = tuple[int, ...]
#: What ``build`` takes: one per-example shape, or a list of them for a layer with several inputs.
InputShape = Shape | list[Shape]

#: Activation names of ``activation=`` and :class:`Activation` (Keras' names; ``relu6``,
#: ``hard_sigmoid`` and ``hard_swish`` as PyTorch's ``ReLU6``, ``Hardsigmoid`` and ``Hardswish``).
ACTIVATIONS = (None, "relu", "leaky_relu", "gelu", "sigmoid", "tanh", "silu", "elu", "softplus", "relu6",
               "hard_sigmoid", "hard_swish")

#: Every layer class by ``kind``, filled as classes are defined (a user's subclass included).
LAYERS: dict[str, type[Layer]] = {}


@dataclass(frozen=True)
class ParamSpec:
    """A trainable parameter a layer declares: its shape and how to initialize it."""

    shape: Shape
    init: Initializer


@dataclass(frozen=True)
class BufferSpec:
    """Non-trainable state a layer declares (running statistics): its shape and starting value.

    ``counter``: a count of steps, the same on every replica of data-parallel training, which
    keeps its own value where the running statistics are averaged over the replicas (a
    weighted float sum would move it off its integer)."""

    shape: Shape
    value: float
    counter: bool = False


@dataclass(frozen=True)
class ForwardContext:
    """What a forward pass needs besides parameters.

    ``training`` switches dropout and batch statistics on; ``noise`` maps a dropout layer's name
    to its mask input (an expression fed from a seeded numpy generator, so a compiled step stays
    deterministic). ``sync_batchnorm`` makes BatchNorm's batch statistics those of every replica's
    batch together (PyTorch's ``SyncBatchNorm``), through ``ops.cross_replica_sum``.
    """

    training: bool = False
    noise: Mapping[str, Expr] = field(default_factory=dict)
    sync_batchnorm: bool = False


def is_int(value: Any) -> bool:
    """Whether ``value`` is an integer (a Python or numpy int, not a bool, a float or a string)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """Whether ``value`` is a real number (a Python or numpy int or float, not a bool or a string)."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def as_int(value: Any, what: str) -> int:
    """``value`` as an int, or a ValueError naming ``what``: a size of 2.5 is refused, as Keras
    and PyTorch refuse it, rather than truncated to 2."""
    if not is_int(value):
        raise ValueError(f"{what} must be an int, got {value!r}")
    return int(value)


def _pair(value: Any, what: str, minimum: int = 1) -> tuple[int, int]:
    if is_int(value):
        pair = (int(value), int(value))
    else:
        try:
            items = tuple(value)
        except TypeError:  # a float, None: not a pair either
            items = ()
        if len(items) != 2 or not all(is_int(v) for v in items):
            raise ValueError(f"{what} must be an int or two ints, got {value!r}")
        pair = (int(items[0]), int(items[1]))
    if min(pair) < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value!r}")
    return pair


def _single(value: Any, what: str, minimum: int = 1) -> int:
    """A 1-D layer's size: an int or a one-element tuple (Keras and PyTorch take both)."""
    items = value if isinstance(value, (tuple, list)) and len(value) == 1 else (value,)
    number = as_int(items[0], what)
    if number < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value!r}")
    return number


def _padding_arg(padding: str | int | Sequence[int], layer: str) -> str | tuple[int, int]:
    """``"valid"``, ``"same"`` or explicit zeros as ``(ph, pw)``: ``ph`` rows above and below,
    ``pw`` columns left and right."""
    if isinstance(padding, str):
        if padding not in ("valid", "same"):
            raise ValueError(f"{layer} padding must be 'valid', 'same', an int or two ints, got {padding!r}")
        return padding
    return _pair(padding, f"{layer} padding", minimum=0)


def per_axis(pair: tuple[int, int]) -> str:
    """A (height, width) setting for a summary: ``2``, or ``1x2`` where the axes differ."""
    return str(pair[0]) if pair[0] == pair[1] else f"{pair[0]}x{pair[1]}"


def padding_text(padding: str | tuple[int, int]) -> str:
    """A layer's padding for a summary: ``same``, ``pad 1`` / ``pad 1x2``, or nothing for none."""
    if isinstance(padding, str):
        return "same" if padding == "same" else ""
    return f"pad {per_axis(padding)}" if any(padding) else ""


def _same_pads(extent: int, k: int, s: int, d: int = 1) -> tuple[int, int]:
    """TF/Keras "same": output ``ceil(extent / s)``; the odd pixel of padding goes after (bottom/right)."""
    out = -(-extent // s)
    total = max((out - 1) * s + (k - 1) * d + 1 - extent, 0)
    return total // 2, total - total // 2


def _check_activation(activation: str | None) -> str | None:
    """``activation`` checked against :data:`ACTIVATIONS`; Keras' ``"linear"`` is None (none)."""
    if activation == "linear":
        return None
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS} ('linear' is None), got {activation!r}")
    return activation


def _activate(x: Expr, activation: str | None) -> Expr:
    if activation == "relu":
        return ops.relu(x)
    if activation == "leaky_relu":
        return ops.leaky_relu(x)
    if activation == "gelu":
        return ops.gelu(x)
    if activation == "sigmoid":
        return ops.sigmoid(x)
    if activation == "tanh":
        return ops.tanh(x)
    if activation == "silu":
        return ops.multiply(x, ops.sigmoid(x))
    if activation == "elu":
        return ops.elu(x)
    if activation == "softplus":
        return ops.softplus(x)
    if activation == "relu6":
        return ops.clip(x, lo=0.0, hi=6.0)
    if activation == "hard_sigmoid":
        return hard_sigmoid(x)
    if activation == "hard_swish":
        return hard_swish(x)
    return x


def hard_sigmoid(x: Expr) -> Expr:
    """``relu6(x + 3) / 6``, as PyTorch's ``Hardsigmoid`` and Keras 3's ``hard_sigmoid`` compute it."""
    return ops.divide(ops.clip(ops.add(x, 3.0), lo=0.0, hi=6.0), 6.0)


def hard_swish(x: Expr) -> Expr:
    """``x * relu6(x + 3) / 6``, as PyTorch's ``Hardswish``: ``x`` from 3 on, else the product on
    ``x`` clipped to [-3, 3], so that the gradient is PyTorch's (0 up to -3, 1 from 3, infinities
    included) rather than the product rule's ``inf * 0``."""
    inner = ops.clip(x, lo=-3.0, hi=3.0)
    return ops.where(ops.greater(3.0, x), ops.multiply(inner, hard_sigmoid(inner)), x)


def _init_config(init: Initializer) -> str | None:
    """A registered initializer's name; a custom function is not stored (the default is used on load)."""
    return initializer_name(init)


class Node:
    """One call of a layer in a functional model: the layer, its input tensors and its output."""

    def __init__(self, layer: Layer, inputs: list[SymbolicTensor], output_shape: Shape) -> None:
        self.layer = layer
        self.inputs = inputs
        self.output = SymbolicTensor(output_shape, "float", node=self)


class SymbolicTensor:
    """A tensor in a functional model before any data exists: a per-example shape and its origin.

    Made by :func:`Input` (``node`` is None) or by calling a layer (``node`` is that call).
    ``dtype`` is ``"float"`` (the model's float type) or ``"int64"`` (indices, for ``Embedding``).
    """

    def __init__(self, shape: Sequence[int], dtype: str, *, node: Node | None = None,
                 name: str | None = None) -> None:
        self.shape: Shape = tuple(int(d) for d in shape)
        self.dtype = dtype
        self.node = node
        self.name = name

    def __repr__(self) -> str:
        origin = f"input {self.name!r}" if self.node is None else f"output of {self.node.layer.describe()}"
        return f"<SymbolicTensor {self.shape} {self.dtype}, {origin}>"


def Input(shape: Sequence[int], *, dtype: str = "float", name: str | None = None) -> SymbolicTensor:
    """A model input of per-example ``shape`` (Keras' ``keras.Input``).

    ``dtype`` is ``"float"`` (the training step's float type, float32 by default) or ``"int64"``
    (token ids for :class:`Embedding`). ``name`` defaults to ``input1``, ``input2``, ... in the
    order the model lists its inputs.
    """
    if isinstance(shape, (int, np.integer)):
        shape = (int(shape),)
    dims = tuple(shape)
    if not dims or any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1 for d in dims):
        raise ValueError(f"Input shape must be one or more positive ints (per example, no batch axis), got {shape!r}")
    if dtype not in ("float", "int64"):
        raise ValueError(f"Input dtype must be 'float' or 'int64', got {dtype!r}")
    if name is not None and (not name or "." in name or "/" in name or ":" in name):
        raise ValueError(f"Input name must be non-empty without '.', '/' or ':', got {name!r}")
    return SymbolicTensor(dims, dtype, name=name)


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _same_definition(a: type, b: type) -> bool:
    """Whether ``a`` and ``b`` are one class, or the same definition run again (module and qualname)."""
    return a is b or _class_path(a) == _class_path(b)


class Layer:
    """Base class. Subclasses set ``kind`` and implement ``output_shape_for`` and ``apply``.

    ``build(input_shape)`` is called by each call on a :class:`SymbolicTensor`; it records the
    shapes and returns the output shape. Calling a layer again (sharing it) needs the same input
    shape: another shape would silently change the parameters the first call uses.

    A layer with several inputs (``Add``, ``Concatenate``) sets ``multi_input`` and takes lists in
    ``build`` and ``apply``. A layer with non-trainable state declares ``buffer_specs`` and
    overrides :meth:`call`. A subclass with a new ``kind`` is registered in :data:`LAYERS`, so a
    checkpoint of a model using it loads wherever the subclass is defined. A kind belongs to one
    class: declaring one another class has is an error, and saving or exporting a subclass that
    inherits its parent's kind is refused (:meth:`registered_kind`).
    """

    kind: ClassVar[str] = "layer"
    multi_input: ClassVar[bool] = False
    #: ``"float"`` for most layers; ``"int64"`` for layers that take indices (``Embedding``).
    input_dtype: ClassVar[str] = "float"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "kind" in cls.__dict__:
            owner = LAYERS.get(cls.kind)
            # A checkpoint names a layer by kind alone, so a second class with the kind would make
            # every model using the first load as the second. The same class defined again (a
            # notebook cell run twice, importlib.reload) replaces itself.
            if owner is not None and not _same_definition(owner, cls):
                raise TypeError(f"layer class {_class_path(cls)} declares kind {cls.kind!r}, which "
                                f"{_class_path(owner)} already has; give {cls.__name__} a kind of its own")
            LAYERS[cls.kind] = cls

    def __init__(self, name: str | None = None) -> None:
        if name is not None and (not name or "." in name or "/" in name or ":" in name):
            raise ValueError(f"layer name must be non-empty without '.', '/' or ':', got {name!r}")
        self.name = name
        self.input_shape: Any = None
        self.output_shape: Shape | None = None

    #: False for a frozen layer (:attr:`trainable`).
    _frozen: bool = False

    @property
    def trainable(self) -> bool:
        """Whether training updates this layer's parameters (Keras' ``layer.trainable``, PyTorch's
        ``requires_grad``). A frozen layer (``layer.trainable = False``) keeps its weights: the
        training step takes no gradient for them and the optimizer keeps no state for them. A frozen
        ``BatchNorm2D`` also normalizes with its running statistics and leaves them as they are
        (Keras' fine-tuning behaviour). The flag is saved with the model's description."""
        return not self._frozen

    @trainable.setter
    def trainable(self, value: bool) -> None:
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"layer {self.describe()}: trainable takes True or False, got {value!r}")
        self._frozen = not value

    # ----- wiring -----

    def __call__(self, inputs: SymbolicTensor | Sequence[SymbolicTensor]) -> SymbolicTensor:
        """Apply the layer to a symbolic tensor (a list of them for ``Add``/``Concatenate``)."""
        if self.multi_input:
            if isinstance(inputs, SymbolicTensor) or not isinstance(inputs, Sequence) or len(inputs) < 2:
                raise TypeError(f"layer {self.describe()} takes a list of two or more tensors, got {inputs!r}")
            tensors = list(inputs)
        else:
            if not isinstance(inputs, SymbolicTensor):
                raise TypeError(f"layer {self.describe()} takes one tensor (from nn.Input or a layer), got {inputs!r}")
            tensors = [inputs]
        for tensor in tensors:
            if not isinstance(tensor, SymbolicTensor):
                raise TypeError(f"layer {self.describe()}: expected tensors from nn.Input or a layer, got {tensor!r}")
            if tensor.dtype != self.input_dtype:
                raise TypeError(f"layer {self.describe()} takes {self.input_dtype} inputs, got {tensor!r}")
        shape: InputShape = [t.shape for t in tensors] if self.multi_input else tensors[0].shape
        out = self.build(shape)
        output = Node(self, tensors, out).output
        self.__dict__.setdefault("_outputs", []).append(output)
        return output

    @property
    def output(self) -> SymbolicTensor:
        """The tensor the call of this layer made (Keras' ``layer.output``), to build a model on part
        of another: ``nn.Model(model.inputs, model.get_layer("flatten").output)``."""
        outputs = self.__dict__.get("_outputs", [])
        if len(outputs) != 1:
            raise ValueError(f"layer {self.describe()} has been called {len(outputs)} times, so it has no one "
                             "output; " + ("call it on a tensor first" if not outputs else
                                           "keep the tensor each call returns"))
        return outputs[0]  # type: ignore[no-any-return]

    def build(self, input_shape: InputShape) -> Shape:
        if self.multi_input:
            shape: InputShape = [tuple(int(d) for d in s) for s in input_shape]  # type: ignore[union-attr]
        else:
            shape = tuple(int(d) for d in input_shape)  # type: ignore[arg-type]
        if self.input_shape is not None and self.input_shape != shape:
            raise ShapeError(
                f"layer {self.describe()} was already built for input {self.input_shape}; a shared layer "
                f"needs the same input shape, so create a new layer for input {shape}"
            )
        out = self.output_shape_for(shape)
        self.input_shape, self.output_shape = shape, tuple(int(d) for d in out)
        return self.output_shape

    def output_shape_for(self, input_shape: Any) -> Shape:
        return input_shape  # type: ignore[no-any-return]

    # ----- declarations -----

    def param_specs(self) -> dict[str, ParamSpec]:
        """Local parameter names (``"weight"``, ``"bias"``) to specs; valid after ``build``."""
        return {}

    def buffer_specs(self) -> dict[str, BufferSpec]:
        """Local non-trainable state names (``"running_mean"``) to specs; valid after ``build``."""
        return {}

    def tied_params(self) -> dict[str, tuple[Layer, str]]:
        """Local parameter names this layer reads from another layer (its ``(layer, local name)``):
        one parameter, trained by both uses, declared by its owner alone (``Dense(weight_from=...)``)."""
        return {}

    def noise_shape(self) -> Shape | None:
        """Per-example shape of the random mask this layer reads while training (None: no mask)."""
        return None

    def sample_mask(self, rng: np.random.Generator, shape: Shape, dtype: str) -> np.ndarray:
        """A training step's mask of ``shape`` (batch first) for a layer with a :meth:`noise_shape`."""
        raise NotImplementedError(f"layer {self.describe()} reads no random mask")

    # ----- the forward pass -----

    def apply(self, x: Any, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        raise NotImplementedError

    def call(self, x: Any, params: Mapping[str, Expr], buffers: Mapping[str, Expr],
             ctx: ForwardContext) -> tuple[Expr, dict[str, Expr]]:
        """``(output, new buffers)``; a stateless layer returns its buffers (none) unchanged."""
        return self.apply(x, params, ctx), dict(buffers)

    # ----- description and serialization -----

    def registered_kind(self) -> str:
        """``kind``, checked to be registered in :data:`LAYERS` to this layer's own class.

        Saving, loading and exporting find a layer's class by its kind alone, so a subclass that
        inherits its parent's kind (``class Scaled(nn.Dense)`` overriding ``apply``) would come back
        as the parent, without what it changed: it is refused here instead.
        """
        cls = type(self)
        owner = LAYERS.get(cls.kind)
        if owner is not None and _same_definition(owner, cls):
            return cls.kind
        held = "names no layer class" if owner is None else f"is {owner.__name__}'s"
        raise TypeError(f"layer {self.describe()}: its class {cls.__name__} has no kind of its own (kind "
                        f"{cls.kind!r} {held}), so a checkpoint or an ONNX file could not rebuild it; give "
                        f"{cls.__name__} its own kind (kind = \"...\") and a get_config for any new arguments")

    def get_config(self) -> dict[str, Any]:
        """Constructor keyword arguments as plain JSON values (``name`` excluded)."""
        return {}

    @classmethod
    def from_config(cls, config: Mapping[str, Any], name: str | None = None) -> Layer:
        """The layer :meth:`get_config` describes; an initializer stored as None (custom) gets the default."""
        return cls(**{k: v for k, v in config.items() if not (k.endswith("_initializer") and v is None)}, name=name)

    def config(self) -> str:
        return ""

    def describe(self) -> str:
        cfg = self.config()
        label = f"{type(self).__name__}{'(' + cfg + ')' if cfg else ''}"
        return f"{self.name!r} ({label})" if self.name else label

    def _shape_error(self, input_shape: Any, problem: str) -> ShapeError:
        return ShapeError(f"layer {self.describe()}: input shape {input_shape} (per example): {problem}")


class Dense(Layer):
    """``x @ weight.T + bias`` with ``weight`` shaped ``(units, in)``; optional activation.

    Over the last axis of each example, as PyTorch's ``Linear`` and Keras' ``Dense``: features
    ``(in,)`` give ``(units,)``, a sequence ``(T, in)`` gives ``(T, units)``, every row by the same
    weights."""

    kind = "dense"

    def __init__(self, units: int, activation: str | None = None, use_bias: bool = True, *,
                 kernel_initializer: str | Initializer = "glorot_uniform",
                 bias_initializer: str | Initializer = "zeros", weight_from: Embedding | str | None = None,
                 name: str | None = None) -> None:
        super().__init__(name)
        if as_int(units, "Dense units") < 1:
            raise ValueError(f"Dense units must be >= 1, got {units}")
        self.units = int(units)
        self.activation = _check_activation(activation)
        self.use_bias = bool(use_bias)
        self.kernel_init = get_initializer(kernel_initializer)
        self.bias_init = get_initializer(bias_initializer)
        #: The Embedding whose table is this layer's weight (tied: a language model's output layer
        #: scoring each token by its embedding, PyTorch's ``head.weight = embedding.weight``), or
        #: its name until a loaded model's layers are linked (:meth:`link_tied`).
        self.weight_from: Embedding | str | None = None
        if weight_from is not None:
            if not isinstance(weight_from, (Embedding, str)):
                raise TypeError(f"Dense weight_from takes an Embedding layer, got {weight_from!r}")
            if isinstance(weight_from, Embedding) and weight_from.input_dim != self.units:
                raise ValueError(f"Dense({units}) weight_from {weight_from.describe()}: its table has "
                                 f"{weight_from.input_dim} rows, one per unit is needed (units = input_dim)")
            self.weight_from = weight_from

    def link_tied(self, layers: Mapping[str, Layer]) -> None:
        """Replace a ``weight_from`` name (a loaded description's) by the layer of that name."""
        if isinstance(self.weight_from, str):
            owner = layers.get(self.weight_from)
            if not isinstance(owner, Embedding):
                raise ValueError(f"layer {self.describe()} takes its weight from layer {self.weight_from!r}, "
                                 "which is no Embedding of the model")
            self.weight_from = owner

    def get_config(self) -> dict[str, Any]:
        tied = self.weight_from if isinstance(self.weight_from, str) or self.weight_from is None else \
            self.weight_from.name
        return {"units": self.units, "activation": self.activation, "use_bias": self.use_bias,
                "kernel_initializer": _init_config(self.kernel_init), "bias_initializer": _init_config(self.bias_init),
                **({"weight_from": tied} if tied is not None else {})}

    def config(self) -> str:
        tied = self.weight_from if isinstance(self.weight_from, str) or self.weight_from is None else \
            self.weight_from.name
        return f"{self.units}" + (f", {self.activation}" if self.activation else "") + (
            f", weight of {tied!r}" if tied is not None else "")

    def output_shape_for(self, input_shape: Shape) -> Shape:
        if not input_shape:
            raise self._shape_error(input_shape, "Dense needs features (in,) or rows of them (..., in)")
        if isinstance(self.weight_from, Embedding) and input_shape[-1] != self.weight_from.output_dim:
            raise self._shape_error(input_shape, f"its weight is the table of {self.weight_from.describe()}, rows of "
                                                 f"{self.weight_from.output_dim}: the input's last axis must be that")
        return (*input_shape[:-1], self.units)

    def param_specs(self) -> dict[str, ParamSpec]:
        assert self.input_shape is not None, "build() first"
        specs = {} if self.weight_from is not None else {
            "weight": ParamSpec((self.units, self.input_shape[-1]), self.kernel_init)}
        if self.use_bias:
            specs["bias"] = ParamSpec((self.units,), self.bias_init)
        return specs

    def tied_params(self) -> dict[str, tuple[Layer, str]]:
        if self.weight_from is None:
            return {}
        if isinstance(self.weight_from, str):
            raise ValueError(f"layer {self.describe()}: its weight_from {self.weight_from!r} is not linked to a layer")
        return {"weight": (self.weight_from, "weight")}

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        rows = x.shape[:-1]
        # Rows of several axes are one matrix of rows for the GEMM (a view), then their shape again.
        flat = x if x.ndim == 2 else ops.reshape(x, shape=(math.prod(rows), x.shape[-1]))
        y = ops.dense(flat, params["weight"])
        if self.use_bias:
            y = ops.bias_add(y, params["bias"], axis=1)
        if x.ndim != 2:
            y = ops.reshape(y, shape=(*rows, self.units))
        return _activate(y, self.activation)


class Conv2D(Layer):
    """2-D convolution (NCHW data, OIHW weight) plus a per-channel bias; optional activation.

    ``padding`` is ``"valid"`` (Keras' default, no padding), ``"same"`` (TF/Keras semantics for
    any stride and dilation: output ``ceil(in / stride)``, the odd pixel of padding at the bottom
    and right) or explicit zeros per side as an int
    or a pair (PyTorch's ``padding``). ``dilation_rate`` spaces the kernel taps. ``groups`` splits
    the channels into independent convolutions (PyTorch's; ``groups == channels`` is depthwise),
    so the weight is ``(filters, channels / groups, KH, KW)``.
    """

    kind = "conv"

    def __init__(self, filters: int, kernel_size: int | Sequence[int], strides: int | Sequence[int] = 1,
                 padding: str | int | Sequence[int] = "valid", *, dilation_rate: int | Sequence[int] = 1,
                 groups: int = 1, activation: str | None = None, use_bias: bool = True,
                 kernel_initializer: str | Initializer = "glorot_uniform",
                 bias_initializer: str | Initializer = "zeros", name: str | None = None) -> None:
        super().__init__(name)
        cls = type(self).__name__
        if as_int(filters, f"{cls} filters") < 1:
            raise ValueError(f"{cls} filters must be >= 1, got {filters}")
        if not is_int(groups) or int(groups) < 1 or int(filters) % int(groups):
            raise ValueError(f"{cls} groups must be a positive divisor of filters={filters}, got {groups!r}")
        self.groups = int(groups)
        self.filters = int(filters)
        self.kernel_size = _pair(kernel_size, f"{cls} kernel_size")
        self.strides = _pair(strides, f"{cls} strides")
        self.dilation_rate = _pair(dilation_rate, f"{cls} dilation_rate")
        self.padding = _padding_arg(padding, cls)
        self.activation = _check_activation(activation)
        self.use_bias = bool(use_bias)
        self.kernel_init = get_initializer(kernel_initializer)
        self.bias_init = get_initializer(bias_initializer)

    def get_config(self) -> dict[str, Any]:
        return {"filters": self.filters, "kernel_size": list(self.kernel_size), "strides": list(self.strides),
                "padding": self.padding if isinstance(self.padding, str) else list(self.padding),
                "dilation_rate": list(self.dilation_rate), "groups": self.groups, "activation": self.activation,
                "use_bias": self.use_bias, "kernel_initializer": _init_config(self.kernel_init),
                "bias_initializer": _init_config(self.bias_init)}

    def config(self) -> str:
        kh, kw = self.kernel_size
        extras = [f"stride {per_axis(self.strides)}" if self.strides != (1, 1) else "",
                  f"dilation {per_axis(self.dilation_rate)}" if self.dilation_rate != (1, 1) else "",
                  f"groups {self.groups}" if self.groups != 1 else "", padding_text(self.padding),
                  self.activation or ""]
        return ", ".join([f"{self.filters}", f"{kh}x{kw}", *(e for e in extras if e)])

    def pads(self, height: int, width: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """``((top, bottom), (left, right))`` zeros for an input of this size."""
        if self.padding == "valid":
            return (0, 0), (0, 0)
        if self.padding == "same":
            return (_same_pads(height, self.kernel_size[0], self.strides[0], self.dilation_rate[0]),
                    _same_pads(width, self.kernel_size[1], self.strides[1], self.dilation_rate[1]))
        assert not isinstance(self.padding, str)
        ph, pw = self.padding
        return (ph, ph), (pw, pw)

    def output_shape_for(self, input_shape: Shape) -> Shape:
        if len(input_shape) != 3:
            raise self._shape_error(input_shape, "Conv2D needs (channels, height, width)")
        c, h, w = input_shape
        # Keras' default image layout is (height, width, channels); here it would read as 28 or 32
        # channels of a strip a few pixels wide.
        looks = (f"{tuple(input_shape)} looks channels-last (height, width, channels), Keras' default: opgrad's "
                 f"images are (channels, height, width), as PyTorch's: give ({w}, {c}, {h})"
                 if w <= 4 < c and w < h else "")
        hint = f"; {looks}" if looks else ""
        if c % self.groups:
            raise self._shape_error(input_shape, f"{c} input channels do not split into {self.groups} groups{hint}")
        size = []
        for axis, extent, k, s, d, (before, after) in zip(("height", "width"), (h, w), self.kernel_size,
                                                           self.strides, self.dilation_rate, self.pads(h, w)):
            out = conv_output_size(extent, k, s, before + after, d)
            if out < 1:
                raise self._shape_error(input_shape, f"the {k}-wide kernel does not fit the {axis} {extent} "
                                                     f"(+{before}+{after} padding){hint}")
            size.append(out)
        if looks and c == h:  # a square image: building would go on with a strip of it
            warnings.warn(f"layer {self.describe()}: input shape {looks}", UserWarning, stacklevel=4)
        return (self.filters, size[0], size[1])

    def param_specs(self) -> dict[str, ParamSpec]:
        assert self.input_shape is not None, "build() first"
        specs = {"weight": ParamSpec((self.filters, self.input_shape[0] // self.groups, *self.kernel_size),
                                     self.kernel_init)}
        if self.use_bias:
            specs["bias"] = ParamSpec((self.filters,), self.bias_init)
        return specs

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        (top, bottom), (left, right) = self.pads(x.shape[2], x.shape[3])
        # An asymmetric "same" goes to the conv as four sides: its kernels read the zeros where
        # they fall, with no padded copy of the input before and none of its gradient after.
        y = ops.conv2d(x, params["weight"], strides=self.strides, padding=(top, left, bottom, right),
                       dilation=self.dilation_rate, groups=self.groups)
        if self.use_bias:
            y = ops.bias_add(y, params["bias"], axis=1)
        return _activate(y, self.activation)


def one_d_shape_errors(layer: Layer, input_shape: Shape, two_d: Callable[[Shape], Shape]) -> Shape:
    """``two_d`` (a 2-D layer's shape rule) on the ``(channels, 1, length)`` view of a 1-D layer's
    ``(channels, length)`` input; its errors name the shape the user gave, and the length."""
    try:
        return two_d((input_shape[0], 1, input_shape[1]))
    except ShapeError as exc:
        problem = str(exc).partition("(per example): ")[2] or str(exc)
        raise layer._shape_error(input_shape, problem.replace("the width", "the length")) from None


class Conv1D(Conv2D):
    """1-D convolution over ``(channels, length)`` (PyTorch's ``Conv1d``; Keras' ``Conv1D`` with
    ``channels_first``) plus a per-channel bias; optional activation.

    The weight is PyTorch's ``(filters, channels / groups, kernel_size)``. ``padding`` is
    ``"valid"``, ``"same"`` (output ``ceil(length / stride)``, the odd zero at the end) or zeros
    on each side (PyTorch's ``padding``). It runs as a ``Conv2D`` over a ``(channels, 1, length)``
    view, so it takes the same kernels, and its gradients, compiled.
    """

    kind = "conv1d"

    def __init__(self, filters: int, kernel_size: int | Sequence[int], strides: int | Sequence[int] = 1,
                 padding: str | int | Sequence[int] = "valid", *, dilation_rate: int | Sequence[int] = 1,
                 groups: int = 1, activation: str | None = None, use_bias: bool = True,
                 kernel_initializer: str | Initializer = "glorot_uniform",
                 bias_initializer: str | Initializer = "zeros", name: str | None = None) -> None:
        k, s, d = (_single(kernel_size, "Conv1D kernel_size"), _single(strides, "Conv1D strides"),
                   _single(dilation_rate, "Conv1D dilation_rate"))
        pad: str | tuple[int, int] = padding if isinstance(padding, str) else (0, _single(padding, "Conv1D padding", 0))
        super().__init__(filters, (1, k), (1, s), pad, dilation_rate=(1, d), groups=groups, activation=activation,
                         use_bias=use_bias, kernel_initializer=kernel_initializer,
                         bias_initializer=bias_initializer, name=name)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "kernel_size": self.kernel_size[1], "strides": self.strides[1],
                "padding": self.padding if isinstance(self.padding, str) else self.padding[1],
                "dilation_rate": self.dilation_rate[1]}

    def config(self) -> str:
        extras = [f"stride {self.strides[1]}" if self.strides[1] != 1 else "",
                  f"dilation {self.dilation_rate[1]}" if self.dilation_rate[1] != 1 else "",
                  f"groups {self.groups}" if self.groups != 1 else "",
                  self.padding if self.padding == "same" else f"pad {self.padding[1]}" if
                  not isinstance(self.padding, str) and self.padding[1] else "", self.activation or ""]
        return ", ".join([f"{self.filters}", f"{self.kernel_size[1]}", *(e for e in extras if e)])

    def output_shape_for(self, input_shape: Shape) -> Shape:
        if len(input_shape) != 2:
            raise self._shape_error(input_shape, "Conv1D needs (channels, length)")
        c, length = input_shape
        try:
            filters, _, out = one_d_shape_errors(self, input_shape, super().output_shape_for)
        except ShapeError:
            # (steps, channels) given for (channels, length): many steps read as channels of a short strip.
            span = self.dilation_rate[1] * (self.kernel_size[1] - 1) + 1
            if c >= 4 * length and c >= span:
                raise self._shape_error(input_shape, f"{tuple(input_shape)} looks channels-last (steps, channels), "
                                                     f"Keras' default: opgrad's sequences are (channels, length), as "
                                                     f"PyTorch's Conv1d: give ({length}, {c})") from None
            raise
        return (filters, out)

    def param_specs(self) -> dict[str, ParamSpec]:
        specs = super().param_specs()  # the weight of the 2-D view, (filters, channels / groups, 1, k)
        filters, per_group, _, k = specs["weight"].shape
        specs["weight"] = ParamSpec((filters, per_group, k), self.kernel_init)
        return specs

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        n, c, length = x.shape
        weight = params["weight"]
        as_2d = {**params, "weight": ops.reshape(weight, shape=(weight.shape[0], weight.shape[1], 1, weight.shape[2]))}
        y = super().apply(ops.reshape(x, shape=(n, c, 1, length)), as_2d, ctx)
        return ops.reshape(y, shape=(n, y.shape[1], y.shape[3]))


class Conv2DTranspose(Conv2D):
    """Transposed convolution (PyTorch's ``ConvTranspose2d``, Keras' ``Conv2DTranspose``), NCHW.

    The weight is PyTorch's ``(channels, filters / groups, KH, KW)``. ``padding`` is ``"valid"``
    (output ``(in - 1) * stride + dilation * (KH - 1) + 1``), ``"same"`` (Keras: output
    ``in * stride``, cropping the odd pixel at the bottom/right, the adjoint of ``Conv2D``'s
    "same") or explicit pixels cropped per side (PyTorch's ``padding``); ``output_padding`` adds
    rows/columns at the bottom/right (each smaller than its stride or its dilation), as PyTorch's.
    """

    kind = "convtranspose"

    def __init__(self, filters: int, kernel_size: int | Sequence[int], strides: int | Sequence[int] = 1,
                 padding: str | int | Sequence[int] = "valid", *, output_padding: int | Sequence[int] = 0,
                 dilation_rate: int | Sequence[int] = 1, groups: int = 1, activation: str | None = None,
                 use_bias: bool = True, kernel_initializer: str | Initializer = "glorot_uniform",
                 bias_initializer: str | Initializer = "zeros", name: str | None = None) -> None:
        super().__init__(filters, kernel_size, strides=strides, padding=padding, dilation_rate=dilation_rate,
                         groups=groups, activation=activation, use_bias=use_bias,
                         kernel_initializer=kernel_initializer, bias_initializer=bias_initializer, name=name)
        self.output_padding = _pair(output_padding, f"{type(self).__name__} output_padding", minimum=0)
        if any(o >= max(s, d) for o, s, d in zip(self.output_padding, self.strides, self.dilation_rate)):
            raise ValueError(f"Conv2DTranspose output_padding {self.output_padding} must be smaller than the stride "
                             f"or the dilation of its axis (PyTorch's rule); strides {self.strides}, dilation_rate "
                             f"{self.dilation_rate}")

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "output_padding": list(self.output_padding)}

    def crops(self) -> tuple[tuple[int, int, int, int], tuple[int, int], tuple[int, int]]:
        """``((top, left, bottom, right) cropped, output_padding, (rows, columns) of zeros after)``:
        what the op takes, and the zeros to append to its output.

        The op takes output_padding below the stride; PyTorch takes it below the stride or the
        dilation. Such extra rows first take back rows the crop drops, then are rows no input
        reaches: zeros, which the op adds up to its limit and a padding after it.
        """
        if self.padding == "same":
            pads, extra = [], []
            for k, s, d in zip(self.kernel_size, self.strides, self.dilation_rate):
                total = d * (k - 1) + 1 - s
                pads.append((total // 2, total - total // 2) if total >= 0 else (0, 0))
                extra.append(max(-total, 0))
            return (pads[0][0], pads[1][0], pads[0][1], pads[1][1]), (extra[0], extra[1]), (0, 0)
        (top, bottom), (left, right) = self.pads(1, 1)
        after, below_stride, zeros = [bottom, right], [0, 0], [0, 0]
        for i, (more, stride) in enumerate(zip(self.output_padding, self.strides)):
            uncropped = min(more, after[i]) if more >= stride else 0
            after[i] -= uncropped
            below_stride[i] = min(more - uncropped, stride - 1)
            zeros[i] = more - uncropped - below_stride[i]
        return (top, left, after[0], after[1]), (below_stride[0], below_stride[1]), (zeros[0], zeros[1])

    def output_shape_for(self, input_shape: Shape) -> Shape:
        if len(input_shape) != 3:
            raise self._shape_error(input_shape, "Conv2DTranspose needs (channels, height, width)")
        c, h, w = input_shape
        if c % self.groups:
            raise self._shape_error(input_shape, f"{c} input channels do not split into {self.groups} groups")
        (top, left, bottom, right), extra, zeros = self.crops()
        size = []
        for extent, k, s, d, crop, more, appended in zip((h, w), self.kernel_size, self.strides, self.dilation_rate,
                                                         (top + bottom, left + right), extra, zeros):
            out = transpose_output_size(extent, k, s, crop, d, more) + appended
            if out < 1:
                raise self._shape_error(input_shape, f"padding {self.padding} crops the whole output")
            size.append(out)
        return (self.filters, size[0], size[1])

    def param_specs(self) -> dict[str, ParamSpec]:
        assert self.input_shape is not None, "build() first"
        specs = {"weight": ParamSpec((self.input_shape[0], self.filters // self.groups, *self.kernel_size),
                                     self.kernel_init)}
        if self.use_bias:
            specs["bias"] = ParamSpec((self.filters,), self.bias_init)
        return specs

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        crop, extra, (rows, columns) = self.crops()
        y = ops.conv2d_transpose(x, params["weight"], strides=self.strides, padding=crop, output_padding=extra,
                                 dilation=self.dilation_rate, groups=self.groups)
        if rows or columns:
            y = ops.pad(y, pad_width=((0, 0), (0, 0), (0, rows), (0, columns)))
        if self.use_bias:
            y = ops.bias_add(y, params["bias"], axis=1)
        return _activate(y, self.activation)


class UpSampling2D(Layer):
    """``(C, H, W) -> (C, H*size, W*size)`` by repeating pixels (``"nearest"``) or ``"bilinear"``
    interpolation (``torch.nn.functional.interpolate`` with ``align_corners=False``)."""

    kind = "upsampling"

    def __init__(self, size: int = 2, *, interpolation: str = "nearest", name: str | None = None) -> None:
        super().__init__(name)
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"UpSampling2D size must be a positive int (one factor for both axes), got {size!r}")
        if interpolation not in ("nearest", "bilinear"):
            raise ValueError(f"UpSampling2D interpolation must be 'nearest' or 'bilinear', got {interpolation!r}")
        self.size, self.interpolation = int(size), interpolation

    def get_config(self) -> dict[str, Any]:
        return {"size": self.size, "interpolation": self.interpolation}

    def config(self) -> str:
        return f"{self.size}x, {self.interpolation}"

    def output_shape_for(self, input_shape: Shape) -> Shape:
        if len(input_shape) != 3:
            raise self._shape_error(input_shape, "UpSampling2D needs (channels, height, width)")
        c, h, w = input_shape
        return (c, h * self.size, w * self.size)

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        return ops.upsampling(x, self.size, method=self.interpolation)


class _Pool2D(Layer):
    def __init__(self, pool_size: int | Sequence[int] = 2, strides: int | Sequence[int] | None = None,
                 padding: str | int | Sequence[int] = "valid", *, ceil_mode: bool = False,
                 name: str | None = None) -> None:
        super().__init__(name)
        cls = type(self).__name__
        self.pool_size = _pair(pool_size, f"{cls} pool_size")
        self.strides = self.pool_size if strides is None else _pair(strides, f"{cls} strides")
        self.padding = _padding_arg(padding, cls)
        problem = pool_padding_problem(self.pool_size, self.padding) if isinstance(self.padding, tuple) else None
        if problem:
            raise ValueError(f"pool {problem}")
        if not isinstance(ceil_mode, (bool, np.bool_)):
            raise ValueError(f"{cls} ceil_mode must be True or False, got {ceil_mode!r}")
        if ceil_mode and self.padding == "same":
            raise ValueError(f"{cls} ceil_mode applies to 'valid' or explicit padding; 'same' sizes the output itself")
        #: PyTorch's ceil_mode: the output size rounds up, keeping windows that start inside the input.
        self.ceil_mode = bool(ceil_mode)

    def get_config(self) -> dict[str, Any]:
        return {"pool_size": list(self.pool_size), "strides": list(self.strides),
                "padding": self.padding if isinstance(self.padding, str) else list(self.padding),
                **({"ceil_mode": True} if self.ceil_mode else {})}

    def config(self) -> str:
        extras = [f"stride {per_axis(self.strides)}" if self.strides != self.pool_size else "",
                  padding_text(self.padding), "ceil_mode" if self.ceil_mode else ""]
        return ", ".join([f"{self.pool_size[0]}x{self.pool_size[1]}", *(e for e in extras if e)])

    def pads(self, height: int, width: int) -> tuple[tuple[int, int], tuple[int, int]]:
        if self.padding == "valid":
            return (0, 0), (0, 0)
        if self.padding == "same":
            return (_same_pads(height, self.pool_size[0], self.strides[0]),
                    _same_pads(width, self.pool_size[1], self.strides[1]))
        assert not isinstance(self.padding, str)
        ph, pw = self.padding
        return (ph, ph), (pw, pw)

    def output_shape_for(self, input_shape: Shape) -> Shape:
        if len(input_shape) != 3:
            raise self._shape_error(input_shape, f"{type(self).__name__} needs (channels, height, width)")
        c, h, w = input_shape
        (top, bottom), (left, right) = self.pads(h, w)
        # apply() hands the op the odd bottom/right pixel of "same" padding as input rows and columns.
        attrs = {"pool_size": self.pool_size, "strides": self.strides, "padding": (top, left),
                 "ceil_mode": self.ceil_mode}
        try:
            oh, ow = pooled_hw((h + bottom - top, w + right - left), attrs)
        except ShapeError:
            raise self._shape_error(input_shape, f"the {self.config()} pool does not fit") from None
        return (c, oh, ow)


class MaxPool2D(_Pool2D):
    """Maximum over each window; strides default to the pool size, as in Keras.

    Padding never wins a window (PyTorch's and TF's semantics); ``"same"`` is TF's.
    """

    kind = "maxpool"

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        (top, bottom), (left, right) = self.pads(x.shape[2], x.shape[3])
        if bottom != top or right != left:  # asymmetric "same": -inf never wins a max
            x = ops.pad(x, pad_width=((0, 0), (0, 0), (0, bottom - top), (0, right - left)), value=-math.inf)
        return ops.max_pool2d(x, pool_size=self.pool_size, strides=self.strides, padding=(top, left),
                              ceil_mode=self.ceil_mode)


class AvgPool2D(_Pool2D):
    """Mean over each window; strides default to the pool size, as in Keras.

    Explicit padding counts the zeros unless ``count_include_pad=False`` (PyTorch's option and
    default); ``"same"`` averages only the real pixels of each window, as TF/Keras do.
    ``ceil_mode`` is PyTorch's.
    """

    kind = "avgpool"

    def __init__(self, pool_size: int | Sequence[int] = 2, strides: int | Sequence[int] | None = None,
                 padding: str | int | Sequence[int] = "valid", *, ceil_mode: bool = False,
                 count_include_pad: bool | None = None, name: str | None = None) -> None:
        super().__init__(pool_size, strides=strides, padding=padding, ceil_mode=ceil_mode, name=name)
        if count_include_pad is not None and not isinstance(count_include_pad, (bool, np.bool_)):
            raise ValueError(f"AvgPool2D count_include_pad must be True or False, got {count_include_pad!r}")
        if count_include_pad and self.padding == "same":
            raise ValueError("AvgPool2D 'same' padding averages the real pixels only (TF's); count_include_pad=True "
                             "needs explicit padding")
        self.count_include_pad = self.padding != "same" if count_include_pad is None else bool(count_include_pad)

    def get_config(self) -> dict[str, Any]:
        counts_padding = self.padding != "same"
        return {**super().get_config(),
                **({"count_include_pad": self.count_include_pad} if self.count_include_pad != counts_padding else {})}

    def config(self) -> str:
        excluded = not self.count_include_pad and self.padding not in ("same", "valid")
        return super().config() + (", count_include_pad=False" if excluded else "")

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        (top, bottom), (left, right) = self.pads(x.shape[2], x.shape[3])
        if self.padding != "same" or (top, bottom, left, right) == (0, 0, 0, 0):
            return ops.avg_pool2d(x, pool_size=self.pool_size, strides=self.strides, padding=(top, left),
                                  ceil_mode=self.ceil_mode, count_include_pad=self.count_include_pad)
        widths = ((0, 0), (0, 0), (top, bottom), (left, right))
        summed = ops.avg_pool2d(ops.pad(x, pad_width=widths), pool_size=self.pool_size, strides=self.strides)
        real = ops.avg_pool2d(ops.pad(ops.ones_like(x), pad_width=widths), pool_size=self.pool_size,
                              strides=self.strides)
        return ops.divide(summed, real)


class _Pool1D(_Pool2D):
    """A pool over ``(channels, length)``: the 2-D pool over a ``(channels, 1, length)`` view."""

    def __init__(self, pool_size: int | Sequence[int] = 2, strides: int | Sequence[int] | None = None,
                 padding: str | int | Sequence[int] = "valid", *, ceil_mode: bool = False,
                 name: str | None = None, **more: Any) -> None:
        cls = type(self).__name__
        size = _single(pool_size, f"{cls} pool_size")
        stride = size if strides is None else _single(strides, f"{cls} strides")
        pad: str | tuple[int, int] = padding if isinstance(padding, str) else (0, _single(padding, f"{cls} padding", 0))
        super().__init__((1, size), (1, stride), pad, ceil_mode=ceil_mode, name=name, **more)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "pool_size": self.pool_size[1], "strides": self.strides[1],
                "padding": self.padding if isinstance(self.padding, str) else self.padding[1]}

    def config(self) -> str:
        padding = self.padding if isinstance(self.padding, str) else self.padding[1]
        extras = [f"stride {self.strides[1]}" if self.strides[1] != self.pool_size[1] else "",
                  "same" if padding == "same" else f"pad {padding}" if padding and padding != "valid" else "",
                  "ceil_mode" if self.ceil_mode else "",
                  "count_include_pad=False" if not getattr(self, "count_include_pad", True) and not
                  isinstance(self.padding, str) else ""]
        return ", ".join([str(self.pool_size[1]), *(e for e in extras if e)])

    def output_shape_for(self, input_shape: Shape) -> Shape:
        if len(input_shape) != 2:
            raise self._shape_error(input_shape, f"{type(self).__name__} needs (channels, length)")
        c, _, out = one_d_shape_errors(self, input_shape, super().output_shape_for)
        return (c, out)

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        n, c, length = x.shape
        y = super().apply(ops.reshape(x, shape=(n, c, 1, length)), params, ctx)
        return ops.reshape(y, shape=(n, c, y.shape[3]))


class MaxPool1D(_Pool1D, MaxPool2D):
    """Maximum over each window of ``(channels, length)`` (PyTorch's ``MaxPool1d``, Keras' ``MaxPooling1D``
    with ``channels_first``); strides default to the pool size."""

    kind = "maxpool1d"


class AvgPool1D(_Pool1D, AvgPool2D):
    """Mean over each window of ``(channels, length)`` (PyTorch's ``AvgPool1d``, Keras' ``AveragePooling1D``
    with ``channels_first``); ``count_include_pad`` and ``ceil_mode`` as :class:`AvgPool2D`'s."""

    kind = "avgpool1d"


class GlobalAvgPool2D(Layer):
    """``(C, H, W) -> (C,)``: the mean of each channel (Keras' ``GlobalAveragePooling2D``)."""

    kind = "globalavgpool"

    def output_shape_for(self, input_shape: Shape) -> Shape:
        if len(input_shape) != 3:
            raise self._shape_error(input_shape, "GlobalAvgPool2D needs (channels, height, width)")
        return (input_shape[0],)

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        return ops.flatten(ops.global_avg_pool2d(x))


class Flatten(Layer):
    """``(C, H, W) -> (C*H*W,)`` in NCHW order (Keras flattens NHWC: weights do not transfer as-is)."""

    kind = "flatten"

    def output_shape_for(self, input_shape: Shape) -> Shape:
        return (int(np.prod(input_shape, dtype=np.int64)),)

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        return ops.flatten(x)


# ----- activations -----


class ReLU(Layer):
    """``max(x, 0)``."""

    kind = "relu"

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        return ops.relu(x)


class LeakyReLU(Layer):
    """``x if x > 0 else negative_slope * x`` (PyTorch's default slope 0.01)."""

    kind = "leakyrelu"

    def __init__(self, negative_slope: float = 0.01, *, name: str | None = None) -> None:
        super().__init__(name)
        if not (is_number(negative_slope) and math.isfinite(float(negative_slope))):
            raise ValueError(f"LeakyReLU negative_slope must be a finite number (PyTorch's takes a negative one "
                             f"too), got {negative_slope!r}")
        self.negative_slope = float(negative_slope)

    def get_config(self) -> dict[str, Any]:
        return {"negative_slope": self.negative_slope}

    def config(self) -> str:
        return f"{self.negative_slope:g}"

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        return ops.leaky_relu(x, alpha=self.negative_slope)


class GELU(Layer):
    """Gaussian error linear unit; ``approximate`` is ``"none"`` (erf, PyTorch's default) or ``"tanh"``."""

    kind = "gelu"

    def __init__(self, approximate: str = "none", *, name: str | None = None) -> None:
        super().__init__(name)
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def get_config(self) -> dict[str, Any]:
        return {"approximate": self.approximate}

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        return ops.gelu(x, approximate=self.approximate)


class Sigmoid(Layer):
    """``1 / (1 + exp(-x))``."""

    kind = "sigmoid"

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        return ops.sigmoid(x)


class Tanh(Layer):
    """``tanh(x)``."""

    kind = "tanh"

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        return ops.tanh(x)


class SiLU(Layer):
    """``x * sigmoid(x)`` (PyTorch's ``SiLU``, Keras' ``silu``/``swish``)."""

    kind = "silu"

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        return _activate(x, "silu")


class ELU(Layer):
    """``x if x > 0 else alpha * (exp(x) - 1)`` (PyTorch's default ``alpha`` 1)."""

    kind = "elu"

    def __init__(self, alpha: float = 1.0, *, name: str | None = None) -> None:
        super().__init__(name)
        if not math.isfinite(float(alpha)):
            raise ValueError(f"ELU alpha must be a finite number, got {alpha!r}")
        self.alpha = float(alpha)

    def get_config(self) -> dict[str, Any]:
        return {"alpha": self.alpha}

    def config(self) -> str:
        return f"{self.alpha:g}" if self.alpha != 1.0 else ""

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        return ops.elu(x, alpha=self.alpha)


class Softplus(Layer):
    """``log(1 + exp(beta * x)) / beta``, linear where ``beta * x > threshold`` (PyTorch's defaults 1 and 20)."""

    kind = "softplus"

    def __init__(self, beta: float = 1.0, threshold: float = 20.0, *, name: str | None = None) -> None:
        super().__init__(name)
        if not (math.isfinite(float(beta)) and float(beta) > 0 and math.isfinite(float(threshold))):
            raise ValueError(f"Softplus beta must be a finite number > 0 and threshold finite, got {beta!r}, "
                             f"{threshold!r}")
        self.beta, self.threshold = float(beta), float(threshold)

    def get_config(self) -> dict[str, Any]:
        return {"beta": self.beta, "threshold": self.threshold}

    def config(self) -> str:
        return "" if (self.beta, self.threshold) == (1.0, 20.0) else f"beta {self.beta:g}, threshold {self.threshold:g}"

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        return ops.softplus(x, beta=self.beta, threshold=self.threshold)


class Hardsigmoid(Layer):
    """``relu6(x + 3) / 6`` (PyTorch's ``Hardsigmoid``, Keras 3's ``hard_sigmoid``)."""

    kind = "hardsigmoid"

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        return hard_sigmoid(x)


class Hardswish(Layer):
    """``x * relu6(x + 3) / 6`` (PyTorch's ``Hardswish``, Keras 3's ``hard_swish``)."""

    kind = "hardswish"

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        return _activate(x, "hard_swish")


class PReLU(Layer):
    """``x if x > 0 else a * x`` with a learned slope ``a``: one shared (``num_parameters=1``) or
    one per channel (axis 1, ``num_parameters`` = channels), starting at ``init``, as PyTorch's
    ``PReLU``; its parameter is ``weight``."""

    kind = "prelu"

    def __init__(self, num_parameters: int = 1, init: float = 0.25, *, name: str | None = None) -> None:
        super().__init__(name)
        self.num_parameters = as_int(num_parameters, "PReLU num_parameters")
        if self.num_parameters < 1 or not math.isfinite(float(init)):
            raise ValueError(f"PReLU needs num_parameters >= 1 and a finite init, got {num_parameters!r}, {init!r}")
        self.init = float(init)

    def get_config(self) -> dict[str, Any]:
        return {"num_parameters": self.num_parameters, "init": self.init}

    def config(self) -> str:
        return f"{self.num_parameters}" if self.num_parameters != 1 else ""

    def output_shape_for(self, input_shape: Shape) -> Shape:
        if self.num_parameters != 1 and (not input_shape or input_shape[0] != self.num_parameters):
            raise self._shape_error(input_shape, f"{self.num_parameters} slopes need {self.num_parameters} channels "
                                                 "on axis 1")
        return input_shape

    def param_specs(self) -> dict[str, ParamSpec]:
        value = self.init

        def constant(shape: tuple[int, ...], rng: np.random.Generator, dtype: str = "float32") -> np.ndarray:
            return np.full(shape, value, dtype=dtype)

        return {"weight": ParamSpec((self.num_parameters,), constant)}

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        return ops.prelu(x, params["weight"], axis=1)


class Softmax(Layer):
    """``exp(x) / sum(exp(x))`` along ``axis`` (batch axis = 0; -1 is the last axis), Keras' ``Softmax``.

    A classifier trained here ends in logits, because the loss applies the softmax itself; this
    layer is for a softmax inside a model, or for a model whose outputs must be probabilities.
    """

    kind = "softmax"

    def __init__(self, axis: int = -1, *, name: str | None = None) -> None:
        super().__init__(name)
        self.axis = as_int(axis, f"{type(self).__name__} axis")

    def get_config(self) -> dict[str, Any]:
        return {"axis": self.axis}

    def config(self) -> str:
        return f"axis={self.axis}" if self.axis != -1 else ""

    def output_shape_for(self, input_shape: Shape) -> Shape:
        rank = len(input_shape) + 1
        if not -rank <= self.axis < rank or self.axis % rank == 0:
            raise self._shape_error(input_shape, f"axis {self.axis} must name a non-batch axis: 1..{rank - 1} "
                                                 f"or -{rank - 1}..-1")
        return input_shape

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        return ops.softmax(x, axis=self.axis % x.ndim)


class Rescaling(Layer):
    """``x * scale + offset`` with constant scalars (Keras' ``Rescaling(1 / 255)`` preprocessing)."""

    kind = "rescaling"

    def __init__(self, scale: float, offset: float = 0.0, *, name: str | None = None) -> None:
        super().__init__(name)
        if not (math.isfinite(float(scale)) and math.isfinite(float(offset))):
            raise ValueError(f"Rescaling scale and offset must be finite numbers, got {scale!r}, {offset!r}")
        self.scale, self.offset = float(scale), float(offset)

    def get_config(self) -> dict[str, Any]:
        return {"scale": self.scale, "offset": self.offset}

    def config(self) -> str:
        return f"{self.scale:g}" + (f", {self.offset:+g}" if self.offset else "")

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        y = ops.multiply(x, self.scale) if self.scale != 1.0 else x
        return ops.add(y, self.offset) if self.offset else y


class Activation(Layer):
    """An activation by name (Keras' ``Activation("relu")``): one of :data:`ACTIVATIONS`."""

    kind = "activation"

    def __init__(self, activation: str, *, name: str | None = None) -> None:
        super().__init__(name)
        if activation not in ACTIVATIONS[1:]:
            raise ValueError(f"Activation takes one of {ACTIVATIONS[1:]}, got {activation!r}")
        self.activation = activation

    def get_config(self) -> dict[str, Any]:
        return {"activation": self.activation}

    def config(self) -> str:
        return self.activation

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        return _activate(x, self.activation)


# ----- regularization and normalization -----


def inverted_dropout_mask(rng: np.random.Generator, shape: Shape, rate: float, dtype: str) -> np.ndarray:
    """A dropout mask: 0 with probability ``rate``, else ``1 / (1 - rate)`` (inverted dropout, so the
    expected value of ``x * mask`` is ``x``), drawn from ``rng``."""
    keep = rng.random(size=shape) >= rate
    return (keep / (1.0 - rate)).astype(dtype)


class Dropout(Layer):
    """Inverted dropout: while training, ``x * mask`` with ``mask`` in ``{0, 1/(1-rate)}``.

    The mask is an *input* of the step (drawn by :meth:`sample_mask` from the trainer's seeded
    generator), not a random op inside the graph: compiled and reference steps then see the
    same mask, and the same seed replays the same run. At evaluation it is the identity. A shared
    dropout layer applies the same mask at each of its calls.
    """

    kind = "dropout"

    def __init__(self, rate: float, *, name: str | None = None) -> None:
        super().__init__(name)
        if not (is_number(rate) and 0.0 <= float(rate) < 1.0):
            raise ValueError(f"Dropout rate must be a number in [0, 1), got {rate!r}")
        self.rate = float(rate)

    def get_config(self) -> dict[str, Any]:
        return {"rate": self.rate}

    def config(self) -> str:
        return f"{self.rate:g}"

    def noise_shape(self) -> Shape | None:
        assert self.input_shape is not None, "build() first"
        return tuple(self.input_shape) if self.rate > 0.0 else None

    def sample_mask(self, rng: np.random.Generator, shape: Shape, dtype: str) -> np.ndarray:
        return inverted_dropout_mask(rng, shape, self.rate, dtype)

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        if not ctx.training or self.rate == 0.0:
            return x
        assert self.name is not None
        mask = ctx.noise.get(self.name)
        if mask is None:
            raise ValueError(f"dropout layer {self.name!r} is training but no mask input was given")
        return ops.multiply(x, mask)


#: A BatchNorm2D momentum above this is taken for Keras' convention (which weighs the old
#: running value), and warned about: PyTorch's default is 0.1, Keras' 0.99.
KERAS_LIKE_MOMENTUM = 0.5


class BatchNorm2D(Layer):
    """Batch normalization over the channel axis (axis 1) of ``(C, H, W)``, ``(C, L)`` or ``(C,)``
    inputs (PyTorch's ``BatchNorm2d``, and ``BatchNorm1d`` for the other two).

    Semantics are PyTorch's ``BatchNorm2d``: while training it normalizes with the batch mean and
    biased variance and updates ``running = (1 - momentum) * running + momentum * batch_stat``,
    with the *unbiased* batch variance for ``running_var``; at evaluation it normalizes with the
    running statistics. (Keras' ``momentum=0.99`` means the opposite weighting; here 0.1 is
    PyTorch's.) ``momentum=None`` is PyTorch's cumulative moving average: the running statistics
    are the plain mean over every batch so far (``momentum = 1 / num_batches_tracked``, a buffer it
    then has). Parameters ``weight`` (ones) and ``bias`` (zeros); buffers ``running_mean``
    (zeros) and ``running_var`` (ones). The running statistics are extra outputs of the
    training step, so they are updated inside the compiled function.
    """

    kind = "batchnorm"

    def __init__(self, momentum: float | None = 0.1, epsilon: float = 1e-5, *, name: str | None = None) -> None:
        super().__init__(name)
        if momentum is not None and not (is_number(momentum) and 0.0 <= float(momentum) <= 1.0):
            raise ValueError(f"BatchNorm2D momentum must be a number in [0, 1] (PyTorch's convention) or None (a "
                             f"cumulative average), got {momentum!r}")
        if not (is_number(epsilon) and math.isfinite(float(epsilon)) and float(epsilon) > 0):
            raise ValueError(f"BatchNorm2D epsilon must be a finite number > 0, got {epsilon!r}")
        self.momentum = None if momentum is None else float(momentum)
        if self.momentum is not None and self.momentum > KERAS_LIKE_MOMENTUM:
            # Keras' momentum weighs the old running value: its 0.99 is this convention's 0.01,
            # and taken as it is the running statistics become almost the last batch's alone.
            warnings.warn(f"BatchNorm2D(momentum={self.momentum:g}) follows PyTorch's convention, the weight of "
                          f"each new batch in the running statistics; Keras' momentum={self.momentum:g} is "
                          f"momentum={1 - self.momentum:.3g} here", stacklevel=2)
        self.epsilon = float(epsilon)

    def get_config(self) -> dict[str, Any]:
        return {"momentum": self.momentum, "epsilon": self.epsilon}

    def config(self) -> str:
        return ""

    def output_shape_for(self, input_shape: Shape) -> Shape:
        if len(input_shape) not in (1, 2, 3):
            raise self._shape_error(input_shape, "BatchNorm2D needs (channels, height, width), (channels, length) or "
                                                 "(features,)")
        return input_shape

    def param_specs(self) -> dict[str, ParamSpec]:
        assert self.input_shape is not None, "build() first"
        c = (self.input_shape[0],)
        return {"weight": ParamSpec(c, ones), "bias": ParamSpec(c, zeros)}

    def buffer_specs(self) -> dict[str, BufferSpec]:
        assert self.input_shape is not None, "build() first"
        c = (self.input_shape[0],)
        specs = {"running_mean": BufferSpec(c, 0.0), "running_var": BufferSpec(c, 1.0)}
        if self.momentum is None:  # a float count, as every buffer is, exact up to 2**24 batches in float32
            specs["num_batches_tracked"] = BufferSpec((), 0.0, counter=True)
        return specs

    def running_statistics(self, buffers: Mapping[str, Expr], batch_mean: Expr,
                           unbiased_var: Expr) -> dict[str, Expr]:
        """The buffers after one training batch: ``(1 - m) * running + m * batch`` for each statistic,
        with ``m`` the momentum, or ``1 / num_batches_tracked`` (counting this batch) for ``None``."""
        mean, var = buffers["running_mean"], buffers["running_var"]
        if self.momentum is not None:
            m = self.momentum
            return {"running_mean": ops.add(ops.multiply(mean, 1.0 - m), ops.multiply(batch_mean, m)),
                    "running_var": ops.add(ops.multiply(var, 1.0 - m), ops.multiply(unbiased_var, m))}
        count = ops.add(buffers["num_batches_tracked"], 1.0)
        weight = ops.divide(1.0, count)
        keep = ops.subtract(1.0, weight)
        return {"running_mean": ops.add(ops.multiply(mean, keep), ops.multiply(batch_mean, weight)),
                "running_var": ops.add(ops.multiply(var, keep), ops.multiply(unbiased_var, weight)),
                "num_batches_tracked": count}

    def call(self, x: Expr, params: Mapping[str, Expr], buffers: Mapping[str, Expr],
             ctx: ForwardContext) -> tuple[Expr, dict[str, Expr]]:
        weight, bias = params["weight"], params["bias"]
        mean, var = buffers["running_mean"], buffers["running_var"]
        if not ctx.training or not self.trainable:  # a frozen BatchNorm runs as at evaluation, as Keras'
            return ops.batch_norm_inference(x, weight, bias, mean, var, axis=1, epsilon=self.epsilon), dict(buffers)
        axes = tuple(a for a in range(x.ndim) if a != 1)
        if ctx.sync_batchnorm:
            return self.synchronized(x, params, buffers)
        count = math.prod(x.shape[a] for a in axes)
        if count < 2:
            raise ShapeError(f"layer {self.describe()}: training needs more than one value per channel "
                             f"(input {x.shape}), as PyTorch's BatchNorm2d; use a batch larger than 1")
        y = ops.batch_norm(x, weight, bias, axis=1, epsilon=self.epsilon)
        batch_mean, _, squares = batch_statistics(x, axes)  # as batch_norm's gradient builds them
        unbiased = ops.multiply(ops.reshape(squares, shape=var.shape), 1.0 / (count - 1))
        return y, self.running_statistics(buffers, ops.reshape(batch_mean, shape=mean.shape), unbiased)

    def synchronized(self, x: Expr, params: Mapping[str, Expr],
                     buffers: Mapping[str, Expr]) -> tuple[Expr, dict[str, Expr]]:
        """Training with the statistics of every replica's batch together (``SyncBatchNorm``).

        Two small sums over the replicas per forward: the per-channel sums with this replica's
        count appended (``count`` is the global number of values per channel, so uneven shards
        weigh right), then the per-channel sums of squares about the global mean. Centering
        before squaring keeps the variance as accurate as ``batch_norm``'s own two passes. The
        backward of each sum is another one (autodiff through ``cross_replica_sum``).
        """
        channels = x.shape[1]
        axes = tuple(a for a in range(x.ndim) if a != 1)
        kept = tuple(channels if a == 1 else 1 for a in range(x.ndim))
        local_count = ops.full(shape=(1,), value=float(math.prod(x.shape[a] for a in axes)), dtype=x.dtype)
        totals = ops.cross_replica_sum(ops.concatenate([ops.sum(x, axis=axes), local_count], axis=0))
        count = ops.strided_slice(totals, begin=(channels,), end=(channels + 1,))
        batch_mean = ops.divide(ops.strided_slice(totals, begin=(0,), end=(channels,)), count)
        centered = ops.subtract(x, ops.reshape(batch_mean, shape=kept))
        squares = ops.cross_replica_sum(ops.sum(ops.multiply(centered, centered), axis=axes))
        batch_var = ops.divide(squares, count)
        scale = ops.divide(params["weight"], ops.sqrt(ops.add(batch_var, self.epsilon)))
        y = ops.add(ops.multiply(centered, ops.reshape(scale, shape=kept)), ops.reshape(params["bias"], shape=kept))
        unbiased = ops.divide(squares, ops.subtract(count, 1.0))
        return y, self.running_statistics(buffers, batch_mean, unbiased)


class LayerNorm(Layer):
    """Normalization of each example over its trailing axes from ``axis`` on (batch axis = 0).

    ``axis=-1`` (the default) normalizes the last axis, as Keras' ``LayerNormalization`` and
    PyTorch's ``LayerNorm(x.shape[-1])``; ``weight`` (ones) and ``bias`` (zeros) are elementwise,
    shaped like the normalized axes, as PyTorch's. Biased variance, ``epsilon`` inside the root.
    """

    kind = "layernorm"

    def __init__(self, axis: int = -1, epsilon: float = 1e-5, *, name: str | None = None) -> None:
        super().__init__(name)
        if not (math.isfinite(float(epsilon)) and float(epsilon) > 0):
            raise ValueError(f"LayerNorm epsilon must be a finite number > 0, got {epsilon!r}")
        self.axis, self.epsilon = as_int(axis, "LayerNorm axis"), float(epsilon)

    def get_config(self) -> dict[str, Any]:
        return {"axis": self.axis, "epsilon": self.epsilon}

    def _first_axis(self, rank: int) -> int:
        """The first normalized axis of a rank-``rank`` batch (batch axis included)."""
        return self.axis % rank if -rank <= self.axis < rank else -1

    def output_shape_for(self, input_shape: Shape) -> Shape:
        if self._first_axis(len(input_shape) + 1) < 1:
            raise self._shape_error(input_shape, f"axis {self.axis} must name a non-batch axis: 1..{len(input_shape)} "
                                                 f"or -{len(input_shape)}..-1")
        return input_shape

    def param_specs(self) -> dict[str, ParamSpec]:
        assert self.input_shape is not None, "build() first"
        normalized = tuple(self.input_shape[self._first_axis(len(self.input_shape) + 1) - 1:])
        return {"weight": ParamSpec(normalized, ones), "bias": ParamSpec(normalized, zeros)}

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        return ops.layer_norm(x, params["weight"], params["bias"], axis=self._first_axis(x.ndim),
                              epsilon=self.epsilon)


class Embedding(Layer):
    """Token ids ``(T,)`` int64 -> vectors ``(T, output_dim)``: rows of ``weight`` ``(input_dim, output_dim)``.

    Ids must lie in ``[0, input_dim)``; the default initializer is Keras' ``uniform`` (+-0.05).
    """

    kind = "embedding"
    input_dtype = "int64"

    def __init__(self, input_dim: int, output_dim: int, *,
                 embeddings_initializer: str | Initializer = "uniform", name: str | None = None) -> None:
        super().__init__(name)
        if as_int(input_dim, "Embedding input_dim") < 1 or as_int(output_dim, "Embedding output_dim") < 1:
            raise ValueError(f"Embedding input_dim and output_dim must be >= 1, got {input_dim}, {output_dim}")
        self.input_dim, self.output_dim = int(input_dim), int(output_dim)
        self.embeddings_init = get_initializer(embeddings_initializer)

    def get_config(self) -> dict[str, Any]:
        return {"input_dim": self.input_dim, "output_dim": self.output_dim,
                "embeddings_initializer": _init_config(self.embeddings_init)}

    def config(self) -> str:
        return f"{self.input_dim}, {self.output_dim}"

    def output_shape_for(self, input_shape: Shape) -> Shape:
        return (*input_shape, self.output_dim)

    def param_specs(self) -> dict[str, ParamSpec]:
        return {"weight": ParamSpec((self.input_dim, self.output_dim), self.embeddings_init)}

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        return ops.take(params["weight"], x, axis=0)


# ----- merging -----


class MultiHeadAttention(Layer):
    """Multi-head scaled dot-product self-attention over a sequence ``(length, embed)``.

    PyTorch's ``nn.MultiheadAttention(embed, num_heads, batch_first=True)`` called as
    ``mha(x, x, x)`` (Keras' ``MultiHeadAttention`` on one input with ``key_dim = embed /
    num_heads``): queries, keys and values are projections of the input, each head attends with
    ``softmax(q k^T / sqrt(head_dim))``, and the heads' outputs are projected back to ``embed``.
    ``causal=True`` hides from each position the positions after it (a decoder's mask, PyTorch's
    ``is_causal``). ``padding_mask=True`` makes the layer take ``[x, mask]``: ``mask (length,)`` per
    example, 1 where a position holds a token and 0 where it is padding, which no query attends to
    (Keras' ``attention_mask`` rows, Hugging Face's ``attention_mask``; PyTorch's
    ``key_padding_mask`` is its negation). ``key_value=True`` makes it cross-attention, PyTorch's
    ``mha(q, kv, kv)`` (an encoder-decoder's): it takes ``[query, key_value]`` (and the mask of
    ``key_value``'s positions after them), queries from the first, keys and values from the
    second, ``(length_q, E)`` and ``(length_kv, E)``; the output has the query's shape. The
    parameters are PyTorch's: ``in_proj_weight (3E, E)``
    (queries, keys, values stacked), ``in_proj_bias (3E,)``, ``out_proj_weight (E, E)``,
    ``out_proj_bias (E,)``. It runs on registered ops (``dense``, ``batch_matmul``, ``softmax``), so
    it is differentiated and compiled as any other layer.
    """

    kind = "multiheadattention"
    #: What a hidden score becomes before the softmax: exp of it is 0 in float32 and float64,
    #: with no infinity in the arithmetic (PyTorch adds -inf).
    MASKED = -1e30

    def __init__(self, num_heads: int, *, causal: bool = False, padding_mask: bool = False, key_value: bool = False,
                 dropout: float = 0.0, use_bias: bool = True, kernel_initializer: str | Initializer = "glorot_uniform",
                 bias_initializer: str | Initializer = "zeros", name: str | None = None) -> None:
        super().__init__(name)
        if as_int(num_heads, "MultiHeadAttention num_heads") < 1:
            raise ValueError(f"MultiHeadAttention num_heads must be >= 1, got {num_heads}")
        for what, flag in (("causal", causal), ("padding_mask", padding_mask), ("key_value", key_value)):
            if not isinstance(flag, (bool, np.bool_)):
                raise ValueError(f"MultiHeadAttention {what} must be True or False, got {flag!r}")
        if causal and key_value:
            raise ValueError("MultiHeadAttention: causal hides later positions of the one sequence a self-attention "
                             "reads; cross-attention (key_value=True) reads another sequence, where PyTorch's "
                             "decoder applies no causal mask either")
        self.num_heads, self.causal, self.use_bias = int(num_heads), bool(causal), bool(use_bias)
        self.padding_mask, self.key_value = bool(padding_mask), bool(key_value)
        if not (is_number(dropout) and 0.0 <= float(dropout) < 1.0):
            raise ValueError(f"MultiHeadAttention dropout must be a rate in [0, 1), got {dropout!r}")
        self.dropout = float(dropout)
        self.kernel_init = get_initializer(kernel_initializer)
        self.bias_init = get_initializer(bias_initializer)

    @property
    def multi_input(self) -> bool:  # type: ignore[override]  # fixed by the config: x, [x, mask], [q, kv, ...]
        return self.padding_mask or self.key_value

    def get_config(self) -> dict[str, Any]:
        return {"num_heads": self.num_heads, "causal": self.causal, "padding_mask": self.padding_mask,
                **({"key_value": True} if self.key_value else {}),
                **({"dropout": self.dropout} if self.dropout else {}),
                "use_bias": self.use_bias, "kernel_initializer": _init_config(self.kernel_init),
                "bias_initializer": _init_config(self.bias_init)}

    def config(self) -> str:
        return f"{self.num_heads} heads" + (", causal" if self.causal else "") + (
            ", cross" if self.key_value else "") + (", padding mask" if self.padding_mask else "") + (
            f", dropout {self.dropout:g}" if self.dropout else "")

    def output_shape_for(self, input_shape: Any) -> Shape:
        if self.multi_input:
            sequences = 2 if self.key_value else 1
            parts = [tuple(shape) for shape in input_shape]
            wanted = ("[query, key_value, mask]" if self.key_value and self.padding_mask else
                      "[query, key_value]" if self.key_value else "[x, mask]")
            fits = len(parts) == sequences + self.padding_mask and all(len(p) == 2 for p in parts[:sequences])
            if fits and self.padding_mask:
                fits = parts[-1] == (parts[sequences - 1][0],)
            if not fits:
                sequences_text = "sequences (length, embed)" if self.key_value else "a sequence (length, embed)"
                mask_text = (" and a mask (length,) of 1 (a token) and 0 (padding)" + (
                    " for the key_value's positions" if self.key_value else "")) if self.padding_mask else ""
                raise self._shape_error(input_shape, f"MultiHeadAttention takes {wanted}: {sequences_text}{mask_text}")
            if self.key_value and parts[0][1] != parts[1][1]:
                raise self._shape_error(input_shape, f"the query's embed {parts[0][1]} differs from the key_value's "
                                                     f"{parts[1][1]}")
            input_shape = parts[0]
        if len(input_shape) != 2:
            raise self._shape_error(input_shape, "MultiHeadAttention needs a sequence (length, embed)")
        if input_shape[1] % self.num_heads:
            raise self._shape_error(input_shape, f"embed {input_shape[1]} does not split into {self.num_heads} heads")
        return tuple(input_shape)

    def param_specs(self) -> dict[str, ParamSpec]:
        assert self.input_shape is not None, "build() first"
        e = (self.input_shape[0] if self.multi_input else self.input_shape)[1]
        specs = {"in_proj_weight": ParamSpec((3 * e, e), self.kernel_init),
                 "out_proj_weight": ParamSpec((e, e), self.kernel_init)}
        if self.use_bias:
            specs["in_proj_bias"] = ParamSpec((3 * e,), self.bias_init)
            specs["out_proj_bias"] = ParamSpec((e,), self.bias_init)
        return specs

    def noise_shape(self) -> Shape | None:
        """``(heads, length_q, length_kv)`` per example while ``dropout`` is on: a mask of the
        attention weights, drawn as a Dropout layer's."""
        assert self.input_shape is not None, "build() first"
        if not self.dropout:
            return None
        query = self.input_shape[0] if self.multi_input else self.input_shape
        keys = self.input_shape[1][0] if self.key_value else query[0]
        return (self.num_heads, query[0], keys)

    def sample_mask(self, rng: np.random.Generator, shape: Shape, dtype: str) -> np.ndarray:
        return inverted_dropout_mask(rng, shape, self.dropout, dtype)

    def apply(self, x: Expr | list[Expr], params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        parts = x if isinstance(x, list) else [x]
        x = parts[0]
        source = parts[1] if self.key_value else x  # what the keys and values are projected from
        mask = parts[-1] if self.padding_mask else None
        n, length, e = x.shape
        keys = source.shape[1]
        heads, d = self.num_heads, e // self.num_heads

        def projected(part: int, of: Expr) -> Expr:
            """Queries (0), keys (1) or values (2) of ``of`` as ``(n * heads, its length, d)``."""
            steps = of.shape[1]
            w = ops.strided_slice(params["in_proj_weight"], begin=[part * e, 0], end=[(part + 1) * e, e])
            y = ops.dense(ops.reshape(of, shape=(n * steps, e)), w)
            if self.use_bias:
                y = ops.bias_add(y, ops.strided_slice(params["in_proj_bias"], begin=[part * e], end=[(part + 1) * e]),
                                 axis=1)
            heads_first = ops.transpose(ops.reshape(y, shape=(n, steps, heads, d)), axes=(0, 2, 1, 3))
            return ops.reshape(heads_first, shape=(n * heads, steps, d))

        q, k, v = projected(0, x), projected(1, source), projected(2, source)
        scores = ops.multiply(ops.batch_matmul(q, ops.transpose(k, axes=(0, 2, 1))), 1.0 / math.sqrt(d))
        if self.causal:
            hidden = np.triu(np.full((length, length), self.MASKED), k=1).astype(x.dtype)
            scores = ops.add(scores, const(hidden))
        if mask is not None:
            # MASKED where a key is padding, per example, the same for every head and every query.
            padding = ops.multiply(ops.subtract(1.0, mask), self.MASKED)
            per_head = ops.broadcast_to(ops.reshape(padding, shape=(n, 1, keys)), shape=(n, heads, keys))
            scores = ops.add(scores, ops.reshape(per_head, shape=(n * heads, 1, keys)))
        weights = ops.softmax(scores, axis=-1)
        if ctx.training and self.dropout > 0.0:  # PyTorch's dropout of the attention weights
            mask = ctx.noise.get(str(self.name))
            if mask is None:
                raise ValueError(f"layer {self.describe()} is training with dropout but no mask input was given")
            weights = ops.multiply(weights, ops.reshape(mask, shape=(n * heads, length, keys)))
        attended = ops.batch_matmul(weights, v)
        merged = ops.transpose(ops.reshape(attended, shape=(n, heads, length, d)), axes=(0, 2, 1, 3))
        y = ops.dense(ops.reshape(merged, shape=(n * length, e)), params["out_proj_weight"])
        if self.use_bias:
            y = ops.bias_add(y, params["out_proj_bias"], axis=1)
        return ops.reshape(y, shape=(n, length, e))


class Add(Layer):
    """The elementwise sum of two or more inputs of the same shape (a residual connection)."""

    kind = "add"
    multi_input = True

    def output_shape_for(self, input_shape: list[Shape]) -> Shape:
        if any(s != input_shape[0] for s in input_shape):
            raise self._shape_error(input_shape, "Add needs inputs of one shape; got "
                                                 + " and ".join(str(s) for s in input_shape))
        return input_shape[0]

    def apply(self, x: list[Expr], params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        total = x[0]
        for other in x[1:]:
            total = ops.add(total, other)
        return total


class Concatenate(Layer):
    """Inputs joined along ``axis`` (batch axis = 0; ``axis=1`` joins NCHW channels or features)."""

    kind = "concat"
    multi_input = True

    def __init__(self, axis: int = 1, *, name: str | None = None) -> None:
        super().__init__(name)
        self.axis = as_int(axis, f"{type(self).__name__} axis")

    def get_config(self) -> dict[str, Any]:
        return {"axis": self.axis}

    def config(self) -> str:
        return f"axis={self.axis}"

    def output_shape_for(self, input_shape: list[Shape]) -> Shape:
        rank = len(input_shape[0]) + 1
        if any(len(s) + 1 != rank for s in input_shape):
            raise self._shape_error(input_shape, "Concatenate needs inputs of one rank")
        if not -rank <= self.axis < rank or self.axis % rank == 0:
            raise self._shape_error(input_shape, f"axis {self.axis} must name a non-batch axis: 1..{rank - 1} "
                                                 f"or -{rank - 1}..-1")
        a = self.axis % rank - 1
        for s in input_shape[1:]:
            if s[:a] + s[a + 1:] != input_shape[0][:a] + input_shape[0][a + 1:]:
                raise self._shape_error(input_shape, f"Concatenate along axis {self.axis} needs the other axes "
                                                     "to match; got " + " and ".join(str(t) for t in input_shape))
        out = list(input_shape[0])
        out[a] = sum(s[a] for s in input_shape)
        return tuple(out)

    def apply(self, x: list[Expr], params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        return ops.concatenate(list(x), axis=self.axis % x[0].ndim)


def __getattr__(name: str) -> Any:
    # ``Sequential`` lives with ``Model`` in opgrad.nn.model; this keeps ``from opgrad.nn.layers import
    # Sequential`` working without an import cycle.
    if name == "Sequential":
        from opgrad.nn.model import Sequential

        return Sequential
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
