"""KernelBuilder: the narrow API through which operators lower themselves into one LLVM module.

A whole graph (forward + backward + optimizer update) becomes ONE function
``void entry(ptr bufs, ptr ws)`` where ``bufs`` is an array of buffer pointers, so a step costs
one ctypes call. Each operator's lowering receives a :class:`KernelBuilder` and calls a handful of
primitives on strided :class:`View` objects:

* :meth:`KernelBuilder.elementwise` - ``out[idx] = body(in_1[idx], ...)``; broadcasting is a
  0-stride in an input view, so the builder never needs to know an operator's semantics;
* :meth:`KernelBuilder.map_reduce` / :meth:`KernelBuilder.reduce` - sum/max/min over axes of an
  elementwise body (reassociation allowed: it vectorizes);
* :meth:`KernelBuilder.matmul`, :meth:`KernelBuilder.conv` - the heavy primitives (transposes are
  strides of the GEMM operands, never copies); :mod:`.windows` adds the pooling primitives;
* :meth:`KernelBuilder.temporary` / :meth:`KernelBuilder.contiguous` - scratch buffers whose
  memory the graph compiler plans with everything else.

Elementwise and reduce steps are recorded, not emitted, until :meth:`KernelBuilder.finish`; in
between, :meth:`KernelBuilder.fuse` inlines an elementwise producer into its only consumer, so
chains such as ``greater -> multiply`` (relu's gradient) or an optimizer's update run as one loop
and their intermediate buffers vanish; an elementwise consumer of a matmul becomes the GEMM's
epilogue (a dense layer's bias and activation, a weight gradient's update), applied to C while it
is in cache; :meth:`KernelBuilder.fuse_reductions` runs a reduction of an elementwise output
that others read too (a bias gradient's sum) in the pass that writes it, slice by slice while
each slice is in cache; :meth:`KernelBuilder.fuse_outputs` computes an elementwise output that
others read too (an optimizer's new moments) in the later pass that reads it. The builder
never sees operator names. Bodies are written against :class:`Scalar`, a tiny expression
emitter over one element type. Outputs must not
overlap inputs (pointers are ``noalias``), which the buffer planner guarantees. Large loops are
split over the thread pool by output rows, so results do not depend on the thread count.
"""

from __future__ import annotations

import ctypes
import itertools
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from .batched import emit_batched_gemm
from .conv import Conv2dGeometry
from .convpass import ConvPass, accepts_prologue, emit_conv2d_pass
from .gather import gather_rows, rows_addressable, scatter_add_rows
from .gemm import Epilogue, GemmSpec, IndexMap, Operand, emit_gemm
from .grouped import conv2d_direct
from .hostcall import emit_cross_replica_sum, register_host_symbols
from .irtext import BYTES, LLVM_TYPE, FunctionEmitter, ModuleEmitter, not_finite
from .jit import NativeModule
from .reduction import emit_reduction, reduces_by_vectors
from .target import current_target
from .threads import PARALLEL_FOR, PARALLEL_FOR_DECL, pool
from .views import (
    CONSTANT,
    INT_TYPE,
    IOTA,
    Body,
    Scalar,
    View,
    collapse,
    elem_type,
    identity,
    load,
    row_major,
)
from .windows import Window2d, pool2d, pool2d_argmax_gather, pool2d_scatter

#: Loops with fewer output elements than this run on the calling thread.
PARALLEL_MIN_ELEMENTS = 1 << 16
#: An elementwise step computes a reduction of its output (:meth:`KernelBuilder.fuse_reductions`)
#: only where its outermost axis has this many slices to share among threads.
FUSED_REDUCTION_MIN_SLICES = 8
#: Steps that :meth:`KernelBuilder.fuse_reductions` may move ahead of a producer write at most
#: this many elements (per-channel values such as a normalization's mean and scale).
HOISTED_STEP_MAX_ELEMENTS = 1 << 12
#: Convolutions with more groups than this run as direct loops (:mod:`.grouped`): their per-group
#: GEMMs are too small to pay for packing, and a depthwise conv would call one per channel.
GROUPED_GEMM_MAX_GROUPS = 8

@dataclass
class Step:
    """One recorded operation. ``kind`` is ``ew`` (elementwise), ``red`` (map-reduce) or ``call``
    (an already emitted function called with ``call_buffers``); ``reads``/``writes`` list the
    memory buffers it touches, which is all the buffer planner and the fusion pass need."""

    kind: str
    out: View | None = None
    inputs: list[View] = field(default_factory=list)
    body: Body = identity
    axes: tuple[int, ...] = ()
    op: str = "sum"
    scale: float = 1.0
    call: str = ""
    call_buffers: list[int] = field(default_factory=list)
    reads: list[int] = field(default_factory=list)
    writes: list[int] = field(default_factory=list)
    label: str = ""  # what produced it (the graph compiler puts op names here, for profiles)
    flops: int = 0  # multiply-adds count 2: what a per-kernel report divides by the time
    detail: str = ""  # the shapes behind a heavy step ("conv x32x32x26x26 w64x32x3x3"), for reports
    #: A GEMM or conv2d pass emitted by :meth:`KernelBuilder.finish` (so that :meth:`KernelBuilder.fuse`
    #: can give it an epilogue first); ``call`` is then its entry's name and ``out`` the view it writes.
    gemm: GemmSpec | None = None
    conv: ConvPass | None = None
    #: Reductions an ``ew`` step also computes, each over the slice of its outermost axis just
    #: written (:meth:`KernelBuilder.fuse_reductions`); their axis 0 is kept.
    reductions: list[Step] = field(default_factory=list)
    #: More outputs of an ``ew`` step, each a view of ``out``'s shape and the body that computes it
    #: from the step's inputs (:meth:`KernelBuilder.fuse_outputs`).
    outputs: list[tuple[View, Body]] = field(default_factory=list)

    @staticmethod
    def of_views(kind: str, out: View, inputs: list[View], **kw: object) -> Step:
        return Step(kind, out, inputs, reads=[v.buffer for v in inputs if v.is_memory], writes=[out.buffer], **kw)  # type: ignore[arg-type]


