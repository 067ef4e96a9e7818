"""Atomic, checksummed ``.npz`` checkpoints for ``opgrad train``.

Why: a training run killed mid-save (Ctrl-C, OOM, CI timeout) must never leave a half-written
checkpoint that a later ``--resume`` loads as if it were fine, and loading weights into a model
of a different shape must fail with a message that says which tensor is wrong, not with a
broadcasting error three layers down.

Format: a plain numpy ``.npz`` (readable with ``np.load(..., allow_pickle=False)`` by anyone),
holding the named arrays plus three reserved entries:

* ``__opgrad_format__``: int64 scalar, the format version (:data:`FORMAT_VERSION`);
* ``__meta__``: a 0-d unicode array with the metadata as a JSON string (epoch, step, optimizer,
  seed, model name, ...). JSON rather than pickled objects so loading never executes code;
* ``__sha256__``: a 0-d unicode array, hex SHA-256 over the format version, the metadata JSON
  and every array's name, dtype, shape and bytes (in sorted name order), so any bit flip or
  truncation that the zip layer does not catch is still detected.

Writes go to a temporary file in the destination directory (``.<name>.tmp-<pid>-<random>``), are
flushed and fsync'ed, and then ``os.replace``'d over the target, so readers see either the old
file or the complete new one. A writer killed mid-save leaves its temporary behind; the next
save to the same path deletes it once its writer pid is gone, and loading refuses temporaries.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import struct
import tokenize
import zipfile
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from opgrad.atomic import atomic_writer, cannot_write_error, remove_stale_temporaries, temporary_target
from opgrad.errors import OutputFileError, UserError

__all__ = [
    "FORMAT_VERSION",
    "Checkpoint",
    "CheckpointError",
    "ExpectedSpec",
    "atomic_writer",
    "cannot_write_error",
    "foreign_model_hint",
    "json_default",
    "load_checkpoint",
    "remove_stale_temporaries",
    "save_checkpoint",
    "temporary_target",
]

FORMAT_VERSION = 1
_META_KEY = "__meta__"
_HASH_KEY = "__sha256__"
_FORMAT_KEY = "__opgrad_format__"
_RESERVED = frozenset({_META_KEY, _HASH_KEY, _FORMAT_KEY})
#: How much of a zip member is read at a time while its CRC-32 is checked.
_CRC_CHUNK_BYTES = 1 << 20
#: What zipfile, its decompressors and numpy's ``.npy`` reader raise for damaged bytes. A bit flip
#: can break the zip structure (BadZipFile, EOFError, struct.error, OSError for a seek before the
#: start), invent a zip version or compression method (NotImplementedError), mark a member
#: encrypted (RuntimeError), break a decompressor (zlib.error, lzma.LZMAError) or a member name
#: (UnicodeDecodeError, a ValueError); a damaged ``.npy`` header fails in numpy's parser
#: (ValueError, SyntaxError, tokenize.TokenError) and an absurd declared size in the allocation
#: (MemoryError, OverflowError).
_DAMAGED_FILE_ERRORS = (
    zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, struct.error, OSError, NotImplementedError, RuntimeError,
    zlib.error, lzma.LZMAError, ValueError, SyntaxError, tokenize.TokenError, MemoryError, OverflowError,
)

#: ``expected`` spec for :func:`load_checkpoint`: name -> (shape, dtype).
ExpectedSpec = Mapping[str, tuple[tuple[int, ...], npt.DTypeLike]]


class CheckpointError(UserError, ValueError):
    """A checkpoint is missing, corrupt, or does not match the model; the message names the file."""


class Checkpoint(NamedTuple):
    """What :func:`load_checkpoint` returns; unpacks as ``arrays, meta = load_checkpoint(p)``."""

    arrays: dict[str, np.ndarray]
    meta: dict[str, Any]


def _digest(arrays: Mapping[str, np.ndarray], meta_json: str, version: int) -> str:
    """SHA-256 over the version, metadata and every array's name, dtype, shape and bytes."""
    h = hashlib.sha256()
    h.update(f"opgrad-checkpoint-v{version}\0".encode())
    h.update(meta_json.encode("utf-8") + b"\0")
    for name in sorted(arrays):
        array = arrays[name]
        h.update(f"{name}\0{array.dtype.str}\0{array.shape}\0".encode())
        h.update(np.ascontiguousarray(array).view(np.uint8).reshape(-1).data)
    return h.hexdigest()


