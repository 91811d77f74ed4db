"""Embedded twins of the image families of 2025-26, each the real diffusers pipeline at toy size
with seeded random weights (issue 56): `tiny-qwen-image` (Qwen-Image), `tiny-qwen-image-edit`
(Qwen-Image-Edit-2509: several reference images), `tiny-z-image` (Z-Image-Turbo),
`tiny-flux2-klein` (FLUX.2 [klein]) and `tiny-flux2` (FLUX.2 [dev]: Mistral Small 3's text
encoder); and the byte-level tokenizers they and HunyuanVideo 1.5 use, generated in memory.
Builders draw from torch's generator as `builtin.build_builtin` seeded it."""

from __future__ import annotations

import functools
from collections import Counter

from serve_app.engine.builtin import _flow_scheduler

# The fixed text the pipelines wrap a prompt in; a byte-level BPE learns whole-word merges from
# it, so these templates split into the same number of tokens as with the real tokenizers
# (the Qwen pipelines drop a fixed count of leading template tokens: 34 / 64).
_QWEN_TEMPLATES = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n",
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
    "objects, background), then explain how the user's text instruction should alter or modify the image. "
    "Generate a new image that meets the user's requirements while maintaining consistency with the "
    "original input where appropriate.<|im_end|>\n<|im_start|>user\n"
    "Picture 1: <|vision_start|><|image_pad|><|vision_end|>",
    "<|im_end|>\n<|im_start|>assistant\n",
)
_QWEN_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<think>",
    "</think>",
)
# Qwen3's template, reduced to what `apply_chat_template(..., add_generation_prompt=True,
# enable_thinking=...)` produces for plain string messages.
_QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}"
    "{%- endif -%}"
)


def _hunyuan_system_message():
    """HunyuanVideo 1.5's system prompt (crop_start=108 tokens with the chat wrapping), taken
    from the pipeline so its odd inner whitespace is exact."""
    import inspect

    from diffusers import HunyuanVideo15Pipeline

    sig = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds)
    return sig.parameters["system_message"].default


def _bpe_merges(pre_tokenizer, texts, specials):
    """Greedy BPE training (ties broken by the pair itself, so it is deterministic) until every
    pre-token of `texts` is one symbol."""
    import re

    words = Counter()
    split = re.compile("|".join(re.escape(s) for s in specials))
    for text in texts:
        for chunk in split.split(text):
            for piece, _ in pre_tokenizer.pre_tokenize_str(chunk):
                words[tuple(piece)] += 1
    merges = []
    while True:
        pairs = Counter()
        for w, c in words.items():
            for pair in zip(w, w[1:], strict=False):
                pairs[pair] += c
        if not pairs:
            return merges
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        merges.append(best)
        merged = {}
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + c
        words = Counter(merged)


def _bpe_vocab(texts, specials):
    """A byte-level BPE's vocabulary and merges: every byte, the merges that make each word of
    `texts` one token, then the special tokens."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    merges = _bpe_merges(Qwen2Tokenizer()._tokenizer.pre_tokenizer, texts, specials)
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    for s in specials:
        vocab[s] = len(vocab)
    return vocab, merges


@functools.cache
def _qwen_vocab():
    return _bpe_vocab(_QWEN_TEMPLATES + (_hunyuan_system_message(),), _QWEN_SPECIALS)


def _qwen_tokenizer(model_max_length: int = 32768):
    """A Qwen2-family byte-level BPE (any text encodes; template words are single tokens) with
    the chat/vision special tokens and a Qwen3-style chat template. ~700 tokens."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    vocab, merges = _qwen_vocab()
    tok = Qwen2Tokenizer(
        vocab=dict(vocab),
        merges=list(merges),
        model_max_length=model_max_length,
        chat_template=_QWEN3_CHAT_TEMPLATE,
    )
    tok.add_tokens([AddedToken(s, special=True, normalized=False) for s in _QWEN_SPECIALS])
    assert len(tok) == len(vocab), (len(tok), len(vocab))
    return tok


def _qwen25_vl(tok, hidden: int = 32):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = tok.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tok),
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 2, 4]},
            bos_token_id=ids("<|endoftext|>"),
            eos_token_id=ids("<|im_end|>"),
            pad_token_id=ids("<|endoftext|>"),
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=hidden,
            fullatt_block_indexes=[1],
        ),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    return Qwen2_5_VLForConditionalGeneration(config)


def _qwen_image_components():
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel

    tok = _qwen_tokenizer()
    return dict(
        transformer=QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=64,  # 16 latent channels in 2x2 patches
            out_channels=16,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            guidance_embeds=False,
            axes_dims_rope=(4, 6, 6),
        ),
        vae=AutoencoderKLQwenImage(
            base_dim=4, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
            temperal_downsample=[False, True, True],
        ),  # fmt: skip
        text_encoder=_qwen25_vl(tok),
        tokenizer=tok,
        scheduler=_flow_scheduler(
            base_image_seq_len=256, max_image_seq_len=8192, base_shift=0.5, max_shift=0.9,
            shift_terminal=0.02, time_shift_type="exponential", use_dynamic_shifting=True, shift=1.0,
        ),
    )  # fmt: skip


