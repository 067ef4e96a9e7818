"""Compile fuzzing: random graphs over every lowered operator, compiled vs the numpy reference.

Each graph is one operator (its case drawn from its own declaration or sampler, at sizes aimed
at what breaks code generators: 1, primes, 72-140, long rows) wrapped in fusable elementwise
work before it and reductions, softmaxes and a weighted-sum loss after it; the graph's value
*and gradients* are compiled with ``opgrad.compile`` and compared with ``opgrad.evaluate``, in
float32 and float64. A mismatch, a compile error, a ``CompileWarning`` (LLVM crashed and a
fallback was needed) or an exception fails the run, and hypothesis shrinks the graph to a
minimal one before it is reported.

Run it in a child process when a native crash must not take the caller down (the test suite
does)::

    python -m opgrad.checks.fuzz --graphs 1000 --seed 0
    python -m opgrad.checks.fuzz --import mylib.ops --ops my_op   # an op of a user's module

``--ops`` names operators with a lowering; an unknown name, or an operator declared reference
only, is a usage error (exit status 2), since it leaves nothing of that op to compile.
"""

from __future__ import annotations

import argparse
import builtins
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

import opgrad
from opgrad import ops
from opgrad.errors import CompileWarning, ConfigError, RegistryError
from opgrad.ir import Expr, Function, var
from opgrad.op import Case, Operator

from .command import add_import_option, import_user_modules
from .profiles import draws_independent_of_loaded_modules
from .strategies import CaseDraw, make_inputs, op_cases

#: Sizes that break code generators: 1, primes, vector widths and their neighbours, rows of
#: 72-140 (the sizes of a loop-vectorizer crash seen on AVX-512), and long rows.
SMALL_SIZES = (1, 2, 3, 4, 5, 7)
ODD_SIZES = (1, 3, 7, 13, 17, 31, 33, 63, 64, 65, 72, 75, 90, 97, 113, 127, 128, 140)
LONG_SIZES = (1000, 4099)
#: Elements in one case's inputs, at most (keeps the numpy reference and the checker fast).
ELEMENT_BUDGET = 60_000

RTOL = {"float32": 2e-4, "float64": 1e-9}


class FuzzDraw(CaseDraw):
    """A CaseDraw whose free sizes are odd ones, within an element budget per case."""

    def __init__(self, draw: Callable[[st.SearchStrategy[Any]], Any]) -> None:
        super().__init__(draw)
        self._elements = 1

    def size(self, low: builtins.int = 1, high: builtins.int | None = None) -> builtins.int:
        if high is not None:  # the sampler bounds this size for a reason of its own
            return self.int(low, high)
        room = ELEMENT_BUDGET // max(self._elements, 1)
        pool = self.choice(("small", "small", "odd", "odd", "long"))
        sizes = {"small": SMALL_SIZES, "odd": ODD_SIZES, "long": LONG_SIZES}[pool]
        fitting = [n for n in sizes if low <= n <= room] or [n for n in SMALL_SIZES if n >= low] or [low]
        n: int = self.choice(fitting)
        self._elements *= max(n, 1)
        return n

    def shape(self, min_rank: builtins.int = 0, max_rank: builtins.int | None = None, min_side: builtins.int = 1,
              max_side: builtins.int | None = None) -> tuple[builtins.int, ...]:
        rank = self.int(min_rank, 3 if max_rank is None else max_rank)
        return tuple(self.size(min_side, max_side) for _ in range(rank))


@dataclass
class FuzzGraph:
    """One generated graph: the function (value first, then gradients), its arguments, a description."""

    function: Function
    arrays: list[np.ndarray]
    description: str
    dtype: str
    ops: set[str] = field(default_factory=set)
    #: ``opgrad.compile(..., in_place=)`` pairs (a parameter and a result of its shape), and
    #: whether the call donates the parameters' arrays.
    in_place: tuple[tuple[int, int], ...] = ()
    donate: bool = False


def lowered_ops(names: Sequence[str] | None = None) -> list[Operator]:
    """Every registered operator with a lowering, or the named ones.

    Named operators are the user's choice, so none is dropped quietly: an unknown name is a
    ``RegistryError`` naming every unknown one, and an operator without a lowering (nothing to
    compile) a ``ConfigError`` naming those.
    """
    from opgrad import registry

    if not names:
        return [op for op in registry.all_ops() if op.lowering_fn is not None]
    chosen: list[Operator] = []
    unknown: list[str] = []
    for name in names:
        try:
            chosen.append(registry.get(name))
        except RegistryError as exc:
            unknown.append(str(exc))
    if unknown:
        raise RegistryError("; ".join(unknown))
    unlowered = [op for op in chosen if op.lowering_fn is None]
    if unlowered:
        listed = ", ".join(f"{op.name} (reference only: {op.lowering_reason})" if op.lowering_reason
                           else f"{op.name} (no lowering declared)" for op in unlowered)
        raise ConfigError(f"no compiled kernel to fuzz for {listed}; the fuzzer compiles operators that "
                          f"have a lowering")
    return chosen


