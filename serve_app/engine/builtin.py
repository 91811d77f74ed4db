"""Pipelines the project makes itself, with no download.

* `shapes`: a tiny Stable Diffusion pipeline the project trained on scenes it drew itself
  (`serve_app/shapes/`, docs/shapes-model.md), loaded from the package; it draws the
  colour, background and place a prompt asks for, circles, triangles and large stars (squares
  half the time);
  the default model of `serve_config.yaml`.
* The others have seeded random weights. `tiny-sd`: a Stable-Diffusion-shaped pipeline small
  enough to build in well under a second and run on a CPU; the shared test app's model, so
  every layer above it is exercised for real.
* `tiny-sdxl`, `tiny-sd3`, `tiny-flux`, `tiny-wan` (and the newer families' in `twins_image`,
  `twins_video`): twins of the other families at the same
  scale, each with the parts that make its family different (SDXL: two CLIP encoders, pooled
  embeddings and size conditioning; SD3: an MMDiT transformer, two CLIP encoders and a T5;
  FLUX: packed sequence latents, CLIP + T5 and a guidance embedding; Wan: a text-to-video
  transformer with a 3D VAE and a UMT5 encoder). `tiny-flux-kontext` is the FLUX twin in the
  instruction-edit pipeline of FLUX.1 Kontext.
* `sd15-arch`, `sdxl-arch`, `flux-arch`: full-size architectures (SD 1.5: an 860M-parameter
  UNet, CLIP ViT-L text encoder, 4-channel VAE; SDXL: 2.6B UNet and two text encoders; FLUX.1:
  11.9B transformer, CLIP ViT-L and T5-XXL, 16-channel VAE) for GPU benchmarks: the compute of
  the real model without its weights.

Same name and seed give the same weights on every replica, so images are reproducible anywhere.
"""

from __future__ import annotations

import functools
import json
import tempfile
from importlib import import_module
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


def _vae(block_out_channels, layers_per_block, sample_size, scaling_factor=0.18215, shift_factor=None):
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
        shift_factor=shift_factor,
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


def _t5_tokenizer(model_max_length: int = 32):
    """A T5 (sentencepiece-unigram) tokenizer over printable ASCII, built in memory."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    pieces += [(chr(c), -2.0) for c in range(33, 127)]
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=model_max_length)


def _t5(tok, d_model: int, umt5: bool = False):
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    kw = dict(
        vocab_size=len(tok),
        d_model=d_model,
        d_kv=8,
        d_ff=37,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return UMT5EncoderModel(UMT5Config(**kw)) if umt5 else T5EncoderModel(T5Config(**kw))


def _flow_scheduler(**kw):
    from diffusers import FlowMatchEulerDiscreteScheduler

    with torch.device("cpu"):
        return FlowMatchEulerDiscreteScheduler(**kw)


def _tiny_sdxl():
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel

    tok = _tokenizer()
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=2,
        sample_size=32,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        transformer_layers_per_block=(1, 2),
        projection_class_embeddings_input_dim=6 * 8 + 32,  # six size/crop ids + the pooled text
        cross_attention_dim=64,  # both encoders' hidden states side by side
    )
    with torch.device("cpu"):
        scheduler = EulerDiscreteScheduler(
            beta_start=0.00085,
            beta_end=0.012,
            beta_schedule="scaled_linear",
            steps_offset=1,
            timestep_spacing="leading",
        )
    return StableDiffusionXLPipeline(
        vae=_vae((32, 64), 1, 64, scaling_factor=0.13025),
        text_encoder=_clip(32, 2, 4, 37, tok),
        text_encoder_2=_clip(32, 2, 4, 37, tok, projection_dim=32),
        tokenizer=tok,
        tokenizer_2=tok,
        unet=unet,
        scheduler=scheduler,
    )


def _tiny_sd3():
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    tok = _tokenizer()
    t5tok = _t5_tokenizer()
    return StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel(
            sample_size=32,
            patch_size=2,
            in_channels=4,
            out_channels=4,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=4,
            joint_attention_dim=64,
            caption_projection_dim=32,
            pooled_projection_dim=64,
            pos_embed_max_size=32,
        ),
        vae=_vae((32, 64), 1, 64, scaling_factor=1.5035, shift_factor=0.0609),
        text_encoder=_clip(32, 2, 4, 37, tok, projection_dim=32),
        text_encoder_2=_clip(32, 2, 4, 37, tok, projection_dim=32),
        text_encoder_3=_t5(t5tok, 64),
        tokenizer=tok,
        tokenizer_2=tok,
        tokenizer_3=t5tok,
        scheduler=_flow_scheduler(shift=3.0),
    )


def _tiny_flux():
    from diffusers import FluxPipeline, FluxTransformer2DModel

    tok = _tokenizer()
    t5tok = _t5_tokenizer()
    pipe = FluxPipeline(
        transformer=FluxTransformer2DModel(
            patch_size=1,
            in_channels=16,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            guidance_embeds=True,
            axes_dims_rope=(4, 4, 8),
        ),
        vae=_vae((32, 64), 1, 64, scaling_factor=0.3611, shift_factor=0.1159),
        text_encoder=_clip(32, 2, 4, 37, tok),
        text_encoder_2=_t5(t5tok, 32),
        tokenizer=tok,
        tokenizer_2=t5tok,
        scheduler=_flow_scheduler(),
    )
    pipe.native_size = (64, 64)
    return pipe


def _tiny_flux_kontext():
    """FLUX.1 Kontext-shaped: the FLUX twin's modules in the instruction-edit pipeline, which
    puts the reference image's tokens beside the ones it denoises."""
    from diffusers import FluxKontextPipeline

    flux = _tiny_flux()
    pipe = FluxKontextPipeline(**flux.components)
    pipe.native_size = flux.native_size
    return pipe


