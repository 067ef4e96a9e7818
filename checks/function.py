"""``check_function``: verify the gradient of a whole composed function (e.g. the seed CNN's loss).

Per-op checks prove each rule; this checks that autodiff composes them right (fan-out sums,
un-broadcasting, second uses of a node) on the real graph, along random directions. The graph
is rebuilt in float64 first: finite differences in float32 are too coarse to judge a gradient.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from opgrad.autodiff import grad, gradients, hvp, resolve_wrt
from opgrad.dtypes import FLOAT_DTYPES
from opgrad.errors import ArgumentError
from opgrad.ir import Call, Const, Expr, Function, Var, topological_order, var
from opgrad.reference import evaluate

from .checks import CheckFailure, Mismatch, difference_mismatch, random_cotangent, worst_mismatch
from .report import Failure, OpReport
from .runner import NothingToCheckError, check_seed, default_seed, positive_int
from .tolerances import TOLERANCES

SAMPLED_ELEMENTS = 8
_WHO = "opgrad.checks.check_function"


def as_float64(fn: Function) -> Function:
    """The same graph with every float variable, constant and ``dtype`` attribute in float64."""
    new: dict[int, Expr] = {}
    for p in fn.params:
        new[p._uid] = var(p.name, p.shape, "float64" if p.type.is_float else p.dtype)
    for node in topological_order(fn.outputs):
        if node._uid in new:
            continue
        if isinstance(node, Const):
            value = node.value.astype(np.float64) if node.type.is_float else node.value
            new[node._uid] = Const(value)
        elif isinstance(node, Call):
            attrs = {k: ("float64" if k == "dtype" and v in FLOAT_DTYPES else v) for k, v in node.attrs.items()}
            new[node._uid] = node.op(*(new[a._uid] for a in node.args), **attrs)
    params = [new[p._uid] for p in fn.params]
    outputs = [new[o._uid] for o in fn.outputs]
    return Function(params, outputs if fn.returns_tuple else outputs[0])  # type: ignore[arg-type]


def check_function(fn: Function, arrays: Sequence[np.ndarray] | None = None, *,
                   wrt: Sequence[int | str | Var] | None = None, max_examples: int = 5, seed: int | None = None,
                   directions: int = 3, name: str = "function", order: int = 1) -> OpReport:
    """Check ``fn``'s gradient (one output, any shape) at ``arrays`` or at random points.

    At each point: the gradients' shapes and dtypes (a); the VJP with a random cotangent against
    central differences along ``directions`` random directions and on sampled elements of each
    parameter (b); linearity in the cotangent (c). With ``order=2`` and a scalar output, also
    second order (e): ``opgrad.hvp``'s Hessian-vector products along ``directions`` random
    vectors against central differences of the gradient. Without ``arrays`` the float
    parameters are drawn uniformly from [-2, 2] (``max_examples`` points); a function with
    integer parameters (labels) needs ``arrays``.
    """
    if not isinstance(fn, Function):
        raise TypeError(f"{_WHO}: fn must be an opgrad.function(...), got {type(fn).__name__} {fn!r}")
    if fn.returns_tuple:
        raise ValueError(f"{_WHO}: fn returns {len(fn.outputs)} outputs; it needs a function with one output, "
                         "so check each output separately")
    if not fn.output.type.is_float:
        raise ValueError(f"{_WHO}: fn's output is {fn.output.type}; only a float output has a gradient")
    max_examples = positive_int(max_examples, "max_examples", who=_WHO)
    directions = positive_int(directions, "directions", who=_WHO)
    if order not in (1, 2):
        raise ValueError(f"{_WHO}: order must be 1 or 2, got {order!r}")
    if order == 2 and fn.output.shape != ():
        raise ValueError(f"{_WHO}: order=2 needs a scalar output (Hessian-vector products), got {fn.output.type}")
    seed = check_seed(seed, who=_WHO)
    given = _check_arrays(fn, arrays) if arrays is not None else None
    run_seed = default_seed() if seed is None else seed
    rng = np.random.default_rng(run_seed)
    f64 = as_float64(fn)
    targets = resolve_wrt(f64, _wrt_in(fn, f64, wrt))
    _require_something_to_check(f64, targets, wrt)
    cot = var("cotangent", f64.output.shape, "float64")
    report = OpReport(op=name, passed=True, seed=run_seed, checks=["a", "b", "c"] + (["e"] if order == 2 else []))
    start = time.perf_counter()
    try:
        grads = gradients(f64.output, targets, cot)
    except Exception as exc:
        report.passed = False
        report.failure = Failure(op=name, check="a", problem=f"differentiating raised {type(exc).__name__}: {exc}",
                                 seed=run_seed, rerun=_rerun_text(arrays is not None, wrt is not None, max_examples,
                                                                  directions, name, order, run_seed))
        return report
    vjp_fn = Function([*f64.params, cot], grads)
    points = [given] if given is not None else [None] * max_examples
    for point in points:
        if point is None:
            if any(not p.type.is_float for p in f64.params):
                raise ValueError("fn has integer parameters: pass arrays=[...] with values for them")
            point = [rng.uniform(-2.0, 2.0, p.shape) for p in f64.params]
        point = [np.asarray(a, dtype=np.float64) if p.type.is_float else np.asarray(a)
                 for a, p in zip(point, f64.params)]
        try:
            worst = _check_point(f64, vjp_fn, targets, point, rng, directions, name, run_seed)
            if order == 2:
                worst = max(worst, _check_second_order(f64, targets, point, rng, directions, name, run_seed))
        except CheckFailure as exc:
            report.passed, report.failure = False, exc.failure
            break
        report.examples += 1
        report.worst_rel_error = max(report.worst_rel_error, worst)
    report.seconds = time.perf_counter() - start
    if report.failure is not None:
        report.failure.rerun = _rerun_text(arrays is not None, wrt is not None, max_examples, directions, name, order,
                                           run_seed)
    return report


def _rerun_text(arrays: bool, wrt: bool, max_examples: int, directions: int, name: str, order: int,
                seed: int) -> str:
    """The ``check_function`` call that reruns a failed one, with placeholders for what only the caller has."""
    args = ["<your function>"] + (["<your arrays>"] if arrays else [])
    args += ["wrt=<yours>"] if wrt else []
    args += [f"max_examples={max_examples}"] if max_examples != 5 and not arrays else []
    args += [f"directions={directions}"] if directions != 3 else []
    args += [f"name={name!r}"] if name != "function" else []
    args += ["order=2"] if order == 2 else []
    return f"opgrad.checks.check_function({', '.join(args)}, seed={seed})"


def _check_arrays(fn: Function, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Match ``arrays`` to ``fn.params`` by count, shape and kind; an error names the parameter.

    A float parameter takes any float array (the check runs in float64 whatever the precision
    given); an integer parameter takes integers that fit its dtype.
    """
    sig = ", ".join(f"{p.name}: {p.type}" for p in fn.params)
    if isinstance(arrays, (np.ndarray, str, bytes)) or not isinstance(arrays, Sequence):
        raise ArgumentError(f"{_WHO}: arrays must be a list with one array per parameter ({sig}), "
                            f"got {type(arrays).__name__}")
    if len(arrays) != len(fn.params):
        raise ArgumentError(f"{_WHO}: expected {len(fn.params)} array(s), one per parameter ({sig}), "
                            f"got {len(arrays)}")
    checked = []
    for p, value in zip(fn.params, arrays):
        arr = np.asarray(value)
        kind = "float" if p.type.is_float else "integer"
        if arr.dtype.kind not in ("f" if p.type.is_float else "iu"):
            raise ArgumentError(f"{_WHO}: parameter {p.name!r} is {p.type} and expects {kind} values, "
                                f"got an array of dtype {arr.dtype} with shape {arr.shape}")
        if arr.shape != p.shape:
            raise ArgumentError(f"{_WHO}: parameter {p.name!r} expects shape {p.shape} ({p.type}), "
                                f"got an array of shape {arr.shape} ({arr.dtype})")
        if not p.type.is_float:
            cast = arr.astype(p.dtype)
            if not np.array_equal(cast, arr):
                raise ArgumentError(f"{_WHO}: parameter {p.name!r} is {p.type}, but the given {arr.dtype} "
                                    f"values do not fit in {p.dtype}")
            arr = cast
        checked.append(arr)
    return checked


