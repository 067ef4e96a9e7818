"""The training step (forward + backward + optimizer update as ONE function) and the eval step.

Why one function: it is what gets compiled. ``opgrad.compile`` then sees the whole step, can
fuse and schedule across layer boundaries, and Python runs one call per batch (XLA compiles
whole training loops for the same reason). The reference backend evaluates the very same function
with numpy, which is what makes backend parity testable step by step.

Signature of the training function (all arrays, fixed shapes)::

    train(images[B,C,H,W], labels[B]:int64 (or targets[B,...]), <dropout masks...>, lr[], <params...>, <state...>)
        -> (loss[], <new params...>, <new state...>)

``state`` is the optimizer's state followed by the model's buffers (``BatchNorm2D``'s running
statistics), so buffers are updated inside the compiled step like the optimizer's moments. A
model with several inputs takes one array per input in place of ``images``; one with several
outputs takes one label array per output (each output's loss, summed with ``loss_weights``).
``loss`` picks the losses (:data:`~opgrad.nn.losses.LOSSES`): softmax cross-entropy against int64
class labels by default, or a regression loss against float targets of the output's shape
(``labels[B, ...]``, the step's dtype).

The backend is a name: ``"reference"`` (``opgrad.evaluate``) or ``"llvm"``
(``opgrad.compile(fn)``); switching is that one argument.

:meth:`TrainStep.run_steps` runs K steps per call over batch-major arrays (``images[K*B, ...]``,
``labels[K*B]``, dropout masks ``[K*B, ...]``, one learning rate per step). With ``"llvm"`` that
is one native call through the loop compiled into the step's module
(:mod:`opgrad.compiler.steploop`): the images, labels, masks and learning rate are streamed,
the loss is written per step, and weights and optimizer state are carried from step to step
without leaving native code. The losses and weights equal K single steps bitwise.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from opgrad import ops
from opgrad.autodiff import gradients
from opgrad.errors import OpgradError, ShapeError
from opgrad.ir import Call, Expr, Function, Var, var
from opgrad.nn.layers import ForwardContext, is_number
from opgrad.nn.losses import CLASS_LABEL_LOSS, LOSSES, loss_name
from opgrad.nn.model import Model
from opgrad.nn.optim import Optimizer
from opgrad.reference import evaluate

__all__ = [
    "BACKENDS",
    "EvalStep",
    "NanLossError",
    "StepFn",
    "StepLabels",
    "StepResult",
    "StepsResult",
    "TrainStep",
    "batch_vars",
    "check_input_values",
    "compile_function",
    "dataset_loss",
    "llvm_unavailable_reason",
    "mask_arrays",
    "model_input_arrays",
    "model_loss",
    "per_input",
    "per_output",
    "per_position",
    "resolve_losses",
    "trainable_names",
]

#: A function's runnable form: arrays in, a tuple of arrays out (as ``opgrad.evaluate`` returns).
StepFn = Callable[..., tuple[np.ndarray, ...]]
BACKENDS = ("llvm", "reference")


def llvm_unavailable_reason() -> str | None:
    """None when ``opgrad.compile`` can be imported, else why not (for a fallback warning)."""
    try:
        from opgrad.compiler import compile as _compile  # noqa: F401
    except Exception as exc:  # ImportError today; anything the compiler's import raises later
        return f"{type(exc).__name__}: {exc}"
    return None


def compile_function(fn: Function, backend: str) -> StepFn:
    """Make ``fn`` runnable on ``backend``; the result returns a tuple like ``opgrad.evaluate``.

    ``"llvm"`` raises ImportError/AttributeError while the compiler is not available; callers that
    want a fallback check :func:`llvm_unavailable_reason` first.
    """
    if not fn.returns_tuple:
        raise ValueError("compile_function expects a tuple-returning function")
    if backend == "reference":

        def run(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
            return evaluate(fn, *arrays)  # type: ignore[return-value]

        return run
    if backend == "llvm":
        from opgrad.compiler import compile as compile_fn  # here: the compiler pulls in llvmlite

        compiled = compile_fn(fn)

        def run_compiled(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
            out = compiled(*arrays)
            return tuple(out) if isinstance(out, (tuple, list)) else (out,)

        return run_compiled
    raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")


@dataclass(frozen=True)
class StepResult:
    """What one training step returns: the batch loss and the updated arrays."""

    loss: float
    params: dict[str, np.ndarray]
    state: dict[str, np.ndarray]


@dataclass(frozen=True)
class StepsResult:
    """What :meth:`TrainStep.run_steps` returns: one loss per step and the arrays after the last."""

    losses: np.ndarray
    params: dict[str, np.ndarray]
    state: dict[str, np.ndarray]


class NanLossError(OpgradError, FloatingPointError):
    """A step's loss was NaN or infinite and ``run_steps(..., stop_on_nan=True)`` was asked to stop there.

    ``step`` is that step (0-based within the call); ``losses`` ends with its loss; ``params``
    and ``state`` are the values *before* it, i.e. after ``step`` good steps.
    """

    def __init__(self, message: str, step: int, losses: np.ndarray, params: dict[str, np.ndarray],
                 state: dict[str, np.ndarray]) -> None:
        super().__init__(message)
        self.step, self.losses, self.params, self.state = step, losses, params, state


class TrainStep:
    """Builds the training function for ``model`` + ``optimizer`` once, then runs it per batch
    (``__call__``) or K batches per call (:meth:`run_steps`)."""

    def __init__(self, model: Model, optimizer: Optimizer, *, batch_size: int, dtype: str = "float32",
                 backend: str = "reference", loss: str | Sequence[str] = CLASS_LABEL_LOSS,
                 loss_weights: Sequence[float] | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        check_optimizer(optimizer, "TrainStep")
        self.model, self.optimizer = model, optimizer
        self.batch_size, self.dtype, self.backend = batch_size, dtype, backend
        #: Each output's loss (a :data:`~opgrad.nn.losses.LOSSES` name).
        self.losses = resolve_losses(model, loss, "TrainStep")
        inputs, masks = batch_vars(model, batch_size, dtype)
        lr = var("lr", (), dtype)
        params = model.param_vars(dtype)
        trained = {name: params[name] for name in trainable_names(model, "TrainStep")}
        opt_state = {name: var(name, shape, dtype)
                     for name, shape in optimizer.state_shapes(model.trainable_param_shapes()).items()}
        buffers = model.buffer_vars(dtype)
        outputs, new_buffers = model.call(inputs, {**params, **buffers},
                                          ForwardContext(training=True, noise=masks))
        self.labels = StepLabels(model, outputs, self.losses, dtype)
        objective = model_loss(model, outputs, self.labels.vars, self.losses, loss_weights)
        grads = dict(zip(trained, gradients(objective, list(trained.values()))))
        # A frozen parameter comes out as it went in: the step keeps one signature (every
        # parameter in and out), which its loop, in-place plan and C export rely on.
        new_params, new_state = optimizer.update(trained, grads, opt_state, lr)
        new_params = {name: new_params.get(name, param) for name, param in params.items()}
        missing = sorted(set(opt_state) - set(new_state))
        if missing:
            raise RuntimeError(f"{optimizer.describe()} produced no update for state {missing}")
        new_state.update(new_buffers)
        state = {**opt_state, **buffers}
        self.param_names: tuple[str, ...] = tuple(params)
        self.state_names: tuple[str, ...] = tuple(state)
        self.mask_names: tuple[str, ...] = tuple(masks)
        self.function = Function(
            [*inputs, *self.labels.vars, *masks.values(), lr, *params.values(), *state.values()],
            [objective, *(new_params[n] for n in self.param_names), *(new_state[n] for n in self.state_names)],
        )
        # The llvm backend compiles on first use, one plan per way of calling (see ``compiled``).
        self._compiled: Any = None
        self._separate: Any = None
        self._run = compile_function(self.function, backend) if backend != "llvm" else self._run_compiled

    @property
    def compiled(self) -> Any:
        """The llvm backend's :class:`~opgrad.compiler.CompiledFunction` (None on the reference
        backend), compiled on first use: it has the multi-step loop of :meth:`run_steps` and
        computes the new parameters and state over the old ones (:mod:`opgrad.compiler.inplace`).
        Calls that donate nothing run a plan whose results have memory of their own (compiled on
        the first such call): copying the weights first would cost more than the update saves."""
        if self.backend != "llvm":
            return None
        if self._compiled is None:
            from opgrad.compiler import compile as compile_fn  # here: the compiler pulls in llvmlite

            loop = self.step_loop()
            self._compiled = compile_fn(self.function, loop=loop, in_place=loop.carry)
        return self._compiled

    def _run_compiled(self, *arrays: np.ndarray, donate: bool = False) -> tuple[np.ndarray, ...]:
        if donate:
            return tuple(self.compiled(*arrays, donate=True))
        if self._separate is None:
            if self._compiled is not None and not self._compiled.in_place:
                self._separate = self._compiled  # it updates nothing in place, so it serves here too
            else:
                from opgrad.compiler import compile as compile_fn

                self._separate = compile_fn(self.function)
        return tuple(self._separate(*arrays))

    def named_arrays(self, params: Mapping[str, np.ndarray], state: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """The parameters, then the optimizer and model state, in the step's order; a ValueError
        names every one missing (a KeyError would name only the first, and not what it is)."""
        missing = [f"parameter {n}" for n in self.param_names if n not in params]
        missing += [f"state {n}" for n in self.state_names if n not in state]
        if missing:
            raise ValueError(f"the training step of model {self.model.name!r} needs every parameter and state "
                             f"array; missing: {', '.join(missing)}")
        return [*(params[n] for n in self.param_names), *(state[n] for n in self.state_names)]

    def step_loop(self) -> Any:
        """The :class:`~opgrad.compiler.steploop.StepLoop` of this step: images, labels, masks and
        lr streamed, the loss outfed (and checked for NaN and infinities), params and state carried."""
        from opgrad.compiler.steploop import StepLoop

        nm, k = len(self.mask_names), len(self.param_names) + len(self.state_names)
        # inputs (images), labels (one per output), masks..., lr, then params and state
        first = len(self.model.inputs) + len(self.model.outputs) + nm + 1
        return StepLoop(streams=tuple(range(first)), outfeeds=(0,),
                        carry=tuple((first + j, 1 + j) for j in range(k)), nan_check=0)

    def __call__(self, images: np.ndarray | Sequence[np.ndarray], labels: np.ndarray | Sequence[np.ndarray],
                 params: Mapping[str, np.ndarray], state: Mapping[str, np.ndarray], lr: float,
                 masks: Mapping[str, np.ndarray] | None = None, *, donate: bool = False) -> StepResult:
        """One step. ``donate=True`` lets the llvm backend write the new parameters and state over
        the arrays passed, as PyTorch's optimizers update in place: the returned dicts then hold
        those arrays (the caller gives them up), and the step needs no second copy of the model.
        Without it nothing passed is modified. The reference backend always returns new arrays."""
        inputs = model_input_arrays(self.model, images, self.dtype, f"TrainStep of model {self.model.name!r}")
        self.check_batch(inputs, self.batch_size, "TrainStep")
        arrays = (
            *inputs,
            *self.labels.arrays(per_output(labels, len(self.model.outputs)), self.batch_size, "TrainStep"),
            *mask_arrays(self.mask_names, masks), np.asarray(lr, dtype=self.dtype),
            *self.named_arrays(params, state),
        )
        outputs = self._run(*arrays, donate=True) if donate and self.backend == "llvm" else self._run(*arrays)
        k = len(self.param_names)
        return StepResult(
            loss=float(outputs[0]),
            params=dict(zip(self.param_names, outputs[1 : 1 + k])),
            state=dict(zip(self.state_names, outputs[1 + k :])),
        )

    def check_batch(self, inputs: Sequence[np.ndarray], rows: int, who: str) -> None:
        """A ``ShapeError`` naming the model, the input and ``batch_size`` where an input array is
        not ``rows`` examples of the input's shape (the function's own check names only the
        argument)."""
        for tensor, shape, array in zip(self.model.inputs, self.model.input_shapes, inputs, strict=True):
            want = (rows, *shape)
            got = np.shape(array)
            if got != want:
                smaller = (" (a last, smaller batch: leave it out, as Trainer.train_epoch does)"
                           if got and got[0] < rows else "")
                cause = (f"a batch of {got[0]} where the step was built for batch_size={self.batch_size}{smaller}"
                         if got[1:] == tuple(shape) else f"examples of shape {tuple(shape)}")
                raise ShapeError(f"{who} of model {self.model.name!r}: input {tensor.name!r} has shape {got}, expected "
                                 f"{want}: {cause}")

    def run_steps(self, images: np.ndarray | Sequence[np.ndarray], labels: np.ndarray | Sequence[np.ndarray],
                  params: Mapping[str, np.ndarray],
                  state: Mapping[str, np.ndarray], lr: float | np.ndarray,
                  masks: Mapping[str, np.ndarray] | None = None, *, stop_on_nan: bool = False) -> StepsResult:
        """``K = len(labels) // batch_size`` training steps in one call; same numbers as K calls.

        ``images`` is ``(K * batch_size, *input_shape)`` and ``labels`` ``(K * batch_size,)``,
        batch-major (step ``i`` trains on rows ``i*B .. i*B+B-1``); ``masks`` holds each dropout
        layer's masks the same way; ``lr`` is one float for every step or an array of K. With
        ``stop_on_nan`` a NaN or infinite loss raises :class:`NanLossError` carrying the state before it. A
        model with several inputs or outputs takes lists, as :meth:`__call__` does.
        """
        b = self.batch_size
        inputs = model_input_arrays(self.model, images, self.dtype,
                                    f"TrainStep.run_steps of model {self.model.name!r}")
        label_arrays = per_output(labels, len(self.model.outputs))
        rows_given = len(label_arrays[0])
        if rows_given % b:
            raise ValueError(f"run_steps: labels has {rows_given} rows, not a multiple of the batch size {b}")
        named = [*((f"input {t.name!r}", a) for t, a in zip(self.model.inputs, inputs, strict=True)),
                 *((f"labels {i}", y) for i, y in enumerate(label_arrays))]
        for what, array in named:
            if np.ndim(array) and len(array) != rows_given:
                raise ShapeError(f"TrainStep.run_steps of model {self.model.name!r}: {what} has {len(array)} rows "
                                 f"and the labels {rows_given}: each holds the K * batch_size rows of K steps "
                                 f"(step i trains on rows i*{b} .. i*{b}+{b - 1})")
        steps = rows_given // b
        self.check_batch(inputs, steps * b, "TrainStep.run_steps")
        label_arrays = self.labels.arrays(label_arrays, steps * b, "TrainStep.run_steps")
        lrs = np.asarray(lr, dtype=self.dtype)
        lrs = np.full(steps, lrs, self.dtype) if lrs.ndim == 0 else lrs
        if lrs.shape != (steps,):
            raise ValueError(f"run_steps: lr must be a float or an array of {steps} (one per step), "
                             f"got shape {lrs.shape}")
        mask_arrays(self.mask_names, masks)  # every mask is given
        self.named_arrays(params, state)  # every parameter and state array is given
        masks = masks or {}
        if self.compiled is None:
            return self._run_steps_in_python(inputs, label_arrays, params, state, lrs, masks, stop_on_nan)
        from opgrad.compiler.steploop import LoopStopped

        k = len(self.param_names)
        try:
            out = self.compiled.run_steps(
                steps, *inputs, *label_arrays, *(masks[n] for n in self.mask_names), lrs,
                *(params[n] for n in self.param_names), *(state[n] for n in self.state_names),
                stop_on_nan=stop_on_nan)
        except LoopStopped as stop:
            o = stop.outputs
            raise NanLossError(f"run_steps: the loss is {o[0][stop.step]} at step {stop.step}; stopped there "
                               "(stop_on_nan: NaN or infinite)",
                               stop.step, np.asarray(o[0]), dict(zip(self.param_names, o[1 : 1 + k])),
                               dict(zip(self.state_names, o[1 + k :]))) from None
        return StepsResult(np.asarray(out[0]), dict(zip(self.param_names, out[1 : 1 + k])),
                           dict(zip(self.state_names, out[1 + k :])))

    def _run_steps_in_python(self, images: list[np.ndarray], labels: list[np.ndarray], params: Mapping[str, np.ndarray],
                             state: Mapping[str, np.ndarray], lrs: np.ndarray, masks: Mapping[str, np.ndarray],
                             stop_on_nan: bool) -> StepsResult:
        """The reference backend's run_steps: the same contract, one call per step."""
        b = self.batch_size
        cur_params, cur_state = dict(params), dict(state)
        losses = np.empty(len(lrs), self.dtype)
        for i in range(len(lrs)):
            rows = slice(i * b, (i + 1) * b)
            result = self([a[rows] for a in images], [a[rows] for a in labels], cur_params, cur_state, lrs[i],
                          {n: m[rows] for n, m in masks.items()})
            losses[i] = result.loss
            if stop_on_nan and not np.isfinite(losses[i]):
                raise NanLossError(f"run_steps: the loss is {losses[i]} at step {i}; stopped there "
                                   "(stop_on_nan: NaN or infinite)",
                                   i, losses[: i + 1], cur_params, cur_state)
            cur_params, cur_state = result.params, result.state
        return StepsResult(losses, cur_params, cur_state)


