"""Tenants: the replica's weighted fair queue (pure policy, then on the real engine), each quota's
429 over HTTP with its headers, jobs that wait for their tenant's room, per-tenant status seen
by the admin and by a user key, and the config and handle inputs refused."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import copy

import httpx
import pytest
from pydantic import ValidationError
from ray import serve

from serve_app.config import AppConfig, BatchingConfig, TenantConfig
from serve_app.errors import InvalidRequest, QuotaExceeded
from serve_app.ingress.tenants import Tenants
from serve_app.replica.scheduler import Job, Scheduler
from serve_app.schemas import PreparedRequest
from serve_app.testing import SLOW_MARKER
from tests.conftest import TEST_ARGS, deploy, wait_for

# ---------------------------------------------------------------- the fair queue (pure policy)


def job(i: int, tenant: str, weight: float = 1.0, images: int = 1) -> Job:
    loop = asyncio.new_event_loop()
    fut = loop.create_future()
    loop.close()
    return Job(f"r{i}", [None] * images, "k", 4, fut, tenant=tenant, weight=weight, cost=float(images))


def dispatch_order(jobs: list[Job], take: int, batch: int = 1) -> list[str]:
    """The tenants of the first `take` jobs the scheduler starts, `batch` images per call."""
    s = Scheduler(BatchingConfig(max_batch_images=batch, batch_wait_ms=0))
    for j in jobs:
        s.submit(j)
    out = []
    while len(out) < take and s.queue:
        for j in asyncio.run(s.next_batch()):
            out.append(j.tenant)
        s.call_ended(s.running)
    return out[:take]


def test_a_deep_backlog_does_not_starve_a_lone_request():
    flood = [job(i, "a") for i in range(40)]
    order = dispatch_order([*flood, job(99, "b")], 3)
    assert "b" in order[:2], order  # FIFO would have started it 41st


def test_weights_three_to_one_give_three_to_one_while_both_are_backlogged():
    jobs = [job(i, "heavy", 3.0) for i in range(40)] + [job(100 + i, "light", 1.0) for i in range(40)]
    for batch in (1, 4):
        counts = collections.Counter(dispatch_order(jobs_copy(jobs), 40, batch))
        assert 28 <= counts["heavy"] <= 32 and counts["heavy"] + counts["light"] == 40, counts


def jobs_copy(jobs: list[Job]) -> list[Job]:
    return [job(k, j.tenant, j.weight) for k, j in enumerate(jobs)]


def test_aborted_jobs_are_not_charged_and_an_idle_replica_forgets_old_debts():
    s = Scheduler(BatchingConfig(max_batch_images=1, batch_wait_ms=0))
    flood = [job(i, "a") for i in range(50)]
    for j in flood:
        s.submit(j)
    for j in flood:
        s.abort_job(j, "aborted")
    for j in [*(job(100 + i, "b") for i in range(30)), job(200, "a")]:
        s.submit(j)
    first = [asyncio.run(s.next_batch())[0].tenant for _ in range(3)]
    assert "a" in first, first  # charged for the 50 it never ran, it would start 31st

    s = Scheduler(BatchingConfig(max_batch_images=1, batch_wait_ms=0))
    s.submit(job(0, "a", images=40))
    (big,) = asyncio.run(s.next_batch())
    s.retire(big, "done")
    s.call_ended([big])  # drained: the replica is idle
    for i in range(10):
        s.submit(job(10 + i, "a"))
        s.submit(job(30 + i, "b"))
    order = [asyncio.run(s.next_batch())[0].tenant for _ in range(4)]
    assert order.count("a") == 2, order  # not all of b's first: a's old job is paid for


def test_one_tenant_alone_is_served_in_arrival_order_and_costs_count():
    assert [j for j in dispatch_order([job(i, "a") for i in range(5)], 5)] == ["a"] * 5
    big = [job(i, "big", images=4) for i in range(5)]
    small = [job(10 + i, "small") for i in range(20)]
    counts = collections.Counter(dispatch_order([*big, *small], 8))
    assert counts["small"] >= 5, counts  # a 4-image job costs four 1-image jobs


# ---------------------------------------------------------------- config and the ingress's quotas (pure)


@pytest.mark.parametrize(
    "tenants, field",
    [
        ([{"name": "a", "api_keys": ["k"]}, {"name": "b", "api_keys": ["k"]}], "tenants[1].api_keys"),
        ([{"name": "a"}, {"name": "a"}], "tenants[1].name"),
        ([{"name": "a", "weight": -1}], "weight"),
        ([{"name": "a", "weight": 1e9}], "weight"),
        ([{"name": "a", "max_concurrent": 0}], "max_concurrent"),
        ([{"name": "a", "images_per_minute": -5}], "images_per_minute"),
        ([{"name": "a", "max_queued": 10**9}], "max_queued"),
        ([{"name": "../x"}], "name"),
    ],
)
def test_bad_tenant_configs_are_refused_at_start_naming_the_field(tenants, field):
    with pytest.raises(ValidationError) as e:
        AppConfig.from_args({"tenants": tenants})
    text = str(e.value)
    assert field.split(".")[-1] in text and "'k'" not in text, text


def prepared(tenant: str, images: int = 1, steps: int = 4) -> PreparedRequest:
    return PreparedRequest(request_id="r", prompts=["x"], negative_prompt=None, height=32, width=32,
                           num_inference_steps=steps, guidance_scale=1.0, seed=1, num_images=images,
                           output_format="png", tenant=tenant)  # fmt: skip


def test_each_quota_refuses_with_its_name_and_headers_and_jobs_wait_instead():
    tenants = Tenants(
        [TenantConfig(name="c", max_concurrent=1), TenantConfig(name="r", images_per_minute=2),
         TenantConfig(name="s", image_steps_per_minute=10)],
        lambda k: "0" * 32, 3,
    )  # fmt: skip

    async def scenario():
        async with tenants.admit(prepared("c")):
            with pytest.raises(QuotaExceeded) as e:
                async with tenants.admit(prepared("c")):
                    pass
            assert e.value.param == "max_concurrent" and e.value.retry_after_s == 3
            assert e.value.to_body()["error"]["code"] == "quota_exceeded"
            waiter = asyncio.ensure_future(_enter(tenants, prepared("c"), wait=True))
            await asyncio.sleep(0.05)
            assert not waiter.done()  # a job waits for the place instead of failing
        await asyncio.wait_for(waiter, 2)
        async with tenants.admit(prepared("r", images=2)):
            pass
        with pytest.raises(QuotaExceeded) as e:
            async with tenants.admit(prepared("r")):
                pass
        headers = e.value.headers()
        assert e.value.param == "images_per_minute" and headers["x-ratelimit-limit-images"] == "2"
        assert headers["x-ratelimit-remaining-images"] == "0" and int(headers["Retry-After"]) >= 1
        with pytest.raises(InvalidRequest, match="more than a minute's") as e:  # never, so no 429
            async with tenants.admit(prepared("s", images=1, steps=20)):
                pass
        assert e.value.param == "image_steps_per_minute"
        with pytest.raises(InvalidRequest):
            await tenants.wait_for_room(prepared("s", images=1, steps=20))  # a job fails, never waits
        with pytest.raises(InvalidRequest) as e:
            tenants.named("nobody")
        assert e.value.param == "tenant"

    asyncio.run(scenario())


async def _enter(tenants, request, wait):
    async with tenants.admit(request, wait=wait):
        return True


# ---------------------------------------------------------------- over HTTP and the handle

KEY_A, KEY_B, KEY_Q, ADMIN = "tenant-a-key-1", "tenant-b-key-2", "tenant-q-key-3", "tenant-admin-9"
KEY_N = "tenant-n-key-4"
KEY_P = "tenant-p-key-5"
APP = "tenants"
P = f"/{APP}"
GEN = f"{P}/v1/images/generations"


@pytest.fixture(scope="module")
def tenants_app(ray_cluster):
    args = copy.deepcopy(TEST_ARGS)
    args["auth"] = {"admin_keys": [ADMIN]}
    args["batching"] = {"max_batch_images": 4, "batch_wait_ms": 30, "batch_gap_ms": 0}
    # Room at the replica for every request of the weights test at once: its fair queue orders
    # only what has reached it (Serve holds the rest back in arrival order).
    args["replica"] = {**args["replica"], "max_ongoing_requests": 64}
    args["tenants"] = [
        {"name": "team-a", "api_keys": [KEY_A], "max_concurrent": 2},
        {"name": "team-b", "api_keys": [KEY_B], "images_per_minute": 2},
        {"name": "team-q", "api_keys": [KEY_Q], "max_queued": 0},
        {"name": "team-n", "api_keys": [KEY_N], "images_per_minute": 3},
        {"name": "team-p", "api_keys": [KEY_P], "max_priority": "batch"},
        {"name": "heavy", "weight": 3},
        {"name": "light", "weight": 1},
    ]
    prefix = deploy(APP, args)
    yield prefix
    serve.delete(APP, _blocking=False)


def call(base_url: str, key: str, **body):
    body = {"prompt": "a red circle", **body}
    return httpx.post(base_url + GEN, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def status(base_url: str, key: str) -> dict:
    auth = {"Authorization": f"Bearer {key}"}
    return httpx.get(f"{base_url}{P}/v1/status", headers=auth, timeout=30).json()


@pytest.mark.slow
def test_quotas_over_http_are_429s_that_never_count_against_the_replica(tenants_app, base_url):
    before = status(base_url, ADMIN)["replicas"][0]

    def in_flight() -> int:
        return next(
            (t["in_flight"] for t in status(base_url, ADMIN)["tenants"] if t["tenant"] == "team-a"), 0
        )

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        slow = [pool.submit(call, base_url, KEY_A, prompt=f"{SLOW_MARKER} {i}", num_inference_steps=20)
                for i in range(2)]  # fmt: skip
        wait_for(lambda: in_flight() == 2, 60, 0.05)
        refused = call(base_url, KEY_A)
        streamed = call(base_url, KEY_A, stream=True)  # refused before a stream opens: a real 429
        answers = [f.result() for f in slow]
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
    for r in (refused, streamed):
        assert r.status_code == 429 and r.headers["content-type"].startswith("application/json"), r.text
        err = r.json()["error"]
        assert (
            err["code"] == "quota_exceeded"
            and err["param"] == "max_concurrent"
            and "team-a" in err["message"]
        )
        assert r.headers["Retry-After"] and r.headers["x-ratelimit-remaining-requests"] == "0"
    assert in_flight() == 0  # every place given back, the refused stream's too

    assert call(base_url, KEY_B, n=2).status_code == 200
    rate = call(base_url, KEY_B)
    assert rate.status_code == 429 and rate.json()["error"]["param"] == "images_per_minute", rate.text
    assert rate.headers["x-ratelimit-limit-images"] == "2" and int(rate.headers["Retry-After"]) >= 1

    job = httpx.post(base_url + GEN, json={"prompt": "x"}, timeout=60,
                     headers={"Authorization": f"Bearer {KEY_Q}", "Prefer": "respond-async"})  # fmt: skip
    assert job.status_code == 429 and job.json()["error"]["param"] == "max_queued", job.text

    after = status(base_url, ADMIN)["replicas"][0]
    assert after["replica_id"] == before["replica_id"] and after["healthy"]
    assert after["engine_failures_in_a_row"] == 0
    assert after["counts"].get("failed", 0) == before["counts"].get("failed", 0)
    seen = {t["tenant"]: t for t in status(base_url, ADMIN)["tenants"]}
    assert seen["team-a"]["rejected"] == {"max_concurrent": 2} and seen["team-a"]["images_done"] >= 2
    assert seen["team-b"]["rejected"] == {"images_per_minute": 1}
    mine = status(base_url, KEY_A)
    assert [t["tenant"] for t in mine["tenants"]] == ["team-a"]  # a user key sees its own tenant only
    assert all(set(r["tenants"]) <= {"team-a"} for r in mine["replicas"])


@pytest.mark.slow
def test_a_request_that_cannot_fit_its_quota_is_refused_before_any_work(tenants_app, base_url):
    """Issue 60: A1111's `n_iter` is judged as a whole before its first iteration runs, and a job
    that could never fit is a 400 at once, as the same request without `Prefer` is."""
    auth = {"Authorization": f"Bearer {KEY_N}"}

    def accepted() -> int:
        return status(base_url, ADMIN)["replicas"][0]["counts"].get("accepted", 0)

    def a1111(**body) -> httpx.Response:
        body = {"prompt": "a red circle", "steps": 2, **body}
        return httpx.post(f"{base_url}{P}/sdapi/v1/txt2img", json=body, headers=auth, timeout=120)

    before = accepted()
    never = a1111(n_iter=2, batch_size=2)  # 4 images, the tenant's minute holds 3
    assert never.status_code == 400 and never.json()["error"]["param"] == "n_iter", never.text
    assert "n_iter 2 × batch_size 2" in never.json()["error"]["message"]
    for prefer in ({}, {"Prefer": "respond-async"}):
        r = httpx.post(base_url + GEN, json={"prompt": "x", "n": 4}, headers={**auth, **prefer}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "images_per_minute", (prefer, r.text)
    ran = a1111(n_iter=3)  # the whole minute, taken before the first iteration runs
    assert ran.status_code == 200 and len(ran.json()["images"]) == 3, ran.text[:300]
    again = a1111(n_iter=3)  # refused whole: no iteration runs and is thrown away
    assert again.status_code == 429 and again.json()["error"]["param"] == "images_per_minute", again.text
    assert int(again.headers["Retry-After"]) >= 1
    assert accepted() == before + 3  # only the three iterations that were answered


@pytest.mark.slow
def test_handle_callers_name_a_tenant_and_weights_share_the_replica(tenants_app, base_url):
    handle = serve.get_app_handle(APP)
    with pytest.raises(InvalidRequest) as e:
        handle.generate.remote({"prompt": "x", "tenant": "nobody"}).result()
    assert e.value.param == "tenant"

    done: list[str] = []

    def one(tenant: str, i: int) -> None:
        handle.generate.remote({"prompt": f"shape {i}", "seed": i, "tenant": tenant}).result()
        done.append(tenant)

    def on_replica(where: str, *tenants: str) -> dict[str, int]:
        seen = status(base_url, ADMIN)["replicas"][0]["tenants"]
        return {t: seen.get(t, {}).get(f"{where}_requests", 0) for t in tenants}

    # A slow call of another tenant holds the replica while all 32 queue, so that the fair queue,
    # not the order in which 32 threads happen to reach it, decides who goes first.
    blocker = handle.generate.remote(
        {"prompt": f"{SLOW_MARKER} hold", "num_inference_steps": 50, "tenant": "team-a"}
    )
    wait_for(lambda: on_replica("running", "team-a") == {"team-a": 1}, 60, 0.05)
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        futures = [pool.submit(one, t, i) for i in range(16) for t in ("heavy", "light")]
        wait_for(lambda: on_replica("queued", "heavy", "light") == {"heavy": 16, "light": 16}, 30, 0.1)
        blocker.result()
        for f in futures:
            f.result()
    first = collections.Counter(done[:16])
    assert first["heavy"] >= 11, (first, done)  # 12 of 16 at weights 3:1, 4 a call; FIFO gives 8
    seen = {t["tenant"]: t for t in status(base_url, ADMIN)["tenants"]}
    assert seen["heavy"]["images_done"] == 16 and seen["light"]["images_done"] == 16

    import ray

    port = ray._private.worker.global_worker.node.metrics_export_port
    names = ["ray_diffusion_tenant_images_total", "ray_diffusion_tenant_queue_wait_ms",
             "ray_diffusion_tenant_requests", "ray_diffusion_tenant_quota_rejected_total"]  # fmt: skip

    def exported():
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        return all(n in text for n in names) and 'tenant="heavy"' in text

    wait_for(exported, 90, 2)


def test_on_a_service_without_keys_a_made_up_key_is_no_tenant_of_its_own(client):
    r = client.post(
        "/v1/images/generations", json={"prompt": "x"}, headers={"Authorization": "Bearer made-up"}
    )
    assert r.status_code == 200, r.text
    names = [t["tenant"] for t in client.get("/v1/status").json()["tenants"]]
    assert "default" in names and not any(n.startswith("key-") for n in names), names


@pytest.mark.slow
def test_a_tenant_cannot_raise_its_priority_past_its_maximum(tenants_app, base_url):
    """Issue 58: `priority` above the tenant's `max_priority` is a 400 naming it; the default
    (interactive) is lowered to the maximum, not refused; a handle caller is held to it too."""
    before = status(base_url, ADMIN)["replicas"][0]["replica_id"]
    for _ in range(3):  # again and again: the replica never sees them
        for key, priority in ((KEY_P, "interactive"), (KEY_P, 1), (KEY_A, 9)):
            r = call(base_url, key, priority=priority)
            assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
            assert "max_priority" in r.json()["error"]["message"]
        for odd in ("urgent", -1, 10, True, "5", 2.5, [5]):
            bad = call(base_url, KEY_A, priority=odd)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority", (odd, bad.text)
    for key, body in ((KEY_P, {}), (KEY_P, {"priority": "batch"}), (KEY_A, {"priority": "interactive"})):
        r = call(base_url, key, num_inference_steps=2, **body)
        assert r.status_code == 200, r.text
    handle = serve.get_app_handle(APP)
    with pytest.raises(InvalidRequest) as e:
        handle.generate.remote({"prompt": "x", "tenant": "team-p", "priority": 3}).result()
    assert e.value.param == "priority"
    after = status(base_url, ADMIN)["replicas"][0]
    assert after["replica_id"] == before and after["healthy"]
