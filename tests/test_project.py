"""Project-level guarantees: the CLI table, generated docs in sync, packaging, lint."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import opgrad
from opgrad import cli, docgen

ROOT = Path(__file__).resolve().parents[1]


def test_opgrad_ops_lists_every_operator_with_gradient_status(capsys) -> None:
    assert cli.main(["ops"]) == 0
    out = capsys.readouterr().out
    for op in opgrad.registry.all_ops():
        assert op.name in out
    assert "registered (non-differentiable: labels)" in out  # softmax_cross_entropy


def test_operator_reference_is_generated_from_declarations() -> None:
    committed = (ROOT / "docs" / "operators.md").read_text()
    assert committed == docgen.render(), "docs/operators.md is stale: run python -m opgrad.docgen > docs/operators.md"


def test_registry_and_checks_install_into_the_opgrad_namespace() -> None:
    import opgrad.checks
    import opgrad.registry

    assert Path(opgrad.registry.__file__).parent.name == "registry"
    assert Path(opgrad.checks.__file__).parent.name == "checks"
    assert (Path(opgrad.__file__).parent / "py.typed").exists()


def test_ruff_is_clean() -> None:
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        raise AssertionError("ruff is not installed: install the dev extra (pip install -e '.[dev]')")
    result = subprocess.run([ruff, "check", str(ROOT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_is_clean() -> None:
    mypy = shutil.which("mypy") or str(Path(sys.executable).parent / "mypy")
    if not Path(mypy).exists():
        raise AssertionError("mypy is not installed: install the dev extra (pip install -e '.[dev]')")
    result = subprocess.run([mypy, "opgrad", "checks", "registry"], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_readme_example_runs_and_compiled_matches_reference(capsys) -> None:
    readme = (ROOT / "README.md").read_text()
    code = readme.split("## What it looks like", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)  # the README's example, as written
    reference, compiled_outputs = namespace["reference"], (namespace["loss_value"], namespace["d_w"], namespace["d_v"])
    for ref, got in zip(reference, compiled_outputs):
        assert abs(ref - got).max() <= 1e-4 * max(1.0, abs(ref).max())
