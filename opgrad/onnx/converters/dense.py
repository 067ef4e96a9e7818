"""Gemm and MatMul against a constant matrix: ``opgrad.nn.Dense`` (weight ``(units, in)``)."""

from __future__ import annotations

import numpy as np

from opgrad.nn.layers import Dense
from opgrad.onnx.table import NodeContext, Value, converter

__all__: list[str] = []


def _matrix(ctx: NodeContext, index: int, what: str) -> np.ndarray:
    matrix = ctx.static_floats(index, what)
    if matrix.ndim != 2:
        raise ctx.error(f"{what} has shape {list(matrix.shape)}; supported: a constant matrix")
    return matrix


@converter("Gemm", since=1, attributes=("alpha", "beta", "transA", "transB"))
def gemm(ctx: NodeContext) -> list[Value]:
    a = ctx.tensor(0, "A", rank=2)
    if int(ctx.attr("transA", 0)):
        raise ctx.unsupported("transA", 1, "0 (A is (batch, features))")
    b = _matrix(ctx, 1, "B")
    weight = (b if int(ctx.attr("transB", 0)) else b.T) * float(ctx.attr("alpha", 1.0))
    units = weight.shape[0]
    if weight.shape[1] != a.shape[0]:
        raise ctx.error(f"B {list(b.shape)} does not fit A (N, {a.shape[0]}) (transB={ctx.attr('transB', 0)})")
    weights = {"weight": weight}
    if ctx.has_input(2):
        c = ctx.static_floats(2, "C") * float(ctx.attr("beta", 1.0))
        if c.ndim > 2 or (c.ndim == 2 and c.shape[0] != 1) or c.size not in (1, units):
            raise ctx.error(f"C has shape {list(c.shape)}; supported: a bias broadcast over the batch, (), (1,), "
                            f"({units},) or (1, {units})")
        weights["bias"] = np.broadcast_to(c.reshape(-1), (units,)).copy()
    return [ctx.layer(ctx.new(Dense, units, use_bias="bias" in weights), a, weights)]


@converter("MatMul", since=1)
def matmul(ctx: NodeContext) -> list[Value]:
    a = ctx.tensor(0, "A")
    b = _matrix(ctx, 1, "B")
    if not a.shape or b.shape[0] != a.shape[-1]:
        raise ctx.error(f"B {list(b.shape)} does not fit A (N, {', '.join(map(str, a.shape))}); supported: A's "
                        "last axis times a constant matrix")
    # Over A's last axis, as PyTorch's Linear on (N, T, K) exports it.
    return [ctx.layer(ctx.new(Dense, b.shape[1], use_bias=False), a, {"weight": b.T})]
