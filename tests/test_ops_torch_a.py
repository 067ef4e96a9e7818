"""New operators against PyTorch (float64 forward and gradients) and compiled against the reference.

Cases are picked by hand where the checker's random draws rarely go: odd sizes, exact ties, the
bounds of clip, negative axes, keepdims, broadcast batches, NaN inputs. PyTorch is a test-only
dependency: without it this module is skipped locally, and fails under CI=true.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

import opgrad
from opgrad import ops


def _import_torch() -> Any:
    if os.environ.get("CI") == "true":
        import torch  # CI must run these comparisons: a missing torch is an error there

        return torch
    return pytest.importorskip("torch", reason="PyTorch (test-only dependency) is not installed; "
                                               "install torch to compare the new operators with it")


torch = _import_torch()

#: Compiled against reference, relative to max(1, max |reference|) (as tests/test_compiler.py).
COMPILED_TOL = {"float64": 1e-10, "float32": 2e-5}


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _close(got: np.ndarray, want: np.ndarray, tol: float, what: str) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} vs {want.shape}"
    scale = max(1.0, float(np.max(np.abs(want[np.isfinite(want)]), initial=0.0)))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{what}: NaN positions")
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * scale, err_msg=what, equal_nan=True)


def _functions(build: Callable[..., opgrad.Expr], arrays: Sequence[np.ndarray], dtype: str,
               wrt: Sequence[int]) -> tuple[opgrad.Function, opgrad.Function, np.ndarray]:
    """(forward, gradient of <forward, c> in the inputs ``wrt``, the cotangent c)."""
    params = [opgrad.var(f"x{i}", a.shape, dtype if a.dtype.kind == "f" else a.dtype.name)
              for i, a in enumerate(arrays)]
    out = build(*params)
    forward = opgrad.function(params, out)
    c = _rng(7).standard_normal(out.shape) + 0.3
    cvar = opgrad.var("c", out.shape, dtype)
    loss = ops.sum(ops.multiply(out, cvar))
    gradient = opgrad.grad(opgrad.function([*params, cvar], loss), wrt=[params[i] for i in wrt])
    return forward, gradient, c


def against_torch(build: Callable[..., opgrad.Expr], torch_fn: Callable[..., Any], arrays: Sequence[np.ndarray],
                  wrt: Sequence[int] | None = None, tol: float = 1e-12, grad_tol: float | None = None) -> None:
    """Forward and gradients in float64 equal PyTorch's; compiled equals the reference in f32/f64."""
    arrays = [np.asarray(a) for a in arrays]
    floats = [i for i, a in enumerate(arrays) if a.dtype.kind == "f"]
    wrt = floats if wrt is None else list(wrt)
    as64 = [a.astype(np.float64) if a.dtype.kind == "f" else a for a in arrays]
    forward, gradient, c = _functions(build, as64, "float64", wrt)
    value = opgrad.evaluate(forward, *as64)
    tensors = [torch.tensor(a, requires_grad=i in wrt) for i, a in enumerate(as64)]
    expected = torch_fn(*tensors)
    _close(value, expected.detach().numpy(), tol, "forward vs torch")
    if wrt:
        expected.backward(torch.tensor(c))
        grads = opgrad.evaluate(gradient, *as64, c)[1:]
        for k, g in zip(wrt, grads):
            _close(g, tensors[k].grad.numpy(), grad_tol or tol, f"gradient of input {k} vs torch")
    for dtype in ("float64", "float32"):
        cast = [a.astype(dtype) if a.dtype.kind == "f" else a for a in arrays]
        fwd, grd, cot = _functions(build, cast, dtype, wrt if wrt else [])
        _close(opgrad.compile(fwd)(*cast), opgrad.evaluate(fwd, *cast), COMPILED_TOL[dtype],
               f"compiled forward {dtype}")
        if wrt:
            args = [*cast, cot.astype(dtype)]
            for k, (got, want) in enumerate(zip(opgrad.compile(grd)(*args), opgrad.evaluate(grd, *args))):
                _close(got, want, COMPILED_TOL[dtype], f"compiled value/gradient {k} {dtype}")


