"""The replica driven directly, no Serve around it: Serve only calls these coroutines, and
driving them in one event loop makes the batching order deterministic, which HTTP timing cannot.

Tests of the queue, batching, abort and health run on `FakeEngine` (flat images, a fixed time
per step, faults on demand), in milliseconds; the tests that compare images run the real tiny
pipeline, the proof that the real thing batches without changing an image.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from serve_app.errors import Aborted
from serve_app.replica import DiffusionReplica
from serve_app.schemas import BatchGenerationRequest, GenerationRequest, PreparedRequest
from serve_app.testing import FakeEngine

# One event loop for the module, as in a Serve replica: the engine loop task lives on it.
_LOOP = asyncio.new_event_loop()


def run(coro):
    return _LOOP.run_until_complete(coro)


@pytest.fixture(scope="module")
def replica():
    r = DiffusionReplica(
        {"source": "builtin:tiny-sd", "device": "cpu", "default_height": 32, "default_width": 32,
         "default_steps": 3, "warmup": False},
        {"max_batch_images": 8, "batch_wait_ms": 0},
    )  # fmt: skip
    yield r
    stop(r)


def stop(r: DiffusionReplica) -> None:
    """Stop the engine loop, as Serve does when the replica goes."""
    if r._loop_task is not None:
        r._loop_task.cancel()
        run(asyncio.gather(r._loop_task, return_exceptions=True))


FAKE_MODEL = {"source": "builtin:tiny-sd", "default_height": 32, "default_width": 32, "default_steps": 3}


def fake_replica() -> DiffusionReplica:
    """A replica around `FakeEngine`: 20 ms per step, so a call of 3 steps takes 60 ms."""
    return DiffusionReplica(
        FAKE_MODEL, {"max_batch_images": 8, "batch_wait_ms": 0}, {"max_consecutive_failures": 3},
        engine_factory=lambda cfg: FakeEngine(cfg, step_s=0.02),
    )  # fmt: skip


@pytest.fixture(scope="module")
def fake():
    r = fake_replica()
    yield r
    stop(r)


def prepare(request: GenerationRequest | BatchGenerationRequest) -> PreparedRequest:
    """What the ingress would send for `request`: defaults of the 32x32, 3-step test model."""
    return PreparedRequest.from_request(
        request, request_id="unnamed", seed=1, height=32, width=32, steps=3, guidance_scale=7.5
    )


def req(prompt: str, rid: str, **kw) -> PreparedRequest:
    return prepare(GenerationRequest(prompt=prompt, request_id=rid, seed=kw.pop("seed", 1), **kw))


@contextlib.contextmanager
def batching(replica, **settings):
    """Reconfigure the shared replica's batching for one test, then put back what it had."""
    before = replica.batching.model_dump()
    replica.reconfigure(settings)
    try:
        yield
    finally:
        replica.reconfigure(before)


async def reaches(replica, request_id: str, state: str, timeout_s: float = 30) -> None:
    """Return once the request is in `state`; fail if it is not within `timeout_s`."""
    async with asyncio.timeout(timeout_s):
        while (st := replica.request_status(request_id)) is None or st.state != state:
            await asyncio.sleep(0.002)


def test_compatible_requests_share_a_call_and_keep_their_images(replica):
    async def go():
        blocker = asyncio.ensure_future(
            replica.generate(req("block", "blk", width=64, height=64, num_inference_steps=6))
        )
        await asyncio.sleep(0.05)  # the blocker is running; the next ones queue behind it
        a = asyncio.ensure_future(replica.generate(req("a red cat", "a1", seed=3)))
        b = asyncio.ensure_future(replica.generate(req("a blue dog", "b1", seed=4, num_images=2)))
        other = asyncio.ensure_future(replica.generate(req("steps differ", "o1", num_inference_steps=4)))
        c = asyncio.ensure_future(replica.generate(req("a tree", "c1", seed=5)))
        return await asyncio.gather(blocker, a, b, other, c)

    blocker, a, b, other, c = run(go())
    assert blocker.metrics.batch_requests == 1
    # a, b and c share one call (4 images); `other` was older than c but incompatible: its own call.
    for r in (a, b, c):
        assert r.metrics.batch_requests == 3 and r.metrics.batch_images == 4, r.request_id
    assert other.metrics.batch_requests == 1
    assert a.seeds == [3] and b.seeds == [4, 5] and c.seeds == [5]

    async def alone():
        return await asyncio.gather(
            replica.generate(req("a red cat", "a2", seed=3)),
            replica.generate(req("a blue dog", "b2", seed=5)),
        )

    a2, b2 = run(alone())
    # Same pixels whether the request ran alone or in a shared call (CPU rounding aside).
    assert _maxdiff(a.images[0], a2.images[0]) <= 1
    assert _maxdiff(b.images[1], b2.images[0]) <= 1