def trainable_names(model: Model, who: str) -> list[str]:
    """``model``'s trainable parameters (:meth:`~opgrad.nn.Model.trainable_param_names`); a
    ValueError naming ``who`` where every layer is frozen, which would train nothing."""
    names = model.trainable_param_names()
    if not names:
        what = "has no parameters" if not model.param_shapes() else "has every layer frozen (trainable=False)"
        raise ValueError(f"{who}: model {model.name!r} {what}, so training would change nothing; set "
                         "layer.trainable = True on the layers to train")
    return names


def check_optimizer(optimizer: object, who: str) -> None:
    """A TypeError naming ``who`` where ``optimizer`` is not an optimizer object (the class itself,
    ``nn.Adam`` for ``nn.Adam()``, included)."""
    if isinstance(optimizer, type) and issubclass(optimizer, Optimizer):
        raise TypeError(f"{who}: optimizer is the class {optimizer.__name__}; pass an optimizer object, "
                        f"{optimizer.__name__}() (with its settings, if any)")
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"{who}: optimizer must be an optimizer object such as nn.SGD() or nn.Adam() "
                        f"(nn.make_optimizer(name) builds one by name), got {optimizer!r}")


def check_loss_weights(model: Model, loss_weights: Sequence[float] | None) -> None:
    """A ValueError naming ``model`` unless ``loss_weights`` is None or one finite number >= 0 per
    output."""
    if loss_weights is None:
        return
    for w in loss_weights:
        if not (is_number(w) and math.isfinite(w) and w >= 0):
            raise ValueError(f"model {model.name!r}: loss_weights must be finite numbers >= 0 (one per "
                             f"output), got {list(loss_weights)!r}")
    if len(loss_weights) != len(model.outputs):
        raise ValueError(f"loss_weights has {len(loss_weights)} entries but model {model.name!r} has "
                         f"{len(model.outputs)} outputs")


