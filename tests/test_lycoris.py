"""LyCORIS adapters (LoHa, LoKr) in kohya's layout, read as the exact LoRA they are
(`serve_app/engine/lycoris.py`): the update each writes equals the LoHa or LoKr formula, and a
LoHa or LoKr file, alone, stacked with a LoRA, or mixed per row beside a row without it,
changes the image as the same updates merged into the UNet's weights do."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from serve_app.config import ModelConfig
from serve_app.engine import CallParams, DiffusionEngine, LoraError, Row
from serve_app.engine.lycoris import as_lora

# Linear layers and a convolution of tiny-sd's UNet, by diffusers' names.
LINEAR = [f"down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_{p}" for p in ("q", "k", "v")]
CONV = "down_blocks.1.resnets.0.conv1"  # (64, 32, 3, 3)
FF = "down_blocks.1.attentions.0.transformer_blocks.0.ff.net.2"  # (64, 256): the LoRA's layer


def kohya(module: str) -> str:
    return "lora_unet_" + module.replace(".", "_")


def loha(shape, r: int, alpha: float, g: torch.Generator) -> tuple[dict, torch.Tensor]:
    out, inner = shape[0], int(np.prod(shape[1:]))
    sizes = {"hada_w1_a": (out, r), "hada_w1_b": (r, inner), "hada_w2_a": (out, r), "hada_w2_b": (r, inner)}
    w = {k: torch.randn(*s, generator=g) * 0.3 for k, s in sizes.items()}
    delta = (w["hada_w1_a"] @ w["hada_w1_b"]) * (w["hada_w2_a"] @ w["hada_w2_b"]) * alpha / r
    return {**w, "alpha": torch.tensor(alpha)}, delta.reshape(shape)


def lokr(
    shape, r: int, alpha: float, g: torch.Generator, whole_w2: bool = False
) -> tuple[dict, torch.Tensor]:
    # w1 whole (4 x 4), w2 low-rank (or whole): kron(w1, w2) has the layer's shape.
    out, inner = shape[0], int(np.prod(shape[1:]))
    w1 = torch.randn(4, 4, generator=g) * 0.3
    if whole_w2:
        w2 = torch.randn(out // 4, inner // 4, generator=g) * 0.1
        return {"lokr_w1": w1, "lokr_w2": w2, "alpha": torch.tensor(alpha)}, torch.kron(w1, w2).reshape(shape)
    a, b = torch.randn(out // 4, r, generator=g) * 0.3, torch.randn(r, inner // 4, generator=g) * 0.3
    delta = torch.kron(w1, a @ b) * alpha / r
    return {"lokr_w1": w1, "lokr_w2_a": a, "lokr_w2_b": b, "alpha": torch.tensor(alpha)}, delta.reshape(shape)


def test_each_module_is_written_as_the_lora_of_its_exact_update():
    g = torch.Generator().manual_seed(0)
    for make, shape in ((loha, (64, 64)), (loha, (64, 32, 3, 3)), (lokr, (64, 64)), (lokr, (64, 32, 3, 3))):
        parts, delta = make(shape, 4, 2.0, g)
        lora = as_lora({f"lora_m.{k}": v for k, v in parts.items()}, {"lora_m": shape})
        up, down = lora["lora_m.lora_up.weight"], lora["lora_m.lora_down.weight"]
        assert float(lora["lora_m.alpha"]) == down.shape[0]  # alpha = rank: the update as it is
        assert torch.allclose((up.flatten(1) @ down.flatten(1)).reshape(shape), delta, atol=1e-5), make
    parts, delta = lokr((64, 64), 4, 2.0, g, whole_w2=True)  # both whole: no alpha / r
    lora = as_lora({f"unet.m.{k}": v for k, v in parts.items()})  # PEFT's names: lora_B, lora_A
    assert torch.allclose(lora["unet.m.lora_B.weight"] @ lora["unet.m.lora_A.weight"], delta, atol=1e-5)
    with pytest.raises(ValueError, match="m: a Tucker-decomposed convolution"):
        as_lora({"m.hada_t1": torch.zeros(1), "m.hada_w1_a": torch.zeros(1)})


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Files (a LoHa, a LoKr, a plain kohya LoRA) and each one's updates by module."""
    root, g = tmp_path_factory.mktemp("lycoris"), torch.Generator().manual_seed(1)
    unet = DiffusionEngine(ModelConfig(source="builtin:tiny-sd", device="cpu", warmup=False)).pipe.unet
    shapes = {m: tuple(unet.get_submodule(m).weight.shape) for m in (*LINEAR, CONV, FF)}
    files, deltas = {}, {}
    for name, make in (("loha", loha), ("lokr", lokr)):
        state, deltas[name] = {}, {}
        for module in (*LINEAR, CONV):
            parts, deltas[name][module] = make(shapes[module], 4, 2.0, g)
            state.update({f"{kohya(module)}.{k}": v for k, v in parts.items()})
        save_file(state, str(root / f"{name}.safetensors"))
        files[name] = str(root / f"{name}.safetensors")
    up, down = torch.randn(64, 4, generator=g) * 0.3, torch.randn(4, 256, generator=g) * 0.3
    save_file({f"{kohya(FF)}.lora_up.weight": up, f"{kohya(FF)}.lora_down.weight": down,
               f"{kohya(FF)}.alpha": torch.tensor(2.0)}, str(root / "lora.safetensors"))  # fmt: skip
    files["lora"], deltas["lora"] = str(root / "lora.safetensors"), {FF: up @ down * 2.0 / 4}
    return files, deltas


