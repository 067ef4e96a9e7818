"""The adjoint (transposed) Winograd F(m, 3) backward-data pass of a 3x3 stride-1 conv2d.

The forward pass computes each ``m x m`` output tile ``t`` as ``y_t = A^T [U ⊙ (B^T d_t B)] A``
from the ``alpha x alpha`` input tile ``d_t`` under it (``alpha = m + 2``, ``U = G g G^T``). Its
adjoint gives the data gradient, tiled over dY as the forward and the weight gradient are:

* ``Hh[pos][o][t] = (A H_t A^T)[pos]`` for each ``m x m`` tile ``H_t`` of dY (zero past its edge),
  ``A = at^T``, the transform :mod:`.winograd_weight` applies to dY;
* ``Mt[pos][c][t] = sum_o U[pos][o][c] Hh[pos][o][t]``: ``alpha**2`` GEMMs on the forward's
  weight transform read with the o/c strides swapped (no flipped taps);
* the patch ``P_t = B Mt[.][c][t] B^T`` (``B = bt^T``) is **added** into a zero plane of
  ``(th m + 2) x (tw m + 2)`` at ``(ty m, tx m)``: neighbouring patches overlap by two rows and
  columns, and dX is the plane's ``h x w`` from ``(top, left)``.

The correlation form of :mod:`.winograd` tiles dX instead, padded by ``2 - pad``: where the
padding is below 1 dX is larger than dY, and the correlation form transforms and multiplies
tiles over outputs past dY's footprint. The seed CNN's conv2 backward-data (dY 24 x 24, dX
26 x 26) by F(4,3) takes 7 x 7 tiles there (49 x 36 products per image and channel pair over
28 x 28 outputs); here F(4,3) takes 6 x 6 tiles (36 x 36) and F(3,3) 8 x 8 (64 x 25, whole
vectors of 16 columns). Measured on AMD EPYC Zen 5 (batch 32, ``opgrad bench --kernels``, the
builds taking turns): F(4,3) correlation 0.78-0.87 ms, adjoint F(3,3) 0.62-0.65 ms on two
threads; 1.52-1.63 against 1.22-1.31 ms on one, 20-27 % less (alone, the adjoint by F(4,3)
takes 1.28 ms on one thread, its GEMMs' fewer columns lost to costlier transforms). With "same" padding
dY and dX are the same size, nothing is saved and the overlap-add makes the adjoint dearer
(a 12 x 12 64-channel layer: 0.62 ms correlation, 0.69 adjoint). :func:`prefers_adjoint` weighs
the two forms by their estimated cycles.

Each block is one or more whole images (:meth:`AdjointEmitter.spanning_rows`), so no patch
overlaps another block's: a block's patches of one channel are added in a fixed order (tile
rows, then runs of tiles, then patch rows) into the thread's own plane, which is then copied to
dX. The sums depend on the shapes only, so the results are bitwise identical for any thread
count. A non-finite output sends the whole pass to the correlation form's direct sum
(:meth:`.winograd.WinogradEmitter.fallback_task`): NaN and infinities then land exactly where
the correlation form puts them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from .conv import Conv2dGeometry, ConvEntry, output_matrix
from .gemm import Epilogue, call_epilogue, emit_epilogue, round_up
from .irtext import FunctionEmitter, ModuleEmitter
from .target import current_target, host_target
from .threads import pool_size
from .winograd import (
    ACCURACY_MARGIN,
    GEMM_FMA_CYCLES,
    SPANNING_GAIN,
    TILE_CHOICES,
    Matrix,
    Segment,
    TileSource,
    WinogradConv,
    WinogradEmitter,
    WinogradTiles,
    block_budget,
    choose_tiles,
    emit_guarded_entry,
    estimated_cycles,
    linear_plan,
    sandwich_ops,
    transform_op_cycles,
    winograd_conv,
)

__all__ = ["AdjointConv", "AdjointEmitter", "adjoint_conv", "adjoint_estimated_cycles",
           "choose_adjoint_tiles", "emit_winograd_adjoint", "prefers_adjoint"]


def _transpose(m: Matrix) -> Matrix:
    return tuple(zip(*m, strict=True))


@dataclass(frozen=True)
class AdjointConv(WinogradConv):
    """The backward-data pass as the adjoint of a forward Winograd pass: the GEMMs' inputs are dY's
    ``cin = O`` channels of ``h x w = oh x ow`` (tiled over ``oh x ow``), their outputs dX's
    ``cout = C`` channels of ``dx_h x dx_w``, cropped from the overlap-added plane at
    ``(top, left)``; ``weight_strides`` read ``w[o, c]``'s taps as row ``c``, column ``o``."""

    dx_h: int
    dx_w: int

    def correlation(self) -> WinogradConv:
        """The same pass as the forward correlation of dY (padded by ``2 - pad``) with the flipped
        weights: the form whose direct sum is the fallback."""
        return WinogradConv(self.n, self.cin, self.oh, self.ow, self.cout, self.dx_h, self.dx_w, 2 - self.top,
                            2 - self.left, (9, self.cout * 9, -3, -1), 8, self.dtype)


