"""OpenAI's Videos API at `/v1/videos`, as its SDK calls it (`client.videos.create`,
`create_and_poll`, `retrieve`, `list`, `download_content`, `delete`): a video is an asynchronous
job (store, lease, resume, webhooks, ownership by key, tenants' quotas, idempotency keys: the
jobs desk's), shown as OpenAI's `Video`. The synchronous answer in the images shape is
`POST /v1/videos/generations` (images.py)."""

import asyncio
import io
import math
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from serve_app.errors import Conflict, InvalidRequest, NotFound
from serve_app.ingress.checks import read_edit_body, validated
from serve_app.ingress.core import CoreDep
from serve_app.ingress.images import request_of, video_body
from serve_app.ingress.jobs import DeskDep, JobDesk
from serve_app.ingress.openapi import ERRORS, FILE_RESPONSES
from serve_app.schemas import JobRecord, Video, VideoDeleted, VideoList, VideosGenerationRequest

router = APIRouter()
ROUTE = "videos.create"  # the route of the jobs this API makes (others' ids are not found here)
_STATUS = {"queued": "queued", "running": "in_progress", "done": "completed"}
_SHEET_FRAMES = 16  # at most this many frames on a spritesheet, evenly spread


def video_of(job: JobRecord, desk: JobDesk) -> Video:
    """A video job as OpenAI's `Video`."""
    spec = job.video
    done = job.state == "done"
    error = None
    if job.error is not None:
        error = {"code": str(job.error.get("code") or job.error.get("type") or job.state),
                 "message": str(job.error.get("message", job.state))}  # fmt: skip
    return Video(
        id=job.id,
        status=_STATUS.get(job.state, "failed"),
        progress=100 if done else min(99, math.floor(100 * job.step / max(job.total_steps, 1))),
        model=job.model,
        prompt=spec.prompt if spec else None,
        seconds=spec.seconds if spec else "0",
        size=spec.size if spec else "",
        created_at=int(job.created_at),
        completed_at=int(job.finished_at) if job.finished_at is not None else None,
        expires_at=int((job.finished_at or job.created_at) + desk.cfg.retention_s),
        error=error,
        seed=job.outputs[0].seed if job.outputs else None,
        request_id=job.request_id,
    )


async def _read_body(http: Request) -> VideosGenerationRequest:
    """The create body from a multipart form (as OpenAI's SDK sends it, `input_reference` a
    file or `input_reference[image_url]`) or from JSON."""
    fields = await read_edit_body(http)
    if "input_reference[file_id]" in fields:
        raise InvalidRequest(
            "input_reference: a file id needs a files API, which this server has not; send the image",
            param="input_reference",
        )
    if "input_reference[image_url]" in fields:
        fields["input_reference"] = fields.pop("input_reference[image_url]")
    if "image" in fields:
        raise InvalidRequest("image: a video starts from `input_reference`", param="image")
    return validated(VideosGenerationRequest, fields)


@router.post(
    "/v1/videos",
    response_model=Video,
    responses=ERRORS,
    openapi_extra={"requestBody": {"required": True, "content": {
        "multipart/form-data": {"schema": {"$ref": "#/components/schemas/VideosGenerationRequestForm"}},
        "application/json": {"schema": {"$ref": "#/components/schemas/VideosGenerationRequest"}},
    }}},
)  # fmt: skip
async def create_video(http: Request, core: CoreDep, desk: DeskDep) -> JSONResponse:
    """OpenAI `videos.create`: a video job, answered at once (`status: queued`); poll it with
    GET /v1/videos/{id} and download it from /content once `completed`."""
    body = await video_body(core, await _read_body(http))
    if body.num_images != 1:
        raise InvalidRequest(f"n: {body.num_images}; a video job makes one video", param="n")
    job, _ = await desk.enqueue(body, request_of(core, body, http), http, ROUTE, video=True)
    return JSONResponse(video_of(job, desk).model_dump(mode="json"))


