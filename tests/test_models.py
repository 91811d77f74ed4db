"""Several models behind one endpoint: routing by `model` (HTTP and handle), the model list,
per-model adapters, readiness and status, jobs that record their model, and a pool that serves
registered checkpoints on demand (load, evict, pin, shared components), each bad input a 4xx
naming its field while the replicas keep their ids. One app with three models: `sd` (tiny-sd,
the default, a pool holding one checkpoint at a time), `shapes`, and `slow`, whose load never
ends."""

from __future__ import annotations

import base64
import copy
import io
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from openai import NotFoundError, OpenAI
from PIL import Image
from ray import serve

from serve_app.app import build_app, deployment_name
from serve_app.config import AppConfig
from serve_app.schemas import PreparedRequest
from serve_app.tools.lora import make_adapter
from tests.conftest import ADAPTER_DIR, SESSION_DIR, TEST_ARGS, wait_for

APP = "multi"
P = f"/{APP}"
GEN = f"{P}/v1/images/generations"
CKPT_DIR = SESSION_DIR / "checkpoints"
pytestmark = pytest.mark.slow


def multi_args() -> dict:
    args = copy.deepcopy(TEST_ARGS)
    base = args.pop("model")
    sd = {**base, "name": "sd", "aliases": ["dall-e-3"]}
    shapes = {"source": "builtin:shapes", "device": "cpu", "default_height": 32, "default_width": 32,
              "default_steps": 2, "warmup_steps": 1, "cpu_threads": 1}  # fmt: skip
    slow = {**base, "name": "slow", "aliases": [], "engine_extension": "serve_app.testing:NeverReady"}
    args["models"] = [
        {"model": sd, "multiplex": {"max_models_per_replica": 1}},
        {"model": shapes, "limits": {**args["limits"], "max_steps": 10}},
        {"model": slow},
    ]
    args["checkpoints"] = {
        "registry_path": str(SESSION_DIR / "checkpoints.json"),
        "allowed_roots": [str(CKPT_DIR)],
    }
    args["lora"] = {**args["lora"], "registry_path": str(SESSION_DIR / "multi-loras.json")}
    return args


@pytest.fixture(scope="module")
def checkpoints():
    """Two tiny-sd fine-tunes (other unets, the same text encoder, tokenizer and VAE files), an
    SDXL, a directory with a pickle, and one that is no pipeline."""
    from serve_app.engine.builtin import build_builtin

    CKPT_DIR.mkdir(exist_ok=True)
    for name, seed in (("ft-a", 11), ("ft-b", 12)):
        build_builtin("tiny-sd", device=torch.device("cpu"), seed=seed).save_pretrained(
            CKPT_DIR / name, safe_serialization=True
        )
    for part in ("text_encoder", "tokenizer", "vae"):
        shutil.rmtree(CKPT_DIR / "ft-b" / part)
        shutil.copytree(CKPT_DIR / "ft-a" / part, CKPT_DIR / "ft-b" / part)
    build_builtin("tiny-sdxl", device=torch.device("cpu"), seed=0).save_pretrained(
        CKPT_DIR / "xl", safe_serialization=True
    )
    shutil.copytree(CKPT_DIR / "ft-a", CKPT_DIR / "pickled")
    (CKPT_DIR / "pickled" / "unet" / "extra.bin").write_bytes(b"\x80\x04K\x01.")
    (CKPT_DIR / "empty").mkdir()
    (CKPT_DIR / "empty" / "weights.safetensors").write_bytes(b"\0" * 8)
    make_adapter(str(ADAPTER_DIR / "sd-style.safetensors"), seed=7)
    return CKPT_DIR


@pytest.fixture(scope="module")
def multi(ray_cluster, checkpoints):
    from ray.serve.api import RunTarget

    serve.run_many(
        [RunTarget(build_app(multi_args()), name=APP, route_prefix=P)],
        wait_for_ingress_deployment_creation=True,
        wait_for_applications_running=False,
    )

    def serving():
        deps = serve.status().applications[APP].deployments
        return all(
            deps.get(f"DiffusionReplica-{m}") is not None
            and deps[f"DiffusionReplica-{m}"].status == "HEALTHY"
            for m in ("sd", "shapes")
        )

    wait_for(serving, 180, 0.2)
    yield P
    serve.delete(APP, _blocking=False)


