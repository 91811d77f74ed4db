"""The batching policy on a GPU-shaped engine (issue 53): counted in calls and rows, not timed.

The app runs the embedded model with `serve_app.testing:GpuShaped` (each denoiser call sleeps
`step_ms + row_ms * rows`, as a GPU's costs little more for a fuller call) with step-level
joining on, as it is by default on a GPU: a burst sent over HTTP shares one call, a lone
request starts at once, and the engine thread steps a joined run without waiting for the event
loop. benchmarks/bench_batching.py measures the same policy in ratios.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time

import httpx
import pytest

from serve_app.config import BatchingConfig
from serve_app.replica import DiffusionReplica
from serve_app.replica.scheduler import Job, Scheduler
from serve_app.schemas import GenerationRequest, PreparedRequest
from tests.conftest import deployed

SHAPED = {"engine_extension": "serve_app.testing:GpuShaped", "default_steps": 12, "warmup_steps": 1}


@pytest.fixture(scope="module")
def shaped(ray_cluster):
    # A lone request that waited for company would wait the whole 3 s window (no early start).
    # Step joining as on a GPU, where it is the default (the engine runs on the CPU here).
    batching = {"max_batch_images": 8, "batch_wait_ms": 3000, "batch_gap_ms": 0, "step_joining": True}
    with deployed("gpu-shaped", model=SHAPED, batching=batching) as prefix:
        with httpx.Client(base_url=f"{ray_cluster}{prefix}", timeout=120) as c:
            assert c.post("/v1/rpc", json={"method": "set_gpu_shape", "args": [15, 1]}).status_code == 200
            yield c


def denoiser_calls(c: httpx.Client) -> list[int]:
    out = c.post("/v1/rpc", json={"method": "denoiser_calls", "kwargs": {"clear": True}}).json()
    return [n for r in out for n in r["result"]]


def test_a_burst_over_http_lands_in_one_call(shaped):
    denoiser_calls(shaped)

    async def burst() -> list[dict]:
        async with httpx.AsyncClient(base_url=shaped.base_url, timeout=120) as c:
            rs = await asyncio.gather(
                *(
                    c.post("/v1/images/generations", json={"prompt": f"a boat {k}", "seed": k})
                    for k in range(8)
                )
            )
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        return [r.json()["metrics"] for r in rs]

    metrics = asyncio.run(burst())
    assert {(m["batch_requests"], m["batch_images"]) for m in metrics} == {(8, 8)}
    rows = denoiser_calls(shaped)
    # One joined call: every denoiser call of the burst is one call of the run (the rows of 8
    # images with guidance at its fullest), never two calls side by side.
    assert max(rows) == 16
    assert sum(rows) == 8 * 2 * 12


def test_a_flood_never_makes_a_step_larger_than_max_batch_images(shaped):
    # 24 requests at once on max_batch_images 8: they join as rows leave, never past 8 images
    # (16 denoiser rows with guidance) in one step, however the hand-over races the steps.
    denoiser_calls(shaped)

    async def flood() -> list[dict]:
        async with httpx.AsyncClient(base_url=shaped.base_url, timeout=120) as c:
            rs = await asyncio.gather(
                *(
                    c.post(
                        "/v1/images/generations",
                        json={"prompt": f"a gull {k}", "seed": k, "num_inference_steps": 4 + k % 5},
                    )  # fmt: skip
                    for k in range(24)
                )
            )
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        return [r.json()["metrics"] for r in rs]

    metrics = asyncio.run(flood())
    assert max(m["batch_images"] for m in metrics) == 8
    rows = denoiser_calls(shaped)
    assert max(rows) == 16 and sum(rows) == 2 * sum(4 + k % 5 for k in range(24))


def test_a_lone_request_does_not_wait_for_company(shaped):
    r = shaped.post("/v1/images/generations", json={"prompt": "a lone boat"})
    assert r.status_code == 200
    m = r.json()["metrics"]
    assert m["batch_requests"] == 1
    assert m["queue_ms"] < 1500  # the window is 3000 ms: it did not wait for it
    assert denoiser_calls(shaped)[-12:] == [2] * 12


def test_step_joining_is_on_by_default_on_a_gpu_and_off_on_a_cpu():
    assert BatchingConfig().joins_on("cuda") and not BatchingConfig().joins_on("cpu")
    assert BatchingConfig(step_joining=True).joins_on("cpu")
    assert not BatchingConfig(step_joining=False).joins_on("cuda")


def test_a_joined_run_starts_at_once_and_a_whole_call_waits_its_window():
    loop = asyncio.new_event_loop()
    s = Scheduler(BatchingConfig(max_batch_images=4, batch_wait_ms=5000, batch_gap_ms=0))
    s.submit(Job("a", [object()], "k", 4, loop.create_future()))
    batch = loop.run_until_complete(asyncio.wait_for(s.next_batch(joins=lambda b: True), 2))
    assert [j.request_id for j in batch] == ["a"]
    s.call_ended(batch)
    s.submit(Job("b", [object()], "k", 4, loop.create_future()))
    with pytest.raises(TimeoutError):  # whole calls wait for company up to the window
        loop.run_until_complete(asyncio.wait_for(s.next_batch(joins=lambda b: False), 0.5))
    loop.close()


@contextlib.contextmanager
def direct_replica(extension: str):
    """A replica of tiny-sd at 32 px with `serve_app.testing:<extension>`, joining, in this
    process (no Ray), and an event loop to drive it; the replica's loop stopped after."""
    model = {"source": "builtin:tiny-sd", "device": "cpu", "default_height": 32, "default_width": 32,
             "warmup": False, "engine_extension": f"serve_app.testing:{extension}"}  # fmt: skip
    r = DiffusionReplica(model, {"max_batch_images": 4, "step_joining": True})
    loop = asyncio.new_event_loop()
    try:
        yield r, loop
    finally:
        r._loop_task.cancel()
        loop.run_until_complete(asyncio.gather(r._loop_task, return_exceptions=True))
        loop.close()


