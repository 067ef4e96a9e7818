"""Edges of the model API a new user meets: custom layer kinds, layers shared by several models,
the float type of assigned weights, batches of another size than the trainer's, an output listed
twice in an ONNX export, and PyTorch's arguments of BatchNorm2d (``momentum=None``) and
ConvTranspose2d (``output_padding`` below the dilation). Semantics are compared with PyTorch.

PyTorch is a test-only dependency: without it this module is skipped locally, and fails under CI=true.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from optional import require

torch = require("torch", "the layers are compared with PyTorch's modules")

import opgrad  # noqa: E402
from opgrad import nn, ops  # noqa: E402
from opgrad.errors import ShapeError  # noqa: E402


def _dense_model(layer: nn.Layer) -> nn.Model:
    inp = nn.Input((4,))
    return nn.Model(inp, layer(inp))


# ----- a layer kind belongs to one class -----


class ScaledDense(nn.Dense):
    """A subclass that changes the computation but keeps Dense's kind."""

    def apply(self, x: Any, params: Any, ctx: Any) -> Any:
        return ops.multiply(super().apply(x, params, ctx), 2.0)


class DoubledDense(nn.Dense):
    """The same with a kind of its own: saved and loaded as itself."""

    kind = "test_edges_doubled_dense"

    def apply(self, x: Any, params: Any, ctx: Any) -> Any:
        return ops.multiply(super().apply(x, params, ctx), 2.0)


def test_saving_a_subclass_without_its_own_kind_is_refused(tmp_path: Path) -> None:
    model = _dense_model(ScaledDense(3))
    expected = r"layer 'dense1' \(ScaledDense\(3\)\): its class ScaledDense has no kind of its own \(kind 'dense' " \
               r"is Dense's\).*give ScaledDense its own kind"
    with pytest.raises(TypeError, match=expected):
        model.save(tmp_path / "model.npz")
    assert not (tmp_path / "model.npz").exists()
    with pytest.raises(TypeError, match=expected):
        nn.Trainer(model, nn.SGD(), batch_size=2).checkpoint()


def test_exporting_a_subclass_without_its_own_kind_is_refused() -> None:
    require("onnx", "the model is exported to ONNX")
    from opgrad.onnx.exporter import to_onnx
    from opgrad.onnx.table import OnnxError

    with pytest.raises(OnnxError, match=r"its class ScaledDense has no kind of its own"):
        to_onnx(_dense_model(ScaledDense(3)))


def test_a_layer_class_without_any_kind_is_refused() -> None:
    class Doubling(nn.Layer):
        def apply(self, x: Any, params: Any, ctx: Any) -> Any:
            return ops.multiply(x, 2.0)

    with pytest.raises(TypeError, match=r"its class Doubling has no kind of its own \(kind 'layer' names no layer"):
        _dense_model(Doubling()).get_config()


def test_a_subclass_with_its_own_kind_round_trips(tmp_path: Path) -> None:
    model = _dense_model(DoubledDense(3))
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    model.save(tmp_path / "model.npz")
    loaded = nn.load(tmp_path / "model.npz")
    assert type(loaded.layers[0]) is DoubledDense
    np.testing.assert_array_equal(loaded.predict(x, backend="reference"), model.predict(x, backend="reference"))


def test_a_kind_another_class_has_is_refused_and_the_builtin_kept() -> None:
    with pytest.raises(TypeError, match=r"layer class .*MyReLU declares kind 'relu', which opgrad\.nn\.layers\.ReLU "
                                        r"already has; give MyReLU a kind of its own"):
        class MyReLU(nn.Layer):
            kind = "relu"

    assert nn.LAYERS["relu"] is nn.ReLU


def _define_scaling(factor: float) -> type[nn.Layer]:
    class Scaling(nn.Layer):
        kind = "test_edges_scaling"

        def apply(self, x: Any, params: Any, ctx: Any) -> Any:
            return ops.multiply(x, factor)

    return Scaling


def test_the_same_class_defined_again_replaces_itself(tmp_path: Path) -> None:
    first = _define_scaling(2.0)
    old_layer = first()
    second = _define_scaling(3.0)  # a notebook cell run again: same module and qualname
    assert nn.LAYERS["test_edges_scaling"] is second
    model = _dense_model(old_layer)  # made before the redefinition, saved as the kind it still is
    model.save(tmp_path / "model.npz")
    assert type(nn.load(tmp_path / "model.npz").layers[0]) is second


