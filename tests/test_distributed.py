"""Data-parallel training over MPI: equivalence with one process, sharding, faults, checkpoints.

The MPI tests start ``mpirun -n 2`` (MPICH's, from the ``distributed`` extra) on small scripts and
models, each under a timeout, so a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mnist_files import idx_images, idx_labels
from optional import require
from trainers import assert_split_trains_as_plain

require("mpi4py", "distributed training runs on MPI through mpi4py (the `distributed` extra)")

from opgrad.checkpoint import load_checkpoint  # noqa: E402
from opgrad.data import load_embedded_mnist  # noqa: E402
from opgrad.distributed import DistributedTrainer, FusedBuffer, shard_bounds  # noqa: E402
from opgrad.nn import SGD, Trainer  # noqa: E402

TIMEOUT = 120  # seconds for one mpirun; a run that hangs is killed and fails its test


def mpirun() -> str:
    """MPICH's mpirun from the environment running the tests (the wheel puts it beside python)."""
    beside = Path(sys.executable).parent / "mpirun"
    found = str(beside) if beside.exists() else shutil.which("mpirun")
    if found is None:
        if os.environ.get("CI") == "true":
            raise RuntimeError("mpirun not found: install the `distributed` extra (pip install mpich)")
        pytest.skip("mpirun not found: pip install mpich")
    return found


def run_mpi(args: list[str], cwd: Path, timeout: int = TIMEOUT) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run([mpirun(), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"mpirun {' '.join(args)} hung for {timeout}s:\n{exc.stdout}\n{exc.stderr}") from None


# The model and data of the equivalence runs: a conv layer, dropout and augmentation shifts, so
# every random draw of a step is exercised, and a global batch of 9 that two ranks split 5 + 4.
COMMON = textwrap.dedent("""
    import numpy as np
    from opgrad.nn import SGD, Adam, Conv2D, Dense, Dropout, Flatten, MaxPool2D, ReLU, Sequential

    def tiny_model():
        return Sequential([Conv2D(3, 3), ReLU(), MaxPool2D(2), Flatten(), Dropout(0.3), Dense(4)],
                          input_shape=(1, 8, 8), name="tiny")

    def tiny_data(n=45):
        rng = np.random.default_rng(7)
        return rng.standard_normal((n, 1, 8, 8)).astype(np.float32), rng.integers(0, 4, n)

    def settings(optimizer):
        return dict(lr=0.05 if optimizer == "momentum" else 0.01, batch_size=9, seed=5, augment_shift=1,
                    backend="llvm")

    def make_optimizer(name):
        return SGD(momentum=0.9, clip_norm=1.0) if name == "momentum" else Adam(weight_decay=0.01)
""")


def tiny_namespace() -> dict:
    namespace: dict = {}
    exec(COMMON, namespace)
    return namespace


def write_script(tmp_path: Path, name: str, body: str) -> Path:
    (tmp_path / "common_dist.py").write_text(COMMON)
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


# ----- in-process pieces: the shard split and the fused buffer -----


@pytest.mark.parametrize("total", [1, 7, 9, 32, 100])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 7])
def test_shards_cover_every_row_once_and_differ_by_at_most_one(total: int, size: int) -> None:
    bounds = [shard_bounds(total, rank, size) for rank in range(size)]
    rows = [i for start, stop in bounds for i in range(start, stop)]
    assert rows == list(range(total))
    sizes = [stop - start for start, stop in bounds]
    assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="rank 2 is not in a world of 2"):
        shard_bounds(total, 2, 2)


def test_every_sample_is_seen_once_per_epoch_across_ranks() -> None:
    """The global batches of an epoch, split by rank, cover the epoch's samples exactly once."""
    ns = tiny_namespace()
    images, labels = ns["tiny_data"](50)
    ids = np.arange(50)
    trainer = Trainer(ns["tiny_model"](), SGD(), batch_size=9, seed=3)
    for epoch in range(2):
        trainer.epoch = epoch
        seen: list[int] = []
        for x, _ in trainer.epoch_batches(images, labels):
            for rank in range(3):
                start, stop = shard_bounds(len(x), rank, 3)
                seen += [int(np.flatnonzero((images == row).all(axis=(1, 2, 3)))[0]) for row in x[start:stop]]
        assert len(seen) == len(set(seen)) == 45  # 50 // 9 full batches; the short last one is dropped
        assert set(seen) <= set(ids.tolist())


