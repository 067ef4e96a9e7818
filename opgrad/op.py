"""Operator declarations.

An operator is declared once, in one file of ``registry/``::

    dense = Operator(
        "dense",
        inputs=[Input("data", dims=("N", "K")), Input("weight", dims=("U", "K"))],
        doc="Fully connected layer: data @ weight.T, weight shaped (units, in_features).",
        linear_in=("data", "weight"),
    )

    @dense.shape_rule
    def _dense_shape(data, weight, attrs): ...      # TensorTypes in, TensorType out

    @dense.reference
    def _dense_forward(data, weight): ...           # numpy, float32 and float64

    @dense.gradient
    def _dense_gradient(call, grad):
        '''d_data = grad @ weight ; d_weight = grad.T @ data'''
        ...

Everything else (the graph builders in ``opgrad.ops``, autodiff, the reference backend, the
compiler, the checker, ``opgrad ops``, the operator reference in the docs) reads the declaration.
"""

from __future__ import annotations

import inspect
import keyword
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from opgrad.dtypes import FLOAT_DTYPES, INT_DTYPES, TensorType
from opgrad.errors import OpCallError, ShapeError

if TYPE_CHECKING:  # types only: the compiler and the checker sit above this layer
    from opgrad.checks.strategies import CaseDraw
    from opgrad.compiler.views import View
    from opgrad.ir import Call, Expr

Attrs = Mapping[str, Any]
#: ``rule(call, grad) -> [expr | None per input]`` (see ``Operator.gradient``).
GradientRule = Callable[["Call", "Expr"], Sequence["Expr | None"]]
#: ``rule(*input_types, attrs) -> TensorType``: as many types as the call has inputs.
ShapeRule = Callable[..., TensorType]
#: ``lowering(kb, call, out, *inputs) -> View | None``: one ``View`` per input (see ``Operator.lowering``).
Lowering = Callable[..., "View | None"]
#: ``sampler(d) -> Case`` (see ``Operator.sampler``).
Sampler = Callable[["CaseDraw"], "Case"]
#: ``forward(*arrays, **attrs) -> ndarray``.
Reference = Callable[..., np.ndarray]
#: ``distance(inputs, attrs) -> float``: how far the inputs are from the nearest kink (see ``Kink``).
KinkDistance = Callable[[Sequence[np.ndarray], Attrs], float]
#: ``place(rng, inputs, attrs) -> inputs``: copies of the inputs moved onto kinks (see ``Kink``).
KinkPlacer = Callable[[np.random.Generator, list[np.ndarray], Attrs], list[np.ndarray]]
#: ``subgradient(inputs, cotangent, attrs) -> [array | None per input]`` at a kink (see ``Kink``).
Subgradient = Callable[[Sequence[np.ndarray], np.ndarray, Attrs], list[np.ndarray | None]]

_NO_DEFAULT = object()


@dataclass(frozen=True)
class Interval:
    """A closed interval of input values the checker may draw from."""

    low: float
    high: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.low) and math.isfinite(self.high) and self.low <= self.high):
            raise ValueError(f"Interval({self.low!r}, {self.high!r}): a domain needs finite bounds, low <= high")


DEFAULT_DOMAIN: tuple[Interval, ...] = (Interval(-2.0, 2.0),)


@dataclass(frozen=True)
class Input:
    """One operator input.

    ``kind`` is ``"float"`` (float32/float64, all float inputs of a call share one dtype) or
    ``"int"`` (int32/int64, e.g. class labels; never differentiable). ``dims`` names each axis
    with a symbol shared across inputs (``("N", "K")``) or an int; ``None`` means any shape.
    ``domain`` is where the checker draws values; ``int_range`` bounds an int input, given as
    ``(low, high_attr_or_symbol)``, e.g. labels in ``[0, C)``.
    ``differentiable=False`` says the op is piecewise constant or only reads the input's shape.
    ``variadic=True`` (the last input only) takes a list of one or more tensors, as
    ``concatenate(xs, axis)``; each becomes an argument of its own, named ``xs[0]``, ``xs[1]``, ...
    """

    name: str
    kind: str = "float"
    differentiable: bool = True
    dims: tuple[str | int, ...] | None = None
    domain: tuple[Interval, ...] = DEFAULT_DOMAIN
    int_range: tuple[int, str] | None = None
    doc: str = ""
    variadic: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("float", "int"):
            raise ValueError(f"input {self.name!r}: kind must be 'float' or 'int', got {self.kind!r}")
        if self.kind == "int" and self.differentiable:
            object.__setattr__(self, "differentiable", False)


