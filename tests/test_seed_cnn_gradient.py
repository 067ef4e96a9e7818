"""The seed CNN differentiated end to end, against float64 central finite differences.

conv3x3 1->32 relu, conv3x3 32->64 relu, avgpool 2, conv12x12 64->128 relu, flatten, dense 10,
softmax cross-entropy: built from opgrad.ops directly so this test does not depend on opgrad.nn.
"""

from __future__ import annotations

import numpy as np

import opgrad
from opgrad import ops

SHAPES = {
    "w1": (32, 1, 3, 3), "b1": (32,),
    "w2": (64, 32, 3, 3), "b2": (64,),
    "w3": (128, 64, 12, 12), "b3": (128,),
    "w4": (10, 128),
}


def seed_cnn_loss(batch: int, dtype: str = "float64") -> opgrad.Function:
    x = opgrad.var("x", (batch, 1, 28, 28), dtype)
    labels = opgrad.var("labels", (batch,), "int64")
    p = {name: opgrad.var(name, shape, dtype) for name, shape in SHAPES.items()}
    h = ops.relu(ops.bias_add(ops.conv2d(x, p["w1"]), p["b1"]))
    h = ops.relu(ops.bias_add(ops.conv2d(h, p["w2"]), p["b2"]))
    h = ops.avg_pool2d(h, pool_size=2)
    h = ops.relu(ops.bias_add(ops.conv2d(h, p["w3"]), p["b3"]))
    logits = ops.dense(ops.flatten(h), p["w4"])
    return opgrad.function([x, labels, *p.values()], ops.softmax_cross_entropy(logits, labels))


def init(rng: np.random.Generator) -> list[np.ndarray]:
    out = []
    for name, shape in SHAPES.items():
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        scale = 0.1 if name.startswith("b") else np.sqrt(2.0 / fan_in)
        out.append(rng.standard_normal(shape) * scale)
    return out


def test_seed_cnn_gradient_matches_finite_differences() -> None:
    rng = np.random.default_rng(0)
    batch = 2
    fn = seed_cnn_loss(batch)
    value_and_grads = opgrad.grad(fn, wrt=list(SHAPES))
    x = rng.uniform(0, 1, (batch, 1, 28, 28))
    labels = np.array([3, 7])
    params = init(rng)
    loss, *grads = opgrad.evaluate(value_and_grads, x, labels, *params)
    assert np.isclose(loss, opgrad.evaluate(fn, x, labels, *params))
    eps = 1e-6
    for i, (name, grad) in enumerate(zip(SHAPES, grads)):
        assert grad.shape == SHAPES[name] and grad.dtype == np.float64
        for _ in range(2):
            direction = rng.standard_normal(SHAPES[name])
            plus = [p.copy() for p in params]
            minus = [p.copy() for p in params]
            plus[i] += eps * direction
            minus[i] -= eps * direction
            numeric = (opgrad.evaluate(fn, x, labels, *plus) - opgrad.evaluate(fn, x, labels, *minus)) / (2 * eps)
            analytic = float(np.sum(grad * direction))
            rel = abs(analytic - numeric) / max(abs(numeric), 1e-12)
            assert rel < 1e-6, f"{name}: directional derivative {analytic:.10g}, numeric {numeric:.10g}, rel {rel:.1e}"
