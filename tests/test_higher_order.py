"""Derivatives of derivatives for users' own functions: nested grad, hvp, jvp, and check_function(order=2)."""

from __future__ import annotations

import numpy as np
import pytest

import opgrad
from opgrad import ops
from opgrad.checks import check_function


def test_nested_grad_of_a_scalar_function_is_the_second_derivative() -> None:
    x = opgrad.var("x", (), "float64")
    f = opgrad.function([x], ops.tanh(x) * x)
    second = opgrad.grad(opgrad.grad(f, with_value=False), with_value=False)
    third = opgrad.grad(second, with_value=False)
    for v in (-1.3, 0.0, 0.7):
        t = np.tanh(v)
        s = 1 - t * t  # tanh'
        expect2 = 2 * s - 2 * v * t * s
        expect3 = -6 * t * s + v * (-2 * s * s + 4 * t * t * s)
        arg = np.array(v)
        assert opgrad.evaluate(second, arg) == pytest.approx(expect2, rel=1e-12, abs=1e-14)
        assert opgrad.evaluate(third, arg) == pytest.approx(expect3, rel=1e-12, abs=1e-14)
        assert float(opgrad.compile(second)(arg)) == pytest.approx(expect2, rel=1e-12, abs=1e-14)


def _mlp() -> tuple[opgrad.Function, list[np.ndarray]]:
    x = opgrad.var("x", (4, 3), "float64")
    w1 = opgrad.var("w1", (5, 3), "float64")
    w2 = opgrad.var("w2", (2, 5), "float64")
    loss = ops.sum(ops.log_softmax(ops.dense(ops.softplus(ops.dense(x, w1)), w2), axis=1))
    rng = np.random.default_rng(3)
    return opgrad.function([x, w1, w2], loss), [rng.standard_normal(s) for s in ((4, 3), (5, 3), (2, 5))]


def test_hvp_matches_finite_differences_of_the_gradient_and_compiles() -> None:
    fn, arrays = _mlp()
    h = opgrad.hvp(fn, wrt=["w1", "w2"])
    assert [p.name for p in h.params] == ["x", "w1", "w2", "v_w1", "v_w2"]
    rng = np.random.default_rng(4)
    vs = [rng.standard_normal(a.shape) for a in arrays[1:]]
    got = opgrad.evaluate(h, *arrays, *vs)
    g = opgrad.grad(fn, wrt=["w1", "w2"], with_value=False)
    eps = 1e-6
    plus = opgrad.evaluate(g, arrays[0], arrays[1] + eps * vs[0], arrays[2] + eps * vs[1])
    minus = opgrad.evaluate(g, arrays[0], arrays[1] - eps * vs[0], arrays[2] - eps * vs[1])
    for a, p, m in zip(got, plus, minus):
        np.testing.assert_allclose(a, (p - m) / (2 * eps), rtol=1e-6, atol=1e-8)
    for a, c in zip(got, opgrad.compile(h)(*arrays, *vs)):
        np.testing.assert_allclose(c, a, rtol=1e-10, atol=1e-12)


def test_jvp_of_a_tensor_output_matches_finite_differences() -> None:
    x = opgrad.var("x", (2, 3, 7, 7), "float64")
    w = opgrad.var("w", (4, 3, 3, 3), "float64")
    fn = opgrad.function([x, w], ops.max_pool2d(ops.relu(ops.conv2d(x, w, padding=1)), pool_size=2))
    j = opgrad.jvp(fn)
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal((2, 3, 7, 7)), rng.standard_normal((4, 3, 3, 3))]
    tangents = [rng.standard_normal(a.shape) for a in arrays]
    y, jt = opgrad.evaluate(j, *arrays, *tangents)
    eps = 1e-7
    plus = opgrad.evaluate(fn, *(a + eps * t for a, t in zip(arrays, tangents)))
    minus = opgrad.evaluate(fn, *(a - eps * t for a, t in zip(arrays, tangents)))
    np.testing.assert_allclose(y, opgrad.evaluate(fn, *arrays))
    np.testing.assert_allclose(jt, (plus - minus) / (2 * eps), rtol=1e-5, atol=1e-7)


def test_check_function_second_order_passes_on_a_real_loss() -> None:
    fn, arrays = _mlp()
    report = check_function(fn, arrays, order=2, seed=0)
    assert report.passed, report.failure
    assert report.checks == ["a", "b", "c", "e"]


def test_check_function_second_order_catches_a_rule_right_only_to_first_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """tanh's derivative computed through stop_gradient is right, but its own derivative is lost."""
    from opgrad import registry

    tanh = registry.get("tanh")

    def first_order_only(call, grad):  # type: ignore[no-untyped-def]
        return [ops.multiply(grad, ops.stop_gradient(ops.subtract(1.0, ops.multiply(call, call))))]

    monkeypatch.setattr(tanh, "_gradient", first_order_only)
    x = opgrad.var("x", (5,), "float64")
    fn = opgrad.function([x], ops.sum(ops.tanh(x)))
    assert check_function(fn, max_examples=2, seed=0).passed
    report = check_function(fn, max_examples=2, seed=0, order=2)
    assert not report.passed and report.failure is not None and report.failure.check == "e"


def test_higher_order_errors_are_clear() -> None:
    x = opgrad.var("x", (3,), "float64")
    vector = opgrad.function([x], ops.tanh(x))
    with pytest.raises(opgrad.GradientError, match=r"or use opgrad\.jvp or opgrad\.gradients with a cotangent"):
        opgrad.grad(vector)
    with pytest.raises(ValueError, match="order must be 1 or 2, got 3"):
        check_function(vector, order=3)
    with pytest.raises(ValueError, match="order=2 needs a scalar output"):
        check_function(vector, order=2)
    with pytest.raises(opgrad.GradientError, match="one output"):
        opgrad.jvp(opgrad.function([x], [ops.tanh(x), x]))
