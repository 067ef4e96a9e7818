"""Strided views and the scalar expression emitter that elementwise bodies are written against.

A :class:`View` names memory by buffer *index* (a slot of the graph's pointer table), shape,
element strides and offset, so reshapes, transposes and broadcasts are views, not copies. Two
pseudo buffers cost no memory at all: :data:`IOTA` views yield their own index (how one_hot and
the cross-entropy select a class without using a label as an address) and :data:`CONSTANT` views
fold a scalar into the generated code.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from .irtext import BYTES, FAST, LLVM_TYPE, PRECISE, FunctionEmitter, ModuleEmitter, float_const, splat_const

#: Pseudo buffer of an index view: its element value is its own (flat, strided) offset.
IOTA = -1
#: Pseudo buffer of a scalar constant view: every element is ``View.value``, baked into the code.
CONSTANT = -2

INT_TYPE = {"int32": "i32", "int64": "i64"}
ELEMENT_BYTES = {**BYTES, "int32": 4, "int64": 8}


@dataclass(frozen=True)
class View:
    """A strided view into buffer ``buffer`` (index into the entry's pointer array), in elements.

    Two pseudo buffers need no memory: :data:`IOTA` views (:meth:`iota`) yield their index along
    an axis, :data:`CONSTANT` views (:meth:`scalar`) yield ``value`` everywhere.
    """

    buffer: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int = 0
    dtype: str = "float32"
    value: float | None = None

    @staticmethod
    def contiguous(buffer: int, shape: Sequence[int], dtype: str = "float32", offset: int = 0) -> View:
        return View(buffer, tuple(shape), row_major(shape), offset, dtype)

    @staticmethod
    def iota(shape: Sequence[int], axis: int) -> View:
        """The index along ``axis`` at every position of ``shape`` (e.g. the class column for one_hot)."""
        strides = tuple(1 if d == axis % len(shape) else 0 for d in range(len(shape)))
        return View(IOTA, tuple(shape), strides, 0, "index")

    @staticmethod
    def flat_index(shape: Sequence[int]) -> View:
        """The row-major flat index of every position of ``shape``, loaded as a raw ``i64`` (not
        converted to the body's float type, so it is exact at any size): the counter of a
        counter-based hash such as :meth:`Scalar.hash64`."""
        return View(IOTA, tuple(shape), row_major(shape), 0, "int64")

    @staticmethod
    def scalar(value: float, dtype: str, shape: Sequence[int] = ()) -> View:
        """A constant folded into the generated code (no load, no buffer)."""
        return View(CONSTANT, tuple(shape), (0,) * len(shape), 0, dtype, float(value))

    @property
    def constant(self) -> float:
        """The value of a :data:`CONSTANT` view, its sign kept (``x * -0.0`` is -0.0 where x > 0)."""
        if self.value is None:
            raise ValueError(f"not a constant view: {self}")
        return self.value

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def is_memory(self) -> bool:
        return self.buffer >= 0

    @property
    def is_contiguous(self) -> bool:
        """Row-major dense (dims of extent 1 may have any stride)."""
        return all(d == 1 or s == e for d, s, e in zip(self.shape, self.strides, row_major(self.shape), strict=True))

    def broadcast_to(self, shape: Sequence[int]) -> View:
        """Right-aligned numpy broadcasting expressed as 0-strides."""
        shape = tuple(shape)
        pad = len(shape) - len(self.shape)
        dims = (1,) * pad + self.shape
        strides = (0,) * pad + self.strides
        new = tuple(0 if d == 1 and s != 1 else st for d, s, st in zip(dims, shape, strides, strict=True))
        return replace(self, shape=shape, strides=new)

    def permute(self, axes: Sequence[int]) -> View:
        """numpy.transpose as a view: only the strides move."""
        return replace(self, shape=tuple(self.shape[a] for a in axes), strides=tuple(self.strides[a] for a in axes))

    @property
    def T(self) -> View:
        return self.permute(tuple(reversed(range(self.ndim))))

    def reshape(self, shape: Sequence[int]) -> View | None:
        """The same elements in row-major order under ``shape``; None if that needs a copy."""
        shape = tuple(shape)
        assert math.prod(shape) == self.size, f"cannot reshape {self.shape} to {shape}"
        if self.buffer == CONSTANT:
            return View.scalar(self.constant, self.dtype, shape)
        if not self.is_contiguous:
            return None
        return replace(self, shape=shape, strides=row_major(shape))

    def refine(self, shape: Sequence[int]) -> View | None:
        """This view under ``shape``, whose axes split this view's axes in order (``(H, W)`` as
        ``(H // kh, kh, W // kw, kw)``), at any strides; None where ``shape`` does not."""
        target, strides, at = tuple(shape), list[int](), 0
        for n, stride in zip(self.shape, self.strides, strict=True):
            start, at = at, at + 1
            while math.prod(target[start:at]) < n and at < len(target):
                at += 1
            if math.prod(target[start:at]) != n:
                return None
            inner = []
            for extent in reversed(target[start:at]):
                inner.append(stride)
                stride *= extent
            strides.extend(reversed(inner))
        return replace(self, shape=target, strides=tuple(strides)) if at == len(target) else None

    def as_matrix(self, rows: int, cols: int) -> View | None:
        """This view as ``rows x cols`` (its leading axes as the rows, the rest as the columns) where
        each side merges into one stride, a broadcast side into stride 0; None where one cannot."""
        for split in range(self.ndim + 1):
            if math.prod(self.shape[:split]) != rows or math.prod(self.shape[split:]) != cols:
                continue
            sides = [_merged_stride(self.shape[lo:hi], self.strides[lo:hi])
                     for lo, hi in ((0, split), (split, self.ndim))]
            if sides[0] is not None and sides[1] is not None:
                return replace(self, shape=(rows, cols), strides=(sides[0], sides[1]))
        return None

    def expand_dims(self, axis: int) -> View:
        """Insert a unit axis at ``axis`` (then :meth:`broadcast_to` can stretch it)."""
        axis = axis % (self.ndim + 1)
        return replace(self, shape=(*self.shape[:axis], 1, *self.shape[axis:]),
                       strides=(*self.strides[:axis], 0, *self.strides[axis:]))

    def along(self, axis: int, shape: Sequence[int]) -> View:
        """This 1-D view laid along ``axis`` of ``shape`` and broadcast over the other axes."""
        assert self.ndim == 1 and self.shape[0] == tuple(shape)[axis], f"{self.shape} along axis {axis} of {shape}"
        strides = tuple(self.strides[0] if d == axis else 0 for d in range(len(shape)))
        return replace(self, shape=tuple(shape), strides=strides)

    def pinned(self, axes: Sequence[int]) -> View:
        """This view with ``axes`` held at index 0 (stride 0): every position along them reads the first."""
        held = {a % self.ndim for a in axes}
        return replace(self, strides=tuple(0 if d in held else s for d, s in enumerate(self.strides)))

    def first_along(self, axes: Sequence[int]) -> View:
        """This view's elements at index 0 of ``axes``, which keep extent 1 (keepdims)."""
        held = {a % self.ndim for a in axes}
        return replace(self, shape=tuple(1 if d in held else n for d, n in enumerate(self.shape)))

    def element(self, index: Sequence[int]) -> View:
        """A 0-d view of one element (e.g. one scalar of a batch)."""
        off = self.offset + sum(i * s for i, s in zip(index, self.strides, strict=True))
        return replace(self, shape=(), strides=(), offset=off)


def _merged_stride(shape: Sequence[int], strides: Sequence[int]) -> int | None:
    """The one stride that walks ``shape`` in row-major order, or None (0 for an empty side)."""
    dims = [(n, st) for n, st in zip(shape, strides, strict=True) if n != 1]
    for (_, outer), (n, inner) in itertools.pairwise(dims):
        if outer != inner * n:
            return None
    return dims[-1][1] if dims else 0


def row_major(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(tuple(shape)):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


class Scalar:
    """Emits scalar float instructions for an elementwise body; values are SSA names or constants."""

    def __init__(self, f: FunctionEmitter, dtype: str) -> None:
        self.f = f
        self.dtype = dtype
        self.t = LLVM_TYPE[dtype]

    def const(self, value: float) -> str:
        return float_const(value, self.t)

    def _bin(self, op: str, a: str, b: str) -> str:
        return self.f.val(f"{op} {PRECISE} {self.t} {a}, {b}", op)

    def add(self, a: str, b: str) -> str:
        return self._bin("fadd", a, b)

    def accumulate(self, total: str, value: str) -> str:
        """``total + value`` in a reduction: reassociation allowed, so the loop vectorizes."""
        return self.f.val(f"fadd {FAST} {self.t} {total}, {value}", "acc")

    def sub(self, a: str, b: str) -> str:
        return self._bin("fsub", a, b)

    def mul(self, a: str, b: str) -> str:
        return self._bin("fmul", a, b)

    def div(self, a: str, b: str) -> str:
        return self._bin("fdiv", a, b)

    def neg(self, a: str) -> str:
        return self.f.val(f"fneg {self.t} {a}", "neg")

    def call(self, intrinsic: str, *args: str) -> str:
        """``llvm.<intrinsic>`` on this type: exp, log, sqrt, fabs, maxnum, minnum, tanh, ...
        (float32's exp is :meth:`exp`, in instructions that vectorize)."""
        if intrinsic == "exp" and self.dtype == "float32":
            return self.exp(args[0])
        fn = self.f.module.intrinsic(intrinsic, self.t, [self.t] * len(args), self._suffix())
        return self.f.call(self.t, fn, [(self.t, a) for a in args], hint=intrinsic)

    def _suffix(self) -> str:
        return _suffix(self.t)

    def _int_type(self) -> str:
        """The i32 type of this type's shape (``i32``, or a vector of them)."""
        return "i32"

    def exp(self, x: str) -> str:
        """e^x in float32 as instructions, no call: ``x = n ln2 + r`` (n = rint(x / ln2), ln2 in two
        parts, so r is exact to float32's rounding), e^r by its Taylor polynomial through r^7
        (|r| <= ln2 / 2: the next term is under 1e-8 of e^r), times 2^n built in exponent bits as
        two factors, so that n reaches from -150 (subnormal results, rounded once by the last
        multiply) to 128. Within 1 float32 ulp of e^x for normal results; 0 below -104, inf above
        88.72, NaN for NaN. The C library's expf is a call per element, which an LLVM vector exp
        becomes lane by lane."""
        it = self._int_type()
        ln2_hi, ln2_lo = 0.693359375, -2.12194440e-4  # ln2_hi has 9 bits: n * ln2_hi is exact
        n = self.call("rint", self.mul(x, self.const(1.4426950408889634)))
        n = self.call("maxnum", self.call("minnum", n, self.const(128.0)), self.const(-150.0))
        r = self.sub(self.sub(x, self.mul(n, self.const(ln2_hi))), self.mul(n, self.const(ln2_lo)))
        poly = self.const(1.0 / 5040.0)
        for coefficient in (1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0):
            poly = self.add(self.mul(poly, r), self.const(coefficient))
        whole = self.f.val(f"fptosi {self.t} {n} to {it}", "exp.n")
        half = self.f.val(f"ashr {it} {whole}, {self._int_const(1)}", "exp.half")
        value = poly
        for power in (half, self.f.val(f"sub {it} {whole}, {half}", "exp.rest")):  # each in [-75, 64]
            biased = self.f.val(f"add {it} {power}, {self._int_const(127)}", "exp.biased")
            bits = self.f.val(f"shl {it} {biased}, {self._int_const(23)}", "exp.bits")
            value = self.mul(value, self.f.val(f"bitcast {it} {bits} to {self.t}", "exp.scale"))
        value = self.select(self.cmp("olt", x, self.const(-104.0)), self.const(0.0), value)
        value = self.select(self.cmp("ogt", x, self.const(88.72283)), self.const(float("inf")), value)
        return self.select(self.cmp("uno", x, x), x, value)

    def high_bits(self, x: str, kept: int) -> str:
        """float32 ``x`` with all but the top ``kept`` of its 23 mantissa bits cleared: the square
        of a value kept to 11 (12 significant bits) is exact (``erfc``'s exp(-z^2) splits z so)."""
        it = self._int_type()
        bits = self.f.val(f"bitcast {self.t} {x} to {it}", "hi.bits")
        mask = self._int_const(-(1 << (23 - kept)))
        return self.f.val(f"bitcast {it} {self.f.val(f'and {it} {bits}, {mask}', 'hi.and')} to {self.t}", "hi")

    def _int_const(self, value: int) -> str:
        return str(value)

    def libm(self, name: str, *args: str) -> str:
        """The C math library's ``name`` on this type (``erf``/``erff``, ``log1p``/``log1pf``, ...).

        For functions without an LLVM intrinsic; their symbols are registered by ``register_host_symbols``.
        """
        fn = name + ("f" if self.t == "float" else "")
        ref = self.f.module.declare(fn, f"declare {self.t} @{fn}({', '.join([self.t] * len(args))})")
        return self.f.call(self.t, ref, [(self.t, a) for a in args], hint=name)

    def max(self, a: str, b: str) -> str:
        """NaN if either is NaN, as ``np.maximum`` (``maxnum`` would drop the NaN)."""
        return self.call("maximum", a, b)

    def min(self, a: str, b: str) -> str:
        """NaN if either is NaN, as ``np.minimum``."""
        return self.call("minimum", a, b)

    def cmp(self, pred: str, a: str, b: str) -> str:
        """Float compare (``olt``, ``ogt``, ``oeq``, ``une``, ...) -> i1."""
        return self.f.val(f"fcmp {pred} {self.t} {a}, {b}", "fc")

    def select(self, cond: str, a: str, b: str) -> str:
        return self.f.select(cond, self.t, a, b)

    def mask(self, cond: str) -> str:
        """An i1 as 1.0 / 0.0 of this type."""
        return self.f.val(f"uitofp i1 {cond} to {self.t}", "mask")

    def hash64(self, counter: str, key: int) -> str:
        """splitmix64 of an ``i64`` counter under ``key``, as an ``i64`` of well-mixed bits.

        ``z = key + counter * 0x9E3779B97F4A7C15``, then ``z ^= z >> 30; z *= 0xBF58476D1CE4E5B9;
        z ^= z >> 27; z *= 0x94D049BB133111EB; z ^= z >> 31``, all modulo 2**64 (logical shifts).
        Each element hashes its own counter, so the result needs no RNG state and does not depend on
        loop order or threads; a numpy twin of these lines gives bitwise the same bits.
        """
        f = self.f
        z = f.add(f.mul(counter, _i64(0x9E3779B97F4A7C15)), _i64(key))
        for shift, factor in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
            z = f.mul(f.val(f"xor i64 {z}, {f.val(f'lshr i64 {z}, {shift}', 'shr')}", "xor"), _i64(factor))
        return f.val(f"xor i64 {z}, {f.val(f'lshr i64 {z}, 31', 'shr')}", "hash")

    def icmp(self, pred: str, a: str, b: str | int) -> str:
        """Integer compare of ``i64`` values (``uge``, ``ult``, ``eq``, ...) -> i1."""
        return self.f.icmp(pred, a, _i64(b) if isinstance(b, int) else b)


class NotVectorizable(Exception):
    """A body uses an operation :class:`VectorScalar` has no lane-parallel form of."""


class VectorScalar(Scalar):
    """Emits a body on whole vectors of ``lanes`` elements: the same instructions on ``<lanes x t>``,
    so a kernel applies an elementwise body to values it holds in registers (a GEMM's finished
    tile) without storing and reloading them. Math library calls run lane by lane; integer work
    (counter hashing) raises :class:`NotVectorizable`, and the caller keeps its scalar loop."""

    def __init__(self, f: FunctionEmitter, dtype: str, lanes: int) -> None:
        super().__init__(f, dtype)
        self.element = self.t
        self.lanes = lanes
        self.t = f"<{lanes} x {self.element}>"

    def const(self, value: float) -> str:
        return splat_const(self.lanes, self.element, float_const(value, self.element))

    def _suffix(self) -> str:
        return f"v{self.lanes}{_suffix(self.element)}"

    def _int_type(self) -> str:
        return f"<{self.lanes} x i32>"

    def _int_const(self, value: int) -> str:
        return splat_const(self.lanes, "i32", str(value))

    def libm(self, name: str, *args: str) -> str:
        fn = name + ("f" if self.element == "float" else "")
        e = self.element
        ref = self.f.module.declare(fn, f"declare {e} @{fn}({', '.join([e] * len(args))})")
        out = "poison"
        for lane in range(self.lanes):
            xs = [self.f.val(f"extractelement {self.t} {a}, i32 {lane}", "lane") for a in args]
            y = self.f.call(e, ref, [(e, x) for x in xs], hint=name)
            out = self.f.val(f"insertelement {self.t} {out}, {e} {y}, i32 {lane}", "lanes")
        return out

    def cmp(self, pred: str, a: str, b: str) -> str:
        return self.f.val(f"fcmp {pred} {self.t} {a}, {b}", "fc")

    def select(self, cond: str, a: str, b: str) -> str:
        return self.f.val(f"select <{self.lanes} x i1> {cond}, {self.t} {a}, {self.t} {b}", "sel")

    def mask(self, cond: str) -> str:
        return self.f.val(f"uitofp <{self.lanes} x i1> {cond} to {self.t}", "mask")

    def hash64(self, counter: str, key: int) -> str:
        raise NotVectorizable("hash64")

    def icmp(self, pred: str, a: str, b: str | int) -> str:
        raise NotVectorizable("icmp")


def _i64(value: int) -> int:
    """An integer modulo 2**64 as the signed decimal LLVM reads for an i64 constant."""
    value %= 1 << 64
    return value - (1 << 64) if value >= 1 << 63 else value


def _suffix(t: str) -> str:
    return "f32" if t == "float" else "f64"


#: An elementwise body: given the Scalar emitter and the loaded inputs, return the output value.
Body = Callable[[Scalar, list[str]], str]


def identity(s: Scalar, v: list[str]) -> str:
    return v[0]


def body_vectorizes(body: Body, dtype: str, lanes: int, inputs: int) -> bool:
    """Whether ``body`` over ``inputs`` values has a form on whole vectors (:class:`VectorScalar`)."""
    probe = FunctionEmitter(ModuleEmitter("probe", function_attrs=""), "probe", [])
    try:
        body(VectorScalar(probe, dtype, lanes), [f"%v{i}" for i in range(inputs)])
    except NotVectorizable:
        return False
    return True


def elem_type(dtype: str) -> str:
    return LLVM_TYPE.get(dtype) or INT_TYPE[dtype]


def load(s: Scalar, v: View, ptr: str | None, off: str) -> str:
    """The value of ``v`` at element offset ``off``, as ``s``'s float type."""
    f = s.f
    if v.buffer == CONSTANT:
        return s.const(v.constant)
    if v.buffer == IOTA:
        if v.dtype == "int64":  # View.flat_index: the raw counter
            return f.add(off, v.offset)
        return f.val(f"sitofp i64 {f.add(off, v.offset)} to {s.t}", "idx")
    assert ptr is not None
    if v.dtype in INT_TYPE:
        it = INT_TYPE[v.dtype]
        return f.val(f"sitofp {it} {f.load(it, f.gep(it, ptr, off))} to {s.t}", "itof")
    t = LLVM_TYPE[v.dtype]
    val = f.load(t, f.gep(t, ptr, off))
    if t != s.t:
        val = f.val(f"{'fpext' if t == 'float' else 'fptrunc'} {t} {val} to {s.t}", "cvt")
    return val


def collapse(shape: tuple[int, ...], strides: list[tuple[int, ...]]) -> tuple[list[int], list[list[int]]]:
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
