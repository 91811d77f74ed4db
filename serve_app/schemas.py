"""The wire format: every request and result that crosses a process boundary.

Two families live here:

* the Python API (`GenerationRequest`, `BatchGenerationRequest`, `GenerationResult`), used by
  handle callers and passed from the ingress to the replicas;
* the HTTP API, compatible with the OpenAI Images API (`ImagesGenerationRequest`,
  `ImagesResponse`), whose extension fields are grouped and marked below.

Static checks (types, ranges that never change) are pydantic constraints; bounds that depend
on the deployment (max pixels, max steps, ...) are checked by the ingress against `Limits`.
"""

from __future__ import annotations

import base64
import io
import re
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    field_validator,
    model_validator,
)

from serve_app.config import Acceleration
from serve_app.errors import InvalidRequest

OutputFormat = Literal["png", "jpeg", "webp", "mp4", "gif"]
# OpenAI's `quality` as a step-caching level (`auto`, `standard`: the deployment's default).
QUALITY_ACCELERATION: dict[str, Acceleration | None] = {
    "high": "none", "hd": "none", "medium": "fast", "low": "faster", "auto": None, "standard": None
}  # fmt: skip
IMAGE_FORMATS = ("png", "jpeg", "webp")
VIDEO_FORMATS = ("mp4", "webp", "gif")  # webp: animated
MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp", "gif": "image/gif",
               "mp4": "video/mp4"}  # fmt: skip
MemoryKind = Literal["cuda", "cpu_rss"]
MAX_SEED = 2**62
REQUEST_ID_PATTERN = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def new_request_id() -> str:
    return "img-" + uuid.uuid4().hex[:24]


def _check_request_id(v: str | None) -> str | None:
    if v is not None and not REQUEST_ID_PATTERN.match(v):
        raise ValueError("must be 1-128 characters of letters, digits, '.', '_', ':' or '-'")
    return v


def _check_prompt(v: str) -> str:
    if not v.strip():
        raise ValueError("must not be empty")
    return v


def _check_prompts(v: list[str]) -> list[str]:
    for i, p in enumerate(v):
        if not p.strip():
            raise ValueError(f"prompt {i} must not be empty")
    return v


def _b64decode(v: Any) -> Any:
    return base64.b64decode(v, validate=True) if isinstance(v, str) else v


# Bytes that travel as standard, padded base64 in JSON (pydantic's own choice is URL-safe).
B64Bytes = Annotated[
    bytes,
    BeforeValidator(_b64decode),
    PlainSerializer(lambda b: base64.b64encode(b).decode("ascii"), return_type=str, when_used="json"),
]
Prompt = Annotated[str, AfterValidator(_check_prompt)]
Prompts = Annotated[list[str], Field(min_length=1), AfterValidator(_check_prompts)]
RequestId = Annotated[str | None, AfterValidator(_check_request_id)]
Extra = Annotated[
    dict[str, Any], Field(description="More keyword arguments for the pipeline call, checked by the engine.")
]


def _bad_text(v: Any, at: str = "") -> str | None:
    """Where in `v` a string holds text no encoder takes (a lone surrogate such as `\\ud800`,
    which JSON can spell), or None."""
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            return at or "it"
    elif isinstance(v, dict):
        for k, item in v.items():
            if (found := _bad_text(k, f"{at}.{k!s}"[:80]) or _bad_text(item, f"{at}.{k!s}")) is not None:
                return found
    elif isinstance(v, list | tuple):
        for i, item in enumerate(v):
            if (found := _bad_text(item, f"{at}[{i}]")) is not None:
                return found
    return None


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _valid_text(cls, v: Any) -> Any:
        """Every string field holds real text: a 400 naming the field, not a tokenizer's 500."""
        if (at := _bad_text(v)) is not None:
            where = "" if at == "it" else f" (at {at.lstrip('.')})"
            raise ValueError(f"must be valid Unicode text{where}: a lone surrogate such as \\ud800 is not")
        return v


# --------------------------------------------------------------------------- tensors


