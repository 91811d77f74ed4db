"""The AUTOMATIC1111 API (`/sdapi/v1/...`), as its clients call it.

Open WebUI's "Automatic1111" image engine first, with its requests built as its source builds
them; then txt2img and img2img against the OpenAI routes (the same seed, sampler and settings
give the same image), `<lora:name:weight>`, the lists, the errors with A1111's field names, and
on an app of two models with two user keys: each key's own model, progress with a preview of
its own request, and an interrupt that stops only its own.
"""

from __future__ import annotations

import base64
import io
import json
import threading
import time

import httpx
import pytest
from PIL import Image

from serve_app.errors import Forbidden, InvalidRequest, NotFound
from serve_app.ingress.a1111 import may_choose, take_loras
from serve_app.ingress.access import AccessPolicy
from tests.conftest import ADAPTER_DIR, SESSION_DIR, TEST_ARGS, app_args, deploy, wait_for

KEY_A, KEY_B = "a1111-user-a-5d1e", "a1111-user-b-09c4"


def png(b64: str) -> Image.Image:
    im = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert im.format == "PNG"
    return im


def ours(client, body: dict, route: str = "/v1/images/generations") -> list[bytes]:
    r = client.post(route, json=body)
    assert r.status_code == 200, r.text
    return [base64.b64decode(d["b64_json"]) for d in r.json()["data"]]


def a1111_error(r, status: int, param: str) -> str:
    """The error body: the project's envelope plus A1111's `detail` and `errors`."""
    assert r.status_code == status, r.text
    body = r.json()
    assert body["error"]["param"] == param and body["error"]["code"] == status
    assert body["detail"] == body["errors"] == body["error"]["message"]
    return body["detail"]


# ---------------------------------------------------------------------- Open WebUI's engine


def test_open_webui_automatic1111_engine(client):
    """What Open WebUI sends to an "Automatic1111" base URL, rebuilt from reading its source
    (open-webui/open-webui, backend/open_webui/routers/images.py: `verify_url`,
    `get_models`, `get_image_model`, `set_image_model` and the automatic1111 branch of
    `image_generations`), with its admin's settings IMAGE_SIZE "64x32", IMAGE_STEPS 4 and
    AUTOMATIC1111_PARAMS {"sampler_name": "DPM++ 2M", "scheduler": "Karras", "cfg_scale": 5}."""
    # No AUTOMATIC1111_API_AUTH: it sends an empty authorization header.
    headers = {"authorization": ""}
    assert client.get("/sdapi/v1/options", headers=headers).status_code == 200  # verify_url
    models = client.get("/sdapi/v1/sd-models", headers=headers).json()  # get_models
    listed = [{"id": m["title"], "name": m["model_name"]} for m in models]
    assert {"id": "tiny-sd", "name": "tiny-sd"} in listed
    options = client.get("/sdapi/v1/options", headers=headers).json()  # get_image_model
    assert options["sd_model_checkpoint"] == "tiny-sd"
    # set_image_model with another name for it: the options it read, posted back changed.
    options["sd_model_checkpoint"] = "dall-e-2"
    r = client.post("/sdapi/v1/options", json=options, headers=headers)
    r.raise_for_status()  # this app opens admin routes to loopback callers (auth.local_admin)
    assert client.get("/sdapi/v1/options", headers=headers).json()["sd_model_checkpoint"] == "tiny-sd"
    # image_generations: form_data.n = 2, a negative prompt, its settings merged last.
    data = {"prompt": "a lighthouse at dusk", "batch_size": 2, "width": 64, "height": 32}
    data["steps"] = 4
    data["negative_prompt"] = "blurry"
    data = {**data, **{"sampler_name": "DPM++ 2M", "scheduler": "Karras", "cfg_scale": 5}}
    r = client.post("/sdapi/v1/txt2img", json=data, headers=headers)
    res = r.json()
    assert r.status_code == 200, res
    images = [base64.b64decode(image) for image in res["images"]]  # get_image_data: no ',', a PNG
    assert len(images) == 2 and all(png(i).size == (64, 32) for i in res["images"])
    info = json.loads(res["info"])
    assert info["all_seeds"] == [info["seed"], info["seed"] + 1] and 0 <= info["seed"] < 2**32
    assert (info["sampler_name"], info["extra_generation_params"]["Schedule type"]) == ("DPM++ 2M", "Karras")
    assert "Steps: 4, Sampler: DPM++ 2M, Schedule type: Karras, CFG scale: 5" in info["infotexts"][0]
    same = {"prompt": "a lighthouse at dusk", "n": 2, "size": "64x32", "num_inference_steps": 4,
            "negative_prompt": "blurry", "guidance_scale": 5, "seed": info["seed"], "sampler": "DPM++ 2M",
            "sigma_schedule": "karras"}  # fmt: skip
    assert ours(client, same) == images


