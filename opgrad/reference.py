"""The numpy reference backend: evaluates any function with each operator's declared forward.

It is the ground truth the compiler and the checker compare against, so it stays simple and
checks everything: arguments against parameters, and each reference result against the type
its shape rule promised (a contributor's forward returning the wrong shape is caught here).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from opgrad.errors import ArgumentError, OpgradError
from opgrad.ir import Call, Const, Expr, Function, Var, describe_value, topological_order


def check_arguments(fn: Function, arrays: Sequence[Any], *, who: str = "opgrad.evaluate") -> list[np.ndarray]:
    """Validate ``arrays`` against ``fn.params``: count, shape and dtype (no silent casts)."""
    if len(arrays) != len(fn.params):
        sig = ", ".join(f"{p.name}: {p.type}" for p in fn.params)
        raise ArgumentError(f"{who}: expected {len(fn.params)} argument(s) ({sig}), got {len(arrays)}")
    checked = []
    for param, value in zip(fn.params, arrays):
        if isinstance(value, np.ma.MaskedArray):  # every kernel would read the masked-out values too
            raise ArgumentError(f"{who}: argument {param.name!r} is a masked array, whose mask no operator "
                                f"reads; pass value.filled(...) or np.asarray(value) for its data ({param.type})")
        try:
            # The base ndarray of a subclass: np.matrix's * is a matrix product, and the reference's
            # numpy forwards must see elementwise arrays as every backend does.
            arr = value if type(value) is np.ndarray else np.asarray(value)
        except (ValueError, TypeError) as exc:  # ragged nested lists
            raise ArgumentError(f"{who}: argument {param.name!r} must be a numeric array ({param.type}), got "
                                f"{describe_value(value)} ({exc})") from None
        if arr.dtype.kind not in "biufc":
            raise ArgumentError(f"{who}: argument {param.name!r} must be a numeric array ({param.type}), got "
                                f"{describe_value(value)}")
        if arr.dtype.name != param.dtype:
            raise ArgumentError(
                f"{who}: argument {param.name!r} has dtype {arr.dtype.name}, expected {param.dtype} "
                f"(shape {param.type.shape}); convert it with .astype(np.{param.dtype})"
            )
        if arr.shape != param.type.shape:
            raise ArgumentError(
                f"{who}: argument {param.name!r} has shape {arr.shape}, expected {param.type.shape} "
                f"({param.type})"
            )
        checked.append(arr)
    return checked


def evaluate_exprs(outputs: Sequence[Expr], env: dict[int, np.ndarray]) -> list[np.ndarray]:
    """Evaluate ``outputs`` given values for variables (keyed by node id)."""
    values: dict[int, np.ndarray] = dict(env)
    for node in topological_order(outputs):
        if node._uid in values:
            continue
        if isinstance(node, Const):
            values[node._uid] = node.value
        elif isinstance(node, Var):
            raise OpgradError(f"no value given for variable {node.name!r}")
        elif isinstance(node, Call):
            args = [values[a._uid] for a in node.args]
            result = np.asarray(node.op.reference_fn(*args, **node.attrs))
            if result.shape != node.type.shape:
                raise OpgradError(
                    f"reference forward of {node.op.name!r} returned shape {result.shape}, but its "
                    f"shape rule promised {node.type.shape}; the declaration is inconsistent"
                )
            values[node._uid] = result.astype(node.type.dtype, copy=False)
    return [values[o._uid] for o in outputs]


def evaluate(fn: Function, *arrays: Any) -> np.ndarray | tuple[np.ndarray, ...]:
    """Run ``fn`` with numpy; returns an array, or a tuple for a tuple-returning function."""
    checked = check_arguments(fn, arrays)
    env = {p._uid: a for p, a in zip(fn.params, checked)}
    results = evaluate_exprs(fn.outputs, env)
    # Each output is an array of its own, as the compiled backend returns: not the caller's
    # argument, a graph constant, a view of either (a reshape's) or another output.
    external = [*checked, *(node.value for node in topological_order(fn.outputs) if isinstance(node, Const))]
    owned: list[np.ndarray] = []
    for result in results:
        if any(np.may_share_memory(result, other) for other in (*external, *owned)):
            result = result.copy()
        owned.append(result)
    return tuple(owned) if fn.returns_tuple else owned[0]
