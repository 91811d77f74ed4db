"""Checks of a request against the deployment and the model, before any replica sees it.

Static bounds are pydantic constraints in the wire schema; these are the ones that depend on
the configuration (limits) or on the model's description (its tasks, modality, frame rule).
"""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi import Request

from serve_app.config import Limits
from serve_app.errors import InvalidRequest
from serve_app.sampling import resolve
from serve_app.schemas import (
    IMAGE_FORMATS,
    REQUEST_ID_PATTERN,
    VIDEO_FORMATS,
    BatchGenerationRequest,
    GenerationParams,
    GenerationRequest,
    ModelDescription,
    PreparedRequest,
    odd_json,
)


def validation_to_error(errors: list[dict[str, Any]]) -> InvalidRequest:
    """Pydantic's error list -> one 400 naming each field and what it allows."""
    parts, first = [], None
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        name = ".".join(loc) or "body"
        first = first or name
        msg = err.get("msg", "invalid").removeprefix("Value error, ")
        parts.append(f"{name}: {msg}")
    return InvalidRequest("; ".join(parts) or "invalid request", param=first)


def validated(model, data: Any):
    """`model` built from `data`, or the 400 that names what is wrong."""
    try:
        return model.model_validate(data)
    except ValueError as e:  # pydantic ValidationError is a ValueError
        raise validation_to_error(e.errors()) from None


def _over(name: str, value, most, param: str | None = None) -> InvalidRequest:
    return InvalidRequest(f"{name}: {value} is outside 1..{most}", param=param or name)


def check_limits(req: GenerationParams, limits: Limits, prompts: list[str]) -> None:
    """Bounds that depend on the deployment; static ones are pydantic constraints."""
    for side in ("width", "height"):
        v = getattr(req, side)
        if v is not None and v > limits.max_side:
            raise InvalidRequest(f"{side}: {v} is above the maximum {limits.max_side}", param=side)
    if req.width is not None and req.height is not None and req.width * req.height > limits.max_pixels:
        raise InvalidRequest(
            f"size: {req.width}x{req.height} is {req.width * req.height} pixels, above the maximum "
            f"{limits.max_pixels}",
            param="size",
        )
    if req.num_inference_steps is not None and req.num_inference_steps > limits.max_steps:
        raise _over("num_inference_steps", req.num_inference_steps, limits.max_steps)
    if req.num_images > limits.max_images:
        raise _over("n (num_images)", req.num_images, limits.max_images, param="n")
    if req.guidance_scale is not None and req.guidance_scale > limits.max_guidance_scale:
        raise InvalidRequest(
            f"guidance_scale: {req.guidance_scale} is outside 0..{limits.max_guidance_scale}",
            param="guidance_scale",
        )
    if len(prompts) > limits.max_prompts:
        raise InvalidRequest(
            f"prompts: {len(prompts)} prompts, the maximum is {limits.max_prompts}", param="prompts"
        )
    for key, value in req.extra.items():
        # Custom `timesteps` or `sigmas` set the number of steps as surely as num_inference_steps.
        if isinstance(value, list | tuple) and len(value) > limits.max_steps:
            raise InvalidRequest(
                f"extra.{key}: {len(value)} items, the maximum is {limits.max_steps}", param=f"extra.{key}"
            )
    negative = req.negative_prompt
    if negative is not None and len(negative) > limits.max_prompt_chars:
        raise InvalidRequest(
            f"negative_prompt: {len(negative)} characters, the maximum is {limits.max_prompt_chars}",
            param="negative_prompt",
        )
    for p in prompts:
        if len(p) > limits.max_prompt_chars:
            raise InvalidRequest(
                f"prompt: {len(p)} characters, the maximum is {limits.max_prompt_chars}", param="prompt"
            )


# The families whose steps `return_trajectory_decoded` decodes (their VAE decodes one step's
# latents as it decodes the last: tests/test_rollout.py).
DECODED_FAMILIES = ("sd", "sdxl", "sd3", "flux")


