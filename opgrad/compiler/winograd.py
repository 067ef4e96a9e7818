"""Winograd F(m, 3) kernels for 3x3 stride-1 conv2d: the forward and the backward-data pass, and
the pieces the weight gradient (:mod:`.winograd_weight`) shares with them.

A 3x3 correlation computed on ``alpha x alpha`` input tiles (``alpha = m + 2``) costs ``alpha**2``
products per ``m x m`` outputs instead of ``9 * m**2``: 2.25x fewer for F(2,3), 3.24x for F(3,3),
4x for F(4,3) (Lavin & Gray, "Fast Algorithms for Convolutional Neural Networks", 2016);
:func:`choose_tiles` weighs the products against the transforms per pass. Summed over input
channels, the products at one of the ``alpha**2`` tile positions form a GEMM:

* ``U[pos][o][c] = (G g G^T)[pos]``: the weights, transformed once per call;
* ``V[pos][c][t] = (B^T d B)[pos]``: the input tiles ``t`` of a block;
* ``M[pos] = U[pos] @ V[pos]``: ``alpha**2`` small GEMMs;
* the ``m x m`` outputs of tile ``t`` are ``A^T M[.][o][t] A``.

Backward-data of a stride-1 convolution is a forward convolution of dY by the weights with O and C
swapped and both taps reversed, padded by ``2 - pad``: the same kernel reading the weights through
other strides. Where dX is larger than dY (padding below 1) the adjoint form of
:mod:`.winograd_adjoint`, tiled over dY, does fewer products and takes the pass where its
estimate is lower (:func:`.winograd_adjoint.prefers_adjoint`).

Each task is one block of ``R`` tile rows of one image, run start to end by one thread with its
data in L1/L2: the block's input tiles of every channel are transformed into V (vectorized over
``VL`` neighbouring tiles of a row, from a zero-padded copy of the rows it reads, so no tap needs a
bounds check, in two separable passes staged in L1), the ``alpha**2`` small GEMMs run a
register-tiled microkernel on V and on U, which the weight transform writes already packed in
``MR``-row panels, and the output transform writes the block's outputs. Nothing large goes
through memory, and the blocks depend only on the shapes, so results are bitwise identical for
any thread count. A non-finite output sends the whole pass to a direct sum
(:func:`emit_guarded_entry`), which puts NaN and infinities where the reference does.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

from .conv import Conv2dGeometry, ConvEntry, output_matrix
from .gemm import (
    Blocking,
    Epilogue,
    RowInput,
    call_epilogue,
    emit_epilogue,
    has_vector_body,
    masked_store,
    round_up,
    tile_row_inputs,
)
from .irtext import (
    BYTES,
    LLVM_TYPE,
    FunctionEmitter,
    ModuleEmitter,
    concatenate,
    float_const,
    prefix_mask,
    splat_const,
)
from .target import cache_share, cache_size, current_target, host_target
from .threads import PARALLEL_FOR, PARALLEL_FOR_DECL, pool_size
from .views import VectorScalar

__all__ = [
    "ACCURACY_MARGIN",
    "BLOCK_BYTES",
    "F2X3",
    "F3X3",
    "F4X3",
    "F6X3",
    "FORWARD_MAX_TILE",
    "LEAN_TASK_ALPHA",
    "TILE_CHOICES",
    "WEIGHT_PARTIAL_BYTES",
    "LinearPlan",
    "Segment",
    "TileSource",
    "WinogradConv",
    "WinogradEmitter",
    "WinogradTiles",
    "accepts_epilogue",
    "block_budget",
    "choose_tiles",
    "combination_ops",
    "declare_helpers",
    "emit_guarded_entry",
    "emit_winograd",
    "estimated_cycles",
    "keeps_exact_zeros",
    "linear_plan",
    "parallel_task",
    "sandwich_ops",
    "thread_share",
    "tile_candidates",
    "transform_op_cycles",
    "winograd_conv",
]

#: Bytes of a block's V and M where the host's caches are not known (another target, no sysfs).
BLOCK_BYTES = 2 << 20
#: Largest partial sum of the weight gradient (16 x O x C values) kept per group of blocks.
WEIGHT_PARTIAL_BYTES = 1 << 20
#: Blocks run across images (:meth:`WinogradEmitter.spanning_rows`) where that takes at least
#: this share off the busiest thread's GEMM columns.
SPANNING_GAIN = 0.05
#: Share of L2 that one chunk of output channels' M may take (:meth:`WinogradEmitter.output_chunk_panels`).
OUTPUT_CHUNK_SHARE = 0.125
#: Fewer channels than this on either side leave the GEMMs too thin to win back the transforms.
MIN_CHANNELS = 8

Matrix = tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class WinogradTiles:
    """The transforms of F(m, 3): ``at`` is m x alpha, ``g`` alpha x 3, ``bt`` alpha x alpha."""

    m: int
    at: Matrix
    g: Matrix
    bt: Matrix

    @property
    def alpha(self) -> int:
        return self.m + 2


#: Interpolation points 0, 1, -1 and infinity: every transform coefficient is 0, +-1 or +-1/2.
F2X3 = WinogradTiles(
    2,
    at=((1, 1, 1, 0), (0, 1, -1, -1)),
    g=((1, 0, 0), (0.5, 0.5, 0.5), (0.5, -0.5, 0.5), (0, 0, 1)),
    bt=((1, 0, -1, 0), (0, 1, 1, 0), (0, -1, 1, 0), (0, 1, 0, -1)),
)

#: Points 0, +-1, 2 and infinity: 1.44x fewer products than F(2,3) with coefficients up to 4, and
#: an odd tile that fits outputs of 3k pixels (24 = 8 tiles) without a ragged edge.
F3X3 = WinogradTiles(
    3,
    at=((1, 1, 1, 1, 0), (0, 1, -1, 2, 0), (0, 1, 1, 4, 1)),
    g=((1 / 2, 0, 0), (-1 / 2, -1 / 2, -1 / 2), (-1 / 6, 1 / 6, -1 / 6), (1 / 6, 1 / 3, 2 / 3), (0, 0, 1)),
    bt=((2, -1, -2, 1, 0), (0, -2, -1, 1, 0), (0, 2, -3, 1, 0), (0, -1, 0, 1, 0), (0, 2, -1, -2, 1)),
)

#: Points 0, +-1, +-2 and infinity: 4x fewer products, at the price of coefficients up to 8 that
#: cost about one decimal digit of float32 accuracy against the direct sum.
F4X3 = WinogradTiles(
    4,
    at=((1, 1, 1, 1, 1, 0), (0, 1, -1, 2, -2, 0), (0, 1, 1, 4, 4, 0), (0, 1, -1, 8, -8, 1)),
    g=((1 / 4, 0, 0), (-1 / 6, -1 / 6, -1 / 6), (-1 / 6, 1 / 6, -1 / 6), (1 / 24, 1 / 12, 1 / 6),
       (1 / 24, -1 / 12, 1 / 6), (0, 0, 1)),
    bt=((4, 0, -5, 0, 1, 0), (0, -4, -4, 1, 1, 0), (0, 4, -4, -1, 1, 0), (0, -2, -1, 2, 1, 0),
        (0, 2, -1, -2, 1, 0), (0, 4, 0, -5, 0, 1)),
)


@dataclass(frozen=True)
class WinogradConv:
    """``y[n, o] = sum_c x[n, c] (*) w'[o, c]``: a 3x3 stride-1 correlation with zero padding ``top``/``left``
    (the bottom and right padding follow from ``oh``/``ow``). Tap ``(kh, kw)`` of ``w'[o, c]`` is the
    weight element at ``weight_base + o*s0 + c*s1 + kh*s2 + kw*s3`` for ``weight_strides = (s0..s3)``."""

    n: int
    cin: int
    h: int
    w: int
    cout: int
    oh: int
    ow: int
    top: int
    left: int
    weight_strides: tuple[int, int, int, int]
    weight_base: int
    dtype: str


@dataclass(frozen=True)
class TileSource:
    """Where a block's tiles come from: ``channels`` planes of ``h x w``, placed at ``top``/``left``
    in a zero plane of ``plane_rows x plane_cols``; each tile reads ``size x size`` values and
    tiles start ``m`` apart."""

    channels: int
    h: int
    w: int
    top: int
    left: int
    size: int
    plane_rows: int
    plane_cols: int


@dataclass(frozen=True)
class Segment:
    """One image's part of a block (IR values): ``rows`` tile rows of image ``image`` from tile row
    ``ty0``, at tile row ``offset`` of the block's columns (V and M) and of its field mask."""

    image: str
    ty0: str
    rows: str
    offset: str