def pixels(e: DiffusionEngine, rows=None, **kw) -> list[np.ndarray]:
    p = CallParams(height=32, width=32, steps=3, guidance_scale=7.5, **kw)
    out = e.run(rows or [Row("a red circle", None, 1)], p)
    return [np.asarray(im).astype(int) for im in out.images]


def merged(*deltas: dict) -> DiffusionEngine:
    e = DiffusionEngine(ModelConfig(source="builtin:tiny-sd", device="cpu", warmup=False))
    with torch.no_grad():
        for d in deltas:
            for module, delta in d.items():
                e.pipe.unet.get_submodule(module).weight += delta
    return e


def test_a_loha_or_lokr_file_changes_the_image_as_its_merged_updates_do(made):
    files, deltas = made
    e = DiffusionEngine(ModelConfig(source="builtin:tiny-sd", device="cpu", warmup=False))
    for name in files:
        e.load_lora(name, files[name])
    base = pixels(e)[0]
    for name in ("loha", "lokr"):
        want = pixels(merged(deltas[name]))[0]
        got = pixels(e, loras=((name, 1.0),))[0]
        assert np.abs(got - want).max() <= 1 and np.abs(got - base).max() > 10, name
        # Stacked with a plain LoRA: both updates, merged.
        both = pixels(e, loras=((name, 1.0), ("lora", 1.0)))[0]
        assert np.abs(both - pixels(merged(deltas[name], deltas["lora"]))[0]).max() <= 1, name
        # Per row: a row with the adapter beside a row without it, in one call.
        rows = [
            dataclasses.replace(Row("a red circle", None, 1), adapters=((name, 1.0),)),
            Row("a red circle", None, 1),
        ]
        mixed = pixels(e, rows)
        assert np.abs(mixed[0] - want).max() <= 2 and np.abs(mixed[1] - base).max() <= 2, name


def test_a_lycoris_file_that_cannot_be_read_as_a_lora_is_refused_naming_the_module(tmp_path):
    save_file({"lora_unet_x.hada_w1_a": torch.ones(4, 2), "lora_unet_x.hada_t1": torch.ones(2, 2, 3, 3)},
              str(tmp_path / "tucker.safetensors"))  # fmt: skip
    save_file({"lora_unet_x.lokr_w1": torch.ones(4, 4)}, str(tmp_path / "half.safetensors"))
    e = DiffusionEngine(ModelConfig(source="builtin:tiny-sd", device="cpu", warmup=False))
    with pytest.raises(LoraError, match="lora_unet_x: a Tucker-decomposed convolution"):
        e.read_lora(str(tmp_path / "tucker.safetensors"))
    with pytest.raises(LoraError, match="lora_unet_x: a LoKr module needs lokr_w2"):
        e.read_lora(str(tmp_path / "half.safetensors"))


