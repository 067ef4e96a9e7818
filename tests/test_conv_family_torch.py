"""conv2d with groups and asymmetric padding, conv2d_transpose, and max/avg pooling with ceil_mode
and count_include_pad against PyTorch (forward and float64 gradients), and their compiled kernels
against the numpy reference in float32 and float64, NaN and inf included.

Asymmetric padding is stored as (top, left, bottom, right) (ONNX's pads order); PyTorch has no
asymmetric conv padding, so the comparison pads explicitly with F.pad(x, (left, right, top, bottom)).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
from optional import require

import opgrad
from opgrad import ops
from opgrad.errors import OpgradError

torch = require("torch", "the conv and pooling ops are compared with PyTorch's F.conv2d, F.conv_transpose2d and pools")
F = torch.nn.functional

#: Compiled vs reference, relative to the output's scale (docs/compiler.md): one op, and gradient graphs.
OP_TOL = {"float64": 1e-10, "float32": 2e-5}
GRAPH_TOL = {"float64": 1e-10, "float32": 1e-4}


def _close(got: np.ndarray, want: np.ndarray, tol: float, what: str) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    scale = max(1.0, float(np.max(np.abs(want)))) if want.size else 1.0
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * scale, err_msg=what)


def _functions(build: Callable[..., opgrad.Expr], arrays: Sequence[np.ndarray],
               dtype: str) -> tuple[opgrad.Function, opgrad.Function, list[np.ndarray]]:
    """The forward and the VJP function (value of <out, c>, then the gradient of every input) in ``dtype``."""
    cast = [a.astype(dtype) for a in arrays]
    params = [opgrad.var(f"in{i}", a.shape, dtype) for i, a in enumerate(cast)]
    out = build(*params)
    c = opgrad.var("cotangent", out.shape, dtype)
    vjp = opgrad.grad(opgrad.function([*params, c], ops.sum(ops.multiply(out, c))), wrt=params)
    return opgrad.function(params, out), vjp, cast


def against_torch(build: Callable[..., opgrad.Expr], torch_fn: Callable[..., Any], arrays: Sequence[np.ndarray],
                  seed: int = 0) -> None:
    """Forward and gradients (float64, reference backend) equal PyTorch's; compiled equals the reference."""
    forward, vjp, cast = _functions(build, arrays, "float64")
    out = np.asarray(opgrad.evaluate(forward, *cast))
    tensors = [torch.tensor(a, requires_grad=True) for a in cast]
    y = torch_fn(*tensors)
    _close(out, y.detach().numpy(), 1e-10, "forward vs torch")
    c = np.random.default_rng(seed).standard_normal(out.shape) + 0.3
    y.backward(torch.tensor(c))
    for i, g in enumerate(opgrad.evaluate(vjp, *cast, c)[1:]):
        _close(g, tensors[i].grad.numpy(), 1e-9, f"gradient of input {i} vs torch")
    for dtype in ("float64", "float32"):
        forward, vjp, cast = _functions(build, arrays, dtype)
        _close(opgrad.compile(forward)(*cast), opgrad.evaluate(forward, *cast), OP_TOL[dtype], f"compiled {dtype}")
        cd = c.astype(dtype)
        got, want = opgrad.compile(vjp)(*cast, cd), opgrad.evaluate(vjp, *cast, cd)
        for k, (g, w) in enumerate(zip(got, want, strict=True)):
            _close(g, w, GRAPH_TOL[dtype], f"compiled gradient output {k}, {dtype}")


def _rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + sum(shape)).uniform(-2.0, 2.0, shape)


def _torch_pad(x: Any, padding: tuple[int, int, int, int]) -> Any:
    top, left, bottom, right = padding
    return F.pad(x, (left, right, top, bottom))


# ----- conv2d: groups and (top, left, bottom, right) padding -----

