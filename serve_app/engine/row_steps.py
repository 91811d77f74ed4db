"""Schedulers' steps run once over the rows of many pipeline calls (step-level joining).

In a joined run each seat steps a scheduler of its own, and for the common schedulers that
step is a few elementwise operations on coefficients the scheduler looks up for its own
timestep: on a CPU host, 0.18 ms a seat-step of the 0.33 a joined seat costs (DDIM, tiny-sd,
in process). So a seat only looks its coefficients up (`plan`, in the seat) and the batch runs
the operations once over every seat's rows (`run`), each row with its seat's coefficients.

A seat gets back what its own scheduler would have returned: the same operations in the same
order, so the same bits in float32; in half precision to rounding (the coefficients meet the
rows in float32, as a CUDA kernel meets a CPU scalar). A scheduler or a call without a form
here (other schedulers, a DDIM call with eta > 0, per-token timesteps) steps alone, unchanged.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import torch


@dataclasses.dataclass
class RowStep:
    """One seat's scheduler step, planned: what must match for steps to run together (`key`),
    the seat's coefficients (float32 values, as Python floats), its model output and sample,
    and how its part of the result becomes what its scheduler returns (`answer`)."""

    key: tuple
    coefs: tuple[float, ...]
    model_output: torch.Tensor
    sample: torch.Tensor
    answer: Callable[[tuple[torch.Tensor, ...]], Any]


def joinable(scheduler) -> bool:
    """Whether `scheduler` has a per-row form here (diffusers' exact class: a subclass may step
    otherwise). Classes are known by name: diffusers is not imported until a pipeline loads it
    (the app's build imports this module without it)."""
    kind = type(scheduler)
    return kind.__name__ in _PLANS and kind.__module__.startswith("diffusers.schedulers.")


def plan(scheduler, args: tuple, kwargs: dict) -> RowStep | None:
    """In the seat: its call `scheduler.step(*args, **kwargs)` as a `RowStep` (the scheduler's
    own state moved on as its step would), or None when the call has no per-row form."""
    if len(args) != 3 or not isinstance(args[0], torch.Tensor) or not isinstance(args[2], torch.Tensor):
        return None
    if args[0].shape != args[2].shape:
        return None
    return _PLANS[type(scheduler).__name__](scheduler, *args, **kwargs)


def run(steps: list[RowStep]) -> list[Any]:
    """The steps of one `key` over all their rows at once: each seat's answer."""
    sizes = [s.sample.shape[0] for s in steps]
    first = steps[0].sample
    model_output = torch.cat([s.model_output for s in steps])
    sample = torch.cat([s.sample for s in steps])
    shape = (-1,) + (1,) * (first.dim() - 1)
    coefs = []
    for j in range(len(steps[0].coefs)):
        c = torch.tensor([s.coefs[j] for s in steps], dtype=torch.float32, device=first.device)
        if any(n != 1 for n in sizes):
            c = c.repeat_interleave(torch.tensor(sizes, device=c.device))
        coefs.append(c.view(shape))
    outs = _COMPUTE[steps[0].key[0]](steps[0].key, model_output, sample, coefs)
    parts = [o.split(sizes) for o in outs]
    return [s.answer(tuple(p[i] for p in parts)) for i, s in enumerate(steps)]


def _layout(name: str, model_output: torch.Tensor, sample: torch.Tensor, *more) -> tuple:
    return (name, model_output.dtype, sample.dtype, tuple(sample.shape[1:]), sample.device, *more)


def _an_index(timestep) -> bool:
    """Whether `timestep` is an index, which the sigma schedulers' own steps refuse."""
    if isinstance(timestep, torch.Tensor):
        return not timestep.is_floating_point()
    return isinstance(timestep, int)


# ---------------------------------------------------------------------- DDIM


def _plan_ddim(s, model_output, timestep, sample, eta=0.0, use_clipped_model_output=False,
               generator=None, variance_noise=None, return_dict=True) -> RowStep | None:  # fmt: skip
    cfg = s.config
    if eta != 0 or use_clipped_model_output or variance_noise is not None or cfg.thresholding:
        return None
    if s.num_inference_steps is None or cfg.prediction_type not in ("epsilon", "sample", "v_prediction"):
        return None  # its own step raises the error
    alphas = _ddim_alphas(s).get(int(timestep))
    if alphas is None:  # a timestep not of its schedule: looked up as its step would
        prev = timestep - cfg.num_train_timesteps // s.num_inference_steps
        alpha_prev = s.alphas_cumprod[prev] if prev >= 0 else s.final_alpha_cumprod
        alphas = (float(s.alphas_cumprod[timestep]), float(alpha_prev))
    clip = cfg.clip_sample_range if cfg.clip_sample else None
    key = _layout("ddim", model_output, sample, cfg.prediction_type, clip)

    def answer(parts):
        if return_dict:
            return _output(s)(prev_sample=parts[0], pred_original_sample=parts[1])
        return parts

    return RowStep(key, alphas, model_output, sample, answer)


def _ddim_alphas(s) -> dict[int, tuple[float, float]]:
    """Each timestep of the scheduler's schedule: its alpha and the previous one's, looked up
    once a schedule (a step looks them up each time: 0.05 ms a seat-step on a CPU host)."""
    table = s.__dict__.get("_joined_alphas")
    if table is not None and table[0] is s.timesteps:
        return table[1]
    ts = s.timesteps.cpu()
    prev = ts - s.config.num_train_timesteps // s.num_inference_steps
    alpha = s.alphas_cumprod[ts]
    alpha_prev = torch.where(prev >= 0, s.alphas_cumprod[prev.clamp(min=0)], s.final_alpha_cumprod)
    out = {t: (a, p) for t, a, p in zip(ts.tolist(), alpha.tolist(), alpha_prev.tolist(), strict=True)}
    s.__dict__["_joined_alphas"] = (s.timesteps, out)
    return out


def _ddim(key, model_output, sample, coefs):
    """DDIM's step with eta 0 (diffusers' `DDIMScheduler.step`, operation for operation)."""
    alpha, alpha_prev = coefs
    prediction, clip = key[-2], key[-1]
    out_dtype = torch.result_type(sample, model_output)
    beta = 1 - alpha
    if prediction == "epsilon":
        original = (sample - beta ** (0.5) * model_output) / alpha ** (0.5)
        epsilon = model_output
    elif prediction == "sample":
        original = model_output
        epsilon = (sample - alpha ** (0.5) * original) / beta ** (0.5)
    else:  # v_prediction
        original = (alpha**0.5) * sample - (beta**0.5) * model_output
        epsilon = (alpha**0.5) * model_output + (beta**0.5) * sample
    if clip is not None:
        original = original.clamp(-clip, clip)
    direction = (1 - alpha_prev) ** (0.5) * epsilon
    prev_sample = alpha_prev ** (0.5) * original + direction
    return prev_sample.to(out_dtype), original.to(out_dtype)


# ---------------------------------------------------------------------- flow matching Euler


def _plan_flow(s, model_output, timestep, sample, s_churn=0.0, s_tmin=0.0,
               s_tmax=float("inf"), s_noise=1.0, generator=None, per_token_timesteps=None,
               return_dict=True) -> RowStep | None:  # fmt: skip
    if per_token_timesteps is not None or s.config.stochastic_sampling:
        return None
    if _an_index(timestep):
        return None  # its own step raises the error
    if s.step_index is None:
        s._init_step_index(timestep)
    i = s.step_index
    dt = float(s.sigmas[i + 1] - s.sigmas[i])
    s._step_index += 1
    key = _layout("flow", model_output, sample)

    def answer(parts):
        return _output(s)(prev_sample=parts[0]) if return_dict else parts

    return RowStep(key, (dt,), model_output, sample, answer)


def _flow(key, model_output, sample, coefs):
    """Flow matching's Euler step (diffusers' `FlowMatchEulerDiscreteScheduler.step`)."""
    (dt,) = coefs
    return ((sample.to(torch.float32) + _narrow(dt, model_output)).to(model_output.dtype),)


# ---------------------------------------------------------------------- Euler


def _plan_euler(s, model_output, timestep, sample, s_churn=0.0, s_tmin=0.0,
                s_tmax=float("inf"), s_noise=1.0, generator=None,
                return_dict=True) -> RowStep | None:  # fmt: skip
    prediction = s.config.prediction_type
    if s_churn != 0 or prediction not in ("epsilon", "v_prediction", "sample", "original_sample"):
        return None  # noise of its own generator (s_churn), or its own step raises the error
    if _an_index(timestep):
        return None
    if s.step_index is None:
        s._init_step_index(timestep)
    sigma = s.sigmas[s.step_index]
    sigma_hat = sigma * (0.0 + 1)  # no churn: its gamma is 0
    dt = s.sigmas[s.step_index + 1] - sigma_hat
    s._step_index += 1
    coefs = (float(sigma_hat), float(dt), float(-sigma / (sigma**2 + 1) ** 0.5), float(sigma**2 + 1))
    form = "sample" if prediction == "original_sample" else prediction
    key = _layout("euler", model_output, sample, form)

    def answer(parts):
        if return_dict:
            return _output(s)(prev_sample=parts[0], pred_original_sample=parts[1])
        return parts

    return RowStep(key, coefs, model_output, sample, answer)


def _euler(key, model_output, sample, coefs):
    """Euler's step without churn (diffusers' `EulerDiscreteScheduler.step`)."""
    sigma_hat, dt, v_out, v_in = coefs
    sample = sample.to(torch.float32)
    if key[-1] == "sample":
        original = model_output
    elif key[-1] == "epsilon":
        original = sample - _narrow(sigma_hat, model_output)
    else:  # v_prediction
        original = _narrow(v_out, model_output) + (sample / v_in)
    derivative = (sample - original) / sigma_hat
    prev_sample = sample + derivative * dt
    return prev_sample.to(model_output.dtype), original


def _narrow(c: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`c * t` with `t`'s dtype, as a 0-dim coefficient gives it: computed wide, rounded to it."""
    return c * t if t.dtype == torch.float32 else (c * t.float()).to(t.dtype)


def _output(scheduler) -> type:
    """The output class of `scheduler`'s step (`DDIMSchedulerOutput`, ...), from its module."""
    module = sys.modules[type(scheduler).__module__]
    return getattr(module, type(scheduler).__name__ + "Output")


_PLANS: dict[str, Callable[..., RowStep | None]] = {
    "DDIMScheduler": _plan_ddim,
    "EulerDiscreteScheduler": _plan_euler,
    "FlowMatchEulerDiscreteScheduler": _plan_flow,
}
_COMPUTE = {"ddim": _ddim, "euler": _euler, "flow": _flow}
