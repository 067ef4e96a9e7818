"""The training step (forward + backward + optimizer update as ONE function) and the eval step.

Why one function: it is what gets compiled. ``opgrad.compile`` then sees the whole step, can
fuse and schedule across layer boundaries, and Python runs one call per batch (seed 004 compiled
the whole loop for the same reason). The reference backend evaluates the very same function
with numpy, which is what makes backend parity testable step by step.

Signature of the training function (all arrays, fixed shapes)::

    train(images[B,C,H,W], labels[B]:int64, <dropout masks...>, lr[], <params...>, <state...>)
        -> (loss[], <new params...>, <new state...>)

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

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from opgrad.autodiff import gradients
from opgrad.errors import OpgradError
from opgrad.ir import Function, Var, var
from opgrad.nn.layers import ForwardContext, Sequential
from opgrad.nn.losses import softmax_cross_entropy
from opgrad.nn.optim import Optimizer
from opgrad.reference import evaluate

__all__ = [
    "BACKENDS",
    "EvalStep",
    "NanLossError",
    "StepFn",
    "StepResult",
    "StepsResult",
    "TrainStep",
    "compile_function",
    "llvm_unavailable_reason",
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
    """A step's loss was NaN and ``run_steps(..., stop_on_nan=True)`` was asked to stop there.

    ``step`` is that step (0-based within the call); ``losses`` ends with its NaN; ``params`` and
    ``state`` are the values *before* it, i.e. after ``step`` good steps.
    """

    def __init__(self, message: str, step: int, losses: np.ndarray, params: dict[str, np.ndarray],
                 state: dict[str, np.ndarray]) -> None:
        super().__init__(message)
        self.step, self.losses, self.params, self.state = step, losses, params, state


class TrainStep:
    """Builds the training function for ``model`` + ``optimizer`` once, then runs it per batch
    (``__call__``) or K batches per call (:meth:`run_steps`)."""

    def __init__(self, model: Sequential, optimizer: Optimizer, *, batch_size: int, dtype: str = "float32",
                 backend: str = "reference") -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model, self.optimizer = model, optimizer
        self.batch_size, self.dtype, self.backend = batch_size, dtype, backend
        images = var("images", (batch_size, *model.input_shape), dtype)
        labels = var("labels", (batch_size,), "int64")
        masks: dict[str, Var] = {
            layer.name: var(f"mask:{layer.name}", (batch_size, *(layer.noise_shape() or ())), dtype)
            for layer in model.noise_layers() if layer.name is not None
        }
        lr = var("lr", (), dtype)
        params = model.param_vars(dtype)
        state = {name: var(name, shape, dtype)
                 for name, shape in optimizer.state_shapes(model.param_shapes()).items()}
        logits = model.forward(images, params, ForwardContext(training=True, noise=masks))
        loss = softmax_cross_entropy(logits, labels)
        grads = dict(zip(params, gradients(loss, list(params.values()))))
        new_params, new_state = optimizer.update(params, grads, state, lr)
        missing = sorted(set(state) - set(new_state))
        if missing:
            raise RuntimeError(f"{optimizer.describe()} produced no update for state {missing}")
        self.param_names: tuple[str, ...] = tuple(params)
        self.state_names: tuple[str, ...] = tuple(state)
        self.mask_names: tuple[str, ...] = tuple(masks)
        self.function = Function(
            [images, labels, *masks.values(), lr, *params.values(), *state.values()],
            [loss, *(new_params[n] for n in self.param_names), *(new_state[n] for n in self.state_names)],
        )
        self.compiled: Any = None  # the CompiledFunction (llvm backend), with its multi-step loop
        if backend == "llvm":
            from opgrad.compiler import compile as compile_fn  # here: the compiler pulls in llvmlite

            self.compiled = compile_fn(self.function, loop=self.step_loop())
            compiled = self.compiled

            def run_compiled(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
                return tuple(compiled(*arrays))

            self._run = run_compiled
        else:
            self._run = compile_function(self.function, backend)

    def step_loop(self) -> Any:
        """The :class:`~opgrad.compiler.steploop.StepLoop` of this step: images, labels, masks and
        lr streamed, the loss outfed (and checked for NaN), params and state carried."""
        from opgrad.compiler.steploop import StepLoop

        nm, k = len(self.mask_names), len(self.param_names) + len(self.state_names)
        first = 3 + nm  # images, labels, masks..., lr, then params and state
        return StepLoop(streams=tuple(range(first)), outfeeds=(0,),
                        carry=tuple((first + j, 1 + j) for j in range(k)), nan_check=0)

    def __call__(self, images: np.ndarray, labels: np.ndarray, params: Mapping[str, np.ndarray],
                 state: Mapping[str, np.ndarray], lr: float,
                 masks: Mapping[str, np.ndarray] | None = None) -> StepResult:
        masks = masks or {}
        absent = [n for n in self.mask_names if n not in masks]
        if absent:
            raise ValueError(f"no dropout mask given for layer(s) {', '.join(absent)}")
        outputs = self._run(
            images, labels, *(masks[n] for n in self.mask_names), np.asarray(lr, dtype=self.dtype),
            *(params[n] for n in self.param_names), *(state[n] for n in self.state_names),
        )
        k = len(self.param_names)
        return StepResult(
            loss=float(outputs[0]),
            params=dict(zip(self.param_names, outputs[1 : 1 + k])),
            state=dict(zip(self.state_names, outputs[1 + k :])),
        )


    def run_steps(self, images: np.ndarray, labels: np.ndarray, params: Mapping[str, np.ndarray],
                  state: Mapping[str, np.ndarray], lr: float | np.ndarray,
                  masks: Mapping[str, np.ndarray] | None = None, *, stop_on_nan: bool = False) -> StepsResult:
        """``K = len(labels) // batch_size`` training steps in one call; same numbers as K calls.

        ``images`` is ``(K * batch_size, *input_shape)`` and ``labels`` ``(K * batch_size,)``,
        batch-major (step ``i`` trains on rows ``i*B .. i*B+B-1``); ``masks`` holds each dropout
        layer's masks the same way; ``lr`` is one float for every step or an array of K. With
        ``stop_on_nan`` a NaN loss raises :class:`NanLossError` carrying the state before it.
        """
        b = self.batch_size
        if len(labels) % b:
            raise ValueError(f"run_steps: labels has {len(labels)} rows, not a multiple of the batch size {b}")
        steps = len(labels) // b
        lrs = np.asarray(lr, dtype=self.dtype)
        lrs = np.full(steps, lrs, self.dtype) if lrs.ndim == 0 else lrs
        if lrs.shape != (steps,):
            raise ValueError(f"run_steps: lr must be a float or an array of {steps} (one per step), "
                             f"got shape {lrs.shape}")
        masks = masks or {}
        absent = [n for n in self.mask_names if n not in masks]
        if absent:
            raise ValueError(f"no dropout mask given for layer(s) {', '.join(absent)}")
        if self.compiled is None:
            return self._run_steps_in_python(images, labels, params, state, lrs, masks, stop_on_nan)
        from opgrad.compiler.steploop import LoopStopped

        k = len(self.param_names)
        try:
            out = self.compiled.run_steps(
                steps, images, labels, *(masks[n] for n in self.mask_names), lrs,
                *(params[n] for n in self.param_names), *(state[n] for n in self.state_names),
                stop_on_nan=stop_on_nan)
        except LoopStopped as stop:
            o = stop.outputs
            raise NanLossError(f"run_steps: the loss is NaN at step {stop.step}; stopped there (stop_on_nan)",
                               stop.step, np.asarray(o[0]), dict(zip(self.param_names, o[1 : 1 + k])),
                               dict(zip(self.state_names, o[1 + k :]))) from None
        return StepsResult(np.asarray(out[0]), dict(zip(self.param_names, out[1 : 1 + k])),
                           dict(zip(self.state_names, out[1 + k :])))

    def _run_steps_in_python(self, images: np.ndarray, labels: np.ndarray, params: Mapping[str, np.ndarray],
                             state: Mapping[str, np.ndarray], lrs: np.ndarray, masks: Mapping[str, np.ndarray],
                             stop_on_nan: bool) -> StepsResult:
        """The reference backend's run_steps: the same contract, one call per step."""
        b = self.batch_size
        cur_params, cur_state = dict(params), dict(state)
        losses = np.empty(len(lrs), self.dtype)
        for i in range(len(lrs)):
            rows = slice(i * b, (i + 1) * b)
            result = self(images[rows], labels[rows], cur_params, cur_state, lrs[i],
                          {n: m[rows] for n, m in masks.items()})
            losses[i] = result.loss
            if stop_on_nan and np.isnan(losses[i]):
                raise NanLossError(f"run_steps: the loss is NaN at step {i}; stopped there (stop_on_nan)",
                                   i, losses[: i + 1], cur_params, cur_state)
            cur_params, cur_state = result.params, result.state
        return StepsResult(losses, cur_params, cur_state)


