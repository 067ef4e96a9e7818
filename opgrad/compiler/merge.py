"""Compile repeated kernels once: merge identical kernel groups in LLVM IR text before optimizing.

A model that repeats a block (a ResNet stage, a transformer layer) lowers each repetition to its
own kernels, and kernels of the same op on the same shapes have the same code under other names.
Optimizing and emitting each copy is the bulk of a cold compile: the training step of a 14-layer
ResNet holds 99 kernel groups of which 60 repeat another, and merging them cuts its optimize +
codegen time about 4x. LLVM's MergeFunctions pass finds the same thing, but only after each copy
has been optimized.

A kernel group is the builder's unit: the functions named ``<module>.<kernel>[.<helper>...]``
(see :mod:`opgrad.compiler.split`). Two groups are equal when their text is, once each group's own
prefix is made neutral. The later group keeps its entry points (its functions that are not
internal, which the graph and Python call by name), each now a tail call to the first group's
counterpart, and loses its internal helpers; whoever called an internal function of the later
group from outside (the graph's entry calls a parallel loop's task) calls the first group's
instead. Whole groups merge or none, so splitting a module into parts and inlining stay as they
were.
"""

from __future__ import annotations

import re

__all__ = ["merge_identical_functions"]

_GLOBAL_NAME = re.compile(r'@("[^"]+"|[\w.$-]+)')
_DEFINE = re.compile(r"define (?P<linkage>(?:(?:internal|private|hidden|protected|dso_local|external) )*)"
                     r"(?P<ret>[^@]*?) ?@(?P<name>[\w.$-]+)\((?P<params>[^)]*)\)(?P<attrs>[^{]*)\{")
_PARAM = re.compile(r"^(?P<type>ptr|i\d+|float|double) (?P<name>%[\w.]+)$")
_FUNCTION_END = "\n}\n"


def _group_of(name: str) -> str:
    return ".".join(name.split(".")[:2])


def _split(ir_text: str) -> tuple[str, list[tuple[str, str]], str] | None:
    """(header, [(name, text of one function)], trailer), or None if the text is not laid out as
    opgrad's builder writes it (then nothing is merged)."""
    starts = [m.start() for m in re.finditer(r"^define ", ir_text, re.M)]
    if not starts:
        return None
    functions, trailer = [], ""
    for i, start in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else len(ir_text)
        chunk = ir_text[start:end]
        close = chunk.rfind(_FUNCTION_END)
        head = _DEFINE.match(chunk)
        if close < 0 or head is None:
            return None
        body_end = close + len(_FUNCTION_END)
        if chunk[body_end:].strip():
            if i + 1 < len(starts):
                return None  # something between two functions that is not a function
            trailer = chunk[body_end:]
        functions.append((head.group("name"), chunk[:body_end]))
    return ir_text[: starts[0]], functions, trailer


def _wrapper(text: str, target: str) -> str | None:
    """An entry point with ``text``'s signature that tail-calls ``target``; None if its parameters
    are not the plain ``type %name`` the builder writes."""
    head = _DEFINE.match(text)
    assert head is not None
    params = [p.strip() for p in head.group("params").split(",") if p.strip()]
    parsed = [_PARAM.match(p) for p in params]
    if any(m is None for m in parsed):
        return None
    args = ", ".join(p for p in params)
    ret = head.group("ret").strip()
    first_line = text[: text.index("{") + 1]
    if ret == "void":
        body = f"  tail call void @{target}({args})\n  ret void"
    else:
        body = f"  %result = tail call {ret} @{target}({args})\n  ret {ret} %result"
    return f"{first_line}\nentry:\n{body}\n}}\n"


def merge_identical_functions(ir_text: str) -> str:
    """``ir_text`` with each kernel group that repeats an earlier one reduced to entry points that
    call the earlier group. Text that does not look like opgrad's IR comes back as is."""
    parts = _split(ir_text)
    if parts is None:
        return ir_text
    header, functions, trailer = parts
    groups: dict[str, list[tuple[str, str]]] = {}
    for name, text in functions:
        groups.setdefault(_group_of(name), []).append((name, text))
    first_with: dict[str, str] = {}
    replacement: dict[str, str] = {}  # function name -> its new text ("" to drop it)
    renamed: dict[str, str] = {}  # dropped internal function -> the first copy, which its callers now call
    for group, members in groups.items():
        if len(group.split(".")) < 2:
            continue  # the module's own functions (the graph entry) are not kernels

        def neutral(match: re.Match[str], group: str = group) -> str:
            name = match.group(1)
            return "@<kernel>" + name[len(group):] if _group_of(name) == group else match.group(0)

        key = "".join(_GLOBAL_NAME.sub(neutral, text) for _, text in members)
        kept = first_with.setdefault(key, group)
        if kept == group:
            continue
        new: dict[str, str] = {}
        new_names: dict[str, str] = {}
        for name, text in members:
            if text.startswith("define internal"):  # dropped; anyone outside that called it calls the first copy
                new[name] = ""
                new_names[name] = kept + name[len(group):]
            else:
                wrapper = _wrapper(text, kept + name[len(group):])
                if wrapper is None:
                    break
                new[name] = wrapper
        else:
            replacement.update(new)
            renamed.update(new_names)
    if not replacement:
        return ir_text
    body = "".join(replacement.get(name, text) for name, text in functions)
    text = header + body + trailer
    if renamed:
        text = _GLOBAL_NAME.sub(lambda m: "@" + renamed.get(m.group(1), m.group(1)), text)
    return text