class KernelBuilder:
    """Accumulates lowered operations, in call order, into one entry ``void name(ptr bufs, ptr ws)``.

    ``allocate(shape, dtype) -> buffer index`` provides scratch buffers (see :meth:`temporary`);
    the graph compiler passes its buffer planner here. Standalone users number buffers themselves.
    """

    def __init__(self, name: str = "graph", allocate: Callable[[tuple[int, ...], str], int] | None = None,
                 constant: Callable[[np.ndarray], int] | None = None) -> None:
        self.m = ModuleEmitter(name)
        self.m.declare(PARALLEL_FOR, PARALLEL_FOR_DECL)
        self.name = name
        self.steps: list[Step] = []
        self.workspace_per_thread = 0
        self._allocate = allocate
        self._constant = constant
        self._count = 0
        self._detail = ""  # set while a conv lowers, so its GEMM steps are reported as that conv
        #: Emitted kernel name -> the op(s) it lowers (filled by :meth:`finish`), for compile errors.
        self.kernel_labels: dict[str, str] = {}
        #: Steps that call back into the host process (a communicator), which an exported library lacks.
        self.host_calls: list[str] = []

    def fresh(self, kind: str) -> str:
        """A function name unique in this module."""
        self._count += 1
        return f"{self.name}.{kind}{self._count}"

    # ----- buffers -----

    def temporary(self, shape: Sequence[int], dtype: str) -> View:
        """A fresh contiguous scratch buffer; the planner gives it memory only while it is live."""
        if self._allocate is None:
            raise RuntimeError("this KernelBuilder has no buffer allocator; pass allocate= to create temporaries")
        return View.contiguous(self._allocate(tuple(shape), dtype), shape, dtype)

    def constant(self, array: np.ndarray) -> View:
        """A table computed at compile time from attributes (interpolation weights, say), held by
        the compiled object as a read-only buffer; its dtype is the array's."""
        if self._constant is None:
            raise RuntimeError("this KernelBuilder has no constant store; pass constant= to bake tables")
        table = np.ascontiguousarray(array)
        return View.contiguous(self._constant(table), table.shape, table.dtype.name)

    def contiguous(self, view: View) -> View:
        """``view`` itself if it is dense row-major memory at offset 0, else a copy that is."""
        if view.is_memory and view.is_contiguous and view.offset == 0:
            return replace(view, strides=row_major(view.shape))
        tmp = self.temporary(view.shape, view.dtype)
        self.elementwise(tmp, [view], identity)
        return tmp

    @staticmethod
    def scalar(value: float, dtype: str, shape: Sequence[int] = ()) -> View:
        """A constant view (:meth:`View.scalar`), so lowerings need not import this module."""
        return View.scalar(value, dtype, shape)

    @staticmethod
    def iota(shape: Sequence[int], axis: int) -> View:
        """The index along ``axis`` (:meth:`View.iota`)."""
        return View.iota(shape, axis)

    @staticmethod
    def flat_index(shape: Sequence[int]) -> View:
        """The raw ``i64`` row-major index of each position (:meth:`View.flat_index`)."""
        return View.flat_index(shape)

    # ----- elementwise -----

    def elementwise(self, out: View, inputs: Sequence[View], body: Body, broadcast: bool = False) -> None:
        """``out[i] = body(inputs[0][i], ...)`` over ``out.shape``; inputs are views of that shape,
        or are broadcast to it (numpy rules) when ``broadcast`` is true.

        Int inputs are converted to ``out``'s float type; iota and scalar views need no memory.
        """
        if broadcast:
            inputs = [v.broadcast_to(out.shape) for v in inputs]
        for v in inputs:
            assert v.shape == out.shape, f"input view {v.shape} != output {out.shape}: broadcast_to first"
            assert v.buffer != out.buffer, "an output must not alias an input (pointers are noalias)"
        if out.size:
            self.steps.append(Step.of_views("ew", out, list(inputs), body=body))

    def fill(self, out: View, value: float) -> None:
        self.elementwise(out, [], lambda s, v: s.const(value))

    # ----- reductions -----

    def map_reduce(self, out: View, inputs: Sequence[View], axes: Sequence[int], op: str = "sum",
                   body: Body = identity, scale: float = 1.0) -> None:
        """``out = scale * op over axes of body(inputs...)``; inputs share one shape.

        ``out`` has that shape with ``axes`` set to 1 (keepdims) or removed. ``op`` is ``sum``,
        ``max`` or ``min``. Reduced axes run innermost with reassociation allowed, so contiguous
        reductions vectorize; the order is fixed at compile time (no thread splits a reduction).
        """
        shape = inputs[0].shape
        axes = tuple(sorted({a % len(shape) for a in axes})) if shape else ()
        keep = [d for d in range(len(shape)) if d not in axes]
        if out.ndim == len(shape) and out.ndim != len(keep):
            out = replace(out, shape=tuple(shape[d] for d in keep), strides=tuple(out.strides[d] for d in keep))
        assert out.shape == tuple(shape[d] for d in keep), f"reduce output {out.shape} for input {shape} axes {axes}"
        assert op in ("sum", "max", "min")
        if out.size:
            self.steps.append(Step.of_views("red", out, list(inputs), body=body, axes=axes, op=op, scale=scale))

    def reduce(self, out: View, inp: View, axes: Sequence[int], op: str = "sum", scale: float = 1.0) -> None:
        """``out = scale * op(inp, axes)``; see :meth:`map_reduce`."""
        self.map_reduce(out, [inp], axes, op, identity, scale)

    # ----- heavy primitives -----

    def matmul(self, out: View, a: View, b: View, alpha: float = 1.0, accumulate: bool = False) -> None:
        """``out (=|+=) alpha * a @ b`` for 2-D views of any strides (a transpose is a stride swap)."""
        (m, k), (k2, n) = a.shape, b.shape
        assert k == k2 and out.shape == (m, n), f"matmul {a.shape} @ {b.shape} -> {out.shape}"
        if out.size == 0:
            return
        if k == 0:
            if not accumulate:
                self.fill(out, 0.0)
            return
        a, b = (v if v.is_memory else self.contiguous(v) for v in (a, b))
        spec = GemmSpec(m, n, k, _operand(a), _operand(b), _operand(out), out.dtype, alpha, accumulate)
        self.gemm(spec, a.buffer, b.buffer, out.buffer)
        self.steps[-1].out = out

    def batch_matmul(self, out: View, a: View, b: View) -> None:
        """``out[i] = a[i] @ b[i]`` for 3-D views; an operand with a batch of 1 is used for every entry.

        One GEMM kernel with a loop over the batch, so code size and compile time do not depend on it.
        """
        batch, m, n = out.shape
        k = a.shape[2]
        assert a.shape[1:] == (m, k) and b.shape[1:] == (k, n) and {a.shape[0], b.shape[0]} <= {1, batch}, \
            f"batch_matmul {a.shape} @ {b.shape} -> {out.shape}"
        if out.size == 0:
            return
        if k == 0:
            self.fill(out, 0.0)
            return
        a, b = (v if v.is_memory else self.contiguous(v) for v in (a, b))

        def entry(v: View) -> View:
            return replace(v, shape=v.shape[1:], strides=v.strides[1:])

        spec = GemmSpec(m, n, k, _operand(entry(a)), _operand(entry(b)), _operand(entry(out)), out.dtype)
        sa, sb, sc = (v.strides[0] if v.shape[0] > 1 else 0 for v in (a, b, out))
        plan = emit_batched_gemm(self.m, spec, batch, (sa, sb, sc), self.fresh("bgemm"))
        self.add_call(plan.names["entry"], [a.buffer, b.buffer, out.buffer], [a.buffer, b.buffer], [out.buffer],
                      plan.workspace_per_thread, flops=2 * batch * m * n * k,
                      detail=f"batch {batch} x gemm {m}x{n}x{k}")

    def gemm(self, spec: GemmSpec, a: int, b: int, c: int) -> None:
        """``C (=|+=) alpha * A @ B`` with the layouts in ``spec``; a, b, c are buffer indices.

        The kernel is emitted by :meth:`finish`, with the epilogue :meth:`fuse` may have given it."""
        reads = [a, b, c] if spec.accumulate else [a, b]
        self.steps.append(Step("call", call=self.fresh("gemm"), call_buffers=[a, b, c], reads=reads, writes=[c],
                               flops=2 * spec.m * spec.n * spec.k,
                               detail=self._detail or f"gemm {spec.m}x{spec.n}x{spec.k}", gemm=spec))

    def conv(self, pass_: str, geom: Conv2dGeometry, out: View, first: View, second: View) -> None:
        """A conv2d pass on views: ``forward`` (x, w) -> y, ``backward_data`` (dy, w) -> dx,
        ``backward_weight`` (x, dy) -> dw. Non-dense operands are copied to scratch first."""
        if out.size == 0:
            return
        if geom.ckk == 0 or geom.n == 0 or geom.o == 0:  # an empty contraction (backward-data sums over O)
            self.fill(out, 0.0)
            return
        a, b = self.contiguous(first), self.contiguous(second)
        self._detail = geom.describe()
        try:
            self._conv_steps(pass_, geom, out, a, b)
        finally:
            self._detail = ""

    def _conv_steps(self, pass_: str, geom: Conv2dGeometry, out: View, a: View, b: View) -> None:
        if _window_is_whole_input(geom):
            self._conv_as_matmul(pass_, geom, out, a, b)
            return
        dst = out if out.is_contiguous and out.offset == 0 else self.temporary(out.shape, out.dtype)
        if geom.groups > GROUPED_GEMM_MAX_GROUPS:
            conv2d_direct(self, pass_, geom, dst, a, b)
        else:
            self.conv2d(geom, pass_, (a.buffer, b.buffer, dst.buffer))
            self.steps[-1].out = dst
        if dst is not out:
            self.elementwise(out, [dst], identity)

    def _conv_as_matmul(self, pass_: str, geom: Conv2dGeometry, out: View, a: View, b: View) -> None:
        """A kernel covering the whole unpadded input (a 1x1 output, e.g. the seed CNN's 12x12 conv)
        is a dense layer on the flattened image: plain strided GEMMs pack without the im2col window
        masks (measured ~30 % faster on the three passes)."""
        n, o, ckk = geom.n, geom.o, geom.ckk
        flat = out if out.is_contiguous and out.offset == 0 else self.temporary(out.shape, out.dtype)

        def as2d(v: View, rows: int, cols: int) -> View:
            view = v.reshape((rows, cols))
            assert view is not None
            return view

        if pass_ == "forward":  # y[n, o] = x[n, :] . w[o, :], as y^T = w @ x^T: the weights are A, read in place
            self.matmul(as2d(flat, n, o).T, as2d(b, o, ckk), as2d(a, n, ckk).T)
        elif pass_ == "backward_data":  # dx[n, :] = dy[n, :] @ w
            self.matmul(as2d(flat, n, ckk), as2d(a, n, o), as2d(b, o, ckk))
        else:  # backward_weight: dw[o, :] = dy[:, o]^T @ x
            self.matmul(as2d(flat, o, ckk), as2d(b, n, o).T, as2d(a, n, ckk))
        if flat is not out:
            self.elementwise(out, [flat], identity)

    def conv2d(self, geom: Conv2dGeometry, pass_: str, buffers: tuple[int, int, int]) -> None:
        """One conv pass: ``forward`` (x, w, y), ``backward_data`` (dy, w, dx), ``backward_weight`` (x, dy, dw).

        The kernel is emitted by :meth:`finish`, with the epilogue :meth:`fuse` may have given it."""
        conv = ConvPass(geom, pass_)
        algorithm = conv.algorithm
        detail = geom.describe() + ("" if algorithm == "direct" else f" ({algorithm})")
        self.steps.append(Step("call", call=self.fresh("conv"), call_buffers=list(buffers), reads=list(buffers[:2]),
                               writes=[buffers[2]], flops=geom.flops(), detail=detail, conv=conv))

    def conv2d_forward(self, out: View, data: View, weight: View, strides: Sequence[int],
                       padding: Sequence[int], dilation: Sequence[int], groups: int = 1) -> None:
        """``out = conv2d(data NCHW, weight OIHW (O, C/groups, KH, KW))``; ``padding`` is ``(ph, pw)``
        on both sides or ``(top, left, bottom, right)``."""
        geom = Conv2dGeometry.make(data.shape, weight.shape, tuple(strides), tuple(padding), tuple(dilation),
                                   out.dtype, groups)
        self.conv("forward", geom, out, data, weight)

    def conv2d_backward_data(self, out: View, grad: View, weight: View, strides: Sequence[int],
                             padding: Sequence[int], dilation: Sequence[int], groups: int = 1) -> None:
        """``out`` (the data's shape) = the transposed convolution of ``grad`` by ``weight``."""
        geom = Conv2dGeometry.make(out.shape, weight.shape, tuple(strides), tuple(padding), tuple(dilation),
                                   out.dtype, groups)
        self.conv("backward_data", geom, out, grad, weight)

    def conv2d_backward_weight(self, out: View, grad: View, data: View, strides: Sequence[int],
                               padding: Sequence[int], dilation: Sequence[int], groups: int = 1) -> None:
        """``out`` (the weight's shape, (O, C/groups, KH, KW)) = the correlation of ``grad`` with ``data``."""
        geom = Conv2dGeometry.make(data.shape, out.shape, tuple(strides), tuple(padding), tuple(dilation),
                                   out.dtype, groups)
        self.conv("backward_weight", geom, out, data, grad)

    def pool2d(self, out: View, data: View, pool: Sequence[int], strides: Sequence[int], padding: Sequence[int],
               op: str, ceil_mode: bool = False, count_include_pad: bool = True) -> None:
        """Window max or mean (``op`` = ``max`` | ``avg``) over NCHW ``data``; see :mod:`.windows`."""
        win = Window2d(tuple(pool), tuple(strides), tuple(padding), ceil_mode, count_include_pad)  # type: ignore[arg-type]
        pool2d(self, out, data, win, op)

    def gather_rows(self, out: View, table: View, indices: View) -> bool:
        """``out[i, ...] = table[indices[i], ...]`` by address (:mod:`.gather`) where the views are
        rows in memory; False (nothing emitted) where they are not."""
        if not rows_addressable(out, table, indices):
            return False
        gather_rows(self, out, table, indices)
        return True

    def scatter_add_rows(self, out: View, grad: View, indices: View) -> bool:
        """The adjoint of :meth:`gather_rows`: each pick's gradient row added into its table row."""
        if not rows_addressable(out, grad, indices):
            return False
        scatter_add_rows(self, out, grad, indices)
        return True

    def pool2d_argmax_gather(self, out: View, values: View, data: View, pool: Sequence[int],
                             strides: Sequence[int], padding: Sequence[int], ceil_mode: bool = False) -> None:
        """``values`` read at the first maximum of each window of ``data``."""
        win = Window2d(tuple(pool), tuple(strides), tuple(padding), ceil_mode)  # type: ignore[arg-type]
        pool2d_argmax_gather(self, out, values, data, win)

    def pool2d_scatter(self, out: View, grad: View, data: View | None, pool: Sequence[int],
                       strides: Sequence[int], padding: Sequence[int], ceil_mode: bool = False,
                       count_include_pad: bool = True) -> None:
        """Adjoint of a window reduction: spread ``grad`` (``data=None``) or add it at each window's argmax."""
        win = Window2d(tuple(pool), tuple(strides), tuple(padding), ceil_mode, count_include_pad)  # type: ignore[arg-type]
        pool2d_scatter(self, out, grad, data, win)

    def cross_replica_sum(self, out: View, data: View) -> None:
        """``out = data`` summed over the replicas by the host's reducer (:mod:`opgrad.replicas`)."""
        emit_cross_replica_sum(self, out, data)

    # ----- extension points for primitive modules (e.g. windows.py) -----

    def add_call(self, fn: str, buffers: list[int], reads: list[int], writes: list[int], workspace: int = 0,
                 flops: int = 0, detail: str = "", checked: bool = False) -> None:
        """Record a call of emitted ``void fn(ptr buf..., ptr ws)``; ``flops`` and ``detail`` only feed reports.

        ``checked`` calls ``i32 fn(...)`` instead: a non-zero result ends the entry there (the
        function has recorded why for the caller, as :mod:`opgrad.replicas` does).
        """
        self.steps.append(Step("call", call=("chk:" if checked else "") + fn, call_buffers=buffers, reads=reads,
                               writes=writes, flops=flops, detail=detail or self._detail))
        self.workspace_per_thread = max(self.workspace_per_thread, workspace)

    def loop_function(self, name: str, nptrs: int, pipeline: str | None = None) -> FunctionEmitter:
        """``internal void name(ptr noalias p0..., i64 lo, i64 hi)``: the body of a parallel loop,
        optimized by ``pipeline`` (default: LLVM's full pipeline)."""
        params = [("ptr noalias", f"p{i}") for i in range(nptrs)] + [("i64", "lo"), ("i64", "hi")]
        return FunctionEmitter(self.m, name, params, linkage="internal", pipeline=pipeline)

    def add_parallel(self, name: str, buffers: list[int], outer: int, work: int, reads: list[int],
                     writes: list[int]) -> None:
        """Record ``name(p..., lo, hi)`` over ``[0, outer)``, split over threads when ``work`` is large."""
        call = self._parallel_task(name, len(buffers), outer, work)
        self.steps.append(Step("call", call=call, call_buffers=buffers, reads=reads, writes=writes))

    def _parallel_task(self, name: str, n: int, outer: int, work: int) -> str:
        """Emit ``name.task(ctx, tid, nt)`` running share ``tid`` of ``[0, outer)``; returns the call tag
        ``mode:name:outer``.

        The context holds the ``n`` buffer pointers and then ``outer``, so the task's code does not
        depend on the extent: loops that differ only there (a model's parameter updates) compile
        once (:mod:`.merge`)."""
        f = FunctionEmitter(self.m, name + ".task", [("ptr", "ctx"), ("i32", "tid"), ("i32", "nt")],
                            linkage="internal")
        ptrs = [f.load("ptr", f.gep("ptr", "%ctx", str(i))) for i in range(n)]
        outer_value = f.val(f"ptrtoint ptr {f.load('ptr', f.gep('ptr', '%ctx', str(n)))} to i64")
        tid, nt = f.val("sext i32 %tid to i64"), f.val("sext i32 %nt to i64")
        lo = f.val(f"udiv i64 {f.mul(tid, outer_value)}, {nt}")
        hi = f.val(f"udiv i64 {f.mul(f.add(tid, 1), outer_value)}, {nt}")
        f.call("void", "@" + name, [("ptr", p) for p in ptrs] + [("i64", lo), ("i64", hi)])
        f.ret_void()
        f.finish()
        parallel = work >= PARALLEL_MIN_ELEMENTS and outer > 1
        return f"{'par' if parallel else 'seq'}:{name}:{outer}"

    # ----- fusion -----

    def drop_unread(self, internal: set[int]) -> int:
        """Remove steps that write only ``internal`` buffers no step reads; returns how many.

        The graph compiler lowers a call's inputs before it finds that an earlier call computed
        the same value; the steps computing those inputs are then read by nothing."""
        dropped = 0
        while True:
            read = {b for st in self.steps for b in st.reads}
            live = [st for st in self.steps if not st.writes or any(b not in internal or b in read for b in st.writes)]
            if len(live) == len(self.steps):
                return dropped
            dropped += len(self.steps) - len(live)
            self.steps = live

    def fuse(self, internal: set[int]) -> int:
        """Inline elementwise producers into their only consumer; returns how many were inlined.

        A producer is inlined when its output buffer is ``internal`` (not an argument, result or
        constant of the graph), it is that buffer's only writer, the consumer is the only reader
        and reads it through exactly the producer's output view, and no step in between writes
        what the producer reads. Its buffer then disappears from the plan.
        """
        fused = 0
        # A fusion changes only its two steps and what follows the producer: no step before it
        # gains a fusion (no buffer loses a reader or writer but the one inlined away), so the
        # next scan starts at the producer's place rather than at the first step. Rescanning a
        # ResNet step's 1,100 steps after each of its ~1,000 fusions would take most of its warm
        # start.
        start = 0
        counts: tuple[Counter[int], Counter[int]] | None = None  # writers and readers per buffer
        while True:
            if counts is None:
                counts = (Counter(b for st in self.steps for b in st.writes),
                          Counter(b for st in self.steps for b in st.reads))
            writers, readers = counts
            done = True
            for j in range(start, len(self.steps)):
                consumer = self.steps[j]
                if consumer.kind not in ("ew", "red"):
                    continue
                for k, v in enumerate(consumer.inputs):
                    if not (v.buffer in internal and writers[v.buffer] == 1 and readers[v.buffer] == 1):
                        continue
                    i = self._writer_of(v.buffer, j)
                    producer = self.steps[i]
                    if consumer.kind == "ew" and i < j and (self._fuse_into_gemm(i, j, k)
                                                            or self._fuse_into_conv(i, j, k)):
                        fused += 1
                        done = False
                        start = i
                        counts = None  # the kernel took over the consumer's buffers: count again
                        break
                    if not (i < j and producer.kind == "ew" and producer.out is not None
                            and v.dtype == (consumer.out.dtype if consumer.out else v.dtype)):
                        continue
                    if consumer.kind == "red" and not producer.inputs and len(consumer.inputs) == 1:
                        continue  # a reduction takes its shape from its input: a fill (a GEMM over no K) stays one

                    views = _aligned(consumer, k, producer)
                    between = {b for st in self.steps[i + 1 : j] for b in st.writes}
                    if views is None or between & set(producer.reads):
                        continue
                    readers.subtract(consumer.reads)
                    readers.subtract(producer.reads)
                    writers.subtract(producer.writes)
                    consumer.out, inputs, inlined = views
                    consumer.inputs = [*inputs[:k], *inlined, *inputs[k + 1 :]]
                    consumer.body = _compose(consumer.body, k, producer.body, len(producer.inputs))
                    consumer.reads = [u.buffer for u in consumer.inputs if u.is_memory]
                    readers.update(consumer.reads)
                    consumer.label = "+".join(x for x in (producer.label, consumer.label) if x)
                    del self.steps[i]
                    fused += 1
                    done = False
                    start = i
                    break
                if not done:
                    break
            if done:
                return fused

    def _writer_of(self, buffer: int, reader: int) -> int:
        """The index of the step writing ``buffer`` (it has one writer), searched outward from the
        step ``reader`` that reads it: a producer mostly sits just before its consumer."""
        for i in itertools.chain(range(reader - 1, -1, -1), range(reader, len(self.steps))):
            if buffer in self.steps[i].writes:
                return i
        raise AssertionError(f"no step writes buffer {buffer}")

    def fuse_reductions(self) -> int:
        """Compute reductions of an elementwise step's output in that step; returns how many joined.

        A bias gradient sums a tensor over (batch, height, width) that an elementwise step has just
        written (a relu's or a pooling's gradient) and that other steps read too, so the producer
        cannot be inlined into the sum; as its own pass the sum reads the whole tensor back from
        memory. Here the elementwise step runs slice by slice of its outermost axis, and after each
        slice reduces it while it is in cache: where the batch axis is summed, into a partial per
        slice that a small reduction then adds in order, so the result never depends on how
        threads share the slices. Taken where that axis has at least
        :data:`FUSED_REDUCTION_MIN_SLICES` slices, the reduction reads the producer's output as
        the same dense run of memory and its other inputs are not written in between.
        """
        fused = 0
        # A join changes steps from its producer on, so the search goes on from there: the
        # reductions before it saw the same steps when they found no producer.
        start = 0
        while True:
            writers = Counter(b for st in self.steps for b in st.writes)
            for j in range(start, len(self.steps)):
                red = self.steps[j]
                if red.kind != "red" or red.out is None or not red.axes:
                    continue
                found = self._reduction_producer(j, writers)
                if found is not None:
                    producer, slices, start = found
                    self._join_reduction(j, producer, slices)
                    fused += 1
                    break
            else:
                return fused

    def fuse_outputs(self) -> int:
        """Compute an elementwise step whose output other steps read too in a later elementwise
        step of the same shape that reads it; returns how many were merged.

        An optimizer's update is several such steps: Adam writes its new first and second moments
        (results of the training step) and then reads them back to update the weights. Merged,
        one pass reads the gradient, weights and moments once and writes the three results: 7
        arrays of memory traffic instead of 10. The producer's value is computed in the
        consumer's loop, used there and stored to its own output. Taken where the consumer reads
        the output through exactly the producer's view and in no other way, no step in between
        reads or writes that output or writes what the producer reads, the producer reads
        nothing the consumer writes, and both compute in the same type.
        """
        merged = 0
        # A merge removes its producer and changes steps after it only, so the search goes on
        # from the producer's place: the consumers before it saw the same steps when none merged.
        start = 0
        while True:
            writer_at: dict[int, int] = {}  # buffer -> its last writer
            rewritten: set[int] = set()  # buffers more than one step writes
            for i, st in enumerate(self.steps):
                for b in st.writes:
                    if b in writer_at:
                        rewritten.add(b)
                    writer_at[b] = i
            for j in range(start, len(self.steps)):
                consumer = self.steps[j]
                if consumer.kind != "ew" or consumer.out is None or consumer.reductions:
                    continue
                for k, v in enumerate(consumer.inputs):
                    i = writer_at.get(v.buffer, j)
                    if v.buffer not in rewritten and i < j and self._merge_output(i, j, k):
                        merged += 1
                        start = i
                        break
                else:
                    continue
                break
            else:
                return merged

    def fuse_prologues(self, internal: set[int]) -> int:
        """Compute an elementwise step's output inside the conv weight gradient that is its only
        reader, as that pass reads it (:func:`~.convpass.accepts_prologue`); returns how many.

        A first layer's relu gradient ``grad * (y > 0)`` is written by one pass, which also sums
        it per image and channel for the bias gradient, and read back by the layer's weight
        gradient, the only other reader. Fused, the weight gradient reads ``grad`` and ``y`` and
        computes the product and those sums itself: the product never goes through memory (on
        the seed CNN, 2.8 MB written and read back). Taken where the step's output is internal,
        dense and read only by the pass, as its dY; its inputs are dY's shape and layout or
        constants; it has no other output and at most one reduction, a per-image channel sum of
        its output; and no step in between writes what it reads or touches what it writes.
        """
        fused = 0
        j = 0
        while j < len(self.steps):
            found = self._prologue_producer(j, internal)
            if found is None:
                j += 1
                continue
            i, prologue = found
            producer, conv_step = self.steps[i], self.steps[j]
            conv = conv_step.conv
            assert conv is not None
            memory = [u for u in producer.inputs if u.buffer != CONSTANT]
            sums = [r.out.buffer for r in producer.reductions if r.out is not None]
            x, _, dw = conv_step.call_buffers[:3]
            conv_step.call_buffers = [x, memory[0].buffer, dw, *(u.buffer for u in memory[1:]), *sums]
            conv_step.reads = [x, *(u.buffer for u in memory)]
            conv_step.writes = [dw, *sums]
            conv_step.conv = replace(conv, prologue=prologue, sums=bool(sums))
            conv_step.label = "+".join(x for x in (conv_step.label, producer.label) if x)
            del self.steps[i]
            fused += 1
            j = i
        return fused

    def _prologue_producer(self, j: int, internal: set[int]) -> tuple[int, Epilogue] | None:
        """The index of the elementwise step that weight-gradient step ``j`` can compute as its
        prologue (:meth:`fuse_prologues`), and that prologue; None where there is none."""
        step = self.steps[j]
        conv = step.conv
        if conv is None or conv.pass_ != "backward_weight" or conv.prologue is not None:
            return None
        g, dy = conv.geom, step.call_buffers[1]
        if dy not in internal or sum(dy in st.writes for st in self.steps) != 1 \
                or sum(dy in st.reads for st in self.steps) != 1:
            return None
        i = self._writer_of(dy, j)
        producer = self.steps[i]
        out = producer.out
        shape = (g.n, g.o, g.oh, g.ow)
        if (i > j or producer.kind != "ew" or out is None or producer.outputs or out.buffer != dy
                or out.shape != shape or out.dtype != g.dtype or not out.is_contiguous or out.offset != 0):
            return None
        memory = [u for u in producer.inputs if u.buffer != CONSTANT]
        dense = _plane_operand(out, shape)
        if dense is None or not memory or any(u.dtype != g.dtype or _plane_operand(u, shape) != dense
                                               for u in memory):
            return None
        for red in producer.reductions:
            total = red.out
            if (len(producer.reductions) > 1 or red.kind != "red" or red.op != "sum" or red.body is not identity
                    or red.scale != 1.0 or red.inputs != [out] or red.axes != (2, 3) or total is None
                    or total.shape != (g.n, g.o) or not total.is_contiguous or total.offset != 0):
                return None
        moved_reads, moved_writes = set(producer.reads), set(producer.writes)
        if any(moved_reads & set(st.writes) or moved_writes & {*st.reads, *st.writes} for st in self.steps[i + 1 : j]):
            return None
        inputs = tuple(u.constant if u.buffer == CONSTANT else dense for u in producer.inputs)
        prologue = Epilogue(producer.body, inputs)
        return (i, prologue) if accepts_prologue(conv, prologue) else None

    def _merge_output(self, i: int, j: int, k: int) -> bool:
        """Merge elementwise step ``i`` into step ``j``, whose input ``k`` is i's output
        (:meth:`fuse_outputs`); False, with nothing changed, where the conditions do not hold."""
        producer, consumer = self.steps[i], self.steps[j]
        out, read = producer.out, consumer.inputs[k]
        # One loop computes in one type: the consumer's (a cast between the two stays apart).
        if (producer.kind != "ew" or out is None or producer.reductions or read != out
                or consumer.out is None or out.shape != consumer.out.shape
                or out.dtype != consumer.out.dtype or out.dtype in INT_TYPE):
            return False
        produced = set(producer.writes)
        if sum(u.buffer in produced for u in consumer.inputs) != 1 or produced & set(producer.reads):
            return False
        if (set(producer.reads) | produced) & set(consumer.writes):
            return False
        moved = produced | set(producer.reads)
        if any(produced & set(st.reads) or moved & set(st.writes) for st in self.steps[i + 1 : j]):
            return False
        n = len(producer.inputs)

        def shifted(body: Body) -> Body:
            return lambda s, vals: body(s, vals[k : k + n])

        consumer.outputs = [(view, _compose(body, k, producer.body, n)) for view, body in consumer.outputs]
        consumer.outputs += [(out, shifted(producer.body))]
        consumer.outputs += [(view, shifted(body)) for view, body in producer.outputs]
        consumer.body = _compose(consumer.body, k, producer.body, n)
        consumer.inputs = [*consumer.inputs[:k], *producer.inputs, *consumer.inputs[k + 1 :]]
        consumer.reads = [u.buffer for u in consumer.inputs if u.is_memory]
        consumer.writes = [consumer.out.buffer, *(view.buffer for view, _ in consumer.outputs)]
        consumer.label = "+".join(x for x in (producer.label, consumer.label) if x)
        del self.steps[i]
        return True

    def _join_reduction(self, j: int, producer: Step, slices: int) -> None:
        """Make reduction step ``j`` one of ``producer``'s (see :meth:`fuse_reductions`)."""
        red = self.steps[j]
        assert red.out is not None
        shape = red.inputs[0].shape
        reads = [b for b in red.reads if b not in producer.writes]
        if 0 in red.axes:
            kept = tuple(shape[d] for d in range(1, len(shape)) if d not in red.axes)
            partial = self.temporary((slices, *kept), red.out.dtype)
            producer.reductions.append(Step.of_views("red", partial, list(red.inputs), body=red.body, op=red.op,
                                                     axes=tuple(a for a in red.axes if a != 0)))
            producer.writes = [*producer.writes, partial.buffer]
            red.inputs, red.body, red.axes, red.reads = [partial], identity, (0,), [partial.buffer]
        else:
            producer.reductions.append(red)
            producer.writes = [*producer.writes, red.out.buffer]
            del self.steps[j]
        producer.reads = [*producer.reads, *reads]
        producer.label = "+".join(x for x in (producer.label, red.label) if x)

    def _reduction_producer(self, j: int, writers: Counter[int]) -> tuple[Step, int, int] | None:
        """The elementwise step that reduction ``j`` can join (:meth:`fuse_reductions`), its
        number of slices and the first index of the steps that the join changes (the producer's,
        before writers are hoisted ahead of it); None where there is none."""
        red = self.steps[j]
        assert red.out is not None
        shape = red.inputs[0].shape
        if not shape or shape[0] < FUSED_REDUCTION_MIN_SLICES:
            return None
        if 0 in red.axes and (set(red.axes) == {0} or self._allocate is None):
            return None  # the partials would be the slices themselves, or there is no scratch
        # The producer writes one of the buffers the reduction reads, and is their only writer:
        # the search ends at the earliest of their writers (a long step list is not walked to
        # its start for every reduction).
        unwritten = {b for b in red.reads if writers[b]}
        for i in range(j - 1, -1, -1):
            if not unwritten:
                return None
            producer = self.steps[i]
            unwritten.difference_update(producer.writes)
            out = producer.out
            if producer.kind != "ew" or out is None or out.dtype in INT_TYPE or out.buffer not in red.reads:
                continue
            if out.size < math.prod(shape):
                continue  # a broadcast input (a per-channel value), not the tensor being reduced
            if writers[out.buffer] != 1 or not out.is_contiguous or out.shape[0] != shape[0]:
                return None
            between = self.steps[i + 1 : j]
            written_between = {b for st in between for b in st.writes}
            late: set[int] = set()  # other inputs of the reduction that steps in between write
            for u in red.inputs:
                if u.buffer == out.buffer:
                    if not (u.is_contiguous and u.offset == out.offset and u.size == out.size):
                        return None
                elif u.buffer in producer.writes:
                    return None
                elif u.buffer in written_between:
                    late.add(u.buffer)
            target = red.out.buffer
            if 0 not in red.axes and (target in producer.reads or target in producer.writes
                                      or any(target in st.reads or target in st.writes for st in between)):
                return None
            if late and not self._hoist_writers(i, j, late):
                return None
            return producer, shape[0], i
        return None

    def _hoist_writers(self, i: int, j: int, buffers: set[int]) -> bool:
        """Move the steps between ``i`` and ``j`` that write ``buffers``, with the steps in between
        that they read from, to just before step ``i``, in their order; False, with nothing
        changed, where one has a large output (it is not a per-channel value) or the move would
        change what a step reads or writes.

        A normalization's gradient sums ``grad * xhat`` right after the pass that writes ``grad``
        (a relu's gradient), but ``xhat``'s per-channel mean and scale are computed in between:
        moved ahead, the sum can join that pass instead of reading ``grad`` back from memory."""
        movers = {k for k in range(i + 1, j) if buffers & set(self.steps[k].writes)}
        pending = sorted(movers)
        while pending:
            k = pending.pop()
            for t in range(i + 1, k):
                if t not in movers and set(self.steps[k].reads) & set(self.steps[t].writes):
                    movers.add(t)
                    pending.append(t)
        for k in movers:
            step = self.steps[k]
            if step.kind not in ("ew", "red") or step.out is None or step.out.size > HOISTED_STEP_MAX_ELEMENTS:
                return False
            for t in range(i, k):
                if t in movers:
                    continue
                other = self.steps[t]
                if set(step.reads) & set(other.writes) or set(step.writes) & {*other.reads, *other.writes}:
                    return False
        self.steps[i:j] = [self.steps[k] for k in sorted(movers)] + \
            [self.steps[k] for k in range(i, j) if k not in movers]
        return True

    def _fuse_into_gemm(self, i: int, j: int, k: int) -> bool:
        """Make elementwise step ``j`` the epilogue of GEMM step ``i``, whose result is its input ``k``
        and read by nothing else; False (nothing changed) where that is not possible. Every view
        must be a matrix in the GEMM's coordinates: its inputs then load at C's positions."""
        spec = self.steps[i].gemm
        if spec is None or spec.accumulate:
            return False

        def operand(v: View) -> Operand | None:
            matrix = v.as_matrix(spec.m, spec.n)
            return _operand(matrix) if matrix is not None else None

        found = self._epilogue_for(i, j, k, operand, spec.epilogue, spec.dtype, fixed_output=False,
                                   accepts=lambda _: True)
        if found is None:
            return False
        epilogue, target = found
        self.steps[i].gemm = replace(spec, c=target, epilogue=epilogue)
        return True

    def _fuse_into_conv(self, i: int, j: int, k: int) -> bool:
        """Make elementwise step ``j`` the epilogue of conv2d step ``i`` (see :meth:`_fuse_into_gemm`),
        where its pass takes one: every view has the output's shape, its output the same layout."""
        conv, produced = self.steps[i].conv, self.steps[i].out
        if conv is None or produced is None:
            return False
        found = self._epilogue_for(i, j, k, lambda v: _plane_operand(v, produced.shape), conv.epilogue,
                                   produced.dtype, fixed_output=True, accepts=conv.accepts)
        if found is None:
            return False
        self.steps[i].conv = replace(conv, epilogue=found[0])
        return True

    def _epilogue_for(self, i: int, j: int, k: int, operand: Callable[[View], Operand | None],
                      earlier: Epilogue | None, dtype: str, fixed_output: bool,
                      accepts: Callable[[Epilogue], bool]) -> tuple[Epilogue, Operand] | None:
        """Fold elementwise step ``j`` into step ``i``, whose result (view ``out``, written by nothing
        else) is j's input ``k`` and read by nothing else, as the epilogue after ``earlier``;
        ``operand`` maps a view to step i's output coordinates (None: it cannot be read there).
        Returns the epilogue and the operand of j's output, which step i then writes; None, with
        nothing changed, where that is not possible or step i does not ``accepts`` the epilogue.

        The consumer then runs at the producer's place, so none of its other inputs may be written,
        and its output neither read nor written, by the steps in between. ``fixed_output``: the
        producer writes its output in its own layout and may run the epilogue twice (a Winograd
        fallback recomputes the output), so the consumer's output must have that layout and must
        not be one of the epilogue's inputs."""
        producer, consumer = self.steps[i], self.steps[j]
        out, result = consumer.out, consumer.inputs[k]
        if out is None or producer.out is None or out.dtype != dtype:
            return None
        produced = operand(producer.out)
        if sum(u.buffer == result.buffer for u in consumer.inputs) != 1 or produced is None \
                or operand(result) != produced:
            return None
        target = operand(out)
        if target is None or out.buffer in producer.reads or (fixed_output and target != produced):
            return None
        inputs: list[Operand | float] = []
        buffers: list[int] = []
        for x, u in enumerate(consumer.inputs):
            if x == k:
                continue
            if u.buffer == CONSTANT:
                inputs.append(u.constant)
                continue
            matrix = operand(u) if u.is_memory and u.dtype == dtype else None
            if matrix is None:
                return None
            inputs.append(matrix)
            buffers.append(u.buffer)
        if fixed_output and out.buffer in buffers:
            return None
        between = self.steps[i + 1 : j]
        if any(set(st.writes) & {*buffers, out.buffer} or out.buffer in st.reads for st in between):
            return None
        body = _epilogue_body(consumer.body, k, earlier.body if earlier else None,
                              len(earlier.inputs) if earlier else 0)
        epilogue = Epilogue(body, (*(earlier.inputs if earlier else ()), *inputs))
        if not accepts(epilogue):
            return None
        producer.out = out
        producer.call_buffers = [*producer.call_buffers[:2], out.buffer, *producer.call_buffers[3:], *buffers]
        producer.reads = [*producer.call_buffers[:2], *producer.call_buffers[3:]]
        producer.writes = [out.buffer]
        producer.label = "+".join(x for x in (producer.label, consumer.label) if x)
        del self.steps[j]
        return epilogue, target

    # ----- assembly -----

    def finish(self, step_entries: bool = False, guard: tuple[int, int, str] | None = None) -> str:
        """Emit every step and the entry that runs them in order; returns the module's IR text.

        ``step_entries`` also exports ``<name>.step<i>(bufs, ws)`` running step ``i`` alone, so
        that a profiler can time each step with the same code and buffers. ``guard`` (step, slot,
        dtype) also emits ``i32 <name>.guarded(bufs, ws)``, which runs the same kernels but returns
        1 before that step where the scalar in ``slot`` is NaN or infinite (a multi-step loop stopping at such a
        loss before any step overwrites a weight), else 0 after the last.
        """
        calls: list[tuple[str, list[int]]] = []
        # A GEMM or conv pass of the same spec as an earlier step calls that step's kernel: a
        # model's repeated blocks would emit the same code again (building IR is most of a warm
        # start), for the merge of identical functions to remove it. Specs with an epilogue are
        # never shared: its body compares by identity and its constants by value (-0.0 == 0.0).
        emitted: dict[tuple[object, ...], str] = {}
        for st in self.steps:
            if st.kind == "ew":
                calls.append(self._emit_elementwise(st))
            elif st.kind == "red":
                calls.append(self._emit_reduce(st))
            elif st.gemm is not None and st.gemm.epilogue is None and _spec_key(st.gemm) in emitted:
                calls.append((emitted[_spec_key(st.gemm)], st.call_buffers))
            elif st.gemm is not None:
                plan = emit_gemm(self.m, st.gemm, st.call)
                self.workspace_per_thread = max(self.workspace_per_thread, plan.workspace_per_thread)
                calls.append((plan.names["entry"], st.call_buffers))
                emitted[_spec_key(st.gemm)] = plan.names["entry"]
            elif (st.conv is not None and st.conv.epilogue is None and st.conv.prologue is None
                  and _spec_key(st.conv) in emitted):
                calls.append((emitted[_spec_key(st.conv)], st.call_buffers))
            elif st.conv is not None:
                entry, _ = emit_conv2d_pass(self.m, st.conv, st.call)
                self.workspace_per_thread = max(self.workspace_per_thread, entry.workspace_per_thread)
                calls.append((entry.entry, st.call_buffers))
                emitted[_spec_key(st.conv)] = entry.entry
            else:
                calls.append((st.call, st.call_buffers))
            self.kernel_labels.setdefault(kernel_name(calls[-1][0]), st.label)
        groups = [[c] for c in calls] if step_entries else [calls]
        for g, group in enumerate(groups):
            self._emit_entry(f"{self.name}.step{g}" if step_entries else self.name, group)
        if step_entries:
            f = FunctionEmitter(self.m, self.name, [("ptr", "bufs"), ("ptr", "ws")])
            for g in range(len(groups)):
                f.call("void", f"@{self.name}.step{g}", [("ptr", "%bufs"), ("ptr", "%ws")])
            f.ret_void()
            f.finish()
        if guard is not None:
            self._emit_entry(f"{self.name}.guarded", calls, guard)
        return self.m.text()

    def _emit_entry(self, name: str, calls: list[tuple[str, list[int]]],
                    guard: tuple[int, int, str] | None = None) -> None:
        # The entry is straight-line glue, one call per step with its pointers: the lean pipeline
        # is all it needs, where O3 on the entry of a deep model's step (a function of megabytes
        # of IR, which no worker can split) took longer than all its kernels.
        f = FunctionEmitter(self.m, name, [("ptr", "bufs"), ("ptr", "ws")], ret="i32" if guard else "void",
                            pipeline="lean")

        def finished() -> None:
            if guard is None:
                f.ret_void()
            else:
                f.emit("ret i32 0")

        for position, (fn, bufs) in enumerate(calls):
            if guard is not None and position == guard[0]:
                t = LLVM_TYPE[guard[2]]
                value = f.load(t, f.load("ptr", f.gep("ptr", "%bufs", str(guard[1]))))
                stop, go_on = f.label("nan"), f.label("finite")
                f.cbr(not_finite(f, t, value), stop, go_on)
                f.block(stop)
                f.emit("ret i32 1")
                f.block(go_on)
            ptrs = [f.load("ptr", f.gep("ptr", "%bufs", str(b))) for b in bufs]
            if fn.startswith(("par:", "seq:")):
                mode, base, outer = fn.split(":")
                ctx = f.alloca(f"[{len(ptrs) + 1} x ptr]", "ctx", align=8)
                for i, p in enumerate(ptrs):
                    f.store("ptr", p, f.gep("ptr", ctx, str(i)))
                f.store("ptr", f"inttoptr (i64 {outer} to ptr)", f.gep("ptr", ctx, str(len(ptrs))))
                if mode == "par":
                    f.call("void", "@" + PARALLEL_FOR, [("ptr", f"@{base}.task"), ("ptr", ctx)])
                else:
                    f.call("void", f"@{base}.task", [("ptr", ctx), ("i32", "0"), ("i32", "1")])
            elif fn.startswith("chk:"):
                code = f.call("i32", "@" + fn[4:], [("ptr", p) for p in ptrs] + [("ptr", "%ws")])
                failed, go_on = f.label("failed"), f.label("ok")
                f.cbr(f.icmp("ne", code, 0, "i32"), failed, go_on)
                f.block(failed)
                finished()
                f.block(go_on)
            else:
                f.call("void", "@" + fn, [("ptr", p) for p in ptrs] + [("ptr", "%ws")])
        finished()
        f.finish()

    def _emit_elementwise(self, st: Step) -> tuple[str, list[int]]:
        out = st.out
        assert out is not None
        views = [out, *st.inputs, *(view for view, _ in st.outputs)]
        name = self.fresh("ew")
        # One pointer parameter per memory view, and per buffer that only the fused reductions
        # touch; a reduction reads the step's output through the pointer that writes it.
        buffers = [v.buffer for v in views if v.is_memory]
        for red in st.reductions:
            assert red.out is not None
            buffers += [v.buffer for v in (red.out, *red.inputs) if v.is_memory and v.buffer not in buffers]
        # A reduction the loop vectorizer widens needs several vector accumulators (interleaving,
        # in ``auto``): with one, its add latency bounds the pass. Interleaved, a loop shorter
        # than its unrolled vector body (a 7 x 7 plane) runs scalar, so where the step's own
        # innermost loop is at least a vector long, its reductions run by explicit vectors and
        # the pass by the streaming pipeline. A shorter innermost loop (the two columns of a
        # pooling window's gradient) needs ``auto``'s unrolling, and there the reductions are
        # left to it as well: measured, explicit vectors beside it cost the seed CNN's pooling
        # gradient pass twice its time.
        # With reductions the loops run over one slice of axis 0 at a time.
        shape, strides = collapse(out.shape[1:] if st.reductions else out.shape,
                                  [v.strides[1:] if st.reductions else v.strides for v in views])
        by_vectors = bool(st.reductions) and shape[-1] >= current_target().vector_width(BYTES[out.dtype]) \
            and all(reduces_by_vectors(red) for red in st.reductions)
        f = self.loop_function(name, len(buffers), pipeline="auto" if st.reductions and not by_vectors else "streaming")
        param = {b: f"%p{n}" for n, b in reversed(list(enumerate(buffers)))}
        ptrs = {i: f.gep(elem_type(v.dtype), param[v.buffer], str(v.offset))
                for i, v in enumerate(views) if v.is_memory}
        int_copy = out.dtype in INT_TYPE  # an int result (a label array returned as is) is only copied
        if int_copy:
            assert len(st.inputs) == 1 and st.inputs[0].dtype == out.dtype and st.body is identity, \
                "int results can only be copies of int inputs"
        s = None if int_copy else Scalar(f, out.dtype)

        def nest(level: int, offs: list[str], shape: list[int], strides: list[list[int]], split: bool) -> None:
            if level == len(shape):
                if s is None:
                    it = INT_TYPE[out.dtype]
                    value = f.load(it, f.gep(it, ptrs[1], offs[1]))
                    f.store(it, value, f.gep(it, ptrs[0], offs[0]))
                    return
                vals = [load(s, v, ptrs.get(i + 1), offs[i + 1]) for i, v in enumerate(st.inputs)]
                # All values first: the outputs' bodies share the producers' terms, which LLVM
                # computes once, and no store comes between the loads and their uses.
                results = [st.body(s, vals), *(body(s, vals) for _, body in st.outputs)]
                first = 1 + len(st.inputs)
                for x, value in enumerate(results):
                    at = 0 if x == 0 else first + x - 1
                    f.store(s.t, value, f.gep(s.t, ptrs[at], offs[at]))
                return
            lo, hi = ("%lo", "%hi") if level == 0 and split else ("0", str(shape[level]))
            with f.loop(lo, hi, hint=f"e{level}") as i:
                nest(level + 1, [f.add(o, f.mul(i, st_[level])) for o, st_ in zip(offs, strides, strict=True)],
                     shape, strides, split)

        if not st.reductions:
            nest(0, ["0"] * len(views), shape, strides, True)
            outer = shape[0]
        else:
            # Slice by slice of axis 0: the step's loops over the slice, then each reduction of it.
            assert s is not None
            with f.loop("%lo", "%hi", hint="slice") as i:
                nest(0, [f.mul(i, v.strides[0]) for v in views], shape, strides, False)
                for red in st.reductions:
                    assert red.out is not None
                    red_views = [red.out, *red.inputs]
                    red_ptrs = {x: f.gep(elem_type(v.dtype), param[v.buffer], str(v.offset))
                                for x, v in enumerate(red_views) if v.is_memory}
                    emit_reduction(f, red, red_ptrs, [f.mul(i, v.strides[0]) for v in red_views], first_dim=1,
                                   by_vectors=by_vectors)
            outer = out.shape[0]
        f.ret_void()
        f.finish()
        return self._parallel_task(name, len(buffers), outer, out.size), buffers

    def _emit_reduce(self, st: Step) -> tuple[str, list[int]]:
        """A reduction as loops over merged runs of kept and of reduced axes (:func:`emit_reduction`),
        the outermost kept run split over threads."""
        assert st.out is not None
        views = [st.out, *st.inputs]
        mem = [i for i, v in enumerate(views) if v.is_memory]
        name = self.fresh("red")
        f = self.loop_function(name, len(mem), pipeline="streaming")
        ptrs = {i: f.gep(elem_type(views[i].dtype), f"%p{n}", str(views[i].offset)) for n, i in enumerate(mem)}
        outer = emit_reduction(f, st, ptrs, ["0"] * len(views), first_dim=0)
        f.ret_void()
        f.finish()
        shape = st.inputs[0].shape
        work = math.prod(shape) if shape else 1
        return self._parallel_task(name, len(mem), outer, work), [views[i].buffer for i in mem]

    def compile(self) -> CompiledGraph:
        """Finish, compile (disk-cached) and wrap the entry for ctypes."""
        register_host_symbols()
        nthreads = pool().nthreads
        module = NativeModule(self.finish(), kernel_labels=self.kernel_labels)
        return CompiledGraph(module, self.name, self.workspace_per_thread * nthreads)


