"""Samplers by name: the catalogue of AUTOMATIC1111's sampler names (and k-diffusion's aliases)
as diffusers schedulers, the sigma schedules, and how a request's name is read.

Plain data and string matching, no diffusers: the engine builds the schedulers
(`engine/schedulers.py`) and says which of these its model offers; the ingress reads a
request's names against that list. A name is matched without regard to case, as the A1111
name, one of its aliases, or the diffusers class name; "DPM++ 2M Karras" (A1111's older form)
is the sampler with the Karras schedule.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

AUTOMATIC = "automatic"  # the sampler's own schedule
# Sigma schedules beyond a sampler's own, and the scheduler flag that turns each on.
SIGMA_SCHEDULES = {
    "karras": "use_karras_sigmas",
    "exponential": "use_exponential_sigmas",
    "beta": "use_beta_sigmas",
}
_LABELS = {AUTOMATIC: "Automatic", "karras": "Karras", "exponential": "Exponential", "beta": "Beta"}


@dataclass(frozen=True)
class SamplerSpec:
    """One sampler: its A1111 name, the diffusers scheduler class that is it, the settings that
    make that class this sampler, and whether it is for flow-matching models (SD3, FLUX, Wan)
    or for models trained on a discrete noise schedule (SD 1.5, SDXL)."""

    name: str
    scheduler: str
    flow: bool
    options: tuple[tuple[str, Any], ...] = ()
    aliases: tuple[str, ...] = ()
    schedules: bool = True  # whether the sigma schedules apply (as the class takes them)


_FLOW = (("use_flow_sigmas", True), ("prediction_type", "flow_prediction"))
_2M = (("algorithm_type", "dpmsolver++"), ("solver_order", 2))

CATALOG: tuple[SamplerSpec, ...] = (
    SamplerSpec("Euler", "EulerDiscreteScheduler", False, aliases=("k_euler",)),
    SamplerSpec("Euler a", "EulerAncestralDiscreteScheduler", False, aliases=("k_euler_a",)),
    SamplerSpec("Heun", "HeunDiscreteScheduler", False, aliases=("k_heun",)),
    SamplerSpec("LMS", "LMSDiscreteScheduler", False, aliases=("k_lms",)),
    SamplerSpec("DPM2", "KDPM2DiscreteScheduler", False, aliases=("k_dpm_2",)),
    SamplerSpec("DPM2 a", "KDPM2AncestralDiscreteScheduler", False, aliases=("k_dpm_2_a",)),
    SamplerSpec("DPM++ 2M", "DPMSolverMultistepScheduler", False, _2M, ("k_dpmpp_2m",)),
    SamplerSpec(
        "DPM++ 2M SDE", "DPMSolverMultistepScheduler", False,
        (("algorithm_type", "sde-dpmsolver++"), ("solver_order", 2)), ("k_dpmpp_2m_sde",),
    ),
    SamplerSpec("DPM++ SDE", "DPMSolverSDEScheduler", False, aliases=("k_dpmpp_sde",)),
    SamplerSpec("DDIM", "DDIMScheduler", False, aliases=("ddim",)),
    SamplerSpec("PLMS", "PNDMScheduler", False, (("skip_prk_steps", True),), ("plms",)),
    SamplerSpec("UniPC", "UniPCMultistepScheduler", False, aliases=("unipc",)),
    SamplerSpec("DEIS", "DEISMultistepScheduler", False, aliases=("deis",)),
    # Flow matching: the model's shift carries over; only the Euler sampler takes sigma schedules
    # in flow space (the others' Karras/exponential branches compute discrete-time sigmas).
    SamplerSpec("Euler", "FlowMatchEulerDiscreteScheduler", True, aliases=("k_euler", "flow_euler")),
    SamplerSpec("Heun", "FlowMatchHeunDiscreteScheduler", True, aliases=("k_heun",), schedules=False),
    SamplerSpec("UniPC", "UniPCMultistepScheduler", True, _FLOW, ("unipc",), schedules=False),
    SamplerSpec("DPM++ 2M", "DPMSolverMultistepScheduler", True, _FLOW + _2M, ("k_dpmpp_2m",), False),
)  # fmt: skip


def schedule_label(schedule: str | None) -> str:
    """A1111's label of a schedule ("Karras"); None is the sampler's own ("Automatic")."""
    return _LABELS[schedule or AUTOMATIC]


def _key(name: str) -> str:
    return " ".join(name.lower().split())


def _find(value: str, offered: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    key = _key(value)
    for entry in offered:
        names = (entry["name"], entry["scheduler"], *entry.get("aliases", ()))
        if key in {_key(n) for n in names}:
            return entry
    return None


def resolve(
    sampler: str | None,
    schedule: str | None,
    offered: Sequence[Mapping[str, Any]],
    default: tuple[str | None, str | None],
    model: str,
) -> tuple[str | None, str | None]:
    """The (sampler, schedule) a request asks for, by the catalogue's name and schedule key
    ((None, None): neither given, the model's own scheduler). `offered` are the model's samplers
    (`name`, `scheduler`, `aliases`, `sigma_schedules`), `default` its own scheduler's (sampler,
    schedule), its sampler None when the catalogue has no name for it: a schedule alone applies
    to that sampler. ValueError, starting with the field's name and saying what the model offers."""
    if schedule is not None and _key(schedule) not in (*SIGMA_SCHEDULES, AUTOMATIC):
        allowed = ", ".join((AUTOMATIC, *SIGMA_SCHEDULES))
        raise ValueError(f"sigma_schedule: {schedule[:40]!r} is not a sigma schedule; allowed: {allowed}")
    schedule = None if schedule is None or _key(schedule) == AUTOMATIC else _key(schedule)
    if sampler is None:
        if schedule is None:
            return None, None
        if default[0] is None:
            offers = _names(offered)
            raise ValueError(f"sigma_schedule: {model}'s own scheduler takes none; name a sampler ({offers})")
        sampler = default[0]
    entry = _find(sampler, offered)
    if entry is None:  # "DPM++ 2M Karras": the sampler and a schedule in one name
        head, _, tail = _key(sampler).rpartition(" ")
        if tail in SIGMA_SCHEDULES and head and (entry := _find(head, offered)) is not None:
            if schedule is not None and schedule != tail:
                raise ValueError(f"sampler: {sampler!r} says {tail}, sigma_schedule says {schedule}")
            schedule = tail
    if entry is None:
        raise ValueError(f"sampler: {sampler[:64]!r} is not offered by {model}; it offers: {_names(offered)}")
    if schedule is not None and schedule not in entry["sigma_schedules"]:
        takes = ", ".join(entry["sigma_schedules"]) or "no other"
        raise ValueError(
            f"sigma_schedule: {entry['name']} takes {takes} schedule(s) on {model}, not {schedule}"
        )
    return entry["name"], schedule


def _names(offered: Sequence[Mapping[str, Any]]) -> str:
    return ", ".join(e["name"] for e in offered) or "none (only its own scheduler)"