def per_position(output: Expr, labels: Expr, loss: str) -> tuple[Expr, Expr]:
    """A ``(N, length, classes)`` output under cross-entropy as ``N * length`` rows of one class
    each, against its labels flattened (:class:`StepLabels`): PyTorch's ``logits.view(-1, classes)``,
    the mean over every position of every example. Other outputs as they are."""
    if loss != CLASS_LABEL_LOSS or output.ndim != 3:
        return output, labels
    n, length, classes = output.shape
    return ops.reshape(output, shape=(n * length, classes)), labels


def resolve_losses(model: Model, loss: str | Sequence[str], who: str) -> list[str]:
    """One :data:`~opgrad.nn.losses.LOSSES` name per output of ``model``: ``loss`` names one for
    every output, or is a list of one per output; a ValueError naming ``who`` otherwise."""
    if isinstance(loss, Mapping):
        raise TypeError(f"{who}: loss is a dict; give one name for every output, or a list of names in the order "
                        f"of model {model.name!r}'s outputs")
    names = [loss] * len(model.outputs) if isinstance(loss, str) or not isinstance(loss, (list, tuple)) else list(loss)
    if len(names) != len(model.outputs):
        raise ValueError(f"{who}: loss names {len(names)} loss(es) but model {model.name!r} has "
                         f"{len(model.outputs)} output(s); give one name, or one per output")
    return [loss_name(name, who) for name in names]


