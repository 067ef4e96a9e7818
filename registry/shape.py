"""Layout operators that move or replicate elements without arithmetic:
transpose, reshape, flatten, broadcast_to. All are linear; each gradient is the inverse move.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from opgrad import ops
from opgrad.dtypes import TensorType, broadcast_shapes
from opgrad.ir import Call, Expr
from opgrad.op import Attr, Attrs, Case, Input, Operator, require, whole

from ._common import dense_reshape, shape_tuple

if TYPE_CHECKING:  # types only: the compiler and the checker sit above the registry
    from opgrad.checks.strategies import CaseDraw
    from opgrad.compiler.builder import KernelBuilder
    from opgrad.compiler.views import View


def _permutation(value: Any, types: Sequence[TensorType], _attrs: Any = None) -> tuple[int, ...]:
    ndim = types[0].ndim if types else 0
    if value is None:
        return tuple(reversed(range(ndim)))
    try:
        axes = tuple(whole(a) % ndim if ndim else whole(a) for a in value)
    except TypeError:
        raise ValueError(f"expected a permutation of range({ndim})") from None
    if sorted(axes) != list(range(ndim)):
        raise ValueError(f"expected a permutation of range({ndim}) for a rank-{ndim} input")
    return axes


# ----- transpose -----

transpose = Operator(
    "transpose",
    inputs=[Input("data")],
    attrs=[Attr("axes", default=None, convert=_permutation, uses_types=True,
                doc="a permutation of the axes; None reverses them")],
    doc="Permute the axes of data (numpy.transpose).",
    jointly_linear=True,
)


@transpose.shape_rule
def _transpose_shape(data: TensorType, attrs: Attrs) -> TensorType:
    return TensorType(tuple(data.shape[a] for a in attrs["axes"]), data.dtype)


@transpose.reference
def _transpose_forward(data: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    return np.asarray(np.transpose(data, axes).copy())


@transpose.gradient
def _transpose_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = transpose(grad, argsort(axes))"""
    inverse = tuple(int(i) for i in np.argsort(call.attrs["axes"]))
    return [ops.transpose(grad, axes=inverse)]


@transpose.mutant("applies axes instead of their inverse")
def _transpose_not_inverted(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.transpose(grad, axes=call.attrs["axes"])]


@transpose.sampler
def _transpose_cases(d: CaseDraw) -> Case:
    shape = d.shape(min_rank=1, max_rank=4)  # up to rank 4: most permutations are not their own inverse
    return Case([shape], {"axes": d.permutation(len(shape)) if d.int(0, 3) else None})


@transpose.lowering
def _transpose_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> View | None:
    """a view with permuted strides: consumers (a GEMM, a loop) read through it, nothing is copied"""
    return data.permute(call.attrs["axes"])


# ----- reshape -----


def _target_shape(value: Any, types: Sequence[TensorType], _attrs: Any = None) -> tuple[int, ...]:
    shape = list(shape_tuple(value))
    size = types[0].size if types else 0
    if shape.count(-1) > 1:
        raise ValueError("at most one dimension may be -1")
    if -1 in shape:
        known = int(np.prod([d for d in shape if d != -1], dtype=np.int64))
        if known == 0 or size % known:
            raise ValueError(f"cannot infer the -1 dimension: {size} elements do not divide by {known}")
        shape[shape.index(-1)] = size // known
    if any(d < 0 for d in shape):
        raise ValueError("dimensions must be >= 0 (or a single -1)")
    return tuple(shape)


reshape = Operator(
    "reshape",
    inputs=[Input("data")],
    attrs=[Attr("shape", convert=_target_shape, uses_types=True,
                doc="the new shape, same element count; one entry may be -1")],
    doc="Same elements in row-major order, new shape.",
    jointly_linear=True,
)


@reshape.shape_rule
def _reshape_shape(data: TensorType, attrs: Attrs) -> TensorType:
    new = attrs["shape"]
    size = int(np.prod(new, dtype=np.int64))
    require(size == data.size, f"cannot reshape {data.size} elements {data.shape} into {new} ({size} elements)")
    return TensorType(new, data.dtype)


