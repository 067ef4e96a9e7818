"""Code generation targets: the host, named x86-64 baselines, and 64-bit ARM Linux and Android.

Everything that shapes the generated code for a CPU reads a :class:`Target`: the vector width
and register count size the GEMM register tile (:meth:`opgrad.compiler.gemm.Blocking.for_target`),
the function attributes go on every emitted function (:class:`opgrad.compiler.irtext.ModuleEmitter`),
and the triple, CPU name and features build LLVM's target machine. Which target is in force is a
context variable (:func:`use_target`), so the lowering code needs no extra parameter and the
in-process JIT, which never sets it, keeps compiling for the host exactly as before.

Named targets (:func:`resolve_target`)::

    host                    this machine's triple, CPU name and features (the JIT's target)
    x86-64, x86-64-v2/v3/v4 the x86-64 psABI levels (v3: AVX2 + FMA; v4: AVX-512)
    aarch64-linux-gnu       64-bit ARM Linux with glibc, NEON (cross-built with aarch64-linux-gnu-gcc)
    aarch64-linux-android   64-bit ARM Android (API 24), NEON; built into an app with the NDK

Any other LLVM triple is accepted with an explicit ``cpu`` and ``features``.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

import llvmlite.binding as llvm

from opgrad.locks import ForkSafeLock

__all__ = [
    "NAMED_TARGETS",
    "Target",
    "cache_share",
    "cache_size",
    "current_target",
    "host_target",
    "resolve_target",
    "use_target",
]

_init_lock = ForkSafeLock()
_initialized = False


def ensure_native_initialized() -> None:
    """Initialize the native target once (``llvm.initialize()`` raises in llvmlite 0.50)."""
    global _initialized
    with _init_lock:
        if not _initialized:
            llvm.initialize_native_target()
            llvm.initialize_native_asmprinter()
            _initialized = True


@dataclass(frozen=True)
class Target:
    """A CPU to generate code for; part of the object cache key because it changes the machine code.

    ``name`` is only a label for messages (``host``, ``aarch64-linux-gnu``); two targets with the
    same triple, CPU and features are equal whatever their labels.
    """

    triple: str
    cpu: str
    features: str
    name: str = field(default="host", compare=False)

    def _has(self, feature: str) -> bool:
        return f"+{feature}" in self.features.split(",")

    @property
    def is_x86(self) -> bool:
        return self.triple.startswith(("x86_64", "i686", "i386"))

    @property
    def is_aarch64(self) -> bool:
        return self.triple.startswith(("aarch64", "arm64"))

    @property
    def is_android(self) -> bool:
        return "android" in self.triple

    @property
    def has_avx512(self) -> bool:
        return self._has("avx512f")

    @property
    def has_fma(self) -> bool:
        """Whether the CPU fuses a multiply and an add in one instruction: x86 with FMA3 (every
        x86-64-v3 CPU), and AArch64, whose NEON always has it."""
        return self._has("fma") if self.is_x86 else self.is_aarch64

    @property
    def vector_registers(self) -> int:
        """Architectural vector registers: the budget for a GEMM register tile."""
        if self.has_avx512:
            return 32
        return 16 if self.is_x86 else 32

    @property
    def function_attrs(self) -> str:
        """Without these, x86 backends tuned for 256-bit vectors split our explicit 512-bit ones."""
        if self.has_avx512:
            return '"prefer-vector-width"="512" "min-legal-vector-width"="512"'
        return ""

    def vector_width(self, dtype_bytes: int) -> int:
        """Lanes in the widest native vector register for elements of ``dtype_bytes`` bytes.

        AArch64 counts NEON's 128-bit registers; SVE's width is unknown at compile time.
        """
        if self.has_avx512:
            bits = 512
        elif self._has("avx2") or self._has("avx"):
            bits = 256
        else:
            bits = 128
        return bits // (8 * dtype_bytes)


#: Alias kept for code that names the host's description by its old class name.
HostTarget = Target


@functools.lru_cache(maxsize=1)
def host_target() -> Target:
    """Describe the host: without the host CPU name and features, FMA becomes a library call."""
    ensure_native_initialized()
    return Target(
        triple=llvm.get_process_triple(),
        cpu=llvm.get_host_cpu_name(),
        features=llvm.get_host_cpu_features().flatten(),
    )


@functools.lru_cache(maxsize=8)
def cache_size(level: int) -> int | None:
    """Bytes of this host's level-``level`` data (or unified) cache per core, from Linux's sysfs;
    None where it is not exposed (then callers keep their defaults)."""
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    try:
        entries = sorted(root.glob("index*"))
    except OSError:
        return None
    for entry in entries:
        try:
            if int((entry / "level").read_text()) != level or (entry / "type").read_text().strip() == "Instruction":
                continue
            text = (entry / "size").read_text().strip().upper()
        except (OSError, ValueError):
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            return int(digits) * scale
    return None


@functools.lru_cache(maxsize=8)
def cache_share(level: int) -> int | None:
    """Bytes of this host's level-``level`` data (or unified) cache that one CPU has to itself when
    every CPU sharing it works: its size over the CPUs sysfs lists as sharing it (an L3 of 32 MiB
    shared by 8 cores: 4 MiB). None where sysfs does not say."""
    size = cache_size(level)
    if size is None:
        return None
    for entry in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if int((entry / "level").read_text()) != level or (entry / "type").read_text().strip() == "Instruction":
                continue
            cpus = _cpu_count((entry / "shared_cpu_list").read_text())
        except (OSError, ValueError):
            return size
        return size // max(1, cpus)
    return size


def _cpu_count(cpu_list: str) -> int:
    """CPUs in a sysfs list such as ``0-3,8-11``."""
    count = 0
    for part in cpu_list.strip().split(","):
        first, _, last = part.partition("-")
        count += int(last or first) - int(first) + 1
    return count


_X86_V2 = "+cx16,+popcnt,+sse3,+sse4.1,+sse4.2,+ssse3,+sahf"
_X86_V3 = _X86_V2 + ",+avx,+avx2,+bmi,+bmi2,+f16c,+fma,+lzcnt,+movbe,+xsave"
_X86_V4 = _X86_V3 + ",+avx512f,+avx512bw,+avx512cd,+avx512dq,+avx512vl"

#: name -> (triple, cpu, features). The features list what the CPU name implies, so the
#: properties above (vector width, registers) read them without asking LLVM.
NAMED_TARGETS: dict[str, tuple[str, str, str]] = {
    "x86-64": ("x86_64-unknown-linux-gnu", "x86-64", "+sse,+sse2"),
    "x86-64-v2": ("x86_64-unknown-linux-gnu", "x86-64-v2", "+sse,+sse2," + _X86_V2),
    "x86-64-v3": ("x86_64-unknown-linux-gnu", "x86-64-v3", "+sse,+sse2," + _X86_V3),
    "x86-64-v4": ("x86_64-unknown-linux-gnu", "x86-64-v4", "+sse,+sse2," + _X86_V4),
    "aarch64-linux-gnu": ("aarch64-unknown-linux-gnu", "generic", "+neon,+fp-armv8"),
    "aarch64-linux-android": ("aarch64-unknown-linux-android24", "generic", "+neon,+fp-armv8"),
}


#: Creates a target machine for (triple, cpu) in a child process: LLVM says on its standard
#: error when it does not know the CPU (and ignores it), and with no features to go on it may
#: abort the process that compiles for it.
_CPU_PROBE = """
import sys
import llvmlite.binding as llvm
llvm.initialize_all_targets()
llvm.Target.from_triple(sys.argv[1]).create_target_machine(cpu=sys.argv[2], features=sys.argv[3])
"""


def check_cpu(triple: str, cpu: str, features: str = "") -> None:
    """A ``ValueError`` where LLVM does not know ``cpu`` or one of ``features`` for ``triple`` (a
    misspelt ``--cpu`` or ``--features``, or another architecture's feature), which it would
    only warn about on stderr and ignore. The probe runs in a child process, whose stderr says."""
    import subprocess
    import sys

    try:
        probe = subprocess.run([sys.executable, "-c", _CPU_PROBE, triple, cpu, features], capture_output=True,
                               text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return  # no verdict: the compile itself still runs with the name
    if "not a recognized processor" in probe.stderr:
        raise ValueError(f"cpu {cpu!r}: LLVM does not know this processor for {triple} (it would ignore the name); "
                         f"use an LLVM CPU name such as {host_target().cpu!r} (this host's) or 'generic'")
    unknown = re.findall(r"'([^']+)' is not a recognized feature", probe.stderr)
    if unknown:
        raise ValueError(f"features {', '.join(unknown)}: LLVM does not know them for {triple} (it would ignore "
                         "them); give +name or -name of features of that architecture, e.g. +avx2 or +neon")


def check_feature_syntax(features: str) -> None:
    """A ``ValueError`` unless ``features`` is a comma-separated list of ``+name`` / ``-name``
    (LLVM asserts on a bare name and skips empty entries)."""
    entries = [entry.strip() for entry in features.split(",")]
    bad = [entry for entry in entries if len(entry) < 2 or entry[0] not in "+-" or not entry[1:].replace("-", "")
           .replace(".", "").replace("_", "").isalnum()]
    if bad:
        raise ValueError(f"features {features!r}: {bad[0]!r} is not +name or -name; give a comma-separated list "
                         "such as +avx2,+fma or -avx512f")


def resolve_target(name: str = "host", cpu: str | None = None, features: str | None = None) -> Target:
    """The target called ``name`` (``host``, a key of :data:`NAMED_TARGETS`, or an LLVM triple).

    ``cpu``/``features`` override the named target's; a bare triple needs no override (it gets
    the ``generic`` CPU) but is checked against LLVM's list of targets. A ``cpu`` or ``features``
    given is checked against LLVM's processors and features for the triple (:func:`check_cpu`).
    """
    if not isinstance(name, str):
        raise ValueError(f"target must be a name or an LLVM triple (a str), got {type(name).__name__} {name!r}")
    if features is not None:
        check_feature_syntax(features)
    target = _resolved_target(name, cpu, features)
    if cpu is not None or features:
        check_cpu(target.triple, target.cpu, features or "")
    return target


def _resolved_target(name: str, cpu: str | None, features: str | None) -> Target:
    if name == "host":
        host = host_target()
        if cpu is None and features is None:
            return host
        return Target(host.triple, cpu or host.cpu, features if features is not None else host.features, "host")
    if name in NAMED_TARGETS:
        triple, default_cpu, default_features = NAMED_TARGETS[name]
        return Target(triple, cpu or default_cpu, features if features is not None else default_features, name)
    if name.count("-") < 1 or not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise ValueError(f"unknown target {name!r}: expected host, {', '.join(NAMED_TARGETS)} or an LLVM triple")
    ensure_all_targets()
    try:
        llvm.Target.from_triple(name)
    except RuntimeError as exc:
        raise ValueError(f"unknown target {name!r}: LLVM has no backend for it ({exc})") from None
    return Target(name, cpu or "generic", features or "", name)


_all_lock = ForkSafeLock()
_all_initialized = False


def ensure_all_targets() -> None:
    """Register every LLVM backend (needed for triples other than the host's)."""
    global _all_initialized
    with _all_lock:
        if not _all_initialized:
            llvm.initialize_all_targets()
            llvm.initialize_all_asmprinters()
            _all_initialized = True


_current: ContextVar[Target | None] = ContextVar("opgrad_target", default=None)


def current_target() -> Target:
    """The target code is generated for: the one set by :func:`use_target`, else the host."""
    target = _current.get()
    return target if target is not None else host_target()


@contextlib.contextmanager
def use_target(target: Target) -> Iterator[Target]:
    """Generate code for ``target`` inside the ``with`` block (this thread/context only)."""
    token = _current.set(target)
    try:
        yield target
    finally:
        _current.reset(token)
