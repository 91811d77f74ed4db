"""From a prepared request to a queued job: the engine checks it, and it becomes rows and the
settings of its pipeline call.

A request the engine refuses (an `extra` it does not take, an option or embeddings shape it
cannot run) gets its 400 here, before it is queued. What the replica keeps of an accepted
request to run and answer it is its `Work`, on the job.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import torch

from serve_app.engine import CallParams, Engine, Row
from serve_app.errors import InvalidRequest
from serve_app.replica.scheduler import Job
from serve_app.schemas import EMBEDS_FIELDS, PreparedRequest


@dataclasses.dataclass(frozen=True, eq=False)
class Work:
    """A queued request as the replica runs it: the request as the ingress prepared it, and
    the settings its pipeline call runs with (without its adapters: those are on its rows)."""

    request: PreparedRequest
    params: CallParams
    engine: Engine | None = None  # a pool's checkpoint's engine; None: the replica's own


def work(job: Job) -> Work:
    """The work a replica's job carries."""
    return job.payload


def cohorts(jobs: list[Job]) -> list[list[Job]]:
    """`jobs` that join a running call at one step, in groups that share a seat (one pipeline
    call): equal `Job.key`s, in the order handed over. Keys are compared, not hashed (`extra`
    may hold lists)."""
    groups: list[list[Job]] = []
    for job in jobs:
        same = next((g for g in groups if g[0].key == job.key), None)
        if same is not None:
            same.append(job)
        else:
            groups.append([job])
    return groups


def new_job(engine: Engine, request: PreparedRequest, future: asyncio.Future, preview_every: int = 0) -> Job:
    """The job for `request`, once the engine takes its arguments (else `InvalidRequest`)."""
    extra = checked_extra(engine, request)
    embeds = checked_embeds(engine, request)
    sampler, sigma_schedule = checked_sampler(engine, request)
    rollout, (sampler, sigma_schedule) = checked_rollout(engine, request, (sampler, sigma_schedule))
    image = request.image.to_pil() if request.image is not None else None
    mask = request.mask.to_pil() if request.mask is not None else None
    refs = tuple(r.to_pil() for r in request.references)
    rows = [
        Row(
            prompt,
            request.negative_prompt,
            request.seed + k,
            **embeds,
            image=image,
            mask=mask,
            references=refs,
        )
        for prompt in request.prompts
        for k in range(request.num_images)
    ]
    params = CallParams(
        height=request.height,
        width=request.width,
        steps=request.num_inference_steps,
        guidance_scale=request.guidance_scale,
        extra=tuple(sorted(extra.items())),
        return_latents=request.return_latents,
        return_trajectory=request.return_trajectory
        or rollout is not None
        or request.return_trajectory_decoded,
        decode_trajectory=request.return_trajectory_decoded,
        rollout=rollout,
        moderation=request.moderation,
        num_frames=request.num_frames,
        task=request.task,
        strength=request.strength,
        generator_device=request.generator_device,
        vae_slicing=request.vae_use_slicing,
        vae_tiling=request.vae_use_tiling,
        acceleration=request.acceleration,
        sampler=sampler,
        sigma_schedule=sigma_schedule,
    )
    # Adapters go on the rows, not in the key: the request may share a call with other adapters.
    if request.loras:
        adapters = tuple((r.loaded_name, r.scale) for r in request.loras)
        rows = [dataclasses.replace(r, adapters=adapters) for r in rows]
    # SDXL treats an absent negative prompt differently from an empty one: keep them apart.
    kinds = (request.negative_prompt is None, *(t is None for t in embeds.values()))
    kinds = (*kinds, request.request_id) if engine.one_request_calls(params) else kinds  # its own call
    # A joined call runs each request's own pipeline call: steps, guidance, strength, the
    # sampler (each row's call has a scheduler of its own) and the outputs asked for may differ
    # between the requests that share its denoiser.
    own = dict(steps=0, guidance_scale=0.0, strength=None, return_latents=False, return_trajectory=False,
               decode_trajectory=False, sampler=None, sigma_schedule=None)  # fmt: skip
    return Job(
        request_id=request.request_id,
        rows=rows,
        key=(request.checkpoint, request.checkpoint_source, params, *kinds),
        steps=params.steps,
        future=future,
        payload=Work(request, params, engine if request.checkpoint else None),
        preview_every=preview_every,
        adapters=tuple(r.loaded_name for r in request.loras),
        join_key=(request.checkpoint, request.checkpoint_source, dataclasses.replace(params, **own), *kinds),
        owner=request.owner,
        tenant=request.tenant,
        weight=request.tenant_weight,
        priority=request.priority,
        # image-steps at its size (a 512x512 image-step is 1), frames and strength counted
        cost=len(rows)
        * params.steps
        * params.height
        * params.width
        / 512**2
        * (params.num_frames or 1)
        * (params.strength if params.strength is not None else 1.0),
    )