@router.get("/v1/videos", response_model=VideoList, responses=ERRORS)
async def list_videos(
    http: Request,
    desk: DeskDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
) -> VideoList:
    """The caller's video jobs, newest first (`order: asc`: oldest first), a page at a time:
    `after` the last id of the page before."""
    desk.runner.start()
    caller = desk.core.caller(http)
    jobs = await asyncio.to_thread(desk.store.jobs)
    mine = sorted(
        (j for j in jobs if j.caller == caller and j.route == ROUTE), key=lambda j: (j.created_at, j.id)
    )
    if order == "desc":
        mine.reverse()
    if after:
        ids = [j.id for j in mine]
        if after not in ids:
            raise NotFound(f"after: no video {after[:80]!r} of yours to page after", param="after")
        mine = mine[ids.index(after) + 1 :]
    page = [video_of(j, desk) for j in mine[:limit]]
    return VideoList(
        data=page,
        first_id=page[0].id if page else None,
        last_id=page[-1].id if page else None,
        has_more=len(mine) > limit,
    )


@router.get("/v1/videos/{video_id}", response_model=Video, responses=ERRORS)
async def retrieve_video(video_id: str, http: Request, desk: DeskDep) -> Video:
    return video_of(await desk.find(video_id, http, "video_id", ROUTE), desk)


@router.get("/v1/videos/{video_id}/content", response_class=Response, responses=FILE_RESPONSES)
async def video_content(
    video_id: str,
    http: Request,
    desk: DeskDep,
    variant: Literal["video", "thumbnail", "spritesheet"] = "video",
) -> Response:
    """The finished video (its `output_format`, MP4 by default); `variant=thumbnail` its first
    frame (WebP), `variant=spritesheet` up to 16 frames in a grid (JPEG)."""
    job = await desk.find(video_id, http, "video_id", ROUTE)
    if job.state != "done":
        status = _STATUS.get(job.state, "failed")
        raise Conflict(
            f"video_id: video {video_id} is {status}; its content exists once completed", param="video_id"
        )
    out = job.outputs[0]
    found = await asyncio.to_thread(desk.store.get_output, job.id, out.name)
    if found is None:
        raise Conflict(f"video_id: video {video_id}'s file is no longer stored (retention)", param="video_id")
    if variant == "video":
        return Response(found[0], media_type=found[1])
    data, media = await asyncio.to_thread(_still, found[0], variant)
    return Response(data, media_type=media)


def _still(video: bytes, variant: str) -> tuple[bytes, str]:
    """A video file's first frame (WebP), or a grid of up to 16 of its frames (JPEG)."""
    from PIL import Image

    buf = io.BytesIO()
    if variant == "thumbnail":
        _frames(video, lambda n: {0})[0].save(buf, format="WEBP", quality=90)
        return buf.getvalue(), "image/webp"
    picked = _frames(video, lambda n: set(range(0, n, max(1, math.ceil(n / _SHEET_FRAMES)))))[:_SHEET_FRAMES]
    cols = math.ceil(math.sqrt(len(picked)))
    rows = math.ceil(len(picked) / cols)
    w, h = picked[0].size
    sheet = Image.new("RGB", (cols * w, rows * h))
    for i, im in enumerate(picked):
        sheet.paste(im, ((i % cols) * w, (i // cols) * h))
    sheet.save(buf, format="JPEG", quality=85)
    return buf.getvalue(), "image/jpeg"


def _frames(video: bytes, pick) -> list:
    """The frames of an MP4 (PyAV) or of an animated WebP or GIF (Pillow) whose indices are in
    `pick(frame count)`, as RGB PIL images; the others are decoded (an MP4's frames depend on
    each other) but not kept."""
    from PIL import Image

    if video[4:8] == b"ftyp":  # an MP4 (ISO base media file)
        import av

        with av.open(io.BytesIO(video)) as container:
            stream = container.streams.video[0]
            n = stream.frames or sum(1 for p in container.demux(stream) if p.size)
        wanted, out = pick(n), []
        with av.open(io.BytesIO(video)) as container:
            for i, frame in enumerate(container.decode(video=0)):
                if i in wanted:
                    out.append(frame.to_image().convert("RGB"))
                if len(out) == len(wanted):
                    break
        return out
    with Image.open(io.BytesIO(video)) as im:
        out = []
        for i in sorted(pick(getattr(im, "n_frames", 1))):
            im.seek(i)
            out.append(im.convert("RGB"))
        return out


@router.delete("/v1/videos/{video_id}", response_model=VideoDeleted, responses=ERRORS)
async def delete_video(video_id: str, http: Request, desk: DeskDep) -> VideoDeleted:
    """Delete a video job and its files; one still queued or running is aborted first."""
    job = await desk.find(video_id, http, "video_id", ROUTE)
    if not job.finished:
        await desk.runner.abort(job)
    await asyncio.to_thread(desk.store.delete, job.id)
    return VideoDeleted(id=job.id)
