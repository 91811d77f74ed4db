"""Faults and scale on a real Serve cluster: health, replica death, backpressure, autoscaling, drain.

Each test deploys its own small app beside the shared one (own name and route prefix) and
deletes it when done; the two overload tests share one. The figures they print (retries,
recovery time, scale-up time) are the ones the closing notes report.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import io
import json
import os
import random
import threading
import time

import httpx
import numpy as np
import pytest
import ray
from PIL import Image
from ray import serve

from serve_app.testing import SLOW_MARKER, fault_token_path
from tests.conftest import app_args, deploy, deployed, wait_for

pytestmark = pytest.mark.slow
GEN = "/v1/images/generations"


class Load:
    """Closed-loop clients, each sending its next request when the last is answered, until
    `finish()`; `outcomes` collects (status, body). `body(c, i)` is client c's i-th request."""

    def __init__(self, url: str, body, clients: int = 4):
        self.outcomes: list[tuple[int, dict]] = []
        self._stop = threading.Event()

        def run(c: int) -> None:
            with httpx.Client(timeout=90) as http:
                i = 0
                while not self._stop.is_set():
                    r = http.post(url, json=body(c, i))
                    self.outcomes.append((r.status_code, r.json()))
                    i += 1

        self._threads = [threading.Thread(target=run, args=(c,), daemon=True) for c in range(clients)]
        for t in self._threads:
            t.start()

    def finish(self, timeout: float = 120) -> list[tuple[int, dict]]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout)
            assert not t.is_alive(), "a client is still waiting: a request hung"
        return self.outcomes


def status(client, prefix) -> dict:
    return client.get(f"{prefix}/v1/status").json()


def replica_actors(app: str) -> list[str]:
    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(f"SERVE_REPLICA::{app}#DiffusionReplica#")
    ]


def arm_fatal(client, prefix: str, token: str) -> str:
    """Break exactly one replica's device on its next call (serve_app.testing.FaultInjection)."""
    path = fault_token_path(token)
    open(path, "w").close()
    r = client.post(f"{prefix}/v1/rpc", json={"method": "arm_fatal_once", "args": [token]})
    assert r.status_code == 200 and all(x["ok"] for x in r.json()), r.text
    return path


def replica_ids(client, prefix) -> set[str]:
    try:
        return {r["replica_id"] for r in status(client, prefix)["replicas"]}
    except Exception:
        return set()


def test_fatal_device_error_fails_over_at_once_and_loses_no_request(app_factory, client, base_url):
    # The broken replica leaves by itself at once (a replica that only reported itself unhealthy
    # would stay listed until Serve replaced it after three failed checks, 15 s here); Serve sees
    # the dead actor at its next health check and starts a replacement.
    app = "fatal"
    period = 5
    prefix = app_factory(
        app,
        replica={"num_replicas": 2, "health_check_period_s": period},
        batching={"batch_wait_ms": 5},
        ingress={"max_attempts": 5},  # a retry may meet the leaving replica before it is gone
    )
    wait_for(lambda: len(replica_ids(client, prefix)) == 2, 60)
    before = replica_ids(client, prefix)
    load = Load(
        f"{base_url}{prefix}/v1/images/generations",
        lambda c, i: {"prompt": f"load {c}", "seed": c * 1000 + i, "num_inference_steps": 4},
    )
    outcomes = load.outcomes
    wait_for(lambda: len(outcomes) >= 4, 60)
    token = arm_fatal(client, prefix, "under-load")
    t0 = time.monotonic()
    wait_for(lambda: not os.path.exists(token), 30)  # one replica took the fault
    # and is gone, sooner than three failed health checks (15 s) would have removed it
    wait_for(lambda: len(replica_ids(client, prefix) & before) == 1, 12)
    gone_s = time.monotonic() - t0
    wait_for(
        lambda: len(replica_ids(client, prefix) - before) == 1 and len(replica_ids(client, prefix)) == 2, 90
    )
    replaced_s = time.monotonic() - t0
    n_after = len(outcomes)
    wait_for(lambda: len(outcomes) >= n_after + 4, 60)
    load.finish()
    failed = [(s, b) for s, b in outcomes if s != 200]
    retried = [b for s, b in outcomes if s == 200 and b["attempts"] > 1]
    print(
        f"\nfatal device error under load: broken replica gone {gone_s:.1f}s and replaced {replaced_s:.1f}s "
        f"after the fault (health checks every {period} s); {len(outcomes)} requests, {len(failed)} "
        f"failed, {len(retried)} retried"
    )
    assert not failed, failed[:3]
    assert retried, "no request was in the broken replica: the test did not test the hand-back"

    # A stream whose replica breaks before its first event is sent again, like a plain request.
    token = arm_fatal(client, prefix, "stream")
    with client.stream(
        "POST",
        f"{prefix}/v1/images/generations",
        json={"prompt": "streamed", "stream": True, "num_inference_steps": 3},
    ) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert not os.path.exists(token)  # the fault fired
    assert events[-1]["type"] == "result" and events[-1]["attempts"] >= 2, events[-1]


