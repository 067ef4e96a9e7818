"""LSTM and GRU against PyTorch's nn.LSTM / nn.GRU (batch_first): outputs, the loss and every
gradient through time, training steps, both backends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from optional import require
from trainers import steps_against_torch

from opgrad import nn
from opgrad.errors import ShapeError

torch = require("torch", "the recurrent layers are compared with PyTorch's")

LAYERS = {"LSTM": (nn.LSTM, "LSTM"), "GRU": (nn.GRU, "GRU")}


def twins(kind: str, return_sequences: bool, length: int = 5, bidirectional: bool = False) -> tuple[nn.Model, Any, Any]:
    """An opgrad model (recurrent layer, then a Dense head) in float64, and PyTorch's recurrent
    module and head holding its weights."""
    layer_class, torch_name = LAYERS[kind]
    inp = nn.Input((length, 3))
    seq = layer_class(4, return_sequences=return_sequences, bidirectional=bidirectional, name="rnn")(inp)
    model = nn.Model(inp, nn.Dense(2, name="head")(nn.Flatten()(seq) if return_sequences else seq))
    model.params = {name: value.astype(np.float64) for name, value in model.params.items()}
    rnn = getattr(torch.nn, torch_name)(3, 4, batch_first=True, bidirectional=bidirectional).double()
    directions = 2 if bidirectional else 1
    head = torch.nn.Linear(4 * directions * (length if return_sequences else 1), 2).double()
    with torch.no_grad():
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            for suffix in ("", "_reverse")[:directions]:
                getattr(rnn, f"{name}_l0{suffix}").copy_(torch.tensor(model.params[f"rnn.{name}{suffix}"]))
        head.weight.copy_(torch.tensor(model.params["head.weight"]))
        head.bias.copy_(torch.tensor(model.params["head.bias"]))
    return model, rnn, head


def torch_logits(rnn: Any, head: Any, x: np.ndarray, return_sequences: bool) -> Any:
    output, last = rnn(torch.tensor(x))
    hidden = last[0] if isinstance(last, tuple) else last  # (directions, N, units)
    return head(output.reshape(len(x), -1) if return_sequences else torch.cat(list(hidden), dim=1))


@pytest.mark.parametrize("backend", ["reference", "llvm"])
@pytest.mark.parametrize("return_sequences", [False, True])
@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_outputs_loss_and_gradients_equal_pytorchs(kind: str, return_sequences: bool, backend: str) -> None:
    model, rnn, head = twins(kind, return_sequences)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, 5, 3)), rng.integers(0, 2, 4)
    logits = torch_logits(rnn, head, x, return_sequences)
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor(y))
    loss.backward()
    np.testing.assert_allclose(model.predict(x, backend=backend, batch_size=4), logits.detach().numpy(),
                               rtol=1e-12, atol=1e-14)
    result = nn.GradientStep(model, batch_size=4, dtype="float64", backend=backend)(x, y, model.params, {})
    assert result.loss == pytest.approx(loss.item(), rel=1e-13)
    for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
        np.testing.assert_allclose(result.grads[f"rnn.{name}"], getattr(rnn, f"{name}_l0").grad.numpy(),
                                   rtol=1e-11, atol=1e-14, err_msg=name)


@pytest.mark.parametrize("return_sequences", [False, True])
@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_bidirectional_equals_pytorchs(kind: str, return_sequences: bool) -> None:
    """bidirectional=True: a second set of parameters (PyTorch's _reverse) runs from the last
    position back, side by side with the forward one, forward first."""
    model, rnn, head = twins(kind, return_sequences, bidirectional=True)
    assert "rnn.weight_hh_reverse" in model.params
    rng = np.random.default_rng(4)
    x, y = rng.standard_normal((3, 5, 3)), rng.integers(0, 2, 3)
    logits = torch_logits(rnn, head, x, return_sequences)
    torch.nn.functional.cross_entropy(logits, torch.tensor(y)).backward()
    for backend in ("reference", "llvm"):
        np.testing.assert_allclose(model.predict(x, backend=backend, batch_size=3), logits.detach().numpy(),
                                   rtol=1e-12, atol=1e-14)
        grads = nn.GradientStep(model, batch_size=3, dtype="float64", backend=backend)(x, y, model.params, {}).grads
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            for suffix in ("", "_reverse"):
                want = getattr(rnn, f"{name}_l0{suffix}").grad.numpy()
                np.testing.assert_allclose(grads[f"rnn.{name}{suffix}"], want, rtol=1e-11, atol=1e-14,
                                           err_msg=name + suffix)


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_adam_steps_and_a_save_load_round_trip(kind: str, tmp_path: Path) -> None:
    """Three compiled Adam steps train as torch.optim.Adam does; the trained model saves, loads
    and predicts the same; the parameters are drawn as PyTorch draws them (uniform within
    1 / sqrt(units))."""
    model, rnn, head = twins(kind, return_sequences=False, length=6)
    assert all(np.abs(value).max() <= 0.5 for name, value in model.params.items() if name.startswith("rnn."))
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((8, 6, 3)), rng.integers(0, 2, 8)
    step = nn.TrainStep(model, nn.Adam(), batch_size=8, dtype="float64", backend="llvm")
    params, state = model.params, nn.Adam().init_state(model.params)
    optimizer = torch.optim.Adam([*rnn.parameters(), *head.parameters()], lr=0.01)
    params, state = steps_against_torch(
        step, x, y, params, state, 0.01,
        lambda: torch.nn.functional.cross_entropy(torch_logits(rnn, head, x, False), torch.tensor(y)), optimizer)
    np.testing.assert_allclose(params["rnn.weight_hh"], rnn.weight_hh_l0.detach().numpy(), rtol=1e-9, atol=1e-12)
    model.params = params
    model.save(tmp_path / "rnn.npz")
    loaded = nn.load(tmp_path / "rnn.npz")
    assert isinstance(loaded.get_layer("rnn"), LAYERS[kind][0])
    np.testing.assert_array_equal(loaded.predict(x, backend="reference"), model.predict(x, backend="reference"))


def test_shapes_and_mistakes_are_named() -> None:
    inp = nn.Input((9, 3))
    assert nn.LSTM(5, return_sequences=True)(inp).shape == (9, 5)
    assert nn.GRU(5)(inp).shape == (5,)
    with pytest.raises(ShapeError, match=r"layer 'lstm' \(LSTM\(5\)\): input shape \(3, 4, 4\) .*needs a sequence "
                                         r"\(length, features\)"):
        nn.LSTM(5, name="lstm")(nn.Input((3, 4, 4)))
    with pytest.raises(ValueError, match=r"GRU units must be >= 1, got 0"):
        nn.GRU(0)
    with pytest.raises(ValueError, match=r"LSTM return_sequences must be True or False, got 'yes'"):
        nn.LSTM(3, return_sequences="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_without_recurrent_bias_is_pytorchs_with_a_zero_one(kind: str) -> None:
    """recurrent_bias=False (Keras' LSTM has one bias per gate): PyTorch's layer with bias_hh = 0,
    in outputs and in the gradient of the one bias left."""
    layer_class, torch_name = LAYERS[kind]
    inp = nn.Input((4, 3))
    model = nn.Model(inp, layer_class(5, recurrent_bias=False, name="rnn")(inp))
    assert "rnn.bias_hh" not in model.params
    model.params = {name: value.astype(np.float64) for name, value in model.params.items()}
    rnn = getattr(torch.nn, torch_name)(3, 5, batch_first=True).double()
    with torch.no_grad():
        for name in ("weight_ih", "weight_hh", "bias_ih"):
            getattr(rnn, f"{name}_l0").copy_(torch.tensor(model.params[f"rnn.{name}"]))
        rnn.bias_hh_l0.zero_()
    x = np.random.default_rng(2).standard_normal((3, 4, 3))
    _, last = rnn(torch.tensor(x))
    hidden = (last[0] if isinstance(last, tuple) else last)[0]
    np.testing.assert_allclose(model.predict(x, backend="reference"), hidden.detach().numpy(), rtol=1e-12, atol=1e-14)
    targets = np.random.default_rng(3).standard_normal((3, 5))
    result = nn.GradientStep(model, batch_size=3, dtype="float64", loss="mse")(x, targets, model.params, {})
    torch.nn.functional.mse_loss(hidden, torch.tensor(targets)).backward()
    np.testing.assert_allclose(result.grads["rnn.bias_ih"], rnn.bias_ih_l0.grad.numpy(), rtol=1e-11, atol=1e-14)
