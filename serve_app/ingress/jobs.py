"""The asynchronous jobs surface: `Prefer: respond-async` submissions, the job routes (state,
content, events, delete) and stored outputs by signed link. The runner and the store are in
`serve_app.jobs`; this module is their HTTP face."""

import asyncio
import re
import time
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from serve_app.errors import Conflict, Forbidden, InvalidRequest, NotFound, Overloaded, ServingError
from serve_app.formats import tensor_file
from serve_app.ingress import sse
from serve_app.ingress.access import servable
from serve_app.ingress.core import Core
from serve_app.ingress.links import Links
from serve_app.ingress.openapi import ERRORS, FILE_RESPONSES, TENSOR_RESPONSES
from serve_app.ingress.requests import request_status
from serve_app.jobs import JobRunner, Store, body_hash, job_id_for, new_job_request_id, signature_ok, webhooks
from serve_app.schemas import DeletedJob, Job, JobList, JobRecord, VideoJob, WebhookDelivery

_EVENTS_MAX_S = 600  # one job event stream; then the client reconnects
JOB_ID = re.compile(r"job_[0-9a-f]{32}")
STORED_KEY = re.compile(r"(job|res)_[0-9a-f]{32}")


class JobDesk:
    """Takes jobs in, finds a caller's jobs, and answers them as their callers see them."""

    def __init__(self, core: Core, store: Store, links: Links, abort):
        self.core, self.store, self.links, self.cfg = core, store, links, core.cfg.jobs
        self.runner = JobRunner(
            store,
            self.cfg,
            lambda request: core.stream(request, restart=True),
            abort,
            links.present,
            room=core.tenants.wait_for_room,
        )
        try:
            asyncio.get_running_loop()
            self.runner.start()
        except RuntimeError:  # built outside an event loop (a unit test): started on first use
            pass

    async def submit(self, body, request, http: Request, route: str) -> JSONResponse:
        """`Prefer: respond-async`: check and prepare now (bad input still gets its 400), store
        the job, answer 202 with it; the job runs on without the connection."""
        return self.response(*await self.enqueue(body, request, http, route))

    async def enqueue(
        self, body, request, http: Request, route: str, video: bool = False
    ) -> tuple[JobRecord, int]:
        """A job made and started (or the one its idempotency key made), with its status code:
        200 once it ended within `Prefer: wait=N`, else 202. `video`: it keeps what OpenAI's
        `Video` shows (`VideoJob`)."""
        self.runner.start()
        hook = self._webhook(body)
        key = http.headers.get("idempotency-key")
        if key is not None and not 1 <= len(key) <= 255:
            raise InvalidRequest("Idempotency-Key: 1-255 characters", param="Idempotency-Key")
        caller = self.core.caller(http)
        job_id = job_id_for(key, caller)
        digest = body_hash({"route": route, **body.model_dump(mode="json")})
        if key is not None and (existing := await asyncio.to_thread(self.store.load_job, job_id)):
            return self._same_job(existing, digest), 200
        self._check_room(caller)
        with self.runner.admission(
            caller, request.tenant or ""
        ):  # counted from the check on (no await between): bursts too
            base = self.links.base_url(http)
            job = await self._admit(request, route, hook, caller, job_id, digest, base, video)
        if job is None:  # the same key, sent twice at once
            return self._same_job(await asyncio.to_thread(self.store.load_job, job_id), digest), 200
        # `Prefer: wait=N` (RFC 7240): a job that ends within N seconds is answered ended (200).
        end = time.monotonic() + _prefer_wait(http)
        while not job.finished and (left := end - time.monotonic()) > 0:
            await self.runner.watch(job_id, left)
            job = await self.current(job_id) or job
        return job, 200 if job.finished else 202

    def _webhook(self, body) -> WebhookDelivery | None:
        if body.stream:
            raise InvalidRequest(
                "stream: an asynchronous job streams from GET /v1/jobs/{id}/events", param="stream"
            )
        if body.webhook is not None:
            webhooks.check_url(body.webhook, self.cfg.webhook_hosts)
            return WebhookDelivery(url=body.webhook, events=body.webhook_events or ["completed"])
        if body.webhook_events is not None:
            raise InvalidRequest("webhook_events: given without a webhook", param="webhook_events")
        return None

    async def _admit(
        self, request, route: str, hook, caller: str, job_id: str, digest: str, base_url: str, video=None
    ) -> JobRecord | None:
        """Prepare the job's request (bad input still gets its 400) and store and start the job;
        None if a job with its id exists already."""
        prepared = (await self.core.prepare(request)).model_copy(
            update={"request_id": new_job_request_id(), "owner": caller}
        )
        if getattr(request, "priority", None) is None:  # a job runs at `batch` unless it asks
            prepared = prepared.model_copy(
                update={"priority": self.core.tenants.priority(prepared.tenant, None, "batch")}
            )
        self.core.tenants.check_fits(prepared)  # one that could never run is a 400 now, as without a job
        waiting = sum(
            1 for j in self.runner.jobs.values() if j.tenant == prepared.tenant and j.state == "queued"
        )
        # and its tenant's other submissions being admitted at this moment (a burst; this one is one)
        admitting = sum(1 for _, t in self.runner.admitting.values() if t == prepared.tenant)
        self.core.tenants.check_queued(prepared.tenant, waiting + admitting - 1)
        job = JobRecord(
            id=job_id,
            route=route,
            model=prepared.checkpoint or prepared.model or self.core.models.default.name,
            state="queued",
            created_at=time.time(),
            request_id=prepared.request_id,
            total_steps=prepared.num_inference_steps,
            output_format=prepared.output_format,
            webhook=hook,
            caller=caller,
            base_url=base_url,
            body_hash=digest,
            tenant=prepared.tenant,
            video=_video_job(prepared) if video else None,
        )
        return await self.runner.submit(job, prepared)

    def _check_room(self, caller: str) -> None:
        """429 past `jobs.max_queued_per_caller` unfinished jobs of this caller, or
        `jobs.max_queued` of all, on this ingress: a backlog of jobs cannot grow without bound."""
        retry = self.core.cfg.ingress.retry_after_s
        mine, every = self.runner.unfinished(caller), self.runner.unfinished()
        if mine >= self.cfg.max_queued_per_caller:
            raise Overloaded(
                f"jobs: you have {mine} unfinished jobs, the most one caller may have "
                f"(jobs.max_queued_per_caller); retry when one has ended",
                retry_after_s=retry,
            )
        if every >= self.cfg.max_queued:
            raise Overloaded(
                f"jobs: {every} unfinished jobs, the most this server holds (jobs.max_queued); retry later",
                retry_after_s=retry,
            )

    def _same_job(self, existing: JobRecord, digest: str) -> JobRecord:
        """An idempotency key sent again: the job it made, if the body is the same."""
        if existing.body_hash != digest:
            raise Conflict(
                "Idempotency-Key: this key was used for another request body", param="Idempotency-Key"
            )
        return existing

    def response(self, job: JobRecord, status: int) -> JSONResponse:
        headers = {"Location": f"{job.base_url}/v1/jobs/{job.id}", "Preference-Applied": "respond-async"}
        return JSONResponse(
            self.links.present(job).model_dump(mode="json"), status_code=status, headers=headers
        )

    async def current(self, job_id: str) -> JobRecord | None:
        """The job as this ingress holds it, else as the store has it."""
        return self.runner.jobs.get(job_id) or await asyncio.to_thread(self.store.load_job, job_id)

    async def find(
        self, job_id: str, http: Request, param: str = "job_id", route: str | None = None
    ) -> JobRecord:
        """The caller's job (404 for another caller's: its existence is not told); with `route`,
        only a job made by that route."""
        self.runner.start()
        if not JOB_ID.fullmatch(job_id):
            raise NotFound(f"{param}: no job {job_id[:80]!r}: ids look like job_<32 hex digits>", param=param)
        job = await self.current(job_id)
        if job is None or job.caller != self.core.caller(http) or route not in (None, job.route):
            raise NotFound(
                f"{param}: no job {job_id!r} (finished jobs are kept {self.cfg.retention_s:g}s)", param=param
            )
        return job

    async def events(self, job: JobRecord, last: int) -> AsyncIterator[str]:
        """The job's events after `last`: a step event per step, then the job; keep-alive
        comments while nothing happens."""
        sent, current = last, job
        started = quiet_since = time.monotonic()
        while True:
            if time.monotonic() - started > _EVENTS_MAX_S:
                return  # a client following a long job reconnects with Last-Event-ID
            if time.monotonic() - quiet_since > 15:
                quiet_since = time.monotonic()
                yield ": keep-alive\n\n"  # a comment: proxies keep the connection open
            # What the record says now: the runner may change it (the same object) at each yield.
            step, total, finished = current.step, current.total_steps, current.finished
            if step > sent:
                quiet_since = time.monotonic()
            for n in range(sent + 1, step + 1):
                yield sse.event(
                    {"type": "step", "job_id": job.id, "step": n, "total_steps": total}, event_id=str(n)
                )
            sent = max(sent, step)
            if finished:
                final = {"type": "job", **self.links.present(current).model_dump(mode="json")}
                yield sse.event(final, event_id=str(total + 1))
                yield sse.DONE
                return
            await self.runner.watch(job.id, 0.5)  # a change saved here, or a poll of the store
            current = await self.current(job.id)
            if current is None:
                return


