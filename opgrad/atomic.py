"""Atomic file writes: a reader sees the old file or the complete new one, never a partial one.

Checkpoints and compiled-object cache entries are written through :func:`atomic_writer`: a
temporary file beside the target, flushed and fsync'ed, then ``os.replace``'d over it. A writer
killed half-way leaves only its temporary, whose name records the target and the writer's pid,
so the next write of the same target removes it (:func:`remove_stale_temporaries`).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from opgrad.errors import OutputFileError
from opgrad.locks import ForkSafeLock

__all__ = ["atomic_writer", "cannot_write_error", "remove_stale_temporaries", "temporary_target"]


#: Temporary files are named ``.<target name>.tmp-<writer pid>-<12 hex digits>`` beside the target,
#: so a later save can tell its own target's leftovers from anything else and whether their
#: writer still runs.
_TEMP_RE = re.compile(r"^\.(?P<target>.+)\.tmp-(?P<pid>[0-9]+)-[0-9a-f]{12}$")
_writing: set[str] = set()  # temporaries this process is writing now (absolute paths)
_writing_lock = ForkSafeLock()


def temporary_target(path: str | os.PathLike[str]) -> Path | None:
    """The file that ``path`` is a temporary of, if its name is one :func:`atomic_writer` gives."""
    p = Path(path)
    match = _TEMP_RE.match(p.name)
    return p.with_name(match.group("target")) if match else None


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this machine; True when it cannot be told (not POSIX)."""
    if os.name != "posix":
        return True  # os.kill(pid, 0) would terminate the process on Windows
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists but belongs to another user
        return True
    return True


def remove_stale_temporaries(path: str | os.PathLike[str]) -> list[Path]:
    """Delete temporaries of ``path`` whose writer is no longer running; returns what was removed.

    A job killed during a save leaves its temporary behind (nothing else can remove it). A
    temporary is stale when its writer pid is not alive, or is this process but not among the
    files it is writing now (a pid reused after the killed job). Temporaries of live writers and
    files of other targets are left alone; errors (a read-only directory) are ignored, since
    the cleanup only frees space.
    """
    target = Path(path)
    directory = target.parent if str(target.parent) else Path(".")
    removed: list[Path] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    me = os.getpid()
    for entry in entries:
        match = _TEMP_RE.match(entry.name)
        if match is None or match.group("target") != target.name:
            continue
        pid = int(match.group("pid"))
        with _writing_lock:
            busy = os.path.abspath(entry.path) in _writing
        if busy or (pid != me and _pid_alive(pid)):
            continue
        try:
            os.unlink(entry.path)
        except OSError:
            continue
        removed.append(Path(entry.path))
    return removed


def cannot_write_error(path: str | os.PathLike[str], exc: OSError, what: str) -> OutputFileError:
    """An ``OutputFileError`` naming ``path`` (not its temporary), ``what`` it is and the OS's reason."""
    target = Path(path)
    reason = exc.strerror or str(exc)
    directory = target.parent if str(target.parent) else Path(".")
    if isinstance(exc, FileNotFoundError) and not directory.is_dir():
        reason = f"directory {directory} does not exist"
    elif isinstance(exc, IsADirectoryError) or target.is_dir():
        reason = "is a directory"
    return OutputFileError(f"{target}: cannot write {what}: {reason}")


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike[str], *, what: str = "the file") -> Iterator[IO[bytes]]:
    """Open a binary temp file next to ``path``; on clean exit fsync it and rename it over ``path``.

    If the body raises, the temp file is deleted and ``path`` is untouched. The temp file lives
    in the same directory because ``os.replace`` is only atomic within one filesystem. The
    directory is fsync'ed afterwards (where the OS allows) so the rename itself survives a crash.
    Stale temporaries of ``path`` left by killed writers are removed first. A failure of the
    writer's own file operations (no such directory, permission denied, disk full at fsync) is
    an :class:`~opgrad.errors.OutputFileError` (an ``OSError``) naming ``path`` and ``what``.

    As ``open`` (and ``np.save``, ``torch.save``) would, a symbolic link is written through: its
    target is replaced, the link stays. A device, FIFO or socket (``/dev/null``, ``/dev/stdout``)
    is written in place, since there is no file to replace. A hard link to the old file keeps
    the old contents.
    """
    given = Path(path)
    target = Path(os.path.realpath(given)) if given.is_symlink() else given
    if target.exists() and not target.is_file() and not target.is_dir():
        # Composed in memory (writers such as zipfile seek), then written in one piece.
        buffer = io.BytesIO()
        yield buffer
        try:
            with open(target, "wb") as special:
                special.write(buffer.getbuffer())
        except OSError as exc:
            raise cannot_write_error(given, exc, what) from exc
        return
    directory = target.parent if str(target.parent) else Path(".")
    remove_stale_temporaries(target)
    # os.open with mode 0o666 lets the umask decide permissions, as for any normal file
    # (tempfile.mkstemp would force 0600); O_EXCL plus a random name avoids clobbering.
    tmp_name = str(directory / f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(6)}")
    with _writing_lock:
        _writing.add(os.path.abspath(tmp_name))
    try:
        try:
            fd = os.open(tmp_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        except OSError as exc:
            raise cannot_write_error(target, exc, what) from exc
        try:
            with os.fdopen(fd, "wb") as handle:
                yield handle
                try:
                    handle.flush()
                    os.fsync(handle.fileno())
                except OSError as exc:
                    raise cannot_write_error(target, exc, what) from exc
            try:
                os.replace(tmp_name, target)
            except OSError as exc:
                raise cannot_write_error(target, exc, what) from exc
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_name)
            raise
    finally:
        with _writing_lock:
            _writing.discard(os.path.abspath(tmp_name))
    _fsync_directory(directory)


def _fsync_directory(directory: Path) -> None:
    """Persist a rename in ``directory``; silently skipped where directories can't be opened (Windows)."""
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)
