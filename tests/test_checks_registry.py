"""Every registered operator through opgrad.checks, under 20 seeds: no false alarms.

The parametrization comes from the registry, so a new file in registry/ is checked here with no
test code. 20 seeds x 4 examples gives each op 80 varied examples in a few seconds; the
exhaustive run is `opgrad check` (100 examples per op).
"""

from __future__ import annotations

import pytest

import opgrad
from opgrad.checks import check_op

SEEDS = range(20)


@pytest.mark.parametrize("name", opgrad.registry.names())
def test_registered_gradient_passes_under_20_seeds(name: str) -> None:
    for seed in SEEDS:
        report = check_op(name, max_examples=4, seed=seed)
        assert report.passed, f"false alarm or real bug under seed {seed}:\n{report}"
        assert report.examples >= 1