def prepared(rid: str, steps: int, prompt: str = "a boat", tenant: str = "default") -> PreparedRequest:
    return PreparedRequest.from_request(
        GenerationRequest(prompt=prompt, request_id=rid), request_id=rid, seed=1, height=32, width=32,
        steps=steps, guidance_scale=7.5, tenant=tenant,
    )  # fmt: skip


def test_the_engine_thread_steps_a_joined_run_while_the_event_loop_is_busy():
    # The replica's event loop held for half a second (a slow result to encode, say) must not
    # stop the device: the engine thread steps the joined run on, and the loop's work (answers,
    # joiners) waits instead. Counted in denoiser calls made while the loop was held.
    async def go(r) -> tuple[int, int]:
        task = asyncio.ensure_future(r.generate(prepared("held", 80)))
        while not r.engine.denoiser_rows:
            await asyncio.sleep(0.005)
        before = len(r.engine.denoiser_rows)
        time.sleep(0.5)  # the event loop is held: nothing of the replica's runs on it
        during = len(r.engine.denoiser_rows) - before
        out = await task
        return during, out.metrics.steps

    with direct_replica("GpuShaped") as (r, loop):
        r.engine.set_gpu_shape(10, 0)
        during, steps = loop.run_until_complete(go(r))
    assert steps == 80
    assert during >= 15, during  # about 40 at 10 ms a step; a step per loop turn made 1


def test_a_request_arriving_during_a_step_joins_at_the_next_one():
    # Handed to the engine thread as it arrives, not after the step in flight ends (by then the
    # engine thread has begun the step after, and the request would wait a whole step more).
    async def go(r) -> tuple[int, list[int]]:
        a = asyncio.ensure_future(r.generate(prepared("a", 4)))
        while len(r.engine.denoiser_rows) < 2:
            await asyncio.sleep(0.002)
        k = len(r.engine.denoiser_rows)  # the k-th call has just begun
        await r.generate(prepared("b", 2, "a dog"))
        await a
        return k, list(r.engine.denoiser_rows)

    with direct_replica("GpuShaped") as (r, loop):
        r.engine.set_gpu_shape(300, 0)
        k, rows = loop.run_until_complete(go(r))
    assert rows[:k] == [2] * k and rows[k] == 4, (k, rows)  # in the call right after


@pytest.mark.parametrize("ahead", [True, False])
def test_a_joiner_handed_over_mid_step_is_encoded_while_the_device_works(ahead):
    # Its prompt is encoded on the foresight thread during the step in flight (the engine
    # thread asleep in its denoiser call), not on the engine thread between two steps, and it
    # still joins at the next step; with `encode_ahead: false`, on the engine thread.
    where: list[str] = []

    async def go(r) -> tuple[int, list[int]]:
        hook = lambda *a: where.append(threading.current_thread().name)  # noqa: E731
        r.engine.pipe.text_encoder.register_forward_pre_hook(hook)
        a = asyncio.ensure_future(r.generate(prepared("a", 4)))
        while len(r.engine.denoiser_rows) < 2:
            await asyncio.sleep(0.002)
        k = len(r.engine.denoiser_rows)
        await r.generate(prepared("b", 2, "a dog"))
        await a
        return k, list(r.engine.denoiser_rows)

    with direct_replica("GpuShaped") as (r, loop):
        r.scheduler.batching = r.scheduler.batching.model_copy(update={"encode_ahead": ahead})
        r.engine.set_gpu_shape(300, 0)
        k, rows = loop.run_until_complete(go(r))
        seen = r.engine_loop.foresight.seen
    assert rows[:k] == [2] * k and rows[k] == 4, (k, rows)  # in the call right after
    # a's prompt and the empty negative prompt on the engine thread; b's ahead, and only there
    # (ahead, the empty negative prompt is encoded again: encoder calls are not looked up there)
    threads = [w.split("_")[0] for w in where]
    assert threads == (["engine", "engine", "foresee", "foresee"] if ahead else ["engine"] * 3), where
    assert seen == ahead


