"""Hypothesis profiles for opgrad's own tests and for users' suites that check ops.

``opgrad-ci``: derandomized (the same examples on every run, so CI is never flaky), no deadline
(an example's time depends on the machine, not on correctness), and the reproduction blob printed.
``opgrad-thorough``: many more examples, for a release or after touching a gradient.
Select one with ``HYPOTHESIS_PROFILE=opgrad-ci`` or pytest's ``--hypothesis-profile opgrad-ci``.
The names carry the ``opgrad-`` prefix so they never collide with a user's own ``ci`` profile.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hypothesis import settings
from hypothesis.errors import InvalidArgument

CI_PROFILE = "opgrad-ci"
THOROUGH_PROFILE = "opgrad-thorough"
PROFILES = (CI_PROFILE, THOROUGH_PROFILE)


def is_registered(name: str) -> bool:
    """Whether hypothesis knows a profile called ``name``."""
    try:
        settings.get_profile(name)
    except InvalidArgument:
        return False
    return True


def register_profiles() -> None:
    """Register ``opgrad-ci`` and ``opgrad-thorough`` (idempotent), unless already registered."""
    if not is_registered(CI_PROFILE):
        settings.register_profile(CI_PROFILE, derandomize=True, deadline=None, print_blob=True, database=None)
    if not is_registered(THOROUGH_PROFILE):
        settings.register_profile(THOROUGH_PROFILE, max_examples=1000, deadline=None, print_blob=True)


def thorough() -> bool:
    """Whether the thorough profile is the one in force (tests then run their larger variants)."""
    return settings.get_current_profile_name() == THOROUGH_PROFILE


def load_profile_from_env() -> str | None:
    """Load the profile named by ``HYPOTHESIS_PROFILE`` if it is registered; return its name."""
    name = os.environ.get("HYPOTHESIS_PROFILE")
    if name and is_registered(name):
        settings.load_profile(name)
        return name
    return None


@contextmanager
def draws_independent_of_loaded_modules() -> Iterator[None]:
    """While active, hypothesis draws none of the literal constants it collects from the *local*
    modules in ``sys.modules`` (the user's code, an editable install of opgrad).

    Why: hypothesis mixes those constants into what it generates, so the examples of one seed
    would depend on what the process happened to import, and a repro line run in a fresh
    process (``opgrad check OP --seed N``) would see other examples than the pytest run, script
    or worker that printed it. The hook is hypothesis's own provider function; on a version
    without it nothing changes (and the tests that compare the runs say so).
    """
    providers: Any
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:  # pragma: no cover - another hypothesis layout
        yield
        return
    original = getattr(providers, "_get_local_constants", None)
    constants = getattr(providers, "Constants", None)
    cache = getattr(getattr(providers, "CONSTANTS_CACHE", None), "cache", None)
    if original is None or constants is None or cache is None:  # pragma: no cover
        yield
        return
    none_loaded = constants()
    cache.clear()  # permitted constants cached with the modules' ones
    providers._get_local_constants = lambda: none_loaded
    try:
        yield
    finally:
        providers._get_local_constants = original
        cache.clear()
