"""Checks in front of everything: the `X-Request-Id` header, before Serve's proxy reads it.

Serve's HTTP proxy decodes the header as UTF-8 and echoes it on the response, before any
application code runs: a value that is not UTF-8 (`\\xff`) answers a plain-text 500 on every
route, `/health` included, and a 20,000-character one comes back whole. `RequestIdGuard`
refuses both with the project's JSON 400, and takes only what a `request_id` may be (1-128
letters, digits, '.', '_', ':' or '-').

It runs in two places:
- in Serve's proxy, through Serve's proxy callback, for the requests the proxy itself would
  fail on: start Ray with
  `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=serve_app.proxy:middlewares` (`diffusion-serve
  serve` and the Dockerfile set it; `serve_app/proxy.py` is the documented alias of `middlewares`);
- in the ingress app (`serve_app.ingress.http.make_app`), so that a deployment whose proxy runs without it
  still refuses a malformed id the proxy let through.
"""

from __future__ import annotations

import json
import re

from serve_app.errors import InvalidRequest

_VALID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")
HEADER = b"x-request-id"


def refusal(value: bytes) -> InvalidRequest:
    """The 400 for an `X-Request-Id` that is not a valid request id, saying what is wrong."""
    try:
        value.decode("utf-8")
        why = f"is {len(value)} bytes long" if len(value) > 128 else "holds other characters"
    except UnicodeDecodeError:
        why = "is not UTF-8"
    return InvalidRequest(
        f"X-Request-Id: the header {why}; a request id is 1-128 characters of letters, digits, "
        "'.', '_', ':' or '-'",
        param="X-Request-Id",
    )


class RequestIdGuard:
    """ASGI middleware: an HTTP request whose `X-Request-Id` is not a valid request id gets a
    JSON 400 naming the header, and never reaches what would fail on it or echo it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            for name, value in scope.get("headers", ()):
                if name.lower() == HEADER and not _VALID.fullmatch(value):
                    body = json.dumps(refusal(value).to_body()).encode()
                    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
                    await send({"type": "http.response.start", "status": 400, "headers": headers})
                    await send({"type": "http.response.body", "body": body})
                    return
        await self.app(scope, receive, send)


def middlewares() -> list:
    """Serve's proxy callback (`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`): the proxy's middlewares."""
    from starlette.middleware import Middleware

    return [Middleware(RequestIdGuard)]
