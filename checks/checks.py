"""Checks a-g on one generated example (see docs/checking.md for what each one proves).

Each check either returns the worst relative error it saw (finite-difference checks) or raises
``CheckFailure`` carrying a ``Failure`` with the worst element. The gradient under test is the
op's registered rule or a candidate ``(call, grad) -> list``; it is applied to one call directly,
so a candidate is checked without being registered.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from opgrad.autodiff import fit_to_input, gradient_entries, gradients
from opgrad.errors import GradientError
from opgrad.ir import Call, Expr, Function, Var, var
from opgrad.op import GradientRule, Input, Operator
from opgrad.reference import evaluate

from .backends import Backend
from .report import CHECK_NAMES, Failure
from .strategies import Example
from .tolerances import Tolerance, tolerance

FULL_JACOBIAN_LIMIT = 24  # inputs and outputs at most this big get their whole Jacobian compared
SAMPLED_ELEMENTS = 16  # elements per input differentiated one by one on bigger inputs
DIRECTIONS = 2  # random directions through all inputs at once (catches what sampling misses)


class CheckFailure(Exception):
    """Raised by a check; carries the structured ``Failure``."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(str(failure))
        self.failure = failure


def failure_class(check: str) -> type[CheckFailure]:
    """The ``CheckFailure`` subclass of one check letter (``CheckBFailure`` for check b).

    Hypothesis tells failures apart by exception type and raising line; a type per check keeps a
    shrink that starts from a check-b failure on check b, even where two checks share a raising
    line, instead of slipping to a smaller example on which another check fails.
    """
    return CHECK_FAILURES.get(check, CheckFailure)


CHECK_FAILURES: dict[str, type[CheckFailure]] = {
    letter: type(f"Check{letter.upper()}Failure", (CheckFailure,),
                 {"__doc__": f"Check {letter} ({name}) failed.", "__module__": __name__})
    for letter, name in CHECK_NAMES.items()
}


@dataclass
class Mismatch:
    """The worst element of a comparison."""

    ratio: float  # |a - b| / (atol + rtol * max(|a|, |b|)); above 1 fails
    index: tuple[int, ...]
    analytic: float
    expected: float
    abs_error: float
    rel_error: float  # floored (see worst_mismatch): what the summary table reports
    plain_rel_error: float = 0.0  # |a - b| / max(|a|, |b|): what a failure report shows


def worst_mismatch(analytic: np.ndarray, expected: np.ndarray, rtol: float, atol: float,
                   rel_floor: float | None = None) -> Mismatch:
    """Compare elementwise; NaN or inf on either side counts as an infinite mismatch.

    The reported relative error divides by ``max(|a|, |b|, rel_floor)``; the floor defaults to
    ``atol / rtol`` (finite differences judge tiny values absolutely). Exact identities, whose
    ``atol`` is a scale rather than noise, pass ``rel_floor=0``-ish to report the plain ratio.
    """
    a = np.asarray(analytic, dtype=np.float64)
    b = np.asarray(expected, dtype=np.float64)
    diff = np.abs(a - b)
    big = np.maximum(np.abs(a), np.abs(b))
    ratio = diff / (atol + rtol * big)
    ratio = np.where(np.isfinite(ratio), ratio, np.inf)
    if ratio.size == 0:
        return Mismatch(0.0, (), 0.0, 0.0, 0.0, 0.0)
    flat = int(np.argmax(ratio))
    index = tuple(int(i) for i in np.unravel_index(flat, ratio.shape))
    floor = atol / rtol if rel_floor is None else rel_floor
    rel = float(diff.flat[flat] / max(big.flat[flat], floor, 1e-300)) if np.isfinite(diff.flat[flat]) else np.inf
    plain = float(diff.flat[flat] / max(big.flat[flat], 1e-300)) if np.isfinite(diff.flat[flat]) else np.inf
    return Mismatch(float(ratio.flat[flat]), index, float(a.flat[flat]), float(b.flat[flat]),
                    float(diff.flat[flat]), rel, plain)


#: Steps, as fractions of ``h``, at which :func:`difference_mismatch` retries a difference that
#: disagrees even after Richardson's extrapolation.
SMALLER_STEPS = (1 / 16, 1 / 256)


