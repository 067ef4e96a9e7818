"""opgrad.nn: layer shapes and errors, seeded initializers, optimizer formulas against plain numpy,
dropout masks, and the float64 reference training step of the seed CNN against an independent
numpy implementation (forward, backward and SGD written here with einsum and loops)."""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import pytest

import opgrad
from opgrad import nn
from opgrad.errors import ShapeError
from opgrad.nn.init import compute_fans, param_generator

# ----- layers -----


def test_seed_cnn_shapes_and_parameters() -> None:
    model = nn.seed_cnn()
    assert [layer.name for layer in model.layers] == ["conv1", "conv2", "avgpool1", "conv3", "flatten1", "dense1"]
    assert [layer.output_shape for layer in model.layers] == [
        (32, 26, 26), (64, 24, 24), (64, 12, 12), (128, 1, 1), (128,), (10,)]
    assert model.param_shapes() == {
        "conv1.weight": (32, 1, 3, 3), "conv1.bias": (32,),
        "conv2.weight": (64, 32, 3, 3), "conv2.bias": (64,),
        "conv3.weight": (128, 64, 12, 12), "conv3.bias": (128,),
        "dense1.weight": (10, 128), "dense1.bias": (10,),
    }
    assert model.num_params == 1_199_882  # the Keras summary of the same model
    assert "conv3" in model.summary() and "1,199,882" in model.summary()


def test_keras_mnist_shapes() -> None:
    model = nn.keras_mnist()
    assert model.output_shape == (10,)
    assert model.param_shapes()["dense1.weight"] == (128, 9216)
    assert [layer.name for layer in model.noise_layers()] == ["dropout1", "dropout2"]
    assert model.num_params == 1_199_882


def test_forward_builds_typed_graph() -> None:
    model = nn.seed_cnn()
    x = opgrad.var("x", (5, 1, 28, 28))
    logits = model.forward(x, model.param_vars())
    assert logits.shape == (5, 10) and logits.dtype == "float32"


@pytest.mark.parametrize(
    ("layers", "match"),
    [
        ([nn.Conv2D(4, 3), nn.PReLU(5)], r"'prelu1' \(PReLU\(5\)\).*5 slopes need 5 channels on axis 1"),
        ([nn.Conv2D(4, 30)], r"'conv1'.*does not fit"),
        ([nn.Flatten(), nn.Conv2D(4, 3)], r"Conv2D needs \(channels, height, width\)"),
        ([nn.MaxPool2D(40)], r"pool does not fit"),
    ],
)
def test_shape_errors_name_the_layer(layers: list[nn.Layer], match: str) -> None:
    with pytest.raises(ShapeError, match=match):
        nn.Sequential(layers, input_shape=(1, 28, 28))


def test_bad_layer_arguments() -> None:
    with pytest.raises(ValueError, match="units"):
        nn.Dense(0)
    with pytest.raises(ValueError, match="activation"):
        nn.Conv2D(4, 3, activation="swish")
    with pytest.raises(ValueError, match="rate"):
        nn.Dropout(1.0)
    with pytest.raises(ValueError, match="same"):
        nn.Conv2D(4, 2, padding="full")
    with pytest.raises(ValueError, match="unique"):
        nn.Sequential([nn.ReLU(name="a"), nn.ReLU(name="a")], input_shape=(3,))
    with pytest.raises(ValueError, match="initializer"):
        nn.Dense(3, kernel_initializer="nope")


@pytest.mark.parametrize(("make", "match"), [
    (lambda: nn.Dense(2.5), "Dense units must be an int, got 2.5"),
    (lambda: nn.Conv2D(4.7, 3), "Conv2D filters must be an int"),
    (lambda: nn.Conv2D(4, 2.5), "Conv2D kernel_size must be an int or two ints, got 2.5"),
    (lambda: nn.Conv2D(4, 3, strides=1.5), "Conv2D strides"),
    (lambda: nn.Conv2D(4, 3, dilation_rate=(1, 2.0)), "Conv2D dilation_rate"),
    (lambda: nn.Conv2D(4, 3, padding=(1, 2, 3)), "Conv2D padding"),
    (lambda: nn.Conv2D(4, 3, groups=2.0), "Conv2D groups"),
    (lambda: nn.MaxPool2D(2.5), "MaxPool2D pool_size"),
    (lambda: nn.AvgPool2D(2, strides=True), "AvgPool2D strides"),
    (lambda: nn.Embedding(10.5, 3), "Embedding input_dim must be an int"),
    (lambda: nn.Softmax(axis=1.5), "Softmax axis must be an int"),
    (lambda: nn.Reshape((2.5, 2)), "Reshape target_shape"),
    (lambda: nn.ZeroPadding2D(((1, 0.5), (0, 1))), "ZeroPadding2D padding"),
])
def test_sizes_must_be_whole_numbers(make: Callable[[], nn.Layer], match: str) -> None:
    """Keras and PyTorch refuse a layer size of 2.5; truncated to 2 it would build another model."""
    with pytest.raises(ValueError, match=re.escape(match)):
        make()
    assert nn.Conv2D(np.int64(4), (np.int64(3), 3)).kernel_size == (3, 3)  # numpy ints are ints