def _post_ops(draw: Callable[[st.SearchStrategy[Any]], Any], y: Expr, notes: list[str]) -> Expr:
    """Fusable elementwise work, softmaxes and reductions after the operator under test."""
    for _ in range(draw(st.integers(0, 2))):
        kind = draw(st.sampled_from(["tanh", "sigmoid", "scale", "softmax", "log_softmax", "sum"]))
        if kind in ("softmax", "log_softmax", "sum") and y.ndim == 0:
            continue
        if kind == "tanh":
            y = ops.tanh(y)
        elif kind == "sigmoid":
            y = ops.sigmoid(y)
        elif kind == "scale":
            y = ops.multiply(y, draw(st.sampled_from([0.5, -1.5, 3.0])))
        elif kind in ("softmax", "log_softmax"):
            axis = draw(st.integers(-y.ndim, y.ndim - 1))
            y = getattr(ops, kind)(y, axis=axis)
            kind = f"{kind}(axis={axis})"
        else:
            axis = draw(st.integers(-y.ndim, y.ndim - 1))
            keepdims = draw(st.booleans())
            y = ops.sum(y, axis=axis, keepdims=keepdims)
            kind = f"sum(axis={axis}, keepdims={keepdims})"
        notes.append(kind)
    return y


@st.composite
def fuzz_graphs(draw: Callable[[st.SearchStrategy[Any]], Any], operators: Sequence[Operator],
                dtypes: Sequence[str] = ("float32", "float64")) -> FuzzGraph:
    """Strategy of :class:`FuzzGraph` over ``operators``."""
    op = draw(st.sampled_from(list(operators)))
    case: Case = draw(op_cases(op, FuzzDraw))
    dtype = draw(st.sampled_from(list(dtypes)))
    value_seed = draw(st.integers(0, 2**32 - 1))
    arrays = make_inputs(op, case, value_seed, dtype)
    if arrays is None:
        from hypothesis import assume

        assume(False)
    assert arrays is not None
    specs = op.specs(len(case.shapes))
    params = [var(spec.name, shape, dtype if spec.kind == "float" else "int64")
              for spec, shape in zip(specs, case.shapes)]
    pre: list[str] = []
    args: list[Expr] = []
    for spec, p in zip(specs, params):
        # Scaling by a positive constant keeps each input in its domain and fuses into the
        # consumer; ops with kinks see their inputs unscaled so no value lands on a kink.
        if spec.kind == "float" and op.kinks is None and draw(st.booleans()):
            scale = draw(st.sampled_from([0.5, 1.25, 2.0]))
            args.append(ops.multiply(p, scale))
            pre.append(f"{spec.name}*{scale}")
        else:
            args.append(p)
    y = op(*args, **case.attrs)
    post: list[str] = []
    outputs: list[Expr] = [y]
    diff_inputs = [p for p, spec in zip(params, specs) if spec.kind == "float" and spec.differentiable]
    differentiable = op.gradient_rule is not None and bool(diff_inputs) and y.dtype == dtype
    if differentiable:
        z = _post_ops(draw, y, post)
        weight = var("loss_weight", z.shape, dtype)
        params.append(weight)
        arrays.append(np.random.default_rng(value_seed).uniform(-1, 1, z.shape).astype(dtype))
        loss = ops.sum(ops.multiply(z, weight))
        wrt = [*diff_inputs, weight]
        fn = Function(params, [loss, y, *opgrad.gradients(loss, wrt)])
    else:
        fn = Function(params, outputs)
    shapes = ", ".join(f"{spec.name}{list(s)}" for spec, s in zip(specs, case.shapes))
    attrs = ", ".join(f"{k}={v!r}" for k, v in case.attrs.items())
    description = (f"{op.name}({shapes}{', ' + attrs if attrs else ''}) {dtype}, value seed {value_seed}"
                   + (f", inputs {' '.join(pre)}" if pre else "")
                   + (f", then {' -> '.join(post)}" if post else "")
                   + (", with gradients" if differentiable else ""))
    in_place: list[tuple[int, int]] = []
    donate = False
    if draw(st.booleans()):  # results computed over parameters of their shape (a gradient over its input)
        for r, out in enumerate(fn.outputs):
            free = [p for p, x in enumerate(fn.params) if (x.shape, x.dtype) == (out.shape, out.dtype)
                    and all(p != q for q, _ in in_place)]
            if free:
                in_place.append((free[0], r))
        donate = draw(st.booleans())
        if in_place:
            description += f", in place {in_place}" + (" donated" if donate else "")
    used = {c.op.name for c in opgrad.ir.calls(fn.outputs)}
    return FuzzGraph(fn, arrays, description, dtype, used, tuple(in_place), donate)


