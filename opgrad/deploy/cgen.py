"""C text of an exported model: the public header and the runtime source around ``runtime.c``.

The header is the contract a C user reads: every entry point with the exact shape and dtype of
each array in a comment, and ``#define``s for the sizes. The runtime source is three parts:
tables generated here from the two :class:`~opgrad.compiler.graph.GraphPlan` objects (which
pointer-table slot is what, arena offsets, array names, shapes and initial values, constants,
range checks), the fixed template ``runtime.c``, and the training entry points, whose argument
lists depend on the model's dropout masks.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

import numpy as np

from opgrad.compiler.graph import GraphPlan

__all__ = ["ModelTables", "render_header", "render_runtime"]


@dataclass(frozen=True)
class Stream:
    """A per-step input of the training loop, as the C API names it."""

    c_name: str
    slot: int
    ctype: str
    align: int
    per_step: tuple[int, ...]  # shape of one step's slice
    doc: str


@dataclass(frozen=True)
class ArrayInfo:
    """A parameter or optimizer-state array the model owns."""

    name: str
    shape: tuple[int, ...]
    init: float  # every element's value after opgrad_model_create (parameters: 0, to be loaded)
    train_param: int
    train_result: int
    eval_param: int  # -1 for optimizer state (parameters and buffers feed the evaluation graph)


@dataclass(frozen=True)
class ModelTables:
    """What the C side needs to drive the two compiled graphs."""

    name: str
    model: str
    optimizer: str
    batch_size: int
    eval_batch_size: int
    input_shape: tuple[int, ...]
    num_classes: int
    threads: int
    target: str
    train: GraphPlan
    eval: GraphPlan
    streams: tuple[Stream, ...]
    arrays: tuple[ArrayInfo, ...]
    num_params: int
    loss_slot: int
    eval_images_slot: int
    eval_logits_slot: int
    checkpoint_meta: Mapping[str, Any]  # what every saved checkpoint's metadata holds besides step and epoch

    @property
    def upper(self) -> str:
        return self.name.upper()

    @property
    def train_entry(self) -> str:
        return self.train.name

    @property
    def loop_entry(self) -> str:
        return self.train.loop_entry

    @property
    def eval_entry(self) -> str:
        return self.eval.name

    @property
    def masks(self) -> tuple[Stream, ...]:
        return tuple(s for s in self.streams if s.c_name.startswith("mask_"))


def _c_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _dims(shape: tuple[int, ...]) -> str:
    return "".join(f"[{d}]" for d in shape) or "[] (a scalar)"


def _stream_args(t: ModelTables, steps: bool) -> list[tuple[str, str]]:
    """(C declaration, comment) of each stream argument of train_steps (or train_step)."""
    args = []
    for s in t.streams:
        if s.c_name == "lrs":
            if steps:
                args.append((f"const float *{s.c_name}", "[steps] float32: the learning rate of each step"))
            continue
        lead = "steps * " if steps else ""
        shape = f"[{lead}{s.per_step[0]}]" + "".join(f"[{d}]" for d in s.per_step[1:])
        args.append((f"const {s.ctype} *{s.c_name}", f"{shape} {s.doc}"))
    return args


def render_header(t: ModelTables) -> str:
    """``<name>.h``: the public API with shapes and dtypes in comments and ``#define``s."""
    p, P = t.name, t.upper
    b, eb = t.batch_size, t.eval_batch_size
    in_size = math.prod(t.input_shape)
    shape = ", ".join(str(d) for d in t.input_shape)
    arrays = "\n".join(
        f" *   {a.name:<28} float32{list(a.shape)}" + ("" if a.eval_param >= 0 else "  (optimizer state)")
        for a in t.arrays)
    masks = "".join(f"#define {P}_{s.c_name.upper()}_SIZE {math.prod(s.per_step[1:])} "
                    f"/* elements of one example's dropout mask */\n" for s in t.masks)

    def proto(ret: str, fn: str, args: list[tuple[str, str]]) -> str:
        if not args:
            return f"{ret} {fn}(void);"
        width = max(len(a) for a, _ in args) + 1
        lines = [f"    {a + ',' if i + 1 < len(args) else a + ');':<{width + 1}} /* {c} */"
                 for i, (a, c) in enumerate(args)]
        return f"{ret} {fn}(\n" + "\n".join(lines)

    steps_args = [(f"{p}_model *model", f"from {p}_model_create"), ("int64_t steps", "N >= 0"),
                  *_stream_args(t, True), ("float *losses", "[steps] float32, written: the loss of each step"),
                  ("int flags", f"0 or {P}_STOP_ON_NAN")]
    handle = (f"{p}_model *model", f"from {p}_model_create")
    eval_args = [handle, ("const float *images", f"[{eb}]{_dims(t.input_shape)} float32"),
                 ("float *logits", f"[{eb}][{t.num_classes}] float32, written")]
    step_args = [handle, *_stream_args(t, False), ("float lr", "learning rate"),
                 ("float *loss", "[1] float32, written (may be NULL)"), ("int flags", f"0 or {P}_STOP_ON_NAN")]
    return f"""/* {p}.h: the {t.model} model's training step ({t.optimizer}), batch {b}, float32,
 * exported by opgrad for {t.target}. Generated by `opgrad export`; see docs/deployment.md.
 *
 * Link with lib{p}.a or lib{p}.so (or {p}.o) and -lm{'' if t.threads == 1 else ' -pthread'}. Every function returns
 * {P}_OK (0) or an error code, and {p}_last_error(model) says what went wrong; nothing
 * aborts the process. Arrays are C-ordered (row-major), aligned to their element size, and
 * never kept after a call returns. One model must not be used by two threads at once; separate
 * models may. The arrays the model owns: parameters, buffers (BatchNorm's running statistics,
 * updated by training steps and used by evaluation), then optimizer state:
 *
{arrays}
 *
 * {p}_model_create leaves parameters and buffers at zero and the optimizer state at its initial values:
 * load {p}_init.npz (written by the export) or a checkpoint of `opgrad train --save` first.
 */
#ifndef {P}_H
#define {P}_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {{
#endif

#define {P}_MODEL {_c_string(t.model)}
#define {P}_OPTIMIZER {_c_string(t.optimizer)}
#define {P}_TARGET {_c_string(t.target)}
#define {P}_BATCH_SIZE {b} /* B: examples per training step */
#define {P}_EVAL_BATCH_SIZE {eb} /* examples per {p}_eval call */
#define {P}_INPUT_SHAPE {{{shape}}} /* one example: float32{list(t.input_shape)} */
#define {P}_INPUT_SIZE {in_size} /* elements of one example */
#define {P}_NUM_CLASSES {t.num_classes} /* logits per example; labels are in [0, {t.num_classes}) */
#define {P}_NUM_ARRAYS {len(t.arrays)} /* parameter, buffer and optimizer-state arrays */
#define {P}_NUM_PARAM_ARRAYS {t.num_params} /* parameters and buffers: the model's own arrays */
#define {P}_THREADS {t.threads} /* worker threads (0: one per online CPU; $OPGRAD_NUM_THREADS overrides) */
{masks}
/* Return codes */
#define {P}_OK 0
#define {P}_ERR_NULL 1     /* a required pointer argument is NULL */
#define {P}_ERR_ARGUMENT 2 /* a bad value: negative steps, a misaligned array, unknown flags or name */
#define {P}_ERR_LABEL 3    /* a label outside [0, {P}_NUM_CLASSES): no step from that one on ran */
#define {P}_ERR_NAN 4      /* a NaN or infinite loss with {P}_STOP_ON_NAN: that step's update was not applied */
#define {P}_ERR_IO 5       /* a file cannot be opened, read or written */
#define {P}_ERR_FORMAT 6   /* not an opgrad checkpoint, corrupt, or for another model */
#define {P}_ERR_NOMEM 7    /* out of memory */

/* Flags */
#define {P}_STOP_ON_NAN 1  /* stop at the first NaN or infinite loss, keeping the parameters before that step */

typedef struct {p}_model {p}_model;

/* A model with its own parameters, optimizer state and scratch memory (about the size of two
 * copies of the arrays above plus the compiled steps' intermediates); NULL when out of memory.
 * The first model starts the worker threads, the last one freed stops them. */
{p}_model *{p}_model_create(void);
void {p}_model_free({p}_model *model); /* NULL is allowed */

/* What the last failing call on `model` did wrong ("" after a success); never NULL. */
const char *{p}_last_error(const {p}_model *model);

/* Run `steps` training steps (forward, backward, optimizer update) in one call. Step i trains
 * on rows i*{b} .. i*{b}+{b - 1} of the batch-major arrays. Labels are checked before each step
 * runs. Same numbers as `steps` calls of {p}_train_step. */
{proto("int", f"{p}_train_steps", steps_args)}

/* One training step on one batch. */
{proto("int", f"{p}_train_step", step_args)}

/* Logits of {eb} examples with the current parameters (dropout off). */
{proto("int", f"{p}_eval", eval_args)}

/* Load parameters and buffers (and optimizer state, if the file has it; else the state is reset) from an
 * opgrad checkpoint (.npz, as `opgrad train --save` and {p}_model_save write it). The checksum,
 * names, shapes and dtypes are checked; on any error the model is unchanged. */
int {p}_model_load({p}_model *model, const char *path);

/* Save parameters, buffers, optimizer state, step and epoch as an opgrad checkpoint, atomically (a
 * temporary file renamed over `path`), with the model's architecture in its metadata as `opgrad train
 * --save` writes it: opgrad.nn.load, `opgrad predict` and `opgrad train --resume` read it. */
int {p}_model_save({p}_model *model, const char *path);

/* Training steps run so far (loaded from a checkpoint's "step"), and the epoch counter saved
 * with checkpoints (the runtime never advances it). -1 for a NULL model. */
int64_t {p}_model_step(const {p}_model *model);
int64_t {p}_model_epoch(const {p}_model *model);
int {p}_model_set_epoch({p}_model *model, int64_t epoch);

/* The current values of parameter or state array `name` (see the list above), C-ordered;
 * `*count` gets its element count. Valid until the next training call, which may move it. */
float *{p}_model_array({p}_model *model, const char *name, int64_t *count);

#ifdef __cplusplus
}}
#endif

#endif /* {P}_H */
"""


