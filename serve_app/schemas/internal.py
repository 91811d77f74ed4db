"""The hand-offs between the ingress and the replicas: `PreparedRequest` (a request with every
default filled in), what comes back (`GenerationResult` with its `StageMetrics`, `StepEvent`s
while it runs) and what a replica says of its model (`ModelDescription`). Handle callers get
the results and step events too."""

from __future__ import annotations

import io
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from serve_app.config import PRIORITIES, Acceleration
from serve_app.schemas.base import B64Bytes, MemoryKind, OutputFormat, _Wire
from serve_app.schemas.generation import BatchGenerationRequest, GenerationRequest, LoraRef, Rollout
from serve_app.schemas.payloads import PixelPayload, TensorPayload, Trajectory

EMBEDS_FIELDS = (
    "prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds", "negative_pooled_prompt_embeds"
)  # fmt: skip


# The multiplexed model id of a request for a pool's checkpoint (adapters' ids carry none), and
# of the checkpoints a replica reports holding: requests go where their checkpoint is.
CHECKPOINT_ID = "checkpoint:"


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
    output_compression: int | None = None  # JPEG and WebP quality; None: the encoder's default
    task: Literal["generate", "img2img", "inpaint", "edit"] = "generate"
    strength: float | None = None
    true_cfg_scale: float | None = None
    generator_device: str | None = None
    vae_use_slicing: bool = False
    vae_use_tiling: bool = False
    image: PixelPayload | None = None  # decoded and fitted to width x height by the ingress
    mask: PixelPayload | None = None  # "L", the same size
    references: list[PixelPayload] = Field(default_factory=list)  # more images, at their own sizes
    return_latents: bool = False
    return_trajectory: bool = False
    return_trajectory_decoded: bool = False
    rollout: Rollout | None = None
    moderation: str | None = None
    priority: int = Field(PRIORITIES["interactive"], ge=0, le=9)  # a level: higher runs first
    extra: dict[str, Any] = Field(default_factory=dict)
    loras: list[LoraRef] = Field(default_factory=list)  # by name, each with its scale and path resolved
    acceleration: Acceleration = "none"
    # The sampler and sigma schedule as the model names them (None: the model's own scheduler).
    sampler: str | None = None
    sigma_schedule: str | None = None
    prompt_embeds: TensorPayload | None = None
    negative_prompt_embeds: TensorPayload | None = None
    pooled_prompt_embeds: TensorPayload | None = None
    negative_pooled_prompt_embeds: TensorPayload | None = None
    # Whose request it is (the ingress's digest of the caller's key; "" for handle callers and
    # callers without a key): only its owner (and the admin) may read its state or abort it.
    owner: str = ""
    # The model it was prepared for (its served name) and, on a pool, the registered checkpoint
    # it runs on (with its resolved source); None: the pool's own model.
    model: str = ""
    # Its tenant (who shares the replicas' fair queues) and the tenant's weight there.
    tenant: str = "default"
    tenant_weight: float = 1.0
    checkpoint: str | None = None
    checkpoint_source: str | None = None
    # Whether the caller chose the seed (only such a request may be answered from the cache).
    seed_given: bool = False

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
        references: list[PixelPayload] | None = None,
        acceleration: str = "none",
        sampler: tuple[str | None, str | None] = (None, None),
        model: str = "",
        checkpoint: str | None = None,
        checkpoint_source: str | None = None,
        tenant: str = "default",
        tenant_weight: float = 1.0,
        priority: int | None = None,
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
            seed_given=request.seed is not None,
            num_images=request.num_images,
            output_format=request.output_format or output_format,
            num_frames=request.num_frames or num_frames,
            fps=request.fps or fps,
            output_compression=request.output_compression,
            task=task,
            references=references or [],
            strength=request.strength,
            true_cfg_scale=request.true_cfg_scale,
            generator_device=request.generator_device,
            vae_use_slicing=request.vae_use_slicing,
            vae_use_tiling=request.vae_use_tiling,
            image=image,
            mask=mask,
            return_latents=request.return_latents,
            return_trajectory=request.return_trajectory,
            return_trajectory_decoded=request.return_trajectory_decoded,
            rollout=request.rollout,
            moderation=request.moderation,
            **({} if priority is None else {"priority": priority}),  # unset: the tenant's default
            extra=request.extra,
            loras=loras or [],
            acceleration=request.acceleration or acceleration,
            sampler=sampler[0],
            sigma_schedule=sampler[1],
            model=model,
            checkpoint=checkpoint,
            checkpoint_source=checkpoint_source,
            tenant=tenant,
            tenant_weight=tenant_weight,
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
    priority: int | None = Field(None, description="The priority level (0-9) it ran at.")
    cache: Literal["hit", "miss", "bypass"] | None = Field(
        None,
        description="The result cache: `hit` (answered from a stored result), `miss` (made, and kept), "
        "`bypass` (Cache-Control: no-cache); absent when the request could not be cached.",
    )

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
    flagged: list[int] | None = Field(
        None, description="The images the safety checker flagged and blanked (their indices), if any."
    )
    attempts: int = Field(1, description="Replicas tried: more than 1 when a replica died mid-request.")
    policy_version: int | None = Field(
        None,
        description="The version of the pushed adapter it was made with (the highest, with several); "
        "absent when it used none.",
    )
    weights_version: int | None = Field(
        None, description="The version of the denoiser weights a trainer pushed that it was made with."
    )

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
    takes_guidance: bool = True  # False: its guider component guides (HunyuanVideo 1.5)
    reference_images: bool = False  # an edit takes several images of one prompt
    image_input: str = "rows"  # "references", "one": an edit call takes one prompt's images
    embeds_dim: int | None = None
    embeds_tokens: int | None = None
    pooled_dim: int | None = None
    default_num_frames: int | None = None
    frame_rule: tuple[int, int] | None = None  # video: frames = a * k + b
    # Per edit task taking `strength`: {"default": the pipeline's, "whole_steps": it runs
    # int(steps × strength) steps, so fewer than one is refused}.
    edit_strength: dict[str, dict[str, Any]] = Field(default_factory=dict)
    default_fps: int | None = None
    default_height: int
    default_width: int
    default_steps: int
    accelerations: list[str] = Field(default_factory=lambda: ["none"])
    # Each offered sampler: name, scheduler (diffusers class), aliases, sigma_schedules.
    samplers: list[dict[str, Any]] = Field(default_factory=list)
    default_sampler: str | None = None
    default_sigma_schedule: str | None = None
    sampler_kind: str = ""
    denoiser_bytes: int | None = None
    denoiser_weights: list[str] = Field(default_factory=list)
    rpc_methods: list[str] = Field(default_factory=list)

    def embeds_shapes(self) -> dict[str, list[int]] | None:
        if self.embeds_dim is None:
            return None
        out = {"prompt_embeds": [1, self.embeds_tokens or -1, self.embeds_dim]}
        if self.pooled_dim is not None:
            out["pooled_prompt_embeds"] = [1, self.pooled_dim]
        return out
