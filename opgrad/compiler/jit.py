"""Host JIT: optimize LLVM IR text at O3 for this CPU, compile it with MCJIT, cache objects on disk.

Everything above this module produces LLVM IR *text*; this module is the only place that talks to
llvmlite's binding layer. A :class:`NativeModule` owns one MCJIT engine; function addresses it
hands out stay valid while the object is alive.

The object cache skips both optimization and codegen in a second process: the key is the sha256 of
the *unoptimized* IR text plus everything that changes the machine code (CPU name and features,
llvmlite version, :data:`ENGINE_VERSION`). Entries are written atomically (temp file +
``os.replace``) and carry a header (magic, payload length, payload sha256) so a truncated or
corrupt entry is detected, reported with :func:`warnings.warn`, deleted and rebuilt.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import struct
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import llvmlite
import llvmlite.binding as llvm

#: Bump when the optimization pipeline or target-machine options change: it invalidates the cache.
ENGINE_VERSION = "opgrad-engine-1"

_MAGIC = b"OPGRDOB1"
_HEADER = struct.Struct("<8sQ32s")  # magic, payload length, sha256(payload)

_init_lock = threading.Lock()
_initialized = False


def _ensure_initialized() -> None:
    """Initialize the native target once (``llvm.initialize()`` raises in llvmlite 0.50)."""
    global _initialized
    with _init_lock:
        if not _initialized:
            llvm.initialize_native_target()
            llvm.initialize_native_asmprinter()
            _initialized = True


@dataclass(frozen=True)
class HostTarget:
    """The CPU the code is compiled for; part of the cache key because it changes the machine code."""

    triple: str
    cpu: str
    features: str

    @property
    def is_x86(self) -> bool:
        return self.triple.startswith(("x86_64", "i686", "i386"))

    @property
    def has_avx512(self) -> bool:
        return "+avx512f" in self.features.split(",")

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
        """Lanes in the widest native vector register for elements of ``dtype_bytes`` bytes."""
        if self.has_avx512:
            bits = 512
        elif "+avx2" in self.features.split(",") or "+avx" in self.features.split(","):
            bits = 256
        else:
            bits = 128
        return bits // (8 * dtype_bytes)


@functools.lru_cache(maxsize=1)
def host_target() -> HostTarget:
    """Describe the host: without the host CPU name and features, FMA becomes a library call."""
    _ensure_initialized()
    return HostTarget(
        triple=llvm.get_process_triple(),
        cpu=llvm.get_host_cpu_name(),
        features=llvm.get_host_cpu_features().flatten(),
    )


def _target_machine() -> llvm.TargetMachine:
    """A fresh target machine (an MCJIT engine takes ownership of the one it is given)."""
    host = host_target()
    target = llvm.Target.from_triple(host.triple)
    return target.create_target_machine(
        cpu=host.cpu, features=host.features, opt=3, reloc="default", codemodel="jitdefault", jit=True
    )


def _optimize(module: llvm.ModuleRef, tm: llvm.TargetMachine) -> None:
    """Run the new pass manager's O3 pipeline with loop/SLP vectorization and unrolling."""
    pto = llvm.create_pipeline_tuning_options(speed_level=3)
    pto.loop_vectorization = True
    pto.slp_vectorization = True
    pto.loop_unrolling = True
    pto.loop_interleaving = True
    pb = llvm.create_pass_builder(tm, pto)
    pm = pb.getModulePassManager()
    pm.run(module, pb)


# ----- Persistent object cache -----


