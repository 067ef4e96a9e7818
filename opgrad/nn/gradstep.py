"""The training step in two halves: gradients, then the optimizer update.

:class:`~opgrad.nn.step.TrainStep` compiles forward + backward + update as ONE function, which
is the fastest form on one process. Data-parallel training needs a seam between backward and
update, where the gradients of every rank are averaged: :class:`GradientStep` ends at the
gradients and :class:`UpdateStep` starts from them. Both are compiled the same way as the whole
step, from the same layers, loss and optimizer, so the two halves compute the numbers the single
function does (up to the rounding of the averaged sum).

Signatures (all arrays, fixed shapes)::

    gradients(images[B,...], labels[B] (or targets[B,...]), <dropout masks...>, <params...>, <buffers...>)
        -> (loss[], <grads...>, <new buffers...>)
    update(lr[], <params...>, <grads...>, <optimizer state...>)
        -> (<new params...>, <new optimizer state...>)

Gradient clipping and weight decay belong to the optimizer (``Optimizer.update``), so they act
on the averaged gradient, as in a single process with the whole batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from opgrad import ops
from opgrad.autodiff import gradients
from opgrad.ir import Function, var
from opgrad.nn.layers import ForwardContext
from opgrad.nn.losses import CLASS_LABEL_LOSS
from opgrad.nn.model import Model
from opgrad.nn.optim import Optimizer
from opgrad.nn.step import (
    StepLabels,
    batch_vars,
    compile_function,
    mask_arrays,
    model_input_arrays,
    model_loss,
    per_output,
    resolve_losses,
    trainable_names,
)

__all__ = ["GradientResult", "GradientStep", "UpdateStep"]


@dataclass(frozen=True)
class GradientResult:
    """One batch's mean loss, the gradients of the trainable parameters and the model's new buffers."""

    loss: float
    grads: dict[str, np.ndarray]
    buffers: dict[str, np.ndarray]


class GradientStep:
    """Forward + backward for ``model`` on a fixed batch: the loss, the gradient of every trainable
    parameter, new buffers.

    ``sync_batchnorm`` builds BatchNorm with the statistics of every replica's batch (run the step
    inside :func:`opgrad.replicas.replica_group`). ``loss_scale`` multiplies the loss before it is
    differentiated, so the loss and the gradients come out scaled: a replica's share of the
    global mean (see :class:`~opgrad.distributed.DistributedTrainer`).
    """

    def __init__(self, model: Model, *, batch_size: int, dtype: str = "float32", backend: str = "reference",
                 loss: str | Sequence[str] = CLASS_LABEL_LOSS, loss_weights: Sequence[float] | None = None,
                 sync_batchnorm: bool = False, loss_scale: float = 1.0) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model, self.batch_size, self.dtype, self.backend = model, batch_size, dtype, backend
        self.sync_batchnorm, self.loss_scale = sync_batchnorm, float(loss_scale)
        self.losses = resolve_losses(model, loss, "GradientStep")
        inputs, masks = batch_vars(model, batch_size, dtype)
        params = model.param_vars(dtype)
        buffers = model.buffer_vars(dtype)
        outputs, new_buffers = model.call(inputs, {**params, **buffers},
                                          ForwardContext(training=True, noise=masks, sync_batchnorm=sync_batchnorm))
        self.labels = StepLabels(model, outputs, self.losses, dtype)
        objective = model_loss(model, outputs, self.labels.vars, self.losses, loss_weights)
        if self.loss_scale != 1.0:
            objective = ops.multiply(objective, self.loss_scale)
        #: The parameters with a gradient: the trainable ones (a frozen layer's take none).
        self.grad_names: tuple[str, ...] = tuple(trainable_names(model, "GradientStep"))
        grads = gradients(objective, [params[name] for name in self.grad_names])
        self.param_names: tuple[str, ...] = tuple(params)
        self.buffer_names: tuple[str, ...] = tuple(buffers)
        self.mask_names: tuple[str, ...] = tuple(masks)
        self.function = Function(
            [*inputs, *self.labels.vars, *masks.values(), *params.values(), *buffers.values()],
            [objective, *grads, *(new_buffers[n] for n in self.buffer_names)],
        )
        self._run = compile_function(self.function, backend)

    def __call__(self, images: np.ndarray | Sequence[np.ndarray], labels: np.ndarray | Sequence[np.ndarray],
                 params: Mapping[str, np.ndarray], buffers: Mapping[str, np.ndarray],
                 masks: Mapping[str, np.ndarray] | None = None) -> GradientResult:
        inputs = model_input_arrays(self.model, images, self.dtype, f"GradientStep of model {self.model.name!r}")
        outputs = self._run(
            *inputs,
            *self.labels.arrays(per_output(labels, len(self.model.outputs)), self.batch_size, "GradientStep"),
            *mask_arrays(self.mask_names, masks),
            *(params[n] for n in self.param_names), *(buffers[n] for n in self.buffer_names),
        )
        k = len(self.grad_names)
        return GradientResult(float(outputs[0]), dict(zip(self.grad_names, outputs[1 : 1 + k])),
                              dict(zip(self.buffer_names, outputs[1 + k :])))


class UpdateStep:
    """``optimizer``'s update of ``model``'s trainable parameters from given gradients, compiled
    once; the new parameters it returns are the trainable ones (a frozen layer's stay as they are)."""

    def __init__(self, model: Model, optimizer: Optimizer, *, dtype: str = "float32",
                 backend: str = "reference") -> None:
        self.model, self.optimizer, self.dtype, self.backend = model, optimizer, dtype, backend
        lr = var("lr", (), dtype)
        every = model.param_vars(dtype)
        params = {name: every[name] for name in trainable_names(model, "UpdateStep")}
        grads = {name: var(f"grad:{name}", p.shape, dtype) for name, p in params.items()}
        state = {name: var(name, shape, dtype)
                 for name, shape in optimizer.state_shapes(model.trainable_param_shapes()).items()}
        new_params, new_state = optimizer.update(params, grads, state, lr)
        missing = sorted(set(state) - set(new_state))
        if missing:
            raise RuntimeError(f"{optimizer.describe()} produced no update for state {missing}")
        self.param_names: tuple[str, ...] = tuple(params)
        self.state_names: tuple[str, ...] = tuple(state)
        self.function = Function(
            [lr, *params.values(), *grads.values(), *state.values()],
            [*(new_params[n] for n in self.param_names), *(new_state[n] for n in self.state_names)],
        )
        self._run = compile_function(self.function, backend)

    def __call__(self, params: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray],
                 state: Mapping[str, np.ndarray], lr: float) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """``(new params, new optimizer state)``; ``state`` may hold more entries (buffers)."""
        outputs = self._run(np.asarray(lr, dtype=self.dtype), *(params[n] for n in self.param_names),
                            *(grads[n] for n in self.param_names), *(state[n] for n in self.state_names))
        k = len(self.param_names)
        return dict(zip(self.param_names, outputs[:k])), dict(zip(self.state_names, outputs[k:]))