CONV_CASES = [
    # data, weight (O, C/groups, KH, KW), strides, padding, dilation, groups
    ((2, 3, 6, 5), (4, 3, 3, 2), (1, 1), (1, 0, 2, 1), (1, 1), 1),
    ((2, 4, 7, 6), (6, 2, 3, 3), (2, 1), (0, 2, 1, 0), (1, 2), 2),
    ((1, 6, 5, 7), (3, 2, 2, 3), (1, 2), (2, 1, 0, 2), (2, 1), 3),
    ((2, 12, 9, 8), (12, 1, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 12),   # depthwise: direct loops
    ((1, 10, 7, 9), (20, 1, 3, 2), (2, 3), (0, 1, 2, 0), (2, 1), 10),   # channel multiplier 2
    ((2, 9, 5, 5), (18, 3, 2, 2), (1, 1), (0, 0, 0, 0), (1, 1), 3),    # unpadded groups
    ((1, 18, 6, 6), (9, 2, 3, 3), (2, 2), (1, 0, 0, 1), (1, 1), 9),    # 9 groups of 2 channels
]


@pytest.mark.parametrize("xs, ws, strides, padding, dilation, groups", CONV_CASES)
def test_conv2d_groups_and_asymmetric_padding_match_torch(xs, ws, strides, padding, dilation, groups) -> None:
    against_torch(
        lambda x, w: ops.conv2d(x, w, strides=strides, padding=padding, dilation=dilation, groups=groups),
        lambda x, w: F.conv2d(_torch_pad(x, padding), w, stride=strides, dilation=dilation, groups=groups),
        [_rand(*xs), _rand(*ws, seed=1)],
    )


def test_conv2d_padding_order_is_onnx_pads() -> None:
    """(top, left, bottom, right) is ONNX's (x1_begin, x2_begin, x1_end, x2_end); (ph, pw) is symmetric."""
    x, w = opgrad.var("x", (1, 1, 4, 4), "float64"), opgrad.var("w", (1, 1, 1, 1), "float64")
    assert ops.conv2d(x, w, padding=(1, 2, 3, 4)).shape == (1, 1, 4 + 1 + 3, 4 + 2 + 4)
    assert ops.conv2d(x, w, padding=(1, 2)).attrs["padding"] == (1, 2, 1, 2)  # type: ignore[attr-defined]
    assert ops.conv2d(x, w, padding=3).attrs["padding"] == (3, 3, 3, 3)  # type: ignore[attr-defined]
    ones = np.ones((1, 1, 4, 4))
    out = opgrad.evaluate(opgrad.function([x, w], ops.conv2d(x, w, padding=(1, 2, 3, 4))), ones, np.ones((1, 1, 1, 1)))
    assert out[0, 0, 1:5, 2:6].sum() == 16 and out.sum() == 16


def test_conv2d_second_order_with_groups() -> None:
    """The backward ops carry groups and padding into their own gradients (gradient of a gradient)."""
    x = opgrad.var("x", (1, 4, 5, 5), "float64")
    w = opgrad.var("w", (6, 2, 3, 3), "float64")
    loss = ops.sum(ops.tanh(ops.conv2d(x, w, padding=(1, 0, 0, 2), groups=2, strides=(2, 1))))
    dx = opgrad.gradients(loss, [x])[0]
    g2 = opgrad.grad(opgrad.function([x, w], ops.sum(ops.multiply(dx, dx))), wrt=["x", "w"])
    xv, wv = _rand(1, 4, 5, 5), _rand(6, 2, 3, 3, seed=3)
    tx, tw = torch.tensor(xv, requires_grad=True), torch.tensor(wv, requires_grad=True)
    ty = torch.tanh(F.conv2d(_torch_pad(tx, (1, 0, 0, 2)), tw, stride=(2, 1), groups=2)).sum()
    (tdx,) = torch.autograd.grad(ty, tx, create_graph=True)
    (tdx * tdx).sum().backward()
    _, gx, gw = opgrad.evaluate(g2, xv, wv)
    _close(gx, tx.grad.numpy(), 1e-9, "second-order d_x")
    _close(gw, tw.grad.numpy(), 1e-9, "second-order d_w")


# ----- conv2d_transpose -----

TRANSPOSE_CASES = [
    # data, weight (C_in, C_out/groups, KH, KW), strides, padding, output_padding, dilation, groups
    ((2, 3, 4, 5), (3, 2, 3, 3), (2, 2), (1, 1), (1, 0), (1, 1), 1),
    ((2, 4, 5, 4), (4, 3, 3, 2), (2, 3), (1, 0), (1, 2), (1, 1), 2),
    ((1, 3, 5, 4), (3, 2, 3, 3), (3, 2), (0, 2), (2, 1), (2, 1), 3),
    ((2, 12, 4, 5), (12, 1, 3, 3), (2, 1), (1, 1), (1, 0), (1, 2), 12),  # depthwise: direct loops
    ((1, 2, 3, 3), (2, 5, 2, 2), (1, 1), (0, 0), (0, 0), (1, 1), 1),
]


@pytest.mark.parametrize("xs, ws, strides, padding, output_padding, dilation, groups", TRANSPOSE_CASES)
def test_conv2d_transpose_matches_torch(xs, ws, strides, padding, output_padding, dilation, groups) -> None:
    attrs = {"stride": strides, "padding": padding, "output_padding": output_padding, "dilation": dilation,
             "groups": groups}
    against_torch(
        lambda x, w: ops.conv2d_transpose(x, w, strides=strides, padding=padding, output_padding=output_padding,
                                          dilation=dilation, groups=groups),
        lambda x, w: F.conv_transpose2d(x, w, **attrs),
        [_rand(*xs), _rand(*ws, seed=1)],
    )


def test_conv2d_transpose_asymmetric_padding_crops_each_side() -> None:
    """Four pads crop (top, left, bottom, right) from the full transposed output, as ONNX's ConvTranspose."""
    xv, wv = _rand(1, 2, 3, 4), _rand(2, 3, 3, 3, seed=1)
    full = F.conv_transpose2d(torch.tensor(xv), torch.tensor(wv), stride=2).numpy()
    x, w = opgrad.var("x", xv.shape, "float64"), opgrad.var("w", wv.shape, "float64")
    out = opgrad.evaluate(opgrad.function([x, w], ops.conv2d_transpose(x, w, strides=2, padding=(1, 0, 2, 3))), xv, wv)
    _close(out, full[:, :, 1:-2, 0:-3], 1e-12, "cropped transposed output")


# ----- pooling: ceil_mode and count_include_pad -----

POOL_CASES = [
    # data, pool_size, strides, padding
    ((2, 3, 7, 6), (3, 2), (2, 2), (1, 0)),
    ((2, 2, 8, 5), (2, 2), (3, 2), (0, 1)),
    ((1, 2, 5, 5), (3, 3), (2, 2), (1, 1)),
    ((1, 1, 4, 4), (2, 2), (3, 3), (0, 0)),  # ceil mode adds a window that starts on the last row
    ((1, 2, 6, 9), (2, 3), (2, 3), (1, 1)),  # the ceil-mode window that would start in the padding is dropped
    # Windows side by side along rows, no padding: the compiled pool runs whole vectors of output
    # columns and a masked last piece per row (35 columns: 2 vectors of 16 and 3, or 4 of 8 and 3).
    ((2, 3, 9, 71), (2, 2), (2, 2), (0, 0)),
    ((1, 2, 7, 40), (3, 4), (2, 4), (0, 0)),  # rows of windows overlap, columns do not
]


@pytest.mark.parametrize("ceil_mode", [False, True])
@pytest.mark.parametrize("xs, pool, strides, padding", POOL_CASES)
def test_max_pool2d_ceil_mode_matches_torch(xs, pool, strides, padding, ceil_mode) -> None:
    against_torch(
        lambda x: ops.max_pool2d(x, pool_size=pool, strides=strides, padding=padding, ceil_mode=ceil_mode),
        lambda x: F.max_pool2d(x, pool, strides, padding, ceil_mode=ceil_mode),
        [_rand(*xs)],
    )


@pytest.mark.parametrize("count_include_pad", [True, False])
@pytest.mark.parametrize("ceil_mode", [False, True])
@pytest.mark.parametrize("xs, pool, strides, padding", POOL_CASES)
def test_avg_pool2d_ceil_mode_and_count_include_pad_match_torch(xs, pool, strides, padding, ceil_mode,
                                                                count_include_pad) -> None:
    against_torch(
        lambda x: ops.avg_pool2d(x, pool_size=pool, strides=strides, padding=padding, ceil_mode=ceil_mode,
                                 count_include_pad=count_include_pad),
        lambda x: F.avg_pool2d(x, pool, strides, padding, ceil_mode=ceil_mode, count_include_pad=count_include_pad),
        [_rand(*xs)],
    )


@pytest.mark.parametrize("op", ["max_pool2d", "avg_pool2d"])
def test_compiled_pools_put_nan_and_infinities_where_the_reference_does(op: str) -> None:
    xv = _rand(2, 3, 6, 70).astype(np.float32)
    xv[0, 0, 1, 3], xv[0, 1, 4, 40], xv[1, 2, 0, 69] = np.nan, np.inf, -np.inf
    x = opgrad.var("x", xv.shape, "float32")
    fn = opgrad.function([x], getattr(ops, op)(x, pool_size=2, strides=2))
    got, want = opgrad.compile(fn)(xv), opgrad.evaluate(fn, xv)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)  # equal_nan: NaN and infinities in place
    # A -inf never wins a max against finite neighbours; an average keeps it.
    assert np.isnan(want).sum() == 1 and np.isinf(want).sum() == (1 if op == "max_pool2d" else 2)