@dataclass(frozen=True)
class Attr:
    """One operator attribute: a default, and a ``convert`` that normalizes and validates it.

    ``convert`` receives the user's value and returns the canonical value (e.g. an int stride
    becomes a pair) or raises ``ValueError`` saying what was expected.
    With ``uses_types=True`` it is called as ``convert(value, input_types, earlier_attrs)`` so
    that it can resolve values that depend on the inputs' ranks or on attributes declared before
    it (negative axes, ``None`` meaning all axes, a ``-1`` in a shape, strides defaulting to the
    pool size); the call then stores the resolved, canonical value.
    ``sample`` is a hypothesis strategy of values for the checker, or a function returning one
    (registry files use the function, so that they need not import hypothesis).

    ``Operator`` refuses, where it is declared, an attribute whose name repeats another
    attribute's or an input's (the reference takes both as arguments of one call) and a default
    its own ``convert`` rejects (a ``uses_types`` converter is only run on calls). A required
    attribute (no default) needs values the checker can draw: a ``sample``, or the op's
    ``@sampler`` choosing it; without either the check stops at once, naming the attribute.
    """

    name: str
    default: Any = _NO_DEFAULT
    convert: Callable[..., Any] | None = None
    doc: str = ""
    sample: Any = None
    uses_types: bool = False

    @property
    def required(self) -> bool:
        return self.default is _NO_DEFAULT


@dataclass(frozen=True)
class Kink:
    """Where an operator is not differentiable, and the subgradient convention it uses there.

    ``distance(inputs, attrs)`` returns how far the inputs are from the nearest kink (the
    checker keeps it above its margin so finite differences are valid).
    ``place(rng, inputs, attrs)`` returns inputs moved exactly onto kinks.
    ``subgradient(inputs, cotangent, attrs)`` is the numpy VJP the convention prescribes there.
    """

    convention: str
    distance: KinkDistance
    place: KinkPlacer | None = None
    subgradient: Subgradient | None = None


#: :attr:`GradientStatus.reason` of an operator with differentiable inputs whose declaration says
#: nothing about its gradient (neither ``@op.gradient`` nor ``op.gradient_not_implemented``).
NO_GRADIENT_DECLARED = "no gradient declared"


@dataclass(frozen=True)
class GradientStatus:
    """How ``opgrad ops`` reports an operator's gradient."""

    registered: bool
    reason: str = ""


