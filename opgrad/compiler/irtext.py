"""A small emitter of textual LLVM IR (opaque pointers, LLVM >= 17).

We write IR text rather than use ``llvmlite.ir`` because the kernels need vector GEPs, masked
gathers/scatters and fast-math flags on arbitrary instructions, all of which are one line of text.
Mutable values (loop counters, accumulators) live in entry-block allocas; SROA/mem2reg in the O3
pipeline turns them into registers, which keeps this emitter free of phi bookkeeping.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from .split import pipeline_attribute

#: LLVM scalar type for each supported numpy dtype name.
LLVM_TYPE = {"float32": "float", "float64": "double"}
BYTES = {"float32": 4, "float64": 8}

#: Fast-math flags of a reduction's accumulating add: reassociation lets it vectorize.
FAST = "reassoc nsz contract"
#: Flags of every other float operation: only fusing a * b + c into one FMA. Reassociating
#: ``(x - max) - log(sum)`` into ``x - (max + log(sum))`` would lose the digits a float32
#: log-softmax keeps at logits near 1e4, so elementwise arithmetic keeps the order it is written in.
PRECISE = "contract"


def float_const(value: float, llvm_type: str) -> str:
    """An exact textual constant: LLVM accepts floats only as decimal that round-trips, or hex doubles."""
    if llvm_type == "float":
        # Rounded as numpy casts: a value beyond float32's range is an infinity, as in the reference.
        with np.errstate(over="ignore"):
            value = float(np.float32(value))
    elif llvm_type != "double":
        raise ValueError(f"not a float type: {llvm_type}")
    bits = struct.unpack("<Q", struct.pack("<d", value))[0]
    return f"0x{bits:016X}"


def vec(n: int, elem: str) -> str:
    return f"<{n} x {elem}>"


@functools.lru_cache(maxsize=4096)  # kernels repeat a few constants thousands of times
def splat_const(n: int, elem: str, value: str) -> str:
    """A constant vector with every lane equal to the constant text ``value``."""
    return "<" + ", ".join(f"{elem} {value}" for _ in range(n)) + ">"


@functools.lru_cache(maxsize=1024)
def iota_const(n: int, elem: str = "i32", start: int = 0) -> str:
    return "<" + ", ".join(f"{elem} {start + i}" for i in range(n)) + ">"


@functools.lru_cache(maxsize=1024)
def prefix_mask(n: int, valid: int) -> str:
    """An ``<n x i1>`` constant, true in the first ``valid`` lanes: a masked load's or store's lanes."""
    return "<" + ", ".join(f"i1 {'true' if i < valid else 'false'}" for i in range(n)) + ">"


class ModuleEmitter:
    """Collects declarations, globals and function bodies of one LLVM module."""

    def __init__(self, name: str = "opgrad", function_attrs: str | None = None,
                 fused_multiply_add: bool | None = None) -> None:
        self.name = name
        if function_attrs is None or fused_multiply_add is None:
            from .target import current_target  # late import: irtext stays usable without llvmlite

            target = current_target()
            function_attrs = target.function_attrs if function_attrs is None else function_attrs
            fused_multiply_add = target.has_fma if fused_multiply_add is None else fused_multiply_add
        #: Attributes put on every function (e.g. keep 512-bit vectors unsplit on AVX-512 targets).
        self.function_attrs = function_attrs
        #: Whether :meth:`fma` may ask for a fused multiply-add (see there).
        self.fused_multiply_add = fused_multiply_add
        self._decls: dict[str, str] = {}
        self._globals: list[str] = []
        self._functions: list[str] = []
        self._names: set[str] = set()

    def declare(self, name: str, decl: str) -> str:
        """Declare an external or intrinsic function once; returns ``@name``."""
        self._decls.setdefault(name, decl)
        return "@" + name

    def intrinsic(self, base: str, ret: str, args: list[str], suffix: str) -> str:
        """Declare ``llvm.<base>.<suffix>`` with the given signature (intrinsics need hand declarations)."""
        name = f"llvm.{base}.{suffix}"
        return self.declare(name, f"declare {ret} @{name}({', '.join(args)})")

    def fma(self, ty: str) -> str:
        """``a * b + c`` for a scalar or vector float type: ``llvm.fma`` where the target fuses
        them in one instruction, else ``llvm.fmuladd``, a multiply and an add (``llvm.fma``
        demands the fused rounding and becomes a call to the C library's ``fmaf`` per element:
        the seed CNN step 17 times slower on an x86-64-v2 target)."""
        name = "fma" if self.fused_multiply_add else "fmuladd"
        return self.intrinsic(name, ty, [ty, ty, ty], _mangle(ty))

    def add_global(self, text: str) -> None:
        self._globals.append(text)

    def add_function(self, text: str) -> None:
        self._functions.append(text)

    def unique(self, base: str) -> str:
        """A function name not used before in this module."""
        name, i = base, 1
        while name in self._names:
            i += 1
            name = f"{base}.{i}"
        self._names.add(name)
        return name

    def merge(self, other: ModuleEmitter) -> None:
        """Add ``other``'s globals, declarations and functions, so two graphs become one module
        (their builders must have used different names, as an exported library's do)."""
        for name, decl in other._decls.items():
            if self._decls.setdefault(name, decl) != decl:
                raise ValueError(f"cannot merge modules: @{name} is declared differently")
        clash = self._names & other._names
        if clash:
            raise ValueError(f"cannot merge modules: both define {', '.join(sorted(clash))}")
        self._globals.extend(other._globals)
        self._functions.extend(other._functions)
        self._names |= other._names

    def text(self) -> str:
        parts = [f"; ModuleID = '{self.name}'", *self._globals, *self._decls.values(), *self._functions]
        return "\n".join(parts) + "\n"


@functools.lru_cache(maxsize=256)
def _mangle(ty: str) -> str:
    ty = ty.strip()
    if ty.startswith("<"):
        n, _, elem = ty[1:-1].partition(" x ")
        return f"v{n.strip()}{_mangle(elem)}"
    return {"float": "f32", "double": "f64", "i32": "i32", "i64": "i64", "i1": "i1", "ptr": "p0"}[ty]


_INT_BITS = {"i64": 64, "i32": 32}
#: First characters no integer literal has: SSA names, globals, vectors, ``true``/``false``/``poison``.
_NOT_LITERAL = frozenset("%@<tfpz")


def _integer(value: str | int) -> int | None:
    """``value`` as a Python int when it is an integer literal, else None (an SSA name, a vector)."""
    if isinstance(value, int):
        return value
    if value[:1] in _NOT_LITERAL:  # the common case, an SSA name or a vector, decided by its first character
        return None
    text = value.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    return None


def _both_constant(x: int | None, y: int | None, ty: str) -> tuple[int, int] | None:
    """Both operands when both are integer literals of a scalar integer type (foldable), else None."""
    return (x, y) if x is not None and y is not None and ty in _INT_BITS else None


def _wrap(value: int, ty: str) -> int:
    """Two's-complement wrap to ``ty``, as LLVM's arithmetic does."""
    bits = _INT_BITS[ty]
    return (value + (1 << (bits - 1))) % (1 << bits) - (1 << (bits - 1))


class FunctionEmitter:
    """Emits one function body. Values are SSA names (``%x``) or constant text."""

    def __init__(
        self,
        module: ModuleEmitter,
        name: str,
        params: list[tuple[str, str]],
        ret: str = "void",
        linkage: str = "",
        attrs: str = "nounwind",
        pipeline: str | None = None,
    ) -> None:
        """``pipeline`` names the optimization the function needs (see
        :func:`opgrad.compiler.split.pipeline_pieces`); None leaves the choice to its kernel's other
        functions."""
        self.module = module
        if pipeline is not None:
            attrs = f"{attrs} {pipeline_attribute(pipeline)}"
        self.name = name
        self.ret = ret
        self._header = (
            f"define {linkage + ' ' if linkage else ''}{ret} @{name}("
            + ", ".join(f"{t} %{n}" for t, n in params)
            + f") {attrs} {module.function_attrs} {{"
        )
        self._allocas: list[str] = []
        self._body: list[str] = []
        self._counter = 0
        self._terminated = False
        self.params = {n: f"%{n}" for _, n in params}

    # ----- naming and raw emission -----

    def fresh(self, hint: str = "t") -> str:
        self._counter += 1
        return f"%{hint}.{self._counter}"

    def emit(self, text: str) -> None:
        self._body.append("  " + text)

    def val(self, text: str, hint: str = "t") -> str:
        """Emit ``%name = text`` and return the name."""
        self._counter += 1  # fresh() and emit() inlined: this runs once per instruction
        name = f"%{hint}.{self._counter}"
        self._body.append(f"  {name} = {text}")
        return name

    def label(self, hint: str) -> str:
        self._counter += 1
        return f"{hint}.{self._counter}"

    def block(self, label: str) -> None:
        self._body.append(f"{label}:")

    def br(self, label: str) -> None:
        self.emit(f"br label %{label}")

    def cbr(self, cond: str, then: str, other: str) -> None:
        self.emit(f"br i1 {cond}, label %{then}, label %{other}")

    # ----- memory -----

    def alloca(self, ty: str, hint: str = "v", align: int = 0) -> str:
        name = self.fresh(hint)
        self._allocas.append(f"  {name} = alloca {ty}" + (f", align {align}" if align else ""))
        return name

    def var(self, ty: str, init: str, hint: str = "v") -> str:
        """An entry-block variable initialised here; read with :meth:`load`, write with :meth:`store`."""
        ptr = self.alloca(ty, hint)
        self.store(ty, init, ptr)
        return ptr

    def load(self, ty: str, ptr: str, align: int = 0, hint: str = "ld") -> str:
        return self.val(f"load {ty}, ptr {ptr}" + (f", align {align}" if align else ""), hint)

    def store(self, ty: str, value: str, ptr: str, align: int = 0) -> None:
        self.emit(f"store {ty} {value}, ptr {ptr}" + (f", align {align}" if align else ""))

    def gep(self, elem: str, ptr: str, index: str | int, index_ty: str = "i64", hint: str = "p") -> str:
        if _integer(index) == 0:
            return ptr
        return self.val(f"getelementptr inbounds {elem}, ptr {ptr}, {index_ty} {index}", hint)

    # ----- integer helpers (i64 unless told) -----
    # Constant operands are folded here: index arithmetic over compile-time shapes is mostly
    # ``x * 1``, ``0 + x`` and literals, and every such instruction left in the text is work for
    # the parser and for InstCombine, which took a fifth of a training step's optimization time.

    def add(self, a: str | int, b: str | int, ty: str = "i64") -> str:
        x, y = _integer(a), _integer(b)
        if x is None and y is None:
            return self.val(f"add {ty} {a}, {b}", "add")
        if (both := _both_constant(x, y, ty)) is not None:
            return str(_wrap(both[0] + both[1], ty))
        if y == 0:
            return str(a)
        if x == 0:
            return str(b)
        return self.val(f"add {ty} {a}, {b}", "add")

    def mul(self, a: str | int, b: str | int, ty: str = "i64") -> str:
        x, y = _integer(a), _integer(b)
        if x is None and y is None:
            return self.val(f"mul {ty} {a}, {b}", "mul")
        if (both := _both_constant(x, y, ty)) is not None:
            return str(_wrap(both[0] * both[1], ty))
        if y == 1:
            return str(a)
        if x == 1:
            return str(b)
        if (x == 0 or y == 0) and ty in _INT_BITS:
            return "0"
        return self.val(f"mul {ty} {a}, {b}", "mul")

    def sub(self, a: str | int, b: str | int, ty: str = "i64") -> str:
        x, y = _integer(a), _integer(b)
        if (both := _both_constant(x, y, ty)) is not None:
            return str(_wrap(both[0] - both[1], ty))
        if y == 0:
            return str(a)
        return self.val(f"sub {ty} {a}, {b}", "sub")

    def icmp(self, pred: str, a: str, b: str | int, ty: str = "i64") -> str:
        return self.val(f"icmp {pred} {ty} {a}, {b}", "c")

    def select(self, cond: str, ty: str, a: str, b: str) -> str:
        return self.val(f"select i1 {cond}, {ty} {a}, {ty} {b}", "sel")

    def smin(self, a: str, b: str | int, ty: str = "i64") -> str:
        return self.select(self.icmp("slt", a, b, ty), ty, a, str(b))

    def smax(self, a: str, b: str | int, ty: str = "i64") -> str:
        return self.select(self.icmp("sgt", a, b, ty), ty, a, str(b))

    def prefetch(self, ptr: str, byte_offset: str | int = 0, locality: int = 3) -> None:
        """Prefetch the line at ``ptr + byte_offset`` for reading, into L1 (``locality`` 3) or
        only into L2 (2). The address may lie past the object (so no ``inbounds``): a prefetch
        never faults."""
        fn = self.module.declare("llvm.prefetch.p0", "declare void @llvm.prefetch.p0(ptr, i32, i32, i32)")
        at = self.val(f"getelementptr i8, ptr {ptr}, i64 {byte_offset}", "pf") if byte_offset != 0 else ptr
        self.call("void", fn, [("ptr", at), ("i32", "0"), ("i32", str(locality)), ("i32", "1")])

    def splat(self, n: int, elem: str, scalar: str) -> str:
        """Broadcast a scalar value to all ``n`` lanes."""
        v = self.val(f"insertelement <{n} x {elem}> poison, {elem} {scalar}, i32 0", "ins")
        return self.val(
            f"shufflevector <{n} x {elem}> {v}, <{n} x {elem}> poison, <{n} x i32> zeroinitializer", "splat"
        )

    def call(
        self, ret: str, fn: str, args: list[tuple[str, str]], flags: str = "", hint: str = "call"
    ) -> str:
        arg_text = ", ".join(f"{t} {v}" for t, v in args)
        text = f"call {flags + ' ' if flags else ''}{ret} {fn}({arg_text})"
        if ret == "void":
            self.emit(text)
            return ""
        return self.val(text, hint)

    # ----- structured control flow -----

    @contextmanager
    def loop(self, lo: str | int, hi: str | int, step: int = 1, hint: str = "i") -> Iterator[str]:
        """``for (i = lo; i < hi; i += step)`` over i64; yields the induction value inside the body."""
        counter = self.var("i64", str(lo), hint + ".addr")
        head, body, done = self.label(hint + ".head"), self.label(hint + ".body"), self.label(hint + ".end")
        self.br(head)
        self.block(head)
        i = self.load("i64", counter, hint=hint)
        self.cbr(self.icmp("slt", i, hi), body, done)
        self.block(body)
        yield i
        self.store("i64", self.add(i, step), counter)
        self.br(head)
        self.block(done)

    @contextmanager
    def if_then(self, cond: str, hint: str = "if") -> Iterator[None]:
        then, done = self.label(hint + ".then"), self.label(hint + ".end")
        self.cbr(cond, then, done)
        self.block(then)
        yield
        self.br(done)
        self.block(done)

    def if_else(self, cond: str, hint: str = "ife") -> tuple[str, str, str]:
        """Start an if/else: returns (then, else, end) labels; caller emits blocks and branches."""
        then, other, done = self.label(hint + ".then"), self.label(hint + ".else"), self.label(hint + ".end")
        self.cbr(cond, then, other)
        return then, other, done

    def ret_void(self) -> None:
        self.emit("ret void")

    def finish(self) -> str:
        """Close the function and add it to the module; returns its text."""
        lines = [self._header, "entry:", *self._allocas, "  br label %body0", "body0:", *self._body, "}"]
        text = "\n".join(lines)
        self.module.add_function(text)
        return text


def not_finite(f: FunctionEmitter, t: str, value: str) -> str:
    """An ``i1``: whether the scalar ``value`` of float type ``t`` is NaN or infinite (``value -
    value`` is NaN exactly then; the emitter puts no fast-math flag on it that would let LLVM fold
    it to zero)."""
    difference = f.val(f"fsub {t} {value}, {value}")
    return f.val(f"fcmp uno {t} {difference}, {difference}")


def concatenate(f: FunctionEmitter, parts: list[str], width: int, t: str) -> str:
    """The ``width``-lane vectors ``parts`` side by side in one vector, padded with poison vectors
    to a power of two of them."""
    parts = parts + ["poison"] * ((1 << (len(parts) - 1).bit_length()) - len(parts))
    while len(parts) > 1:
        ty = f"<{width} x {t}>"
        order = "<" + ", ".join(f"i32 {i}" for i in range(2 * width)) + ">"
        parts = [f.val(f"shufflevector {ty} {parts[i]}, {ty} {parts[i + 1]}, <{2 * width} x i32> {order}", "cat")
                 for i in range(0, len(parts), 2)]
        width *= 2
    return parts[0]
