"""A spin-then-sleep thread pool written in JIT code, shared by every compiled kernel.

Why in JIT code: a Python ThreadPoolExecutor round trip costs ~30 µs, more than many kernels. Here a
kernel calls ``opgrad_parallel_for(task, ctx)`` directly; the workers spin on a sequence word (with
``pause``) for a short while and then sleep in ``futex`` with a timeout, so a dispatch to a hot
worker costs well under a microsecond and an idle pool costs no CPU.

The worker OS threads are Python ``threading.Thread`` objects whose target is the JIT'd worker loop
called through ctypes (which releases the GIL), so no ``pthread_create`` is needed in JIT code. An
``atexit`` hook stops and joins them; they are daemons so a missed stop can never block exit.

Platforms: the workers sleep in Linux's ``futex`` (syscall numbers for x86-64 and AArch64).
Elsewhere the pool starts no workers and every kernel runs its shares on the calling thread:
correct, single-threaded (:func:`futex_supported` says which applies).

Contract for tasks: ``void task(ptr ctx, i32 tid, i32 nthreads)`` must do the share ``tid`` of
``nthreads`` and must produce results that do not depend on ``nthreads`` (split over outputs; a
reduction only into parts fixed by the shapes, added in a fixed order). If the pool is busy (another
Python thread, or a nested call) the dispatcher runs all shares inline, one after the other; results
are the same by that contract.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import os
import platform
import sys
import threading
import warnings
from dataclasses import dataclass

from opgrad.env import NUM_THREADS_VAR, available_cpus, num_threads_setting
from opgrad.errors import user_stacklevel
from opgrad.locks import ForkSafeLock

from .irtext import FunctionEmitter, ModuleEmitter
from .jit import NativeModule, host_target, provide_symbol, register_symbol

#: Symbol that kernels declare as ``declare void @opgrad_parallel_for(ptr, ptr)``.
PARALLEL_FOR = "opgrad_parallel_for"
PARALLEL_FOR_DECL = f"declare void @{PARALLEL_FOR}(ptr, ptr)"

_SPINS = 20000  # ~50-100 µs of spinning before sleeping: keeps back-to-back kernels hot
_SLEEP_NS = 2_000_000  # futex timeout: a lost wake-up costs at most this, never a deadlock
_FUTEX_WAIT_PRIVATE = 128
_FUTEX_WAKE_PRIVATE = 129
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}


def _runtime_ir() -> str:
    # The pool runs in this process, so it is built for the host even while code for another
    # target is being generated (exported libraries get a C runtime instead, opgrad/deploy).
    host = host_target()
    m = ModuleEmitter("opgrad_runtime", function_attrs=host.function_attrs)
    for name, ty in (("seq", "i32"), ("done", "i32"), ("busy", "i32"), ("stop", "i32"), ("sleepers", "i32")):
        m.add_global(f"@pool.{name} = internal global {ty} 0, align 64")
    m.add_global("@pool.nthreads = internal global i32 1, align 64")
    m.add_global("@pool.claim = internal global i64 0, align 64")
    m.add_global("@pool.fn = internal global ptr null, align 64")
    m.add_global("@pool.ctx = internal global ptr null, align 64")
    m.add_global(f"@pool.timeout = internal constant [2 x i64] [i64 0, i64 {_SLEEP_NS}], align 8")
    # Simulated shares (ThreadPool.simulate): on, nesting depth, and the totals since the last read.
    m.add_global("@pool.simulate = internal global i32 0, align 64")
    m.add_global("@pool.sim_depth = internal global i32 0, align 4")
    for name in ("sim_calls", "sim_busiest", "sim_work"):
        m.add_global(f"@pool.{name} = internal global i64 0, align 8")
    m.declare("syscall", "declare i64 @syscall(i64, ...)")
    m.declare("clock_gettime", "declare i32 @clock_gettime(i32, ptr)")
    m.declare("sched_yield", "declare i32 @sched_yield()")
    sys_futex = _SYS_FUTEX.get(platform.machine(), -1)  # never called where futex_supported() is False
    pause = ""
    if host.is_x86:  # `pause` keeps a spinning core from starving its SMT sibling
        pause = m.declare("llvm.x86.sse2.pause", "declare void @llvm.x86.sse2.pause()")

    def relax(f: FunctionEmitter) -> None:
        if pause:
            f.call("void", pause, [])

    # void opgrad_pool_set_size(i32 n)
    f = FunctionEmitter(m, "opgrad_pool_set_size", [("i32", "n")])
    f.emit("store atomic i32 %n, ptr @pool.nthreads seq_cst, align 4")
    f.ret_void()
    f.finish()

    # void run_shares(i32 job): claim shares of job `job` until none is left. A claim is a CAS on
    # one word holding (job << 32 | next share), so a late worker can never run a share of a job
    # that has been replaced; fn/ctx are read after the claim, when they are known to be current.
    f = FunctionEmitter(m, "opgrad_run_shares", [("i32", "job")], linkage="internal")
    job64 = f.val("zext i32 %job to i64")
    nt = f.val("load atomic i32, ptr @pool.nthreads acquire, align 4")
    nt64 = f.val(f"zext i32 {nt} to i64")
    head, claim, out = f.label("head"), f.label("claim"), f.label("out")
    f.br(head)
    f.block(head)
    w = f.val("load atomic i64, ptr @pool.claim acquire, align 8")
    same = f.icmp("eq", f.val(f"lshr i64 {w}, 32"), job64)
    share = f.val(f"and i64 {w}, 4294967295")
    left = f.icmp("ult", share, nt64)
    f.cbr(f.val(f"and i1 {same}, {left}"), claim, out)
    f.block(claim)
    pair = f.val(f"cmpxchg ptr @pool.claim, i64 {w}, i64 {f.add(w, 1)} acq_rel acquire")
    got = f.val(f"extractvalue {{ i64, i1 }} {pair}, 1")
    run = f.label("run")
    f.cbr(got, run, head)
    f.block(run)
    fn = f.val("load ptr, ptr @pool.fn, align 8")
    ctx = f.val("load ptr, ptr @pool.ctx, align 8")
    f.emit(f"call void {fn}(ptr {ctx}, i32 {f.val(f'trunc i64 {share} to i32')}, i32 {nt})")
    f.emit("atomicrmw add ptr @pool.done, i32 1 release")
    f.br(head)
    f.block(out)
    f.ret_void()
    f.finish()

    # void opgrad_pool_worker(i32 tid): runs jobs until stop is set
    f = FunctionEmitter(m, "opgrad_pool_worker", [("i32", "tid")])
    seen = f.var("i32", f.val("load atomic i32, ptr @pool.seq acquire, align 4"), "seen")
    spins = f.var("i64", "0", "spins")
    labels = ("head", "run", "idle", "sleep", "woke", "out")
    head, run, idle, sleep, wait_end, out = (f.label(x) for x in labels)
    f.br(head)
    f.block(head)
    stop = f.val("load atomic i32, ptr @pool.stop acquire, align 4")
    chk = f.label("chk")
    f.cbr(f.icmp("ne", stop, "0", "i32"), out, chk)
    f.block(chk)
    s = f.val("load atomic i32, ptr @pool.seq acquire, align 4")
    old = f.load("i32", seen)
    f.cbr(f.icmp("ne", s, old, "i32"), run, idle)
    f.block(run)
    f.store("i32", s, seen)
    f.store("i64", "0", spins)
    f.call("void", "@opgrad_run_shares", [("i32", s)])
    f.br(head)
    f.block(idle)
    n = f.add(f.load("i64", spins), 1)
    f.store("i64", n, spins)
    relax(f)
    f.cbr(f.icmp("slt", n, _SPINS), head, sleep)
    f.block(sleep)
    f.emit("atomicrmw add ptr @pool.sleepers, i32 1 seq_cst")
    s2 = f.val("load atomic i32, ptr @pool.seq seq_cst, align 4")
    st2 = f.val("load atomic i32, ptr @pool.stop seq_cst, align 4")
    same = f.val(f"and i1 {f.icmp('eq', s2, old, 'i32')}, {f.icmp('eq', st2, '0', 'i32')}")
    do_wait = f.label("futex")
    f.cbr(same, do_wait, wait_end)
    f.block(do_wait)
    old64 = f.val(f"zext i32 {old} to i64")
    f.emit(
        f"call i64 (i64, ...) @syscall(i64 {sys_futex}, ptr @pool.seq, i32 {_FUTEX_WAIT_PRIVATE}, "
        f"i64 {old64}, ptr @pool.timeout)"
    )
    f.br(wait_end)
    f.block(wait_end)
    # The spin count is not reset: a worker whose sleep timed out with no new job goes straight
    # back to sleep. Spinning after every 2 ms timeout would cost an idle pool a fifth of a core.
    f.emit("atomicrmw sub ptr @pool.sleepers, i32 1 seq_cst")
    f.br(head)
    f.block(out)
    f.ret_void()
    f.finish()

    _emit_simulation(m)

    # void opgrad_parallel_for(ptr fn, ptr ctx): the caller claims shares too, so a descheduled
    # worker delays a job only by the share it already started, never by one it has not.
    f = FunctionEmitter(m, PARALLEL_FOR, [("ptr", "fn"), ("ptr", "ctx")])
    nt = f.val("load atomic i32, ptr @pool.nthreads acquire, align 4")
    single, dispatch, try_lock, serial, pooled = (f.label(x) for x in ("single", "dispatch", "trylock", "serial",
                                                                        "pooled"))
    f.cbr(f.icmp("sle", nt, "1", "i32"), single, dispatch)
    f.block(single)
    f.emit("call void %fn(ptr %ctx, i32 0, i32 1)")
    f.ret_void()
    f.block(dispatch)
    simulated = f.label("simulated")
    simulating = f.val("load atomic i32, ptr @pool.simulate monotonic, align 4")
    f.cbr(f.icmp("ne", simulating, "0", "i32"), simulated, try_lock)
    f.block(simulated)
    f.call("void", "@opgrad_simulated_shares", [("ptr", "%fn"), ("ptr", "%ctx"), ("i32", nt)])
    f.ret_void()
    f.block(try_lock)
    pair = f.val("cmpxchg ptr @pool.busy, i32 0, i32 1 acquire monotonic")
    f.cbr(f.val(f"extractvalue {{ i32, i1 }} {pair}, 1"), pooled, serial)
    f.block(serial)  # pool busy (another thread or a nested call): run every share here
    f.call("void", "@opgrad_run_every_share", [("ptr", "%fn"), ("ptr", "%ctx"), ("i32", nt)])
    f.ret_void()
    f.block(pooled)
    f.emit("store ptr %fn, ptr @pool.fn, align 8")
    f.emit("store ptr %ctx, ptr @pool.ctx, align 8")
    f.emit("store atomic i32 0, ptr @pool.done seq_cst, align 4")
    job = f.add(f.val("load atomic i32, ptr @pool.seq seq_cst, align 4"), 1, "i32")
    job64 = f.val(f"zext i32 {job} to i64")
    f.emit(f"store atomic i64 {f.val(f'shl i64 {job64}, 32')}, ptr @pool.claim seq_cst, align 8")
    f.emit(f"store atomic i32 {job}, ptr @pool.seq seq_cst, align 4")
    nsl = f.val("load atomic i32, ptr @pool.sleepers seq_cst, align 4")
    with f.if_then(f.icmp("ne", nsl, "0", "i32"), "wake"):
        f.emit(
            f"call i64 (i64, ...) @syscall(i64 {sys_futex}, ptr @pool.seq, i32 {_FUTEX_WAKE_PRIVATE}, "
            "i32 2147483647)"
        )
    f.call("void", "@opgrad_run_shares", [("i32", job)])
    spins = f.var("i64", "0", "wspins")
    wait, waited, more = f.label("wait"), f.label("waited"), f.label("more")
    f.br(wait)
    f.block(wait)
    d = f.val("load atomic i32, ptr @pool.done acquire, align 4")
    f.cbr(f.icmp("sge", d, nt, "i32"), waited, more)
    f.block(more)
    k = f.add(f.load("i64", spins), 1)
    f.store("i64", k, spins)
    relax(f)
    with f.if_then(f.icmp("sgt", k, _SPINS), "yield"):
        f.call("i32", "@sched_yield", [])
    f.br(wait)
    f.block(waited)
    f.emit("store atomic i32 0, ptr @pool.busy release, align 4")
    f.ret_void()
    f.finish()

    # void opgrad_pool_stop(): wake everyone and make them return
    f = FunctionEmitter(m, "opgrad_pool_stop", [])
    f.emit("store atomic i32 1, ptr @pool.stop seq_cst, align 4")
    f.emit("atomicrmw add ptr @pool.seq, i32 1 seq_cst")
    f.emit(
        f"call i64 (i64, ...) @syscall(i64 {sys_futex}, ptr @pool.seq, i32 {_FUTEX_WAKE_PRIVATE}, "
        "i32 2147483647)"
    )
    f.ret_void()
    f.finish()
    return m.text()


def _emit_simulation(m: ModuleEmitter) -> None:
    """``opgrad_simulated_shares(fn, ctx, nt)``: every share of a job run here, one after the other,
    each timed by the monotonic clock; the call count, the busiest share's time and all shares' time
    are added to the totals that ``opgrad_pool_share_totals(ptr out)`` returns (and clears), and
    ``opgrad_pool_simulate(i32 on)`` switches ``parallel_for`` to this. A job started inside a
    simulated share runs inline untimed: its time is part of that share's."""
    # void run_every_share(fn, ctx, nt): each share in turn, on this thread
    f = FunctionEmitter(m, "opgrad_run_every_share", [("ptr", "fn"), ("ptr", "ctx"), ("i32", "nt")],
                        linkage="internal")
    with f.loop(0, f.val("sext i32 %nt to i64"), hint="t") as t:
        f.emit(f"call void %fn(ptr %ctx, i32 {f.val(f'trunc i64 {t} to i32')}, i32 %nt)")
    f.ret_void()
    f.finish()

    f = FunctionEmitter(m, "opgrad_simulated_shares", [("ptr", "fn"), ("ptr", "ctx"), ("i32", "nt")],
                        linkage="internal")
    nested, timed = f.label("nested"), f.label("timed")
    f.cbr(f.icmp("ne", f.load("i32", "@pool.sim_depth"), "0", "i32"), nested, timed)
    f.block(nested)
    f.call("void", "@opgrad_run_every_share", [("ptr", "%fn"), ("ptr", "%ctx"), ("i32", "%nt")])
    f.ret_void()
    f.block(timed)
    f.store("i32", "1", "@pool.sim_depth")
    clock = f.alloca("[2 x i64]", "ts", align=8)

    def now() -> str:
        f.call("i32", "@clock_gettime", [("i32", "1"), ("ptr", clock)])  # CLOCK_MONOTONIC
        sec, nsec = f.load("i64", clock), f.load("i64", f.gep("i64", clock, 1))
        return f.add(f.mul(sec, 1_000_000_000), nsec)

    busiest, work = f.var("i64", "0", "busiest"), f.var("i64", "0", "work")
    with f.loop(0, f.val("sext i32 %nt to i64"), hint="t") as t:
        start = now()
        f.emit(f"call void %fn(ptr %ctx, i32 {f.val(f'trunc i64 {t} to i32')}, i32 %nt)")
        took = f.sub(now(), start)
        f.store("i64", f.add(f.load("i64", work), took), work)
        f.store("i64", f.smax(f.load("i64", busiest), took), busiest)
    for name, value in (("sim_calls", "1"), ("sim_busiest", f.load("i64", busiest)),
                        ("sim_work", f.load("i64", work))):
        f.store("i64", f.add(f.load("i64", f"@pool.{name}"), value), f"@pool.{name}")
    f.store("i32", "0", "@pool.sim_depth")
    f.ret_void()
    f.finish()

    f = FunctionEmitter(m, "opgrad_pool_simulate", [("i32", "on")])
    f.emit("store atomic i32 %on, ptr @pool.simulate seq_cst, align 4")
    f.ret_void()
    f.finish()

    f = FunctionEmitter(m, "opgrad_pool_share_totals", [("ptr", "out")])
    for i, name in enumerate(("sim_calls", "sim_busiest", "sim_work")):
        f.store("i64", f.load("i64", f"@pool.{name}"), f.gep("i64", "%out", i))
        f.store("i64", "0", f"@pool.{name}")
    f.ret_void()
    f.finish()


