"""batch_matmul compiles to one GEMM kernel with a loop over the batch, and small GEMMs to a loop nest."""

from __future__ import annotations

import re

import numpy as np
import pytest

import opgrad
from opgrad import ops
from opgrad.compiler import plan_graph


def _batch_fn(ba: int, bb: int, m: int, k: int, n: int, dtype: str = "float32") -> opgrad.Function:
    a, b = opgrad.var("a", (ba, m, k), dtype), opgrad.var("b", (bb, k, n), dtype)
    return opgrad.function([a, b], ops.batch_matmul(a, b))


def _defined(ir: str) -> int:
    return len(re.findall(r"^define ", ir, flags=re.M))


def test_code_size_does_not_grow_with_the_batch() -> None:
    small, large = plan_graph(_batch_fn(2, 2, 4, 5, 3)).ir, plan_graph(_batch_fn(1000, 1000, 4, 5, 3)).ir
    assert _defined(small) == _defined(large)
    assert abs(len(small) - len(large)) < 200  # only the batch constants differ


@pytest.mark.parametrize(("ba", "bb", "m", "k", "n", "dtype"), [
    (300, 300, 4, 5, 3, "float32"),    # many tiny entries, spread over the threads
    (3, 1, 33, 70, 90, "float64"),     # b broadcast, packed engine per entry
    (1, 5, 7, 3, 9, "float32"),        # a broadcast
    (2, 2, 130, 150, 140, "float32"),  # entries big enough to split each over the threads
])
def test_batch_matmul_and_its_gradient_equal_the_reference(ba: int, bb: int, m: int, k: int, n: int,
                                                           dtype: str) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ba, m, k)).astype(dtype)
    y = rng.standard_normal((bb, k, n)).astype(dtype)
    fn = _batch_fn(ba, bb, m, k, n, dtype)
    tol = 2e-5 if dtype == "float32" else 1e-10
    np.testing.assert_allclose(opgrad.compile(fn)(x, y), np.matmul(x, y), rtol=tol, atol=tol * np.sqrt(k))
    loss = opgrad.function(fn.params, ops.sum(ops.multiply(fn.outputs[0], fn.outputs[0])))
    step = opgrad.grad(loss, wrt=["a", "b"])
    for got, want in zip(opgrad.compile(step)(x, y), opgrad.evaluate(step, x, y), strict=True):
        scale = max(1.0, float(np.abs(want).max()))
        assert np.abs(got - want).max() <= 1e-4 * scale


@pytest.mark.parametrize(("alpha", "accumulate"), [(1.0, False), (0.5, True)])
@pytest.mark.parametrize(("m", "n", "k", "trans_a", "trans_b", "dtype"), [
    (9, 5, 7, False, True, "float32"),     # B strided: copied into whole vectors first
    (17, 35, 6, False, False, "float32"),  # B's rows read in place, a masked last part; 2 x 8 rows + 1
    (17, 35, 6, False, False, "float64"),
    (3, 16, 40, True, False, "float64"),   # A strided, whole vectors of B, fewer rows than a group
    (8, 1, 300, False, True, "float32"),   # one column: a vector of which 15 lanes are padding
])
def test_small_gemm_loop_nest_honours_alpha_and_accumulate(m: int, n: int, k: int, trans_a: bool, trans_b: bool,
                                                           dtype: str, alpha: float, accumulate: bool) -> None:
    from opgrad.compiler import gemm_kernel
    from opgrad.compiler.gemm import SMALL_GEMM_MAX_FLOPS, GemmSpec

    assert 2.0 * m * n * k < SMALL_GEMM_MAX_FLOPS
    rng = np.random.default_rng(1)
    a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(dtype)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(dtype)
    c = rng.standard_normal((m, n)).astype(dtype)
    product = (a.T if trans_a else a).astype(np.float64) @ (b.T if trans_b else b).astype(np.float64)
    want = (c if accumulate else 0) + alpha * product
    kernel = gemm_kernel(GemmSpec.dense(m, n, k, dtype, trans_a=trans_a, trans_b=trans_b, alpha=alpha,
                                        accumulate=accumulate))
    kernel(a, b, c)
    tol = 1e-5 if dtype == "float32" else 1e-12
    np.testing.assert_allclose(c, want, rtol=tol, atol=tol * np.sqrt(k))


