"""Tests for opgrad.progress (both drawing modes), opgrad.history and opgrad.plot."""

from __future__ import annotations

import importlib.util
import io
import json
import math
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from opgrad.history import TrainingHistory
from opgrad.progress import ProgressBar, format_duration, format_metric

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------------------- progress bar


def test_non_tty_prints_every_ten_percent_then_final_line() -> None:
    clock, out = FakeClock(), io.StringIO()
    bar = ProgressBar(125, "epoch 3/10", stream=out, tty=False, clock=clock, width=10)
    for i in range(125):
        clock.now += 0.025
        bar.update(1, loss=1.0 / (i + 1))
    assert out.getvalue().count("\n") == 9  # 10%..90%; 100% is left to close()
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert len(lines) == 10
    assert lines[0] == "epoch 3/10 [#.........]  13/125 loss 0.0769 40.0 steps/s"
    assert lines[-1] == "epoch 3/10 [##########] 125/125 loss 0.0080 40.0 steps/s in 3.1s"
    bar.close()  # idempotent
    assert len(out.getvalue().splitlines()) == 10


def test_non_tty_batched_updates_print_once_per_crossing() -> None:
    clock, out = FakeClock(), io.StringIO()
    with ProgressBar(10, stream=out, tty=False, clock=clock) as bar:
        clock.now += 1.0
        bar.update(5)  # jumps 0% -> 50%: one line, not five
        clock.now += 1.0
        bar.update(5)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].endswith(" 5/10 5.0 steps/s")
    assert lines[1].endswith("10/10 5.0 steps/s in 2.0s")


def test_tty_redraws_in_place() -> None:
    clock, out = FakeClock(), io.StringIO()
    bar = ProgressBar(4, "epoch 1/1", stream=out, tty=True, clock=clock, width=4, min_redraw_interval=0.0)
    for _ in range(4):
        clock.now += 0.5
        bar.update(1, loss=0.5)
    bar.close()
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith(" in 2.0s\n")
    frames = text.rstrip("\n").split("\r")[1:]
    assert frames[0] == "epoch 1/1 [#...] 1/4 loss 0.5000 2.0 steps/s"
    assert frames[3] == "epoch 1/1 [####] 4/4 loss 0.5000 2.0 steps/s"


def test_tty_throttles_redraws_but_always_draws_the_end() -> None:
    clock, out = FakeClock(), io.StringIO()
    bar = ProgressBar(1000, stream=out, tty=True, clock=clock, min_redraw_interval=0.1)
    for _ in range(1000):
        clock.now += 0.001  # 1 s in total -> ~10 redraws, not 1000
        bar.update()
    assert 9 <= out.getvalue().count("\r") <= 12
    assert "1000/1000" in out.getvalue().split("\r")[-1]


def test_tty_write_keeps_bar_intact() -> None:
    out = io.StringIO()
    bar = ProgressBar(2, stream=out, tty=True, clock=FakeClock(), min_redraw_interval=0.0)
    bar.update()
    bar.write("checkpoint saved")
    assert "\rcheckpoint saved\n\r" in out.getvalue()


def test_rate_uses_median_so_a_slow_first_step_is_ignored() -> None:
    clock = FakeClock()
    bar = ProgressBar(10, stream=io.StringIO(), tty=False, clock=clock)
    assert bar.rate is None
    clock.now += 5.0  # first step: kernel compilation
    bar.update()
    for _ in range(6):
        clock.now += 0.01
        bar.update()
    assert bar.rate == pytest.approx(100.0)


def test_unknown_total_and_metric_formats() -> None:
    clock, out = FakeClock(), io.StringIO()
    bar = ProgressBar(None, "eval", stream=out, tty=False, clock=clock, log_every_unknown=2)
    for _ in range(4):
        clock.now += 0.1
        bar.update(1, acc=np.float32(0.5), n=np.int64(3), lr=1e-4, phase="test")
    assert (
        out.getvalue().splitlines()[0] == "eval 2 steps acc 0.5000 n 3 lr 1.000e-04 phase test 10.0 steps/s"
    )
    assert format_metric(math.nan) == "nan"
    assert format_duration(75) == "1m15s" and format_duration(3725) == "1h02m05s"
    with pytest.raises(ValueError):
        ProgressBar(-1)


