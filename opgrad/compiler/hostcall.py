"""Steps that call back into the host process: the sum over replicas of ``cross_replica_sum``.

The kernel copies its input into the result, then calls the C function pointer registered under
:data:`opgrad.replicas.CALLBACK_SYMBOL` on the result, in place. The call is a step of the entry
itself, so it runs on the thread that called the compiled function (the thread whose reducer is
installed), never on a worker of the thread pool, and in graph order, which is the same on every
replica. Its ``i32`` result is checked: a failed reducer ends the step there (see
:meth:`KernelBuilder.add_call` with ``checked``) and the caller raises the recorded error.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import TYPE_CHECKING

from opgrad.replicas import CALLBACK_DECLARATION, CALLBACK_SYMBOL, DTYPE_CODES, callback_address

from .irtext import FunctionEmitter
from .jit import register_symbol
from .views import View, elem_type, identity

if TYPE_CHECKING:
    from .builder import KernelBuilder

__all__ = ["emit_cross_replica_sum", "register_host_symbols"]


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


_registered = False


def register_host_symbols() -> None:
    """Make the symbols compiled code calls in this process resolvable: libm (scalar math
    intrinsics lower to libm calls on x86) and the host callback of ``cross_replica_sum``."""
    global _registered
    if _registered:
        return
    register_symbol(CALLBACK_SYMBOL, callback_address())
    libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    for sym in ("expf", "exp", "logf", "log", "tanhf", "tanh", "powf", "pow", "sinf", "sin", "cosf", "cos",
                "erff", "erf", "erfcf", "erfc", "log1pf", "log1p", "expm1f", "expm1"):
        fn = getattr(libm, sym, None)
        if fn is not None:
            register_symbol(sym, ctypes.cast(fn, ctypes.c_void_p).value or 0)
    _registered = True
