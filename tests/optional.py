"""Optional test dependencies: skipped with the reason printed locally, required in CI.

CI (``CI=true``) installs every optional component, so a missing one there is a failure rather
than a silent skip.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def require(module: str, why: str) -> ModuleType:
    """Import ``module``; skip the calling test module with ``why`` if it is missing, except in CI."""
    if os.environ.get("CI") == "true":
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"{module} is not installed: {why}")
