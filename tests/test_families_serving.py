"""Each family's twin through the whole system: Serve, HTTP and the Python handle.

The four twins are deployed once, together, beside the shared app (one app each, under its
own route prefix). tests/test_families.py checks the engine side of the same twins.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import io
import json

import av
import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from serve_app.schemas import GenerationRequest, TensorPayload
from serve_app.testing import SLOW_MARKER
from serve_app.tools.lora import make_adapter
from tests.conftest import ADAPTER_DIR, SESSION_DIR, app_args, wait_for

pytestmark = pytest.mark.slow  # four apps of their own
TWINS = ["tiny-sdxl", "tiny-sd3", "tiny-flux", "tiny-wan"]
JOINED = ("tiny-sdxl", "tiny-flux")
FAMILY = {"tiny-sdxl": "sdxl", "tiny-sd3": "sd3", "tiny-flux": "flux", "tiny-wan": "wan"}


def prefix(name: str) -> str:
    return "/" + name.replace("tiny-", "fam-")


@pytest.fixture(scope="module")
def twins(ray_cluster, client):
    from ray import serve
    from ray.serve.api import RunTarget

    from serve_app.app import build_app

    targets = [
        RunTarget(
            target=build_app(
                app_args(
                    model={
                        "source": f"builtin:{name}",
                        "default_guidance_scale": 4.0,
                        # The video twin's requests are step-cached unless they say otherwise.
                        **({"optimizations": {"step_cache": "fast"}} if name == "tiny-wan" else {}),
                    },
                    lora={"registry_path": str(SESSION_DIR / f"{name}-registry.json")},
                    # A UNet twin and a transformer twin serve every test here joined at steps.
                    batching={"step_joining": name in JOINED},
                )
            ),
            name=prefix(name)[1:],
            route_prefix=prefix(name),
        )
        for name in TWINS
    ]
    serve.run_many(targets)
    yield
    for name in TWINS:
        serve.delete(prefix(name)[1:], _blocking=False)


def route(name: str) -> str:
    if name == "tiny-wan":
        return f"{prefix(name)}/v1/videos/generations"
    return f"{prefix(name)}/v1/images/generations"


def decode(name: str, b64: str) -> np.ndarray:
    """An image, or a video's frames stacked, as integers."""
    raw = base64.b64decode(b64)
    if name == "tiny-wan":
        with av.open(io.BytesIO(raw)) as c:
            return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)]).astype(int)
    return np.asarray(Image.open(io.BytesIO(raw)).convert("RGB")).astype(int)[None]


