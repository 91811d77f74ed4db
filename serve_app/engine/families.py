"""What the engine needs to know about a kind of pipeline, read from the pipeline itself.

A family is a small description, not a branch in the request path: which argument counts the
outputs, where the result is, whether prompt embeddings come with pooled ones and of what
widths, and how to turn the latents the pipeline holds between steps into an image-shaped
(batch, channels, height, width) tensor for previews. Everything is read from the pipeline's
call signature and its modules' configs, so a pipeline this file has never heard of still gets
a description; the known names only label it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Literal

import torch

# Class name -> the family's label, for the pipelines the embedded twins reproduce.
_LABELS = {
    "StableDiffusionPipeline": "sd",
    "StableDiffusionXLPipeline": "sdxl",
    "StableDiffusion3Pipeline": "sd3",
    "FluxPipeline": "flux",
    "FluxKontextPipeline": "flux",
    "WanPipeline": "wan",
    "WanImageToVideoPipeline": "wan",
    "QwenImagePipeline": "qwen-image",
    "QwenImageEditPlusPipeline": "qwen-image",
    "ZImagePipeline": "z-image",
    "Flux2KleinPipeline": "flux2",
    "Flux2Pipeline": "flux2",
    "LTXPipeline": "ltx",
    "HunyuanVideo15Pipeline": "hunyuan-video",
}


# How a pipeline's `image` argument holds a call's images: a list of one per row ("rows", the
# default), the reference images of one prompt ("references"), or one image ("one", Wan's
# image-to-video). The last two make an edit call one row.
_IMAGE_INPUT = {
    "QwenImageEditPlusPipeline": "references",
    "Flux2KleinPipeline": "references",
    "Flux2Pipeline": "references",
    "WanImageToVideoPipeline": "one",
}


@dataclass(frozen=True)
class Family:
    name: str
    modality: Literal["image", "video"]
    count_arg: str | None  # the call argument for outputs per prompt
    output_attr: str  # where the pipeline's output keeps its result
    embeds_dim: int | None  # width of `prompt_embeds` the denoiser takes (None: takes none)
    embeds_tokens: int | None  # their length: what the pipeline's own text encoding makes
    pooled_dim: int | None  # width of `pooled_prompt_embeds` it also needs (None: needs none)
    packed_latents: bool  # latents travel as a (batch, tokens, channels) sequence between steps
    frame_rule: tuple[int, int] | None = None  # video: frames must be (a * k + b), as (a, b)
    default_frames: int | None = None
    negative: bool = True  # the call takes `negative_prompt` (FLUX.2 [klein], distilled: not)
    guidance: bool = True  # the call takes `guidance_scale` (HunyuanVideo 1.5: a guider component)
    image_input: Literal["rows", "references", "one"] = "rows"

    def inputs(self) -> list[str]:
        out = ["prompt"] + (["negative_prompt"] if self.negative else [])
        if self.embeds_dim is not None:
            out.append("prompt_embeds")
        if self.pooled_dim is not None:
            out.append("pooled_prompt_embeds")
        return out


def _by_class(pipe: Any, table: dict[str, Any], default: Any) -> Any:
    """`table`'s value for the pipeline's class or the nearest base class it names."""
    return next((table[c.__name__] for c in type(pipe).__mro__ if c.__name__ in table), default)


def _setting(module: Any, key: str) -> Any:
    """A value of a diffusers (dict-like) or transformers (attribute) config; None if absent."""
    cfg = getattr(module, "config", None)
    if cfg is None:
        return None
    return cfg.get(key) if isinstance(cfg, dict) else getattr(cfg, key, None)


def describe_pipeline(pipe: Any, denoiser: torch.nn.Module) -> Family:
    params = inspect.signature(pipe.__call__).parameters
    video = "num_frames" in params
    count_arg = next((a for a in ("num_images_per_prompt", "num_videos_per_prompt") if a in params), None)
    embeds_dim = None
    if "prompt_embeds" in params:
        # LTX's transformer projects `caption_channels`-wide embeddings to its cross-attention width.
        keys = ("caption_channels", "cross_attention_dim", "joint_attention_dim", "text_dim")
        dims = (_setting(denoiser, k) for k in keys)
        embeds_dim = next((d for d in dims if d), None)
        if isinstance(embeds_dim, list | tuple):
            embeds_dim = embeds_dim[0]
    embeds_tokens = _encoded_tokens(pipe, denoiser.device) if embeds_dim else None
    pooled_dim = None
    if "pooled_prompt_embeds" in params:
        enc2 = getattr(pipe, "text_encoder_2", None)
        pooled_dim = _setting(denoiser, "pooled_projection_dim") or _setting(enc2, "projection_dim")
    frame_rule = default_frames = None
    if video:
        temporal = (  # LTX names it otherwise
            getattr(pipe, "vae_scale_factor_temporal", None)
            or getattr(pipe, "vae_temporal_compression_ratio", 1)
            or 1
        )
        frame_rule = (int(temporal), 1)  # frames = temporal * k + 1
        default = getattr(pipe, "native_num_frames", None) or params["num_frames"].default
        default_frames = default if isinstance(default, int) else int(temporal) + 1
    return Family(
        name=_by_class(pipe, _LABELS, type(pipe).__name__),
        modality="video" if video else "image",
        count_arg=count_arg,
        output_attr="frames" if video else "images",
        embeds_dim=embeds_dim,
        embeds_tokens=embeds_tokens,
        pooled_dim=pooled_dim,
        packed_latents=hasattr(type(pipe), "_unpack_latents"),
        frame_rule=frame_rule,
        default_frames=default_frames,
        negative="negative_prompt" in params,
        guidance="guidance_scale" in params,
        image_input=_by_class(pipe, _IMAGE_INPUT, "one" if video and "image" in params else "rows"),
    )


def _encoded_tokens(pipe: Any, device: torch.device) -> int | None:
    """The length of the embeddings the pipeline's own `encode_prompt` makes of a prompt.

    Every family pads its text to a fixed length (CLIP 77; SD3 77 + T5's 256; FLUX and Wan
    512), and embeddings from a caller are mixed with ones the pipeline makes itself (the
    unconditional half of classifier-free guidance), so theirs must have that length too.
    """
    encode = getattr(pipe, "encode_prompt", None)
    if encode is None:
        return None
    kwargs: dict[str, Any] = {}
    call = inspect.signature(pipe.__call__).parameters
    for name, p in inspect.signature(encode).parameters.items():
        if name == "max_sequence_length" and name in call:  # Wan's defaults differ (226 vs 512)
            kwargs[name] = call[name].default
        elif name.startswith("prompt") and p.default is inspect.Parameter.empty:
            kwargs[name] = ""
        elif name == "device":
            kwargs[name] = device
        elif name in ("num_images_per_prompt", "num_videos_per_prompt"):
            kwargs[name] = 1
        elif name == "do_classifier_free_guidance":
            kwargs[name] = False
    try:
        with torch.no_grad():
            out = encode(**kwargs)
    except Exception:  # a pipeline whose encoder wants more than a prompt: length not checked
        return None
    first = next((t for t in out if isinstance(t, torch.Tensor) and t.ndim == 3), None)
    return int(first.shape[1]) if first is not None else None


def image_latents(pipe: Any, family: Family, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The step's latents as (batch, channels, height, width): packed sequences unpacked (as
    the pipeline unpacks them, else laid out on a grid of the image's aspect), and video
    latents (batch, channels, frames, height, width) reduced to their first frame."""
    scale = getattr(pipe, "vae_scale_factor", None)
    if family.packed_latents and latents.ndim == 3 and scale is not None:
        try:
            latents = type(pipe)._unpack_latents(latents, height, width, scale)
        except (TypeError, RuntimeError, ValueError):  # another signature, or another layout
            pass
    if latents.ndim == 3:  # (batch, tokens, channels) on a grid
        tokens = latents.shape[1]
        rows = max(1, round((tokens * height / width) ** 0.5))
        rows = rows if tokens % rows == 0 else 1
        latents = latents.reshape(latents.shape[0], rows, tokens // rows, -1).permute(0, 3, 1, 2)
    if latents.ndim == 5:
        return latents[:, :, 0]
    return latents