class TensorPayload(_Wire):
    """A tensor as raw little-endian bytes, so it travels as JSON (base64) or through Ray."""

    shape: list[int]
    dtype: str
    data: B64Bytes

    @classmethod
    def from_tensor(cls, t: Any) -> TensorPayload:
        arr = t.detach().to("cpu").float().contiguous().numpy()
        return cls(shape=list(arr.shape), dtype=str(arr.dtype), data=arr.tobytes())

    def to_numpy(self):
        import numpy as np

        return np.frombuffer(self.data, dtype=self.dtype).reshape(self.shape)

    def to_torch(self):
        import torch

        return torch.from_numpy(self.to_numpy().copy())


class PixelPayload(_Wire):
    """A decoded image as raw 8-bit pixels: what the ingress hands a replica after it has checked
    and fitted an input image (the replica never decodes a caller's file)."""

    width: int
    height: int
    mode: Literal["RGB", "L"]
    data: B64Bytes

    @classmethod
    def from_pil(cls, im: Any) -> PixelPayload:
        return cls(width=im.width, height=im.height, mode=im.mode, data=im.tobytes())

    def to_pil(self) -> Any:
        from PIL import Image

        return Image.frombytes(self.mode, (self.width, self.height), self.data)


def _image_bytes(v: Any) -> Any:
    """An input image as the bytes of an image file, from what a caller may hand over: bytes,
    base64 text or a `data:` URL, a PIL image, or a `TensorPayload` (channels first or last,
    values in 0..1 or 0..255). The file itself is checked where it is decoded (the ingress)."""
    if isinstance(v, bytes | bytearray):
        return bytes(v)
    if isinstance(v, str):
        text = v.split(",", 1)[1] if v.startswith("data:") and "," in v else v
        try:
            return base64.b64decode(text, validate=True)
        except ValueError:
            raise ValueError("must be base64 or a data: URL of an image file") from None
    if isinstance(v, dict) and {"shape", "dtype", "data"} <= set(v):
        v = TensorPayload.model_validate(v)
    if isinstance(v, TensorPayload):
        import numpy as np
        from PIL import Image

        arr = v.to_numpy()
        if arr.ndim == 3 and arr.shape[0] in (1, 3, 4) and arr.shape[-1] not in (1, 3, 4):
            arr = np.moveaxis(arr, 0, -1)
        if arr.ndim not in (2, 3):
            raise ValueError(f"a tensor image must be (H, W), (H, W, C) or (C, H, W), not {tuple(arr.shape)}")
        if arr.dtype != np.uint8:
            scale = 255.0 if float(np.nanmax(arr, initial=0)) <= 1.0 else 1.0
            arr = np.clip(np.nan_to_num(arr) * scale, 0, 255).round().astype(np.uint8)
        v = Image.fromarray(arr.squeeze(-1) if arr.ndim == 3 and arr.shape[-1] == 1 else arr)
    if hasattr(v, "save") and hasattr(v, "size"):  # a PIL image
        buf = io.BytesIO()
        v.save(buf, format="PNG", compress_level=1)
        return buf.getvalue()
    raise ValueError("must be image file bytes, base64 or a data: URL, a PIL image or a TensorPayload")


InputImage = Annotated[
    bytes,
    BeforeValidator(_image_bytes),
    PlainSerializer(lambda b: base64.b64encode(b).decode("ascii"), return_type=str, when_used="json"),
]


class Trajectory(_Wire):
    """Latents after every denoising step, with the timestep of each."""

    timesteps: list[float]
    latents: list[TensorPayload]


# --------------------------------------------------------------------------- Python API


_LORA_ALIASES = {"lora_name": "name", "adapter": "name", "lora_scale": "scale", "lora_path": "path",
                 "local_path": "path"}  # fmt: skip


class LoraRef(_Wire):
    """Apply a registered adapter to this request only. vLLM-Omni's names for the same fields
    (`lora_name`, `adapter`, `lora_scale`, `lora_path`, `local_path`, `int_id`) are taken too."""

    name: str = Field(min_length=1, max_length=64)

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        out = {k: x for k, x in v.items() if k not in _LORA_ALIASES and k not in ("int_id", "lora_int_id")}
        for alias, field in _LORA_ALIASES.items():
            if alias in v and field not in out:
                out[field] = v[alias]
        return out

    scale: float | None = Field(None, ge=-10, le=10, description="Default: the adapter's registered scale.")
    path: str | None = Field(None, description="Filled in by the server from the registry; ignored if sent.")


