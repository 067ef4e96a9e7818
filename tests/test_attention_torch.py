"""MultiHeadAttention against torch.nn.MultiheadAttention: outputs and every gradient, both backends,
and a small transformer encoder block trained a few steps."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from optional import require
from trainers import steps_against_torch

torch = require("torch", "attention is compared with torch.nn.MultiheadAttention (pip install torch==2.13.0)")

import opgrad  # noqa: E402
from opgrad import nn, ops  # noqa: E402


def _torch_attention(params: dict[str, np.ndarray], embed: int, heads: int) -> object:
    mha = torch.nn.MultiheadAttention(embed, heads, batch_first=True).double()
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.tensor(params["att.in_proj_weight"]))
        mha.in_proj_bias.copy_(torch.tensor(params["att.in_proj_bias"]))
        mha.out_proj.weight.copy_(torch.tensor(params["att.out_proj_weight"]))
        mha.out_proj.bias.copy_(torch.tensor(params["att.out_proj_bias"]))
    return mha


@pytest.mark.parametrize("backend", ["reference", "llvm"])
@pytest.mark.parametrize("causal", [False, True])
def test_self_attention_and_its_gradients_equal_torchs(causal: bool, backend: str) -> None:
    n, length, embed, heads = 3, 5, 8, 2
    model = nn.Sequential([nn.MultiHeadAttention(heads, causal=causal, name="att")], input_shape=(length, embed))
    rng = np.random.default_rng(11)
    params = {k: v + 0.1 * rng.standard_normal(v.shape) for k, v in model.init_params(0, "float64").items()}
    x, cotangent = rng.standard_normal((n, length, embed)), rng.standard_normal((n, length, embed))
    mha = _torch_attention(params, embed, heads)
    xt = torch.tensor(x, requires_grad=True)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(length, dtype=torch.float64) if causal else None
    yt, _ = mha(xt, xt, xt, need_weights=False, attn_mask=mask, is_causal=causal)  # type: ignore[operator]
    yt.backward(torch.tensor(cotangent))

    images = opgrad.var("x", x.shape, "float64")
    variables = {k: opgrad.var(k, v.shape, "float64") for k, v in params.items()}
    out = model.forward(images, variables)
    loss = ops.sum(ops.multiply(out, opgrad.const(cotangent)))
    fn = opgrad.function([images, *variables.values()], [out, *opgrad.gradients(loss, [images, *variables.values()])])
    y, dx, *grads = nn.compile_function(fn, backend)(x, *params.values())
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-10, atol=1e-12)
    expected = {"att.in_proj_weight": mha.in_proj_weight.grad, "att.in_proj_bias": mha.in_proj_bias.grad,
                "att.out_proj_weight": mha.out_proj.weight.grad, "att.out_proj_bias": mha.out_proj.bias.grad}
    for name, grad in zip(variables, grads, strict=True):
        np.testing.assert_allclose(grad, expected[name].numpy(), rtol=1e-10, atol=1e-12, err_msg=name)


def _encoder(length: int, embed: int, classes: int) -> nn.Model:
    tokens = nn.Input((length,), dtype="int64")
    x = nn.Embedding(20, embed, name="emb")(tokens)
    x = nn.LayerNorm(name="ln1")(nn.Add()([x, nn.MultiHeadAttention(2, name="att")(x)]))
    h = nn.Dense(2 * embed, activation="gelu", name="ff1")(x)
    x = nn.LayerNorm(name="ln2")(nn.Add()([x, nn.Dense(embed, name="ff2")(h)]))
    return nn.Model(tokens, nn.Dense(classes, name="head")(nn.Reduce("mean", [1], keepdims=False)(x)))


@pytest.mark.parametrize("backend", ["reference", "llvm"])
def test_a_transformer_encoder_block_trains_as_torchs(backend: str) -> None:
    length, embed, classes = 6, 8, 3
    model = _encoder(length, embed, classes)
    params = model.init_params(1)
    rng = np.random.default_rng(12)
    tokens, labels = rng.integers(0, 20, (4, length)), rng.integers(0, classes, 4)

    emb = torch.nn.Embedding(20, embed)
    mha = torch.nn.MultiheadAttention(embed, 2, batch_first=True)
    ln1, ln2 = torch.nn.LayerNorm(embed), torch.nn.LayerNorm(embed)
    ff1, ff2, head = torch.nn.Linear(embed, 2 * embed), torch.nn.Linear(2 * embed, embed), torch.nn.Linear(embed, 3)
    modules = {"emb": emb, "ln1": ln1, "ln2": ln2, "ff1": ff1, "ff2": ff2, "head": head}
    with torch.no_grad():
        for name, value in params.items():
            owner, local = name.split(".", 1)
            if owner == "att":
                target = mha.out_proj.weight if local == "out_proj_weight" else mha.out_proj.bias \
                    if local == "out_proj_bias" else getattr(mha, local)
            else:
                target = getattr(modules[owner], local)
            target.copy_(torch.tensor(value))
    every = [p for m in (*modules.values(), mha) for p in m.parameters()]
    opt = torch.optim.Adam(every, lr=0.01)
    step = nn.TrainStep(model, nn.Adam(), batch_size=4, backend=backend)
    state = nn.Adam().init_state(params)

    def torch_loss() -> Any:
        x = emb(torch.tensor(tokens))
        x = ln1(x + mha(x, x, x, need_weights=False)[0])
        x = ln2(x + ff2(torch.nn.functional.gelu(ff1(x))))
        return torch.nn.functional.cross_entropy(head(x.mean(dim=1)), torch.tensor(labels))

    params, state = steps_against_torch(step, tokens, labels, params, state, 0.01, torch_loss, opt, rel=2e-5)
    np.testing.assert_allclose(params["att.in_proj_weight"], mha.in_proj_weight.detach().numpy(), atol=2e-5)
    np.testing.assert_allclose(params["head.weight"], head.weight.detach().numpy(), atol=2e-5)


def test_attention_saves_describes_and_refuses_what_it_cannot_take(tmp_path: Path) -> None:
    model = nn.Sequential([nn.MultiHeadAttention(4, causal=True)], input_shape=(7, 8))
    assert "4 heads, causal" in str(model)
    model.save(tmp_path / "att.npz")
    x = np.random.default_rng(13).standard_normal((2, 7, 8)).astype(np.float32)
    np.testing.assert_array_equal(nn.load_model(tmp_path / "att.npz").predict(x, backend="reference"),
                                  model.predict(x, backend="reference"))
    with pytest.raises(opgrad.ShapeError, match=r"embed 8 does not split into 3 heads"):
        nn.Sequential([nn.MultiHeadAttention(3)], input_shape=(7, 8))
    with pytest.raises(opgrad.ShapeError, match=r"MultiHeadAttention needs a sequence \(length, embed\)"):
        nn.Sequential([nn.MultiHeadAttention(2)], input_shape=(8,))


@pytest.mark.parametrize("backend", ["reference", "llvm"])
def test_next_token_cross_entropy_over_every_position_equals_torchs(backend: str) -> None:
    # A language model's loss: logits (N, length, vocab) against a token per position, the mean over
    # every position (PyTorch: cross_entropy(logits.view(-1, vocab), targets.view(-1))).
    from opgrad.nn.gradstep import GradientStep

    length, embed, vocab = 6, 8, 11
    tokens = nn.Input((length,), dtype="int64")
    x = nn.Embedding(vocab, embed, name="emb")(tokens)
    x = nn.Add()([x, nn.MultiHeadAttention(2, causal=True, name="att")(x)])
    model = nn.Model(tokens, nn.Dense(vocab, name="head")(x))
    params = model.init_params(2, "float64")
    rng = np.random.default_rng(14)
    sequence = rng.integers(0, vocab, (3, length + 1))
    result = GradientStep(model, batch_size=3, dtype="float64", backend=backend)(
        sequence[:, :-1], sequence[:, 1:], params, {})
    t = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    mha = _torch_attention({k: v.detach().numpy() for k, v in t.items()}, embed, 2)
    e = torch.nn.functional.embedding(torch.tensor(sequence[:, :-1]), t["emb.weight"])
    mask = torch.nn.Transformer.generate_square_subsequent_mask(length, dtype=torch.float64)
    h = e + mha(e, e, e, need_weights=False, attn_mask=mask, is_causal=True)[0]  # type: ignore[operator]
    logits = h @ t["head.weight"].T + t["head.bias"]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), torch.tensor(sequence[:, 1:]).reshape(-1))
    loss.backward()
    np.testing.assert_allclose(result.loss, loss.item(), rtol=1e-12)
    for name in ("emb.weight", "head.weight", "head.bias"):
        np.testing.assert_allclose(result.grads[name], t[name].grad.numpy(), rtol=1e-9, atol=1e-12, err_msg=name)
    with pytest.raises(ValueError, match=r"takes class labels of shape \(3, 6\) and dtype int64, got shape \(3,\); the "
                                         r"output gives classes per position of a sequence: one label per position"):
        nn.TrainStep(model, nn.SGD(), batch_size=3)(sequence[:, :-1], sequence[:, 0], model.init_params(0), {}, 0.1)
    with pytest.raises(ValueError, match=r"^GradientStep: output 0 of model .* takes class labels of shape "
                                         r"\(3, 6\) and dtype int64, each in 0..10 \(11 classes\); got values in "
                                         r"20..30$"):
        outside = np.full((3, 6), 20) + np.eye(3, 6, dtype=np.int64) * 10
        nn.GradientStep(model, batch_size=3)(sequence[:, :-1], outside, model.init_params(0), {})


def test_run_steps_streams_a_label_per_position_as_single_steps_do() -> None:
    length, vocab = 5, 7
    tokens = nn.Input((length,), dtype="int64")
    x = nn.MultiHeadAttention(2, causal=True)(nn.Embedding(vocab, 4)(tokens))
    model = nn.Model(tokens, nn.Dense(vocab)(x))
    step = nn.TrainStep(model, nn.SGD(0.9), batch_size=2, backend="llvm")
    params = model.init_params(3)
    state = nn.SGD(0.9).init_state(params)
    sequence = np.random.default_rng(15).integers(0, vocab, (4, length + 1))
    together = step.run_steps(sequence[:, :-1], sequence[:, 1:], params, state, 0.1)
    p, s, losses = params, state, []
    for rows in (slice(0, 2), slice(2, 4)):
        one = step(sequence[rows, :-1], sequence[rows, 1:], p, s, 0.1)
        p, s = one.params, one.state
        losses.append(one.loss)
    np.testing.assert_array_equal(together.losses, np.float32(losses))
    for name in p:
        np.testing.assert_array_equal(together.params[name], p[name])


@pytest.mark.parametrize("backend", ["reference", "llvm"])
def test_a_padding_mask_hides_padded_keys_as_torchs_key_padding_mask(backend: str) -> None:
    n, length, embed, heads = 3, 6, 8, 2
    x_in, mask_in = nn.Input((length, embed)), nn.Input((length,))
    model = nn.Model([x_in, mask_in], nn.MultiHeadAttention(heads, causal=True, padding_mask=True, name="att")(
        [x_in, mask_in]))
    rng = np.random.default_rng(16)
    params = {k: v + 0.1 * rng.standard_normal(v.shape) for k, v in model.init_params(0, "float64").items()}
    x = rng.standard_normal((n, length, embed))
    mask = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]], np.float64)  # right-padded
    mha = _torch_attention(params, embed, heads)
    causal = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)  # True: hidden, as the padding
    xt = torch.tensor(x, requires_grad=True)
    yt, _ = mha(xt, xt, xt, need_weights=False, attn_mask=causal,  # type: ignore[operator]
                key_padding_mask=torch.tensor(mask == 0))
    cotangent = rng.standard_normal((n, length, embed))
    yt.backward(torch.tensor(cotangent))
    xs, ms = opgrad.var("x", x.shape, "float64"), opgrad.var("m", mask.shape, "float64")
    variables = {k: opgrad.var(k, v.shape, "float64") for k, v in params.items()}
    out = model.forward([xs, ms], variables)
    loss = ops.sum(ops.multiply(out, opgrad.const(cotangent)))
    fn = opgrad.function([xs, ms, *variables.values()], [out, *opgrad.gradients(loss, [xs, *variables.values()])])
    y, dx, *grads = nn.compile_function(fn, backend)(x, mask, *params.values())
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(grads[0], mha.in_proj_weight.grad.numpy(), rtol=1e-10, atol=1e-12)
    with pytest.raises(opgrad.ShapeError, match=r"takes \[x, mask\]: a sequence \(length, embed\) and a mask "
                                                r"\(length,\)"):
        nn.MultiHeadAttention(2, padding_mask=True)([x_in, nn.Input((length + 1,))])


@pytest.mark.parametrize("backend", ["reference", "llvm"])
@pytest.mark.parametrize("padding", [False, True])
def test_cross_attention_equals_torchs_on_another_sequence(padding: bool, backend: str) -> None:
    """key_value=True: queries from a decoder's 4 positions, keys and values from an encoder's 6
    (some padded): outputs and every gradient, both inputs' included, equal PyTorch's mha(q, kv, kv)."""
    n, queries, keys, embed, heads = 3, 4, 6, 8, 2
    q_in, kv_in = nn.Input((queries, embed), name="q"), nn.Input((keys, embed), name="kv")
    inputs = [q_in, kv_in]
    if padding:
        inputs.append(nn.Input((keys,), name="mask"))
    layer = nn.MultiHeadAttention(heads, key_value=True, padding_mask=padding, name="att")
    model = nn.Model(inputs, layer(inputs))
    assert model.output_shape == (queries, embed)
    rng = np.random.default_rng(12)
    params = {k: v + 0.1 * rng.standard_normal(v.shape) for k, v in model.init_params(0, "float64").items()}
    q, kv = rng.standard_normal((n, queries, embed)), rng.standard_normal((n, keys, embed))
    keep = np.ones((n, keys))
    keep[0, 4:] = keep[2, 1:] = 0
    cotangent = rng.standard_normal((n, queries, embed))
    mha = _torch_attention(params, embed, heads)
    qt, kvt = torch.tensor(q, requires_grad=True), torch.tensor(kv, requires_grad=True)
    yt, _ = mha(qt, kvt, kvt, need_weights=False,  # type: ignore[operator]
                key_padding_mask=torch.tensor(keep == 0) if padding else None)
    yt.backward(torch.tensor(cotangent))

    arrays = [q, kv, *([keep] if padding else [])]
    variables = [opgrad.var(f"in{i}", a.shape, "float64") for i, a in enumerate(arrays)]
    weights = {k: opgrad.var(k, v.shape, "float64") for k, v in params.items()}
    out = model.call(variables, weights)[0][0]
    loss = ops.sum(ops.multiply(out, opgrad.const(cotangent)))
    fn = opgrad.function([*variables, *weights.values()],
                         [out, *opgrad.gradients(loss, [variables[0], variables[1], *weights.values()])])
    y, dq, dkv, *grads = nn.compile_function(fn, backend)(*arrays, *params.values())
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(dq, qt.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dkv, kvt.grad.numpy(), rtol=1e-10, atol=1e-12)
    expected = {"att.in_proj_weight": mha.in_proj_weight.grad, "att.in_proj_bias": mha.in_proj_bias.grad,
                "att.out_proj_weight": mha.out_proj.weight.grad, "att.out_proj_bias": mha.out_proj.bias.grad}
    for name, grad in zip(weights, grads, strict=True):
        np.testing.assert_allclose(grad, expected[name].numpy(), rtol=1e-10, atol=1e-12, err_msg=name)
    with pytest.raises(ValueError, match=r"cross-attention \(key_value=True\) reads another sequence"):
        nn.MultiHeadAttention(2, key_value=True, causal=True)
    with pytest.raises(TypeError, match=r"MultiHeadAttention\(2 heads, cross\) takes a list of two or more"):
        nn.MultiHeadAttention(2, key_value=True)(q_in)
    with pytest.raises(opgrad.errors.ShapeError, match=r"takes \[query, key_value\]: sequences \(length, embed\)"):
        nn.MultiHeadAttention(2, key_value=True)([q_in, nn.Input((keys,))])


def _tied_language_model(vocab: int, embed: int, length: int) -> tuple[nn.Model, nn.Embedding]:
    tokens = nn.Input((length,), dtype="int64", name="tokens")
    table = nn.Embedding(vocab, embed, name="emb")
    h = table(tokens)
    h = nn.Add()([h, nn.MultiHeadAttention(2, causal=True, name="att")(h)])
    head = nn.Dense(vocab, use_bias=False, weight_from=table, name="head")
    return nn.Model(tokens, head(nn.LayerNorm(name="norm")(h)), name="tied"), table


@pytest.mark.parametrize("backend", ["reference", "llvm"])
def test_a_language_model_with_tied_embedding_trains_as_torchs(backend: str, tmp_path: Path) -> None:
    """Dense(weight_from=embedding): the output layer scores tokens with the embedding table itself
    (PyTorch's head.weight = emb.weight), one parameter whose gradient adds both uses: three Adam
    steps of next-token cross-entropy equal PyTorch's; the tie survives save/load."""
    vocab, embed, length, n = 11, 8, 5, 3
    model, _ = _tied_language_model(vocab, embed, length)
    assert "head.weight" not in model.params and "weight of 'emb'" in str(model)
    params = {k: v.astype(np.float64) for k, v in model.params.items()}
    rng = np.random.default_rng(13)
    ids = rng.integers(0, vocab, (n, length))
    targets = rng.integers(0, vocab, (n, length))

    emb = torch.nn.Embedding(vocab, embed).double()
    mha = _torch_attention(params, embed, 2)
    norm = torch.nn.LayerNorm(embed).double()
    head = torch.nn.Linear(embed, vocab, bias=False).double()
    with torch.no_grad():
        emb.weight.copy_(torch.tensor(params["emb.weight"]))
        norm.weight.copy_(torch.tensor(params["norm.weight"]))
        norm.bias.copy_(torch.tensor(params["norm.bias"]))
    head.weight = emb.weight  # tied
    modules = torch.nn.ModuleList([emb, mha, norm, head])
    optimizer = torch.optim.Adam(modules.parameters(), lr=0.01)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(length, dtype=torch.float64)
    step = nn.TrainStep(model, nn.Adam(), batch_size=n, dtype="float64", backend=backend)
    state = nn.Adam().init_state(params)

    def torch_loss() -> Any:
        h = emb(torch.tensor(ids))
        h = h + mha(h, h, h, need_weights=False, attn_mask=mask, is_causal=True)[0]  # type: ignore[operator]
        logits = head(norm(h))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), torch.tensor(targets).reshape(-1))

    params, state = steps_against_torch(step, ids, targets, params, state, 0.01, torch_loss, optimizer)
    np.testing.assert_allclose(params["emb.weight"], emb.weight.detach().numpy(), rtol=1e-8, atol=1e-10)
    model.params = params
    model.save(tmp_path / "tied.npz")
    loaded = nn.load(tmp_path / "tied.npz")
    assert loaded.get_layer("head").tied_params()["weight"][0] is loaded.get_layer("emb")
    np.testing.assert_array_equal(loaded.predict(ids, backend="reference"), model.predict(ids, backend="reference"))
    if backend == "reference":
        require("onnx", "the tied model is written to ONNX")
        ort = require("onnxruntime", "the written ONNX is run")
        from opgrad import onnx as opgrad_onnx

        model.params = {k: v.astype(np.float32) for k, v in params.items()}
        opgrad_onnx.save(model, tmp_path / "tied.onnx")
        session = ort.InferenceSession(str(tmp_path / "tied.onnx"), providers=["CPUExecutionProvider"])
        got = session.run(None, {session.get_inputs()[0].name: ids})[0]
        np.testing.assert_allclose(got, model.predict(ids, backend="reference"), rtol=1e-5, atol=2e-6)