def difference_mismatch(analytic: np.ndarray | float, difference: Callable[[float], Any], h: float, rtol: float,
                        atol: float) -> Mismatch:
    """``analytic`` against the central difference quotient ``difference(h)``; where they disagree,
    against Richardson's extrapolation ``(4 D(h/2) - D(h)) / 3``, then against the quotient at
    the steps :data:`SMALLER_STEPS` before calling it a mismatch.

    A central difference is off by about h^2 / 6 times the third derivative: near a sharp feature
    (a normalization over two elements, whose scale is sqrt(epsilon)) that alone can exceed the
    tolerance. The extrapolation cancels that term, while a wrong gradient, off by O(1), stays off.
    Within ``h`` of a point where the second derivative jumps (softsign's ``x / (1 + |x|)`` at 0)
    the error is of order ``h`` and no extrapolation removes it; it shrinks with the step, so a
    smaller step agrees, whereas a wrong gradient disagrees at every step (float64 keeps the
    rounding of a 256 times smaller step far below the tolerance).
    """
    numeric = np.asarray(difference(h), dtype=np.float64)
    m = worst_mismatch(np.asarray(analytic), numeric, rtol, atol)
    if m.ratio <= 1:
        return m
    refined = (4 * np.asarray(difference(h / 2), dtype=np.float64) - numeric) / 3
    best = worst_mismatch(np.asarray(analytic), refined, rtol, atol)
    for fraction in SMALLER_STEPS:
        if best.ratio <= 1:
            break
        smaller = worst_mismatch(np.asarray(analytic), np.asarray(difference(h * fraction), dtype=np.float64),
                                 rtol, atol)
        if smaller.ratio <= 1:
            return smaller
    return best


def kinked_along(value_at: Callable[[float], float], h: float, rtol: float, atol: float) -> bool:
    """Whether ``t -> value_at(t)`` has a kink within ``h / 16`` of ``t = 0``: its one-sided difference
    quotients disagree beyond the tolerance at the steps ``h`` and ``h / 16`` both. A smooth
    function's quotients differ by about the step times its second derivative, so they agree at
    the smaller step; across a kink they differ by the jump of the slope at any step."""
    at_zero = value_at(0.0)
    for step in (h, h / 16):
        right, left = (value_at(step) - at_zero) / step, (at_zero - value_at(-step)) / step
        if worst_mismatch(np.asarray(right), np.asarray(left), rtol, atol).ratio <= 1:
            return False
    return True


@dataclass
class Context:
    """Everything a check needs about one example, built once."""

    example: Example
    rule: GradientRule | None
    tol: Tolerance
    backend: Backend | None = None
    seed: int | None = None
    params: list[Var] = field(default_factory=list)
    call: Call | None = None
    cotangent: Var | None = None
    diff: list[int] = field(default_factory=list)  # indices of differentiable inputs
    grads: list[Expr] = field(default_factory=list)  # one VJP expression per differentiable input
    vjp_fn: Function | None = None
    vjp_fn32: Function | None = None  # the same rule built in float32
    #: Comparisons that finite differences cannot decide at this example, and why.
    skipped: list[str] = field(default_factory=list)

    @property
    def op(self) -> Operator:
        return self.example.op

    @property
    def arrays(self) -> list[np.ndarray]:
        return self.example.arrays

    @property
    def specs(self) -> tuple[Input, ...]:
        """The declaration of each input of this example (a variadic input repeated)."""
        return self.example.specs

    def rng(self, salt: int) -> np.random.Generator:
        return np.random.default_rng([self.example.noise_seed, salt])

    def fail(self, check: str, problem: str, mismatch: Mismatch | None = None, *, input: str | None = None,
             step: float | None = None, rtol: float | None = None, dtype: str = "float64",
             arrays: Sequence[np.ndarray] | None = None) -> CheckFailure:
        """The failure of ``check``; ``dtype`` is the one the failing comparison evaluated in (the
        gradient checks run in float64; checks a and g also in float32), ``arrays`` the inputs
        it evaluated when they are not the example's (on a kink, random ones for the adjoint test)."""
        case = self.example.case
        shown = self.arrays if arrays is None else arrays
        failure = Failure(
            op=self.op.name, check=check, problem=problem,
            shapes={spec.name: tuple(s) for spec, s in zip(self.specs, case.shapes)},
            attrs=dict(case.attrs), seed=self.seed, input=input, step=step, tolerance=rtol, dtype=dtype,
            arrays=[np.asarray(a).astype(dtype) if spec.kind == "float" else np.array(a)
                    for spec, a in zip(self.specs, shown)],
            names=[spec.name for spec in self.specs],
        )
        if mismatch is not None:
            failure.index = mismatch.index
            failure.analytic, failure.numeric = mismatch.analytic, mismatch.expected
            failure.abs_error, failure.rel_error = mismatch.abs_error, mismatch.plain_rel_error
        return failure_class(check)(failure)

    def forward(self, arrays: Sequence[np.ndarray]) -> np.ndarray:
        return np.asarray(self.op.reference_fn(*arrays, **self.example.case.attrs), dtype=np.float64)

    def vjp(self, arrays: Sequence[np.ndarray], cotangent: np.ndarray) -> list[np.ndarray]:
        assert self.vjp_fn is not None
        out = evaluate(self.vjp_fn, *arrays, cotangent)
        return list(out) if isinstance(out, tuple) else [out]


