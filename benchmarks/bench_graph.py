"""ms per training step of the seed CNN (value + gradients, batch 32, float32): compiled vs reference.

Run: ``python benchmarks/bench_graph.py [--batch 32] [--runs 20] [--sgd]``. The step is the
function ``opgrad.grad`` returns for the seed CNN's softmax-CE loss (conv3x3 1->32 relu, conv3x3
32->64 relu, avgpool 2, conv12x12 64->128 relu, flatten, dense 10); ``--sgd`` appends the SGD
update so the step returns new parameters, as a training loop would compile it.
Both backends run in this process, so compare the printed ratio, not absolute numbers across runs
(the machine is shared and noisy). Compile time is reported cold (empty object cache) and warm
(a second compile of the same graph, which loads the cached object). A child process with one
thread reports CPU time per step, the number to compare across runs on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from test_seed_cnn_gradient import SHAPES, init, seed_cnn_loss  # noqa: E402

import opgrad  # noqa: E402
from opgrad import ops  # noqa: E402


def median_ms(fn: Callable[[], object], runs: int, clock: Callable[[], float] = time.perf_counter) -> float:
    fn()
    times = []
    for _ in range(runs):
        t = clock()
        fn()
        times.append(clock() - t)
    return 1e3 * float(np.median(times))


def one_thread_cpu_ms(args: argparse.Namespace) -> float:
    """CPU ms of one compiled step on one thread, in a child process (the pool size is per process).

    Thread CPU time is what the step costs when nobody else shares the cores; on a shared machine
    it is far steadier than wall time.
    """
    env = {**os.environ, "OPGRAD_NUM_THREADS": "1", "_OPGRAD_BENCH_CHILD": "1"}
    cmd = [sys.executable, __file__, "--batch", str(args.batch), "--runs", str(args.runs)]
    cmd += ["--sgd"] if args.sgd else []
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return float(out.strip().splitlines()[-1])


def training_step(batch: int, dtype: str, sgd: bool) -> opgrad.Function:
    """(loss, grads...) or, with ``sgd``, (loss, params - 0.01 * grads...)."""
    step = opgrad.grad(seed_cnn_loss(batch, dtype), wrt=list(SHAPES))
    if not sgd:
        return step
    loss, *grads = step.outputs
    params = step.params[2:]
    updated = (ops.subtract(p, ops.multiply(g, 0.01)) for p, g in zip(params, grads, strict=True))
    return opgrad.function(step.params, (loss, *updated))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--sgd", action="store_true")
    parser.add_argument("--profile", action="store_true", help="also print ms per native step")
    args = parser.parse_args()
    child = bool(os.environ.get("_OPGRAD_BENCH_CHILD"))
    if not child:
        os.environ["OPGRAD_CACHE_DIR"] = tempfile.mkdtemp(prefix="opgrad-bench-")  # cold, then warm

    fn = training_step(args.batch, "float32", args.sgd)
    cold = opgrad.compile(fn)
    warm = opgrad.compile(fn)
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, (args.batch, 1, 28, 28)).astype(np.float32)
    labels = rng.integers(0, 10, args.batch)
    params = [p.astype(np.float32) for p in init(rng)]
    arrays = [x, labels, *params]

    if child:
        print(median_ms(lambda: warm(*arrays), args.runs, time.thread_time))
        return
    got, want = warm(*arrays), opgrad.evaluate(fn, *arrays)
    err = max(float(np.max(np.abs(g - w))) / max(1.0, float(np.max(np.abs(w)))) for g, w in zip(got, want))
    compiled_ms = median_ms(lambda: warm(*arrays), args.runs)
    reference_ms = median_ms(lambda: opgrad.evaluate(fn, *arrays), max(3, args.runs // 4))
    print(f"seed CNN {'SGD step' if args.sgd else 'value+grad'}, batch {args.batch}, float32, "
          f"{len(fn.outputs)} outputs, {warm.steps} native steps ({warm.fused} fused), arena "
          f"{warm.arena_bytes / 2**20:.1f} MiB")
    print(f"  compile: cold {cold.compile_seconds:.2f} s (optimize {cold.times.optimize:.2f} s, codegen "
          f"{cold.times.codegen:.2f} s), warm {warm.compile_seconds:.3f} s (cache hit: {warm.cache_hit})")
    print(f"  compiled  {compiled_ms:8.2f} ms/step (median of {args.runs})")
    print(f"  reference {reference_ms:8.2f} ms/step  -> speedup x{reference_ms / compiled_ms:.1f}")
    print(f"  compiled, 1 thread: {one_thread_cpu_ms(args):8.2f} CPU-ms/step (thread time, median)")
    if args.profile:
        rows = opgrad.compile(fn, step_entries=True).profile(*arrays, runs=args.runs)
        total = sum(ms for _, ms in rows)
        print(f"  per step (each re-run alone, median ms; sum {total:.2f}):")
        for i, (label, ms) in enumerate(rows):
            print(f"    {i:3d} {label:40s} {ms:8.3f}  {100 * ms / total:5.1f} %")
    print(f"  max |compiled - reference| / scale = {err:.1e}")


if __name__ == "__main__":
    main()
