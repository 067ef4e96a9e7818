"""Tests for opgrad.checkpoint: round trip, atomicity, corruption detection, mismatch messages."""

from __future__ import annotations

import os
import stat
import threading
import zipfile
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from opgrad import checkpoint
from opgrad.checkpoint import CheckpointError, atomic_writer, load_checkpoint, save_checkpoint


def model_arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "conv1.weight": rng.standard_normal((16, 1, 3, 3)).astype(np.float32),
        "conv1.bias": np.zeros(16, np.float32),
        "fc.weight": rng.standard_normal((10, 64)).astype(np.float32),
        "optim/step": np.array(120, dtype=np.int64),
    }


META = {"epoch": 3, "step": 120, "optimizer": "adam", "seed": 0, "model": "tiny_cnn", "lr": 1e-3}


def test_round_trip(tmp_path: Path) -> None:
    p = tmp_path / "ckpt.npz"
    arrays = model_arrays()
    save_checkpoint(p, arrays, {**META, "loss": np.float32(0.25)})
    arrays_back, meta = load_checkpoint(p)
    assert arrays_back.keys() == arrays.keys()
    for name, value in arrays.items():
        assert arrays_back[name].dtype == value.dtype
        np.testing.assert_array_equal(arrays_back[name], value)
    assert meta == {**META, "loss": 0.25}
    # Plain npz: readable without opgrad and without pickle.
    with np.load(p, allow_pickle=False) as npz:
        assert "conv1.weight" in npz.files and "__meta__" in npz.files
    assert sorted(os.listdir(tmp_path)) == ["ckpt.npz"]  # no temp files left behind


def test_expected_matches(tmp_path: Path) -> None:
    p = tmp_path / "ckpt.npz"
    arrays = model_arrays()
    save_checkpoint(p, arrays, META)
    expected = {name: (a.shape, a.dtype) for name, a in arrays.items()}
    assert load_checkpoint(p, expected).meta["epoch"] == 3


def test_shape_mismatch_message(tmp_path: Path) -> None:
    p = tmp_path / "ckpt.npz"
    arrays = model_arrays()
    save_checkpoint(p, arrays, META)
    expected: dict[str, tuple[tuple[int, ...], npt.DTypeLike]] = {
        name: (a.shape, a.dtype) for name, a in arrays.items()
    }
    expected["conv1.weight"] = ((32, 1, 3, 3), np.float32)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(p, expected)
    assert str(err.value) == (
        f"{p}: conv1.weight: checkpoint has shape (16, 1, 3, 3), model expects (32, 1, 3, 3)"
    )


def test_missing_extra_and_dtype(tmp_path: Path) -> None:
    p = tmp_path / "ckpt.npz"
    save_checkpoint(p, model_arrays(), META)
    expected: dict[str, tuple[tuple[int, ...], npt.DTypeLike]] = {
        "conv1.weight": ((16, 1, 3, 3), "float64"),
        "conv1.bias": ((16,), np.float32),
        "conv2.weight": ((8, 16, 3, 3), np.float32),
    }
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(p, expected)
    msg = str(err.value)
    assert "missing arrays the model needs: conv2.weight" in msg
    assert "unexpected arrays the model does not have: fc.weight, optim/step" in msg
    assert "conv1.weight: checkpoint has dtype float32, model expects float64" in msg


def test_failed_write_leaves_old_file_and_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "ckpt.npz"
    save_checkpoint(p, model_arrays(), META)
    before = p.read_bytes()

    calls = {"n": 0}
    real_write_array = np.lib.format.write_array

    def explode_midway(*args: object, **kwargs: object) -> None:
        calls["n"] += 1
        if calls["n"] == 3:  # two arrays already written to the temp file
            raise OSError("disk full")
        real_write_array(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(np.lib.format, "write_array", explode_midway)
    bigger = {**model_arrays(), "extra": np.ones(1000)}
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(p, bigger, {**META, "epoch": 4})
    assert p.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt.npz"]
    monkeypatch.undo()
    assert load_checkpoint(p).meta["epoch"] == 3


def test_failed_first_write_creates_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail_fsync(fd: int) -> None:
        raise OSError("fsync failed")

    monkeypatch.setattr(checkpoint.os, "fsync", fail_fsync)
    with pytest.raises(OSError, match="fsync failed"):
        save_checkpoint(tmp_path / "new.npz", model_arrays(), META)
    assert os.listdir(tmp_path) == []


def test_atomic_writer_interrupted(tmp_path: Path) -> None:
    p = tmp_path / "out.bin"
    p.write_bytes(b"old")
    with pytest.raises(KeyboardInterrupt), atomic_writer(p) as handle:
        handle.write(b"partial")
        raise KeyboardInterrupt
    assert p.read_bytes() == b"old" and os.listdir(tmp_path) == ["out.bin"]
    with atomic_writer(p) as handle:
        handle.write(b"new")
    assert p.read_bytes() == b"new"


@pytest.mark.parametrize("keep", [0.5, 0.9, 0.99])
def test_truncated_file(tmp_path: Path, keep: float) -> None:
    p = tmp_path / "ckpt.npz"
    save_checkpoint(p, model_arrays(), META)
    data = p.read_bytes()
    p.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CheckpointError, match=r"ckpt\.npz: corrupt or truncated checkpoint"):
        load_checkpoint(p)


