"""Data-parallel training over MPI: every rank runs the same compiled step on its shard of the batch.

The design is Horovod's and PyTorch DDP's, on ``mpi4py`` (``pip install 'opgrad[distributed]'``
brings ``mpi4py`` and MPICH's ``mpirun``; a cluster's own MPI works the same under ``mpirun`` or
``srun``):

* every rank holds the whole model, parameters and optimizer state, identical on every rank;
* each step every rank draws the same global batch (the batch order depends on the seed and the
  epoch only), takes its contiguous block of rows (:func:`shard_bounds`), and runs the compiled
  forward + backward (:class:`~opgrad.nn.gradstep.GradientStep`) on it;
* the gradients, the loss, the BatchNorm running statistics and one failure flag per rank are
  packed into ONE contiguous buffer (:class:`FusedBuffer`) and summed by one ``Allreduce``;
  each rank's share is weighted by its row count, so the sum is the mean over the global batch
  even when the batch does not split evenly;
* every rank runs the compiled optimizer update (:class:`~opgrad.nn.gradstep.UpdateStep`) on the
  averaged gradients, so the parameters stay identical without being sent;
* rank 0 alone prints and writes checkpoints (atomically, as ``opgrad.checkpoint`` always does).

Dropout masks and augmentation shifts are drawn for the whole global batch from the step's seed
and sliced, so N ranks with global batch B compute what one process with batch B computes.
BatchNorm normalizes with each rank's own batch statistics by default (PyTorch's default without
``SyncBatchNorm``); the running statistics are averaged over the ranks in the same all-reduce,
so every rank, and every checkpoint, holds the same values. ``sync_batchnorm=True``
(``--sync-batchnorm``, PyTorch's ``SyncBatchNorm``) normalizes with the statistics of the global
batch instead: BatchNorm sums its per-channel statistics over the ranks inside the compiled step
(``opgrad.ops.cross_replica_sum``, whose gradient is the same sum of the output gradient; four
small all-reduces per BatchNorm layer, two in the forward and two in the backward, through
:class:`ReplicaReducer`), and each rank's loss is scaled by its share of the batch before the
backward, so the step equals one process's with the whole batch, uneven shards included.

Faults: a rank whose step raises (bad data, a bug, a diverging loss) still joins the all-reduce
with its flag set, so every rank learns at the same step which ranks failed and stops with an
error naming them (:class:`RankFailedError`) instead of waiting forever. With synchronized
BatchNorm it first joins the step's remaining BatchNorm sums with a failure mark, which stops the
peers waiting in them (:class:`ReplicaReducer`). A failure outside a step
on one rank only (:func:`agree` is not reached) aborts the whole job through ``MPI_Abort`` after
printing the error (:func:`abort_on_error`); a rank that dies is cleaned up by ``mpirun``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import numpy as np

from opgrad.env import NUM_THREADS_VAR
from opgrad.errors import ConfigError, NonFiniteLossError, UserError
from opgrad.ir import Call, topological_order
from opgrad.nn.gradstep import GradientStep, UpdateStep
from opgrad.nn.losses import CLASS_LABEL_LOSS, accuracy, cross_entropy_numpy
from opgrad.nn.model import Model
from opgrad.nn.optim import Optimizer
from opgrad.nn.schedules import Schedule
from opgrad.nn.trainer import (
    Inputs,
    Labels,
    Trainer,
    cut_labels,
    first_labels,
    label_rows,
    noise_rng,
)
from opgrad.replicas import replica_group

__all__ = [
    "Communicator",
    "DistributedTrainer",
    "FusedBuffer",
    "PeerStepFailed",
    "RankFailedError",
    "ReplicaReducer",
    "abort_on_error",
    "agree",
    "check_same_everywhere",
    "shard_bounds",
    "share_cores",
    "world",
]

T = TypeVar("T")
#: Seconds a failing rank waits after printing its error before MPI_Abort (see abort_on_error).
ABORT_GRACE_SECONDS = 0.2
INSTALL_HINT = ("install it with `pip install 'opgrad[distributed]'` (in a checkout: "
                "`pip install -e \".[distributed]\"`; either brings mpi4py and MPICH's mpirun)")


class RankFailedError(UserError, RuntimeError):
    """Another rank failed; this rank stops with it. The failing rank printed its own error."""

    exit_code = 1


class PeerStepFailed(RuntimeError):
    """Raised inside a step on the ranks whose peers' step failed (see :class:`ReplicaReducer`)."""


