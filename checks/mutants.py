"""Deliberately wrong gradients: the checker's power, measured.

Each mutant is a plausible mistake (the kinds that shipped in real frameworks) written as a
candidate rule for ``check_op(op, gradient=rule)``. The checker must flag every one; the kill rate
is ``python -m opgrad.checks.mutants``. A mutant that builds a wrongly shaped gradient is caught by
autodiff's own shape check, which the checker reports as check a.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

from opgrad import ops
from opgrad.ir import Call, Expr
from opgrad.op import GradientRule

from .report import OpReport

Rule = GradientRule


@dataclass(frozen=True)
class Mutant:
    op: str
    mistake: str
    rule: Rule


def _window(call: Call) -> dict[str, Any]:
    return {k: call.attrs[k] for k in ("strides", "padding", "dilation", "groups")}


def _without(call: Call, key: str, value: Any) -> dict[str, Any]:
    return {**call.attrs, key: value}


def _dense_grads(call: Call, grad: Expr) -> tuple[Expr, Expr]:
    data, weight = call.args
    return ops.dense(grad, ops.transpose(weight)), ops.dense(ops.transpose(grad), ops.transpose(data))


def _conv_grads(call: Call, grad: Expr, data_window: dict[str, Any] | None = None,
                weight_window: dict[str, Any] | None = None) -> list[Expr | None]:
    data, weight = call.args
    return [
        ops.conv2d_backward_input(grad, weight, input_size=data.shape[2:], **(data_window or _window(call))),
        ops.conv2d_backward_weight(grad, data, kernel_size=weight.shape[2:], **(weight_window or _window(call))),
    ]


def _bias_grad(call: Call, grad: Expr) -> Expr:
    return ops.sum(grad, axis=tuple(i for i in range(grad.ndim) if i != call.attrs["axis"]))


def _reduced_first(call: Call) -> tuple[int, ...]:
    shape, axes = call.args[0].shape, call.attrs["axis"]
    return (1,) * len(axes) + tuple(d for i, d in enumerate(shape) if i not in axes)


def _pool_size_plus_one(call: Call) -> dict[str, Any]:
    kh, kw = call.attrs["pool_size"]
    return {**call.attrs, "pool_size": (kh + 1, kw), "padding": (0, 0)}


_LISTED: list[Mutant] = [
    # ----- dense -----
    Mutant("dense", "d_data missing the transpose of weight",
           lambda call, g: [ops.dense(g, call.args[1]), _dense_grads(call, g)[1]]),
    Mutant("dense", "d_weight transposed (grad.T @ data transposed)",
           lambda call, g: [_dense_grads(call, g)[0], ops.dense(ops.transpose(call.args[0]), ops.transpose(g))]),
    Mutant("dense", "gradients of the two inputs swapped",
           lambda call, g: list(reversed(_dense_grads(call, g)))),
    Mutant("dense", "d_weight scaled by 2", lambda call, g: [_dense_grads(call, g)[0], _dense_grads(call, g)[1] * 2.0]),
    Mutant("dense", "cotangent ignored (ones instead)",
           lambda call, g: list(_dense_grads(call, ops.ones_like(g)))),
    # ----- bias_add -----
    Mutant("bias_add", "d_bias summed over every axis",
           lambda call, g: [g, ops.sum(g)]),
    Mutant("bias_add", "d_bias reduces the last axis, ignoring attrs['axis']",
           lambda call, g: [g, ops.sum(g, axis=tuple(range(g.ndim - 1)))]),
    Mutant("bias_add", "d_bias is the mean instead of the sum",
           lambda call, g: [g, _bias_grad(call, g) * (call.args[1].shape[0] / call.type.size)]),
    Mutant("bias_add", "d_data forgotten (zeros)",
           lambda call, g: [ops.zeros_like(g), _bias_grad(call, g)]),
    # ----- conv2d and its backward ops -----
    Mutant("conv2d", "d_data ignores strides",
           lambda call, g: _conv_grads(call, g, data_window={**_window(call), "strides": (1, 1)})),
    Mutant("conv2d", "d_data ignores padding",
           lambda call, g: _conv_grads(call, g, data_window={**_window(call), "padding": (0, 0)})),
    Mutant("conv2d", "d_weight ignores dilation",
           lambda call, g: _conv_grads(call, g, weight_window={**_window(call), "dilation": (1, 1)})),
    Mutant("conv2d", "d_weight with the cotangent ignored (ones)",
           lambda call, g: [_conv_grads(call, g)[0], _conv_grads(call, ops.ones_like(g))[1]]),
    Mutant("conv2d", "d_data with the wrong sign",
           lambda call, g: [ops.negative(_conv_grads(call, g)[0]), _conv_grads(call, g)[1]]),
    Mutant("conv2d_backward_input", "d_grad ignores strides",
           lambda call, g: [ops.conv2d(g, call.args[1], **{**_window(call), "strides": (1, 1)}),
                            ops.conv2d_backward_weight(call.args[0], g, kernel_size=call.args[1].shape[2:],
                                                       **_window(call))]),
    Mutant("conv2d_backward_input", "d_weight with the wrong sign",
           lambda call, g: [ops.conv2d(g, call.args[1], **_window(call)),
                            ops.negative(ops.conv2d_backward_weight(call.args[0], g, kernel_size=call.args[1].shape[2:],
                                                                    **_window(call)))]),
    Mutant("conv2d_backward_weight", "d_grad ignores padding",
           lambda call, g: [ops.conv2d(call.args[1], g, **{**_window(call), "padding": (0, 0)}),
                            ops.conv2d_backward_input(call.args[0], g, input_size=call.args[1].shape[2:],
                                                      **_window(call))]),
    Mutant("conv2d_backward_weight", "d_data scaled by 0.5",
           lambda call, g: [ops.conv2d(call.args[1], g, **_window(call)),
                            ops.conv2d_backward_input(call.args[0], g, input_size=call.args[1].shape[2:],
                                                      **_window(call)) * 0.5]),
    # ----- pooling -----
    Mutant("max_pool2d", "gradient spread over the window (avg_pool's rule)",
           lambda call, g: [ops.avg_pool2d_backward(g, call.args[0], **call.attrs)]),
    Mutant("max_pool2d", "off-by-one pool window",
           lambda call, g: [ops.max_pool2d_backward(g, call.args[0], **_pool_size_plus_one(call))]),
    Mutant("max_pool2d", "padding ignored",
           lambda call, g: [ops.max_pool2d_backward(g, call.args[0], **_without(call, "padding", (0, 0)))]),
    Mutant("max_pool2d", "strides ignored (taken as the pool size)",
           lambda call, g: [ops.max_pool2d_backward(g, call.args[0],
                                                    **_without(call, "strides", call.attrs["pool_size"]))]),
    Mutant("max_pool2d_backward", "d_grad is a max-pool of the cotangent instead of a gather",
           lambda call, g: [ops.max_pool2d(g, **call.attrs), None]),
    Mutant("max_pool2d_gather", "d_values with the wrong sign",
           lambda call, g: [ops.negative(ops.max_pool2d_backward(g, call.args[1], **call.attrs)), None]),
    Mutant("avg_pool2d", "sum-pool gradient (not divided by the window size)",
           lambda call, g: [ops.avg_pool2d_backward(g, call.args[0], **call.attrs)
                            * float(call.attrs["pool_size"][0] * call.attrs["pool_size"][1])]),
    Mutant("avg_pool2d", "strides ignored",
           lambda call, g: [ops.avg_pool2d_backward(g, call.args[0], **_without(call, "strides", (1, 1)))]),
    Mutant("avg_pool2d_backward", "d_grad ignores padding",
           lambda call, g: [ops.avg_pool2d(g, **_without(call, "padding", (0, 0))), None]),
    # ----- softmax_cross_entropy -----
    Mutant("softmax_cross_entropy", "forgets the 1/N of the batch mean",
           lambda call, g: [ops.multiply(ops.subtract(ops.softmax(call.args[0], axis=1),
                                                      ops.one_hot(call.args[1], depth=call.args[0].shape[1],
                                                                  dtype=call.dtype)), g), None]),
    Mutant("softmax_cross_entropy", "cotangent ignored",
           lambda call, g: [ops.divide(ops.subtract(ops.softmax(call.args[0], axis=1),
                                                    ops.one_hot(call.args[1], depth=call.args[0].shape[1],
                                                                dtype=call.dtype)), float(call.args[0].shape[0])),
                            None]),
    Mutant("softmax_cross_entropy", "sign flipped (onehot - softmax)",
           lambda call, g: [ops.multiply(ops.subtract(ops.one_hot(call.args[1], depth=call.args[0].shape[1],
                                                                  dtype=call.dtype),
                                                      ops.softmax(call.args[0], axis=1)),
                                         ops.divide(g, float(call.args[0].shape[0]))), None]),
    Mutant("softmax_cross_entropy", "softmax over the batch axis",
           lambda call, g: [ops.multiply(ops.subtract(ops.softmax(call.args[0], axis=0),
                                                      ops.one_hot(call.args[1], depth=call.args[0].shape[1],
                                                                  dtype=call.dtype)),
                                         ops.divide(g, float(call.args[0].shape[0]))), None]),
    # ----- collapse_sum_like / broadcasting -----
    Mutant("collapse_sum_like", "forgets to broadcast the gradient back",
           lambda call, g: [g, None]),
    Mutant("collapse_sum_like", "broadcast gradient scaled by 2",
           lambda call, g: [ops.broadcast_to(g * 2.0, shape=call.args[0].shape), None]),
    Mutant("broadcast_to", "averages the replicas instead of summing them",
           lambda call, g: [ops.collapse_sum_like(g, call.args[0]) * (call.args[0].type.size / call.type.size)]),
    Mutant("sum", "restores the reduced axes at the front instead of in place",
           lambda call, g: [ops.broadcast_to(ops.reshape(g, shape=_reduced_first(call)), shape=call.args[0].shape)]),
    # ----- elementwise -----
    Mutant("tanh", "1 - t instead of 1 - t^2",
           lambda call, g: [ops.multiply(g, ops.subtract(1.0, call))]),
    Mutant("tanh", "cotangent ignored (TVM's all-ones blind spot)",
           lambda call, g: [ops.subtract(1.0, ops.multiply(call, call))]),
    Mutant("sigmoid", "s instead of s (1 - s)", lambda call, g: [ops.multiply(g, call)]),
    Mutant("exp", "gradient of the wrong input (grad * data)", lambda call, g: [ops.multiply(g, call.args[0])]),
    Mutant("log", "1 / data^2", lambda call, g: [ops.divide(g, ops.multiply(call.args[0], call.args[0]))]),
    Mutant("multiply", "each input gets its own value instead of the other's",
           lambda call, g: [ops.multiply(g, call.args[0]), ops.multiply(g, call.args[1])]),
    Mutant("divide", "d_rhs with the wrong sign",
           lambda call, g: [ops.divide(g, call.args[1]), ops.multiply(ops.divide(g, call.args[1]), call)]),
    Mutant("subtract", "d_rhs not negated", lambda call, g: [g, g]),
    Mutant("relu", "subgradient 1 at the kink (data >= 0)",
           lambda call, g: [ops.multiply(g, ops.subtract(1.0, ops.greater(ops.zeros_like(call.args[0]),
                                                                           call.args[0])))]),
    Mutant("softmax", "drops the sum term: y * grad", lambda call, g: [ops.multiply(call, g)]),
    Mutant("transpose", "applies axes instead of their inverse",
           lambda call, g: [ops.transpose(g, axes=call.attrs["axes"])]),
    Mutant("where", "branches swapped",
           lambda call, g: [None, ops.where(call.args[0], ops.zeros_like(g), g),
                            ops.where(call.args[0], g, ops.zeros_like(g))]),
]


def _declared() -> list[Mutant]:
    """Mutants planted with ``@op.mutant`` in the operators' own registry files."""
    from opgrad.registry import all_ops

    return [Mutant(op.name, mistake, rule) for op in all_ops() for mistake, rule in op.mutants]


#: Every mutant: those listed above for the original operators, then those declared beside each op.
MUTANTS: list[Mutant] = _LISTED + _declared()


def run_mutants(max_examples: int = 30, seed: int = 0, shrink: bool = False,
                mutants: list[Mutant] | None = None) -> list[tuple[Mutant, OpReport]]:
    """Check every mutant; returns each with its report (``passed`` means the mutant survived)."""
    from .runner import check_op

    return [(m, check_op(m.op, gradient=m.rule, max_examples=max_examples, seed=seed, shrink=shrink))
            for m in (mutants if mutants is not None else MUTANTS)]


def main() -> int:
    start = time.perf_counter()
    results = run_mutants()
    for m, report in results:
        verdict = f"killed by check {report.failure.check}" if report.failure else "SURVIVED"
        print(f"{m.op:24} {m.mistake:62} {verdict}")
    killed = sum(1 for _, r in results if not r.passed)
    print(f"\nkill rate: {killed}/{len(results)} = {killed / len(results):.0%} "
          f"({time.perf_counter() - start:.1f}s)")
    return 0 if killed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
