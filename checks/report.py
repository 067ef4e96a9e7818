"""The checker's results: one structured failure, one report per operator, and their text forms.

A failure carries everything needed to act on it without rerunning anything: which check, the
shrunk shapes, attributes and input values, the seed that reproduces it, the worst element with
both values, and the step. ``str(failure)`` is the text a person reads; the dataclass is what tools read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

CHECK_NAMES: dict[str, str] = {
    "a": "gradient shape and dtype",
    "b": "VJP vs central finite differences",
    "c": "VJP linear in the cotangent",
    "d": "exact adjoint (dot-product) test",
    "e": "second order vs finite differences",
    "f": "subgradient convention at kinks",
    "g": "backend agrees with the reference",
}


@dataclass
class Failure:
    """One failed check on one (shrunk) example."""

    op: str
    check: str  # a letter of CHECK_NAMES
    problem: str  # one sentence: what disagreed
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None  # the hypothesis run seed (`opgrad check OP --seed SEED`)
    input: str | None = None  # which input's gradient (or "direction k", "output")
    index: tuple[int, ...] | None = None  # the worst element
    analytic: float | None = None
    numeric: float | None = None  # finite differences, or the expected value of an exact identity
    abs_error: float | None = None
    rel_error: float | None = None
    step: float | None = None
    tolerance: float | None = None
    dtype: str = "float64"
    arrays: list[np.ndarray] | None = field(default=None, repr=False)  # the inputs, to reproduce by hand
    names: list[str] | None = None  # the name of each of ``arrays`` (default: the keys of ``shapes``)
    # How to rerun exactly this check; check_op sets the CLI form where a fresh process can rerun
    # it, and the Python call where only the caller's process can (a candidate rule, a subset).
    rerun: str | None = None
    # Other distinct failures of the same run, one line each (each was shrunk on its own).
    others: list[str] = field(default_factory=list)

    @property
    def check_name(self) -> str:
        return CHECK_NAMES.get(self.check, self.check)

    def __str__(self) -> str:
        lines = [f"FAILED {self.op}: check {self.check} ({self.check_name})", f"  problem:  {self.problem}"]
        if self.shapes:
            lines.append("  shapes:   " + ", ".join(f"{k}={list(v)}" for k, v in self.shapes.items()))
        lines.append("  attrs:    " + (", ".join(f"{k}={v!r}" for k, v in self.attrs.items()) or "none"))
        lines.append(f"  dtype:    {self.dtype}")
        if self.input is not None:
            where = f"{self.input}[{', '.join(str(i) for i in self.index)}]" if self.index is not None else self.input
            lines.append(f"  worst:    {where}")
        if self.analytic is not None:
            label = "numeric " if self.step is not None else "expected"
            lines.append(f"  analytic: {self.analytic:.10g}")
            lines.append(f"  {label}: {self.numeric:.10g}")
        if self.abs_error is not None:
            lines.append(f"  error:    abs {self.abs_error:.3g}, rel {self.rel_error:.3g} "
                         f"(tolerance {self.tolerance:.1g})")
        if self.step is not None:
            lines.append(f"  step:     {self.step:g} (central differences)")
        if self.arrays:
            names = self.names or list(self.shapes)
            lines.append("  inputs:")
            for name, array in zip(names, self.arrays):
                worst = self.index if self.input == name else None
                lines.extend("    " + line for line in format_array(name, array, worst).splitlines())
        for other in self.others:
            lines.append(f"  also:     {other}")
        if self.seed is not None:
            rerun = self.rerun or f"opgrad check {self.op} --seed {self.seed}"
            lines.append(f"  repro:    seed {self.seed}: {rerun}")
        return "\n".join(lines)


#: Arrays with at most this many elements are printed in full in a failure report.
PRINT_IN_FULL = 64


def format_array(name: str, array: np.ndarray, worst: tuple[int, ...] | None = None) -> str:
    """``name = <values>`` for a report: every value of a small array (repr precision, so the
    numbers can be pasted back), else a summary and the neighbourhood of the worst element
    (or of the start when no element is singled out)."""
    a = np.asarray(array)
    kind = f"{a.dtype}{list(a.shape)}"
    with np.printoptions(precision=17, floatmode="unique", threshold=PRINT_IN_FULL, linewidth=100):
        if a.size <= PRINT_IN_FULL:
            text = np.array2string(a, separator=", ", prefix=f"{name} = ")
            return f"{name} = {text}  # {kind}"
        finite = a[np.isfinite(a)] if a.dtype.kind == "f" else a
        stats = (f"min {finite.min():.6g}, max {finite.max():.6g}, mean {finite.mean():.6g}" if finite.size
                 else "no finite value")
        centre = tuple(worst) if worst is not None and len(worst) == a.ndim else (0,) * a.ndim
        window = tuple(slice(max(i - 1, 0), i + 2) for i in centre)
        corner = [s.start for s in window]
        where = "the worst element" if worst is not None and len(worst) == a.ndim else "the start"
        around = np.array2string(a[window], separator=", ", prefix="  ")
        return (f"{name}: {kind}, {stats}\n  around {where} {list(centre)} (the block from {corner}):\n"
                f"  {around}")


@dataclass
class OpReport:
    """The outcome of checking one operator (``check_op``) or one function (``check_function``)."""

    op: str
    passed: bool
    examples: int = 0
    checks: list[str] = field(default_factory=list)  # letters of the checks that ran
    worst_rel_error: float = 0.0  # worst finite-difference relative error over passing comparisons
    seconds: float = 0.0
    seed: int | None = None
    failure: Failure | None = None
    notes: list[str] = field(default_factory=list)  # skipped checks and why

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        status = "passed" if self.passed else "FAILED"
        head = (f"{self.op}: {status} after {self.examples} example(s), checks {''.join(self.checks) or '-'}, "
                f"worst rel error {self.worst_rel_error:.2g}, {self.seconds:.2f}s, seed {self.seed}")
        parts = [head, *(f"  note: {n}" for n in self.notes)]
        if self.failure is not None:
            parts.append(str(self.failure))
        return "\n".join(parts)


def _verdict(report: OpReport) -> str:
    """A report's result cell: ``ok``, ``skipped`` where no check could run (an op without a kernel
    checked on a compiling backend), or the failing check."""
    if not report.passed:
        return f"FAILED ({report.failure.check if report.failure else '?'})"
    return "ok" if report.checks else "skipped"


def format_table(reports: Sequence[OpReport]) -> str:
    """The ``opgrad check`` table: op, examples, checks, worst relative error, time."""
    rows = [("op", "examples", "checks", "worst rel err", "time", "result")]
    for r in reports:
        rows.append((r.op, str(r.examples), "".join(r.checks) or "-", f"{r.worst_rel_error:.1e}",
                     f"{r.seconds:.2f}s", _verdict(r)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
