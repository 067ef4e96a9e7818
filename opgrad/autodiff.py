"""Reverse-mode automatic differentiation through the registered gradients.

The result of differentiation is ordinary IR built from registered operators, so it can be
printed, evaluated, compiled, and differentiated again (second order).

Two jobs are done here, centrally, so that no gradient rule can get them wrong:
* un-broadcasting: a rule may return a gradient with the output's broadcast shape; it is summed
  back to the input's shape with ``collapse_sum_like``;
* fan-out: when an expression feeds several calls, the gradients are accumulated with ``add``.
Each rule's result is then checked against its input's type, naming the rule if it is off.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import numpy as np

from opgrad import ops
from opgrad.dtypes import collapses_to
from opgrad.errors import GradientError
from opgrad.ir import Call, Const, Expr, Function, Var, topological_order, var
from opgrad.registry.strided_slice import resolved_slices


def _describe(call: Call) -> str:
    args = ", ".join(str(a.type) for a in call.args)
    attrs = "".join(f", {k}={v!r}" for k, v in call.attrs.items())
    return f"{call.op.name}({args}{attrs}) -> {call.type}"


def fit_to_input(call: Call, index: int, grad: Expr) -> Expr:
    """Sum a broadcast-shaped gradient back to the input's shape and check its type."""
    target = call.args[index]
    spec = call.specs[index]
    if not isinstance(grad, Expr):
        raise GradientError(
            f"gradient of {call.op.name!r} returned {grad!r} for input {spec.name!r}; "
            "expected an opgrad expression or None"
        )
    if grad.shape != target.shape:
        if not collapses_to(grad.shape, target.shape):
            raise GradientError(
                f"gradient of {call.op.name!r} for input {spec.name!r} has shape {grad.shape}, "
                f"which cannot be summed to the input's shape {target.shape} (call: {_describe(call)})"
            )
        grad = ops.collapse_sum_like(grad, target)
    if grad.dtype != target.dtype:
        raise GradientError(
            f"gradient of {call.op.name!r} for input {spec.name!r} has dtype {grad.dtype}, "
            f"expected {target.dtype} (call: {_describe(call)})"
        )
    return grad


def gradient_entries(call: Call, result: object) -> list[Expr | None]:
    """A gradient rule's ``result`` for ``call`` as a list with one entry per input, or a
    ``GradientError`` naming the op when it is something else (a bare expression, a wrong count)."""
    inputs = ", ".join(spec.name for spec in call.specs)
    expected = (f"a gradient rule must return a list with one entry (an expression or None) per input, "
                f"{len(call.args)} here ({inputs})")
    if isinstance(result, Expr):
        wrap = " (wrap it: return [expr])" if len(call.args) == 1 else ""
        raise GradientError(f"gradient of {call.op.name!r} returned the expression {result!r} instead of a "
                            f"list; {expected}{wrap}")
    if not isinstance(result, Iterable):
        raise GradientError(f"gradient of {call.op.name!r} returned {result!r} instead of a list; {expected}")
    entries = list(result)
    if len(entries) != len(call.args):
        raise GradientError(
            f"gradient of {call.op.name!r} returned {len(entries)} entries for {len(call.args)} inputs; {expected}"
        )
    return entries


def _depends_on(outputs: Sequence[Expr], wrt: Sequence[Expr]) -> set[int]:
    """Ids of the nodes whose value depends on any of ``wrt`` (only these carry gradients)."""
    active = {w._uid for w in wrt}
    for node in topological_order(outputs):
        if isinstance(node, Call) and any(a._uid in active for a in node.args):
            active.add(node._uid)
    return active


def _slice_block(part: Expr) -> tuple[tuple[int, ...], int, int, int] | None:
    """``(input_shape, axis, start, stop)`` where ``part`` writes a gradient into one contiguous
    block of zeros along one axis, whole along the others (the gradient of a gate, a head or one
    of q, k, v cut from a tensor); None for anything else."""
    if not (isinstance(part, Call) and part.op.name == "strided_slice_backward"):
        return None
    shape = tuple(part.attrs["input_shape"])
    cut = [(axis, start, step, length) for axis, (start, step, length) in enumerate(resolved_slices(shape, part.attrs))
           if (start, step, length) != (0, 1, shape[axis])]
    if len(cut) != 1 or cut[0][2] != 1:
        return None
    axis, start, _, length = cut[0]
    return shape, axis, start, start + length