def raised_in(exc: BaseException, op: Operator) -> str:
    """Where in ``op``'s declaration ``exc`` was raised, as `` (in the shape rule of 'op':
    file:line in function)``, or ``""`` when no part of the declaration is on its traceback."""
    codes = {fn.__code__: part for part, fn in op.declared_parts().items() if hasattr(fn, "__code__")}
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame.f_code, tb.tb_lineno))
        tb = tb.tb_next
    declared = [(code, line) for code, line in frames if code in codes]
    if not declared:
        # Code the declaration hands on and the compiler runs later (a lowering's elementwise body).
        files = {code.co_filename for code in codes}
        inner = [(code, line) for code, line in frames if code.co_filename in files]
        if not inner:
            return ""
        code, line = inner[-1]
        return f" (in code declared with {op.name!r}: {code.co_filename}:{line} in {code.co_name})"
    part_code = declared[-1][0]
    # The innermost line in the part's own file: the raising line, or its call of a helper there.
    code, line = next((c, n) for c, n in reversed(frames) if c.co_filename == part_code.co_filename)
    return f" (in the {codes[part_code]} of {op.name!r}: {code.co_filename}:{line} in {code.co_name})"


def vjp_exprs(op: Operator, rule: GradientRule, call: Call, cotangent: Expr) -> list[Expr]:
    """The rule applied to ``call``, each entry fitted to its input exactly as autodiff does."""
    raw = gradient_entries(call, rule(call, cotangent))
    specs = call.specs
    fitted = []
    for index, spec in enumerate(specs):
        if not spec.differentiable:
            continue
        entry = raw[index]
        if entry is None:
            raise GradientError(f"gradient of {op.name!r} returned None for differentiable input {spec.name!r}")
        fitted.append(fit_to_input(call, index, entry))
    return fitted


def _build(op: Operator, rule: GradientRule, shapes: Sequence[tuple[int, ...]], attrs: Any,
           dtype: str) -> tuple[list[Var], Call, Var, list[Expr]]:
    params = [var(spec.name, shape, dtype if spec.kind == "float" else "int64")
              for spec, shape in zip(op.specs(len(shapes)), shapes)]
    call = op(*params, **attrs)
    cot = var("cotangent", call.shape, call.dtype)
    return params, call, cot, vjp_exprs(op, rule, call, cot)


def check_a_build(ctx: Context) -> None:
    """(a) the rule builds, in float64 and float32, a gradient of each input's shape and dtype."""
    op, case = ctx.op, ctx.example.case
    ctx.diff = [i for i, spec in enumerate(ctx.specs) if spec.differentiable]
    assert ctx.rule is not None
    # The declaration first: a forward that breaks its own shape rule would otherwise be blamed on
    # the gradient, whose calls are built from the shape rule's output type.
    promised = op(*[var(spec.name, shape, "float64" if spec.kind == "float" else "int64")
                    for spec, shape in zip(ctx.specs, case.shapes)], **case.attrs).type.shape
    try:
        forward = ctx.forward(ctx.arrays)
    except Exception:  # a raising forward is a finding of the checks that run it, with their own message
        forward = None
    if forward is not None and forward.shape != promised:
        raise ctx.fail("a", f"the reference forward returned shape {list(forward.shape)}, but the shape rule "
                            f"promises {list(promised)}: the declaration is inconsistent")
    for dtype in ("float32", "float64"):
        try:
            params, call, cot, grads = _build(op, ctx.rule, case.shapes, case.attrs, dtype)
        except Exception as exc:  # a wrong rule fails in many ways; each is a finding, not a crash
            raise ctx.fail("a", f"building the gradient in {dtype} raised {type(exc).__name__}: {exc}"
                                f"{raised_in(exc, op)}", dtype=dtype) from None
        for k, g in zip(ctx.diff, grads):
            if g.type != params[k].type:
                raise ctx.fail("a", f"gradient for {ctx.specs[k].name!r} has type {g.type}, expected {params[k].type}",
                               input=ctx.specs[k].name, dtype=dtype)
        if dtype == "float32":
            ctx.vjp_fn32 = Function([*params, cot], grads)
    ctx.params, ctx.call, ctx.cotangent, ctx.grads = params, call, cot, grads
    ctx.vjp_fn = Function([*params, cot], grads)


