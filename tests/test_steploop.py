"""The native multi-step loop: K steps in one call give the numbers of K single calls, labels are
checked per step inside native code, a NaN loss stops it when asked, and the trainer and CLI use it."""

from __future__ import annotations

import re

import numpy as np
import pytest

import opgrad
from opgrad import cli, nn, ops
from opgrad.compiler import LoopStopped, StepLoop
from opgrad.data import Dataset, load_embedded_mnist


@pytest.fixture(scope="module")
def mnist() -> Dataset:
    return load_embedded_mnist()


def _tiny() -> tuple[opgrad.Function, StepLoop]:
    """SGD on a softmax regression: (x, labels, lr, w) -> (loss, w - lr * dw)."""
    x = opgrad.var("x", (4, 5), "float32")
    labels = opgrad.var("labels", (4,), "int64")
    lr = opgrad.var("lr", (), "float32")
    w = opgrad.var("w", (3, 5), "float32")
    loss = ops.softmax_cross_entropy(ops.dense(x, w), labels)
    (dw,) = opgrad.gradients(loss, [w])
    fn = opgrad.function([x, labels, lr, w], [loss, ops.subtract(w, ops.multiply(lr, dw))])
    return fn, StepLoop(streams=(0, 1, 2), outfeeds=(0,), carry=((3, 1),), nan_check=0)


@pytest.fixture(scope="module")
def tiny() -> opgrad.compiler.CompiledFunction:
    fn, loop = _tiny()
    return opgrad.compile(fn, loop=loop)


def _tiny_data(steps: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((steps * 4, 5)).astype(np.float32), rng.integers(0, 3, steps * 4),
            np.linspace(0.5, 0.1, steps).astype(np.float32), rng.standard_normal((3, 5)).astype(np.float32))


def test_loop_equals_single_calls_bitwise(tiny: opgrad.compiler.CompiledFunction) -> None:
    x, y, lrs, w0 = _tiny_data(7)
    losses, w = tiny.run_steps(7, x, y, lrs, w0)
    cur, single = w0, []
    for i in range(7):
        loss, cur = tiny(x[4 * i : 4 * i + 4], y[4 * i : 4 * i + 4], lrs[i].reshape(()), cur)
        single.append(loss)
    np.testing.assert_array_equal(losses, np.array(single))
    np.testing.assert_array_equal(w, cur)
    assert losses.shape == (7,) and losses[-1] < losses[0]
    _, w_again = tiny.run_steps(0, x[:0], y[:0], lrs[:0], w0)  # no steps: the initial values
    np.testing.assert_array_equal(w_again, w0)
    assert w_again is not w0


def test_native_label_check_stops_before_the_bad_step(tiny: opgrad.compiler.CompiledFunction) -> None:
    x, y, lrs, w0 = _tiny_data(5)
    w_before = w0.copy()
    y[4 * 3 + 2] = 3  # step 3, index 2: one past the 3 classes
    for validate in (False, True):  # native check alone, then the Python check in front of it
        with pytest.raises(opgrad.ArgumentError, match=r"'labels'.*value 3.*\[0, 3\)") as info:
            tiny.run_steps(5, x, y, lrs, w0, validate=validate)
        if not validate:
            assert "at step 3 (index 2 of that step, flat index 14)" in str(info.value)
    y[14] = -1
    with pytest.raises(opgrad.ArgumentError, match="value -1 at step 3"):
        tiny.run_steps(5, x, y, lrs, w0, validate=False)
    np.testing.assert_array_equal(w0, w_before)  # the caller's arrays are never written


def test_nan_loss_stops_the_loop_only_when_asked(tiny: opgrad.compiler.CompiledFunction) -> None:
    x, y, lrs, w0 = _tiny_data(5)
    x[4 * 2] = np.nan
    losses, _ = tiny.run_steps(5, x, y, lrs, w0)  # not asked: NaN flows on, as in single calls
    assert np.isnan(losses[2:]).all() and np.isfinite(losses[:2]).all()
    with pytest.raises(LoopStopped, match="NaN or infinite at step 2") as info:
        tiny.run_steps(5, x, y, lrs, w0, stop_on_nan=True)
    stopped_losses, w = info.value.outputs
    np.testing.assert_array_equal(stopped_losses[:2], losses[:2])
    assert len(stopped_losses) == 3 and np.isnan(stopped_losses[2])
    _, w_two = tiny.run_steps(2, x[:8], y[:8], lrs[:2], w0)
    np.testing.assert_array_equal(w, w_two)  # the weights before the NaN step


