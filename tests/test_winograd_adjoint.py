"""The adjoint Winograd backward-data pass (:mod:`opgrad.compiler.winograd_adjoint`) against float64
direct sums: its index conventions in numpy, the kernel over odd and even sizes, paddings and
channel counts, its independence of the thread count, its non-finite fallback and its choice."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import opgrad
from opgrad import ops
from opgrad.compiler import conv2d_geometry
from opgrad.compiler.convpass import ConvPass
from opgrad.compiler.irtext import ModuleEmitter
from opgrad.compiler.jit import NativeModule
from opgrad.compiler.kernels import CompiledKernel
from opgrad.compiler.target import resolve_target, use_target
from opgrad.compiler.threads import pool
from opgrad.compiler.winograd import F3X3, F4X3, TILE_CHOICES, WinogradTiles, emit_winograd, winograd_conv
from opgrad.compiler.winograd_adjoint import (
    AdjointEmitter,
    adjoint_conv,
    adjoint_estimated_cycles,
    emit_winograd_adjoint,
    prefers_adjoint,
)
from opgrad.env import CONV_ALGORITHM_VAR

ROOT = Path(__file__).resolve().parent.parent
TILE_IDS = [f"F({t.m},3)" for t in TILE_CHOICES]


def _backward_data(dy: np.ndarray, w: np.ndarray, hw: tuple[int, int], pads: tuple[int, int, int, int]) -> np.ndarray:
    """dX as the direct full correlation: each tap's contribution added into the padded plane."""
    top, left, bottom, right = pads
    n, _, oh, ow = dy.shape
    h, wd = hw
    dxp = np.zeros((n, w.shape[1], h + top + bottom, wd + left + right))
    for i in range(3):
        for j in range(3):
            dxp[:, :, i : i + oh, j : j + ow] += np.einsum("nopq,oc->ncpq", dy.astype(np.float64), w[:, :, i, j])
    return dxp[:, :, top : top + h, left : left + wd]


