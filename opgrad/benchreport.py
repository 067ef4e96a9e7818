"""The parts of ``opgrad bench`` that look beneath the step time: per-kernel GFLOP/s, thread scaling,
compile time and peak memory.

Why child processes: opgrad's thread pool is sized once per process, the object cache is read per
process, and peak resident memory only ever grows, so thread counts, cold/warm
compiles and memory are each measured in a fresh ``python -m opgrad.benchreport`` child that
prints one JSON line. For memory and compile times a child measures only its own engine (the
opgrad child never imports torch), and reports its resident memory after the imports as well as
at the end, so the step's own footprint is the difference; a scaling row's child times opgrad
and PyTorch taking turns, so that their ratio is of one phase of a shared host.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import opgrad

#: Kernels below this many FLOPs are too small for the peak targets (their call overhead dominates).
TARGET_MIN_FLOPS = 50_000_000
#: The issue's targets for heavy kernels: % of peak on one thread, and on more.
TARGET_ONE_THREAD, TARGET_THREADS = 75.0, 70.0

_PASS = {"conv2d": "forward", "conv2d_backward_input": "backward-data", "conv2d_backward_weight": "backward-weight"}


def _maxrss_mib() -> float:
    """This process's peak resident memory. Linux's VmHWM belongs to the process image, whereas
    ``ru_maxrss`` carries the parent's peak across fork and exec (a child of a big bench process
    would report the parent's size)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# ----- the child process -----

def _child(engine: str, model_name: str, batch: int, threads: int, steps: int,
           optimizer: str = "sgd") -> dict[str, Any]:
    """Build and time one engine's training step, or (``engine="pair"``) opgrad's and PyTorch's
    taking turns (:func:`opgrad.bench.time_interleaved`); runs in a fresh process (see the module doc)."""
    from opgrad import nn
    from opgrad.bench import Row, bench_batch, bench_masks, bench_model, keep_freed_memory, time_interleaved

    result: dict[str, Any] = {}
    if engine == "pair":  # timed as the main table is; memory and compile children keep the default
        keep_freed_memory()
    if engine in ("torch", "pair"):
        import torch

        torch.set_num_threads(threads)
    if engine in ("opgrad", "pair"):  # the compiler's own libraries (LLVM) count as imports, as torch's do
        from opgrad.compiler.threads import pool

        pool()
    result["rss_after_imports_mib"] = _maxrss_mib()
    model = bench_model(model_name)
    params = model.init_params(seed=0)
    images, labels = bench_batch(model, batch)
    runs: dict[str, Callable[[], float]] = {}
    t0 = time.perf_counter()
    if engine in ("opgrad", "pair"):
        cpu0 = time.process_time()
        step = nn.TrainStep(model, nn.make_optimizer(optimizer), batch_size=batch, backend="llvm")
        compiled = step.compiled
        from opgrad.compiler.jit import close_worker

        close_worker()  # its CPU time then counts in RUSAGE_CHILDREN
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        result["compile_cpu_s"] = time.process_time() - cpu0 + children.ru_utime + children.ru_stime
        result.update(compile_s=compiled.compile_seconds, plan_s=compiled.plan_seconds,
                      optimize_s=compiled.times.optimize, load_s=compiled.times.load, parts=compiled.times.parts,
                      cache_hit=compiled.cache_hit, plan_cache_hit=compiled.plan_cache_hit, threads=_pool_threads())
        # Updated in place (donate), as the bench's own runner does; PyTorch starts from ``params`` too.
        state = {"params": {name: array.copy() for name, array in params.items()},
                 "state": {**step.optimizer.init_state(params), **model.init_buffers()}}
        masks = bench_masks(model, batch)

        def run() -> float:
            out = step(images, labels, state["params"], state["state"], 0.01, masks, donate=True)
            state["params"], state["state"] = out.params, out.state
            return out.loss

        runs["ms"] = run
    if engine in ("torch", "pair"):
        from opgrad.bench import torch_runner

        runs["torch_ms" if engine == "pair" else "ms"] = torch_runner(model_name, optimizer=optimizer)(
            params, images, labels, 0.01)
    result["setup_s"] = time.perf_counter() - t0
    for run_step in runs.values():
        for _ in range(3):
            run_step()
    rows = {key: Row(key) for key in runs}
    time_interleaved(rows, runs, steps)
    for key, row in rows.items():
        result[key] = row.ms
    result.update(best_ms=rows["ms"].best_ms, rss_mib=_maxrss_mib())
    return result


