"""Optimizers, gradient clipping and schedules against torch.optim: 20-step trajectories match."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from optional import require

import opgrad
from opgrad import nn

torch = require("torch", "the optimizer parity tests compare with torch.optim (pip install torch==2.13.0)")

STEPS = 20
SHAPES = {"w": (3, 4), "b": (4,)}
LRS = [0.05 * (1 + 0.5 * np.sin(i)) for i in range(STEPS)]


def _gradients() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    return [{n: rng.standard_normal(s) * (3.0 if i % 5 == 0 else 1.0) for n, s in SHAPES.items()}
            for i in range(STEPS)]


def _opgrad_trajectory(optimizer: nn.Optimizer, p0: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    params = {n: opgrad.var(n, s, "float64") for n, s in SHAPES.items()}
    grads = {n: opgrad.var(f"g_{n}", s, "float64") for n, s in SHAPES.items()}
    lr = opgrad.var("lr", (), "float64")
    state_vars = {n: opgrad.var(n, s, "float64") for n, s in optimizer.state_shapes(SHAPES).items()}
    new_p, new_s = optimizer.update(params, grads, state_vars, lr)
    fn = opgrad.function([*params.values(), *grads.values(), lr, *state_vars.values()],
                         [*(new_p[n] for n in SHAPES), *(new_s[n] for n in state_vars)])
    values, state = dict(p0), optimizer.init_state(p0)
    out = []
    for g, rate in zip(_gradients(), LRS):
        result = opgrad.evaluate(fn, *values.values(), *(g[n] for n in SHAPES), np.float64(rate),
                                 *(state[n] for n in state_vars))
        values = dict(zip(SHAPES, result[: len(SHAPES)]))
        state = dict(zip(state_vars, result[len(SHAPES):]))
        out.append(values)
    return out


def _torch_trajectory(make: Callable[[list], object], p0: dict[str, np.ndarray], clip_value: float | None = None,
                      clip_norm: float | None = None) -> list[dict[str, np.ndarray]]:
    tensors = {n: torch.tensor(v, dtype=torch.float64, requires_grad=True) for n, v in p0.items()}
    opt = make(list(tensors.values()))
    out = []
    for g, rate in zip(_gradients(), LRS):
        for n, t in tensors.items():
            t.grad = torch.tensor(g[n], dtype=torch.float64)
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(list(tensors.values()), clip_value)
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(list(tensors.values()), clip_norm)
        for group in opt.param_groups:  # type: ignore[attr-defined]
            group["lr"] = rate
        opt.step()  # type: ignore[attr-defined]
        out.append({n: t.detach().numpy().copy() for n, t in tensors.items()})
    return out


CASES: dict[str, tuple[Callable[[], nn.Optimizer], Callable[[list], object], dict]] = {
    "sgd": (lambda: nn.SGD(), lambda p: torch.optim.SGD(p, lr=0.1), {}),
    "sgd_weight_decay": (lambda: nn.SGD(weight_decay=0.05), lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.05),
                         {}),
    "momentum": (lambda: nn.SGD(momentum=0.9, weight_decay=0.01),
                 lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01), {}),
    "nesterov": (lambda: nn.SGD(momentum=0.8, nesterov=True),
                 lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.8, nesterov=True), {}),
    "adam": (lambda: nn.Adam(), lambda p: torch.optim.Adam(p, lr=0.1), {}),
    "adam_weight_decay": (lambda: nn.Adam(beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1),
                          lambda p: torch.optim.Adam(p, lr=0.1, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1), {}),
    "adamw": (lambda: nn.AdamW(weight_decay=0.1), lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.1), {}),
    "rmsprop": (lambda: nn.RMSprop(), lambda p: torch.optim.RMSprop(p, lr=0.1), {}),
    "rmsprop_momentum_centered": (
        lambda: nn.RMSprop(alpha=0.9, eps=1e-6, momentum=0.5, centered=True, weight_decay=0.01),
        lambda p: torch.optim.RMSprop(p, lr=0.1, alpha=0.9, eps=1e-6, momentum=0.5, centered=True,
                                      weight_decay=0.01), {}),
    "adam_clip_norm": (lambda: nn.Adam(clip_norm=1.5), lambda p: torch.optim.Adam(p, lr=0.1), {"clip_norm": 1.5}),
    "sgd_clip_value": (lambda: nn.SGD(momentum=0.9, clip_value=0.7),
                       lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), {"clip_value": 0.7}),
    "adamw_both_clips": (lambda: nn.AdamW(clip_value=2.0, clip_norm=2.5),
                         lambda p: torch.optim.AdamW(p, lr=0.1), {"clip_value": 2.0, "clip_norm": 2.5}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_trajectory_matches_torch_optim(case: str) -> None:
    ours, theirs, clips = CASES[case]
    rng = np.random.default_rng(1)
    p0 = {n: rng.standard_normal(s) for n, s in SHAPES.items()}
    got = _opgrad_trajectory(ours(), p0)
    want = _torch_trajectory(theirs, p0, **clips)
    for step, (g, w) in enumerate(zip(got, want)):
        for name in SHAPES:
            np.testing.assert_allclose(g[name], w[name], rtol=1e-10, atol=1e-12,
                                       err_msg=f"{case}: parameter {name} after step {step + 1}")


def _torch_lrs(make: Callable[[object], object], steps: int = 30) -> list[float]:
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    sched = make(opt)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()  # type: ignore[attr-defined]
    return lrs


@pytest.mark.parametrize("ours, theirs", [
    (nn.cosine_lr(0.1, total_steps=25, final=0.01),
     lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=25, eta_min=0.01)),
    (nn.StepLR(0.1, step_size=7, gamma=0.5), lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=7, gamma=0.5)),
    (nn.WarmupLR(nn.cosine_lr(0.1, total_steps=20), warmup_steps=5, start_factor=0.2),
     lambda o: torch.optim.lr_scheduler.SequentialLR(o, [
         torch.optim.lr_scheduler.LinearLR(o, start_factor=0.2, end_factor=1.0, total_iters=5),
         torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=20)], milestones=[5])),
], ids=["cosine", "step", "warmup_cosine"])
def test_schedule_matches_torch_lr_scheduler(ours: nn.Schedule, theirs: Callable[[object], object]) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about SequentialLR's internal step order
        want = _torch_lrs(theirs, 25)
    np.testing.assert_allclose([ours(step) for step in range(25)], want, rtol=1e-9, atol=1e-12)


def test_optimizer_options_are_validated() -> None:
    with pytest.raises(ValueError, match="weight_decay must be a finite number >= 0"):
        nn.SGD(weight_decay=-1)
    with pytest.raises(ValueError, match="clip_norm must be a finite number > 0, or None"):
        nn.Adam(clip_norm=0)
    with pytest.raises(ValueError, match="clip_value must be"):
        nn.Adam(clip_value=float("inf"))
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        nn.make_optimizer("lion")
    assert nn.make_optimizer("adamw").weight_decay == 0.01
    assert nn.make_optimizer("adamw", weight_decay=0.0).weight_decay == 0.0
    assert "clip_norm=1" in nn.make_optimizer("adam", clip_norm=1.0).describe()
