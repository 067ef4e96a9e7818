"""Generic tensor layers: slice, pad, reduce, broadcasting arithmetic, log-softmax, clip, resize, ...

The layers in :mod:`opgrad.nn.layers` are the building blocks of a model one writes by hand.
An imported graph (ONNX, Keras) also holds plain tensor operations between them: a reshape
before a dense layer, a constant scale, a channel slice. These layers express such operations
as ordinary model layers, so an imported model trains, checkpoints and exports like any other
(``Reshape``, ``Permute`` and ``Softmax`` live with Keras' names in :mod:`opgrad.nn.reshaping` and
:mod:`opgrad.nn.layers`).

As everywhere in ``opgrad.nn``, shapes are per example and an ``axis`` counts the batch axis as
0; none of these layers may move, reduce or slice the batch axis.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from opgrad import ops
from opgrad.ir import Const, Expr
from opgrad.nn.init import zeros
from opgrad.nn.layers import ForwardContext, Layer, ParamSpec, Softmax, as_int

__all__ = [
    "ARITHMETIC",
    "UNARY",
    "Arithmetic",
    "BroadcastingLayer",
    "Clip",
    "Elementwise",
    "GlobalPool2D",
    "LogSoftmax",
    "Pad",
    "Reduce",
    "Resize",
    "Slice",
    "Unary",
    "Where",
]

Shape = tuple[int, ...]
#: The binary operations of :class:`Elementwise` and :class:`Arithmetic`; ``greater`` gives a float
#: 0/1 mask (what an imported graph's comparisons become, for :class:`Where` and arithmetic).
ARITHMETIC = ("add", "subtract", "multiply", "divide", "maximum", "minimum", "greater")
#: The registered one-input operators :class:`Unary` applies.
UNARY = ("abs", "erf", "exp", "log", "negative", "rsqrt", "sqrt", "square")


def _example_axis(axis: int, rank: int, what: str) -> int:
    """``axis`` (batch axis = 0, negative from the end) of a rank-``rank`` batch, as a per-example index."""
    if not -rank <= axis < rank or axis % rank == 0:
        raise ValueError(f"{what} {axis} must name a non-batch axis: 1..{rank - 1} or -{rank - 1}..-1")
    return axis % rank - 1


def _binary(op: str, a: Expr, b: Expr) -> Expr:
    return getattr(ops, op)(a, b)  # type: ignore[no-any-return]


def _broadcast(shapes: Sequence[Shape]) -> Shape | None:
    try:
        return tuple(int(d) for d in np.broadcast_shapes(*shapes))
    except ValueError:
        return None




class BroadcastingLayer(Layer):
    """A layer of several inputs that numpy broadcasting combines (their batch axes align)."""

    multi_input = True

    def broadcast_shape(self, input_shape: list[Shape]) -> Shape:
        """The shape the inputs broadcast to: of one rank, numpy's rules."""
        if len({len(s) for s in input_shape}) != 1:
            raise self._shape_error(input_shape, f"{type(self).__name__} needs inputs of one rank (the batch axes "
                                                 "align)")
        shape = _broadcast(input_shape)
        if shape is None:
            raise self._shape_error(input_shape, "the shapes do not broadcast together")
        return shape


class Elementwise(BroadcastingLayer):
    """``op`` of two or more inputs with numpy broadcasting of their per-example shapes (equal ranks).

    ``op`` is one of :data:`ARITHMETIC`; several inputs fold from the left (``(a - b) - c``).
    """

    kind = "elementwise"

    def __init__(self, op: str, *, name: str | None = None) -> None:
        super().__init__(name)
        if op not in ARITHMETIC:
            raise ValueError(f"Elementwise op must be one of {ARITHMETIC}, got {op!r}")
        self.op = op

    def get_config(self) -> dict[str, Any]:
        return {"op": self.op}

    def config(self) -> str:
        return self.op

    def output_shape_for(self, input_shape: list[Shape]) -> Shape:
        return self.broadcast_shape(input_shape)

    def apply(self, x: list[Expr], params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        out = x[0]
        for other in x[1:]:
            out = _binary(self.op, out, other)
        return out


def _fixed_value(value: float | str | None, what: str) -> float | None:
    """A fixed branch of :class:`Where`: a number, infinities included (as JSON keeps them, "inf")."""
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"Where {what} must be a number (or None for an input), got {value!r}") from None
    if math.isnan(number):
        raise ValueError(f"Where {what} must not be NaN")
    return number


