"""What every wire model shares: the base model `_Wire`, the constants and patterns of the
wire format, and the checked field types (base64 bytes, prompts, request ids).

Static checks (types, ranges that never change) are pydantic constraints; bounds that depend
on the deployment (max pixels, max steps, ...) are checked by the ingress against `Limits`.
"""

from __future__ import annotations

import base64
import json
import math
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
MemoryKind = Literal["cuda", "cpu_rss"]
# The largest integer every JSON reader keeps exactly (I-JSON, RFC 7493: JavaScript's
# Number.MAX_SAFE_INTEGER); above it a checker comparing as doubles cannot tell 2**62 + 95 from 2**62.
MAX_SEED = 2**53 - 1
REQUEST_ID_REGEX = r"^[A-Za-z0-9._:-]{1,128}$"  # the document's pattern (fullmatch it in Python)
REQUEST_ID_PATTERN = re.compile(REQUEST_ID_REGEX)
# What str.strip() removes. A prompt of nothing else is empty; the document's pattern for a
# prompt (ECMA-262 syntax, which Python's re reads the same) asks for one character outside it.
SPACE_CHARS = r"\t\n\x0b\x0c\r\x1c-\x1f \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
NOT_BLANK = f"[^{SPACE_CHARS}]"


def new_request_id() -> str:
    return "img-" + uuid.uuid4().hex[:24]


def _check_request_id(v: str | None) -> str | None:
    if v is not None and not REQUEST_ID_PATTERN.fullmatch(v):
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


def rules(*rules: tuple[str, str]) -> dict[str, Any]:
    """A body's `json_schema_extra`: the rules a server enforces that JSON Schema cannot say (one
    field against another, or against the model or the deployment), as the `x-constraints`
    extension, each with the `param` its 400 names. The document lifts them onto every operation
    taking the body (`ingress/openapi.py`), and the field's description says the same."""
    return {"x-constraints": [{"param": param, "rule": rule} for param, rule in rules]}


def _b64decode(v: Any) -> Any:
    return base64.b64decode(v, validate=True) if isinstance(v, str) else v


# Bytes that travel as standard, padded base64 in JSON (pydantic's own choice is URL-safe).
B64Bytes = Annotated[
    bytes,
    BeforeValidator(_b64decode),
    PlainSerializer(lambda b: base64.b64encode(b).decode("ascii"), return_type=str, when_used="json"),
]
# Declared in the document (JSON Schema), checked by the validators with their own messages.
_PROMPT_SCHEMA = {"minLength": 1, "pattern": NOT_BLANK}
Prompt = Annotated[str, AfterValidator(_check_prompt), Field(json_schema_extra=_PROMPT_SCHEMA)]
Prompts = Annotated[
    list[Annotated[str, Field(json_schema_extra=_PROMPT_SCHEMA)]],
    Field(min_length=1),
    AfterValidator(_check_prompts),
]
RequestId = Annotated[
    str | None,
    AfterValidator(_check_request_id),
    Field(json_schema_extra={"pattern": REQUEST_ID_REGEX, "minLength": 1, "maxLength": 128}),
]
Extra = Annotated[
    dict[str, Any], Field(description="More keyword arguments for the pipeline call, checked by the engine.")
]


def _shown(key: Any) -> str:
    """A key as a message may show it: what is not valid text escaped, at most 40 characters."""
    return str(key).encode("utf-8", "backslashreplace").decode("utf-8")[:40]


def _bad_text(v: Any, at: str = "") -> str | None:
    """Where in `v` a string holds text no encoder takes (a lone surrogate such as `\\ud800`,
    which JSON can spell), in a key or a value, or None. The place is printable itself."""
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            return at or "it"
    elif isinstance(v, dict):
        for k, item in v.items():
            place = f"{at}.{_shown(k)}"[:120]
            if (found := _bad_text(k, place) or _bad_text(item, place)) is not None:
                return found
    elif isinstance(v, list | tuple):
        for i, item in enumerate(v):
            if (found := _bad_text(item, f"{at}[{i}]")) is not None:
                return found
    return None


# What may make a JSON body hold a value no field takes; only bodies with one are parsed twice.
_ODD_JSON = re.compile(rb"\\u[dD][89a-fA-F]|NaN|Infinity|[eE][+-]?\d{3}|\d{300}")


class _Constant(str):
    """NaN, Infinity or -Infinity in a body: Python's parser reads them, JSON has no such number."""


def odd_json(raw: bytes) -> tuple[str, str] | None:
    """(where, why) of the first value in a JSON body that no field may take: text that is not
    UTF-8 (JSON between systems is UTF-8, RFC 8259; Python's parser would also read UTF-16 and
    UTF-32, and surrogates encoded as bytes), a lone surrogate in a key or a value at any depth,
    NaN or Infinity, a number too large for a double. None if there is none, or if the body is
    not JSON (the route's own parser answers that)."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return "", f"the body is not UTF-8 text (byte {e.start})"
    if not _ODD_JSON.search(raw):
        return None
    try:
        return _odd(json.loads(raw, parse_constant=_Constant), "")
    except (ValueError, RecursionError):
        return None


def _odd(v: Any, at: str) -> tuple[str, str] | None:
    if isinstance(v, _Constant):
        return at, f"{v} is not a JSON number"
    if isinstance(v, float) and not math.isfinite(v):
        return at, "the number is too large for a 64-bit float"
    if isinstance(v, str) and _bad_text(v) is not None:
        return at, "must be valid Unicode text: a lone surrogate such as \\ud800 is not"
    items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
    for k, item in items:
        place = f"{at}.{_shown(k)}"[:120] if isinstance(v, dict) else f"{at}[{k}]"
        if isinstance(k, str) and _bad_text(k) is not None:
            return place, "a key must be valid Unicode text: a lone surrogate such as \\ud800 is not"
        if (found := _odd(item, place)) is not None:
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