class Operator:
    """A registered operator: declaration plus the rules attached with its decorators.

    Calling the operator builds a graph node: ``opgrad.ops.dense(x, w)`` returns a ``Call``
    whose type is inferred immediately, so a bad call fails where it is written.
    """

    def __init__(
        self,
        name: str,
        *,
        inputs: Sequence[Input],
        attrs: Sequence[Attr] = (),
        doc: str = "",
        linear_in: Sequence[str] = (),
        jointly_linear: bool = False,
        kinks: Kink | None = None,
        broadcast: bool = False,
    ) -> None:
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name) or name.startswith("_"):
            raise ValueError(f"operator name {name!r} must be a Python identifier not starting with '_' "
                             "(the operator becomes opgrad.ops.<name> and `opgrad check <name>`)")
        self.name = name
        self.inputs: tuple[Input, ...] = tuple(inputs)
        self.attrs: tuple[Attr, ...] = tuple(attrs)
        self.doc = doc
        self.linear_in: tuple[str, ...] = tuple(linear_in)
        self.jointly_linear = jointly_linear
        self.kinks = kinks
        self.broadcast = broadcast
        self._shape_rule: ShapeRule | None = None
        self._reference: Reference | None = None
        self._gradient: GradientRule | None = None
        self._gradient_reason = NO_GRADIENT_DECLARED
        self._lowering: Lowering | None = None
        self._lowering_reason = ""
        self._sampler: Sampler | None = None
        self._mutants: list[tuple[str, GradientRule]] = []
        #: Where the op is declared: a registry file's stem ("relu"), or a user's module ("mylib.ops").
        self.module: str = ""
        self._declared_outside_registry = False
        names = [i.name for i in self.inputs]
        if len(set(names)) != len(names):
            raise ValueError(f"operator {name!r}: duplicate input names {names}")
        for lin in self.linear_in:
            if lin not in names:
                raise ValueError(f"operator {name!r}: linear_in names unknown input {lin!r}")
        if any(spec.variadic for spec in self.inputs[:-1]):
            raise ValueError(f"operator {name!r}: only the last input may be variadic")
        self._check_attrs(names)
        declared_in = declaring_module(inspect.currentframe())
        if declared_in and not declared_in.startswith("opgrad.registry"):
            # An operator declared in a user's module is as first-class as one in registry/: it
            # joins opgrad.ops, the checker and the pytest plugin as soon as its module is imported.
            from opgrad import registry  # here, not at the top: the registry imports this module

            self.module = declared_in
            self._declared_outside_registry = True
            registry.register(self, module_run(inspect.currentframe(), declared_in))

    def _check_attrs(self, input_names: Sequence[str]) -> None:
        """Refuse attribute declarations that calls would trip over later, with errors that could
        no longer point at the declaration."""
        seen: set[str] = set()
        for attr in self.attrs:
            where = f"operator {self.name!r}: attribute {attr.name!r}"
            if attr.name in seen:
                raise ValueError(f"{where} is declared twice; attribute names must be unique "
                                 f"(attributes: {', '.join(a.name for a in self.attrs)})")
            seen.add(attr.name)
            if attr.name in input_names:
                raise ValueError(f"{where} has the name of an input; the reference is called as "
                                 f"reference(*inputs, **attrs), where it would collide with that input's "
                                 f"parameter (inputs: {', '.join(input_names)})")
            # A converter that reads the input types can only be run on a call; any other one must
            # accept its own default, or every call that leaves the attribute out fails.
            if attr.required or attr.convert is None or attr.uses_types:
                continue
            try:
                attr.convert(attr.default)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{where}: the default {attr.default!r} is rejected by the attribute's own "
                                 f"convert: {exc}") from None

    # ----- decorators used by registry files -----

    def shape_rule(self, fn: ShapeRule) -> ShapeRule:
        """Attach ``fn(*input_types, attrs) -> TensorType``; raise ``ShapeError`` on a bad call."""
        self._shape_rule = fn
        return fn

    def reference(self, fn: Reference) -> Reference:
        """Attach the numpy forward ``fn(*arrays, **attrs) -> ndarray``."""
        self._reference = fn
        return fn

    def gradient(self, fn: GradientRule) -> GradientRule:
        """Attach the gradient ``fn(call, grad) -> [expr | None per input]``.

        The result is a list even for a one-input op (``[expr]``); ``None`` stands for an input
        that is not differentiable.
        Each entry is built from registered ops. It may have the broadcast shape of the output;
        autodiff sums it back to the input's shape with ``collapse_sum_like``.
        """
        self._gradient = fn
        return fn

    def gradient_not_implemented(self, reason: str) -> None:
        """Declare, visibly, that this operator has no gradient (and why)."""
        self._gradient = None
        self._gradient_reason = reason

    def lowering(self, fn: Lowering) -> Lowering:
        """Attach the LLVM lowering used by ``opgrad.compile`` (see ``docs/compiler.md``).

        Calling convention: ``fn(kb, call, out, *inputs) -> View | None`` where ``kb`` is an
        ``opgrad.compiler.KernelBuilder``, ``call`` the graph node (read ``call.attrs``, shapes,
        dtypes), ``out`` a dense row-major ``View`` of the result buffer and ``inputs`` one
        ``View`` per operator input, in declaration order. Input views may be strided, broadcast
        (0-strides), constants folded into code (``kb.scalar``) or, for int inputs, int32/int64.
        Either write ``out`` with builder primitives (``kb.elementwise``, ``kb.map_reduce``,
        ``kb.matmul``, ``kb.conv2d_*``, ``kb.pool2d*``, ``kb.temporary`` for scratch) and return
        None, or return a view of an input (a reshape, a transpose, a broadcast) and write
        nothing. Handle float32 and float64 alike (the views carry the dtype). Never use an int
        input as an address: compare it with ``kb.iota`` instead. Keep the function in the
        op's registry file, right below its gradient (or sampler), with the formula as docstring.
        """
        self._lowering = fn
        return fn

    def lowering_not_implemented(self, reason: str) -> None:
        """Declare, visibly, that this operator is reference only: ``opgrad.evaluate`` runs it and
        ``opgrad.compile`` refuses it with ``reason`` (``opgrad ops`` says so in its kernel column)."""
        self._lowering = None
        self._lowering_reason = reason

    def sampler(self, fn: Sampler) -> Sampler:
        """Attach a case generator for ops whose shapes and attrs are tied together.

        Calling convention: ``fn(d) -> Case``. ``d`` is an ``opgrad.checks.CaseDraw``: every
        choice goes through it (``d.int(lo, hi)``, ``d.bool()``, ``d.choice(seq)``,
        ``d.shape(...)``, ``d.permutation(n)``, ``d.broadcastable_to(shape)``, ``d.draw(strategy)``)
        so that hypothesis records it and can shrink a failing case to a minimal one. Return
        ``Case(shapes=[one per input], attrs={...})``; the checker draws the values itself from
        each input's ``domain``. A case the shape rule rejects is a sampler bug and is reported
        as such; call ``d.reject()`` to discard a draw on purpose. Without a sampler the checker
        derives cases from ``dims``, ``broadcast`` and each ``Attr.sample``/default.
        Keep samplers in the op's file, below its gradient; registry files need not import
        hypothesis.
        """
        self._sampler = fn
        return fn

    def mutant(self, mistake: str) -> Callable[[GradientRule], GradientRule]:
        """Plant a deliberately wrong gradient that the checker must flag (``opgrad check --mutants``).

        ``mistake`` says in a few words what is wrong (``"1 - t instead of 1 - t^2"``); the rule has
        the gradient's calling convention. Keep mutants in the op's file, below its gradient: each
        one is a plausible slip, and the checker's power is measured by killing all of them.
        """

        def attach(fn: GradientRule) -> GradientRule:
            self._mutants.append((mistake, fn))
            return fn

        return attach

    # ----- queries -----

    @property
    def user_defined(self) -> bool:
        """Declared in a user's module rather than in opgrad's registry/."""
        return self._declared_outside_registry

    @property
    def qualified_name(self) -> str:
        """How errors name the op: ``opgrad.ops.relu``, or ``mylib.ops.my_op`` for a user's op."""
        return f"{self.module}.{self.name}" if self.user_defined else f"opgrad.ops.{self.name}"

    @property
    def source(self) -> str:
        """Where to edit the declaration: ``registry/relu.py`` or the user's module name."""
        return f"module {self.module}" if self.user_defined else f"registry/{self.module}.py"

    @property
    def mutants(self) -> tuple[tuple[str, GradientRule], ...]:
        """The planted wrong gradients: ``(mistake, rule)`` pairs."""
        return tuple(self._mutants)

    @property
    def gradient_rule(self) -> GradientRule | None:
        return self._gradient

    def declared_parts(self) -> dict[str, Callable[..., Any]]:
        """The functions of the declaration, by the part they play (``"shape rule"``,
        ``"reference"``, ``"gradient"``, ``"lowering"``, ``"sampler"``): for errors that name the
        part of a declaration that raised."""
        parts = {"shape rule": self._shape_rule, "reference": self._reference, "gradient": self._gradient,
                 "lowering": self._lowering, "sampler": self._sampler}
        return {part: fn for part, fn in parts.items() if fn is not None}

    @property
    def reference_fn(self) -> Reference:
        if self._reference is None:
            raise NotImplementedError(f"operator {self.name!r} has no numpy reference")
        return self._reference

    @property
    def lowering_fn(self) -> Lowering | None:
        return self._lowering

    @property
    def lowering_reason(self) -> str:
        """Why the operator has no lowering, when it is declared reference only; "" otherwise."""
        return self._lowering_reason

    @property
    def sampler_fn(self) -> Sampler | None:
        return self._sampler

    @property
    def gradient_status(self) -> GradientStatus:
        if self._gradient is not None:
            return GradientStatus(True)
        if not any(i.differentiable for i in self.inputs):
            return GradientStatus(False, "no differentiable inputs")
        return GradientStatus(False, self._gradient_reason)

    @property
    def variadic(self) -> bool:
        """Whether the last input takes a list of tensors."""
        return bool(self.inputs) and self.inputs[-1].variadic

    def specs(self, count: int) -> tuple[Input, ...]:
        """The input declaration of each of ``count`` arguments (a variadic input repeated).

        Raises ``ValueError`` when ``count`` arguments cannot fill the declared inputs.
        """
        if not self.variadic:
            if count != len(self.inputs):
                raise ValueError(self.count_problem(count))
            return self.inputs
        fixed, many = self.inputs[:-1], self.inputs[-1]
        if count < len(fixed) + 1:
            raise ValueError(self.count_problem(count))
        return fixed + tuple(replace(many, name=f"{many.name}[{i}]") for i in range(count - len(fixed)))

    def input(self, name: str) -> Input:
        for spec in self.inputs:
            if spec.name == name:
                return spec
        raise KeyError(f"operator {self.name!r} has no input {name!r}")

    # ----- building calls -----

    def normalize_attrs(self, given: Mapping[str, Any], arg_types: Sequence[TensorType]) -> dict[str, Any]:
        """Fill defaults, convert and validate attributes; unknown names are errors."""
        known = {a.name: a for a in self.attrs}
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise self._call_error(
                arg_types, dict(given),
                f"unknown attribute(s) {', '.join(unknown)}; "
                f"accepted: {', '.join(known) or 'none'}",
            )
        out: dict[str, Any] = {}
        for attr in self.attrs:
            if attr.name in given:
                value = given[attr.name]
            elif attr.required:
                raise self._call_error(arg_types, dict(given), f"missing required attribute {attr.name!r}")
            else:
                value = attr.default
            if attr.convert is not None:
                try:
                    value = attr.convert(value, arg_types, out) if attr.uses_types else attr.convert(value)
                except (ValueError, TypeError, ShapeError) as exc:
                    raise self._call_error(arg_types, dict(given), f"attribute {attr.name}={value!r}: {exc}") from None
            out[attr.name] = value
        return out

    def infer_type(self, arg_types: Sequence[TensorType], attrs: Mapping[str, Any]) -> TensorType:
        """Check input count, kinds and dtypes, then run the shape rule; errors carry context."""
        try:
            specs = self.specs(len(arg_types))
        except ValueError as exc:
            raise self._call_error(arg_types, attrs, str(exc)) from None
        float_dtypes = set()
        for spec, t in zip(specs, arg_types):
            allowed = FLOAT_DTYPES if spec.kind == "float" else INT_DTYPES
            if t.dtype not in allowed:
                raise self._call_error(
                    arg_types, attrs, f"input {spec.name!r} has dtype {t.dtype}; expected one of {', '.join(allowed)}"
                )
            if spec.kind == "float":
                float_dtypes.add(t.dtype)
        if len(float_dtypes) > 1:
            raise self._call_error(
                arg_types, attrs,
                "float inputs mix dtypes " + ", ".join(sorted(float_dtypes))
                + "; opgrad never promotes implicitly, cast one side first",
            )
        if self._shape_rule is None:
            raise NotImplementedError(f"operator {self.name!r} has no shape rule")
        try:
            result = self._shape_rule(*arg_types, attrs)
        except ShapeError as exc:
            raise self._call_error(arg_types, attrs, str(exc)) from None
        if not isinstance(result, TensorType):
            raise TypeError(f"shape rule of {self.name!r} returned {result!r}, not a TensorType")
        return result

    def count_problem(self, given: int) -> str:
        """The problem text of a call with ``given`` inputs instead of the declared number."""
        if self.variadic:
            fixed = [i.name for i in self.inputs[:-1]]
            many = self.inputs[-1].name
            listed = ", ".join([*fixed, f"{many} (a list of at least one tensor)"])
            return (f"expected {len(fixed)} input(s) and a non-empty list ({listed}), "
                    f"got {given - len(fixed)} in the list")
        return f"expected {len(self.inputs)} input(s) ({', '.join(i.name for i in self.inputs)}), got {given}"

    def _call_error(self, arg_types: Sequence[TensorType | str], attrs: Mapping[str, Any],
                    problem: str) -> OpCallError:
        try:
            specs: Sequence[Input] | None = self.specs(len(arg_types))
        except ValueError:
            specs = None
        described = ", ".join(
            f"{spec.name}: {t}" for spec, t in zip(specs, arg_types)
        ) if specs is not None else ", ".join(str(t) for t in arg_types)
        described = described or "none"
        attr_text = ", ".join(f"{k}={v!r}" for k, v in attrs.items()) or "none"
        return OpCallError(
            f"{self.qualified_name}: invalid call\n"
            f"  inputs: {described or 'none'}\n"
            f"  attrs:  {attr_text}\n"
            f"  problem: {problem}"
        )

    def __call__(self, *args: Any, **attrs: Any) -> Call:
        """Build a call: ``op(*inputs, **attrs)``; as in numpy, plain values after the inputs are
        attributes in declaration order (``ops.full((2, 3), 1.0, "float64")``)."""
        from opgrad.ir import Expr, make_call

        n = len(self.inputs)
        if not self.variadic and any(spec.name in attrs for spec in self.inputs):
            args = self._keyword_inputs(args, attrs)
        if self.variadic:
            # The list form ops.concatenate([a, b], 1) is the public one; generic callers (autodiff,
            # the checker) pass the tensors flattened, ops.concatenate(a, b, axis=1).
            if len(args) >= n and isinstance(args[n - 1], (list, tuple)):
                listed = tuple(args[n - 1])
                args = (*args[: n - 1], *listed, *args[n:])
                n = n - 1 + len(listed)
            elif len(args) >= n and isinstance(args[n - 1], Expr):
                while n < len(args) and isinstance(args[n], Expr):
                    n += 1
            else:
                given = "nothing" if len(args) < n else f"{type(args[n - 1]).__name__}"
                raise self._call_error([], attrs, f"input {self.inputs[-1].name!r} takes a list of tensors "
                                       f"(e.g. ops.{self.name}([a, b], ...)), got {given}")
        extra = args[n:]
        if extra and len(extra) <= len(self.attrs) and not any(isinstance(a, Expr) for a in extra):
            names = [a.name for a in self.attrs[: len(extra)]]
            twice = [name for name in names if name in attrs]
            if twice:
                arg_types = [a.type for a in args[:n] if isinstance(a, Expr)]
                raise self._call_error(arg_types, attrs, f"attribute(s) {', '.join(twice)} given by position "
                                       "and by keyword")
            attrs = {**dict(zip(names, extra, strict=True)), **attrs}
            args = args[:n]
        return make_call(self, args, attrs)

    def _keyword_inputs(self, args: tuple[Any, ...], attrs: dict[str, Any]) -> tuple[Any, ...]:
        """``args`` with the inputs given by name (``ops.add(lhs=a, rhs=b)``, as PyTorch's
        ``torch.add(input=a, other=b)``) moved out of ``attrs`` into their places after the
        positional ones."""
        from opgrad.ir import Expr

        named = {spec.name: attrs.pop(spec.name) for spec in self.inputs if spec.name in attrs}
        positional = list(args[: len(self.inputs)])
        given = [a.type if isinstance(a, Expr) else type(a).__name__ for a in positional]
        for i, spec in enumerate(self.inputs):
            if spec.name in named and i < len(positional):
                raise self._call_error(given, attrs, f"input {spec.name!r} given by position and by keyword")
        missing = [spec.name for spec in self.inputs[len(positional):] if spec.name not in named]
        if missing:
            raise self._call_error(given, attrs, f"input(s) {', '.join(map(repr, missing))} missing (given by keyword: "
                                   f"{', '.join(named)}); inputs by keyword follow the positional ones "
                                   f"({', '.join(s.name for s in self.inputs)})")
        return (*positional, *(named[spec.name] for spec in self.inputs[len(positional):]),
                *args[len(self.inputs):])

    def __repr__(self) -> str:
        return f"<Operator {self.name}>"


