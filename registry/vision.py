"""SSD-style detection post-processing, forward only: multibox_transform_loc (decode anchor
offsets into boxes and keep the confident ones) and nms (non-maximum suppression), as NNVM and
TVM's topi.vision define them.

Both run after a network's loss, at inference time, and neither framework defines a gradient:
the kept rows are chosen by thresholds and sorting, which are piecewise constant. Their inputs
are declared differentiable with the gradient declared not implemented, so ``opgrad.grad``
through them fails and says why, rather than returning zeros. They are reference only (numpy,
``opgrad.evaluate``): sorting and the sequential suppression loop have no kernel, and
``opgrad.compile`` refuses them by name.

A detection row is ``[class_id, score, xmin, ymin, xmax, ymax]``; class -1 marks an empty or
suppressed row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from opgrad.dtypes import TensorType
from opgrad.op import Attr, Attrs, Case, Input, Interval, Operator, require

if TYPE_CHECKING:  # types only: the compiler and the checker sit above the registry
    from opgrad.checks.strategies import CaseDraw

_NO_GRADIENT = ("detection post-processing: rows are selected by thresholds, sorting and suppression (piecewise "
                "constant); NNVM and TVM define no gradient")
_NO_KERNEL = "sorting and a sequential suppression loop; numpy only"


def _probability(value: Any) -> float:
    v = float(value)
    if not np.isfinite(v):
        raise ValueError("expected a finite number")
    return v


def _flag(value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError("expected True or False")
    return bool(value)


def _variances(value: Any) -> tuple[float, float, float, float]:
    try:
        items = tuple(float(v) for v in value)
    except TypeError:
        raise ValueError("expected 4 floats (x, y, w, h)") from None
    if len(items) != 4 or not all(np.isfinite(items)):
        raise ValueError("expected 4 finite floats (x, y, w, h)")
    return items


def _top_k(value: Any) -> int:
    if isinstance(value, bool) or int(value) != value:
        raise ValueError("expected an int (-1 or 0 for no limit)")
    return int(value)


# ----- multibox_transform_loc -----

multibox_transform_loc = Operator(
    "multibox_transform_loc",
    inputs=[
        Input("cls_prob", dims=("B", "K", "A"), domain=(Interval(0.0, 1.0),),
              doc="(B, num_classes, A) class probabilities; class 0 is the background"),
        Input("loc_pred", doc="(B, A*4) offsets (x, y, w, h) of each anchor"),
        Input("anchor", domain=(Interval(0.0, 1.0),), doc="(1, A, 4) anchor boxes (left, top, right, bottom)"),
    ],
    attrs=[
        Attr("clip", default=True, convert=_flag, doc="clamp box coordinates to [0, 1]"),
        Attr("threshold", default=0.01, convert=_probability,
             doc="an anchor whose best class scores below it is background"),
        Attr("variances", default=(0.1, 0.1, 0.2, 0.2), convert=_variances, doc="scales of the (x, y, w, h) offsets"),
    ],
    doc="TVM's multibox_transform_loc: (B, A, 6) detection rows. For each anchor, the best non-background "
        "class j >= 1 (the first of equal maxima; a NaN never wins) and its probability p; the anchor is kept "
        "if p > -1 and p >= threshold, as the row [j - 1, p, box], rows packed to the top in anchor order, "
        "the rest filled with -1. box: centre (ax + x*vx*aw, ay + y*vy*ah), half sizes exp(w*vw)*aw/2 and "
        "exp(h*vh)*ah/2 around it, clamped to [0, 1] if clip. TVM's second output, the kept count per batch, "
        "is sum(out[:, :, 0] >= 0, axis=1).",
)
multibox_transform_loc.gradient_not_implemented(_NO_GRADIENT)
multibox_transform_loc.lowering_not_implemented(_NO_KERNEL)


@multibox_transform_loc.shape_rule
def _multibox_shape(cls_prob: TensorType, loc_pred: TensorType, anchor: TensorType, attrs: Attrs) -> TensorType:
    require(cls_prob.ndim == 3, f"cls_prob must be 3-D (B, num_classes, A), got shape {cls_prob.shape}")
    b, _, a = cls_prob.shape
    require(loc_pred.shape == (b, a * 4), f"loc_pred has shape {loc_pred.shape}; cls_prob {cls_prob.shape} needs "
                                          f"(B, A*4) = {(b, a * 4)}")
    require(anchor.shape == (1, a, 4), f"anchor has shape {anchor.shape}; cls_prob {cls_prob.shape} needs "
                                       f"(1, A, 4) = {(1, a, 4)}")
    return TensorType((b, a, 6), cls_prob.dtype)


def decode_boxes(loc: np.ndarray, anchor: np.ndarray, variances: tuple[float, ...], clip: bool) -> np.ndarray:
    """(A, 4) boxes (xmin, ymin, xmax, ymax) from (A, 4) offsets and (A, 4) anchors."""
    vx, vy, vw, vh = variances
    al, at, ar, ab = (anchor[:, k] for k in range(4))
    aw, ah = ar - al, ab - at
    ax, ay = (al + ar) / 2, (at + ab) / 2
    ox, oy = loc[:, 0] * vx * aw + ax, loc[:, 1] * vy * ah + ay
    ow, oh = np.exp(loc[:, 2] * vw) * aw / 2, np.exp(loc[:, 3] * vh) * ah / 2
    boxes = np.stack([ox - ow, oy - oh, ox + ow, oy + oh], axis=1)
    return np.clip(boxes, 0, 1) if clip else boxes


@multibox_transform_loc.reference
def _multibox_forward(cls_prob: np.ndarray, loc_pred: np.ndarray, anchor: np.ndarray, clip: bool, threshold: float,
                      variances: tuple[float, ...]) -> np.ndarray:
    b, k, a = cls_prob.shape
    out = np.full((b, a, 6), -1.0, dtype=cls_prob.dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        for n in range(b):
            score = np.full(a, -1.0, dtype=cls_prob.dtype)
            cls = np.zeros(a, dtype=np.int64)
            for j in range(1, k):  # TVM's scan: a strictly greater probability takes over
                better = cls_prob[n, j] > score
                cls = np.where(better, j, cls)
                score = np.where(better, cls_prob[n, j], score)
            keep = np.flatnonzero((cls > 0) & (score >= threshold))
            boxes = decode_boxes(loc_pred[n].reshape(a, 4)[keep], anchor[0, keep], variances, clip)
            out[n, : keep.size, 0] = cls[keep] - 1
            out[n, : keep.size, 1] = score[keep]
            out[n, : keep.size, 2:] = boxes
    return out


@multibox_transform_loc.sampler
def _multibox_cases(d: CaseDraw) -> Case:
    b, k, a = d.int(1, 2), d.int(1, 4), d.int(1, 5)
    return Case([(b, k, a), (b, a * 4), (1, a, 4)],
                {"clip": d.bool(), "threshold": d.choice([0.01, 0.3, 0.6])})


# ----- nms -----

nms = Operator(
    "nms",
    inputs=[
        Input("data", dims=("B", "A", 6), doc="(B, A, 6) rows [class_id, score, xmin, ymin, xmax, ymax]"),
        Input("valid_count", kind="int", dims=("B",), int_range=(0, "A"),
              doc="(B,) rows of each batch that hold boxes, from the top; 0..A (the checker draws 0..A-1)"),
    ],
    attrs=[
        Attr("nms_threshold", default=0.5, convert=_probability,
             doc="a box whose IoU with a kept, higher-scored box is at least this is suppressed; <= 0 disables"),
        Attr("force_suppress", default=False, convert=_flag, doc="suppress across classes, not only within one"),
        Attr("nms_topk", default=-1, convert=_top_k, doc="keep only the k best-scored boxes (-1 or 0: all)"),
        Attr("do_rearrange", default=False, convert=_flag, doc="move the kept rows to the top, in order"),
    ],
    doc="TVM's nms (hybrid form): per batch, when nms_threshold > 0 and valid_count > 0, the first valid_count rows "
        "sorted by score, descending and stable (a NaN score sorts last); beyond nms_topk they are dropped (TVM "
        "of NNVM's time copied them unsorted). Then, best first, every later row of the same class (any class with "
        "force_suppress) whose IoU with a kept row is >= nms_threshold gets class -1, its score and box left as they "
        "were. IoU = intersection / union with 0 for a union <= 0; a NaN coordinate never suppresses. Rows past the "
        "boxes are all -1. Otherwise the valid rows are copied unchanged.",
)
nms.gradient_not_implemented(_NO_GRADIENT)
nms.lowering_not_implemented(_NO_KERNEL)


@nms.shape_rule
def _nms_shape(data: TensorType, valid_count: TensorType, attrs: Attrs) -> TensorType:
    require(data.ndim == 3 and data.shape[2] == 6,
            f"data must be (B, A, 6) rows [class_id, score, xmin, ymin, xmax, ymax], got shape {data.shape}")
    require(valid_count.shape == (data.shape[0],),
            f"valid_count has shape {valid_count.shape}; data {data.shape} needs one count per batch: "
            f"{(data.shape[0],)}")
    return TensorType(data.shape, data.dtype)


def iou(a: np.ndarray, b: np.ndarray) -> float:
    """Intersection over union of two (xmin, ymin, xmax, ymax) boxes; 0 when the union is <= 0."""
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = w * h
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return 0.0 if union <= 0 else float(inter / union)


@nms.reference
def _nms_forward(data: np.ndarray, valid_count: np.ndarray, nms_threshold: float, force_suppress: bool,
                 nms_topk: int, do_rearrange: bool) -> np.ndarray:
    b, a, _ = data.shape
    if valid_count.size and (valid_count.min() < 0 or valid_count.max() > a):
        raise ValueError(f"nms: valid_count must lie in [0, {a}], got values in "
                         f"[{valid_count.min()}, {valid_count.max()}]")
    out = np.full(data.shape, -1.0, dtype=data.dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        for n in range(b):
            count = int(valid_count[n])
            if not (nms_threshold > 0 and count > 0):
                out[n, :count] = data[n, :count]
                continue
            order = np.argsort(-data[n, :count, 1], kind="stable")
            if 0 < nms_topk < count:
                order = order[:nms_topk]
            rows = data[n, order].copy()
            for j in range(len(rows)):
                if not rows[j, 0] >= 0:
                    continue
                for k in range(j + 1, len(rows)):
                    if rows[k, 0] >= 0 and (force_suppress or rows[j, 0] == rows[k, 0]) \
                            and iou(rows[j, 2:], rows[k, 2:]) >= nms_threshold:
                        rows[k, 0] = -1.0
            out[n, : len(rows)] = rows
    if do_rearrange:
        packed = np.full(data.shape, -1.0, dtype=data.dtype)
        for n in range(b):
            kept = out[n][out[n, :, 0] >= 0]
            packed[n, : len(kept)] = kept
        out = packed
    return out


@nms.sampler
def _nms_cases(d: CaseDraw) -> Case:
    b, a = d.int(1, 2), d.int(1, 6)
    return Case([(b, a, 6), (b,)], {"nms_threshold": d.choice([0.0, 0.3, 0.5, 0.9]), "force_suppress": d.bool(),
                                    "nms_topk": d.choice([-1, 0, 1, 3]), "do_rearrange": d.bool()})
