"""nn.Reshape, nn.Permute, nn.ZeroPadding2D, nn.Rescaling and nn.Softmax: values, gradients, configs and errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import opgrad
from opgrad import nn, ops
from opgrad.checks import check_function
from opgrad.errors import ShapeError


def _model() -> nn.Model:
    inp = nn.Input((2, 3, 4))
    nhwc = nn.Permute((2, 3, 1))(inp)
    rows = nn.Reshape((-1, 2))(nhwc)
    probs = nn.Softmax(axis=1)(rows)
    padded = nn.ZeroPadding2D(((1, 0), (2, 1)))(nn.Rescaling(2.0, offset=0.5)(inp))
    flat = nn.Dense(3)(nn.Concatenate()([nn.Flatten()(probs), nn.Flatten()(padded)]))
    return nn.Model(inp, [probs, padded, flat])


def test_values_match_numpy() -> None:
    model = _model()
    x = np.random.default_rng(0).standard_normal((2, 2, 3, 4)).astype(np.float32)
    probs, padded, _ = model.predict(x, backend="reference")
    rows = x.transpose(0, 2, 3, 1).reshape(2, 12, 2)
    expected = np.exp(rows) / np.exp(rows).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(probs, expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(padded, np.pad(x * 2 + 0.5, ((0, 0), (0, 0), (1, 0), (2, 1))))


def test_gradients_pass_the_checker() -> None:
    model = _model()
    x = opgrad.var("x", (2, 2, 3, 4))
    labels = opgrad.var("labels", (2,), "int64")
    params = model.param_vars()
    logits = model.call([x], dict(params))[0][2]
    fn = opgrad.function([x, labels, *params.values()], ops.softmax_cross_entropy(logits, labels))
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal((2, 2, 3, 4)), np.array([0, 2]), *model.params.values()]
    report = check_function(fn, arrays, seed=0, directions=2)
    assert report.passed, str(report)


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    model = _model()
    model.save(tmp_path / "m.npz")
    again = nn.load(tmp_path / "m.npz")
    x = np.random.default_rng(2).standard_normal((2, 2, 3, 4)).astype(np.float32)
    for a, b in zip(model.predict(x, backend="reference"), again.predict(x, backend="reference")):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(("make", "message"), [
    (lambda: nn.Reshape((0, 3)), "target_shape must be positive ints"),
    (lambda: nn.Reshape((-1, -1)), "at most one -1"),
    (lambda: nn.Permute((0, 1, 2)), "permutation of 1..3"),
    (lambda: nn.ZeroPadding2D(-1), "ZeroPadding2D padding must be"),
    (lambda: nn.ZeroPadding2D((1, 2, 3)), "ZeroPadding2D padding must be"),
    (lambda: nn.Rescaling(float("inf")), "must be finite"),
])
def test_bad_arguments(make, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize(("layer", "shape", "message"), [
    (nn.Reshape((5, 5)), (2, 3, 4), "24 values do not fit target shape"),
    (nn.Reshape((-1, 5)), (2, 3, 4), "24 values do not fill"),
    (nn.Permute((2, 1)), (2, 3, 4), "needs rank 2"),
    (nn.ZeroPadding2D(1), (3, 4), "needs \\(channels, height, width\\)"),
    (nn.Softmax(axis=0), (3,), "must name a non-batch axis"),
])
def test_wiring_errors_name_the_layer(layer: nn.Layer, shape: tuple[int, ...], message: str) -> None:
    with pytest.raises(ShapeError, match=message):
        layer(nn.Input(shape))