def test_batch_size_limit_and_oldest_first(fake):
    with batching(fake, max_batch_images=3):

        async def go():
            blocker = asyncio.ensure_future(fake.generate(req("block", "blk2", width=64, height=64)))
            await asyncio.sleep(0.05)
            jobs = [
                asyncio.ensure_future(fake.generate(req(f"p{i}", f"q{i}", num_images=2))) for i in range(3)
            ]
            return await asyncio.gather(blocker, *jobs)

        _, *rs = run(go())
        assert [r.metrics.batch_images for r in rs] == [2, 2, 2]  # 2+2 > 3: each runs alone
        assert rs[0].metrics.queue_ms < rs[1].metrics.queue_ms < rs[2].metrics.queue_ms


def test_idle_device_waits_for_a_burst_but_not_past_its_gap(fake):
    # Gaps of 100 ms < batch_gap_ms: the three trickling requests share a call, which starts one
    # gap after the last of them (well before the 600 ms window). A lone request waits one gap.
    with batching(fake, batch_wait_ms=600, batch_gap_ms=200):

        async def go():
            jobs = []
            for i in range(3):
                jobs.append(asyncio.ensure_future(fake.generate(req(f"t{i}", f"gap{i}"))))
                await asyncio.sleep(0.1)
            burst = await asyncio.gather(*jobs)
            await asyncio.sleep(0.7)  # past the window: not a caller of that call coming back
            lone = await fake.generate(req("alone", "gap-lone"))
            return burst, lone

        burst, lone = run(go())
        assert [r.metrics.batch_requests for r in burst] == [3, 3, 3]
        # The head waited for its company (>= 2 gaps of arrivals + one quiet gap), not the window.
        assert 350 <= burst[0].metrics.queue_ms < 580, burst[0].metrics.queue_ms
        assert lone.metrics.batch_requests == 1
        assert 190 <= lone.metrics.queue_ms < 450, lone.metrics.queue_ms


def test_callers_coming_back_refill_their_call_past_the_gap(fake):
    # Closed-loop callers: three answered together come back 150 ms apart, more than the gap.
    # They share one call again instead of the first leaving alone one gap after it arrived.
    with batching(fake, batch_wait_ms=600, batch_gap_ms=100):

        async def go():
            first = await asyncio.gather(*(fake.generate(req(f"c{i}", f"back{i}")) for i in range(3)))
            jobs = []
            for i in range(3):
                jobs.append(asyncio.ensure_future(fake.generate(req(f"c{i}", f"back{i}-again"))))
                await asyncio.sleep(0.15)
            return first, await asyncio.gather(*jobs)

        first, again = run(go())
        assert [r.metrics.batch_requests for r in first] == [3, 3, 3]
        assert [r.metrics.batch_requests for r in again] == [3, 3, 3]
        # The head waited past the gap for the other two, then one gap more, not the window.
        assert 250 <= again[0].metrics.queue_ms < 580, again[0].metrics.queue_ms


def test_requests_queued_behind_a_call_wait_for_its_callers_to_come_back(fake):
    # Two requests run; two more queue behind them. When the call ends, the queued pair waits
    # for the first pair's callers to come back (150 ms apart, past the gap), and the four
    # share one call: a wave split in two halves joins up again instead of alternating.
    big = {"width": 64, "height": 64, "num_inference_steps": 8}
    with batching(fake, batch_wait_ms=600, batch_gap_ms=100):

        async def go():
            first = [
                asyncio.ensure_future(fake.generate(req(f"a{i}", f"join-a{i}", **big))) for i in range(2)
            ]
            await reaches(fake, "join-a0", "running")
            queued = [
                asyncio.ensure_future(fake.generate(req(f"q{i}", f"join-q{i}", **big))) for i in range(2)
            ]
            await reaches(fake, "join-q1", "queued")
            ran = await asyncio.gather(*first)
            back = []
            for i in range(2):
                back.append(asyncio.ensure_future(fake.generate(req(f"a{i}", f"join-a{i}-again", **big))))
                await asyncio.sleep(0.15)
            return ran, await asyncio.gather(*queued, *back)

        ran, rest = run(go())
        assert [r.metrics.batch_requests for r in ran] == [2, 2]
        assert [r.metrics.batch_requests for r in rest] == [4, 4, 4, 4]


