"""Hypothesis strategies derived from operator declarations.

Shapes and attributes come from the declaration (``dims`` symbols shared across inputs,
``broadcast``, ``Attr.sample``) or from the op's own ``@op.sampler``; values come from each
input's ``domain`` and are kept away from declared kinks. Everything goes through hypothesis
draws, so a failing case shrinks to small shapes and simple attributes.

Values are not drawn element by element (that would make hypothesis slow on a 2x3x8x8
tensor); a drawn integer seeds numpy. The seed shrinks too, and it is printed in reports.

Use them in your own tests::

    from hypothesis import given
    from opgrad.checks import op_examples

    @given(op_examples("conv2d"))
    def test_my_property(example):
        out = example.op.reference_fn(*example.arrays, **example.case.attrs)
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hypothesis import assume
from hypothesis import strategies as st

from opgrad.dtypes import FLOAT_DTYPES
from opgrad.errors import OpgradError
from opgrad.op import Case, Input, Operator

from .tolerances import KINK_MARGIN

MAX_SIDE = 4  # default largest dimension: small keeps finite differences fast, >1 keeps them honest
MAX_RANK = 3
SEED_MAX = 2**32 - 1
_KINK_RETRIES = 12


class SamplerError(OpgradError):
    """An operator's ``@sampler`` produced a case its own shape rule rejects."""


def resolve_op(op: Operator | str) -> Operator:
    if isinstance(op, Operator):
        return op
    from opgrad import registry

    return registry.get(op)


class CaseDraw:
    """What a ``@op.sampler`` receives: named draws that hypothesis records and shrinks.

    Every method is a thin wrapper over a hypothesis strategy, so a sampler stays a few lines
    of plain Python and its registry file never imports hypothesis.
    """

    def __init__(self, draw: Callable[[st.SearchStrategy[Any]], Any]) -> None:
        self._draw = draw

    def draw(self, strategy: st.SearchStrategy[Any]) -> Any:
        """Any hypothesis strategy, for what the helpers below do not cover."""
        return self._draw(strategy)

    def int(self, low: int, high: int) -> int:
        """An int in ``[low, high]`` (inclusive); shrinks towards ``low``."""
        return self._draw(st.integers(low, high))

    def bool(self) -> bool:
        return self._draw(st.booleans())

    def choice(self, options: Sequence[Any]) -> Any:
        return self._draw(st.sampled_from(list(options)))

    def size(self, low: builtins.int = 1, high: builtins.int = MAX_SIDE) -> builtins.int:
        return self.int(low, high)

    def shape(self, min_rank: builtins.int = 0, max_rank: builtins.int = MAX_RANK, min_side: builtins.int = 1,
              max_side: builtins.int = MAX_SIDE) -> tuple[builtins.int, ...]:
        rank = self.int(min_rank, max_rank)
        return tuple(self.int(min_side, max_side) for _ in range(rank))

    def permutation(self, n: builtins.int) -> tuple[builtins.int, ...]:
        return tuple(self._draw(st.permutations(list(range(n)))))

    def subset(self, items: Sequence[Any]) -> tuple[Any, ...]:
        return tuple(item for item in items if self.bool())

    def broadcastable_to(self, shape: Sequence[builtins.int]) -> tuple[builtins.int, ...]:
        """A shape that numpy broadcasts to ``shape``: leading axes dropped, some axes set to 1."""
        drop = self.int(0, len(shape))
        return tuple(1 if self.bool() else d for d in tuple(shape)[drop:])

    def broadcast_target(self, shape: Sequence[builtins.int], max_new: builtins.int = 2) -> tuple[builtins.int, ...]:
        """A shape ``shape`` broadcasts to: new leading axes, and size-1 axes stretched."""
        lead = tuple(self.size() for _ in range(self.int(0, max_new)))
        return lead + tuple(self.size(2) if d == 1 and self.bool() else d for d in shape)

    def same_size_shape(
        self, shape: Sequence[builtins.int], max_rank: builtins.int = MAX_RANK
    ) -> tuple[builtins.int, ...]:
        """A random shape with as many elements as ``shape`` (its prime factors regrouped)."""
        factors = [p for d in shape for p in _prime_factors(d)]
        rank = self.int(1 if factors else 0, max(max_rank, 1 if factors else 0))
        target = [1] * rank
        for p in factors:
            target[self.int(0, rank - 1)] *= p
        return tuple(target)

    def reject(self) -> None:
        """Discard this draw (hypothesis counts it as filtered, not failed)."""
        assume(False)


def _prime_factors(n: int) -> list[int]:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


# ----- cases: shapes and attributes -----


def _default_case(op: Operator, d: CaseDraw) -> Case:
    """Shapes from ``dims`` (one size per symbol, shared across inputs) and ``broadcast``."""
    if op.variadic:
        raise SamplerError(f"{op.name}: a variadic operator needs an @{op.name}.sampler that chooses the list length")
    sizes: dict[str, int] = {}
    shapes: list[tuple[int, ...] | None] = []
    for spec in op.inputs:
        if spec.dims is None:
            shapes.append(None)
            continue
        shape = []
        for dim in spec.dims:
            if isinstance(dim, int):
                shape.append(dim)
            else:
                if dim not in sizes:
                    sizes[dim] = d.size()
                shape.append(sizes[dim])
        shapes.append(tuple(shape))
    free = [i for i, s in enumerate(shapes) if s is None]
    if free:
        full = d.shape()
        for i in free:
            # Broadcasting ops get a different compatible shape per input; others share one shape.
            shapes[i] = d.broadcastable_to(full) if op.broadcast else full
    attrs = {a.name: d.draw(a.sample()) for a in op.attrs if a.sample is not None}
    return Case([s for s in shapes if s is not None], attrs)


