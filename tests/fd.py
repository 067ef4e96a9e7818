"""Float64 central finite differences for the foundation tests (the hypothesis checker is opgrad.checks)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

import opgrad
from opgrad import ops


def numeric_jacobian_vjp(f: Callable[[list[np.ndarray]], np.ndarray], inputs: list[np.ndarray],
                         cotangent: np.ndarray, index: int, eps: float = 1e-6) -> np.ndarray:
    """d<cotangent, f(inputs)>/d inputs[index], one central difference per element (full Jacobian)."""
    x = inputs[index]
    out = np.zeros_like(x)
    for pos in np.ndindex(x.shape):
        plus = [a.copy() for a in inputs]
        minus = [a.copy() for a in inputs]
        plus[index][pos] += eps
        minus[index][pos] -= eps
        out[pos] = (np.sum(cotangent * f(plus)) - np.sum(cotangent * f(minus))) / (2 * eps)
    return out


def analytic_and_numeric(op_name: str, arrays: Sequence[np.ndarray], attrs: dict, seed: int = 0):
    """Yield (input name, analytic VJP, numeric VJP) for each differentiable input of one op call."""
    op = opgrad.registry.get(op_name)
    params = [opgrad.var(spec.name, a.shape, a.dtype.name) for spec, a in zip(op.inputs, arrays)]
    out = op(*params, **attrs)
    rng = np.random.default_rng(seed)
    cot = rng.standard_normal(out.shape).astype(np.float64) + 0.5  # never all ones
    cot_var = opgrad.var("cotangent", out.shape, "float64")
    diff = [p for p, spec in zip(params, op.inputs) if spec.differentiable]
    loss = ops.sum(ops.multiply(out, cot_var))
    fn = opgrad.function([*params, cot_var], loss)
    g = opgrad.grad(fn, wrt=diff)
    results = opgrad.evaluate(g, *arrays, cot)
    fwd = opgrad.function(params, out)
    f = lambda xs: opgrad.evaluate(fwd, *xs)  # noqa: E731
    for k, p in enumerate(diff):
        index = params.index(p)
        yield p.name, results[1 + k], numeric_jacobian_vjp(f, list(arrays), cot, index)
