"""opgrad bench's measuring tools: peak, CPUs available, per-kernel costs, child processes."""

from __future__ import annotations

import importlib.util
import itertools
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from optional import require

import opgrad
from opgrad import bench, benchreport, cli, nn
from opgrad.compiler.peak import available_cpus, cgroup_cpu_limit, host_info, measure_bandwidth, measure_peak


@pytest.mark.parametrize(("text", "expected"), [("max 100000\n", None), ("150000 100000\n", 1.5),
                                                ("200000 100000", 2.0), ("garbage", None), ("", None)])
def test_cgroup_quota_is_read_from_cpu_max(tmp_path: Path, text: str, expected: float | None) -> None:
    path = tmp_path / "cpu.max"
    path.write_text(text)
    assert cgroup_cpu_limit(path, v1=tmp_path / "no-v1") == expected
    assert cgroup_cpu_limit(tmp_path / "absent", v1=tmp_path / "no-v1") is None


@pytest.mark.parametrize(("quota", "expected"), [("-1", None), ("250000", 2.5)])
def test_cgroup_v1_quota_is_read_when_v2_is_absent(tmp_path: Path, quota: str, expected: float | None) -> None:
    (tmp_path / "cpu.cfs_quota_us").write_text(quota + "\n")
    (tmp_path / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(tmp_path / "absent", v1=tmp_path) == expected


def test_available_cpus_honours_affinity() -> None:
    import os

    assert 1 <= available_cpus() <= len(os.sched_getaffinity(0))


def test_peak_and_bandwidth_are_measured() -> None:
    one = measure_peak(1, seconds=0.002, repeats=3)
    info = host_info()
    # at least one vector FMA per cycle at 0.5 GHz: a generated loop that fell back to scalar or
    # library calls would be far below it
    assert one > info.vector_bits / 32 * 2 * 0.5
    assert measure_bandwidth(1, mib=1, repeats=2) > 0.1
    assert info.vector_registers in (16, 32) and info.cpus >= 1 and info.llvm_cpu


@pytest.mark.parametrize(("available", "counts"), [(1, [1]), (2, [1, 2]), (6, [1, 2, 4, 6]), (8, [1, 2, 4, 8])])
def test_scaling_thread_counts(available: int, counts: list[int]) -> None:
    assert benchreport.thread_counts(available) == counts


def test_plan_counts_conv_and_gemm_flops() -> None:
    from opgrad import ops
    from opgrad.compiler import plan_graph

    x = opgrad.var("x", (2, 3, 9, 8), "float32")
    w = opgrad.var("w", (5, 3, 3, 2), "float32")
    d = opgrad.var("d", (5 * 7 * 7, 4), "float32")
    y = ops.conv2d(x, w)
    fn = opgrad.function([x, w, d], ops.matmul(ops.reshape(y, (2, 5 * 7 * 7)), d))
    costs = plan_graph(fn).step_costs
    conv = [c for c in costs if c.label == "conv2d"]
    assert [c.flops for c in conv] == [2 * 2 * 5 * 7 * 7 * 3 * 3 * 2]
    assert conv[0].detail == "conv x2x3x9x8 w5x3x3x2"
    assert [c.flops for c in costs if c.label == "matmul"] == [2 * 2 * 4 * 245]
    assert all(c.bytes > 0 for c in costs)


def test_bench_prints_peak_percent_and_kernels(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--model", "mlp", "--peak", "--kernels", "--steps", "2", "--warmup", "3",
            "--skip", "torch", "--skip", "jax", "--skip", "reference"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "peak fp32 FMA:" in out and "GFLOP/s" in out and "% peak" in out
    row = next(line for line in out.splitlines() if line.startswith("opgrad llvm (compiled)"))
    assert "%" in row
    kernels = out.split("kernels of the mlp step", 1)[1]
    dense = [line for line in kernels.splitlines() if line.strip().startswith("dense")]
    assert len(dense) >= 6 and all("gemm" in line and "%" in line for line in dense)
    assert "all steps" in kernels


def test_bench_times_a_model_file_against_pytorch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A user's saved model (not built in: 3-channel 20x18 images, a stride-2 "same" conv,
    dropout, 4 classes) is timed on every engine; all of them apply the same dropout masks, so
    PyTorch's loss after two updates matches the reference's."""
    require("torch", "the bench times the model file against PyTorch")
    model = nn.Sequential([nn.Conv2D(6, 3, strides=2, padding="same", activation="relu"), nn.Dropout(0.3),
                           nn.Flatten(), nn.Dense(4)], input_shape=(3, 20, 18), name="users-net")
    path = tmp_path / "users-net.npz"
    model.save(path)
    argv = ["bench", "--checkpoint", str(path), "--steps", "2", "--warmup", "3", "--skip", "jax", "--kernels"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert f"{path} training step" in out and f"{model.num_params:,} parameters" in out
    for engine in ("opgrad llvm (compiled)", "PyTorch"):
        row = next(line for line in out.splitlines() if line.startswith(engine))
        assert "ok (rel. diff" in row, row
    nhwc = next(line for line in out.splitlines() if line.startswith("PyTorch") and "channels_last" in line)
    assert "ok (rel. diff" in nhwc, nhwc
    assert next(line for line in out.splitlines() if line.startswith("opgrad reference")).endswith("(the reference)")
    assert "conv1 forward" in out.split("kernels of the", 1)[1]


@pytest.mark.parametrize("optimizer", ["adam", "nesterov"])
def test_bench_steps_every_engine_with_the_optimizer_asked(optimizer: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """opgrad's optimizer and torch.optim's update alike: PyTorch's loss after two updates matches
    the reference's; the kernel table is of the step with that update."""
    require("torch", "the bench steps PyTorch with torch.optim")
    assert set(bench.OPTIMIZER_NAMES) == set(nn.OPTIMIZERS)
    argv = ["bench", "--model", "mlp", "--optimizer", optimizer, "--steps", "2", "--warmup", "3", "--skip", "jax",
            "--kernels"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert nn.make_optimizer(optimizer).describe() in out.splitlines()[1]
    for engine in ("opgrad llvm (compiled)", "PyTorch"):
        row = next(line for line in out.splitlines() if line.startswith(engine))
        assert "ok (rel. diff" in row, row
    assert f"(after 2 {nn.make_optimizer(optimizer).describe()} updates)" in out
    assert "kernels of the mlp step" in out


def test_bench_names_a_model_it_cannot_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inp = nn.Input((5,))
    regression = tmp_path / "regression.npz"
    nn.Model(inp, nn.Dense(1)(inp)).save(regression)
    assert cli.main(["bench", "--checkpoint", str(regression), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("opgrad bench: error: --checkpoint") and str(regression) in err and "[1]" in err
    assert "\n" not in err
    assert cli.main(["bench", "--checkpoint", str(tmp_path / "absent.npz")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert cli.main(["bench", "--checkpoint", str(regression), "--model", "mlp"]) == 2
    assert "not allowed with" in capsys.readouterr().err
    (tmp_path / "broken.npz").write_bytes(b"not a checkpoint")
    assert cli.main(["bench", "--checkpoint", str(tmp_path / "broken.npz"), "--steps", "1"]) == 2
    assert "broken.npz" in capsys.readouterr().err


def test_child_reports_time_compile_and_memory(tmp_path: Path) -> None:
    result = benchreport.run_child("opgrad", "mlp", 8, 1, 2, cache_dir=str(tmp_path))
    assert "error" not in result, result
    assert result["threads"] == 1 and not result["cache_hit"]
    assert result["ms"] > 0 and result["rss_mib"] >= result["rss_after_imports_mib"] > 10
    warm = benchreport.run_child("opgrad", "mlp", 8, 1, 2, cache_dir=str(tmp_path))
    assert warm["cache_hit"] and np.isfinite(warm["compile_s"])


def test_child_imports_this_processes_opgrad_from_any_working_directory(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # `python -m` puts its working directory first on the path: run from a source checkout beside
    # an installed opgrad, a child would import the checkout's package. A decoy stands in for it.
    decoy = tmp_path / "opgrad"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("raise ImportError('the decoy opgrad was imported')\n")
    monkeypatch.chdir(tmp_path)
    result = benchreport.run_child("opgrad", "mlp", 8, 1, 1, cache_dir=str(tmp_path / "cache"))
    assert "error" not in result, result


def test_kernel_rows_name_each_convolution_pass_by_its_layer() -> None:
    # A layer's passes may run different algorithms (conv2's Winograd tiles differ per pass, and the
    # algorithm is part of the detail): every pass is still named after its layer, not a bare "conv".
    rows = benchreport.kernel_rows("seed-cnn", 2, 1)
    conv_rows = [row for row in rows if row.detail.startswith("conv x")]
    assert len(conv_rows) >= 8
    assert all(row.name.split()[0] in {"conv1", "conv2", "conv3"} for row in conv_rows), [r.name for r in conv_rows]


def test_kernel_rows_tell_apart_layers_of_the_same_shapes() -> None:
    # A ResNet's blocks repeat their shapes and its steps do not run in layer order: each pass is
    # named by the layer whose weight it reads or whose update reads its gradient.
    from opgrad import nn

    model = nn.build_model("resnet")
    rows = benchreport.kernel_rows("resnet", 2, 1)
    params = model.init_params(seed=0)
    weights = {layer.name: params[f"{layer.name}.weight"].shape for layer in model.layers if layer.kind == "conv"}
    passes: dict[str, list[str]] = {}
    for row in rows:
        if row.detail.startswith("conv x"):
            layer, kind = row.name.split()[:2]
            o, c, kh, kw = weights[layer]
            assert f" w{o}x{c}x{kh}x{kw}" in row.detail, (row.name, row.detail)
            passes.setdefault(layer, []).append(kind)
    assert set(passes) == set(weights)
    first = model.layers[0].name  # the images need no gradient
    assert all(sorted(kinds) == sorted(["forward", "backward-weight"] + ["backward-data"] * (layer != first))
               for layer, kinds in passes.items()), passes


def test_engines_take_turns_so_a_drifting_machine_slows_all_alike() -> None:
    calls: list[str] = []

    def engine(key: str) -> Callable[[], float]:
        def run() -> float:
            calls.append(key)
            return 0.0
        return run

    rows = {key: bench.Row(key) for key in ("a", "b", "c")}
    bench.time_interleaved(rows, {key: engine(key) for key in rows}, steps=10)
    rounds = -(-10 // bench.ROUND_STEPS)
    for key in rows:  # every timed step, plus one untimed step per round
        assert calls.count(key) == 10 + rounds
        assert rows[key].ms is not None and rows[key].best_ms is not None and rows[key].cpu_ms is not None
    runs = [len(list(group)) for _, group in itertools.groupby(calls)]
    assert max(runs) <= bench.ROUND_STEPS + 1 and len(runs) == 3 * rounds
    firsts = [calls[sum(runs[:3 * r])] for r in range(rounds)]
    assert firsts[:3] == ["a", "b", "c"]  # the order rotates, so no engine always follows the same one


FAULT_COUNTER = """
import resource, sys
import numpy as np
from opgrad import bench
if sys.argv[1] == "keep":
    assert bench.keep_freed_memory().startswith("glibc malloc keeps freed memory")
np.ones(1 << 18, np.float32)  # one freed 1 MiB block: glibc's own thresholds become 1 and 2 MiB

def step():  # allocates and frees 10 MiB, as a training step allocates and frees its activations
    blocks = [np.ones(1 << 18, np.float32) for _ in range(10)]
    del blocks

step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_bench_keeps_freed_memory_so_steps_take_no_page_faults(tmp_path: Path) -> None:
    if platform.libc_ver()[0] != "glibc":
        pytest.skip(f"the allocator setting is glibc's; this C library is {platform.libc_ver()[0] or 'unknown'}")
    script = tmp_path / "faults.py"
    script.write_text(FAULT_COUNTER)

    def faults(mode: str) -> int:
        proc = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, check=True,
                              cwd=Path(opgrad.__file__).resolve().parents[1])
        return int(proc.stdout.split()[-1])

    default, kept = faults("default"), faults("keep")
    pages = 10 * 10 * (1 << 20) // 4096
    assert default > pages // 2, default  # glibc trims the freed 10 MiB and faults it in again every step
    assert kept < pages // 20, kept


def test_a_scaling_child_times_opgrad_and_pytorch_in_one_process(tmp_path: Path) -> None:
    require("torch", "the scaling table's ratio column times PyTorch's step")
    result = benchreport.run_child("pair", "mlp", 8, 1, 4, cache_dir=str(tmp_path))
    assert "error" not in result, result
    assert result["ms"] > 0 and result["torch_ms"] > 0 and result["best_ms"] <= result["ms"]


def test_scaling_without_pytorch_still_times_opgrad(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "torch" else real_find_spec(name, *args))
    benchreport.scaling_report("mlp", 8, 1, 10**6, 2, with_torch=True)
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.strip().startswith("1 "))
    assert "failed" not in row and "PyTorch" not in out and row.split()[2].replace(".", "").isdigit()


def test_decomposition_simulates_more_threads_than_cores(capsys: pytest.CaptureFixture[str]) -> None:
    benchreport.decomposition_report("seed-cnn", 4, [4], flops=10**8, peak_one=100.0, runs=2)
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.strip().startswith("4 "))
    assert "failed" not in row, out
    _, serial, parallel, speedup = row.split()[:4]
    # the busiest of 4 shares is at least a quarter of their sum, and the kernels do split
    assert 1.0 < float(speedup.rstrip("x")) <= 4.0 and float(parallel) < float(serial)


@pytest.mark.parametrize("value", ["1", "0", "many", "257"])
def test_simulated_thread_counts_are_checked(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--simulate-threads", value]) == 2
    assert f"argument --simulate-threads: expected an integer from 2 to 256 (threads to simulate), got '{value}'" \
        in capsys.readouterr().err


def test_bench_arguments_name_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--threads", "300"]) == 2
    assert capsys.readouterr().err.endswith("argument --threads: expected an integer from 1 to 256 (opgrad's most "
                                            "worker threads), got '300'\n")
    assert cli.main(["bench", "--skip", "llvm", "--skip", "reference"]) == 2
    assert capsys.readouterr().err == ("opgrad bench: error: --skip llvm --skip reference: the table compares "
                                       "opgrad's step with its peers; keep at least one of opgrad's engines\n")


def test_memory_without_pytorch_says_it_is_not_installed(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "torch" else real_find_spec(name, *args))
    benchreport.memory_report("mlp", 8, 1, with_torch=True)
    out = capsys.readouterr().out
    assert "PyTorch is not installed" in out and "failed" not in out


def test_benchs_pytorch_twin_translates_or_names_what_it_cannot() -> None:
    # Activations, grouped convolutions and ceil-mode pools are translated (the same logits as
    # opgrad's); a layer it lacks is a NotImplementedError naming it, which leaves PyTorch's row out.
    from optional import require

    torch = require("torch", "bench's PyTorch twin is compared with opgrad's model")
    from opgrad.bench import torch_forward

    inp = nn.Input((4, 9, 9))
    h = nn.Conv2D(8, 3, groups=2, activation="silu")(inp)
    h = nn.MaxPool2D(2, ceil_mode=True)(nn.Conv2D(8, 1, activation="hard_swish")(h))
    h = nn.AvgPool2D(2, padding=1, count_include_pad=False, ceil_mode=True)(nn.Activation("elu")(h))
    model = nn.Model(inp, nn.Dense(5, activation="relu6")(nn.Flatten()(h)))
    params = model.init_params(0, "float64")
    x = np.random.default_rng(1).standard_normal((2, 4, 9, 9))
    model.params = params
    logits = torch_forward(model, {k: torch.tensor(v) for k, v in params.items()}, {}, torch.tensor(x),
                           training=False)
    np.testing.assert_allclose(logits.numpy(), model.predict(x, backend="reference"), rtol=1e-10, atol=1e-12)
    cumulative = nn.Sequential([nn.Conv2D(2, 3), nn.BatchNorm2D(momentum=None)], (1, 6, 6))
    weights = {k: torch.tensor(v) for k, v in cumulative.init_params(0).items()}
    with pytest.raises(NotImplementedError, match=r"no translation of layer .*cumulative average"):
        torch_forward(cumulative, weights, {}, torch.zeros((1, 1, 6, 6)), training=True)


def test_more_threads_than_cpus_measure_the_peak_of_the_cpus(tmp_path: Path) -> None:
    # Threads sharing CPUs each run at full speed by their own CPU time; their sum is no peak.
    from opgrad.env import available_cpus

    cpus = available_cpus()
    done = subprocess.run([sys.executable, "-m", "opgrad.cli", "bench", "--model", "mlp", "--steps", "1", "--peak",
                           "--threads", str(cpus + 1), "--skip", "reference", "--skip", "torch", "--skip", "jax"],
                          capture_output=True, text=True, timeout=300, cwd=Path(opgrad.__file__).parents[1],
                          env={**os.environ, "OPGRAD_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith("peak fp32 FMA"))
    assert f" on {cpus} ({cpus + 1} threads share them)" in line or (cpus == 1 and " on 1 (2 threads" in line), line


def test_a_busy_host_is_named_under_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    # PyTorch's OpenMP threads spin while they wait, so shared cores slow its step more than opgrad's.
    monkeypatch.setattr(bench.os, "getloadavg", lambda: (5.5, 3.0, 2.0))
    assert bench.host_load_note(2).startswith("note: load average 5.5 on 2 CPU(s): other jobs share them")
    assert "OMP_WAIT_POLICY=PASSIVE" in bench.host_load_note(2)
    assert bench.host_load_note(8) == ""


def test_compile_times_show_a_cold_build_and_a_warm_start_from_the_caches(monkeypatch: pytest.MonkeyPatch,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("OPGRAD_PLAN_CACHE", "1")  # the suite turns it off; the children use it as a user's would
    benchreport.compile_report("mlp", 8, 1)
    out = capsys.readouterr().out
    cold = next(line for line in out.splitlines() if "cold (empty caches)" in line)
    warm = next(line for line in out.splitlines() if "warm (stored plan, object)" in line)
    assert "build IR" in cold and "optimize/codegen" in cold and "unexpected" not in cold
    assert "read stored plan" in warm and "object read from the cache" in warm and "unexpected" not in warm
