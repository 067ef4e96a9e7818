"""softmax_cross_entropy: the fused classification loss on logits and integer labels.

Fusing keeps it stable (log-sum-exp, never log(softmax)) and gives the textbook gradient
softmax - onehot in one step, as a classifier's training loop wants it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from opgrad import ops
from opgrad.dtypes import TensorType
from opgrad.ir import Call, Expr
from opgrad.op import Attrs, Input, Operator, require

from .softmax import stable_log_softmax

if TYPE_CHECKING:  # types only: the compiler and the checker sit above the registry
    from opgrad.compiler.builder import KernelBuilder
    from opgrad.compiler.views import Scalar, View

softmax_cross_entropy = Operator(
    "softmax_cross_entropy",
    inputs=[
        Input("logits", dims=("N", "C"), doc="(batch, classes) unnormalized scores"),
        Input("labels", kind="int", dims=("N",), int_range=(0, "C"), doc="(batch,) class indices in [0, C)"),
    ],
    doc="mean over the batch of -log softmax(logits)[label]; a scalar.",
)


@softmax_cross_entropy.shape_rule
def _sce_shape(logits: TensorType, labels: TensorType, attrs: Attrs) -> TensorType:
    require(logits.ndim == 2, f"logits must be 2-D (batch, classes), got shape {logits.shape}")
    require(labels.ndim == 1, f"labels must be 1-D (batch,), got shape {labels.shape}")
    require(
        labels.shape[0] == logits.shape[0],
        f"labels has {labels.shape[0]} entries but logits has a batch of {logits.shape[0]}; "
        f"expected labels shape ({logits.shape[0]},)",
    )
    require(logits.shape[0] > 0, "the batch is empty: the mean over zero examples is undefined")
    return TensorType((), logits.dtype)


@softmax_cross_entropy.reference
def _sce_forward(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    classes = logits.shape[1]
    if labels.size and (labels.min() < 0 or labels.max() >= classes):
        raise ValueError(
            f"softmax_cross_entropy: labels must lie in [0, {classes}), "
            f"got values in [{labels.min()}, {labels.max()}]"
        )
    logp = stable_log_softmax(logits, axis=1)
    return np.asarray(-np.mean(logp[np.arange(logits.shape[0]), labels]), dtype=logits.dtype)


@softmax_cross_entropy.gradient
def _sce_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_logits = (softmax(logits) - onehot(labels)) * grad / N"""
    logits, labels = call.args
    batch, classes = logits.shape
    onehot = ops.one_hot(labels, depth=classes, dtype=logits.dtype)
    scale = ops.divide(grad, float(batch))
    return [ops.multiply(ops.subtract(ops.softmax(logits, axis=1), onehot), scale), None]


def _sce_difference(call: Call, softmax_axis: int = 1) -> Expr:
    """softmax(logits) - onehot(labels), the softmax taken along ``softmax_axis`` (1 is right)."""
    logits, labels = call.args
    onehot = ops.one_hot(labels, depth=logits.shape[1], dtype=logits.dtype)
    return ops.subtract(ops.softmax(logits, axis=softmax_axis), onehot)


@softmax_cross_entropy.mutant("forgets the 1/N of the batch mean")
def _sce_no_batch_mean(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.multiply(_sce_difference(call), grad), None]


@softmax_cross_entropy.mutant("cotangent ignored")
def _sce_cotangent_ignored(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.divide(_sce_difference(call), float(call.args[0].shape[0])), None]


@softmax_cross_entropy.mutant("sign flipped (onehot - softmax)")
def _sce_sign_flipped(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.multiply(ops.negative(_sce_difference(call)), ops.divide(grad, float(call.args[0].shape[0]))), None]


@softmax_cross_entropy.mutant("softmax over the batch axis")
def _sce_softmax_over_batch(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.multiply(_sce_difference(call, softmax_axis=0), ops.divide(grad, float(call.args[0].shape[0]))),
            None]


@softmax_cross_entropy.lowering
def _sce_lowering(kb: KernelBuilder, call: Call, out: View, logits: View, labels: View) -> None:
    """out = mean over n of max + log(sum(exp(logits - max))) - logits[n, labels[n]]

    The label column is selected by comparing with an iota, so a label is never an address.
    """
    from .softmax import softmax_row_stats

    top, total = softmax_row_stats(kb, logits, 1)
    rows = labels.expand_dims(1).broadcast_to(logits.shape)

    def picked_loss(s: Scalar, v: list[str]) -> str:
        x, m, z, label, column = v
        # (m - x) first: both are near the logits' scale, so their difference is exact and the small
        # log(z) adds no rounding at that scale (m + log(z) first would, at logits near 1e4).
        loss = s.add(s.sub(m, x), s.call("log", z))
        return s.select(s.cmp("oeq", label, column), loss, s.const(0.0))

    kb.map_reduce(out, [logits, top, total, rows, kb.iota(logits.shape, 1)], [0, 1], "sum", picked_loss,
                  scale=1.0 / logits.shape[0])