class Communicator:
    """The few collectives data-parallel training needs, over an ``mpi4py`` communicator.

    ``comm`` defaults to ``MPI.COMM_WORLD``. Every method is collective unless it says otherwise:
    all ranks call it, in the same order.
    """

    def __init__(self, comm: Any = None) -> None:
        try:
            from mpi4py import MPI
        except ImportError as exc:
            raise ConfigError(f"distributed training needs mpi4py ({exc}); {INSTALL_HINT}") from None
        except RuntimeError as exc:  # mpi4py is there, but the MPI library it was built for cannot be loaded
            raise ConfigError(f"distributed training needs an MPI library that mpi4py can load ({exc}); "
                              f"{INSTALL_HINT}") from None
        self.mpi = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank: int = self.comm.Get_rank()
        self.size: int = self.comm.Get_size()

    @property
    def is_root(self) -> bool:
        """Rank 0, the one that prints and writes files (not collective)."""
        return self.rank == 0

    def ranks_on_this_host(self) -> int:
        """How many ranks share this machine (its cores)."""
        local = self.comm.Split_type(self.mpi.COMM_TYPE_SHARED, key=self.rank)
        try:
            return int(local.Get_size())
        finally:
            local.Free()

    def allreduce_sum(self, buffer: np.ndarray) -> np.ndarray:
        """Sum ``buffer`` (contiguous) over every rank, in place; returns it."""
        if not buffer.flags.c_contiguous:
            raise ValueError("allreduce_sum needs a contiguous buffer")
        self.comm.Allreduce(self.mpi.IN_PLACE, buffer, op=self.mpi.SUM)
        return buffer

    def barrier(self) -> None:
        self.comm.Barrier()

    def abort(self, exit_code: int) -> None:
        """End every rank of the job now (not collective: one rank calls it)."""
        self.comm.Abort(exit_code)


_WORLD: Communicator | None = None


def world() -> Communicator:
    """The communicator of every rank of this job (``MPI.COMM_WORLD``), created once."""
    global _WORLD
    if _WORLD is None:
        _WORLD = Communicator()
    return _WORLD


class ReplicaReducer:
    """The reducer of a step's ``cross_replica_sum`` calls (SyncBatchNorm's sums) over ``comm``'s ranks.

    Each sum is an ``Allreduce`` on a communicator of its own (a duplicate of ``comm``'s), so it
    never matches the step's fused all-reduce by mistake, with one more value appended: how many
    ranks have failed. A rank whose step fails (before the compiled step, or inside it) cannot
    simply leave: its peers wait in the step's next sum. So it joins every sum the step has left
    (:meth:`drain`, the sizes come from the graph, :meth:`expect`) with that value set; each peer
    sees it in the very sum where it waits, raises :class:`PeerStepFailed`, which stops its step,
    and drains the rest too. Every rank then reaches the step's fused all-reduce, whose failure
    flags name the rank that failed. ``seconds`` adds up the time spent in the sums.
    """

    def __init__(self, comm: Communicator) -> None:
        self.mpi = comm.mpi
        self.comm = comm.comm.Dup()
        self.schedule: list[tuple[int, np.dtype[Any]]] = []
        self.done = 0
        self.seconds = 0.0

    def expect(self, outputs: Sequence[Any]) -> None:
        """Record the sums of a step computing ``outputs``: their sizes, in the order both backends run them."""
        self.schedule = [(call.type.size, np.dtype(call.dtype)) for call in topological_order(outputs)
                         if isinstance(call, Call) and call.op.name == "cross_replica_sum" and call.type.size]

    def start_step(self) -> None:
        self.done = 0

    def __call__(self, data: np.ndarray) -> None:
        packed = np.empty(data.size + 1, data.dtype)
        packed[:-1] = data.reshape(-1)
        packed[-1] = 0
        self._allreduce(packed)
        if packed[-1] != 0:
            raise PeerStepFailed("another rank's step failed")
        data.reshape(-1)[:] = packed[:-1]

    def drain(self) -> None:
        """Join the sums this step has left, flagged as failed (after this rank's step stopped)."""
        for size, dtype in self.schedule[self.done :]:
            packed = np.zeros(size + 1, dtype)
            packed[-1] = 1
            self._allreduce(packed)

    def _allreduce(self, packed: np.ndarray) -> None:
        started = time.perf_counter()
        self.comm.Allreduce(self.mpi.IN_PLACE, packed, op=self.mpi.SUM)
        self.done += 1
        self.seconds += time.perf_counter() - started


