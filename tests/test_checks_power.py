"""The checker's power: every planted wrong gradient must be flagged (see opgrad.checks.mutants)."""

from __future__ import annotations

import pytest

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
