"""Trainer with models other than one float image input: token ids (int64) and several inputs.

Every Trainer run is checked against a hand-driven ``nn.TrainStep`` over the same batches (the
Trainer only adds the epoch's batch order and the cast of float inputs to float32), and llvm
against the numpy reference. The error cases are refused before any step runs.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from trainers import assert_split_trains_as_plain

from opgrad import nn
from opgrad.data import iterate_batches
from opgrad.errors import ShapeError
from opgrad.nn.losses import accuracy, cross_entropy_numpy
from opgrad.nn.trainer import Inputs, epoch_shuffle_seed

BATCH, EXAMPLES, EPOCHS, LR, SEED = 8, 40, 4, 0.05, 3
BACKENDS = ("reference", "llvm")


def text_classifier() -> nn.Model:
    """Embedding -> Flatten -> Dense over six token ids."""
    tokens = nn.Input((6,), dtype="int64", name="tokens")
    embedded = nn.Flatten(name="flat")(nn.Embedding(30, 8, name="embed")(tokens))
    return nn.Model(tokens, nn.Dense(3, name="logits")(embedded), name="text")


def text_data() -> tuple[np.ndarray, np.ndarray]:
    """Token ids and a class the first token decides."""
    ids = np.random.default_rng(0).integers(0, 30, (EXAMPLES, 6))
    return ids, ids[:, 0] % 3


def two_input_model() -> nn.Model:
    """Float features and token ids, each through layers of its own, then joined."""
    features = nn.Input((4,), name="features")
    tokens = nn.Input((3,), dtype="int64", name="tokens")
    dense = nn.Dense(6, activation="tanh", name="dense")(features)
    embedded = nn.Flatten(name="flat")(nn.Embedding(10, 2, name="embed")(tokens))
    joined = nn.Concatenate(name="join")([dense, embedded])
    return nn.Model([features, tokens], nn.Dense(3, name="logits")(joined), name="two-inputs")


def two_input_data() -> tuple[list[np.ndarray], np.ndarray]:
    """float64 features (the Trainer casts them to float32), token ids, a class both decide."""
    rng = np.random.default_rng(1)
    features = rng.standard_normal((EXAMPLES, 4))
    tokens = rng.integers(0, 10, (EXAMPLES, 3))
    return [features, tokens], (features[:, 0] > 0).astype(np.int64) + tokens[:, 0] % 2


MODELS: dict[str, tuple[Callable[[], nn.Model], Callable[[], tuple[Inputs, np.ndarray]]]] = {
    "text": (text_classifier, text_data),
    "two-inputs": (two_input_model, two_input_data),
}


def as_list(inputs: Inputs) -> list[np.ndarray]:
    return [inputs] if isinstance(inputs, np.ndarray) else list(inputs)


def train_with_trainer(model: nn.Model, inputs: Inputs, labels: np.ndarray, backend: str,
                       steps_per_call: int = 1) -> tuple[nn.Trainer, list[float]]:
    trainer = nn.Trainer(model, nn.Adam(), lr=LR, batch_size=BATCH, seed=SEED, backend=backend, eval_batch_size=7)
    losses: list[float] = []
    for _ in range(EPOCHS):
        trainer.train_epoch(inputs, labels, steps_per_call=steps_per_call,
                            on_step=lambda i, loss: losses.append(loss))
    return trainer, losses


def train_by_hand(model: nn.Model, inputs: list[np.ndarray], labels: np.ndarray,
                  backend: str) -> tuple[list[float], dict[str, np.ndarray]]:
    """The same epochs as single TrainStep calls: Trainer's documented order (a PCG64 permutation
    seeded by ``epoch_shuffle_seed``, the last partial batch dropped), float inputs cast by hand."""
    step = nn.TrainStep(model, nn.Adam(), batch_size=BATCH, backend=backend)
    params = model.init_params(SEED, "float32")
    state = {**nn.Adam().init_state(params), **model.init_buffers("float32")}
    arrays = [a.astype(np.float32) if a.dtype.kind == "f" else a for a in inputs]
    losses = []
    for epoch in range(EPOCHS):
        order = np.random.Generator(np.random.PCG64(epoch_shuffle_seed(SEED, epoch))).permutation(len(labels))
        for start in range(0, len(labels) - BATCH + 1, BATCH):
            rows = order[start : start + BATCH]
            result = step([a[rows] for a in arrays], labels[rows], params, state, LR)
            losses.append(result.loss)
            params, state = result.params, result.state
    return losses, params


# ----- training: the same numbers as TrainStep, on both backends -----


@pytest.mark.parametrize("kind", list(MODELS))
def test_trainer_trains_like_train_step_and_backends_agree(kind: str) -> None:
    build, data = MODELS[kind]
    inputs, labels = data()
    runs: dict[str, tuple[nn.Trainer, list[float]]] = {}
    for backend in BACKENDS:
        trainer, losses = train_with_trainer(build(), inputs, labels, backend)
        expected_losses, expected_params = train_by_hand(build(), as_list(inputs), labels, backend)
        np.testing.assert_array_equal(losses, expected_losses)
        for name, value in expected_params.items():
            np.testing.assert_array_equal(trainer.params[name], value, err_msg=name)
        per_epoch = np.reshape(losses, (EPOCHS, -1)).mean(axis=1)
        assert per_epoch[-1] < 0.8 * per_epoch[0], per_epoch
        runs[backend] = trainer, losses
    (reference, reference_losses), (llvm, llvm_losses) = runs["reference"], runs["llvm"]
    np.testing.assert_allclose(llvm_losses, reference_losses, rtol=1e-5)
    for name, value in reference.params.items():
        np.testing.assert_allclose(llvm.params[name], value, rtol=1e-4, atol=1e-6, err_msg=name)
    # 40 examples in batches of 7: the last one padded, ids included.
    evaluated = {backend: trainer.evaluate(inputs, labels) for backend, (trainer, _) in runs.items()}
    np.testing.assert_allclose(evaluated["llvm"], evaluated["reference"], rtol=1e-5)
    logits = reference.model.predict(inputs, batch_size=EXAMPLES, backend="reference")
    assert isinstance(logits, np.ndarray)
    np.testing.assert_allclose(evaluated["reference"], (accuracy(logits, labels), cross_entropy_numpy(logits, labels)),
                               rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", list(MODELS))
def test_several_steps_per_call_give_the_single_steps_numbers(kind: str, backend: str) -> None:
    """Five steps an epoch in calls of three and two (llvm: the native multi-step loop)."""
    build, data = MODELS[kind]
    inputs, labels = data()
    chunked, chunked_losses = train_with_trainer(build(), inputs, labels, backend, steps_per_call=3)
    expected_losses, expected_params = train_by_hand(build(), as_list(inputs), labels, backend)
    np.testing.assert_array_equal(chunked_losses, expected_losses)
    for name, value in expected_params.items():
        np.testing.assert_array_equal(chunked.params[name], value, err_msg=name)


def test_train_batch_and_train_batches_take_a_list_per_batch() -> None:
    inputs, labels = two_input_data()
    batches = [([a[i : i + BATCH] for a in inputs], labels[i : i + BATCH]) for i in range(0, EXAMPLES, BATCH)]
    one_by_one = nn.Trainer(two_input_model(), nn.SGD(), lr=LR, batch_size=BATCH, backend="reference")
    together = nn.Trainer(two_input_model(), nn.SGD(), lr=LR, batch_size=BATCH, backend="reference")
    losses = [one_by_one.train_batch(x, y) for x, y in batches]
    assert together.train_batches(batches) == losses
    assert losses[-1] < losses[0]


def test_one_input_takes_an_array_or_a_list_of_one_and_int32_ids() -> None:
    ids, labels = text_data()
    results = []
    for given in (ids, [ids], (ids.astype(np.int32),)):
        trainer = nn.Trainer(text_classifier(), nn.Adam(), lr=LR, batch_size=BATCH, seed=SEED, backend="reference")
        results.append((trainer.train_epoch(given, labels), trainer.evaluate(given, labels)))
    assert results[0] == results[1] == results[2]


def test_epoch_batches_cut_every_input_by_the_same_rows() -> None:
    count = 20
    features = np.repeat(np.arange(count, dtype=np.float64)[:, None], 4, axis=1)
    tokens = np.repeat(np.arange(count)[:, None] % 10, 3, axis=1)  # ids of the 10-row embedding
    row_ids = np.arange(count)
    trainer = nn.Trainer(two_input_model(), nn.SGD(), batch_size=6, seed=SEED)
    batches = list(trainer.epoch_batches([features, tokens], row_ids))
    assert len(batches) == 3  # 20 // 6; the short last batch is dropped
    for (batch_features, batch_tokens), batch_rows in batches:
        np.testing.assert_array_equal(batch_features[:, 0], batch_rows)
        np.testing.assert_array_equal(batch_tokens[:, 0], batch_rows % 10)
    seen = np.concatenate([rows for _, rows in batches])
    assert len(set(seen.tolist())) == 18 and not np.array_equal(seen, np.arange(18))  # shuffled, each row once
    # A one-input model's batches are iterate_batches' (the order single-input runs always had).
    ids, labels = text_data()
    text = nn.Trainer(text_classifier(), nn.SGD(), batch_size=BATCH, seed=SEED)
    text.epoch = 2
    expected = iterate_batches(ids, labels, BATCH, shuffle_seed=epoch_shuffle_seed(SEED, 2), drop_last=True)
    for (x, y), (want_x, want_y) in zip(text.epoch_batches(ids, labels), expected, strict=True):
        assert isinstance(x, np.ndarray)
        np.testing.assert_array_equal(x, want_x)
        np.testing.assert_array_equal(y, want_y)


# ----- errors: one line, naming the input, before any step -----


def _calls(trainer: nn.Trainer, inputs: Inputs, labels: np.ndarray) -> dict[str, Callable[[], object]]:
    """Every public Trainer method that takes inputs, on ``inputs`` as given."""
    return {
        "train_batch": lambda: trainer.train_batch(inputs, labels),
        "train_batches": lambda: trainer.train_batches([(inputs, labels)]),
        "train_epoch": lambda: trainer.train_epoch(inputs, labels),
        "epoch_batches": lambda: trainer.epoch_batches(inputs, labels),
        "evaluate": lambda: trainer.evaluate(inputs, labels),
    }


def _refused(trainer: nn.Trainer, inputs: Inputs, labels: np.ndarray, error: type[Exception], message: str) -> None:
    for method, call in _calls(trainer, inputs, labels).items():
        with pytest.raises(error, match=message) as info:
            call()
        assert str(info.value).startswith(f"Trainer.{method}"), str(info.value)
        assert "\n" not in str(info.value)
    assert trainer.step == 0 and trainer.epoch == 0


def test_float_ids_are_refused_not_truncated() -> None:
    ids, labels = text_data()
    trainer = nn.Trainer(text_classifier(), nn.SGD(), batch_size=BATCH, backend="reference")
    _refused(trainer, ids[:BATCH] + 0.5, labels[:BATCH], ValueError,
             r"input 'tokens' takes integer ids \(int64\), got an array of float64; convert it with "
             r"\.astype\(np\.int64\) if its values are whole")
    (features, tokens), labels = two_input_data()
    two = nn.Trainer(two_input_model(), nn.SGD(), batch_size=BATCH, backend="reference")
    _refused(two, [features[:BATCH], tokens[:BATCH].astype(np.float32)], labels[:BATCH], ValueError,
             r"input 'tokens' takes integer ids \(int64\), got an array of float32")


def test_a_wrong_number_of_inputs_is_refused() -> None:
    (features, tokens), labels = two_input_data()
    trainer = nn.Trainer(two_input_model(), nn.SGD(), batch_size=BATCH, backend="reference")
    listed = r"\('features' \(4,\) float, 'tokens' \(3,\) int64\)"
    _refused(trainer, features[:BATCH], labels[:BATCH], ValueError,
             rf"model 'two-inputs' takes 2 input array\(s\) {listed}, got 1$")
    _refused(trainer, [features[:BATCH], tokens[:BATCH], tokens[:BATCH]], labels[:BATCH], ValueError,
             rf"model 'two-inputs' takes 2 input array\(s\) {listed}, got 3$")


def test_inputs_with_different_numbers_of_rows_are_refused() -> None:
    (features, tokens), labels = two_input_data()
    trainer = nn.Trainer(two_input_model(), nn.SGD(), batch_size=BATCH, backend="reference")
    _refused(trainer, [features[:BATCH], tokens[: BATCH - 2]], labels[:BATCH], ValueError,
             r"the inputs hold different numbers of examples \('features' 8, 'tokens' 6\)$")
    _refused(trainer, [features[:BATCH], tokens[:BATCH]], labels[: BATCH - 1], ValueError,
             r"every input needs one row per label; got 7 labels and rows 'features' 8, 'tokens' 8$")


def test_an_input_of_the_wrong_shape_is_refused() -> None:
    (features, tokens), labels = two_input_data()
    trainer = nn.Trainer(two_input_model(), nn.SGD(), batch_size=BATCH, backend="reference")
    _refused(trainer, [features[:BATCH, :3], tokens[:BATCH]], labels[:BATCH], ShapeError,
             r"input 'features' has shape \(8, 3\); model 'two-inputs' expects \(N, 4\)$")


@pytest.mark.parametrize("option", [{"augment_shift": 1}, {"augment_rotate": 5.0}, {"augment_scale": 0.1}])
@pytest.mark.parametrize("build", [text_classifier, two_input_model])
def test_augmentation_is_refused_for_a_model_without_one_image_input(build: Callable[[], nn.Model],
                                                                     option: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=r"^Trainer: augment_shift, augment_rotate and augment_scale move the "
                                         r"pixels of one image input \(channels, height, width\); model "
                                         r"'(text' takes 'tokens' \(6,\) int64|two-inputs' takes 'features' \(4,\))"):
        nn.Trainer(build(), nn.SGD(), **option)  # type: ignore[arg-type]


# ----- the distributed Trainer: the same inputs, sharded by rows -----


def test_one_rank_split_step_is_bitwise_the_plain_trainer() -> None:
    """In a world of one, the split step + all-reduce computes exactly the Trainer's step."""
    pytest.importorskip("mpi4py", reason="distributed training runs on MPI through mpi4py (the `distributed` extra)")
    from opgrad.distributed import DistributedTrainer

    for build, data in MODELS.values():
        inputs, labels = data()
        options = dict(lr=LR, batch_size=BATCH, seed=SEED, backend="reference")
        plain = nn.Trainer(build(), nn.Adam(), **options)  # type: ignore[arg-type]
        split = DistributedTrainer(build(), nn.Adam(), **options, fused_when_alone=False)  # type: ignore[arg-type]
        assert_split_trains_as_plain(plain, split, inputs, labels)