# ----- a layer used by several models has one set of weights -----


def _encoder_and_full() -> tuple[nn.Model, nn.Model]:
    inp = nn.Input((4,))
    z = nn.BatchNorm2D(name="norm")(nn.Dense(5, name="enc")(inp))
    full = nn.Model(inp, nn.Dense(3, name="head")(z))
    return nn.Model(inp, z), full


def test_a_sub_model_sees_the_weights_the_full_model_was_trained_to() -> None:
    encoder, full = _encoder_and_full()
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, 4)).astype(np.float32), rng.integers(0, 3, 8)
    trainer = nn.Trainer(full, nn.SGD(), lr=0.5, batch_size=8)
    for _ in range(3):
        trainer.train_batch(x, y)
    for name in ("enc.weight", "enc.bias", "norm.weight"):
        np.testing.assert_array_equal(encoder.params[name], full.params[name])
    for name in ("norm.running_mean", "norm.running_var"):
        np.testing.assert_array_equal(encoder.buffers[name], full.buffers[name])
    hidden = x @ full.params["enc.weight"].T + full.params["enc.bias"]
    mean, var = full.buffers["norm.running_mean"], full.buffers["norm.running_var"]
    expected = (hidden - mean) / np.sqrt(var + 1e-5) * full.params["norm.weight"] + full.params["norm.bias"]
    np.testing.assert_allclose(encoder.predict(x, backend="reference"), expected, rtol=1e-5, atol=1e-6)


def test_weights_assigned_through_either_model_are_the_current_ones() -> None:
    encoder, full = _encoder_and_full()
    drawn = full.params["enc.weight"]  # drawn first in the full model
    assert encoder.weights_assigned
    assert encoder.params["enc.weight"] is drawn  # the same arrays: one changed in place is changed in both
    encoder.params = {k: v + 1.0 for k, v in encoder.params.items()}
    for name, value in encoder.params.items():
        np.testing.assert_array_equal(full.params[name], value)
    full.params = {k: v * 2.0 for k, v in full.params.items()}
    for name, value in encoder.params.items():
        np.testing.assert_array_equal(value, full.params[name])
    np.testing.assert_array_equal(encoder.params["enc.weight"], (drawn + 1.0) * 2.0)


def test_a_trainer_of_a_model_built_on_trained_layers_starts_from_them() -> None:
    encoder, full = _encoder_and_full()
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((8, 4)).astype(np.float32), rng.integers(0, 3, 8)
    nn.Trainer(full, nn.SGD(), lr=0.5, batch_size=8).train_batch(x, y)
    trained = full.params["enc.weight"].copy()
    classifier = nn.Model(encoder.inputs[0], nn.Dense(2, name="other_head")(encoder.outputs[0]))
    trainer = nn.Trainer(classifier, nn.SGD(), lr=0.0, batch_size=8, seed=7)
    np.testing.assert_array_equal(trainer.params["enc.weight"], trained)


# ----- the float type of assigned weights -----


def _conv_bn_model() -> nn.Model:
    inp = nn.Input((3, 8, 8))
    x = nn.BatchNorm2D()(nn.Conv2D(4, 3, padding=1)(inp))
    return nn.Model(inp, nn.Dense(5)(nn.GlobalAvgPool2D()(nn.ReLU()(x))))


def test_integer_weights_are_refused_naming_the_parameter() -> None:
    model = _conv_bn_model()
    with pytest.raises(TypeError, match=r"parameter conv1\.weight has dtype int64; parameters are float arrays"):
        model.params = {k: np.round(v * 10).astype(np.int64) for k, v in model.params.items()}
    with pytest.raises(TypeError, match=r"buffer batchnorm1\.running_mean has dtype int64"):
        model.buffers = {k: v.astype(np.int64) for k, v in model.buffers.items()}