# ---------------------------------------------------------------------- txt2img and img2img


def test_txt2img_seeds_batches_and_iterations(client):
    body = {
        "prompt": "a red kite",
        "seed": 41,
        "batch_size": 2,
        "n_iter": 2,
        "steps": 3,
        "sampler_name": "Euler a",
    }
    res = client.post("/sdapi/v1/txt2img", json=body).json()
    info = json.loads(res["info"])
    assert info["all_seeds"] == [41, 42, 43, 44] and len(res["images"]) == 4
    assert len(info["request_ids"]) == 2 and not info["interrupted"]
    p = res["parameters"]
    assert (p["steps"], p["width"], p["height"], p["cfg_scale"], p["seed"]) == (3, 32, 32, 7.5, 41)
    mine = {"prompt": "a red kite", "num_inference_steps": 3, "sampler": "Euler a"}
    images = [base64.b64decode(i) for i in res["images"]]
    assert ours(client, {**mine, "seed": 43, "n": 2}) == images[2:]  # image k: seed + k
    # The model's own sampler when none is named; `send_images: false` answers none.
    res = client.post(
        "/sdapi/v1/txt2img", json={"prompt": "a kite", "seed": 2, "steps": 3, "scheduler": ""}
    ).json()
    assert json.loads(res["info"])["sampler_name"] == "DDIM" and res["parameters"]["sampler_name"] == "DDIM"
    quiet = client.post(
        "/sdapi/v1/txt2img", json={"prompt": "a kite", "seed": 2, "steps": 3, "send_images": False}
    )
    assert quiet.json()["images"] == [] and json.loads(quiet.json()["info"])["all_seeds"] == [2]
    # What only steers A1111's own files and UI is taken and changes nothing.
    ui = {"save_images": True, "do_not_save_grid": True, "comments": {}, "hr_scale": 2, "subseed": 5,
          "styles": [], "restore_faces": False, "enable_hr": False}  # fmt: skip
    same = client.post("/sdapi/v1/txt2img", json={"prompt": "a kite", "seed": 2, "steps": 3, **ui})
    assert same.json()["images"] == res["images"]


def test_img2img_and_inpainting(client):
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (20, 90, 200)).save(buf, "PNG")
    image = base64.b64encode(buf.getvalue()).decode()
    mask = io.BytesIO()
    Image.new("L", (32, 32), 255).save(mask, "PNG")
    body = {"prompt": "a blue pond", "init_images": [f"data:image/png;base64,{image}"], "seed": 3, "steps": 5,
            "denoising_strength": 0.6, "sampler_name": "LMS"}  # fmt: skip
    res = client.post("/sdapi/v1/img2img", json=body).json()
    assert res["parameters"]["init_images"] is None and res["parameters"]["denoising_strength"] == 0.6
    edit = {"prompt": "a blue pond", "image": image, "seed": 3, "num_inference_steps": 5, "strength": 0.6,
            "sampler": "LMS"}  # fmt: skip
    assert [base64.b64decode(i) for i in res["images"]] == ours(client, edit, "/v1/images/edits")
    masked = {**body, "mask": base64.b64encode(mask.getvalue()).decode(), "include_init_images": True}
    res = client.post("/sdapi/v1/img2img", json=masked).json()
    assert res["parameters"]["init_images"] == body["init_images"]
    edit_mask = {**edit, "mask": masked["mask"]}
    assert [base64.b64decode(i) for i in res["images"]] == ours(client, edit_mask, "/v1/images/edits")
    bad = client.post("/sdapi/v1/img2img", json={**body, "init_images": ["bm90IGFuIGltYWdl"]})
    assert "not an image" in a1111_error(bad, 400, "init_images")
    two = client.post("/sdapi/v1/img2img", json={**body, "init_images": [image, image]})
    a1111_error(two, 400, "init_images")
    second = client.post("/sdapi/v1/img2img", json={**body, "init_images": [image, "not base64!"]})
    assert a1111_error(second, 400, "init_images").startswith("init_images.1: must be base64")


