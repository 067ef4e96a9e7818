"""opgrad.keras: Keras 3 .keras and legacy .h5 models imported, checked, fine-tuned and saved.

The fixtures (tests/fixtures/keras) and Keras' predictions on fixed inputs are committed, made by
tests/fixtures/make_keras_models.py; only the regeneration test needs Keras itself.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from optional import require

h5py = require("h5py", "opgrad.keras reads Keras files' HDF5 weights with h5py (the interop extra)")

import opgrad  # noqa: E402
from opgrad import nn, ops  # noqa: E402
from opgrad.checks import check_function  # noqa: E402
from opgrad.keras import KerasImportError, load, read  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "keras"
EXPECTED = dict(np.load(FIXTURES / "expected.npz"))
#: fixture file -> the model it holds
FILES = {
    "mnist_cnn.keras": "mnist_cnn",
    "mnist_cnn.h5": "mnist_cnn",
    "mnist_cnn_keras2.h5": "mnist_cnn",
    "residual.keras": "residual",
    "shapes.keras": "shapes",
    "embedding.keras": "embedding",
}


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def nchw(x: np.ndarray) -> np.ndarray:
    return x.transpose(0, 3, 1, 2) if x.ndim == 4 else x.astype(np.int64)


# ----- outputs equal Keras' -----


@pytest.mark.parametrize("filename", FILES)
def test_outputs_equal_keras(filename: str) -> None:
    name = FILES[filename]
    imported = read(FIXTURES / filename)
    x, keras_out = EXPECTED[f"{name}.x"], EXPECTED[f"{name}.y"]
    out = imported.model.predict(nchw(x), batch_size=len(x), backend="reference")
    assert isinstance(out, np.ndarray)
    stripped = any("final softmax is left out" in note for note in imported.notes)
    assert stripped == (name != "embedding")  # every other fixture ends in a softmax
    np.testing.assert_allclose(softmax(out) if stripped else out, keras_out, atol=1e-5, rtol=0)
    assert imported.format == Path(filename).suffix


def test_a_mixed_precision_model_imports_as_float32_with_a_note(tmp_path: Path) -> None:
    def mixed(config: dict[str, Any]) -> None:
        for layer in config["config"]["layers"]:
            if isinstance(layer["config"].get("dtype"), dict):
                layer["config"]["dtype"] = {"module": "keras", "class_name": "DTypePolicy",
                                            "config": {"name": "mixed_float16"}, "registered_name": None}

    imported = read(_rewrite_keras(FIXTURES / "mnist_cnn.keras", tmp_path / "mixed.keras", mixed))
    policy_notes = [note for note in imported.notes if "mixed_float16" in note]
    assert len(policy_notes) == 1, imported.notes
    assert policy_notes[0].startswith("layers 'conv2d', ") and "computes and trains in float32" in policy_notes[0]
    plain = read(FIXTURES / "mnist_cnn.keras")
    assert not any("dtype policy" in note for note in plain.notes)


#: Where Keras 3 stores each class's variables in a .keras file: its class name in snake case.
SNAKE = {"InputLayer": "input_layer", "Conv2D": "conv2d", "BatchNormalization": "batch_normalization",
         "ReLU": "re_lu", "Add": "add", "DepthwiseConv2D": "depthwise_conv2d", "Concatenate": "concatenate",
         "Conv2DTranspose": "conv2d_transpose", "AveragePooling2D": "average_pooling2d",
         "MaxPooling2D": "max_pooling2d", "GlobalAveragePooling2D": "global_average_pooling2d",
         "Flatten": "flatten", "Dense": "dense"}


def _as_keras2_h5(source: Path, target: Path) -> None:
    """The functional model of ``source`` (.keras) in the HDF5 layout Keras 2 / tf.keras wrote."""
    with zipfile.ZipFile(source) as archive:
        config = json.loads(archive.read("config.json"))["config"]
        weights = h5py.File(io.BytesIO(archive.read("model.weights.h5")))
    layers, seen = [], {}
    with h5py.File(target, "w") as f:
        group = f.create_group("model_weights")
        for entry in config["layers"]:
            fields = {**entry["config"], "dtype": "float32"}
            if entry["class_name"] == "InputLayer":
                fields["batch_input_shape"] = fields.pop("batch_shape")
            nodes = []
            for node in entry["inbound_nodes"]:
                args = node["args"][0]
                nodes.append([[t["config"]["keras_history"][0], 0, 0, {}]
                              for t in (args if isinstance(args, list) else [args])])
            layers.append({"class_name": entry["class_name"], "name": entry["name"], "config": fields,
                           "inbound_nodes": nodes})
            snake = SNAKE[entry["class_name"]]
            stored = snake if snake not in seen else f"{snake}_{seen[snake] + 1}"
            seen[snake] = seen.get(snake, -1) + 1
            variables = weights[f"layers/{stored}/vars"]
            sub = group.create_group(entry["name"])
            names = []
            for i in range(len(variables)):
                name = f"{entry['name']}/w{i}:0"
                sub[name] = variables[str(i)][()]
                names.append(name.encode())
            sub.attrs["weight_names"] = names
        model = {"class_name": "Model", "config": {"name": config["name"], "layers": layers,
                                                   "input_layers": [["image", 0, 0]],
                                                   "output_layers": [["classes", 0, 0]]}}
        f.attrs["model_config"] = json.dumps(model).encode()
        f.attrs["keras_version"] = b"2.4.0"
    weights.close()


def test_keras2_functional_h5_predicts_like_keras(tmp_path: Path) -> None:
    _as_keras2_h5(FIXTURES / "residual.keras", tmp_path / "residual.h5")
    imported = read(tmp_path / "residual.h5")
    assert imported.keras_version == "2.4.0"
    x = nchw(EXPECTED["residual.x"])
    np.testing.assert_allclose(softmax(imported.model.predict(x, backend="reference")), EXPECTED["residual.y"],
                               atol=1e-5, rtol=0)


def test_keep_softmax_and_nhwc_layout_give_keras_predictions_directly() -> None:
    x, keras_out = EXPECTED["residual.x"], EXPECTED["residual.y"]
    model = load(FIXTURES / "residual.keras", layout="NHWC", keep_softmax=True)
    assert model.input_shape == x.shape[1:]
    out = model.predict(x, batch_size=len(x), backend="reference")
    np.testing.assert_allclose(out, keras_out, atol=1e-5, rtol=0)


def test_seed_mnist_model_layers_and_weight_layouts() -> None:
    """The Keras MNIST CNN: NCHW input, OIHW kernels, and the Dense after Flatten reordered to C, H, W."""
    model = load(FIXTURES / "mnist_cnn.keras")
    assert model.input_shape == (1, 28, 28) and model.output_shape == (10,)
    kinds = [layer.kind for layer in model.layers]
    assert kinds == ["conv", "conv", "maxpool", "dropout", "flatten", "dense", "dropout", "dense"]
    with h5py.File(io.BytesIO(zipfile.ZipFile(FIXTURES / "mnist_cnn.keras").read("model.weights.h5"))) as f:
        kernel = f["layers/conv2d/vars/0"][()]
        dense = f["layers/dense/vars/0"][()]
    np.testing.assert_array_equal(model.params["conv2d.weight"], kernel.transpose(3, 2, 0, 1))
    # Keras' feature (h, w, c) of the 12x12x8 image is opgrad's feature (c, h, w).
    h, w, c = 5, 7, 3
    np.testing.assert_array_equal(model.params["dense.weight"][:, c * 144 + h * 12 + w],
                                  dense[h * 12 * 8 + w * 8 + c, :])


@pytest.mark.parametrize(("filename", "keep_softmax"), [("residual.keras", False), ("shapes.keras", True)])
def test_checkpoint_round_trip_gives_identical_predictions(tmp_path: Path, filename: str,
                                                           keep_softmax: bool) -> None:
    model = load(FIXTURES / filename, keep_softmax=keep_softmax)
    x = nchw(EXPECTED[f"{FILES[filename]}.x"])
    path = tmp_path / "model.npz"
    model.save(path)
    again = nn.load(path)
    assert [layer.get_config() for layer in again.layers] == [layer.get_config() for layer in model.layers]
    np.testing.assert_array_equal(again.predict(x, backend="reference"), model.predict(x, backend="reference"))


def test_import_does_not_need_keras() -> None:
    code = ("import sys, opgrad.keras; opgrad.keras.load(sys.argv[1]); "
            "assert 'keras' not in sys.modules and 'torch' not in sys.modules, 'imported keras or torch'")
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    subprocess.run([sys.executable, "-c", code, str(FIXTURES / "mnist_cnn.keras")], check=True, env=env,
                   cwd=Path(__file__).parent.parent)


# ----- gradients and fine-tuning -----


def test_imported_model_gradient_passes_the_checker() -> None:
    model = load(FIXTURES / "residual.keras")
    batch = 2
    x = opgrad.var("x", (batch, *model.input_shape))
    labels = opgrad.var("labels", (batch,), "int64")
    params, buffers = model.param_vars(), model.buffer_vars()
    logits = model.forward(x, {**params, **buffers})
    fn = opgrad.function([x, labels, *params.values(), *buffers.values()],
                         ops.softmax_cross_entropy(logits, labels))
    arrays = [nchw(EXPECTED["residual.x"][:batch]), np.array([1, 4]), *model.params.values(),
              *model.buffers.values()]
    report = check_function(fn, arrays, wrt=list(params), seed=0, directions=2, name="imported residual loss")
    assert report.passed, str(report)


def test_fine_tune_with_compiled_kernels_lowers_the_loss() -> None:
    if nn.llvm_unavailable_reason() is not None:
        pytest.skip(f"the llvm backend is unavailable: {nn.llvm_unavailable_reason()}")
    model = load(FIXTURES / "mnist_cnn.h5")
    rng = np.random.default_rng(0)
    labels = np.arange(16) % 10
    images = rng.random((16, 1, 28, 28), dtype=np.float32) * 0.2
    for i, label in enumerate(labels):  # a bar whose height gives the class
        images[i, 0, 2 * label:2 * label + 6, 4:24] += 0.8
    before = model.predict(images, batch_size=16, backend="reference")
    trainer = nn.Trainer(model, nn.Adam(), lr=1e-2, batch_size=16, backend="llvm", params=model.params)
    losses = trainer.train_batches([(images, labels)] * 30)
    assert np.mean(losses[-5:]) < 0.75 * losses[0], losses
    # the imported weights were the starting point: the first loss is the imported model's loss
    # (dropout is on while training, so only roughly)
    first = -np.mean(np.log(softmax(before)[np.arange(16), labels]))
    assert losses[0] == pytest.approx(first, rel=0.1)


def test_trainer_keeps_imported_batchnorm_statistics() -> None:
    model = load(FIXTURES / "residual.keras")
    running = {k: v.copy() for k, v in model.buffers.items()}
    trainer = nn.Trainer(model, nn.SGD(), batch_size=3, backend="reference", params=model.params)
    for name, value in running.items():
        np.testing.assert_array_equal(trainer.state[name], value)


# ----- errors -----


def _rewrite_keras(source: Path, target: Path, edit: Callable[[dict[str, Any]], None] | None = None,
                   drop: str | None = None) -> Path:
    """A copy of ``source`` (.keras) with its config.json edited or one entry left out."""
    with zipfile.ZipFile(source) as archive:
        entries = {info.filename: archive.read(info) for info in archive.infolist()}
    if edit is not None:
        config = json.loads(entries["config.json"])
        edit(config)
        entries["config.json"] = json.dumps(config).encode()
    with zipfile.ZipFile(target, "w") as archive:
        for name, data in entries.items():
            if name != drop:
                archive.writestr(name, data)
    return target


def _layer(config: dict[str, Any], name: str) -> dict[str, Any]:
    return next(entry for entry in config["config"]["layers"] if entry["config"].get("name") == name)


def _set(layer: str, **fields: Any) -> Callable[[dict[str, Any]], None]:
    def edit(config: dict[str, Any]) -> None:
        _layer(config, layer)["config"].update(fields)
    return edit


def _rename_class(layer: str, class_name: str) -> Callable[[dict[str, Any]], None]:
    def edit(config: dict[str, Any]) -> None:
        _layer(config, layer)["class_name"] = class_name
    return edit


def _call_twice_over(layer: str, class_name: str | None = None) -> Callable[[dict[str, Any]], None]:
    """The layer called with its input twice and a keyword (MultiHeadAttention's query, value, mask)."""
    def edit(config: dict[str, Any]) -> None:
        entry = _layer(config, layer)
        node = entry["inbound_nodes"][0]
        node["args"] = node["args"] * 2
        node["kwargs"] = {**(node.get("kwargs") or {}), "attention_mask": node["args"][0]}
        if class_name is not None:
            entry["class_name"] = class_name
    return edit


def _nest(config: dict[str, Any]) -> None:
    entry = _layer(config, "dense")
    entry["class_name"] = "Sequential"
    entry["config"] = {"name": "dense", "layers": []}


def _share(config: dict[str, Any]) -> None:
    entry = _layer(config, "stem_relu")
    entry["inbound_nodes"] = entry["inbound_nodes"] * 2


def _corrupt(tmp_path: Path, name: str) -> Path:
    target = tmp_path / name
    if name == "not_a_model.keras":
        target.write_bytes(b"this is text, not a model\n" * 10)
    elif name == "truncated.keras":
        data = (FIXTURES / "mnist_cnn.keras").read_bytes()
        target.write_bytes(data[: len(data) // 2])
    elif name == "no_config.keras":
        _rewrite_keras(FIXTURES / "mnist_cnn.keras", target, drop="config.json")
    elif name == "no_weights.keras":
        _rewrite_keras(FIXTURES / "mnist_cnn.keras", target, drop="model.weights.h5")
    elif name == "bad_json.keras":
        with zipfile.ZipFile(target, "w") as archive:
            archive.writestr("config.json", "{not json")
    elif name == "deep_json.keras":
        with zipfile.ZipFile(target, "w") as archive:
            archive.writestr("config.json", "[" * 100_000 + "]" * 100_000)
    elif name == "weights_only.h5":
        with h5py.File(target, "w") as f:
            f.attrs["layer_names"] = [b"dense"]
            f.create_group("dense").attrs["weight_names"] = []
    elif name == "int8_weights.h5":
        shutil.copy(FIXTURES / "mnist_cnn.h5", target)
        with h5py.File(target, "r+") as f:
            path = "model_weights/dense_1/mnist_cnn/dense_1/kernel"
            kernel = f[path][()]
            del f[path]
            f[path] = (kernel * 100).astype(np.int8)
    elif name == "nan_weights.h5":
        shutil.copy(FIXTURES / "mnist_cnn.h5", target)
        with h5py.File(target, "r+") as f:
            f["model_weights/dense_1/mnist_cnn/dense_1/bias"][0] = np.nan
    elif name == "external_link.h5":
        shutil.copy(FIXTURES / "mnist_cnn.h5", target)
        with h5py.File(target, "r+") as f:
            del f["model_weights/dense_1/mnist_cnn/dense_1/bias"]
            f["model_weights/dense_1/mnist_cnn/dense_1/bias"] = h5py.ExternalLink("/etc/other.h5", "/bias")
    return target


EDITS: dict[str, tuple[str, Callable[[dict[str, Any]], None]]] = {
    "weights_shape": ("mnist_cnn.keras", _set("dense", units=9)),
    "unknown_layer": ("mnist_cnn.keras", _rename_class("dropout", "CenterCrop")),
    "channels_first": ("mnist_cnn.keras", _set("conv2d", data_format="channels_first")),
    "activation": ("mnist_cnn.keras", _set("conv2d_1", activation="celu")),
    "unknown_field": ("mnist_cnn.keras", _set("dense", dot_general="int8")),
    "dtype": ("mnist_cnn.keras", _set("dense", dtype="int8_from_float32")),
    "nested": ("mnist_cnn.keras", _nest),
    "shared": ("residual.keras", _share),
    "batchnorm_axis": ("residual.keras", _set("stem_bn", axis=1)),
    "max_value": ("residual.keras", _set("stem_relu", max_value=-1.0)),
    "threshold": ("residual.keras", _set("stem_relu", threshold=-0.5)),
    "bad_value": ("mnist_cnn.keras", _set("dense", units="ten")),
    "bad_input_shape": ("residual.keras", _set("image", batch_shape=[None, "9", 9, 3])),
    "dynamic_input": ("residual.keras", _set("image", batch_shape=[None, None, None, 3])),
    "bad_wiring": ("residual.keras", lambda config: config["config"].update(input_layers=[["image", "x", 0]])),
    "two_arguments": ("residual.keras", _call_twice_over("stem_relu")),
    "unknown_layer_two_arguments": ("residual.keras", _call_twice_over("stem_relu", "MultiHeadAttention")),
}

ERRORS = [
    ("not_a_model.keras", None, "neither a Keras 3 .keras file"),
    ("truncated.keras", None, "not a readable .keras archive"),
    ("no_config.keras", None, "has no config.json"),
    ("no_weights.keras", None, "has no model.weights.h5"),
    ("bad_json.keras", None, "config.json is not valid JSON"),
    ("weights_only.h5", None, "weights only (saved with save_weights)"),
    ("int8_weights.h5", "dense_1", "dtype int8; supported: float16, float32, float64"),
    ("nan_weights.h5", "dense_1", "holds nan or infinite values"),
    ("external_link.h5", None, "is a ExternalLink"),
    ("weights_shape", "dense", "variable kernel (layers/dense/vars/0) has shape (1152, 8), expected (1152, 9)"),
    ("unknown_layer", "dropout", "class 'CenterCrop', which the importer does not support; supported: Activation"),
    ("channels_first", "conv2d", "data_format='channels_first' is not supported; supported: 'channels_last'"),
    ("activation", "conv2d_1", "activation='celu' is not supported; supported: linear, relu"),
    ("unknown_field", "dense", "config field dot_general='int8' is not supported"),
    ("dtype", "dense", "dtype='int8_from_float32' is not supported"),
    ("nested", "dense", "is itself a model (Sequential)"),
    ("shared", "stem_relu", "is called 2 times (a shared layer)"),
    ("batchnorm_axis", "stem_bn", "supported: the channel (last) axis"),
    ("max_value", "stem_relu", "max_value=-1.0 is not supported; supported: None or a number >= 0"),
    ("threshold", "stem_relu", "threshold=-0.5 is not supported; supported: a number >= 0"),
    ("bad_value", "dense", "malformed config"),
    ("bad_input_shape", "image", "is not a list of positive ints"),
    ("dynamic_input", "image", "has an unknown dimension"),
    ("bad_wiring", None, "malformed Functional config"),
    ("deep_json.keras", None, "nested too deeply"),
    ("two_arguments", "stem_relu", "is called with 2 positional argument(s) and keyword arguments attention_mask; "
                                   "the importer reads calls on one tensor or one list of tensors"),
    ("unknown_layer_two_arguments", "stem_relu", "class 'MultiHeadAttention', which the importer does not support"),
]


@pytest.mark.parametrize(("case", "layer", "message"), ERRORS, ids=[case for case, _, _ in ERRORS])
def test_unsupported_or_malformed_files_give_one_clear_error(tmp_path: Path, case: str, layer: str | None,
                                                             message: str) -> None:
    if case in EDITS:
        source, edit = EDITS[case]
        path = _rewrite_keras(FIXTURES / source, tmp_path / f"{case}.keras", edit)
    else:
        path = _corrupt(tmp_path, case)
    with pytest.raises(KerasImportError) as info:
        load(path)
    text = str(info.value)
    assert text.startswith(str(path)), text
    assert message in text, text
    if layer is not None:
        assert f"layer {layer!r}" in text, text


def test_mutated_config_fields_import_or_fail_clearly(tmp_path: Path) -> None:
    """A sample of config fields set to values of the wrong kind: never anything but KerasImportError."""
    with zipfile.ZipFile(FIXTURES / "residual.keras") as archive:
        config = json.loads(archive.read("config.json"))
    cases = [(i, key) for i, entry in enumerate(config["config"]["layers"]) for key in entry["config"]]
    rng = np.random.default_rng(0)
    values: list[Any] = ["x", -1, None, [], {"a": 1}, 0, 10**9, [1, 2, 3], True, 2.5]
    for k in rng.choice(len(cases), size=30, replace=False):
        index, key = cases[k]
        value = values[int(rng.integers(len(values)))]

        def edit(config: dict[str, Any], index: int = index, key: str = key, value: Any = value) -> None:
            config["config"]["layers"][index]["config"][key] = value

        path = _rewrite_keras(FIXTURES / "residual.keras", tmp_path / f"mutated{k}.keras", edit)
        try:
            load(path)
        except KerasImportError as exc:
            assert str(exc).startswith(str(path))


def test_missing_file_and_bad_layout_are_clear(tmp_path: Path) -> None:
    with pytest.raises(KerasImportError, match="no such file"):
        load(tmp_path / "missing.keras")
    with pytest.raises(ValueError, match="layout must be one of"):
        load(FIXTURES / "mnist_cnn.keras", layout="CHWN")


# ----- the fixtures are what the generator makes -----


def _generator(monkeypatch: pytest.MonkeyPatch) -> Any:
    """tests/fixtures/make_keras_models.py, with Keras 3 on the torch backend (skips without Keras)."""
    monkeypatch.setenv("KERAS_BACKEND", os.environ.get("KERAS_BACKEND", "torch"))
    require("keras", "regenerating the Keras fixtures needs Keras 3 (with the torch backend)")
    monkeypatch.syspath_prepend(str(FIXTURES.parent))
    import make_keras_models

    return make_keras_models


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Keras' own numpy 2 deprecations
def test_full_size_keras_mnist_cnn_predicts_like_keras(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Keras MNIST example at its real size (1.2 M parameters), too big to commit, made here."""
    generator = _generator(monkeypatch)
    keras_model = generator.mnist_cnn((32, 64, 128))
    generator.randomize(keras_model, seed=7)
    x = np.random.default_rng(7).random((2, 28, 28, 1), dtype=np.float32)
    expected = np.asarray(keras_model.predict(x, verbose=0))
    for suffix in (".keras", ".h5"):
        keras_model.save(tmp_path / f"mnist{suffix}")
        model = load(tmp_path / f"mnist{suffix}", layout="NHWC", keep_softmax=True)
        assert model.num_params == 1_199_882
        np.testing.assert_allclose(model.predict(x, backend="reference"), expected, atol=1e-5, rtol=0)


LAYER_VARIANTS = {
    "transpose_kernel_below_stride": lambda layers: layers.Conv2DTranspose(2, 1, strides=2),
    "transpose_valid_output_padding": lambda layers: layers.Conv2DTranspose(2, 3, strides=2, output_padding=1),
    "transpose_same_even_kernel": lambda layers: layers.Conv2DTranspose(2, 4, strides=2, padding="same"),
    "conv_strided_valid": lambda layers: layers.Conv2D(3, (3, 2), strides=(2, 1), activation="sigmoid"),
    "conv_same_stride3": lambda layers: layers.Conv2D(2, 2, strides=3, padding="same", use_bias=False),
    "maxpool_same_strided": lambda layers: layers.MaxPooling2D(3, strides=2, padding="same"),
    "avgpool_valid_strided": lambda layers: layers.AveragePooling2D((2, 3), strides=(1, 2)),
    "gap_keepdims": lambda layers: layers.GlobalAveragePooling2D(keepdims=True),
    "global_max_pooling": lambda layers: layers.GlobalMaxPooling2D(),
    "global_max_pooling_keepdims": lambda layers: layers.GlobalMaxPooling2D(keepdims=True),
    "cropping_int": lambda layers: layers.Cropping2D(1),
    "cropping_rows_cols": lambda layers: layers.Cropping2D((2, 1)),
    "cropping_four_sides": lambda layers: layers.Cropping2D(((0, 3), (2, 1))),
    "upsampling_nearest_2x3": lambda layers: layers.UpSampling2D((2, 3)),
    "upsampling_bilinear_3x2": lambda layers: layers.UpSampling2D((3, 2), interpolation="bilinear"),
    "upsampling_bilinear_2x2": lambda layers: layers.UpSampling2D(2, interpolation="bilinear"),
    "relu_negative_slope": lambda layers: layers.ReLU(negative_slope=0.1),
    "relu_max_value": lambda layers: layers.ReLU(max_value=6.0),
    "relu_slope_and_max_value": lambda layers: layers.ReLU(max_value=0.5, negative_slope=0.2),
    "conv_relu6": lambda layers: layers.Conv2D(3, 3, activation="relu6"),
    "conv_silu": lambda layers: layers.Conv2D(2, 1, activation="silu"),
    "dense_on_pixels": lambda layers: layers.Dense(4, activation="silu"),
    "activation_swish": lambda layers: layers.Activation("swish"),
    "activation_elu": lambda layers: layers.Activation("elu"),
    "activation_softplus": lambda layers: layers.Activation("softplus"),
    "activation_hard_silu": lambda layers: layers.Activation("hard_silu"),
    "activation_hard_sigmoid": lambda layers: layers.Activation("hard_sigmoid"),
    "activation_mish": lambda layers: layers.Activation("mish"),
    "activation_selu": lambda layers: layers.Activation("selu"),
    "activation_softsign": lambda layers: layers.Activation("softsign"),
    "conv_selu": lambda layers: layers.Conv2D(2, 1, activation="selu"),
    "dense_softsign": lambda layers: layers.Dense(4, activation="softsign"),
    "relu_threshold": lambda layers: layers.ReLU(threshold=0.3),
    "relu_threshold_slope": lambda layers: layers.ReLU(threshold=0.5, negative_slope=0.1),
    "relu_threshold_slope_max_value": lambda layers: layers.ReLU(threshold=0.3, negative_slope=0.2, max_value=1.0),
    "prelu_per_channel": lambda layers: layers.PReLU(shared_axes=[1, 2]),
    "prelu_one_slope": lambda layers: layers.PReLU(shared_axes=[1, 2, 3]),
    "prelu_per_element": lambda layers: layers.PReLU(),
    "prelu_per_column_and_channel": lambda layers: layers.PReLU(shared_axes=[1]),
    "channel_softmax": lambda layers: layers.Softmax(axis=-1),
    "rescaling": lambda layers: layers.Rescaling(1 / 255, offset=-0.5),
    "separable": lambda layers: layers.SeparableConv2D(4, 3, depth_multiplier=2, padding="same", strides=2,
                                                       activation="relu"),
    "separable_no_bias": lambda layers: layers.SeparableConv2D(2, (2, 3), dilation_rate=2, use_bias=False),
}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Keras' own numpy 2 deprecations
@pytest.mark.parametrize("variant", LAYER_VARIANTS)
def test_layer_variants_predict_like_keras(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variant: str) -> None:
    generator = _generator(monkeypatch)
    import keras

    inp = keras.Input((7, 6, 3))
    keras_model = keras.Model(inp, LAYER_VARIANTS[variant](keras.layers)(inp))
    _predicts_like_keras(tmp_path, keras_model, generator, seed=3, layouts=("NCHW", "NHWC"))


def _predicts_like_keras(tmp_path: Path, keras_model: Any, generator: Any, seed: int, *,
                         suffixes: tuple[str, ...] = (".keras",), layouts: tuple[str, ...] = ("NCHW",),
                         randomize: bool = True) -> nn.Model:
    """``keras_model`` with random weights (unless not ``randomize``: weights set by the caller),
    saved as each of ``suffixes`` and imported with each of ``layouts``, predicts as Keras does on
    both backends; returns the last import."""
    if randomize:
        generator.randomize(keras_model, seed=seed)
    x = np.random.default_rng(seed).standard_normal((2, *keras_model.inputs[0].shape[1:])).astype(np.float32)
    expected = np.asarray(keras_model.predict(x, verbose=0))
    for suffix in suffixes:
        keras_model.save(tmp_path / f"model{suffix}")
        for layout in layouts:
            model = load(tmp_path / f"model{suffix}", layout=layout, keep_softmax=True)
            transpose = layout == "NCHW"  # images in and out as NCHW; anything else as Keras has it
            for backend in ("reference", "llvm"):
                out = model.predict(nchw(x) if transpose and x.ndim == 4 else x, backend=backend)
                out = out.transpose(0, 2, 3, 1) if transpose and out.ndim == 4 else out
                np.testing.assert_allclose(out, expected, atol=1e-5, rtol=0, err_msg=f"{suffix} {layout} {backend}")
    return model


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Keras' own numpy 2 deprecations
def test_dense_over_a_sequence_predicts_like_keras(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    generator = _generator(monkeypatch)
    import keras

    inp = keras.Input((5, 7))
    hidden = keras.layers.Dense(6, activation="gelu")(inp)
    keras_model = keras.Model(inp, keras.layers.Dense(3)(keras.layers.Flatten()(keras.layers.Dense(4)(hidden))))
    _predicts_like_keras(tmp_path, keras_model, generator, seed=4)


SEQUENCE_VARIANTS = {
    "conv1d_valid_strided": lambda layers: layers.Conv1D(4, 3, strides=2, activation="relu"),
    "conv1d_valid_dilated": lambda layers: layers.Conv1D(4, 3, dilation_rate=2),
    "conv1d_same_even_kernel_grouped": lambda layers: layers.Conv1D(6, 4, padding="same", groups=3, use_bias=False),
    "conv1d_causal": lambda layers: layers.Conv1D(5, 3, padding="causal", dilation_rate=2, activation="tanh"),
    "maxpool1d_same": lambda layers: layers.MaxPooling1D(3, strides=2, padding="same"),
    "avgpool1d_valid": lambda layers: layers.AveragePooling1D(2),
    "global_average_pooling1d": lambda layers: layers.GlobalAveragePooling1D(),
    "global_max_pooling1d_keepdims": lambda layers: layers.GlobalMaxPooling1D(keepdims=True),
    "batch_normalization_of_a_sequence": lambda layers: layers.BatchNormalization(momentum=0.9),
    "prelu_per_channel": lambda layers: layers.PReLU(shared_axes=[1]),
    "prelu_per_step": lambda layers: layers.PReLU(shared_axes=[2]),
}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Keras' own numpy 2 deprecations
@pytest.mark.parametrize("variant", SEQUENCE_VARIANTS)
def test_sequence_layers_predict_like_keras(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variant: str) -> None:
    # Keras' sequences are (steps, channels); the imported model takes them so, and its 1-D layers
    # run over (channels, length) between transposes.
    generator = _generator(monkeypatch)
    import keras

    inp = keras.Input((11, 6))
    keras_model = keras.Model(inp, keras.layers.Dense(3)(SEQUENCE_VARIANTS[variant](keras.layers)(inp)))
    _predicts_like_keras(tmp_path, keras_model, generator, seed=5)


def _squeeze_excitation(layers: Any, x: Any) -> Any:
    gate = layers.GlobalAveragePooling2D(keepdims=True)(x)
    gate = layers.Conv2D(2, 1, activation="relu")(gate)
    return layers.Multiply()([x, layers.Conv2D(3, 1, activation="sigmoid")(gate)])


#: Merges of a (7, 6, 3) image with what is computed from it; Keras broadcasts a lower rank input
#: as if it had leading axes of 1.
MERGE_VARIANTS: dict[str, Callable[[Any, Any], Any]] = {
    "squeeze_excitation": _squeeze_excitation,
    "multiply_by_a_channel_vector": lambda layers, x: layers.Multiply()(
        [x, layers.Dense(3, activation="sigmoid")(layers.GlobalAveragePooling2D()(x))]),
    "multiply_three": lambda layers, x: layers.Multiply()(
        [x, layers.Conv2D(3, 1)(x), layers.Conv2D(3, 3, padding="same")(x)]),
    "subtract": lambda layers, x: layers.Subtract()([x, layers.Conv2D(3, 1)(x)]),
    "average_three": lambda layers, x: layers.Average()([x, layers.Conv2D(3, 1)(x), layers.Conv2D(3, 1)(x)]),
    "maximum_with_a_row": lambda layers, x: layers.Maximum()([x, layers.AveragePooling2D((7, 1))(x)]),
    "minimum": lambda layers, x: layers.Minimum()([x, layers.Conv2D(3, 1)(x)]),
    "add_a_channel_vector": lambda layers, x: layers.Add()([x, layers.Dense(3)(layers.GlobalAveragePooling2D()(x))]),
    "multiply_flattened_by_dense": lambda layers, x: layers.Multiply()(
        [layers.Flatten()(x), layers.Dense(126)(layers.Flatten()(x))]),
    "multiply_flattened_by_one_value": lambda layers, x: layers.Multiply()(
        [layers.Flatten()(x), layers.Dense(1)(layers.Flatten()(x))]),
    "multiply_sequence_by_a_vector": lambda layers, x: layers.Multiply()(
        [layers.Reshape((42, 3))(x), layers.Dense(3)(layers.GlobalAveragePooling2D()(x))]),
}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Keras' own numpy 2 deprecations
@pytest.mark.parametrize("variant", MERGE_VARIANTS)
def test_merges_predict_like_keras(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variant: str) -> None:
    generator = _generator(monkeypatch)
    import keras

    inp = keras.Input((7, 6, 3))
    keras_model = keras.Model(inp, MERGE_VARIANTS[variant](keras.layers, inp))
    _predicts_like_keras(tmp_path, keras_model, generator, seed=6, suffixes=(".keras", ".h5"),
                         layouts=("NCHW", "NHWC"))


def _gradient_passes(model: nn.Model, x: np.ndarray, name: str) -> None:
    """The imported model's gradient, to its input and every parameter, passes the checker."""
    inputs = opgrad.var("x", x.shape)
    params, buffers = model.param_vars(), model.buffer_vars()
    fn = opgrad.function([inputs, *params.values(), *buffers.values()],
                         model.forward(inputs, {**params, **buffers}))
    report = check_function(fn, [x, *model.params.values(), *model.buffers.values()], wrt=["x", *params], seed=0,
                            directions=2, name=name)
    assert report.passed, str(report)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Keras' own numpy 2 deprecations
def test_squeeze_excitation_gradient_passes_the_checker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    generator = _generator(monkeypatch)
    import keras

    inp = keras.Input((5, 4, 3))
    keras_model = keras.Model(inp, _squeeze_excitation(keras.layers, inp))
    model = _predicts_like_keras(tmp_path, keras_model, generator, seed=7)
    x = np.random.default_rng(7).standard_normal((2, 3, 5, 4))
    _gradient_passes(model, x, "imported squeeze-and-excitation")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Keras' own numpy 2 deprecations
def test_cropping_uneven_upsampling_and_global_max_pooling_from_h5_differentiate(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    generator = _generator(monkeypatch)
    import keras

    layers = keras.layers
    inp = keras.Input((6, 5, 2))
    x = layers.UpSampling2D((1, 2))(layers.Cropping2D(((1, 0), (0, 2)))(layers.Conv2D(3, 2)(inp)))
    pooled = layers.GlobalMaxPooling2D(keepdims=True)(layers.Conv2D(4, 1)(x))
    keras_model = keras.Model(inp, layers.Dense(2)(layers.Flatten()(pooled)))
    model = _predicts_like_keras(tmp_path, keras_model, generator, seed=9, suffixes=(".keras", ".h5"),
                                 layouts=("NCHW", "NHWC"))
    _gradient_passes(model, np.random.default_rng(9).standard_normal((2, 6, 5, 2)), "imported crop/upsample/max")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Keras' own numpy 2 deprecations
def test_selu_softsign_thresholded_relu_and_prelu_from_h5_differentiate(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    generator = _generator(monkeypatch)
    import keras

    layers = keras.layers
    inp = keras.Input((5, 4, 3))
    x = layers.Activation("softsign")(layers.Conv2D(4, 3, padding="same", activation="selu")(inp))
    x = layers.PReLU(shared_axes=[1, 2])(layers.ReLU(threshold=0.2, negative_slope=0.1, max_value=0.5)(x))
    x = layers.Dense(3)(layers.PReLU()(layers.Flatten()(layers.PReLU(shared_axes=[3])(x))))
    model = _predicts_like_keras(tmp_path, keras.Model(inp, x), generator, seed=10, suffixes=(".keras", ".h5"),
                                 layouts=("NCHW", "NHWC"))
    kinds = [layer.kind for layer in model.layers]
    assert kinds.count("prelu") == 2 and "where" in kinds, kinds  # per channel and per feature; per pixel
    _gradient_passes(model, np.random.default_rng(10).standard_normal((2, 5, 4, 3)), "imported activations")


def test_prelu_shared_axes_outside_the_input_are_refused(tmp_path: Path) -> None:
    def prelu(config: dict[str, Any]) -> None:
        entry = _layer(config, "stem_relu")
        entry["class_name"] = "PReLU"
        entry["config"] = {"name": "stem_relu", "shared_axes": [0, 1]}

    path = _rewrite_keras(FIXTURES / "residual.keras", tmp_path / "prelu.keras", prelu)
    with pytest.raises(KerasImportError, match=r"layer 'stem_relu' \(PReLU\): shared_axes=\[0, 1\] is not supported; "
                                               r"supported: None or axes 1..3 of the 4-d input"):
        load(path)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Keras' own numpy 2 deprecations
def test_transpose_same_with_output_padding_0_names_the_size_keras_computes(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    _generator(monkeypatch)
    import keras

    inp = keras.Input((7, 6, 3))
    out = keras.layers.Conv2DTranspose(2, 3, strides=2, padding="same", output_padding=0, name="up")(inp)
    assert tuple(out.shape[1:3]) == (13, 11)  # not the (14, 12) of output_padding=None
    keras.Model(inp, out).save(tmp_path / "up.keras")
    with pytest.raises(KerasImportError) as info:
        load(tmp_path / "up.keras")
    text = str(info.value)
    assert "layer 'up' (Conv2DTranspose): output_padding=[0, 0] is not supported with padding='same'" in text, text
    assert "(13x11 here), where output_padding=None gives in * stride (14x12 here), so 0 is not the same as None" \
        in text, text


def _masked_tokens_model(keras: Any, head: Callable[[Any, Any, Any], Any]) -> Any:
    """Two Embedding(mask_zero=True) of one token input, merged by ``head(layers, e1, e2)`` (its last layer
    named 'merge')."""
    tokens = keras.Input((6,), dtype="int32")
    first = keras.layers.Embedding(10, 4, mask_zero=True, name="first")(tokens)
    second = keras.layers.Embedding(10, 4, mask_zero=True, name="second")(tokens)
    return keras.Model(tokens, head(keras.layers, first, second))


#: Merges of masked embeddings: those that read Keras' mask are refused (naming what carries it);
#: a mask that a layer without masking support drops, or that a merge of a masked and an unmasked
#: input drops, changes nothing.
MASKED_MERGES: dict[str, tuple[Callable[[Any, Any, Any], Any], str | None]] = {
    "dense_keeps_the_mask": (
        lambda layers, a, b: layers.Multiply(name="merge")([layers.Dense(4)(a), b]),
        "layer 'merge' (Multiply): input 0 carries the mask of Embedding 'first'"),
    "conv1d_drops_the_mask": (
        lambda layers, a, b: layers.Multiply(name="merge")([layers.Conv1D(4, 1)(a), layers.Conv1D(4, 1)(b)]),
        None),
    "add_keeps_a_mask_of_every_input": (
        lambda layers, a, b: layers.Maximum(name="merge")([layers.Add()([a, b]), layers.Conv1D(4, 1)(a)]),
        "layer 'merge' (Maximum): input 0 carries the mask of Embedding 'first'"),
    "add_drops_a_mask_of_one_input": (
        lambda layers, a, b: layers.Minimum(name="merge")([layers.Add()([a, layers.Conv1D(4, 1)(b)]),
                                                           layers.Conv1D(4, 1)(a)]),
        None),
    "concatenate_keeps_a_mask_of_any_input": (
        lambda layers, a, b: layers.Multiply(name="merge")([layers.Conv1D(8, 1)(a),
                                                            layers.Concatenate()([layers.Conv1D(4, 1)(a), b])]),
        "layer 'merge' (Multiply): input 1 carries the mask of Embedding 'second'"),
}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Keras' own numpy 2 deprecations
@pytest.mark.filterwarnings("ignore::UserWarning")  # Keras' "does not support masking" when Conv1D drops it
@pytest.mark.parametrize("variant", MASKED_MERGES)
def test_a_merge_that_reads_a_mask_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variant: str) -> None:
    generator = _generator(monkeypatch)
    import keras

    head, refusal = MASKED_MERGES[variant]
    keras_model = _masked_tokens_model(keras, head)
    generator.randomize(keras_model, seed=8)
    tokens = np.array([[1, 2, 0, 0, 3, 0], [4, 5, 6, 7, 8, 9]])
    keras_model.save(tmp_path / "masked.keras")
    if refusal is None:
        imported = read(tmp_path / "masked.keras")
        np.testing.assert_allclose(imported.model.predict(tokens, backend="reference"),
                                   keras_model.predict(tokens, verbose=0), atol=1e-6, rtol=0)
        assert any("mask_zero is ignored: no layer of the model applies the mask" in n for n in imported.notes)
        return
    with pytest.raises(KerasImportError) as info:
        load(tmp_path / "masked.keras")
    assert refusal in str(info.value) and "rebuild the model with mask_zero=False" in str(info.value), info.value


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Keras' own numpy 2 deprecations
def test_a_masked_average_names_the_embedding_not_the_mask_layer(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    _generator(monkeypatch)
    import keras

    tokens = keras.Input((6,), dtype="int32")
    embedded = keras.layers.Embedding(10, 4, mask_zero=True, name="embed")(tokens)
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(keras.layers.Dense(3, name="dense")(embedded))
    keras.Model(tokens, pooled).save(tmp_path / "masked.keras")
    keras.Model(tokens, pooled).save(tmp_path / "masked.h5")
    for suffix in (".keras", ".h5"):
        with pytest.raises(KerasImportError) as info:
            load(tmp_path / f"masked{suffix}")
        text = str(info.value)
        assert "layer 'pool' (GlobalAveragePooling1D) reads the mask of Embedding 'embed' (mask_zero=True), which " \
               "Keras computes in layer 'not_equal" in text, text
        assert "rebuild the model with mask_zero=False" in text and "averages over every step" in text, text

    # Keras 2 passed the mask without writing it in the file: the pooling refuses the masked input itself.
    def implicit_mask(config: dict[str, Any]) -> None:
        layers = config["config"]["layers"]
        layers[:] = [entry for entry in layers if entry["class_name"] != "NotEqual"]
        _layer(config, "pool")["inbound_nodes"][0]["kwargs"] = {}

    path = _rewrite_keras(tmp_path / "masked.keras", tmp_path / "implicit.keras", implicit_mask)
    with pytest.raises(KerasImportError, match=r"layer 'pool' .*: input 0 carries the mask of Embedding 'embed'"):
        load(path)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Keras' own numpy 2 deprecations
def test_fixtures_regenerate_identically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = _generator(monkeypatch).generate(tmp_path)
    assert sorted(expected) == sorted(EXPECTED)
    for key, value in expected.items():
        np.testing.assert_allclose(value, EXPECTED[key], atol=1e-6, rtol=0, err_msg=key)
    for filename, name in FILES.items():
        fresh, committed = read(tmp_path / filename), read(FIXTURES / filename)
        assert fresh.model.get_config() == committed.model.get_config(), filename
        for key, value in committed.model.params.items():
            np.testing.assert_array_equal(fresh.model.params[key], value, err_msg=f"{filename} {key}")
        # what today's Keras writes imports to its own predictions
        out = fresh.model.predict(nchw(expected[f"{name}.x"]), backend="reference")
        out = softmax(out) if name != "embedding" else out
        np.testing.assert_allclose(out, expected[f"{name}.y"], atol=1e-5, rtol=0, err_msg=filename)


def test_hard_sigmoid_follows_the_keras_version_that_wrote_the_file(tmp_path: Path) -> None:
    # Keras 3's hard_sigmoid is relu6(x + 3) / 6, Keras 2's clip(0.2 x + 0.5, 0, 1).
    keras3 = _rewrite_keras(FIXTURES / "residual.keras", tmp_path / "hard.keras",
                            _set("dilated", activation="hard_sigmoid"))
    _as_keras2_h5(keras3, tmp_path / "hard.h5")
    x = nchw(EXPECTED["residual.x"])
    kinds = {}
    for path in (keras3, tmp_path / "hard.h5"):
        model = load(path)
        kinds[path.suffix] = [(layer.kind, layer.get_config()) for layer in model.layers
                              if "dilated" in str(layer.name)]
        assert np.isfinite(model.predict(x, backend="reference")).all()
    assert ("hardsigmoid", {}) in kinds[".keras"]
    assert ("arithmetic", {"op": "multiply", "operand": 0.2, "reverse": False}) in kinds[".h5"]
    assert ("arithmetic", {"op": "add", "operand": 0.5, "reverse": False}) in kinds[".h5"]
    assert ("clip", {"min_value": 0.0, "max_value": 1.0}) in kinds[".h5"]


def test_the_import_command_prints_the_notes_and_writes_only_checkpoints(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from opgrad import cli

    assert cli.main(["import", str(FIXTURES / "mnist_cnn.keras"), "--save", str(tmp_path / "cnn.npz")]) == 0
    assert "note: layer 'dense_1': the final softmax is left out" in capsys.readouterr().out
    assert cli.main(["import", str(FIXTURES / "mnist_cnn.keras"), "--save", str(tmp_path / "cnn.onnx")]) == 2
    assert capsys.readouterr().err.endswith("writes an opgrad checkpoint, not a .onnx file; name it .npz (opgrad "
                                            "export-onnx writes ONNX from a checkpoint)\n")
    assert not (tmp_path / "cnn.onnx").exists()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Keras' own numpy 2 deprecations
def test_lstm_and_gru_predict_and_fine_tune_like_keras(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keras' LSTM (every step) into its GRU (the last step): the kernels transposed, GRU's gates
    reordered; the import predicts as Keras on both backends and files, and one SGD step trains as
    Keras' fit does."""
    generator = _generator(monkeypatch)
    import keras

    inp = keras.Input((6, 3))
    x = keras.layers.LSTM(5, return_sequences=True, name="lstm")(inp)
    x = keras.layers.GRU(4, name="gru")(x)
    keras_model = keras.Model(inp, keras.layers.Dense(3, name="head")(x))
    model = _predicts_like_keras(tmp_path, keras_model, generator, seed=11, suffixes=(".keras", ".h5"))
    assert isinstance(model.get_layer("lstm"), nn.LSTM) and isinstance(model.get_layer("gru"), nn.GRU)
    rng = np.random.default_rng(12)
    images, labels = rng.standard_normal((4, 6, 3)).astype(np.float32), rng.integers(0, 3, 4)
    keras_model.compile(optimizer=keras.optimizers.SGD(0.5),
                        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    keras_model.fit(images, labels, batch_size=4, epochs=1, shuffle=False, verbose=0)
    trainer = nn.Trainer(model, nn.SGD(), lr=0.5, batch_size=4, backend="llvm")
    trainer.train_batch(images, labels)
    np.testing.assert_allclose(model.predict(images), np.asarray(keras_model.predict(images, verbose=0)),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Keras' own numpy 2 deprecations
def test_bidirectional_recurrent_layers_predict_like_keras(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bidirectional(LSTM, every step) into Bidirectional(GRU, the last step): the backward
    halves' weights as opgrad's _reverse parameters, in .keras (two weight groups) and .h5."""
    generator = _generator(monkeypatch)
    import keras

    inp = keras.Input((5, 3))
    x = keras.layers.Bidirectional(keras.layers.LSTM(4, return_sequences=True), name="bi_lstm")(inp)
    x = keras.layers.Bidirectional(keras.layers.GRU(3), name="bi_gru")(x)
    keras_model = keras.Model(inp, keras.layers.Dense(2, name="head")(x))
    model = _predicts_like_keras(tmp_path, keras_model, generator, seed=13, suffixes=(".keras", ".h5"))
    layer = model.get_layer("bi_lstm")
    assert isinstance(layer, nn.LSTM) and layer.bidirectional and layer.return_sequences
    assert model.get_layer("bi_gru").output_shape == (6,)
    inp = keras.Input((5, 3))
    summed = keras.Model(inp, keras.layers.Bidirectional(keras.layers.LSTM(4), merge_mode="sum")(inp))
    summed.save(tmp_path / "sum.keras")
    with pytest.raises(KerasImportError, match=r"merge_mode='sum' is not supported; supported: 'concat'"):
        load(tmp_path / "sum.keras")


def _keras_ops_arithmetic(keras: Any, x: Any) -> Any:
    """Every form Keras saves for arithmetic on a tensor: operators and keras.ops functions, the
    number first or second, and two tensors."""
    from keras import ops

    y = keras.layers.ReLU(6.0)(x + 3.0) * (1.0 / 6.0)  # MobileNetV3's hard sigmoid
    y = ops.subtract(3.0 - ops.add(y, 2.0), 1.0) / 2.0
    y = ops.divide(ops.multiply(y, x), 4.0) + y
    return ops.true_divide(2.0 / (y * y + 1.0), 3.0) - keras.layers.Conv2D(3, 1)(x)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Keras' own numpy 2 deprecations
def test_keras_ops_arithmetic_predicts_like_keras(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    generator = _generator(monkeypatch)
    import keras

    inp = keras.Input((5, 4, 3))
    keras_model = keras.Model(inp, _keras_ops_arithmetic(keras, inp))
    model = _predicts_like_keras(tmp_path, keras_model, generator, seed=14, suffixes=(".keras", ".h5"),
                                 layouts=("NCHW", "NHWC"))
    assert "3 subtract x" in {layer.config() for layer in model.layers}  # 3.0 - y: the number first


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Keras' own numpy 2 deprecations
def test_other_keras_ops_are_refused_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _generator(monkeypatch)
    import keras
    from keras import ops

    inp = keras.Input((4,))
    keras.Model(inp, keras.layers.Dense(2)(ops.abs(inp) + 1.0)).save(tmp_path / "abs.keras")
    with pytest.raises(KerasImportError, match=r"layer 'absolute' is the keras.ops operation 'Absolute', which the "
                                               r"importer does not support; supported keras.ops operations: Add, "):
        load(tmp_path / "abs.keras")
    short = keras.Input((3,))
    keras.Model([inp, short], inp + ops.tile(short, 2)[:, :4]).save(tmp_path / "ranks.keras")
    with pytest.raises(KerasImportError, match=r"keras.ops operation 'Tile'"):
        load(tmp_path / "ranks.keras")
    features = keras.Input((2, 4))
    keras.Model([inp, features], features * inp).save(tmp_path / "ranks.keras")
    with pytest.raises(KerasImportError, match=r"\(2, 4\) and \(4,\) differ in rank"):
        load(tmp_path / "ranks.keras")


def _scale_depthwise_kernels(keras: Any, keras_model: Any) -> None:
    """Depthwise kernels at the scale of their 3x3 fan-in: the fixtures' randomize divides them by
    the channel count too, which leaves a deep MobileNet's output independent of its input."""
    for layer in keras_model.layers:
        if isinstance(layer, keras.layers.DepthwiseConv2D):
            kernel, *rest = layer.get_weights()
            layer.set_weights([kernel * np.sqrt(kernel.shape[2]), *rest])


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Keras' own numpy 2 deprecations
@pytest.mark.parametrize("preprocessing", [True, False])
def test_mobilenet_v3_small_predicts_like_keras(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                preprocessing: bool) -> None:
    """keras.applications.MobileNetV3Small: its hard sigmoid and hard swish are keras.ops arithmetic;
    include_preprocessing adds a Rescaling of [0, 255] images."""
    generator = _generator(monkeypatch)
    import keras

    keras_model = keras.applications.MobileNetV3Small(input_shape=(32, 32, 3), weights=None, classes=10,
                                                      classifier_activation=None,
                                                      include_preprocessing=preprocessing)
    generator.randomize(keras_model, seed=15)
    _scale_depthwise_kernels(keras, keras_model)
    x = np.random.default_rng(15).standard_normal((2, 32, 32, 3)).astype(np.float32) * (60 if preprocessing else 1)
    expected = np.asarray(keras_model.predict(x, verbose=0))
    keras_model.save(tmp_path / "mobilenet.keras")
    layout, backend = ("NHWC", "llvm") if preprocessing else ("NCHW", "reference")
    model = load(tmp_path / "mobilenet.keras", layout=layout)
    out = model.predict(x if layout == "NHWC" else nchw(x), backend=backend)
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=0)
    assert np.abs(expected[0] - expected[1]).max() > 1e-5  # the output depends on the input


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Keras' own numpy 2 deprecations
def test_dict_inputs_and_outputs_take_keras_flatten_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """keras.Model(inputs={...}, outputs={...}): the imported model's inputs and outputs are in the
    sorted order of the keys (Keras' own flatten order), which input_names and output_names give."""
    generator = _generator(monkeypatch)
    import keras

    meta, image = keras.Input((3,), name="meta"), keras.Input((4, 4, 2), name="image")
    pooled = keras.layers.GlobalAveragePooling2D()(keras.layers.Conv2D(3, 1)(image))
    joined = keras.layers.Concatenate()([meta, pooled])
    keras_model = keras.Model(inputs={"meta": meta, "image": image},
                              outputs={"score": keras.layers.Dense(1)(meta), "classes": keras.layers.Dense(2)(joined)})
    generator.randomize(keras_model, seed=16)
    rng = np.random.default_rng(16)
    x = {"meta": rng.standard_normal((2, 3)).astype(np.float32),
         "image": rng.standard_normal((2, 4, 4, 2)).astype(np.float32)}
    expected = keras_model.predict(x, verbose=0)
    for suffix in (".keras", ".h5"):
        keras_model.save(tmp_path / f"model{suffix}")
        model = load(tmp_path / f"model{suffix}")
        assert model.input_names == ["image", "meta"] and model.output_names == ["classes", "score"]
        for backend in ("reference", "llvm"):
            out = model.predict([nchw(x["image"]), x["meta"]], backend=backend)
            for name, array in zip(model.output_names, out):
                np.testing.assert_allclose(array, expected[name], atol=1e-5, rtol=0, err_msg=f"{suffix} {backend}")


#: Layers that change their input only while Keras trains, between two convolutions.
AUGMENTATIONS = {
    "RandomFlip": lambda layers: layers.RandomFlip(),
    "RandomRotation": lambda layers: layers.RandomRotation(0.2, fill_mode="nearest"),
    "RandomZoom": lambda layers: layers.RandomZoom(0.1, 0.2),
    "RandomTranslation": lambda layers: layers.RandomTranslation(0.1, 0.1),
    "RandomContrast": lambda layers: layers.RandomContrast(0.3),
    "RandomBrightness": lambda layers: layers.RandomBrightness(0.2, value_range=(-3, 3)),
    "GaussianNoise": lambda layers: layers.GaussianNoise(0.5),
    "GaussianDropout": lambda layers: layers.GaussianDropout(0.3),
    "AlphaDropout": lambda layers: layers.AlphaDropout(0.3),
    "RandomCrop_to_the_input_size": lambda layers: layers.RandomCrop(5, 4),
}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Keras' own numpy 2 deprecations
@pytest.mark.parametrize("variant", AUGMENTATIONS)
def test_augmentation_and_noise_layers_are_left_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    variant: str) -> None:
    generator = _generator(monkeypatch)
    import keras

    inp = keras.Input((5, 4, 3))
    x = AUGMENTATIONS[variant](keras.layers)(keras.layers.Conv2D(3, 1)(inp))
    keras_model = keras.Model(inp, keras.layers.Conv2D(2, 1)(x))
    # Keras' .h5 writer fails on RandomBrightness (it deep-copies a module the layer holds).
    suffixes = (".keras",) if variant == "RandomBrightness" else (".keras", ".h5")
    model = _predicts_like_keras(tmp_path, keras_model, generator, seed=17, suffixes=suffixes,
                                 layouts=("NCHW", "NHWC"))
    assert {type(layer).__name__ for layer in model.layers} == {"Conv2D", "Permute"}  # NHWC's transposes
    notes = read(tmp_path / "model.keras").notes
    assert len(notes) == 1 and "left out: " in notes[0] and "opgrad does not apply it" in notes[0]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Keras' own numpy 2 deprecations
def test_a_random_crop_to_another_size_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _generator(monkeypatch)
    import keras

    inp = keras.Input((6, 5, 3))
    keras.Model(inp, keras.layers.RandomCrop(4, 3)(inp)).save(tmp_path / "crop.keras")
    with pytest.raises(KerasImportError, match=r"\(RandomCrop\): crops \(6, 5, 3\) to 4x3; at inference Keras does "
                                               r"not crop"):
        load(tmp_path / "crop.keras")


#: Normalization of a (5, 4, 3) image or 7 features, adapted to data with other statistics than
#: the input's, or given its mean and variance.
NORMALIZATIONS = {
    "image_channels": ((5, 4, 3), dict(), True),
    "image_pixels_and_channels": ((5, 4, 3), dict(axis=(2, 3)), True),
    "image_one_statistic": ((5, 4, 3), dict(axis=None), True),
    "image_rows_inverted": ((5, 4, 3), dict(axis=1, invert=True), True),
    "features": ((7,), dict(), True),
    "features_given": ((7,), dict(mean=np.linspace(-1, 1, 7).tolist(), variance=np.linspace(0, 4, 7).tolist()), False),
    "image_given_one_number": ((5, 4, 3), dict(mean=0.5, variance=2.0), False),
}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Keras' own numpy 2 deprecations
@pytest.mark.parametrize("variant", NORMALIZATIONS)
def test_normalization_predicts_like_keras(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variant: str) -> None:
    generator = _generator(monkeypatch)
    import keras

    shape, options, adapt = NORMALIZATIONS[variant]
    layer = keras.layers.Normalization(**options)
    if adapt:
        rng = np.random.default_rng(18)
        layer.adapt(rng.normal(2.0, 3.0, (16, *shape)).astype(np.float32) * rng.uniform(0.2, 2.0, shape[-1]))
    inp = keras.Input(shape)
    keras_model = keras.Model(inp, layer(inp))
    suffixes = (".keras", ".h5") if adapt else (".keras",)  # Keras cannot read a given mean back from .h5
    model = _predicts_like_keras(tmp_path, keras_model, generator, seed=18, suffixes=suffixes,
                                 layouts=("NCHW", "NHWC") if len(shape) == 3 else ("NCHW",), randomize=False)
    assert model.num_params == 0  # fixed statistics: Keras does not train them either


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Keras' own numpy 2 deprecations
def test_time_distributed_dense_is_a_dense_over_the_last_axis(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    generator = _generator(monkeypatch)
    import keras

    inp = keras.Input((5, 6))
    x = keras.layers.TimeDistributed(keras.layers.Dense(4, activation="tanh"), name="per_step")(inp)
    keras_model = keras.Model(inp, keras.layers.Dense(2)(keras.layers.Flatten()(x)))
    model = _predicts_like_keras(tmp_path, keras_model, generator, seed=19, suffixes=(".keras", ".h5"))
    assert isinstance(model.get_layer("per_step"), nn.Dense)
    image = keras.Input((5, 4, 3))
    wrapped = keras.layers.TimeDistributed(keras.layers.Conv1D(2, 1))(image)
    keras.Model(image, wrapped).save(tmp_path / "conv.keras")
    with pytest.raises(KerasImportError, match=r"\(TimeDistributed\): layer='Conv1D' is not supported; supported: "
                                               r"Dense"):
        load(tmp_path / "conv.keras")
