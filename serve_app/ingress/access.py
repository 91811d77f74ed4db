"""Who and what may reach the HTTP routes: API keys, the admin routes, and the body size.

HTTP callers are untrusted; handle callers inside the Ray cluster never pass through here.
Routes that change the server for everyone (adapters, profiling, RPC) depend on
`require_admin`, so a route is an admin route by what it declares, not by a path pattern.
With no admin key configured they are closed, unless the operator opted in to anonymous
administration from this machine (`auth.local_admin`), for a local demo.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import ipaddress
import os
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse

from serve_app.config import AuthConfig
from serve_app.errors import Forbidden, InvalidRequest, PayloadTooLarge, ServingError, Unauthorized
from serve_app.schemas import odd_json

# Routes anyone may call, keys or not: probes and the static playground page.
OPEN_ROUTES = {("GET", "/health"), ("GET", "/live"), ("GET", "/"), ("HEAD", "/health"), ("HEAD", "/live")}
# Stored outputs by signed link: the route checks the signature instead of a key.
SIGNED_PREFIX = "/v1/files/"

ADMIN_CLOSED = (
    "this route changes the server for every user and is closed: configure admin keys "
    "(auth.admin_keys or the DIFFUSION_ADMIN_KEYS environment variable) and send one as "
    "'Authorization: Bearer <key>', or, for a local demo, set auth.local_admin: true and call "
    "from this machine (see the README, 'Access control')"
)


def _env_keys(var: str) -> tuple[str, ...]:
    return tuple(k.strip() for k in os.environ.get(var, "").split(",") if k.strip())


def _key_in(key: str, keys: tuple[str, ...]) -> bool:
    return any(hmac.compare_digest(key.encode(), k.encode()) for k in keys)


def is_loopback(host: str | None) -> bool:
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class AccessPolicy:
    user_keys: tuple[str, ...] = ()
    admin_keys: tuple[str, ...] = ()
    local_admin: bool = False

    @classmethod
    def from_config(cls, auth: AuthConfig) -> AccessPolicy:
        return cls(
            user_keys=tuple(auth.api_keys) + _env_keys(auth.api_keys_env),
            admin_keys=tuple(auth.admin_keys) + _env_keys(auth.admin_keys_env),
            local_admin=auth.local_admin,
        )

    @property
    def keys_required(self) -> bool:
        return bool(self.user_keys or self.admin_keys)

    def bearer(self, authorization: str) -> str:
        """The key of an `Authorization: Bearer <key>` header ("" without one)."""
        return self._bearer(authorization) or ""

    def _bearer(self, authorization: str) -> str | None:
        """The key of a Bearer header, or the password of a Basic one (any user name): what
        AUTOMATIC1111's clients send for its `--api-auth` credentials."""
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() == "basic" and key.strip():
            try:
                key = base64.b64decode(key.strip(), validate=True).decode("utf-8").partition(":")[2]
            except (binascii.Error, UnicodeDecodeError):
                return None
            return key or None
        return key.strip() if scheme.lower() == "bearer" and key.strip() else None

    def check_caller(self, method: str, path: str, authorization: str) -> ServingError | None:
        """Any route: with keys configured, a valid user or admin key (401 otherwise)."""
        if not self.keys_required or (method, path) in OPEN_ROUTES:
            return None
        if path in {p for _, p in OPEN_ROUTES} or path.startswith(SIGNED_PREFIX):
            return None  # open paths have only open routes: another method is the router's 405
        key = self._bearer(authorization)
        if key is None:
            return Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        if _key_in(key, self.admin_keys) or _key_in(key, self.user_keys):
            return None
        return Unauthorized("invalid API key")

    def is_admin_key(self, authorization: str) -> bool:
        """Whether the header carries one of the admin keys."""
        key = self._bearer(authorization)
        return key is not None and _key_in(key, self.admin_keys)

    def check_admin(self, authorization: str, client_host: str | None) -> ServingError | None:
        """Admin routes: an admin key, or (no admin key configured) the local opt-in."""
        key = self._bearer(authorization)
        if self.admin_keys:
            if key is not None and _key_in(key, self.admin_keys):
                return None
            return Forbidden("this route needs an admin key")
        if self.local_admin and is_loopback(client_host):
            return None
        return Forbidden(ADMIN_CLOSED)


