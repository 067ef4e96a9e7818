"""Training: compiled-vs-reference parity, reproducibility, checkpoint resume, and the CLI.

The parity tests run the llvm backend (``opgrad.compile``) against the reference: they are the
acceptance test for the compiled training step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from opgrad import checkpoint, cli, nn, train
from opgrad.checkpoint import load_checkpoint, save_checkpoint
from opgrad.data import Dataset, load_embedded_mnist


@pytest.fixture(scope="module")
def mnist() -> Dataset:
    return load_embedded_mnist()


def _parity(model: nn.Sequential, optimizer: nn.Optimizer, mnist: Dataset, *, steps: int, batch: int,
            lr: float) -> None:
    reference = nn.TrainStep(model, optimizer, batch_size=batch, backend="reference")
    compiled = nn.TrainStep(model, optimizer, batch_size=batch, backend="llvm")
    start = model.init_params(seed=0)
    runs = {}
    for name, step in (("reference", reference), ("llvm", compiled)):
        params, state = dict(start), optimizer.init_state(start)
        losses = []
        for i in range(steps):
            x = mnist.train_images[i * batch : (i + 1) * batch]
            y = mnist.train_labels[i * batch : (i + 1) * batch]
            masks = model.sample_noise(np.random.default_rng(i), batch)
            result = step(x, y, params, state, lr, masks)
            params, state = result.params, result.state
            losses.append(result.loss)
        runs[name] = np.array(losses)
    np.testing.assert_allclose(runs["llvm"], runs["reference"], rtol=1e-5, atol=0)
    assert runs["reference"][-5:].mean() < runs["reference"][:5].mean()  # the run did learn


def test_compiled_seed_cnn_losses_match_reference_over_20_sgd_steps(mnist: Dataset) -> None:
    _parity(nn.seed_cnn(), nn.SGD(), mnist, steps=20, batch=16, lr=0.05)


def test_compiled_keras_mnist_adam_matches_reference(mnist: Dataset) -> None:
    _parity(nn.keras_mnist(), nn.Adam(), mnist, steps=10, batch=16, lr=1e-3)


# ----- reproducibility and resume -----


def _small(mnist: Dataset, n: int = 32) -> tuple[np.ndarray, np.ndarray]:
    return mnist.train_images[:n], mnist.train_labels[:n]


def _trainer(model_name: str, seed: int = 5) -> nn.Trainer:
    optimizer = nn.Adam() if model_name == "seed-cnn" else nn.SGD(momentum=0.9, nesterov=True)
    return nn.Trainer(nn.build_model(model_name), optimizer, lr=nn.cosine_lr(2e-3, total_steps=6),
                      batch_size=16, seed=seed, augment_shift=2, eval_batch_size=32)


def test_same_seed_same_numbers(mnist: Dataset) -> None:
    x, y = _small(mnist)
    runs = []
    for seed in (5, 5, 6):
        trainer = _trainer("keras-mnist", seed)
        for _ in range(2):
            trainer.train_epoch(x, y)
        runs.append(trainer.history.step_losses)
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


@pytest.mark.parametrize("model_name", ["seed-cnn", "keras-mnist"])
def test_checkpoint_resume_continues_identically(mnist: Dataset, tmp_path: Path, model_name: str) -> None:
    x, y = _small(mnist)
    straight = _trainer(model_name)
    for _ in range(3):
        straight.train_epoch(x, y)

    first = _trainer(model_name)
    first.train_epoch(x, y)
    arrays, meta = first.checkpoint()
    save_checkpoint(tmp_path / "ckpt.npz", arrays, meta)

    resumed = _trainer(model_name)
    arrays, meta = load_checkpoint(tmp_path / "ckpt.npz", expected=resumed.expected_arrays())
    resumed.restore(arrays, meta)
    assert (resumed.epoch, resumed.step) == (1, 2)
    for _ in range(2):
        resumed.train_epoch(x, y)

    assert resumed.history.step_losses == straight.history.step_losses
    for name, value in straight.params.items():
        np.testing.assert_array_equal(resumed.params[name], value, err_msg=name)
    for name, value in straight.state.items():
        np.testing.assert_array_equal(resumed.state[name], value, err_msg=name)


def test_restore_rejects_other_model_or_optimizer(mnist: Dataset) -> None:
    arrays, meta = _trainer("seed-cnn").checkpoint()
    other = nn.Trainer(nn.seed_cnn(), nn.SGD(), lr=0.01)
    with pytest.raises(ValueError, match="same optimizer"):
        other.restore(arrays, meta)
    with pytest.raises(ValueError, match="not 'keras-mnist'"):
        _trainer("keras-mnist").restore(arrays, meta)


def test_cli_resume_with_another_optimizer_or_model_says_so(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint of momentum SGD resumed under Adam, or as another model, names the optimizer or
    model first: their arrays differ by the dozen, which says less."""
    ckpt = tmp_path / "momentum.npz"
    assert cli.main([*SMOKE, "--optimizer", "momentum", "--save", str(ckpt)]) == 0
    capsys.readouterr()
    assert cli.main([*SMOKE, "--resume", str(ckpt), "--epochs", "2", "--optimizer", "adam"]) == 2
    err = capsys.readouterr().err
    assert f"--optimizer adam: the checkpoint {ckpt} was trained with --optimizer momentum; a resumed run " \
           "continues with its own settings" in err
    assert "missing arrays" not in err and err.count("\n") == 1
    _, meta = load_checkpoint(ckpt)
    del meta["run_settings"]  # a checkpoint that does not record its settings: the optimizer is still compared
    arrays, _ = load_checkpoint(ckpt)
    save_checkpoint(ckpt, arrays, meta)
    assert cli.main([*SMOKE, "--resume", str(ckpt), "--epochs", "2"]) == 2
    assert "checkpoint was trained with 'sgd(momentum=0.9)'; resume it with the same optimizer" \
           in capsys.readouterr().err
    assert cli.main([*SMOKE, "--model", "mlp", "--optimizer", "momentum", "--resume", str(ckpt), "--epochs", "2"]) == 2
    assert "checkpoint is of model 'seed-cnn', not 'mlp'" in capsys.readouterr().err
    weights = tmp_path / "weights.npz"
    nn.seed_cnn().save(weights)  # a model's weights, no training run
    assert cli.main([*SMOKE, "--resume", str(weights), "--epochs", "2"]) == 2
    assert "holds a model's weights but no optimizer state to resume; start a new run from its weights " \
           "(opgrad train --init" in capsys.readouterr().err