class GenerationParams(_Wire):
    """Sampling parameters shared by every prompt of one request."""

    negative_prompt: str | None = None
    height: int | None = Field(None, ge=8, multiple_of=8, description="Pixels; default: the model's.")
    width: int | None = Field(None, ge=8, multiple_of=8, description="Pixels; default: the model's.")
    num_inference_steps: int | None = Field(None, ge=1, description="Default: the model's.")
    guidance_scale: float | None = Field(None, ge=0, description="Default: the model's.")
    seed: int | None = Field(
        None, ge=0, le=MAX_SEED, description="Image k of each prompt uses seed + k; default: random."
    )
    num_images: int = Field(1, ge=1, description="Images per prompt (OpenAI `n`).")
    output_format: OutputFormat | None = Field(
        None, description="Default: png for an image model, mp4 for a video model (webp and gif too)."
    )
    num_frames: int | None = Field(None, ge=1, description="Video models: frames; default: the model's.")
    strength: float | None = Field(
        None, gt=0, le=1, description="Edits (image-to-image, inpainting): how much of the input to repaint."
    )
    # vLLM-Omni's extension fields, so that its clients work unchanged
    true_cfg_scale: float | None = Field(
        None, ge=0, le=50, description="True classifier-free guidance, for the pipelines that have it (FLUX)."
    )
    generator_device: Literal["cpu", "cuda"] | None = Field(
        None, description="Where seeded noise is drawn; default the model's device. `cpu` matches CPU runs."
    )
    vae_use_slicing: bool = Field(False, description="Decode a batch one image at a time (less memory).")
    vae_use_tiling: bool = Field(False, description="Decode in tiles (less memory for large images).")
    fps: int | None = Field(None, ge=1, le=120, description="Video models: frames per second of the file.")
    return_latents: bool = False
    return_trajectory: bool = False
    request_id: RequestId = None
    extra: Extra = Field(default_factory=dict)
    lora: LoraRef | None = None
    loras: list[LoraRef] = Field(
        default_factory=list, description="Several adapters at once, each at its scale (with `lora` too)."
    )
    acceleration: Acceleration | None = Field(
        None,
        description="Step caching: `fast` and `faster` reuse the denoiser's block outputs across steps "
        "(quicker, a little less faithful); default: the deployment's `model.optimizations.step_cache`.",
    )


class _ImageInputs(_Wire):
    """An input image, for image-to-image and instruction edits, and a mask for inpainting
    (white, or transparent in an image with alpha, where to paint). Sizes default to the image's."""

    image: InputImage | None = Field(None, description="The image to edit.")
    mask: InputImage | None = Field(None, description="Where to paint: transparent (alpha) or white.")

    @model_validator(mode="after")
    def _mask_needs_image(self):
        if self.mask is not None and self.image is None:
            raise ValueError("mask needs an image to paint into")
        return self


class GenerationRequest(_ImageInputs, GenerationParams):
    """One prompt; `num_images` images of it.

    Instead of text, a handle caller (an upstream language-model stage, say) may pass
    `prompt_embeds` (and `negative_prompt_embeds`) of the shape the model's text encoders make,
    (1, tokens, hidden), with `pooled_prompt_embeds` (1, width) for the families that also
    condition on a pooled vector (SDXL, SD3, FLUX); `prompt` is then only a label.
    `GET /v1/models` and `describe()` give the shapes.
    """

    prompt_embeds: TensorPayload | None = None
    negative_prompt_embeds: TensorPayload | None = None
    pooled_prompt_embeds: TensorPayload | None = None
    negative_pooled_prompt_embeds: TensorPayload | None = None
    prompt: str = ""  # after the embeddings, so that its check can see them

    @field_validator("prompt")
    @classmethod
    def _text_or_embeds(cls, v: str, info) -> str:
        if info.data.get("prompt_embeds") is None:
            _check_prompt(v)
            for name in ("negative_prompt_embeds", "pooled_prompt_embeds", "negative_pooled_prompt_embeds"):
                if info.data.get(name) is not None:
                    raise ValueError(f"{name} needs prompt_embeds too")
        return v

    @property
    def prompts(self) -> list[str]:
        return [self.prompt]


