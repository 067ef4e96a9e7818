"""Compiled heavy primitives callable from Python: GEMM and conv2d (forward, backward-data/weight).

Each function here builds IR for fixed shapes, compiles it once (memoized in-process, cached on
disk across processes) and returns a :class:`CompiledKernel`. Calls take numpy arrays and do no
validation beyond asserting invariants: argument checking belongs to the layers above.
Phase 2 will emit the same generators into one module per graph instead of one per primitive.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .conv import Conv2dGeometry
from .convpass import ConvPass, emit_conv2d_pass
from .gemm import GemmSpec, emit_gemm, epilogue_pointers
from .irtext import ModuleEmitter
from .jit import NativeModule
from .threads import pool


class CompiledKernel:
    """One entry point ``void f(ptr arg0, ..., ptr ws)`` plus its workspace, ready for ctypes.

    The workspace (sized for the pool's thread count) is allocated once and reused: calls on one
    kernel object must not overlap, which holds for the single-threaded callers this serves.
    """

    def __init__(self, module: NativeModule, entry: str, nargs: int, workspace_bytes: int) -> None:
        self.module = module
        self.nargs = nargs
        self._fn = module.cfunc(entry, None, *([ctypes.c_void_p] * (nargs + 1)))
        self._ws = np.zeros(max(workspace_bytes, 64) + 64, np.uint8)
        addr = self._ws.ctypes.data
        self.workspace = addr + (-addr) % 64

    def call_pointers(self, *pointers: int) -> None:
        """Call with raw addresses (the fast path: precompute them, PERF_NOTES says ~2 µs each)."""
        self._fn(*pointers, self.workspace)

    def __call__(self, *arrays: np.ndarray) -> None:
        assert len(arrays) == self.nargs
        for a in arrays:
            assert a.flags.c_contiguous, "kernels take C-contiguous arrays"
        self._fn(*(a.ctypes.data for a in arrays), self.workspace)


def _build(m: ModuleEmitter, entry: str, nargs: int, workspace_bytes_per_thread: int) -> CompiledKernel:
    nthreads = pool().nthreads  # the pool must exist before the module is linked against it
    module = NativeModule(m.text())
    return CompiledKernel(module, entry, nargs, workspace_bytes_per_thread * nthreads)


@functools.lru_cache(maxsize=256)
def gemm_kernel(spec: GemmSpec) -> CompiledKernel:
    """Compile ``spec``; the kernel is called as ``k(a, b, c)``, followed by the epilogue's memory inputs."""
    m = ModuleEmitter("gemm")
    plan = emit_gemm(m, spec, name="gemm")
    return _build(m, plan.names["entry"], 3 + len(epilogue_pointers(spec)), plan.workspace_per_thread)


def gemm(
    a: np.ndarray, b: np.ndarray, c: np.ndarray | None = None, *, trans_a: bool = False, trans_b: bool = False,
    alpha: float = 1.0, accumulate: bool = False,
) -> np.ndarray:
    """``c (=|+=) alpha * op(a) @ op(b)`` with contiguous row-major storage; ``op`` is transpose if asked."""
    m = a.shape[1] if trans_a else a.shape[0]
    k = a.shape[0] if trans_a else a.shape[1]
    n = b.shape[0] if trans_b else b.shape[1]
    if c is None:
        c = np.zeros((m, n), a.dtype)
    spec = GemmSpec.dense(m, n, k, str(a.dtype), trans_a, trans_b, alpha, accumulate)
    gemm_kernel(spec)(a, b, c)
    return c


@dataclass(frozen=True)
class Conv2dKernels:
    """The three compiled conv2d passes for one geometry, each called with numpy arrays."""

    forward: CompiledKernel  # (x, w, y)
    backward_data: CompiledKernel  # (dy, w, dx)
    backward_weight: CompiledKernel  # (x, dy, dw)


@functools.lru_cache(maxsize=64)
def conv2d_kernels(geom: Conv2dGeometry) -> Conv2dKernels:
    """Compile forward, backward-data and backward-weight for ``geom`` into one module."""
    m = ModuleEmitter("conv2d")
    fwd, _ = emit_conv2d_pass(m, ConvPass(geom, "forward"), "conv2d_forward")
    bwd_d, _ = emit_conv2d_pass(m, ConvPass(geom, "backward_data"), "conv2d_backward_data")
    bwd_w, _ = emit_conv2d_pass(m, ConvPass(geom, "backward_weight"), "conv2d_backward_weight")
    nthreads = pool().nthreads
    module = NativeModule(m.text())
    return Conv2dKernels(
        CompiledKernel(module, fwd.entry, 3, fwd.workspace_per_thread * nthreads),
        CompiledKernel(module, bwd_d.entry, 3, bwd_d.workspace_per_thread * nthreads),
        CompiledKernel(module, bwd_w.entry, 3, bwd_w.workspace_per_thread * nthreads),
    )


def conv2d_geometry(
    x_shape: Sequence[int], w_shape: Sequence[int], stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] = 0, dilation: int | Sequence[int] = 1, dtype: str = "float32",
) -> Conv2dGeometry:
    """Normalize conv attributes; ``padding`` is an int, (ph, pw) or (top, left, bottom, right)."""
    return Conv2dGeometry.make(tuple(x_shape), tuple(w_shape), stride, padding, dilation, dtype)
