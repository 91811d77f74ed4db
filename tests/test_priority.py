"""Issue 58: priorities and preemption at a step boundary.

The queue's order is pure policy, tested on the scheduler alone. Preemption is tested on the
real tiny pipeline, driven directly as in `test_replica`: a batch call of many steps is paused
for an interactive request, which is answered within a step or two of the batch call's
progress, and the paused call's images equal those of the same call never paused, whether
the paused call or the one that ran inside it had an adapter in force.
"""

from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest
from PIL import Image

from serve_app.config import BatchingConfig
from serve_app.replica import DiffusionReplica
from serve_app.replica.scheduler import Job, Scheduler
from serve_app.schemas import GenerationRequest, LoraRef, PreparedRequest
from serve_app.testing import SLOW_MARKER

_LOOP = asyncio.new_event_loop()


def run(coro):
    return _LOOP.run_until_complete(coro)


# ------------------------------------------------------------------ the queue's order


def _job(loop, rid: str, priority: int, tenant: str = "t", key: str = "k") -> Job:
    future = loop.create_future()
    return Job(rid, rows=[rid], key=key, steps=4, future=future, tenant=tenant, priority=priority)


def test_an_interactive_request_overtakes_ten_queued_batch_jobs_and_rides_alone():
    async def go():
        loop = asyncio.get_running_loop()
        s = Scheduler(BatchingConfig(max_batch_images=8, batch_wait_ms=0))
        for i in range(10):
            s.submit(_job(loop, f"b{i}", 0, tenant=f"t{i % 2}"))
        s.submit(_job(loop, "i", 5, tenant="t1"))
        first = [j.request_id for j in await s.next_batch()]
        s.call_ended(s.running)
        second = [j.request_id for j in await s.next_batch()]
        return first, second

    first, second = asyncio.run(go())
    # Compatible with every batch job, yet its call holds none of them: a call is of one priority.
    assert first == ["i"]
    # Within a priority, the tenants' fair order (alternating) still holds.
    assert second == ["b0", "b1", "b2", "b3", "b4", "b5", "b6", "b7"]


def test_only_a_higher_priority_that_waited_its_budget_preempts():
    async def go():
        loop = asyncio.get_running_loop()
        s = Scheduler(BatchingConfig(max_batch_images=8, batch_wait_ms=0))
        s.submit(_job(loop, "running", 3))
        await s.next_batch()
        s.submit(_job(loop, "equal", 3))
        found = [s.preempting(0.0, lambda j: True)]  # equal priority: waits its turn
        s.submit(_job(loop, "high", 6))
        found.append(s.preempting(60.0, lambda j: True))  # not waited long enough
        found.append(s.preempting(0.0, lambda j: False))  # the engine cannot pause for it
        found.append(s.preempting(0.0, lambda j: True))
        found.append(s.preempting(0.0, lambda j: True))  # one at a time: it now runs, at 6
        return [[j.request_id for j in f] for f in found], [j.request_id for j in s.running]

    found, running = asyncio.run(go())
    assert found == [[], [], [], ["high"], []]
    assert running == ["running", "high"]


def test_a_job_that_starts_out_of_turn_moves_no_other_priority_s_fair_order():
    """Each priority keeps its own fair tags: a tenant's interactive job, run before its own
    backlog of batch jobs, leaves another tenant's next batch job second in line, as without it."""

    async def go():
        loop = asyncio.get_running_loop()
        s = Scheduler(BatchingConfig(max_batch_images=1, batch_wait_ms=0))
        for i in range(10):
            s.submit(_job(loop, f"h{i}", 0, tenant="heavy"))
        s.submit(_job(loop, "h-quick", 5, tenant="heavy"))
        ran = [j.request_id for j in await s.next_batch()]
        s.submit(_job(loop, "light", 0, tenant="light"))
        return ran, [j.request_id for j in s.queue].index("light")

    assert asyncio.run(go()) == (["h-quick"], 1)


# ------------------------------------------------------------------ preemption, real pipeline

STEPS = 16  # the batch call's steps, each 0.1 s slower (SLOW_MARKER): event-loop lag is small beside one
MODEL = {"source": "builtin:tiny-sd", "device": "cpu", "default_height": 64, "default_width": 64,
         "default_steps": 3, "warmup": False,
         "engine_extension": "serve_app.testing:FaultInjection"}  # fmt: skip


def _replica(**batching) -> DiffusionReplica:
    settings = {"max_batch_images": 8, "batch_wait_ms": 0, "preempt_after_ms": 0, **batching}
    return DiffusionReplica(MODEL, settings)


def _stop(r: DiffusionReplica) -> None:
    if r._loop_task is not None:
        r._loop_task.cancel()
        run(asyncio.gather(r._loop_task, return_exceptions=True))


@pytest.fixture(scope="module")
def replica():
    r = _replica()
    yield r
    _stop(r)


def _req(rid: str, priority: int, steps: int, seed: int, adapter=None, slow: bool = False) -> PreparedRequest:
    prompt = f"a scene {seed}" + (f" {SLOW_MARKER}" if slow else "")
    body = GenerationRequest(prompt=prompt, request_id=rid, seed=seed, num_inference_steps=steps)
    p = PreparedRequest.from_request(
        body, request_id=rid, seed=seed, height=64, width=64, steps=3, guidance_scale=7.5, priority=priority
    )
    return p.model_copy(update={"loras": [adapter]} if adapter is not None else {})


