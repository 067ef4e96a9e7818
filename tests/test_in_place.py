"""Results computed over a parameter's memory (``opgrad.compile(fn, in_place=...)``): the same
numbers as a plan with results of their own, the caller's arrays written only when donated, and
pairs the plan cannot honour left alone."""

from __future__ import annotations

import numpy as np
import pytest

import opgrad
from opgrad import nn, ops
from opgrad.compiler import LoopStopped, StepLoop
from opgrad.compiler.gemm import Epilogue, GemmSpec, IndexMap, Operand, writes_c_once


def _sgd(batch: int, features: int = 1024, units: int = 96) -> tuple[opgrad.Function, list[np.ndarray]]:
    """(x, labels, lr, w, b) -> (loss, w - lr * dw, b - lr * db): a dense layer's SGD step."""
    x = opgrad.var("x", (batch, features), "float32")
    labels = opgrad.var("labels", (batch,), "int64")
    lr = opgrad.var("lr", (), "float32")
    w = opgrad.var("w", (units, features), "float32")
    b = opgrad.var("b", (units,), "float32")
    loss = ops.softmax_cross_entropy(ops.bias_add(ops.dense(x, w), b), labels)
    dw, db = opgrad.gradients(loss, [w, b])
    fn = opgrad.function([x, labels, lr, w, b], [loss, ops.subtract(w, ops.multiply(lr, dw)),
                                                 ops.subtract(b, ops.multiply(lr, db))])
    rng = np.random.default_rng(batch)
    arrays: list[np.ndarray] = [
        rng.standard_normal((batch, features)).astype(np.float32), rng.integers(0, units, batch),
        np.asarray(0.1, np.float32), rng.standard_normal((units, features)).astype(np.float32),
        rng.standard_normal(units).astype(np.float32)]
    return fn, arrays


PAIRS = ((3, 1), (4, 2))


@pytest.mark.parametrize("features", [1024, 64], ids=["packed-gemm", "small-gemm"])
def test_update_in_place_gives_the_same_bits_and_writes_only_donated_arrays(features: int) -> None:
    fn, arrays = _sgd(32, features=features)
    separate = opgrad.compile(fn)(*arrays)
    compiled = opgrad.compile(fn, in_place=PAIRS)
    assert compiled.in_place == list(PAIRS)
    given = [a.copy() for a in arrays]
    kept = compiled(*given)  # not donated: nothing passed changes
    for a, b in zip(given, arrays, strict=True):
        np.testing.assert_array_equal(a, b)
    donated = compiled(*given, donate=True)
    assert donated[1] is given[3] and donated[2] is given[4]  # the new values, in the arrays passed
    for got in (kept, donated):
        for g, e in zip(got, separate, strict=True):
            np.testing.assert_array_equal(g, e)
    np.testing.assert_array_equal(given[0], arrays[0])  # what was not donated is untouched


def test_a_read_only_or_shared_array_is_not_written_even_when_donated() -> None:
    fn, arrays = _sgd(32)
    expected = opgrad.compile(fn)(*arrays)
    compiled = opgrad.compile(fn, in_place=PAIRS)
    frozen = arrays[3].copy()
    frozen.flags.writeable = False
    got = compiled(*arrays[:3], frozen, arrays[4].copy(), donate=True)
    np.testing.assert_array_equal(frozen, arrays[3])
    np.testing.assert_array_equal(got[1], expected[1])
    # A donated weight that is also another argument's memory: writing it would change that input.
    square, _ = _sgd(48, features=48, units=48)
    rng = np.random.default_rng(1)
    shared = rng.standard_normal((48, 48)).astype(np.float32)
    args: list[np.ndarray] = [shared, rng.integers(0, 48, 48), np.asarray(0.1, np.float32), shared,
                              np.zeros(48, np.float32)]
    want = opgrad.evaluate(square, *[a.copy() for a in args])
    before = shared.copy()
    got = opgrad.compile(square, in_place=PAIRS)(*args, donate=True)
    np.testing.assert_array_equal(shared, before)
    for g, e in zip(got, want, strict=True):
        np.testing.assert_allclose(g, e, rtol=2e-5, atol=2e-6)