TWO_RANKS = """
    import json, sys
    sys.path.insert(0, {tests!r})
    from test_trainer_inputs import EPOCHS, LR, SEED, two_input_data, two_input_model
    from opgrad import nn
    from opgrad.distributed import DistributedTrainer, world

    comm = world()
    inputs, labels = two_input_data()
    trainer = DistributedTrainer(two_input_model(), nn.Adam(), lr=LR, batch_size=9, seed=SEED, backend="llvm")
    losses = []
    for _ in range(EPOCHS):
        trainer.train_epoch(inputs, labels, on_step=lambda i, loss: losses.append(loss))
    json.dump({{"rows": trainer.rows, "losses": losses, "eval": trainer.evaluate(inputs, labels)}},
              open(f"rank{{comm.rank}}.json", "w"))
"""


def test_two_ranks_train_a_two_input_model_like_one_process(tmp_path: Path) -> None:
    pytest.importorskip("mpi4py", reason="distributed training runs on MPI through mpi4py (the `distributed` extra)")
    beside = Path(sys.executable).parent / "mpirun"
    mpirun = str(beside) if beside.exists() else shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun not found: pip install mpich")
    script = tmp_path / "two_ranks.py"
    script.write_text(textwrap.dedent(TWO_RANKS.format(tests=str(Path(__file__).parent))))
    done = subprocess.run([mpirun, "-n", "2", sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    inputs, labels = two_input_data()
    single = nn.Trainer(two_input_model(), nn.Adam(), lr=LR, batch_size=9, seed=SEED, backend="llvm")
    losses: list[float] = []
    for _ in range(EPOCHS):
        single.train_epoch(inputs, labels, on_step=lambda i, loss: losses.append(loss))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [rank["rows"] for rank in ranks] == [[0, 5], [5, 9]]  # each global batch of 9 split 5 + 4
    for rank in ranks:
        np.testing.assert_allclose(rank["losses"], losses, rtol=1e-5)
        np.testing.assert_allclose(rank["eval"], single.evaluate(inputs, labels), rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ids_past_the_embedding_table_name_the_layer(backend: str) -> None:
    ids, labels = text_data()
    bad = ids.copy()
    bad[3, 2] = 30
    model = text_classifier()
    message = r"input 'tokens' feeds layer 'embed' \(Embedding\(30, 8\)\), whose ids lie in 0..29; got values in 0..30"
    with pytest.raises(ValueError, match=message):
        model.predict(bad, backend=backend)
    with pytest.warns(UserWarning, match="the model already holds weights"):  # predict drew seed 0's
        trainer = nn.Trainer(model, nn.SGD(), lr=LR, batch_size=BATCH, seed=SEED, backend=backend)
    with pytest.raises(ValueError, match=message):
        trainer.train_epoch(bad, labels)
    bad[3, 2] = -1
    with pytest.raises(ValueError, match=r"got values in -1\.\.29"):
        trainer.evaluate(bad, labels)


@pytest.mark.parametrize("backend", BACKENDS)
def test_integer_labels_of_any_width_train_as_int64(backend: str) -> None:
    # Trainer's check takes any integer class indices, so every training method casts them: int32
    # and uint8 labels failed inside the compiled step, naming only its argument.
    ids, labels = text_data()
    results = []
    for dtype in (np.int64, np.int32, np.uint8):
        trainer = nn.Trainer(text_classifier(), nn.SGD(), lr=LR, batch_size=BATCH, seed=SEED, backend=backend)
        y = labels.astype(dtype)
        results.append((trainer.train_batch(ids[:BATCH], y[:BATCH]),
                        trainer.train_batches([(ids[:BATCH], y[:BATCH])]),
                        trainer.train_epoch(ids, y, steps_per_call=2), trainer.evaluate(ids, y)))
    assert results[0] == results[1] == results[2]


def test_integer_images_are_trained_unscaled_with_a_warning_unless_rescaled() -> None:
    # Raw uint8 pixels are cast as they are (as Keras does): the same numbers as the float32 cast,
    # with a warning that names the input, unless the input feeds a Rescaling layer.
    pixels = np.random.default_rng(0).integers(0, 256, (BATCH, 1, 4, 4)).astype(np.uint8)
    labels = np.arange(BATCH) % 3

    def classifier(*first: nn.Layer) -> nn.Model:
        return nn.Sequential([*first, nn.Flatten(), nn.Dense(3)], input_shape=(1, 4, 4), name="pixels")

    plain = nn.Trainer(classifier(), nn.SGD(), lr=1e-4, batch_size=BATCH, backend="reference")
    with pytest.warns(UserWarning, match=r"Trainer.train_batch: input 'images' is uint8, taken as float32 values as "
                                         r"they are, unscaled; divide it first \(images / 255\)"):
        loss = plain.train_batch(pixels, labels)
    cast = nn.Trainer(classifier(), nn.SGD(), lr=1e-4, batch_size=BATCH, backend="reference")
    assert cast.train_batch(pixels.astype(np.float32), labels) == loss
    with pytest.warns(UserWarning, match="input 'images' is uint8"):
        classifier().predict(pixels)
    rescaled = nn.Trainer(classifier(nn.Rescaling(1 / 255)), nn.SGD(), lr=0.1, batch_size=BATCH, backend="reference")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rescaled.train_batch(pixels, labels)


def test_train_step_takes_a_torch_tensor_and_names_rows_that_disagree() -> None:
    torch = pytest.importorskip("torch", reason="torch (the dev extra) converts the tensor")
    model = nn.Sequential([nn.Flatten(), nn.Dense(5)], input_shape=(3, 4, 4), name="flat")
    optimizer = nn.SGD()
    params = model.init_params(0)
    state = {**optimizer.init_state(params), **model.buffers}
    step = nn.TrainStep(model, optimizer, batch_size=4, backend="reference")
    images = np.random.default_rng(0).random((8, 3, 4, 4), np.float32)
    labels = np.arange(8) % 5
    want = step(images[:4], labels[:4], params, state, lr=0.1).loss
    assert step(torch.from_numpy(images[:4]), torch.from_numpy(labels[:4]), params, state, lr=0.1).loss == want
    assert step.run_steps(torch.from_numpy(images), labels, params, state, lr=0.1).losses[0] == want
    with pytest.raises(ShapeError, match=r"TrainStep.run_steps of model 'flat': input 'images' has 8 rows and the "
                                         r"labels 4: each holds the K \* batch_size rows of K steps"):
        step.run_steps(images, labels[:4], params, state, lr=0.1)
    with pytest.raises(ShapeError, match=r"a batch of 8 where the step was built for batch_size=4$"):
        step(images, labels, params, state, lr=0.1)
    with pytest.raises(ShapeError, match=r"a batch of 2 where .* \(a last, smaller batch"):
        step(images[:2], labels[:2], params, state, lr=0.1)


@pytest.mark.parametrize("seed", [-1, 1.5, True])
def test_iterate_batches_names_a_bad_shuffle_seed(seed: object) -> None:
    with pytest.raises(ValueError, match=r"iterate_batches: shuffle_seed must be None or a non-negative integer, "
                                         rf"got {seed!r}"):
        next(iterate_batches(np.zeros((4, 2)), np.zeros(4, np.int64), 2, shuffle_seed=seed, drop_last=True))  # type: ignore[arg-type]


def two_head_model() -> nn.Model:
    """One image input, a digit head and a parity head."""
    images = nn.Input((1, 4, 4))
    features = nn.Dense(8, activation="tanh", name="features")(nn.Flatten(name="flat")(images))
    return nn.Model(images, [nn.Dense(3, name="digit")(features), nn.Dense(2, name="parity")(features)], name="heads")


def test_trainer_weights_each_outputs_loss_as_train_step_does() -> None:
    # Trainer(loss_weights=...) is TrainStep's: the heads' cross-entropies weighted and summed.
    images = np.random.default_rng(2).random((BATCH, 1, 4, 4), np.float32)
    labels = [np.arange(BATCH) % 3, np.arange(BATCH) % 2]
    weights = [0.7, 2.5]
    trainer = nn.Trainer(two_head_model(), nn.SGD(), lr=LR, batch_size=BATCH, seed=SEED, backend="reference",
                         loss_weights=weights)
    model = two_head_model()
    step = nn.TrainStep(model, nn.SGD(), batch_size=BATCH, backend="reference", loss_weights=weights)
    want = step(images, labels, trainer.params, {**nn.SGD().init_state(trainer.params), **model.buffers}, LR).loss
    assert trainer.train_batch(images, labels) == want
    plain = nn.Trainer(two_head_model(), nn.SGD(), lr=LR, batch_size=BATCH, seed=SEED, backend="reference")
    assert plain.train_batch(images, labels) != want
    with pytest.raises(ValueError, match=r"model 'heads': loss_weights must be finite numbers >= 0"):
        nn.Trainer(two_head_model(), nn.SGD(), loss_weights=[1.0, -1.0])
    with pytest.raises(ValueError, match=r"loss_weights has 1 entries but model 'heads' has 2 outputs"):
        nn.Trainer(two_head_model(), nn.SGD(), loss_weights=[1.0])


def test_one_rank_split_step_weights_the_heads_as_the_plain_trainer() -> None:
    pytest.importorskip("mpi4py", reason="distributed training runs on MPI through mpi4py (the `distributed` extra)")
    from opgrad.distributed import DistributedTrainer

    images = np.random.default_rng(3).random((2 * BATCH, 1, 4, 4), np.float32)
    labels = [np.arange(2 * BATCH) % 3, np.arange(2 * BATCH) % 2]
    options = dict(lr=LR, batch_size=BATCH, seed=SEED, backend="reference", loss_weights=[0.7, 2.5])
    plain = nn.Trainer(two_head_model(), nn.Adam(), **options)  # type: ignore[arg-type]
    split = DistributedTrainer(two_head_model(), nn.Adam(), **options, fused_when_alone=False)  # type: ignore[arg-type]
    assert_split_trains_as_plain(plain, split, images, labels)