def test_float64_weights_given_after_predict_make_a_float64_model() -> None:
    model = _conv_bn_model()
    x = np.random.default_rng(0).standard_normal((4, 3, 8, 8)).astype(np.float32)
    before = model.predict(x, backend="reference")  # its buffers now exist in float32
    model.params = {k: v.astype(np.float64) for k, v in model.params.items()}
    assert model.dtype == "float64"
    assert {v.dtype for v in (*model.params.values(), *model.buffers.values())} == {np.dtype(np.float64)}
    after = model.predict(x, backend="reference")
    assert after.dtype == np.float64
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("replaced", ["dense1.weight", "conv1.weight"])
def test_weights_of_mixed_float_types_take_the_models_type(replaced: str) -> None:
    model = _conv_bn_model()
    x = np.random.default_rng(0).standard_normal((4, 3, 8, 8)).astype(np.float32)
    params = dict(model.params)
    params[replaced] = params[replaced].astype(np.float64)  # as np.random.randn would give it
    model.params = params
    assert model.dtype == "float32"
    assert {v.dtype for v in (*model.params.values(), *model.buffers.values())} == {np.dtype(np.float32)}
    assert model.predict(x, backend="reference").dtype == np.float32


# ----- batches of another size than the trainer's -----


def _tokens_model() -> nn.Model:
    tok = nn.Input((5,), dtype="int64", name="tok")
    feat = nn.Input((3,), name="feat")
    x = nn.Concatenate()([nn.Flatten()(nn.Embedding(10, 4)(tok)), feat])
    return nn.Model([tok, feat], nn.Dense(2)(x))


def _batch(rng: np.random.Generator, rows: int) -> tuple[list[np.ndarray], np.ndarray]:
    return [rng.integers(0, 10, (rows, 5)), rng.standard_normal((rows, 3))], rng.integers(0, 2, rows)


@pytest.mark.parametrize("rows", [6, 9])
def test_train_batch_of_another_size_is_refused_before_any_step(rows: int) -> None:
    trainer = nn.Trainer(_tokens_model(), nn.SGD(), batch_size=8)
    before = {k: v.copy() for k, v in trainer.params.items()}
    with pytest.raises(ValueError, match=rf"^Trainer\.train_batch: input 'tok' has {rows} rows; this trainer steps "
                                         r"batches of batch_size=8 .*drop_last=True\)$"):
        trainer.train_batch(*_batch(np.random.default_rng(0), rows))
    assert trainer.step == 0
    for name, value in trainer.params.items():
        np.testing.assert_array_equal(value, before[name])


def test_train_batches_names_the_batch_of_another_size() -> None:
    trainer = nn.Trainer(_tokens_model(), nn.SGD(), batch_size=8)
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match=r"^Trainer\.train_batches \(batch 1\): input 'tok' has 5 rows; this trainer "
                                         r"steps batches of batch_size=8"):
        trainer.train_batches([_batch(rng, 8), _batch(rng, 5)])
    assert trainer.step == 0


# ----- ONNX: a tensor listed as several outputs -----


