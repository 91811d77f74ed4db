"""The AUTOMATIC1111 web UI's API (`/sdapi/v1/...`), the part its clients use (Open WebUI's
"Automatic1111" engine, SillyTavern, scripts): txt2img and img2img, the models, samplers,
schedulers and adapters, the caller's model (`options`), progress and interrupt.

Every request goes through the same `Core` as the OpenAI routes: the same keys (an A1111
client's Basic credentials carry the key as their password), limits, tenants, adapters and
errors (the project's error body, plus A1111's `detail` and `errors`, with A1111's field names).
What is the caller's own (its chosen model, its running request's progress, interrupt) is kept
per caller: with no keys configured every caller is one caller, so choosing the model there
changes it for everyone and is an admin route.
"""

from __future__ import annotations

import base64
import json
import math
import re
from typing import Any

from fastapi import APIRouter, Request

from serve_app.errors import InvalidRequest, NotFound, ServingError
from serve_app.formats.sources import shown_path
from serve_app.ingress.a1111_desk import A1111DeskDep, Task, preview_every
from serve_app.ingress.access import AccessPolicy
from serve_app.ingress.checks import validation_to_error
from serve_app.ingress.core import Core, CoreDep
from serve_app.ingress.openapi import ERRORS
from serve_app.ingress.ops import models as list_models
from serve_app.sampling import AUTOMATIC, SIGMA_SCHEDULES, schedule_label
from serve_app.schemas import (
    LORA_NAME_CHARS,
    LORA_SCALE,
    GenerationRequest,
    LoraRef,
    ModelDescription,
    PreparedRequest,
    new_request_id,
)
from serve_app.schemas.a1111 import (
    NOT_DONE,
    A1111Images,
    A1111Lora,
    A1111Model,
    A1111Options,
    A1111Progress,
    A1111Sampler,
    A1111Scheduler,
    Img2ImgRequest,
    Txt2ImgRequest,
)

router = APIRouter()

CHECKPOINT = "override_settings.sd_model_checkpoint"
# The project's field names in errors, as A1111's bodies name them.
_A1111_NAMES = {
    "n": "batch_size", "n (num_images)": "batch_size", "num_inference_steps": "steps",
    "guidance_scale": "cfg_scale", "strength": "denoising_strength", "image": "init_images",
    "sampler": "sampler_name", "sigma_schedule": "scheduler", "model": CHECKPOINT, "loras": "prompt",
    "lora": "prompt", "size": "width",
}  # fmt: skip
_RATES = ("images_per_minute", "image_steps_per_minute")
_TAG = re.compile(r"<lora:([^<>]*)>", re.IGNORECASE)


def a1111_error(err: ServingError) -> ServingError:
    """`err` with A1111's name for its field, in `param` and at the head of the message."""
    if m := re.fullmatch(r"references\.(\d+)", err.param or ""):  # the images after the first
        err.message = f"init_images.{int(m.group(1)) + 1}" + err.message.removeprefix(err.param)
        err.param = "init_images"
    for ours, theirs in _A1111_NAMES.items():
        if err.message.startswith(f"{ours}:"):
            err.message = theirs + err.message[len(ours) :]
            break
    err.param = _A1111_NAMES.get(err.param, err.param)
    return err


def take_loras(prompt: str, registered: dict[str, Any] | None) -> tuple[str, list[LoraRef]]:
    """The prompt without its `<lora:name>` / `<lora:name:weight>` tags, and the adapters they
    name (weight omitted: the adapter's registered scale). A malformed tag is a 400, an adapter
    not in `registered` a 404 (None: not looked up), each naming the prompt."""
    opened = len(re.findall(r"<lora:", prompt, re.IGNORECASE))
    tags = _TAG.findall(prompt)
    if opened != len(tags):
        raise InvalidRequest("prompt: a '<lora:' tag is not closed with '>'", param="prompt")
    refs: dict[str, LoraRef] = {}
    for body in tags:
        name, *rest = body.split(":")
        name = name.strip()
        if not name or len(rest) > 1:
            raise InvalidRequest(
                f"prompt: <lora:{body}> must be <lora:name> or <lora:name:weight>", param="prompt"
            )
        try:
            scale = float(rest[0]) if rest else None
        except ValueError:
            scale = math.nan
        if scale is not None and not (math.isfinite(scale) and LORA_SCALE[0] <= scale <= LORA_SCALE[1]):
            raise InvalidRequest(
                f"prompt: <lora:{name[:64]}>: the weight {rest[0][:32]!r} is not a number from "
                f"{LORA_SCALE[0]:g} to {LORA_SCALE[1]:g}",
                param="prompt",
            )
        if len(name) > LORA_NAME_CHARS:
            raise InvalidRequest(
                f"prompt: <lora:{name[:64]}...>: an adapter's name has at most {LORA_NAME_CHARS} characters",
                param="prompt",
            )
        if registered is not None and name not in registered:
            known = ", ".join(sorted(registered)) or "none"
            raise NotFound(
                f"prompt: <lora:{name}> names no registered adapter; registered: {known}", param="prompt"
            )
        if name in refs:
            raise InvalidRequest(f"prompt: <lora:{name}> is named twice", param="prompt")
        refs[name] = LoraRef(name=name, scale=scale)
    text = re.sub(r"\s{2,}", " ", _TAG.sub(" ", prompt)).strip()
    return text, list(refs.values())