def adjoint_conv(g: Conv2dGeometry, require_gain: bool = True) -> AdjointConv | None:
    """The adjoint form of ``g``'s backward-data pass, or None where Winograd does not apply
    (:func:`.winograd.winograd_conv`)."""
    if winograd_conv(g, "backward_data", require_gain) is None:
        return None
    return AdjointConv(g.n, g.o, g.oh, g.ow, g.c, g.oh, g.ow, g.pads[0], g.pads[2], (9, g.c * 9, 3, 1), 0, g.dtype,
                       g.h, g.w)


class AdjointEmitter(WinogradEmitter):
    """Emission state of one adjoint backward-data kernel (:mod:`this module <.winograd_adjoint>`).

    The inherited tiling covers dY (``p.oh x p.ow``); blocks are whole images, so ``rows`` is a
    multiple of ``th``. The epilogue, if any, runs on each (image, channel) plane of dX as soon
    as it is copied out, while it is in L1."""

    def __init__(self, mod: ModuleEmitter, p: AdjointConv, tiles: WinogradTiles,
                 epilogue: Epilogue | None = None, spans_images: bool = True) -> None:
        super().__init__(mod, p, tiles, epilogue, exact_zeros=False, spans_images=spans_images)
        self.q = p  # ``p`` as its own type: the dX shape
        self.epilogue_in_registers = False
        m, lanes = tiles.m, self.row_lanes
        #: Values a run's patch row adds into a plane row: ``m * lanes + m``, rounded to 32 bytes so
        #: that the load, add and store are whole vectors of 8 floats or more.
        self.patch_width = round_up(m * lanes + m, 32 // self.esize)
        #: The overlap-add plane of one channel: a run's patch row from column ``m * tx0``; copying
        #: out reads whole vectors from ``left``.
        self.acc_rows = m * round_up(self.th, self.pack) + 2
        self.acc_cols = round_up(max(m * (round_up(self.tw, lanes) - lanes) + self.patch_width, 2 + p.dx_w) + self.vl,
                                 64 // self.esize)

    def output_chunk_panels(self) -> int:
        """Every panel: the overlap-add reads the whole block's M (its patches of every channel)."""
        return self.cout_pad // self.mr

    def block_rows(self) -> int:
        """One whole image: a block's patches overlap no other block's."""
        return self.th

    def spanning_rows(self) -> int | None:
        """Tile rows of blocks of ``k`` whole images, or None where one image a block does as well:
        the ``k`` (its V and M within :func:`.winograd.block_budget`) that minimizes the busiest
        thread's GEMM columns, nearest to one image among equals, where that takes at least
        :data:`.winograd.SPANNING_GAIN` off. The seed CNN's conv2 has 36 F(4,3) tiles an image
        (48 columns of 16); blocks of 4 images are 144, 9 whole vectors."""
        threads = pool_size() if current_target() == host_target() else 1
        n, per_image = self.p.n, self.th * self.tw

        def busiest(k: int) -> int:
            count = -(-n // k)
            full = round_up(k * per_image, self.vl)
            tail = round_up((n - (count - 1) * k) * per_image, self.vl)
            cost = 0
            for t in range(threads):
                lo, hi = t * count // threads, (t + 1) * count // threads
                has_tail = lo < count <= hi
                cost = max(cost, (hi - lo - has_tail) * full + has_tail * tail)
            return cost

        budget = block_budget()
        best = min((busiest(k), abs(math.log(k)), k) for k in range(1, n + 1)
                   if k == 1 or self.block_bytes(k * self.th) <= budget)
        if best[2] == 1 or best[0] > (1 - SPANNING_GAIN) * busiest(1):
            return None
        return best[2] * self.th

    @property
    def acc_bytes(self) -> int:
        return round_up(self.acc_rows * self.acc_cols * self.esize, 64)

    def scratch_bytes(self) -> int:
        """One thread's dY plane, V, M, the overlap-add plane and the separable transforms' rows."""
        return self.plane_bytes + self.v_bytes + self.m_bytes + self.acc_bytes + self.staging_rows_bytes

    def block_task(self, name: str, scratch_stride: int) -> str:
        """Task over blocks of whole images: ``Hh`` for every dY channel, the GEMMs, then each dX
        channel's patches overlap-added and copied out."""
        p, t, m = self.q, self.t, self.tiles.m
        f, (dy, u, dx, scratch, flag, *inputs), tid, nt = self.task(name, 5 + self.epilogue_inputs,
                                                                  self.block_pipeline())
        tasks = self.blocks if self.spans else p.n * self.blocks
        lo, hi = self.share(f, tid, nt, tasks)
        plane = f.gep("i8", scratch, f.mul(tid, scratch_stride))
        v = f.gep("i8", plane, str(self.plane_bytes))
        mm = f.gep("i8", v, str(self.v_bytes))
        acc = f.gep("i8", mm, str(self.m_bytes))
        self.row_staging = f.gep("i8", acc, str(self.acc_bytes))
        self.sentinel = f.var(self.vt, "zeroinitializer", "bad")
        source = TileSource(p.cin, p.h, p.w, 0, 0, m, self.hp, self.wp)
        with f.loop(lo, hi, hint="blk") as item:
            block = item if self.spans else f.val(f"urem i64 {item}, {self.blocks}")
            last = f.icmp("eq", block, self.blocks - 1)
            rows = f.select(last, "i64", str(self.tail_rows), str(self.rows))

            def transform(segment: Segment) -> None:
                self.transform_tiles(f, f.gep(t, dy, f.mul(segment.image, p.cin * p.h * p.w)), source, segment.ty0,
                                     plane, _transpose(self.tiles.at), v, self.v_pos, segment.rows,
                                     first_column=f.mul(segment.offset, self.tw))

            self.segments(f, item, rows, transform)
            self.block_gemms(f, u, v, mm, last)

            def store(segment: Segment) -> None:
                finish = None
                if self.epilogue is not None:
                    plane0 = f.mul(segment.image, p.cout)

                    def finish(co: str) -> None:
                        call_epilogue(f, self.epilogue_fn, dx, inputs, f.add(plane0, co), "1", "0",
                                      str(p.dx_h * p.dx_w))
                self.overlap_add(f, mm, acc, f.gep(t, dx, f.mul(segment.image, p.cout * p.dx_h * p.dx_w)), segment,
                                 finish)

            self.segments(f, item, rows, store)
        self.raise_flag_if_nan(f, self.sentinel, flag)
        f.ret_void()
        f.finish()
        return name

    def overlap_add(self, f: FunctionEmitter, mm: str, acc: str, dx: str, segment: Segment,
                    finish: Callable[[str], None] | None) -> None:
        """For every dX channel of the segment's image (a whole one): ``P_t = B Mt B^T`` of each
        tile added into the cleared plane ``acc`` at ``(ty m, tx m)``, then the plane's ``h x w``
        from ``(top, left)`` stored to ``dx`` and watched for non-finite values; ``finish(co)``
        then runs on channel ``co``'s stored plane.

        A run's patches are computed separably as the forward's outputs (:meth:`outputs`), each
        column of positions times ``B``, staged, then each patch row, on one load of M's columns
        per position (its :attr:`pack` tile rows ``tw`` columns apart, as they lie); the ``alpha``
        columns of a patch row are the ``m`` columns each tile starts plus two that overlap the
        next tile's, which one interleave places ``m`` columns on: one load, add and store of a
        plane row of :attr:`patch_width` per patch row."""
        p, t, m, vl, alpha, lanes = self.q, self.t, self.tiles.m, self.vl, self.alpha, self.row_lanes
        b_matrix = _transpose(self.tiles.bt)
        first_column = f.mul(segment.offset, self.tw)
        plane_bytes = p.dx_h * p.dx_w * self.esize
        with f.loop(0, p.cout, hint="co") as co:
            # The next channel's dX plane, into L2 while this one is computed (:meth:`outputs`).
            self.prefetch_bytes(f, f.gep(t, dx, f.mul(co, p.dx_h * p.dx_w)), plane_bytes, "0", str(plane_bytes),
                                locality=2)
            f.emit(f"call void @llvm.memset.p0.i64(ptr align 64 {acc}, i8 0, i64 {self.acc_bytes}, i1 false)")
            base = f.add(f.mul(co, self.stride), first_column)
            with f.loop(0, self.packed_runs(f, segment.rows), hint="r") as run:
                r = f.mul(run, self.pack)
                for tx0 in range(0, self.tw, lanes):
                    col = f.add(base, f.add(f.mul(r, self.tw), tx0))
                    # M's columns as they lie: packed row g's tiles in lanes g * tw ..., which the
                    # patch rows pick (:meth:`patch_row`), leaving the lanes past them out.
                    tiles = min(lanes, self.tw - tx0)
                    for b in range(alpha):
                        down = [f.load(self.vt, f.gep(t, mm, f.add(col, (a * alpha + b) * self.m_pos)),
                                       align=self.esize) for a in range(alpha)]
                        for i, value in enumerate(self.product(f, b_matrix, down, vl)):
                            f.store(self.vt, value, f.gep(t, self.row_staging, (i * alpha + b) * vl),
                                    align=self.esize)
                    for i in range(alpha):
                        across = [f.load(self.vt, f.gep(t, self.row_staging, (i * alpha + b) * vl),
                                         align=self.esize) for b in range(alpha)]
                        parts = self.product(f, b_matrix, across, vl)
                        for g in range(self.pack):
                            y = f.add(f.mul(f.add(f.add(segment.ty0, r), g), m), i)
                            ptr = f.gep(t, acc, f.add(f.mul(y, self.acc_cols), m * tx0))
                            if self.pack > 1:  # a last run's packed rows past the image's add nothing
                                with f.if_then(f.icmp("slt", f.add(r, g), segment.rows), "prow"):
                                    self.add_patch_row(f, parts, g, tiles, ptr)
                            else:
                                self.add_patch_row(f, parts, g, tiles, ptr)
            self.copy_out(f, acc, f.gep(t, dx, f.mul(co, p.dx_h * p.dx_w)))
            if finish is not None:
                finish(co)

    def add_patch_row(self, f: FunctionEmitter, parts: list[str], g: int, tiles: int, ptr: str) -> None:
        """Add packed row ``g``'s patch row of its first ``tiles`` tiles (:meth:`patch_row`) into
        the plane row at ``ptr``."""
        row_type = f"<{self.patch_width} x {self.t}>"
        row = self.patch_row(f, parts, g * self.tw, tiles)
        total = f.val(f"fadd {row_type} {f.load(row_type, ptr, align=self.esize)}, {row}", "oa")
        f.store(row_type, total, ptr, align=self.esize)

    def patch_row(self, f: FunctionEmitter, parts: list[str], first: int, tiles: int) -> str:
        """One patch row of the ``tiles`` tiles in lanes ``first ...`` of ``parts`` (its ``alpha``
        columns, each a vector over tiles), overlap-added in registers: :attr:`patch_width` values,
        tile ``l``'s columns at ``m * l ...  m * l + alpha - 1``, zeros past the last tile's (the
        shuffles take the other lanes, whatever they hold, nowhere)."""
        m, t, width = self.tiles.m, self.t, self.patch_width
        n = m * tiles
        starts = self.interleave(f, parts[:m], first, tiles)
        spill = self.interleave(f, parts[m:] + ["zeroinitializer"] * (2 * m - self.alpha), first, tiles)
        ty = f"<{n} x {t}>"
        low = ", ".join([f"i32 {k}" for k in range(n)] + [f"i32 {n}"] * (width - n))
        high = ", ".join([f"i32 {n}"] * m + [f"i32 {k}" for k in range(n)] + [f"i32 {n}"] * (width - n - m))
        widened = f.val(f"shufflevector {ty} {starts}, {ty} zeroinitializer, <{width} x i32> <{low}>", "pl")
        shifted = f.val(f"shufflevector {ty} {spill}, {ty} zeroinitializer, <{width} x i32> <{high}>", "ph")
        return f.val(f"fadd <{width} x {t}> {widened}, {shifted}", "pr")

    def copy_out(self, f: FunctionEmitter, acc: str, dx: str) -> None:
        """dX's plane ``h x w`` from the overlap-add plane at ``(top, left)``, watched for non-finite values."""
        p, t, vl = self.q, self.t, self.vl
        with f.loop(0, p.dx_h, hint="cy") as y:
            src = f.gep(t, acc, f.add(f.mul(f.add(y, p.top), self.acc_cols), p.left))
            dst = f.gep(t, dx, f.mul(y, p.dx_w))
            for x0 in range(0, p.dx_w, vl):
                columns = min(vl, p.dx_w - x0)
                value = f.load(self.vt, f.gep(t, src, x0), align=self.esize)
                self.watch(f, value, columns, vl)
                if columns == vl:
                    f.store(self.vt, value, f.gep(t, dst, x0), align=self.esize)
                else:
                    self.masked_store(f, vl, value, f.gep(t, dst, x0), columns)


def emit_winograd_adjoint(mod: ModuleEmitter, p: AdjointConv, name: str, tiles: WinogradTiles,
                          epilogue: Epilogue | None = None) -> ConvEntry:
    """``name(dy, w, dx, e..., ws)``: the backward-data pass ``p`` in the adjoint form, then
    ``epilogue`` (inputs ``e...``) on dX seen as the matrix (image, channel) x pixel. The same
    entry and guard as :func:`.winograd.emit_winograd`'s backward-data kernel; its fallback is the
    correlation form's direct sum."""
    e = AdjointEmitter(mod, p, tiles, epilogue)
    correlation = WinogradEmitter(mod, p.correlation(), tiles, epilogue, spans_images=False)
    u_bytes = round_up(e.alpha**2 * e.cout_pad * p.cin * e.esize, 64)
    scratch_stride = e.scratch_bytes()
    inputs = [ptr for _, ptr in epilogue.pointers] if epilogue else []
    fallback = [(correlation.fallback_task(name + ".direct", padding_is_data=False), ["x", "w", "y"])]
    if epilogue is not None:
        e.epilogue_fn = correlation.epilogue_fn = name + ".epilogue"
        emit_epilogue(mod, e.epilogue_fn, output_matrix(p.n, p.cout, p.dx_h * p.dx_w), epilogue, p.dtype)
        fallback.append((correlation.epilogue_task(name + ".direct_epilogue"), ["y", *inputs]))
    phases = [(e.weight_task(name + ".weights"), ["w", "shared"]),
              (e.block_task(name + ".blocks", scratch_stride), ["x", "shared", "y", "scratch", "flag", *inputs])]
    return emit_guarded_entry(mod, name, ("x", "w", "y", *inputs), u_bytes, scratch_stride, phases, fallback)


# ----- cost and choice -----


def adjoint_estimated_cycles(p: AdjointConv, tiles: WinogradTiles) -> float | None:
    """Cycles the adjoint form takes for one image by ``tiles`` (None where one image's V and M
    exceed :func:`.winograd.block_budget`, which blocks of whole images cannot split), counted as
    :func:`.winograd.estimated_cycles` counts the forward: the GEMMs' vector FMAs over one image's
    tiles rounded to whole vectors, and the transforms' vector operations per run of tiles. dY's
    ``m x m`` tiles take ``m`` plane rows each through ``A``'s plan and the ``alpha`` staged
    columns; each output patch takes ``B``'s sandwich, and each of its ``alpha`` rows (per packed
    tile row) two interleaves, two widening shuffles, an add, and the plane row's load, add and
    store. Per image and dX channel, the plane is cleared, and copied out (a load, the
    non-finite watch's subtract and add, and a store per vector of dX).

    With the constants fitted for the correlation form, this picks the faster form for each of
    six layers measured on AMD EPYC Zen 5 (1 thread, batch 32 unless said; the adjoint's time
    over the correlation form's, measured and estimated): it takes the adjoint for the seed CNN's
    conv2 (F(3,3), 0.79 / 0.73), 32 x 32 channels 14 x 14 unpadded (F(3,3), 0.83 / 0.91) and
    64 x 64 9 x 9 unpadded (F(2,3), 0.89 / 0.72), and keeps the correlation form for 64 x 64
    12 x 12 padded 1 (1.09 / 1.17), 16 x 32 30 x 30 unpadded at batch 8 (1.16 / 1.12) and
    16 x 16 28 x 28 padded 1 at batch 16 (1.37 / 1.26)."""
    e = AdjointEmitter(ModuleEmitter("estimate"), p, tiles, spans_images=False)
    if e.block_bytes(e.th) > block_budget():
        return None
    alpha, m, vl = tiles.alpha, tiles.m, e.vl
    fmas = alpha**2 * e.cout_pad * p.cin * round_up(e.th * e.tw, vl) // vl
    runs = -(-e.tw // e.row_lanes) * -(-e.th // e.pack)
    a_plan = linear_plan(_transpose(tiles.at)).ops
    per_input = (m + m * m) + a_plan * (m + alpha) + alpha**2
    # M's loads, the staging's stores and loads, B's sandwich, and each patch row's interleaves.
    per_output = 3 * alpha**2 + sandwich_ops(_transpose(tiles.bt), alpha) + alpha * e.pack * (4 * m + 6)
    per_plane = -(-e.acc_rows * e.acc_cols // vl) + 4 * p.dx_h * -(-p.dx_w // vl)
    ops = runs * (p.cin * per_input + p.cout * per_output) + p.cout * per_plane
    return GEMM_FMA_CYCLES * fmas + transform_op_cycles() * ops


def choose_adjoint_tiles(p: AdjointConv) -> tuple[WinogradTiles, float] | None:
    """The adjoint form's tiles and their estimate, as :func:`.winograd.choose_tiles` chooses (a
    more accurate tile within :data:`.winograd.ACCURACY_MARGIN` wins); None where no tile fits."""
    best: tuple[WinogradTiles, float] | None = None
    for tiles in TILE_CHOICES:
        cost = adjoint_estimated_cycles(p, tiles)
        if cost is not None and (best is None or cost < (1 - ACCURACY_MARGIN) * best[1]):
            best = (tiles, cost)
    return best


def prefers_adjoint(g: Conv2dGeometry, require_gain: bool = True) -> tuple[AdjointConv, WinogradTiles] | None:
    """The adjoint form and its tiles where its estimate is below the correlation form's (by its
    :func:`.winograd.choose_tiles`), else None."""
    p = adjoint_conv(g, require_gain)
    if p is None:
        return None
    chosen = choose_adjoint_tiles(p)
    if chosen is None:
        return None
    correlation = p.correlation()
    current = estimated_cycles(correlation, choose_tiles(correlation, "backward_data"))
    return (p, chosen[0]) if chosen[1] < current else None