def post(client, url: str, **body) -> dict:
    r = client.post(url, json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("name", TWINS)
def test_models_lists_the_family_and_what_it_takes(twins, client, name):
    card = client.get(f"{prefix(name)}/v1/models").json()["data"][0]
    assert card["family"] == FAMILY[name]
    assert card["modalities"] == (["video"] if name == "tiny-wan" else ["image"])
    pooled = name != "tiny-wan"
    assert ("pooled_prompt_embeds" in card["inputs"]) is pooled
    assert ("pooled_prompt_embeds" in card["embeds_shapes"]) is pooled


@pytest.mark.parametrize("name", TWINS)
def test_n_images_and_the_batch_route_keep_each_seed(twins, client, name):
    body = {"prompt": "a red circle", "seed": 7, "n": 2, "return_latents": True}
    one = post(client, route(name), **body)
    a, b = (decode(name, d["b64_json"]) for d in one["data"])
    assert a.shape[1:3] == (32, 32) and not np.array_equal(a, b)
    if name == "tiny-wan":
        assert a.shape[0] == 9  # the model's default frames
    # The same prompt and seed inside a batch of prompts: the same latents (to rounding).
    batch = post(
        client,
        f"{prefix(name)}/v1/images/generations/batch",
        prompts=["something else", "a red circle"],
        seed=7,
        return_latents=True,
    )
    assert [d["prompt_index"] for d in batch["data"]] == [0, 1]
    lat_one = TensorPayload(**one["latents"]).to_numpy()[0]
    lat_batch = TensorPayload(**batch["latents"]).to_numpy()[1]
    assert np.abs(lat_one - lat_batch).max() < 1e-3


@pytest.mark.parametrize("name", TWINS)
def test_stream_previews_decode_then_the_result(twins, client, name):
    body = {"prompt": "streamed", "stream": True, "preview_every": 1, "num_inference_steps": 3}
    with client.stream("POST", route(name), json=body) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    steps = [e for e in events if e["type"] == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3] and events[-1]["type"] == "result"
    preview = Image.open(io.BytesIO(base64.b64decode(steps[0]["preview_png"])))
    assert preview.format == "PNG" and preview.height in (4, 16)  # 32 px over the VAE's scale
    decode(name, events[-1]["data"][0]["b64_json"])


@pytest.mark.parametrize("name", TWINS)
def test_abort_mid_run(twins, client, name):
    rid = f"abort-{name}"
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(
            client.post, route(name), json={"prompt": "long", "num_inference_steps": 50, "request_id": rid}
        )
        wait_for(lambda: client.get(f"{prefix(name)}/v1/requests/{rid}").json().get("state") == "running", 60)
        assert client.post(f"{prefix(name)}/v1/requests/{rid}/abort").json()["result"] == "aborted"
        r = fut.result(60)
    assert r.status_code == 499 and r.json()["error"]["type"] == "aborted"
    assert client.get(f"{prefix(name)}/v1/requests/{rid}").json()["step"] < 50


@pytest.mark.parametrize("name", JOINED)
def test_a_request_arriving_mid_call_joins_it_over_http(twins, client, name):
    first, late = f"join-a-{name}", f"join-b-{name}"
    body = {"prompt": "a red circle", "seed": 3, "num_inference_steps": 12}
    with cf.ThreadPoolExecutor(1) as pool:
        # The first call is slowed (0.1 s a step) so that the late request finds it still running.
        slow = {**body, "prompt": f"first {SLOW_MARKER}", "request_id": first}
        fut = pool.submit(client.post, route(name), json=slow)
        wait_for(lambda: client.get(f"{prefix(name)}/v1/requests/{first}").json().get("step", 0) >= 2, 60)
        joined = post(client, route(name), **body, request_id=late)
        r = fut.result(60)
    assert r.status_code == 200 and r.json()["metrics"]["steps"] == 12
    assert joined["metrics"]["batch_requests"] == 2 and joined["metrics"]["steps"] == 12
    alone = post(client, route(name), **body)
    assert alone["metrics"]["batch_requests"] == 1
    diff = np.abs(decode(name, joined["data"][0]["b64_json"]) - decode(name, alone["data"][0]["b64_json"]))
    assert diff.max() <= 2 and diff.mean() < 0.05


@pytest.mark.parametrize("name", TWINS)
def test_prompt_embeds_on_the_handle_and_a_clear_error_for_wrong_shapes(twins, client, name):
    from ray import serve

    from serve_app.errors import InvalidRequest

    shapes = client.get(f"{prefix(name)}/v1/models").json()["data"][0]["embeds_shapes"]
    handle = serve.get_app_handle(prefix(name)[1:])
    g = torch.Generator().manual_seed(0)
    tensors = {k: TensorPayload.from_tensor(torch.randn(v, generator=g)) for k, v in shapes.items()}
    result = handle.generate.remote(GenerationRequest(seed=3, **tensors)).result()
    assert len(result.images) == 1 and result.model == name
    wrong = TensorPayload.from_tensor(torch.randn(1, 7, 5))
    with pytest.raises(InvalidRequest, match=r"prompt_embeds: shape \(1, 7, 5\) .* which wants") as e:
        handle.generate.remote(GenerationRequest(**{**tensors, "prompt_embeds": wrong})).result()
    assert e.value.param == "prompt_embeds"
    if "pooled_prompt_embeds" in tensors:  # SDXL, SD3, FLUX need the pooled vector too
        with pytest.raises(InvalidRequest, match=r"pooled_prompt_embeds: got none") as e:
            handle.generate.remote(GenerationRequest(prompt_embeds=tensors["prompt_embeds"])).result()
        assert e.value.param == "pooled_prompt_embeds"


@pytest.mark.parametrize("name", TWINS)
def test_an_adapter_of_the_family_over_http(twins, client, name):
    path = make_adapter(str(ADAPTER_DIR / f"{name}-style.safetensors"), seed=5, model=name, strength=3.0)
    r = client.post(f"{prefix(name)}/v1/loras", json={"name": "style", "path": str(path)})
    assert r.status_code == 200, r.text
    body = {"prompt": "a cat", "seed": 1, "output_format": "gif" if name == "tiny-wan" else "png"}
    base = post(client, route(name), **body)["data"][0]["b64_json"]
    styled = post(client, route(name), **body, lora={"name": "style"})["data"][0]["b64_json"]
    off = post(client, route(name), **body, lora={"name": "style", "scale": 0})["data"][0]["b64_json"]
    assert styled != base and off == base


def test_video_length_formats_and_refusals(twins, client):
    url = route("tiny-wan")
    body = post(client, url, prompt="a boat", seconds=1, fps=8)
    with av.open(io.BytesIO(base64.b64decode(body["data"][0]["b64_json"]))) as c:
        stream = c.streams.video[0]
        assert stream.codec_context.name == "h264" and stream.average_rate == 8
        assert sum(1 for _ in c.decode(video=0)) == 9  # 1 s at 8 fps, at Wan's 4k+1 rule
    url_form = post(client, url, prompt="a boat", num_frames=5, response_format="url")
    assert httpx.get(url_form["data"][0]["url"]).headers["content-type"] == "video/mp4"
    # A video as an asynchronous job: the stored file comes back with its type.
    job = client.post(
        url, json={"prompt": "a boat", "num_frames": 5}, headers={"Prefer": "respond-async"}
    ).json()
    done = wait_for(
        lambda: (
            (j := client.get(f"{prefix('tiny-wan')}/v1/jobs/{job['id']}").json())["state"] == "done" and j
        ),
        60,
        0.1,
    )
    assert client.get(done["outputs"][0]["content_url"]).headers["content-type"] == "video/mp4"
    webp = post(client, url, prompt="a boat", num_frames=5, output_format="webp")
    assert Image.open(io.BytesIO(base64.b64decode(webp["data"][0]["b64_json"]))).n_frames == 5
    for bad, param, words in [
        ({"num_frames": 6}, "num_frames", "4k+1 frames (5, 9, 13, ...)"),
        ({"num_frames": 1000}, "num_frames", "up to"),
        ({"output_format": "png"}, "output_format", "makes videos: mp4, webp, gif"),
        ({"fps": 0}, "fps", "greater than or equal to 1"),
    ]:
        r = client.post(url, json={"prompt": "a boat", **bad})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], err
    # An image model has no video route.
    r = client.post(
        route("tiny-sdxl").replace("images/generations", "videos/generations"), json={"prompt": "a"}
    )
    assert r.status_code == 400 and "makes images" in r.json()["error"]["message"]