def _wrt_in(fn: Function, f64: Function, wrt: Sequence[int | str | Var] | None) -> list[int | str | Var] | None:
    """``wrt`` with variables of ``fn`` named by position, since the check runs on the float64 copy."""
    if wrt is None:
        return None
    items: list[Any] = list(wrt) if isinstance(wrt, (list, tuple)) else [wrt]
    index = {p._uid: i for i, p in enumerate(fn.params)}
    return [index.get(item._uid, item) if isinstance(item, Var) else item for item in items]


def _require_something_to_check(fn: Function, targets: list[Var], wrt: object) -> None:
    """Raise ``NothingToCheckError`` unless the output depends differentiably on some target.

    A gradient through nothing (no float parameter, ``wrt=[]``, or parameters that reach the
    output only through integer or non-differentiable inputs) is zero by construction, so
    finite differences would "confirm" it without testing any rule.
    """
    reached = {fn.output._uid}
    for node in reversed(topological_order(fn.outputs)):
        if isinstance(node, Call) and node._uid in reached:
            reached.update(a._uid for spec, a in zip(node.specs, node.args) if spec.differentiable)
    if any(t._uid in reached for t in targets):
        return
    params = ", ".join(f"{p.name}: {p.type}" for p in fn.params) or "none"
    if not targets:
        why = f"wrt={wrt!r} selects no parameter" if wrt is not None else "it has no float parameter"
    else:
        names = ", ".join(repr(t.name) for t in targets)
        why = f"the output does not depend differentiably on {names}"
    raise NothingToCheckError(f"nothing to check: function has no differentiable parameter to check the gradient "
                              f"of ({why}; parameters: {params})")


