"""The HTTP API compatible with OpenAI's: the bodies of the images and videos routes, which map
onto the Python API (`to_generation_request`), their answer (`ImagesResponse`), the model list
and the error body. Extension fields are grouped and marked."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from serve_app.config import Acceleration
from serve_app.errors import InvalidRequest
from serve_app.schemas.base import MemoryKind, OutputFormat, Prompt, Prompts, rules
from serve_app.schemas.generation import BatchGenerationRequest, GenerationParams, GenerationRequest
from serve_app.schemas.internal import StageMetrics
from serve_app.schemas.payloads import InputImage, TensorPayload, Trajectory

# OpenAI's `quality` as a step-caching level (`auto`, `standard`: the deployment's default).
QUALITY_ACCELERATION: dict[str, Acceleration | None] = {
    "high": "none", "hd": "none", "medium": "fast", "low": "faster", "auto": None, "standard": None
}  # fmt: skip


# The other way: the OpenAI quality a request was served at, from its step-caching level.
SERVED_QUALITY = {"none": "high", "fast": "medium", "faster": "low"}


# `size` in the document; ASCII digits and spaces only, so that Python and ECMA-262 agree.
SIZE_PATTERN = r"^(auto| *[0-9]{1,5} *[xX] *[0-9]{1,5} *)$"


def parse_size(size: str) -> tuple[int, int]:
    """`"512x768"` -> (width=512, height=768)."""
    m = re.fullmatch(r" *([0-9]{1,5}) *[xX] *([0-9]{1,5}) *", size)
    if not m:
        raise ValueError("must look like 'WIDTHxHEIGHT', e.g. '512x512', or be 'auto'")
    return int(m.group(1)), int(m.group(2))


# The rules of every image body that JSON Schema cannot say (`x-constraints`); a 400 for one
# names its `param`. The deployment's own bounds (limits) are in the document as maximums.
_MODEL_RULES = (
    ("size", "width × height (given, or from `size`) is at most the deployment's limits.max_pixels; "
     "`size` agrees with width and height when they are given too"),
    ("width", "from `size`: at most limits.max_side"),
    ("height", "from `size`: at most limits.max_side"),
    ("num_frames", "only a video model takes it, a count its frame rule a·k+b allows (GET /v1/models), "
     "at most limits.max_frames"),
    ("fps", "only a video model takes it"),
    ("output_format", "png, jpeg or webp for an image model; mp4, webp or gif for a video model"),
    ("sampler", "one the model offers (GET /v1/models lists each model's samplers)"),
    ("sigma_schedule", "one the request's sampler takes (GET /v1/models)"),
    ("lora", "registered for the model the request goes to (404: not registered at all)"),
    ("loras", "each registered for the model the request goes to and named once (with `lora`), at most "
     "lora.max_per_request; not on a pool's checkpoint"),
    ("extra", "keyword arguments the model's pipeline takes (checked by the engine)"),
    ("true_cfg_scale", "only a model with true classifier-free guidance (FLUX) takes it"),
    ("generator_device", "cpu, or the model's own device"),
    ("acceleration", "a level the model offers (GET /v1/models: accelerations)"),
    ("rollout.sampler", "sde or cps for a flow-matching model, ddim for the others"),
    ("rollout.noise_level", "at most 1"),
    ("rollout.window", "[start, stop] with start ≤ stop ≤ the request's steps"),
    ("rollout", "a model a rollout's sampler can be built for (its scheduler config)"),
    ("request_id", "not the id of a request queued or running now"),
    ("priority", "at most the tenant's max_priority"),
    ("return_trajectory_decoded", "an image model (not a video model)"),
    ("webhook", "only with `Prefer: respond-async`; its host is one of jobs.webhook_hosts"),
    ("webhook_events", "only with `webhook` and `Prefer: respond-async`"),
    ("stream", "not with `Prefer: respond-async` (a job streams from GET /v1/jobs/{id}/events)"),
    ("images_per_minute", "the request's images at most a minute of its tenant's images_per_minute"),
    ("image_steps_per_minute", "its images × steps at most a minute of its tenant's image_steps_per_minute"),
)  # fmt: skip
_EDIT_RULES = (
    ("image", "a PNG, JPEG or WebP file (or base64, or a data: URL of one), 8×8 to limits.max_input_pixels "
     "pixels, for a model that takes an input image"),
    ("mask", "like `image`, its size, for a model that inpaints"),
    ("strength", "num_inference_steps × strength ≥ 1 where the model runs whole steps of it (SD, SDXL); "
     "an instruction-edit model (FLUX.1 Kontext) takes none"),
)  # fmt: skip


class _ImagesCommon(GenerationParams):
    """The OpenAI Images fields, plus this server's sampling parameters (`GenerationParams`)."""

    # OpenAI fields
    model: str | None = Field(None, max_length=256)
    num_images: int = Field(1, ge=1, alias="n", description="Images per prompt (OpenAI `n`).")
    size: str | None = Field(
        None,
        description="'WIDTHxHEIGHT' or 'auto'; each side a multiple of 8, at least 8.",
        json_schema_extra={"pattern": SIZE_PATTERN},
    )
    response_format: Literal["b64_json", "url"] = Field(
        "b64_json", description="'url': signed links to the stored images (valid `jobs.url_ttl_s`)."
    )
    quality: Literal["auto", "high", "medium", "low", "hd", "standard"] | None = Field(
        None,
        description="OpenAI's quality: `high`/`hd` turn step caching off, `medium` is `acceleration: "
        "fast`, `low` is `faster`; `auto`/`standard` leave the deployment's default. "
        "`acceleration` wins when both are given.",
    )
    background: Literal["transparent", "opaque", "auto"] | None = Field(
        None,
        description="`opaque` or `auto`; the models served here make no transparent images.",
        json_schema_extra={"enum": ["opaque", "auto", None]},  # `transparent`: a 400 naming it
    )
    # OpenAI fields accepted for compatibility and ignored by diffusion models
    style: str | None = None
    user: str | None = None
    # Extensions: streaming
    stream: bool = Field(
        False, description="Answer with Server-Sent Events: a step event per step, then the result."
    )
    preview_every: int = Field(0, ge=0, description="With `stream`: a preview image every k steps (0: none).")
    # Extensions: asynchronous jobs (with the header `Prefer: respond-async`)
    webhook: str | None = Field(
        None, max_length=2048, description="Asynchronous jobs: a URL to POST the job to when it finishes."
    )
    webhook_events: list[Literal["start", "progress", "completed"]] | None = Field(
        None, max_length=3, description="Which events call the webhook (default: completed)."
    )
    partial_images: int | None = Field(
        None,
        ge=0,
        le=3,
        description="With `stream`: speak OpenAI's image stream (`image_generation.partial_image` "
        "events, then `image_generation.completed` per image) with this many partial images.",
    )

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """JSON `null` for any field means it was not set (OpenAI's clients send it for a
        parameter passed as None): the field's default applies."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    @field_validator("size")
    @classmethod
    def _size_form(cls, v: str | None) -> str | None:
        if v is not None and v != "auto":
            w, h = parse_size(v)
            if min(w, h) < 8 or w % 8 or h % 8:
                raise ValueError(f"{w}x{h}: each side must be a multiple of 8, at least 8")
        return v

    def _params(self) -> dict[str, Any]:
        """The `GenerationParams` of this body, `size` folded into width and height."""
        if self.background == "transparent":
            raise InvalidRequest(
                "background: 'transparent' is not something these diffusion models make; send "
                "'opaque' or 'auto'",
                param="background",
            )
        params = {name: getattr(self, name) for name in GenerationParams.model_fields}
        if self.acceleration is None and self.quality is not None:
            params["acceleration"] = QUALITY_ACCELERATION[self.quality]
        if self.size and self.size != "auto":
            w, h = parse_size(self.size)
            if (self.width is not None and self.width != w) or (self.height is not None and self.height != h):
                raise InvalidRequest(
                    f"size: {self.size} disagrees with width/height; give one or the other", param="size"
                )
            params.update(width=w, height=h)
        return params


class ImagesGenerationRequest(_ImagesCommon):
    """Body of `POST /v1/images/generations`."""

    model_config = ConfigDict(json_schema_extra=rules(*_MODEL_RULES))

    prompt: Prompt
    strength: SkipJsonSchema[float | None] = None  # edits only: refused here with a 400 naming it

    def to_generation_request(self) -> GenerationRequest:
        """Build the Python API request; its validators run again on the mapped fields."""
        return GenerationRequest(prompt=self.prompt, **self._params())


class ImagesEditRequest(_ImagesCommon):
    """Body of `POST /v1/images/edits`, as a multipart form (files `image` or `image[]` and `mask`)
    or as JSON (the images as base64 or `data:` URLs). A mask makes it an inpainting; without
    one, an edit model (FLUX.1 Kontext) edits by the prompt and other models remake the image
    (image-to-image, `strength`)."""

    model_config = ConfigDict(json_schema_extra=rules(*_MODEL_RULES, *_EDIT_RULES))

    prompt: Prompt
    image: list[InputImage] = Field(
        min_length=1,
        max_length=16,
        description="The image to edit; several (`image[]` repeated) for models that take reference images.",
    )
    mask: InputImage | None = Field(None, description="Where to paint: transparent (alpha) or white.")
    # OpenAI edit fields accepted for compatibility and ignored by diffusion models
    input_fidelity: str | None = None

    @field_validator("image", mode="before")
    @classmethod
    def _one_or_more(cls, v: Any) -> Any:
        return v if isinstance(v, list) else [v]

    def to_generation_request(self) -> GenerationRequest:
        return GenerationRequest(
            prompt=self.prompt,
            image=self.image[0],
            references=self.image[1:],
            mask=self.mask,
            **self._params(),
        )


class VideosGenerationRequest(ImagesGenerationRequest):
    """Body of `POST /v1/videos/generations`: a prompt (and for an image-to-video model the image
    to start from) to a video model, answered when the video is made; `POST /v1/videos` takes
    the same fields as OpenAI's video job (`schemas.videos`)."""

    model_config = ConfigDict(
        json_schema_extra=rules(*_MODEL_RULES, ("model", "a video model (default: the default model)"))
    )

    seconds: float | None = Field(
        None,
        gt=0,
        le=600,
        description="Length; sets `num_frames` at the model's rule (at least one step of it, however "
        "short) and `fps`.",
    )
    partial_images: SkipJsonSchema[int | None] = None  # an image stream's: refused with a 400 naming it
    input_reference: InputImage | None = Field(
        None,
        description="Image-to-video models: the image the video starts from (a file in a form; base64, a "
        'data: URL or OpenAI\'s `{"image_url": <data: URL>}` in JSON).',
    )

    @field_validator("input_reference", mode="before")
    @classmethod
    def _reference(cls, v: Any) -> Any:
        if isinstance(v, dict):  # OpenAI's ImageInputReferenceParam
            if set(v) != {"image_url"}:
                raise ValueError("takes {'image_url': <a data: URL>} (no file ids: there is no files API)")
            v = v["image_url"]
        if isinstance(v, str) and v.startswith(("http://", "https://")):
            raise ValueError("a data: URL or base64, not a link (the server fetches nothing)")
        return v

    def to_generation_request(self) -> GenerationRequest:
        return GenerationRequest(prompt=self.prompt, image=self.input_reference, **self._params())


