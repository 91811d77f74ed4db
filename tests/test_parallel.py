"""One request on two ranks (`model.parallel.cfg: 2`, issue 55): a replica in a placement group
of two bundles, a worker actor in the second, gloo between them, for a model that guides in one
batched call a step (tiny-sd) and one that runs two calls a step (tiny-flux's true CFG). The
images are those one process makes of the same seeds; the guided calls ran split; the replica
shows its ranks; an abort stops both ranks' call; an adapter reaches both; a lost rank makes
Serve replace the group, and the request under way runs again."""

from __future__ import annotations

import base64
import io
import os
import signal

import numpy as np
import pytest
from PIL import Image

from tests.conftest import ADAPTER_DIR, app_args, deploy, engine_cache, wait_for
from tests.test_lifecycle import LONG, Background, rid

pytestmark = pytest.mark.slow  # two models of two ranks each
APP = "par"
P = f"/{APP}"
GEN = f"{P}/v1/images/generations"
# Guided requests of each model, and the extra call argument the single-process engine gets.
GUIDED = {
    "sd": ({"guidance_scale": 5.0}, {}),
    "flux": (
        {"negative_prompt": "blue", "true_cfg_scale": 4.0, "guidance_scale": 3.5},
        {"true_cfg_scale": 4.0},
    ),
}


@pytest.fixture(scope="module")
def par(ray_cluster):
    from ray import serve

    args = app_args()
    base = {**args.pop("model"), "parallel": {"cfg": 2}, "default_steps": 4}
    base.pop("aliases")
    args["models"] = [{"model": {**base, "name": name, "source": f"builtin:tiny-{name}"}} for name in GUIDED]
    deploy(APP, args)
    yield P
    serve.delete(APP, _blocking=False)


def _ranks(client, model: str = "sd") -> list[dict]:
    models = client.get(f"{P}/v1/status").json()["models"]
    return next(m for m in models if m["model"] == model)["replicas"][0]["ranks"]


def _ranks_agree(client, model: str = "sd") -> None:
    """The worker ran as many split calls as rank 0 (its count arrives with a health check)."""
    wait_for(lambda: (r := _ranks(client, model))[1]["split_calls"] == r[0]["split_calls"], timeout=15)


def _replica(client, model: str = "sd") -> str | None:
    """The id of `model`'s replica; None while it has none that answers."""
    r = client.get(f"{P}/v1/status")
    models = r.json().get("models", []) if r.status_code == 200 else []
    found = [rep["replica_id"] for m in models if m["model"] == model for rep in m["replicas"]]
    return found[0] if found else None


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def decoded(item: dict) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))).convert("RGB"))


@pytest.mark.parametrize("model, acceleration", [("sd", "none"), ("flux", "none"), ("flux", "fast")])
def test_two_ranks_make_the_images_one_process_makes(par, client, model, acceleration):
    """Same seeds, same prompts: the single-process engine's images (a batched call's halves
    within 40 dB PSNR: a rank's share of the arithmetic may round a little differently from the
    whole batch's; 83 dB and identical measured), step caching too, and the ranks ran every
    guided step split, both the same number of them."""
    from serve_app.engine import CallParams, Row

    body, extra = GUIDED[model]
    before = _ranks(client, model)[0]["split_calls"]
    r = client.post(
        GEN,
        json={
            "model": model,
            "prompt": "a red circle",
            "seed": 11,
            "n": 2,
            "num_inference_steps": 6,
            "acceleration": acceleration,
            **body,
        },  # fmt: skip
    )
    assert r.status_code == 200, r.text
    served = [decoded(d) for d in r.json()["data"]]
    with engine_cache(cpu_threads=1) as get:  # as the served ranks run
        eng = get(f"tiny-{model}")
        rows = [Row("a red circle", body.get("negative_prompt"), s) for s in (11, 12)]
        params = CallParams(height=32, width=32, steps=6, guidance_scale=body["guidance_scale"],
                            extra=tuple(extra.items()), acceleration=acceleration)  # fmt: skip
        alone = [np.asarray(im.convert("RGB")) for im in eng.run(rows, params).images]
    db = [psnr(a, b) for a, b in zip(served, alone, strict=True)]
    # A paired step runs each call whole on one rank: the same arithmetic, the same pixels (the
    # tiny FLUX's images change little with their inputs: 4 steps against 6 is 50 dB apart).
    assert min(db) >= 40.0 if model == "sd" else db == [float("inf")] * 2, db
    ranks = _ranks(client, model)
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["pid"] != ranks[1]["pid"], ranks
    # Every guided step split (two calls a step: the first step runs whole while the pattern is learned).
    assert ranks[0]["split_calls"] - before == (6 if model == "sd" else 5), ranks
    _ranks_agree(client, model)