def test_bit_flip_detected_by_checksum(tmp_path: Path) -> None:
    p = tmp_path / "ckpt.npz"
    arrays = model_arrays()
    save_checkpoint(p, arrays, META)
    data = bytearray(p.read_bytes())
    # Flip one byte inside conv1.weight's raw data (uncompressed zip member, so findable).
    offset = bytes(data).find(arrays["conv1.weight"].tobytes()[:16]) + 5
    assert offset > 5
    data[offset] ^= 0x01
    p.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"ckpt\.npz: (checksum mismatch|corrupt or truncated)"):
        load_checkpoint(p)


def test_tampered_entry_detected(tmp_path: Path) -> None:
    # Rewrite a valid zip with one array replaced: the zip layer is fine, only sha256 notices.
    p = tmp_path / "ckpt.npz"
    save_checkpoint(p, model_arrays(), META)
    with np.load(p) as npz:
        entries = {name: npz[name] for name in npz.files}
    entries["conv1.bias"] = entries["conv1.bias"] + 1
    np.savez(tmp_path / "tampered.npz", **entries)
    with pytest.raises(CheckpointError, match=r"tampered\.npz: checksum mismatch"):
        load_checkpoint(tmp_path / "tampered.npz")


def test_not_a_checkpoint(tmp_path: Path) -> None:
    empty = tmp_path / "empty.npz"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"empty\.npz: empty file"):
        load_checkpoint(empty)
    text = tmp_path / "notes.npz"
    text.write_text("hello")
    with pytest.raises(CheckpointError, match=r"notes\.npz: not an \.npz checkpoint"):
        load_checkpoint(text)
    foreign = tmp_path / "foreign.npz"
    np.savez(foreign, w=np.ones(3))
    with pytest.raises(CheckpointError, match=r"foreign\.npz: not an opgrad checkpoint"):
        load_checkpoint(foreign)
    with pytest.raises(CheckpointError, match=r"absent\.npz: checkpoint file not found"):
        load_checkpoint(tmp_path / "absent.npz")
    fixtures = Path(__file__).parent / "fixtures"
    for model_file in (fixtures / "onnx_mlp.onnx", fixtures / "keras" / "mnist_cnn.keras"):
        with pytest.raises(CheckpointError, match=rf"a \{model_file.suffix} model becomes a checkpoint with "
                                                  rf"`opgrad import .*{model_file.name} --save MODEL\.npz`"):
            load_checkpoint(model_file)
    objects = tmp_path / "objects.npz"
    np.savez(objects, w=np.array([{"a": 1}], dtype=object))
    with pytest.raises(CheckpointError, match=r"objects\.npz: w holds Python objects \(an object array, stored as "
                                              r"a pickle\); opgrad loads no pickles"):
        load_checkpoint(objects)


def test_garbage_zip_member(tmp_path: Path) -> None:
    p = tmp_path / "ckpt.npz"
    with zipfile.ZipFile(p, "w") as zf:
        zf.writestr("w.npy", b"\x93NUMPY garbage")
    with pytest.raises(CheckpointError, match=r"ckpt\.npz: corrupt or truncated checkpoint"):
        load_checkpoint(p)


def test_save_rejects_bad_input(tmp_path: Path) -> None:
    p = tmp_path / "ckpt.npz"
    with pytest.raises(CheckpointError, match=r"'__meta__' is reserved"):
        save_checkpoint(p, {"__meta__": np.ones(1)}, {})
    with pytest.raises(CheckpointError, match=r"obj: dtype object"):
        save_checkpoint(p, {"obj": np.array([{}, 1], dtype=object)}, {})
    with pytest.raises(CheckpointError, match=r"metadata is not JSON-serialisable"):
        save_checkpoint(p, {"w": np.ones(1)}, {"when": object()})
    assert not p.exists()


def test_errors_are_value_errors() -> None:
    assert issubclass(CheckpointError, ValueError)


def test_a_symbolic_link_is_written_through_and_stays_a_link(tmp_path: Path) -> None:
    # As open(), np.save and torch.save: the link's target gets the new contents.
    (tmp_path / "runs").mkdir()
    real = tmp_path / "runs" / "target.npz"
    save_checkpoint(real, {"w": np.zeros(2, np.float32)}, {"step": 1})
    link = tmp_path / "latest.npz"
    link.symlink_to(real)
    save_checkpoint(link, {"w": np.ones(2, np.float32)}, {"step": 2})
    assert link.is_symlink() and os.readlink(link) == str(real)
    arrays, meta = load_checkpoint(real)
    np.testing.assert_array_equal(arrays["w"], np.ones(2))
    assert meta["step"] == 2
    dangling = tmp_path / "dangling.npz"
    dangling.symlink_to(tmp_path / "runs" / "new.npz")
    save_checkpoint(dangling, {"w": np.ones(2, np.float32)}, {})
    assert dangling.is_symlink() and (tmp_path / "runs" / "new.npz").is_file()


def test_a_fifo_or_device_is_written_in_place_not_replaced(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()))
    reader.start()
    save_checkpoint(fifo, {"w": np.ones(3, np.float32)}, {})
    reader.join(timeout=30)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert received and received[0].startswith(b"PK")
    save_checkpoint("/dev/null", {"w": np.ones(3, np.float32)}, {})
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
