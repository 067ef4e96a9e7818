"""Edge values whose answer must not depend on rounding or on the array layout.

- ``power`` follows C's ``pow`` at every layout: numpy takes ``sqrt`` for a broadcast exponent
  of 0.5, which gives NaN at base -inf and -0.0 at base -0.0 where ``pow`` gives +inf and +0.0.
- ``batch_norm`` and ``layer_norm`` center a constant group to exactly 0 (so the output is beta
  and an infinite gamma meets a true 0), on both backends, whatever the mean's rounding.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

import opgrad
from opgrad import ops


def _as_list(result: Any) -> list[np.ndarray]:
    return [np.asarray(a) for a in result] if isinstance(result, tuple) else [np.asarray(result)]


def _both(fn: opgrad.Function, *arrays: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The reference's and the compiled results."""
    with np.errstate(all="ignore"):
        return _as_list(opgrad.evaluate(fn, *arrays)), _as_list(opgrad.compile(fn)(*arrays))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("exponent_shape", [(), (1,), (4,)], ids=["0-d", "one", "full"])
def test_power_at_half_follows_c_pow_at_every_layout(dtype: str, exponent_shape: tuple[int, ...]) -> None:
    bases = np.array([-np.inf, -0.0, 0.0, 9.0], dtype)
    exponent = np.full(exponent_shape, 0.5, dtype)
    expected = np.array([math.pow(float(b), 0.5) for b in bases], dtype)
    b, e = opgrad.var("b", bases.shape, dtype), opgrad.var("e", exponent_shape, dtype)
    reference, compiled = _both(opgrad.function([b, e], ops.power(b, e)), bases, exponent)
    for got in (reference[0], compiled[0]):
        np.testing.assert_array_equal(got, expected)
        np.testing.assert_array_equal(np.signbit(got), np.signbit(expected))


# values whose mean over a few copies does not round back to themselves in plain summation
CONSTANTS = [0.1, 0.5115649878732467, -3.7, 1000.0 / 7, 2.0 ** -20 * 3]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("op", ["batch_norm", "layer_norm"])
def test_normalizing_a_constant_group_gives_exactly_beta(op: str, dtype: str) -> None:
    shape = (3, 5, 2, 7)
    axis = 1 if op == "batch_norm" else 2
    channels = (shape[1],) if op == "batch_norm" else shape[2:]
    x = opgrad.var("x", shape, dtype)
    gamma, beta = opgrad.var("gamma", channels, dtype), opgrad.var("beta", channels, dtype)
    out = getattr(ops, op)(x, gamma, beta, axis=axis)
    loss_grads = opgrad.gradients(ops.sum(out), [x, gamma])
    fn = opgrad.function([x, gamma, beta], [out, *loss_grads])
    rng = np.random.default_rng(0)
    gamma_v = rng.standard_normal(channels).astype(dtype)
    gamma_v.flat[0] = np.inf
    beta_v = rng.standard_normal(channels).astype(dtype)
    laid = (1, -1, 1, 1) if op == "batch_norm" else channels
    beta_full = np.broadcast_to(beta_v.reshape(laid), shape)
    finite = np.isfinite(np.broadcast_to(gamma_v.reshape(laid), shape))
    for value in CONSTANTS:
        data = np.full(shape, value, dtype)
        for output, _, d_gamma in _both(fn, data, gamma_v, beta_v):
            # xhat is exactly 0: the output is exactly beta where gamma is finite, inf * 0 = NaN elsewhere
            np.testing.assert_array_equal(output[finite], beta_full[finite])
            assert np.isnan(output[~finite]).all()
            # d_gamma = sum(grad * xhat)
            np.testing.assert_array_equal(d_gamma, np.zeros(channels, dtype))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_negative_zero_constant_keeps_its_sign(dtype: str) -> None:
    """A constant -0.0 is baked into the code as -0.0: x * -0.0 is -0.0 for positive x, as numpy's,
    in an elementwise pass, in a reduction's input and as a GEMM's epilogue operand."""
    x = opgrad.var("x", (4, 8), dtype)
    w = opgrad.var("w", (8, 8), dtype)
    fn = opgrad.Function([x, w], (ops.multiply(x, -0.0), ops.max(ops.multiply(x, -0.0), axis=0),
                                  ops.add(ops.multiply(ops.matmul(x, w), 0.0), -0.0)))
    data = np.full((4, 8), 2.0, dtype)
    weights = np.full((8, 8), 0.5, dtype)
    want, got = _both(fn, data, weights)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, r)
        np.testing.assert_array_equal(np.signbit(g), np.signbit(r))
    assert np.signbit(got[0]).all() and np.signbit(got[1]).all()


@pytest.mark.parametrize("case", ["sum_dense", "mean_matmul", "max_batch_matmul", "sum_conv", "grad_tanh_dense"])
def test_a_reduction_of_a_product_over_an_empty_axis_compiles(case: str) -> None:
    """A GEMM or conv over an empty contraction axis is a fill of zeros; a reduction of it keeps
    its own pass (it takes its shape from its input) and gives the reference's value."""
    x, w = opgrad.var("x", (3, 0)), opgrad.var("w", (4, 0))
    a, b = opgrad.var("a", (2, 3, 0)), opgrad.var("b", (2, 0, 5))
    images, kernels = opgrad.var("images", (2, 0, 5, 5)), opgrad.var("kernels", (3, 0, 3, 3))
    built = {
        "sum_dense": lambda: opgrad.function([x, w], ops.sum(ops.dense(x, w))),
        "mean_matmul": lambda: opgrad.function([x, w], ops.mean(ops.matmul(x, ops.transpose(w)), axis=1)),
        "max_batch_matmul": lambda: opgrad.function([a, b], ops.max(ops.batch_matmul(a, b), axis=(1, 2))),
        "sum_conv": lambda: opgrad.function([images, kernels], ops.sum(ops.conv2d(images, kernels))),
        "grad_tanh_dense": lambda: opgrad.grad(opgrad.function([x, w], ops.sum(ops.tanh(ops.dense(x, w))))),
    }
    fn = built[case]()
    args = [np.zeros(p.shape, np.float32) for p in fn.params]
    want, got = opgrad.evaluate(fn, *args), opgrad.compile(fn)(*args)
    for g, e in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,),
                    strict=True):
        np.testing.assert_array_equal(g, e)
