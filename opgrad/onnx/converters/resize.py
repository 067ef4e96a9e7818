"""Resize: nearest (PyTorch's legacy nearest) and bilinear, as ``opgrad.nn.Resize``."""

from __future__ import annotations

import math
from typing import Any

from opgrad.nn.ops_layers import Resize
from opgrad.onnx.table import BATCH, NodeContext, Value, converter

__all__: list[str] = []

_LINEAR_MODES = "half_pixel or pytorch_half_pixel (align_corners=False), align_corners"


def _output_size(ctx: NodeContext, shape: tuple[int, ...]) -> tuple[int, int]:
    axes = ctx.ints("axes", (0, 1, 2, 3))
    if sorted(a % 4 for a in axes) != sorted(set(a % 4 for a in axes)):
        raise ctx.unsupported("axes", list(axes), "distinct axes")
    full = (BATCH, *shape)
    if ctx.has_input(3):
        given: list[Any] = [v if v is BATCH else int(v) for v in ctx.static(3, "sizes").array.ravel()]  # plain ints
        sizes = {a % 4: v for a, v in zip(axes, given)}
        for axis in (0, 1):
            if axis in sizes and not (sizes[axis] is BATCH or int(sizes[axis]) == full[axis]
                                      or (axis == 0 and ctx.batch is not None and int(sizes[axis]) == ctx.batch)):
                raise ctx.error(f"sizes {given} resize the batch or channel axis; supported: height and width")
        return int(sizes.get(2, shape[1])), int(sizes.get(3, shape[2]))
    scales = ctx.static_floats(2, "scales").ravel().tolist() if ctx.has_input(2) else []
    if not scales:
        raise ctx.error("neither scales nor sizes is given")
    by_axis = {a % 4: s for a, s in zip(axes, scales)}
    if by_axis.get(0, 1.0) != 1.0 or by_axis.get(1, 1.0) != 1.0:
        raise ctx.error(f"scales {scales} resize the batch or channel axis; supported: height and width")
    out = []
    for axis, extent in ((2, shape[1]), (3, shape[2])):
        scaled = extent * by_axis.get(axis, 1.0)
        if abs(scaled - round(scaled)) > 1e-6 * max(1.0, scaled):
            raise ctx.error(f"scale {by_axis.get(axis)} of axis {axis} gives {scaled:g} pixels; supported: scales "
                            "giving whole output sizes (or give sizes)")
        out.append(round(scaled))
    return out[0], out[1]


@converter("Resize", since=11, attributes=("antialias", "axes", "coordinate_transformation_mode", "cubic_coeff_a",
                                           "exclude_outside", "extrapolation_value", "keep_aspect_ratio_policy",
                                           "mode", "nearest_mode"))
def resize(ctx: NodeContext) -> list[Value]:
    x = ctx.tensor(0, "X", rank=4)
    for attribute, default in (("antialias", 0), ("exclude_outside", 0)):
        if int(ctx.attr(attribute, default)) != default:
            raise ctx.unsupported(attribute, ctx.attr(attribute), str(default))
    policy = ctx.attr("keep_aspect_ratio_policy", "stretch")
    if policy != "stretch":
        raise ctx.unsupported("keep_aspect_ratio_policy", policy, "stretch")
    size = _output_size(ctx, x.shape)
    if min(size) < 1 or math.prod(size) > 1 << 26:
        raise ctx.error(f"output size {list(size)} is out of range")
    mode = ctx.attr("mode", "nearest")
    transform = ctx.attr("coordinate_transformation_mode", "half_pixel")
    if mode == "nearest":
        nearest = ctx.attr("nearest_mode", "round_prefer_floor")
        if transform != "asymmetric":
            raise ctx.unsupported("coordinate_transformation_mode", transform,
                                  "asymmetric with mode nearest (PyTorch's nearest)")
        if nearest != "floor":
            raise ctx.unsupported("nearest_mode", nearest, "floor (PyTorch's nearest)")
        layer = ctx.new(Resize, size, method="nearest")
    elif mode == "linear":
        if transform not in ("half_pixel", "pytorch_half_pixel", "align_corners"):
            raise ctx.unsupported("coordinate_transformation_mode", transform, f"{_LINEAR_MODES} with mode linear")
        if transform == "pytorch_half_pixel" and min(size) == 1:
            raise ctx.error("pytorch_half_pixel with an output size of 1; supported: output sizes > 1")
        layer = ctx.new(Resize, size, method="bilinear", align_corners=transform == "align_corners")
    else:
        raise ctx.unsupported("mode", mode, "nearest, linear")
    return [ctx.layer(layer, x)]
