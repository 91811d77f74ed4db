"""DoRA adapters (`serve_app/engine/dora.py`): a LoRA and a magnitude per output, the layer's
weight set to `m * (W + k B A) / ||W + k B A||`. A DoRA file in kohya's layout (LyCORIS's
`dora_scale`, on attention layers and a convolution) or a PEFT directory (`use_dora`) changes
the image as that weight merged into the UNet does: alone, at another scale, stacked with a
LoRA, per row beside rows with other adapters, in a joined run; and an unloaded one leaves no
trace."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from serve_app.config import ModelConfig
from serve_app.engine import CallParams, DiffusionEngine, LoraError, Row

# Linear layers without a bias (to_q, to_v) and with one (to_out.0), by diffusers' names.
LINEAR = [f"down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_{p}" for p in ("q", "v", "out.0")]
CONV = "down_blocks.1.resnets.0.conv1"  # (64, 32, 3, 3)
FF = "down_blocks.1.attentions.0.transformer_blocks.0.ff.net.2"  # the plain LoRA's layer


def kohya(module: str) -> str:
    return "lora_unet_" + module.replace(".", "_")


def engine() -> DiffusionEngine:
    return DiffusionEngine(ModelConfig(source="builtin:tiny-sd", device="cpu", warmup=False))


def pixels(e: DiffusionEngine, rows=None, **kw) -> list[np.ndarray]:
    p = CallParams(height=32, width=32, steps=3, guidance_scale=7.5, **kw)
    out = e.run(rows or [Row("a red circle", None, 1)], p)
    return [np.asarray(im).astype(int) for im in out.images]


def random_dora(
    w: torch.Tensor, key: str, alpha: float, g: torch.Generator
) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """A rank-4 kohya DoRA module for weight `w` (its magnitudes 0.5-1.5 times the weight's row
    norms, LyCORIS's (out, 1, ...) shape): its keys, its `up @ down` and its magnitudes."""
    down = torch.randn(4, *w.shape[1:], generator=g) * 0.3
    up = torch.randn(w.shape[0], 4, *[1] * (w.dim() - 2), generator=g) * 0.3
    m = w.flatten(1).norm(dim=1) * (0.5 + torch.rand(w.shape[0], generator=g))
    keys = {f"{key}.lora_down.weight": down, f"{key}.lora_up.weight": up, f"{key}.alpha": torch.tensor(alpha),
            f"{key}.dora_scale": m.reshape(-1, *[1] * (w.dim() - 1))}  # fmt: skip
    return keys, (up.flatten(1) @ down.flatten(1)).reshape(w.shape), m


def dora_weight(w: torch.Tensor, delta: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """DoRA's merged weight: `m * (w + delta) / ||w + delta||`, the norm per output."""
    v = w + delta
    return v * (m / v.flatten(1).norm(dim=1)).reshape(-1, *[1] * (w.dim() - 1))


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A DoRA file (rank 4, alpha 2: k = 0.5 a unit of scale), a plain LoRA file, and each
    module's (up @ down, magnitude) for the merges."""
    root, g = tmp_path_factory.mktemp("dora"), torch.Generator().manual_seed(5)
    unet = engine().pipe.unet
    state, parts = {}, {}
    for module in (*LINEAR, CONV):
        keys, delta, m = random_dora(unet.get_submodule(module).weight.detach(), kohya(module), 2.0, g)
        state.update(keys)
        parts[module] = (delta, m)
    save_file(state, str(root / "dora.safetensors"))
    up, down = torch.randn(64, 4, generator=g) * 0.3, torch.randn(4, 256, generator=g) * 0.3
    save_file({f"{kohya(FF)}.lora_up.weight": up, f"{kohya(FF)}.lora_down.weight": down,
               f"{kohya(FF)}.alpha": torch.tensor(4.0)}, str(root / "lora.safetensors"))  # fmt: skip
    return (
        {"dora": str(root / "dora.safetensors"), "lora": str(root / "lora.safetensors")},
        parts,
        {FF: up @ down},
    )


def merged(parts: dict, scale: float = 1.0, lora: dict | None = None) -> DiffusionEngine:
    """An engine whose UNet holds DoRA's weights (k = scale * alpha / r) and a LoRA's update."""
    e = engine()
    with torch.no_grad():
        for module, (delta, m) in parts.items():
            w = e.pipe.unet.get_submodule(module).weight
            w.copy_(dora_weight(w, scale * 0.5 * delta, m))
        for module, delta in (lora or {}).items():
            e.pipe.unet.get_submodule(module).weight += delta
    return e


def test_a_dora_file_changes_the_image_as_its_merged_weights_do(made):
    files, parts, lora = made
    e = engine()
    base = pixels(e)[0]
    for name, path in files.items():
        e.load_lora(name, path)
    want = pixels(merged(parts))[0]
    got = pixels(e, loras=(("dora", 1.0),))[0]
    assert np.abs(got - want).max() <= 1 and np.abs(got - base).max() > 10
    half = pixels(e, loras=(("dora", 0.5),))[0]  # the scale inside the norm, as PEFT has it
    assert np.abs(half - pixels(merged(parts, 0.5))[0]).max() <= 1 and np.abs(half - got).max() > 10
    both = pixels(e, loras=(("dora", 1.0), ("lora", 1.0)))[0]
    assert np.abs(both - pixels(merged(parts, lora=lora))[0]).max() <= 1
    # Per row: the DoRA row beside a plain row and a LoRA row, in one call.
    row = Row("a red circle", None, 1)
    rows = [
        dataclasses.replace(row, adapters=(("dora", 1.0),)),
        row,
        dataclasses.replace(row, adapters=(("lora", 1.0),)),
    ]
    mixed = pixels(e, rows)
    assert np.abs(mixed[0] - want).max() <= 2 and np.abs(mixed[1] - base).max() <= 2
    assert np.abs(mixed[2] - pixels(merged({}, lora=lora))[0]).max() <= 2
    # After the DoRA call a plain LoRA call and a base call carry none of it.
    assert np.abs(pixels(e, loras=(("lora", 1.0),))[0] - mixed[2]).max() <= 2
    assert np.abs(pixels(e)[0] - base).max() == 0
    e.unload_lora("dora")
    e.load_lora("dora", files["lora"])  # the same name, now a plain LoRA: no magnitudes left
    assert np.abs(pixels(e, loras=(("dora", 1.0),))[0] - mixed[2]).max() <= 2


def test_a_joined_run_applies_dora(made):
    files, parts, _ = made
    e = engine()
    e.load_lora("dora", files["dora"])
    p = CallParams(height=32, width=32, steps=3, guidance_scale=7.5)
    run = e.open_joined(p, (("dora", 1.0),))
    seat = run.add(Row("a red circle", None, 1))
    while run.active:
        run.step()
    run.close()
    assert seat.error is None
    got = np.asarray(seat.output.images[0]).astype(int)
    assert np.abs(got - pixels(merged(parts))[0]).max() <= 2


def test_a_peft_dora_directory_makes_the_image_of_peft_s_own_merge(tmp_path):
    import copy
    import json

    import peft

    e = engine()
    base = pixels(e)[0]
    config = peft.LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["to_q", "to_v", CONV],
                             init_lora_weights=False)  # fmt: skip
    torch.manual_seed(3)
    adapted = peft.inject_adapter_in_model(config, copy.deepcopy(e.pipe.unet))
    with torch.no_grad():  # magnitudes off the base norms, or DoRA changes little
        for name, p in adapted.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(0.5 + torch.rand(p.shape))
            elif "lora_B" in name:
                p.mul_(3)
    state = {f"base_model.model.{k}": v for k, v in peft.get_peft_model_state_dict(adapted).items()}
    (tmp_path / "d").mkdir()
    save_file(state, str(tmp_path / "d" / "adapter_model.safetensors"))
    (tmp_path / "d" / "adapter_config.json").write_text(json.dumps(config.to_dict(), default=str))
    e.load_lora("x", str(tmp_path / "d"))
    got = pixels(e, loras=(("x", 1.0),))[0]
    for module in adapted.modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            module.merge()
    weights = {k.replace(".base_layer", ""): v for k, v in adapted.state_dict().items() if "lora_" not in k}
    reference = engine()
    reference.pipe.unet.load_state_dict(weights)
    assert np.abs(got - pixels(reference)[0]).max() <= 1 and np.abs(got - base).max() > 10


def test_a_dora_file_that_cannot_be_applied_is_refused_naming_the_module(made, tmp_path):
    files, _, _ = made
    from safetensors.torch import load_file

    state = load_file(files["dora"])
    e = engine()
    bad = {  # the magnitude over the input axis; one for a module without LoRA weights; a NaN
        "input": {**state, f"{kohya(LINEAR[0])}.dora_scale": torch.ones(1, 64)},
        "orphan": {**state, f"{kohya(FF)}.dora_scale": torch.ones(64, 1)},
        "nan": {**state, f"{kohya(CONV)}.dora_scale": torch.full((64, 1, 1, 1), float("nan"))},
    }
    said = {
        "input": f"{kohya(LINEAR[0])}: a DoRA magnitude of shape \\(1, 64\\) .* its input axis",
        "orphan": f"{kohya(FF)}: a DoRA magnitude without the module's LoRA weights",
        "nan": f"{kohya(CONV)}: its DoRA magnitude is not finite",
    }
    for case, st in bad.items():
        save_file(st, str(tmp_path / f"{case}.safetensors"))
        with pytest.raises(LoraError, match=said[case]):
            e.load_lora(case, str(tmp_path / f"{case}.safetensors"))
        assert case not in e.loaded_loras()
    # A quantized denoiser has no dense weight to take DoRA's norm of.
    cfg = ModelConfig(
        source="builtin:tiny-sd", device="cpu", warmup=False, optimizations={"quantize": "int8_weight_only"}
    )
    quantized = DiffusionEngine(cfg)
    with pytest.raises(LoraError, match="DoRA on a quantized or offloaded layer is not loaded"):
        quantized.load_lora("dora", files["dora"])
    assert "dora" not in quantized.loaded_loras()


def test_lycoris_and_dora_files_register_and_serve_over_http(client):
    """A LoHa and a DoRA file (the maker's) register through `POST /v1/loras`, change the image
    on the OpenAI route, and an A1111 `<lora:name:w>` tag makes the same image; both are listed."""
    import base64

    from serve_app.tools.lora import main as lora_main
    from tests.conftest import ADAPTER_DIR

    def image(route: str, body: dict) -> bytes:
        r = client.post(route, json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        return base64.b64decode(data["data"][0]["b64_json"] if "data" in data else data["images"][0])

    names = ("http-loha", "http-dora")
    plain = {"prompt": "a cat , sitting", "seed": 8, "num_inference_steps": 3}
    try:
        for name in names:
            lora_main(
                [
                    "make",
                    "--kind",
                    name.split("-")[1],
                    "--seed",
                    "7",
                    "--out",
                    str(ADAPTER_DIR / f"{name}.safetensors"),
                ]
            )
            r = client.post("/v1/loras", json={"name": name, "path": f"{name}.safetensors"})
            assert r.status_code == 200, r.text
        base = image("/v1/images/generations", plain)
        for name in names:
            ours = image("/v1/images/generations", {**plain, "loras": [{"name": name, "scale": 0.8}]})
            tagged = image(
                "/sdapi/v1/txt2img", {"prompt": f"a cat <lora:{name}:0.8>, sitting", "seed": 8, "steps": 3}
            )
            assert ours == tagged != base, name
        listed = {entry["name"] for entry in client.get("/sdapi/v1/loras").json()}
        assert set(names) <= listed
    finally:
        for name in names:
            client.delete(f"/v1/loras/{name}")


def test_a_loha_module_with_a_dora_scale_makes_its_merged_image(tmp_path):
    from tests.test_lycoris import loha

    e, reference, g = engine(), engine(), torch.Generator().manual_seed(9)
    state = {}
    for module in (*LINEAR, CONV):
        w = e.pipe.unet.get_submodule(module).weight.detach().clone()
        parts, delta = loha(tuple(w.shape), 4, 2.0, g)
        m = w.flatten(1).norm(dim=1) * (0.5 + torch.rand(w.shape[0], generator=g))
        state.update({f"{kohya(module)}.{k}": v for k, v in parts.items()})
        state[f"{kohya(module)}.dora_scale"] = m.reshape(-1, *[1] * (w.dim() - 1))
        with torch.no_grad():
            reference.pipe.unet.get_submodule(module).weight.copy_(dora_weight(w, delta, m))
    save_file(state, str(tmp_path / "loha-dora.safetensors"))
    e.load_lora("ld", str(tmp_path / "loha-dora.safetensors"))
    got = pixels(e, loras=(("ld", 1.0),))[0]
    assert np.abs(got - pixels(reference)[0]).max() <= 1 and np.abs(got - pixels(engine())[0]).max() > 10


ATTN1 = "transformer_blocks.0.attn1"


def test_an_sdxl_kohya_dora_file_under_the_original_unet_names_makes_its_merged_image(tmp_path):
    # SDXL's kohya files name the UNet's modules as the original does: the magnitudes find
    # their layers by those names too.
    config = ModelConfig(source="builtin:tiny-sdxl", device="cpu", warmup=False)
    e, reference, g = DiffusionEngine(config), DiffusionEngine(config), torch.Generator().manual_seed(8)
    names = {
        f"down_blocks.1.attentions.0.{ATTN1}.to_q": f"input_blocks_4_1_{ATTN1.replace('.', '_')}_to_q",
        "down_blocks.1.resnets.0.conv1": "input_blocks_4_0_in_layers_2",
    }
    state = {}
    for module, key in names.items():
        w = e.pipe.unet.get_submodule(module).weight.detach().clone()
        keys, delta, m = random_dora(w, f"lora_unet_{key}", 4.0, g)
        state.update(keys)
        with torch.no_grad():
            reference.pipe.unet.get_submodule(module).weight.copy_(dora_weight(w, delta, m))
    save_file(state, str(tmp_path / "sdxl-dora.safetensors"))
    e.load_lora("d", str(tmp_path / "sdxl-dora.safetensors"))
    got = pixels(e, loras=(("d", 1.0),))[0]
    base = pixels(DiffusionEngine(config))[0]
    assert np.abs(got - pixels(reference)[0]).max() <= 1 and np.abs(got - base).max() > 10
