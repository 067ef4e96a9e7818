"""The graph IR: variables, constants, operator calls and functions.

Expressions are immutable and typed at construction: building ``ops.conv2d(x, w)`` runs the
operator's shape rule at once, so a shape mistake is reported on the line that made it, naming
the operator, the inputs and the attributes (instead of a ``data != nullptr`` deep in a kernel).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np

from opgrad import ops
from opgrad.dtypes import ALL_DTYPES, FLOAT_DTYPES, TensorType, canonical_dtype
from opgrad.errors import OpCallError, OpInputTypeError

if TYPE_CHECKING:
    from opgrad.op import Input, Operator

_ids = itertools.count()


class Expr:
    """Base of all expressions. Supports ``+ - * / @`` and unary ``-`` through registered ops."""

    __slots__ = ("_uid", "type")
    type: TensorType
    # numpy defers its binary operators to ours (``array + expr`` calls ``__radd__``) instead of
    # broadcasting over the expression as an object and returning an array of expressions.
    __array_ufunc__ = None

    def __init__(self, type_: TensorType) -> None:
        self.type = type_
        self._uid = next(_ids)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.type.shape

    @property
    def dtype(self) -> str:
        return self.type.dtype

    @property
    def ndim(self) -> int:
        return self.type.ndim

    # Python operators build calls of the registered elementwise ops.
    def __add__(self, other: Any) -> Call:
        return ops.add(self, other)

    def __radd__(self, other: Any) -> Call:
        return ops.add(other, self)

    def __sub__(self, other: Any) -> Call:
        return ops.subtract(self, other)

    def __rsub__(self, other: Any) -> Call:
        return ops.subtract(other, self)

    def __mul__(self, other: Any) -> Call:
        return ops.multiply(self, other)

    def __rmul__(self, other: Any) -> Call:
        return ops.multiply(other, self)

    def __truediv__(self, other: Any) -> Call:
        return ops.divide(self, other)

    def __rtruediv__(self, other: Any) -> Call:
        return ops.divide(other, self)

    def __neg__(self) -> Call:
        return ops.negative(self)

    def __matmul__(self, other: Any) -> Call:
        """``a @ b`` for 2-D operands, as ``dense(a, transpose(b))``."""
        other = as_expr(other, like=self, who="'@': right operand")
        if self.ndim != 2 or other.ndim != 2:
            raise OpCallError(
                f"'@' needs two 2-D operands, got {self.type} @ {other.type}; "
                "use opgrad.ops.dense or reshape first"
            )
        return ops.dense(self, ops.transpose(other))

    def __rmatmul__(self, other: Any) -> Call:
        """``a @ b`` with ``a`` an array or scalar: the same as ``as_expr(a) @ b``."""
        return as_expr(other, like=self, who="'@': left operand") @ self

    @property
    def T(self) -> Call:
        return ops.transpose(self)

    def __bool__(self) -> bool:
        raise TypeError("an opgrad expression has no truth value; it is a graph node, not an array")

    def __hash__(self) -> int:
        return self._uid

    def __eq__(self, other: object) -> bool:  # identity: expressions are graph nodes
        return self is other


class Var(Expr):
    """A named input of a function."""

    __slots__ = ("name",)

    def __init__(self, name: str, type_: TensorType) -> None:
        super().__init__(type_)
        self.name = name

    def __repr__(self) -> str:
        return f"Var({self.name!r}, {self.type})"


class Const(Expr):
    """A constant array baked into the graph."""

    __slots__ = ("value",)

    def __init__(self, value: np.ndarray) -> None:
        value = np.array(value, copy=True)
        value.setflags(write=False)
        super().__init__(TensorType(value.shape, canonical_dtype(value.dtype)))
        self.value = value

    def __repr__(self) -> str:
        return f"Const({self.value.tolist() if self.value.size <= 4 else self.type})"


class Call(Expr):
    """An operator applied to argument expressions with attributes; typed by the op's rule."""

    __slots__ = ("args", "attrs", "op")

    def __init__(self, op: Operator, args: tuple[Expr, ...], attrs: Mapping[str, Any], type_: TensorType) -> None:
        super().__init__(type_)
        self.op = op
        self.args = args
        self.attrs: Mapping[str, Any] = MappingProxyType(dict(attrs))

    @property
    def specs(self) -> tuple[Input, ...]:
        """The input declaration of each argument (a variadic input repeated per tensor)."""
        return self.op.specs(len(self.args))

    def __repr__(self) -> str:
        return f"Call({self.op.name}, {self.type})"


