"""A failure shrinks on the check that found it, and several distinct failures are all reported."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from opgrad import registry
from opgrad.checks import check_op
from opgrad.checks.checks import CHECK_FAILURES, CheckFailure, failure_class
from opgrad.checks.mutants import MUTANTS
from opgrad.checks.report import Failure
from opgrad.checks.runner import first_of
from opgrad.op import GradientRule

if sys.version_info >= (3, 11):
    from builtins import ExceptionGroup
else:  # hypothesis depends on the backport there
    from exceptiongroup import ExceptionGroup


def _mutant(op: str, words: str) -> GradientRule:
    return next(m.rule for m in MUTANTS if m.op == op and words in m.mistake)


PLANT = textwrap.dedent("""
    import sys
    from opgrad import cli, registry
    from opgrad.checks.mutants import MUTANTS

    registry.get("dense")._gradient = next(m.rule for m in MUTANTS if m.op == "dense" and "scaled by 2" in m.mistake)
    sys.exit(cli.main(sys.argv[1:]))
""")


@pytest.mark.parametrize("seed", [1, 3])
def test_a_mutant_failing_check_b_is_reported_as_check_b_after_shrinking(tmp_path: Path, seed: int) -> None:
    # Run as a user runs it (the CLI's loaded modules steer hypothesis toward all-zero inputs):
    # all-zero inputs are the smallest example, and for a gradient scaled by 2 they pass check b
    # (2 * 0 = 0) and fail check e. The report must still name b, on a shrunk example failing b.
    script = tmp_path / "plant.py"
    script.write_text(PLANT)
    done = subprocess.run([sys.executable, str(script), "check", "dense", "--examples", "10", "--seed", str(seed)],
                          capture_output=True, text=True, timeout=300)
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert "FAILED dense: check b (VJP vs central finite differences)" in out, out
    assert "  shapes:   data=[1, 1], weight=[1, 1]" in out  # shrunk to the smallest shapes
    analytic = float(re.search(r"analytic: (\S+)", out).group(1))  # type: ignore[union-attr]
    numeric = float(re.search(r"numeric : (\S+)", out).group(1))  # type: ignore[union-attr]
    assert abs(numeric) > 1e-3 and analytic == pytest.approx(2 * numeric, rel=1e-4)  # it fails b


def test_check_op_reports_the_scaled_dense_gradient_as_check_b() -> None:
    report = check_op("dense", gradient=_mutant("dense", "scaled by 2"), max_examples=10, seed=0)
    assert report.failure is not None and report.failure.check == "b", str(report)


def test_each_check_fails_with_its_own_exception_type() -> None:
    assert len({failure_class(c) for c in "abcdefg"}) == 7
    assert all(issubclass(cls, CheckFailure) for cls in CHECK_FAILURES.values())
    assert failure_class("b").__name__ == "CheckBFailure"


def _raised(check: str, problem: str) -> CheckFailure:
    try:
        raise failure_class(check)(Failure(op="dense", check=check, problem=problem, shapes={"data": (1, 2)}))
    except CheckFailure as exc:
        return exc


def test_several_distinct_failures_report_the_earliest_check_and_mention_the_others() -> None:
    e, b, g = _raised("e", "second order off"), _raised("b", "VJP off"), _raised("g", "backend off")
    group = ExceptionGroup("distinct failures", [e, ExceptionGroup("nested", [g, b])])
    failure = first_of(group, e, registry.get("dense"), 5)
    assert failure.check == "b" and failure.problem == "VJP off"
    assert len(failure.others) == 2
    assert any(line.startswith("check e (second order vs finite differences): second order off")
               for line in failure.others)
    assert "  also:     check g (backend agrees with the reference): backend off [shapes data=[1, 2]]" in str(failure)


def test_another_failure_with_a_message_of_several_lines_is_mentioned_on_one() -> None:
    b = _raised("b", "VJP off")
    group = ExceptionGroup("distinct failures", [b, ValueError("the sampler's case:\n  inputs: x\n  problem: y")])
    failure = first_of(group, b, registry.get("dense"), 5)
    assert failure.others == ["error: ValueError: the sampler's case: inputs: x problem: y"]


def test_errors_alone_in_a_group_are_reported_as_errors() -> None:
    group = ExceptionGroup("distinct failures", [ValueError("bad sampler"), KeyError("x")])
    failure = first_of(group, None, registry.get("dense"), 5)
    assert failure.check == "error" and "ValueError: bad sampler" in failure.problem
    assert failure.others == ["error: KeyError: 'x'"]
