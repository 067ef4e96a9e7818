"""Frozen layers (``layer.trainable = False``): training leaves their weights, as PyTorch's
``requires_grad_(False)`` and Keras' ``trainable`` do, on every path that trains a model."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from optional import require
from trainers import assert_split_trains_as_plain

from opgrad import nn
from opgrad.checkpoint import load_checkpoint

torch = require("torch", "the frozen-layer training is compared with PyTorch's")

BACKENDS = ["reference", "llvm"]


def small_cnn(name: str = "model") -> nn.Model:
    inp = nn.Input((3, 8, 8))
    x = nn.Conv2D(4, 3, padding=1, name="conv")(inp)
    x = nn.BatchNorm2D(name="bn")(x)
    x = nn.ReLU()(x)
    x = nn.Flatten(name="flatten")(x)
    x = nn.Dense(6, activation="relu", name="hidden")(x)
    return nn.Model(inp, nn.Dense(5, name="head")(x), name=name)


def with_statistics(model: nn.Model, seed: int = 1) -> nn.Model:
    rng = np.random.default_rng(seed)
    model.params = {k: v.astype(np.float64) for k, v in model.params.items()}
    model.buffers = {"bn.running_mean": rng.normal(size=4), "bn.running_var": rng.uniform(0.5, 2.0, 4)}
    return model


def torch_twin(model: nn.Model) -> Any:
    """The PyTorch module of :func:`small_cnn` holding ``model``'s weights and statistics."""
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                              torch.nn.Flatten(), torch.nn.Linear(256, 6), torch.nn.ReLU(),
                              torch.nn.Linear(6, 5)).double()
    p, b = model.params, model.buffers
    with torch.no_grad():
        for i, layer in ((0, "conv"), (1, "bn"), (4, "hidden"), (6, "head")):
            net[i].weight.copy_(torch.tensor(p[f"{layer}.weight"]))
            net[i].bias.copy_(torch.tensor(p[f"{layer}.bias"]))
        net[1].running_mean.copy_(torch.tensor(b["bn.running_mean"]))
        net[1].running_var.copy_(torch.tensor(b["bn.running_var"]))
    return net


@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_layers_train_as_pytorch_requires_grad_false(backend: str) -> None:
    """Conv and BatchNorm frozen, AdamW with weight decay: the losses and the trained weights are
    PyTorch's with those parameters' requires_grad off and the BatchNorm in eval mode; the frozen
    weights and running statistics come out bitwise as they went in, with no optimizer state."""
    model = with_statistics(small_cnn())
    for name in ("conv", "bn"):
        model.get_layer(name).trainable = False
    assert model.trainable_param_names() == ["hidden.weight", "hidden.bias", "head.weight", "head.bias"]
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(6, 3, 8, 8)), rng.integers(0, 5, 6)
    optimizer = nn.AdamW(weight_decay=0.1)
    step = nn.TrainStep(model, optimizer, batch_size=6, dtype="float64", backend=backend)
    assert step.state_names == ("hidden.weight/m", "hidden.weight/v", "hidden.bias/m", "hidden.bias/v",
                                "head.weight/m", "head.weight/v", "head.bias/m", "head.bias/v",
                                "adamw/beta1_power", "adamw/beta2_power", "bn.running_mean", "bn.running_var")
    params = dict(model.params)
    state = {**optimizer.init_state({n: params[n] for n in model.trainable_param_names()}), **model.buffers}
    losses = []
    for _ in range(3):
        result = step(x, y, params, state, lr=0.05)
        losses.append(result.loss)
        params, state = result.params, result.state

    net = torch_twin(model)
    for p in [*net[0].parameters(), *net[1].parameters()]:
        p.requires_grad_(False)
    net.train()
    net[1].eval()
    torch_opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=0.05, weight_decay=0.1)
    torch_losses = []
    for _ in range(3):
        torch_opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(torch.tensor(x)), torch.tensor(y))
        loss.backward()
        torch_opt.step()
        torch_losses.append(loss.item())
    np.testing.assert_allclose(losses, torch_losses, rtol=1e-12)
    np.testing.assert_allclose(params["head.weight"], net[6].weight.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(params["hidden.weight"], net[4].weight.detach().numpy(), rtol=1e-10, atol=1e-12)
    for name in ("conv.weight", "conv.bias", "bn.weight", "bn.bias"):
        np.testing.assert_array_equal(params[name], model.params[name])
    for name in ("bn.running_mean", "bn.running_var"):
        np.testing.assert_array_equal(state[name], model.buffers[name])
    assert not (params["head.weight"] == model.params["head.weight"]).any()


def test_run_steps_and_donated_steps_keep_frozen_weights() -> None:
    """The compiled multi-step loop and the in-place step carry a frozen parameter unchanged and
    compute the single steps' numbers."""
    model = small_cnn()
    model.get_layer("hidden").trainable = False
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(12, 3, 8, 8)).astype(np.float32), rng.integers(0, 5, 12)
    optimizer = nn.SGD(momentum=0.9)
    step = nn.TrainStep(model, optimizer, batch_size=4, backend="llvm")
    start = {**optimizer.init_state({n: model.params[n] for n in model.trainable_param_names()}), **model.buffers}
    looped = step.run_steps(x, y, model.params, start, 0.1)
    params, state = dict(model.params), dict(start)
    for i in range(3):
        donated = {k: v.copy() for k, v in params.items()}
        result = step(x[4 * i: 4 * i + 4], y[4 * i: 4 * i + 4], donated, {k: v.copy() for k, v in state.items()},
                      0.1, donate=True)
        params, state = result.params, result.state
        assert result.loss == looped.losses[i]
    for name, value in looped.params.items():
        np.testing.assert_array_equal(value, params[name])
    np.testing.assert_array_equal(looped.params["hidden.weight"], model.params["hidden.weight"])
    assert not np.array_equal(looped.params["conv.weight"], model.params["conv.weight"])