def _tiny_wan():
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel

    t5tok = _t5_tokenizer()
    pipe = WanPipeline(
        tokenizer=t5tok,
        text_encoder=_t5(t5tok, 32, umt5=True),
        transformer=WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=12,
            in_channels=16,
            out_channels=16,
            text_dim=32,
            freq_dim=32,
            ffn_dim=32,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
        ),
        vae=AutoencoderKLWan(
            base_dim=3,
            z_dim=16,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
        ),
        scheduler=_flow_scheduler(shift=3.0),
    )
    pipe.native_size, pipe.native_num_frames = (32, 32), 9
    return pipe


def _flux_arch():
    """FLUX.1 shapes: a 12B transformer (19 double-stream and 38 single-stream blocks),
    CLIP ViT-L, a T5-XXL encoder and the 16-channel VAE."""
    from diffusers import AutoencoderKL, FluxPipeline, FluxTransformer2DModel

    from serve_app.engine.twins_video import t5_xxl

    tok, t5tok, t5 = _tokenizer(), _t5_tokenizer(model_max_length=512), t5_xxl()
    vae = AutoencoderKL(
        block_out_channels=[128, 256, 512, 512],
        down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4,
        latent_channels=16,
        layers_per_block=2,
        sample_size=1024,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    return FluxPipeline(
        transformer=FluxTransformer2DModel(guidance_embeds=True),  # its defaults are FLUX.1's shapes
        vae=vae,
        text_encoder=_clip(768, 12, 12, 3072, tok, vocab_size=49408),
        text_encoder_2=t5,
        tokenizer=tok,
        tokenizer_2=t5tok,
        scheduler=_flow_scheduler(
            base_image_seq_len=256, max_image_seq_len=4096, base_shift=0.5, max_shift=1.15,
            use_dynamic_shifting=True, shift=3.0,
        ),
    )  # fmt: skip


WEIGHTS = Path(__file__).parent / "weights"  # trained by serve_app/shapes/train.py, shipped in the package
SHAPES_DIR = WEIGHTS / "shapes"
GREEN_LORA = WEIGHTS / "shapes-green.safetensors"  # an adapter for it: paints the shape green


def load_shapes(directory: Path = SHAPES_DIR):
    """The trained shape-scene model, in float32 (its files are float16), with the grid
    positions its UNet was trained with."""
    from diffusers import StableDiffusionPipeline

    if not (directory / "model_index.json").exists():
        raise FileNotFoundError(f"no trained weights at {directory}; run `python -m serve_app.train_tiny`")
    pipe = StableDiffusionPipeline.from_pretrained(directory, torch_dtype=torch.float32)
    add_grid_positions(pipe.unet)
    return pipe


class _GridPosition(torch.nn.Module):
    """Fixed 2D sin/cos coordinates added to a transformer block's tokens before its attention
    (diffusers' `BasicTransformerBlock.pos_embed` slot). Coordinates are relative to the
    latent's height and width, so every image size sees the same places. No weights."""

    def __init__(self):
        super().__init__()
        self.hw: tuple[int, int] = (0, 0)  # set by the owning Transformer2DModel's pre-hook

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens + _grid_table(tokens.shape[-1], self.hw, tokens.device, tokens.dtype)


@functools.lru_cache(maxsize=8)  # a few image sizes; at most ~25 MB at the 512-pixel limit
def _grid_table(dim: int, hw: tuple[int, int], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The (h*w, dim) sin/cos table: the same for every step and block of a size, so made once."""
    from diffusers.models.embeddings import get_2d_sincos_pos_embed

    return get_2d_sincos_pos_embed(dim, hw, base_size=16, device=device).to(dtype)


def add_grid_positions(unet) -> None:
    """Give `unet`'s attention blocks a sense of where each latent pixel is.

    A UNet's convolutions learn absolute position only slowly, from their zero padding, so a
    small model trained briefly could not place an object where the prompt said. With this, each
    attention query carries its pixel's coordinates from the first step.
    """
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    for module in unet.modules():
        if not isinstance(module, Transformer2DModel):
            continue
        grids = []
        for block in module.transformer_blocks:
            block.pos_embed = _GridPosition()
            grids.append(block.pos_embed)

        def note_size(_module, args, kwargs, grids=grids):
            hidden = args[0] if args else kwargs["hidden_states"]
            for g in grids:
                g.hw = tuple(hidden.shape[-2:])

        module.register_forward_pre_hook(note_size, with_kwargs=True)


def _twin(module: str, name: str):
    """`twins_image` or `twins_video`'s builder of `name` (they import this module: imported late)."""
    return lambda: getattr(import_module(f"serve_app.engine.{module}"), "_" + name.replace("-", "_"))()


TRAINED = ("shapes",)
BUILDERS = {
    "shapes": load_shapes,
    "tiny-sd": _tiny_sd,
    "tiny-sdxl": _tiny_sdxl,
    "tiny-sd3": _tiny_sd3,
    "tiny-flux": _tiny_flux,
    "tiny-flux-kontext": _tiny_flux_kontext,
    "tiny-wan": _tiny_wan,
    **{n: _twin("twins_image", n) for n in ("tiny-qwen-image", "tiny-qwen-image-edit", "tiny-z-image")},
    **{n: _twin("twins_image", n) for n in ("tiny-flux2-klein", "tiny-flux2")},
    **{n: _twin("twins_video", n) for n in ("tiny-wan-i2v", "tiny-ltx", "tiny-hunyuan-video", "ltx-arch")},
    "sd15-arch": _sd15_arch,
    "sdxl-arch": _sdxl_arch,
    "flux-arch": _flux_arch,
}


def build_builtin(name: str, *, device: str | torch.device = "cpu", seed: int = 0):
    """Build `builtin:<name>` with weights drawn from `seed`, directly on `device` (a trained
    model, `shapes`, has its own weights).

    `device="meta"` builds the shapes without memory (used to count parameters).
    """
    if name not in BUILDERS:
        raise ValueError(f"unknown builtin model {name!r}; allowed: {', '.join(sorted(BUILDERS))}")
    torch.manual_seed(seed)
    if name in TRAINED:  # loaded from files, then moved; `seed` does not apply
        pipe = BUILDERS[name]().to(device)
    else:
        with torch.device(device):
            pipe = BUILDERS[name]()
    for part in pipe.components.values():  # built modules start in training mode (T5's dropout)
        if isinstance(part, torch.nn.Module):
            part.eval()
    return pipe