def cache_dir() -> Path:
    """The cache directory: ``$OPGRAD_CACHE_DIR`` or ``~/.cache/opgrad``."""
    env = os.environ.get("OPGRAD_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "opgrad"


def cache_key(ir_text: str) -> str:
    """sha256 over the IR text and everything else that determines the object code."""
    host = host_target()
    h = hashlib.sha256()
    for part in (ENGINE_VERSION, llvmlite.__version__, host.triple, host.cpu, host.features, ir_text):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


class ObjectCache:
    """On-disk store of compiled objects, one file per key, each validated by its own header."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory if directory is not None else cache_dir()

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.o"

    def load(self, key: str) -> bytes | None:
        """Return the payload, or None if absent; a damaged entry is warned about and deleted."""
        path = self.path(key)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            warnings.warn(f"opgrad: cannot read cached object {path}: {exc}", stacklevel=3)
            return None
        problem = self._check(blob)
        if problem is None:
            return blob[_HEADER.size :]
        warnings.warn(f"opgrad: cached object {path} is {problem}; deleting and rebuilding", stacklevel=3)
        with contextlib.suppress(OSError):
            path.unlink()
        return None

    @staticmethod
    def _check(blob: bytes) -> str | None:
        if len(blob) < _HEADER.size:
            return "truncated (no header)"
        magic, length, digest = _HEADER.unpack_from(blob)
        if magic != _MAGIC:
            return "not an opgrad object (bad magic)"
        payload = memoryview(blob)[_HEADER.size :]
        if len(payload) != length:
            return f"truncated ({len(payload)} of {length} bytes)"
        if hashlib.sha256(payload).digest() != digest:
            return "corrupt (checksum mismatch)"
        return None

    def store(self, key: str, payload: bytes) -> None:
        """Write atomically: a reader sees either no entry or a complete one, never a partial file."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            header = _HEADER.pack(_MAGIC, len(payload), hashlib.sha256(payload).digest())
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=".o")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(header)
                    f.write(payload)
                os.replace(tmp, self.path(key))
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as exc:  # a read-only home must not break compilation
            warnings.warn(f"opgrad: cannot write object cache in {self.directory}: {exc}", stacklevel=3)


# ----- Symbols shared between modules -----

_symbols: dict[str, int] = {}


def register_symbol(name: str, address: int) -> None:
    """Make ``name`` resolvable by later modules (e.g. the thread-pool runtime, libc's syscall)."""
    _symbols[name] = address
    llvm.add_symbol(name, address)


# ----- Native modules -----


@dataclass
class CompileTimes:
    """Wall-clock seconds spent in each stage; a cache hit has optimize = codegen = 0."""

    parse: float = 0.0
    optimize: float = 0.0
    codegen: float = 0.0
    load: float = 0.0
    cache_hit: bool = False

    @property
    def total(self) -> float:
        return self.parse + self.optimize + self.codegen + self.load


@dataclass
class NativeModule:
    """LLVM IR text compiled for the host; exposes function addresses for ctypes.

    ``use_cache=False`` bypasses the disk cache (used by tests and when the IR is throwaway).
    """

    ir_text: str
    use_cache: bool = True
    cache: ObjectCache | None = None
    times: CompileTimes = field(default_factory=CompileTimes)
    key: str = ""

    def __post_init__(self) -> None:
        _ensure_initialized()
        self.key = cache_key(self.ir_text)
        store = (self.cache or ObjectCache()) if self.use_cache else None
        t0 = time.perf_counter()
        module = llvm.parse_assembly(self.ir_text)
        module.verify()
        t1 = time.perf_counter()
        self.times.parse = t1 - t0
        cached = store.load(self.key) if store is not None else None
        tm = _target_machine()
        if cached is None:
            _optimize(module, tm)
            self.times.optimize = time.perf_counter() - t1
        self._engine = llvm.create_mcjit_compiler(module, tm)
        if store is not None:
            key = self.key

            def notify(_mod: llvm.ModuleRef, buf: bytes) -> None:
                if cached is None:
                    store.store(key, buf)

            def getbuffer(_mod: llvm.ModuleRef) -> bytes | None:
                return cached

            self._engine.set_object_cache(notify, getbuffer)
        t2 = time.perf_counter()
        self._engine.finalize_object()
        dt = time.perf_counter() - t2
        if cached is None:
            self.times.codegen = dt
        else:
            self.times.load = dt
            self.times.cache_hit = True

    def address(self, name: str) -> int:
        """Address of a function defined in the IR; raises KeyError if it is not there."""
        addr = self._engine.get_function_address(name)
        if not addr:
            raise KeyError(f"function {name!r} not found in native module")
        return int(addr)

    def cfunc(self, name: str, restype: object, *argtypes: object) -> ctypes._CFuncPtr:
        """A ctypes function for ``name``; ctypes releases the GIL during the call."""
        proto = ctypes.CFUNCTYPE(restype, *argtypes)  # type: ignore[arg-type]
        fn = proto(self.address(name))
        fn._opgrad_module = self  # keep the code alive as long as the function object
        return fn