def _spec_key(spec: GemmSpec | ConvPass) -> tuple[object, ...]:
    """What identifies a GEMM's or conv pass's code: its spec, and a GEMM's alpha by its repr
    (the spec compares -0.0 and 0.0 equal)."""
    return (spec, repr(spec.alpha)) if isinstance(spec, GemmSpec) else (spec,)


def kernel_name(call: str) -> str:
    """The kernel a step's call tag names (``par:name:extent``, ``chk:name`` or ``name``)."""
    parts = call.split(":")
    return parts[1] if len(parts) > 1 else parts[0]


def _window_is_whole_input(g: Conv2dGeometry) -> bool:
    return (g.kh, g.kw) == (g.h, g.w) and g.pads == (0, 0, 0, 0) and g.dilation == (1, 1) and g.groups == 1


def _aligned(consumer: Step, k: int, producer: Step) -> tuple[View, list[View], list[View]] | None:
    """The elementwise ``consumer``'s output and inputs and the ``producer``'s inputs, where the
    consumer's input ``k`` is the producer's output: as they are, or all split into the finer of
    the two shapes (a pooling gradient's ``(oh, kh, ow, kw)`` read as ``(h, w)``); None where
    input ``k`` is another view of the buffer."""
    out, produced, read = consumer.out, producer.out, consumer.inputs[k]
    assert out is not None and produced is not None
    if read == produced:
        return out, list(consumer.inputs), list(producer.inputs)
    shape = max(produced.shape, read.shape, key=len)
    refined = [v.refine(shape) for v in (out, *consumer.inputs, produced, *producer.inputs)]
    views = [v for v in refined if v is not None]
    count = 1 + len(consumer.inputs)
    if len(views) != len(refined) or views[1 + k] != views[count]:
        return None
    return views[0], views[1:count], views[count + 1 :]