def compiled_matches_reference(build: Callable[..., opgrad.Expr], arrays: Sequence[np.ndarray]) -> None:
    """Forward only, compiled vs reference, NaN/inf included, in both float dtypes."""
    for dtype in ("float64", "float32"):
        cast = [np.asarray(a).astype(dtype) for a in arrays]
        params = [opgrad.var(f"x{i}", a.shape, dtype) for i, a in enumerate(cast)]
        fn = opgrad.function(params, build(*params))
        with np.errstate(all="ignore"):
            want = opgrad.evaluate(fn, *cast)
            got = opgrad.compile(fn)(*cast)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"NaN positions {dtype}")
        np.testing.assert_array_equal(np.isinf(got), np.isinf(want), err_msg=f"inf positions {dtype}")
        _close(got, want, COMPILED_TOL[dtype], f"compiled {dtype}")


ODD = (3, 5, 7)


# ----- activations -----


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu(approximate: str) -> None:
    x = np.concatenate([np.linspace(-6, 6, 101), [0.0, -0.5, 1e-8]]).reshape(8, 13)
    against_torch(lambda a: ops.gelu(a, approximate=approximate),
                  lambda a: torch.nn.functional.gelu(a, approximate=approximate), [x])


def test_erf() -> None:
    x = np.linspace(-4, 4, 35).reshape(5, 7)
    against_torch(ops.erf, torch.erf, [x])


def test_erfc() -> None:
    x = np.linspace(-4, 9, 35).reshape(5, 7)
    against_torch(ops.erfc, torch.erfc, [x])


def test_gelu_keeps_its_digits_far_below_zero_in_float32() -> None:
    """Phi(x) as erfc(-x / sqrt 2) / 2: as 1 + erf(x / sqrt 2) it cancels to 0 below x = -5.5 in float32.
    The tolerance is the tail's conditioning: x / sqrt 2 rounded to float32 moves erfc by about x**2 ulp."""
    x = np.linspace(-10, -3, 57).astype(np.float32)
    exact = np.array([v * math.erfc(-v / math.sqrt(2)) / 2 for v in x.astype(np.float64)])
    slope = np.array([math.erfc(-v / math.sqrt(2)) / 2 + v * math.exp(-v * v / 2) / math.sqrt(2 * math.pi)
                      for v in x.astype(np.float64)])
    var = opgrad.var("x", x.shape)
    value = opgrad.function([var], ops.gelu(var))
    derivative = opgrad.grad(opgrad.function([var], ops.sum(ops.gelu(var))), with_value=False)
    for name, run in (("reference", opgrad.evaluate), ("compiled", lambda fn, a: opgrad.compile(fn)(a))):
        np.testing.assert_allclose(run(value, x), exact, rtol=1e-5, err_msg=f"gelu, {name}")
        np.testing.assert_allclose(run(derivative, x), slope, rtol=1e-5, err_msg=f"gelu's gradient, {name}")


@pytest.mark.parametrize(("beta", "threshold"), [(1.0, 20.0), (2.0, 1.0), (0.5, -1.0), (3.0, 5.0)])
def test_softplus(beta: float, threshold: float) -> None:
    x = np.concatenate([np.linspace(-30, 30, 33), [threshold / beta, 0.0]]).reshape(5, 7)
    against_torch(lambda a: ops.softplus(a, beta=beta, threshold=threshold),
                  lambda a: torch.nn.functional.softplus(a, beta=beta, threshold=threshold), [x])


@pytest.mark.parametrize("alpha", [1.0, 0.3, 2.5])
def test_elu(alpha: float) -> None:
    x = np.concatenate([np.linspace(-5, 5, 34), [0.0]]).reshape(7, 5)
    against_torch(lambda a: ops.elu(a, alpha=alpha), lambda a: torch.nn.functional.elu(a, alpha=alpha), [x])


