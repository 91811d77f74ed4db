"""The Python API's requests, which handle callers send and the HTTP bodies map onto: the
sampling parameters (`GenerationParams`), adapters (`LoraRef`) and input images shared by
`GenerationRequest` (one prompt) and `BatchGenerationRequest` (several)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from serve_app.config import Acceleration, Priority
from serve_app.schemas.base import MAX_SEED, Extra, OutputFormat, Prompts, RequestId, _check_prompt, _Wire
from serve_app.schemas.payloads import InputImage, TensorPayload

_LORA_ALIASES = {"lora_name": "name", "adapter": "name", "lora_scale": "scale", "lora_path": "path",
                 "local_path": "path"}  # fmt: skip


LORA_NAME_CHARS = 64
LORA_SCALE = (-10.0, 10.0)  # an adapter's weight in a request


class LoraRef(_Wire):
    """Apply a registered adapter to this request only. vLLM-Omni's names for the same fields
    (`lora_name`, `adapter`, `lora_scale`, `lora_path`, `local_path`, `int_id`) are taken too."""

    name: str = Field(min_length=1, max_length=LORA_NAME_CHARS)

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

    scale: float | None = Field(
        None, ge=LORA_SCALE[0], le=LORA_SCALE[1], description="Default: the adapter's registered scale."
    )
    path: str | None = Field(None, description="Filled in by the server from the registry; ignored if sent.")
    version: int | None = Field(
        None, description="Filled in by the server: a pushed adapter's version; ignored if sent."
    )

    @property
    def loaded_name(self) -> str:
        """Its name on a replica: each pushed version is an adapter of its own (`name@v3`), so a
        call that started with one version ends with it, whatever is pushed meanwhile."""
        return self.name if self.version is None else f"{self.name}@v{self.version}"


class Rollout(_Wire):
    """Stochastic sampling whose every transition's log-probability comes back (RL rollouts)."""

    sampler: Literal["sde", "cps", "ddim"] | None = Field(
        None,
        description="sde (Flow-GRPO's SDE) or cps for flow-matching models, ddim (with eta) for the "
        "others; default sde or ddim.",
    )
    noise_level: float | None = Field(
        None, ge=0.01, le=1, description="The noise (ddim: eta); default 0.7 for sde and cps, 1.0 for ddim."
    )
    window: tuple[Annotated[int, Field(ge=0)], Annotated[int, Field(ge=0)]] | None = Field(
        None, description="[start, stop): the steps that are stochastic; default every step."
    )


class GenerationParams(_Wire):
    """Sampling parameters shared by every prompt of one request."""

    negative_prompt: str | None = None
    model: str | None = Field(
        None, max_length=256, description="Which model; default: the application's default model."
    )
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
        None,
        gt=0,
        le=1,
        description="Edits (image-to-image, inpainting): how much of the input to repaint. Where the "
        "model runs int(num_inference_steps × strength) steps (SD, SDXL), that is at least 1 (a 400 "
        "naming strength otherwise); an instruction-edit model takes none.",
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
    output_compression: int | None = Field(
        None, ge=0, le=100, description="JPEG and WebP quality, 0-100 (OpenAI's name); PNG is lossless."
    )
    return_latents: bool = False
    return_trajectory: bool = False
    return_trajectory_decoded: bool = Field(
        False,
        description="With the trajectory: the image decoded from the latents after every step, as PNG "
        "(`trajectory.decoded`, per step, per image; image models).",
    )
    rollout: Rollout | None = Field(
        None,
        description="RL rollouts: stochastic steps with per-row log-probabilities, returned in "
        "`trajectory` (with the latents before the first step) for every row of the group "
        "(`num_images` seeds).",
    )
    moderation: Literal["low", "auto"] | None = Field(
        None,
        description="OpenAI's moderation: with a safety checker (`model.safety`), `low` flags at its looser "
        "threshold; `auto` (default) at its own.",
    )
    priority: Priority | None = Field(
        None,
        description="`interactive` (the default) or `batch`, or a level 0-9 (`batch` is 0, `interactive` "
        "5): higher runs first, and one that waits behind a running call of a lower priority pauses it "
        "at its next step (`batching.preempt_after_ms`). Asynchronous jobs default to `batch`. At most "
        "the tenant's `max_priority`.",
    )
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
    sampler: str | None = Field(
        None,
        max_length=64,
        description="The sampler, by AUTOMATIC1111's name ('Euler a', 'DPM++ 2M', 'DPM++ 2M Karras', ...), "
        "a k-diffusion alias or a diffusers scheduler class; `GET /v1/models` lists each model's. "
        "Default: the model's own scheduler.",
    )
    sigma_schedule: str | None = Field(
        None,
        max_length=32,
        description="With a sampler: 'karras', 'exponential' or 'beta' noise levels instead of its own "
        "('automatic'); A1111's `scheduler`.",
    )


class _ImageInputs(_Wire):
    """An input image, for image-to-image and instruction edits, and a mask for inpainting
    (white, or transparent in an image with alpha, where to paint). Sizes default to the image's."""

    image: InputImage | None = Field(None, description="The image to edit.")
    mask: InputImage | None = Field(None, description="Where to paint: transparent (alpha) or white.")
    references: list[InputImage] = Field(
        default_factory=list,
        max_length=15,
        description="More images after `image`, for models that take several reference images of one "
        "prompt (Qwen-Image-Edit-2509, FLUX.2 [klein]).",
    )
    tenant: str | None = Field(
        None,
        max_length=64,
        description="Handle callers: the configured tenant the request counts against (its fair share "
        "and quotas); default `default`. An HTTP request's tenant is its API key's.",
    )

    @model_validator(mode="after")
    def _mask_needs_image(self):
        if self.mask is not None and self.image is None:
            raise ValueError("mask needs an image to paint into")
        if self.references and self.image is None:
            raise ValueError("references follow an image: give `image` first")
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
