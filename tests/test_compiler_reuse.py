"""The compiler computes a value once where a graph builds it twice (opgrad.compiler.graph.SameValues).

Reuse must never change a result: the same training step compiled with and without it gives the
same bits, and calls that differ in any attribute, input or constant (0.0 against -0.0 included)
stay apart.
"""

from __future__ import annotations

import numpy as np
import pytest

import opgrad
from opgrad import nn, ops
from opgrad.compiler import compile as compile_fn
from opgrad.compiler import graph


def without_reuse(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(graph.SameValues, "earlier_call", lambda self, node: None)


def test_a_reduction_built_twice_runs_once_and_its_unread_inputs_vanish(monkeypatch: pytest.MonkeyPatch) -> None:
    x = opgrad.var("x", (64, 32))

    def total() -> opgrad.Expr:  # a fresh exp and sum each time: nodes the graph does not share
        return ops.sum(ops.exp(ops.multiply(x, 0.5)), axis=0)

    fn = opgrad.Function([x], ops.add(total(), total()))
    shared = opgrad.Function([x], (lambda t: ops.add(t, t))(total()))
    data = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    reused, once = compile_fn(fn), compile_fn(shared)
    assert reused.steps == once.steps, (reused.step_labels, once.step_labels)
    np.testing.assert_array_equal(reused(data), once(data))
    without_reuse(monkeypatch)
    twice = compile_fn(fn)
    assert twice.steps == once.steps + 1, twice.step_labels
    np.testing.assert_array_equal(twice(data), reused(data))


def test_an_elementwise_value_built_twice_fuses_into_each_reader() -> None:
    x = opgrad.var("x", (256, 128))
    rows = ops.sum(ops.exp(x), axis=0)
    cols = ops.sum(ops.exp(x), axis=1)
    compiled = compile_fn(opgrad.Function([x], (rows, cols)))
    assert compiled.arena_bytes < 256 * 128 * 4, "exp(x) was written to memory instead of fused into both sums"
    data = np.random.default_rng(1).standard_normal((256, 128)).astype(np.float32)
    got = compiled(data)
    want = opgrad.evaluate(opgrad.Function([x], (rows, cols)), data)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5)


@pytest.mark.parametrize(("first", "second"), [
    (lambda x: ops.sum(x, axis=0), lambda x: ops.sum(x, axis=1, keepdims=False)),
    (lambda x: ops.sum(x, axis=0), lambda x: ops.sum(x, axis=0, keepdims=True)),
    (lambda x: ops.max(ops.multiply(x, 0.0), axis=0), lambda x: ops.max(ops.multiply(x, -0.0), axis=0)),
    (lambda x: ops.sum(ops.multiply(x, 2.0), axis=0), lambda x: ops.sum(ops.multiply(x, 2.0000002), axis=0)),
    (lambda x: ops.max(x, axis=0), lambda x: ops.sum(x, axis=0)),
])
def test_calls_that_differ_in_an_attribute_or_constant_stay_apart(first, second) -> None:  # type: ignore[no-untyped-def]
    x = opgrad.var("x", (8, 8))
    fn = opgrad.Function([x], (first(x), second(x)))
    data = np.abs(np.random.default_rng(2).standard_normal((8, 8))).astype(np.float32) + 0.5
    got, want = compile_fn(fn)(data), opgrad.evaluate(fn, data)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-5)
        np.testing.assert_array_equal(np.signbit(g), np.signbit(w))  # max(x * -0.0) is -0.0


def test_batch_norm_training_step_computes_its_batch_statistics_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The running statistics and batch_norm's gradient build the batch mean and variance alike;
    the compiled step computes them once per layer, to the same bits."""
    model = nn.Sequential([nn.Conv2D(4, 3, use_bias=False), nn.BatchNorm2D(), nn.ReLU(),
                           nn.Conv2D(4, 3, use_bias=False), nn.BatchNorm2D(), nn.ReLU(),
                           nn.Flatten(), nn.Dense(3)], input_shape=(2, 8, 8), name="bn")
    params, buffers = model.init_params(0), model.init_buffers()
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((6, 2, 8, 8)) * 2 + 1.5).astype(np.float32)
    y = rng.integers(0, 3, 6)

    def run() -> tuple[int, nn.StepResult]:
        step = nn.TrainStep(model, nn.SGD(), batch_size=6, backend="llvm")
        assert step.compiled is not None
        return step.compiled.steps, step(x, y, params, buffers, 0.1)

    steps, result = run()
    without_reuse(monkeypatch)
    steps_without, result_without = run()
    assert steps <= steps_without - 2 * 2, (steps, steps_without)  # mean and variance, in each of 2 layers
    assert result.loss == result_without.loss
    for name in (*result.params, *result.state):
        got = result.params.get(name, result.state.get(name))
        want = result_without.params.get(name, result_without.state.get(name))
        np.testing.assert_array_equal(got, want, err_msg=name)


def test_passes_of_the_same_spec_share_one_kernel() -> None:
    """Two convolutions of the same shapes (a model's repeated blocks) call one emitted kernel;
    each still reads and writes its own buffers."""
    x = opgrad.var("x", (2, 8, 10, 10))
    w1, w2 = opgrad.var("w1", (8, 8, 3, 3)), opgrad.var("w2", (8, 8, 3, 3))
    fn = opgrad.Function([x, w1, w2], ops.conv2d(ops.conv2d(x, w1, padding=1), w2, padding=1))
    compiled = compile_fn(fn)
    conv_kernels = [name for name, label in compiled.plan.kernel_labels.items() if label == "conv2d"]
    assert compiled.step_labels.count("conv2d") == 2 and len(conv_kernels) == 1, compiled.plan.kernel_labels
    rng = np.random.default_rng(4)
    args = [rng.standard_normal(v.shape).astype(np.float32) for v in fn.params]
    np.testing.assert_allclose(compiled(*args), opgrad.evaluate(fn, *args), rtol=1e-4, atol=1e-4)
