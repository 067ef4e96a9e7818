"""Layers and ``Sequential``: functional building blocks that emit registered operators.

Why functional: a layer never holds arrays. It declares its parameters (name, shape,
initializer) once its input shape is known, and ``apply`` turns an input expression plus
parameter expressions into an output expression made only of registered ops. The training step
can then differentiate, optimize and compile the whole thing as *one* graph, and the same model
can be evaluated with any parameter values (a checkpoint, a parity test's weights) without
copying them into objects.

Shapes are per example, without the batch axis (Keras' convention): ``Sequential`` checks the
whole stack when it is constructed, so ``Dense`` after a conv without ``Flatten`` fails there,
naming the layer, instead of deep inside a step.

Layout is NCHW with OIHW convolution weights and ``(units, in)`` dense weights, as the
operators expect.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from opgrad import ops
from opgrad.errors import ShapeError
from opgrad.ir import Expr, Var, var
from opgrad.nn.init import Initializer, get_initializer, param_generator

__all__ = [
    "AvgPool2D",
    "Conv2D",
    "Dense",
    "Dropout",
    "Flatten",
    "ForwardContext",
    "Layer",
    "MaxPool2D",
    "ParamSpec",
    "ReLU",
    "Sequential",
]

Shape = tuple[int, ...]
ACTIVATIONS = (None, "relu")


@dataclass(frozen=True)
class ParamSpec:
    """A trainable parameter a layer declares: its shape and how to initialize it."""

    shape: Shape
    init: Initializer


@dataclass(frozen=True)
class ForwardContext:
    """What a forward pass needs besides parameters.

    ``training`` switches dropout on; ``noise`` maps a dropout layer's name to its mask input
    (an expression fed from a seeded numpy generator, so a compiled step stays deterministic).
    """

    training: bool = False
    noise: Mapping[str, Expr] = field(default_factory=dict)


def _pair(value: int | Sequence[int], what: str) -> tuple[int, int]:
    if isinstance(value, bool):
        raise ValueError(f"{what} must be an int or two ints, got {value!r}")
    if isinstance(value, (int, np.integer)):
        pair = (int(value), int(value))
    else:
        items = tuple(int(v) for v in value)
        if len(items) != 2:
            raise ValueError(f"{what} must be an int or two ints, got {value!r}")
        pair = (items[0], items[1])
    if min(pair) < 1:
        raise ValueError(f"{what} must be >= 1, got {value!r}")
    return pair


def _check_activation(activation: str | None) -> str | None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    return activation


def _activate(x: Expr, activation: str | None) -> Expr:
    return ops.relu(x) if activation == "relu" else x


class Layer:
    """Base class. Subclasses set ``kind`` and implement ``output_shape_for`` and ``apply``.

    ``build(input_shape)`` is called once by ``Sequential``; it records the shapes and returns
    the output shape. A layer object belongs to one model: building it again with another input
    shape is an error (it would silently change the other model's parameters).
    """

    kind: ClassVar[str] = "layer"

    def __init__(self, name: str | None = None) -> None:
        if name is not None and (not name or "." in name or "/" in name):
            raise ValueError(f"layer name must be non-empty without '.' or '/', got {name!r}")
        self.name = name
        self.input_shape: Shape | None = None
        self.output_shape: Shape | None = None

    def build(self, input_shape: Shape) -> Shape:
        input_shape = tuple(int(d) for d in input_shape)
        if self.input_shape is not None and self.input_shape != input_shape:
            raise ValueError(
                f"layer {self.describe()} was already built for input {self.input_shape}; "
                f"create a new layer for input {input_shape}"
            )
        out = self.output_shape_for(input_shape)
        self.input_shape, self.output_shape = input_shape, out
        return out

    def output_shape_for(self, input_shape: Shape) -> Shape:
        return input_shape

    def param_specs(self) -> dict[str, ParamSpec]:
        """Local parameter names (``"weight"``, ``"bias"``) to specs; valid after ``build``."""
        return {}

    def noise_shape(self) -> Shape | None:
        """Per-example shape of the random mask this layer reads while training (None: no mask)."""
        return None

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        raise NotImplementedError

    def config(self) -> str:
        return ""

    def describe(self) -> str:
        label = self.name or "?"
        cfg = self.config()
        return f"{label!r} ({type(self).__name__}{'(' + cfg + ')' if cfg else ''})"

    def _shape_error(self, input_shape: Shape, problem: str) -> ShapeError:
        return ShapeError(f"layer {self.describe()}: input shape {input_shape} (per example): {problem}")


class Dense(Layer):
    """``x @ weight.T + bias`` with ``weight`` shaped ``(units, in)``; optional ReLU."""

    kind = "dense"

    def __init__(self, units: int, *, activation: str | None = None, use_bias: bool = True,
                 kernel_initializer: str | Initializer = "glorot_uniform",
                 bias_initializer: str | Initializer = "zeros", name: str | None = None) -> None:
        super().__init__(name)
        if int(units) < 1:
            raise ValueError(f"Dense units must be >= 1, got {units}")
        self.units = int(units)
        self.activation = _check_activation(activation)
        self.use_bias = use_bias
        self.kernel_init = get_initializer(kernel_initializer)
        self.bias_init = get_initializer(bias_initializer)

    def config(self) -> str:
        return f"{self.units}" + (f", {self.activation}" if self.activation else "")

    def output_shape_for(self, input_shape: Shape) -> Shape:
        if len(input_shape) != 1:
            raise self._shape_error(input_shape, "Dense needs flat features (in,); put a Flatten() before it")
        return (self.units,)

    def param_specs(self) -> dict[str, ParamSpec]:
        assert self.input_shape is not None, "build() first"
        specs = {"weight": ParamSpec((self.units, self.input_shape[0]), self.kernel_init)}
        if self.use_bias:
            specs["bias"] = ParamSpec((self.units,), self.bias_init)
        return specs

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        y = ops.dense(x, params["weight"])
        if self.use_bias:
            y = ops.bias_add(y, params["bias"], axis=1)
        return _activate(y, self.activation)


class Conv2D(Layer):
    """2-D convolution (NCHW data, OIHW weight) plus a per-channel bias; optional ReLU.

    ``padding`` is ``"valid"`` (Keras' default, no padding), ``"same"`` (stride 1, odd kernel) or
    explicit zeros per side as an int or a pair.
    """

    kind = "conv"

    def __init__(self, filters: int, kernel_size: int | Sequence[int], *, strides: int | Sequence[int] = 1,
                 padding: str | int | Sequence[int] = "valid", activation: str | None = None,
                 use_bias: bool = True, kernel_initializer: str | Initializer = "glorot_uniform",
                 bias_initializer: str | Initializer = "zeros", name: str | None = None) -> None:
        super().__init__(name)
        if int(filters) < 1:
            raise ValueError(f"Conv2D filters must be >= 1, got {filters}")
        self.filters = int(filters)
        self.kernel_size = _pair(kernel_size, "kernel_size")
        self.strides = _pair(strides, "strides")
        self.padding = self._padding(padding)
        self.activation = _check_activation(activation)
        self.use_bias = use_bias
        self.kernel_init = get_initializer(kernel_initializer)
        self.bias_init = get_initializer(bias_initializer)

    def _padding(self, padding: str | int | Sequence[int]) -> tuple[int, int]:
        if padding == "valid":
            return (0, 0)
        if padding == "same":
            kh, kw = self.kernel_size
            if self.strides != (1, 1) or kh % 2 == 0 or kw % 2 == 0:
                raise ValueError("padding='same' is supported for stride 1 and odd kernel sizes only")
            return (kh // 2, kw // 2)
        if isinstance(padding, str):
            raise ValueError(f"padding must be 'valid', 'same', an int or two ints, got {padding!r}")
        pad = (int(padding), int(padding)) if isinstance(padding, (int, np.integer)) else tuple(padding)
        if len(pad) != 2 or min(pad) < 0:
            raise ValueError(f"padding must be two ints >= 0, got {padding!r}")
        return (int(pad[0]), int(pad[1]))

    def config(self) -> str:
        kh, kw = self.kernel_size
        return f"{self.filters}, {kh}x{kw}" + (f", {self.activation}" if self.activation else "")

    def output_shape_for(self, input_shape: Shape) -> Shape:
        if len(input_shape) != 3:
            raise self._shape_error(input_shape, "Conv2D needs (channels, height, width)")
        _, h, w = input_shape
        size = []
        for extent, k, s, p in zip((h, w), self.kernel_size, self.strides, self.padding):
            out = (extent + 2 * p - k) // s + 1
            if out < 1:
                raise self._shape_error(input_shape, f"the {k}-wide kernel does not fit {extent} (+2*{p} padding)")
            size.append(out)
        return (self.filters, size[0], size[1])

    def param_specs(self) -> dict[str, ParamSpec]:
        assert self.input_shape is not None, "build() first"
        specs = {"weight": ParamSpec((self.filters, self.input_shape[0], *self.kernel_size), self.kernel_init)}
        if self.use_bias:
            specs["bias"] = ParamSpec((self.filters,), self.bias_init)
        return specs

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        y = ops.conv2d(x, params["weight"], strides=self.strides, padding=self.padding)
        if self.use_bias:
            y = ops.bias_add(y, params["bias"], axis=1)
        return _activate(y, self.activation)


class _Pool2D(Layer):
    def __init__(self, pool_size: int | Sequence[int] = 2, *, strides: int | Sequence[int] | None = None,
                 name: str | None = None) -> None:
        super().__init__(name)
        self.pool_size = _pair(pool_size, "pool_size")
        self.strides = self.pool_size if strides is None else _pair(strides, "strides")

    def config(self) -> str:
        return f"{self.pool_size[0]}x{self.pool_size[1]}"

    def output_shape_for(self, input_shape: Shape) -> Shape:
        if len(input_shape) != 3:
            raise self._shape_error(input_shape, f"{type(self).__name__} needs (channels, height, width)")
        c, h, w = input_shape
        oh = (h - self.pool_size[0]) // self.strides[0] + 1
        ow = (w - self.pool_size[1]) // self.strides[1] + 1
        if oh < 1 or ow < 1:
            raise self._shape_error(input_shape, f"the {self.config()} pool does not fit")
        return (c, oh, ow)


class MaxPool2D(_Pool2D):
    """Maximum over each window (no padding); strides default to the pool size, as in Keras."""

    kind = "maxpool"

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        return ops.max_pool2d(x, pool_size=self.pool_size, strides=self.strides)


class AvgPool2D(_Pool2D):
    """Mean over each window (no padding); strides default to the pool size, as in Keras."""

    kind = "avgpool"

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        return ops.avg_pool2d(x, pool_size=self.pool_size, strides=self.strides)


class Flatten(Layer):
    """``(C, H, W) -> (C*H*W,)`` in NCHW order (Keras flattens NHWC: weights do not transfer as-is)."""

    kind = "flatten"

    def output_shape_for(self, input_shape: Shape) -> Shape:
        return (int(np.prod(input_shape, dtype=np.int64)),)

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        return ops.flatten(x)


class ReLU(Layer):
    """``max(x, 0)``."""

    kind = "relu"

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        return ops.relu(x)


class Dropout(Layer):
    """Inverted dropout: while training, ``x * mask`` with ``mask`` in ``{0, 1/(1-rate)}``.

    The mask is an *input* of the step (drawn by :meth:`sample_mask` from the trainer's seeded
    generator), not a random op inside the graph: compiled and reference steps then see the
    same mask, and the same seed replays the same run. At evaluation it is the identity.
    """

    kind = "dropout"

    def __init__(self, rate: float, *, name: str | None = None) -> None:
        super().__init__(name)
        if not 0.0 <= float(rate) < 1.0:
            raise ValueError(f"Dropout rate must be in [0, 1), got {rate}")
        self.rate = float(rate)

    def config(self) -> str:
        return f"{self.rate:g}"

    def noise_shape(self) -> Shape | None:
        assert self.input_shape is not None, "build() first"
        return self.input_shape

    def sample_mask(self, rng: np.random.Generator, shape: Shape, dtype: str) -> np.ndarray:
        keep = rng.random(size=shape) >= self.rate
        return (keep / (1.0 - self.rate)).astype(dtype)

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        if not ctx.training or self.rate == 0.0:
            return x
        assert self.name is not None
        mask = ctx.noise.get(self.name)
        if mask is None:
            raise ValueError(f"dropout layer {self.name!r} is training but no mask input was given")
        return ops.multiply(x, mask)


class Sequential:
    """A stack of layers applied in order to inputs of per-example shape ``input_shape``.

    Unnamed layers are named by kind and position among their kind (``conv1``, ``conv2``,
    ``dense1``, ...); parameters are named ``<layer>.<param>`` (``conv1.weight``), which is
    also how checkpoints store them.
    """

    def __init__(self, layers: Sequence[Layer], input_shape: Sequence[int], *, name: str = "model") -> None:
        if not layers:
            raise ValueError("Sequential needs at least one layer")
        self.name = name
        self.layers: tuple[Layer, ...] = tuple(layers)
        self.input_shape: Shape = tuple(int(d) for d in input_shape)
        counts: dict[str, int] = {}
        seen: set[str] = set()
        shape = self.input_shape
        for layer in self.layers:
            if not isinstance(layer, Layer):
                raise TypeError(f"Sequential takes Layer objects, got {layer!r}")
            if layer.name is None:
                counts[layer.kind] = counts.get(layer.kind, 0) + 1
                layer.name = f"{layer.kind}{counts[layer.kind]}"
            if layer.name in seen:
                raise ValueError(f"two layers are named {layer.name!r}; layer names must be unique")
            seen.add(layer.name)
            shape = layer.build(shape)
        self.output_shape: Shape = shape

    def param_specs(self) -> dict[str, ParamSpec]:
        """Every parameter, in layer order: ``{"conv1.weight": ParamSpec(...), ...}``."""
        return {f"{layer.name}.{local}": spec for layer in self.layers for local, spec in layer.param_specs().items()}

    def param_shapes(self) -> dict[str, Shape]:
        return {name: spec.shape for name, spec in self.param_specs().items()}

    @property
    def num_params(self) -> int:
        return int(sum(int(np.prod(s.shape, dtype=np.int64)) for s in self.param_specs().values()))

    def init_params(self, seed: int, dtype: str = "float32") -> dict[str, np.ndarray]:
        """Fresh parameters; each drawn from its own generator (see ``opgrad.nn.init``)."""
        return {
            name: np.ascontiguousarray(spec.init(spec.shape, param_generator(seed, name), dtype))
            for name, spec in self.param_specs().items()
        }

    def param_vars(self, dtype: str = "float32") -> dict[str, Var]:
        """One graph variable per parameter, named like the parameter."""
        return {name: var(name, spec.shape, dtype) for name, spec in self.param_specs().items()}

    def noise_layers(self) -> list[Dropout]:
        """Layers that read a random mask while training (dropout), in order."""
        return [layer for layer in self.layers if isinstance(layer, Dropout) and layer.rate > 0.0]

    def sample_noise(self, rng: np.random.Generator, batch: int, dtype: str = "float32") -> dict[str, np.ndarray]:
        """One training step's masks, keyed by layer name, drawn in layer order from ``rng``."""
        masks = {}
        for layer in self.noise_layers():
            assert layer.name is not None and layer.input_shape is not None
            masks[layer.name] = layer.sample_mask(rng, (batch, *layer.input_shape), dtype)
        return masks

    def forward(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext | None = None) -> Expr:
        """The output expression for a batch ``x`` shaped ``(N, *input_shape)``."""
        ctx = ctx or ForwardContext()
        if tuple(x.shape[1:]) != self.input_shape:
            raise ShapeError(
                f"{self.name}: input has shape {x.shape}, expected (batch, {', '.join(map(str, self.input_shape))})"
            )
        missing = [n for n in self.param_specs() if n not in params]
        if missing:
            raise ValueError(f"{self.name}: no value given for parameter(s) {', '.join(missing)}")
        for layer in self.layers:
            local = {key.split(".", 1)[1]: value for key, value in params.items()
                     if key.split(".", 1)[0] == layer.name}
            x = layer.apply(x, local, ctx)
        return x

    def summary(self) -> str:
        """A Keras-like table: layer, output shape, parameter count."""
        rows = [("layer", "output shape", "params")]
        for layer in self.layers:
            count = sum(int(np.prod(s.shape, dtype=np.int64)) for s in layer.param_specs().values())
            rows.append((layer.describe(), str(layer.output_shape), f"{count:,}"))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:>{widths[2]}}" for a, b, c in rows]
        lines.insert(1, "-" * len(lines[0]))
        lines.append(f"total: {self.num_params:,} parameters, input {self.input_shape}")
        return "\n".join(lines)
