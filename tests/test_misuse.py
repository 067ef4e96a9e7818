"""Misuse is refused with one clear error that names the culprit, the value given and what was expected.

Covers the Python API (checker arguments, variable shapes, operator inputs, the trainer) and the
``opgrad`` command, where a user error is one ``opgrad <cmd>: error: ...`` line and no traceback.
"""

from __future__ import annotations

import numpy as np
import pytest

import opgrad
from opgrad import ops
from opgrad.checks import NothingToCheckError, check_function, check_op, check_ops

# ----- opgrad.checks -----


def test_unknown_check_letters_are_named_with_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown check letter\(s\) 'x', 'y', 'z' in checks='xyz'") as info:
        check_op("relu", checks="xyz")
    assert "valid letters are 'abcdefg'" in str(info.value) and "a: gradient shape and dtype" in str(info.value)
    with pytest.raises(ValueError, match=r"unknown check letter.*'A'"):
        check_op("relu", checks="A")
    with pytest.raises(ValueError, match="selects no check"):
        check_op("relu", checks="")


def test_checks_accepts_letters_in_any_order_and_as_a_list() -> None:
    assert check_op("relu", checks="gfa", max_examples=2, seed=0).checks == ["a", "f", "g"]
    assert check_op("relu", checks=["b", "a"], max_examples=2, seed=0).checks == ["a", "b"]


def test_a_subset_that_does_not_apply_is_refused_not_reported_as_passed() -> None:
    with pytest.raises(NothingToCheckError, match=r"none of checks='d' applies to relu; .* 'abcefg'"):
        check_op("relu", checks="d")
    reports = check_ops(["relu", "one_hot"], checks="ab", max_examples=2, seed=0)
    assert reports[0].checks == ["a", "b"]
    assert reports[1].checks == [] and "nothing to check" in reports[1].notes[0]
    with pytest.raises(NothingToCheckError):
        check_ops(["one_hot", "greater"], checks="ab", max_examples=2, seed=0)


@pytest.mark.parametrize(("kwargs", "error", "words"), [
    ({"max_examples": 0}, ValueError, "max_examples must be a positive integer, got 0"),
    ({"max_examples": 2.5}, TypeError, "max_examples must be a positive integer, got float 2.5"),
    ({"seed": -1}, ValueError, "seed must be a non-negative integer or None, got -1"),
    ({"backend": 3}, TypeError, "backend must be one of 'reference', 'llvm' or a callable"),
    ({"backend": "cuda"}, ValueError, "unknown backend 'cuda'"),
    ({"gradient": "mine"}, TypeError, "gradient must be a rule"),
])
def test_check_op_arguments_are_validated(kwargs: dict, error: type, words: str) -> None:
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        check_op("relu", **kwargs)


def _xy() -> tuple[opgrad.Var, opgrad.Var, opgrad.Function]:
    x, y = opgrad.var("x", (3,), "float64"), opgrad.var("y", (3,), "float64")
    return x, y, opgrad.function([x, y], ops.sum(x * y))


def test_check_function_names_the_parameter_and_the_expected_and_given_arrays() -> None:
    _, _, fn = _xy()
    with pytest.raises(opgrad.ArgumentError, match=r"expected 2 array\(s\), one per parameter "
                                                   r"\(x: float64\[3\], y: float64\[3\]\), got 1"):
        check_function(fn, [np.zeros(3)])
    with pytest.raises(opgrad.ArgumentError, match=r"parameter 'y' expects shape \(3,\) \(float64\[3\]\), "
                                                   r"got an array of shape \(4,\)"):
        check_function(fn, [np.zeros(3), np.zeros(4)])
    with pytest.raises(opgrad.ArgumentError, match=r"parameter 'x' is float64\[3\] and expects float values, "
                                                   r"got an array of dtype int64"):
        check_function(fn, [np.zeros(3, np.int64), np.zeros(3)])
    with pytest.raises(opgrad.ArgumentError, match="one array per parameter"):
        check_function(fn, np.zeros((2, 3)))
    labels = opgrad.var("labels", (2,), "int32")
    logits = opgrad.var("logits", (2, 4), "float64")
    loss_fn = opgrad.function([logits, labels], ops.softmax_cross_entropy(logits, labels))
    with pytest.raises(opgrad.ArgumentError, match=r"parameter 'labels' is int32\[2\] and expects integer values"):
        check_function(loss_fn, [np.zeros((2, 4)), np.zeros(2)])
    with pytest.raises(opgrad.ArgumentError, match="do not fit in int32"):
        check_function(loss_fn, [np.zeros((2, 4)), np.array([0, 2**40])])
    # float precision does not matter (the check runs in float64); plain int lists fit int params
    assert check_function(fn, [np.ones(3, np.float32), np.ones(3)], seed=0).passed
    assert check_function(loss_fn, [np.zeros((2, 4)), [0, 3]], seed=0).passed


def test_check_function_with_nothing_differentiable_says_so_instead_of_passing() -> None:
    x, _, fn = _xy()
    with pytest.raises(NothingToCheckError, match=r"nothing to check: function has no differentiable parameter.*"
                                                  r"wrt=\[\] selects no parameter"):
        check_function(fn, wrt=[])
    labels = opgrad.var("labels", (3,), "int64")
    with pytest.raises(NothingToCheckError, match="it has no float parameter"):
        check_function(opgrad.function([labels], ops.sum(ops.one_hot(labels, depth=4))), [np.arange(3)])
    with pytest.raises(NothingToCheckError, match="does not depend differentiably on 'x'"):
        check_function(opgrad.function([x], ops.sum(ops.zeros_like(x))))
    with pytest.raises(ValueError, match=r"output is int64\[3\]; only a float output has a gradient"):
        check_function(opgrad.function([labels], labels), [np.arange(3)])