def test_the_lycoris_maker_writes_files_that_load_and_change_the_image(tmp_path):
    from serve_app.tools.lora import main as lora_main

    e = DiffusionEngine(ModelConfig(source="builtin:tiny-sd", device="cpu", warmup=False))
    base = pixels(e)[0]
    for kind in ("loha", "lokr", "dora"):
        lora_main(["make", "--kind", kind, "--out", str(tmp_path / f"{kind}.safetensors")])
        e.load_lora(kind, str(tmp_path / f"{kind}.safetensors"))
        assert np.abs(pixels(e, loras=((kind, 1.0),))[0] - base).max() > 10, kind


@pytest.mark.parametrize("kind", ["LoHa", "LoKr"])
def test_a_peft_loha_or_lokr_directory_makes_the_image_of_peft_s_own_merge(kind, tmp_path):
    # PEFT's layout: an adapter directory written from PEFT's own LoHa/LoKr layers (attention
    # and a convolution, alpha 8 at r 4); the reference is PEFT's merge of the same layers.
    import copy
    import json

    import peft

    e = DiffusionEngine(ModelConfig(source="builtin:tiny-sd", device="cpu", warmup=False))
    base = pixels(e)[0]
    config = getattr(peft, f"{kind}Config")(
        r=4, alpha=8, target_modules=["to_q", "to_v", CONV], init_weights=False
    )
    torch.manual_seed(3)
    adapted = peft.inject_adapter_in_model(config, copy.deepcopy(e.pipe.unet))
    with torch.no_grad():  # PEFT's random init changes the image too little to tell
        for name, p in adapted.named_parameters():
            if "hada_" in name or "lokr_" in name:
                p.mul_(3)
    state = {f"base_model.model.{k}": v for k, v in peft.get_peft_model_state_dict(adapted).items()}
    (tmp_path / kind).mkdir()
    save_file(state, str(tmp_path / kind / "adapter_model.safetensors"))
    (tmp_path / kind / "adapter_config.json").write_text(json.dumps(config.to_dict(), default=str))
    e.load_lora("x", str(tmp_path / kind))
    got = pixels(e, loras=(("x", 1.0),))[0]
    for module in adapted.modules():
        if isinstance(module, peft.tuners.lycoris_utils.LycorisLayer):
            module.merge()
    merged_weights = {k.replace(".base_layer", ""): v for k, v in adapted.state_dict().items()
                      if "hada_" not in k and "lokr_" not in k}  # fmt: skip
    reference = DiffusionEngine(ModelConfig(source="builtin:tiny-sd", device="cpu", warmup=False))
    reference.pipe.unet.load_state_dict(merged_weights)
    want = pixels(reference)[0]
    assert np.abs(got - want).max() <= 1 and np.abs(got - base).max() > 10


def test_an_sdxl_kohya_file_under_the_original_unet_names_changes_the_image_as_its_merge_does(tmp_path):
    # SDXL's kohya files name modules as the original UNet does (`input_blocks_4_0_in_layers_2`
    # for diffusers' `down_blocks.1.resnets.0.conv1`): a LoHa and a LoKr convolution and
    # attention projection so named make the image of their updates merged.
    names = {
        "down_blocks.1.resnets.0.conv1": "lora_unet_input_blocks_4_0_in_layers_2",
        "down_blocks.1.resnets.0.conv2": "lora_unet_input_blocks_4_0_out_layers_3",
        "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q": (
            "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q"
        ),
    }
    config = ModelConfig(source="builtin:tiny-sdxl", device="cpu", warmup=False)
    e, g = DiffusionEngine(config), torch.Generator().manual_seed(4)
    base = pixels(e)[0]
    for kind, make in (("loha", loha), ("lokr", lokr)):
        state, reference = {}, DiffusionEngine(config)
        for module, key in names.items():
            weight = reference.pipe.unet.get_submodule(module).weight
            parts, delta = make(tuple(weight.shape), 4, 2.0, g)
            state.update({f"{key}.{k}": v for k, v in parts.items()})
            with torch.no_grad():
                weight += delta
        save_file(state, str(tmp_path / f"{kind}.safetensors"))
        e.load_lora(kind, str(tmp_path / f"{kind}.safetensors"))
        got = pixels(e, loras=((kind, 1.0),))[0]
        assert np.abs(got - pixels(reference)[0]).max() <= 1 and np.abs(got - base).max() > 10, kind
