"""``opgrad bench`` as on an older x86 machine: opgrad's code generated and compiled for an x86-64
level below this host's, PyTorch restricted to the same instructions, taking turns as usual.

Run: ``python benchmarks/bench_isa.py [--level x86-64-v3] [opgrad bench options]``, e.g.
``python benchmarks/bench_isa.py --peak --kernels --skip jax`` on an AVX-512 host to see the AVX2
code (8-lane vectors, 16 registers: its own register tiles, Winograd tiles and peak) against
PyTorch's AVX2 kernels (``ATEN_CPU_CAPABILITY=avx2``, ``DNNL_MAX_CPU_ISA=AVX2``). It is a stand-in
for such a machine, not one: the caches, clock and memory are this host's.

opgrad describes the machine it compiles for by ``opgrad.compiler.target.host_target``; this
script replaces that description, in every module that reads it, with the named level before
anything is compiled (in this process: ``--scaling``, ``--compile-times`` and ``--memory`` run
children, which see the real host).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

#: Levels this script runs and what PyTorch and oneDNN are limited to for each.
LEVELS = {"x86-64-v3": ("avx2", "AVX2"), "x86-64-v2": ("default", "SSE41")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--level", choices=sorted(LEVELS), default="x86-64-v3")
    args, bench_args = parser.parse_known_args()
    aten, dnnl = LEVELS[args.level]
    os.environ["ATEN_CPU_CAPABILITY"] = aten  # read when torch is imported, later
    os.environ["DNNL_MAX_CPU_ISA"] = dnnl
    from opgrad.compiler import target

    level = target.resolve_target(args.level)
    for name in ("opgrad.compiler.target", "opgrad.compiler.jit", "opgrad.compiler.threads", "opgrad.compiler.gemm",
                 "opgrad.compiler.winograd", "opgrad.compiler.winograd_weight", "opgrad.compiler.peak",
                 "opgrad.compiler"):
        module = importlib.import_module(name)
        if hasattr(module, "host_target"):
            module.host_target = lambda: level  # type: ignore[attr-defined]
    print(f"stand-in for an {args.level} machine: {level.vector_width(4)}-lane float32 vectors, "
          f"{level.vector_registers} vector registers; PyTorch with ATEN_CPU_CAPABILITY={aten}, "
          f"DNNL_MAX_CPU_ISA={dnnl}")
    from opgrad.cli import main as opgrad_main

    return opgrad_main(["bench", *bench_args])


if __name__ == "__main__":
    sys.exit(main())
