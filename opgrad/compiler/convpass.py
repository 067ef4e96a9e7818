"""Which algorithm computes a conv2d pass: the im2col GEMM or Winograd, by shape and setting."""

from __future__ import annotations

from opgrad.env import conv_algorithm_setting

from .conv import Conv2dGeometry, ConvEntry, emit_conv2d_backward_data, emit_conv2d_backward_weight, emit_conv2d_forward
from .irtext import ModuleEmitter
from .winograd import choose_tiles, emit_winograd, winograd_conv
from .winograd_weight import emit_winograd_weight

__all__ = ["emit_conv2d_pass"]


def emit_conv2d_pass(mod: ModuleEmitter, g: Conv2dGeometry, pass_: str, name: str) -> tuple[ConvEntry, str]:
    """One conv2d pass (``forward``, ``backward_data`` or ``backward_weight``) by the algorithm that
    ``$OPGRAD_CONV_ALGORITHM`` and the shapes choose; returns the entry and the algorithm's name."""
    setting = conv_algorithm_setting()
    problem = None if setting == "direct" else winograd_conv(g, pass_, require_gain=setting == "auto")
    if problem is not None and pass_ == "backward_weight":
        return emit_winograd_weight(mod, problem, name), "winograd F(3x3,2x2)"
    if problem is not None:
        tiles = choose_tiles(problem)
        return emit_winograd(mod, problem, name, tiles), f"winograd F({tiles.m},3)"
    emit = {"forward": emit_conv2d_forward, "backward_data": emit_conv2d_backward_data,
            "backward_weight": emit_conv2d_backward_weight}[pass_]
    return emit(mod, g, name), "direct"