def _check_point(fn: Function, vjp_fn: Function, targets: list[Var], point: list[np.ndarray],
                 rng: np.random.Generator, directions: int, name: str, run_seed: int) -> float:
    tol = TOLERANCES["float64"]
    h = tol.fd_step
    index_of = {p._uid: i for i, p in enumerate(fn.params)}

    def fail(check: str, problem: str, m: Mismatch | None = None, input: str | None = None,
             step: float | None = None, rtol: float | None = None) -> CheckFailure:
        failure = Failure(op=name, check=check, problem=problem, seed=run_seed, input=input, step=step,
                          tolerance=rtol, shapes={p.name: p.shape for p in fn.params}, arrays=point)
        if m is not None:
            failure.index, failure.analytic, failure.numeric = m.index, m.analytic, m.expected
            failure.abs_error, failure.rel_error = m.abs_error, m.plain_rel_error
        return CheckFailure(failure)

    def value(arrays: list[np.ndarray]) -> np.ndarray:
        return np.asarray(evaluate(fn, *arrays), dtype=np.float64)

    def vjp(c: np.ndarray) -> list[np.ndarray]:
        out = evaluate(vjp_fn, *point, c)
        return list(out) if isinstance(out, tuple) else [out]

    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):  # reported below, not warned
        at = value(point)
    if not np.all(np.isfinite(at)):
        where = tuple(int(i) for i in np.argwhere(~np.isfinite(at))[0]) if at.ndim else ()
        element = f" (output{list(where)})" if where else ""
        raise fail("b", f"the function's value is {at[where]} at this point{element}, so finite differences "
                        "cannot check its gradient there; pass arrays= inside its domain (without them, points "
                        "are drawn from [-2, 2])")
    c = random_cotangent(rng, fn.output.shape)
    grads = vjp(c)
    for t, g in zip(targets, grads):
        if g.shape != t.shape or g.dtype.name != t.dtype:
            raise fail("a", f"gradient for {t.name!r} is {g.dtype}{list(g.shape)}, expected {t.type}", input=t.name)
    worst = 0.0
    for t, g in zip(targets, grads):  # sampled elements: a failure names the worst element
        k = index_of[t._uid]
        picked = rng.choice(g.size, min(g.size, SAMPLED_ELEMENTS), replace=False)

        def numeric_at(step: float, k: int = k, picked: np.ndarray = picked) -> np.ndarray:
            numeric = []
            for i in picked:
                plus, minus = list(point), list(point)
                plus[k], minus[k] = point[k].copy(), point[k].copy()
                plus[k].flat[i] += step
                minus[k].flat[i] -= step
                numeric.append(float(np.sum(c * (value(plus) - value(minus)))) / (2 * step))
            return np.array(numeric)

        m = difference_mismatch(g.ravel()[picked], numeric_at, h, tol.fd_rtol, tol.fd_atol)
        m.index = tuple(int(i) for i in np.unravel_index(int(picked[m.index[0]]), g.shape))
        if m.ratio > 1:
            raise fail("b", f"gradient for {t.name!r} disagrees with finite differences", m, t.name, h, tol.fd_rtol)
        worst = max(worst, m.rel_error)
    for r in range(directions):
        vs = {index_of[t._uid]: rng.standard_normal(g.shape) for t, g in zip(targets, grads)}
        analytic = sum(float(np.sum(g * vs[index_of[t._uid]])) for t, g in zip(targets, grads))

        def directional(step: float, vs: dict[int, np.ndarray] = vs) -> float:
            plus, minus = list(point), list(point)
            for k, v in vs.items():
                plus[k], minus[k] = point[k] + step * v, point[k] - step * v
            return float(np.sum(c * (value(plus) - value(minus)))) / (2 * step)

        m = difference_mismatch(analytic, directional, h, tol.fd_rtol, tol.fd_atol)
        if m.ratio > 1:
            raise fail("b", "directional derivative along a random direction disagrees with finite differences",
                       m, f"direction {r}", h, tol.fd_rtol)
        worst = max(worst, m.rel_error)
    c2 = random_cotangent(rng, fn.output.shape)
    for g1, g2, gm, t in zip(grads, vjp(c2), vjp(2.0 * c - 0.5 * c2), targets):
        expected = 2.0 * g1 - 0.5 * g2
        scale = max(float(np.max(np.abs(expected), initial=0)), 1.0)
        m = worst_mismatch(gm, expected, tol.exact_rtol, tol.exact_rtol * scale)
        if m.ratio > 1:
            raise fail("c", f"gradient for {t.name!r} is not linear in the cotangent", m, t.name, None,
                       tol.exact_rtol)
    return worst


