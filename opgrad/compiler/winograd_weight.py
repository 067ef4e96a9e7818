"""Winograd F(3x3, mxm) for the weight gradient of a 3x3 stride-1 conv2d.

``dW[o, c]`` is the correlation of the input with the output gradient, summed over images. Cut
the output gradient into m x m tiles ``H``; tile ``t`` contributes the 3x3 correlation of its
``H`` with the (m+2) x (m+2) input tile ``D`` under it. That is F(m,3) transposed (the same
interpolation points, the roles of the output and filter transforms swapped):

    dW_tile = G^T [ (A H A^T) * (B^T D B) ] G,   A = (A^T of F(m,3))^T

so with ``Hh[pos][o][t] = (A H_t A^T)[pos]`` and ``Dh[pos][c][t] = (B^T D_t B)[pos]`` the sum over
tiles is (m+2)**2 GEMMs ``What[pos] = Hh[pos] @ Dh[pos]^T`` with the tiles as the reduction, and
``dW[o, c] = G^T What[.][o][c] G``: for m = 2, 16 products per 2x2 outputs' worth of taps instead
of 36. :func:`.winograd.choose_tiles` picks m.

Both transforms run over VL tiles at a time, as in the forward pass, and are written transposed,
``[pos][tile][channel]`` (staged for VL channels, then one in-register transpose per position), so
each GEMM is an outer-product microkernel: a broadcast channel on one side, vectors of channels on
the other, tiles as the reduction. Blocks (tile rows of one image) are summed in a fixed number
of groups, each group's blocks in order, and the groups in order at the end, so the result does
not depend on the thread count. A non-finite result makes the pass recompute by the direct sum,
as the other Winograd passes do.
"""

from __future__ import annotations

from .conv import ConvEntry
from .gemm import Blocking, round_up, transpose_square
from .irtext import FunctionEmitter, ModuleEmitter, prefix_mask
from .target import current_target, host_target
from .threads import pool_size
from .winograd import F2X3, TileSource, WinogradConv, WinogradEmitter, WinogradTiles, emit_guarded_entry

__all__ = ["GROUPS", "GROUP_TILES", "MIN_GROUPS", "WeightGradEmitter", "emit_winograd_weight"]

#: Most groups of partial sums kept apart (then added in order): enough to share the blocks among many threads.
GROUPS = 16
#: Fewest tiles a group sums. Each group clears, fills and finally adds its own alpha**2 x O x C
#: partial sums, a cost that only the tiles it sums pay for: measured on AMD Zen 3 (2 threads), the
#: seed CNN's conv2 weight gradient (2048 tiles) took 3.00 ms in 16 groups, 2.63 in 8, 2.49 in 4
#: and no less in 2.
GROUP_TILES = 512
#: Groups wherever there are that many blocks, however few tiles: with one group a second thread
#: takes half of its channels (:meth:`WeightGradEmitter.group_parts`) and transforms the vector
#: side of every tile again, where with two each sums its own blocks. Measured on AMD Zen 5 at
#: batch 32, a ResNet's 14x14 32-channel layer (512 tiles) took 0.203 ms in one group and 0.153 in
#: two on 2 threads, its 7x7 64-channel layer 0.228 and 0.209; on one thread 0.276 and 0.284,
#: 0.386 and 0.391 (one more clear and add of the partial sums).
MIN_GROUPS = 2


def _transpose(m: tuple[tuple[float, ...], ...]) -> tuple[tuple[float, ...], ...]:
    return tuple(zip(*m, strict=True))


