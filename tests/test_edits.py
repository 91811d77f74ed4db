"""`POST /v1/images/edits` and image inputs on the handle, through Serve: the official `openai`
client, the multipart and JSON forms, inpainting, an instruction-edit model, streaming, abort,
adapters, and every kind of bad image answered with a 400 (or 413) that names the field."""

from __future__ import annotations

import base64
import concurrent.futures as cf
import io
import json
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from serve_app.schemas import GenerationRequest, TensorPayload
from tests.conftest import ADAPTER_DIR, deployed, wait_for

EDITS = "/v1/images/edits"


def png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def picture(size: int = 64, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size] / size
    arr = np.stack([x * 255, y * 255, np.full_like(x, rng.uniform(0, 255))], -1).astype(np.uint8)
    return Image.fromarray(arr).convert(mode)


def decoded(body: dict, i: int = 0) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(body["data"][i]["b64_json"])))).astype(int)


def up(data: bytes | Image.Image, name: str = "a.png") -> tuple[str, bytes, str]:
    """One uploaded file, as httpx takes it."""
    return (name, png(data) if isinstance(data, Image.Image) else data, "image/png")


def form(client, files: dict | list, prefix: str = "", **fields):
    return client.post(f"{prefix}{EDITS}", files=files, data={k: str(v) for k, v in fields.items()})


def test_the_openai_client_edits_and_generates(base_url, tmp_path):
    from openai import OpenAI

    path = tmp_path / "in.png"
    path.write_bytes(png(picture()))
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    with open(path, "rb") as f:
        edited = client.images.edit(model="tiny-sd", image=f, prompt="a red boat", n=2, size="64x64")
    assert len(edited.data) == 2 and edited.data[0].b64_json != edited.data[1].b64_json
    assert Image.open(io.BytesIO(base64.b64decode(edited.data[0].b64_json))).size == (64, 64)
    made = client.images.generate(model="tiny-sd", prompt="a blue boat", size="32x32", n=1)
    assert Image.open(io.BytesIO(base64.b64decode(made.data[0].b64_json))).size == (32, 32)


def test_the_openai_client_streams_partial_images(base_url, client, tmp_path):
    """OpenAI's image stream, parsed by the official SDK: the partial images asked for, then the
    completed image, the same as the image of the same seed made without streaming."""
    from openai import OpenAI

    oai = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    extra = {"seed": 5, "num_inference_steps": 6}
    events = list(
        oai.images.generate(
            model="tiny-sd",
            prompt="a red boat",
            size="32x32",
            stream=True,
            partial_images=2,
            extra_body=extra,
        )
    )
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    assert all(Image.open(io.BytesIO(base64.b64decode(e.b64_json))).format == "PNG" for e in events)
    plain = client.post("/v1/images/generations", json={"prompt": "a red boat", "size": "32x32", **extra})
    assert events[-1].b64_json == plain.json()["data"][0]["b64_json"]
    assert events[-1].size == "32x32" and events[-1].output_format == "png"

    path = tmp_path / "in.png"
    path.write_bytes(png(picture(32)))
    with open(path, "rb") as f:
        edits = list(
            oai.images.edit(image=f, prompt="a boat", stream=True, partial_images=0, n=2, extra_body=extra)
        )
    assert [e.type for e in edits] == ["image_edit.completed"] * 2
    # A bad request is refused before the stream opens, as the SDK's error type.
    import openai

    with pytest.raises(openai.BadRequestError, match="num_inference_steps"):
        list(
            oai.images.generate(
                prompt="x", stream=True, partial_images=1, extra_body={"num_inference_steps": 999}
            )
        )


def test_edit_size_defaults_to_the_input_and_seeds_hold(client):
    files = {"image": ("in.png", png(picture(48)), "image/png")}
    a = form(client, files, prompt="x", seed=3, strength=0.5, num_inference_steps=6)
    assert a.status_code == 200, a.text
    assert decoded(a.json()).shape[:2] == (48, 48) and a.json()["data"][0]["seed"] == 3
    b = form(client, files, prompt="x", seed=3, strength=0.5, num_inference_steps=6)
    assert a.json()["data"][0]["b64_json"] == b.json()["data"][0]["b64_json"]


