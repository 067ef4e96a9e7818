"""The training step (forward + backward + optimizer update as ONE function) and the eval step.

Why one function: it is what gets compiled. ``opgrad.compile`` then sees the whole step, can
fuse and schedule across layer boundaries, and Python runs one call per batch (seed 004 compiled
the whole loop for the same reason). The reference backend evaluates the very same function
with numpy, which is what makes backend parity testable step by step.

Signature of the training function (all arrays, fixed shapes)::

    train(images[B,C,H,W], labels[B]:int64, <dropout masks...>, lr[], <params...>, <state...>)
        -> (loss[], <new params...>, <new state...>)

``state`` is the optimizer's state followed by the model's buffers (``BatchNorm2D``'s running
statistics), so buffers are updated inside the compiled step like the optimizer's moments. A
model with several inputs takes one array per input in place of ``images``; one with several
outputs takes one label array per output (softmax cross-entropy each, summed with
``loss_weights``).

The backend is a name: ``"reference"`` (``opgrad.evaluate``) or ``"llvm"``
(``opgrad.compile(fn)``); switching is that one argument.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from opgrad import ops
from opgrad.autodiff import gradients
from opgrad.errors import ShapeError
from opgrad.ir import Expr, Function, Var, var
from opgrad.nn.layers import ForwardContext
from opgrad.nn.losses import softmax_cross_entropy
from opgrad.nn.model import Model
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

    def __init__(self, model: Model, optimizer: Optimizer, *, batch_size: int, dtype: str = "float32",
                 backend: str = "reference", loss_weights: Sequence[float] | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model, self.optimizer = model, optimizer
        self.batch_size, self.dtype, self.backend = batch_size, dtype, backend
        inputs = model.input_vars(batch_size, dtype)
        single = len(model.outputs) == 1
        labels = [var("labels" if single else f"labels:{i}", (batch_size,), "int64") for i in range(len(model.outputs))]
        masks: dict[str, Var] = {
            layer.name: var(f"mask:{layer.name}", (batch_size, *(layer.noise_shape() or ())), dtype)
            for layer in model.noise_layers() if layer.name is not None
        }
        lr = var("lr", (), dtype)
        params = model.param_vars(dtype)
        opt_state = {name: var(name, shape, dtype)
                     for name, shape in optimizer.state_shapes(model.param_shapes()).items()}
        buffers = model.buffer_vars(dtype)
        outputs, new_buffers = model.call(inputs, {**params, **buffers},
                                          ForwardContext(training=True, noise=masks))
        loss = _classifier_loss(model, outputs, labels, loss_weights)
        grads = dict(zip(params, gradients(loss, list(params.values()))))
        new_params, new_state = optimizer.update(params, grads, opt_state, lr)
        missing = sorted(set(opt_state) - set(new_state))
        if missing:
            raise RuntimeError(f"{optimizer.describe()} produced no update for state {missing}")
        new_state.update(new_buffers)
        state = {**opt_state, **buffers}
        self.param_names: tuple[str, ...] = tuple(params)
        self.state_names: tuple[str, ...] = tuple(state)
        self.mask_names: tuple[str, ...] = tuple(masks)
        self.function = Function(
            [*inputs, *labels, *masks.values(), lr, *params.values(), *state.values()],
            [loss, *(new_params[n] for n in self.param_names), *(new_state[n] for n in self.state_names)],
        )
        self._run = compile_function(self.function, backend)

    def __call__(self, images: np.ndarray | Sequence[np.ndarray], labels: np.ndarray | Sequence[np.ndarray],
                 params: Mapping[str, np.ndarray], state: Mapping[str, np.ndarray], lr: float,
                 masks: Mapping[str, np.ndarray] | None = None) -> StepResult:
        masks = masks or {}
        absent = [n for n in self.mask_names if n not in masks]
        if absent:
            raise ValueError(f"no dropout mask given for layer(s) {', '.join(absent)}")
        outputs = self._run(
            *_per_input(images, len(self.model.inputs), "input"),
            *_per_output(labels, len(self.model.outputs)),
            *(masks[n] for n in self.mask_names), np.asarray(lr, dtype=self.dtype),
            *(params[n] for n in self.param_names), *(state[n] for n in self.state_names),
        )
        k = len(self.param_names)
        return StepResult(
            loss=float(outputs[0]),
            params=dict(zip(self.param_names, outputs[1 : 1 + k])),
            state=dict(zip(self.state_names, outputs[1 + k :])),
        )


def _classifier_loss(model: Model, outputs: Sequence[Expr], labels: Sequence[Var],
                     loss_weights: Sequence[float] | None) -> Expr:
    """Softmax cross-entropy of each output against its labels, weighted and summed."""
    weights = [1.0] * len(outputs) if loss_weights is None else [float(w) for w in loss_weights]
    if len(weights) != len(outputs):
        raise ValueError(f"loss_weights has {len(weights)} entries but model {model.name!r} has {len(outputs)} outputs")
    for i, out in enumerate(outputs):
        if out.ndim != 2:
            raise ShapeError(f"model {model.name!r}: output {i} has shape {tuple(out.shape[1:])} per example; the "
                             "training step's softmax cross-entropy needs class logits (classes,)")
    if len(outputs) == 1 and weights[0] == 1.0:
        return softmax_cross_entropy(outputs[0], labels[0])
    total: Expr | None = None
    for out, y, w in zip(outputs, labels, weights):
        term = ops.multiply(softmax_cross_entropy(out, y), w)
        total = term if total is None else ops.add(total, term)
    assert total is not None
    return total


def _per_input(arrays: np.ndarray | Sequence[np.ndarray], count: int, what: str) -> list[np.ndarray]:
    items = [arrays] if isinstance(arrays, np.ndarray) else list(arrays)
    if len(items) != count:
        raise ValueError(f"the model takes {count} {what} array(s), got {len(items)}")
    return items


def _per_output(labels: np.ndarray | Sequence[np.ndarray], count: int) -> list[np.ndarray]:
    """One label array per output; a single array serves every output."""
    if isinstance(labels, np.ndarray):
        return [labels] * count
    return _per_input(labels, count, "label")


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
        arrays = _per_input(inputs, len(self.input_dtypes), "input")
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
