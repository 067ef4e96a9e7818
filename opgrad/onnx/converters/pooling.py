"""MaxPool, AveragePool (1-D over (N, C, L) and 2-D over NCHW), GlobalAveragePool, GlobalMaxPool (2-D)."""

from __future__ import annotations

import math

from opgrad.nn.layers import AvgPool1D, AvgPool2D, MaxPool1D, MaxPool2D, SymbolicTensor
from opgrad.nn.ops_layers import GlobalPool2D
from opgrad.onnx.converters.conv import line_padding, line_pads, same_pads, spatial_pads, symmetric_or_padded
from opgrad.onnx.table import NodeContext, Value, converter

__all__: list[str] = []


def _pool1d(ctx: NodeContext, x: SymbolicTensor, kind: str) -> list[Value]:
    kernel, strides = ctx.ints("kernel_shape", ()), ctx.ints("strides", (1,))
    if len(kernel) != 1 or min(kernel) < 1:
        raise ctx.unsupported("kernel_shape", list(kernel), "one positive int (1-D pooling)")
    if len(strides) != 1 or min(strides) < 1:
        raise ctx.unsupported("strides", list(strides), "one positive int")
    if tuple(ctx.ints("dilations", (1,))) != (1,):
        raise ctx.unsupported("dilations", list(ctx.ints("dilations", ())), "[1]")
    (k,), (s,) = kernel, strides
    left, right = line_pads(ctx, x.shape[1], k, s, 1)
    ceil_mode = bool(int(ctx.attr("ceil_mode", 0))) and bool((x.shape[1] + left + right - k) % s)
    if ceil_mode and (left != right or left >= k):
        raise ctx.unsupported("ceil_mode", 1, "0, or 1 with equal pads on both sides below the window")
    if kind == "max":
        x, padding = line_padding(ctx, x, (left, right), same_pads(x.shape[1], k, s, 1), k, -math.inf)
        layer = ctx.new(MaxPool1D, k, strides=s, padding=padding, ceil_mode=ceil_mode)
    elif int(ctx.attr("count_include_pad", 0)) or (left, right) == (0, 0):
        x, padding = line_padding(ctx, x, (left, right), (-1, -1), k, 0.0)
        layer = ctx.new(AvgPool1D, k, strides=s, padding=padding, ceil_mode=ceil_mode)
    elif left == right and left < k:
        layer = ctx.new(AvgPool1D, k, strides=s, padding=left, ceil_mode=ceil_mode, count_include_pad=False)
    else:
        raise ctx.unsupported("count_include_pad", 0, f"1, or 0 with equal pads on both sides; these pads are "
                                                      f"{[left, right]}")
    return [ctx.layer(layer, x)]


def _pool(ctx: NodeContext, kind: str) -> list[Value]:
    if len(ctx.tensor(0, "X").shape) == 2:  # (N, C, L): torch's MaxPool1d, AvgPool1d
        return _pool1d(ctx, ctx.tensor(0, "X"), kind)
    x = ctx.tensor(0, "X", rank=4)
    kernel = ctx.ints("kernel_shape", ())
    if len(kernel) != 2 or min(kernel) < 1:
        raise ctx.unsupported("kernel_shape", list(kernel), "two positive ints (2-D pooling)")
    strides = ctx.ints("strides", (1, 1))
    if len(strides) != 2 or min(strides) < 1:
        raise ctx.unsupported("strides", list(strides), "two positive ints")
    dilations = ctx.ints("dilations", (1, 1))
    if dilations != (1, 1):
        raise ctx.unsupported("dilations", list(dilations), "[1, 1]")
    size = x.shape[1:]
    t, l, b, r = spatial_pads(ctx, size, kernel, strides, (1, 1))
    # Equal pads below the window are the layer's own padding, which takes ceil_mode and
    # count_include_pad=0 as PyTorch defines them; other pads become a Pad layer first.
    symmetric = t == b and l == r and t < kernel[0] and l < kernel[1]
    ceil_mode = False
    if int(ctx.attr("ceil_mode", 0)):
        for extent, k, s, pad in zip(size, kernel, strides, (t + b, l + r)):
            if (extent + pad - k) % s:
                if not symmetric:
                    floor = (extent + pad - k) // s + 1
                    raise ctx.unsupported("ceil_mode", 1, f"0, or 1 with equal pads on both sides or where it "
                                                          f"does not change the output size (here it gives "
                                                          f"{floor + 1} instead of {floor})")
                ceil_mode = True
    (st, sb), (sl, sr) = (same_pads(e, k, s, 1) for e, k, s in zip(size, kernel, strides))
    same = (st, sl, sb, sr)
    if kind == "max":
        x, padding = symmetric_or_padded(ctx, x, (t, l, b, r), same, kernel, -math.inf)
        layer = ctx.new(MaxPool2D, kernel, strides=strides, padding=padding, ceil_mode=ceil_mode)
    elif int(ctx.attr("count_include_pad", 0)) or (t, l, b, r) == (0, 0, 0, 0):
        # The nn layer's "same" averages real pixels only: padding counted must not take that path.
        x, padding = symmetric_or_padded(ctx, x, (t, l, b, r), (-1, -1, -1, -1), kernel, 0.0)
        layer = ctx.new(AvgPool2D, kernel, strides=strides, padding=padding, ceil_mode=ceil_mode)
    elif symmetric:
        layer = ctx.new(AvgPool2D, kernel, strides=strides, padding=(t, l), ceil_mode=ceil_mode,
                        count_include_pad=False)
    elif (t, l, b, r) == same:
        layer = ctx.new(AvgPool2D, kernel, strides=strides, padding="same")
    else:
        raise ctx.unsupported("count_include_pad", 0, f"1, or 0 with equal pads on both sides or the pads of "
                                                      f"auto_pad SAME_UPPER ({list(same)}); these pads are "
                                                      f"{[t, l, b, r]}")
    return [ctx.layer(layer, x)]


@converter("MaxPool", since=1, attributes=("auto_pad", "ceil_mode", "dilations", "kernel_shape", "pads",
                                           "storage_order", "strides"))
def max_pool(ctx: NodeContext) -> list[Value]:
    return _pool(ctx, "max")


@converter("AveragePool", since=1, attributes=("auto_pad", "ceil_mode", "count_include_pad", "dilations",
                                               "kernel_shape", "pads", "strides"))
def average_pool(ctx: NodeContext) -> list[Value]:
    return _pool(ctx, "avg")


@converter("GlobalAveragePool", since=1)
def global_average_pool(ctx: NodeContext) -> list[Value]:
    return [ctx.layer(ctx.new(GlobalPool2D, "avg"), ctx.tensor(0, "X", rank=4))]


@converter("GlobalMaxPool", since=1)
def global_max_pool(ctx: NodeContext) -> list[Value]:
    return [ctx.layer(ctx.new(GlobalPool2D, "max"), ctx.tensor(0, "X", rank=4))]
