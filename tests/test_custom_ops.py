"""Operators declared in a user's own module are first-class: ops, compile, checker, pytest plugin, errors."""

from __future__ import annotations

import contextlib
import importlib
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

import opgrad
from opgrad import ops
from opgrad.checks import check_op, resolve_backend
from opgrad.errors import OpCallError, RegistryError

CUBE = textwrap.dedent('''
    """A user's operator library: cube, declared outside opgrad's registry."""
    import numpy as np
    from opgrad import ops
    from opgrad.op import Input, Operator

    cube = Operator("user_cube", inputs=[Input("data", dims=("N",))], doc="data ** 3")

    @cube.shape_rule
    def _shape(data, attrs):
        return data

    @cube.reference
    def _forward(data):
        return data * data * data

    @cube.gradient
    def _gradient(call, grad):
        """d_data = 3 data^2 grad"""
        x = call.args[0]
        return [ops.multiply(grad, ops.multiply(ops.multiply(x, x), 3.0))]

    @cube.mutant("2 data^2 instead of 3 data^2")
    def _wrong(call, grad):
        x = call.args[0]
        return [ops.multiply(grad, ops.multiply(ops.multiply(x, x), 2.0))]

    @cube.lowering
    def _lowering(kb, call, out, data):
        """out = data * data * data"""
        kb.elementwise(out, [data], lambda s, v: s.mul(s.mul(v[0], v[0]), v[0]))
''')


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    (tmp_path / "my_user_ops.py").write_text(CUBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("my_user_ops")
    yield module
    from opgrad import registry

    registry.unregister("user_cube")
    sys.modules.pop("my_user_ops", None)


def test_user_op_joins_ops_compiles_and_checks(user_module: object) -> None:
    x = opgrad.var("x", (5,), "float64")
    y = ops.user_cube(x)
    fn = opgrad.grad(opgrad.function([x], ops.sum(y)))
    data = np.linspace(-2, 2, 5)
    value, grad = opgrad.compile(fn)(data)
    np.testing.assert_allclose(value, np.sum(data**3), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(grad, 3 * data**2, rtol=1e-12)
    assert check_op("user_cube", max_examples=20, seed=0).passed
    assert check_op("user_cube", max_examples=10, seed=0, backend=resolve_backend("llvm")).passed
    from opgrad.checks.mutants import declared_mutants

    mutants = [m for m in declared_mutants() if m.op == "user_cube"]
    assert mutants and not check_op("user_cube", gradient=mutants[0].rule, max_examples=20, seed=0).passed


def test_user_op_errors_name_the_users_module(user_module: object) -> None:
    with pytest.raises(OpCallError, match=r"^my_user_ops\.user_cube: invalid call(?s:.*)unknown attribute\(s\) power"):
        ops.user_cube(opgrad.var("m", (2, 3)), power=2)
    with pytest.raises(TypeError, match=r"my_user_ops\.user_cube: input 'data'"):
        ops.user_cube("text")


def test_a_name_already_taken_is_refused() -> None:
    from opgrad.op import Input, Operator

    with pytest.raises(RegistryError, match=r"operator 'relu' declared in module .* is already declared in "
                                            r"registry/relu\.py"):
        Operator("relu", inputs=[Input("data")])


def test_missing_lowering_names_the_users_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_unlowered_ops.py").write_text(CUBE.replace("user_cube", "user_cube2").split("@cube.lowering")[0])
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("my_unlowered_ops")
    try:
        x = opgrad.var("x", (3,), "float64")
        with pytest.raises(NotImplementedError, match=r"add '@user_cube2\.lowering' in module my_unlowered_ops"):
            opgrad.compile(opgrad.function([x], ops.user_cube2(x)))
    finally:
        from opgrad import registry

        registry.unregister("user_cube2")
        sys.modules.pop("my_unlowered_ops", None)


def test_pytest_plugin_checks_a_user_op_in_the_users_suite(tmp_path: Path) -> None:
    (tmp_path / "my_user_ops.py").write_text(CUBE)
    (tmp_path / "test_mine.py").write_text(textwrap.dedent("""
        import my_user_ops  # declaring the op registers it

        def test_cube(opgrad_check):
            opgrad_check("user_cube", max_examples=10)
    """))
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout


def test_only_user_ops_can_be_unregistered() -> None:
    from opgrad import registry

    with pytest.raises(RegistryError, match=r"operator 'relu' is declared in registry/relu\.py and cannot be"):
        registry.unregister("relu")


def test_a_module_that_declares_a_name_twice_is_refused_and_one_imported_again_replaces_its_op(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # One run of a module declaring a name twice is a slip (the second op would silently replace
    # the first); the module run again (importlib.reload, a notebook cell) replaces its ops.
    helper = textwrap.dedent('''
        import numpy as np
        from opgrad import ops
        from opgrad.op import Input, Operator

        def scaled(name, k):
            op = Operator(name, inputs=[Input("data")], doc=f"{k} * data")
            op.shape_rule(lambda data, attrs: data)
            op.reference(lambda data: k * data)
            op.gradient(lambda call, grad: [ops.multiply(grad, float(k))])
            return op
    ''')
    (tmp_path / "my_scaled_helper.py").write_text(helper)
    (tmp_path / "my_scaled_ops.py").write_text("from my_scaled_helper import scaled\n\n"
                                               "double = scaled('user_double', 2)\n")
    (tmp_path / "my_slip_ops.py").write_text("from my_scaled_helper import scaled\n\n"
                                             "double = scaled('user_double2', 2)\ntriple = scaled('user_double2', 3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from opgrad import registry

    try:
        module = importlib.import_module("my_scaled_ops")
        first = registry.get("user_double")
        assert importlib.reload(module).double is registry.get("user_double") is not first
        with pytest.raises(RegistryError, match=r"operator 'user_double2' is declared twice in module my_slip_ops "
                                                r"\(lines 3 and 4\)"):
            importlib.import_module("my_slip_ops")
    finally:
        for name in ("user_double", "user_double2"):
            if name in registry.names():
                registry.unregister(name)
        for name in ("my_scaled_helper", "my_scaled_ops", "my_slip_ops"):
            sys.modules.pop(name, None)


@pytest.mark.parametrize("name", ["", "my-op", "with space", "__class__", "_private", "lambda", 3])
def test_an_operator_name_must_be_a_public_identifier(name: object) -> None:
    from opgrad.op import Input, Operator

    with pytest.raises(ValueError, match="must be a Python identifier"):
        Operator(name, inputs=[Input("data")])  # type: ignore[arg-type]


def test_ir_that_llvm_rejects_from_a_users_lowering_names_that_lowering(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # sin takes one operand; the lowering passes two, which LLVM's verifier rejects.
    bad = CUBE.replace("user_cube", "user_bad_lowering").replace(
        "kb.elementwise(out, [data], lambda s, v: s.mul(s.mul(v[0], v[0]), v[0]))",
        'kb.elementwise(out, [data], lambda s, v: s.call("sin", v[0], v[0]))')
    (tmp_path / "my_bad_lowering_ops.py").write_text(bad)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("OPGRAD_CACHE_DIR", str(tmp_path / "cache"))
    importlib.import_module("my_bad_lowering_ops")
    try:
        x = opgrad.var("x", (3,), "float64")
        with pytest.raises(opgrad.errors.CompileError,
                           match=r"LLVM rejected the IR of kernel \S+ \(user_bad_lowering\) of function .*, which "
                                 r"@user_bad_lowering\.lowering in module my_bad_lowering_ops emitted"):
            opgrad.compile(opgrad.function([x], ops.user_bad_lowering(x)))
    finally:
        from opgrad import registry

        registry.unregister("user_bad_lowering")
        sys.modules.pop("my_bad_lowering_ops", None)


def test_opgrad_ops_lists_the_operators_of_an_imported_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "my_listed_ops.py").write_text(CUBE.replace("user_cube", "user_listed_cube"))
    monkeypatch.chdir(tmp_path)
    from opgrad import cli, registry

    try:
        assert cli.main(["ops", "--import", "my_listed_ops"]) == 0
        assert any(line.startswith("user_listed_cube ") for line in capsys.readouterr().out.splitlines())
    finally:
        if "user_listed_cube" in registry.names():
            registry.unregister("user_listed_cube")
        sys.modules.pop("my_listed_ops", None)


LOGCOSH = textwrap.dedent('''
    """log(cosh(x)), whose derivative tanh(x) written as (e^2x - 1) / (e^2x + 1) is NaN in float32 past 44."""
    import numpy as np
    from opgrad import ops
    from opgrad.op import Input, Interval, Operator

    logcosh = Operator("user_logcosh", inputs=[Input("data", domain=(Interval(-60.0, 60.0),))], doc="log(cosh(x))")

    @logcosh.shape_rule
    def _shape(data, attrs):
        return data

    @logcosh.reference
    def _forward(data):
        return (np.logaddexp(data, -data) - np.log(2.0)).astype(data.dtype)

    @logcosh.gradient
    def _gradient(call, grad):
        """d_data = grad * tanh(x)"""
        return [ops.multiply(grad, ops.tanh(call.args[0]))]

    def overflowing(call, grad):
        e = ops.exp(ops.multiply(call.args[0], 2.0))
        return [ops.multiply(grad, ops.divide(ops.subtract(e, 1.0), ops.add(e, 1.0)))]
''')


@contextlib.contextmanager
def declared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str, text: str,
             ops: Sequence[str]) -> Iterator[object]:
    """The user module ``module`` with source ``text``, imported; its ``ops`` unregistered after."""
    (tmp_path / f"{module}.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        yield importlib.import_module(module)
    finally:
        from opgrad import registry

        for name in ops:
            if name in registry.names():
                registry.unregister(name)
        sys.modules.pop(module, None)


def test_a_gradient_that_overflows_only_in_float32_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with declared(tmp_path, monkeypatch, "my_logcosh_ops", LOGCOSH, ["user_logcosh"]) as module:
        assert check_op("user_logcosh", max_examples=60, seed=0).passed
        report = check_op("user_logcosh", gradient=module.overflowing, max_examples=60, seed=0)  # type: ignore[attr-defined]
        assert not report.passed and report.failure is not None
        assert report.failure.check == "b" and report.failure.dtype == "float32"
        assert "the rule overflows or divides inf by inf in float32" in report.failure.problem


def test_float32_forms_that_lose_the_value_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A gradient or forward right in float64 and wrong in float32 (what training runs) fails, and
    so does a forward returning a Python value instead of an array."""
    lossy = LOGCOSH + textwrap.dedent('''
        def cancelling(call, grad):
            big = ops.multiply(ops.ones_like(call.args[0]), 1e8)
            return [ops.multiply(grad, ops.subtract(ops.add(ops.tanh(call.args[0]), big), big))]
    ''')
    with declared(tmp_path, monkeypatch, "my_lossy_ops", lossy, ["user_logcosh"]) as module:
        report = check_op("user_logcosh", gradient=module.cancelling, max_examples=30, seed=0)  # type: ignore[attr-defined]
        assert not report.passed and report.failure is not None
        assert report.failure.check == "b" and report.failure.dtype == "float32"
        assert "differs from the float64 rule on the same float32 inputs" in report.failure.problem
    scaled = LOGCOSH.replace("user_logcosh", "user_scaled").replace(
        "- np.log(2.0)).astype(data.dtype)", "- np.log(2.0 if data.dtype == np.float64 else 2.5)).astype(data.dtype)")
    listed = LOGCOSH.replace("user_logcosh", "user_listed").replace(".astype(data.dtype)", ".tolist()")
    with declared(tmp_path, monkeypatch, "my_scaled_ops", scaled, ["user_scaled"]):
        report = check_op("user_scaled", max_examples=30, seed=0)
        assert not report.passed and report.failure is not None
        assert report.failure.check == "g" and report.failure.dtype == "float32"
        assert "the forward in float32 differs from the float64 forward" in report.failure.problem
    with declared(tmp_path, monkeypatch, "my_listed_ops", listed, ["user_listed"]):
        report = check_op("user_listed", max_examples=5, seed=0)
        assert not report.passed and report.failure is not None
        assert re.search(r"the forward returns a (float|list), not a numpy array", report.failure.problem)


def test_a_forgotten_gradient_and_a_raising_shape_rule_are_reported_where_they_are(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    forgotten = LOGCOSH.replace("user_logcosh", "user_nograd").split("@logcosh.gradient")[0]
    broken = LOGCOSH.replace("user_logcosh", "user_badshape").replace("return data\n", "return data.shape[3]\n")
    with declared(tmp_path, monkeypatch, "my_nograd_ops", forgotten, ["user_nograd"]):
        report = check_op("user_nograd", max_examples=5, seed=0)
        assert not report.passed and report.failure is not None and report.failure.check == "a"
        assert "declares no gradient: register one with @user_nograd.gradient" in report.failure.problem
    with declared(tmp_path, monkeypatch, "my_badshape_ops", broken, ["user_badshape"]):
        report = check_op("user_badshape", max_examples=5, seed=0)
        assert not report.passed and report.failure is not None
        assert re.search(r"in the shape rule of 'user_badshape': .*my_badshape_ops\.py:\d+ in _shape",
                         report.failure.problem), report.failure.problem


def test_an_unshrunk_failure_of_an_imported_op_quotes_the_command_line() -> None:
    from opgrad.checks.runner import rerun_text

    text = rerun_text("user_op", 4, custom_rule=False, checks="abcdefg", backend=None, max_examples=30,
                      shrink=False, user_module="mylib.ops")
    assert text == "opgrad check user_op --import mylib.ops --seed 4 --examples 30 --no-shrink"


def test_a_failure_at_an_undeclared_kink_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plain_relu = textwrap.dedent('''
        import numpy as np
        from opgrad import ops
        from opgrad.op import Input, Operator

        relu = Operator("user_plain_relu", inputs=[Input("data")], doc="max(x, 0), its kink at 0 not declared")

        @relu.shape_rule
        def _shape(data, attrs):
            return data

        @relu.reference
        def _forward(data):
            return np.maximum(data, 0).astype(data.dtype)

        @relu.gradient
        def _gradient(call, grad):
            """d_data = grad * (data > 0)"""
            x = call.args[0]
            return [ops.multiply(grad, ops.greater(x, ops.zeros_like(x)))]
    ''')
    with declared(tmp_path, monkeypatch, "my_plain_relu_ops", plain_relu, ["user_plain_relu"]):
        report = check_op("user_plain_relu", max_examples=100, seed=0)
        assert not report.passed and report.failure is not None and report.failure.check == "b"
        assert "jumps at this input (a kink), which the op does not declare" in report.failure.problem