def _hex_rows(data: bytes) -> str:
    return ",\n".join("    " + ", ".join(f"0x{b:02x}" for b in data[i : i + 16]) for i in range(0, len(data), 16))


def _consts(prefix: str, plan: GraphPlan) -> str:
    lines = []
    for slot, value in sorted(plan.consts.items()):
        raw = np.ascontiguousarray(value).astype(value.dtype.newbyteorder("<"), copy=False).tobytes()
        lines.append(f"static const unsigned char og_{prefix}_const{slot}[{max(1, len(raw))}] "
                     f"__attribute__((aligned(64))) = {{\n{_hex_rows(raw) or '    0'}\n}};")
    entries = ", ".join(f"{{{slot}, og_{prefix}_const{slot}}}" for slot in sorted(plan.consts)) or "{-1, 0}"
    lines.append(f"#define OG_{prefix.upper()}_NCONSTS {len(plan.consts)}")
    lines.append(f"static const og_const og_{prefix}_consts[] = {{{entries}}};")
    return "\n".join(lines)


def _saved_meta(t: ModelTables) -> str:
    """The hex rows of ``og_saved_meta``: the metadata fields that every checkpoint the runtime saves
    shares, as one JSON object, ASCII and NUL-terminated. Bytes rather than a string literal: an
    architecture's JSON easily passes the 4095 characters C promises to accept in one literal, and
    its text may hold a trigraph such as ``??(``, which a C11 compiler would rewrite."""
    text = json.dumps({**t.checkpoint_meta, "saved_by": "opgrad export runtime"}, sort_keys=True, ensure_ascii=True)
    return _hex_rows(text.encode("ascii") + b"\0")


