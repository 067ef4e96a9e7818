"""Hypothesis profiles for opgrad's own tests and for users' suites that check ops.

``opgrad-ci``: derandomized (the same examples on every run, so CI is never flaky), no deadline
(an example's time depends on the machine, not on correctness), and the reproduction blob printed.
``opgrad-thorough``: many more examples, for a release or after touching a gradient.
Select one with ``HYPOTHESIS_PROFILE=opgrad-ci`` or pytest's ``--hypothesis-profile opgrad-ci``.
The names carry the ``opgrad-`` prefix so they never collide with a user's own ``ci`` profile.
"""

from __future__ import annotations

import os

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
