"""Shape-only nodes: Flatten, Reshape, Transpose, Squeeze, Unsqueeze, Concat, Split, Slice, Pad,
ReduceMean/Sum/Max, plus Constant and Shape, whose values are known when the file is read.

``Shape`` of data gives the batch size as :data:`~opgrad.onnx.table.BATCH`; the shape
arithmetic exporters write around a reshape (``Gather``, ``Unsqueeze``, ``Concat``, ``Slice``)
passes it through (:func:`fold_batch_shape`), so ``Reshape(x, [N, -1])`` stays a per-example reshape.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from opgrad.nn.layers import Concatenate, Flatten, SymbolicTensor
from opgrad.nn.ops_layers import Pad, Reduce, Slice
from opgrad.nn.reshaping import Permute, Reshape
from opgrad.onnx.table import BATCH, BATCH_ARITHMETIC, NodeContext, OnnxError, StaticValue, Value, converter

__all__ = ["INT_MAX", "fold_batch_shape"]

#: Exporters write "to the end" as the largest int64.
INT_MAX = 2**63 - 1


def _reshaped(ctx: NodeContext, x: SymbolicTensor, shape: Sequence[int]) -> Value:
    if tuple(shape) == x.shape:
        return x
    if not shape:
        raise ctx.error("the result has the batch axis alone; supported: at least one axis per example")
    return ctx.layer(ctx.new(Reshape, shape), x)


# ----- constants and shapes -----


@converter("Constant", since=1, attributes=("value", "value_float", "value_floats", "value_int", "value_ints"))
def constant(ctx: NodeContext) -> list[Value]:
    import onnx

    attributes = ctx.attributes
    if "value" in attributes:
        tensor = attributes["value"]
        count = math.prod(int(d) for d in tensor.dims) if len(tensor.dims) else 1
        if count > 1 << 28:
            raise ctx.error(f"the constant declares shape {list(tensor.dims)}; supported: at most {1 << 28:,} elements")
        try:
            array = onnx.numpy_helper.to_array(tensor)
        except Exception as exc:
            raise ctx.error(f"the constant cannot be read: {exc}") from None
    elif "value_float" in attributes:
        array = np.array(attributes["value_float"], dtype=np.float32)
    elif "value_floats" in attributes:
        array = np.array(attributes["value_floats"], dtype=np.float32)
    elif "value_int" in attributes:
        array = np.array(attributes["value_int"], dtype=np.int64)
    elif "value_ints" in attributes:
        array = np.array(attributes["value_ints"], dtype=np.int64)
    else:
        raise ctx.error("no value attribute; supported: value, value_float(s), value_int(s)")
    return [StaticValue(np.asarray(array))]


@converter("Shape", since=1, attributes=("end", "start"))
def shape(ctx: NodeContext) -> list[Value]:
    x = ctx.tensor(0, "data")
    full: list[Any] = [BATCH, *x.shape]
    start, end = ctx.attr("start", 0), ctx.attr("end")
    part = full[int(start): None if end is None else int(end)]
    if BATCH in part:
        return [StaticValue(np.array(part, dtype=object))]
    return [StaticValue(np.array(part, dtype=np.int64))]


def fold_batch_shape(node: Any, attributes: dict[str, Any], inputs: list[np.ndarray | None], opset: int,
                     where: str) -> list[np.ndarray]:
    """Shape arithmetic on values holding the batch size: moved around, never computed with."""
    op = node.op_type
    data = inputs[0]
    assert data is not None

    def ints(index: int, attribute: str) -> list[int]:
        source = inputs[index] if len(inputs) > index and inputs[index] is not None else None
        if source is not None:
            return [int(v) for v in source.ravel()]
        return [int(v) for v in attributes.get(attribute, [])]

    if op in ("Identity", "Cast"):
        return [data]
    if op == "Gather":
        indices = inputs[1]
        assert indices is not None
        return [np.take(data, indices.astype(np.int64), axis=int(attributes.get("axis", 0)))]
    if op == "Unsqueeze":
        out = data
        axes = ints(1, "axes")
        for axis in sorted(a % (data.ndim + len(axes)) for a in axes):
            out = np.expand_dims(out, axis)
        return [out]
    if op == "Squeeze":
        axes = ints(1, "axes")
        return [np.squeeze(data, axis=tuple(axes)) if axes else np.squeeze(data)]
    if op == "Concat":
        parts = [a for a in inputs if a is not None]
        return [np.concatenate([a.astype(object) for a in parts], axis=int(attributes.get("axis", 0)))]
    if op == "Slice":
        starts, ends = ints(1, "starts"), ints(2, "ends")
        axes = ints(3, "axes") or list(range(len(starts)))
        steps = ints(4, "steps") or [1] * len(starts)
        index: list[slice] = [slice(None)] * data.ndim
        for s, e, a, st in zip(starts, ends, axes, steps):
            index[a] = slice(s, e, st)
        return [data[tuple(index)]]
    raise OnnxError(f"{where}: {BATCH_ARITHMETIC}")


# ----- reshaping -----


@converter("Reshape", since=5, attributes=("allowzero",))
def reshape(ctx: NodeContext) -> list[Value]:
    x = ctx.tensor(0, "data")
    target = ctx.static(1, "shape")
    entries: list[Any] = [v if v is BATCH else int(v) for v in target.array.ravel()]
    allowzero = int(ctx.attr("allowzero", 0))
    if not entries:
        raise ctx.error("shape is empty; supported: a shape with the batch axis first")
    first, rest = entries[0], entries[1:]
    full = (BATCH, *x.shape)
    resolved = []
    for axis, entry in enumerate(rest, start=1):
        if entry is BATCH:
            raise ctx.error(f"shape {entries} moves the batch size to axis {axis}; supported: the batch axis first")
        entry = int(entry)
        if entry == 0 and not allowzero:
            if axis >= len(full):
                raise ctx.error(f"shape {entries} copies axis {axis}, which the data (rank {len(full)}) lacks")
            entry = full[axis]
        resolved.append(entry)
    size = math.prod(x.shape)
    if -1 in resolved and first is not BATCH and int(first) == -1:
        raise ctx.error(f"shape {entries} has two -1 entries")
    batch_ok = first is BATCH or (int(first) == 0 and not allowzero) or (ctx.batch is not None
                                                                          and int(first) == ctx.batch)
    if not batch_ok and int(first) == -1:
        batch_ok = math.prod(resolved) == size
    if not batch_ok:
        raise ctx.error(f"shape {entries} changes the batch axis (data is (N, {', '.join(map(str, x.shape))})); "
                        "supported: shape[0] = 0, -1 (with the rest keeping each example's size) or the batch size")
    if -1 in resolved:
        known = math.prod(d for d in resolved if d != -1)
        if known <= 0 or size % known:
            raise ctx.error(f"shape {entries} does not fit (N, {', '.join(map(str, x.shape))})")
        resolved = [size // known if d == -1 else d for d in resolved]
    if math.prod(resolved) != size or min(resolved, default=1) < 1:
        raise ctx.error(f"shape {entries} does not fit (N, {', '.join(map(str, x.shape))})")
    return [_reshaped(ctx, x, resolved)]


@converter("Flatten", since=1, attributes=("axis",))
def flatten(ctx: NodeContext) -> list[Value]:
    x = ctx.tensor(0, "input")
    rank = len(x.shape) + 1
    axis = int(ctx.attr("axis", 1))
    if not -rank <= axis <= rank:
        raise ctx.error(f"attribute axis={axis} is out of range for a rank-{rank} input")
    axis = axis % (rank + 1) if axis < 0 else axis
    outer = math.prod(x.shape[: max(axis - 1, 0)])
    if axis == 0 or outer != 1:
        raise ctx.unsupported("axis", ctx.attr("axis", 1), "1, or an axis that keeps the batch axis alone first")
    if len(x.shape) == 1:
        return [x]
    if axis == 1:
        return [ctx.layer(ctx.new(Flatten), x)]
    return [_reshaped(ctx, x, (math.prod(x.shape),))]


@converter("Transpose", since=1, attributes=("perm",))
def transpose(ctx: NodeContext) -> list[Value]:
    x = ctx.tensor(0, "data")
    rank = len(x.shape) + 1
    perm = ctx.ints("perm", tuple(reversed(range(rank))))
    if sorted(perm) != list(range(rank)):
        raise ctx.unsupported("perm", list(perm), f"a permutation of 0..{rank - 1}")
    if perm[0] != 0:
        raise ctx.unsupported("perm", list(perm), "permutations that keep the batch axis first (perm[0] = 0)")
    axes = [p - 1 for p in perm[1:]]
    if axes == sorted(axes):
        return [x]
    return [ctx.layer(ctx.new(Permute, [a + 1 for a in axes]), x)]


def _axes(ctx: NodeContext, index: int, attribute: str) -> list[int]:
    if ctx.opset >= 13:
        return ctx.static_ints(index, "axes") if ctx.has_input(index) else []
    return list(ctx.ints(attribute, ()))


@converter("Unsqueeze", since=1, attributes=("axes",))
def unsqueeze(ctx: NodeContext) -> list[Value]:
    x = ctx.tensor(0, "data")
    axes = _axes(ctx, 1, "axes")
    rank = len(x.shape) + 1 + len(axes)
    normalized = sorted(ctx.example_axis(a, rank, "axes") + 1 for a in axes)
    out: list[int] = list(x.shape)
    for axis in normalized:
        out.insert(axis - 1, 1)
    return [_reshaped(ctx, x, out)]


@converter("Squeeze", since=1, attributes=("axes",))
def squeeze(ctx: NodeContext) -> list[Value]:
    x = ctx.tensor(0, "data")
    rank = len(x.shape) + 1
    axes = _axes(ctx, 1, "axes")
    if not axes:
        raise ctx.error("no axes given; supported: explicit axes (the batch size is not known to be 1 or not)")
    drop = {ctx.example_axis(a, rank, "axes") for a in axes}
    if any(x.shape[a] != 1 for a in drop):
        raise ctx.error(f"axes {axes} of (N, {', '.join(map(str, x.shape))}) are not all of size 1")
    return [_reshaped(ctx, x, [d for i, d in enumerate(x.shape) if i not in drop])]


# ----- joining and splitting -----


@converter("Concat", since=4, attributes=("axis",))
def concat(ctx: NodeContext) -> list[Value]:
    tensors = [ctx.tensor(i, f"inputs[{i}]") for i in range(ctx.input_count)]
    rank = len(tensors[0].shape) + 1
    axis = ctx.example_axis(int(ctx.attr("axis", 0)), rank) + 1
    if len(tensors) == 1:
        return [tensors[0]]
    return [ctx.layer(ctx.new(Concatenate, axis), tensors)]


def _slice_layer(ctx: NodeContext, x: SymbolicTensor, axis: int, start: int | None, stop: int | None,
                 step: int = 1) -> SymbolicTensor:
    """``x[..., start:stop:step, ...]`` along per-example ``axis``."""
    begin: list[int | None] = [*([None] * axis), start]
    end: list[int | None] = [*([None] * axis), stop]
    return ctx.layer(ctx.new(Slice, begin, end, [1] * axis + [step]), x)


@converter("Split", since=2, attributes=("axis", "num_outputs", "split"))
def split(ctx: NodeContext) -> list[Value]:
    x = ctx.tensor(0, "input")
    rank = len(x.shape) + 1
    axis = ctx.example_axis(int(ctx.attr("axis", 0)), rank)
    extent = x.shape[axis]
    outputs = len(ctx.node.output)
    if ctx.opset >= 13 and ctx.has_input(1):
        sizes = ctx.static_ints(1, "split")
    elif ctx.attr("split") is not None:
        sizes = list(ctx.ints("split", ()))
    else:
        count = int(ctx.attr("num_outputs", outputs))
        chunk = -(-extent // count)
        sizes = [min(chunk, extent - i * chunk) for i in range(count)]
    if len(sizes) != outputs or min(sizes) < 1 or sum(sizes) != extent:
        raise ctx.error(f"split sizes {sizes} do not divide axis {axis + 1} of size {extent} into {outputs} outputs")
    out: list[Value] = []
    start = 0
    for size in sizes:
        out.append(_slice_layer(ctx, x, axis, start, start + size))
        start += size
    return out


@converter("Slice", since=10)
def slice_(ctx: NodeContext) -> list[Value]:
    x = ctx.tensor(0, "data")
    rank = len(x.shape) + 1
    starts, ends = ctx.static_ints(1, "starts"), ctx.static_ints(2, "ends")
    axes = ctx.static_ints(3, "axes") if ctx.has_input(3) else list(range(len(starts)))
    steps = ctx.static_ints(4, "steps") if ctx.has_input(4) else [1] * len(starts)
    if not len(starts) == len(ends) == len(axes) == len(steps):
        raise ctx.error(f"starts {starts}, ends {ends}, axes {axes} and steps {steps} differ in length")
    begin: list[int | None] = [None] * len(x.shape)
    end: list[int | None] = [None] * len(x.shape)
    stride = [1] * len(x.shape)
    for start, stop, axis, step in zip(starts, ends, axes, steps):
        if step == 0:
            raise ctx.error("a step is 0")
        if not -rank <= axis < rank:
            raise ctx.error(f"axis {axis} is out of range for a rank-{rank} input")
        if axis % rank == 0:
            if (start, step) != (0, 1) or stop < INT_MAX // 2:
                raise ctx.error(f"slices the batch axis ({start}:{stop}:{step}); supported: the whole batch axis")
            continue
        a = axis % rank - 1
        extent = x.shape[a]
        # ONNX clamps each bound into the axis (numpy does too, but reads -1 as "the last" for a stop).
        lo, hi = (0, extent) if step > 0 else (0, extent - 1)
        first = min(max(start + extent if start < 0 else start, lo), hi)
        last = min(max(stop + extent if stop < 0 else stop, lo if step > 0 else -1), hi if step < 0 else extent)
        begin[a], end[a], stride[a] = first, (None if last < 0 else last), step
    used = max((i + 1 for i in range(len(begin)) if begin[i] is not None), default=0)
    if used == 0:
        return [x]
    return [ctx.layer(ctx.new(Slice, begin[:used], end[:used], stride[:used]), x)]


@converter("Pad", since=11, attributes=("mode",))
def pad(ctx: NodeContext) -> list[Value]:
    x = ctx.tensor(0, "data")
    rank = len(x.shape) + 1
    mode = ctx.attr("mode", "constant")
    if mode not in ("constant", "reflect", "edge"):
        raise ctx.unsupported("mode", mode, "constant, reflect, edge")
    pads = ctx.static_ints(1, "pads")
    axes = ctx.static_ints(3, "axes") if ctx.has_input(3) else list(range(rank))
    if len(pads) != 2 * len(axes):
        raise ctx.error(f"pads {pads} needs two entries per padded axis ({len(axes)})")
    value = float(ctx.static_floats(2, "constant_value").reshape(())) if ctx.has_input(2) else 0.0
    widths = [(0, 0)] * len(x.shape)
    for i, axis in enumerate(axes):
        before, after = pads[i], pads[i + len(axes)]
        if min(before, after) < 0:
            raise ctx.error(f"pads {pads} crop (negative); supported: pads >= 0 (use Slice to crop)")
        if axis % rank == 0:
            if (before, after) != (0, 0):
                raise ctx.error(f"pads {pads} pad the batch axis; supported: 0 on the batch axis")
            continue
        widths[axis % rank - 1] = (before, after)
    if all(w == (0, 0) for w in widths):
        return [x]
    return [ctx.layer(ctx.new(Pad, widths, mode=mode, value=value), x)]


# ----- reductions -----


def _reduce(ctx: NodeContext, op: str, axes_input: bool) -> list[Value]:
    x = ctx.tensor(0, "data")
    rank = len(x.shape) + 1
    if axes_input:
        axes = ctx.static_ints(1, "axes") if ctx.has_input(1) else []
    else:
        axes = list(ctx.ints("axes", ()))
    if not axes:
        if int(ctx.attr("noop_with_empty_axes", 0)):
            return [x]
        raise ctx.error("reduces every axis, the batch axis included; supported: axes without the batch axis")
    per_example = [ctx.example_axis(a, rank, "axes") + 1 for a in axes]
    layer = ctx.new(Reduce, op, per_example, keepdims=bool(int(ctx.attr("keepdims", 1))))
    return [ctx.layer(layer, x)]


def _reducer(op: str, axes_input: bool) -> Callable[[NodeContext], list[Value]]:
    def convert(ctx: NodeContext) -> list[Value]:
        return _reduce(ctx, op, axes_input)

    return convert


for _op_type, _op, _since in (("ReduceMean", "mean", 18), ("ReduceSum", "sum", 13), ("ReduceMax", "max", 18)):
    converter(_op_type, since=1, attributes=("axes", "keepdims"))(_reducer(_op, False))
    converter(_op_type, since=_since, attributes=("keepdims", "noop_with_empty_axes"))(_reducer(_op, True))
