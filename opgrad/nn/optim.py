"""Optimizers whose update is a graph of registered ops, so it fuses into the training step.

Why in the graph: the training step is ONE function, forward + backward + update, returning
``(loss, new params..., new state...)``; compiled, a step is one call with no per-parameter
Python loop, and the update is checked by the same machinery as every other op. The learning
rate is an *input* scalar rather than a constant, so schedules and ``--lr`` never force a
recompile.

State naming: per-parameter slots are ``"<param>/<slot>"`` (``"conv1.weight/m"``); scalar
state shared by all parameters is ``"<optimizer>/<name>"`` (``"adam/beta1_power"``). Parameter
names contain no ``/``, so the two never collide and a checkpoint can hold both.

Conventions follow ``torch.optim`` (tests compare 20-step trajectories with it):

* SGD: ``p -= lr * g``
* momentum: ``v = mu * v + g; p -= lr * v``; Nesterov: ``p -= lr * (g + mu * v)`` with the new v
* Adam: ``m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
  p -= lr * (m / (1 - b1^t)) / (sqrt(v) / sqrt(1 - b2^t) + eps)``. ``b1^t`` and ``b2^t`` are
  carried as state and multiplied each step, because it keeps the step self-contained:
  resuming from a checkpoint continues the exact sequence.
* AdamW: ``p *= 1 - lr * weight_decay`` (decoupled), then Adam's update.
* RMSprop: ``v = a v + (1-a) g^2``; centered: ``avg = sqrt(v - gbar^2) + eps`` with
  ``gbar = a gbar + (1-a) g``, else ``sqrt(v) + eps``; ``p -= lr * g / avg``, or with momentum
  ``b = mu b + g / avg; p -= lr * b``.

Every optimizer takes ``weight_decay`` (coupled L2: ``g += weight_decay * p``, as torch's SGD,
Adam and RMSprop; AdamW decouples it), and Keras-style ``clip_value`` (each gradient element
clamped to ``[-clip_value, clip_value]``) and ``clip_norm`` (all gradients scaled by
``min(1, clip_norm / (global_norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_``), applied in
that order before the update.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from opgrad import ops
from opgrad.ir import Expr

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "RMSprop", "make_optimizer"]

Shape = tuple[int, ...]


def _non_negative(label: str, value: float | None, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    number = float(value)  # type: ignore[arg-type]
    if not math.isfinite(number) or number < 0.0 or (allow_none and number == 0.0):
        expected = "a finite number > 0, or None" if allow_none else "a finite number >= 0"
        raise ValueError(f"{label} must be {expected}, got {value!r}")
    return number


class Optimizer:
    """Base class: declares its state and builds the update expressions.

    Subclasses implement :meth:`apply` on prepared gradients; :meth:`update` first clips the
    gradients and adds the coupled weight decay (see the module docstring).
    """

    name = "optimizer"
    #: Per-parameter state slots, each shaped like its parameter and initialized to zeros.
    slots: tuple[str, ...] = ()
    #: AdamW applies its weight decay to the parameters, not to the gradients.
    decoupled_weight_decay = False

    def __init__(self, *, weight_decay: float = 0.0, clip_norm: float | None = None,
                 clip_value: float | None = None) -> None:
        self.weight_decay = _non_negative("weight_decay", weight_decay) or 0.0
        self.clip_norm = _non_negative("clip_norm", clip_norm, allow_none=True)
        self.clip_value = _non_negative("clip_value", clip_value, allow_none=True)

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
        return self.apply(params, self.prepare_gradients(params, grads), state, lr)

    def prepare_gradients(self, params: Mapping[str, Expr], grads: Mapping[str, Expr]) -> dict[str, Expr]:
        """Gradients clipped by value, then by global norm, plus the coupled weight decay."""
        out = dict(grads)
        if self.clip_value is not None:
            c = self.clip_value
            out = {n: ops.where(ops.greater(g, c), ops.multiply(ops.ones_like(g), c),
                                ops.where(ops.greater(-c, g), ops.multiply(ops.ones_like(g), -c), g))
                   for n, g in out.items()}
        if self.clip_norm is not None and out:
            squares = [ops.sum(ops.multiply(g, g)) for g in out.values()]
            total = squares[0]
            for extra in squares[1:]:
                total = ops.add(total, extra)
            coef = ops.divide(self.clip_norm, ops.add(ops.sqrt(total), 1e-6))
            coef = ops.where(ops.greater(coef, 1.0), ops.ones_like(coef), coef)
            out = {n: ops.multiply(g, coef) for n, g in out.items()}
        if self.weight_decay and not self.decoupled_weight_decay:
            out = {n: ops.add(g, ops.multiply(params[n], self.weight_decay)) for n, g in out.items()}
        return out

    def apply(self, params: Mapping[str, Expr], grads: Mapping[str, Expr], state: Mapping[str, Expr],
              lr: Expr) -> tuple[dict[str, Expr], dict[str, Expr]]:
        """The update itself, on gradients :meth:`prepare_gradients` produced."""
        raise NotImplementedError

    def options(self) -> str:
        """The base options that differ from their defaults, as ``", name=value"`` text."""
        parts = [f"weight_decay={self.weight_decay:g}"] if self.weight_decay else []
        parts += [f"clip_norm={self.clip_norm:g}"] if self.clip_norm is not None else []
        parts += [f"clip_value={self.clip_value:g}"] if self.clip_value is not None else []
        return "".join(f", {p}" for p in parts)

    def describe(self) -> str:
        return self.name


class SGD(Optimizer):
    """Stochastic gradient descent, optionally with (Nesterov) momentum (PyTorch convention)."""

    def __init__(self, momentum: float = 0.0, *, nesterov: bool = False, weight_decay: float = 0.0,
                 clip_norm: float | None = None, clip_value: float | None = None) -> None:
        super().__init__(weight_decay=weight_decay, clip_norm=clip_norm, clip_value=clip_value)
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
            return f"sgd({self.options()[2:]})" if self.options() else "sgd"
        return f"sgd(momentum={self.momentum:g}{', nesterov' if self.nesterov else ''}{self.options()})"

    def apply(self, params: Mapping[str, Expr], grads: Mapping[str, Expr], state: Mapping[str, Expr],
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

    def __init__(self, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8, *, weight_decay: float = 0.0,
                 clip_norm: float | None = None, clip_value: float | None = None) -> None:
        super().__init__(weight_decay=weight_decay, clip_norm=clip_norm, clip_value=clip_value)
        for label, beta in (("beta1", beta1), ("beta2", beta2)):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"{label} must be in [0, 1), got {beta}")
        if eps <= 0.0:
            raise ValueError(f"eps must be > 0, got {eps}")
        self.beta1, self.beta2, self.eps = float(beta1), float(beta2), float(eps)
        self.name = "adam"

    def describe(self) -> str:
        return f"{self.name}(beta1={self.beta1:g}, beta2={self.beta2:g}, eps={self.eps:g}{self.options()})"

    def scalar_state(self) -> dict[str, float]:
        return {"beta1_power": 1.0, "beta2_power": 1.0}

    def apply(self, params: Mapping[str, Expr], grads: Mapping[str, Expr], state: Mapping[str, Expr],
               lr: Expr) -> tuple[dict[str, Expr], dict[str, Expr]]:
        b1, b2 = self.beta1, self.beta2
        b1_power = ops.multiply(state[f"{self.name}/beta1_power"], b1)
        b2_power = ops.multiply(state[f"{self.name}/beta2_power"], b2)
        # Scalars, computed once per step and broadcast: lr / (1 - b1^t) and 1 / sqrt(1 - b2^t).
        step_size = ops.divide(lr, ops.subtract(1.0, b1_power))
        inv_v_correction = ops.divide(1.0, ops.sqrt(ops.subtract(1.0, b2_power)))
        new_params: dict[str, Expr] = {}
        new_state: dict[str, Expr] = {f"{self.name}/beta1_power": b1_power, f"{self.name}/beta2_power": b2_power}
        for name, p in params.items():
            g = grads[name]
            if self.decoupled_weight_decay and self.weight_decay:
                p = ops.multiply(p, ops.subtract(1.0, ops.multiply(lr, self.weight_decay)))
            m = ops.add(ops.multiply(state[f"{name}/m"], b1), ops.multiply(g, 1.0 - b1))
            v = ops.add(ops.multiply(state[f"{name}/v"], b2), ops.multiply(ops.multiply(g, g), 1.0 - b2))
            denom = ops.add(ops.multiply(ops.sqrt(v), inv_v_correction), self.eps)
            new_params[name] = ops.subtract(p, ops.multiply(step_size, ops.divide(m, denom)))
            new_state[f"{name}/m"] = m
            new_state[f"{name}/v"] = v
        return new_params, new_state


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter; torch.optim.AdamW's default 0.01)."""

    decoupled_weight_decay = True

    def __init__(self, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8, *, weight_decay: float = 0.01,
                 clip_norm: float | None = None, clip_value: float | None = None) -> None:
        super().__init__(beta1, beta2, eps, weight_decay=weight_decay, clip_norm=clip_norm, clip_value=clip_value)
        self.name = "adamw"


