"""ONNX interop: PyTorch-exported models load and predict like PyTorch, their gradients pass the
checker, they fine-tune with compiled kernels, and opgrad models go back out as ONNX that
onnxruntime runs with opgrad's outputs. Every node kind is checked against onnxruntime on a small
hand-built graph; every refused case names the node, its op type and the attribute."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from optional import require

onnx = require("onnx", "the ONNX importer reads files with it (pip install 'opgrad[interop]')")
ort = require("onnxruntime", "the ONNX tests run exported models in it")

import opgrad  # noqa: E402
from opgrad import cli, nn  # noqa: E402
from opgrad import onnx as opgrad_onnx  # noqa: E402
from opgrad.checks import check_function  # noqa: E402
from opgrad.data import load_embedded_mnist  # noqa: E402
from opgrad.nn.losses import softmax_cross_entropy  # noqa: E402
from opgrad.onnx.exporter import to_onnx  # noqa: E402
from opgrad.onnx.table import OnnxError  # noqa: E402

TensorProto, helper, numpy_helper = onnx.TensorProto, onnx.helper, onnx.numpy_helper

FIXTURES = Path(__file__).parent / "fixtures"
TORCH_MODELS = ["onnx_resnet", "onnx_mlp"]
INT_MAX = 2**63 - 1


def run_onnxruntime(path: Path | str, *arrays: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {i.name: a for i, a in zip(session.get_inputs(), arrays)}
    return [np.asarray(o) for o in session.run(None, feeds)]


def as_list(outputs: Any) -> list[np.ndarray]:
    return outputs if isinstance(outputs, list) else [outputs]


def expected(name: str) -> Any:
    return np.load(FIXTURES / f"{name}_expected.npz")


# ----- models exported by PyTorch -----


@pytest.mark.parametrize("name", TORCH_MODELS)
def test_pytorch_exports_predict_like_pytorch(name: str) -> None:
    model = opgrad_onnx.load(FIXTURES / f"{name}.onnx")
    data = expected(name)
    assert isinstance(model, nn.Model) and model.input_shape == (1, 28, 28) and model.output_shape == (10,)
    ours = model.predict(data["x"], batch_size=2, backend="reference")  # a partial last batch too
    np.testing.assert_allclose(ours, data["y"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(run_onnxruntime(FIXTURES / f"{name}.onnx", data["x"])[0], data["y"], atol=1e-5)
    if name == "onnx_mlp":  # the compiled evaluation step too (the ResNet's is compiled by the fine-tuning test)
        np.testing.assert_allclose(model.predict(data["x"], batch_size=2, backend="llvm"), data["y"], atol=1e-5)


def test_imported_resnet_keeps_its_structure_and_checkpoints(tmp_path: Path) -> None:
    model = opgrad_onnx.load(FIXTURES / "onnx_resnet.onnx")
    kinds = [layer.kind for layer in model.layers]
    for kind in ("conv", "batchnorm", "relu", "maxpool", "add", "avgpool", "globalpool", "flatten", "dense"):
        assert kind in kinds
    assert model.num_params == 2642 and len(model.buffers) == 8
    model.save(tmp_path / "resnet.npz")
    again = nn.load(tmp_path / "resnet.npz")
    assert again.get_config() == model.get_config()
    x = expected("onnx_resnet")["x"]
    np.testing.assert_array_equal(again.predict(x, backend="reference"), model.predict(x, backend="reference"))


@pytest.mark.parametrize("name", TORCH_MODELS)
def test_imported_model_gradient_passes_the_checker(name: str) -> None:
    """The training loss (batch statistics in BatchNorm, as fine-tuning uses) differentiated by opgrad."""
    model = opgrad_onnx.load(FIXTURES / f"{name}.onnx")
    x, labels = opgrad.var("x", (2, 1, 28, 28)), opgrad.var("labels", (2,), "int64")
    params, buffers = model.param_vars(), model.buffer_vars()
    outputs, _ = model.call([x], {**params, **buffers}, nn.ForwardContext(training=True))
    loss = opgrad.function([x, labels, *params.values(), *buffers.values()], softmax_cross_entropy(outputs[0], labels))
    arrays = [expected(name)["x"][:2], np.array([3, 7]), *model.params.values(), *model.buffers.values()]
    report = check_function(loss, arrays, wrt=list(params), seed=0, max_examples=1, directions=2)
    assert report.passed, str(report)


def test_imported_resnet_fine_tunes_with_compiled_kernels() -> None:
    model = opgrad_onnx.load(FIXTURES / "onnx_resnet.onnx")
    data = expected("onnx_resnet")
    np.testing.assert_allclose(model.predict(data["x"], batch_size=5, backend="llvm"), data["y"], atol=1e-5)
    before = {k: v.copy() for k, v in model.params.items()}
    buffers = dict(model.buffers)
    mnist = load_embedded_mnist()
    images, labels = mnist.train_images[:32], mnist.train_labels[:32]
    trainer = nn.Trainer(model, nn.Adam(), lr=1e-2, batch_size=32, backend="llvm", params=model.params)
    trainer.state = {**trainer.state, **buffers}
    losses = [trainer.train_batch(images, labels) for _ in range(10)]
    assert all(later < earlier for earlier, later in itertools.pairwise(losses)), losses  # one batch, learned
    assert losses[-1] < losses[0] - 0.25, losses
    assert any(not np.array_equal(before[k], model.params[k]) for k in before)
    assert not np.array_equal(buffers["stem_stem_1_BatchNormalization.running_mean"],
                              model.buffers["stem_stem_1_BatchNormalization.running_mean"])


# ----- opgrad -> ONNX -> onnxruntime -----


def _perturbed(model: nn.Model, seed: int = 0) -> nn.Model:
    """Weights and running statistics away from their initial values, so BatchNorm's matter."""
    rng = np.random.default_rng(seed)
    model.params = {k: (v + 0.05 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in model.params.items()}
    if model.buffers:
        model.buffers = {k: (rng.uniform(0.5, 1.5, v.shape) if k.endswith("var") else
                             rng.uniform(-0.2, 0.2, v.shape)).astype(np.float32) for k, v in model.buffers.items()}
    return model


@pytest.mark.parametrize("name", ["seed-cnn", "resnet", "mlp", "keras-mnist"])
def test_builtin_models_round_trip_through_onnxruntime(name: str, tmp_path: Path) -> None:
    model = _perturbed(nn.build_model(name))
    path = tmp_path / f"{name}.onnx"
    opgrad_onnx.save(model, path)
    x = np.random.default_rng(1).random((3, 1, 28, 28), dtype=np.float32)
    ours = model.predict(x, batch_size=3, backend="reference")
    np.testing.assert_allclose(run_onnxruntime(path, x)[0], ours, rtol=1e-5, atol=1e-5)
    back = opgrad_onnx.load(path)
    np.testing.assert_allclose(back.predict(x, batch_size=3, backend="reference"), ours, rtol=1e-6, atol=1e-6)


def test_a_sequence_model_goes_out_as_onnx_and_back(tmp_path: Path) -> None:
    inp = nn.Input((3, 40))
    x = nn.Conv1D(8, 5, strides=2, padding="same", activation="relu")(inp)
    x = nn.BatchNorm2D()(nn.Conv1D(8, 3, padding=2, dilation_rate=2, groups=2)(x))
    x = nn.AvgPool1D(3, strides=2, padding=1, ceil_mode=True)(nn.MaxPool1D(2, padding=1)(x))
    model = _perturbed(nn.Model(inp, nn.Dense(4)(nn.Flatten()(x))))
    path = tmp_path / "sequence.onnx"
    opgrad_onnx.save(model, path)
    x = np.random.default_rng(2).standard_normal((3, 3, 40)).astype(np.float32)
    ours = model.predict(x, batch_size=3, backend="reference")
    np.testing.assert_allclose(run_onnxruntime(path, x)[0], ours, rtol=1e-5, atol=1e-5)
    back = opgrad_onnx.load(path)
    assert [type(layer).__name__ for layer in back.layers][:2] == ["Conv1D", "BatchNorm2D"] or any(
        type(layer).__name__ == "Conv1D" for layer in back.layers)
    np.testing.assert_allclose(back.predict(x, batch_size=3, backend="reference"), ours, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_recurrent_layers_go_out_as_onnx_lstm_and_gru_nodes(kind: str, tmp_path: Path) -> None:
    """A bidirectional layer over every step into a one-way layer without recurrent bias over the
    last: onnxruntime's LSTM / GRU give opgrad's outputs."""
    layer = getattr(nn, kind)
    inp = nn.Input((6, 3))
    x = layer(4, return_sequences=True, bidirectional=True)(inp)
    x = layer(5, recurrent_bias=False)(x)
    model = _perturbed(nn.Model(inp, nn.Dense(2)(x), name="recurrent"))
    path = tmp_path / "recurrent.onnx"
    opgrad_onnx.save(model, path)
    x = np.random.default_rng(3).standard_normal((3, 6, 3)).astype(np.float32)
    assert [node.op_type for node in onnx.load(path).graph.node].count(kind) == 2
    np.testing.assert_allclose(run_onnxruntime(path, x)[0], model.predict(x, batch_size=3, backend="reference"),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_a_transformer_block_goes_out_as_onnx(causal: bool, tmp_path: Path) -> None:
    """MultiHeadAttention (with a padding mask; causal or not, with and without biases) in a
    residual block with LayerNorm and GELU: onnxruntime gives opgrad's outputs."""
    tokens, mask = nn.Input((6,), dtype="int64", name="tokens"), nn.Input((6,), name="mask")
    x = nn.Embedding(20, 8)(tokens)
    x = nn.LayerNorm()(nn.Add()([x, nn.MultiHeadAttention(2, causal=causal, padding_mask=True)([x, mask])]))
    x = nn.Add()([x, nn.MultiHeadAttention(4, use_bias=False)(x)])
    model = _perturbed(nn.Model([tokens, mask], nn.Dense(3)(nn.Dense(8, activation="gelu")(x)), name="block"))
    path = tmp_path / "block.onnx"
    opgrad_onnx.save(model, path)
    rng = np.random.default_rng(4)
    ids, keep = rng.integers(0, 20, (3, 6)), np.ones((3, 6), np.float32)
    keep[0, 4:] = keep[2, 1:] = 0
    np.testing.assert_allclose(run_onnxruntime(path, ids, keep)[0],
                               model.predict([ids, keep], batch_size=3, backend="reference"), rtol=1e-5, atol=2e-6)


def test_an_encoder_decoder_goes_out_as_onnx_and_its_description_back(tmp_path: Path) -> None:
    """Cross-attention (queries from a decoder's 4 positions, keys and values from an encoder's 6,
    padded) in onnxruntime and through nn.save / nn.load."""
    source, target = nn.Input((6, 8), name="source"), nn.Input((4, 8), name="target")
    keep = nn.Input((6,), name="keep")
    memory = nn.LayerNorm()(nn.Add()([source, nn.MultiHeadAttention(2)(source)]))
    attended = nn.MultiHeadAttention(2, key_value=True, padding_mask=True, name="cross")([target, memory, keep])
    model = _perturbed(nn.Model([source, target, keep], nn.Dense(5)(nn.Add()([target, attended])), name="seq2seq"))
    rng = np.random.default_rng(5)
    src, tgt = rng.standard_normal((3, 6, 8)).astype(np.float32), rng.standard_normal((3, 4, 8)).astype(np.float32)
    mask = np.ones((3, 6), np.float32)
    mask[1, 3:] = 0
    ours = model.predict([src, tgt, mask], batch_size=3, backend="reference")
    opgrad_onnx.save(model, tmp_path / "seq2seq.onnx")
    np.testing.assert_allclose(run_onnxruntime(tmp_path / "seq2seq.onnx", src, tgt, mask)[0], ours, rtol=1e-5,
                               atol=2e-6)
    model.save(tmp_path / "seq2seq.npz")
    loaded = nn.load(tmp_path / "seq2seq.npz")
    assert loaded.get_layer("cross").key_value
    np.testing.assert_array_equal(loaded.predict([src, tgt, mask], batch_size=3, backend="reference"), ours)


@pytest.mark.parametrize("name", TORCH_MODELS)
def test_imported_models_go_back_out_as_onnx(name: str, tmp_path: Path) -> None:
    model = opgrad_onnx.load(FIXTURES / f"{name}.onnx")
    opgrad_onnx.save(model, tmp_path / "out.onnx")
    data = expected(name)
    np.testing.assert_allclose(run_onnxruntime(tmp_path / "out.onnx", data["x"])[0], data["y"], atol=1e-5)


def generic_layers_model() -> nn.Model:
    """Every opgrad layer kind the importer produces or the exporter writes, in one graph."""
    inp = nn.Input((3, 8, 8), name="images")
    x = nn.Conv2D(4, 3, padding="same", strides=2, activation="gelu")(inp)
    x = nn.Conv2DTranspose(4, 3, strides=2, padding="same", activation="tanh")(x)
    x = nn.BatchNorm2D()(nn.Pad([(0, 0), (1, 0), (0, 2)], mode="reflect")(x))
    up = nn.Resize((6, 10), method="bilinear")(nn.Slice([None, None, 1], [None, None, -1], [1, 1, 1])(x))
    near = nn.UpSampling2D(2)(nn.AvgPool2D(2, padding="same")(nn.MaxPool2D(3, strides=1, padding=1)(x)))
    both = nn.Concatenate(axis=1)([nn.Slice([None, 0, 0], [None, 6, 10])(near), up])
    clipped = nn.Clip(0.1, 3.0)(nn.Sigmoid()(nn.Rescaling(0.5, 0.25)(nn.ZeroPadding2D(((0, 1), (2, 0)))(both))))
    scaled = nn.Arithmetic("divide", operand=[[[2.0]]], reverse=True)(clipped)
    shifted = nn.Arithmetic("subtract", operand_shape=(8, 1, 1))(scaled)
    mixed = nn.Elementwise("multiply")([shifted, nn.Reduce("mean", [2, 3])(shifted)])
    pooled = nn.Flatten()(nn.GlobalPool2D("max")(nn.Permute((1, 3, 2))(mixed)))
    flat = nn.Reshape((2, -1))(nn.LeakyReLU(0.2)(nn.Dense(8)(pooled)))
    logits = nn.Dense(10)(nn.Flatten()(nn.Softmax(axis=1)(nn.Reduce("sum", [-1])(flat))))
    side = nn.LogSoftmax()(nn.Dense(5, activation="relu")(nn.Flatten()(nn.GlobalAvgPool2D()(x))))
    return nn.Model(inp, [logits, side], name="generic")


def test_generic_layers_export_import_and_checkpoint(tmp_path: Path) -> None:
    model = _perturbed(generic_layers_model())
    x = np.random.default_rng(2).random((2, 3, 8, 8), dtype=np.float32)
    ours = as_list(model.predict(x, batch_size=2, backend="reference"))
    opgrad_onnx.save(model, tmp_path / "generic.onnx")
    for theirs, mine in zip(run_onnxruntime(tmp_path / "generic.onnx", x), ours):
        np.testing.assert_allclose(theirs, mine, rtol=1e-5, atol=1e-5)
    assert onnx.load(tmp_path / "generic.onnx").opset_import[0].version == 20  # the first opset with Gelu
    opgrad_onnx.save(model, tmp_path / "generic17.onnx", opset=17)  # GELU as its erf formula
    for theirs, mine in zip(run_onnxruntime(tmp_path / "generic17.onnx", x), ours):
        np.testing.assert_allclose(theirs, mine, rtol=1e-5, atol=1e-5)
    back = opgrad_onnx.load(tmp_path / "generic.onnx")
    assert back.num_params == model.num_params  # fixed constants come back fixed, weights as weights
    for again, mine in zip(as_list(back.predict(x, batch_size=2, backend="reference")), ours):
        np.testing.assert_allclose(again, mine, rtol=1e-5, atol=1e-6)
    model.save(tmp_path / "generic.npz")
    loaded = nn.load(tmp_path / "generic.npz")
    assert loaded.get_config() == model.get_config()
    for again, mine in zip(as_list(loaded.predict(x, batch_size=2, backend="reference")), ours):
        np.testing.assert_array_equal(again, mine)


# ----- every node kind against onnxruntime -----


def build(nodes: list[Any], input_shape: tuple[int, ...], initializers: dict[str, Any] | None = None, *,
          outputs: tuple[str, ...] = ("y",), opset: int = 17, input_type: int = TensorProto.FLOAT,
          batch: Any = "N") -> Any:
    graph = helper.make_graph(
        nodes, "case", [helper.make_tensor_value_info("x", input_type, [batch, *input_shape])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in outputs],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in (initializers or {}).items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    try:  # the checker wants the outputs' shapes: let ONNX's shape inference write them
        return onnx.shape_inference.infer_shapes(model, strict_mode=True)
    except Exception:  # a graph made to be refused; it keeps its outputs untyped
        return model


def node(op_type: str, inputs: list[str], outputs: list[str] | None = None, suffix: str = "", **attrs: Any) -> Any:
    return helper.make_node(op_type, inputs, outputs or ["y"], name=f"my_{op_type.lower()}{suffix}", **attrs)


def _rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


CASES: dict[str, tuple[list[Any], tuple[int, ...], dict[str, Any]] | tuple[Any, ...]] = {
    # Sequences (N, C, L): torch's Conv1d, MaxPool1d, AvgPool1d and BatchNorm1d export these.
    "1-D convolutions: strided, dilated, grouped, padded unevenly, SAME_UPPER": (
        [node("Conv", ["x", "w", "b"], ["a"], strides=[2], dilations=[2], pads=[2, 2]),
         node("Conv", ["a", "v"], ["c"], suffix="2", group=2, pads=[1, 2]),
         node("Conv", ["c", "u"], suffix="3", auto_pad="SAME_UPPER", kernel_shape=[4])],
        (4, 17), {"w": _rand(6, 4, 3), "b": _rand(6), "v": _rand(4, 3, 3, seed=1), "u": _rand(3, 4, 4, seed=2)}),
    "1-D pools and batch normalization": (
        [node("MaxPool", ["x"], ["m"], kernel_shape=[3], strides=[2], pads=[1, 1]),
         node("AveragePool", ["m"], ["a"], kernel_shape=[2], pads=[1, 1], count_include_pad=1),
         node("AveragePool", ["a"], ["p"], suffix="2", kernel_shape=[2], pads=[1, 1], ceil_mode=1),
         node("BatchNormalization", ["p", "g", "b", "mu", "var"])],
        (3, 19), {"g": _rand(3), "b": _rand(3, seed=1), "mu": _rand(3, seed=2),
                  "var": np.abs(_rand(3, seed=3)) + 0.5}),
    "conv groups, dilations, asymmetric pads": (
        [node("Conv", ["x", "w", "b"], group=2, dilations=[2, 1], strides=[2, 1], pads=[1, 2, 0, 1])],
        (4, 9, 9), {"w": _rand(6, 2, 3, 3), "b": _rand(6)}),
    "conv SAME_LOWER": ([node("Conv", ["x", "w"], auto_pad="SAME_LOWER", strides=[2, 2])], (3, 8, 7),
                        {"w": _rand(4, 3, 3, 3)}),
    "conv SAME_UPPER": ([node("Conv", ["x", "w"], auto_pad="SAME_UPPER", strides=[2, 2])], (3, 8, 7),
                        {"w": _rand(4, 3, 3, 3)}),
    "conv transpose": ([node("ConvTranspose", ["x", "w", "b"], strides=[2, 2], pads=[1, 1, 1, 1],
                             output_padding=[1, 1])], (3, 4, 5), {"w": _rand(3, 4, 3, 3), "b": _rand(4)}),
    "conv transpose groups, output_shape": (
        [node("ConvTranspose", ["x", "w"], group=2, strides=[2, 2], output_shape=[6, 7])], (4, 4, 4),
        {"w": _rand(4, 1, 2, 2)}),
    "gemm alpha, beta, transB=0": ([node("Gemm", ["x", "w", "c"], alpha=0.5, beta=2.0)], (5,),
                                   {"w": _rand(5, 3), "c": _rand(1, 3)}),
    "matmul + add initializer": ([node("MatMul", ["x", "w"], ["h"]), node("Add", ["h", "b"])], (5,),
                                 {"w": _rand(5, 4), "b": _rand(4)}),
    "sub/div against constants": (
        [helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.array(1.5, np.float32))),
         node("Sub", ["c", "x"], ["h"]), node("Div", ["h", "d"])], (3, 2, 2), {"d": _rand(3, 1, 1) + 3}),
    "mul between tensors, broadcast": ([node("ReduceMean", ["x"], ["m"], axes=[2, 3], keepdims=1),
                                        node("Mul", ["x", "m"])], (3, 4, 5), {}),
    "softmax axis 1, logsoftmax": ([node("Softmax", ["x"], ["s"], axis=1), node("LogSoftmax", ["s"])], (3, 4), {}),
    "softmax opset 11 flattens": ([node("Softmax", ["x"], axis=1)], (3, 4), {}, 11),
    "maxpool asymmetric pads": ([node("MaxPool", ["x"], kernel_shape=[3, 3], strides=[2, 2], pads=[0, 1, 1, 0])],
                                (2, 7, 8), {}),
    "maxpool SAME_UPPER": ([node("MaxPool", ["x"], kernel_shape=[2, 3], strides=[2, 2], auto_pad="SAME_UPPER")],
                           (2, 7, 8), {}),
    "avgpool count_include_pad": ([node("AveragePool", ["x"], kernel_shape=[3, 3], strides=[2, 2],
                                        pads=[1, 1, 1, 1], count_include_pad=1)], (2, 7, 8), {}),
    "avgpool SAME_UPPER excludes pads": ([node("AveragePool", ["x"], kernel_shape=[3, 3], strides=[2, 2],
                                               auto_pad="SAME_UPPER")], (2, 7, 8), {}),
    "avgpool ceil_mode without effect": ([node("AveragePool", ["x"], kernel_shape=[2, 2], strides=[2, 2],
                                               ceil_mode=1)], (2, 8, 6), {}),
    "global pools, concat, flatten": ([node("GlobalMaxPool", ["x"], ["a"]), node("GlobalAveragePool", ["x"], ["b"]),
                                       node("Concat", ["a", "b"], ["c"], axis=1), node("Flatten", ["c"], axis=1)],
                                      (3, 4, 5), {}),
    "transpose, reshape [0, -1]": ([node("Transpose", ["x"], ["t"], perm=[0, 2, 3, 1]),
                                    node("Reshape", ["t", "s"])], (3, 4, 5), {"s": _i64(0, -1)}),
    "split, slice with a negative step": (
        [node("Split", ["x", "sizes"], ["a", "b"], axis=1), node("Slice", ["b", "st", "en", "ax", "sp"], ["y"])],
        (4, 3, 7), {"sizes": _i64(1, 3), "st": _i64(-1, 0), "en": _i64(-INT_MAX, INT_MAX), "ax": _i64(3, 0),
                    "sp": _i64(-2, 1)}, 17, ("a", "y")),
    "pad constant value": ([node("Pad", ["x", "p", "v"], mode="constant")], (2, 3, 4),
                           {"p": _i64(0, 0, 1, 2, 0, 0, 2, 1), "v": np.array(0.5, np.float32)}),
    "pad reflect": ([node("Pad", ["x", "p"], mode="reflect")], (2, 3, 4), {"p": _i64(0, 0, 1, 2, 0, 0, 2, 1)}),
    "pad edge with axes": ([node("Pad", ["x", "p", "", "a"], mode="edge")], (2, 3, 4),
                           {"p": _i64(1, 0, 2, 3), "a": _i64(2, 3)}, 18),
    "resize nearest": ([node("Resize", ["x", "", "s"], mode="nearest", coordinate_transformation_mode="asymmetric",
                             nearest_mode="floor")], (2, 3, 4), {"s": np.array([1, 1, 2, 3], np.float32)}),
    "resize linear pytorch_half_pixel": ([node("Resize", ["x", "", "s"], mode="linear",
                                               coordinate_transformation_mode="pytorch_half_pixel")],
                                         (2, 3, 4), {"s": np.array([1, 1, 2, 1.5], np.float32)}),
    "resize linear align_corners": ([node("Resize", ["x", "", "s"], mode="linear",
                                          coordinate_transformation_mode="align_corners")],
                                    (2, 3, 4), {"s": np.array([1, 1, 3, 2], np.float32)}),
    "reduce sum (axes input) and max": ([node("ReduceSum", ["x", "a"], ["s"], keepdims=0),
                                         node("ReduceMax", ["s"], axes=[-1], keepdims=1)], (2, 3, 4),
                                        {"a": _i64(2)}),
    "clip, cast, identity, dropout": (
        [helper.make_node("Constant", [], ["lo"], value_float=-0.5), node("Clip", ["x", "lo"], ["c"]),
         node("Cast", ["c"], ["d"], to=TensorProto.FLOAT), node("Identity", ["d"], ["e"]),
         node("Dropout", ["e", "r"])], (3, 4), {"r": np.array(0.3, np.float32)}),
    "activations": ([node("LeakyRelu", ["x"], ["a"], alpha=0.2), node("Sigmoid", ["a"], ["b"]),
                     node("Tanh", ["b"], ["c"]), node("Relu", ["c"])], (3, 4), {}),
    "unsqueeze, squeeze": ([node("Unsqueeze", ["x", "a"], ["u"]), node("Squeeze", ["u", "b"])], (6,),
                           {"a": _i64(2, 3), "b": _i64(3)}),
    "flatten axis 2": ([node("Flatten", ["x"], axis=2)], (1, 4, 3), {}),
    "batchnorm on features": ([node("BatchNormalization", ["x", "g", "b", "m", "v"], epsilon=1e-3)], (4,),
                              {"g": _rand(4), "b": _rand(4), "m": _rand(4), "v": np.abs(_rand(4)) + 0.5}),
    "layer normalization": ([node("LayerNormalization", ["x", "g", "b"], axis=-2, epsilon=1e-3)], (3, 4, 5),
                            {"g": _rand(4, 5), "b": _rand(5)}),
    "matmul over the last axis": ([node("MatMul", ["x", "w"], ["h"]), node("Add", ["h", "b"])], (3, 5),
                                  {"w": _rand(5, 4), "b": _rand(4)}),
    "maxpool ceil_mode with equal pads": ([node("MaxPool", ["x"], kernel_shape=[3, 3], strides=[2, 2],
                                                pads=[1, 1, 1, 1], ceil_mode=1)], (2, 8, 8), {}),
    "maxpool ceil_mode whose last window would start in the padding": (
        [node("MaxPool", ["x"], kernel_shape=[3, 3], strides=[3, 3], pads=[1, 1, 1, 1], ceil_mode=1)], (2, 8, 8), {}),
    "avgpool ceil_mode excluding equal pads": ([node("AveragePool", ["x"], kernel_shape=[3, 3], strides=[2, 2],
                                                     pads=[1, 1, 1, 1], ceil_mode=1, count_include_pad=0)],
                                               (2, 8, 8), {}),
    "one-input math": ([node("Abs", ["x"], ["a"]), node("Sqrt", ["a"], ["b"]), node("Erf", ["b"], ["c"]),
                        node("Neg", ["c"], ["d"]), node("Exp", ["d"], ["e"]), node("Reciprocal", ["e"], ["f"]),
                        node("Log", ["f"], ["g"]), node("Pow", ["g", "two"])], (3, 4), {"two": np.float32(2.0)}),
    "more activations": ([node("Elu", ["x"], ["a"], alpha=0.7), node("Softplus", ["a"], ["b"]),
                          node("HardSigmoid", ["b"], ["c"], alpha=0.2, beta=0.4),
                          node("HardSigmoid", ["x"], ["d"], "2", alpha=1 / 6, beta=0.5),
                          node("HardSwish", ["x"], ["e"]),
                          node("Mish", ["x"], ["f"]), node("Max", ["c", "d", "e"], ["g"]),
                          node("Min", ["g", "f"], ["h"]), node("Max", ["h", "zero"], suffix="2")], (3, 4),
                         {"zero": np.float32(0.0)}, 18),
    "prelu per channel and shared": ([node("PRelu", ["x", "s"], ["a"]), node("PRelu", ["a", "t"], suffix="2")],
                                     (3, 4, 5),
                                     {"s": _rand(3, 1, 1), "t": np.array([0.3], np.float32)}),
    "shape arithmetic into reshape": (
        [node("Shape", ["x"], ["sh"]), node("Gather", ["sh", "zero"], ["n"], axis=0),
         node("Unsqueeze", ["n", "ax"], ["n1"]), node("Concat", ["n1", "rest"], ["target"], axis=0),
         node("Reshape", ["x", "target"])], (2, 3, 4), {"zero": np.array(0, np.int64), "ax": _i64(0),
                                                       "rest": _i64(4, 6)}),
    "comparisons, logic, where and bool casts": (
        [node("Greater", ["x", "zero"], ["g"]), node("Sigmoid", ["x"], ["h"]), node("Less", ["x", "h"], ["l"]),
         node("Not", ["g"], ["ng"]), node("And", ["ng", "l"], ["a"]), node("Or", ["a", "g"], ["o"]),
         node("Where", ["o", "x", "minus_inf"], ["w"]), node("Cast", ["h"], ["hb"], to=TensorProto.BOOL),
         node("Where", ["hb", "w", "zero"], ["v"], suffix="2"),
         node("Cast", ["g"], ["gf"], suffix="2", to=TensorProto.FLOAT),
         node("Greater", ["half", "h"], ["lower"], suffix="2"), node("Where", ["lower", "gf", "v"], suffix="3")],
        (2, 3, 4), {"zero": np.float32(0.0), "minus_inf": np.float32(-np.inf), "half": np.float32(0.5)}),
    "where between two numbers (torch.where(x > 0, 1.0, -0.5))": (
        [node("Greater", ["x", "zero"], ["g"]), node("Where", ["g", "one", "minus_half"], ["s"]),
         node("Mul", ["x", "s"])], (3, 4), {"zero": np.float32(0.0), "one": np.float32(1.0),
                                            "minus_half": np.float32(-0.5)}),
    "softmax of a constant at opset 11 (over the flattened axes)": (
        [node("Softmax", ["c"], ["s"], axis=1), node("Add", ["x", "s"])], (2, 3),
        {"c": _rand(1, 2, 3, seed=5)}, 11),
    "dropout with a BOOL training_mode": (
        [node("Dropout", ["x", "ratio", "training"])], (3, 4), {"ratio": np.float32(0.3), "training": np.array(False)},
        13),
}


@pytest.mark.parametrize("case", list(CASES))
def test_node_kinds_match_onnxruntime_and_round_trip(case: str, tmp_path: Path) -> None:
    nodes, shape, inits, *rest = CASES[case]
    opset = rest[0] if rest else 17
    outputs = rest[1] if len(rest) > 1 else ("y",)
    path = tmp_path / "case.onnx"
    onnx.save(build(nodes, shape, inits, outputs=outputs, opset=opset), path)
    x = _rand(2, *shape, seed=3)
    reference = run_onnxruntime(path, x)
    model = opgrad_onnx.load(path)
    ours = as_list(model.predict(x, batch_size=2, backend="reference"))
    assert len(ours) == len(reference)
    for theirs, mine in zip(reference, ours):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-5)
    opgrad_onnx.save(model, tmp_path / "back.onnx")
    for theirs, again in zip(reference, run_onnxruntime(tmp_path / "back.onnx", x)):
        np.testing.assert_allclose(again, theirs, rtol=1e-5, atol=1e-5)


def test_constants_fold_by_the_files_opset(tmp_path: Path) -> None:
    # x.view(x.size(0), x.size(1), -1) at opset 11: Unsqueeze takes its axes as an attribute there,
    # and the channel count it unsqueezes is a constant folded while reading.
    nodes = [node("Shape", ["x"], ["sh"]), node("Gather", ["sh", "zero"], ["n"], axis=0),
             node("Gather", ["sh", "one"], ["c"], suffix="2", axis=0),
             node("Unsqueeze", ["n"], ["n1"], axes=[0]), node("Unsqueeze", ["c"], ["c1"], suffix="2", axes=[0]),
             node("Concat", ["n1", "c1", "rest"], ["target"], axis=0), node("Reshape", ["x", "target"])]
    graph = helper.make_graph(
        nodes, "view", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 4, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3, 20])],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in
         {"zero": np.array(0, np.int64), "one": np.array(1, np.int64), "rest": _i64(-1)}.items()])
    path = tmp_path / "view11.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)], ir_version=8), path)
    x = _rand(2, 3, 4, 5)
    np.testing.assert_array_equal(opgrad_onnx.load(path).predict(x, backend="reference"), x.reshape(2, 3, 20))


