"""Corrupt files are refused with one error that names the file, never with a library's exception.

Checkpoints (``CheckpointError``): a bit flipped at every position of a small checkpoint, the
damage kinds that used to escape as numpy's and zipfile's own exceptions, and crafted members
whose CRC-32 is right but whose contents are not. Model imports (``KerasImportError`` for
``.keras``/``.h5``, ``OnnxError`` for ``.onnx``): seeded byte flips and truncations of every
fixture, names that are not UTF-8, and directories given where a model file is expected.
"""

from __future__ import annotations

import io
import re
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from optional import require

from opgrad import cli
from opgrad.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

FIXTURES = Path(__file__).parent / "fixtures"
META = {"epoch": 2, "step": 40, "model": "tiny"}


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """The exit status and the stderr of ``opgrad ARGV``, which must be one line without a traceback."""
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return code, err.strip()


# ----- checkpoints -----


def _small_checkpoint(path: Path) -> dict[str, np.ndarray]:
    """Save a checkpoint whose first array is larger than the 4 KiB zipfile reads at a time.

    numpy parses that member's header before anything reads to the member's end, which is where
    zipfile checks the CRC-32: damage to the header reaches numpy's parser unless the loader
    checks the CRC-32 first.
    """
    rng = np.random.default_rng(0)
    arrays: dict[str, np.ndarray] = {
        "fc.weight": rng.standard_normal((16, 80)).astype(np.float32),
        "fc.bias": rng.standard_normal(16).astype(np.float32),
        "optim/step": np.array(40, dtype=np.int64),
    }
    save_checkpoint(path, arrays, META)
    return arrays


def _array_data_positions(data: bytes, arrays: dict[str, np.ndarray]) -> set[int]:
    """The byte positions of the arrays' raw data in ``data`` (stored uncompressed, so findable)."""
    positions: set[int] = set()
    for array in arrays.values():
        raw = array.tobytes()
        start = data.find(raw)
        assert start >= 0
        positions.update(range(start, start + len(raw)))
    return positions


def test_a_bit_flip_anywhere_loads_the_same_arrays_or_raises_checkpoint_error(tmp_path: Path) -> None:
    """Every bit of every byte outside the arrays' data, and one bit of every byte inside it."""
    path = tmp_path / "ckpt.npz"
    arrays = _small_checkpoint(path)
    data = path.read_bytes()
    array_data = _array_data_positions(data, arrays)
    outcomes = {"same": 0, "refused": 0}
    for position in range(len(data)):
        masks = [1 << (position % 8)] if position in array_data else [1 << bit for bit in range(8)]
        for mask in masks:
            damaged = bytearray(data)
            damaged[position] ^= mask
            path.write_bytes(damaged)
            try:
                loaded, meta = load_checkpoint(path)
            except CheckpointError as exc:
                assert str(exc).startswith(f"{path}: ") and "\n" not in str(exc), str(exc)
                outcomes["refused"] += 1
                continue
            except Exception as exc:
                pytest.fail(f"flipping bit {mask:#04x} of byte {position} raised {type(exc).__module__}."
                            f"{type(exc).__qualname__}: {exc}")
            # A flip in a field nothing reads (a timestamp, "version made by") changes nothing.
            assert meta == META and loaded.keys() == arrays.keys(), (position, mask)
            for name, array in arrays.items():
                assert loaded[name].dtype == array.dtype, (position, mask, name)
                np.testing.assert_array_equal(loaded[name], array)
            outcomes["same"] += 1
    assert outcomes["refused"] > 0 and outcomes["same"] > 0, outcomes


def _flip_npy_header_brace(data: bytearray) -> None:
    # '}' -> '|' leaves the header dict of the first member unclosed: numpy's parser raises
    # tokenize.TokenError ("EOF in multi-line statement").
    start = data.find(b"{'descr'")
    data[data.find(b"}", start)] ^= 0x01


def _central_directory_entry(data: bytearray) -> int:
    return data.find(b"PK\x01\x02")


def _flip_zip_version(data: bytearray) -> None:
    # "version needed to extract" far above what zipfile reads: NotImplementedError.
    data[_central_directory_entry(data) + 6] ^= 0x80


def _flip_encryption_flag(data: bytearray) -> None:
    # General purpose flag bit 0 marks the member encrypted: RuntimeError ("password required").
    data[_central_directory_entry(data) + 8] ^= 0x01


@pytest.mark.parametrize("damage", [_flip_npy_header_brace, _flip_zip_version, _flip_encryption_flag],
                         ids=["npy header (TokenError)", "zip version (NotImplementedError)",
                              "encryption flag (RuntimeError)"])
