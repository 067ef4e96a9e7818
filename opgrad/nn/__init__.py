"""Trainable models built from registered operators: layers, losses, initializers, optimizers.

Every piece emits graph expressions, so forward, backward (through the checked registered
gradients) and the optimizer update of a step form ONE function that ``opgrad.compile`` or the
reference backend runs per batch::

    from opgrad import nn
    model = nn.seed_cnn()
    trainer = nn.Trainer(model, nn.Adam(), lr=1e-3, batch_size=32, seed=0, backend="reference")
    loss = trainer.train_batch(images, labels)          # images (32, 1, 28, 28) float32
    accuracy, test_loss = trainer.evaluate(test_images, test_labels)
"""

from opgrad.nn.init import compute_fans, get_initializer, glorot_uniform, he_uniform, param_generator, zeros
from opgrad.nn.layers import (
    AvgPool2D,
    Conv2D,
    Dense,
    Dropout,
    Flatten,
    ForwardContext,
    Layer,
    MaxPool2D,
    ParamSpec,
    ReLU,
    Sequential,
)
from opgrad.nn.losses import accuracy, softmax_cross_entropy
from opgrad.nn.models import MODELS, build_model, keras_mnist, seed_cnn
from opgrad.nn.optim import OPTIMIZERS, SGD, Adam, AdamW, Optimizer, RMSprop, make_optimizer
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

__all__ = [
    "BACKENDS",
    "MODELS",
    "OPTIMIZERS",
    "SGD",
    "Adam",
    "AdamW",
    "AvgPool2D",
    "Conv2D",
    "Dense",
    "Dropout",
    "EvalStep",
    "Flatten",
    "ForwardContext",
    "LRSchedule",
    "Layer",
    "MaxPool2D",
    "NanLossError",
    "Optimizer",
    "ParamSpec",
    "RMSprop",
    "ReLU",
    "Schedule",
    "Sequential",
    "StepLR",
    "StepResult",
    "StepsResult",
    "TrainStep",
    "Trainer",
    "WarmupLR",
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
    "make_optimizer",
    "param_generator",
    "seed_cnn",
    "softmax_cross_entropy",
    "zeros",
]