class WeightGradEmitter(WinogradEmitter):
    """Emission state of one weight-gradient kernel; ``p.cout`` is the output gradient's channels.

    The GEMMs hold one side's channels in vectors (``vector``, stored tile-major for it) and
    broadcast the other side's (``broadcast``); What is stored ``[pos][broadcast][vector]``
    (:meth:`register_tile` says which side is which)."""

    def __init__(self, mod: ModuleEmitter, p: WinogradConv, tiles: WinogradTiles = F2X3) -> None:
        super().__init__(mod, p, tiles, spans_images=False)
        vl = self.vl
        self.o_pad, self.c_pad = round_up(p.cout, vl), round_up(p.cin, vl)
        self.o_in_vectors, self.kr, self.nvec = self.register_tile()
        self.vector, self.broadcast = (self.o_pad, self.c_pad) if self.o_in_vectors else (self.c_pad, self.o_pad)
        self.vector_real, self.broadcast_real = (p.cout, p.cin) if self.o_in_vectors else (p.cin, p.cout)
        #: The vector side is stored [pos][tile][channel]; its tile rows are the block's columns plus
        #: the spill of its last run. The broadcast side keeps the transform's [pos][channel][tile].
        line = 64 // self.esize
        self.vector_pos = (self.cols + vl) * self.vector
        self.broadcast_pos = round_up(self.broadcast * self.stride, line) + line
        # The count depends on the shapes only, so the sums do not depend on the thread count; a
        # power of two, so that 2, 4, 8 or 16 threads share the groups evenly (3 groups on 2
        # threads would leave one of them idle for a third of the pass).
        most = max(1, min(GROUPS, p.n * self.blocks, max(MIN_GROUPS, p.n * self.th * self.tw // GROUP_TILES)))
        self.groups = 1 << (most.bit_length() - 1)
        self.parts = self.group_parts()
        self.w_group = self.alpha**2 * self.o_pad * self.c_pad
        self.dy_cols = self.tiles.m * round_up(self.tw, vl)
        #: Transform runs of a block: packed rows share one (:meth:`~.WinogradEmitter.row_packing`).
        self.runs = -(-self.rows // self.pack) * -(-self.tw // vl)
        #: Rows of the output gradient's plane: whole runs of packed tile rows.
        self.dy_rows = self.tiles.m * round_up(self.rows, self.pack)

    def register_tile(self) -> tuple[bool, int, int]:
        """``(o_in_vectors, kr, nvec)``: which side's channels the GEMMs hold in vectors, and the
        register tile: ``kr`` broadcast channels by ``nvec`` vectors.

        The vector side is stored tile-major, one VL x VL transpose per position and VL channels,
        so the side with fewer channels goes there where its vectors fill the accumulators with
        ``kr`` 4 or 8 broadcast rows (they divide the other side's padded count): the seed CNN's
        conv2 weight gradient (64 output, 32 input channels) on AVX-512 takes 8 x 2 vectors of
        input channels and transposes half as much; measured on AMD Zen 5, 0.749 -> 0.672 ms
        (2 threads), the same bits. Otherwise the side with more vectors takes them, 4 rows by
        as many vectors as the accumulators hold."""
        vl = self.vl
        blk = Blocking.for_target(self.p.dtype)
        accumulators = blk.mr * blk.nr // vl
        vectors = min(self.o_pad, self.c_pad) // vl
        kr = accumulators // vectors
        if self.o_pad != self.c_pad and kr * vectors == accumulators and kr in (4, 8):
            return self.o_pad < self.c_pad, kr, vectors
        return self.o_pad >= self.c_pad, 4, max(1, accumulators // 4)

    def group_parts(self) -> int:
        """Parts of each group's broadcast-side channels that are separate units of work, so that
        a pool with more threads than groups has a unit for each: a part sums the group's tiles for
        its channels only, in the same order, so the results do not depend on the parts. Each part
        transforms the vector side again, so there are no more parts than the pool's threads need
        (the seed CNN's conv2 at batch 32 has 2 groups by F(4,3), 4 by F(3,3): on 16 threads, 8 or 4
        parts each), up to twice that where it makes the units a multiple of the threads."""
        threads = pool_size() if current_target() == host_target() else 1
        most = max(1, self.broadcast // self.kr)
        fewest = min(-(-threads // self.groups), most)
        # As many units as a multiple of the threads where the channels allow it: 2 groups on 3
        # threads in 3 parts each (2 units a thread), not 2 parts (2, 1 and 1 units).
        even = [parts for parts in range(fewest, min(most, 2 * fewest) + 1) if self.groups * parts % threads == 0]
        return even[0] if even else fewest

    def part_channels(self, f: FunctionEmitter, part: str) -> tuple[str, str]:
        """The broadcast-side channels ``[lo, hi)`` of part ``part``: whole register rows of ``kr``."""
        if self.parts == 1:
            return "0", str(self.broadcast)
        rows = self.broadcast // self.kr
        lo = f.mul(f.val(f"udiv i64 {f.mul(part, rows)}, {self.parts}"), self.kr)
        hi = f.mul(f.val(f"udiv i64 {f.mul(f.add(part, 1), rows)}, {self.parts}"), self.kr)
        return lo, hi

    @property
    def x_plane_bytes(self) -> int:
        return round_up((self.hp * self.wp + self.tiles.m * self.vl) * self.esize, 64)

    @property
    def dy_plane_bytes(self) -> int:
        return round_up((self.dy_rows * self.dy_cols + self.tiles.m * self.vl) * self.esize, 64)

    @property
    def staging_bytes(self) -> int:
        return round_up(self.runs * self.alpha**2 * self.vl * self.vl * self.esize, 64)

    @property
    def transformed_bytes(self) -> int:
        """The vector side's and the broadcast side's transforms."""
        return round_up(self.alpha**2 * (self.vector_pos + self.broadcast_pos) * self.esize, 64)

    def scratch_bytes(self) -> int:
        """One thread's two planes (each 64-byte aligned, as the plane fill assumes), the staging
        area of VL channels' transforms, both sides' transforms and the separable transforms' rows."""
        return (self.x_plane_bytes + self.dy_plane_bytes + self.staging_bytes + self.transformed_bytes
                + self.staging_rows_bytes)

    def group_task(self, name: str, scratch_stride: int) -> str:
        """Task over groups (and their parts, :meth:`group_parts`): ``What_g = sum over the group's
        blocks of Hh^T Dh`` per position."""
        p, t, m = self.p, self.t, self.tiles.m
        f, (x, dy, partial, scratch), tid, nt = self.task(name, 4, self.block_pipeline())
        lo, hi = self.share(f, tid, nt, self.groups * self.parts)
        own = f.gep("i8", scratch, f.mul(tid, scratch_stride))
        x_plane = own
        dy_plane = f.gep("i8", own, str(self.x_plane_bytes))
        staging = f.gep("i8", dy_plane, str(self.dy_plane_bytes))
        vectors = f.gep("i8", staging, str(self.staging_bytes))
        broadcasts = f.gep(t, vectors, str(self.alpha**2 * self.vector_pos))
        self.row_staging = f.gep("i8", vectors, str(self.transformed_bytes))
        total = p.n * self.blocks
        x_source = TileSource(p.cin, p.h, p.w, p.top, p.left, self.alpha, self.hp, self.wp)
        dy_source = TileSource(p.cout, p.oh, p.ow, 0, 0, m, self.dy_rows, self.dy_cols)
        x_side = (x, p.cin * p.h * p.w, x_source, x_plane, self.tiles.bt)
        dy_side = (dy, p.cout * p.oh * p.ow, dy_source, dy_plane, _transpose(self.tiles.at))
        vector_side, broadcast_side = (dy_side, x_side) if self.o_in_vectors else (x_side, dy_side)
        with f.loop(lo, hi, hint="unit") as unit:
            group = f.val(f"udiv i64 {unit}, {self.parts}")
            n_lo, n_hi = self.part_channels(f, f.val(f"urem i64 {unit}, {self.parts}"))
            mine = f.gep(t, partial, f.mul(group, self.w_group))
            if self.parts == 1:
                f.emit(f"call void @llvm.memset.p0.i64(ptr align 64 {mine}, i8 0, "
                       f"i64 {self.w_group * self.esize}, i1 false)")
            else:
                part_bytes = f.mul(f.sub(n_hi, n_lo), self.vector * self.esize)
                with f.loop(0, self.alpha**2, hint="zp") as pos:
                    rows = f.gep(t, mine, f.add(f.mul(pos, self.vector * self.broadcast), f.mul(n_lo, self.vector)))
                    f.emit(f"call void @llvm.memset.p0.i64(ptr {rows}, i8 0, i64 {part_bytes}, i1 false)")
            first = f.val(f"udiv i64 {f.mul(group, total)}, {self.groups}")
            last = f.val(f"udiv i64 {f.mul(f.add(group, 1), total)}, {self.groups}")
            with f.loop(first, last, hint="blk") as item:
                img = f.val(f"udiv i64 {item}, {self.blocks}")
                block = f.val(f"urem i64 {item}, {self.blocks}")
                ty0 = f.mul(block, self.rows)
                rows = f.select(f.icmp("eq", block, self.blocks - 1), "i64", str(self.tail_rows), str(self.rows))
                src, per_image, source, plane, matrix = vector_side
                self.transposed_tiles(f, f.gep(t, src, f.mul(img, per_image)), source, ty0, rows, plane, matrix,
                                      staging, vectors, self.vector, self.vector_pos)
                src, per_image, source, plane, matrix = broadcast_side
                real = (n_lo, f.smin(n_hi, self.broadcast_real)) if self.parts > 1 else None
                self.transform_tiles(f, f.gep(t, src, f.mul(img, per_image)), source, ty0, plane, matrix, broadcasts,
                                     self.broadcast_pos, rows, channels=real)
                self.outer_gemms(f, vectors, broadcasts, mine, f.mul(rows, self.tw), (n_lo, n_hi))
        f.ret_void()
        f.finish()
        return name

    def transposed_tiles(self, f: FunctionEmitter, x: str, source: TileSource, ty0: str, rows: str, plane: str,
                         matrix: tuple[tuple[float, ...], ...], staging: str, dest: str, channels_pad: int,
                         pos_stride: int) -> None:
        """``dest[pos][tile][c] = (matrix d matrix^T)[pos]`` for the block's tiles (``rows`` tile rows
        from ``ty0``): VL channels are transformed into the staging area, then each position's
        VL x VL square is transposed."""
        t, vt, vl, a2 = self.t, self.vt, self.vl, len(matrix) ** 2
        chunks = -(-self.tw // vl)
        self.clear_plane(f, source, plane)
        with f.loop(0, channels_pad, step=vl, hint="cg") as cg:
            with f.loop(0, vl, hint="cl") as lane:
                ci = f.add(cg, lane)
                with f.if_then(f.icmp("slt", ci, source.channels), "real"):
                    self.fill_plane(f, f.gep(t, x, f.mul(ci, source.h * source.w)), source, ty0, plane)

                    def put(r: str, chunk: int, a: int, b: int, value: str) -> None:
                        # r is the first of the run's packed rows (a multiple of pack, a power of two).
                        run = f.add(f.mul(f.val(f"udiv i64 {r}, {self.pack}", "run"), chunks), chunk)
                        square0 = f.gep(t, staging, f.add(f.mul(run, a2 * vl * vl), f.mul(lane, vl)))
                        pos = a * len(matrix) + b
                        f.store(vt, value, f.gep(t, square0, str(pos * vl * vl)), align=self.esize)

                    self.transform_runs(f, source, plane, matrix, put, rows)
            with f.loop(0, self.packed_runs(f, rows), hint="tr") as packed:
                r = f.mul(packed, self.pack)
                for chunk in range(chunks):
                    run = f.add(f.mul(packed, chunks), chunk)
                    col = f.add(f.mul(r, self.tw), chunk * vl)
                    with f.loop(0, a2, hint="tp") as position:
                        square = f.gep(t, staging, f.mul(f.add(f.mul(run, a2), position), vl * vl))
                        lines = [f.load(vt, f.gep(t, square, str(i * vl)), align=self.esize) for i in range(vl)]
                        columns = transpose_square(f, lines, vt, vl)
                        base = f.add(f.add(f.mul(position, pos_stride), cg), f.mul(col, channels_pad))
                        for held, slot in enumerate(self.lane_slots()):
                            # Packed row g's tiles follow row g - 1's; lanes past a row's tiles
                            # hold nothing and are not stored.
                            g, tile = divmod(slot, self.row_lanes)
                            if self.pack > 1 and tile >= self.tw:
                                continue
                            ptr = f.gep(t, dest, f.add(base, (g * self.tw + tile) * channels_pad))
                            f.store(vt, columns[held], ptr, align=self.esize)

    def outer_gemms(self, f: FunctionEmitter, vectors: str, broadcasts: str, out: str, tiles: str,
                    channels: tuple[str, str]) -> None:
        """``out[pos][n][w] += sum_tile broadcasts[pos][n][tile] * vectors[pos][tile][w]`` over the
        block's first ``tiles`` tiles, for the broadcast-side channels ``n`` in ``channels``."""
        t, vt, vl, kr = self.t, self.vt, self.vl, self.kr
        fma = self.mod.fma(vt)
        w_pos, n_pos = self.vector_pos, self.broadcast_pos
        count = self.vector // vl
        groups = [self.nvec] * (count // self.nvec) + ([count % self.nvec] if count % self.nvec else [])
        accs = [[f.alloca(vt, f"wacc{i}_{j}") for j in range(self.nvec)] for i in range(kr)]
        with f.loop(0, self.alpha**2, hint="pos") as pos:
            wrow = f.gep(t, vectors, f.mul(pos, w_pos))
            nrow = f.gep(t, broadcasts, f.mul(pos, n_pos))
            opos = f.gep(t, out, f.mul(pos, self.vector * self.broadcast))
            with f.loop(channels[0], channels[1], step=kr, hint="n") as n0:
                col = 0
                for nvec in groups:
                    for i in range(kr):
                        for j in range(nvec):
                            f.store(vt, "zeroinitializer", accs[i][j])
                    with f.loop(0, tiles, hint="k") as k:
                        wv = [f.load(vt, f.gep(t, wrow, f.add(f.mul(k, self.vector), col + j * vl)), align=self.esize)
                              for j in range(nvec)]
                        nbase = f.add(f.mul(n0, self.stride), k)
                        for i in range(kr):
                            nv = f.splat(vl, t, f.load(t, f.gep(t, nrow, f.add(nbase, i * self.stride))))
                            for j in range(nvec):
                                cur = f.load(vt, accs[i][j])
                                f.store(vt, f.call(vt, fma, [(vt, nv), (vt, wv[j]), (vt, cur)]), accs[i][j])
                    for i in range(kr):
                        orow = f.add(f.mul(f.add(n0, i), self.vector), col)
                        for j in range(nvec):
                            ptr = f.gep(t, opos, f.add(orow, j * vl))
                            total = f.val(f"fadd {vt} {f.load(vt, ptr, align=self.esize)}, {f.load(vt, accs[i][j])}",
                                          "wsum")
                            f.store(vt, total, ptr, align=self.esize)
                    col += nvec * vl

    def finish_task(self, name: str) -> str:
        """Task over broadcast-side channels: add the groups in order and ``dW = G^T What G``, VL
        vector-side channels at a time; watch the results for non-finite values."""
        p, t, vt, vl, alpha = self.p, self.t, self.vt, self.vl, self.alpha
        f, (partial, dw, flag), tid, nt = self.task(name, 3, pipeline="lean")
        lo, hi = self.share(f, tid, nt, self.broadcast_real)
        bad = f.var(vt, "zeroinitializer", "bad")
        s0, s1, s2, s3 = p.weight_strides
        plane = self.o_pad * self.c_pad
        gt = _transpose(self.tiles.g)
        sums = [f.alloca(vt, f"gsum{pos}") for pos in range(alpha**2)]

        def lanes_of(n: str, w0: str, lanes: int) -> None:
            at = f.add(f.mul(n, self.vector), w0)
            for acc in sums:
                f.store(vt, "zeroinitializer", acc)
            with f.loop(0, self.groups, hint="g") as g:
                group = f.gep(t, partial, f.add(at, f.mul(g, self.w_group)))
                for pos, acc in enumerate(sums):
                    v = f.load(vt, f.gep(t, group, str(pos * plane)), align=self.esize)
                    f.store(vt, f.val(f"fadd {vt} {f.load(vt, acc)}, {v}", "gs"), acc)
            grid = [[f.load(vt, sums[a * alpha + b]) for b in range(alpha)] for a in range(alpha)]
            out = self.sandwich(f, gt, grid, gt, self.vl)
            keep = prefix_mask(vl, lanes)
            for kh in range(3):
                for kw in range(3):
                    value = out[kh][kw]
                    for lane in range(lanes):
                        w = f.add(w0, lane)
                        o, c = (w, n) if self.o_in_vectors else (n, w)
                        tap = f.add(f.add(f.mul(o, s0), f.mul(c, s1)), p.weight_base + kh * s2 + kw * s3)
                        f.store(t, f.val(f"extractelement {vt} {value}, i32 {lane}", "dwv"), f.gep(t, dw, tap))
                    kept = f.val(f"select <{vl} x i1> {keep}, {vt} {value}, {vt} zeroinitializer", "kept")
                    diff = f.val(f"fsub {vt} {kept}, {kept}", "fin")
                    f.store(vt, f.val(f"fadd {vt} {f.load(vt, bad)}, {diff}", "fa"), bad)

        full = self.vector_real // vl * vl
        with f.loop(lo, hi, hint="n") as n:
            if full:
                with f.loop(0, full, step=vl, hint="w") as w0:
                    lanes_of(n, w0, vl)
            if self.vector_real % vl:
                lanes_of(n, str(full), self.vector_real % vl)
        self.raise_flag_if_nan(f, bad, flag)
        f.ret_void()
        f.finish()
        return name

    def direct_task(self, name: str) -> str:
        """Task over output channels: every tap's sum over images and output pixels, directly (only
        after a non-finite result: it puts NaN and infinities where the reference does). A tap on
        the padding counts a zero input, as the reference's padded image does: an infinite output
        gradient there gives ``inf * 0``, NaN."""
        p, t = self.p, self.t
        f, (x, dy, dw), tid, nt = self.task(name, 3, pipeline="cold")
        lo, hi = self.share(f, tid, nt, p.cout)
        s0, s1, s2, s3 = p.weight_strides
        fma = self.mod.fma(t)
        acc = f.alloca(t, "acc")
        # The taps are loops, not unrolled: this code is cold, and small code compiles fast.
        with (f.loop(lo, hi, hint="o") as o, f.loop(0, p.cin, hint="c") as c, f.loop(0, 3, hint="kh") as kh,
              f.loop(0, 3, hint="kw") as kw):
            f.store(t, self.const(0.0, False), acc)
            with f.loop(0, p.n, hint="n") as img, f.loop(0, p.oh, hint="oy") as oy, f.loop(0, p.ow, hint="ox") as ox:
                iy, ix = f.sub(f.add(oy, kh), p.top), f.sub(f.add(ox, kw), p.left)
                inside = f.val(f"and i1 {f.icmp('ult', iy, p.h)}, {f.icmp('ult', ix, p.w)}")
                xi = f.add(f.mul(f.add(f.mul(f.add(f.mul(img, p.cin), c), p.h), iy), p.w), ix)
                gi = f.add(f.mul(f.add(f.mul(f.add(f.mul(img, p.cout), o), p.oh), oy), p.ow), ox)
                xv = f.select(inside, t, f.load(t, f.gep(t, x, f.select(inside, "i64", xi, "0"))),
                              self.const(0.0, False))
                gv = f.load(t, f.gep(t, dy, gi))
                f.store(t, f.call(t, fma, [(t, gv), (t, xv), (t, f.load(t, acc))]), acc)
            tap = f.add(f.add(f.add(f.mul(o, s0), f.mul(c, s1)), p.weight_base), f.add(f.mul(kh, s2), f.mul(kw, s3)))
            f.store(t, f.load(t, acc), f.gep(t, dw, tap))
        f.ret_void()
        f.finish()
        return name


def emit_winograd_weight(mod: ModuleEmitter, p: WinogradConv, name: str, tiles: WinogradTiles = F2X3) -> ConvEntry:
    """``name(x, dy, dw, ws)``: the weight gradient of the correlation ``p`` (``dw`` is overwritten).
    The workspace holds the groups' partial sums and a flag, shared, then each thread's scratch."""
    e = WeightGradEmitter(mod, p, tiles)
    partial_bytes = round_up(e.groups * e.w_group * e.esize, 64)
    scratch_stride = e.scratch_bytes()
    phases = [(e.group_task(name + ".groups", scratch_stride), ["x", "dy", "shared", "scratch"]),
              (e.finish_task(name + ".finish"), ["shared", "dw", "flag"])]
    fallback = (e.direct_task(name + ".direct"), ["x", "dy", "dw"])
    return emit_guarded_entry(mod, name, ("x", "dy", "dw"), partial_bytes, scratch_stride, phases, [fallback])
