"""Graph building, typing, printing, Python operators and error messages."""

from __future__ import annotations

import numpy as np
import pytest

import opgrad
from opgrad import ops


def test_python_operators_build_registered_calls() -> None:
    a = opgrad.var("a", (2, 3), "float64")
    b = opgrad.var("b", (3,), "float64")
    w = opgrad.var("w", (3, 4), "float64")
    expr = -(a + b) * 2.0 / (a - 0.5) @ w
    fn = opgrad.function([a, b, w], expr)
    x, y, z = np.ones((2, 3)) * 2, np.arange(3.0), np.arange(12.0).reshape(3, 4)
    np.testing.assert_allclose(opgrad.evaluate(fn, x, y, z), (-(x + y) * 2.0 / (x - 0.5)) @ z)
    assert expr.type == opgrad.TensorType((2, 4), "float64")


def test_printing_is_one_line_per_call() -> None:
    x = opgrad.var("x", (2, 3))
    w = opgrad.var("w", (4, 3))
    fn = opgrad.function([x, w], ops.relu(ops.dense(x, w)))
    text = str(fn)
    assert text.splitlines()[0] == "fn(%x: float32[2, 3], %w: float32[4, 3]) {"
    assert "%0 = dense(%x, %w)  # float32[2, 4]" in text
    assert "%1 = relu(%0)  # float32[2, 4]" in text
    assert text.splitlines()[-2].strip() == "return %1"


def test_bad_conv_call_names_op_input_shapes_and_expectation() -> None:
    x = opgrad.var("x", (8, 28, 28, 1))  # NHWC by mistake, as a Keras user would
    w = opgrad.var("w", (32, 1, 3, 3))
    with pytest.raises(opgrad.OpCallError) as info:
        ops.conv2d(x, w)
    message = str(info.value)
    assert "opgrad.ops.conv2d" in message
    assert "data: float32[8, 28, 28, 1]" in message
    assert "weight: float32[32, 1, 3, 3]" in message
    assert "expected weight shape (32, 28, KH, KW)" in message


def test_kernel_that_does_not_fit_is_reported() -> None:
    with pytest.raises(opgrad.OpCallError, match="does not fit the 2x2 input"):
        ops.conv2d(opgrad.var("x", (1, 1, 2, 2)), opgrad.var("w", (1, 1, 3, 3)))


def test_bad_attribute_is_reported_with_the_value() -> None:
    x = opgrad.var("x", (1, 1, 4, 4))
    with pytest.raises(opgrad.OpCallError, match=r"attribute strides=\(0, 1\): every entry must be >= 1"):
        ops.max_pool2d(x, strides=(0, 1))
    with pytest.raises(opgrad.OpCallError, match="unknown attribute"):
        ops.max_pool2d(x, stride=2)


def test_mixed_dtypes_are_not_promoted_silently() -> None:
    with pytest.raises(opgrad.OpCallError, match="mix dtypes float32, float64"):
        ops.add(opgrad.var("a", (2,), "float32"), opgrad.var("b", (2,), "float64"))


def test_labels_must_match_batch() -> None:
    with pytest.raises(opgrad.OpCallError, match=r"expected labels shape \(4,\)"):
        ops.softmax_cross_entropy(opgrad.var("z", (4, 10)), opgrad.var("y", (3,), "int64"))


def test_evaluate_rejects_wrong_argument_shape_and_dtype() -> None:
    x = opgrad.var("x", (2, 3))
    fn = opgrad.function([x], ops.relu(x))
    with pytest.raises(opgrad.ArgumentError, match=r"argument 'x' has shape \(3, 2\), expected \(2, 3\)"):
        opgrad.evaluate(fn, np.zeros((3, 2), np.float32))
    with pytest.raises(opgrad.ArgumentError, match="argument 'x' has dtype float64, expected float32"):
        opgrad.evaluate(fn, np.zeros((2, 3)))
    with pytest.raises(opgrad.ArgumentError, match="expected 1 argument"):
        opgrad.evaluate(fn)


def test_reusing_a_parameter_is_fine_and_fan_out_accumulates() -> None:
    w = opgrad.var("w", (3,), "float64")
    loss = ops.sum(ops.multiply(w, w) + w)  # w feeds three uses
    _, dw = opgrad.evaluate(opgrad.grad(opgrad.function([w], loss)), np.array([1.0, -2.0, 0.5]))
    np.testing.assert_allclose(dw, 2 * np.array([1.0, -2.0, 0.5]) + 1)


def test_unused_parameter_gets_zero_gradient_and_int_params_are_skipped() -> None:
    x = opgrad.var("x", (2, 3), "float64")
    unused = opgrad.var("unused", (4,), "float64")
    labels = opgrad.var("labels", (2,), "int64")
    fn = opgrad.function([x, unused, labels], ops.softmax_cross_entropy(x, labels))
    g = opgrad.grad(fn)
    assert len(g.outputs) == 3  # value, d_x, d_unused (labels are not differentiable)
    _, _, d_unused = opgrad.evaluate(g, np.zeros((2, 3)), np.ones(4), np.array([0, 2]))
    np.testing.assert_array_equal(d_unused, np.zeros(4))


