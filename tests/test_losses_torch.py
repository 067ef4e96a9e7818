"""Training-step losses against torch.nn.functional: the loss and every gradient, both backends."""

from __future__ import annotations

import numpy as np
import pytest
from optional import require

from opgrad import errors as opgrad_errors
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


@pytest.mark.parametrize("backend", ["reference", "llvm"])
def test_bce_with_logits_at_logits_of_exactly_zero_has_torchs_gradient(backend: str) -> None:
    # A zero-initialized output layer (or any output whose receptive field is all zeros) starts at
    # logits of exactly 0, where the gradient is sigmoid(0) - t = 1/2 - t.
    model = nn.Sequential([nn.Dense(2, kernel_initializer="zeros")], input_shape=(3,))
    params = model.init_params(0, "float64")
    t = np.array([[0.0, 1.0], [1.0, 0.0], [0.3, 0.7], [1.0, 1.0]])
    result = GradientStep(model, batch_size=4, dtype="float64", backend=backend, loss="bce_with_logits")(
        np.ones((4, 3)), t, params, {})
    np.testing.assert_allclose(result.grads["dense1.bias"], (0.5 - t).mean(axis=0) / 2, rtol=1e-12)
    np.testing.assert_allclose(result.loss, np.log(2.0), rtol=1e-12)


@pytest.mark.parametrize("name, means", [("MSELoss", "mse"), ("mean_absolute_error", "l1"), ("Huber", "huber"),
                                         ("binary_crossentropy", "bce_with_logits"),
                                         ("sparse_categorical_crossentropy", "cross_entropy"),
                                         ("binary_cross_entropy_with_logits", "bce_with_logits"),
                                         ("SmoothL1Loss", "huber"), ("smooth_l1_loss", "huber"),
                                         ("MeanSquaredError", "mse"), ("Mean Squared-Error", "mse")])
def test_pytorch_and_keras_names_of_a_loss_are_taken(name: str, means: str) -> None:
    model = nn.Sequential([nn.Dense(3)], input_shape=(5,))
    assert nn.TrainStep(model, nn.SGD(), batch_size=2, loss=name).losses == [means]


def test_targets_are_checked_naming_the_output_and_its_loss() -> None:
    model = nn.Sequential([nn.Dense(1)], input_shape=(5,))
    step = nn.TrainStep(model, nn.SGD(), batch_size=4, loss="bce_with_logits")
    params, x = model.init_params(0), np.zeros((4, 5), np.float32)
    with pytest.raises(ValueError, match=r"^TrainStep: output 0 of model .* \(loss 'bce_with_logits'\) takes targets "
                                         r"of shape \(4, 1\) and dtype float32, got shape \(4,\); \(N,\) targets "
                                         r"become \(N, 1\) with y\[:, None\]$"):
        step(x, np.zeros(4, np.float32), params, {}, 0.1)
    with pytest.raises(ValueError, match=r"got dtype int64; targets of a loss other than cross-entropy are floats"):
        step(x, np.zeros((4, 1), np.int64), params, {}, 0.1)
    with pytest.raises(ValueError, match=r"in \[0, 1\] \(probabilities\); got values in 255.0..255.0: scale them"):
        step(x, np.full((4, 1), 255, np.float32), params, {}, 0.1)
    classifier = nn.TrainStep(nn.Sequential([nn.Dense(3)], input_shape=(5,)), nn.SGD(), batch_size=4)
    with pytest.raises(ValueError, match=r"takes class labels of shape \(4,\) and dtype int64, got dtype float32; "
                                         r"class indices are integers: a regression or a reconstruction takes "
                                         r"loss='mse'"):
        classifier(x, np.zeros(4, np.float32), model.init_params(0), {}, 0.1)
    with pytest.raises(ValueError, match=r"^TrainStep.run_steps: output 0 .* takes targets of shape \(8, 1\)"):
        step.run_steps(np.zeros((8, 5), np.float32), np.zeros((8, 2), np.float32), params, {}, 0.1)


def test_graph_losses_refuse_targets_that_would_broadcast() -> None:
    import opgrad

    prediction, target = opgrad.var("p", (5, 1), "float32"), opgrad.var("t", (5,), "float32")
    with pytest.raises(opgrad.ShapeError, match=r"^mse_loss: prediction of shape \(5, 1\) and target of shape "
                                                r"\(5,\) differ"):
        nn.mse_loss(prediction, target)