def shard_bounds(total: int, rank: int, size: int) -> tuple[int, int]:
    """``(start, stop)`` of ``rank``'s contiguous block when ``total`` rows go to ``size`` ranks.

    The first ``total % size`` ranks take one row more, so block sizes differ by at most one,
    every row goes to exactly one rank, and the split depends on nothing but the three numbers.
    """
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"shard_bounds: rank {rank} is not in a world of {size} rank(s)")
    base, extra = divmod(total, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def agree(comm: Communicator, what: str, action: Callable[[], T]) -> T:
    """Run ``action`` on every rank; if it raises on any rank, every rank raises.

    The rank that failed re-raises its own exception; the others raise :class:`RankFailedError`
    naming the failed ranks and ``what`` was being done. This is the check-in that turns one
    rank's failure into a clean stop everywhere rather than a hang in the next collective.
    """
    error: BaseException | None = None
    result: Any = None
    try:
        result = action()
    except Exception as exc:
        error = exc
    flags = np.zeros(comm.size, np.int32)
    flags[comm.rank] = error is not None
    comm.allreduce_sum(flags)
    failed = np.flatnonzero(flags).tolist()
    if error is not None:
        raise _collective(error)
    if failed:
        raise _collective(RankFailedError(f"rank {_ranks(failed)} failed while {what} (its error is printed "
                                          f"above); rank {comm.rank} stops too"))
    return result  # type: ignore[no-any-return]


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)


@contextmanager
def abort_on_error(comm: Communicator, command: str) -> Iterator[None]:
    """Around a distributed run: every rank that fails says why, and the whole job ends.

    An exception every rank raised together (after :func:`agree` or a failed step): each rank
    prints its error (one line for a user's mistake, the traceback for anything else), the ranks
    meet once more, and each exits with the error's exit status. Meeting after printing matters:
    mpirun ends the job as soon as one rank exits with an error, which would cut off a message
    another rank is still writing. Any other exception means the other ranks may be waiting in a
    collective this rank will never join: the error is printed and ``MPI_Abort`` ends every rank.
    (An MPI rank that merely exits leaves the others waiting forever.) With one rank the
    exception propagates unchanged.
    """
    try:
        yield
    except SystemExit as exc:
        # sys.exit(0) is a clean end; another status ends every rank with it, as an error would.
        if comm.size == 1 or exc.code in (0, None):
            raise
        code = exc.code if isinstance(exc.code, int) else 1
        if not isinstance(exc.code, int):
            print(f"{command}: [rank {comm.rank}] {exc.code}", file=sys.stderr)
        sys.stderr.flush()
        time.sleep(ABORT_GRACE_SECONDS)
        comm.abort(code)
        raise
    except BaseException as exc:
        if comm.size == 1:
            raise
        code = exc.exit_code if isinstance(exc, UserError) else 130 if isinstance(exc, KeyboardInterrupt) else 1
        if not getattr(exc, "collective", False):
            if isinstance(exc, KeyboardInterrupt):  # Ctrl-C reaches every rank: a line each, as one process prints
                print(f"{command}: [rank {comm.rank}] interrupted", file=sys.stderr)
            else:
                if not isinstance(exc, UserError):
                    print(f"{command}: rank {comm.rank} failed; ending every rank:", file=sys.stderr)
                _report(exc, comm.rank, command)
            # mpiexec forwards a rank's stderr through a pipe; MPI_Abort kills the rank before
            # the forwarder has read it, and the message is lost (seen once in about ten runs).
            sys.stderr.flush()
            time.sleep(ABORT_GRACE_SECONDS)
            comm.abort(code)
            if isinstance(exc, KeyboardInterrupt):
                # MPICH's abort may return before it ends this rank; Python would then print the
                # interrupt's traceback on the way out. Said once already: leave at once.
                os._exit(code)
            raise
        _report(exc, comm.rank, command)
        comm.barrier()
        raise SystemExit(code) from None


def _report(exc: BaseException, rank: int, command: str) -> None:
    """Print a rank's error to stderr now: one line for a user's mistake, else the traceback."""
    if isinstance(exc, UserError):
        message = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        print(f"{command}: error: [rank {rank}] {message}", file=sys.stderr, flush=True)
    else:
        traceback.print_exception(exc)
        sys.stderr.flush()


