"""``opgrad ops``: a table of every registered operator, straight from the declarations."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from opgrad import registry
from opgrad.op import Operator


def gradient_text(op: Operator) -> str:
    status = op.gradient_status
    fixed = [i.name for i in op.inputs if not i.differentiable]
    if status.registered:
        return "registered" + (f" (non-differentiable: {', '.join(fixed)})" if fixed else "")
    return f"none: {status.reason}"


def kernel_text(op: Operator) -> str:
    if op.lowering_fn is not None:
        return "llvm"
    return "no kernel: reference only" if op.lowering_reason else "missing"


def rows() -> list[tuple[str, str, str, str, str]]:
    out = []
    for op in registry.all_ops():
        inputs = ", ".join(i.name + ("" if i.kind == "float" else ":int") + ("..." if i.variadic else "")
                           for i in op.inputs)
        attrs = ", ".join(a.name for a in op.attrs) or "-"
        out.append((op.name, inputs, attrs, gradient_text(op), kernel_text(op)))
    return out


def format_table(table: Sequence[tuple[str, ...]], header: tuple[str, ...]) -> str:
    widths = [max(len(r[i]) for r in [header, *table]) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(tuple("-" * w for w in widths)), *(line(r) for r in table)])


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table (for the docs)")


def run(args: argparse.Namespace) -> int:
    header = ("op", "inputs", "attributes", "gradient", "kernel")
    table = rows()
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for r in table:
            print("| " + " | ".join(f"`{r[0]}`" if i == 0 else c for i, c in enumerate(r)) + " |")
    else:
        print(format_table(table, header))
        print(f"\n{len(table)} operators; gradients registered for "
              f"{sum(1 for o in registry.all_ops() if o.gradient_status.registered)}")
        builders = registry.all_composites()
        if builders:
            print("composites (built of the operators above): "
                  + ", ".join(f"{c.name} ({', '.join(c.uses)})" for c in builders))
    return 0
