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
