"""What the OpenAPI document says about the routes: the error answers every route may give, the
image routes' stream, the admin routes' dependency, and bodies a route reads itself.

The document is as strict as the server: each body's static bounds are its pydantic schema;
the rules JSON Schema cannot say are each operation's `x-constraints` (lifted from its body's
schema, `schemas.base.rules`); and, served by a deployment, the document is that deployment's:
its limits as maximums, and the API keys it asks for as security schemes.
"""

import copy
from typing import Any

from fastapi import Depends, FastAPI

from serve_app.formats.tensor_file import MEDIA_TYPES as TENSOR_FILES
from serve_app.ingress.access import OPEN_ROUTES, SIGNED_PREFIX, require_admin, servable
from serve_app.schemas import MEDIA_TYPES, ErrorResponse, Job
from serve_app.schemas.a1111 import options_schema

ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 403, 404, 409, 413, 429, 499, 500, 503, 504)}
# One Server-Sent Event as OpenAPI before 3.2 describes a stream's events: its fields, `data`
# the JSON of a step event, a partial image or the result.
SSE_EVENT = {
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                   "retry": {"type": "integer"}},
}  # fmt: skip
# The image routes answer JSON (the images; with `Prefer: respond-async` the job, 202 while it
# runs, 200 once it ended within `Prefer: wait=N`), or with `stream: true` Server-Sent Events,
# or with a tensor file's `Accept:` that file.
IMAGE_RESPONSES = {
    **ERRORS,
    200: {
        "content": {
            "text/event-stream": {"schema": SSE_EVENT},
            # `Accept:` one of these: the result's tensors and files as one file (tensor_file.py).
            **{media: {"schema": {"type": "string", "format": "binary"}} for media in TENSOR_FILES},
        }
    },
    202: {"model": Job, "description": "With `Prefer: respond-async`: the job (`Location`: its URL)."},
}
# A stored output (with `response_class=Response`): the file, by its media type.
_FILE = {"schema": {"type": "string", "format": "binary"}}
FILE_RESPONSES = {
    **ERRORS,
    200: {
        "description": "The file.",
        "content": {media: _FILE for media in sorted(set(MEDIA_TYPES.values()))},
    },
}
TENSOR_RESPONSES = {
    **ERRORS,
    200: {"description": "The tensor file.", "content": {media: _FILE for media in TENSOR_FILES}},
}
# Routes that change the server for everyone: an admin key, or the local opt-in (access.py).
ADMIN = {"dependencies": [Depends(require_admin)], "responses": ERRORS}

_METHODS = ("get", "put", "post", "delete", "patch", "head", "options", "trace")
# The bodies whose fields the deployment's limits bound: field -> (limit, JSON Schema keyword)s;
# a string bound on an array bounds its items.
_OPENAI = ("ImagesGenerationRequest", "ImagesBatchRequest", "ImagesEditRequest", "VideosGenerationRequest")
_A1111 = ("Txt2ImgRequest", "Img2ImgRequest")
_SIDE, _STEPS, _IMAGES = (("max_side", "maximum"),), (("max_steps", "maximum"),), (("max_images", "maximum"),)
_GUIDANCE, _CHARS = (("max_guidance_scale", "maximum"),), (("max_prompt_chars", "maxLength"),)
_BOUNDS = {
    **{b: {"width": _SIDE, "height": _SIDE, "num_inference_steps": _STEPS, "n": _IMAGES,
           "guidance_scale": _GUIDANCE, "num_frames": (("max_frames", "maximum"),), "prompt": _CHARS,
           "negative_prompt": _CHARS, "prompts": (("max_prompts", "maxItems"), *_CHARS)} for b in _OPENAI},
    # (A1111's prompt is bounded without its `<lora:...>` tags: a rule of the body)
    **{b: {"width": _SIDE, "height": _SIDE, "steps": _STEPS, "batch_size": _IMAGES, "cfg_scale": _GUIDANCE,
           "negative_prompt": _CHARS} for b in _A1111},
}  # fmt: skip
SECURITY_SCHEMES = {
    "apiKey": {
        "type": "http",
        "scheme": "bearer",
        "description": "An API key (an admin key for admin routes).",
    },
    "basic": {"type": "http", "scheme": "basic", "description": "AUTOMATIC1111's form: the key as password."},
}


# What a multipart form cannot carry (`ingress/checks.read_edit_body`): a null, or a list other
# than the images (a field given twice is refused); objects travel as JSON text.
FORM_SUFFIX = "Form"


def document(fastapi_app: FastAPI, *models) -> None:
    """Add the schemas of bodies a route reads itself (the edit route's form or JSON) to the
    OpenAPI document's components, where the routes' `$ref`s point, each also as a multipart
    form (`<name>Form`); lift each body's rules onto its operations; and, in a deployment, state
    its limits and keys."""
    make = fastapi_app.openapi

    def openapi() -> dict[str, Any]:
        if fastapi_app.openapi_schema is None:
            doc = make()
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
                schemas[model.__name__ + FORM_SUFFIX] = as_form(schema)
            _as_served(doc)
            ingress = servable()
            if getattr(ingress, "cfg", None) is not None:
                for_deployment(doc, ingress.cfg, ingress.access)
        return fastapi_app.openapi_schema

    fastapi_app.openapi = openapi