def _profiled_step(model_name: str, batch: int, optimizer: str = "sgd") -> tuple[Any, Any, list[Any]]:
    """The model, its training step compiled with an entry per step, and the step's arguments."""
    import opgrad
    from opgrad import nn
    from opgrad.bench import bench_batch, bench_masks, bench_model

    model = bench_model(model_name)
    step = nn.TrainStep(model, nn.make_optimizer(optimizer), batch_size=batch, backend="reference")
    compiled = opgrad.compile(step.function, step_entries=True, in_place=step.step_loop().carry)
    params = model.init_params(seed=0)
    state = {**step.optimizer.init_state(params), **model.init_buffers()}
    images, labels = bench_batch(model, batch)
    masks = bench_masks(model, batch)
    args = [images, labels, *(masks[n] for n in step.mask_names), np.asarray(0.01, np.float32),
            *step.named_arrays(params, state)]
    return model, compiled, args


def _shares_child(model_name: str, batch: int, runs: int, optimizer: str = "sgd") -> dict[str, Any]:
    """Each step's serial and simulated parallel time on the pool's threads
    (:meth:`opgrad.compiler.graph.CompiledFunction.profile_parallel`), with its label and FLOPs."""
    model, compiled, args = _profiled_step(model_name, batch, optimizer)
    compiled(*args)
    timings = compiled.profile_parallel(*args, runs=runs)
    rows = named_rows(model, compiled, [serial for _, serial, _ in timings])
    return {"threads": _pool_threads(),
            "steps": [[row.name, row.flops, serial, parallel]
                      for row, (_, serial, parallel) in zip(rows, timings, strict=True)]}


def _pool_threads() -> int:
    from opgrad.compiler.threads import pool

    return pool().nthreads


def run_child(engine: str, model_name: str, batch: int, threads: int, steps: int,
              cache_dir: str | None = None, optimizer: str = "sgd") -> dict[str, Any]:
    """Run :func:`_child` in a fresh interpreter with ``threads`` threads; its JSON result, or
    ``{"error": ...}`` when it failed."""
    if engine in ("torch", "pair") and importlib.util.find_spec("torch") is None:
        return {"error": "PyTorch is not installed", "missing": True}
    env = {**os.environ, "OPGRAD_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    if cache_dir is not None:
        env["OPGRAD_CACHE_DIR"] = cache_dir
    cmd = [sys.executable, "-m", "opgrad.benchreport", engine, model_name, str(batch), str(threads), str(steps),
           "--optimizer", optimizer]
    # `python -m` puts its working directory first on the path: started from a source checkout
    # beside an installed opgrad, the child would import the checkout's half (without
    # opgrad.registry). It starts where this process's opgrad lies, so it imports the same one.
    package_home = Path(opgrad.__file__).resolve().parents[1]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=package_home)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {proc.returncode}: {tail}"}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


# ----- reports -----


def failure(result: dict[str, Any]) -> str:
    """What a child that timed nothing says in a table: an engine not installed, or how it failed."""
    return str(result["error"]) if result.get("missing") else f"failed: {result['error']}"

def thread_counts(available: int) -> list[int]:
    """1, 2, 4, ... up to ``available``, and ``available`` itself."""
    counts = [1]
    while counts[-1] * 2 <= available:
        counts.append(counts[-1] * 2)
    if counts[-1] != available:
        counts.append(available)
    return counts


def scaling_report(model_name: str, batch: int, available: int, flops: int, steps: int, with_torch: bool,
                   optimizer: str = "sgd") -> None:
    """ms/step, speed-up and % of the same threads' peak for 1, 2, 4, ... threads (children)."""
    from opgrad.compiler.peak import measure_peak

    with_torch = with_torch and importlib.util.find_spec("torch") is not None  # else its row would fail
    print(f"\nscaling ({model_name}, batch {batch}; each row in a fresh process"
          f"{', opgrad and PyTorch taking turns' if with_torch else ''}):")
    print(f"{'threads':>7} {'peak GFLOP/s':>13} {'opgrad ms':>10} {'speed-up':>9} {'GFLOP/s':>8} {'% peak':>7}"
          f"{'  PyTorch ms' if with_torch else ''}{'   ratio' if with_torch else ''}")
    base = None
    for t in thread_counts(available):
        peak = measure_peak(t)
        ours = run_child("pair" if with_torch else "opgrad", model_name, batch, t, steps, optimizer=optimizer)
        if "error" in ours:
            print(f"{t:>7} {peak:>13.1f}  {failure(ours)}")
            continue
        base = base or ours["ms"]
        rate = flops / ours["ms"] / 1e6
        line = (f"{t:>7} {peak:>13.1f} {ours['ms']:>10.2f} {base / ours['ms']:>8.2f}x {rate:>8.1f} "
                f"{100 * rate / peak:>6.1f}%")
        if with_torch:
            line += f"  {ours['torch_ms']:>10.2f} {ours['torch_ms'] / ours['ms']:>6.2f}x"
        print(line)


