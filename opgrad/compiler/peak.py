"""What this machine can do: fp32 FMA peak, memory bandwidth, and the CPUs the process may use.

The FLOP peak is measured, not looked up: a generated loop of independent vector FMA chains (as
many as the register file holds, so FMA latency is hidden on every core seen so far) runs on one
thread and then on ``n`` threads at once. Reports divide a kernel's GFLOP/s by this number, so
"% of peak" means the same thing on AVX2 and AVX-512 hosts. The bandwidth is a large copy
(bytes read plus bytes written per second), the yardstick for elementwise and pooling passes.

Both are best-of-several: another job on a shared machine can only make a run slower, so the
fastest run is the best estimate of what the hardware does.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from opgrad.env import available_cpus, cgroup_cpu_limit

from .irtext import ModuleEmitter
from .jit import NativeModule
from .target import Target, cache_size, host_target

__all__ = ["HostInfo", "available_cpus", "cgroup_cpu_limit", "host_info", "measure_bandwidth", "measure_peak",
           "peak_chains"]


def _cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


@dataclass(frozen=True)
class HostInfo:
    """The host as the code generator and the reports see it."""

    model: str  # /proc/cpuinfo's model name, e.g. "AMD EPYC"
    llvm_cpu: str  # LLVM's name for the microarchitecture, e.g. "znver3"
    vector_bits: int
    vector_registers: int
    cpus: int  # available to this process (affinity and cgroup quota)
    l1d: int | None
    l2: int | None
    l3: int | None

    def describe(self) -> str:
        def size(b: int | None) -> str:
            if b is None:
                return "?"
            return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"

        return (f"{self.model} ({self.llvm_cpu}, {self.vector_bits}-bit vectors x {self.vector_registers} registers, "
                f"L1d {size(self.l1d)} / L2 {size(self.l2)} / L3 {size(self.l3)}, {self.cpus} CPU(s) available)")


@functools.lru_cache(maxsize=1)
def host_info() -> HostInfo:
    target = host_target()
    return HostInfo(_cpu_model_name(), target.cpu, target.vector_width(1) * 8, target.vector_registers,
                    available_cpus(), cache_size(1), cache_size(2), cache_size(3))


def peak_chains(target: Target) -> int:
    """Independent FMA chains: the register file less a few for the operands (12 of 16, 24 of 32)."""
    return 24 if target.vector_registers >= 32 else 12


@functools.lru_cache(maxsize=1)
def _peak_kernel() -> tuple[NativeModule, int, int]:
    """``void opgrad_peak(i64 iters, float a, float b, ptr out)``: iters x chains vector FMAs.

    ``a`` and ``b`` are arguments so that LLVM cannot fold the FMAs into adds, and the chains'
    sum is stored so that it cannot drop them.
    """
    target = host_target()
    lanes, chains = target.vector_width(4), peak_chains(target)
    vec = f"<{lanes} x float>"
    m = ModuleEmitter("opgrad_peak", function_attrs=target.function_attrs, fused_multiply_add=target.has_fma)
    fma = m.fma(vec)[1:]
    lines = [f"define void @opgrad_peak(i64 %iters, float %a, float %b, ptr %out) nounwind {m.function_attrs} {{",
             "entry:",
             f"  %va0 = insertelement {vec} poison, float %a, i64 0",
             f"  %va = shufflevector {vec} %va0, {vec} poison, <{lanes} x i32> zeroinitializer",
             f"  %vb0 = insertelement {vec} poison, float %b, i64 0",
             f"  %vb = shufflevector {vec} %vb0, {vec} poison, <{lanes} x i32> zeroinitializer",
             "  br label %loop",
             "loop:",
             "  %i = phi i64 [ 0, %entry ], [ %i.next, %loop ]"]
    for c in range(chains):
        lines.append(f"  %acc{c} = phi {vec} [ %vb, %entry ], [ %next{c}, %loop ]")
    for c in range(chains):
        lines.append(f"  %next{c} = call {vec} @{fma}({vec} %acc{c}, {vec} %va, {vec} %vb)")
    lines += ["  %i.next = add i64 %i, 1",
              "  %more = icmp ult i64 %i.next, %iters",
              "  br i1 %more, label %loop, label %done",
              "done:"]
    total = "%next0"
    for c in range(1, chains):
        lines.append(f"  %sum{c} = fadd {vec} {total}, %next{c}")
        total = f"%sum{c}"
    lines += [f"  store {vec} {total}, ptr %out, align 4", "  ret void", "}"]
    m.add_function("\n".join(lines))
    return NativeModule(m.text()), lanes, chains


def _run_threads(fn: object, nthreads: int, args_of: Sequence[tuple[object, ...]]) -> tuple[float, float]:
    """Run ``fn(*args_of[t])`` on ``nthreads`` threads released together: (wall seconds until the
    last one finished, the longest thread CPU time). CPU time leaves out the time another job held
    the core, so on a shared machine it is the steadier measure of what the hardware does."""
    barrier = threading.Barrier(nthreads + 1)
    cpu = [0.0] * nthreads

    def work(t: int) -> None:
        barrier.wait()
        start = time.thread_time()
        fn(*args_of[t])  # type: ignore[operator]
        cpu[t] = time.thread_time() - start

    threads = [threading.Thread(target=work, args=(t,)) for t in range(nthreads)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - start, max(cpu)


def measure_peak(nthreads: int = 1, seconds: float = 0.01, repeats: int = 10) -> float:
    """fp32 GFLOP/s of ``nthreads`` threads each running independent vector FMAs (best of ``repeats``).

    Each thread's rate is its work over its own CPU time (see :func:`_run_threads`), so the figure is
    what the cores do when they are ours, whatever else the machine runs.
    """
    module, lanes, chains = _peak_kernel()
    fn = module.cfunc("opgrad_peak", None, ctypes.c_int64, ctypes.c_float, ctypes.c_float, ctypes.c_void_p)
    outs = np.zeros((max(1, nthreads), 64), np.float32)
    flops_per_iter = 2 * lanes * chains
    iters = 10_000
    while True:  # calibrate on one thread to about ``seconds`` per run
        t0 = time.perf_counter()
        fn(iters, 0.999999, 1e-6, outs[0].ctypes.data)
        if time.perf_counter() - t0 > seconds / 4 or iters > 1 << 34:
            iters = int(iters * seconds / max(time.perf_counter() - t0, 1e-9))
            break
        iters *= 4
    args = [(iters, 0.999999, 1e-6, outs[t].ctypes.data) for t in range(nthreads)]
    best = min(max(_run_threads(fn, nthreads, args)[1], 1e-9) for _ in range(repeats))
    return nthreads * iters * flops_per_iter / best / 1e9


def measure_bandwidth(nthreads: int = 1, mib: int = 8, repeats: int = 20) -> float:
    """GB/s (bytes read + bytes written) of ``nthreads`` threads each copying ``mib`` MiB with numpy.

    The default size is that of a training step's large activations (a few MiB), so the figure is
    what an elementwise pass over them can reach, from the last-level cache where it holds them.
    """
    n = (mib << 20) // 4
    pairs = [(np.ones(n, np.float32), np.empty(n, np.float32)) for _ in range(nthreads)]
    for src, dst in pairs:
        np.copyto(dst, src)  # touch every page first
    args = [(dst, src) for src, dst in pairs]
    best = min(max(_run_threads(np.copyto, nthreads, args)[1], 1e-9) for _ in range(repeats))
    return nthreads * 2 * n * 4 / best / 1e9
