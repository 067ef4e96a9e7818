"""Training-step losses against torch.nn.functional: the loss and every gradient, both backends."""

from __future__ import annotations

import numpy as np
import pytest
from optional import require

from opgrad import nn
from opgrad.nn.gradstep import GradientStep

torch = require("torch", "the loss parity tests compare with torch.nn.functional (pip install torch==2.13.0)")
F = torch.nn.functional

TORCH_LOSSES = {
    "mse": F.mse_loss,
    "l1": F.l1_loss,
    "huber": F.huber_loss,
    "bce_with_logits": F.binary_cross_entropy_with_logits,
}


def _targets(loss: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    # bce takes probabilities; the others get targets 0..3 apart from the outputs, so huber's
    # quadratic and linear parts (delta 1) both occur.
    return rng.random(shape) if loss == "bce_with_logits" else 3.0 * rng.standard_normal(shape)


@pytest.mark.parametrize("backend", ["reference", "llvm"])
@pytest.mark.parametrize("loss", sorted(TORCH_LOSSES))
def test_a_regression_loss_and_its_gradients_equal_torchs(loss: str, backend: str) -> None:
    rng = np.random.default_rng(3)
    model = nn.Sequential([nn.Dense(6)], input_shape=(5,))
    params = model.init_params(0, "float64")
    step = GradientStep(model, batch_size=4, dtype="float64", backend=backend, loss=loss)
    x, t = rng.standard_normal((4, 5)), _targets(loss, (4, 6), rng)
    result = step(x, t, params, {})
    w = torch.tensor(params["dense1.weight"], requires_grad=True)
    b = torch.tensor(params["dense1.bias"], requires_grad=True)
    expected = TORCH_LOSSES[loss](torch.tensor(x) @ w.T + b, torch.tensor(t))
    expected.backward()
    np.testing.assert_allclose(result.loss, expected.item(), rtol=1e-12)
    np.testing.assert_allclose(result.grads["dense1.weight"], w.grad.numpy(), rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(result.grads["dense1.bias"], b.grad.numpy(), rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("backend", ["reference", "llvm"])
def test_an_image_output_trains_against_image_targets(backend: str) -> None:
    # An autoencoder's or a segmenter's output: targets of the output's shape, the mean over
    # every pixel; the step updates the weights as torch's SGD does.
    rng = np.random.default_rng(4)
    model = nn.Sequential([nn.Conv2D(2, 3, padding="same")], input_shape=(1, 6, 6))
    params = model.init_params(0)
    step = nn.TrainStep(model, nn.SGD(), batch_size=3, backend=backend, loss="mse")
    x = rng.standard_normal((3, 1, 6, 6)).astype(np.float32)
    t = rng.standard_normal((3, 2, 6, 6)).astype(np.float32)
    result = step(x, t, params, {}, 0.1)
    w = torch.tensor(params["conv1.weight"], requires_grad=True)
    b = torch.tensor(params["conv1.bias"], requires_grad=True)
    expected = F.mse_loss(F.conv2d(torch.tensor(x), w, b, padding=1), torch.tensor(t))
    expected.backward()
    np.testing.assert_allclose(result.loss, expected.item(), rtol=1e-5)
    np.testing.assert_allclose(result.params["conv1.weight"], (w - 0.1 * w.grad).detach().numpy(), rtol=1e-5,
                               atol=1e-6)


def test_each_output_takes_its_own_loss_and_weight() -> None:
    rng = np.random.default_rng(5)
    x = nn.Input((5,))
    h = nn.Dense(4, activation="tanh")(x)
    model = nn.Model(x, [nn.Dense(3, name="cls")(h), nn.Dense(2, name="reg")(h)])
    params = model.init_params(0, "float64")
    step = GradientStep(model, batch_size=4, dtype="float64", loss=["cross_entropy", "huber"],
                           loss_weights=[1.0, 0.5])
    images, classes, values = rng.standard_normal((4, 5)), np.array([0, 2, 1, 2]), 2 * rng.standard_normal((4, 2))
    result = step(images, [classes, values], params, {})
    t = {name: torch.tensor(value, requires_grad=True) for name, value in params.items()}
    hidden = torch.tanh(torch.tensor(images) @ t["dense1.weight"].T + t["dense1.bias"])
    expected = (F.cross_entropy(hidden @ t["cls.weight"].T + t["cls.bias"], torch.tensor(classes))
                + 0.5 * F.huber_loss(hidden @ t["reg.weight"].T + t["reg.bias"], torch.tensor(values)))
    expected.backward()
    np.testing.assert_allclose(result.loss, expected.item(), rtol=1e-12)
    for name, tensor in t.items():
        np.testing.assert_allclose(result.grads[name], tensor.grad.numpy(), rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("name, means", [("MSELoss", "mse"), ("mean_absolute_error", "l1"), ("Huber", "huber"),
                                         ("binary_crossentropy", "bce_with_logits"),
                                         ("sparse_categorical_crossentropy", "cross_entropy")])
def test_pytorch_and_keras_names_of_a_loss_are_taken(name: str, means: str) -> None:
    model = nn.Sequential([nn.Dense(3)], input_shape=(5,))
    assert nn.TrainStep(model, nn.SGD(), batch_size=2, loss=name).losses == [means]


def test_loss_mistakes_are_named() -> None:
    model = nn.Sequential([nn.Dense(3)], input_shape=(5,))
    with pytest.raises(ValueError, match=r"^TrainStep: unknown loss 'hinge'; expected one of cross_entropy, mse, l1, "
                                         r"huber, bce_with_logits"):
        nn.TrainStep(model, nn.SGD(), batch_size=2, loss="hinge")
    with pytest.raises(ValueError, match=r"^GradientStep: loss names 2 loss\(es\) but model .* has 1 output\(s\)"):
        GradientStep(model, batch_size=2, loss=["mse", "l1"])
    image_out = nn.Sequential([nn.Conv2D(2, 3, padding="same")], input_shape=(1, 6, 6))
    with pytest.raises(ValueError, match=r"needs class logits \(classes,\); for class scores, put a Flatten\(\).*"
                                         r"takes a loss against targets of its shape: loss='mse'"):
        nn.TrainStep(image_out, nn.SGD(), batch_size=2)


def test_run_steps_streams_float_targets_as_k_single_steps_do() -> None:
    rng = np.random.default_rng(6)
    model = nn.Sequential([nn.Dense(8, activation="relu"), nn.Dense(3)], input_shape=(5,))
    params = model.init_params(0)
    step = nn.TrainStep(model, nn.Adam(), batch_size=4, backend="llvm", loss="huber")
    state = nn.Adam().init_state(params)
    x = rng.standard_normal((12, 5)).astype(np.float32)
    t = (3 * rng.standard_normal((12, 3))).astype(np.float32)
    together = step.run_steps(x, t, params, state, 0.01)
    p, s, losses = params, state, []
    for i in range(3):
        one = step(x[4 * i: 4 * i + 4], t[4 * i: 4 * i + 4], p, s, 0.01)
        p, s = one.params, one.state
        losses.append(one.loss)
    np.testing.assert_array_equal(together.losses, np.float32(losses))
    for name in p:
        np.testing.assert_array_equal(together.params[name], p[name])