def test_a_lora_tag_applies_a_registered_adapter(client):
    from serve_app.tools.lora import make_adapter

    path = make_adapter(str(ADAPTER_DIR / "a1111-tag.safetensors"), seed=51, strength=2.0)
    assert client.post("/v1/loras", json={"name": "a1111-tag", "path": str(path)}).status_code == 200
    try:
        base = {"seed": 8, "steps": 3}
        tagged = client.post(
            "/sdapi/v1/txt2img", json={**base, "prompt": "a cat <lora:a1111-tag:0.8>, sitting"}
        )
        res = tagged.json()
        plain = {"prompt": "a cat , sitting", "seed": 8, "num_inference_steps": 3}
        with_adapter = ours(client, {**plain, "loras": [{"name": "a1111-tag", "scale": 0.8}]})
        assert [base64.b64decode(i) for i in res["images"]] == with_adapter != ours(client, plain)
        assert json.loads(res["info"])["prompt"] == "a cat <lora:a1111-tag:0.8>, sitting"
        off = {**base, "prompt": "a cat <lora:a1111-tag:0.8>, sitting", "disable_extra_networks": True}
        assert [base64.b64decode(i) for i in client.post("/sdapi/v1/txt2img", json=off).json()["images"]] == (
            ours(client, plain)
        )  # fmt: skip
        listed = client.get("/sdapi/v1/loras").json()
        assert {
            "name": "a1111-tag",
            "alias": "a1111-tag",
            "path": "a1111-tag.safetensors",
            "metadata": {},
        } in listed
    finally:
        client.delete("/v1/loras/a1111-tag")
    gone = client.post("/sdapi/v1/txt2img", json={"prompt": "a cat <lora:a1111-tag>", "steps": 2})
    assert "<lora:a1111-tag> names no registered adapter" in a1111_error(gone, 404, "prompt")
    for prompt in ("a cat <lora:a1111-tag", "a cat <lora:a1111-tag:lots>", "<lora::1>", "<lora:x:1:2>"):
        a1111_error(client.post("/sdapi/v1/txt2img", json={"prompt": prompt}), 400, "prompt")


def test_take_loras_reads_the_tags():
    registered = {"red": {}, "blue": {}}
    assert take_loras("a <lora:red:0.5> cat <LORA:blue>", registered)[0] == "a cat"
    refs = take_loras("a <lora:red:0.5> cat <LORA:blue>", registered)[1]
    assert [(r.name, r.scale) for r in refs] == [("red", 0.5), ("blue", None)]
    assert take_loras("<lora:green:1>", None)[1][0].name == "green"  # not looked up
    with pytest.raises(NotFound, match="<lora:green> names no registered adapter; registered: blue, red"):
        take_loras("<lora:green:1>", registered)
    with pytest.raises(InvalidRequest, match="named twice"):
        take_loras("<lora:red> <lora:red:2>", registered)
    with pytest.raises(InvalidRequest, match="not closed"):
        take_loras("<lora:red <lora:blue>", registered)


def test_the_lists_a1111_clients_read(client):
    samplers = client.get("/sdapi/v1/samplers").json()
    by_name = {s["name"]: s for s in samplers}
    assert by_name["DPM++ 2M"] == {
        "name": "DPM++ 2M", "aliases": ["k_dpmpp_2m", "DPMSolverMultistepScheduler"],
        "options": {"scheduler": "DPMSolverMultistepScheduler", "sigma_schedules": "karras,exponential,beta"},
    }  # fmt: skip
    assert "Euler a" in by_name and "DDIM" in by_name
    names = [(s["name"], s["label"]) for s in client.get("/sdapi/v1/schedulers").json()]
    assert names == [
        ("automatic", "Automatic"),
        ("karras", "Karras"),
        ("exponential", "Exponential"),
        ("beta", "Beta"),
    ]
    assert client.get("/sdapi/v1/progress").json()["state"]["job_count"] == 0


