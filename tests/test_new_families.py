"""The families of issue 56 through the whole system: one application serving the eight new twins
(Qwen-Image and its edit model, Z-Image, FLUX.2 [klein] and [dev], Wan 2.2 image-to-video,
LTX-Video, HunyuanVideo 1.5), each the real diffusers pipeline at toy size, called over HTTP (and the
image-to-video one through OpenAI's SDK): each task it offers, and each input it does not take
refused with a 400 naming the field."""

from __future__ import annotations

import base64
import copy
import io

import av
import numpy as np
import pytest
from PIL import Image

from tests.conftest import SESSION_DIR, TEST_ARGS, deploy, replica_ids
from tests.test_edits import picture, png, up

pytestmark = pytest.mark.slow  # an application of eight models
APP = "fam26"
P = f"/{APP}"
MODELS = {
    "qwen-image": "tiny-qwen-image",
    "qwen-image-edit": "tiny-qwen-image-edit",
    "z-image": "tiny-z-image",
    "flux2-klein": "tiny-flux2-klein",
    "flux2": "tiny-flux2",
    "wan-i2v": "tiny-wan-i2v",
    "ltx": "tiny-ltx",
    "hunyuan-video": "tiny-hunyuan-video",
}


@pytest.fixture(scope="module")
def fam(ray_cluster):
    from ray import serve

    args = copy.deepcopy(TEST_ARGS)
    base = args.pop("model")
    common = {k: base[k] for k in ("device", "warmup_steps", "cpu_threads", "engine_extension")}
    args["models"] = [
        {"model": {**common, "name": name, "source": f"builtin:{src}", "default_steps": 2}}
        for name, src in MODELS.items()
    ]
    args["lora"] = {**args["lora"], "registry_path": str(SESSION_DIR / f"{APP}-loras.json")}
    # Joining on, as on a GPU: requests that start from their own images must still not share.
    args["batching"] = {**args["batching"], "step_joining": True}
    deploy(APP, args)
    yield P
    serve.delete(APP, _blocking=False)


def generate(client, **body):
    r = client.post(f"{P}/v1/images/generations", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def frames(b64_or_bytes) -> list[np.ndarray]:
    data = base64.b64decode(b64_or_bytes) if isinstance(b64_or_bytes, str) else b64_or_bytes
    with av.open(io.BytesIO(data)) as c:
        return [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]


def refused(r, param: str) -> str:
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    return r.json()["error"]["message"]


def test_the_cards_say_each_family_and_what_it_does(fam, client):
    cards = {c["id"]: c for c in client.get(f"{P}/v1/models").json()["data"]}
    tasks = {name: cards[name]["tasks"] for name in MODELS}
    assert tasks == {
        "qwen-image": ["generate", "img2img", "inpaint"],
        "qwen-image-edit": ["edit"],
        "z-image": ["generate", "img2img", "inpaint"],
        "flux2-klein": ["generate", "edit"],
        "flux2": ["generate", "edit"],
        "wan-i2v": ["edit"],
        "ltx": ["generate"],
        "hunyuan-video": ["generate"],
    }, tasks
    assert [cards[n]["modalities"] for n in ("ltx", "wan-i2v", "qwen-image")] == [
        ["video"],
        ["video"],
        ["image"],
    ]


@pytest.mark.parametrize("model", ["qwen-image", "z-image", "flux2-klein", "flux2"])
def test_a_new_image_family_generates_each_seed_reproducibly(fam, client, model):
    """Image k of a request is its seed's (to rounding: a batched call's arithmetic differs a
    little from a single one's), and two seeds make two images."""
    from serve_app.schemas import TensorPayload

    two = generate(client, model=model, prompt="a red circle", seed=3, n=2, return_latents=True)
    assert [d["seed"] for d in two["data"]] == [3, 4] and two["size"] == "64x64"
    again = generate(client, model=model, prompt="a red circle", seed=4, return_latents=True)
    pair, alone = (TensorPayload(**r["latents"]).to_numpy() for r in (two, again))
    assert np.abs(pair[1] - alone[0]).max() < 1e-3 and np.abs(pair[0] - pair[1]).max() > 0.1


@pytest.mark.parametrize("model", ["qwen-image", "z-image"])
def test_image_to_image_and_inpainting_where_diffusers_offers_them(fam, client, model):
    base = {"model": model, "prompt": "a blue square", "seed": 2, "num_inference_steps": 4}
    img = client.post(
        f"{P}/v1/images/edits", files={"image": up(picture(64, 1))}, data={**base, "strength": "0.5"}
    )
    assert img.status_code == 200, img.text
    mask = Image.new("L", (64, 64), 0)
    mask.paste(255, (16, 16, 48, 48))
    inpaint = client.post(f"{P}/v1/images/edits", files={"image": up(picture(64, 1)), "mask": up(mask)},
                          data={k: str(v) for k, v in base.items()})  # fmt: skip
    assert inpaint.status_code == 200, inpaint.text
    a, b = (
        np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))))
        for r in (img, inpaint)
    )
    assert a.shape == b.shape == (64, 64, 3) and not np.array_equal(a, b)