def operations(doc: dict[str, Any]):
    """(path, method, operation) of every operation in the document."""
    for path, item in doc.get("paths", {}).items():
        for method in _METHODS:
            if method in item:
                yield path, method, item[method]


def _as_served(doc: dict[str, Any]) -> None:
    """What FastAPI's document says otherwise than the server does: no route answers 422 (a
    validation error is the project's 400), A1111's options take only what `options_schema`
    says, and each body's `x-constraints` belong to the operations taking it."""
    schemas = doc["components"]["schemas"]
    for path, method, op in operations(doc):
        op.get("responses", {}).pop("422", None)
        content = op.get("requestBody", {}).get("content", {})
        if (path, method) == ("/sdapi/v1/options", "post"):
            content["application/json"]["schema"] = options_schema()
        rules: dict[str, dict[str, str]] = {}
        for media in content.values():
            name = media.get("schema", {}).get("$ref", "").rsplit("/", 1)[-1]
            for rule in schemas.get(name, {}).get("x-constraints", []):
                rules.setdefault(rule["param"], rule)
        if rules:
            op["x-constraints"] = list(rules.values())
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)


def for_deployment(doc: dict[str, Any], cfg, access) -> None:
    """The document of one deployment: its limits as the bodies' maximums, their forms' too (the
    largest of its models'; a bound that differs between models is also a rule of the named
    model), and the keys it asks for as security schemes on every route but the open ones."""
    schemas = doc["components"]["schemas"]
    limits = [served.limits for served in cfg.served()]
    differ: set[str] = set()
    for body, fields in _BOUNDS.items():
        for props in (schemas.get(name, {}).get("properties", {}) for name in (body, body + FORM_SUFFIX)):
            for field, bounds in fields.items():
                for limit, keyword in bounds:
                    values = {getattr(lim, limit) for lim in limits}
                    if field in props:
                        _bound(props[field], keyword, max(values))
                    if len(values) > 1:
                        differ.add(field)
    for body in _OPENAI:
        if "loras" in schemas.get(body, {}).get("properties", {}):
            _bound(schemas[body]["properties"]["loras"], "maxItems", cfg.lora.max_per_request)
    for path, method, op in operations(doc):
        fields = {f for body in _bodies(op) for f in _BOUNDS.get(body, {})}
        for field in sorted(fields & differ):
            rule = {"param": field, "rule": "within the limits of the model the request names"}
            op.setdefault("x-constraints", []).append(rule)
        if access.keys_required and not _open(path, method):
            op["security"] = [{name: []} for name in SECURITY_SCHEMES]
    if access.keys_required:
        doc["components"]["securitySchemes"] = dict(SECURITY_SCHEMES)


def _bodies(op: dict[str, Any]) -> set[str]:
    content = op.get("requestBody", {}).get("content", {})
    return {m.get("schema", {}).get("$ref", "").rsplit("/", 1)[-1] for m in content.values()}


def _open(path: str, method: str) -> bool:
    """Routes anyone may call, keys or not (access.py)."""
    return (method.upper(), path) in OPEN_ROUTES or (
        method in ("get", "head") and path.startswith(SIGNED_PREFIX)
    )


def as_form(schema: dict[str, Any]) -> dict[str, Any]:
    """A body's schema as a multipart form takes it: no null anywhere (a form field is text or a
    file, and an absent one is unset), no list but of files (a name is given once)."""
    form = copy.deepcopy(schema)
    props = form.get("properties", {})
    for name in list(props):
        prop = props[name]
        forms = [f for f in prop.pop("anyOf", [prop]) if f.get("type") != "null"]
        if len(forms) > 1:
            prop["anyOf"] = forms
        elif forms[0] is not prop:
            props[name] = prop = {**forms[0], **prop}  # the field's own keywords (an enum) first
        if prop.get("default", 0) is None:
            del prop["default"]
        if "enum" in prop:
            prop["enum"] = [v for v in prop["enum"] if v is not None]
        if prop.get("type") == "array" and prop["items"].get("format") != "binary":
            del props[name]
    form["title"] = schema.get("title", "") + " (form)"
    return form


def _bound(schema: dict[str, Any], keyword: str, value: float) -> None:
    """`keyword: value` on a property's schema: on each of its non-null forms (an optional field
    is `anyOf` a form and null); on the items of an array for a string bound."""
    forms = [f for f in schema.get("anyOf", [schema]) if f.get("type") != "null"]
    for form in forms:
        if keyword == "maxLength" and form.get("type") == "array":
            form = form["items"]
        current = form.get(keyword)
        form[keyword] = value if current is None else min(current, value)