def test_lr_schedule() -> None:
    schedule = nn.cosine_lr(1e-3, total_steps=100)
    assert schedule(0) == pytest.approx(1e-3)
    assert schedule(50) == pytest.approx(5e-4)
    assert schedule(100) == schedule(150) == pytest.approx(0.0)
    assert nn.constant_lr(0.1)(10**6) == 0.1


def test_evaluate_pads_the_last_batch(mnist: Dataset) -> None:
    trainer = _trainer("seed-cnn")
    acc, loss = trainer.evaluate(mnist.test_images[:45], mnist.test_labels[:45])  # 32 + 13 padded
    logits = trainer.eval_step.logits(mnist.test_images[:45], trainer.params)
    assert logits.shape == (45, 10)
    assert acc == nn.accuracy(logits, mnist.test_labels[:45])
    assert 0.0 <= acc <= 1.0 and np.isfinite(loss)


# ----- the CLI -----

SMOKE = ["train", "--backend", "reference", "--batch-size", "8", "--max-steps", "2", "--test-limit", "40"]


def test_cli_resume_continues_with_the_settings_the_run_was_saved_with(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    # Two epochs in one run, and one epoch then a resume that repeats none of the options: the same
    # batches, schedule and updates, so the same weights to the bit.
    settings = ["--model", "mlp", "--optimizer", "sgd", "--lr", "0.05", "--batch-size", "16", "--lr-schedule", "step",
                "--lr-step-size", "2", "--lr-gamma", "0.5", "--warmup-steps", "1", "--augment-shift", "1",
                "--seed", "3", "--max-steps", "3", "--test-limit", "40", "--backend", "reference"]
    straight, first, resumed = tmp_path / "straight.npz", tmp_path / "first.npz", tmp_path / "resumed.npz"
    assert cli.main(["train", *settings, "--epochs", "2", "--save", str(straight)]) == 0
    assert cli.main(["train", *settings, "--epochs", "1", "--save", str(first)]) == 0
    capsys.readouterr()
    assert cli.main(["train", "--epochs", "2", "--resume", str(first), "--save", str(resumed),
                     "--test-limit", "40", "--backend", "reference"]) == 0
    said = capsys.readouterr().out
    assert "optimizer sgd, lr" in said and "batch 16, augment shift 1" in said and "seed 3" in said
    want, _ = load_checkpoint(straight)
    got, meta = load_checkpoint(resumed)
    assert meta["step"] == 6 and sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert cli.main(["train", "--epochs", "2", "--resume", str(first), "--lr", "0.01"]) == 2
    assert capsys.readouterr().err.endswith(
        f"--lr 0.01: the checkpoint {first} was trained with --lr 0.05; a resumed run continues with its own "
        "settings: leave --lr out (or start a new run from its weights with --init)\n")


def test_cli_resume_of_an_interrupted_run_continues_to_its_own_epochs(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # Without --epochs the resumed run ends where the saved one would have, on the same cosine
    # schedule (it fell back to the model's default length and re-planned the decay).
    settings = ["--model", "mlp", "--batch-size", "16", "--max-steps", "3", "--test-limit", "40",
                "--backend", "reference"]
    straight, interrupted = tmp_path / "straight.npz", tmp_path / "interrupted.npz"
    assert cli.main(["train", *settings, "--epochs", "3", "--save", str(straight)]) == 0
    real_save = checkpoint.save_checkpoint

    def save_then_interrupt(path: Any, arrays: Any, meta: Any) -> None:
        real_save(path, arrays, meta)
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "save_checkpoint", save_then_interrupt)
    assert cli.main(["train", *settings, "--epochs", "3", "--save", str(interrupted)]) == 130
    monkeypatch.setattr(checkpoint, "save_checkpoint", real_save)
    assert load_checkpoint(interrupted)[1]["epoch"] == 1
    assert cli.main(["train", "--resume", str(interrupted), "--save", str(interrupted), "--test-limit", "40",
                     "--backend", "reference"]) == 0
    want, _ = load_checkpoint(straight)
    got, meta = load_checkpoint(interrupted)
    assert meta["epoch"] == 3 and meta["epochs"] == 3
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_cli_resume_extending_a_cosine_run_says_where_its_learning_rate_goes_on(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The cosine decays over the run's whole length: extended from 1 to 2 epochs of 4 steps, the
    # fifth step runs at half the rate (cosine over 8 steps) where the saved run's curve was at 0.
    saved = tmp_path / "one.npz"
    settings = ["--model", "mlp", "--batch-size", "16", "--max-steps", "4", "--test-limit", "40",
                "--backend", "reference", "--lr", "0.002"]
    assert cli.main(["train", *settings, "--epochs", "1", "--save", str(saved)]) == 0
    capsys.readouterr()
    assert cli.main(["train", "--resume", str(saved), "--epochs", "2", "--max-steps", "4", "--test-limit", "40",
                     "--backend", "reference"]) == 0
    out = capsys.readouterr().out
    assert ("note: --epochs 2 changes the saved run's 1: the cosine schedule is planned over the new length, so "
            "step 5 runs at lr 0.001 where the saved run's schedule had 0\n") in out
    assert cli.main(["train", "--resume", str(saved), "--epochs", "1", "--test-limit", "40",
                     "--backend", "reference"]) == 0
    assert "note:" not in capsys.readouterr().out
    two = tmp_path / "two.npz"
    assert cli.main(["train", *settings, "--epochs", "2", "--save", str(two)]) == 0
    capsys.readouterr()
    # Fewer epochs than trained: nothing runs, so no step's rate is worth a note.
    assert cli.main(["train", "--resume", str(two), "--epochs", "1", "--test-limit", "40",
                     "--backend", "reference"]) == 0
    out = capsys.readouterr().out
    assert "note:" not in out and "nothing to do" in out


def test_cli_smoke_save_resume_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt, png = tmp_path / "run.npz", tmp_path / "curves.png"
    assert cli.main([*SMOKE, "--epochs", "2", "--save", str(ckpt), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "epoch 2/2: train loss" in out and "test accuracy" in out
    assert "done: final test accuracy" in out and "backend reference" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    _, meta = load_checkpoint(ckpt)
    assert (meta["epoch"], meta["step"], meta["model"]) == (2, 4, "seed-cnn")

    assert cli.main([*SMOKE, "--epochs", "3", "--resume", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "epoch 3/3" in out and "epoch 2/3" not in out

    assert cli.main([*SMOKE, "--epochs", "3", "--resume", str(ckpt), "--model", "keras-mnist"]) == 2
    assert "run.npz" in capsys.readouterr().err


def test_cli_falls_back_to_reference_with_a_warning(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("opgrad.nn.step.llvm_unavailable_reason", lambda: "ImportError: not built")
    assert train.resolve_backend("llvm") == "reference"
    assert "falling back" in capsys.readouterr().err
    assert train.resolve_backend("reference") == "reference"
    monkeypatch.setattr("opgrad.nn.step.llvm_unavailable_reason", lambda: None)
    assert train.resolve_backend("llvm") == "llvm"
    assert capsys.readouterr().err == ""


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([*SMOKE, "--data", str(tmp_path)]) == 2
    assert str(tmp_path) in capsys.readouterr().err
    assert cli.main([*SMOKE, "--epochs", "0"]) == 2
    assert "--epochs" in capsys.readouterr().err
    assert cli.main([*SMOKE, "--resume", str(tmp_path / "missing.npz")]) == 2
    assert "not found" in capsys.readouterr().err


def test_bench_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--steps", "2", "--warmup", "3", "--skip", "torch", "--skip", "jax"]) == 0
    out = capsys.readouterr().out
    assert "median of 2 steps" in out
    compiled = next(line for line in out.splitlines() if line.startswith("opgrad llvm (compiled)"))
    assert "ok (rel. diff" in compiled
    assert "skipped" in out


def test_cli_optimizer_schedule_and_clipping_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([*SMOKE, "--optimizer", "adamw", "--weight-decay", "0.05", "--clip-norm", "1", "--clip-value",
                     "5", "--lr-schedule", "step", "--lr-step-size", "2", "--lr-gamma", "0.5",
                     "--warmup-steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "adamw(beta1=0.9, beta2=0.999, eps=1e-08, weight_decay=0.05, clip_norm=1, clip_value=5)" in out
    assert "linear warm-up over 1 steps, then 0.001 times 0.5 every 2 steps" in out
    assert cli.main([*SMOKE, "--optimizer", "rmsprop", "--lr-gamma", "1.5"]) == 2
    assert "--lr-gamma: expected a number in (0, 1]" in capsys.readouterr().err
    # Without the step schedule the decay options would be ignored without a word.
    assert cli.main([*SMOKE, "--lr-step-size", "3", "--lr-gamma", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "--lr-step-size and --lr-gamma: only the step schedule decays by steps; this run's schedule is cosine" in err


def test_train_lists_every_built_in_model() -> None:
    assert tuple(nn.MODELS) == train.MODEL_NAMES and set(train.MODEL_EPOCHS) == set(nn.MODELS)


def test_cli_resumes_a_checkpoint_that_records_only_a_trainers_metadata(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    # The exported C runtime's checkpoints (and a Trainer's own) hold batch_size, seed and a step
    # counted without epochs, not the command line's settings: the batch size is the checkpoint's,
    # and the schedule runs on from its step (it stood at lr 0 past a horizon counted from 0).
    common = ["--model", "mlp", "--backend", "reference", "--test-limit", "40", "--max-steps", "3"]
    first = tmp_path / "first.npz"
    assert cli.main(["train", *common, "--epochs", "1", "--batch-size", "8", "--save", str(first)]) == 0
    arrays, meta = load_checkpoint(first)
    del meta["run_settings"]
    meta.update(step=20, epoch=0)
    save_checkpoint(first, arrays, meta)
    capsys.readouterr()
    assert cli.main(["train", *common, "--epochs", "1", "--resume", str(first), "--batch-size", "16"]) == 2
    assert "--batch-size 16: the checkpoint" in capsys.readouterr().err
    resumed = tmp_path / "resumed.npz"
    assert cli.main(["train", *common, "--epochs", "1", "--resume", str(first), "--save", str(resumed)]) == 0
    assert "cosine-decayed to 0 over 23 steps, batch 8," in capsys.readouterr().out
    after, meta = load_checkpoint(resumed)
    assert meta["step"] == 23 and meta["batch_size"] == 8
    assert any(not np.array_equal(after[name], arrays[name]) for name in arrays)
