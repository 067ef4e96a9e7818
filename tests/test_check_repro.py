"""A failure report's repro line runs as printed: named backends, operators of a user's module.

Also the command-line errors around them: ``--import`` of a module that cannot be imported, and
the compile fuzzer's ``--ops`` naming an unknown operator or one with no kernel to compile.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from opgrad import cli, registry
from opgrad.checks import check_op
from opgrad.checks.mutants import MUTANTS
from opgrad.checks.runner import rerun_text

#: A user's operator library whose gradient is wrong: the denominator should be squared.
SOFTSIGN = textwrap.dedent('''
    """softsign, declared outside opgrad's registry, with a wrong gradient."""
    import numpy as np
    from opgrad import ops
    from opgrad.op import Input, Operator

    softsign = Operator("user_softsign", inputs=[Input("data")], doc="data / (1 + |data|)")

    @softsign.shape_rule
    def _shape(data, attrs):
        return data

    @softsign.reference
    def _forward(data):
        return data / (1 + np.abs(data))

    @softsign.gradient
    def _gradient(call, grad):
        """d_data = grad / (1 + |data|)   (should be grad / (1 + |data|)^2)"""
        return [ops.divide(grad, ops.add(ops.abs(call.args[0]), 1.0))]

    @softsign.lowering
    def _lowering(kb, call, out, data):
        """out = data / (1 + |data|)"""
        kb.elementwise(out, [data], lambda s, v: s.div(v[0], s.add(s.const(1.0), s.call("fabs", v[0]))))