def _model_name(core: Core, value: Any, field: str) -> str:
    """The served model (or a pool's checkpoint) an A1111 checkpoint title names: its name, or
    A1111's forms of it ("name.safetensors", "name [hash]"). Image models only."""
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequest(f"{field}: must be a model's name", param=field)
    for name in dict.fromkeys(
        (value, re.sub(r"\s*\[[0-9a-fA-F]+\]$", "", value).removesuffix(".safetensors"))
    ):
        try:
            served, checkpoint, _ = core.models.find(name)
        except NotFound:
            continue
        return checkpoint or served.name
    available = ", ".join(core.models.available())
    raise NotFound(f"{field}: {value[:64]!r} is not served here; available: {available}", param=field)


def _only_the_model(options: dict[str, Any], prefix: str = "") -> None:
    """Options other than `sd_model_checkpoint` may only say what they are here."""
    ours = A1111Options(sd_model_checkpoint="")
    for key, value in options.items():
        if key != "sd_model_checkpoint" and (
            key not in A1111Options.model_fields or getattr(ours, key) != value
        ):
            field = prefix + key
            raise InvalidRequest(f"{field}: cannot be set here; only sd_model_checkpoint can", param=field)


def may_choose(policy: AccessPolicy, authorization: str, client: str | None) -> ServingError | None:
    """Whether a caller may choose its model: with keys each key chooses its own; without,
    every caller is one caller and the choice is everyone's, so it takes what an admin route
    takes (an admin key, or the local opt-in)."""
    return None if policy.keys_required else policy.check_admin(authorization, client)


async def _current_model(core: Core, desk, caller: str, override: dict[str, Any]) -> str:
    """The model a request runs on: its override, else the caller's choice, else the default."""
    _only_the_model(override, "override_settings.")
    if "sd_model_checkpoint" in override:
        return _model_name(core, override["sd_model_checkpoint"], CHECKPOINT)
    chosen = desk.chosen(caller)
    if chosen is not None:
        try:
            return _model_name(core, chosen, CHECKPOINT)
        except NotFound:  # no longer served: the default
            pass
    return core.models.default.name


async def _description(core: Core, model: str) -> ModelDescription:
    info = await core.models.find(model)[0].describe()
    if info.modality != "image":
        raise InvalidRequest(
            f"{CHECKPOINT}: {model} makes videos; the A1111 routes make images", param=CHECKPOINT
        )
    return info


def _check_done(body) -> None:
    for name, allowed in NOT_DONE.items():
        value = getattr(body, name, None)
        if value not in allowed:
            raise InvalidRequest(f"{name}: not done by this server; leave it at {allowed[-1]!r}", param=name)


async def _prepare(
    core: Core, desk, body, http: Request
) -> tuple[PreparedRequest, ModelDescription, list[LoraRef]]:
    """The body as one prepared request of `batch_size` images (400s with A1111's names)."""
    _check_done(body)
    caller = core.caller(http)
    model = await _current_model(core, desk, caller, body.override_settings)
    info = await _description(core, model)
    registered = None if body.disable_extra_networks else core.registry.all()
    prompt, loras = take_loras(body.prompt, registered)
    fields: dict[str, Any] = {}
    if isinstance(body, Img2ImgRequest):
        fields = {"image": body.init_images[0], "references": body.init_images[1:], "mask": body.mask,
                  "strength": body.denoising_strength}  # fmt: skip
    seed = body.seed if body.seed >= 0 else desk.random_seed()
    try:
        request = GenerationRequest(
            prompt=prompt, negative_prompt=body.negative_prompt or None, model=model, width=body.width,
            height=body.height, num_inference_steps=body.steps, guidance_scale=body.cfg_scale, seed=seed,
            num_images=body.batch_size, sampler=body.sampler_name or body.sampler_index or None,
            sigma_schedule=body.scheduler or None, loras=loras if registered is not None else [],
            tenant=core.tenant_of(http), **fields,
        )  # fmt: skip
    except ValueError as e:  # pydantic's ValidationError
        raise a1111_error(validation_to_error(e.errors())) from None
    try:
        prepared = await core.prepare(request)
    except ServingError as e:
        raise a1111_error(e) from None
    return prepared.model_copy(update={"owner": caller}), info, loras


