"""What every wire model shares: the base model `_Wire`, the constants and patterns of the
wire format, and the checked field types (base64 bytes, prompts, request ids).

Static checks (types, ranges that never change) are pydantic constraints; bounds that depend
on the deployment (max pixels, max steps, ...) are checked by the ingress against `Limits`.
"""

from __future__ import annotations

import base64
import re
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    field_validator,
)

OutputFormat = Literal["png", "jpeg", "webp", "mp4", "gif"]
IMAGE_FORMATS = ("png", "jpeg", "webp")
VIDEO_FORMATS = ("mp4", "webp", "gif")  # webp: animated
MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp", "gif": "image/gif",
               "mp4": "video/mp4"}  # fmt: skip
MemoryKind = Literal["cuda", "cpu_rss"]
MAX_SEED = 2**62
REQUEST_ID_PATTERN = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def new_request_id() -> str:
    return "img-" + uuid.uuid4().hex[:24]


def _check_request_id(v: str | None) -> str | None:
    if v is not None and not REQUEST_ID_PATTERN.match(v):
        raise ValueError("must be 1-128 characters of letters, digits, '.', '_', ':' or '-'")
    return v


def _check_prompt(v: str) -> str:
    if not v.strip():
        raise ValueError("must not be empty")
    return v


def _check_prompts(v: list[str]) -> list[str]:
    for i, p in enumerate(v):
        if not p.strip():
            raise ValueError(f"prompt {i} must not be empty")
    return v


def _b64decode(v: Any) -> Any:
    return base64.b64decode(v, validate=True) if isinstance(v, str) else v


# Bytes that travel as standard, padded base64 in JSON (pydantic's own choice is URL-safe).
B64Bytes = Annotated[
    bytes,
    BeforeValidator(_b64decode),
    PlainSerializer(lambda b: base64.b64encode(b).decode("ascii"), return_type=str, when_used="json"),
]
Prompt = Annotated[str, AfterValidator(_check_prompt)]
Prompts = Annotated[list[str], Field(min_length=1), AfterValidator(_check_prompts)]
RequestId = Annotated[str | None, AfterValidator(_check_request_id)]
Extra = Annotated[
    dict[str, Any], Field(description="More keyword arguments for the pipeline call, checked by the engine.")
]


def _bad_text(v: Any, at: str = "") -> str | None:
    """Where in `v` a string holds text no encoder takes (a lone surrogate such as `\\ud800`,
    which JSON can spell), or None."""
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            return at or "it"
    elif isinstance(v, dict):
        for k, item in v.items():
            if (found := _bad_text(k, f"{at}.{k!s}"[:80]) or _bad_text(item, f"{at}.{k!s}")) is not None:
                return found
    elif isinstance(v, list | tuple):
        for i, item in enumerate(v):
            if (found := _bad_text(item, f"{at}[{i}]")) is not None:
                return found
    return None


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _valid_text(cls, v: Any) -> Any:
        """Every string field holds real text: a 400 naming the field, not a tokenizer's 500."""
        if (at := _bad_text(v)) is not None:
            where = "" if at == "it" else f" (at {at.lstrip('.')})"
            raise ValueError(f"must be valid Unicode text{where}: a lone surrogate such as \\ud800 is not")
        return v