class Composite:
    """A graph builder of registered ops, declared in a registry file and exposed in ``opgrad.ops``.

    For calls that are naturally several ops, such as ``split`` (a tuple of ``strided_slice``):
    it needs no gradient, lowering or checker case of its own, since every op it emits has them.
    """

    def __init__(self, fn: Callable[..., Any], uses: Sequence[str]) -> None:
        self.fn = fn
        self.name = fn.__name__
        self.uses = tuple(uses)
        self.doc = " ".join((fn.__doc__ or "").split("\n\n")[0].split())
        self.module = ""
        self.__doc__ = fn.__doc__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<Composite {self.name} of {', '.join(self.uses)}>"


def composite(*uses: str) -> Callable[[Callable[..., Any]], Composite]:
    """Declare a module-level function of a registry file as ``opgrad.ops.<name>``, built of ``uses``."""

    def wrap(fn: Callable[..., Any]) -> Composite:
        return Composite(fn, uses)

    return wrap


# ----- helpers shared by shape rules and attribute converters -----


def declaring_module(frame: Any) -> str:
    """The module an operator declared from ``frame``'s caller belongs to: the module being
    imported where the declaration runs inside one's import (a helper function in another module
    may build it), so that importing it registers the operator again; else the caller's module."""
    caller = frame.f_back if frame is not None else None
    if caller is None:
        return ""
    outer = caller
    while outer is not None:
        if outer.f_code.co_name == "<module>":
            name = str(outer.f_globals.get("__name__", ""))
            if name and name != "__main__":
                return name
            break
        outer = outer.f_back
    return str(caller.f_globals.get("__name__", ""))


