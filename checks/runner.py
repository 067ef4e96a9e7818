"""``check_op``: drive checks a-g over hypothesis-generated examples and shrink any failure."""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.errors import FailedHealthCheck, Flaky, Unsatisfiable

from opgrad.op import NO_GRADIENT_DECLARED, GradientRule, Operator

from .backends import BACKENDS, Backend, LLVMBackend, resolve_backend
from .checks import (
    CheckFailure,
    Context,
    check_a_build,
    check_b_vjp,
    check_c_linearity,
    check_d_adjoint,
    check_e_second_order,
    check_f_kinks,
    check_g_backend,
    failure_class,
    raised_in,
)
from .profiles import draws_independent_of_loaded_modules
from .report import CHECK_NAMES, Failure, OpReport
from .strategies import Example, op_examples, resolve_op
from .tolerances import tolerance

if sys.version_info >= (3, 11):
    from builtins import BaseExceptionGroup
else:  # hypothesis depends on the backport there
    from exceptiongroup import BaseExceptionGroup

ALL_CHECKS = "abcdefg"


class NothingToCheckError(ValueError):
    """The call selects nothing to check: no check letter applies, or nothing is differentiable.

    Raised rather than returning a passing report, since a report of checks that never ran would
    read as a verified gradient.
    """


def parse_checks(checks: str | Iterable[str], *, who: str = "check_op") -> str:
    """The letters ``checks`` selects, in a-g order; a ``ValueError`` names unknown letters.

    ``checks`` is a string of check letters (``"abc"``) or an iterable of them (``["a", "b"]``).
    """
    if isinstance(checks, str):
        letters = list(checks)
    else:
        try:
            items = list(checks)
        except TypeError:
            raise TypeError(f"{who}: checks must be a string of check letters such as 'abc', "
                            f"got {type(checks).__name__} {checks!r}") from None
        if not all(isinstance(item, str) for item in items):
            raise TypeError(f"{who}: checks must be a string of check letters such as 'abc', got {checks!r}")
        letters = list("".join(items))
    valid = "; ".join(f"{c}: {CHECK_NAMES[c]}" for c in ALL_CHECKS)
    unknown = sorted(set(letters) - set(ALL_CHECKS))
    if unknown:
        raise ValueError(f"{who}: unknown check letter(s) {', '.join(map(repr, unknown))} in checks={checks!r}; "
                         f"valid letters are {ALL_CHECKS!r} ({valid})")
    if not letters:
        raise ValueError(f"{who}: checks={checks!r} selects no check; pass some of {ALL_CHECKS!r} ({valid})")
    return "".join(c for c in ALL_CHECKS if c in letters)


def positive_int(value: object, name: str, *, who: str) -> int:
    """``value`` as an int >= 1, or a ``ValueError``/``TypeError`` naming ``name`` and the value."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{who}: {name} must be a positive integer, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{who}: {name} must be a positive integer, got {value}")
    return int(value)


def check_seed(seed: object, *, who: str) -> int | None:
    """``seed`` as a non-negative int (or None), or an error naming it."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"{who}: seed must be a non-negative integer or None, got {type(seed).__name__} {seed!r}")
    if seed < 0:
        raise ValueError(f"{who}: seed must be a non-negative integer or None, got {seed}")
    return int(seed)


def as_backend(backend: Backend | str | None, *, who: str) -> Backend | None:
    """A backend given by name (``"reference"``, ``"llvm"``) or as ``backend(fn) -> callable``."""
    if isinstance(backend, str):
        return resolve_backend(backend)
    if backend is not None and not callable(backend):
        raise TypeError(f"{who}: backend must be one of {', '.join(map(repr, BACKENDS))} or a callable "
                        f"backend(fn) -> callable(*arrays), got {type(backend).__name__} {backend!r}")
    return backend


def default_seed() -> int:
    """A fresh seed, except under a derandomized hypothesis profile (``ci``), where it is 0."""
    current = settings.default
    return 0 if current is not None and current.derandomize else random.randrange(2**32)


def applicable_checks(op: Operator, rule: GradientRule | None) -> tuple[list[str], list[str]]:
    """The checks that apply to ``op`` from its declaration, and notes on those that do not."""
    notes: list[str] = []
    if rule is None or not any(spec.differentiable for spec in op.inputs):
        notes.append(f"gradient checks skipped: {op.gradient_status.reason or 'no gradient'}")
        return ["g"], notes
    letters = ["a", "b", "c"]
    if op.jointly_linear or any(op.input(n).differentiable for n in op.linear_in):
        letters.append("d")
    letters.append("e")
    if op.kinks is not None and op.kinks.place is not None and op.kinks.subgradient is not None:
        letters.append("f")
    letters.append("g")
    return letters, notes


