"""The HTTP API over real loopback HTTP against the shared Serve app."""

from __future__ import annotations

import base64
import io
import re

import httpx
import numpy as np
import pytest
from PIL import Image

from serve_app.testing import FAIL_MARKER, OOM_MARKER

GEN = "/v1/images/generations"
BATCH = "/v1/images/generations/batch"


def post_ok(client, path, **body):
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def decode(item) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(item["b64_json"])))


def px(im) -> np.ndarray:
    return np.asarray(im.convert("RGB")).astype(np.int16)


def test_openai_shape_request_id_and_metrics(client):
    r = client.post(GEN, json={"prompt": "a red cat", "n": 2, "size": "48x32", "model": "tiny-sd", "seed": 7})
    assert r.status_code == 200, r.text
    body = r.json()
    assert isinstance(body["created"], int)
    assert len(body["data"]) == 2
    assert [decode(d).size for d in body["data"]] == [(48, 32), (48, 32)]
    assert [d["seed"] for d in body["data"]] == [7, 8]
    assert r.headers["X-Request-Id"] == body["request_id"]
    m = body["metrics"]
    assert m["batch_images"] == 2 and m["steps"] == 3
    for k in ("queue_ms", "text_encode_ms", "denoise_ms", "vae_decode_ms", "image_encode_ms", "total_ms"):
        assert m[k] >= 0, k
    assert m["total_ms"] >= m["denoise_ms"] > 0
    assert body["peak_memory_kind"] == "cpu_rss"


def test_client_request_id_is_kept(client):
    body = post_ok(client, GEN, prompt="a", request_id="my-job.42")
    assert body["request_id"] == "my-job.42"
    r = client.post(GEN, json={"prompt": "a"}, headers={"X-Request-Id": "my-job.43"})
    assert r.json()["request_id"] == "my-job.43" == r.headers["X-Request-Id"]


def test_same_seed_same_bytes_and_n_images_follow_seeds(client):
    a = post_ok(client, GEN, prompt="a lighthouse", seed=123, n=2)
    b = post_ok(client, GEN, prompt="a lighthouse", seed=123, n=2)
    c = post_ok(client, GEN, prompt="a lighthouse", seed=124)
    assert [d["b64_json"] for d in a["data"]] == [d["b64_json"] for d in b["data"]]
    # Image k uses seed + k: the same image as that seed alone, to the rounding of a batch of
    # two against one (CPU kernels may block them differently: one grey level at most).
    second, alone = (np.asarray(decode(d)).astype(int) for d in (a["data"][1], c["data"][0]))
    assert np.abs(second - alone).max() <= 1
    assert a["data"][0]["b64_json"] != a["data"][1]["b64_json"]


def test_default_seed_is_random_and_reported(client):
    a = post_ok(client, GEN, prompt="a lighthouse")
    b = post_ok(client, GEN, prompt="a lighthouse")
    assert a["data"][0]["seed"] != b["data"][0]["seed"]
    again = post_ok(client, GEN, prompt="a lighthouse", seed=a["data"][0]["seed"])
    assert again["data"][0]["b64_json"] == a["data"][0]["b64_json"]


def test_batch_request_merges_prompts_and_matches_single_requests(client):
    prompts = ["a red cat", "a blue dog", "a green tree"]
    batch = post_ok(client, BATCH, prompts=prompts, seed=5, n=2)
    assert [d["prompt_index"] for d in batch["data"]] == [0, 0, 1, 1, 2, 2]
    assert [d["seed"] for d in batch["data"]] == [5, 6] * 3
    assert batch["metrics"]["batch_images"] == 6
    alone = post_ok(client, GEN, prompt="a blue dog", seed=6)
    # Same (prompt, seed) alone and inside a batch of other prompts: equal up to CPU rounding.
    assert np.abs(px(decode(alone["data"][0])) - px(decode(batch["data"][3]))).max() <= 1


@pytest.mark.parametrize("fmt, magic", [("png", b"\x89PNG"), ("jpeg", b"\xff\xd8\xff"), ("webp", b"RIFF")])
def test_output_formats(client, fmt, magic):
    body = post_ok(client, GEN, prompt="a", output_format=fmt)
    assert body["output_format"] == fmt
    assert base64.b64decode(body["data"][0]["b64_json"]).startswith(magic)


def test_response_format_url_links_to_the_stored_image(client, base_url):
    """A real link: the stored image over HTTP, signed; a forged or expired link is refused."""
    body = post_ok(client, GEN, prompt="a", response_format="url", seed=1, n=2)
    urls = [d["url"] for d in body["data"]]
    assert all(u.startswith(f"{base_url}/v1/files/res_") for u in urls), urls
    ref = post_ok(client, GEN, prompt="a", seed=1, n=2)
    for url, item in zip(urls, ref["data"], strict=True):
        got = httpx.get(url)  # a fresh client: no key, no cookies; the signature is the permission
        assert got.status_code == 200 and got.headers["content-type"] == "image/png"
        assert got.content == base64.b64decode(item["b64_json"])
    forged = urls[0].replace("signature=", "signature=0")
    expired = re.sub(r"expires=\d+", "expires=1", urls[0])
    other = urls[0].replace("/0.png", "/1.png")  # a valid signature is for its own file only
    for bad in (forged, expired, other, urls[0].split("?")[0]):
        r = httpx.get(bad)
        assert r.status_code == 403 and r.json()["error"]["param"] == "signature", bad