def accumulate(parts: Sequence[Expr]) -> Expr:
    """The sum of a node's gradient contributions, in order. Contributions that write disjoint
    blocks of one axis into zeros (:func:`_slice_block`) are joined by one ``concatenate``, zeros
    between them, rather than added as whole tensors of zeros: the gradient of a tensor cut into
    gates or heads is one copy, not a zero-fill and an add per part. The values are the sum's."""
    blocks = [(_slice_block(part), part) for part in parts]
    groups: dict[tuple[tuple[int, ...], int, str], list[tuple[int, int, Expr]]] = {}
    for block, part in blocks:
        if block is not None:
            shape, axis, start, stop = block
            groups.setdefault((shape, axis, part.dtype), []).append((start, stop, part))
    joined: dict[int, Expr] = {}  # the first part of each joined group -> the concatenate
    for (shape, axis, dtype), members in groups.items():
        ordered = sorted(members, key=lambda member: member[0])
        if len(ordered) < 2 or any(a[1] > b[0] for a, b in itertools.pairwise(ordered)):
            continue  # one block, or overlapping ones: added as they are
        pieces: list[Expr] = []
        at = 0
        for start, stop, part in ordered:
            if start > at:
                pieces.append(ops.zeros(shape=(*shape[:axis], start - at, *shape[axis + 1:]), dtype=dtype))
            assert isinstance(part, Call)
            pieces.append(part.args[0])
            at = stop
        if at < shape[axis]:
            pieces.append(ops.zeros(shape=(*shape[:axis], shape[axis] - at, *shape[axis + 1:]), dtype=dtype))
        joined[members[0][2]._uid] = ops.concatenate(pieces, axis=axis)
        for _, _, part in members[1:]:
            joined[part._uid] = None  # type: ignore[assignment]  # folded into the first
    total: Expr | None = None
    for part in parts:
        term = joined.get(part._uid, part)
        if term is None:
            continue
        total = term if total is None else ops.add(total, term)
    assert total is not None
    return total


def gradients(output: Expr, wrt: Sequence[Expr], cotangent: Expr | None = None) -> list[Expr]:
    """Vector-Jacobian products of ``output`` with respect to each of ``wrt``.

    ``cotangent`` defaults to ones (so a scalar output gives its gradient). Expressions in
    ``wrt`` that ``output`` does not depend on get ``zeros_like``.
    """
    if cotangent is None:
        cotangent = ops.ones_like(output)
    elif cotangent.type != output.type:
        raise GradientError(f"cotangent has type {cotangent.type}, expected the output's type {output.type}")
    active = _depends_on([output], wrt)
    pending: dict[int, list[Expr]] = {output._uid: [cotangent]}
    totals: dict[int, Expr] = {}
    for node in reversed(topological_order([output])):
        parts = pending.pop(node._uid, None)
        if parts is None or node._uid not in active:
            continue
        total = accumulate(parts)
        totals[node._uid] = total
        if not isinstance(node, Call):
            continue
        needs = [
            spec.differentiable and arg._uid in active for spec, arg in zip(node.specs, node.args)
        ]
        if not any(needs):
            continue
        rule = node.op.gradient_rule
        if rule is None:
            status = node.op.gradient_status
            raise GradientError(
                f"cannot differentiate through {node.op.name!r}: its gradient is not implemented "
                f"({status.reason}); call: {_describe(node)}"
            )
        grads = gradient_entries(node, rule(node, total))
        for index, (need, grad) in enumerate(zip(needs, grads)):
            if not need:
                continue
            if grad is None:
                raise GradientError(
                    f"gradient of {node.op.name!r} returned None for differentiable input "
                    f"{node.specs[index].name!r} (call: {_describe(node)})"
                )
            fitted = fit_to_input(node, index, grad)
            pending.setdefault(node.args[index]._uid, []).append(fitted)
    results = []
    for w in wrt:
        found = totals.get(w._uid)
        results.append(found if found is not None else ops.zeros_like(w))
    return results