def test_log_sigmoid() -> None:
    x = np.concatenate([np.linspace(-40, 40, 34), [0.0]]).reshape(5, 7)
    against_torch(ops.log_sigmoid, torch.nn.functional.logsigmoid, [x])


def test_activations_nonfinite_compiled() -> None:
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -1.5, 2.0, 30.0])
    for build in (ops.erf, ops.log_sigmoid, lambda a: ops.gelu(a), lambda a: ops.gelu(a, approximate="tanh"),
                  lambda a: ops.softplus(a, beta=2.0, threshold=1.0), lambda a: ops.elu(a, alpha=0.5)):
        compiled_matches_reference(build, [x])


def test_activation_attribute_errors_name_the_op() -> None:
    x = opgrad.var("x", (3,), "float64")
    with pytest.raises(opgrad.errors.OpCallError, match=r"(?s)gelu.*approximate='exact'.*'none'"):
        ops.gelu(x, approximate="exact")
    with pytest.raises(opgrad.errors.OpCallError, match=r"(?s)softplus.*beta=0.*> 0"):
        ops.softplus(x, beta=0)
    with pytest.raises(opgrad.errors.OpCallError, match=r"(?s)elu.*alpha=nan.*finite"):
        ops.elu(x, alpha=float("nan"))


# ----- elementwise math -----


def test_abs_square_rsqrt() -> None:
    x = np.concatenate([np.linspace(-3, 3, 34), [0.0]]).reshape(5, 7)
    against_torch(ops.abs, torch.abs, [x])  # sign(0) = 0 on both sides
    against_torch(ops.square, torch.square, [x])
    against_torch(ops.rsqrt, torch.rsqrt, [np.linspace(0.01, 9, 35).reshape(7, 5)])


def test_elementwise_math_nonfinite_compiled() -> None:
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, -1.5, 2.0])
    for build in (ops.abs, ops.square, ops.rsqrt, lambda a: ops.clip(a, lo=-1.0, hi=1.0),
                  lambda a: ops.clip(a, hi=0.5), lambda a: ops.cast(a, dtype="float64")):
        compiled_matches_reference(build, [x])
    y = np.array([2.0, 0.5, -1.0, np.nan, 3.0, 0.0, 1.5])
    compiled_matches_reference(ops.power, [np.abs(x), y])
    compiled_matches_reference(ops.power, [x, y])


@pytest.mark.parametrize(("lo", "hi"), [(-1.0, 1.0), (0.0, 0.5), (-0.5, None), (None, 0.25), (0.5, 0.5)])
def test_clip_off_the_bounds_matches_torch(lo: float | None, hi: float | None) -> None:
    x = np.linspace(-2.05, 2.05, 35).reshape(5, 7) + 0.013  # no element exactly on a bound
    against_torch(lambda a: ops.clip(a, lo=lo, hi=hi), lambda a: torch.clamp(a, min=lo, max=hi), [x])