def run_example(example: Example, rule: GradientRule | None, letters: Sequence[str], *, seed: int | None,
                backend: Backend | None) -> tuple[dict[str, float], set[str], list[str]]:
    """Run the chosen checks on one example; returns worst FD relative errors, the checks that ran
    and the comparisons finite differences could not decide (:attr:`Context.skipped`)."""
    ctx = Context(example=example, rule=rule, tol=tolerance(example.dtype), seed=seed)
    errors: dict[str, float] = {}
    ran: set[str] = set()
    # Checks b-f evaluate the gradient that check a builds, so it is built whenever one of them runs.
    if "a" in letters or any(c in letters for c in "bcdef"):
        check_a_build(ctx)
        if "a" in letters:
            ran.add("a")
    if "b" in letters:
        errors["b"] = check_b_vjp(ctx)
        ran.add("b")
    if "c" in letters:
        check_c_linearity(ctx)
        ran.add("c")
    if "d" in letters:
        check_d_adjoint(ctx)
        ran.add("d")
    if "e" in letters:
        done, worst = check_e_second_order(ctx)
        if done:
            errors["e"] = worst
            ran.add("e")
    if "f" in letters:
        check_f_kinks(ctx)
        ran.add("f")
    if "g" in letters and check_g_backend(ctx, backend):
        ran.add("g")
    return errors, ran, ctx.skipped


def check_op(name: str | Operator, *, gradient: GradientRule | None = None, max_examples: int = 100,
             seed: int | None = None, backend: Backend | str | None = None, checks: str | Iterable[str] = ALL_CHECKS,
             shrink: bool = True) -> OpReport:
    """Check one operator's gradient on generated examples; the report's ``.passed`` says if it held.

    ``gradient`` is a candidate rule ``(call, grad) -> list`` checked instead of the registered one
    (nothing is registered). ``backend(fn) -> callable(*arrays)`` (or a name, ``"reference"`` or
    ``"llvm"``) is compared against the numpy reference in check g (default: the reference
    itself, which still checks forward shapes and dtypes). ``checks`` selects check letters
    (``"abc"``); letters that do not apply to the op are skipped, and a selection of which none
    applies raises ``NothingToCheckError`` (a ``ValueError``). ``seed`` makes the run
    reproducible; a failure report quotes it. ``shrink=False`` reports the first failing example
    as found (faster when only the verdict matters).
    """
    who = "check_op"
    checks = parse_checks(checks, who=who)
    max_examples = positive_int(max_examples, "max_examples", who=who)
    seed = check_seed(seed, who=who)
    backend = as_backend(backend, who=who)
    if gradient is not None and not callable(gradient):
        raise TypeError(f"{who}: gradient must be a rule (call, grad) -> list, got {type(gradient).__name__} "
                        f"{gradient!r}")
    op = resolve_op(name)
    rule = gradient if gradient is not None else op.gradient_rule
    applicable, notes = applicable_checks(op, rule)
    letters = [c for c in applicable if c in checks]
    if not letters:
        raise NothingToCheckError(f"nothing to check: {who}({op.name!r}): none of checks={checks!r} applies to "
                                  f"{op.name}; its applicable checks are {''.join(applicable)!r}")
    run_seed = default_seed() if seed is None else seed
    report = OpReport(op=op.name, passed=True, seed=run_seed, notes=notes)
    seen: set[str] = set()
    undecided: list[str] = []  # comparisons finite differences could not decide
    first_failure: list[CheckFailure] = []  # the failure found first, before any shrinking
    start = time.perf_counter()

    def one(example: Example) -> None:
        try:
            # A wrong rule overflowing (exp of a large logit) is a finding reported as a mismatch,
            # not a warning.
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                errors, ran, skipped = run_example(example, rule, letters, seed=run_seed, backend=backend)
        except CheckFailure as exc:
            if not first_failure:
                first_failure.append(exc)
            raise
        if not first_failure:
            report.examples += 1
            seen.update(ran)
            undecided.extend(skipped)
            report.worst_rel_error = max(report.worst_rel_error, *errors.values(), 0.0)

    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])
    # Every distinct failure (check and raising line) is shrunk on its own, so the shrunk example
    # still fails the check that failed first; with one bug reported, hypothesis would shrink
    # toward whichever failure has the smallest example (all-zero inputs often fail another check).
    runner = settings(
        max_examples=max_examples, deadline=None, database=None, derandomize=False, phases=phases,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.differing_executors],
        report_multiple_bugs=shrink, print_blob=False, verbosity=Verbosity.quiet,
    )(hypothesis_seed(run_seed)(given(op_examples(op))(one)))
    try:
        if rule is None and op.gradient_status.reason == NO_GRADIENT_DECLARED:
            raise failure_class("a")(Failure(
                op=op.name, check="a", seed=run_seed,
                problem=f"{op.name} has differentiable inputs ("
                        f"{', '.join(spec.name for spec in op.inputs if spec.differentiable)}) and declares no "
                        f"gradient: register one with @{op.name}.gradient, or declare "
                        f"{op.name}.gradient_not_implemented(reason) where it has none"))
        with draws_independent_of_loaded_modules():
            runner()
    except CheckFailure as exc:
        report.passed, report.failure = False, exc.failure
    except (FailedHealthCheck, Unsatisfiable) as exc:
        report.passed = False
        report.failure = Failure(op=op.name, check="cases", problem=f"could not generate valid examples: {exc}",
                                 seed=run_seed)
    except BaseExceptionGroup as group:
        if not isinstance(group, Exception):
            raise  # KeyboardInterrupt and the like inside
        report.passed = False
        if isinstance(group, Flaky):  # a failure that did not fail again: not a verdict on one check
            report.failure = error_failure(group, op, run_seed)
        else:
            report.failure = first_of(group, first_failure[0] if first_failure else None, op, run_seed)
    except Exception as exc:  # a sampler bug or an op's reference raising on a valid case
        report.passed = False
        report.failure = error_failure(exc, op, run_seed)
    if report.failure is not None:
        report.failure.rerun = rerun_text(op.name, run_seed, custom_rule=gradient is not None, checks=checks,
                                          backend=backend, max_examples=max_examples, shrink=shrink,
                                          user_module=op.module if op.user_defined else None)
    report.checks = [c for c in ALL_CHECKS if c in seen or (report.failure and report.failure.check == c)]
    if undecided:
        report.notes.append(f"{len(undecided)} second-order comparison(s) skipped: the direction crossed a kink of "
                            "the gradient within a few steps, where no step resolves a second derivative")
    if "g" in letters and "g" not in report.checks and report.failure is None:
        why = f" ({op.lowering_reason})" if op.lowering_reason else ""
        report.notes.append(f"g skipped: backend {backend_name(backend) or 'given'} runs no graph of {op.name}: "
                            f"it has no compiled kernel{why}")
    report.seconds = time.perf_counter() - start
    return report


