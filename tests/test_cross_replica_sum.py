"""cross_replica_sum and SyncBatchNorm inside one process.

Replicas are simulated with threads: each thread installs a reducer (opgrad.replicas.replica_group)
that meets the other threads at a barrier and sums their buffers, which is what an MPI Allreduce
does between ranks. The MPI runs are in test_distributed_syncbn.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import pytest

import opgrad
from opgrad import ops
from opgrad.checks import check_op
from opgrad.deploy import ExportError, export
from opgrad.ir import Expr
from opgrad.nn import BatchNorm2D, Conv2D, Dense, Flatten, ReLU, Sequential
from opgrad.nn.gradstep import GradientResult, GradientStep
from opgrad.nn.layers import ForwardContext
from opgrad.replicas import replica_group


class ThreadReplicas:
    """``size`` threads that sum buffers like ranks of an all-reduce (same order on every thread)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots: list[np.ndarray | None] = [None] * size

    def reducer(self, rank: int) -> Callable[[np.ndarray], None]:
        def reduce(buffer: np.ndarray) -> None:
            self.slots[rank] = buffer.copy()
            self.barrier.wait()
            total = np.array(self.slots[0], copy=True)
            for other in self.slots[1:]:
                total += other
            self.barrier.wait()
            buffer[...] = total

        return reduce

    def run(self, work: Callable[[int], object]) -> list[object]:
        results: list[object] = [None] * self.size
        errors: list[BaseException] = []

        def target(rank: int) -> None:
            try:
                with replica_group(self.reducer(rank)):
                    results[rank] = work(rank)
            except BaseException as exc:
                errors.append(exc)
                self.barrier.abort()

        threads = [threading.Thread(target=target, args=(rank,)) for rank in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


def scaled_sum_function() -> opgrad.Function:
    x = opgrad.var("x", (3, 4), "float32")
    y = ops.multiply(ops.cross_replica_sum(ops.multiply(x, 3.0)), 2.0)
    return opgrad.grad(opgrad.function([x], ops.sum(ops.multiply(y, y))), wrt=["x"])


@pytest.mark.parametrize("backend", ["reference", "llvm"])
def test_cross_replica_sum_passes_the_checker_as_the_identity_of_one_process(backend: str) -> None:
    report = check_op("cross_replica_sum", max_examples=25, seed=0, backend=backend)
    assert report.passed, report


def test_without_a_reducer_the_sum_is_the_identity_on_both_backends() -> None:
    fn = scaled_sum_function()
    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    loss, grad = opgrad.compile(fn)(data)
    assert loss == pytest.approx(36 * float((data * data).sum()))
    np.testing.assert_allclose(grad, 72 * data)
    np.testing.assert_array_equal(opgrad.evaluate(fn, data)[1], grad)


@pytest.mark.parametrize("backend", ["reference", "llvm"])
def test_two_replicas_sum_forward_and_gradient(backend: str) -> None:
    """y = 2 * sum_r(3 x_r): each replica's value sees both inputs, and so does its gradient."""
    fn = scaled_sum_function()
    # One compiled object per replica: calls on one object are serialized, as ranks' are not.
    runs = [opgrad.compile(fn) if backend == "llvm" else (lambda a: opgrad.evaluate(fn, a)) for _ in range(2)]
    inputs = [np.full((3, 4), 1.0, np.float32), np.full((3, 4), 2.0, np.float32)]
    results = ThreadReplicas(2).run(lambda rank: runs[rank](inputs[rank]))
    for loss, grad in results:  # type: ignore[misc]
        assert loss == pytest.approx(12 * 18.0**2)  # y = 2 * 3 * (1 + 2) = 18 everywhere
        # d/dx_r of sum_r' L_r' = 3 * sum_r'(2 * 2 y_r') = 3 * 2 * 72 = 432
        np.testing.assert_allclose(grad, 432.0)


@pytest.mark.parametrize("backend", ["reference", "llvm"])
def test_a_failing_reducer_raises_its_error_and_stops_the_step(backend: str) -> None:
    fn = scaled_sum_function()
    run = opgrad.compile(fn) if backend == "llvm" else (lambda a: opgrad.evaluate(fn, a))
    calls: list[int] = []

    def broken(buffer: np.ndarray) -> None:
        calls.append(buffer.size)
        raise ConnectionError("rank 3 is gone")

    data = np.ones((3, 4), np.float32)
    with replica_group(broken), pytest.raises(ConnectionError, match="rank 3 is gone"):
        run(data)
    assert calls == [12]  # the step stopped at the failed sum: the backward's sum never ran
    loss, _ = run(data)  # nothing left behind: the next call works (no reducer: one replica)
    assert loss == pytest.approx(36 * 12)


def test_sync_batchnorm_on_two_replicas_equals_one_batch_with_uneven_shards() -> None:
    backend = "reference"  # the compiled step runs under mpirun in test_distributed_syncbn.py
    model = Sequential([Conv2D(4, 3, use_bias=False), BatchNorm2D(), ReLU(), Flatten(), Dense(3)],
                       input_shape=(2, 6, 6), name="bn")
    params, buffers = model.init_params(0), model.init_buffers("float32")
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((9, 2, 6, 6)) * 2 + 1.5).astype(np.float32)
    y = rng.integers(0, 3, 9)
    whole = GradientStep(model, batch_size=9, backend=backend)(x, y, params, buffers)
    bounds = [(0, 5), (5, 9)]
    steps = [GradientStep(model, batch_size=b - a, backend=backend, sync_batchnorm=True, loss_scale=(b - a) / 9)
             for a, b in bounds]

    def shard(rank: int) -> GradientResult:
        a, b = bounds[rank]
        return steps[rank](x[a:b], y[a:b], params, buffers)

    parts: list[GradientResult] = ThreadReplicas(2).run(shard)  # type: ignore[assignment]
    assert parts[0].loss + parts[1].loss == pytest.approx(whole.loss, rel=1e-6)
    for name, grad in whole.grads.items():
        np.testing.assert_allclose(parts[0].grads[name] + parts[1].grads[name], grad, rtol=1e-5,
                                   atol=1e-6 * float(np.abs(grad).max()), err_msg=name)
    for name, value in whole.buffers.items():  # every replica's running statistics are the global ones
        for part in parts:
            np.testing.assert_allclose(part.buffers[name], value, rtol=1e-6, err_msg=name)
    # Per-rank statistics (PyTorch's default) are another computation: the option does something.
    local = [GradientStep(model, batch_size=b - a, backend=backend, loss_scale=(b - a) / 9) for a, b in bounds]
    summed = sum(local[r](x[a:b], y[a:b], params, buffers).grads["batchnorm1.weight"]
                 for r, (a, b) in enumerate(bounds))
    assert not np.allclose(summed, whole.grads["batchnorm1.weight"], rtol=1e-3)


class ReplicaSummed(Flatten):
    """A user's layer that sums over replicas: it cannot run in an exported C library."""

    kind = "test_replica_summed"

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        return ops.cross_replica_sum(super().apply(x, params, ctx))


def test_export_refuses_a_graph_that_sums_over_replicas(tmp_path: Path) -> None:
    model = Sequential([ReplicaSummed(), Dense(10)], input_shape=(1, 28, 28), name="summed")
    with pytest.raises(ExportError, match=r"cross_replica_sum.*MPI communicator.*an exported library has none"):
        export(tmp_path / "out", model=model, optimizer="sgd", batch_size=2, object_only=True)
    assert not (tmp_path / "out").exists()