def test_summary_shows_each_axis_and_the_padding() -> None:
    inp = nn.Input((3, 20, 20))
    model = nn.Model(inp, [nn.Conv2D(4, 3, strides=(1, 2), dilation_rate=(2, 3), padding=1, name="a")(inp),
                           nn.MaxPool2D(3, strides=2, padding=1, name="b")(inp),
                           nn.Conv2D(4, 3, strides=2, padding="same", name="c")(inp)])
    text = model.summary()
    assert "'a' (Conv2D(4, 3x3, stride 1x2, dilation 2x3, pad 1))" in text
    assert "'b' (MaxPool2D(3x3, stride 2, pad 1))" in text
    assert "'c' (Conv2D(4, 3x3, stride 2, same))" in text


def test_forward_rejects_wrong_input_and_missing_params() -> None:
    model = nn.seed_cnn()
    with pytest.raises(ShapeError, match=r"expected \(batch, 1, 28, 28\)"):
        model.forward(opgrad.var("x", (2, 28, 28, 1)), model.param_vars())
    params = model.param_vars()
    del params["conv2.bias"]
    with pytest.raises(ValueError, match=r"conv2\.bias"):
        model.forward(opgrad.var("x", (2, 1, 28, 28)), params)


def test_layer_cannot_join_two_models_with_different_shapes() -> None:
    conv = nn.Conv2D(4, 3)
    nn.Sequential([conv], input_shape=(1, 28, 28))
    with pytest.raises(ValueError, match="already built"):
        nn.Sequential([conv], input_shape=(3, 28, 28))


def test_same_padding_and_strides() -> None:
    model = nn.Sequential([nn.Conv2D(8, 3, padding="same"), nn.Conv2D(8, 3, strides=2), nn.MaxPool2D(2, strides=1)],
                          input_shape=(1, 28, 28))
    assert model.output_shape == (8, 12, 12)
    x = opgrad.var("x", (2, 1, 28, 28))
    params = model.param_vars()
    fn = opgrad.function([x, *params.values()], model.forward(x, params))
    out = opgrad.evaluate(fn, np.ones((2, 1, 28, 28), np.float32), *model.init_params(0).values())
    assert out.shape == (2, 8, 12, 12)


# ----- initializers -----


def test_initializers_are_deterministic_and_per_parameter() -> None:
    a = nn.seed_cnn().init_params(seed=7)
    b = nn.seed_cnn().init_params(seed=7)
    c = nn.seed_cnn().init_params(seed=8)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
        assert a[name].dtype == np.float32
    assert not np.array_equal(a["conv2.weight"], c["conv2.weight"])
    # Seeded by name: conv1 of another model with the same first layer gets the same weights.
    k = nn.keras_mnist().init_params(seed=7)
    np.testing.assert_array_equal(a["conv1.weight"], k["conv1.weight"])
    np.testing.assert_array_equal(a["conv1.weight"],
                                  nn.glorot_uniform((32, 1, 3, 3), param_generator(7, "conv1.weight")))


def test_glorot_limits_and_zero_biases() -> None:
    params = nn.seed_cnn().init_params(seed=0, dtype="float64")
    for name, shape in nn.seed_cnn().param_shapes().items():
        value = params[name]
        assert value.shape == shape and value.dtype == np.float64
        if name.endswith("bias"):
            assert not value.any()
            continue
        fan_in, fan_out = compute_fans(shape)
        limit = np.sqrt(6.0 / (fan_in + fan_out))
        assert np.abs(value).max() <= limit
        assert np.abs(value).max() > 0.9 * limit  # actually spread over the range
        assert abs(value.mean()) < 0.1 * limit
    assert compute_fans((64, 32, 3, 3)) == (288, 576)
    assert compute_fans((10, 128)) == (128, 10)
    with pytest.raises(ValueError, match="seed"):
        param_generator(-1, "w")


# ----- optimizers: the graph update against plain numpy -----


