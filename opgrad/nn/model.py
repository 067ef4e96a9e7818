"""``Model``: a graph of layer calls (Keras' functional API), and ``Sequential`` as its chain.

::

    inp = nn.Input((1, 28, 28))
    x = nn.Conv2D(16, 3, padding="same", activation="relu")(inp)
    skip = x
    x = nn.BatchNorm2D()(nn.Conv2D(16, 3, padding="same")(x))
    x = nn.ReLU()(nn.Add()([x, skip]))
    out = nn.Dense(10)(nn.GlobalAvgPool2D()(x))
    model = nn.Model(inp, out)

Why a graph of calls rather than a ``forward`` method: the graph is data, so the model can be
described as JSON (:meth:`Model.get_config`) and rebuilt from a checkpoint without the code
that built it, and its summary can show the wiring.

Naming: unnamed layers are named by kind and position among their kind in the order the model
first uses them (``conv1``, ``conv2``, ``dense1``, ...); parameters are ``<layer>.<param>``
(``conv1.weight``) and buffers ``<layer>.<buffer>`` (``batchnorm1.running_mean``), which is also how
checkpoints store them. Parameters are seeded by name, so the same architecture and seed give the
same weights.

A model also carries one current set of weights (``model.params``, ``model.buffers``), the
Keras habit: ``Trainer`` trains them, ``model.predict`` and ``model.save`` use them. A layer
object that several models use has one set of weights, as a Keras layer has: each model reads
the arrays last assigned through any of them (an encoder sub-model sees what training the full
model made). The graph functions themselves (``forward``, ``call``) take any weights as expressions.
"""

from __future__ import annotations

import inspect
import itertools
import os
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import numpy as np

from opgrad.errors import ShapeError
from opgrad.ir import Expr, Var, var
from opgrad.nn.init import param_generator
from opgrad.nn.layers import (
    LAYERS,
    BufferSpec,
    ForwardContext,
    Input,
    Layer,
    Node,
    ParamSpec,
    SymbolicTensor,
)

__all__ = ["CONFIG_FORMAT", "Model", "Sequential", "load_model", "model_from_config"]

Shape = tuple[int, ...]
#: The ``format`` field of a model description; bumped when the JSON layout changes.
CONFIG_FORMAT = "opgrad.model/1"


def _as_list(value: SymbolicTensor | Sequence[SymbolicTensor], what: str) -> list[SymbolicTensor]:
    items = [value] if isinstance(value, SymbolicTensor) else list(value)
    if not items or not all(isinstance(t, SymbolicTensor) for t in items):
        raise TypeError(f"Model {what} must be tensors from nn.Input or layer calls, got {value!r}")
    return items


def _file_names(names: Sequence[str] | None, count: int, what: str, model: str) -> list[str] | None:
    """``names`` checked as one distinct non-empty string per model input or output (``what``)."""
    if names is None:
        return None
    listed = list(names)
    if len(listed) != count or not all(isinstance(n, str) and n for n in listed) or len(set(listed)) != count:
        raise ValueError(f"model {model!r}: {what}_names must be {count} distinct non-empty strings, one per "
                         f"{what}; got {names!r}")
    return listed


class _HeldArrays:
    """A model's parameters or buffers, and for each layer when its arrays were assigned: of the
    models that share a layer, the one assigned last holds its current arrays."""

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] | None = None
        self.stamps: dict[int, int] = {}  # id(layer) -> assignment number; absent: drawn, never assigned

    def stamp(self, layer: Layer) -> int:
        return self.stamps.get(id(layer), 0)

    def assign(self, arrays: dict[str, np.ndarray], layers: Sequence[Layer]) -> None:
        self.arrays = arrays
        number = next(_ASSIGNMENTS)
        self.stamps = {id(layer): number for layer in layers}


#: Why a model cannot be used as a layer, and what to do instead.
NOT_A_LAYER = ("a model is not a layer, so it cannot be called inside another model (nesting is not "
               "supported); call its layers on your tensors in order (they share their weights), or "
               "extend it from its own tensors: nn.Model(model.inputs, new_layer(model.outputs[0]))")


#: The live models using each layer object, for the weights of layers several models share.
_MODELS_USING: weakref.WeakKeyDictionary[Layer, weakref.WeakSet[Model]] = weakref.WeakKeyDictionary()
_ASSIGNMENTS = itertools.count(1)


