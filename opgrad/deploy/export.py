"""``opgrad.export``: a model's training step, eval step and checkpoint I/O as a native library.

The training step (forward, backward, optimizer update) and the multi-step loop around it, plus
the evaluation step, are lowered exactly as ``opgrad.compile`` lowers them, but for a chosen
target, into ONE LLVM module, emitted as a position-independent object. A generated C runtime
(``runtime.c`` plus tables, :mod:`.cgen`) owns the parameters and optimizer state, fills the
pointer tables, runs the thread pool behind ``opgrad_parallel_for`` and reads/writes opgrad's own
``.npz`` checkpoints. The system C compiler then builds ``<name>.o`` (everything, relocatable),
``lib<name>.a`` and ``lib<name>.so``. See docs/deployment.md.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from opgrad.checkpoint import atomic_writer, save_checkpoint
from opgrad.compiler.graph import GraphPlan, plan_graph
from opgrad.compiler.irtext import ModuleEmitter
from opgrad.compiler.jit import Codegen, object_code
from opgrad.compiler.target import Target, host_target, resolve_target, use_target
from opgrad.errors import CompileError, OpgradError
from opgrad.nn import EvalStep, Model, Optimizer, TrainStep, build_model, make_optimizer

from .cgen import ArrayInfo, ModelTables, Stream, render_header, render_runtime

__all__ = ["ExportError", "ExportResult", "default_c_compiler", "export"]

_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,31}$")
#: Names whose ``<name>.h`` would stand in for a standard header: the runtime (and a program built
#: with ``-I`` on the export folder) would include the export's header in its place.
RESERVED_NAMES = frozenset({
    "assert", "complex", "ctype", "errno", "fenv", "float", "inttypes", "iso646", "limits", "locale", "math",
    "setjmp", "signal", "stdalign", "stdarg", "stdatomic", "stdbool", "stddef", "stdint", "stdio", "stdlib",
    "stdnoreturn", "string", "tgmath", "threads", "time", "uchar", "wchar", "wctype", "pthread", "sched",
    "unistd", "fcntl", "strings", "alloca", "malloc", "memory", "dlfcn", "omp",
})
_DEFINE = re.compile(r"^define (?!internal )(?P<rest>[^@]*)@(?P<name>[^(]+)\(")


class ExportError(OpgradError, ValueError):
    """The export cannot be made as asked; the message names the argument or tool at fault."""


@dataclass(frozen=True)
class ExportResult:
    """Where the export went: ``files`` maps ``header``, ``runtime``, ``kernels``, ``init`` and,
    when a C compiler was used, ``object``, ``static`` and ``shared`` to their paths."""

    directory: Path
    target: Target
    files: dict[str, Path] = field(default_factory=dict)
    compile_seconds: float = 0.0
    cache_hit: bool = False
    c_compiler: str | None = None


def default_c_compiler(target: Target) -> str | None:
    """The compiler that builds the runtime for ``target`` when none is given: ``$CC`` or ``cc``
    for the host's architecture, ``aarch64-linux-gnu-gcc`` for ARM Linux, none for Android (the
    app's NDK build compiles ``<name>_runtime.c``)."""
    host = host_target()
    if target.triple.split("-")[0] == host.triple.split("-")[0] and not target.is_android:
        return os.environ.get("CC") or "cc"
    if target.is_aarch64 and not target.is_android and "linux" in target.triple:
        return "aarch64-linux-gnu-gcc"
    return None


def _archiver(cc: str) -> str:
    """``<prefix>ar`` for a ``<prefix>gcc``/``<prefix>clang`` cross compiler, else llvm-ar or ar."""
    base = os.path.basename(cc)
    m = re.match(r"^(?P<prefix>.*-)(?:gcc|cc|clang)(?:-[\d.]+)?$", base)
    for candidate in ([m.group("prefix") + "ar"] if m else []) + ["ar", "llvm-ar"]:
        if shutil.which(candidate):
            return candidate
    raise ExportError(f"no archiver found for {cc} (tried {(m.group('prefix') + 'ar, ') if m else ''}ar, llvm-ar)")