def model_loss(model: Model, outputs: Sequence[Expr], labels: Sequence[Var], losses: Sequence[str],
               loss_weights: Sequence[float] | None) -> Expr:
    """Each output's loss against its labels (or targets), weighted and summed."""
    check_loss_weights(model, loss_weights)
    weights = [1.0] * len(outputs) if loss_weights is None else [float(w) for w in loss_weights]
    for i, (out, loss) in enumerate(zip(outputs, losses, strict=True)):
        if loss == "bce_with_logits" and isinstance(out, Call) and out.op.name == "sigmoid":
            raise ValueError(f"model {model.name!r}: output {i} is a sigmoid (probabilities), and loss "
                             "'bce_with_logits' applies the sigmoid itself, so it would apply it twice (Keras' "
                             "binary_crossentropy on a sigmoid output is its from_logits=False); train the model "
                             "without its final sigmoid, and take the sigmoid of predict's logits")
        if loss != CLASS_LABEL_LOSS:
            continue
        if out.ndim in (2, 3) and out.shape[-1] == 1:
            raise ShapeError(f"model {model.name!r}: output {i} has one unit, and softmax cross-entropy over one class "
                             "is 0 whatever the weights; a binary classifier takes loss='bce_with_logits' with "
                             "float 0/1 targets of shape (N, 1), a regression loss='mse' (or 'l1', 'huber')")
        if out.ndim not in (2, 3):
            # A Dense runs over the last axis of each example (PyTorch's Linear), so one on an
            # image gives a score per row of pixels rather than per image.
            hint = "; for class scores, put a Flatten() (or a global pool) before the last Dense" \
                if out.ndim > 2 else ""
            raise ShapeError(f"model {model.name!r}: output {i} has shape {tuple(out.shape[1:])} per example; the "
                             f"training step's softmax cross-entropy needs class logits (classes,), or (length, "
                             f"classes) for a class per position{hint}; an output of values (an image, a "
                             f"regression) takes a loss against targets of its shape: loss='mse' (or 'l1', "
                             f"'huber', 'bce_with_logits')")
        if isinstance(out, Call) and out.op.name == "softmax":
            raise ValueError(f"model {model.name!r}: output {i} is a softmax (probabilities), and the training step's "
                             "softmax cross-entropy applies softmax itself, so it would apply it twice; train a model "
                             "that outputs logits: leave its final Softmax out (opgrad.onnx.load and opgrad.keras.load "
                             "do unless keep_softmax=True), and take softmax of predict's logits")
    terms = [LOSSES[loss](*per_position(out, y, loss)) for out, y, loss in zip(outputs, labels, losses, strict=True)]
    if len(terms) == 1 and weights[0] == 1.0:
        return terms[0]
    total: Expr | None = None
    for term, w in zip(terms, weights):
        weighted = ops.multiply(term, w)
        total = weighted if total is None else ops.add(total, weighted)
    assert total is not None
    return total


