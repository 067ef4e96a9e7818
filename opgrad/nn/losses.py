"""Losses (graph) and metrics (numpy).

A loss is a graph expression so it is differentiated and compiled with the model; metrics
are numpy on the logits the evaluation step returns, because argmax has no gradient and no
reason to be an operator.

A training step takes a loss by name (:data:`LOSSES`, PyTorch's and Keras' names): softmax
cross-entropy against integer class labels, or a regression loss against float targets of the
output's shape. Each is the mean over the batch (and over every element of the output), as
PyTorch's ``reduction="mean"``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from opgrad import ops
from opgrad.errors import ShapeError
from opgrad.ir import Expr

__all__ = ["CLASS_LABEL_LOSS", "LOSSES", "accuracy", "binary_cross_entropy_with_logits", "check_class_labels",
           "check_position_labels", "check_targets", "cross_entropy_numpy", "huber_loss", "l1_loss", "loss_name",
           "mse_loss", "softmax_cross_entropy"]


def softmax_cross_entropy(logits: Expr, labels: Expr) -> Expr:
    """Mean over the batch of ``-log softmax(logits)[label]`` (fused and stable); a scalar."""
    return ops.softmax_cross_entropy(logits, labels)


def _same_shape(prediction: Expr, target: Expr, loss: str) -> None:
    """A ShapeError unless ``target`` has ``prediction``'s shape: a (N, 1) prediction against (N,)
    targets would broadcast to (N, N) and average the wrong differences (torch only warns)."""
    if tuple(prediction.shape) != tuple(target.shape):
        raise ShapeError(f"{loss}: prediction of shape {tuple(prediction.shape)} and target of shape "
                         f"{tuple(target.shape)} differ; give targets of the prediction's shape (y[:, None] makes "
                         f"(N,) targets (N, 1))")


def mse_loss(prediction: Expr, target: Expr) -> Expr:
    """Mean of ``(prediction - target)**2`` over every element (torch's ``mse_loss``)."""
    _same_shape(prediction, target, "mse_loss")
    return ops.mean(ops.square(ops.subtract(prediction, target)))


def l1_loss(prediction: Expr, target: Expr) -> Expr:
    """Mean of ``|prediction - target|`` over every element (torch's ``l1_loss``, Keras' ``mae``)."""
    _same_shape(prediction, target, "l1_loss")
    return ops.mean(ops.abs(ops.subtract(prediction, target)))


def huber_loss(prediction: Expr, target: Expr, delta: float = 1.0) -> Expr:
    """Mean over every element of ``d**2 / 2`` where ``d = |prediction - target| <= delta``, else
    ``delta * (d - delta / 2)`` (torch's ``huber_loss``): written as ``q**2 / 2 + delta * (d - q)``
    with ``q = min(d, delta)``, one expression with no branch to select."""
    _same_shape(prediction, target, "huber_loss")
    d = ops.abs(ops.subtract(prediction, target))
    q = ops.minimum(d, delta)
    return ops.mean(ops.add(ops.multiply(ops.square(q), 0.5), ops.multiply(ops.subtract(d, q), delta)))


def binary_cross_entropy_with_logits(logits: Expr, target: Expr) -> Expr:
    """Mean over every element of ``-(t log sigmoid(x) + (1 - t) log(1 - sigmoid(x)))`` for logits
    ``x`` and targets ``t`` in [0, 1] (torch's ``binary_cross_entropy_with_logits``), computed as
    ``softplus(x) - x t``: softplus never takes the log of a rounded zero, and its derivative is
    ``sigmoid(x)`` everywhere (``relu(x) + log(1 + exp(-|x|))``, the same value, has the kinks of
    relu and abs at 0, where a zero-initialized output layer starts, and loses its 1/2 there)."""
    _same_shape(logits, target, "binary_cross_entropy_with_logits")
    return ops.mean(ops.subtract(ops.softplus(logits), ops.multiply(logits, target)))


#: The loss that takes integer class labels; every other one takes float targets shaped as the output.
CLASS_LABEL_LOSS = "cross_entropy"

#: The losses a training step takes by name, each ``loss(output, labels or targets)``.
LOSSES: dict[str, Callable[[Expr, Expr], Expr]] = {
    CLASS_LABEL_LOSS: softmax_cross_entropy,
    "mse": mse_loss,
    "l1": l1_loss,
    "huber": huber_loss,
    "bce_with_logits": binary_cross_entropy_with_logits,
}

def _folded(name: str) -> str:
    """``name`` compared as loss names are: case, spaces, ``_`` and ``-`` aside."""
    return "".join(c for c in name.lower() if c.isalnum())


#: Other names users bring for the same losses: PyTorch's functions and classes, Keras' strings and
#: classes (compared by :func:`_folded`). Keras' binary cross-entropy is taken on logits (its
#: ``from_logits=True``); smooth L1 equals Huber at PyTorch's default beta = delta = 1.
_ALIASES = {_folded(alias): loss for loss, aliases in {
    CLASS_LABEL_LOSS: ("softmax_cross_entropy", "CrossEntropyLoss", "sparse_categorical_crossentropy",
                       "SparseCategoricalCrossentropy"),
    "mse": ("mse_loss", "mean_squared_error", "MSELoss", "MeanSquaredError"),
    "l1": ("l1_loss", "mae", "mean_absolute_error", "L1Loss", "MeanAbsoluteError"),
    "huber": ("huber_loss", "HuberLoss", "smooth_l1", "smooth_l1_loss", "SmoothL1Loss"),
    "bce_with_logits": ("binary_cross_entropy_with_logits", "BCEWithLogitsLoss", "binary_crossentropy",
                        "BinaryCrossentropy"),
}.items() for alias in (loss, *aliases)}

#: Losses users ask for that take what the step's outputs are not, and what to use instead.
_NOT_ON_LOGITS = {
    _folded(name): hint for names, hint in (
        (("categorical_crossentropy", "CategoricalCrossentropy"),
         "it takes one-hot rows; give class indices (labels.argmax(axis=1)) with loss='cross_entropy'"),
        (("BCELoss", "binary_cross_entropy"),
         "it takes probabilities; leave the final sigmoid out and use loss='bce_with_logits'"),
        (("nll_loss", "NLLLoss"), "it takes log-probabilities; leave the final log_softmax out and use "
                                  "loss='cross_entropy'"),
    ) for name in names}


def loss_name(name: object, who: str) -> str:
    """The :data:`LOSSES` key ``name`` means (case, spaces, ``_`` and ``-`` aside); a ValueError naming
    ``who`` and the choices otherwise. Keras' ``binary_crossentropy`` is taken on logits (its
    ``from_logits=True``): train a model without its final sigmoid."""
    if not isinstance(name, str):
        raise TypeError(f"{who}: loss must be a name (one of {', '.join(LOSSES)}) or a list of names, one per "
                        f"output; got {type(name).__name__} {name!r}. A loss object (torch.nn.MSELoss(), "
                        f"keras.losses.MeanSquaredError()) is given by its name: loss='mse'")
    key = _ALIASES.get(_folded(name))
    if key is None:
        hint = _NOT_ON_LOGITS.get(_folded(name))
        raise ValueError(f"{who}: unknown loss {name!r}" + (f": {hint}" if hint else "") +
                         f"; expected one of {', '.join(LOSSES)} (or a list of them, one per output)")
    return key


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


def check_position_labels(labels: np.ndarray, shape: tuple[int, ...], num_classes: int | None, who: str) -> None:
    """Raise ``ValueError`` unless ``labels`` holds one integer class index per position,
    ``(rows, length)``, each in ``0 .. num_classes - 1`` (unchecked when None): the labels of a
    ``(length, classes)`` output under cross-entropy."""
    labels = np.asarray(labels)
    if labels.shape != shape:
        raise ValueError(f"{who}: labels have shape {labels.shape}, expected {shape}: one class index per position "
                         "of each example's sequence")
    check_class_labels(labels.reshape(-1), labels.size, num_classes, who)


def check_targets(targets: np.ndarray, shape: tuple[int, ...], loss: str, who: str) -> None:
    """Raise ``ValueError`` unless ``targets`` are finite real numbers of ``shape`` (the output's,
    per example), in [0, 1] for ``bce_with_logits``: a wrong shape would broadcast against the
    predictions, and a NaN target makes every loss after it NaN."""
    targets = np.asarray(targets)
    if targets.shape != shape:
        hint = "; (N,) targets become (N, 1) with y[:, None]" if targets.shape == shape[:1] and shape[1:] == (1,) \
            else ""
        raise ValueError(f"{who}: targets have shape {targets.shape}, expected {shape} (the output's shape, loss "
                         f"{loss!r}){hint}")
    if not (np.issubdtype(targets.dtype, np.floating) or np.issubdtype(targets.dtype, np.integer)
            or targets.dtype == np.bool_):
        raise ValueError(f"{who}: targets have dtype {targets.dtype}, expected real numbers (loss {loss!r})")
    if targets.size and not np.isfinite(targets).all():
        raise ValueError(f"{who}: targets hold NaN or infinite values (loss {loss!r}); expected finite numbers")
    if loss == "bce_with_logits" and targets.size and not (targets.min() >= 0 and targets.max() <= 1):
        raise ValueError(f"{who}: targets of loss 'bce_with_logits' are probabilities in [0, 1]; got values in "
                         f"{targets.min()}..{targets.max()}")


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
