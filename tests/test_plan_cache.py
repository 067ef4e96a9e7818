"""The plan cache: a second compile of the same graph loads its plan and object instead of lowering
the graph again, gives the same bits, and never takes a plan that another graph, target, thread
count or setting would plan differently."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import opgrad
from opgrad import nn, ops
from opgrad.compiler import compile as compile_fn
from opgrad.compiler import plan_graph, plancache
from opgrad.compiler.target import resolve_target, use_target
from opgrad.env import check_environment
from opgrad.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def plans(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh object and plan cache, with the plan cache on (the suite turns it off by default)."""
    monkeypatch.setenv("OPGRAD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("OPGRAD_PLAN_CACHE", "1")
    return tmp_path


def small_cnn() -> nn.Sequential:
    return nn.Sequential([nn.Conv2D(8, 3, activation="relu"), nn.Conv2D(8, 3, padding=1, activation="relu"),
                          nn.AvgPool2D(2), nn.Flatten(), nn.Dense(10)], input_shape=(1, 10, 10), name="small")


def step_function() -> opgrad.Function:
    return nn.TrainStep(small_cnn(), nn.SGD(), batch_size=4, backend="reference").function


def arguments(fn: opgrad.Function, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 10, p.shape).astype(p.dtype) if p.dtype.startswith("int")
            else (0.3 * rng.standard_normal(p.shape)).astype(p.dtype) for p in fn.params]


def run(compiled: opgrad.compiler.CompiledFunction, args: list[np.ndarray]) -> list[np.ndarray]:
    out = compiled(*args)
    return list(out) if isinstance(out, tuple) else [out]


def test_a_second_compile_loads_the_plan_and_gives_the_same_bits(plans: Path) -> None:
    fn = step_function()
    first = compile_fn(fn)
    assert not first.plan_cache_hit and len(list(plans.glob("*.plan"))) == 1
    again = compile_fn(step_function())  # built anew: other Var objects, the same graph
    assert again.plan_cache_hit and again.cache_hit
    args = arguments(fn)
    for a, b in zip(run(first, args), run(again, args), strict=True):
        assert a.tobytes() == b.tobytes()
    fresh = plan_graph(fn)
    stored = again.plan
    assert stored.step_labels == fresh.step_labels and stored.offsets == fresh.offsets
    assert stored.arena_bytes == fresh.arena_bytes and stored.step_costs == fresh.step_costs
    assert stored.kernel_labels == fresh.kernel_labels and stored.checks == fresh.checks
    assert again.ir == fresh.ir  # built on demand


def test_a_stored_loop_plan_runs_the_native_loop_like_a_fresh_one(plans: Path) -> None:
    model = small_cnn()
    rng = np.random.default_rng(1)
    images = rng.random((12, 1, 10, 10), dtype=np.float32)
    labels = rng.integers(0, 10, 12).astype(np.int64)
    results = []
    for expect_hit in (False, True):
        step = nn.TrainStep(model, nn.SGD(), batch_size=4, backend="llvm")
        assert step.compiled.plan_cache_hit is expect_hit
        params = model.init_params(seed=0)
        results.append(step.run_steps(images, labels, params, model.init_buffers(), 0.1))
    assert np.array_equal(results[0].losses, results[1].losses)
    for name, value in results[0].params.items():
        assert value.tobytes() == results[1].params[name].tobytes()


def test_integer_inputs_are_range_checked_after_a_plan_cache_hit(plans: Path) -> None:
    fn = step_function()
    compile_fn(fn)
    again = compile_fn(fn)
    assert again.plan_cache_hit
    args = arguments(fn)
    labels = next(i for i, p in enumerate(fn.params) if p.dtype.startswith("int"))
    args[labels] = args[labels].copy()
    args[labels][0] = 10
    with pytest.raises(opgrad.errors.ArgumentError, match=r"valid range is \[0, 10\)"):
        again(*args)


def _conv(padding: int, scale: float) -> opgrad.Function:
    x, w = opgrad.var("x", (2, 8, 6, 6)), opgrad.var("w", (8, 8, 3, 3))
    return opgrad.Function([x, w], ops.multiply(ops.conv2d(x, w, padding=padding), opgrad.const(scale)))


def test_the_key_follows_the_graph_and_what_the_planner_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    def key(fn: opgrad.Function, **options: object) -> str | None:
        return plancache.plan_key(fn, name="opgrad_graph", step_entries=bool(options.get("step_entries")),
                                  loop=None)

    base = key(_conv(1, 2.0))
    assert base is not None and base == key(_conv(1, 2.0))
    others = {key(_conv(0, 2.0)), key(_conv(1, 3.0)), key(_conv(1, -0.0)), key(_conv(1, 0.0)),
              key(_conv(1, 2.0), step_entries=True)}
    with use_target(resolve_target("x86-64-v3")):
        others.add(key(_conv(1, 2.0)))
    monkeypatch.setenv("OPGRAD_CONV_ALGORITHM", "direct")
    others.add(key(_conv(1, 2.0)))
    monkeypatch.delenv("OPGRAD_CONV_ALGORITHM")
    monkeypatch.setattr(plancache, "pool_size", lambda: 7)
    others.add(key(_conv(1, 2.0)))
    assert base not in others and len(others) == 8