def _check_second_order(fn: Function, targets: list[Var], point: list[np.ndarray], rng: np.random.Generator,
                        directions: int, name: str, run_seed: int) -> float:
    """(e) H v from ``opgrad.hvp`` equals the central difference of the gradient along v."""
    tol = TOLERANCES["float64"]
    h = tol.fd_step
    index_of = {p._uid: i for i, p in enumerate(fn.params)}
    grad_fn = grad(fn, [index_of[t._uid] for t in targets], with_value=False)
    hvp_fn = hvp(fn, [index_of[t._uid] for t in targets])

    def as_list(out: object) -> list[np.ndarray]:
        return list(out) if isinstance(out, tuple) else [np.asarray(out)]

    worst = 0.0
    for r in range(directions):
        vs = [rng.standard_normal(t.shape) for t in targets]

        def numeric_at(step: float, vs: list[np.ndarray] = vs) -> list[np.ndarray]:
            plus, minus = list(point), list(point)
            for t, v in zip(targets, vs):
                k = index_of[t._uid]
                plus[k], minus[k] = point[k] + step * v, point[k] - step * v
            return [(gp - gm) / (2 * step) for gp, gm in zip(as_list(evaluate(grad_fn, *plus)),
                                                             as_list(evaluate(grad_fn, *minus)))]

        analytic = as_list(evaluate(hvp_fn, *point, *vs))
        numeric = numeric_at(h)
        for i, (t, a) in enumerate(zip(targets, analytic)):

            def target_at(step: float, i: int = i, numeric: list[np.ndarray] = numeric,
                          numeric_at: Callable[[float], list[np.ndarray]] = numeric_at) -> np.ndarray:
                return numeric[i] if step == h else numeric_at(step)[i]

            m = difference_mismatch(a, target_at, h, tol.fd_rtol, tol.fd_atol)
            if m.ratio > 1:
                failure = Failure(op=name, check="e", problem=f"Hessian-vector product for {t.name!r} along random "
                                  f"direction {r} disagrees with finite differences of the gradient", seed=run_seed,
                                  input=t.name, step=h, tolerance=tol.fd_rtol, arrays=point,
                                  shapes={p.name: p.shape for p in fn.params})
                failure.index, failure.analytic, failure.numeric = m.index, m.analytic, m.expected
                failure.abs_error, failure.rel_error = m.abs_error, m.plain_rel_error
                raise CheckFailure(failure)
            worst = max(worst, m.rel_error)
    return worst


def assert_function(fn: Function, arrays: Sequence[np.ndarray] | None = None, **kwargs: object) -> OpReport:
    """``check_function`` for test suites: raises ``AssertionError`` with the report text."""
    report = check_function(fn, arrays, **kwargs)  # type: ignore[arg-type]
    if not report.passed:
        raise AssertionError(str(report))
    return report
