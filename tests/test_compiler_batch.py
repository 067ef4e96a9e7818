"""batch_matmul compiles to one GEMM kernel with a loop over the batch, and small GEMMs to a loop nest."""

from __future__ import annotations

import re

import numpy as np
import pytest

import opgrad
from opgrad import ops
from opgrad.compiler import plan_graph


def _batch_fn(ba: int, bb: int, m: int, k: int, n: int, dtype: str = "float32") -> opgrad.Function:
    a, b = opgrad.var("a", (ba, m, k), dtype), opgrad.var("b", (bb, k, n), dtype)
    return opgrad.function([a, b], ops.batch_matmul(a, b))


def _defined(ir: str) -> int:
    return len(re.findall(r"^define ", ir, flags=re.M))


def test_code_size_does_not_grow_with_the_batch() -> None:
    small, large = plan_graph(_batch_fn(2, 2, 4, 5, 3)).ir, plan_graph(_batch_fn(1000, 1000, 4, 5, 3)).ir
    assert _defined(small) == _defined(large)
    assert abs(len(small) - len(large)) < 200  # only the batch constants differ


@pytest.mark.parametrize(("ba", "bb", "m", "k", "n", "dtype"), [
    (300, 300, 4, 5, 3, "float32"),    # many tiny entries, spread over the threads
    (3, 1, 33, 70, 90, "float64"),     # b broadcast, packed engine per entry
    (1, 5, 7, 3, 9, "float32"),        # a broadcast
    (2, 2, 130, 150, 140, "float32"),  # entries big enough to split each over the threads
])
def test_batch_matmul_and_its_gradient_equal_the_reference(ba: int, bb: int, m: int, k: int, n: int,
                                                           dtype: str) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ba, m, k)).astype(dtype)
    y = rng.standard_normal((bb, k, n)).astype(dtype)
    fn = _batch_fn(ba, bb, m, k, n, dtype)
    tol = 2e-5 if dtype == "float32" else 1e-10
    np.testing.assert_allclose(opgrad.compile(fn)(x, y), np.matmul(x, y), rtol=tol, atol=tol * np.sqrt(k))
    loss = opgrad.function(fn.params, ops.sum(ops.multiply(fn.outputs[0], fn.outputs[0])))
    step = opgrad.grad(loss, wrt=["a", "b"])
    for got, want in zip(opgrad.compile(step)(x, y), opgrad.evaluate(step, x, y), strict=True):
        scale = max(1.0, float(np.abs(want).max()))
        assert np.abs(got - want).max() <= 1e-4 * scale


@pytest.mark.parametrize(("alpha", "accumulate"), [(1.0, False), (0.5, True)])
def test_small_gemm_loop_nest_honours_alpha_and_accumulate(alpha: float, accumulate: bool) -> None:
    from opgrad.compiler import gemm_kernel
    from opgrad.compiler.gemm import GemmSpec

    rng = np.random.default_rng(1)
    a = rng.standard_normal((9, 7)).astype(np.float32)
    b = rng.standard_normal((5, 7)).astype(np.float32)  # used transposed: a strided operand
    c = rng.standard_normal((9, 5)).astype(np.float32)
    want = (c if accumulate else 0) + alpha * (a @ b.T)
    kernel = gemm_kernel(GemmSpec.dense(9, 5, 7, trans_b=True, alpha=alpha, accumulate=accumulate))
    kernel(a, b, c)
    np.testing.assert_allclose(c, want, rtol=1e-5, atol=1e-5)


def test_split_module_defines_every_function_once() -> None:
    from opgrad.compiler.split import DEFINE, split_module

    ir = plan_graph(_batch_fn(3, 1, 33, 70, 90)).ir
    parts = split_module(ir, 2)
    assert len(parts) == 2
    defined = [m.group("name") for text in parts for line in text.splitlines() if (m := DEFINE.match(line))]
    whole = [m.group("name") for line in ir.splitlines() if (m := DEFINE.match(line))]
    assert sorted(defined) == sorted(whole)
    assert split_module("@state = internal global i32 0\n" + ir, 2) == ["@state = internal global i32 0\n" + ir]


def test_a_module_cut_in_parts_runs_and_loads_from_the_cache(monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: object) -> None:
    from opgrad.compiler import jit

    monkeypatch.setenv("OPGRAD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(jit, "SPLIT_MIN_CHARS", 0)
    monkeypatch.setattr(jit, "SPLIT_PART_CHARS", 1)
    monkeypatch.setattr(jit, "available_cpus", lambda: 3)
    a, b = opgrad.var("a", (20, 30), "float32"), opgrad.var("b", (30, 40), "float32")
    fn = opgrad.function([a, b], ops.relu(ops.matmul(ops.tanh(a), b)))
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((20, 30)).astype(np.float32), rng.standard_normal((30, 40)).astype(np.float32)
    want = np.maximum(np.tanh(x) @ y, 0)
    cold = opgrad.compile(fn)
    assert not cold.cache_hit and cold.times.parts > 1
    np.testing.assert_allclose(cold(x, y), want, rtol=1e-5, atol=1e-5)
    warm = opgrad.compile(fn)
    assert warm.cache_hit and warm.times.parts == cold.times.parts
    np.testing.assert_allclose(warm(x, y), want, rtol=1e-5, atol=1e-5)