def test_bad_input_names_a1111s_field(client):
    bad = client.post("/sdapi/v1/txt2img", json={"prompt": "a", "sampler_name": "Euler z"})
    assert "it offers: Euler, Euler a, Heun" in a1111_error(bad, 400, "sampler_name")
    assert a1111_error(bad, 400, "sampler_name").startswith("sampler_name: 'Euler z' is not offered")
    bad = client.post(
        "/sdapi/v1/txt2img", json={"prompt": "a", "sampler_name": "Euler", "scheduler": "SGM Uniform"}
    )
    assert "automatic, karras, exponential, beta" in a1111_error(bad, 400, "scheduler")
    ddim = {"prompt": "a", "sampler_name": "DDIM", "scheduler": "Karras"}
    a1111_error(client.post("/sdapi/v1/txt2img", json=ddim), 400, "scheduler")
    msg = a1111_error(client.post("/sdapi/v1/txt2img", json={"prompt": "a", "steps": 999}), 400, "steps")
    assert msg == "steps: 999 is outside 1..50"
    a1111_error(client.post("/sdapi/v1/txt2img", json={"prompt": "a", "batch_size": 9}), 400, "batch_size")
    a1111_error(client.post("/sdapi/v1/txt2img", json={"prompt": "a", "cfg_scale": 1000}), 400, "cfg_scale")
    a1111_error(client.post("/sdapi/v1/txt2img", json={"prompt": "a", "enable_hr": True}), 400, "enable_hr")
    a1111_error(
        client.post("/sdapi/v1/txt2img", json={"prompt": "a", "restore_faces": True}), 400, "restore_faces"
    )
    a1111_error(client.post("/sdapi/v1/txt2img", json={"prompt": " "}), 400, "prompt")
    override = {"prompt": "a", "override_settings": {"sd_model_checkpoint": "sd-xl [0123abcd]"}}
    assert "'sd-xl [0123abcd]' is not served here; available: tiny-sd" in a1111_error(
        client.post("/sdapi/v1/txt2img", json=override), 404, "override_settings.sd_model_checkpoint"
    )  # fmt: skip
    clip = {"prompt": "a", "override_settings": {"CLIP_stop_at_last_layers": 2}}
    a1111_error(
        client.post("/sdapi/v1/txt2img", json=clip), 400, "override_settings.CLIP_stop_at_last_layers"
    )
    a1111_error(client.post("/sdapi/v1/options", json={"samples_format": "jpg"}), 400, "samples_format")
    a1111_error(
        client.post("/sdapi/v1/options", json={"sd_model_checkpoint": "nope"}), 404, "sd_model_checkpoint"
    )
    assert client.post("/sdapi/v1/options", json={"samples_format": "png"}).status_code == 200  # as it is
    unknown = client.get("/sdapi/v1/upscalers")
    assert unknown.status_code == 404 and "detail" in unknown.json() and "error" in unknown.json()
    # The other routes keep the project's envelope alone.
    assert "detail" not in client.post("/v1/images/generations", json={"prompt": "a", "sampler": "x"}).json()


def test_keys_a1111_does_not_know_are_ignored_as_a1111_ignores_them(client):
    # Bodies forwarded by clients built for other servers or extensions carry keys A1111's own
    # API models do not define; A1111 ignores them, and so do these routes. A known field with a
    # bad value beside them is still a 400 naming it.
    extras = {"clip_skip": 2, "model": "whatever.safetensors", "use_async": True,
              "adetailer": {"args": [{"ad_model": "face_yolov8n.pt"}]}, "x-client": None}  # fmt: skip
    body = {"prompt": "a lighthouse", "steps": 2, "width": 32, "height": 32, "seed": 3, **extras}
    r = client.post("/sdapi/v1/txt2img", json=body)
    assert r.status_code == 200, r.text
    assert len(r.json()["images"]) == 1 and not set(extras) & set(r.json()["parameters"])
    edit = {**body, "init_images": [r.json()["images"][0]], "denoising_strength": 0.5, "steps": 4}
    r = client.post("/sdapi/v1/img2img", json=edit)
    assert r.status_code == 200, r.text
    a1111_error(client.post("/sdapi/v1/txt2img", json={**body, "steps": "many"}), 400, "steps")
    a1111_error(client.post("/sdapi/v1/img2img", json={**edit, "init_images": []}), 400, "init_images")


