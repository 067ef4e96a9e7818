"""Native code never takes the process down, and compiled results keep NaN and inf like the reference.

Cases that could crash natively run in a child process: a crash there fails the test with the
child's output instead of ending the test run.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import opgrad
from opgrad import CompileError, ops
from opgrad.compiler import jit
from opgrad.compiler.jit import NativeModule, ObjectCache

ROOT = Path(__file__).resolve().parents[1]


def _run_child(code: str, tmp_path: Path, timeout: float = 300) -> str:
    env = {**os.environ, "OPGRAD_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, f"child exited with {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


# ----- the shapes that aborted LLVM's loop vectorizer on AVX-512 hosts -----


@pytest.mark.parametrize("classes", [64, 72, 80, 90, 96, 1000])
def test_softmax_cross_entropy_compiles_for_the_class_counts_that_aborted(tmp_path: Path, classes: int) -> None:
    out = _run_child(f"""
        import numpy as np, opgrad
        from opgrad import ops
        x = opgrad.var("x", (2, {classes})); labels = opgrad.var("labels", (2,), "int64")
        fn = opgrad.grad(opgrad.function([x, labels], ops.softmax_cross_entropy(x, labels)), wrt=["x"])
        rng = np.random.default_rng(0)
        args = (rng.standard_normal((2, {classes})).astype(np.float32), np.array([0, {classes} - 1]))
        got, want = opgrad.compile(fn)(*args), opgrad.evaluate(fn, *args)
        assert all(np.allclose(g, w, rtol=1e-5, atol=1e-6) for g, w in zip(got, want)), (got, want)
        print("ok")
    """, tmp_path)
    assert out.strip() == "ok"


def test_softmax_rows_of_75_to_140_compile(tmp_path: Path) -> None:
    out = _run_child("""
        import numpy as np, opgrad
        from opgrad import ops
        rng = np.random.default_rng(1)
        for n in (75, 89, 101, 113, 127, 140):
            for op in (ops.softmax, ops.log_softmax):
                x = opgrad.var("x", (3, n))
                fn = opgrad.function([x], op(x, axis=-1))
                a = rng.standard_normal((3, n)).astype(np.float32)
                assert np.allclose(opgrad.compile(fn)(a), opgrad.evaluate(fn, a), rtol=1e-5, atol=1e-6), (n, op)
        print("ok")
    """, tmp_path)
    assert out.strip() == "ok"


# ----- an LLVM abort becomes a warning with working code, or a CompileError -----

_MAXNUM_ROWS = """
declare float @llvm.maxnum.f32(float, float)
define void @rowmax(ptr noalias %x, ptr noalias %out, i64 %rows) nounwind {
entry:
  br label %row
row:
  %r = phi i64 [0, %entry], [%r.next, %row.end]
  %base = mul i64 %r, 72
  br label %col
col:
  %c = phi i64 [0, %row], [%c.next, %col]
  %acc = phi float [0xFFF0000000000000, %row], [%m, %col]
  %i = add i64 %base, %c
  %p = getelementptr inbounds float, ptr %x, i64 %i
  %v = load float, ptr %p
  %m = call float @llvm.maxnum.f32(float %acc, float %v)
  %c.next = add i64 %c, 1
  %cdone = icmp eq i64 %c.next, 72
  br i1 %cdone, label %row.end, label %col
row.end:
  %po = getelementptr inbounds float, ptr %out, i64 %r
  store float %m, ptr %po
  %r.next = add i64 %r, 1
  %rdone = icmp eq i64 %r.next, %rows
  br i1 %rdone, label %exit, label %row
exit:
  ret void
}
"""


def test_ir_that_aborts_llvm_leaves_the_process_running(tmp_path: Path) -> None:
    """A maxnum reduction over 72 floats trips an assertion in LLVM 22's loop vectorizer on
    AVX-512 hosts; the worker dies, the module is rebuilt without the loop vectorizer, and the
    code computes the right maxima. Hosts whose LLVM does not abort simply compile it."""
    out = _run_child(f"""
        import ctypes, warnings, numpy as np
        from opgrad.compiler.jit import NativeModule
        from opgrad import CompileWarning
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            m = NativeModule({_MAXNUM_ROWS!r}, use_cache=False, what="rowmax test")
        for w in caught:
            assert issubclass(w.category, CompileWarning), w
            text = str(w.message)
            assert "kernel rowmax" in text and "rowmax test" in text and "host CPU" in text, text
        f = m.cfunc("rowmax", None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
        x = np.random.default_rng(0).random((5, 72)).astype(np.float32)
        out = np.zeros(5, np.float32)
        f(x.ctypes.data, out.ctypes.data, 5)
        assert np.array_equal(out, x.max(axis=1))
        print("warned" if caught else "compiled")
    """, tmp_path)
    assert out.strip() in ("warned", "compiled")


@pytest.fixture
def crashing_worker(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every compile worker aborts, as one would on an LLVM assertion."""
    jit.close_worker()
    monkeypatch.setattr(jit, "worker_command", lambda: [sys.executable, "-c", "import os; os.abort()"])
    monkeypatch.delenv("OPGRAD_COMPILE_IN_PROCESS", raising=False)
    yield
    jit.close_worker()


def test_worker_crash_is_a_compile_error_naming_function_kernel_and_cpu(crashing_worker: None,
                                                                        tmp_path: Path) -> None:
    x = opgrad.var("x", (3, 72))
    fn = opgrad.function([x], ops.softmax(x))
    with pytest.raises(CompileError) as info:
        NativeModule(
            _softmax_ir(fn), cache=ObjectCache(tmp_path), what="function (x: float32[3, 72]) -> (softmax)",
            kernel_labels={"opgrad_graph.red1": "softmax"})
    text = str(info.value)
    assert "function (x: float32[3, 72]) -> (softmax)" in text
    assert "opgrad_graph." in text and "(softmax)" in text
    assert f"host CPU {jit.host_target().cpu}" in text
    assert not list(tmp_path.glob("*.o")), "nothing is cached for a failed compile"


def test_compile_after_a_crash_gets_a_fresh_worker(crashing_worker: None, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(CompileError):
        NativeModule(_DOUBLE, use_cache=False)
    monkeypatch.undo()
    f = NativeModule(_DOUBLE, use_cache=False).cfunc("f", ctypes.c_double, ctypes.c_double)
    assert f(2.0) == 6.0


def _softmax_ir(fn: opgrad.Function) -> str:
    from opgrad.compiler.graph import _Lowering  # the IR opgrad.compile would hand to the worker

    low = _Lowering(fn)
    low.run()
    return low.kb.finish()


_DOUBLE = """
define double @f(double %x) {
  %y = fmul double %x, 0x4008000000000000
  ret double %y
}
"""


def test_in_process_switch_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPGRAD_COMPILE_IN_PROCESS", "yes")
    with pytest.raises(ValueError, match="OPGRAD_COMPILE_IN_PROCESS='yes'"):
        NativeModule(_DOUBLE, use_cache=False)
    monkeypatch.setenv("OPGRAD_COMPILE_IN_PROCESS", "1")
    assert NativeModule(_DOUBLE, use_cache=False).cfunc("f", ctypes.c_double, ctypes.c_double)(1.0) == 3.0


# ----- the object cache -----


def test_cache_entry_copied_over_another_key_is_rejected(tmp_path: Path) -> None:
    store = ObjectCache(tmp_path)
    first = NativeModule(_DOUBLE, cache=store)
    other_ir = _DOUBLE.replace("0x4008000000000000", "0x4010000000000000")  # x * 4
    second = NativeModule(other_ir, cache=store)
    store.path(second.key).write_bytes(store.path(first.key).read_bytes())  # x * 3 under x * 4's name
    with pytest.warns(UserWarning, match="entry of another key"):
        again = NativeModule(other_ir, cache=store)
    assert not again.times.cache_hit
    assert again.cfunc("f", ctypes.c_double, ctypes.c_double)(1.0) == 4.0
    assert ObjectCache.check(store.path(second.key).read_bytes(), second.key) is None


# ----- NaN and inf: compiled == reference -----


def _both(fn: opgrad.Function, *args: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(opgrad.compile(fn)(*args)), np.asarray(opgrad.evaluate(fn, *args))


def _same_nonfinite(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_relu_keeps_nan_and_inf(dtype: str) -> None:
    x = opgrad.var("x", (4,), dtype)
    got, want = _both(opgrad.function([x], ops.relu(x)), np.array([np.nan, -1, 0, np.inf], dtype))
    np.testing.assert_array_equal(want, np.array([np.nan, 0, 0, np.inf], dtype))
    _same_nonfinite(got, want)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_max_pool_window_with_nan_is_nan(dtype: str) -> None:
    x = opgrad.var("x", (1, 1, 4, 4), dtype)
    data = np.arange(16, dtype=dtype).reshape(1, 1, 4, 4)
    data[0, 0, 1, 1] = np.nan
    data[0, 0, 3, 2] = -np.inf
    got, want = _both(opgrad.function([x], ops.max_pool2d(x, pool_size=2)), data)
    assert np.isnan(want[0, 0, 0, 0]) and np.isfinite(want[0, 0, 1, 1])
    _same_nonfinite(got, want)


@pytest.mark.parametrize("make", [
    lambda x: ops.sum(ops.relu(x)),
    lambda x: ops.sum(ops.max_pool2d(x, pool_size=2)),
    lambda x: ops.sum(ops.softmax(x, axis=-1)),
    lambda x: ops.sum(ops.log_softmax(x, axis=1)),
], ids=["sum_relu", "sum_max_pool", "sum_softmax", "sum_log_softmax"])
def test_reductions_do_not_hide_a_nan(make) -> None:
    x = opgrad.var("x", (2, 3, 6, 6))
    data = np.random.default_rng(0).standard_normal((2, 3, 6, 6)).astype(np.float32)
    data[1, 2, 5, 5] = np.nan
    got, want = _both(opgrad.function([x], make(x)), data)
    assert np.isnan(want) and np.isnan(got)


def test_max_pool_gradient_at_nan_and_all_inf_windows_matches_reference() -> None:
    """As PyTorch: the first NaN of a window takes the gradient; an all -inf window gives it to
    its first element that is not padding."""
    x = opgrad.var("x", (1, 1, 3, 3), "float64")
    data = np.array([[[[1.0, np.nan, 2.0], [np.nan, 0.5, 3.0], [-np.inf, -np.inf, 4.0]]]])
    fn = opgrad.grad(opgrad.function([x], ops.sum(ops.max_pool2d(x, pool_size=2, strides=1, padding=1))))
    got, want = opgrad.compile(fn)(data), opgrad.evaluate(fn, data)
    for g, w in zip(got, want):
        _same_nonfinite(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("op", ["relu", "max_pool2d", "max_pool2d_backward", "max_pool2d_gather", "softmax",
                                "log_softmax", "softmax_cross_entropy", "sum", "dense", "conv2d", "sigmoid",
                                "tanh", "exp", "log", "sqrt", "divide", "where", "avg_pool2d"])
def test_checker_backend_check_feeds_nonfinite_values(op: str) -> None:
    """Check g compares the compiled op with the reference on NaN, +inf and -inf inputs too."""
    from opgrad.checks import check_op, resolve_backend

    report = check_op(op, max_examples=8, seed=3, backend=resolve_backend("llvm"), checks="g")
    assert report.passed, report.failure


# ----- the compile fuzz -----


def test_compile_fuzz_random_graphs(tmp_path: Path) -> None:
    """Random graphs over every lowered op (odd sizes, float32 and float64), values and gradients,
    compiled in a child process; the thorough profile runs thousands."""
    from opgrad.checks.profiles import thorough

    graphs = 2000 if thorough() else 200
    env = {**os.environ, "OPGRAD_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "opgrad.checks.fuzz", "--graphs", str(graphs), "--seed", "0",
                           "--quiet"], capture_output=True, text=True, env=env, timeout=3000, cwd=ROOT)
    assert proc.returncode == 0, f"fuzz exited with {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-3000:]}"
    assert f"{graphs} graphs" in proc.stdout and "no mismatch" in proc.stdout, proc.stdout


def test_fuzz_flags_a_wrong_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fuzzer is not blind: a lowering that is off by a little is found and reported."""
    from opgrad import registry
    from opgrad.checks import fuzz

    tanh = registry.get("tanh")
    original = tanh.lowering_fn

    def slightly_wrong(kb, call, out, data):  # type: ignore[no-untyped-def]
        kb.elementwise(out, [data], lambda s, v: s.mul(s.call("tanh", v[0]), s.const(1.001)))

    monkeypatch.setattr(tanh, "_lowering", slightly_wrong)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = fuzz.run(graphs=30, seed=0, op_names=["tanh"])
    assert original is not None
    assert result.failure is not None and "tanh" in result.failure


def test_cache_dir_that_is_a_file_is_one_line_cli_error(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "cache"
    not_a_dir.write_text("x")
    proc = subprocess.run([sys.executable, "-m", "opgrad.cli", "ops"], capture_output=True, text=True,
                          env={**os.environ, "OPGRAD_CACHE_DIR": str(not_a_dir)}, cwd=ROOT)
    assert proc.returncode == 2
    assert "OPGRAD_CACHE_DIR" in proc.stderr and "is a file" in proc.stderr and "Traceback" not in proc.stderr


def test_stale_cache_temporary_of_a_killed_compile_is_removed(tmp_path: Path) -> None:
    store = ObjectCache(tmp_path)
    first = NativeModule(_DOUBLE, cache=store)
    stale = tmp_path / f".{first.key}.o.tmp-999999999-0123456789ab"  # no such pid
    stale.write_bytes(b"half an object")
    store.path(first.key).unlink()
    NativeModule(_DOUBLE, cache=store)
    assert not stale.exists()
    assert store.path(first.key).exists()


@pytest.mark.parametrize("axis", [0, 1])
def test_softmax_family_over_an_empty_axis(axis: int) -> None:
    """Found by the compile fuzzer: the reference's row maximum failed on a zero-size axis."""
    x = opgrad.var("x", (0, 3) if axis == 0 else (3, 0))
    for op in (ops.softmax, ops.log_softmax):
        fn = opgrad.grad(opgrad.function([x], ops.sum(op(x, axis=axis))))
        data = np.zeros(x.shape, np.float32)
        for got, want in zip(opgrad.compile(fn)(data), opgrad.evaluate(fn, data)):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("make", [
    lambda x, labels: ops.log_softmax(x, axis=1),
    lambda x, labels: ops.softmax(x, axis=1),
    lambda x, labels: ops.softmax_cross_entropy(x, labels),
    lambda x, labels: opgrad.gradients(ops.softmax_cross_entropy(x, labels), [x])[0],
    lambda x, labels: opgrad.gradients(ops.sum(ops.logsumexp(x, axis=1)), [x])[0],
], ids=["log_softmax", "softmax", "softmax_cross_entropy", "its_gradient", "logsumexp_gradient"])
def test_float32_kernels_keep_their_digits_at_logits_near_1e4(make) -> None:
    """Elementwise arithmetic is not reassociated: (x - max) - log(sum) stays in that order, so a
    float32 kernel is as close to the exact value as float32 allows, like the float32 reference."""
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((6, 11)) * 3 + 1e4).astype(np.float32)
    logits[::2] *= -1
    labels = np.arange(6) % 11
    x32, x64 = opgrad.var("x", (6, 11), "float32"), opgrad.var("x", (6, 11), "float64")
    lab = opgrad.var("labels", (6,), "int64")
    got = np.asarray(opgrad.compile(opgrad.function([x32, lab], make(x32, lab)))(logits, labels), np.float64)
    exact = np.asarray(opgrad.evaluate(opgrad.function([x64, lab], make(x64, lab)), logits.astype(np.float64), labels))
    reference = np.asarray(opgrad.evaluate(opgrad.function([x32, lab], make(x32, lab)), logits, labels), np.float64)
    scale = max(1.0, float(np.abs(exact).max()))
    assert float(np.abs(got - exact).max()) <= max(2e-6 * scale, 2 * float(np.abs(reference - exact).max()))