def module_run(frame: Any, module: str) -> Any:
    """The frame running the top level of ``module`` (its import, a script, a notebook cell) above
    ``frame``, or None where the declaration runs after it (a function called later, a test).
    Two declarations under one such frame are two statements of one run of the module; a later
    run (a re-import, a cell run again) gets a new frame."""
    outer = frame.f_back if frame is not None else None
    while outer is not None:
        if outer.f_code.co_name == "<module>":
            return outer if outer.f_globals.get("__name__") == module else None
        outer = outer.f_back
    return None


def whole(value: Any) -> int:
    """``value`` as an int where it is a Python or numpy integer; a float (which ``int`` would
    truncate) or a bool is a ``ValueError``, as numpy refuses them for shapes and axes."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"expected ints, got {value!r}")
    return int(value)


def int_tuple(length: int, *, minimum: int = 0) -> Callable[[Any], tuple[int, ...]]:
    """Converter: an int or a sequence of ``length`` ints, each ``>= minimum``."""

    def convert(value: Any) -> tuple[int, ...]:
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            items = (int(value),) * length
        else:
            try:
                items = tuple(whole(v) for v in value)
            except TypeError:
                raise ValueError(f"expected an int or {length} ints") from None
            if len(items) != length:
                raise ValueError(f"expected {length} ints, got {len(items)}")
        if any(v < minimum for v in items):
            raise ValueError(f"every entry must be >= {minimum}")
        return items

    return convert


def require(condition: bool, message: str) -> None:
    """Raise ``ShapeError(message)`` unless ``condition`` holds (for shape rules)."""
    if not condition:
        raise ShapeError(message)


def same_dtype(*types: TensorType) -> str:
    return types[0].dtype


@dataclass
class Case:
    """One generated checker case: input shapes, attributes, and optional fixed input arrays."""

    shapes: list[tuple[int, ...]]
    attrs: dict[str, Any] = field(default_factory=dict)
