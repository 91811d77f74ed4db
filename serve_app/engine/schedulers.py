"""A scheduler per request: the samplers a model offers (`sampling.CATALOG`), each built from
the pipeline's own scheduler config (`from_config`) once per (sampler, sigma schedule).

A model offers the samplers of its kind that keep what its scheduler config says about the
model: flow-matching models (SD3, FLUX, Wan) get the flow samplers with their shift (and
resolution-dependent shifting), the others get the discrete-schedule samplers that take their
noise schedule (a zero-terminal-SNR model only those that can rescale to it). A model whose
scheduler the catalogue does not know (an LCM, a consistency model) offers only its own.
Pipelines that may hand the scheduler sigmas of their own (FLUX, LTX-Video) get only the flow samplers
that take them, and flow-matching image-to-image and inpainting pipelines, which noise their
input with the scheduler's `scale_noise`, only those that have it. `CallingScheduler` steps a
call's scheduler for a pipeline whose call takes no step callback, and calls it itself.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from serve_app.engine.types import Row
from serve_app.sampling import CATALOG, SIGMA_SCHEDULES, SamplerSpec, resolve

# What a scheduler config says about the model itself, which a sampler must keep.
_KEEPS = ("rescale_betas_zero_snr", "thresholding", "use_dynamic_shifting", "shift_terminal", "invert_sigmas")
# The settings of the pipeline's scheduler that it reads itself (FLUX's resolution shift):
# carried along to whichever sampler a request picks.
_PIPELINE_READS = ("base_image_seq_len", "max_image_seq_len", "base_shift", "max_shift")
_PREDICTIONS = ("epsilon", "v_prediction", "flow_prediction")  # what every sampler here can take


def _init_args(cls) -> frozenset[str]:
    return frozenset(inspect.signature(cls.__init__).parameters)


def _class(name: str):
    """The diffusers class, or None when its optional dependency (scipy, torchsde) is missing."""
    import diffusers
    from diffusers.utils import DummyObject

    cls = getattr(diffusers, name, None)
    return None if cls is None or isinstance(cls, DummyObject) else cls


def _is_flow(config: dict[str, Any], cls_name: str) -> bool:
    return (
        cls_name.startswith("FlowMatch")
        or bool(config.get("use_flow_sigmas"))
        or config.get("prediction_type") == "flow_prediction"
    )


def _hands_sigmas(pipe) -> bool:
    """Whether the pipeline sets its scheduler's timesteps from sigmas: it takes `sigmas`, or its
    call hands them over itself (LTX-Video's)."""
    if "sigmas" in inspect.signature(pipe.__call__).parameters:
        return True
    try:
        return "sigmas=" in inspect.getsource(type(pipe).__call__)
    except (OSError, TypeError):  # no source at hand: take the signature's word
        return False


def _schedule_of(config: dict[str, Any]) -> str | None:
    return next((s for s, flag in SIGMA_SCHEDULES.items() if config.get(flag)), None)


def _beta_ok() -> bool:
    from diffusers.utils import is_scipy_available

    return is_scipy_available()


class Schedulers:
    """The samplers one engine offers, and their schedulers, built on first use and kept.
    `base` is the pipeline's scheduler (the model's own); `task_pipes` its pipelines."""

    def __init__(self, base, task_pipes: dict[str, Any], model: str):
        self.base = base
        self._config = dict(base.config)
        name = type(base).__name__
        self.flow = _is_flow(self._config, name)
        self.model = f"{model} (a flow-matching model)" if self.flow else model  # as messages name it
        hands_sigmas = any(_hands_sigmas(p) for p in task_pipes.values())
        self._needs = {
            "sigmas": self.flow and hands_sigmas,
            "scale_noise": self.flow and bool({"img2img", "inpaint"} & set(task_pipes)),
        }
        kind = [s for s in CATALOG if s.flow == self.flow]
        known = any(s.scheduler == name for s in kind)
        self.offered: list[SamplerSpec] = [s for s in kind if known and self._usable(s)]
        own = next((s for s in self.offered if s.scheduler == name and self._same(s)), None)
        self.default = (own.name if own else None, _schedule_of(self._config))
        self._described = [
            dict(name=s.name, scheduler=s.scheduler, aliases=s.aliases, sigma_schedules=self.schedules(s))
            for s in self.offered
        ]
        self._built: dict[tuple[str, str | None], Any] = {}

    def _usable(self, spec: SamplerSpec) -> bool:
        cls = _class(spec.scheduler)
        if cls is None:
            return False
        takes = _init_args(cls)
        if any(self._config.get(k) and k not in takes for k in _KEEPS):
            return False
        if self._config.get("prediction_type", "epsilon") not in _PREDICTIONS:
            return False
        if self._needs["sigmas"] and "sigmas" not in inspect.signature(cls.set_timesteps).parameters:
            return False
        return not self._needs["scale_noise"] or hasattr(cls, "scale_noise")

    def _same(self, spec: SamplerSpec) -> bool:
        return all(self._config.get(k) == v for k, v in spec.options)

    def schedules(self, spec: SamplerSpec) -> list[str]:
        """The sigma schedules `spec` takes (beyond its own)."""
        if not spec.schedules:
            return []
        takes = _init_args(_class(spec.scheduler))
        return [s for s, flag in SIGMA_SCHEDULES.items() if flag in takes and (s != "beta" or _beta_ok())]

    def describe(self) -> list[dict[str, Any]]:
        """Each offered sampler: `name`, `scheduler` (the diffusers class), `aliases`, `sigma_schedules`."""
        return [
            dict(d, aliases=list(d["aliases"]), sigma_schedules=list(d["sigma_schedules"]))
            for d in self._described
        ]

    def check(self, sampler: str | None, schedule: str | None) -> tuple[str | None, str | None]:
        """The canonical (sampler, schedule) of a request, (None, None) for the model's own
        scheduler (also when it names exactly that); ValueError naming the field and what this
        model offers."""
        chosen = resolve(sampler, schedule, self._described, self.default, self.model)
        return (None, None) if chosen == self.default else chosen

    def get(self, sampler: str | None, schedule: str | None):
        """The scheduler of (sampler, schedule) as `check` gave them: the model's own for
        (None, None), else one built once from its config."""
        if sampler is None:
            return self.base
        key = (sampler, schedule)
        if key not in self._built:
            self._built[key] = self._build(next(s for s in self.offered if s.name == sampler), schedule)
        return self._built[key]

    def _build(self, spec: SamplerSpec, schedule: str | None):
        cls = _class(spec.scheduler)
        takes = _init_args(cls)
        config = {k: v for k, v in self._config.items() if k in takes}
        if self.flow:  # the model's shift, under each class's name for it
            shift = self._config.get("shift", self._config.get("flow_shift", 1.0))
            config.update({k: shift for k in ("shift", "flow_shift") if k in takes})
        config.update(dict(spec.options))
        config.update({flag: s == schedule for s, flag in SIGMA_SCHEDULES.items() if flag in takes})
        with torch.device("cpu"):  # schedulers keep their tables on the CPU
            scheduler = cls.from_config(config)
        reads = {k: self._config[k] for k in _PIPELINE_READS if k in self._config and k not in takes}
        if reads:
            scheduler.register_to_config(**reads)
        return scheduler


def seed_noise(scheduler, rows: list[Row]) -> None:
    """Samplers that draw their noise from a Brownian tree (DPM++ SDE) take no generator: seed
    one tree per row from its seed, so that an image depends on its own seed alone."""
    if hasattr(scheduler, "noise_sampler_seed"):
        scheduler.noise_sampler_seed = [r.seed for r in rows]


class CallingScheduler:
    """A call's scheduler that calls the step-end callback after each of its steps, with the
    step's result as the latents: the step hooks (events, previews, abort, trajectories) of a
    pipeline whose call takes no `callback_on_step_end`. Anything else is the scheduler's own."""

    def __init__(self, inner, pipe, callback):
        self.__dict__.update(inner=inner, pipe=pipe, callback=callback, steps=0)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        setattr(self.inner, name, value)

    def step(self, model_output, timestep, sample, *args, **kwargs):
        out = self.inner.step(model_output, timestep, sample, *args, **kwargs)
        latents = out[0] if isinstance(out, tuple) else out.prev_sample
        i = self.__dict__["steps"]
        self.__dict__["steps"] = i + 1
        self.callback(self.pipe, i, timestep, {"latents": latents})
        return out