def test_fused_buffer_packs_weighted_slots_and_reads_views() -> None:
    buffer = FusedBuffer(3, {"w": (2, 3), "b": (4,)}, "float32")
    w, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(4, np.float32)
    buffer.pack(2.0, {"w": w, "b": b}, 0.5)
    assert buffer.array.shape == (3 + 1 + 6 + 4,) and buffer.loss == 1.0 and buffer.failed_ranks() == []
    np.testing.assert_array_equal(buffer.view("w"), w * 0.5)
    assert np.shares_memory(buffer.view("b"), buffer.array)
    buffer.mark_failed(2)
    assert buffer.failed_ranks() == [2] and buffer.loss == 0.0


def test_one_rank_is_bitwise_the_plain_trainer() -> None:
    """In a world of one, the split step + all-reduce computes exactly the single function."""
    ns = tiny_namespace()
    images, labels = ns["tiny_data"]()
    options = {**ns["settings"]("adam"), "backend": "reference"}
    plain = Trainer(ns["tiny_model"](), ns["make_optimizer"]("adam"), **options)
    split = DistributedTrainer(ns["tiny_model"](), ns["make_optimizer"]("adam"), **options, fused_when_alone=False)
    assert_split_trains_as_plain(plain, split, images, labels)


# ----- two ranks under mpirun -----


EQUIVALENCE = """
    import json, sys
    import numpy as np
    from common_dist import tiny_model, tiny_data, settings, make_optimizer
    from opgrad.distributed import DistributedTrainer, world

    optimizer = sys.argv[1]
    comm = world()
    images, labels = tiny_data()
    trainer = DistributedTrainer(tiny_model(), make_optimizer(optimizer), **settings(optimizer))
    losses = []
    while len(losses) < 20:  # 5 steps per epoch: four epochs, each with its own batch order
        trainer.train_epoch(images, labels, on_step=lambda i, loss: losses.append(loss))
    accuracy, test_loss = trainer.evaluate(images, labels)
    # Which samples this rank trained on in one more epoch, found through a wrapped gradient step.
    ids = np.arange(len(labels), dtype=np.float32)
    marked = images.copy()
    marked[:, 0, 0, 0] = ids
    seen = []
    step = trainer.gradient_step
    trainer.augment_shift = 0
    def spy(x, y, params, buffers, masks):
        seen.extend(int(v) for v in x[:, 0, 0, 0])
        return step(x, y, params, buffers, masks)
    trainer._gradient_step = spy
    trainer.train_epoch(marked, labels)
    np.savez(f"rank{comm.rank}.npz", losses=np.array(losses), seen=np.array(seen),
             **{"param:" + k: v for k, v in trainer.params.items()})
    json.dump({"rows": trainer.rows, "eval": [accuracy, test_loss], "size": comm.size},
              open(f"rank{comm.rank}.json", "w"))
"""


@pytest.mark.parametrize("optimizer", ["adam", "momentum"])
def test_two_ranks_match_one_process_with_the_whole_batch(tmp_path: Path, optimizer: str) -> None:
    script = write_script(tmp_path, "equivalence.py", EQUIVALENCE)
    done = run_mpi(["-n", "2", sys.executable, str(script), optimizer], tmp_path)
    assert done.returncode == 0, done.stderr
    ns = tiny_namespace()
    images, labels = ns["tiny_data"]()
    single = Trainer(ns["tiny_model"](), ns["make_optimizer"](optimizer), **ns["settings"](optimizer))
    losses: list[float] = []
    while len(losses) < 20:
        single.train_epoch(images, labels, on_step=lambda i, loss: losses.append(loss))
    expected_eval = single.evaluate(images, labels)
    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in range(2)]
    infos = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [info["rows"] for info in infos] == [[0, 5], [5, 9]] and infos[0]["size"] == 2
    for rank in ranks:
        np.testing.assert_allclose(rank["losses"], losses, rtol=1e-5)
    for info in infos:
        np.testing.assert_allclose(info["eval"], expected_eval, rtol=1e-5)
    # Every rank holds the same weights, bitwise: the update ran on the same all-reduced sum.
    for name in single.params:
        np.testing.assert_array_equal(ranks[0][f"param:{name}"], ranks[1][f"param:{name}"])
    # The spied epoch: rank 0 saw rows 0-4 and rank 1 rows 5-8 of each global batch, and
    # together every sample of the epoch's five full batches exactly once.
    seen = [ranks[r]["seen"].tolist() for r in range(2)]
    assert len(seen[0]) == 25 and len(seen[1]) == 20
    union = seen[0] + seen[1]
    assert len(set(union)) == 45 == len(union)
    single.augment_shift = 0
    marked = images.copy()
    marked[:, 0, 0, 0] = np.arange(len(labels))
    order = [int(v) for x, _ in single.epoch_batches(marked, labels) for v in x[:, 0, 0, 0]]
    assert sorted(order) == sorted(union)
    assert seen[0] == [v for i, v in enumerate(order) if i % 9 < 5]
    single.train_epoch(marked, labels)
    for name, value in single.params.items():
        got = ranks[0][f"param:{name}"]
        np.testing.assert_allclose(got, value, rtol=1e-5, atol=1e-5 * float(np.abs(value).max()))