#: The decomposition table lists the steps with at least this share of the serial time whose
#: simulated speed-up is below this fraction of the thread count.
DECOMPOSITION_MIN_SHARE, DECOMPOSITION_LOW_EFFICIENCY = 0.02, 0.7


def decomposition_report(model_name: str, batch: int, counts: list[int], flops: int, peak_one: float,
                         runs: int, optimizer: str = "sgd") -> None:
    """How the step splits over ``counts`` threads, simulated with one core (children): each job's
    shares timed one after another (:meth:`opgrad.compiler.graph.CompiledFunction.profile_parallel`),
    the fastest of ``runs``: the busiest of many short shares is the one an interrupt hit, unless
    there are enough runs for a quiet one."""
    print(f"\ndecomposition ({model_name}, batch {batch}; simulated: each row in a fresh process planned for "
          "its thread count, every parallel job's shares run one after another on one core and timed; parallel = "
          "the steps' serial parts plus each job's busiest share, so dispatch and contention for memory are "
          "left out and the speed-up is an upper bound):")
    print(f"{'threads':>7} {'serial ms':>10} {'parallel ms':>12} {'speed-up':>9} {'efficiency':>11} {'GFLOP/s':>8} "
          f"{'% of threads x 1-thread peak':>29}")
    for t in counts:
        r = run_child("shares", model_name, batch, t, runs, optimizer=optimizer)
        if "error" in r:
            print(f"{t:>7}  {failure(r)}")
            continue
        if r["threads"] != t:  # a platform whose pool runs every share on the caller (no futex)
            print(f"{t:>7}  not simulated: the child's pool has {r['threads']} thread(s)")
            continue
        steps = r["steps"]
        serial = sum(x[2] for x in steps)
        parallel = sum(x[3] for x in steps)
        rate = flops / parallel / 1e6
        speedup = serial / parallel
        print(f"{t:>7} {serial:>10.2f} {parallel:>12.2f} {speedup:>8.2f}x {100 * speedup / t:>10.1f}% "
              f"{rate:>8.1f} {100 * rate / (t * peak_one):>28.1f}%")
        # Steps of one name (a model's repeated blocks have layers of the same shapes) count together.
        by_name: dict[str, list[float]] = {}
        for name, _, step_serial, step_parallel in steps:
            totals = by_name.setdefault(name, [0.0, 0.0, 0])
            totals[0] += step_serial
            totals[1] += step_parallel
            totals[2] += 1
        for name, (step_serial, step_parallel, count) in by_name.items():
            if step_serial < DECOMPOSITION_MIN_SHARE * serial or \
                    step_serial / step_parallel >= DECOMPOSITION_LOW_EFFICIENCY * t:
                continue
            label = f"{name} (x{count:.0f})" if count > 1 else name
            print(f"{'':>7}   {label[:44]:<44} {step_serial:>8.2f} -> {step_parallel:>7.2f} ms "
                  f"({step_serial / step_parallel:.1f}x, {100 * step_serial / serial:.0f}% of the serial time)")


def compile_report(model_name: str, batch: int, threads: int, optimizer: str = "sgd") -> None:
    """Cold compile (empty caches) and warm (a second process, same caches: stored plan and object), in children."""
    with tempfile.TemporaryDirectory(prefix="opgrad-bench-cache-") as cache:
        cold = run_child("opgrad", model_name, batch, threads, 3, cache_dir=cache, optimizer=optimizer)
        warm = run_child("opgrad", model_name, batch, threads, 3, cache_dir=cache, optimizer=optimizer)
    print("\ncompile time of the training step (fresh processes):")
    for name, r in (("cold (empty caches)", cold), ("warm (stored plan, object)", warm)):
        if "error" in r:
            print(f"  {name:<27} {failure(r)}")
            continue
        expected = name.startswith("warm")
        surprise = "".join(f"  (unexpected {what} {'hit' if r[field] else 'miss'})"
                           for field, what in (("cache_hit", "object cache"), ("plan_cache_hit", "plan cache"))
                           if r[field] != expected)
        plan = "read stored plan" if r["plan_cache_hit"] else "build IR"
        code = ("object read from the cache" if r["cache_hit"] else
                f"optimize/codegen {r['optimize_s']:.2f} s ({r['parts']} part{'s' if r['parts'] > 1 else ''} in "
                "parallel workers)")
        print(f"  {name:<27} {r['compile_s']:6.3f} s  = {plan} {r['plan_s']:.3f} s + {code} "
              f"+ load {r['load_s']:.3f} s + rest; CPU {r['compile_cpu_s']:.2f} s in all processes{surprise}")


