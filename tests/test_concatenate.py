"""concatenate (a variadic op) and split (a composite) against torch.cat / np.split, and their errors."""

from __future__ import annotations

import numpy as np
import pytest
from optional import require

import opgrad
from opgrad import ops
from opgrad.errors import OpCallError

torch = require("torch", "concatenate is compared with torch.cat (pip install torch==2.13.0)")


@pytest.mark.parametrize("shapes, axis", [
    ([(2, 3, 4), (2, 1, 4), (2, 5, 4)], 1),
    ([(3, 2), (3, 7)], -1),
    ([(5,)], 0),
    ([(1, 2, 3), (4, 2, 3), (2, 2, 3), (1, 2, 3)], 0),
    ([(2, 0, 3), (2, 4, 3)], 1),
])
def test_concatenate_value_and_gradients_match_torch(shapes: list[tuple[int, ...]], axis: int) -> None:
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s) for s in shapes]
    xs = [opgrad.var(f"x{i}", s, "float64") for i, s in enumerate(shapes)]
    y = ops.concatenate(xs, axis=axis)
    weight = rng.standard_normal(y.shape)
    fn = opgrad.grad(opgrad.function(xs, ops.sum(ops.tanh(y) * weight)))
    got = opgrad.evaluate(fn, *arrays)
    tensors = [torch.tensor(a, requires_grad=True) for a in arrays]
    loss = (torch.tanh(torch.cat(tensors, dim=axis)) * torch.tensor(weight)).sum()
    loss.backward()
    np.testing.assert_allclose(got[0], loss.detach().numpy(), rtol=1e-12)
    for g, t in zip(got[1:], tensors):
        np.testing.assert_allclose(g, t.grad.numpy(), rtol=1e-12, atol=1e-15)
    for dtype in ("float32", "float64"):
        typed = [opgrad.var(f"x{i}", s, dtype) for i, s in enumerate(shapes)]
        f = opgrad.function(typed, ops.concatenate(typed, axis=axis))
        cast = [a.astype(dtype) for a in arrays]
        np.testing.assert_array_equal(opgrad.compile(f)(*cast), np.concatenate(cast, axis=axis))


@pytest.mark.parametrize("sections, axis", [(3, 1), ([2, 5], 0), ([0, 3, 3, 10], 0), ([-2], 1), (1, 0)])
def test_split_matches_numpy(sections: int | list[int], axis: int) -> None:
    data = np.arange(42.0).reshape(7, 6)
    x = opgrad.var("x", (7, 6), "float64")
    parts = ops.split(x, sections, axis=axis)
    want = np.split(data, sections, axis=axis)
    assert len(parts) == len(want)
    got = opgrad.evaluate(opgrad.function([x], list(parts)), data)
    for g, w in zip(got if isinstance(got, tuple) else [got], want):
        np.testing.assert_array_equal(g, w)


def test_split_then_concatenate_is_identity_with_gradient() -> None:
    x = opgrad.var("x", (4, 9), "float64")
    back = ops.concatenate(list(ops.split(x, [2, 7], axis=1)), axis=1)
    fn = opgrad.grad(opgrad.function([x], ops.sum(back * back)))
    data = np.random.default_rng(1).standard_normal((4, 9))
    value, grad = opgrad.compile(fn)(data)
    np.testing.assert_allclose(value, np.sum(data * data), rtol=1e-12)
    np.testing.assert_allclose(grad, 2 * data, rtol=1e-12)


def test_errors_name_the_op_and_inputs() -> None:
    a = opgrad.var("a", (2, 3))
    with pytest.raises(OpCallError, match=r"xs\[1\] has shape \(3, 3\) but xs\[0\] has \(2, 3\); they may differ "
                                          r"only along axis 1"):
        ops.concatenate([a, opgrad.var("b", (3, 3))], axis=1)
    with pytest.raises(OpCallError, match=r"xs\[1\] has rank 1 but xs\[0\] has rank 2"):
        ops.concatenate([a, opgrad.var("b", (3,))])
    with pytest.raises(OpCallError, match="axis=2: axis 2 is out of range for a rank-2 input"):
        ops.concatenate([a, a], axis=2)
    with pytest.raises(OpCallError, match="a non-empty list"):
        ops.concatenate([], axis=0)
    with pytest.raises(OpCallError, match="takes a list of tensors"):
        ops.concatenate("ab")
    with pytest.raises(ValueError, match="4 sections do not divide axis 1 of shape \\(2, 3\\) equally"):
        ops.split(a, 4, axis=1)
    with pytest.raises(ValueError, match="axis=5 is out of range"):
        ops.split(a, 1, axis=5)


def test_composites_are_listed() -> None:
    assert "split" in dir(ops)
    from opgrad import registry

    assert {"split", "upsampling", "conv2d_nchwc"} <= {c.name for c in registry.all_composites()}