def share_cores(comm: Communicator) -> None:
    """Give each rank its share of this machine's cores for compiled kernels.

    Without it every rank starts one worker thread per core and N ranks on one machine run N
    times too many threads. An explicit ``$OPGRAD_NUM_THREADS`` is kept. Collective.
    """
    local = comm.ranks_on_this_host()
    if os.environ.get(NUM_THREADS_VAR, "").strip():
        return
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    share = max(1, cores // max(1, local))
    from opgrad.compiler.threads import pool_size, pool_started

    if pool_started() and pool_size() > share:
        warnings.warn(f"opgrad: this rank's compiled kernels already run {pool_size()} worker threads, started "
                      f"before the ranks shared this machine's {cores} cores ({share} each for {local} ranks): set "
                      f"{NUM_THREADS_VAR}={share}, or build the DistributedTrainer before compiling anything else",
                      stacklevel=3)
        return
    os.environ[NUM_THREADS_VAR] = str(share)


def check_same_everywhere(comm: Communicator, arrays: Mapping[str, np.ndarray], what: str,
                          remedy: str = "every rank must start from the same --seed and the same checkpoint") -> None:
    """Raise on every rank unless ``arrays`` are bitwise the same on every rank. Collective.

    Ranks that start from different weights (another ``--seed``, another checkpoint) would
    silently train different models that share gradients, and ranks with other data would run
    other numbers of steps until their all-reduces no longer match; one 64-bit digest per rank,
    compared with a min and a max all-reduce, catches either before the first step. ``remedy``
    ends the message.
    """
    digest = hashlib.sha256()
    for name in sorted(arrays):
        value = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}:{value.dtype.str}:{value.shape}".encode())
        digest.update(value.tobytes())
    mine = np.frombuffer(digest.digest()[:8], np.uint64).copy()
    low, high = mine.copy(), mine.copy()
    comm.comm.Allreduce(comm.mpi.IN_PLACE, low, op=comm.mpi.MIN)
    comm.comm.Allreduce(comm.mpi.IN_PLACE, high, op=comm.mpi.MAX)
    if low[0] != high[0]:
        raise _collective(RankFailedError(
            f"{what} differ between the ranks (rank {comm.rank} of {comm.size}); {remedy}"))


def check_settings_everywhere(comm: Communicator, settings: Mapping[str, Any], what: str, remedy: str) -> None:
    """Raise on every rank, naming the settings that differ, unless each of ``settings`` (name ->
    a value with a stable ``repr``) is the same on every rank. Collective: one min and one max
    all-reduce of a digest per setting."""
    names = sorted(settings)
    mine = np.array([int.from_bytes(hashlib.sha256(repr(settings[name]).encode()).digest()[:8], "little")
                     for name in names], np.uint64)
    low, high = mine.copy(), mine.copy()
    comm.comm.Allreduce(comm.mpi.IN_PLACE, low, op=comm.mpi.MIN)
    comm.comm.Allreduce(comm.mpi.IN_PLACE, high, op=comm.mpi.MAX)
    differ = [name for name, a, b in zip(names, low, high, strict=True) if a != b]
    if differ:
        shown = ", ".join(f"{name} (here {settings[name]!r})" for name in differ)
        raise _collective(RankFailedError(f"{what} differ between the ranks: {shown} on rank {comm.rank} of "
                                          f"{comm.size}; {remedy}"))


def _collective(exc: BaseException) -> BaseException:
    """Mark ``exc`` as raised on every rank at the same point (see :func:`abort_on_error`)."""
    exc.collective = True  # type: ignore[attr-defined]
    return exc


class FusedBuffer:
    """One contiguous array that carries a step's whole all-reduce, and views into it.

    Layout: ``[failure flag per rank | loss | every gradient, flattened | every buffer]``.
    Packing copies each array into its slot once; after the all-reduce the slots are read back
    as reshaped views, without copies.
    """

    def __init__(self, size: int, shapes: Mapping[str, tuple[int, ...]], dtype: str) -> None:
        self.flags = slice(0, size)
        self.loss_index = size
        offset = size + 1
        self.slots: dict[str, tuple[int, int, tuple[int, ...]]] = {}
        for name, shape in shapes.items():
            count = int(np.prod(shape, dtype=np.int64))
            self.slots[name] = (offset, offset + count, tuple(shape))
            offset += count
        self.array = np.zeros(offset, dtype=dtype)

    def pack(self, loss: float, arrays: Mapping[str, np.ndarray], weight: float) -> None:
        """Write ``weight * loss`` and ``weight * array`` for every slot; flags cleared."""
        self.array[self.flags] = 0
        self.array[self.loss_index] = loss * weight
        for name, (start, stop, _) in self.slots.items():
            np.multiply(arrays[name].reshape(-1), weight, out=self.array[start:stop])

    def mark_failed(self, rank: int) -> None:
        self.array[:] = 0
        self.array[self.flags.start + rank] = 1

    def failed_ranks(self) -> list[int]:
        return [int(rank) for rank in np.flatnonzero(self.array[self.flags])]

    @property
    def loss(self) -> float:
        return float(self.array[self.loss_index])

    def view(self, name: str) -> np.ndarray:
        start, stop, shape = self.slots[name]
        return self.array[start:stop].reshape(shape)


