"""Embedded twins of the video families of 2025-26, each the real diffusers pipeline at toy size
with seeded random weights (issue 56): `tiny-wan-i2v` (Wan 2.2 image-to-video: two experts
switched at a boundary), `tiny-ltx` (LTX-Video) and `tiny-hunyuan-video` (HunyuanVideo 1.5).
Builders draw from torch's generator as `builtin.build_builtin` seeded it."""

from __future__ import annotations

from serve_app.engine.builtin import _flow_scheduler, _t5, _t5_tokenizer
from serve_app.engine.twins_image import _qwen_tokenizer


def _wan_transformer(in_channels: int):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=in_channels,
        out_channels=16,
        text_dim=32,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
        image_dim=None,  # Wan 2.2: no CLIP image tokens; the image enters as latent channels
    )


def _tiny_wan_i2v():
    """Wan 2.2 I2V-A14B shaped: a high-noise `transformer` (timesteps >= boundary_ratio * 1000)
    and a low-noise `transformer_2`, both taking 16 noise + 4 mask + 16 first-frame channels."""
    from diffusers import AutoencoderKLWan, WanImageToVideoPipeline

    t5tok = _t5_tokenizer(model_max_length=512)
    pipe = WanImageToVideoPipeline(
        tokenizer=t5tok,
        text_encoder=_t5(t5tok, 32, umt5=True),
        vae=AutoencoderKLWan(
            base_dim=3,
            z_dim=16,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
        ),
        scheduler=_flow_scheduler(shift=3.0),
        transformer=_wan_transformer(36),
        transformer_2=_wan_transformer(36),
        image_encoder=None,
        image_processor=None,
        boundary_ratio=0.875,
    )
    pipe.native_size, pipe.native_num_frames = (32, 32), 5
    return pipe


def _tiny_ltx():
    """LTX-Video 0.9 shaped: a T5 encoder, a DiT over 1x1x1 latent patches, and a causal video
    VAE that patchifies 4x4 and then halves space and time three times (32x / 8x), so frames
    are 8k+1 and sides multiples of 32."""
    from diffusers import AutoencoderKLLTXVideo, LTXPipeline, LTXVideoTransformer3DModel

    t5tok = _t5_tokenizer(model_max_length=128)
    vae = AutoencoderKLLTXVideo(
        latent_channels=8,
        block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, True, False),
        decoder_spatio_temporal_scaling=(True, True, True, False),
        patch_size=4,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
    )
    pipe = LTXPipeline(
        transformer=LTXVideoTransformer3DModel(
            in_channels=8,
            out_channels=8,
            patch_size=1,
            patch_size_t=1,
            num_attention_heads=2,
            attention_head_dim=8,
            cross_attention_dim=16,
            num_layers=1,
            caption_channels=32,
        ),
        vae=vae,
        text_encoder=_t5(t5tok, 32),
        tokenizer=t5tok,
        scheduler=_ltx_scheduler(),
    )
    pipe.native_size, pipe.native_num_frames = (64, 64), 9
    return pipe


def _ltx_scheduler():
    return _flow_scheduler(
        base_image_seq_len=1024, max_image_seq_len=4096, base_shift=0.95, max_shift=2.05,
        use_dynamic_shifting=True, shift=1.0,
    )  # fmt: skip


def t5_xxl():
    """A T5-XXL encoder's shapes (4.8B parameters; random weights)."""
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(
        T5Config(
            vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
            feed_forward_proj="gated-gelu", dropout_rate=0.0,
        )
    )  # fmt: skip


def _ltx_arch():
    """LTX-Video 0.9 at its real shapes (diffusers' defaults for its transformer and VAE are the
    released model's; T5-XXL), random weights: a newer family's compute for GPU benchmarks."""
    from diffusers import AutoencoderKLLTXVideo, LTXPipeline, LTXVideoTransformer3DModel

    t5tok = _t5_tokenizer(model_max_length=128)
    pipe = LTXPipeline(
        transformer=LTXVideoTransformer3DModel(),
        vae=AutoencoderKLLTXVideo(),
        text_encoder=t5_xxl(),
        tokenizer=t5tok,
        scheduler=_ltx_scheduler(),
    )
    pipe.native_size, pipe.native_num_frames = (480, 704), 161
    return pipe


def _tiny_hunyuan_video():
    """HunyuanVideo-1.5 (480p T2V) shaped: prompt from the Qwen2.5-VL text model's third-to-last
    hidden state after a 108-token system prompt, quoted text in the prompt also read by a
    ByT5 encoder, a 16x / 4x VAE, and guidance set on the `guider` component, not the call."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    tok = _qwen_tokenizer()
    ids = tok.convert_tokens_to_ids
    text_encoder = Qwen2_5_VLTextModel(
        Qwen2_5_VLTextConfig(
            vocab_size=len(tok),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [1, 1, 2]},
            bos_token_id=ids("<|endoftext|>"),
            eos_token_id=ids("<|im_end|>"),
            pad_token_id=ids("<|endoftext|>"),
        )
    )
    byt5tok = ByT5Tokenizer()
    latent = 8
    pipe = HunyuanVideo15Pipeline(
        transformer=HunyuanVideo15Transformer3DModel(
            in_channels=2 * latent + 1,  # noise + first-frame condition + mask
            out_channels=latent,
            num_attention_heads=2,
            attention_head_dim=8,
            num_layers=1,
            num_refiner_layers=1,
            mlp_ratio=2.0,
            patch_size=1,
            patch_size_t=1,
            text_embed_dim=16,
            text_embed_2_dim=32,
            image_embed_dim=12,
            rope_axes_dim=(2, 2, 4),
            target_size=64,
            task_type="t2v",
        ),
        vae=AutoencoderKLHunyuanVideo15(
            latent_channels=latent,
            block_out_channels=(8, 8, 8, 8, 8),
            layers_per_block=1,
            spatial_compression_ratio=16,
            temporal_compression_ratio=4,
            downsample_match_channel=False,
            upsample_match_channel=False,
        ),
        text_encoder=text_encoder,
        tokenizer=tok,
        text_encoder_2=_t5(byt5tok, 32),
        tokenizer_2=byt5tok,
        scheduler=_flow_scheduler(shift=5.0),
        guider=ClassifierFreeGuidance(guidance_scale=6.0),
    )
    pipe.native_size, pipe.native_num_frames = (48, 80), 5
    return pipe