def test_a_softplus_threshold_is_exported_as_its_linear_region(tmp_path: Path) -> None:
    x = np.array([[1.0, 2.49, 2.51, 2.6, 4.0]], np.float32)
    for beta, threshold in ((2.0, 5.0), (0.5, 1.0), (1.0, 20.0)):
        model = nn.Sequential([nn.Softplus(beta, threshold)], input_shape=(5,))
        opgrad_onnx.save(model, tmp_path / "softplus.onnx")
        np.testing.assert_allclose(run_onnxruntime(tmp_path / "softplus.onnx", x)[0], model.predict(x), rtol=1e-6)
        # The Greater and Where it is written with read back as opgrad layers.
        np.testing.assert_allclose(opgrad_onnx.load(tmp_path / "softplus.onnx").predict(x), model.predict(x),
                                   rtol=1e-6)


@pytest.mark.parametrize("layer", ["max", "avg without count_include_pad", "avg with count_include_pad"])
def test_a_pool_whose_ceil_mode_keeps_a_last_window_on_one_axis_exports_with_that_windows_padding(
        layer: str, tmp_path: Path) -> None:
    # 5 x 6 input, 3x3 windows, stride 3, padding 1: PyTorch's rule drops the last window of the
    # height (it would start in the padding) and keeps the width's; ONNX's ceil_mode takes both.
    pool = (nn.MaxPool2D(3, 3, 1, ceil_mode=True) if layer == "max" else
            nn.AvgPool2D(3, 3, 1, ceil_mode=True, count_include_pad=layer.endswith("with count_include_pad")))
    model = nn.Sequential([pool], input_shape=(2, 5, 6))
    assert model.output_shape == (2, 2, 3)
    if layer == "avg with count_include_pad":
        with pytest.raises(OnnxError, match=r"ceil_mode keeps a last window on one axis of the 5x6 input only, "
                                            r"which ONNX's AveragePool with count_include_pad=1 cannot express"):
            opgrad_onnx.save(model, tmp_path / "pool.onnx")
        return
    x = np.random.default_rng(3).standard_normal((4, 2, 5, 6)).astype(np.float32)
    opgrad_onnx.save(model, tmp_path / "pool.onnx")
    np.testing.assert_allclose(run_onnxruntime(tmp_path / "pool.onnx", x)[0], model.predict(x), rtol=1e-6)
    if layer == "max":  # the importer reads an average without count_include_pad over equal pads only
        np.testing.assert_allclose(opgrad_onnx.load(tmp_path / "pool.onnx").predict(x), model.predict(x),
                                   rtol=1e-6)


