"""Differentiating gradient functions again: Hessian-vector products against finite differences."""

from __future__ import annotations

import numpy as np
import pytest

import opgrad
from opgrad import ops

rng = np.random.default_rng(7)


def hvp_error(build, shapes: list[tuple[int, ...]], arrays: list[np.ndarray]) -> float:
    """Relative error of H v (from differentiating the gradient) against FD of the gradient along v."""
    params = [opgrad.var(f"p{i}", s, "float64") for i, s in enumerate(shapes)]
    loss = build(*params)
    g = opgrad.gradients(loss, [params[0]])[0]
    v = opgrad.var("v", shapes[0], "float64")
    hv = opgrad.gradients(ops.sum(ops.multiply(g, v)), [params[0]])[0]
    hv_fn = opgrad.function([*params, v], hv)
    g_fn = opgrad.function(params, g)
    direction = rng.standard_normal(shapes[0])
    eps = 1e-5
    plus = [arrays[0] + eps * direction, *arrays[1:]]
    minus = [arrays[0] - eps * direction, *arrays[1:]]
    numeric = (opgrad.evaluate(g_fn, *plus) - opgrad.evaluate(g_fn, *minus)) / (2 * eps)
    analytic = opgrad.evaluate(hv_fn, *arrays, direction)
    return float(np.max(np.abs(analytic - numeric)) / max(1e-8, np.max(np.abs(numeric))))


LABELS = np.array([1, 0, 2])

CASES = {
    "dense+tanh": (lambda x, w: ops.sum(ops.tanh(ops.dense(x, w))), [(3, 4), (5, 4)]),
    "dense weight": (lambda w, x: ops.sum(ops.sigmoid(ops.dense(x, w))), [(5, 4), (3, 4)]),
    "bias_add": (lambda b, x: ops.sum(ops.exp(ops.bias_add(x, b))), [(3,), (2, 3, 2)]),
    "softmax_cross_entropy": (
        lambda z: ops.softmax_cross_entropy(z, opgrad.const(LABELS)), [(3, 4)]),
    "conv2d data": (
        lambda x, w: ops.sum(ops.tanh(ops.conv2d(x, w, strides=2, padding=1))), [(2, 2, 5, 5), (3, 2, 3, 3)]),
    "conv2d weight": (
        lambda w, x: ops.sum(ops.tanh(ops.conv2d(x, w, dilation=2))), [(3, 2, 2, 2), (1, 2, 5, 6)]),
    "avg_pool2d": (lambda x: ops.sum(ops.tanh(ops.avg_pool2d(x, pool_size=2, strides=1))), [(1, 2, 4, 4)]),
    "max_pool2d": (
        lambda x: ops.sum(ops.multiply(ops.max_pool2d(x, pool_size=2), ops.max_pool2d(x, pool_size=2))),
        [(1, 2, 4, 4)]),
    "collapse_sum_like": (
        lambda x, y: ops.sum(ops.tanh(ops.multiply(ops.collapse_sum_like(ops.exp(x), y), y))), [(2, 3), (3,)]),
    "log_softmax": (lambda x: ops.sum(ops.multiply(ops.log_softmax(x), ops.log_softmax(x))), [(2, 5)]),
    "divide+sqrt": (lambda x, y: ops.sum(ops.divide(ops.sqrt(x), y)), [(4,), (4,)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_hessian_vector_product(name: str) -> None:
    build, shapes = CASES[name]
    arrays = [rng.uniform(0.5, 1.5, s) for s in shapes]
    assert hvp_error(build, shapes, arrays) < 1e-6


def test_third_order_through_tanh() -> None:
    x = opgrad.var("x", (3,), "float64")
    g1 = opgrad.gradients(ops.sum(ops.tanh(x)), [x])[0]
    g2 = opgrad.gradients(ops.sum(g1), [x])[0]
    g3 = opgrad.gradients(ops.sum(g2), [x])[0]
    values = np.array([-0.7, 0.1, 1.3])
    t = np.tanh(values)
    expected = -2 * (1 - t**2) ** 2 + 4 * t**2 * (1 - t**2)  # d^3/dx^3 tanh
    np.testing.assert_allclose(opgrad.evaluate(opgrad.function([x], g3), values), expected, rtol=1e-12)
