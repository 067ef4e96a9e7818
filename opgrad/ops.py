"""Graph builders for every registered operator: ``opgrad.ops.<name>(*inputs, **attrs)``.

Each name resolves to the ``Operator`` declared in ``registry/``; calling it returns a typed
``Call``. The attribute lookup is dynamic so that a new registry file needs no edit here.
"""

from __future__ import annotations

from opgrad.op import Operator


def __getattr__(name: str) -> Operator:
    if name.startswith("__"):
        raise AttributeError(name)
    from opgrad import registry
    from opgrad.errors import RegistryError

    try:
        return registry.get(name)
    except RegistryError as exc:
        raise AttributeError(str(exc)) from None


def __dir__() -> list[str]:
    from opgrad import registry

    return registry.names()