def memory_report(model_name: str, batch: int, threads: int, with_torch: bool, optimizer: str = "sgd") -> None:
    """Peak resident memory of a process running the step, opgrad vs PyTorch (children)."""
    print("\npeak resident memory (VmHWM of a fresh process running 20 steps):")
    print(f"  {'engine':<22} {'after imports':>14} {'peak':>10} {'step adds':>10}")
    engines = ["opgrad", "torch"] if with_torch else ["opgrad"]
    for engine in engines:
        r = run_child(engine, model_name, batch, threads, 20, optimizer=optimizer)
        name = "opgrad llvm" if engine == "opgrad" else "PyTorch"
        if "error" in r:
            print(f"  {name:<22} {failure(r)}")
            continue
        print(f"  {name:<22} {r['rss_after_imports_mib']:>10.0f} MiB {r['rss_mib']:>6.0f} MiB "
              f"{r['rss_mib'] - r['rss_after_imports_mib']:>6.0f} MiB")


@dataclass
class KernelRow:
    name: str
    detail: str
    ms: float
    flops: int
    bytes: int


def kernel_rows(model_name: str, batch: int, runs: int, cpu_clock: bool = False,
                optimizer: str = "sgd") -> list[KernelRow]:
    """Each native step of the compiled training step, timed alone (fastest of ``runs``; by the
    thread's CPU time with ``cpu_clock``, right only when the pool has one thread)."""
    model, compiled, args = _profiled_step(model_name, batch, optimizer)
    timings = compiled.profile(*args, runs=runs, best=True, clock=time.thread_time if cpu_clock else time.perf_counter)
    return named_rows(model, compiled, [ms for _, ms in timings])


def named_rows(model: Any, compiled: Any, times_ms: list[float]) -> list[KernelRow]:
    """A row for each step of ``compiled`` (a model's step) with its time: conv passes named by
    their layer ("conv2 backward-data") and the elementwise ops fused into them."""
    layers = conv_layers_of_steps(model, compiled.plan, compiled.function)
    conv_names = [layer.name or "conv" for layer in model.layers if layer.kind == "conv"]
    by_geometry: dict[str, str] = {}  # a conv's shapes -> a layer name, in step order (the fallback)
    rows = []
    for cost, layer, ms in zip(compiled.plan.step_costs, layers, times_ms, strict=True):
        name = cost.label
        op, _, fused = cost.label.partition("+")  # a GEMM with its epilogue: "conv2d_backward_weight+multiply+..."
        if op in _PASS and cost.detail:
            # The shapes name the layer; the algorithm in brackets may differ between its passes.
            shapes = cost.detail.partition(" (")[0]
            if op == "conv2d" and shapes not in by_geometry and len(by_geometry) < len(conv_names):
                by_geometry[shapes] = conv_names[len(by_geometry)]
            name = f"{layer or by_geometry.get(shapes) or 'conv'} {_PASS[op]}" + (f" +{fused}" if fused else "")
        rows.append(KernelRow(name, cost.detail, ms, cost.flops, cost.bytes))
    return rows


