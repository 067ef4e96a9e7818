"""Exceptions raised by opgrad.

Every error a user can trigger names the operator (or function argument) involved, what it got
and what was expected. The classes subclass the builtin exception a Python user would expect to
catch (``ValueError`` for bad values and shapes, ``TypeError`` for wrong kinds), so existing
``except ValueError`` code keeps working.

:class:`UserError` marks the problems that come from what a user supplied (an option, an
environment variable, a file) rather than from a bug: the ``opgrad`` command prints them as one
line, ``opgrad <command>: error: <message>``, and exits with the class's ``exit_code``; any other
exception keeps its traceback, because it is a bug worth reporting.
"""

from __future__ import annotations

import sys


class OpgradError(Exception):
    """Base class of every error opgrad raises on purpose."""


class ShapeError(OpgradError, ValueError):
    """Raised by a shape rule or attribute validator; the operator adds the call's context."""


class DimensionTypeError(ShapeError, TypeError):
    """A shape has a dimension that is not an integer (a float, a bool, a string)."""


class OpCallError(OpgradError, ValueError):
    """A call of a registered operator is invalid (bad shapes, dtypes or attributes)."""


class OpInputTypeError(OpCallError, TypeError):
    """An operator input is neither an opgrad expression nor a numeric array or scalar."""


class ArgumentError(OpgradError, ValueError):
    """An array passed to ``evaluate`` or a compiled function does not match its parameter."""


class GradientError(OpgradError):
    """Differentiation failed: an operator on the path has no gradient, or a rule misbehaved."""


class RegistryError(OpgradError, LookupError):
    """An operator name is unknown or declared twice."""


class UserError(OpgradError):
    """A problem with something the user supplied; the CLI prints it as one line.

    ``exit_code`` is the ``opgrad`` command's exit status for it: 2 for bad input (as argparse
    uses for bad options), 1 for a run that started and then failed.
    """

    exit_code: int = 2


class ConfigError(UserError, ValueError):
    """An option or environment variable has an invalid value; the message names it."""


class OutputFileError(UserError, OSError):
    """A file opgrad was asked to write could not be written; the message names the file."""

    exit_code = 1

    def __str__(self) -> str:
        # OSError's own __str__ prefixes "[Errno N]" when given more than one argument; the
        # message is always built complete here, so it is shown as is.
        return str(self.args[0]) if self.args else ""


class NonFiniteLossError(UserError, ArithmeticError):
    """The training loss became nan or infinite: the run diverged.

    ``epoch`` and ``step`` count from 1; ``step`` is the global optimizer step and
    ``epoch_step`` the step within the epoch when known. The parameters are those before the
    step that produced ``loss``. ``hint`` is the advice at the end of the message; the CLI
    replaces it with one that names its options.
    """

    exit_code = 1

    def __init__(self, loss: float, *, epoch: int, step: int, lr: float, epoch_step: int | None = None,
                 hint: str = "the run diverged; try a lower learning rate") -> None:
        super().__init__(loss, epoch, step, lr)
        self.loss, self.epoch, self.step, self.lr = loss, epoch, step, lr
        self.epoch_step = epoch_step
        self.hint = hint

    def __str__(self) -> str:
        where = f"epoch {self.epoch}, step {self.epoch_step} (global step {self.step})" \
            if self.epoch_step is not None else f"epoch {self.epoch}, global step {self.step}"
        return f"training loss is {float(self.loss):g} at {where} with learning rate {self.lr:g}: {self.hint}"


class CompileError(OpgradError, RuntimeError):
    """Native compilation failed; the message names the function, the kernel and the host CPU."""


class CompileWarning(UserWarning):
    """Compilation succeeded only by working around a problem (e.g. an LLVM crash) that was found."""


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a :func:`warnings.warn` in the calling function name the
    first frame outside opgrad: the user's line that led to it, wherever inside opgrad the
    warning arises (the outermost frame where opgrad itself was run, as a command)."""
    level, frame = 1, sys._getframe(1)
    while frame.f_back is not None:
        module = str(frame.f_globals.get("__name__", ""))
        if module != "opgrad" and not module.startswith("opgrad."):
            break
        level, frame = level + 1, frame.f_back
    return level