def json_default(value: object) -> Any:
    """Let numpy scalars/arrays (a loss as ``np.float32``, say) into the metadata as plain JSON."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def save_checkpoint(
    path: str | os.PathLike[str], arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]
) -> None:
    """Write ``arrays`` and JSON ``meta`` to ``path`` atomically (see module docstring).

    ``path`` is written exactly as given (no ``.npz`` is appended). Raises
    :class:`CheckpointError` for a reserved or non-string array name, an object-dtype array
    (it could only be stored by pickling) or metadata that is not JSON-serialisable, and
    :class:`~opgrad.errors.OutputFileError` (an ``OSError``) naming ``path`` when the file
    cannot be written; in every failure case an existing file at ``path`` is left as it was.
    """
    target = Path(path)
    clean: dict[str, np.ndarray] = {}
    for name, value in arrays.items():
        if not isinstance(name, str) or not name:
            raise CheckpointError(f"{target}: array names must be non-empty strings, got {name!r}")
        if name in _RESERVED:
            raise CheckpointError(f"{target}: array name {name!r} is reserved for checkpoint metadata")
        array = np.asarray(value)
        if array.dtype.hasobject:
            raise CheckpointError(
                f"{target}: {name}: dtype {array.dtype} holds Python objects and cannot be saved "
                "without pickle"
            )
        clean[name] = array
    try:
        meta_json = json.dumps(dict(meta), sort_keys=True, default=json_default)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{target}: metadata is not JSON-serialisable: {exc}") from None
    entries: dict[str, np.ndarray] = dict(clean)
    entries[_FORMAT_KEY] = np.array(FORMAT_VERSION, dtype=np.int64)
    entries[_META_KEY] = np.array(meta_json)
    entries[_HASH_KEY] = np.array(_digest(clean, meta_json, FORMAT_VERSION))
    try:
        with atomic_writer(target, what="the checkpoint") as handle, \
                zipfile.ZipFile(handle, "w", zipfile.ZIP_STORED) as archive:
            # What np.savez does, minus its **kwargs API, under which an array named "allow_pickle"
            # would be taken for the flag.
            for name, array in entries.items():
                with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, array, allow_pickle=False)
    except OutputFileError:
        raise
    except OSError as exc:  # writing the data itself failed, e.g. the disk is full
        raise cannot_write_error(target, exc, "the checkpoint") from exc


def _describe_dtype(dtype: npt.DTypeLike) -> str:
    return str(np.dtype(dtype))


def load_checkpoint(path: str | os.PathLike[str], expected: ExpectedSpec | None = None) -> Checkpoint:
    """Load and verify a checkpoint written by :func:`save_checkpoint`.

    Verifies the SHA-256 and, when ``expected`` (name -> (shape, dtype)) is given, that the
    checkpoint has exactly those arrays with those shapes and dtypes. Every problem is reported
    in one :class:`CheckpointError` whose message starts with the file's path, e.g.
    ``ckpt.npz: conv1.weight: checkpoint has shape (16, 1, 3, 3), model expects (32, 1, 3, 3)``.
    A missing file is a :class:`CheckpointError` too, so callers need catch only one type.
    """
    source = Path(path)
    unfinished = temporary_target(source)
    if unfinished is not None:
        raise CheckpointError(
            f"{source}: is an unfinished temporary file of {unfinished}, left by a save that did not "
            f"complete; load {unfinished} instead"
        )
    if not source.exists():
        raise CheckpointError(f"{source}: checkpoint file not found")
    if source.is_dir():
        raise CheckpointError(f"{source}: is a directory, expected a checkpoint file")
    try:
        with open(source, "rb") as probe:
            head = probe.read(4)
    except OSError as exc:
        raise CheckpointError(f"{source}: cannot read the checkpoint: {exc.strerror or exc}") from None
    if not head:
        raise CheckpointError(f"{source}: empty file (0 bytes): the save that wrote it never finished")
    foreign = foreign_model_hint(source)
    if head != b"PK\x03\x04":
        raise CheckpointError(f"{source}: not an .npz checkpoint (the file does not start with a zip header){foreign}")
    try:
        contents = _read_members(source)
    except CheckpointError:
        raise
    except zipfile.BadZipFile as exc:
        if "not a zip file" in str(exc):  # starts like a zip but its end-of-file index is gone
            raise CheckpointError(
                f"{source}: corrupt or truncated checkpoint (the zip index at the end of the file is "
                f"missing; {source.stat().st_size} bytes on disk)"
            ) from None
        raise CheckpointError(f"{source}: corrupt or truncated checkpoint ({exc})") from None
    except _DAMAGED_FILE_ERRORS as exc:
        raise CheckpointError(
            f"{source}: corrupt or truncated checkpoint ({type(exc).__name__}: {exc})"
        ) from None

    missing_reserved = sorted(_RESERVED - contents.keys())
    if missing_reserved:
        raise CheckpointError(f"{source}: not an opgrad checkpoint (no {', '.join(missing_reserved)} entry)")
    try:
        version = int(contents.pop(_FORMAT_KEY))
        meta_json = str(contents.pop(_META_KEY).item())
        stored_hash = str(contents.pop(_HASH_KEY).item())
    except (TypeError, ValueError, OverflowError) as exc:
        raise CheckpointError(f"{source}: malformed checkpoint header entries ({exc})") from None
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{source}: checkpoint format version {version}, this opgrad reads version {FORMAT_VERSION}"
        )
    try:
        actual_hash = _digest(contents, meta_json, version)
    except UnicodeEncodeError:  # a lone surrogate in the metadata, which save_checkpoint never writes
        raise CheckpointError(f"{source}: the metadata is not valid Unicode text") from None
    if actual_hash != stored_hash:
        raise CheckpointError(
            f"{source}: checksum mismatch: contents were modified or corrupted after saving "
            f"(stored sha256 {stored_hash[:12]}..., actual {actual_hash[:12]}...)"
        )
    try:
        meta = json.loads(meta_json)
    except json.JSONDecodeError as exc:  # unreachable unless the hash was forged along with it
        raise CheckpointError(f"{source}: metadata is not valid JSON: {exc}") from None
    if expected is not None:
        check_arrays(source, contents, expected)
    return Checkpoint(arrays=contents, meta=meta)


def foreign_model_hint(source: Path) -> str:
    """How a model file of another framework becomes a checkpoint (it is converted, not read as
    weights), for an error about ``source``; "" for other suffixes."""
    if source.suffix.lower() not in (".onnx", ".keras", ".h5", ".hdf5"):
        return ""
    return f"; a {source.suffix} model becomes a checkpoint with `opgrad import {source} --save MODEL.npz`"


def _read_members(source: Path) -> dict[str, np.ndarray]:
    """Every ``<name>.npy`` member of the zip ``source`` as ``{name: array}``, each member's CRC-32
    checked before numpy parses it.

    numpy parses a member's header before it reads the data, and zipfile checks the CRC-32 only
    when a member has been read to its end, so without the first pass a bit flip in a header
    reaches numpy's parser and fails there with whatever the damage provokes. Reading each member
    to its end first turns any damage inside a member into one ``BadZipFile: Bad CRC-32``.
    """
    with zipfile.ZipFile(source) as archive:
        members = archive.infolist()
        for info in members:
            with archive.open(info) as member:
                while member.read(_CRC_CHUNK_BYTES):
                    pass
        contents: dict[str, np.ndarray] = {}
        for info in members:
            name = info.filename.removesuffix(".npy")
            if name == info.filename:
                raise CheckpointError(f"{source}: not an opgrad checkpoint (it holds {info.filename!r}, which is "
                                      f"not a .npy array){foreign_model_hint(source)}")
            if name in contents:
                raise CheckpointError(f"{source}: corrupt checkpoint (it holds two entries named {info.filename!r})")
            with archive.open(info) as member:
                try:
                    contents[name] = np.lib.format.read_array(member, allow_pickle=False)
                except ValueError as exc:
                    if "allow_pickle" not in str(exc):
                        raise
                    raise CheckpointError(f"{source}: {name} holds Python objects (an object array, stored as a "
                                          "pickle); opgrad loads no pickles: save numeric arrays") from None
    return contents


def check_arrays(source: str | os.PathLike[str], arrays: Mapping[str, np.ndarray], expected: ExpectedSpec) -> None:
    """A ``CheckpointError`` naming ``source`` with every array name, shape and dtype of
    ``arrays`` that differs from ``expected`` (name -> (shape, dtype)), raised together."""
    problems: list[str] = []
    missing = [name for name in expected if name not in arrays]
    extra = sorted(name for name in arrays if name not in expected)
    if missing:
        problems.append(f"missing arrays the model needs: {', '.join(missing)}")
    if extra:
        problems.append(f"unexpected arrays the model does not have: {', '.join(extra)}")
    for name, (shape, dtype) in expected.items():
        if name not in arrays:
            continue
        array = arrays[name]
        want_shape = tuple(int(d) for d in shape)
        if array.shape != want_shape:
            problems.append(f"{name}: checkpoint has shape {array.shape}, model expects {want_shape}")
        if array.dtype != np.dtype(dtype):
            problems.append(
                f"{name}: checkpoint has dtype {array.dtype}, model expects {_describe_dtype(dtype)}"
            )
    if problems:
        raise CheckpointError(f"{source}: " + "; ".join(problems))