def test_choosing_the_model_without_keys_is_for_everyone_so_it_is_an_admin_choice():
    anyone = AccessPolicy()
    assert isinstance(may_choose(anyone, "", "203.0.113.9"), Forbidden)
    assert may_choose(AccessPolicy(local_admin=True), "", "127.0.0.1") is None  # the local opt-in
    assert isinstance(may_choose(AccessPolicy(local_admin=True), "", "203.0.113.9"), Forbidden)
    assert may_choose(AccessPolicy(admin_keys=("k",)), "Bearer k", "203.0.113.9") is None
    assert may_choose(AccessPolicy(user_keys=("u",)), "Bearer u", "203.0.113.9") is None  # its own


def test_the_routes_are_documented(client):
    paths = client.get("/openapi.json").json()["paths"]
    for path in ("txt2img", "img2img", "sd-models", "samplers", "schedulers", "loras", "options", "progress",
                 "interrupt"):  # fmt: skip
        ops = paths[f"/sdapi/v1/{path}"]
        assert all({"400", "401", "404", "429"} <= set(op["responses"]) for op in ops.values()), path


# ---------------------------------------------------------------------- two models, two keys


@pytest.fixture(scope="module")
def two_models(ray_cluster):
    """Two models (the second the SD twin from other weights) behind user keys A and B (B's
    tenant runs one request at a time)."""
    from ray import serve

    model = {k: v for k, v in TEST_ARGS["model"].items() if k not in ("aliases", "engine_extension")}
    keys = {"api_keys": [KEY_A], "local_admin": False}
    args = app_args(model=None, auth=keys, jobs={"store": str(SESSION_DIR / "a1111-store")},
                    batching={"batch_wait_ms": 5})  # fmt: skip
    args["tenants"] = [{"name": "team-b", "api_keys": [KEY_B], "max_concurrent": 1}]
    args["models"] = [
        {"model": {**model, "name": "tiny-sd"}},
        {"model": {**model, "name": "tiny-sd-b", "seed": 7}},
    ]
    url = ray_cluster + deploy("a1111", args)
    headers = {"Authorization": f"Bearer {KEY_A}"}
    wait_for(lambda: httpx.get(f"{url}/health?model=tiny-sd-b", headers=headers).status_code == 200, 180, 0.5)
    yield url
    serve.delete("a1111", _blocking=False)


def basic(key: str) -> dict[str, str]:
    """A1111 clients' credentials (`--api-auth user:password`): the key as the password."""
    return {"authorization": "Basic " + base64.b64encode(f"open-webui:{key}".encode()).decode()}


def test_each_key_chooses_its_own_model(two_models):
    a = httpx.Client(base_url=two_models, headers=basic(KEY_A), timeout=120)
    b = httpx.Client(base_url=two_models, headers={"Authorization": f"Bearer {KEY_B}"}, timeout=120)
    assert [m["title"] for m in a.get("/sdapi/v1/sd-models").json()] == ["tiny-sd", "tiny-sd-b"]
    options = a.get("/sdapi/v1/options").json()
    assert options["sd_model_checkpoint"] == "tiny-sd"
    a.post(
        "/sdapi/v1/options", json={**options, "sd_model_checkpoint": "tiny-sd-b.safetensors"}
    ).raise_for_status()
    assert a.get("/sdapi/v1/options").json()["sd_model_checkpoint"] == "tiny-sd-b"
    assert b.get("/sdapi/v1/options").json()["sd_model_checkpoint"] == "tiny-sd"  # B's is its own
    # Kept on the job store (every ingress replica sharing it sees it), under a digest of the key.
    kept = {f.name: json.loads(f.read_text()) for f in (SESSION_DIR / "a1111-store" / "settings").iterdir()}
    assert list(kept.values()) == ["tiny-sd-b"] and not any(KEY_A in name for name in kept)
    body = {"prompt": "a two model cat", "seed": 4, "steps": 3}
    from_a = json.loads(a.post("/sdapi/v1/txt2img", json=body).json()["info"])
    from_b = b.post("/sdapi/v1/txt2img", json=body).json()
    assert from_a["sd_model_name"] == "tiny-sd-b" and json.loads(from_b["info"])["sd_model_name"] == "tiny-sd"
    one = {"prompt": "a two model cat", "seed": 4, "num_inference_steps": 3, "model": "tiny-sd-b"}
    assert base64.b64decode(a.post("/sdapi/v1/txt2img", json=body).json()["images"][0]) == ours(b, one)[0]
    override = {**body, "override_settings": {"sd_model_checkpoint": "tiny-sd-b"}}
    assert (
        json.loads(b.post("/sdapi/v1/txt2img", json=override).json()["info"])["sd_model_name"] == "tiny-sd-b"
    )
    # The keys, limits and errors are the other routes': no key is a 401 in both envelopes.
    anonymous = httpx.post(f"{two_models}/sdapi/v1/txt2img", json=body, timeout=30)
    assert anonymous.status_code == 401 and anonymous.json()["error"]["type"] == "authentication_error"
    assert anonymous.json()["detail"].startswith("missing API key")
    wrong = httpx.get(f"{two_models}/sdapi/v1/options", headers=basic("not-a-key"), timeout=30)
    assert wrong.status_code == 401 and wrong.json()["detail"] == "invalid API key"
    a.close()
    b.close()


