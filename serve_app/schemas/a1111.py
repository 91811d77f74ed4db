"""The AUTOMATIC1111 web UI's API, the part its clients use (`/sdapi/v1/...`): the txt2img and
img2img bodies with A1111's field names, and the answers those clients read.

The bodies name every field A1111 takes. What this server does: prompt, negative prompt, seed
(-1: random), sampler and schedule, steps, CFG scale, size, batch size and iterations, the
input image, mask and denoising strength, `override_settings.sd_model_checkpoint` and
`<lora:name:weight>` in the prompt. What it does not do (hires fix, face restoration, tiling,
scripts, variation seeds, ...) is taken at A1111's default (a client that sends every field
sends those) and refused with a 400 naming the field otherwise (`NOT_DONE`). Fields that only
steer A1111's own files and UI (saving, comments, the second pass's settings while it is off)
are taken and have no effect. Keys A1111 does not know are ignored, as A1111 ignores them
(clients forward bodies built for other servers and extensions); a known field with a bad value
is a 400 naming it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from serve_app.schemas.base import MAX_SEED, NOT_BLANK, Prompt, _Wire, rules

CHECKPOINT_FIELD = "override_settings.sd_model_checkpoint"

# Fields taken only at these values (A1111's defaults, and what clients send for "off").
NOT_DONE: dict[str, tuple[Any, ...]] = {
    "styles": (None, []),
    "subseed_strength": (None, 0, 0.0),
    "seed_resize_from_h": (None, -1, 0),
    "seed_resize_from_w": (None, -1, 0),
    "restore_faces": (None, False),
    "tiling": (None, False),
    "eta": (None,),
    "s_min_uncond": (None, 0, 0.0),
    "s_churn": (None, 0, 0.0),
    "s_tmax": (None, 0, 0.0),
    "s_tmin": (None, 0, 0.0),
    "s_noise": (None, 1, 1.0),
    "refiner_checkpoint": (None, ""),
    "refiner_switch_at": (None,),
    "enable_hr": (None, False),
    "firstpass_image": (None, ""),
    "script_name": (None, ""),
    "script_args": (None, []),
    "alwayson_scripts": (None, {}),
    # img2img
    "image_cfg_scale": (None,),
    "initial_noise_multiplier": (None, 1, 1.0),
    "latent_mask": (None, ""),
    "inpainting_mask_invert": (None, 0),
}


# The rules JSON Schema cannot say (`x-constraints`), by the A1111 names the 400s give.
_RULES = (
    ("prompt", "its `<lora:name>` / `<lora:name:weight>` tags well formed (a weight from -10 to 10), each "
     "naming an adapter registered for the model, once; the prompt without them not empty, at most "
     "limits.max_prompt_chars"),
    ("width", "width × height at most the deployment's limits.max_pixels"),
    ("sampler_name", "one the model offers (GET /sdapi/v1/samplers), `sampler_index` too"),
    ("scheduler", "one the sampler takes (GET /sdapi/v1/schedulers)"),
    (CHECKPOINT_FIELD, "an image model served here (or a pool's checkpoint): 404 for an unknown one"),
    ("n_iter", "n_iter × batch_size images at most a minute of the tenant's rates"),
    ("images_per_minute", "the images at most a minute of the tenant's images_per_minute"),
    ("image_steps_per_minute", "images × steps at most a minute of the tenant's image_steps_per_minute"),
)  # fmt: skip
_IMG2IMG_RULES = (
    ("init_images", "a PNG, JPEG or WebP file as base64 (or a data: URL), 8×8 to limits.max_input_pixels "
     "pixels, for a model that takes an input image"),
    ("mask", "like the image, its size, for a model that inpaints"),
    ("denoising_strength", "steps × denoising_strength ≥ 1 where the model runs whole steps of it "
     "(SD, SDXL)"),
)  # fmt: skip


def _declared(schema: dict[str, Any], extra: tuple[tuple[str, str], ...]) -> None:
    """The body's document: the fields taken only at their defaults (`NOT_DONE`) as enums of
    those values, and its `x-constraints`."""
    for name, allowed in NOT_DONE.items():
        if name in schema.get("properties", {}):
            # once each (0 and 0.0 are one JSON value)
            schema["properties"][name]["enum"] = [v for i, v in enumerate(allowed) if v not in allowed[:i]]
    schema.update(rules(*_RULES, *extra))


def options_schema() -> dict[str, Any]:
    """What `override_settings` and `POST /sdapi/v1/options` take: `sd_model_checkpoint`, and
    the other options only at the values this server has (`A1111Options`)."""
    ours = A1111Options(sd_model_checkpoint="")
    props: dict[str, Any] = {
        "sd_model_checkpoint": {"type": "string", "pattern": NOT_BLANK, "description": "A model served here."}
    }
    for name in A1111Options.model_fields:
        if name != "sd_model_checkpoint":
            props[name] = {"enum": [getattr(ours, name)], "description": "Only this server's value."}
    return {"type": "object", "properties": props, "additionalProperties": False}


class _A1111Common(_Wire):
    """What txt2img and img2img share, with A1111's names; None: the model's default."""

    model_config = ConfigDict(extra="ignore", json_schema_extra=lambda schema: _declared(schema, ()))

    prompt: Prompt = Field(
        description="The prompt; `<lora:name:weight>` applies a registered adapter. Not empty without "
        "its tags."
    )
    negative_prompt: str | None = None
    seed: int = Field(-1, ge=-1, le=MAX_SEED, description="-1: random (a 32-bit seed, as A1111 draws).")
    sampler_name: str | None = Field(None, max_length=64, description="e.g. 'Euler a', 'DPM++ 2M Karras'.")
    sampler_index: str | None = Field(None, max_length=64, description="A1111's older name for sampler_name.")
    scheduler: str | None = Field(
        None, max_length=32, description="'Automatic', 'Karras', 'Exponential', 'Beta'."
    )
    batch_size: int = Field(1, ge=1, description="Images per iteration (one pipeline call's worth).")
    n_iter: int = Field(1, ge=1, le=100, description="Iterations, one after another.")
    steps: int | None = Field(None, ge=1)
    cfg_scale: float | None = Field(None, ge=0)
    width: int | None = Field(None, ge=8, multiple_of=8)
    height: int | None = Field(None, ge=8, multiple_of=8)
    denoising_strength: float | None = Field(
        None,
        gt=0,
        le=1,
        description="img2img: how much to repaint; int(steps × denoising_strength) at least 1 where the "
        "model runs whole steps of it (SD, SDXL).",
    )
    override_settings: dict[str, Any] = Field(
        default_factory=dict,
        description="Only `sd_model_checkpoint` (a model or checkpoint served here).",
        json_schema_extra=lambda schema: schema.update(options_schema()),
    )
    send_images: bool = Field(True, description="False: the answer carries no images.")
    disable_extra_networks: bool = Field(
        False, description="True: `<lora:...>` tags are removed, not applied."
    )
    # Taken, and without effect here: A1111's files, UI and the second pass's settings.
    save_images: bool = False
    do_not_save_samples: bool = False
    do_not_save_grid: bool = False
    override_settings_restore_afterwards: bool = True
    comments: dict[str, Any] | None = None
    force_task_id: str | None = None
    infotext: str | None = None
    subseed: int = -1
    hr_scale: float | None = None
    hr_upscaler: str | None = None
    hr_second_pass_steps: int | None = None
    hr_resize_x: int | None = None
    hr_resize_y: int | None = None
    hr_checkpoint_name: str | None = None
    hr_sampler_name: str | None = None
    hr_scheduler: str | None = None
    hr_prompt: str | None = None
    hr_negative_prompt: str | None = None
    hr_additional_modules: list[str] | None = None
    firstphase_width: int | None = None
    firstphase_height: int | None = None
    # Not done here: taken at their defaults only (NOT_DONE).
    styles: list[str] | None = None
    subseed_strength: float | None = None
    seed_resize_from_h: int | None = None
    seed_resize_from_w: int | None = None
    restore_faces: bool | None = None
    tiling: bool | None = None
    eta: float | None = None
    s_min_uncond: float | None = None
    s_churn: float | None = None
    s_tmax: float | None = None
    s_tmin: float | None = None
    s_noise: float | None = None
    refiner_checkpoint: str | None = None
    refiner_switch_at: float | None = None
    enable_hr: bool | None = None
    firstpass_image: str | None = None
    script_name: str | None = None
    script_args: list[Any] | None = None
    alwayson_scripts: dict[str, Any] | None = None


class Txt2ImgRequest(_A1111Common):
    """Body of `POST /sdapi/v1/txt2img`."""


class Img2ImgRequest(_A1111Common):
    """Body of `POST /sdapi/v1/img2img`: `init_images` (base64 or data URLs: one, or several for
    a model that takes reference images), and a `mask` (white where to paint) for inpainting."""

    model_config = ConfigDict(json_schema_extra=lambda schema: _declared(schema, _IMG2IMG_RULES))

    init_images: list[str] = Field(
        min_length=1,
        max_length=16,
        description="The image to remake; several for a model that takes reference images (the first is "
        "fitted to the size).",
    )
    mask: str | None = Field(None, description="Base64 image: white where to paint (inpainting).")
    include_init_images: bool = False
    # Taken, and without effect here: how A1111 fits, blurs and fills its masks.
    resize_mode: int = 0
    mask_blur: int | None = None
    mask_blur_x: int | None = None
    mask_blur_y: int | None = None
    mask_round: bool | None = None
    inpainting_fill: int | None = None
    inpaint_full_res: bool | int | None = None
    inpaint_full_res_padding: int | None = None
    # Not done here: taken at their defaults only (NOT_DONE).
    image_cfg_scale: float | None = None
    initial_noise_multiplier: float | None = None
    latent_mask: str | None = None
    inpainting_mask_invert: int | None = None


class A1111Images(BaseModel):
    """The answer of txt2img and img2img: base64 PNGs, the request's parameters as used, and
    `info`, a JSON string (`seed`, `all_seeds`, `infotexts`, ...) as A1111 writes it."""

    images: list[str]
    parameters: dict[str, Any]
    info: str


class A1111ProgressState(BaseModel):
    skipped: bool = False
    interrupted: bool = False
    job: str = ""
    job_count: int = 0
    job_timestamp: str = "0"
    job_no: int = 0
    sampling_step: int = 0
    sampling_steps: int = 0


class A1111Progress(BaseModel):
    """`GET /sdapi/v1/progress`: the caller's own running request."""

    progress: float = 0.0
    eta_relative: float = 0.0
    state: A1111ProgressState = Field(default_factory=A1111ProgressState)
    current_image: str | None = Field(
        None, description="A low-resolution preview (base64 PNG) when one exists."
    )
    textinfo: str | None = None
    current_task: str | None = None


class A1111Model(BaseModel):
    title: str
    model_name: str
    hash: str | None = None
    sha256: str | None = None
    filename: str
    config: str | None = None


class A1111Sampler(BaseModel):
    name: str
    aliases: list[str]
    options: dict[str, str]


class A1111Scheduler(BaseModel):
    name: str
    label: str
    aliases: list[str] | None = None
    default_rho: float | None = -1
    need_inner_model: bool | None = False


class A1111Lora(BaseModel):
    name: str
    alias: str
    path: str
    metadata: dict[str, Any] = Field(default_factory=dict)


class A1111Options(BaseModel):
    """The options this server has (a client may post them back as they are); only
    `sd_model_checkpoint` can be changed: the caller's model."""

    model_config = ConfigDict(extra="allow")

    sd_model_checkpoint: str
    sd_checkpoint_hash: str | None = None
    samples_format: str = "png"
    CLIP_stop_at_last_layers: int = 1
    eta_noise_seed_delta: int = 0
    sd_vae: str = "Automatic"