class Function:
    """Parameters and one output expression or a tuple of them."""

    def __init__(self, params: Sequence[Var], output: Expr | Sequence[Expr]) -> None:
        self.params: tuple[Var, ...] = tuple(params)
        for p in self.params:
            if not isinstance(p, Var):
                raise TypeError(f"function parameters must be opgrad.var(...) variables, got {p!r}")
        names = [p.name for p in self.params]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"duplicate parameter name(s) {dup}; each parameter needs its own name")
        self.returns_tuple = not isinstance(output, Expr)
        self.outputs: tuple[Expr, ...] = (output,) if isinstance(output, Expr) else tuple(output)
        for out in self.outputs:
            if not isinstance(out, Expr):
                raise TypeError(f"function outputs must be opgrad expressions, got {out!r}")
        free = [v for v in free_vars(self.outputs) if v not in set(self.params)]
        if free:
            listed = ", ".join(f"{v.name}: {v.type}" for v in free)
            raise ValueError(f"the output uses variable(s) not among the parameters: {listed}")

    @property
    def output(self) -> Expr:
        if self.returns_tuple:
            raise ValueError("this function returns a tuple; use .outputs")
        return self.outputs[0]

    def __str__(self) -> str:
        return format_function(self)

    def __repr__(self) -> str:
        sig = ", ".join(f"{p.name}: {p.type}" for p in self.params)
        return f"<opgrad.Function ({sig}) -> {len(self.outputs)} output(s)>"


# ----- construction helpers -----



def var(name: str, shape: Sequence[int] | int, dtype: str = "float32") -> Var:
    """A function parameter with a static shape and dtype.

    ``shape`` holds integers >= 0 (Python or numpy; a single integer is a 1-D shape); a float,
    bool or negative dimension, or a tensor whose byte size overflows int64, is refused.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"variable name must be a non-empty string, got {name!r}")
    try:
        type_ = TensorType(shape, dtype)  # type: ignore[arg-type]  # validated and normalized here
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"opgrad.var({name!r}): {exc}") from None
    return Var(name, type_)


def describe_value(value: Any, limit: int = 60) -> str:
    """``str 'hello'``: a value's type and a shortened repr, for error messages."""
    text = repr(value)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(value).__name__} {text}"


def _numeric_array(value: Any, who: str, expected: str = "must be an opgrad expression or a numeric array/scalar",
                   ) -> np.ndarray:
    """``value`` as a numeric numpy array, or ``OpInputTypeError`` naming ``who`` and the value.

    Numbers, numpy arrays and scalars, (nested) lists and tuples of numbers, and objects with
    ``__array__`` are numeric; strings, None, dicts and arbitrary objects are not.
    """
    if isinstance(value, Function):
        raise OpInputTypeError(f"{who} {expected}, got an opgrad.Function; pass one of its expressions "
                               "(fn.output or fn.outputs[i]) instead")
    numeric = isinstance(value, (np.ndarray, np.generic, bool, int, float, complex, list, tuple)) or (
        hasattr(value, "__array__") and not isinstance(value, (str, bytes)))
    if not numeric:
        raise OpInputTypeError(f"{who} {expected}, got {describe_value(value)}")
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as exc:  # ragged nested lists
        raise OpInputTypeError(f"{who} {expected}, got {describe_value(value)} ({exc})") from None
    if arr.dtype.kind not in "biufc":
        raise OpInputTypeError(f"{who} {expected}, got {describe_value(value)} (numpy dtype {arr.dtype})")
    return arr


def const(value: Any, dtype: str | None = None) -> Const:
    """A constant; ``dtype`` defaults to the array's own (Python floats become float32)."""
    arr = _numeric_array(value, "opgrad.const: value", "must be a numeric array or scalar")
    if dtype is None and arr.dtype == np.float64 and not isinstance(value, np.ndarray):
        dtype = "float32"
    return Const(arr.astype(dtype) if dtype is not None else arr)