def random_cotangent(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Normal entries shifted off zero mean, never all ones (TVM's all-ones cotangent hid bugs)."""
    c = rng.standard_normal(shape) + 0.3
    if c.size == 1:
        c = np.full(shape, rng.choice([-1.0, 1.0]) * rng.uniform(0.5, 1.5))
    return c


def _numeric_columns(ctx: Context, k: int, flat_indices: Sequence[int], h: float) -> np.ndarray:
    """Central differences of the forward in input ``k``: one Jacobian column per index."""
    columns = []
    for i in flat_indices:
        plus, minus = list(ctx.arrays), list(ctx.arrays)
        plus[k] = ctx.arrays[k].copy()
        minus[k] = ctx.arrays[k].copy()
        plus[k].flat[i] += h
        minus[k].flat[i] -= h
        columns.append(((ctx.forward(plus) - ctx.forward(minus)) / (2 * h)).ravel())
    return np.array(columns)


def _evaluated(ctx: Context, check: str, arrays: Sequence[np.ndarray], c: np.ndarray) -> list[np.ndarray]:
    try:
        grads = ctx.vjp(arrays, c)
    except Exception as exc:
        raise ctx.fail(check, f"evaluating the gradient raised {type(exc).__name__}: {exc}"
                              f"{raised_in(exc, ctx.op)}") from None
    for k, g in zip(ctx.diff, grads):
        spec = ctx.specs[k]
        if g.shape != ctx.arrays[k].shape or g.dtype != ctx.arrays[k].dtype:
            raise ctx.fail("a", f"evaluated gradient for {spec.name!r} is {g.dtype}{list(g.shape)}, expected "
                           f"{ctx.arrays[k].dtype}{list(ctx.arrays[k].shape)}", input=spec.name)
    return grads


def check_b_vjp(ctx: Context) -> float:
    """(b) VJP with a random cotangent against central differences; whole Jacobian when small."""
    tol, rng = ctx.tol, ctx.rng(1)
    h = tol.fd_step
    out_shape = ctx.call.shape if ctx.call is not None else ()
    c = random_cotangent(rng, out_shape)
    grads = _evaluated(ctx, "b", ctx.arrays, c)
    worst = 0.0
    out_size = int(np.prod(out_shape, dtype=np.int64))
    for k, g in zip(ctx.diff, grads):
        name = ctx.specs[k].name
        size = ctx.arrays[k].size
        full = size <= FULL_JACOBIAN_LIMIT
        picked = range(size) if full else rng.choice(size, SAMPLED_ELEMENTS, replace=False)
        shape = ctx.arrays[k].shape if full else (len(picked),)
        indices = [int(i) for i in picked]
        columns = _numeric_columns(ctx, k, indices, h)

        def numeric_at(step: float, k: int = k, indices: list[int] = indices, shape: tuple[int, ...] = shape,
                       columns: np.ndarray = columns) -> np.ndarray:
            at_step = columns if step == h else _numeric_columns(ctx, k, indices, step)
            return (at_step @ c.ravel() if indices else np.zeros(0)).reshape(shape)

        m = difference_mismatch(g.ravel()[indices].reshape(shape), numeric_at, h, tol.fd_rtol, tol.fd_atol)
        if not full and m.index:
            m.index = tuple(int(i) for i in np.unravel_index(int(picked[m.index[0]]), ctx.arrays[k].shape))
        if m.ratio > 1:
            raise ctx.fail("b", f"VJP for {name!r} disagrees with finite differences{_mismatch_hint(ctx, k, m, c)}", m,
                           input=name, step=h, rtol=tol.fd_rtol)
        worst = max(worst, m.rel_error)
        if full and 1 < out_size <= FULL_JACOBIAN_LIMIT:
            worst = max(worst, _full_jacobian(ctx, k, columns.T, out_shape, h))
    _float32_gradient(ctx, c, grads)
    return max(worst, _directional(ctx, c, grads, rng))


#: A float64 gradient below this is in float32's range with room for the float32 rounding of its inputs.
FLOAT32_SAFE = float(np.finfo(np.float32).max) / 16


def float32_mismatch(got: np.ndarray, want: np.ndarray) -> Mismatch:
    """``got`` (computed in float32) against ``want`` (float64, from the same float32-rounded
    inputs), where ``want`` is finite and inside float32's range: they may differ by float32's
    rounding, :data:`FLOAT32_RTOL` of each value plus that of the largest (a sum that cancels keeps
    the error of its terms), not by a float32 formula computing something else."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    usable = np.isfinite(want) & (np.abs(want) < FLOAT32_SAFE)
    got, want = np.where(usable, got, 0.0), np.where(usable, want, 0.0)
    scale = max(1.0, float(np.max(np.abs(want), initial=0.0)))
    return worst_mismatch(got, want, FLOAT32_RTOL, FLOAT32_RTOL * scale)


#: float32 results may differ from float64 ones by this much of their scale (about 800 float32
#: roundings: sums over thousands of terms stay inside, a formula off by 1e-3 does not).
FLOAT32_RTOL = 1e-4


def _as_list(value: Any) -> list[Any]:
    """An evaluated function's results as a list (a tuple for several, one array for one)."""
    return list(value) if isinstance(value, tuple) else [value]


def _float32_gradient(ctx: Context, c: np.ndarray, grads: list[np.ndarray]) -> None:
    """(b) The rule evaluated in float32 (what training runs) is finite wherever the float64 one is
    finite and well inside float32's range, on inputs where the float32 forward is finite, and
    equals the float64 rule on those float32 inputs up to float32's rounding: a rule that overflows
    or divides inf by inf in float32 ((e^2x - 1) / (e^2x + 1) for tanh at x = 50), or one whose
    float32 form loses the value ((tanh(x) + 1e8) - 1e8), passes every float64 comparison."""
    if ctx.vjp_fn32 is None:
        return
    arrays = [a.astype(np.float32) if spec.kind == "float" else a for spec, a in zip(ctx.specs, ctx.arrays)]
    c32 = c.astype(ctx.vjp_fn32.params[-1].dtype)
    with np.errstate(all="ignore"):
        try:
            forward = np.asarray(ctx.op.reference_fn(*arrays, **ctx.example.case.attrs))
            if not np.all(np.isfinite(forward)):
                return
            out = evaluate(ctx.vjp_fn32, *arrays, c32)
        except Exception as exc:
            raise ctx.fail("b", f"evaluating the gradient in float32 raised {type(exc).__name__}: {exc}"
                                f"{raised_in(exc, ctx.op)}", dtype="float32") from None
        rounded = out if ctx.vjp_fn is None else evaluate(
            ctx.vjp_fn, *[a.astype(np.float64) if spec.kind == "float" else a for spec, a in zip(ctx.specs, arrays)],
            c32.astype(np.float64))
    for k, g64, g32, want in zip(ctx.diff, grads, _as_list(out), _as_list(rounded)):
        name = ctx.specs[k].name
        bad = np.isfinite(g64) & (np.abs(g64) < FLOAT32_SAFE) & ~np.isfinite(np.asarray(g32))
        if bad.any():
            index = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), bad.shape))
            raise ctx.fail("b", f"in float32 the gradient for {name!r} is {np.asarray(g32)[index]} at {index}, where "
                           f"float64 gives {g64[index]:.6g} and the float32 forward is finite: the rule overflows "
                           "or divides inf by inf in float32", input=name, dtype="float32")
        m = float32_mismatch(g32, want)
        if m.ratio > 1:
            raise ctx.fail("b", f"in float32 the gradient for {name!r} differs from the float64 rule on the same "
                           "float32 inputs by more than float32's rounding: the rule loses precision in float32",
                           m, input=name, rtol=FLOAT32_RTOL, dtype="float32")