# ----- faults: every rank stops with an error, none hangs -----


FAILING_STEP = """
    import sys
    from common_dist import tiny_model, tiny_data, settings, make_optimizer
    from opgrad.distributed import DistributedTrainer, abort_on_error, world

    comm = world()
    where = sys.argv[1]
    with abort_on_error(comm, "script"):
        if where == "setup" and comm.rank == 1:
            raise ValueError("rank 1 could not read its shard")
        if where == "interrupt" and comm.rank == 1:
            raise KeyboardInterrupt
        images, labels = tiny_data()
        options = {**settings("adam"), "backend": "reference"}
        trainer = DistributedTrainer(tiny_model(), make_optimizer("adam"), **options)
        step = trainer.gradient_step
        def flaky(x, y, params, buffers, masks):
            if comm.rank == 1 and trainer.step == 3:
                if where == "step":
                    raise ValueError("bad batch on rank 1")
                if where == "exit":
                    import os
                    os._exit(3)
                if where == "kill":
                    import os, signal
                    os.kill(os.getpid(), signal.SIGKILL)
            return step(x, y, params, buffers, masks)
        trainer._gradient_step = flaky
        trainer.train_epoch(images, labels)
        if where == "save":
            trainer.save("no-such-directory/checkpoint.npz")
    print(f"rank {comm.rank} finished")
"""


def test_an_exception_in_one_ranks_step_stops_every_rank_with_an_error(tmp_path: Path) -> None:
    script = write_script(tmp_path, "failing.py", FAILING_STEP)
    done = run_mpi(["-n", "2", sys.executable, str(script), "step"], tmp_path, timeout=60)
    assert done.returncode != 0
    assert "ValueError: bad batch on rank 1" in done.stderr
    assert "script: error: [rank 0] rank 1 failed at step 4 (epoch 1)" in done.stderr
    assert "finished" not in done.stdout


def test_a_checkpoint_rank_0_cannot_write_stops_every_rank(tmp_path: Path) -> None:
    script = write_script(tmp_path, "failing.py", FAILING_STEP)
    done = run_mpi(["-n", "2", sys.executable, str(script), "save"], tmp_path, timeout=60)
    assert done.returncode != 0 and "finished" not in done.stdout
    assert "no-such-directory" in done.stderr
    assert "script: error: [rank 1] rank 0 failed while writing the checkpoint no-such-directory/checkpoint.npz" \
        in done.stderr


@pytest.mark.parametrize("where", ["setup", "exit", "kill"])
def test_a_rank_that_fails_alone_or_dies_ends_the_job(tmp_path: Path, where: str) -> None:
    script = write_script(tmp_path, "failing.py", FAILING_STEP)
    done = run_mpi(["-n", "2", sys.executable, str(script), where], tmp_path, timeout=60)
    assert done.returncode != 0
    assert "finished" not in done.stdout
    if where == "setup":  # raised outside any collective: printed, then MPI_Abort ends rank 0 too
        assert "script: rank 1 failed; ending every rank" in done.stderr
        assert "ValueError: rank 1 could not read its shard" in done.stderr


def test_ctrl_c_on_a_rank_ends_the_job_with_one_line(tmp_path: Path) -> None:
    """Ctrl-C is no failure to report: each interrupted rank says so in a line, as one process
    does, and the job ends with status 130."""
    script = write_script(tmp_path, "failing.py", FAILING_STEP)
    done = run_mpi(["-n", "2", sys.executable, str(script), "interrupt"], tmp_path, timeout=60)
    assert done.returncode == 130, done.stderr
    assert "script: [rank 1] interrupted" in done.stderr
    assert "Traceback" not in done.stderr and "failed" not in done.stderr


def opgrad_cli() -> str:
    return str(Path(sys.executable).parent / "opgrad")