def test_true_cfg_scale_where_the_pipeline_has_it(twins, client):
    body = {"prompt": "a red circle", "negative_prompt": "blue", "seed": 2, "return_latents": True}
    plain = post(client, route("tiny-flux"), **body)
    true_cfg = post(client, route("tiny-flux"), **body, true_cfg_scale=4.0)  # FLUX runs the negative too
    a, b = (TensorPayload(**x["latents"]).to_numpy() for x in (plain, true_cfg))
    assert np.abs(a - b).mean() > 1e-4
    r = client.post(route("tiny-sdxl"), json={**body, "true_cfg_scale": 4.0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "true_cfg_scale"


def test_step_caching_follows_the_deployment_default_and_the_request(twins, client):
    """The video twin caches steps by default (`model.optimizations.step_cache: fast`); a request
    may turn it off. FLUX with true CFG keeps a cache per denoiser call it names (cond, uncond)."""

    def latents(name, **kw):
        body = {"prompt": "a boat", "seed": 3, "num_inference_steps": 8, "return_latents": True, **kw}
        if name == "tiny-wan":
            body["num_frames"] = 5
        return TensorPayload(**post(client, route(name), **body)["latents"]).to_numpy()

    default, fast, none = (
        latents("tiny-wan"),
        latents("tiny-wan", acceleration="fast"),
        latents("tiny-wan", acceleration="none"),
    )
    assert np.array_equal(default, fast) and not np.array_equal(default, none)
    assert client.get(f"{prefix('tiny-wan')}/v1/models").json()["data"][0]["accelerations"][-1] == "faster"
    flux = {"negative_prompt": "blue", "true_cfg_scale": 4.0}
    cached, full = latents("tiny-flux", acceleration="faster", **flux), latents("tiny-flux", **flux)
    assert 0 < np.abs(cached - full).mean() < 0.1 * np.abs(full).mean()


def test_a_video_model_refuses_decoded_trajectories_naming_the_field(twins, client):
    r = client.post(route("tiny-wan"), json={"prompt": "x", "return_trajectory_decoded": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_trajectory_decoded", r.text


def test_openai_s_videos_api_through_the_official_sdk(twins, client, base_url):
    """OpenAI's Videos API as its SDK calls it: `create_and_poll` makes a video job, whose
    `download_content` is the MP4 (and a WebP thumbnail, a JPEG spritesheet); `retrieve`, `list`
    pages, an idempotency key, another key's 404, `delete` (of a running one too: it is
    aborted), and each bad input a 400 naming its field."""
    import openai
    from openai import OpenAI

    from serve_app.testing import SLOW_MARKER

    oai = OpenAI(base_url=f"{base_url}{prefix('tiny-wan')}/v1", api_key="video-key", max_retries=0)
    fast = {"fps": 4, "num_inference_steps": 2, "seed": 3}
    video = oai.videos.create_and_poll(prompt="a boat", seconds="2", size="32x32", extra_body=fast,
                                       poll_interval_ms=100)  # fmt: skip
    assert (video.object, video.status, video.progress, video.size) == ("video", "completed", 100, "32x32"), (
        video
    )
    assert video.seconds == "2.25" and video.prompt == "a boat" and video.completed_at >= video.created_at
    assert video.model == client.get(f"{prefix('tiny-wan')}/v1/models").json()["data"][0]["id"]
    mp4 = oai.videos.download_content(video.id).content
    with av.open(io.BytesIO(mp4)) as c:
        assert c.streams.video[0].codec_context.name == "h264"
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    assert len(frames) == 9 and frames[0].shape == (32, 32, 3)  # 2 s at 4 fps, at Wan's 4k+1 rule
    thumb = Image.open(io.BytesIO(oai.videos.download_content(video.id, variant="thumbnail").content))
    assert thumb.format == "WEBP" and thumb.size == (32, 32)
    assert np.abs(np.asarray(thumb.convert("RGB"), dtype=int) - frames[0]).mean() < 12  # the first frame
    sheet = Image.open(io.BytesIO(oai.videos.download_content(video.id, variant="spritesheet").content))
    assert sheet.format == "JPEG" and sheet.size == (3 * 32, 3 * 32)  # 9 frames, 3 x 3
    assert oai.videos.retrieve(video.id).status == "completed"
    # The SDK's JSON-free form and a JSON body make the same kind of job; a key makes it once.
    again = {"prompt": "a boat", "seconds": 1, "size": "32x32", **fast}
    key = {"Idempotency-Key": "v-1", "Authorization": "Bearer video-key"}
    keyed = [client.post(f"{prefix('tiny-wan')}/v1/videos", json=again, headers=key) for _ in range(2)]
    assert keyed[0].status_code == 200 and keyed[0].json()["object"] == "video", keyed[0].text
    assert keyed[1].json()["id"] == keyed[0].json()["id"]
    page = oai.videos.list(limit=1)
    assert [v.id for v in page.data] == [keyed[0].json()["id"]] and page.has_more
    assert [v.id for v in oai.videos.list(limit=1, after=page.last_id).data] == [video.id]
    assert video.id in [v.id for v in oai.videos.list(order="asc")]
    other = OpenAI(base_url=oai.base_url, api_key="someone-else", max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        other.videos.retrieve(video.id)
    assert e.value.body["param"] == "video_id"
    # A jobs-route job is not a video here, and a video is still a job there.
    assert (
        client.get(
            f"{prefix('tiny-wan')}/v1/jobs/{video.id}", headers={"Authorization": "Bearer video-key"}
        ).status_code
        == 200
    )
    # Deleting: the finished one and its files; a running one is aborted first.
    assert oai.videos.delete(video.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        oai.videos.retrieve(video.id)
    slow = oai.videos.create(prompt=f"a boat {SLOW_MARKER}", seconds="1", size="32x32",
                             extra_body={**fast, "num_inference_steps": 40})  # fmt: skip
    assert slow.status in ("queued", "in_progress")
    assert oai.videos.delete(slow.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        oai.videos.retrieve(slow.id)
    # Bad input: a 400 naming the field, in OpenAI's error shape.
    png = io.BytesIO()
    Image.new("RGB", (32, 32), "red").save(png, format="PNG")
    for kw, param in [
        ({"input_reference": ("ref.png", png.getvalue(), "image/png")}, "input_reference"),
        ({"seconds": "600"}, "seconds"),
        ({"size": "33x32"}, "size"),
        ({"extra_body": {"n": 2}}, "n"),
        ({"model": "no-such-model"}, "model"),
    ]:
        with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as e:
            oai.videos.create(prompt="a boat", **{"size": "32x32", **kw})
        assert e.value.body["param"] == param, (kw, e.value.body)
    for ref in ({"file_id": "file-1"}, {"image_url": "https://example.com/a.png"}, "not base64!"):
        r = client.post(f"{prefix('tiny-wan')}/v1/videos", json={"prompt": "a boat", "input_reference": ref})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input_reference", r.text
    sdxl = OpenAI(base_url=f"{base_url}{prefix('tiny-sdxl')}/v1", api_key="video-key", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        sdxl.videos.create(prompt="a boat")
    assert e.value.body["param"] == "model" and "makes images" in e.value.body["message"]
