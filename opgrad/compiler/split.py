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

__all__ = ["DEFINE", "isolate_kernels", "split_module"]

#: One function definition's first line, as the emitters write it.
DEFINE = re.compile(r"^define (?:internal )?(?P<ret>[^@]*) @(?P<name>[^(]+)\((?P<params>[^)]*)\)(?P<attrs>[^{]*)\{$")
_REFERENCE = re.compile(r"@([A-Za-z0-9_.$-]+)")
_MUTABLE_GLOBAL = re.compile(r"^@\S+ = (?:[a-z_]+ )*global ")


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


def split_module(ir_text: str, parts: int) -> list[str]:
    """``ir_text`` as at most ``parts`` modules that together define every function once; the
    module itself (a one-element list) when it cannot or need not be cut."""
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
                return [ir_text]
            header.append(line)
            continue
        declaration = f"declare {m.group('ret')} @{m.group('name')}({m.group('params')}){m.group('attrs')}"
        current = _Function(m.group("name"), [line], declaration, _group_of(m.group("name")))
        functions.append(current)
    if current is not None:
        return [ir_text]  # an unterminated function: leave the text to LLVM's parser to report
    sizes: dict[str, int] = {}
    for fn in functions:
        sizes[fn.group] = sizes.get(fn.group, 0) + sum(len(line) for line in fn.lines)
    parts = min(parts, len(sizes))
    if parts < 2:
        return [ir_text]
    load = [0] * parts
    owner: dict[str, int] = {}
    for group in sorted(sizes, key=lambda g: -sizes[g]):
        lightest = load.index(min(load))
        owner[group] = lightest
        load[lightest] += sizes[group]
    part_of = {fn.name: owner[fn.group] for fn in functions}
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
