"""A convolutional autoencoder trained by a Trainer against its own input: digits in, digits out.

    python examples/autoencoder.py [--epochs 5] [--backend llvm]

The encoder halves the image twice with strided convolutions down to 8 x 7 x 7 values, the
decoder brings it back with transposed convolutions to one logit per pixel, and the loss is
``bce_with_logits`` against the input itself (the labels are the images; ``loss="mse"`` on
pixel values trains too). ``evaluate_loss`` scores the test digits the same way; a denoising
pass feeds noisy digits and compares their reconstructions with the clean ones.
"""

from __future__ import annotations

import argparse

import numpy as np

from opgrad import nn
from opgrad.data import load_embedded_mnist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--backend", choices=nn.BACKENDS, default="llvm")
    args = parser.parse_args()
    data = load_embedded_mnist()
    model = nn.Sequential([
        nn.Conv2D(16, 3, strides=2, padding="same", activation="relu"),       # 16 x 14 x 14
        nn.Conv2D(8, 3, strides=2, padding="same", activation="relu"),        # 8 x 7 x 7: the code
        nn.Conv2DTranspose(16, 3, strides=2, padding="same", activation="relu"),
        nn.Conv2DTranspose(1, 3, strides=2, padding="same"),                  # logits of each pixel
    ], input_shape=(1, 28, 28), name="autoencoder")
    print(model)
    trainer = nn.Trainer(model, nn.Adam(), lr=2e-3, batch_size=32, backend=args.backend, loss="bce_with_logits")
    print(f"before training: test loss {trainer.evaluate_loss(data.test_images, data.test_images):.4f}")
    for epoch in range(args.epochs):
        loss = trainer.train_epoch(data.train_images, data.train_images)
        test = trainer.evaluate_loss(data.test_images, data.test_images)
        print(f"epoch {epoch + 1}: train loss {loss:.4f}, test loss {test:.4f}")
    noisy = np.clip(data.test_images + np.random.default_rng(0).normal(0, 0.3, data.test_images.shape), 0, 1)
    restored = 1 / (1 + np.exp(-model.predict(noisy.astype(np.float32))))
    print(f"mean squared error of noisy digits {np.mean((noisy - data.test_images) ** 2):.4f}, "
          f"of their reconstructions {np.mean((restored - data.test_images) ** 2):.4f}")


if __name__ == "__main__":
    main()
