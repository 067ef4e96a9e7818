"""Host JIT: optimize LLVM IR text for this CPU in a crash-proof worker, cache objects on disk.

Everything above this module produces LLVM IR *text*; this module and :mod:`.llvm_worker` are the
only places that talk to llvmlite's binding layer. Optimization and code generation run in a
child process (:mod:`.llvm_worker`), so an LLVM abort costs a worker, not the user's process:
the crashing kernel is found by bisection, the module is rebuilt without the loop vectorizer
(with a :class:`~opgrad.errors.CompileWarning`), and only if that fails too does
:class:`~opgrad.errors.CompileError` name the function, the kernel and the host CPU. A
:class:`NativeModule` loads the resulting object into its own MCJIT engine; function addresses it
hands out stay valid while the object is alive.

The object cache skips the worker entirely in a second process: the key is the sha256 of the
*unoptimized* IR text plus everything that changes the machine code (CPU name and features,
llvmlite version, :data:`ENGINE_VERSION`). Entries are written atomically (temp file +
``os.replace``) and carry a header (magic, the key, payload length, payload sha256), so a
truncated or corrupt entry, or one copied over another key's file, is detected, reported with
:func:`warnings.warn`, deleted and rebuilt.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import hashlib
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llvmlite
import llvmlite.binding as llvm

from opgrad.atomic import atomic_writer
from opgrad.env import available_cpus, cache_dir_setting, compile_in_process_setting
from opgrad.errors import CompileError, CompileWarning, user_stacklevel
from opgrad.locks import ForkSafeLock

from . import llvm_worker
from .merge import merge_identical_functions
from .split import DEFINE, isolate_kernels, pipeline_pieces, split_module
from .target import HostTarget, Target, ensure_native_initialized, host_target

__all__ = ["ENGINE_VERSION", "Codegen", "HostTarget", "NativeModule", "ObjectCache", "ObjectMissing", "build_object",
           "cache_key", "declared_functions", "host_target", "object_code"]

#: Bump when the optimization pipeline, target-machine options or cache format change.
ENGINE_VERSION = "opgrad-engine-4"

_MAGIC = b"OPGRDOB2"
_HEADER = struct.Struct("<8s32sQ32s")  # magic, sha256 key, payload length, sha256(payload)

_ensure_initialized = ensure_native_initialized


@dataclass(frozen=True)
class Codegen:
    """How an object is built: for which target, and whether MCJIT loads it into this process.

    ``jit=True`` (the in-process path) uses LLVM's JIT relocation and code models; ``jit=False``
    emits a position-independent object with the default code model, for a linker elsewhere (a
    static or shared library, another architecture).
    """

    target: Target
    jit: bool = True

    @property
    def reloc(self) -> str:
        return "default" if self.jit else "pic"

    @property
    def codemodel(self) -> str:
        return "jitdefault" if self.jit else "default"

    def request(self, vectorize: bool) -> dict[str, Any]:
        """The compile worker's options; the JIT's request is what it always was."""
        t = self.target
        options: dict[str, Any] = {"triple": t.triple, "cpu": t.cpu, "features": t.features, "vectorize": vectorize}
        if not self.jit:
            options.update(reloc=self.reloc, codemodel=self.codemodel, jit=False)
        return options

    def key_parts(self) -> tuple[str, ...]:
        """What the cache key covers besides the IR; a host JIT key is unchanged by the export path."""
        t = self.target
        parts: tuple[str, ...] = (t.triple, t.cpu, t.features)
        return parts if self.jit else (*parts, "object", self.reloc, self.codemodel)


def host_jit() -> Codegen:
    return Codegen(host_target())


def _target_machine() -> llvm.TargetMachine:
    """A fresh target machine (an MCJIT engine takes ownership of the one it is given)."""
    host = host_target()
    return llvm_worker.target_machine(host.triple, host.cpu, host.features)


# ----- Persistent object cache -----


def cache_dir() -> Path:
    """The cache directory: ``$OPGRAD_CACHE_DIR`` or ``~/.cache/opgrad``."""
    return cache_dir_setting()


def cache_key(ir_text: str, codegen: Codegen | None = None) -> str:
    """sha256 over the IR text and everything else that determines the object code."""
    parts = (codegen or host_jit()).key_parts()
    h = hashlib.sha256()
    for part in (ENGINE_VERSION, llvmlite.__version__, *parts, ir_text):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


class ObjectCache:
    """On-disk store of compiled objects, one file per key, each validated by its own header.

    ``suffix`` and ``what`` let other entries share the directory and format (stored plans:
    ``.plan``, :mod:`.plancache`)."""

    def __init__(self, directory: Path | None = None, suffix: str = ".o", what: str = "object") -> None:
        self.directory = directory if directory is not None else cache_dir()
        self.suffix = suffix
        self.what = what

    def path(self, key: str) -> Path:
        return self.directory / f"{key}{self.suffix}"

    def load(self, key: str) -> bytes | None:
        """Return the payload, or None if absent; a damaged entry is warned about and deleted."""
        path = self.path(key)
        try:
            if path.exists() and not path.is_file():  # a device, fifo or folder: reading may never end
                self.discard(key, "not a regular file")
                return None
            blob = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):  # no entry (the folder cannot be one: written then)
            return None
        except OSError as exc:
            warnings.warn(f"opgrad: cannot read cached {self.what} {path}: {exc}", stacklevel=user_stacklevel())
            return None
        problem = self.check(blob, key)
        if problem is None:
            return blob[_HEADER.size :]
        self.discard(key, problem)
        return None

    def discard(self, key: str, problem: str) -> None:
        """Warn that the entry under ``key`` is ``problem`` (damaged), and delete it."""
        path = self.path(key)
        warnings.warn(f"opgrad: cached {self.what} {path} is {problem}; deleting and rebuilding",
                      stacklevel=user_stacklevel())
        with contextlib.suppress(OSError):
            path.unlink()

    @staticmethod
    def check(blob: bytes, key: str) -> str | None:
        """What is wrong with the entry ``blob`` stored under ``key``, or None if it is sound."""
        if len(blob) < _HEADER.size:
            return "truncated (no header)"
        magic, stored_key, length, digest = _HEADER.unpack_from(blob)
        if magic != _MAGIC:
            return "not an opgrad object of this version (bad magic)"
        if stored_key != bytes.fromhex(key):
            return f"the entry of another key ({stored_key.hex()[:16]}...)"
        payload = memoryview(blob)[_HEADER.size :]
        if len(payload) != length:
            return f"truncated ({len(payload)} of {length} bytes)"
        if hashlib.sha256(payload).digest() != digest:
            return "corrupt (checksum mismatch)"
        return None

    def store(self, key: str, payload: bytes) -> None:
        """Write atomically: a reader sees either no entry or a complete one, never a partial file.

        A compile killed while writing leaves a temporary named after its entry and its pid; the
        next store of that entry removes it.
        """
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            header = _HEADER.pack(_MAGIC, bytes.fromhex(key), len(payload), hashlib.sha256(payload).digest())
            with atomic_writer(self.path(key), what=f"a compiled {self.what}") as f:
                f.write(header)
                f.write(payload)
        except OSError as exc:  # a read-only home must not break compilation
            warnings.warn(f"opgrad: cannot write the {self.what} cache in {self.directory}: {exc}",
                          stacklevel=user_stacklevel())


# ----- Symbols shared between modules -----

_symbols: dict[str, int] = {}


_providers: dict[str, Callable[[], object]] = {}


def register_symbol(name: str, address: int) -> None:
    """Make ``name`` resolvable by later modules (e.g. the thread-pool runtime, libc's syscall)."""
    _symbols[name] = address
    llvm.add_symbol(name, address)


def provide_symbol(name: str, start: Callable[[], object]) -> None:
    """``start()`` registers ``name`` (through :func:`register_symbol`) the first time a module that
    declares it loads: MCJIT aborts the process on a symbol it cannot resolve."""
    _providers[name] = start


_DECLARE = re.compile(r"^declare [^@\n]*@([^\s(]+)\(", re.MULTILINE)


def declared_functions(ir_text: str) -> list[str]:
    """The functions ``ir_text`` declares (calls without defining), in order."""
    return _DECLARE.findall(ir_text)


def _resolve_provided_symbols(declared: list[str]) -> None:
    for name, start in list(_providers.items()):
        if name not in _symbols and name in declared:
            start()
            if name not in _symbols:
                raise RuntimeError(f"opgrad: starting the provider of {name!r} did not register it")


# ----- Compiling in a worker process -----


class WorkerDied(Exception):
    """The compile worker exited without answering; ``detail`` is the end of what it printed."""

    def __init__(self, detail: str, returncode: int | None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.returncode = returncode


def worker_command() -> list[str]:
    """How the worker is started: this interpreter, isolated from the user's environment and cwd."""
    return [sys.executable, "-I", str(Path(llvm_worker.__file__).resolve())]


class CompileWorker:
    """One long-lived worker process; a dead one is replaced on the next request."""

    def __init__(self) -> None:
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 -- lives as long as the worker; close() ends it
        self._proc = subprocess.Popen(worker_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._stderr)
        self.pid_of_owner = os.getpid()

    def compile(self, ir_text: str, vectorize: bool, codegen: Codegen | None = None) -> bytes:
        """The object for ``ir_text``; raises WorkerDied if the worker crashes, CompileError on bad IR."""
        pieces = pipeline_pieces(ir_text)
        request = (codegen or host_jit()).request(vectorize)
        request["pipelines"] = [pipeline for pipeline, _ in pieces]
        options = json.dumps(request).encode()
        texts = [text.encode() for _, text in pieces]
        proc = self._proc
        assert proc.stdin is not None and proc.stdout is not None
        try:
            try:
                proc.stdin.write(llvm_worker.REQUEST_HEADER.pack(len(options)) + options
                                 + b"".join(llvm_worker.PAYLOAD_LENGTH.pack(len(t)) + t for t in texts))
                proc.stdin.flush()
            except (BrokenPipeError, OSError):
                raise self._died() from None
            head = llvm_worker.read_exact(proc.stdout, 1 + llvm_worker.PAYLOAD_LENGTH.size)
            if head is None:
                raise self._died()
            (length,) = llvm_worker.PAYLOAD_LENGTH.unpack(head[1:])
            payload = llvm_worker.read_exact(proc.stdout, length)
            if payload is None:
                raise self._died()
        except WorkerDied:
            raise
        except BaseException:
            # Interrupted mid-exchange (Ctrl-C, a timeout's signal handler): the worker may still
            # answer this request, and its answer would be read as the next request's object,
            # another model's code, and cached under that model's key. The worker is ended.
            self.abandon()
            raise
        if head[0] == llvm_worker.STATUS_ERROR:
            raise CompileError(f"opgrad: LLVM rejected the generated IR (an opgrad bug; please report it): "
                               f"{payload.decode(errors='replace')}")
        return payload

    def _died(self) -> WorkerDied:
        returncode = self._proc.wait()
        self._stderr.seek(0)
        lines = self._stderr.read().decode(errors="replace").strip().splitlines()
        detail = next((ln for ln in reversed(lines) if "Assertion" in ln or "LLVM ERROR" in ln),
                      lines[-1] if lines else "")
        self.close()
        return WorkerDied(_shorten_llvm_message(detail), returncode)

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def abandon(self) -> None:
        """End the worker now, whatever it is doing (its pipes then read as closed)."""
        with contextlib.suppress(OSError):
            self._proc.kill()
        self.close()

    def close(self) -> None:
        """End the worker: closing its input makes it exit; one that does not is killed."""
        for stream in (self._proc.stdin, self._proc.stdout):
            with contextlib.suppress(OSError):
                if stream is not None:
                    stream.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=5)
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        with contextlib.suppress(OSError):
            self._stderr.close()


def _shorten_llvm_message(line: str) -> str:
    """LLVM's assertion line without the build directory and the asserted expression."""
    line = re.sub(r"\S*/([^/\s]+\.(?:cpp|h|inc):\d+)", r"\1", line.strip())
    m = re.search(r"Assertion `.*&& \"(.*)\"' failed", line)
    if m:
        line = line[: line.index("Assertion")] + f"assertion failed: {m.group(1).strip()}"
    return line.removeprefix("python: ").strip()


def close_worker() -> None:
    """End this process's compile workers, if any; the next compile starts new ones."""
    with _worker_lock:
        for worker in _workers:
            if worker.pid_of_owner == os.getpid():
                worker.close()
        _workers.clear()


def _hold_llvm_across_fork() -> None:
    """Fork only while no thread is inside LLVM: llvmlite serializes its calls with one lock, which a
    thread parsing or linking a module at the moment of a fork would leave held in the child, and
    the child's first compile would wait for it forever. The forking thread takes it first (waiting
    for the call in progress to end) and both processes release it after the fork."""
    lock: Any = getattr(getattr(llvm.ffi, "lib", None), "_lock", None)  # llvmlite's lock (not public)
    if lock is None or not hasattr(lock, "__enter__") or not hasattr(os, "register_at_fork"):
        return

    def release() -> None:
        lock.__exit__(None, None, None)

    os.register_at_fork(before=lock.__enter__, after_in_parent=release, after_in_child=release)


_hold_llvm_across_fork()

_workers: list[CompileWorker] = []  # this process's workers; the first also builds modules that are not cut
_worker_lock = ForkSafeLock()
atexit.register(close_worker)


def _live_workers(count: int) -> list[CompileWorker]:
    """The first ``count`` workers, started where missing (call with ``_worker_lock`` held). A dead
    worker is dropped; a forked child leaves its parent's workers alone and starts its own."""
    for worker in _workers:
        if worker.pid_of_owner == os.getpid() and not worker.alive:
            worker.close()
    _workers[:] = [w for w in _workers if w.alive and w.pid_of_owner == os.getpid()]
    while len(_workers) < count:
        _workers.append(CompileWorker())
    return _workers[:count]


def _isolated_object(ir_text: str, vectorize: bool, codegen: Codegen | None = None) -> bytes:
    """Compile in the process's first worker (started on first use; a forked child starts its own)."""
    with _worker_lock:
        worker = _live_workers(1)[0]
        try:
            return worker.compile(ir_text, vectorize, codegen)
        except WorkerDied:
            _workers.remove(worker)
            raise


_DEFINE = DEFINE


#: Modules shorter than this (IR characters) compile in one piece: a worker's start costs more.
SPLIT_MIN_CHARS = 150_000
#: IR characters per part at least, so that each part is worth a worker.
SPLIT_PART_CHARS = 60_000


def _part_count(chars: int) -> int:
    """How many parts a module of ``chars`` IR characters is compiled in (1: whole)."""
    if chars < SPLIT_MIN_CHARS:
        return 1
    return max(1, min(available_cpus(), 8, chars // SPLIT_PART_CHARS))


def _split_objects(ir_text: str) -> list[bytes] | None:
    """Objects for the parts of ``ir_text``, compiled at once in one worker each (as many as the CPUs
    this process may use); None when the module is not worth cutting or a worker crashed (the
    caller then builds it whole, which finds and reports the crashing kernel)."""
    ir_text = merge_identical_functions(ir_text)  # before sizing the parts: repeated kernels compile once
    parts = _part_count(len(ir_text))
    if parts < 2 or compile_in_process_setting():
        return None
    texts = split_module(isolate_kernels(ir_text), parts)
    if len(texts) < 2:
        return None
    with _worker_lock:
        workers = _live_workers(len(texts))
        results: list[bytes | BaseException | None] = [None] * len(texts)

        def run(i: int) -> None:
            try:
                results[i] = workers[i].compile(texts[i], True)
            except BaseException as exc:  # handed to the calling thread below
                results[i] = exc

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(texts))]
        for t in threads:
            t.start()
        try:
            for t in threads:
                t.join()
        except BaseException:
            # Interrupted while the workers compile: they are ended before the lock is released,
            # or the next compile would share them with threads still reading their answers.
            for worker in workers:
                worker.abandon()
            for t in threads:
                t.join()
            raise
        if any(isinstance(r, WorkerDied) for r in results):
            return None  # _live_workers replaces the dead ones
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return [r for r in results if isinstance(r, bytes)]


_MULTI_MAGIC = b"OPGRDMUL"
_COUNT = struct.Struct("<I")


def pack_objects(objects: list[bytes]) -> bytes:
    """One cache payload for several objects (a single object is stored as itself)."""
    if len(objects) == 1:
        return objects[0]
    lengths = b"".join(llvm_worker.PAYLOAD_LENGTH.pack(len(o)) for o in objects)
    return _MULTI_MAGIC + _COUNT.pack(len(objects)) + lengths + b"".join(objects)


def unpack_objects(payload: bytes) -> list[bytes]:
    """The objects :func:`pack_objects` stored (the cache has already checked the payload's sha256)."""
    if not payload.startswith(_MULTI_MAGIC):
        return [payload]
    (count,) = _COUNT.unpack_from(payload, len(_MULTI_MAGIC))
    pos = len(_MULTI_MAGIC) + _COUNT.size
    size = llvm_worker.PAYLOAD_LENGTH
    lengths = [size.unpack_from(payload, pos + i * size.size)[0] for i in range(count)]
    pos += count * size.size
    objects = []
    for n in lengths:
        objects.append(payload[pos : pos + n])
        pos += n
    return objects


def _defined_functions(ir_text: str) -> list[str]:
    return [m.group("name") for line in ir_text.splitlines() if (m := _DEFINE.match(line))]


def _keep_only(ir_text: str, keep: set[str]) -> str:
    """The module with only ``keep`` defined (and external, so O3 does not drop them); the other
    functions become declarations, so their loops never reach the optimizer."""
    out: list[str] = []
    skipping = False
    for line in ir_text.splitlines():
        if skipping:
            skipping = line != "}"
            continue
        m = _DEFINE.match(line)
        if m is None:
            out.append(line)
        elif m.group("name") in keep:
            out.append(line.replace("define internal ", "define ", 1))
        else:
            out.append(f"declare {m.group('ret')} @{m.group('name')}({m.group('params')}){m.group('attrs')}")
            skipping = True
    return "\n".join(out) + "\n"


def find_crashing_kernels(ir_text: str, vectorize: bool = True, codegen: Codegen | None = None) -> list[str]:
    """Bisect the module's functions down to the one(s) whose optimization kills the worker."""
    candidates = _defined_functions(ir_text)

    def crashes(names: list[str]) -> bool:
        try:
            _isolated_object(_keep_only(ir_text, set(names)), vectorize, codegen)
        except WorkerDied:
            return True
        except CompileError:
            return False
        return False

    while len(candidates) > 1:
        half = len(candidates) // 2
        if crashes(candidates[:half]):
            candidates = candidates[:half]
        elif crashes(candidates[half:]):
            candidates = candidates[half:]
        else:
            break  # the crash needs functions from both halves together
    return candidates


def _describe_kernels(names: list[str], labels: Mapping[str, str]) -> str:
    described = []
    for name in names:
        owner = max((k for k in labels if name == k or name.startswith(k + ".")), key=len, default=None)
        described.append(f"{name} ({labels[owner]})" if owner and labels[owner] else name)
    return ", ".join(described) or "unknown"


def rejected_kernels(ir_text: str) -> list[str]:
    """The functions of a module LLVM rejects whose own IR fails to parse or verify, each alone
    (in this process: the parser and the verifier report bad IR, they do not crash on it)."""
    ensure_native_initialized()
    found = []
    for name in _defined_functions(ir_text):
        try:
            llvm.parse_assembly(_keep_only(ir_text, {name})).verify()
        except RuntimeError:
            found.append(name)
    return found


def _rejection_message(ir_text: str, said: str, what: str, labels: Mapping[str, str]) -> str:
    """What to say when LLVM rejects a module: the kernel and the ops it comes from, and whose code
    is at fault: an operator's lowering declared in a user's module, else opgrad's."""
    from opgrad.registry import get, names  # here: the registry's lowerings import the compiler

    kernels = rejected_kernels(ir_text)
    ops = {op for name in kernels for key, label in labels.items() if name == key or name.startswith(key + ".")
           for op in label.split("+") if op}
    known = set(names())
    users = sorted({f"@{op}.lowering in module {get(op).module}" for op in ops if op in known and get(op).user_defined})
    detail = said.partition("): ")[2] or said
    where = f"kernel {_describe_kernels(kernels, labels)} of {what or 'a module'}"
    if users:
        return (f"opgrad.compile: LLVM rejected the IR of {where}, which {', '.join(users)} emitted: {detail} "
                "(check the arguments that lowering passes to the kernel builder)")
    return f"opgrad.compile: LLVM rejected the generated IR of {where} (an opgrad bug; please report it): {detail}"


def build_object(ir_text: str, what: str = "", kernel_labels: Mapping[str, str] | None = None,
                 codegen: Codegen | None = None) -> bytes:
    """Optimize and emit ``ir_text`` (for the host's JIT unless ``codegen`` says otherwise), in the
    worker unless in-process is requested.

    ``what`` names the function being compiled and ``kernel_labels`` maps kernel names to the ops
    they come from; both only go into messages.
    """
    codegen = codegen or host_jit()
    host = codegen.target
    ir_text = merge_identical_functions(ir_text)
    ir_text = isolate_kernels(ir_text)  # the same code as the parts of a split build (see split.py)
    if compile_in_process_setting():
        return llvm_worker.compile_object(pipeline_pieces(ir_text), host.triple, host.cpu, host.features,
                                          **_object_options(codegen))
    try:
        return _isolated_object(ir_text, True, codegen)
    except CompileError as rejected:
        raise CompileError(_rejection_message(ir_text, str(rejected), what, kernel_labels or {})) from None
    except WorkerDied as crash:
        kernels = _describe_kernels(find_crashing_kernels(ir_text, True, codegen), kernel_labels or {})
        cpu_role = "host CPU" if codegen.target == host_target() else f"target CPU ({codegen.target.name})"
        where = (f"kernel {kernels} of {what or 'a module'}; {cpu_role} {host.cpu} ({host.triple}, "
                 f"{'AVX-512' if host.has_avx512 else 'no AVX-512'}), llvmlite {llvmlite.__version__}")
        said = crash.detail or f"exit status {crash.returncode}"
        try:
            obj = _isolated_object(ir_text, False, codegen)
        except WorkerDied as again:
            raise CompileError(
                f"opgrad.compile: LLVM crashed while optimizing {where}: {said}; rebuilding without the loop "
                f"vectorizer crashed too ({again.detail or again.returncode}). Your process is unharmed; "
                "please report this with the function that triggers it."
            ) from None
        warnings.warn(CompileWarning(
            f"opgrad.compile: LLVM crashed while optimizing {where}: {said}; the module was rebuilt without "
            "the loop vectorizer and runs correctly, possibly slower."
        ), stacklevel=3)
        return obj


def _object_options(codegen: Codegen) -> dict[str, Any]:
    return {} if codegen.jit else {"reloc": codegen.reloc, "codemodel": codegen.codemodel, "jit": False}


def object_code(ir_text: str, codegen: Codegen, what: str = "", kernel_labels: Mapping[str, str] | None = None,
                use_cache: bool = True) -> tuple[bytes, CompileTimes]:
    """The object file for ``ir_text`` built as ``codegen`` says, through the same worker and cache
    as the JIT (under a key that also names the target and the relocation model)."""
    times = CompileTimes()
    key = cache_key(ir_text, codegen)
    store = ObjectCache() if use_cache else None
    t0 = time.perf_counter()
    obj = store.load(key) if store is not None else None
    if obj is None:
        obj = build_object(ir_text, what, kernel_labels, codegen)
        times.optimize = time.perf_counter() - t0
        if store is not None:
            store.store(key, obj)
    else:
        times.cache_hit = True
    return obj, times


# ----- Native modules -----


@dataclass
class CompileTimes:
    """Wall-clock seconds spent in each stage; a cache hit has optimize = 0.

    ``optimize`` covers optimization and code generation (they run together in the worker);
    ``load`` is linking the object into this process.
    """

    parse: float = 0.0
    optimize: float = 0.0
    codegen: float = 0.0
    load: float = 0.0
    cache_hit: bool = False
    parts: int = 1  # objects the module was compiled as, in parallel workers (:mod:`.split`)

    @property
    def total(self) -> float:
        return self.parse + self.optimize + self.codegen + self.load


class ObjectMissing(LookupError):
    """No sound object-cache entry under the key a stored plan names."""


@dataclass
class NativeModule:
    """LLVM IR text compiled for the host; exposes function addresses for ctypes.

    ``use_cache=False`` bypasses the disk cache (used by tests and when the IR is throwaway).
    ``what`` and ``kernel_labels`` only make compile errors name the function and its ops.
    ``before_load`` runs after the object is built and before it is linked: it can build the
    module that defines the symbols this one calls, in workers this build has already started.

    With an empty ``ir_text``, the object is the cache's entry under ``key`` (a stored plan
    names it) and ``declared`` lists the functions its IR declared; :class:`ObjectMissing` is
    raised when there is no sound entry, and the caller builds the IR after all.
    """

    ir_text: str
    use_cache: bool = True
    cache: ObjectCache | None = None
    times: CompileTimes = field(default_factory=CompileTimes)
    key: str = ""
    what: str = ""
    kernel_labels: Mapping[str, str] | None = None
    before_load: Callable[[], object] | None = None
    declared: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        _ensure_initialized()
        if self.ir_text:
            self.key = cache_key(self.ir_text)
            self.declared = declared_functions(self.ir_text)
        elif not (self.key and self.use_cache):
            raise ValueError("NativeModule: give the IR text, or the cache key of its object")
        store = (self.cache or ObjectCache()) if self.use_cache else None
        t0 = time.perf_counter()
        payload = store.load(self.key) if store is not None else None
        if payload is None and not self.ir_text:
            raise ObjectMissing(self.key)
        if payload is None:
            objects = _split_objects(self.ir_text) or [build_object(self.ir_text, self.what, self.kernel_labels)]
            self.times.optimize = time.perf_counter() - t0
            if store is not None:
                store.store(self.key, pack_objects(objects))
        else:
            objects = unpack_objects(payload)
            self.times.cache_hit = True
        if self.before_load is not None:
            self.before_load()
        _resolve_provided_symbols(self.declared)
        t1 = time.perf_counter()
        self._engine = llvm.create_mcjit_compiler(llvm.parse_assembly(""), _target_machine())
        self.times.parts = len(objects)
        self._objects = [llvm.ObjectFileRef.from_data(obj) for obj in objects]
        for obj_ref in self._objects:
            self._engine.add_object_file(obj_ref)
        self._engine.finalize_object()
        self.times.load = time.perf_counter() - t1

    def address(self, name: str) -> int:
        """Address of a function defined in the IR; raises KeyError if it is not there."""
        addr = self._engine.get_function_address(name)
        if not addr:
            raise KeyError(f"function {name!r} not found in native module")
        return int(addr)

    def cfunc(self, name: str, restype: Any, *argtypes: Any) -> Any:
        """A ctypes function for ``name``; ctypes releases the GIL during the call."""
        proto = ctypes.CFUNCTYPE(restype, *argtypes)
        fn = proto(self.address(name))
        fn._opgrad_module = self  # type: ignore[attr-defined]  # keeps the code alive with the function
        return fn