def conv_layers_of_steps(model: Any, plan: Any, function: Any) -> list[str | None]:
    """For each step of ``plan``, the conv layer whose weight it works on, or None.

    A forward or backward-data pass reads the weight (or a copy of it, one step back); a
    backward-weight pass writes the gradient that the layer's update reads, or reads the weight
    itself when the update is its epilogue. Layers that share shapes (a ResNet's blocks) are told
    apart this way, whatever order the steps run in; a step that matches no weight, or several,
    gets None."""
    conv_names = {layer.name for layer in model.layers if layer.kind == "conv" and layer.name}
    weights: dict[int, str] = {}  # pointer-table slot -> layer
    for slot, param in zip(plan.params, function.params, strict=True):
        layer, _, leaf = param.name.rpartition(".")
        if leaf == "weight" and layer in conv_names:
            weights[slot] = layer
    costs = plan.step_costs
    readers: dict[int, list[Any]] = {}
    producer: dict[int, Any] = {}
    for cost in costs:
        for b in cost.reads:
            readers.setdefault(b, []).append(cost)
        for b in cost.writes:
            producer.setdefault(b, cost)
    nbytes = [buffer.nbytes for buffer in plan.buffers]

    def weights_read(cost: Any, size: int | None = None) -> set[str]:
        return {weights[b] for b in cost.reads if b in weights and size in (None, nbytes[b])}

    found: list[str | None] = []
    for cost in costs:
        op = cost.label.partition("+")[0]
        names: set[str] = set()
        if op in _PASS:
            names = weights_read(cost)
            if not names and op != "conv2d_backward_weight":
                names = {name for b in cost.reads if b in producer
                         for name in weights_read(producer[b], nbytes[b])}
            if not names and op == "conv2d_backward_weight":
                names = {name for b in cost.writes for reader in readers.get(b, [])
                         for name in weights_read(reader, nbytes[b])}
        found.append(names.pop() if len(names) == 1 else None)
    return found


def kernels_report(model_name: str, batch: int, threads: int, peak: float, bandwidth: float, runs: int,
                   optimizer: str = "sgd") -> None:
    """The per-kernel table: GFLOP/s and % of peak for GEMM/conv steps, GB/s for the rest."""
    rows = kernel_rows(model_name, batch, runs, cpu_clock=threads == 1, optimizer=optimizer)
    total = sum(r.ms for r in rows)
    target = TARGET_ONE_THREAD if threads == 1 else TARGET_THREADS
    how = "thread CPU time" if threads == 1 else "wall time"
    print(f"\nkernels of the {model_name} step ({threads} thread{'s' if threads > 1 else ''}, each step re-run alone, "
          f"fastest of {runs}, {how}); peak {peak:.1f} GFLOP/s, copy bandwidth {bandwidth:.1f} GB/s")
    print(f"  {'kernel':<30} {'shapes':<28} {'ms':>7} {'share':>6} {'GFLOP/s':>8} {'% peak':>7} {'GB/s':>6}  target")
    small = [r for r in rows if r.flops == 0 and r.ms < 0.01 * total]
    for r in rows:
        if r in small:
            continue
        share = f"{100 * r.ms / total:5.1f}%"
        if r.flops:
            rate = r.flops / r.ms / 1e6
            verdict = "-"
            if r.flops >= TARGET_MIN_FLOPS:
                verdict = "ok" if 100 * rate / peak >= target else f"below {target:.0f}%"
                if " +" in r.name:  # the time includes the fused elementwise ops, the flops do not
                    verdict += ", with epilogue"
            print(f"  {r.name[:30]:<30} {r.detail[5:33] if r.detail.startswith('conv ') else r.detail[:28]:<28} "
                  f"{r.ms:>7.3f} {share:>6} {rate:>8.1f} {100 * rate / peak:>6.1f}% {'':>6}  {verdict}")
        else:
            gbs = r.bytes / r.ms / 1e6
            print(f"  {r.name[:30]:<30} {'':<28} {r.ms:>7.3f} {share:>6} {'':>8} {'':>7} {gbs:>6.1f}  "
                  f"{100 * gbs / bandwidth:.0f}% of copy bw")
    if small:
        print(f"  {f'{len(small)} smaller passes':<30} {'':<28} {sum(r.ms for r in small):>7.3f} "
              f"{100 * sum(r.ms for r in small) / total:5.1f}%")
    flops = sum(r.flops for r in rows)
    print(f"  {'all steps':<30} {'':<28} {total:>7.3f} {'100%':>6} {flops / total / 1e6:>8.1f} "
          f"{100 * flops / total / 1e6 / peak:>6.1f}%")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opgrad.benchreport",
                                     description="one engine's training step in this process, or opgrad's and "
                                                 "PyTorch's taking turns (pair) (bench's child)")
    parser.add_argument("engine", choices=("opgrad", "torch", "pair", "shares"))
    parser.add_argument("model")
    parser.add_argument("batch", type=int)
    parser.add_argument("threads", type=int)
    parser.add_argument("steps", type=int)
    parser.add_argument("--optimizer", default="sgd")
    args = parser.parse_args(argv)
    if args.engine == "shares":
        print(json.dumps(_shares_child(args.model, args.batch, args.steps, args.optimizer)))
    else:
        print(json.dumps(_child(args.engine, args.model, args.batch, args.threads, args.steps, args.optimizer)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