async def generate(core: Core, desk, body, http: Request) -> A1111Images:
    """txt2img or img2img: `n_iter` requests of `batch_size` images, one after another (image k
    has seed + k throughout), answered with A1111's body."""
    first, info, loras = await _prepare(core, desk, body, http)
    size = first.num_images
    iterations = [
        first
        if i == 0
        else first.model_copy(update={"request_id": new_request_id(), "seed": first.seed + i * size})
        for i in range(body.n_iter)
    ]
    job = "img2img" if isinstance(body, Img2ImgRequest) else "txt2img"
    task = Task(caller=first.owner, request_ids=[r.request_id for r in iterations], job=job)
    try:  # every iteration's share of the tenant's rates taken before the first runs
        place = core.tenants.admit(first, times=body.n_iter)
        async with place:
            results = await desk.run(core, task, iterations, preview_every(first.num_inference_steps))
    except InvalidRequest as e:  # more than a minute of the tenant's rates: never, so a 400 now
        if body.n_iter > 1 and e.param in _RATES:
            e.message += f" (n_iter {body.n_iter} × batch_size {body.batch_size} images)"
            e.param = "n_iter"
        raise a1111_error(e) from None
    seeds = [s for r in results for s in r.seeds]
    sampler = first.sampler or info.default_sampler or str(getattr(info, "scheduler", ""))
    used = {
        "seed": first.seed, "steps": first.num_inference_steps, "cfg_scale": first.guidance_scale,
        "width": first.width, "height": first.height, "sampler_name": sampler,
        "scheduler": schedule_label(first.sigma_schedule), "denoising_strength": first.strength,
    }  # fmt: skip
    parameters = body.model_dump(mode="json")
    if isinstance(body, Img2ImgRequest) and not body.include_init_images:
        parameters.update(init_images=None, mask=None)
    parameters.update({k: v for k, v in used.items() if k != "seed"})
    info_text = _info(body, first, used, seeds, loras, task)
    images = [r for result in results for r in result.images] if body.send_images else []
    return A1111Images(images=[_b64(b) for b in images], parameters=parameters, info=json.dumps(info_text))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _info(
    body, first: PreparedRequest, used: dict[str, Any], seeds: list[int], loras, task: Task
) -> dict[str, Any]:
    """A1111's `info` (processing's `js()`): the seeds, the settings and an infotext per image."""
    n = len(seeds)
    negative = body.negative_prompt or ""
    extra = {"Schedule type": used["scheduler"]}
    if loras:
        extra["Lora weights"] = ", ".join(
            f"{r.name}: {r.scale if r.scale is not None else 'registered'}" for r in loras
        )
    line = (
        f"Steps: {used['steps']}, Sampler: {used['sampler_name']}, Schedule type: {used['scheduler']}, "
        f"CFG scale: {used['cfg_scale']:g}, Seed: {{seed}}, Size: {used['width']}x{used['height']}, "
        f"Model: {first.checkpoint or first.model}"
        + (f", Denoising strength: {used['denoising_strength']:g}" if used["denoising_strength"] else "")
    )
    infotexts = [f"{body.prompt}\nNegative prompt: {negative}\n{line.format(seed=s)}" for s in seeds]
    return {
        "prompt": body.prompt, "all_prompts": [body.prompt] * n, "negative_prompt": negative,
        "all_negative_prompts": [negative] * n, "seed": first.seed, "all_seeds": seeds, "subseed": -1,
        "all_subseeds": [-1] * n, "subseed_strength": 0, "width": used["width"], "height": used["height"],
        "sampler_name": used["sampler_name"], "scheduler": used["scheduler"], "cfg_scale": used["cfg_scale"],
        "steps": used["steps"], "batch_size": first.num_images, "restore_faces": False,
        "face_restoration_model": None, "sd_model_name": first.checkpoint or first.model,
        "sd_model_hash": None, "sd_vae_name": None, "sd_vae_hash": None, "seed_resize_from_w": -1,
        "seed_resize_from_h": -1,
        "denoising_strength": used["denoising_strength"], "extra_generation_params": extra,
        "index_of_first_image": 0, "infotexts": infotexts, "styles": [], "job_timestamp": task.timestamp,
        "clip_skip": 1, "is_using_inpainting_conditioning": False, "version": "diffusion-serve",
        "request_ids": task.request_ids, "interrupted": task.interrupted,
    }  # fmt: skip


