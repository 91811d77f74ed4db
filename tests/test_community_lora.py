"""Adapters in the kohya-ss (A1111) layout: `lora_unet_...` and `lora_te_...` modules with
`.lora_down.weight`, `.lora_up.weight` and an `.alpha` each. The same weights written in that
layout (`serve_app.formats.lora.to_kohya`, with an alpha other than the rank) make the same images as in
the diffusers layout; their text encoder parts change the text encoder, also for one row of a
call whose rows have other adapters; registered over HTTP like any adapter, and a file cut short
or a pickle under a `.safetensors` name is a 400 naming `path`."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from serve_app.engine import CallParams, Row
from serve_app.engine.adapters import read_adapter
from serve_app.formats.lora import to_kohya
from serve_app.tools.lora import main as lora_main
from serve_app.tools.lora import make_adapter
from tests.conftest import ADAPTER_DIR, SESSION_DIR, engine_cache, replica_ids

PROMPT = "a red circle"
RANK, ALPHA = 4, 2.0


@pytest.fixture(scope="module")
def adapters():
    """In the adapter root of the shared app: a UNet + text encoder adapter in the diffusers
    layout and in kohya's (alpha 2 of rank 4), the kohya one without its alphas, a text-encoder
    only kohya adapter (written by the command line), and two bad files."""
    d = ADAPTER_DIR
    both = make_adapter(str(d / "cl-both.safetensors"), seed=21, rank=RANK, strength=1.5, text_encoder=True)
    save_file(to_kohya(load_file(str(both)), alpha=ALPHA), str(d / "cl-both-kohya.safetensors"))
    kohya = load_file(str(d / "cl-both-kohya.safetensors"))
    save_file(
        {k: v for k, v in kohya.items() if not k.endswith(".alpha")}, str(d / "cl-no-alpha.safetensors")
    )
    te = make_adapter(str(d / "cl-te.safetensors"), seed=22, strength=3.0, denoiser=False, text_encoder=True)
    lora_main(["kohya", str(te), "--out", str(d / "cl-te-kohya.safetensors"), "--alpha", str(ALPHA)])
    good = (d / "cl-both-kohya.safetensors").read_bytes()
    (d / "cl-cut.safetensors").write_bytes(good[: len(good) - 100])
    torch.save(kohya, d / "cl-pickle.safetensors")
    return d


@pytest.fixture(scope="module")
def engine(adapters):
    with engine_cache() as get:
        e = get("tiny-sd")
        for name in ("cl-both", "cl-both-kohya", "cl-no-alpha", "cl-te-kohya"):
            e.load_lora(name, str(adapters / f"{name}.safetensors"))
        yield e


def params(loras=()) -> CallParams:
    return CallParams(height=32, width=32, steps=3, guidance_scale=7.5, loras=tuple(loras))


def pixels(image) -> np.ndarray:
    return np.asarray(image).astype(int)


def alone(e, loras=(), seed: int = 1) -> np.ndarray:
    return pixels(e.run([Row(PROMPT, None, seed)], params(loras)).images[0])


def test_the_kohya_layout_names_modules_and_alphas_as_kohya_does(adapters, engine):
    state = load_file(str(adapters / "cl-both-kohya.safetensors"))
    modules = {k.rsplit(".", 2)[0] if not k.endswith(".alpha") else k[: -len(".alpha")] for k in state}
    assert "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q" in modules
    assert "lora_te_text_model_encoder_layers_0_self_attn_q_proj" in modules
    for m in modules:
        assert {f"{m}.lora_down.weight", f"{m}.lora_up.weight", f"{m}.alpha"} <= state.keys()
        assert float(state[f"{m}.alpha"]) == ALPHA
    assert read_adapter(engine.pipe, str(adapters / "cl-te-kohya.safetensors"))  # the project's own checks
    held = engine.pipe.get_list_adapters()
    assert "cl-both-kohya" in held["unet"] and "cl-both-kohya" in held["text_encoder"]
    assert "cl-te-kohya" in held["text_encoder"] and "cl-te-kohya" not in held["unet"]


def test_a_kohya_adapter_makes_the_images_of_its_weights_in_the_diffusers_layout(engine):
    base = alone(engine)
    diffusers_layout = alone(engine, [("cl-both", 1.0)])
    kohya = alone(engine, [("cl-both-kohya", 1.0)])
    assert np.abs(kohya - diffusers_layout).max() <= 1 and np.abs(kohya - base).max() > 20
    # Its alphas count: without them (alpha = rank) the same file acts twice as strongly.
    assert np.abs(alone(engine, [("cl-no-alpha", 1.0)]) - kohya).max() > 5
    assert np.abs(alone(engine, [("cl-both-kohya", 0.5)]) - alone(engine, [("cl-both", 0.5)])).max() <= 1


def test_a_text_encoder_only_kohya_adapter_changes_the_image_also_beside_other_rows(engine):
    """Rows with different adapters share the call: the text encoder's LoRA layers take each
    row's own deltas too, so a text-encoder-only adapter still acts on its row, and only there."""
    base, te = alone(engine), alone(engine, [("cl-te-kohya", 1.0)])
    assert np.abs(te - base).max() > 5
    sets = [(("cl-te-kohya", 1.0),), (), (("cl-both-kohya", 0.5),)]
    rows = [Row(PROMPT, None, 1, adapters=s) for s in sets]
    mixed = [pixels(im) for im in engine.run(rows, params()).images]
    for image, s in zip(mixed, sets, strict=True):
        assert np.abs(image - alone(engine, s)).max() <= 3, s
    assert np.abs(mixed[0] - base).max() > 5


def png(r) -> np.ndarray:
    assert r.status_code == 200, r.text
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"])))).astype(int)


def test_kohya_adapters_register_and_serve_over_http(adapters, client):
    """`POST /v1/loras` takes a kohya file; its image is the diffusers-layout twin's. A file cut
    short and a pickle named `.safetensors` are 400s naming `path`, and the replica stays."""

    before = replica_ids(client)
    names = ("cl-both", "cl-both-kohya")
    try:
        for name in names:
            r = client.post("/v1/loras", json={"name": name, "path": f"{name}.safetensors"})
            assert r.status_code == 200, r.text
        body = {"prompt": PROMPT, "seed": 3, "size": "32x32", "num_inference_steps": 3}
        images = [
            png(client.post("/v1/images/generations", json={**body, "lora": {"name": n}})) for n in names
        ]
        assert np.abs(images[0] - images[1]).max() <= 1
        assert np.abs(images[1] - png(client.post("/v1/images/generations", json=body))).max() > 20
        for name, message in [("cl-cut", "is cut short"), ("cl-pickle", "holds a pickle")]:
            r = client.post("/v1/loras", json={"name": name, "path": f"{name}.safetensors"})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "path", r.text
            assert f"'{name}.safetensors' {message}" in err["message"] and str(SESSION_DIR) not in r.text, err
        assert replica_ids(client) == before
    finally:
        for name in names:
            client.delete(f"/v1/loras/{name}")