def test_a_per_request_error_does_not_fail_health(client, base_url):
    from serve_app.testing import FAIL_MARKER, OOM_MARKER

    for marker in (FAIL_MARKER, OOM_MARKER):
        client.post("/v1/images/generations", json={"prompt": marker})
    rep = client.get("/v1/status").json()["replicas"][0]
    assert rep["healthy"] and rep["health_problem"] is None


def test_killed_replicas_and_ingress_lose_no_request_and_no_job(app_factory, client, base_url):
    app = "kill"
    prefix = app_factory(
        app,
        replica={"num_replicas": 2, "health_check_period_s": 1},
        ingress={"max_attempts": 4},
        batching={"batch_wait_ms": 5},
    )
    wait_for(lambda: len(replica_actors(app)) == 2, 60)
    load = Load(
        f"{base_url}{prefix}/v1/images/generations",
        lambda c, i: {
            "prompt": f"steady {c}",
            "seed": c * 10_000 + i,
            "size": "64x64",
            "num_inference_steps": 8,
        },
    )
    outcomes = load.outcomes
    kills = 0
    rng = random.Random(0)
    t0 = time.monotonic()
    # Three kills, and more (up to eight) until one has caught a request that was then retried:
    # on a loaded machine three kills 3 s apart sometimes caught none.
    caught = lambda: any(s == 200 and b["attempts"] > 1 for s, b in list(outcomes))  # noqa: E731
    for k in range(8):
        time.sleep(3)
        if k >= 3 and caught():
            break
        names = replica_actors(app)
        if names:
            ray.kill(ray.get_actor(rng.choice(names), namespace="serve"), no_restart=True)
            kills += 1
    # Keep the traffic going until enough requests have finished to judge (slow machines).
    end = time.monotonic() + 120
    while len(outcomes) < 12 and time.monotonic() < end:
        time.sleep(0.5)
    load.finish()
    elapsed = time.monotonic() - t0

    ok = [b for s, b in outcomes if s == 200]
    failed = [(s, b) for s, b in outcomes if s != 200]
    retried = [b for b in ok if b["attempts"] > 1]
    print(f"\nreplica kills: {kills} in {elapsed:.0f}s; {len(outcomes)} requests, {len(ok)} ok "
          f"({len(retried)} after a retry), {len(failed)} clear errors")  # fmt: skip
    for s, b in failed:
        assert s == 503 and b["error"]["request_id"], (s, b)
    assert len(ok) >= 0.8 * len(outcomes) and len(outcomes) >= 12
    assert retried, "no request was caught by a kill: the test did not test retries"
    # Replacements come up and take traffic.
    wait_for(lambda: len(status(client, prefix)["replicas"]) == 2, 90)
    assert client.post(f"{prefix}/v1/images/generations", json={"prompt": "after"}).status_code == 200
    jobs_survive(app, prefix, client)