class Where(BroadcastingLayer):
    """``on_true where condition != 0 else on_false`` (numpy.where with a float 0/1 mask, numpy
    broadcasting of the per-example shapes). The inputs are ``[condition, on_true, on_false]``
    less a branch given as a fixed number: ``true_value`` or ``false_value``, infinities allowed
    (PyTorch's ``masked_fill(mask, -inf)``, an imported ONNX ``Where``).
    """

    kind = "where"

    def __init__(self, true_value: float | str | None = None, false_value: float | str | None = None, *,
                 name: str | None = None) -> None:
        super().__init__(name)
        self.true_value = _fixed_value(true_value, "true_value")
        self.false_value = _fixed_value(false_value, "false_value")

    @property
    def input_count(self) -> int:
        return 1 + (self.true_value is None) + (self.false_value is None)

    @property
    def multi_input(self) -> bool:  # type: ignore[override]  # both branches fixed: the condition alone
        return self.input_count > 1

    def get_config(self) -> dict[str, Any]:
        # JSON has no infinity: an infinite branch is stored as the string "inf" or "-inf".
        def stored(value: float | None) -> float | str | None:
            return value if value is None or math.isfinite(value) else str(value)

        return {"true_value": stored(self.true_value), "false_value": stored(self.false_value)}

    def config(self) -> str:
        return f"{'x' if self.true_value is None else f'{self.true_value:g}'}, " \
               f"{'y' if self.false_value is None else f'{self.false_value:g}'}"

    def output_shape_for(self, input_shape: list[Shape] | Shape) -> Shape:
        if not self.multi_input:
            return tuple(input_shape)  # type: ignore[arg-type]
        assert isinstance(input_shape, list)
        if len(input_shape) != self.input_count:
            given = " and the branches not given as numbers" if self.input_count > 1 else ""
            raise self._shape_error(input_shape, f"Where takes {self.input_count} input(s) (the condition{given})")
        return self.broadcast_shape(input_shape)

    def apply(self, x: list[Expr] | Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        x = x if isinstance(x, list) else [x]
        condition, branches = x[0], iter(x[1:])
        on_true = next(branches) if self.true_value is None else Const(np.asarray(self.true_value, x[0].dtype))
        on_false = next(branches) if self.false_value is None else Const(np.asarray(self.false_value, x[0].dtype))
        return ops.where(condition, on_true, on_false)


class Unary(Layer):
    """A registered one-input operator ``op`` (one of :data:`UNARY`) on every element: what an
    imported graph holds between layers (ONNX's Abs, Erf, Exp, Log, Neg, Sqrt)."""

    kind = "unary"

    def __init__(self, op: str, *, name: str | None = None) -> None:
        super().__init__(name)
        if op not in UNARY:
            raise ValueError(f"Unary op must be one of {UNARY}, got {op!r}")
        self.op = op

    def get_config(self) -> dict[str, Any]:
        return {"op": self.op}

    def config(self) -> str:
        return self.op

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        return getattr(ops, self.op)(x)  # type: ignore[no-any-return]


class Arithmetic(Layer):
    """``x op w`` (or ``w op x`` with ``reverse``) with a constant ``w`` broadcast against each example.

    ``w`` is a trainable parameter ``"operand"`` of ``operand_shape`` when ``operand`` is None (an
    imported weight), else the fixed value ``operand`` (a number or nested list, kept in the model
    description). ``w`` broadcasts against the per-example shape (numpy rules, aligned right).
    """

    kind = "arithmetic"

    def __init__(self, op: str, *, operand_shape: Sequence[int] | None = None, operand: Any = None,
                 reverse: bool = False, name: str | None = None) -> None:
        super().__init__(name)
        if op not in ARITHMETIC:
            raise ValueError(f"Arithmetic op must be one of {ARITHMETIC}, got {op!r}")
        if (operand_shape is None) == (operand is None):
            raise ValueError("Arithmetic takes either operand_shape (a trainable operand) or operand (a fixed one)")
        self.op, self.reverse = op, bool(reverse)
        self.operand = None if operand is None else np.asarray(operand, dtype=np.float64)
        if self.operand is not None and not np.all(np.isfinite(self.operand)):
            raise ValueError("Arithmetic operand must be finite")
        shape = self.operand.shape if self.operand is not None else operand_shape
        assert shape is not None
        self.operand_shape: Shape = tuple(as_int(d, "Arithmetic operand_shape") for d in shape)

    def get_config(self) -> dict[str, Any]:
        if self.operand is not None:
            return {"op": self.op, "operand": self.operand.tolist(), "reverse": self.reverse}
        return {"op": self.op, "operand_shape": list(self.operand_shape), "reverse": self.reverse}

    def config(self) -> str:
        what = f"{self.operand.item():g}" if self.operand is not None and self.operand.size == 1 else \
            f"{'w' if self.operand is None else 'c'}{list(self.operand_shape)}"
        return f"{what} {self.op} x" if self.reverse else f"x {self.op} {what}"

    def output_shape_for(self, input_shape: Shape) -> Shape:
        shape = _broadcast([input_shape, self.operand_shape]) if len(self.operand_shape) <= len(input_shape) else None
        if shape is None:
            raise self._shape_error(input_shape, f"operand {self.operand_shape} does not broadcast against each "
                                                 "example")
        return shape

    def param_specs(self) -> dict[str, ParamSpec]:
        return {} if self.operand is not None else {"operand": ParamSpec(self.operand_shape, zeros)}

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        w: Expr = params["operand"] if self.operand is None else Const(self.operand.astype(x.dtype))
        return _binary(self.op, w, x) if self.reverse else _binary(self.op, x, w)



class LogSoftmax(Softmax):
    """``x - log(sum(exp(x)))`` along ``axis`` (batch axis = 0; default the last): ``nn.Softmax``'s log."""

    kind = "logsoftmax"

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        return ops.log_softmax(x, axis=self.axis % x.ndim)


class Clip(Layer):
    """``min(max(x, min_value), max_value)``; either bound may be None.

    The gradient is 1 strictly between the bounds and 0 at and beyond them, as PyTorch's
    ``hardtanh`` and ``relu6`` (which ONNX exports as ``Clip`` too); ``torch.clamp`` passes it at
    the bounds as well, so the two differ only where an input equals a bound."""

    kind = "clip"

    def __init__(self, min_value: float | None = None, max_value: float | None = None, *,
                 name: str | None = None) -> None:
        super().__init__(name)
        self.min_value = None if min_value is None else float(min_value)
        self.max_value = None if max_value is None else float(max_value)
        if self.min_value is not None and self.max_value is not None and self.min_value > self.max_value:
            raise ValueError(f"Clip min_value {min_value} is above max_value {max_value}")

    def get_config(self) -> dict[str, Any]:
        return {"min_value": self.min_value, "max_value": self.max_value}

    def config(self) -> str:
        return f"{self.min_value}, {self.max_value}"

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        return ops.clip(x, lo=self.min_value, hi=self.max_value)


class Pad(Layer):
    """``numpy.pad`` of each example: ``pads`` is one ``(before, after)`` per axis (batch excluded).

    ``mode`` is ``"constant"`` (filled with ``value``, which may be ``-inf`` before a max pool),
    ``"reflect"`` or ``"edge"``.
    """

    kind = "pad"

    def __init__(self, pads: Sequence[Sequence[int]], *, mode: str = "constant", value: float = 0.0,
                 name: str | None = None) -> None:
        super().__init__(name)
        self.pads = tuple((as_int(p[0], "Pad pads"), as_int(p[1], "Pad pads")) for p in pads)
        if not self.pads or any(min(p) < 0 for p in self.pads):
            raise ValueError(f"Pad pads must be one (before, after) pair of ints >= 0 per axis, got {pads!r}")
        if mode not in ("constant", "reflect", "edge"):
            raise ValueError(f"Pad mode must be 'constant', 'reflect' or 'edge', got {mode!r}")
        self.mode, self.value = mode, float(value)

    def get_config(self) -> dict[str, Any]:
        # JSON has no infinity: a -inf fill is stored as the string "-inf".
        value: float | str = self.value if math.isfinite(self.value) else str(self.value)
        return {"pads": [list(p) for p in self.pads], "mode": self.mode, "value": value}

    def config(self) -> str:
        return f"{[list(p) for p in self.pads]}, {self.mode}"

    def output_shape_for(self, input_shape: Shape) -> Shape:
        if len(input_shape) != len(self.pads):
            raise self._shape_error(input_shape, f"{len(self.pads)} pad pairs need rank {len(self.pads)} examples")
        if self.mode == "reflect" and any(max(p) >= d for p, d in zip(self.pads, input_shape)):
            raise self._shape_error(input_shape, "reflect padding must be smaller than the axis it mirrors")
        return tuple(d + a + b for d, (a, b) in zip(input_shape, self.pads))

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        return ops.pad(x, pad_width=((0, 0), *self.pads), mode=self.mode, value=self.value)


class Slice(Layer):
    """``x[begin[0]:end[0]:steps[0], ...]`` of each example (numpy slicing; None is a default bound)."""

    kind = "slice"

    def __init__(self, begin: Sequence[int | None], end: Sequence[int | None],
                 steps: Sequence[int | None] | None = None, *, name: str | None = None) -> None:
        super().__init__(name)
        self.begin = tuple(None if b is None else as_int(b, "Slice begin") for b in begin)
        self.end = tuple(None if e is None else as_int(e, "Slice end") for e in end)
        self.steps = tuple(1 if s is None else as_int(s, "Slice steps") for s in (steps or [1] * len(self.begin)))
        if not len(self.begin) == len(self.end) == len(self.steps) or 0 in self.steps:
            raise ValueError(f"Slice needs one begin, end and non-zero step per axis, got {begin}, {end}, {steps}")

    def get_config(self) -> dict[str, Any]:
        return {"begin": list(self.begin), "end": list(self.end), "steps": list(self.steps)}

    def config(self) -> str:
        return ", ".join(f"{'' if b is None else b}:{'' if e is None else e}" + (f":{s}" if s != 1 else "")
                         for b, e, s in zip(self.begin, self.end, self.steps))

    def output_shape_for(self, input_shape: Shape) -> Shape:
        if len(self.begin) > len(input_shape):
            raise self._shape_error(input_shape, f"{len(self.begin)} sliced axes need rank >= {len(self.begin)}")
        out = list(input_shape)
        for axis, (b, e, s) in enumerate(zip(self.begin, self.end, self.steps)):
            out[axis] = len(range(*slice(b, e, s).indices(input_shape[axis])))
        if 0 in out:
            raise self._shape_error(input_shape, f"slice [{self.config()}] selects nothing")
        return tuple(out)

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        return ops.strided_slice(x, begin=(None, *self.begin), end=(None, *self.end), strides=(1, *self.steps))


class Reduce(Layer):
    """``mean``, ``sum`` or ``max`` over ``axes`` (batch axis = 0, which cannot be reduced)."""

    kind = "reduce"

    def __init__(self, op: str, axes: Sequence[int], *, keepdims: bool = True, name: str | None = None) -> None:
        super().__init__(name)
        if op not in ("mean", "sum", "max"):
            raise ValueError(f"Reduce op must be 'mean', 'sum' or 'max', got {op!r}")
        self.op, self.axes, self.keepdims = op, tuple(as_int(a, "Reduce axes") for a in axes), bool(keepdims)
        if not self.axes:
            raise ValueError("Reduce needs at least one axis")

    def get_config(self) -> dict[str, Any]:
        return {"op": self.op, "axes": list(self.axes), "keepdims": self.keepdims}

    def config(self) -> str:
        return f"{self.op} {list(self.axes)}"

    def _example_axes(self, rank: int) -> tuple[int, ...]:
        return tuple(sorted({_example_axis(a, rank + 1, "axis") for a in self.axes}))

    def output_shape_for(self, input_shape: Shape) -> Shape:
        try:
            axes = self._example_axes(len(input_shape))
        except ValueError as exc:
            raise self._shape_error(input_shape, str(exc)) from None
        if self.keepdims:
            return tuple(1 if i in axes else d for i, d in enumerate(input_shape))
        out = tuple(d for i, d in enumerate(input_shape) if i not in axes)
        if not out:
            raise self._shape_error(input_shape, "reducing every axis needs keepdims=True (a model keeps an axis)")
        return out

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        axes = tuple(a + 1 for a in self._example_axes(x.ndim - 1))
        return getattr(ops, self.op)(x, axis=axes, keepdims=self.keepdims)  # type: ignore[no-any-return]


class GlobalPool2D(Layer):
    """``(C, H, W) -> (C, 1, 1)``: each channel's mean (``"avg"``) or maximum (``"max"``), axes kept
    (ONNX's ``GlobalAveragePool``; :class:`~opgrad.nn.GlobalAvgPool2D` drops them)."""

    kind = "globalpool"

    def __init__(self, op: str = "avg", *, name: str | None = None) -> None:
        super().__init__(name)
        if op not in ("avg", "max"):
            raise ValueError(f"GlobalPool2D op must be 'avg' or 'max', got {op!r}")
        self.op = op

    def get_config(self) -> dict[str, Any]:
        return {"op": self.op}

    def config(self) -> str:
        return self.op

    def output_shape_for(self, input_shape: Shape) -> Shape:
        if len(input_shape) != 3:
            raise self._shape_error(input_shape, "GlobalPool2D needs (channels, height, width)")
        return (input_shape[0], 1, 1)

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        return ops.global_avg_pool2d(x) if self.op == "avg" else ops.global_max_pool2d(x)


class Resize(Layer):
    """``(C, H, W) -> (C, *size)`` by ``"nearest"`` (PyTorch's legacy nearest) or ``"bilinear"``
    interpolation, as ``torch.nn.functional.interpolate`` (``align_corners`` for bilinear only)."""

    kind = "resize"

    def __init__(self, size: Sequence[int], *, method: str = "nearest", align_corners: bool = False,
                 name: str | None = None) -> None:
        super().__init__(name)
        self.size = tuple(as_int(s, "Resize size") for s in size)
        if len(self.size) != 2 or min(self.size) < 1:
            raise ValueError(f"Resize size must be two positive ints (height, width), got {size!r}")
        if method not in ("nearest", "bilinear"):
            raise ValueError(f"Resize method must be 'nearest' or 'bilinear', got {method!r}")
        if align_corners and method != "bilinear":
            raise ValueError("Resize align_corners applies to bilinear interpolation only")
        self.method, self.align_corners = method, bool(align_corners)

    def get_config(self) -> dict[str, Any]:
        return {"size": list(self.size), "method": self.method, "align_corners": self.align_corners}

    def config(self) -> str:
        return f"{self.size[0]}x{self.size[1]}, {self.method}"

    def output_shape_for(self, input_shape: Shape) -> Shape:
        if len(input_shape) != 3:
            raise self._shape_error(input_shape, "Resize needs (channels, height, width)")
        return (input_shape[0], *self.size)

    def apply(self, x: Expr, params: Mapping[str, Expr], ctx: ForwardContext) -> Expr:
        return ops.resize(x, size=self.size, method=self.method, align_corners=self.align_corners)