@reshape.reference
def _reshape_forward(data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return data.reshape(shape)


@reshape.gradient
def _reshape_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = reshape(grad, data.shape)"""
    return [ops.reshape(grad, shape=call.args[0].shape)]


def column_major(grad: Expr, shape: tuple[int, ...]) -> Expr:
    """``grad``'s elements laid into ``shape`` in Fortran order: the same as row-major only when at
    most one axis of ``shape`` is longer than 1."""
    return ops.transpose(ops.reshape(grad, shape=tuple(reversed(shape))))


@reshape.mutant("gradient reshaped in column-major order (right for vectors, single rows and columns)")
def _reshape_column_major(call: Call, grad: Expr) -> list[Expr | None]:
    return [column_major(grad, call.args[0].shape)]


@reshape.sampler
def _reshape_cases(d: CaseDraw) -> Case:
    shape = d.shape()
    target = list(d.same_size_shape(shape))
    if target and d.bool():
        target[d.int(0, len(target) - 1)] = -1  # let the op infer one dimension
    return Case([shape], {"shape": tuple(target)})


@reshape.lowering
def _reshape_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> View | None:
    """a view of dense data under the new shape; a strided input is copied into out first"""
    view = data.reshape(out.shape)
    if view is None:
        kb.elementwise(dense_reshape(out, data.shape), [data], lambda s, v: v[0])
    return view


# ----- flatten -----

flatten = Operator(
    "flatten",
    inputs=[Input("data")],
    doc="(N, d1, d2, ...) -> (N, d1*d2*...): keeps the batch axis, as Keras Flatten.",
    jointly_linear=True,
)


@flatten.shape_rule
def _flatten_shape(data: TensorType, attrs: Attrs) -> TensorType:
    require(data.ndim >= 1, "data must have a batch axis (rank >= 1), got a scalar")
    rest = int(np.prod(data.shape[1:], dtype=np.int64))
    return TensorType((data.shape[0], rest), data.dtype)


@flatten.reference
def _flatten_forward(data: np.ndarray) -> np.ndarray:
    return data.reshape(data.shape[0], int(np.prod(data.shape[1:], dtype=np.int64)))  # -1 fails on 0 rows


flatten.gradient(_reshape_gradient)


@flatten.mutant("gradient unflattened in column-major order (right when only one axis is longer than 1)")
def _flatten_column_major(call: Call, grad: Expr) -> list[Expr | None]:
    return [column_major(grad, call.args[0].shape)]


@flatten.sampler
def _flatten_cases(d: CaseDraw) -> Case:
    return Case([d.shape(min_rank=1, max_rank=4)])


flatten.lowering(_reshape_lowering)  # a flatten is a reshape to (N, rest)


# ----- broadcast_to -----

broadcast_to = Operator(
    "broadcast_to",
    inputs=[Input("data")],
    attrs=[Attr("shape", convert=shape_tuple, doc="target shape; data must broadcast to it")],
    doc="Replicate data to `shape` by numpy broadcasting.",
    jointly_linear=True,
)


@broadcast_to.shape_rule
def _broadcast_to_shape(data: TensorType, attrs: Attrs) -> TensorType:
    target = attrs["shape"]
    require(
        broadcast_shapes(data.shape, target) == target,
        f"data of shape {data.shape} does not broadcast to {target}",
    )
    return TensorType(target, data.dtype)


@broadcast_to.reference
def _broadcast_to_forward(data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return np.asarray(np.broadcast_to(data, shape).copy())


@broadcast_to.gradient
def _broadcast_to_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = collapse_sum_like(grad, data)"""
    return [ops.collapse_sum_like(grad, call.args[0])]


@broadcast_to.mutant("averages the replicas instead of summing them")
def _broadcast_to_averaged(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.collapse_sum_like(grad, call.args[0]) * (call.args[0].type.size / call.type.size)]


@broadcast_to.sampler
def _broadcast_to_cases(d: CaseDraw) -> Case:
    shape = d.shape()
    return Case([shape], {"shape": d.broadcast_target(shape)})


@broadcast_to.lowering
def _broadcast_to_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> View | None:
    """a view with 0-strides along the broadcast axes: never materialized"""
    return data.broadcast_to(out.shape)
