"""GFLOP/s of the JIT GEMM (1 and 2 threads) vs numpy, and ms of the seed-CNN conv passes.

Run: ``python benchmarks/bench_kernels.py``. Thread counts are fixed per process (the pool is
process-wide), so the 1-thread numbers come from a child process with ``OPGRAD_NUM_THREADS=1``.
Medians of >= 10 runs; the machines are noisy, so compare ratios printed from one run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from opgrad.compiler import conv2d_geometry, conv2d_kernels, gemm_kernel  # noqa: E402
from opgrad.compiler.gemm import GemmSpec  # noqa: E402

SEED_CONVS = [
    ((32, 1, 28, 28), (32, 1, 3, 3)),
    ((32, 32, 26, 26), (64, 32, 3, 3)),
    ((32, 64, 12, 12), (128, 64, 12, 12)),
]


def median_seconds(fn: Callable[[], object], runs: int = 10) -> float:
    fn()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def _im2col_forward(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """numpy baseline (stride 1, no padding): im2col + BLAS matmul."""
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    oh, ow = h - kh + 1, wd - kw + 1
    cols = np.lib.stride_tricks.sliding_window_view(x, (kh, kw), axis=(2, 3))  # n c oh ow kh kw
    cols = cols.transpose(1, 4, 5, 0, 2, 3).reshape(c * kh * kw, n * oh * ow)
    return (w.reshape(o, -1) @ cols).reshape(o, n, oh, ow).transpose(1, 0, 2, 3)


def measure() -> dict[str, float]:
    res: dict[str, float] = {}
    rng = np.random.default_rng(0)
    for n in (512, 1024):
        a, b = rng.standard_normal((n, n)).astype(np.float32), rng.standard_normal((n, n)).astype(np.float32)
        c = np.zeros((n, n), np.float32)
        k = gemm_kernel(GemmSpec.dense(n, n, n))
        ptrs = (a.ctypes.data, b.ctypes.data, c.ctypes.data)
        res[f"gemm{n}_jit"] = 2 * n**3 / median_seconds(lambda k=k, ptrs=ptrs: k.call_pointers(*ptrs)) / 1e9
        res[f"gemm{n}_numpy"] = 2 * n**3 / median_seconds(lambda a=a, b=b: a @ b) / 1e9
    for xs, ws in SEED_CONVS:
        g = conv2d_geometry(xs, ws)
        k = conv2d_kernels(g)
        x, w = rng.standard_normal(xs).astype(np.float32), rng.standard_normal(ws).astype(np.float32)
        dy = rng.standard_normal(g.out_shape).astype(np.float32)
        y, dx, dw = np.zeros(g.out_shape, np.float32), np.zeros(xs, np.float32), np.zeros(ws, np.float32)
        tag = f"conv{xs[1]}x{ws[0]}k{ws[2]}"
        res[f"{tag}_fwd"] = 1e3 * median_seconds(lambda k=k, x=x, w=w, y=y: k.forward(x, w, y))
        res[f"{tag}_bwd_data"] = 1e3 * median_seconds(lambda k=k, dy=dy, w=w, dx=dx: k.backward_data(dy, w, dx))
        res[f"{tag}_bwd_weight"] = 1e3 * median_seconds(lambda k=k, x=x, dy=dy, dw=dw: k.backward_weight(x, dy, dw))
        res[f"{tag}_numpy_fwd"] = 1e3 * median_seconds(lambda x=x, w=w: _im2col_forward(x, w))
        res[f"{tag}_gflop"] = g.flops() / 1e9
    return res


def main() -> None:
    if os.environ.get("_OPGRAD_BENCH_CHILD"):
        print(json.dumps(measure()))
        return
    env = {**os.environ, "_OPGRAD_BENCH_CHILD": "1", "OPGRAD_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    one = json.loads(subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                                    check=True).stdout.strip().splitlines()[-1])
    two = measure()
    print("GEMM fp32 GFLOP/s (median of 10)      jit-1T  numpy-1T  ratio |  jit-2T  numpy-2T  ratio")
    for n in (512, 1024):
        j1, n1, j2, n2 = one[f"gemm{n}_jit"], one[f"gemm{n}_numpy"], two[f"gemm{n}_jit"], two[f"gemm{n}_numpy"]
        print(f"  {n}^3 {'':30} {j1:7.1f} {n1:8.1f} {j1 / n1:6.2f} | {j2:7.1f} {n2:8.1f} {j2 / n2:6.2f}")
    print("Seed CNN conv fp32, batch 32, ms (median of 10); numpy = im2col + matmul forward")
    print(f"  {'conv':18} {'pass':12} {'1T':>7} {'2T':>7} {'1T/2T':>6} {'GFLOP/s 2T':>10} {'numpy fwd':>10}")
    for xs, ws in SEED_CONVS:
        tag = f"conv{xs[1]}x{ws[0]}k{ws[2]}"
        for p in ("fwd", "bwd_data", "bwd_weight"):
            a, b = one[f"{tag}_{p}"], two[f"{tag}_{p}"]
            npf = f"{two[f'{tag}_numpy_fwd']:10.2f}" if p == "fwd" else ""
            print(f"  {tag:18} {p:12} {a:7.2f} {b:7.2f} {a / b:6.2f} {two[f'{tag}_gflop'] / b * 1e3:10.1f} {npf}")


if __name__ == "__main__":
    main()
