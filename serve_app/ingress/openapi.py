"""What the OpenAPI document says about the routes: the error answers every route may give, the
image routes' stream, the admin routes' dependency, and bodies a route reads itself."""

from typing import Any

from fastapi import Depends, FastAPI

from serve_app.access import require_admin
from serve_app.schemas import ErrorResponse

ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 403, 404, 413, 429, 499, 500, 503, 504)}
# The image routes answer JSON, or with `stream: true` Server-Sent Events.
IMAGE_RESPONSES = {**ERRORS, 200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}}}
# Routes that change the server for everyone: an admin key, or the local opt-in (access.py).
ADMIN = {"dependencies": [Depends(require_admin)], "responses": ERRORS}


def document(fastapi_app: FastAPI, *models) -> None:
    """Add the schemas of bodies a route reads itself (the edit route's form or JSON) to the
    OpenAPI document's components, where the routes' `$ref`s point."""
    make = fastapi_app.openapi

    def openapi() -> dict[str, Any]:
        if fastapi_app.openapi_schema is None:
            doc = make()
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
        return fastapi_app.openapi_schema

    fastapi_app.openapi = openapi