@pytest.mark.parametrize("backend", ["llvm", "reference"])
def test_an_infinite_loss_stops_the_loop_as_a_nan_does(backend: str) -> None:
    """Logits of +-3e38 make the cross-entropy overflow to +inf with no NaN anywhere: the step has
    diverged all the same, and stop_on_nan stops there with the weights before it, as the Trainer's
    per-step check does."""
    model = nn.Sequential([nn.Dense(3)], input_shape=(4,))
    params = model.init_params(0)
    params["dense1.weight"] = np.full((3, 4), 0.8e38, np.float32)
    params["dense1.weight"][0] = -0.8e38
    step = nn.TrainStep(model, nn.SGD(), batch_size=4, backend=backend)
    x, y = np.ones((12, 4), np.float32), np.zeros(12, np.int64)
    x[:4] = 0.0  # step 0 is finite (logits 0 plus the zero biases), step 1 overflows
    with np.errstate(over="ignore", invalid="ignore"):
        assert np.isinf(step(x[4:8], y[4:8], params, {}, 0.1).loss)
        with pytest.raises(nn.NanLossError, match="loss is inf at step 1") as info:
            step.run_steps(x, y, params, {}, 0.1, stop_on_nan=True)
        first = step(x[:4], y[:4], params, {}, 0.1)
    assert info.value.step == 1 and np.isposinf(info.value.losses[1])
    for name, value in first.params.items():
        np.testing.assert_array_equal(info.value.params[name], value, err_msg=name)


def test_run_steps_argument_errors_name_the_argument(tiny: opgrad.compiler.CompiledFunction) -> None:
    x, y, lrs, w0 = _tiny_data(3)
    with pytest.raises(opgrad.ArgumentError, match=re.escape("argument 'x' expects float32[12, 5] (3 steps of "
                                                             "float32[4, 5], batch-major), got float32[8, 5]")):
        tiny.run_steps(3, x[:8], y, lrs, w0)
    with pytest.raises(opgrad.ArgumentError, match=re.escape("argument 'lr' expects float32[3]")):
        tiny.run_steps(3, x, y, lrs.astype(np.float64), w0)
    with pytest.raises(opgrad.ArgumentError, match="expected 4 arrays"):
        tiny.run_steps(3, x, y, lrs)
    with pytest.raises(ValueError, match="steps must be an int >= 0"):
        tiny.run_steps(-1, x, y, lrs, w0)
    fn, _ = _tiny()
    with pytest.raises(ValueError, match="needs the native loop"):
        opgrad.compile(fn).run_steps(3, x, y, lrs, w0)
    with pytest.raises(ValueError, match="cannot carry result 0"):
        StepLoop(carry=((3, 0),)).validate(fn)
    with pytest.raises(ValueError, match="streamed or carried twice"):
        StepLoop(streams=(3,), carry=((3, 1),)).validate(fn)


