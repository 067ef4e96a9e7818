"""Render ``docs/operators.md`` from the declarations: ``python -m opgrad.docgen > docs/operators.md``.

The operator reference is generated, never hand-edited, so it cannot drift from the code; a test
fails when the committed file differs from what this prints.
"""

from __future__ import annotations

import inspect

from opgrad import registry
from opgrad.op import Operator
from opgrad.optable import gradient_text, kernel_text


def _formula(op: Operator) -> str:
    rule = op.gradient_rule
    if rule is None:
        return ""
    doc = inspect.getdoc(rule) or ""
    return doc.splitlines()[0] if doc else ""


def operator_section(op: Operator) -> str:
    lines = [f"## `{op.name}`", "", op.doc, "", f"Declared in `registry/{op.module}.py`.", ""]
    if op.inputs:
        lines.append("| input | kind | differentiable | value domain (checker) | notes |")
        lines.append("|---|---|---|---|---|")
    else:
        lines.append("No inputs: the result depends on the attributes alone.")
    for spec in op.inputs:
        if spec.kind == "int":
            domain = f"integers in [{spec.int_range[0]}, {spec.int_range[1]})" if spec.int_range else "integers"
        else:
            domain = " ∪ ".join(f"[{i.low:g}, {i.high:g}]" for i in spec.domain)
        dims = f"dims {spec.dims}; " if spec.dims else ""
        many = "a list of tensors; " if spec.variadic else ""
        lines.append(
            f"| `{spec.name}` | {spec.kind} | {'yes' if spec.differentiable else 'no'} | {domain} | "
            f"{many}{dims}{spec.doc} |"
        )
    if op.attrs:
        lines += ["", "| attribute | default | meaning |", "|---|---|---|"]
        for attr in op.attrs:
            default = "required" if attr.required else f"`{attr.default!r}`"
            lines.append(f"| `{attr.name}` | {default} | {attr.doc} |")
    lines += ["", f"- gradient: {gradient_text(op)}" + (f" — `{_formula(op)}`" if _formula(op) else "")]
    if op.jointly_linear:
        lines.append("- linear in its differentiable inputs (checked by an exact adjoint test)")
    elif op.linear_in:
        lines.append(f"- linear in each of: {', '.join(op.linear_in)} (the others held fixed)")
    if op.kinks is not None:
        lines.append(f"- kinks: {op.kinks.convention}")
    lines.append(f"- kernel: {kernel_text(op)}")
    return "\n".join(lines)


def render() -> str:
    ops = registry.all_ops()
    head = [
        "# Operator reference",
        "",
        "Generated from the declarations in `registry/` by `python -m opgrad.docgen`; do not edit by hand.",
        "",
        "| op | gradient | kernel |",
        "|---|---|---|",
        *(f"| [`{o.name}`](#{o.name}) | {gradient_text(o)} | {kernel_text(o)} |" for o in ops),
        "",
    ]
    builders = registry.all_composites()
    tail = ["## Composites", "", "Builders made of the operators above; their gradients, kernels and checks are those "
            "of the operators they emit.", ""]
    tail += [f"- `{c.name}` (`registry/{c.module}.py`, built of {', '.join(f'`{u}`' for u in c.uses)}): {c.doc}"
             for c in builders]
    return "\n".join(head + [operator_section(o) + "\n" for o in ops] + (tail + [""] if builders else []))


if __name__ == "__main__":
    print(render(), end="")
