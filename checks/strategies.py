"""Hypothesis strategies derived from operator declarations.

Shapes and attributes come from the declaration (``dims`` symbols shared across inputs,
``broadcast``, ``Attr.sample``) or from the op's own ``@op.sampler``; values come from each
input's ``domain`` and are kept away from declared kinks. Everything goes through hypothesis
draws, so a failing case shrinks to small shapes and simple attributes.

Values are hypothesis draws too, so a failing example shrinks to simple numbers. Arrays of up
to ``SMALL_ARRAY`` elements get every element drawn; bigger ones (a 2x3x8x8 image batch), where
element-by-element draws would make hypothesis slow, are a fixed pattern scaled by a drawn
centre and spread per domain interval, plus a few drawn values at drawn positions: shrinking
flattens the pattern to a constant and moves the special values towards simple numbers.

Compose them in your own tests, in the style of ``hypothesis.extra.numpy``::

    from hypothesis import given, strategies as st
    from opgrad.checks.strategies import cases, inputs

    @given(inputs("conv2d", dtype="float32", max_side=3))
    def test_my_property(example):
        out = example.op.reference_fn(*example.arrays, **example.case.attrs)

    @given(inputs("tanh", elements=st.floats(-30, 30)))   # values from your own strategy
    def test_saturation(example): ...
"""

from __future__ import annotations

import builtins
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hypothesis import assume
from hypothesis import strategies as st

from opgrad.dtypes import FLOAT_DTYPES
from opgrad.errors import OpgradError
from opgrad.op import Attr, Case, Input, Operator

from .tolerances import KINK_MARGIN

MAX_SIDE = 4  # default largest dimension: small keeps finite differences fast, >1 keeps them honest
MAX_RANK = 3
SMALL_ARRAY = 64  # arrays up to this many elements get every value drawn (and shrunk) by hypothesis
SPECIAL_VALUES = 3  # drawn values placed at drawn positions in a bigger array
KINK_RETRIES = 12


class SamplerError(OpgradError):
    """The checker cannot build cases of an operator: its ``@sampler`` produced a case its own shape
    rule rejects, or its declaration leaves something undrawable (a list length, a required attribute)."""


def resolve_op(op: Operator | str) -> Operator:
    if isinstance(op, Operator):
        return op
    from opgrad import registry

    found: Operator = registry.get(op)
    return found