def test_reconfigure_turns_batching_off_without_a_restart(fake):
    with batching(fake, max_batch_images=1):

        async def go():
            blocker = asyncio.ensure_future(fake.generate(req("block", "blk3", width=64, height=64)))
            await asyncio.sleep(0.05)
            return await asyncio.gather(blocker, *(fake.generate(req(f"p{i}", f"r{i}")) for i in range(3)))

        _, *rs = run(go())
        assert all(r.metrics.batch_requests == 1 for r in rs)
        assert fake.stats().batching["max_batch_images"] == 1


def test_request_aborted_while_queued_never_joins_a_batch(fake):
    async def go():
        blocker = asyncio.ensure_future(
            fake.generate(req("block", "blk4", width=64, height=64, num_inference_steps=6))
        )
        await asyncio.sleep(0.05)
        a = asyncio.ensure_future(fake.generate(req("a", "ab-a")))
        b = asyncio.ensure_future(fake.generate(req("b", "ab-b")))
        await asyncio.sleep(0)
        assert fake.request_status("ab-a").state == "queued"
        assert fake.abort(["ab-a", "nope"]) == {"ab-a": "aborted", "nope": "unknown"}
        with pytest.raises(Aborted):
            await a
        rb = await b
        await blocker
        return rb

    rb = run(go())
    assert rb.metrics.batch_requests == 1
    st = fake.request_status("ab-a")
    assert st.state == "aborted" and st.step == 0
    assert fake.abort(["ab-b"]) == {"ab-b": "finished"}


def test_duplicate_live_request_id_is_refused(fake):
    from serve_app.errors import InvalidRequest

    async def go():
        first = asyncio.ensure_future(fake.generate(req("a", "dup", width=64, height=64)))
        await asyncio.sleep(0.01)
        with pytest.raises(InvalidRequest, match="already queued or running"):
            await fake.generate(req("a", "dup"))
        return await first

    assert run(go()).images


def test_batch_request_rows_stay_together(fake):
    async def go():
        return await fake.generate(
            prepare(BatchGenerationRequest(prompts=["x", "y", "z"], request_id="bt", seed=2))
        )

    r = run(go())
    assert r.prompt_index == [0, 1, 2] and r.metrics.batch_images == 3


def _maxdiff(a: bytes, b: bytes) -> int:
    import io

    import numpy as np
    from PIL import Image

    pa = np.asarray(Image.open(io.BytesIO(a))).astype(np.int16)
    pb = np.asarray(Image.open(io.BytesIO(b))).astype(np.int16)
    return int(np.abs(pa - pb).max())


def test_a_request_larger_than_one_call_runs_in_calls_of_max_batch_images(replica):
    # 3 prompts x 3 images = 9 rows with max_batch_images 4: calls of 4, 4 and 1, merged in order,
    # each image the same as when it runs alone.
    with batching(replica, max_batch_images=4):
        big = prepare(
            BatchGenerationRequest(prompts=["x", "y", "z"], num_images=3, request_id="split", seed=7)
        )
        r = run(replica.generate(big))
        alone = run(replica.generate(req("z", "split-alone", seed=9)))
    assert len(r.images) == 9 and r.prompt_index == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert r.seeds == [7, 8, 9] * 3
    assert r.metrics.batch_images == 4 and r.metrics.pipeline_calls == 3
    assert _maxdiff(r.images[8], alone.images[0]) <= 1
    st = replica.request_status("split")
    assert st.state == "done" and st.step == st.total_steps == 3 * 3  # 3 calls of 3 steps