def _compose(outer: Body, k: int, inner: Body, n_inner: int) -> Body:
    """The consumer body with its ``k``-th input computed by ``inner`` from ``n_inner`` inputs."""

    def body(s: Scalar, vals: list[str]) -> str:
        produced = inner(s, vals[k : k + n_inner])
        return outer(s, [*vals[:k], produced, *vals[k + n_inner :]])

    return body


def _epilogue_body(consumer: Body, k: int, before: Body | None, n_before: int) -> Body:
    """The body of a GEMM epilogue over ``[c, *earlier inputs, *consumer inputs]``: the consumer's
    body with its ``k``-th input the value of C after the ``before`` epilogue (``n_before`` inputs)."""

    def body(s: Scalar, vals: list[str]) -> str:
        c = before(s, vals[: 1 + n_before]) if before is not None else vals[0]
        rest = vals[1 + n_before :]
        return consumer(s, [*rest[:k], c, *rest[k:]])

    return body


def _plane_operand(v: View, shape: tuple[int, ...]) -> Operand | None:
    """A view of an NCHW convolution output's ``shape`` as the matrix (image, channel) x pixel;
    None for other shapes."""
    if v.shape != shape or len(shape) != 4:
        return None
    (n, c, h, w), (s0, s1, s2, s3) = v.shape, v.strides
    rows = IndexMap((n, c), (s0, s1), v.offset)
    if w == 1 or h == 1 or s2 == w * s3:
        return Operand(rows, IndexMap.strided(h * w, s2 if w == 1 else s3))
    return Operand(rows, IndexMap((h, w), (s2, s3)))


def _operand(v: View) -> Operand:
    """A 2-D view as a GEMM operand: the view's offset is the row map's base."""
    (m, n), (rs, cs) = v.shape, v.strides
    return Operand(IndexMap.strided(m, rs, v.offset), IndexMap.strided(n, cs))


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


__all__ = ["BYTES", "CONSTANT", "IOTA", "Body", "CompiledGraph", "KernelBuilder", "Scalar", "Step", "View"]