def test_progress_and_interrupt_are_the_callers_own(two_models):
    a = httpx.Client(base_url=two_models, headers=basic(KEY_A), timeout=120)
    b = httpx.Client(base_url=two_models, headers=basic(KEY_B), timeout=120)
    body = {"prompt": "a long one", "seed": 6, "steps": 50, "width": 128, "height": 128, "n_iter": 5,
            "override_settings": {"sd_model_checkpoint": "tiny-sd"}}  # fmt: skip
    answer: dict = {}
    started = time.monotonic()
    worker = threading.Thread(target=lambda: answer.update(r=a.post("/sdapi/v1/txt2img", json=body)))
    worker.start()
    try:
        seen = wait_for(lambda: (p := a.get("/sdapi/v1/progress").json())["current_image"] and p, 60, 0.1)
        assert seen["state"]["job_count"] == 5 and seen["state"]["sampling_steps"] == 50
        assert 0 < seen["progress"] < 1 and seen["state"]["sampling_step"] >= 1
        w, h = png(seen["current_image"]).size  # the latents' preview, below the image's size
        assert w == h < 128
        assert (
            "current_image" in seen
            and a.get("/sdapi/v1/progress?skip_current_image=true").json()["current_image"] is None
        )
        other = b.get("/sdapi/v1/progress").json()
        assert other["state"]["job_count"] == 0 and other["current_image"] is None  # not B's
        assert b.post("/sdapi/v1/interrupt").json() == {}  # B has nothing to stop
        step = a.get("/sdapi/v1/progress").json()["state"]["sampling_step"]
        wait_for(lambda: a.get("/sdapi/v1/progress").json()["state"]["sampling_step"] > step, 30, 0.05)
        assert a.post("/sdapi/v1/interrupt").json() == {}
        worker.join(60)
    finally:
        worker.join(120)
    r = answer["r"]
    assert r.status_code == 200, r.text
    info = json.loads(r.json()["info"])
    assert info["interrupted"] and len(r.json()["images"]) < 5  # the later iterations never ran
    assert time.monotonic() - started < 60
    assert a.get("/sdapi/v1/progress").json()["state"]["job_count"] == 0
    # B's tenant quota holds here as on the other routes: a second request at once is a 429.
    worker = threading.Thread(target=lambda: answer.update(b=b.post("/sdapi/v1/txt2img", json=body)))
    worker.start()
    try:
        wait_for(lambda: b.get("/sdapi/v1/progress").json()["state"]["sampling_step"], 60, 0.05)  # admitted
        second = b.post("/sdapi/v1/txt2img", json={**body, "n_iter": 1})
        assert second.status_code == 429 and second.json()["error"]["code"] == "quota_exceeded"
        assert second.json()["error"]["param"] == "max_concurrent" and "detail" in second.json()
        b.post("/sdapi/v1/interrupt")
    finally:
        worker.join(120)
    assert answer["b"].status_code == 200 and json.loads(answer["b"].json()["info"])["interrupted"]
    a.close()
    b.close()
