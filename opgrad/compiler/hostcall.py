"""Steps that call back into the host process: the sum over replicas of ``cross_replica_sum``.

The kernel copies its input into the result, then calls the C function pointer registered under
:data:`opgrad.replicas.CALLBACK_SYMBOL` on the result, in place. The call is a step of the entry
itself, so it runs on the thread that called the compiled function (the thread whose reducer is
installed), never on a worker of the thread pool, and in graph order, which is the same on every
replica. Its ``i32`` result is checked: a failed reducer ends the step there (see
:meth:`KernelBuilder.add_call` with ``checked``) and the caller raises the recorded error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opgrad.replicas import CALLBACK_DECLARATION, CALLBACK_SYMBOL, DTYPE_CODES

from .irtext import FunctionEmitter
from .views import View, elem_type, identity

if TYPE_CHECKING:
    from .builder import KernelBuilder


def emit_cross_replica_sum(kb: KernelBuilder, out: View, data: View) -> None:
    """``out = data`` summed over the replicas; ``out`` is the dense result of the call."""
    if data.dtype not in DTYPE_CODES:
        raise NotImplementedError(f"cross_replica_sum: no reducer for dtype {data.dtype}; "
                                  f"expected one of {', '.join(DTYPE_CODES)}")
    kb.elementwise(out, [data], identity)
    callback = kb.m.declare(CALLBACK_SYMBOL, CALLBACK_DECLARATION)
    name = kb.fresh("replica_sum")
    f = FunctionEmitter(kb.m, name, [("ptr", "p0"), ("ptr", "ws")], ret="i32", linkage="internal")
    start = f.gep(elem_type(out.dtype), "%p0", str(out.offset))
    code = f.call("i32", callback, [("ptr", start), ("i64", str(out.size)), ("i32", str(DTYPE_CODES[out.dtype]))])
    f.emit(f"ret i32 {code}")
    f.finish()
    kb.add_call(name, [out.buffer], [out.buffer], [out.buffer], detail=f"all-reduce {out.size} x {out.dtype}",
                checked=True)
    kb.host_calls.append(f"cross_replica_sum of {out.size} {out.dtype} value(s)")