def post(client, model=None, **body):
    body = {"prompt": "a red circle", "seed": 5, **body}
    if model is not None:
        body["model"] = model
    return client.post(GEN, json=body)


def pixels(r) -> np.ndarray:
    assert r.status_code == 200, r.text
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))))


def replica_ids(client) -> dict[str, list[str]]:
    st = client.get(f"{P}/v1/status").json()
    return {m["model"]: sorted(r["replica_id"] for r in m["replicas"]) for m in st["models"]}


# ---------------------------------------------------------------- configuration (no cluster)


def test_one_model_config_is_unchanged_and_several_are_checked():
    one = AppConfig.from_args({"model": {"source": "builtin:shapes"}})
    (served,) = one.served()
    assert served.name == "shapes" and deployment_name(served, 1) == "DiffusionReplica"
    cfg = AppConfig.from_args(multi_args())
    assert [s.name for s in cfg.served()] == ["sd", "shapes", "slow"]
    assert cfg.served()[1].limits.max_steps == 10 and cfg.served()[0].limits.max_steps == 50
    assert deployment_name(cfg.served()[1], 3) == "DiffusionReplica-shapes"
    with pytest.raises(ValueError, match="not both"):
        AppConfig.from_args({"model": {"source": "builtin:shapes"}, "models": [{"model": {}}]})
    with pytest.raises(ValueError, match="taken by model"):
        clash = {"source": "builtin:tiny-sd", "aliases": ["shapes"]}
        AppConfig.from_args({"models": [{"model": {"source": "builtin:shapes"}}, {"model": clash}]})
    with pytest.raises(ValueError, match="default_model"):
        AppConfig.from_args({"models": [{"model": {"source": "builtin:shapes"}}], "default_model": "x"})
    two = AppConfig.from_args(
        {"models": [{"model": {"source": "builtin:shapes"}}, {"model": {"source": "builtin:tiny-sd"}}],
         "default_model": "tiny-sd"}
    )  # fmt: skip
    assert [s.name for s in two.served()] == ["tiny-sd", "shapes"]
    with pytest.raises(ValueError, match=r"models\[0\].default_steps"):
        AppConfig.from_args({"models": [{"model": {"default_steps": 99}, "limits": {"max_steps": 10}}]})


# ---------------------------------------------------------------- routing and the model list


def test_model_picks_the_deployment_over_http_the_sdk_and_the_handle(multi, client, base_url):
    by_default, sd, alias = pixels(post(client)), pixels(post(client, "sd")), pixels(post(client, "dall-e-3"))
    shapes = post(client, "shapes")
    assert (by_default == sd).all() and (alias == sd).all()
    assert shapes.json()["model"] == "shapes" and post(client, "sd").json()["model"] == "sd"
    assert not np.array_equal(pixels(shapes), sd)
    sdk = OpenAI(base_url=f"{base_url}{P}/v1", api_key="none", max_retries=0)
    assert sdk.images.generate(model="shapes", prompt="a red circle").model == "shapes"
    with pytest.raises(NotFoundError, match="available: 'sd', 'shapes', 'slow'"):
        sdk.images.generate(model="stable-cascade", prompt="x")
    handle = serve.get_app_handle(APP)
    result = handle.generate.remote({"prompt": "a red circle", "seed": 5, "model": "shapes"}).result()
    assert result.model == "shapes"
    assert handle.generate.remote({"prompt": "a red circle", "seed": 5}).result().model == "sd"


def test_models_lists_every_model_with_its_family_and_defaults(multi, client):
    cards = {c["id"]: c for c in client.get(f"{P}/v1/models").json()["data"]}
    assert cards["sd"]["family"] == "sd" and cards["sd"]["aliases"] == ["dall-e-3"]
    assert cards["sd"]["default_steps"] == 3 and "img2img" in cards["sd"]["tasks"]
    assert cards["shapes"]["default_steps"] == 2 and cards["shapes"]["modalities"] == ["image"]
    assert cards["slow"]["ready"] is False and cards["sd"]["ready"] is True