def _run(cmd: list[str], what: str) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        said = (result.stderr or result.stdout).strip().splitlines()
        # The errors, not the warnings around them, say why; the last lines where none is marked.
        errors = [line.strip() for line in said if "error" in line.lower()] or [line.strip() for line in said[-6:]]
        raise ExportError(f"{what} failed ({' '.join(cmd)}): " + " ;; ".join(errors[:4]))


def _write(path: Path, data: bytes) -> None:
    with atomic_writer(path) as handle:
        handle.write(data)


def _module_ir(name: str, train: GraphPlan, evaluation: GraphPlan) -> str:
    """One module: both graphs, with the pool entry renamed to this export's and every function
    hidden (linkable by the runtime, but a shared library exports its C API only)."""
    module = ModuleEmitter(name, function_attrs="")
    module.merge(train.emitter())
    module.merge(evaluation.emitter())
    text = re.sub(r"@opgrad_parallel_for\b", f"@{name}_parallel_for", module.text())
    lines = []
    for line in text.splitlines():
        if _DEFINE.match(line):
            line = "define hidden " + line[len("define "):]
        lines.append(line)
    return "\n".join(lines) + "\n"


def _checkpoint_meta(model: Model, optimizer: Optimizer, batch_size: int) -> dict[str, Any]:
    """The metadata, but for the counters, of every checkpoint the export and its runtime write: what
    ``opgrad train --save`` writes, architecture included, so that ``opgrad.nn.load``, ``opgrad predict``
    and ``opgrad train --resume`` rebuild a model that is not built in from the file alone."""
    meta = {"model": model.name, "architecture": model.get_config(), "optimizer": optimizer.describe(),
            "batch_size": batch_size, "dtype": "float32"}
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as exc:
        raise ExportError(f"model {model.name!r}: its description (get_config) is not plain JSON: {exc}") from None
    return meta


def _tables(name: str, model: Model, optimizer: Optimizer, step: TrainStep, train: GraphPlan,
            evaluation: GraphPlan, evaluation_names: Sequence[str], threads: int, target: Target) -> ModelTables:
    fn = step.function
    nm = len(step.mask_names)
    first = 3 + nm
    k = len(step.param_names)
    carried = {1 + j for j in range(k + len(step.state_names))}
    extra = [i for i in range(1, len(fn.outputs)) if i not in carried]
    if extra:  # the runtime keeps nothing but the loss and the carried arrays
        raise ExportError(f"the training function has results the runtime does not keep: {extra}")
    streams = [Stream("images", train.params[0], "float", 4, fn.params[0].shape,
                      f"float32: the images, {list(model.input_shape)} each"),
               Stream("labels", train.params[1], "int64_t", 8, fn.params[1].shape,
                      f"int64: class labels in [0, {model.output_shape[-1]})")]
    for i, layer in enumerate(step.mask_names):
        c_name = "mask_" + re.sub(r"\W", "_", layer)
        streams.append(Stream(c_name, train.params[2 + i], "float", 4, fn.params[2 + i].shape,
                              f"float32: dropout mask of layer {layer} (0 or 1/(1-rate))"))
    streams.append(Stream("lrs", train.params[2 + nm], "float", 4, (), "float32"))
    trained = model.trainable_param_shapes()
    state0 = optimizer.init_state({n: np.zeros(shape, np.float32) for n, shape in trained.items()})
    # The model's arrays (parameters, then buffers such as BatchNorm's running statistics) come first:
    # they feed the evaluation graph and are loaded from checkpoints; the optimizer's state follows and
    # is reset when a checkpoint has none. Each keeps its own slots, so the order is the table's only.
    carried_names = (*step.param_names, *step.state_names)
    eval_index = {name: i for i, name in enumerate(evaluation_names)}
    model_arrays = [n for n in carried_names if n in eval_index]
    arrays = []
    for array_name in (*model_arrays, *(n for n in carried_names if n not in eval_index)):
        j = carried_names.index(array_name)
        if array_name in eval_index:
            init = 0.0  # loaded from a checkpoint before training or evaluation
        else:
            flat = state0[array_name].reshape(-1)
            if flat.size and not (flat == flat[0]).all():
                raise ExportError(f"optimizer state {array_name!r} does not start as one constant value")
            init = float(flat[0]) if flat.size else 0.0
        arrays.append(ArrayInfo(array_name, fn.params[first + j].shape, init, train.params[first + j],
                                train.results[1 + j],
                                evaluation.params[1 + eval_index[array_name]] if array_name in eval_index else -1))
    return ModelTables(
        name=name, model=model.name, optimizer=optimizer.describe(), batch_size=step.batch_size,
        eval_batch_size=evaluation.function.params[0].shape[0], input_shape=model.input_shape,
        num_classes=model.output_shape[-1], threads=threads, target=f"{target.triple} ({target.cpu})",
        train=train, eval=evaluation, streams=tuple(streams), arrays=tuple(arrays), num_params=len(model_arrays),
        loss_slot=train.results[0], eval_images_slot=evaluation.params[0],
        eval_logits_slot=evaluation.results[0],
        checkpoint_meta=_checkpoint_meta(model, optimizer, step.batch_size),
    )


