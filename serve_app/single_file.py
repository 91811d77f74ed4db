"""Write a diffusers pipeline as one checkpoint file in the original ("LDM") layout, the layout
of the single-file checkpoints A1111, ComfyUI and model sites share:

    python -m serve_app.single_file builtin:tiny-sd tiny-sd.safetensors
    python -m serve_app.single_file ./my-sdxl-pipeline my-sdxl.safetensors

Stable Diffusion 1.x and SDXL pipelines: the UNet under `model.diffusion_model.` (SDXL's size
embedding as `label_emb`), the VAE under `first_stage_model.`; SD 1.x's CLIP text encoder under
`cond_stage_model.transformer.`, SDXL's first under `conditioner.embedders.0.transformer.` and
its second (OpenCLIP's layout: fused attention projections, `resblocks`, a transposed
projection) under `conditioner.embedders.1.model.`. The file loads back with diffusers'
`from_single_file` to the same weights (tests/test_single_file.py serves one and compares
images), so a twin in this layout stands for a community checkpoint. For FLUX, the transformer
alone in Black Forest Labs' layout (`double_blocks`, `single_blocks`; engine/flux_file.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

UNET, VAE, TEXT = "model.diffusion_model.", "first_stage_model.", "cond_stage_model.transformer."
SDXL_TEXT, SDXL_TEXT_2 = "conditioner.embedders.0.transformer.", "conditioner.embedders.1.model."

# A UNet resnet's parts: diffusers' name -> the original's.
_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "norm2": "out_layers.0", "conv2": "out_layers.3",
           "time_emb_proj": "emb_layers.1", "conv_shortcut": "skip_connection"}  # fmt: skip
_UNET_TOP = {"time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
             "conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2",
             "add_embedding.linear_1": "label_emb.0.0",
             "add_embedding.linear_2": "label_emb.0.2"}  # fmt: skip
# A VAE attention's parts (1x1 convolutions in the original).
_VAE_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
_VAE_TOP = {"conv_norm_out": "norm_out"}


def _rename(key: str, table: dict[str, str]) -> str:
    """`key` with its leading module renamed by `table` (the longest name that matches)."""
    for new in sorted(table, key=len, reverse=True):
        if key == new or key.startswith(new + "."):
            return table[new] + key[len(new) :]
    return key


def unet_to_original(state: dict[str, torch.Tensor], layers_per_block: int) -> dict[str, torch.Tensor]:
    """A diffusers `UNet2DConditionModel` state dict in the original key layout (input,
    middle and output blocks numbered as the original UNet numbers its layers)."""
    per_down, per_up = layers_per_block, layers_per_block + 1
    out = {}
    for key, value in state.items():
        parts = key.split(".")
        head = parts[0]
        if head == "down_blocks":
            block, kind = int(parts[1]), parts[2]
            if kind == "downsamplers":  # after its block's layers: input block 3(b+1) in SD 1.5
                name = f"input_blocks.{(block + 1) * (per_down + 1)}.0.op" + key.split(".conv", 1)[1]
            else:
                layer = int(parts[3])
                index = 1 + block * (per_down + 1) + layer
                inner = ".".join(parts[4:])
                sub = "0" if kind == "resnets" else "1"
                name = f"input_blocks.{index}.{sub}." + (_rename(inner, _RESNET) if sub == "0" else inner)
        elif head == "mid_block":
            kind, layer, inner = parts[1], int(parts[2]), ".".join(parts[3:])
            if kind == "resnets":
                name = f"middle_block.{2 * layer}." + _rename(inner, _RESNET)
            else:
                name = f"middle_block.1.{inner}"
        elif head == "up_blocks":
            block, kind = int(parts[1]), parts[2]
            if kind == "upsamplers":  # the last layer of its block, after the attention if any
                index = block * per_up + per_up - 1
                has_attention = any(k.startswith(f"up_blocks.{block}.attentions.") for k in state)
                name = f"output_blocks.{index}.{2 if has_attention else 1}.conv" + key.split(".conv", 1)[1]
            else:
                layer = int(parts[3])
                index = block * per_up + layer
                inner = ".".join(parts[4:])
                sub = "0" if kind == "resnets" else "1"
                name = f"output_blocks.{index}.{sub}." + (_rename(inner, _RESNET) if sub == "0" else inner)
        else:
            name = _rename(key, _UNET_TOP)
        out[UNET + name] = value
    return out


def vae_to_original(state: dict[str, torch.Tensor], num_blocks: int) -> dict[str, torch.Tensor]:
    """A diffusers `AutoencoderKL` state dict in the original layout (decoder blocks numbered
    from the lowest resolution up, attention projections as 1x1 convolutions)."""
    out = {}
    for key, value in state.items():
        coder, rest = key.split(".", 1) if key.startswith(("encoder.", "decoder.")) else ("", key)
        parts = rest.split(".")
        if parts[0] in ("down_blocks", "up_blocks"):
            block = int(parts[1]) if parts[0] == "down_blocks" else num_blocks - 1 - int(parts[1])
            where = "down" if parts[0] == "down_blocks" else "up"
            if parts[2] == "resnets":
                inner = ".".join(parts[4:]).replace("conv_shortcut", "nin_shortcut")
                rest = f"{where}.{block}.block.{parts[3]}.{inner}"
            else:  # downsamplers.0.conv / upsamplers.0.conv
                rest = f"{where}.{block}.{'downsample' if where == 'down' else 'upsample'}." + ".".join(
                    parts[4:]
                )
        elif parts[0] == "mid_block" and parts[1] == "resnets":
            inner = ".".join(parts[3:]).replace("conv_shortcut", "nin_shortcut")
            rest = f"mid.block_{int(parts[2]) + 1}.{inner}"
        elif parts[0] == "mid_block":  # attentions.0
            rest = "mid.attn_1." + _rename(".".join(parts[3:]), _VAE_ATTENTION)
            if value.ndim == 2:
                value = value[:, :, None, None]
        else:
            rest = _rename(rest, _VAE_TOP)
        out[VAE + (f"{coder}.{rest}" if coder else rest)] = value
    return out


def text_encoder_to_original(state: dict[str, torch.Tensor], prefix: str = TEXT) -> dict[str, torch.Tensor]:
    """A transformers `CLIPTextModel` state dict under the original prefix (with its
    `text_model.` level, which newer transformers versions leave out)."""
    return {
        prefix + (key if key.startswith("text_model.") else "text_model." + key): value
        for key, value in state.items()
    }


# An OpenCLIP text transformer's names for a CLIP layer's parts.
_OPEN_CLIP_LAYER = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "mlp.fc1": "mlp.c_fc",
                    "mlp.fc2": "mlp.c_proj", "self_attn.out_proj": "attn.out_proj"}  # fmt: skip
_OPEN_CLIP_TOP = {"embeddings.position_embedding.weight": "positional_embedding",
                  "embeddings.token_embedding.weight": "token_embedding.weight",
                  "final_layer_norm.weight": "ln_final.weight",
                  "final_layer_norm.bias": "ln_final.bias"}  # fmt: skip


def open_clip_to_original(
    state: dict[str, torch.Tensor], prefix: str = SDXL_TEXT_2
) -> dict[str, torch.Tensor]:
    """A transformers `CLIPTextModelWithProjection` state dict in OpenCLIP's layout (SDXL's
    second text encoder): each layer's q, k and v projections as one `in_proj`, the
    projection transposed (OpenCLIP multiplies by it from the right)."""
    out, fused = {}, {}
    for key, value in state.items():
        key = key.removeprefix("text_model.")
        if key == "text_projection.weight":
            out[prefix + "text_projection"] = value.T
        elif key in _OPEN_CLIP_TOP:
            out[prefix + _OPEN_CLIP_TOP[key]] = value
        elif key.startswith("encoder.layers."):
            layer, inner = key.removeprefix("encoder.layers.").split(".", 1)
            where = f"{prefix}transformer.resblocks.{layer}."
            if inner.startswith(("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.")):
                fused[(where, inner.rsplit(".", 1)[1], inner.split(".")[1][0])] = value  # weight|bias, q|k|v
            else:
                out[where + _rename(inner, _OPEN_CLIP_LAYER)] = value
    for (where, kind, part), value in fused.items():
        if part == "q":
            out[f"{where}attn.in_proj_{kind}"] = torch.cat([value, *(fused[(where, kind, p)] for p in "kv")])
    return out


def pipeline_to_original(pipe) -> dict[str, torch.Tensor]:
    """Every weight of a Stable Diffusion 1.x or SDXL pipeline, or a FLUX pipeline's transformer,
    in one original-layout state dict."""
    kind = type(pipe).__name__
    if kind.startswith("Flux"):  # the transformer alone, unprefixed, as FLUX's makers share it
        from serve_app.engine.flux_file import flux_to_original

        return {
            k: v.detach().to("cpu").contiguous()
            for k, v in flux_to_original(pipe.transformer.state_dict()).items()
        }
    if kind not in ("StableDiffusionPipeline", "StableDiffusionXLPipeline"):
        raise ValueError(f"only Stable Diffusion 1.x, SDXL and FLUX pipelines are written; this is a {kind}")
    state = unet_to_original(pipe.unet.state_dict(), pipe.unet.config.layers_per_block)
    state.update(vae_to_original(pipe.vae.state_dict(), len(pipe.vae.config.down_block_types)))
    if kind == "StableDiffusionXLPipeline":
        state.update(text_encoder_to_original(pipe.text_encoder.state_dict(), SDXL_TEXT))
        state.update(open_clip_to_original(pipe.text_encoder_2.state_dict()))
    else:
        state.update(text_encoder_to_original(pipe.text_encoder.state_dict()))
    return {k: v.detach().to("cpu").contiguous() for k, v in state.items()}


def write_single_file(pipe, out: str | Path) -> Path:
    """Write `pipe` as one original-layout `.safetensors` file at `out`."""
    from safetensors.torch import save_file

    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(pipeline_to_original(pipe), str(path))
    return path


def _load(source: str):
    if source.startswith("builtin:"):
        from serve_app.engine.builtin import build_builtin

        return build_builtin(source.removeprefix("builtin:"))
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.from_pretrained(source, local_files_only=True, use_safetensors=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m serve_app.single_file", description=__doc__.split("\n\n")[0])
    ap.add_argument("source", help="builtin:<name> or a local diffusers pipeline directory")
    ap.add_argument("out", help="the .safetensors file to write")
    a = ap.parse_args(argv)
    print(write_single_file(_load(a.source), a.out))


if __name__ == "__main__":
    main()
