"""Cut one LLVM module's text into parts that compile in parallel and link back together.

Why: optimizing and emitting a training step's module takes seconds on one core, nearly all of it
in a dozen GEMM and conv kernels that do not depend on each other. Each kernel is a group of
functions named ``<module>.<kernel>[.<helper>...]`` (the builder's naming), and a group never
calls into another group except through the entry functions, so groups can be optimized apart
with nothing lost: a kernel's helpers stay internal and are inlined into it as before. Only a
function called from another part becomes external; the MCJIT engine resolves the calls between
the parts' objects when it links them.

Groups are spread over the parts longest first onto the lightest part (text length stands in for
compile time). Modules with globals that are not constants are never cut: each part would get a
copy of the variable.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .llvm_worker import AUTO_PIPELINE, PIPELINES

__all__ = ["AUTO_PIPELINE", "DEFINE", "PIPELINE_KEY", "isolate_kernels", "pipeline_attribute", "pipeline_pieces",
           "split_module"]

#: One function definition's first line, as the emitters write it.
DEFINE = re.compile(r"^define (?:internal )?(?P<ret>[^@]*) @(?P<name>[^(]+)\((?P<params>[^)]*)\)(?P<attrs>[^{]*)\{$")
_REFERENCE = re.compile(r"@([A-Za-z0-9_.$-]+)")
_MUTABLE_GLOBAL = re.compile(r"^@\S+ = (?:[a-z_]+ )*global ")
#: The string function attribute that names a function's optimization pipeline.
PIPELINE_KEY = "opgrad-pipeline"
_PIPELINE = re.compile(rf'"{PIPELINE_KEY}"="(\w+)"')
#: LLVM's fixed work per function, in characters of explicit code: parts are balanced by this plus
#: each function's length weighted by its pipeline's ``compile_cost``, not by length alone.
COST_PER_FUNCTION = 1000.0


@dataclass
class _Function:
    name: str
    lines: list[str]
    declaration: str
    group: str


def _group_of(name: str) -> str:
    """``graph.conv2.gemm.pack_a`` -> ``graph.conv2``: a kernel and its helpers travel together."""
    return ".".join(name.split(".")[:2])


def isolate_kernels(ir_text: str) -> str:
    """``ir_text`` with every function that another group refers to made external (hidden: a shared
    library still exports its C API only) and ``noinline``.

    Both the whole-module build and the parts go through this, so a kernel is optimized the same
    way whichever part it lands in, and the machine code, and every rounding, is the same whether
    the module is compiled whole (an exported library) or in parts (the JIT): inlined across
    kernels, LLVM could contract one kernel's multiply with the next one's add.
    """
    names: dict[str, str] = {}
    for line in ir_text.splitlines():
        if (m := DEFINE.match(line)) is not None:
            names[m.group("name")] = _group_of(m.group("name"))
    shared: set[str] = set()
    group = ""
    for line in ir_text.splitlines():
        if (m := DEFINE.match(line)) is not None:
            group = names[m.group("name")]
            continue
        if "@" in line:
            shared.update(n for n in _REFERENCE.findall(line) if n in names and names[n] != group)
    out = []
    for line in ir_text.splitlines():
        m = DEFINE.match(line)
        if m is not None and m.group("name") in shared:
            line = line.replace("define internal ", "define hidden ", 1)
            line = line[:-1] + "noinline {" if "noinline" not in m.group("attrs") else line
        out.append(line)
    return "\n".join(out) + "\n"


def _parse(ir_text: str) -> tuple[list[str], list[_Function]] | None:
    """The module's header lines (everything outside functions) and its functions; None when it
    must stay whole: it has a global that is not a constant, or an unterminated function."""
    header: list[str] = []
    functions: list[_Function] = []
    current: _Function | None = None
    for line in ir_text.splitlines():
        if current is not None:
            current.lines.append(line)
            if line == "}":
                current = None
            continue
        m = DEFINE.match(line)
        if m is None:
            if _MUTABLE_GLOBAL.match(line):
                return None
            header.append(line)
            continue
        declaration = f"declare {m.group('ret')} @{m.group('name')}({m.group('params')}){m.group('attrs')}"
        current = _Function(m.group("name"), [line], declaration, _group_of(m.group("name")))
        functions.append(current)
    if current is not None:
        return None  # leave the text to LLVM's parser to report
    return header, functions


def _cut(header: list[str], functions: list[_Function], part_of: dict[str, int], parts: int) -> list[str]:
    """One module per part: the functions ``part_of`` gives it, declarations of the rest; a
    function another part calls becomes external (hidden) so the linker can join them."""
    called_across = set()
    for fn in functions:
        for line in fn.lines[1:]:
            for name in _REFERENCE.findall(line):
                if name in part_of and part_of[name] != part_of[fn.name]:
                    called_across.add(name)
    texts = []
    for p in range(parts):
        out = list(header)
        for fn in functions:
            if part_of[fn.name] != p:
                out.append(fn.declaration)
                continue
            first = fn.lines[0]
            if fn.name in called_across:
                first = first.replace("define internal ", "define hidden ", 1)
            out.append(first)
            out.extend(fn.lines[1:])
        texts.append("\n".join(out) + "\n")
    return texts


def split_module(ir_text: str, parts: int) -> list[str]:
    """``ir_text`` as at most ``parts`` modules that together define every function once; the
    module itself (a one-element list) when it cannot or need not be cut."""
    parsed = _parse(ir_text)
    if parsed is None:
        return [ir_text]
    header, functions = parsed
    pipelines = _function_pipelines(functions)
    sizes: dict[str, float] = {}
    for fn in functions:
        cost = COST_PER_FUNCTION + sum(len(line) for line in fn.lines) * PIPELINES[pipelines[fn.name]].compile_cost
        sizes[fn.group] = sizes.get(fn.group, 0) + cost
    parts = min(parts, len(sizes))
    if parts < 2:
        return [ir_text]
    load = [0.0] * parts
    owner: dict[str, int] = {}
    for group in sorted(sizes, key=lambda g: -sizes[g]):
        lightest = load.index(min(load))
        owner[group] = lightest
        load[lightest] += sizes[group]
    return _cut(header, functions, {fn.name: owner[fn.group] for fn in functions}, parts)


def pipeline_attribute(pipeline: str) -> str:
    """The function attribute by which an emitter asks for ``pipeline`` (see :func:`pipeline_pieces`)."""
    if pipeline not in PIPELINES:
        raise ValueError(f"unknown optimization pipeline {pipeline!r}; known: {', '.join(PIPELINES)}")
    return f'"{PIPELINE_KEY}"="{pipeline}"'


def _function_pipelines(functions: list[_Function]) -> dict[str, str]:
    """Each function's pipeline: the one it asks for; for a function that asks for none (a
    kernel's entry or glue), the one its group's other functions ask for, ``cold`` aside, and
    ``auto`` where they ask for none or for several (``auto`` does what every other pipeline does,
    and more)."""
    asked: dict[str, str] = {}
    votes: dict[str, set[str]] = {}
    for fn in functions:
        group_votes = votes.setdefault(fn.group, set())
        if (m := _PIPELINE.search(fn.lines[0])) is not None:
            asked[fn.name] = m.group(1)
            group_votes.add(m.group(1))
    unmarked: dict[str, str] = {}
    for group, group_votes in votes.items():
        if len(group_votes) > 1:
            group_votes -= {"cold"}
        unmarked[group] = next(iter(group_votes)) if len(group_votes) == 1 else AUTO_PIPELINE
    return {fn.name: asked.get(fn.name, unmarked[fn.group]) for fn in functions}


def pipeline_pieces(ir_text: str) -> list[tuple[str, str]]:
    """``ir_text`` cut by optimization pipeline: ``(pipeline, module text)`` for each pipeline its
    functions ask for, in a fixed order; the whole module as one piece when it cannot be cut.

    Why: optimizing a training step at O3 spends most of its time re-vectorizing and unrolling
    code that is already explicit vector code, register-tiled by its emitter, or a memory-bound
    loop that unrolling does not speed up. An emitter names what each function needs with
    :func:`pipeline_attribute`; the pieces are optimized apart and linked before code generation.
    A function is never inlined into one of another pipeline (it is only declared there), and
    every build goes through this cut, so a kernel is optimized the same way whether its module
    is compiled whole or in parts.
    """
    parsed = _parse(ir_text)
    if parsed is None:
        return [(AUTO_PIPELINE, ir_text)]
    header, functions = parsed
    chosen = _function_pipelines(functions)
    order = sorted(set(chosen.values()))
    if len(order) < 2:
        return [(order[0] if order else AUTO_PIPELINE, ir_text)]
    part_of = {name: order.index(pipeline) for name, pipeline in chosen.items()}
    return list(zip(order, _cut(header, functions, part_of, len(order)), strict=True))