def validate_case(op: Operator, case: Case, dtype: str = "float64") -> dict[str, Any]:
    """Run the op's shape rule on ``case``; return the normalized attributes (defaults filled in,
    ``strides=None`` resolved, ...) or raise ``OpCallError`` (with context) if it rejects."""
    from opgrad.ir import var

    try:
        specs = op.specs(len(case.shapes))
    except ValueError:
        raise SamplerError(f"{op.name}: the case has {len(case.shapes)} shapes for {len(op.inputs)} inputs") from None
    params = [var(spec.name, shape, _input_dtype(spec, dtype)) for spec, shape in zip(specs, case.shapes)]
    return dict(op(*params, **case.attrs).attrs)


def _input_dtype(spec: Input, dtype: str) -> str:
    return dtype if spec.kind == "float" else "int64"


@st.composite
def _cases(draw: Callable[[st.SearchStrategy[Any]], Any], op: Operator,
           case_draw: Callable[[Callable[[st.SearchStrategy[Any]], Any]], CaseDraw] = CaseDraw) -> Case:
    d = case_draw(draw)
    sampler = op.sampler_fn
    case = sampler(d) if sampler is not None else _default_case(op, d)
    case = Case([tuple(int(n) for n in s) for s in case.shapes], dict(case.attrs))
    try:
        case.attrs = validate_case(op, case)
    except OpgradError as exc:
        if sampler is not None:
            raise SamplerError(f"the @sampler of {op.name!r} produced an invalid case:\n{exc}") from None
        assume(False)  # the generic derivation may propose what a shape rule forbids
    return case


def op_cases(op: Operator | str,
             case_draw: Callable[[Callable[[st.SearchStrategy[Any]], Any]], CaseDraw] = CaseDraw,
             ) -> st.SearchStrategy[Case]:
    """Strategy of valid ``Case``s (input shapes and attributes) for one operator.

    ``case_draw`` makes the object samplers draw through; a subclass of :class:`CaseDraw` that
    overrides ``size``/``shape`` changes the sizes every sampler sees (the compile fuzzer aims
    them at odd sizes).
    """
    return _cases(resolve_op(op), case_draw)


# ----- values -----


def draw_values(spec: Input, shape: tuple[int, ...], rng: np.random.Generator, dtype: str = "float64") -> np.ndarray:
    """Values of one float input from its declared domain: an interval per element, then uniform.

    Each interval is equally likely (not weighted by length), so a domain such as
    ``(Interval(0, 0), Interval(1, 1))`` gives a 0/1 mask.
    """
    lows = np.array([i.low for i in spec.domain])
    highs = np.array([i.high for i in spec.domain])
    which = rng.integers(len(spec.domain), size=shape)
    return np.asarray(lows[which] + (highs[which] - lows[which]) * rng.random(shape), dtype=dtype)


def int_bounds(op: Operator, case: Case, spec: Input) -> tuple[int, int]:
    """``[low, high)`` for an int input; ``high`` names an attribute or a dimension symbol."""
    if spec.int_range is None:
        return 0, 4
    low, high = spec.int_range
    if isinstance(high, int):
        return low, high
    if high in case.attrs:
        return low, int(case.attrs[high])
    for other, shape in zip(op.specs(len(case.shapes)), case.shapes):
        if other.dims is not None and high in other.dims:
            return low, shape[other.dims.index(high)]
    raise SamplerError(f"{op.name}: int_range of {spec.name!r} names {high!r}, neither an attribute nor a dim")


def make_inputs(op: Operator, case: Case, seed: int, dtype: str = "float64") -> list[np.ndarray] | None:
    """Arrays for every input, or ``None`` when no draw stayed ``KINK_MARGIN`` away from a kink."""
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype!r}")
    rng = np.random.default_rng(seed)
    for _ in range(_KINK_RETRIES):
        arrays = []
        for spec, shape in zip(op.specs(len(case.shapes)), case.shapes):
            if spec.kind == "int":
                low, high = int_bounds(op, case, spec)
                arrays.append(np.asarray(rng.integers(low, max(high, low + 1), size=shape), dtype=np.int64))
            else:
                arrays.append(draw_values(spec, shape, rng, dtype))
        if op.kinks is None or op.kinks.distance(arrays, case.attrs) > KINK_MARGIN:
            return arrays
    return None


@dataclass
class Example:
    """One generated call of an operator: its case, the input arrays, and the seed of the values."""

    op: Operator
    case: Case
    arrays: list[np.ndarray]
    value_seed: int
    dtype: str = "float64"
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def specs(self) -> tuple[Input, ...]:
        """The declaration of each input array (a variadic input repeated)."""
        return self.op.specs(len(self.case.shapes))

    def describe(self) -> str:
        shapes = ", ".join(f"{spec.name}{list(s)}" for spec, s in zip(self.specs, self.case.shapes))
        attrs = ", ".join(f"{k}={v!r}" for k, v in self.case.attrs.items())
        return f"{self.op.name}({shapes}{', ' + attrs if attrs else ''})"


@st.composite
def _examples(draw: Callable[[st.SearchStrategy[Any]], Any], op: Operator, dtype: str) -> Example:
    case = draw(_cases(op))
    seed = draw(st.integers(0, SEED_MAX))
    arrays = make_inputs(op, case, seed, dtype)
    assume(arrays is not None)
    assert arrays is not None
    return Example(op, case, arrays, seed, dtype)


def op_examples(op: Operator | str, dtype: str = "float64") -> st.SearchStrategy[Example]:
    """Strategy of ``Example``s: a valid case plus input arrays from the declared domains."""
    return _examples(resolve_op(op), dtype)