def test_graphs_with_code_from_outside_opgrad_have_no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    fn = _conv(1, 2.0)
    assert plancache.graph_fingerprint(fn) is not None

    def patched_lowering(*args: object) -> None:
        raise AssertionError("not lowered here")

    monkeypatch.setattr(ops.conv2d, "_lowering", patched_lowering)
    assert plancache.graph_fingerprint(fn) is None


def test_without_opgrads_sources_to_digest_nothing_has_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    assert plancache.source_digest() is not None
    monkeypatch.setattr(plancache, "source_digest", lambda: None)
    assert plancache.plan_key(_conv(1, 2.0), name="opgrad_graph", step_entries=False, loop=None) is None


def test_a_damaged_plan_is_reported_deleted_and_planned_again(plans: Path) -> None:
    fn = step_function()
    expected = run(compile_fn(fn), arguments(fn))
    (entry,) = plans.glob("*.plan")
    entry.write_bytes(entry.read_bytes()[:-7])  # truncated
    with pytest.warns(UserWarning, match=r"cached plan .* is truncated"):
        again = compile_fn(fn)
    assert not again.plan_cache_hit
    assert all(a.tobytes() == b.tobytes() for a, b in zip(run(again, arguments(fn)), expected, strict=True))
    assert compile_fn(fn).plan_cache_hit  # stored again


@pytest.mark.parametrize("damage", ["params", "arena", "offsets"])
def test_a_sound_entry_that_does_not_fit_the_function_is_discarded(plans: Path, damage: str) -> None:
    fn = step_function()
    compile_fn(fn)
    (entry,) = plans.glob("*.plan")
    key = entry.name.removesuffix(".plan")
    store = plancache.PlanCache()
    record = store.load(key)
    assert record is not None
    fields, consts = record
    if damage == "params":
        fields["params"] = fields["params"][:-1]
    elif damage == "arena":  # every internal buffer would run past the arena
        fields["arena_bytes"] = 64
    else:
        fields["offsets"] = [[slot, offset + fields["arena_bytes"]] for slot, offset in fields["offsets"]]
    store.store(key, fields, consts)
    with pytest.warns(UserWarning, match="not a plan of this function"):
        again = compile_fn(fn)
    assert not again.plan_cache_hit and compile_fn(fn).plan_cache_hit


def test_a_plan_whose_object_is_gone_is_compiled_again(plans: Path) -> None:
    fn = step_function()
    expected = run(compile_fn(fn), arguments(fn))
    for obj in plans.glob("*.o"):
        obj.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = compile_fn(fn)
    assert not again.plan_cache_hit and not again.cache_hit
    assert all(a.tobytes() == b.tobytes() for a, b in zip(run(again, arguments(fn)), expected, strict=True))


def test_plan_cache_off_stores_and_loads_nothing(plans: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fn = step_function()
    compile_fn(fn, plan_cache=False)
    assert not list(plans.glob("*.plan"))
    compile_fn(fn)
    monkeypatch.setenv("OPGRAD_PLAN_CACHE", "0")
    assert not compile_fn(fn).plan_cache_hit
    assert compile_fn(fn, plan_cache=True).plan_cache_hit
    monkeypatch.setenv("OPGRAD_PLAN_CACHE", "yes")
    with pytest.raises(ConfigError, match="OPGRAD_PLAN_CACHE='yes'"):
        check_environment()


def test_records_hold_constants_as_raw_bytes_and_reject_what_does_not_fit() -> None:
    arrays: dict[int, np.ndarray] = {3: np.arange(6, dtype=np.int64).reshape(2, 3),
                                     5: np.array([-0.0, 1.5], np.float32)}
    payload = plancache.encode_record({"name": "f"}, arrays)
    fields, back = plancache.decode_record(payload)
    assert fields == {"name": "f"} and sorted(back) == [3, 5]
    for slot, array in arrays.items():
        assert back[slot].dtype == array.dtype and back[slot].tobytes() == array.tobytes()
    with pytest.raises(ValueError, match="does not fit"):
        plancache.decode_record(payload[:-4])
    with pytest.raises(ValueError, match="not a plan record"):
        plancache.decode_record(b"OPGRDOB2" + payload[8:])


def test_a_new_process_starts_warm_from_the_stored_plan(plans: Path) -> None:
    script = ("import json, opgrad\nfrom opgrad import nn\n"
              "s = nn.TrainStep(nn.build_model('mlp'), nn.SGD(), batch_size=8, backend='llvm')\n"
              "print(json.dumps([s.compiled.plan_cache_hit, s.compiled.cache_hit]))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    assert [r.stdout.strip() for r in runs] == ["[false, false]", "[true, true]"], [r.stderr[-2000:] for r in runs]