def test_an_abort_mid_call_stops_every_rank(par, client, base_url):
    """Rank 0 hears the abort at a step's end and tells the worker: both leave the call at the
    same step (a rank left behind would wait in its next collective and the next call would
    not run), and the next request is served."""
    job = rid("par-long")
    bg = Background(base_url + P, {**LONG, "model": "sd", "size": "64x64", "request_id": job})
    wait_for(lambda: (s := client.get(f"{P}/v1/requests/{job}")).status_code == 200 and s.json()["step"] >= 2)
    assert client.post(f"{P}/v1/requests/{job}/abort").json()["result"] == "aborted"
    assert bg.join().status_code == 499
    nxt = client.post(GEN, json={"model": "sd", "prompt": "next", "seed": 2})
    assert nxt.status_code == 200, nxt.text
    _ranks_agree(client)


def test_an_adapter_added_after_start_reaches_both_ranks(par, client):
    """The adapter is loaded on every rank: the guided halves each rank runs both carry it, so
    the image is the single-process engine's with the adapter (a rank without it would make
    another image)."""
    from serve_app.engine import CallParams, Row
    from serve_app.tools.lora import make_adapter

    path = make_adapter(str(ADAPTER_DIR / "par-red.safetensors"), seed=7, strength=3.0)
    r = client.post(f"{P}/v1/loras", json={"name": "par-red", "path": "par-red.safetensors", "model": "sd"})
    assert r.status_code == 200, r.text
    body = {"model": "sd", "prompt": "a cat", "seed": 4, "guidance_scale": 5.0, "num_inference_steps": 4}
    made = client.post(GEN, json={**body, "lora": {"name": "par-red"}})
    plain = client.post(GEN, json=body)
    assert made.status_code == plain.status_code == 200, made.text
    with engine_cache(cpu_threads=1) as get:  # as the served ranks run
        eng = get("tiny-sd")
        eng.load_lora("par-red", str(path))
        params = CallParams(height=32, width=32, steps=4, guidance_scale=5.0, loras=(("par-red", 1.0),))
        alone = np.asarray(eng.run([Row("a cat", None, 4)], params).images[0].convert("RGB"))
    served = decoded(made.json()["data"][0])
    assert psnr(served, alone) >= 40.0 and psnr(served, decoded(plain.json()["data"][0])) < 35.0


def test_a_lost_rank_makes_serve_replace_the_whole_group(par, client, base_url):
    """Kill the worker's process during a call: the call fails as a lost rank, the replica
    leaves and Serve replaces it (a new replica with a new worker), the request under way runs
    again there, and the dead group leaves no process behind."""
    before = _replica(client)
    old = _ranks(client)
    job = rid("par-killed")
    bg = Background(base_url + P, {"model": "sd", "prompt": "under way", "size": "64x64",
                                   "num_inference_steps": 12, "request_id": job}, timeout=180)  # fmt: skip
    wait_for(lambda: (s := client.get(f"{P}/v1/requests/{job}")).status_code == 200 and s.json()["step"] >= 1)
    os.kill(old[1]["pid"], signal.SIGKILL)

    wait_for(lambda: _replica(client) not in (None, before), timeout=90, interval=0.5)
    # The request under way when the rank died ran again on the new group: none lost.
    done = bg.join(timeout=120)
    assert done is not None and done.status_code == 200, (bg.error, done and done.text)
    new = _ranks(client)
    assert {r["pid"] for r in new}.isdisjoint({r["pid"] for r in old}), (old, new)

    def gone(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    wait_for(lambda: all(gone(r["pid"]) for r in old), timeout=30, interval=0.5)