def test_a_tie_names_what_does_not_fit() -> None:
    table = nn.Embedding(7, 4, name="table")
    with pytest.raises(ValueError, match=r"Dense\(9\) weight_from 'table' \(Embedding\(7, 4\)\): its table has 7 "
                                         r"rows"):
        nn.Dense(9, weight_from=table)
    inp = nn.Input((3, 5))
    with pytest.raises(opgrad.errors.ShapeError,
                       match=r"its weight is the table of 'table' \(Embedding\(7, 4\)\), rows of 4: the input's "
                             r"last axis"):
        nn.Dense(7, weight_from=table)(inp)
    features = nn.Input((3, 4))
    with pytest.raises(ValueError, match=r"takes its weight from layer 'table' \(Embedding\(7, 4\)\), which the "
                                         r"model does not use"):
        nn.Model(features, nn.Dense(7, weight_from=table)(features))


@pytest.mark.parametrize("backend", ["reference", "llvm"])
def test_attention_dropout_masks_the_weights_as_pytorchs(backend: str) -> None:
    """dropout=0.3: while training, the attention weights times a mask drawn as a Dropout layer's
    (an input of the step, (heads, length_q, length_kv) per example); equal to PyTorch's attention
    computed with that mask, in output and gradients; off at evaluation."""
    n, length, embed, heads = 2, 4, 8, 2
    layer = nn.MultiHeadAttention(heads, causal=True, dropout=0.3, name="att")
    model = nn.Sequential([layer], input_shape=(length, embed))
    assert [lay.name for lay in model.noise_layers()] == ["att"] and layer.noise_shape() == (heads, length, length)
    rng = np.random.default_rng(14)
    params = {k: v + 0.1 * rng.standard_normal(v.shape) for k, v in model.init_params(0, "float64").items()}
    mask = model.sample_noise(np.random.default_rng(1), n, "float64")["att"]
    assert set(np.unique(mask)) <= {0.0, 1 / 0.7} and 0 < (mask == 0).mean() < 0.6
    x, cotangent = rng.standard_normal((n, length, embed)), rng.standard_normal((n, length, embed))

    xt = torch.tensor(x, requires_grad=True)
    p = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    w, b = p["att.in_proj_weight"], p["att.in_proj_bias"]
    q, k, v = (torch.nn.functional.linear(xt, w[i * embed:(i + 1) * embed], b[i * embed:(i + 1) * embed])
               .reshape(n, length, heads, embed // heads).transpose(1, 2) for i in range(3))
    scores = q @ k.transpose(-1, -2) / (embed // heads) ** 0.5
    scores = scores + torch.triu(torch.full((length, length), float("-inf"), dtype=torch.float64), 1)
    attended = (torch.softmax(scores, dim=-1) * torch.tensor(mask)) @ v
    yt = torch.nn.functional.linear(attended.transpose(1, 2).reshape(n, length, embed), p["att.out_proj_weight"],
                                    p["att.out_proj_bias"])
    yt.backward(torch.tensor(cotangent))

    images = opgrad.var("x", x.shape, "float64")
    noise = opgrad.var("mask", mask.shape, "float64")
    variables = {key: opgrad.var(key, value.shape, "float64") for key, value in params.items()}
    out = model.forward(images, variables, nn.ForwardContext(training=True, noise={"att": noise}))
    loss = ops.sum(ops.multiply(out, opgrad.const(cotangent)))
    fn = opgrad.function([images, noise, *variables.values()],
                         [out, *opgrad.gradients(loss, [images, *variables.values()])])
    y, dx, *grads = nn.compile_function(fn, backend)(x, mask, *params.values())
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-10, atol=1e-12)
    for name, grad in zip(variables, grads, strict=True):
        np.testing.assert_allclose(grad, p[name].grad.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)
    model.params = params
    plain = nn.Sequential([nn.MultiHeadAttention(heads, causal=True, name="att")], input_shape=(length, embed))
    plain.params = params
    np.testing.assert_array_equal(model.predict(x, backend=backend), plain.predict(x, backend=backend))
    trainer = nn.Trainer(model, nn.SGD(), batch_size=n, dtype="float64", loss="mse", backend=backend)
    trainer.train_batch(x, x)  # the step draws and feeds the mask itself


def test_padding_masks_and_token_ids_are_checked_where_they_enter() -> None:
    """A padding mask holding other than 0 and 1 (PyTorch's additive 0 / -inf mask, say) is refused
    naming the layer; an int64 0/1 mask (Hugging Face's) takes no image-scaling warning; the steps
    take token ids of any integer type and name the input of float ones; freezing a tied output
    layer freezes the table it reads, as requires_grad_(False) on either PyTorch module does."""
    tokens, keep = nn.Input((5,), dtype="int64", name="tokens"), nn.Input((5,), name="keep")
    table = nn.Embedding(9, 4, name="emb")
    h = nn.MultiHeadAttention(2, padding_mask=True, name="att")([table(tokens), keep])
    head = nn.Dense(9, use_bias=False, weight_from=table, name="head")
    model = nn.Model([tokens, keep], head(h), name="lm")
    ids = np.random.default_rng(0).integers(0, 9, (2, 5))
    additive = np.array([[0, 0, 0, -np.inf, -np.inf]] * 2)
    with pytest.raises(ValueError, match=r"input 'keep' is the padding mask of layer 'att' \(MultiHeadAttention"
                                         r"\(2 heads, padding mask\)\): 1 for a token and 0 for padding; got other"):
        model.predict([ids, additive])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.predict([ids, np.ones((2, 5), np.int64)])
    step = nn.TrainStep(model, nn.SGD(), batch_size=2)
    ones = np.ones((2, 5), np.float32)
    step([ids.astype(np.int32), ones], ids, model.params, {}, 0.1)
    with pytest.raises(ValueError, match=r"TrainStep of model 'lm': input 'tokens' takes integer ids \(int64\), got an "
                                         r"array of float64"):
        step([ids.astype(np.float64), ones], ids, model.params, {}, 0.1)
    head.trainable = False
    assert "emb.weight" not in model.trainable_param_names()