def test_json_form_with_a_data_url_and_a_mask(client):
    src = png(picture())
    mask = Image.new("RGBA", (64, 64), (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (0, 0, 32, 64))  # transparent left half: paint there (OpenAI's way)
    body = {
        "prompt": "a cat",
        "image": "data:image/png;base64," + base64.b64encode(src).decode(),
        "mask": base64.b64encode(png(mask)).decode(),
        "seed": 1,
        "num_inference_steps": 6,
    }
    r = client.post(EDITS, json=body)
    assert r.status_code == 200, r.text
    # The same edit as a form gives the same image.
    files = [("image", ("i.png", src, "image/png")), ("mask", ("m.png", png(mask), "image/png"))]
    f = form(client, files, prompt="a cat", seed=1, num_inference_steps=6)
    assert f.json()["data"][0]["b64_json"] == r.json()["data"][0]["b64_json"]


def bomb_png(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height pixels, with a few bytes of data."""

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


NOISE = png(Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)))
BAD = [
    ({"image": ("a.png", b"not an image at all", "image/png")}, {}, "image", "not an image file"),
    ({"image": ("a.png", NOISE[: len(NOISE) // 2], "image/png")}, {}, "image", "damaged or truncated"),
    ({"image": ("a.png", bomb_png(60000, 60000), "image/png")}, {}, "image", "than the limit"),
    ({"image": ("a.png", bomb_png(5000, 5000), "image/png")}, {}, "image", "above the limit of 16777216"),
    ({"image": ("a.png", b"", "image/png")}, {}, "image", "empty"),
    ({"image": ("a.png", png(picture(4)), "image/png")}, {}, "image", "too small"),
    (
        [("image", up(picture())), ("mask", up(picture(32)))],
        {},
        "mask",
        "differs from the image's 64x64",
    ),
    (
        [("image", up(picture())), ("image", up(picture()))],
        {},
        "image",
        "2 images; tiny-sd (StableDiffusionPipeline) takes one",
    ),
    ({"image": ("a.png", png(picture()), "image/png")}, {"strength": 0}, "strength", "greater than 0"),
    ({"image": ("a.png", png(picture()), "image/png")}, {"strength": 1.5}, "strength", "less than or equal"),
    ({"image": ("a.png", png(picture()), "image/png")}, {"size": "4000x4000"}, "width", "above the maximum"),
    ({"image": ("a.png", png(picture()), "image/png")}, {"lora": "{bad"}, "lora", "JSON object"),
    ({}, {}, "image", "Field required"),
]


@pytest.mark.parametrize("files, fields, param, words", BAD)
def test_bad_images_get_400_naming_the_field(client, files, fields, param, words):
    r = form(client, files, prompt="x", **fields)
    assert r.status_code == 400, (fields, r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_other_refusals_and_the_replica_keeps_serving(client):
    before = client.get("/v1/status").json()["replicas"][0]["replica_id"]
    r = client.post("/v1/images/generations", json={"prompt": "a", "strength": 0.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "strength"
    r = client.post(EDITS, content=b"prompt=x", headers={"content-type": "text/plain"})
    assert r.status_code == 400 and "multipart/form-data or application/json" in r.json()["error"]["message"]
    r = client.post(EDITS, json=["not", "an", "object"])
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    big = b"\0" * (16 * 1024 * 1024 + 10)
    r = client.post(EDITS, files={"image": ("a.png", big, "image/png")}, data={"prompt": "x"})
    assert r.status_code == 413 and r.json()["error"]["param"] == "body"
    ok = form(client, {"image": ("a.png", png(picture()), "image/png")}, prompt="fine")
    assert ok.status_code == 200
    assert client.get("/v1/status").json()["replicas"][0]["replica_id"] == before


def test_the_handle_takes_pil_bytes_and_tensors(handle):
    im = picture()
    arr = np.asarray(im).astype(np.float32) / 255  # (H, W, C) in 0..1
    import torch

    tensor = TensorPayload.from_tensor(torch.from_numpy(arr).permute(2, 0, 1))  # channels first
    outs = [
        handle.generate.remote(GenerationRequest(prompt="p", image=x, seed=2, strength=0.5)).result()
        for x in (im, png(im), tensor)
    ]
    assert outs[0].images[0] == outs[1].images[0] == outs[2].images[0]
    from serve_app.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="image: not an image file") as e:
        handle.generate.remote(GenerationRequest(prompt="p", image=b"junk")).result()
    assert e.value.param == "image"


def test_a_streamed_edit_runs_the_strength_s_share_of_its_steps(client):
    files = {"image": ("a.png", png(picture()), "image/png")}
    fields = {"prompt": "x", "stream": "true", "num_inference_steps": 10, "strength": 0.5, "preview_every": 1}
    with client.stream("POST", EDITS, files=files, data={k: str(v) for k, v in fields.items()}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    steps = [e for e in events if e["type"] == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3, 4, 5] and {e["total_steps"] for e in steps} == {5}
    assert steps[0]["preview_png"] and events[-1]["type"] == "result"
    assert events[-1]["metrics"]["steps"] == 5


def test_abort_an_edit_mid_run(client):
    rid = "edit-abort"
    files = {"image": ("a.png", png(picture(128)), "image/png")}
    with cf.ThreadPoolExecutor(1) as pool:
        body = {"prompt": "x", "request_id": rid, "num_inference_steps": 50, "strength": 1.0}
        fut = pool.submit(form, client, files, **body)
        wait_for(lambda: client.get(f"/v1/requests/{rid}").json().get("state") == "running", 60)
        assert client.post(f"/v1/requests/{rid}/abort").json()["result"] == "aborted"
        r = fut.result(60)
    assert r.status_code == 499 and r.json()["error"]["type"] == "aborted"


def test_an_adapter_applies_to_an_edit(client):
    from serve_app.tools.lora import make_adapter

    path = make_adapter(str(ADAPTER_DIR / "edit-style.safetensors"), seed=9, strength=2.0)
    assert client.post("/v1/loras", json={"name": "edit-style", "path": str(path)}).status_code == 200
    try:
        files = {"image": ("a.png", png(picture()), "image/png")}
        base = form(client, files, prompt="x", seed=1, strength=0.7)
        lora = json.dumps({"name": "edit-style"})
        styled = form(client, files, prompt="x", seed=1, strength=0.7, lora=lora)
        assert styled.status_code == 200, styled.text
        assert np.abs(decoded(base.json()) - decoded(styled.json())).mean() > 1
    finally:
        client.delete("/v1/loras/edit-style")


@pytest.fixture(scope="module")
def kontext(ray_cluster):
    model = {"source": "builtin:tiny-flux-kontext", "default_guidance_scale": 2.5}
    with deployed("kontext", model=model) as p:
        yield p


@pytest.mark.slow
def test_an_instruction_edit_model_over_http(kontext, client):
    card = client.get(f"{kontext}/v1/models").json()["data"][0]
    assert card["tasks"] == ["generate", "edit"]
    assert "image" in card["inputs"] and "mask" not in card["inputs"]
    body = {"prompt": "make it red", "seed": 4, "return_latents": "true"}
    a = form(client, {"image": up(picture(seed=1))}, kontext, **body)
    b = form(client, {"image": up(picture(seed=7))}, kontext, **body)
    assert a.status_code == 200, a.text
    assert decoded(a.json()).shape[:2] == (64, 64)
    lat_a, lat_b = (TensorPayload(**r.json()["latents"]).to_numpy() for r in (a, b))
    assert np.abs(lat_a - lat_b).mean() > 1e-5  # the reference image takes part
    r = form(client, {"image": ("a.png", png(picture()), "image/png")}, kontext, prompt="x", strength=0.5)
    assert r.status_code == 400 and "takes no strength" in r.json()["error"]["message"]
    mask = [("image", up(picture())), ("mask", up(picture()))]
    r = form(client, mask, kontext, prompt="x")
    assert r.status_code == 400 and r.json()["error"]["param"] == "mask"


# What vLLM-Omni's clients send (its documented ImageGenerationRequest / ImageEditRequest fields).
VLLM_OMNI_GENERATION = {
    "prompt": "a cat wearing a tiara",
    "model": None,
    "n": 1,
    "size": "32x32",
    "response_format": "b64_json",
    "user": None,
    "negative_prompt": "blurry",
    "num_inference_steps": 4,
    "guidance_scale": 5.0,
    "seed": 42,
    "generator_device": "cpu",
    "lora": None,
    "vae_use_slicing": False,
    "vae_use_tiling": False,
}


def test_requests_shaped_as_vllm_omni_documents_them(client):
    r = client.post("/v1/images/generations", json=VLLM_OMNI_GENERATION)
    assert r.status_code == 200, r.text
    omni_only = ("generator_device", "vae_use_slicing", "vae_use_tiling", "lora", "user")
    plain = {k: v for k, v in VLLM_OMNI_GENERATION.items() if k not in omni_only}
    same = client.post("/v1/images/generations", json=plain)
    assert same.json()["data"][0]["b64_json"] == r.json()["data"][0]["b64_json"]  # cpu is this model's device
    # The VAE options are honoured for the call (slicing and tiling decode the same image here).
    tiled = client.post("/v1/images/generations", json={**VLLM_OMNI_GENERATION, "vae_use_tiling": True,
                                                         "vae_use_slicing": True})  # fmt: skip
    assert tiled.status_code == 200, tiled.text
    # vLLM-Omni's adapter names (lora_name, lora_scale, int_id) and its edit form fields.
    from serve_app.tools.lora import make_adapter

    path = make_adapter(str(ADAPTER_DIR / "omni.safetensors"), seed=11)
    assert client.post("/v1/loras", json={"name": "omni", "path": str(path)}).status_code == 200
    try:
        lora = {"lora_name": "omni", "lora_scale": 0.5, "int_id": 7}
        r = client.post("/v1/images/generations", json={**VLLM_OMNI_GENERATION, "lora": lora})
        assert r.status_code == 200, r.text
        assert r.json()["data"][0]["b64_json"] != same.json()["data"][0]["b64_json"]
        fields = {k: v for k, v in VLLM_OMNI_GENERATION.items() if v is not None and k != "size"}
        fields["lora"] = json.dumps(lora)
        e = form(client, {"image": up(picture(32))}, **fields)
        assert e.status_code == 200, e.text
    finally:
        client.delete("/v1/loras/omni")
    # Where this model cannot honour a field, a 400 names it.
    for bad, param in (
        ({"true_cfg_scale": 4.0}, "true_cfg_scale"),
        ({"generator_device": "cuda"}, "generator_device"),
    ):
        r = client.post("/v1/images/generations", json={**VLLM_OMNI_GENERATION, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