def test_clip_at_the_bounds_passes_no_gradient() -> None:
    """Declared convention: 1 strictly inside (lo, hi); PyTorch's clamp passes the gradient at the bounds."""
    x = np.array([-1.0, -0.5, 0.0, 0.5, 1.0, 2.0, -3.0])
    xv = opgrad.var("x", x.shape, "float64")
    fn = opgrad.grad(opgrad.function([xv], ops.sum(ops.clip(xv, lo=-0.5, hi=0.5))))
    value, dx = opgrad.evaluate(fn, x)
    np.testing.assert_array_equal(dx, [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    t = torch.tensor(x, requires_grad=True)
    torch.clamp(t, -0.5, 0.5).sum().backward()
    np.testing.assert_array_equal(t.grad.numpy(), [0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    assert value == float(np.clip(x, -0.5, 0.5).sum())
    for dtype in ("float32", "float64"):
        xd = opgrad.var("x", x.shape, dtype)
        g = opgrad.grad(opgrad.function([xd], ops.sum(ops.clip(xd, lo=-0.5, hi=0.5))))
        np.testing.assert_array_equal(opgrad.compile(g)(x.astype(dtype))[1], dx.astype(dtype))


def test_clip_errors() -> None:
    x = opgrad.var("x", (3,), "float64")
    with pytest.raises(opgrad.errors.OpCallError, match=r"(?s)clip.*hi=-1.*hi >= lo = 1.0"):
        ops.clip(x, lo=1.0, hi=-1.0)
    with pytest.raises(opgrad.errors.OpCallError, match=r"(?s)clip.*lo=nan"):
        ops.clip(x, lo=float("nan"))


@pytest.mark.parametrize("name", ["maximum", "minimum"])
def test_maximum_minimum_ties_and_broadcasting(name: str) -> None:
    rng = _rng(1)
    lhs = rng.integers(-2, 3, (3, 1, 5)).astype(np.float64)  # small integers: many exact ties
    rhs = rng.integers(-2, 3, (4, 1)).astype(np.float64)
    against_torch(getattr(ops, name), getattr(torch, name), [lhs, rhs])
    same = rng.standard_normal((5, 3))
    against_torch(getattr(ops, name), getattr(torch, name), [same, same.copy()])  # every element ties


@pytest.mark.parametrize("name", ["maximum", "minimum"])
def test_maximum_minimum_propagate_nan(name: str) -> None:
    lhs = np.array([np.nan, 1.0, np.nan, -np.inf, np.inf, 2.0])
    rhs = np.array([0.0, np.nan, np.nan, 1.0, np.nan, -np.inf])
    want = getattr(torch, name)(torch.tensor(lhs), torch.tensor(rhs)).numpy()
    a, b = opgrad.var("a", (6,), "float64"), opgrad.var("b", (6,), "float64")
    fn = opgrad.function([a, b], getattr(ops, name)(a, b))
    np.testing.assert_array_equal(opgrad.evaluate(fn, lhs, rhs), want)
    compiled_matches_reference(getattr(ops, name), [lhs, rhs])


def test_power() -> None:
    rng = _rng(2)
    base = rng.uniform(0.1, 3.0, (3, 5))
    exponent = np.concatenate([rng.uniform(-2.5, 2.5, 4), [0.0]])
    against_torch(ops.power, torch.pow, [base, exponent], tol=1e-11)
    # negative bases with integer exponents: the forward (and the base's gradient) are defined
    against_torch(ops.power, torch.pow, [np.array([-2.0, -0.5, 1.5, -3.0]), np.array([2.0, 3.0, -1.0, 0.0])],
                  wrt=[0])


def test_stop_gradient_blocks_the_gradient() -> None:
    x = np.linspace(-1, 1, 7)
    against_torch(lambda a: ops.multiply(ops.stop_gradient(a), a), lambda a: a.detach() * a, [x])
    xv = opgrad.var("x", (7,), "float64")
    fn = opgrad.grad(opgrad.function([xv], ops.sum(ops.stop_gradient(ops.square(xv)))))
    np.testing.assert_array_equal(opgrad.evaluate(fn, x)[1], np.zeros(7))
    assert not opgrad.registry.get("stop_gradient").gradient_status.registered


@pytest.mark.parametrize(("src", "dst"), [("float64", "float32"), ("float32", "float64"), ("float64", "float64")])
def test_cast(src: str, dst: str) -> None:
    x = (_rng(3).standard_normal((3, 5)) * 1e3).astype(src)
    xv = opgrad.var("x", x.shape, src)
    out = ops.cast(xv, dtype=dst)
    assert out.dtype == dst
    fn = opgrad.function([xv], out)
    want = torch.tensor(x).to(getattr(torch, dst)).numpy()
    np.testing.assert_array_equal(opgrad.evaluate(fn, x), want)
    np.testing.assert_array_equal(opgrad.compile(fn)(x), want)
    c = opgrad.var("c", x.shape, dst)
    g = opgrad.grad(opgrad.function([xv, c], ops.sum(ops.multiply(out, c))), wrt=[xv])
    cot = _rng(4).standard_normal(x.shape).astype(dst)
    t = torch.tensor(x, requires_grad=True)
    t.to(getattr(torch, dst)).backward(torch.tensor(cot))
    for backend in (lambda f: (lambda *a: opgrad.evaluate(f, *a)), opgrad.compile):
        dx = backend(g)(x, cot)[1]
        assert dx.dtype == np.dtype(src)
        np.testing.assert_array_equal(dx, t.grad.numpy())


def test_cast_mixed_dtypes_then_combine() -> None:
    """cast is how a float32 and a float64 tensor meet: other ops refuse mixed dtypes."""
    a, b = opgrad.var("a", (3,), "float32"), opgrad.var("b", (3,), "float64")
    with pytest.raises(opgrad.errors.OpCallError, match="mix dtypes"):
        ops.add(a, b)
    fn = opgrad.grad(opgrad.function([a, b], ops.sum(ops.multiply(ops.cast(a, dtype="float64"), b))))
    x, y = np.array([1, 2, 3], np.float32), np.array([0.5, -1.0, 2.0])
    value, da, db = opgrad.compile(fn)(x, y)
    assert value == np.float64(0.5 - 2.0 + 6.0)
    assert da.dtype == np.float32 and db.dtype == np.float64
    np.testing.assert_array_equal(da, y.astype(np.float32))
    with pytest.raises(opgrad.errors.OpCallError, match=r"(?s)cast.*dtype='int64'.*float32, float64"):
        ops.cast(a, dtype="int64")


# ----- reductions -----

AXES = [None, 1, -1, (0, 2), (-3, -1), (2, 0, 1)]


def _dims(axis: int | tuple[int, ...] | None, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    return (axis,) if isinstance(axis, int) else tuple(axis)


def _torch_reduce(name: str, axis: Any, keepdims: bool) -> Callable[[Any], Any]:
    def fn(t: Any) -> Any:
        dims = _dims(axis, t.ndim)
        if name == "prod":  # torch.prod reduces one dim at a time
            for d in sorted((d % t.ndim for d in dims), reverse=True):
                t = torch.prod(t, dim=d, keepdim=keepdims)
            return t
        torch_name = {"max": "amax", "min": "amin"}.get(name, name)
        return getattr(torch, torch_name)(t, dim=dims, keepdim=keepdims)

    return fn


@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("axis", AXES)
@pytest.mark.parametrize("name", ["mean", "max", "min", "prod", "logsumexp"])
def test_reductions(name: str, axis: Any, keepdims: bool) -> None:
    x = _rng(5).uniform(0.5, 1.5, (3, 5, 7)) * _rng(6).choice([-1.0, 1.0], (3, 5, 7))
    against_torch(lambda a: getattr(ops, name)(a, axis=axis, keepdims=keepdims),
                  _torch_reduce(name, axis, keepdims), [x], tol=1e-11)


@pytest.mark.parametrize("axis", [None, 0, -1, (0, 1)])
@pytest.mark.parametrize("name", ["max", "min"])
def test_max_min_split_ties_like_torch_amax(name: str, axis: Any) -> None:
    x = _rng(8).integers(-1, 2, (5, 7)).astype(np.float64)  # three values: ties everywhere
    against_torch(lambda a: getattr(ops, name)(a, axis=axis, keepdims=True), _torch_reduce(name, axis, True), [x])


@pytest.mark.parametrize("name", ["max", "min"])
def test_max_min_propagate_nan(name: str) -> None:
    x = np.array([[1.0, np.nan, 3.0], [-np.inf, 2.0, -1.0], [np.nan, np.inf, 0.0]])
    xv = opgrad.var("x", x.shape, "float64")
    fn = opgrad.function([xv], getattr(ops, name)(xv, axis=1))
    want = _torch_reduce(name, 1, False)(torch.tensor(x)).numpy()
    np.testing.assert_array_equal(opgrad.evaluate(fn, x), want)
    compiled_matches_reference(lambda a: getattr(ops, name)(a, axis=1), [x])
    compiled_matches_reference(lambda a: getattr(ops, name)(a), [x])


def test_prod_gradient_at_zeros() -> None:
    x = np.array([[2.0, 0.0, 3.0, -1.5],   # one zero: only it gets a gradient (the others' product)
                  [0.0, 4.0, 0.0, 1.0],    # two zeros: no gradient at all
                  [1.5, -2.0, 0.5, 3.0],   # none: prod / x
                  [0.0, 0.0, 0.0, 0.0]])
    for axis in (1, None, (0, 1)):
        against_torch(lambda a, axis=axis: ops.prod(a, axis=axis), _torch_reduce("prod", axis, False), [x])
    against_torch(lambda a: ops.prod(a, axis=0, keepdims=True), _torch_reduce("prod", 0, True), [x])


@pytest.mark.parametrize("axis", [1, None, (0, 1), 0])
def test_prod_second_order_at_zeros_matches_torch(axis: Any) -> None:
    # Rows with one zero, two zeros, none, all zeros, and a zero beside a 1: Hessian-vector
    # products of sum(w * prod(x)) against torch's double backward.
    x = np.array([[2.0, 0.0, 3.0, -1.5],
                  [0.0, 4.0, 0.0, 1.0],
                  [1.5, -2.0, 0.5, 3.0],
                  [0.0, 0.0, 0.0, 0.0],
                  [1.0, 0.0, -0.5, 2.0]])
    gen = np.random.default_rng(3)
    v = gen.standard_normal(x.shape)
    dims = (0, 1) if axis is None else (axis,) if isinstance(axis, int) else axis
    out_shape = tuple(n for i, n in enumerate(x.shape) if i not in dims)
    w = gen.standard_normal(out_shape)

    xv, vv, wv = (opgrad.var(n, a.shape, "float64") for n, a in (("x", x), ("v", v), ("w", w)))
    loss = ops.sum(ops.multiply(ops.prod(xv, axis=axis), wv))
    g = opgrad.gradients(loss, [xv])[0]
    hv = opgrad.gradients(ops.sum(ops.multiply(g, vv)), [xv])[0]
    fn = opgrad.function([xv, vv, wv], [g, hv])
    got_g, got_hv = opgrad.evaluate(fn, x, v, w)

    xt = torch.tensor(x, requires_grad=True)
    t = xt
    for d in sorted(dims, reverse=True):
        t = torch.prod(t, dim=d)
    tg = torch.autograd.grad((t * torch.tensor(w)).sum(), xt, create_graph=True)[0]
    thv = torch.autograd.grad((tg * torch.tensor(v)).sum(), xt)[0]
    np.testing.assert_allclose(got_g, tg.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got_hv, thv.numpy(), rtol=1e-12, atol=1e-12)
    if axis == 1:  # one compile is enough to hold the kernels to the same numbers
        np.testing.assert_allclose(opgrad.compile(fn)(x, v, w)[1], thv.numpy(), rtol=1e-12, atol=1e-12)


def test_logsumexp_float32_at_1e4_keeps_its_digits() -> None:
    x = np.array([[1.0e4, 1.0e4 + 1.0, 1.0e4 - 2.5], [-1.0e4, -1.0e4 + 0.5, -1.0e4 - 3.0]], np.float32)
    truth = torch.logsumexp(torch.tensor(x, dtype=torch.float64), dim=1).numpy()
    xv = opgrad.var("x", x.shape, "float32")
    fn = opgrad.function([xv], ops.logsumexp(xv, axis=-1))
    for got in (opgrad.evaluate(fn, x), opgrad.compile(fn)(x)):
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, truth, rtol=2 * np.finfo(np.float32).eps)
        np.testing.assert_allclose(got, torch.logsumexp(torch.tensor(x), dim=1).numpy(), rtol=2e-7)


def test_logsumexp_nonfinite() -> None:
    x = np.array([[-np.inf, -np.inf, -np.inf], [np.inf, 1.0, 2.0], [np.nan, 1.0, 2.0], [-np.inf, 0.0, 1.0]])
    want = torch.logsumexp(torch.tensor(x), dim=1).numpy()
    xv = opgrad.var("x", x.shape, "float64")
    np.testing.assert_array_equal(opgrad.evaluate(opgrad.function([xv], ops.logsumexp(xv, axis=1)), x), want)
    compiled_matches_reference(lambda a: ops.logsumexp(a, axis=1), [x])
    compiled_matches_reference(lambda a: ops.prod(a, axis=1), [x])
    compiled_matches_reference(lambda a: ops.mean(a, axis=0), [x])


@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("axis", [None, 0, 1, -1])
@pytest.mark.parametrize("name", ["argmax", "argmin"])
def test_argmax_argmin_first_occurrence(name: str, axis: int | None, keepdims: bool) -> None:
    x = _rng(9).integers(-2, 3, (4, 5, 3)).astype(np.float64)  # ties: the first one wins
    for dtype in ("float64", "float32"):
        xv = opgrad.var("x", x.shape, dtype)
        out = getattr(ops, name)(xv, axis=axis, keepdims=keepdims)
        assert out.dtype == "int64"
        fn = opgrad.function([xv], out)
        want = getattr(np, name)(x, axis=axis, keepdims=keepdims)
        for got in (opgrad.evaluate(fn, x.astype(dtype)), opgrad.compile(fn)(x.astype(dtype))):
            assert got.dtype == np.int64 and got.shape == want.shape
            np.testing.assert_array_equal(got, want)
        if axis is not None or not keepdims:
            expected = getattr(torch, name)(torch.tensor(x), dim=axis, keepdim=keepdims).numpy()
            np.testing.assert_array_equal(opgrad.evaluate(fn, x.astype(dtype)), expected)


@pytest.mark.parametrize("name", ["argmax", "argmin"])
def test_argmax_argmin_nan_is_the_first_nan(name: str) -> None:
    x = np.array([[1.0, np.nan, 5.0, np.nan], [np.inf, -np.inf, 2.0, 0.0], [3.0, 3.0, np.nan, -1.0],
                  [np.nan, 0.0, 0.0, 0.0]])
    for axis in (None, 0, 1):
        for dtype in ("float64", "float32"):
            xv = opgrad.var("x", x.shape, dtype)
            fn = opgrad.function([xv], getattr(ops, name)(xv, axis=axis))
            want = getattr(np, name)(x.astype(dtype), axis=axis)
            np.testing.assert_array_equal(opgrad.evaluate(fn, x.astype(dtype)), want)
            np.testing.assert_array_equal(opgrad.compile(fn)(x.astype(dtype)), want)
        np.testing.assert_array_equal(want, getattr(torch, name)(torch.tensor(x), dim=axis).numpy())


def test_argmax_beside_float_results_in_a_compiled_graph() -> None:
    x = _rng(10).standard_normal((6, 4)).astype(np.float32)
    xv = opgrad.var("x", x.shape, "float32")
    fn = opgrad.function([xv], (ops.argmax(xv, axis=1), ops.max(ops.tanh(xv), axis=1), ops.argmin(xv)))
    index, top, first_min = opgrad.compile(fn)(x)
    np.testing.assert_array_equal(index, x.argmax(axis=1))
    np.testing.assert_allclose(top, np.tanh(x).max(axis=1), rtol=1e-6)
    assert first_min.shape == () and first_min == x.argmin()


def test_reduction_errors() -> None:
    x = opgrad.var("x", (3, 4), "float64")
    with pytest.raises(opgrad.errors.OpCallError, match=r"(?s)argmax.*axis=\(0, 1\).*one int axis"):
        ops.argmax(x, axis=(0, 1))
    with pytest.raises(opgrad.errors.OpCallError, match=r"(?s)mean.*axis=2.*out of range for a rank-2"):
        ops.mean(x, axis=2)
    with pytest.raises(opgrad.errors.OpCallError, match=r"(?s)max.*axis=\(1, -1\).*repeated"):
        ops.max(x, axis=(1, -1))
    with pytest.raises(opgrad.errors.OpCallError, match=r"(?s)logsumexp.*zero-size axis"):
        ops.logsumexp(opgrad.var("e", (3, 0), "float64"), axis=1)
    with pytest.raises(opgrad.errors.OpCallError, match=r"(?s)argmin.*zero-size"):
        ops.argmin(opgrad.var("e", (0,), "float64"))
    assert ops.prod(opgrad.var("e", (3, 0), "float64"), axis=1).shape == (3,)  # np.prod: 1 over an empty axis


# ----- matmul -----


@pytest.mark.parametrize(("m", "k", "n"), [(3, 5, 7), (1, 9, 2), (7, 1, 5), (17, 13, 11)])
def test_matmul(m: int, k: int, n: int) -> None:
    rng = _rng(11)
    against_torch(ops.matmul, torch.mm, [rng.standard_normal((m, k)), rng.standard_normal((k, n))], tol=1e-12)


@pytest.mark.parametrize(("batch_a", "batch_b"), [(3, 3), (1, 4), (5, 1), (1, 1)])
def test_batch_matmul_broadcasts_the_batch(batch_a: int, batch_b: int) -> None:
    rng = _rng(12)
    a, b = rng.standard_normal((batch_a, 3, 5)), rng.standard_normal((batch_b, 5, 7))
    against_torch(ops.batch_matmul, torch.matmul, [a, b], tol=1e-12)


def test_batch_matmul_of_transposed_views() -> None:
    """Strided operands (a transpose in the graph) reach the per-batch GEMMs as views."""
    rng = _rng(13)
    a, b = rng.standard_normal((2, 5, 3)), rng.standard_normal((5, 2, 4))
    against_torch(lambda x, y: ops.batch_matmul(ops.transpose(x, axes=(0, 2, 1)), ops.transpose(y, axes=(1, 0, 2))),
                  lambda x, y: torch.matmul(x.transpose(1, 2), y.permute(1, 0, 2)), [a, b], tol=1e-12)


def test_matmul_nonfinite_compiled() -> None:
    rng = _rng(14)
    a, b = rng.standard_normal((4, 3)), rng.standard_normal((3, 5))
    a[1, 2], b[0, 4] = np.nan, np.inf
    compiled_matches_reference(ops.matmul, [a, b])
    compiled_matches_reference(ops.batch_matmul, [a[None], np.stack([b, -b])])


def test_matmul_errors() -> None:
    with pytest.raises(opgrad.errors.OpCallError, match=r"(?s)matmul.*a has 3 columns but b has 4 rows"):
        ops.matmul(opgrad.var("a", (2, 3), "float64"), opgrad.var("b", (4, 5), "float64"))
    with pytest.raises(opgrad.errors.OpCallError, match=r"(?s)matmul.*use batch_matmul"):
        ops.matmul(opgrad.var("a", (1, 2, 3), "float64"), opgrad.var("b", (3, 5), "float64"))
    with pytest.raises(opgrad.errors.OpCallError, match=r"(?s)batch_matmul.*batch sizes 2 and 3"):
        ops.batch_matmul(opgrad.var("a", (2, 2, 3), "float64"), opgrad.var("b", (3, 3, 5), "float64"))