def test_train_step_run_steps_matches_single_steps(mnist: Dataset) -> None:
    step = nn.TrainStep(nn.seed_cnn(), nn.SGD(), batch_size=16, backend="llvm")  # as test_train's parity run
    params = nn.seed_cnn().init_params(seed=0)
    x, y = mnist.train_images[:64], mnist.train_labels[:64]
    lrs = np.array([0.05, 0.04, 0.03, 0.02], np.float32)
    many = step.run_steps(x, y, params, {}, lrs)
    cur, losses = params, []
    for i in range(4):
        one = step(x[16 * i : 16 * i + 16], y[16 * i : 16 * i + 16], cur, {}, float(lrs[i]))
        cur = one.params
        losses.append(one.loss)
    np.testing.assert_array_equal(many.losses, np.array(losses, np.float32))
    for name, value in cur.items():
        np.testing.assert_array_equal(many.params[name], value, err_msg=name)

    bad = x.copy()
    bad[16:32] = np.nan
    with pytest.raises(nn.NanLossError, match="loss is nan at step 1") as info:
        step.run_steps(bad, y, params, {}, lrs, stop_on_nan=True)
    assert info.value.step == 1 and info.value.losses[0] == many.losses[0]
    first = step(x[:16], y[:16], params, {}, float(lrs[0]))
    for name, value in first.params.items():
        np.testing.assert_array_equal(info.value.params[name], value, err_msg=name)
    with pytest.raises(ValueError, match="not a multiple of the batch size 16"):
        step.run_steps(x[:40], y[:40], params, {}, 0.1)


@pytest.mark.parametrize("backend", ["llvm", "reference"])
def test_trainer_steps_per_call_gives_the_same_run(mnist: Dataset, backend: str) -> None:
    """keras-mnist: dropout masks, shifts and a cosine lr are drawn per step and fed batch-major."""
    batch = 16 if backend == "llvm" else 4
    x, y = mnist.train_images[: 5 * batch], mnist.train_labels[: 5 * batch]
    runs = []
    for k in (1, 3):
        trainer = nn.Trainer(nn.keras_mnist(), nn.Adam(), lr=nn.cosine_lr(2e-3, total_steps=5), batch_size=batch,
                             seed=5, augment_shift=2, backend=backend)
        seen: list[int] = []
        losses: list[float] = []
        chunks: list[list[float]] = []
        trainer.train_epoch(x, y, steps_per_call=k, on_chunk=chunks.append,
                            on_step=lambda i, loss, seen=seen, losses=losses: (seen.append(i), losses.append(loss)))
        assert seen == [1, 2, 3, 4, 5] and trainer.step == 5
        # one call per native call, with its steps' losses: a progress bar times chunks, not steps
        assert [len(c) for c in chunks] == ([1] * 5 if k == 1 else [3, 2])
        assert [loss for c in chunks for loss in c] == losses
        runs.append(trainer)
    assert runs[0].history.step_losses == runs[1].history.step_losses
    for name, value in runs[0].params.items():
        np.testing.assert_array_equal(runs[1].params[name], value, err_msg=name)
    for name, value in runs[0].state.items():
        np.testing.assert_array_equal(runs[1].state[name], value, err_msg=name)


def test_cli_steps_per_call(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["train", "--backend", "reference", "--batch-size", "4", "--max-steps", "3", "--test-limit", "8",
            "--epochs", "1", "--optimizer", "sgd"]
    lines = []
    for k in ("1", "2"):
        assert cli.main([*base, "--steps-per-call", k]) == 0
        out = capsys.readouterr().out
        lines.append(re.search(r"train loss \S+, test loss \S+", out).group(0))  # type: ignore[union-attr]
    assert lines[0] == lines[1]
    assert cli.main([*base, "--steps-per-call", "0"]) == 2
    assert "argument --steps-per-call: expected a positive integer" in capsys.readouterr().err


def test_no_steps_leave_every_result_defined() -> None:
    """With zero steps a carried result is its initial value, an outfeed is empty, and a result
    no step computed is NaN rather than whatever the allocator left there."""
    fn, loop = _tiny()
    w = fn.params[3]
    extra = opgrad.function(fn.params, [*fn.outputs, ops.exp(w)])
    compiled = opgrad.compile(extra, loop=loop, step_entries=True)
    x, y, lrs, w0 = _tiny_data(0)
    losses, w_after, exp_w = compiled.run_steps(0, x, y, lrs, w0)
    assert losses.shape == (0,)
    np.testing.assert_array_equal(w_after, w0)
    assert np.isnan(exp_w).all()
    with pytest.raises(ValueError, match="runs must be an int >= 1"):
        compiled.profile(*[a[:4] if a.ndim else a for a in _tiny_data(1)[:2]], np.float32(0.1), w0, runs=0)
