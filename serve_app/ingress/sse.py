"""Server-Sent Events framing for the streaming routes: one `data:` line per event, an error
event with the same body as a JSON error when the stream fails, and `[DONE]` at the end."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from serve_app.errors import ServingError

logger = logging.getLogger("ray.serve")

DONE = "data: [DONE]\n\n"


def event(obj: dict[str, Any], event_id: str | None = None) -> str:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def frame(
    source: AsyncIterator[Any], render: Callable[[Any], dict[str, Any]], request_id: str
) -> AsyncIterator[str]:
    """`source`'s items as events; never a broken stream: the client always learns how it ended."""
    try:
        async for item in source:
            yield event(render(item))
    except ServingError as e:
        yield event({"type": "error", **e.to_body()})
    except Exception as e:
        logger.exception("stream %s failed", request_id, exc_info=e)
        err = ServingError("internal error; the server log has the details", request_id=request_id)
        yield event({"type": "error", **err.to_body()})
    yield DONE
