"""Native engine: GEMM and conv2d against numpy, object-cache reuse and repair, pool determinism."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from opgrad.compiler import GemmSpec, KernelBuilder, View, conv2d_geometry, conv2d_kernels, gemm, gemm_kernel
from opgrad.compiler.jit import NativeModule, ObjectCache
from opgrad.compiler.views import row_major

TOL = {"float32": 2e-4, "float64": 1e-11}
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="module")
def _private_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    os.environ["OPGRAD_CACHE_DIR"] = str(tmp_path_factory.mktemp("objcache"))


def _close(got: np.ndarray, want: np.ndarray, dtype: str) -> None:
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL[dtype] * scale)


# ----- GEMM -----

@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("mnk", [(1, 1, 1), (1, 37, 5), (19, 1, 300), (33, 47, 261), (130, 70, 9)])
def test_gemm_matches_numpy(dtype: str, trans_a: bool, trans_b: bool, mnk: tuple[int, int, int]) -> None:
    m, n, k = mnk
    rng = np.random.default_rng(m * 1000 + n * 10 + k)
    a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(dtype)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(dtype)
    want = (a.T if trans_a else a) @ (b.T if trans_b else b)
    _close(gemm(a, b, trans_a=trans_a, trans_b=trans_b), want, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gemm_accumulate_and_alpha(dtype: str) -> None:
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal((45, 530)).astype(dtype), rng.standard_normal((530, 29)).astype(dtype)
    c0 = rng.standard_normal((45, 29)).astype(dtype)
    c = c0.copy()
    gemm(a, b, c, alpha=-0.5, accumulate=True)
    _close(c, c0 - 0.5 * (a @ b), dtype)
    gemm(a, b, c, alpha=2.0)
    _close(c, 2.0 * (a @ b), dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(("panels", "long_k"), [(0, False), (1, False), (2, False), (1, True)])
def test_gemm_reading_a_in_place_matches_numpy(dtype: str, panels: int, long_k: bool) -> None:
    # Few columns (a weight matrix against a small batch): A is read where it is, not packed. Its
    # rows are strided past K and start at an offset; M is not a multiple of the register tile.
    # K is one block (each row tile streams its rows through all of K), or with ``long_k`` more
    # than a B panel in half of L2 holds, so several K blocks, the last one shorter.
    from opgrad.compiler.gemm import K_GROUPS_MAX, Blocking, GemmPlan, IndexMap, Operand
    from opgrad.compiler.target import cache_size

    nr = Blocking.for_target(dtype).nr
    esize = np.dtype(dtype).itemsize
    half_l2 = ((cache_size(2) or 512 << 10) // 2)
    n = [1, nr + 1, 2 * nr][panels]  # one column, a partial second panel, two full panels
    m, k, lda, offset = 131, 1100, 1107, 5
    if long_k:  # K groups each longer than two B panels in half of L2: three blocks a group
        m, k = 13, 2 * K_GROUPS_MAX * (half_l2 // (nr * esize)) + 37
        lda = k + 7
    rng = np.random.default_rng(n)
    storage = rng.standard_normal(offset + m * lda).astype(dtype)
    a = storage[offset:].reshape(m, lda)[:, :k]
    b = rng.standard_normal((k, n)).astype(dtype)
    spec = GemmSpec(m, n, k, a=Operand(IndexMap.strided(m, lda, offset), IndexMap.strided(k, 1)),
                    b=Operand.matrix(k, n, n, 1), c=Operand.matrix(m, n, n, 1), dtype=dtype)
    plan = GemmPlan(spec, Blocking.for_target(dtype))
    assert plan.a_in_place and plan.kc * nr * esize <= half_l2
    assert plan.group_blocks == (3 if long_k else 1) and (plan.kgroups == K_GROUPS_MAX or not long_k)
    c = np.full((m, n), np.nan, dtype)
    gemm_kernel(spec)(storage, b, c)
    _close(c, a @ b, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(("operand", "row_blocks"), [("b", 1), ("b", 2), ("a", 1)])
def test_gemm_packing_whole_rows_matches_numpy(dtype: str, operand: str, row_blocks: int) -> None:
    # Panels whose lanes are one run of memory (a row-major B's columns, a column-major A's rows)
    # are packed row by row, or for B by the first row tile that uses them. The run starts past an
    # offset and its rows are strided past the operand; N spans two column blocks with a partial
    # last panel, K two cache blocks; M one block of rows (every B panel packed into one slot) or
    # two (the panels kept for the second block).
    from opgrad.compiler.gemm import Blocking, IndexMap, Operand

    m = 37 if row_blocks == 1 else Blocking.for_target(dtype).mc + 5
    n, k, ld, offset = 2100, 300, 2111, 3
    rng = np.random.default_rng(7)
    storage = rng.standard_normal(offset + k * ld).astype(dtype)
    run = storage[offset:].reshape(k, ld)
    strided = Operand(IndexMap.strided(k, ld), IndexMap.strided(n if operand == "b" else m, 1, offset))
    if operand == "b":
        a, b = rng.standard_normal((m, k)).astype(dtype), run[:, :n]
        spec = GemmSpec(m, n, k, a=Operand.matrix(m, k, k, 1), b=strided, c=Operand.matrix(m, n, n, 1), dtype=dtype)
        args = (a, storage)
    else:
        a, b = run[:, :m].T, rng.standard_normal((k, n)).astype(dtype)
        spec = GemmSpec(m, n, k, a=Operand(strided.cols, strided.rows), b=Operand.matrix(k, n, n, 1),
                        c=Operand.matrix(m, n, n, 1), dtype=dtype)
        args = (storage, b)
    assert Blocking.for_target(dtype).nc < n
    c = np.full((m, n), np.nan, dtype)
    gemm_kernel(spec)(*args, c)
    _close(c, a @ b, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("mnk", [(128, 1000, 32), (37, 53, 700), (30, 20, 10), (16, 24, 5000), (32, 9, 8000)])
def test_gemm_epilogue_equals_the_separate_elementwise_pass(dtype: str, mnk: tuple[int, int, int]) -> None:
    # One K block, several, K summed in groups (16x24x5000; 32x9x8000, in float32 transposed) and
    # the small-GEMM loop: the epilogue sees each finished C element once, whatever the path, so
    # its result is bitwise that of the GEMM followed by the same operations in numpy.
    from opgrad.compiler.gemm import Epilogue, IndexMap, Operand, oriented

    m, n, k = mnk
    rng = np.random.default_rng(m + n + k)
    a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
    w, bias = rng.standard_normal((m, n)).astype(dtype), rng.standard_normal(n).astype(dtype)
    # relu(w - 0.25 * (C + bias)): a full matrix, a row broadcast along the rows, a constant.
    epilogue = Epilogue(lambda s, v: s.max(s.sub(v[1], s.mul(v[3], s.add(v[0], v[2]))), s.const(0.0)),
                        (Operand.matrix(m, n, n, 1), Operand(IndexMap.strided(m, 0), IndexMap.strided(n, 1)), 0.25))
    plain = GemmSpec.dense(m, n, k, dtype)
    fused = GemmSpec(m, n, k, plain.a, plain.b, plain.c, dtype, epilogue=epilogue)
    if mnk == (32, 9, 8000) and dtype == "float32":
        assert oriented(plain)[0] is not plain, "this shape should exercise the transposed GEMM"
    c, out = np.full((m, n), np.nan, dtype), np.full((m, n), np.nan, dtype)
    gemm_kernel(plain)(a, b, c)
    gemm_kernel(fused)(a, b, out, w, bias)
    np.testing.assert_array_equal(out, np.maximum(w - np.asarray(0.25, dtype) * (c + bias), 0))


@pytest.mark.parametrize("target", ["x86-64-v3", "x86-64-v4"])
def test_gemm_orientation_follows_what_it_packs(target: str) -> None:
    # ``x @ w.T`` with a batch of 32 rows and a weight of shape (n, k) runs as ``w @ x.T``: the
    # weight's rows are read in place and only x is packed, with K summed in groups (9216) or
    # not (784, the tiles then stored transposed). The data gradient dy @ w and the weight
    # gradient dy.T @ x pack as much either way (transposed they measured 3-11x slower), and a
    # 40-row batch would pad to 64 columns. (AArch64's 4-lane tiles read at most 16 rows in place.)
    from opgrad.compiler.gemm import oriented, packing_cost
    from opgrad.compiler.target import resolve_target, use_target

    with use_target(resolve_target(target)):
        for m, n, k in [(32, 128, 9216), (32, 200, 784)]:
            plain = GemmSpec.dense(m, n, k, trans_b=True)
            swapped, blk = oriented(plain)
            assert swapped is not plain, (m, n, k)
            assert 2 * packing_cost(swapped, blk, c_transposed=k < 4 * n) <= packing_cost(plain, blk)
        for spec in [GemmSpec.dense(32, 9216, 128),
                     GemmSpec.dense(128, 9216, 32, trans_a=True), GemmSpec.dense(40, 512, 512, trans_b=True)]:
            assert oriented(spec)[0] is spec, spec


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("mnk", [(32, 128, 2304), (32, 200, 784), (19, 75, 600), (64, 130, 1000), (2, 8, 784)])
def test_gemm_transposed_for_a_batch_against_weight_rows_matches_numpy(dtype: str, mnk: tuple[int, int, int]) -> None:
    # x @ w.T in whichever orientation the host takes (see the test above): K in groups or one
    # pass, edge tiles both ways; 2 x 8 x 784 is the small GEMM, which reads its operands as
    # passed and is never transposed. The epilogue still sees each finished element once, so
    # the fused result is bitwise the plain GEMM's followed by numpy.
    from opgrad.compiler.gemm import Epilogue, IndexMap, Operand

    m, n, k = mnk
    rng = np.random.default_rng(n + k)
    x, w = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((n, k)).astype(dtype)
    prev, bias = rng.standard_normal((m, n)).astype(dtype), rng.standard_normal(n).astype(dtype)
    plain = GemmSpec.dense(m, n, k, dtype, trans_b=True)
    epilogue = Epilogue(lambda s, v: s.max(s.sub(v[1], s.mul(v[3], s.add(v[0], v[2]))), s.const(0.0)),
                        (Operand.matrix(m, n, n, 1), Operand(IndexMap.strided(m, 0), IndexMap.strided(n, 1)), 0.25))
    fused = GemmSpec(m, n, k, plain.a, plain.b, plain.c, dtype, epilogue=epilogue)
    c, out = np.full((m, n), np.nan, dtype), np.full((m, n), np.nan, dtype)
    gemm_kernel(plain)(x, w, c)
    _close(c, x @ w.T, dtype)
    gemm_kernel(fused)(x, w, out, prev, bias)
    np.testing.assert_array_equal(out, np.maximum(prev - np.asarray(0.25, dtype) * (c + bias), 0))


_STORE_BODIES = {
    # name: (body over [C, W, bias, scale], numpy twin, applied by the tile store)
    "sgd": (lambda s, v: s.sub(v[1], s.mul(v[3], v[0])), lambda c, w, bias, lr: w - lr * c, True),
    "erf": (lambda s, v: s.libm("erf", s.add(v[0], v[2])), None, True),
    "step": (lambda s, v: s.select(s.cmp("ogt", v[0], v[2]), v[1], s.mask(s.cmp("olt", v[0], v[1]))),
             lambda c, w, bias, lr: np.where(c > bias, w, (c < w).astype(c.dtype)), True),
    # Integer work has no vector form: the finished panels go through the epilogue pass.
    "integer": (lambda s, v: s.select(s.icmp("ult", "0", 1), v[0], v[1]), lambda c, w, bias, lr: c, False),
}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("body", sorted(_STORE_BODIES))
@pytest.mark.parametrize("mnk,accumulate", [((128, 1000, 32), False), ((37, 53, 700), True), ((13, 301, 300), False),
                                            ((300, 70, 40), False)])
def test_gemm_epilogue_applied_in_the_tile_store(dtype: str, body: str, mnk: tuple[int, int, int],
                                                 accumulate: bool) -> None:
    # The tile store applies the epilogue to the finished tile in registers, walking C row tile by
    # row tile: vector bodies (math library lane by lane, compares and selects) on whole panels
    # and the same body scalar on edge tiles; with several K blocks only the last store applies
    # it, onto C's old value when accumulating. The scale is a 0-d array broadcast to every element.
    from scipy.special import erf

    from opgrad.compiler.gemm import Epilogue, IndexMap, Operand, emit_gemm
    from opgrad.compiler.irtext import ModuleEmitter

    m, n, k = mnk
    fn, twin, in_store = _STORE_BODIES[body]
    if twin is None:
        twin = lambda c, w, bias, lr: erf(c + bias).astype(c.dtype)  # noqa: E731
    rng = np.random.default_rng(m * n + k)
    a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
    w, bias = rng.standard_normal((m, n)).astype(dtype), rng.standard_normal(n).astype(dtype)
    lr = np.asarray(0.125, dtype)
    everywhere = Operand(IndexMap.strided(m, 0), IndexMap.strided(n, 0))
    epilogue = Epilogue(fn, (Operand.matrix(m, n, n, 1), Operand(IndexMap.strided(m, 0), IndexMap.strided(n, 1)),
                             everywhere))
    plain = GemmSpec.dense(m, n, k, dtype, alpha=-0.5, accumulate=accumulate)
    fused = GemmSpec(m, n, k, plain.a, plain.b, plain.c, dtype, alpha=-0.5, accumulate=accumulate,
                     epilogue=epilogue)
    plan = emit_gemm(ModuleEmitter(), fused)
    assert plan.spec is fused and plan.epilogue_in_store == in_store
    c0 = rng.standard_normal((m, n)).astype(dtype)
    c, out = c0.copy(), c0.copy()
    gemm_kernel(plain)(a, b, c)
    gemm_kernel(fused)(a, b, out, w, bias, lr)
    want = twin(c, w, bias, lr)
    if body == "erf":
        _close(out, want, dtype)
    else:
        np.testing.assert_array_equal(out, want)


def test_gemm_epilogue_reading_strided_columns_runs_as_a_pass() -> None:
    # An input whose columns are not a run (every other element of a wider matrix) cannot be read
    # by whole vectors where C can: the GEMM applies the epilogue in its pass over finished panels.
    from opgrad.compiler.gemm import Epilogue, IndexMap, Operand, emit_gemm
    from opgrad.compiler.irtext import ModuleEmitter

    m, n, k, dtype = 64, 200, 48, "float32"
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
    wide = rng.standard_normal((m, 2 * n)).astype(dtype)
    epilogue = Epilogue(lambda s, v: s.add(v[0], v[1]), (Operand(IndexMap.strided(m, 2 * n), IndexMap.strided(n, 2)),))
    plain = GemmSpec.dense(m, n, k, dtype)
    fused = GemmSpec(m, n, k, plain.a, plain.b, plain.c, dtype, epilogue=epilogue)
    assert not emit_gemm(ModuleEmitter(), fused).epilogue_in_store
    c, out = np.full((m, n), np.nan, dtype), np.full((m, n), np.nan, dtype)
    gemm_kernel(plain)(a, b, c)
    gemm_kernel(fused)(a, b, out, wide)
    np.testing.assert_array_equal(out, c + wide[:, ::2])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("mnk,accumulate", [((131, 2000, 40), False), ((70, 3001, 700), True)])
def test_gemm_walking_row_tiles_gives_the_bits_of_walking_down_panels(
        dtype: str, mnk: tuple[int, int, int], accumulate: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # A C larger than a few L2 caches is walked row tile by row tile; every element is still the
    # same chain of FMAs over K, so the bits equal those of the walk down the panels, edge tiles,
    # several K blocks and accumulation included.
    import importlib

    from opgrad.compiler.irtext import ModuleEmitter

    gemm_module = importlib.import_module("opgrad.compiler.gemm")  # the package exports a function gemm

    m, n, k = mnk
    rng = np.random.default_rng(m + k)
    a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
    c0 = rng.standard_normal((m, n)).astype(dtype)
    spec = GemmSpec.dense(m, n, k, dtype, alpha=0.75, accumulate=accumulate)
    results = []
    for l2s, walks_rows in ((1 << 30, False), (0, True)):
        monkeypatch.setattr(gemm_module, "C_IN_CACHE_L2S", l2s)
        assert gemm_module.emit_gemm(ModuleEmitter(), spec).walk_rows == walks_rows
        c = c0.copy()
        gemm_kernel(spec)(a, b, c)
        results.append(c)
    np.testing.assert_array_equal(results[0], results[1])
    _close(results[1], (c0 if accumulate else 0) + np.asarray(0.75, dtype) * (a @ b), dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_gemm_summing_k_in_groups_matches_numpy(dtype: str, layout: str) -> None:
    # A small output over a long K sums K in groups, then adds them into C with alpha, onto C's
    # old values; C stored by rows or by columns. K is not a multiple of the blocks, so the last
    # group is shorter.
    from opgrad.compiler.gemm import Blocking, GemmPlan, Operand

    m, n, k = 45, 29, 5003
    rng = np.random.default_rng(11)
    a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
    c_op = Operand.matrix(m, n, n, 1) if layout == "rows" else Operand.matrix(m, n, 1, m)
    spec = GemmSpec(m, n, k, Operand.matrix(m, k, k, 1), Operand.matrix(k, n, n, 1), c_op, dtype, alpha=-0.5,
                    accumulate=True)
    plan = GemmPlan(spec, Blocking.for_target(dtype).for_shape(m, n, dtype))
    assert plan.kgroups > 1 and plan.kgroups * plan.group_blocks * plan.kc > k
    c0 = rng.standard_normal((m, n)).astype(dtype)
    c = c0.copy() if layout == "rows" else c0.T.copy()
    gemm_kernel(spec)(a, b, c)
    _close(c if layout == "rows" else c.T, c0 - 0.5 * (a @ b), dtype)


# ----- conv2d -----

def _im2col(x: np.ndarray, geom) -> np.ndarray:
    (sh, sw), (pt, pb, pl, pr), (dh, dw) = geom.stride, geom.pads, geom.dilation
    xp = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    cols = np.empty((geom.n, geom.c, geom.kh, geom.kw, geom.oh, geom.ow), x.dtype)
    for i in range(geom.kh):
        for j in range(geom.kw):
            cols[:, :, i, j] = xp[:, :, i * dh : i * dh + sh * (geom.oh - 1) + 1 : sh,
                                  j * dw : j * dw + sw * (geom.ow - 1) + 1 : sw]
    return cols


def _col2im(dcols: np.ndarray, geom) -> np.ndarray:
    (sh, sw), (pt, pb, pl, pr), (dh, dw) = geom.stride, geom.pads, geom.dilation
    dxp = np.zeros((geom.n, geom.c, geom.h + pt + pb, geom.w + pl + pr), dcols.dtype)
    for i in range(geom.kh):
        for j in range(geom.kw):
            dxp[:, :, i * dh : i * dh + sh * (geom.oh - 1) + 1 : sh,
                j * dw : j * dw + sw * (geom.ow - 1) + 1 : sw] += dcols[:, :, i, j]
    return dxp[:, :, pt : pt + geom.h, pl : pl + geom.w]


def _random_geometries(count: int) -> list[tuple]:
    rng = np.random.default_rng(2024)
    out = []
    for i in range(count):
        kh, kw = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        stride = (int(rng.integers(1, 3)), int(rng.integers(1, 3)))
        dil = (int(rng.integers(1, 3)), int(rng.integers(1, 3)))
        pads = tuple(int(p) for p in rng.integers(0, 3, size=4))
        h = int(rng.integers(dil[0] * (kh - 1) + 1, 12))
        w = int(rng.integers(dil[1] * (kw - 1) + 1, 12))
        dtype = "float64" if i % 3 == 0 else "float32"
        out.append(((int(rng.integers(1, 4)), int(rng.integers(1, 5)), h, w),
                    (int(rng.integers(1, 7)), 0, kh, kw), stride, pads, dil, dtype))
    out.append(((2, 4, 12, 12), (6, 0, 12, 12), (1, 1), (0, 0, 0, 0), (1, 1), "float32"))  # 1x1 output
    out.append(((3, 2, 9, 9), (5, 0, 3, 3), (2, 2), (1, 1, 1, 1), (2, 2), "float32"))
    # Large enough (> 1 MFLOP per pass) for the packing's transposing path: padded (masked loads,
    # rows not a multiple of the vector width), unpadded (plain loads), partial panels (13 channels).
    out.append(((4, 8, 19, 19), (13, 0, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), "float32"))
    out.append(((4, 8, 19, 19), (13, 0, 3, 3), (1, 1), (0, 0, 0, 0), (1, 1), "float64"))
    # 20 output channels: the forward GEMM takes the 4-row tile (less padding than 6 rows).
    out.append(((4, 8, 19, 19), (20, 0, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), "float32"))
    out.append(((4, 8, 19, 19), (20, 0, 3, 3), (1, 1), (0, 2, 1, 0), (1, 1), "float64"))
    # Small outputs over long reductions sum K in groups: the forward (C indexed by image and
    # pixel) and a one-channel weight gradient, both under a padding window.
    out.append(((4, 128, 8, 8), (16, 0, 6, 6), (1, 1), (1, 1, 1, 1), (1, 1), "float32"))
    out.append(((16, 1, 60, 60), (16, 0, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), "float64"))
    # Column strides from 2 to past half a vector: backward-data adds each col row to every
    # stride-th element of a dx row by whole vectors (the last one partial), or by scalars.
    out.append(((2, 3, 23, 37), (4, 0, 3, 3), (2, 2), (1, 1, 1, 1), (1, 1), "float32"))
    out.append(((2, 3, 17, 40), (4, 0, 3, 4), (1, 3), (0, 0, 2, 1), (1, 1), "float64"))
    out.append(((1, 2, 9, 50), (3, 0, 2, 5), (2, 5), (1, 0, 0, 2), (1, 2), "float32"))
    out.append(((1, 2, 9, 60), (3, 0, 1, 3), (1, 9), (0, 0, 0, 0), (1, 1), "float32"))
    # Over 1 MFLOP a pass with column strides of 2 and 3: the weight gradient packs the im2col
    # a strided output row at a time (rows of 14, 7, 10 and 11 pixels; K blocks and groups that
    # start and end inside rows take the per-pixel path for their ends), padded and not.
    out.append(((4, 8, 27, 27), (12, 0, 3, 3), (2, 2), (1, 1, 1, 1), (1, 1), "float32"))
    out.append(((8, 10, 15, 15), (16, 0, 3, 3), (2, 2), (0, 1, 1, 0), (1, 1), "float64"))
    out.append(((6, 32, 20, 20), (32, 0, 1, 1), (2, 2), (0, 0, 0, 0), (1, 1), "float32"))
    out.append(((5, 8, 31, 31), (16, 0, 3, 3), (3, 3), (1, 1, 1, 1), (1, 1), "float32"))
    # A dilated 7-wide kernel: the forward packs its taps a kernel row at a time (7 taps two
    # elements apart), the weight gradient its strided output rows, under uneven padding.
    out.append(((4, 8, 33, 33), (16, 0, 7, 7), (2, 2), (2, 3, 1, 4), (2, 2), "float32"))
    # With 512-bit vectors the forward packs output pixels a row of lanes at a time where they are
    # no run of memory: rows longer than a vector (43 pixels of a valid conv, 35 two elements
    # apart), pieces of 7 pixels five elements apart, float64's 8-lane vectors, rows across panel ends.
    out.append(((4, 8, 12, 45), (16, 0, 3, 3), (1, 1), (0, 0, 0, 0), (1, 1), "float32"))
    out.append(((4, 8, 9, 70), (16, 0, 3, 3), (2, 2), (1, 1, 1, 1), (1, 1), "float64"))
    out.append(((4, 8, 20, 45), (16, 0, 3, 3), (1, 5), (0, 2, 0, 1), (1, 1), "float32"))
    return out


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_register_tile_follows_the_shape(dtype: str) -> None:
    import dataclasses

    from opgrad.compiler.gemm import Blocking

    host = Blocking.for_target(dtype)
    vl = host.vl
    base = dataclasses.replace(host, mr=6, nr=2 * vl)  # the 16-register tile, whatever this host has
    assert (base.for_shape(32, 9216, dtype).mr, base.for_shape(32, 9216, dtype).nr) == (4, 3 * vl)
    assert base.for_shape(96, 2048, dtype) == base  # no padding with 6 rows
    assert base.for_shape(128, 32, dtype) == base  # 3 vectors would pad 32 columns to 48
    eight = dataclasses.replace(host, mr=8, nr=2 * vl)  # 32 registers: no 3-vector tile of 16 accumulators
    assert eight.for_shape(32, 9216, dtype) == eight


@pytest.mark.parametrize("case", _random_geometries(10))
def test_conv2d_three_passes_match_numpy(case: tuple) -> None:
    xs, ws, stride, pads, dil, dtype = case
    ws = (ws[0], xs[1], ws[2], ws[3])
    geom = conv2d_geometry(xs, ws, stride, pads, dil, dtype)
    k = conv2d_kernels(geom)
    rng = np.random.default_rng(hash(case) % 2**32)
    x, w = rng.standard_normal(xs).astype(dtype), rng.standard_normal(ws).astype(dtype)
    dy = rng.standard_normal(geom.out_shape).astype(dtype)
    cols = _im2col(x, geom)
    y = np.zeros(geom.out_shape, dtype)
    k.forward(x, w, y)
    _close(y, np.einsum("nckjpq,ockj->nopq", cols, w), dtype)
    dx = np.full(xs, np.nan, dtype)  # overwritten, not accumulated
    k.backward_data(dy, w, dx)
    _close(dx, _col2im(np.einsum("ockj,nopq->nckjpq", w, dy), geom), dtype)
    dw = np.full(ws, np.nan, dtype)
    k.backward_weight(x, dy, dw)
    _close(dw, np.einsum("nckjpq,nopq->ockj", cols, dy), dtype)


# ----- KernelBuilder -----

def test_kernel_builder_elementwise_reduce_gemm_in_one_entry() -> None:
    kb = KernelBuilder("t_graph")
    a = View.contiguous(0, (64, 300))
    bias = View.contiguous(1, (300,)).broadcast_to((64, 300))
    kb.elementwise(View.contiguous(2, (64, 300)), [a, bias], lambda s, v: s.max(s.add(v[0], v[1]), s.const(0.0)))
    kb.reduce(View.contiguous(3, (64, 1)), View.contiguous(2, (64, 300)), [1], scale=0.5)
    kb.reduce(View.contiguous(4, (1, 300)), View.contiguous(2, (64, 300)), [0], op="max")
    kb.gemm(GemmSpec.dense(64, 64, 300, trans_b=True), 0, 0, 5)
    kb.elementwise(View.contiguous(7, (600, 300)), [View.contiguous(6, (600, 300))],
                   lambda s, v: s.call("exp", v[0]))
    g = kb.compile()
    rng = np.random.default_rng(3)
    x, b = rng.standard_normal((64, 300)).astype(np.float32), rng.standard_normal(300).astype(np.float32)
    big = rng.standard_normal((600, 300)).astype(np.float32)
    outs = [np.zeros((64, 300), np.float32), np.zeros((64, 1), np.float32), np.zeros((1, 300), np.float32),
            np.zeros((64, 64), np.float32), np.zeros_like(big)]
    g(x, b, outs[0], outs[1], outs[2], outs[3], big, outs[4])
    relu = np.maximum(x + b, 0)
    _close(outs[0], relu, "float32")
    _close(outs[1], 0.5 * relu.sum(1, keepdims=True), "float32")
    _close(outs[2], relu.max(0, keepdims=True), "float32")
    _close(outs[3], x @ x.T, "float32")
    np.testing.assert_allclose(outs[4], np.exp(big), rtol=1e-6)


def _splitmix64(counter: np.ndarray, key: int) -> np.ndarray:
    """numpy's twin of Scalar.hash64 (uint64 arithmetic wraps modulo 2**64)."""
    z = np.uint64(key) + counter.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def test_hash64_of_the_flat_index_is_splitmix64_bitwise() -> None:
    shape, key, threshold = (3, 70001), 0xDEADBEEFCAFEF00D, 3 << 62  # over 2**16 elements: threads split it
    kb = KernelBuilder("t_hash")
    index = KernelBuilder.flat_index(shape)

    def bits(shift: int, mask: int):
        def body(s, v):
            z = s.f.val(f"and i64 {s.f.val(f'lshr i64 {s.hash64(v[0], key)}, {shift}')}, {mask}")
            return s.f.val(f"uitofp i64 {z} to double")
        return body

    kb.elementwise(View.contiguous(0, shape, "float64"), [index], bits(32, 0xFFFFFFFF))
    kb.elementwise(View.contiguous(1, shape, "float64"), [index], bits(0, 0xFFFFFFFF))
    kb.elementwise(View.contiguous(2, shape, "float32"), [index],
                   lambda s, v: s.mask(s.icmp("uge", s.hash64(v[0], key), threshold)))
    outs = [np.zeros(shape), np.zeros(shape), np.zeros(shape, np.float32)]
    kb.compile()(*outs)
    # splitmix64's published first outputs from state 0: counters 1, 2 under key 0
    assert [int(z) for z in _splitmix64(np.array([1, 2]), 0)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4]
    want = _splitmix64(np.arange(np.prod(shape)).reshape(shape), key)
    np.testing.assert_array_equal(outs[0].astype(np.uint64), want >> np.uint64(32))
    np.testing.assert_array_equal(outs[1].astype(np.uint64), want & np.uint64(0xFFFFFFFF))
    np.testing.assert_array_equal(outs[2], (want >= np.uint64(threshold)).astype(np.float32))