def _mismatch_hint(ctx: Context, k: int, m: Mismatch, c: np.ndarray) -> str:
    """What else may be wrong where the differences disagree: the forward is undefined (NaN or
    infinite) within a step of inputs drawn from the declared domain, which is then too wide; or
    the forward has a kink at that input that the op does not declare."""
    spec = ctx.specs[k]
    if np.isfinite(m.expected):
        if ctx.op.kinks is not None or m.index is None or len(m.index) != ctx.arrays[k].ndim:
            return ""
        flat = int(np.ravel_multi_index(m.index, ctx.arrays[k].shape)) if ctx.arrays[k].ndim else 0

        def value_at(t: float) -> float:
            moved = list(ctx.arrays)
            moved[k] = ctx.arrays[k].copy()
            moved[k].flat[flat] += t
            return float(np.sum(ctx.forward(moved) * c))

        if not kinked_along(value_at, ctx.tol.fd_step, ctx.tol.fd_rtol, ctx.tol.fd_atol):
            return ""
        return (f": the forward's slope in {spec.name!r} jumps at this input (a kink), which the op does not "
                "declare; if the kink is the op's, declare it with kinks=Kink(...) (docs/checking.md) so that "
                "examples keep off it and check f tests your convention there")
    domain = " or ".join(f"[{i.low:g}, {i.high:g}]" for i in spec.domain)
    return (f": the forward itself is not finite there (differences {m.expected}) though {spec.name!r} lies in "
            f"its declared domain {domain}; narrow domain= to where the op is defined")


def _full_jacobian(ctx: Context, k: int, numeric: np.ndarray, out_shape: tuple[int, ...], h: float) -> float:
    """Every row of the Jacobian of input ``k`` via a one-hot cotangent per output element, against
    ``numeric`` (central differences with step ``h``, refined as :func:`difference_mismatch` does)."""
    tol = ctx.tol
    rows = []
    for j in range(numeric.shape[0]):
        basis = np.zeros(numeric.shape[0])
        basis[j] = 1.0
        rows.append(_evaluated(ctx, "b", ctx.arrays, basis.reshape(out_shape))[ctx.diff.index(k)].ravel())
    analytic = np.array(rows)

    def numeric_at(step: float) -> np.ndarray:
        return numeric if step == h else _numeric_columns(ctx, k, range(numeric.shape[1]), step).T

    m = difference_mismatch(analytic, numeric_at, h, tol.fd_rtol, tol.fd_atol)
    if m.ratio > 1:
        name = ctx.specs[k].name
        out_index = np.unravel_index(m.index[0], out_shape) if out_shape else ()
        in_index = np.unravel_index(m.index[1], ctx.arrays[k].shape) if ctx.arrays[k].shape else ()
        m.index = tuple(int(i) for i in (*out_index, *in_index))
        raise ctx.fail("b", f"Jacobian entry d output[{', '.join(str(i) for i in out_index)}] / d {name}"
                       f"[{', '.join(str(i) for i in in_index)}] disagrees with finite differences (full Jacobian)",
                       m, input=f"d output / d {name} (output index, then input index)", step=tol.fd_step,
                       rtol=tol.fd_rtol)
    return m.rel_error


