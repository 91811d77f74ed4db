"""Rollouts for RL post-training: stochastic sampling whose every transition has a known
log-probability (the original's `trajectory_log_probs`).

Each stochastic step draws `x' = mean + std * z` (z standard normal, from the row's own noise
stream), so its log-probability is that of a Gaussian, taken per element and averaged over the
row's elements, in float32: `mean(-(x' - mean)^2 / (2 std^2) - log std - log sqrt(2 pi))`.

- `sde` (flow-matching models; Flow-GRPO's SDE): with `s = sigma_t`, `s' = sigma_{t+1}`,
  `dt = s' - s` (negative) and `a = noise_level * sqrt(s / (1 - s))` (the `s` under `1 -` read
  as the schedule's second sigma where `s = 1`),
  `mean = x (1 + a^2 dt / (2 s)) + v (1 + a^2 (1 - s) / (2 s)) dt` and `std = a sqrt(-dt)`, `v`
  the guided velocity the pipeline hands its scheduler.
- `cps` (flow-matching; coefficients-preserving sampling): `std = s' sin(noise_level pi / 2)`,
  `mean = (1 - s') (x - s v) + sqrt(s'^2 - std^2) (x + (1 - s) v)`.
- `ddim` (epsilon and v-prediction models): diffusers' DDIM step with `eta = noise_level`; the
  mean is its step without noise, `std = eta sqrt(variance)`.

Steps outside `window` (and those whose std is 0: the last step of `cps`) are the sampler's
deterministic step (Euler, DDIM at eta 0) and have no log-probability. Rows draw their noise from
a generator seeded from their own seed, so a row's rollout is the same alone or in a group.
Nothing here runs for a call without a rollout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from serve_app.engine.types import InvalidArguments, RolloutSpec

SAMPLERS = ("sde", "cps", "ddim")
FLOW_SAMPLERS = ("sde", "cps")
MIN_NOISE = 0.01  # below it float32 log-densities lose their meaning
DEFAULT_NOISE = {"sde": 0.7, "cps": 0.7, "ddim": 1.0}  # Flow-GRPO's noise level; DDPO's eta
_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)
_NOISE_SEED = 0x9E3779B97F4A7C15  # mixes a row's seed into its rollout noise seed


def noise_seed(seed: int) -> int:
    """The seed of a row's rollout noise: apart from every row's initial noise (seed + k)."""
    return (seed * 6364136223846793005 + _NOISE_SEED) % 2**63


@dataclass
class RolloutRecord:
    """What a rollout call gives back: the latents before the first step, the steps that were
    stochastic and, per row, each one's log-probability (rows, k)."""

    start: torch.Tensor | None = None
    steps: list[int] = field(default_factory=list)
    log_probs: list[torch.Tensor] = field(default_factory=list)  # one (rows,) per stochastic step

    def table(self) -> torch.Tensor:
        if not self.log_probs:
            return torch.zeros((0 if self.start is None else self.start.shape[0], 0))
        return torch.stack(self.log_probs, dim=1)


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor | float) -> torch.Tensor:
    """Per row: the element-wise Gaussian log-density of `x` under (`mean`, `std`), averaged."""
    x, mean = x.float(), mean.float()
    std = torch.as_tensor(std, dtype=torch.float32, device=x.device)
    lp = -((x - mean) ** 2) / (2 * std**2) - torch.log(std) - _LOG_SQRT_2PI
    return lp.mean(dim=tuple(range(1, lp.dim())))