def test_loss_mistakes_are_named() -> None:
    model = nn.Sequential([nn.Dense(3)], input_shape=(5,))
    with pytest.raises(ValueError, match=r"^TrainStep: unknown loss 'hinge'; expected one of cross_entropy, mse, l1, "
                                         r"huber, bce_with_logits"):
        nn.TrainStep(model, nn.SGD(), batch_size=2, loss="hinge")
    with pytest.raises(ValueError, match=r"^GradientStep: loss names 2 loss\(es\) but model .* has 1 output\(s\)"):
        GradientStep(model, batch_size=2, loss=["mse", "l1"])
    with pytest.raises(TypeError, match=r"^TrainStep: loss must be a name .* got MSELoss MSELoss\(\)\. A loss object "
                                        r".* is given by its name: loss='mse'"):
        nn.TrainStep(model, nn.SGD(), batch_size=2, loss=torch.nn.MSELoss())
    with pytest.raises(TypeError, match=r"^TrainStep: loss is a dict; give one name for every output, or a list"):
        nn.TrainStep(model, nn.SGD(), batch_size=2, loss={"dense1": "mse"})
    with pytest.raises(ValueError, match=r"unknown loss 'BCELoss': it takes probabilities; leave the final sigmoid out "
                                         r"and use loss='bce_with_logits'"):
        nn.TrainStep(model, nn.SGD(), batch_size=2, loss="BCELoss")
    with pytest.raises(ValueError, match=r"output 0 is a sigmoid \(probabilities\), and loss 'bce_with_logits' "
                                         r"applies the sigmoid itself"):
        nn.TrainStep(nn.Sequential([nn.Dense(1, activation="sigmoid")], input_shape=(5,)), nn.SGD(), batch_size=2,
                     loss="binary_crossentropy")
    with pytest.raises(opgrad_errors.ShapeError, match=r"output 0 has one unit, and softmax cross-entropy over one "
                                                       r"class is 0 whatever the weights; a binary classifier takes "
                                                       r"loss='bce_with_logits'"):
        nn.TrainStep(nn.Sequential([nn.Dense(1)], input_shape=(5,)), nn.SGD(), batch_size=2)
    image_out = nn.Sequential([nn.Conv2D(2, 3, padding="same")], input_shape=(1, 6, 6))
    with pytest.raises(ValueError, match=r"needs class logits \(classes,\), or \(length, classes\) for a class per "
                                         r"position; for class scores, put a Flatten\(\).*"
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


def two_heads() -> nn.Model:
    """A classifier head and a regression head on one trunk."""
    inp = nn.Input((5,))
    trunk = nn.Dense(8, activation="tanh", name="trunk")(inp)
    return nn.Model(inp, [nn.Dense(3, name="digit")(trunk), nn.Dense(2, name="value")(trunk)], name="heads")


def test_trainer_trains_any_loss_as_its_steps_do() -> None:
    """Trainer with cross-entropy on one output and huber on the other, weighted: its epoch equals
    TrainStep over the epoch's batches bitwise, and evaluate_loss equals PyTorch's losses of the
    predictions."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((24, 5))
    classes, values = rng.integers(0, 3, 24), 3.0 * rng.standard_normal((24, 2))
    options = {"lr": 0.05, "batch_size": 8, "dtype": "float64", "loss": ["cross_entropy", "huber"],
               "loss_weights": [1.0, 0.5]}
    trainer = nn.Trainer(two_heads(), nn.Adam(), **options)
    twin = nn.Trainer(two_heads(), nn.Adam(), **options)
    step = nn.TrainStep(twin.model, nn.Adam(), batch_size=8, dtype="float64", loss=["cross_entropy", "huber"],
                        loss_weights=[1.0, 0.5])
    params, state = twin.params, twin.state
    batches = list(trainer.epoch_batches(x, [classes, values]))
    mean = trainer.train_epoch(x, [classes, values])
    losses = []
    for inputs, (c, v) in batches:
        result = step(inputs, [c, v], params, state, 0.05)
        losses.append(result.loss)
        params, state = result.params, result.state
    assert mean == np.mean(losses)
    for name, value in params.items():
        np.testing.assert_array_equal(trainer.params[name], value)
    digit, value = trainer.model.predict(x, backend="reference")
    want = (F.cross_entropy(torch.tensor(digit), torch.tensor(classes))
            + 0.5 * F.huber_loss(torch.tensor(value), torch.tensor(values))).item()
    assert trainer.evaluate_loss(x, [classes, values]) == pytest.approx(want, rel=1e-12)
    assert trainer.evaluate(x, [classes, values])[0] == np.mean(digit.argmax(axis=1) == classes)


@pytest.mark.parametrize("backend", ["reference", "llvm"])
def test_trainer_fits_an_autoencoder_and_a_sequence_labeller(backend: str) -> None:
    """mse against the input itself, integer pixels cast as targets; per-position cross-entropy
    with (N, length) labels; both lower their loss, and evaluate says what a regression needs."""
    rng = np.random.default_rng(6)
    images = rng.random((32, 1, 6, 6)).astype(np.float32)
    autoencoder = nn.Sequential([nn.Flatten(), nn.Dense(8, activation="relu"), nn.Dense(36),
                                 nn.Reshape((1, 6, 6))], input_shape=(1, 6, 6), name="ae")
    trainer = nn.Trainer(autoencoder, nn.Adam(), lr=1e-2, batch_size=8, backend=backend, loss="mse")
    before = trainer.evaluate_loss(images, images)
    for _ in range(10):
        trainer.train_epoch(images, images)
    assert trainer.evaluate_loss(images, images) < 0.5 * before
    with pytest.raises(ValueError, match=r"Trainer\.evaluate: accuracy needs a classifier, one class per example; "
                                         r"model 'ae' trains output 0 \(1, 6, 6\) with 'mse': use evaluate_loss"):
        trainer.evaluate(images, images)
    tokens = nn.Input((5,), dtype="int64")
    tagger = nn.Model(tokens, nn.Dense(4)(nn.Embedding(10, 6)(tokens)), name="tagger")
    ids = rng.integers(0, 10, (32, 5))
    tags = ids % 4
    tag_trainer = nn.Trainer(tagger, nn.Adam(), lr=5e-2, batch_size=8, backend=backend)
    first = tag_trainer.evaluate_loss(ids, tags)
    for _ in range(10):
        tag_trainer.train_epoch(ids, tags)
    assert tag_trainer.evaluate_loss(ids, tags) < 0.5 * first


def test_trainer_targets_are_checked_naming_the_output_and_loss() -> None:
    model = two_heads()
    trainer = nn.Trainer(model, nn.SGD(), batch_size=4, loss=["cross_entropy", "bce_with_logits"])
    x, c = np.zeros((4, 5)), np.zeros(4, np.int64)
    cases = [
        (np.zeros((4, 3)), r"targets have shape \(4, 3\), expected \(4, 2\) \(the output's shape, loss "
                           r"'bce_with_logits'\)"),
        (np.full((4, 2), np.nan), r"targets hold NaN or infinite values"),
        (np.full((4, 2), 2.0), r"targets of loss 'bce_with_logits' are probabilities in \[0, 1\]; got values in "
                               r"2\.0\.\.2\.0"),
        (np.zeros((4, 2), complex), r"targets have dtype complex128, expected real numbers"),
    ]
    for targets, message in cases:
        with pytest.raises(ValueError, match=r"Trainer\.train_epoch \(output 'value' \(Dense\(2\)\)\): " + message):
            trainer.train_epoch(x, [c, targets])
    trainer.train_epoch(x, [c, np.ones((4, 2), np.int64)])  # integer 0/1 targets are cast
    trainer.train_epoch(x, [c, np.ones((4, 2), bool)])  # and so are booleans (Keras takes them)
    arrays, meta = trainer.checkpoint()
    assert meta["losses"] == ["cross_entropy", "bce_with_logits"]
    other = nn.Trainer(model, nn.SGD(), batch_size=4, loss=["cross_entropy", "mse"])
    with pytest.raises(ValueError, match=r"checkpoint was trained with loss \['cross_entropy', 'bce_with_logits'\]; "
                                         r"resume it with the same losses"):
        other.restore(arrays, meta)


def test_one_rank_split_trainer_trains_a_regression_as_the_plain_one() -> None:
    from opgrad.distributed import DistributedTrainer

    rng = np.random.default_rng(7)
    x, t = rng.standard_normal((12, 5)), rng.standard_normal((12, 3))

    def regressor() -> nn.Model:
        return nn.Sequential([nn.Dense(4, activation="tanh"), nn.Dense(3)], input_shape=(5,), name="reg")

    options = {"lr": 0.05, "batch_size": 4, "loss": "l1"}
    plain = nn.Trainer(regressor(), nn.Adam(), **options)
    split = DistributedTrainer(regressor(), nn.Adam(), **options, fused_when_alone=False)
    for _ in range(2):
        assert plain.train_epoch(x, t) == split.train_epoch(x, t)
    for name in plain.params:
        np.testing.assert_array_equal(plain.params[name], split.params[name])
    assert plain.evaluate_loss(x, t) == split.evaluate_loss(x, t)
