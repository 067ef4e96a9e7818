"""The functional model API (nn.Input / layer calls / nn.Model): wiring, shared layers, summary, the
new layers against PyTorch, BatchNorm2D's running statistics inside the compiled step, compiled
against reference training of a DAG, and checkpoints that rebuild the model in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from optional import require

import opgrad
from opgrad import nn
from opgrad.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from opgrad.errors import ShapeError

REPO = Path(__file__).resolve().parents[1]


def dag_model(name: str = "dag") -> nn.Model:
    """A skip connection, BatchNorm, a shared layer and two outputs, on 1x8x8 images."""
    inp = nn.Input((1, 8, 8))
    x = nn.Conv2D(4, 3, padding="same", activation="relu")(inp)
    y = nn.Conv2D(4, 3, padding="same", use_bias=False)(x)
    y = nn.BatchNorm2D()(y)
    x = nn.ReLU()(nn.Add()([x, y]))
    x = nn.MaxPool2D(2, padding="same")(x)
    features = nn.GlobalAvgPool2D()(x)
    shared = nn.Dense(5, activation="tanh")
    main = nn.Dense(3, name="main")(shared(features))
    flat = nn.Dense(4)(nn.Flatten()(x))
    aux = nn.Dense(3, name="aux")(nn.Concatenate()([shared(nn.Dense(4)(flat)), flat]))
    return nn.Model(inp, [main, aux], name=name)


def _batches(steps: int, batch: int, dtype: str = "float32") -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [(rng.random((batch, 1, 8, 8)).astype(dtype), rng.integers(0, 3, batch)) for _ in range(steps)]


# ----- wiring -----


def test_dag_wiring_names_and_shared_parameters() -> None:
    model = dag_model()
    names = [layer.name for layer in model.layers]
    assert names[:4] == ["conv1", "conv2", "batchnorm1", "add1"]
    assert names.count("dense1") == 1  # the shared Dense is one layer with one set of parameters
    assert len(model.nodes) == len(model.layers) + 1
    assert model.output_shapes == [(3,), (3,)]
    assert model.param_shapes()["dense1.weight"] == (5, 4)
    assert model.buffer_shapes() == {"batchnorm1.running_mean": (4,), "batchnorm1.running_var": (4,)}
    text = model.summary()
    assert "'dense1#2' (shared)" in text and "connected to" in text and "add1" in text
    assert f"total: {model.num_params:,} parameters (+8 buffer values)" in text
    assert str(model) == text


def test_shared_layer_gradient_sums_both_uses() -> None:
    inp = nn.Input((3,))
    shared = nn.Dense(3, use_bias=False)
    model = nn.Model(inp, shared(shared(inp)))
    assert list(model.param_shapes()) == ["dense1.weight"]
    x = opgrad.var("x", (2, 3), "float64")
    w = opgrad.var("dense1.weight", (3, 3), "float64")
    out = model.forward(x, {"dense1.weight": w})
    rng = np.random.default_rng(0)
    xv, wv = rng.standard_normal((2, 3)), rng.standard_normal((3, 3))
    np.testing.assert_allclose(opgrad.evaluate(opgrad.function([x, w], out), xv, wv), xv @ wv.T @ wv.T)


def test_several_inputs_and_int_inputs() -> None:
    tokens = nn.Input((5,), dtype="int64", name="tokens")
    extra = nn.Input((2,), name="extra")
    emb = nn.Flatten()(nn.LayerNorm()(nn.Embedding(7, 3)(tokens)))
    out = nn.Dense(2)(nn.Concatenate()([emb, extra]))
    model = nn.Model([tokens, extra], out)
    assert model.output_shape == (2,)
    rng = np.random.default_rng(0)
    ids, more = rng.integers(0, 7, (4, 5)), rng.random((4, 2)).astype(np.float32)
    logits = model.predict([ids, more], batch_size=3, backend="reference")
    assert isinstance(logits, np.ndarray) and logits.shape == (4, 2)
    step = nn.TrainStep(model, nn.SGD(), batch_size=4, backend="reference")
    result = step([ids, more], rng.integers(0, 2, 4), model.params, {}, 0.1)
    assert np.isfinite(result.loss)


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        (lambda a, b: nn.Add()([a, b]), ShapeError, r"layer Add: input shape .* Add needs inputs of one shape"),
        (lambda a, b: nn.PReLU(3)(a), ShapeError, r"PReLU\(3\).*3 slopes need 3 channels"),
        (lambda a, b: nn.Concatenate(axis=2)([a, b]), ShapeError, r"Concatenate along axis 2 needs the other axes"),
        (lambda a, b: nn.Add()(a), TypeError, r"takes a list of two or more tensors"),
        (lambda a, b: nn.Embedding(3, 2)(a), TypeError, r"takes int64 inputs"),
    ],
)
def test_wiring_errors_name_the_layer(build, error: type[Exception], match: str) -> None:
    a = nn.Conv2D(4, 3)(nn.Input((1, 8, 8)))
    b = nn.Conv2D(8, 3, strides=2)(nn.Input((1, 8, 8)))
    with pytest.raises(error, match=match) as info:
        build(a, b)
    assert "\n" not in str(info.value)


def test_shared_layer_needs_the_same_shape_and_outputs_need_their_inputs() -> None:
    dense = nn.Dense(2)
    dense(nn.Input((3,)))
    with pytest.raises(ShapeError, match=r"already built for input \(3,\).*shared layer"):
        dense(nn.Input((4,)))
    a, b = nn.Input((3,)), nn.Input((3,))
    with pytest.raises(ValueError, match=r"depends on an unnamed input of shape \(3,\), which is not among"):
        nn.Model(a, nn.Add()([a, b]))
    with pytest.raises(ValueError, match=r"depends on input 'extra' of shape \(3,\), which is not among"):
        nn.Model(a, nn.Add()([a, nn.Input((3,), name="extra")]))


# ----- layers against PyTorch -----


def test_conv_same_padding_any_stride_and_pool_padding_match_torch() -> None:
    torch = require("torch", "conv/pool padding semantics are checked against PyTorch")
    F = torch.nn.functional
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 9, 10)).astype(np.float64)
    # F.pad takes (left, right, top, bottom); TF's "same" puts the odd pixel bottom/right.
    cases = [
        (nn.Conv2D(4, 3, strides=2, padding="same", use_bias=False),
         lambda t, w: F.conv2d(F.pad(t, (0, 1, 1, 1)), w, stride=2)),
        (nn.Conv2D(4, 4, strides=1, padding="same", use_bias=False), lambda t, w: F.conv2d(F.pad(t, (1, 2, 1, 2)), w)),
        (nn.Conv2D(4, 3, dilation_rate=2, padding="same", use_bias=False),
         lambda t, w: F.conv2d(t, w, padding=2, dilation=2)),
        (nn.MaxPool2D(3, strides=2, padding=1), lambda t, w: F.max_pool2d(t, 3, 2, padding=1)),
        (nn.MaxPool2D(2, padding="same"), lambda t, w: F.max_pool2d(F.pad(t, (0, 0, 0, 1), value=-np.inf), 2)),
        (nn.AvgPool2D(3, strides=1, padding=1), lambda t, w: F.avg_pool2d(t, 3, 1, padding=1)),
        (nn.AvgPool2D(2, padding="same"),
         lambda t, w: F.avg_pool2d(F.pad(t, (0, 0, 0, 1)), 2)
         / F.avg_pool2d(F.pad(torch.ones_like(t), (0, 0, 0, 1)), 2)),
    ]
    for layer, expected in cases:
        model = nn.Sequential([layer], input_shape=x.shape[1:])
        params = model.init_params(0, "float64")
        xv = opgrad.var("x", x.shape, "float64")
        pv = model.param_vars("float64")
        fn = opgrad.function([xv, *pv.values()], model.forward(xv, pv))
        ours = opgrad.evaluate(fn, x, *params.values())
        weight = torch.from_numpy(params["conv1.weight"]) if params else None
        theirs = expected(torch.from_numpy(x), weight).numpy()
        assert ours.shape == theirs.shape == (2, *model.output_shape), layer.describe()
        np.testing.assert_allclose(ours, theirs, rtol=1e-10, atol=1e-12, err_msg=layer.describe())


@pytest.mark.parametrize("layer, shape", [
    (nn.Conv2D(6, 3, strides=2, padding="same"), (3, 10, 9)),  # im2col GEMM, the odd row and column
    (nn.Conv2D(4, 4, padding="same"), (1, 12, 12)),  # sliding window: one row and column more after
    (nn.Conv2D(4, 3, strides=2, groups=4, padding="same"), (4, 8, 8)),  # depthwise
])
def test_asymmetric_same_padding_is_the_convolutions_own(layer: nn.Conv2D, shape: tuple[int, ...]) -> None:
    """TF's "same" with its odd pixel after is one conv2d with four sides of padding (no padded
    copy of the input, none of its gradient), and the compiled step trains as the reference does."""
    model = nn.Sequential([layer, nn.Flatten(), nn.Dense(3)], input_shape=shape)
    xv = opgrad.var("x", (2, *shape))
    ops_used = {call.op.name for call in opgrad.ir.calls([model.forward(xv, model.param_vars())])}
    assert "pad" not in ops_used and "conv2d" in ops_used
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((5, *shape)).astype(np.float32), rng.integers(0, 3, 5)
    params, state = model.init_params(1), model.init_buffers()
    runs = [nn.TrainStep(model, nn.SGD(), batch_size=5, backend=backend)(x, y, params, state, 0.1)
            for backend in ("reference", "llvm")]
    assert runs[0].loss == pytest.approx(runs[1].loss, rel=1e-5)
    for name, value in runs[0].params.items():
        np.testing.assert_allclose(runs[1].params[name], value, rtol=1e-4, atol=1e-5, err_msg=name)


def test_grouped_conv_transposed_conv_and_upsampling_match_torch() -> None:
    torch = require("torch", "conv groups, transposed convs and upsampling are checked against PyTorch")
    F = torch.nn.functional
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4, 5, 6))
    cases = [
        (nn.Conv2D(6, 3, groups=2, padding=1), lambda t, p: F.conv2d(t, p["weight"], p["bias"], padding=1, groups=2)),
        (nn.Conv2D(4, 3, groups=4, strides=2, padding="same", use_bias=False),  # depthwise
         lambda t, p: F.conv2d(F.pad(t, (0, 1, 1, 1)), p["weight"], stride=2, groups=4)),
        (nn.Conv2DTranspose(3, 3, strides=2, padding=1, output_padding=1),
         lambda t, p: F.conv_transpose2d(t, p["weight"], p["bias"], stride=2, padding=1, output_padding=1)),
        (nn.Conv2DTranspose(6, 3, strides=2, padding="same", groups=2, use_bias=False),
         lambda t, p: F.conv_transpose2d(t, p["weight"], stride=2, groups=2)[:, :, :-1, :-1]),  # TF crops after
        (nn.Conv2DTranspose(2, 4, strides=2, padding="same", use_bias=False),
         lambda t, p: F.conv_transpose2d(t, p["weight"], stride=2)[:, :, 1:-1, 1:-1]),
        (nn.UpSampling2D(2), lambda t, p: F.interpolate(t, scale_factor=2, mode="nearest")),
        (nn.UpSampling2D(3, interpolation="bilinear"),
         lambda t, p: F.interpolate(t, scale_factor=3, mode="bilinear", align_corners=False)),
    ]
    for layer, expected in cases:
        model = nn.Sequential([layer], input_shape=x.shape[1:])
        params = model.init_params(0, "float64")
        xv, pv = opgrad.var("x", x.shape, "float64"), model.param_vars("float64")
        ours = opgrad.evaluate(opgrad.function([xv, *pv.values()], model.forward(xv, pv)), x, *params.values())
        local = {k.split(".", 1)[1]: torch.from_numpy(v) for k, v in params.items()}
        theirs = expected(torch.from_numpy(x), local).numpy()
        assert ours.shape == theirs.shape == (2, *model.output_shape), layer.describe()
        np.testing.assert_allclose(ours, theirs, rtol=1e-10, atol=1e-12, err_msg=layer.describe())
    assert nn.Conv2DTranspose(2, 4, strides=2, padding="same").build((1, 5, 6)) == (2, 10, 12)  # Keras: in * stride
    with pytest.raises(ValueError, match="groups must be a positive divisor of filters=6"):
        nn.Conv2D(6, 3, groups=4)
    with pytest.raises(ShapeError, match="5 input channels do not split into 2 groups"):
        nn.Conv2D(4, 3, groups=2)(nn.Input((5, 8, 8)))


def test_activations_layernorm_embedding_match_torch() -> None:
    torch = require("torch", "layer semantics are checked against PyTorch")
    F = torch.nn.functional
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4, 5))
    for layer, expected in [
        (nn.LeakyReLU(0.2), lambda t: F.leaky_relu(t, 0.2)),
        (nn.GELU(), F.gelu),
        (nn.Activation("gelu"), F.gelu),
        (nn.Sigmoid(), torch.sigmoid),
        (nn.Tanh(), torch.tanh),
        (nn.LayerNorm(), lambda t: F.layer_norm(t, (5,))),
        (nn.LayerNorm(axis=1), lambda t: F.layer_norm(t, (4, 5))),
    ]:
        model = nn.Sequential([layer], input_shape=(4, 5))
        xv = opgrad.var("x", x.shape, "float64")
        pv = model.param_vars("float64")
        ours = opgrad.evaluate(opgrad.function([xv, *pv.values()], model.forward(xv, pv)), x,
                               *model.init_params(0, "float64").values())
        np.testing.assert_allclose(ours, expected(torch.from_numpy(x)).numpy(), rtol=1e-7, atol=1e-9,
                                   err_msg=layer.describe())
    emb = nn.Sequential([nn.Embedding(6, 3)], input_shape=(4,))
    ids = rng.integers(0, 6, (2, 4))
    weight = emb.init_params(0)["embedding1.weight"]
    np.testing.assert_array_equal(emb.predict(ids, backend="reference"),
                                  F.embedding(torch.from_numpy(ids), torch.from_numpy(weight)).numpy())


def _bn_model() -> nn.Model:
    inp = nn.Input((3, 6, 6))
    x = nn.Conv2D(5, 3, name="conv")(inp)
    x = nn.BatchNorm2D(name="bn")(x)
    out = nn.Dense(4, name="fc")(nn.GlobalAvgPool2D()(x))
    return nn.Model(inp, out, name="bn-net")


def test_batchnorm_forward_running_stats_and_eval_equal_torch() -> None:
    """BatchNorm2D inside the compiled training step: output, running stats after 4 steps, eval output."""
    torch = require("torch", "BatchNorm2D is checked against torch.nn.BatchNorm2d")
    model = _bn_model()
    params = model.init_params(0)
    rng = np.random.default_rng(3)
    params["bn.weight"] = rng.uniform(0.5, 1.5, 5).astype(np.float32)
    params["bn.bias"] = rng.uniform(-0.5, 0.5, 5).astype(np.float32)
    step = nn.TrainStep(model, nn.SGD(), batch_size=8, backend="llvm")
    bn = torch.nn.BatchNorm2d(5)  # momentum 0.1, eps 1e-5
    with torch.no_grad():
        bn.weight.copy_(torch.from_numpy(params["bn.weight"]))
        bn.bias.copy_(torch.from_numpy(params["bn.bias"]))
    weight = torch.from_numpy(params["conv.weight"])
    conv_bias = torch.from_numpy(params["conv.bias"])
    state = model.init_buffers()
    for _ in range(4):
        x = rng.standard_normal((8, 3, 6, 6)).astype(np.float32) * 2 + 1
        # lr 0 keeps the weights fixed, so torch sees the same conv outputs at every step.
        result = step(x, rng.integers(0, 4, 8), params, state, 0.0)
        state = result.state
        bn.train()
        bn(torch.nn.functional.conv2d(torch.from_numpy(x), weight, conv_bias))
    np.testing.assert_allclose(state["bn.running_mean"], bn.running_mean.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state["bn.running_var"], bn.running_var.numpy(), rtol=1e-5, atol=1e-6)
    # Evaluation normalizes with the running statistics.
    bn.eval()
    x = rng.standard_normal((8, 3, 6, 6)).astype(np.float32)
    h = torch.nn.functional.conv2d(torch.from_numpy(x), weight, conv_bias)
    pooled = bn(h).mean(dim=(2, 3))
    expected_logits = torch.nn.functional.linear(pooled, torch.from_numpy(params["fc.weight"]),
                                                 torch.from_numpy(params["fc.bias"])).detach().numpy()
    model.params, model.buffers = params, state
    np.testing.assert_allclose(model.predict(x, batch_size=8), expected_logits, rtol=1e-4, atol=1e-5)


def test_batchnorm_training_forward_equals_torch_module() -> None:
    torch = require("torch", "BatchNorm2D is checked against torch.nn.BatchNorm2d")
    model = nn.Sequential([nn.BatchNorm2D(momentum=0.3, epsilon=1e-3)], input_shape=(3, 4, 4))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 4, 4))
    xv = opgrad.var("x", x.shape, "float64")
    variables = {**model.param_vars("float64"), **model.buffer_vars("float64")}
    (out,), buffers = model.call([xv], variables, nn.ForwardContext(training=True))
    fn = opgrad.function([xv, *variables.values()], [out, *buffers.values()])
    values = {**model.init_params(0, "float64"), **model.init_buffers("float64")}
    values["batchnorm1.running_mean"] = rng.standard_normal(3)
    y, mean, var = opgrad.evaluate(fn, x, *values.values())
    bn = torch.nn.BatchNorm2d(3, eps=1e-3, momentum=0.3).double()
    bn.running_mean.copy_(torch.from_numpy(values["batchnorm1.running_mean"]))
    np.testing.assert_allclose(y, bn(torch.from_numpy(x)).detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(mean, bn.running_mean.numpy(), rtol=1e-12)
    np.testing.assert_allclose(var, bn.running_var.numpy(), rtol=1e-12)


# ----- compiled against reference -----


def test_dag_trains_compiled_and_matches_reference_per_step() -> None:
    model = dag_model()
    optimizer = nn.Adam()
    steps = {backend: nn.TrainStep(model, optimizer, batch_size=8, backend=backend, loss_weights=[1.0, 0.5])
             for backend in ("reference", "llvm")}
    start = model.init_params(seed=0)
    runs: dict[str, list[nn.StepResult]] = {}
    for backend, step in steps.items():
        params, state = dict(start), {**optimizer.init_state(start), **model.init_buffers()}
        runs[backend] = []
        for x, y in _batches(4, 8):
            result = step(x, [y, (y + 1) % 3], params, state, 1e-2)
            params, state = result.params, result.state
            runs[backend].append(result)
    for ref, com in zip(runs["reference"], runs["llvm"]):
        np.testing.assert_allclose(com.loss, ref.loss, rtol=1e-5)
        for name in ref.params:
            np.testing.assert_allclose(com.params[name], ref.params[name], rtol=1e-4, atol=1e-6, err_msg=name)
        for name in ("batchnorm1.running_mean", "batchnorm1.running_var"):
            np.testing.assert_allclose(com.state[name], ref.state[name], rtol=1e-5, atol=1e-7, err_msg=name)
    assert not np.allclose(runs["llvm"][-1].state["batchnorm1.running_var"], 1.0)


# ----- checkpoints carry the architecture -----


def _trained_dag(tmp_path: Path) -> tuple[nn.Model, Path, np.ndarray]:
    model = dag_model()
    trainer = nn.Trainer(model, nn.Adam(), lr=1e-2, batch_size=8, seed=0, backend="llvm")
    for x, y in _batches(3, 8):
        trainer.train_batch(x, y)
    path = tmp_path / "dag.npz"
    arrays, meta = trainer.checkpoint()
    save_checkpoint(path, arrays, meta)
    images = _batches(1, 13)[0][0]
    return model, path, images


def test_checkpoint_round_trip_in_a_fresh_process_is_bitwise(tmp_path: Path) -> None:
    model, path, images = _trained_dag(tmp_path)
    main, aux = model.predict(images, batch_size=5)
    np.save(tmp_path / "images.npy", images)
    script = (
        "import sys, numpy as np\n"
        "from opgrad import nn\n"
        f"model = nn.load({str(path)!r})\n"
        f"main, aux = model.predict(np.load({str(tmp_path / 'images.npy')!r}), batch_size=5)\n"
        f"np.save({str(tmp_path / 'main.npy')!r}, main); np.save({str(tmp_path / 'aux.npy')!r}, aux)\n"
        "print(type(model).__name__, model.name, len(model.layers), model.checkpoint_meta['step'])\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["Model", "dag", str(len(model.layers)), "3"]
    np.testing.assert_array_equal(np.load(tmp_path / "main.npy"), main)
    np.testing.assert_array_equal(np.load(tmp_path / "aux.npy"), aux)
    # The checkpoint also holds the optimizer state and step, as before.
    arrays, meta = load_checkpoint(path)
    assert "adam/beta1_power" in arrays and meta["step"] == 3 and meta["architecture"]["class"] == "Model"


def test_model_save_and_load_every_layer_kind(tmp_path: Path) -> None:
    inp = nn.Input((2, 9, 9))
    x = nn.Conv2D(3, 3, strides=2, padding="same", dilation_rate=1, activation="leaky_relu")(inp)
    x = nn.AvgPool2D(2, padding="same")(nn.BatchNorm2D(momentum=0.2)(x))
    x = nn.Dropout(0.25)(nn.GELU(approximate="tanh")(nn.LeakyReLU(0.1)(x)))
    x = nn.Hardswish()(nn.Hardsigmoid()(nn.Softplus(2.0)(nn.ELU(0.5)(nn.SiLU()(nn.PReLU(3, init=0.2)(x))))))
    x = nn.AvgPool2D(2, strides=1, padding=1, ceil_mode=True, count_include_pad=False)(x)
    x = nn.Sigmoid()(nn.Tanh()(nn.ReLU()(nn.Activation("relu")(nn.LayerNorm(axis=1)(x)))))
    x = nn.Permute((1, 3, 2))(nn.ZeroPadding2D(((1, 0), (0, 2)))(nn.Rescaling(0.5, offset=0.1)(x)))
    flat = nn.Softmax()(nn.Reshape((-1,))(x))
    tokens = nn.Input((3,), dtype="int64")
    emb = nn.Flatten()(nn.Embedding(5, 2)(tokens))
    out = nn.Dense(2, kernel_initializer="he_uniform")(nn.Concatenate()([flat, emb]))
    up = nn.UpSampling2D(2)(nn.Conv2DTranspose(2, 3, strides=2, padding="same", groups=2)(inp))
    pooled = nn.Dense(2)(nn.GlobalAvgPool2D()(nn.MaxPool2D(2, strides=2, padding=1, ceil_mode=True)(up)))
    series = nn.Input((2, 12))
    line = nn.AvgPool1D(2, padding=1, ceil_mode=True)(nn.MaxPool1D(3, strides=2, padding="same")(
        nn.Conv1D(3, 3, strides=2, padding=1, dilation_rate=2, groups=1, activation="tanh")(series)))
    line = nn.MultiHeadAttention(3, causal=True)(nn.Permute((2, 1))(line))
    pooled = nn.Add()([pooled, nn.Dense(2)(nn.Flatten()(line))])
    model = nn.Model([inp, tokens, series], [nn.Add()([out, pooled])], name="every")
    kinds = {layer.kind for layer in model.layers}
    builtin = {kind for kind, cls in nn.LAYERS.items() if cls.__module__ in ("opgrad.nn.layers", "opgrad.nn.reshaping")}
    assert kinds == builtin, f"this test misses {builtin - kinds}"
    model.params = model.init_params(4)
    path = tmp_path / "every.npz"
    model.save(path)
    loaded = nn.load(path)
    assert json.dumps(loaded.get_config(), sort_keys=True) == json.dumps(model.get_config(), sort_keys=True)
    rng = np.random.default_rng(0)
    batch = [rng.random((3, 2, 9, 9)).astype(np.float32), rng.integers(0, 5, (3, 3)),
             rng.random((3, 2, 12)).astype(np.float32)]
    np.testing.assert_array_equal(loaded.predict(batch, backend="reference"), model.predict(batch, backend="reference"))
    seq = nn.mlp()
    seq.save(tmp_path / "mlp.npz")
    again = nn.load(tmp_path / "mlp.npz")
    assert isinstance(again, nn.Sequential) and again.summary() == seq.summary()


def test_unknown_layer_kind_and_bad_files_are_one_line_errors(tmp_path: Path) -> None:
    model = nn.Sequential([nn.Flatten(), nn.Dense(3)], input_shape=(2, 2), name="tiny")
    config = model.get_config()
    config["layers"][1]["kind"] = "mystery"
    path = tmp_path / "odd.npz"
    save_checkpoint(path, model.params, {"model": "tiny", "architecture": config})
    with pytest.raises(CheckpointError, match=r"odd\.npz: unknown layer kind 'mystery' \(layer 'dense1'\)") as info:
        nn.load(path)
    assert "\n" not in str(info.value)
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(CheckpointError, match=r"notes\.txt: not an \.npz checkpoint"):
        nn.load(text)
    save_checkpoint(path, {"w": np.zeros(3)}, {"model": "somebody-elses"})
    with pytest.raises(CheckpointError, match="holds no model description"):
        nn.load(path)
    save_checkpoint(path, {}, {"model": "tiny", "architecture": model.get_config()})
    with pytest.raises(CheckpointError, match=r"do not fit the model description: missing dense1\.weight"):
        nn.load(path)


def test_models_doc_example_runs() -> None:
    """docs/models.md's first Python block, executed as written."""
    text = (REPO / "docs" / "models.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict[str, object] = {}
    exec(compile(code, "docs/models.md", "exec"), namespace)
    model = namespace["model"]
    assert isinstance(model, nn.Model) and len(model.outputs) == 2


def sgd_steps_against_torch_twin(model: nn.Model, batch: int, seed: int) -> tuple[Any, Any, Any, Any, Any]:
    """Two float64 SGD steps of ``model`` (reference backend) and of bench's PyTorch translation on
    the same random digits, their losses equal; returns opgrad's params and state, PyTorch's
    parameters and buffers, and the generator for more data."""
    torch = require("torch", "the built-in models are checked against their PyTorch twins")
    from opgrad.bench import torch_forward

    step = nn.TrainStep(model, nn.SGD(), batch_size=batch, dtype="float64", backend="reference")
    params, state = model.init_params(0, "float64"), model.init_buffers("float64")
    p = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    buffers = {k: torch.tensor(v) for k, v in state.items()}
    rng = np.random.default_rng(seed)
    for _ in range(2):
        x, y = rng.random((batch, 1, 28, 28)), rng.integers(0, 10, batch)
        result = step(x, y, params, state, 0.1)
        params, state = result.params, result.state
        loss = torch.nn.functional.cross_entropy(torch_forward(model, p, buffers, torch.from_numpy(x), training=True),
                                                 torch.from_numpy(y))
        grads = torch.autograd.grad(loss, list(p.values()))
        with torch.no_grad():
            for value, grad in zip(p.values(), grads):
                value -= 0.1 * grad
        assert result.loss == pytest.approx(float(loss.detach()), rel=1e-10)
    for name, value in params.items():
        np.testing.assert_allclose(value, p[name].detach().numpy(), rtol=1e-8, atol=1e-10, err_msg=name)
    return params, state, p, buffers, rng


def test_resnet_training_step_equals_its_torch_twin() -> None:
    """The built-in ResNet (1 block per stage, to stay quick on the reference backend) against
    bench's PyTorch translation: loss, updated weights and running statistics after two SGD steps,
    then evaluation logits."""
    torch = require("torch", "the ResNet is checked against its PyTorch twin")
    from opgrad.bench import torch_forward

    model = nn.resnet(blocks_per_stage=1)
    assert [layer.name for layer in model.layers][:3] == ["stem_conv", "stem_bn", "stem_relu"]
    params, state, p, buffers, rng = sgd_steps_against_torch_twin(model, batch=4, seed=0)
    for name, value in state.items():
        np.testing.assert_allclose(value, buffers[name].numpy(), rtol=1e-10, atol=1e-12, err_msg=name)
    model.params, model.buffers = params, state
    x = rng.random((3, 1, 28, 28))
    expected = torch_forward(model, p, buffers, torch.from_numpy(x), training=False).detach().numpy()
    np.testing.assert_allclose(model.predict(x, backend="reference"), expected, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("name", ["lstm", "transformer"])
def test_sequence_models_train_as_their_torch_twins(name: str) -> None:
    """The built-in LSTM and transformer against bench's PyTorch translation (nn.LSTM through
    functional_call, F.multi_head_attention_forward, F.layer_norm): loss and weights after two SGD
    steps, float64."""
    sgd_steps_against_torch_twin(nn.build_model(name), batch=3, seed=1)
