"""opgrad.checks.strategies composed in a user's own hypothesis tests, as hypothesis.extra.numpy is."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import opgrad
from opgrad.checks.strategies import Example, cases, inputs
from opgrad.op import Case


@settings(max_examples=25, database=None)
@given(inputs("conv2d", dtype="float32", max_side=3), st.floats(0.5, 2.0))
def test_user_composes_inputs_with_own_strategies(example: Example, scale: float) -> None:
    data, weight = example.arrays
    assert data.dtype == weight.dtype == np.float32 and example.dtype == "float32"
    attrs = example.case.attrs
    # conv2d is linear in data: the user's own property, on opgrad's examples.
    scaled = example.op.reference_fn(data * np.float32(scale), weight, **attrs)
    plain = example.op.reference_fn(data, weight, **attrs)
    np.testing.assert_allclose(scaled, plain * np.float32(scale), rtol=1e-4, atol=1e-4)


@settings(max_examples=30, database=None)
@given(inputs("tanh", elements=st.floats(20.0, 30.0), max_rank=2))
def test_elements_replace_the_domain(example: Example) -> None:
    (x,) = example.arrays
    assert x.ndim <= 2 and np.all((x >= 20.0) & (x <= 30.0))


@settings(max_examples=30, database=None)
@given(inputs("divide", elements={"lhs": st.just(3.0)}))
def test_elements_by_input_name_keep_the_others_domain(example: Example) -> None:
    lhs, rhs = example.arrays
    assert np.all(lhs == 3.0) and np.all(np.abs(rhs) > 0.1)


@settings(max_examples=40, database=None)
@given(inputs("clip", elements=st.floats(0.5, 1.0)))
def test_elements_of_a_kinked_op_stay_in_the_users_range(example: Example) -> None:
    # clip's kinks are at its bounds; the checker's own draws are moved off them, a user's are not.
    (x,) = example.arrays
    assert np.all((x >= 0.5) & (x <= 1.0))


@settings(max_examples=20, database=None)
@given(inputs("relu", elements=st.just(0.0), max_side=9))
def test_elements_on_a_kink_are_kept(example: Example) -> None:
    (x,) = example.arrays
    assert not np.any(x)


def test_elements_that_draw_nan_reach_a_kinked_op() -> None:
    seen = []

    @settings(max_examples=200, database=None, derandomize=True)
    @given(inputs("maximum", elements=st.floats(allow_nan=True, allow_infinity=True)))
    def collect(example: Example) -> None:
        seen.append(any(np.isnan(a).any() for a in example.arrays))

    collect()
    assert any(seen), "no example held a NaN"


@settings(max_examples=40, database=None)
@given(cases("dense", max_side=7), cases("exp", max_rank=5, max_side=2))
def test_cases_honour_the_limits(dense: Case, exp: Case) -> None:
    (n, k), (u, k2) = dense.shapes
    assert k == k2 and max(n, k, u) <= 7
    (shape,) = exp.shapes
    assert len(shape) <= 5 and all(side <= 2 for side in shape)


def test_limits_reach_the_bounds() -> None:
    from hypothesis import find

    assert find(cases("exp", max_rank=5, max_side=2), lambda c: len(c.shapes[0]) == 5).shapes == [(1,) * 5]


@settings(max_examples=20, database=None)
@given(st.data())
def test_strategies_draw_interactively(data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(["relu", "exp", "dense"]))
    example = data.draw(inputs(name, max_rank=1, max_side=2))
    out = opgrad.registry.get(name).reference_fn(*example.arrays, **example.case.attrs)
    assert np.all(np.isfinite(out))


def test_bad_arguments_say_what_was_expected() -> None:
    with pytest.raises(ValueError, match="max_side must be an int >= 1, got 0"):
        cases("relu", max_side=0)
    with pytest.raises(ValueError, match="dtype must be one of"):
        inputs("relu", dtype="float16")
    with pytest.raises(ValueError, match=r"unknown input\(s\) \['x'\]"):
        inputs("relu", elements={"x": st.just(1.0)})
    with pytest.raises(TypeError, match="elements must be a hypothesis strategy"):
        inputs("relu", elements=1.0)  # type: ignore[arg-type]


def test_big_arrays_shrink_towards_a_constant() -> None:
    from hypothesis import find

    big = find(inputs("exp", max_rank=3, max_side=8), lambda e: e.arrays[0].size > 100,
               settings=settings(database=None, max_examples=200))
    (x,) = big.arrays
    assert len(np.unique(x)) == 1, x  # the pattern's spread shrinks to 0 and no special value is left
