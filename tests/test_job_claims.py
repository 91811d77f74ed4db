"""Claims are exclusive or the store is refused (issue 60): who runs a job is settled by files the
store creates exclusively (`Store.claim`, `Store.create_job`, `Store.secret`). Two ingresses racing
for one claim never both win, and a store whose file system cannot create exclusively is refused
when it opens, with no check-then-write fallback. No Ray here."""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time
import uuid

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from serve_app.errors import ServingError
from serve_app.jobs import JobRunner, Store
from serve_app.jobs.store import StoreRefused
from serve_app.schemas import JobRecord, PreparedRequest

ROUNDS = 200


# ------------------------------------------------------------------ file systems without exclusive create


class _NoExclusive(MemoryFileSystem):
    """Exclusive create is not implemented (as an fsspec backend that has no "x" mode)."""

    protocol = ("noxmem",)

    def _open(self, path, mode="rb", **kw):
        if "x" in mode:
            raise NotImplementedError("no exclusive create")
        return super()._open(path, mode, **kw)


class _BadMode(MemoryFileSystem):
    """Mode "xb" is refused as an unknown mode."""

    protocol = ("badxmem",)

    def _open(self, path, mode="rb", **kw):
        if "x" in mode:
            raise ValueError(f"unsupported mode {mode!r}")
        return super()._open(path, mode, **kw)


class _IgnoresExclusive(MemoryFileSystem):
    """Accepts "xb" and overwrites anyway (an S3-compatible server that ignores If-None-Match)."""

    protocol = ("ignorexmem",)

    def _open(self, path, mode="rb", **kw):
        return super()._open(path, mode.replace("x", "w"), **kw)


for _cls in (_NoExclusive, _BadMode, _IgnoresExclusive):
    fsspec.register_implementation(_cls.protocol[0], _cls, clobber=True)


@pytest.mark.parametrize("protocol", ["noxmem", "badxmem", "ignorexmem"])
def test_a_store_without_exclusive_create_is_refused_when_it_opens(protocol):
    url = f"{protocol}://admin:hunter2@bucket/jobs-{uuid.uuid4().hex[:8]}"
    with pytest.raises(StoreRefused) as info:
        Store(url)
    e = info.value
    message = str(e)
    assert message.startswith(f"jobs.store ({protocol}://"), message
    assert "second create of the same key" in message and "mode 'xb'" in message, message
    assert "s3fs>=" in message and "gcsfs>=" in message, message
    assert "hunter2" not in message and "admin" not in message, message  # never the URL's credentials
    assert isinstance(e, ServingError) and isinstance(e, ValueError) and e.param == "jobs.store"
    assert "hunter2" not in str(e.to_body())


def test_the_ingress_refuses_to_start_on_such_a_store():
    from serve_app.ingress.deployment import DiffusionIngress

    url = f"ignorexmem://bucket/jobs-{uuid.uuid4().hex[:8]}"
    with pytest.raises(StoreRefused, match=r"^jobs\.store \(ignorexmem://"):
        DiffusionIngress({}, {"jobs": {"store": url}})


def test_stores_that_create_exclusively_are_accepted_and_leave_no_probe(tmp_path):
    for url in (str(tmp_path / "s"), f"memory://claims-{uuid.uuid4().hex[:8]}"):
        store = Store(url)
        assert store.fs.find(store._path("probe")) == []  # the probe is removed
        store.fs.makedirs(store._path("objects", "job_x"), exist_ok=True)  # the job's, made first
        assert store.claim("job_x", 2, "a") is True
        assert store.claim("job_x", 2, "b") is False  # the second create of the same key loses
        assert store._read(store._path("objects", "job_x", "claim.2")) == b"a"


def test_a_claim_never_falls_back_to_check_then_write(tmp_path):
    """A store that stops creating exclusively after it opened makes a claim fail loudly: it
    never falls back to writing the claim after seeing none there (two ingresses could)."""
    store = Store(f"memory://claims-{uuid.uuid4().hex[:8]}")
    store.fs.makedirs(store._path("objects", "job_y"), exist_ok=True)
    store.fs = _NoExclusive()
    with pytest.raises(NotImplementedError):
        store.claim("job_y", 2, "a")
    assert not store.fs.exists(store._path("objects", "job_y", "claim.2"))


# ------------------------------------------------------------------ races


