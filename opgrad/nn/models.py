"""The two models ``opgrad train`` knows: seed 000's CNN and the Keras MNIST example (seed 001).

Both take ``(1, 28, 28)`` images (NCHW, pixels in [0, 1]) and return 10 logits; the softmax is
fused into the loss.
"""

from __future__ import annotations

from collections.abc import Callable

from opgrad.nn.layers import AvgPool2D, Conv2D, Dense, Dropout, Flatten, MaxPool2D, Sequential

__all__ = ["MODELS", "build_model", "keras_mnist", "seed_cnn"]

MNIST_SHAPE = (1, 28, 28)


def seed_cnn(num_classes: int = 10) -> Sequential:
    """Seed 000: conv3x3 1->32 relu, conv3x3 32->64 relu, avgpool 2, conv12x12 64->128 relu, dense 10.

    The 12x12 convolution on the 12x12 map is seed 000's stand-in for flatten + dense (TVM's
    autodiff could not do flatten then); it leaves a 128x1x1 map that Flatten turns into 128
    features. 1,199,882 parameters.
    """
    return Sequential(
        [
            Conv2D(32, 3, activation="relu"),
            Conv2D(64, 3, activation="relu"),
            AvgPool2D(2),
            Conv2D(128, 12, activation="relu"),
            Flatten(),
            Dense(num_classes),
        ],
        input_shape=MNIST_SHAPE,
        name="seed-cnn",
    )


def keras_mnist(num_classes: int = 10) -> Sequential:
    """The Keras example (seed 001): conv 32, conv 64, max pool 2, dropout .25, dense 128, dropout .5."""
    return Sequential(
        [
            Conv2D(32, 3, activation="relu"),
            Conv2D(64, 3, activation="relu"),
            MaxPool2D(2),
            Dropout(0.25),
            Flatten(),
            Dense(128, activation="relu"),
            Dropout(0.5),
            Dense(num_classes),
        ],
        input_shape=MNIST_SHAPE,
        name="keras-mnist",
    )


MODELS: dict[str, Callable[[], Sequential]] = {"seed-cnn": seed_cnn, "keras-mnist": keras_mnist}


def build_model(name: str) -> Sequential:
    """A fresh model by CLI name (``seed-cnn`` or ``keras-mnist``)."""
    try:
        return MODELS[name]()
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}") from None