def dataset_loss(model: Model, outputs: Sequence[np.ndarray], labels: Sequence[np.ndarray], losses: Sequence[str],
                 loss_weights: Sequence[float] | None = None) -> float:
    """The training objective of ``model`` on whole-dataset ``outputs`` (as predicted) against
    ``labels`` (one array per output), in float64: each output's loss, the mean over every example
    (and position), summed with ``loss_weights``, by the same expressions the step differentiates."""
    rows = len(outputs[0])
    output_vars = [var(f"output:{i}", (rows, *shape), "float64") for i, shape in enumerate(model.output_shapes)]
    step_labels = StepLabels(model, output_vars, losses, "float64")
    given = [np.asarray(y, np.int64 if loss == CLASS_LABEL_LOSS else np.float64)
             for y, loss in zip(labels, losses, strict=True)]
    objective = model_loss(model, output_vars, step_labels.vars, losses, loss_weights)
    values = evaluate(Function([*output_vars, *step_labels.vars], objective),
                      *(np.asarray(out, np.float64) for out in outputs),
                      *step_labels.arrays(given, rows, f"the loss of model {model.name!r}"))
    return float(np.asarray(values))


def batch_vars(model: Model, batch_size: int, dtype: str) -> tuple[list[Var], dict[str, Var]]:
    """A training batch's variables: the inputs, and a dropout mask per noise layer (keyed by layer
    name), in the order the step functions take them (the labels, after the inputs, come from
    :class:`StepLabels`)."""
    masks = {layer.name: var(f"mask:{layer.name}", (batch_size, *(layer.noise_shape() or ())), dtype)
             for layer in model.noise_layers() if layer.name is not None}
    return model.input_vars(batch_size, dtype), masks