def _tiny_qwen_image():
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline(**_qwen_image_components())
    pipe.native_size = (64, 64)
    return pipe


def _qwen_vl_processor(tok):
    from unittest import mock

    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor

    # Qwen2.5-VL's preprocessing: 14-px patches merged 2x2, CLIP normalisation. Without
    # torchvision this is the PIL backend (Qwen2VLImageProcessorPil), same outputs.
    image_processor = Qwen2VLImageProcessor(patch_size=14, temporal_patch_size=2, merge_size=2)
    # The processor type-checks every sub-processor, the absent video processor too, against
    # `VideoProcessorMixin`, which transformers only exports with torchvision installed; skip
    # the check for None while constructing (videos are never passed here).
    check = Qwen2VLProcessor.check_argument_for_proper_class

    def lenient(self, name, arg):
        return None if arg is None else check(self, name, arg)

    with mock.patch.object(Qwen2VLProcessor, "check_argument_for_proper_class", lenient):
        return Qwen2VLProcessor(image_processor=image_processor, tokenizer=tok, video_processor=None)


def _tiny_qwen_image_edit():
    """Qwen-Image-Edit-2509 shaped (QwenImageEditPlusPipeline): the Qwen-Image twin's modules plus
    a Qwen2-VL processor, so the reference images reach the text encoder as vision tokens and
    the transformer as extra latent tokens."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus

    class TinyQwenImageEditPlusPipeline(plus.QwenImageEditPlusPipeline):
        """The real pipeline with the sizes it fits reference images to (1024x1024 for the VAE,
        384x384 for the text encoder, module constants) scaled to the twin's 64x64 for its call:
        the same code at a toy's cost (5.4 s -> 0.04 s a call with three images here)."""

        @functools.wraps(plus.QwenImageEditPlusPipeline.__call__)  # its signature, for describe_pipeline
        def __call__(self, *args, **kwargs):
            saved = plus.VAE_IMAGE_SIZE, plus.CONDITION_IMAGE_SIZE
            plus.VAE_IMAGE_SIZE = plus.CONDITION_IMAGE_SIZE = 64 * 64
            try:
                return super().__call__(*args, **kwargs)
            finally:
                plus.VAE_IMAGE_SIZE, plus.CONDITION_IMAGE_SIZE = saved

    parts = _qwen_image_components()
    pipe = TinyQwenImageEditPlusPipeline(**parts, processor=_qwen_vl_processor(parts["tokenizer"]))
    pipe.native_size = (64, 64)
    return pipe


def _qwen3_config(tok, hidden: int = 16, layers: int = 2):
    from transformers import Qwen3Config

    ids = tok.convert_tokens_to_ids
    return Qwen3Config(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=hidden // 2,
        max_position_embeddings=1024,
        bos_token_id=ids("<|endoftext|>"),
        eos_token_id=ids("<|im_end|>"),
        pad_token_id=ids("<|endoftext|>"),
    )


def _tiny_z_image():
    """Z-Image-Turbo shaped: a single-stream DiT over [caption; image] tokens, the prompt read
    from the Qwen3 encoder's second-to-last hidden state, a FLUX-style 16-channel VAE (8x)."""
    from diffusers import AutoencoderKL, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Model

    tok = _qwen_tokenizer()
    pipe = ZImagePipeline(
        transformer=ZImageTransformer2DModel(
            all_patch_size=(2,),
            all_f_patch_size=(1,),
            in_channels=16,
            dim=32,
            n_layers=2,
            n_refiner_layers=1,
            n_heads=2,
            n_kv_heads=2,
            qk_norm=True,
            cap_feat_dim=16,
            axes_dims=[8, 4, 4],
            axes_lens=[1024, 64, 64],
        ),
        vae=AutoencoderKL(
            block_out_channels=[8, 8, 8, 8],  # four levels: 8x down, as the real one
            down_block_types=["DownEncoderBlock2D"] * 4,
            up_block_types=["UpDecoderBlock2D"] * 4,
            latent_channels=16,
            layers_per_block=1,
            norm_num_groups=4,
            sample_size=64,
            scaling_factor=0.3611,
            shift_factor=0.1159,
            use_quant_conv=False,
            use_post_quant_conv=False,
        ),
        text_encoder=Qwen3Model(_qwen3_config(tok, hidden=16)),
        tokenizer=tok,
        scheduler=_flow_scheduler(shift=3.0, use_dynamic_shifting=False),
    )
    pipe.native_size = (64, 64)
    return pipe


def _flux2_vae():
    """FLUX.2's VAE at toy size: 8x down, 32 latent channels (patchified 2x2 to 128)."""
    from diffusers import AutoencoderKLFlux2

    return AutoencoderKLFlux2(
        block_out_channels=(8, 8, 8, 8),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=1,
        latent_channels=32,
        norm_num_groups=4,
        sample_size=64,
    )


