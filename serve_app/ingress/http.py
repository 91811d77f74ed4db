"""The FastAPI app: access checks, the body limit and the X-Request-Id guard, every error as
the project's JSON error body, and the routers of each API."""

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray.serve.exceptions import DeploymentUnavailableError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from serve_app.errors import InvalidRequest, NotFound, ServingError
from serve_app.ingress import a1111, admin, checkpoints, images, jobs, ops, requests, videos
from serve_app.ingress.access import BodyLimit, check_api_key, error_response
from serve_app.ingress.checks import validation_to_error
from serve_app.ingress.failures import not_ready
from serve_app.ingress.openapi import document
from serve_app.ingress.proxy import RequestIdGuard
from serve_app.schemas import ImagesEditRequest, VideosGenerationRequest

logger = logging.getLogger("ray.serve")


async def _serving_error(request: Request, exc: ServingError) -> JSONResponse:
    return error_response(exc, path=request.url.path)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(validation_to_error(exc.errors()), path=request.url.path)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """FastAPI's own refusals (unknown route, wrong method) in the project's error body, with
    their headers; a 405's `Allow` lists every method of the path (RFC 9110), not only those of
    the one route Starlette tried."""
    kinds = {404: NotFound, 405: InvalidRequest}
    err = kinds.get(exc.status_code, InvalidRequest)(f"{request.method} {request.url.path}: {exc.detail}")
    err.status_code = exc.status_code
    headers = {**(err.headers() or {}), **(exc.headers or {})}
    if exc.status_code == 405:
        headers["Allow"] = ", ".join(allowed_methods(request))
    return error_response(err, headers, path=request.url.path)


_METHODS = ("DELETE", "GET", "PATCH", "POST", "PUT")  # those a route here may declare


def allowed_methods(request: Request) -> list[str]:
    """The methods some route of the app takes at this request's path (each route matches a
    method in full, whatever the nesting of routers); HEAD wherever GET is (`HeadAsGet`)."""
    routes = request.app.router.routes
    # A path that is some route's own (no parameters) is that resource, as OpenAPI matches
    # concrete paths before templated ones: /v1/videos/generations is no video's id.
    own = [
        r
        for r in _flat(routes)
        if not getattr(r, "param_convertors", True) and r.matches(request.scope)[0] != Match.NONE
    ]
    methods = {m for r in own for m in getattr(r, "methods", ())} or {
        m
        for m in _METHODS
        if any(route.matches({**request.scope, "method": m})[0] == Match.FULL for route in routes)
    }
    if "GET" in methods:
        methods.add("HEAD")
    return sorted(methods)


def _flat(routes):
    """Every route, those of included routers too (FastAPI keeps them nested)."""
    for r in routes:
        inner = getattr(r, "original_router", None)
        yield from _flat(inner.routes) if inner is not None else (r,)


class OwnPathFirst:
    """ASGI middleware: a path that is some route's own (no parameters) is that resource for every
    method, so a method none of its routes takes is a 405 there, not whatever a templated route
    would make of it (`GET /v1/videos/generations` is no video's id)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            own = [r for r in _flat(scope["app"].router.routes) if not getattr(r, "param_convertors", True)]
            matches = [r.matches(scope)[0] for r in own]
            if Match.PARTIAL in matches and Match.FULL not in matches:
                request = Request(scope, receive)
                response = await _http_error(request, StarletteHTTPException(405, "Method Not Allowed"))
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


class HeadAsGet:
    """ASGI middleware: HEAD is answered as GET is, without the body (RFC 9110, 9.3.2), on every
    GET route; FastAPI's routes take only the methods they declare."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "HEAD":
            return await self.app(scope, receive, send)

        async def headless(message):
            # The head is all a HEAD gets: once it is sent the answer ends, and the GET stops
            # (a stream would otherwise run on, and keep the connection, to its end).
            if message["type"] == "http.response.start":
                await send(message)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                raise _HeadSent

        try:
            await self.app({**scope, "method": "GET"}, receive, headless)
        except _HeadSent:
            pass


class _HeadSent(Exception):
    """Raised from a HEAD's send once its head is out, to stop the GET that answers it."""


async def _no_replica(request: Request, exc: DeploymentUnavailableError) -> JSONResponse:
    return error_response(not_ready(), path=request.url.path)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(
        ServingError("internal error; the server log has the details"), path=request.url.path
    )


def make_app() -> FastAPI:
    fastapi_app = FastAPI(
        title="diffusion-serve",
        description="Diffusion image models on Ray Serve; the image routes follow the OpenAI Images API.",
        version="0.1.0",
    )
    fastapi_app.add_middleware(OwnPathFirst)  # innermost: after the key, as the router's own 405s
    fastapi_app.middleware("http")(check_api_key)
    fastapi_app.add_middleware(BodyLimit)
    fastapi_app.add_middleware(RequestIdGuard)  # a malformed X-Request-Id goes no further
    fastapi_app.add_middleware(HeadAsGet)  # outermost: HEAD is GET to everything inside
    for exc_type, handler in (
        (ServingError, _serving_error),
        (RequestValidationError, _validation_error),
        (StarletteHTTPException, _http_error),
        (DeploymentUnavailableError, _no_replica),
        (Exception, _unexpected),
    ):
        fastapi_app.add_exception_handler(exc_type, handler)
    for module in (images, videos, requests, admin, checkpoints, ops, jobs, a1111):
        fastapi_app.include_router(module.router)
    document(fastapi_app, ImagesEditRequest, VideosGenerationRequest)
    return fastapi_app