def _video_job(prepared) -> VideoJob:
    seconds = f"{prepared.num_frames / prepared.fps:.3g}" if prepared.num_frames and prepared.fps else "0"
    return VideoJob(prompt=prepared.prompts[0], seconds=seconds, size=f"{prepared.width}x{prepared.height}")


async def get_desk() -> JobDesk:
    """Route dependency: the jobs desk of the ingress this process serves."""
    return servable().desk


DeskDep = Annotated[JobDesk, Depends(get_desk)]


def prefers_async(http: Request) -> bool:
    prefer = http.headers.get("prefer", "")
    return any(p.strip().lower() == "respond-async" for p in prefer.split(","))


def _prefer_wait(http: Request) -> float:
    """The `wait=N` preference in seconds, at most 60 (0 when absent or malformed)."""
    for part in http.headers.get("prefer", "").split(","):
        name, _, value = part.strip().partition("=")
        if name.strip().lower() == "wait" and value.strip().isascii() and value.strip().isdigit():
            return float(min(int(value.strip()[:4]), 60))
    return 0.0


def _gone() -> NotFound:
    return NotFound("this file is no longer stored (retention)")


router = APIRouter()


@router.get("/v1/jobs", response_model=JobList, responses=ERRORS)
async def list_jobs(
    http: Request, desk: DeskDep, limit: Annotated[int, Query(ge=1, le=1000)] = 20
) -> JobList:
    """The caller's jobs, newest first."""
    desk.runner.start()
    caller = desk.core.caller(http)
    mine = [j for j in await asyncio.to_thread(desk.store.jobs) if j.caller == caller]
    return JobList(data=[desk.links.present(j) for j in mine[:limit]])


