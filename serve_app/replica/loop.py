"""The replica's engine loop: it takes the scheduler's next batch, runs it on the engine thread
and answers its requests, one call at a time.

A batch runs as one whole call (its rows in pipeline calls of at most `max_batch_images`), or
as a joined call when step-level joining is on: queued requests of the same kind join it
between two denoising steps, and each request is answered as soon as its own rows are done.
Either way the call ends the same way: the scheduler hears of it, and after a fatal device
error the replica leaves, or after failures in a row it runs its self-test.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from serve_app import metrics
from serve_app.config import BatchingConfig
from serve_app.engine import CallParams, Engine, EngineOutput, Row
from serve_app.errors import EngineFailure, ReplicaLost, ServingError
from serve_app.replica.adapters import AdapterResidency
from serve_app.replica.foresight import Foresight
from serve_app.replica.health import Health
from serve_app.replica.intake import cohorts, work
from serve_app.replica.preemption import Pause, between_steps
from serve_app.replica.results import step_hook
from serve_app.replica.scheduler import Job, Scheduler


@dataclasses.dataclass(eq=False)
class _Member:
    """A request in a joined call: the seat its rows run in (with the requests that joined the
    run beside it), where its rows start there, and the most rows and requests it ran with."""

    job: Job
    seat: Any
    start: int
    images: int = 0
    requests: int = 0


@dataclasses.dataclass(eq=False)
class _Joined:
    """A joined run's state shared by the event loop and the engine thread: its requests by
    id(job) (request ids are unique per owner only), and the inbox of requests handed over to
    join at the next step. `closed`: the run takes nobody more; `stop`: end it now."""

    batch: list[Job]
    params: CallParams
    adapters: tuple
    members: dict[int, _Member] = dataclasses.field(default_factory=dict)
    inbox: list[Job] = dataclasses.field(default_factory=list)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    closed: bool = False
    stop: bool = False
    # Rows of the requests let in and not yet answered, by tenant, counted on the event loop:
    # what the run holds or will hold at its next step (the engine thread's count lags behind).
    # Parked seats' rows are not in it (`preemption.between_steps`).
    admitted: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    # Seats parked for requests of a higher priority (seat: its rows by tenant): the engine
    # thread leaves these out of its next steps. `news`: something was handed to it.
    parked: dict = dataclasses.field(default_factory=dict)
    news: threading.Event = dataclasses.field(default_factory=threading.Event)
    # The images of each step run since the event loop last looked: it records them (Ray's
    # metrics cost 0.1-0.5 ms a call, time the engine thread owes the device).
    step_images: list[int] = dataclasses.field(default_factory=list)
    run: Any = None  # the engine's `JoinedRun`, once open
    foreseen: set = dataclasses.field(default_factory=set)  # cohorts run ahead (`foresight`)

    def settle(self, scheduler: Scheduler, health: Health) -> None:
        """Answer each request of a joined call whose rows have all ended. One failed denoiser
        call fails every request in it with one error, counted once."""
        members, params = self.members, self.params
        errors: dict[int, ServingError] = {}
        for key, m in list(members.items()):
            if not m.seat.done:
                continue
            del members[key]
            job = m.job
            if m.seat in self.parked:  # it ended as it parked: its rows left `admitted` then
                left = self.parked[m.seat]
                left[job.tenant] -= len(job.rows)
                if left.total() <= 0:
                    del self.parked[m.seat]
            else:
                self.admitted[job.tenant] -= len(job.rows)
            scheduler.left(job)
            if job.state != "running":  # aborted during the call: its images are dropped
                continue
            error = m.seat.error
            if error is not None:
                if id(error) not in errors:  # judged without a self-test: the run goes on
                    shared = len(members) + 1
                    errors[id(error)] = health.classify(error, job.request_id, len(job.rows), params, shared)
                scheduler.fail(job, errors[id(error)])
                continue
            health.consecutive_failures = 0
            out = m.seat.output.slice(m.start, m.start + len(job.rows))
            out.batch_images, out.batch_requests = m.images, m.requests
            scheduler.retire(job, "done")
            if not job.future.done():
                job.future.set_result(out)


class EngineLoop:
    """Runs the scheduler's batches on the engine thread, the thread that runs torch (but for
    encoding joiners' prompts ahead, `foresight`, while it waits on the device).

    `leave` is called after a fatal device error, once every queued request has been handed
    back: it ends the replica (Serve starts another).
    """

    def __init__(
        self,
        engine: Engine,
        scheduler: Scheduler,
        adapters: AdapterResidency,
        health: Health,
        engine_thread: ThreadPoolExecutor,
        leave: Callable[[asyncio.AbstractEventLoop], None],
    ):
        self.engine, self.scheduler, self.adapters, self.health = engine, scheduler, adapters, health
        self._engine_thread = engine_thread
        self._leave = leave
        self.foresight = Foresight()

    @property
    def batching(self) -> BatchingConfig:
        return self.scheduler.batching

    async def run(self) -> None:
        """Run batches until cancelled; one call's failure fails its requests, not the loop."""
        loop = asyncio.get_running_loop()
        while True:
            batch = await self.scheduler.next_batch(self._joins)
            try:
                if self._joins(batch):
                    await self._run_joined(batch, loop)
                else:
                    await self._run_whole(batch, loop)
            finally:
                self.health.call_started = None
                self.scheduler.call_ended(batch)
                metrics.set_queue_length(self.engine.model_name, self.scheduler.queue_length())
            await self._after_call(loop)

    async def _after_call(self, loop: asyncio.AbstractEventLoop) -> None:
        """After a fatal device error: hand every queued request back (the ingress sends them to
        another replica) and leave. After failures in a row: run the self-test, a call of its own
        (a self-test that hangs makes the replica unhealthy like any call)."""
        if self.health.fatal:
            for job in list(self.scheduler.queue):
                self.scheduler.fail(job, self.health.lost())
            self._leave(loop)
        elif self.health.needs_self_test:
            self.health.call_started = time.monotonic()
            try:
                await loop.run_in_executor(self._engine_thread, self.health.self_test, self.engine)
            finally:
                self.health.call_started = None

    def _hold_adapters(self, batch: list[Job], paused: list[Job] = ()) -> None:
        """On the engine thread: load the adapters of the call's requests this replica lacks.
        The scheduler puts at most max_loaded in a call, and none of them (nor one of a call
        `paused` for this one) is evicted to make room for another."""
        refs = [ref for job in batch for ref in work(job).request.loras]
        also = [ref for job in paused for ref in work(job).request.loras]
        names = {ref.loaded_name for ref in [*refs, *also]}
        for ref in refs:
            self.adapters.hold(ref.loaded_name, ref.path, keep=names)

    # ------------------------------------------------------------------ whole calls

    async def _run_whole(self, batch: list[Job], loop: asyncio.AbstractEventLoop) -> None:
        """Run `batch` as one call and answer each request with its slice of the output."""
        rows = [r for j in batch for r in j.rows]
        hook = step_hook(batch, loop)
        pause = Pause.for_call(self, batch, loop)
        watch = None
        if pause is not None:  # requests of a higher priority may run between two of its steps
            hook, watch = pause.hook(hook), loop.create_task(pause.watch())
        try:
            self.health.call_started = time.monotonic()
            out = await loop.run_in_executor(self._engine_thread, self.run_call, batch, rows, hook)
        except Exception as e:  # one call's failure; the loop goes on
            err = await self._judged(e, batch[0], len(rows), loop, requests=len(batch))
            for job in batch:
                if job.state == "running":
                    self.scheduler.fail(job, err)
        else:
            self.health.consecutive_failures = 0
            self.deliver(batch, out)
        finally:
            left = []
            if watch is not None:
                watch.cancel()
                left = pause.left()  # handed over, not run: the call had ended (or was cancelled)
                if self.health.fatal or (left and asyncio.current_task().cancelling()):
                    lost = self.health.lost() if self.health.fatal else ReplicaLost("the replica stopped")
                    for job in left:  # the ingress sends them to another replica
                        self.scheduler.fail(job, lost)
                    left = []
        if left:  # handed over after the call's last step: they run now, as a call of their own
            await self._run_whole(left, loop)

    async def _judged(
        self, e: Exception, job: Job, rows: int, loop: asyncio.AbstractEventLoop, requests: int
    ) -> ServingError:
        """A failed call's error for its `requests` requests. A failure no check foresaw is
        judged by the self-test (`Health.recheck`): a lone request's 400 if the model runs its
        defaults (a shared call's 500, not counted)."""
        params = work(job).params
        err = self.health.classify(e, job.request_id, rows, params, requests)
        if type(err) is not EngineFailure or self.health.fatal:
            return err
        engine = work(job).engine or self.engine
        self.health.call_started = time.monotonic()
        try:
            verdict = await loop.run_in_executor(
                self._engine_thread, self.health.recheck, engine, e, job.request_id, params, requests
            )
        finally:
            self.health.call_started = None
        return verdict or err

    def run_call(
        self, batch: list[Job], rows: list[Row], hook, paused: list[Job] | None = None
    ) -> EngineOutput:
        """On the engine thread: load the call's adapters if this replica lacks them, then run
        the rows in pipeline calls of at most `max_batch_images` (one call unless one job is
        larger). `paused`: the jobs of a call paused in its step hook for this one."""
        params, engine = work(batch[0]).params, work(batch[0]).engine or self.engine
        for job in batch:
            job.weights_version = getattr(engine, "weights_version", None)
        self._hold_adapters(batch, paused or ())
        run = engine.run if paused is None else engine.run_paused
        size = self.batching.max_batch_images
        chunks = [rows[k : k + size] for k in range(0, len(rows), size)]
        parts = []
        for k, chunk in enumerate(chunks):
            offset = k * params.steps  # progress counts on across the calls of one request
            part = run(chunk, params, lambda i, n, x, o=offset: hook(o + i, n * len(chunks), x))
            metrics.observe_batch(engine.model_name, len(chunk))
            parts.append(part)
            if part.interrupted:
                break
        out = EngineOutput.concat(parts)
        out.batch_images = max(len(c) for c in chunks)
        out.pipeline_calls = len(parts)
        return out

    def deliver(self, batch: list[Job], out: EngineOutput) -> None:
        start = 0
        for job in batch:
            part = out.slice(start, start + len(job.rows))
            start += len(job.rows)
            part.batch_requests = len(batch)
            if job.state != "running":  # aborted during the call: its images are dropped
                continue
            self.scheduler.retire(job, "done")
            if not job.future.done():
                job.future.set_result(part)

    # ------------------------------------------------------------------ step-level joining

    def _joins(self, batch: list[Job]) -> bool:
        """Whether `batch` runs joined: the setting is on (by default where the engine runs on a
        GPU), the engine can join its calls, and its rows fit one call and share one adapter set
        (joiners must have the same)."""
        rows = [r for j in batch for r in j.rows]
        device = getattr(self.engine, "device", None)
        return (
            self.batching.joins_on(getattr(device, "type", "cpu"))
            and work(batch[0]).engine is None  # a pool's checkpoints run whole calls
            and len(rows) <= self.batching.max_batch_images
            and all(r.adapters == rows[0].adapters for r in rows)
            and self.engine.can_join(work(batch[0]).params)
        )

    async def _run_joined(self, batch: list[Job], loop: asyncio.AbstractEventLoop) -> None:
        """Run `batch` as a joined call: between two denoising steps, queued requests of the
        same kind join it (up to `max_batch_images` rows), and each request is answered as soon
        as its own rows are done.

        The engine thread drives the steps back to back (`_drive`) and never waits for this
        event loop: after each step it posts `_between_steps` here, which answers the requests
        whose rows ended and hands queued joiners over through the run's inbox; they join at
        the step after. A busy event loop (requests coming in, results going out) so delays
        a joiner, never the device."""
        params, adapters = work(batch[0]).params, batch[0].rows[0].adapters
        joined = _Joined(batch, params, adapters)
        self.health.call_started = time.monotonic()
        on_engine = functools.partial(loop.run_in_executor, self._engine_thread)
        # What requests still running at the end get: they lost their call (the loop stopped,
        # a fatal error) and their rows ended unfinished, or the call failed as a whole.
        lost: ServingError = EngineFailure("engine error: the call stopped before this request was done")
        failure: Exception | None = None
        run = None
        try:
            run = joined.run = await on_engine(self._open_joined, batch, params, adapters)
            joined.inbox = list(batch)
            for job in batch:
                joined.admitted[job.tenant] += len(job.rows)
            # An arrival is let in at once, to join at the engine's next step; waiting for the
            # step in flight to end first would cost it a step more.
            self.scheduler.on_submit = functools.partial(loop.call_soon, self._between_steps, joined)
            await on_engine(self._drive, run, joined, loop)
        except asyncio.CancelledError:
            joined.stop = True
            raise
        except Exception as e:  # the run could not start or go on (an adapter failed to load)
            failure = e
        finally:
            self.scheduler.on_submit = None
            with joined.lock:
                joined.closed = True
                left = list(joined.inbox)
            if run is not None:
                await on_engine(run.close)
            joined.settle(self.scheduler, self.health)
            everyone = [*batch, *left, *(m.job for m in joined.members.values())]
            if failure is not None:  # judged once the run is closed (the self-test may run)
                shared = len({id(j) for j in everyone})
                lost = await self._judged(failure, batch[0], len(batch[0].rows), loop, requests=shared)
            for job in everyone:
                if job.state == "running":
                    self.scheduler.fail(job, lost)

    def _drive(self, run, joined: _Joined, loop: asyncio.AbstractEventLoop) -> None:
        """On the engine thread: step the run until no row is left and nobody is handed over."""
        while True:
            with joined.lock:
                joining, joined.inbox = joined.inbox, []
                run.park(joined.parked)
                joined.news.clear()
                if not joining and not run.active:
                    joined.closed = True
                    return
            if not joining and run.stepping == 0:  # only parked seats: until the event loop unparks
                joined.news.wait(0.05)
                loop.call_soon_threadsafe(self._between_steps, joined)
                if self.health.fatal or joined.stop:
                    return
                continue
            self._joined_step(run, joined, joining, loop)
            self.health.call_started = time.monotonic()
            loop.call_soon_threadsafe(self._between_steps, joined)
            if self.health.fatal or joined.stop:
                return

    def _between_steps(self, joined: _Joined) -> None:
        """On the event loop after a step: answer the requests that are done, and hand the
        queued requests that can join over to the engine thread (none once the run ended)."""
        joined.settle(self.scheduler, self.health)
        images, joined.step_images = joined.step_images, []
        for n in images:
            metrics.observe_batch(self.engine.model_name, n)
        with joined.lock:
            if joined.closed:
                return
            fits = lambda j: all(r.adapters == joined.adapters for r in j.rows)  # noqa: E731
            key = joined.batch[0].join_key
            parked = set(joined.parked)
            room = between_steps(self, joined, lambda j: j.join_key == key and fits(j))
            if room > 0:
                taken = self.scheduler.take_joiners(key, room, fits, joined.admitted)
                joined.inbox += taken
                if taken and joined.run is not None and self.batching.encode_ahead:
                    self.foresight.ahead(joined)
            if joined.inbox or set(joined.parked) != parked:  # news for the engine thread
                joined.news.set()

    def _open_joined(self, batch: list[Job], params: CallParams, adapters):
        self._hold_adapters(batch)
        return self.engine.open_joined(params, tuple(sorted((n, s) for n, s in adapters if s != 0)))

    def _joined_step(self, run, joined: _Joined, joining: list[Job], loop) -> None:
        """On the engine thread: add the joining requests, then run one step of all. Requests
        that join at the same step with the same call (`Job.key`) share one seat, one pipeline
        call: the host work of a step grows with the seats, not the rows. The run's adapters
        are held again first: an admin call between two steps may have evicted or switched
        them (the run puts its own set back in force at every step)."""
        self._hold_adapters(joined.batch)
        for jobs in cohorts(joining):
            seat = run.add([r for j in jobs for r in j.rows], step_hook(jobs, loop), work(jobs[0]).params)
            start = 0
            for job in jobs:
                job.weights_version = getattr(self.engine, "weights_version", None)
                joined.members[id(job)] = _Member(job, seat, start)
                start += len(job.rows)
        joined.step_images.append(run.active)
        members = list(joined.members.values())
        for m in members:
            m.images = max(m.images, run.active)
            m.requests = max(m.requests, len(members))
        run.step()
