"""Which algorithm computes a conv2d pass: the im2col GEMM, Winograd (for backward-data, in the
correlation or the adjoint form) or the sliding window, by shape and setting."""

from __future__ import annotations

from dataclasses import dataclass

from opgrad.env import conv_algorithm_setting

from .conv import Conv2dGeometry, ConvEntry, emit_conv2d_backward_data, emit_conv2d_backward_weight, emit_conv2d_forward
from .gemm import Epilogue
from .irtext import ModuleEmitter
from .sliding import emit_sliding, sliding_applies, vector_lanes
from .views import body_vectorizes
from .winograd import (
    WinogradConv,
    WinogradTiles,
    accepts_epilogue,
    choose_tiles,
    emit_winograd,
    keeps_exact_zeros,
    winograd_conv,
)
from .winograd_adjoint import AdjointConv, emit_winograd_adjoint, prefers_adjoint
from .winograd_weight import emit_winograd_weight

__all__ = ["ConvPass", "accepts_prologue", "emit_conv2d_pass", "winograd_name"]


@dataclass(frozen=True)
class ConvPass:
    """One conv2d pass (``forward``, ``backward_data`` or ``backward_weight``) by the algorithm that
    ``$OPGRAD_CONV_ALGORITHM`` and the shapes choose, and the elementwise ``epilogue`` (one it
    :meth:`accepts`) it applies to its output, seen as the matrix (image, channel) x pixel,
    where each piece of it is finished; the epilogue's memory inputs follow the output among the
    entry's pointers."""

    geom: Conv2dGeometry
    pass_: str
    epilogue: Epilogue | None = None
    #: The weight gradient's dY computed from these inputs as it is read (:meth:`accepts_prologue`):
    #: a relu's gradient then never goes through memory. Its memory inputs take dY's place among
    #: the entry's pointers, the first where dY was, the others after the output.
    prologue: Epilogue | None = None
    #: With a prologue: also write each image's per-channel sum of dY, ``(N, O)``, after them.
    sums: bool = False

    @property
    def winograd(self) -> WinogradConv | None:
        setting = conv_algorithm_setting()
        if setting == "direct":
            return None
        return winograd_conv(self.geom, self.pass_, require_gain=setting == "auto")

    @property
    def adjoint(self) -> tuple[AdjointConv, WinogradTiles] | None:
        """The backward-data pass in the adjoint Winograd form (:mod:`.winograd_adjoint`) and its
        tiles, where Winograd applies and that form's estimate is below the correlation form's."""
        if self.pass_ != "backward_data" or self.winograd is None:
            return None
        return prefers_adjoint(self.geom, require_gain=conv_algorithm_setting() == "auto")

    @property
    def sliding(self) -> bool:
        """Whether the pass runs as a sliding window (:mod:`.sliding`): where Winograd does not
        apply, unless ``$OPGRAD_CONV_ALGORITHM`` asks for the im2col GEMM (``direct``)."""
        return conv_algorithm_setting() != "direct" and self.winograd is None and sliding_applies(self.geom, self.pass_)

    @property
    def algorithm(self) -> str:
        problem = self.winograd
        if problem is None:
            return "sliding window" if self.sliding else "direct"
        adjoint = self.adjoint
        if adjoint is not None:
            return winograd_name(self.pass_, adjoint[1], adjoint=True)
        return winograd_name(self.pass_, choose_tiles(problem, self.pass_))

    def accepts(self, epilogue: Epilogue) -> bool:
        """Whether the pass can apply ``epilogue`` to its output: the direct forward without groups
        (as its GEMM's epilogue), and the Winograd forward and backward-data passes where
        :func:`~.winograd.accepts_epilogue`."""
        if self.pass_ == "backward_weight":
            return False
        if self.winograd is not None:
            return accepts_epilogue(epilogue)
        return self.pass_ == "forward" and self.geom.groups == 1  # as the GEMM's or the sliding window's


def accepts_prologue(conv: ConvPass, prologue: Epilogue) -> bool:
    """Whether ``conv`` can compute its dY from ``prologue`` as it reads it: the sliding window's
    weight gradient (it reads each dY vector once per tap group), where the body is vector code."""
    return (conv.pass_ == "backward_weight" and conv.sliding and bool(prologue.operands)
            and body_vectorizes(prologue.body, conv.geom.dtype, vector_lanes(conv.geom.dtype), len(prologue.inputs)))


def winograd_name(pass_: str, tiles: WinogradTiles, adjoint: bool = False) -> str:
    """The algorithm's name in reports: F(m,3), F(3x3,mxm) for the weight gradient, ``adjoint
    F(m,3)`` for backward-data in the adjoint form."""
    m = tiles.m
    if pass_ == "backward_weight":
        return f"winograd F(3x3,{m}x{m})"
    return f"winograd adjoint F({m},3)" if adjoint else f"winograd F({m},3)"


def emit_conv2d_pass(mod: ModuleEmitter, conv: ConvPass, name: str) -> tuple[ConvEntry, str]:
    """Emit ``conv`` as ``name(first, second, out, e..., ws)``; returns the entry and the algorithm's name."""
    epilogue, problem, g = conv.epilogue, conv.winograd, conv.geom
    assert epilogue is None or conv.accepts(epilogue), f"{conv.pass_} by {conv.algorithm} cannot take this epilogue"
    if problem is not None:
        adjoint = conv.adjoint
        if adjoint is not None:
            return (emit_winograd_adjoint(mod, adjoint[0], name, adjoint[1], epilogue),
                    winograd_name(conv.pass_, adjoint[1], adjoint=True))
        tiles = choose_tiles(problem, conv.pass_)
        if conv.pass_ == "backward_weight":
            return emit_winograd_weight(mod, problem, name, tiles), winograd_name(conv.pass_, tiles)
        return (emit_winograd(mod, problem, name, tiles, epilogue, exact_zeros=keeps_exact_zeros(conv.pass_),
                              padding_is_data=conv.pass_ == "forward"), winograd_name(conv.pass_, tiles))
    assert conv.prologue is None or accepts_prologue(conv, conv.prologue), "only the sliding weight gradient " \
        "takes a prologue"
    if conv.sliding:
        return emit_sliding(mod, g, conv.pass_, name, epilogue, conv.prologue, conv.sums), "sliding window"
    if conv.pass_ == "forward":
        return emit_conv2d_forward(mod, g, name, epilogue), "direct"
    emit = {"backward_data": emit_conv2d_backward_data, "backward_weight": emit_conv2d_backward_weight}[conv.pass_]
    return emit(mod, g, name), "direct"
