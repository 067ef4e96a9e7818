"""Winograd conv2d kernels (the three passes of 3x3 stride-1 convolutions) against float64 direct
sums, including padding, ragged tiles, non-finite inputs and the dispatch rules."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from numpy.lib.stride_tricks import sliding_window_view

import opgrad
import opgrad.compiler.winograd as winograd
from opgrad import ops
from opgrad.compiler import conv2d_geometry
from opgrad.compiler.convpass import ConvPass, emit_conv2d_pass
from opgrad.compiler.irtext import FunctionEmitter, ModuleEmitter
from opgrad.compiler.jit import NativeModule
from opgrad.compiler.kernels import CompiledKernel
from opgrad.compiler.target import cache_share, cache_size, current_target, resolve_target, use_target
from opgrad.compiler.threads import pool
from opgrad.compiler.winograd import (
    ACCURACY_MARGIN,
    BLOCK_BYTES,
    F2X3,
    F3X3,
    F4X3,
    F6X3,
    TILE_CHOICES,
    WinogradConv,
    WinogradEmitter,
    WinogradTiles,
    block_budget,
    choose_tiles,
    combination_ops,
    emit_winograd,
    estimated_cycles,
    linear_plan,
    tile_candidates,
    transform_op_cycles,
    winograd_conv,
)
from opgrad.compiler.winograd_weight import GROUP_TILES, GROUPS, MIN_GROUPS, WeightGradEmitter, emit_winograd_weight
from opgrad.env import CONV_ALGORITHM_VAR, conv_algorithm_setting
from opgrad.errors import ConfigError


@pytest.mark.parametrize("tiles", [F2X3, F3X3, F4X3], ids=["F(2,3)", "F(3,3)", "F(4,3)"])
def test_transforms_compute_the_one_dimensional_correlation(tiles: WinogradTiles) -> None:
    at, g, bt = np.array(tiles.at), np.array(tiles.g), np.array(tiles.bt)
    rng = np.random.default_rng(0)
    d, taps = rng.standard_normal(tiles.alpha), rng.standard_normal(3)
    want = [d[i : i + 3] @ taps for i in range(tiles.m)]
    np.testing.assert_allclose(at @ ((g @ taps) * (bt @ d)), want, rtol=1e-12, atol=1e-12)


def _forward(x: np.ndarray, w: np.ndarray, pads: tuple[int, int, int, int]) -> np.ndarray:
    top, left, bottom, right = pads
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (top, bottom), (left, right)))
    windows = sliding_window_view(xp, (3, 3), axis=(2, 3))
    return np.einsum("ncpqij,ocij->nopq", windows, w.astype(np.float64))


def _backward_weight(x: np.ndarray, dy: np.ndarray, pads: tuple[int, int, int, int]) -> np.ndarray:
    top, left, bottom, right = pads
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (top, bottom), (left, right)))
    windows = sliding_window_view(xp, (3, 3), axis=(2, 3))
    return np.einsum("ncpqij,nopq->ocij", windows, dy.astype(np.float64))


def _backward_data(dy: np.ndarray, w: np.ndarray, x_shape: tuple[int, ...],
                   pads: tuple[int, int, int, int]) -> np.ndarray:
    top, left, bottom, right = pads
    n, c, h, wd = x_shape
    oh, ow = dy.shape[2:]
    dxp = np.zeros((n, c, h + top + bottom, wd + left + right))
    for i in range(3):
        for j in range(3):
            dxp[:, :, i : i + oh, j : j + ow] += np.einsum("nopq,oc->ncpq", dy.astype(np.float64), w[:, :, i, j])
    return dxp[:, :, top : top + h, left : left + wd]


def _kernel(x_shape: tuple[int, ...], w_shape: tuple[int, ...], pads: tuple[int, int, int, int], pass_: str,
            tiles: WinogradTiles, dtype: str) -> CompiledKernel:
    nthreads = pool().nthreads  # the pool exists before a module links against it
    problem = winograd_conv(conv2d_geometry(x_shape, w_shape, 1, pads, 1, dtype), pass_, require_gain=False)
    assert problem is not None
    m = ModuleEmitter("winograd_test")
    if pass_ == "backward_weight":
        entry = emit_winograd_weight(m, problem, "conv", tiles)
    else:
        entry = emit_winograd(m, problem, "conv", tiles)
    return CompiledKernel(NativeModule(m.text()), entry.entry, 3, entry.workspace_per_thread * nthreads)


# (x shape, output channels, pads as (top, left, bottom, right)): ragged tiles in both directions,
# asymmetric padding up to the largest that applies (2), few and many channels, batch 1.
CASES = [
    ((2, 8, 7, 9), 8, (0, 0, 0, 0)),
    ((3, 5, 11, 6), 16, (1, 1, 2, 0)),
    ((1, 16, 5, 5), 7, (2, 2, 2, 2)),
    ((2, 3, 4, 13), 40, (0, 2, 1, 1)),
    ((2, 24, 18, 17), 20, (1, 1, 1, 1)),
]


# Every case in float32 with F(2,3) and F(3,3); float64, F(4,3) and F(6,3) on the raggedest ones.
RUNS = ([(case, "float32", tiles) for tiles in (F2X3, F3X3) for case in CASES]
        + [(case, "float64", tiles) for tiles in (F2X3, F3X3) for case in CASES[1:3]]
        + [(case, "float32", tiles) for tiles in (F4X3, F6X3) for case in CASES[1:4]])


@pytest.mark.parametrize("tiles", [F2X3, F3X3])
def test_the_weight_gradient_sums_its_groups_of_blocks_in_order(tiles: WinogradTiles) -> None:
    # Enough tiles for more than MIN_GROUPS groups; the count follows the tiles, never the
    # threads, and is a power of two (2, 4, ... threads share it evenly).
    x_shape, w_shape, pads = (5, 3, 66, 64), (4, 3, 3, 3), (0, 1, 0, 1)
    problem = winograd_conv(conv2d_geometry(x_shape, w_shape, 1, pads, 1, "float32"), "backward_weight",
                            require_gain=False)
    assert problem is not None
    emitter = WeightGradEmitter(ModuleEmitter("groups"), problem, tiles)
    total_tiles = problem.n * emitter.th * emitter.tw
    most = min(GROUPS, problem.n * emitter.blocks, total_tiles // GROUP_TILES)
    assert MIN_GROUPS < emitter.groups <= most < 2 * emitter.groups and emitter.groups & (emitter.groups - 1) == 0
    rng = np.random.default_rng(7)
    x = rng.standard_normal(x_shape).astype(np.float32)
    dy = rng.standard_normal((5, 4, 64, 64)).astype(np.float32)
    want = _backward_weight(x, dy, pads)
    dw = np.full(w_shape, np.nan, np.float32)
    _kernel(x_shape, w_shape, pads, "backward_weight", tiles, "float32")(x, dy, dw)
    # float32 sums of 20480 products each
    np.testing.assert_allclose(dw, want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_few_tiles_still_make_two_groups_where_there_are_two_blocks() -> None:
    # A ResNet's 14x14 layer at batch 32 has 512 tiles, one GROUP_TILES' worth: in one group a
    # second thread would transform its vector side again; two groups are summed in order.
    problem = winograd_conv(conv2d_geometry((32, 32, 14, 14), (32, 32, 3, 3), 1, (1, 1, 1, 1), 1, "float32"),
                            "backward_weight")
    assert problem is not None
    assert WeightGradEmitter(ModuleEmitter("few"), problem, F4X3).groups == MIN_GROUPS
    one_image = winograd_conv(conv2d_geometry((1, 32, 6, 6), (32, 32, 3, 3), 1, (1, 1, 1, 1), 1, "float32"),
                              "backward_weight", require_gain=False)
    assert one_image is not None
    assert WeightGradEmitter(ModuleEmitter("one"), one_image, F4X3).groups == 1  # one block


@pytest.mark.parametrize(("case", "dtype", "tiles"), RUNS,
                         ids=[f"x{c[0]}o{c[1]}p{c[2]}-{d}-F({t.m},3)" for c, d, t in RUNS])
def test_forward_and_backward_data_match_the_direct_sum(case: tuple, dtype: str, tiles: WinogradTiles) -> None:
    x_shape, cout, pads = case
    w_shape = (cout, x_shape[1], 3, 3)
    rng = np.random.default_rng(len(x_shape) + cout)
    x = rng.standard_normal(x_shape).astype(dtype)
    w = rng.standard_normal(w_shape).astype(dtype)
    want = _forward(x, w, pads)
    # float32 F(4,3) keeps about one digit less than the direct sum (coefficients up to 8).
    relative = {"float64": 1e-11, "float32": 2e-5 if tiles.m >= 4 else 2e-6}[dtype]
    tol = relative * max(1.0, np.abs(want).max())
    y = np.full(want.shape, np.nan, dtype)  # every output is written, none accumulated
    _kernel(x_shape, w_shape, pads, "forward", tiles, dtype)(x, w, y)
    np.testing.assert_allclose(y, want, rtol=0, atol=tol)

    dy = rng.standard_normal(want.shape).astype(dtype)
    want_dx = _backward_data(dy, w, x_shape, pads)
    dx = np.full(x_shape, np.nan, dtype)
    _kernel(x_shape, w_shape, pads, "backward_data", tiles, dtype)(dy, w, dx)
    np.testing.assert_allclose(dx, want_dx, rtol=0, atol=tol)

    want_dw = _backward_weight(x, dy, pads)
    dw = np.full(w_shape, np.nan, dtype)
    _kernel(x_shape, w_shape, pads, "backward_weight", tiles, dtype)(x, dy, dw)
    np.testing.assert_allclose(dw, want_dw, rtol=0, atol=relative * max(1.0, np.abs(want_dw).max()))


@pytest.mark.parametrize("x_shape", [(2, 3, 10, 58), (3, 5, 11, 6), (4, 6, 26, 26)],
                         ids=["15 tiles a row", "2 tiles a row, packed", "7 tiles a row, packed"])
@pytest.mark.parametrize("tiles", TILE_CHOICES, ids=[f"F({t.m},3)" for t in TILE_CHOICES])
def test_tile_loads_give_the_same_bits_as_16_byte_lanes(monkeypatch: pytest.MonkeyPatch, tiles: WinogradTiles,
                                                        x_shape: tuple[int, ...]) -> None:
    # F(4,3)'s float32 tiles are 16-byte lanes: the transforms read whole vectors of tiles and put
    # them back in order on the way to V. Smaller tiles on AVX-512 pick every m-th element of row
    # loads. Every pass equals the 16-byte-lane loads bitwise (on AVX2 hosts those are the loads).
    w_shape, pads = (8, x_shape[1], 3, 3), (1, 1, 1, 1)
    problem = winograd_conv(conv2d_geometry(x_shape, w_shape, 1, pads, 1, "float32"), "forward", require_gain=False)
    assert problem is not None
    emitter = WinogradEmitter(ModuleEmitter("w"), problem, tiles)
    assert emitter.whole_loads == (tiles is F4X3 and current_target().vector_width(4) >= 4)
    assert emitter.strided_picks == (tiles is not F4X3 and current_target().vector_width(4) >= 16)
    rng = np.random.default_rng(3)
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal(w_shape).astype(np.float32)
    dy = rng.standard_normal((x_shape[0], 8, *x_shape[2:])).astype(np.float32)
    calls = {"forward": (x, w, (x_shape[0], 8, *x_shape[2:])), "backward_data": (dy, w, x_shape),
             "backward_weight": (x, dy, w_shape)}
    results = []
    for host_loads in (True, False):
        if not host_loads:
            for name in ("whole_loads", "strided_picks"):
                monkeypatch.setattr(WinogradEmitter, name, property(lambda self: False))
        outs = []
        for pass_, (a, b, shape) in calls.items():
            out = np.full(shape, np.nan, np.float32)
            _kernel(x_shape, w_shape, pads, pass_, tiles, "float32")(a, b, out)
            outs.append(out)
        results.append(outs)
    for host, lanes in zip(*results, strict=True):
        np.testing.assert_array_equal(host, lanes)
    np.testing.assert_allclose(results[0][0], _forward(x, w, pads), rtol=0, atol=2e-5 * np.abs(results[0][0]).max())


@pytest.mark.parametrize("width", ["4 tiles", "3 tiles"])
@pytest.mark.parametrize("blocks", ["one block", "blocks of 3 tile rows"])
@pytest.mark.parametrize("tiles", TILE_CHOICES, ids=[f"F({t.m},3)" for t in TILE_CHOICES])
@pytest.mark.parametrize("pass_", ["forward", "backward_data", "backward_weight"])
def test_packed_tile_rows_give_the_same_bits_as_one_row_per_vector(
        pass_: str, tiles: WinogradTiles, blocks: str, width: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Outputs 4 tiles wide pack at least two tile rows per vector of 8 or 16 lanes, with a last
    # run that reaches past the block (5 tile rows, or blocks of 3) and, in the forward pass,
    # exact zeros kept; each lane computes what it computes alone, so the results are the same
    # bits, and no block writes another's rows. Rows of 3 tiles in 4 lanes store and load a run
    # through a lane shuffle (each row's tiles 3 columns after the last's).
    if blocks != "one block":
        monkeypatch.setattr(WinogradEmitter, "block_rows", lambda self: 3)
    monkeypatch.setattr(WinogradEmitter, "spanning_rows", lambda self: None)
    columns = 4 * tiles.m - 1 if width == "4 tiles" else 3 * tiles.m
    problem, x, w, dy = _layout_case((2, 8, 4 * tiles.m + 1, columns), pass_, 3)
    emitter = WinogradEmitter(ModuleEmitter("pack"), problem, tiles)
    assert emitter.pack >= 2 and emitter.blocks == (1 if blocks == "one block" else 2)
    packed = _run_pass(problem, pass_, tiles, x, w, dy)
    monkeypatch.setattr(WinogradEmitter, "row_packing", lambda self: (1, self.vl))
    np.testing.assert_array_equal(packed, _run_pass(problem, pass_, tiles, x, w, dy))


def _layout_case(x_shape: tuple[int, ...], pass_: str,
                 seed: int) -> tuple[WinogradConv, np.ndarray, np.ndarray, np.ndarray]:
    """A pass to run in two layouts: 16 output channels, pads (1, 0, 2, 1), the input's first
    three columns zero (exact zeros in the forward pass); the problem, x, w and dy."""
    w_shape, pads = (16, x_shape[1], 3, 3), (1, 0, 2, 1)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x_shape).astype(np.float32)
    x[..., :3] = 0
    w = rng.standard_normal(w_shape).astype(np.float32)
    geometry = conv2d_geometry(x_shape, w_shape, 1, pads, 1, "float32")
    problem = winograd_conv(geometry, pass_, require_gain=False)
    assert problem is not None
    dy = rng.standard_normal((x_shape[0], 16, geometry.oh, geometry.ow)).astype(np.float32)
    return problem, x, w, dy


def _run_pass(problem: WinogradConv, pass_: str, tiles: WinogradTiles, x: np.ndarray, w: np.ndarray,
              dy: np.ndarray) -> np.ndarray:
    """``pass_`` of ``problem`` compiled now (no cache: the layout is patched), the forward
    keeping exact zeros."""
    m = ModuleEmitter("layout")
    if pass_ == "backward_weight":
        entry = emit_winograd_weight(m, problem, "conv", tiles)
        args, out = (x, dy), np.full(w.shape, np.nan, np.float32)
    elif pass_ == "forward":
        entry = emit_winograd(m, problem, "conv", tiles, exact_zeros=True)
        args, out = (x, w), np.full(dy.shape, np.nan, np.float32)
    else:
        entry = emit_winograd(m, problem, "conv", tiles)
        args, out = (dy, w), np.full(x.shape, np.nan, np.float32)
    CompiledKernel(NativeModule(m.text(), use_cache=False), entry.entry, 3,
                   entry.workspace_per_thread * pool().nthreads)(*args, out)
    return out


@pytest.mark.parametrize("packing", ["packed rows", "one row per vector"])
@pytest.mark.parametrize("rows", [3, 5])
@pytest.mark.parametrize("tiles", TILE_CHOICES, ids=[f"F({t.m},3)" for t in TILE_CHOICES])
@pytest.mark.parametrize("pass_", ["forward", "backward_data"])
def test_blocks_across_images_give_the_same_bits_as_blocks_within_one(pass_: str, tiles: WinogradTiles, rows: int,
                                                                      packing: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # Three images of 4 x 3 tiles. Blocks of 3 tile rows split them into segments of 3, 1 + 2,
    # 2 + 1 and 3 rows; blocks of 5 into 4 + 1 and 3 + 2, and a tail of 2. Odd segments leave a
    # packed run half past their rows, whose pieces land in the next segment's columns before
    # it writes them. The GEMMs sum each column over the channels in one order wherever it lies,
    # so the outputs are the same bits; the forward pass keeps exact zeros, whose mask rows
    # follow the segments.
    if packing != "packed rows":
        monkeypatch.setattr(WinogradEmitter, "row_packing", lambda self: (1, self.vl))
    problem, x, w, dy = _layout_case((3, 8, 3 * tiles.m + 1, 3 * tiles.m), pass_, 11)

    def run(spanning: int | None) -> np.ndarray:
        monkeypatch.setattr(WinogradEmitter, "spanning_rows", lambda self: spanning)
        emitter = WinogradEmitter(ModuleEmitter("span"), problem, tiles, exact_zeros=pass_ == "forward")
        assert (emitter.th, emitter.spans) == (4, spanning is not None)
        if spanning is not None:
            assert (emitter.blocks, emitter.tail_rows) == (-(-12 // rows), 12 - (-(-12 // rows) - 1) * rows)
        return _run_pass(problem, pass_, tiles, x, w, dy)

    across = run(rows)
    np.testing.assert_array_equal(across, run(None))
    pads = (1, 0, 2, 1)
    want = _forward(x, w, pads) if pass_ == "forward" else _backward_data(dy, w, x.shape, pads)
    np.testing.assert_allclose(across, want, rtol=0, atol=(2e-5 if tiles.m >= 4 else 2e-6) * np.abs(want).max())
    if pass_ == "forward":
        assert np.array_equal(across == 0, want == 0)  # the exact zeros of the zero columns


def test_a_fused_epilogue_runs_on_each_image_of_a_block_across_images(monkeypatch: pytest.MonkeyPatch) -> None:
    # Bias and relu run on each segment's rows of its own image and channels: in registers
    # before each output row's store, or (a body without a vector form) on the stored rows.
    import opgrad
    from opgrad import ops

    rng = np.random.default_rng(12)
    x, w, b = (opgrad.var(name, shape, "float32")
               for name, shape in (("x", (3, 8, 10, 9)), ("w", (16, 8, 3, 3)), ("b", (16,))))
    fn = opgrad.function([x, w, b], ops.relu(ops.bias_add(ops.conv2d(x, w, padding=1), b)))
    xs, ws, bs = (rng.standard_normal(v.shape).astype(np.float32) for v in (x, w, b))
    results = []
    for spanning, in_registers in ((3, True), (None, True), (3, False), (None, False)):
        monkeypatch.setattr(WinogradEmitter, "spanning_rows", lambda self, rows=spanning: rows)
        monkeypatch.setattr("opgrad.compiler.winograd.has_vector_body", lambda *args, keep=in_registers: keep)
        compiled = opgrad.compile(fn, step_entries=True)
        assert compiled.step_labels == ["conv2d+bias_add+relu"]
        assert (".epilogue(" in compiled.ir.split("blocks(")[1].split("\ndefine")[0]) != in_registers
        results.append(compiled(xs, ws, bs))
    for result in results[1:]:
        np.testing.assert_array_equal(results[0], result)
    want = opgrad.evaluate(fn, xs, ws, bs)
    np.testing.assert_allclose(results[0], want, rtol=0, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize(("cout", "chunk_panels"), [(17, 1), (20, 2)])
def test_output_channels_in_chunks_give_the_same_bits_as_all_at_once(cout: int, chunk_panels: int,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # The GEMMs and output transform run chunk by chunk of output channels so that M stays in L2;
    # each output is the same sum wherever its chunk starts, with the epilogue in registers or on
    # the stored rows, blocks within or across images, a last chunk clipped at the channel count.
    import opgrad
    from opgrad import ops

    rng = np.random.default_rng(13)
    x, w, b = (opgrad.var(name, shape, "float32")
               for name, shape in (("x", (3, 8, 10, 9)), ("w", (cout, 8, 3, 3)), ("b", (cout,))))
    fn = opgrad.function([x, w, b], ops.relu(ops.bias_add(ops.conv2d(x, w, padding=1), b)))
    xs, ws, bs = (rng.standard_normal(v.shape).astype(np.float32) for v in (x, w, b))
    every = WinogradEmitter.output_chunk_panels
    for spanning, in_registers in ((3, True), (None, False)):
        monkeypatch.setattr(WinogradEmitter, "spanning_rows", lambda self, rows=spanning: rows)
        monkeypatch.setattr("opgrad.compiler.winograd.has_vector_body", lambda *args, keep=in_registers: keep)
        results, chunks = [], []
        for panels in (None, chunk_panels):
            def chosen(self: WinogradEmitter, panels: int | None = panels, seen: list[int] = chunks) -> int:
                whole = self.cout_pad // self.mr
                seen.append(whole // (panels or whole))
                return panels or whole

            monkeypatch.setattr(WinogradEmitter, "output_chunk_panels", chosen)
            results.append(opgrad.compile(fn)(xs, ws, bs))
        monkeypatch.setattr(WinogradEmitter, "output_chunk_panels", every)
        # 17 channels are 3 panels of 8 (the last 7 past the channels), 20 are 4 of 5.
        assert chunks[0] == 1 and chunks[-1] == {17: 3, 20: 2}[cout]
        np.testing.assert_array_equal(results[0], results[1])


def test_an_epilogue_input_that_varies_along_the_pixels_is_read_pixel_by_pixel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The compiler keeps such an epilogue (a relu gradient) in its own pass; where a block is
    # given one anyway, it must not take the in-register path, which reads each input once per
    # (image, channel).
    import opgrad
    from opgrad import ops

    monkeypatch.setattr("opgrad.compiler.convpass.accepts_epilogue", lambda epilogue: True)
    rng = np.random.default_rng(13)
    dy, w, y = (opgrad.var(name, shape, "float32")
                for name, shape in (("dy", (2, 16, 8, 8)), ("w", (16, 8, 3, 3)), ("y", (2, 8, 10, 10))))
    dx = ops.conv2d_backward_input(dy, w, input_size=(10, 10), strides=(1, 1), padding=(0, 0, 0, 0))
    fn = opgrad.function([dy, w, y], ops.multiply(dx, ops.greater(y, opgrad.const(0.0))))
    compiled = opgrad.compile(fn, step_entries=True)
    assert compiled.step_labels == ["conv2d_backward_input+greater+multiply"]
    args = [rng.standard_normal(v.shape).astype(np.float32) for v in (dy, w, y)]
    want = opgrad.evaluate(fn, *args)
    np.testing.assert_allclose(compiled(*args), want, rtol=0, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("threads", [1, 2, 16])
def test_blocks_run_across_images_where_the_tiles_leave_vectors_part_empty(threads: int,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # The seed CNN's conv2: backward-data by F(4,3) has 7 x 7 tiles per image, 49 columns in 64
    # (AVX-512). Blocks of 16 tile rows across images are 112 columns, 7 whole vectors: 14
    # blocks, 7 per thread on 2 threads; on one, blocks of 32 rows would be as few columns, and
    # 16 is nearer a block within an image (7 rows). On 16 threads, 16 blocks of 14 rows (98
    # tiles in 112 columns) give each thread one. The forward by F(3,3) (8 x 8 tiles, 4 whole
    # vectors) gains nothing and keeps a block per image.
    monkeypatch.setattr("opgrad.compiler.winograd.pool_size", lambda: threads)
    monkeypatch.setattr("opgrad.compiler.winograd.host_target", lambda: resolve_target("x86-64-v4"))
    monkeypatch.setattr("opgrad.compiler.winograd.block_budget", lambda: 4 << 20)
    with use_target(resolve_target("x86-64-v4")):
        data = WinogradEmitter(ModuleEmitter("d"), _problem((32, 32, 26, 26), 64, 0, "backward_data"), F4X3)
        forward = WinogradEmitter(ModuleEmitter("f"), _problem((32, 32, 26, 26), 64, 0), F3X3, exact_zeros=True)
    rows, cols = (14, 112) if threads == 16 else (16, 112)
    assert (data.spans, data.rows, data.cols, data.blocks, data.segment_rows) == (True, rows, cols, 224 // rows, 7)
    assert not forward.spans and (forward.rows, forward.cols) == (8, 64)


@pytest.mark.parametrize("tiles", TILE_CHOICES, ids=[f"F({t.m},3)" for t in TILE_CHOICES])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", ["data", "weight"])
def test_non_finite_inputs_give_the_direct_sums_nan_and_infinities(value: float, where: str,
                                                                   tiles: WinogradTiles) -> None:
    # The transforms add and subtract neighbouring taps, so one infinity can meet its own
    # negative (inf - inf = NaN) where the direct sum is an infinity: the kernel must notice
    # and give exactly the direct sum's non-finite pattern.
    x_shape, w_shape, pads = (2, 8, 9, 9), (8, 8, 3, 3), (1, 1, 1, 1)
    rng = np.random.default_rng(3)
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal(w_shape).astype(np.float32)
    if where == "data":
        x[1, 3, 4, 5] = x[0, 0, 0, 0] = value
    else:
        w[2, 5, 1, 1] = value
    with np.errstate(all="ignore"):
        want = _forward(x, w, pads)
    y = np.zeros(want.shape, np.float32)
    _kernel(x_shape, w_shape, pads, "forward", tiles, "float32")(x, w, y)
    _same_non_finite(y, want)
    if where == "data":  # the weight gradient reads the data and dY
        dy = rng.standard_normal(want.shape).astype(np.float32)
        with np.errstate(all="ignore"):
            want_dw = _backward_weight(x, dy, pads)
        dw = np.zeros(w_shape, np.float32)
        _kernel(x_shape, w_shape, pads, "backward_weight", tiles, "float32")(x, dy, dw)
        _same_non_finite(dw, want_dw)


def test_a_fallback_to_the_direct_sum_applies_the_epilogue_again() -> None:
    # An infinite input sends the pass to the direct sum, which rewrites every output: the fused
    # bias and relu must then run again, over all of them, and give the reference's values.
    import opgrad
    from opgrad import ops

    rng = np.random.default_rng(8)
    x, w, b = (opgrad.var(name, shape, "float32")
               for name, shape in (("x", (2, 8, 9, 9)), ("w", (8, 8, 3, 3)), ("b", (8,))))
    fn = opgrad.function([x, w, b], ops.relu(ops.bias_add(ops.conv2d(x, w, padding=1), b)))
    compiled = opgrad.compile(fn, step_entries=True)
    assert compiled.step_labels == ["conv2d+bias_add+relu"]
    xs, ws, bs = (rng.standard_normal(v.shape).astype(np.float32) for v in (x, w, b))
    xs[1, 3, 4, 5] = np.inf
    with np.errstate(all="ignore"):
        want = opgrad.evaluate(fn, xs, ws, bs)
    got = compiled(xs, ws, bs)
    # The transforms alone would put NaN (inf - inf) where the direct sum has infinities.
    assert np.isposinf(got).any() and not np.isnan(got).any()
    _same_non_finite(got, want)


def _same_non_finite(got: np.ndarray, want: np.ndarray) -> None:
    for test in (np.isnan, np.isposinf, np.isneginf):
        np.testing.assert_array_equal(test(got), test(want))
    finite = np.isfinite(want)
    if finite.any():
        np.testing.assert_allclose(got[finite], want[finite], rtol=0, atol=1e-5 * np.abs(want[finite]).max())


WINOGRAD_NAMES = {f"winograd F({tiles.m},3)" for tiles in TILE_CHOICES}
WEIGHT_NAMES = {f"winograd F(3x3,{tiles.m}x{tiles.m})" for tiles in TILE_CHOICES}


def _problem(x_shape: tuple[int, ...], cout: int, pad: int, pass_: str = "forward") -> WinogradConv:
    problem = winograd_conv(conv2d_geometry(x_shape, (cout, x_shape[1], 3, 3), 1, pad, 1), pass_)
    assert problem is not None
    return problem


def _run_plan(matrix: tuple[tuple[float, ...], ...], x: np.ndarray) -> np.ndarray:
    """Evaluate ``linear_plan(matrix)`` on ``x`` term by term, as the emitter does."""
    plan = linear_plan(matrix)
    values = list(x)
    for terms in plan.shared:
        assert all(src < len(values) for _, src in terms), "a shared sum reads only what exists before it"
        values.append(sum(coef * values[src] for coef, src in terms))
    return np.array([sum(coef * values[src] for coef, src in terms) for terms in plan.rows])


def _plain_ops(matrix: tuple[tuple[float, ...], ...]) -> int:
    return sum(combination_ops([(c, j) for j, c in enumerate(row) if c != 0]) for row in matrix)


@pytest.mark.parametrize("tiles", TILE_CHOICES, ids=lambda t: f"F({t.m},3)")
def test_linear_plans_of_the_transforms_compute_the_matrix_products(tiles: WinogradTiles) -> None:
    rng = np.random.default_rng(1)
    for matrix in (tiles.bt, tiles.at, tiles.g, tuple(zip(*tiles.at, strict=True)), tuple(zip(*tiles.g, strict=True))):
        x = rng.standard_normal(len(matrix[0]))
        np.testing.assert_allclose(_run_plan(matrix, x), np.array(matrix) @ x, rtol=1e-12, atol=1e-12)
        assert linear_plan(matrix).ops <= _plain_ops(matrix)


def test_linear_plans_share_the_sums_of_the_plus_minus_point_pairs() -> None:
    # F(4,3): rows of B^T for +-1 and +-2 are E + O and E - O (22 operations per column as plain
    # sums started from the first term, 16 started from a +1 term, 12 shared); A^T's columns for
    # +-1 and +-2 are summed and differenced once (14 -> 10).
    assert linear_plan(F4X3.bt).ops == 12
    assert linear_plan(F4X3.at).ops == 10
    # F(2,3) has nothing to share: its forward transforms stay exactly the plain sums.
    for matrix in (F2X3.bt, F2X3.at):
        assert linear_plan(matrix).ops == _plain_ops(matrix)
        assert not linear_plan(matrix).shared


_COEFFICIENTS = st.sampled_from([0.0, 0.0, 1.0, -1.0, 2.0, -2.0, 0.5, -4.0, 4.0, 8.0, -3.0])


@given(st.integers(2, 6).flatmap(lambda n: st.lists(st.lists(_COEFFICIENTS, min_size=n, max_size=n),
                                                    min_size=1, max_size=6)))
def test_linear_plans_of_any_matrix_compute_its_product_for_no_more_operations(rows: list[list[float]]) -> None:
    # Mirror pairs of rows and columns (the structure the planner looks for) are common here.
    matrix = tuple(tuple(row) for row in rows)
    x = np.random.default_rng(len(rows)).standard_normal(len(matrix[0]))
    np.testing.assert_allclose(_run_plan(matrix, x), np.array(matrix) @ x, rtol=1e-12, atol=1e-12)
    assert linear_plan(matrix).ops <= _plain_ops(matrix)


@pytest.mark.parametrize(("x_shape", "cout", "pad"), [((8, 16, 4, 4), 16, 1), ((32, 32, 26, 26), 64, 0),
                                                      ((32, 64, 56, 56), 64, 1), ((8, 128, 28, 28), 64, 1)])
def test_gradient_tiles_are_the_cheapest_estimate_unless_a_more_accurate_one_is_close(
        x_shape: tuple[int, ...], cout: int, pad: int) -> None:
    for pass_ in ("backward_data", "backward_weight"):
        problem = _problem(x_shape, cout, pad, pass_)
        chosen = choose_tiles(problem, pass_)
        allowed = tile_candidates(problem, pass_)
        cost = {tiles.m: estimated_cycles(problem, tiles, reduces_tiles=pass_ == "backward_weight")
                for tiles in allowed}
        assert chosen.m in cost
        assert cost[chosen.m] * (1 - ACCURACY_MARGIN) <= min(cost.values())
        for tiles in allowed:  # a more accurate candidate loses only by more than the margin
            if tiles.m < chosen.m:
                assert cost[chosen.m] < (1 - ACCURACY_MARGIN) * cost[tiles.m]


def test_tile_choice_follows_the_pass_and_the_output_size() -> None:
    # A 56x56 output with 64 channels is GEMM-bound in every pass: the forward pass too takes the
    # larger tiles, paying for their exact zeros.
    big = _problem((32, 64, 56, 56), 64, 1)
    assert choose_tiles(big, "forward") is F4X3
    # A 4x4 output fills few tiles and vector runs: the small tile's cheap transforms win. A 56x56
    # output with 64 channels is GEMM-bound: the larger tiles' fewer products win.
    assert choose_tiles(_problem((8, 16, 4, 4), 16, 1, "backward_data"), "backward_data") is F2X3
    for pass_ in ("backward_data", "backward_weight"):
        problem = _problem((32, 64, 56, 56), 64, 1, pass_)
        assert estimated_cycles(problem, choose_tiles(problem, pass_)) < 0.8 * estimated_cycles(problem, F2X3)
    # 128 x 128 channels: only F(2,3)'s 16 partial sums per weight fit the weight gradient's budget.
    assert tile_candidates(_problem((8, 128, 28, 28), 128, 1, "backward_weight"), "backward_weight") == [F2X3]
    assert choose_tiles(_problem((8, 128, 28, 28), 128, 1, "backward_weight"), "backward_weight") is F2X3


# (lanes, dtype, tile rows packed per vector): every vector width of both dtypes unpacked, and
# packed where two rows each keep whole 16-byte lanes.
COLUMN_LAYOUTS = [(lanes, dtype, pack) for lanes in (2, 4, 8, 16)
                  for dtype, per_lane in (("float32", 4), ("float64", 2))
                  for pack in (1, 2) if pack == 1 or lanes // pack >= per_lane]


@pytest.mark.parametrize(("lanes", "dtype", "pack"), COLUMN_LAYOUTS)
@pytest.mark.parametrize("tiles", TILE_CHOICES, ids=lambda t: f"F({t.m},3)")
def test_tile_columns_pick_every_mth_element_at_any_vector_width(tiles: WinogradTiles, lanes: int, dtype: str,
                                                                  pack: int) -> None:
    # Column j of tile l is plane[start + m * l + j], for every vector width the targets have
    # (AVX-512's 16 float32 lanes included: LLVM splits wider vectors than the host's, so the
    # shuffles' meaning is checked on any machine) and the 16-byte lanes of both dtypes. With two
    # tile rows packed in a vector, the second half of the slots reads row_step elements on.
    # Lane e holds tile slot lane_slots()[e]: in order, or permuted where whole vectors are loaded.
    emitter = WinogradEmitter(ModuleEmitter("t_cols"), _problem((1, 8, 12, 12), 8, 1), tiles)
    emitter.t, emitter.esize = {"float32": ("float", 4), "float64": ("double", 8)}[dtype]
    emitter.vl, emitter.vt = lanes, f"<{lanes} x {emitter.t}>"
    emitter.pack, emitter.row_lanes = pack, lanes // pack
    start, size, row_step = 3, tiles.alpha, 5 * tiles.m * lanes + 7
    f = FunctionEmitter(emitter.mod, "cols", [("ptr", "plane"), ("ptr", "out"), ("ptr", "ws")])
    for j, column in enumerate(emitter.tile_columns(f, "%plane", str(start), size, row_step)):
        f.store(emitter.vt, column, f.gep(emitter.t, "%out", str(j * lanes)), align=emitter.esize)
    f.ret_void()
    f.finish()
    kernel = CompiledKernel(NativeModule(emitter.mod.text()), "cols", 2, 0)
    # The loads may read up to a 16-byte lane past the last column: the plane has room for that.
    plane = np.arange(start + row_step + tiles.m * lanes + size + 16, dtype=dtype)
    out = np.zeros((size, lanes), dtype)
    kernel(plane, out)
    row_lanes = lanes // pack
    slots = emitter.lane_slots()
    assert sorted(slots) == list(range(lanes))
    per_vector = lanes * emitter.esize // 16  # 16-byte lanes
    assert emitter.whole_loads == (tiles.m * emitter.esize == 16 and per_vector >= 1 and row_lanes % per_vector == 0)
    want = np.array([[plane[start + (slot // row_lanes) * row_step + tiles.m * (slot % row_lanes) + j]
                      for slot in slots] for j in range(size)])
    np.testing.assert_array_equal(out, want)


def test_blocks_are_as_large_as_the_cache_budget_allows() -> None:
    # For another target than the host the budget is BLOCK_BYTES (2 MiB): the seed CNN's conv2
    # (24x24 outputs) is one block per image, a 112x112x64 layer several, each within the budget.
    with use_target(resolve_target("x86-64-v3")):
        assert block_budget() == BLOCK_BYTES
        seed = WinogradEmitter(ModuleEmitter("t_blocks"), _problem((32, 32, 26, 26), 64, 0), F3X3)
        large = WinogradEmitter(ModuleEmitter("t_blocks"), _problem((2, 64, 112, 112), 64, 1), F4X3)
    assert (seed.blocks, seed.rows) == (1, seed.th)
    assert large.blocks > 1 and large.v_bytes + large.m_bytes <= BLOCK_BYTES
    assert cache_share(2) is None or cache_share(2) <= (cache_size(2) or 0)
    assert cache_share(3) is None or cache_share(3) <= (cache_size(3) or 0)


@pytest.mark.parametrize("o_in_vectors", [True, False])
def test_the_weight_gradient_gives_the_same_bits_with_either_side_in_vectors(o_in_vectors: bool,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # Each What element is one FMA chain over the tiles in order, whichever side's channels the
    # GEMMs hold in vectors (and transpose) and which they broadcast.
    x_shape, w_shape, pads = (2, 24, 11, 13), (40, 24, 3, 3), (1, 1, 0, 2)
    rng = np.random.default_rng(13)
    x = rng.standard_normal(x_shape).astype(np.float32)
    geometry = conv2d_geometry(x_shape, w_shape, 1, pads, 1, "float32")
    dy = rng.standard_normal((2, 40, geometry.oh, geometry.ow)).astype(np.float32)
    results = []
    for side in (o_in_vectors, not o_in_vectors):
        monkeypatch.setattr(WeightGradEmitter, "register_tile", lambda self, side=side: (side, 4, 2))
        dw = np.full(w_shape, np.nan, np.float32)
        _kernel(x_shape, w_shape, pads, "backward_weight", F3X3, "float32")(x, dy, dw)
        results.append(dw)
    np.testing.assert_array_equal(results[0], results[1])
    want = _backward_weight(x, dy, pads)
    np.testing.assert_allclose(results[0], want, rtol=0, atol=2e-6 * np.abs(want).max())


def test_the_weight_gradient_holds_the_fewer_channels_in_vectors_where_they_fill_the_tile() -> None:
    # The seed CNN's conv2 (64 output, 32 input channels): on AVX-512 the 2 vectors of input
    # channels by 8 output channels fill the 16 accumulators, and only the input side is
    # transposed; on AVX2 the 4 vectors of 8 would need 3 rows, so the output side stays there.
    problem = _problem((32, 32, 26, 26), 64, 0, "backward_weight")
    with use_target(resolve_target("x86-64-v4")):
        avx512 = WeightGradEmitter(ModuleEmitter("w512"), problem, F3X3)
    with use_target(resolve_target("x86-64-v3")):
        avx2 = WeightGradEmitter(ModuleEmitter("w256"), problem, F3X3)
    assert (avx512.o_in_vectors, avx512.kr, avx512.nvec, avx512.vector) == (False, 8, 2, 32)
    assert (avx2.o_in_vectors, avx2.kr, avx2.nvec, avx2.vector) == (True, 4, 3, 64)


def test_a_narrow_last_piece_of_columns_takes_several_panels_per_register_tile() -> None:
    # The seed CNN's conv2 backward-data by F(4,3) in blocks of one image: 7x7 tiles, 49 columns
    # (56 with padding) in register tiles 3 vectors wide: two of 24 columns and a last piece of
    # 8. The full width takes 4 rows by 3 vectors; the 8-column piece takes 2 panels, 8 rows by
    # 1 vector, where 4 rows would leave 8 of the 12 accumulators idle. The tile covers whole
    # panels only.
    with use_target(resolve_target("x86-64-v3")):  # AVX2: 8 lanes, 16 registers
        emitter = WinogradEmitter(ModuleEmitter("t_panels"), _problem((32, 32, 26, 26), 64, 0, "backward_data"), F4X3,
                                  spans_images=False)
        odd = WinogradEmitter(ModuleEmitter("t_panels"), _problem((2, 8, 10, 10), 20, 0), F2X3)
    assert (emitter.vl, emitter.mr, emitter.nvec, emitter.cout_pad, emitter.cols) == (8, 4, 3, 32, 56)
    assert [emitter.panels_per_tile(n) for n in (3, 2, 1)] == [1, 1, 2]
    # 20 channels: 5-row panels, 4 of them; one vector takes 2 panels, two vectors one.
    assert (odd.mr, odd.nvec) == (5, 2) and [odd.panels_per_tile(n) for n in (2, 1)] == [1, 2]


@pytest.mark.parametrize("tiles", TILE_CHOICES, ids=lambda t: f"F({t.m},3)")
@pytest.mark.parametrize("zero_columns", [9, 11])
def test_forward_outputs_over_all_zero_inputs_are_exactly_zero(zero_columns: int, tiles: WinogradTiles) -> None:
    # A relu passes 1e-9 and a max pool routes its gradient there, so rounding noise where the
    # direct sum is exactly zero would change which units train: the forward pass must not make
    # any, whichever tiles it takes (the zero left part of each plane meets nonzero data inside
    # the tiles along its edge, for tiles of 3 at 9 zero columns and of 4 at 11). Without the
    # field mask, F(3,3) and F(4,3) do leave noise there. A -0 input counts as zero.
    x_shape, w_shape = (2, 16, 20, 20), (16, 16, 3, 3)
    rng = np.random.default_rng(5)
    x = rng.standard_normal(x_shape).astype(np.float32)
    x[..., :zero_columns] = 0
    x[1, 3, 5, zero_columns + 4] = -0.0
    w = rng.standard_normal(w_shape).astype(np.float32)
    problem = winograd_conv(conv2d_geometry(x_shape, w_shape, 1, 0, 1), "forward")
    assert problem is not None
    nthreads = pool().nthreads  # starts the pool, whose dispatch symbol the kernels link to
    m = ModuleEmitter("zeros")
    entries = {exact: emit_winograd(m, problem, f"conv{int(exact)}", tiles, exact_zeros=exact)
               for exact in (True, False)}
    module = NativeModule(m.text())
    zero_outputs = zero_columns - 2
    for exact, entry in entries.items():
        y = np.full((2, 16, 18, 18), np.nan, np.float32)
        CompiledKernel(module, entry.entry, 3, entry.workspace_per_thread * nthreads)(x, w, y)
        if exact or tiles is F2X3:
            assert np.all(y[..., :zero_outputs] == 0) and np.all(y[..., zero_outputs:] != 0)
            want = np.einsum("nchwij,ocij->nohw", sliding_window_view(x.astype(np.float64), (3, 3), (2, 3)), w)
            np.testing.assert_allclose(y, want, rtol=0, atol=1e-5 * np.abs(want).max())
        elif (tiles.m, zero_columns) in ((3, 9), (4, 11)):
            assert np.any(y[..., :zero_outputs] != 0)


@pytest.mark.parametrize("target", ["x86-64-v3", "x86-64-v4"])
def test_the_forward_pass_takes_larger_tiles_where_they_pay_for_exact_zeros(target: str) -> None:
    # The seed CNN's conv2 (26x26 -> 24x24, 32 -> 64 channels): 24 outputs are 8 tiles of 3, and
    # F(3,3)'s 25 products per tile against F(2,3)'s 4 x 16 pay for the transforms and the mask,
    # with 16 vector registers (AVX2) and with 32 (AVX-512, twice the lanes per transform).
    # F(6,3) is not weighed for the forward pass (FORWARD_MAX_TILE): its float32 error moved a
    # 20-step SGD run 4e-5 off the reference's losses; its backward passes take it.
    with use_target(resolve_target(target)):
        seed = _problem((32, 32, 26, 26), 64, 0)
        assert choose_tiles(seed, "forward") is F3X3
        assert F6X3 not in tile_candidates(seed, "forward")
        assert choose_tiles(_problem((32, 32, 26, 26), 64, 0, "backward_weight"), "backward_weight") is F6X3
        assert estimated_cycles(seed, F3X3, exact_zeros=True) > estimated_cycles(seed, F3X3)
        assert estimated_cycles(seed, F2X3, exact_zeros=True) == estimated_cycles(seed, F2X3)


def test_transforms_cost_less_against_the_fmas_where_nothing_spills(monkeypatch: pytest.MonkeyPatch) -> None:
    # 32 vector registers hold a 6x6 tile's transform without spills: measured on AMD Zen 5, its
    # operations cost a fifth of what they cost on Zen 3's 16, and among F(2,3) to F(4,3) the seed
    # CNN's weight gradient takes F(4,3) on AVX-512 (its 36 tiles an image against F(3,3)'s 64:
    # 10 % faster there) and F(3,3) on AVX2 (Zen 3: 8 % faster). F(6,3)'s 8x8 tiles, 21 % fewer
    # products again, win on both: on AMD Zen 4 the AVX2 code's weight gradient ran 1.94-2.11 ms
    # by F(3,3) and 1.47-1.71 by F(6,3), the AVX-512 code's 1.55-1.60 by F(4,3) and 1.49-1.54.
    seed = _problem((32, 32, 26, 26), 64, 0, "backward_weight")
    costs = {}
    for target in ("x86-64-v3", "x86-64-v4"):
        with use_target(resolve_target(target)):
            costs[target] = transform_op_cycles()
            assert choose_tiles(seed, "backward_weight") is F6X3
            with monkeypatch.context() as patch:
                patch.setattr(winograd, "TILE_CHOICES", (F2X3, F3X3, F4X3))
                assert choose_tiles(seed, "backward_weight") is (F4X3 if target == "x86-64-v4" else F3X3)
    assert costs["x86-64-v4"] < costs["x86-64-v3"] / 3


def test_dispatch_applies_only_to_three_by_three_stride_one_convolutions(monkeypatch: pytest.MonkeyPatch) -> None:
    def algorithm(x_shape: tuple[int, ...], w_shape: tuple[int, ...], stride: int = 1, pads: int = 1,
                  dilation: int = 1, pass_: str = "forward") -> str:
        geom = conv2d_geometry(x_shape, w_shape, stride, pads, dilation)
        return emit_conv2d_pass(ModuleEmitter("dispatch"), ConvPass(geom, pass_), "conv")[1]

    assert algorithm((8, 16, 14, 14), (32, 16, 3, 3)) in WINOGRAD_NAMES
    assert algorithm((8, 16, 14, 14), (32, 16, 3, 3), pass_="backward_data") in WINOGRAD_NAMES
    assert algorithm((8, 16, 14, 14), (32, 16, 3, 3), pass_="backward_weight") in WEIGHT_NAMES
    assert algorithm((8, 16, 14, 14), (32, 16, 3, 3), stride=2) == "direct"
    assert algorithm((8, 16, 14, 14), (32, 16, 3, 3), dilation=2) == "direct"
    assert algorithm((8, 16, 14, 14), (32, 16, 5, 5)) == "direct"
    assert algorithm((8, 16, 14, 14), (32, 16, 3, 3), pads=3) == "direct"
    # one input channel: too thin a GEMM for Winograd; the sliding window takes it
    assert algorithm((8, 1, 28, 28), (32, 1, 3, 3)) == "sliding window"
    assert algorithm((8, 16, 3, 3), (32, 16, 3, 3), pads=0) == "direct"  # a 1x1 output: 16 products for 9
    # The weight gradient's per-group partial sums (16 x O x C) stay small, else the direct GEMM.
    assert algorithm((2, 128, 8, 8), (128, 128, 3, 3), pass_="backward_weight") == "winograd F(3x3,2x2)"
    assert algorithm((2, 256, 8, 8), (256, 256, 3, 3), pass_="backward_weight") == "direct"
    assert algorithm((2, 256, 8, 8), (256, 256, 3, 3), pass_="forward") in WINOGRAD_NAMES
    monkeypatch.setenv(CONV_ALGORITHM_VAR, "direct")
    assert algorithm((8, 16, 14, 14), (32, 16, 3, 3)) == "direct"
    assert algorithm((8, 1, 28, 28), (32, 1, 3, 3)) == "direct"
    monkeypatch.setenv(CONV_ALGORITHM_VAR, "winograd")
    assert algorithm((8, 1, 28, 28), (32, 1, 3, 3)) in WINOGRAD_NAMES
    assert algorithm((8, 16, 14, 14), (32, 16, 3, 3), stride=2) == "direct"  # does not apply at all


def test_conv_algorithm_variable_is_validated() -> None:
    assert conv_algorithm_setting({}) == "auto"
    assert conv_algorithm_setting({CONV_ALGORITHM_VAR: "winograd"}) == "winograd"
    with pytest.raises(ConfigError, match=f"{CONV_ALGORITHM_VAR}='fft': expected one of auto, direct, winograd"):
        conv_algorithm_setting({CONV_ALGORITHM_VAR: "fft"})


def test_an_infinite_weight_on_the_padding_gives_nan_as_the_reference_does() -> None:
    """Padded zeros times an infinite weight are NaN in the reference (and PyTorch): the direct
    sum a non-finite Winograd result falls back to counts the padding's taps as zero inputs,
    in the forward and in the weight gradient alike."""
    c = 8
    x, w = opgrad.var("x", (1, c, 6, 6)), opgrad.var("w", (c, c, 3, 3))
    fn = opgrad.function([x, w], ops.conv2d(x, w, padding=1))
    images, weights = np.ones((1, c, 6, 6), np.float32), np.ones((c, c, 3, 3), np.float32)
    weights[0, 0, 0, 0] = np.inf
    assert "winograd" in opgrad.compile(fn).plan.step_costs[0].detail
    with np.errstate(invalid="ignore"):
        want, got = opgrad.evaluate(fn, images, weights), opgrad.compile(fn)(images, weights)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(got[0, 0, 0]).all()
    g = opgrad.var("g", (1, c, 6, 6))
    fw = opgrad.function([g, x], ops.conv2d_backward_weight(g, x, padding=1, kernel_size=(3, 3)))
    grads = np.ones((1, c, 6, 6), np.float32)
    grads[0, 0, 0, 0] = np.inf
    with np.errstate(invalid="ignore"):
        want, got = opgrad.evaluate(fw, grads, images), opgrad.compile(fw)(grads, images)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
