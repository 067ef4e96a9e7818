"""Project-level guarantees: the CLI table, generated docs in sync, packaging, lint."""

from __future__ import annotations

import ast
import importlib
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


def test_mypy_is_clean(tmp_path: Path) -> None:
    mypy = shutil.which("mypy") or str(Path(sys.executable).parent / "mypy")
    if not Path(mypy).exists():
        raise AssertionError("mypy is not installed: install the dev extra (pip install -e '.[dev]')")
    # mypy names modules by their paths and does not read setuptools' package-dir, so in the source
    # tree `opgrad.registry.*` and `opgrad.checks.*` would resolve to nothing, and with
    # ignore_missing_imports everything imported from them would be Any. The installed layout
    # (registry/ and checks/ inside opgrad/) lets it check those imports.
    shutil.copytree(ROOT / "opgrad", tmp_path / "opgrad", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "registry", tmp_path / "opgrad" / "registry", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "checks", tmp_path / "opgrad" / "checks", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    # A user's code against the installed package: the lazily loaded names (opgrad.compile,
    # opgrad.checks.*) are typed, so a misspelt keyword is caught before it runs.
    (tmp_path / "users_code.py").write_text(
        "import opgrad\n"
        "from opgrad.checks import check_op\n"
        "passed: bool = check_op('relu', max_exampels=5).passed\n"
        "compiled = opgrad.compile(opgrad.function([], opgrad.const(1.0)), inplace=True)\n")
    result = subprocess.run([mypy, "--cache-dir", str(tmp_path / ".mypy_cache"), "opgrad", "users_code.py"],
                            capture_output=True, text=True, cwd=tmp_path)
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert [line.split(": error:")[0] for line in errors] == ["users_code.py:3", "users_code.py:4"], result.stdout
    assert all('Unexpected keyword argument "' in line for line in errors), result.stdout


def test_the_pytest_plugin_imports_from_the_source_tree_alone() -> None:
    # pytest run in a checkout or unpacked sdist imports `opgrad` from that tree, where checks/
    # is not yet opgrad.checks: the plugin's entry point must lie in opgrad/ itself.
    import tomllib

    entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["pytest11"]["opgrad"]
    package, _, module = entry.partition(".")
    assert package == "opgrad" and "." not in module, entry
    assert (ROOT / "opgrad" / f"{module}.py").exists(), entry


def test_every_lazily_loaded_name_of_the_checks_package_is_visible_to_type_checkers() -> None:
    import opgrad.checks

    tree = ast.parse(Path(opgrad.checks.__file__).read_text())
    guarded = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    typed = {alias.asname: node.module for node in guarded.body if isinstance(node, ast.ImportFrom)
             for alias in node.names}
    assert sorted(typed) == opgrad.checks.__all__
    for name, module in typed.items():
        assert getattr(importlib.import_module(f"opgrad.checks.{module}"), name) is getattr(opgrad.checks, name)


def test_readme_example_runs_and_compiled_matches_reference(capsys) -> None:
    readme = (ROOT / "README.md").read_text()
    code = readme.split("## What it looks like", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)  # the README's example, as written
    reference, compiled_outputs = namespace["reference"], (namespace["loss_value"], namespace["d_w"], namespace["d_v"])
    for ref, got in zip(reference, compiled_outputs):
        assert abs(ref - got).max() <= 1e-4 * max(1.0, abs(ref).max())


# ----- the house: no private names across modules, no import circles -----

PACKAGES = {"opgrad": ROOT / "opgrad", "opgrad.registry": ROOT / "registry", "opgrad.checks": ROOT / "checks"}


def _modules() -> dict[str, Path]:
    """Every opgrad module by its import name (registry/ and checks/ install as opgrad.registry/.checks)."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def test_no_private_names_are_imported_across_modules() -> None:
    offenders = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                offenders += [f"{path.relative_to(ROOT)}:{node.lineno}: from {_absolute(module, path, node)} import "
                              f"{alias.name}" for alias in node.names
                              if alias.name.startswith("_") and not alias.name.startswith("__")]
    assert not offenders, "private names imported from another module (make them public or move them):\n" + \
        "\n".join(offenders)


def _module_level_imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The opgrad modules ``module`` imports when it is imported: top-level statements, including
    those under if/try, but not under ``if TYPE_CHECKING`` nor inside functions."""
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(module, path, node)
                names.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)

    visit(ast.parse(path.read_text()).body)
    resolved = set()
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module and not module.startswith(name + "."):  # a package's own parents load first
            resolved.add(name)
    return resolved


def test_no_import_circles_at_module_level() -> None:
    known = _modules()
    graph = {m: _module_level_imports(m, p, known) for m, p in known.items()}
    circles, state = [], dict.fromkeys(graph, 0)  # 0 unvisited, 1 on the current path, 2 done

    def walk(module: str, trail: list[str]) -> None:
        state[module] = 1
        for other in sorted(graph[module]):
            if state[other] == 1:
                circles.append(" -> ".join(trail[trail.index(other):] + [other]))
            elif state[other] == 0:
                walk(other, trail + [other])
        state[module] = 2

    for module in sorted(graph):
        if state[module] == 0:
            walk(module, [module])
    assert not circles, "module-level import circles (move a typing-only import under TYPE_CHECKING, or move " \
        "the shared code down a layer):\n" + "\n".join(circles)
