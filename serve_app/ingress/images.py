"""The image and video routes (OpenAI Images compatible): generations, batches, edits and
videos. Each parses its body, and `generate` does the rest the same way for all of them:
the answer as JSON, as a stream, or as an asynchronous job."""

import asyncio
import contextlib

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from serve_app.errors import InvalidRequest
from serve_app.formats import tensor_file
from serve_app.ingress import present
from serve_app.ingress.checks import FORM_JSON, read_edit_body, validated, validation_to_error
from serve_app.ingress.core import Core, CoreDep
from serve_app.ingress.jobs import DeskDep, JobDesk, prefers_async
from serve_app.ingress.openapi import IMAGE_RESPONSES
from serve_app.schemas import (
    ImagesBatchRequest,
    ImagesEditRequest,
    ImagesGenerationRequest,
    ImagesResponse,
    Job,
    VideosGenerationRequest,
)

router = APIRouter()


@router.post("/v1/images/generations", response_model=ImagesResponse | Job, responses=IMAGE_RESPONSES)
async def images_generations(
    body: ImagesGenerationRequest,
    http: Request,
    core: CoreDep,
    desk: DeskDep,
) -> Response:
    return await generate(core, desk, body, http, "images.generations")


@router.post("/v1/images/generations/batch", response_model=ImagesResponse | Job, responses=IMAGE_RESPONSES)
async def images_generations_batch(
    body: ImagesBatchRequest, http: Request, core: CoreDep, desk: DeskDep
) -> Response:
    return await generate(core, desk, body, http, "images.generations.batch")


@router.post(
    "/v1/images/edits",
    response_model=ImagesResponse | Job,
    responses=IMAGE_RESPONSES,
    openapi_extra={"requestBody": {"required": True, "content": {
        "multipart/form-data": {
            "schema": {"$ref": "#/components/schemas/ImagesEditRequestForm"},
            "encoding": {name: {"contentType": "application/json"} for name in FORM_JSON},
        },
        "application/json": {"schema": {"$ref": "#/components/schemas/ImagesEditRequest"}},
    }}},
)  # fmt: skip
async def images_edits(request: Request, core: CoreDep, desk: DeskDep) -> Response:
    """OpenAI `images.edit`: an image (and a mask) and a prompt, as a form or as JSON."""
    edit = validated(ImagesEditRequest, await read_edit_body(request))
    return await generate(core, desk, edit, request, "images.edits", "image_edit")


@router.post("/v1/videos/generations", response_model=ImagesResponse | Job, responses=IMAGE_RESPONSES)
async def videos_generations(
    body: VideosGenerationRequest,
    http: Request,
    core: CoreDep,
    desk: DeskDep,
) -> Response:
    """A video model's video, answered when it is made (or streamed, like images); OpenAI's
    video jobs are `POST /v1/videos` (videos.py)."""
    return await generate(core, desk, await video_body(core, body), http, "videos")


async def video_body(core: Core, body: VideosGenerationRequest) -> VideosGenerationRequest:
    """A video route's body checked against its model: a video model; `input_reference` only
    for one that starts from an image; `seconds` as frames at the model's rule and `fps`."""
    served = core.models.find(body.model)[0]
    info, most = await served.describe(), served.spec.limits.max_frames
    if info.modality != "video":
        raise InvalidRequest(
            f"model: {info.model} makes images; use POST /v1/images/generations", param="model"
        )
    if body.partial_images is not None:
        raise InvalidRequest(
            "partial_images: OpenAI's image stream is for images; a video streams step events",
            param="partial_images",
        )
    if body.input_reference is None and "generate" not in info.tasks:
        raise InvalidRequest(
            f"input_reference: {info.model} makes video from an image; send the image to start from",
            param="input_reference",
        )
    if body.input_reference is not None and "edit" not in info.tasks:
        raise InvalidRequest(
            f"input_reference: {info.model} makes video from text only; an image-to-video model "
            "takes an image to start from",
            param="input_reference",
        )
    if body.seconds is not None and body.num_frames is None:
        a, b = info.frame_rule or (1, 0)
        fps = body.fps or info.default_fps or 16
        k = max(1, round((body.seconds * fps - b) / a))
        if a * k + b > most:
            raise InvalidRequest(
                f"seconds: {body.seconds:g} s at {fps} fps is {a * k + b} frames; this model makes at "
                f"most {most} (limits.max_frames)",
                param="seconds",
            )
        body = body.model_copy(update={"num_frames": a * k + b, "fps": fps})
    return body


