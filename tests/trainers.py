"""Checks that several test modules share on trainers."""

from __future__ import annotations

from typing import Any

import numpy as np


def assert_split_trains_as_plain(plain: Any, split: Any, inputs: Any, labels: np.ndarray, epochs: int = 2) -> None:
    """A one-rank DistributedTrainer running the split step (gradients, all-reduce, update) trains
    bitwise as the plain Trainer: losses, weights and evaluation."""
    assert split.comm.size == 1 and not split.fused
    for _ in range(epochs):
        assert plain.train_epoch(inputs, labels) == split.train_epoch(inputs, labels)
    for name in plain.params:
        np.testing.assert_array_equal(plain.params[name], split.params[name])
    assert plain.evaluate(inputs, labels) == split.evaluate(inputs, labels)