def test_pool_output_sizes_follow_torch_ceil_rule() -> None:
    for h in range(1, 12):
        for k in (1, 2, 3):
            for s in (1, 2, 3):
                for p in range(k // 2 + 1):  # PyTorch allows padding up to half the window
                    if h + 2 * p < k:
                        continue
                    x = opgrad.var("x", (1, 1, h, h), "float32")
                    want = F.max_pool2d(torch.zeros(1, 1, h, h), k, s, p, ceil_mode=True).shape
                    assert ops.max_pool2d(x, pool_size=k, strides=s, padding=p, ceil_mode=True).shape == tuple(want)


# ----- NaN and inf: compiled equals the reference element by element -----


def _nonfinite(shape: tuple[int, ...], seed: int) -> np.ndarray:
    a = _rand(*shape, seed=seed)
    flat = a.reshape(-1)
    rng = np.random.default_rng(seed)
    for value, count in ((np.nan, 2), (np.inf, 1), (-np.inf, 1)):
        flat[rng.choice(flat.size, count, replace=False)] = value
    return a


def _same_nonfinite(got: np.ndarray, want: np.ndarray, dtype: str, what: str) -> None:
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{what}: NaN positions")
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want), err_msg=f"{what}: +inf positions")
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=f"{what}: -inf positions")
    finite = np.isfinite(want)
    if finite.any():
        _close(got[finite], want[finite], GRAPH_TOL[dtype], what)