def _run_optimizer(optimizer: nn.Optimizer, grads_seq: list[np.ndarray], p0: np.ndarray,
                   lrs: list[float]) -> np.ndarray:
    p = opgrad.var("p", p0.shape, "float64")
    g = opgrad.var("g", p0.shape, "float64")
    lr = opgrad.var("lr", (), "float64")
    state_vars = {n: opgrad.var(n, s, "float64") for n, s in optimizer.state_shapes({"p": p0.shape}).items()}
    new_p, new_s = optimizer.update({"p": p}, {"p": g}, state_vars, lr)
    fn = opgrad.function([p, g, lr, *state_vars.values()], [new_p["p"], *(new_s[n] for n in state_vars)])
    value, state = p0, optimizer.init_state({"p": p0})
    for grad, rate in zip(grads_seq, lrs):
        out = opgrad.evaluate(fn, value, grad, np.float64(rate), *(state[n] for n in state_vars))
        value, state = out[0], dict(zip(state_vars, out[1:]))
    return value


@pytest.fixture
def grads() -> tuple[np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(3)
    return rng.standard_normal((3, 4)), [rng.standard_normal((3, 4)) for _ in range(5)]


LRS = [0.1, 0.05, 0.2, 0.01, 0.1]


def test_sgd_matches_numpy(grads: tuple[np.ndarray, list[np.ndarray]]) -> None:
    p0, gs = grads
    expect = p0.copy()
    for g, lr in zip(gs, LRS):
        expect = expect - lr * g
    np.testing.assert_allclose(_run_optimizer(nn.SGD(), gs, p0, LRS), expect, rtol=1e-12)


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_matches_numpy(grads: tuple[np.ndarray, list[np.ndarray]], nesterov: bool) -> None:
    p0, gs = grads
    expect, v = p0.copy(), np.zeros_like(p0)
    for g, lr in zip(gs, LRS):
        v = 0.9 * v + g
        expect = expect - lr * (g + 0.9 * v if nesterov else v)
    got = _run_optimizer(nn.SGD(momentum=0.9, nesterov=nesterov), gs, p0, LRS)
    np.testing.assert_allclose(got, expect, rtol=1e-12)


def test_adam_matches_numpy(grads: tuple[np.ndarray, list[np.ndarray]]) -> None:
    p0, gs = grads
    b1, b2, eps = 0.8, 0.95, 1e-3
    expect, m, v = p0.copy(), np.zeros_like(p0), np.zeros_like(p0)
    for t, (g, lr) in enumerate(zip(gs, LRS), start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        expect = expect - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    got = _run_optimizer(nn.Adam(beta1=b1, beta2=b2, eps=eps), gs, p0, LRS)
    np.testing.assert_allclose(got, expect, rtol=1e-12)


def test_optimizer_arguments_and_names() -> None:
    with pytest.raises(ValueError, match="Nesterov"):
        nn.SGD(nesterov=True)
    with pytest.raises(ValueError, match="beta1"):
        nn.Adam(beta1=1.0)
    with pytest.raises(ValueError, match="unknown optimizer"):
        nn.make_optimizer("lion")
    shapes = nn.Adam().state_shapes({"w": (2, 3)})
    assert shapes == {"w/m": (2, 3), "w/v": (2, 3), "adam/beta1_power": (), "adam/beta2_power": ()}
    assert nn.SGD().state_shapes({"w": (2,)}) == {}


# ----- dropout -----


def test_dropout_mask_and_modes() -> None:
    layer = nn.Dropout(0.25)
    model = nn.Sequential([layer], input_shape=(1000,))
    masks = model.sample_noise(np.random.default_rng(0), 4)
    mask = masks["dropout1"]
    assert mask.shape == (4, 1000) and mask.dtype == np.float32
    assert set(np.unique(mask)) == {0.0, np.float32(1 / 0.75)}
    assert abs((mask == 0).mean() - 0.25) < 0.03
    x = opgrad.var("x", (4, 1000))
    m = opgrad.var("m", (4, 1000))
    train = opgrad.function([x, m], model.forward(x, {}, nn.ForwardContext(training=True, noise={"dropout1": m})))
    data = np.ones((4, 1000), np.float32)
    np.testing.assert_array_equal(opgrad.evaluate(train, data, mask), mask)
    assert model.forward(x, {}) is x  # evaluation: identity
    with pytest.raises(ValueError, match="no mask"):
        model.forward(x, {}, nn.ForwardContext(training=True))


# ----- the float64 training step against an independent numpy seed CNN -----


def _np_conv(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    _, _, h, wd = x.shape
    _, _, kh, kw = w.shape
    oh, ow = h - kh + 1, wd - kw + 1
    out = np.zeros((x.shape[0], w.shape[0], oh, ow))
    for i in range(kh):
        for j in range(kw):
            out += np.einsum("nchw,oc->nohw", x[:, :, i : i + oh, j : j + ow], w[:, :, i, j])
    return out


def _np_conv_backward(x: np.ndarray, w: np.ndarray, dy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    _, _, kh, kw = w.shape
    oh, ow = dy.shape[2:]
    dx, dw = np.zeros_like(x), np.zeros_like(w)
    for i in range(kh):
        for j in range(kw):
            dx[:, :, i : i + oh, j : j + ow] += np.einsum("nohw,oc->nchw", dy, w[:, :, i, j])
            dw[:, :, i, j] = np.einsum("nohw,nchw->oc", dy, x[:, :, i : i + oh, j : j + ow])
    return dx, dw


def _np_seed_cnn_sgd_step(p: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray,
                          lr: float) -> tuple[float, dict[str, np.ndarray]]:
    n = x.shape[0]
    z1 = _np_conv(x, p["conv1.weight"]) + p["conv1.bias"][None, :, None, None]
    a1 = np.maximum(z1, 0)
    z2 = _np_conv(a1, p["conv2.weight"]) + p["conv2.bias"][None, :, None, None]
    a2 = np.maximum(z2, 0)
    pooled = a2.reshape(n, 64, 12, 2, 12, 2).mean(axis=(3, 5))
    z3 = _np_conv(pooled, p["conv3.weight"]) + p["conv3.bias"][None, :, None, None]
    a3 = np.maximum(z3, 0).reshape(n, 128)
    logits = a3 @ p["dense1.weight"].T + p["dense1.bias"]
    shifted = logits - logits.max(axis=1, keepdims=True)
    probs = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
    loss = -np.mean(np.log(probs[np.arange(n), y]))
    # backward
    dlogits = probs.copy()
    dlogits[np.arange(n), y] -= 1.0
    dlogits /= n
    g = {"dense1.weight": dlogits.T @ a3, "dense1.bias": dlogits.sum(0)}
    dz3 = (dlogits @ p["dense1.weight"]).reshape(n, 128, 1, 1) * (z3 > 0)
    g["conv3.bias"] = dz3.sum(axis=(0, 2, 3))
    dpooled, g["conv3.weight"] = _np_conv_backward(pooled, p["conv3.weight"], dz3)
    da2 = np.repeat(np.repeat(dpooled, 2, axis=2), 2, axis=3) / 4.0
    dz2 = da2 * (z2 > 0)
    g["conv2.bias"] = dz2.sum(axis=(0, 2, 3))
    da1, g["conv2.weight"] = _np_conv_backward(a1, p["conv2.weight"], dz2)
    dz1 = da1 * (z1 > 0)
    g["conv1.bias"] = dz1.sum(axis=(0, 2, 3))
    _, g["conv1.weight"] = _np_conv_backward(x, p["conv1.weight"], dz1)
    return float(loss), {k: p[k] - lr * g[k] for k in p}


def test_float64_reference_step_equals_independent_numpy_seed_cnn() -> None:
    model = nn.seed_cnn()
    rng = np.random.default_rng(11)
    params = model.init_params(seed=3, dtype="float64")
    # Non-zero biases so their gradients and broadcasting are exercised from the first step.
    params = {k: v + 0.05 * rng.standard_normal(v.shape) if k.endswith("bias") else v for k, v in params.items()}
    step = nn.TrainStep(model, nn.SGD(), batch_size=4, dtype="float64", backend="reference")
    expect = dict(params)
    got, state = dict(params), {}
    for _ in range(3):
        x = rng.random((4, 1, 28, 28))
        y = rng.integers(0, 10, 4)
        expect_loss, expect = _np_seed_cnn_sgd_step(expect, x, y, lr=0.1)
        result = step(x, y, got, state, lr=0.1)
        got, state = result.params, result.state
        assert result.loss == pytest.approx(expect_loss, rel=1e-12)
        for name in expect:
            np.testing.assert_allclose(got[name], expect[name], rtol=1e-9, atol=1e-12, err_msg=name)
    assert not np.allclose(got["conv1.weight"], params["conv1.weight"])  # it did train


@pytest.mark.parametrize("backend", ["reference", "llvm"])
def test_train_step_names_every_missing_parameter(backend: str) -> None:
    model = nn.Sequential([nn.Conv2D(4, 3), nn.Flatten(), nn.Dense(3)], input_shape=(1, 6, 6))
    step = nn.TrainStep(model, nn.SGD(momentum=0.9), batch_size=2, backend=backend)
    params = {k: v for k, v in model.params.items() if k != "conv1.weight"}
    state = nn.SGD(momentum=0.9).init_state(model.params)
    del state[next(iter(state))]
    x, y = np.zeros((2, 1, 6, 6), np.float32), np.zeros(2, np.int64)
    with pytest.raises(ValueError, match=r"missing: parameter conv1\.weight, state "):
        step(x, y, params, state, 0.1)
    with pytest.raises(ValueError, match=r"missing: parameter conv1\.weight"):
        step.run_steps(x, y, params, state, 0.1)
