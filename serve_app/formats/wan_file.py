"""Wan's transformer in the original (Wan-AI) layout, the layout of the community's Wan single
files and GGUF files (`blocks.N.self_attn.q`, `head.head`, `time_embedding.0`), both ways.

diffusers converts this layout to its own (`convert_wan_transformer_to_diffusers`, which reads
every width from the tensors): the loader uses it. The writer needs the way back, which
diffusers has not: its renames, undone. Torch only.
"""

from __future__ import annotations

import re

import torch

# diffusers' name -> the original's, for a module outside the blocks.
_TOP = {
    "condition_embedder.time_embedder.linear_1": "time_embedding.0",
    "condition_embedder.time_embedder.linear_2": "time_embedding.2",
    "condition_embedder.text_embedder.linear_1": "text_embedding.0",
    "condition_embedder.text_embedder.linear_2": "text_embedding.2",
    "condition_embedder.time_proj": "time_projection.1",
    "condition_embedder.image_embedder.norm1": "img_emb.proj.0",
    "condition_embedder.image_embedder.ff.net.0.proj": "img_emb.proj.1",
    "condition_embedder.image_embedder.ff.net.2": "img_emb.proj.3",
    "condition_embedder.image_embedder.norm2": "img_emb.proj.4",
    "scale_shift_table": "head.modulation",
    "proj_out": "head.head",
}
# ... and for a module inside a block (`blocks.N.`).
_BLOCK = {
    "attn1": "self_attn",
    "attn2": "cross_attn",
    "scale_shift_table": "modulation",
    "ffn.net.0.proj": "ffn.0",
    "ffn.net.2": "ffn.2",
    "norm2": "norm3",  # the cross-attention's norm: norm3 in the original, norm2 in diffusers
}
_ATTENTION = {"to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "o", "add_k_proj": "k_img",
              "add_v_proj": "v_img", "norm_added_k": "norm_k_img"}  # fmt: skip
_IN_BLOCK = re.compile(r"^(blocks\.\d+)\.(.*)$")


def _renamed(name: str, table: dict[str, str]) -> str:
    for new in sorted(table, key=len, reverse=True):
        if name == new or name.startswith(new + "."):
            return table[new] + name[len(new) :]
    return name


def wan_to_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers `WanTransformer3DModel` state dict under the original's names."""
    out = {}
    for key, value in state.items():
        block = _IN_BLOCK.match(key)
        if block is None:
            out[_renamed(key, _TOP)] = value
            continue
        head, rest = block.groups()
        rest = _renamed(rest, _BLOCK)
        if rest.startswith(("self_attn.", "cross_attn.")):
            attention, _, inner = rest.partition(".")
            rest = f"{attention}.{_renamed(inner, _ATTENTION)}"
        out[f"{head}.{rest}"] = value
    return out


def wan_from_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The original layout's state dict under diffusers' names (diffusers' own converter)."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    return convert_wan_transformer_to_diffusers(dict(state))
