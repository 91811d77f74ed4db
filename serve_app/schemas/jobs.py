"""Asynchronous jobs: a job as callers see it (`Job`, `JobList`), as it is stored (`JobRecord`),
its outputs and its webhook delivery."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from serve_app.schemas.base import OutputFormat
from serve_app.schemas.internal import StageMetrics

JobState = Literal["queued", "running", "done", "failed", "aborted"]
WebhookEvent = Literal["start", "progress", "completed"]
FINISHED = ("done", "failed", "aborted")


class JobOutput(BaseModel):
    index: int
    name: str = Field(description="The stored file's name.")
    url: str | None = Field(None, description="A signed link to the file; it expires (`jobs.url_ttl_s`).")
    content_url: str | None = Field(
        None, description="The same file behind the API keys (GET /v1/jobs/{id}/content/{index})."
    )
    content_type: str
    bytes: int
    seed: int
    prompt_index: int


class JobTensors(BaseModel):
    """A finished job's tensors (latents, trajectory, log-probs) with its files, as one file."""

    name: str = Field(description="The stored file's name.")
    url: str | None = Field(None, description="A signed link to the safetensors file; it expires.")
    content_url: str | None = Field(
        None, description="GET /v1/jobs/{id}/tensors: the file behind the API keys (`.npz` with its Accept)."
    )
    content_type: str = "application/vnd.safetensors"
    bytes: int


class WebhookDelivery(BaseModel):
    url: str
    events: list[WebhookEvent] = Field(default_factory=lambda: ["completed"])
    state: Literal["pending", "delivered", "failed"] = "pending"
    attempts: int = 0
    last_status: int | None = None
    last_error: str | None = None


class Job(BaseModel):
    """An asynchronous generation: where it is, and once done where its outputs are."""

    id: str
    object: Literal["job"] = "job"
    route: str = Field(description="The route it was submitted to, e.g. images.generations.")
    model: str
    state: JobState
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    request_id: str = Field(description="The request id of its current attempt (GET /v1/requests/{id}).")
    queue_position: int | None = None
    step: int = 0
    total_steps: int = 0
    output_format: OutputFormat
    outputs: list[JobOutput] = Field(default_factory=list)
    tensors: JobTensors | None = Field(
        None, description="When the request asked for latents, a trajectory or a rollout: its tensors' file."
    )
    metrics: StageMetrics | None = None
    error: dict[str, Any] | None = Field(None, description="The error body's `error` object when failed.")
    attempts: int = Field(1, description="Ingress and replica attempts it took (resumed after a loss: more).")
    webhook: WebhookDelivery | None = None

    @property
    def finished(self) -> bool:
        return self.state in FINISHED


class DeletedJob(Job):
    """`DELETE /v1/jobs/{id}` of a finished job: the job as it was, its outputs gone with it."""

    deleted: Literal[True] = True


class VideoJob(BaseModel):
    """What `POST /v1/videos` asked for, kept with its job to answer as OpenAI's `Video`."""

    prompt: str
    seconds: str
    size: str


class JobRecord(Job):
    """A job as stored: with the bookkeeping callers do not see."""

    owner: str | None = Field(None, description="The ingress instance running it.")
    caller: str = Field("", description="A digest of the submitting API key: only it sees the job.")
    base_url: str = Field("", description="Where the links of its outputs point.")
    body_hash: str | None = Field(None, description="Of the submitted body, for idempotency keys.")
    tenant: str = Field("default", description="The tenant it counts against.")
    video: VideoJob | None = Field(None, description="A job made by POST /v1/videos: what it asked for.")

    def public(self) -> Job:
        return Job.model_validate(self.model_dump(include=set(Job.model_fields)))


class JobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Job]