#: First components of LLVM triples of big-endian CPUs.
BIG_ENDIAN_ARCHES = ("s390x", "sparc", "sparcv9", "sparc64", "mips", "mips64", "powerpc", "powerpc64", "ppc",
                     "ppc64", "aarch64_be", "armeb", "thumbeb", "bpfeb", "m68k", "lanai")


def export(directory: str | os.PathLike[str], *, model: str | Model = "seed-cnn",
           optimizer: str | Optimizer = "adam", batch_size: int = 32, eval_batch_size: int | None = None,
           target: str | Target = "host", cpu: str | None = None, features: str | None = None, threads: int = 0,
           name: str = "opgrad", cc: str | None = None, object_only: bool = False,
           seed: int | None = None) -> ExportResult:
    """Write ``model`` + ``optimizer``'s training library for ``target`` into ``directory``.

    Always written: ``<name>.h`` (the C API), ``<name>_runtime.c`` (the runtime), ``<name>_kernels.o``
    (the compiled graphs) and ``<name>_init.npz`` (the starting parameters and buffers with the
    optimizer's initial state, an opgrad checkpoint that ``opgrad.nn.load`` rebuilds the model from).
    The starting weights are drawn from ``seed`` when it is given or ``model`` is a name (seed 0), else
    they are ``model``'s current weights — so ``export(dir, model=nn.load("trained.npz"))`` ships a
    trained model. Unless ``object_only``, the C compiler ``cc`` (default: :func:`default_c_compiler`)
    also builds ``<name>.o``, ``lib<name>.a`` and ``lib<name>.so``. ``threads`` is the runtime's pool
    size (0: one thread per online CPU; 1: no threads at all). Files are written atomically.
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise ExportError(f"name (--name) {name!r}: expected a lowercase C identifier of at most 32 characters "
                          "(it prefixes every exported symbol)")
    if name in RESERVED_NAMES:
        raise ExportError(f"name (--name) {name!r}: {name}.h would stand in for the C library's <{name}.h> in "
                          "every build that includes the export folder; choose another name")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ExportError(f"batch_size (--batch-size) must be an int >= 1, got {batch_size!r}")
    eval_batch_size = batch_size if eval_batch_size is None else eval_batch_size
    if isinstance(eval_batch_size, bool) or not isinstance(eval_batch_size, int) or eval_batch_size < 1:
        raise ExportError(f"eval_batch_size (--eval-batch-size) must be an int >= 1, got {eval_batch_size!r}")
    if isinstance(threads, bool) or not isinstance(threads, int) or not 0 <= threads <= 256:
        raise ExportError(f"threads (--threads) must be an int in [0, 256] (0: one per CPU), got {threads!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ExportError(f"seed (--seed) must be an int >= 0, got {seed!r}")
    if not isinstance(model, (str, Model)):
        raise ExportError(f"model must be a built-in model's name or an opgrad.nn.Model, got {type(model).__name__}")
    try:
        net = build_model(model) if isinstance(model, str) else model
        opt = make_optimizer(optimizer) if isinstance(optimizer, str) else optimizer
        tgt = target if isinstance(target, Target) else resolve_target(target, cpu, features)
    except ValueError as exc:
        raise ExportError(str(exc)) from None
    if tgt.triple.split("-")[0] in BIG_ENDIAN_ARCHES:
        # The runtime reads and writes checkpoints' little-endian float32 as they lie in memory.
        raise ExportError(f"target {tgt.name} ({tgt.triple}) is big-endian; the exported runtime runs on "
                          "little-endian CPUs (x86-64, AArch64, RISC-V, little-endian POWER)")
    if len(net.inputs) != 1 or len(net.outputs) != 1:
        # The C API streams one image array and one label array per step and returns one logits array.
        raise ExportError(f"model {net.name!r}: export takes single-input, single-output models; this one has "
                          f"{len(net.inputs)} input(s) and {len(net.outputs)} output(s)")
    if net.inputs[0].dtype != "float":
        # The C API's input is float32 data; integer ids would need an int64 stream of their own.
        raise ExportError(f"model {net.name!r}: export takes a float input (images or features); input "
                          f"{net.inputs[0].name!r} holds {net.inputs[0].dtype} ids (an Embedding's), which the C API "
                          "does not take")
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: exists and is not a directory")
    # Before the compile, so a path that cannot be written fails in a second; the folder itself is
    # made only once there is something to write, so a refused export leaves none behind.
    existing = next(p for p in (out, *out.absolute().parents) if p.exists())
    try:
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".opgrad-probe-"):
            pass
    except OSError as exc:
        raise ExportError(f"{out}: cannot write the export there ({existing}: {exc.strerror})") from None
    if cc is None and not object_only:
        cc = default_c_compiler(tgt)
        if cc is None:
            object_only = True  # Android and other triples: the app's own toolchain builds the runtime
    if not object_only:
        assert cc is not None
        if shutil.which(cc) is None:
            hint = " (apt-get install gcc-aarch64-linux-gnu)" if "aarch64-linux-gnu" in cc else ""
            raise ExportError(f"C compiler {cc!r} for {tgt.name} ({tgt.triple}) is not on PATH{hint}; pass cc= "
                              "(--cc) or object_only=True (--object-only) to write the object and sources only")

    t0 = time.perf_counter()
    try:
        step = TrainStep(net, opt, batch_size=batch_size, backend="reference")
        evaluation_step = EvalStep(net, batch_size=eval_batch_size, backend="reference")
    except (ValueError, TypeError) as exc:  # ShapeError included: a model the training step refuses
        raise ExportError(str(exc)) from None
    if step.labels.shapes[0] != (batch_size,):
        # The C API streams one class index per example; a class per position would be read past it.
        raise ExportError(f"model {net.name!r}: output 0 has shape {tuple(net.output_shapes[0])} per example, a "
                          f"class per position; export takes classifiers with one class per example (class "
                          f"logits (classes,)): put a Flatten() or a pooling before the last Dense")
    with use_target(tgt):
        try:
            train = plan_graph(step.function, name=f"{name}_train_graph", loop=step.step_loop())
            evaluation = plan_graph(evaluation_step.function, name=f"{name}_eval_graph")
        except CompileError as exc:  # a batch too large for the kernels' offsets, say
            raise ExportError(f"model {net.name!r} at batch_size={batch_size}, eval_batch_size={eval_batch_size}: "
                              f"{exc}") from None
    for graph, plan in (("training step", train), ("evaluation step", evaluation)):
        if plan.host_calls:
            # The kernels would call back into a Python communicator that a C program does not have.
            raise ExportError(f"model {net.name!r}: its {graph} sums over replicas ({plan.host_calls[0]}, "
                              "opgrad.ops.cross_replica_sum), which needs the MPI communicator of a running "
                              "opgrad process; an exported library has none. Export the model without it "
                              "(BatchNorm synchronizes only inside DistributedTrainer)")
    tables = _tables(name, net, opt, step, train, evaluation, evaluation_step.param_names, threads, tgt)
    ir = _module_ir(name, train, evaluation)
    labels = {**train.kernel_labels, **evaluation.kernel_labels}
    obj, times = object_code(ir, Codegen(tgt, jit=False), what=f"the exported {net.name} steps ({name})",
                             kernel_labels=labels)

    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ExportError(f"{out}: cannot create the export folder: {exc.strerror}") from None
    for stale in built_files(out, name).values():
        # A library from an earlier export beside this one's header would run the old graphs with the new
        # sizes; it goes before anything is written, so a failed or object-only export leaves none.
        try:
            stale.unlink(missing_ok=True)
        except OSError as exc:
            raise ExportError(f"{stale}: cannot remove the library of an earlier export: {exc.strerror}") from None
    files = {"header": out / f"{name}.h", "runtime": out / f"{name}_runtime.c", "kernels": out / f"{name}_kernels.o",
             "init": out / f"{name}_init.npz"}
    _write(files["header"], render_header(tables).encode())
    _write(files["runtime"], render_runtime(tables).encode())
    _write(files["kernels"], obj)
    if seed is not None or isinstance(model, str):
        params, buffers = net.init_params(seed or 0), net.init_buffers("float32")
    else:
        params = {n: np.asarray(a, np.float32) for n, a in net.params.items()}
        buffers = {n: np.asarray(a, np.float32) for n, a in net.buffers.items()}
    trained = {n: params[n] for n in net.trainable_param_names()}
    save_checkpoint(files["init"], {**params, **buffers, **opt.init_state(trained)},
                    {**tables.checkpoint_meta, "step": 0, "epoch": 0, "seed": seed})
    if not object_only:
        assert cc is not None
        files.update(_build(cc, out, name, files, threads))
    return ExportResult(out, tgt, files, time.perf_counter() - t0, times.cache_hit, None if object_only else cc)


def built_files(out: Path, name: str) -> dict[str, Path]:
    """What the C compiler builds from an export: the runtime and kernels as one object, and the libraries."""
    return {"object": out / f"{name}.o", "static": out / f"lib{name}.a", "shared": out / f"lib{name}.so"}


def _build(cc: str, out: Path, name: str, files: dict[str, Path], threads: int) -> dict[str, Path]:
    """Compile the runtime, then link ``<name>.o``, ``lib<name>.a`` and ``lib<name>.so`` into ``out``."""
    ar = _archiver(cc)
    pthread = [] if threads == 1 else ["-pthread"]
    built = built_files(out, name)
    with tempfile.TemporaryDirectory(dir=out, prefix=".build-") as tmp:
        runtime_o = Path(tmp) / f"{name}_runtime.o"
        _run([cc, "-std=c11", "-O2", "-fPIC", "-Wall", *pthread, "-I", str(out), "-c",
              str(files["runtime"]), "-o", str(runtime_o)], f"compiling {files['runtime'].name} with {cc}")
        objects = [str(files["kernels"]), str(runtime_o)]
        staged = {kind: Path(tmp) / path.name for kind, path in built.items()}
        _run([cc, "-r", "-nostdlib", "-o", str(staged["object"]), *objects], f"linking {name}.o")
        _run([ar, "rcs", str(staged["static"]), *objects], f"archiving lib{name}.a")
        _run([cc, "-shared", "-o", str(staged["shared"]), *objects, "-lm", *pthread], f"linking lib{name}.so")
        for kind, path in staged.items():
            os.replace(path, built[kind])
    return built