def jobs_survive(app: str, prefix: str, client) -> None:
    """Asynchronous jobs: kill the replica under one and the ingress under another; both end
    done with the image their seed makes (a resumed job re-runs its stored request)."""
    body = {"prompt": f"durable {SLOW_MARKER}", "seed": 21, "num_inference_steps": 20}
    ref = pixels(base64.b64decode(client.post(f"{prefix}{GEN}", json=body).json()["data"][0]["b64_json"]))
    t0 = time.monotonic()

    def get(path):
        try:
            r = client.get(f"{prefix}{path}")
        except httpx.HTTPError:
            return None
        return r.json() if r.status_code == 200 else None

    def actor(kind, unique_id=""):
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
        name = next(
            n for n in names if n.startswith(f"SERVE_REPLICA::{app}#{kind}#") and n.endswith(unique_id)
        )
        return ray.get_actor(name, "serve")

    def running(job_id):
        return (get(f"/v1/jobs/{job_id}") or {}).get("step", 0) >= 2

    def ended(job_id):
        return (j := get(f"/v1/jobs/{job_id}")) and j["state"] in ("done", "failed", "aborted") and j

    def submit():
        r = client.post(f"{prefix}{GEN}", json=body, headers={"Prefer": "respond-async"})
        assert r.status_code == 202, r.text
        return r.json()["id"]

    # The replica running a job dies: the ingress runs it again on the other replica.
    a = submit()
    wait_for(lambda: running(a), 60)
    holder = get(f"/v1/requests/{get(f'/v1/jobs/{a}')['request_id']}")["replica_id"]
    ray.kill(actor("DiffusionReplica", holder), no_restart=False)
    wait_for(lambda: ended(a), 120, 0.2)
    # The ingress dies under a running job: when its lease runs out, the ingress Serve starts
    # in its place takes the job over.
    b = submit()
    wait_for(lambda: running(b), 60)
    ray.kill(actor("DiffusionIngress"), no_restart=False)
    for job_id in (a, b):
        done = wait_for(lambda jid=job_id: ended(jid), 180, 0.5)
        assert done["state"] == "done" and done["attempts"] >= 2, (job_id == a, done["error"])
        image = pixels(client.get(f"{prefix}/v1/jobs/{job_id}/content/0").content)
        # A resumed job may share a pipeline call with its lost attempt, still running on the
        # replica, and rows of a batch may differ by a rounding step or two.
        assert np.abs(image - ref).max() <= 3, job_id == a
    print(f"jobs: both done after a replica kill and an ingress kill, {time.monotonic() - t0:.0f}s")


def pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)


@pytest.fixture(scope="module")
def overload_app(ray_cluster):
    """One running and one waiting request admitted; the rest refused with the configured
    Retry-After (7 s, not the default)."""
    with deployed(
        "bp", replica={"max_ongoing_requests": 1, "max_queued_requests": 1}, ingress={"retry_after_s": 7}
    ) as prefix:
        yield prefix


def test_overload_gets_429_with_retry_after_and_memory_stays_bounded(overload_app, base_url, client):
    prefix = overload_app
    rss0 = status(client, prefix)["replicas"][0]["rss_mb"]
    body = {"prompt": "load", "size": "64x64", "num_inference_steps": 6}
    with httpx.Client(base_url=base_url, timeout=120, limits=httpx.Limits(max_connections=64)) as http:
        with cf.ThreadPoolExecutor(40) as pool:  # 20x what the app admits (1 running + 1 queued)
            rs = list(pool.map(lambda i: http.post(f"{prefix}/v1/images/generations", json=body), range(40)))
    codes = sorted(r.status_code for r in rs)
    assert set(codes) <= {200, 429}, codes
    # At least the one that runs is served (the one queued behind it was refused too in one CI
    # run of 10, on a loaded machine: the burst outlasted the router's queue); most get 429.
    assert codes.count(429) >= 10 and codes.count(200) >= 1, codes
    for r in rs:
        if r.status_code == 429:
            assert r.headers["Retry-After"] == "7" and r.json()["error"]["type"] == "overloaded"
    # Overload on a stream: an error event with the same body, not a broken connection.
    with httpx.Client(base_url=base_url, timeout=120, limits=httpx.Limits(max_connections=64)) as http:

        def stream(i):
            with http.stream("POST", f"{prefix}/v1/images/generations", json={**body, "stream": True}) as r:
                return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]

        with cf.ThreadPoolExecutor(20) as pool:
            streams = list(pool.map(stream, range(20)))
    ends = [json.loads(ev[-2]) for ev in streams]
    assert {e["type"] for e in ends} <= {"result", "error"} and all(ev[-1] == "[DONE]" for ev in streams)
    overloaded = [e for e in ends if e["type"] == "error"]
    assert overloaded and all(
        e["error"]["type"] == "overloaded" and e["error"]["code"] == 429 for e in overloaded
    )
    rss1 = status(client, prefix)["replicas"][0]["rss_mb"]
    n_ok, n_429 = codes.count(200), codes.count(429)
    print(f"\noverload: {n_ok} ok, {n_429} x 429; replica RSS {rss0:.0f} -> {rss1:.0f} MB")
    assert rss1 - rss0 < 300


