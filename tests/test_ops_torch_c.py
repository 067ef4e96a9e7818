"""Resizing, layouts, Darknet's reorg and detection post-processing: against PyTorch (float64
forward and gradients) where it has the operation, against hand-computed cases where it has not
(nms, multibox_transform_loc: torchvision is not a dependency), compiled kernels against the
numpy reference in float32 and float64 including NaN and inf, and the `opgrad ops --nnvm` /
`--matrix` tables.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from optional import require

import opgrad
from opgrad import cli, docgen, ops, registry
from opgrad.errors import GradientError, OpCallError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_ops_torch_b import against_torch, compiled_matches_reference

torch = require("torch", "resize, layout and reorg are compared with PyTorch (test-only dependency)")
ROOT = Path(__file__).resolve().parents[1]


def _rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + sum(shape)).uniform(-2.0, 2.0, shape)


# ----- resize and upsampling -----

RESIZE_CASES = [((2, 3, 4, 5), (8, 10)), ((1, 2, 5, 3), (3, 7)), ((1, 1, 7, 4), (2, 2)), ((2, 1, 1, 1), (3, 4)),
                ((1, 2, 6, 6), (6, 6)), ((1, 1, 3, 5), (13, 1))]


@pytest.mark.parametrize("shape, size", RESIZE_CASES)
@pytest.mark.parametrize("method, align", [("nearest", False), ("bilinear", False), ("bilinear", True)])
def test_resize_matches_torch_interpolate(shape, size, method: str, align: bool) -> None:
    def reference(x):
        return torch.nn.functional.interpolate(x, size=size, mode=method,
                                               align_corners=align if method == "bilinear" else None)

    against_torch(lambda x: ops.resize(x, size=size, method=method, align_corners=align), reference, [_rand(*shape)],
                  [0])


@pytest.mark.parametrize("scale", [1, 2, 3])
@pytest.mark.parametrize("method", ["nearest", "bilinear"])
def test_upsampling_is_interpolate_with_a_scale_factor(scale: int, method: str) -> None:
    against_torch(lambda x: ops.upsampling(x, scale, method),
                  lambda x: torch.nn.functional.interpolate(x, scale_factor=scale, mode=method),
                  [_rand(2, 3, 3, 4)], [0])


def test_many_phase_ratios_take_the_table_kernel_and_match() -> None:
    """7 -> 40 rows has 40 phases: the kernel reduces against the constant weight table instead."""
    against_torch(lambda x: ops.resize(x, size=(40, 3), method="bilinear"),
                  lambda x: torch.nn.functional.interpolate(x, size=(40, 3), mode="bilinear"), [_rand(1, 2, 7, 5)], [0])


@pytest.mark.parametrize("size, method, align", [((9, 7), "bilinear", False), ((40, 3), "bilinear", True),
                                                 ((5, 8), "nearest", False), ((2, 2), "bilinear", False)])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_resize_nan_and_inf_reach_exactly_the_outputs_that_read_them(size, method: str, align: bool,
                                                                     dtype: str) -> None:
    x = _rand(1, 2, 7, 5).astype(dtype)
    x[0, 0, 3, 2], x[0, 1, 1, 1], x[0, 1, 6, 4] = np.nan, np.inf, -np.inf
    v = opgrad.var("x", x.shape, dtype)
    y = ops.resize(v, size=size, method=method, align_corners=align)
    c = opgrad.var("c", y.shape, dtype)
    fn = opgrad.grad(opgrad.function([v, c], ops.sum(ops.multiply(y, c))), wrt=[v])
    cot = _rand(*y.shape).astype(dtype)
    cot.flat[3] = np.nan
    for f, args in ((opgrad.function([v], y), [x]), (fn, [x, cot])):
        with np.errstate(all="ignore"):
            want = opgrad.evaluate(f, *args)
        got = opgrad.compile(f)(*args)
        for g, w in zip(got if isinstance(got, tuple) else [got], want if isinstance(want, tuple) else [want]):
            assert np.array_equal(np.isnan(g), np.isnan(w)) and np.array_equal(np.isinf(g), np.isinf(w))
            finite = np.isfinite(w)
            if finite.any():
                np.testing.assert_allclose(g[finite], w[finite], rtol=0,
                                           atol=2e-5 * max(1.0, np.abs(w[finite]).max()))
    with np.errstate(all="ignore"):
        out = opgrad.evaluate(opgrad.function([v], y), x)
    assert np.isnan(out).sum() < out.size  # the NaN spreads to its readers only


def test_resize_errors_name_the_problem() -> None:
    x = opgrad.var("x", (1, 2, 3, 4), "float64")
    with pytest.raises(OpCallError, match="align_corners applies to method 'bilinear' only"):
        ops.resize(x, size=4, align_corners=True)
    with pytest.raises(OpCallError, match="expected one of nearest, bilinear"):
        ops.resize(x, size=4, method="bicubic")
    with pytest.raises(OpCallError, match="positive ints"):
        ops.resize(x, size=(0, 3))
    with pytest.raises(OpCallError, match="4-D NCHW"):
        ops.resize(opgrad.var("y", (2, 3, 4), "float64"), size=2)
    with pytest.raises(ValueError, match=r"scale=1\.5 must be a positive int"):
        ops.upsampling(x, 1.5)


# ----- layout_transform, conv2d_nchwc, yolo2_reorg -----


def _to_blocked(t: Any, c: int) -> Any:
    n, ch, h, w = t.shape
    return t.reshape(n, ch // c, c, h, w).permute(0, 1, 3, 4, 2)


@pytest.mark.parametrize("src, dst", [("NCHW", "NCHW4c"), ("NCHW", "NHWC"), ("NHWC", "NCHW2c"), ("NCHW4c", "NCHW2c"),
                                      ("NCHW8c", "NHWC"), ("NCHW2c", "NCHW2c")])
def test_layout_transform_matches_torch_permutes(src: str, dst: str) -> None:
    layouts = {"NCHW": lambda t: t, "NHWC": lambda t: t.permute(0, 2, 3, 1),
               "NCHW2c": lambda t: _to_blocked(t, 2), "NCHW4c": lambda t: _to_blocked(t, 4),
               "NCHW8c": lambda t: _to_blocked(t, 8)}
    nchw = torch.tensor(_rand(2, 8, 3, 5))
    data = layouts[src](nchw).contiguous().numpy()
    back = {"NCHW": lambda t: t, "NHWC": lambda t: t.permute(0, 3, 1, 2),
            "NCHW2c": lambda t: t.permute(0, 1, 4, 2, 3).reshape(2, 8, 3, 5),
            "NCHW4c": lambda t: t.permute(0, 1, 4, 2, 3).reshape(2, 8, 3, 5),
            "NCHW8c": lambda t: t.permute(0, 1, 4, 2, 3).reshape(2, 8, 3, 5)}
    against_torch(lambda x: ops.layout_transform(x, src=src, dst=dst), lambda x: layouts[dst](back[src](x)),
                  [data], [0])


def test_layout_transform_errors() -> None:
    x = opgrad.var("x", (1, 6, 2, 2), "float64")
    with pytest.raises(OpCallError, match="needs the 6 channels in whole blocks of 4"):
        ops.layout_transform(x, src="NCHW", dst="NCHW4c")
    with pytest.raises(OpCallError, match=r"not in layout NCHW4c: expected 5-D \(N, C/4, H, W, 4\)"):
        ops.layout_transform(x, src="NCHW4c", dst="NCHW")
    with pytest.raises(OpCallError, match="'NCHW', 'NHWC' or 'NCHW\\{c\\}c'"):
        ops.layout_transform(x, src="NCWH", dst="NCHW")


def test_conv2d_nchwc_is_conv2d_between_layout_transforms() -> None:
    x, w = _rand(2, 8, 6, 5), _rand(6, 8, 3, 3, seed=1)

    def library(xb, wb):
        data = xb.permute(0, 1, 4, 2, 3).reshape(2, 8, 6, 5)
        weight = wb.permute(0, 5, 1, 4, 2, 3).reshape(6, 8, 3, 3)
        return _to_blocked(torch.nn.functional.conv2d(data, weight, stride=2, padding=1), 3)

    xb = x.reshape(2, 2, 4, 6, 5).transpose(0, 1, 3, 4, 2).copy()
    wb = w.reshape(2, 3, 2, 4, 3, 3).transpose(0, 2, 4, 5, 3, 1).copy()
    against_torch(lambda a, b: ops.conv2d_nchwc(a, b, strides=2, padding=1), library, [xb, wb], [0, 1])
    with pytest.raises(ValueError, match="does not match data"):
        ops.conv2d_nchwc(opgrad.var("a", xb.shape, "float64"), opgrad.var("b", (2, 2, 3, 3, 2, 3), "float64"))


def _darknet_reorg(a: np.ndarray, s: int) -> np.ndarray:
    """Darknet's reorg_cpu(forward=0) loop, index by index (TVM's reorg_python)."""
    b_, c, h, w = a.shape
    flat, oc, out = a.reshape(-1), c // (s * s), np.zeros(a.size)
    cnt = 0
    for b in range(b_):
        for k in range(c):
            for j in range(h):
                for i in range(w):
                    offset = k // oc
                    w2, h2 = i * s + offset % s, j * s + offset // s
                    out[cnt] = flat[w2 + w * s * (h2 + h * s * (k % oc + oc * b))]
                    cnt += 1
    return out.reshape(b_, c * s * s, h // s, w // s)


@pytest.mark.parametrize("shape, stride", [((2, 8, 4, 6), 2), ((1, 9, 3, 6), 3), ((2, 4, 2, 2), 1),
                                           ((1, 4, 2, 4), 2)])
def test_yolo2_reorg_is_darknets_reorg(shape: tuple[int, ...], stride: int) -> None:
    x = _rand(*shape)
    v = opgrad.var("x", shape, "float64")
    np.testing.assert_array_equal(opgrad.evaluate(opgrad.function([v], ops.yolo2_reorg(v, stride=stride)), x),
                                  _darknet_reorg(x, stride))
    b, c, h, w = shape
    s = stride

    def library(t):  # the same permutation in torch, for its autograd
        six = t.reshape(b, c // (s * s), h, s, w, s).permute(0, 3, 5, 1, 2, 4)
        return six.reshape(b, c * s * s, h // s, w // s)

    against_torch(lambda t: ops.yolo2_reorg(t, stride=stride), library, [x], [0])


def test_yolo2_reorg_errors() -> None:
    with pytest.raises(OpCallError, match="C=6 must be a multiple of stride\\*\\*2=4"):
        ops.yolo2_reorg(opgrad.var("x", (1, 6, 4, 4), "float64"), stride=2)
    with pytest.raises(OpCallError, match="H=3 and W=4 must be multiples of stride=2"):
        ops.yolo2_reorg(opgrad.var("x", (1, 4, 3, 4), "float64"), stride=2)


@pytest.mark.parametrize("build, shape", [
    (lambda x: ops.layout_transform(ops.tanh(x), src="NCHW", dst="NCHW4c"), (1, 8, 3, 2)),
    (lambda x: ops.yolo2_reorg(ops.transpose(x, axes=(0, 1, 3, 2)), stride=2), (2, 4, 6, 4)),
    (lambda x: ops.resize(ops.strided_slice(x, begin=[0, 0, 0], end=[2, 2, 5], strides=[1, 1, 2]), size=(5, 6),
                          method="bilinear", align_corners=True), (2, 3, 5, 6)),
])
def test_strided_inputs_inside_gradient_graphs(build: Any, shape: tuple[int, ...]) -> None:
    compiled_matches_reference(build, [_rand(*shape)], [0])


# ----- detection post-processing -----


def _nms(data: np.ndarray, counts: list[int], **attrs: Any) -> np.ndarray:
    d = opgrad.var("d", data.shape, "float64")
    v = opgrad.var("v", (len(counts),), "int64")
    return opgrad.evaluate(opgrad.function([d, v], ops.nms(d, v, **attrs)), data, np.array(counts))


BOXES = np.array([[[0, 0.6, 0.0, 0.0, 1.0, 1.0],    # class 0, overlaps the next one with IoU 0.81
                   [0, 0.9, 0.0, 0.0, 0.9, 0.9],
                   [1, 0.8, 0.0, 0.0, 1.0, 1.0],    # another class: kept unless force_suppress
                   [0, 0.7, 2.0, 2.0, 3.0, 3.0],    # far away
                   [0, 0.99, 5.0, 5.0, 6.0, 6.0]]])  # past valid_count: becomes -1


def test_nms_hand_computed() -> None:
    out = _nms(BOXES, [4], nms_threshold=0.5)
    want = np.array([[0, 0.9, 0, 0, 0.9, 0.9], [1, 0.8, 0, 0, 1, 1], [0, 0.7, 2, 2, 3, 3],
                     [-1, 0.6, 0, 0, 1, 1], [-1] * 6])
    np.testing.assert_array_equal(out[0], want)
    forced = _nms(BOXES, [4], nms_threshold=0.5, force_suppress=True)
    assert list(forced[0, :, 0]) == [0, -1, 0, -1, -1]
    assert list(_nms(BOXES, [4], nms_threshold=0.85)[0, :, 0]) == [0, 1, 0, 0, -1]  # IoU 0.81 < 0.85
    top2 = _nms(BOXES, [4], nms_threshold=0.5, nms_topk=2)
    np.testing.assert_array_equal(top2[0, 2:], -np.ones((3, 6)))
    packed = _nms(BOXES, [4], nms_threshold=0.5, force_suppress=True, do_rearrange=True)
    np.testing.assert_array_equal(packed[0, :2, 1], [0.9, 0.7])
    np.testing.assert_array_equal(packed[0, 2:], -np.ones((3, 6)))
    off = _nms(BOXES, [3], nms_threshold=0.0)  # a threshold <= 0 copies the valid rows unsorted
    np.testing.assert_array_equal(off[0, :3], BOXES[0, :3])
    np.testing.assert_array_equal(_nms(BOXES, [0], nms_threshold=0.5), -np.ones_like(BOXES))


def test_multibox_transform_loc_hand_computed() -> None:
    cls_prob = np.array([[[0.1, 0.7, 0.2], [0.6, 0.2, 0.005], [0.3, 0.1, 0.795]]])  # (1, 3 classes, 3 anchors)
    loc = np.array([[0.0, 0.0, 0.0, 0.0, 1.0, -1.0, 0.5, 0.0, 5.0, 5.0, 0.0, 0.0]])
    anchor = np.array([[[0.1, 0.1, 0.3, 0.5], [0.4, 0.4, 0.6, 0.6], [0.8, 0.8, 1.0, 1.0]]])
    args = [opgrad.var(n, a.shape, "float64") for n, a in (("c", cls_prob), ("l", loc), ("a", anchor))]
    out = opgrad.evaluate(opgrad.function(args, ops.multibox_transform_loc(*args, threshold=0.01)),
                          cls_prob, loc, anchor)
    # anchor 0: best class 1 (0.6) -> id 0, box = the anchor; anchor 1: class 1 (0.2 > 0.1) -> id 0;
    # anchor 2: classes 0.005 and 0.795 -> id 1 with 0.795, centre shifted by 5 * 0.1 * 0.2 to (1, 1),
    # so (0.9, 0.9, 1.1, 1.1) clipped to 1.
    np.testing.assert_allclose(out[0, 0], [0, 0.6, 0.1, 0.1, 0.3, 0.5])
    cx, cy = 0.5 + 1.0 * 0.1 * 0.2, 0.5 - 1.0 * 0.1 * 0.2
    half_w, half_h = np.exp(0.5 * 0.2) * 0.2 / 2, 0.1
    np.testing.assert_allclose(out[0, 1], [0, 0.2, cx - half_w, cy - half_h, cx + half_w, cy + half_h])
    np.testing.assert_allclose(out[0, 2], [1, 0.795, 0.9, 0.9, 1.0, 1.0])
    strict = opgrad.evaluate(opgrad.function(args, ops.multibox_transform_loc(*args, threshold=0.7, clip=False)),
                             cls_prob, loc, anchor)
    np.testing.assert_allclose(strict[0, 0, :2], [1, 0.795])  # only anchor 2 scores >= 0.7
    np.testing.assert_array_equal(strict[0, 1:], -np.ones((2, 6)))
    assert strict[0, 0, 4] > 1.0  # unclipped


def test_detection_ops_have_no_gradient_and_no_kernel_and_say_why() -> None:
    d, v = opgrad.var("d", (1, 3, 6), "float64"), opgrad.var("v", (1,), "int64")
    with pytest.raises(GradientError, match=r"cannot differentiate through 'nms'.*piecewise constant"):
        opgrad.grad(opgrad.function([d, v], ops.sum(ops.nms(d, v))))
    c, lo, a = (opgrad.var(n, s, "float64") for n, s in (("c", (1, 2, 3)), ("l", (1, 12)), ("a", (1, 3, 4))))
    with pytest.raises(GradientError, match="cannot differentiate through 'multibox_transform_loc'"):
        opgrad.grad(opgrad.function([c, lo, a], ops.sum(ops.multibox_transform_loc(c, lo, a))), wrt=["l"])
    with pytest.raises(NotImplementedError, match="'multibox_transform_loc' has no lowering: it is reference only"):
        opgrad.compile(opgrad.function([c, lo, a], ops.multibox_transform_loc(c, lo, a)))
    with pytest.raises(OpCallError, match=r"anchor has shape \(1, 2, 4\); cls_prob \(1, 2, 3\) needs"):
        ops.multibox_transform_loc(c, lo, opgrad.var("b", (1, 2, 4), "float64"))
    with pytest.raises(OpCallError, match="data must be \\(B, A, 6\\)"):
        ops.nms(opgrad.var("e", (1, 3, 5), "float64"), v)
    with pytest.raises(ValueError, match=r"valid_count must lie in \[0, 3\]"):
        _nms(np.zeros((1, 3, 6)), [4])


# ----- opgrad ops --nnvm and --matrix -----

NNVM_OPS = [
    "__add_symbol__", "__div_symbol__", "__layout_transform__", "__mul_symbol__", "__sub_symbol__", "__undef__",
    "_contrib_conv2d_NCHWc", "_conv2d_grad", "_max_pool2d_grad", "avg_pool2d", "batch_norm", "broadcast_add",
    "broadcast_div", "broadcast_mul", "broadcast_sub", "broadcast_to", "cast", "concatenate", "conv2d_transpose",
    "dropout", "flip", "full", "global_avg_pool2d", "global_max_pool2d", "multibox_transform_loc", "nms", "ones",
    "pad", "prelu", "resize", "split", "tvm_op", "upsampling", "yolo2_reorg"
]


def test_nnvm_table_answers_all_34_truthfully(capsys) -> None:
    assert len(NNVM_OPS) == 34
    assert cli.main(["ops", "--nnvm"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines()[2:] if line.strip()}
    assert sorted(lines) == sorted(NNVM_OPS)
    assert "python operator: a + b → add" in lines["__add_symbol__"]
    assert "NNVM internal" in lines["tvm_op"] and "NNVM internal" in lines["__undef__"]
    assert "conv2d_backward_input" in lines["_conv2d_grad"] and "conv2d_backward_weight" in lines["_conv2d_grad"]
    assert "composite conv2d_nchwc" in lines["_contrib_conv2d_NCHWc"]
    for name in ("conv2d_transpose", "resize", "nms"):
        planned = f"planned: {name}" in lines[name]
        assert planned == (name not in registry.names())


def test_nnvm_doc_is_generated() -> None:
    committed = (ROOT / "docs" / "nnvm.md").read_text()
    assert committed == docgen.render_nnvm(), "docs/nnvm.md is stale: run python -m opgrad.docgen nnvm > docs/nnvm.md"


#: Operators of this branch, each of which must have at least one planted mutant.
NEW_DIFFERENTIABLE = {"resize", "resize_backward", "layout_transform", "yolo2_reorg"}


def test_matrix_has_no_hole_for_differentiable_ops() -> None:
    from opgrad.optable import MATRIX_HEADER, matrix_rows

    reference_only = {op.name for op in registry.all_ops() if op.lowering_reason}
    holes = []
    for row in matrix_rows():
        r = dict(zip(MATRIX_HEADER, row))
        op = registry.get(r["op"])
        if op.user_defined or not any(i.differentiable for i in op.inputs) or r["op"] in reference_only:
            continue
        wanted = {"forward": "numpy", "gradient": "yes", "second order": "yes", "lowering": "llvm"}
        holes += [f"{r['op']}: {k} is {r[k]!r}" for k, v in wanted.items() if r[k] != v]
        if r["op"] in NEW_DIFFERENTIABLE and int(r["mutants"]) < 1:
            holes.append(f"{r['op']}: no mutant")
    assert not holes, holes
    assert reference_only == {"nms", "multibox_transform_loc"}


def test_check_results_are_recorded_for_the_matrix(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("OPGRAD_CACHE_DIR", str(tmp_path))
    assert cli.main(["check", "yolo2_reorg", "--examples", "3", "--seed", "0", "--jobs", "1"]) == 0
    stored = json.loads((tmp_path / "check-results.json").read_text())
    assert stored["yolo2_reorg"]["reference"]["passed"] is True
    assert stored["yolo2_reorg"]["reference"]["examples"] == 3
    capsys.readouterr()
    assert cli.main(["ops", "--matrix"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("yolo2_reorg "))
    assert "passed reference 3" in row
    assert "never run" in next(line for line in out.splitlines() if line.startswith("resize "))
    assert cli.main(["ops", "--matrix", "--nnvm"]) == 2  # two tables asked for at once
    assert "argument --nnvm: not allowed with argument --matrix" in capsys.readouterr().err