def test_a_plain_request_does_no_per_step_work_that_only_streams_need(replica, monkeypatch):
    """Counted, not timed, on the real pipeline: a request nobody streams makes no step event,
    no preview, never unpacks its latents for one, and copies no latents off the device unless
    it asks for them. The same counters count a watched stream's work, so they can fail."""
    import collections

    from serve_app.engine import runs
    from serve_app.replica import results

    calls = collections.Counter()

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(runs.Runner, "_viewable", counted("unpack", runs.Runner._viewable))
    monkeypatch.setattr(runs, "host_copy", counted("copy", runs.host_copy))
    monkeypatch.setattr(results, "latents_preview", counted("preview", results.latents_preview))
    monkeypatch.setattr(results, "StepEvent", counted("event", results.StepEvent))

    plain = run(replica.generate(req("plain", "count-plain")))
    assert plain.metrics.steps == 3 and calls == {}, calls
    assert replica.request_status("count-plain").step == 3  # its progress is still counted

    async def watched(rid: str, preview_every: int):
        stream = replica.generate_stream(req("watched", rid), preview_every=preview_every)
        return [e async for e in stream]

    assert len(run(watched("count-events", 0))) == 4 and calls == {"event": 3}, calls
    calls.clear()
    run(watched("count-previews", 1))
    assert calls == {"event": 3, "unpack": 3, "preview": 3}, calls  # one unpack a step, not a job
    calls.clear()
    run(replica.generate(req("latents", "count-latents", return_latents=True)))
    assert calls == {"copy": 1}, calls


# ----------------------------------------------------------------------------- health


@pytest.fixture(scope="module")
def faulty():
    """A replica of its own, whose `FakeEngine` the tests below break on purpose."""
    r = fake_replica()
    yield r
    stop(r)


def fresh_health(replica) -> None:
    """The replica's health record anew (no verdicts, no recent self-test), whatever ran before."""
    from serve_app.replica.health import Health

    replica.health = replica.engine_loop.health = Health(
        replica.health.max_failures, replica.health.call_timeout_s
    )


def _fail(replica, rid: str, **kw):
    from serve_app.errors import ServingError

    with pytest.raises(ServingError) as e:
        run(replica.generate(req("x", rid, **kw)))
    return e.value


def test_failing_requests_alone_never_make_a_replica_unhealthy(faulty):
    from serve_app.errors import InvalidRequest

    fresh_health(faulty)
    faulty.engine.fail_next = 10  # more than max_consecutive_failures, three times over
    tests_before = faulty.engine.self_tests
    for i in range(10):
        err = _fail(faulty, f"hostile-{i}")
        # The self-test runs after the first: the model runs its defaults, so the request's own
        # arguments failed the call: a 400, not counted; failures of the same kind reuse it.
        assert isinstance(err, InvalidRequest) and err.status_code == 400, err
        assert "injected engine failure" in err.message and "runs its defaults" in err.message
    stats = faulty.stats()
    assert stats.healthy, stats.health_problem
    assert stats.engine_failures_in_a_row == 0 and stats.counts["argument_failures"] >= 10
    assert faulty.engine.self_tests == tests_before + 1
    run(faulty.check_health())
    assert run(faulty.generate(req("fine", "after-hostile"))).images


def test_failures_the_self_test_shares_are_the_engine_s_counted_and_checked_again(faulty):
    # A fresh record: the test above left a verdict for failures of this kind (they were the
    # requests' own), which would answer these without a self-test for a minute.
    fresh_health(faulty)
    faulty.engine.fail_next = 3
    faulty.engine.self_test_fails_next = 3  # each failure's own self-test fails: the engine's fault
    for i in range(3):
        err = _fail(faulty, f"engine-{i}")
        assert err.status_code == 500 and "injected engine failure" in err.message, err
    # After three in a row the replica runs its self-test once more; now it passes: healthy.
    deadline = time.monotonic() + 10
    while faulty.stats().counts["self_tests_passed"] < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    stats = faulty.stats()
    assert stats.healthy and stats.counts["self_tests_passed"] == 1, stats
    assert run(faulty.generate(req("fine", "after-engine-faults"))).images


