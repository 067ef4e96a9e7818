"""``opgrad predict``: run a saved model on images and report accuracy and a confusion matrix.

The checkpoint carries the architecture (``opgrad.nn.load``), so any model saved by ``opgrad
train --save`` or ``model.save`` predicts without the code that built it. With no data option it
predicts the 1,000 embedded held-out digits, the ones ``opgrad train`` reports test accuracy on,
so the numbers can be compared directly.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

from opgrad.argtypes import positive_int
from opgrad.data import DataError
from opgrad.errors import ConfigError


def configure(parser: argparse.ArgumentParser) -> None:
    """Add ``opgrad predict``'s options to ``parser``."""
    parser.add_argument("--checkpoint", metavar="PATH", required=True,
                        help="a checkpoint written by opgrad train --save or model.save")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--data", metavar="DIR", default=None,
                        help="directory with the MNIST IDX files; predicts its test split (t10k-images and "
                             "t10k-labels; the train files are not read)")
    source.add_argument("--images", metavar="FILE.npy", default=None,
                        help="images as a .npy array (N, 28, 28) or (N, 1, 28, 28); uint8 is scaled to [0, 1]")
    parser.add_argument("--labels", metavar="FILE.npy", default=None,
                        help="with --images: the true labels (N,), for accuracy and the confusion matrix")
    parser.add_argument("--output", metavar="FILE.npy", default=None,
                        help="write the predicted classes (int64, shape (N,)) to this .npy file")
    parser.add_argument("--batch-size", type=positive_int, default=100, help="evaluation batch size (default 100)")
    parser.add_argument("--backend", choices=("llvm", "reference"), default="llvm",
                        help="llvm: compiled evaluation step (default); reference: the numpy backend")


def _load_npy(path: str, what: str) -> np.ndarray:
    source = Path(path)
    if not source.is_file():
        raise DataError(f"{path}: {what} file not found" if not source.exists() else f"{path}: is not a file")
    try:
        with source.open("rb") as handle:
            magic = handle.read(6)
    except OSError as exc:
        raise DataError(f"{path}: cannot read the {what} file ({exc.strerror or exc})") from None
    # numpy reads a file without the NPY header as a pickle, and its refusal says so: say what the file is not.
    if magic != b"\x93NUMPY":
        kind = "a .npz archive" if magic.startswith(b"PK") else "no .npy file (it lacks the NPY header)"
        raise DataError(f"{path}: {what} file is {kind}; expected one array written by numpy.save")
    try:
        return np.asarray(np.load(source, allow_pickle=False))
    except ValueError as exc:
        if "pickle" in str(exc):
            raise DataError(f"{path}: the {what} array holds Python objects; expected numbers (opgrad loads no "
                            "pickles)") from None
        raise DataError(f"{path}: not a readable .npy array ({exc})") from None
    except (OSError, EOFError) as exc:
        raise DataError(f"{path}: truncated or unreadable .npy array ({type(exc).__name__}: {exc})") from None


def _images_from_npy(path: str, shape: tuple[int, ...]) -> np.ndarray:
    stored = _load_npy(path, "images")
    images = stored[:, None] if stored.ndim == len(shape) and len(shape) == 3 and shape[0] == 1 else stored
    if images.ndim != len(shape) + 1 or tuple(images.shape[1:]) != shape:
        raise DataError(f"{path}: images have shape {stored.shape}, the model expects (N, {', '.join(map(str, shape))})"
                        + (f" or (N, {shape[1]}, {shape[2]})" if len(shape) == 3 and shape[0] == 1 else ""))
    if images.dtype == np.uint8:
        return np.asarray(images.astype(np.float32) / np.float32(255.0), dtype=np.float32)
    if not np.issubdtype(images.dtype, np.floating):
        raise DataError(f"{path}: images have dtype {images.dtype}, expected uint8 (0..255) or floats in [0, 1]")
    if not len(images):
        raise DataError(f"{path}: holds no images (shape {stored.shape}); expected at least one")
    bad = np.flatnonzero(~np.isfinite(images.reshape(len(images), -1)).all(axis=1))
    if bad.size:  # a NaN would come out as class 0 (argmax of NaN scores), a prediction of nothing
        raise DataError(f"{path}: image {bad[0]} holds NaN or infinite values ({bad.size} such image(s)); "
                        "expected finite pixels (floats in [0, 1] or uint8)")
    return images.astype(np.float32)


def confusion_matrix(labels: np.ndarray, predictions: np.ndarray, num_classes: int) -> np.ndarray:
    """``m[true, predicted]`` counts."""
    matrix = np.zeros((num_classes, num_classes), dtype=np.int64)
    np.add.at(matrix, (labels, predictions), 1)
    return matrix