def check_inputs(
    req: GenerationRequest | BatchGenerationRequest, info: ModelDescription, limits: Limits
) -> None:
    """What the model's pipeline call takes: a negative prompt, a guidance scale, a text-only
    request (one that starts from an image does not), several images (reference-image models)."""
    refs = req.references
    if req.image is not None and info.image_input != "rows" and len(req.prompts) > 1:
        raise InvalidRequest(
            f"prompts: {info.model} ({info.pipeline}) edits one prompt's images at a time", param="prompts"
        )
    if refs and not info.reference_images:
        raise InvalidRequest(
            f"image: {1 + len(refs)} images; {info.model} ({info.pipeline}) takes one", param="image"
        )
    if 1 + len(refs) > limits.max_input_images:
        raise InvalidRequest(
            f"image: {1 + len(refs)} images; at most {limits.max_input_images} (limits.max_input_images)",
            param="image",
        )
    if req.negative_prompt and "negative_prompt" not in info.inputs:  # "" is none
        raise InvalidRequest(
            f"negative_prompt: {info.model} ({info.pipeline}) takes none", param="negative_prompt"
        )
    if req.guidance_scale is not None and not info.takes_guidance:
        raise InvalidRequest(
            f"guidance_scale: {info.model} ({info.pipeline}) is guided by its guider, not per request",
            param="guidance_scale",
        )
    if req.image is None and "generate" not in info.tasks:
        raise InvalidRequest(f"image: {info.model} ({info.pipeline}) starts from an image", param="image")


def edit_task(req: GenerationRequest | BatchGenerationRequest, info: ModelDescription) -> str:
    """Which task an image request is for this model: inpainting with a mask, else the model's
    own instruction edit if it is an edit model, else image-to-image."""
    if req.mask is not None:
        if "inpaint" not in info.tasks:
            raise InvalidRequest(f"mask: {info.model} ({info.pipeline}) cannot inpaint", param="mask")
        return "inpaint"
    task = "edit" if "edit" in info.tasks else "img2img"
    if task not in info.tasks:
        raise InvalidRequest(f"image: {info.model} ({info.pipeline}) takes no input image", param="image")
    if task == "edit" and req.strength is not None:
        raise InvalidRequest(
            f"strength: {info.model} edits by instruction and takes no strength", param="strength"
        )
    return task


def check_media(req: GenerationParams, info: ModelDescription, limits: Limits) -> None:
    """What the model makes decides the output formats and whether frames and fps mean anything."""
    fmt = req.output_format
    if info.modality == "image":
        for name in ("num_frames", "fps"):
            if getattr(req, name) is not None:
                raise InvalidRequest(f"{name}: {info.model} makes images, not videos", param=name)
        if fmt is not None and fmt not in IMAGE_FORMATS:
            raise InvalidRequest(
                f"output_format: {fmt!r} is a video format; {info.model} makes images "
                f"({', '.join(IMAGE_FORMATS)})",
                param="output_format",
            )
        return
    if fmt is not None and fmt not in VIDEO_FORMATS:
        raise InvalidRequest(
            f"output_format: {info.model} makes videos: {', '.join(VIDEO_FORMATS)}, not {fmt!r}",
            param="output_format",
        )
    n = req.num_frames
    a, b = info.frame_rule or (1, 0)
    if n is not None and (n > limits.max_frames or n < b or (n - b) % a):
        examples = ", ".join(str(a * k + b) for k in (1, 2, 3))
        raise InvalidRequest(
            f"num_frames: {n} does not fit {info.model}, which takes {a}k+{b} frames ({examples}, ...) "
            f"up to {limits.max_frames}",
            param="num_frames",
        )