def _directional(ctx: Context, c: np.ndarray, grads: list[np.ndarray], rng: np.random.Generator) -> float:
    """<c, f(x + h v) - f(x - h v)> / 2h against sum_k <g_k, v_k>, for random v over all inputs."""
    tol, h = ctx.tol, ctx.tol.fd_step
    worst = 0.0
    for r in range(DIRECTIONS):
        vs = {k: rng.standard_normal(ctx.arrays[k].shape) for k in ctx.diff}
        analytic = sum(float(np.sum(g * vs[k])) for k, g in zip(ctx.diff, grads))

        def numeric_at(step: float, vs: dict[int, np.ndarray] = vs) -> float:
            plus, minus = list(ctx.arrays), list(ctx.arrays)
            for k, v in vs.items():
                plus[k], minus[k] = ctx.arrays[k] + step * v, ctx.arrays[k] - step * v
            return float(np.sum(c * (ctx.forward(plus) - ctx.forward(minus)))) / (2 * step)

        m = difference_mismatch(analytic, numeric_at, h, tol.fd_rtol, tol.fd_atol)
        if m.ratio > 1:
            raise ctx.fail("b", "directional derivative along a random direction through all inputs disagrees",
                           m, input=f"direction {r}", step=h, rtol=tol.fd_rtol)
        worst = max(worst, m.rel_error)
    return worst


def check_c_linearity(ctx: Context) -> None:
    """(c) VJP(a c1 + b c2) = a VJP(c1) + b VJP(c2), and VJP(0) = 0: the rule uses its cotangent linearly."""
    rng, rtol = ctx.rng(2), ctx.tol.exact_rtol
    shape = ctx.call.shape if ctx.call is not None else ()
    c1, c2 = random_cotangent(rng, shape), random_cotangent(rng, shape)
    a, b = rng.uniform(0.5, 2.0) * rng.choice([-1, 1]), rng.uniform(0.5, 2.0) * rng.choice([-1, 1])
    g1, g2 = _evaluated(ctx, "c", ctx.arrays, c1), _evaluated(ctx, "c", ctx.arrays, c2)
    mixed = _evaluated(ctx, "c", ctx.arrays, a * c1 + b * c2)
    zero = _evaluated(ctx, "c", ctx.arrays, np.zeros(shape))
    for k, x1, x2, xm, x0 in zip(ctx.diff, g1, g2, mixed, zero):
        name = ctx.specs[k].name
        expected = a * x1 + b * x2
        scale = max(float(np.max(np.abs(a * x1), initial=0)), float(np.max(np.abs(b * x2), initial=0)), 1e-300)
        m = worst_mismatch(xm, expected, rtol, rtol * scale, rel_floor=0)
        if m.ratio > 1:
            raise ctx.fail("c", f"VJP for {name!r} is not linear in the cotangent: VJP({a:.3g} c1 + {b:.3g} c2) "
                           f"!= {a:.3g} VJP(c1) + {b:.3g} VJP(c2)", m, input=name, rtol=rtol)
        m = worst_mismatch(x0, np.zeros_like(x0), rtol, rtol * max(scale, 1.0))
        if m.ratio > 1:
            raise ctx.fail("c", f"a zero cotangent gives a nonzero gradient for {name!r} (is the cotangent ignored?)",
                           m, input=name, rtol=rtol)


def check_d_adjoint(ctx: Context) -> None:
    """(d) for linear ops, <op(u), c> = sum_k <u_k, VJP_k(c)> exactly: no finite differences."""
    op, rng, rtol = ctx.op, ctx.rng(3), ctx.tol.exact_rtol
    shape = ctx.call.shape if ctx.call is not None else ()
    groups = ([[k for k in ctx.diff]] if op.jointly_linear
              else [[op.inputs.index(op.input(n))] for n in op.linear_in if op.input(n).differentiable])
    for group in groups:
        arrays = list(ctx.arrays)
        for k in group:
            arrays[k] = rng.standard_normal(arrays[k].shape)
        c = random_cotangent(rng, shape)
        y = ctx.forward(arrays)
        grads = _evaluated(ctx, "d", arrays, c)
        lhs = float(np.sum(y * c))
        terms = [arrays[k] * grads[ctx.diff.index(k)] for k in group]
        rhs = float(sum(np.sum(t) for t in terms))
        scale = float(np.sum(np.abs(y * c)) + sum(np.sum(np.abs(t)) for t in terms)) + 1e-300
        m = worst_mismatch(np.array(rhs), np.array(lhs), rtol, rtol * scale, rel_floor=0)
        if m.ratio > 1:
            names = ", ".join(ctx.specs[k].name for k in group)
            raise ctx.fail("d", f"adjoint test in ({names}): sum <u, VJP(c)> (analytic) != <op(u), c> (expected); "
                           "the op is declared linear there", m, input=names, rtol=rtol, arrays=arrays)