def test_damage_that_escaped_as_library_errors_is_a_checkpoint_error(
        tmp_path: Path, damage: Callable[[bytearray], None]) -> None:
    path = tmp_path / "ckpt.npz"
    _small_checkpoint(path)
    data = bytearray(path.read_bytes())
    damage(data)
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(path))}: corrupt or truncated checkpoint \(.+\)$"):
        load_checkpoint(path)


def _npy(header: str, payload: bytes = b"") -> bytes:
    """A version 1.0 ``.npy`` file with ``header`` as is (padded like numpy's) and ``payload``."""
    text = header.encode("latin1")
    text += b" " * (-(len(text) + 11) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text + payload


#: Members numpy fails on in turn with tokenize.TokenError, ValueError, MemoryError, OverflowError and
#: ValueError (pickle refused), and archives that are not what save_checkpoint writes.
CRAFTED = {
    "unclosed header": [("w.npy", _npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), "))],
    "header syntax": [("w.npy", _npy("{'descr': '<f4' 'fortran_order': False, 'shape': (2,), }"))],
    "absurd shape": [("w.npy", _npy("{'descr': '<f8', 'fortran_order': False, 'shape': (1099511627776, 1024), }"))],
    "overflowing shape": [("w.npy", _npy(f"{{'descr': '<f4', 'fortran_order': False, 'shape': ({2**70},), }}"))],
    "object dtype": [("w.npy", _npy("{'descr': '|O', 'fortran_order': False, 'shape': (1,), }", b"\x80\x04N."))],
    "not an array": [("w.txt", b"hello")],
    "two entries of one name": [("w.npy", _npy("{'descr': '<f4', 'fortran_order': False, 'shape': (0,), }"))] * 2,
}


@pytest.mark.filterwarnings("ignore:Duplicate name:UserWarning")
@pytest.mark.parametrize("case", list(CRAFTED))
def test_members_with_a_valid_crc_but_bad_contents_are_refused(tmp_path: Path, case: str) -> None:
    """Damage the CRC-32 cannot see (a file made so): still one CheckpointError, nothing unpickled."""
    path = tmp_path / "crafted.npz"
    with zipfile.ZipFile(path, "w") as archive:
        for name, content in CRAFTED[case]:
            archive.writestr(name, content)
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(path))}: "):
        load_checkpoint(path)


