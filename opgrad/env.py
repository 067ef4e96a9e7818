"""Environment variables opgrad reads, parsed in one place so a bad value fails with its name.

``OPGRAD_NUM_THREADS`` sets the number of worker threads of compiled kernels (default: the CPUs
this process may run on). It is read when the first kernel is compiled; the ``opgrad`` command
checks every variable here up front, so a typo fails before any work, as one line.
``OPGRAD_CACHE_DIR`` is the compiled-object cache directory (default ``$XDG_CACHE_HOME/opgrad`` or
``~/.cache/opgrad``).
``OPGRAD_COMPILE_IN_PROCESS=1`` runs LLVM in the calling process instead of a worker process.
``OPGRAD_CONV_ALGORITHM`` picks how stride-1 convolutions run: ``auto`` (the default: Winograd for
3x3 kernels where it pays, a sliding window for few input taps), ``direct`` (always the im2col
GEMM) or ``winograd`` (wherever it applies).
``OPGRAD_PLAN_CACHE=0`` plans every compile afresh instead of loading a stored plan
(:mod:`opgrad.compiler.plancache`): for code that patches opgrad's compiler at run time.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from pathlib import Path

from opgrad.errors import ConfigError

__all__ = [
    "CACHE_DIR_VAR",
    "COMPILE_IN_PROCESS_VAR",
    "CONV_ALGORITHMS",
    "CONV_ALGORITHM_VAR",
    "MAX_THREADS",
    "NUM_THREADS_VAR",
    "PLAN_CACHE_VAR",
    "available_cpus",
    "cache_dir_setting",
    "cgroup_cpu_limit",
    "check_environment",
    "compile_in_process_setting",
    "conv_algorithm_setting",
    "num_threads_setting",
    "plan_cache_setting",
]

NUM_THREADS_VAR = "OPGRAD_NUM_THREADS"
CACHE_DIR_VAR = "OPGRAD_CACHE_DIR"
COMPILE_IN_PROCESS_VAR = "OPGRAD_COMPILE_IN_PROCESS"
CONV_ALGORITHM_VAR = "OPGRAD_CONV_ALGORITHM"
CONV_ALGORITHMS = ("auto", "direct", "winograd")
PLAN_CACHE_VAR = "OPGRAD_PLAN_CACHE"


#: Most worker threads a pool runs (the exported C runtime's limit too): thousands of spinning
#: workers on a few cores would turn a step of milliseconds into minutes.
MAX_THREADS = 256


def num_threads_setting(environ: Mapping[str, str] | None = None) -> int | None:
    """The thread count ``$OPGRAD_NUM_THREADS`` asks for; None when it is unset or empty.

    Raises :class:`~opgrad.errors.ConfigError` (a ``ValueError``) naming the variable unless the
    value is a positive integer of at most :data:`MAX_THREADS`.
    """
    text = (os.environ if environ is None else environ).get(NUM_THREADS_VAR, "")
    if not text.strip():
        return None
    # Plain ASCII digits: int() would also take "1_6", "+2" and other scripts' digits.
    value = int(text.strip()) if re.fullmatch(r"[0-9]+", text.strip()) else 0
    if value < 1:
        raise ConfigError(
            f"environment variable {NUM_THREADS_VAR}={text!r}: expected a positive integer (the number of "
            f"worker threads for compiled kernels, e.g. {NUM_THREADS_VAR}=4), or leave it unset to use every CPU"
        )
    if value > MAX_THREADS:
        raise ConfigError(f"environment variable {NUM_THREADS_VAR}={text!r}: at most {MAX_THREADS} worker threads; "
                          "more than the CPUs only slows the kernels down")
    return value


def cache_dir_setting(environ: Mapping[str, str] | None = None) -> Path:
    """The object-cache directory: ``$OPGRAD_CACHE_DIR``, else ``opgrad`` in ``$XDG_CACHE_HOME``
    (the XDG base directory rule: an absolute path, or it is ignored), else ``~/.cache/opgrad``.

    Raises :class:`~opgrad.errors.ConfigError` when the variable names an existing non-directory.
    """
    env = os.environ if environ is None else environ
    text = env.get(CACHE_DIR_VAR, "")
    if not text.strip():
        xdg = env.get("XDG_CACHE_HOME", "")
        return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "opgrad"
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"environment variable {CACHE_DIR_VAR}={text!r}: is a file, expected a directory for "
                          "compiled objects (it is created if missing)")
    return path


def compile_in_process_setting(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``$OPGRAD_COMPILE_IN_PROCESS`` asks to run LLVM in this process (``1``) or not (``0``)."""
    text = (os.environ if environ is None else environ).get(COMPILE_IN_PROCESS_VAR, "").strip()
    if text not in ("", "0", "1"):
        raise ConfigError(f"environment variable {COMPILE_IN_PROCESS_VAR}={text!r}: expected 0 (compile in a "
                          "worker process, the default) or 1 (compile in this process, without its crash guard)")
    return text == "1"


def conv_algorithm_setting(environ: Mapping[str, str] | None = None) -> str:
    """``$OPGRAD_CONV_ALGORITHM``: ``auto`` (default), ``direct`` or ``winograd``."""
    text = (os.environ if environ is None else environ).get(CONV_ALGORITHM_VAR, "").strip() or "auto"
    if text not in CONV_ALGORITHMS:
        raise ConfigError(f"environment variable {CONV_ALGORITHM_VAR}={text!r}: expected one of "
                          f"{', '.join(CONV_ALGORITHMS)} (how stride-1 convolutions are computed)")
    return text


def plan_cache_setting(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``$OPGRAD_PLAN_CACHE`` lets a compile load a stored plan (``1``, the default) or not (``0``)."""
    text = (os.environ if environ is None else environ).get(PLAN_CACHE_VAR, "").strip()
    if text not in ("", "0", "1"):
        raise ConfigError(f"environment variable {PLAN_CACHE_VAR}={text!r}: expected 1 (load a graph's stored "
                          "plan, the default) or 0 (plan every compile afresh)")
    return text != "0"


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Validate every opgrad environment variable; raises ``ConfigError`` for the first bad one."""
    num_threads_setting(environ)
    cache_dir_setting(environ)
    compile_in_process_setting(environ)
    conv_algorithm_setting(environ)
    plan_cache_setting(environ)


def cgroup_cpu_limit(path: Path = Path("/sys/fs/cgroup/cpu.max"),
                     v1: Path = Path("/sys/fs/cgroup/cpu")) -> float | None:
    """CPUs the cgroup quota allows (``quota / period``: v2's ``cpu.max``, else v1's
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), or None when unlimited or unknown."""
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = (v1 / "cpu.cfs_quota_us").read_text().strip()
            period = (v1 / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    if quota in ("max", "-1"):
        return None
    try:
        limit = int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None
    return limit if limit > 0 else None


def available_cpus() -> int:
    """The CPUs this process may use: its affinity mask, capped by the cgroup's CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    if limit is not None:
        cpus = min(cpus, max(1, math.floor(limit)))
    return max(1, cpus)
