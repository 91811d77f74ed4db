"""Which queued requests run together, and when: the replica's queue as plain Python.

No Ray, no torch. A request is a `Job` (its rows are opaque here: only their number counts).
The engine loop asks `next_batch()` for the oldest queued job and the compatible jobs that
can share its pipeline call, waits for company as the batching settings allow, and reports
back with `call_ended()`. Abort, request states and the finished-request records live here too,
so that a change to how requests are queued or batched has one place to go.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Literal

from serve_app.config import BatchingConfig
from serve_app.errors import Aborted, InvalidRequest, ServingError

State = Literal["queued", "running", "done", "aborted", "failed"]
FINISHED_KEPT = 2048  # finished requests remembered for GET /v1/requests/{id}
ACTIVE_S = 10.0  # a tenant that sent a request this recently is active (rows are kept for it)


@dataclass(eq=False)
class Job:
    """One request in the replica: its rows (one image each) and where it is."""

    request_id: str
    rows: list[Any]
    key: Hashable  # jobs with equal keys may share a pipeline call
    steps: int
    future: asyncio.Future
    payload: Any = None  # what the replica needs to run and answer it
    preview_every: int = 0
    enqueued: float = field(default_factory=time.perf_counter)
    started: float | None = None
    state: State = "queued"
    step: int = 0
    total_steps: int = 0  # steps of all its pipeline calls, once it runs
    listeners: list[asyncio.Queue] = field(default_factory=list)
    # The names of the job's adapters. Jobs with different adapters (or sets, or scales) may
    # share a call while the call names at most `max_adapters` adapters in all.
    adapters: tuple[str, ...] = ()
    # Jobs with equal join keys may share a joined call (step-level joining), which runs each
    # job's own pipeline call: a wider kind than `key`.
    join_key: Hashable = None
    # Whose request it is: its id names it only among its owner's requests ("" for handle
    # callers and callers without a key). Ids of other owners are unknown to a caller.
    owner: str = ""
    # Its tenant, the tenant's weight and what the job costs (image-steps at its size): the
    # queue serves tenants in weighted fair order of this cost (start-time fair queueing).
    tenant: str = ""
    weight: float = 1.0
    cost: float = 1.0
    start_tag: float = 0.0
    # Higher runs first (jobs of a priority above a running call's may preempt it); within a
    # priority, tenants' fair order.
    priority: int = 0
    weights_version: int | None = None  # the denoiser weights' version its call started with

    @property
    def ident(self) -> tuple[str, str]:
        return (self.owner, self.request_id)


@dataclass(frozen=True)
class FinishedRecord:
    """What is remembered of a request after it left the replica."""

    state: State
    step: int
    total_steps: int
    error: str | None = None


class _Arrivals:
    """When each tenant last sent a request, and from it each tenant's share of a joined call."""

    def __init__(self):
        self.seen: dict[str, float] = {}

    def shares(self, batching: BatchingConfig, jobs: list[Job]) -> Callable[[str], int]:
        """Each tenant's share: all of a joined call's rows, less `rows_kept_for_others` while
        another tenant is active (a request of its among `jobs`, queued or running, or one sent
        in the last `ACTIVE_S`), so that tenant's next request finds a row free at the next
        step instead of waiting for the call's rows to free up. The active tenants are found
        once: a call looks at many jobs."""
        limit = batching.max_batch_images
        kept = min(batching.rows_kept_for_others, limit - 1)
        now = time.perf_counter()
        for t in [t for t, at in self.seen.items() if now - at > ACTIVE_S]:
            del self.seen[t]  # only recent arrivals count (and the map stays small)
        if kept == 0:
            return lambda tenant: limit
        active = {*self.seen, *(j.tenant for j in jobs)}
        return lambda tenant: limit - kept if active - {tenant} else limit


