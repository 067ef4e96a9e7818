"""NaN and inf under zero operands: the references of the products agree with IEEE and the kernels.

BLAS may skip zero operands, so a reference built on ``@`` or ``tensordot`` could turn NaN * 0
or inf * 0 into 0 where IEEE arithmetic (and the compiled kernels) give NaN. Each case puts a
NaN and an inf in one operand of a product whose other operand is zero; the output is NaN exactly
where a non-finite element meets the zeros, which an all-finite product of the masks tells.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import opgrad
from opgrad import ops

Build = Callable[[Any, Any], Any]

# (name, build(x, y), shape of x, shape of y)
PRODUCTS: list[tuple[str, Build, tuple[int, ...], tuple[int, ...]]] = [
    ("dense", lambda x, y: ops.dense(x, y), (4, 3), (5, 3)),
    ("matmul", lambda x, y: ops.matmul(x, y), (4, 3), (3, 5)),
    ("batch_matmul", lambda x, y: ops.batch_matmul(x, y), (2, 4, 3), (2, 3, 5)),
    ("batch_matmul broadcast", lambda x, y: ops.batch_matmul(x, y), (1, 4, 3), (3, 3, 2)),
    ("conv2d", lambda x, y: ops.conv2d(x, y, strides=2), (2, 3, 5, 5), (4, 3, 3, 3)),
    ("conv2d groups", lambda x, y: ops.conv2d(x, y, groups=2), (1, 4, 4, 4), (2, 2, 2, 2)),
    ("conv2d_backward_input",
     lambda x, y: ops.conv2d_backward_input(x, y, input_size=(5, 5), strides=2), (2, 4, 2, 2), (4, 3, 3, 3)),
    ("conv2d_backward_weight",
     lambda x, y: ops.conv2d_backward_weight(x, y, kernel_size=(3, 3)), (2, 4, 3, 3), (2, 3, 5, 5)),
    ("conv2d_transpose", lambda x, y: ops.conv2d_transpose(x, y, strides=2), (1, 3, 3, 3), (3, 2, 2, 2)),
    # A contracted length of 1 with a single row or column: where BLAS (OpenBLAS's ger/axpy paths)
    # skips a zero operand and drops NaN * 0.
    ("dense K=1, one row", lambda x, y: ops.dense(x, y), (1, 1), (5, 1)),
    ("dense K=1, one unit", lambda x, y: ops.dense(x, y), (4, 1), (1, 1)),
    ("matmul K=1, one row", lambda x, y: ops.matmul(x, y), (1, 1), (1, 5)),
    ("matmul K=1, one column", lambda x, y: ops.matmul(x, y), (4, 1), (1, 1)),
    ("batch_matmul K=1", lambda x, y: ops.batch_matmul(x, y), (2, 1, 1), (2, 1, 4)),
    ("conv2d 1x1, one channel", lambda x, y: ops.conv2d(x, y), (1, 1, 3, 3), (1, 1, 1, 1)),
    ("conv2d_backward_input one channel",
     lambda x, y: ops.conv2d_backward_input(x, y, input_size=(3, 3)), (1, 1, 3, 3), (1, 1, 1, 1)),
    ("conv2d_backward_weight one position",
     lambda x, y: ops.conv2d_backward_weight(x, y, kernel_size=(2, 3)), (1, 1, 1, 1), (1, 2, 2, 3)),
]


def _run(build: Build, arrays: list[np.ndarray], compiled: bool) -> np.ndarray:
    params = [opgrad.var(f"p{i}", a.shape, "float64") for i, a in enumerate(arrays)]
    fn = opgrad.function(params, build(*params))
    with np.errstate(all="ignore"):
        return np.asarray(opgrad.compile(fn)(*arrays) if compiled else opgrad.evaluate(fn, *arrays))


@pytest.mark.parametrize("operand", [0, 1], ids=["nonfinite x, zero y", "zero x, nonfinite y"])
@pytest.mark.parametrize(("name", "build", "x_shape", "y_shape"), PRODUCTS, ids=[p[0] for p in PRODUCTS])
def test_nan_and_inf_times_zero_give_nan_on_both_backends(name: str, build: Build, x_shape: tuple[int, ...],
                                                          y_shape: tuple[int, ...], operand: int) -> None:
    rng = np.random.default_rng(5)
    shapes = [x_shape, y_shape]
    special = rng.standard_normal(shapes[operand])
    special.flat[-1] = np.inf
    special.flat[0] = np.nan  # a one-element operand holds the NaN alone
    arrays = [np.zeros(shapes[1 - operand]), special]
    arrays = arrays if operand == 1 else arrays[::-1]

    masks = [np.ones(s) for s in shapes]
    masks[operand] = (~np.isfinite(special)).astype(np.float64)
    expected_nan = _run(build, masks, compiled=False) > 0  # finite: BLAS is exact here
    assert expected_nan.any(), "the case must reach a NaN output"

    for compiled in (False, True):
        got = _run(build, arrays, compiled)
        where = "compiled" if compiled else "reference"
        np.testing.assert_array_equal(np.isnan(got), expected_nan, err_msg=f"{name}: NaN positions ({where})")
        assert np.all(got[~expected_nan] == 0.0), f"{name}: zeros elsewhere ({where})"


# (input shape, weight shape, padding): the Winograd backward-data forms, adjoint and correlation.
WINOGRAD_BACKWARD_DATA = [((2, 8, 6, 6), (8, 8, 3, 3), 1), ((2, 8, 6, 6), (8, 8, 3, 3), 0),
                          ((2, 32, 26, 26), (64, 32, 3, 3), 0), ((2, 16, 12, 12), (16, 16, 3, 3), 1)]


@pytest.mark.parametrize("x_shape, w_shape, pad", WINOGRAD_BACKWARD_DATA)
def test_an_infinite_weight_meets_no_padding_in_the_data_gradient(x_shape: tuple[int, ...],
                                                                  w_shape: tuple[int, ...], pad: int) -> None:
    # The data gradient sums dY's real positions only: an infinite weight gives infinities, and
    # NaN nowhere, where a correlation over dY padded with zeros would add 0 * inf.
    x, w = opgrad.var("x", x_shape), opgrad.var("w", w_shape)
    y = ops.conv2d(x, w, padding=pad)
    dy = opgrad.var("dy", y.shape)
    fn = opgrad.grad(opgrad.function([x, w, dy], ops.sum(ops.multiply(y, dy))), wrt=["x"], with_value=False)
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(v.shape).astype(np.float32) for v in (x, w, dy)]
    args[1][0, 0, 0, 0] = np.inf
    with np.errstate(all="ignore"):
        want = opgrad.evaluate(fn, *args)
    got = opgrad.compile(fn)(*args)
    assert np.isinf(want).any() and not np.isnan(want).any()
    for test in (np.isnan, np.isposinf, np.isneginf):
        np.testing.assert_array_equal(test(got), test(want))