class RMSprop(Optimizer):
    """RMSprop with torch.optim.RMSprop's defaults and placement of ``eps`` (outside the sqrt)."""

    def __init__(self, alpha: float = 0.99, eps: float = 1e-8, momentum: float = 0.0, *, centered: bool = False,
                 weight_decay: float = 0.0, clip_norm: float | None = None, clip_value: float | None = None) -> None:
        super().__init__(weight_decay=weight_decay, clip_norm=clip_norm, clip_value=clip_value)
        if not 0.0 <= alpha < 1.0:
            raise ValueError(f"alpha must be in [0, 1), got {alpha}")
        if eps <= 0.0:
            raise ValueError(f"eps must be > 0, got {eps}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.alpha, self.eps, self.momentum, self.centered = float(alpha), float(eps), float(momentum), centered
        self.name = "rmsprop"
        self.slots = ("square_avg",) + (("grad_avg",) if centered else ()) + (("momentum",) if momentum else ())

    def describe(self) -> str:
        extra = f", momentum={self.momentum:g}" if self.momentum else ""
        extra += ", centered" if self.centered else ""
        return f"rmsprop(alpha={self.alpha:g}, eps={self.eps:g}{extra}{self.options()})"

    def apply(self, params: Mapping[str, Expr], grads: Mapping[str, Expr], state: Mapping[str, Expr],
              lr: Expr) -> tuple[dict[str, Expr], dict[str, Expr]]:
        a = self.alpha
        new_params: dict[str, Expr] = {}
        new_state: dict[str, Expr] = {}
        for name, p in params.items():
            g = grads[name]
            v = ops.add(ops.multiply(state[f"{name}/square_avg"], a), ops.multiply(ops.multiply(g, g), 1.0 - a))
            new_state[f"{name}/square_avg"] = v
            if self.centered:
                gbar = ops.add(ops.multiply(state[f"{name}/grad_avg"], a), ops.multiply(g, 1.0 - a))
                new_state[f"{name}/grad_avg"] = gbar
                v = ops.subtract(v, ops.multiply(gbar, gbar))
            step = ops.divide(g, ops.add(ops.sqrt(v), self.eps))
            if self.momentum:
                step = ops.add(ops.multiply(state[f"{name}/momentum"], self.momentum), step)
                new_state[f"{name}/momentum"] = step
            new_params[name] = ops.subtract(p, ops.multiply(lr, step))
        return new_params, new_state


#: The CLI's optimizer names.
OPTIMIZERS = ("adam", "adamw", "sgd", "momentum", "nesterov", "rmsprop")


def make_optimizer(name: str, *, weight_decay: float | None = None, clip_norm: float | None = None,
                   clip_value: float | None = None) -> Optimizer:
    """The CLI's choices: ``sgd``, ``momentum`` (0.9), ``nesterov`` (0.9), ``adam``, ``adamw``
    and ``rmsprop``; ``weight_decay`` defaults to 0, and to 0.01 for adamw (as torch)."""
    if name == "adamw":
        return AdamW(weight_decay=0.01 if weight_decay is None else weight_decay, clip_norm=clip_norm,
                     clip_value=clip_value)
    decay = weight_decay or 0.0
    if name == "sgd":
        return SGD(weight_decay=decay, clip_norm=clip_norm, clip_value=clip_value)
    if name in ("momentum", "nesterov"):
        return SGD(momentum=0.9, nesterov=name == "nesterov", weight_decay=decay, clip_norm=clip_norm,
                   clip_value=clip_value)
    if name == "adam":
        return Adam(weight_decay=decay, clip_norm=clip_norm, clip_value=clip_value)
    if name == "rmsprop":
        return RMSprop(weight_decay=decay, clip_norm=clip_norm, clip_value=clip_value)
    raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