def _flux2_scheduler():
    return _flow_scheduler(
        base_image_seq_len=256, max_image_seq_len=4096, base_shift=0.5, max_shift=1.15,
        use_dynamic_shifting=True, shift=3.0,
    )  # fmt: skip


def _tiny_flux2_klein():
    """FLUX.2-klein-4B shaped (step-distilled, `is_distilled=True`): the prompt is the Qwen3
    hidden states of layers 9, 18 and 27 side by side (so the tiny encoder has 27 layers), the
    VAE's 32 latent channels are patchified 2x2 into 128 transformer channels; optional
    reference images (`image=`) join as extra tokens."""
    from diffusers import Flux2KleinPipeline, Flux2Transformer2DModel
    from transformers import Qwen3ForCausalLM

    tok = _qwen_tokenizer()
    hidden = 16
    pipe = Flux2KleinPipeline(
        transformer=Flux2Transformer2DModel(
            patch_size=1,
            in_channels=128,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=3 * hidden,
            timestep_guidance_channels=256,
            axes_dims_rope=[4, 4, 4, 4],
            guidance_embeds=False,
        ),
        vae=_flux2_vae(),
        text_encoder=Qwen3ForCausalLM(_qwen3_config(tok, hidden=hidden, layers=27)),
        tokenizer=tok,
        scheduler=_flux2_scheduler(),
        is_distilled=True,
    )
    pipe.native_size = (64, 64)
    return pipe


# Mistral Small 3's control tokens, and its chat format for a system and a user turn (the
# messages' content is a list of typed parts, as FLUX.2's `format_input` makes them).
_MISTRAL_SPECIALS = ("<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]",
                     "[/SYSTEM_PROMPT]", "[IMG]", "[IMG_BREAK]", "[IMG_END]")  # fmt: skip
_MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{%- for message in messages -%}"
    "{%- set text = message['content'] if message['content'] is string else message['content']"
    " | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') -%}"
    "{%- if message['role'] == 'system' -%}{{ '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' -%}{{ '[INST]' + text + '[/INST]' }}"
    "{%- else -%}{{ text + eos_token }}{%- endif -%}{%- endfor -%}"
)


def _mistral_tokenizer():
    """A byte-level BPE with Mistral's control tokens and chat format; FLUX.2's system message is
    whole words. It stands where the real pipeline has Pixtral's processor, whose text path
    (`apply_chat_template` for prompts) is the tokenizer's; the processor's image path serves
    only the prompt upsampling this server does not offer (and needs torchvision)."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    vocab, merges = _bpe_vocab((SYSTEM_MESSAGE,), _MISTRAL_SPECIALS)
    tok = Qwen2Tokenizer(vocab=dict(vocab), merges=list(merges), model_max_length=1024,
                         chat_template=_MISTRAL_CHAT_TEMPLATE, bos_token="<s>", eos_token="</s>",
                         pad_token="<pad>", unk_token="<unk>")  # fmt: skip
    tok.add_tokens([AddedToken(s, special=True, normalized=False) for s in _MISTRAL_SPECIALS])
    return tok


def _tiny_flux2():
    """FLUX.2 [dev] shaped (Flux2Pipeline): guidance-distilled (the guidance scale is embedded,
    no negative prompt), the prompt the Mistral 3 encoder's hidden states of layers 10, 20 and 30
    side by side (so the tiny encoder has 30 layers, and a Pixtral vision tower it does not use
    for prompts), the FLUX.2 VAE and transformer as the klein twin has them; reference images
    join as extra tokens."""
    from diffusers import Flux2Pipeline, Flux2Transformer2DModel
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    tok = _mistral_tokenizer()
    ids = tok.convert_tokens_to_ids
    hidden = 16
    encoder = Mistral3ForConditionalGeneration(
        Mistral3Config(
            text_config=dict(
                model_type="mistral", vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                num_hidden_layers=30, num_attention_heads=2, num_key_value_heads=2, head_dim=hidden // 2,
                max_position_embeddings=1024, bos_token_id=ids("<s>"), eos_token_id=ids("</s>"),
                pad_token_id=ids("<pad>"),
            ),
            vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32,
                               num_hidden_layers=1, num_attention_heads=2, head_dim=8, image_size=64,
                               patch_size=16),
            image_token_index=ids("[IMG]"),
            spatial_merge_size=1,
        )
    )  # fmt: skip
    pipe = Flux2Pipeline(
        transformer=Flux2Transformer2DModel(
            patch_size=1, in_channels=128, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=3 * hidden, timestep_guidance_channels=256,
            axes_dims_rope=[4, 4, 4, 4], guidance_embeds=True,
        ),
        vae=_flux2_vae(),
        text_encoder=encoder,
        tokenizer=tok,
        scheduler=_flux2_scheduler(),
    )  # fmt: skip
    pipe.native_size = (64, 64)
    return pipe