def test_default_output_names_stay_apart_from_an_input_named_like_them(tmp_path: Path) -> None:
    inp = nn.Input((6,), name="output")
    model = nn.Model(inp, nn.Dense(3)(inp))
    opgrad_onnx.save(model, tmp_path / "named.onnx")
    graph = onnx.load(tmp_path / "named.onnx").graph
    assert [i.name for i in graph.input] == ["output"] and [o.name for o in graph.output] == ["output_2"]
    x = np.ones((2, 6), np.float32)
    np.testing.assert_allclose(run_onnxruntime(tmp_path / "named.onnx", x)[0], model.predict(x), rtol=1e-6)


def test_an_opset_20_model_declares_the_ir_version_it_needs(tmp_path: Path) -> None:
    model = nn.Sequential([nn.GELU()], input_shape=(4,))
    proto = to_onnx(model)
    assert [o.version for o in proto.opset_import] == [20] and proto.ir_version == 9
    assert to_onnx(nn.Sequential([nn.ReLU()], input_shape=(4,))).ir_version == 8


def test_where_and_comparison_layers_export_and_read_back(tmp_path: Path) -> None:
    # masked_fill(x <= 0, -inf) then a comparison between tensors: float 0/1 masks in opgrad.
    inp = nn.Input((4,))
    other = nn.Arithmetic("multiply", operand=0.5)(inp)
    positive = nn.Arithmetic("greater", operand=0.0)(inp)
    filled = nn.Where(false_value="-inf")([positive, inp])
    larger = nn.Elementwise("greater")([inp, other])
    model = nn.Model(inp, [filled, nn.Elementwise("add")([larger, other])], name="masks")
    x = np.array([[-1.0, 0.0, 0.5, 3.0], [2.0, -0.25, 1.0, -4.0]], np.float32)
    want = model.predict(x)
    assert np.isneginf(want[0][0, 0]) and want[0][0, 3] == 3.0
    opgrad_onnx.save(model, tmp_path / "masks.onnx")
    for theirs, mine in zip(run_onnxruntime(tmp_path / "masks.onnx", x), want):
        np.testing.assert_array_equal(theirs, mine)
    for again, mine in zip(opgrad_onnx.load(tmp_path / "masks.onnx").predict(x), want):
        np.testing.assert_array_equal(again, mine)
    model.save(tmp_path / "masks.npz")
    for again, mine in zip(nn.load(tmp_path / "masks.npz").predict(x), want):
        np.testing.assert_array_equal(again, mine)