def test_qwen_image_edit_takes_three_reference_images_and_each_one_counts(fam, client):
    """Edit-2509's several images of one prompt: the form repeats `image[]`; the answer changes
    when the second image does, and is the same for the same images."""
    refs = [picture(64, s) for s in (1, 2, 3)]
    data = {"model": "qwen-image-edit", "prompt": "put them together", "seed": 5}

    def edit(images):
        r = client.post(f"{P}/v1/images/edits", files=[("image[]", up(im)) for im in images], data=data)
        assert r.status_code == 200, r.text
        return r.json()["data"][0]["b64_json"]

    first = edit(refs)
    assert edit(refs) == first
    assert edit([refs[0], picture(64, 9), refs[2]]) != first
    as_json = client.post(
        f"{P}/v1/images/edits", json={**data, "image": [base64.b64encode(png(im)).decode() for im in refs]}
    )
    assert as_json.status_code == 200 and as_json.json()["data"][0]["b64_json"] == first, as_json.text
    # AUTOMATIC1111's img2img takes them as `init_images` too.
    a1111 = {"prompt": "put them together", "seed": 5, "steps": 2, "width": 64, "height": 64,
             "init_images": [base64.b64encode(png(im)).decode() for im in refs],
             "override_settings": {"sd_model_checkpoint": "qwen-image-edit"}}  # fmt: skip
    r = client.post(f"{P}/sdapi/v1/img2img", json=a1111)
    assert r.status_code == 200 and len(r.json()["images"]) == 1, r.text
    # A model that takes one image, too many images, and no image at all: 400s naming `image`.
    one = client.post(f"{P}/v1/images/edits", files=[("image[]", up(im)) for im in refs[:2]],
                      data={**data, "model": "qwen-image"})  # fmt: skip
    assert "takes one" in refused(one, "image")
    many = client.post(f"{P}/v1/images/edits", files=[("image[]", up(refs[0]))] * 5, data=data)
    assert "limits.max_input_images" in refused(many, "image")
    refused(
        client.post(f"{P}/v1/images/generations", json={"model": "qwen-image-edit", "prompt": "x"}), "image"
    )


@pytest.mark.parametrize("model", ["flux2-klein", "flux2"])
def test_flux2_edits_from_references_and_refuses_a_negative_prompt(fam, client, model):
    data = {"model": model, "prompt": "a cat", "seed": 1}
    r = client.post(
        f"{P}/v1/images/edits", files=[("image[]", up(picture(64, s))) for s in (1, 2)], data=data
    )
    assert r.status_code == 200, r.text
    plain = generate(client, **data)["data"][0]["b64_json"]
    assert r.json()["data"][0]["b64_json"] != plain  # the references count
    bad = client.post(f"{P}/v1/images/generations", json={**data, "negative_prompt": "dogs"})
    assert "takes none" in refused(bad, "negative_prompt")
    if model == "flux2":  # [dev] is guidance-distilled: the scale is an input of its transformer
        other = generate(client, **data, guidance_scale=1.5)["data"][0]["b64_json"]
        assert other != plain


def test_ltx_and_hunyuan_make_videos_at_their_frame_rules(fam, client):
    url = f"{P}/v1/videos/generations"
    ltx = client.post(url, json={"model": "ltx", "prompt": "a boat", "num_frames": 17, "seed": 1})
    assert ltx.status_code == 200, ltx.text
    assert len(frames(ltx.json()["data"][0]["b64_json"])) == 17  # 8k+1
    assert "8k+1" in refused(
        client.post(url, json={"model": "ltx", "prompt": "a", "num_frames": 13}), "num_frames"
    )
    hy = client.post(url, json={"model": "hunyuan-video", "prompt": "a boat", "seed": 1})
    assert hy.status_code == 200, hy.text
    clip = frames(hy.json()["data"][0]["b64_json"])
    assert len(clip) == 5 and clip[0].shape == (48, 80, 3)
    # Its call takes no step callback: the engine sees each step from its scheduler, so it streams.
    r = client.post(
        url, json={"model": "hunyuan-video", "prompt": "a boat", "stream": True, "num_inference_steps": 3}
    )
    steps = [e for e in r.text.split("\n\n") if '"type":"step"' in e.replace(" ", "")]
    assert r.status_code == 200 and len(steps) == 3, r.text[:500]
    guided = client.post(url, json={"model": "hunyuan-video", "prompt": "a", "guidance_scale": 3})
    assert "guider" in refused(guided, "guidance_scale")