def format_confusion(matrix: np.ndarray) -> str:
    """Rows are true classes, columns predicted ones; the last column is each class's recall."""
    n = matrix.shape[0]
    width = max(4, len(str(int(matrix.max(initial=0)))) + 1)
    lines = ["confusion matrix (rows: true class, columns: predicted class)",
             "true\\pred" + "".join(f"{c:>{width}}" for c in range(n)) + "  recall"]
    for c in range(n):
        total = int(matrix[c].sum())
        recall = f"{matrix[c, c] / total * 100:6.1f} %" if total else "     -"
        lines.append(f"{c:>9}" + "".join(f"{int(v):>{width}}" for v in matrix[c]) + f"  {recall}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Predict; returns 0. User errors raise :class:`~opgrad.errors.UserError` (printed as one line)."""
    from opgrad.checkpoint import CheckpointError
    from opgrad.data import load_embedded_mnist, load_mnist_split
    from opgrad.nn import load_model
    from opgrad.train import check_output, resolve_backend

    check_output(args.output, "--output", {"--checkpoint": args.checkpoint, "--images": args.images,
                                           "--labels": args.labels})
    if args.labels and not args.images:
        raise ConfigError("--labels goes with --images (--data and the embedded digits bring their own labels)")
    model = load_model(args.checkpoint)
    if len(model.inputs) != 1 or len(model.outputs) != 1:
        raise CheckpointError(f"{args.checkpoint}: model {model.name!r} has {len(model.inputs)} input(s) and "
                              f"{len(model.outputs)} output(s); opgrad predict runs single-input classifiers "
                              "(use model.predict in Python)")
    labels: np.ndarray | None
    if args.images:
        images = _images_from_npy(args.images, model.input_shape)
        labels = None
        if args.labels:
            stored = _load_npy(args.labels, "labels")
            if stored.dtype == np.bool_ or not np.issubdtype(stored.dtype, np.integer):
                raise DataError(f"{args.labels}: labels have dtype {stored.dtype}, expected integer class indices")
            labels = stored.astype(np.int64, copy=False)
            if labels.shape != (len(images),):
                raise DataError(f"{args.labels}: labels have shape {labels.shape}, expected ({len(images)},) "
                                f"for the {len(images)} images of {args.images}")
        source = args.images
    elif args.data:
        images, labels = load_mnist_split(args.data, "test")
        source = f"the test split of the MNIST IDX files in {args.data}"
    else:
        data = load_embedded_mnist()
        images, labels = data.test_images, data.test_labels
        source = f"the test split of {data.source}"
        if tuple(images.shape[1:]) != model.input_shape:
            raise DataError(f"{source}: images have shape {images.shape[1:]}, model {model.name!r} expects "
                            f"{model.input_shape}")
    backend = resolve_backend(args.backend)
    meta: dict[str, Any] = model.checkpoint_meta
    trained = f", trained {meta['epoch']} epoch(s)" if meta.get("epoch") else ""
    print(f"model {model.name}: {model.num_params:,} parameters from {args.checkpoint}{trained}; "
          f"{len(images)} images from {source}; backend {backend}")
    logits = model.predict(images, batch_size=args.batch_size, backend=backend)
    assert isinstance(logits, np.ndarray)
    undefined = np.flatnonzero(~np.isfinite(logits).all(axis=1))
    if undefined.size:
        raise DataError(f"{args.checkpoint}: the model's scores for image {undefined[0]} of {source} are NaN or "
                        f"infinite ({undefined.size} image(s)), so it predicts no class there; its weights may "
                        "have diverged")
    predictions = np.argmax(logits, axis=1).astype(np.int64)
    if labels is not None:
        num_classes = int(logits.shape[1])
        if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
            raise DataError(f"labels must lie in 0..{num_classes - 1} for this {num_classes}-class model, got "
                            f"values in {labels.min()}..{labels.max()}")
        correct = int((predictions == labels).sum())
        print(f"accuracy {correct / max(1, len(labels)) * 100:.2f} % ({correct}/{len(labels)})")
        print(format_confusion(confusion_matrix(labels, predictions, num_classes)))
    else:
        counts = np.bincount(predictions, minlength=int(logits.shape[1]))
        print("predicted classes: " + ", ".join(f"{c}: {int(n)}" for c, n in enumerate(counts)))
    if args.output:
        from opgrad.atomic import atomic_writer

        with atomic_writer(Path(args.output), what="the predictions") as handle:
            np.save(handle, predictions, allow_pickle=False)
        print(f"wrote {args.output} ({len(predictions)} predicted classes)")
    sys.stdout.flush()
    return 0
