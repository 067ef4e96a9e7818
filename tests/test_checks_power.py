"""The checker's power: every planted wrong gradient must be flagged (see opgrad.checks.mutants)."""

from __future__ import annotations

from pathlib import Path

import pytest

import opgrad
from opgrad import cli
from opgrad.checks import check_op
from opgrad.checks.mutants import MUTANTS, Mutant, main

CARD_OPS = {"dense", "bias_add", "conv2d", "conv2d_backward_input", "conv2d_backward_weight", "max_pool2d",
            "avg_pool2d", "softmax_cross_entropy", "collapse_sum_like"}


def test_at_least_30_mutants_cover_the_card_ops() -> None:
    assert len(MUTANTS) >= 30
    assert {m.op for m in MUTANTS} >= CARD_OPS


@pytest.mark.parametrize("mutant", MUTANTS, ids=[f"{m.op}: {m.mistake}" for m in MUTANTS])
def test_wrong_gradient_is_flagged(mutant: Mutant) -> None:
    report = check_op(mutant.op, gradient=mutant.rule, max_examples=60, seed=0, shrink=False)
    assert not report.passed, f"{mutant.op}: '{mutant.mistake}' survived {report.examples} examples"
    assert report.failure is not None and report.failure.check in "abcdefg"


def test_kill_rate_is_printed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main() == 0
    out = capsys.readouterr().out
    assert f"kill rate: {len(MUTANTS)}/{len(MUTANTS)} = 100%" in out
    with capsys.disabled():
        print("\n" + out.strip().splitlines()[-1])


def test_every_differentiable_op_has_mutants() -> None:
    planted = {m.op for m in MUTANTS}
    missing = [op.name for op in opgrad.registry.all_ops()
               if op.gradient_rule is not None and any(s.differentiable for s in op.inputs) and op.name not in planted]
    assert not missing, f"differentiable operators without a planted mutant: {missing}"


def _mistake(op: str, words: str) -> Mutant:
    return next(m for m in MUTANTS if m.op == op and words in m.mistake)


@pytest.mark.parametrize(("op", "words", "killer"), [
    ("exp", "1e-8 bias", "c"),  # VJP(0) != 0, by 1e-8: far below central differences' noise
    ("add", "1e-7 relative", "d"),  # the exact adjoint test sees round-off only
    ("sqrt", "held constant", "e"),  # right first order, wrong second
    ("prod", "zero masks", "e"),  # right first order at exact zeros, wrong second there
])
def test_checks_c_d_e_kill_what_finite_differences_miss(op: str, words: str, killer: str) -> None:
    mutant = _mistake(op, words)
    assert check_op(op, gradient=mutant.rule, checks="ab", max_examples=60, seed=0).passed
    report = check_op(op, gradient=mutant.rule, max_examples=60, seed=0)
    assert report.failure is not None and report.failure.check == killer, report


@pytest.mark.parametrize(("op", "words"), [
    ("softmax", "naively"), ("log_softmax", "naively"), ("logsumexp", "unshifted"),
])
def test_overflow_at_large_logits_is_reached_on_purpose(op: str, words: str) -> None:
    report = check_op(op, gradient=_mistake(op, words).rule, max_examples=60, seed=0)
    assert report.failure is not None and report.failure.arrays is not None
    assert max(float(abs(a).max()) for a in report.failure.arrays) > 700  # exp overflows there, not at 2