def test_output_names_survive_import_and_export(tmp_path: Path) -> None:
    path = tmp_path / "named.onnx"
    onnx.save(build([node("Relu", ["x"], ["logits"]), node("Sigmoid", ["x"], ["features"])], (3,),
                    outputs=("logits", "features")), path)
    model = opgrad_onnx.load(path)
    assert model.output_names == ["logits", "features"]
    opgrad_onnx.save(model, tmp_path / "back.onnx")
    assert [o.name for o in onnx.load(tmp_path / "back.onnx").graph.output] == ["logits", "features"]
    model.save(tmp_path / "named.npz")
    assert nn.load(tmp_path / "named.npz").output_names == ["logits", "features"]
    with pytest.raises(ValueError, match="output_names must be 2 distinct non-empty strings"):
        nn.Model(model.inputs, model.outputs, output_names=["a", "a"])
    # PyTorch's default names are no identifiers: the model's input is renamed, the file's name kept.
    graph = helper.make_graph([node("Relu", ["input.1"], ["input_1"])], "torch-named",
                              [helper.make_tensor_value_info("input.1", TensorProto.FLOAT, ["N", 3])],
                              [helper.make_tensor_value_info("input_1", TensorProto.FLOAT, ["N", 3])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    model = opgrad_onnx.load(path)
    assert model.input_names == ["input.1"] and model.inputs[0].name != "input.1"
    opgrad_onnx.save(model, tmp_path / "back.onnx")
    back = onnx.load(tmp_path / "back.onnx").graph
    assert [i.name for i in back.input] == ["input.1"] and [o.name for o in back.output] == ["input_1"]


def test_a_fixed_batch_size_is_read_as_the_batch_axis(tmp_path: Path) -> None:
    """A model exported with batch 1 and ``Reshape(x, [1, -1])`` predicts any batch, row by row."""
    path = tmp_path / "batch1.onnx"
    onnx.save(build([node("Reshape", ["x", "s"], ["r"]), node("Gemm", ["r", "w"])], (2, 3),
                    {"s": _i64(1, -1), "w": _rand(6, 4)}, batch=1), path)
    x = _rand(3, 2, 3)
    model = opgrad_onnx.load(path)
    rows = np.concatenate([run_onnxruntime(path, x[i : i + 1])[0] for i in range(3)])
    np.testing.assert_allclose(model.predict(x, backend="reference"), rows, rtol=1e-5, atol=1e-6)


# ----- refused: one clear error each -----


def _huge_initializer() -> Any:
    tensor = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[1 << 20, 1 << 20], raw_data=b"\0" * 16)
    model = build([node("MatMul", ["x", "w"])], (4,))
    model.graph.initializer.append(tensor)
    return model


def _external_initializer() -> Any:
    model = build([node("MatMul", ["x", "w"])], (4,), {"w": _rand(4, 2)})
    tensor = model.graph.initializer[0]
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", "../../etc/passwd"
    return model


def _cycle() -> Any:
    return build([node("Relu", ["x", "b"], ["a"]), node("Add", ["a", "x"], ["b"]), node("Identity", ["b"])], (3,))


REFUSED: dict[str, tuple[Any, str]] = {
    "unsupported op": (build([node("Celu", ["x"])], (3,)),
                       r"node 'my_celu' \(Celu\): op type Celu is not supported; supported op types:"),
    "pow by a tensor": (build([node("Pow", ["x", "x"])], (3,)), r"\(Pow\): input 1 \(Y, 'x'\) is computed from"),
    "pow by 3": (build([node("Pow", ["x", "e"])], (3,), {"e": np.float32(3.0)}),
                 r"\(Pow\): exponent 3 is not supported; supported: constant exponents"),
    "unsupported attribute value": (
        build([node("Resize", ["x", "", "s"], mode="cubic")], (1, 2, 2), {"s": np.array([1, 1, 2, 2], np.float32)}),
        r"node 'my_resize' \(Resize\): attribute mode='cubic' is not supported; supported: nearest, linear"),
    "max pool dilations": (build([node("MaxPool", ["x"], kernel_shape=[2, 2], dilations=[2, 2])], (1, 6, 6)),
                           r"'my_maxpool' \(MaxPool\): attribute dilations=\[2, 2\] is not supported"),
    "ceil_mode that changes the size": (build([node("MaxPool", ["x"], kernel_shape=[3, 3], strides=[2, 2],
                                                    pads=[0, 1, 1, 0], ceil_mode=1)], (1, 7, 7)),
                                        r"\(MaxPool\): attribute ceil_mode=1 is not supported; supported: 0, or"),
    "avg pool excluding explicit pads": (build([node("AveragePool", ["x"], kernel_shape=[2, 2], pads=[1, 1, 0, 0])],
                                               (1, 5, 5)),
                                         r"\(AveragePool\): attribute count_include_pad=0 is not supported"),
    "transpose moving the batch axis": (build([node("Transpose", ["x"], perm=[1, 0, 2])], (2, 3)),
                                        r"\(Transpose\): attribute perm=\[1, 0, 2\] is not supported; supported: "
                                        r"permutations that keep the batch axis first"),
    # A torch RNN exported batch-first: the Transpose before it is refused first, and the GRU
    # (no converter at all), the real obstacle, is named with it.
    "a later op type without a converter": (
        build([node("Transpose", ["x"], ["t"], perm=[1, 0, 2]), node("GRU", ["t", "w", "r"], hidden_size=2)], (2, 3),
              {"w": _rand(1, 6, 3), "r": _rand(1, 6, 2)}),
        r"\(Transpose\): attribute perm=\[1, 0, 2\] is not supported; .*; the model also has op type\(s\) GRU, "
        r"which this importer does not convert$"),
    "gemm transA": (build([node("Gemm", ["x", "w"], transA=1)], (3,), {"w": _rand(3, 3)}),
                    r"\(Gemm\): attribute transA=1 is not supported"),
    "arithmetic with the batch size": (
        build([node("Shape", ["x"], ["sh"]), node("Gather", ["sh", "zero"], ["n"], axis=0),
               node("Cast", ["n"], ["nf"], to=TensorProto.FLOAT), node("Div", ["x", "nf"])], (3,),
              {"zero": np.array(0, np.int64)}),
        r"\(Div\): input 1 \(operand\) computes with the batch size \(from Shape of the data\)"),
    "infinite leaky slope": (build([node("LeakyRelu", ["x"], alpha=float("inf"))], (3,)),
                             r"\(LeakyRelu\): attribute alpha=inf is not supported; supported: a finite slope"),
    "3-D convolution": (build([node("Conv", ["x", "w"])], (2, 4, 4, 4), {"w": _rand(3, 2, 2, 2, 2)}),
                        r"\(Conv\): input 0 \(X\) has shape \(N, 2, 4, 4, 4\); supported: rank 4"),
    "reshape that changes the batch": (build([node("Reshape", ["x", "s"])], (2, 3), {"s": _i64(-1, 3)}),
                                       r"\(Reshape\): shape \[-1, 3\] changes the batch axis"),
    "cast to an integer": (build([node("Cast", ["x"], ["i"], to=TensorProto.INT64),
                                  node("Cast", ["i"], to=TensorProto.FLOAT)], (3,)),
                           r"\(Cast\): attribute to=7 is not supported; supported: float types"),
    "weights computed from the input": (build([node("MatMul", ["x", "x"])], (3,)),
                                        r"\(MatMul\): input 1 \(B, 'x'\) is computed from the model input"),
    "integer input": (build([node("Relu", ["x"])], (3,), input_type=TensorProto.INT32),
                      r"input 'x' has dtype INT32; supported: float inputs"),
    "dynamic non-batch axis": (build([node("Relu", ["x"])], (3, "H", 4)),
                               r"input 'x': axis 2 is dynamic \('H'\); supported: a dynamic batch axis"),
    "old opset": (build([node("Relu", ["x"])], (3,), opset=9), r"opset 9 is not supported; supported: opsets 11"),
    "missing initializer": (build([node("MatMul", ["x", "w"])], (3,)),
                            r"node 'my_matmul' \(MatMul\) reads 'w', which is neither a graph input, an initializer"),
    "cycle": (_cycle(), r"the graph has a cycle through node\(s\) 'my_relu' \(Relu\), 'my_add' \(Add\)"),
    "huge declared dims": (_huge_initializer(), r"initializer 'w' declares shape \[1048576, 1048576\]"),
    "external data": (_external_initializer(), r"initializer 'w' keeps its data in an external file"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_models_give_one_clear_error(case: str, tmp_path: Path) -> None:
    model, message = REFUSED[case]
    path = tmp_path / "bad.onnx"
    path.write_bytes(model.SerializeToString())
    with pytest.raises(OnnxError, match=message) as info:
        opgrad_onnx.load(path)
    assert str(info.value).startswith(str(path)) and "\n" not in str(info.value)


@pytest.mark.parametrize("content, message", [
    (b"", "not an ONNX model"),
    (b"def forward(x):\n    return x\n", "not an ONNX model"),
    (None, "not an ONNX model"),  # truncated
])
def test_files_that_are_not_onnx_are_refused(content: bytes | None, message: str, tmp_path: Path) -> None:
    path = tmp_path / "model.onnx"
    data = (FIXTURES / "onnx_resnet.onnx").read_bytes()
    path.write_bytes(data[: len(data) // 3] if content is None else content)
    with pytest.raises(OnnxError, match=message):
        opgrad_onnx.load(path)
    with pytest.raises(OnnxError, match="cannot read the file"):
        opgrad_onnx.load(tmp_path / "missing.onnx")


def test_export_refuses_a_layer_without_onnx_form() -> None:
    class Square(nn.Layer):
        kind = "test_square"

        def apply(self, x: Any, params: Any, ctx: Any) -> Any:
            return opgrad.ops.multiply(x, x)

    inp = nn.Input((3,))
    model = nn.Model(inp, Square(name="sq")(inp))
    with pytest.raises(OnnxError, match=r"layer 'sq' \(Square\) \(kind 'test_square'\) has no ONNX export"):
        to_onnx(model)


# ----- the command line -----


def test_cli_import_export_onnx_and_fine_tune(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt, out, tuned = tmp_path / "resnet.npz", tmp_path / "resnet.onnx", tmp_path / "tuned.npz"
    assert cli.main(["import", str(FIXTURES / "onnx_resnet.onnx"), "--save", str(ckpt)]) == 0
    data = expected("onnx_resnet")
    np.testing.assert_allclose(nn.load(ckpt).predict(data["x"], backend="reference"), data["y"], atol=1e-5)
    assert cli.main(["export-onnx", str(ckpt), str(out)]) == 0
    np.testing.assert_allclose(run_onnxruntime(out, data["x"])[0], data["y"], atol=1e-5)
    assert cli.main(["train", "--init", str(ckpt), "--backend", "reference", "--batch-size", "8", "--max-steps", "2",
                     "--test-limit", "40", "--epochs", "1", "--save", str(tuned)]) == 0
    assert "fine-tuning from" in capsys.readouterr().out
    model = nn.load(tuned)
    assert model.name == "onnx_resnet" and model.checkpoint_meta["step"] == 2
    assert cli.main(["train", "--resume", str(tuned), "--backend", "reference", "--batch-size", "8",
                     "--max-steps", "2", "--test-limit", "40", "--epochs", "2"]) == 0


@pytest.mark.parametrize("argv, message", [
    (["import", "model.txt", "--save", "x.npz"], "unknown model file type '.txt'; supported: .onnx, .keras, .h5"),
    (["import", "missing.onnx", "--save", "x.npz"], "missing.onnx: no such file"),
    (["export-onnx", "missing.npz", "out.onnx"], "missing.npz"),
    (["train", "--init", "a.npz", "--model", "mlp"], "leave out --model mlp"),
    (["export-onnx", "missing.npz", "no-such-dir/out.onnx"], "OUT no-such-dir/out.onnx: directory no-such-dir does "
                                                              "not exist"),
    (["import", "missing.onnx", "--save", "no-such-dir/x.npz"], "--save no-such-dir/x.npz: directory no-such-dir "
                                                                "does not exist"),
])
def test_cli_mistakes_are_one_line_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.count("\n") == 0 and err.startswith(f"opgrad {argv[0]}: error:")


def test_cli_import_of_a_bad_onnx_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.onnx"
    path.write_bytes(REFUSED["unsupported op"][0].SerializeToString())
    assert cli.main(["import", str(path), "--save", str(tmp_path / "x.npz")]) == 2
    err = capsys.readouterr().err.strip()
    assert "(Celu): op type Celu is not supported" in err and err.count("\n") == 0
    assert not (tmp_path / "x.npz").exists()


# ----- the committed fixtures are what the script makes -----


def test_fixtures_regenerate_consistently(tmp_path: Path) -> None:
    require("torch", "tests/fixtures/make_models.py exports the ONNX fixtures from PyTorch")
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_models", FIXTURES / "make_models.py")
    assert spec is not None and spec.loader is not None
    make_models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_models)

    make_models.make(tmp_path, [name for name in make_models.FIXTURES if name.startswith("onnx_")])
    for name in TORCH_MODELS:
        fresh, committed = np.load(tmp_path / f"{name}_expected.npz"), expected(name)
        np.testing.assert_array_equal(fresh["x"], committed["x"])
        np.testing.assert_allclose(fresh["y"], committed["y"], rtol=1e-6, atol=1e-6)
        weights = {t.name: numpy_helper.to_array(t) for t in onnx.load(tmp_path / f"{name}.onnx").graph.initializer}
        stored = {t.name: numpy_helper.to_array(t) for t in onnx.load(FIXTURES / f"{name}.onnx").graph.initializer}
        assert weights.keys() == stored.keys()
        for key in weights:
            np.testing.assert_array_equal(weights[key], stored[key])
    total = sum(p.stat().st_size for p in FIXTURES.iterdir() if p.name.startswith("onnx_"))
    assert total < 200_000, f"the ONNX fixtures take {total:,} bytes"


def test_hostile_constant_computations_are_refused_before_they_allocate(tmp_path: Path) -> None:
    path = tmp_path / "range.onnx"
    limits = {"start": np.array(0, np.int64), "limit": np.array(1 << 40, np.int64), "delta": np.array(1, np.int64)}
    model = build([node("Range", ["start", "limit", "delta"], ["r"]), node("Relu", ["x"])], (3,), limits)
    path.write_bytes(model.SerializeToString())
    with pytest.raises(OnnxError, match=r"node 'my_range' \(Range\): computes a constant larger than"):
        opgrad_onnx.load(path)
    padded = build([node("Pad", ["x", "p"])], (3,), {"p": _i64(0, 0, 0, 1 << 30)})
    path.write_bytes(padded.SerializeToString())
    with pytest.raises(OnnxError, match=r"node 'my_pad' \(Pad\): .*more than 268,435,456 elements per example"):
        opgrad_onnx.load(path)


def test_corrupted_files_load_or_fail_with_onnx_error_only(tmp_path: Path) -> None:
    """Random bytes changed in the graph part of a real file: every outcome is a model or an OnnxError."""
    data = (FIXTURES / "onnx_resnet.onnx").read_bytes()
    rng = np.random.default_rng(0)
    outcomes = {"loaded": 0, "refused": 0}
    for i in range(60):
        corrupted = bytearray(data)
        for position in rng.integers(0, 3000, size=int(rng.integers(1, 4))):
            corrupted[int(position)] = int(rng.integers(0, 256))
        path = tmp_path / f"corrupted{i}.onnx"
        path.write_bytes(bytes(corrupted))
        try:
            opgrad_onnx.load(path)
            outcomes["loaded"] += 1
        except OnnxError as exc:
            assert str(exc).startswith(str(path)) and "\n" not in str(exc)
            outcomes["refused"] += 1
    assert outcomes["refused"] > 0


KERAS_FIXTURES = sorted(p.name for p in (FIXTURES / "keras").glob("*") if p.suffix in (".keras", ".h5"))


@pytest.mark.parametrize("name", KERAS_FIXTURES)
def test_keras_imports_go_out_as_onnx(name: str, tmp_path: Path) -> None:
    """Keras -> opgrad -> ONNX: onnxruntime computes what the imported model computes."""
    require("h5py", "opgrad.keras reads Keras weights with it")
    from opgrad import keras as opgrad_keras

    model = opgrad_keras.load(FIXTURES / "keras" / name)
    rng = np.random.default_rng(4)
    inputs = [rng.integers(0, 5, (3, *t.shape)).astype(np.int64) if t.dtype == "int64" else
              rng.random((3, *t.shape), dtype=np.float32) for t in model.inputs]
    ours = as_list(model.predict(inputs if len(inputs) > 1 else inputs[0], batch_size=3, backend="reference"))
    opgrad_onnx.save(model, tmp_path / "keras.onnx")
    for theirs, mine in zip(run_onnxruntime(tmp_path / "keras.onnx", *inputs), ours):
        np.testing.assert_allclose(theirs, mine, rtol=1e-5, atol=1e-5)


def test_a_classifiers_final_softmax_is_left_out_unless_kept(tmp_path: Path) -> None:
    # Exported for deployment, a classifier ends in probabilities; opgrad's training step needs logits
    # (its loss applies softmax), as the Keras importer already gives.
    path = tmp_path / "classifier.onnx"
    onnx.save(build([node("Gemm", ["x", "w", "b"], ["logits"]), node("Softmax", ["logits"], axis=-1)], (5,),
                    {"w": _rand(5, 3), "b": _rand(3)}, opset=13), path)
    x = _rand(4, 5, seed=1)
    (probabilities,) = run_onnxruntime(path, x)
    imported = opgrad_onnx.read(path)
    assert len(imported.notes) == 1 and "the final Softmax is left out" in imported.notes[0]
    logits = imported.model.predict(x, backend="reference")
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    np.testing.assert_allclose(shifted / shifted.sum(axis=1, keepdims=True), probabilities, rtol=1e-5, atol=1e-6)
    kept = opgrad_onnx.read(path, keep_softmax=True)
    assert kept.notes == []
    np.testing.assert_allclose(kept.model.predict(x, backend="reference"), probabilities, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"output 0 is a softmax .* would apply it twice"):
        nn.TrainStep(kept.model, nn.SGD(), batch_size=4)


def test_a_file_exported_without_its_weights_says_so(tmp_path: Path) -> None:
    graph = helper.make_graph(
        [node("Gemm", ["x", "fc.weight", "fc.bias"], transB=1)], "no-params",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 5]),
         helper.make_tensor_value_info("fc.weight", TensorProto.FLOAT, [3, 5]),
         helper.make_tensor_value_info("fc.bias", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    path = tmp_path / "no_params.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    with pytest.raises(OnnxError, match=r"node 'my_gemm' \(Gemm\) takes its weight 'fc.weight' as a graph input, "
                                        r"not an initializer: the file holds no weights"):
        opgrad_onnx.load(path)


def test_a_bool_cast_of_nan_is_true_as_in_onnxruntime(tmp_path: Path) -> None:
    path = tmp_path / "bool_cast.onnx"
    onnx.save(build([node("Cast", ["x"], ["b"], to=TensorProto.BOOL), node("Where", ["b", "one", "zero"])], (6,),
                    {"one": np.float32(1.0), "zero": np.float32(0.0)}, opset=13), path)
    x = np.array([[np.nan, 0.0, -0.0, np.inf, -np.inf, -2.5]], np.float32)
    (expected,) = run_onnxruntime(path, x)
    np.testing.assert_array_equal(expected, [[1, 0, 0, 1, 1, 1]])
    model = opgrad_onnx.load(path)
    for backend in ("reference", "llvm"):
        np.testing.assert_array_equal(model.predict(x, backend=backend), expected)
