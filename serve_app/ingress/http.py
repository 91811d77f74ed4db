"""The FastAPI app: access checks, the body limit and the X-Request-Id guard, every error as
the project's JSON error body, and the routers of each API."""

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray.serve.exceptions import DeploymentUnavailableError
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve_app.access import BodyLimit, check_api_key, error_response
from serve_app.errors import InvalidRequest, NotFound, ServingError
from serve_app.ingress import a1111, admin, checkpoints, images, jobs, ops, requests
from serve_app.ingress.checks import validation_to_error
from serve_app.ingress.failures import not_ready
from serve_app.ingress.openapi import document
from serve_app.proxy import RequestIdGuard
from serve_app.schemas import ImagesEditRequest

logger = logging.getLogger("ray.serve")


async def _serving_error(request: Request, exc: ServingError) -> JSONResponse:
    return error_response(exc, path=request.url.path)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(validation_to_error(exc.errors()), path=request.url.path)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """FastAPI's own refusals (unknown route, wrong method) in the project's error body."""
    kinds = {404: NotFound, 405: InvalidRequest}
    err = kinds.get(exc.status_code, InvalidRequest)(f"{request.method} {request.url.path}: {exc.detail}")
    err.status_code = exc.status_code
    return error_response(err, path=request.url.path)


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
    fastapi_app.middleware("http")(check_api_key)
    fastapi_app.add_middleware(BodyLimit)
    fastapi_app.add_middleware(RequestIdGuard)  # outermost: a malformed X-Request-Id goes no further
    for exc_type, handler in (
        (ServingError, _serving_error),
        (RequestValidationError, _validation_error),
        (StarletteHTTPException, _http_error),
        (DeploymentUnavailableError, _no_replica),
        (Exception, _unexpected),
    ):
        fastapi_app.add_exception_handler(exc_type, handler)
    for module in (images, requests, admin, checkpoints, ops, jobs, a1111):
        fastapi_app.include_router(module.router)
    document(fastapi_app, ImagesEditRequest)
    return fastapi_app
