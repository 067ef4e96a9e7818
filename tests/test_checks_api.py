"""opgrad.checks as users meet it: strategies, check_op's report, check_function, the CLI, pytest."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings

import opgrad
from opgrad import cli, ops
from opgrad.checks import TOLERANCES, check_function, check_op, op_cases, op_examples
from opgrad.checks.mutants import MUTANTS

ROOT = Path(__file__).resolve().parents[1]


def _mutant(op: str, words: str):
    return next(m.rule for m in MUTANTS if m.op == op and words in m.mistake)


# ----- strategies -----


def test_dense_shapes_share_symbols_and_include_size_one_and_non_square() -> None:
    seen = []

    @settings(max_examples=150, database=None)
    @given(op_cases("dense"))
    def collect(case):
        (n, k), (u, k2) = case.shapes
        assert k == k2  # the symbol K is shared by both inputs
        seen.append((n, k, u))

    collect()
    assert any(1 in s for s in seen)
    assert any(len(set(s)) == 3 for s in seen)  # all three sizes differ: non-square everywhere


@settings(max_examples=40, database=None)
@given(op_examples("softmax_cross_entropy"))
def test_labels_are_in_range(example) -> None:
    logits, labels = example.arrays
    assert labels.dtype == np.int64 and labels.min() >= 0 and labels.max() < logits.shape[1]


@settings(max_examples=40, database=None)
@given(op_examples("relu"))
def test_values_keep_off_the_kink(example) -> None:
    assert np.min(np.abs(example.arrays[0]), initial=np.inf) > opgrad.checks.KINK_MARGIN


@settings(max_examples=40, database=None)
@given(op_examples("log"))
def test_values_come_from_the_declared_domain(example) -> None:
    assert np.all(example.arrays[0] >= 0.2)


@settings(max_examples=30, database=None)
@given(op_examples("conv2d_backward_input"))
def test_sampler_cases_are_valid_and_usable_in_user_tests(example) -> None:
    out = example.op.reference_fn(*example.arrays, **example.case.attrs)
    assert out.shape[2:] == tuple(example.case.attrs["input_size"])


# ----- check_op and its report -----


def test_failure_report_has_everything_to_act_on() -> None:
    report = check_op("dense", gradient=_mutant("dense", "scaled by 2"), checks="abc", max_examples=50, seed=11)
    assert not report.passed and not report
    f = report.failure
    assert f is not None and f.check == "b" and f.op == "dense" and f.seed == 11
    assert set(f.shapes) == {"data", "weight"} and f.step == TOLERANCES["float64"].fd_step
    assert f.index is not None and f.abs_error > 0 and f.rel_error > 1e-3
    assert f.analytic is not None and f.numeric is not None and f.arrays is not None
    text = str(report)
    rerun = "opgrad.checks.check_op('dense', gradient=<your rule>, checks='abc', max_examples=50, seed=11)"
    for piece in ("check b", "shapes:", "worst:", "analytic:", "numeric", "step:", "inputs:", "data = [", rerun):
        assert piece in text
    again = check_op("dense", gradient=_mutant("dense", "scaled by 2"), checks="abc", max_examples=50, seed=11).failure
    assert again is not None and (again.shapes, again.index, again.analytic) == (f.shapes, f.index, f.analytic)


def test_values_shrink_to_a_minimal_input_printed_in_the_report() -> None:
    report = check_op("conv2d", gradient=_mutant("conv2d", "wrong sign"), max_examples=50, seed=2)
    f = report.failure
    assert f is not None and f.arrays is not None
    # The smallest failing input: one element per tensor, the values as simple as a failure allows.
    assert [a.size for a in f.arrays] == [1, 1]
    assert all(float(v) in (0.0, 1.0, -1.0) for a in f.arrays for v in a.ravel()), f.arrays
    text = str(f)
    assert "data = [[[[" in text and "# float64[1, 1, 1, 1]" in text


def test_a_float32_failure_says_float32() -> None:
    def float32_only_off(fn):
        def run(*arrays):
            out = np.asarray(opgrad.evaluate(fn, *arrays))
            return out * np.float32(1.01) if out.dtype == np.float32 else out
        return run

    report = check_op("exp", backend=float32_only_off, checks="g", max_examples=5, seed=0)
    f = report.failure
    assert f is not None and f.check == "g" and f.dtype == "float32"
    assert "dtype:    float32" in str(f) and "float64" not in str(f).split("inputs:")[1]


def test_big_inputs_are_summarized_around_the_worst_element() -> None:
    from opgrad.checks.report import format_array

    a = np.arange(5 * 6 * 7, dtype=np.float32).reshape(5, 6, 7)
    text = format_array("x", a, worst=(4, 2, 6))
    assert "float32[5, 6, 7]" in text and "min 0, max 209" in text and "[4, 2, 6]" in text
    block = text.split("[3, 1, 5]):")[1]
    assert "188." in block and "138." in block and "209." not in block  # a[4, 2, 6] and its neighbours only
    small = format_array("y", np.array([0.1, -2.0]))
    assert small == "y = [ 0.1, -2. ]  # float64[2]"


def test_shrinking_gives_a_small_case() -> None:
    report = check_op("conv2d", gradient=_mutant("conv2d", "wrong sign"), max_examples=50, seed=2)
    assert report.failure is not None
    assert all(np.prod(s) <= 16 for s in report.failure.shapes.values()), report.failure.shapes


def test_wrongly_shaped_gradient_is_a_failure_not_a_crash() -> None:
    report = check_op("collapse_sum_like", gradient=_mutant("collapse_sum_like", "forgets"), seed=0)
    assert report.failure is not None and report.failure.check == "a"
    assert "cannot be summed" in report.failure.problem


def test_candidate_gradient_is_not_registered() -> None:
    op = opgrad.registry.get("tanh")
    before = op.gradient_rule
    check_op("tanh", gradient=_mutant("tanh", "1 - t instead"), max_examples=5, seed=0)
    assert op.gradient_rule is before
    assert check_op("tanh", max_examples=5, seed=0).passed


def test_checks_follow_the_declaration() -> None:
    assert check_op("conv2d", max_examples=3, seed=0).checks == list("abcdeg")  # linear: adjoint test
    assert check_op("relu", max_examples=3, seed=0).checks == list("abcefg")  # kink convention
    assert check_op("one_hot", max_examples=3, seed=0).checks == ["g"]  # nothing to differentiate


def test_backend_is_a_parameter() -> None:
    def off_by_a_little(fn):
        return lambda *arrays: np.asarray(opgrad.evaluate(fn, *arrays)) * (1 + 1e-3)

    report = check_op("exp", backend=off_by_a_little, max_examples=5, seed=0)
    assert report.failure is not None and report.failure.check == "g"
    assert check_op("exp", backend=lambda fn: lambda *a: opgrad.evaluate(fn, *a), max_examples=5, seed=0).passed


# ----- check_function -----


def _cnn_loss():
    x, labels = opgrad.var("x", (3, 1, 8, 8)), opgrad.var("labels", (3,), "int64")
    w, b, v = opgrad.var("w", (4, 1, 3, 3)), opgrad.var("b", (4,)), opgrad.var("v", (5, 36))
    h = ops.max_pool2d(ops.relu(ops.bias_add(ops.conv2d(x, w), b)), pool_size=2)
    fn = opgrad.function([x, labels, w, b, v], ops.softmax_cross_entropy(ops.dense(ops.flatten(h), v), labels))
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(p.shape).astype(np.float32) if p.type.is_float else rng.integers(0, 5, p.shape)
              for p in fn.params]
    return fn, arrays


def test_check_function_on_the_seed_cnn_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    fn, arrays = _cnn_loss()
    assert check_function(fn, arrays, seed=0).passed
    dense = opgrad.registry.get("dense")
    monkeypatch.setattr(dense, "_gradient", _mutant("dense", "scaled by 2"))
    report = check_function(fn, arrays, seed=0, name="seed-cnn loss")
    assert not report.passed and report.failure is not None and report.failure.check == "b"
    assert ("repro:    seed 0: opgrad.checks.check_function(<your function>, <your arrays>, name='seed-cnn loss', "
            "seed=0)") in str(report.failure)


def test_check_function_says_where_the_function_itself_is_undefined() -> None:
    x = opgrad.var("x", (3, 4), "float64")
    report = check_function(opgrad.function([x], ops.sum(ops.log(x))), seed=0)
    assert report.failure is not None
    assert report.failure.problem.startswith("the function's value is nan at this point, so finite differences "
                                             "cannot check its gradient there; pass arrays= inside its domain")
    assert report.failure.rerun == "opgrad.checks.check_function(<your function>, seed=0)"


def test_a_forward_undefined_inside_the_declared_domain_is_named() -> None:
    # log's own rule is right; its domain widened to [-2, 2] puts inputs where log is NaN.
    from opgrad.op import Input, Interval, Operator

    op = Operator("api_wide_log", inputs=[Input("data", domain=(Interval(-2.0, 2.0),))], doc="log over [-2, 2]")
    op.shape_rule(lambda data, attrs: data)
    op.reference(lambda data: np.log(data))
    op.gradient(lambda call, grad: [ops.divide(grad, call.args[0])])
    try:
        report = check_op("api_wide_log", seed=0, max_examples=30)
    finally:
        opgrad.registry.unregister("api_wide_log")
    assert report.failure is not None and report.failure.check == "b"
    assert "the forward itself is not finite there (differences nan) though 'data' lies in its declared domain " \
           "[-2, 2]; narrow domain= to where the op is defined" in report.failure.problem, report.failure.problem


# ----- CLI -----


def test_cli_table_and_exit_code(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert cli.main(["check", "relu", "dense", "--examples", "5", "--seed", "1", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "worst rel err" in out and "relu" in out and "dense" in out
    monkeypatch.setattr(opgrad.registry.get("relu"), "_gradient", _mutant("relu", "kink"))
    assert cli.main(["check", "relu", "--examples", "20", "--seed", "1", "--jobs", "1"]) == 1
    out = capsys.readouterr().out
    assert "FAILED relu: check f" in out
    assert cli.main(["check", "no_such_op"]) == 2


# ----- pytest integration and docs -----


def test_profiles_are_registered() -> None:
    from hypothesis import settings as hs

    ci = hs.get_profile("opgrad-ci")
    assert ci.derandomize and ci.deadline is None and ci.print_blob
    assert hs.get_profile("opgrad-thorough").max_examples >= 1000


def test_a_user_suite_checks_an_op_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "test_user.py").write_text(textwrap.dedent("""
        def test_leaky_relu(opgrad_check):
            opgrad_check("leaky_relu", max_examples=10)
    """))
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                            capture_output=True, text=True, cwd=tmp_path,
                            env={**__import__("os").environ, "HYPOTHESIS_PROFILE": "opgrad-ci"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout


def test_tolerance_table_is_documented() -> None:
    text = (ROOT / "docs" / "checking.md").read_text()
    for dtype, tol in TOLERANCES.items():
        assert dtype in text
        for value in (tol.fd_step, tol.fd_rtol, tol.fd_atol, tol.exact_rtol):
            assert f"{value:g}" in text, f"{dtype}: {value:g} missing from docs/checking.md"


def test_repro_line_quotes_the_call_that_reproduces_the_run() -> None:
    from opgrad.checks.runner import rerun_text

    common = {"backend": None, "shrink": True}
    assert rerun_text("dense", 3, custom_rule=False, checks="abcdefg", max_examples=100, **common) == (
        "opgrad check dense --seed 3")
    assert rerun_text("dense", 3, custom_rule=False, checks="abcdefg", max_examples=20, **common) == (
        "opgrad check dense --seed 3 --examples 20")
    assert rerun_text("dense", 3, custom_rule=True, checks="abc", max_examples=100, **common) == (
        "opgrad.checks.check_op('dense', gradient=<your rule>, checks='abc', seed=3)")


def test_a_backend_without_the_ops_kernel_says_what_it_skipped(capsys: pytest.CaptureFixture[str]) -> None:
    """nms has neither a gradient nor a compiled kernel: on llvm no check applies, and the report,
    the table and the summary say so instead of calling it checked."""
    report = check_op("nms", backend="llvm", max_examples=3, seed=0)
    assert report.passed and report.checks == []
    assert any(note.startswith("g skipped: backend llvm runs no graph of nms") for note in report.notes)
    assert cli.main(["check", "nms", "relu", "--backend", "llvm", "--examples", "3", "--seed", "0"]) == 0
    out = capsys.readouterr().out
    assert "skipped" in next(line for line in out.splitlines() if line.startswith("nms "))
    assert "1/2 operators passed, 1 skipped" in out



def test_the_command_line_prints_what_a_passing_op_was_not_checked_for(capsys: pytest.CaptureFixture[str]) -> None:
    # argmax passes its forward and backend checks; that no gradient was checked is said, not hidden.
    assert cli.main(["check", "argmax", "--examples", "3", "--seed", "0"]) == 0
    assert "argmax: gradient checks skipped: no differentiable inputs" in capsys.readouterr().out.splitlines()
