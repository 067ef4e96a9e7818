"""The ``opgrad`` command: ``ops``, ``check``, ``train``, ``bench``, ``export``.

Each subcommand lives with the code it drives and exposes ``configure(parser)`` and
``run(args) -> int``; this module only dispatches, importing the subcommand lazily so that
``opgrad ops`` does not pay for llvmlite or matplotlib.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "ops": ("opgrad.optable", "list every registered operator with its gradient and kernel status"),
    "check": ("opgrad.checks.command", "verify registered gradients with hypothesis + finite differences"),
    "train": ("opgrad.train", "train the seed CNN (or the Keras MNIST model) on real MNIST"),
    "bench": ("opgrad.bench", "time the compiled training step against the reference and peers"),
    "export": ("opgrad.deploy.command", "write the training step as a C library (.o/.a/.so + header + runtime)"),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="opgrad", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:  # a subcommand whose optional pieces are missing stays listed
            sub_parser.set_defaults(_unavailable=f"opgrad {name} is unavailable: {exc}")
            continue
        module.configure(sub_parser)
        modules[name] = module
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "_unavailable", None):
        print(args._unavailable, file=sys.stderr)
        return 2
    try:
        return int(modules[args.command].run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
