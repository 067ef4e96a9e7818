"""Losses (graph) and metrics (numpy) for classification.

The loss is a graph expression so it is differentiated and compiled with the model; metrics
are numpy on the logits the evaluation step returns, because argmax has no gradient and no
reason to be an operator.
"""

from __future__ import annotations

import numpy as np

from opgrad import ops
from opgrad.ir import Expr

__all__ = ["accuracy", "check_class_labels", "cross_entropy_numpy", "softmax_cross_entropy"]


def softmax_cross_entropy(logits: Expr, labels: Expr) -> Expr:
    """Mean over the batch of ``-log softmax(logits)[label]`` (fused and stable); a scalar."""
    return ops.softmax_cross_entropy(logits, labels)


def check_class_labels(labels: np.ndarray, rows: int, num_classes: int | None, who: str) -> None:
    """Raise ``ValueError`` unless ``labels`` holds one integer class index per row, each in
    ``0 .. num_classes - 1`` (not checked when ``num_classes`` is None), as PyTorch's
    ``cross_entropy`` asks: an ``(N, 1)`` array would broadcast against the ``N`` predictions, and
    numpy would read a label of -1 as the last class."""
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.shape[0] != rows:
        raise ValueError(f"{who}: labels have shape {labels.shape}, expected ({rows},): one class index per example")
    if labels.dtype == np.bool_ or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"{who}: labels have dtype {labels.dtype}, expected integer class indices")
    if num_classes is not None and labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"{who}: labels must lie in 0..{num_classes - 1} for {num_classes} classes, got values in "
                         f"{labels.min()}..{labels.max()}")


def accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
    """Fraction of rows whose largest logit is at the label."""
    check_class_labels(labels, logits.shape[0], logits.shape[1], "accuracy")
    return float(np.mean(np.argmax(logits, axis=1) == labels)) if len(labels) else 0.0


def cross_entropy_numpy(logits: np.ndarray, labels: np.ndarray) -> float:
    """Mean softmax cross-entropy of numpy logits (for test-set loss, computed in float64)."""
    check_class_labels(labels, logits.shape[0], logits.shape[1], "cross_entropy_numpy")
    z = logits.astype(np.float64)
    z = z - z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return float(-np.mean(logp[np.arange(len(labels)), labels]))
