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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from opgrad.autodiff import gradients
from opgrad.ir import Function, Var, var
from opgrad.nn.layers import ForwardContext, Sequential
from opgrad.nn.losses import softmax_cross_entropy
from opgrad.nn.optim import Optimizer
from opgrad.reference import evaluate

__all__ = [
    "BACKENDS",
    "EvalStep",
    "StepFn",
    "StepResult",
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
        import opgrad

        compiled = opgrad.compile(fn)

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


class TrainStep:
    """Builds the training function for ``model`` + ``optimizer`` once, then runs it per batch."""

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
        self._run = compile_function(self.function, backend)

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