def test_wan_image_to_video_through_openai_s_sdk(fam, client, base_url):
    """`client.videos.create_and_poll` with an `input_reference`, then `download_content`: the
    MP4 starts from that image (another image, another video); a text-only request, or an image
    to a text-to-video model, is a 400 naming `input_reference`."""
    import openai
    from openai import OpenAI

    before = replica_ids(client, P)
    oai = OpenAI(base_url=f"{base_url}{P}/v1", api_key="i2v-key", max_retries=0)
    extra = {"num_inference_steps": 2, "seed": 4, "fps": 4}

    def video(color: str) -> bytes:
        ref = ("start.png", png(Image.new("RGB", (32, 32), color)), "image/png")
        made = oai.videos.create_and_poll(model="wan-i2v", prompt="a boat", input_reference=ref, seconds="1",
                                          size="32x32", extra_body=extra, poll_interval_ms=100)  # fmt: skip
        assert made.status == "completed", made
        return oai.videos.download_content(made.id).content

    red = video("red")
    assert len(frames(red)) == 5 and video("red") == red
    assert video("blue") != red
    start = base64.b64encode(png(Image.new("RGB", (32, 32), "red"))).decode()
    body = {
        "model": "wan-i2v",
        "prompt": "a boat",
        "num_frames": 5,
        "size": "32x32",
        "input_reference": start,
    }
    as_json = client.post(f"{P}/v1/videos/generations", json={**body, **extra})
    assert as_json.status_code == 200, as_json.text
    with pytest.raises(openai.BadRequestError) as e:
        oai.videos.create(model="wan-i2v", prompt="a boat", size="32x32")
    assert e.value.body["param"] == "input_reference"
    with pytest.raises(openai.BadRequestError) as e:
        oai.videos.create(
            model="ltx", prompt="a boat", input_reference=("a.png", png(picture(64)), "image/png")
        )
    assert e.value.body["param"] == "input_reference"
    assert replica_ids(client, P) == before


