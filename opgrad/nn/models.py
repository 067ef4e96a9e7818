"""The models ``opgrad train`` knows: the seed CNN (TVM's autodiff MNIST tutorial), the Keras MNIST example, a small
CIFAR-style ResNet, an MLP, and two sequence models reading a digit's rows as 28 steps: an LSTM and a transformer
encoder.

All take ``(1, 28, 28)`` images (NCHW, pixels in [0, 1]) and return 10 logits; the softmax is
fused into the loss.
"""

from __future__ import annotations

from collections.abc import Callable

from opgrad.nn.layers import (
    Add,
    AvgPool2D,
    BatchNorm2D,
    Conv2D,
    Dense,
    Dropout,
    Flatten,
    GlobalAvgPool2D,
    Input,
    LayerNorm,
    MaxPool2D,
    MultiHeadAttention,
    ReLU,
    SymbolicTensor,
)
from opgrad.nn.model import Model, Sequential
from opgrad.nn.ops_layers import Arithmetic, Reduce
from opgrad.nn.recurrent import LSTM
from opgrad.nn.reshaping import Reshape

__all__ = ["MODELS", "build_model", "keras_mnist", "mlp", "resnet", "row_lstm", "row_transformer", "seed_cnn"]

MNIST_SHAPE = (1, 28, 28)


def seed_cnn(num_classes: int = 10) -> Sequential:
    """The seed CNN: conv3x3 1->32 relu, conv3x3 32->64 relu, avgpool 2, conv12x12 64->128 relu, dense 10.

    The 12x12 convolution on the 12x12 map stands in for flatten + dense, as in TVM's autodiff
    tutorial (whose autodiff had no flatten); it leaves a 128x1x1 map that Flatten turns into 128
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
    """The Keras MNIST example: conv 32, conv 64, max pool 2, dropout .25, dense 128, dropout .5."""
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


def _basic_block(x: SymbolicTensor, filters: int, stride: int, prefix: str) -> SymbolicTensor:
    """conv3x3-BN-relu-conv3x3-BN plus the shortcut, then relu (He et al. 2016's basic block).

    The shortcut is the identity, or a strided 1x1 conv + BN where the block changes the shape
    (torchvision's "option B").
    """
    y = Conv2D(filters, 3, strides=stride, padding=1, use_bias=False, kernel_initializer="he_uniform",
               name=f"{prefix}_conv1")(x)
    y = ReLU(name=f"{prefix}_relu1")(BatchNorm2D(name=f"{prefix}_bn1")(y))
    y = Conv2D(filters, 3, padding=1, use_bias=False, kernel_initializer="he_uniform", name=f"{prefix}_conv2")(y)
    y = BatchNorm2D(name=f"{prefix}_bn2")(y)
    shortcut = x
    if stride != 1 or x.shape[0] != filters:
        shortcut = Conv2D(filters, 1, strides=stride, use_bias=False, kernel_initializer="he_uniform",
                          name=f"{prefix}_down_conv")(x)
        shortcut = BatchNorm2D(name=f"{prefix}_down_bn")(shortcut)
    return ReLU(name=f"{prefix}_relu2")(Add(name=f"{prefix}_add")([y, shortcut]))


def resnet(num_classes: int = 10, blocks_per_stage: int = 2, widths: tuple[int, int, int] = (16, 32, 64)) -> Model:
    """A small CIFAR-style ResNet for 28x28 digits (He et al. 2016, section 4.2).

    conv3x3 16 + BN + relu, then three stages of ``blocks_per_stage`` basic blocks with 16, 32 and
    64 channels (the second and third start with stride 2: 28 -> 14 -> 7), global average pool,
    dense ``num_classes``. With 2 blocks per stage (ResNet-14): 174,970 parameters and 1,120 buffer values.
    """
    if blocks_per_stage < 1:
        raise ValueError(f"blocks_per_stage must be >= 1, got {blocks_per_stage}")
    inp = Input(MNIST_SHAPE, name="images")
    x = Conv2D(widths[0], 3, padding=1, use_bias=False, kernel_initializer="he_uniform", name="stem_conv")(inp)
    x = ReLU(name="stem_relu")(BatchNorm2D(name="stem_bn")(x))
    for stage, filters in enumerate(widths, start=1):
        for block in range(1, blocks_per_stage + 1):
            stride = 2 if stage > 1 and block == 1 else 1
            x = _basic_block(x, filters, stride, f"s{stage}b{block}")
    x = GlobalAvgPool2D(name="pool")(x)
    out = Dense(num_classes, name="fc")(x)
    return Model(inp, out, name="resnet")


def mlp(num_classes: int = 10, hidden: tuple[int, ...] = (256, 256)) -> Sequential:
    """Flatten, then ``hidden`` dense relu layers, then dense ``num_classes``: the no-convolution baseline."""
    return Sequential([Flatten(), *(Dense(units, activation="relu", kernel_initializer="he_uniform")
                                    for units in hidden), Dense(num_classes)],
                      input_shape=MNIST_SHAPE, name="mlp")


def row_lstm(num_classes: int = 10, units: int = 128) -> Sequential:
    """The image's 28 rows as the steps of an ``LSTM(units)`` whose last hidden state a Dense
    classifies (the classic sequential-MNIST recurrent net); 82,186 parameters at 128 units."""
    return Sequential([Reshape(MNIST_SHAPE[1:]), LSTM(units), Dense(num_classes)], input_shape=MNIST_SHAPE,
                      name="lstm")


def row_transformer(num_classes: int = 10, width: int = 64, heads: int = 4, blocks: int = 2) -> Model:
    """A pre-norm transformer encoder over the image's 28 rows: each row projected to ``width``
    plus a learned position embedding, ``blocks`` blocks of LayerNorm, self-attention (``heads``
    heads) and a residual add, then LayerNorm, a GELU MLP of twice the width and a residual add;
    a final LayerNorm, the mean over the rows and a Dense classifier. 71,370 parameters."""
    inp = Input(MNIST_SHAPE, name="images")
    rows = Reshape(MNIST_SHAPE[1:], name="rows")(inp)
    x = Arithmetic("add", operand_shape=(MNIST_SHAPE[1], width), name="positions")(Dense(width, name="embed")(rows))
    for block in range(1, blocks + 1):
        attended = MultiHeadAttention(heads, name=f"b{block}_attention")(LayerNorm(name=f"b{block}_norm1")(x))
        x = Add(name=f"b{block}_add1")([x, attended])
        hidden = Dense(2 * width, activation="gelu", name=f"b{block}_mlp1")(LayerNorm(name=f"b{block}_norm2")(x))
        x = Add(name=f"b{block}_add2")([x, Dense(width, name=f"b{block}_mlp2")(hidden)])
    pooled = Reduce("mean", [1], keepdims=False, name="pool")(LayerNorm(name="norm")(x))
    return Model(inp, Dense(num_classes, name="head")(pooled), name="transformer")


MODELS: dict[str, Callable[[], Model]] = {"seed-cnn": seed_cnn, "keras-mnist": keras_mnist, "resnet": resnet,
                                          "mlp": mlp, "lstm": row_lstm, "transformer": row_transformer}


def build_model(name: str) -> Model:
    """A fresh model by CLI name (``seed-cnn``, ``keras-mnist``, ``resnet`` or ``mlp``)."""
    try:
        return MODELS[name]()
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}") from None