def futex_supported() -> bool:
    """Whether pool workers can sleep in ``futex``: Linux on a machine whose syscall number is known."""
    return sys.platform.startswith("linux") and platform.machine() in _SYS_FUTEX


def default_num_threads() -> int:
    """``$OPGRAD_NUM_THREADS`` or the number of CPUs this process may run on (its affinity mask,
    capped by a cgroup CPU quota: a container limited to 2 CPUs on a 64-core host gets 2 threads).

    A value that is not a positive integer is a ``ConfigError`` naming the variable.
    """
    configured = num_threads_setting()
    if configured is not None:
        return configured
    return available_cpus()


@dataclass(frozen=True)
class ShareTotals:
    """Simulated jobs (:meth:`ThreadPool.simulate`): how many, the sum over them of their busiest
    share's seconds, and of all their shares' seconds. A region that took ``wall`` seconds with
    these totals would take ``wall - work_s + busiest_s`` on ``nthreads`` cores that each ran
    their share as fast as one core alone does (no dispatch cost, no contention for memory)."""

    calls: int
    busiest_s: float
    work_s: float

    def parallel_seconds(self, wall: float) -> float:
        """The time of a region that took ``wall`` seconds simulated, with its jobs' shares in parallel."""
        return wall - self.work_s + self.busiest_s


