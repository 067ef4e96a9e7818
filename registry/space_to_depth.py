"""space_to_depth and depth_to_space: PyTorch's pixel_unshuffle and pixel_shuffle on NCHW data.

The two block moves are each other's inverse and adjoint, so each is the other's gradient. Both
are copies through one 6-D strided view that pairs the two layouts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from opgrad import ops
from opgrad.dtypes import TensorType
from opgrad.ir import Call, Expr
from opgrad.op import Attr, Attrs, Case, Input, Operator, require

from ._common import copy_element, positive_int

if TYPE_CHECKING:  # types only: the compiler and the checker sit above the registry
    from opgrad.checks.strategies import CaseDraw
    from opgrad.compiler.builder import KernelBuilder
    from opgrad.compiler.views import View


def _block_views(nchw_shape: Sequence[int], strides: Sequence[int], r: int, kind: str) -> tuple[tuple[int, ...],
                                                                                                   tuple[int, ...]]:
    """(shape, strides) of the 6-D (N, C, r, r, H, W) view that pairs the two layouts.

    ``kind="spatial"`` views an (N, C, H*r, W*r) tensor, ``kind="depth"`` an (N, C*r*r, H, W) one,
    both at element (n, c, i, j, h, w) = spatial[n, c, h*r + i, w*r + j] = depth[n, c*r*r + i*r + j, h, w].
    """
    s0, s1, s2, s3 = strides
    if kind == "spatial":
        n, c, hr, wr = nchw_shape
        return (n, c, r, r, hr // r, wr // r), (s0, s1, s2, s3, s2 * r, s3 * r)
    n, crr, h, w = nchw_shape
    return (n, crr // (r * r), r, r, h, w), (s0, s1 * r * r, s1 * r, s1, s2, s3)


def _block_move(kb: KernelBuilder, out: View, data: View, r: int, out_kind: str, data_kind: str) -> None:
    oshape, ostrides = _block_views(out.shape, out.strides, r, out_kind)
    dshape, dstrides = _block_views(data.shape, data.strides, r, data_kind)
    assert oshape == dshape, (oshape, dshape)
    kb.elementwise(replace(out, shape=oshape, strides=ostrides), [replace(data, shape=dshape, strides=dstrides)],
                   copy_element)


space_to_depth = Operator(
    "space_to_depth",
    inputs=[Input("data", doc="NCHW, H and W multiples of block_size")],
    attrs=[Attr("block_size", convert=positive_int, doc="r: each r x r block becomes r*r channels")],
    doc="(N, C, H*r, W*r) -> (N, C*r*r, H, W): out[n, c*r*r + i*r + j, h, w] = data[n, c, h*r + i, w*r + j] "
        "(torch.nn.functional.pixel_unshuffle).",
    jointly_linear=True,
)


@space_to_depth.shape_rule
def _space_to_depth_shape(data: TensorType, attrs: Attrs) -> TensorType:
    r = attrs["block_size"]
    require(data.ndim == 4, f"data must be 4-D NCHW, got shape {data.shape}")
    n, c, h, w = data.shape
    require(h % r == 0 and w % r == 0, f"H={h} and W={w} must be multiples of block_size={r}")
    return TensorType((n, c * r * r, h // r, w // r), data.dtype)


@space_to_depth.reference
def _space_to_depth_forward(data: np.ndarray, block_size: int) -> np.ndarray:
    n, c, h, w = data.shape
    r = block_size
    blocks = data.reshape(n, c, h // r, r, w // r, r).transpose(0, 1, 3, 5, 2, 4)
    return np.asarray(blocks.reshape(n, c * r * r, h // r, w // r))


@space_to_depth.gradient
def _space_to_depth_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = depth_to_space(grad, block_size): the inverse permutation"""
    return [ops.depth_to_space(grad, block_size=call.attrs["block_size"])]


def _swap_block_axes(x: Expr, r: int) -> Expr:
    """The channel order c*r*r + j*r + i instead of c*r*r + i*r + j (rows and columns of a block swapped)."""
    n, crr, h, w = x.shape
    six = ops.reshape(x, shape=(n, crr // (r * r), r, r, h, w))
    return ops.reshape(ops.transpose(six, axes=(0, 1, 3, 2, 4, 5)), shape=x.shape)


@space_to_depth.mutant("block rows and columns swapped in the channel order")
def _space_to_depth_swapped(call: Call, grad: Expr) -> list[Expr | None]:
    r = call.attrs["block_size"]
    return [ops.depth_to_space(_swap_block_axes(grad, r), block_size=r)]


def _block_case(d: CaseDraw, layout: str) -> Case:
    r = d.int(1, 3)
    n, c, h, w = d.int(1, 2), d.int(1, 3), d.int(1, 3), d.int(1, 3)
    shape = (n, c, h * r, w * r) if layout == "spatial" else (n, c * r * r, h, w)
    return Case([shape], {"block_size": r})


@space_to_depth.sampler
def _space_to_depth_cases(d: CaseDraw) -> Case:
    return _block_case(d, "spatial")


@space_to_depth.lowering
def _space_to_depth_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = data through the 6-D (N, C, r, r, H, W) view that regroups each block into channels"""
    _block_move(kb, out, data, call.attrs["block_size"], "depth", "spatial")


depth_to_space = Operator(
    "depth_to_space",
    inputs=[Input("data", doc="NCHW, C a multiple of block_size**2")],
    attrs=[Attr("block_size", convert=positive_int, doc="r: each r*r channels become an r x r block")],
    doc="(N, C*r*r, H, W) -> (N, C, H*r, W*r): out[n, c, h*r + i, w*r + j] = data[n, c*r*r + i*r + j, h, w] "
        "(torch.nn.functional.pixel_shuffle).",
    jointly_linear=True,
)


@depth_to_space.shape_rule
def _depth_to_space_shape(data: TensorType, attrs: Attrs) -> TensorType:
    r = attrs["block_size"]
    require(data.ndim == 4, f"data must be 4-D NCHW, got shape {data.shape}")
    n, c, h, w = data.shape
    require(c % (r * r) == 0, f"C={c} must be a multiple of block_size**2={r * r}")
    return TensorType((n, c // (r * r), h * r, w * r), data.dtype)


@depth_to_space.reference
def _depth_to_space_forward(data: np.ndarray, block_size: int) -> np.ndarray:
    n, c, h, w = data.shape
    r = block_size
    blocks = data.reshape(n, c // (r * r), r, r, h, w).transpose(0, 1, 4, 2, 5, 3)
    return np.asarray(blocks.reshape(n, c // (r * r), h * r, w * r))


@depth_to_space.gradient
def _depth_to_space_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = space_to_depth(grad, block_size): the inverse permutation"""
    return [ops.space_to_depth(grad, block_size=call.attrs["block_size"])]


@depth_to_space.mutant("block rows and columns swapped in the channel order")
def _depth_to_space_swapped(call: Call, grad: Expr) -> list[Expr | None]:
    r = call.attrs["block_size"]
    return [_swap_block_axes(ops.space_to_depth(grad, block_size=r), r)]


@depth_to_space.sampler
def _depth_to_space_cases(d: CaseDraw) -> Case:
    return _block_case(d, "depth")


@depth_to_space.lowering
def _depth_to_space_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = data through the 6-D (N, C, r, r, H, W) view that spreads channels into blocks"""
    _block_move(kb, out, data, call.attrs["block_size"], "spatial", "depth")