def test_trainer_follows_freezing_and_unfreezing() -> None:
    """A Trainer keeps frozen weights through its epochs, rebuilds its step when a layer is unfrozen
    (the layer's fresh optimizer state added) and then trains it."""
    model = small_cnn()
    model.trainable = False
    model.get_layer("head").trainable = True
    rng = np.random.default_rng(4)
    x, y = rng.random((16, 3, 8, 8), dtype=np.float32), rng.integers(0, 5, 16)
    trainer = nn.Trainer(model, nn.Adam(), lr=1e-2, batch_size=8, backend="llvm")
    before = {k: v.copy() for k, v in model.params.items()}
    statistics = {k: v.copy() for k, v in model.buffers.items()}
    trainer.train_epoch(x, y)
    assert sorted(k for k in trainer.state if k.endswith("/m")) == ["head.bias/m", "head.weight/m"]
    for name, value in model.params.items():
        assert np.array_equal(value, before[name]) == (not name.startswith("head."))
    for name, value in model.buffers.items():
        np.testing.assert_array_equal(value, statistics[name])

    model.get_layer("hidden").trainable = True
    hidden = model.params["hidden.weight"].copy()
    trainer.train_epoch(x, y)
    assert {"hidden.weight/m", "hidden.weight/v"} <= set(trainer.state)
    assert not np.array_equal(model.params["hidden.weight"], hidden)
    np.testing.assert_array_equal(model.params["conv.weight"], before["conv.weight"])


def test_every_layer_frozen_is_an_error_naming_the_model() -> None:
    model = small_cnn("frozen")
    model.trainable = False
    assert not model.trainable and model.trainable_param_names() == []
    with pytest.raises(ValueError, match=r"TrainStep: model 'frozen' has every layer frozen \(trainable=False\), so "
                                         r"training would change nothing"):
        nn.TrainStep(model, nn.SGD(), batch_size=2)
    with pytest.raises(TypeError, match=r"layer 'conv' \(Conv2D.*\): trainable takes True or False, got 'no'"):
        model.get_layer("conv").trainable = "no"  # type: ignore[assignment]


def test_the_flag_is_saved_with_the_model_and_shown(tmp_path: Path) -> None:
    model = small_cnn()
    model.get_layer("conv").trainable = False
    text = str(model)
    assert "112 frozen" in text and "(112 frozen)" in text
    model.save(tmp_path / "m.npz")
    loaded = nn.load(tmp_path / "m.npz")
    assert not loaded.get_layer("conv").trainable and loaded.get_layer("bn").trainable
    assert loaded.trainable_param_names() == model.trainable_param_names()
    _, meta = load_checkpoint(tmp_path / "m.npz")
    entries = {entry["name"]: entry for entry in meta["architecture"]["layers"]}
    assert entries["conv"]["trainable"] is False and "trainable" not in entries["bn"]


