"""One request on two ranks (`model.parallel`, issue 55): a replica in a placement group of two
bundles, a worker actor in the second, gloo between them. CFG parallel (`cfg: 2`) for a model
that guides in one batched call a step (tiny-sd) and one that runs two calls a step (tiny-flux's
true CFG); sequence parallel (`ulysses: 2`, diffusers' context parallelism) for tiny-flux and
tiny-wan; both at once on four ranks for tiny-flux. The images are those one process makes of
the same seeds; the calls ran split; the replica shows its ranks; an abort stops both ranks'
call; an adapter reaches both; a lost rank makes Serve replace the group, and the request under
way runs again."""

from __future__ import annotations

import base64
import io
import os
import signal

import numpy as np
import pytest
from PIL import Image

from tests.conftest import ADAPTER_DIR, TEST_ARGS, app_args, deploy, engine_cache, wait_for
from tests.test_lifecycle import LONG, Background, rid

pytestmark = pytest.mark.slow  # four models of two ranks each, one of four
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

    # A health check that times out in 8 s (the worker's ping in 4): a long call must not trip it.
    args = app_args(replica={**TEST_ARGS["replica"], "health_check_timeout_s": 8})
    base = {**args.pop("model"), "parallel": {"cfg": 2}, "default_steps": 4}
    base.pop("aliases")
    args["models"] = (
        [{"model": {**base, "name": name, "source": f"builtin:tiny-{name}"}} for name in GUIDED]
        + [
            {
                "model": {
                    **base,
                    "name": f"{name}-u",
                    "source": f"builtin:tiny-{name}",
                    "parallel": {"ulysses": 2},
                }
            }
            for name in ("flux", "wan")
        ]
        + [
            {
                "model": {
                    **base,
                    "name": "flux-cu",
                    "source": "builtin:tiny-flux",
                    "parallel": {"cfg": 2, "ulysses": 2},
                }
            }
        ]
    )
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


def test_adapters_added_mixed_and_removed_reach_both_ranks(par, client):
    """Adapters are loaded and removed on every rank: the guided halves each rank runs carry the
    request's adapter, so each image is the single-process engine's with it (a rank without it
    would make another image); two requests with different adapters share one call (each rank
    gives each row its own); an adapter removed and registered again under its name with other
    weights has those on both ranks."""
    import concurrent.futures as cf

    from serve_app.engine import CallParams, Row
    from serve_app.tools.lora import make_adapter
    from tests.conftest import replica_held

    def register(name: str, seed: int):
        make_adapter(str(ADAPTER_DIR / f"{name}-{seed}.safetensors"), seed=seed, strength=3.0)
        r = client.post(
            f"{P}/v1/loras", json={"name": name, "path": f"{name}-{seed}.safetensors", "model": "sd"}
        )
        assert r.status_code == 200, r.text

    def alone(adapters: dict[str, int], name: str) -> np.ndarray:
        """The single-process engine's image of `name` (adapter -> seed of its weights)."""
        with engine_cache(cpu_threads=1) as get:  # as the served ranks run
            eng = get("tiny-sd")
            eng.load_lora(name, str(ADAPTER_DIR / f"{name}-{adapters[name]}.safetensors"))
            params = CallParams(height=32, width=32, steps=4, guidance_scale=5.0, loras=((name, 1.0),))
            return np.asarray(eng.run([Row("a cat", None, 4)], params).images[0].convert("RGB"))

    body = {"model": "sd", "prompt": "a cat", "seed": 4, "guidance_scale": 5.0, "num_inference_steps": 4}

    def made(name: str):
        r = client.post(GEN, json={**body, "lora": {"name": name}})
        assert r.status_code == 200, r.text
        return decoded(r.json()["data"][0]), r.json()["metrics"]["batch_requests"]

    register("par-red", 7)
    register("par-blue", 8)
    plain = client.post(GEN, json=body)
    assert plain.status_code == 200, plain.text
    red = made("par-red")[0]
    assert psnr(red, alone({"par-red": 7}, "par-red")) >= 40.0
    assert psnr(red, decoded(plain.json()["data"][0])) < 35.0
    with replica_held(client, P, steps=20), cf.ThreadPoolExecutor(2) as pool:  # both queue, then share a call
        both = list(pool.map(made, ["par-red", "par-blue"]))
    assert [n for _, n in both] == [2, 2], both
    assert psnr(both[0][0], red) >= 40.0 and psnr(both[1][0], alone({"par-blue": 8}, "par-blue")) >= 40.0
    assert client.delete(f"{P}/v1/loras/par-red").status_code == 200
    register("par-red", 9)
    assert psnr(made("par-red")[0], alone({"par-red": 9}, "par-red")) >= 40.0