class BatchGenerationRequest(_ImageInputs, GenerationParams):
    """Several prompts, one parameter set, one engine call, one merged result."""

    prompts: Prompts


EMBEDS_FIELDS = (
    "prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds", "negative_pooled_prompt_embeds"
)  # fmt: skip


class PreparedRequest(_Wire):
    """What the ingress hands a replica: one request with every default filled in, once.

    The ingress fixes the id and the seed (so that a retried request makes the same image),
    the model's defaults and the adapter's registered scale and file; the replica uses the
    fields as they are.
    """

    request_id: str
    prompts: list[str]
    negative_prompt: str | None
    height: int
    width: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    num_images: int
    output_format: OutputFormat
    num_frames: int | None = None  # video models only, like fps
    fps: int | None = None
    task: Literal["generate", "img2img", "inpaint", "edit"] = "generate"
    strength: float | None = None
    true_cfg_scale: float | None = None
    generator_device: str | None = None
    vae_use_slicing: bool = False
    vae_use_tiling: bool = False
    image: PixelPayload | None = None  # decoded and fitted to width x height by the ingress
    mask: PixelPayload | None = None  # "L", the same size
    return_latents: bool = False
    return_trajectory: bool = False
    extra: dict[str, Any] = Field(default_factory=dict)
    loras: list[LoraRef] = Field(default_factory=list)  # by name, each with its scale and path resolved
    acceleration: Acceleration = "none"
    prompt_embeds: TensorPayload | None = None
    negative_prompt_embeds: TensorPayload | None = None
    pooled_prompt_embeds: TensorPayload | None = None
    negative_pooled_prompt_embeds: TensorPayload | None = None
    # Whose request it is (the ingress's digest of the caller's key; "" for handle callers and
    # callers without a key): only its owner (and the admin) may read its state or abort it.
    owner: str = ""

    @classmethod
    def from_request(
        cls,
        request: GenerationRequest | BatchGenerationRequest,
        *,
        request_id: str,
        seed: int,
        height: int,
        width: int,
        steps: int,
        guidance_scale: float,
        output_format: str = "png",
        num_frames: int | None = None,
        fps: int | None = None,
        loras: list[LoraRef] | None = None,
        task: str = "generate",
        image: PixelPayload | None = None,
        mask: PixelPayload | None = None,
        acceleration: str = "none",
    ) -> PreparedRequest:
        """`request` with the given values wherever it left a field to the server."""
        return cls(
            request_id=request.request_id or request_id,
            prompts=request.prompts,
            negative_prompt=request.negative_prompt,
            height=request.height or height,
            width=request.width or width,
            num_inference_steps=request.num_inference_steps or steps,
            guidance_scale=request.guidance_scale if request.guidance_scale is not None else guidance_scale,
            seed=request.seed if request.seed is not None else seed,
            num_images=request.num_images,
            output_format=request.output_format or output_format,
            num_frames=request.num_frames or num_frames,
            fps=request.fps or fps,
            task=task,
            strength=request.strength,
            true_cfg_scale=request.true_cfg_scale,
            generator_device=request.generator_device,
            vae_use_slicing=request.vae_use_slicing,
            vae_use_tiling=request.vae_use_tiling,
            image=image,
            mask=mask,
            return_latents=request.return_latents,
            return_trajectory=request.return_trajectory,
            extra=request.extra,
            loras=loras or [],
            acceleration=request.acceleration or acceleration,
            **{name: getattr(request, name, None) for name in EMBEDS_FIELDS},
        )


