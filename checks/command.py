"""``opgrad check [OP ...] [--import MODULE] [--examples N] [--seed S] [--backend B] [--jobs J] [--mutants]``.

Prints one table row per operator as it finishes, then the failure report of every failing
operator, and exits 1 if any failed. ``--import`` first imports a user's module, which registers
the operators it declares. With ``--mutants`` it checks the operators' planted wrong
gradients instead, prints which check killed each, and exits 1 if one survived. Imports stay
inside ``run``: the CLI imports this module for every subcommand, and ``opgrad ops`` must not
pay for hypothesis.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import traceback
from typing import Any

from opgrad.argtypes import non_negative_int, positive_int


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ops", nargs="*", metavar="OP", help="operators to check (default: every registered op)")
    add_import_option(parser)
    parser.add_argument("--examples", type=positive_int, default=100,
                        help="generated examples per operator (default 100)")
    parser.add_argument("--seed", type=non_negative_int, default=None,
                        help="reproduce a run (a failure report prints its seed)")
    parser.add_argument("--backend", default="reference", choices=("reference", "llvm"),
                        help="backend compared with the numpy reference in check g (default: reference)")
    parser.add_argument("--jobs", type=positive_int, default=min(2, os.cpu_count() or 1),
                        help="operators checked in parallel processes (default: 2 or the CPU count)")
    parser.add_argument("--no-shrink", action="store_true", help="report the first failing example unshrunk")
    parser.add_argument("--mutants", action="store_true",
                        help="check the planted wrong gradients of OP (default: of every op) and say which check "
                             "killed each")


def add_import_option(parser: argparse.ArgumentParser) -> None:
    """``--import MODULE`` (repeatable), shared with the compile fuzzer's command line."""
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                        help="import MODULE first, registering the operators it declares (a module name as "
                             "python -m takes it, e.g. mylib.ops; repeatable)")


def import_user_modules(names: list[str]) -> None:
    """Import the modules of ``--import``; importing one registers the operators it declares.

    A name is looked up as ``python -m`` looks it up: on ``sys.path``, then in the current
    directory, which the ``opgrad`` script (unlike ``python -m``) does not put on ``sys.path``.
    A module that cannot be imported is a ``ConfigError`` naming it and why.
    """
    from opgrad.errors import ConfigError

    for name in names:
        if name.endswith(".py") or os.sep in name or "/" in name:
            raise ConfigError(f"--import {name}: expected a module name as python -m takes it (mylib.ops), "
                              f"not a file path")
        try:
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as exc:
                cwd = os.getcwd()
                # Only when needed: a directory on sys.path can shadow packages (spawned workers inherit it).
                if exc.name != name.split(".")[0] or "" in sys.path or cwd in sys.path:
                    raise
                sys.path.append(cwd)
                importlib.import_module(name)
        except Exception as exc:  # the user's module raising on import is the user's to fix: say where
            where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ is not None else None
            at = f" (at {where.filename}:{where.lineno})" if where is not None and \
                not isinstance(exc, (ImportError, SyntaxError)) else ""
            raise ConfigError(f"--import {name}: cannot import it: {type(exc).__name__}: {exc}{at}") from None


def _check_one(job: tuple[str, dict[str, Any]]) -> Any:
    from opgrad.checks.backends import resolve_backend
    from opgrad.checks.runner import check_op

    name, options = job
    backend = resolve_backend(options.pop("backend"))
    return check_op(name, backend=backend, **options)