def check_e_second_order(ctx: Context) -> tuple[bool, float]:
    """(e) the gradient of <w, VJP(x, c)> in (x, c) against finite differences along random directions.

    Returns ``(ran, worst rel error)``; it does not run when the gradient graph uses an op whose
    own gradient is not implemented.
    """
    tol, rng, h = ctx.tol, ctx.rng(4), ctx.tol.fd_step
    assert ctx.cotangent is not None
    weights = [var(f"w_{ctx.specs[k].name}", ctx.arrays[k].shape, "float64") for k in ctx.diff]
    terms = [g * w for g, w in zip(ctx.grads, weights)]
    from opgrad import ops

    s = ops.sum(terms[0])
    for t in terms[1:]:
        s = s + ops.sum(t)
    wrt = [*(ctx.params[k] for k in ctx.diff), ctx.cotangent]
    try:
        second = gradients(s, wrt)
    except GradientError as exc:
        if "not implemented" in str(exc):
            return False, 0.0
        raise ctx.fail("e", f"differentiating the gradient raised GradientError: {exc}") from None
    params = [*ctx.params, ctx.cotangent, *weights]
    value_fn, grad_fn = Function(params, s), Function(params, second)
    c = random_cotangent(rng, ctx.cotangent.shape)
    w = [rng.standard_normal(ctx.arrays[k].shape) for k in ctx.diff]
    try:
        analytic = list(evaluate(grad_fn, *ctx.arrays, c, *w))
    except Exception as exc:
        raise ctx.fail("e", f"evaluating the second-order gradient raised {type(exc).__name__}: {exc}") from None
    worst = 0.0
    for r in range(DIRECTIONS):
        directions = [rng.standard_normal(a.shape) for a in (*(ctx.arrays[k] for k in ctx.diff), c)]

        def value_at(t: float, directions: list[np.ndarray] = directions) -> float:
            moved = list(ctx.arrays)
            for k, v in zip(ctx.diff, directions):
                moved[k] = ctx.arrays[k] + t * v
            return float(np.asarray(evaluate(value_fn, *moved, c + t * directions[-1], *w)))

        def numeric_at(step: float, value_at: Callable[[float], float] = value_at) -> float:
            return (value_at(step) - value_at(-step)) / (2 * step)

        along = float(sum(np.sum(g * v) for g, v in zip(analytic, directions)))
        m = difference_mismatch(along, numeric_at, h, tol.fd_rtol, tol.fd_atol)
        if m.ratio > 1:
            if kinked_along(value_at, h, tol.fd_rtol, tol.fd_atol):
                # The gradient itself has a kink this close (softsign's second derivative jumps at
                # 0): no step resolves the second derivative here, so this direction proves nothing.
                ctx.skipped.append(f"e: a direction through a kink of the gradient within {h / 16:.1e} skipped")
                continue
            raise ctx.fail("e", "second order: the gradient of <w, VJP(x, c)> disagrees with finite differences "
                           "along a random direction in (inputs, cotangent)", m, input=f"direction {r}", step=h,
                           rtol=tol.fd_rtol)
        worst = max(worst, m.rel_error)
    return True, worst


def check_f_kinks(ctx: Context) -> None:
    """(f) with inputs placed exactly on kinks, the VJP equals the declared subgradient convention."""
    kinks = ctx.op.kinks
    assert kinks is not None and kinks.place is not None and kinks.subgradient is not None
    rng, rtol = ctx.rng(5), ctx.tol.exact_rtol
    placed = kinks.place(rng, [a.copy() for a in ctx.arrays], ctx.example.case.attrs)
    c = random_cotangent(rng, ctx.call.shape if ctx.call is not None else ())
    grads = _evaluated(ctx, "f", placed, c)
    expected = kinks.subgradient(placed, c, ctx.example.case.attrs)
    for k, g in zip(ctx.diff, grads):
        want = expected[k]
        if want is None:
            continue
        name = ctx.specs[k].name
        m = worst_mismatch(g, want, rtol, rtol * max(1.0, float(np.max(np.abs(c), initial=0))), rel_floor=0)
        if m.ratio > 1:
            raise ctx.fail("f", f"at a kink the gradient for {name!r} breaks the declared convention "
                           f"({kinks.convention})", m, input=name, rtol=rtol, arrays=placed)


