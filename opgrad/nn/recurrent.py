"""Recurrent layers: PyTorch's ``nn.LSTM`` and ``nn.GRU`` (one layer, ``batch_first=True``).

A sequence model has a fixed length here, as every compiled shape is fixed, so the recurrence is
unrolled: one step's expressions per position, each built from registered operators (``dense``,
``sigmoid``, ``tanh``, slices), so the whole sequence is differentiated (backpropagation through
time) and compiled like any other layer. The input projection of every position is one GEMM
ahead of the loop; each step adds the recurrent GEMM of the hidden state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from opgrad import ops
from opgrad.ir import Expr
from opgrad.nn.init import Initializer
from opgrad.nn.layers import ForwardContext, Layer, ParamSpec, Shape, as_int

__all__ = ["GRU", "LSTM"]


def recurrent_uniform(hidden: int) -> Initializer:
    """PyTorch's initialization of every recurrent weight and bias: uniform in ``[-k, k]``,
    ``k = 1 / sqrt(hidden)``."""
    bound = 1.0 / math.sqrt(hidden)

    def init(shape: tuple[int, ...], rng: np.random.Generator, dtype: str = "float32") -> np.ndarray:
        return rng.uniform(-bound, bound, shape).astype(dtype)

    return init


class _Recurrent(Layer):
    """What LSTM and GRU share: the arguments, shapes, parameters and the unrolled loop; a
    subclass gives its gate count and one step (:meth:`cell`)."""

    gates = 1

    def __init__(self, units: int, *, return_sequences: bool = False, bidirectional: bool = False,
                 recurrent_bias: bool = True, name: str | None = None) -> None:
        super().__init__(name)
        kind = type(self).__name__
        self.units = as_int(units, f"{kind} units")
        if self.units < 1:
            raise ValueError(f"{kind} units must be >= 1, got {units}")
        for what, flag in (("return_sequences", return_sequences), ("bidirectional", bidirectional),
                           ("recurrent_bias", recurrent_bias)):
            if not isinstance(flag, (bool, np.bool_)):
                raise ValueError(f"{kind} {what} must be True or False, got {flag!r}")
        self.return_sequences, self.bidirectional = bool(return_sequences), bool(bidirectional)
        self.recurrent_bias = bool(recurrent_bias)

    def get_config(self) -> dict[str, Any]:
        return {"units": self.units, "return_sequences": self.return_sequences,
                **({"bidirectional": True} if self.bidirectional else {}),
                **({} if self.recurrent_bias else {"recurrent_bias": False})}

    def config(self) -> str:
        return (f"{self.units}" + (", sequences" if self.return_sequences else "")
                + (", bidirectional" if self.bidirectional else ""))

    @property
    def directions(self) -> tuple[str, ...]:
        """The parameter-name suffix of each direction: PyTorch's ``_reverse`` for the backward one."""
        return ("", "_reverse") if self.bidirectional else ("",)

    def output_shape_for(self, input_shape: Shape) -> Shape:
        if len(input_shape) != 2:
            raise self._shape_error(input_shape, f"{type(self).__name__} needs a sequence (length, features)")
        width = self.units * len(self.directions)
        return (input_shape[0], width) if self.return_sequences else (width,)

    def param_specs(self) -> dict[str, ParamSpec]:
        assert self.input_shape is not None, "build() first"
        features, width = self.input_shape[1], self.gates * self.units
        init = recurrent_uniform(self.units)
        specs = {}
        for suffix in self.directions:
            specs.update({f"weight_ih{suffix}": ParamSpec((width, features), init),
                          f"weight_hh{suffix}": ParamSpec((width, self.units), init),
                          f"bias_ih{suffix}": ParamSpec((width,), init)})
            if self.recurrent_bias:
                specs[f"bias_hh{suffix}"] = ParamSpec((width,), init)
        return specs

    def gate(self, gates: Expr, index: int) -> Expr:
        """Gate ``index`` (``(n, units)``) of the stacked ``(n, gates * units)`` pre-activations."""
        n, h = gates.shape[0], self.units
        return ops.strided_slice(gates, begin=[0, index * h], end=[n, (index + 1) * h])

    def cell(self, projected: Expr, hidden: Expr | None, state: Expr | None,
             params: Mapping[str, Expr]) -> tuple[Expr, Expr | None]:
        """One step: ``(hidden, state)`` after the input's ``projected`` pre-activations, from the
        previous ``hidden`` and ``state`` (None before the first step: PyTorch's zeros)."""
        raise NotImplementedError

    def input_bias(self, params: Mapping[str, Expr]) -> Expr:
        """The bias added to every position's input projection ahead of the loop."""
        return params["bias_ih"]

    def run(self, x: Expr, params: Mapping[str, Expr], reverse: bool) -> tuple[list[Expr], Expr]:
        """One direction over ``x``: the hidden state at each position (in position order) and the
        last one computed (at the last position, or the first going backward)."""
        n, length, features = x.shape
        width = self.gates * self.units
        rows = ops.dense(ops.reshape(x, shape=(n * length, features)), params["weight_ih"])
        projected = ops.reshape(ops.bias_add(rows, self.input_bias(params), axis=1), shape=(n, length, width))
        hidden: Expr | None = None
        state: Expr | None = None
        hiddens: list[Expr] = [projected] * length
        for t in (range(length - 1, -1, -1) if reverse else range(length)):
            step = ops.reshape(ops.strided_slice(projected, begin=[0, t, 0], end=[n, t + 1, width]), shape=(n, width))
            hidden, state = self.cell(step, hidden, state, params)
            hiddens[t] = hidden
        assert hidden is not None
        return hiddens, hidden

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        n = x.shape[0]
        outputs = []
        for suffix in self.directions:
            local = {name: params[name + suffix] for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
                     if name + suffix in params}
            hiddens, last = self.run(x, local, reverse=bool(suffix))
            if not self.return_sequences:
                outputs.append(last)
                continue
            steps = [ops.reshape(h, shape=(n, 1, self.units)) for h in hiddens]
            outputs.append(steps[0] if len(steps) == 1 else ops.concatenate(steps, axis=1))
        # Both directions side by side on the last axis, forward first (PyTorch's and Keras' concat).
        return outputs[0] if len(outputs) == 1 else ops.concatenate(outputs, axis=-1)


