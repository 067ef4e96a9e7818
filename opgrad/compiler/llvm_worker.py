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

* request: ``u32`` length + JSON ``{"triple", "cpu", "features", "vectorize", "pipelines"}`` (plus
  ``"reloc"``, ``"codemodel"`` and ``"jit": false`` for an object linked outside this process, e.g.
  for another architecture), then for each name in ``pipelines`` a ``u64`` length + the IR text
  (UTF-8) of the piece to optimize with that pipeline; the pieces are linked into one object;
* reply: one status byte (``0`` object follows, ``1`` an error message follows), ``u64`` length,
  then the object bytes or the UTF-8 message.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Pipeline:
    """The new pass manager's tuning of one optimization pipeline."""

    speed_level: int
    loop_vectorization: bool
    slp_vectorization: bool
    loop_unrolling: bool
    loop_interleaving: bool
    #: Relative compile time per character of IR, measured over a training step's kernels; the
    #: parallel parts of a module are balanced by it (``opgrad.compiler.split.split_module``).
    compile_cost: float
    #: When given, exactly these module passes run (llvmlite's ``add_<name>_pass``), in this order,
    #: instead of the tuned pipeline.
    passes: tuple[str, ...] = ()


#: The pipelines an emitter may ask for by name (``opgrad.compiler.split.pipeline_attribute``).
#: ``auto`` is LLVM's full O3, for loops the compiler must vectorize and unroll. ``explicit`` is
#: for code its emitter has already vectorized and register-tiled: O2 with the SLP vectorizer,
#: which still packs the odd scalar tail, and without the loop passes, which find nothing left to
#: do there but take most of the time. ``streaming`` is for memory-bound loops: vectorized, but
#: neither unrolled nor interleaved, which their speed does not notice. ``cold`` is for fallbacks
#: that run only on rare inputs. ``lean`` is for explicit code outside the register-tiled inner
#: loops (packing, transforms, task glue), whose loops are final as written: promote the
#: variables to registers, fold, and clean up, at a fifth of ``explicit``'s compile time (O2 runs
#: instcombine eight times, plus loop passes that find nothing there). Measured over a training
#: step, its packing and transform code ran as fast as under ``explicit``; the register-tiled
#: GEMM blocks did not (one ran 17 % slower), so they stay ``explicit``. A loop the loop
#: vectorizer widens costs about twice the compile time of a line of explicit vector code.
PIPELINES = {
    "auto": Pipeline(3, True, True, True, True, compile_cost=1.6),
    "explicit": Pipeline(2, False, True, False, False, compile_cost=1.0),
    "lean": Pipeline(2, False, False, False, False, compile_cost=0.25,
                     passes=("sroa", "instruction_combine", "simplify_cfg", "sccp", "loop_rotate",
                             "dead_store_elimination", "instruction_combine", "simplify_cfg")),
    "streaming": Pipeline(2, True, False, False, False, compile_cost=1.8),
    "cold": Pipeline(1, False, False, False, False, compile_cost=1.0),
}
#: The pipeline of code that asks for none.
AUTO_PIPELINE = "auto"


def optimize(module: llvm.ModuleRef, tm: llvm.TargetMachine, pipeline: str = AUTO_PIPELINE,
             vectorize: bool = True) -> None:
    """Run the named pipeline (:data:`PIPELINES`); ``vectorize=False`` leaves out the loop vectorizer."""
    p = PIPELINES[pipeline]
    if p.passes:
        pb = llvm.create_pass_builder(tm, llvm.create_pipeline_tuning_options(speed_level=p.speed_level))
        pm = llvm.create_new_module_pass_manager()
        for name in p.passes:
            getattr(pm, f"add_{name}_pass")()
        pm.run(module, pb)
        return
    pto = llvm.create_pipeline_tuning_options(speed_level=p.speed_level)
    pto.loop_vectorization = p.loop_vectorization and vectorize
    pto.slp_vectorization = p.slp_vectorization
    pto.loop_unrolling = p.loop_unrolling
    pto.loop_interleaving = p.loop_interleaving and vectorize
    pb = llvm.create_pass_builder(tm, pto)
    pm = pb.getModulePassManager()
    pm.run(module, pb)


def compile_object(pieces: Sequence[tuple[str, str]], triple: str, cpu: str, features: str, vectorize: bool = True,
                   reloc: str = "default", codemodel: str = "jitdefault", jit: bool = True) -> bytes:
    """Parse, verify and optimize each ``(pipeline, IR text)`` piece, link them and emit one object;
    raises RuntimeError on invalid IR or an unknown pipeline."""
    tm = target_machine(triple, cpu, features, reloc, codemodel, jit)
    linked: llvm.ModuleRef | None = None
    for pipeline, ir_text in pieces:
        if pipeline not in PIPELINES:
            raise RuntimeError(f"unknown optimization pipeline {pipeline!r}; known: {', '.join(PIPELINES)}")
        module = llvm.parse_assembly(ir_text)
        module.verify()
        if not jit:  # an object for a linker: it records its triple and layout, as clang's would
            module.triple = triple
            module.data_layout = str(tm.target_data)
        optimize(module, tm, pipeline, vectorize)
        if linked is None:
            linked = module
        else:
            linked.link_in(module)
    if linked is None:
        raise RuntimeError("nothing to compile: no IR was given")
    return bytes(tm.emit_object(linked))


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


def read_payload(stream: IO[bytes]) -> str | None:
    """One ``u64`` length + UTF-8 text, or None at end of stream."""
    size = read_exact(stream, PAYLOAD_LENGTH.size)
    if size is None:
        return None
    blob = read_exact(stream, PAYLOAD_LENGTH.unpack(size)[0])
    return None if blob is None else blob.decode()


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
        if options_blob is None:
            return
        options = json.loads(options_blob)
        pieces = []
        for pipeline in options["pipelines"]:
            text = read_payload(inp)
            if text is None:
                return
            pieces.append((str(pipeline), text))
        try:
            payload = compile_object(pieces, options["triple"], options["cpu"], options["features"],
                                     bool(options.get("vectorize", True)), str(options.get("reloc", "default")),
                                     str(options.get("codemodel", "jitdefault")), bool(options.get("jit", True)))
            status = STATUS_OBJECT
        except RuntimeError as exc:  # llvmlite reports parse and verifier errors this way
            payload, status = str(exc).encode(), STATUS_ERROR
        out.write(bytes([status]) + PAYLOAD_LENGTH.pack(len(payload)) + payload)
        out.flush()


if __name__ == "__main__":
    serve(sys.stdin.buffer, sys.stdout.buffer)
