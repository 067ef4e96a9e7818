"""Compiled float32 kernels keep the reference's digits at logits near 1e4, where exp overflows
unless the kernel subtracts the max (what a naive log-sum-exp gets wrong)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import opgrad
from opgrad import ops
from opgrad.ir import Expr

SHAPE = (3, 37)
EPS32 = float(np.finfo(np.float32).eps)


def _loss_grad(loss: Callable[[Expr], Expr]) -> Callable[[Expr], Expr]:
    return lambda x: opgrad.gradients(ops.sum(ops.multiply(loss(x), 0.3)), [x])[0]


GRAPHS: dict[str, Callable[[Expr], Expr]] = {
    "logsumexp": lambda x: ops.logsumexp(x, axis=1),
    "log_softmax": lambda x: ops.log_softmax(x, axis=1),
    "softmax": lambda x: ops.softmax(x, axis=1),
    "gradient of logsumexp": _loss_grad(lambda x: ops.logsumexp(x, axis=1)),
    "gradient of log_softmax": _loss_grad(lambda x: ops.log_softmax(x, axis=1)),
    "gradient of softmax": _loss_grad(lambda x: ops.softmax(x, axis=1)),
}


def _function(build: Callable[[Expr], Expr], dtype: str) -> opgrad.Function:
    x = opgrad.var("x", SHAPE, dtype)
    return opgrad.function([x], build(x))


@pytest.mark.parametrize("name", list(GRAPHS))
@pytest.mark.parametrize("centre", [1e4, -1e4, 3e4])
def test_compiled_float32_keeps_the_references_digits(name: str, centre: float) -> None:
    build = GRAPHS[name]
    logits = (centre + np.random.default_rng(0).standard_normal(SHAPE) * 3).astype(np.float32)
    exact = np.asarray(opgrad.evaluate(_function(build, "float64"), logits.astype(np.float64)))
    reference = np.asarray(opgrad.evaluate(_function(build, "float32"), logits))
    compiled = np.asarray(opgrad.compile(_function(build, "float32"))(logits))
    assert np.all(np.isfinite(compiled)), f"{name} at {centre:g}: the compiled kernel overflowed"
    # Error against float64 on the same float32 inputs: the compiled kernel may round differently
    # from numpy, by a few ulps of the result, never by the digits an unshifted exp would lose.
    ulps = 4 * EPS32 * float(np.max(np.abs(exact)))
    reference_error = float(np.max(np.abs(reference - exact)))
    compiled_error = float(np.max(np.abs(compiled - exact)))
    assert compiled_error <= 4 * reference_error + ulps, (name, centre, compiled_error, reference_error)
