"""New operators against PyTorch (float64 forward and gradients) and compiled against the reference.

Cases are picked by hand where the checker's random draws rarely go: odd sizes, exact ties, the
bounds of clip, negative axes, keepdims, broadcast batches, NaN inputs. PyTorch is a test-only
dependency: without it this module is skipped locally, and fails under CI=true.
"""

from __future__ import annotations

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