class StepLabels:
    """The labels (or targets) of a training step's outputs: one variable per output in the step
    function, the array each takes from the caller, and the checks and reshaping in between.

    Cross-entropy takes int64 class indices, one per example, or one per position ``(N, length)``
    for a ``(length, classes)`` output (flattened for the step, batch-major, so K steps' rows stay
    K consecutive runs); every other loss takes float targets of the output's shape in the step's
    dtype."""

    def __init__(self, model: Model, outputs: Sequence[Expr], losses: Sequence[str], dtype: str) -> None:
        self.model, self.losses, self.dtype = model, list(losses), dtype
        #: The array each output takes from the caller, batch axis first.
        self.shapes = [tuple(out.shape[:2]) if loss == CLASS_LABEL_LOSS and out.ndim == 3 else
                       (out.shape[0],) if loss == CLASS_LABEL_LOSS else tuple(out.shape)
                       for out, loss in zip(outputs, losses, strict=True)]
        self.classes = [int(out.shape[-1]) for out in outputs]
        single = len(outputs) == 1
        self.vars = [var("labels" if single else f"labels:{i}", (math.prod(shape),), "int64")
                     if loss == CLASS_LABEL_LOSS else var("labels" if single else f"labels:{i}", shape, dtype)
                     for i, (shape, loss) in enumerate(zip(self.shapes, losses, strict=True))]

    def arrays(self, given: Sequence[np.ndarray], rows: int, who: str) -> list[np.ndarray]:
        """``given`` (one array per output, ``rows`` examples) as the step function takes them,
        after :meth:`check`."""
        self.check(given, rows, who)
        return [np.ascontiguousarray(a).reshape(-1) if loss == CLASS_LABEL_LOSS and np.ndim(a) == 2 else a
                for loss, a in zip(self.losses, given, strict=True)]

    def check(self, arrays: Sequence[np.ndarray], rows: int, who: str) -> None:
        """A ValueError naming the output, its loss and what it takes where a label or target array
        is not ``rows`` examples of the right shape and dtype (the function's own check names only
        the argument), where a class label lies outside the output's classes, or where targets of
        ``bce_with_logits`` leave [0, 1]."""
        model, dtype, classes = self.model, self.dtype, self.classes
        for i, (loss, want, array) in enumerate(zip(self.losses, self.shapes, arrays, strict=True)):
            array = np.asarray(array)
            shape = (rows, *want[1:])
            dtype_ = np.dtype("int64" if loss == CLASS_LABEL_LOSS else dtype)
            what = "class labels" if loss == CLASS_LABEL_LOSS else "targets"
            head = (f"{who}: output {i} of model {model.name!r} (loss {loss!r}) takes {what} of shape {shape} and "
                    f"dtype {dtype_}")
            if array.shape != shape:
                given_rows = array.shape == shape[:1]
                hint = ("; (N,) targets become (N, 1) with y[:, None]" if given_rows and shape[1:] == (1,)
                        else "; the output gives classes per position of a sequence: one label per position (for one "
                             "class per example, put a Flatten() or a pooling before the last Dense)"
                        if loss == CLASS_LABEL_LOSS and len(shape) == 2 and given_rows else "")
                raise ValueError(f"{head}, got shape {array.shape}{hint}")
            if array.dtype != dtype_:
                hint = ("; class indices are integers: a regression or a reconstruction takes loss='mse' (or 'l1', "
                        "'huber', 'bce_with_logits')" if loss == CLASS_LABEL_LOSS and array.dtype.kind == "f" else
                        "; targets of a loss other than cross-entropy are floats"
                        if array.dtype.kind in "iub" and loss != CLASS_LABEL_LOSS else "")
                raise ValueError(f"{head}, got dtype {array.dtype}{hint}" +
                                 ("" if hint else f"; convert it with .astype(np.{dtype_})"))
            if loss == CLASS_LABEL_LOSS and array.size and (array.min() < 0 or array.max() >= classes[i]):
                raise ValueError(f"{head}, each in 0..{classes[i] - 1} ({classes[i]} classes); got values in "
                                 f"{array.min()}..{array.max()}")
            if loss == "bce_with_logits" and array.size and not (array.min() >= 0 and array.max() <= 1):
                raise ValueError(f"{head}, in [0, 1] (probabilities); got values in {array.min()}..{array.max()}: "
                                 "scale them (pixels / 255)")