# ---------------------------------------------------------------------- routes


@router.post("/sdapi/v1/txt2img", response_model=A1111Images, responses=ERRORS)
async def txt2img(body: Txt2ImgRequest, http: Request, core: CoreDep, desk: A1111DeskDep) -> A1111Images:
    return await generate(core, desk, body, http)


@router.post("/sdapi/v1/img2img", response_model=A1111Images, responses=ERRORS)
async def img2img(body: Img2ImgRequest, http: Request, core: CoreDep, desk: A1111DeskDep) -> A1111Images:
    """Image-to-image, or with a `mask` inpainting, of the one image in `init_images`."""
    return await generate(core, desk, body, http)


@router.get("/sdapi/v1/sd-models", response_model=list[A1111Model], responses=ERRORS)
async def sd_models(core: CoreDep) -> list[A1111Model]:
    """The image models served, then the pools' registered checkpoints."""
    cards = (await list_models(core)).data
    return [
        A1111Model(title=c.id, model_name=c.id, filename=c.id) for c in cards if "video" not in c.modalities
    ]


@router.get("/sdapi/v1/samplers", response_model=list[A1111Sampler], responses=ERRORS)
async def samplers(http: Request, core: CoreDep, desk: A1111DeskDep) -> list[A1111Sampler]:
    """The samplers of the caller's model."""
    info = await _description(core, await _current_model(core, desk, core.caller(http), {}))
    return [
        A1111Sampler(name=s["name"], aliases=[*s["aliases"], s["scheduler"]],
                     options={"scheduler": s["scheduler"], "sigma_schedules": ",".join(s["sigma_schedules"])})
        for s in info.samplers
    ]  # fmt: skip


@router.get("/sdapi/v1/schedulers", response_model=list[A1111Scheduler], responses=ERRORS)
async def schedulers(http: Request, core: CoreDep, desk: A1111DeskDep) -> list[A1111Scheduler]:
    """The sigma schedules the samplers of the caller's model take, after `automatic` (each sampler's own)."""
    info = await _description(core, await _current_model(core, desk, core.caller(http), {}))
    taken = {x for s in info.samplers for x in s["sigma_schedules"]}
    names = [AUTOMATIC, *(s for s in SIGMA_SCHEDULES if s in taken)]
    return [A1111Scheduler(name=n, label=schedule_label(n)) for n in names]


@router.get("/sdapi/v1/loras", response_model=list[A1111Lora], responses=ERRORS)
async def loras(http: Request, core: CoreDep, desk: A1111DeskDep) -> list[A1111Lora]:
    """The adapters registered for the caller's model, as `<lora:name>` takes them."""
    model = await _current_model(core, desk, core.caller(http), {})
    owner = core.models.find(model)[0].name
    return [
        A1111Lora(name=n, alias=n, path=shown_path(e["path"], core.cfg.lora.allowed_roots))
        for n, e in sorted(core.registry.all().items())
        if core.adapter_model(e) == owner
    ]


@router.get("/sdapi/v1/options", response_model=A1111Options, responses=ERRORS)
async def get_options(http: Request, core: CoreDep, desk: A1111DeskDep) -> A1111Options:
    return A1111Options(sd_model_checkpoint=await _current_model(core, desk, core.caller(http), {}))


@router.post("/sdapi/v1/options", responses=ERRORS)
async def set_options(body: dict[str, Any], http: Request, core: CoreDep, desk: A1111DeskDep) -> None:
    """Choose the caller's model (`sd_model_checkpoint`); every other option may be sent back
    as it is. Without keys every caller is one caller: choosing is then an admin route."""
    _only_the_model(body)
    if "sd_model_checkpoint" not in body:
        return None
    name = _model_name(core, body["sd_model_checkpoint"], "sd_model_checkpoint")
    await _description(core, name)
    client = http.client.host if http.client else None
    if (refused := may_choose(core.access, http.headers.get("authorization", ""), client)) is not None:
        raise refused
    desk.choose(core.caller(http), name)
    return None


@router.get("/sdapi/v1/progress", response_model=A1111Progress, responses=ERRORS)
async def progress(
    http: Request, desk: A1111DeskDep, core: CoreDep, skip_current_image: bool = False
) -> A1111Progress:
    """The caller's own running request: its step, and a preview when one exists."""
    return desk.progress(core.caller(http), skip_current_image)


@router.post("/sdapi/v1/interrupt", responses=ERRORS)
async def interrupt(http: Request, core: CoreDep, desk: A1111DeskDep) -> dict[str, Any]:
    """Stop the caller's own running request (and its further iterations); never another key's."""
    await desk.interrupt(core, core.caller(http))
    return {}