def compare(graph: FuzzGraph) -> None:
    """Compile ``graph`` and raise AssertionError where it differs from the reference."""
    with np.errstate(all="ignore"):
        expected = opgrad.evaluate(graph.function, *graph.arrays)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileWarning)
        # The planner is what is tested.
        compiled = opgrad.compile(graph.function, plan_cache=False, in_place=graph.in_place)
    arrays = [a.copy() for a in graph.arrays]
    got = compiled(*arrays, donate=graph.donate)
    if not graph.donate:
        for arr, given in zip(arrays, graph.arrays):
            assert np.array_equal(arr, given, equal_nan=arr.dtype.kind == "f"), "the call modified an argument"
    expected_list = list(expected) if isinstance(expected, tuple) else [expected]
    got_list = list(got) if isinstance(got, tuple) else [got]
    names = _output_names(graph.function)
    for name, g, e in zip(names, got_list, expected_list):
        g, e = np.asarray(g), np.asarray(e)
        assert g.shape == e.shape and g.dtype == e.dtype, \
            f"{name}: compiled {g.dtype}{list(g.shape)} vs reference {e.dtype}{list(e.shape)}"
        if e.dtype.kind != "f":
            assert np.array_equal(g, e), f"{name}: compiled ints differ from the reference"
            continue
        assert np.array_equal(np.isnan(g), np.isnan(e)) and np.array_equal(np.isposinf(g), np.isposinf(e)) \
            and np.array_equal(np.isneginf(g), np.isneginf(e)), f"{name}: NaN/inf differ from the reference"
        finite = np.isfinite(e)
        if not finite.any():
            continue
        scale = max(1.0, float(np.abs(e[finite]).max()))
        worst = float(np.abs(g[finite].astype(np.float64) - e[finite]).max())
        assert worst <= RTOL[graph.dtype] * scale, \
            f"{name}: compiled differs from the reference by {worst:.3g} (scale {scale:.3g})"


def _output_names(fn: Function) -> list[str]:
    n = len(fn.outputs)
    if n == 1:
        return ["output"]
    return ["loss", "output", *(f"gradient {i}" for i in range(n - 2))]


@dataclass
class FuzzResult:
    graphs: int
    seconds: float
    ops: set[str]
    failure: str | None


def run(graphs: int = 200, seed: int = 0, op_names: Sequence[str] | None = None,
        dtypes: Sequence[str] = ("float32", "float64"), log: Callable[[str], None] | None = None) -> FuzzResult:
    """Compile and compare ``graphs`` random graphs; a failure is shrunk and described.

    ``op_names`` that are unknown or have no lowering raise, as :func:`lowered_ops` says.
    """
    operators = lowered_ops(op_names)
    count = 0
    covered: set[str] = set()
    start = time.perf_counter()
    last: list[str] = []

    @settings(max_examples=graphs, deadline=None, database=None, print_blob=False,
              phases=[Phase.generate, Phase.shrink],
              suppress_health_check=list(HealthCheck))
    @hypothesis_seed(seed)
    @given(fuzz_graphs(operators, dtypes))
    def one(graph: FuzzGraph) -> None:
        nonlocal count
        last[:] = [graph.description]
        if log is not None:
            log(f"graph {count}: {graph.description}")
        count += 1
        covered.update(graph.ops)
        compare(graph)

    try:
        with draws_independent_of_loaded_modules():
            one()
    except Exception as exc:  # hypothesis re-raises the shrunk failure
        return FuzzResult(count, time.perf_counter() - start, covered,
                          f"{type(exc).__name__}: {exc}\n  minimal graph: {last[0] if last else '?'}")
    return FuzzResult(count, time.perf_counter() - start, covered, None)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opgrad.checks.fuzz", description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", type=_positive, default=200, help="random graphs to compile (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    parser.add_argument("--ops", nargs="*", default=None, help="only these operators (each needs a lowering)")
    add_import_option(parser)
    parser.add_argument("--quiet", action="store_true", help="print only the summary")
    args = parser.parse_args(argv)
    from opgrad.cli import one_line
    from opgrad.compiler.jit import host_target

    try:
        import_user_modules(args.imports)
    except ConfigError as exc:
        print(f"{parser.prog}: error: {one_line(exc)}", file=sys.stderr)
        return 2
    try:
        lowered_ops(args.ops)  # refuses unknown names and ops with nothing to compile, before any run
    except (ConfigError, RegistryError) as exc:
        print(f"{parser.prog}: error: --ops: {one_line(exc)}", file=sys.stderr)
        return 2

    log = None if args.quiet else (lambda line: print(line, flush=True))
    result = run(args.graphs, args.seed, args.ops, log=log)
    host = host_target()
    print(f"{result.graphs} graphs, {len(result.ops)} operators covered, {result.seconds:.1f} s, "
          f"host CPU {host.cpu}: {'FAILED' if result.failure else 'no mismatch'}")
    if result.failure:
        print(result.failure)
        return 1
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


if __name__ == "__main__":
    sys.exit(main())