@pytest.mark.parametrize(
    "model, status",
    [
        ("/etc/passwd", 404),
        ("../../models/sd", 404),
        ("x" * 200, 404),
        ("x" * 300, 400),
        ("unregistered", 404),
    ],
)
def test_bad_model_names_are_refused_naming_the_field(multi, client, model, status):
    before = replica_ids(client)
    r = post(client, model)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == "model" and str(SESSION_DIR) not in r.text
    if status == 404:
        assert "available: 'sd', 'shapes', 'slow'" in err["message"]
    assert replica_ids(client) == before


# ---------------------------------------------------------------- per model: readiness, status, jobs


def test_a_model_not_ready_is_a_503_for_it_alone(multi, client):
    r = post(client, "slow")
    assert r.status_code == 503 and "'slow'" in r.json()["error"]["message"], r.text
    assert client.get(f"{P}/health", params={"model": "slow"}).status_code == 503
    assert client.get(f"{P}/health").status_code == 200
    assert client.get(f"{P}/health", params={"model": "shapes"}).status_code == 200
    assert post(client, "shapes").status_code == 200


def test_status_and_metrics_carry_the_model(multi, client, base_url):
    post(client, "shapes")
    post(client, "sd")
    st = client.get(f"{P}/v1/status").json()
    assert st["model"] == "sd"
    models = {m["model"]: m for m in st["models"]}
    assert models["sd"]["ready"] and models["shapes"]["ready"] and not models["slow"]["ready"]
    assert all(r["model"] == "shapes" for r in models["shapes"]["replicas"])
    assert {r["model"] for r in st["replicas"]} == {"sd", "shapes"}
    import httpx
    import ray

    port = ray._private.worker.global_worker.node.metrics_export_port

    def labelled():
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        lines = [ln for ln in text.splitlines() if ln.startswith("ray_diffusion_requests_total")]
        # Both labels, each from its own export: another app of this session may serve a "shapes"
        # model too (tests/test_grpo_example.py), so one label seen says nothing of the other.
        return lines if all(any(f'model="{m}"' in ln for ln in lines) for m in ("shapes", "sd")) else None

    assert wait_for(labelled, 90, 2)


def test_a_job_records_its_model(multi, client):
    r = client.post(
        GEN, json={"prompt": "a blue square", "model": "shapes"}, headers={"Prefer": "respond-async, wait=60"}
    )
    assert r.status_code in (200, 202) and r.json()["model"] == "shapes", r.text


# ---------------------------------------------------------------- adapters per model


