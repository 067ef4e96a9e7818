"""``opgrad train --plot``: a two-panel PNG of a training run (loss per step, test accuracy per epoch).

Why it looks the way it does: raw per-step losses are noisy, so they are drawn faint with an
exponential moving average on top, on a log axis when they span more than a decade (late
progress from 0.1 to 0.03 would be a flat line otherwise); epoch boundaries are marked so the
two panels can be read against each other.

matplotlib is optional (``pip install "opgrad[train]"``) and imported only when plotting. The
figure is built with the object-oriented API on an Agg canvas, never through ``pyplot``, so
importing opgrad in a notebook does not change the user's backend or global figure state.
The PNG is written atomically (temp file + ``os.replace``) like checkpoints.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from opgrad.atomic import atomic_writer, cannot_write_error
from opgrad.errors import OutputFileError
from opgrad.history import TrainingHistory

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["TrainingHistory", "plot_training", "smooth"]

_RAW_COLOR = "#9ecae1"
_SMOOTH_COLOR = "#08519c"
_EPOCH_COLOR = "#d94801"
_ACC_COLOR = "#238b45"


def smooth(values: Sequence[float], window: int | None = None) -> list[float]:
    """Bias-corrected exponential moving average (as TensorBoard draws it).

    ``window`` is the EMA span (alpha = 2 / (window + 1)); by default ~5% of the run, at most 100
    steps. Bias correction keeps the first points from being dragged toward zero. Non-finite
    values are skipped (they come out as NaN and do not poison later points).
    """
    n = len(values)
    if window is None:
        window = max(1, min(100, n // 20))
    alpha = 2.0 / (window + 1.0)
    out: list[float] = []
    avg = 0.0
    weight = 0.0
    for v in values:
        if math.isfinite(v):
            avg = (1.0 - alpha) * avg + alpha * v
            weight = (1.0 - alpha) * weight + alpha
            out.append(avg / weight)
        else:
            out.append(math.nan)
    return out


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError(
            'plotting needs matplotlib, which is not installed: run `pip install "opgrad[train]"` '
            "(or `pip install matplotlib`), or train without --plot"
        ) from None


def plot_training(
    path: str | os.PathLike[str], history: TrainingHistory, *, title: str | None = None
) -> None:
    """Write a PNG with the loss curve (left) and test accuracy per epoch (right) to ``path``.

    Raises ``ImportError`` saying how to install matplotlib when it is missing, and
    :class:`~opgrad.errors.OutputFileError` naming ``path`` when the file cannot be written.
    """
    _require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_acc = fig.subplots(1, 2, width_ratios=[1.6, 1])
    _draw_losses(ax_loss, history)
    _draw_accuracy(ax_acc, history)
    if title:
        fig.suptitle(title, fontsize=12)
    try:
        with atomic_writer(path, what="the plot") as handle:
            fig.savefig(handle, format="png")
    except OutputFileError:
        raise
    except OSError as exc:  # writing the PNG data itself failed, e.g. the disk is full
        raise cannot_write_error(path, exc, "the plot") from exc


def _draw_losses(ax: Axes, history: TrainingHistory) -> None:
    losses = history.step_losses
    from matplotlib.ticker import MaxNLocator

    ax.set_title("Training loss per step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(True, which="major", alpha=0.3)
    finite = [v for v in losses if math.isfinite(v)]
    if not finite:
        ax.text(
            0.5,
            0.5,
            "no steps recorded" if not losses else "all losses are NaN/inf",
            ha="center",
            va="center",
            transform=ax.transAxes,
            color="gray",
        )
        return
    steps = list(range(1, len(losses) + 1))
    raw_label = "per step"
    skipped = len(losses) - len(finite)
    if skipped:
        raw_label += f" ({skipped} NaN/inf omitted)"
    if len(losses) >= 5:
        ax.plot(steps, losses, color=_RAW_COLOR, linewidth=0.8, alpha=0.8, label=raw_label)
        ax.plot(steps, smooth(losses), color=_SMOOTH_COLOR, linewidth=2.0, label="smoothed (EMA)")
    else:  # too few points to smooth: draw them plainly and visibly
        ax.plot(steps, losses, "-o", color=_SMOOTH_COLOR, linewidth=1.5, markersize=4, label=raw_label)
    if history.epoch_end_steps and len(history.epoch_losses) == len(history.epoch_end_steps):
        # An epoch's mean loss sits mid-epoch (it averages the whole epoch); the test loss is
        # measured after the epoch, so it sits on the boundary.
        starts = [0, *history.epoch_end_steps[:-1]]
        mids = [(a + b + 1) / 2 for a, b in zip(starts, history.epoch_end_steps, strict=True)]
        ax.plot(
            mids,
            history.epoch_losses,
            "o",
            color=_EPOCH_COLOR,
            markersize=5,
            label="epoch mean",
            zorder=3,
        )
        if len(history.epoch_test_losses) == len(history.epoch_end_steps):
            ax.plot(
                history.epoch_end_steps,
                history.epoch_test_losses,
                "s",
                color=_ACC_COLOR,
                markersize=5,
                label="test loss",
                zorder=3,
            )
        for end in (e for e in history.epoch_end_steps if e < len(losses)):  # skip the right edge
            ax.axvline(end + 0.5, color="gray", linewidth=0.6, linestyle=":", alpha=0.7)
    low, high = min(finite), max(finite)
    if low > 0 and high / low > 10:
        ax.set_yscale("log")
        ax.grid(True, which="minor", alpha=0.12)
    ax.set_xlim(0.5, len(losses) + 0.5)
    ax.legend(loc="upper right", fontsize=9, framealpha=0.9)


def _draw_accuracy(ax: Axes, history: TrainingHistory) -> None:
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    ax.set_title("Test accuracy per epoch")
    ax.set_xlabel("epoch")
    ax.set_ylabel("accuracy")
    ax.yaxis.set_major_formatter(PercentFormatter(decimals=0))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    ax.grid(True, alpha=0.3)
    accuracies = [100.0 * a for a in history.epoch_accuracies]
    if not accuracies:
        ax.text(
            0.5, 0.5, "no epoch finished yet", ha="center", va="center", transform=ax.transAxes, color="gray"
        )
        ax.set_ylim(0, 100)
        ax.set_xticks([])
        return
    epochs = list(range(1, len(accuracies) + 1))
    ax.plot(epochs, accuracies, "-o", color=_ACC_COLOR, linewidth=2.0, markersize=6)
    best = max(range(len(accuracies)), key=accuracies.__getitem__)
    ax.plot(
        [epochs[best]],
        [accuracies[best]],
        "o",
        markersize=12,
        markerfacecolor="none",
        markeredgecolor=_ACC_COLOR,
        markeredgewidth=1.5,
    )
    summary = f"final {accuracies[-1]:.2f}%"
    if best != len(accuracies) - 1:
        summary += f"\nbest {accuracies[best]:.2f}% (epoch {epochs[best]})"
    ax.text(
        0.97,
        0.04,
        summary,
        transform=ax.transAxes,
        ha="right",
        va="bottom",
        fontsize=10,
        bbox={"boxstyle": "round,pad=0.35", "facecolor": "white", "edgecolor": "0.8"},
    )
    if len(epochs) <= 20:
        ax.set_xticks(epochs)
    low = min(accuracies)
    span = max(100.0 - low, 2.0)
    ax.set_ylim(max(0.0, low - 0.25 * span), 100.0 + 0.05 * span)
    ax.set_xlim(0.5, len(accuracies) + 0.5)