def test_check_function_wrt_accepts_the_functions_own_variables() -> None:
    x, _, fn = _xy()
    assert check_function(fn, wrt=[x], seed=0, max_examples=2).passed
    assert check_function(fn, wrt="y", seed=0, max_examples=2).passed


# ----- variable shapes -----


@pytest.mark.parametrize(("shape", "error", "words"), [
    ((2.5, 3), opgrad.DimensionTypeError, "shape (2.5, 3): dimension 0 is float 2.5; dimensions must be integers"),
    ((3.0,), TypeError, "dimension 0 is float 3.0"),
    ((True, 3), TypeError, "dimension 0 is bool True"),
    ((2, "3"), TypeError, "dimension 1 is str '3'"),
    ((4, -1), ValueError, "shape (4, -1): dimension 1 is -1; dimensions must be >= 0"),
    ("ab", TypeError, "shape must be a sequence of integers such as (2, 3), got str 'ab'"),
    (None, TypeError, "got NoneType None"),
    ((2**62, 4), opgrad.ShapeError, "has 18446744073709551616 elements; a float32 tensor may have at most "
                                    "2305843009213693951 (its size in bytes and its strides must fit in int64)"),
    ((2**63,), ValueError, "has 9223372036854775808 elements"),
    ((2**62, 4, 0), ValueError, "non-zero dimensions multiplying to 18446744073709551616"),
])
def test_var_refuses_bad_dimensions_naming_the_variable(shape: object, error: type, words: str) -> None:
    with pytest.raises(error) as info:
        opgrad.var("x", shape)  # type: ignore[arg-type]
    assert str(info.value).startswith("opgrad.var('x'): ") and words in str(info.value)


def test_var_accepts_python_and_numpy_integers_and_zero_sizes() -> None:
    assert opgrad.var("x", (np.int32(2), np.int64(3), 4)).shape == (2, 3, 4)
    assert opgrad.var("x", np.array([2, 3])).shape == (2, 3)
    assert opgrad.var("x", 5).shape == (5,)  # a single integer is a 1-D shape, as in numpy
    assert opgrad.var("x", (0, 3)).type.size == 0
    assert opgrad.var("x", (2**30, 2**30), "float32").type.size == 2**60  # exact, no int64 wrap-around
    with pytest.raises(TypeError, match=r"opgrad.var\('x'\): unsupported dtype 'float16'"):
        opgrad.var("x", (2,), "float16")


# ----- operator inputs -----


@pytest.mark.parametrize(("value", "given"), [
    ("hello", "got str 'hello'"),
    (None, "got NoneType None"),
    ({"a": 1}, "got dict {'a': 1}"),
    (object(), "got object <object object at"),
    ([[1.0], [2.0, 3.0]], "got list [[1.0], [2.0, 3.0]] (setting an array element"),
])
def test_a_non_numeric_op_input_names_the_op_and_the_input(value: object, given: str) -> None:
    with pytest.raises(opgrad.OpInputTypeError) as info:
        ops.relu(value)
    message = str(info.value)
    assert message.startswith("opgrad.ops.relu: input 'data' must be an opgrad expression or a numeric "
                              "array/scalar, ") and given in message
    assert isinstance(info.value, TypeError) and isinstance(info.value, opgrad.OpCallError)


def test_other_op_input_mistakes_name_the_op_and_the_input() -> None:
    x = opgrad.var("x", (3,))
    with pytest.raises(TypeError, match=r"opgrad.ops.add: input 'rhs' must be .*, got str 'a'"):
        _ = x + "a"
    with pytest.raises(TypeError, match=r"'@': right operand must be .*, got str 'a'"):
        _ = opgrad.var("m", (2, 3)) @ "a"
    with pytest.raises(TypeError, match=r"opgrad.ops.relu: input 'data' has dtype complex128, which opgrad does "
                                        r"not support \(expected one of float32, float64, int32, int64\)"):
        ops.relu(1 + 2j)
    with pytest.raises(TypeError, match=r"opgrad.ops.one_hot: input 'labels' takes integers \(int32 or int64\), "
                                        r"got list \[0.5, 1.0\]"):
        ops.one_hot([0.5, 1.0], depth=3)
    with pytest.raises(TypeError, match=r"got an opgrad\.Function; pass one of its expressions"):
        ops.relu(opgrad.function([x], x))
    with pytest.raises(opgrad.OpCallError, match=r"inputs: float32\[3\], float32\[3\], str 'a'\n.*\n"
                                                 r"  problem: expected 2 input\(s\) \(lhs, rhs\), got 3"):
        ops.add(x, x, "a")
    with pytest.raises(TypeError, match=r"opgrad\.const: value must be a numeric array or scalar, got str 's'"):
        opgrad.const("s")
    # numbers, lists and numpy values still work, with numpy's dtypes
    assert ops.add(x, 2).dtype == "float32" and ops.relu([1.0, 2.0]).shape == (2,)
    assert ops.one_hot(np.array([0, 2], np.int32), depth=3).shape == (2, 3)
