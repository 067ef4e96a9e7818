"""The ``opgrad`` command: ops, check, train, predict, bench, export, import and export-onnx.

Each subcommand lives with the code it drives and exposes ``configure(parser)`` and
``run(args) -> int``; this module only dispatches, importing the subcommand lazily so that
``opgrad ops`` does not pay for llvmlite or matplotlib.

User errors are reported here and only here: a subcommand raises an
:class:`~opgrad.errors.UserError` (a bad file, option value or environment variable, a
diverging run) and this module prints it as one line, ``opgrad <command>: error: <message>``,
exiting with the error's ``exit_code``. Any other exception is a bug and keeps its traceback.
Bad option values are refused earlier, by argparse ``type=`` functions (``opgrad.argtypes``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from opgrad.env import check_environment
from opgrad.errors import UserError

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "ops": ("opgrad.optable", "list every registered operator with its gradient and kernel status"),
    "check": ("opgrad.checks.command", "verify registered gradients with hypothesis + finite differences"),
    "train": ("opgrad.train", "train the seed CNN (or keras-mnist, resnet, mlp) on real MNIST"),
    "predict": ("opgrad.predict", "run a saved model on images: accuracy, confusion matrix, predictions"),
    "bench": ("opgrad.bench", "time the compiled training step against the reference and peers"),
    "export": ("opgrad.deploy.command", "write the training step as a C library (.o/.a/.so + header + runtime)"),
    "import": ("opgrad.interop", "read an ONNX or Keras model into an opgrad checkpoint"),
    "export-onnx": ("opgrad.onnx.command", "write a checkpoint's model as ONNX (opset 17)"),
}


class OneLineErrorParser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line, ``opgrad <command>: error: ...`` (exit
    2), like every other user error: argparse's usage block would bury it (``--help`` shows it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def one_line(exc: BaseException | str) -> str:
    """``exc``'s message on one line (continuation lines joined with "; ")."""
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())


def one_line_warnings(prefix: str, fallback: Callable[..., None]) -> Callable[..., None]:
    """A ``warnings.showwarning`` that prints opgrad's user warnings as ``<prefix>: warning: ...``
    lines: run as a command there is no user code for the usual ``file:line`` to point at (it
    named the console script). Other warnings go to ``fallback``."""

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
             line: str | None = None) -> None:
        if not issubclass(category, UserWarning):
            fallback(message, category, filename, lineno, file, line)
            return
        text = one_line(message)
        print(f"{prefix}: warning: {text.removeprefix('opgrad: ')}", file=sys.stderr if file is None else file)

    return show


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineErrorParser(prog="opgrad", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineErrorParser)
    modules = {}
    parsers = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = parsers[name] = sub.add_parser(name, help=help_text, description=help_text)
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:  # a subcommand whose optional pieces are missing stays listed
            sub_parser.set_defaults(_unavailable=f"this command is unavailable: {exc}")
            continue
        module.configure(sub_parser)
        modules[name] = module
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # named by the command they were given to, as its other errors are
            (parsers.get(args.command) or parser).error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # --help (0) or a bad option (2, after argparse's "error:" line)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "_unavailable", None):
        print(f"opgrad {args.command}: error: {args._unavailable}", file=sys.stderr)
        return 2
    try:
        with warnings.catch_warnings():
            warnings.showwarning = one_line_warnings(f"opgrad {args.command}", warnings.showwarning)
            check_environment()  # a bad setting fails now, not when the first kernel compiles
            return int(modules[args.command].run(args) or 0)
    except UserError as exc:
        print(f"opgrad {args.command}: error: {one_line(exc)}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `opgrad ops | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