def test_latents_and_trajectory(client):
    body = post_ok(
        client, GEN, prompt="a", n=2, num_inference_steps=4, return_latents=True, return_trajectory=True
    )
    lat = body["latents"]
    assert lat["shape"] == [2, 4, 16, 16] and lat["dtype"] == "float32"
    arr = np.frombuffer(base64.b64decode(lat["data"]), dtype=np.float32).reshape(lat["shape"])
    traj = body["trajectory"]
    assert len(traj["timesteps"]) == 4 and len(traj["latents"]) == 4
    last = np.frombuffer(base64.b64decode(traj["latents"][-1]["data"]), dtype=np.float32).reshape(
        lat["shape"]
    )
    assert np.array_equal(arr, last)
    plain = post_ok(client, GEN, prompt="a")
    assert "latents" not in plain and "trajectory" not in plain


def test_quality_and_acceleration_choose_step_caching(client):
    """OpenAI's `quality` maps onto step caching: high is the uncached image, medium is
    `acceleration: fast`, low is `faster`; a cached image is close to the uncached one."""
    models = client.get("/v1/models").json()["data"][0]
    assert models["accelerations"] == ["none", "fast", "faster"]
    body = {"prompt": "a red circle", "seed": 5, "num_inference_steps": 10}

    def image(**kw):
        return px(decode(post_ok(client, GEN, **body, **kw)["data"][0]))

    plain, high = image(), image(quality="high")
    medium, fast = image(quality="medium"), image(acceleration="fast")
    low = image(quality="low", acceleration="faster")  # acceleration wins: same as low alone
    assert np.array_equal(plain, high) and np.array_equal(medium, fast)
    assert not np.array_equal(plain, medium) and not np.array_equal(medium, low)
    assert np.abs(plain - medium).mean() < 40, np.abs(plain - medium).mean()
    assert np.array_equal(image(acceleration="none", quality="low"), plain)


def test_extra_reaches_the_pipeline(client):
    a = post_ok(client, GEN, prompt="a", seed=3)
    b = post_ok(client, GEN, prompt="a", seed=3, extra={"guidance_rescale": 0.7})
    assert a["data"][0]["b64_json"] != b["data"][0]["b64_json"]


