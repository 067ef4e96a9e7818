"""The scripts in examples/ run as documented (shortened) and print what they promise."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_example(name: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONWARNINGS": "error::UserWarning"})
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_fine_tune_keeps_the_frozen_layers_and_learns_the_new_digits() -> None:
    out = run_example("fine_tune.py", "--epochs", "1")
    first = float(re.search(r"step 1: digits 0-4, test accuracy ([\d.]+)", out).group(1))  # type: ignore[union-attr]
    last = float(re.search(r"step 3: .* test accuracy ([\d.]+)", out).group(1))  # type: ignore[union-attr]
    assert first > 0.8 and last > 0.6, out
    assert "parameters left as step 1 trained them: conv1.weight, conv1.bias, conv2.weight, conv2.bias\n" in out


def test_autoencoder_lowers_its_reconstruction_loss() -> None:
    out = run_example("autoencoder.py", "--epochs", "1")
    before = float(re.search(r"before training: test loss ([\d.]+)", out).group(1))  # type: ignore[union-attr]
    after = float(re.search(r"epoch 1: .* test loss ([\d.]+)", out).group(1))  # type: ignore[union-attr]
    assert after < 0.5 * before, out


def test_sequence_lstm_learns_digits_row_by_row() -> None:
    out = run_example("sequence_lstm.py", "--epochs", "1", "--units", "16")
    accuracy = float(re.search(r"epoch 1: .* test accuracy ([\d.]+)", out).group(1))  # type: ignore[union-attr]
    assert accuracy > 0.3, out
    assert "written as ONNX: LSTM and GRU nodes" in out