class CaseDraw:
    """What a ``@op.sampler`` receives: named draws that hypothesis records and shrinks.

    Every method is a thin wrapper over a hypothesis strategy, so a sampler stays a few lines
    of plain Python and its registry file never imports hypothesis.
    """

    def __init__(self, draw: Callable[[st.SearchStrategy[Any]], Any], *, max_rank: builtins.int = MAX_RANK,
                 max_side: builtins.int = MAX_SIDE) -> None:
        self._draw = draw
        self.max_rank = max_rank  # the defaults of shape(); a sampler's explicit bounds win
        self.max_side = max_side

    def draw(self, strategy: st.SearchStrategy[Any]) -> Any:
        """Any hypothesis strategy, for what the helpers below do not cover."""
        return self._draw(strategy)

    def int(self, low: int, high: int) -> int:
        """An int in ``[low, high]`` (inclusive); shrinks towards ``low``."""
        value: builtins.int = self._draw(st.integers(low, high))
        return value

    def bool(self) -> builtins.bool:
        value: builtins.bool = self._draw(st.booleans())
        return value

    def choice(self, options: Sequence[Any]) -> Any:
        return self._draw(st.sampled_from(list(options)))

    def size(self, low: builtins.int = 1, high: builtins.int | None = None) -> builtins.int:
        """One axis length in ``[low, high]``, ``high`` defaulting to the strategy's ``max_side``."""
        return self.int(low, max(low, self.max_side if high is None else high))

    def shape(self, min_rank: builtins.int = 0, max_rank: builtins.int | None = None, min_side: builtins.int = 1,
              max_side: builtins.int | None = None) -> tuple[builtins.int, ...]:
        rank = self.int(min_rank, max(min_rank, self.max_rank if max_rank is None else max_rank))
        return tuple(self.size(min_side, max_side) for _ in range(rank))

    def permutation(self, n: builtins.int) -> tuple[builtins.int, ...]:
        return tuple(self._draw(st.permutations(list(range(n)))))

    def subset(self, items: Sequence[Any]) -> tuple[Any, ...]:
        return tuple(item for item in items if self.bool())

    def broadcastable_to(self, shape: Sequence[builtins.int]) -> tuple[builtins.int, ...]:
        """A shape that numpy broadcasts to ``shape``: leading axes dropped, some axes set to 1."""
        drop = self.int(0, len(shape))
        return tuple(1 if self.bool() else d for d in tuple(shape)[drop:])

    def broadcast_part(self, shape: Sequence[builtins.int]) -> tuple[builtins.int, ...]:
        """A shape that numpy broadcasts to ``shape`` (of rank >= 2) without being it, keeping at
        least one of its axes: an operand of several elements stretched along the others."""
        rank = len(shape)
        keep = self.int(0, rank - 1)
        squeeze = (keep + self.int(1, rank - 1)) % rank
        sizes = tuple(d if j == keep else 1 if j == squeeze or self.bool() else d for j, d in enumerate(shape))
        return sizes[self.int(0, keep):]

    def broadcast_target(self, shape: Sequence[builtins.int], max_new: builtins.int = 2) -> tuple[builtins.int, ...]:
        """A shape ``shape`` broadcasts to: new leading axes, and size-1 axes stretched."""
        lead = tuple(self.size() for _ in range(self.int(0, max_new)))
        return lead + tuple(self.size(2) if d == 1 and self.bool() else d for d in shape)

    def same_size_shape(
        self, shape: Sequence[builtins.int], max_rank: builtins.int | None = None
    ) -> tuple[builtins.int, ...]:
        """A random shape with as many elements as ``shape`` (its prime factors regrouped)."""
        factors = [p for d in shape for p in _prime_factors(d)]
        limit = self.max_rank if max_rank is None else max_rank
        rank = self.int(1 if factors else 0, max(limit, 1 if factors else 0))
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
    undrawable = [a.name for a in op.attrs if a.required and a.sample is None]
    if undrawable:
        # Every case would be rejected for the missing attribute; hypothesis would only report
        # that it filtered out too many, without saying which attribute or why.
        listed = ", ".join(repr(name) for name in undrawable)
        raise SamplerError(
            f"{op.name}: required attribute(s) {listed} have no default and no sample, and the op has no "
            f"@sampler, so the checker cannot draw them; give each Attr a sample= strategy or a default, "
            f"or declare an @{op.name}.sampler that chooses them"
        )
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
    if free and op.broadcast and len(free) > 1 and d.max_rank >= 2 and d.max_side >= 2 and d.bool():
        # Half the cases stretch an operand of several elements along some axes of another's shape:
        # a gradient summed over the wrong axes shows only there, scalars and equal shapes hide it.
        full = d.shape(min_rank=2, min_side=2)
        stretched = d.choice(free)
        widest = d.choice([i for i in free if i != stretched])
        for i in free:
            shapes[i] = d.broadcast_part(full) if i == stretched else full if i == widest else d.broadcastable_to(full)
    elif free:
        full = d.shape()
        for i in free:
            # Broadcasting ops get a different compatible shape per input; others share one shape.
            shapes[i] = d.broadcastable_to(full) if op.broadcast else full
    attrs = {a.name: d.draw(attr_strategy(op, a)) for a in op.attrs if a.sample is not None}
    return Case([s for s in shapes if s is not None], attrs)


def attr_strategy(op: Operator, attr: Attr) -> st.SearchStrategy[Any]:
    """The strategy of ``attr.sample``: a hypothesis strategy, or a function returning one."""
    sample = attr.sample
    strategy = sample if isinstance(sample, st.SearchStrategy) else sample() if callable(sample) else sample
    if not isinstance(strategy, st.SearchStrategy):
        raise SamplerError(f"{op.name}: attribute {attr.name!r}: sample= must be a hypothesis strategy or a "
                           f"function returning one (sample=st.floats(0.1, 2) or sample=lambda: "
                           f"st.floats(0.1, 2)); it gave {type(strategy).__name__} {strategy!r:.60}")
    return strategy


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


