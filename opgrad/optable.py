"""``opgrad ops``: a table of every registered operator, straight from the declarations."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from opgrad import registry
from opgrad.checks.command import add_import_option, import_user_modules
from opgrad.errors import RegistryError
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

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()

    return "\n".join([line(header), line(tuple("-" * w for w in widths)), *(line(r) for r in table)])


# ----- NNVM's operators without a gradient -----

#: The operators NNVM registered without a gradient (34 names), and how opgrad answers each:
#: ("op"/"composite", names) resolved against the registry at run time, or an explanation.
NNVM_NO_GRADIENT: dict[str, tuple[str, tuple[str, ...], str]] = {
    "__add_symbol__": ("python", ("add",), "python operator: a + b → add"),
    "__sub_symbol__": ("python", ("subtract",), "python operator: a - b → subtract"),
    "__mul_symbol__": ("python", ("multiply",), "python operator: a * b → multiply"),
    "__div_symbol__": ("python", ("divide",), "python operator: a / b → divide"),
    "__layout_transform__": ("op", ("layout_transform",), ""),
    "__undef__": ("internal", (), "NNVM internal: the placeholder of an undefined node; no user-level meaning"),
    "tvm_op": ("internal", (), "NNVM internal: a node holding an already compiled TVM kernel (after fusion); "
                               "no user-level meaning"),
    "_contrib_conv2d_NCHWc": ("op", ("conv2d_nchwc",), "layout_transform + conv2d + layout_transform"),
    "_conv2d_grad": ("op", ("conv2d_backward_input", "conv2d_backward_weight"), "conv2d's gradient ops"),
    "_max_pool2d_grad": ("op", ("max_pool2d_backward",), "max_pool2d's gradient op"),
    "broadcast_add": ("op", ("add",), "numpy broadcasting"),
    "broadcast_sub": ("op", ("subtract",), "numpy broadcasting"),
    "broadcast_mul": ("op", ("multiply",), "numpy broadcasting"),
    "broadcast_div": ("op", ("divide",), "numpy broadcasting"),
    **{name: ("op", (name,), "") for name in (
        "avg_pool2d", "batch_norm", "broadcast_to", "cast", "concatenate", "conv2d_transpose", "dropout", "flip",
        "full", "global_avg_pool2d", "global_max_pool2d", "multibox_transform_loc", "nms", "ones", "pad", "prelu",
        "resize", "split", "upsampling", "yolo2_reorg")},
}


def _resolve(name: str) -> tuple[str, Operator | None]:
    """("op"|"composite"|"planned", the operator if one) for an opgrad name."""
    try:
        return "op", registry.get(name)
    except RegistryError:
        pass
    if registry.get_composite(name) is not None:
        return "composite", None
    return "planned", None


def nnvm_rows() -> list[tuple[str, str, str]]:
    """(NNVM op, opgrad's answer, gradient) for each of NNVM_NO_GRADIENT, checked against the registry."""
    out = []
    for nnvm, (kind, names, note) in sorted(NNVM_NO_GRADIENT.items()):
        if kind == "internal":
            out.append((nnvm, note, "-"))
            continue
        answers, grads = [], []
        for name in names:
            what, op = _resolve(name)
            if what == "planned":
                answers.append(f"planned: {name}")
                grads.append("-")
            elif what == "composite":
                composite = registry.get_composite(name)
                assert composite is not None  # _resolve found it
                uses = composite.uses
                answers.append(f"composite {name} ({', '.join(uses)})")
                grads.append("through its ops")
            else:
                assert op is not None
                answers.append(note if kind == "python" else f"op {name}")
                grads.append("registered" if op.gradient_status.registered else f"none: {op.gradient_status.reason}")
        if kind != "python" and note and all(not a.startswith("planned") for a in answers):
            answers[-1] += f" ({note})"
        out.append((nnvm, "; ".join(answers), "; ".join(dict.fromkeys(grads))))
    return out


# ----- the coverage matrix -----

MATRIX_HEADER = ("op", "forward", "gradient", "second order", "lowering", "sampler", "mutants", "last check")


def _example_call(op: Operator) -> Any:
    """A call the checker would generate (the first, derandomized), or None."""
    from hypothesis import HealthCheck, Phase, find, settings

    from opgrad.checks.strategies import op_cases
    from opgrad.ir import var

    try:
        case = find(op_cases(op), lambda c: True,
                    settings=settings(database=None, max_examples=50, derandomize=True, phases=[Phase.generate],
                                      suppress_health_check=list(HealthCheck)))
    except Exception:
        return None
    params = [var(spec.name, shape, "float64" if spec.kind == "float" else "int64")
              for spec, shape in zip(op.specs(len(case.shapes)), case.shapes)]
    return op(*params, **case.attrs)


def second_order_text(op: Operator) -> str:
    """Whether every op the gradient rule emits can itself be differentiated."""
    if op.gradient_rule is None:
        return "-"
    from opgrad.ir import Call, topological_order, var

    call = _example_call(op)
    if call is None:
        return "unknown: no example case"
    grad = var("cotangent", call.shape, call.dtype)
    built = [g for g in op.gradient_rule(call, grad) if g is not None]
    before = {n._uid for n in topological_order([call])}
    used = {n.op for n in topological_order(built) if isinstance(n, Call) and n._uid not in before}
    stuck = sorted(o.name for o in used if o.gradient_rule is None and any(i.differentiable for i in o.inputs))
    return "yes" if not stuck else f"no: {', '.join(stuck)} has no gradient"


def _mutant_counts() -> dict[str, int]:
    from opgrad.checks.mutants import MUTANTS

    counts: dict[str, int] = {}
    for m in MUTANTS:
        counts[m.op] = counts.get(m.op, 0) + 1
    return counts


def matrix_rows() -> list[tuple[str, ...]]:
    """One row per operator: forward, gradient, second order, lowering, sampler, mutants, last check."""
    from opgrad.checks import results

    recorded = results.load()
    mutants = _mutant_counts()
    out: list[tuple[str, ...]] = []
    for op in registry.all_ops():
        differentiable = any(i.differentiable for i in op.inputs)
        status = op.gradient_status
        gradient = "yes" if status.registered else ("n/a" if not differentiable else "none")
        lowering = "llvm" if op.lowering_fn is not None else ("reference only" if op.lowering_reason else "missing")
        sampler = "own" if op.sampler_fn is not None else "derived"
        count = mutants.get(op.name, 0)
        out.append((op.name, "numpy", gradient, second_order_text(op), lowering, sampler,
                    str(count) if differentiable and status.registered else "-", results.summary(op.name, recorded)))
    return out


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table (for the docs)")
    tables = parser.add_mutually_exclusive_group()  # each prints a table of its own
    tables.add_argument("--nnvm", action="store_true",
                        help="NNVM's 34 operators without a gradient, and how opgrad answers each")
    tables.add_argument("--matrix", action="store_true",
                        help="per operator: forward, gradient, second order, lowering, sampler, mutants, last check")
    add_import_option(parser)


def markdown_table(table: Sequence[tuple[str, ...]], header: tuple[str, ...]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(f"`{r[0]}`" if i == 0 else c for i, c in enumerate(r)) + " |" for r in table]
    return "\n".join(lines)


NNVM_HEADER = ("NNVM op", "opgrad", "gradient")


def run(args: argparse.Namespace) -> int:
    import_user_modules(args.imports)
    if args.nnvm or args.matrix:
        chosen: tuple[str, ...] = NNVM_HEADER if args.nnvm else MATRIX_HEADER
        special: Sequence[tuple[str, ...]] = nnvm_rows() if args.nnvm else matrix_rows()
        print(markdown_table(special, chosen) if args.markdown else format_table(special, chosen))
        return 0
    header = ("op", "inputs", "attributes", "gradient", "kernel")
    table = rows()
    if args.markdown:
        print(markdown_table(table, header))
    else:
        print(format_table(table, header))
        print(f"\n{len(table)} operators; gradients registered for "
              f"{sum(1 for o in registry.all_ops() if o.gradient_status.registered)}")
        builders = registry.all_composites()
        if builders:
            print("composites (built of the operators above): "
                  + ", ".join(f"{c.name} ({', '.join(c.uses)})" for c in builders))
    return 0