def servable():
    """The ingress object this process serves (Serve's replica context): its access policy and
    body limit are per deployment, not module globals. None outside Serve."""
    try:
        from ray import serve

        return serve.get_replica_context().servable_object
    except Exception:
        return None


def _policy(request: Request) -> AccessPolicy:
    return getattr(servable(), "access", None) or AccessPolicy()


def route_path(request: Request) -> str:
    """The path below the app's route prefix."""
    path = request.url.path
    root = request.scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :] or "/"
    return path


# The AUTOMATIC1111 routes (`ingress/a1111.py`): their errors also carry the fields A1111's own
# clients read (`detail`, `errors`) beside the project's `error`.
A1111_PATH = "/sdapi/v1/"


def error_response(err: ServingError, headers: dict[str, str] | None = None, path: str = "") -> JSONResponse:
    body = err.to_body()
    if A1111_PATH in path:
        body.update(detail=err.message, errors=err.message)
    return JSONResponse(body, status_code=err.status_code, headers=headers or err.headers())


async def check_api_key(request: Request, call_next):
    """HTTP middleware: 401 without a valid key where keys are configured."""
    err = _policy(request).check_caller(
        request.method, route_path(request), request.headers.get("authorization", "")
    )
    if err is not None:
        return error_response(err, {"WWW-Authenticate": "Bearer"}, request.url.path)
    return await call_next(request)


async def require_admin(request: Request) -> None:
    """Route dependency of every admin route."""
    client = request.client.host if request.client else None
    err = _policy(request).check_admin(request.headers.get("authorization", ""), client)
    if err is not None:
        raise err


class BodyLimit:
    """ASGI middleware: a request body over the limit gets 413 before anything parses it,
    whether it declares its length or streams in chunks; a JSON body holding a value no field
    takes (a lone surrogate in a key or a value, NaN, Infinity) gets a 400 naming where."""

    def __init__(self, app, max_bytes: int | None = None):
        self.app = app
        self.max_bytes = max_bytes

    def _limit(self, scope) -> int | None:
        ingress = servable()
        images = ("/v1/images/edits", "/sdapi/v1/img2img", "/v1/videos", "/v1/videos/generations")
        if scope.get("path", "").endswith(images):  # bodies with images
            return getattr(ingress, "max_upload_bytes", None) or self.max_bytes
        return getattr(ingress, "max_body_bytes", None) or self.max_bytes

    async def __call__(self, scope, receive, send):
        limit = self._limit(scope) if scope["type"] == "http" else None
        if limit is None:
            return await self.app(scope, receive, send)
        too_large = PayloadTooLarge(
            f"body: the request body is larger than the limit of {limit} bytes", param="body"
        )
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > limit:
                    return await error_response(too_large, path=scope.get("path", ""))(scope, receive, send)
        # A body that streams in chunks is read here, up to the limit, before the app sees it
        # (FastAPI would turn an error raised mid-body into a parse error); it is small.
        messages, seen = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            seen += len(message.get("body", b""))
            if seen > limit:
                return await error_response(too_large, path=scope.get("path", ""))(scope, receive, send)
            if not message.get("more_body", False):
                break

        ctype = next((v for k, v in scope.get("headers", ()) if k == b"content-type"), b"")
        if _parsed_as_json(ctype):
            body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")
            # A large body (an image) is read off the event loop: the other requests go on.
            odd = odd_json(body) if len(body) < 2**16 else await asyncio.to_thread(odd_json, body)
            if odd is not None:
                where = odd[0].lstrip(".") or "body"
                err = InvalidRequest(f"{where}: {odd[1]}", param=where)
                return await error_response(err, path=scope.get("path", ""))(scope, receive, send)

        async def replay():
            return messages.pop(0) if messages else await receive()

        return await self.app(scope, replay, send)


def _parsed_as_json(content_type: bytes) -> bool:
    """Whether FastAPI parses a body of this content type as JSON: none given, `application/json`
    or any `application/*+json`."""
    kind = content_type.split(b";")[0].strip().lower()
    return kind in (b"", b"application/json") or (
        kind.startswith(b"application/") and kind.endswith(b"+json")
    )
