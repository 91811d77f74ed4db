"""The job runner: runs an ingress's jobs as asyncio tasks, renews their leases, resumes jobs
whose ingress went away (same prepared request, so the same seed and the same images), prunes
old outputs, and calls webhooks. No Ray here: the runner is handed the function that streams a
request to the replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from serve_app.config import JobsConfig
from serve_app.errors import Aborted, ServingError
from serve_app.formats import tensor_file
from serve_app.jobs import webhooks
from serve_app.jobs.store import JOB_PREFIX, Store
from serve_app.schemas import (
    MEDIA_TYPES,
    GenerationResult,
    JobOutput,
    JobRecord,
    JobTensors,
    PreparedRequest,
    StepEvent,
)

logger = logging.getLogger("ray.serve")

Stream = Callable[[PreparedRequest], AsyncIterator[StepEvent | GenerationResult]]


def new_job_request_id() -> str:
    """The request id of one attempt of a job: random, so that knowing a job's id (a webhook
    receiver does) gives no handle on its requests."""
    return f"jr_{uuid.uuid4().hex}"


class JobRunner:
    """Runs this ingress's jobs; renews their leases, resumes orphaned ones, prunes the store.

    Who runs a job is decided by files of the store, not by the record: the lease (renewed by
    its owner), and for each attempt after the first a claim file only one ingress can create.
    A record is never written back over a finished one by a runner that does not own the job,
    and an owner that finds its job finished or taken by another stops running it.
    """

    def __init__(
        self,
        store: Store,
        cfg: JobsConfig,
        stream: Stream,
        abort: Callable[[str], Awaitable[Any]],
        present: Callable[[JobRecord], Any],
        room: Callable[[PreparedRequest], Awaitable[None]] | None = None,
    ):
        self.store, self.cfg, self.stream, self.abort_request = store, cfg, stream, abort
        self.room = room  # waits until the job's tenant has room, before it takes a run slot
        self.present = present  # a job as callers see it, with fresh links to its outputs
        self.owner = uuid.uuid4().hex[:12]
        self.jobs: dict[str, JobRecord] = {}  # the jobs this ingress runs, as it last saved them
        self.tasks: dict[str, asyncio.Task] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._hooks: set[asyncio.Task] = set()
        self._loop_task: asyncio.Task | None = None
        self._changed: dict[str, asyncio.Event] = {}
        self.webhook_key = b""
        self.public_only = not cfg.webhook_hosts  # no allow-list: webhooks reach public addresses only
        # At most `max_running` jobs are in the engine replicas' queues at once (made in start()).
        self._slots: asyncio.Semaphore | None = None
        self.waiting: set[str] = set()  # jobs held here until a slot frees
        # The caller of each job being admitted, by the task admitting it (see `admission`).
        self.admitting: dict[asyncio.Task, tuple[str, str]] = {}  # (caller, tenant)

    def start(self) -> None:
        """Start the background loop (renew, resume, prune); call from the event loop."""
        if self._loop_task is None or self._loop_task.done():
            key = self.cfg.webhook_secret or os.environ.get(self.cfg.webhook_secret_env) or ""
            self.webhook_key = key.encode()
            if self._slots is None:
                self._slots = asyncio.Semaphore(self.cfg.max_running)
            self._loop_task = asyncio.ensure_future(self._background())

    # ------------------------------------------------------------------ submit, abort, watch

    async def submit(self, job: JobRecord, request: PreparedRequest) -> JobRecord | None:
        """Store and start a new job; None if a job with its id exists already."""
        job.owner = self.owner
        await asyncio.to_thread(self.store.save_request, job.id, request)
        if not await asyncio.to_thread(self.store.create_job, job):
            return None
        await asyncio.to_thread(self.store.renew, job.id, self.owner, time.time() + self.cfg.lease_s)
        # Counted in `jobs` from here on: its admission ends now, so that it is never counted twice.
        self.admitting.pop(asyncio.current_task(), None)
        self._run(job, request)
        return job

    async def abort(self, job: JobRecord) -> JobRecord:
        """Abort an unfinished job: its replica request stops, and the job ends `aborted`,
        whichever ingress runs it (that one sees the record finished and stops). A job held
        here for a run slot was never sent: it is just cancelled."""
        task = self.tasks.get(job.id)
        if task is not None and job.id in self.waiting:  # never sent: nothing to stop elsewhere
            task.cancel()
        else:
            await self.abort_request(job.request_id)
            if task is not None:  # running here: it ends once its request has stopped
                try:
                    await asyncio.wait_for(asyncio.shield(task), 5.0)
                except TimeoutError:
                    task.cancel()
        current = await asyncio.to_thread(self.store.load_job, job.id) or job
        if not current.finished:
            current.state, current.finished_at = "aborted", time.time()
            current.error = Aborted("aborted by a DELETE", request_id=job.request_id).to_body()["error"]
            await self._save(current, force=True)
        return current

    async def watch(self, job_id: str, timeout: float) -> None:
        """Wait until this ingress saves a change to `job_id`, or `timeout` passes."""
        event = self._changed.setdefault(job_id, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            pass

    async def _save(self, job: JobRecord, force: bool = False) -> bool:
        """Write the record, unless (without `force`) the job is gone (deleted, pruned: files written
        meanwhile go too), finished, or another ingress's: then this ingress stops running it."""
        async with self._locks.setdefault(job.id, asyncio.Lock()):  # one save of a job at a time
            if not force:
                stored = await asyncio.to_thread(self.store.load_job, job.id)
                if stored is None or stored.owner != self.owner or (stored.finished and not job.finished):
                    self._drop(job.id)
                    if stored is None and (job.outputs or job.tensors):
                        await asyncio.to_thread(self.store.delete, job.id)
                    return False
            await asyncio.to_thread(self.store.save_job, job)
        if job.finished:
            self.jobs.pop(job.id, None)
        event = self._changed.pop(job.id, None)
        if event is not None:
            event.set()
        return True

    def _drop(self, job_id: str) -> None:
        """Stop running a job this ingress no longer owns (the caller's result is elsewhere)."""
        self.jobs.pop(job_id, None)
        task = self.tasks.get(job_id)
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    # ------------------------------------------------------------------ running

    def _run(self, job: JobRecord, request: PreparedRequest) -> None:
        self.jobs[job.id] = job
        task = asyncio.ensure_future(self._execute(job, request))
        self.tasks[job.id] = task

        def done(t: asyncio.Task) -> None:
            if self.tasks.get(job.id) is t:
                del self.tasks[job.id]

        task.add_done_callback(done)

    def unfinished(self, caller: str | None = None) -> int:
        """Jobs this ingress runs, holds or is admitting that have not ended (of `caller`, or of all)."""
        admitting = sum(1 for c, _ in self.admitting.values() if caller is None or c == caller)
        return admitting + sum(1 for j in self.jobs.values() if caller is None or j.caller == caller)

    @contextlib.contextmanager
    def admission(self, caller: str, tenant: str = ""):
        """Counts a job being checked and stored as unfinished, so that a burst of submissions
        sent at once is bounded like the same jobs sent one by one. The count ends when `submit`,
        awaited in the same task, puts the job among the jobs this ingress runs, or at the end."""
        task = asyncio.current_task()
        self.admitting[task] = (caller, tenant)
        try:
            yield
        finally:
            self.admitting.pop(task, None)

    async def _execute(self, job: JobRecord, request: PreparedRequest) -> None:
        """Hold the job here until a run slot frees, then run it."""
        self.start()  # the slots, and a background loop that died is started again
        self.waiting.add(job.id)
        try:
            try:  # a tenant past its quota holds no slot others could use
                await self.room(request) if self.room is not None else None
            except ServingError as e:  # a bound it can never meet (more than a minute's rate)
                job.state, job.error, job.finished_at = "failed", e.to_body()["error"], time.time()
                return self._notify(job, "completed") if await self._save(job) else None
            async with self._slots:
                self.waiting.discard(job.id)
                await self._stream(job, request)
        finally:
            self.waiting.discard(job.id)

    async def _stream(self, job: JobRecord, request: PreparedRequest) -> None:
        last_save = 0.0
        try:
            async for item in self.stream(request):
                if isinstance(item, StepEvent):
                    first = job.state == "queued"
                    job.state, job.step, job.total_steps = "running", item.step, item.total_steps
                    job.queue_position = None
                    if first:
                        job.started_at = time.time()
                    if first or time.monotonic() - last_save > 0.2 or item.step == item.total_steps:
                        last_save = time.monotonic()
                        if not await self._save(job):
                            await self.abort_request(request.request_id)  # this attempt's own id
                            return
                        self._notify(job, "start" if first else "progress")
                    continue
                job.outputs = _outputs(await asyncio.to_thread(self.store.put_outputs, job.id, item), item)
                job.tensors = await asyncio.to_thread(_tensors, self.store, job.id, item)
                job.metrics = item.metrics
                job.attempts += item.attempts - 1
                # Done is every step done, whichever step events this ingress saw last.
                job.state, job.step, job.finished_at = "done", job.total_steps, time.time()
        except asyncio.CancelledError:
            raise  # the ingress is going away (its lease runs out, another resumes the job)
        except ServingError as e:
            job.state = "aborted" if isinstance(e, Aborted) else "failed"
            job.error, job.finished_at = e.to_body()["error"], time.time()
        except Exception as e:  # never leave a job running forever
            logger.exception("job %s failed", job.id, exc_info=e)
            job.state, job.finished_at = "failed", time.time()
            job.error = ServingError("internal error; the server log has the details").to_body()["error"]
        if not job.finished:  # the stream ended without a result
            job.state, job.finished_at = "failed", time.time()
            job.error = ServingError("the request ended without a result").to_body()["error"]
        if await self._save(job):
            self._notify(job, "completed")

    # ------------------------------------------------------------------ webhooks

    def _notify(self, job: JobRecord, event: str) -> None:
        hook = job.webhook
        if hook is None or event not in hook.events:
            return
        if event == "completed":
            coro = self._deliver_final(job)
        elif any(not t.done() for t in self._hooks if t.get_name() == job.id):
            return  # one progress call in flight per job at most
        else:  # start and progress: one try each, never blocking the job
            body = webhooks.payload(event, self.present(job))
            coro = webhooks.post(
                hook.url, body, self.webhook_key, self.cfg.webhook_timeout_s, self.public_only
            )
        task = asyncio.ensure_future(coro)
        task.set_name(job.id)
        self._hooks.add(task)
        task.add_done_callback(self._hooks.discard)

    async def _deliver_final(self, job: JobRecord) -> None:
        hook = job.webhook
        body = webhooks.payload("completed", self.present(job))
        delay = self.cfg.webhook_backoff_s
        while hook.attempts < self.cfg.webhook_max_attempts:
            hook.attempts += 1
            status, error = await webhooks.post(
                hook.url, body, self.webhook_key, self.cfg.webhook_timeout_s, self.public_only
            )
            hook.last_status, hook.last_error = status, error
            if status is not None and 200 <= status < 300:
                hook.state = "delivered"
                break
            if hook.attempts < self.cfg.webhook_max_attempts:
                await asyncio.sleep(delay)
                delay *= 2
        else:
            hook.state = "failed"
        await self._save(job)  # not if the job was deleted meanwhile

    # ------------------------------------------------------------------ background: renew, resume, prune

    async def _background(self) -> None:
        last_prune = 0.0
        while True:
            try:
                await self._renew()
                await self._resume_orphans()
                if time.monotonic() - last_prune > 60:
                    last_prune = time.monotonic()
                    limit = self.cfg.max_store_mb * 2**20
                    await asyncio.to_thread(self.store.prune, self.cfg.retention_s, limit)
            except Exception as e:
                logger.warning("jobs: background pass failed: %s", e)
            await asyncio.sleep(self.cfg.sweep_interval_s)

    async def _renew(self) -> None:
        until = time.time() + self.cfg.lease_s
        for job_id in list(self.tasks):
            lease = await asyncio.to_thread(self.store.lease, job_id)
            if lease is not None and lease[0] != self.owner:
                self._drop(job_id)  # another ingress took it over (this one was too slow)
                continue
            await asyncio.to_thread(self.store.renew, job_id, self.owner, until)

    async def _resume_orphans(self) -> None:
        """Take over unfinished jobs whose owner stopped renewing their lease, and run them again."""
        now = time.time()
        keys = await asyncio.to_thread(self.store.keys)
        for job_id in keys:
            if not job_id.startswith(JOB_PREFIX) or job_id in self.tasks:
                continue
            if (lease := await asyncio.to_thread(self.store.lease, job_id)) is not None and lease[1] > now:
                continue
            job = await asyncio.to_thread(self.store.load_job, job_id)  # read now, not from a listing
            if job is None or job.finished:
                continue
            # Read again after the record: whoever took the job since renewed its lease before saving it.
            if (lease := await asyncio.to_thread(self.store.lease, job_id)) is not None and lease[1] > now:
                continue
            if lease is None and now - job.created_at < self.cfg.lease_s:
                continue  # just created: its ingress stores the record first, then its lease
            request = await asyncio.to_thread(self.store.load_request, job_id)
            attempt = job.attempts + 1
            if request is None or not await asyncio.to_thread(self.store.claim, job_id, attempt, self.owner):
                continue  # another ingress won this attempt
            await asyncio.to_thread(self.store.renew, job_id, self.owner, now + self.cfg.lease_s)
            job.owner, job.attempts = self.owner, attempt
            if attempt > 1 + self.cfg.max_resumes:
                job.state, job.finished_at = "failed", time.time()
                job.error = ServingError(
                    f"its ingress went away {attempt - 1} times; not resumed again", request_id=job.request_id
                ).to_body()["error"]
                await self._save(job, force=True)
                self._notify(job, "completed")
                continue
            # A new request id: the lost attempt may still be known to a replica under the old one.
            job.request_id = new_job_request_id()
            job.state, job.step, job.started_at = "queued", 0, None
            logger.warning("job %s: its ingress went away; resuming it (attempt %d)", job_id, attempt)
            await self._save(job, force=True)
            self._run(job, request.model_copy(update={"request_id": job.request_id}))


def _tensors(store: Store, key: str, result: GenerationResult) -> JobTensors | None:
    """A result's tensors stored as one safetensors file beside its files; None if it has none."""
    if not tensor_file.has_tensors(result):
        return None
    name, size = store.put_tensors(key, tensor_file.encode(result, tensor_file.SAFETENSORS))
    return JobTensors(name=name, bytes=size)


def _outputs(names: list[tuple[str, int]], result: GenerationResult) -> list[JobOutput]:
    """A job's outputs as its record lists them, from the (name, size) of each stored file."""
    return [
        JobOutput(
            index=i,
            name=name,
            content_type=MEDIA_TYPES[result.output_format],
            bytes=size,
            seed=seed,
            prompt_index=idx,
        )
        for i, ((name, size), seed, idx) in enumerate(
            zip(names, result.seeds, result.prompt_index, strict=True)
        )
    ]
