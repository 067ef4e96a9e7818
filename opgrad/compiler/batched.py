"""batch_matmul's kernel: one GEMM body called for every batch entry on moved pointers.

A GEMM per entry made code size and compile time grow with the batch (a batch of 1000 compiled
for minutes); one body with a loop costs the same for any batch.
"""

from __future__ import annotations

from .gemm import GemmPlan, GemmSpec, emit_gemm
from .irtext import LLVM_TYPE, FunctionEmitter, ModuleEmitter
from .threads import PARALLEL_FOR

__all__ = ["emit_batched_gemm"]


def emit_batched_gemm(m: ModuleEmitter, spec: GemmSpec, batch: int, steps: tuple[int, int, int],
                      name: str) -> GemmPlan:
    """``void @name(ptr a, ptr b, ptr c, ptr ws)``: ``spec``'s GEMM for each of ``batch`` entries, entry
    ``i`` on A, B and C moved by ``i * steps`` elements (a step of 0 broadcasts that operand).

    One GEMM body serves every entry, so the code and the compile time do not grow with the batch.
    Entries big enough to split (``spec.parallel_min_flops``) run one after the other, each on all
    threads; smaller ones are spread over the threads, whole entries each, so every result is
    computed the same way whatever the thread count.
    """
    plan = emit_gemm(m, spec, name + ".one")
    one = plan.names["entry"]
    t = LLVM_TYPE[spec.dtype]
    split_entries = 2.0 * spec.m * spec.n * spec.k < spec.parallel_min_flops and batch > 1

    def run_entries(f: FunctionEmitter, ptrs: list[str], lo: str, hi: str, ws: str, whole: bool) -> None:
        with f.loop(lo, hi, hint="bi") as i:
            moved = [f.gep(t, p, f.mul(i, step)) if step else p for p, step in zip(ptrs, steps, strict=True)]
            args = [("ptr", p) for p in moved] + [("ptr", ws)]
            if whole or "block" not in plan.names or plan.operands_swapped:
                f.call("void", "@" + one, args)
            else:
                f.call("void", f"@{plan.names['block']}", args + [("i64", x) for x in (
                    "0", str(spec.m), "0", str(spec.n), "0", str(spec.k))])

    if split_entries:
        task = FunctionEmitter(m, name + ".task", [("ptr", "ctx"), ("i32", "tid"), ("i32", "nt")], linkage="internal")
        ptrs = [task.load("ptr", task.gep("ptr", "%ctx", str(i))) for i in range(4)]
        tid, nt = task.val("sext i32 %tid to i64"), task.val("sext i32 %nt to i64")
        lo = task.val(f"udiv i64 {task.mul(tid, batch)}, {nt}")
        hi = task.val(f"udiv i64 {task.mul(task.add(tid, 1), batch)}, {nt}")
        ws = task.gep("i8", ptrs[3], task.mul(tid, plan.workspace_per_thread))
        run_entries(task, ptrs[:3], lo, hi, ws, whole=False)
        task.ret_void()
        task.finish()
    f = FunctionEmitter(m, name, [("ptr", "a"), ("ptr", "b"), ("ptr", "c"), ("ptr", "ws")])
    if split_entries:
        ctx = f.alloca("[4 x ptr]", "ctx", align=8)
        for i, p in enumerate(("%a", "%b", "%c", "%ws")):
            f.store("ptr", p, f.gep("ptr", ctx, str(i)))
        f.call("void", "@" + PARALLEL_FOR, [("ptr", f"@{name}.task"), ("ptr", ctx)])
    else:
        run_entries(f, ["%a", "%b", "%c"], "0", str(batch), "%ws", whole=True)
    f.ret_void()
    f.finish()
    plan.names = {"entry": name}
    return plan