def _gemm_with_update(m: int, n: int, k: int) -> GemmSpec:
    """C = E - A @ B, row-major, with E read as C is (a weight and its update)."""

    def matrix(rows: int, cols: int) -> Operand:
        return Operand(IndexMap.strided(rows, cols), IndexMap.strided(cols, 1))

    c = matrix(m, n)
    return GemmSpec(m, n, k, matrix(m, k), matrix(k, n), c,
                    epilogue=Epilogue(lambda s, v: s.sub(v[1], v[0]), (c,)))


def test_only_a_gemm_storing_c_once_may_write_over_its_epilogue_input() -> None:
    """Summing K in blocks or groups stores partial sums in C first: the input would be
    overwritten before the epilogue reads it. The small GEMM finishes each row before storing it."""
    assert writes_c_once(_gemm_with_update(128, 9216, 32))  # the seed CNN's conv3 weight update
    assert not writes_c_once(_gemm_with_update(256, 256, 2048))  # K in blocks
    assert not writes_c_once(_gemm_with_update(40, 40, 3000))  # K in groups
    assert writes_c_once(_gemm_with_update(64, 64, 8))  # the small GEMM
    # Whatever the plan honours, a long-K update computes the reference's numbers.
    fn, args = _sgd(3000, features=40, units=40)
    given = [a.copy() for a in args]
    got = opgrad.compile(fn, in_place=PAIRS)(*given, donate=True)
    want = opgrad.evaluate(fn, *args)
    for g, e in zip(got, want, strict=True):
        np.testing.assert_allclose(g, e, rtol=2e-4, atol=1e-5)


def test_pairs_the_plan_cannot_honour_keep_results_of_their_own() -> None:
    w = opgrad.var("w", (6, 6), "float32")
    # The result reads its parameter transposed: element (i, j) needs w[j, i], which an in-place
    # write of (j, i) would already have changed.
    transposed = opgrad.function([w], [ops.add(ops.transpose(w), w)])
    # The parameter is read after the result by a step that needs both.
    doubled = ops.multiply(w, 2.0)
    tangled = opgrad.function([w], [doubled, ops.matmul(doubled, w)])
    value = np.arange(36, dtype=np.float32).reshape(6, 6) / 7
    for fn in (transposed, tangled):
        compiled = opgrad.compile(fn, in_place=[(0, 0)])
        assert compiled.in_place == []
        given = value.copy()
        got = compiled(given, donate=True)
        np.testing.assert_array_equal(given, value)
        want = opgrad.evaluate(fn, value.copy())
        for g, e in zip(got if isinstance(got, tuple) else [got], want if isinstance(want, tuple) else [want],
                        strict=True):
            np.testing.assert_allclose(g, e, rtol=1e-6)


def test_in_place_pairs_are_validated() -> None:
    fn, _ = _sgd(8)
    with pytest.raises(ValueError, match=r"in_place: \(9, 1\) is not a \(parameter, result\) pair"):
        opgrad.compile(fn, in_place=[(9, 1)])
    with pytest.raises(ValueError, match=r"parameter .b. \(float32\[96\]\) cannot hold result 1"):
        opgrad.compile(fn, in_place=[(4, 1)])
    with pytest.raises(ValueError, match="paired twice"):
        opgrad.compile(fn, in_place=[(3, 1), (3, 1)])
    for bad in ([3], 3, [(3.0, 1)], [(True, 1)], [(3, 1, 0)]):
        with pytest.raises(ValueError, match="expected a sequence of \\(parameter index, result index\\) pairs"):
            opgrad.compile(fn, in_place=bad)
    loop = StepLoop(streams=(0, 1, 2), outfeeds=(0,), carry=((3, 1),), nan_check=0)
    with pytest.raises(ValueError, match=r"\(4, 2\) is not a carried pair of the loop"):
        opgrad.compile(fn, loop=loop, in_place=PAIRS)


