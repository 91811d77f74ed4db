"""Adapters to try the server with: a deterministic LoRA for an embedded model, `builtin:shapes`'
trained one, and an adapter file rewritten in the kohya (A1111) layout.

    python -m serve_app.lora make --out adapters/red.safetensors --seed 1   # an adapter for builtin:tiny-sd
    python -m serve_app.lora green --out adapters/green.safetensors       # builtin:shapes' trained one
    python -m serve_app.lora kohya adapters/red.safetensors --out adapters/red-kohya.safetensors --alpha 2
    python -m serve_app.lora make --kind loha --out adapters/red-loha.safetensors  # LyCORIS, kohya's layout

(`python -m serve_app.tools.lora` is the same command.) The files are written by
`serve_app.formats.lora`; this module draws the weights, on the embedded model they adapt.
"""

from __future__ import annotations

import argparse
import copy
import functools
import shutil
from pathlib import Path
from typing import Any

from serve_app.formats.lora import to_kohya, write_adapter


def make_adapter(
    out: str,
    seed: int = 0,
    rank: int = 4,
    model: str = "tiny-sd",
    strength: float = 1.0,
    alpha: int | None = None,
    denoiser: bool = True,
    text_encoder: bool = False,
) -> Path:
    """Write a LoRA adapter for `builtin:<model>` in the diffusers/peft safetensors format, or,
    when `out` does not end in `.safetensors`, as a PEFT adapter directory (`alpha`, default
    `rank`, goes in its config; the weights are stored so that the adapter acts the same).
    It adapts the denoiser's attention, and with `text_encoder` the text encoder's (a file only).

    Same arguments, same file: the weights are drawn from `seed`.
    """
    import torch
    from peft import LoraConfig, get_peft_model_state_dict

    prefix, base = _base_denoiser(model)
    encoder = copy.deepcopy(_base_pipe(model).text_encoder) if text_encoder else None
    torch.manual_seed(seed)
    cfg = LoraConfig(
        r=rank, lora_alpha=rank, init_lora_weights=False, target_modules=["to_q", "to_k", "to_v", "to_out.0"]
    )
    state = {}
    if denoiser:
        base.add_adapter(cfg, adapter_name="make")
        try:
            state = get_peft_model_state_dict(base, adapter_name="make")
        finally:
            base.delete_adapters("make")
    return write_adapter(
        out,
        state,
        prefix,
        rank=rank,
        targets=list(cfg.target_modules),
        alpha=alpha,
        strength=strength,
        text_encoder=None if encoder is None else _text_encoder_lora(encoder, rank),
    )


def _text_encoder_lora(encoder, rank: int) -> dict[str, Any]:
    """Random LoRA weights (drawn from torch's generator as it stands) for the attention of
    `encoder` (a copy: they are put in it), under the keys diffusers loads (`text_encoder.` +
    peft's)."""
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    cfg = LoraConfig(r=rank, lora_alpha=rank, init_lora_weights=False,
                     target_modules=["q_proj", "k_proj", "v_proj", "out_proj"])  # fmt: skip
    inject_adapter_in_model(cfg, encoder, adapter_name="make")
    return {
        f"text_encoder.{k}": v for k, v in get_peft_model_state_dict(encoder, adapter_name="make").items()
    }


@functools.lru_cache(maxsize=2)
def _base_pipe(model: str):
    """The pipeline adapters are shaped for, built once per process (a full-size one takes a while)."""
    from serve_app.engine.builtin import build_builtin

    return build_builtin(model, seed=0)


def make_lycoris(out: str, kind: str = "loha", seed: int = 0, rank: int = 4, model: str = "tiny-sd") -> Path:
    """Write a LyCORIS adapter (`loha`, `lokr` with a whole 4x4 first factor and a rank-`rank`
    second, or `dora`: a LoRA with LyCORIS's `dora_scale`, each output's magnitude 0.5-1.5
    times the base weight's norm) for a UNet model's attention projections in kohya's layout,
    weights drawn from `seed`, `alpha` 2 * rank."""
    import torch
    from safetensors.torch import save_file

    prefix, base = _base_denoiser(model)
    if prefix != "unet":
        raise ValueError("LyCORIS adapters are written for UNet models (kohya's lora_unet_ names)")
    g, state = torch.Generator().manual_seed(seed), {}
    targets = ("to_q", "to_k", "to_v", "to_out.0")
    for name, module in base.named_modules():
        name = name.removesuffix(".base_layer")  # `make_adapter` may have wrapped it (peft)
        if not (isinstance(module, torch.nn.Linear) and name.endswith(targets)):
            continue
        out_f, in_f = module.weight.shape
        draw = lambda *shape: torch.randn(*shape, generator=g) * 0.3  # noqa: E731
        key = "lora_unet_" + name.replace(".", "_")
        if kind == "loha":
            parts = {"hada_w1_a": draw(out_f, rank), "hada_w1_b": draw(rank, in_f),
                     "hada_w2_a": draw(out_f, rank), "hada_w2_b": draw(rank, in_f)}  # fmt: skip
        elif kind == "dora":
            norm = module.weight.detach().norm(dim=1, keepdim=True)
            parts = {"lora_down.weight": draw(rank, in_f), "lora_up.weight": draw(out_f, rank),
                     "dora_scale": norm * (0.5 + torch.rand(out_f, 1, generator=g))}  # fmt: skip
        else:
            parts = {
                "lokr_w1": draw(4, 4),
                "lokr_w2_a": draw(out_f // 4, rank),
                "lokr_w2_b": draw(rank, in_f // 4),
            }
        state.update({f"{key}.{k}": v for k, v in parts.items()})
        state[f"{key}.alpha"] = torch.tensor(2.0 * rank)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    save_file(state, out)
    return Path(out)


def _base_denoiser(model: str):
    """The denoiser adapters are shaped for, with its key prefix ("unet" or "transformer")."""
    pipe = _base_pipe(model)
    unet = getattr(pipe, "unet", None)
    return ("unet", unet) if unet is not None else ("transformer", pipe.transformer)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m serve_app.lora", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make", help="write a deterministic adapter for a builtin model")
    mk.add_argument("--out", required=True)
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--rank", type=int, default=4)
    mk.add_argument("--model", default="tiny-sd")
    mk.add_argument(
        "--kind", choices=["lora", "loha", "lokr", "dora"], default="lora", help="LyCORIS: kohya's layout"
    )
    green = sub.add_parser("green", help="copy builtin:shapes' trained adapter (paints shapes green)")
    green.add_argument("--out", required=True)
    ko = sub.add_parser("kohya", help="rewrite a diffusers/peft adapter file in the kohya (A1111) layout")
    ko.add_argument("source")
    ko.add_argument("--out", required=True)
    ko.add_argument("--alpha", type=float, default=None, help="alpha of every module (default: its rank)")
    a = ap.parse_args(argv)
    if a.cmd == "kohya":
        from safetensors.torch import load_file, save_file

        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        save_file(to_kohya(load_file(a.source), a.alpha), a.out)
        print(a.out)
        return
    if a.cmd == "green":
        from serve_app.engine.builtin import GREEN_LORA

        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        print(shutil.copyfile(GREEN_LORA, a.out))
        return
    if a.kind != "lora":
        print(make_lycoris(a.out, a.kind, seed=a.seed, rank=a.rank, model=a.model))
        return
    print(make_adapter(a.out, seed=a.seed, rank=a.rank, model=a.model))


if __name__ == "__main__":
    main()