def test_default_stream_is_stderr_and_not_a_tty(capsys: pytest.CaptureFixture[str]) -> None:
    with ProgressBar(1, "x") as bar:
        bar.update()
    assert capsys.readouterr().err.startswith("x [###")


# ---------------------------------------------------------------------------- history


def sample_history(epochs: int = 3, steps_per_epoch: int = 40) -> TrainingHistory:
    history = TrainingHistory()
    rng = np.random.default_rng(0)
    for e in range(epochs):
        losses = []
        for s in range(steps_per_epoch):
            t = e * steps_per_epoch + s
            loss = 2.3 * math.exp(-t / 30) + 0.05 + abs(rng.normal(0, 0.05))
            history.record_step(loss)
            losses.append(loss)
        history.record_epoch(0.8 + 0.05 * e, float(np.mean(losses)), test_loss=0.5 - 0.1 * e)
    return history


def test_history_round_trips_through_json() -> None:
    history = sample_history()
    history.record_step(math.nan)
    data = json.loads(json.dumps(history.to_dict(), allow_nan=False))
    back = TrainingHistory.from_dict(data)
    assert back.epoch_end_steps == [40, 80, 120]
    assert back.epoch_accuracies == history.epoch_accuracies
    assert math.isnan(back.step_losses[-1]) and back.step_losses[:-1] == history.step_losses[:-1]
    assert back.best_accuracy() == pytest.approx(0.9)
    with pytest.raises(ValueError, match="inconsistent"):
        TrainingHistory.from_dict({**data, "epoch_losses": [1.0]})
    with pytest.raises(ValueError, match="fraction"):
        history.record_epoch(97.0, 0.1)


def test_history_pads_test_losses() -> None:
    history = TrainingHistory()
    history.record_epoch(0.5, 1.0)
    history.record_epoch(0.6, 0.9, test_loss=0.8)
    assert math.isnan(history.epoch_test_losses[0]) and history.epoch_test_losses[1] == 0.8


# ---------------------------------------------------------------------------- plot

needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="matplotlib not installed"
)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


@needs_matplotlib
@pytest.mark.parametrize(
    "history",
    [sample_history(), TrainingHistory(), TrainingHistory(step_losses=[2.3, 2.0, math.nan])],
    ids=["full", "empty", "short-with-nan"],
)
def test_plot_writes_png(tmp_path: Path, history: TrainingHistory) -> None:
    from opgrad.plot import plot_training

    out = tmp_path / "curves.png"
    plot_training(out, history, title="test run")
    width, height = png_size(out)
    assert width > 600 and height > 300
    assert os.listdir(tmp_path) == ["curves.png"]


@needs_matplotlib
def test_plot_failure_leaves_previous_png(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from matplotlib.figure import Figure

    from opgrad.plot import plot_training

    out = tmp_path / "curves.png"
    plot_training(out, sample_history())
    before = out.read_bytes()

    def broken_savefig(self: Figure, fname: object, **kwargs: object) -> None:
        assert hasattr(fname, "write")
        fname.write(b"partial")  # type: ignore[attr-defined]
        raise RuntimeError("renderer crashed")

    monkeypatch.setattr(Figure, "savefig", broken_savefig)
    with pytest.raises(RuntimeError, match="renderer crashed"):
        plot_training(out, sample_history(epochs=1))
    assert out.read_bytes() == before and os.listdir(tmp_path) == ["curves.png"]


def test_plot_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    from opgrad import plot

    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: object, **kwargs: object) -> object:
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ImportError, match=r'pip install "opgrad\[train\]"'):
        plot.plot_training(tmp_path / "x.png", TrainingHistory())
    assert not (tmp_path / "x.png").exists()


def test_smooth() -> None:
    from opgrad.plot import smooth

    assert smooth([1.0, 1.0, 1.0], window=5) == pytest.approx([1.0, 1.0, 1.0])  # bias-corrected
    values = smooth([4.0, math.nan, 2.0], window=1)
    assert values[0] == 4.0 and math.isnan(values[1]) and values[2] == 2.0