def test_adapters_are_per_model(multi, client):
    r = client.post(
        f"{P}/v1/loras", json={"name": "for-shapes", "path": "sd-style.safetensors", "model": "shapes"}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "path", r.text
    assert "model 'shapes'" in r.json()["error"]["message"]
    ok = client.post(
        f"{P}/v1/loras", json={"name": "sd-style", "path": "sd-style.safetensors", "model": "sd"}
    )
    assert ok.status_code == 200, ok.text
    listed = {a["name"]: a for a in client.get(f"{P}/v1/loras").json()["adapters"]}
    assert listed["sd-style"]["model"] == "sd"
    styled = pixels(post(client, "sd", lora={"name": "sd-style"}))
    assert not np.array_equal(styled, pixels(post(client, "sd")))
    wrong = post(client, "shapes", lora={"name": "sd-style"})
    assert wrong.status_code == 400 and "registered for model 'sd'" in wrong.json()["error"]["message"]
    pinned = client.post(f"{P}/v1/loras/sd-style/pin", json={"pinned": True})
    assert pinned.status_code == 200, pinned.text
    held = client.get(f"{P}/v1/loras").json()["replicas"]
    assert [r["pinned"] for r in held if "sd-style" in r["pinned"]]  # on sd's replica
    assert client.delete(f"{P}/v1/loras/sd-style").status_code == 200


# ---------------------------------------------------------------- a pool's checkpoints on demand


def held(client) -> dict:
    (replica,) = client.get(f"{P}/v1/checkpoints").json()["replicas"]
    return replica


def test_checkpoints_load_on_demand_evict_and_pin(multi, client):
    base = pixels(post(client, "sd"))
    for name in ("ft-a", "ft-b"):
        r = client.post(f"{P}/v1/checkpoints", json={"name": name, "source": str(CKPT_DIR / name)})
        assert r.status_code == 200 and r.json()["family"] == "sd" and r.json()["source"] == name, r.text
    cards = {c["id"]: c for c in client.get(f"{P}/v1/models").json()["data"]}
    assert cards["ft-a"]["pool"] == "sd" and cards["ft-a"]["family"] == "sd"
    assert held(client)["held"] == ["ft-b"]  # one at a time: registering b evicted a
    a1 = post(client, "ft-a")
    assert a1.json()["model"] == "ft-a"
    a = pixels(a1)
    assert held(client)["held"] == ["ft-a"]
    assert not np.array_equal(a, base)
    assert (pixels(post(client, "ft-a")) == a).all()  # the same seed, the same image
    b = pixels(post(client, "ft-b"))
    assert not np.array_equal(a, b) and held(client)["held"] == ["ft-b"]
    assert held(client)["shared_components"] >= 2  # b took a's text encoder and VAE as they were
    assert client.post(f"{P}/v1/checkpoints/ft-a/pin", json={"pinned": True}).status_code == 200
    post(client, "ft-b")
    post(client, "sd")  # the pool's own model is always there
    state = held(client)
    assert "ft-a" in state["held"] and state["pinned"] == ["ft-a"]
    handle = serve.get_app_handle(APP)
    assert handle.generate.remote({"prompt": "x", "model": "ft-a"}).result().model == "ft-a"
    # A prepared request names its checkpoint; its source is the registry's, never the caller's.
    fields = dict(prompts=["x"], negative_prompt=None, height=32, width=32, num_inference_steps=2,
                  guidance_scale=1.0, seed=5, num_images=1, output_format="png")  # fmt: skip
    forged = PreparedRequest(
        request_id="forged-1", model="sd", checkpoint="ft-a", checkpoint_source="/etc", **fields
    )
    assert handle.generate.remote(forged).result().model == "ft-a"
    lora = post(client, "ft-a", lora={"name": "anything"})
    assert lora.status_code == 400 and lora.json()["error"]["param"] == "loras"
    gone = client.delete(f"{P}/v1/checkpoints/ft-b")
    assert gone.status_code == 200 and post(client, "ft-b").status_code == 404


@pytest.mark.parametrize(
    "body, message",
    [
        ({"name": "outside", "source": "/etc"}, "outside"),
        ({"name": "pickled", "source": str(CKPT_DIR / "pickled")}, "pickle"),
        ({"name": "empty", "source": str(CKPT_DIR / "empty")}, "model_index.json"),
        ({"name": "missing", "source": str(CKPT_DIR / "missing")}, ""),
        ({"name": "xl", "source": str(CKPT_DIR / "xl")}, "serves sd checkpoints"),
        ({"name": "hub", "source": "stabilityai/sdxl-turbo"}, "hub"),
        ({"name": "a/b", "source": str(CKPT_DIR / "ft-a")}, "name"),
        ({"name": "shapes", "source": str(CKPT_DIR / "ft-a")}, "model's name"),
        ({"name": "p", "source": str(CKPT_DIR / "ft-a"), "pool": "shapes"}, "not a pool"),
    ],
)
def test_bad_checkpoints_are_refused_and_the_replicas_keep_their_ids(
    multi, client, checkpoints, body, message
):
    before = replica_ids(client)
    r = client.post(f"{P}/v1/checkpoints", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    field = "name" if body["name"] in ("a/b", "shapes") else "pool" if "pool" in body else "source"
    assert err["param"] == field and message.lower() in err["message"].lower(), err
    assert str(SESSION_DIR) not in r.text
    assert replica_ids(client) == before
    assert body["name"] not in {c["name"] for c in client.get(f"{P}/v1/checkpoints").json()["checkpoints"]}


def test_a_checkpoint_s_header_is_read_off_the_event_loop(multi, client, checkpoints):
    """Issue 60: a large safetensors header (up to 100 MB of JSON) once stalled every route of the
    ingress, `/live` too, while a registration read it. Now `/live` answers throughout."""
    import json
    import struct
    import threading

    tensors = {f"t{i}": {"dtype": "F16", "shape": [1], "data_offsets": [0, 0]} for i in range(700_000)}
    raw = json.dumps(tensors).encode()  # about 60 MB, read here in two seconds or more
    big = checkpoints / "big-header.safetensors"
    big.write_bytes(struct.pack("<Q", len(raw)) + raw)
    answer: list = []

    def register():
        t = time.monotonic()
        r = client.post(f"{P}/v1/checkpoints", json={"name": "big-header", "source": str(big)})
        answer.append((r, time.monotonic() - t))

    thread = threading.Thread(target=register)
    live: list[float] = []
    try:
        thread.start()
        while thread.is_alive():
            t = time.monotonic()
            assert client.get(f"{P}/live").status_code == 200
            live.append(time.monotonic() - t)
            time.sleep(0.02)
        thread.join()
    finally:
        big.unlink()
    r, took = answer[0]
    assert r.status_code == 400 and r.json()["error"]["param"] == "source", r.text  # no known layout
    assert took > 0.5, f"the header read in {took:.2f}s: too quick to show anything"
    assert len(live) >= 3 and max(live) < took / 2, (took, live)


def test_a_hot_model_keeps_serving_while_a_checkpoint_loads(multi, client):
    """Not a timing assertion (benchmarks/bench_models.py measures it): a request for the
    pool's own model sent while a checkpoint loads is answered, and the load happens once."""
    import concurrent.futures

    assert client.post(f"{P}/v1/checkpoints/ft-a/pin", json={"pinned": False}).status_code == 200
    r = client.post(f"{P}/v1/checkpoints", json={"name": "ft-c", "source": str(CKPT_DIR / "ft-b")})
    assert r.status_code == 200 and held(client)["held"] == ["ft-c"], r.text  # a, unpinned, went
    loads = held(client)["loads"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        cold = [pool.submit(post, client, "ft-a") for _ in range(2)]
        time.sleep(0.05)
        hot = pool.submit(post, client, "sd")
        assert hot.result().status_code == 200
        assert all(f.result().status_code == 200 for f in cold)
    assert held(client)["loads"] == loads + 1  # two requests, one load


def test_the_multi_model_demo_config_serves_both_models(ray_cluster, base_url):
    """configs/multi-model-demo.yaml as shipped (its registry moved into the test session): both
    models answer by name, the default without one, and both are listed."""
    import httpx
    import yaml

    from tests.conftest import deploy

    root = Path(__file__).resolve().parent.parent
    args = yaml.safe_load((root / "configs" / "multi-model-demo.yaml").read_text())["applications"][0]["args"]
    args["checkpoints"]["registry_path"] = str(SESSION_DIR / "demo-checkpoints.json")
    args["lora"]["registry_path"] = str(SESSION_DIR / "demo-loras.json")
    prefix = deploy("demo", args)
    try:
        url = f"{base_url}{prefix}/v1/images/generations"
        for model, expected in ((None, "shapes"), ("shapes", "shapes"), ("tiny-sdxl", "tiny-sdxl")):
            body = {"prompt": "a red circle", **({"model": model} if model else {})}
            r = httpx.post(url, json=body, timeout=120)
            assert r.status_code == 200 and r.json()["model"] == expected, r.text
        ids = [c["id"] for c in httpx.get(f"{base_url}{prefix}/v1/models", timeout=30).json()["data"]]
        assert ids[:2] == ["shapes", "tiny-sdxl"]
    finally:
        serve.delete("demo", _blocking=False)