def test_a_stream_with_previews_and_a_job_on_two_ranks(par, client):
    """Progress and previews are rank 0's, at every step; an asynchronous job runs as any
    request does."""
    import json

    body = {"model": "sd", "prompt": "a boat", "seed": 1, "num_inference_steps": 3, "guidance_scale": 5.0}
    r = client.post(GEN, json={**body, "stream": True, "preview_every": 1})
    assert r.status_code == 200, r.text
    events = [json.loads(e[len("data: ") :]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    assert [e["step"] for e in events if e.get("type") == "step" and e.get("preview_png")] == [1, 2, 3]
    assert events[-1]["type"] == "result"
    job = client.post(GEN, json=body, headers={"Prefer": "respond-async, wait=30"})
    assert job.status_code == 200 and job.json()["state"] == "done", job.text


def test_a_call_longer_than_the_health_check_keeps_its_replica(par, client):
    """The worker answers the health check's ping during a call (its ping has a thread of its
    own): a call several times longer than the check's timeout leaves the replica as it was."""
    from serve_app.testing import SLOW_MARKER

    before = _replica(client)
    body = {"model": "sd", "prompt": f"long {SLOW_MARKER}", "num_inference_steps": 50, "size": "128x128"}
    r = client.post(GEN, json=body, timeout=120)
    assert r.status_code == 200 and r.json()["metrics"]["total_ms"] > 10000, r.text[:300]
    assert _replica(client) == before


def test_a_lost_rank_makes_serve_replace_the_whole_group(par, client, base_url):
    """Kill the worker's process under load, during a call with more requests queued behind it:
    the call fails as a lost rank, the replica leaves and Serve replaces it (a new replica with
    a new worker), every request runs again there (none lost), and the dead group leaves no
    process behind."""
    before = _replica(client)
    old = _ranks(client)
    job = rid("par-killed")
    body = {"model": "sd", "size": "64x64", "num_inference_steps": 12}
    under_way = Background(base_url + P, {**body, "prompt": "under way", "request_id": job}, timeout=180)
    wait_for(lambda: (s := client.get(f"{P}/v1/requests/{job}")).status_code == 200 and s.json()["step"] >= 1)
    queued = [Background(base_url + P, {**body, "prompt": f"queued {i}"}, timeout=180) for i in range(3)]
    wait_for(lambda: client.get(f"{P}/v1/status").json()["models"][0]["queue_length"] >= 2, timeout=30)
    os.kill(old[1]["pid"], signal.SIGKILL)

    wait_for(lambda: _replica(client) not in (None, before), timeout=90, interval=0.5)
    for bg in (under_way, *queued):  # all ran again on the new group: none lost
        done = bg.join(timeout=150)
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


@pytest.mark.parametrize("model", ["flux-u", "wan-u"])
def test_ulysses_shares_the_tokens_and_makes_one_process_s_latents(par, client, model):
    """Each rank holds half the tokens between the attention's all-to-alls (its output projection
    sees half of one process's); the final latents are the single-process engine's (to 1e-4:
    attention over the same tokens, added in another order). A size whose tokens two ranks
    cannot share is a 400 naming `size`, and the replica stays."""
    from serve_app.engine import CallParams, Row
    from serve_app.engine.loading import find_denoiser
    from serve_app.schemas import TensorPayload

    video = model == "wan-u"
    url = f"{P}/v1/videos/generations" if video else GEN
    before = _ranks(client, model)[0]["split_calls"]
    body = {"model": model, "prompt": "a red circle", "seed": 5, "num_inference_steps": 3,
            "guidance_scale": 3.5, "size": "64x64", "return_latents": True}  # fmt: skip
    r = client.post(url, json=body)
    assert r.status_code == 200, r.text
    served = TensorPayload(**r.json()["latents"]).to_numpy()
    with engine_cache(cpu_threads=1) as get:
        eng = get("tiny-" + model.removesuffix("-u"))
        seen = []  # the tokens one process's output projection sees: all of them
        hook = find_denoiser(eng.pipe).proj_out.register_forward_pre_hook(
            lambda _, a: seen.append(a[0].shape[1])
        )
        params = CallParams(height=64, width=64, steps=3, guidance_scale=3.5, return_latents=True,
                            num_frames=eng.default_num_frames)  # fmt: skip
        alone = eng.run([Row("a red circle", None, 5)], params).latents.numpy()
        hook.remove()
    assert served.shape == alone.shape and np.abs(served - alone).max() < 1e-4, np.abs(served - alone).max()
    wait_for(lambda: [r["tokens"] for r in _ranks(client, model)] == [seen[0] // 2] * 2, timeout=15)
    calls_a_step = 2 if video else 1  # Wan guides in two calls a step; this FLUX in none
    assert _ranks(client, model)[0]["split_calls"] - before == 3 * calls_a_step
    _ranks_agree(client, model)
    if video:  # 48x48 in one frame: 9 tokens
        ids = _replica(client, model)
        bad = client.post(url, json={**body, "size": "48x48", "num_frames": 1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "size", bad.text
        assert _replica(client, model) == ids


@pytest.mark.parametrize(
    "source, ulysses, message",
    [
        ("tiny-sd", 2, "model.parallel.ulysses: UNet2DConditionModel has no context-parallel plan"),
        ("tiny-sd3", 2, "model.parallel.ulysses: SD3Transformer2DModel has no context-parallel plan"),
        ("tiny-flux", 4, "model.parallel.ulysses: 4 does not divide the 2 attention heads"),
    ],
)
def test_sequence_parallel_is_refused_at_start_where_the_denoiser_cannot_share_its_tokens(
    source, ulysses, message
):
    """Checked before any process group is needed: the replica fails to start with the field."""
    from serve_app.config import ModelConfig
    from serve_app.engine import DiffusionEngine, ModelLoadError, parallel

    eng = DiffusionEngine(
        ModelConfig(source=f"builtin:{source}", device="cpu", warmup=False, parallel={"ulysses": ulysses})
    )
    with pytest.raises(ModelLoadError) as e:
        eng.split_across(parallel.Group(rank=0, world=ulysses, device=eng.device))
    assert message in str(e.value), e.value
    eng.close()


def test_guidance_and_tokens_shared_at_once_on_four_ranks(par, client):
    """`cfg: 2` with `ulysses: 2`: ranks on a (branch, token share) mesh; the two ranks of a
    branch share its call's tokens, the branches swap outputs. The latents are one process's."""
    from serve_app.engine import CallParams, Row
    from serve_app.schemas import TensorPayload

    body = {"model": "flux-cu", "prompt": "a red circle", "seed": 5, "num_inference_steps": 4,
            "size": "64x64", "guidance_scale": 3.5, "negative_prompt": "blue", "true_cfg_scale": 4.0,
            "return_latents": True}  # fmt: skip
    r = client.post(GEN, json=body)
    assert r.status_code == 200, r.text
    served = TensorPayload(**r.json()["latents"]).to_numpy()
    with engine_cache(cpu_threads=1) as get:
        params = CallParams(height=64, width=64, steps=4, guidance_scale=3.5, return_latents=True,
                            extra=(("true_cfg_scale", 4.0),))  # fmt: skip
        alone = get("tiny-flux").run([Row("a red circle", "blue", 5)], params).latents.numpy()
    assert np.abs(served - alone).max() < 1e-4, np.abs(served - alone).max()
    ranks = _ranks(client, "flux-cu")
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3] and len({r["pid"] for r in ranks}) == 4, ranks
    assert ranks[0]["split_calls"] == 3  # steps 2-4 paired (the first learns the pattern)
    wait_for(lambda: {r["split_calls"] for r in _ranks(client, "flux-cu")} == {3}, timeout=15)


def test_ranks_that_cannot_be_placed_say_so_and_requests_are_refused_not_held(ray_cluster, client):
    """Two ranks of one GPU each on a cluster without GPUs: the deployment's status says its
    replica waits for resources (naming them), and a request for the model gets a 503 at once."""
    from ray import serve

    app = "par-unplaced"
    args = app_args(replica={"num_replicas": 1, "num_cpus": 0, "num_gpus": 1})
    args["model"] = {**args["model"], "parallel": {"cfg": 2}}
    from serve_app.app import build_app

    serve._run(build_app(args), name=app, route_prefix=f"/{app}", _blocking=False)
    try:

        def waiting() -> str | None:
            st = serve.status().applications.get(app)
            msgs = [d.message for d in st.deployments.values()] if st else []
            return next((m for m in msgs if "Resources required for each replica" in m), None)

        message = wait_for(waiting, timeout=60, interval=0.5)
        assert '[{"CPU": 0.01, "GPU": 1.0}, {"CPU": 0.01, "GPU": 1.0}]' in message, message  # the two bundles
        wait_for(lambda: client.get(f"/{app}/live").status_code == 200, timeout=60, interval=0.5)
        r = client.post(f"/{app}/v1/images/generations", json={"prompt": "a"}, timeout=30)
        assert r.status_code == 503, r.text
    finally:
        serve.delete(app, _blocking=False)
