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


def steps_against_torch(step: Any, inputs: Any, labels: Any, params: dict[str, np.ndarray],
                        state: dict[str, np.ndarray], lr: float, torch_loss: Any, optimizer: Any, *, steps: int = 3,
                        rel: float = 1e-10) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``steps`` opgrad training steps and as many of PyTorch's (``torch_loss()`` on its module,
    then ``optimizer``), each step's loss equal to ``rel``; returns opgrad's params and state."""
    import pytest

    for _ in range(steps):
        result = step(inputs, labels, params, state, lr)
        params, state = result.params, result.state
        optimizer.zero_grad()
        loss = torch_loss()
        loss.backward()
        optimizer.step()
        assert result.loss == pytest.approx(loss.item(), rel=rel)
    return params, state
