"""Optimize LLVM IR and emit an object file, in a child process that may die without harm.

LLVM reports an internal inconsistency by aborting the process (an assertion in the loop
vectorizer has been seen to fire on plain reductions). Run in-process, that kills the user's
notebook or training job; run here, it kills this worker only, and the parent turns it into a
warning or an ``opgrad.CompileError``. The parent keeps one worker per process and talks to it
over its standard input and output; :mod:`opgrad.compiler.jit` is the only client.

This module imports nothing but the standard library and llvmlite, so the worker starts in a
fraction of a second; it runs as a script (``python -I llvm_worker.py``), and the parent imports
the same :func:`target_machine` and :func:`optimize` so both sides build identical code.

Protocol, one exchange per compile (all integers little-endian):

* request: ``u32`` length + JSON ``{"triple", "cpu", "features", "vectorize"}`` (plus ``"reloc"``,
  ``"codemodel"`` and ``"jit": false`` for an object linked outside this process, e.g. for another
  architecture), then ``u64`` length + the IR text (UTF-8);
* reply: one status byte (``0`` object follows, ``1`` an error message follows), ``u64`` length,
  then the object bytes or the UTF-8 message.
"""

from __future__ import annotations

import json
import struct
import sys
from typing import IO

import llvmlite.binding as llvm

REQUEST_HEADER = struct.Struct("<I")
PAYLOAD_LENGTH = struct.Struct("<Q")
STATUS_OBJECT = 0
STATUS_ERROR = 1


def target_machine(triple: str, cpu: str, features: str, reloc: str = "default", codemodel: str = "jitdefault",
                   jit: bool = True) -> llvm.TargetMachine:
    """The target machine every opgrad object is built with: by default one MCJIT loads into this
    process; ``reloc="pic", codemodel="default", jit=False`` for objects linked elsewhere."""
    try:
        target = llvm.Target.from_triple(triple)
    except RuntimeError:  # only the native backend is registered until a cross target is asked for
        llvm.initialize_all_targets()
        llvm.initialize_all_asmprinters()
        target = llvm.Target.from_triple(triple)
    return target.create_target_machine(
        cpu=cpu, features=features, opt=3, reloc=reloc, codemodel=codemodel, jit=jit
    )


def optimize(module: llvm.ModuleRef, tm: llvm.TargetMachine, vectorize: bool = True) -> None:
    """The new pass manager's O3 pipeline; ``vectorize=False`` leaves out the loop vectorizer."""
    pto = llvm.create_pipeline_tuning_options(speed_level=3)
    pto.loop_vectorization = vectorize
    pto.slp_vectorization = True
    pto.loop_unrolling = True
    pto.loop_interleaving = vectorize
    pb = llvm.create_pass_builder(tm, pto)
    pm = pb.getModulePassManager()
    pm.run(module, pb)


def compile_object(ir_text: str, triple: str, cpu: str, features: str, vectorize: bool = True,
                   reloc: str = "default", codemodel: str = "jitdefault", jit: bool = True) -> bytes:
    """Parse, verify, optimize and emit ``ir_text``; raises RuntimeError on invalid IR."""
    module = llvm.parse_assembly(ir_text)
    module.verify()
    tm = target_machine(triple, cpu, features, reloc, codemodel, jit)
    if not jit:  # an object for a linker: it records its triple and layout, as clang's would
        module.triple = triple
        module.data_layout = str(tm.target_data)
    optimize(module, tm, vectorize)
    return bytes(tm.emit_object(module))


def read_exact(stream: IO[bytes], n: int) -> bytes | None:
    """``n`` bytes, or None at end of stream (the other side closed or died)."""
    chunks, need = [], n
    while need:
        chunk = stream.read(need)
        if not chunk:
            return None
        chunks.append(chunk)
        need -= len(chunk)
    return b"".join(chunks)


def serve(inp: IO[bytes], out: IO[bytes]) -> None:
    """Answer requests until the parent closes the pipe."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    while True:
        head = read_exact(inp, REQUEST_HEADER.size)
        if head is None:
            return
        (n,) = REQUEST_HEADER.unpack(head)
        options_blob = read_exact(inp, n)
        size_blob = read_exact(inp, PAYLOAD_LENGTH.size)
        if options_blob is None or size_blob is None:
            return
        ir_blob = read_exact(inp, PAYLOAD_LENGTH.unpack(size_blob)[0])
        if ir_blob is None:
            return
        options = json.loads(options_blob)
        try:
            payload = compile_object(ir_blob.decode(), options["triple"], options["cpu"], options["features"],
                                     bool(options.get("vectorize", True)), str(options.get("reloc", "default")),
                                     str(options.get("codemodel", "jitdefault")), bool(options.get("jit", True)))
            status = STATUS_OBJECT
        except RuntimeError as exc:  # llvmlite reports parse and verifier errors this way
            payload, status = str(exc).encode(), STATUS_ERROR
        out.write(bytes([status]) + PAYLOAD_LENGTH.pack(len(payload)) + payload)
        out.flush()


if __name__ == "__main__":
    serve(sys.stdin.buffer, sys.stdout.buffer)
