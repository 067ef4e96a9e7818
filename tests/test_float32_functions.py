"""The compiled float32 exp, tanh and erfc (generated instructions, not the C library's calls)
against float64 truth over their whole range: ulps, the ends of the range and special values."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from optional import require

import opgrad
from opgrad import ops

special = require("scipy.special", "erfc's truth is scipy's")


def compiled(op: Callable[..., opgrad.Expr], values: np.ndarray) -> np.ndarray:
    x = opgrad.var("x", values.shape, "float32")
    return np.asarray(opgrad.compile(opgrad.function([x], op(x)))(values))


def max_ulps(got: np.ndarray, truth: np.ndarray) -> float:
    """The largest error in units of the float32 spacing at the truth, over normal results."""
    with np.errstate(over="ignore"):
        rounded = truth.astype(np.float32)
    normal = np.isfinite(rounded) & (np.abs(rounded) >= np.finfo(np.float32).tiny)
    spacing = np.spacing(np.abs(rounded[normal])).astype(np.float64)
    return float((np.abs(got[normal].astype(np.float64) - truth[normal]) / spacing).max())


GRID = np.random.default_rng(0)


@pytest.mark.parametrize(("name", "op", "truth", "low", "high", "ulps"), [
    ("exp", ops.exp, np.exp, -104.0, 88.72, 1.0),
    ("tanh", ops.tanh, np.tanh, -10.0, 10.0, 5.0),
    ("erfc", ops.erfc, special.erfc, -10.0, 10.0, 7.0),
])
def test_within_a_few_ulps_over_the_whole_range(name: str, op: Callable[..., opgrad.Expr],
                                                truth: Callable[[np.ndarray], np.ndarray], low: float, high: float,
                                                ulps: float) -> None:
    x = np.concatenate([np.linspace(low, high, 200001), GRID.uniform(-1, 1, 50000),
                        GRID.uniform(low, high, 50000)]).astype(np.float32)
    error = max_ulps(compiled(op, x), truth(x.astype(np.float64)))
    assert error <= ulps, f"{name}: {error:.2f} ulps"


def test_range_ends_and_special_values() -> None:
    exp = compiled(ops.exp, np.array([np.inf, -np.inf, np.nan, 88.73, -104.5, -95.0, 0.0], np.float32))
    np.testing.assert_array_equal(exp[[0, 1, 3, 4, 6]], [np.inf, 0.0, np.inf, 0.0, 1.0])
    assert np.isnan(exp[2]) and exp[5] == pytest.approx(np.exp(-95.0), rel=1e-2)  # a subnormal, not 0
    tanh = compiled(ops.tanh, np.array([np.inf, -np.inf, np.nan, -0.0, 1e-30], np.float32))
    np.testing.assert_array_equal(tanh[[0, 1, 4]], np.array([1.0, -1.0, 1e-30], np.float32))
    assert np.isnan(tanh[2]) and tanh[3] == 0.0 and np.signbit(tanh[3])
    erfc = compiled(ops.erfc, np.array([np.inf, -np.inf, np.nan, 0.0, 12.0], np.float32))
    np.testing.assert_array_equal(erfc[[0, 1, 3, 4]], [0.0, 2.0, 1.0, 0.0])
    assert np.isnan(erfc[2])
