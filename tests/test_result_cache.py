"""The result cache (`serve_app/ingress/result_cache.py`, `result_cache:`): on an app of its own
with the cache on, a repeated seeded request is a hit with identical bytes (`X-Cache: hit`,
`metrics.cache`); any changed input, a request without a seed or with `Cache-Control: no-cache`
is a miss or a bypass; another tenant misses; an adapter file written again under its name
misses; the kept bytes stay within `max_bytes`, least recently used out first."""

from __future__ import annotations

import os
import time

import pytest

from serve_app.config import ResultCacheConfig
from serve_app.ingress.result_cache import ResultCache, result_bytes
from serve_app.schemas import GenerationResult, LoraRef, PreparedRequest, StageMetrics
from tests.conftest import ADAPTER_DIR, app_args, deploy

KEY_A, KEY_B = "cache-tenant-a-5f1c", "cache-tenant-b-93e0"


def prepared(**kw) -> PreparedRequest:
    base = dict(request_id="r1", prompts=["a red circle"], negative_prompt=None, height=32, width=32,
                num_inference_steps=3, guidance_scale=7.5, seed=1, num_images=1, output_format="png",
                model="m", seed_given=True)  # fmt: skip
    return PreparedRequest(**{**base, **kw})


def result(n_bytes: int) -> GenerationResult:
    return GenerationResult(request_id="x", model="m", images=[b"\0" * n_bytes], seeds=[1], prompt_index=[0],
                            metrics=StageMetrics(steps=3), peak_memory_mb=0.0)  # fmt: skip


def test_keys_follow_every_input_and_not_the_request_s_name():
    cache = ResultCache(ResultCacheConfig(enabled=True), [str(ADAPTER_DIR)])
    k = cache.key(prepared())
    assert k == cache.key(prepared(request_id="other", owner="someone", tenant_weight=3.0))
    changes = [dict(prompts=["a blue circle"]), dict(seed=2), dict(num_inference_steps=4), dict(width=40),
               dict(guidance_scale=7.0), dict(sampler="Euler"), dict(extra={"eta": 0.5}), dict(tenant="b"),
               dict(output_format="webp"), dict(acceleration="fast"), dict(model="n")]  # fmt: skip
    for change in changes:
        assert cache.key(prepared(**change)) != k, change
    assert cache.key(prepared(seed_given=False)) is None
    assert ResultCache(ResultCacheConfig(enabled=False), []).key(prepared()) is None
    shared = ResultCache(ResultCacheConfig(enabled=True, shared_across_tenants=True), [])
    assert shared.key(prepared(tenant="a")) == shared.key(prepared(tenant="b"))
    # An adapter file written again under its name (its size or time changes): another key.
    path = ADAPTER_DIR / "cache-unit.safetensors"
    path.write_bytes(b"one")
    with_adapter = prepared(loras=[LoraRef(name="a", scale=1.0, path=path.name)])
    before = cache.key(with_adapter)
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert cache.key(with_adapter) != before != k
    # A PEFT directory: its files, not the directory, key it.
    folder = ADAPTER_DIR / "cache-unit-dir"
    folder.mkdir(exist_ok=True)
    (folder / "adapter_model.safetensors").write_bytes(b"one")
    in_dir = prepared(loras=[LoraRef(name="d", scale=1.0, path=folder.name)])
    before = cache.key(in_dir)
    (folder / "adapter_model.safetensors").write_bytes(b"other")  # the same size
    os.utime(folder / "adapter_model.safetensors", ns=(time.time_ns(), time.time_ns() + 2 * 10**9))
    assert cache.key(in_dir) != before


def test_kept_bytes_stay_bounded_least_recently_used_out_first():
    cache = ResultCache(ResultCacheConfig(enabled=True, max_bytes=250, max_entry_bytes=200), [])
    for key in ("a", "b"):
        cache.put(key, result(100), "m")
    assert cache.get("a", prepared()) is not None  # a is now the most recent
    cache.put("c", result(100), "m")  # 300 bytes: b goes
    assert cache.get("b", prepared()) is None and cache.get("a", prepared()) is not None
    assert cache.bytes == 200 and len(cache) == 2
    cache.put("big", result(201), "m")  # over max_entry_bytes: not kept
    assert cache.get("big", prepared()) is None and cache.bytes == 200
    hit = cache.get("c", prepared(request_id="mine"))
    assert hit.request_id == "mine" and hit.metrics.cache == "hit" and result_bytes(hit) == 100


def test_pushed_denoiser_weights_key_the_results_and_stale_ones_are_not_kept():
    """Issue 57: after a trainer pushes denoiser weights (`push_weights`), the same request has
    another key, and a result made with other weights than the last pushed is not kept."""
    cache = ResultCache(ResultCacheConfig(enabled=True), [])
    before = cache.key(prepared())
    cache.weights["m"] = 3
    assert cache.key(prepared()) != before
    made_before = result(10)  # weights_version None: the weights as loaded
    cache.put("k", made_before, "m")
    assert cache.get("k", prepared()) is None
    cache.put("k", made_before.model_copy(update={"weights_version": 3}), "m")
    assert cache.get("k", prepared()) is not None


@pytest.fixture(scope="module")
def cached(ray_cluster):
    from ray import serve

    args = app_args(result_cache={"enabled": True})
    args["tenants"] = [{"name": "team-a", "api_keys": [KEY_A]}, {"name": "team-b", "api_keys": [KEY_B]}]
    try:
        yield deploy("cache", args)
    finally:
        serve.delete("cache", _blocking=False)


def test_a_repeated_seeded_request_is_a_hit_with_identical_bytes(cached, client):
    body = {"prompt": "a red circle", "seed": 21, "size": "32x32", "num_inference_steps": 3}

    def post(json, key=KEY_A, **headers):
        headers = {"Authorization": f"Bearer {key}", **headers}
        r = client.post(f"{cached}/v1/images/generations", json=json, headers=headers)
        assert r.status_code == 200, r.text
        return r.headers.get("x-cache"), r.json()["data"][0]["b64_json"], r.json()["metrics"]

    first = post(body)
    assert first[0] == "miss" and first[2]["cache"] == "miss"
    again = post(body)
    assert again[0] == "hit" and again[1] == first[1] and again[2]["cache"] == "hit"
    assert again[2]["batch_images"] == 0  # no pipeline call
    changed = post({**body, "prompt": "a blue circle"})
    assert changed[0] == "miss" and changed[1] != first[1]
    assert post({**body, "num_inference_steps": 4})[0] == "miss"
    bypass = post(body, **{"Cache-Control": "no-cache"})
    assert bypass[0] == "bypass" and bypass[1] == first[1] and bypass[2]["batch_images"] == 1
    unseeded = post({k: v for k, v in body.items() if k != "seed"})
    assert unseeded[0] is None and unseeded[2].get("cache") is None
    assert post(body, key=KEY_B)[0] == "miss"  # another tenant
