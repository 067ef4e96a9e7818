"""Row gathers and their adjoint: ``take`` along axis 0 (an embedding lookup) by address.

``take``'s general lowering compares every index with every position of the axis, which costs the
axis' length per element picked: an embedding of 30,000 tokens would read its whole table for each
token. Along axis 0 of dense rows the pick is a copy of one row, addressed by the index; an index
past the table is clamped to it, so a kernel never reads outside its buffers (indices given as
arguments are checked before the call and named in the error).

The adjoint (``take_backward``) adds each picked row's gradient into its table row. Threads split
the row's columns, and every thread adds the picks in their order, so the sums are the same on any
thread count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .irtext import LLVM_TYPE, FunctionEmitter
from .views import View, elem_type

if TYPE_CHECKING:  # the builder imports this module; the type is all this one needs of it
    from .builder import KernelBuilder

__all__ = ["gather_rows", "rows_addressable", "scatter_add_rows"]


def rows_addressable(*views: View) -> bool:
    """Whether each view is memory in row-major order: one row a run of elements."""
    return all(v.is_memory and v.is_contiguous for v in views)


def _row(f: FunctionEmitter, indices: View, pick: str, rows: int) -> str:
    """The table row that pick ``pick`` of ``indices`` names, as i64, held to ``[0, rows)``."""
    index_type = elem_type(indices.dtype)
    index = f.load(index_type, f.gep(index_type, "%p2", f.add(pick, indices.offset)))
    wide = index if index_type == "i64" else f.val(f"sext {index_type} {index} to i64")
    return f.smin(f.smax(wide, 0), rows - 1)


def gather_rows(kb: KernelBuilder, out: View, table: View, indices: View) -> None:
    """``out[i, ...] = table[indices[i], ...]`` for the flattened ``indices`` (views in row-major
    memory, :func:`rows_addressable`), split over threads by picks."""
    picks, rows = indices.size, table.shape[0]
    width = table.size // rows if rows else 0
    name = kb.fresh("gather")
    f = kb.loop_function(name, 3)
    t = LLVM_TYPE[table.dtype]
    with f.loop("%lo", "%hi", hint="pick") as i:
        row = _row(f, indices, i, rows)
        source = f.gep(t, "%p1", f.add(f.mul(row, width), table.offset))
        target = f.gep(t, "%p0", f.add(f.mul(i, width), out.offset))
        with f.loop(0, width, hint="col") as c:
            f.store(t, f.load(t, f.gep(t, source, c)), f.gep(t, target, c))
    f.ret_void()
    f.finish()
    kb.add_parallel(name, [out.buffer, table.buffer, indices.buffer], picks, picks * width,
                    [table.buffer, indices.buffer], [out.buffer])


def scatter_add_rows(kb: KernelBuilder, out: View, grad: View, indices: View) -> None:
    """``out = zeros; out[indices[i], ...] += grad[i, ...]`` over the flattened ``indices``, picks
    in order (views in row-major memory), split over threads by columns."""
    picks, rows = indices.size, out.shape[0]
    width = out.size // rows if rows else 0
    name = kb.fresh("scatter_add")
    f = kb.loop_function(name, 3)
    t = LLVM_TYPE[out.dtype]
    with f.loop(0, rows, hint="row") as r:
        target = f.gep(t, "%p0", f.add(f.mul(r, width), out.offset))
        with f.loop("%lo", "%hi", hint="col") as c:
            f.store(t, "0.0", f.gep(t, target, c))
    with f.loop(0, picks, hint="pick") as i:
        row = _row(f, indices, i, rows)
        target = f.gep(t, "%p0", f.add(f.mul(row, width), out.offset))
        source = f.gep(t, "%p1", f.add(f.mul(i, width), grad.offset))
        with f.loop("%lo", "%hi", hint="col") as c:
            at = f.gep(t, target, c)
            total = f.val(f"fadd {t} {f.load(t, at)}, {f.load(t, f.gep(t, source, c))}", "acc")
            f.store(t, total, at)
    f.ret_void()
    f.finish()
    kb.add_parallel(name, [out.buffer, grad.buffer, indices.buffer], width, picks * width,
                    [grad.buffer, indices.buffer], [out.buffer])