def test_cli_a_rank_with_bad_data_or_other_weights_stops_every_rank(tmp_path: Path) -> None:
    common = ["train", "--distributed", "--model", "mlp", "--epochs", "1", "--max-steps", "2", "--test-limit", "50"]
    done = run_mpi(["-n", "1", opgrad_cli(), *common, ":", "-n", "1", opgrad_cli(), *common, "--data",
                    str(tmp_path / "missing")], tmp_path, timeout=60)
    assert done.returncode != 0
    assert "opgrad train: error:" in done.stderr and "missing" in done.stderr
    assert "rank 1 failed while loading the data" in done.stderr
    done = run_mpi(["-n", "1", opgrad_cli(), *common, ":", "-n", "1", opgrad_cli(), *common, "--seed", "1"],
                   tmp_path, timeout=60)
    assert done.returncode != 0
    assert "the training settings differ between the ranks: seed (here 0)" in done.stderr
    assert "every rank must be given the same options (opgrad train's flags" in done.stderr
    # Other data on one rank (here of another size) would run other numbers of steps until the
    # all-reduces no longer match: refused before the first step, on both ranks.
    other = tmp_path / "other"
    other.mkdir()
    mnist = load_embedded_mnist()
    (other / "train-images-idx3-ubyte").write_bytes(idx_images((mnist.train_images[:300, 0] * 255).round()))
    (other / "train-labels-idx1-ubyte").write_bytes(idx_labels(mnist.train_labels[:300]))
    (other / "t10k-images-idx3-ubyte").write_bytes(idx_images((mnist.test_images[:50, 0] * 255).round()))
    (other / "t10k-labels-idx1-ubyte").write_bytes(idx_labels(mnist.test_labels[:50]))
    done = run_mpi(["-n", "1", opgrad_cli(), *common, ":", "-n", "1", opgrad_cli(), *common, "--data", str(other)],
                   tmp_path, timeout=60)
    assert done.returncode != 0
    assert done.stderr.count("differ between the ranks") == 2 and "every rank must read the same --data" in done.stderr


# ----- checkpoints: rank 0 writes, a different number of ranks resumes -----


