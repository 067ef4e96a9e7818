"""The operator registry: one module per operator (or tight family), discovered automatically.

Adding an operator means adding (or editing) one file in this package; every module-level
``Operator`` it defines is registered under its name, and every ``@composite`` function (a
builder made of registered ops, such as ``split``) is exposed beside them. Nothing else needs
editing.

    >>> from opgrad import registry
    >>> registry.get("dense").inputs[0].name
    'data'
    >>> [op.name for op in registry.all_ops()][:3]   # doctest: +SKIP
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
from typing import Any

from opgrad.errors import RegistryError
from opgrad.op import Composite, Operator

_ops: dict[str, Operator] = {}
_composites: dict[str, Composite] = {}
#: Per user module, the frame of its latest top-level run and the names (with their lines) it declared.
_runs: dict[str, tuple[Any, dict[str, int | None]]] = {}
_loaded = False
_lock = threading.RLock()


def _load() -> None:
    global _loaded
    with _lock:
        if _loaded:
            return
        found: dict[str, Operator] = {}
        builders: dict[str, Composite] = {}
        for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
            if info.name.startswith("_"):
                continue
            module = importlib.import_module(f"{__name__}.{info.name}")
            for value in vars(module).values():
                if isinstance(value, Composite):
                    value.module = info.name
                    builders[value.name] = value
                if isinstance(value, Operator) and value.name not in found:
                    value.module = info.name
                    found[value.name] = value
                elif isinstance(value, Operator) and found[value.name] is not value:
                    raise RegistryError(
                        f"operator {value.name!r} declared twice: in {found[value.name].module}.py "
                        f"and {info.name}.py"
                    )
        clash = sorted(set(found) & set(builders))
        if clash:
            raise RegistryError(f"{', '.join(clash)}: declared both as an operator and as a composite")
        _ops.update(found)
        _composites.update(builders)
        _loaded = True


def get(name: str) -> Operator:
    """The operator called ``name``; an unknown name lists close matches."""
    _load()
    try:
        return _ops[name]
    except KeyError:
        import difflib

        close = difflib.get_close_matches(name, _ops, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise RegistryError(f"no operator named {name!r} is registered{hint}") from None


def register(op: Operator, run: Any = None) -> None:
    """Add an operator declared outside this package (a user's module); its name must be new.

    Called by ``Operator`` itself when the declaring module is not part of opgrad's registry, with
    ``run``, the frame running the module's top level (:func:`opgrad.op.module_run`) where there is
    one. A module imported again (a notebook cell run twice) replaces its operators; one run that
    declares a name twice (a copy-paste slip) is an error.
    """
    with _lock:
        _load()
        existing = _ops.get(op.name)
        line = run.f_lineno if run is not None else None
        if existing is not None and existing is not op:
            if existing.user_defined and existing.module == op.module:
                earlier = _runs.get(op.module)
                if run is not None and earlier is not None and earlier[0] is run and op.name in earlier[1]:
                    raise RegistryError(f"operator {op.name!r} is declared twice in module {op.module} (lines "
                                        f"{earlier[1][op.name]} and {line}); choose another name for one of them")
                _ops[op.name] = op
                _note_run(op, run, line)
                return
            raise RegistryError(f"operator {op.name!r} declared in {op.source} is already declared in "
                                f"{existing.source}; choose another name")
        if op.name in _composites:
            raise RegistryError(f"operator {op.name!r} declared in {op.source} clashes with the composite "
                                f"{op.name!r} in registry/{_composites[op.name].module}.py")
        _ops[op.name] = op
        _note_run(op, run, line)


def _note_run(op: Operator, run: Any, line: int | None) -> None:
    """Remember that ``run`` (a module's top-level frame) declared ``op``; a new run of the
    module starts afresh, so only the latest frame of each module is kept."""
    if run is None:
        return
    earlier = _runs.get(op.module)
    if earlier is None or earlier[0] is not run:
        earlier = _runs[op.module] = (run, {})
    earlier[1][op.name] = line


def unregister(name: str) -> None:
    """Remove an operator a user's module declared (opgrad's own operators cannot be removed)."""
    with _lock:
        op = _ops.get(name)
        if op is None:
            raise RegistryError(f"no operator named {name!r} is registered")
        if not op.user_defined:
            raise RegistryError(f"operator {name!r} is declared in {op.source} and cannot be unregistered")
        del _ops[name]


def get_composite(name: str) -> Composite | None:
    """The composite called ``name``, or None."""
    _load()
    return _composites.get(name)


def all_composites() -> list[Composite]:
    """Every composite, sorted by name."""
    _load()
    return [_composites[n] for n in sorted(_composites)]


def all_ops(include_user: bool = True) -> list[Operator]:
    """Every registered operator, sorted by name; ``include_user=False`` keeps opgrad's own."""
    _load()
    return [_ops[n] for n in sorted(_ops) if include_user or not _ops[n].user_defined]


def names() -> list[str]:
    _load()
    return sorted(_ops)
