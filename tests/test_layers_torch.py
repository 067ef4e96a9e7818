"""Activation and pooling layers against PyTorch's modules: forward and every gradient, on both
backends, and through a checkpoint; the Trainer's handling of labels and of a model's own weights.

PyTorch is a test-only dependency: without it this module is skipped locally, and fails under CI=true.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from optional import require

torch = require("torch", "the layers are compared with PyTorch's modules")

import opgrad  # noqa: E402
from opgrad import nn, ops  # noqa: E402

# name -> (opgrad layer, the same PyTorch module, input shape per example)
LAYERS: dict[str, tuple[Callable[[], nn.Layer], Callable[[], Any], tuple[int, ...]]] = {
    "silu": (nn.SiLU, lambda: torch.nn.SiLU(), (3, 5, 4)),
    "elu": (lambda: nn.ELU(0.7), lambda: torch.nn.ELU(0.7), (3, 5, 4)),
    "elu_negative_alpha": (lambda: nn.ELU(-0.5), lambda: torch.nn.ELU(-0.5), (3, 5, 4)),
    "softplus": (lambda: nn.Softplus(2.0, 3.0), lambda: torch.nn.Softplus(2.0, 3.0), (3, 5, 4)),
    "hardsigmoid": (nn.Hardsigmoid, lambda: torch.nn.Hardsigmoid(), (3, 5, 4)),
    "hardswish": (nn.Hardswish, lambda: torch.nn.Hardswish(), (3, 5, 4)),
    "prelu_per_channel": (lambda: nn.PReLU(3, 0.1), lambda: torch.nn.PReLU(3, 0.1), (3, 5, 4)),
    "prelu_shared": (nn.PReLU, lambda: torch.nn.PReLU(), (6,)),
    "dense_over_rows": (lambda: nn.Dense(4), lambda: torch.nn.Linear(5, 4), (2, 3, 5)),
    "maxpool_ceil": (lambda: nn.MaxPool2D(3, strides=2, padding=1, ceil_mode=True),
                     lambda: torch.nn.MaxPool2d(3, 2, 1, ceil_mode=True), (2, 8, 7)),
    "avgpool_ceil_excluding_pads": (
        lambda: nn.AvgPool2D(3, strides=2, padding=1, ceil_mode=True, count_include_pad=False),
        lambda: torch.nn.AvgPool2d(3, 2, 1, ceil_mode=True, count_include_pad=False), (2, 8, 7)),
    "avgpool_excluding_pads": (lambda: nn.AvgPool2D((2, 3), strides=1, padding=(1, 1), count_include_pad=False),
                               lambda: torch.nn.AvgPool2d((2, 3), 1, (1, 1), count_include_pad=False), (2, 5, 6)),
    "avgpool_ceil_counting_pads": (lambda: nn.AvgPool2D(2, padding=1, ceil_mode=True),
                                   lambda: torch.nn.AvgPool2d(2, 2, 1, ceil_mode=True), (1, 6, 5)),
    # Sequences (channels, length): text and time-series models.
    "conv1d_strided_dilated": (lambda: nn.Conv1D(6, 3, strides=2, padding=2, dilation_rate=2),
                               lambda: torch.nn.Conv1d(4, 6, 3, stride=2, padding=2, dilation=2), (4, 17)),
    "conv1d_grouped_same_even_kernel": (lambda: nn.Conv1D(6, 4, padding="same", groups=2),
                                        lambda: torch.nn.Conv1d(4, 6, 4, padding="same", groups=2), (4, 11)),
    "maxpool1d": (lambda: nn.MaxPool1D(3, strides=2, padding=1), lambda: torch.nn.MaxPool1d(3, 2, 1), (3, 10)),
    "avgpool1d_ceil": (lambda: nn.AvgPool1D(2, ceil_mode=True), lambda: torch.nn.AvgPool1d(2, ceil_mode=True),
                       (3, 9)),
}


def _model(name: str) -> tuple[nn.Model, Any, np.ndarray]:
    make_layer, make_module, shape = LAYERS[name]
    layer = make_layer()
    layer.name = "act"
    model = nn.Sequential([layer], input_shape=shape)
    module = make_module().double()
    params = {f"act.{key}": value.detach().numpy().astype(np.float64) for key, value in module.named_parameters()}
    model.params = params
    x = np.random.default_rng(5).standard_normal((2, *shape))
    x[0].flat[:4] = [0.0, -3.0, 3.0, 25.0]  # the kinks of hardsigmoid/hardswish, softplus' linear region
    return model, module, x


@pytest.mark.parametrize("name", LAYERS)
def test_layer_matches_pytorch_forward_and_gradients(name: str) -> None:
    model, module, x = _model(name)
    xt = torch.tensor(x, requires_grad=True)
    yt = module(xt)
    cotangent = np.random.default_rng(6).standard_normal(tuple(yt.shape))
    yt.backward(torch.tensor(cotangent))
    images = opgrad.var("x", x.shape, "float64")
    params = {k: opgrad.var(k, v.shape, "float64") for k, v in model.params.items()}
    out = model.forward(images, params)
    loss = ops.sum(ops.multiply(out, opgrad.const(cotangent)))
    outputs = opgrad.evaluate(opgrad.function([images, *params.values()], [out]), x, *model.params.values())
    y = outputs[0] if isinstance(outputs, tuple) else outputs
    grads = opgrad.evaluate(opgrad.grad(opgrad.function([images, *params.values()], loss), with_value=False),
                            x, *model.params.values())
    grads = grads if isinstance(grads, tuple) else (grads,)
    wrt = ["x", *params]
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-12, atol=1e-12)
    expected = {"x": xt.grad.numpy(), **{f"act.{k}": p.grad.numpy() for k, p in module.named_parameters()}}
    for key, value in zip(wrt, grads, strict=True):
        # PyTorch's double hardsigmoid/hardswish gradients scale by the float constant 1.0f / 6.0f.
        rtol = 1e-7 if name.startswith("hard") else 1e-10
        np.testing.assert_allclose(value, expected[key], rtol=rtol, atol=1e-12, err_msg=key)


@pytest.mark.parametrize("name", LAYERS)
def test_layer_compiles_and_checkpoints(name: str, tmp_path: Path) -> None:
    model, module, x = _model(name)
    model.params = {k: v.astype(np.float32) for k, v in model.params.items()}
    expected = module(torch.tensor(x)).detach().numpy()
    compiled = model.predict(x.astype(np.float32), backend="llvm")
    np.testing.assert_allclose(compiled, expected, rtol=1e-5, atol=1e-6)
    model.save(tmp_path / "model.npz")
    again = nn.load(tmp_path / "model.npz")
    assert [layer.get_config() for layer in again.layers] == [layer.get_config() for layer in model.layers]
    np.testing.assert_array_equal(again.predict(x.astype(np.float32), backend="llvm"), compiled)


def test_pool_layer_options_are_checked() -> None:
    with pytest.raises(ValueError, match="ceil_mode applies to 'valid' or explicit padding"):
        nn.MaxPool2D(2, padding="same", ceil_mode=True)
    with pytest.raises(ValueError, match="count_include_pad=True needs explicit padding"):
        nn.AvgPool2D(2, padding="same", count_include_pad=True)
    with pytest.raises(ValueError, match="ceil_mode must be True or False"):
        nn.AvgPool2D(2, ceil_mode=1)  # type: ignore[arg-type]
    assert "count_include_pad=False" in nn.AvgPool2D(3, padding=1, count_include_pad=False).config()


def _classifier() -> nn.Model:
    return nn.Sequential([nn.Dense(3, name="fc")], input_shape=(3,))


def test_evaluate_refuses_labels_pytorch_refuses() -> None:
    model = _classifier()
    trainer = nn.Trainer(model, nn.SGD(), lr=0.1, batch_size=2)
    x = np.eye(3, dtype=np.float32)[[0, 1, 2, 0]]
    trainer.evaluate(x, np.array([0, 1, 2, 1]))
    for labels, message in ((np.array([[0], [1], [2], [1]]), r"labels have shape \(4, 1\), expected \(4,\)"),
                            (np.array([0, 1, 2, -1]), r"labels must lie in 0..2 for 3 classes, got values in -1..2"),
                            (np.array([0, 1, 3, 1]), r"labels must lie in 0..2"),
                            (np.array([0.0, 1.0, 2.0, 1.0]), "labels have dtype float64, expected integer")):
        with pytest.raises(ValueError, match=message):
            trainer.evaluate(x, labels)
    with pytest.raises(ValueError, match="accuracy: labels have shape"):
        nn.accuracy(np.zeros((4, 3)), np.zeros((4, 1), np.int64))


def test_an_epoch_without_a_whole_batch_is_an_error() -> None:
    trainer = nn.Trainer(_classifier(), nn.SGD(), lr=0.1, batch_size=32)
    x, y = np.zeros((20, 3), np.float32), np.zeros(20, np.int64)
    with pytest.raises(ValueError, match="20 examples make no whole batch of 32"):
        trainer.train_epoch(x, y)


def test_trainer_trains_the_weights_a_model_holds() -> None:
    model = _classifier()
    fresh = nn.Trainer(model, nn.SGD(), lr=0.1, batch_size=2, seed=3)
    drawn = {k: v.copy() for k, v in fresh.params.items()}
    ported = {"fc.weight": np.eye(3, dtype=np.float32), "fc.bias": np.ones(3, np.float32)}
    model.params = ported
    trainer = nn.Trainer(model, nn.SGD(), lr=0.1, batch_size=2, seed=3)
    for key, value in ported.items():
        np.testing.assert_array_equal(trainer.params[key], value)
    assert not np.array_equal(drawn["fc.weight"], ported["fc.weight"])
    # A model never assigned weights still starts from the seed's draw.
    again = nn.Trainer(_classifier(), nn.SGD(), lr=0.1, batch_size=2, seed=3)
    for key, value in drawn.items():
        np.testing.assert_array_equal(again.params[key], value)


def test_a_classifier_scoring_rows_of_pixels_is_told_to_flatten() -> None:
    model = nn.Sequential([nn.Conv2D(4, 3), nn.Dense(10)], input_shape=(1, 8, 8))
    assert model.output_shape == (4, 6, 10)  # the Dense runs over each row of pixels, as PyTorch's Linear
    trainer = nn.Trainer(model, nn.SGD(), lr=0.1, batch_size=2)
    with pytest.raises(ValueError, match=r"output 0 has shape \(4, 6, 10\).*put a Flatten\(\) \(or a global pool\)"):
        trainer.train_batch(np.zeros((2, 1, 8, 8), np.float32), np.zeros(2, np.int64))


@pytest.mark.parametrize("backend", ["reference", "llvm"])
def test_hardswish_gradient_at_the_infinities_is_pytorchs(backend: str) -> None:
    x = np.array([[-np.inf, -4.0, -3.0, 3.0, 4.0, np.inf]])
    xt = torch.tensor(x, requires_grad=True)
    torch.nn.functional.hardswish(xt).sum().backward()
    images = opgrad.var("x", x.shape, "float64")
    fn = opgrad.grad(opgrad.function([images], ops.sum(nn.layers.hard_swish(images))), with_value=False)
    grad = opgrad.evaluate(fn, x) if backend == "reference" else opgrad.compile(fn)(x)
    np.testing.assert_array_equal(grad, xt.grad.numpy())


def test_a_float64_trainer_trains_float32_weights_the_model_holds() -> None:
    model = nn.Sequential([nn.Dense(4, name="fc"), nn.Dense(3, name="out")],
                          input_shape=(5,))
    model.params = {k: v.astype(np.float32) for k, v in model.init_params(1).items()}
    trainer = nn.Trainer(model, nn.SGD(), lr=0.1, batch_size=2, dtype="float64")
    assert all(v.dtype == np.float64 for v in trainer.params.values())
    trainer.train_batch(np.ones((2, 5)), np.array([0, 2]))
    assert model.predict(np.ones((2, 5))).shape == (2, 3)


def test_weights_read_from_a_model_are_the_ones_a_trainer_trains() -> None:
    model = _classifier()
    model.params["fc.bias"][:] = 5.0  # the lazily drawn weights, changed in place
    with pytest.warns(UserWarning, match=r"Trainer\(seed=7\): the model already holds weights"):
        trainer = nn.Trainer(model, nn.SGD(), lr=0.0, batch_size=2, seed=7)
    np.testing.assert_array_equal(trainer.params["fc.bias"], np.full(3, 5.0, np.float32))


def test_integer_arguments_of_generic_layers_are_not_truncated() -> None:
    with pytest.raises(ValueError, match=r"Pad pads must be an int, got 1\.5"):
        nn.Pad([(0, 0), (1.5, 1)])
    with pytest.raises(ValueError, match=r"Slice end must be an int, got 2\.9"):
        nn.Slice([0], [2.9])


def _two_heads() -> nn.Model:
    inp = nn.Input((6,))
    hidden = nn.Dense(8, activation="relu", name="hidden")(inp)
    return nn.Model(inp, [nn.Dense(10, name="digit")(hidden), nn.Dense(2, name="parity")(hidden)])


def test_a_trainer_takes_one_label_array_per_head() -> None:
    rng = np.random.default_rng(3)
    x, digits = rng.standard_normal((16, 6)).astype(np.float32), rng.integers(0, 10, 16)
    heads = [digits, digits % 2]
    trainer = nn.Trainer(_two_heads(), nn.SGD(), lr=0.1, batch_size=8, seed=1)
    start = {k: v.copy() for k, v in trainer.params.items()}
    step = nn.TrainStep(_two_heads(), nn.SGD(), batch_size=8)
    expected = step(x[:8], [digits[:8], digits[:8] % 2], start, {}, lr=0.1)
    assert trainer.train_batch(x[:8], [h[:8] for h in heads]) == expected.loss
    for key, value in expected.params.items():
        np.testing.assert_array_equal(trainer.params[key], value)
    # Two steps in one native call give the numbers of two calls; evaluation scores the first head.
    one, two = (nn.Trainer(_two_heads(), nn.SGD(), lr=0.1, batch_size=8, seed=1) for _ in range(2))
    assert one.train_epoch(x, heads) == two.train_epoch(x, heads, steps_per_call=2)
    accuracy, _ = one.evaluate(x, heads)
    assert accuracy == nn.accuracy(one.model.predict(x, backend="reference")[0], digits)


def test_a_multi_head_trainer_says_what_its_labels_are() -> None:
    trainer = nn.Trainer(_two_heads(), nn.Adam(), batch_size=4)
    x, digits = np.zeros((4, 6), np.float32), np.array([3, 4, 7, 8])
    with pytest.raises(TypeError, match="labels must be one array, which serves every output, or a list "
                                        "of 2"):
        trainer.train_batch(x, [digits])
    with pytest.raises(ValueError, match=r"\(output 'parity' \(Dense\(2\)\)\): labels must lie in 0..1 for 2 "
                                         r"classes, got values in 3..8"):
        trainer.train_batch(x, digits)
    with pytest.raises(ValueError, match=r"\(output 'parity' \(Dense\(2\)\)\): labels have shape \(3,\), expected"):
        trainer.train_batch(x, [digits, digits[:3] % 2])
    with pytest.raises(ValueError, match=r"Trainer\.evaluate: no examples"):
        trainer.evaluate(np.zeros((0, 6), np.float32), np.zeros(0, np.int64))


@pytest.mark.parametrize("backend", ["reference", "llvm"])
def test_a_sequence_model_trains_as_torchs(backend: str) -> None:
    # A text/time-series CNN: Conv1d, BatchNorm1d over (channels, length) in training mode (its
    # running statistics too), MaxPool1d, a strided Conv1d, a linear head; loss and every gradient.
    from opgrad.nn.gradstep import GradientStep

    model = nn.Sequential([nn.Conv1D(8, 5, padding="same", use_bias=False, name="c1"), nn.BatchNorm2D(name="bn"),
                           nn.ReLU(), nn.MaxPool1D(2, name="pool"), nn.Conv1D(6, 3, strides=2, name="c2"),
                           nn.Flatten(), nn.Dense(4, name="head")], input_shape=(3, 20))
    params = model.init_params(0, "float64")
    step = GradientStep(model, batch_size=5, dtype="float64", backend=backend)
    rng = np.random.default_rng(8)
    x, labels = rng.standard_normal((5, 3, 20)), np.array([0, 3, 1, 2, 3])
    result = step(x, labels, params, model.init_buffers("float64"))
    t = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    bn = torch.nn.BatchNorm1d(8).double()
    bn.weight, bn.bias = torch.nn.Parameter(t["bn.weight"]), torch.nn.Parameter(t["bn.bias"])
    h = torch.relu(bn(torch.nn.functional.conv1d(torch.tensor(x), t["c1.weight"], padding="same")))
    h = torch.nn.functional.conv1d(torch.nn.functional.max_pool1d(h, 2), t["c2.weight"], t["c2.bias"], stride=2)
    logits = h.flatten(1) @ t["head.weight"].T + t["head.bias"]
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor(labels))
    loss.backward()
    np.testing.assert_allclose(result.loss, loss.item(), rtol=1e-12)
    for name, tensor in t.items():
        grad = bn.weight.grad if name == "bn.weight" else bn.bias.grad if name == "bn.bias" else tensor.grad
        np.testing.assert_allclose(result.grads[name], grad.numpy(), rtol=1e-9, atol=1e-12, err_msg=name)
    np.testing.assert_allclose(result.buffers["bn.running_mean"], bn.running_mean.numpy(), rtol=1e-12)
    np.testing.assert_allclose(result.buffers["bn.running_var"], bn.running_var.numpy(), rtol=1e-12)


def test_sequence_layers_save_describe_and_refuse_channels_last(tmp_path: Path) -> None:
    model = nn.Sequential([nn.Conv1D(4, (3,), strides=2, padding=1), nn.MaxPool1D(2), nn.AvgPool1D(2, padding=1)],
                          input_shape=(2, 30))
    assert "Conv1D" in str(model) and "4, 3, stride 2, pad 1" in str(model)
    path = tmp_path / "seq.npz"
    model.save(path)
    again = nn.load_model(path)
    x = np.random.default_rng(9).standard_normal((2, 2, 30)).astype(np.float32)
    np.testing.assert_array_equal(again.predict(x, backend="reference"), model.predict(x, backend="reference"))
    assert "MaxPool1D(3, stride 1, pad 1, ceil_mode)" in str(nn.Sequential([nn.MaxPool1D(3, 1, 1, ceil_mode=True)],
                                                                           input_shape=(2, 9)))
    with pytest.raises(opgrad.ShapeError, match=r"input shape \(3, 2\) \(per example\): the 4 pool does not fit"):
        nn.Sequential([nn.MaxPool1D(4)], input_shape=(3, 2))
    with pytest.raises(opgrad.ShapeError, match=r"input shape \(4, 3\) \(per example\): the 5-wide kernel does not fit "
                                                r"the length 3"):
        nn.Sequential([nn.Conv1D(2, 5)], input_shape=(4, 3))
    with pytest.raises(opgrad.ShapeError, match=r"\(100, 3\) looks channels-last \(steps, channels\), Keras' "
                                                r"default: .* give \(3, 100\)"):
        nn.Sequential([nn.Conv1D(4, 5)], input_shape=(100, 3))

