"""Merge identical internal functions in LLVM IR text before it is optimized.

A model that repeats a block (a ResNet stage, a transformer layer) lowers each repetition to its
own kernels, and kernels of the same op on the same shapes have the same body under different
names. Optimizing and emitting each copy is the bulk of a cold compile: the training step of a
14-layer ResNet shrinks from 1,338 to 358 functions, and its optimize + codegen time by about 4x.
LLVM's MergeFunctions pass finds the same thing, but only after each copy has been optimized.

Two internal functions are merged when their text is equal once their own name and the names of
functions already merged are made canonical, repeated until nothing changes (callers of merged
kernels become equal in the next round). Only ``define internal`` functions that the module's
header (globals, declarations) does not mention are merged away, so every exported symbol stays.
"""

from __future__ import annotations

import re

__all__ = ["merge_identical_functions"]

_GLOBAL_NAME = re.compile(r'@("[^"]+"|[\w.$-]+)')
_DEFINE = re.compile(r'define[^@]*@("[^"]+"|[\w.$-]+)\(')
_FUNCTION_END = "\n}\n"


def _split(ir_text: str) -> tuple[str, list[tuple[str, str]], str] | None:
    """(header, [(name, text of one function)], trailer), or None if the text is not laid out as
    opgrad's builder writes it (then nothing is merged)."""
    starts = [m.start() for m in re.finditer(r"^define ", ir_text, re.M)]
    if not starts:
        return None
    header, functions = ir_text[: starts[0]], []
    trailer = ""
    for i, start in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else len(ir_text)
        chunk = ir_text[start:end]
        close = chunk.rfind(_FUNCTION_END)
        if close < 0:
            return None
        head = _DEFINE.match(chunk)
        if head is None:
            return None
        body_end = close + len(_FUNCTION_END)
        if chunk[body_end:].strip():
            if i + 1 < len(starts):
                return None  # something between two functions that is not a function
            trailer = chunk[body_end:]
        functions.append((head.group(1), chunk[:body_end]))
    return header, functions, trailer


def merge_identical_functions(ir_text: str) -> str:
    """``ir_text`` with duplicate internal functions removed and their callers pointed at the one
    kept (the first in module order). Text that does not look like opgrad's IR comes back as is."""
    parts = _split(ir_text)
    if parts is None:
        return ir_text
    header, functions, trailer = parts
    pinned = {m.group(1) for m in _GLOBAL_NAME.finditer(header + trailer)}
    mergeable = {name for name, text in functions if text.startswith("define internal") and name not in pinned}
    replaced: dict[str, str] = {}

    def canonical(name: str) -> str:
        while name in replaced:
            name = replaced[name]
        return name

    changed = True
    while changed:
        changed = False
        first_with: dict[str, str] = {}
        for name, text in functions:
            if name in replaced:
                continue

            def reference(match: re.Match[str], me: str = name) -> str:
                return "@" + ("<self>" if match.group(1) == me else canonical(match.group(1)))

            key = _GLOBAL_NAME.sub(reference, text)
            kept = first_with.setdefault(key, name)
            if kept != name and name in mergeable:
                replaced[name] = kept
                changed = True
    if not replaced:
        return ir_text
    body = "".join(_GLOBAL_NAME.sub(lambda m: "@" + canonical(m.group(1)), text)
                   for name, text in functions if name not in replaced)
    return header + body + trailer