def test_a_broken_engine_fails_its_self_test_and_reports_unhealthy(faulty):
    from serve_app.errors import Unavailable

    faulty.engine.broken = True
    try:
        for i in range(3):
            assert "injected engine failure" in _fail(faulty, f"broken-{i}").message
        # The self-test runs on the engine thread after the third caller has its answer.
        deadline = time.monotonic() + 10
        while (problem := faulty.stats().health_problem) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert problem and "3 engine failures in a row, then the self-test failed" in problem, problem
        assert not faulty.ready()
        with pytest.raises(Unavailable, match="self-test failed"):
            run(faulty.check_health())
    finally:
        faulty.engine.broken = False
        faulty.health.broken = None  # Serve would replace the replica; the fixture lives on
        faulty.health.consecutive_failures = 0


def test_a_call_running_past_its_limit_reports_unhealthy(faulty):
    from serve_app.errors import Unavailable

    faulty.health.call_timeout_s = 0.3
    try:

        async def go():
            long = asyncio.ensure_future(faulty.generate(req("slow", "hung", num_inference_steps=40)))
            await reaches(faulty, "hung", "running")
            await asyncio.sleep(0.45)
            with pytest.raises(Unavailable, match=r"a pipeline call has run for \d+s \(limit 0.3s\)"):
                await faulty.check_health()
            await long
            await faulty.check_health()  # the call ended: healthy again

        run(go())
    finally:
        faulty.health.call_timeout_s = 900


def test_a_dead_engine_loop_reports_unhealthy(faulty):
    from serve_app.errors import Unavailable

    run(faulty.generate(req("start the loop", "loop-up")))
    faulty._loop_task.cancel()
    run(asyncio.gather(faulty._loop_task, return_exceptions=True))
    with pytest.raises(Unavailable, match="engine loop stopped"):
        run(faulty.check_health())
    faulty._loop_task = None  # the next request starts a new loop (Serve would replace us instead)


def test_a_fatal_device_error_hands_every_request_back(faulty):
    from serve_app.errors import ReplicaLost

    faulty.engine.fatal_next = True

    async def go():
        running = asyncio.ensure_future(faulty.generate(req("a", "fatal-running")))
        await asyncio.sleep(0)
        queued = asyncio.ensure_future(faulty.generate(req("b", "fatal-queued", num_inference_steps=4)))
        return await asyncio.gather(running, queued, return_exceptions=True)

    try:
        outcomes = run(go())
        assert all(isinstance(o, ReplicaLost) for o in outcomes), outcomes
        assert not faulty.ready() and "fatal device error" in faulty.stats().health_problem
        with pytest.raises(ReplicaLost):  # and it takes nothing new
            run(faulty.generate(req("c", "fatal-after")))
    finally:
        faulty.health.fatal = None


def test_requests_with_different_adapters_share_a_call_within_the_rules():
    """The scheduler's rule for mixed-adapter calls, as pure policy: at most `max_adapters`
    names in a call counting every adapter of every request once (sets and scales do not
    matter), and requests with no adapter join any call."""
    from serve_app.config import BatchingConfig
    from serve_app.replica.scheduler import Job, Scheduler

    async def go():
        s = Scheduler(BatchingConfig(max_batch_images=8), max_adapters=2)
        loop = asyncio.get_running_loop()

        def job(rid, adapters):
            return Job(rid, rows=[rid], key="k", steps=3, future=loop.create_future(), adapters=adapters)

        for rid, adapters in [("a", ("red",)), ("b", ("blue", "red")), ("c", ("red",)), ("d", ()),
                              ("e", ("green",)), ("g", ("blue", "green")), ("f", ("blue",))]:  # fmt: skip
            s.submit(job(rid, adapters))
        return [j.request_id for j in s.gather()]

    # e and g: a third name over the limit of 2; b's set and c (red again, at any scale) fit.
    assert asyncio.run(go()) == ["a", "b", "c", "d", "f"]


def _adapter_req(rid: str, tmp_path, name: str, size: int = 400) -> PreparedRequest:
    """A request naming adapter `name`, whose file (for FakeEngine, any bytes) has `size` bytes."""
    from serve_app.schemas import LoraRef

    path = tmp_path / f"{name}.safetensors"
    if not path.exists():
        path.write_bytes(b"\0" * size)
    r = req("p", rid)
    return r.model_copy(update={"loras": [LoraRef(name=name, scale=1.0, path=str(path))]})