def test_cli_runs_one_ops_mutants(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check", "--mutants", "sqrt", "--examples", "30", "--no-shrink"]) == 0
    out = capsys.readouterr().out
    assert "held constant" in out and "killed by check e" in out and "killed 2/2" in out
    assert cli.main(["check", "--mutants", "one_hot"]) == 2


def test_central_differences_are_refined_before_a_mismatch_is_reported() -> None:
    # sin(k x) for large k: the central difference with h = 1e-6 is off by about (k h)^2 / 6, so
    # alone it would reject the true derivative; the extrapolated one accepts it and still rejects
    # a derivative off by a factor.
    import numpy as np

    from opgrad.checks.checks import difference_mismatch

    k, x, h = 20000.0, 0.3, 1e-6

    def quotient(step: float) -> float:
        return (np.sin(k * (x + step)) - np.sin(k * (x - step))) / (2 * step)

    true = k * np.cos(k * x)
    assert abs(quotient(h) - true) > 1e-5 * abs(true)  # the plain quotient would fail
    assert difference_mismatch(true, quotient, h, 1e-5, 1e-6).ratio <= 1
    assert difference_mismatch(1.001 * true, quotient, h, 1e-5, 1e-6).ratio > 1


def test_a_correct_gradient_near_a_sharp_feature_passes_every_check() -> None:
    # tanh(10^4 x) near 0: plain central differences with h = 1e-6 miss its (correct) gradient by
    # 2.5e-5 relative and its second order likewise; a layer_norm over two elements (scale
    # sqrt(epsilon)) did so on a random seed of `opgrad check`.
    import numpy as np

    from opgrad.checks import check_function

    x = opgrad.var("x", (3,), "float64")
    fn = opgrad.function([x], opgrad.ops.sum(opgrad.ops.tanh(x * 10000.0)))
    report = check_function(fn, [np.array([3e-5, -5e-5, 1e-4])])
    assert report.passed, report.failure


def test_a_difference_across_a_jump_of_the_second_derivative_converges_with_the_step() -> None:
    # t + 2500 t |t| at 2e-7: the steps h = 1e-6 and h / 2 straddle 0, where the second derivative
    # jumps from -5000 to 5000, so the central quotient is off by about h and Richardson's
    # extrapolation (which assumes h^2) does not help; a 16 times smaller step stays on one side
    # and agrees.
    from opgrad.checks.checks import difference_mismatch

    x, h = 2e-7, 1e-6

    def f(t: float) -> float:
        return t + 2500 * t * abs(t)

    def quotient(step: float) -> float:
        return (f(x + step) - f(x - step)) / (2 * step)

    true = 1 + 5000 * x
    refined = (4 * quotient(h / 2) - quotient(h)) / 3
    assert abs(quotient(h) - true) > 1e-6 + 1e-5 * true  # the plain quotient would reject it,
    assert abs(refined - true) > 1e-6 + 1e-5 * true  # and so would the extrapolation
    assert difference_mismatch(true, quotient, h, 1e-5, 1e-6).ratio <= 1
    assert difference_mismatch(1.001 * true, quotient, h, 1e-5, 1e-6).ratio > 1  # a wrong one stays wrong


def test_a_kink_is_told_from_a_curve_by_its_one_sided_slopes() -> None:
    import math

    from opgrad.checks.checks import kinked_along

    assert kinked_along(lambda t: abs(t + 1e-9) + t, 1e-6, 1e-5, 1e-6)
    assert not kinked_along(lambda t: math.sin(3 * t + 0.2), 1e-6, 1e-5, 1e-6)
    assert not kinked_along(lambda t: abs(t + 1e-3), 1e-6, 1e-5, 1e-6)  # the kink is far from the steps


SOFTSIGN = '''
import numpy as np
from opgrad import ops
from opgrad.op import Input, Operator
from opgrad.registry._common import same_as_first

softsign = Operator("user_softsign", inputs=[Input("data")], doc="data / (1 + |data|)")
softsign.shape_rule(same_as_first)
softsign.reference(lambda data: (data / (1 + np.abs(data))).astype(data.dtype, copy=False))

@softsign.gradient
def _gradient(call, grad):
    """d_data = grad / (1 + |data|)^2"""
    den = ops.add(ops.abs(call.args[0]), 1.0)
    return [ops.divide(grad, ops.multiply(den, den))]

@softsign.mutant("1 + 2|data| instead of (1 + |data|)^2")
def _wrong(call, grad):
    return [ops.divide(grad, ops.add(ops.multiply(ops.abs(call.args[0]), 2.0), 1.0))]
'''


def test_an_operator_whose_second_derivative_jumps_passes_with_its_correct_gradient(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """softsign is differentiable everywhere (no kink to declare) but its second derivative jumps
    at 0, where the examples like to land (1e-9, 1e-130): its exact gradient passes every seed
    that once failed check b or e, and a wrong one still fails."""
    import importlib
    import sys

    from opgrad import registry
    from opgrad.checks.mutants import declared_mutants

    (tmp_path / "user_softsign_ops.py").write_text(SOFTSIGN)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("user_softsign_ops")
    try:
        reports = [check_op("user_softsign", seed=seed) for seed in range(6)]
        for report in reports:
            assert report.passed, report.failure
        # Where a direction of check e crossed the kink of the gradient, the report says it was skipped.
        assert any("second-order comparison(s) skipped" in note for r in reports for note in r.notes)
        wrong = next(m for m in declared_mutants() if m.op == "user_softsign")
        assert not check_op("user_softsign", gradient=wrong.rule, seed=0, max_examples=30).passed
    finally:
        registry.unregister("user_softsign")
        sys.modules.pop("user_softsign_ops", None)


def test_a_forward_computing_in_another_precision_fails_check_g() -> None:
    """The reference backend casts each forward's result to its promised type; check g does not."""
    import numpy as np

    from opgrad import registry
    from opgrad.op import Input, Operator
    from opgrad.registry._common import same_as_first

    op = Operator("user_float64_forward", inputs=[Input("data")], doc="2 data, computed in float64")
    op.shape_rule(same_as_first)
    op.reference(lambda data: data.astype(np.float64) * 2.0)
    op.gradient(lambda call, grad: [opgrad.ops.multiply(grad, 2.0)])
    try:
        report = check_op("user_float64_forward", seed=0, max_examples=10)
        assert not report.passed and report.failure is not None and report.failure.check == "g"
        assert "returns float64 for float32 inputs" in report.failure.problem
    finally:
        registry.unregister("user_float64_forward")


def test_a_rule_returning_one_expression_instead_of_a_list_is_named() -> None:
    report = check_op("relu", gradient=lambda call, grad: opgrad.ops.multiply(grad, 1.0), seed=0, max_examples=5)
    assert not report.passed and report.failure is not None and report.failure.check == "a"
    assert "gradient of 'relu' returned the expression" in report.failure.problem


def test_a_gradient_wrong_only_for_stretched_operands_is_flagged_within_a_few_examples() -> None:
    # Summing a stretched operand's gradient over every axis is right for scalars and for equal
    # shapes; only an operand of several elements stretched along another axis shows it. Half the
    # cases of a broadcasting op are such, so 20 examples find it under almost every seed.
    mutant = _mistake("multiply", "stretched d_rhs")
    flagged = sum(not check_op("multiply", gradient=mutant.rule, checks="ab", max_examples=20, seed=seed,
                               shrink=False).passed for seed in range(20))
    assert flagged >= 18, f"flagged under {flagged} of 20 seeds"
