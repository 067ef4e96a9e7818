"""Environment variables opgrad reads, parsed in one place so a bad value fails with its name.

``OPGRAD_NUM_THREADS`` sets the number of worker threads of compiled kernels (default: the CPUs
this process may run on). It is read when the first kernel is compiled; the ``opgrad`` command
checks it up front, so a typo fails before any work, as one line.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from opgrad.errors import ConfigError

__all__ = ["NUM_THREADS_VAR", "check_environment", "num_threads_setting"]

NUM_THREADS_VAR = "OPGRAD_NUM_THREADS"


def num_threads_setting(environ: Mapping[str, str] | None = None) -> int | None:
    """The thread count ``$OPGRAD_NUM_THREADS`` asks for; None when it is unset or empty.

    Raises :class:`~opgrad.errors.ConfigError` (a ``ValueError``) naming the variable unless the
    value is a positive integer.
    """
    text = (os.environ if environ is None else environ).get(NUM_THREADS_VAR, "")
    if not text.strip():
        return None
    try:
        value = int(text.strip(), 10)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(
            f"environment variable {NUM_THREADS_VAR}={text!r}: expected a positive integer (the number of "
            f"worker threads for compiled kernels, e.g. {NUM_THREADS_VAR}=4), or leave it unset to use every CPU"
        )
    return value


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Validate every opgrad environment variable; raises ``ConfigError`` for the first bad one."""
    num_threads_setting(environ)