def mask_arrays(names: Sequence[str], masks: Mapping[str, np.ndarray] | None) -> list[np.ndarray]:
    """The dropout masks of the layers ``names``, in order; a ValueError names the layers without one."""
    masks = masks or {}
    absent = [n for n in names if n not in masks]
    if absent:
        raise ValueError(f"no dropout mask given for layer(s) {', '.join(absent)}")
    return [masks[n] for n in names]


def check_batch_inputs(model: Model, arrays: Sequence[np.ndarray], dtypes: Sequence[str], who: str) -> None:
    """A ValueError naming the input where ``arrays`` (one per model input) do not hold the same
    number of examples, or where an integer input (token ids) holds anything but integers: a
    float id would be truncated and a short input padded with zeros, both without a word."""
    counts = [len(a) if a.ndim else 0 for a in arrays]
    if len(set(counts)) > 1:
        sizes = ", ".join(f"{t.name!r} {count}" for t, count in zip(model.inputs, counts, strict=True))
        raise ValueError(f"{who}: the inputs hold different numbers of examples ({sizes})")
    for tensor, array, dtype in zip(model.inputs, arrays, dtypes, strict=True):
        if np.issubdtype(np.dtype(dtype), np.integer) and not (np.issubdtype(array.dtype, np.integer)
                                                                 or array.dtype == np.bool_):
            raise ValueError(f"{who}: input {tensor.name!r} takes integer ids ({dtype}), got an array of "
                             f"{array.dtype}; convert it with .astype(np.{dtype}) if its values are whole")
        if np.issubdtype(np.dtype(dtype), np.floating) and np.issubdtype(array.dtype, np.integer) and not any(
                node.layer.kind == "rescaling" and any(t is tensor for t in node.inputs) for node in model.nodes) \
                and not _feeds_attention_mask(model, tensor):
            # Keras casts such pixels silently and PyTorch refuses them; a model trained on 0..255
            # where it was meant for 0..1 only shows as a large loss.
            warnings.warn(f"{who}: input {tensor.name!r} is {array.dtype}, taken as {dtype} values as they are, "
                          f"unscaled; divide it first (images / 255) if the model expects 0..1, or give the model "
                          f"a Rescaling layer", stacklevel=4)
    check_input_values(model, arrays, who)


def model_input_arrays(model: Model, given: Any, dtype: str, who: str) -> list[np.ndarray]:
    """``given`` as one array per input of ``model``, checked as predict and Trainer check them
    (:func:`check_batch_inputs`, naming the input), token ids of any integer type as int64."""
    arrays = per_input(given, len(model.inputs), "input", who)
    dtypes = [v.dtype for v in model.input_vars(1, dtype)]
    check_batch_inputs(model, [np.asarray(a) for a in arrays], dtypes, who)
    return [np.asarray(a).astype(np.int64, copy=False) if t == "int64" else a for a, t in zip(arrays, dtypes)]


def check_input_values(model: Model, arrays: Sequence[np.ndarray], who: str) -> None:
    """A ValueError naming the input where one holds complex numbers (numpy would drop their
    imaginary parts) or ids past the table of the Embedding it feeds (named here with the layer,
    not later by its gather)."""
    for tensor, array in zip(model.inputs, arrays, strict=True):
        if np.iscomplexobj(array):
            raise ValueError(f"{who}: input {tensor.name!r} holds complex numbers ({np.asarray(array).dtype}); the "
                             "model computes with real ones: pass the real part (.real) or the magnitude (abs) "
                             "explicitly")
        for node in model.nodes:
            size = getattr(node.layer, "input_dim", None)
            if node.layer.kind == "embedding" and size is not None and any(t is tensor for t in node.inputs) \
                    and array.size and (array.min() < 0 or array.max() >= size):
                raise ValueError(f"{who}: input {tensor.name!r} feeds layer {node.layer.describe()}, whose ids lie in "
                                 f"0..{size - 1}; got values in {array.min()}..{array.max()}")
        layer = _feeds_attention_mask(model, tensor)
        if layer is not None and array.size and not np.isin(array, (0, 1)).all():
            raise ValueError(f"{who}: input {tensor.name!r} is the padding mask of layer {layer.describe()}: 1 for a "
                             "token and 0 for padding; got other values (PyTorch's additive 0 / -inf masks and "
                             "True-for-padding key_padding_mask are other conventions: pass (mask == 0) or ~mask)")


