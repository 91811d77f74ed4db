"""LoRA adapters on a real Serve app with two replicas: per-request adapters, admin, pinning, eviction."""

from __future__ import annotations

import base64
import concurrent.futures as cf
import copy
import io
import time

import numpy as np
import pytest
from PIL import Image
from ray import serve
from safetensors.torch import load_file, save_file

from serve_app.app import build_app
from serve_app.tools.lora import make_adapter
from tests.conftest import ADAPTER_DIR, SESSION_DIR, TEST_ARGS, replica_held, wait_for

APP = "lora"
P = f"/{APP}"
GEN = f"{P}/v1/images/generations"
own_app = pytest.mark.slow  # the tests on the two-replica app deployed here


def lora_args(replicas: int = 2) -> dict:
    args = copy.deepcopy(TEST_ARGS)
    args["replica"]["num_replicas"] = replicas
    args["lora"] = {**args["lora"], "registry_path": str(SESSION_DIR / "lora-app-registry.json")}
    args["batching"] = {"max_batch_images": 8, "batch_wait_ms": 20}
    return args


@pytest.fixture(scope="module")
def files():
    out = {n: make_adapter(str(ADAPTER_DIR / f"{n}.safetensors"), seed=s) for n, s in
           (("red", 1), ("blue", 2), ("green", 3), ("gold", 4))}  # fmt: skip
    state = load_file(str(out["red"]))
    save_file(
        {k: v[:2] if ".down." in k else v for k, v in state.items()}, str(ADAPTER_DIR / "rank2.safetensors")
    )
    save_file({k.replace("unet.", "unet.nowhere."): v for k, v in state.items()},
              str(ADAPTER_DIR / "nomatch.safetensors"))  # fmt: skip
    save_file({k: v * 0 for k, v in state.items()}, str(ADAPTER_DIR / "zero.safetensors"))
    (ADAPTER_DIR / "corrupt.safetensors").write_bytes(b"not a safetensors file at all")
    (ADAPTER_DIR / "big.safetensors").write_bytes(b"\0" * (2 * 2**20))
    (ADAPTER_DIR / "pickle.bin").write_bytes(b"\x80\x04K\x01.")
    return out


@pytest.fixture(scope="module")
def lora_app(ray_cluster, files):
    serve.run(build_app(lora_args()), name=APP, route_prefix=P)
    yield P
    serve.delete(APP, _blocking=False)


def image(client, **body) -> np.ndarray:
    r = client.post(GEN, json={"prompt": "a cat", "seed": 1, **body})
    assert r.status_code == 200, r.text
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"])))).astype(
        np.int16
    )


def add(client, name, path=None, **kw):
    return client.post(f"{P}/v1/loras", json={"name": name, "path": path or f"{name}.safetensors", **kw})


def replicas_loaded(client) -> list[dict]:
    return client.get(f"{P}/v1/loras").json()["replicas"]


@own_app
def test_adapter_changes_the_image_and_scale_zero_is_the_base(lora_app, client):
    assert add(client, "red", scale=1.0).status_code == 200
    assert add(client, "blue").status_code == 200
    base = image(client)
    red = image(client, lora={"name": "red"})
    blue = image(client, lora={"name": "blue"})
    zero = image(client, lora={"name": "red", "scale": 0})
    assert np.abs(red - base).max() > 5 and np.abs(blue - red).max() > 5
    assert np.array_equal(zero, base)
    listing = client.get(f"{P}/v1/loras").json()
    assert [a["name"] for a in listing["adapters"]] == ["blue", "red"]
    # Paths relative to their adapter root: the server's directories are nobody's business.
    assert listing["adapters"][0]["path"] == "blue.safetensors" and listing["adapters"][0]["pinned"] is False
    assert str(SESSION_DIR) not in str(listing)


@own_app
def test_stacked_adapters_give_one_image_whatever_their_order(lora_app, client):
    base, red = image(client), image(client, lora={"name": "red"})
    both = image(client, loras=[{"name": "red"}, {"name": "blue", "scale": 0.5}])
    again = image(client, loras=[{"name": "blue", "scale": 0.5}, {"name": "red"}])
    mixed = image(client, lora={"name": "blue", "scale": 0.5}, loras=[{"name": "red"}])  # both fields
    assert np.array_equal(both, again) and np.array_equal(both, mixed)
    assert np.abs(both - red).max() > 5 and np.abs(both - base).max() > 5
    zeros = image(client, loras=[{"name": "red", "scale": 0}, {"name": "blue", "scale": 0}])
    assert np.array_equal(zeros, base)
    for loras, words in [
        ([{"name": "red"}, {"name": "red"}], "'red' is named twice"),
        ([{"name": n} for n in ("red", "blue", "green")], "3 adapters, the maximum is 2"),
    ]:
        r = client.post(GEN, json={"prompt": "x", "loras": loras})
        assert r.status_code == 400 and r.json()["error"]["param"] == "loras", r.text
        assert words in r.json()["error"]["message"]
    r = client.post(GEN, json={"prompt": "x", "loras": [{"name": "red"}, {"name": "nope"}]})
    assert r.status_code == 404, r.text