class DistributedTrainer(Trainer):
    """A :class:`~opgrad.nn.trainer.Trainer` whose steps are split over the ranks of ``comm``.

    ``batch_size`` is the global batch: each step every rank computes the gradients of its block
    of it and the all-reduced mean updates every rank's copy of the parameters. Everything else
    (schedules, seeds, checkpoints, ``restore``, evaluation) is the Trainer's, so a checkpoint of
    a distributed run resumes on any number of ranks, or in one plain process. Evaluation is
    sharded too, and returns the same numbers on every rank. With one rank the Trainer's fused
    step runs (``fused_when_alone=False`` keeps the split step, which benchmarks measure).

    ``sync_batchnorm=True`` is PyTorch's ``SyncBatchNorm``: every BatchNorm layer normalizes with
    the mean and variance of the global batch, through sums over the ranks inside the step
    (:class:`ReplicaReducer`), so N ranks compute what one process with the whole batch computes,
    BatchNorm included. Without it each rank uses its own rows' statistics (PyTorch's default).
    """

    def __init__(self, model: Model, optimizer: Optimizer, *, comm: Communicator | None = None,
                 lr: float | Schedule = 1e-3, batch_size: int = 32, seed: int = 0, dtype: str = "float32",
                 backend: str = "reference", eval_batch_size: int = 100, augment_shift: int = 0,
                 augment_rotate: float = 0.0, augment_scale: float = 0.0,
                 params: Mapping[str, np.ndarray] | None = None, stop_on_nan: bool = True,
                 fused_when_alone: bool = True, sync_batchnorm: bool = False,
                 loss_weights: Sequence[float] | None = None, loss: str | Sequence[str] = CLASS_LABEL_LOSS) -> None:
        super().__init__(model, optimizer, lr=lr, batch_size=batch_size, seed=seed, dtype=dtype, backend=backend,
                         eval_batch_size=eval_batch_size, augment_shift=augment_shift,
                         augment_rotate=augment_rotate, augment_scale=augment_scale, params=params,
                         stop_on_nan=stop_on_nan, loss_weights=loss_weights, loss=loss)
        self.comm = comm if comm is not None else world()
        if batch_size < self.comm.size:
            raise ConfigError(f"the global batch size {batch_size} is smaller than the number of ranks "
                              f"({self.comm.size}); every rank needs at least one example per step")
        share_cores(self.comm)  # before the first kernel starts the pool
        self.rows = shard_bounds(batch_size, self.comm.rank, self.comm.size)
        self.sync_batchnorm = bool(sync_batchnorm)
        if self.comm.size > 1:
            # Every rank takes its rows of one global batch drawn from the seed, and the ranks
            # average their gradients into one model: another batch size, seed or schedule would
            # use rows twice or never and train apart; so would replicas that start apart.
            check_settings_everywhere(self.comm, self.run_settings(), "the training settings",
                                      "every rank must be given the same options (opgrad train's flags, "
                                      "DistributedTrainer's arguments)")
            check_same_everywhere(self.comm, {**self.params, **self.state}, "the starting parameters and state",
                                  "every rank must start from the same weights: the same --seed (seed), "
                                  "checkpoint or params")
        # Alone, nothing is averaged: the single fused step computes the same numbers, faster.
        self.fused = fused_when_alone and self.comm.size == 1
        # Alone, the global batch is this rank's: the plain step computes the same statistics.
        self._reducer: ReplicaReducer | None = (ReplicaReducer(self.comm) if self.sync_batchnorm and self.comm.size > 1
                                                else None)
        self._gradient_step: GradientStep | None = None
        self._update_step: UpdateStep | None = None
        self._buffer: FusedBuffer | None = None
        #: This rank's buffers after its part of the step, before the all-reduce.
        self._local_buffers: dict[str, np.ndarray] = {}
        #: Seconds spent in each phase of the steps so far: local forward + backward (with the
        #: batch slicing and packing), the all-reduce (waiting for the slowest rank included),
        #: and the optimizer update; ``timed_steps`` counts the steps.
        self.times: dict[str, float] = {}
        self.timed_steps = 0
        self.reset_times()

    def run_settings(self) -> dict[str, Any]:
        """What every rank must agree on: the step's batch and update, and how batches are drawn."""
        return {"batch_size": self.batch_size, "seed": self.seed, "dtype": self.dtype,
                "optimizer": self.optimizer.describe(), "lr": self.schedule.describe(), "step": self.step,
                "epoch": self.epoch, "eval_batch_size": self.eval_batch_size, "augment": (
                    self.augment_shift, self.augment_rotate, self.augment_scale),
                "sync_batchnorm": self.sync_batchnorm, "stop_on_nan": bool(self.stop_on_nan),
                "backend": self.backend, "model": self.model.name,
                # Another architecture with the same weight shapes would train apart unseen.
                "model.get_config()": hashlib.sha256(json.dumps(self.model.get_config(), sort_keys=True,
                                                          default=str).encode()).hexdigest()[:16]}

    def _check_same_method(self, method: str) -> None:
        """Every collective method starts here, so that ranks in different methods meet in
        collectives of one size and stop with an error, rather than in the next all-reduce whose
        buffers differ (MPI's "Message truncated") or, worse, have the same size."""
        check_settings_everywhere(self.comm, {"method": method}, "the calls",
                                  "every rank calls the same DistributedTrainer method at the same point "
                                  "(train, evaluate and save on every rank, not on rank 0 alone)")

    def _check_agreement(self, inputs: Inputs, labels: Labels, who: str, weights: bool = False) -> None:
        """Before ``who`` runs, every rank must stand at the same step and epoch (a checkpoint restored
        on some ranks only moves them) and pass the same whole data set, each taking its own rows of
        every batch; with ``weights``, hold the same parameters and state too (once an epoch: a
        digest of every weight). Collective: every rank calls the same method."""
        if self.comm.size == 1:
            return
        self._check_same_method(who.split(" (", 1)[0])
        check_settings_everywhere(self.comm, {"step": self.step, "epoch": self.epoch},
                                  f"the training position at {who}", "every rank must restore the same checkpoint "
                                  "(call restore on every rank)")
        arrays = self._input_arrays(inputs, labels, who, classes=False)
        named = {f"input {i}": a for i, a in enumerate(arrays)}
        named.update({f"labels {i}": np.asarray(y) for i, y in enumerate(
            labels if isinstance(labels, (list, tuple)) else [labels])})
        check_same_everywhere(self.comm, named, f"the data given to {who}", "every rank passes the same whole "
                              "data set (each takes its own rows of every batch), not a shard of its own")
        if weights:
            check_same_everywhere(self.comm, {**self.params, **self.state}, f"the parameters and state at {who}",
                                  "every rank must restore the same checkpoint (call restore on every rank)")

    def train_epoch(self, inputs: Inputs, labels: Labels, **options: Any) -> float:
        """The Trainer's epoch, once every rank is found at the same position, with the same data and
        weights (one digest each)."""
        self._check_agreement(inputs, labels, "DistributedTrainer.train_epoch", weights=True)
        return super().train_epoch(inputs, labels, **options)

    def train_batch(self, inputs: Inputs, labels: Labels) -> float:
        self._check_agreement(inputs, labels, "DistributedTrainer.train_batch")
        return super().train_batch(inputs, labels)

    def train_batches(self, batches: Sequence[tuple[Inputs, Labels]]) -> list[float]:
        for i, (inputs, labels) in enumerate(batches):
            self._check_agreement(inputs, labels, f"DistributedTrainer.train_batches (batch {i})")
        return super().train_batches(batches)

    def reset_times(self) -> None:
        """Start :attr:`times` and :attr:`timed_steps` from zero (per epoch, say)."""
        self.times = {"gradients": 0.0, "allreduce": 0.0, "update": 0.0, "batchnorm_sums": 0.0}
        self.timed_steps = 0

    @property
    def local_batch_size(self) -> int:
        return self.rows[1] - self.rows[0]

    @property
    def share(self) -> float:
        """This rank's fraction of the global batch: its weight in the step's sums."""
        return self.local_batch_size / self.batch_size

    def reset_steps(self) -> None:
        super().reset_steps()
        self._gradient_step, self._update_step, self._buffer = None, None, None

    @property
    def gradient_step(self) -> GradientStep:
        self.follow_trainable()
        if self._gradient_step is None:
            # Synchronized, every rank's loss is scaled by its share of the batch before the
            # backward: the sums over ranks in the backward then add gradients of the global
            # mean loss, and the fused all-reduce adds the shares unweighted (see _local_gradients).
            sync = self._reducer is not None
            step = GradientStep(self.model, batch_size=self.local_batch_size, dtype=self.dtype, backend=self.backend,
                                loss_weights=self.loss_weights, loss=self.losses, sync_batchnorm=sync,
                                loss_scale=self.share if sync else 1.0)
            if self._reducer is not None:
                self._reducer.expect(step.function.outputs)
            self._gradient_step = step
        return self._gradient_step

    @property
    def update_step(self) -> UpdateStep:
        self.follow_trainable()
        if self._update_step is None:
            self._update_step = UpdateStep(self.model, self.optimizer, dtype=self.dtype, backend=self.backend)
        return self._update_step

    @property
    def fused_buffer(self) -> FusedBuffer:
        self.follow_trainable()
        if self._buffer is None:
            shapes = {**self.model.trainable_param_shapes(), **self.model.buffer_shapes()}
            self._buffer = FusedBuffer(self.comm.size, shapes, self.dtype)
        return self._buffer

    # ----- one step: local gradients, one all-reduce, the update everywhere -----

    def _local_gradients(self, inputs: list[np.ndarray], labels: Labels) -> None:
        """This rank's share of the step, packed into the fused buffer (weighted by its rows)."""
        if label_rows(labels) != self.batch_size:
            raise ValueError(f"distributed step: the global batch has {label_rows(labels)} rows, expected "
                             f"{self.batch_size} (every rank passes the same whole batch)")
        augmented = self._augmented(inputs, self.step)
        masks = self.model.sample_noise(noise_rng(self.seed, self.step), self.batch_size, self.dtype)
        start, stop = self.rows
        local_masks = {name: np.ascontiguousarray(m[start:stop]) for name, m in masks.items()}
        x = self._one_or_list([np.ascontiguousarray(array[start:stop], dtype=dtype)
                               for array, dtype in zip(augmented, self._input_dtypes)])
        y = self.step_labels(cut_labels(labels, slice(start, stop)))
        if self._reducer is None:
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                result = self.gradient_step(x, y, self.params, self.model.buffers, local_masks)
            self.fused_buffer.pack(result.loss, {**result.grads, **result.buffers}, self.share)
            self._local_buffers = result.buffers
            return
        step = self.gradient_step
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"), replica_group(self._reducer):
            result = step(x, y, self.params, self.model.buffers, local_masks)
        # The loss and gradients are already this rank's share; the running statistics, the same
        # on every rank, are weighted so that their sum is that value.
        self.fused_buffer.pack(result.loss, {**result.grads, **{name: value * self.share for name, value
                                                                in result.buffers.items()}}, 1.0)
        self._local_buffers = result.buffers

    def _train_batch(self, inputs: list[np.ndarray], labels: Labels, *, epoch_step: int | None) -> float:
        if self.fused:
            return super()._train_batch(inputs, labels, epoch_step=epoch_step)
        buffer = self.fused_buffer  # rebuilt, with the steps, where layers were frozen or unfrozen
        error: Exception | None = None
        started = time.perf_counter()
        reducer = self._reducer
        if reducer is not None:
            if self._gradient_step is None:
                # A rank that failed to build its step could not tell its peers, already waiting
                # in the step's first BatchNorm sum, how many sums to expect: build in a check-in.
                agree(self.comm, "building the synchronized training step",
                      lambda: (self.gradient_step, self.update_step))
            reducer.start_step()
        sums_before = reducer.seconds if reducer is not None else 0.0
        peer_failed = False
        try:
            # Both halves are built (compiled) inside the check-in, and outside the timings.
            _ = self.gradient_step, self.update_step
            started = time.perf_counter()
            self._local_gradients(inputs, labels)
        except PeerStepFailed:
            peer_failed = True
            buffer.array[:] = 0  # not this rank: the flags of the fused all-reduce name the one that failed
        except Exception as exc:
            error = exc
            buffer.mark_failed(self.comm.rank)
        if reducer is not None and reducer.done < len(reducer.schedule):
            reducer.drain()
        computed = time.perf_counter()
        self.comm.allreduce_sum(buffer.array)
        reduced = time.perf_counter()
        failed = buffer.failed_ranks()
        if error is not None:
            raise _collective(error)
        if failed or peer_failed:
            raise _collective(RankFailedError(
                f"rank {_ranks(failed)} failed at step {self.step + 1} (epoch {self.epoch + 1}); its error is "
                f"printed above; rank {self.comm.rank} stops too"))
        loss = buffer.loss
        lr = self.schedule(self.step)
        if self.stop_on_nan and not np.isfinite(loss):
            raise _collective(NonFiniteLossError(loss, epoch=self.epoch + 1, step=self.step + 1, lr=lr,
                                                 epoch_step=epoch_step))
        grads = {name: buffer.view(name) for name in self.update_step.param_names}
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            params, optimizer_state = self.update_step(self.params, grads, self.state, lr)
        # The views are overwritten by the next step's all-reduce: keep copies of the buffers.
        self.params = {**self.params, **params}
        # A counter is the same on every rank: each keeps its own (the float sum of its shares may not be).
        local = self._local_buffers
        self.state = {**self.kept_state(optimizer_state),
                      **{name: (np.array(local[name]) if spec.counter else buffer.view(name).copy())
                                            for name, spec in self.model.buffer_specs().items()}}
        self.times["gradients"] += computed - started
        self.times["batchnorm_sums"] += (reducer.seconds - sums_before) if reducer is not None else 0.0
        self.times["allreduce"] += reduced - computed
        self.times["update"] += time.perf_counter() - reduced
        self.timed_steps += 1
        self.step += 1
        self.history.record_step(loss)
        return loss

    def _train_batches(self, batches: Sequence[tuple[list[np.ndarray], Labels]], *,
                       epoch_step: int | None) -> list[float]:
        if self.fused:
            return super()._train_batches(batches, epoch_step=epoch_step)
        # Each step needs its all-reduce, so the native multi-step loop does not apply.
        first = 1 if epoch_step is None else epoch_step
        return [self._train_batch(x, y, epoch_step=None if epoch_step is None else first + i)
                for i, (x, y) in enumerate(batches)]

    # ----- evaluation: every rank scores its block of the data, the counts are summed -----

    def evaluate(self, inputs: Inputs, labels: Labels) -> tuple[float, float]:
        """``(accuracy, mean cross-entropy)`` of the first output over every example, the same on every rank."""
        self.check_classifier("DistributedTrainer.evaluate")
        self._check_agreement(inputs, labels, "DistributedTrainer.evaluate")
        if not label_rows(labels):
            raise ValueError("DistributedTrainer.evaluate: no examples; accuracy and loss need at least one")
        start, stop = shard_bounds(label_rows(labels), self.comm.rank, self.comm.size)
        totals = np.zeros(self.comm.size + 2, np.float64)  # failure flags, correct, summed loss
        error: Exception | None = None
        try:
            arrays = self._input_arrays(inputs, labels, "evaluate")
            if stop > start:
                logits = self.eval_step.logits([array[start:stop] for array in arrays],
                                               {**self.params, **self.model.buffers})
                part = first_labels(labels)[start:stop]
                totals[-2] = accuracy(logits, part) * len(part)
                totals[-1] = cross_entropy_numpy(logits, part) * len(part)
        except Exception as exc:
            error = exc
            totals[:] = 0
            totals[self.comm.rank] = 1
        self.comm.allreduce_sum(totals)
        failed = np.flatnonzero(totals[: self.comm.size]).tolist()
        if error is not None:
            raise _collective(error)
        if failed:
            raise _collective(RankFailedError(f"rank {_ranks(failed)} failed while evaluating; its error is "
                                              f"printed above; rank {self.comm.rank} stops too"))
        n = max(1, label_rows(labels))
        return float(totals[-2] / n), float(totals[-1] / n)

    # ----- checkpoints: rank 0 writes, everyone learns whether it worked -----

    def save(self, path: str | os.PathLike[str], extra_meta: Mapping[str, Any] | None = None) -> None:
        """Rank 0 writes the checkpoint atomically; every rank raises if that failed."""
        from opgrad.checkpoint import save_checkpoint

        if self.comm.size > 1:
            self._check_same_method("DistributedTrainer.save")

        def write() -> None:
            if self.comm.is_root:
                arrays, meta = self.checkpoint()
                meta.update({"ranks": self.comm.size, **(extra_meta or {})})
                save_checkpoint(path, arrays, meta)

        agree(self.comm, f"writing the checkpoint {os.fspath(path)}", write)