def error_failure(exc: BaseException, op: Operator, seed: int) -> Failure:
    """A failure for an exception that is not a check's verdict (a sampler bug, a shape rule or
    reference raising), naming the part of the declaration it was raised in."""
    return Failure(op=op.name, check="error", problem=f"{type(exc).__name__}: {exc}{raised_in(exc, op)}", seed=seed)


def raising_line(exc: BaseException) -> tuple[str, int] | None:
    """Where ``exc`` was raised: the innermost frame of its traceback (how hypothesis tells failures apart)."""
    tb = exc.__traceback__
    if tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_filename, tb.tb_lineno


def leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    """The exceptions of a (possibly nested) exception group, in order."""
    found: list[BaseException] = []
    for exc in group.exceptions:
        found.extend(leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return found


def first_of(group: BaseExceptionGroup[BaseException], first: CheckFailure | None, op: Operator,
             seed: int) -> Failure:
    """The failure to report when hypothesis found several distinct ones, each shrunk on its own.

    That is the failure of the first check in a-g order: the checks go from the gradient's shape
    to first order, second order and backends, so a wrong first-order gradient (b) that also
    breaks second order (e) is reported as b. Among failures of one check, the one found first
    wins. The others are listed in its ``others``.
    """
    found = leaves(group)
    checks = [exc for exc in found if isinstance(exc, CheckFailure)]
    if not checks:
        main = error_failure(found[0], op, seed)
        main.others = [summary_line(exc) for exc in found[1:]]
        return main

    def rank(exc: CheckFailure) -> tuple[int, bool]:
        letter = ALL_CHECKS.find(exc.failure.check)
        same_origin = first is not None and type(exc) is type(first) and raising_line(exc) == raising_line(first)
        return letter if letter >= 0 else len(ALL_CHECKS), not same_origin

    chosen = min(checks, key=rank)
    main = chosen.failure
    main.others = [summary_line(exc) for exc in found if exc is not chosen]
    return main


def summary_line(exc: BaseException) -> str:
    """One line naming another failure found in the same run."""
    if isinstance(exc, CheckFailure):
        f = exc.failure
        shapes = ", ".join(f"{k}={list(v)}" for k, v in f.shapes.items())
        return " ".join(f"check {f.check} ({f.check_name}): {f.problem}".split()) + (
            f" [shapes {shapes}]" if shapes else "")
    return " ".join(f"error: {type(exc).__name__}: {exc}".split())  # messages with line breaks stay one line


#: Names a module run as a script has; such a module cannot be imported by name in another process.
SCRIPT_MODULES = ("__main__", "__mp_main__")


def backend_name(backend: Backend | None) -> str | None:
    """The name that selects ``backend`` (``"reference"``, ``"llvm"``), or None for a user's callable."""
    if backend is None:
        return "reference"
    if type(backend) is LLVMBackend:
        return LLVMBackend.name
    return None


def module_search_path(module: str) -> str | None:
    """The folder (relative to the working directory where it lies below it) that a fresh
    ``python -m`` process started here needs on its path to import ``module`` as this process did,
    or None where it needs none: the working directory itself, or a folder already on the default
    path (an installed package)."""
    loaded = sys.modules.get(module)
    file = getattr(loaded, "__file__", None)
    if not file:
        return None
    root = Path(file).resolve().parent
    for _ in range(module.count(".") + (Path(file).name == "__init__.py")):
        root = root.parent
    cwd = Path.cwd().resolve()
    if root == cwd or "site-packages" in root.parts or "dist-packages" in root.parts:
        return None
    return str(root.relative_to(cwd)) if root.is_relative_to(cwd) else str(root)


def rerun_text(op: str, seed: int, *, custom_rule: bool, checks: str, backend: Backend | None,
               max_examples: int, shrink: bool, user_module: str | None = None) -> str:
    """The command that reruns a failed ``check_op`` call: the CLI form when it can, else the Python call.

    ``user_module`` is the module that declares ``op`` when a user's module does (None for an op of
    opgrad's registry): the CLI imports it with ``--import``, since a fresh process knows only the
    registry's operators. A module run as a script, a candidate rule or a backend callable exists
    only in the caller's process, so those runs quote the ``check_op(...)`` call made there, with
    a placeholder for what only the caller has. The hypothesis search depends on the number of
    examples too, so a non-default count is quoted.
    """
    named_backend = backend_name(backend)
    importable = user_module is None or user_module not in SCRIPT_MODULES
    if not custom_rule and checks == ALL_CHECKS and named_backend is not None and importable:
        flags = f" --import {user_module}" if user_module is not None else ""
        flags += f" --seed {seed}"
        flags += f" --examples {max_examples}" if max_examples != 100 else ""
        flags += f" --backend {named_backend}" if named_backend != "reference" else ""
        flags += "" if shrink else " --no-shrink"
        path = module_search_path(user_module) if user_module is not None else None
        # A module pytest imported from tests/, say: a fresh process needs its folder.
        return f"{f'PYTHONPATH={path} ' if path is not None else ''}opgrad check {op}{flags}"
    args = [repr(op)]
    if custom_rule:
        args.append("gradient=<your rule>")
    if checks != ALL_CHECKS:
        args.append(f"checks={checks!r}")
    if named_backend is None:
        args.append("backend=<your backend>")
    elif named_backend != "reference":
        args.append(f"backend={named_backend!r}")
    if max_examples != 100:
        args.append(f"max_examples={max_examples}")
    if not shrink:
        args.append("shrink=False")
    args.append(f"seed={seed}")
    return f"opgrad.checks.check_op({', '.join(args)})"


def assert_op(name: str | Operator, **kwargs: object) -> OpReport:
    """``check_op`` for test suites: raises ``AssertionError`` with the failure report text."""
    report = check_op(name, **kwargs)  # type: ignore[arg-type]
    if not report.passed:
        raise AssertionError(str(report))
    return report


def check_ops(names: Sequence[str] | None = None, *, progress: Callable[[OpReport], None] | None = None,
              **kwargs: object) -> list[OpReport]:
    """``check_op`` over several operators (all registered ones by default), in name order.

    An operator that none of the selected ``checks`` applies to gets a report with no checks and
    a note saying so; if that leaves nothing checked at all, ``NothingToCheckError`` is raised.
    """
    from opgrad import registry

    chosen = list(names) if names else registry.names()
    reports = []
    skipped = 0
    for n in chosen:
        try:
            report = check_op(n, **kwargs)  # type: ignore[arg-type]
        except NothingToCheckError as exc:
            if len(chosen) == 1:
                raise
            # A subset such as checks="abc" skips the ops it does not apply to, visibly.
            report = OpReport(op=resolve_op(n).name, passed=True, notes=[str(exc)])
            skipped += 1
        reports.append(report)
        if progress is not None:
            progress(report)
    if reports and skipped == len(reports):
        raise NothingToCheckError(f"nothing to check: checks={kwargs.get('checks')!r} applies to none of "
                                  f"{', '.join(r.op for r in reports)}")
    return reports