class EvalStep:
    """``logits = model(images)`` (dropout off) for a fixed batch; any dataset size via padding.

    A compiled function has fixed shapes, so the last partial batch is padded with zeros and the
    padded rows' logits are dropped.
    """

    def __init__(self, model: Sequential, *, batch_size: int = 100, dtype: str = "float32",
                 backend: str = "reference") -> None:
        self.model, self.batch_size, self.dtype = model, batch_size, dtype
        images = var("images", (batch_size, *model.input_shape), dtype)
        params = model.param_vars(dtype)
        self.param_names: tuple[str, ...] = tuple(params)
        logits = model.forward(images, params, ForwardContext(training=False))
        self.function = Function([images, *params.values()], [logits])
        self._run = compile_function(self.function, backend)

    def logits(self, images: np.ndarray, params: Mapping[str, np.ndarray]) -> np.ndarray:
        ordered = [params[n] for n in self.param_names]
        chunks = []
        for start in range(0, len(images), self.batch_size):
            batch = images[start : start + self.batch_size]
            real = len(batch)
            if real < self.batch_size:
                pad = np.zeros((self.batch_size - real, *batch.shape[1:]), dtype=batch.dtype)
                batch = np.concatenate([batch, pad])
            chunks.append(self._run(np.ascontiguousarray(batch, dtype=self.dtype), *ordered)[0][:real])
        if not chunks:
            return np.zeros((0, *self.model.output_shape), dtype=self.dtype)
        return np.concatenate(chunks)
