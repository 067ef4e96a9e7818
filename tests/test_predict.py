"""``opgrad predict`` and ``model.predict``: accuracy and confusion matrix of a saved model, the same
numbers ``opgrad train`` reported, predictions written to .npy, and one-line user errors."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import numpy as np
import pytest

from opgrad import cli, nn
from opgrad.data import load_embedded_mnist

TRAIN = ["train", "--model", "mlp", "--batch-size", "16", "--max-steps", "5", "--epochs", "1"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    """An mlp trained for 5 steps by ``opgrad train --save``, with the test accuracy it printed."""
    path = tmp_path_factory.mktemp("predict") / "mlp.npz"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main([*TRAIN, "--save", str(path)]) == 0
    found = re.search(r"final test accuracy ([\d.]+) %", out.getvalue())
    assert found is not None, out.getvalue()
    return path, float(found.group(1))


def test_predict_embedded_digits_matches_train(trained: tuple[Path, float], capsys: pytest.CaptureFixture[str]) -> None:
    path, train_accuracy = trained
    assert cli.main(["predict", "--checkpoint", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"accuracy {train_accuracy:.2f} % (" in out
    assert "confusion matrix (rows: true class, columns: predicted class)" in out
    rows = [line.split() for line in out.splitlines() if re.match(r"^\s+\d\s", line)]
    matrix = np.array([[int(v) for v in row[1:11]] for row in rows])
    assert matrix.shape == (10, 10) and matrix.sum() == 1000 and matrix.sum(axis=1).tolist() == [100] * 10
    assert np.trace(matrix) / 10 == pytest.approx(train_accuracy)


def test_predict_images_file_writes_predictions(trained: tuple[Path, float], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = trained
    data = load_embedded_mnist()
    images = np.round(data.test_images[:37, 0] * 255).astype(np.uint8)  # (N, 28, 28) uint8, as files hold them
    np.save(tmp_path / "x.npy", images)
    np.save(tmp_path / "y.npy", data.test_labels[:37])
    out_file = tmp_path / "preds.npy"
    assert cli.main(["predict", "--checkpoint", str(path), "--images", str(tmp_path / "x.npy"), "--labels",
                     str(tmp_path / "y.npy"), "--output", str(out_file), "--batch-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "accuracy" in out and "wrote" in out
    predictions = np.load(out_file)
    model = nn.load(path)
    logits = model.predict(images[:, None].astype(np.float32) / 255, batch_size=16)
    assert isinstance(logits, np.ndarray)
    np.testing.assert_array_equal(predictions, logits.argmax(axis=1))
    assert predictions.dtype == np.int64 and predictions.shape == (37,)
    assert cli.main(["predict", "--checkpoint", str(path), "--images", str(tmp_path / "x.npy")]) == 0
    assert "predicted classes: 0:" in capsys.readouterr().out


def test_predict_user_errors_are_one_line(trained: tuple[Path, float], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = trained
    notes = tmp_path / "notes.txt"
    notes.write_text("not a checkpoint")
    np.save(tmp_path / "wrong.npy", np.zeros((3, 32, 32), np.uint8))
    np.savez(tmp_path / "arrays.npz", images=np.zeros((2, 28, 28), np.float32))
    np.save(tmp_path / "digits.npy", np.zeros((2, 28, 28), np.float32))
    np.save(tmp_path / "f.npy", np.array([1.9, 3.9]))
    np.save(tmp_path / "objects.npy", np.array([{"image": 1}], dtype=object), allow_pickle=True)
    holes = np.zeros((4, 28, 28), np.float32)
    holes[2, 14, 14] = np.nan
    np.save(tmp_path / "holes.npy", holes)
    diverged = nn.load(path)
    diverged.params = {name: np.full_like(value, np.nan) for name, value in diverged.params.items()}
    diverged.save(tmp_path / "diverged.npz")
    np.save(tmp_path / "none.npy", np.zeros((0, 28, 28), np.float32))
    cases = [
        (["--checkpoint", str(path), "--images", str(tmp_path / "none.npy")],
         "none.npy: holds no images (shape (0, 28, 28)); expected at least one"),
        (["--checkpoint", str(path), "--images", str(tmp_path / "holes.npy")],
         "holes.npy: image 2 holds NaN or infinite values (1 such image(s)); expected finite pixels"),
        (["--checkpoint", str(tmp_path / "diverged.npz"), "--images", str(tmp_path / "digits.npy")],
         "diverged.npz: the model's scores for image 0 of "),
        (["--checkpoint", str(notes)], "notes.txt: not an .npz checkpoint"),
        (["--checkpoint", str(tmp_path / "missing.npz")], "missing.npz: checkpoint file not found"),
        (["--checkpoint", str(path), "--images", str(tmp_path / "wrong.npy")],
         "wrong.npy: images have shape (3, 32, 32), the model expects (N, 1, 28, 28) or (N, 28, 28)"),
        (["--checkpoint", str(path), "--images", str(notes)],
         "notes.txt: images file is no .npy file (it lacks the NPY header); expected one array written by numpy.save"),
        (["--checkpoint", str(path), "--images", str(tmp_path / "arrays.npz")],
         "arrays.npz: images file is a .npz archive; expected one array written by numpy.save"),
        (["--checkpoint", str(path), "--images", str(tmp_path / "objects.npy")],
         "objects.npy: the images array holds Python objects; expected numbers (opgrad loads no pickles)"),
        (["--checkpoint", str(path), "--labels", str(notes)], "--labels goes with --images"),
        (["--checkpoint", str(path), "--images", str(tmp_path / "digits.npy"), "--labels", str(tmp_path / "f.npy")],
         "f.npy: labels have dtype float64, expected integer class indices"),
    ]
    for args, message in cases:
        assert cli.main(["predict", *args]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("opgrad predict: error: ") and message in err, err
        assert err.count("\n") == 1, err


def test_model_predict_pads_and_keeps_order() -> None:
    model = nn.Sequential([nn.Flatten(), nn.Dense(3)], input_shape=(2, 2))
    x = np.random.default_rng(0).random((7, 2, 2)).astype(np.float32)
    w, b = model.params["dense1.weight"], model.params["dense1.bias"]
    expected = x.reshape(7, 4) @ w.T + b
    for batch_size in (1, 3, 7, 10):
        np.testing.assert_allclose(model.predict(x, batch_size=batch_size), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        model.predict(x, batch_size=0)


@pytest.mark.parametrize("backend", ["reference", "llvm"])
def test_predict_refuses_inputs_it_would_pad_or_truncate(backend: str) -> None:
    """Two inputs of 7 and 5 examples would run the short one's last rows as zeros, and float
    token ids would be cut to integers: both are refused, naming the input."""
    a, b = nn.Input((4,), name="a"), nn.Input((3,), name="b")
    two = nn.Model([a, b], nn.Dense(2)(nn.Concatenate()([nn.Dense(5)(a), nn.Dense(5)(b)])))
    rng = np.random.default_rng(0)
    xa, xb = rng.random((7, 4)).astype(np.float32), rng.random((5, 3)).astype(np.float32)
    with pytest.raises(ValueError, match=r"different numbers of examples \('a' 7, 'b' 5\)"):
        two.predict([xa, xb], backend=backend)
    assert two.predict([xa, np.vstack([xb, xb[:2]])], backend=backend).shape == (7, 2)
    tokens = nn.Input((3,), dtype="int64", name="tokens")
    text = nn.Model(tokens, nn.Dense(2)(nn.Flatten()(nn.Embedding(10, 4)(tokens))))
    with pytest.raises(ValueError, match=r"input 'tokens' takes integer ids \(int64\), got an array of float64"):
        text.predict(np.array([[2.7, 5.9, 0.0]]), backend=backend)
    ids = [[2, 5, 0], [1, 1, 9]]
    np.testing.assert_array_equal(text.predict(ids, backend=backend), text.predict(np.array(ids), backend=backend))


def test_predict_data_reads_only_the_test_split(trained: tuple[Path, float], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    from mnist_files import idx_images, idx_labels

    digits = load_embedded_mnist()
    images = np.round(digits.test_images[:20, 0] * 255).astype(np.uint8)
    (tmp_path / "t10k-images-idx3-ubyte").write_bytes(idx_images(images))
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(idx_labels(digits.test_labels[:20]))
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(b"not read")  # no train images beside it either
    path, _ = trained
    assert cli.main(["predict", "--checkpoint", str(path), "--data", str(tmp_path)]) == 0
    assert "20 images from the test split of the MNIST IDX files in" in capsys.readouterr().out


def test_a_batch_size_beyond_the_images_compiles_for_the_images(trained: tuple[Path, float], tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """predict with a batch size far above the number of images (one too large for the kernels'
    32-bit offsets) gives the outputs of a fitting batch, and the command line warns without
    naming its own script."""
    path, _ = trained
    model = nn.load(path)
    images = load_embedded_mnist().test_images[:10]
    np.testing.assert_array_equal(model.predict(images, batch_size=10**11), model.predict(images, batch_size=32))
    np.save(tmp_path / "ten.npy", images)
    assert cli.main(["predict", "--checkpoint", str(path), "--images", str(tmp_path / "ten.npy"),
                     "--batch-size", str(10**11)]) == 0
    assert capsys.readouterr().err == ""


def test_command_line_warnings_are_one_line(trained: tuple[Path, float], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = trained
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("OPGRAD_CACHE_DIR", str(tmp_path / "file" / "cache"))  # under a file: cannot be made
    assert cli.main(["predict", "--checkpoint", str(path), "--batch-size", "7"]) == 0
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert lines and all(line.startswith("opgrad predict: warning: cannot write the ") for line in lines), err
    assert "object cache" in err