def test_adapter_residency_keeps_to_its_size_and_evicts_least_recently_used(tmp_path):
    """`lora.max_loaded_mb`: three 400-byte adapters in a 900-byte budget hold two at a time,
    the least recently used evicted; a pinned adapter is never evicted, and pins over the budget
    are refused with a message naming the setting."""
    from serve_app.errors import InvalidRequest

    budget_mb = 900 / 2**20
    r = DiffusionReplica(
        FAKE_MODEL, {"max_batch_images": 8, "batch_wait_ms": 0}, {},
        {"max_loaded": 4, "max_per_request": 2, "max_loaded_mb": budget_mb},
        engine_factory=lambda cfg: FakeEngine(cfg, step_s=0.0),
    )  # fmt: skip
    try:
        for rid, name in [("1", "a"), ("2", "b"), ("3", "a"), ("4", "c")]:
            run(r.generate(_adapter_req(rid, tmp_path, name)))
        assert r.adapters.loaded == ["a", "c"]  # b was the least recently used when c came
        assert r.stats().loras_loaded_mb == round(800 / 2**20, 3) and r.stats().counts["lora_evictions"] == 1
        run(r.pin_lora("c", str(tmp_path / "c.safetensors"), True))
        for rid, name in [("5", "b"), ("6", "a"), ("7", "b")]:
            run(r.generate(_adapter_req(rid, tmp_path, name)))
            assert "c" in r.adapters.loaded and len(r.adapters.loaded) == 2
        with pytest.raises(InvalidRequest, match="max_loaded_mb"):  # c + b + a pinned: 1200 bytes
            run(r.pin_lora("b", str(tmp_path / "b.safetensors"), True))
            run(r.pin_lora("a", str(tmp_path / "a.safetensors"), True))
    finally:
        stop(r)


def test_adapter_files_are_read_off_the_engine_thread_while_a_call_runs(tmp_path):
    """A request naming an adapter the replica lacks starts reading its file at once, on the
    reader thread, while the engine thread runs the call in flight; only installing it waits
    for that call. The read (300 ms here) overlaps the running call (400 ms) instead of
    following it."""
    r = DiffusionReplica(
        FAKE_MODEL, {"max_batch_images": 1, "batch_wait_ms": 0}, {}, {"max_loaded": 2, "max_per_request": 1},
        engine_factory=lambda cfg: FakeEngine(cfg, step_s=0.1),
    )  # fmt: skip
    r.engine.read_delay_s = 0.3

    async def go():
        first = asyncio.ensure_future(r.generate(req("p", "long", num_inference_steps=4)))
        await asyncio.sleep(0.05)  # the first call is running
        t = time.perf_counter()
        await r.generate(_adapter_req("with-adapter", tmp_path, "a"))
        await first
        return time.perf_counter() - t

    try:
        took = run(go())
        assert [thread for thread, _ in r.engine.reads] == ["adapter-reader_0"]
        assert r.stats().counts["lora_prefetched"] == 1
        # Read during the first call: ~0.35 s left of it, then 3 steps of 0.1 s (sequential: ~0.95 s).
        assert took < 0.85, took
    finally:
        stop(r)


def test_abort_of_a_request_waiting_for_its_checkpoint_answers_aborted(fake):
    """Issue 60: the abort reached it (it ends Aborted) and says so, not `unknown`."""
    from serve_app.errors import Aborted

    class Loading:  # a pool's checkpoints, one of them loading for a long time
        held: list = []

        async def engine(self, name, source):
            await asyncio.sleep(3600)

    saved, fake.checkpoints = fake.checkpoints, Loading()
    try:

        async def go():
            request = req("x", "waits-for-ckpt").model_copy(
                update={"checkpoint": "ck", "checkpoint_source": "ck"}
            )
            waiting = asyncio.ensure_future(fake.generate(request))
            async with asyncio.timeout(30):
                while fake.request_status("waits-for-ckpt") is None:
                    await asyncio.sleep(0.005)
            answer = fake.abort(["waits-for-ckpt", "never-seen"])
            with pytest.raises(Aborted):
                await waiting
            return answer

        assert run(go()) == {"waits-for-ckpt": "aborted", "never-seen": "unknown"}
    finally:
        fake.checkpoints = saved