def _feeds_attention_mask(model: Model, tensor: Any) -> Any:
    """The MultiHeadAttention layer whose padding mask ``tensor`` (a model input) is, else None."""
    for node in model.nodes:
        if node.layer.kind == "multiheadattention" and getattr(node.layer, "padding_mask", False) \
                and node.inputs[-1] is tensor:
            return node.layer
    return None


def per_input(arrays: Any, count: int, what: str, who: str = "the model") -> list[np.ndarray]:
    """``arrays`` as ``count`` numpy arrays. For one input: one array-like (a numpy array, a torch
    tensor, nested lists of values as Keras takes them) or a list holding one array; for several,
    a list or tuple of ``count`` array-likes. A ValueError starting with ``who`` names the count."""
    if isinstance(arrays, np.ndarray):
        items = [arrays]
    elif count == 1 and not (isinstance(arrays, (list, tuple)) and len(arrays) == 1 and is_array_like(arrays[0])):
        items = [np.asarray(arrays)]
    else:
        items = [np.asarray(a) for a in arrays]
    if len(items) != count:
        raise ValueError(f"{who} takes {count} {what} array(s), got {len(items)}")
    return items


def is_array_like(value: object) -> bool:
    """Whether ``value`` is one array (numpy's, or another library's tensor that converts to one),
    not a nested list of values."""
    return isinstance(value, np.ndarray) or (hasattr(value, "__array__") and not isinstance(value, (list, tuple)))


def per_output(labels: Any, count: int) -> list[np.ndarray]:
    """One label array per output; a single array (or tensor) serves every output."""
    if is_array_like(labels):
        return [np.asarray(labels)] * count
    return per_input(labels, count, "label")


class EvalStep:
    """``outputs = model(inputs)`` (dropout off, running statistics) for a fixed batch; any dataset size.

    A compiled function has fixed shapes, so the last partial batch is padded with zeros and the
    padded rows' outputs are dropped. ``params`` given to :meth:`logits` / :meth:`outputs` holds
    the parameters and the model's buffers.
    """

    def __init__(self, model: Model, *, batch_size: int = 100, dtype: str = "float32",
                 backend: str = "reference") -> None:
        self.model, self.batch_size, self.dtype = model, batch_size, dtype
        inputs = model.input_vars(batch_size, dtype)
        self.input_dtypes: tuple[str, ...] = tuple(v.dtype for v in inputs)
        params = model.param_vars(dtype)
        buffers = model.buffer_vars(dtype)
        self.param_names: tuple[str, ...] = (*params, *buffers)
        outputs, _ = model.call(inputs, {**params, **buffers}, ForwardContext(training=False))
        self.function = Function([*inputs, *params.values(), *buffers.values()], outputs)
        self._run = compile_function(self.function, backend)

    def logits(self, images: np.ndarray | Sequence[np.ndarray], params: Mapping[str, np.ndarray]) -> np.ndarray:
        """The first output (the logits of a classifier) for every example."""
        return self.outputs(images, params)[0]

    def outputs(self, inputs: np.ndarray | Sequence[np.ndarray], params: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Every output for every example, in the model's output order."""
        arrays = per_input(inputs, len(self.input_dtypes), "input", f"model {self.model.name!r}")
        check_batch_inputs(self.model, arrays, self.input_dtypes, f"model {self.model.name!r}")
        absent = [n for n in self.param_names if n not in params]
        if absent:
            raise ValueError(f"no value given for {', '.join(absent)}")
        ordered = [params[n] for n in self.param_names]
        n = len(arrays[0])
        chunks: list[list[np.ndarray]] = []
        for start in range(0, n, self.batch_size):
            batch = []
            for array, dtype in zip(arrays, self.input_dtypes):
                part = np.ascontiguousarray(array[start : start + self.batch_size], dtype=dtype)
                if len(part) < self.batch_size:
                    pad = np.zeros((self.batch_size - len(part), *part.shape[1:]), dtype=dtype)
                    part = np.concatenate([part, pad])
                batch.append(part)
            real = min(self.batch_size, n - start)
            chunks.append([out[:real] for out in self._run(*batch, *ordered)])
        if not chunks:
            return [np.zeros((0, *shape), dtype=self.dtype) for shape in self.model.output_shapes]
        return [np.concatenate([chunk[i] for chunk in chunks]) for i in range(len(self.model.outputs))]