def as_expr(value: Any, *, like: Expr | None = None, who: str = "value") -> Expr:
    """Wrap Python numbers and arrays as constants; a float scalar takes the dtype of ``like``.

    ``who`` names the argument in errors (``"opgrad.ops.relu: input 'data'"``).
    """
    if isinstance(value, Expr):
        return value
    arr = _numeric_array(value, who)
    if like is not None and like.dtype in FLOAT_DTYPES and arr.dtype.kind in "fiub":
        with np.errstate(over="ignore"):
            narrowed = arr.astype(like.dtype)
        overflowed = np.isinf(narrowed) & np.isfinite(arr)
        if overflowed.any():
            raise OpCallError(f"{who}: the constant {describe_value(value)} takes the dtype {like.dtype} of the "
                              f"other inputs, whose range it leaves (|value| up to {np.abs(arr[overflowed]).max():g} "
                              f"would become inf); use a {arr.dtype} graph or values within {like.dtype}")
        return Const(narrowed)
    if arr.dtype == np.float64 and not isinstance(value, np.ndarray):
        return Const(arr.astype(np.float32))  # a bare Python float means the default dtype
    if arr.dtype.name not in ALL_DTYPES:
        raise OpInputTypeError(f"{who} has dtype {arr.dtype}, which opgrad does not support "
                               f"(expected one of {', '.join(ALL_DTYPES)}): got {describe_value(value)}")
    return Const(arr)


def make_call(op: Operator, args: Sequence[Any], attrs: Mapping[str, Any]) -> Call:
    """Build a typed call: wrap constants, normalize attributes, run the shape rule."""
    try:
        specs = op.specs(len(args))
    except ValueError as exc:
        shown = [a.type if isinstance(a, Expr) else describe_value(a) for a in args]
        raise op._call_error(shown, attrs, str(exc)) from None
    like = next((a for a in args if isinstance(a, Expr) and a.dtype in FLOAT_DTYPES), None)
    exprs: list[Expr] = []
    for i, a in enumerate(args):
        if isinstance(a, Expr):
            exprs.append(a)
            continue
        spec = specs[i]
        who = f"{op.qualified_name}: input {spec.name!r}"
        if spec.kind == "int":
            arr = _numeric_array(a, who)
            if arr.dtype.kind not in "iu":
                raise OpInputTypeError(f"{who} takes integers (int32 or int64), got {describe_value(a)} "
                                       f"(numpy dtype {arr.dtype})")
            exprs.append(Const(np.asarray(arr, dtype=np.int64)))
        else:
            exprs.append(as_expr(a, like=like, who=who))
    types = [e.type for e in exprs]
    norm = op.normalize_attrs(attrs, types)
    out_type = op.infer_type(types, norm)
    return Call(op, tuple(exprs), norm, out_type)


# ----- traversal -----


def children(node: Expr) -> tuple[Expr, ...]:
    return node.args if isinstance(node, Call) else ()


def topological_order(outputs: Iterable[Expr]) -> list[Expr]:
    """Every node reachable from ``outputs``, each after its arguments (iterative, no recursion limit)."""
    order: list[Expr] = []
    seen: set[int] = set()
    for root in outputs:
        stack: list[tuple[Expr, bool]] = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                order.append(node)
                continue
            if node._uid in seen:
                continue
            seen.add(node._uid)
            stack.append((node, True))
            for child in reversed(children(node)):
                if child._uid not in seen:
                    stack.append((child, False))
    return order


def free_vars(outputs: Iterable[Expr]) -> list[Var]:
    return [n for n in topological_order(outputs) if isinstance(n, Var)]


def calls(outputs: Iterable[Expr]) -> Iterator[Call]:
    return (n for n in topological_order(outputs) if isinstance(n, Call))


# ----- printing -----


def _format_attr(value: Any) -> str:
    if isinstance(value, float):
        return repr(value)
    return str(value) if not isinstance(value, str) else repr(value)


def format_function(fn: Function) -> str:
    """Text form, one line per call::

        fn(%x: float32[2, 3], %w: float32[4, 3]) {
          %0 = dense(%x, %w)  # float32[2, 4]
          return %0
        }
    """
    names: dict[int, str] = {p._uid: f"%{p.name}" for p in fn.params}
    lines = []
    counter = 0
    for node in topological_order(fn.outputs):
        if isinstance(node, Const):
            if node.value.ndim == 0:
                names[node._uid] = repr(node.value.item())
            else:
                names[node._uid] = f"const<{node.type}>"
        elif isinstance(node, Call):
            name = f"%{counter}"
            counter += 1
            names[node._uid] = name
            items = [names[a._uid] for a in node.args] + [f"{k}={_format_attr(v)}" for k, v in node.attrs.items()]
            lines.append(f"  {name} = {node.op.name}({', '.join(items)})  # {node.type}")
    sig = ", ".join(f"%{p.name}: {p.type}" for p in fn.params)
    ret = ", ".join(names[o._uid] for o in fn.outputs)
    if fn.returns_tuple:
        ret = f"({ret})"
    return "fn(" + sig + ") {\n" + "\n".join([*lines, f"  return {ret}"]) + "\n}"