@own_app
def test_same_adapter_image_on_every_replica_and_no_cross_contamination(lora_app, client):
    ref = {
        name: image(client, lora={"name": name}) if name else image(client) for name in ("red", "blue", None)
    }
    jobs = [name for name in ("red", "blue", None) for _ in range(4)]

    def go(name):
        body = {"lora": {"name": name}} if name else {}
        return name, image(client, **body)

    with cf.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(go, jobs))
    for name, img in results:
        # Requests with different adapters may share a call (mixed batches): the same image to
        # within 3 levels of 255, the CPU's rounding for another batch.
        assert np.abs(img - ref[name]).max() <= 3, f"request with adapter {name} got another image"
    holders = [r for r in replicas_loaded(client) if r["loaded"]]
    print(f"\nadapters per replica after mixed traffic: {[r['loaded'] for r in replicas_loaded(client)]}")
    assert holders


@own_app
def test_pinned_adapter_is_on_every_replica_and_a_full_pin_set_refuses_others(lora_app, client, files):
    assert add(client, "green").status_code == 200
    r = client.post(f"{P}/v1/loras/red/pin")
    assert r.status_code == 200 and r.json()["pinned"] is True
    for rep in replicas_loaded(client):
        assert "red" in rep["loaded"] and "red" in rep["pinned"], rep
    assert client.post(f"{P}/v1/loras/blue/pin").status_code == 200  # both slots now pinned
    r = client.post(GEN, json={"prompt": "a cat", "lora": {"name": "green"}})
    assert r.status_code == 400 and "pinned" in r.json()["error"]["message"], r.text
    for rep in replicas_loaded(client):
        assert set(rep["loaded"]) == {"red", "blue"}
    assert client.post(f"{P}/v1/loras/blue/pin", json={"pinned": False}).status_code == 200
    green = image(client, lora={"name": "green"})  # now it may evict the unpinned blue
    assert green.shape == (32, 32, 3)


@own_app
def test_eviction_keeps_at_most_max_loaded(lora_app, client):
    add(client, "gold")
    for name in ("gold", "green", "blue", "gold", "green"):
        image(client, lora={"name": name})
    stats = client.get(f"{P}/v1/status").json()["replicas"]
    assert all(len(r["loras_loaded"]) <= 2 for r in stats)
    assert all("red" in r["loras_loaded"] for r in stats)  # pinned: never evicted
    assert sum(r["counts"].get("lora_evictions", 0) for r in stats) >= 1
    # The real engine's files were read on the reader thread, ahead of the call that used them.
    assert sum(r["counts"].get("lora_prefetched", 0) for r in stats) >= 1
    assert all(r["loras_loaded_mb"] > 0 for r in stats)


@own_app
def test_replicas_started_later_load_pinned_adapters_and_the_registry_survives_a_restart(lora_app, client):
    # The app goes away entirely; its new replicas start after "red" was pinned and must load
    # it before they serve, from the registry file that outlived the old ones.
    serve.delete(APP)
    t = time.monotonic()
    serve.run(build_app(lora_args()), name=APP, route_prefix=P)
    print(f"\napp restarted in {time.monotonic() - t:.1f}s")
    listing = client.get(f"{P}/v1/loras").json()
    assert {a["name"] for a in listing["adapters"]} >= {"red", "blue", "green", "gold"}
    assert len(listing["replicas"]) == 2 and all("red" in r["loaded"] for r in listing["replicas"])
    assert image(client, lora={"name": "gold"}).shape == (32, 32, 3)


@own_app
def test_remove_evicts_everywhere_and_later_requests_get_404(lora_app, client):
    image(client, lora={"name": "green"})
    r = client.delete(f"{P}/v1/loras/green")
    assert r.status_code == 200
    assert all("green" not in rep["loaded"] for rep in replicas_loaded(client))
    r = client.post(GEN, json={"prompt": "a", "lora": {"name": "green"}})
    assert r.status_code == 404 and "green" in r.json()["error"]["message"]
    assert client.delete(f"{P}/v1/loras/green").status_code == 404