_REDUCTIONS = [
    ((512, 1024), (0,), False),  # a column sum: rows added into the output, vectorized
    ((6, 7, 33, 5), (1,), False),  # kept runs on both sides of the reduced axis
    ((6, 7, 33, 5), (0, 2), False),  # reduced axes apart, the last one kept
    ((32, 64, 24, 24), (0, 2, 3), False),  # a bias gradient: h and w merge into one contiguous loop
    ((40, 70), (0,), True),  # inputs with their axes reversed in memory: the reduced axis is the
    ((40, 70), (1,), True),  # contiguous one, or adjacent axes cannot merge into one loop
    ((5, 6, 70), (1, 2), True),
    ((5, 6, 70), (0, 1), True),
    ((3, 1, 65, 1, 9), (0, 1, 3), False),  # extent-1 axes between runs
]


@pytest.mark.parametrize("op", ["sum", "max", "min"])
@pytest.mark.parametrize("case", _REDUCTIONS, ids=[f"{s}-{a}{'-T' if t else ''}" for s, a, t in _REDUCTIONS])
def test_kernel_builder_reductions_match_numpy(case: tuple, op: str) -> None:
    # Every loop order the reduction takes, against numpy, with a fused product of two inputs
    # and a scale; a NaN in the data must reach its output element (max and min included).
    shape, axes, transposed = case
    kb = KernelBuilder("t_reduce")
    ins = [View.contiguous(i, shape) for i in range(2)]
    if transposed:
        ins = [View(i, shape, tuple(reversed(row_major(shape[::-1])))) for i in range(2)]
    kept = tuple(1 if d in axes else n for d, n in enumerate(shape))
    scale = 0.5 if op == "sum" else 1.0
    kb.map_reduce(View.contiguous(2, kept), ins, axes, op, lambda s, v: s.mul(v[0], v[1]), scale=scale)
    rng = np.random.default_rng(len(shape))
    x, y = (rng.standard_normal(shape[::-1] if transposed else shape).astype(np.float32) for _ in range(2))
    x.flat[x.size // 3] = np.nan
    out = np.full(kept, 7.0, np.float32)  # overwritten, not accumulated into
    kb.compile()(x, y, out)
    xv, yv = (x.transpose(), y.transpose()) if transposed else (x, y)
    want = scale * getattr(np, op)((xv * yv).astype(np.float64), axis=axes, keepdims=True)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    finite = ~np.isnan(want)
    np.testing.assert_allclose(out[finite], want[finite], rtol=1e-5, atol=1e-4)


# ----- thread pool determinism -----

_DETERMINISM_SCRIPT = textwrap.dedent("""
    import hashlib, sys, numpy as np
    from opgrad.compiler import conv2d_geometry, conv2d_kernels, gemm
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((300, 257)).astype(np.float32), rng.standard_normal((257, 333)).astype(np.float32)
    h = hashlib.sha256(gemm(a, b).tobytes())
    long_k = rng.standard_normal((24, 3000)).astype(np.float32), rng.standard_normal((3000, 40)).astype(np.float32)
    h.update(gemm(*long_k).tobytes())  # K summed in groups, spread over the threads
    g = conv2d_geometry((8, 16, 14, 14), (32, 16, 3, 3), 1, 1, 1)
    k = conv2d_kernels(g)
    x = rng.standard_normal((8, 16, 14, 14)).astype(np.float32)
    w = rng.standard_normal((32, 16, 3, 3)).astype(np.float32)
    dy = rng.standard_normal(g.out_shape).astype(np.float32)
    y, dx, dw = np.zeros(g.out_shape, np.float32), np.zeros(x.shape, np.float32), np.zeros(w.shape, np.float32)
    k.forward(x, w, y); k.backward_data(dy, w, dx); k.backward_weight(x, dy, dw)
    for t in (y, dx, dw):
        h.update(t.tobytes())
    import opgrad
    from opgrad import ops
    v = opgrad.var("v", (40, 16, 30, 30), "float32")
    r = ops.relu(v)  # a bias gradient's sum computed slice by slice in the relu's pass
    fn = opgrad.function([v], (r, ops.sum(r, axis=(0, 2, 3)), ops.sum(r, axis=(1, 2, 3))))
    for t in opgrad.compile(fn)(rng.standard_normal((40, 16, 30, 30)).astype(np.float32)):
        h.update(t.tobytes())
    print(h.hexdigest())
""")


def _run(script: str, env: dict[str, str]) -> str:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    res = subprocess.run([sys.executable, "-c", script], env=full, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout


_FORK_SCRIPT = textwrap.dedent("""
    import os, signal, threading, time
    import numpy as np
    import opgrad
    from opgrad import ops

    x = opgrad.var("x", (48, 48), "float32")
    fn = opgrad.compile(opgrad.function([x], ops.tanh(ops.matmul(x, x))))
    a = np.random.default_rng(0).standard_normal((48, 48)).astype(np.float32)
    expected = fn(a)
    stop = threading.Event()

    def calling():  # holds the compiled function's lock, over and over
        while not stop.is_set():
            fn(a)

    def compiling():  # holds the compile worker's lock for most of each compile
        k = 0
        while not stop.is_set():
            k += 1
            opgrad.compile(opgrad.function([x], ops.multiply(x, opgrad.const(np.float32(k)))))

    threads = [threading.Thread(target=calling), threading.Thread(target=compiling)]
    for t in threads:
        t.start()
    statuses = []
    for i in range(6):
        time.sleep(0.05 + 0.03 * i)
        pid = os.fork()
        if pid == 0:  # the child: only this thread exists; the locks the others held must not be
            signal.alarm(30)
            ok = np.array_equal(fn(a), expected)
            g = opgrad.compile(opgrad.function([x], ops.multiply(x, opgrad.const(np.float32(-1.0 - i)))))
            ok = ok and np.array_equal(g(a), a * np.float32(-1.0 - i))
            os._exit(0 if ok else 1)
        statuses.append(os.waitpid(pid, 0)[1])
    stop.set()
    for t in threads:
        t.join()
    print(statuses)
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX only")
def test_a_child_forked_while_other_threads_run_and_compile_runs_and_compiles(tmp_path: Path) -> None:
    # A multiprocessing pool or data loader forked mid-training: a lock another thread held at the
    # fork stays held in the child, where no thread will release it (each child would hang until
    # its alarm killed it: status 14 = SIGALRM).
    assert _run(_FORK_SCRIPT, {"OPGRAD_CACHE_DIR": str(tmp_path)}).strip() == str([0] * 6)


def test_results_identical_for_any_thread_count(tmp_path: Path) -> None:
    cache = {"OPGRAD_CACHE_DIR": str(tmp_path)}
    digests = {_run(_DETERMINISM_SCRIPT, {**cache, "OPGRAD_NUM_THREADS": str(n)}).strip() for n in (1, 2, 3, 9)}
    assert len(digests) == 1


# ----- object cache -----

_IR = """
define double @f(double %x) {
  %y = fmul double %x, 0x4008000000000000
  ret double %y
}
"""

_CACHE_SCRIPT = textwrap.dedent("""
    import ctypes
    from opgrad.compiler.jit import NativeModule
    m = NativeModule(IR)
    f = m.cfunc("f", ctypes.c_double, ctypes.c_double)
    assert f(2.0) == 6.0
    print(m.times.cache_hit)
""").replace("IR", repr(_IR))


def test_object_cache_reused_by_second_process(tmp_path: Path) -> None:
    env = {"OPGRAD_CACHE_DIR": str(tmp_path)}
    assert _run(_CACHE_SCRIPT, env).strip() == "False"
    assert len(list(tmp_path.glob("*.o"))) == 1
    assert _run(_CACHE_SCRIPT, env).strip() == "True"


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_corrupt_cache_entry_is_reported_deleted_and_rebuilt(tmp_path: Path, damage: str) -> None:
    store = ObjectCache(tmp_path)
    NativeModule(_IR, cache=store)
    (entry,) = tmp_path.glob("*.o")
    blob = entry.read_bytes()
    if damage == "truncate":
        entry.write_bytes(blob[: len(blob) // 2])
    elif damage == "flip":
        entry.write_bytes(blob[:-1] + bytes([blob[-1] ^ 0xFF]))
    else:
        entry.write_bytes(b"not an object")
    with pytest.warns(UserWarning, match="deleting and rebuilding"):
        m = NativeModule(_IR, cache=store)
    assert not m.times.cache_hit
    assert ObjectCache.check(entry.read_bytes(), m.key) is None  # rebuilt entry is whole again
    assert NativeModule(_IR, cache=store).times.cache_hit


def test_a_cache_entry_that_is_no_regular_file_is_rebuilt_without_reading_it(tmp_path: Path) -> None:
    store = ObjectCache(tmp_path)
    NativeModule(_IR, cache=store)
    (entry,) = tmp_path.glob("*.o")
    entry.unlink()
    entry.symlink_to("/dev/zero")  # read to its end, it would fill the memory
    with pytest.warns(UserWarning, match="is not a regular file; deleting and rebuilding"):
        m = NativeModule(_IR, cache=store)
    assert m.cfunc("f", ctypes.c_double, ctypes.c_double)(2.0) == 6.0
    assert entry.is_file() and NativeModule(_IR, cache=store).times.cache_hit


def test_a_compile_interrupted_mid_exchange_never_hands_its_object_to_the_next(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # A KeyboardInterrupt (or a timeout's signal handler) while the worker compiles: the worker's
    # answer to that request must not become the next request's object (another model's code,
    # cached under its key).
    from opgrad.compiler import llvm_worker

    monkeypatch.delenv("OPGRAD_COMPILE_IN_PROCESS", raising=False)
    read_exact, interrupted = llvm_worker.read_exact, []

    def interrupt_once(stream: object, count: int) -> bytes | None:
        if not interrupted:
            interrupted.append(count)
            raise KeyboardInterrupt
        return read_exact(stream, count)

    monkeypatch.setattr(llvm_worker, "read_exact", interrupt_once)
    with pytest.raises(KeyboardInterrupt):
        NativeModule(_IR, cache=ObjectCache(tmp_path))
    other = NativeModule(_IR.replace("@f", "@g").replace("0x4008", "0x4010"), cache=ObjectCache(tmp_path))
    assert other.cfunc("g", ctypes.c_double, ctypes.c_double)(2.0) == 8.0
    assert NativeModule(_IR, cache=ObjectCache(tmp_path)).cfunc("f", ctypes.c_double, ctypes.c_double)(2.0) == 6.0


def test_a_cache_that_cannot_be_written_warns_at_the_callers_line(tmp_path: Path) -> None:
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    with pytest.warns(UserWarning, match="cannot write the object cache") as warned:
        NativeModule(_IR, cache=ObjectCache(not_a_directory / "cache"))
    assert {w.filename for w in warned} == {__file__}  # this line, not a frame inside opgrad


def test_the_cache_directory_follows_xdg_cache_home() -> None:
    from opgrad.env import cache_dir_setting

    assert cache_dir_setting({"XDG_CACHE_HOME": "/var/cache/me"}) == Path("/var/cache/me/opgrad")
    assert cache_dir_setting({"XDG_CACHE_HOME": "relative"}) == Path.home() / ".cache" / "opgrad"  # ignored, per XDG
    assert cache_dir_setting({}) == Path.home() / ".cache" / "opgrad"
    assert cache_dir_setting({"XDG_CACHE_HOME": "/var/cache/me", "OPGRAD_CACHE_DIR": "/srv/o"}) == Path("/srv/o")


def test_gemm_kernel_is_memoized_in_process() -> None:
    spec = GemmSpec.dense(8, 8, 8)
    assert gemm_kernel(spec) is gemm_kernel(spec)


_PARALLEL_IR = """
declare void @opgrad_parallel_for(ptr, ptr)

define void @share(ptr %ctx, i32 %tid, i32 %nthreads) {
  %slot = getelementptr i32, ptr %ctx, i32 %tid
  store i32 %nthreads, ptr %slot
  ret void
}

define void @run(ptr %ctx) {
  call void @opgrad_parallel_for(ptr @share, ptr %ctx)
  ret void
}
"""

_PARALLEL_SCRIPT = textwrap.dedent("""
    import ctypes
    from opgrad.compiler import threads
    from opgrad.compiler.jit import NativeModule
    assert threads._pool is None
    run = NativeModule(IR, use_cache=False).cfunc("run", None, ctypes.c_void_p)
    shares = (ctypes.c_int32 * 64)()
    run(ctypes.addressof(shares))
    n = threads.pool().nthreads
    assert list(shares[:n]) == [n] * n, list(shares[:n])
    print(n)
""").replace("IR", repr(_PARALLEL_IR))


def test_a_module_calling_the_pool_starts_it_before_loading() -> None:
    """Loading a module that declares the pool's entry starts the pool first (MCJIT would abort the
    process on the unresolved symbol)."""
    assert int(_run(_PARALLEL_SCRIPT, {"OPGRAD_NUM_THREADS": "2"}).strip()) >= 1


# ----- simulated shares -----

_SHARES_SCRIPT = textwrap.dedent("""
    import json, time
    import numpy as np
    import opgrad
    from opgrad import ops
    from opgrad.compiler.threads import pool
    rng = np.random.default_rng(0)
    a = opgrad.var("a", (256, 384), "float32")
    b = opgrad.var("b", (384, 512), "float32")
    fn = opgrad.function([a, b], ops.relu(ops.matmul(a, b)))
    compiled = opgrad.compile(fn, step_entries=True)
    x, y = rng.standard_normal((256, 384), dtype=np.float32), rng.standard_normal((384, 512), dtype=np.float32)
    real = compiled(x, y)
    threads = pool()
    threads.simulate(True)
    try:
        start = time.perf_counter()
        simulated = compiled(x, y)
        wall = time.perf_counter() - start
        totals = threads.share_totals()
        again = threads.share_totals()
    finally:
        threads.simulate(False)
    profile = compiled.profile_parallel(x, y, runs=2)
    print(json.dumps({"nthreads": threads.nthreads, "same": bool(np.array_equal(real, simulated)), "wall": wall,
                      "calls": totals.calls, "busiest": totals.busiest_s, "work": totals.work_s,
                      "cleared": again.calls == 0 and again.work_s == 0, "profile": profile,
                      "after": bool(np.array_equal(real, compiled(x, y)))}))
""")


@pytest.mark.parametrize("threads", [3, 16])
def test_simulated_shares_time_every_share_of_the_pool_size(tmp_path: Path, threads: int) -> None:
    """More threads than this machine has cores: each job's shares run on the caller, timed;
    the busiest share is at least the mean and at most all of them, the results are the same."""
    r = json.loads(_run(_SHARES_SCRIPT, {"OPGRAD_CACHE_DIR": str(tmp_path), "OPGRAD_NUM_THREADS": str(threads)}))
    assert r["nthreads"] == threads and r["same"] and r["after"] and r["cleared"]
    assert r["calls"] >= 1
    assert r["work"] / threads <= r["busiest"] <= r["work"] <= r["wall"]
    (_, serial, parallel), = [row for row in r["profile"] if row[0].startswith("matmul")]
    assert 0 < parallel < serial, r["profile"]


def test_share_totals_give_the_parallel_time() -> None:
    from opgrad.compiler.threads import ShareTotals

    totals = ShareTotals(calls=2, busiest_s=0.25, work_s=1.0)
    assert totals.parallel_seconds(1.5) == pytest.approx(0.75)  # 0.5 s serial + 0.25 s in parallel
