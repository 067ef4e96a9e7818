"""SyncBatchNorm over MPI: 2 ranks with --sync-batchnorm compute what one process with the whole batch does.

Each test starts ``mpirun -n 2`` on a small script under a timeout (the helpers of
test_distributed.py), so a rank left waiting in a BatchNorm sum fails the test instead of hanging.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from optional import require

require("mpi4py", "SyncBatchNorm runs on MPI through mpi4py (the `distributed` extra)")

from test_distributed import opgrad_cli, run_mpi  # noqa: E402

from opgrad import cli  # noqa: E402
from opgrad.nn import Trainer  # noqa: E402

# A conv + BatchNorm model (global batch 9: a 5 + 4 split) and the resnet model's shape, narrowed
# (stem, one basic block per stage, strided stages with a conv + BatchNorm shortcut; batch 5: 3 + 2).
COMMON = textwrap.dedent("""
    import numpy as np
    from opgrad.nn import SGD, Adam, BatchNorm2D, Conv2D, Dense, Flatten, MaxPool2D, ReLU, Sequential
    from opgrad.nn.models import resnet

    def build(kind):
        if kind == "conv":
            return Sequential([Conv2D(3, 3, use_bias=False), BatchNorm2D(), ReLU(), MaxPool2D(2), Flatten(), Dense(4)],
                              input_shape=(1, 8, 8), name="conv-bn")
        return resnet(num_classes=4, blocks_per_stage=1, widths=(4, 6, 8))

    def data(kind):
        rng = np.random.default_rng(7)
        n, side = (45, 8) if kind == "conv" else (25, 28)
        return (rng.standard_normal((n, 1, side, side)) * 2 + 1).astype(np.float32), rng.integers(0, 4, n)

    def settings(kind):
        if kind == "conv":
            return dict(lr=0.01, batch_size=9, seed=5, augment_shift=1, backend="llvm")
        return dict(lr=0.05, batch_size=5, seed=5, backend="reference")

    def optimizer(kind):
        # Momentum for the resnet: Adam scales steps of weights whose gradient is rounding noise
        # up to lr, which would turn rounding into differences (see test_distributed.py).
        return Adam(weight_decay=0.01) if kind == "conv" else SGD(momentum=0.9)
""")

# Ten steps: training this resnet amplifies rounding (one ulp of one pixel moves its 20th loss by
# 2e-5 and a weight by 0.2 % of its tensor's largest), so a longer run would compare the BLAS
# library's summation order on the host rather than the synchronized statistics.
STEPS = 10

EQUIVALENCE = """
    import json, sys
    import numpy as np
    from common_syncbn import build, data, optimizer, settings
    from opgrad.distributed import DistributedTrainer, world

    kind = sys.argv[1]
    comm = world()
    images, labels = data(kind)
    out = {}
    # Per-rank statistics once, on the reference backend: one compile fewer per rank in CI.
    for sync in (True, False) if kind == "resnet" else (True,):
        trainer = DistributedTrainer(build(kind), optimizer(kind), sync_batchnorm=sync, **settings(kind))
        losses = []
        while len(losses) < int(sys.argv[2]):
            trainer.train_epoch(images, labels, on_step=lambda i, loss: losses.append(loss))
        out["sync" if sync else "local"] = {"losses": losses, "rows": trainer.rows,
                                            "sums": trainer.times["batchnorm_sums"]}
        np.savez(f"{'sync' if sync else 'local'}{comm.rank}.npz", **trainer.params,
                 **{k: v for k, v in trainer.state.items() if "running" in k})
    json.dump(out, open(f"rank{comm.rank}.json", "w"))