@own_app
@pytest.mark.parametrize(
    "name, path, status, message",
    [
        ("x1", "/etc/passwd.safetensors", 403, "outside the adapter roots"),
        ("x2", "../outside.safetensors", 403, "'..'"),
        ("x3", "pickle.bin", 400, "only .safetensors"),
        ("x4", "missing.safetensors", 400, "no adapter file"),
        ("x5", "corrupt.safetensors", 400, "not a readable safetensors file"),
        ("x6", "rank2.safetensors", 400, "does not fit"),
        ("x7", "nomatch.safetensors", 400, "match no layer"),
        ("x8", "zero.safetensors", 400, "would change no layer"),
        ("x9", "big.safetensors", 400, "above the limit"),
        ("bad name", "red.safetensors", 400, "name:"),
        ("red", "red.safetensors", 400, "already registered"),
    ],
)
def test_bad_adapters_are_refused_and_the_replicas_keep_serving(
    lora_app, client, name, path, status, message
):
    if name == "red" and not any(a["name"] == "red" for a in client.get(f"{P}/v1/loras").json()["adapters"]):
        add(client, "red")
    r = add(client, name, path)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"], r.json()
    assert str(SESSION_DIR) not in r.text  # no server path in what a caller sees
    assert client.post(GEN, json={"prompt": "still serving"}).status_code == 200


@own_app
def test_unknown_adapter_on_a_request_is_404(lora_app, client):
    r = client.post(GEN, json={"prompt": "a", "lora": {"name": "no-such-adapter"}})
    assert r.status_code == 404 and "no-such-adapter" in r.json()["error"]["message"]


def test_requests_with_different_adapters_share_one_call_over_http(client):
    """On the shared app (one replica, a 100 ms batch window): a request with adapter A, one
    with adapter B, one with none, one with A at half its scale and one stacking both, sent
    together, run as one pipeline call, and each gets the image it gets alone."""
    from serve_app.tools.lora import make_adapter

    for name, seed in (("mix-a", 31), ("mix-b", 32)):
        path = make_adapter(str(ADAPTER_DIR / f"{name}.safetensors"), seed=seed, strength=2.0)
        assert client.post("/v1/loras", json={"name": name, "path": str(path)}).status_code == 200
    try:
        both = [{"name": "mix-a", "scale": 0.6}, {"name": "mix-b", "scale": 0.4}]
        loras = ({"lora": {"name": "mix-a"}}, {"lora": {"name": "mix-b"}}, {},
                 {"lora": {"name": "mix-a", "scale": 0.5}}, {"loras": both})  # fmt: skip
        bodies = [{"prompt": "a cat", "seed": 5, "size": "32x32", **lora} for lora in loras]

        def post(body):
            r = client.post("/v1/images/generations", json=body)
            assert r.status_code == 200, r.text
            return r.json()

        alone = [post(b) for b in bodies]
        with replica_held(client) as queued, cf.ThreadPoolExecutor(5) as pool:
            futures = [pool.submit(post, b) for b in bodies]
            wait_for(lambda: queued() == 5, 60)
        together = [f.result() for f in futures]
        assert all(t["metrics"]["batch_requests"] == 5 for t in together), [t["metrics"] for t in together]
        for a, t in zip(alone, together, strict=True):
            assert np.abs(decoded(a) - decoded(t)).max() <= 3
        assert np.abs(decoded(together[0]) - decoded(together[1])).max() > 5  # the adapters differ
        assert np.abs(decoded(together[0]) - decoded(together[3])).max() > 5  # and so do the scales
        assert np.abs(decoded(together[0]) - decoded(together[4])).max() > 5  # and the stack
    finally:
        for name in ("mix-a", "mix-b"):
            client.delete(f"/v1/loras/{name}")


def decoded(body: dict) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(body["data"][0]["b64_json"])))).astype(np.int16)


def test_a_peft_adapter_directory_registers_over_http(client):
    """PEFT's layout registered on the shared app gives the image of the same adapter as a file,
    and the answer names the directory relative to its root."""
    from serve_app.tools.lora import make_adapter

    file = make_adapter(str(ADAPTER_DIR / "dir-twin.safetensors"), seed=41, strength=2.0)
    make_adapter(str(ADAPTER_DIR / "peft-dir"), seed=41, strength=2.0, alpha=8)  # lora_alpha = 2r
    r = client.post("/v1/loras", json={"name": "peft-dir", "path": "peft-dir"})
    assert r.status_code == 200 and r.json()["path"] == "peft-dir", r.text
    assert client.post("/v1/loras", json={"name": "dir-twin", "path": str(file)}).status_code == 200
    try:
        imgs = [
            client.post("/v1/images/generations", json={"prompt": "a", "seed": 3, "lora": {"name": n}}).json()
            for n in ("peft-dir", "dir-twin")
        ]
        assert imgs[0]["data"][0]["b64_json"] == imgs[1]["data"][0]["b64_json"]
    finally:
        for n in ("peft-dir", "dir-twin"):
            client.delete(f"/v1/loras/{n}")