class ThreadPool:
    """The process-wide pool; construct through :func:`pool`."""

    def __init__(self, nthreads: int) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        register_symbol("syscall", ctypes.cast(libc.syscall, ctypes.c_void_p).value or 0)
        register_symbol("sched_yield", ctypes.cast(libc.sched_yield, ctypes.c_void_p).value or 0)
        register_symbol("clock_gettime", ctypes.cast(libc.clock_gettime, ctypes.c_void_p).value or 0)
        self.module = NativeModule(_runtime_ir())
        register_symbol(PARALLEL_FOR, self.module.address(PARALLEL_FOR))
        self._worker = self.module.cfunc("opgrad_pool_worker", None, ctypes.c_int32)
        self._stop = self.module.cfunc("opgrad_pool_stop", None)
        self._set_size = self.module.cfunc("opgrad_pool_set_size", None, ctypes.c_int32)
        self._simulate = self.module.cfunc("opgrad_pool_simulate", None, ctypes.c_int32)
        self._share_totals = self.module.cfunc("opgrad_pool_share_totals", None, ctypes.c_void_p)
        self.parallel_for_address = self.module.address(PARALLEL_FOR)
        if not futex_supported():
            nthreads = 1  # no workers to sleep or wake: parallel_for runs every share inline
        self.nthreads = nthreads
        self._threads: list[threading.Thread] = []
        self._set_size(nthreads)
        for tid in range(1, nthreads):
            t = threading.Thread(target=self._worker, args=(tid,), name=f"opgrad-worker-{tid}", daemon=True)
            t.start()
            self._threads.append(t)
        atexit.register(self.shutdown)

    def simulate(self, on: bool) -> None:
        """Run every job's ``nthreads`` shares on the calling thread, one after the other, each timed
        (:meth:`share_totals`): what the pool's decomposition would give on ``nthreads`` cores,
        measured with only one. The results are the same (tasks do not depend on who runs a share).
        For one calling thread at a time; the workers stay idle meanwhile."""
        self._simulate(1 if on else 0)

    def share_totals(self) -> ShareTotals:
        """The simulated jobs since the last read (then cleared): see :class:`ShareTotals`."""
        out = (ctypes.c_int64 * 3)()
        self._share_totals(ctypes.addressof(out))
        return ShareTotals(out[0], out[1] / 1e9, out[2] / 1e9)

    def shutdown(self) -> None:
        """Stop the workers; afterwards every parallel_for runs on the calling thread."""
        self._set_size(1)
        if self._threads:  # waking sleepers is a futex call: only where workers were started
            self._stop()
        for t in self._threads:
            t.join(timeout=1.0)
        self._threads.clear()