def _layer_entry(layer: Layer) -> dict[str, Any]:
    """A layer as its model's description lists it; a class without a kind of its own is refused,
    and so is a user's class whose ``get_config`` leaves out an argument of its constructor:
    rebuilt from the description, the layer would silently take that argument's default. (opgrad's
    own layers leave out arguments at their defaults, or the one of two they were not given; their
    round trips are tested.)"""
    kind, config = layer.registered_kind(), layer.get_config()
    signature = inspect.signature(type(layer).__init__)
    missing = [p.name for p in signature.parameters.values()
               if p.name not in ("self", "name", *config) and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    # A subclass that keeps an opgrad layer's constructor and get_config keeps its convention too.
    owners = {next(c for c in type(layer).__mro__ if method in c.__dict__) for method in ("__init__", "get_config")}
    inherited = len(owners) == 1 and next(iter(owners)).__module__.startswith("opgrad.")
    if missing and not type(layer).__module__.startswith("opgrad.") and not inherited:
        raise TypeError(f"layer {layer.describe()}: {type(layer).__name__}.get_config returns no "
                        f"{', '.join(map(repr, missing))}, which its constructor takes, so a saved model would "
                        f"rebuild it with the default; return every constructor argument from get_config")
    return {"kind": kind, "name": layer.name, "config": config, **({} if layer.trainable else {"trainable": False})}


def _count(shape: Shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


class Model:
    """The layers between ``inputs`` and ``outputs`` (one tensor or a list of each).

    Supports branches, skip connections, several inputs and outputs and shared layers; every
    tensor the outputs depend on must come from the given inputs. ``input_names`` and
    ``output_names`` (one distinct name each) name the inputs and outputs where a file format has
    names for them, which need not be identifiers: an imported ONNX graph keeps its names
    (PyTorch's ``input.1``) through ``opgrad.onnx.save``.
    """

    def __init__(self, inputs: SymbolicTensor | Sequence[SymbolicTensor],
                 outputs: SymbolicTensor | Sequence[SymbolicTensor], *, name: str = "model",
                 input_names: Sequence[str] | None = None, output_names: Sequence[str] | None = None) -> None:
        self.name = name
        self.inputs = _as_list(inputs, "inputs")
        self.outputs = _as_list(outputs, "outputs")
        self.input_names = _file_names(input_names, len(self.inputs), "input", name)
        self.output_names = _file_names(output_names, len(self.outputs), "output", name)
        for tensor in self.inputs:
            if tensor.node is not None:
                raise TypeError(f"model {name!r}: inputs must come from nn.Input, got {tensor!r}")
        if len(set(map(id, self.inputs))) != len(self.inputs):
            raise ValueError(f"model {name!r}: an input is listed twice")
        self.nodes: list[Node] = self._sort_nodes()
        self._name_inputs()
        self.layers: tuple[Layer, ...] = tuple(dict.fromkeys(node.layer for node in self.nodes))
        self._name_layers()
        for layer in self.layers:
            for local, (owner, _) in layer.tied_params().items():
                if owner not in self.layers:
                    raise ValueError(f"model {name!r}: layer {layer.describe()} takes its {local} from layer "
                                     f"{owner.describe()}, which the model does not use; build the model on both")
        for layer in self.layers:
            _MODELS_USING.setdefault(layer, weakref.WeakSet()).add(self)
        self._dtype = "float32"
        self._held_params = _HeldArrays()
        self._held_buffers = _HeldArrays()
        self._weights_assigned = False
        #: The weights are seed 0's draw, made when they were first used (:attr:`params`, predict).
        self.weights_drawn_at_first_use = False
        self._predict_steps: dict[tuple[int, str, str], Any] = {}
        #: The metadata of the checkpoint the model was loaded from (step, optimizer, ...), else empty.
        self.checkpoint_meta: dict[str, Any] = {}

    # ----- graph -----

    def _sort_nodes(self) -> list[Node]:
        """Every layer call the outputs depend on, inputs before users (depth-first, deterministic)."""
        order: list[Node] = []
        done: set[int] = set()
        known_inputs = {id(t) for t in self.inputs}
        for output in self.outputs:
            stack: list[tuple[SymbolicTensor, bool]] = [(output, False)]
            on_path: set[int] = set()
            while stack:
                tensor, expanded = stack.pop()
                node = tensor.node
                if node is None:
                    if id(tensor) not in known_inputs:
                        raise ValueError(
                            f"model {self.name!r}: an output depends on "
                            f"{f'input {tensor.name!r}' if tensor.name else 'an unnamed input'} of shape "
                            f"{tensor.shape}, which is not among the model's inputs; pass it in Model(inputs=[...])"
                        )
                    continue
                if id(node) in done:
                    continue
                if expanded:
                    on_path.discard(id(node))
                    done.add(id(node))
                    order.append(node)
                    continue
                on_path.add(id(node))
                stack.append((tensor, True))
                stack.extend((t, False) for t in reversed(node.inputs))
        return order

    def _name_inputs(self) -> None:
        taken = {t.name for t in self.inputs if t.name}
        for i, tensor in enumerate(self.inputs, start=1):
            if tensor.name is None:
                candidate = f"input{i}"
                while candidate in taken:
                    candidate += "_"
                tensor.name = candidate
                taken.add(candidate)
        names = [t.name for t in self.inputs]
        if len(set(names)) != len(names):
            raise ValueError(f"model {self.name!r}: two inputs are named alike ({names}); input names must be unique")

    def _name_layers(self) -> None:
        taken = {layer.name for layer in self.layers if layer.name}
        counts: dict[str, int] = {}
        for layer in self.layers:
            if layer.name is None:
                while True:
                    counts[layer.kind] = counts.get(layer.kind, 0) + 1
                    candidate = f"{layer.kind}{counts[layer.kind]}"
                    if candidate not in taken:
                        break
                layer.name = candidate
                taken.add(candidate)
        seen: set[str] = set()
        for layer in self.layers:
            assert layer.name is not None
            if layer.name in seen:
                raise ValueError(f"two layers are named {layer.name!r}; layer names must be unique")
            seen.add(layer.name)

    def get_layer(self, name: str) -> Layer:
        """The layer named ``name`` (Keras' ``model.get_layer``); a KeyError lists the names."""
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(f"model {self.name!r} has no layer {name!r}; its layers: "
                       f"{', '.join(str(layer.name) for layer in self.layers)}")

    @property
    def input_shapes(self) -> list[Shape]:
        return [t.shape for t in self.inputs]

    @property
    def output_shapes(self) -> list[Shape]:
        return [t.shape for t in self.outputs]

    @property
    def input_shape(self) -> Shape:
        """The per-example input shape of a single-input model."""
        if len(self.inputs) != 1:
            raise ValueError(f"model {self.name!r} has {len(self.inputs)} inputs; use input_shapes")
        return self.inputs[0].shape

    @property
    def output_shape(self) -> Shape:
        """The per-example output shape of a single-output model."""
        if len(self.outputs) != 1:
            raise ValueError(f"model {self.name!r} has {len(self.outputs)} outputs; use output_shapes")
        return self.outputs[0].shape

    # ----- parameters and buffers -----

    def param_specs(self) -> dict[str, ParamSpec]:
        """Every parameter, in layer order: ``{"conv1.weight": ParamSpec(...), ...}`` (shared layers once)."""
        return {f"{layer.name}.{local}": spec for layer in self.layers for local, spec in layer.param_specs().items()}

    def buffer_specs(self) -> dict[str, BufferSpec]:
        """Every non-trainable state entry: ``{"batchnorm1.running_mean": BufferSpec(...), ...}``."""
        return {f"{layer.name}.{local}": spec for layer in self.layers for local, spec in layer.buffer_specs().items()}

    def param_shapes(self) -> dict[str, Shape]:
        return {name: spec.shape for name, spec in self.param_specs().items()}

    def trainable_param_names(self) -> list[str]:
        """The parameters training updates, in :meth:`param_specs` order: those of every layer not
        frozen (``layer.trainable = False``; Keras' ``model.trainable_weights``). A parameter another
        layer reads too (``Dense(weight_from=...)``) is frozen when either layer is, as PyTorch's
        ``requires_grad_(False)`` on either module freezes the one shared tensor."""
        held = {f"{owner.name}.{owned}" for layer in self.layers if not layer.trainable
                for owner, owned in layer.tied_params().values()}
        return [name for layer in self.layers if layer.trainable for local in layer.param_specs()
                if (name := f"{layer.name}.{local}") not in held]

    def trainable_param_shapes(self) -> dict[str, Shape]:
        """The shapes of :meth:`trainable_param_names`: what the optimizer keeps state for."""
        shapes = self.param_shapes()
        return {name: shapes[name] for name in self.trainable_param_names()}

    @property
    def trainable(self) -> bool:
        """Whether any layer is trainable. Setting it sets every layer's flag, as Keras'
        ``model.trainable`` does (``model.trainable = False`` freezes the whole model)."""
        return any(layer.trainable for layer in self.layers)

    @trainable.setter
    def trainable(self, value: bool) -> None:
        for layer in self.layers:
            layer.trainable = value

    def buffer_shapes(self) -> dict[str, Shape]:
        return {name: spec.shape for name, spec in self.buffer_specs().items()}

    @property
    def num_params(self) -> int:
        return sum(_count(s.shape) for s in self.param_specs().values())

    def init_params(self, seed: int, dtype: str = "float32") -> dict[str, np.ndarray]:
        """Fresh parameters; each drawn from its own generator (see ``opgrad.nn.init``)."""
        return {
            name: np.ascontiguousarray(spec.init(spec.shape, param_generator(seed, name), dtype))
            for name, spec in self.param_specs().items()
        }

    def init_buffers(self, dtype: str = "float32") -> dict[str, np.ndarray]:
        """Starting buffers (running mean 0, running variance 1)."""
        return {name: np.full(spec.shape, spec.value, dtype=dtype) for name, spec in self.buffer_specs().items()}

    def param_vars(self, dtype: str = "float32") -> dict[str, Var]:
        """One graph variable per parameter, named like the parameter."""
        return {name: var(name, spec.shape, dtype) for name, spec in self.param_specs().items()}

    def buffer_vars(self, dtype: str = "float32") -> dict[str, Var]:
        return {name: var(name, spec.shape, dtype) for name, spec in self.buffer_specs().items()}

    def input_vars(self, batch_size: int, dtype: str = "float32") -> list[Var]:
        """The step's input variables: ``images`` for a single input, else ``input:<name>``."""
        single = len(self.inputs) == 1
        return [var("images" if single else f"input:{t.name}", (batch_size, *t.shape),
                    dtype if t.dtype == "float" else t.dtype) for t in self.inputs]

    # ----- current weights (Keras' model.weights) -----

    @property
    def dtype(self) -> str:
        """The float type of the model's weights: float32 unless they were assigned (or trained by a
        Trainer) all in float64. ``predict`` computes in it."""
        return self._dtype

    @property
    def weights_assigned(self) -> bool:
        """Whether the model holds weights: assigned (set, loaded, imported or trained), handed out by
        ``params``, or held by another model for a layer the two share. A Trainer keeps them where
        it does, else it draws its own from its seed."""
        return self._weights_assigned or any(
            other._held_params.arrays is not None for _, others in self._sharing() for other in others)

    @property
    def params(self) -> dict[str, np.ndarray]:
        """The model's current parameters (initialized from seed 0 on first use, unless set).

        Once handed out they are the model's weights (:attr:`weights_assigned`): whoever read,
        changed in place or predicted with them finds the same ones in a Trainer. A layer object
        that several models use has one set of weights: each model reads the ones last assigned
        through any of them (Keras' shared layers)."""
        drawn = self._held_params.arrays is None
        if drawn:
            self._held_params.arrays = self.init_params(seed=0, dtype=self._dtype)
            self._weights_assigned = self.weights_drawn_at_first_use = True
        self._take_shared("params", drawn=drawn)
        assert self._held_params.arrays is not None
        return self._held_params.arrays

    @params.setter
    def params(self, values: Mapping[str, np.ndarray]) -> None:
        arrays = self._checked(values, self.param_shapes(), "parameter")
        # One float type for every array, as the compiled functions take them: the type of a
        # complete set given in one (a checkpoint, a float64 Trainer), else the model's own,
        # into which PyTorch's load_state_dict copies too.
        given = {a.dtype for a in arrays.values()}
        if len(given) == 1 and given <= {np.dtype(np.float32), np.dtype(np.float64)}:
            self._dtype = given.pop().name
        self._held_params.assign({k: a.astype(self._dtype, copy=False) for k, a in arrays.items()}, self.layers)
        if self._held_buffers.arrays is not None:
            self._held_buffers.arrays = {k: a.astype(self._dtype, copy=False)
                                         for k, a in self._held_buffers.arrays.items()}
        self._weights_assigned = True
        self.weights_drawn_at_first_use = False

    @property
    def buffers(self) -> dict[str, np.ndarray]:
        """The model's current buffers (running statistics), as initialized unless set or trained;
        shared layers' as :attr:`params` are."""
        drawn = self._held_buffers.arrays is None
        if drawn:
            self._held_buffers.arrays = self.init_buffers(self._dtype)
        self._take_shared("buffers", drawn=drawn)
        assert self._held_buffers.arrays is not None
        return self._held_buffers.arrays

    @buffers.setter
    def buffers(self, values: Mapping[str, np.ndarray]) -> None:
        arrays = self._checked(values, self.buffer_shapes(), "buffer")
        self._held_buffers.assign({k: a.astype(self._dtype, copy=False) for k, a in arrays.items()}, self.layers)

    def _checked(self, values: Mapping[str, np.ndarray], shapes: Mapping[str, Shape],
                 what: str) -> dict[str, np.ndarray]:
        missing = [n for n in shapes if n not in values]
        extra = [n for n in values if n not in shapes]
        if missing or extra:
            raise ValueError(f"model {self.name!r}: {what}s do not match: "
                             + "; ".join(filter(None, [f"missing {', '.join(missing)}" if missing else "",
                                                       f"unknown {', '.join(extra)}" if extra else ""])))
        out = {}
        for name, shape in shapes.items():
            value = np.asarray(values[name])
            if value.dtype.kind != "f":
                raise TypeError(f"model {self.name!r}: {what} {name} has dtype {value.dtype}; {what}s are float "
                                f"arrays (float32 or float64): convert it with .astype(np.float32)")
            if tuple(value.shape) != shape:
                raise ShapeError(f"model {self.name!r}: {what} {name} has shape {value.shape}, expected {shape}")
            out[name] = value
        return out

    # ----- layers shared with other models -----

    def _sharing(self) -> list[tuple[Layer, list[Model]]]:
        """Each of this model's layers that other live models use too, with those models."""
        shared = []
        for layer in self.layers:
            users = _MODELS_USING.get(layer)
            if users is not None and len(users) > 1:
                shared.append((layer, [m for m in users if m is not self]))
        return shared

    def _take_shared(self, which: str, *, drawn: bool = False) -> None:
        """Bring in, for each shared layer, the arrays another model was assigned after this one's;
        just ``drawn`` (from seed 0), any other model's, so that all use the same arrays."""
        mine = self._held_params if which == "params" else self._held_buffers
        assert mine.arrays is not None
        for layer, others in self._sharing():
            held = [m._held_params if which == "params" else m._held_buffers for m in others]
            newest = max((h for h in held if h.arrays is not None), key=lambda h: h.stamp(layer), default=None)
            if newest is None or newest.stamp(layer) < mine.stamp(layer) + (0 if drawn else 1):
                continue
            assert newest.arrays is not None
            names = layer.param_specs() if which == "params" else layer.buffer_specs()
            for local in names:
                key = f"{layer.name}.{local}"
                mine.arrays[key] = newest.arrays[key].astype(self._dtype, copy=False)
            if newest.stamp(layer):
                mine.stamps[id(layer)] = newest.stamp(layer)

    # ----- dropout masks -----

    def noise_layers(self) -> list[Layer]:
        """Layers that read a random mask while training (dropout, attention dropout), in order."""
        return [layer for layer in self.layers if layer.noise_shape() is not None]

    def sample_noise(self, rng: np.random.Generator, batch: int, dtype: str = "float32") -> dict[str, np.ndarray]:
        """One training step's masks, keyed by layer name, drawn in layer order from ``rng``."""
        masks = {}
        for layer in self.noise_layers():
            shape = layer.noise_shape()
            assert layer.name is not None and shape is not None
            masks[layer.name] = layer.sample_mask(rng, (batch, *shape), dtype)
        return masks

    # ----- the forward graph -----

    def call(self, inputs: Sequence[Expr], variables: Mapping[str, Expr],
             ctx: ForwardContext | None = None) -> tuple[list[Expr], dict[str, Expr]]:
        """``(outputs, new buffers)`` for batches ``inputs`` (one per model input, in order).

        ``variables`` holds every parameter and buffer by full name. Buffers change only while
        training; a layer called twice (shared) sees the buffers its first call produced.
        """
        ctx = ctx or ForwardContext()
        if len(inputs) != len(self.inputs):
            raise ValueError(f"model {self.name!r} takes {len(self.inputs)} input(s), got {len(inputs)}")
        for expr, tensor in zip(inputs, self.inputs):
            if tuple(expr.shape[1:]) != tensor.shape:
                raise ShapeError(f"{self.name}: input {tensor.name!r} has shape {expr.shape}, expected "
                                 f"(batch, {', '.join(map(str, tensor.shape))})")
        missing = [n for n in (*self.param_specs(), *self.buffer_specs()) if n not in variables]
        if missing:
            raise ValueError(f"{self.name}: no value given for parameter(s) {', '.join(missing)}")
        values: dict[int, Expr] = {id(t): e for t, e in zip(self.inputs, inputs)}
        buffers = {name: variables[name] for name in self.buffer_specs()}
        for node in self.nodes:
            layer = node.layer
            params = {local: variables[f"{layer.name}.{local}"] for local in layer.param_specs()}
            params.update({local: variables[f"{owner.name}.{owned}"]
                           for local, (owner, owned) in layer.tied_params().items()})
            local_buffers = {local: buffers[f"{layer.name}.{local}"] for local in layer.buffer_specs()}
            args = [values[id(t)] for t in node.inputs]
            out, updated = layer.call(args if layer.multi_input else args[0], params, local_buffers, ctx)
            buffers.update({f"{layer.name}.{local}": value for local, value in updated.items()})
            values[id(node.output)] = out
        return [values[id(t)] for t in self.outputs], buffers

    def forward(self, x: Expr | Sequence[Expr], params: Mapping[str, Expr], ctx: ForwardContext | None = None) -> Expr:
        """The (first) output expression for a batch ``x`` shaped ``(N, *input_shape)``.

        ``params`` holds the parameters and, for a model with buffers, the buffers too.
        """
        inputs = [x] if isinstance(x, Expr) else list(x)
        variables = dict(params)
        if len(inputs) == 1 and len(self.inputs) == 1 and tuple(inputs[0].shape[1:]) != self.inputs[0].shape:
            raise ShapeError(f"{self.name}: input has shape {inputs[0].shape}, expected "
                             f"(batch, {', '.join(map(str, self.inputs[0].shape))})")
        return self.call(inputs, variables, ctx)[0][0]

    # ----- inference -----

    def predict(self, inputs: np.ndarray | Sequence[np.ndarray], *, batch_size: int = 32,
                backend: str = "llvm") -> np.ndarray | list[np.ndarray]:
        """The model's outputs for ``inputs`` with its current weights, through the compiled evaluation step.

        ``inputs`` is one array ``(N, *input_shape)`` (a list of them for several inputs); the
        result is one array (a list for several outputs), logits for a classifier. ``backend``
        ``"llvm"`` falls back to the numpy reference when the compiler cannot be imported. A
        ``batch_size`` above the number of examples compiles for that number instead (rounded up
        to a power of two, at least 32): the same outputs, without memory for rows never given.
        """
        from opgrad.nn.step import EvalStep, llvm_unavailable_reason, per_input

        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"predict: batch_size must be a positive integer, got {batch_size!r}")
        if backend == "llvm" and llvm_unavailable_reason() is not None:
            backend = "reference"
        arrays = per_input(inputs, len(self.inputs), "input", f"predict: model {self.name!r}")
        for array, tensor in zip(arrays, self.inputs):
            if tuple(array.shape[1:]) != tensor.shape:
                raise ShapeError(f"predict: input {tensor.name!r} has shape {array.shape}, model {self.name!r} "
                                 f"expects (N, {', '.join(map(str, tensor.shape))})")
        weights = {**self.params, **self.buffers}
        dtype = self.dtype
        examples = len(arrays[0]) if arrays[0].ndim else 0
        batch = min(int(batch_size), max(32, 1 << max(0, examples - 1).bit_length()))
        key = (batch, dtype, backend)
        step = self._predict_steps.get(key)
        if step is None:
            step = self._predict_steps[key] = EvalStep(self, batch_size=batch, dtype=dtype, backend=backend)
        # An array put into the dicts in place (not through the setters) is brought to the model's type here.
        outputs = step.outputs(arrays, {k: np.asarray(v).astype(dtype, copy=False) for k, v in weights.items()})
        return outputs[0] if len(outputs) == 1 else outputs

    # ----- description -----

    def _node_labels(self) -> dict[int, str]:
        """A readable name per tensor: the input's name, or the layer's (``name#2`` for a second call)."""
        labels = {id(t): str(t.name) for t in self.inputs}
        calls: dict[int, int] = {}
        for node in self.nodes:
            n = calls[id(node.layer)] = calls.get(id(node.layer), 0) + 1
            labels[id(node.output)] = f"{node.layer.name}" + (f"#{n}" if n > 1 else "")
        return labels

    def summary(self) -> str:
        """A Keras-like table: layer, output shape, parameter count, and (for a graph) its inputs."""
        labels = self._node_labels()
        show_wiring = not isinstance(self, Sequential)
        rows = [("layer", "output shape", "params", "connected to")]
        if show_wiring:
            rows += [(f"{t.name!r} (Input{'' if t.dtype == 'float' else ', ' + t.dtype})", str(t.shape), "0", "")
                     for t in self.inputs]
        counted: set[int] = set()
        for node in self.nodes:
            layer = node.layer
            shared = id(layer) in counted
            count = 0 if shared else sum(_count(s.shape) for s in layer.param_specs().values())
            counted.add(id(layer))
            label = layer.describe() if not shared else f"{labels[id(node.output)]!r} (shared)"
            count_text = f"{count:,}" + (" frozen" if count and not layer.trainable else "")
            rows.append((label, str(node.output.shape), count_text, ", ".join(labels[id(t)] for t in node.inputs)))
        columns = 4 if show_wiring else 3
        widths = [max(len(r[i]) for r in rows) for i in range(columns)]
        lines = []
        for row in rows:
            line = f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:>{widths[2]}}"
            if show_wiring:
                line += f"  {row[3]:<{widths[3]}}"
            lines.append(line.rstrip())
        lines.insert(1, "-" * max(len(line) for line in lines))
        buffers = sum(_count(s.shape) for s in self.buffer_specs().values())
        shapes = ", ".join(str(s) for s in self.input_shapes)
        shapes_of = self.param_shapes()
        frozen = self.num_params - sum(_count(shapes_of[name]) for name in self.trainable_param_names())
        lines.append(f"total: {self.num_params:,} parameters" + (f" ({frozen:,} frozen)" if frozen else "")
                     + (f" (+{buffers:,} buffer values)" if buffers else "")
                     + f", input{'s' if len(self.inputs) > 1 else ''} {shapes}")
        return f"model {self.name!r}\n" + "\n".join(lines)

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(f"model {self.name!r}: {NOT_A_LAYER}")

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} {self.name!r}: {len(self.layers)} layers, {self.num_params:,} parameters, "
                f"inputs {self.input_shapes}, outputs {self.output_shapes}>")

    # ----- serialization -----

    def get_config(self) -> dict[str, Any]:
        """The architecture as plain JSON: layers with their arguments, and the wiring."""
        index = {id(t): i for i, t in enumerate(self.inputs)}
        for k, node in enumerate(self.nodes):
            index[id(node.output)] = len(self.inputs) + k
        return {
            "format": CONFIG_FORMAT,
            "class": "Model",
            "name": self.name,
            "inputs": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype} for t in self.inputs],
            "layers": [_layer_entry(layer) for layer in self.layers],
            "nodes": [{"layer": node.layer.name, "inputs": [index[id(t)] for t in node.inputs]} for node in self.nodes],
            "outputs": [index[id(t)] for t in self.outputs],
            **({"input_names": self.input_names} if self.input_names is not None else {}),
            **({"output_names": self.output_names} if self.output_names is not None else {}),
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the architecture, parameters and buffers to ``path`` (an opgrad ``.npz`` checkpoint)."""
        from opgrad.checkpoint import save_checkpoint

        save_checkpoint(path, {**self.params, **self.buffers},
                        {"model": self.name, "architecture": self.get_config(), "step": 0})


class Sequential(Model):
    """A stack of layers applied in order to inputs of per-example shape ``input_shape``.

    The chain special case of :class:`Model`: ``Sequential([a, b, c], input_shape=s)`` is
    ``Model(inp, c(b(a(inp))))`` with ``inp = Input(s)``. Layers are named before they are
    wired, so a shape error already names the layer (``'dense1' (Dense(10))``).
    """

    def __init__(self, layers: Sequence[Layer], input_shape: Sequence[int], *, name: str = "model") -> None:
        if not layers:
            raise ValueError("Sequential needs at least one layer")
        for layer in layers:
            if isinstance(layer, Model):
                raise TypeError(f"Sequential takes Layer objects, got model {layer.name!r}: {NOT_A_LAYER}")
            if not isinstance(layer, Layer):
                raise TypeError(f"Sequential takes Layer objects, got {layer!r}")
            if layer.multi_input:
                raise TypeError(f"Sequential: layer {layer.describe()} takes several inputs; use nn.Model")
        counts: dict[str, int] = {}
        seen: set[str] = set()
        # Layers reused from another model keep their names; new ones are numbered past them.
        taken = {layer.name for layer in layers if layer.name is not None}
        for layer in layers:
            if layer.name is None:
                while True:
                    counts[layer.kind] = counts.get(layer.kind, 0) + 1
                    if f"{layer.kind}{counts[layer.kind]}" not in taken:
                        break
                layer.name = f"{layer.kind}{counts[layer.kind]}"
            if layer.name in seen:
                raise ValueError(f"two layers are named {layer.name!r}; layer names must be unique")
            seen.add(layer.name)
        ids = layers[0].input_dtype != "float"  # an Embedding first: the input holds token ids, not images
        inp = Input(tuple(input_shape), dtype=layers[0].input_dtype, name="tokens" if ids else "images")
        x = inp
        for layer in layers:
            x = layer(x)
        super().__init__(inp, x, name=name)

    def get_config(self) -> dict[str, Any]:
        return {
            "format": CONFIG_FORMAT,
            "class": "Sequential",
            "name": self.name,
            "input_shape": list(self.input_shape),
            "layers": [_layer_entry(layer) for layer in self.layers],
        }


def _layer_from_config(entry: Mapping[str, Any], source: str) -> Layer:
    kind, name = entry.get("kind"), entry.get("name")
    cls = LAYERS.get(str(kind))
    if cls is None:
        raise ValueError(
            f"{source}: unknown layer kind {kind!r} (layer {name!r}); known kinds: {', '.join(sorted(LAYERS))}. "
            "A custom layer's class must be defined (imported) before the model is loaded"
        )
    trainable = entry.get("trainable", True)
    if not isinstance(trainable, bool):
        raise ValueError(f"{source}: layer {name!r} has trainable {trainable!r}; expected true or false")
    try:
        layer = cls.from_config(entry.get("config") or {}, name=name)
        layer.trainable = trainable
        return layer
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: layer {name!r} ({cls.__name__}): cannot rebuild it from {entry.get('config')}: "
                         f"{exc}") from None


def model_from_config(config: Mapping[str, Any], *, source: str = "model description") -> Model:
    """Rebuild the model :meth:`Model.get_config` described (fresh layers, no weights)."""
    if config.get("format") != CONFIG_FORMAT:
        raise ValueError(f"{source}: model description format {config.get('format')!r}, this opgrad reads "
                         f"{CONFIG_FORMAT!r}")
    try:
        layers = [_layer_from_config(entry, source) for entry in config["layers"]]
        named = {layer.name: layer for layer in layers}
        for layer in layers:  # a layer reading another's parameter names it in the description
            link = getattr(layer, "link_tied", None)
            if link is not None:
                link(named)
        if config.get("class") == "Sequential":
            return Sequential(layers, tuple(config["input_shape"]), name=str(config["name"]))
        if config.get("class") != "Model":
            raise ValueError(f"{source}: unknown model class {config.get('class')!r}")
        by_name = {layer.name: layer for layer in layers}
        tensors: list[SymbolicTensor] = [Input(tuple(i["shape"]), dtype=i["dtype"], name=i["name"])
                                         for i in config["inputs"]]
        for node in config["nodes"]:
            layer = by_name[node["layer"]]
            args = [tensors[i] for i in node["inputs"]]
            tensors.append(layer(args if layer.multi_input else args[0]))
        return Model(tensors[: len(config["inputs"])], [tensors[i] for i in config["outputs"]],
                     name=str(config["name"]), input_names=config.get("input_names"),
                     output_names=config.get("output_names"))
    except (KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"{source}: malformed model description ({type(exc).__name__}: {exc})") from None



def load_model(path: str | os.PathLike[str]) -> Model:
    """Rebuild the model a checkpoint holds, with its parameters and buffers (Keras' ``load_model``).

    Works for any checkpoint written by ``model.save`` or ``opgrad train --save``, without the
    code that built the model: the architecture is JSON in the checkpoint's metadata. Every
    problem is a :class:`~opgrad.checkpoint.CheckpointError` naming the file: not an opgrad
    checkpoint, an unknown layer kind, weights that do not fit the architecture.
    """
    from opgrad.checkpoint import CheckpointError, load_checkpoint

    arrays, meta = load_checkpoint(path)
    config = meta.get("architecture")
    if config is None:
        from opgrad.nn.models import MODELS

        builtin = MODELS.get(str(meta.get("model")))
        if builtin is None:
            raise CheckpointError(f"{path}: the checkpoint holds no model description (no \"architecture\" in "
                                  f"its metadata) and its model {meta.get('model')!r} is not built in")
        model = builtin()
    else:
        try:
            model = model_from_config(config, source=str(path))
        except (ValueError, ShapeError) as exc:
            raise CheckpointError(str(exc)) from None
    problems = []
    for name, shape in {**model.param_shapes(), **model.buffer_shapes()}.items():
        if name not in arrays:
            problems.append(f"missing {name}")
        elif arrays[name].shape != shape:
            problems.append(f"{name} has shape {arrays[name].shape}, the architecture expects {shape}")
    if problems:
        raise CheckpointError(f"{path}: the weights do not fit the model description: {'; '.join(problems)}")
    model.params = {name: np.array(arrays[name], order="C") for name in model.param_shapes()}
    model.buffers = {name: np.array(arrays[name], order="C") for name in model.buffer_shapes()}
    model.checkpoint_meta = dict(meta)
    return model
