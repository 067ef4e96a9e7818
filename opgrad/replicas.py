"""Sums over replicas: the runtime behind ``opgrad.ops.cross_replica_sum``.

A *replica* is one copy of the same computation on another shard of the data (an MPI rank in
data-parallel training). ``cross_replica_sum(x)`` is the sum of ``x`` over every replica, as
JAX's ``psum`` and XLA's ``CrossReplicaSum``. The operator itself knows no communicator: whoever
runs a step across replicas installs a *reducer* for the duration of the step with
:func:`replica_group`::

    with replica_group(communicator.allreduce_sum):
        outputs = step(*arrays)

A reducer is any callable that sums a contiguous float array over the replicas, in place. Every
replica must make the same sequence of calls (the same graph in the same order), as MPI's
collectives require. With no reducer installed there is one replica and the sum is the identity.

Both backends come here: the numpy reference calls :func:`sum_over_replicas` directly, and
compiled code calls the C function pointer registered under :data:`CALLBACK_SYMBOL`, a ctypes
callback that runs the same reducer on the kernel's buffer. A reducer that raises does not take
the process down: the callback records the exception and returns a non-zero code, the compiled
step stops at that point, and the call raises the recorded exception once it returns
(:func:`raise_pending`).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

__all__ = [
    "CALLBACK_DECLARATION",
    "CALLBACK_SYMBOL",
    "DTYPE_CODES",
    "Reducer",
    "callback_address",
    "raise_pending",
    "replica_group",
    "sum_over_replicas",
]

#: Sums a contiguous float array over every replica, in place.
Reducer = Callable[[np.ndarray], None]

#: The C symbol compiled kernels call: ``int32 f(void *data, int64 count, int32 dtype_code)``;
#: 0 means done, anything else that the reducer failed (the error waits in this thread).
CALLBACK_SYMBOL = "opgrad_cross_replica_sum"
CALLBACK_DECLARATION = f"declare i32 @{CALLBACK_SYMBOL}(ptr, i64, i32)"
#: The ``dtype_code`` argument of the callback for each float dtype.
DTYPE_CODES = {"float32": 0, "float64": 1}
_DTYPES = {code: np.dtype(name) for name, code in DTYPE_CODES.items()}
#: Returned by the callback when the reducer raised, and when the dtype code is unknown.
REDUCER_FAILED = 1
BAD_DTYPE = 2


class _ThreadState(threading.local):
    """The reducer of the step running on this thread, and an error the callback caught."""

    def __init__(self) -> None:
        self.reducer: Reducer | None = None
        self.pending: BaseException | None = None


_state = _ThreadState()


@contextmanager
def replica_group(reducer: Reducer) -> Iterator[None]:
    """Make ``cross_replica_sum`` call ``reducer`` on this thread while the block runs."""
    previous = _state.reducer
    _state.reducer = reducer
    try:
        yield
    finally:
        _state.reducer = previous


def sum_over_replicas(data: np.ndarray) -> np.ndarray:
    """A new contiguous array holding ``data`` summed over the replicas (a copy alone)."""
    out = np.array(data, copy=True, order="C")
    reducer = _state.reducer
    if reducer is not None and out.size:
        reducer(out)
    return out


def raise_pending() -> None:
    """Raise the error a reducer raised inside compiled code on this thread, if there is one."""
    error = _state.pending
    if error is not None:
        _state.pending = None
        raise error


def _callback(address: int | None, count: int, dtype_code: int) -> int:
    # Exceptions must not cross back into native code: every one is kept for raise_pending.
    try:
        reducer = _state.reducer
        if reducer is None or count == 0:
            return 0
        dtype = _DTYPES.get(dtype_code)
        if dtype is None or address is None:
            _state.pending = RuntimeError(f"cross_replica_sum: compiled code passed dtype code {dtype_code} "
                                          f"(known: {DTYPE_CODES}) or a null buffer")
            return BAD_DTYPE
        raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(address)
        reducer(np.frombuffer(memoryview(raw), dtype=dtype))
        return 0
    except BaseException as exc:  # re-raised by raise_pending once the native call returns
        _state.pending = exc
        return REDUCER_FAILED


_CALLBACK_TYPE = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32)
_CALLBACK = _CALLBACK_TYPE(_callback)  # module-level: native code keeps its address for the process


def callback_address() -> int:
    """The address compiled code calls :data:`CALLBACK_SYMBOL` at."""
    return ctypes.cast(_CALLBACK, ctypes.c_void_p).value or 0