def run(args: argparse.Namespace) -> int:
    from opgrad import registry
    from opgrad.checks.backends import resolve_backend
    from opgrad.checks.report import format_table
    from opgrad.errors import ConfigError, RegistryError

    import_user_modules(args.imports)
    try:
        names = [registry.get(n).name for n in args.ops] if args.ops else registry.names()
        resolve_backend(args.backend)  # fail early, with the reason, if the backend is unavailable
    except (RegistryError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    if args.mutants:
        return _run_mutants(names, args)
    options = {"max_examples": args.examples, "seed": args.seed, "backend": args.backend,
               "shrink": not args.no_shrink}
    jobs = [(n, dict(options)) for n in names]
    start = time.perf_counter()
    print(f"checking {len(names)} operator(s), {args.examples} examples each, backend {args.backend}", flush=True)
    if args.jobs > 1 and len(jobs) > 1:
        import multiprocessing

        # A worker registers the user's operators as this process did; the examples it draws do not
        # depend on what else either process imported (profiles.draws_independent_of_loaded_modules).
        with multiprocessing.get_context("spawn").Pool(args.jobs, initializer=import_user_modules,
                                                       initargs=(args.imports,)) as pool:
            # Slowest first (conv, pools) so the two workers finish together.
            order = sorted(range(len(jobs)), key=lambda i: not names[i].startswith(("conv", "max_pool", "avg_pool")))
            results = dict(zip(order, pool.map(_check_one, [jobs[i] for i in order], chunksize=1)))
        reports = [results[i] for i in range(len(jobs))]
    else:
        reports = [_check_one(job) for job in jobs]
    print(format_table(reports))
    _record(reports, args.backend, args.examples)
    failed = [r for r in reports if not r.passed]
    for r in failed:
        print()
        print(r.failure)
    total = time.perf_counter() - start
    skipped = [r for r in reports if r.passed and not r.checks]
    for r in skipped:
        print(f"\n{r.op}: skipped, nothing to check on this backend: {'; '.join(r.notes)}")
    noted = [r for r in reports if r.passed and r.checks and r.notes]
    if noted:  # what a passing op was not checked for (no gradient, no kernel, skipped comparisons)
        print()
        for r in noted:
            for note in r.notes:
                print(f"{r.op}: {note}")
    unchecked = f", {len(skipped)} skipped" if skipped else ""
    print(f"\n{len(reports) - len(failed) - len(skipped)}/{len(reports)} operators passed{unchecked} in {total:.1f}s"
          f" (sum of per-op times {sum(r.seconds for r in reports):.1f}s)")
    return 1 if failed else 0


def _record(reports: list[Any], backend: str, examples: int) -> None:
    """Keep each operator's verdict for ``opgrad ops --matrix``; a cache that cannot be written
    costs the record, not the run."""
    import sys

    from opgrad.checks.results import record
    from opgrad.errors import OpgradError

    try:
        record(reports, backend, examples)
    except (OSError, OpgradError) as exc:
        print(f"opgrad check: note: results not recorded: {exc}", file=sys.stderr)


def _run_mutants(names: list[str], args: argparse.Namespace) -> int:
    from opgrad.checks.mutants import MUTANTS, run_mutants
    from opgrad.errors import ConfigError

    chosen = [m for m in MUTANTS if m.op in set(names)]
    if not chosen:
        raise ConfigError(f"no planted mutants for {', '.join(names)}; operators with mutants: "
                          f"{', '.join(sorted({m.op for m in MUTANTS}))}")
    seed = 0 if args.seed is None else args.seed
    print(f"checking {len(chosen)} mutant(s) of {len({m.op for m in chosen})} operator(s), up to {args.examples} "
          f"examples each, seed {seed}", flush=True)
    start = time.perf_counter()
    survived = 0
    width = max(len(m.op) for m in chosen)
    for mutant, report in run_mutants(max_examples=args.examples, seed=seed, shrink=not args.no_shrink,
                                      mutants=chosen):
        if report.failure is not None:
            verdict = f"killed by check {report.failure.check} ({report.failure.check_name}) after " \
                      f"{report.examples + 1} example(s)"
        else:
            verdict = f"SURVIVED {report.examples} examples"
            survived += 1
        print(f"{mutant.op:{width}}  {mutant.mistake}\n{'':{width}}  -> {verdict}", flush=True)
    print(f"\nkilled {len(chosen) - survived}/{len(chosen)} in {time.perf_counter() - start:.1f}s")
    return 1 if survived else 0
