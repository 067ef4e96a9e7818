"""Conv (1-D over (N, C, L) and 2-D over NCHW) and ConvTranspose (2-D); ONNX's weight layouts are
opgrad's (OIHW, and OIL for 1-D)."""

from __future__ import annotations

from collections.abc import Sequence

from opgrad.nn.layers import Conv1D, Conv2D, Conv2DTranspose, SymbolicTensor
from opgrad.nn.ops_layers import Pad, Slice
from opgrad.onnx.table import NodeContext, Value, converter

__all__ = ["AUTO_PADS", "line_padding", "line_pads", "same_pads", "spatial_pads", "symmetric_or_padded"]

AUTO_PADS = "NOTSET, VALID, SAME_UPPER, SAME_LOWER"
Pads = tuple[int, int, int, int]


def same_pads(extent: int, kernel: int, stride: int, dilation: int, upper: bool = True) -> tuple[int, int]:
    """ONNX's SAME_UPPER (TF/Keras "same": the odd pixel after) or SAME_LOWER (before) for one axis."""
    out = -(-extent // stride)
    total = max((out - 1) * stride + (kernel - 1) * dilation + 1 - extent, 0)
    small, large = total // 2, total - total // 2
    return (small, large) if upper else (large, small)


def spatial_pads(ctx: NodeContext, size: Sequence[int], kernel: Sequence[int], strides: Sequence[int],
                 dilations: Sequence[int]) -> Pads:
    """``(top, left, bottom, right)`` from ``auto_pad`` and ``pads`` for an input of ``size`` (H, W)."""
    auto = ctx.attr("auto_pad", "NOTSET")
    if auto == "NOTSET":
        pads = ctx.ints("pads", (0, 0, 0, 0))
        if len(pads) != 4 or min(pads) < 0:
            raise ctx.unsupported("pads", list(pads), "four non-negative ints (top, left, bottom, right)")
        return pads[0], pads[1], pads[2], pads[3]
    if auto == "VALID":
        return 0, 0, 0, 0
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        (t, b), (l, r) = (same_pads(e, k, s, d, auto == "SAME_UPPER")
                          for e, k, s, d in zip(size, kernel, strides, dilations))
        return t, l, b, r
    raise ctx.unsupported("auto_pad", auto, AUTO_PADS)


def symmetric_or_padded(ctx: NodeContext, x: SymbolicTensor, pads: Pads, same: Pads, limit: Sequence[int] | None,
                        value: float) -> tuple[SymbolicTensor, str | tuple[int, int]]:
    """The ``padding`` argument of an opgrad conv/pool layer for ONNX ``pads``, and its input.

    Equal pads on both sides (below ``limit``, the pool size) or the "same" pads map onto the
    layer's own padding; anything else becomes a :class:`~opgrad.nn.Pad` layer (``value``) first.
    """
    t, l, b, r = pads
    if pads == (0, 0, 0, 0):
        return x, "valid"
    if t == b and l == r and (limit is None or (t < limit[0] and l < limit[1])):
        return x, (t, l)
    if pads == same:
        return x, "same"
    padded = ctx.layer(ctx.new(Pad, [(0, 0), (t, b), (l, r)], value=value), x)
    return padded, "valid"


def _geometry(ctx: NodeContext, kernel_from_weight: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    kernel = ctx.ints("kernel_shape", kernel_from_weight)
    if tuple(kernel) != tuple(kernel_from_weight):
        raise ctx.error(f"attribute kernel_shape={list(kernel)} does not match the weight's {list(kernel_from_weight)}")
    strides = ctx.ints("strides", (1, 1))
    dilations = ctx.ints("dilations", (1, 1))
    for attribute, value in (("strides", strides), ("dilations", dilations)):
        if len(value) != 2 or min(value) < 1:
            raise ctx.unsupported(attribute, list(value), "two positive ints (2-D convolution)")
    return kernel, strides, dilations


def _weights(ctx: NodeContext, rank_what: str) -> tuple:  # type: ignore[type-arg]
    w = ctx.static_floats(1, "W")
    if w.ndim != 4:
        raise ctx.error(f"weight W has shape {list(w.shape)}; supported: 2-D convolution, {rank_what}")
    b = ctx.static_floats(2, "B") if ctx.has_input(2) else None
    return w, b


def line_pads(ctx: NodeContext, length: int, kernel: int, stride: int, dilation: int) -> tuple[int, int]:
    """``(left, right)`` from ``auto_pad`` and ``pads`` for a 1-D input of ``length``."""
    auto = ctx.attr("auto_pad", "NOTSET")
    if auto == "NOTSET":
        pads = ctx.ints("pads", (0, 0))
        if len(pads) != 2 or min(pads) < 0:
            raise ctx.unsupported("pads", list(pads), "two non-negative ints (begin, end)")
        return pads[0], pads[1]
    if auto == "VALID":
        return 0, 0
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        return same_pads(length, kernel, stride, dilation, auto == "SAME_UPPER")
    raise ctx.unsupported("auto_pad", auto, AUTO_PADS)


def line_padding(ctx: NodeContext, x: SymbolicTensor, pads: tuple[int, int], same: tuple[int, int],
                 limit: int | None, value: float) -> tuple[SymbolicTensor, str | int]:
    """:func:`symmetric_or_padded` for a 1-D layer's ``padding``: equal pads (below ``limit``), the
    "same" pads, or a :class:`~opgrad.nn.Pad` layer (``value``) first."""
    left, right = pads
    if pads == (0, 0):
        return x, "valid"
    if left == right and (limit is None or left < limit):
        return x, left
    if pads == same:
        return x, "same"
    return ctx.layer(ctx.new(Pad, [(0, 0), (left, right)], value=value), x), "valid"


def _conv1d(ctx: NodeContext, x: SymbolicTensor) -> list[Value]:
    w = ctx.static_floats(1, "W")
    if w.ndim != 3:
        raise ctx.error(f"weight W has shape {list(w.shape)}; supported for an (N, C, L) input: W (M, C/group, k)")
    b = ctx.static_floats(2, "B") if ctx.has_input(2) else None
    kernel = int(w.shape[2])
    if tuple(ctx.ints("kernel_shape", (kernel,))) != (kernel,):
        raise ctx.error(f"attribute kernel_shape={list(ctx.ints('kernel_shape', ()))} does not match the weight's "
                        f"[{kernel}]")
    strides, dilations = ctx.ints("strides", (1,)), ctx.ints("dilations", (1,))
    for attribute, value in (("strides", strides), ("dilations", dilations)):
        if len(value) != 1 or min(value) < 1:
            raise ctx.unsupported(attribute, list(value), "one positive int (1-D convolution)")
    group = int(ctx.attr("group", 1))
    if group < 1 or w.shape[1] * group != x.shape[0] or w.shape[0] % group:
        raise ctx.error(f"weight W {list(w.shape)} with group={group} does not fit {x.shape[0]} input channels")
    if b is not None and b.shape != (w.shape[0],):
        raise ctx.error(f"bias B has shape {list(b.shape)}; expected ({w.shape[0]},)")
    pads = line_pads(ctx, x.shape[1], kernel, strides[0], dilations[0])
    x, padding = line_padding(ctx, x, pads, same_pads(x.shape[1], kernel, strides[0], dilations[0]), None, 0.0)
    layer = ctx.new(Conv1D, w.shape[0], kernel, strides=strides[0], padding=padding, dilation_rate=dilations[0],
                    groups=group, use_bias=b is not None)
    weights = {"weight": w} if b is None else {"weight": w, "bias": b}
    return [ctx.layer(layer, x, weights)]


@converter("Conv", since=1, attributes=("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"))
def conv(ctx: NodeContext) -> list[Value]:
    if len(ctx.tensor(0, "X").shape) == 2:  # (N, C, L): torch's Conv1d
        return _conv1d(ctx, ctx.tensor(0, "X"))
    x = ctx.tensor(0, "X", rank=4)
    w, b = _weights(ctx, "W (M, C/group, kH, kW)")
    kernel, strides, dilations = _geometry(ctx, w.shape[2:])
    group = int(ctx.attr("group", 1))
    if group < 1 or w.shape[1] * group != x.shape[0] or w.shape[0] % group:
        raise ctx.error(f"weight W {list(w.shape)} with group={group} does not fit {x.shape[0]} input channels")
    if b is not None and b.shape != (w.shape[0],):
        raise ctx.error(f"bias B has shape {list(b.shape)}; expected ({w.shape[0]},)")
    size = x.shape[1:]
    pads = spatial_pads(ctx, size, kernel, strides, dilations)
    (st, sb), (sl, sr) = (same_pads(e, k, s, d) for e, k, s, d in zip(size, kernel, strides, dilations))
    x, padding = symmetric_or_padded(ctx, x, pads, (st, sl, sb, sr), None, 0.0)
    layer = ctx.new(Conv2D, w.shape[0], kernel, strides=strides, padding=padding, dilation_rate=dilations,
                    groups=group, use_bias=b is not None)
    weights = {"weight": w} if b is None else {"weight": w, "bias": b}
    return [ctx.layer(layer, x, weights)]


@converter("ConvTranspose", since=1, attributes=("auto_pad", "dilations", "group", "kernel_shape",
                                                 "output_padding", "output_shape", "pads", "strides"))
def conv_transpose(ctx: NodeContext) -> list[Value]:
    x = ctx.tensor(0, "X", rank=4)
    w, b = _weights(ctx, "W (C, M/group, kH, kW)")
    kernel, strides, dilations = _geometry(ctx, w.shape[2:])
    group = int(ctx.attr("group", 1))
    if group < 1 or w.shape[0] != x.shape[0] or x.shape[0] % group:
        raise ctx.error(f"weight W {list(w.shape)} with group={group} does not fit {x.shape[0]} input channels")
    filters = w.shape[1] * group
    if b is not None and b.shape != (filters,):
        raise ctx.error(f"bias B has shape {list(b.shape)}; expected ({filters},)")
    extra = ctx.ints("output_padding", (0, 0))
    auto = ctx.attr("auto_pad", "NOTSET")
    target = ctx.attr("output_shape")
    full = [(e - 1) * s + (k - 1) * d + 1 for e, k, s, d in zip(x.shape[1:], kernel, strides, dilations)]
    if target is not None or auto in ("SAME_UPPER", "SAME_LOWER"):
        if target is not None:
            out = [int(v) for v in target][-2:]
        else:
            out = [e * s for e, s in zip(x.shape[1:], strides)]
        totals = [f + o - t for f, o, t in zip(full, extra, out)]
        if min(totals) < 0:
            raise ctx.unsupported("output_shape", list(out), "sizes the transposed convolution reaches by cropping")
        begin = [t // 2 if auto == "SAME_UPPER" else t - t // 2 for t in totals]
        pads = (begin[0], begin[1], totals[0] - begin[0], totals[1] - begin[1])
    else:
        pads = spatial_pads(ctx, x.shape[1:], kernel, strides, dilations)
    # Unequal crops: the layer crops what both sides share, a Slice the rest.
    top, left = min(pads[0], pads[2]), min(pads[1], pads[3])
    layer = ctx.new(Conv2DTranspose, filters, kernel, strides=strides, padding=(top, left),
                    output_padding=extra, dilation_rate=dilations, groups=group, use_bias=b is not None)
    weights = {"weight": w} if b is None else {"weight": w, "bias": b}
    y = ctx.layer(layer, x, weights)
    crops = (pads[0] - top, pads[1] - left, pads[2] - top, pads[3] - left)
    if crops == (0, 0, 0, 0):
        return [y]
    end = [None, -crops[2] or None, -crops[3] or None]
    return [ctx.layer(ctx.new(Slice, [None, crops[0], crops[1]], end), y)]
