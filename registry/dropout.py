"""dropout: inverted dropout whose mask is a counter-based hash, so the numpy reference and the
compiled kernel draw bitwise the same mask with no random state.

Element ``i`` (its row-major flat index) is kept when ``splitmix64(key + i * 0x9E3779B97F4A7C15)``,
read as an unsigned 64-bit integer, is at least ``rate * 2**64``; ``key`` is splitmix64's first
output for ``seed``, so neighbouring seeds give unrelated masks. Kept elements are scaled by
``1 / (1 - rate)`` (PyTorch's training-mode ``torch.nn.functional.dropout`` scaling; its masks come
from another generator, so only the distribution matches). Dropped elements are exactly 0, even
where data is NaN or inf.

The mask depends on (seed, index) only, so the gradient is dropout of the cotangent with the same
seed: grad * mask / (1 - rate). The seed is an attribute, baked into the kernel: a new seed is a
new graph (and a new compile).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from opgrad import ops
from opgrad.ir import Call, Expr
from opgrad.op import Attr, Case, Input, Operator

from ._common import same_as_first

if TYPE_CHECKING:  # types only: the compiler and the checker sit above the registry
    from opgrad.checks.strategies import CaseDraw
    from opgrad.compiler.builder import KernelBuilder
    from opgrad.compiler.views import Scalar, View

_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


def splitmix64(counter: np.ndarray, key: int) -> np.ndarray:
    """The twin of the kernel's ``Scalar.hash64``: uint64 arithmetic wraps modulo 2**64 as i64 does."""
    flat = np.asarray(counter, np.uint64).reshape(-1)  # 1-D: numpy scalars would warn on the wraparound
    z = np.uint64(key & _MASK64) + flat * np.uint64(_GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return np.asarray((z ^ (z >> np.uint64(31))).reshape(np.shape(counter)))


def mask_key(seed: int) -> int:
    """splitmix64's first output from state ``seed``: the key of the element hashes."""
    return int(splitmix64(np.array([1], np.uint64), seed)[0])


def keep_threshold(rate: float) -> int:
    """An element is kept when its hash is >= this (exact: rate * 2**64 scales by a power of two)."""
    return int(rate * 2.0**64)


def keep_mask(shape: tuple[int, ...], rate: float, seed: int) -> np.ndarray:
    """The boolean mask of kept elements that dropout(rate, seed) applies to a tensor of ``shape``."""
    counters = np.arange(int(np.prod(shape, dtype=np.int64)), dtype=np.uint64).reshape(shape)
    return np.asarray(splitmix64(counters, mask_key(seed)) >= np.uint64(keep_threshold(rate)))


def _rate(value: Any) -> float:
    rate = float(value)
    if not 0.0 <= rate < 1.0:
        raise ValueError("expected a drop probability in [0, 1) (rate 1 would scale by 1 / 0)")
    return rate


def _seed(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError("expected an int seed")
    return int(value) & _MASK64


dropout = Operator(
    "dropout",
    inputs=[Input("data")],
    attrs=[
        Attr("rate", convert=_rate, doc="probability that an element is dropped, in [0, 1)"),
        Attr("seed", convert=_seed, doc="int (taken modulo 2**64); the same seed gives the same mask"),
    ],
    doc="Inverted dropout: data / (1 - rate) where a hash of (seed, flat index) keeps the element, else 0; "
        "about a fraction 1 - rate is kept. Reference and kernel draw bitwise the same mask.",
    jointly_linear=True,
)
dropout.shape_rule(same_as_first)


@dropout.reference
def _dropout_forward(data: np.ndarray, rate: float, seed: int) -> np.ndarray:
    scale = data.dtype.type(1.0 / (1.0 - rate))
    return np.asarray(np.where(keep_mask(data.shape, rate, seed), data * scale, data.dtype.type(0.0)))


@dropout.gradient
def _dropout_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = dropout(grad, rate, seed) = grad * mask / (1 - rate), the forward's mask"""
    return [ops.dropout(grad, **call.attrs)]


@dropout.mutant("forgets the 1 / (1 - rate) scale of the kept elements")
def _dropout_unscaled(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.multiply(ops.dropout(grad, **call.attrs), 1.0 - call.attrs["rate"])]


@dropout.mutant("the gradient's mask comes from another seed")
def _dropout_other_seed(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.dropout(grad, rate=call.attrs["rate"], seed=call.attrs["seed"] + 1)]


@dropout.sampler
def _dropout_cases(d: CaseDraw) -> Case:
    return Case([d.shape(max_rank=3)], {"rate": d.choice([0.0, 0.2, 0.5, 0.8]), "seed": d.int(0, 2**40)})


@dropout.lowering
def _dropout_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = data * 1/(1 - rate) where hash64(flat index, key) >= rate * 2**64, else 0"""
    rate = call.attrs["rate"]
    key, threshold, scale = mask_key(call.attrs["seed"]), keep_threshold(rate), 1.0 / (1.0 - rate)

    def body(s: Scalar, v: list[str]) -> str:
        kept = s.icmp("uge", s.hash64(v[1], key), threshold)
        return s.select(kept, s.mul(v[0], s.const(scale)), s.const(0.0))

    kb.elementwise(out, [data, kb.flat_index(out.shape)], body)
