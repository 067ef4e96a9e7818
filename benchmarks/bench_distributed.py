"""Data-parallel step time of the seed CNN over 1, 2, ... MPI ranks, and what the all-reduce costs.

Run: ``python benchmarks/bench_distributed.py [--ranks 1 2] [--batch 32] [--steps 20] [--model seed-cnn]``.
For each rank count it starts ``mpirun -n N`` on this script (``--worker``), which trains
``--steps`` timed steps of the global batch (after warm-up steps that compile and load the
kernels) with :class:`opgrad.distributed.DistributedTrainer`, and reports per step: the wall time,
the local forward + backward, the all-reduce (waiting for the slowest rank included), the update;
then the time of a bare ``Allreduce`` of a buffer of the gradient's size, alone, which gives the
bandwidth the model in docs/distributed.md uses. The 1-process row of the plain
``opgrad.nn.Trainer`` (the fused single function, no MPI) is the peer each row is compared with.

``--sync-batchnorm`` also times, in the same worker processes, the same steps with synchronized
BatchNorm (``DistributedTrainer(sync_batchnorm=True)``, PyTorch's SyncBatchNorm) for each rank
count above one, and the time spent in its per-layer sums over the ranks: run it with
``--model resnet``, whose 15 BatchNorm layers make 60 small all-reduces a step.

Ranks share this machine's cores (``OPGRAD_NUM_THREADS`` = cores / ranks unless set), so on a
2-core machine 2 ranks can at best halve a step, and more ranks than cores oversubscribe.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def cpu_name() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown CPU"


def train_data(batch: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Random digits-shaped data: the step time does not depend on the values."""
    rng = np.random.default_rng(0)
    n = batch * steps
    return rng.random((n, 1, 28, 28), dtype=np.float32), rng.integers(0, 10, n)


def worker(args: argparse.Namespace) -> None:
    from opgrad.distributed import DistributedTrainer, share_cores, world
    from opgrad.nn import Adam, Trainer, build_model

    comm = world()
    share_cores(comm)
    warmup = 3
    images, labels = train_data(args.batch, warmup + args.steps)
    batches = [(images[i * args.batch : (i + 1) * args.batch], labels[i * args.batch : (i + 1) * args.batch])
               for i in range(warmup + args.steps)]
    result: dict[str, object] = {"ranks": comm.size}
    if comm.size == 1:  # the peer: one fused compiled function, no MPI in the step
        plain = Trainer(build_model(args.model), Adam(), batch_size=args.batch, backend="llvm")
        for x, y in batches[:warmup]:
            plain.train_batch(x, y)
        start, cpu_start = time.perf_counter(), time.process_time()
        for x, y in batches[warmup:]:
            plain.train_batch(x, y)
        result["fused_ms"] = (time.perf_counter() - start) / args.steps * 1e3
        result["fused_cpu_ms"] = (time.process_time() - cpu_start) / args.steps * 1e3
    def timed(sync: bool) -> tuple[DistributedTrainer, dict[str, float]]:
        trainer = DistributedTrainer(build_model(args.model), Adam(), comm=comm, batch_size=args.batch,
                                     backend="llvm", fused_when_alone=False, sync_batchnorm=sync)
        for x, y in batches[:warmup]:
            trainer.train_batch(x, y)
        trainer.reset_times()
        comm.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        for x, y in batches[warmup:]:
            trainer.train_batch(x, y)
        wall = (time.perf_counter() - start) / args.steps
        cpu = np.array([(time.process_time() - cpu_start) / args.steps])
        comm.allreduce_sum(cpu)  # the CPU time of every rank: what the step costs the machine
        return trainer, {"step_ms": wall * 1e3, "cpu_ms": float(cpu[0]) * 1e3,
                         **{f"{k}_ms": v / args.steps * 1e3 for k, v in trainer.times.items()}}

    trainer, times = timed(False)
    result.update(times)
    if args.sync_batchnorm and comm.size > 1:
        synced, sync_times = timed(True)
        assert synced._reducer is not None
        result.update({f"sync_{k}": v for k, v in sync_times.items()})
        reducer = synced._reducer
        result["sums_per_step"] = len(reducer.schedule)
        buffers = [np.ones(size, dtype) for size, dtype in reducer.schedule]
        comm.barrier()
        start = time.perf_counter()
        for _ in range(20):  # one step's sums alone, back to back: their cost without waiting for compute
            for buffer in buffers:
                reducer(buffer)
        result["bare_sums_ms"] = (time.perf_counter() - start) / 20 * 1e3
    buffer = np.ones(trainer.fused_buffer.array.size, np.float32)
    result["buffer_mb"] = buffer.nbytes / 1e6
    result["params"] = int(sum(p.size for p in trainer.params.values()))
    comm.barrier()
    repeats = 20
    start = time.perf_counter()
    for _ in range(repeats):
        comm.allreduce_sum(buffer)
    result["bare_allreduce_ms"] = (time.perf_counter() - start) / repeats * 1e3
    if comm.is_root:
        print("RESULT " + json.dumps(result), flush=True)


