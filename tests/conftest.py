import os
import sys

from hypothesis import settings

# tests/fd.py and other helpers are imported as plain modules by the tests.
sys.path.insert(0, os.path.dirname(__file__))

# Tests patch the compiler's internals (tile choices, value reuse) and compile graphs that other
# tests compile unpatched; a stored plan would hide the patch. tests/test_plan_cache.py turns the
# plan cache on for its own tests.
os.environ["OPGRAD_PLAN_CACHE"] = "0"

# The project's own suite is derandomized unless asked otherwise (HYPOTHESIS_PROFILE=opgrad-thorough):
# the same examples on every machine, so CI and a developer's run never disagree by chance.
if not os.environ.get("HYPOTHESIS_PROFILE"):
    from opgrad.checks.profiles import register_profiles

    register_profiles()
    settings.load_profile("opgrad-ci")
