"""opgrad export: the C example trains to the Python compiled step's losses (host, and AArch64 under
QEMU), the Android object is an AArch64 ELF, and the C runtime reports every misuse as an error code.

The cross-building tests need ``aarch64-linux-gnu-gcc`` and ``qemu-aarch64`` (Debian:
``apt-get install gcc-aarch64-linux-gnu qemu-user``; ``.ci/run`` installs them). Without them a local
run skips with the reason; in CI (``CI=true``) they fail, so they can never silently stop running.
"""

from __future__ import annotations

import ctypes
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
import threading
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import opgrad
from opgrad import cli, nn
from opgrad.checkpoint import load_checkpoint, save_checkpoint
from opgrad.deploy import ExportError

ROOT = Path(__file__).resolve().parents[1]
BATCH = 8


def _require(*tools: str) -> None:
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        reason = f"{', '.join(missing)} not installed (Debian: apt-get install gcc-aarch64-linux-gnu qemu-user)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}; CI must run this test (.ci/run installs them)")
        print(f"skipping: {reason}")
        pytest.skip(reason)


def _doc_block(marker: str) -> list[str]:
    """The commands of the ```bash block after the HTML comment naming ``marker`` in deployment.md."""
    text = (ROOT / "docs" / "deployment.md").read_text()
    after = text.split(f"({marker})", 1)[1]
    block = after.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def _run_doc(lines: list[str], build: str, tmp: Path, replace: dict[str, str] | None = None) -> str:
    """Run the doc's commands from the repository root, ``build`` redirected into ``tmp``."""
    out = []
    for line in lines:
        for old, new in (replace or {}).items():
            line = line.replace(old, new)
        line = line.replace(build, str(tmp)).replace(".venv/bin/", str(Path(sys.executable).parent) + "/")
        result = subprocess.run(shlex.split(line), cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{line}\n{result.stdout}\n{result.stderr}"
        out.append(result.stdout)
    return "".join(out)


def _losses(output: str) -> np.ndarray:
    return np.array([float(m) for m in re.findall(r"^step \d+ loss (\S+)$", output, re.M)], np.float32)


@pytest.fixture(scope="module")
def python_losses() -> np.ndarray:
    """The Python compiled step's losses on the example's data: 20 Adam steps at lr 1e-3 from seed 0."""
    from opgrad.data import load_embedded_mnist

    data = load_embedded_mnist()
    model, opt = nn.seed_cnn(), nn.Adam()
    params = model.init_params(0)
    step = nn.TrainStep(model, opt, batch_size=BATCH, backend="llvm")
    n = 20 * BATCH
    return step.run_steps(data.train_images[:n], data.train_labels[:n], params, opt.init_state(params), 1e-3).losses


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The quick start of docs/deployment.md, run as written; returns (directory, the example's output)."""
    _require("cc")
    tmp = tmp_path_factory.mktemp("export-host")
    return tmp, _run_doc(_doc_block("test_docs_quick_start"), "build/export", tmp)


def test_docs_quick_start(host: tuple[Path, str], python_losses: np.ndarray) -> None:
    tmp, output = host
    losses = _losses(output)
    assert len(losses) == 20
    np.testing.assert_allclose(losses, python_losses, rtol=1e-6, atol=0)
    assert losses[-5:].mean() < losses[:5].mean()
    assert "accuracy on the first 8 training digits" in output and "ms/step" in output
    arrays, meta = load_checkpoint(tmp / "trained.npz")  # the C-written checkpoint passes Python's checks
    assert (meta["step"], meta["model"], meta["optimizer"]) == (20, "seed-cnn", nn.Adam().describe())
    trainer = nn.Trainer(nn.seed_cnn(), nn.Adam(), batch_size=BATCH)
    trainer.restore(arrays, meta)  # what opgrad train --resume does
    assert trainer.step == 20
    for file in ("opgrad.h", "opgrad_runtime.c", "opgrad_kernels.o", "opgrad.o", "libopgrad.a", "libopgrad.so",
                 "opgrad_init.npz"):
        assert (tmp / file).stat().st_size > 0, file


def test_shared_library_and_object_link_and_agree(host: tuple[Path, str], python_losses: np.ndarray) -> None:
    tmp, _ = host
    for kind, lib in (("so", tmp / "libopgrad.so"), ("o", tmp / "opgrad.o")):
        exe = tmp / f"train-{kind}"
        subprocess.run(["cc", "-std=c11", "-O2", "-I", str(tmp), str(ROOT / "examples/export_c/train.c"), str(lib),
                        "-lm", "-pthread", "-o", str(exe)], check=True)
        run = subprocess.run([str(exe), str(tmp), "6", "4"], capture_output=True, text=True,
                             env={**os.environ, "LD_LIBRARY_PATH": str(tmp), "OPGRAD_NUM_THREADS": "1"})
        assert run.returncode == 0, run.stderr
        np.testing.assert_array_equal(_losses(run.stdout), python_losses[:6])  # thread count changes nothing
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(tmp / "libopgrad.so")], capture_output=True,
                             text=True).stdout if shutil.which("nm") else ""
    if symbols:
        exported = sorted(line.split()[-1] for line in symbols.splitlines() if " T " in line)
        assert all(name.startswith("opgrad_") for name in exported) and "opgrad_train_steps" in exported
        assert not any("graph" in name or "parallel_for" in name for name in exported)


def test_runtime_and_example_compile_without_warnings(host: tuple[Path, str]) -> None:
    tmp, _ = host
    for source in (tmp / "opgrad_runtime.c", ROOT / "examples/export_c/train.c"):
        subprocess.run(["cc", "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-pedantic", "-fPIC", "-I", str(tmp),
                        "-c", str(source), "-o", str(tmp / "strict.o")], check=True)


# ----- the C runtime's errors, through ctypes on the shared library -----