def _adjoint_model(dy: np.ndarray, w: np.ndarray, hw: tuple[int, int], pads: tuple[int, int, int, int],
                   tiles: WinogradTiles) -> np.ndarray:
    """The module docstring's formula in numpy: per dY tile ``B [U ⊙ (A H A^T)] B^T`` added at ``(ty m, tx m)``."""
    top, left = pads[:2]
    n, o, oh, ow = dy.shape
    m, alpha = tiles.m, tiles.alpha
    a, g, b = np.array(tiles.at).T, np.array(tiles.g), np.array(tiles.bt).T
    u = np.einsum("ai,ocij,bj->abco", g, w, g)
    th, tw = -(-oh // m), -(-ow // m)
    whole = np.zeros((n, o, th * m, tw * m))
    whole[:, :, :oh, :ow] = dy
    plane = np.zeros((n, w.shape[1], th * m + 2, tw * m + 2))
    for ty in range(th):
        for tx in range(tw):
            hh = np.einsum("ai,noij,bj->noab", a, whole[:, :, ty * m : ty * m + m, tx * m : tx * m + m], a)
            mt = np.einsum("abco,noab->ncab", u, hh)
            plane[:, :, ty * m : ty * m + alpha, tx * m : tx * m + alpha] += np.einsum("ia,ncab,jb->ncij", b, mt, b)
    return plane[:, :, top : top + hw[0], left : left + hw[1]]


@pytest.mark.parametrize("tiles", TILE_CHOICES, ids=TILE_IDS)
def test_the_adjoint_formula_is_the_full_correlation(tiles: WinogradTiles) -> None:
    rng = np.random.default_rng(0)
    for pads in [(0, 0, 0, 0), (1, 1, 1, 1), (2, 2, 2, 2), (1, 0, 2, 1), (0, 2, 1, 0), (2, 1, 0, 2)]:
        for hw in [(3, 3), (7, 9), (11, 6), (5, 13)]:
            oh, ow = hw[0] + pads[0] + pads[2] - 2, hw[1] + pads[1] + pads[3] - 2
            if min(oh, ow) < 1:
                continue
            dy, w = rng.standard_normal((2, 5, oh, ow)), rng.standard_normal((5, 3, 3, 3))
            np.testing.assert_allclose(_adjoint_model(dy, w, hw, pads, tiles), _backward_data(dy, w, hw, pads),
                                       rtol=0, atol=1e-10)


def _adjoint_kernel(x_shape: tuple[int, ...], w_shape: tuple[int, ...], pads: tuple[int, int, int, int],
                    tiles: WinogradTiles, dtype: str) -> CompiledKernel:
    nthreads = pool().nthreads
    problem = adjoint_conv(conv2d_geometry(x_shape, w_shape, 1, pads, 1, dtype), require_gain=False)
    assert problem is not None
    m = ModuleEmitter("adjoint_test")
    entry = emit_winograd_adjoint(m, problem, "conv", tiles)
    return CompiledKernel(NativeModule(m.text()), entry.entry, 3, entry.workspace_per_thread * nthreads)


def _correlation_kernel(x_shape: tuple[int, ...], w_shape: tuple[int, ...], pads: tuple[int, int, int, int],
                        tiles: WinogradTiles) -> CompiledKernel:
    problem = winograd_conv(conv2d_geometry(x_shape, w_shape, 1, pads, 1), "backward_data", require_gain=False)
    assert problem is not None
    m = ModuleEmitter("correlation_test")
    entry = emit_winograd(m, problem, "conv", tiles, padding_is_data=False)
    return CompiledKernel(NativeModule(m.text()), entry.entry, 3, entry.workspace_per_thread * pool().nthreads)


def _dy_shape(x_shape: tuple[int, ...], cout: int, pads: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    top, left, bottom, right = pads
    return (x_shape[0], cout, x_shape[2] + top + bottom - 2, x_shape[3] + left + right - 2)


# (x shape, output channels, pads as (top, left, bottom, right)): sizes from 3 to 30, odd and even,
# symmetric and asymmetric padding up to 2, channel counts off the vector width, batch 1 and more.
Case = tuple[tuple[int, int, int, int], int, tuple[int, int, int, int]]
CASES: list[Case] = [
    ((2, 8, 7, 9), 8, (0, 0, 0, 0)),
    ((3, 5, 11, 6), 16, (1, 1, 2, 0)),
    ((1, 16, 5, 5), 7, (2, 2, 2, 2)),
    ((2, 3, 4, 13), 40, (0, 2, 1, 1)),
    ((2, 24, 18, 17), 20, (1, 1, 1, 1)),
    ((1, 9, 3, 3), 11, (1, 0, 0, 1)),
    ((3, 17, 30, 29), 33, (0, 1, 2, 0)),
    ((5, 32, 26, 26), 64, (0, 0, 0, 0)),
    ((2, 12, 14, 22), 24, (2, 0, 1, 2)),
]
RUNS = ([(case, "float32", tiles) for tiles in TILE_CHOICES for case in CASES]
        + [(case, "float64", tiles) for tiles in TILE_CHOICES for case in CASES[1:4] + CASES[6:7]])


@pytest.mark.parametrize(("case", "dtype", "tiles"), RUNS,
                         ids=[f"x{c[0]}o{c[1]}p{c[2]}-{d}-F({t.m},3)" for c, d, t in RUNS])
def test_the_adjoint_pass_matches_the_direct_sum(case: Case, dtype: str, tiles: WinogradTiles) -> None:
    x_shape, cout, pads = case
    w_shape = (cout, x_shape[1], 3, 3)
    rng = np.random.default_rng(cout + x_shape[2])
    dy = rng.standard_normal(_dy_shape(x_shape, cout, pads)).astype(dtype)
    w = rng.standard_normal(w_shape).astype(dtype)
    want = _backward_data(dy, w, x_shape[2:], pads)
    dx = np.full(x_shape, np.nan, dtype)  # every output is written, none accumulated
    _adjoint_kernel(x_shape, w_shape, pads, tiles, dtype)(dy, w, dx)
    # float32 F(4,3) keeps about one digit less than the direct sum (coefficients up to 8).
    relative = {"float64": 1e-11, "float32": 2e-5 if tiles.m >= 4 else 5e-6}[dtype]
    np.testing.assert_allclose(dx, want, rtol=0, atol=relative * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize("tiles", TILE_CHOICES, ids=TILE_IDS)
def test_eight_lane_vectors_as_on_avx2_give_the_direct_sum(tiles: WinogradTiles) -> None:
    # AVX2's 8 float32 lanes pack tile rows differently (a 4-tile row shares a vector with one
    # other, not three); the kernel emitted for it runs on any AVX2 host.
    for x_shape, cout, pads in CASES[:5]:
        w_shape = (cout, x_shape[1], 3, 3)
        geom = conv2d_geometry(x_shape, w_shape, 1, pads, 1)
        with use_target(resolve_target("x86-64-v3")):
            problem = adjoint_conv(geom, require_gain=False)
            assert problem is not None
            m = ModuleEmitter("avx2")
            entry = emit_winograd_adjoint(m, problem, "conv", tiles)
            workspace = entry.workspace_per_thread * pool().nthreads
            kernel = CompiledKernel(NativeModule(m.text()), entry.entry, 3, workspace)
        rng = np.random.default_rng(cout)
        dy = rng.standard_normal(_dy_shape(x_shape, cout, pads)).astype(np.float32)
        w = rng.standard_normal(w_shape).astype(np.float32)
        dx = np.full(x_shape, np.nan, np.float32)
        kernel(dy, w, dx)
        want = _backward_data(dy, w, x_shape[2:], pads)
        np.testing.assert_allclose(dx, want, rtol=0, atol=2e-5 * max(1.0, np.abs(want).max()))


_THREADS_SCRIPT = textwrap.dedent("""
    import hashlib
    import numpy as np
    from opgrad.compiler import conv2d_geometry
    from opgrad.compiler.irtext import ModuleEmitter
    from opgrad.compiler.jit import NativeModule
    from opgrad.compiler.kernels import CompiledKernel
    from opgrad.compiler.threads import pool
    from opgrad.compiler.winograd import TILE_CHOICES
    from opgrad.compiler.winograd_adjoint import AdjointEmitter, adjoint_conv, emit_winograd_adjoint
    h = hashlib.sha256()
    rng = np.random.default_rng(5)
    for x_shape, cout, pads in [((32, 32, 26, 26), 64, (0, 0, 0, 0)), ((7, 10, 13, 11), 12, (1, 0, 2, 1))]:
        w_shape = (cout, x_shape[1], 3, 3)
        g = conv2d_geometry(x_shape, w_shape, 1, pads, 1)
        problem = adjoint_conv(g, require_gain=False)
        dy = rng.standard_normal((x_shape[0], cout, g.oh, g.ow)).astype(np.float32)
        w = rng.standard_normal(w_shape).astype(np.float32)
        for tiles in TILE_CHOICES:
            print(AdjointEmitter(ModuleEmitter("e"), problem, tiles).rows, end=" ")
            m = ModuleEmitter("threads")
            entry = emit_winograd_adjoint(m, problem, "conv", tiles)
            kernel = CompiledKernel(NativeModule(m.text()), entry.entry, 3,
                                    entry.workspace_per_thread * pool().nthreads)
            dx = np.zeros(x_shape, np.float32)
            kernel(dy, w, dx)
            h.update(dx.tobytes())
    print(h.hexdigest())
""")


def test_results_are_the_same_bits_for_any_thread_count(tmp_path: Path) -> None:
    # Blocks of whole images follow the thread count (blocks of 4 seed images on 2 threads, one
    # image each on 1); each image's patches are added in one order whatever the block.
    outputs = []
    for threads in ("1", "2", "3"):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OPGRAD_CACHE_DIR": str(tmp_path),
               "OPGRAD_NUM_THREADS": threads}
        res = subprocess.run([sys.executable, "-c", _THREADS_SCRIPT], env=env, capture_output=True, text=True,
                             timeout=300)
        assert res.returncode == 0, res.stderr
        outputs.append(res.stdout.split())
    assert len({out[-1] for out in outputs}) == 1
    assert len({tuple(out[:-1]) for out in outputs}) > 1, "the thread counts should give different blocks"


def test_blocks_are_whole_images_and_span_images_where_that_fills_the_columns(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The seed CNN's conv2: 6 x 6 F(4,3) tiles an image, 36 columns in 48 of 16 lanes; blocks of
    # 4 images are 144 columns, 9 whole vectors.
    monkeypatch.setattr("opgrad.compiler.winograd_adjoint.pool_size", lambda: 2)
    monkeypatch.setattr("opgrad.compiler.winograd_adjoint.host_target", lambda: resolve_target("x86-64-v4"))
    monkeypatch.setattr("opgrad.compiler.winograd_adjoint.block_budget", lambda: 4 << 20)
    problem = adjoint_conv(conv2d_geometry((32, 32, 26, 26), (64, 32, 3, 3), 1, 0, 1))
    assert problem is not None
    with use_target(resolve_target("x86-64-v4")):
        e = AdjointEmitter(ModuleEmitter("blocks"), problem, F4X3)
    assert (e.th, e.tw, e.spans, e.rows, e.cols, e.blocks, e.segment_rows) == (6, 6, True, 24, 144, 8, 6)
    monkeypatch.setattr("opgrad.compiler.winograd_adjoint.pool_size", lambda: 1)
    with use_target(resolve_target("x86-64-v4")):
        one = AdjointEmitter(ModuleEmitter("blocks"), problem, F3X3)  # 8 x 8 tiles: 64 columns, whole vectors
    assert (one.spans, one.rows, one.blocks) == (False, 8, 1)  # one block an image


@pytest.mark.parametrize("tiles", TILE_CHOICES, ids=TILE_IDS)
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", ["gradient", "weight"])
def test_non_finite_inputs_fall_back_to_the_direct_sum(value: float, where: str, tiles: WinogradTiles) -> None:
    # The transforms mix taps (inf - inf = NaN): the pass falls back to the correlation form's
    # direct sum, which gives the same bits as that form's own fallback and NaN and infinities
    # where the reference has them (the zeros dY is padded with are no terms: an infinite weight
    # does not meet them, as the reference's gradient never multiplies them).
    x_shape, w_shape, pads = (2, 8, 9, 10), (8, 8, 3, 3), (1, 0, 2, 1)
    rng = np.random.default_rng(3)
    dy = rng.standard_normal(_dy_shape(x_shape, 8, pads)).astype(np.float32)
    w = rng.standard_normal(w_shape).astype(np.float32)
    if where == "gradient":
        dy[1, 3, 4, 5] = dy[0, 0, 0, 0] = value
    else:
        w[2, 5, 0, 1] = value
    dx, want = np.zeros(x_shape, np.float32), np.zeros(x_shape, np.float32)
    _adjoint_kernel(x_shape, w_shape, pads, tiles, "float32")(dy, w, dx)
    _correlation_kernel(x_shape, w_shape, pads, tiles)(dy, w, want)
    np.testing.assert_array_equal(dx, want)
    assert not np.isfinite(dx).all()
    g, wv = opgrad.var("g", dy.shape), opgrad.var("w", w_shape)
    reference = ops.conv2d_backward_input(g, wv, input_size=x_shape[2:], strides=(1, 1), padding=pads)
    with np.errstate(all="ignore"):
        expected = opgrad.evaluate(opgrad.function([g, wv], reference), dy, w)
    for test in (np.isnan, np.isposinf, np.isneginf):
        np.testing.assert_array_equal(test(dx), test(expected))


def test_a_fused_epilogue_runs_on_each_stored_plane() -> None:
    # A per-channel scale after the backward-data pass runs on each (image, channel) plane as it is
    # stored, and again over all planes after a fallback.
    c, o = 16, 32
    g, w, s = opgrad.var("g", (8, o, 12, 12)), opgrad.var("w", (o, c, 3, 3)), opgrad.var("s", (1, c, 1, 1))
    dx = ops.conv2d_backward_input(g, w, input_size=(14, 14), strides=(1, 1), padding=(0, 0, 0, 0))
    fn = opgrad.function([g, w, s], ops.multiply(dx, s))
    rng = np.random.default_rng(4)
    args = [rng.standard_normal(v.shape).astype(np.float32) for v in (g, w, s)]
    compiled = opgrad.compile(fn, step_entries=True)
    assert compiled.step_labels == ["conv2d_backward_input+multiply"]
    assert "winograd adjoint" in compiled.plan.step_costs[0].detail
    want = opgrad.evaluate(fn, *args)
    np.testing.assert_allclose(compiled(*args), want, rtol=0, atol=2e-5 * np.abs(want).max())
    args[0][3, 2, 5, 5] = np.inf
    with np.errstate(all="ignore"):
        want = opgrad.evaluate(fn, *args)
    got = compiled(*args)
    for test in (np.isnan, np.isposinf, np.isneginf):
        np.testing.assert_array_equal(test(got), test(want))


def test_the_seed_cnns_conv2_backward_data_takes_the_adjoint_form(monkeypatch: pytest.MonkeyPatch) -> None:
    # dY 24 x 24 -> dX 26 x 26: the correlation form tiles dX (7 x 7 F(4,3) tiles over 28 x 28),
    # the adjoint form dY (8 x 8 F(3,3) tiles, 64 columns: whole vectors).
    geom = conv2d_geometry((32, 32, 26, 26), (64, 32, 3, 3), 1, 0, 1)
    with use_target(resolve_target("x86-64-v4")):
        assert ConvPass(geom, "backward_data").algorithm.startswith("winograd adjoint F(")
        problem = adjoint_conv(geom)
        assert problem is not None
        assert adjoint_estimated_cycles(problem, F4X3) is not None
        monkeypatch.setenv(CONV_ALGORITHM_VAR, "winograd")
        assert ConvPass(geom, "backward_data").algorithm.startswith("winograd adjoint F(")
        monkeypatch.setenv(CONV_ALGORITHM_VAR, "direct")
        assert ConvPass(geom, "backward_data").algorithm == "direct"


def test_same_padding_keeps_the_correlation_form() -> None:
    # With "same" padding dY and dX are the same size: no tiles are saved, and the overlap-add
    # costs more than it gains.
    with use_target(resolve_target("x86-64-v4")):
        geom = conv2d_geometry((32, 64, 12, 12), (64, 64, 3, 3), 1, 1, 1)
        assert prefers_adjoint(geom) is None
        assert ConvPass(geom, "backward_data").algorithm in {f"winograd F({t.m},3)" for t in TILE_CHOICES}


def test_the_seed_cnn_step_runs_the_adjoint_backward_data() -> None:
    x, w = opgrad.var("x", (4, 32, 26, 26)), opgrad.var("w", (64, 32, 3, 3))
    fn = opgrad.function([x, w], ops.sum(ops.conv2d(x, w)))
    grads = opgrad.grad(fn, wrt=["x"])
    compiled = opgrad.compile(grads)
    if not ConvPass(conv2d_geometry((4, 32, 26, 26), (64, 32, 3, 3), 1, 0, 1), "backward_data").adjoint:
        pytest.skip("this host's estimate keeps the correlation form")
    assert any("winograd adjoint" in cost.detail for cost in compiled.plan.step_costs)
    rng = np.random.default_rng(6)
    xs, ws = (rng.standard_normal(v.shape).astype(np.float32) for v in (x, w))
    _, dx = compiled(xs, ws)
    want = np.broadcast_to(ws.astype(np.float64).sum(axis=0), (4, 32, 3, 3))
    full = np.zeros((4, 32, 26, 26))
    for i in range(3):
        for j in range(3):
            full[:, :, i : i + 24, j : j + 24] += want[:, :, i, j][:, :, None, None]
    np.testing.assert_allclose(dx, full, rtol=0, atol=2e-5 * np.abs(full).max())


@pytest.mark.parametrize("target", ["x86-64-v3", "x86-64-v4"])
def test_the_seed_cnns_backward_passes_take_eight_by_eight_tiles_compiled_lean(target: str) -> None:
    # F(6,3): 21 % fewer products than F(4,3) (conv2's backward-data 1.37-1.59 -> 1.08-1.33 ms on
    # AMD EPYC Zen 4, 2 threads). Its block task is 616 KB of IR that no compile worker can split,
    # so it takes the lean pipeline, which kept the cold compile of the step under 1.5 s and ran
    # as fast as O2; the smaller tiles' block tasks stay explicit.
    from opgrad.compiler.split import pipeline_attribute
    from opgrad.compiler.winograd import F6X3, LEAN_TASK_ALPHA
    from opgrad.compiler.winograd_weight import emit_winograd_weight

    with use_target(resolve_target(target)):
        chosen = prefers_adjoint(conv2d_geometry((32, 32, 26, 26), (64, 32, 3, 3)))
        assert chosen is not None and chosen[1] is F6X3
        for tiles, pipeline in ((F6X3, "lean"), (F3X3, "explicit")):
            assert (tiles.alpha >= LEAN_TASK_ALPHA) == (pipeline == "lean")
            module = ModuleEmitter("adjoint")
            emit_winograd_adjoint(module, chosen[0], "bwd", tiles)
            header = next(line for line in module.text().splitlines()
                          if line.startswith("define") and "@bwd.blocks(" in line)
            assert pipeline_attribute(pipeline) in header, header
        # The weight gradient's group task likewise (567 KB of IR by F(6,3)).
        weight = winograd_conv(conv2d_geometry((32, 32, 26, 26), (64, 32, 3, 3)), "backward_weight")
        assert weight is not None
        for tiles, pipeline in ((F6X3, "lean"), (F4X3, "explicit")):
            module = ModuleEmitter("weight")
            emit_winograd_weight(module, weight, "dw", tiles)
            header = next(line for line in module.text().splitlines()
                          if line.startswith("define") and "@dw.groups(" in line)
            assert pipeline_attribute(pipeline) in header, header
