"""How results look to HTTP callers, in one place: the OpenAI Images body, the project's own
step-event stream, OpenAI's image stream (which its SDK parses), and abort answers."""

from __future__ import annotations

import base64
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from serve_app.ingress import sse
from serve_app.schemas import (
    SERVED_QUALITY,
    AbortResponse,
    GenerationResult,
    ImageData,
    ImagesResponse,
    ImagesUsage,
    PreparedRequest,
    StepEvent,
)

_ABORT_MESSAGES = {
    "aborted": "aborted; its caller gets an 'aborted' error",
    "finished": "already finished; nothing to abort",
    "unknown": "no such request is queued or running; nothing to abort",
}

Events = AsyncIterator[StepEvent | GenerationResult]


def _rows(result: GenerationResult):
    """Each output with its seed and the index of its prompt."""
    return zip(result.images, result.seeds, result.prompt_index, strict=True)


def served(request: PreparedRequest) -> dict[str, Any]:
    """What a request was served at, as OpenAI's gpt-image responses say it."""
    return {
        "background": "opaque",
        "output_format": request.output_format,
        "quality": SERVED_QUALITY.get(request.acceleration, "high"),
        "size": f"{request.width}x{request.height}",
    }


def images_response(
    result: GenerationResult, urls: list[str] | None, request: PreparedRequest
) -> dict[str, Any]:
    """The OpenAI body of a result: each image as base64, or as a link when `urls` are given."""
    data = []
    for i, (img, seed, idx) in enumerate(_rows(result)):
        item = {"url": urls[i]} if urls is not None else {"b64_json": base64.b64encode(img).decode("ascii")}
        data.append(ImageData(seed=seed, prompt_index=idx, **item))
    resp = ImagesResponse(
        created=result.created,
        data=data,
        **served(request),
        usage=ImagesUsage(),
        model=result.model,
        request_id=result.request_id,
        metrics=result.metrics,
        peak_memory_mb=result.peak_memory_mb,
        peak_memory_kind=result.peak_memory_kind,
        latents=result.latents,
        trajectory=result.trajectory,
        attempts=result.attempts,
        policy_version=result.policy_version,
        weights_version=result.weights_version,
    )
    return resp.model_dump(mode="json", exclude_none=True)


def step_stream(
    events: Events, request: PreparedRequest, urls: Callable[[GenerationResult], Awaitable[list[str] | None]]
) -> AsyncIterator[str]:
    """The project's stream: a `step` event per denoising step, then a `result` event with
    the OpenAI body."""

    async def items() -> AsyncIterator[dict[str, Any]]:
        async for item in events:
            if isinstance(item, StepEvent):
                yield {"type": "step", **item.model_dump(mode="json", exclude_none=True)}
            else:
                yield {"type": "result", **images_response(item, await urls(item), request)}

    return sse.frame(items(), dict, request.request_id)


def preview_every(request: PreparedRequest, partial_images: int) -> int:
    """The step interval that spreads `partial_images` previews over the request's steps."""
    return math.ceil(request.num_inference_steps / (partial_images + 1)) if partial_images else 0


def openai_stream(
    events: Events, request: PreparedRequest, partial_images: int, kind: str
) -> AsyncIterator[str]:
    """OpenAI's image stream: `partial_images` previews spread over the steps
    (`<kind>.partial_image`), then one `<kind>.completed` per image."""
    common = served(request)

    async def items() -> AsyncIterator[dict[str, Any]]:
        sent = 0
        async for item in events:
            if isinstance(item, StepEvent):
                # The preview of the last step is the image itself: the completed event says it.
                if item.preview_png is not None and sent < partial_images and item.step < item.total_steps:
                    yield {
                        "type": f"{kind}.partial_image",
                        "partial_image_index": sent,
                        "b64_json": base64.b64encode(item.preview_png).decode("ascii"),
                        "created_at": int(time.time()),
                        **common,
                    }
                    sent += 1
                continue
            for img, seed, idx in _rows(item):
                yield {
                    "type": f"{kind}.completed",
                    "b64_json": base64.b64encode(img).decode("ascii"),
                    "created_at": item.created,
                    "usage": ImagesUsage().model_dump(),
                    **common,
                    "seed": seed,
                    "prompt_index": idx,
                    "request_id": item.request_id,
                }

    return sse.frame(items(), dict, request.request_id)


def abort_response(request_id: str, outcome: str) -> AbortResponse:
    return AbortResponse(request_id=request_id, result=outcome, message=_ABORT_MESSAGES[outcome])