def resolve_wrt(fn: Function, wrt: Sequence[int | str | Var] | int | str | Var | None) -> list[Var]:
    """The parameters ``wrt`` selects (positions, names or the Vars themselves; None: every float one)."""
    if wrt is None:
        return [p for p in fn.params if p.type.is_float]
    items = wrt if isinstance(wrt, (list, tuple)) else [wrt]
    names = [p.name for p in fn.params]
    chosen: list[Var] = []
    for item in items:
        if isinstance(item, Var):
            if item not in fn.params:
                raise ValueError(f"wrt variable {item.name!r} is not a parameter of the function")
            chosen.append(item)
        elif isinstance(item, (int, np.integer)) and not isinstance(item, (bool, np.bool_)):
            if not -len(fn.params) <= int(item) < len(fn.params):
                raise ValueError(f"wrt position {int(item)} is out of range: the function has {len(fn.params)} "
                                 f"parameter(s) {names}")
            chosen.append(fn.params[int(item)])
        elif isinstance(item, str):
            match = [p for p in fn.params if p.name == item]
            if not match:
                raise ValueError(f"no parameter named {item!r}; parameters: {names}")
            chosen.append(match[0])
        else:
            raise TypeError(f"wrt entries are parameter positions (int), names (str) or Vars, got {item!r}")
    for v in chosen:
        if not v.type.is_float:
            raise ValueError(f"cannot differentiate with respect to {v.name!r} of dtype {v.dtype}")
    return chosen


def chosen_parameters(fn: Function, wrt: Sequence[int | str | Var] | int | str | Var | None, what: str) -> list[Var]:
    """:func:`resolve_wrt` for a derivative that needs at least one parameter (``what`` names it)."""
    targets = resolve_wrt(fn, wrt)
    if not targets:
        names = [p.name for p in fn.params]
        raise ValueError(f"opgrad.{what}: wrt selects no parameter to differentiate by; choose one or more of "
                         f"{names} (a float one)")
    return targets


def fresh_names(fn: Function, prefix: str, targets: Sequence[Var]) -> list[str]:
    """``prefix + name`` for each of ``targets``, with underscores added where a parameter of
    ``fn`` already has that name (a parameter named ``v_w`` beside ``w``)."""
    taken = {p.name for p in fn.params}
    names = []
    for t in targets:
        name = prefix + t.name
        while name in taken:
            name = "_" + name
        taken.add(name)
        names.append(name)
    return names


def _require_function(fn: object, what: str) -> None:
    """A clear error where an expression (or anything else) is passed where a Function belongs."""
    if not isinstance(fn, Function):
        hint = (" (an expression: wrap it as opgrad.function([params...], expr), or call "
                "opgrad.gradients(expr, [vars]) for its gradient expressions)") if isinstance(fn, Expr) else ""
        raise TypeError(f"opgrad.{what} takes an opgrad.Function, got {type(fn).__name__}{hint}")


def _require_scalar_float(fn: Function, what: str) -> None:
    """Raise unless ``fn`` returns one float scalar, the only output ``opgrad.<what>`` differentiates."""
    _require_function(fn, what)
    if fn.returns_tuple or fn.outputs[0].shape != ():
        shapes = ", ".join(str(o.type) for o in fn.outputs)
        raise GradientError(
            f"opgrad.{what} needs a function returning one scalar, got ({shapes}); reduce it first "
            "(e.g. opgrad.ops.sum), or use opgrad.jvp or opgrad.gradients with a cotangent"
        )
    if not fn.outputs[0].type.is_float:
        raise GradientError(f"opgrad.{what}: the output is {fn.outputs[0].type}; only a float output has a "
                            "derivative")