def _offsets(plan: GraphPlan) -> str:
    values = [str(plan.offsets.get(s, -1)) for s in range(len(plan.buffers))]
    return ",\n".join("    " + ", ".join(values[i : i + 16]) for i in range(0, len(values), 16))


def render_runtime(t: ModelTables) -> str:
    """``<name>_runtime.c``: generated tables + the ``runtime.c`` template + the training entries."""
    p, P = t.name, t.upper
    template = resources.files("opgrad.deploy").joinpath("runtime.c").read_text()
    if p != "opgrad":  # the template's public names use the default prefix
        template = re.sub(r"\bopgrad_", f"{p}_", template)
        template = re.sub(r"\bOPGRAD_", f"{P}_", template)
    arrays = ",\n".join(
        f"    {{{_c_string(a.name)}, {len(a.shape)}, {{{', '.join(str(d) for d in a.shape) or '0'}}}, "
        f"{math.prod(a.shape)}, {a.init!r}, {a.train_param}, {a.train_result}, {a.eval_param}}}"
        for a in t.arrays)
    streams = ",\n".join(f"    {{{_c_string(s.c_name)}, {s.slot}, {s.align}}}" for s in t.streams)
    checks = ",\n".join(
        f"    {{{_c_string(t.train.function.params[c.param].name)}, {_c_string(c.op)}, {_c_string(c.input)}, "
        f"{c.low}, {c.high}, {math.prod(t.train.function.params[c.param].shape)}}}"
        for c in t.train.checks) or '    {"", "", "", 0, 0, 1}'
    prologue = f"""/* {p}_runtime.c: generated by `opgrad export` for the {t.model} model ({t.optimizer}), batch
 * {t.batch_size}, target {t.target}. The tables below describe the compiled graphs in
 * {p}_kernels.o; the rest is opgrad/deploy/runtime.c. */
#define _POSIX_C_SOURCE 200809L
#include "{p}.h"

#include <stdint.h>

#define OG_MAX_THREADS {t.threads}
#define OG_THREADS_ENV "OPGRAD_NUM_THREADS"
#define OG_TRAIN_SLOTS {len(t.train.buffers)}
#define OG_EVAL_SLOTS {len(t.eval.buffers)}
#define OG_TRAIN_ARENA {t.train.arena_bytes}
#define OG_EVAL_ARENA {t.eval.arena_bytes}
#define OG_WS_PER_THREAD {max(t.train.workspace_per_thread, t.eval.workspace_per_thread)}
#define OG_NARRAYS {len(t.arrays)}
#define OG_NPARAMS {t.num_params}
#define OG_NSTREAMS {len(t.streams)}
#define OG_LOSS_SLOT {t.loss_slot}
#define OG_EVAL_IMAGES_SLOT {t.eval_images_slot}
#define OG_EVAL_LOGITS_SLOT {t.eval_logits_slot}
#define OG_META_MODEL {_c_string(t.model)}
#define OG_META_OPTIMIZER {_c_string(t.optimizer)}

/* The compiled graphs (opgrad/compiler: one pointer table `bufs`, one workspace `ws`). */
void {t.train_entry}(void **bufs, void *ws);
int32_t {t.loop_entry}(void **bufs, void *ws, int64_t steps, int32_t flags, int64_t *status);
void {t.eval_entry}(void **bufs, void *ws);
#define OG_TRAIN_LOOP {t.loop_entry}
#define OG_EVAL_ENTRY {t.eval_entry}

typedef struct {{
    const char *name;
    int ndim;
    int64_t shape[8];
    int64_t count;
    double init;
    int train_param, train_result, eval_param; /* pointer-table slots */
}} og_array;

typedef struct {{
    const char *name;
    int slot;
    int align;
}} og_stream;

typedef struct {{
    const char *argument, *op, *input;
    int64_t low, high, per_step;
}} og_check;

typedef struct {{
    int slot;
    const unsigned char *data;
}} og_const;

/* Parameters and buffers first, then optimizer state: the loop's carried (parameter, result) slot pairs. */
static const og_array og_arrays[OG_NARRAYS] = {{
{arrays}
}};

/* Per-step inputs, in the loop's stream order. */
static const og_stream og_streams[OG_NSTREAMS] = {{
{streams}
}};

/* Integer inputs with a declared range; the compiled loop reports a violation by index. */
static const og_check og_checks[] = {{
{checks}
}};

/* Arena offset of each pointer-table slot, -1 for slots that are not intermediates. */
static const int64_t og_train_offsets[OG_TRAIN_SLOTS] = {{
{_offsets(t.train)}
}};
static const int64_t og_eval_offsets[OG_EVAL_SLOTS] = {{
{_offsets(t.eval)}
}};

{_consts("train", t.train)}
{_consts("eval", t.eval)}

/* The JSON metadata of every checkpoint {p}_model_save writes, but for "epoch" and "step", which it puts
 * first: the model's name and architecture (opgrad.nn.load rebuilds the model from them), the optimizer,
 * the batch size and the dtype. */
static const char og_saved_meta[] = {{
{_saved_meta(t)}
}};

/* ---------------------------------- opgrad/deploy/runtime.c ---------------------------------- */
"""
    decls = [d for d, _ in _stream_args(t, True)]
    step_decls = [d for d, _ in _stream_args(t, False)]
    names = [s.c_name for s in t.streams]
    step_names = ["lr_one" if n == "lrs" else n for n in names]
    epilogue = f"""
/* ------------------------------------ training entry points ------------------------------------ */

int {p}_train_steps({p}_model *model, int64_t steps, {', '.join(decls)}, float *losses, int flags) {{
    const void *streams[OG_NSTREAMS] = {{{', '.join(names)}}};
    return og_train_run(model, "{p}_train_steps", steps, streams, losses, flags);
}}

int {p}_train_step({p}_model *model, {', '.join(step_decls)}, float lr, float *loss, int flags) {{
    float lr_one[1] = {{lr}}, unused;
    const void *streams[OG_NSTREAMS] = {{{', '.join(step_names)}}};
    return og_train_run(model, "{p}_train_step", 1, streams, loss ? loss : &unused, flags);
}}
"""
    return prologue + template + epilogue