class StageMetrics(_Wire):
    """Where the time of one request went, in milliseconds."""

    queue_ms: float = 0.0
    text_encode_ms: float = 0.0
    denoise_ms: float = 0.0
    vae_decode_ms: float = 0.0
    image_encode_ms: float = 0.0
    total_ms: float = 0.0
    batch_images: int = Field(0, description="Images in the pipeline call this request ran in.")
    batch_requests: int = Field(0, description="Requests that shared that pipeline call.")
    pipeline_calls: int = Field(
        1, description="Calls the request ran in: more than 1 when it had more images than one call takes."
    )
    steps: int = 0

    def stage_ms(self) -> dict[str, float]:
        """Milliseconds by stage, as the latency metrics name them."""
        return {
            "queue": self.queue_ms,
            "text_encode": self.text_encode_ms,
            "denoise": self.denoise_ms,
            "vae_decode": self.vae_decode_ms,
            "image_encode": self.image_encode_ms,
            "total": self.total_ms,
        }


class GenerationResult(_Wire):
    """A request's result: the images of every prompt of the request, in prompt order."""

    request_id: str
    model: str
    created: int = Field(default_factory=lambda: int(time.time()))
    images: list[B64Bytes] = Field(description="Encoded images or videos (`output_format`).")
    output_format: OutputFormat = "png"
    seeds: list[int] = Field(description="The seed of each image.")
    prompt_index: list[int] = Field(description="Which prompt of the request each image belongs to.")
    metrics: StageMetrics
    peak_memory_mb: float = Field(description="Peak device memory (CUDA) or peak RSS growth (CPU).")
    peak_memory_kind: MemoryKind = "cpu_rss"
    latents: TensorPayload | None = None
    trajectory: Trajectory | None = None
    final_output_type: str = "image"
    attempts: int = Field(1, description="Replicas tried: more than 1 when a replica died mid-request.")

    def pil_images(self) -> list[Any]:
        from PIL import Image

        return [Image.open(io.BytesIO(b)) for b in self.images]


class StepEvent(_Wire):
    """Progress of a streamed request, sent after every denoising step."""

    request_id: str
    step: int
    total_steps: int
    elapsed_ms: float
    preview_png: B64Bytes | None = Field(
        None, description="Low-resolution preview, every `preview_every` steps."
    )


class RequestState(_Wire):
    """Where a request is: queued (with position), running (step i of n), done, aborted or failed."""

    request_id: str
    state: Literal["queued", "running", "done", "aborted", "failed"]
    queue_position: int | None = None
    step: int = 0
    total_steps: int = 0
    images: int | None = None
    error: str | None = None
    replica_id: str | None = None


# --------------------------------------------------------------------------- HTTP API (OpenAI Images)


def parse_size(size: str) -> tuple[int, int]:
    """`"512x768"` -> (width=512, height=768)."""
    m = re.fullmatch(r"\s*(\d{1,5})\s*[xX]\s*(\d{1,5})\s*", size)
    if not m:
        raise ValueError("must look like 'WIDTHxHEIGHT', e.g. '512x512', or be 'auto'")
    return int(m.group(1)), int(m.group(2))


class _ImagesCommon(GenerationParams):
    """The OpenAI Images fields, plus this server's sampling parameters (`GenerationParams`)."""

    # OpenAI fields
    model: str | None = None
    num_images: int = Field(1, ge=1, alias="n", description="Images per prompt (OpenAI `n`).")
    size: str | None = Field(None, description="'WIDTHxHEIGHT' or 'auto'.")
    response_format: Literal["b64_json", "url"] = Field(
        "b64_json", description="'url' answers with a data: URL, since nothing is stored server-side."
    )
    quality: Literal["auto", "high", "medium", "low", "hd", "standard"] | None = Field(
        None,
        description="OpenAI's quality: `high`/`hd` turn step caching off, `medium` is `acceleration: "
        "fast`, `low` is `faster`; `auto`/`standard` leave the deployment's default. "
        "`acceleration` wins when both are given.",
    )
    # OpenAI fields accepted for compatibility and ignored by diffusion models
    style: str | None = None
    user: str | None = None
    background: str | None = None
    moderation: str | None = None
    output_compression: int | None = Field(None, ge=0, le=100)
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

    @field_validator("size")
    @classmethod
    def _size_form(cls, v: str | None) -> str | None:
        if v is not None and v != "auto":
            parse_size(v)
        return v

    def _params(self) -> dict[str, Any]:
        """The `GenerationParams` of this body, `size` folded into width and height."""
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

    prompt: Prompt

    def to_generation_request(self) -> GenerationRequest:
        """Build the Python API request; its validators run again on the mapped fields."""
        return GenerationRequest(prompt=self.prompt, **self._params())