def test_models_health_and_openapi(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "tiny-sd"
    assert models["data"][0]["default_height"] == 32
    assert client.get("/health").json() == {"status": "ok"}
    spec = client.get("/openapi.json").json()
    for path in (GEN, BATCH, "/v1/models", "/health"):
        assert path in spec["paths"], path
    assert "ImagesGenerationRequest" in spec["components"]["schemas"]


BAD_INPUTS = [
    ({"prompt": "a", "width": 30}, "width", "multiple of 8"),
    ({"prompt": "a", "height": 0}, "height", "greater than or equal to 8"),
    ({"prompt": "a", "width": 256}, "width", "above the maximum 128"),
    ({"prompt": "a", "width": 128, "height": 128, "size": "64x64"}, "size", "disagrees"),
    ({"prompt": "a", "size": "big"}, "size", "WIDTHxHEIGHT"),
    ({"prompt": "a", "size": "136x8"}, "width", "above the maximum 128"),
    ({"prompt": "a", "num_inference_steps": 0}, "num_inference_steps", "greater than or equal to 1"),
    ({"prompt": "a", "num_inference_steps": 51}, "num_inference_steps", "outside 1..50"),
    ({"prompt": "a", "n": 0}, "n", "greater than or equal to 1"),
    ({"prompt": "a", "n": 5}, "n", "outside 1..4"),
    ({"prompt": ""}, "prompt", "must not be empty"),
    ({"prompt": "   "}, "prompt", "must not be empty"),
    ({}, "prompt", "Field required"),
    ({"prompt": 5}, "prompt", "valid string"),
    ({"prompt": "a", "n": "two"}, "n", "valid integer"),
    ({"prompt": "a", "output_format": "gif"}, "output_format", "makes images (png, jpeg, webp)"),
    ({"prompt": "a", "output_format": "bmp"}, "output_format", "'png', 'jpeg', 'webp', 'mp4' or 'gif'"),
    ({"prompt": "a", "num_frames": 5}, "num_frames", "makes images, not videos"),
    ({"prompt": "a", "response_format": "binary"}, "response_format", "'b64_json' or 'url'"),
    ({"prompt": "a", "guidance_scale": -1}, "guidance_scale", "greater than or equal to 0"),
    ({"prompt": "a", "guidance_scale": 51}, "guidance_scale", "outside 0..50"),
    ({"prompt": "a", "seed": -1}, "seed", "greater than or equal to 0"),
    ({"prompt": "a", "request_id": "has spaces"}, "request_id", "letters, digits"),
    ({"prompt": "a", "extra": {"generator": 1}}, "extra", "may not set generator"),
    ({"prompt": "a", "extra": {"bogus_arg": 1}}, "extra", "takes no argument 'bogus_arg'"),
    ({"prompt": "a", "unknown_field": 1}, "unknown_field", "Extra inputs are not permitted"),
    ({"prompt": "a", "acceleration": "turbo"}, "acceleration", "'none', 'fast' or 'faster'"),
    ({"prompt": "a", "quality": "ultra"}, "quality", "'auto', 'high', 'medium', 'low', 'hd' or 'standard'"),
    ({"prompt": "a" * 5000}, "prompt", "the maximum is 4000"),
    ({"prompt": "a", "negative_prompt": "n" * 5000}, "negative_prompt", "the maximum is 4000"),
]


@pytest.mark.parametrize("body, field, message", BAD_INPUTS)
def test_bad_input_gets_400_naming_the_field_and_the_replica_keeps_serving(client, body, field, message):
    r = client.post(GEN, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == field
    assert field in err["message"] and message in err["message"], err["message"]
    assert client.post(GEN, json={"prompt": "still serving"}).status_code == 200


@pytest.mark.parametrize(
    "body, field, message",
    [
        ({"prompts": []}, "prompts", "at least 1 item"),
        ({"prompts": ["a", ""]}, "prompts", "prompt 1 must not be empty"),
        ({"prompts": ["a"] * 7}, "prompts", "the maximum is 6"),
        ({"prompts": ["a"], "n": 9}, "n", "outside 1..4"),
    ],
)
def test_bad_batch_input(client, body, field, message):
    r = client.post(BATCH, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and message in err["message"], err


def test_body_that_is_not_json(client):
    r = client.post(GEN, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert "JSON" in r.json()["error"]["message"]


def test_unknown_model_is_404(client):
    r = client.post(GEN, json={"prompt": "a", "model": "stable-cascade"})  # dall-e-3 is an alias here
    assert r.status_code == 404
    assert "stable-cascade" in r.json()["error"]["message"] and "tiny-sd" in r.json()["error"]["message"]


def test_engine_error_is_500_with_request_id_and_replica_keeps_serving(client):
    r = client.post(GEN, json={"prompt": f"boom {FAIL_MARKER}"}, headers={"X-Request-Id": "will-fail"})
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["request_id"] == "will-fail" == r.headers["X-Request-Id"]
    assert "injected engine failure" in err["message"]
    assert client.post(GEN, json={"prompt": "after a failure"}).status_code == 200


def test_arguments_the_pipeline_refuses_are_a_400_not_an_engine_failure(client):
    # DDIM takes no custom sigmas: the pipeline itself raises inside the engine, on the caller's value.
    before = client.get("/v1/status").json()["replicas"][0]["counts"].get("failed", 0)
    r = client.post(GEN, json={"prompt": "a", "extra": {"sigmas": [1.0, 0.5]}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "extra" and "sigmas" in err["message"] and err["request_id"]
    rep = client.get("/v1/status").json()["replicas"][0]
    assert rep["healthy"] and rep["counts"].get("failed", 0) == before + 1
    assert rep["engine_failures_in_a_row"] == 0  # a caller's mistake is not the engine's failure
    assert client.post(GEN, json={"prompt": "after a pipeline error"}).status_code == 200


def test_out_of_memory_is_503_and_replica_keeps_serving(client):
    r = client.post(GEN, json={"prompt": f"huge {OOM_MARKER}", "request_id": "too-big"})
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["type"] == "out_of_memory" and err["request_id"] == "too-big"
    assert "out of device memory" in err["message"]
    assert client.post(GEN, json={"prompt": "after an OOM"}).status_code == 200


def test_prometheus_metrics_are_exported(client):
    import time

    import httpx
    import ray

    assert client.post(GEN, json={"prompt": "counted"}).status_code == 200
    port = ray._private.worker.global_worker.node.metrics_export_port
    wanted = ["ray_diffusion_requests_total", "ray_diffusion_images_total", "ray_diffusion_stage_latency_ms",
              "ray_diffusion_batch_images", "ray_diffusion_queue_length"]  # fmt: skip
    text, end = "", time.monotonic() + 90
    while time.monotonic() < end:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        if all(w in text for w in wanted):
            break
        time.sleep(2)
    missing = [w for w in wanted if w not in text]
    assert not missing, missing
    assert 'outcome="done"' in text and 'stage="denoise"' in text