class RolloutScheduler:
    """The call's scheduler with its `step` replaced by the rollout's (see the module); anything
    else is the scheduler's own. `generators`: one per row, where its noise is drawn."""

    def __init__(self, inner, spec: RolloutSpec, generators: Sequence[torch.Generator]):
        own = dict(inner=inner, spec=spec, generators=list(generators), record=RolloutRecord(), _i=0)
        self.__dict__.update(own)  # its own attributes; every other one is the scheduler's

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        setattr(self.inner, name, value)

    def step(self, model_output, timestep, sample, *args, return_dict: bool = True, **kwargs):
        from diffusers.schedulers.scheduling_utils import SchedulerOutput

        i = self._i
        self.__dict__["_i"] = i + 1
        if self.record.start is None:
            self.record.start = sample.detach().float().cpu()
        start, stop = self.spec.window or (0, 1 << 30)
        if not start <= i < stop:
            return self.inner.step(model_output, timestep, sample, *args, return_dict=return_dict, **kwargs)
        if self.spec.sampler == "ddim":
            prev, mean, std = self._ddim(model_output, timestep, sample)
        else:
            prev, mean, std = self._flow(model_output, timestep, sample)
        if prev is None:  # std 0: the step is deterministic
            return self.inner.step(model_output, timestep, sample, *args, return_dict=return_dict, **kwargs)
        prev = prev.to(sample.dtype)  # what the next step and the trajectory get: its log-prob
        self.record.steps.append(i)
        self.record.log_probs.append(gaussian_log_prob(prev, mean, std).cpu())
        return SchedulerOutput(prev_sample=prev) if return_dict else (prev,)

    def _noise(self, like: torch.Tensor) -> torch.Tensor:
        rows = len(self.generators)
        if like.shape[0] != rows:
            raise RuntimeError(f"a rollout step got {like.shape[0]} rows for {rows} generators")
        shape = like.shape[1:]
        z = [torch.randn(shape, generator=g, device=g.device, dtype=torch.float32) for g in self.generators]
        return torch.stack(z).to(like.device)

    def _flow(self, v, timestep, x):
        inner = self.inner
        if inner.step_index is None:
            inner._init_step_index(timestep)
        sigmas = inner.sigmas.float()
        s, s_next = float(sigmas[inner.step_index]), float(sigmas[inner.step_index + 1])
        s_first = float(sigmas[1]) if len(sigmas) > 1 else 0.0
        if not 0 <= s_next < s <= 1 or (s == 1 and not 0 < s_first < 1):  # sigmas from `extra`, say
            raise InvalidArguments(f"rollout: the schedule's sigmas {s}, {s_next} are no flow-matching step")
        x32, v32 = x.float(), v.float()
        if self.spec.sampler == "sde":
            dt = s_next - s
            a = self.spec.noise_level * math.sqrt(s / (1 - (s_first if s >= 1.0 else s)))
            mean = x32 * (1 + a**2 * dt / (2 * s)) + v32 * (1 + a**2 * (1 - s) / (2 * s)) * dt
            std = a * math.sqrt(-dt)
        else:
            std = s_next * math.sin(self.spec.noise_level * math.pi / 2)
            noise_part = math.sqrt(max(s_next**2 - std**2, 0.0))
            mean = (1 - s_next) * (x32 - s * v32) + noise_part * (x32 + (1 - s) * v32)
        if std <= 0:
            return None, None, None
        inner._step_index += 1
        return mean + std * self._noise(x), mean, std

    def _ddim(self, eps, timestep, x):
        inner = self.inner
        eta = self.spec.noise_level
        prev_t = timestep - inner.config.num_train_timesteps // inner.num_inference_steps
        std = eta * float(inner._get_variance(timestep, prev_t)) ** 0.5
        if std <= 0:
            return None, None, None
        mean = inner.step(eps, timestep, x, eta=eta, variance_noise=torch.zeros_like(x)).prev_sample.float()
        return mean + std * self._noise(x), mean, std


def check_rollout(
    schedulers, sampler: str | None, noise_level: float | None, window: tuple[int, int] | None, steps: int
) -> tuple[RolloutSpec, tuple[str | None, None]]:
    """A request's rollout as the engine runs it, and the sampler its call takes ((None, None):
    the model's own scheduler, which is the one the rollout steps); ValueError starting with the
    field's name. Defaults: sde (flow-matching models) or ddim, at `DEFAULT_NOISE`."""
    flow = schedulers.flow
    sampler = sampler or ("sde" if flow else "ddim")
    noise_level = DEFAULT_NOISE.get(sampler, 0.7) if noise_level is None else noise_level
    if sampler not in SAMPLERS:
        raise ValueError(f"rollout.sampler: {sampler!r} is not one of {', '.join(SAMPLERS)}")
    if (sampler in FLOW_SAMPLERS) != flow:
        takes = " or ".join(FLOW_SAMPLERS) if flow else "ddim"
        raise ValueError(f"rollout.sampler: {schedulers.model} takes {takes}, not {sampler!r}")
    if not MIN_NOISE <= noise_level <= 1:
        raise ValueError(f"rollout.noise_level: {noise_level} is not in [{MIN_NOISE}, 1]")
    if window is not None and not 0 <= window[0] <= window[1] <= steps:
        raise ValueError(
            f"rollout.window: {list(window)} is not [start, stop] within [0, {steps}] (the steps)"
        )
    wanted = "FlowMatchEulerDiscreteScheduler" if flow else "DDIMScheduler"
    spec = RolloutSpec(sampler, float(noise_level), tuple(window) if window is not None else None)
    if type(schedulers.base).__name__ == wanted:
        return spec, (None, None)
    name = next((s.name for s in schedulers.offered if s.scheduler == wanted), None)
    if name is None:
        raise ValueError(f"rollout: {schedulers.model} offers no {wanted} to step a rollout with")
    return spec, (name, None)