_pool: ThreadPool | None = None
_pool_lock = ForkSafeLock()
_pool_setting = ""  # the OPGRAD_NUM_THREADS text the pool was sized by
_settings_warned: set[str] = set()


def pool() -> ThreadPool:
    """The process-wide pool, created on first use: at the latest by the first module that declares
    :data:`PARALLEL_FOR`, before it loads. ``OPGRAD_NUM_THREADS`` set to another value later is
    warned about (once per value), not silently ignored: the pool keeps its size."""
    global _pool, _pool_setting
    with _pool_lock:
        setting = os.environ.get(NUM_THREADS_VAR, "").strip()
        if _pool is None:
            _pool = ThreadPool(default_num_threads())
            _pool_setting = setting
        elif setting != _pool_setting and setting not in _settings_warned and _asks_other_size(setting, _pool.nthreads):
            _settings_warned.add(setting)
            warnings.warn(f"{NUM_THREADS_VAR}={setting!r} takes no effect in this process: it is read when the first "
                          f"kernel is compiled, and the worker pool keeps its {_pool.nthreads} thread(s); set it "
                          "before that (or start a new process)", stacklevel=user_stacklevel())
        return _pool


def _asks_other_size(setting: str, nthreads: int) -> bool:
    """Whether ``OPGRAD_NUM_THREADS=setting`` asks for another pool size than ``nthreads`` (an
    unset or invalid value asks for none: it is read, and refused, where a pool starts)."""
    return setting.isascii() and setting.isdigit() and int(setting) != nthreads


def pool_started() -> bool:
    """Whether the process-wide pool exists; its size is then fixed for the process's life."""
    with _pool_lock:
        return _pool is not None


def pool_size() -> int:
    """Threads of the process-wide pool: its size, or the size it takes when first used."""
    with _pool_lock:
        return _pool.nthreads if _pool is not None else default_num_threads()


provide_symbol(PARALLEL_FOR, pool)
