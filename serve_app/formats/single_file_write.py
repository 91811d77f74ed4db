"""A diffusers pipeline written as one checkpoint file in the original ("LDM") layout, the layout
of the single-file checkpoints A1111, ComfyUI and model sites share (its command line is
`python -m serve_app.single_file`, serve_app/tools/single_file.py).

Stable Diffusion 1.x, SDXL and SD3 pipelines. SD 1.x and SDXL: the UNet under
`model.diffusion_model.` (SDXL's size embedding as `label_emb`), the VAE under
`first_stage_model.`; SD 1.x's CLIP text encoder under `cond_stage_model.transformer.`, SDXL's
first under `conditioner.embedders.0.transformer.` and its second (OpenCLIP's layout: fused
attention projections, `resblocks`, a transposed projection) under
`conditioner.embedders.1.model.`. SD3: the MMDiT under `model.diffusion_model.` (`joint_blocks`,
fused `qkv`), the VAE likewise, the text encoders under `text_encoders.clip_l|clip_g|t5xxl.`.
For FLUX, the transformer alone in Black Forest Labs' layout (`double_blocks`, `single_blocks`;
flux_file.py); for Wan, the transformer alone in Wan-AI's (`blocks.N.self_attn`; wan_file.py).
FLUX's and Wan's transformers are also written as GGUF files (`write_gguf`). The file loads
back to the same weights (tests/test_single_file.py serves one and compares images), so a twin
in this layout stands for a community checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch

from serve_app.formats.flux_file import flux_to_original, swap_halves
from serve_app.formats.wan_file import wan_to_original

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
    """A transformers `CLIPTextModel` (or `...WithProjection`) state dict under the original
    prefix (with its `text_model.` level, which newer transformers versions leave out)."""
    return {
        prefix + (key if key.startswith(("text_model.", "text_projection.")) else "text_model." + key): value
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


# SD3's MMDiT: the original's names (Stability's `mmdit`) for diffusers' modules, outside the blocks.
_SD3_TOP = {
    "pos_embed.proj": "x_embedder.proj",
    "context_embedder": "context_embedder",
    "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
    "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
    "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
    "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2",
    "proj_out": "final_layer.linear",
    "norm_out.linear": "final_layer.adaLN_modulation.1",
}
# In a joint block (`transformer_blocks.N` / `joint_blocks.N`): the image stream is `x_block`, the
# text stream `context_block`.
_SD3_BLOCK = {
    "norm1.linear": "x_block.adaLN_modulation.1",
    "norm1_context.linear": "context_block.adaLN_modulation.1",
    "attn.norm_q": "x_block.attn.ln_q",
    "attn.norm_k": "x_block.attn.ln_k",
    "attn.norm_added_q": "context_block.attn.ln_q",
    "attn.norm_added_k": "context_block.attn.ln_k",
    "attn.to_out.0": "x_block.attn.proj",
    "attn.to_add_out": "context_block.attn.proj",
    "attn2.norm_q": "x_block.attn2.ln_q",
    "attn2.norm_k": "x_block.attn2.ln_k",
    "attn2.to_out.0": "x_block.attn2.proj",
    "ff.net.0.proj": "x_block.mlp.fc1",
    "ff.net.2": "x_block.mlp.fc2",
    "ff_context.net.0.proj": "context_block.mlp.fc1",
    "ff_context.net.2": "context_block.mlp.fc2",
}
_SD3_FUSED = {
    "x_block.attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "context_block.attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "x_block.attn2.qkv": ("attn2.to_q", "attn2.to_k", "attn2.to_v"),
}


def sd3_to_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers `SD3Transformer2DModel` state dict in the original layout under
    `model.diffusion_model.`: q, k and v fused as `qkv`, the last block's text-stream norm (it
    only feeds the image stream) and the final norm with their halves swapped."""
    last = max(int(k.split(".")[1]) for k in state if k.startswith("transformer_blocks."))
    out, fused = {}, {}
    for key, value in state.items():
        if key == "pos_embed.pos_embed":
            out["pos_embed"] = value
            continue
        if not key.startswith("transformer_blocks."):
            name = _rename(key, _SD3_TOP)
            out[name] = swap_halves(value) if name.startswith("final_layer.adaLN") else value
            continue
        _, block, inner = key.split(".", 2)
        module, kind = inner.rsplit(".", 1)
        group = next((g for g, parts in _SD3_FUSED.items() if module in parts), None)
        if group is not None:
            fused.setdefault((block, group, kind), {})[module] = value
            continue
        name = _rename(inner, _SD3_BLOCK)
        if int(block) == last and module == "norm1_context.linear":
            value = swap_halves(value)
        out[f"joint_blocks.{block}.{name}"] = value
    for (block, group, kind), parts in fused.items():
        out[f"joint_blocks.{block}.{group}.{kind}"] = torch.cat([parts[m] for m in _SD3_FUSED[group]])
    return {UNET + k: v for k, v in out.items()}