def test_gradient_step_and_one_rank_split_trainer_with_a_frozen_layer() -> None:
    """The data-parallel halves take gradients of the trainable parameters only, and a split
    one-rank DistributedTrainer trains a partly frozen model bitwise as the plain Trainer."""
    from opgrad.distributed import DistributedTrainer

    model = small_cnn()
    model.get_layer("conv").trainable = False
    rng = np.random.default_rng(5)
    x, y = rng.random((6, 3, 8, 8), dtype=np.float32), rng.integers(0, 5, 6)
    result = nn.GradientStep(model, batch_size=6)(x, y, model.params, model.buffers)
    assert set(result.grads) == set(model.trainable_param_names())

    def frozen_model() -> nn.Model:
        net = small_cnn()
        net.get_layer("conv").trainable = False
        net.get_layer("bn").trainable = False
        return net

    options: dict[str, Any] = {"lr": 0.05, "batch_size": 3, "backend": "reference"}
    plain = nn.Trainer(frozen_model(), nn.Adam(), **options)
    split = DistributedTrainer(frozen_model(), nn.Adam(), **options, fused_when_alone=False)
    conv = plain.params["conv.weight"].copy()
    assert_split_trains_as_plain(plain, split, x, y)
    np.testing.assert_array_equal(split.params["conv.weight"], conv)