''')

#: What the ``opgrad`` console script does; run from a file, so the current directory is not on
#: ``sys.path`` (unlike ``python -m``), and ``--import`` must still find a module there.
OPGRAD_SCRIPT = "import sys\nfrom opgrad.cli import main\nsys.exit(main())\n"


def repro_line(text: str) -> str:
    """The command of the report's ``repro:`` line."""
    lines = [line for line in text.splitlines() if line.strip().startswith("repro:")]
    assert len(lines) == 1, text
    return lines[0].split(": ", 2)[-1]


def without_times(text: str) -> list[str]:
    return [re.sub(r"\d+\.\d+s\b", "<t>", line) for line in text.splitlines()]


def _mutant(op: str, words: str):
    return next(m.rule for m in MUTANTS if m.op == op and words in m.mistake)


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The name of an importable module declaring ``user_softsign`` (not yet imported)."""
    (tmp_path / "my_softsign_ops.py").write_text(SOFTSIGN)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_softsign_ops"
    if "user_softsign" in registry.names():
        registry.unregister("user_softsign")
    sys.modules.pop("my_softsign_ops", None)


# ----- named backends -----


def test_cli_repro_line_names_the_llvm_backend(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    pytest.importorskip("llvmlite", reason="the llvm backend needs llvmlite")
    monkeypatch.setenv("OPGRAD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(registry.get("relu"), "_gradient", _mutant("relu", "kink"))
    assert cli.main(["check", "relu", "--examples", "20", "--seed", "1", "--backend", "llvm", "--jobs", "1"]) == 1
    assert repro_line(capsys.readouterr().out) == "opgrad check relu --seed 1 --examples 20 --backend llvm"


def test_api_repro_line_names_the_llvm_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("llvmlite", reason="the llvm backend needs llvmlite")
    monkeypatch.setattr(registry.get("relu"), "_gradient", _mutant("relu", "kink"))
    report = check_op("relu", seed=0, backend="llvm")
    assert not report.passed
    assert repro_line(str(report)) == "opgrad check relu --seed 0 --backend llvm"
    report = check_op("relu", seed=0, backend="llvm", checks="abf")
    assert not report.passed
    assert repro_line(str(report)) == "opgrad.checks.check_op('relu', checks='abf', backend='llvm', seed=0)"


def test_repro_line_of_a_backend_callable_keeps_a_placeholder() -> None:
    def my_backend(fn):
        raise AssertionError("not called")

    common = {"custom_rule": False, "checks": "abcdefg", "max_examples": 100, "shrink": True}
    # The CLI cannot take a callable, so the Python call made in the user's process is quoted.
    assert rerun_text("relu", 3, backend=my_backend, **common) == (
        "opgrad.checks.check_op('relu', backend=<your backend>, seed=3)")


# ----- operators of a user's module -----


def test_repro_line_of_a_user_op_imports_its_module() -> None:
    common = {"custom_rule": False, "checks": "abcdefg", "max_examples": 100, "shrink": True, "backend": None}
    assert rerun_text("my_op", 5, user_module="mylib.ops", **common) == "opgrad check my_op --import mylib.ops --seed 5"
    # A script's module is __main__, which no other process can import: the call made in it is quoted.
    assert rerun_text("my_op", 5, user_module="__main__", **common) == "opgrad.checks.check_op('my_op', seed=5)"


def test_repro_line_of_a_module_imported_from_a_subfolder_puts_the_folder_on_the_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # pytest imports a test module's helpers from tests/ (its rootdir insertion); a fresh
    # `opgrad check` started in the project root needs that folder on its path.
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "my_inline_ops.py").write_text("OPS = []\n")
    monkeypatch.syspath_prepend(str(tmp_path / "tests"))
    monkeypatch.chdir(tmp_path)
    import my_inline_ops  # noqa: F401

    try:
        common = {"custom_rule": False, "checks": "abcdefg", "max_examples": 100, "shrink": True, "backend": None}
        assert rerun_text("my_op", 5, user_module="my_inline_ops", **common) == \
            "PYTHONPATH=tests opgrad check my_op --import my_inline_ops --seed 5"
    finally:
        sys.modules.pop("my_inline_ops", None)


def test_user_op_failure_repro_runs_as_printed(tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "my_softsign_ops.py").write_text(SOFTSIGN)
    script = tmp_path / "opgrad_script.py"
    script.write_text(OPGRAD_SCRIPT)

    def opgrad(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(script), *args], cwd=lib, capture_output=True, text=True,
                              timeout=300)

    first = opgrad("check", "user_softsign", "--import", "my_softsign_ops", "--seed", "0", "--jobs", "1")
    assert first.returncode == 1, first.stdout + first.stderr
    assert "FAILED user_softsign: check b" in first.stdout
    command = repro_line(first.stdout)
    assert command == "opgrad check user_softsign --import my_softsign_ops --seed 0"
    program, *args = shlex.split(command)
    assert program == "opgrad"
    again = opgrad(*args)
    assert again.returncode == 1, again.stdout + again.stderr
    assert without_times(again.stdout) == without_times(first.stdout)


@pytest.mark.parametrize("module, says", [
    ("opgrad_no_such_module", "ModuleNotFoundError: No module named 'opgrad_no_such_module'"),
    ("my_softsign_ops.py", "expected a module name"),
    ("my_raising_ops", "ZeroDivisionError: division by zero (at "),
])
def test_import_of_a_module_that_cannot_be_imported_is_a_one_line_error(
        module: str, says: str, capsys: pytest.CaptureFixture[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_raising_ops.py").write_text("import numpy\n1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert cli.main(["check", "relu", "--import", module]) == 2
    finally:
        sys.modules.pop("my_raising_ops", None)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"opgrad check: error: --import {module}: ") and says in err[0]


# ----- the compile fuzzer's command line -----


def fuzz_main(argv: list[str]) -> int:
    pytest.importorskip("llvmlite", reason="the compile fuzzer needs llvmlite")
    from opgrad.checks import fuzz

    return fuzz.main(argv)


def test_fuzz_refuses_an_op_without_a_lowering(capsys: pytest.CaptureFixture[str]) -> None:
    assert fuzz_main(["--graphs", "2", "--quiet", "--ops", "relu", "nms"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("python -m opgrad.checks.fuzz: error: ")
    assert "nms (reference only: " in lines[0] and "relu" not in lines[0] and "lowering" in lines[0]


def test_fuzz_names_unknown_ops_on_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert fuzz_main(["--graphs", "2", "--quiet", "--ops", "relu", "no_such_op", "nor_this_op"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("python -m opgrad.checks.fuzz: error: ")
    assert "'no_such_op'" in lines[0] and "'nor_this_op'" in lines[0]


def test_fuzz_imports_a_users_module(user_module: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert fuzz_main(["--graphs", "3", "--quiet", "--import", user_module, "--ops", "user_softsign"]) == 0
    assert "3 graphs" in capsys.readouterr().out


def test_a_seed_draws_the_same_examples_whatever_other_modules_are_loaded(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # Hypothesis mixes the literal constants of local modules in sys.modules into its draws: a
    # repro line run in a fresh process (other modules loaded) must still see the same examples.
    lines = [f"C{i} = {v!r}" for i, v in enumerate((0.8125, -1.4375, 2.71875, 1e-3, 3.5, -0.3125, 17.0, 0.0625))]
    (tmp_path / "probe_constants_lib.py").write_text("\n".join(lines) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def seen() -> tuple[int, float]:
        report = check_op("tanh", seed=11, max_examples=40, checks="b")
        return report.examples, report.worst_rel_error

    before = seen()
    import probe_constants_lib  # noqa: F401

    assert seen() == before