def test_numpy_arrays_on_the_left_build_one_call() -> None:
    x = opgrad.var("x", (3,))
    m = opgrad.var("m", (3, 2))
    b = np.array([1.0, 2.0, 4.0], np.float32)
    for expr, expected in ((b + x, b + 1), (b - x, b - 1), (b * x, b), (b / x, b), (np.float32(2) * x, 2 + 0 * b)):
        assert isinstance(expr, opgrad.Call) and expr.type == x.type
        np.testing.assert_array_equal(opgrad.evaluate(opgrad.function([x], expr), np.ones(3, np.float32)), expected)
    product = np.ones((2, 3), np.float32) @ m
    assert isinstance(product, opgrad.Call) and product.shape == (2, 2)
    with pytest.raises(TypeError):
        np.exp(x)  # a ufunc on an expression is an error, not an array of expressions


def test_inputs_by_keyword_as_pytorch() -> None:
    x, y = opgrad.var("x", (3,)), opgrad.var("y", (3,))
    assert ops.subtract(lhs=x, rhs=y).args == (x, y)
    assert ops.subtract(x, rhs=y).args == (x, y)
    with pytest.raises(opgrad.OpCallError, match="input 'lhs' given by position and by keyword"):
        ops.subtract(x, lhs=y)
    with pytest.raises(opgrad.OpCallError, match="input\\(s\\) 'lhs' missing"):
        ops.subtract(rhs=y)


def test_grad_requires_scalar_output() -> None:
    x = opgrad.var("x", (2,))
    with pytest.raises(opgrad.GradientError, match="one scalar"):
        opgrad.grad(opgrad.function([x], ops.exp(x)))
    with pytest.raises(opgrad.GradientError, match=r"opgrad\.hvp needs a function returning one scalar"):
        opgrad.hvp(opgrad.function([x], ops.exp(x)))
    with pytest.raises(opgrad.GradientError, match=r"opgrad\.grad: the output is int64\[\]; only a float"):
        opgrad.grad(opgrad.function([x], ops.argmax(x)))


def test_function_rejects_free_variables_and_duplicate_names() -> None:
    x, y = opgrad.var("x", (2,)), opgrad.var("y", (2,))
    with pytest.raises(ValueError, match="not among the parameters: y"):
        opgrad.function([x], x + y)
    with pytest.raises(ValueError, match="duplicate parameter"):
        opgrad.function([x, opgrad.var("x", (2,))], x)


def test_unknown_op_suggests_close_names() -> None:
    with pytest.raises(AttributeError, match="did you mean max_pool2d"):
        ops.maxpool2d  # noqa: B018


def test_registry_lists_all_card_ops() -> None:
    names = set(opgrad.registry.names())
    card = {"dense", "bias_add", "conv2d", "max_pool2d", "avg_pool2d", "softmax_cross_entropy", "collapse_sum_like"}
    assert card <= names
    for name in card:
        assert opgrad.registry.get(name).gradient_status.registered


def test_float32_reference_stays_float32() -> None:
    x = opgrad.var("x", (2, 1, 5, 5), "float32")
    w = opgrad.var("w", (3, 1, 3, 3), "float32")
    fn = opgrad.grad(opgrad.function([x, w], ops.sum(ops.max_pool2d(ops.conv2d(x, w), pool_size=3))))
    out = opgrad.evaluate(fn, np.ones((2, 1, 5, 5), np.float32), np.ones((3, 1, 3, 3), np.float32))
    assert all(o.dtype == np.float32 for o in out)


def test_deep_graph_has_no_recursion_limit() -> None:
    x = opgrad.var("x", (2,), "float64")
    y = x
    for _ in range(3000):
        y = ops.add(y, x)
    value, dx = opgrad.evaluate(opgrad.grad(opgrad.function([x], ops.sum(y))), np.ones(2))
    assert value == 6002.0 and np.all(dx == 3001.0)


def test_plain_values_after_the_inputs_are_attributes_in_declaration_order() -> None:
    x = opgrad.var("x", (2, 3), "float64")
    assert dict(ops.sum(x, (0,), True).attrs) == dict(ops.sum(x, axis=(0,), keepdims=True).attrs)
    assert ops.sum(x, (0,), True).shape == (1, 3)
    with pytest.raises(opgrad.OpCallError, match="axis given by position and by keyword"):
        ops.sum(x, (0,), axis=1)
    with pytest.raises(opgrad.OpCallError, match=r"expected 2 input\(s\)"):
        ops.add(x, x, x)  # a tensor past the inputs stays an input-count error


def test_a_call_without_inputs_prints_only_its_attributes() -> None:
    bare = opgrad.op.Operator("nothing_in", inputs=[], attrs=[opgrad.op.Attr("n", default=2)])
    bare.shape_rule(lambda attrs: opgrad.dtypes.TensorType((attrs["n"],), "float64"))
    fn = opgrad.function([], bare(3))
    assert "nothing_in(n=3)  # float64[3]" in str(fn)
