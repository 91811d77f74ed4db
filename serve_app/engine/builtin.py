"""Pipelines the project builds itself, with seeded random weights and no download.

* `tiny-sd`: a Stable-Diffusion-shaped pipeline small enough to build in well under a second
  and run on a CPU; the default model, so every layer above it is exercised for real.
* `sd15-arch`, `sdxl-arch`: full-size architectures (SD 1.5: an 860M-parameter UNet, CLIP ViT-L
  text encoder, 4-channel VAE; SDXL: 2.6B UNet and two text encoders) for GPU benchmarks:
  the compute of the real model without its weights.

Same name and seed give the same weights on every replica, so images are reproducible anywhere.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch


def _tokenizer(model_max_length: int = 77):
    """A CLIP tokenizer over a generated vocabulary: printable ASCII characters, no merges."""
    from transformers import CLIPTokenizer

    chars = [chr(c) for c in range(33, 127)]
    vocab = {c: i for i, c in enumerate(chars)}
    for c in chars:
        vocab[c + "</w>"] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "vocab.json").write_text(json.dumps(vocab))
        (Path(d) / "merges.txt").write_text("#version: 0.2\n")
        tok = CLIPTokenizer(
            str(Path(d) / "vocab.json"), str(Path(d) / "merges.txt"), model_max_length=model_max_length
        )
    return tok


def _sd_scheduler():
    from diffusers import DDIMScheduler

    with torch.device("cpu"):  # schedulers keep their tables on the CPU, whatever the build device
        return DDIMScheduler(
            beta_start=0.00085,
            beta_end=0.012,
            beta_schedule="scaled_linear",
            clip_sample=False,
            set_alpha_to_one=False,
            steps_offset=1,
        )


def _vae(block_out_channels, layers_per_block, sample_size, scaling_factor=0.18215):
    from diffusers import AutoencoderKL

    n = len(block_out_channels)
    return AutoencoderKL(
        block_out_channels=list(block_out_channels),
        down_block_types=["DownEncoderBlock2D"] * n,
        up_block_types=["UpDecoderBlock2D"] * n,
        latent_channels=4,
        layers_per_block=layers_per_block,
        sample_size=sample_size,
        scaling_factor=scaling_factor,
    )


def _clip(hidden, layers, heads, inter, tok, projection_dim=None, vocab_size=None):
    """A CLIP text encoder; `vocab_size` pads the embedding to the real model's table size."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(
        vocab_size=vocab_size or len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        hidden_size=hidden,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_hidden_layers=layers,
        max_position_embeddings=77,
        projection_dim=projection_dim or hidden,
    )
    return CLIPTextModelWithProjection(cfg) if projection_dim else CLIPTextModel(cfg)


def _tiny_sd():
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel

    tok = _tokenizer()
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=2,
        sample_size=32,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
    )
    return StableDiffusionPipeline(
        unet=unet,
        vae=_vae((32, 64), 1, 64),
        text_encoder=_clip(32, 2, 4, 37, tok),
        tokenizer=tok,
        scheduler=_sd_scheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def _sd15_arch():
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel

    tok = _tokenizer()
    return StableDiffusionPipeline(
        unet=UNet2DConditionModel(sample_size=64, cross_attention_dim=768, attention_head_dim=8),
        vae=_vae((128, 256, 512, 512), 2, 512),
        text_encoder=_clip(768, 12, 12, 3072, tok, vocab_size=49408),
        tokenizer=tok,
        scheduler=_sd_scheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def _sdxl_arch():
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel

    unet = UNet2DConditionModel(
        sample_size=128,
        block_out_channels=(320, 640, 1280),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 2, 10),
        attention_head_dim=(5, 10, 20),
        cross_attention_dim=2048,
        addition_embed_type="text_time",
        addition_time_embed_dim=256,
        projection_class_embeddings_input_dim=2816,
        use_linear_projection=True,
        layers_per_block=2,
    )
    tok = _tokenizer()
    with torch.device("cpu"):
        scheduler = EulerDiscreteScheduler(
            beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1
        )
    return StableDiffusionXLPipeline(
        unet=unet,
        vae=_vae((128, 256, 512, 512), 2, 1024, scaling_factor=0.13025),
        text_encoder=_clip(768, 12, 12, 3072, tok, vocab_size=49408),
        text_encoder_2=_clip(1280, 32, 20, 5120, tok, projection_dim=1280, vocab_size=49408),
        tokenizer=tok,
        tokenizer_2=tok,
        scheduler=scheduler,
    )


BUILDERS = {"tiny-sd": _tiny_sd, "sd15-arch": _sd15_arch, "sdxl-arch": _sdxl_arch}


def build_builtin(name: str, *, device: str | torch.device = "cpu", seed: int = 0):
    """Build `builtin:<name>` with weights drawn from `seed`, directly on `device`.

    `device="meta"` builds the shapes without memory (used to count parameters).
    """
    if name not in BUILDERS:
        raise ValueError(f"unknown builtin model {name!r}; allowed: {', '.join(sorted(BUILDERS))}")
    torch.manual_seed(seed)
    with torch.device(device):
        pipe = BUILDERS[name]()
    return pipe