DrawFactory = Callable[[Callable[[st.SearchStrategy[Any]], Any]], CaseDraw]


@st.composite
def _cases(draw: Callable[[st.SearchStrategy[Any]], Any], op: Operator, case_draw: DrawFactory = CaseDraw) -> Case:
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


def op_cases(op: Operator | str, case_draw: DrawFactory = CaseDraw) -> st.SearchStrategy[Case]:
    """Strategy of valid ``Case``s (input shapes and attributes) for one operator.

    ``case_draw`` makes the object samplers draw through; a subclass of :class:`CaseDraw` that
    overrides ``size``/``shape`` changes the sizes every sampler sees (the compile fuzzer aims
    them at odd sizes).
    """
    return _cases(resolve_op(op), case_draw)


def cases(op: Operator | str, *, max_rank: int = MAX_RANK, max_side: int = MAX_SIDE) -> st.SearchStrategy[Case]:
    """Strategy of valid ``Case``s (input shapes and attributes) of ``op``.

    ``max_rank`` and ``max_side`` bound the free ranks and axis lengths (``CaseDraw.shape`` and
    ``CaseDraw.size`` without explicit bounds); a sampler's own explicit bounds still hold, since
    they encode what the op needs (a pool window no bigger than its input).
    """
    resolved = resolve_op(op)
    max_rank = _limit(max_rank, "max_rank", resolved, low=0)
    max_side = _limit(max_side, "max_side", resolved, low=1)
    return _cases(resolved, lambda draw: CaseDraw(draw, max_rank=max_rank, max_side=max_side))


def _limit(value: object, name: str, op: Operator, *, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"strategies for {op.name!r}: {name} must be an int >= {low}, got {value!r}")
    return value




# ----- values -----


def domain_elements(spec: Input) -> st.SearchStrategy[float]:
    """Strategy of one value of a float input: one of its ``domain`` intervals, then a float in it.

    Shrinks towards the first interval and, inside it, towards the simplest float (0, integers).
    """
    options = [st.just(float(i.low)) if i.low == i.high else
               st.floats(i.low, i.high, allow_nan=False, allow_infinity=False, allow_subnormal=False)
               for i in spec.domain]
    return options[0] if len(options) == 1 else st.one_of(*options)


def draw_values(spec: Input, shape: tuple[int, ...], rng: np.random.Generator, dtype: str = "float64") -> np.ndarray:
    """Values of one float input from its declared domain, by numpy: an interval per element, then uniform.

    Each interval is equally likely (not weighted by length), so a domain such as
    ``(Interval(0, 0), Interval(1, 1))`` gives a 0/1 mask. The compile fuzzer uses this; the
    checker's examples draw through hypothesis (:func:`inputs`).
    """
    lows = np.array([i.low for i in spec.domain])
    highs = np.array([i.high for i in spec.domain])
    which = rng.integers(len(spec.domain), size=shape)
    return np.asarray(lows[which] + (highs[which] - lows[which]) * rng.random(shape), dtype=dtype)


def _fold(values: np.ndarray, low: float, high: float) -> np.ndarray:
    """``values`` reflected into ``[low, high]`` (a triangle wave): no pile-up at the bounds."""
    width = high - low
    if width <= 0:
        return np.full_like(values, low)
    t = np.mod(values - low, 2 * width)
    return low + np.where(t > width, 2 * width - t, t)