def test_small_gemm_reads_no_further_than_the_end_of_b(tmp_path: object) -> None:
    # B's rows are read in place a vector at a time; the last part of a row is a masked load, so
    # an operand that ends right before an unmapped page is read without a fault.
    import ctypes
    import mmap

    from opgrad.compiler import gemm_kernel
    from opgrad.compiler.gemm import GemmSpec

    m, n, k = 5, 35, 6
    page = mmap.PAGESIZE
    region = mmap.mmap(-1, 2 * page, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(base + page, page, 0) == 0, ctypes.get_errno()  # PROT_NONE
    try:
        nbytes = k * n * 4
        b = np.frombuffer(region, np.float32, count=k * n, offset=page - nbytes).reshape(k, n)
        rng = np.random.default_rng(2)
        b[...] = rng.standard_normal((k, n))
        a = rng.standard_normal((m, k)).astype(np.float32)
        c = np.zeros((m, n), np.float32)
        gemm_kernel(GemmSpec.dense(m, n, k))(a, b, c)
        np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)
        del b
    finally:
        libc.mprotect(base + page, page, mmap.PROT_READ | mmap.PROT_WRITE)


def test_split_module_defines_every_function_once() -> None:
    from opgrad.compiler.split import DEFINE, split_module

    ir = plan_graph(_batch_fn(3, 1, 33, 70, 90)).ir
    parts = split_module(ir, 2)
    assert len(parts) == 2
    defined = [m.group("name") for text in parts for line in text.splitlines() if (m := DEFINE.match(line))]
    whole = [m.group("name") for line in ir.splitlines() if (m := DEFINE.match(line))]
    assert sorted(defined) == sorted(whole)
    assert split_module("@state = internal global i32 0\n" + ir, 2) == ["@state = internal global i32 0\n" + ir]


