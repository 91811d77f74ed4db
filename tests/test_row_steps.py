"""Schedulers' steps run once over the rows of many calls (`row_steps`): each call's part is,
bit for bit in float32, what its own scheduler's step returns, whatever its timestep, its
number of steps and its rows; a call without a per-row form steps alone."""

from __future__ import annotations

import copy

import pytest
import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
)

from serve_app.engine import row_steps
from serve_app.engine.joining import StepBatch


def _ddim(**config):
    return DDIMScheduler(beta_schedule="scaled_linear", set_alpha_to_one=False, **config)


def _flow():
    return FlowMatchEulerDiscreteScheduler(shift=3.0)


def _seats(make, steps_each, at_each, rows_each, seed=0):
    """A scheduler per seat, set to its steps and moved to its step `at`, with its inputs."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for steps, at, rows in zip(steps_each, at_each, rows_each, strict=True):
        s = make()
        s.set_timesteps(steps)
        if isinstance(s, FlowMatchEulerDiscreteScheduler | EulerDiscreteScheduler):
            s._init_step_index(s.timesteps[0])
            s._step_index = at
        x = torch.randn(rows, 4, 8, 8, generator=g)
        eps = torch.randn(rows, 4, 8, 8, generator=g)
        out.append((s, s.timesteps[at], x, eps))
    return out


MAKERS = {
    "ddim-epsilon": lambda: _ddim(),
    "ddim-v": lambda: _ddim(prediction_type="v_prediction", timestep_spacing="trailing"),
    "ddim-sample-clipped": lambda: _ddim(prediction_type="sample", clip_sample=True),
    "euler-epsilon": lambda: EulerDiscreteScheduler(beta_schedule="scaled_linear"),
    "euler-v": lambda: EulerDiscreteScheduler(prediction_type="v_prediction", timestep_spacing="trailing"),
    "flow": _flow,
}


@pytest.mark.parametrize("name", list(MAKERS))
@pytest.mark.parametrize("return_dict", [True, False])
def test_one_step_over_all_rows_is_each_schedulers_own_step(name, return_dict):
    seats = _seats(MAKERS[name], steps_each=[20, 20, 7, 50], at_each=[0, 5, 6, 49], rows_each=[1, 3, 2, 1])
    own = [copy.deepcopy(s) for s, *_ in seats]
    want = [o.step(eps, t, x, return_dict=return_dict) for o, (_, t, x, eps) in zip(own, seats, strict=True)]
    plans = [row_steps.plan(s, (eps, t, x), {"return_dict": return_dict}) for s, t, x, eps in seats]
    assert len({p.key for p in plans}) == 1  # one batched step for all four
    got = row_steps.run(plans)
    for g, w in zip(got, want, strict=True):
        assert type(g) is type(w)
        g, w = (g, w) if not return_dict else (g.to_tuple(), w.to_tuple())
        assert len(g) == len(w) and all(torch.equal(a, b) for a, b in zip(g, w, strict=True))
    # The schedulers' own state moved on as their step moves it (flow matching's step index).
    for (s, *_), o in zip(seats, own, strict=True):
        assert getattr(s, "step_index", None) == getattr(o, "step_index", None)


def test_calls_without_a_per_row_form_step_alone():
    (s, t, x, eps), = _seats(MAKERS["ddim-epsilon"], [20], [3], [1])  # fmt: skip
    assert row_steps.plan(s, (eps, t, x), {"eta": 0.5}) is None  # noise of its own generator
    assert row_steps.plan(s, (eps, t, x, 0.5), {}) is None
    assert not row_steps.joinable(DPMSolverMultistepScheduler())
    euler, et, ex, eeps = _seats(MAKERS["euler-epsilon"], [10], [2], [1])[0]
    assert row_steps.plan(euler, (eeps, et, ex), {"s_churn": 0.5}) is None
    flow, ft, fx, feps = _seats(_flow, [10], [2], [1])[0]
    assert row_steps.plan(flow, (feps, ft, fx), {"per_token_timesteps": torch.ones(1, 16)}) is None
    assert row_steps.plan(flow, (feps, 3, fx), {}) is None  # an index: its own step refuses it


def test_a_joined_run_steps_its_schedulers_once_a_step():
    """Seats with DDIM schedulers, joined: one batched scheduler step per step, and each seat's
    latents those of its scheduler stepping alone."""
    calls = []
    real_run = row_steps.run

    def counting(plans):
        calls.append(len(plans))
        return real_run(plans)

    def seat_fn(scheduler, seed):
        def fn(stand_in):
            stand_in.join_steps(scheduler)
            x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(seed))
            for t in scheduler.timesteps:
                x = scheduler.step(stand_in(x, t), t, x, return_dict=False)[0]
            return x

        return fn

    def alone(seed):
        s = _ddim()
        s.set_timesteps(6)
        x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(seed))
        for t in s.timesteps:
            x = s.step(x * 0.5, t, x, return_dict=False)[0]
        return x

    row_steps_run, row_steps.run = row_steps.run, counting
    try:
        batch = StepBatch(lambda x, t: x * 0.5, RuntimeError)
        seats = []
        for seed in range(3):
            s = _ddim()
            s.set_timesteps(6)
            seats.append(batch.add(seat_fn(s, seed)))
            batch.step()
        while batch.active:
            batch.step()
    finally:
        row_steps.run = row_steps_run
    assert all(torch.equal(seat.output, alone(seed)) for seed, seat in enumerate(seats))
    assert len(calls) == 6 + 2 and max(calls) == 3  # one a step, all seats in it


def test_a_timestep_off_the_schedule_is_looked_up_as_its_own_step_would():
    (s, _, x, eps), = _seats(MAKERS["ddim-epsilon"], [20], [3], [2])  # fmt: skip
    t = torch.tensor(777)  # not one of the 20 timesteps
    want = copy.deepcopy(s).step(eps, t, x, return_dict=False)
    got = row_steps.run([row_steps.plan(s, (eps, t, x), {"return_dict": False})])[0]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