class ImagesEditRequest(_ImagesCommon):
    """Body of `POST /v1/images/edits`, as a multipart form (files `image` or `image[]` and `mask`)
    or as JSON (the images as base64 or `data:` URLs). A mask makes it an inpainting; without
    one, an edit model (FLUX.1 Kontext) edits by the prompt and other models remake the image
    (image-to-image, `strength`)."""

    prompt: Prompt
    image: list[InputImage] = Field(min_length=1, description="The image to edit (one).")
    mask: InputImage | None = Field(None, description="Where to paint: transparent (alpha) or white.")
    # OpenAI edit fields accepted for compatibility and ignored by diffusion models
    input_fidelity: str | None = None

    @field_validator("image", mode="before")
    @classmethod
    def _one_or_more(cls, v: Any) -> Any:
        return v if isinstance(v, list) else [v]

    def to_generation_request(self) -> GenerationRequest:
        if len(self.image) > 1:
            raise InvalidRequest(
                f"image: {len(self.image)} images; an edit here takes one image", param="image"
            )
        return GenerationRequest(prompt=self.prompt, image=self.image[0], mask=self.mask, **self._params())


class VideosGenerationRequest(ImagesGenerationRequest):
    """Body of `POST /v1/videos`: a prompt to a video model, answered when the video is made."""

    seconds: float | None = Field(
        None, gt=0, le=600, description="Length; sets `num_frames` at the model's rule and `fps`."
    )


class ImagesBatchRequest(_ImagesCommon):
    """Body of `POST /v1/images/generations/batch`: several prompts, one parameter set."""

    prompts: Prompts

    def to_generation_request(self) -> BatchGenerationRequest:
        return BatchGenerationRequest(prompts=self.prompts, **self._params())


class ImageData(BaseModel):
    b64_json: str | None = None
    url: str | None = None
    revised_prompt: str | None = None
    # Extensions
    seed: int
    prompt_index: int


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
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


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "diffusion-serve"
    # Extensions
    source: str
    family: str = Field(description="sd, sdxl, sd3, flux, wan, or the pipeline's class for others.")
    modalities: list[Literal["image", "video"]] = Field(description="What the model makes.")
    tasks: list[str] = Field(description="generate, and the edits it does: img2img, inpaint, edit.")
    inputs: list[str] = Field(description="What a request may give the model (embeddings: handle calls).")
    embeds_shapes: dict[str, list[int]] | None = Field(
        None, description="Shapes of `prompt_embeds` (and `pooled_prompt_embeds`) the model takes."
    )
    default_height: int
    default_width: int
    default_steps: int
    default_num_frames: int | None = None
    accelerations: list[Acceleration] = Field(
        default_factory=lambda: ["none"], description="The `acceleration` levels the model offers."
    )


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoraAdd(_Wire):
    """Body of `POST /v1/loras`."""

    name: str
    path: str = Field(description="A .safetensors file inside one of the configured lora.allowed_roots.")
    scale: float = Field(1.0, ge=-10, le=10)
    pinned: bool = False


class LoraPin(_Wire):
    pinned: bool = True


class ProfileStart(_Wire):
    prefix: str = Field("trace", description="Trace files are named <prefix>-<replica id>-<time>.json.")


class RpcCall(_Wire):
    """Body of `POST /v1/rpc`: call an engine (or worker extension) method on every replica."""

    method: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = Field(None, gt=0)