@st.composite
def float_array(draw: Callable[[st.SearchStrategy[Any]], Any], spec: Input, shape: tuple[int, ...],
                elements: st.SearchStrategy[float] | None = None) -> np.ndarray:
    """A float64 array of ``shape`` with values from ``spec.domain`` (or from ``elements``).

    Up to ``SMALL_ARRAY`` elements, each is drawn. A bigger array is a fixed pattern (the same
    for every draw of this size) shifted and scaled into each domain interval by a drawn centre
    and spread, plus up to ``SPECIAL_VALUES`` drawn values at drawn positions.
    """
    size = int(np.prod(shape, dtype=np.int64))
    element = elements if elements is not None else domain_elements(spec)
    if size <= SMALL_ARRAY:
        return np.array([draw(element) for _ in range(size)], dtype=np.float64).reshape(shape)
    pattern = np.random.default_rng(size).random(size) - 0.5
    if elements is not None:
        # Values from a user's strategy: a drawn centre and spread, folded into the range drawn
        # (a constant where the strategy drew a NaN or an infinity; drawn values are placed below).
        a, b = draw(element), draw(element)
        low, high = min(a, b), max(a, b)
        if np.isfinite(low) and np.isfinite(high):
            values = _fold((low + high) / 2 + (high - low) * pattern, low, high)
        else:
            values = np.full(size, a)
    else:
        which = np.random.default_rng(size + 1).integers(len(spec.domain), size=size)
        values = np.empty(size)
        for j, interval in enumerate(spec.domain):
            chosen = which == j
            centre = draw(st.floats(interval.low, interval.high, allow_nan=False, allow_subnormal=False))
            spread = draw(st.floats(0.0, 1.0, allow_subnormal=False))
            width = interval.high - interval.low
            values[chosen] = _fold(centre + spread * width * pattern[chosen], interval.low, interval.high)
    for _ in range(draw(st.integers(0, SPECIAL_VALUES))):
        values[draw(st.integers(0, size - 1))] = draw(element)
    return values.reshape(shape)


@st.composite
def int_array(draw: Callable[[st.SearchStrategy[Any]], Any], shape: tuple[int, ...], low: int,
              high: int) -> np.ndarray:
    """An int64 array of ``shape`` with values in ``[low, high)``: each drawn when small, else a
    fixed pattern shifted by a drawn offset (shrinks to the pattern itself)."""
    size = int(np.prod(shape, dtype=np.int64))
    if size <= SMALL_ARRAY:
        return np.array([draw(st.integers(low, high - 1)) for _ in range(size)], dtype=np.int64).reshape(shape)
    pattern = np.random.default_rng(size).integers(0, high - low, size)
    offset = draw(st.integers(0, high - low - 1))
    return np.asarray(low + (pattern + offset) % (high - low), dtype=np.int64).reshape(shape)


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


def _check_dtype(dtype: str) -> str:
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype!r}")
    return dtype


def make_inputs(op: Operator, case: Case, seed: int, dtype: str = "float64") -> list[np.ndarray] | None:
    """Arrays for every input from a numpy seed (the compile fuzzer's values), or ``None`` when no
    draw stayed ``KINK_MARGIN`` away from a kink."""
    _check_dtype(dtype)
    rng = np.random.default_rng(seed)
    for _ in range(KINK_RETRIES):
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


def fingerprint(arrays: Sequence[np.ndarray]) -> int:
    """A 32-bit digest of the arrays' bytes: seeds the noise a check draws for these inputs."""
    digest = 0
    for a in arrays:
        digest = zlib.crc32(np.ascontiguousarray(a).tobytes(), zlib.crc32(str(a.shape).encode(), digest))
    return digest


def _off_kinks(op: Operator, case: Case, arrays: list[np.ndarray]) -> list[np.ndarray] | None:
    """``arrays``, or a copy nudged (deterministically, ever harder) until no value is within
    ``KINK_MARGIN`` of a kink; None if that fails. Drawn values land on kinks often (hypothesis
    likes 0 and ties), and a nudge keeps the example instead of rejecting it."""
    if op.kinks is None or op.kinks.distance(arrays, case.attrs) > KINK_MARGIN:
        return arrays
    rng = np.random.default_rng(fingerprint(arrays))
    specs = op.specs(len(case.shapes))
    for attempt in range(KINK_RETRIES):
        nudged = []
        for spec, a in zip(specs, arrays):
            if spec.kind != "float" or not spec.differentiable:
                nudged.append(a)
                continue
            low = min(i.low for i in spec.domain)
            high = max(i.high for i in spec.domain)
            step = (high - low) * 0.01 * 2.0**attempt
            moved = a + rng.uniform(-step, step, a.shape)
            # Each value stays in the domain interval it came from.
            for interval in spec.domain:
                inside = (a >= interval.low) & (a <= interval.high)
                moved = np.where(inside, _fold(moved, interval.low, interval.high), moved)
            nudged.append(moved)
        if op.kinks.distance(nudged, case.attrs) > KINK_MARGIN:
            return nudged
    return None


