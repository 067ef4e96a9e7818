"""The last ``opgrad check`` result of each operator and backend, kept beside the object cache.

``check-results.json`` in the cache directory (``$OPGRAD_CACHE_DIR`` or ``~/.cache/opgrad``) maps
an operator's name to ``{backend: {"date", "backend", "examples", "passed"}}``; ``opgrad ops
--matrix`` reads it. The file is rewritten atomically, so a reader never sees half of it; two
concurrent ``opgrad check`` runs may lose one run's entries, never corrupt the file. It is a
convenience record, not a proof: an unreadable file reads as empty.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opgrad.atomic import atomic_writer
from opgrad.env import cache_dir_setting

FILE_NAME = "check-results.json"


def results_path() -> Path:
    return cache_dir_setting() / FILE_NAME


def load(path: Path | None = None) -> dict[str, dict[str, dict[str, Any]]]:
    """Every recorded result: op name -> backend -> record; empty when there is none."""
    path = path or results_path()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def record(reports: Sequence[Any], backend: str, examples: int, path: Path | None = None) -> Path:
    """Store the outcome of each report that ran checks (``OpReport``s of ``opgrad check``)."""
    path = path or results_path()
    data = load(path)
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    for report in reports:
        if not report.checks and report.passed:
            continue  # nothing ran (a check subset that does not apply): nothing to record
        data.setdefault(report.op, {})[backend] = {"date": date, "backend": backend, "examples": examples,
                                                   "passed": bool(report.passed)}
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_writer(path, what="the check results") as handle:
        handle.write(json.dumps(data, indent=1, sort_keys=True).encode())
    return path


def summary(op: str, data: dict[str, dict[str, dict[str, Any]]]) -> str:
    """``passed llvm 50 2025-01-01`` per backend, or ``never run``."""
    runs = data.get(op) or {}
    if not runs:
        return "never run"
    parts = []
    for backend in sorted(runs):
        r = runs[backend]
        verdict = "passed" if r.get("passed") else "FAILED"
        parts.append(f"{verdict} {backend} {r.get('examples', '?')} {str(r.get('date', ''))[:10]}")
    return "; ".join(parts)
