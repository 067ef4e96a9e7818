"""Locks a forked child gets back unheld.

``os.fork()`` copies a process with only the forking thread: a lock another thread held at that
moment stays held in the child, and nothing there will ever release it. A ``multiprocessing``
pool or a data loader forked while a thread predicts or compiles would hang on its first call.
Every :class:`ForkSafeLock` is replaced by a fresh lock in the child (``os.register_at_fork``);
what it guarded is whatever the other thread left, which opgrad's users of it either rebuild per
call (a compiled function's buffers) or check by pid (the compile workers).
"""

from __future__ import annotations

import os
import threading
import weakref
from types import TracebackType

__all__ = ["ForkSafeLock"]


class ForkSafeLock:
    """A ``threading.Lock`` (as a context manager) that is unheld again in a forked child."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        _LOCKS.add(self)

    def __enter__(self) -> ForkSafeLock:
        self._lock.acquire()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._lock.release()

    def renew(self) -> None:
        """Replace the lock by an unheld one (in a forked child, where no other thread exists)."""
        self._lock = threading.Lock()


_LOCKS: weakref.WeakSet[ForkSafeLock] = weakref.WeakSet()


def _renew_all_in_child() -> None:
    for lock in list(_LOCKS):
        lock.renew()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_renew_all_in_child)
