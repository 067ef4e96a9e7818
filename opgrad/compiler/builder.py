"""KernelBuilder: the narrow API through which operators lower themselves into one LLVM module.

Phase 2 turns a whole graph (forward + backward) into ONE function ``void entry(ptr bufs, ptr ws)``
where ``bufs`` is an array of buffer pointers, so a step costs one ctypes call. Each operator's
lowering receives a :class:`KernelBuilder` and calls a handful of primitives on strided views:

* :meth:`KernelBuilder.elementwise` - ``out[idx] = body(in_1[idx], ...)``; broadcasting is a
  0-stride in an input view, so the builder never needs to know an operator's semantics;
* :meth:`KernelBuilder.reduce` - sum/max/min over axes (reassociation allowed: it vectorizes);
* :meth:`KernelBuilder.gemm` and :meth:`KernelBuilder.conv2d` - the heavy primitives.

The builder never sees operator names. Bodies are written against :class:`Scalar`, a tiny
expression emitter over one element type. Outputs must not overlap inputs (pointers are
``noalias``), which the buffer planner guarantees. Large loops are split over the thread pool by
output rows, so results do not depend on the thread count.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .conv import Conv2dGeometry, emit_conv2d_backward_data, emit_conv2d_backward_weight, emit_conv2d_forward
from .gemm import GemmSpec, emit_gemm
from .irtext import BYTES, FAST, LLVM_TYPE, FunctionEmitter, ModuleEmitter, float_const
from .jit import NativeModule, register_symbol
from .threads import PARALLEL_FOR, PARALLEL_FOR_DECL, pool

#: Loops with fewer output elements than this run on the calling thread.
PARALLEL_MIN_ELEMENTS = 1 << 16


@dataclass(frozen=True)
class View:
    """A strided view into buffer ``buffer`` (index into the entry's pointer array), in elements."""

    buffer: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int = 0
    dtype: str = "float32"

    @staticmethod
    def contiguous(buffer: int, shape: Sequence[int], dtype: str = "float32", offset: int = 0) -> View:
        strides, acc = [], 1
        for d in reversed(shape):
            strides.append(acc)
            acc *= d
        return View(buffer, tuple(shape), tuple(reversed(strides)), offset, dtype)

    def broadcast_to(self, shape: Sequence[int]) -> View:
        """Right-aligned numpy broadcasting expressed as 0-strides."""
        shape = tuple(shape)
        pad = len(shape) - len(self.shape)
        dims = (1,) * pad + self.shape
        strides = (0,) * pad + self.strides
        new = tuple(0 if d == 1 and s != 1 else st for d, s, st in zip(dims, shape, strides, strict=True))
        return View(self.buffer, shape, new, self.offset, self.dtype)


class Scalar:
    """Emits scalar float instructions for an elementwise body; values are SSA names or constants."""

    def __init__(self, f: FunctionEmitter, dtype: str) -> None:
        self.f = f
        self.t = LLVM_TYPE[dtype]

    def const(self, value: float) -> str:
        return float_const(value, self.t)

    def _bin(self, op: str, a: str, b: str) -> str:
        return self.f.val(f"{op} {FAST} {self.t} {a}, {b}", op)

    def add(self, a: str, b: str) -> str:
        return self._bin("fadd", a, b)

    def sub(self, a: str, b: str) -> str:
        return self._bin("fsub", a, b)

    def mul(self, a: str, b: str) -> str:
        return self._bin("fmul", a, b)

    def div(self, a: str, b: str) -> str:
        return self._bin("fdiv", a, b)

    def neg(self, a: str) -> str:
        return self.f.val(f"fneg {self.t} {a}", "neg")

    def call(self, intrinsic: str, *args: str) -> str:
        """``llvm.<intrinsic>`` on this type: exp, log, sqrt, fabs, maxnum, minnum, tanh, ..."""
        fn = self.f.module.intrinsic(intrinsic, self.t, [self.t] * len(args), _suffix(self.t))
        return self.f.call(self.t, fn, [(self.t, a) for a in args], hint=intrinsic)

    def max(self, a: str, b: str) -> str:
        return self.call("maxnum", a, b)

    def min(self, a: str, b: str) -> str:
        return self.call("minnum", a, b)

    def cmp(self, pred: str, a: str, b: str) -> str:
        """Ordered float compare (``olt``, ``ogt``, ``oeq``, ...) -> i1."""
        return self.f.val(f"fcmp {pred} {self.t} {a}, {b}", "fc")

    def select(self, cond: str, a: str, b: str) -> str:
        return self.f.select(cond, self.t, a, b)


def _suffix(t: str) -> str:
    return "f32" if t == "float" else "f64"


#: An elementwise body: given the Scalar emitter and the loaded inputs, return the output value.
Body = Callable[[Scalar, list[str]], str]


class KernelBuilder:
    """Accumulates lowered operations, in call order, into one entry ``void name(ptr bufs, ptr ws)``."""

    def __init__(self, name: str = "graph") -> None:
        self.m = ModuleEmitter(name)
        self.m.declare(PARALLEL_FOR, PARALLEL_FOR_DECL)
        self.name = name
        self._steps: list[tuple[str, list[int]]] = []  # (function, buffer indices)
        self.workspace_per_thread = 0
        self._count = 0

    def _fresh(self, kind: str) -> str:
        self._count += 1
        return f"{self.name}.{kind}{self._count}"

    # ----- elementwise -----

    def elementwise(self, out: View, inputs: Sequence[View], body: Body) -> None:
        """``out[i] = body(inputs[0][i], ...)`` over ``out.shape``; inputs are views of that shape."""
        assert all(v.shape == out.shape for v in inputs), "broadcast inputs with View.broadcast_to first"
        views = [out, *inputs]
        shape, strides = _collapse(out.shape, [v.strides for v in views])
        name = self._fresh("ew")
        f = self._loop_function(name, views, shape[0] if shape else 1)
        ptrs = [f.gep(LLVM_TYPE[v.dtype], f"%p{i}", str(v.offset)) for i, v in enumerate(views)]
        s = Scalar(f, inputs[0].dtype if inputs else out.dtype)

        def nest(level: int, offs: list[str]) -> None:
            if level == len(shape):
                vals = [f.load(LLVM_TYPE[v.dtype], f.gep(LLVM_TYPE[v.dtype], p, o))
                        for v, p, o in zip(views[1:], ptrs[1:], offs[1:], strict=True)]
                f.store(LLVM_TYPE[out.dtype], body(s, vals), f.gep(LLVM_TYPE[out.dtype], ptrs[0], offs[0]))
                return
            lo, hi = ("%lo", "%hi") if level == 0 else ("0", str(shape[level]))
            with f.loop(lo, hi, hint=f"e{level}") as i:
                nest(level + 1, [f.add(o, f.mul(i, st[level])) for o, st in zip(offs, strides, strict=True)])

        nest(0, ["0"] * len(views))
        f.ret_void()
        f.finish()
        self._add_parallel(name, views, shape[0] if shape else 1, math.prod(out.shape))

    # ----- reductions -----

    def reduce(self, out: View, inp: View, axes: Sequence[int], op: str = "sum", scale: float = 1.0) -> None:
        """``out = scale * op(inp, axes)``; ``out.shape`` is ``inp.shape`` with ``axes`` set to 1.

        ``op`` is ``sum``, ``max`` or ``min``. The reduced axes run innermost with reassociation
        allowed, so contiguous reductions vectorize; the order is fixed at compile time.
        """
        axes = sorted(a % len(inp.shape) for a in axes)
        keep = [d for d in range(len(inp.shape)) if d not in axes]
        t = LLVM_TYPE[inp.dtype]
        init = {"sum": 0.0, "max": -math.inf, "min": math.inf}[op]
        kshape = [inp.shape[d] for d in keep] or [1]
        kin = [inp.strides[d] for d in keep] or [0]
        kout = [out.strides[d] for d in keep] or [0]
        name = self._fresh("red")
        f = self._loop_function(name, [out, inp], kshape[0])
        pout = f.gep(t, "%p0", str(out.offset))
        pin = f.gep(t, "%p1", str(inp.offset))
        s = Scalar(f, inp.dtype)
        acc = f.alloca(t, "acc")

        def inner(level: int, off: str) -> None:
            if level == len(axes):
                v = f.load(t, f.gep(t, pin, off))
                cur = f.load(t, acc)
                f.store(t, s.add(cur, v) if op == "sum" else getattr(s, op)(cur, v), acc)
                return
            with f.loop(0, inp.shape[axes[level]], hint=f"r{level}") as i:
                inner(level + 1, f.add(off, f.mul(i, inp.strides[axes[level]])))

        def outer(level: int, oin: str, oout: str) -> None:
            if level == len(kshape):
                f.store(t, s.const(init), acc)
                inner(0, oin)
                res = f.load(t, acc)
                if scale != 1.0:
                    res = s.mul(res, s.const(scale))
                f.store(t, res, f.gep(t, pout, oout))
                return
            lo, hi = ("%lo", "%hi") if level == 0 else ("0", str(kshape[level]))
            with f.loop(lo, hi, hint=f"o{level}") as i:
                outer(level + 1, f.add(oin, f.mul(i, kin[level])), f.add(oout, f.mul(i, kout[level])))

        outer(0, "0", "0")
        f.ret_void()
        f.finish()
        self._add_parallel(name, [out, inp], kshape[0], math.prod(kshape))

    # ----- heavy primitives -----

    def gemm(self, spec: GemmSpec, a: int, b: int, c: int) -> None:
        """``C (=|+=) alpha * A @ B`` with the layouts in ``spec``; a, b, c are buffer indices."""
        plan = emit_gemm(self.m, spec, self._fresh("gemm"))
        self._steps.append((plan.names["entry"], [a, b, c]))
        self.workspace_per_thread = max(self.workspace_per_thread, plan.workspace_per_thread)

    def conv2d(self, geom: Conv2dGeometry, pass_: str, buffers: tuple[int, int, int]) -> None:
        """One conv pass: ``forward`` (x, w, y), ``backward_data`` (dy, w, dx), ``backward_weight`` (x, dy, dw)."""
        emit = {"forward": emit_conv2d_forward, "backward_data": emit_conv2d_backward_data,
                "backward_weight": emit_conv2d_backward_weight}[pass_]
        entry = emit(self.m, geom, self._fresh("conv"))
        self._steps.append((entry.entry, list(buffers)))
        self.workspace_per_thread = max(self.workspace_per_thread, entry.workspace_per_thread)

    # ----- assembly -----

    def _loop_function(self, name: str, views: Sequence[View], outer: int) -> FunctionEmitter:
        params = [("ptr noalias", f"p{i}") for i in range(len(views))] + [("i64", "lo"), ("i64", "hi")]
        return FunctionEmitter(self.m, name, params, linkage="internal")

    def _add_parallel(self, name: str, views: Sequence[View], outer: int, elements: int) -> None:
        """Wrap ``name(p..., lo, hi)`` so that the outermost loop is split over threads if large."""
        n = len(views)
        f = FunctionEmitter(self.m, name + ".task", [("ptr", "ctx"), ("i32", "tid"), ("i32", "nt")],
                            linkage="internal")
        ptrs = [f.load("ptr", f.gep("ptr", "%ctx", str(i))) for i in range(n)]
        tid, nt = f.val("sext i32 %tid to i64"), f.val("sext i32 %nt to i64")
        lo = f.val(f"udiv i64 {f.mul(tid, outer)}, {nt}")
        hi = f.val(f"udiv i64 {f.mul(f.add(tid, 1), outer)}, {nt}")
        f.call("void", "@" + name, [("ptr", p) for p in ptrs] + [("i64", lo), ("i64", hi)])
        f.ret_void()
        f.finish()
        parallel = elements >= PARALLEL_MIN_ELEMENTS and outer > 1
        self._steps.append((("par:" if parallel else "seq:") + name, [v.buffer for v in views]))

    def finish(self) -> str:
        """Emit the entry that runs every step in order; returns the module's IR text."""
        f = FunctionEmitter(self.m, self.name, [("ptr", "bufs"), ("ptr", "ws")])
        for fn, bufs in self._steps:
            ptrs = [f.load("ptr", f.gep("ptr", "%bufs", str(b))) for b in bufs]
            if fn.startswith(("par:", "seq:")):
                mode, base = fn.split(":", 1)
                ctx = f.alloca(f"[{len(ptrs)} x ptr]", "ctx", align=8)
                for i, p in enumerate(ptrs):
                    f.store("ptr", p, f.gep("ptr", ctx, str(i)))
                if mode == "par":
                    f.call("void", "@" + PARALLEL_FOR, [("ptr", f"@{base}.task"), ("ptr", ctx)])
                else:
                    f.call("void", f"@{base}.task", [("ptr", ctx), ("i32", "0"), ("i32", "1")])
            else:
                f.call("void", "@" + fn, [("ptr", p) for p in ptrs] + [("ptr", "%ws")])
        f.ret_void()
        f.finish()
        return self.m.text()

    def compile(self) -> CompiledGraph:
        """Finish, compile (disk-cached) and wrap the entry for ctypes."""
        _register_libm()
        nthreads = pool().nthreads
        module = NativeModule(self.finish())
        return CompiledGraph(module, self.name, self.workspace_per_thread * nthreads)


class CompiledGraph:
    """A compiled entry ``void f(ptr bufs, ptr ws)``: call with a sequence of numpy arrays."""

    def __init__(self, module: NativeModule, entry: str, workspace_bytes: int) -> None:
        import numpy as np

        self.module = module
        self._fn = module.cfunc(entry, None, ctypes.c_void_p, ctypes.c_void_p)
        self._ws = np.zeros(workspace_bytes + 128, np.uint8)
        self._ws_addr = self._ws.ctypes.data + (-self._ws.ctypes.data) % 64

    def call_pointers(self, table: ctypes.Array) -> None:  # type: ignore[type-arg]
        """Fast path: ``table`` is a prebuilt ``(c_void_p * n)`` of buffer addresses."""
        self._fn(ctypes.addressof(table), self._ws_addr)

    def __call__(self, *arrays: object) -> None:
        table = (ctypes.c_void_p * len(arrays))(*(a.ctypes.data for a in arrays))  # type: ignore[attr-defined]
        self.call_pointers(table)


def _collapse(shape: tuple[int, ...], strides: list[tuple[int, ...]]) -> tuple[list[int], list[list[int]]]:
    """Merge adjacent dims that are contiguous in every view: fewer, longer loops vectorize better."""
    dims = [d for d in range(len(shape)) if shape[d] != 1] or []
    if not dims:
        return [1], [[0] for _ in strides]
    out_shape = [shape[dims[0]]]
    out_strides = [[s[dims[0]]] for s in strides]
    for d in dims[1:]:
        if all(st[-1] == s[d] * shape[d] for st, s in zip(out_strides, strides, strict=True)):
            out_shape[-1] *= shape[d]
            for st, s in zip(out_strides, strides, strict=True):
                st[-1] = s[d]
        else:
            out_shape.append(shape[d])
            for st, s in zip(out_strides, strides, strict=True):
                st.append(s[d])
    return out_shape, out_strides


_libm_done = False


def _register_libm() -> None:
    """Scalar math intrinsics lower to libm calls on x86; make those symbols resolvable."""
    global _libm_done
    if _libm_done:
        return
    libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    for sym in ("expf", "exp", "logf", "log", "tanhf", "tanh", "powf", "pow", "sinf", "sin", "cosf", "cos"):
        fn = getattr(libm, sym, None)
        if fn is not None:
            register_symbol(sym, ctypes.cast(fn, ctypes.c_void_p).value or 0)
    _libm_done = True


__all__ = ["BYTES", "Body", "CompiledGraph", "KernelBuilder", "Scalar", "View"]