def checked_extra(engine: Engine, request: PreparedRequest) -> dict[str, Any]:
    """The request's `extra` pipeline arguments (with `true_cfg_scale`), once the engine takes
    them and the request's run options."""
    rid = request.request_id
    try:
        extra = engine.check_extra(request.extra, request.task)
    except ValueError as e:
        raise InvalidRequest(str(e), param="extra", request_id=rid) from None
    if request.true_cfg_scale is not None:  # vLLM-Omni's field, for the pipelines that have it
        if not engine.takes("true_cfg_scale", request.task):
            raise InvalidRequest(
                "true_cfg_scale: this model has no true classifier-free guidance; use guidance_scale",
                param="true_cfg_scale",
                request_id=rid,
            )
        extra["true_cfg_scale"] = request.true_cfg_scale
    r = request
    try:
        engine.check_options(r.generator_device, r.vae_use_slicing, r.vae_use_tiling, r.acceleration)
    except ValueError as e:  # the message starts with the field's name
        raise InvalidRequest(str(e), param=str(e).split(":")[0], request_id=rid) from None
    return extra


def checked_sampler(engine: Engine, request: PreparedRequest) -> tuple[str | None, str | None]:
    """The request's sampler and sigma schedule as the engine names them ((None, None): the
    model's own scheduler), once the engine offers them."""
    try:
        return engine.check_sampler(request.sampler, request.sigma_schedule)
    except ValueError as e:  # the message starts with the field's name
        raise InvalidRequest(str(e), param=str(e).split(":")[0], request_id=request.request_id) from None


def checked_rollout(engine: Engine, request: PreparedRequest, sampler: tuple[str | None, str | None]):
    """The request's rollout as the engine runs it (None: none) and the sampler its call takes."""
    r = request.rollout
    if r is None:
        return None, sampler
    try:
        for field in ("sampler", "sigma_schedule"):
            if getattr(request, field) is not None:
                raise ValueError(f"{field}: a rollout steps with its own sampler (rollout.sampler); leave it")
        spec, chosen = engine.check_rollout(r.sampler, r.noise_level, r.window, request.num_inference_steps)
    except ValueError as e:  # the message starts with the field's name
        raise InvalidRequest(str(e), param=str(e).split(":")[0], request_id=request.request_id) from None
    return spec, chosen


def checked_embeds(engine: Engine, request: PreparedRequest) -> dict[str, torch.Tensor | None]:
    """The request's prompt embeddings by field, once the engine takes their shapes."""
    embeds = prompt_embeds(request)
    try:
        for which in ("", "negative_"):
            if embeds[f"{which}prompt_embeds"] is not None:
                engine.check_embeds(
                    embeds[f"{which}prompt_embeds"], embeds[f"{which}pooled_prompt_embeds"], which
                )
    except ValueError as e:  # the message starts with the field's name
        raise InvalidRequest(str(e), param=str(e).split(":")[0], request_id=request.request_id) from None
    return embeds


def prompt_embeds(request: PreparedRequest) -> dict[str, torch.Tensor | None]:
    """Prompt embeddings of a handle caller by field: (1, tokens, hidden) and pooled (1, width)."""
    out = {}
    for name in EMBEDS_FIELDS:
        payload = getattr(request, name)
        t = payload.to_torch() if payload is not None else None
        unbatched = 1 if "pooled" in name else 2
        out[name] = t.unsqueeze(0) if t is not None and t.dim() == unbatched else t
    return out