@st.composite
def _examples(draw: Callable[[st.SearchStrategy[Any]], Any], op: Operator, dtype: str,
              case_strategy: st.SearchStrategy[Case],
              elements: Mapping[str, st.SearchStrategy[float]] | st.SearchStrategy[float] | None) -> Example:
    case = draw(case_strategy)
    arrays: list[np.ndarray] = []
    for spec, shape in zip(op.specs(len(case.shapes)), case.shapes):
        if spec.kind == "int":
            low, high = int_bounds(op, case, spec)
            arrays.append(draw(int_array(tuple(shape), low, max(high, low + 1))))
        else:
            chosen = elements.get(spec.name.split("[")[0]) if isinstance(elements, Mapping) else elements
            arrays.append(draw(float_array(spec, tuple(shape), chosen)))
    # Values from a user's strategies are kept as drawn (on a kink, NaN, outside the domain): a
    # property test asks for exactly those; the checker's own draws keep off the kinks.
    settled = _off_kinks(op, case, arrays) if elements is None else arrays
    assume(settled is not None)
    assert settled is not None
    cast = [a.astype(dtype) if spec.kind == "float" else a for spec, a in zip(op.specs(len(case.shapes)), settled)]
    return Example(op, case, cast, dtype)


def inputs(op: Operator | str, *, dtype: str = "float64", max_rank: int = MAX_RANK, max_side: int = MAX_SIDE,
           elements: Mapping[str, st.SearchStrategy[float]] | st.SearchStrategy[float] | None = None,
           ) -> st.SearchStrategy[Example]:
    """Strategy of ``Example``s of ``op``: a valid case (as :func:`cases`) and one array per input.

    Float values come from each input's declared ``domain``, kept ``KINK_MARGIN`` away from the
    op's kinks, in ``dtype``; integer inputs (labels) from their ``int_range``. ``elements``
    replaces the domain: one strategy of floats for every float input, or a mapping from input
    name to strategy (inputs it does not name keep their domain); the values are then exactly
    what the strategies draw, on a kink, NaN or infinite included (nothing is moved off kinks).
    Values shrink like shapes do.
    """
    resolved = resolve_op(op)
    _check_dtype(dtype)
    if elements is not None and not isinstance(elements, (Mapping, st.SearchStrategy)):
        raise TypeError(f"inputs({resolved.name!r}): elements must be a hypothesis strategy of floats or a mapping "
                        f"from input name to one, got {type(elements).__name__}")
    if isinstance(elements, Mapping):
        names = {spec.name for spec in resolved.inputs}
        unknown = sorted(set(elements) - names)
        if unknown:
            raise ValueError(f"inputs({resolved.name!r}): elements names unknown input(s) {unknown}; "
                             f"the inputs are {sorted(names)}")
    return _examples(resolved, dtype, cases(resolved, max_rank=max_rank, max_side=max_side), elements)


@dataclass
class Example:
    """One generated call of an operator: its case, the input arrays and their float dtype."""

    op: Operator
    case: Case
    arrays: list[np.ndarray]
    dtype: str = "float64"
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def specs(self) -> tuple[Input, ...]:
        """The declaration of each input array (a variadic input repeated)."""
        return self.op.specs(len(self.case.shapes))

    @property
    def noise_seed(self) -> int:
        """Seeds the cotangents and directions the checks draw for this example (from the values)."""
        return fingerprint(self.arrays)

    def describe(self) -> str:
        shapes = ", ".join(f"{spec.name}{list(s)}" for spec, s in zip(self.specs, self.case.shapes))
        attrs = ", ".join(f"{k}={v!r}" for k, v in self.case.attrs.items())
        return f"{self.op.name}({shapes}{', ' + attrs if attrs else ''})"


def op_examples(op: Operator | str, dtype: str = "float64") -> st.SearchStrategy[Example]:
    """Strategy of ``Example``s: a valid case plus input arrays from the declared domains
    (``inputs(op, dtype=dtype)`` with the default limits)."""
    return inputs(op, dtype=dtype)
