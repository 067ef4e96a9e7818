"""Every registered gradient against float64 central finite differences (full Jacobian, small shapes).

These are the foundation's hand-written cases; opgrad.checks generates many more from the
declarations. A new operator needs no case here: tests/test_checks_registry.py checks every
registered op from its declaration (docs/contributing-an-operator.md: one file, no test code).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from fd import analytic_and_numeric

import opgrad

rng = np.random.default_rng(1234)


def u(*shape: int) -> np.ndarray:
    return rng.uniform(-2, 2, shape)


def pos(*shape: int) -> np.ndarray:
    return rng.uniform(0.3, 2, shape)


POOL = {"pool_size": (2, 3), "strides": (2, 1), "padding": (1, 1)}
CONV = {"strides": (2, 1), "padding": (1, 0), "dilation": (1, 2)}

CASES: dict[str, tuple[list[np.ndarray], dict]] = {
    "add": ([u(3, 4), u(4)], {}),
    "subtract": ([u(2, 1, 3), u(4, 1)], {}),
    "multiply": ([u(3, 4), u(3, 1)], {}),
    "divide": ([u(3, 4), pos(4)], {}),
    "negative": ([u(2, 3)], {}),
    "exp": ([u(2, 3)], {}),
    "log": ([pos(2, 3)], {}),
    "sqrt": ([pos(3)], {}),
    "sigmoid": ([u(2, 3)], {}),
    "tanh": ([u(2, 3)], {}),
    "relu": ([u(3, 4)], {}),
    "where": ([(u(3, 4) > 0).astype(float), u(3, 4), u(4)], {}),
    "transpose": ([u(2, 3, 4)], {"axes": (1, 2, 0)}),
    "reshape": ([u(2, 6)], {"shape": (3, -1)}),
    "flatten": ([u(2, 3, 2)], {}),
    "broadcast_to": ([u(3, 1)], {"shape": (2, 3, 4)}),
    "collapse_sum_like": ([u(2, 3, 4), u(3, 1)], {}),
    "sum": ([u(2, 3, 4)], {"axis": (0, 2), "keepdims": True}),
    "dense": ([u(3, 5), u(4, 5)], {}),
    "bias_add": ([u(2, 3, 4, 2), u(3)], {}),
    "softmax": ([u(3, 5)], {"axis": 0}),
    "log_softmax": ([u(3, 5)], {}),
    "softmax_cross_entropy": ([u(4, 3), np.array([0, 2, 1, 2])], {}),
    "conv2d": ([u(2, 3, 7, 6), u(4, 3, 3, 2)], {**CONV, "padding": (1, 2)}),
    "conv2d_backward_input": ([u(2, 4, 4, 4), u(4, 3, 3, 2)], {**CONV, "input_size": (7, 6)}),
    "conv2d_backward_weight": ([u(2, 4, 4, 4), u(2, 3, 7, 6)], {**CONV, "kernel_size": (3, 2)}),
    "avg_pool2d": ([u(2, 3, 5, 6)], POOL),
    "avg_pool2d_backward": ([u(2, 3, 3, 6), u(2, 3, 5, 6)], POOL),
    "max_pool2d": ([u(2, 3, 5, 6)], POOL),
    "max_pool2d_backward": ([u(2, 3, 3, 6), u(2, 3, 5, 6)], POOL),
    "max_pool2d_gather": ([u(2, 3, 5, 6), u(2, 3, 5, 6)], POOL),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradient_matches_finite_differences(name: str) -> None:
    arrays, attrs = CASES[name]
    checked = 0
    for input_name, analytic, numeric in analytic_and_numeric(name, arrays, attrs):
        scale = max(1.0, float(np.max(np.abs(numeric))))
        err = float(np.max(np.abs(analytic - numeric))) / scale
        assert err < 1e-7, f"{name}: gradient for {input_name!r} is off by {err:.2e} (relative)"
        checked += 1
    assert checked >= 1


def test_every_case_names_a_registered_differentiable_op() -> None:
    # The reverse direction (every differentiable op has a case here) is deliberately not required:
    # a new registry file is covered by tests/test_checks_registry.py without any test code.
    stale = [name for name in CASES if not opgrad.registry.get(name).gradient_status.registered]
    assert not stale, f"cases for operators without a registered gradient: {stale}"


def test_relu_subgradient_at_zero_is_zero() -> None:
    x = opgrad.var("x", (4,), "float64")
    g = opgrad.grad(opgrad.function([x], opgrad.ops.sum(opgrad.ops.relu(x))))
    _, dx = opgrad.evaluate(g, np.array([-1.0, 0.0, 0.0, 2.0]))
    np.testing.assert_array_equal(dx, [0.0, 0.0, 0.0, 1.0])


def test_max_pool_ties_go_to_first_maximum() -> None:
    x = opgrad.var("x", (1, 1, 2, 2), "float64")
    g = opgrad.grad(opgrad.function([x], opgrad.ops.sum(opgrad.ops.max_pool2d(x, pool_size=2))))
    _, dx = opgrad.evaluate(g, np.full((1, 1, 2, 2), 3.0))
    np.testing.assert_array_equal(dx[0, 0], [[1.0, 0.0], [0.0, 0.0]])


@pytest.mark.parametrize("cuts", [(0, 2, 4, 6, 8), (1, 3, 6), ((0, 4), (2, 6))])
def test_gradients_of_slices_of_one_tensor_are_joined(cuts: tuple) -> None:
    """A tensor cut into blocks along one axis (gates, heads): the blocks' gradients are joined by
    one concatenate, zeros where no block reads, rather than added as whole tensors of zeros;
    overlapping blocks are added. The values are the finite differences' either way."""
    from opgrad import ops
    from opgrad.checks import check_function

    x = opgrad.var("x", (3, 8), "float64")
    spans = list(cuts) if isinstance(cuts[0], tuple) else list(itertools.pairwise(cuts))
    terms = [ops.sum(ops.multiply(ops.tanh(ops.strided_slice(x, begin=[0, lo], end=[3, hi])), float(i + 1)))
             for i, (lo, hi) in enumerate(spans)]
    total = terms[0]
    for term in terms[1:]:
        total = ops.add(total, term)
    fn = opgrad.function([x], total)
    grad_fn = opgrad.grad(fn, with_value=False)
    names = {node.op.name for node in opgrad.ir.topological_order(list(grad_fn.outputs)) if hasattr(node, "op")}
    overlapping = any(a[1] > b[0] for a, b in itertools.pairwise(spans))
    assert ("strided_slice_backward" in names) == overlapping, names
    assert ("concatenate" in names) != overlapping, names
    assert check_function(fn, max_examples=3, seed=0).passed
    x0 = rng.uniform(-2, 2, (3, 8))
    want = np.zeros((3, 8))
    for i, (lo, hi) in enumerate(spans):
        want[:, lo:hi] += (i + 1) * (1 - np.tanh(x0[:, lo:hi]) ** 2)
    np.testing.assert_allclose(opgrad.evaluate(grad_fn, x0), want, rtol=1e-12, atol=1e-14)