def _pixels(b: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(b)).convert("RGB"), dtype=np.int16)


async def _paused_run(replica, batch: PreparedRequest, interactive: PreparedRequest):
    """Start `batch`, submit `interactive` once the batch call is a few steps in; the batch
    job's step then and when the interactive request's first step ran, and both results."""
    slow = asyncio.ensure_future(replica.generate(batch))
    async with asyncio.timeout(60):
        while (job := replica.scheduler.jobs.get(("", batch.request_id))) is None or job.step < 3:
            await asyncio.sleep(0.001)
    submitted_at = job.step
    quick = asyncio.ensure_future(replica.generate(interactive))
    async with asyncio.timeout(60):  # the batch job's step when the interactive one has begun
        while (mine := replica.scheduler.jobs.get(("", interactive.request_id))) is None or mine.step < 1:
            if quick.done():
                break
            await asyncio.sleep(0.001)
    began_at = job.step
    return submitted_at, began_at, await quick, await slow


@pytest.mark.parametrize("adapters", [("a", None), (None, "a"), ("a", "b")], ids=["batch", "quick", "both"])
def test_an_interactive_request_pauses_a_batch_call_which_resumes_the_same(replica, tmp_path, adapters):
    """The batch call is paused at its next step for the interactive request, which runs inside
    it; adapters the interactive one needs are loaded during the pause (its own, or none), and
    the paused call's are put back: its images equal those of the call never paused."""
    from serve_app.tools.lora import make_adapter

    refs = {n: LoraRef(name=n, scale=1.0, path=str(make_adapter(str(tmp_path / f"{n}.safetensors"),
                                                                seed=ord(n), strength=2.0)))
            for n in ("a", "b")}  # fmt: skip
    on_batch, on_quick = (refs.get(a) if a else None for a in adapters)

    def pair(tag: str):
        return (_req(f"b-{tag}", 0, STEPS, 7, on_batch, slow=True), _req(f"i-{tag}", 5, 3, 11, on_quick))

    alone_batch, alone_quick = pair("alone")
    ref_batch, ref_quick = run(replica.generate(alone_batch)), run(replica.generate(alone_quick))
    if on_quick is not None:  # it must be loaded while the batch call is paused
        run(replica.evict_lora(on_quick.name))
    before = replica.stats().counts.get("preemptions", 0)

    at, began, quick, slow = run(_paused_run(replica, *pair("paused")))
    # The interactive request began within a step or two of the batch call's progress (the one
    # being run when it came, the boundary it paused at), not after the batch call's rest.
    assert began - at <= 2 and began < STEPS, (at, began)
    assert replica.stats().counts["preemptions"] == before + 1
    # The paused call's images are those of the call never paused, and so are the other's.
    assert np.abs(_pixels(slow.images[0]) - _pixels(ref_batch.images[0])).max() == 0
    assert np.abs(_pixels(quick.images[0]) - _pixels(ref_quick.images[0])).max() == 0
    assert quick.metrics.batch_requests == 1 and slow.metrics.batch_requests == 1


def test_without_a_budget_the_interactive_request_waits_for_the_whole_call(replica):
    replica.reconfigure({"max_batch_images": 8, "batch_wait_ms": 0, "preempt_after_ms": None})
    try:
        at, began, _, _ = run(
            _paused_run(replica, _req("b-wait", 0, STEPS, 8, slow=True), _req("i-wait", 5, 3, 12))
        )
    finally:
        replica.reconfigure({"max_batch_images": 8, "batch_wait_ms": 0, "preempt_after_ms": 0})
    assert began == STEPS, (at, began)


@pytest.fixture(scope="module")
def joined_replica():
    r = _replica(max_batch_images=2, step_joining=True)
    yield r
    _stop(r)


def test_in_a_full_joined_run_a_batch_seat_parks_for_an_interactive_request(joined_replica):
    """Step-level joining (continuous batching, the GPU's default): the run is full of a batch
    request's rows, so the interactive one could not join; the batch request's seat is parked
    (left out of the steps, its call waiting where it stood), the interactive one joins and
    ends, then the seat goes on and makes its images as if never parked."""
    r = joined_replica

    def batch(rid):
        return _req(rid, 0, STEPS, 7, slow=True).model_copy(update={"num_images": 2})

    ref_batch, ref_quick = run(r.generate(batch("jb-alone"))), run(r.generate(_req("ji-alone", 5, 3, 11)))
    before = r.stats().counts.get("preemptions", 0)
    at, began, quick, slow = run(_paused_run(r, batch("jb-paused"), _req("ji-paused", 5, 3, 11)))
    assert began - at <= 2 and began < STEPS, (at, began)
    assert r.stats().counts["preemptions"] == before + 1
    for got, ref in ((slow.images[0], ref_batch.images[0]), (slow.images[1], ref_batch.images[1]),
                     (quick.images[0], ref_quick.images[0])):  # fmt: skip
        assert np.abs(_pixels(got) - _pixels(ref)).max() <= 1  # joined: CPU rounding aside
