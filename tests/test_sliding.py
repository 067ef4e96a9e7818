"""The sliding-window conv2d passes (few input taps: an image's first layer) against the reference.

Each case compiles a convolution with a bias and relu (the forward pass's epilogue) and its weight
gradient, checks that the plan runs both as a sliding window, and compares with the numpy
reference; the shapes cover padding on any side, rows exactly one vector wide and one lane more
(the overlapping last vector), non-square kernels and partial blocks of output channels.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import opgrad
from opgrad import ops
from opgrad.compiler.conv import Conv2dGeometry
from opgrad.compiler.sliding import sliding_applies
from opgrad.compiler.target import host_target

ROOT = Path(__file__).resolve().parents[1]
VL = host_target().vector_width(4)

# (x shape, w shape, padding)
CASES = [
    ((6, 1, 28, 28), (32, 1, 3, 3), 0),
    ((3, 3, 17, VL + 3), (5, 3, 3, 3), 1),
    ((2, 2, 9, VL + 2), (7, 2, 3, 3), (1, 0)),
    ((3, 1, 12, VL + 1), (4, 1, 5, 5), 2),
    ((2, 3, 10, VL), (13, 3, 1, 1), 0),
    ((1, 1, 8, VL + 2), (3, 1, 3, 3), (0, 1, 2, 0)),
    ((2, 2, 7, 2 * VL + 5), (9, 2, 2, 3), (1, 1, 0, 2)),
]


def _conv_step(xs: tuple[int, ...], ws: tuple[int, ...], pad: object, dtype: str) -> opgrad.Function:
    x, w, b = opgrad.var("x", xs, dtype), opgrad.var("w", ws, dtype), opgrad.var("b", (ws[0],), dtype)
    y = ops.relu(ops.bias_add(ops.conv2d(x, w, padding=pad), b, axis=1))
    (d_w,) = opgrad.gradients(ops.sum(ops.multiply(y, y)), [w])
    return opgrad.function([x, w, b], [y, d_w])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(("xs", "ws", "pad"), CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_sliding_window_passes_match_the_reference(xs: tuple[int, ...], ws: tuple[int, ...], pad: object,
                                                   dtype: str) -> None:
    fn = _conv_step(xs, ws, pad, dtype)
    compiled = opgrad.compile(fn, step_entries=True)
    sliding = [cost.label for cost in compiled.plan.step_costs if "sliding window" in cost.detail]
    assert len(sliding) == 2, [cost.detail for cost in compiled.plan.step_costs]  # forward and weight gradient
    rng = np.random.default_rng(sum(xs) + sum(ws))
    args = [rng.standard_normal(xs).astype(dtype), rng.standard_normal(ws).astype(dtype),
            rng.standard_normal(ws[0]).astype(dtype)]
    tol = 2e-5 if dtype == "float32" else 1e-12
    for got, want in zip(compiled(*args), opgrad.evaluate(fn, *args), strict=True):
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * float(np.abs(want).max()))


def test_a_repeated_lane_of_the_last_vector_counts_once_with_infinities() -> None:
    """The last vector of a row overlaps the one before; its repeated lanes count zero in both
    factors, so an infinite input there gives the reference's infinity, not inf * 0 = NaN."""
    xs, ws = (2, 1, 6, VL + 3), (3, 1, 3, 3)
    fn = _conv_step(xs, ws, 0, "float64")
    rng = np.random.default_rng(5)
    x = rng.uniform(0.5, 1.5, xs)
    x[1, 0, 2, VL - 1] = np.inf  # a column the last vector repeats
    args = [x, rng.uniform(0.5, 1.5, ws), rng.uniform(0.5, 1.5, ws[0])]
    with np.errstate(all="ignore"):
        got, want = opgrad.compile(fn)(*args), opgrad.evaluate(fn, *args)
    for g, r in zip(got, want, strict=True):
        for test in (np.isnan, np.isposinf, np.isneginf):
            np.testing.assert_array_equal(test(g), test(r))
        assert np.isinf(r).any()


def _first_layer_step(xs: tuple[int, ...], ws: tuple[int, ...], pad: object, dtype: str,
                      data_gradient: bool = False) -> opgrad.Function:
    """A first layer (conv, bias, relu) under a 1x1 conv and a loss, and the gradients of its
    weight and bias (and of its input with ``data_gradient``, which gives the relu's gradient a
    second reader)."""
    x, w, b = opgrad.var("x", xs, dtype), opgrad.var("w", ws, dtype), opgrad.var("b", (ws[0],), dtype)
    y = ops.relu(ops.bias_add(ops.conv2d(x, w, padding=pad), b, axis=1))
    w2 = opgrad.var("w2", (3, ws[0], 1, 1), dtype)
    z = ops.conv2d(y, w2)
    r = opgrad.var("r", z.shape, dtype)
    wrt = [w, b, x] if data_gradient else [w, b]
    return opgrad.function([x, w, b, w2, r], opgrad.gradients(ops.sum(ops.multiply(z, r)), wrt))


