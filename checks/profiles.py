"""Hypothesis profiles for opgrad's own tests and for users' suites that check ops.

``ci``: derandomized (the same examples on every run, so CI is never flaky), no deadline (an
example's time depends on the machine, not on correctness), and the reproduction blob printed.
``thorough``: many more examples, for a release or after touching a gradient.
Select one with ``HYPOTHESIS_PROFILE=ci`` or pytest's ``--hypothesis-profile ci``.
"""

from __future__ import annotations

import os

from hypothesis import settings

PROFILES = ("ci", "thorough")


def register_profiles() -> None:
    """Register ``ci`` and ``thorough`` (idempotent), unless the user already registered them."""
    known = settings._profiles  # hypothesis keeps no public "is registered" query
    if "ci" not in known:
        settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True, database=None)
    if "thorough" not in known:
        settings.register_profile("thorough", max_examples=1000, deadline=None, print_blob=True)


def load_profile_from_env() -> str | None:
    """Load the profile named by ``HYPOTHESIS_PROFILE`` if it is registered; return its name."""
    name = os.environ.get("HYPOTHESIS_PROFILE")
    if name and name in settings._profiles:
        settings.load_profile(name)
        return name
    return None
