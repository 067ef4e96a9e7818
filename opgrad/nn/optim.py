"""Optimizers whose update is a graph of registered ops, so it fuses into the training step.

Why in the graph: the training step is ONE function, forward + backward + update, returning
``(loss, new params..., new state...)``; compiled, a step is one call with no per-parameter
Python loop, and the update is checked by the same machinery as every other op. The learning
rate is an *input* scalar rather than a constant, so schedules and ``--lr`` never force a
recompile.

State naming: per-parameter slots are ``"<param>/<slot>"`` (``"conv1.weight/m"``); scalar
state shared by all parameters is ``"<optimizer>/<name>"`` (``"adam/beta1_power"``). Parameter
names contain no ``/``, so the two never collide and a checkpoint can hold both.

Conventions follow PyTorch (the comparison runs in the issue used it):

* SGD: ``p -= lr * g``
* momentum: ``v = mu * v + g; p -= lr * v``; Nesterov: ``p -= lr * (g + mu * v)`` with the new v
* Adam: ``m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
  p -= lr * (m / (1 - b1^t)) / (sqrt(v) / sqrt(1 - b2^t) + eps)``. ``b1^t`` and ``b2^t`` are
  carried as state and multiplied each step, because there is no power op and because it keeps
  the step self-contained: resuming from a checkpoint continues the exact sequence.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from opgrad import ops
from opgrad.ir import Expr

__all__ = ["SGD", "Adam", "Optimizer", "make_optimizer"]

Shape = tuple[int, ...]


class Optimizer:
    """Base class: declares its state and builds the update expressions."""

    name = "optimizer"
    #: Per-parameter state slots, each shaped like its parameter and initialized to zeros.
    slots: tuple[str, ...] = ()

    def scalar_state(self) -> dict[str, float]:
        """Shared scalar state (local name -> initial value)."""
        return {}

    def state_shapes(self, param_shapes: Mapping[str, Shape]) -> dict[str, Shape]:
        """Every state entry's full name and shape, in a fixed order (slots, then scalars)."""
        shapes = {f"{p}/{slot}": shape for p, shape in param_shapes.items() for slot in self.slots}
        shapes.update({f"{self.name}/{key}": () for key in self.scalar_state()})
        return shapes

    def init_state(self, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        state = {f"{p}/{slot}": np.zeros_like(value) for p, value in params.items() for slot in self.slots}
        dtype = next(iter(params.values())).dtype if params else np.dtype("float32")
        state.update({f"{self.name}/{k}": np.array(v, dtype=dtype) for k, v in self.scalar_state().items()})
        return state

    def update(self, params: Mapping[str, Expr], grads: Mapping[str, Expr], state: Mapping[str, Expr],
               lr: Expr) -> tuple[dict[str, Expr], dict[str, Expr]]:
        """``(new_params, new_state)`` expressions, keyed like ``params`` and ``state``."""
        raise NotImplementedError

    def describe(self) -> str:
        return self.name


class SGD(Optimizer):
    """Stochastic gradient descent, optionally with (Nesterov) momentum (PyTorch convention)."""

    def __init__(self, momentum: float = 0.0, *, nesterov: bool = False) -> None:
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if nesterov and momentum == 0.0:
            raise ValueError("Nesterov momentum needs momentum > 0")
        self.momentum = float(momentum)
        self.nesterov = nesterov
        self.name = "sgd"
        self.slots = ("velocity",) if momentum > 0.0 else ()

    def describe(self) -> str:
        if not self.momentum:
            return "sgd"
        return f"sgd(momentum={self.momentum:g}{', nesterov' if self.nesterov else ''})"

    def update(self, params: Mapping[str, Expr], grads: Mapping[str, Expr], state: Mapping[str, Expr],
               lr: Expr) -> tuple[dict[str, Expr], dict[str, Expr]]:
        new_params: dict[str, Expr] = {}
        new_state: dict[str, Expr] = {}
        for name, p in params.items():
            g = grads[name]
            if not self.momentum:
                new_params[name] = ops.subtract(p, ops.multiply(lr, g))
                continue
            v = ops.add(ops.multiply(state[f"{name}/velocity"], self.momentum), g)
            direction = ops.add(g, ops.multiply(v, self.momentum)) if self.nesterov else v
            new_params[name] = ops.subtract(p, ops.multiply(lr, direction))
            new_state[f"{name}/velocity"] = v
        return new_params, new_state


class Adam(Optimizer):
    """Adam (Kingma & Ba) with PyTorch's placement of ``eps`` (after bias-correcting sqrt(v))."""

    slots = ("m", "v")

    def __init__(self, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8) -> None:
        for label, beta in (("beta1", beta1), ("beta2", beta2)):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"{label} must be in [0, 1), got {beta}")
        if eps <= 0.0:
            raise ValueError(f"eps must be > 0, got {eps}")
        self.beta1, self.beta2, self.eps = float(beta1), float(beta2), float(eps)
        self.name = "adam"

    def describe(self) -> str:
        return f"adam(beta1={self.beta1:g}, beta2={self.beta2:g}, eps={self.eps:g})"

    def scalar_state(self) -> dict[str, float]:
        return {"beta1_power": 1.0, "beta2_power": 1.0}

    def update(self, params: Mapping[str, Expr], grads: Mapping[str, Expr], state: Mapping[str, Expr],
               lr: Expr) -> tuple[dict[str, Expr], dict[str, Expr]]:
        b1, b2 = self.beta1, self.beta2
        b1_power = ops.multiply(state["adam/beta1_power"], b1)
        b2_power = ops.multiply(state["adam/beta2_power"], b2)
        # Scalars, computed once per step and broadcast: lr / (1 - b1^t) and 1 / sqrt(1 - b2^t).
        step_size = ops.divide(lr, ops.subtract(1.0, b1_power))
        inv_v_correction = ops.divide(1.0, ops.sqrt(ops.subtract(1.0, b2_power)))
        new_params: dict[str, Expr] = {}
        new_state: dict[str, Expr] = {"adam/beta1_power": b1_power, "adam/beta2_power": b2_power}
        for name, p in params.items():
            g = grads[name]
            m = ops.add(ops.multiply(state[f"{name}/m"], b1), ops.multiply(g, 1.0 - b1))
            v = ops.add(ops.multiply(state[f"{name}/v"], b2), ops.multiply(ops.multiply(g, g), 1.0 - b2))
            denom = ops.add(ops.multiply(ops.sqrt(v), inv_v_correction), self.eps)
            new_params[name] = ops.subtract(p, ops.multiply(step_size, ops.divide(m, denom)))
            new_state[f"{name}/m"] = m
            new_state[f"{name}/v"] = v
        return new_params, new_state


def make_optimizer(name: str) -> Optimizer:
    """The CLI's choices: ``sgd``, ``momentum`` (0.9), ``nesterov`` (0.9) and ``adam``."""
    if name == "sgd":
        return SGD()
    if name == "momentum":
        return SGD(momentum=0.9)
    if name == "nesterov":
        return SGD(momentum=0.9, nesterov=True)
    if name == "adam":
        return Adam()
    raise ValueError(f"unknown optimizer {name!r}; choose sgd, momentum, nesterov or adam")
