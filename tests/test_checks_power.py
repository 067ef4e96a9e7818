"""The checker's power: every planted wrong gradient must be flagged (see opgrad.checks.mutants)."""

from __future__ import annotations

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
