"""Jobs that outlive their connection, and outputs that outlive their replica.

`Store` keeps job records, the prepared requests that make them, and output files on a file
system every ingress replica shares: a local directory by default, any fsspec URL for a cluster.
`JobRunner` runs an ingress's jobs as asyncio tasks, renews their leases, resumes jobs whose
ingress went away (same prepared request, so the same seed and the same images), prunes old
outputs, and calls webhooks. No Ray here: the runner is handed the function that streams a
request to the replicas.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import hmac
import json
import logging
import os
import posixpath
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import fsspec

from serve_app import webhooks
from serve_app.config import JobsConfig
from serve_app.errors import Aborted, ServingError
from serve_app.schemas import (
    MEDIA_TYPES,
    GenerationResult,
    JobOutput,
    JobRecord,
    PreparedRequest,
    StepEvent,
)

logger = logging.getLogger("ray.serve")

JOB_PREFIX = "job_"


def job_id_for(idempotency_key: str | None, caller: str) -> str:
    """A new job id, or with an idempotency key the same id for the same key and caller."""
    if idempotency_key is None:
        return JOB_PREFIX + uuid.uuid4().hex
    digest = hashlib.sha256(f"{caller}\0{idempotency_key}".encode()).hexdigest()
    return JOB_PREFIX + digest[:32]


def body_hash(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


class Store:
    """Records and files under one root: `objects/<key>/` per job or stored result, holding
    `job.json` (jobs), `request.json` (jobs), `meta.json` and the outputs `<index>.<format>`."""

    def __init__(self, url: str):
        self.fs, root = fsspec.core.url_to_fs(os.path.expanduser(url))
        self.root = root.rstrip("/")
        self.fs.makedirs(self._path("objects"), exist_ok=True)

    def _path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def _write(self, path: str, data: bytes) -> None:
        # Write then rename, so a reader on another process never sees half a record.
        tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
        with self.fs.open(tmp, "wb") as f:
            f.write(data)
        self.fs.mv(tmp, path)

    def _create(self, path: str, data: bytes) -> bool:
        """Write `path` only if nothing is there yet (True), else leave it (False): the one
        writer that wins a race is the only one that gets True."""
        try:
            with self.fs.open(path, "xb") as f:
                f.write(data)
            return True
        except FileExistsError:
            return False
        except (ValueError, NotImplementedError):  # a file system without exclusive create
            if self.fs.exists(path):
                return False
            self._write(path, data)
            return True

    def _read(self, path: str) -> bytes | None:
        try:
            with self.fs.open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    # ------------------------------------------------------------------ secrets

    def secret(self, name: str, env: str) -> bytes:
        """A signing key: from the environment variable `env`, else one made once and kept in
        the store (every ingress sharing the store shares it)."""
        if os.environ.get(env):
            return os.environ[env].encode()
        path = self._path(f"{name}.key")
        self._create(path, secrets.token_hex(32).encode())  # the first ingress's key is everyone's
        return self._read(path)

    # ------------------------------------------------------------------ jobs

    def save_job(self, job: JobRecord) -> None:
        self.fs.makedirs(self._path("objects", job.id), exist_ok=True)
        self._write(self._path("objects", job.id, "job.json"), job.model_dump_json().encode())

    def create_job(self, job: JobRecord) -> bool:
        """Store a new job; False if a job with its id exists (an idempotency key reused)."""
        self.fs.makedirs(self._path("objects", job.id), exist_ok=True)
        return self._create(self._path("objects", job.id, "job.json"), job.model_dump_json().encode())

    def load_job(self, job_id: str) -> JobRecord | None:
        data = self._read(self._path("objects", job_id, "job.json"))
        return JobRecord.model_validate_json(data) if data is not None else None

    def jobs(self) -> list[JobRecord]:
        out = []
        for key in self.keys():
            if key.startswith(JOB_PREFIX) and (job := self.load_job(key)) is not None:
                out.append(job)
        return sorted(out, key=lambda j: j.created_at, reverse=True)

    def renew(self, job_id: str, owner: str, until: float) -> None:
        """The lease: its owner promises to renew it before `until` (a file of its own, so that
        renewing never rewrites the job's record)."""
        self._write(self._path("objects", job_id, "lease.json"), json.dumps([owner, until]).encode())

    def lease(self, job_id: str) -> tuple[str, float] | None:
        data = self._read(self._path("objects", job_id, "lease.json"))
        return tuple(json.loads(data)) if data is not None else None

    def claim(self, job_id: str, attempt: int, owner: str) -> bool:
        """Take over attempt `attempt` of a job: only one ingress wins it."""
        return self._create(self._path("objects", job_id, f"claim.{attempt}"), owner.encode())

    def save_request(self, job_id: str, request: PreparedRequest) -> None:
        self.fs.makedirs(self._path("objects", job_id), exist_ok=True)
        self._write(self._path("objects", job_id, "request.json"), request.model_dump_json().encode())

    def load_request(self, job_id: str) -> PreparedRequest | None:
        data = self._read(self._path("objects", job_id, "request.json"))
        return PreparedRequest.model_validate_json(data) if data is not None else None

    # ------------------------------------------------------------------ outputs

    def put_outputs(self, key: str, result: GenerationResult) -> list[tuple[str, int]]:
        """Store a result's files under `key`; (file name, size) of each, in order."""
        self.fs.makedirs(self._path("objects", key), exist_ok=True)
        # The date first: retention must never take files being written for an old one.
        meta = {"created": time.time(), "format": result.output_format, "count": len(result.images)}
        self._write(self._path("objects", key, "meta.json"), json.dumps(meta).encode())
        names = []
        for i, data in enumerate(result.images):
            name = f"{i}.{result.output_format}"
            self._write(self._path("objects", key, name), data)
            names.append((name, len(data)))
        return names

    def get_output(self, key: str, name: str) -> tuple[bytes, str] | None:
        """A stored file and its content type; None if there is none."""
        stem, _, fmt = name.partition(".")
        if not stem.isdigit() or fmt not in MEDIA_TYPES:
            return None
        data = self._read(self._path("objects", key, name))
        return (data, MEDIA_TYPES[fmt]) if data is not None else None

    # ------------------------------------------------------------------ retention

    def keys(self) -> list[str]:
        try:
            return [
                posixpath.basename(p.rstrip("/")) for p in self.fs.ls(self._path("objects"), detail=False)
            ]
        except FileNotFoundError:
            return []

    def delete(self, key: str) -> None:
        try:
            self.fs.rm(self._path("objects", key), recursive=True)
        except FileNotFoundError:
            pass

    def usage(self) -> list[tuple[str, float, int, bool]]:
        """(key, created, bytes, finished) of everything stored."""
        out = []
        for key in self.keys():
            files = self.fs.find(self._path("objects", key), detail=True)
            size = sum(int(info.get("size") or 0) for info in files.values())
            job = self.load_job(key) if key.startswith(JOB_PREFIX) else None
            if job is not None:
                out.append((key, job.finished_at or job.created_at, size, job.finished))
                continue
            meta = self._read(self._path("objects", key, "meta.json"))
            # No date yet: just created (or a job's record still being written); keep it.
            created = json.loads(meta)["created"] if meta else time.time()
            out.append((key, created, size, meta is not None or not key.startswith(JOB_PREFIX)))
        return out

    def prune(self, max_age_s: float, max_bytes: float, now: float | None = None) -> list[str]:
        """Delete finished things older than `max_age_s`, then the oldest finished ones until
        the total is under `max_bytes`. Unfinished jobs are never deleted. Returns the keys."""
        now = now if now is not None else time.time()
        items = sorted(self.usage(), key=lambda it: it[1])
        gone = [k for k, created, _, done in items if done and now - created > max_age_s]
        total = sum(size for k, _, size, _ in items if k not in gone)
        for key, _, size, done in items:
            if total <= max_bytes:
                break
            if done and key not in gone:
                gone.append(key)
                total -= size
        for key in gone:
            self.delete(key)
        return gone


# --------------------------------------------------------------------------- signed links


def sign(key: bytes, path: str, expires: int) -> str:
    return hmac.new(key, f"{path}\n{expires}".encode(), hashlib.sha256).hexdigest()


def signature_ok(key: bytes, path: str, expires: int, signature: str, now: float | None = None) -> bool:
    if expires < (now if now is not None else time.time()):
        return False
    # As bytes: compare_digest refuses a str with characters outside ASCII (a caller's `%C3%A9`).
    return hmac.compare_digest(sign(key, path, expires).encode(), signature.encode("utf-8", "replace"))


# --------------------------------------------------------------------------- the runner

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
    ):
        self.store, self.cfg, self.stream, self.abort_request = store, cfg, stream, abort
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
        self.admitting: collections.Counter[str] = collections.Counter()  # by caller

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
        self._run(job, request)
        return job

    async def abort(self, job: JobRecord) -> JobRecord:
        """Abort an unfinished job: its replica request stops, and the job ends `aborted`,
        whichever ingress runs it (that one sees the record finished and stops)."""
        await self.abort_request(job.request_id)
        task = self.tasks.get(job.id)
        if task is not None and job.id in self.waiting:  # never sent: nothing to stop elsewhere
            task.cancel()
        elif task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(task), 5.0)
            except TimeoutError:
                task.cancel()
        current = await asyncio.to_thread(self.store.load_job, job.id) or job
        if not current.finished:
            current.state, current.finished_at = "aborted", time.time()
            current.error = Aborted("aborted by DELETE /v1/jobs", request_id=job.request_id).to_body()[
                "error"
            ]
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
        """Write the record, unless (without `force`) the job is gone (deleted, pruned), finished,
        or taken over by another ingress: then this ingress stops running it. Saves of one job
        go one at a time."""
        async with self._locks.setdefault(job.id, asyncio.Lock()):
            if not force:
                stored = await asyncio.to_thread(self.store.load_job, job.id)
                if stored is None or stored.owner != self.owner or (stored.finished and not job.finished):
                    self._drop(job.id)
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
        admitting = self.admitting[caller] if caller is not None else sum(self.admitting.values())
        return admitting + sum(1 for j in self.jobs.values() if caller is None or j.caller == caller)

    @contextlib.contextmanager
    def admission(self, caller: str):
        """Counts a job being checked and stored as unfinished, so that a burst of submissions
        sent at once is bounded like the same jobs sent one by one."""
        self.admitting[caller] += 1
        try:
            yield
        finally:
            self.admitting[caller] -= 1

    async def _execute(self, job: JobRecord, request: PreparedRequest) -> None:
        self.start()
        self.waiting.add(job.id)
        try:
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
                names = await asyncio.to_thread(self.store.put_outputs, job.id, item)
                job.outputs = [
                    JobOutput(
                        index=i,
                        name=name,
                        content_type=MEDIA_TYPES[item.output_format],
                        bytes=size,
                        seed=seed,
                        prompt_index=idx,
                    )
                    for i, ((name, size), seed, idx) in enumerate(
                        zip(names, item.seeds, item.prompt_index, strict=True)
                    )
                ]
                job.metrics = item.metrics
                job.attempts += item.attempts - 1
                job.state, job.finished_at = "done", time.time()
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
            lease = await asyncio.to_thread(self.store.lease, job_id)
            if lease is not None and lease[1] > now:
                continue
            job = await asyncio.to_thread(self.store.load_job, job_id)  # read now, not from a listing
            if job is None or job.finished:
                continue
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