def test_injected_faults_reach_joined_calls_too():
    # FaultInjection's markers fail a joined seat as they fail a whole call: a GPU deployment,
    # which joins by default, can be tested for its faults the same way.
    from serve_app.errors import OutOfMemory

    with direct_replica("FaultInjection") as (r, loop):
        with pytest.raises(OutOfMemory):
            loop.run_until_complete(r.generate(prepared("oom", 2, "[[inject-oom]] a boat")))
        out = loop.run_until_complete(r.generate(prepared("fine", 2)))
        assert out.metrics.steps == 2 and r.stats().healthy


def test_a_joined_run_keeps_a_row_for_another_active_tenant():
    # Tenant a floods a replica of max_batch_images 4 with 8 long requests while tenant b is
    # active (it sent a request a moment ago): a's requests hold at most 3 rows of the run, so
    # b's next short request joins at the next step and is done before any of a's, instead of
    # waiting for a's first 4 to leave together. Counted in rows and completions, not timed.
    def request(tenant: str, rid: str, steps: int) -> PreparedRequest:
        return prepared(rid, steps, f"a boat {rid}", tenant)

    async def go(r) -> tuple[int, list[int]]:
        await r.generate(request("b", "b-first", 1))
        flood = [asyncio.ensure_future(r.generate(request("a", f"a{k}", 30))) for k in range(8)]
        while len(r.engine.denoiser_rows) < 3:
            await asyncio.sleep(0.005)
        rows_before_b = list(r.engine.denoiser_rows)
        await r.generate(request("b", "b-second", 4))
        a_done = sum(f.done() for f in flood)
        await asyncio.gather(*flood)
        return a_done, rows_before_b

    with direct_replica("GpuShaped") as (r, loop):
        r.engine.set_gpu_shape(5, 0)
        a_done, rows_before_b = loop.run_until_complete(go(r))
    assert max(rows_before_b[1:]) == 6  # a's 3 images with guidance, one image's rows kept
    assert a_done == 0


def test_the_row_kept_for_others_only_while_another_tenant_is_active():
    loop = asyncio.new_event_loop()

    def job(rid: str, tenant: str) -> Job:
        return Job(rid, [object()], "k", 4, loop.create_future(), join_key="k", tenant=tenant)

    for kept, other, share in ((1, False, 4), (1, True, 3), (0, True, 4), (9, True, 1)):
        s = Scheduler(BatchingConfig(max_batch_images=4, rows_kept_for_others=kept))
        if other:
            s.submit(job("b0", "b"))
            s.queue.clear()
        for k in range(6):
            s.submit(job(f"a{k}", "a"))
        assert s.share("a") == share
        assert len(s.gather(shared=True)) == share
        assert len(s.gather()) == 4  # a whole call is not held back: the next one is b's in fair order
    # A queued job of the tenant at its share is passed over; the other tenant's is taken.
    s = Scheduler(BatchingConfig(max_batch_images=4))
    for k in range(3):
        s.submit(job(f"a{k}", "a"))
    s.submit(job("b1", "b"))
    held = collections.Counter({"a": 3})
    taken = s.take_joiners("k", room=1, fits=lambda j: True, held=held)
    assert [j.request_id for j in taken] == ["b1"] and held == {"a": 3, "b": 1}
    loop.close()


def test_a_job_past_its_tenants_share_is_not_overtaken_for_ever():
    loop = asyncio.new_event_loop()

    def job(rid: str, tenant: str, rows: int = 1) -> Job:
        return Job(rid, [object()] * rows, "k", 4, loop.create_future(), join_key="k", tenant=tenant)

    s = Scheduler(BatchingConfig(max_batch_images=4))
    s.submit(job("b0", "b"))  # b is active: a's share of a joined call is 3 rows
    s.queue.clear()
    for j in (job("a-big", "a", 4), job("a1", "a"), job("b1", "b")):
        s.submit(j)
    # More rows than its tenant's share: nobody joins past it, so the call drains and it leads the next.
    assert s.take_joiners("k", room=4, fits=lambda j: True) == []
    assert [j.request_id for j in s.gather(shared=True)] == ["a-big"]
    # A tenant's job that does not fit its share now is not overtaken by the tenant's later ones.
    s.queue.clear()
    for j in (job("a2", "a", 2), job("a3", "a")):
        s.submit(j)
    assert s.take_joiners("k", room=2, fits=lambda j: True, held=collections.Counter({"a": 2})) == []
    loop.close()
