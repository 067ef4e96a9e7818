"""Malformed operator declarations fail where they are written, naming the op and what is wrong."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st

import opgrad
from opgrad import ops, registry
from opgrad.checks import check_op
from opgrad.errors import GradientError
from opgrad.op import Attr, Input, Operator


def doubling_op(name: str, attrs: Sequence[Attr] = (), gradient: Callable[..., Any] | None = None) -> Operator:
    """``2 * data``, with the given attributes and gradient rule (a correct one by default)."""
    op = Operator(name, inputs=[Input("data")], attrs=attrs, doc="2 * data")
    op.shape_rule(lambda data, attrs: data)
    op.reference(lambda data, **attrs: 2 * data)
    op.gradient(gradient or (lambda call, grad: [ops.multiply(grad, 2.0)]))
    return op


@pytest.fixture
def declared() -> Iterator[list[str]]:
    """Names of the operators a test declares; each is unregistered afterwards."""
    names: list[str] = []
    yield names
    for name in names:
        if name in registry.names():
            registry.unregister(name)


def non_negative(value: Any) -> int:
    if value < 0:
        raise ValueError("k must be >= 0")
    return int(value)


def test_duplicate_attribute_names_are_refused() -> None:
    with pytest.raises(ValueError, match="operator 'decl_dup_attr': attribute 'k' is declared twice"):
        doubling_op("decl_dup_attr", [Attr("k", default=1), Attr("k", default=2)])
    assert "decl_dup_attr" not in registry.names()


def test_attribute_named_like_an_input_is_refused() -> None:
    with pytest.raises(ValueError, match="operator 'decl_attr_like_input': attribute 'data' has the name of an input"):
        doubling_op("decl_attr_like_input", [Attr("data", default=1.0)])
    assert "decl_attr_like_input" not in registry.names()


def test_default_its_own_convert_rejects_is_refused() -> None:
    with pytest.raises(ValueError, match=r"operator 'decl_bad_default': attribute 'k': the default -1 is rejected "
                                         r"by the attribute's own convert: k must be >= 0"):
        doubling_op("decl_bad_default", [Attr("k", default=-1, convert=non_negative)])
    assert "decl_bad_default" not in registry.names()


def test_converter_that_reads_input_types_is_not_run_at_declaration(declared: list[str]) -> None:
    def rank_axis(value: Any, types: Sequence[Any], earlier: Any) -> int:
        return int(value) % len(types[0].shape)

    declared.append("decl_typed_default")
    doubling_op("decl_typed_default", [Attr("axis", default=-1, convert=rank_axis, uses_types=True)])
    x = opgrad.var("x", (2, 3), "float64")
    assert ops.decl_typed_default(x).attrs == {"axis": 1}


def test_required_attribute_the_checker_cannot_draw_is_named(declared: list[str]) -> None:
    declared.append("decl_required_attr")
    doubling_op("decl_required_attr", [Attr("k")])
    report = check_op("decl_required_attr", seed=0, max_examples=5)
    assert not report.passed and report.failure is not None
    problem = report.failure.problem
    assert "decl_required_attr" in problem and "'k'" in problem and "cannot draw" in problem, problem
    assert "filtering" not in problem


def test_required_attribute_with_a_sample_is_drawn(declared: list[str]) -> None:
    declared.append("decl_sampled_attr")
    doubling_op("decl_sampled_attr", [Attr("k", convert=non_negative, sample=lambda: st.integers(0, 3))])
    assert check_op("decl_sampled_attr", seed=0, max_examples=5).passed


def test_a_sample_may_be_the_strategy_itself(declared: list[str]) -> None:
    declared.append("decl_strategy_attr")
    doubling_op("decl_strategy_attr", [Attr("k", convert=non_negative, sample=st.integers(0, 3))])
    report = check_op("decl_strategy_attr", seed=0, max_examples=5)
    assert report.passed, report


def test_a_sample_that_gives_no_strategy_is_named(declared: list[str]) -> None:
    declared.append("decl_list_sample")
    doubling_op("decl_list_sample", [Attr("k", convert=non_negative, sample=lambda: [0, 1, 2])])
    report = check_op("decl_list_sample", seed=0, max_examples=5)
    assert report.failure is not None
    assert ("decl_list_sample: attribute 'k': sample= must be a hypothesis strategy or a function returning one"
            in report.failure.problem), report.failure.problem


def test_every_required_registry_attribute_can_be_drawn() -> None:
    undrawable = [f"{op.name}.{attr.name}" for op in registry.all_ops(include_user=False) for attr in op.attrs
                  if attr.required and attr.sample is None and op.sampler_fn is None]
    assert not undrawable


def test_gradient_rule_returning_a_bare_expression_names_the_op(declared: list[str]) -> None:
    declared.append("decl_bare_gradient")
    doubling_op("decl_bare_gradient", gradient=lambda call, grad: ops.multiply(grad, 2.0))
    x = opgrad.var("x", (3,), "float64")
    with pytest.raises(GradientError, match=r"gradient of 'decl_bare_gradient' returned the expression .* instead "
                                            r"of a list; a gradient rule must return a list with one entry"):
        opgrad.grad(opgrad.function([x], ops.sum(ops.decl_bare_gradient(x))))


def test_gradient_rule_returning_none_names_the_op(declared: list[str]) -> None:
    declared.append("decl_none_gradient")
    doubling_op("decl_none_gradient", gradient=lambda call, grad: None)
    x = opgrad.var("x", (3,), "float64")
    with pytest.raises(GradientError, match="gradient of 'decl_none_gradient' returned None instead of a list"):
        opgrad.grad(opgrad.function([x], ops.sum(ops.decl_none_gradient(x))))


def test_gradient_rule_returning_a_tuple_still_works(declared: list[str]) -> None:
    declared.append("decl_tuple_gradient")
    doubling_op("decl_tuple_gradient", gradient=lambda call, grad: (ops.multiply(grad, 2.0),))
    x = opgrad.var("x", (3,), "float64")
    _, grad = opgrad.evaluate(opgrad.grad(opgrad.function([x], ops.sum(ops.decl_tuple_gradient(x)))), np.ones(3))
    np.testing.assert_array_equal(grad, np.full(3, 2.0))


def test_a_reversed_or_infinite_domain_is_refused_at_declaration() -> None:
    from opgrad.op import Interval

    for low, high in ((3.0, 1.0), (0.0, float("inf")), (float("nan"), 1.0)):
        with pytest.raises(ValueError, match="a domain needs finite bounds, low <= high"):
            Interval(low, high)


def test_a_forward_breaking_its_shape_rule_is_named_not_the_gradient(declared: list[str]) -> None:
    declared.append("decl_flattening")
    op = Operator("decl_flattening", inputs=[Input("data")], doc="2 * data, flattened by mistake")
    op.shape_rule(lambda data, attrs: data)
    op.reference(lambda data: np.asarray(2 * data).reshape(-1))
    op.gradient(lambda call, grad: [ops.multiply(grad, 2.0)])
    report = check_op("decl_flattening", max_examples=20, seed=0)
    assert not report.passed and report.failure is not None
    assert report.failure.check == "a"
    assert "the reference forward returned shape" in report.failure.problem
    assert "the declaration is inconsistent" in report.failure.problem


def test_an_operator_built_by_a_helper_belongs_to_the_module_being_imported(tmp_path: Any,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "decl_factory.py").write_text(
        "import numpy as np\n"
        "from opgrad import ops\n"
        "from opgrad.op import Input, Operator\n"
        "def tripling(name):\n"
        "    op = Operator(name, inputs=[Input('data')], doc='3 * data')\n"
        "    op.shape_rule(lambda data, attrs: data)\n"
        "    op.reference(lambda data: 3 * data)\n"
        "    op.gradient(lambda call, grad: [ops.multiply(grad, 3.0)])\n"
        "    return op\n")
    (tmp_path / "decl_user_ops.py").write_text("from decl_factory import tripling\ntripling('decl_tripled')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        import decl_user_ops  # noqa: F401

        assert registry.get("decl_tripled").module == "decl_user_ops"
    finally:
        if "decl_tripled" in registry.names():
            registry.unregister("decl_tripled")