def grad(fn: Function, wrt: Sequence[int | str | Var] | int | str | Var | None = None, *,
         with_value: bool = True) -> Function:
    """A function of the same parameters returning ``(value, grad_1, ..., grad_k)``.

    ``fn`` must return one scalar. ``wrt`` selects parameters by position, name or variable;
    it defaults to every float parameter (integer parameters such as labels are skipped).
    ``with_value=False`` returns the gradients alone, and a single gradient as a single output
    (JAX's ``grad``), so derivatives nest: for a scalar ``x``,
    ``grad(grad(f, with_value=False), with_value=False)`` is ``f''(x)``.
    """
    _require_scalar_float(fn, "grad")
    targets = chosen_parameters(fn, wrt, "grad")
    value = fn.outputs[0]
    grads = gradients(value, targets)
    if with_value:
        return Function(fn.params, (value, *grads))
    return Function(fn.params, grads[0] if len(grads) == 1 else tuple(grads))


def hvp(fn: Function, wrt: Sequence[int | str | Var] | int | str | Var | None = None) -> Function:
    """Hessian-vector products of a scalar ``fn``: ``f(params..., v_1, ..., v_k) -> (H v)_1, ..., (H v)_k``.

    One ``v_i`` per selected parameter, of its shape; the result is the gradient of
    ``sum_i <grad_i f, v_i>`` with respect to the same parameters (reverse over reverse), built
    from registered gradients only, so it compiles like any other function.
    """
    _require_scalar_float(fn, "hvp")
    targets = chosen_parameters(fn, wrt, "hvp")
    first = grad(fn, wrt, with_value=False)
    vectors = [var(name, t.shape, t.dtype) for name, t in zip(fresh_names(fn, "v_", targets), targets, strict=True)]
    firsts = list(first.outputs)
    total = ops.sum(ops.multiply(firsts[0], vectors[0]))
    for g, v in zip(firsts[1:], vectors[1:]):
        total = ops.add(total, ops.sum(ops.multiply(g, v)))
    second = gradients(total, targets)
    return Function([*fn.params, *vectors], second[0] if len(second) == 1 else tuple(second))


def jvp(fn: Function, wrt: Sequence[int | str | Var] | int | str | Var | None = None) -> Function:
    """Forward-mode derivative of a one-output ``fn``: ``f(params..., t_1, ..., t_k) -> (y, J t)``.

    ``J t = sum_i dy/dparam_i . t_i``, computed by differentiating the (linear) VJP
    ``u -> J^T u`` once more: ``J t = d/du <J^T u, t>``. The output may have any shape.
    """
    _require_function(fn, "jvp")
    if fn.returns_tuple:
        raise GradientError(f"opgrad.jvp needs a function with one output, got {len(fn.outputs)}")
    y = fn.outputs[0]
    if not y.type.is_float:
        raise GradientError(f"opgrad.jvp: the output is {y.type}; only a float output has a derivative")
    targets = chosen_parameters(fn, wrt, "jvp")
    tangents = [var(name, t.shape, t.dtype) for name, t in zip(fresh_names(fn, "t_", targets), targets, strict=True)]
    u = var("jvp_cotangent", y.shape, y.dtype)
    pulled = gradients(y, targets, cotangent=u)
    total = ops.sum(ops.multiply(pulled[0], tangents[0]))
    for g, t in zip(pulled[1:], tangents[1:]):
        total = ops.add(total, ops.sum(ops.multiply(g, t)))
    (jt,) = gradients(total, [u])
    # J t does not depend on u (the VJP is linear in u); any leftover use of u only reads its
    # shape, so u is replaced by zeros and the function takes the parameters and tangents alone.
    jt = substitute(jt, {u._uid: Const(np.zeros(y.shape, y.dtype))})
    return Function([*fn.params, *tangents], (y, jt))


def substitute(expr: Expr, replacements: dict[int, Expr]) -> Expr:
    """``expr`` rebuilt with the nodes whose ids are keys of ``replacements`` swapped for the values."""
    new: dict[int, Expr] = dict(replacements)
    for node in topological_order([expr]):
        if node._uid in new:
            continue
        if isinstance(node, Call) and any(a._uid in new and new[a._uid] is not a for a in node.args):
            new[node._uid] = node.op(*(new.get(a._uid, a) for a in node.args), **node.attrs)
        else:
            new[node._uid] = node
    return new[expr._uid]
