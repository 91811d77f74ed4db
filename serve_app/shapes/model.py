"""The model `builtin:shapes` is trained from: a tiny Stable-Diffusion pipeline whose tokenizer
makes every word of the scene grammar one token, built at its initial weights from a seed, and
how a trained one is saved."""

from __future__ import annotations

import collections
import json
import tempfile
from pathlib import Path

import torch

from serve_app.engine.builtin import add_grid_positions
from serve_app.shapes.scenes import COLOURS, POSITIONS, SHAPES, SIZE, SIZES

MAX_TOKENS = 24
LATENT_CHANNELS = 4
TE_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]


def _words() -> list[str]:
    words = {"a", "on", "background", ",", *COLOURS, *SHAPES, *SIZES}
    for p in POSITIONS:
        words.update(p.split())
    return sorted(words)


def build_tokenizer(directory: Path):
    """A CLIP tokenizer whose BPE merges make every word of the grammar one token; any other
    text still tokenizes, character by character (the base vocabulary is printable ASCII)."""
    from transformers import CLIPTokenizer

    chars = [chr(c) for c in range(33, 127)]
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    # BPE learning on the grammar's words: merge the most frequent adjacent pair until every
    # word is one symbol. Encoding replays merges in this order, so each word comes back whole.
    corpus = {w: list(w[:-1]) + [w[-1] + "</w>"] for w in _words()}
    merges: list[tuple[str, str]] = []
    while any(len(s) > 1 for s in corpus.values()):
        pairs = collections.Counter(p for s in corpus.values() for p in zip(s, s[1:], strict=False))
        best = min(pairs, key=lambda p: (-pairs[p], p))  # ties broken by name: deterministic
        merges.append(best)
        joined = best[0] + best[1]
        vocab.setdefault(joined, len(vocab))
        for w, s in corpus.items():
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and (s[i], s[i + 1]) == best:
                    out.append(joined)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            corpus[w] = out
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return CLIPTokenizer(
        str(directory / "vocab.json"), str(directory / "merges.txt"), model_max_length=MAX_TOKENS
    )


def build_pipeline(seed: int):
    """The untrained pipeline: every part at its initial weights, drawn from `seed`."""
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory() as d:
        tok = build_tokenizer(Path(d))
    text = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tok),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=MAX_TOKENS,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    )
    # Token embeddings drawn large (std 1, not CLIP's 0.02): each word then dominates its own
    # position's output from the first step. With CLIP's initialisation the words late in a
    # prompt (the place) were drowned by attention and the UNet never learned to use them.
    with torch.no_grad():
        text.get_input_embeddings().weight.normal_(0.0, 1.0)
    vae = AutoencoderKL(
        block_out_channels=[16, 32],
        down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2,
        latent_channels=LATENT_CHANNELS,
        layers_per_block=1,
        sample_size=SIZE,
        mid_block_add_attention=False,
        norm_num_groups=8,
    )
    unet = UNet2DConditionModel(
        sample_size=SIZE // 2,
        in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS,
        block_out_channels=(32, 64, 96),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=64,
        attention_head_dim=8,
        norm_num_groups=16,
    )
    add_grid_positions(unet)
    scheduler = DDIMScheduler(
        beta_schedule="scaled_linear",
        beta_start=0.00085,
        beta_end=0.012,
        prediction_type="v_prediction",
        rescale_betas_zero_snr=True,
        timestep_spacing="trailing",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    return StableDiffusionPipeline(
        vae=vae,
        text_encoder=text,
        tokenizer=tok,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def save_pipeline(pipe, directory: Path) -> None:
    """The pipeline as a diffusers folder of float16 safetensors (it loads as float32), with no
    trace of where it was loaded from (diffusers records the path in each config)."""
    pipe.to(torch.float16).save_pretrained(directory, safe_serialization=True)
    pipe.to(torch.float32)
    for f in directory.rglob("*.json"):
        config = json.loads(f.read_text())
        if isinstance(config, dict) and config.pop("_name_or_path", None) is not None:
            f.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