@router.get("/v1/jobs/{job_id}", response_model=Job, responses=ERRORS)
async def get_job(job_id: str, http: Request, desk: DeskDep) -> Job:
    """A job: queued (with its place in the queue), running (step), done, failed or aborted."""
    job = await desk.find(job_id, http)
    public = desk.links.present(job)
    if job.state == "queued":
        try:
            state = await asyncio.wait_for(request_status(desk.core, job.request_id), 2.0)
            public.queue_position = state.queue_position
        except (ServingError, TimeoutError):
            pass
    return public


@router.get("/v1/jobs/{job_id}/content/{index}", response_class=Response, responses=FILE_RESPONSES)
async def job_content(job_id: str, index: int, http: Request, desk: DeskDep) -> Response:
    """Output `index` of a finished job, with its content type."""
    job = await desk.find(job_id, http)
    if not 0 <= index < len(job.outputs):
        why = f"it has {len(job.outputs)} output(s)" if job.state == "done" else f"it is {job.state}"
        raise NotFound(f"index: job {job_id} has no output {index}: {why}", param="index")
    found = await asyncio.to_thread(desk.store.get_output, job.id, job.outputs[index].name)
    if found is None:
        raise _gone()
    return Response(found[0], media_type=found[1])


@router.get("/v1/jobs/{job_id}/tensors", response_class=Response, responses=TENSOR_RESPONSES)
async def job_tensors(job_id: str, http: Request, desk: DeskDep) -> Response:
    """A finished job's tensors and files as one safetensors file (`Accept: application/x-npz`:
    NumPy's `.npz`); for a request that asked for latents, a trajectory or a rollout."""
    job = await desk.find(job_id, http)
    if job.tensors is None:
        why = (
            "it did not ask for latents, a trajectory or a rollout"
            if job.state == "done"
            else f"it is {job.state}"
        )
        raise NotFound(f"job_id: job {job_id} has no tensors: {why}", param="job_id")
    found = await asyncio.to_thread(desk.store.get_output, job.id, job.tensors.name)
    if found is None:
        raise _gone()
    media = tensor_file.wanted(http.headers.get("accept")) or tensor_file.SAFETENSORS
    data = await asyncio.to_thread(tensor_file.convert, found[0], media)
    name = f"{job.id}.{tensor_file.suffix(media)}"
    return Response(data, media_type=media, headers={"Content-Disposition": f'attachment; filename="{name}"'})