def test_two_ingresses_race_for_each_claim_and_exactly_one_wins(tmp_path):
    """Two stores on one directory (two ingresses), one thread each, released together by a
    barrier for every claim: each round has exactly one winner."""
    stores = [Store(str(tmp_path / "s")), Store(str(tmp_path / "s"))]
    _make_jobs(stores[0])
    barrier = threading.Barrier(2)
    won: list[list[bool]] = [[], []]

    def ingress(i: int) -> None:
        for n in range(ROUNDS):
            barrier.wait()
            won[i].append(stores[i].claim(f"job_{n:04d}", 2, f"owner{i}"))

    threads = [threading.Thread(target=ingress, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [a + b for a, b in zip(*won, strict=True)] == [1] * ROUNDS, won
    for n, (a, _) in enumerate(zip(*won, strict=True)):
        assert stores[0]._read(stores[0]._path("objects", f"job_{n:04d}", "claim.2")) == (
            b"owner0" if a else b"owner1"
        )


def _make_jobs(store: Store) -> None:
    for n in range(ROUNDS):  # a claim is made in its job's directory, made with the job
        store.fs.makedirs(store._path("objects", f"job_{n:04d}"), exist_ok=True)


def _claim_rounds(url: str, owner: str, barrier, results) -> None:
    store = Store(url)
    won = []
    for n in range(ROUNDS):
        barrier.wait(60)  # a partner that died breaks the barrier: this one ends too
        won.append(store.claim(f"job_{n:04d}", 3, owner))
    results.put((owner, won))


def test_two_processes_race_for_each_claim_and_exactly_one_wins(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    url = str(tmp_path / "s")
    _make_jobs(Store(url))
    procs = [ctx.Process(target=_claim_rounds, args=(url, f"p{i}", barrier, results)) for i in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.terminate()
    assert [a + b for a, b in zip(got["p0"], got["p1"], strict=True)] == [1] * ROUNDS


class _SlowRecords(Store):
    """A store whose records take a while to read: the other ingress claims, renews and saves the
    job between this one's read of the lease and its read of the record."""

    def load_job(self, job_id):
        time.sleep(0.03)
        return super().load_job(job_id)


@pytest.mark.parametrize("second", [Store, _SlowRecords], ids=["even", "slow-record-reader"])
def test_two_runners_resume_one_orphan_and_exactly_one_sends_it(tmp_path, second):
    """Two ingresses' runners find the same orphaned job (no lease, older than a lease) in the
    same pass: exactly one claims the next attempt and streams it to a replica. With the second
    reading records slowly, it reads the record after the first took the job: it must not claim
    the attempt after (CI once saw both run it)."""
    from serve_app.config import JobsConfig

    url = str(tmp_path / "s")
    cfg = JobsConfig(store=url, lease_s=30, max_running=1000)  # every won job reaches its stream
    sent: list[str] = []

    async def scenario(rounds: int) -> list[tuple[int, int]]:
        forever = asyncio.Event()

        async def stream(request):
            sent.append(request.prompts[0])  # the job's id
            await forever.wait()  # a replica still running it
            yield None

        async def nothing(_):
            return None

        runners = [JobRunner(kind(url), cfg, stream, nothing, lambda job: job) for kind in (Store, second)]
        for r in runners:  # no background passes: only the resume passes below race
            r._background = lambda: asyncio.sleep(3600)
        out = []
        try:
            for n in range(rounds):
                job_id = f"job_{n:032d}"
                prepared = PreparedRequest(request_id="r", prompts=[job_id], height=32, width=32,
                                           num_inference_steps=2, guidance_scale=1.0, seed=1, num_images=1,
                                           output_format="png", negative_prompt=None)  # fmt: skip
                job = JobRecord(id=job_id, route="r", model="m", state="running", created_at=time.time() - 60,
                                request_id="r", output_format="png", owner="gone")  # fmt: skip
                runners[0].store.save_request(job_id, prepared)
                assert runners[0].store.create_job(job)
                await asyncio.gather(*(r._resume_orphans() for r in runners))
                for _ in range(5):
                    await asyncio.sleep(0)  # the winner's task reaches the stream
                took = [int(job_id in r.tasks) for r in runners]
                stored = runners[0].store.load_job(job_id)
                assert stored.attempts == 2 and stored.owner == runners[took.index(1)].owner, (took, stored)
                out.append((took[0], took[1]))
        finally:
            for r in runners:
                for task in [*r.tasks.values(), r._loop_task]:
                    if task is not None:
                        task.cancel()
            await asyncio.sleep(0)
        return out

    rounds = 50
    took = asyncio.run(scenario(rounds))
    assert all(a + b == 1 for a, b in took), took
    assert sorted(sent) == [f"job_{n:032d}" for n in range(rounds)]  # each sent once, by one runner