NONFINITE_CASES = {
    "conv2d groups=2": (lambda x, w: ops.conv2d(x, w, padding=(1, 0, 2, 1), groups=2), [(2, 4, 6, 5), (4, 2, 3, 3)]),
    "conv2d depthwise": (lambda x, w: ops.conv2d(x, w, padding=(0, 1, 1, 0), strides=2, groups=10),
                         [(1, 10, 7, 6), (10, 1, 3, 3)]),
    "conv2d_transpose": (lambda x, w: ops.conv2d_transpose(x, w, strides=2, padding=1, output_padding=1, groups=2),
                         [(1, 4, 4, 3), (4, 1, 3, 3)]),
    "conv2d_transpose depthwise": (lambda x, w: ops.conv2d_transpose(x, w, strides=(1, 2), padding=(1, 0), groups=9),
                                   [(1, 9, 4, 3), (9, 1, 2, 3)]),
    "max_pool2d ceil": (lambda x: ops.max_pool2d(x, pool_size=3, strides=2, padding=1, ceil_mode=True), [(2, 2, 6, 6)]),
    "avg_pool2d ceil, no pad count": (
        lambda x: ops.avg_pool2d(x, pool_size=3, strides=2, padding=1, ceil_mode=True, count_include_pad=False),
        [(2, 2, 6, 6)]),
}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", list(NONFINITE_CASES))
def test_compiled_matches_reference_with_nan_and_inf(name: str, dtype: str) -> None:
    build, shapes = NONFINITE_CASES[name]
    arrays = [_nonfinite(s, seed=i) for i, s in enumerate(shapes)]
    forward, vjp, cast = _functions(build, arrays, dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        _same_nonfinite(opgrad.compile(forward)(*cast), opgrad.evaluate(forward, *cast), dtype, f"{name} forward")
        c = _rand(*forward.output.shape, seed=7).astype(dtype)
        got, want = opgrad.compile(vjp)(*cast, c), opgrad.evaluate(vjp, *cast, c)
        for k, (g, w) in enumerate(zip(got, want, strict=True)):
            _same_nonfinite(g, w, dtype, f"{name} gradient output {k}")


# ----- errors name the op, the inputs and what was expected -----


@pytest.mark.parametrize("build, fragments", [
    (lambda: ops.conv2d(opgrad.var("x", (1, 6, 5, 5)), opgrad.var("w", (4, 2, 3, 3)), groups=4),
     ["opgrad.ops.conv2d", "groups=4", "6 channel(s)", "does not divide"]),
    (lambda: ops.conv2d(opgrad.var("x", (1, 6, 5, 5)), opgrad.var("w", (4, 2, 3, 3)), groups=2),
     ["opgrad.ops.conv2d", "per group", "expected weight shape (4, 3, KH, KW)"]),
    (lambda: ops.conv2d(opgrad.var("x", (1, 6, 5, 5)), opgrad.var("w", (3, 3, 3, 3)), groups=2),
     ["opgrad.ops.conv2d", "3 output channel(s)", "groups=2"]),
    (lambda: ops.conv2d(opgrad.var("x", (1, 1, 5, 5)), opgrad.var("w", (1, 1, 3, 3)), padding=(1, 2, 3)),
     ["opgrad.ops.conv2d", "padding", "(top, left, bottom, right)"]),
    (lambda: ops.conv2d_transpose(opgrad.var("x", (1, 2, 3, 3)), opgrad.var("w", (2, 1, 3, 3)), strides=2,
                                  output_padding=2),
     ["opgrad.ops.conv2d_transpose", "output_padding (2, 2)", "smaller than strides"]),
    (lambda: ops.conv2d_transpose(opgrad.var("x", (1, 2, 3, 3)), opgrad.var("w", (3, 1, 3, 3))),
     ["opgrad.ops.conv2d_transpose", "(2, C_out/groups, KH, KW)"]),
    (lambda: ops.conv2d_transpose(opgrad.var("x", (1, 2, 1, 1)), opgrad.var("w", (2, 1, 1, 1)), padding=1),
     ["opgrad.ops.conv2d_transpose", "crops the whole output"]),
    (lambda: ops.avg_pool2d(opgrad.var("x", (1, 1, 4, 4)), ceil_mode="yes"),
     ["opgrad.ops.avg_pool2d", "ceil_mode", "True or False"]),
])
def test_shape_and_attribute_errors_name_the_op(build: Callable[[], object], fragments: list[str]) -> None:
    with pytest.raises(OpgradError) as info:
        build()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in:\n{message}"