class _TenantStats:
    """Per tenant: requests started, their queue wait, images done."""

    def __init__(self):
        self.counts: collections.defaultdict[str, collections.Counter] = collections.defaultdict(
            collections.Counter
        )

    def started(self, job: Job, now: float) -> None:
        stats = self.counts[job.tenant]
        stats["started"] += 1
        stats["queue_wait_us"] += int((now - job.enqueued) * 1e6)

    def report(self, queue, running) -> dict[str, dict[str, int]]:
        """Per tenant: queued and running requests and images, images done, queue wait (ms)."""
        out: dict[str, dict[str, int]] = {}
        for name, c in self.counts.items():
            out[name] = {"images_done": c["images_done"], "started": c["started"],
                         "queue_wait_ms": c["queue_wait_us"] // 1000}  # fmt: skip
        for where, jobs in (("queued", queue), ("running", running)):
            for j in jobs:
                t = out.setdefault(j.tenant, {"images_done": 0, "started": 0, "queue_wait_ms": 0})
                t[f"{where}_requests"] = t.get(f"{where}_requests", 0) + 1
                t[f"{where}_images"] = t.get(f"{where}_images", 0) + len(j.rows)
        return out


def _order(job: Job) -> tuple[int, float]:
    """Where a job goes in the queue: by priority (highest first), then by start tag."""
    return (-job.priority, job.start_tag)


class _FairTags:
    """Start-time fair queueing: a job's start tag is the later of the virtual time (the tag of
    the work last started) and its tenant's previous finish tag. One tenant alone: arrival
    order, and all of the replica."""

    def __init__(self):
        self.vtime = 0.0
        self.finish: dict[str, float] = {}

    def tag_idle(self) -> None:
        """A busy period ended: nobody owes anything."""
        self.vtime = max([self.vtime, *self.finish.values()])
        self.finish.clear()

    def tag(self, job: Job) -> None:
        job.start_tag = max(self.vtime, self.finish.get(job.tenant, 0.0))
        self.finish[job.tenant] = job.start_tag + job.cost / job.weight

    def started(self, job: Job) -> None:
        self.vtime = max(self.vtime, job.start_tag)

    def refund(self, job: Job, queue) -> bool:
        """`job` left the queue without running: its tenant is not charged for it, so its later
        jobs in `queue` move up by its share. Whether any moved."""
        share = job.cost / job.weight
        if job.tenant in self.finish:
            self.finish[job.tenant] -= share
        mine = [j for j in queue if j.tenant == job.tenant and j.priority == job.priority]
        later = [j for j in mine if j.start_tag > job.start_tag]
        for j in later:
            j.start_tag -= share
        return bool(later)


@dataclass(frozen=True)
class _LastCall:
    key: Hashable
    ended: float
    callers: int  # its images plus the images of its kind queued when it ended


class Scheduler:
    def __init__(
        self,
        batching: BatchingConfig,
        on_retire: Callable[[Job, State], None] | None = None,
        max_adapters: int = 1 << 30,
    ):
        self.batching = batching
        self.max_adapters = max_adapters
        self.queue: collections.deque[Job] = collections.deque()
        # Queued and running jobs, and the finished ones remembered, by (owner, request id).
        self.jobs: dict[tuple[str, str], Job] = {}
        self.running: list[Job] = []
        self.finished: collections.OrderedDict[tuple[str, str], FinishedRecord] = collections.OrderedDict()
        self._last_call: _LastCall | None = None
        # Whether each of the last arrivals came within `batch_gap_ms` of the one before: none
        # did, and a request is alone (a lone client), so it waits for no company.
        self._clustered: collections.deque[bool] = collections.deque(maxlen=4)
        self._last_arrival = float("-inf")
        self._arrivals = _Arrivals()
        self._wakeup = asyncio.Event()
        self.on_submit: Callable[[], None] | None = None  # after each submit (a joined run's)
        self._on_retire = on_retire
        # The queue is in priority, then fair (start-tag) order; each priority keeps its own
        # tags, so a job that starts before older ones of a lower priority moves no clock of theirs.
        self._fair: collections.defaultdict[int, _FairTags] = collections.defaultdict(_FairTags)
        self._stats = _TenantStats()
        self.preemptions = 0

    # ------------------------------------------------------------------ the queue

    def submit(self, job: Job) -> None:
        if job.ident in self.jobs:
            raise InvalidRequest(
                f"request_id: {job.request_id!r} is already queued or running", param="request_id"
            )
        if not self.queue and not self.running:  # a busy period ends: nobody owes anything
            for tags in self._fair.values():
                tags.tag_idle()
        self._fair[job.priority].tag(job)
        k = len(self.queue)
        while k > 0 and _order(self.queue[k - 1]) > _order(job):
            k -= 1  # behind every job of an earlier or equal place: arrival order among equals
        self.queue.insert(k, job)
        self.jobs[job.ident] = job
        self._clustered.append(job.enqueued - self._last_arrival <= self.batching.batch_gap_ms / 1e3)
        self._last_arrival = job.enqueued
        self._arrivals.seen[job.tenant] = job.enqueued
        self._wakeup.set()
        if self.on_submit is not None:
            self.on_submit()

    def queue_length(self) -> int:
        """Queued plus running images: the load figure for routing and autoscaling."""
        return sum(len(j.rows) for j in self.queue) + sum(len(j.rows) for j in self.running)

    def gather(self, shared: bool = False) -> list[Job]:
        """The oldest queued job and the queued jobs of its priority that can share its pipeline
        call; for a call that runs `shared` (joined), no tenant past its `share` of the call's rows.

        A job with more images than `max_batch_images` runs alone (the replica runs it in calls
        of at most that many), so no request makes one call larger than the setting.
        """
        head = self.queue[0]
        limit = self.batching.max_batch_images
        batch, images = [head], len(head.rows)
        adapters = set(head.adapters)
        held = collections.Counter({head.tenant: len(head.rows)})
        share, passed = self._shares(), set()
        for job in list(self.queue)[1:]:
            if images >= limit or job.priority != head.priority:
                break
            if shared and (job.tenant in passed or held[job.tenant] + len(job.rows) > share(job.tenant)):
                passed.add(job.tenant)  # the tenant's later jobs wait behind this one
                continue
            if job.key == head.key and images + len(job.rows) <= limit and self._fits(adapters, job):
                batch.append(job)
                images += len(job.rows)
                held[job.tenant] += len(job.rows)
                adapters.update(job.adapters)
        return batch

    def share(self, tenant: str) -> int:
        """The most rows of a joined call `tenant`'s requests may hold (`_Arrivals.shares`)."""
        return self._shares()(tenant)

    def _shares(self) -> Callable[[str], int]:
        return self._arrivals.shares(self.batching, [*self.queue, *self.running])

    def _fits(self, adapters: set[str], job: Job) -> bool:
        """Whether `job`'s adapters can join a call holding `adapters` (names)."""
        return len(adapters.union(job.adapters)) <= self.max_adapters

    def fill_deadline(self, batch: list[Job], images: int, joins: bool = False) -> float:
        """When a call led by `batch[0]` stops waiting for company: `batch_wait_ms` after the head
        arrived, or earlier, `batch_gap_ms` after the newest arrival (the burst is over), or at
        once when none of the last arrivals came within that gap of another (a lone client's
        requests: company is not coming).

        A call that runs joined (`joins`) waits for a burst that is arriving (the gap) and for
        nothing else: who comes later joins it at its next step.

        Callers of the last call coming back are waited for past quiet gaps: when the head is
        of the last call's kind and came within the window after that call ended, and the
        batch is smaller than that call plus what was queued beside it, the call waits up to
        `batch_wait_ms` after the device became free. Clients that send their next request when
        the last one is answered come back one by one, spread by the serving path's own work;
        cutting at the first gap split their waves into smaller and smaller calls (2 CPU cores,
        8 clients: mean batch 5.3 of 8), and once split, the halves never met again.
        """
        head = batch[0]
        window = self.batching.batch_wait_ms / 1e3
        gap = self.batching.batch_gap_ms / 1e3
        newest = max(j.enqueued for j in self.queue)  # the queue is in fair order, not arrival
        alone = not any(self._clustered)
        if joins:
            return head.enqueued if alone or gap == 0 else min(head.enqueued + window, newest + gap)
        last = self._last_call
        if (
            last is not None
            and head.key == last.key
            and head.enqueued <= last.ended + window
            and images < last.callers
        ):
            return max(head.enqueued, last.ended) + window
        if gap > 0:
            return head.enqueued if alone else min(head.enqueued + window, newest + gap)
        return head.enqueued + window

    async def next_batch(self, joins: Callable[[list[Job]], bool] | None = None) -> list[Job]:
        """Wait for work, gather a batch, wait for it to fill (never past the window), and
        mark it running. A batch that `joins` says will run joined waits only for a burst
        that is arriving: who comes later joins it at its next step."""
        while True:
            if not self.queue:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch, joined = self._gathered(joins)
            while (images := sum(len(j.rows) for j in batch)) < self.batching.max_batch_images:
                wait_until = self.fill_deadline(batch, images, joined)
                if time.perf_counter() >= wait_until:
                    break
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), wait_until - time.perf_counter())
                except TimeoutError:
                    pass
                if not self.queue:
                    break
                batch, joined = self._gathered(joins)
            if not self.queue:
                continue
            self._start(batch)
            self.running = list(batch)
            return batch

    def _start(self, batch: list[Job]) -> None:
        now = time.perf_counter()
        self._fair[batch[0].priority].started(batch[0])
        for job in batch:
            self.queue.remove(job)
            self._stats.started(job, now)
            job.state, job.started = "running", now
            calls = -(-len(job.rows) // self.batching.max_batch_images)
            job.total_steps = job.steps * calls

    def preempting(self, wait_s: float, can: Callable[[Job], bool]) -> list[Job]:
        """The jobs that preempt the running call now, marked running beside it: the head of the
        queue and its company (`gather`), if its priority is above every running job's, it has
        waited `wait_s` and `can` says it may; else none."""
        if not self.queue or not self.running:
            return []
        head = self.queue[0]
        if head.priority <= max(j.priority for j in self.running):
            return []
        if time.perf_counter() - head.enqueued < wait_s or not can(head):
            return []
        # Its company adds no adapter to the head's: `can` judged the head's beside the paused call's.
        batch = [head, *(j for j in self.gather()[1:] if can(j) and set(j.adapters) <= set(head.adapters))]
        self._start(batch)
        self.running += batch
        self.preemptions += 1
        return batch

    def _gathered(self, joins: Callable[[list[Job]], bool] | None) -> tuple[list[Job], bool]:
        """`gather()`, and whether the batch runs joined (then gathered with tenants' shares)."""
        batch = self.gather()
        joined = joins is not None and joins(batch)
        return (self.gather(shared=True) if joined else batch), joined

    def take_joiners(
        self,
        join_key: Hashable,
        room: int,
        fits: Callable[[Job], bool],
        held: collections.Counter | None = None,
    ) -> list[Job]:
        """Queued jobs of `join_key` that join a running call now (step-level joining), oldest first,
        marked running: at most `room` images, none past an older job that cannot join (of another
        kind, or larger than its tenant's `share`: it waits for the call to drain, not for ever).
        `held`: the call's rows by tenant, added to as jobs are taken; a job that would take its
        tenant past its share is passed over, and its tenant's later jobs with it."""
        out: list[Job] = []
        held = collections.Counter() if held is None else held
        share, passed = self._shares(), set()
        for job in list(self.queue):
            if job.tenant in passed:
                continue
            if job.join_key != join_key or len(job.rows) > min(room, share(job.tenant)) or not fits(job):
                break
            if held[job.tenant] + len(job.rows) > share(job.tenant):
                passed.add(job.tenant)
                continue
            held[job.tenant] += len(job.rows)
            self.queue.remove(job)
            self._fair[job.priority].started(job)
            self._stats.started(job, time.perf_counter())
            job.state, job.started, job.total_steps = "running", time.perf_counter(), job.steps
            self.running.append(job)
            out.append(job)
            room -= len(job.rows)
        return out

    def tenants(self) -> dict[str, dict[str, int]]:
        """Per tenant: queued and running requests and images, images done, queue wait (ms)."""
        return self._stats.report(self.queue, self.running)

    def left(self, job: Job) -> None:
        """A job of a joined call has ended while the call goes on."""
        if job in self.running:
            self.running.remove(job)

    def call_ended(self, batch: list[Job]) -> None:
        self.running = []
        key = batch[0].key
        callers = sum(len(j.rows) for j in batch) + sum(len(j.rows) for j in self.queue if j.key == key)
        self._last_call = _LastCall(key, time.perf_counter(), callers)

    # ------------------------------------------------------------------ outcomes

    def retire(self, job: Job, state: State, error: str | None = None) -> None:
        job.state = state
        if state == "done":
            self._stats.counts[job.tenant]["images_done"] += len(job.rows)
        self.jobs.pop(job.ident, None)
        self.finished[job.ident] = FinishedRecord(state, job.step, job.total_steps or job.steps, error)
        while len(self.finished) > FINISHED_KEPT:
            self.finished.popitem(last=False)
        if self._on_retire is not None:
            self._on_retire(job, state)

    def _leave_queue(self, job: Job) -> None:
        """A queued job leaves without running (aborted, failed): its tenant is not charged for
        it, so its later jobs move up by its share."""
        self.queue.remove(job)
        if self._fair[job.priority].refund(job, self.queue):
            self.queue = collections.deque(sorted(self.queue, key=_order))  # stable

    def fail(self, job: Job, err: ServingError) -> None:
        """End a queued or running job with `err` (a copy for its own request id)."""
        if job.state == "queued":
            self._leave_queue(job)
        if job.state in ("queued", "running"):
            self.retire(job, "failed", err.message)
        if not job.future.done():
            job.future.set_exception(err.with_request_id(job.request_id))

    def find(self, request_id: str, owner: str | None) -> tuple[list[Job], list[FinishedRecord]]:
        """The queued or running jobs and the finished records with this id, of `owner` only;
        with `owner` None (the admin, handle callers) of every owner."""
        if owner is not None:
            job, done = self.jobs.get((owner, request_id)), self.finished.get((owner, request_id))
            return ([job] if job else []), ([done] if done else [])
        jobs = [j for (_, rid), j in self.jobs.items() if rid == request_id]
        return jobs, [f for (_, rid), f in self.finished.items() if rid == request_id]

    def abort(self, request_ids: list[str], owner: str | None = None) -> dict[str, str]:
        """Abort by id, among `owner`'s requests (None: anyone's): `aborted`, `finished`
        (already done, nothing to do) or `unknown` (another owner's request is unknown too)."""
        out = {}
        for rid in request_ids:
            jobs, done = self.find(rid, owner)
            for job in jobs:
                self.abort_job(job, "aborted")
            out[rid] = "aborted" if jobs else "finished" if done else "unknown"
        return out

    def abort_job(self, job: Job, why: str) -> bool:
        """Abort a queued or running job; its caller gets `Aborted` at once. A running job's
        pipeline call stops at the next step once no job in it still wants its images."""
        if job.state not in ("queued", "running"):
            return False
        was = job.state
        if was == "queued":
            self._leave_queue(job)
        self.retire(job, "aborted")
        if not job.future.done():
            job.future.set_exception(Aborted(f"request {why} while {was}", request_id=job.request_id))
        return True
