"""``opgrad export DIR``: write a model's training step, eval step and checkpoint I/O as a C library."""

from __future__ import annotations

import argparse
import sys

from opgrad.compiler.target import NAMED_TARGETS
from opgrad.train import DEFAULT_LR, MODEL_NAMES


def configure(parser: argparse.ArgumentParser) -> None:
    """Add ``opgrad export``'s options to ``parser``."""
    parser.add_argument("directory", metavar="DIR", help="output directory (created if missing)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default="seed-cnn", choices=MODEL_NAMES, help="a built-in model (default seed-cnn)")
    source.add_argument("--checkpoint", metavar="PATH", default=None,
                        help="export the model a checkpoint holds (architecture and trained weights, as "
                             "model.save or opgrad train --save write it)")
    parser.add_argument("--optimizer", default="adam", choices=tuple(DEFAULT_LR), help="default adam")
    parser.add_argument("--batch-size", type=int, default=32, help="examples per training step (default 32)")
    parser.add_argument("--eval-batch-size", type=int, default=None,
                        help="examples per eval call (default: the batch size)")
    parser.add_argument("--target", default="host",
                        help=f"host (default), {', '.join(NAMED_TARGETS)}, or an LLVM triple")
    parser.add_argument("--cpu", default=None, help="LLVM CPU name (default: the target's)")
    parser.add_argument("--features", default=None, help="LLVM feature string, e.g. +avx2,+fma (default: the "
                        "target's); one that starts with - goes after =, as --features=-avx512f")
    parser.add_argument("--threads", type=int, default=0,
                        help="runtime thread pool size: 0 = one per online CPU (default), 1 = no threads")
    parser.add_argument("--name", default="opgrad", help="prefix of every exported symbol and file (default opgrad)")
    parser.add_argument("--cc", default=None,
                        help="C compiler for the runtime (default: $CC or cc for the host, aarch64-linux-gnu-gcc for "
                             "aarch64-linux-gnu; none for Android)")
    parser.add_argument("--object-only", action="store_true",
                        help="write the header, runtime source, compiled object and initial weights only")
    parser.add_argument("--seed", type=int, default=None,
                        help="draw the weights in NAME_init.npz from this seed (default: the checkpoint's "
                             "weights, or seed 0 for a built-in model)")


def run(args: argparse.Namespace) -> int:
    """Export; returns a process exit code (0 ok, 2 bad input or a failed build)."""
    from opgrad.checkpoint import CheckpointError
    from opgrad.deploy.export import ExportError, export
    from opgrad.errors import ShapeError
    from opgrad.nn import Model, load_model

    try:
        model: str | Model = load_model(args.checkpoint) if args.checkpoint else args.model
        result = export(args.directory, model=model, optimizer=args.optimizer, batch_size=args.batch_size,
                        eval_batch_size=args.eval_batch_size, target=args.target, cpu=args.cpu,
                        features=args.features, threads=args.threads, name=args.name, cc=args.cc,
                        object_only=args.object_only, seed=args.seed)
    except (ExportError, CheckpointError, OSError, ShapeError) as exc:  # ShapeError: a model the step cannot train
        print(f"opgrad export: error: {exc}", file=sys.stderr)
        return 2
    t = result.target
    print(f"exported {args.checkpoint or args.model} ({args.optimizer}, batch {args.batch_size}) for {t.triple} "
          f"({t.cpu}) in {result.compile_seconds:.1f} s{' (object cache hit)' if result.cache_hit else ''}:")
    for kind, path in result.files.items():
        print(f"  {kind:<8} {path}")
    if result.c_compiler is None:
        print(f"  (no C compiler used: build {args.name}_runtime.c with the target's toolchain, see "
              "docs/deployment.md)")
    return 0
