"""BLIS-style GEMM generator over *index maps*, so one engine serves matmul and every conv pass.

``C[M,N] (=|+=) alpha * A[M,K] @ B[K,N]`` where each operand element's address is separable:
``offset(r, c) = rows(r) + cols(c)``. Each axis is an :class:`IndexMap`: a mixed-radix split of
the flat index into digits, each digit with an element stride and (for convolutions) a contribution
to a spatial coordinate ``(h, w)``. An operand with a ``window`` reads zero where ``(h, w)`` falls
outside ``[0,H) x [0,W)``: that is the zero padding of an implicit im2col, gathered while packing,
so the im2col matrix is never materialized. Transposes are just strides.

Structure (all sizes are compile-time constants; shapes are fixed per compiled graph):
  jc (NC cols) -> pc (KC) -> pack B panel -> ic (MC rows) -> pack A block -> jr (NR) -> ir (MR)
  -> microkernel: MR x NR register tile of ``<VL x T>`` accumulators fed by ``llvm.fma``.
Packed panels are zero padded, so edge tiles run the same microkernel; only the C store is masked.

Determinism: every C element is the same chain of FMAs over k (KC blocks in order), whatever the
tile it lands in, so splitting rows or columns over threads gives bitwise identical results. A
small output over a long K sums K in groups fixed by the shapes (:func:`k_groups`), each group one
such chain, and adds the groups in order: the thread count still changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from opgrad.errors import CompileError

from .irtext import BYTES, LLVM_TYPE, FunctionEmitter, ModuleEmitter, float_const, iota_const, prefix_mask, splat_const
from .target import Target, cache_size, current_target, host_target
from .threads import PARALLEL_FOR, PARALLEL_FOR_DECL
from .views import Body, Scalar, VectorScalar, body_vectorizes

_I32_LIMIT = 2**31 - 1
#: GEMMs below this many flops pack without the transposing path (about 0.06 s of compile time
#: per GEMM, and their packing takes microseconds either way).
_RUNS_MIN_FLOPS = 1e6
#: Unpadded GEMMs below this many flops (a classifier's dense layer and its gradients) run as one
#: small loop nest instead of the packed engine: they take microseconds either way, and the
#: engine's packing and tile code cost about 0.3 s of compile time per GEMM.
SMALL_GEMM_MAX_FLOPS = 1e6


@dataclass(frozen=True)
class IndexMap:
    """Flat index -> (element offset, h, w) through digits of ``radices`` (outermost first).

    ``offset = base + sum(digit * stride)``, ``h = h0 + sum(digit * hs)``, ``w = w0 + sum(digit * ws)``.
    The outermost digit is not reduced modulo its radix, so ``radices[0]`` only documents the extent.
    """

    radices: tuple[int, ...]
    strides: tuple[int, ...]
    base: int = 0
    hs: tuple[int, ...] = ()
    h0: int = 0
    ws: tuple[int, ...] = ()
    w0: int = 0

    @staticmethod
    def strided(n: int, stride: int, base: int = 0) -> IndexMap:
        return IndexMap((n,), (stride,), base)

    @property
    def size(self) -> int:
        return math.prod(self.radices)

    @property
    def spatial(self) -> bool:
        return bool(self.hs or self.ws or self.h0 or self.w0)

    def offset_range(self) -> tuple[int, int]:
        """Smallest and largest offset over the whole axis (bounds for the i32 index check)."""
        lo = hi = self.base
        for r, s in zip(self.radices, self.strides, strict=True):
            lo += min(0, (r - 1) * s)
            hi += max(0, (r - 1) * s)
        return lo, hi

    # ----- IR emission -----

    def _digits(self, f: FunctionEmitter, x: str, ty: str) -> list[str]:
        digits: list[str] = []
        for r in reversed(self.radices[1:]):
            digits.append(f.val(f"urem {ty} {x}, {_const(ty, r)}", "dig"))
            x = f.val(f"udiv {ty} {x}, {_const(ty, r)}", "quo")
        digits.append(x)
        return list(reversed(digits))

    def _combine(self, f: FunctionEmitter, digits: list[str], coefs: tuple[int, ...], c0: int, ty: str) -> str:
        acc = _const(ty, c0)
        for d, c in zip(digits, coefs, strict=False):
            if c:
                acc = f.val(f"add {ty} {acc}, {f.val(f'mul {ty} {d}, {_const(ty, c)}', 'm')}", "s")
        return acc

    def terms(self, f: FunctionEmitter, x: str, ty: str = "i64") -> tuple[str, str, str]:
        """(offset, h, w) for index ``x`` of type ``ty`` (scalar ``i64`` or a ``<L x i32>`` vector)."""
        digits = self._digits(f, x, ty)
        off = self._combine(f, digits, self.strides, self.base, ty)
        h = self._combine(f, digits, self.hs, self.h0, ty)
        w = self._combine(f, digits, self.ws, self.w0, ty)
        return off, h, w


def _const(ty: str, v: int) -> str:
    if ty.startswith("<"):
        n, _, elem = ty[1:-1].partition(" x ")
        return splat_const(int(n), elem.strip(), str(v))
    return str(v)


@dataclass(frozen=True)
class Operand:
    """A matrix operand: ``rows`` and ``cols`` index maps, optional zero-padding ``window=(H, W)``."""

    rows: IndexMap
    cols: IndexMap
    window: tuple[int, int] | None = None

    @staticmethod
    def matrix(m: int, n: int, row_stride: int, col_stride: int) -> Operand:
        """A plain strided matrix; ``matrix(m, n, 1, m)`` is column-major, i.e. a transpose."""
        return Operand(IndexMap.strided(m, row_stride), IndexMap.strided(n, col_stride))

    def fits_offsets(self) -> bool:
        """Whether every element's offset fits the kernels' 32-bit offsets."""
        lo = self.rows.offset_range()[0] + self.cols.offset_range()[0]
        hi = self.rows.offset_range()[1] + self.cols.offset_range()[1]
        return lo >= -_I32_LIMIT and hi <= _I32_LIMIT


@dataclass(frozen=True)
class Epilogue:
    """``C[i, j] = body(s, [C[i, j], inputs[0][i, j], ...])``, applied where the GEMM finishes C.

    Each input is an operand in C's coordinates (a bias broadcast along the rows has row stride 0)
    or a constant. The elementwise consumer of a GEMM's result runs here while the result is in
    cache, instead of in a later pass that reads it back from memory (a weight update reads the
    gradient it was just given, a bias and activation read the layer's output)."""

    body: Body
    inputs: tuple[Operand | float, ...] = ()

    @property
    def operands(self) -> list[Operand]:
        """The inputs that are memory, in order: each is one more pointer argument of the GEMM."""
        return [x for x in self.inputs if isinstance(x, Operand)]

    @property
    def pointers(self) -> list[tuple[str, str]]:
        """The ``(type, name)`` parameters of the memory inputs in a kernel that takes them."""
        return [("ptr", f"e{i}") for i in range(len(self.operands))]

    def transposed(self) -> Epilogue:
        return Epilogue(self.body, tuple(Operand(x.cols, x.rows) if isinstance(x, Operand) else x
                                         for x in self.inputs))


#: A GEMM with an epilogue applies it to this many bytes of finished C panels at a time: few
#: enough to be in L2 still, enough that each row of the epilogue's inputs is read as a run of
#: lines (one panel's 96-byte piece of a row on its own page is a miss no prefetcher foresees).
EPILOGUE_BYTES = 96 << 10

#: The wide tile is taken only where it saves this much padded work: it loads A as often per FMA
#: but serves fewer rows per packed panel, and on a 128 x 9216 x 32 GEMM (3 % padding with 6
#: rows) it was 15 % slower.
WIDE_TILE_MAX_WORK = 0.92


@dataclass(frozen=True)
class Blocking:
    """Register and cache blocking; defaults follow PERF_NOTES (8x32 fp32 tile, KC=256, MC=128)."""

    mr: int
    nr: int
    vl: int
    kc: int
    mc: int
    nc: int

    @staticmethod
    def for_target(dtype: str, target: Target | None = None) -> Blocking:
        """Register tile sized to the register file: 8 x 2 vectors with 32 registers (AVX-512,
        AArch64), 6 x 2 with 16 (AVX2), leaving room for the B vectors and the A broadcast.
        ``target`` defaults to the one code is being generated for (the host unless set).

        Cache blocking follows the host's caches where sysfs gives them (BLIS's rule): a KC-deep
        A sliver and B panel fill about 3/4 of L1d, and an MC x KC block of A half of L2. Other
        targets, and hosts that do not say, keep KC = 256 and MC = 128 (fp32).
        """
        target = target or current_target()
        vl = target.vector_width(BYTES[dtype])
        return Blocking._sized(8 if target.vector_registers >= 32 else 6, 2 * vl, vl, dtype, target)

    @staticmethod
    def _sized(mr: int, nr: int, vl: int, dtype: str, target: Target) -> Blocking:
        """The register tile ``mr x nr`` with cache blocking for it on ``target``."""
        esize = BYTES[dtype]
        kc, mc = 256, (128 if esize == 4 else 64)
        if target == host_target():
            l1, l2 = cache_size(1), cache_size(2)
            if l1:
                kc = max(128, min(512, (l1 * 3 // 4 // ((mr + nr) * esize)) // 16 * 16))
            if l2:
                mc = max(4 * mr, min(512, l2 // 2 // (kc * esize)))
        return Blocking(mr=mr, nr=nr, vl=vl, kc=kc, mc=round_up(mc, mr) if mc % mr else mc, nc=2048)

    def for_shape(self, m: int, n: int, dtype: str, target: Target | None = None) -> Blocking:
        """This blocking, or the tile with the same accumulators two rows by three vectors wide
        (4 x 3 for 6 x 2) where that computes fewer padded rows and columns of ``m x n``.

        The padding of the last row tile is work thrown away: a batch of 32 rows in tiles of 6 is
        36 rows, 12 % of the FMAs; in tiles of 4 it is none. Measured on AVX2 (AMD EPYC, znver3),
        such a 32 x 9216 x 128 GEMM took 1.09 ms with 4 x 24 tiles against 1.18 ms with 6 x 16,
        and 96 x 2048 x 256 (no padding either way) 1.16 against 1.14 ms.
        """
        if self.mr % 3 or self.nr != 2 * self.vl:
            return self
        wide = Blocking._sized(self.mr * 2 // 3, 3 * self.vl, self.vl, dtype, target or current_target())

        return wide if wide.padded_work(m, n) <= WIDE_TILE_MAX_WORK * self.padded_work(m, n) else self

    def padded_work(self, m: int, n: int) -> int:
        """Output elements computed for an ``m x n`` C, its edge tiles padded to whole tiles."""
        return round_up(m, self.mr) * round_up(n, self.nr)


@dataclass(frozen=True)
class GemmSpec:
    """One GEMM ``C (=|+=) alpha * A @ B`` with shapes and layouts fixed at compile time."""

    m: int
    n: int
    k: int
    a: Operand
    b: Operand
    c: Operand
    dtype: str = "float32"
    alpha: float = 1.0
    accumulate: bool = False
    #: Problems with fewer flops than this run on the calling thread (dispatch would cost more).
    parallel_min_flops: float = 4e6
    #: What is applied to each finished element of C; its memory inputs are more pointer arguments.
    epilogue: Epilogue | None = None

    @staticmethod
    def dense(
        m: int, n: int, k: int, dtype: str = "float32", trans_a: bool = False, trans_b: bool = False,
        alpha: float = 1.0, accumulate: bool = False,
    ) -> GemmSpec:
        """Contiguous row-major operands; ``trans_a`` means A is stored as its transpose [K, M]."""
        a = Operand.matrix(m, k, 1, m) if trans_a else Operand.matrix(m, k, k, 1)
        b = Operand.matrix(k, n, 1, k) if trans_b else Operand.matrix(k, n, n, 1)
        c = Operand.matrix(m, n, n, 1)
        return GemmSpec(m, n, k, a, b, c, dtype, alpha, accumulate)


#: A C larger than this many L2 caches is written row tile by row tile, each row a run of lines
#: the prefetchers follow; down a panel, each tile's rows are lines on pages of their own, and
#: where C is not in cache every one is a miss. Measured on AMD EPYC (znver5, L2 1 MiB, 2
#: threads): 64 x 50000 x 32 0.60 -> 0.47 ms, 512 x 4096 x 512 5.1 -> 4.5 ms, 128 x 9216 x 32
#: with C evicted 0.28 -> 0.17 ms; where C fits in about one L2 (32 x 9216 x 128) walking down
#: the panels is 6 % faster, its packed panel then staying in L1 for the panel's row tiles.
C_IN_CACHE_L2S = 2

#: A GEMM with a long reduction and a small output sums K in this many groups at most (see
#: :func:`k_groups`), and keeps their partial sums in at most this many bytes.
K_GROUPS_MAX = 8
K_GROUPS_PARTIAL_BYTES = 256 << 10


@dataclass
class GemmPlan:
    """Blocking derived from a spec; ``workspace_per_thread`` bytes of scratch for packed panels
    (with K groups, the shared partial sums come first and are counted in every thread's share)."""

    spec: GemmSpec
    blk: Blocking
    kc: int = 0
    nc: int = 0
    split_n: bool = True
    #: Read A's rows in place instead of packing them (:func:`reads_a_in_place`).
    a_in_place: bool = False
    #: ``spec`` is the caller's GEMM transposed (:func:`oriented`): the entry's A and B pointers
    #: are the spec's B and A.
    operands_swapped: bool = False
    #: K is summed in this many groups of whole KC blocks (:func:`k_groups`).
    kgroups: int = 1
    #: KC blocks per group.
    group_blocks: int = 0
    partial_bytes: int = 0
    workspace_per_thread: int = 0
    #: The block's tile store applies the epilogue (:func:`epilogue_in_store`), row tile by row tile.
    epilogue_in_store: bool = False
    #: The block walks row tile by row tile, not down each panel (:data:`C_IN_CACHE_L2S`).
    walk_rows: bool = False
    names: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        s, b = self.spec, self.blk
        nk = -(-s.k // b.kc)
        self.kgroups = k_groups(s, nk)
        nk = round_up(nk, self.kgroups)
        self.kc = -(-s.k // nk)  # even K blocks: no tiny tail block
        self.group_blocks = nk // self.kgroups
        assert (self.kgroups - 1) * self.group_blocks * self.kc < s.k, "every K group must be non-empty"
        self.nc = min(b.nc, round_up(s.n, b.nr))
        self.split_n = s.n >= s.m
        self.a_in_place = reads_a_in_place(s, b)
        self.epilogue_in_store = self.kgroups == 1 and epilogue_in_store(s, b.vl)
        esize = BYTES[s.dtype]
        l2 = (cache_size(2) if current_target() == host_target() else 0) or 512 << 10
        if self.a_in_place:
            self._long_k_blocks(l2 // 2 // (b.nr * esize))
        # An epilogue applied to finished panels needs the walk down the panels.
        self.walk_rows = self.epilogue_in_store or (
            self.kgroups == 1 and s.epilogue is None and s.m * s.n * esize > C_IN_CACHE_L2S * l2)
        if self.walk_rows:
            # Walking row tile by row tile, every row tile reads all the packed panels of its NC
            # columns again: as many as fit in half of L2.
            panels = max(1, l2 // 2 // (panel_stride(self.kc, b.nr, s.dtype) * esize))
            self.nc = min(self.nc, panels * b.nr)
        a_bytes = -(-b.mc // b.mr) * panel_stride(self.kc, b.mr, s.dtype) * esize
        b_bytes = -(-self.nc // b.nr) * panel_stride(self.kc, b.nr, s.dtype) * esize
        if self.kgroups > 1:
            self.partial_bytes = round_up(self.kgroups * s.m * s.n * esize, 64)
        self.workspace_per_thread = self.partial_bytes + round_up(a_bytes, 64) + round_up(b_bytes, 64)

    def _long_k_blocks(self, most: int) -> None:
        """K blocks as long as a group (at most ``most``, so the B panel stays in half of L2).

        Reading A in place, a row tile streams its MR rows through the block. Short blocks walk
        every row tile's piece of a block before the next block: all M rows become streams in
        turn, more than a core's prefetchers track, and each piece is too short for them to ramp
        up. Long blocks keep MR streams running (128 x 32 x 9216, 2 threads, Intel Xeon Emerald
        Rapids: 0.31-0.41 -> 0.28-0.30 ms; unchanged on AMD Zen 5)."""
        group_k = -(-self.spec.k // self.kgroups)
        blocks = -(-group_k // max(most, self.blk.kc))
        kc = -(-group_k // blocks)
        if (self.kgroups - 1) * blocks * kc < self.spec.k:  # every K group keeps some of K
            self.kc, self.group_blocks = kc, blocks

    @property
    def block_spec(self) -> GemmSpec:
        """What one block call computes: the spec itself, or with K groups a group's plain sum
        into its row-major ``m x n`` partial (the reduction applies ``alpha`` and ``accumulate``)."""
        s = self.spec
        if self.kgroups == 1:
            return s
        return GemmSpec(s.m, s.n, s.k, s.a, s.b, Operand.matrix(s.m, s.n, s.n, 1), s.dtype)

    def workspace_bytes(self, nthreads: int) -> int:
        return self.workspace_per_thread * nthreads


def k_groups(spec: GemmSpec, k_blocks: int) -> int:
    """How many groups of KC blocks sum K apart, their partial sums added in order at the end.

    Splitting rows or columns over threads makes every thread pack the whole of the other operand;
    where the output is small and K long (a 12x12 kernel over a 12x12 input: 128 x 32 outputs,
    K = 9216), that packing is repeated on each thread, and a 32 x 9 output has too few tiles to
    share at all. Groups split K instead: each thread packs only its groups' part. The groups
    depend on the shapes alone, never on the thread count, so the sums do not either.
    """
    esize = BYTES[spec.dtype]
    if 2.0 * spec.m * spec.n * spec.k < spec.parallel_min_flops or spec.k < 4 * max(spec.m, spec.n):
        return 1
    groups = min(K_GROUPS_MAX, k_blocks, K_GROUPS_PARTIAL_BYTES // (spec.m * spec.n * esize))
    return groups if groups >= 2 else 1


def transposed(spec: GemmSpec) -> GemmSpec:
    """``C^T = B^T A^T``: the same products and sums, with the roles of rows and columns swapped."""
    return GemmSpec(spec.n, spec.m, spec.k, Operand(spec.b.cols, spec.b.rows, spec.b.window),
                    Operand(spec.a.cols, spec.a.rows, spec.a.window), Operand(spec.c.cols, spec.c.rows),
                    spec.dtype, spec.alpha, spec.accumulate, spec.parallel_min_flops,
                    spec.epilogue.transposed() if spec.epilogue else None)


def oriented(spec: GemmSpec) -> tuple[GemmSpec, Blocking]:
    """``spec`` or its transpose, with the register tile for it.

    The transpose is taken where K is summed in groups (C is then written by the groups' sum, in
    any layout) and its tiles pad at least ``1 - WIDE_TILE_MAX_WORK`` less: a weight gradient
    with 9 columns (a one-channel 3x3 conv) fills 9 of a tile's 16 columns; transposed, its 32 rows
    fill whole tiles. It is also taken where it copies at most half as many elements into packed
    panels (:func:`packing_cost`): ``x @ w.T`` with a batch of 32 rows and ``w`` of shape
    ``(128, 9216)`` packs all of ``w`` (transposing it); as ``w @ x.T`` it reads ``w``'s rows in
    place and packs only ``x``.
    """
    host = Blocking.for_target(spec.dtype)
    blk = host.for_shape(spec.m, spec.n, spec.dtype)
    swapped = transposed(spec)
    swapped_blk = host.for_shape(swapped.m, swapped.n, spec.dtype)
    grouped = k_groups(spec, -(-spec.k // blk.kc)) > 1
    work, swapped_work = blk.padded_work(spec.m, spec.n), swapped_blk.padded_work(swapped.m, swapped.n)
    if grouped and swapped_work <= WIDE_TILE_MAX_WORK * work:
        return swapped, swapped_blk
    packs_less = (packing_cost(swapped, swapped_blk, c_transposed=not grouped)
                  <= PACKING_SWAP_SHARE * packing_cost(spec, blk))
    if packs_less and swapped_work <= PACKING_SWAP_MAX_WORK * work:
        return swapped, swapped_blk
    return spec, blk


#: :func:`oriented` transposes a GEMM where that packs at most this share of the elements and
#: pads its tiles to at most this much more work. Measured on AMD EPYC (znver4, 2 threads):
#: 32 x 128 x 9216 0.70 -> 0.43 ms, 19 x 75 x 600 (11 % more padded work) 0.045 -> 0.039 ms;
#: 40 x 512 x 512, whose 40 rows pad to 64 as columns, 0.12 -> 0.19 ms.
PACKING_SWAP_SHARE = 0.5
PACKING_SWAP_MAX_WORK = 1.125

#: A transposed C element costs about this many packed elements: each tile of it goes through
#: the tile store's scalar loop (:func:`_store_tile`), each row a column of C.
TRANSPOSED_STORE_COST = 4


def packing_cost(spec: GemmSpec, blk: Blocking, c_transposed: bool = False) -> int:
    """Elements :func:`emit_gemm` copies into packed panels for ``spec``: A once per NC block of
    columns unless its rows are read in place (:func:`reads_a_in_place`), B once, plus
    ``TRANSPOSED_STORE_COST`` per element of C where its tiles are stored transposed."""
    a = 0 if reads_a_in_place(spec, blk) else spec.m * spec.k * -(-spec.n // blk.nc)
    c = TRANSPOSED_STORE_COST * spec.m * spec.n if c_transposed else 0
    return a + spec.k * spec.n + c


#: Packed panels are this far apart beyond their own size. Panels of a whole number of 4 KiB pages
#: (24 columns x 128 rows of float32 is 12 KiB) would all start in the same L1 set, and packing
#: row by row writes one row of every panel in turn: eight ways cannot hold 85 panels' rows.
PANEL_PAD_BYTES = 64


def panel_stride(kc: int, lanes: int, dtype: str) -> int:
    """Elements from one packed panel of ``kc x lanes`` to the next."""
    return kc * lanes + PANEL_PAD_BYTES // BYTES[dtype]


def reads_a_in_place(spec: GemmSpec, blk: Blocking) -> bool:
    """Whether the microkernel broadcasts A straight from its rows rather than from packed panels.

    Packing pays when a packed A block serves many column tiles. With at most two (a weight matrix
    against a batch of 32, say), it costs about as much as the FMAs it feeds, while rows contiguous
    in K can be read where they are: each of the MR rows is a sequential stream that the hardware
    prefetches, and the values, so the sums, are the same.
    """
    a = spec.a
    return (a.window is None and len(a.rows.radices) == 1 and len(a.cols.radices) == 1
            and a.cols.strides[0] == 1 and spec.n <= 2 * blk.nr)


def round_up(x: int, q: int) -> int:
    return -(-x // q) * q


def _gather(m: ModuleEmitter, n: int, t: str) -> str:
    suffix = f"v{n}{'f32' if t == 'float' else 'f64'}.v{n}p0"
    return m.intrinsic("masked.gather", f"<{n} x {t}>", [f"<{n} x ptr>", "i32", f"<{n} x i1>", f"<{n} x {t}>"], suffix)


def _scatter(m: ModuleEmitter, n: int, t: str) -> str:
    suffix = f"v{n}{'f32' if t == 'float' else 'f64'}.v{n}p0"
    return m.intrinsic("masked.scatter", "void", [f"<{n} x {t}>", f"<{n} x ptr>", "i32", f"<{n} x i1>"], suffix)


def _reduce_and(m: ModuleEmitter, n: int) -> str:
    return m.intrinsic("vector.reduce.and", "i1", [f"<{n} x i1>"], f"v{n}i1")


def _lane_terms(f: FunctionEmitter, imap: IndexMap, start: str, lanes: int) -> tuple[str, str, str, str]:
    """Vector (offset, h, w) for indices ``start + 0..lanes-1`` and the lane iota, all ``<lanes x i32>``."""
    vty = f"<{lanes} x i32>"
    s32 = f.val(f"trunc i64 {start} to i32")
    idx = f.val(f"add {vty} {f.splat(lanes, 'i32', s32)}, {iota_const(lanes)}", "lane")
    off, h, w = imap.terms(f, idx, vty)
    return off, h, w, idx


def masked_load(m: ModuleEmitter, n: int, t: str) -> str:
    """``llvm.masked.load`` of ``n`` elements of ``t``: (pointer, alignment, lane mask, values of
    the lanes left out)."""
    suffix = f"v{n}{'f32' if t == 'float' else 'f64'}.p0"
    return m.intrinsic("masked.load", f"<{n} x {t}>", ["ptr", "i32", f"<{n} x i1>", f"<{n} x {t}>"], suffix)


def masked_store(m: ModuleEmitter, n: int, t: str) -> str:
    """``llvm.masked.store`` of ``n`` elements of ``t``: (values, pointer, alignment, lane mask)."""
    suffix = f"v{n}{'f32' if t == 'float' else 'f64'}.p0"
    return m.intrinsic("masked.store", "void", [f"<{n} x {t}>", "ptr", "i32", f"<{n} x i1>"], suffix)


def transpose_square(f: FunctionEmitter, rows: list[str], vt: str, n: int) -> list[str]:
    """Transpose ``n`` vectors of ``n`` lanes (``n`` a power of two) with two-source shuffles."""
    rows = list(rows)
    b = n // 2
    while b >= 1:
        for i in range(n):
            if i & b:
                continue
            j = i + b
            lo = [c if not c & b else n + c - b for c in range(n)]
            hi = [c + b if not c & b else n + c for c in range(n)]
            ri, rj = rows[i], rows[j]
            for dst, sel in ((i, lo), (j, hi)):
                mask = ", ".join(f"i32 {x}" for x in sel)
                rows[dst] = f.val(f"shufflevector {vt} {ri}, {vt} {rj}, <{n} x i32> <{mask}>", "tr")
        b //= 2
    return rows


def _emit_pack(
    m: ModuleEmitter, name: str, op: Operand, lanes_are_rows: bool, lanes: int, vl: int, t: str, runs: bool = True
) -> None:
    """``pack(src, dst, lane0, nlanes, loop0, nloop)``: panels of ``[nloop][lanes]``, zero padded.

    For A the lanes are rows (MR); for B the lanes are columns (NR). Where the lanes are one plain
    run of memory, the full panels are copied row by row first. The other panels take one of three
    paths, chosen at run time: lanes contiguous in memory are copied with vector loads (masked
    loads under a padding window or on a partial panel); otherwise runs of ``vl`` consecutive loop
    indices that are contiguous in memory (im2col rows, a row-major A) are loaded per lane and
    transposed in registers; with 512-bit vectors, B's lanes along a row of memory (a strided
    conv's output pixels) are copied a row at a time (:func:`_pack_by_lane_rows`); anything else
    is a masked gather.
    """
    lane_map, loop_map = (op.rows, op.cols) if lanes_are_rows else (op.cols, op.rows)
    chunk = vl if lanes % vl == 0 else lanes  # B panels: whole vectors; A panels: one MR-lane vector
    nchunks = lanes // chunk
    vt, it, mt = f"<{chunk} x {t}>", f"<{chunk} x i32>", f"<{chunk} x i1>"
    esize = 4 if t == "float" else 8
    window = op.window
    f = FunctionEmitter(
        m, name, [("ptr", "src"), ("ptr", "dst"), ("i64", "lane0"), ("i64", "nlanes"), ("i64", "loop0"),
                  ("i64", "nloop")], linkage="internal", pipeline="lean",
    )
    gather = _gather(m, chunk, t)
    mload = masked_load(m, chunk, t)
    npanels = f.val(f"udiv i64 {f.add('%nlanes', lanes - 1)}, {lanes}")
    stride = f.add(f.mul("%nloop", lanes), PANEL_PAD_BYTES // esize)
    first_panel = "0"
    if lanes_are_plain_run(op, lanes_are_rows):
        # Lanes are a plain run of memory (a row-major B, a column-major A): full panels are copied
        # row by row, each source row read once from end to end. Panel by panel, every row of a
        # panel would be a 64-byte read from another page, which no hardware prefetcher follows:
        # on a 9216-column B that took longer than the FMAs the panel feeds.
        first_panel = f.val(f"udiv i64 %nlanes, {lanes}")
        with f.loop(0, "%nloop", hint="k") as k:
            roff, _, _ = loop_map.terms(f, f.add("%loop0", k))
            row = f.gep(t, "%src", f.add(roff, f.add("%lane0", lane_map.base)))
            dst_row = f.gep(t, "%dst", f.mul(k, lanes))
            with f.loop(0, first_panel, hint="pr") as p:
                src_panel = f.gep(t, row, f.mul(p, lanes))
                dst_panel = f.gep(t, dst_row, f.mul(p, stride))
                for c in range(nchunks):
                    v = f.load(vt, f.gep(t, src_panel, str(c * chunk)), align=esize)
                    f.store(vt, v, f.gep(t, dst_panel, str(c * chunk)), align=esize)
    with f.loop(first_panel, npanels, hint="p") as p:
        first = f.add("%lane0", f.mul(p, lanes))
        valid = f.sub("%nlanes", f.mul(p, lanes))
        panel = f.gep(t, "%dst", f.mul(p, stride))
        chunks = []
        all_contig, all_full = "true", "true"
        for c in range(nchunks):
            off, h, w, _ = _lane_terms(f, lane_map, f.add(first, c * chunk), chunk)
            v32 = f.val(f"trunc i64 {f.sub(valid, c * chunk)} to i32")
            lane_ok = f.val(f"icmp slt {it} {iota_const(chunk)}, {f.splat(chunk, 'i32', v32)}", "lok")
            off0 = f.val(f"extractelement {it} {off}, i32 0")
            expect = f.val(f"add {it} {f.splat(chunk, 'i32', off0)}, {iota_const(chunk)}")
            contig = f.call("i1", _reduce_and(m, chunk), [(mt, f.val(f"icmp eq {it} {off}, {expect}"))])
            full = f.call("i1", _reduce_and(m, chunk), [(mt, lane_ok)])
            all_contig = f.val(f"and i1 {all_contig}, {contig}")
            all_full = f.val(f"and i1 {all_full}, {full}")
            chunks.append((off, h, w, lane_ok, off0))

        def window_mask(h: str, w: str, rh: str, rw: str, mask: str) -> str:
            if window is None:
                return mask
            hh = f.val(f"add {it} {h}, {f.splat(chunk, 'i32', f.val(f'trunc i64 {rh} to i32'))}")
            ww = f.val(f"add {it} {w}, {f.splat(chunk, 'i32', f.val(f'trunc i64 {rw} to i32'))}")
            hok = f.val(f"icmp ult {it} {hh}, {splat_const(chunk, 'i32', str(window[0]))}")
            wok = f.val(f"icmp ult {it} {ww}, {splat_const(chunk, 'i32', str(window[1]))}")
            return f.val(f"and {mt} {mask}, {f.val(f'and {mt} {hok}, {wok}')}")

        def per_k(k: str, mode: str) -> None:
            """One packed row (loop index ``loop0 + k``) by lane vectors: plain, masked or gathered."""
            roff, rh, rw = loop_map.terms(f, f.add("%loop0", k))
            dst_row = f.gep(t, panel, f.mul(k, lanes))
            for c, (off, h, w, lane_ok, off0) in enumerate(chunks):
                out = f.gep(t, dst_row, str(c * chunk))
                if mode == "fast":
                    v = f.load(vt, f.gep(t, "%src", f.add(roff, f.val(f"sext i32 {off0} to i64"))), align=esize)
                elif mode == "masked":
                    src = f.val(f"getelementptr {t}, ptr %src, i64 {f.add(roff, f.val(f'sext i32 {off0} to i64'))}")
                    v = f.call(vt, mload, [("ptr", src), ("i32", str(esize)), (mt, window_mask(h, w, rh, rw, lane_ok)),
                                           (vt, "zeroinitializer")])
                else:
                    r32 = f.val(f"trunc i64 {roff} to i32")
                    idx = f.val(f"add {it} {off}, {f.splat(chunk, 'i32', r32)}")
                    ptrs = f.val(f"getelementptr {t}, ptr %src, {it} {idx}", "ptrs")
                    v = f.call(vt, gather, [(f"<{chunk} x ptr>", ptrs), ("i32", str(esize)),
                                            (mt, window_mask(h, w, rh, rw, lane_ok)), (vt, "zeroinitializer")])
                f.store(vt, v, out, align=esize)

        # Paths that can never apply (known from the index maps) are not emitted: code size is
        # compile time. A partial panel without a window takes the gather path.
        paths = []  # (condition, emit) in priority order; the gather loop is the fallback
        if _unit_step(lane_map):
            if window is None:
                paths.append((f.val(f"and i1 {all_contig}, {all_full}"), "fast"))
            else:
                paths.append((all_contig, "masked"))
        ends = []
        for cond, mode in paths:
            yes, no, end = f.if_else(cond, mode)
            f.block(yes)
            with f.loop(0, "%nloop", hint="k") as k:
                per_k(k, mode)
            f.br(end)
            f.block(no)
            ends.append(end)
        rows_of_lanes = (runs and not lanes_are_rows and vl * esize >= LANE_ROW_VECTOR_BYTES
                         and lane_row(lane_map, vl) is not None)
        if runs and _unit_step(loop_map) and (not rows_of_lanes or contiguous_run(loop_map) >= vl):
            runs_ok = all_full if window is None else "true"
            _pack_by_loop_runs(f, m, loop_map, window, chunks, chunk, lanes, vl, panel, t, per_k, runs_ok)
        elif runs and strided_row(loop_map, vl) is not None:
            _pack_by_strided_rows(f, m, loop_map, window, chunks, chunk, lanes, vl, panel, t, per_k)
        elif rows_of_lanes:
            _pack_by_lane_rows(f, m, lane_map, loop_map, window, first, f.smin(valid, lanes), lanes, vl, panel, t)
        else:
            with f.loop(0, "%nloop", hint="k") as k:
                per_k(k, "slow")
        for end in reversed(ends):
            f.br(end)
            f.block(end)
    f.ret_void()
    f.finish()


def lanes_are_plain_run(op: Operand, lanes_are_rows: bool) -> bool:
    """Whether the lanes of a packed panel (A's rows, B's columns) lie at consecutive addresses,
    with no padding window: a row-major B or a column-major A."""
    lane_map = op.rows if lanes_are_rows else op.cols
    return (op.window is None and len(lane_map.radices) == 1 and lane_map.strides[0] == 1
            and not lane_map.spatial)


def _unit_step(imap: IndexMap) -> bool:
    """Whether consecutive indices can be consecutive in memory: the innermost digit that ever
    changes (radix > 1, else the outermost) has stride 1."""
    for radix, stride in zip(reversed(imap.radices), reversed(imap.strides), strict=True):
        if radix > 1:
            return stride == 1
    return imap.strides[0] == 1


def _pack_by_loop_runs(
    f: FunctionEmitter, m: ModuleEmitter, loop_map: IndexMap, window: tuple[int, int] | None,
    chunks: list[tuple[str, str, str, str, str]], chunk: int, lanes: int, vl: int, panel: str, t: str,
    per_k: Callable[[str, str], None], runs_ok: str,
) -> None:
    """Runs of ``vl`` loop indices: where a whole run is contiguous in memory (and, under a window, on
    one input row), one vector load per lane and an in-register transpose; otherwise, and for the
    tail, per-index gathers. Without a window the loads are plain, so ``runs_ok`` (the panel is full)
    must hold; with one they are masked by the window and the panel's valid lanes."""
    vt, it, mt = f"<{vl} x {t}>", f"<{vl} x i32>", f"<{vl} x i1>"
    esize = 4 if t == "float" else 8
    mload = masked_load(m, vl, t)
    with f.loop(0, f.val(f"udiv i64 {f.add('%nloop', vl - 1)}, {vl}"), hint="kv") as kv:
        k0 = f.mul(kv, vl)
        koff, kh, kw, _ = _lane_terms(f, loop_map, f.add("%loop0", k0), vl)
        koff0 = f.val(f"extractelement {it} {koff}, i32 0")

        def run_of(first: str) -> str:
            return f.val(f"add {it} {f.splat(vl, 'i32', first)}, {iota_const(vl)}")

        conds = [f.val(f"icmp eq {it} {koff}, {run_of(koff0)}")]
        kh0 = kw0 = ""
        if window is not None:
            kh0 = f.val(f"extractelement {it} {kh}, i32 0")
            kw0 = f.val(f"extractelement {it} {kw}, i32 0")
            conds.append(f.val(f"icmp eq {it} {kh}, {f.splat(vl, 'i32', kh0)}"))
            conds.append(f.val(f"icmp eq {it} {kw}, {run_of(kw0)}"))
        cond = conds[0]
        for c in conds[1:]:
            cond = f.val(f"and {mt} {cond}, {c}")
        whole = f.icmp("sle", f.add(k0, vl), "%nloop")
        run = f.val(f"and i1 {f.val(f'and i1 {whole}, {runs_ok}')}, "
                    f"{f.call('i1', _reduce_and(m, vl), [(mt, cond)])}")
        yes, no, done = f.if_else(run, "run")
        f.block(yes)
        base = f.val(f"sext i32 {koff0} to i64")
        vecs = []
        for lane in range(lanes):
            ci, li = divmod(lane, chunk)
            off = chunks[ci][0]
            loff = f.val(f"sext i32 {f.val(f'extractelement <{chunk} x i32> {off}, i32 {li}')} to i64")
            if window is None:
                vecs.append(f.load(vt, f.gep(t, "%src", f.add(base, loff)), align=esize))
                continue
            mask = _lane_row_mask(f, chunks[ci], chunk, li, window, vl, kh0, kw0)
            src = f.val(f"getelementptr {t}, ptr %src, i64 {f.add(base, loff)}")
            vecs.append(f.call(vt, mload, [("ptr", src), ("i32", str(esize)), (mt, mask), (vt, "zeroinitializer")]))
        _store_transposed(f, vecs, vl, vl, lanes, panel, k0, t)
        f.br(done)
        f.block(no)
        with f.loop(k0, f.smin(f.add(k0, vl), "%nloop"), hint="ki") as k:
            per_k(k, "slow")
        f.br(done)
        f.block(done)


def contiguous_run(imap: IndexMap) -> int:
    """Length of the runs of consecutive indices that lie at consecutive addresses: the innermost
    digits whose strides chain from 1 (at least 1)."""
    run = 1
    for radix, stride in zip(reversed(imap.radices), reversed(imap.strides), strict=True):
        if radix == 1:
            continue
        if stride != run:
            break
        run *= radix
    return run


#: Shortest row of lanes that :func:`_pack_by_lane_rows` takes: shorter rows cost a masked load,
#: shuffle and store each for few lanes, and a gather per packed row does as well.
LANE_ROW_MIN = 4
#: Vectors at least this wide (AVX-512) pack rows of lanes: a two-source shuffle and a masked load
#: are one instruction each there. AVX2 code builds them from several, and a gather is quicker:
#: on AMD EPYC (znver4) a stride-2 3x3 conv's forward (x32x16x28x28, w32x16x3x3) took 0.49 ->
#: 0.39 ms with AVX-512 code, 0.53 -> 0.59 ms with AVX2 code.
LANE_ROW_VECTOR_BYTES = 64


def lane_row(imap: IndexMap, vl: int) -> tuple[int, int] | None:
    """(stride, length) of the innermost digit of a B panel's lanes where packing copies them a
    row at a time (:func:`_pack_by_lane_rows`): a conv's output pixels, ``stride`` elements apart
    in a row of ``length``, under a window a ``w`` that moves one column per element. None where
    the digit is shorter than :data:`LANE_ROW_MIN`, two vectors hold fewer of its elements (one
    pixel per image, a whole image apart), or the lanes do not move through memory."""
    inner = [i for i, r in enumerate(imap.radices) if r > 1]
    if not inner:
        return None
    i = inner[-1]
    stride, length = imap.strides[i], imap.radices[i]
    w_step = imap.ws[i] if imap.ws else 0
    h_step = imap.hs[i] if imap.hs else 0
    if imap.spatial and (w_step != stride or h_step):
        return None
    if stride < 1 or length < LANE_ROW_MIN or (2 * vl - 1) // stride + 1 < LANE_ROW_MIN:
        return None
    return stride, length


def _pack_by_lane_rows(
    f: FunctionEmitter, m: ModuleEmitter, lane_map: IndexMap, loop_map: IndexMap, window: tuple[int, int] | None,
    first: str, valid: str, lanes: int, vl: int, panel: str, t: str,
) -> None:
    """A B panel whose lanes are not one run of memory (a strided conv's output pixels, or pixels
    of two images) packed a row of lanes at a time: the panel's lanes split at the ends of rows of
    the lanes' innermost digit into pieces of at most ``vl``; each packed row takes a piece's
    elements by one or two masked loads over its span (zeros outside the window), every
    stride-th one picked by a shuffle, and one masked store at the piece's lanes. A gather per
    packed row, the fallback, takes several times as long: a stride-2 3x3 conv's im2col packed at
    1.0-1.5 G elements/s by gathers, 4.6 G by rows of lanes (AMD EPYC znver4, 2 threads)."""
    stride, length = lane_row(lane_map, vl) or (1, 1)
    vt, it, mt = f"<{vl} x {t}>", f"<{vl} x i32>", f"<{vl} x i1>"
    esize = 4 if t == "float" else 8
    piece = min(vl, (2 * vl - 1) // stride + 1)
    parts = 2 if stride * (piece - 1) + 1 > vl else 1
    mload, mstore = masked_load(m, vl, t), masked_store(m, vl, t)
    # The lanes of a partial panel past the operand are zeros in every packed row.
    with f.if_then(f.icmp("slt", valid, lanes), "lrz"), f.loop(0, "%nloop", hint="kz") as k:
        for c in range(lanes // vl):
            f.store(vt, "zeroinitializer", f.gep(t, panel, f.add(f.mul(k, lanes), c * vl)), align=esize)
    end = f.add(first, valid)
    last_row = f.val(f"udiv i64 {f.sub(end, 1)}, {length}")
    with f.loop(f.val(f"udiv i64 {first}, {length}"), f.add(last_row, 1), hint="lr") as row:
        row_first = f.mul(row, length)
        lo = f.smax(first, row_first)
        hi = f.smin(end, f.add(row_first, length))
        pieces = f.val(f"udiv i64 {f.add(f.sub(hi, lo), piece - 1)}, {piece}")
        with f.loop(0, pieces, hint="pc") as pc:
            j = f.add(lo, f.mul(pc, piece))
            count = f.val(f"trunc i64 {f.smin(f.sub(hi, j), piece)} to i32")
            span = f.add(f.mul(f.sub(count, 1, "i32"), stride, "i32"), 1, "i32")
            store_mask = f.val(f"icmp slt {it} {iota_const(vl)}, {f.splat(vl, 'i32', count)}")
            in_span = [f.val(f"icmp slt {it} {iota_const(vl, start=part * vl)}, {f.splat(vl, 'i32', span)}")
                       for part in range(parts)]
            lane_off, lane_h, lane_w = lane_map.terms(f, j)
            dst = f.gep(t, panel, f.sub(j, first))
            with f.loop(0, "%nloop", hint="k") as k:
                roff, rh, rw = loop_map.terms(f, f.add("%loop0", k))
                # Not inbounds: under a window a piece starts before its row (the padding).
                src = f.val(f"getelementptr {t}, ptr %src, i64 {f.add(roff, lane_off)}")
                loaded = []
                for part in range(parts):
                    mask = in_span[part]
                    if window is not None:
                        h32 = f.val(f"trunc i64 {f.add(lane_h, rh)} to i32")
                        w32 = f.val(f"trunc i64 {f.add(lane_w, rw)} to i32")
                        mask = f.val(f"and {mt} {mask}, {row_window_mask(f, h32, w32, window, vl, part * vl)}")
                    ptr = f.val(f"getelementptr {t}, ptr {src}, i64 {part * vl}") if part else src
                    loaded.append(f.call(vt, mload, [("ptr", ptr), ("i32", str(esize)), (mt, mask),
                                                     (vt, "zeroinitializer")]))
                values = loaded[0]
                if stride > 1:
                    # Piece element e is span element e * stride; lanes past the piece are not stored.
                    pick = ", ".join(f"i32 {e * stride if e < piece else 0}" for e in range(vl))
                    second = loaded[1] if parts == 2 else "zeroinitializer"
                    values = f.val(f"shufflevector {vt} {values}, {vt} {second}, <{vl} x i32> <{pick}>")
                f.call("void", mstore, [(vt, values), ("ptr", f.gep(t, dst, f.mul(k, lanes))), ("i32", str(esize)),
                                        (mt, store_mask)])


#: Shortest row that :func:`_pack_by_strided_rows` takes: a row's transpose costs the same
#: vl * log2(vl) shuffles however short it is, against one gather per index (7-pixel rows of a
#: stride-2 conv's weight gradient gained 8 % on AMD Zen 5, 14-pixel rows 45 %).
STRIDED_ROW_MIN = 6


def _lane_row_mask(f: FunctionEmitter, terms: tuple[str, str, str, str, str], chunk: int, lane: int,
                   window: tuple[int, int], vl: int, dh: str, dw: str, start: int = 0) -> str:
    """Mask of ``vl`` consecutive elements of one packed lane's input row, the first at column
    ``w + dw + start``: the lane is valid, its row ``h + dh`` and each column inside ``window``
    (``terms``: a chunk's (offsets, h, w, valid lanes, first offset); ``dh``, ``dw`` i32)."""
    _, h, w, lane_ok, _ = terms
    ok = f.val(f"extractelement <{chunk} x i1> {lane_ok}, i32 {lane}")
    lh = f.val(f"extractelement <{chunk} x i32> {h}, i32 {lane}")
    lw = f.val(f"extractelement <{chunk} x i32> {w}, i32 {lane}")
    inside = row_window_mask(f, f.add(lh, dh, "i32"), f.add(lw, dw, "i32"), window, vl, start)
    return f.val(f"and <{vl} x i1> {f.splat(vl, 'i1', ok)}, {inside}")


def row_window_mask(f: FunctionEmitter, row: str, column: str, window: tuple[int, int], vl: int,
                    start: int = 0) -> str:
    """Mask of ``vl`` consecutive elements of input row ``row``, the first at column ``column +
    start`` (both i32): the row and each column inside ``window``, the input's (height, width)."""
    it, mt = f"<{vl} x i32>", f"<{vl} x i1>"
    row_ok = f.val(f"icmp ult i32 {row}, {window[0]}")
    columns = f.val(f"add {it} {f.splat(vl, 'i32', column)}, {iota_const(vl, start=start)}")
    column_ok = f.val(f"icmp ult {it} {columns}, {splat_const(vl, 'i32', str(window[1]))}")
    return f.val(f"and {mt} {column_ok}, {f.splat(vl, 'i1', row_ok)}")


def _store_transposed(f: FunctionEmitter, vecs: list[str], vl: int, count: int, lanes: int, panel: str, k0: str,
                      t: str) -> None:
    """Store packed rows ``k0 .. k0+count`` of a panel from ``vecs``, one ``vl``-lane vector per
    lane holding its values for those rows: transposed in registers ``vl`` lanes at a time."""
    vt, esize = f"<{vl} x {t}>", 4 if t == "float" else 8
    for g in range(0, lanes, vl):
        group = vecs[g:g + vl]
        group += ["zeroinitializer"] * (vl - len(group))
        width = min(vl, lanes - g)
        for i, row in enumerate(transpose_square(f, group, vt, vl)[:count]):
            out = f.gep(t, panel, f.add(f.mul(f.add(k0, i), lanes), g))
            if width < vl:
                sel = ", ".join(f"i32 {x}" for x in range(width))
                row = f.val(f"shufflevector {vt} {row}, {vt} poison, <{width} x i32> <{sel}>")
            f.store(f"<{width} x {t}>", row, out, align=esize)


def strided_row(imap: IndexMap, vl: int) -> tuple[int, int] | None:
    """(stride, length) of the loop's innermost digit where packing takes it a row at a time
    (:func:`_pack_by_strided_rows`): a stride of 2 or more (a strided conv's output pixels, a
    dilated kernel's taps), rows of :data:`STRIDED_ROW_MIN` to ``vl`` indices whose elements
    span at most two vectors, and, under a window, a ``w`` that moves with the offset. None
    otherwise."""
    inner = [i for i, r in enumerate(imap.radices) if r > 1]
    if len(inner) < 2:
        return None
    i = inner[-1]
    stride, length = imap.strides[i], imap.radices[i]
    w_step = imap.ws[i] if imap.ws else 0
    h_step = imap.hs[i] if imap.hs else 0
    moves = not imap.spatial or (w_step == stride and h_step == 0)
    if stride < 2 or not STRIDED_ROW_MIN <= length <= vl or stride * (length - 1) + 1 > 2 * vl or not moves:
        return None
    return stride, length


def _pack_by_strided_rows(
    f: FunctionEmitter, m: ModuleEmitter, loop_map: IndexMap, window: tuple[int, int] | None,
    chunks: list[tuple[str, str, str, str, str]], chunk: int, lanes: int, vl: int, panel: str, t: str,
    per_k: Callable[[str, str], None],
) -> None:
    """Loop indices a row of the innermost digit at a time (a strided conv's output row, its
    pixels ``stride`` elements apart, or a dilated kernel's row of taps): each lane's row is
    read by one or two masked vector loads over its span, its every stride-th element picked by
    a shuffle, and the lanes transposed in registers. A gather per loop index (the fallback)
    costs several times as much. Indices before the first whole row and after the last take the
    per-index path."""
    stride, length = strided_row(loop_map, vl) or (0, 0)
    vt, it, mt = f"<{vl} x {t}>", f"<{vl} x i32>", f"<{vl} x i1>"
    esize = 4 if t == "float" else 8
    mload = masked_load(m, vl, t)
    span = stride * (length - 1) + 1
    two = span > vl
    head = f.smin(f.val(f"urem i64 {f.sub(length, f.val(f'urem i64 %loop0, {length}'))}, {length}"), "%nloop")
    with f.loop(0, head, hint="kh") as k:
        per_k(k, "slow")
    rows = f.val(f"udiv i64 {f.sub('%nloop', head)}, {length}")
    with f.loop(0, rows, hint="kr") as r:
        k0 = f.add(head, f.mul(r, length))
        roff, rh, rw = loop_map.terms(f, f.add("%loop0", k0))
        rh32, rw32 = (f.val(f"trunc i64 {x} to i32") for x in (rh, rw))
        in_span = [f.val(f"icmp ult {it} {iota_const(vl, start=part * vl)}, {splat_const(vl, 'i32', str(span))}")
                   for part in range(2 if two else 1)]
        vecs = []
        for lane in range(lanes):
            ci, li = divmod(lane, chunk)
            off, lane_ok = chunks[ci][0], chunks[ci][3]
            loff = f.val(f"sext i32 {f.val(f'extractelement <{chunk} x i32> {off}, i32 {li}')} to i64")
            base = f.gep(t, "%src", f.add(roff, loff))
            parts = []
            for part in range(2 if two else 1):
                if window is not None:
                    lane_mask = _lane_row_mask(f, chunks[ci], chunk, li, window, vl, rh32, rw32, part * vl)
                else:
                    lane_mask = f.splat(vl, "i1", f.val(f"extractelement <{chunk} x i1> {lane_ok}, i32 {li}"))
                mask = f.val(f"and {mt} {in_span[part]}, {lane_mask}")
                src = f.val(f"getelementptr {t}, ptr {base}, i64 {part * vl}")
                parts.append(f.call(vt, mload, [("ptr", src), ("i32", str(esize)), (mt, mask),
                                                (vt, "zeroinitializer")]))
            # Row element j is span element j * stride; lanes past the row are never stored.
            pick = ", ".join(f"i32 {j * stride if j < length else 0}" for j in range(vl))
            second = parts[1] if two else "zeroinitializer"
            vecs.append(f.val(f"shufflevector {vt} {parts[0]}, {vt} {second}, <{vl} x i32> <{pick}>"))
        _store_transposed(f, vecs, vl, length, lanes, panel, k0, t)
    with f.loop(f.add(head, f.mul(rows, length)), "%nloop", hint="kt") as k:
        per_k(k, "slow")


def check_offsets(spec: GemmSpec, operands: Sequence[Operand]) -> None:
    """A CompileError where an operand of ``spec`` reaches past the 32-bit offsets its kernel
    computes with (a batch of millions of images), rather than a kernel reading the wrong memory."""
    if not all(op.fits_offsets() for op in operands):
        raise CompileError(f"a matrix product of {spec.m} x {spec.n} x {spec.k} ({spec.dtype}) addresses more than "
                           f"2**31 - 1 elements of one operand, past its kernel's 32-bit offsets: make the batch size "
                           "(or the layer) smaller")


def emit_gemm(
    m: ModuleEmitter, spec: GemmSpec, name: str | None = None, blocking: Blocking | None = None
) -> GemmPlan:
    """Emit ``void @name(ptr a, ptr b, ptr c, ptr ws)`` into ``m``; returns the plan (workspace size).

    ``ws`` must hold ``plan.workspace_bytes(nthreads)`` bytes, 64-byte aligned, for the pool size.
    """
    check_offsets(spec, (spec.a, spec.b, spec.c))
    assert spec.c.window is None, "C cannot have a padding window"
    assert min(spec.m, spec.n, spec.k) >= 1
    swapped = False
    # The small GEMM reads A, B and C as the caller passes them: it is never transposed.
    small = blocking is None and is_small(spec)
    if blocking is not None:
        blk = blocking
    elif small:
        blk = Blocking.for_target(spec.dtype)
    else:
        oriented_spec, blk = oriented(spec)
        swapped, spec = oriented_spec is not spec, oriented_spec
    plan = GemmPlan(spec, blk, operands_swapped=swapped)
    base = m.unique(name or f"gemm_{spec.m}x{spec.n}x{spec.k}")
    m.declare(PARALLEL_FOR, PARALLEL_FOR_DECL)
    t = LLVM_TYPE[spec.dtype]
    if spec.epilogue is not None:
        check_offsets(spec, spec.epilogue.operands)
        if small:  # applied to each finished row where it waits in the workspace (_emit_small_gemm)
            row = Operand(IndexMap.strided(spec.m, 0), IndexMap.strided(spec.n, 1))
            emit_epilogue(m, base + ".epilogue", row, spec.epilogue, spec.dtype)
        elif not plan.epilogue_in_store:
            emit_epilogue(m, base + ".epilogue", spec.c, spec.epilogue, spec.dtype)
    if small:
        plan.epilogue_in_store = False
        plan.workspace_per_thread = small_gemm_workspace(spec)
        _emit_small_gemm(m, base, spec, t)
        plan.names = {"entry": base}
        return plan
    runs = 2.0 * spec.m * spec.n * spec.k >= _RUNS_MIN_FLOPS
    _emit_pack(m, base + ".pack_a", spec.a, True, blk.mr, blk.vl, t, runs)
    _emit_pack(m, base + ".pack_b", spec.b, False, blk.nr, blk.vl, t, runs)
    _emit_block(m, base, plan, t)
    _emit_task_and_entry(m, base, plan)
    plan.names = {"entry": base, "block": base + ".block"}
    return plan


def is_small(spec: GemmSpec) -> bool:
    """Whether :func:`emit_gemm` (with the host's blocking) emits ``spec`` as the small GEMM, which
    neither packs nor splits over threads."""
    return spec.a.window is None and spec.b.window is None and 2.0 * spec.m * spec.n * spec.k < SMALL_GEMM_MAX_FLOPS


def writes_c_once(spec: GemmSpec) -> bool:
    """Whether :func:`emit_gemm` (with the host's blocking) stores each element of C once, with
    the epilogue applied before that store: the small GEMM, or one K block, no K groups and the
    epilogue in the tile store.

    Then C may be the memory of an epilogue input laid out as C is (a weight update written over
    the weights it reads): each input element is loaded in the store of its own C element, before
    that store, and by nothing else. A GEMM summing K in blocks stores partial sums in C first,
    and a separate epilogue pass reads its inputs after C is stored."""
    if spec.epilogue is None:
        return False
    if is_small(spec):
        return True  # its epilogue runs on each row before the row is stored (_emit_small_gemm)
    oriented_spec, blk = oriented(spec)
    plan = GemmPlan(oriented_spec, blk, operands_swapped=oriented_spec is not spec)
    return plan.epilogue_in_store and plan.kgroups == 1 and plan.kc >= oriented_spec.k


#: Rows of A whose FMA chains the small GEMM runs side by side (one vector of C's row each).
SMALL_GEMM_ROWS = 8


def small_gemm_workspace(spec: GemmSpec) -> int:
    """Bytes of the small GEMM's scratch (:func:`_emit_small_gemm`): B packed ``k x n`` padded to
    whole vectors where its columns are not contiguous, then :data:`SMALL_GEMM_ROWS` rows of C's
    values."""
    esize = BYTES[spec.dtype]
    columns = round_up(spec.n, current_target().vector_width(esize))
    packed = 0 if lanes_are_plain_run(spec.b, False) else round_up(spec.k * columns * esize, 64)
    return packed + round_up(SMALL_GEMM_ROWS * columns * esize, 64)


def _emit_small_gemm(m: ModuleEmitter, base: str, spec: GemmSpec, t: str) -> None:
    """``base(a, b, c, ws)`` on the calling thread. :data:`SMALL_GEMM_ROWS` rows of A at a time,
    each vector of their C columns accumulates ``A[i,k] * B[k,:]`` in registers, k in order, so
    each C element is one FMA chain over k as in the packed engine; the rows' chains run side by
    side, which hides the FMA latency. B's rows are read in place where its columns are
    contiguous (a masked load for the last part of a row), else first copied into ``ws`` as
    ``k`` rows of ``n`` contiguous values, zero-padded to whole vectors. The rows' values then
    go to C through ``ws`` with ``alpha``, accumulation and the epilogue."""
    esize = BYTES[spec.dtype]
    vl = current_target().vector_width(esize)
    vt = f"<{vl} x {t}>"
    vfma = m.fma(vt)
    columns = round_up(spec.n, vl)
    in_place = lanes_are_plain_run(spec.b, False)
    extras = epilogue_pointers(spec)
    f = FunctionEmitter(m, base, [("ptr", "a"), ("ptr", "b"), ("ptr", "c"), *extras, ("ptr", "ws")],
                        pipeline="explicit")
    rows_out = "%ws"
    if not in_place:
        packed = f.gep("i8", "%ws", str(round_up(SMALL_GEMM_ROWS * columns * esize, 64)))
        with f.loop(0, spec.k, hint="pk") as k:
            b_row, _, _ = spec.b.rows.terms(f, k)
            dst = f.gep(t, packed, f.mul(k, columns))
            with f.loop(0, spec.n, hint="pj") as j:
                b_col, _, _ = spec.b.cols.terms(f, j)
                f.store(t, f.load(t, f.gep(t, "%b", f.add(b_row, b_col))), f.gep(t, dst, j))
            with f.loop(spec.n, columns, hint="pz") as j:
                f.store(t, "0.0", f.gep(t, dst, j))
    accs = [f.alloca(vt, f"acc{r}") for r in range(SMALL_GEMM_ROWS)]
    tail = spec.n % vl if in_place else 0

    def b_vector(k: str, first: str) -> str:
        """B[k, first .. first + VL), zeros past column n."""
        if not in_place:
            return f.load(vt, f.gep(t, packed, f.add(f.mul(k, columns), first)), align=esize)
        b_row, _, _ = spec.b.rows.terms(f, k)
        ptr = f.gep(t, "%b", f.add(f.add(b_row, spec.b.cols.base), first))
        if not tail or first != str(spec.n - tail):
            return f.load(vt, ptr, align=esize)
        return f.call(vt, masked_load(m, vl, t), [("ptr", ptr), ("i32", str(esize)),
                                                   (f"<{vl} x i1>", prefix_mask(vl, tail)), (vt, "zeroinitializer")])

    def row_group(i0: str, rows: int) -> None:
        a_rows = [spec.a.rows.terms(f, f.add(i0, r))[0] for r in range(rows)]

        def column_vector(first: str) -> None:
            for r in range(rows):
                f.store(vt, "zeroinitializer", accs[r])
            with f.loop(0, spec.k, hint="k") as k:
                a_col, _, _ = spec.a.cols.terms(f, k)
                bv = b_vector(k, first)
                for r in range(rows):
                    av = f.splat(vl, t, f.load(t, f.gep(t, "%a", f.add(a_rows[r], a_col))))
                    f.store(vt, f.call(vt, vfma, [(vt, av), (vt, bv), (vt, f.load(vt, accs[r]))]), accs[r])
            for r in range(rows):
                f.store(vt, f.load(vt, accs[r]), f.gep(t, rows_out, f.add(r * columns, first)), align=esize)

        with f.loop(0, (spec.n - tail if in_place else columns) // vl, hint="cv") as cv:
            column_vector(f.mul(cv, vl))
        if tail:
            column_vector(str(spec.n - tail))
        def row_out(i: str, row: str, to_c: bool, scale: bool) -> None:
            """The row's values (with ``alpha`` and accumulation where ``scale``) to row ``i`` of C,
            or back into the row where not ``to_c``."""
            c_row, _, _ = spec.c.rows.terms(f, i)
            with f.loop(0, spec.n, hint="s") as j:
                c_col, _, _ = spec.c.cols.terms(f, j)
                ptr = f.gep(t, "%c", f.add(c_row, c_col))
                at = f.gep(t, row, j)
                v = f.load(t, at)
                if scale and spec.alpha != 1.0:
                    v = f.val(f"fmul {t} {v}, {float_const(spec.alpha, t)}")
                if scale and spec.accumulate:
                    v = f.val(f"fadd {t} {f.load(t, ptr)}, {v}")
                f.store(t, v, ptr if to_c else at)

        for r in range(rows):
            i = f.add(i0, r)
            row = f.gep(t, rows_out, str(r * columns))
            if spec.epilogue is None:
                row_out(i, row, to_c=True, scale=True)
                continue
            # The epilogue finishes the row in the workspace and C is stored after it: each
            # element of C is written once, after the epilogue read its inputs (one of which may
            # be C's own memory: a weight updated in place).
            if spec.alpha != 1.0 or spec.accumulate:
                row_out(i, row, to_c=False, scale=True)
            call_epilogue(f, base + ".epilogue", row, _named(extras), i, "1", "0", str(spec.n))
            row_out(i, row, to_c=True, scale=False)

    whole = spec.m - spec.m % SMALL_GEMM_ROWS
    with f.loop(0, whole, SMALL_GEMM_ROWS, hint="i") as i0:
        row_group(i0, SMALL_GEMM_ROWS)
    with f.loop(whole, spec.m, hint="ir") as i:
        row_group(i, 1)
    f.ret_void()
    f.finish()


def epilogue_pointers(spec: GemmSpec) -> list[tuple[str, str]]:
    """The ``(type, name)`` parameters of the epilogue's memory inputs, after ``c``."""
    return spec.epilogue.pointers if spec.epilogue else []


def _named(params: list[tuple[str, str]]) -> list[str]:
    """The values of the parameters ``params`` inside the function that has them."""
    return ["%" + name for _, name in params]


def call_epilogue(f: FunctionEmitter, name: str, c: str, inputs: list[str], i0: str, rows: str, j0: str,
                  cols: str) -> None:
    """Apply the epilogue function ``name`` (:func:`emit_epilogue`) to C's rows ``i0 .. i0+rows``,
    columns ``j0 .. j0+cols``; ``inputs`` are the pointers to its memory inputs."""
    f.call("void", f"@{name}", [("ptr", c), *[("ptr", p) for p in inputs],
                                ("i64", i0), ("i64", rows), ("i64", j0), ("i64", cols)])


def epilogue_in_store(spec: GemmSpec, lanes: int) -> bool:
    """Whether the tile store applies ``spec``'s epilogue to the finished tile in registers, instead
    of a pass over finished panels that stores C, reads it back and stores it again.

    It does where every memory input can be read by whole vectors wherever C can: its columns are
    one unit-stride run, a broadcast, or laid out as C's are; and where the body has a vector form
    (:class:`VectorScalar`). A weight update fused into its gradient's GEMM then reads the old
    weights and writes the new ones once, and the gradient never reaches memory."""
    epi = spec.epilogue
    if epi is None:
        return False
    c_cols = spec.c.cols
    for op in epi.operands:
        cols = op.cols
        if not (cols.strides == (1,) or not any(cols.strides)
                or (cols.radices == c_cols.radices and cols.strides == c_cols.strides)):
            return False
    return has_vector_body(epi, spec.dtype, lanes)


def has_vector_body(epi: Epilogue, dtype: str, lanes: int) -> bool:
    """Whether ``epi``'s body has a vector form on ``lanes`` lanes (:class:`VectorScalar`)."""
    return body_vectorizes(epi.body, dtype, lanes, 1 + len(epi.inputs))


def emit_epilogue(m: ModuleEmitter, name: str, c: Operand, epi: Epilogue, dtype: str) -> None:
    """``name(c, e..., i0, rows, j0, cols)``: C[i, j] = body(C[i, j], inputs[i, j]...) over a block
    of the matrix ``c`` (a GEMM's result, or a convolution's output as (image, channel) x pixel).

    The loop along C's unit stride runs innermost, compiled by the vectorizing pipeline; a GEMM
    calls it on a few finished panels at a time (:data:`EPILOGUE_BYTES`), still in L2."""
    t = LLVM_TYPE[dtype]
    ptrs = epi.pointers
    f = FunctionEmitter(m, name, [("ptr noalias", "c"), *[("ptr noalias", p) for _, p in ptrs],
                                  ("i64", "i0"), ("i64", "rows"), ("i64", "j0"), ("i64", "cols")],
                        linkage="internal", pipeline="streaming")
    scalar = Scalar(f, dtype)
    maps = [c, *epi.operands]
    rows_inner = c.rows.strides == (1,) and c.cols.strides != (1,)
    outer_maps = [op.cols if rows_inner else op.rows for op in maps]
    inner_maps = [op.rows if rows_inner else op.cols for op in maps]
    # Where every inner map has two digits with the same low radix (a convolution's (image, pixel)
    # columns), the inner loop runs over one high digit at a time, so no element divides.
    radix = inner_maps[0].radices[-1]
    segmented = all(len(x.radices) == 2 and x.radices[1] == radix for x in inner_maps)

    def element(offsets: list[str]) -> None:
        at = f.gep(t, "%c", offsets[0])
        values, memory = [f.load(t, at)], iter(zip(ptrs, offsets[1:], strict=True))
        for x in epi.inputs:
            if isinstance(x, Operand):
                (_, p), off = next(memory)
                values.append(f.load(t, f.gep(t, "%" + p, off)))
            else:
                values.append(scalar.const(x))
        f.store(t, epi.body(scalar, values), at)

    rows, cols = ("%i0", f.add("%i0", "%rows")), ("%j0", f.add("%j0", "%cols"))
    (start, end), outer_range = (rows, cols) if rows_inner else (cols, rows)
    with f.loop(*outer_range, hint="eo") as outer:
        bases = [x.terms(f, outer)[0] for x in outer_maps]
        if not segmented:
            with f.loop(start, end, hint="ei") as inner:
                element([f.add(b, x.terms(f, inner)[0]) for b, x in zip(bases, inner_maps, strict=True)])
        else:
            last = f.val(f"udiv i64 {f.add(end, radix - 1)}, {radix}")
            with f.loop(f.val(f"udiv i64 {start}, {radix}"), last, hint="eg") as digit:
                first = f.mul(digit, radix)
                lo = f.sub(f.select(f.icmp("sgt", start, first), "i64", start, first), first)
                hi = f.sub(f.smin(end, f.add(first, radix)), first)
                digit_bases = [f.add(b, f.add(f.mul(digit, x.strides[0]), x.base))
                               for b, x in zip(bases, inner_maps, strict=True)]
                with f.loop(lo, hi, hint="ei") as low:
                    element([f.add(b, f.mul(low, x.strides[1])) for b, x in zip(digit_bases, inner_maps, strict=True)])
    f.ret_void()
    f.finish()


def _emit_block(m: ModuleEmitter, base: str, plan: GemmPlan, t: str) -> None:
    """``block(a, b, c, ws, m0, m1, n0, n1, k0, k1)``: the C sub-block [m0,m1) x [n0,n1) summed over
    K in [k0,k1) (whole KC blocks), on one thread."""
    s, b = plan.block_spec, plan.blk
    esize = BYTES[s.dtype]
    vl, mr, nr = b.vl, b.mr, b.nr
    vt, it = f"<{vl} x {t}>", f"<{vl} x i32>"
    fma = m.fma(vt)
    extras = epilogue_pointers(s)
    f = FunctionEmitter(
        m, base + ".block", [("ptr", "a"), ("ptr", "b"), ("ptr", "c"), *extras, ("ptr", "ws"), ("i64", "m0"),
                             ("i64", "m1"), ("i64", "n0"), ("i64", "n1"), ("i64", "k0"), ("i64", "k1")],
        linkage="internal", pipeline="explicit",
    )
    ap = "%ws"
    bp = f.gep("i8", "%ws", str(round_up(-(-b.mc // mr) * panel_stride(plan.kc, mr, s.dtype) * esize, 64)))
    pad = PANEL_PAD_BYTES // esize
    accs = [[f.alloca(vt, f"acc{r}_{c}") for c in range(nr // vl)] for r in range(mr)]
    # Where B's columns are one run of memory, the first row tile of each whole panel packs the
    # panel while it computes: the strided reads of B then overlap the FMAs instead of running as
    # a separate copy first, and the panel is in L1 for the other row tiles.
    fuse_pack = lanes_are_plain_run(s.b, False)
    # With one block of rows, no panel is read again after its last row tile: every whole panel
    # is packed into the first slot, which stays in L1 from one panel to the next instead of
    # missing on every store.
    one_row_block = f.icmp("sle", f.sub("%m1", "%m0"), b.mc)
    in_store = plan.epilogue_in_store
    walk_rows = plan.walk_rows
    with f.loop("%n0", "%n1", plan.nc, hint="jc") as jc:
        nc = f.smin(f.sub("%n1", jc), plan.nc)
        with f.loop("%k0", "%k1", plan.kc, hint="pc") as pc:
            kc = f.smin(f.sub("%k1", pc), plan.kc)
            whole = f.mul(f.val(f"udiv i64 {nc}, {nr}"), nr) if fuse_pack else "0"
            with f.if_then(f.icmp("slt", whole, nc), "packb"):
                tail = f.gep(t, bp, f.mul(f.val(f"udiv i64 {whole}, {nr}"), f.add(f.mul(kc, nr), pad)))
                f.call("void", f"@{base}.pack_b", [("ptr", "%b"), ("ptr", tail), ("i64", f.add(jc, whole)),
                                                    ("i64", f.sub(nc, whole)), ("i64", pc), ("i64", kc)])
            overwrite = "false" if s.accumulate else f.icmp("eq", pc, "%k0")
            with f.loop("%m0", "%m1", b.mc, hint="ic") as ic:
                mc = f.smin(f.sub("%m1", ic), b.mc)
                if not plan.a_in_place:
                    f.call("void", f"@{base}.pack_a", [("ptr", "%a"), ("ptr", ap), ("i64", ic), ("i64", mc),
                                                        ("i64", pc), ("i64", kc)])
                def panel_of(jr: str, shared_slot: bool) -> tuple[str, tuple[list[tuple[str, str]], str], str, str]:
                    """(valid columns, C's column terms, whether whole, packed B) of the panel at ``jr``."""
                    nvalid = f.smin(f.sub(nc, jr), nr)
                    col_info = _col_terms(f, m, s.c.cols, f.add(jc, jr), nvalid, nr, vl)
                    slot = f.val(f"udiv i64 {jr}, {nr}")
                    whole_panel = f.icmp("slt", jr, whole)
                    if fuse_pack and shared_slot:
                        slot = f.select(f.val(f"and i1 {one_row_block}, {whole_panel}"), "i64", "0", slot)
                    return nvalid, col_info, whole_panel, f.gep(t, bp, f.mul(slot, f.add(f.mul(kc, nr), pad)))

                def tile(jr: str, ir: str, panel: tuple[str, tuple[list[tuple[str, str]], str], str, str]) -> None:
                    nvalid, col_info, whole_panel, bpanel = panel
                    if plan.a_in_place:
                        # Rows past M repeat the last row: their sums are computed and not stored.
                        lda, first = s.a.rows.strides[0], f.add(ic, ir)
                        rows = [f.gep(t, "%a", f.add(f.mul(f.smin(f.add(first, r), s.m - 1), lda),
                                                     f.add(pc, s.a.rows.base + s.a.cols.base)))
                                for r in range(mr)]
                        a_at = _rows_in_place(f, rows, t)
                    else:
                        apanel = f.gep(t, ap, f.mul(f.val(f"udiv i64 {ir}, {mr}"), f.add(f.mul(kc, mr), pad)))
                        a_at = _packed_rows(f, apanel, mr, t)
                    if fuse_pack:
                        first_tile = f.val(f"and i1 {f.icmp('eq', ic, '%m0')}, {f.icmp('eq', ir, '0')}")
                        packing, packed, done = f.if_else(f.val(f"and i1 {first_tile}, {whole_panel}"))
                        f.block(packing)
                        source = _PanelSource(s.b, f.add(jc, jr), pc)
                        _microkernel(f, fma, accs, a_at, bpanel, kc, t, vt, nr, vl, source)
                        f.br(done)
                        f.block(packed)
                        _microkernel(f, fma, accs, a_at, bpanel, kc, t, vt, nr, vl)
                        f.br(done)
                        f.block(done)
                    else:
                        _microkernel(f, fma, accs, a_at, bpanel, kc, t, vt, nr, vl)
                    mvalid = f.smin(f.sub(mc, ir), mr)
                    where = (accs, f.add(ic, ir), mvalid, f.add(jc, jr), nvalid, col_info, overwrite)
                    if in_store:
                        finished, partial, stored = f.if_else(f.icmp("sge", f.add(pc, kc), "%k1"), "fin")
                        f.block(finished)
                        _store_tile(f, plan, *where, t, vt, it, extras)
                        f.br(stored)
                        f.block(partial)
                        _store_tile(f, plan, *where, t, vt, it)
                        f.br(stored)
                        f.block(stored)
                    else:
                        _store_tile(f, plan, *where, t, vt, it)

                if walk_rows:
                    # Row tile by row tile: the tiles along a row tile read the epilogue's inputs
                    # and write C as runs of lines the hardware prefetchers follow; down a panel
                    # each tile's rows are a line on a page of their own, a miss apiece (30 %
                    # slower on 128 x 9216 x 32 with an SGD update, AMD EPYC). Every row tile
                    # then reads all the packed panels again, from L2.
                    with f.loop(0, mc, mr, hint="ir") as ir, f.loop(0, nc, nr, hint="jr") as jr:
                        tile(jr, ir, panel_of(jr, shared_slot=False))
                else:
                    with f.loop(0, nc, nr, hint="jr") as jr:
                        panel = panel_of(jr, shared_slot=True)
                        with f.loop(0, mc, mr, hint="ir") as ir:
                            tile(jr, ir, panel)
                        if s.epilogue is not None:
                            # Every EPILOGUE_BYTES of finished panels (or at the block's last panel):
                            # the rows of its inputs are then read in runs the hardware prefetchers follow.
                            nvalid = panel[0]
                            index = f.val(f"udiv i64 {jr}, {nr}")
                            group = max(1, EPILOGUE_BYTES // (b.mc * nr * esize))
                            in_group = f.val(f"urem i64 {f.add(index, 1)}, {group}")
                            ends_group = f.val(f"or i1 {f.icmp('eq', in_group, '0')}, "
                                               f"{f.icmp('sge', f.add(jr, nr), nc)}")
                            with f.if_then(f.val(f"and i1 {ends_group}, {f.icmp('sge', f.add(pc, kc), '%k1')}"), "epi"):
                                first = f.mul(f.mul(f.val(f"udiv i64 {index}, {group}"), group), nr)
                                call_epilogue(f, base + ".epilogue", "%c", _named(extras), ic, mc, f.add(jc, first),
                                              f.sub(f.add(jr, nvalid), first))
    f.ret_void()
    f.finish()


def _col_terms(
    f: FunctionEmitter, m: ModuleEmitter, cmap: IndexMap, j0: str, nvalid: str, nr: int, vl: int
) -> tuple[list[tuple[str, str]], str]:
    """Per-chunk (column offsets, lane mask) of one C panel, and whether the panel is one full run."""
    it, mt = f"<{vl} x i32>", f"<{vl} x i1>"
    chunks = []
    contig = "true"
    first_off = ""
    for c in range(nr // vl):
        off, _, _, _ = _lane_terms(f, cmap, f.add(j0, c * vl), vl)
        v32 = f.val(f"trunc i64 {f.sub(nvalid, c * vl)} to i32")
        ok = f.val(f"icmp slt {it} {iota_const(vl)}, {f.splat(vl, 'i32', v32)}", "cok")
        if not first_off:
            first_off = f.val(f"extractelement {it} {off}, i32 0")
        expect = f.val(f"add {it} {f.splat(vl, 'i32', first_off)}, {iota_const(vl, start=c * vl)}")
        same = f.call("i1", _reduce_and(m, vl), [(mt, f.val(f"icmp eq {it} {off}, {expect}"))])
        full = f.call("i1", _reduce_and(m, vl), [(mt, ok)])
        contig = f.val(f"and i1 {contig}, {f.val(f'and i1 {same}, {full}')}")
        chunks.append((off, ok))
    return chunks, contig


def _packed_rows(f: FunctionEmitter, apanel: str, mr: int, t: str) -> Callable[[str, int], str]:
    """A's value for (k, row r) of a packed MR-row panel: ``apanel[k * MR + r]``."""
    return lambda k, r: f.load(t, f.gep(t, apanel, f.add(f.mul(k, mr), r)))


def _rows_in_place(f: FunctionEmitter, rows: list[str], t: str) -> Callable[[str, int], str]:
    """A's value for (k, row r) read in place: ``rows[r][k]``, each row contiguous in K."""
    return lambda k, r: f.load(t, f.gep(t, rows[r], k))


@dataclass(frozen=True)
class _PanelSource:
    """Where a whole B panel is read from when the microkernel packs it: B's columns ``col0 ..``
    (one run of memory) of the rows ``k0 + k``."""

    b: Operand
    col0: str
    k0: str

    def row(self, f: FunctionEmitter, t: str, k: str) -> str:
        roff, _, _ = self.b.rows.terms(f, f.add(self.k0, k))
        return f.gep(t, "%b", f.add(roff, f.add(self.col0, self.b.cols.base)))


def _prefetch_l2(f: FunctionEmitter, ptr: str, byte_offset: str | int = 0) -> None:
    """Prefetch the line at ``ptr + byte_offset`` into L2 (locality 2), not L1: the rows that
    the GEMM prefetches are often a power-of-two multiple apart, share one L1 set and would evict
    each other. The address may lie past the operand (so no ``inbounds``): a prefetch never
    faults."""
    f.prefetch(ptr, byte_offset, locality=2)


def _microkernel(
    f: FunctionEmitter, fma: str, accs: list[list[str]], a_at: Callable[[str, int], str], bpanel: str, kc: str,
    t: str, vt: str, nr: int, vl: int, source: _PanelSource | None = None,
) -> None:
    """MR x NR outer-product accumulation over kc; accumulators stay in registers after SROA.
    ``a_at(k, r)`` loads A's value for row ``r`` of the tile at ``k``.

    With a ``source``, B's rows are read from there and stored into ``bpanel`` as they are used,
    and the same row of the next panel is prefetched: each row of a panel is a line or two on
    another page, which the hardware prefetchers do not follow.
    """
    esize = 4 if t == "float" else 8
    align = vl * esize  # packed rows start on whole vectors
    for row in accs:
        for acc in row:
            f.store(vt, "zeroinitializer", acc)
    if source is not None:
        span = nr * esize  # the next panel's part of a row: bytes [span, 2 * span)
        line_offsets = sorted({*range(span, 2 * span, 64), 2 * span - 1})
    with f.loop(0, kc, hint="k") as k:
        brow = f.gep(t, bpanel, f.mul(k, nr))
        if source is None:
            bv = [f.load(vt, f.gep(t, brow, str(c * vl)), align=align) for c in range(nr // vl)]
        else:
            src = source.row(f, t, k)
            bv = [f.load(vt, f.gep(t, src, str(c * vl)), align=esize) for c in range(nr // vl)]
            for c, v in enumerate(bv):
                f.store(vt, v, f.gep(t, brow, str(c * vl)), align=align)
            for off in line_offsets:
                _prefetch_l2(f, src, off)
        for r in range(len(accs)):
            av = f.splat(vl, t, a_at(k, r))
            for c in range(nr // vl):
                cur = f.load(vt, accs[r][c])
                f.store(vt, f.call(vt, fma, [(vt, av), (vt, bv[c]), (vt, cur)]), accs[r][c])


def _store_tile(
    f: FunctionEmitter, plan: GemmPlan, accs: list[list[str]], i0: str, mvalid: str, j0: str, nvalid: str,
    col_info: tuple[list[tuple[str, str]], str], overwrite: str, t: str, vt: str, it: str,
    epilogue_inputs: list[tuple[str, str]] | None = None,
) -> None:
    """Write rows ``i0 .. i0+mvalid``, columns ``j0 .. j0+nvalid`` of the tile: vector stores on
    contiguous panels, otherwise (edge tiles, panels that cross a C row) the tile goes through a
    stack buffer and one scalar loop nest. The loop keeps the code small: unrolled masked scatters
    become dozens of branches each on AVX2, and they made up most of a GEMM's compile time.

    With ``epilogue_inputs`` (the epilogue's pointer parameters) the tile is C's final value and
    the epilogue is applied to it on the way (:func:`epilogue_in_store`)."""
    s, b = plan.block_spec, plan.blk
    esize = BYTES[s.dtype]
    chunks, contig = col_info
    alpha = None if s.alpha == 1.0 else splat_const(b.vl, t, float_const(s.alpha, t))
    width = len(chunks) * b.vl
    epi = s.epilogue if epilogue_inputs is not None else None
    pointers = _named(epilogue_inputs or [])

    def value(r: int, c: int) -> str:
        v = f.load(vt, accs[r][c])
        return f.val(f"fmul {vt} {v}, {alpha}") if alpha else v

    fast, slow, done = f.if_else(contig, "st")
    f.block(fast)
    vector = VectorScalar(f, s.dtype, b.vl)
    for r in range(b.mr):
        with f.if_then(f.icmp("slt", str(r), mvalid), "row"):
            roff, _, _ = s.c.rows.terms(f, f.add(i0, r))
            row_inputs = tile_row_inputs(f, epi, pointers, f.add(i0, r), j0, t) if epi else []
            for c, (off, _ok) in enumerate(chunks):
                off0 = f.val(f"extractelement {it} {off}, i32 0")
                ptr = f.gep(t, "%c", f.add(roff, f.val(f"sext i32 {off0} to i64")))
                old = f.load(vt, ptr, align=esize)
                v = value(r, c)
                new = f.val(f"select i1 {overwrite}, {vt} {v}, {vt} {f.val(f'fadd {vt} {old}, {v}')}")
                if epi is not None:
                    new = epi.body(vector, [new, *(x.at(f, c * b.vl, vector) for x in row_inputs)])
                f.store(vt, new, ptr, align=esize)
    f.br(done)
    f.block(slow)
    tile = f.alloca(f"[{b.mr * width} x {t}]", "tilebuf", align=64)
    offs = f.alloca(f"[{width} x i32]", "offbuf", align=64)
    for c, (off, _ok) in enumerate(chunks):
        f.store(it, off, f.gep("i32", offs, str(c * b.vl)), align=4)
        for row in range(b.mr):
            f.store(vt, value(row, c), f.gep(t, tile, str(row * width + c * b.vl)), align=esize)
    with f.loop(0, mvalid, hint="sr") as i:
        roff, _, _ = s.c.rows.terms(f, f.add(i0, i))
        with f.loop(0, nvalid, hint="sc") as j:
            x = f.load(t, f.gep(t, tile, f.add(f.mul(i, width), j)))
            ptr = f.gep(t, "%c", f.add(roff, f.val(f"sext i32 {f.load('i32', f.gep('i32', offs, j))} to i64")))
            old = f.load(t, ptr)
            new = f.val(f"select i1 {overwrite}, {t} {x}, {t} {f.val(f'fadd {t} {old}, {x}')}")
            if epi is not None:
                scalar = Scalar(f, s.dtype)
                inputs = tile_row_inputs(f, epi, pointers, f.add(i0, i), f.add(j0, j), t)
                new = epi.body(scalar, [new, *(x.at(f, 0, scalar) for x in inputs)])
            f.store(t, new, ptr)
    f.br(done)
    f.block(done)


@dataclass(frozen=True)
class RowInput:
    """One epilogue input along a row of C: a constant, a value broadcast along the row (loaded
    once), or a run of elements from ``start``."""

    t: str
    const: float | None = None
    broadcast: str = ""
    start: str = ""

    def at(self, f: FunctionEmitter, col: int, s: Scalar) -> str:
        """The value ``col`` elements into the run: a scalar, or from a :class:`VectorScalar` a
        vector of its lanes."""
        if self.const is not None:
            return s.const(self.const)
        if self.broadcast:
            return f.splat(s.lanes, self.t, self.broadcast) if isinstance(s, VectorScalar) else self.broadcast
        return f.load(s.t, f.gep(self.t, self.start, str(col)), align=BYTES[s.dtype])


def tile_row_inputs(f: FunctionEmitter, epi: Epilogue, pointers: list[str], i: str, j0: str,
                    t: str) -> list[RowInput]:
    """The epilogue's inputs on row ``i`` of C from column ``j0``. Memory inputs read the run of
    columns their map lays out from ``j0`` (:func:`epilogue_in_store` admits no others)."""
    values: list[RowInput] = []
    memory = iter(pointers)
    for x in epi.inputs:
        if not isinstance(x, Operand):
            values.append(RowInput(t, const=x))
            continue
        roff, _, _ = x.rows.terms(f, i)
        coff, _, _ = x.cols.terms(f, j0)
        start = f.gep(t, next(memory), f.add(roff, coff))
        values.append(RowInput(t, broadcast=f.load(t, start)) if not any(x.cols.strides)
                      else RowInput(t, start=start))
    return values


def _emit_task_and_entry(m: ModuleEmitter, base: str, plan: GemmPlan) -> None:
    """The parallel task, the reduction of K groups where there are several, and the entry point.

    Threads split the output rows or columns. With K groups, a thread takes whole units (one group
    over one part of the rows or columns); there are as many parts as it takes to give every
    thread a unit, and the parts do not change any sum, only who computes it.
    """
    s, b = plan.spec, plan.blk
    esize = BYTES[s.dtype]
    scratch_bytes = plan.workspace_per_thread - plan.partial_bytes
    extras = epilogue_pointers(s)
    f = FunctionEmitter(m, base + ".task", [("ptr", "ctx"), ("i32", "tid"), ("i32", "nt")], linkage="internal",
                        pipeline="lean")
    args = [f.load("ptr", f.gep("ptr", "%ctx", str(i))) for i in range(4)]
    # The block applies the epilogue itself only where it finishes C (one group of K).
    block_extras = [("ptr", f.load("ptr", f.gep("ptr", "%ctx", str(4 + i))))
                    for i in range(len(extras))] if plan.kgroups == 1 else []
    tid, nt = f.val("sext i32 %tid to i64"), f.val("sext i32 %nt to i64")
    extent, quantum = (s.n, b.nr) if plan.split_n else (s.m, b.mr)
    tiles = -(-extent // quantum)
    ws = f.gep("i8", args[3], f.add(plan.partial_bytes, f.mul(tid, scratch_bytes)))

    def share(part: str, parts: str) -> tuple[str, str]:
        lo = f.smin(f.mul(f.val(f"udiv i64 {f.mul(part, tiles)}, {parts}"), quantum), extent)
        hi = f.smin(f.mul(f.val(f"udiv i64 {f.mul(f.add(part, 1), tiles)}, {parts}"), quantum), extent)
        return lo, hi

    def call_block(c: str, lo: str, hi: str, k0: str, k1: str) -> None:
        with f.if_then(f.icmp("slt", lo, hi), "work"):
            rng = ["0", str(s.m), lo, hi] if plan.split_n else [lo, hi, "0", str(s.n)]
            f.call("void", f"@{base}.block", [("ptr", args[0]), ("ptr", args[1]), ("ptr", c), *block_extras,
                                               ("ptr", ws)] + [("i64", x) for x in (*rng, k0, k1)])

    if plan.kgroups == 1:
        call_block(args[2], *share(tid, nt), "0", str(s.k))
    else:
        groups, group_k = plan.kgroups, plan.group_blocks * plan.kc
        parts = f.val(f"udiv i64 {f.add(nt, groups - 1)}, {groups}")
        units = f.mul(parts, groups)
        first = f.val(f"udiv i64 {f.mul(tid, units)}, {nt}")
        last = f.val(f"udiv i64 {f.mul(f.add(tid, 1), units)}, {nt}")
        with f.loop(first, last, hint="unit") as unit:
            group = f.val(f"udiv i64 {unit}, {parts}")
            k0 = f.mul(group, group_k)
            partial = f.gep("i8", args[3], f.mul(group, s.m * s.n * esize))
            call_block(partial, *share(f.val(f"urem i64 {unit}, {parts}"), parts), k0,
                       f.smin(f.add(k0, group_k), s.k))
        _emit_group_sum(m, base, plan)
    f.ret_void()
    f.finish()

    f = FunctionEmitter(m, base, [("ptr", "a"), ("ptr", "b"), ("ptr", "c"), *extras, ("ptr", "ws")], pipeline="lean")
    operands = ("%b", "%a") if plan.operands_swapped else ("%a", "%b")
    extra_names = _named(extras)
    if 2.0 * s.m * s.n * s.k < s.parallel_min_flops:
        f.call("void", f"@{base}.block", [("ptr", p) for p in (*operands, "%c", *extra_names, "%ws")]
               + [("i64", x) for x in ("0", str(s.m), "0", str(s.n), "0", str(s.k))])
    else:
        ctx = f.alloca(f"[{4 + len(extras)} x ptr]", "ctx", align=8)
        for i, p in enumerate((*operands, "%c", "%ws", *extra_names)):
            f.store("ptr", p, f.gep("ptr", ctx, str(i)))
        f.call("void", "@" + PARALLEL_FOR, [("ptr", f"@{base}.task"), ("ptr", ctx)])
        if plan.kgroups > 1:
            f.call("void", "@" + PARALLEL_FOR, [("ptr", f"@{base}.sum"), ("ptr", ctx)])
    f.ret_void()
    f.finish()


def _emit_group_sum(m: ModuleEmitter, base: str, plan: GemmPlan) -> None:
    """Task ``base.sum``: ``C (=|+=) alpha * (((P0 + P1) + P2) + ...)`` over the K groups' row-major partial sums
    at the start of the workspace, split over C's rows. The partials are read by vectors; C takes
    vector stores where its rows are contiguous and one store per element otherwise (a transposed
    C). Written vectorized by hand so that it compiles with the GEMM's own cheap pipeline."""
    s = plan.spec
    t = LLVM_TYPE[s.dtype]
    esize = BYTES[s.dtype]
    vl = plan.blk.vl
    vt = f"<{vl} x {t}>"
    f = FunctionEmitter(m, base + ".sum", [("ptr", "ctx"), ("i32", "tid"), ("i32", "nt")], linkage="internal",
                        pipeline="lean")
    c, partials = (f.load("ptr", f.gep("ptr", "%ctx", str(i))) for i in (2, 3))
    inputs = [f.load("ptr", f.gep("ptr", "%ctx", str(4 + i))) for i in range(len(epilogue_pointers(s)))]
    contiguous = s.c.cols.strides == (1,) and s.c.cols.base == 0
    tid, nt = f.val("sext i32 %tid to i64"), f.val("sext i32 %nt to i64")
    lo = f.val(f"udiv i64 {f.mul(tid, s.m)}, {nt}")
    hi = f.val(f"udiv i64 {f.mul(f.add(tid, 1), s.m)}, {nt}")

    def columns(i: str, row: str, j: str, width: int) -> None:
        """C[i, j .. j+width) from the partials; ``width`` is ``vl`` or 1."""
        ty = vt if width > 1 else t
        at = f.add(f.mul(i, s.n), j)
        total = f.load(ty, f.gep(t, partials, at), align=esize)
        for group in range(1, plan.kgroups):
            part = f.load(ty, f.gep(t, partials, f.add(at, group * s.m * s.n)), align=esize)
            total = f.val(f"fadd {ty} {total}, {part}")
        if s.alpha != 1.0:
            scale = float_const(s.alpha, t)
            total = f.val(f"fmul {ty} {total}, {splat_const(vl, t, scale) if width > 1 else scale}")
        if width == 1 or contiguous:
            col, _, _ = s.c.cols.terms(f, j)
            ptr = f.gep(t, c, f.add(row, col))
            if s.accumulate:
                total = f.val(f"fadd {ty} {f.load(ty, ptr, align=esize)}, {total}")
            f.store(ty, total, ptr, align=esize)
            return
        for lane in range(vl):
            col, _, _ = s.c.cols.terms(f, f.add(j, lane))
            ptr = f.gep(t, c, f.add(row, col))
            value = f.val(f"extractelement {vt} {total}, i32 {lane}")
            if s.accumulate:
                value = f.val(f"fadd {t} {f.load(t, ptr)}, {value}")
            f.store(t, value, ptr)

    whole = s.n // vl * vl
    with f.loop(lo, hi, hint="i") as i:
        row, _, _ = s.c.rows.terms(f, i)
        if whole:
            with f.loop(0, whole, vl, hint="j") as j:
                columns(i, row, j, vl)
        if whole < s.n:
            with f.loop(whole, s.n, hint="jt") as j:
                columns(i, row, j, 1)
        if s.epilogue is not None:
            call_epilogue(f, base + ".epilogue", c, inputs, i, "1", "0", str(s.n))
    f.ret_void()
    f.finish()