class ImagesBatchRequest(_ImagesCommon):
    """Body of `POST /v1/images/generations/batch`: several prompts, one parameter set."""

    model_config = ConfigDict(json_schema_extra=rules(*_MODEL_RULES))

    prompts: Prompts
    strength: SkipJsonSchema[float | None] = None  # edits only: refused here with a 400 naming it

    def to_generation_request(self) -> BatchGenerationRequest:
        return BatchGenerationRequest(prompts=self.prompts, **self._params())


class ImageData(BaseModel):
    b64_json: str | None = None
    url: str | None = None
    revised_prompt: str | None = None
    # Extensions
    seed: int
    prompt_index: int


class InputTokensDetails(BaseModel):
    image_tokens: int = 0
    text_tokens: int = 0


class ImagesUsage(BaseModel):
    """OpenAI's token counts. A diffusion model counts no tokens: always zeros."""

    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    total_tokens: int = 0


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
    # OpenAI's gpt-image fields: what was served
    size: str | None = Field(None, description="'WIDTHxHEIGHT' of the images made.")
    quality: Literal["high", "medium", "low"] | None = Field(
        None, description="The quality served: `high` without step caching, `medium` and `low` with it."
    )
    background: Literal["opaque"] | None = None
    usage: ImagesUsage | None = Field(None, description="Zeros: a diffusion model counts no tokens.")
    # Extensions
    model: str
    request_id: str
    output_format: OutputFormat
    metrics: StageMetrics
    peak_memory_mb: float
    peak_memory_kind: MemoryKind
    latents: TensorPayload | None = None
    trajectory: Trajectory | None = None
    attempts: int = 1
    policy_version: int | None = Field(None, description="The pushed adapter's version it was made with.")
    weights_version: int | None = Field(
        None, description="The pushed denoiser weights' version it was made with."
    )


