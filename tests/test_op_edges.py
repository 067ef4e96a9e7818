"""Operator semantics at the edges numpy and PyTorch define: NaN through max/min reductions,
integer-only shapes and axes, zero-size tensors, scalars, on both backends."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import opgrad
from opgrad import ops
from opgrad.errors import OpCallError

BACKENDS = ("reference", "llvm")


def _run(fn: opgrad.Function, backend: str, *arrays: np.ndarray) -> Any:
    return opgrad.evaluate(fn, *arrays) if backend == "reference" else opgrad.compile(fn)(*arrays)


def _gradient(build: Callable[[Any], Any], shape: tuple[int, ...], backend: str, data: np.ndarray) -> np.ndarray:
    x = opgrad.var("x", shape, "float64")
    fn = opgrad.grad(opgrad.function([x], ops.sum(build(x))), with_value=False)
    return np.asarray(_run(fn, backend, data))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduce", [ops.max, ops.min])
def test_max_and_min_gradients_are_nan_over_a_slice_holding_nan(backend: str, reduce: Any) -> None:
    data = np.array([[np.nan, 1.0, -3.0, 2.0], [1.0, 4.0, 4.0, -np.inf]])
    grad = _gradient(lambda x: reduce(x, axis=1), data.shape, backend, data)
    # torch.amax/amin: NaN over the whole slice with the NaN; ties share the gradient elsewhere.
    assert np.isnan(grad[0]).all()
    expected = [0.0, 0.5, 0.5, 0.0] if reduce is ops.max else [0.0, 0.0, 0.0, 1.0]
    np.testing.assert_array_equal(grad[1], expected)


@pytest.mark.parametrize("call", [
    lambda x: ops.zeros(shape=(2.5, 3)),
    lambda x: ops.sum(x, axis=(1.9,)),
    lambda x: ops.sum(x, axis=[True]),
    lambda x: ops.broadcast_to(x, shape=(5.5, 2, 3)),
    lambda x: ops.reshape(x, shape=(2.0, 3)),
    lambda x: ops.transpose(x, axes=(0.0, 1.0)),
    lambda x: ops.strided_slice(x, begin=[0.5], end=[1.9]),
    lambda x: ops.pad(x, pad_width=1.0),
    lambda x: ops.pad(x, pad_width=((0, 0), (True, 1))),
    lambda x: ops.take(x, opgrad.var("i", (2,), "int64"), axis=1.0),
    lambda x: ops.take(x, opgrad.var("i", (2,), "int64"), axis=True),
    lambda x: ops.space_to_depth(ops.reshape(x, shape=(1, 1, 2, 3)), block_size=2.0),
])
def test_float_and_bool_shapes_and_axes_are_refused(call: Callable[[Any], Any]) -> None:
    x = opgrad.var("x", (2, 3), "float64")
    with pytest.raises(OpCallError, match=r"expected|must be ints"):  # numpy raises TypeError, not truncating
        call(x)


def test_numpy_integer_axes_are_taken() -> None:
    x = opgrad.var("x", (2, 3, 4), "float64")
    for reduce in (ops.sum, ops.mean, ops.max, ops.min, ops.prod, ops.logsumexp):
        assert reduce(x, axis=np.int64(1)).shape == (2, 4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_size_tensors_give_empty_results(backend: str) -> None:
    empty = np.zeros((0, 3, 2))
    x = opgrad.var("x", empty.shape, "float64")
    assert np.asarray(_run(opgrad.function([x], ops.flatten(x)), backend, empty)).shape == (0, 6)
    for batch in ((0, 2, 4, 4), (1, 0, 4, 4)):
        pooled = _gradient(lambda v: ops.max_pool2d(v, pool_size=2), batch, backend, np.zeros(batch))
        assert pooled.shape == batch
        assert _gradient(ops.global_max_pool2d, batch, backend, np.zeros(batch)).shape == batch
    padded = _gradient(lambda v: ops.pad(v, pad_width=((1, 1), (0, 0))), (2, 0), backend, np.zeros((2, 0)))
    assert padded.shape == (2, 0)
    edged = _gradient(lambda v: ops.pad(v, pad_width=((0, 0), (1, 1)), mode="edge"), (0, 2), backend,
                      np.zeros((0, 2)))
    assert edged.shape == (0, 2)
    assert _gradient(lambda v: ops.mean(v, axis=1), (0, 3), backend, np.zeros((0, 3))).shape == (0, 3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_conv_gradients_with_no_output_channels_are_zero(backend: str) -> None:
    x, w = opgrad.var("x", (1, 2, 3, 3), "float64"), opgrad.var("w", (0, 2, 2, 2), "float64")
    fn = opgrad.grad(opgrad.function([x, w], ops.sum(ops.conv2d(x, w))), wrt=["x", "w"], with_value=False)
    dx, dw = _run(fn, backend, np.ones((1, 2, 3, 3)), np.zeros((0, 2, 2, 2)))
    np.testing.assert_array_equal(dx, np.zeros((1, 2, 3, 3)))
    assert dw.shape == (0, 2, 2, 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_a_scalar_returns_it(backend: str) -> None:
    x = opgrad.var("x", (), "float64")
    y = ops.pad(x, pad_width=1)
    assert y.shape == np.pad(np.float64(2.0), 1).shape == ()
    assert float(_run(opgrad.function([x], y), backend, np.float64(2.0))) == 2.0
    assert float(_gradient(lambda v: ops.pad(v, pad_width=1), (), backend, np.float64(2.0))) == 1.0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduce", [ops.max, ops.min, ops.logsumexp])
def test_reducing_over_no_axes_is_the_identity_and_so_is_its_gradient(backend: str, reduce: Any) -> None:
    # numpy's axis=() reduces nothing; the tie mask (NaN == NaN is false) and exp(inf - inf) gave NaN.
    data = np.array([1.0, np.nan, np.inf, -np.inf])
    x = opgrad.var("x", data.shape, "float64")
    np.testing.assert_array_equal(_run(opgrad.function([x], reduce(x, axis=())), backend, data), data)
    np.testing.assert_array_equal(_gradient(lambda v: reduce(v, axis=()), data.shape, backend, data), np.ones(4))


@pytest.mark.parametrize("backend", BACKENDS)
def test_float_attributes_beyond_float32_are_infinities_as_numpy_casts_them(backend: str) -> None:
    x = opgrad.var("x", (3,), "float32")
    data = np.array([1.0, -1.0, 2e38], np.float32)
    outputs = [ops.full(shape=(2,), value=1e39, dtype="float32"), ops.pad(x, pad_width=1, value=-1e39),
               ops.clip(x, lo=-1e39, hi=1e39), ops.leaky_relu(x, alpha=1e39)]
    with np.errstate(over="ignore"):  # the reference's numpy casts warn as numpy's own would
        got = _run(opgrad.function([x], outputs), backend, data)
        expected = [np.full(2, 1e39, np.float32), np.pad(data, 1, constant_values=np.float32(-1e39)),
                    data, np.where(data > 0, data, data * np.float32(1e39))]
    for out, want in zip(got, expected, strict=True):
        np.testing.assert_array_equal(out, want)


def test_a_constant_that_would_overflow_the_graphs_float_type_is_refused() -> None:
    x = opgrad.var("x", (2,), "float32")
    with pytest.raises(OpCallError, match=r"opgrad.ops.add: input 'rhs': the constant .* takes the dtype float32 "
                                          r"of the other inputs, whose range it leaves \(\|value\| up to 1e\+300"):
        ops.add(x, np.array([1e300, 0.1]))
    assert ops.add(x, np.array([3e38, 0.1])).dtype == "float32"  # narrowed where it fits, as before


@pytest.mark.parametrize("outputs", ["input", "repeated", "constant", "view"])
def test_reference_outputs_are_arrays_of_their_own(outputs: str) -> None:
    # As the compiled backend returns: writing into an output changes neither an argument, a
    # constant of the graph nor another output.
    x = opgrad.var("x", (2, 3), "float32")
    table = np.arange(6, dtype=np.float32).reshape(2, 3)
    relu = ops.relu(x)
    built = {"input": [x, relu], "repeated": [relu, relu],
             "constant": [opgrad.const(table), x], "view": [ops.reshape(x, shape=(6,)), x]}[outputs]
    fn = opgrad.function([x], built)
    data = np.ones((2, 3), np.float32)
    first, second = opgrad.evaluate(fn, data)
    first[...] = 7.0
    np.testing.assert_array_equal(data, np.ones((2, 3)))
    np.testing.assert_array_equal(table, np.arange(6).reshape(2, 3))
    assert not np.shares_memory(second, first)
    again = opgrad.evaluate(fn, data)[0]
    np.testing.assert_array_equal(again, table if outputs == "constant" else np.ones(first.shape))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(("pool", "shape"), [((2, 2), (7, 37)), ((3, 3), (12, 12)), ((2, 3), (9, 20)),
                                             ((1, 2), (5, 33)), ((4, 1), (9, 4))])
def test_max_pool_gradient_where_windows_tile_the_input_goes_to_each_windows_first_maximum(
        pool: tuple[int, int], shape: tuple[int, int], dtype: str) -> None:
    # The compiled kernel compares a row's windows lane by lane: ties (small integers), NaN (the
    # first wins), windows of -inf only (the first element), rows and columns past the last window
    # (no gradient) and a row's last, partial group of windows are where it could part from the
    # reference's np.argmax.
    rng = np.random.default_rng(sum(pool) + shape[1])
    (kh, kw), (h, w) = pool, shape
    g = opgrad.var("g", (2, 3, h // kh, w // kw), dtype)
    x = opgrad.var("x", (2, 3, h, w), dtype)
    fn = opgrad.function([g, x], ops.max_pool2d_backward(g, x, pool_size=pool, strides=pool, padding=(0, 0)))
    compiled = opgrad.compile(fn)
    grads = rng.standard_normal(g.shape).astype(dtype)
    for case in ("ties", "nan and -inf", "only -inf and nan"):
        data = rng.integers(-2, 3, x.shape).astype(dtype)
        if case != "ties":
            data[rng.random(x.shape) < 0.15] = -np.inf
            data[rng.random(x.shape) < 0.1] = np.nan
        if case == "only -inf and nan":
            data[np.isfinite(data)] = -np.inf
        np.testing.assert_array_equal(compiled(grads, data), opgrad.evaluate(fn, grads, data), err_msg=case)
