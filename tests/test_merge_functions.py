"""Identical kernels are compiled once: the IR merge keeps results and exported symbols."""

from __future__ import annotations

import ctypes

import numpy as np

import opgrad
from opgrad import ops
from opgrad.compiler.jit import NativeModule
from opgrad.compiler.merge import merge_identical_functions

MODULE = """; ModuleID = 'm'
declare float @llvm.exp.f32(float)
define internal float @m.a.leaf(float %x) nounwind {
entry:
  %y = call float @llvm.exp.f32(float %x)
  ret float %y
}
define float @m.a(float %x) nounwind {
entry:
  %y = call float @m.a.leaf(float %x)
  ret float %y
}
define internal float @m.b.leaf(float %x) nounwind {
entry:
  %y = call float @llvm.exp.f32(float %x)
  ret float %y
}
define float @m.b(float %x) nounwind {
entry:
  %y = call float @m.b.leaf(float %x)
  ret float %y
}
define internal float @m.c.leaf(float %x) nounwind {
entry:
  ret float %x
}
define float @m.c(float %x) nounwind {
entry:
  %y = call float @m.c.leaf(float %x)
  ret float %y
}
define float @m(float %x) {
entry:
  %a = call float @m.a(float %x)
  %b = call float @m.b(float %x)
  %c = call float @m.c(float %x)
  %s = fadd float %a, %b
  %t = fadd float %s, %c
  ret float %t
}
"""


def _defined(text: str) -> list[str]:
    return [line.split("@")[1].split("(")[0] for line in text.splitlines() if line.startswith("define")]


def test_a_repeated_kernel_group_becomes_entry_points_calling_the_first() -> None:
    merged = merge_identical_functions(MODULE)
    assert _defined(merged) == ["m.a.leaf", "m.a", "m.b", "m.c.leaf", "m.c", "m"]
    assert "define float @m.b(float %x) nounwind {\nentry:\n  %result = tail call float @m.a(float %x)" in merged
    assert "m.b.leaf" not in merged
    assert merge_identical_functions(merged) == merged


def test_callers_of_a_dropped_helper_call_the_first_groups() -> None:
    # The graph's entry calls each parallel loop's internal task; a repeated loop must still merge.
    shared = MODULE.replace("%c = call float @m.c(float %x)", "%c = call float @m.b.leaf(float %x)")
    merged = merge_identical_functions(shared)
    assert _defined(merged) == ["m.a.leaf", "m.a", "m.b", "m.c.leaf", "m.c", "m"]
    assert "%c = call float @m.a.leaf(float %x)" in merged and "m.b.leaf" not in merged
    for text in (shared, merged):
        f = NativeModule(text, use_cache=False).cfunc("m", ctypes.c_float, ctypes.c_float)
        np.testing.assert_allclose(f(0.5), 3 * np.exp(0.5), rtol=1e-6)


def test_text_without_functions_or_with_stray_text_is_left_alone() -> None:
    assert merge_identical_functions("; ModuleID = 'empty'\n") == "; ModuleID = 'empty'\n"
    odd = MODULE.replace("define float @m.b(", "@g = global i32 0\ndefine float @m.b(")
    assert merge_identical_functions(odd) == odd


def test_repeated_layers_compile_to_the_reference_numbers() -> None:
    x = opgrad.var("x", (2, 3, 9, 9), "float32")
    w1, w2 = opgrad.var("w1", (3, 3, 3, 3), "float32"), opgrad.var("w2", (3, 3, 3, 3), "float32")
    h = ops.relu(ops.conv2d(x, w1, padding=(1, 1)))
    y = ops.relu(ops.conv2d(h, w2, padding=(1, 1)))
    fn = opgrad.Function([x, w1, w2], ops.sum(ops.multiply(y, y)))
    grad_fn = opgrad.grad(fn, wrt=[1, 2])
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(v.shape).astype(np.float32) for v in (x, w1, w2)]
    want = opgrad.evaluate(grad_fn, *args)
    compiled = opgrad.compile(grad_fn)
    assert merge_identical_functions(compiled.ir).count("\ndefine ") < compiled.ir.count("\ndefine ")
    got = compiled(*args)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


def test_wrappers_of_hidden_kernels_call_with_the_return_type_only() -> None:
    hidden = MODULE.replace("define float @m.", "define hidden float @m.")
    merged = merge_identical_functions(hidden)
    assert "define hidden float @m.b(float %x) nounwind {\nentry:\n  %result = tail call float @m.a(float %x)" in merged
    import llvmlite.binding as llvm

    llvm.parse_assembly(merged).verify()
