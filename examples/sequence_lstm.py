"""A recurrent classifier: each MNIST digit read as a sequence of 28 rows by a bidirectional LSTM.

    python examples/sequence_lstm.py [--epochs 4] [--units 48] [--backend llvm]

The image's rows are the steps of a ``(28, 28)`` sequence; ``LSTM(return_sequences=True,
bidirectional=True)`` feeds a ``GRU`` whose last hidden state is classified. The recurrence is
unrolled over the 28 steps and compiled into one training step (the first step compiles for some
seconds; the object cache makes later runs start at once). The model then goes out as ONNX
(``LSTM`` / ``GRU`` nodes) where onnx is installed.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from opgrad import nn
from opgrad.data import load_embedded_mnist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--units", type=int, default=48)
    parser.add_argument("--backend", choices=nn.BACKENDS, default="llvm")
    args = parser.parse_args()
    data = load_embedded_mnist()
    rows = data.train_images[:, 0]  # (N, 28, 28): 28 steps of 28 pixels
    model = nn.Sequential([nn.LSTM(args.units, return_sequences=True, bidirectional=True), nn.Dropout(0.1),
                           nn.GRU(args.units), nn.Dense(10)], input_shape=(28, 28), name="rows")
    print(model)
    trainer = nn.Trainer(model, nn.Adam(), lr=nn.cosine_lr(3e-3, args.epochs * (len(rows) // 32)), batch_size=32,
                         backend=args.backend)
    for epoch in range(args.epochs):
        started = time.perf_counter()
        loss = trainer.train_epoch(rows, data.train_labels)
        accuracy, test_loss = trainer.evaluate(data.test_images[:, 0], data.test_labels)
        print(f"epoch {epoch + 1}: train loss {loss:.3f}, test loss {test_loss:.3f}, test accuracy {accuracy:.3f} "
              f"({time.perf_counter() - started:.1f} s)")
    try:
        from opgrad import onnx
        with tempfile.TemporaryDirectory() as folder:
            onnx.save(model, Path(folder) / "rows.onnx")
            print("written as ONNX: LSTM and GRU nodes")
    except ImportError as exc:
        print(f"no ONNX export here ({exc})")


if __name__ == "__main__":
    main()