def test_the_loop_updates_carried_arrays_in_place_and_still_stops_before_a_nan_step() -> None:
    fn, arrays = _sgd(8)
    loop = StepLoop(streams=(0, 1, 2), outfeeds=(0,), carry=PAIRS, nan_check=0)
    in_place = opgrad.compile(fn, loop=loop, in_place=PAIRS)
    swapping = opgrad.compile(fn, loop=loop)
    assert in_place.in_place == list(PAIRS) and swapping.in_place == []
    rng = np.random.default_rng(3)
    steps = 5
    x = rng.standard_normal((steps * 8, 1024)).astype(np.float32)
    y = rng.integers(0, 96, steps * 8)
    lrs = np.linspace(0.2, 0.05, steps).astype(np.float32)
    w0, b0 = arrays[3].copy(), arrays[4].copy()
    for k in (0, 1, steps):
        got = in_place.run_steps(k, x[: 8 * k], y[: 8 * k], lrs[:k], w0, b0)
        want = swapping.run_steps(k, x[: 8 * k], y[: 8 * k], lrs[:k], w0, b0)
        for g, e in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, e)
    np.testing.assert_array_equal(w0, arrays[3])  # the loop never writes the caller's arrays
    x[8 * 3] = np.nan
    with pytest.raises(LoopStopped, match="NaN or infinite at step 3") as info:
        in_place.run_steps(steps, x, y, lrs, w0, b0, stop_on_nan=True)
    before = swapping.run_steps(3, x[:24], y[:24], lrs[:3], w0, b0)
    np.testing.assert_array_equal(info.value.outputs[1], before[1])  # the weights before the NaN step
    np.testing.assert_array_equal(info.value.outputs[2], before[2])


@pytest.mark.parametrize("optimizer", [nn.SGD(momentum=0.9), nn.Adam()], ids=["sgd-momentum", "adam"])
def test_train_step_updates_weights_and_optimizer_state_in_place(optimizer: nn.Optimizer) -> None:
    model = nn.resnet() if isinstance(optimizer, nn.Adam) else nn.seed_cnn()
    step = nn.TrainStep(model, optimizer, batch_size=8, backend="llvm")
    honoured = {step.function.params[p].name for p, _ in step.compiled.in_place}
    assert any(name.endswith(".weight") for name in honoured), honoured
    separate = opgrad.compile(step.function)
    rng = np.random.default_rng(0)
    x = rng.random((8, *model.input_shape), np.float32)
    y = rng.integers(0, 10, 8)
    params = model.init_params(seed=0)
    state = {**optimizer.init_state(params), **model.init_buffers()}
    args = [x, y, np.asarray(0.01, np.float32), *(params[n] for n in step.param_names),
            *(state[n] for n in step.state_names)]
    want = separate(*args)
    got = step(x, y, {n: a.copy() for n, a in params.items()}, {n: a.copy() for n, a in state.items()}, 0.01,
               donate=True)
    assert got.loss == float(want[0])
    k = len(step.param_names)
    for i, name in enumerate(step.param_names):
        np.testing.assert_array_equal(got.params[name], want[1 + i], err_msg=name)
    for i, name in enumerate(step.state_names):
        np.testing.assert_array_equal(got.state[name], want[1 + k + i], err_msg=name)


def test_the_plan_cache_keeps_the_pairs_and_keys_by_them(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPGRAD_CACHE_DIR", str(tmp_path))
    fn, arrays = _sgd(16)
    first = opgrad.compile(fn, in_place=PAIRS, plan_cache=True)
    again = opgrad.compile(fn, in_place=PAIRS, plan_cache=True)
    other = opgrad.compile(fn, plan_cache=True)
    assert not first.plan_cache_hit and again.plan_cache_hit and not other.plan_cache_hit
    assert again.in_place == first.in_place == list(PAIRS) and other.in_place == []
    for g, e in zip(again(*arrays), other(*arrays), strict=True):
        np.testing.assert_array_equal(g, e)


@pytest.mark.parametrize("donate", ["no", 0, None])
def test_donate_takes_only_a_bool(donate: object) -> None:
    # "no" is truthy: taken as True it would give the caller's arrays up.
    fn, arrays = _sgd(4, features=64)
    compiled = opgrad.compile(fn, in_place=PAIRS)
    before = arrays[3].copy()
    with pytest.raises(TypeError, match=f"donate must be True or False, got {donate!r}"):
        compiled(*arrays, donate=donate)  # type: ignore[arg-type]
    np.testing.assert_array_equal(arrays[3], before)