def check_g_backend(ctx: Context, backend: Backend | None) -> bool:
    """(g) the forward (and, for a non-reference backend, the VJP) equals the numpy reference.

    Returns False when the backend supports none of the graphs (an op without a lowering)."""
    op, case = ctx.op, ctx.example.case
    for dtype in ("float64", "float32"):
        tol = tolerance(dtype)
        arrays = [a.astype(dtype) if spec.kind == "float" else a for spec, a in zip(ctx.specs, ctx.arrays)]
        params = [var(spec.name, s, dtype if spec.kind == "float" else "int64")
                  for spec, s in zip(ctx.specs, case.shapes)]
        call = op(*params, **case.attrs)
        # The reference backend casts each forward's result to the promised type, so a forward
        # computing in another precision would pass unseen there, and differ from every backend.
        try:
            result = op.reference_fn(*arrays, **case.attrs)
        except Exception as exc:
            raise ctx.fail("g", f"the forward in {dtype} raised {type(exc).__name__}: {exc}{raised_in(exc, op)}",
                           dtype=dtype) from None
        if not isinstance(result, (np.ndarray, np.generic)):
            raise ctx.fail("g", f"the forward returns a {type(result).__name__}, not a numpy array (return "
                           "np.asarray(...) of the op's dtype)", input="output", dtype=dtype)
        forward = np.asarray(result)
        if forward.dtype != np.dtype(call.dtype):
            raise ctx.fail("g", f"the forward returns {forward.dtype} for {dtype} inputs; its shape rule promises "
                           f"{call.dtype} (cast the result, e.g. .astype(data.dtype))", input="output", dtype=dtype)
        if dtype == "float32" and forward.dtype == np.float32:
            # The float32 forward is what training runs; the reference backend has no other to compare.
            with np.errstate(all="ignore"):
                want = np.asarray(op.reference_fn(*[a.astype(np.float64) if spec.kind == "float" else a
                                                    for spec, a in zip(ctx.specs, arrays)], **case.attrs))
            m = float32_mismatch(forward, want)
            if m.ratio > 1:
                raise ctx.fail("g", "the forward in float32 differs from the float64 forward on the same inputs by "
                               "more than float32's rounding", m, input="output", rtol=FLOAT32_RTOL, dtype=dtype)
        fns = [("output", Function(params, call))]
        if backend is not None and ctx.vjp_fn is not None and ctx.rule is not None and dtype == "float64":
            fns.append(("gradient", ctx.vjp_fn))
        supports = getattr(backend, "supports", None)
        fns = [(what, fn) for what, fn in fns if supports is None or supports(fn)]
        if not fns:
            return False
        for what, fn in fns:
            args = arrays if what == "output" else [*arrays, random_cotangent(ctx.rng(6), fn.params[-1].shape)]
            runner = None
            try:
                expected = evaluate(fn, *args)
                runner = backend(fn) if backend is not None else None
                got = runner(*args) if runner is not None else expected
            except Exception as exc:
                raise ctx.fail("g", f"evaluating the {what} in {dtype} raised {type(exc).__name__}: {exc}"
                                    f"{raised_in(exc, op)}", dtype=dtype) from None
            pairs = zip(got, expected) if isinstance(expected, tuple) else [(got, expected)]
            for got_k, exp_k in pairs:
                got_k = np.asarray(got_k)
                if got_k.shape != exp_k.shape or got_k.dtype != exp_k.dtype:
                    raise ctx.fail("g", f"the backend's {what} is {got_k.dtype}{list(got_k.shape)}, the reference's "
                                   f"{exp_k.dtype}{list(exp_k.shape)}", input=what, dtype=dtype)
                m = worst_mismatch(got_k, exp_k, tol.backend_rtol, tol.backend_atol)
                if m.ratio > 1:
                    raise ctx.fail("g", f"the backend's {what} in {dtype} differs from the numpy reference", m,
                                   input=what, rtol=tol.backend_rtol, dtype=dtype)
            if runner is not None:
                _compare_nonfinite(ctx, fn, what, dtype, args, runner, tol)
    return True


def nonfinite_variants(arrays: Sequence[np.ndarray], float_inputs: Sequence[int],
                       rng: np.random.Generator) -> list[tuple[str, list[np.ndarray]]]:
    """Copies of ``arrays`` with one NaN, +inf or -inf placed in one float input at a time."""
    variants = []
    for i in float_inputs:
        if arrays[i].size == 0:
            continue
        for value in (np.nan, np.inf, -np.inf):
            changed = [a.copy() for a in arrays]
            changed[i].flat[int(rng.integers(arrays[i].size))] = value
            variants.append((f"{value} at one element of input {i}", changed))
    return variants


def _compare_nonfinite(ctx: Context, fn: Function, what: str, dtype: str, args: Sequence[np.ndarray],
                       compiled: Callable[..., Any], tol: Tolerance) -> None:
    """A non-finite input gives NaN and inf at the same places, with the same signs, as the reference."""
    float_inputs = [i for i, p in enumerate(fn.params) if p.dtype in ("float32", "float64")]
    for label, changed in nonfinite_variants(args, float_inputs, ctx.rng(11)):
        with np.errstate(all="ignore"):
            expected = evaluate(fn, *changed)
            got = compiled(*changed)
        pairs = zip(got, expected) if isinstance(expected, tuple) else [(got, expected)]
        for got_k, exp_k in pairs:
            got_k, exp_k = np.asarray(got_k), np.asarray(exp_k)
            for name, test in (("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)):
                differ = test(got_k) != test(exp_k)
                if differ.any():
                    index = tuple(int(k) for k in np.unravel_index(int(np.argmax(differ)), differ.shape))
                    raise ctx.fail("g", f"with {label}, the backend's {what} in {dtype} has {got_k[index]} at "
                                   f"{index} where the numpy reference has {exp_k[index]} ({name} must agree)",
                                   input=what, dtype=dtype, arrays=changed)
            finite = np.isfinite(exp_k)
            m = worst_mismatch(got_k[finite], exp_k[finite], tol.backend_rtol, tol.backend_atol)
            if m.ratio > 1:
                raise ctx.fail("g", f"with {label}, the backend's finite {what} values in {dtype} differ from the "
                               "numpy reference", m, input=what, rtol=tol.backend_rtol, dtype=dtype, arrays=changed)
