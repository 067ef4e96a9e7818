"""Trainable models built from registered operators: layers, losses, initializers, optimizers.

Every piece emits graph expressions, so forward, backward (through the checked registered
gradients) and the optimizer update of a step form ONE function that ``opgrad.compile`` or the
reference backend runs per batch::

    from opgrad import nn
    model = nn.seed_cnn()                                # or nn.Model(inputs, outputs): see nn.model
    trainer = nn.Trainer(model, nn.Adam(), lr=1e-3, batch_size=32, seed=0, backend="reference")
    loss = trainer.train_batch(images, labels)          # images (32, 1, 28, 28) float32
    accuracy, test_loss = trainer.evaluate(test_images, test_labels)
"""

from opgrad.nn.init import compute_fans, get_initializer, glorot_uniform, he_uniform, param_generator, zeros
from opgrad.nn.layers import (
    GELU,
    LAYERS,
    Activation,
    Add,
    AvgPool2D,
    BatchNorm2D,
    Concatenate,
    Conv2D,
    Conv2DTranspose,
    Dense,
    Dropout,
    Embedding,
    Flatten,
    ForwardContext,
    GlobalAvgPool2D,
    Input,
    Layer,
    LayerNorm,
    LeakyReLU,
    MaxPool2D,
    ParamSpec,
    ReLU,
    Rescaling,
    Sigmoid,
    Softmax,
    SymbolicTensor,
    Tanh,
    UpSampling2D,
)
from opgrad.nn.losses import accuracy, softmax_cross_entropy
from opgrad.nn.model import Model, Sequential, load_model, model_from_config
from opgrad.nn.models import MODELS, build_model, keras_mnist, mlp, resnet, seed_cnn
from opgrad.nn.ops_layers import (
    Arithmetic,
    Clip,
    Elementwise,
    GlobalPool2D,
    LogSoftmax,
    Pad,
    Reduce,
    Resize,
    Slice,
)
from opgrad.nn.optim import OPTIMIZERS, SGD, Adam, AdamW, Optimizer, RMSprop, make_optimizer
from opgrad.nn.reshaping import Permute, Reshape, ZeroPadding2D
from opgrad.nn.schedules import LRSchedule, Schedule, StepLR, WarmupLR, constant_lr, cosine_lr
from opgrad.nn.step import (
    BACKENDS,
    EvalStep,
    NanLossError,
    StepResult,
    StepsResult,
    TrainStep,
    compile_function,
    llvm_unavailable_reason,
)
from opgrad.nn.trainer import Trainer

#: Keras' ``keras.models.load_model`` under a short name: ``model = nn.load("ckpt.npz")``.
load = load_model

__all__ = [
    "BACKENDS",
    "GELU",
    "LAYERS",
    "MODELS",
    "OPTIMIZERS",
    "SGD",
    "Activation",
    "Adam",
    "AdamW",
    "Add",
    "Arithmetic",
    "AvgPool2D",
    "BatchNorm2D",
    "Clip",
    "Concatenate",
    "Conv2D",
    "Conv2DTranspose",
    "Dense",
    "Dropout",
    "Elementwise",
    "Embedding",
    "EvalStep",
    "Flatten",
    "ForwardContext",
    "GlobalAvgPool2D",
    "GlobalPool2D",
    "Input",
    "LRSchedule",
    "Layer",
    "LayerNorm",
    "LeakyReLU",
    "LogSoftmax",
    "MaxPool2D",
    "Model",
    "NanLossError",
    "Optimizer",
    "Pad",
    "ParamSpec",
    "Permute",
    "RMSprop",
    "ReLU",
    "Reduce",
    "Rescaling",
    "Reshape",
    "Resize",
    "Schedule",
    "Sequential",
    "Sigmoid",
    "Slice",
    "Softmax",
    "StepLR",
    "StepResult",
    "StepsResult",
    "SymbolicTensor",
    "Tanh",
    "TrainStep",
    "Trainer",
    "UpSampling2D",
    "WarmupLR",
    "ZeroPadding2D",
    "accuracy",
    "build_model",
    "compile_function",
    "compute_fans",
    "constant_lr",
    "cosine_lr",
    "get_initializer",
    "glorot_uniform",
    "he_uniform",
    "keras_mnist",
    "llvm_unavailable_reason",
    "load",
    "load_model",
    "make_optimizer",
    "mlp",
    "model_from_config",
    "param_generator",
    "resnet",
    "seed_cnn",
    "softmax_cross_entropy",
    "zeros",
]