def launch(ranks: int, args: argparse.Namespace) -> dict[str, float]:
    mpirun = Path(sys.executable).parent / "mpirun"
    command = [str(mpirun if mpirun.exists() else "mpirun"), "-n", str(ranks), sys.executable, __file__, "--worker",
               "--batch", str(args.batch), "--steps", str(args.steps), "--model", args.model,
               *(["--sync-batchnorm"] if args.sync_batchnorm else [])]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])  # type: ignore[no-any-return]
    raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch", type=int, default=32, help="global batch (default 32)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    parser.add_argument("--model", default="seed-cnn")
    parser.add_argument("--sync-batchnorm", action="store_true",
                        help="also time synchronized BatchNorm (SyncBatchNorm) against per-rank statistics")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    cores = len(os.sched_getaffinity(0))
    print(f"{args.model}, global batch {args.batch}, {args.steps} timed steps, float32, llvm; "
          f"{cpu_name()}, {cores} core(s), load average {os.getloadavg()[0]:.1f} at the start")
    rows = [launch(n, args) for n in args.ranks]
    first = rows[0]
    print(f"{first['params']:,} parameters; all-reduce buffer {first['buffer_mb']:.2f} MB "
          "(gradients + loss + one flag per rank)")
    fused = next((r["fused_ms"] for r in rows if "fused_ms" in r), None)
    if fused is not None:
        fused_cpu = next(r["fused_cpu_ms"] for r in rows if "fused_cpu_ms" in r)
        print(f"peer: one process, fused train step (opgrad.nn.Trainer): {fused:.1f} ms/step, "
              f"{fused_cpu:.1f} CPU ms/step")
    print("times per step in ms: wall, CPU of all ranks together, then rank 0's phases; bare AR: the all-reduce "
          "alone; GB/s: ring-all-reduce bus bandwidth of the bare AR; vs fused: fused wall / this wall")
    print(f"{'ranks':>5} {'step':>7} {'CPU':>7} {'fwd+bwd':>8} {'allreduce':>9} {'update':>7} {'bare AR':>8} "
          f"{'AR GB/s':>8} {'vs fused':>8}")
    for r in rows:
        n = int(r["ranks"])
        # Ring all-reduce moves 2 (n - 1) / n of the buffer through each rank's link.
        moved = 2 * (n - 1) / n * r["buffer_mb"] / 1e3
        bandwidth = f"{moved / (r['bare_allreduce_ms'] / 1e3):8.2f}" if n > 1 else f"{'-':>8}"
        ratio = f"{fused / r['step_ms']:7.2f}x" if fused else f"{'-':>8}"
        print(f"{n:>5} {r['step_ms']:7.1f} {r['cpu_ms']:7.1f} {r['gradients_ms']:8.1f} {r['allreduce_ms']:9.2f} "
              f"{r['update_ms']:7.2f} "
              f"{r['bare_allreduce_ms']:8.2f} {bandwidth} {ratio}")
    synced = [r for r in rows if "sync_step_ms" in r]
    if synced:
        print("synchronized BatchNorm (SyncBatchNorm) against per-rank statistics, same processes, ms per step: "
              "wall and CPU of all ranks; sums: rank 0's time in the BatchNorm all-reduces (waits included); "
              "bare sums: one step's sums alone, back to back")
        print(f"{'ranks':>5} {'sums/step':>9} {'step':>7} {'sync step':>9} {'CPU':>7} {'sync CPU':>8} "
              f"{'sums':>7} {'bare sums':>9} {'CPU cost':>8}")
        for r in synced:
            print(f"{int(r['ranks']):>5} {int(r['sums_per_step']):>9} {r['step_ms']:7.1f} {r['sync_step_ms']:9.1f} "
                  f"{r['cpu_ms']:7.1f} {r['sync_cpu_ms']:8.1f} {r['sync_batchnorm_sums_ms']:7.2f} "
                  f"{r['bare_sums_ms']:9.2f} "
                  f"{r['sync_cpu_ms'] / r['cpu_ms']:7.2f}x")


if __name__ == "__main__":
    main()
