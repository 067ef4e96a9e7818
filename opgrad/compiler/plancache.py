"""Plans stored beside the objects, so that a warm start neither lowers the graph nor writes its IR.

The object cache (:mod:`.jit`) is keyed by the IR text, and building that text is most of a warm
start: lowering, fusion, the buffer plan and the IR of a training step take 25-30 ms for the
seed CNN and 0.14 s for a ResNet on an AMD Zen 5, while loading their objects takes a few. Like
the compilation caches of JAX and TorchInductor, this cache keys a compile by what its plan is a
function of instead:

* the graph (:func:`graph_fingerprint`): every node in topological order, calls by operator,
  dtype, shape, attributes and argument positions, constants by the sha256 of their bytes,
  parameters by position, and which nodes the outputs are;
* the code that plans it: a sha256 of every Python source of the installed ``opgrad`` package
  (its compiler and its registry of operators), the engine and plan-format versions, llvmlite's
  and numpy's;
* what the planner reads from its surroundings: the target (triple, CPU, features), the host's
  cache sizes, the thread count, ``$OPGRAD_CONV_ALGORITHM`` and the compile's own options.

A graph that calls an operator declared outside opgrad, or one whose lowering is not opgrad's own
function, has no key (user code may change without the key seeing it) and is planned each time.
Code that patches opgrad's compiler at run time sets ``OPGRAD_PLAN_CACHE=0``.

A stored plan is the :class:`~.graph.GraphPlan` without its IR: the pointer-table slots, arena
offsets, constants, range checks and step descriptions, and the key of the object compiled from
its IR. Entries share the object cache's directory and its atomic, checksummed file format
(:class:`~.jit.ObjectCache`); a damaged or unreadable one is reported, deleted and rebuilt.
Nothing is unpickled: the record is JSON followed by the constants' raw bytes.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import llvmlite
import numpy as np

from opgrad.env import conv_algorithm_setting
from opgrad.ir import Call, Const, Function, Var, topological_order

from .jit import ENGINE_VERSION, ObjectCache
from .steploop import StepLoop
from .target import cache_share, cache_size, current_target
from .threads import pool_size

__all__ = ["PLAN_FORMAT", "PlanCache", "attribute_key", "decode_record", "encode_record", "graph_fingerprint",
           "plan_key", "source_digest"]

#: Bump when the stored record's fields or their meaning change.
PLAN_FORMAT = "opgrad-plan-2"

_RECORD_MAGIC = b"OPGRDPL1"
_RECORD_HEADER = struct.Struct("<8sQ")  # magic, bytes of the JSON part


def attribute_key(value: Any) -> Any:
    """An attribute value as a hashable key; floats by repr, so 0.0 and -0.0 differ. Raises
    TypeError for a value of another kind (a call with such an attribute is never taken for
    another one)."""
    if value is None or isinstance(value, (bool, int, str)):
        return (type(value).__name__, value)
    if isinstance(value, float):
        return ("float", repr(value))
    if isinstance(value, (list, tuple)):
        return ("seq", tuple(attribute_key(v) for v in value))
    if isinstance(value, np.generic):
        return ("np", value.dtype.str, value.tobytes())
    raise TypeError(f"attribute value of type {type(value).__name__}")


@functools.lru_cache(maxsize=1)
def source_digest() -> str | None:
    """sha256 of every ``.py`` file of the installed ``opgrad`` package and of its registry, by
    relative path and content (about 2.5 ms for 1.1 MB, once per process); None where the
    sources are not there to read (an install of bytecode only), and then nothing has a key."""
    files = [importlib.import_module(name).__file__ for name in ("opgrad", "opgrad.registry")]
    roots = sorted({Path(file).resolve().parent for file in files if file})
    h = hashlib.sha256()
    found = 0
    try:
        for root in roots:
            for path in sorted(root.rglob("*.py")):
                h.update(f"{root.name}/{path.relative_to(root).as_posix()}\0".encode())
                h.update(path.read_bytes())
                h.update(b"\0")
                found += 1
    except OSError:
        return None
    return h.hexdigest() if found else None


def graph_fingerprint(fn: Function) -> str | None:
    """sha256 of ``fn``'s structure (see the module docstring); None when a call's operator or
    lowering is not opgrad's own, or an attribute has no key."""
    h = hashlib.sha256()

    def put(*parts: Any) -> None:
        h.update(repr(parts).encode())
        h.update(b"\n")

    param_position = {p._uid: i for i, p in enumerate(fn.params)}
    for p in fn.params:
        put("param", p.dtype, p.shape)
    position: dict[int, int] = {}
    for n, node in enumerate(topological_order(fn.outputs)):
        position[node._uid] = n
        if isinstance(node, Var):
            if node._uid not in param_position:
                return None
            put("var", param_position[node._uid])
        elif isinstance(node, Const):
            value = np.ascontiguousarray(node.value)
            put("const", node.dtype, node.shape, value.dtype.str, hashlib.sha256(value.data).hexdigest())
        elif isinstance(node, Call):
            op, lower = node.op, node.op.lowering_fn
            if op.user_defined or lower is None or not str(getattr(lower, "__module__", "")).startswith("opgrad."):
                return None
            try:
                attrs = tuple(sorted((name, attribute_key(value)) for name, value in node.attrs.items()))
            except TypeError:
                return None
            put("call", op.name, node.dtype, node.shape, attrs, tuple(position[a._uid] for a in node.args))
        else:
            return None
    put("outputs", tuple(position[o._uid] for o in fn.outputs), fn.returns_tuple)
    return h.hexdigest()


