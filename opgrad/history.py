"""What a training run records for plots and for resuming: per-step losses and per-epoch results.

Why a separate, dependency-free module: the training loop fills a :class:`TrainingHistory`
whether or not matplotlib is installed, stores it in checkpoint metadata (``to_dict``) so a
resumed run's curves continue where they left off, and only ``opgrad.plot`` needs matplotlib.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TrainingHistory"]


@dataclass
class TrainingHistory:
    """Losses and accuracies of one training run.

    * ``step_losses``: training loss of every optimizer step, in order.
    * ``epoch_accuracies``: test accuracy after each epoch, as a fraction in [0, 1].
    * ``epoch_losses``: mean training loss over each epoch.
    * ``epoch_test_losses``: mean test loss after each epoch (empty if not measured).
    * ``epoch_end_steps``: number of steps done when each epoch ended, so plots can mark epoch
      boundaries even if epochs had different lengths (e.g. after a resume with another batch size).
    """

    step_losses: list[float] = field(default_factory=list)
    epoch_accuracies: list[float] = field(default_factory=list)
    epoch_losses: list[float] = field(default_factory=list)
    epoch_test_losses: list[float] = field(default_factory=list)
    epoch_end_steps: list[int] = field(default_factory=list)

    @property
    def num_epochs(self) -> int:
        """Number of completed epochs."""
        return len(self.epoch_accuracies)

    def record_step(self, loss: float) -> None:
        """Append one optimizer step's training loss."""
        self.step_losses.append(float(loss))

    def record_epoch(self, accuracy: float, train_loss: float, test_loss: float | None = None) -> None:
        """Close an epoch: test accuracy (fraction), mean train loss, optional mean test loss."""
        if not 0.0 <= accuracy <= 1.0:
            raise ValueError(f"accuracy must be a fraction in [0, 1], got {accuracy}")
        self.epoch_accuracies.append(float(accuracy))
        self.epoch_losses.append(float(train_loss))
        if test_loss is not None or self.epoch_test_losses:
            # Keep one test loss per epoch once any is recorded (NaN where an epoch had none).
            pad = len(self.epoch_losses) - 1 - len(self.epoch_test_losses)
            self.epoch_test_losses.extend([math.nan] * pad)
            self.epoch_test_losses.append(math.nan if test_loss is None else float(test_loss))
        self.epoch_end_steps.append(len(self.step_losses))

    def best_accuracy(self) -> float | None:
        """Highest test accuracy so far, or None before the first epoch ends."""
        return max(self.epoch_accuracies) if self.epoch_accuracies else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (for checkpoint metadata); NaN/inf losses become None."""

        def clean(values: list[float]) -> list[float | None]:
            return [v if math.isfinite(v) else None for v in values]

        return {
            "step_losses": clean(self.step_losses),
            "epoch_accuracies": list(self.epoch_accuracies),
            "epoch_losses": clean(self.epoch_losses),
            "epoch_test_losses": clean(self.epoch_test_losses),
            "epoch_end_steps": list(self.epoch_end_steps),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainingHistory:
        """Inverse of :meth:`to_dict`; None losses come back as NaN. Checks the lists agree."""

        def floats(key: str) -> list[float]:
            return [math.nan if v is None else float(v) for v in data.get(key, [])]

        history = cls(
            step_losses=floats("step_losses"),
            epoch_accuracies=floats("epoch_accuracies"),
            epoch_losses=floats("epoch_losses"),
            epoch_test_losses=floats("epoch_test_losses"),
            epoch_end_steps=[int(v) for v in data.get("epoch_end_steps", [])],
        )
        epochs = len(history.epoch_accuracies)
        if len(history.epoch_losses) != epochs or len(history.epoch_end_steps) != epochs:
            raise ValueError(
                f"inconsistent training history: {epochs} accuracies, {len(history.epoch_losses)} "
                f"epoch losses, {len(history.epoch_end_steps)} epoch end steps"
            )
        if history.epoch_test_losses and len(history.epoch_test_losses) != epochs:
            raise ValueError(
                f"inconsistent training history: {epochs} epochs but "
                f"{len(history.epoch_test_losses)} test losses"
            )
        return history
