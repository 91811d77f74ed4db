"""OpenAI's Videos API as this server answers it: a video job (`Video`), a page of them, and a
deleted one. The jobs are the asynchronous jobs of `schemas.jobs`; these are how `/v1/videos`
shows them (ingress/videos.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

VideoStatus = Literal["queued", "in_progress", "completed", "failed"]


class VideoError(BaseModel):
    code: str
    message: str


class Video(BaseModel):
    """A video job, in the shape of OpenAI's `Video`."""

    id: str
    object: Literal["video"] = "video"
    status: VideoStatus
    progress: int = Field(description="Percent of the denoising steps done.")
    model: str
    prompt: str | None = None
    seconds: str = Field(description="The clip's length: frames over frames per second.")
    size: str = Field(description="WIDTHxHEIGHT")
    created_at: int
    completed_at: int | None = None
    expires_at: int | None = Field(
        None, description="When the stored video may be pruned (jobs.retention_s)."
    )
    error: VideoError | None = None
    remixed_from_video_id: str | None = None
    # Extensions
    seed: int | None = Field(None, description="The video's seed, once made.")
    request_id: str | None = Field(
        None, description="Its current attempt's request id (GET /v1/requests/{id})."
    )


class VideoList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Video]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class VideoDeleted(BaseModel):
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: Literal[True] = True