def c_library(path: Path, prefix: str = "opgrad") -> ctypes.CDLL:
    """The exported shared library at ``path`` with its C API's prototypes (``prefix`` is the
    export's ``--name``), for a model without dropout (four streamed arrays per training call)."""
    so = ctypes.CDLL(str(path))
    vp, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int

    def fn(name: str) -> Any:
        return getattr(so, f"{prefix}_{name}")

    fn("model_create").restype = vp
    fn("model_free").argtypes = [vp]
    fn("last_error").restype = ctypes.c_char_p
    fn("last_error").argtypes = [vp]
    fn("train_steps").argtypes = [vp, i64, vp, vp, vp, vp, i32]
    fn("train_step").argtypes = [vp, vp, vp, ctypes.c_float, vp, i32]
    fn("eval").argtypes = [vp, vp, vp]
    fn("model_load").argtypes = [vp, ctypes.c_char_p]
    fn("model_save").argtypes = [vp, ctypes.c_char_p]
    fn("model_step").argtypes = [vp]
    fn("model_step").restype = i64
    fn("model_set_epoch").argtypes = [vp, i64]
    fn("model_array").argtypes = [vp, ctypes.c_char_p, ctypes.POINTER(i64)]
    fn("model_array").restype = ctypes.POINTER(ctypes.c_float)
    return so


@pytest.fixture(scope="module")
def lib(host: tuple[Path, str]) -> ctypes.CDLL:
    tmp, _ = host
    return c_library(tmp / "libopgrad.so")


OK, ERR_NULL, ERR_ARGUMENT, ERR_LABEL, ERR_NAN, ERR_IO, ERR_FORMAT = range(7)


class Model:
    """A model of the exported library, loaded with the export's initial weights."""

    def __init__(self, lib: ctypes.CDLL, directory: Path) -> None:
        self.lib, self.handle = lib, lib.opgrad_model_create()
        assert self.handle
        assert lib.opgrad_model_load(self.handle, str(directory / "opgrad_init.npz").encode()) == OK, self.error

    @property
    def error(self) -> str:
        return self.lib.opgrad_last_error(self.handle).decode()

    def steps(self, images: np.ndarray, labels: np.ndarray, lrs: np.ndarray, flags: int = 0) -> tuple[int, np.ndarray]:
        losses = np.full(len(lrs), -1.0, np.float32)
        rc = self.lib.opgrad_train_steps(self.handle, len(lrs), images.ctypes.data, labels.ctypes.data,
                                         lrs.ctypes.data, losses.ctypes.data, flags)
        return rc, losses

    def array(self, name: str) -> np.ndarray:
        count = ctypes.c_int64()
        ptr = self.lib.opgrad_model_array(self.handle, name.encode(), ctypes.byref(count))
        assert ptr, self.error
        return np.ctypeslib.as_array(ptr, (count.value,)).copy()

    def __del__(self) -> None:
        self.lib.opgrad_model_free(self.handle)