def plan_key(fn: Function, *, name: str, step_entries: bool, loop: StepLoop | None,
             in_place: Sequence[tuple[int, int]] = ()) -> str | None:
    """The plan cache's key for compiling ``fn`` here and now, or None when it has none."""
    graph, sources = graph_fingerprint(fn), source_digest()
    if graph is None or sources is None:
        return None
    target = current_target()
    parts = (PLAN_FORMAT, ENGINE_VERSION, llvmlite.__version__, np.__version__, sources,
             target.triple, target.cpu, target.features,
             repr([cache_size(level) for level in (1, 2, 3)]), repr([cache_share(level) for level in (1, 2, 3)]),
             f"threads={pool_size()}", f"conv={conv_algorithm_setting()}", f"name={name}",
             f"step_entries={step_entries}", f"loop={loop!r}", f"in_place={list(in_place)!r}", graph)
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def encode_record(fields: Mapping[str, Any], arrays: Mapping[int, np.ndarray]) -> bytes:
    """``fields`` as JSON, then the raw bytes of ``arrays`` (described in the JSON)."""
    described, blobs, offset = [], [], 0
    for slot, array in arrays.items():
        data = np.ascontiguousarray(array)
        described.append({"slot": int(slot), "dtype": data.dtype.str, "shape": list(data.shape),
                          "offset": offset, "nbytes": data.nbytes})
        blobs.append(data.tobytes())
        offset += data.nbytes
    text = json.dumps({**fields, "arrays": described}, separators=(",", ":")).encode()
    return b"".join((_RECORD_HEADER.pack(_RECORD_MAGIC, len(text)), text, *blobs))


def decode_record(payload: bytes) -> tuple[dict[str, Any], dict[int, np.ndarray]]:
    """The inverse of :func:`encode_record`; ValueError says what is malformed."""
    if len(payload) < _RECORD_HEADER.size:
        raise ValueError("shorter than its header")
    magic, length = _RECORD_HEADER.unpack_from(payload)
    if magic != _RECORD_MAGIC:
        raise ValueError("not a plan record of this version")
    start = _RECORD_HEADER.size
    try:
        fields = json.loads(payload[start : start + length].decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"its JSON part does not parse ({exc})") from None
    if not isinstance(fields, dict) or not isinstance(fields.get("arrays"), list):
        raise ValueError("its JSON part is not a plan record")
    blob = memoryview(payload)[start + length :]
    arrays: dict[int, np.ndarray] = {}
    for entry in fields.pop("arrays"):
        dtype, shape = np.dtype(entry["dtype"]), tuple(int(d) for d in entry["shape"])
        offset, nbytes = int(entry["offset"]), int(entry["nbytes"])
        if dtype.hasobject or nbytes != dtype.itemsize * int(np.prod(shape)) or offset < 0 \
                or offset + nbytes > len(blob):
            raise ValueError(f"array of slot {entry['slot']} does not fit the record")
        arrays[int(entry["slot"])] = np.frombuffer(blob[offset : offset + nbytes], dtype).reshape(shape).copy()
    return fields, arrays


class PlanCache:
    """Stored plans, one ``<key>.plan`` file each in the object cache's directory."""

    def __init__(self, directory: Path | None = None) -> None:
        self.entries = ObjectCache(directory, suffix=".plan", what="plan")

    def load(self, key: str) -> tuple[dict[str, Any], dict[int, np.ndarray]] | None:
        """The record stored under ``key``, or None; a damaged one is warned about and deleted."""
        payload = self.entries.load(key)
        if payload is None:
            return None
        try:
            return decode_record(payload)
        except (ValueError, KeyError, TypeError) as exc:
            self.entries.discard(key, f"malformed ({exc})")
            return None

    def store(self, key: str, fields: Mapping[str, Any], arrays: Mapping[int, np.ndarray]) -> None:
        self.entries.store(key, encode_record(fields, arrays))

    def discard(self, key: str, problem: str) -> None:
        """Warn that the entry under ``key`` is ``problem``, and delete it."""
        self.entries.discard(key, problem)

