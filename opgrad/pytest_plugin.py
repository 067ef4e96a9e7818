"""pytest plugin (entry point ``opgrad``): hypothesis profiles, and an ``opgrad_check`` fixture.

It loads in every pytest run of anyone who installs opgrad, so it imports only hypothesis'
settings and never fails a run: anything else is imported when a check is actually used. It
lives in ``opgrad/`` itself, not in ``opgrad.checks``: where pytest runs in a directory holding
an ``opgrad/`` source tree (a checkout, an unpacked sdist), that tree shadows the installed
package, and ``checks/`` becomes ``opgrad.checks`` only when installed.

In a user's suite, one line checks an operator::

    def test_leaky_relu(opgrad_check):
        opgrad_check("leaky_relu")          # or: opgrad.checks.assert_op("leaky_relu")
"""

from __future__ import annotations

from typing import Any

import pytest


def _profiles() -> Any:
    try:
        from opgrad.checks import profiles
    except Exception:  # pragma: no cover - a broken install must not break unrelated test runs
        return None
    return profiles


_module = _profiles()
if _module is not None:
    _module.register_profiles()  # before hypothesis' own plugin resolves --hypothesis-profile


def pytest_configure(config: pytest.Config) -> None:
    if _module is None:
        return
    if config.getoption("hypothesis_profile", default=None):
        return  # an explicit --hypothesis-profile wins over the environment
    _module.load_profile_from_env()


def pytest_report_header(config: pytest.Config) -> str | None:
    try:
        from hypothesis import settings
    except Exception:  # pragma: no cover
        return None
    return f"opgrad.checks: hypothesis profile {settings.get_current_profile_name()!r}"


@pytest.fixture
def opgrad_check() -> Any:
    """``opgrad_check(name, **kwargs)``: ``opgrad.checks.assert_op`` (raises with the failure report)."""
    from opgrad.checks import assert_op

    return assert_op