def _corrupt_header_checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt.npz"
    _small_checkpoint(path)
    data = bytearray(path.read_bytes())
    _flip_npy_header_brace(data)
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("command", [
    ["export-onnx", "{ckpt}", "{tmp}/out.onnx"],
    ["predict", "--checkpoint", "{ckpt}", "--images", "{tmp}/images.npy"],
    ["train", "--resume", "{ckpt}", "--backend", "reference", "--max-steps", "1"],
    ["train", "--init", "{ckpt}", "--backend", "reference", "--max-steps", "1"],
    ["export", "--checkpoint", "{ckpt}", "{tmp}/lib"],
    ["bench", "--checkpoint", "{ckpt}"],
], ids=lambda argv: " ".join(argv[:2]))
def test_every_command_that_reads_a_checkpoint_reports_a_corrupt_one_in_one_line(
        tmp_path: Path, command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = _corrupt_header_checkpoint(tmp_path)
    np.save(tmp_path / "images.npy", np.zeros((2, 1, 28, 28), np.float32))
    argv = [part.format(ckpt=ckpt, tmp=tmp_path) for part in command]
    code, err = _cli(argv, capsys)
    assert code == 2 and err.startswith(f"opgrad {argv[0]}: error: {ckpt}: corrupt or truncated checkpoint"), err


# ----- model imports -----


def _keras_error() -> type[Exception]:
    require("h5py", "opgrad.keras reads Keras files' HDF5 weights with h5py (the interop extra)")
    from opgrad.keras import KerasImportError

    return KerasImportError


def _onnx_error() -> type[Exception]:
    require("onnx", "the ONNX importer reads files with it (pip install 'opgrad[interop]')")
    from opgrad.onnx import OnnxError

    return OnnxError


def _rezip_with_member_damaged(data: bytes, rng: np.random.Generator) -> bytes:
    """The ``.keras`` zip in ``data`` with bytes of one member changed and valid CRCs, so that the
    damage reaches the JSON or HDF5 reader rather than zipfile."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as source, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as target:
        members = source.infolist()
        victim = members[int(rng.integers(len(members)))].filename
        for info in members:
            content = bytearray(source.read(info))
            if info.filename == victim and content:
                for _ in range(int(rng.integers(1, 4))):
                    content[int(rng.integers(len(content)))] ^= int(rng.integers(1, 256))
            target.writestr(info.filename, bytes(content))
    return out.getvalue()


def _damaged_copies(data: bytes, suffix: str, rng: np.random.Generator, count: int) -> Iterator[tuple[str, bytes]]:
    """``count`` damaged versions of ``data`` with what was done to each: one to three bytes
    changed, a truncation, or (for a ``.keras`` zip) bytes changed inside one of its members."""
    for case in range(count):
        kind = case % 4
        if kind == 3:
            size = int(rng.integers(len(data)))
            yield f"truncated to {size} bytes", data[:size]
        elif kind == 2 and suffix == ".keras":
            yield "a member's bytes changed", _rezip_with_member_damaged(data, rng)
        else:
            damaged = bytearray(data)
            changes = []
            for _ in range(int(rng.integers(1, 4))):
                position, mask = int(rng.integers(len(data))), int(rng.integers(1, 256))
                damaged[position] ^= mask
                changes.append(f"byte {position} ^= {mask:#04x}")
            yield ", ".join(changes), bytes(damaged)


IMPORT_FIXTURES = sorted(
    str(path.relative_to(FIXTURES)) for path in [*FIXTURES.glob("*.onnx"), *(FIXTURES / "keras").glob("*")]
    if path.suffix in (".onnx", ".keras", ".h5"))


@pytest.mark.parametrize("name", IMPORT_FIXTURES)
def test_damaged_model_files_import_or_raise_the_importers_error(tmp_path: Path, name: str) -> None:
    # The HDF5 C library itself crashes or loops forever on a few damaged files (about 1 in 4000
    # of these damages: mnist_cnn_keras2.h5 with byte 1009 set to 0xCB crashes, mnist_cnn.h5 with
    # byte 6656 set to 0xD3 loops, both while reading the model_config attribute), which no Python
    # code can catch; these seeds draw none of them.
    source = FIXTURES / name
    suffix = source.suffix
    if suffix == ".onnx":
        from opgrad.onnx import load

        error = _onnx_error()
    else:
        from opgrad.keras import load

        error = _keras_error()
    path = tmp_path / f"damaged{suffix}"
    outcomes = {"loaded": 0, "refused": 0}
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    for what, damaged in _damaged_copies(source.read_bytes(), suffix, rng, 160):
        path.write_bytes(damaged)
        try:
            load(path)
        except error as exc:
            assert str(exc).startswith(f"{path}: "), (what, str(exc))
            outcomes["refused"] += 1
            continue
        except Exception as exc:
            pytest.fail(f"{name} with {what}: {type(exc).__module__}.{type(exc).__qualname__}: {exc}")
        outcomes["loaded"] += 1
    assert outcomes["refused"] > 0, outcomes


def _onnx_with_undecodable_input_name(tmp_path: Path) -> Path:
    data = (FIXTURES / "onnx_mlp.onnx").read_bytes()
    assert b"images" in data
    path = tmp_path / "names.onnx"
    path.write_bytes(data.replace(b"images", b"im\xffges"))
    return path


def test_onnx_names_that_are_not_utf8_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    error = _onnx_error()
    from opgrad.onnx import load

    path = _onnx_with_undecodable_input_name(tmp_path)
    message = rf"^{re.escape(str(path))}: corrupt ONNX file: model\.graph\..* is not valid UTF-8 text"
    with pytest.raises(error, match=message):
        load(path)
    code, err = _cli(["import", str(path), "--save", str(tmp_path / "out.npz")], capsys)
    assert code == 2 and err.startswith(f"opgrad import: error: {path}: corrupt ONNX file"), err


def test_onnx_shape_arithmetic_out_of_range_is_refused(tmp_path: Path) -> None:
    """Gather of index 7 from the shape of a rank-2 input (what a damaged index turns into)."""
    error = _onnx_error()
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from opgrad.onnx import load

    graph = helper.make_graph(
        [helper.make_node("Shape", ["x"], ["s"], name="shape"),
         helper.make_node("Gather", ["s", "i"], ["g"], name="gather"),
         helper.make_node("Reshape", ["x", "g"], ["y"], name="reshape")],
        "case", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(np.array([7], np.int64), "i")])
    path = tmp_path / "gather.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    message = rf"^{re.escape(str(path))}: node 'gather' \(Gather\): cannot evaluate it on its constant inputs: " \
              "IndexError"
    with pytest.raises(error, match=message):
        load(path)


@pytest.mark.parametrize("directory", ["model.onnx", "model.keras", "model.h5", "models"])
def test_a_directory_given_as_the_model_file_is_named_as_one(tmp_path: Path, directory: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / directory
    path.mkdir()
    code, err = _cli(["import", str(path), "--save", str(tmp_path / "out.npz")], capsys)
    assert code == 2 and err == f"opgrad import: error: {path}: is a directory, expected a model file " \
                                "(.onnx, .keras, .h5)", err


def test_the_keras_api_names_a_directory_as_one(tmp_path: Path) -> None:
    error = _keras_error()
    from opgrad.keras import load

    with pytest.raises(error, match=rf"^{re.escape(str(tmp_path))}: is a directory, expected a Keras model file"):
        load(tmp_path)