def test_queue_length_autoscaling_up_and_down(app_factory, base_url, client):
    app = "auto"
    prefix = app_factory(
        app,
        replica={
            "autoscaling": {
                "min_replicas": 1,
                "max_replicas": 3,
                "target_queue_length": 2,
                "upscale_delay_s": 1,
                "downscale_delay_s": 2,
                "metrics_interval_s": 0.5,
                "look_back_period_s": 2,
            },
        },  # fmt: skip
    )
    assert len(replica_actors(app)) == 1
    t0 = time.monotonic()
    load = Load(  # 8 waiting clients: a queue of 8 against a target of 2 per replica
        f"{base_url}{prefix}/v1/images/generations",
        lambda c, i: {"prompt": "burst", "size": "64x64", "num_inference_steps": 10, "seed": c * 1000 + i},
        clients=8,
    )
    wait_for(lambda: len(replica_actors(app)) >= 2, 60)
    up = time.monotonic() - t0
    n_up = len(load.outcomes)
    wait_for(lambda: len(load.outcomes) >= n_up + 8, 120)  # served by the larger set too
    results = [s for s, _ in load.finish()]
    assert results and all(c == 200 for c in results), results
    reps = len(status(client, prefix)["replicas"])
    t1 = time.monotonic()
    wait_for(lambda: len(replica_actors(app)) == 1, 90, interval=1)
    down = time.monotonic() - t1
    print(f"\nautoscaling: >=2 replicas {up:.1f}s into the burst ({reps} serving at its end), back to 1 "
          f"{down:.1f}s after it; {len(results)} burst requests all 200")  # fmt: skip


def test_redeploy_lets_accepted_requests_finish(app_factory, base_url, client):
    prefix = app_factory("drain", replica={"graceful_shutdown_timeout_s": 60})
    before = status(client, prefix)["replicas"][0]["replica_id"]
    long_body = {"prompt": "long", "size": "128x128", "num_inference_steps": 10}
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(
            lambda: httpx.post(f"{base_url}{prefix}/v1/images/generations", json=long_body, timeout=180)
        )
        wait_for(lambda: status(client, prefix)["replicas"][0]["running_requests"] == 1, 30)
        deploy(
            "drain", app_args(model={"seed": 1}, replica={"graceful_shutdown_timeout_s": 60})
        )  # new weights
        r = fut.result(180)
    assert r.status_code == 200, r.text
    assert status(client, prefix)["replicas"][0]["replica_id"] != before


def test_deadline_gives_504_and_stops_the_work(app_factory, client):
    prefix = app_factory("deadline", ingress={"request_timeout_s": 1.5})
    t = time.monotonic()
    body = {"prompt": "slow", "size": "128x128", "num_inference_steps": 40, "request_id": "late"}
    r = client.post(f"{prefix}/v1/images/generations", json=body)
    assert r.status_code == 504 and time.monotonic() - t < 10
    err = r.json()["error"]
    assert err["type"] == "timeout" and err["request_id"] == "late" and "1.5s" in err["message"]

    def aborted():
        s = client.get(f"{prefix}/v1/requests/late").json()
        return s if s["state"] == "aborted" else None

    st = wait_for(aborted, 30)
    assert st["step"] < 40
    # The same deadline on a stream arrives as an error event, then the end of the stream.
    with client.stream(
        "POST", f"{prefix}/v1/images/generations", json={**body, "request_id": "late-stream", "stream": True}
    ) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    err = json.loads(events[-2])
    assert err["type"] == "error" and err["error"]["type"] == "timeout" and events[-1] == "[DONE]"


def test_overload_on_the_handle_raises_overloaded(overload_app, client):
    from serve_app.errors import Overloaded
    from serve_app.schemas import GenerationRequest

    handle = serve.get_app_handle("bp")
    reqs = [handle.generate.remote(GenerationRequest(prompt="x", width=64, height=64, num_inference_steps=6))
            for _ in range(12)]  # fmt: skip
    outcomes = []
    for r in reqs:
        try:
            r.result()
            outcomes.append("ok")
        except Overloaded as e:
            assert e.status_code == 429 and e.retry_after_s == 7  # the configured value, across Ray
            outcomes.append("overloaded")
    assert "overloaded" in outcomes and "ok" in outcomes, outcomes
