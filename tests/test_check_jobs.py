"""``opgrad check --jobs N`` gives the serial run's table and failure reports, in the same order.

The runs are subprocesses of a script that plants two wrong gradients (mutants) at import, so the
spawned workers, which re-import the script, check the same wrong rules as the serial run.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

PLANT = textwrap.dedent("""
    import sys
    from opgrad import cli, registry
    from opgrad.checks.mutants import MUTANTS

    def rule(op, words):
        return next(m.rule for m in MUTANTS if m.op == op and words in m.mistake)

    registry.get("dense")._gradient = rule("dense", "scaled by 2")
    registry.get("relu")._gradient = rule("relu", "kink")

    if __name__ == "__main__":
        sys.exit(cli.main(sys.argv[1:]))
""")


def check_output(script: Path, jobs: int, *ops: str) -> tuple[int, list[str]]:
    done = subprocess.run([sys.executable, str(script), "check", *ops, "--examples", "10", "--seed", "3",
                           "--jobs", str(jobs)], capture_output=True, text=True, timeout=300)
    # Times are the only thing allowed to differ: the table's time column and the summary's.
    lines = [re.sub(r"\d+\.\d+s\b", "<t>", line) for line in done.stdout.splitlines()]
    return done.returncode, lines


def test_jobs_output_equals_serial_output_with_planted_failures(tmp_path: Path) -> None:
    script = tmp_path / "plant.py"
    script.write_text(PLANT)
    ops = ("relu", "dense", "tanh", "max_pool2d", "exp", "sigmoid")
    serial_code, serial = check_output(script, 1, *ops)
    parallel_code, parallel = check_output(script, 2, *ops)
    assert serial_code == parallel_code == 1
    assert "FAILED relu: check f (subgradient convention at kinks)" in serial
    assert "FAILED dense: check b (VJP vs central finite differences)" in serial
    assert serial[-1].startswith("4/6 operators passed")
    assert parallel == serial