def winograd_conv(g: Conv2dGeometry, pass_: str, require_gain: bool = True) -> WinogradConv | None:
    """The Winograd form of a conv2d pass, or None where it does not apply: 3x3 kernels at stride 1
    without dilation or groups, padding of at most 2.
    ``require_gain`` also asks for :data:`MIN_CHANNELS` channels on both sides, below which the
    GEMMs are too thin to pay for the transforms."""
    if (g.kh, g.kw) != (3, 3) or g.stride != (1, 1) or g.dilation != (1, 1) or g.groups != 1:
        return None
    if max(g.pads) > 2:
        return None
    if require_gain:
        # Thin GEMMs, or outputs so small that padding them to whole tiles costs more products
        # than the direct sum (a 3x3 output takes 4 tiles: 64 products against 81).
        out_h, out_w = (g.h, g.w) if pass_ == "backward_data" else (g.oh, g.ow)  # the 2x2-tiled plane
        tiles, pixels = -(-out_h // 2) * -(-out_w // 2), out_h * out_w
        if min(g.c, g.o) < MIN_CHANNELS or 16 * tiles > 0.75 * 9 * pixels:
            return None
    if pass_ == "forward":
        return WinogradConv(g.n, g.c, g.h, g.w, g.o, g.oh, g.ow, g.pads[0], g.pads[2], (g.c * 9, 9, 3, 1), 0,
                            g.dtype)
    if pass_ == "backward_weight":
        # Each group of blocks keeps its own 16 x O x C partial sums (winograd_weight.py); beyond
        # this the direct GEMM, which needs no such buffer, is the better trade.
        if 16 * g.o * g.c * BYTES[g.dtype] > WEIGHT_PARTIAL_BYTES:
            return None
        # dW[o, c] = sum_n dy[n, o] (*) x[n, c]: stored where the forward reads w'[o, c].
        return WinogradConv(g.n, g.c, g.h, g.w, g.o, g.oh, g.ow, g.pads[0], g.pads[2], (g.c * 9, 9, 3, 1), 0,
                            g.dtype)
    if pass_ == "backward_data":
        # dx[n, c] = sum_o dy[n, o] (*) W[o, c] reversed in both taps, padded by 2 - pad.
        return WinogradConv(g.n, g.o, g.oh, g.ow, g.c, g.h, g.w, 2 - g.pads[0], 2 - g.pads[2], (9, g.c * 9, -3, -1),
                            8, g.dtype)
    return None


def accepts_epilogue(epilogue: Epilogue) -> bool:
    """Whether a Winograd block applies ``epilogue`` to its outputs: only where its memory inputs
    hold one value per (image, channel) (a bias, a scale). A block's outputs are a few rows of
    every channel, so an input that varies along the pixels is read as one short run per channel,
    and measured (AMD EPYC Zen 3; again on Zen 5 for the seed CNN's conv2 backward-data and the
    relu gradient of conv1, 4.03 against 4.09 ms a step) a relu gradient read that way cost as
    much in the block as its own pass over the whole tensor does: it keeps its pass, which streams."""
    return all(not any(x.cols.strides) for x in epilogue.operands)


#: Points 0, +-1, +-2, +-1/2 and infinity (NNPACK's float32 choice): 64 products per 36 outputs,
#: 5.1x fewer than the direct sum and 21 % fewer than F(4,3), with coefficients up to 32 that
#: cost about three times F(4,3)'s float32 error (median 3e-6 of the largest output over 32
#: channels against 1e-6).
F6X3 = WinogradTiles(
    6,
    at=((1, 1, 1, 1, 1, 1, 1, 0), (0, 1, -1, 2, -2, 1 / 2, -1 / 2, 0), (0, 1, 1, 4, 4, 1 / 4, 1 / 4, 0),
        (0, 1, -1, 8, -8, 1 / 8, -1 / 8, 0), (0, 1, 1, 16, 16, 1 / 16, 1 / 16, 0),
        (0, 1, -1, 32, -32, 1 / 32, -1 / 32, 1)),
    g=((1, 0, 0), (-2 / 9, -2 / 9, -2 / 9), (-2 / 9, 2 / 9, -2 / 9), (1 / 90, 1 / 45, 2 / 45),
       (1 / 90, -1 / 45, 2 / 45), (32 / 45, 16 / 45, 8 / 45), (32 / 45, -16 / 45, 8 / 45), (0, 0, 1)),
    bt=((1, 0, -21 / 4, 0, 21 / 4, 0, -1, 0), (0, 1, 1, -17 / 4, -17 / 4, 1, 1, 0),
        (0, -1, 1, 17 / 4, -17 / 4, -1, 1, 0), (0, 1 / 2, 1 / 4, -5 / 2, -5 / 4, 2, 1, 0),
        (0, -1 / 2, 1 / 4, 5 / 2, -5 / 4, -2, 1, 0), (0, 2, 4, -5 / 2, -5, 1 / 2, 1, 0),
        (0, -2, 4, 5 / 2, -5, -1 / 2, 1, 0), (0, -1, 0, 21 / 4, 0, -21 / 4, 0, 1)),
)

#: The candidates :func:`choose_tiles` weighs, the most accurate first.
TILE_CHOICES = (F2X3, F3X3, F4X3, F6X3)
#: Cycles per vector FMA of the GEMMs (two FMA pipes, about 93 % busy) and per vector operation of
#: the transforms' arithmetic as :func:`linear_plan` emits it (each counted operation stands for its
#: share of the loads, shuffles and stores, and with 16 vector registers of the 5x5 or 6x6 spills,
#: which take most of the time there). Fitted with 16 registers on AMD Zen 3 (AVX2) over F(2,3),
#: F(3,3) and F(4,3) of five layers from 6x6 to 56x56 outputs, and with 32 on AMD Zen 5 (AVX-512)
#: over the three tiles of the seed CNN's conv2 forward and backward-data passes, where nothing
#: spills and the transforms cost a fifth as much against the FMAs: there F(3,3) runs the forward
#: 19 % and the weight gradient 21 % faster than F(2,3), which the 16-register figure would pick.
GEMM_FMA_CYCLES = 0.54
TRANSFORM_OP_CYCLES = {16: 1.9, 32: 0.38}
#: Cycles per byte of the weight gradient's partial sums that each block loads and stores back
#: (alpha**2 x O x C of them, whatever the block's tile count): a 7x7 image has 4 tiles by F(4,3)
#: against 16 by F(2,3), so F(4,3)'s 2.25 times larger sums are read and written for a quarter of
#: the products. Fitted on AMD Zen 5 over the three tiles of a 64-channel 7x7 layer (F(2,3) 0.216,
#: F(3,3) 0.247, F(4,3) 0.247 ms at batch 32, 2 threads), where the products alone chose F(4,3);
#: it keeps F(4,3) for the seed CNN's conv2 and the 14x14 and 28x28 layers, measured fastest there.
PARTIAL_SUM_BYTE_CYCLES = 0.045
#: A larger tile must be estimated this much cheaper to be worth its lost float32 accuracy.
ACCURACY_MARGIN = 0.05


def choose_tiles(p: WinogradConv, pass_: str) -> WinogradTiles:
    """The tiles for one pass of ``p``: the candidate with the fewest estimated cycles
    (:func:`estimated_cycles`), unless a more accurate one is within :data:`ACCURACY_MARGIN`
    (F(2,3) keeps about 3e-7 of the largest output, F(3,3) 1e-6, F(4,3) 3e-6), among
    :func:`tile_candidates`.

    The forward pass counts the cost of keeping exact zeros: an F(2,3) output reads transforms of
    its own 3x3 inputs only, so over all-zero inputs it is exactly zero, as in the direct sum.
    Larger tiles mix neighbouring inputs into every output and leave rounding noise (1e-9) there,
    which a relu passes and a max pool routes the gradient to, where the reference (and PyTorch)
    see a dead unit: the Keras MNIST model's conv2 bias gradient moved by 35 % that way on zero
    background. Their forward pass zeroes such outputs (:meth:`WinogradEmitter.field_mask`)."""
    exact_zeros = keeps_exact_zeros(pass_)
    candidates = tile_candidates(p, pass_)
    best = candidates[0]
    reduces_tiles = pass_ == "backward_weight"
    best_cost = estimated_cycles(p, best, exact_zeros, reduces_tiles)
    for tiles in candidates[1:]:
        cost = estimated_cycles(p, tiles, exact_zeros, reduces_tiles)
        if cost < (1 - ACCURACY_MARGIN) * best_cost:
            best, best_cost = tiles, cost
    return best


def keeps_exact_zeros(pass_: str) -> bool:
    """Whether ``pass_`` stores exactly 0 where every input is zero (:func:`choose_tiles` says why):
    the forward pass, whose outputs relu and max pooling decide on."""
    return pass_ == "forward"


#: Tiles this large or larger compile the tasks that transform, multiply and transform back in
#: one function with the lean pipeline (:meth:`WinogradEmitter.block_pipeline`): register-tiled
#: code that no compile worker can split, by F(6,3) 567-696 KB of IR for the seed CNN's conv2
#: backward passes (F(3,3), F(4,3): 190-310 KB). Under O2 they took 0.41-0.51 s each to compile
#: and made the step's cold compile 1.3-1.6 s, where it must stay under 1.5; lean, 0.28 s each,
#: and they ran as fast (AMD EPYC Zen 4, 2 threads, builds taking turns: backward-data 1.11-1.33
#: ms either way, weight gradient 1.22-1.39 against 1.29-1.39).
LEAN_TASK_ALPHA = 8

#: The largest output tile of the forward pass. Its outputs are the activations that relu and
#: max pooling decide on and the loss is computed from, and F(6,3)'s float32 error (about ten
#: times F(3,3)'s) moved a 20-step SGD run of the seed CNN 4e-5 off the reference's losses,
#: where F(3,3) and F(4,3) stay within 2e-7; in the backward passes it moved the Keras MNIST
#: model's Adam run 3e-6 and the seed CNN's not at all.
FORWARD_MAX_TILE = 4


def tile_candidates(p: WinogradConv, pass_: str) -> list[WinogradTiles]:
    """The tiles :func:`choose_tiles` weighs for one pass of ``p``, the most accurate first: for
    the forward pass up to F(:data:`FORWARD_MAX_TILE`, 3); for the weight gradient, those whose
    (m+2)**2 x O x C partial sums per group fit :data:`WEIGHT_PARTIAL_BYTES`."""
    if pass_ == "backward_weight":
        return [t for t in TILE_CHOICES if t.alpha**2 * p.cout * p.cin * BYTES[p.dtype] <= WEIGHT_PARTIAL_BYTES]
    if pass_ == "forward":
        return [t for t in TILE_CHOICES if t.m <= FORWARD_MAX_TILE]
    return list(TILE_CHOICES)


def estimated_cycles(p: WinogradConv, tiles: WinogradTiles, exact_zeros: bool = False,
                     reduces_tiles: bool = False) -> float:
    """Cycles the blocks of one image take by ``tiles``: the GEMMs' vector FMAs over the columns the
    blocks really multiply, plus the vector operations of the input and output transforms over the
    runs of ``VL`` tiles they really transform (a row of 9 tiles is two runs of 8 lanes), plus,
    with ``exact_zeros``, those that keep exact zeros (:meth:`WinogradEmitter.field_mask`). The
    weight gradient does the same products and transforms the same tiles of its two inputs, so
    one estimate serves the three passes, but its GEMMs sum over the tiles (``reduces_tiles``):
    they multiply each real tile once, where the other passes' GEMMs run over a block's tiles
    rounded up to whole vectors of columns. Counted as columns, the seed CNN's conv2 weight
    gradient by F(4,3) (36 tiles an image, 48 columns) looked 11 % dearer than by F(3,3) (64
    tiles, 64 columns), where on AMD Zen 5 it ran 10 % faster (2 threads, 0.644 against 0.712 ms).
    Each of its blocks also loads and stores its partial sums (:data:`PARTIAL_SUM_BYTE_CYCLES`).

    Blocks are counted within one image, the layout the costs are fitted on; blocks across
    images (:meth:`WinogradEmitter.spanning_rows`) then fill the chosen tiles' columns. Counted
    with them, F(4,3) would take the seed CNN's conv2 forward as 11 % cheaper than F(3,3), where
    it ran no faster (AMD Zen 5, 0.70 against 0.69 ms) and is less accurate."""
    e = WinogradEmitter(ModuleEmitter("estimate"), p, tiles, exact_zeros=exact_zeros, spans_images=False)
    alpha, m, vl = tiles.alpha, tiles.m, e.vl
    columns = e.th * e.tw if reduces_tiles else (e.blocks - 1) * e.cols + round_up(e.tail_rows * e.tw, vl)
    fmas = alpha**2 * e.cout_pad * p.cin * columns // vl
    runs = -(-e.tw // e.row_lanes) * -(-e.th // e.pack)
    loads = -(-alpha // m) * alpha + alpha**2  # wide loads and their phase shuffles
    # The input transform's first pass runs once per plane row, which tile rows overlap on, or
    # with packed rows once per row of the tile for the run.
    first_pass = m + (alpha - m) / e.rows if e.pack == 1 else alpha
    per_input = loads + linear_plan(tiles.bt).ops * (first_pass + alpha) + alpha**2
    # A load of M per position, and a lane shuffle where packed rows sit tw apart
    # (:meth:`WinogradEmitter.from_columns`); each of the m output rows: interleave, store and
    # the non-finite watch.
    shifted = e.pack > 1 and e.tw != e.row_lanes
    per_output = (2 if shifted else 1) * alpha**2 + sandwich_ops(tiles.at, alpha) + m * (2 * m + 3)
    ops = runs * (p.cin * per_input + p.cout * per_output)
    partials = e.blocks * alpha**2 * e.cout_pad * p.cin * BYTES[p.dtype] if reduces_tiles else 0
    if e.exact_zeros:
        # Per block and channel, a load, an and, an or and a store per vector of the plane; per
        # output row stored, a load, a compare and a select; per block, the 3x3 window's union.
        plane_vectors = -(-e.hp * e.wp // vl)
        ops += e.blocks * (4 * p.cin * plane_vectors + 18 * m * e.rows * e.mask_cols // vl)
        ops += runs * p.cout * 3 * m
    return GEMM_FMA_CYCLES * fmas + transform_op_cycles() * ops + PARTIAL_SUM_BYTE_CYCLES * partials


def transform_op_cycles() -> float:
    """:data:`TRANSFORM_OP_CYCLES` for the target's vector register count (the nearest fitted)."""
    registers = current_target().vector_registers
    return TRANSFORM_OP_CYCLES[min(TRANSFORM_OP_CYCLES, key=lambda fitted: abs(fitted - registers))]


def sandwich_ops(matrix: Matrix, columns: int) -> int:
    """Vector operations of ``matrix @ d @ matrix^T`` for a ``len(matrix[0]) x columns`` grid ``d``, as
    :meth:`WinogradEmitter.outputs` emits them: :func:`linear_plan`'s operations once per column of
    ``d``, then once per row of the product."""
    ops = linear_plan(matrix).ops
    return ops * columns + ops * len(matrix)


#: One term of a linear combination: a coefficient and a source, either input ``i`` of the
#: product or (numbered from ``len(inputs)`` on) one of the plan's shared sums.
Term = tuple[float, int]


@dataclass(frozen=True)
class LinearPlan:
    """``matrix @ x`` for a vector ``x`` as shared sums, then one combination per row.

    The interpolation points of a Winograd tile come in pairs ``+-p``, so its matrices share sums
    two ways. Two columns that every row weighs equally or oppositely (A^T's columns for ``+-p``)
    are summed and differenced once: ``x_j + x_k`` and ``x_j - x_k`` then serve every row. Two rows
    that agree on some columns and differ in sign on the rest (B^T's rows for ``+-p``) are ``E + O``
    and ``E - O``, with ``E`` and ``O`` the sums over those columns. F(4,3)'s input transform drops
    from 22 operations per column to 12 that way, its output transform from 14 to 10.
    ``shared[k]`` is source ``len(x) + k`` and may read earlier shared sums; each row lists its
    terms, the first emitted plainly, the rest as adds, subtracts or FMAs."""

    shared: tuple[tuple[Term, ...], ...]
    rows: tuple[tuple[Term, ...], ...]

    @property
    def ops(self) -> int:
        return sum(combination_ops(terms) for terms in (*self.shared, *self.rows))


def combination_ops(terms: tuple[Term, ...] | list[Term]) -> int:
    """Operations :meth:`WinogradEmitter.lincomb` spends on ``terms``: one per term after the first,
    and one for the first unless some coefficient is +1 (that term goes first, as it is)."""
    if not terms:
        return 0
    return len(terms) - 1 + (0 if any(c == 1 for c, _ in terms) else 1)


def _factored(group: list[Term]) -> tuple[float, list[Term]]:
    """``group`` as ``factor * sum(terms)`` with the factor that makes the sum cheapest: pulling a
    common magnitude out turns the group's first product into a plain value, and the factor
    rides on the FMA that adds the group to a row. Only exact factorings count."""
    best: tuple[float, list[Term]] = (1.0, group)
    for factor in sorted({abs(c) for c, _ in group}):
        terms = [(c / factor, src) for c, src in group]
        if all((c / factor) * factor == c for c, _ in group) and \
                combination_ops(terms) < combination_ops(best[1]):
            best = (factor, terms)
    return best


#: A row of a matrix being planned: coefficient by source, zeros left out.
Row = dict[int, float]


def _terms(row: Row) -> list[Term]:
    return [(c, src) for src, c in sorted(row.items()) if c != 0]


def _column_pair_saving(rows: list[Row], j: int, k: int) -> int:
    """Operations saved by summing and differencing sources ``j`` and ``k`` once for all rows."""
    plus = sum(1 for r in rows if r.get(j, 0) != 0 and r.get(j) == r.get(k))
    minus = sum(1 for r in rows if r.get(j, 0) != 0 and r.get(j) == -r.get(k, 0))
    return max(plus - 1, 0) + max(minus - 1, 0)


def _pair_columns(rows: list[Row], j: int, k: int, shared: list[list[Term]], first_shared: int) -> None:
    """Rewrite ``rows`` to read ``x_j + x_k`` and ``x_j - x_k`` (new shared sums) where they can."""
    for sign in (1.0, -1.0):
        users = [r for r in rows if r.get(j, 0) != 0 and r.get(j) == sign * r.get(k, 0)]
        if len(users) < 2:
            continue
        source = first_shared + len(shared)
        shared.append([(1.0, j), (sign, k)])
        for r in users:
            r[source] = r.pop(j)
            del r[k]


def _paired(row_a: Row, row_b: Row, first_shared: int) -> tuple[list[list[Term]], Row, Row] | None:
    """Rows ``a`` and ``b`` through the sums of their agreeing and opposing sources: the new shared
    sums (sources from ``first_shared``) and the two rows rewritten, or None without both kinds."""
    both = sorted(set(row_a) & set(row_b))
    agree = [(row_a[j], j) for j in both if row_a[j] != 0 and row_a[j] == row_b[j]]
    oppose = [(row_a[j], j) for j in both if row_a[j] != 0 and row_a[j] == -row_b[j]]
    if not agree or not oppose:
        return None
    grouped = {j for _, j in agree + oppose}
    new_a = {j: c for j, c in row_a.items() if j not in grouped}
    new_b = {j: c for j, c in row_b.items() if j not in grouped}
    shared: list[list[Term]] = []
    for group, sign in ((agree, 1.0), (oppose, -1.0)):
        if len(group) == 1:  # a single term needs no shared sum
            (c, j), = group
            new_a[j], new_b[j] = c, sign * c
            continue
        factor, terms = _factored(group)
        src = first_shared + len(shared)
        new_a[src], new_b[src] = factor, sign * factor
        shared.append(terms)
    return shared, new_a, new_b


@functools.cache
def linear_plan(matrix: Matrix) -> LinearPlan:
    """A cheap evaluation of ``matrix @ x`` (:class:`LinearPlan`): row pairs alone, or column pairs
    first and then row pairs, whichever needs fewer operations (pairing two columns can break a
    better pairing of rows). Each pass takes greedily the pair that saves most operations; rows
    that no pairing makes cheaper stay plain sums."""
    return min((_planned(matrix, pair_columns) for pair_columns in (False, True)), key=lambda plan: plan.ops)


def _planned(matrix: Matrix, pair_columns: bool) -> LinearPlan:
    inputs = len(matrix[0])
    rows: list[Row] = [{j: c for j, c in enumerate(row) if c != 0} for row in matrix]
    shared: list[list[Term]] = []
    while pair_columns:
        savings = [(_column_pair_saving(rows, j, k), j, k) for j in range(inputs) for k in range(j + 1, inputs)]
        saved, j, k = max(savings, default=(0, 0, 0), key=lambda item: item[0])
        if saved <= 0:
            break
        _pair_columns(rows, j, k, shared, inputs)
    unpaired = set(range(len(rows)))
    while True:
        best = None
        for a in sorted(unpaired):
            for b in sorted(unpaired - set(range(a + 1))):
                pairing = _paired(rows[a], rows[b], inputs + len(shared))
                if pairing is None:
                    continue
                new_shared, new_a, new_b = pairing
                saved = combination_ops(_terms(rows[a])) + combination_ops(_terms(rows[b])) \
                    - combination_ops(_terms(new_a)) - combination_ops(_terms(new_b)) \
                    - sum(combination_ops(g) for g in new_shared)
                if saved > 0 and (best is None or saved > best[0]):
                    best = (saved, a, b, pairing)
        if best is None:
            break
        _, a, b, (new_shared, rows[a], rows[b]) = best
        shared.extend(new_shared)
        unpaired -= {a, b}
    return LinearPlan(tuple(tuple(g) for g in shared), tuple(tuple(_terms(r)) for r in rows))


class WinogradEmitter:
    """Shared emission state of one Winograd kernel: types, vector width and constants."""

    def __init__(self, mod: ModuleEmitter, p: WinogradConv, tiles: WinogradTiles,
                 epilogue: Epilogue | None = None, exact_zeros: bool = False, spans_images: bool = True) -> None:
        self.mod, self.p, self.tiles = mod, p, tiles
        #: Outputs whose 3x3 inputs are all zero are stored as exactly 0 (:meth:`field_mask`):
        #: needed by tiles larger than F(2,3), whose other inputs leave rounding noise there.
        self.exact_zeros = exact_zeros and tiles.m > 2
        self.field_mask_ptr = ""
        #: This thread's L1 staging of the separable transforms (:meth:`transform_runs`, :meth:`outputs`).
        self.row_staging = ""
        #: Applied to each output row in registers before its store where its body has a vector
        #: form (:attr:`epilogue_in_registers`), else to each block's outputs once they are stored;
        #: after a fallback to the direct sum, to all outputs.
        self.epilogue = epilogue
        self.epilogue_fn = ""
        #: The block task's vector of ``x - x`` sums over every output it stores (NaN: non-finite).
        self.sentinel = ""
        self.t = LLVM_TYPE[p.dtype]
        self.esize = BYTES[p.dtype]
        self.vl = current_target().vector_width(self.esize)
        self.vt = f"<{self.vl} x {self.t}>"
        self.alpha = tiles.alpha
        self.th = -(-p.oh // tiles.m)
        self.tw = -(-p.ow // tiles.m)
        #: Tile rows that share one vector of the transforms (``pack``), ``row_lanes`` lanes each
        #: (:meth:`row_packing`).
        self.pack, self.row_lanes = self.row_packing()
        # In registers each operand is read once per (image, channel): one that varies along the
        # pixels takes the pass over the stored outputs, which reads it pixel by pixel.
        self.epilogue_in_registers = (epilogue is not None and accepts_epilogue(epilogue)
                                      and has_vector_body(epilogue, p.dtype, tiles.m * self.row_lanes))
        blk = Blocking.for_target(p.dtype)
        # The register tile keeps the GEMM engine's accumulator count (MR x NR/VL) but takes a
        # height that divides the output channels where one exists, so no GEMM rows are padding.
        accumulators = blk.mr * blk.nr // self.vl
        self.mr = next((mr for mr in range(8, 3, -1) if p.cout % mr == 0 and accumulators // mr >= 2), blk.mr)
        self.cout_pad = round_up(p.cout, self.mr)
        self.rows = self.block_rows()
        self.blocks = -(-self.th // self.rows)
        #: Tile rows of an image's last block: its transforms and GEMMs cover only those.
        self.tail_rows = self.th - (self.blocks - 1) * self.rows
        #: Blocks take consecutive tile rows of the batch, across images (:meth:`spanning_rows`):
        #: then ``rows`` and ``tail_rows`` count the batch's tile rows and ``blocks`` the batch's
        #: blocks. A block transforms and stores each image it touches as one segment.
        self.spans = False
        spanning = self.spanning_rows() if spans_images else None
        if spanning is not None:
            self.spans, self.rows = True, spanning
            self.blocks = -(-p.n * self.th // self.rows)
            self.tail_rows = p.n * self.th - (self.blocks - 1) * self.rows
        #: Tile rows of one image a block transforms at once: its plane and staging hold those.
        self.segment_rows = min(self.rows, self.th)
        #: GEMM columns of a block (tiles, rounded to whole vectors) and the row stride of V and M,
        #: one vector longer: a row's last transform chunk spills into the next row's columns
        #: before that row overwrites them, and past the end into the spare vector.
        self.cols = round_up(self.rows * self.tw, self.vl)
        self.nvec = min(accumulators // self.mr, self.cols // self.vl)
        self.stride = self.row_stride(self.rows)
        self.v_pos = self.position_elements(p.cin, self.rows)
        #: Panels of output channels whose GEMMs and output transform run together
        #: (:meth:`output_chunk_panels`); M holds one such chunk.
        self.chunk_panels = self.output_chunk_panels()
        self.m_pos = self.position_elements(self.chunk_panels * self.mr, self.rows)
        self.wp = tiles.m * round_up(self.tw, self.vl) + self.alpha - 1
        self.hp = tiles.m * round_up(self.segment_rows, self.pack) + 2
        self.it = "i32" if self.esize == 4 else "i64"
        #: Row stride of the field mask: every column a block's output transform stores.
        self.mask_cols = tiles.m * round_up(self.tw, self.vl)

    def row_packing(self) -> tuple[int, int]:
        """``(G, L)``: the transforms run ``G`` tile rows side by side in one vector, ``L = VL / G``
        lanes each, where a row's tiles fit in half a vector or less. A 24-pixel row is 8 F(3,3)
        tiles: on 16 lanes (AVX-512) one row per vector leaves half of every transform operation
        idle, two rows fill it. ``L`` keeps whole 16-byte lanes, which :meth:`tile_columns` loads
        a row's tiles by."""
        per_lane = 16 // self.esize
        if self.vl % per_lane or per_lane not in (2, 4):
            return 1, self.vl
        lanes = self.vl
        while lanes // 2 >= max(self.tw, per_lane):
            lanes //= 2
        return self.vl // lanes, lanes

    def packed_runs(self, f: FunctionEmitter, rows: str) -> str:
        """Vectors of :attr:`pack` tile rows that cover ``rows`` tile rows."""
        return f.val(f"udiv i64 {f.add(rows, self.pack - 1)}, {self.pack}", "runs")

    def run_positions(self) -> list[int | None]:
        """For each column from a run's first (tile row ``r``, stored at ``r * tw``), the tile slot
        of the packed vector that lands there: packed row ``g``'s slots start at column ``g * tw``,
        where they overwrite the slots of row ``g - 1`` past its tiles; None past the last row's."""
        positions: list[int | None] = [None] * self.vl
        for g in range(self.pack):
            for i in range(self.row_lanes):
                positions[g * self.tw + i] = g * self.row_lanes + i
        return positions

    @property
    def whole_loads(self) -> bool:
        """:meth:`tile_columns` reads whole vectors of consecutive tiles (a tile is one 16-byte
        lane wide, and a vector's tiles lie in one packed row); the lanes of a transformed vector
        then hold the tiles in the order :meth:`lane_slots` gives."""
        per_lane = 16 // self.esize
        return (self.tiles.m == per_lane and per_lane in (2, 4) and self.vl % per_lane == 0
                and self.row_lanes % (self.vl // per_lane) == 0)

    @property
    def strided_picks(self) -> bool:
        """:meth:`tile_columns` picks every ``m``-th element of whole-row loads (not 16-byte lanes):
        where vectors are not whole 16-byte lanes, and with 64-byte vectors (AVX-512), whose
        two-source permutes pick a column from four vectors in two or three instructions."""
        per_lane = 16 // self.esize
        return not self.whole_loads and (self.vl % per_lane != 0 or per_lane not in (2, 4)
                                         or self.vl * self.esize >= 64)

    def lane_slots(self) -> list[int]:
        """The tile slot (``g * row_lanes + i``: tile ``i`` of packed row ``g``) that each lane of a
        transformed vector holds: lane ``e`` holds slot ``e``, or with :attr:`whole_loads` slot
        ``(e % P) * (VL / P) + e // P`` for ``P`` elements per 16-byte lane."""
        vl = self.vl
        if not self.whole_loads:
            return list(range(vl))
        per_lane = 16 // self.esize
        return [(e % per_lane) * (vl // per_lane) + e // per_lane for e in range(vl)]

    def to_columns(self, f: FunctionEmitter, value: str) -> str:
        """A transform vector as one run of V's columns (:meth:`run_positions`), its lanes in tile
        order (:meth:`lane_slots`): one store instead of one per packed row. The lanes past the last
        row's tiles are undefined; they land in columns that a later run, segment or the row's
        spare vector takes."""
        slots = self.lane_slots()
        if slots == list(range(self.vl)) and (self.pack == 1 or self.tw == self.row_lanes):
            return value
        lane_of = {slot: lane for lane, slot in enumerate(slots)}
        lanes = ", ".join("i32 undef" if slot is None else f"i32 {lane_of[slot]}" for slot in self.run_positions())
        return f.val(f"shufflevector {self.vt} {value}, {self.vt} poison, <{self.vl} x i32> <{lanes}>", "tc")

    def from_columns(self, f: FunctionEmitter, value: str) -> str:
        """One run of M's columns (``VL`` from the run's first) as a packed vector: the inverse of
        :meth:`to_columns`, one load instead of one per packed row."""
        if self.pack == 1 or self.tw == self.row_lanes:
            return value
        lanes = ", ".join(f"i32 {g * self.tw + i}" for g in range(self.pack) for i in range(self.row_lanes))
        return f.val(f"shufflevector {self.vt} {value}, {self.vt} poison, <{self.vl} x i32> <{lanes}>", "fc")

    def block_rows(self) -> int:
        """Tile rows per block: the count whose GEMM columns (each block's tiles, the last block's
        fewer, rounded to whole vectors) waste least, preferring more rows, among those whose V and
        M fit :func:`block_budget`.

        Every block reads all of U (the transformed weights, ``alpha**2 x O x C``) and pays its
        halo rows and a partial last block, so blocks are as large as stay on chip: measured on
        AMD Zen 3 (L2 512 KiB), one block of a whole 24 x 24 image (V and M 0.7 MiB) ran the seed
        CNN's conv2 forward 7 % faster than two."""
        def waste(rows: int) -> float:
            full, tail = divmod(self.th, rows)
            return (full * round_up(rows * self.tw, self.vl) + round_up(tail * self.tw, self.vl)) / (self.th * self.tw)

        budget = block_budget()
        limit = max([1] + [rows for rows in range(1, self.th + 1) if self.block_bytes(rows) <= budget])
        return min(range(1, limit + 1), key=lambda rows: (waste(rows), -rows))

    def block_bytes(self, rows: int) -> int:
        """Bytes of V and M of a block of ``rows`` tile rows."""
        elements = self.position_elements(self.p.cin, rows) + self.position_elements(self.cout_pad, rows)
        return self.alpha**2 * elements * self.esize

    def spanning_rows(self) -> int | None:
        """Tile rows per block where blocks run across images, or None where blocks within one
        image do as well.

        A block's tiles are the GEMMs' columns, rounded to whole vectors: a 26 x 26 output is 7 x 7
        F(4,3) tiles, 49 columns in 64, and a 7 x 7 output's 2 x 2 tiles fill a quarter of 16
        lanes. Blocks of the batch's consecutive tile rows fill them (16 rows of 7 tiles are 112
        columns, 7 whole vectors). The choice minimizes the columns of the busiest thread under
        the blocks' even split over the pool's threads, among blocks within :func:`block_budget`,
        and is taken where that is at least :data:`SPANNING_GAIN` below blocks within images.
        Among equals it takes the size nearest (in ratio) to the blocks within images, which
        :meth:`block_rows` sized for the caches: on one thread, blocks of 16 and 32 rows both
        fill whole vectors, and 16 (1.8 MiB) ran the seed's conv2 backward-data 4 % faster than
        32 (3.5 MiB) on AMD Zen 5 (L2 1 MiB), as on two threads (0.81 against 0.92 ms).
        The GEMMs sum each column over the channels in the same order wherever it lies, so the
        results do not depend on the blocks."""
        threads = pool_size() if current_target() == host_target() else 1
        total = self.p.n * self.th

        def busiest(rows: int, count: int, tail_rows: int, per_image: int) -> int:
            """Columns of the busiest thread over ``count`` blocks of ``rows`` tile rows, every
            ``per_image``-th (and the last) of ``tail_rows``."""
            full, tail = round_up(rows * self.tw, self.vl), round_up(tail_rows * self.tw, self.vl)
            cost = 0
            for t in range(threads):
                lo, hi = t * count // threads, (t + 1) * count // threads
                tails = hi // per_image - lo // per_image
                cost = max(cost, (hi - lo - tails) * full + tails * tail)
            return cost

        within = busiest(self.rows, self.p.n * self.blocks, self.tail_rows, self.blocks)
        budget = block_budget()
        best: tuple[int, float, int] | None = None
        for rows in range(1, total + 1):
            if rows > 1 and self.block_bytes(rows) > budget:
                break
            count = -(-total // rows)
            candidate = (busiest(rows, count, total - (count - 1) * rows, count),
                         abs(math.log(rows / self.rows)), rows)
            if best is None or candidate < best:
                best = candidate
        if best is None or best[0] > (1 - SPANNING_GAIN) * within:
            return None
        return best[2]

    def output_chunk_panels(self) -> int:
        """Panels of output channels per chunk: the block's GEMMs and output transform run chunk by
        chunk, so that the output transform reads the chunk's M (``alpha**2`` positions of its
        channels) from L2 where the GEMMs just wrote it, not the whole block's M back from L3.
        The most panels, dividing the panel count, whose M fits :data:`OUTPUT_CHUNK_SHARE` of L2;
        every panel where L2's size is not known."""
        panels = self.cout_pad // self.mr
        l2 = cache_size(2) if current_target() == host_target() else None
        if not l2:
            return panels
        per_panel = self.alpha**2 * self.position_elements(self.mr, self.rows) * self.esize
        fitting = [k for k in range(1, panels + 1) if panels % k == 0 and k * per_panel <= l2 * OUTPUT_CHUNK_SHARE]
        return max(fitting, default=1)

    def row_stride(self, rows: int) -> int:
        """Row stride of V and M for blocks of ``rows`` tile rows: their tiles rounded to whole
        vectors, and one vector more (a row's last transform chunk spills into it)."""
        return round_up(rows * self.tw, self.vl) + self.vl

    def position_elements(self, channels: int, rows: int) -> int:
        """Elements between two positions' matrices of ``channels`` rows (V: the input channels,
        M: the padded output channels) for blocks of ``rows`` tile rows, one cache line more than
        they need: a multiple of 4 KiB would make the transform's stores to the positions alias."""
        line = 64 // self.esize
        return round_up(channels * self.row_stride(rows), line) + line

    def const(self, value: float, lanes: int) -> str:
        """``value`` as a scalar (``lanes`` 1) or splat to a vector of ``lanes``."""
        c = float_const(value, self.t)
        return splat_const(lanes, self.t, c) if lanes > 1 else c

    def lincomb(self, f: FunctionEmitter, terms: list[tuple[float, str]], lanes: int) -> str:
        """``sum(coef * value)`` over scalars (``lanes`` 1) or vectors of ``lanes``, skipping zero
        coefficients; +-1 are adds and subtracts, others FMAs. A term with coefficient +1 goes
        first, so the sum starts from a plain value."""
        ty = f"<{lanes} x {self.t}>" if lanes > 1 else self.t
        terms = [(coef, value) for coef, value in terms if coef != 0]
        plain = next((i for i, (coef, _) in enumerate(terms) if coef == 1), 0)
        terms = terms[plain:plain + 1] + terms[:plain] + terms[plain + 1:]
        acc = ""
        for coef, value in terms:
            if not acc:
                if coef == 1:
                    acc = value
                elif coef == -1:
                    acc = f.val(f"fneg {ty} {value}", "wn")
                else:
                    acc = f.val(f"fmul {ty} {value}, {self.const(coef, lanes)}", "wm")
            elif coef == 1:
                acc = f.val(f"fadd {ty} {acc}, {value}", "wa")
            elif coef == -1:
                acc = f.val(f"fsub {ty} {acc}, {value}", "ws")
            else:
                acc = f.call(ty, self.mod.fma(ty), [(ty, value), (ty, self.const(coef, lanes)), (ty, acc)], hint="wf")
        return acc or self.const(0.0, lanes)

    def product(self, f: FunctionEmitter, matrix: Matrix, x: list[str], lanes: int) -> list[str]:
        """``matrix @ x`` for a vector of values ``x`` (scalars or vectors of ``lanes``), by :func:`linear_plan`."""
        plan = linear_plan(matrix)
        values = list(x)
        for terms in plan.shared:
            values.append(self.lincomb(f, [(coef, values[src]) for coef, src in terms], lanes))
        return [self.lincomb(f, [(coef, values[src]) for coef, src in terms], lanes) for terms in plan.rows]

    def sandwich(self, f: FunctionEmitter, left: Matrix, x: list[list[str]], right: Matrix,
                 lanes: int) -> list[list[str]]:
        """``left @ x @ right^T`` on a grid of values (scalars or vectors of ``lanes``)."""
        columns = [self.product(f, left, [row[j] for row in x], lanes) for j in range(len(x[0]))]
        rows = [[column[a] for column in columns] for a in range(len(left))]
        return [self.product(f, right, row, lanes) for row in rows]

    def block_pipeline(self) -> str:
        """The pipeline of a task that transforms, multiplies and transforms back in one function:
        ``explicit``, or ``lean`` for tiles of :data:`LEAN_TASK_ALPHA` or more."""
        return "lean" if self.tiles.alpha >= LEAN_TASK_ALPHA else "explicit"

    def task(self, name: str, nctx: int, pipeline: str = "explicit") -> tuple[FunctionEmitter, list[str], str, str]:
        """:func:`parallel_task` in this kernel's module."""
        return parallel_task(self.mod, name, nctx, pipeline)

    @staticmethod
    def share(f: FunctionEmitter, tid: str, nt: str, total: str | int) -> tuple[str, str]:
        """:func:`thread_share`."""
        return thread_share(f, tid, nt, total)

    def masked_store(self, f: FunctionEmitter, lanes: int, value: str, ptr: str, valid: int) -> None:
        fn = masked_store(self.mod, lanes, self.t)
        mask = prefix_mask(lanes, valid)
        f.call("void", fn, [(f"<{lanes} x {self.t}>", value), ("ptr", ptr), ("i32", str(self.esize)),
                            (f"<{lanes} x i1>", mask)])


    # ----- weights -----

    def weight_task(self, name: str) -> str:
        """Task over panels of ``MR`` (padded) output channels: ``U = G g G^T`` for every input
        channel, stored as ``U[pos][panel][c][r]`` (the microkernel's A operand); rows past
        ``cout`` are zero. A panel's ``MR`` rows are the lanes of one vector, so each position is
        one contiguous store, and the transform's arithmetic is shared by the panel."""
        p, t, alpha, mr = self.p, self.t, self.alpha, self.mr
        f, (w, u), tid, nt = self.task(name, 2, pipeline="lean")
        panels = self.cout_pad // mr
        lo, hi = self.share(f, tid, nt, panels)
        s0, s1, s2, s3 = p.weight_strides
        vt = f"<{mr} x {t}>"
        with f.loop(lo, hi, hint="pn") as panel:
            # Padding rows read the last real row's taps (always in bounds) and are then zeroed.
            rows = [f.add(f.mul(panel, mr), r) for r in range(mr)]
            offsets = [f.add(f.mul(f.smin(o, p.cout - 1), s0), p.weight_base) for o in rows]
            real = "poison"
            for r, o in enumerate(rows):
                real = f.val(f"insertelement <{mr} x i1> {real}, i1 {f.icmp('slt', o, p.cout)}, i32 {r}", "real")
            with f.loop(0, p.cin, hint="c") as c:
                slot = f.mul(f.add(f.mul(panel, p.cin), c), mr)
                taps = []
                for kh in range(3):
                    row = []
                    for kw in range(3):
                        tap = f.add(f.mul(c, s1), kh * s2 + kw * s3)
                        lanes = "poison"
                        for r, offset in enumerate(offsets):
                            value = f.load(t, f.gep(t, w, f.add(offset, tap)))
                            lanes = f.val(f"insertelement {vt} {lanes}, {t} {value}, i32 {r}", "tap")
                        row.append(f.val(f"select <{mr} x i1> {real}, {vt} {lanes}, {vt} zeroinitializer", "tap"))
                    taps.append(row)
                out = self.sandwich(f, self.tiles.g, taps, self.tiles.g, mr)
                for a in range(alpha):
                    for b in range(alpha):
                        f.store(vt, out[a][b], f.gep(t, u, f.add(slot, (a * alpha + b) * panels * p.cin * mr)),
                                align=self.esize)
        f.ret_void()
        f.finish()
        return name

    # ----- one block: input transform, GEMMs, output transform -----

    def block_task(self, name: str, scratch_stride: int) -> str:
        """Task over blocks of tile rows (of one image, or the batch's with :attr:`spans`); every
        buffer but x, U, y and the epilogue's inputs is this thread's own."""
        p, m = self.p, self.tiles.m
        f, (x, u, y, scratch, flag, *inputs), tid, nt = self.task(name, 5 + self.epilogue_inputs)
        tasks = self.blocks if self.spans else p.n * self.blocks
        lo, hi = self.share(f, tid, nt, tasks)
        own = f.gep("i8", scratch, f.mul(tid, scratch_stride))
        plane = own
        v = f.gep("i8", own, str(self.plane_bytes))
        mm = f.gep("i8", v, str(self.v_bytes))
        occupancy = f.gep("i8", mm, str(self.m_bytes)) if self.exact_zeros else None
        if occupancy is not None:
            self.field_mask_ptr = f.gep("i8", occupancy, str(self.plane_bytes))
        self.row_staging = f.gep("i8", mm, str(self.m_bytes + self.mask_bytes))
        self.sentinel = f.var(self.vt, "zeroinitializer", "bad")
        with f.loop(lo, hi, hint="blk") as item:
            block = item if self.spans else f.val(f"urem i64 {item}, {self.blocks}")
            last = f.icmp("eq", block, self.blocks - 1)
            rows = f.select(last, "i64", str(self.tail_rows), str(self.rows))

            def transform(segment: Segment) -> None:
                self.inputs(f, f.gep(self.t, x, f.mul(segment.image, p.cin * p.h * p.w)), segment, plane, v,
                            occupancy)
                if occupancy is not None:
                    self.field_mask(f, occupancy, segment)

            self.segments(f, item, rows, transform)

            def store(segment: Segment, first_channel: str) -> None:
                finish, epilogue_rows = None, None
                if self.epilogue_in_registers:
                    plane0 = f.mul(segment.image, p.cout)

                    def epilogue_rows(co: str) -> list[RowInput]:
                        assert self.epilogue is not None
                        return tile_row_inputs(f, self.epilogue, inputs, f.add(plane0, co), "0", self.t)
                elif self.epilogue is not None:
                    # The segment's rows of one channel are one run of pixels of its (image, channel) row.
                    first = f.mul(segment.ty0, m)
                    pixels = f.mul(f.sub(f.smin(f.add(first, f.mul(segment.rows, m)), p.oh), first), p.ow)
                    plane0, start = f.mul(segment.image, p.cout), f.mul(first, p.ow)

                    def finish(co: str) -> None:
                        call_epilogue(f, self.epilogue_fn, y, inputs, f.add(plane0, co), "1", start, pixels)
                self.outputs(f, mm, f.gep(self.t, y, f.mul(segment.image, p.cout * p.oh * p.ow)), segment, finish,
                             epilogue_rows, first_channel)

            with f.loop(0, self.cout_pad // self.mr // self.chunk_panels, hint="och") as chunk:
                first_channel = f.mul(chunk, self.chunk_panels * self.mr)
                self.block_gemms(f, u, v, mm, last, first_channel)
                self.segments(f, item, rows, lambda segment: store(segment, first_channel))
        self.raise_flag_if_nan(f, self.sentinel, flag)
        f.ret_void()
        f.finish()
        return name

    def block_gemms(self, f: FunctionEmitter, u: str, v: str, mm: str, last: str, first_channel: str = "0") -> None:
        """:meth:`gemms` over a block's columns: the last block's fewer (``last``, an i1) where its
        tile rows round to fewer vectors."""
        tail_cols = round_up(self.tail_rows * self.tw, self.vl)
        if tail_cols == self.cols:
            self.gemms(f, u, v, mm, self.cols, first_channel)
            return
        tail, whole, done = f.if_else(last, "tail")
        for label, cols in ((tail, tail_cols), (whole, self.cols)):
            f.block(label)
            self.gemms(f, u, v, mm, cols, first_channel)
            f.br(done)
        f.block(done)

    def segments(self, f: FunctionEmitter, item: str, rows: str, body: Callable[[Segment], None]) -> None:
        """``body`` on each image's part of block ``item`` of ``rows`` tile rows, in column order: the
        block itself, or with :attr:`spans` a loop over the images its rows reach."""
        if not self.spans:
            img = f.val(f"udiv i64 {item}, {self.blocks}")
            ty0 = f.mul(f.val(f"urem i64 {item}, {self.blocks}"), self.rows)
            body(Segment(img, ty0, rows, "0"))
            return
        th = self.th
        first = f.mul(item, self.rows)
        end = f.add(first, rows)
        with f.loop(f.val(f"udiv i64 {first}, {th}"), f.val(f"udiv i64 {f.add(end, th - 1)}, {th}"),
                    hint="img") as img:
            base = f.mul(img, th)
            ty0 = f.smax(f.sub(first, base), "0")
            count = f.sub(f.smin(f.sub(end, base), th), ty0)
            body(Segment(img, ty0, count, f.sub(f.add(base, ty0), first)))

    def inputs(self, f: FunctionEmitter, x: str, segment: Segment, plane: str, v: str,
               occupancy: str | None = None) -> None:
        """``V[pos][c][(offset + r) * tw + tx] = (B^T d B)[pos]`` for the segment's tiles of every
        input channel of its image ``x``; with ``occupancy``, also which plane positions hold a
        nonzero value in any channel (:meth:`field_mask`)."""
        p = self.p
        source = TileSource(p.cin, p.h, p.w, p.top, p.left, self.alpha, self.hp, self.wp)
        self.transform_tiles(f, x, source, segment.ty0, plane, self.tiles.bt, v, self.v_pos, segment.rows, occupancy,
                             f.mul(segment.offset, self.tw))

    def transform_tiles(self, f: FunctionEmitter, x: str, source: TileSource, ty0: str, plane: str, matrix: Matrix,
                        dest: str, pos_stride: int, rows: str | None = None, occupancy: str | None = None,
                        first_column: str = "0", channels: tuple[str, str] | None = None) -> None:
        """``dest[pos][c][first_column + r * tw + tx] = (matrix d matrix^T)[pos]`` for the ``size x size``
        tiles ``d`` of ``rows`` tile rows (the block's ``R`` unless given) from tile row ``ty0`` in every
        channel of ``source`` (or those in ``channels``, ``[lo, hi)``); ``plane`` is 64-byte aligned
        scratch for one zero-padded channel. With ``occupancy`` (a plane of ints), each channel's plane
        is ORed into it, sign bits cleared."""
        t = self.t
        self.clear_plane(f, source, plane)
        if occupancy is not None:
            self.clear_plane(f, source, occupancy)
        first, last = channels or ("0", str(source.channels))
        with f.loop(first, last, hint="ci") as ci:
            self.fill_plane(f, f.gep(t, x, f.mul(ci, source.h * source.w)), source, ty0, plane)
            if occupancy is not None:
                self.occupy(f, source, plane, occupancy)
            row_base = f.add(f.mul(ci, self.stride), first_column)

            def put(r: str, chunk: int, a: int, b: int, value: str) -> None:
                # Runs store in order: a run's lanes past its tiles spill into the next run's
                # columns before that run overwrites them.
                col = f.add(row_base, f.add(f.mul(r, self.tw), chunk * self.vl))
                ptr = f.gep(t, dest, f.add(col, (a * len(matrix) + b) * pos_stride))
                f.store(self.vt, self.to_columns(f, value), ptr, align=self.esize)

            self.transform_runs(f, source, plane, matrix, put, rows)

    def clear_plane(self, f: FunctionEmitter, source: TileSource, plane: str) -> None:
        """Zero the plane; every channel fills the same interior, so the border stays zero for the block."""
        f.emit(f"call void @llvm.memset.p0.i64(ptr align 64 {plane}, i8 0, "
               f"i64 {source.plane_rows * source.plane_cols * self.esize}, i1 false)")

    def fill_plane(self, f: FunctionEmitter, src: str, source: TileSource, ty0: str, plane: str) -> None:
        """Copy the rows of one channel ``src`` that the block's tiles read into the plane's interior."""
        t = self.t
        first_row = f.sub(f.mul(ty0, self.tiles.m), source.top)
        with f.loop(0, source.plane_rows, hint="pr") as pr:
            ir = f.add(first_row, pr)
            with f.if_then(f.icmp("ult", ir, source.h), "inrow"):
                dst = f.gep(t, plane, f.add(f.mul(pr, source.plane_cols), source.left))
                f.emit(f"call void @llvm.memcpy.p0.p0.i64(ptr {dst}, ptr {f.gep(t, src, f.mul(ir, source.w))}, "
                       f"i64 {source.w * self.esize}, i1 false)")
        # The same rows of the next channel, into L1 while this one is transformed: the copy
        # reads a channel's rows as one short run among the transform's many streams, and would
        # otherwise wait on each of its lines from L3 or memory in turn (measured on AMD Zen 3:
        # the seed CNN's conv2 backward passes 7-8 % faster).
        lo = f.mul(f.select(f.icmp("slt", first_row, 0), "i64", "0", first_row), source.w * self.esize)
        hi = f.mul(f.smin(f.add(first_row, source.plane_rows), source.h), source.w * self.esize)
        self.prefetch_bytes(f, src, source.h * source.w * self.esize, lo, hi)

    @staticmethod
    def prefetch_bytes(f: FunctionEmitter, base: str, offset: int, lo: str, hi: str, locality: int = 3) -> None:
        """Prefetch the lines of bytes ``[lo, hi)`` of the plane ``offset`` bytes past ``base`` (the
        next channel's), into L1 (``locality`` 3) or L2 (2)."""
        start = f.add(f.val(f"ptrtoint ptr {base} to i64", "at"), offset)
        first_line = f.val(f"and i64 {f.add(start, lo)}, -64", "line")
        with f.loop(first_line, f.add(start, hi), step=64, hint="pf") as line:
            f.prefetch(f.val(f"inttoptr i64 {line} to ptr", "pp"), locality=locality)

    def occupy(self, f: FunctionEmitter, source: TileSource, plane: str, occupancy: str) -> None:
        """``occupancy |= bits(plane) & ~sign`` over the whole plane (its spare vector included):
        nonzero exactly where some channel so far holds a value other than +-0."""
        vl, it = self.vl, self.it
        ivt = f"<{vl} x {it}>"
        magnitude = f"<{', '.join([f'{it} {(1 << (8 * self.esize - 1)) - 1}'] * vl)}>"
        with f.loop(0, -(-source.plane_rows * source.plane_cols // vl), hint="occ") as q:
            at = f.mul(q, vl)
            bits = f.load(ivt, f.gep(self.t, plane, at), align=self.esize)
            ptr = f.gep(it, occupancy, at)
            seen = f.load(ivt, ptr, align=self.esize)
            f.store(ivt, f.val(f"or {ivt} {seen}, {f.val(f'and {ivt} {bits}, {magnitude}')}"), ptr,
                    align=self.esize)

    def field_mask(self, f: FunctionEmitter, occupancy: str, segment: Segment) -> None:
        """For each output of the segment's tile rows, whether any of its 3x3 inputs in any channel
        is nonzero (the OR of its window of ``occupancy``), for :meth:`outputs` to zero the others:
        where the direct sum adds only zeros, it is exactly 0. The segment's mask rows start at its
        offset's first output row."""
        vl, it, m = self.vl, self.it, self.tiles.m
        ivt = f"<{vl} x {it}>"
        mask = f.gep(it, self.field_mask_ptr, f.mul(f.mul(segment.offset, m), self.mask_cols))
        with f.loop(0, f.mul(segment.rows, m), hint="fy") as py:
            for cx in range(0, self.mask_cols, vl):
                window = [f.load(ivt, f.gep(it, occupancy, f.add(f.mul(f.add(py, dy), self.wp), cx + dx)),
                                 align=self.esize) for dy in range(3) for dx in range(3)]
                union = window[0]
                for value in window[1:]:
                    union = f.val(f"or {ivt} {union}, {value}")
                f.store(ivt, union, f.gep(it, mask, f.add(f.mul(py, self.mask_cols), cx)), align=self.esize)

    def transform_runs(self, f: FunctionEmitter, source: TileSource, plane: str, matrix: Matrix,
                       put: Callable[[str, int, int, int, str], None], rows: str | None = None) -> None:
        """``matrix d matrix^T`` for every tile ``d`` of the block's ``rows`` tile rows (``R`` unless
        given), VL neighbouring tiles of a row at a time: ``put(r, chunk, a, b, value)`` receives
        position ``(a, b)`` of the run ``chunk`` (tiles ``chunk * VL ...``) of tile row ``r`` (an IR
        value: the rows are a loop).

        The product is separable, so it runs in two passes through :attr:`row_staging` in L1: each
        plane row the tiles read, its tiles' columns times ``matrix^T`` (shared by the tile rows
        that overlap there), then down each staged column, times ``matrix``. Each pass holds one
        tile row's ``size`` vectors and its results, where the direct sandwich holds the whole
        ``size x size`` grid: on AMD Zen 3 (16 vector registers) F(4,3)'s sandwich went to the
        stack 157 times per run of 8 tiles, the two passes not once, and the seed CNN's conv2
        backward-data pass ran 8 % faster this way (the forward, F(3,3), 4 %)."""
        m, vl, size, width = self.tiles.m, self.vl, source.size, len(matrix)
        if self.pack > 1:
            self.packed_transform_runs(f, source, plane, matrix, put, rows)
            return
        runs = -(-self.tw // vl)
        line = width * runs * vl  # one staged plane row: [b][run][tile]
        count = f.add(f.mul(rows or self.rows, m), size - m)
        with f.loop(0, count, hint="hy") as y:
            staged = f.gep(self.t, self.row_staging, f.mul(y, line))
            for chunk, tx0 in enumerate(range(0, self.tw, vl)):
                columns = self.tile_columns(f, plane, f.add(f.mul(y, source.plane_cols), m * tx0), size)
                for b, value in enumerate(self.product(f, matrix, columns, self.vl)):
                    f.store(self.vt, value, f.gep(self.t, staged, (b * runs + chunk) * vl), align=self.esize)
        with f.loop(0, rows or self.rows, hint="r") as r:
            staged = f.gep(self.t, self.row_staging, f.mul(r, m * line))
            for chunk in range(runs):
                for b in range(width):
                    down = [f.load(self.vt, f.gep(self.t, staged, i * line + (b * runs + chunk) * vl), align=self.esize)
                            for i in range(size)]
                    for a, value in enumerate(self.product(f, matrix, down, self.vl)):
                        put(r, chunk, a, b, value)

    def packed_transform_runs(self, f: FunctionEmitter, source: TileSource, plane: str, matrix: Matrix,
                              put: Callable[[str, int, int, int, str], None], rows: str | None = None) -> None:
        """:meth:`transform_runs` for :attr:`pack` tile rows per vector: ``put(r, 0, a, b, value)``
        receives the run of tile rows ``r ... r + G - 1``. The first pass's vectors hold the plane
        rows ``m`` apart that the packed tile rows read at the same height, so tile rows share no
        first-pass work, and a run's staging stays in L1 between its two passes. A last run may
        reach past the block's rows into the plane's zero rows; :meth:`inputs`'s columns for them
        land in the next segment's columns (written after) or V's spare vector."""
        m, vl, size, width = self.tiles.m, self.vl, source.size, len(matrix)
        with f.loop(0, self.packed_runs(f, rows or str(self.rows)), hint="pr") as run:
            r = f.mul(run, self.pack)
            for i in range(size):
                row = f.mul(f.add(f.mul(r, m), i), source.plane_cols)
                columns = self.tile_columns(f, plane, row, size, m * source.plane_cols)
                for b, value in enumerate(self.product(f, matrix, columns, vl)):
                    f.store(self.vt, value, f.gep(self.t, self.row_staging, (i * width + b) * vl), align=self.esize)
            for b in range(width):
                down = [f.load(self.vt, f.gep(self.t, self.row_staging, (i * width + b) * vl), align=self.esize)
                        for i in range(size)]
                for a, value in enumerate(self.product(f, matrix, down, vl)):
                    put(r, 0, a, b, value)

    def tile_columns(self, f: FunctionEmitter, plane: str, row: str, size: int, row_step: int = 0) -> list[str]:
        """Columns ``0 .. size-1`` of the VL consecutive tiles whose first starts at element ``row``
        of ``plane`` (tile ``l`` at ``row + m * l``): one vector over the tiles per column.

        Columns ``j .. j+3`` of a tile are one 16-byte load ``j`` past its start, whatever ``m`` is,
        so loading tiles ``q, q+4, q+8, ...`` into the 16-byte lanes of ``R_q`` and transposing the
        4 x 4 squares of ``R_0 .. R_3`` lane by lane (:func:`transpose_lanes`) gives four columns in
        tile order: in-lane shuffles, and an insert per extra lane. Picking every ``m``-th element
        of long loads takes cross-lane permutes and blends instead, about six per column: on AMD
        Zen 3 the F(4,3) input transform's shuffles halve this way (216 to 102 per run of tiles)
        and the seed CNN's conv2 backward-data runs 4 % faster. Targets whose vectors are not whole
        16-byte lanes pick, and so do 64-byte vectors (AVX-512, :attr:`strided_picks`), whose
        two-source permutes take each column from one load per packed row in two or three
        instructions: on AMD Zen 5 the seed CNN's conv2 forward (F(3,3)) ran 3-7 % faster than by
        16-byte lanes (2 threads, 0.636 -> 0.618 and 0.688 -> 0.638 ms, the builds taking turns),
        the same bits. With :attr:`pack` rows per vector, packed row ``g``'s lanes read
        ``g * row_step`` elements further on.

        Where a tile is one 16-byte lane wide (``m`` = 4 float32, :attr:`whole_loads`), ``VL / 4``
        consecutive tiles are one whole vector: ``R_q`` is a single load of the tiles ``q * VL / 4
        ...`` instead of four 16-byte loads and three inserts, and the transposed columns hold the
        tiles in the order :meth:`lane_slots` gives, which :meth:`to_columns` puts back in order
        with the shuffle it stores through. On AMD Zen 5 the seed CNN's conv2 backward-data
        (F(4,3)) input transform's loop went from 735 to 568 instructions and the pass ran 2-3 %
        faster (2 threads, 0.800 -> 0.786 and 0.816 -> 0.790 ms, the builds taking turns)."""
        t, m, vl = self.t, self.tiles.m, self.vl
        per_lane, lanes = 16 // self.esize, self.row_lanes
        if self.strided_picks:
            # Packed row g's tiles read one run of ``span`` elements; column j of lane (g, i) is its
            # element m * i + j.
            span = round_up(m * (lanes - 1) + size, vl)
            runs = [f.load(f"<{span} x {t}>", f.gep(t, plane, f.add(row, g * row_step)), align=self.esize)
                    for g in range(self.pack)]
            joined = concatenate(f, runs, span, t) if self.pack > 1 else runs[0]
            wide = f"<{span * self.pack} x {t}>"
            return [f.val(f"shufflevector {wide} {joined}, {wide} poison, <{vl} x i32> <"
                          + ", ".join(f"i32 {(k // lanes) * span + m * (k % lanes) + j}" for k in range(vl)) + ">",
                          "dv") for j in range(size)]

        def register(q: int, first: int) -> str:
            """``R_q``: elements ``first ..`` of the tiles it holds, whole (:attr:`whole_loads`) or
            one 16-byte lane per tile."""
            if self.whole_loads:
                g, tile = divmod(q * (vl // per_lane), lanes)
                return f.load(self.vt, f.gep(t, plane, f.add(row, g * row_step + m * tile + first)), align=self.esize)
            parts = [f.load(f"<{per_lane} x {t}>",
                            f.gep(t, plane, f.add(row, (k // lanes) * row_step + m * (k % lanes + q) + first)),
                            align=self.esize) for k in range(0, vl, per_lane)]
            return concatenate(f, parts, per_lane, t)

        columns: list[str] = []
        for first in range(0, size, per_lane):
            columns += transpose_lanes(f, [register(q, first) for q in range(per_lane)], vl, t)[:size - first]
        return columns

    def gemms(self, f: FunctionEmitter, u: str, v: str, mm: str, cols: int, first_channel: str = "0") -> None:
        """``M[pos] = U[pos] @ V[pos]`` for every position and the :attr:`chunk_panels` panels of
        output channels from ``first_channel`` (M's row 0): register tiles over the block's first
        ``cols`` columns, MR x NR, and over a narrower last piece of columns as many panels' rows
        at once as fill the same accumulators (:meth:`panels_per_tile`)."""
        p, t, vl, vt, mr = self.p, self.t, self.vl, self.vt, self.mr
        fma = self.mod.fma(vt)
        panels = self.cout_pad // mr
        nr = self.nvec * vl
        widths = [nr] * (cols // nr) + ([cols % nr] if cols % nr else [])
        most = max(self.panels_per_tile(width // vl) for width in widths) * mr
        accs = [[f.alloca(vt, f"acc{r}_{c}") for c in range(self.nvec)] for r in range(most)]
        with f.loop(0, self.alpha**2, hint="pos") as pos:
            vpos = f.gep(t, v, f.mul(pos, self.v_pos))
            mpos = f.gep(t, mm, f.mul(pos, self.m_pos))
            upos = f.gep(t, u, f.mul(pos, panels * p.cin * mr))
            col = 0
            for width in widths:
                nvec = width // vl
                group = self.panels_per_tile(nvec)
                rows = group * mr
                with f.loop(0, self.chunk_panels // group, hint="pan") as tile:
                    chunk_panel = f.mul(tile, group)
                    first_panel = f.add(f.val(f"udiv i64 {first_channel}, {mr}"), chunk_panel)
                    for r in range(rows):
                        for c in range(nvec):
                            f.store(vt, "zeroinitializer", accs[r][c])
                    with f.loop(0, p.cin, hint="k") as k:
                        brow = f.gep(t, vpos, f.add(f.mul(k, self.stride), col))
                        bv = [f.load(vt, f.gep(t, brow, str(c * vl)), align=self.esize) for c in range(nvec)]
                        arow = f.gep(t, upos, f.add(f.mul(first_panel, p.cin * mr), f.mul(k, mr)))
                        for r in range(rows):
                            # Row r is row r % MR of the group's panel r // MR.
                            at = (r // mr) * p.cin * mr + r % mr
                            av = f.splat(vl, t, f.load(t, f.gep(t, arow, str(at))))
                            for c in range(nvec):
                                cur = f.load(vt, accs[r][c])
                                f.store(vt, f.call(vt, fma, [(vt, av), (vt, bv[c]), (vt, cur)]), accs[r][c])
                    out_rows = f.gep(t, mpos, f.add(f.mul(f.mul(chunk_panel, mr), self.stride), col))
                    for r in range(rows):
                        for c in range(nvec):
                            ptr = f.gep(t, out_rows, str(r * self.stride + c * vl))
                            f.store(vt, f.load(vt, accs[r][c]), ptr, align=self.esize)
                col += width

    def panels_per_tile(self, nvec: int) -> int:
        """Panels whose rows one register tile covers over ``nvec`` vectors of columns: one for
        the full width; for a narrower piece (a block's last tile row, 8 columns of 56, say) the
        most, dividing the panel count, whose accumulators fit the full tile's. An MR x 1 tile
        has MR chains of FMAs, too few to hide their latency, and loads B once per MR FMAs."""
        panels = self.chunk_panels
        fits = max(1, (self.mr * self.nvec) // (self.mr * nvec))
        return max(g for g in range(1, min(fits, panels) + 1) if panels % g == 0)

    def outputs(self, f: FunctionEmitter, mm: str, y: str, segment: Segment,
                finish: Callable[[str], None] | None = None,
                epilogue_rows: Callable[[str], list[RowInput]] | None = None, first_channel: str = "0") -> None:
        """``y tile = A^T M A`` for the segment's tiles of the output channels of its image ``y``
        that M holds (:attr:`chunk_panels` panels from ``first_channel``);
        rows past ``oh`` and columns past ``ow`` are not written. ``finish(co)`` runs after channel
        ``co``'s rows are stored, while they are in L1; with ``epilogue_rows(co)`` (channel ``co``'s
        epilogue inputs) the epilogue is applied to each output row in registers before its store.

        A run is :attr:`row_lanes` tiles of each of :attr:`pack` tile rows, one load of M's
        columns per position (:meth:`from_columns`); each output row of a packed row is one
        interleave and one store. A
        last run's rows past the segment's belong to the next segment or block (or to none) and
        are not stored."""
        p, t, m, vl, alpha, lanes = self.p, self.t, self.tiles.m, self.vl, self.alpha, self.row_lanes
        row_type = f"<{m * lanes} x {t}>"
        ty0, rows = segment.ty0, segment.rows
        first_column, first_mask_row = f.mul(segment.offset, self.tw), f.mul(segment.offset, m)
        last_channel = f.smin(f.add(first_channel, self.chunk_panels * self.mr), p.cout)
        # The bytes of a channel's plane that the segment's rows cover.
        first_byte = f.mul(f.mul(ty0, m), p.ow * self.esize)
        end_byte = f.mul(f.smin(f.mul(f.add(ty0, rows), m), p.oh), p.ow * self.esize)
        with f.loop(first_channel, last_channel, hint="co") as co:
            dst = f.gep(t, y, f.mul(co, p.oh * p.ow))
            # The next channel's rows, into L2 while this one's are computed: stores that miss
            # wait for their lines one by one (measured on AMD Zen 4: the seed CNN's conv2 forward
            # 4 % faster on one and on two threads; a prefetch for writing gained less).
            self.prefetch_bytes(f, dst, p.oh * p.ow * self.esize, first_byte, end_byte, locality=2)
            base = f.add(f.mul(f.sub(co, first_channel), self.stride), first_column)
            row_inputs = epilogue_rows(co) if epilogue_rows is not None else None
            with f.loop(0, self.packed_runs(f, rows), hint="r") as run:
                r = f.mul(run, self.pack)
                for tx0 in range(0, self.tw, lanes):
                    col = f.add(base, f.add(f.mul(r, self.tw), tx0))
                    columns = min(m * lanes, p.ow - m * tx0)
                    # Separable, as the input transform (:meth:`transform_runs`): each column of
                    # positions times A^T, staged, then each output row from its staged row.
                    for b in range(alpha):
                        down = []
                        for a in range(alpha):
                            at = f.add(col, (a * alpha + b) * self.m_pos)
                            down.append(self.from_columns(f, f.load(self.vt, f.gep(t, mm, at), align=self.esize)))
                        for i, value in enumerate(self.product(f, self.tiles.at, down, vl)):
                            f.store(self.vt, value, f.gep(t, self.row_staging, (i * alpha + b) * vl),
                                    align=self.esize)
                    for i in range(m):
                        across = [f.load(self.vt, f.gep(t, self.row_staging, (i * alpha + b) * vl),
                                         align=self.esize) for b in range(alpha)]
                        parts = self.product(f, self.tiles.at, across, vl)
                        for g in range(self.pack):
                            oy = f.add(f.mul(f.add(f.add(ty0, r), g), m), i)
                            inside = f.icmp("slt", oy, p.oh)
                            if self.pack > 1:
                                inside = f.val(f"and i1 {inside}, {f.icmp('slt', f.add(r, g), rows)}")
                            with f.if_then(inside, "orow"):
                                value = self.interleave(f, parts, g * lanes, lanes)
                                if self.exact_zeros:
                                    row = f.add(first_mask_row, f.add(f.mul(f.add(r, g), m), i))
                                    value = self.zero_where_inputs_are(f, value, row, m * tx0, m * lanes)
                                self.watch(f, value, columns, m * lanes)
                                if row_inputs is not None:
                                    assert self.epilogue is not None
                                    vector = VectorScalar(f, p.dtype, m * lanes)
                                    value = self.epilogue.body(vector, [value, *(x.at(f, 0, vector)
                                                                                 for x in row_inputs)])
                                ptr = f.gep(t, dst, f.add(f.mul(oy, p.ow), m * tx0))
                                if columns == m * lanes:
                                    f.store(row_type, value, ptr, align=self.esize)
                                else:
                                    self.masked_store(f, m * lanes, value, ptr, columns)
            if finish is not None:
                finish(co)

    def zero_where_inputs_are(self, f: FunctionEmitter, value: str, row: str, col: int, lanes: int) -> str:
        """``value`` (a vector of ``lanes`` outputs of the block's output row ``row`` from column
        ``col``) with 0 where :meth:`field_mask` says every input is zero."""
        ivt, wide = f"<{lanes} x {self.it}>", f"<{lanes} x {self.t}>"
        mask = f.load(ivt, f.gep(self.it, self.field_mask_ptr, f.add(f.mul(row, self.mask_cols), col)),
                      align=self.esize)
        nonzero = f.val(f"icmp ne {ivt} {mask}, zeroinitializer")
        return f.val(f"select <{lanes} x i1> {nonzero}, {wide} {value}, {wide} zeroinitializer", "ez")

    def raise_flag_if_nan(self, f: FunctionEmitter, sentinel: str, flag: str) -> None:
        """Set the shared i32 ``flag`` when any lane of the vector in ``sentinel`` is NaN. Every
        writer stores the same 1, so the threads need no ordering beyond an atomic store."""
        total = f.load(self.vt, sentinel)
        nan = f.val(f"fcmp uno {self.vt} {total}, {total}")
        any_nan = f.call("i1", self.mod.intrinsic("vector.reduce.or", "i1", [f"<{self.vl} x i1>"], f"v{self.vl}i1"),
                         [(f"<{self.vl} x i1>", nan)])
        with f.if_then(any_nan, "nonfinite"):
            f.emit(f"store atomic i32 1, ptr {flag} monotonic, align 4")

    def watch(self, f: FunctionEmitter, value: str, columns: int, lanes: int) -> None:
        """Fold the first ``columns`` lanes of a stored row ``lanes`` wide into the block's
        non-finite sentinel: ``x - x`` is 0 for a finite ``x`` and NaN otherwise, and NaN survives
        every later sum."""
        vl, t = self.vl, self.t
        wide = f"<{lanes} x {t}>"
        if columns < lanes:
            keep = prefix_mask(lanes, columns)
            value = f.val(f"select <{lanes} x i1> {keep}, {wide} {value}, {wide} zeroinitializer", "kept")
        diff = f.val(f"fsub {wide} {value}, {value}", "fin")
        acc = f.load(self.vt, self.sentinel)
        for first in range(0, lanes, vl):
            # A last part shorter than a vector takes zeros (lanes of the second, zero, operand).
            picks = "<" + ", ".join(f"i32 {first + i if first + i < lanes else lanes}" for i in range(vl)) + ">"
            piece = f.val(f"shufflevector {wide} {diff}, {wide} zeroinitializer, <{vl} x i32> {picks}", "fp")
            acc = f.val(f"fadd {self.vt} {acc}, {piece}", "fa")
        f.store(self.vt, acc, self.sentinel)

    def fallback_task(self, name: str, padding_is_data: bool = True) -> str:
        """Task over (image, output channel) planes: the correlation summed directly, tap by tap.

        It runs only when a Winograd output is NaN or infinite. The transforms mix the taps of a
        tile, so one infinite input can meet its own negative there (``inf - inf``) and give NaN
        where the direct sum gives an infinity; the direct sum puts NaN and infinities exactly
        where the reference does. With ``padding_is_data`` (the forward pass) a tap on the padding
        counts a zero input, as the reference's padded image does: an infinite weight there gives
        ``0 * inf``, NaN. Without it (backward-data, a correlation of dY padded by ``2 - pad``) such
        a tap is no term at all: that padding stands for dY positions that do not exist, which
        the reference's gradient never multiplies."""
        p, t = self.p, self.t
        f, (x, w, y), tid, nt = self.task(name, 3, pipeline="cold")
        lo, hi = self.share(f, tid, nt, p.n * p.cout)
        s0, s1, s2, s3 = p.weight_strides
        fma = self.mod.fma(t)
        acc = f.alloca(t, "acc")
        with f.loop(lo, hi, hint="pl") as pl:
            img, co = f.val(f"udiv i64 {pl}, {p.cout}"), f.val(f"urem i64 {pl}, {p.cout}")
            src = f.gep(t, x, f.mul(img, p.cin * p.h * p.w))
            with f.loop(0, p.oh, hint="oy") as oy, f.loop(0, p.ow, hint="ox") as ox:
                f.store(t, self.const(0.0, 1), acc)
                # The taps are loops, not unrolled: this code is cold, and small code compiles fast.
                with f.loop(0, p.cin, hint="ci") as ci, f.loop(0, 3, hint="kh") as kh, f.loop(0, 3, hint="kw") as kw:
                    wbase = f.add(f.add(f.mul(co, s0), f.mul(ci, s1)), p.weight_base)
                    iy, ix = f.sub(f.add(oy, kh), p.top), f.sub(f.add(ox, kw), p.left)
                    inside = f.val(f"and i1 {f.icmp('ult', iy, p.h)}, {f.icmp('ult', ix, p.w)}")
                    at = f.select(inside, "i64", f.add(f.mul(f.add(f.mul(ci, p.h), iy), p.w), ix), "0")
                    xv = f.select(inside, t, f.load(t, f.gep(t, src, at)), self.const(0.0, 1))
                    wv = f.load(t, f.gep(t, w, f.add(wbase, f.add(f.mul(kh, s2), f.mul(kw, s3)))))
                    summed = f.call(t, fma, [(t, wv), (t, xv), (t, f.load(t, acc))])
                    if not padding_is_data:
                        summed = f.select(inside, t, summed, f.load(t, acc))
                    f.store(t, summed, acc)
                out = f.gep(t, y, f.add(f.mul(pl, p.oh * p.ow), f.add(f.mul(oy, p.ow), ox)))
                f.store(t, f.load(t, acc), out)
        f.ret_void()
        f.finish()
        return name

    @property
    def epilogue_inputs(self) -> int:
        return len(self.epilogue.operands) if self.epilogue else 0

    def epilogue_task(self, name: str) -> str:
        """Task over (image, channel) planes: the epilogue on all of them (after the fallback)."""
        p = self.p
        f, (y, *inputs), tid, nt = self.task(name, 1 + self.epilogue_inputs, pipeline="lean")
        lo, hi = self.share(f, tid, nt, p.n * p.cout)
        call_epilogue(f, self.epilogue_fn, y, inputs, lo, f.sub(hi, lo), "0", str(p.oh * p.ow))
        f.ret_void()
        f.finish()
        return name

    def interleave(self, f: FunctionEmitter, parts: list[str], first: int, tiles: int) -> str:
        """``m`` vectors of ``vl`` tiles' column ``j`` -> one row of ``m * tiles`` consecutive outputs
        of the ``tiles`` tiles in lanes ``first ...``."""
        vl, t, m = self.vl, self.t, self.tiles.m
        # Concatenation pairs vectors: an odd m pads the list with poison to a power of two.
        parts = parts + ["poison"] * ((1 << (len(parts) - 1).bit_length()) - len(parts))
        joined = f"<{vl * len(parts)} x {t}>"
        order = "<" + ", ".join(f"i32 {(k % m) * vl + first + k // m}" for k in range(m * tiles)) + ">"
        joined_parts = concatenate(f, parts, vl, t)
        return f.val(f"shufflevector {joined} {joined_parts}, {joined} poison, <{m * tiles} x i32> {order}", "il")

    @property
    def plane_bytes(self) -> int:
        return round_up((self.hp * self.wp + self.tiles.m * self.vl) * self.esize, 64)

    @property
    def v_bytes(self) -> int:
        return round_up(self.alpha**2 * self.v_pos * self.esize, 64)

    @property
    def m_bytes(self) -> int:
        return round_up(self.alpha**2 * self.m_pos * self.esize, 64)

    @property
    def staging_rows_bytes(self) -> int:
        """:attr:`row_staging`: the plane rows a block's tiles read, each ``alpha`` staged columns of
        every run of tiles (:meth:`transform_runs`); it also holds a run's half-transformed outputs."""
        runs = -(-self.tw // self.vl)
        return round_up((self.tiles.m * self.segment_rows + 2) * self.alpha * runs * self.vl * self.esize, 64)

    @property
    def mask_bytes(self) -> int:
        """The occupancy plane and the field mask (:meth:`field_mask`), where outputs keep exact zeros."""
        if not self.exact_zeros:
            return 0
        return self.plane_bytes + round_up((self.tiles.m * self.rows * self.mask_cols + self.vl) * self.esize, 64)


def emit_winograd(mod: ModuleEmitter, p: WinogradConv, name: str, tiles: WinogradTiles | None = None,
                  epilogue: Epilogue | None = None, exact_zeros: bool = False,
                  padding_is_data: bool = True) -> ConvEntry:
    """``name(x, w, y, e..., ws)``: the correlation ``p`` by Winograd ``tiles`` (F(2,3) unless
    given), then ``epilogue`` (inputs ``e...``) on y, seen as the matrix
    (image, channel) x pixel. ``exact_zeros``: outputs whose inputs are all zero are exactly 0,
    as in the direct sum (F(2,3) has that property by itself). ``padding_is_data``: the forward's
    zero padding, which the fallback multiplies (:meth:`WinogradEmitter.fallback_task`). The
    workspace holds the packed U, shared, then each thread's plane, V, M and the planes that keep
    exact zeros."""
    tiles = tiles or F2X3
    e = WinogradEmitter(mod, p, tiles, epilogue, exact_zeros)
    u_bytes = round_up(e.alpha**2 * e.cout_pad * p.cin * e.esize, 64)
    scratch_stride = e.plane_bytes + e.v_bytes + e.m_bytes + e.mask_bytes + e.staging_rows_bytes
    inputs = [ptr for _, ptr in epilogue.pointers] if epilogue else []
    fallback = [(e.fallback_task(name + ".direct", padding_is_data), ["x", "w", "y"])]
    if epilogue is not None:
        e.epilogue_fn = name + ".epilogue"
        emit_epilogue(mod, e.epilogue_fn, output_matrix(p.n, p.cout, p.oh * p.ow), epilogue, p.dtype)
        fallback.append((e.epilogue_task(name + ".direct_epilogue"), ["y", *inputs]))
    phases = [(e.weight_task(name + ".weights"), ["w", "shared"]),
              (e.block_task(name + ".blocks", scratch_stride), ["x", "shared", "y", "scratch", "flag", *inputs])]
    return emit_guarded_entry(mod, name, ("x", "w", "y", *inputs), u_bytes, scratch_stride, phases, fallback)


def transpose_lanes(f: FunctionEmitter, regs: list[str], vl: int, t: str) -> list[str]:
    """The square each 16-byte lane of ``regs`` (2 or 4 vectors of ``vl`` elements, as many as a
    lane holds) forms, transposed: output ``j`` holds element ``j`` of each input's lane, in input
    order. Built from the two-source in-lane interleaves x86 has (unpack low and high)."""
    vt = f"<{vl} x {t}>"
    per_lane = len(regs)

    def unpack(a: str, b: str, size: int, upper: bool) -> str:
        # Per lane: runs of ``size`` elements from a and b taken in turn, from the lane's low or high half.
        order: list[int] = []
        for lane in range(0, vl, per_lane):
            start = lane + (per_lane // 2 if upper else 0)
            for first in range(start, start + per_lane // 2, size):
                order += [*range(first, first + size), *range(vl + first, vl + first + size)]
        return f.val(f"shufflevector {vt} {a}, {vt} {b}, <{vl} x i32> <{', '.join(f'i32 {i}' for i in order)}>", "tl")

    if per_lane == 2:
        return [unpack(regs[0], regs[1], 1, False), unpack(regs[0], regs[1], 1, True)]
    low01, high01 = unpack(regs[0], regs[1], 1, False), unpack(regs[0], regs[1], 1, True)
    low23, high23 = unpack(regs[2], regs[3], 1, False), unpack(regs[2], regs[3], 1, True)
    return [unpack(low01, low23, 2, False), unpack(low01, low23, 2, True),
            unpack(high01, high23, 2, False), unpack(high01, high23, 2, True)]


def block_budget() -> int:
    """Bytes a Winograd block's V and M may take: four times L2, within one core's share of the
    last-level cache, from the host's sysfs (:data:`BLOCK_BYTES` for another target or where the
    host does not say). Each stage walks a block one position (``1 / alpha**2`` of it) at a time,
    which L2 holds, while the block waits for its next stage in L3. Measured on AMD Zen 3 (L2 512
    KiB, 16 MiB of L3 per core), a 112 x 112 x 64 forward took 18.2 ms in 2 MiB blocks, 20.9 in
    0.5 MiB and 28.7 in one 14 MiB block per image."""
    target = current_target()
    l2 = cache_size(2) if target == host_target() else None
    if not l2:
        return BLOCK_BYTES
    l3 = cache_share(3)
    return min(4 * l2, l3) if l3 else 4 * l2


def parallel_task(mod: ModuleEmitter, name: str, nctx: int,
                  pipeline: str = "explicit") -> tuple[FunctionEmitter, list[str], str, str]:
    """A parallel-for task: its emitter, the context pointers, tid and thread count as i64.
    Tasks are register-tiled explicit vector code unless they say otherwise: ``lean`` for
    transforms, ``cold`` for fallbacks (:data:`opgrad.compiler.llvm_worker.PIPELINES`)."""
    f = FunctionEmitter(mod, name, [("ptr", "ctx"), ("i32", "tid"), ("i32", "nt")], linkage="internal",
                        pipeline=pipeline)
    ptrs = [f.load("ptr", f.gep("ptr", "%ctx", str(i))) for i in range(nctx)]
    return f, ptrs, f.val("sext i32 %tid to i64"), f.val("sext i32 %nt to i64")


def thread_share(f: FunctionEmitter, tid: str, nt: str, total: str | int) -> tuple[str, str]:
    """Thread ``tid``'s part ``[lo, hi)`` of ``[0, total)`` out of ``nt`` even parts."""
    lo = f.val(f"udiv i64 {f.mul(tid, total)}, {nt}")
    hi = f.val(f"udiv i64 {f.mul(f.add(tid, 1), total)}, {nt}")
    return lo, hi


def declare_helpers(mod: ModuleEmitter) -> None:
    """The thread pool's entry and the memset/memcpy intrinsics every Winograd kernel calls."""
    mod.declare(PARALLEL_FOR, PARALLEL_FOR_DECL)
    mod.declare("llvm.memset.p0.i64", "declare void @llvm.memset.p0.i64(ptr, i8, i64, i1)")
    mod.declare("llvm.memcpy.p0.p0.i64", "declare void @llvm.memcpy.p0.p0.i64(ptr, ptr, i64, i1)")


def emit_guarded_entry(mod: ModuleEmitter, name: str, params: tuple[str, ...], shared_bytes: int,
                       scratch_stride: int, phases: list[tuple[str, list[str]]],
                       fallback: list[tuple[str, list[str]]]) -> ConvEntry:
    """``name(params..., ws)``: run each phase's task on all threads, in order, then the fallback
    tasks if a phase raised the non-finite flag. A task's context lists pointers by name: the
    parameters, ``shared`` (the workspace's first ``shared_bytes``), ``flag`` (an i32 after it)
    and ``scratch`` (then ``scratch_stride`` bytes per thread)."""
    declare_helpers(mod)
    f = FunctionEmitter(mod, name, [("ptr", p) for p in (*params, "ws")], pipeline="lean")
    pointers = {p: "%" + p for p in params}
    pointers["shared"] = "%ws"
    pointers["flag"] = f.gep("i8", "%ws", str(shared_bytes))
    pointers["scratch"] = f.gep("i8", "%ws", str(shared_bytes + 64))

    def parallel(task: str, names: list[str]) -> None:
        ctx = f.alloca(f"[{len(names)} x ptr]", "ctx", align=8)
        for i, ptr_name in enumerate(names):
            f.store("ptr", pointers[ptr_name], f.gep("ptr", ctx, str(i)))
        f.call("void", "@" + PARALLEL_FOR, [("ptr", "@" + task), ("ptr", ctx)])

    f.store("i32", "0", pointers["flag"], align=4)
    for task, names in phases:
        parallel(task, names)
    with f.if_then(f.icmp("ne", f.load("i32", pointers["flag"], align=4), "0", "i32"), "nonfinite"):
        for task, names in fallback:
            parallel(task, names)
    f.ret_void()
    f.finish()
    return ConvEntry(name, shared_bytes + 64 + scratch_stride)
