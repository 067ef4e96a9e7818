"""Results computed over the memory of a parameter: an optimizer's update written over the weights.

A training step reads each weight and writes its new value. Written to a result array of its own,
every new weight costs a second copy of the model in memory and, on the way in, a read of that
cold array for ownership of its cache lines (the conv3 weight update of the seed CNN writes
4.7 MB this way). PyTorch's optimizers update in place; so does a step compiled with
``in_place=[(parameter, result), ...]``, where the plan allows it.

A pair is honoured (:func:`update_in_place`) when

* exactly one step writes the result, and it reads the parameter, if at all, only where it
  writes: an elementwise step whose every view of the parameter is laid out as its output, with
  no fused reduction reading the parameter; or a GEMM whose epilogue reads it as C is laid out
  and which stores each element of C once (:func:`.gemm.writes_c_once`);
* that step can run after every other step that reads the parameter (and after ``after``'s
  writer: the loss, which a guarded step checks before any weight changes): it is moved there
  when no step in between reads what it writes or writes what it touches.

The writer then writes the parameter's pointer-table slot, and every later reader of the result
reads that slot too; the result's own slot is not used. Other pairs are left as they are.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace

from .builder import Step
from .gemm import writes_c_once
from .views import View

__all__ = ["update_in_place"]


def update_in_place(steps: list[Step], pairs: Sequence[tuple[int, int]], after: int | None = None) -> list[int]:
    """Make each ``(parameter slot, result slot)`` pair's writer write the parameter's slot where
    the plan allows it (see the module docstring); reorders and edits ``steps``. ``after``: a slot
    whose writer must come before every honoured writer. Returns the indices of the pairs honoured."""
    # Which steps touch each slot, kept up to date as pairs are honoured: a model's pairs (one per
    # weight and optimizer moment) times its steps would otherwise be walked pair by pair.
    index = _SlotIndex(steps)
    position = {id(st): i for i, st in enumerate(steps)}
    honoured = []
    for n, (param, result) in enumerate(pairs):
        writers = list(index.writes[result].values())
        if len(writers) != 1 or index.writes[param]:
            continue
        writer = writers[0]
        w = position[id(writer)]
        if not _reads_where_it_writes(writer, param, result):
            continue
        before = [position[k] for k in index.reads[param] if k != id(writer)]
        if after is not None:
            before += [position[k] for k in index.writes[after] if k != id(writer)]
        if any(position[k] < w for k in (*index.reads[result], *index.calls[result])):
            continue
        last = max(before, default=-1)
        if last > w:
            touched = {*writer.reads, *writer.writes}
            if any(set(st.reads) & set(writer.writes) or set(st.writes) & touched for st in steps[w + 1 : last + 1]):
                continue
            steps.insert(last, steps.pop(w))
            position = {id(st): i for i, st in enumerate(steps)}
        for st in list(index.mentions[result].values()):
            index.forget(st, result)
            _rename(st, result, param)
            index.add(st)
        honoured.append(n)
    return honoured


class _SlotIndex:
    """For each slot, the steps that read it (``reads``), write it, pass it to a call, or touch
    it in any way, a reduction they compute included (``mentions``); keyed by ``id``."""

    def __init__(self, steps: Sequence[Step]) -> None:
        self.reads: defaultdict[int, dict[int, Step]] = defaultdict(dict)
        self.writes: defaultdict[int, dict[int, Step]] = defaultdict(dict)
        self.calls: defaultdict[int, dict[int, Step]] = defaultdict(dict)
        self.mentions: defaultdict[int, dict[int, Step]] = defaultdict(dict)
        for st in steps:
            self.add(st)

    def add(self, st: Step) -> None:
        for table, slots in ((self.reads, st.reads), (self.writes, st.writes), (self.calls, st.call_buffers),
                             (self.mentions, _slots(st))):
            for slot in slots:
                table[slot][id(st)] = st

    def forget(self, st: Step, slot: int) -> None:
        """``st`` no longer touches ``slot``."""
        for table in (self.reads, self.writes, self.calls, self.mentions):
            table[slot].pop(id(st), None)


def _slots(st: Step) -> set[int]:
    """Every slot ``st`` or a reduction it computes reads or writes."""
    return {*st.reads, *st.writes, *st.call_buffers, *(b for red in st.reductions for b in _slots(red))}


def _reads_where_it_writes(st: Step, param: int, result: int) -> bool:
    """Whether ``st`` reads slot ``param`` only at the element it writes to slot ``result``."""
    if st.kind == "ew" and st.out is not None:
        written = [v for v in (st.out, *(view for view, _ in st.outputs)) if v.buffer == result]
        if len(written) != 1:
            return False
        target = replace(written[0], buffer=param)
        reductions = [v for red in st.reductions for v in (red.out, *red.inputs) if v is not None]
        return all(v == target for v in st.inputs if v.buffer == param) and all(v.buffer != param for v in reductions)
    spec = st.gemm
    if st.kind == "call" and spec is not None and spec.epilogue is not None and st.call_buffers[2] == result:
        a, b, _, *extra = st.call_buffers
        operands = spec.epilogue.operands
        if param in (a, b) or len(operands) != len(extra):
            return False
        return all(op == spec.c for op, slot in zip(operands, extra, strict=True) if slot == param) \
            and (param not in extra or writes_c_once(spec))
    return False


def _rename(st: Step, old: int, new: int) -> None:
    """Slot ``old`` read or written by ``st`` becomes slot ``new``."""

    def view(v: View) -> View:
        return replace(v, buffer=new) if v.buffer == old else v

    if st.out is not None:
        st.out = view(st.out)
    st.inputs = [view(v) for v in st.inputs]
    st.outputs = [(view(v), body) for v, body in st.outputs]
    for red in st.reductions:
        _rename(red, old, new)
    st.call_buffers = [new if b == old else b for b in st.call_buffers]
    st.reads = [new if b == old else b for b in st.reads]
    st.writes = [new if b == old else b for b in st.writes]