def request_of(core: Core, body, http: Request):
    """The Python API request of an OpenAI-style body, counted against the caller's tenant."""
    core.models.find(body.model)  # an unknown model is a 404 before anything else is looked at
    try:
        request = body.to_generation_request()
    except ValueError as e:  # pydantic ValidationError is a ValueError
        raise validation_to_error(e.errors()) from None
    return request.model_copy(update={"tenant": core.tenant_of(http)})


async def generate(
    core: Core, desk: JobDesk, body, http: Request, route: str, stream_kind: str = "image_generation"
) -> Response:
    """An OpenAI-style body answered: as a job with `Prefer: respond-async`, else as events
    with `stream`, else as one JSON body."""
    request = request_of(core, body, http)
    if prefers_async(http):
        return await desk.submit(body, request, http, route)
    for name in ("webhook", "webhook_events"):
        if getattr(body, name) is not None:
            raise InvalidRequest(
                f"{name}: only an asynchronous job calls a webhook (send 'Prefer: respond-async')",
                param=name,
            )
    tensors = tensor_file.wanted(http.headers.get("accept"))
    if tensors is not None and body.stream:
        raise InvalidRequest(
            f"Accept: a tensor file ({tensors}) answers a whole request; it cannot be streamed",
            param="Accept",
        )
    base = desk.links.base_url(http)
    # Prepared here, once: bad input gets its 400 before a stream opens, and the request
    # is its caller's (only they, or the admin, may read its state or abort it).
    request = (await core.prepare(request)).model_copy(update={"owner": core.caller(http)})
    if body.stream:
        # The tenant's place is taken now: past a quota the answer is its 429, not a stream.
        place = contextlib.AsyncExitStack()
        await place.enter_async_context(core.tenants.admit(request))
        if body.partial_images is not None:
            every = present.preview_every(request, body.partial_images)
            events = present.openai_stream(
                core.stream(request, every, admitted=True), request, body.partial_images, stream_kind
            )
        else:

            async def urls(result):
                return await desk.links.urls(result, body.response_format, base)

            stream = core.stream(request, body.preview_every, admitted=True)
            events = present.step_stream(stream, request, urls)
        return StreamingResponse(
            _holding(events, place),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
            background=BackgroundTask(place.aclose),  # a stream never read gives the place back too
        )
    result = await core.submit(request, cache="no-cache" not in http.headers.get("cache-control", "").lower())
    # Serve's proxy sets the X-Request-Id response header to its own request id, which is
    # ours unless the body chose another one.
    headers = {"X-Cache": result.metrics.cache} if result.metrics.cache else {}
    if tensors is not None:  # the images go in the file; none is stored for a link
        name = f"{result.request_id}.{tensor_file.suffix(tensors)}"
        headers["Content-Disposition"] = f'attachment; filename="{name}"'
        data = await asyncio.to_thread(tensor_file.encode, result, tensors)
        return Response(data, media_type=tensors, headers=headers)
    urls = await desk.links.urls(result, body.response_format, base)
    return JSONResponse(present.images_response(result, urls, request), headers=headers)


async def _holding(events, place: contextlib.AsyncExitStack):
    """A stream's events, its tenant's place given back when it ends however it ends."""
    try:
        async for event in events:
            yield event
    finally:
        await place.aclose()
