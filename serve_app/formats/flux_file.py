"""FLUX's transformer in the original (Black Forest Labs) layout, the layout of `flux1-dev.safetensors`
and of the FLUX fine-tunes model sites share, both ways: to diffusers' names and back.

diffusers converts this layout too, but takes FLUX.1's width (3072) as given where it splits a
single block's fused projection, so it cannot read a FLUX of another width, a twin among them.
Here every width is read from the file (`img_in`'s rows): one table of names serves both ways.
Torch only: the writer (`single_file_write`) and the loader (`single_file_load`) share it.
"""

from __future__ import annotations

import torch

# The original's names for diffusers' modules, outside the blocks.
_TOP = {
    "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
    "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
    "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "context_embedder": "txt_in",
    "x_embedder": "img_in",
    "proj_out": "final_layer.linear",
    "norm_out.linear": "final_layer.adaLN_modulation.1",  # its shift and scale halves swapped
}
# In a double block (`transformer_blocks.N` / `double_blocks.N`).
_DOUBLE = {
    "norm1.linear": "img_mod.lin",
    "norm1_context.linear": "txt_mod.lin",
    "attn.norm_q": "img_attn.norm.query_norm",
    "attn.norm_k": "img_attn.norm.key_norm",
    "attn.norm_added_q": "txt_attn.norm.query_norm",
    "attn.norm_added_k": "txt_attn.norm.key_norm",
    "ff.net.0.proj": "img_mlp.0",
    "ff.net.2": "img_mlp.2",
    "ff_context.net.0.proj": "txt_mlp.0",
    "ff_context.net.2": "txt_mlp.2",
    "attn.to_out.0": "img_attn.proj",
    "attn.to_add_out": "txt_attn.proj",
}
# In a single block (`single_transformer_blocks.N` / `single_blocks.N`).
_SINGLE = {
    "norm.linear": "modulation.lin",
    "attn.norm_q": "norm.query_norm",
    "attn.norm_k": "norm.key_norm",
    "proj_out": "linear2",
}
# The original's fused projections: its name, diffusers' modules in the order they are stacked.
_DOUBLE_FUSED = {
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
}
_SINGLE_FUSED = {"linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")}
_SCOPES = {  # diffusers' block prefix -> (the original's, renames, fused)
    "transformer_blocks": ("double_blocks", _DOUBLE, _DOUBLE_FUSED),
    "single_transformer_blocks": ("single_blocks", _SINGLE, _SINGLE_FUSED),
}
_SWAPPED = "final_layer.adaLN_modulation.1"
PREFIX = "model.diffusion_model."  # ComfyUI's files put the transformer under it; BFL's do not


def swap_halves(t: torch.Tensor) -> torch.Tensor:
    """An adaptive norm's projection with its two halves swapped: the original (FLUX's, SD3's)
    splits it into shift then scale, diffusers into scale then shift (its own inverse)."""
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a])


def _param(module: str, kind: str, original: bool) -> str:
    """`module.kind`, a norm's weight named `scale` on the original's side."""
    is_norm = module.endswith(("_norm", "norm_q", "norm_k", "norm_added_q", "norm_added_k"))
    return f"{module}.{'scale' if original and is_norm and kind == 'weight' else kind}"


def _parse(key: str, scopes) -> tuple[str, str, tuple | None, str]:
    """(module, weight|bias|scale, the block's entry in `scopes` with the block's new prefix,
    the module inside the block): `scopes` keyed by the key's side's block names."""
    module, kind = key.rsplit(".", 1)
    head, _, rest = module.partition(".")
    if head not in scopes:
        return module, kind, None, ""
    index, inner = rest.split(".", 1)
    name, renames, fuse = scopes[head]
    return module, kind, (f"{name}.{index}.", renames, fuse), inner


def flux_to_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers `FluxTransformer2DModel` state dict in the original layout (unprefixed)."""
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, list] = {}
    for key, value in state.items():
        module, kind, block, inner = _parse(key, _SCOPES)
        if block is not None:
            where, renames, fuse = block
            for name, parts in fuse.items():
                if inner in parts:
                    fused.setdefault(f"{where}{name}.{kind}", [None] * len(parts))[parts.index(inner)] = value
                    break
            else:
                out[where + _param(renames[inner], kind, True)] = value
        else:
            name = _TOP[module]
            out[f"{name}.{kind}"] = swap_halves(value) if name == _SWAPPED else value
    out.update({k: torch.cat(v) for k, v in fused.items()})
    return out


def flux_from_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The original layout's transformer (prefixed or not; other parts of the file left out) in
    diffusers' names, its widths read from the file. KeyError if it has no `img_in` weight."""
    state = {k.removeprefix(PREFIX): v for k, v in state.items()}
    width = state["img_in.weight"].shape[0]
    top = {v: k for k, v in _TOP.items()}
    scopes = {
        theirs: (ours, {v: k for k, v in renames.items()}, fuse)
        for ours, (theirs, renames, fuse) in _SCOPES.items()
    }
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        module, kind, block, inner = _parse(key, scopes)
        if block is not None:
            where, renames, fuse = block
            if inner in fuse:
                parts = fuse[inner]
                sizes = [width] * 3 + [value.shape[0] - 3 * width] * (len(parts) - 3)
                for part, piece in zip(parts, value.split(sizes), strict=True):
                    out[f"{where}{part}.{kind}"] = piece
            elif inner in renames:
                out[where + _param(renames[inner], "weight" if kind == "scale" else kind, False)] = value
        elif module in top:
            out[f"{top[module]}.{kind}"] = swap_halves(value) if module == _SWAPPED else value
    return out
