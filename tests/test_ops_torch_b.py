"""Normalization, creation, pooling, dropout and data-movement ops against PyTorch (float64), and
their compiled kernels against the numpy reference (float32 and float64), on hand-picked cases:
odd sizes, non-default axes, batch 1 with spatial extent, exact zeros at kinks.

PyTorch is a test-only dependency. Without it these tests skip, except under CI=true, where a
missing torch is an error rather than a silently skipped comparison.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

import opgrad
from opgrad import ops

#: Compiled vs reference, relative to the output's scale (docs/compiler.md): one op, and gradient graphs.
OP_TOL = {"float64": 1e-10, "float32": 2e-5}
GRAPH_TOL = {"float64": 1e-10, "float32": 1e-4}


def _torch() -> Any:
    if os.environ.get("CI") == "true":
        import torch  # CI must compare against PyTorch: a missing torch fails here

        return torch
    return pytest.importorskip("torch", reason="PyTorch is not installed (test-only dependency: pip install torch)")


def _close(got: np.ndarray, want: np.ndarray, tol: float, what: str) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    scale = max(1.0, float(np.max(np.abs(want)))) if want.size else 1.0
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * scale, err_msg=what)


def _functions(build: Callable[..., opgrad.Expr], arrays: Sequence[np.ndarray], wrt: Sequence[int],
               dtype: str) -> tuple[opgrad.Function, opgrad.Function | None, list[np.ndarray]]:
    """The forward and, when ``wrt`` is not empty, the VJP function (value of <out, c>, then the
    gradients) in ``dtype``; returns them with the arguments cast to it."""
    cast = [a.astype(dtype) if a.dtype.kind == "f" else a for a in arrays]
    params = [opgrad.var(f"in{i}", a.shape, a.dtype.name) for i, a in enumerate(cast)]
    out = build(*params)
    forward = opgrad.function(params, out)
    if not wrt:
        return forward, None, cast
    c = opgrad.var("cotangent", out.shape, out.dtype)
    vjp = opgrad.grad(opgrad.function([*params, c], ops.sum(ops.multiply(out, c))), wrt=[params[i] for i in wrt])
    return forward, vjp, cast


def against_torch(build: Callable[..., opgrad.Expr], torch_fn: Callable[..., Any], arrays: Sequence[np.ndarray],
                  wrt: Sequence[int], *, seed: int = 0) -> None:
    """opgrad's forward and VJP (float64, reference backend) equal PyTorch's, and opgrad's compiled
    forward and VJP equal its reference in float32 and float64."""
    torch = _torch()
    forward, vjp, cast = _functions(build, arrays, wrt, "float64")
    out = np.asarray(opgrad.evaluate(forward, *cast))
    c = np.random.default_rng(seed).standard_normal(out.shape) + 0.3
    tensors = [torch.tensor(a, requires_grad=i in wrt) for i, a in enumerate(cast)]
    y = torch_fn(*tensors)
    _close(out, y.detach().numpy(), 1e-10, "forward vs torch")
    if vjp is not None:
        y.backward(torch.tensor(c))
        grads = opgrad.evaluate(vjp, *cast, c)[1:]
        for i, g in zip(wrt, grads, strict=True):
            want = tensors[i].grad.numpy() if tensors[i].grad is not None else np.zeros_like(cast[i])
            _close(g, want, 1e-9, f"gradient of input {i} vs torch")
    compiled_matches_reference(build, arrays, wrt, seed=seed)


def compiled_matches_reference(build: Callable[..., opgrad.Expr], arrays: Sequence[np.ndarray],
                               wrt: Sequence[int], *, seed: int = 0) -> None:
    for dtype in ("float64", "float32"):
        forward, vjp, cast = _functions(build, arrays, wrt, dtype)
        _close(opgrad.compile(forward)(*cast), opgrad.evaluate(forward, *cast), OP_TOL[dtype], f"compiled {dtype}")
        if vjp is not None:
            shape = vjp.params[-1].shape
            c = (np.random.default_rng(seed).standard_normal(shape) + 0.3).astype(dtype)
            got, want = opgrad.compile(vjp)(*cast, c), opgrad.evaluate(vjp, *cast, c)
            for k, (g, w) in enumerate(zip(got, want, strict=True)):
                _close(g, w, GRAPH_TOL[dtype], f"compiled gradient output {k}, {dtype}")


def _rand(*shape: int, seed: int = 0, low: float = -2.0, high: float = 2.0) -> np.ndarray:
    return np.random.default_rng(seed + sum(shape)).uniform(low, high, shape)


# ----- normalization -----


@pytest.mark.parametrize("shape, axis", [((1, 3, 4, 5), 1), ((4, 3, 2, 2), 1), ((5, 3), 1), ((2, 3, 5), 2),
                                         ((3, 2, 3), 0)])
def test_batch_norm_matches_torch(shape: tuple[int, ...], axis: int) -> None:
    torch = _torch()
    c = shape[axis]
    arrays = [_rand(*shape), _rand(c, seed=1), _rand(c, seed=2)]

    def reference(x, g, b):
        moved = torch.nn.functional.batch_norm(x.movedim(axis, 1), None, None, g, b, training=True, eps=1e-3)
        return moved.movedim(1, axis)

    against_torch(lambda x, g, b: ops.batch_norm(x, g, b, axis=axis, epsilon=1e-3), reference, arrays, [0, 1, 2])


@pytest.mark.parametrize("shape, axis", [((2, 3, 4, 5), 1), ((5, 3), 1), ((2, 4, 3), -1)])
def test_batch_norm_inference_matches_torch(shape: tuple[int, ...], axis: int) -> None:
    torch = _torch()
    c = shape[axis]
    arrays = [_rand(*shape), _rand(c, seed=1), _rand(c, seed=2), _rand(c, seed=3),
              _rand(c, seed=4, low=0.2, high=3.0)]
    a = axis % len(shape)

    def library(x, g, b, m, v):  # PyTorch's own kernel: gradients to data, gamma and beta
        moved = torch.nn.functional.batch_norm(x.movedim(a, 1), m, v, g, b, training=False, eps=1e-5)
        return moved.movedim(1, a)

    def formula(x, g, b, m, v):  # the same function in autograd primitives: also differentiates mean, var
        along = [1] * len(shape)
        along[a] = c
        return (x - m.reshape(along)) / torch.sqrt(v.reshape(along) + 1e-5) * g.reshape(along) + b.reshape(along)

    def build(*p):
        return ops.batch_norm_inference(*p, axis=axis)

    against_torch(build, library, arrays, [0, 1, 2])
    against_torch(build, formula, arrays, [0, 1, 2, 3, 4])


@pytest.mark.parametrize("shape, axis", [((3, 5), -1), ((2, 3, 4), -2), ((2, 3, 4), 0), ((1, 7), 1)])
def test_layer_norm_matches_torch(shape: tuple[int, ...], axis: int) -> None:
    torch = _torch()
    trailing = shape[axis:]
    arrays = [_rand(*shape), _rand(*trailing, seed=1), _rand(*trailing, seed=2)]
    against_torch(lambda x, g, b: ops.layer_norm(x, g, b, axis=axis),
                  lambda x, g, b: torch.nn.functional.layer_norm(x, trailing, g, b, 1e-5), arrays, [0, 1, 2])


@pytest.mark.parametrize("shape, alpha_shape, axis", [((2, 3, 4, 5), (3,), 1), ((2, 3, 4, 5), (1,), 1),
                                                      ((5,), (1,), 0), ((2, 5, 3), (3,), 2)])
def test_prelu_matches_torch_including_exact_zeros(shape, alpha_shape, axis) -> None:
    torch = _torch()
    x = _rand(*shape)
    x.reshape(-1)[::3] = 0.0  # on the kink: PyTorch's slope there is alpha, as declared
    arrays = [x, _rand(*alpha_shape, seed=5, low=0.05, high=0.5)]

    def reference(x, alpha):
        return torch.nn.functional.prelu(x.movedim(axis, 1) if x.ndim > 1 else x, alpha).movedim(1, axis) \
            if x.ndim > 1 else torch.nn.functional.prelu(x, alpha)

    against_torch(lambda x, a: ops.prelu(x, a, axis=axis), reference, arrays, [0, 1])


def test_prelu_single_slope_as_a_scalar() -> None:
    x = _rand(2, 3, 4)
    compiled_matches_reference(lambda x, a: ops.prelu(x, a), [x, np.array(0.25)], [0, 1])


def test_normalization_shape_errors_name_the_problem() -> None:
    x = opgrad.var("x", (2, 3, 4), "float64")
    with pytest.raises(opgrad.OpCallError, match=r"gamma has shape \(4,\).*expected gamma shape \(3,\)"):
        ops.batch_norm(x, opgrad.var("g", (4,), "float64"), opgrad.var("b", (3,), "float64"))
    with pytest.raises(opgrad.OpCallError, match=r"expected gamma shape \(3, 4\)"):
        ops.layer_norm(x, opgrad.var("g", (4,), "float64"), opgrad.var("b", (3, 4), "float64"), axis=1)
    with pytest.raises(opgrad.OpCallError, match="epsilon"):
        ops.layer_norm(x, opgrad.var("g", (4,), "float64"), opgrad.var("b", (4,), "float64"), epsilon=0)
    with pytest.raises(opgrad.OpCallError, match=r"alpha has shape \(2,\)"):
        ops.prelu(x, opgrad.var("a", (2,), "float64"))


# ----- creation: no inputs -----


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", [(), (5,), (2, 3, 1), (0, 3)])
def test_full_zeros_ones_match_torch_and_compile(shape: tuple[int, ...], dtype: str) -> None:
    torch = _torch()
    tdtype = getattr(torch, dtype)
    for value in (0.0, -2.5, 1e30, float("inf"), float("-inf"), float("nan")):
        fn = opgrad.function([], ops.full(shape, value, dtype))
        want = torch.full(shape, value, dtype=tdtype).numpy()
        for got in (opgrad.evaluate(fn), opgrad.compile(fn)()):
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want)  # bitwise, nan and inf included
    for op, make in ((ops.zeros, torch.zeros), (ops.ones, torch.ones)):
        fn = opgrad.function([], op(shape, dtype=dtype))
        want = make(shape, dtype=tdtype).numpy()
        for got in (opgrad.evaluate(fn), opgrad.compile(fn)()):
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)


def test_created_tensors_inside_a_gradient_graph() -> None:
    """x * ones + full: the constants fold into the kernels, and no gradient flows into them."""
    x = _rand(3, 4)
    compiled_matches_reference(lambda x: ops.multiply(ops.add(x, ops.full((4,), 0.5, x.dtype)),
                                                      ops.ones((3, 1), x.dtype)), [x], [0])
    compiled_matches_reference(lambda x: ops.tanh(ops.add(x, ops.zeros(x.shape, x.dtype))), [x], [0])
    with pytest.raises(opgrad.OpCallError, match="every dimension must be >= 0"):
        ops.zeros((2, -1))
    with pytest.raises(opgrad.OpCallError, match="dtype"):
        ops.ones(3, "int64")


# ----- global pooling -----


@pytest.mark.parametrize("shape", [(1, 3, 5, 7), (2, 1, 1, 1), (3, 2, 4, 1)])
def test_global_pools_match_torch(shape: tuple[int, ...]) -> None:
    torch = _torch()
    x = _rand(*shape)
    against_torch(ops.global_avg_pool2d, lambda x: torch.nn.functional.adaptive_avg_pool2d(x, 1), [x], [0])
    against_torch(ops.global_max_pool2d, lambda x: torch.nn.functional.adaptive_max_pool2d(x, 1), [x], [0])


def test_global_max_pool_ties_go_to_the_first_maximum() -> None:
    x = np.zeros((1, 2, 2, 3))
    x[0, 0, 0, 2] = x[0, 0, 1, 0] = 5.0  # tie: (0, 2) comes first in row-major order
    x[0, 1] = 1.0  # a constant plane: the first element takes the gradient
    v = opgrad.var("x", x.shape, "float64")
    _, dx = opgrad.evaluate(opgrad.grad(opgrad.function([v], ops.sum(ops.global_max_pool2d(v)))), x)
    want = np.zeros_like(x)
    want[0, 0, 0, 2] = want[0, 1, 0, 0] = 1.0
    np.testing.assert_array_equal(dx, want)
    compiled_matches_reference(ops.global_max_pool2d, [x], [0])


def test_global_max_pool_propagates_nan_in_the_reference() -> None:
    x = _rand(2, 2, 3, 3)
    x[1, 0, 2, 1] = np.nan
    fn = opgrad.function([v := opgrad.var("x", x.shape, "float64")], ops.global_max_pool2d(v))
    out = opgrad.evaluate(fn, x)
    assert np.isnan(out[1, 0, 0, 0]) and np.isfinite(np.delete(out.ravel(), 2)).all()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_global_max_pool_propagates_nan_compiled(dtype: str) -> None:
    x = _rand(2, 2, 3, 3).astype(dtype)
    x[1, 0, 2, 1] = np.nan
    x[0, 1, 0, 0] = np.nan
    fn = opgrad.function([v := opgrad.var("x", x.shape, dtype)], ops.global_max_pool2d(v))
    np.testing.assert_array_equal(opgrad.compile(fn)(x), opgrad.evaluate(fn, x))


def test_global_pool_shape_errors() -> None:
    with pytest.raises(opgrad.OpCallError, match="must be 4-D NCHW"):
        ops.global_avg_pool2d(opgrad.var("x", (2, 3, 4), "float32"))
    with pytest.raises(opgrad.OpCallError, match="empty 0x4 plane"):
        ops.global_max_pool2d(opgrad.var("x", (2, 3, 0, 4), "float32"))


# ----- dropout -----


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_dropout_compiled_mask_is_the_reference_mask_bitwise(rate: float, dtype: str) -> None:
    from opgrad.registry.dropout import keep_mask

    n = 100_003  # over 2**16 elements: the kernel splits the loop over threads
    x = np.random.default_rng(1).uniform(0.5, 2.0, n).astype(dtype)  # nonzero: a zero output means dropped
    fn = opgrad.function([v := opgrad.var("x", (n,), dtype)], ops.dropout(v, rate, 12345))
    got, want = opgrad.compile(fn)(x), opgrad.evaluate(fn, x)
    np.testing.assert_array_equal(got, want)  # bitwise: one multiply by the same rounded scale
    kept = want != 0
    np.testing.assert_array_equal(kept, keep_mask((n,), rate, 12345))
    sigma = np.sqrt(rate * (1 - rate) / n)
    assert abs(kept.mean() - (1 - rate)) < 5 * sigma, f"kept {kept.mean():.4f}, expected {1 - rate}"
    np.testing.assert_array_equal(want[kept], x[kept] * np.asarray(1 / (1 - rate), dtype))


def test_dropout_masks_depend_on_seed_and_position_only() -> None:
    from opgrad.registry.dropout import keep_mask

    a, b = keep_mask((40, 50), 0.5, 0), keep_mask((40, 50), 0.5, 1)
    assert 0.4 < (a != b).mean() < 0.6  # neighbouring seeds: unrelated masks
    np.testing.assert_array_equal(keep_mask((2000,), 0.5, 7).reshape(40, 50), keep_mask((40, 50), 0.5, 7))
    assert keep_mask((100,), 0.0, 3).all()
    x = np.full((3, 4), np.nan)
    out = opgrad.evaluate(opgrad.function([v := opgrad.var("x", (3, 4), "float64")], ops.dropout(v, 0.5, 2)), x)
    assert np.all((out == 0) | np.isnan(out)) and (out == 0).any()  # dropped elements are exactly 0


@pytest.mark.parametrize("shape, rate", [((7, 5), 0.3), ((2, 3, 4, 5), 0.5), ((), 0.0)])
def test_dropout_matches_torch_with_the_same_mask(shape: tuple[int, ...], rate: float) -> None:
    """PyTorch's generator differs, so torch applies opgrad's mask with its own dropout arithmetic."""
    from opgrad.registry.dropout import keep_mask

    torch = _torch()
    mask = torch.tensor(keep_mask(shape, rate, 99).astype(np.float64))
    against_torch(lambda x: ops.dropout(x, rate, 99), lambda x: x * mask / (1 - rate), [_rand(*shape)], [0])


def test_dropout_inside_a_fused_gradient_graph() -> None:
    compiled_matches_reference(lambda x: ops.tanh(ops.dropout(ops.multiply(x, x), rate=0.4, seed=5)),
                               [_rand(6, 7)], [0])
    with pytest.raises(opgrad.OpCallError, match=r"drop probability in \[0, 1\)"):
        ops.dropout(opgrad.var("x", (2,), "float32"), 1.0, 0)


# ----- data movement -----


@pytest.mark.parametrize("shape, axis", [((3, 4, 5), 1), ((3, 4, 5), (0, 2)), ((2, 3), None), ((7,), -1),
                                         ((2, 1, 3), (-1, -3))])
def test_flip_matches_torch(shape: tuple[int, ...], axis: Any) -> None:
    torch = _torch()
    dims = list(range(len(shape))) if axis is None else ([axis] if isinstance(axis, int) else list(axis))
    against_torch(lambda x: ops.flip(x, axis), lambda x: torch.flip(x, dims), [_rand(*shape)], [0])


def test_take_is_an_embedding_lookup_with_repeated_indices() -> None:
    torch = _torch()
    table = _rand(11, 5)
    ids = np.array([[3, 0, 3, 10], [3, 7, 7, 1], [0, 0, 0, 0]])  # repeats accumulate in the gradient
    against_torch(lambda w, i: ops.take(w, i), lambda w, i: torch.nn.functional.embedding(i, w), [table, ids], [0])


@pytest.mark.parametrize("shape, axis, indices", [((3, 5, 2), 1, [4, 0, 4, 2, 1]), ((4, 3), -1, [[2, 2], [0, 1]]),
                                                  ((6,), 0, 5), ((2, 3, 4), 2, [[[3]]])])
def test_take_along_an_axis_matches_torch(shape: tuple[int, ...], axis: int, indices: Any) -> None:
    torch = _torch()
    idx = np.asarray(indices, dtype=np.int64)
    a = axis % len(shape)

    def reference(x, i):
        picked = torch.index_select(x, a, i.reshape(-1))
        return picked.reshape(x.shape[:a] + tuple(i.shape) + x.shape[a + 1:])

    against_torch(lambda x, i: ops.take(x, i, axis), reference, [_rand(*shape), idx], [0])


def test_take_out_of_range_indices_fail_before_any_kernel_runs() -> None:
    x, i = opgrad.var("x", (4, 3), "float64"), opgrad.var("i", (2,), "int64")
    fn = opgrad.function([x, i], ops.take(x, i))
    with pytest.raises(ValueError, match=r"indices must lie in \[0, 4\)"):
        opgrad.evaluate(fn, np.zeros((4, 3)), np.array([1, 4]))
    compiled = opgrad.compile(fn)
    for bad in (4, -1):
        with pytest.raises(opgrad.ArgumentError, match=r"valid range is \[0, 4\)"):
            compiled(np.zeros((4, 3)), np.array([0, bad]))
    with pytest.raises(opgrad.OpCallError, match="axis_size is derived from data"):
        ops.take(x, i, axis=0, axis_size=3)


def _torch_pad(torch: Any, x: Any, widths: Sequence[tuple[int, int]], mode: str, value: float) -> Any:
    flat = [w for pair in reversed(widths) for w in pair]  # torch lists the last axis first
    kind = {"constant": "constant", "reflect": "reflect", "edge": "replicate"}[mode]
    lead = next(i for i, (b, a) in enumerate(widths) if b or a)  # torch pads only trailing axes of a batch
    flat = flat[: 2 * (len(widths) - lead)]
    return torch.nn.functional.pad(x, flat, mode=kind, value=value) if mode == "constant" \
        else torch.nn.functional.pad(x, flat, mode=kind)


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge"])
@pytest.mark.parametrize("shape, widths", [((2, 3, 5, 6), ((0, 0), (0, 0), (2, 1), (1, 3))),
                                           ((1, 4, 7), ((0, 0), (0, 0), (3, 2))),
                                           ((2, 3, 4), ((0, 0), (1, 2), (3, 0)))])
def test_pad_matches_torch(shape: tuple[int, ...], widths: Any, mode: str) -> None:
    torch = _torch()
    value = 1.5 if mode == "constant" else 0.0
    against_torch(lambda x: ops.pad(x, widths, mode, value), lambda x: _torch_pad(torch, x, widths, mode, value),
                  [_rand(*shape)], [0])


@pytest.mark.parametrize("mode", ["reflect", "edge", "constant"])
@pytest.mark.parametrize("shape, pad_width", [((3, 4), 5), ((1, 5), (0, 9)), ((2, 1, 3), ((2, 3), (4, 1), (7, 0)))])
def test_pad_beyond_the_axis_follows_numpy(shape: tuple[int, ...], pad_width: Any, mode: str) -> None:
    """numpy keeps reflecting where a pad is wider than the axis (PyTorch refuses); int and pair forms."""
    x = _rand(*shape)
    v = opgrad.var("x", shape, "float64")
    np.testing.assert_array_equal(opgrad.evaluate(opgrad.function([v], ops.pad(v, pad_width, mode)), x),
                                  np.pad(x, pad_width, mode=mode))
    compiled_matches_reference(lambda x: ops.pad(x, pad_width, mode), [x], [0])


def test_pad_errors() -> None:
    x = opgrad.var("x", (2, 0, 3), "float32")
    with pytest.raises(opgrad.OpCallError, match="cannot pad axis 1 of length 0"):
        ops.pad(x, 1, "reflect")
    with pytest.raises(opgrad.OpCallError, match="mode 'edge' takes none"):
        ops.pad(x, 1, "edge", 2.0)
    with pytest.raises(opgrad.OpCallError, match=r"numpy\.pad's forms"):
        ops.pad(x, ((1, 2), (3, 4)))
    with pytest.raises(opgrad.OpCallError, match="expected one of constant, reflect, edge"):
        ops.pad(x, 1, "wrap")


@pytest.mark.parametrize("shape, begin, end, strides", [
    ((6, 5), (1, -1), (5, None), (2, -2)),
    ((7,), (None,), (None,), (-1,)),
    ((4, 5, 3), (-1, 0), (-5, 5), (-1, 3)),
    ((5, 4), (10,), (-10,), (-3,)),
    ((3, 4), (1,), (3,), None),
])
def test_strided_slice_matches_torch_including_negative_strides(shape, begin, end, strides) -> None:
    torch = _torch()
    steps = strides or (None,) * len(begin)
    index = [np.arange(n)[slice(b, e, s)] for n, b, e, s in zip(shape, begin, end, steps, strict=False)]
    index += [np.arange(n) for n in shape[len(begin):]]
    grid = tuple(torch.tensor(i.copy()) for i in np.ix_(*index))  # torch slices reject negative steps: gather instead
    against_torch(lambda x: ops.strided_slice(x, begin, end, strides), lambda x: x[grid], [_rand(*shape)], [0])


def test_strided_slice_errors() -> None:
    x = opgrad.var("x", (4, 3), "float32")
    with pytest.raises(opgrad.OpCallError, match="step cannot be zero"):
        ops.strided_slice(x, (0,), (2,), (0,))
    with pytest.raises(opgrad.OpCallError, match="one entry per sliced axis"):
        ops.strided_slice(x, (0, 1), (2,))
    with pytest.raises(opgrad.OpCallError, match="3 axes sliced but data has rank 2"):
        ops.strided_slice(x, (0, 0, 0), (1, 1, 1))


@pytest.mark.parametrize("shape, r", [((2, 3, 6, 4), 2), ((1, 2, 9, 3), 3), ((2, 1, 3, 5), 1)])
def test_space_to_depth_and_back_match_torch(shape: tuple[int, ...], r: int) -> None:
    torch = _torch()
    x = _rand(*shape)
    against_torch(lambda x: ops.space_to_depth(x, r), lambda x: torch.nn.functional.pixel_unshuffle(x, r), [x], [0])
    n, c, h, w = shape
    y = _rand(n, c * r * r, h // r + 1, w // r + 2)
    against_torch(lambda y: ops.depth_to_space(y, r), lambda y: torch.nn.functional.pixel_shuffle(y, r), [y], [0])
    with pytest.raises(opgrad.OpCallError, match="must be multiples of block_size"):
        ops.space_to_depth(opgrad.var("x", (1, 1, 5, 4), "float32"), 2)


def test_data_movement_of_strided_inputs_inside_gradient_graphs() -> None:
    """Inputs that are themselves views (a transpose, a broadcast) feed the copies correctly."""
    x = _rand(4, 6)
    compiled_matches_reference(lambda x: ops.flip(ops.transpose(x), 0) * 2.0, [x], [0])
    compiled_matches_reference(lambda x: ops.strided_slice(ops.transpose(x), (None, 4), (None, 0), (2, -1)),
                               [x], [0])
    compiled_matches_reference(lambda x: ops.pad(ops.broadcast_to(x, (2, 4, 6)), ((1, 0), (2, 2), (0, 3)),
                                                 "reflect"), [x], [0])
    compiled_matches_reference(lambda x: ops.take(ops.transpose(x), opgrad.const(np.array([5, 0, 5]))), [x], [0])