class ModelDescription(BaseModel):
    """What a replica says of its model (the ingress's source for defaults and the RPC allow-list)."""

    model_config = ConfigDict(extra="allow")

    model: str
    source: str
    pipeline: str
    family: str = ""
    modality: Literal["image", "video"] = "image"
    tasks: list[str] = Field(default_factory=lambda: ["generate"])
    inputs: list[str] = Field(default_factory=lambda: ["prompt", "negative_prompt"])
    embeds_dim: int | None = None
    embeds_tokens: int | None = None
    pooled_dim: int | None = None
    default_num_frames: int | None = None
    frame_rule: tuple[int, int] | None = None  # video: frames = a * k + b
    default_fps: int | None = None
    default_height: int
    default_width: int
    default_steps: int
    accelerations: list[str] = Field(default_factory=lambda: ["none"])
    rpc_methods: list[str] = Field(default_factory=list)

    def embeds_shapes(self) -> dict[str, list[int]] | None:
        if self.embeds_dim is None:
            return None
        out = {"prompt_embeds": [1, self.embeds_tokens or -1, self.embeds_dim]}
        if self.pooled_dim is not None:
            out["pooled_prompt_embeds"] = [1, self.pooled_dim]
        return out


class Outcome(BaseModel):
    """One replica's answer to a call made on every replica (profiling, RPC)."""

    replica_id: str
    ok: bool
    result: Any = None
    error: str | None = None


class ReplicaStats(BaseModel):
    """What one replica reports of itself in `GET /v1/status`."""

    replica_id: str
    node_id: str | None = None
    queued_requests: int
    queued_images: int
    running_requests: int
    running_images: int
    healthy: bool
    health_problem: str | None = None
    rss_mb: float
    batching: dict[str, Any]
    loras_loaded: list[str]
    loras_loaded_mb: float = 0.0
    engine_failures_in_a_row: int
    counts: dict[str, int]


class StatusResponse(BaseModel):
    model: str
    replicas: list[ReplicaStats]
    queue_length: int


class AbortResponse(BaseModel):
    request_id: str
    result: Literal["aborted", "finished", "unknown"]
    message: str


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int
    request_id: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


# --------------------------------------------------------------------------- asynchronous jobs

JobState = Literal["queued", "running", "done", "failed", "aborted"]
WebhookEvent = Literal["start", "progress", "completed"]
FINISHED = ("done", "failed", "aborted")


class JobOutput(BaseModel):
    index: int
    name: str = Field(description="The stored file's name.")
    url: str | None = Field(None, description="A signed link to the file; it expires (`jobs.url_ttl_s`).")
    content_url: str | None = Field(
        None, description="The same file behind the API keys (GET /v1/jobs/{id}/content/{index})."
    )
    content_type: str
    bytes: int
    seed: int
    prompt_index: int


class WebhookDelivery(BaseModel):
    url: str
    events: list[WebhookEvent] = Field(default_factory=lambda: ["completed"])
    state: Literal["pending", "delivered", "failed"] = "pending"
    attempts: int = 0
    last_status: int | None = None
    last_error: str | None = None


class Job(BaseModel):
    """An asynchronous generation: where it is, and once done where its outputs are."""

    id: str
    object: Literal["job"] = "job"
    route: str = Field(description="The route it was submitted to, e.g. images.generations.")
    model: str
    state: JobState
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    request_id: str = Field(description="The request id of its current attempt (GET /v1/requests/{id}).")
    queue_position: int | None = None
    step: int = 0
    total_steps: int = 0
    output_format: OutputFormat
    outputs: list[JobOutput] = Field(default_factory=list)
    metrics: StageMetrics | None = None
    error: dict[str, Any] | None = Field(None, description="The error body's `error` object when failed.")
    attempts: int = Field(1, description="Ingress and replica attempts it took (resumed after a loss: more).")
    webhook: WebhookDelivery | None = None

    @property
    def finished(self) -> bool:
        return self.state in FINISHED


class JobRecord(Job):
    """A job as stored: with the bookkeeping callers do not see."""

    owner: str | None = Field(None, description="The ingress instance running it.")
    caller: str = Field("", description="A digest of the submitting API key: only it sees the job.")
    base_url: str = Field("", description="Where the links of its outputs point.")
    body_hash: str | None = Field(None, description="Of the submitted body, for idempotency keys.")

    def public(self) -> Job:
        return Job.model_validate(self.model_dump(include=set(Job.model_fields)))


class JobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Job]