def _batches(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    from opgrad.data import load_embedded_mnist

    data = load_embedded_mnist()
    return (np.ascontiguousarray(data.train_images[: n * BATCH]), data.train_labels[: n * BATCH].copy(),
            np.full(n, 1e-3, np.float32))


def test_c_errors_are_codes_with_messages(lib: ctypes.CDLL, host: tuple[Path, str],
                                          python_losses: np.ndarray) -> None:
    tmp, _ = host
    x, y, lrs = _batches(4)
    assert lib.opgrad_train_steps(None, 1, x.ctypes.data, y.ctypes.data, lrs.ctypes.data, lrs.ctypes.data, 0) \
        == ERR_NULL
    assert b"NULL" in lib.opgrad_last_error(None)
    assert lib.opgrad_model_load(None, b"x.npz") == ERR_NULL and lib.opgrad_model_save(None, b"x.npz") == ERR_NULL
    assert lib.opgrad_model_step(None) == -1
    m = Model(lib, tmp)
    losses = np.zeros(4, np.float32)
    assert lib.opgrad_train_steps(m.handle, 4, None, y.ctypes.data, lrs.ctypes.data, losses.ctypes.data, 0) == ERR_NULL
    assert m.error == "opgrad_train_steps: images is NULL"
    assert lib.opgrad_train_steps(m.handle, 4, x.ctypes.data, y.ctypes.data, lrs.ctypes.data, None, 0) == ERR_NULL
    assert lib.opgrad_eval(m.handle, x.ctypes.data, None) == ERR_NULL and "logits is NULL" in m.error
    assert lib.opgrad_train_steps(m.handle, -1, x.ctypes.data, y.ctypes.data, lrs.ctypes.data, losses.ctypes.data,
                                  0) == ERR_ARGUMENT
    assert "steps must be >= 0, got -1" in m.error
    assert lib.opgrad_train_steps(m.handle, 1, x.ctypes.data, y.ctypes.data + 4, lrs.ctypes.data,
                                  losses.ctypes.data, 0) == ERR_ARGUMENT
    assert m.error == "opgrad_train_steps: labels is not aligned to 8 bytes (its element size)"
    assert m.steps(x, y, lrs, flags=8)[0] == ERR_ARGUMENT and "unknown flags 0x8" in m.error
    assert not lib.opgrad_model_array(m.handle, b"nope", None)
    assert "no parameter or state array named 'nope'" in m.error
    assert lib.opgrad_model_step(m.handle) == 0  # nothing ran

    bad = y.copy()
    bad[2 * BATCH + 3] = 10  # step 2, row 3: one past the 10 classes
    rc, losses = m.steps(x, bad, lrs)
    assert rc == ERR_LABEL
    assert m.error == ("opgrad_train_steps: labels[19] = 10 (step 2, row 3 of its batch) is out of range [0, 10) for "
                       "input 'labels' of softmax_cross_entropy; steps 2.. did not run (2 done)")
    assert lib.opgrad_model_step(m.handle) == 2
    np.testing.assert_array_equal(losses[:2], python_losses[:2])
    assert (losses[2:] == -1.0).all()  # the steps from the bad one on never ran
    bad[19] = -3
    assert m.steps(x, bad, lrs)[0] == ERR_LABEL and "= -3" in m.error


def test_c_stop_on_nan_keeps_the_parameters_before_that_step(lib: ctypes.CDLL, host: tuple[Path, str]) -> None:
    tmp, _ = host
    x, y, lrs = _batches(3)
    one = Model(lib, tmp)
    assert one.steps(x[:BATCH], y[:BATCH], lrs[:1])[0] == OK
    nan = x.copy()
    nan[BATCH + 5, 0, 10, 10] = np.nan
    stopped = Model(lib, tmp)
    rc, losses = stopped.steps(nan, y, lrs, flags=1)
    assert rc == ERR_NAN and "the loss is NaN or infinite at step 1" in stopped.error
    assert "the parameters are those after step 0 of this call" in stopped.error
    assert np.isfinite(losses[0]) and np.isnan(losses[1]) and losses[2] == -1.0
    assert lib.opgrad_model_step(stopped.handle) == 1
    for name in ("conv1.weight", "dense1.bias", "conv3.weight/m", "adam/beta1_power"):
        np.testing.assert_array_equal(stopped.array(name), one.array(name), err_msg=name)
    first = Model(lib, tmp)
    rc, _ = first.steps(nan[BATCH:], y[BATCH:], lrs[1:], flags=1)  # the NaN batch comes first
    assert rc == ERR_NAN and "at step 0; stopped there" in first.error and "unchanged by this call" in first.error
    assert lib.opgrad_model_step(first.handle) == 0
    flowing = Model(lib, tmp)
    rc, losses = flowing.steps(nan, y, lrs)  # without the flag NaN flows on, as in Python
    assert rc == OK and np.isnan(losses[1:]).all()


def test_c_checkpoint_load_errors_and_round_trip(lib: ctypes.CDLL, host: tuple[Path, str], tmp_path: Path) -> None:
    tmp, _ = host
    m = Model(lib, tmp)
    x, y, lrs = _batches(2)
    assert m.steps(x, y, lrs)[0] == OK
    assert lib.opgrad_model_set_epoch(m.handle, 3) == OK
    saved = tmp_path / "c.npz"
    assert lib.opgrad_model_save(m.handle, str(saved).encode()) == OK, m.error
    assert not list(tmp_path.glob("*.tmp"))
    back = Model(lib, tmp)
    assert lib.opgrad_model_load(back.handle, str(saved).encode()) == OK, back.error
    assert lib.opgrad_model_step(back.handle) == 2
    for name in ("conv2.weight", "conv2.weight/v", "adam/beta2_power"):
        np.testing.assert_array_equal(back.array(name), m.array(name), err_msg=name)
    arrays, meta = load_checkpoint(saved)
    assert meta["epoch"] == 3 and meta["step"] == 2

    def load_error(path: Path) -> tuple[int, str]:
        rc = lib.opgrad_model_load(back.handle, str(path).encode())
        return rc, back.error

    assert load_error(tmp_path / "missing.npz") == (
        ERR_IO, f"{tmp_path / 'missing.npz'}: cannot open checkpoint: No such file or directory")
    blob = saved.read_bytes()
    (tmp_path / "short.npz").write_bytes(blob[: len(blob) // 2])
    rc, message = load_error(tmp_path / "short.npz")
    assert rc == ERR_FORMAT and "truncated" in message
    flipped = bytearray(blob)
    flipped[len(blob) // 3] ^= 0x10
    (tmp_path / "flipped.npz").write_bytes(bytes(flipped))
    rc, message = load_error(tmp_path / "flipped.npz")
    assert rc == ERR_FORMAT and ("CRC-32" in message or "checksum" in message or "malformed" in message), message
    (tmp_path / "empty.npz").write_bytes(b"")
    assert load_error(tmp_path / "empty.npz")[0] == ERR_FORMAT
    wrong = dict(arrays)
    wrong["conv1.weight"] = np.zeros((16, 1, 3, 3), np.float32)
    save_checkpoint(tmp_path / "shape.npz", wrong, meta)
    assert load_error(tmp_path / "shape.npz") == (
        ERR_FORMAT, f"{tmp_path / 'shape.npz'}: conv1.weight: checkpoint has shape (16, 1, 3, 3), model expects "
                    "(32, 1, 3, 3)")
    save_checkpoint(tmp_path / "other.npz", arrays, {**meta, "model": "keras-mnist"})
    assert "is of model 'keras-mnist'" in load_error(tmp_path / "other.npz")[1]
    with zipfile.ZipFile(tmp_path / "deflated.npz", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("a.npy", b"x" * 100)
    assert "compressed (zip method 8)" in load_error(tmp_path / "deflated.npz")[1]
    # A zip64 size chosen so that offset + size wraps around 2**64: refused, never read.
    eocd = blob.rfind(b"PK\x05\x06")
    cd = struct.unpack_from("<I", blob, eocd + 16)[0]
    nlen = struct.unpack_from("<H", blob, cd + 28)[0]
    local = struct.unpack_from("<I", blob, cd + 42)[0]
    data = local + 30 + sum(struct.unpack_from("<HH", blob, local + 26))
    huge = (1 << 64) - data + 8
    entry = bytearray(blob[cd:cd + 46 + nlen])
    struct.pack_into("<II", entry, 20, 0xFFFFFFFF, 0xFFFFFFFF)
    struct.pack_into("<H", entry, 30, 20)
    entry += struct.pack("<HHQQ", 1, 16, huge, huge)
    (tmp_path / "wrapped.npz").write_bytes(blob[:cd] + bytes(entry) + blob[cd + 46 + nlen:])
    rc, message = load_error(tmp_path / "wrapped.npz")
    assert rc == ERR_FORMAT and "runs past the end" in message, message
    assert load_error(tmp_path) == (ERR_IO, f"{tmp_path}: cannot read checkpoint: not a regular file")
    params_only = {k: v for k, v in arrays.items() if "/" not in k}
    momentum = {**params_only, **{f"{k}/velocity": np.zeros_like(v) for k, v in params_only.items()}}
    save_checkpoint(tmp_path / "momentum.npz", momentum, {**meta, "optimizer": "sgd(momentum=0.9)"})
    assert load_error(tmp_path / "momentum.npz") == (
        ERR_FORMAT, f"{tmp_path / 'momentum.npz'}: checkpoint was trained with 'sgd(momentum=0.9)'; this library "
                    "uses 'adam(beta1=0.9, beta2=0.999, eps=1e-08)' (its state has no array conv1.bias/velocity); "
                    "export it with that optimizer (opgrad export --optimizer)")
    save_checkpoint(tmp_path / "params.npz", params_only, meta)  # accepted: the optimizer state is reset
    assert load_error(tmp_path / "params.npz")[0] == OK
    np.testing.assert_array_equal(back.array("adam/beta1_power"), [1.0])
    np.testing.assert_array_equal(back.array("conv1.weight"), arrays["conv1.weight"].reshape(-1))


# ----- the other targets -----


def test_docs_aarch64(python_losses: np.ndarray, tmp_path: Path) -> None:
    _require("aarch64-linux-gnu-gcc", "qemu-aarch64")
    lines = _doc_block("test_docs_aarch64")
    fewer = {"--steps 20": "--steps 5", "build/aarch64 20 5": "build/aarch64 5 5"}  # QEMU is slow: 5 steps
    output = _run_doc(lines, "build/aarch64", tmp_path, fewer)
    header = subprocess.run(["readelf", "-h", str(tmp_path / "train")], capture_output=True, text=True).stdout \
        if shutil.which("readelf") else (tmp_path / "train").read_bytes()[:20].hex()
    assert "AArch64" in header or header[36:40] == "b700"
    losses = _losses(output)
    assert len(losses) == 5
    np.testing.assert_allclose(losses, python_losses[:5], rtol=1e-5, atol=0)


def _elf_header(path: Path) -> dict[str, int]:
    raw = path.read_bytes()[:64]
    assert raw[:4] == b"\x7fELF", f"{path} is not an ELF file"
    return {"class": raw[4], "data": raw[5], "type": int.from_bytes(raw[16:18], "little"),
            "machine": int.from_bytes(raw[18:20], "little")}


def test_docs_android(tmp_path: Path) -> None:
    lines = _doc_block("test_docs_android")
    _run_doc(lines[:1], "build/android", tmp_path)
    kernels = tmp_path / "opgrad_kernels.o"
    assert _elf_header(kernels) == {"class": 2, "data": 1, "type": 1, "machine": 183}  # ELF64, LE, REL, AArch64
    assert not (tmp_path / "libopgrad.so").exists()
    assert (tmp_path / "opgrad.h").exists() and (tmp_path / "opgrad_runtime.c").exists()
    if shutil.which("readelf"):
        out = _run_doc(lines[1:], "build/android", tmp_path)
        assert "AArch64" in out and "REL (Relocatable file)" in out
        for symbol in ("opgrad_train_graph", "opgrad_train_graph_steps", "opgrad_eval_graph"):
            assert re.search(rf"FUNC\s+GLOBAL\s+HIDDEN\s+\d+\s+{symbol}$", out, re.M), symbol
        assert re.search(r"NOTYPE\s+GLOBAL\s+DEFAULT\s+UND\s+opgrad_parallel_for$", out, re.M)
    if shutil.which("aarch64-linux-gnu-gcc"):  # the runtime is plain C11 + POSIX: it compiles for AArch64
        subprocess.run(["aarch64-linux-gnu-gcc", "-std=c11", "-O2", "-fPIC", "-Wall", "-Wextra", "-Werror", "-I",
                        str(tmp_path), "-c", str(tmp_path / "opgrad_runtime.c"), "-o", str(tmp_path / "rt.o")],
                       check=True)


# ----- options and misuse -----


def test_named_single_threaded_keras_export_with_masks_matches_python(tmp_path: Path) -> None:
    """--name renames every symbol; --threads 1 drops pthreads; dropout masks are stream arguments."""
    _require("cc")
    result = opgrad.export(tmp_path, model="keras-mnist", optimizer="sgd", batch_size=4, threads=1, name="keras")
    header = (tmp_path / "keras.h").read_text()
    assert "const float *mask_dropout1" in header and "#define KERAS_MASK_DROPOUT1_SIZE 9216" in header
    assert "int keras_train_steps(" in header and "opgrad_model" not in header and "OPGRAD_OK" not in header
    assert "#define OG_MAX_THREADS 1" in (tmp_path / "keras_runtime.c").read_text()
    subprocess.run(["cc", "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-fPIC", "-I", str(tmp_path), "-c",
                    str(tmp_path / "keras_runtime.c"), "-o", str(tmp_path / "rt.o")], check=True)
    if shutil.which("nm"):
        undefined = subprocess.run(["nm", "-u", str(tmp_path / "rt.o")], capture_output=True, text=True).stdout
        assert "pthread" not in undefined
    so = ctypes.CDLL(str(result.files["shared"]))
    so.keras_model_create.restype = ctypes.c_void_p
    so.keras_model_load.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    so.keras_train_steps.argtypes = [ctypes.c_void_p, ctypes.c_int64, *([ctypes.c_void_p] * 6), ctypes.c_int]
    so.keras_model_free.argtypes = [ctypes.c_void_p]
    model = so.keras_model_create()
    assert so.keras_model_load(model, str(tmp_path / "keras_init.npz").encode()) == OK

    from opgrad.data import load_embedded_mnist

    data = load_embedded_mnist()
    steps, b = 3, 4
    x, y = np.ascontiguousarray(data.train_images[: steps * b]), data.train_labels[: steps * b].copy()
    net, opt = nn.keras_mnist(), nn.SGD()
    rng = np.random.default_rng(0)
    m1 = np.concatenate([net.sample_noise(rng, b)["dropout1"] for _ in range(steps)])
    m2 = np.concatenate([net.sample_noise(rng, b)["dropout2"] for _ in range(steps)])
    lrs = np.array([0.05, 0.04, 0.03], np.float32)
    losses = np.zeros(steps, np.float32)
    assert so.keras_train_steps(model, steps, x.ctypes.data, y.ctypes.data, m1.ctypes.data, m2.ctypes.data,
                                lrs.ctypes.data, losses.ctypes.data, 0) == OK
    so.keras_model_free(model)
    params = net.init_params(0)
    want = nn.TrainStep(net, opt, batch_size=b, backend="reference").run_steps(
        x, y, params, {}, lrs, {"dropout1": m1, "dropout2": m2}).losses
    np.testing.assert_allclose(losses, want, rtol=1e-4)  # the numpy reference rounds differently


def test_export_argument_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ExportError, match=r"batch_size \(--batch-size\) must be an int >= 1, got 0"):
        opgrad.export(tmp_path, batch_size=0)
    with pytest.raises(ExportError, match=r"name .* expected a lowercase C identifier"):
        opgrad.export(tmp_path, name="My-Net")
    with pytest.raises(ExportError, match="unknown target 'sparc'"):
        opgrad.export(tmp_path, target="sparc")
    with pytest.raises(ExportError, match=r"features \+nosuchfeature: LLVM does not know them for x86_64"):
        opgrad.export(tmp_path, target="x86_64-unknown-linux-gnu", features="+nosuchfeature", object_only=True)
    with pytest.raises(ExportError, match=r"features \+avx512f: LLVM does not know them for aarch64"):
        opgrad.export(tmp_path, target="aarch64-linux-gnu", features="+avx512f", object_only=True)
    with pytest.raises(ExportError, match=r"model 'seed-cnn' at batch_size=100000000000, eval_batch_size=4: a matrix "
                                          r"product of .* past its kernel's 32-bit offsets: make the batch size"):
        opgrad.export(tmp_path, batch_size=10**11, eval_batch_size=4, object_only=True)
    with pytest.raises(ExportError, match="unknown model 'vgg'"):
        opgrad.export(tmp_path, model="vgg")
    two_heads = nn.Input((1, 8, 8))
    features = nn.Flatten()(two_heads)
    with pytest.raises(ExportError, match=r"model 'heads': export takes single-input, single-output models; this "
                                          r"one has 1 input\(s\) and 2 output\(s\)"):
        opgrad.export(tmp_path, model=nn.Model(two_heads, [nn.Dense(3)(features), nn.Dense(2)(features)],
                                               name="heads"))
    with pytest.raises(ExportError, match=r"C compiler 'no-such-cc' for host .* is not on PATH"):
        opgrad.export(tmp_path, cc="no-such-cc")
    (tmp_path / "file").write_text("")
    with pytest.raises(ExportError, match="exists and is not a directory"):
        opgrad.export(tmp_path / "file")
    assert cli.main(["export", str(tmp_path / "out"), "--threads", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("opgrad export: error: threads (--threads)") and err.count("\n") == 1
    assert "Traceback" not in err
    assert cli.main(["export", str(tmp_path / "out"), "--seed", "-1"]) == 2
    err = capsys.readouterr().err
    assert err == "opgrad export: error: seed (--seed) must be an int >= 0, got -1\n"
    assert cli.main(["export", str(tmp_path / "out"), "--cpu", "skylake-avx51", "--object-only"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("opgrad export: error: cpu 'skylake-avx51': LLVM does not know this processor")
    assert err.count("\n") == 1
    assert not (tmp_path / "out").exists()
    assert cli.main(["export", "/proc/opgrad-export"]) == 2  # /proc takes no new entries, even from root
    assert capsys.readouterr().err == ("opgrad export: error: /proc/opgrad-export: cannot write the export there "
                                       "(/proc: No such file or directory)\n")


def test_export_mistakes_that_reached_llvm_or_the_step_are_export_errors(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    # A bare feature name made LLVM assert; a softmax output, a big-endian target (the runtime reads
    # checkpoints' little-endian floats as they lie) and arguments of the wrong type raised plain
    # Python errors (tracebacks on the command line).
    with pytest.raises(ExportError, match=r"features 'avx2': 'avx2' is not \+name or -name"):
        opgrad.export(tmp_path / "a", features="avx2", object_only=True)
    with pytest.raises(ExportError, match=r"is not \+name or -name"):
        opgrad.export(tmp_path / "a", features="+avx2,,+fma", object_only=True)
    with pytest.raises(ExportError, match=r"target s390x-linux-gnu \(s390x-linux-gnu\) is big-endian"):
        opgrad.export(tmp_path / "a", model="mlp", target="s390x-linux-gnu", object_only=True)
    with pytest.raises(ExportError, match="target must be a name or an LLVM triple"):
        opgrad.export(tmp_path / "a", target=123)  # type: ignore[arg-type]
    with pytest.raises(ExportError, match=r"model must be a built-in model's name or an opgrad\.nn\.Model"):
        opgrad.export(tmp_path / "a", model=None)  # type: ignore[arg-type]
    probabilities = nn.Sequential([nn.Dense(3), nn.Softmax()], input_shape=(6,), name="probs")
    with pytest.raises(ExportError, match="model 'probs': output 0 is a softmax"):
        opgrad.export(tmp_path / "a", model=probabilities, object_only=True)
    assert cli.main(["export", str(tmp_path / "b"), "--bogus"]) == 2
    assert capsys.readouterr().err == "opgrad export: error: unrecognized arguments: --bogus\n"
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_ci_installs_the_cross_tools_before_the_readme_command() -> None:
    run = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    command = 'python3 -m venv .venv && .venv/bin/pip install -q -e ".[dev]" && .venv/bin/python -m pytest'
    assert command in readme and run.rstrip().endswith(command)
    install = run.index("apt-get install -y gcc gcc-aarch64-linux-gnu qemu-user")
    assert run.index("command -v aarch64-linux-gnu-gcc") < install < run.index(command)
    assert "[docs/deployment.md](docs/deployment.md)" in readme


# ----- targets -----


def test_target_descriptions() -> None:
    from opgrad.compiler.gemm import Blocking
    from opgrad.compiler.irtext import ModuleEmitter
    from opgrad.compiler.target import current_target, host_target, resolve_target, use_target

    v3, arm, android = (resolve_target(n) for n in ("x86-64-v3", "aarch64-linux-gnu", "aarch64-linux-android"))
    assert (v3.is_x86, v3.vector_width(4), v3.vector_registers, v3.has_avx512) == (True, 8, 16, False)
    assert (arm.is_aarch64, arm.vector_width(4), arm.vector_width(8), arm.vector_registers) == (True, 4, 2, 32)
    assert android.is_android and android.triple.startswith("aarch64") and not arm.is_android
    assert resolve_target("x86-64-v4").function_attrs.startswith('"prefer-vector-width"="512"')
    assert resolve_target("riscv64-unknown-linux-gnu").cpu == "generic"
    with pytest.raises(ValueError, match="unknown target 'armv99'"):
        resolve_target("armv99")
    assert current_target() is host_target()
    with use_target(arm):
        assert current_target() == arm and ModuleEmitter().function_attrs == ""
        assert (Blocking.for_target("float32").mr, Blocking.for_target("float32").vl) == (8, 4)
    with use_target(v3):
        assert (Blocking.for_target("float32").mr, Blocking.for_target("float32").nr) == (6, 16)
    assert current_target() is host_target()


@pytest.mark.parametrize(("name", "fused"), [("x86-64-v2", False), ("x86-64", False), ("x86-64-v3", True),
                                             ("aarch64-linux-gnu", True)])
def test_multiply_adds_are_fused_only_where_the_target_fuses_them(name: str, fused: bool) -> None:
    """``llvm.fma`` demands the fused rounding: on a CPU without FMA it becomes a call to the C
    library's ``fmaf`` per element, so kernels for such a target ask for ``llvm.fmuladd``."""
    from opgrad.compiler.gemm import GemmSpec, emit_gemm
    from opgrad.compiler.irtext import ModuleEmitter
    from opgrad.compiler.target import resolve_target, use_target

    target = resolve_target(name)
    assert target.has_fma == fused
    with use_target(target):
        module = ModuleEmitter("fma")
        emit_gemm(module, GemmSpec.dense(64, 48, 32))
        ir = module.text()
    assert ("@llvm.fma." in ir, "@llvm.fmuladd." in ir) == (fused, not fused)


def test_x86_64_v3_baseline_runs_here_and_agrees(python_losses: np.ndarray, tmp_path: Path) -> None:
    """A portable AVX2 library (what to ship to other x86-64 machines) trains to the same losses."""
    _require("cc")
    from opgrad.compiler.target import host_target

    if "+avx2" not in host_target().features.split(",") or "+fma" not in host_target().features.split(","):
        pytest.skip("this CPU cannot run x86-64-v3 code")
    result = opgrad.export(tmp_path, batch_size=BATCH, target="x86-64-v3", threads=2)
    assert _elf_header(result.files["kernels"])["machine"] == 62  # x86-64
    subprocess.run([sys.executable, str(ROOT / "examples/export_c/make_data.py"), str(tmp_path), "--steps", "6",
                    "--batch-size", str(BATCH)], check=True, capture_output=True)
    subprocess.run(["cc", "-std=c11", "-O2", "-I", str(tmp_path), str(ROOT / "examples/export_c/train.c"),
                    str(result.files["static"]), "-lm", "-pthread", "-o", str(tmp_path / "train")], check=True)
    run = subprocess.run([str(tmp_path / "train"), str(tmp_path), "6", "3"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    np.testing.assert_allclose(_losses(run.stdout), python_losses[:6], rtol=1e-5, atol=0)


def _batchnorm_model() -> nn.Model:
    inp = nn.Input((1, 28, 28))
    x = nn.Conv2D(4, 3, strides=2, padding="same", use_bias=False)(inp)
    x = nn.ReLU()(nn.BatchNorm2D()(x))
    skip = x
    x = nn.BatchNorm2D()(nn.Conv2D(4, 3, padding="same", use_bias=False)(x))
    x = nn.GlobalAvgPool2D()(nn.ReLU()(nn.Add()([x, skip])))
    return nn.Model(inp, nn.Dense(10)(x), name="bn-net")


def test_checkpoint_with_batchnorm_exports_trains_and_evaluates_like_python(tmp_path: Path) -> None:
    """opgrad export --checkpoint ships a saved model's architecture and weights; BatchNorm's running
    statistics are updated by the C training steps and used by its evaluation, as in Python."""
    _require("cc")
    from opgrad.data import load_embedded_mnist

    model = _batchnorm_model()
    model.params = model.init_params(3)
    model.save(tmp_path / "bn.npz")
    out = tmp_path / "lib"
    assert cli.main(["export", str(out), "--checkpoint", str(tmp_path / "bn.npz"), "--optimizer", "momentum",
                     "--batch-size", "4", "--threads", "1", "--name", "bn"]) == 0
    header = (out / "bn.h").read_text()
    assert all(name in header for name in model.buffers) and "#define BN_NUM_PARAM_ARRAYS 12" in header

    so = c_library(out / "libbn.so", "bn")
    handle = so.bn_model_create()
    assert so.bn_model_load(handle, str(out / "bn_init.npz").encode()) == OK

    data = load_embedded_mnist()
    steps, b = 3, 4
    x, y = np.ascontiguousarray(data.train_images[: steps * b]), data.train_labels[: steps * b].copy()
    lrs = np.array([0.05, 0.04, 0.03], np.float32)
    losses = np.zeros(steps, np.float32)
    assert so.bn_train_steps(handle, steps, x.ctypes.data, y.ctypes.data, lrs.ctypes.data, losses.ctypes.data, 0) == OK
    logits = np.zeros((4, 10), np.float32)
    test_x = np.ascontiguousarray(data.test_images[:4])
    assert so.bn_eval(handle, test_x.ctypes.data, logits.ctypes.data) == OK
    assert so.bn_model_save(handle, str(tmp_path / "trained.npz").encode()) == OK
    so.bn_model_free(handle)

    net, opt = nn.load(tmp_path / "bn.npz"), nn.SGD(momentum=0.9)
    want = nn.TrainStep(net, opt, batch_size=b, backend="llvm").run_steps(
        x, y, net.params, {**opt.init_state(net.params), **net.buffers}, lrs)
    np.testing.assert_allclose(losses, want.losses, rtol=1e-5)
    arrays, _ = load_checkpoint(tmp_path / "trained.npz")
    for name in net.buffers:
        assert not np.array_equal(arrays[name], net.buffers[name]), name  # training moved the statistics
        np.testing.assert_allclose(arrays[name], want.state[name], rtol=1e-5, atol=1e-6)
    net.params = {n: want.params[n] for n in net.params}
    net.buffers = {n: want.state[n] for n in net.buffers}
    np.testing.assert_allclose(logits, net.predict(test_x, batch_size=4), rtol=1e-4, atol=1e-5)


def _user_model() -> nn.Model:
    """A model that is not built in, so only the architecture in a checkpoint can rebuild it."""
    inp = nn.Input((1, 28, 28))
    x = nn.ReLU()(nn.BatchNorm2D()(nn.Conv2D(4, 3, strides=2, padding="same")(inp)))
    return nn.Model(inp, nn.Dense(10)(nn.Flatten()(x)), name="user-net")


def test_checkpoints_of_a_user_model_export_and_its_runtime_rebuild_with_nn_load(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """NAME_init.npz and every checkpoint the C runtime saves carry the architecture, as model.save writes it:
    opgrad.nn.load, opgrad predict and opgrad train --resume read them back for a model that is not built in."""
    _require("cc")
    from opgrad.data import load_embedded_mnist

    model = _user_model()
    model.params = model.init_params(4)
    rng = np.random.default_rng(1)
    model.buffers = {n: rng.uniform(0.5, 1.5, a.shape).astype(np.float32) for n, a in model.buffers.items()}
    model.save(tmp_path / "user.npz")
    out = tmp_path / "lib"
    assert cli.main(["export", str(out), "--checkpoint", str(tmp_path / "user.npz"), "--batch-size", "4",
                     "--threads", "1"]) == 0

    init = nn.load(out / "opgrad_init.npz")
    assert init.get_config() == model.get_config()
    for name, array in {**model.params, **model.buffers}.items():
        np.testing.assert_array_equal({**init.params, **init.buffers}[name], array, err_msg=name)

    so = c_library(out / "libopgrad.so")
    handle = so.opgrad_model_create()
    assert so.opgrad_model_load(handle, str(out / "opgrad_init.npz").encode()) == OK
    data = load_embedded_mnist()
    steps, b = 2, 4
    x, y = np.ascontiguousarray(data.train_images[: steps * b]), data.train_labels[: steps * b].copy()
    lrs = np.array([0.01, 0.01], np.float32)
    losses = np.zeros(steps, np.float32)
    assert so.opgrad_train_steps(handle, steps, x.ctypes.data, y.ctypes.data, lrs.ctypes.data,
                                 losses.ctypes.data, 0) == OK
    test_x = np.ascontiguousarray(data.test_images[:4])
    logits = np.zeros((4, 10), np.float32)
    assert so.opgrad_eval(handle, test_x.ctypes.data, logits.ctypes.data) == OK
    assert so.opgrad_model_save(handle, str(tmp_path / "c.npz").encode()) == OK

    def c_array(name: str, shape: tuple[int, ...]) -> np.ndarray:
        count = ctypes.c_int64()
        ptr = so.opgrad_model_array(handle, name.encode(), ctypes.byref(count))
        return np.ctypeslib.as_array(ptr, (count.value,)).reshape(shape).copy()

    python = nn.load(tmp_path / "user.npz")
    python.params = {n: c_array(n, a.shape) for n, a in python.params.items()}
    python.buffers = {n: c_array(n, a.shape) for n, a in python.buffers.items()}
    so.opgrad_model_free(handle)

    from_c = nn.load(tmp_path / "c.npz")
    assert from_c.get_config() == model.get_config()
    assert from_c.checkpoint_meta["step"] == steps and from_c.checkpoint_meta["optimizer"] == nn.Adam().describe()
    np.testing.assert_array_equal(from_c.predict(test_x, batch_size=4), python.predict(test_x, batch_size=4))
    np.testing.assert_allclose(from_c.predict(test_x, batch_size=4), logits, rtol=1e-4, atol=1e-5)

    capsys.readouterr()
    assert cli.main(["predict", "--checkpoint", str(tmp_path / "c.npz")]) == 0
    assert "model user-net:" in capsys.readouterr().out
    assert cli.main(["train", "--resume", str(tmp_path / "c.npz"), "--epochs", "1", "--max-steps", "1",
                     "--batch-size", "4", "--test-limit", "4"]) == 0
    assert "model user-net:" in capsys.readouterr().out


def test_export_of_a_model_the_step_cannot_train_is_one_line(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    model = nn.Sequential([nn.Dense(3)], input_shape=(5, 4))  # scores per row of a sequence: no classifier
    model.save(tmp_path / "rows.npz")
    assert cli.main(["export", str(tmp_path / "out"), "--checkpoint", str(tmp_path / "rows.npz")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("opgrad export: error: model 'model': output 0 has shape (5, 3) per example, a class per "
                          "position; export takes classifiers with one class per example")
    assert err.count("\n") == 1 and "Traceback" not in err


def test_two_models_saving_one_path_from_two_threads_write_apart(lib: ctypes.CDLL, host: tuple[Path, str],
                                                                  tmp_path: Path) -> None:
    tmp, _ = host
    models = [Model(lib, tmp) for _ in range(2)]
    target = str(tmp_path / "shared.npz").encode()
    codes: list[int] = []

    def save_many(model: Model) -> None:
        codes.extend(lib.opgrad_model_save(model.handle, target) for _ in range(15))

    threads = [threading.Thread(target=save_many, args=(model,)) for model in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert codes == [OK] * 30
    load_checkpoint(tmp_path / "shared.npz")  # a whole file, whichever save renamed last
    assert not list(tmp_path.glob("*.tmp"))


def test_models_with_integer_inputs_are_refused(tmp_path: Path) -> None:
    tokens = nn.Input((5,), dtype="int64", name="tokens")
    model = nn.Model(tokens, nn.Dense(3)(nn.Flatten()(nn.Embedding(10, 4)(tokens))), name="ids")
    with pytest.raises(ExportError, match=r"model 'ids': export takes a float input .* input 'tokens' holds int64"):
        opgrad.export(tmp_path, model=model)


def test_an_export_over_an_earlier_one_leaves_none_of_its_libraries(tmp_path: Path) -> None:
    # Libraries built for batch 4 beside a header for batch 6 would run the old graphs with the
    # new sizes; an object-only export, or one whose C build fails, must not leave them there.
    _require("cc")
    model = nn.Sequential([nn.Dense(3)], (6,), name="tiny")
    first = opgrad.export(tmp_path, model=model, batch_size=4)
    built = [first.files[k] for k in ("object", "static", "shared")]
    assert all(path.exists() for path in built)
    opgrad.export(tmp_path, model=model, batch_size=6, object_only=True)
    assert "#define OPGRAD_BATCH_SIZE 6" in (tmp_path / "opgrad.h").read_text()
    assert not any(path.exists() for path in built)
    opgrad.export(tmp_path, model=model, batch_size=4)
    with pytest.raises(ExportError):
        opgrad.export(tmp_path, model=model, batch_size=6, cc="false")
    assert not any(path.exists() for path in built)


def test_a_name_that_would_shadow_a_standard_header_is_refused(tmp_path: Path) -> None:
    # string.h in the export folder would stand in for <string.h>: strerror undeclared, a crash.
    for name in ("string", "stdio", "math"):
        with pytest.raises(ExportError, match=rf"name \(--name\) '{name}': {name}\.h would stand in for the C "
                                              rf"library's <{name}\.h>"):
            opgrad.export(tmp_path / name, name=name, object_only=True)


def test_a_failed_c_build_shows_the_compilers_errors(tmp_path: Path) -> None:
    _require("cc")
    fake_cc = tmp_path / "fake-cc"
    fake_cc.write_text("#!/bin/sh\necho 'x.c:1: warning: unused thing' >&2\necho 'x.c:9: error: unknown type "
                       "name FILE' >&2\nfor i in 1 2 3 4 5 6 7; do echo 'x.c: warning: noise' >&2; done\nexit 1\n")
    fake_cc.chmod(0o755)
    model = nn.Sequential([nn.Dense(3)], (6,), name="tiny")
    with pytest.raises(ExportError, match=r"failed \(.*\): x\.c:9: error: unknown type name FILE$"):
        opgrad.export(tmp_path / "out", model=model, batch_size=2, cc=str(fake_cc))


def test_export_of_a_partly_frozen_model_keeps_frozen_weights(tmp_path: Path) -> None:
    """A model with a frozen convolution and BatchNorm exports a training step that leaves them (and
    the running statistics) as they are and trains the rest as Python's step does."""
    _require("cc")
    inp = nn.Input((1, 6, 6))
    x = nn.BatchNorm2D(name="bn")(nn.Conv2D(3, 3, name="conv")(inp))
    net = nn.Model(inp, nn.Dense(4, name="head")(nn.Flatten()(nn.ReLU()(x))), name="frozen")
    net.buffers = {"bn.running_mean": np.array([0.1, -0.2, 0.3]), "bn.running_var": np.array([0.5, 1.5, 2.0])}
    for name in ("conv", "bn"):
        net.get_layer(name).trainable = False
    result = opgrad.export(tmp_path, model=net, optimizer="adam", batch_size=4, threads=1)
    so = c_library(result.files["shared"])
    model = so.opgrad_model_create()
    assert so.opgrad_model_load(model, str(result.files["init"]).encode()) == OK
    rng = np.random.default_rng(0)
    steps = 3
    x_all = rng.random((steps * 4, 1, 6, 6), dtype=np.float32)
    y_all = rng.integers(0, 4, steps * 4)
    lrs = np.full(steps, 0.01, np.float32)
    losses = np.zeros(steps, np.float32)
    assert so.opgrad_train_steps(model, steps, x_all.ctypes.data, y_all.ctypes.data, lrs.ctypes.data,
                                 losses.ctypes.data, 0) == OK
    step = nn.TrainStep(net, nn.Adam(), batch_size=4, backend="reference")
    start = {**nn.Adam().init_state({n: net.params[n] for n in net.trainable_param_names()}), **net.buffers}
    want = step.run_steps(x_all, y_all, net.params, start, lrs)
    np.testing.assert_allclose(losses, want.losses, rtol=1e-4)

    def c_array(name: str) -> np.ndarray:
        size = ctypes.c_int64()
        pointer = so.opgrad_model_array(model, name.encode(), ctypes.byref(size))
        return np.ctypeslib.as_array(pointer, (size.value,)).copy()

    for name in ("conv.weight", "bn.weight"):
        np.testing.assert_array_equal(c_array(name), net.params[name].reshape(-1))
    np.testing.assert_array_equal(c_array("bn.running_var"), net.buffers["bn.running_var"].reshape(-1))
    np.testing.assert_allclose(c_array("head.weight"), want.params["head.weight"].reshape(-1), rtol=1e-4, atol=1e-6)
    so.opgrad_model_free(model)
