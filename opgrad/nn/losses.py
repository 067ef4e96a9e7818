"""Losses (graph) and metrics (numpy) for classification.

The loss is a graph expression so it is differentiated and compiled with the model; metrics
are numpy on the logits the evaluation step returns, because argmax has no gradient and no
reason to be an operator.
"""

from __future__ import annotations

import numpy as np

from opgrad import ops
from opgrad.ir import Expr

__all__ = ["accuracy", "cross_entropy_numpy", "softmax_cross_entropy"]


def softmax_cross_entropy(logits: Expr, labels: Expr) -> Expr:
    """Mean over the batch of ``-log softmax(logits)[label]`` (fused and stable); a scalar."""
    return ops.softmax_cross_entropy(logits, labels)


def accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
    """Fraction of rows whose largest logit is at the label."""
    if logits.shape[0] != labels.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows of logits but {labels.shape[0]} labels")
    return float(np.mean(np.argmax(logits, axis=1) == labels)) if len(labels) else 0.0


def cross_entropy_numpy(logits: np.ndarray, labels: np.ndarray) -> float:
    """Mean softmax cross-entropy of numpy logits (for test-set loss, computed in float64)."""
    z = logits.astype(np.float64)
    z = z - z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return float(-np.mean(logp[np.arange(len(labels)), labels]))