def test_cli_checkpoint_of_two_ranks_resumes_in_one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from opgrad import cli

    # Momentum rather than Adam: Adam scales each step to about lr whatever the gradient's size, so
    # the rounding of the averaged sum on weights whose gradient is ~0 (border pixels) shows as
    # ~1e-4 relative in those few weights; momentum keeps rounding at rounding size.
    common = ["--model", "mlp", "--max-steps", "4", "--test-limit", "50", "--lr-schedule", "constant",
              "--backend", "reference", "--optimizer", "momentum"]
    done = run_mpi(["-n", "2", opgrad_cli(), "train", "--distributed", *common, "--epochs", "1",
                    "--save", "two.npz"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("model mlp:") == 1  # rank 0 alone prints
    assert "data-parallel over 2 MPI rank(s): 16 examples per rank per step" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["two.npz"]  # one file, no temporaries
    _, meta = load_checkpoint(tmp_path / "two.npz")
    assert meta["ranks"] == 2 and meta["step"] == 4 and meta["epoch"] == 1
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", *common, "--epochs", "2", "--resume", "two.npz", "--save", "resumed.npz"]) == 0
    assert cli.main(["train", *common, "--epochs", "2", "--save", "straight.npz"]) == 0
    resumed, resumed_meta = load_checkpoint(tmp_path / "resumed.npz")
    straight, straight_meta = load_checkpoint(tmp_path / "straight.npz")
    assert resumed_meta["step"] == straight_meta["step"] == 8
    for name, value in straight.items():
        np.testing.assert_allclose(resumed[name], value, rtol=1e-5, atol=1e-5 * float(np.abs(value).max()),
                                   err_msg=name)
    assert resumed_meta["history"]["step_losses"][:4] == pytest.approx(straight_meta["history"]["step_losses"][:4],
                                                                         rel=1e-5)


def test_distributed_without_mpi4py_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from opgrad import cli, distributed

    monkeypatch.setitem(sys.modules, "mpi4py", None)  # as if it were not installed
    monkeypatch.setattr(distributed, "_WORLD", None)
    assert cli.main(["train", "--distributed", "--model", "mlp", "--epochs", "1", "--max-steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("opgrad train: error: distributed training needs mpi4py")
    assert 'pip install -e ".[distributed]"' in err and "\n" not in err


def test_an_mpi_library_that_cannot_be_loaded_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from opgrad import cli, distributed

    def unloadable(name: str) -> Any:
        raise RuntimeError("cannot load MPI library: libmpi.so.40: cannot open shared object file")

    package = types.ModuleType("mpi4py")
    package.__getattr__ = unloadable  # type: ignore[method-assign]  # what `from mpi4py import MPI` meets
    monkeypatch.setitem(sys.modules, "mpi4py", package)
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
    monkeypatch.setattr(distributed, "_WORLD", None)
    assert cli.main(["train", "--distributed", "--model", "mlp", "--epochs", "1", "--max-steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("opgrad train: error: distributed training needs an MPI library that mpi4py can load "
                          "(cannot load MPI library: libmpi.so.40") and "\n" not in err


def test_a_global_batch_smaller_than_the_world_is_refused() -> None:
    class FakeWorld:
        rank, size = 0, 4

    ns = tiny_namespace()
    with pytest.raises(ValueError, match="global batch size 3 is smaller than the number of ranks \\(4\\)"):
        DistributedTrainer(ns["tiny_model"](), SGD(), comm=FakeWorld(), batch_size=3)  # type: ignore[arg-type]



OWN_WEIGHTS = """
import sys
import numpy as np
from opgrad import nn
from opgrad.distributed import DistributedTrainer, RankFailedError, world

comm = world()
inp = nn.Input((6,))
model = nn.Model(inp, nn.Dense(3)(nn.Dense(5, activation="relu")(inp)))
model.params = model.init_params(seed=100 + comm.rank if sys.argv[1] == "apart" else 100)
try:
    DistributedTrainer(model, nn.SGD(), lr=0.1, batch_size=8, comm=comm)
except RankFailedError as exc:
    outcome = f"refused: {exc}"
else:
    outcome = "built"
with open(f"rank{comm.rank}.txt", "w") as handle:  # mpirun may interleave the ranks' printed lines
    handle.write(outcome)
"""


@pytest.mark.parametrize("weights", ["apart", "same"])
def test_ranks_holding_other_weights_are_refused(tmp_path: Path, weights: str) -> None:
    # A Trainer trains the weights its model holds; replicas that hold other ones would train apart.
    script = write_script(tmp_path, "own_weights.py", OWN_WEIGHTS)
    done = run_mpi(["-n", "2", sys.executable, str(script), weights], tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = [(tmp_path / f"rank{rank}.txt").read_text() for rank in range(2)]
    if weights == "apart":
        assert all("refused: the starting parameters and state differ between the ranks" in line for line in lines)
    else:
        assert lines == ["built", "built"]


RANKS_APART = """
import sys
import numpy as np
from opgrad import nn
from opgrad.checkpoint import load_checkpoint, save_checkpoint
from opgrad.distributed import DistributedTrainer, RankFailedError, world

comm = world()
case = sys.argv[1]
inp = nn.Input((6,))
model = nn.Model(inp, nn.Dense(3)(inp))
rng = np.random.default_rng(0)
x, y = rng.standard_normal((64, 6)).astype(np.float32), rng.integers(0, 3, 64)
options = {"lr": 0.1, "batch_size": 16, "seed": 0, "backend": "reference"}
if case == "batch":
    options["batch_size"] = 16 if comm.rank == 0 else 13
if case == "seed":
    options["seed"] = comm.rank
if case == "shard":  # PyTorch's DistributedSampler habit: each rank passes a data set of its own
    x, y = (x[:32], y[:32]) if comm.rank == 0 else (x[32:], y[32:])
if case == "stop_on_nan":
    options["stop_on_nan"] = comm.rank == 0
if case == "sync_batchnorm":
    options["sync_batchnorm"] = comm.rank == 0
if case == "backend":
    options["backend"] = "reference" if comm.rank == 0 else "llvm"
if case == "architecture":  # the same weight shapes, another activation
    model = nn.Model(inp, nn.Dense(3, activation="relu" if comm.rank == 0 else "tanh")(inp))
try:
    trainer = DistributedTrainer(model, nn.SGD(), comm=comm, **options)
    if case == "restore":
        trainer.train_epoch(x, y)
        arrays, meta = trainer.checkpoint()
        later = DistributedTrainer(model, nn.SGD(), comm=comm, **options)
        if comm.rank == 0:  # PyTorch's habit of loading on rank 0 alone
            later.restore(arrays, meta)
        later.train_epoch(x, y)
    elif case == "empty":
        trainer.evaluate(x[:0], y[:0])
    elif case == "evaluate_alone":  # Keras' habit of scoring on the chief worker only
        trainer.train_epoch(x, y)
        trainer.evaluate(x, y) if comm.rank == 0 else trainer.train_epoch(x, y)
    elif case == "save_alone":  # PyTorch's habit of saving on rank 0 alone
        trainer.train_epoch(x, y)
        trainer.save("alone.npz") if comm.rank == 0 else trainer.train_epoch(x, y)
    else:
        trainer.train_epoch(x, y)
except (RankFailedError, ValueError) as exc:
    outcome = f"refused: {type(exc).__name__}: {exc}"
else:
    outcome = "trained"
with open(f"rank{comm.rank}.txt", "w") as handle:
    handle.write(outcome)
"""


@pytest.mark.parametrize(("case", "says"), [
    ("batch", "the training settings differ between the ranks: batch_size (here "),
    ("seed", "the training settings differ between the ranks: seed (here "),
    ("shard", "the data given to DistributedTrainer.train_epoch differ between the ranks"),
    ("restore", "the training position at DistributedTrainer.train_epoch differ between the ranks: epoch (here "),
    ("empty", "DistributedTrainer.evaluate: no examples"),
    ("evaluate_alone", "the calls differ between the ranks: method (here 'DistributedTrainer."),
    ("save_alone", "the calls differ between the ranks: method (here 'DistributedTrainer."),
    ("stop_on_nan", "the training settings differ between the ranks: stop_on_nan (here "),
    ("sync_batchnorm", "the training settings differ between the ranks: sync_batchnorm (here "),
    ("backend", "the training settings differ between the ranks: backend (here "),
    ("architecture", "the training settings differ between the ranks: model.get_config() (here "),
    ("same", None),
])
def test_ranks_that_would_train_apart_stop_on_every_rank(tmp_path: Path, case: str, says: str | None) -> None:
    # Another batch size, seed, data set or restored checkpoint on one rank used rows twice or
    # never, hung in an all-reduce, or trained replicas apart; each is an error on every rank.
    script = write_script(tmp_path, "apart.py", RANKS_APART)
    done = run_mpi(["-n", "2", sys.executable, str(script), case], tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [(tmp_path / f"rank{rank}.txt").read_text() for rank in range(2)]
    if says is None:
        assert lines == ["trained", "trained"]
    else:
        assert all(line.startswith("refused: ") and says in line for line in lines), lines


COUNTER = """
import sys
import numpy as np
from opgrad import nn
from opgrad.distributed import DistributedTrainer, abort_on_error, world

comm = world()
inp = nn.Input((1, 6, 6))
hidden = nn.BatchNorm2D(momentum=None)(nn.Conv2D(2, 3)(inp))
model = nn.Model(inp, nn.Dense(3)(nn.Flatten()(hidden)), name="tiny")
rng = np.random.default_rng(1)
x, y = rng.normal(size=(1400, 1, 6, 6)).astype(np.float32), rng.integers(0, 3, 1400)
with abort_on_error(comm, "counter"):
    trainer = DistributedTrainer(model, nn.SGD(), comm=comm, sync_batchnorm=sys.argv[1] == "sync", lr=1e-2,
                                 batch_size=7)
    trainer.train_epoch(x, y)
    with open(f"rank{comm.rank}.txt", "w") as handle:
        handle.write(f"{trainer.step} {float(trainer.state['batchnorm1.num_batches_tracked'])!r}")
    sys.exit(0)
"""


@pytest.mark.parametrize("mode", ["local", "sync"])
def test_a_step_counter_stays_an_integer_over_the_ranks(tmp_path: Path, mode: str) -> None:
    # BatchNorm's cumulative average counts steps in a float buffer; averaged over the ranks as
    # row-weighted shares (4/7 + 3/7) it drifted off its integer, 200.00012 after 200 steps, and
    # moved every running statistic's weight. A clean sys.exit(0) inside abort_on_error ends the
    # job with status 0 (it was taken for a failure and aborted every rank).
    script = write_script(tmp_path, "counter.py", COUNTER)
    done = run_mpi(["-n", "2", sys.executable, str(script), mode], tmp_path, timeout=180)
    assert done.returncode == 0, done.stderr
    for rank in range(2):
        assert (tmp_path / f"rank{rank}.txt").read_text() == "200 200.0"


def test_train_under_mpirun_without_distributed_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from opgrad import cli

    monkeypatch.setenv("PMI_SIZE", "2")
    assert cli.main(["train", "--model", "mlp", "--epochs", "1", "--max-steps", "1"]) == 2
    assert "one of 2 processes started by mpirun, and without --distributed" in capsys.readouterr().err