def test_layer_output_and_get_layer_build_a_head_on_a_frozen_base(tmp_path: Path) -> None:
    """The fine-tuning recipe of docs/models.md: a saved model's layers frozen, a new head on the
    tensor before its old one."""
    small_cnn("digits").save(tmp_path / "digits.npz")
    base = nn.load(tmp_path / "digits.npz")
    base.trainable = False
    head = nn.Dense(2, name="new_head")(base.get_layer("hidden").output)
    model = nn.Model(base.inputs, head)
    assert model.trainable_param_names() == ["new_head.weight", "new_head.bias"]
    rng = np.random.default_rng(6)
    x, y = rng.random((8, 3, 8, 8), dtype=np.float32), rng.integers(0, 2, 8)
    trainer = nn.Trainer(model, nn.SGD(), lr=0.1, batch_size=8)
    trainer.train_batch(x, y)
    assert set(model.params) == set(base.params) - {"head.weight", "head.bias"} | {"new_head.weight", "new_head.bias"}
    for name, value in model.params.items():
        if name in base.params:
            np.testing.assert_array_equal(value, base.params[name])
    with pytest.raises(KeyError, match=r"model 'digits' has no layer 'dense9'; its layers: conv, bn"):
        base.get_layer("dense9")
    shared = nn.Dense(3, name="twice")
    inp = nn.Input((3,))
    shared(shared(inp))
    with pytest.raises(ValueError, match=r"layer 'twice' \(Dense\(3\)\) has been called 2 times"):
        _ = shared.output


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Keras' own numpy 2 deprecations
def test_keras_frozen_layers_import_frozen_and_train_as_keras(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Keras model with a frozen Conv2D and BatchNormalization, fitted with SGD in Keras and
    imported before that fit into opgrad and trained on the same batches: the same weights."""
    monkeypatch.setenv("KERAS_BACKEND", os.environ.get("KERAS_BACKEND", "torch"))
    require("h5py", "opgrad.keras reads Keras files' HDF5 weights with h5py")
    keras = require("keras", "the Keras fit is the reference")
    from opgrad.keras import load

    keras.utils.set_random_seed(0)
    inp = keras.Input((6, 6, 2))
    x = keras.layers.Conv2D(3, 3, name="conv")(inp)
    x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.Activation("relu")(x)
    x = keras.layers.Flatten()(x)
    keras_model = keras.Model(inp, keras.layers.Dense(4, name="head")(x))
    rng = np.random.default_rng(7)
    bn = keras_model.get_layer("bn")
    bn.set_weights([rng.uniform(0.5, 1.5, 3), rng.normal(size=3), rng.normal(size=3), rng.uniform(0.5, 2, 3)])
    keras_model.get_layer("conv").trainable = False
    bn.trainable = False
    keras_model.save(tmp_path / "frozen.keras")
    model = load(tmp_path / "frozen.keras", layout="NHWC")
    assert model.trainable_param_names() == ["head.weight", "head.bias"]

    images = rng.standard_normal((8, 6, 6, 2)).astype(np.float32)
    labels = rng.integers(0, 4, 8)
    keras_model.compile(optimizer=keras.optimizers.SGD(0.1),
                        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    keras_model.fit(images, labels, batch_size=4, epochs=1, shuffle=False, verbose=0)
    step = nn.TrainStep(model, nn.SGD(), batch_size=4, backend="llvm")
    params, state = dict(model.params), dict(model.buffers)
    for i in (0, 4):
        result = step(images[i: i + 4], labels[i: i + 4], params, state, 0.1)
        params, state = result.params, result.state
    bias = keras_model.get_layer("head").get_weights()[1]
    np.testing.assert_allclose(params["head.bias"], bias, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(model.predict(images, backend="reference"), model.predict(images), atol=1e-6)
    for name in ("conv.weight", "bn.weight", "bn.bias"):
        np.testing.assert_array_equal(params[name], model.params[name])
    for name, value in state.items():
        np.testing.assert_array_equal(value, model.buffers[name])
    model.params = params
    np.testing.assert_allclose(model.predict(images, backend="reference"),
                               np.asarray(keras_model.predict(images, verbose=0)), rtol=1e-4, atol=1e-5)


def test_models_doc_fine_tuning_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/models.md's fine-tuning block, executed as written: the head trains first, then the
    unfrozen layer too, and the frozen convolution never."""
    text = (Path(__file__).parents[1] / "docs" / "models.md").read_text()
    code = text.split("## Freezing layers", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {}
    exec(compile(code, "docs/models.md", "exec"), namespace)
    model, base = namespace["model"], namespace["base"]
    assert model.trainable_param_names() == ["features.weight", "features.bias", "parity.weight", "parity.bias"]
    saved = nn.load(tmp_path / "digits.npz")
    np.testing.assert_array_equal(model.params["conv1.weight"], saved.params["conv1.weight"])
    assert not np.array_equal(model.params["features.weight"], saved.params["features.weight"])
    assert base.get_layer("conv1") is model.get_layer("conv1")


def test_a_layer_frozen_and_unfrozen_keeps_its_momentum_as_pytorch() -> None:
    """Trainer: two steps, 'hidden' frozen for one, then trained again: its momentum buffer waits
    through the frozen step, as torch.optim.SGD keeps a parameter's buffer while its grad is None."""
    model = small_cnn()
    model.params = {k: v.astype(np.float64) for k, v in model.params.items()}
    net = torch_twin(with_statistics(model))
    rng = np.random.default_rng(8)
    x, y = rng.normal(size=(6, 3, 8, 8)), rng.integers(0, 5, 6)
    trainer = nn.Trainer(model, nn.SGD(momentum=0.9), lr=0.05, batch_size=6, dtype="float64")
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    net.train()
    for frozen in (False, False, True, False):
        model.get_layer("hidden").trainable = not frozen
        for p in net[4].parameters():
            p.requires_grad_(not frozen)
        trainer.train_batch(x, y)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(net(torch.tensor(x)), torch.tensor(y)).backward()
        optimizer.step()
    np.testing.assert_allclose(model.params["hidden.weight"], net[4].weight.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(model.params["conv.weight"], net[0].weight.detach().numpy(), rtol=1e-10, atol=1e-12)


def test_resuming_with_other_frozen_layers_names_the_layer(tmp_path: Path) -> None:
    model = small_cnn("frozen")
    model.get_layer("conv").trainable = False
    trainer = nn.Trainer(model, nn.SGD(), batch_size=2)
    arrays, meta = trainer.checkpoint()
    other = nn.Trainer(small_cnn("frozen"), nn.SGD(), batch_size=2)
    with pytest.raises(ValueError, match=r"checkpoint has layer 'conv' frozen and model 'frozen' has it trainable: set "
                                         r"layer\.trainable = False to resume"):
        other.restore(arrays, meta)