def t5_to_original(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """A transformers `T5EncoderModel` state dict under `prefix`; the token embedding once, as
    `shared` (the encoder's copy is the same tensor, tied back on load)."""
    return {prefix + k: v.clone() for k, v in state.items() if k != "encoder.embed_tokens.weight"}


def pipeline_to_original(pipe) -> dict[str, torch.Tensor]:
    """Every weight of a Stable Diffusion 1.x, SDXL or SD3 pipeline, or a FLUX or Wan pipeline's
    transformer, in one original-layout state dict."""
    kind = type(pipe).__name__
    if kind.startswith("Flux"):  # the transformer alone, unprefixed, as FLUX's makers share it
        state = flux_to_original(pipe.transformer.state_dict())
    elif kind.startswith("Wan"):  # the same for Wan's
        state = wan_to_original(pipe.transformer.state_dict())
    elif kind == "StableDiffusion3Pipeline":
        from serve_app.formats.single_file_load import TEXT_ENCODERS

        state = sd3_to_original(pipe.transformer.state_dict())
        for name, (layout, prefix) in TEXT_ENCODERS["sd3"].items():  # CLIP-L, CLIP-G, T5
            part = getattr(pipe, name).state_dict()
            state.update(
                t5_to_original(part, prefix) if layout == "t5" else text_encoder_to_original(part, prefix)
            )
    elif kind == "StableDiffusionXLPipeline":
        state = unet_to_original(pipe.unet.state_dict(), pipe.unet.config.layers_per_block)
        state.update(text_encoder_to_original(pipe.text_encoder.state_dict(), SDXL_TEXT))
        state.update(open_clip_to_original(pipe.text_encoder_2.state_dict()))
    elif kind == "StableDiffusionPipeline":
        state = unet_to_original(pipe.unet.state_dict(), pipe.unet.config.layers_per_block)
        state.update(text_encoder_to_original(pipe.text_encoder.state_dict()))
    else:
        raise ValueError(
            f"only Stable Diffusion 1.x, SDXL, SD3, FLUX and Wan pipelines are written; this is a {kind}"
        )
    if not kind.startswith(("Flux", "Wan")):
        state.update(vae_to_original(pipe.vae.state_dict(), len(pipe.vae.config.down_block_types)))
    return {k: v.detach().to("cpu").contiguous() for k, v in state.items()}


def write_gguf(pipe, out: str | Path, quant: str = "Q8_0") -> Path:
    """Write a FLUX or Wan pipeline's transformer as one GGUF file at `out`, in the original
    layout as the community's GGUF files are: each 2-D weight whose rows fill whole blocks of the
    type in `quant` (`Q8_0`, `Q4_0`, ...: the types the `gguf` package quantizes), the rest
    (biases, norms, layers too narrow) in F32."""
    import gguf

    kind = type(pipe).__name__
    if not kind.startswith(("Flux", "Wan")):
        raise ValueError(f"GGUF files are written for FLUX and Wan pipelines only; this is a {kind}")
    qtype = gguf.GGMLQuantizationType[quant]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch="wan" if kind.startswith("Wan") else "flux")
    for name, tensor in pipeline_to_original(pipe).items():
        data = tensor.float().numpy()
        if data.ndim == 2 and data.shape[1] % block == 0:
            packed = gguf.quants.quantize(data, qtype)
            writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_single_file(pipe, out: str | Path) -> Path:
    """Write `pipe` as one original-layout `.safetensors` file at `out`."""
    from safetensors.torch import save_file

    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(pipeline_to_original(pipe), str(path))
    return path