"""


def write(tmp_path: Path, name: str, body: str) -> Path:
    (tmp_path / "common_syncbn.py").write_text(COMMON)
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def namespace() -> dict:
    found: dict = {}
    exec(COMMON, found)
    return found


@pytest.mark.parametrize("kind", ["conv", "resnet"])
def test_two_ranks_with_sync_batchnorm_match_one_process_with_the_whole_batch(tmp_path: Path, kind: str) -> None:
    done = run_mpi(["-n", "2", sys.executable, str(write(tmp_path, "equivalence.py", EQUIVALENCE)), kind,
                    str(STEPS)], tmp_path)
    assert done.returncode == 0, done.stderr
    ns = namespace()
    images, labels = ns["data"](kind)
    single = Trainer(ns["build"](kind), ns["optimizer"](kind), **ns["settings"](kind))
    losses: list[float] = []
    while len(losses) < STEPS:
        single.train_epoch(images, labels, on_step=lambda i, loss: losses.append(loss))
    expected = {**single.params, **{k: v for k, v in single.state.items() if "running" in k}}
    infos = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [info["sync"]["rows"] for info in infos] == ([[0, 5], [5, 9]] if kind == "conv" else [[0, 3], [3, 5]])
    for info in infos:
        np.testing.assert_allclose(info["sync"]["losses"], losses, rtol=1e-5)
        assert info["sync"]["sums"] > 0
    ranks = [np.load(tmp_path / f"sync{r}.npz") for r in range(2)]
    for name, value in expected.items():
        np.testing.assert_array_equal(ranks[0][name], ranks[1][name], err_msg=name)
        np.testing.assert_allclose(ranks[0][name], value, rtol=1e-5, atol=1e-5 * float(np.abs(value).max()),
                                   err_msg=name)
    if kind != "resnet":
        return
    # Per-rank statistics, the default, are another computation with BatchNorm in the model.
    assert infos[0]["local"]["sums"] == 0
    local = np.array(infos[0]["local"]["losses"])
    assert np.max(np.abs(local - losses) / np.abs(losses)) > 1e-3
    local_params = np.load(tmp_path / "local0.npz")
    assert any(not np.allclose(local_params[name], value, rtol=1e-4) for name, value in expected.items())


FAILING = """
    import sys
    from common_syncbn import build, data, optimizer, settings
    from opgrad.distributed import DistributedTrainer, ReplicaReducer, abort_on_error, world

    comm = world()
    where = sys.argv[1]
    with abort_on_error(comm, "script"):
        if where == "build" and comm.rank == 1:
            import opgrad.distributed
            def cannot_build(*args, **kwargs):
                raise MemoryError("rank 1 cannot build its step")
            opgrad.distributed.GradientStep = cannot_build
        images, labels = data("conv")
        trainer = DistributedTrainer(build("conv"), optimizer("conv"), sync_batchnorm=True, **settings("conv"))
        def before_the_step(x, y, params, buffers, masks):
            if comm.rank == 1 and trainer.step == 3:
                raise ValueError("bad batch on rank 1")
            return step(x, y, params, buffers, masks)
        if where == "before":
            step = trainer.gradient_step
            trainer._gradient_step = before_the_step
        elif where == "inside":  # rank 1's second BatchNorm sum of step 4 fails inside the compiled step
            reduce = ReplicaReducer.__call__
            def flaky(self, buffer):
                if comm.rank == 1 and trainer.step == 3 and self.done == 1:
                    raise ConnectionError("rank 1 lost its link")
                reduce(self, buffer)
            ReplicaReducer.__call__ = flaky
        trainer.train_epoch(images, labels)
    print(f"rank {comm.rank} finished")
"""


@pytest.mark.parametrize("where", ["build", "before", "inside"])
def test_a_rank_failing_in_a_synchronized_step_stops_every_rank(tmp_path: Path, where: str) -> None:
    done = run_mpi(["-n", "2", sys.executable, str(write(tmp_path, "failing.py", FAILING)), where], tmp_path,
                   timeout=90)
    assert done.returncode != 0 and "finished" not in done.stdout
    error = {"build": "MemoryError: rank 1 cannot build its step", "before": "ValueError: bad batch on rank 1",
             "inside": "ConnectionError: rank 1 lost its link"}[where]
    assert error in done.stderr
    stopped = ("rank 1 failed while building the synchronized training step (its error is printed above); "
               "rank 0 stops too" if where == "build" else
               "rank 1 failed at step 4 (epoch 1); its error is printed above; rank 0 stops too")
    assert f"script: error: [rank 0] {stopped}" in done.stderr
    assert "MPI_Abort" not in done.stderr and "BAD TERMINATION" not in done.stderr  # stopped, not killed


def test_cli_sync_batchnorm_trains_resnet_on_two_ranks(tmp_path: Path) -> None:
    done = run_mpi(["-n", "2", opgrad_cli(), "train", "--distributed", "--sync-batchnorm", "--model", "resnet",
                    "--backend", "reference", "--batch-size", "4", "--epochs", "1", "--max-steps", "2",
                    "--test-limit", "20", "--save", "ckpt.npz"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "data-parallel over 2 MPI rank(s): 2 examples per rank per step" in done.stdout
    assert "(BatchNorm sums" in done.stdout
    assert (tmp_path / "ckpt.npz").exists()


def test_cli_sync_batchnorm_without_distributed_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["train", "--sync-batchnorm", "--model", "resnet", "--epochs", "1", "--max-steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("opgrad train: error: --sync-batchnorm synchronizes BatchNorm over the ranks")
    assert "\n" not in err