def check_edit_steps(req: PreparedRequest, info: ModelDescription) -> None:
    """An edit runs the last `strength` of its steps; where the pipeline counts whole steps
    (`int(steps × strength)`, SD and SDXL) fewer than one would run none, and is refused here
    rather than failing inside the pipeline."""
    rule = info.edit_strength.get(req.task)
    if not rule or not rule.get("whole_steps"):
        return
    steps = req.num_inference_steps
    strength = req.strength if req.strength is not None else rule["default"]
    if int(steps * strength) >= 1:
        return
    more = ""
    if strength >= 1e-6:  # else no number of steps would do
        least = math.ceil(1 / strength)
        while int(least * strength) < 1:
            least += 1
        more = f" or num_inference_steps to at least {least}"
    given = "" if req.strength is not None else " (the default)"
    least_strength = math.ceil(1000 / steps) / 1000  # 3 decimals, rounded up: one whole step
    raise InvalidRequest(
        f"strength: {strength:g}{given} of {steps} steps runs no denoising step: {info.model} runs "
        f"int(num_inference_steps × strength) steps; raise strength to at least {least_strength:g}{more}",
        param="strength",
    )


def check_sampler(req: GenerationParams, info: ModelDescription) -> tuple[str | None, str | None]:
    """The request's sampler and sigma schedule by the model's names for them, if the model
    offers them (a 400 naming the field and listing what it offers otherwise)."""
    label = f"{info.model} (a flow-matching model)" if info.sampler_kind == "flow" else info.model
    default = (info.default_sampler, info.default_sigma_schedule)
    try:
        return resolve(req.sampler, req.sigma_schedule, info.samplers, default, label)
    except ValueError as e:  # the message starts with the field's name
        raise InvalidRequest(str(e), param=str(e).split(":")[0]) from None


def check_path_id(request_id: str) -> None:
    if not REQUEST_ID_PATTERN.fullmatch(request_id):
        raise InvalidRequest(
            "request_id: must be 1-128 characters of letters, digits, '.', '_', ':' or '-'",
            param="request_id",
        )


FORM_JSON = ("extra", "lora", "rollout")  # fields that are objects: JSON text inside a form


async def read_edit_body(request: Request) -> dict[str, Any]:
    """An edit request's fields from a multipart form or a JSON body."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype in ("multipart/form-data", "application/x-www-form-urlencoded"):
        try:
            form = await request.form(max_files=17, max_fields=64)  # 16 images (schema) and a mask
        except Exception as e:  # a malformed form: starlette raises several types
            why = type(e).__name__
            raise InvalidRequest(f"body: not a readable multipart form ({why})", param="body") from None
        return await _form_fields(form)
    if ctype in ("application/json", ""):
        try:
            body = await request.json()
        except ValueError:
            raise InvalidRequest("body: not valid JSON", param="body") from None
        if not isinstance(body, dict):
            raise InvalidRequest("body: must be a JSON object", param="body")
        return body
    raise InvalidRequest(
        f"body: content-type {ctype!r} is not taken; send multipart/form-data or application/json",
        param="body",
    )


async def _form_fields(form) -> dict[str, Any]:
    out: dict[str, Any] = {}
    images = []
    for key, value in form.multi_items():
        data = await value.read() if hasattr(value, "read") else value
        if key in ("image", "image[]"):
            images.append(data)
        elif key in out:
            raise InvalidRequest(f"{key}: given more than once", param=key)
        elif key in FORM_JSON and isinstance(data, str):
            try:
                out[key] = json.loads(data)
            except ValueError:
                raise InvalidRequest(f"{key}: a JSON object in a form field", param=key) from None
            if (odd := odd_json(data.encode("utf-8", "surrogatepass"))) is not None:
                raise InvalidRequest(f"{key}{odd[0]}: {odd[1]}", param=f"{key}{odd[0]}")
        elif key == "priority" and isinstance(data, str) and data.isdecimal() and data.isascii():
            out[key] = int(data)  # a level in a form is text; its names stay text
        else:
            out[key] = data
    if images:
        out["image"] = images
    return out
