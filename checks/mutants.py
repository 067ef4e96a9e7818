"""Deliberately wrong gradients: the checker's power, measured.

Each mutant is a plausible mistake (the kinds that shipped in real frameworks), declared with
``@op.mutant("what is wrong")`` beside the operator's gradient in its registry file and checked
as a candidate rule, ``check_op(op, gradient=rule)``. The checker must flag every one; the kill
rate is ``python -m opgrad.checks.mutants``. A mutant that builds a wrongly shaped gradient is caught by
autodiff's own shape check, which the checker reports as check a.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from opgrad.op import GradientRule

from .report import OpReport

Rule = GradientRule


@dataclass(frozen=True)
class Mutant:
    op: str
    mistake: str
    rule: Rule


def declared_mutants() -> list[Mutant]:
    """Mutants planted with ``@op.mutant`` in the operators' own registry files, op by op."""
    from opgrad.registry import all_ops

    return [Mutant(op.name, mistake, rule) for op in all_ops() for mistake, rule in op.mutants]


#: Every mutant, in the order of the operators' registration.
MUTANTS: list[Mutant] = declared_mutants()


def run_mutants(max_examples: int = 30, seed: int = 0, shrink: bool = False,
                mutants: list[Mutant] | None = None) -> list[tuple[Mutant, OpReport]]:
    """Check every mutant; returns each with its report (``passed`` means the mutant survived)."""
    from .runner import check_op

    return [(m, check_op(m.op, gradient=m.rule, max_examples=max_examples, seed=seed, shrink=shrink))
            for m in (mutants if mutants is not None else MUTANTS)]


def main() -> int:
    start = time.perf_counter()
    results = run_mutants()
    for m, report in results:
        verdict = f"killed by check {report.failure.check}" if report.failure else "SURVIVED"
        print(f"{m.op:24} {m.mistake:62} {verdict}")
    killed = sum(1 for _, r in results if not r.passed)
    print(f"\nkill rate: {killed}/{len(results)} = {killed / len(results):.0%} "
          f"({time.perf_counter() - start:.1f}s)")
    return 0 if killed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
