"""Graph builders for every registered operator: ``opgrad.ops.<name>(*inputs, **attrs)``.

Each name resolves to the ``Operator`` declared in ``registry/``; calling it returns a typed
``Call``. The attribute lookup is dynamic so that a new registry file needs no edit here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opgrad.op import Composite, Operator


def _registry() -> Any:
    # Imported by name: registry/ is mapped onto opgrad.registry by the install, not a subfolder.
    return importlib.import_module("opgrad.registry")


def __getattr__(name: str) -> Operator | Composite:
    if name.startswith("__"):
        raise AttributeError(name)
    from opgrad.errors import RegistryError

    registry = _registry()
    builder: Composite | None = registry.get_composite(name)
    if builder is not None:
        return builder
    try:
        op: Operator = registry.get(name)
        return op
    except RegistryError as exc:
        raise AttributeError(str(exc)) from None


def __dir__() -> list[str]:
    registry = _registry()
    return sorted([*registry.names(), *(c.name for c in registry.all_composites())])
