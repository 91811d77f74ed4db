"""Faults and scale on a real Serve cluster: health, replica death, backpressure, autoscaling, drain.

Each test deploys its own small app beside the shared one (own name and route prefix) and
deletes it when done. The figures they print (retries, recovery time, scale-up time) are the
ones the closing notes report.
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import random
import threading
import time

import httpx
import pytest
import ray
from ray import serve

from serve_app.app import build_app
from serve_app.testing import FATAL_MARKER
from tests.conftest import TEST_ARGS, wait_for

pytestmark = pytest.mark.slow


def deploy(name: str, **overrides) -> str:
    args = copy.deepcopy(TEST_ARGS)
    for section, values in overrides.items():
        args[section] = {**args.get(section, {}), **values}
    serve.run(build_app(args), name=name, route_prefix=f"/{name}")
    return f"/{name}"


@pytest.fixture
def app_factory(ray_cluster):
    names = []

    def make(name, **overrides):
        names.append(name)
        return deploy(name, **overrides)

    yield make
    for n in names:
        serve.delete(n)


def status(client, prefix) -> dict:
    return client.get(f"{prefix}/v1/status").json()


def replica_actors(app: str) -> list[str]:
    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(f"SERVE_REPLICA::{app}#DiffusionReplica#")
    ]


def test_fatal_device_error_gets_the_replica_replaced(app_factory, client):
    prefix = app_factory("fatal", replica={"health_check_period_s": 1, "health_check_timeout_s": 5})
    before = status(client, prefix)["replicas"][0]["replica_id"]
    r = client.post(f"{prefix}/v1/images/generations", json={"prompt": FATAL_MARKER})
    assert r.status_code == 500 and "illegal memory access" in r.json()["error"]["message"]
    t = time.monotonic()

    def replaced():
        try:
            reps = status(client, prefix)["replicas"]
        except Exception:
            return False
        return reps and reps[0]["replica_id"] != before and reps[0]["healthy"]

    wait_for(replaced, 90)
    print(f"\nfatal device error: replacement replica healthy after {time.monotonic() - t:.1f}s")
    assert client.post(f"{prefix}/v1/images/generations", json={"prompt": "after"}).status_code == 200


def test_a_per_request_error_does_not_fail_health(client, base_url):
    from serve_app.testing import FAIL_MARKER, OOM_MARKER

    for marker in (FAIL_MARKER, OOM_MARKER):
        client.post("/v1/images/generations", json={"prompt": marker})
    rep = client.get("/v1/status").json()["replicas"][0]
    assert rep["healthy"] and rep["health_problem"] is None


def test_killed_replicas_lose_no_request(app_factory, client, base_url):
    app = "kill"
    prefix = app_factory(
        app,
        replica={"num_replicas": 2, "health_check_period_s": 1},
        ingress={"max_attempts": 4},
        batching={"batch_wait_ms": 5},
    )
    wait_for(lambda: len(replica_actors(app)) == 2, 60)
    outcomes: list[tuple[int, dict]] = []
    stop = threading.Event()

    def clients(c: int) -> None:
        with httpx.Client(base_url=base_url, timeout=90) as http:
            i = 0
            while not stop.is_set():
                body = {
                    "prompt": f"steady {c}",
                    "seed": c * 10_000 + i,
                    "size": "64x64",
                    "num_inference_steps": 8,
                }
                r = http.post(f"{prefix}/v1/images/generations", json=body)
                outcomes.append((r.status_code, r.json()))
                i += 1

    threads = [threading.Thread(target=clients, args=(c,), daemon=True) for c in range(4)]
    for t in threads:
        t.start()
    kills = 0
    rng = random.Random(0)
    t0 = time.monotonic()
    for _ in range(3):
        time.sleep(4)
        names = replica_actors(app)
        if names:
            ray.kill(ray.get_actor(rng.choice(names), namespace="serve"), no_restart=True)
            kills += 1
    # Keep the traffic going until enough requests have finished to judge (slow machines).
    end = time.monotonic() + 120
    while len(outcomes) < 12 and time.monotonic() < end:
        time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a client is still waiting: a request hung"
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


def test_overload_gets_429_with_retry_after_and_memory_stays_bounded(app_factory, base_url, client):
    prefix = app_factory("bp", replica={"max_ongoing_requests": 2, "max_queued_requests": 2})
    rss0 = status(client, prefix)["replicas"][0]["rss_mb"]
    body = {"prompt": "load", "size": "64x64", "num_inference_steps": 6}
    with httpx.Client(base_url=base_url, timeout=120, limits=httpx.Limits(max_connections=64)) as http:
        with cf.ThreadPoolExecutor(40) as pool:  # 10x what the app admits (2 running + 2 queued)
            rs = list(pool.map(lambda i: http.post(f"{prefix}/v1/images/generations", json=body), range(40)))
    codes = sorted(r.status_code for r in rs)
    assert set(codes) <= {200, 429}, codes
    assert codes.count(429) >= 10 and codes.count(200) >= 4, codes
    for r in rs:
        if r.status_code == 429:
            assert r.headers["Retry-After"] == "2" and r.json()["error"]["type"] == "overloaded"
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
                "downscale_delay_s": 5,
                "metrics_interval_s": 0.5,
                "look_back_period_s": 2,
            },
        },  # fmt: skip
    )
    assert len(replica_actors(app)) == 1
    body = {"prompt": "burst", "size": "64x64", "num_inference_steps": 10}
    results: list[int] = []
    t0 = time.monotonic()

    def burst():
        with httpx.Client(base_url=base_url, timeout=180) as http, cf.ThreadPoolExecutor(12) as pool:
            post = lambda i: http.post(f"{prefix}/v1/images/generations", json={**body, "seed": i})  # noqa: E731
            for _ in range(3):
                results.extend(r.status_code for r in pool.map(post, range(12)))

    t = threading.Thread(target=burst)
    t.start()
    wait_for(lambda: len(replica_actors(app)) >= 2, 60)
    up = time.monotonic() - t0
    t.join(300)
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
            "drain", model={"seed": 1}, replica={"graceful_shutdown_timeout_s": 60}
        )  # new weights: new replica
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


def test_overload_on_the_handle_raises_overloaded(app_factory, client):
    from serve_app.errors import Overloaded
    from serve_app.schemas import GenerationRequest

    app_factory("bph", replica={"max_ongoing_requests": 1, "max_queued_requests": 1})
    handle = serve.get_app_handle("bph")
    reqs = [handle.generate.remote(GenerationRequest(prompt="x", width=64, height=64, num_inference_steps=6))
            for _ in range(12)]  # fmt: skip
    outcomes = []
    for r in reqs:
        try:
            r.result()
            outcomes.append("ok")
        except Overloaded as e:
            assert e.status_code == 429
            outcomes.append("overloaded")
    assert "overloaded" in outcomes and "ok" in outcomes, outcomes
