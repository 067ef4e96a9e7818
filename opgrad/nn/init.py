"""Keras-style weight initializers with explicit, per-parameter seeds.

Why per-parameter seeds: every parameter draws from its own generator, seeded from the model
seed and the parameter's *name* (``PCG64([seed, crc32(name)])``). So the same ``--seed`` gives
bit-identical weights on every machine and numpy version that keeps PCG64's stream, and adding or
removing a layer does not shift the random numbers of the others (which a single shared
generator consumed in order would do).

Fans follow Keras: a 2-D weight shaped ``(units, in)`` has ``fan_in = in`` and
``fan_out = units``; a 4-D OIHW convolution weight has ``fan_in = I*KH*KW`` and
``fan_out = O*KH*KW``, and any weight ``(out, in, *kernel)`` of 3 or more axes likewise.
(Keras stores kernels transposed, ``(in, units)`` / HWIO, but the fans and therefore the
distributions are the same.)
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable

import numpy as np

__all__ = [
    "INITIALIZERS",
    "Initializer",
    "compute_fans",
    "get_initializer",
    "glorot_uniform",
    "he_uniform",
    "initializer_name",
    "ones",
    "param_generator",
    "uniform",
    "zeros",
]

#: ``init(shape, rng, dtype) -> array``: fills one parameter; must use only ``rng`` for randomness.
Initializer = Callable[[tuple[int, ...], np.random.Generator, str], np.ndarray]


def param_generator(seed: int, name: str) -> np.random.Generator:
    """The generator that initializes parameter ``name`` of a model seeded with ``seed``."""
    if seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed}")
    return np.random.Generator(np.random.PCG64([int(seed), zlib.crc32(name.encode("utf-8"))]))


def compute_fans(shape: tuple[int, ...]) -> tuple[int, int]:
    """``(fan_in, fan_out)`` of a weight in opgrad's layouts (see the module docstring)."""
    if len(shape) == 2:
        units, inputs = shape
        return int(inputs), int(units)
    if len(shape) >= 3:
        # (out, in, *kernel), PyTorch's rule for every kernel rank: each input and output
        # channel meets the whole receptive field.
        receptive = int(np.prod(shape[2:], dtype=np.int64))
        return int(shape[1]) * receptive, int(shape[0]) * receptive
    if len(shape) == 1:
        return int(shape[0]), int(shape[0])
    raise ValueError(f"cannot compute fans of a weight with shape {shape}: a scalar weight has none; give it "
                     "an initializer that needs no fans (zeros, ones, uniform)")


def glorot_uniform(shape: tuple[int, ...], rng: np.random.Generator, dtype: str = "float32") -> np.ndarray:
    """Uniform in ``[-limit, limit]``, ``limit = sqrt(6 / (fan_in + fan_out))`` (Keras' default)."""
    fan_in, fan_out = compute_fans(shape)
    limit = math.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, size=shape).astype(dtype)


def he_uniform(shape: tuple[int, ...], rng: np.random.Generator, dtype: str = "float32") -> np.ndarray:
    """Uniform in ``[-limit, limit]``, ``limit = sqrt(6 / fan_in)``: keeps ReLU activations' scale."""
    fan_in, _ = compute_fans(shape)
    limit = math.sqrt(6.0 / fan_in)
    return rng.uniform(-limit, limit, size=shape).astype(dtype)


def zeros(shape: tuple[int, ...], rng: np.random.Generator, dtype: str = "float32") -> np.ndarray:
    """All zeros (Keras' bias default); ``rng`` is accepted for a uniform signature and unused."""
    del rng
    return np.zeros(shape, dtype=dtype)


def ones(shape: tuple[int, ...], rng: np.random.Generator, dtype: str = "float32") -> np.ndarray:
    """All ones (a normalization layer's scale); ``rng`` is unused."""
    del rng
    return np.ones(shape, dtype=dtype)


def uniform(shape: tuple[int, ...], rng: np.random.Generator, dtype: str = "float32") -> np.ndarray:
    """Uniform in ``[-0.05, 0.05]`` (Keras' ``RandomUniform()``, its ``Embedding`` default)."""
    return rng.uniform(-0.05, 0.05, size=shape).astype(dtype)


INITIALIZERS: dict[str, Initializer] = {
    "glorot_uniform": glorot_uniform,
    "he_uniform": he_uniform,
    "ones": ones,
    "uniform": uniform,
    "zeros": zeros,
}


def initializer_name(init: Initializer) -> str | None:
    """The registered name of ``init`` (what a saved model stores), or None for a custom function."""
    return next((name for name, fn in INITIALIZERS.items() if fn is init), None)


def get_initializer(init: str | Initializer) -> Initializer:
    """An initializer by Keras name (``"glorot_uniform"``, ``"he_uniform"``, ``"zeros"``) or as given."""
    if callable(init):
        return init
    try:
        return INITIALIZERS[init]
    except KeyError:
        raise ValueError(f"unknown initializer {init!r}; known: {', '.join(sorted(INITIALIZERS))}") from None