class LSTM(_Recurrent):
    """Long short-term memory over a sequence ``(length, features)``: PyTorch's
    ``nn.LSTM(features, units, batch_first=True)``, starting from zero hidden and cell states.

    Per position ``i, f, g, o = split(W_ih x + b_ih + W_hh h + b_hh)`` (PyTorch's gate order),
    ``c = sigmoid(f) * c + sigmoid(i) * tanh(g)``, ``h = sigmoid(o) * tanh(c)``. The output is the
    last ``h`` ``(units,)`` (Keras' default, PyTorch's ``h_n``), or every ``h`` ``(length, units)``
    with ``return_sequences=True`` (PyTorch's ``output``). Parameters PyTorch's, without its
    ``_l0`` suffix: ``weight_ih (4 units, features)``, ``weight_hh (4 units, units)``,
    ``bias_ih``, ``bias_hh (4 units,)``, drawn as PyTorch draws them. ``recurrent_bias=False``
    keeps ``bias_ih`` alone, Keras' one bias per gate (two biases that always add train at twice
    the rate of one).
    """

    kind = "lstm"
    gates = 4

    def input_bias(self, params: Mapping[str, Expr]) -> Expr:
        # Both biases add to every position's gates: one sum ahead of the loop.
        return ops.add(params["bias_ih"], params["bias_hh"]) if self.recurrent_bias else params["bias_ih"]

    def cell(self, projected: Expr, hidden: Expr | None, state: Expr | None,
             params: Mapping[str, Expr]) -> tuple[Expr, Expr | None]:
        gates = projected if hidden is None else ops.add(projected, ops.dense(hidden, params["weight_hh"]))
        i, f = ops.sigmoid(self.gate(gates, 0)), ops.sigmoid(self.gate(gates, 1))
        g, o = ops.tanh(self.gate(gates, 2)), ops.sigmoid(self.gate(gates, 3))
        written = ops.multiply(i, g)
        cell = written if state is None else ops.add(ops.multiply(f, state), written)
        return ops.multiply(o, ops.tanh(cell)), cell


class GRU(_Recurrent):
    """Gated recurrent unit over a sequence ``(length, features)``: PyTorch's
    ``nn.GRU(features, units, batch_first=True)`` (Keras' ``GRU`` with its default
    ``reset_after=True``), starting from a zero hidden state.

    Per position ``r = sigmoid(W_ir x + b_ir + W_hr h + b_hr)``, ``z`` likewise,
    ``n = tanh(W_in x + b_in + r * (W_hn h + b_hn))``, ``h = (1 - z) * n + z * h`` (gate order
    r, z, n as PyTorch's). The output is the last ``h`` or, with ``return_sequences=True``, every
    ``h``. Parameters ``weight_ih (3 units, features)``, ``weight_hh (3 units, units)``,
    ``bias_ih``, ``bias_hh (3 units,)``, drawn as PyTorch draws them; ``recurrent_bias=False``
    leaves ``b_hn`` and the other recurrent biases out.
    """

    kind = "gru"
    gates = 3

    def cell(self, projected: Expr, hidden: Expr | None, state: Expr | None,
             params: Mapping[str, Expr]) -> tuple[Expr, Expr | None]:
        n, width = projected.shape[0], self.gates * self.units
        bias = params.get("bias_hh")
        recurrent: Expr | None = None  # W_hh h + b_hh; None where it is 0 (no state yet, no bias)
        if hidden is not None:
            recurrent = ops.dense(hidden, params["weight_hh"])
            recurrent = recurrent if bias is None else ops.bias_add(recurrent, bias, axis=1)
        elif bias is not None:
            recurrent = ops.broadcast_to(ops.reshape(bias, shape=(1, width)), shape=(n, width))

        def plus_recurrent(index: int, gate: Expr) -> Expr:
            return gate if recurrent is None else ops.add(gate, self.gate(recurrent, index))

        reset = ops.sigmoid(plus_recurrent(0, self.gate(projected, 0)))
        update = ops.sigmoid(plus_recurrent(1, self.gate(projected, 1)))
        candidate = self.gate(projected, 2)
        if recurrent is not None:
            candidate = ops.add(candidate, ops.multiply(reset, self.gate(recurrent, 2)))
        candidate = ops.tanh(candidate)
        kept = ops.multiply(ops.subtract(1.0, update), candidate)
        return (kept if hidden is None else ops.add(kept, ops.multiply(update, hidden))), None