@router.delete("/v1/jobs/{job_id}", response_model=Job | DeletedJob, responses=ERRORS)
async def delete_job(job_id: str, http: Request, desk: DeskDep) -> Response:
    """Abort an unfinished job (it ends `aborted`: the job); delete a finished one and its
    outputs (the job as it was, `deleted: true`, no outputs)."""
    job = await desk.find(job_id, http)
    if job.finished:
        await asyncio.to_thread(desk.store.delete, job.id)
        gone = DeletedJob(**job.public().model_dump(exclude={"outputs"}))
        return JSONResponse(gone.model_dump(mode="json"))
    return JSONResponse(desk.links.present(await desk.runner.abort(job)).model_dump(mode="json"))


@router.get("/v1/jobs/{job_id}/events", responses={**ERRORS, 200: {"content": {"text/event-stream": {}}}})
async def job_events(job_id: str, http: Request, desk: DeskDep) -> StreamingResponse:
    """The job's events as Server-Sent Events with ids: a step event per step, then the job.
    A client that reconnects with `Last-Event-ID` gets the events after that one."""
    job = await desk.find(job_id, http)
    last = http.headers.get("last-event-id") or http.query_params.get("last_event_id") or "0"
    if not re.fullmatch(r"[0-9]{1,9}", last):
        raise InvalidRequest("Last-Event-ID: an event id from this stream (a number)", param="Last-Event-ID")
    return StreamingResponse(
        desk.events(job, int(last)), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


@router.get("/v1/files/{key}/{name}", response_class=Response, responses=FILE_RESPONSES)
async def stored_file(key: str, name: str, desk: DeskDep, expires: int = 0, signature: str = "") -> Response:
    """A stored output by its signed link (no API key: the signature is the permission)."""
    if not STORED_KEY.fullmatch(key) or not signature_ok(desk.links.key, f"{key}/{name}", expires, signature):
        raise Forbidden("signature: this link is not valid, or it expired", param="signature")
    found = await asyncio.to_thread(desk.store.get_output, key, name)
    if found is None:
        raise _gone()
    age = max(0, min(expires - int(time.time()), 3600))
    return Response(found[0], media_type=found[1], headers={"Cache-Control": f"private, max-age={age}"})