class SamplerCard(BaseModel):
    """A sampler a model offers (the request's `sampler`) and the sigma schedules it takes."""

    name: str = Field(description="AUTOMATIC1111's name.")
    scheduler: str = Field(description="The diffusers scheduler class it is.")
    aliases: list[str] = Field(default_factory=list, description="Other names a request may give.")
    sigma_schedules: list[str] = Field(
        default_factory=list, description="`sigma_schedule` values it takes besides its own ('automatic')."
    )


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "diffusion-serve"
    # Extensions
    source: str
    family: str = Field(
        description="sd, sdxl, sd3, flux, flux2, wan, qwen-image, z-image, ltx, hunyuan-video, or the "
        "pipeline's class for others."
    )
    modalities: list[Literal["image", "video"]] = Field(description="What the model makes.")
    tasks: list[str] = Field(description="generate, and the edits it does: img2img, inpaint, edit.")
    inputs: list[str] = Field(description="What a request may give the model (embeddings: handle calls).")
    reference_images: bool = Field(False, description="An edit takes several images of one prompt.")
    embeds_shapes: dict[str, list[int]] | None = Field(
        None, description="Shapes of `prompt_embeds` (and `pooled_prompt_embeds`) the model takes."
    )
    default_height: int
    default_width: int
    default_steps: int
    default_num_frames: int | None = None
    aliases: list[str] = Field(default_factory=list, description="Other names `model` may give for it.")
    accelerations: list[Acceleration] = Field(
        default_factory=lambda: ["none"], description="The `acceleration` levels the model offers."
    )
    samplers: list[SamplerCard] = Field(
        default_factory=list, description="The samplers a request may name (`sampler`); empty: only its own."
    )
    default_sampler: str | None = Field(
        None, description="The sampler of the model's own scheduler (None: one without a name here)."
    )
    default_sigma_schedule: str | None = None
    denoiser_bytes: int | None = Field(
        None, description="Bytes the denoiser's weights hold on the device (quantized ones as stored)."
    )
    denoiser_weights: list[str] = Field(
        default_factory=list,
        description="The types the denoiser's weights are held in, most bytes first: float16, bfloat16, "
        "Q8_0 or Q4_0 (a GGUF file's), ...",
    )
    ready: bool = Field(True, description="Whether a replica serves it now (else requests for it get 503).")
    pool: str | None = Field(
        None, description="A registered checkpoint's pool model: it runs on that pool's replicas, "
        "loaded when a request first names it.",
    )  # fmt: skip


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int
    request_id: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