# Batches of at least 8 images, so that the bias gradient's sum joins the relu gradient's pass.
PROLOGUE_CASES = [
    ((9, 1, 14, VL + 3), (6, 1, 3, 3), 1),
    ((8, 3, 9, VL + 2), (5, 3, 3, 3), (1, 0)),  # rows exactly one vector
    ((8, 1, 8, 2 * VL + 5), (4, 1, 5, 5), (0, 1, 2, 0)),
    ((8, 3, 7, VL + 4), (6, 3, 5, 5), 2),  # 75 taps: several passes over each dY row
]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(("xs", "ws", "pad"), PROLOGUE_CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in PROLOGUE_CASES])
def test_the_relu_gradient_and_bias_sum_run_inside_the_weight_gradient(
        xs: tuple[int, ...], ws: tuple[int, ...], pad: object, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The relu's gradient is computed as the weight gradient reads it, with the per-image channel
    sums its bias gradient adds: no pass of its own. The weight gradient has the same bits as
    with the separate pass (the same values in the same order), the bias gradient the same sums
    in another order, and both match the reference."""
    from opgrad.compiler.builder import KernelBuilder

    fn = _first_layer_step(xs, ws, pad, dtype)
    rng = np.random.default_rng(sum(xs) + sum(ws))
    args = [rng.standard_normal(v.shape).astype(dtype) for v in fn.params]
    fused = opgrad.compile(fn, plan_cache=False)
    labels = [cost.label for cost in fused.plan.step_costs]
    assert any(label.startswith("conv2d_backward_weight+") and "sum" in label for label in labels), labels
    monkeypatch.setattr(KernelBuilder, "fuse_prologues", lambda self, internal: 0)
    apart = opgrad.compile(fn, plan_cache=False)
    assert len(apart.plan.step_costs) == len(labels) + 1
    (d_w, d_b), (sep_w, sep_b) = fused(*args), apart(*args)
    np.testing.assert_array_equal(d_w, sep_w)
    tol = 2e-5 if dtype == "float32" else 1e-12
    np.testing.assert_allclose(d_b, sep_b, rtol=tol, atol=tol * float(np.abs(sep_b).max()))
    for got, want in zip((d_w, d_b), opgrad.evaluate(fn, *args), strict=True):
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * float(np.abs(want).max()))


def test_a_relu_gradient_with_another_reader_keeps_its_pass() -> None:
    """Where the input's gradient reads the relu's gradient too, the product is written once and
    read by both passes, as before."""
    xs, ws = (8, 2, 9, VL + 2), (5, 2, 3, 3)
    fn = _first_layer_step(xs, ws, 1, "float64", data_gradient=True)
    compiled = opgrad.compile(fn)
    assert not any(cost.label.startswith("conv2d_backward_weight+") for cost in compiled.plan.step_costs)
    rng = np.random.default_rng(3)
    args = [rng.standard_normal(v.shape) for v in fn.params]
    for got, want in zip(compiled(*args), opgrad.evaluate(fn, *args), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("xs", "ws", "stride", "dilation", "groups", "pass_"), [
    ((1, 1, 20, 20), (4, 1, 3, 3), 2, 1, 1, "forward"),
    ((1, 1, 20, 20), (4, 1, 3, 3), 1, 2, 1, "forward"),
    ((1, 2, 20, 20), (4, 1, 3, 3), 1, 1, 2, "forward"),
    ((1, 1, 20, VL + 1), (4, 1, 3, 3), 1, 1, 1, "forward"),
    ((1, 1, 20, 20), (4, 1, 3, 3), 1, 1, 1, "backward_data"),
    ((1, 4, 20, 20), (4, 4, 5, 5), 1, 1, 1, "forward"),  # 100 taps
])
def test_the_sliding_window_declines_what_it_does_not_cover(xs: tuple[int, ...], ws: tuple[int, ...], stride: int,
                                                            dilation: int, groups: int, pass_: str) -> None:
    g = Conv2dGeometry.make(xs, ws, stride, 0, dilation, "float32", groups)
    assert not sliding_applies(g, pass_)


_THREADS_SCRIPT = """
import hashlib, numpy as np, opgrad
from opgrad import ops
x, w = opgrad.var("x", (9, 3, 13, 21)), opgrad.var("w", (10, 3, 3, 3))
y = ops.relu(ops.conv2d(x, w, padding=1))
(d_w,) = opgrad.gradients(ops.sum(ops.multiply(y, y)), [w])
rng = np.random.default_rng(1)
out = opgrad.compile(opgrad.function([x, w], [y, d_w]))(rng.standard_normal((9, 3, 13, 21)).astype(np.float32),
                                                        rng.standard_normal((10, 3, 3, 3)).astype(np.float32))
print(hashlib.sha256(b"".join(a.tobytes() for a in out)).hexdigest())
"""


def test_sliding_window_results_do_not_depend_on_the_thread_count(tmp_path: Path) -> None:
    digests = set()
    for threads in (1, 2, 3):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OPGRAD_NUM_THREADS": str(threads),
               "OPGRAD_CACHE_DIR": str(tmp_path)}
        res = subprocess.run([sys.executable, "-c", _THREADS_SCRIPT], env=env, capture_output=True, text=True,
                             timeout=300)
        assert res.returncode == 0, res.stderr
        digests.add(res.stdout.strip())
    assert len(digests) == 1