def test_an_output_listed_twice_exports_with_distinct_names_and_reimports(tmp_path: Path) -> None:
    onnx = require("onnx", "the model is exported to ONNX")
    ort = require("onnxruntime", "the exported model is run")
    import opgrad.onnx

    inp = nn.Input((4,))
    logits, aux = nn.Dense(3)(inp), nn.Dense(2)(inp)
    model = nn.Model(inp, [logits, aux, logits], name="dup")
    path = tmp_path / "dup.onnx"
    opgrad.onnx.save(model, path)
    assert [o.name for o in onnx.load(str(path)).graph.output] == ["output1", "output2", "output3"]
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    expected = model.predict(x, backend="reference")
    session = ort.InferenceSession(str(path))
    for got, want in zip(session.run(None, {session.get_inputs()[0].name: x}), expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    reloaded = opgrad.onnx.load(path)
    for got, want in zip(reloaded.predict(x, backend="reference"), expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


# ----- BatchNorm2D(momentum=None): PyTorch's cumulative moving average -----


def _batchnorm_model(momentum: float | None) -> nn.Model:
    inp = nn.Input((3, 4, 4))
    x = nn.BatchNorm2D(momentum=momentum, name="bn")(inp)
    return nn.Model(inp, nn.Dense(2, name="head")(nn.GlobalAvgPool2D()(x)))


@pytest.mark.parametrize("backend", ["reference", "llvm"])
def test_batchnorm_cumulative_average_matches_pytorch(backend: str) -> None:
    dtype = "float64" if backend == "reference" else "float32"
    model = _batchnorm_model(None)
    assert set(model.buffer_shapes()) == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    rng = np.random.default_rng(0)
    batches = [rng.standard_normal((4, 3, 4, 4)) * (i + 1) + i for i in range(3)]
    trainer = nn.Trainer(model, nn.SGD(), lr=0.1, batch_size=4, dtype=dtype, backend=backend)
    reference = torch.nn.BatchNorm2d(3, momentum=None).double().train()
    for x in batches:
        trainer.train_batch(x, rng.integers(0, 2, 4))
        reference(torch.tensor(x))
    tolerance = 1e-12 if dtype == "float64" else 1e-5
    np.testing.assert_allclose(model.buffers["bn.running_mean"], reference.running_mean.numpy(), rtol=tolerance,
                               atol=tolerance)
    np.testing.assert_allclose(model.buffers["bn.running_var"], reference.running_var.numpy(), rtol=tolerance)
    assert float(model.buffers["bn.num_batches_tracked"]) == int(reference.num_batches_tracked) == 3


def test_batchnorm_cumulative_average_round_trips_a_checkpoint(tmp_path: Path) -> None:
    model = _batchnorm_model(None)
    rng = np.random.default_rng(0)
    trainer = nn.Trainer(model, nn.SGD(), lr=0.1, batch_size=4)
    trainer.train_batch(rng.standard_normal((4, 3, 4, 4)), rng.integers(0, 2, 4))
    model.save(tmp_path / "bn.npz")
    loaded = nn.load(tmp_path / "bn.npz")
    assert loaded.layers[0].momentum is None  # type: ignore[attr-defined]
    assert float(loaded.buffers["bn.num_batches_tracked"]) == 1.0
    x = rng.standard_normal((2, 3, 4, 4)).astype(np.float32)
    np.testing.assert_array_equal(loaded.predict(x, backend="reference"), model.predict(x, backend="reference"))


def test_batchnorm_momentum_must_be_a_fraction_or_none() -> None:
    for bad in ("0.1", 1.5, True):
        with pytest.raises(ValueError, match=r"BatchNorm2D momentum must be a number in \[0, 1\].* or None"):
            nn.BatchNorm2D(momentum=bad)  # type: ignore[arg-type]


# ----- Conv2DTranspose: output_padding below the stride or the dilation, as PyTorch -----

TRANSPOSE_CASES = {
    "stride1_dilation2": dict(kernel=3, stride=1, dilation=2, padding=0, output_padding=1),
    "uncrops_then_zeros": dict(kernel=2, stride=1, dilation=4, padding=2, output_padding=3),
    "uncrops_only": dict(kernel=3, stride=1, dilation=3, padding=2, output_padding=2),
    "stride2_dilation3": dict(kernel=3, stride=2, dilation=3, padding=1, output_padding=2),
    "per_axis": dict(kernel=(3, 2), stride=(1, 2), dilation=(3, 1), padding=(0, 1), output_padding=(2, 1)),
}


def _transpose_pair(case: dict[str, Any]) -> tuple[nn.Model, Any]:
    inp = nn.Input((2, 5, 6))
    layer = nn.Conv2DTranspose(3, case["kernel"], strides=case["stride"], dilation_rate=case["dilation"],
                               padding=case["padding"], output_padding=case["output_padding"], name="up")
    model = nn.Model(inp, layer(inp))
    module = torch.nn.ConvTranspose2d(2, 3, case["kernel"], stride=case["stride"], dilation=case["dilation"],
                                      padding=case["padding"], output_padding=case["output_padding"]).double()
    model.params = {f"up.{k}": v.detach().numpy().copy() for k, v in module.named_parameters()}
    return model, module


@pytest.mark.parametrize("name", TRANSPOSE_CASES)
def test_conv_transpose_output_padding_below_the_dilation_matches_pytorch(name: str) -> None:
    model, module = _transpose_pair(TRANSPOSE_CASES[name])
    x = np.random.default_rng(1).standard_normal((2, 2, 5, 6))
    xt = torch.tensor(x, requires_grad=True)
    yt = module(xt)
    assert model.output_shape == tuple(yt.shape[1:])
    cotangent = np.random.default_rng(2).standard_normal(tuple(yt.shape))
    yt.backward(torch.tensor(cotangent))
    images = opgrad.var("x", x.shape, "float64")
    params = {k: opgrad.var(k, v.shape, "float64") for k, v in model.params.items()}
    out = model.forward(images, params)
    fn = opgrad.function([images, *params.values()], [out])
    y = opgrad.evaluate(fn, x, *model.params.values())
    np.testing.assert_allclose(y[0] if isinstance(y, tuple) else y, yt.detach().numpy(), rtol=1e-12, atol=1e-12)
    loss = ops.sum(ops.multiply(out, opgrad.const(cotangent)))
    grads = opgrad.evaluate(opgrad.grad(opgrad.function([images, *params.values()], loss), with_value=False),
                            x, *model.params.values())
    expected = [xt.grad.numpy(), *(p.grad.numpy() for p in module.parameters())]
    for got, want in zip(grads, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


def test_conv_transpose_output_padding_below_the_dilation_compiles_and_exports(tmp_path: Path) -> None:
    ort = require("onnxruntime", "the exported model is run")
    import opgrad.onnx

    model, module = _transpose_pair(TRANSPOSE_CASES["uncrops_then_zeros"])
    model.params = {k: v.astype(np.float32) for k, v in model.params.items()}
    x = np.random.default_rng(1).standard_normal((2, 2, 5, 6)).astype(np.float32)
    with torch.no_grad():
        module.weight.copy_(torch.tensor(model.params["up.weight"], dtype=torch.float64))
        module.bias.copy_(torch.tensor(model.params["up.bias"], dtype=torch.float64))
        expected = module(torch.tensor(x, dtype=torch.float64)).numpy()
    np.testing.assert_allclose(model.predict(x, backend="llvm"), expected, rtol=1e-5, atol=1e-5)
    opgrad.onnx.save(model, tmp_path / "up.onnx")
    session = ort.InferenceSession(str(tmp_path / "up.onnx"))
    got = session.run(None, {session.get_inputs()[0].name: x})[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_conv_transpose_output_padding_past_stride_and_dilation_is_refused() -> None:
    with pytest.raises(ValueError, match=r"output_padding \(2, 2\) must be smaller than the stride or the dilation "
                                         r"of its axis \(PyTorch's rule\); strides \(1, 1\), dilation_rate \(2, 2\)"):
        nn.Conv2DTranspose(3, 3, dilation_rate=2, output_padding=2)


# ----- learning-rate schedules refuse what they cannot mean -----


@pytest.mark.parametrize(("make", "message"), [
    (lambda: nn.cosine_lr(0.1, total_steps=-5), r"cosine_lr: total_steps must be a positive integer .*got -5"),
    (lambda: nn.cosine_lr(0.1, total_steps=0), r"cosine_lr: total_steps must be a positive integer .*got 0"),
    (lambda: nn.cosine_lr(0.1, total_steps=2.5), r"cosine_lr: total_steps must be a positive integer .*got 2\.5"),
    (lambda: nn.LRSchedule(0.1, -1), r"LRSchedule: total_steps must be an integer >= 0 .*got -1"),
    (lambda: nn.cosine_lr(0.1, 10, final=float("nan")), r"LRSchedule: final must be a finite number, got nan"),
    (lambda: nn.StepLR(0.1, 2.5), r"StepLR: step_size must be a positive integer, got 2\.5"),
    (lambda: nn.WarmupLR(nn.cosine_lr(0.1, 10), 1.5), r"WarmupLR: warmup_steps must be an integer >= 0, got 1\.5"),
    (lambda: nn.WarmupLR(0.1, 5), r"WarmupLR: after must be a schedule"),  # type: ignore[arg-type]
])
def test_schedules_refuse_meaningless_arguments(make: Any, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        make()


def test_a_negative_leaky_slope_matches_pytorch_and_the_checker_draws_one() -> None:
    x = np.random.default_rng(0).standard_normal((4, 6))
    model = nn.Sequential([nn.LeakyReLU(-0.3)], input_shape=(6,))
    want = torch.nn.functional.leaky_relu(torch.tensor(x), negative_slope=-0.3).numpy()
    np.testing.assert_allclose(model.predict(x.astype(np.float32)), want, rtol=1e-6, atol=1e-7)
    from opgrad.checks import check_op

    assert check_op("leaky_relu", max_examples=30, seed=0).passed


def test_a_trainer_seed_that_the_weights_drawn_at_first_use_override_is_warned_about() -> None:
    x = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    model = nn.Sequential([nn.Dense(3)], input_shape=(6,))
    model.predict(x)  # draws seed 0's weights, which the model then holds
    assert model.weights_drawn_at_first_use
    with pytest.warns(UserWarning, match=r"Trainer\(seed=5\): the model already holds weights, seed 0's draw .* "
                                         r"assign model.params = model.init_params\(5\) first"):
        trainer = nn.Trainer(model, nn.SGD(), seed=5, batch_size=4)
    for name, value in model.init_params(0).items():
        np.testing.assert_array_equal(trainer.params[name], value)
    model.params = model.init_params(5)
    assert not model.weights_drawn_at_first_use
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nn.Trainer(model, nn.SGD(), seed=5, batch_size=4)
        nn.Trainer(nn.Sequential([nn.Dense(3)], input_shape=(6,)), nn.SGD(), seed=5, batch_size=4)


def test_a_checkpoint_restored_into_another_architecture_names_the_difference(tmp_path: Path) -> None:
    x, y = np.random.default_rng(0).standard_normal((8, 6)).astype(np.float32), np.arange(8) % 3
    relu = nn.Trainer(nn.Sequential([nn.Dense(3, activation="relu")], input_shape=(6,)), nn.SGD(), batch_size=4)
    relu.train_epoch(x, y)
    arrays, meta = relu.checkpoint()
    tanh = nn.Trainer(nn.Sequential([nn.Dense(3, activation="tanh")], input_shape=(6,)), nn.SGD(), batch_size=4)
    with pytest.raises(ValueError, match=r"checkpoint is of another architecture than model 'model' "
                                         r"\(layers\[0\]\.config\.activation: 'relu' in the checkpoint, 'tanh' here\)"):
        tanh.restore(arrays, meta)
    same = nn.Trainer(nn.Sequential([nn.Dense(3, activation="relu")], input_shape=(6,)), nn.SGD(), batch_size=4)
    same.restore(arrays, json.loads(json.dumps(meta)))  # as a checkpoint file gives it back
    assert same.step == relu.step


def test_layers_take_the_leading_arguments_by_position_as_keras_does() -> None:
    # Keras' order: Dense(units, activation, use_bias), Conv2D(filters, kernel_size, strides, padding),
    # MaxPooling2D(pool_size, strides, padding).
    pairs = [(nn.Dense(4, "relu", False), nn.Dense(4, activation="relu", use_bias=False)),
             (nn.Conv2D(8, 3, 2, "same"), nn.Conv2D(8, 3, strides=2, padding="same")),
             (nn.Conv2DTranspose(8, 3, 2, "same"), nn.Conv2DTranspose(8, 3, strides=2, padding="same")),
             (nn.MaxPool2D(3, 2, "same"), nn.MaxPool2D(3, strides=2, padding="same")),
             (nn.AvgPool2D(3, 1, 1), nn.AvgPool2D(3, strides=1, padding=1))]
    for positional, keywords in pairs:
        assert positional.get_config() == keywords.get_config()
    with pytest.raises(TypeError):
        nn.Conv2D(8, 3, 2, "same", 2)  # dilation_rate is keyword-only (Keras has data_format there)


def test_a_channels_last_image_shape_is_named_as_one() -> None:
    # Keras' (height, width, channels) read as (channels, height, width): a kernel too wide for a
    # one-pixel "width", or a 3-pixel strip of 32 channels that builds.
    with pytest.raises(ShapeError, match=r"the 3-wide kernel does not fit the width 1 \(\+0\+0 padding\); "
                                         r"\(28, 28, 1\) looks channels-last .* give \(1, 28, 28\)"):
        nn.Sequential([nn.Conv2D(8, 3)], input_shape=(28, 28, 1))
    with pytest.warns(UserWarning, match=r"input shape \(32, 32, 3\) looks channels-last .* give \(3, 32, 32\)"):
        nn.Sequential([nn.Conv2D(8, 3)], input_shape=(32, 32, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert nn.Sequential([nn.Conv2D(8, 3)], input_shape=(3, 32, 32)).output_shape == (8, 30, 30)


def test_a_training_steps_batch_of_the_wrong_shape_names_the_model_and_batch_size() -> None:
    model = nn.Sequential([nn.Flatten(), nn.Dense(3)], input_shape=(1, 8, 8), name="tiny")
    step = nn.TrainStep(model, nn.SGD(), batch_size=4)
    params = model.init_params(0)
    state = nn.SGD().init_state(params)
    labels = np.zeros(4, np.int64)
    with pytest.raises(ShapeError, match=r"TrainStep of model 'tiny': input 'images' has shape \(3, 1, 8, 8\), "
                                         r"expected \(4, 1, 8, 8\): a batch of 3 where the step was built for "
                                         r"batch_size=4"):
        step(np.zeros((3, 1, 8, 8), np.float32), labels, params, state, 0.1)
    with pytest.raises(ShapeError, match=r"has shape \(4, 1, 9, 8\), expected \(4, 1, 8, 8\): examples of shape"):
        step(np.zeros((4, 1, 9, 8), np.float32), labels, params, state, 0.1)
    with pytest.raises(ShapeError, match=r"TrainStep.run_steps of model 'tiny': input 'images' has shape \(8, 64\)"):
        step.run_steps(np.zeros((8, 64), np.float32), np.zeros(8, np.int64), params, state, 0.1)


# ----- Keras and PyTorch habits that must not pass silently -----


def test_a_custom_layer_whose_config_leaves_out_a_constructor_argument_is_not_saved(tmp_path: Path) -> None:
    # Rebuilt from the description, the layer would take the argument's default: alpha 3 came
    # back as 1 and predict moved by 2.9.
    class ScaledBy(nn.Layer):
        kind = "test_scaled_by"

        def __init__(self, alpha: float = 1.0, *, name: str | None = None) -> None:
            super().__init__(name)
            self.alpha = float(alpha)

        def apply(self, x: Any, params: Any, ctx: Any) -> Any:
            return ops.multiply(x, self.alpha)

    class ScaledByWithConfig(ScaledBy):
        kind = "test_scaled_by_config"

        def get_config(self) -> dict[str, Any]:
            return {"alpha": self.alpha}

    inp = nn.Input((4,))
    model = nn.Model(inp, nn.Dense(3)(ScaledBy(3.0, name="scale")(inp)))
    with pytest.raises(TypeError, match=r"layer 'scale' \(ScaledBy\): ScaledBy.get_config returns no 'alpha', which "
                                         r"its constructor takes, so a saved model would rebuild it with the default"):
        model.save(tmp_path / "m.npz")
    inp = nn.Input((4,))
    model = nn.Model(inp, nn.Dense(3)(ScaledByWithConfig(3.0, name="scale")(inp)))
    model.save(tmp_path / "m.npz")
    x = np.ones((2, 4), np.float32)
    np.testing.assert_array_equal(nn.load(tmp_path / "m.npz").predict(x), model.predict(x))


def test_a_model_called_as_a_layer_says_how_to_reuse_it() -> None:
    encoder = nn.Sequential([nn.Flatten(), nn.Dense(4)], input_shape=(1, 3, 3), name="encoder")
    with pytest.raises(TypeError, match=r"model 'encoder': a model is not a layer, .*call its layers on your tensors"):
        encoder(nn.Input((1, 3, 3)))  # type: ignore[operator]
    with pytest.raises(TypeError, match=r"Sequential takes Layer objects, got model 'encoder': a model is not a layer"):
        nn.Sequential([encoder, nn.Dense(2)], input_shape=(1, 3, 3))  # type: ignore[list-item]


def test_a_sequential_numbers_new_layers_past_the_names_of_layers_it_reuses() -> None:
    # Keras' transfer-learning habit: the backbone's layers with a new head. The new Dense was
    # numbered 'dense1' like the reused one, and the model refused names the user never gave.
    base = nn.Sequential([nn.Flatten(), nn.Dense(16, "relu"), nn.Dense(10)], input_shape=(1, 8, 8))
    assert [layer.name for layer in base.layers] == ["flatten1", "dense1", "dense2"]
    tuned = nn.Sequential([*base.layers[:-1], nn.Dense(3)], input_shape=(1, 8, 8))
    assert [layer.name for layer in tuned.layers] == ["flatten1", "dense1", "dense2"]
    assert tuned.layers[1] is base.layers[1] and tuned.layers[2] is not base.layers[2]
    renamed = nn.Sequential([nn.Flatten(), base.layers[1], nn.Dense(3)], input_shape=(1, 8, 8))
    assert [layer.name for layer in renamed.layers] == ["flatten1", "dense1", "dense2"]


@pytest.mark.parametrize("weights", [[float("nan"), 1.0], [-1.0, 1.0], [True, 2.0], ["2", 1.0]])
def test_loss_weights_must_be_finite_and_not_negative(weights: list[Any]) -> None:
    inp = nn.Input((4,))
    model = nn.Model(inp, [nn.Dense(2)(inp), nn.Dense(3)(inp)], name="two")
    with pytest.raises(ValueError, match=r"model 'two': loss_weights must be finite numbers >= 0 \(one per output\)"):
        nn.TrainStep(model, nn.SGD(), batch_size=2, loss_weights=weights)


def test_fans_of_weights_with_any_kernel_rank_follow_pytorch() -> None:
    from opgrad.nn.init import compute_fans

    assert compute_fans((8, 3, 5)) == (15, 40)  # a 1-D convolution's (out, in, k)
    assert compute_fans((8, 3, 2, 3, 4)) == (72, 192)  # a 3-D convolution's
    assert compute_fans((8, 3, 3, 3)) == (27, 72)
    with pytest.raises(ValueError, match="a scalar weight has none"):
        compute_fans(())


def test_layer_arguments_keras_users_pass_are_named_or_taken() -> None:
    assert nn.Dense(4, activation="linear").activation is None  # Keras' name for no activation
    for bad in ("a", None, True):
        with pytest.raises(ValueError, match=rf"Dropout rate must be a number in \[0, 1\), got {bad!r}"):
            nn.Dropout(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Activation takes one of \('relu', .*got 'relux'"):
        nn.Activation("relux")
    model = nn.Sequential([nn.Flatten(), nn.Dense(2)], input_shape=(1, 2, 2))
    with pytest.raises(TypeError, match=r"Trainer: optimizer is the class Adam; pass an optimizer object, Adam\(\)"):
        nn.Trainer(model, nn.Adam)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"TrainStep: optimizer must be an optimizer object"):
        nn.TrainStep(model, "adam", batch_size=2)  # type: ignore[arg-type]


def test_a_keras_convention_batchnorm_momentum_is_warned_about() -> None:
    with pytest.warns(UserWarning, match=r"BatchNorm2D\(momentum=0.99\) follows PyTorch's convention.*Keras' "
                                         r"momentum=0.99 is momentum=0.01 here"):
        nn.BatchNorm2D(momentum=0.99)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nn.BatchNorm2D(momentum=0.1)
        nn.BatchNorm2D(momentum=None)


def test_step_inputs_name_the_layer_or_input_they_break() -> None:
    """int32 class labels get the int64 advice (not the float targets'); token ids past an
    Embedding's table name the layer in the training steps as in predict; complex inputs are refused."""
    tokens = nn.Input((3,), dtype="int64", name="tok")
    model = nn.Model(tokens, nn.Dense(2)(nn.Flatten()(nn.Embedding(5, 4, name="emb")(tokens))), name="text")
    ids = np.array([[0, 1, 4], [2, 3, 1]])
    step = nn.TrainStep(model, nn.SGD(), batch_size=2)
    with pytest.raises(ValueError, match=r"takes class labels of shape \(2,\) and dtype int64, got dtype int32; "
                                         r"convert it with \.astype\(np\.int64\)$"):
        step(ids, np.array([0, 1], np.int32), model.params, {}, 0.1)
    bad = ids.copy()
    bad[1, 2] = 9
    for call in (lambda: step(bad, np.array([0, 1]), model.params, {}, 0.1),
                 lambda: step.run_steps(bad, np.array([0, 1]), model.params, {}, 0.1),
                 lambda: nn.GradientStep(model, batch_size=2)(bad, np.array([0, 1]), model.params, {})):
        with pytest.raises(ValueError, match=r"of model 'text': input 'tok' feeds layer 'emb' \(Embedding\(5, 4\)\), "
                                             r"whose ids lie in 0\.\.4; got values in 0\.\.9"):
            call()
    images = nn.Sequential([nn.Dense(2)], input_shape=(3,), name="reals")
    with pytest.raises(ValueError, match=r"model 'reals': input 'images' holds complex numbers \(complex128\)"):
        images.predict(np.ones((2, 3)) * (1 + 1j))