def test_a_module_cut_in_parts_runs_and_loads_from_the_cache(monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: object) -> None:
    from opgrad.compiler import jit

    monkeypatch.setenv("OPGRAD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(jit, "SPLIT_MIN_CHARS", 0)
    monkeypatch.setattr(jit, "SPLIT_PART_CHARS", 1)
    monkeypatch.setattr(jit, "available_cpus", lambda: 3)
    a, b = opgrad.var("a", (20, 30), "float32"), opgrad.var("b", (30, 40), "float32")
    fn = opgrad.function([a, b], ops.relu(ops.matmul(ops.tanh(a), b)))
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((20, 30)).astype(np.float32), rng.standard_normal((30, 40)).astype(np.float32)
    want = np.maximum(np.tanh(x) @ y, 0)
    cold = opgrad.compile(fn)
    assert not cold.cache_hit and cold.times.parts > 1
    np.testing.assert_allclose(cold(x, y), want, rtol=1e-5, atol=1e-5)
    warm = opgrad.compile(fn)
    assert warm.cache_hit and warm.times.parts == cold.times.parts
    np.testing.assert_allclose(warm(x, y), want, rtol=1e-5, atol=1e-5)


PIECES = """; ModuleID = 'm'
define internal void @m.k1.pack(ptr %p) nounwind "opgrad-pipeline"="explicit" {
  ret void
}
define internal void @m.k1(ptr %p) nounwind "opgrad-pipeline"="cold" {
  call void @m.k1.pack(ptr %p)
  ret void
}
define internal void @m.k2(ptr %p) nounwind "opgrad-pipeline"="streaming" {
  ret void
}
define internal void @m.k3.a(ptr %p) nounwind "opgrad-pipeline"="streaming" {
  ret void
}
define internal void @m.k3(ptr %p) nounwind "opgrad-pipeline"="explicit" {
  call void @m.k3.a(ptr %p)
  ret void
}
define void @m(ptr %p) nounwind {
  call void @m.k1(ptr %p)
  call void @m.k2(ptr %p)
  call void @m.k3(ptr %p)
  ret void
}
"""


def test_a_module_is_cut_by_the_pipelines_its_functions_ask_for() -> None:
    from opgrad.compiler.split import DEFINE, pipeline_pieces

    pieces = dict(pipeline_pieces(PIECES))
    defined = {p: [m.group("name") for line in text.splitlines() if (m := DEFINE.match(line))]
               for p, text in pieces.items()}
    # each function gets the pipeline it asks for; the entry asks for none, and its group's
    # functions ask for several
    assert defined == {"explicit": ["m.k1.pack", "m.k3"], "cold": ["m.k1"], "streaming": ["m.k2", "m.k3.a"],
                       "auto": ["m"]}
    assert "define hidden void @m.k2(" in pieces["streaming"]  # called from another piece
    assert "declare void @m.k2(" in pieces["auto"]
    # a helper of another pipeline is only declared beside its caller, so it is never inlined
    assert "define hidden void @m.k3.a(" in pieces["streaming"] and "declare void @m.k3.a(" in pieces["explicit"]
    # a function that asks for none follows its group's others, a cold fallback aside
    glue = ('define internal void @m.k4.x(ptr %p) nounwind "opgrad-pipeline"="lean" {\n  ret void\n}\n'
            'define internal void @m.k4.y(ptr %p) nounwind "opgrad-pipeline"="cold" {\n  ret void\n}\n'
            'define void @m.k4(ptr %p) nounwind {\n  call void @m.k4.x(ptr %p)\n  call void @m.k4.y(ptr %p)\n'
            '  ret void\n}\n')
    pieces = dict(pipeline_pieces(PIECES + glue))
    assert "define void @m.k4(" in pieces["lean"] and "define hidden void @m.k4.y(" in pieces["cold"]
    unmarked = "\n".join(line.split(' "opgrad-pipeline"')[0] + (" {" if "opgrad-pipeline" in line else "")
                          for line in PIECES.splitlines()) + "\n"
    assert pipeline_pieces(unmarked) == [("auto", unmarked)]


def test_pieces_compile_with_their_pipelines_into_one_module() -> None:
    import ctypes

    from opgrad.compiler.jit import NativeModule

    ir = PIECES.replace("define internal void @m.k2(ptr %p) nounwind \"opgrad-pipeline\"=\"streaming\" {\n  ret void",
                        "define internal void @m.k2(ptr %p) nounwind \"opgrad-pipeline\"=\"streaming\" {\n"
                        "  store i32 7, ptr %p\n  ret void")
    f = NativeModule(ir, use_cache=False).cfunc("m", None, ctypes.c_void_p)
    out = ctypes.c_int32(0)
    f(ctypes.addressof(out))
    assert out.value == 7


def test_an_unknown_pipeline_is_refused() -> None:
    from opgrad.compiler.irtext import FunctionEmitter, ModuleEmitter

    with pytest.raises(ValueError, match="unknown optimization pipeline 'fast'; known: auto, explicit"):
        FunctionEmitter(ModuleEmitter("m"), "m.f", [], pipeline="fast")


def test_a_training_step_marks_its_kernels_and_merges_its_repeated_loops() -> None:
    from opgrad import nn
    from opgrad.compiler.graph import plan_graph
    from opgrad.compiler.merge import merge_identical_functions

    model = nn.build_model("mlp")
    step = nn.TrainStep(model, nn.SGD(), batch_size=4, backend="reference")
    ir = plan_graph(step.function).ir
    for pipeline in ("explicit", "streaming"):
        assert f'"opgrad-pipeline"="{pipeline}"' in ir
    # the parameter updates differ only in their lengths, which the tasks read at run time
    assert merge_identical_functions(ir).count("\ndefine ") < ir.count("\ndefine ")


def test_index_arithmetic_on_constants_is_folded_while_emitting() -> None:
    from opgrad.compiler.irtext import FunctionEmitter, ModuleEmitter

    f = FunctionEmitter(ModuleEmitter("m"), "m.f", [("i64", "x"), ("ptr", "p")])
    assert f.add("%x", 0) == "%x" and f.add(0, "%x") == "%x" and f.sub("%x", "0") == "%x"
    assert f.mul("%x", 1) == "%x" and f.mul("1", "%x") == "%x" and f.mul("%x", 0) == "0"
    assert f.add(f.mul(3, 7), "-4") == "17" and f.sub(5, 9) == "-4"
    assert f.add(2**31 - 1, 1, "i32") == str(-(2**31))  # wraps as LLVM's i32 add does
    assert f.gep("float", "%p", 0) == "%p"
    assert f.add("%x", 5).startswith("%add.")  # anything else is still an instruction