def test_requests_that_start_from_their_own_images_never_share_a_call(fam, client):
    """A model whose call takes one prompt's images (Wan's first frame, Qwen-Image-Edit's
    references) holds one request a call, joining on or off: two image-to-video requests sent
    together each make what they make alone; a request's `n` outputs come from one call."""
    import concurrent.futures as cf

    def i2v(color: str):
        start = base64.b64encode(png(Image.new("RGB", (32, 32), color))).decode()
        body = {"model": "wan-i2v", "prompt": "a boat", "seed": 2, "num_frames": 5, "input_reference": start}
        r = client.post(f"{P}/v1/videos/generations", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    alone = [i2v(c) for c in ("red", "blue")]
    with cf.ThreadPoolExecutor(2) as pool:
        together = list(pool.map(i2v, ("red", "blue")))
    for a, t in zip(alone, together, strict=True):
        assert t["metrics"]["batch_requests"] == 1, t["metrics"]
        diff = [
            np.abs(x.astype(int) - y).max()
            for x, y in zip(frames(a["data"][0]["b64_json"]), frames(t["data"][0]["b64_json"]), strict=True)
        ]
        assert max(diff) <= 2, diff
    two = client.post(f"{P}/v1/images/edits", files=[("image[]", up(picture(64, s))) for s in (1, 2)],
                      data={"model": "qwen-image-edit", "prompt": "mix", "seed": 8, "n": "2"})  # fmt: skip
    assert two.status_code == 200, two.text
    assert [d["seed"] for d in two.json()["data"]] == [8, 9] and two.json()["metrics"]["batch_images"] == 2


def test_an_adapter_on_a_new_family_and_a_clear_refusal_where_its_pipeline_takes_none(fam, client):
    from serve_app.tools.lora import make_adapter
    from tests.conftest import ADAPTER_DIR

    path = make_adapter(
        str(ADAPTER_DIR / "qwen-style.safetensors"), seed=5, model="tiny-qwen-image", strength=3.0
    )
    r = client.post(f"{P}/v1/loras", json={"name": "qwen-style", "path": str(path), "model": "qwen-image"})
    assert r.status_code == 200, r.text
    try:
        body = {"model": "qwen-image", "prompt": "a cat", "seed": 1}
        base = generate(client, **body)["data"][0]["b64_json"]
        styled = generate(client, **body, lora={"name": "qwen-style"})["data"][0]["b64_json"]
        off = generate(client, **body, lora={"name": "qwen-style", "scale": 0})["data"][0]["b64_json"]
        assert styled != base and off == base
    finally:
        client.delete(f"{P}/v1/loras/qwen-style")
    # HunyuanVideo 1.5's pipeline has no LoRA loader: registering one for it is a 400 saying so.
    bad = client.post(f"{P}/v1/loras", json={"name": "hy-style", "path": str(path), "model": "hunyuan-video"})
    assert "takes no LoRA adapters" in refused(bad, "path")


@pytest.mark.parametrize("model", list(MODELS))
def test_streamed_previews_of_every_new_family(fam, client, model):
    """Step events with a preview of the latents at every step (packed sequences unpacked or laid
    out on a grid, video latents at their first frame), whatever the layout; a decoded
    trajectory, which these families' VAEs are not proven to give, is a 400 naming the field."""
    video = model in ("wan-i2v", "ltx", "hunyuan-video")
    body = {
        "model": model,
        "prompt": "a boat",
        "seed": 1,
        "num_inference_steps": 2,
        "stream": True,
        "preview_every": 1,
    }
    if model == "wan-i2v":
        body["input_reference"] = base64.b64encode(png(Image.new("RGB", (32, 32), "red"))).decode()
    url = f"{P}/v1/videos/generations" if video else f"{P}/v1/images/generations"
    if model == "qwen-image-edit":
        url = f"{P}/v1/images/edits"
        body["image"] = [base64.b64encode(png(picture(64, s))).decode() for s in (1, 2)]
    r = client.post(url, json=body)
    assert r.status_code == 200, r.text
    import json

    events = [json.loads(e[len("data: ") :]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    previews = [e["preview_png"] for e in events if e.get("type") == "step"]
    assert len(previews) == 2, r.text[:800]
    assert all(Image.open(io.BytesIO(base64.b64decode(p))).size for p in previews)
    assert events[-1]["type"] == "result", events[-1]
    if not video and model != "qwen-image-edit":
        bad = client.post(
            f"{P}/v1/images/generations",
            json={"model": model, "prompt": "a", "return_trajectory_decoded": True},
        )
        refused(bad, "return_trajectory_decoded")


@pytest.mark.parametrize("model", ["qwen-image", "z-image", "flux2-klein", "flux2", "ltx", "hunyuan-video"])
def test_every_sampler_a_new_family_offers_runs(fam, client, model):
    """The card's samplers are the ones the pipeline can step with (LTX-Video hands its scheduler
    sigmas, so a scheduler that takes none is not offered); each makes its own image."""
    card = next(c for c in client.get(f"{P}/v1/models").json()["data"] if c["id"] == model)
    names = [s["name"] for s in card["samplers"]]
    assert names and names[0] == card["default_sampler"], card["samplers"]
    video = model in ("ltx", "hunyuan-video")
    url = f"{P}/v1/videos/generations" if video else f"{P}/v1/images/generations"
    made = []
    for name in names:
        r = client.post(
            url,
            json={"model": model, "prompt": "a cat", "seed": 1, "num_inference_steps": 3, "sampler": name},
        )
        assert r.status_code == 200, (name, r.text)
        made.append(r.json()["data"][0]["b64_json"])
    assert len(set(made)) == len(made)
    if model == "ltx":
        assert "DPM++ 2M" not in names


@pytest.mark.parametrize("model", ["qwen-image", "flux2-klein", "flux2", "ltx"])
def test_prompt_embeddings_by_handle_on_a_new_family(fam, client, model):
    """Where the card lists `prompt_embeds`, a handle caller's embeddings of its shape make an
    image (LTX-Video's call also wants their attention mask: every token counts); a wrong shape
    is an InvalidRequest naming the field."""
    import torch
    from ray import serve

    from serve_app.errors import InvalidRequest
    from serve_app.schemas import GenerationRequest, TensorPayload

    card = next(c for c in client.get(f"{P}/v1/models").json()["data"] if c["id"] == model)
    assert "prompt_embeds" in card["inputs"]
    shape = card["embeds_shapes"]["prompt_embeds"]
    emb = TensorPayload.from_tensor(torch.randn(*shape, generator=torch.Generator().manual_seed(0)))
    handle = serve.get_app_handle(APP)
    made = handle.generate.remote(
        GenerationRequest(model=model, seed=3, num_inference_steps=2, prompt_embeds=emb)
    ).result()
    assert len(made.images) == 1 and made.model == model
    with pytest.raises(InvalidRequest) as e:
        wrong = TensorPayload.from_tensor(torch.randn(1, 3, shape[2] + 1))
        handle.generate.remote(GenerationRequest(model=model, prompt_embeds=wrong)).result()
    assert e.value.param == "prompt_embeds"
