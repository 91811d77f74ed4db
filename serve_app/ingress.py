"""The ingress: the HTTP API (OpenAI Images compatible) and the Python API for handle callers.

It checks every request against the deployment's limits before a replica sees it, gives it
an id and a seed (so a retried request makes the same image), forwards it to the replicas
through a `DeploymentHandle`, and turns every failure into one `ServingError`. No diffusers
and no torch here.
"""

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import math
import random
import re
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import NodeDiedError, RayActorError, RayError, RayTaskError, WorkerCrashedError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve_app import metrics, sse, webhooks
from serve_app.access import AccessPolicy, BodyLimit, check_api_key, error_response, require_admin
from serve_app.config import AppConfig, Limits
from serve_app.errors import (
    Conflict,
    DeadlineExceeded,
    Forbidden,
    InvalidRequest,
    NotFound,
    Overloaded,
    ReplicaLost,
    ServingError,
    Unavailable,
)
from serve_app.inputs import prepare_inputs
from serve_app.jobs import JobRunner, Store, body_hash, job_id_for, new_job_request_id, sign, signature_ok
from serve_app.lora import Registry, check_adapter_file, check_name, shown_path
from serve_app.proxy import RequestIdGuard
from serve_app.schemas import (
    IMAGE_FORMATS,
    MAX_SEED,
    REQUEST_ID_PATTERN,
    VIDEO_FORMATS,
    AbortResponse,
    BatchGenerationRequest,
    ErrorResponse,
    GenerationParams,
    GenerationRequest,
    GenerationResult,
    ImageData,
    ImagesBatchRequest,
    ImagesEditRequest,
    ImagesGenerationRequest,
    ImagesResponse,
    Job,
    JobList,
    JobRecord,
    LoraAdd,
    LoraPin,
    LoraRef,
    ModelCard,
    ModelDescription,
    ModelList,
    Outcome,
    PixelPayload,
    PreparedRequest,
    ProfileStart,
    ReplicaStats,
    RequestState,
    RpcCall,
    StatusResponse,
    StepEvent,
    VideosGenerationRequest,
    WebhookDelivery,
    new_request_id,
)

logger = logging.getLogger("ray.serve")

_PLAYGROUND = (Path(__file__).parent / "playground.html").read_text()
_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 403, 404, 413, 429, 499, 500, 503, 504)}
# The image routes answer JSON, or with `stream: true` Server-Sent Events.
_IMAGE_RESPONSES = {**_ERRORS, 200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}}}
# Routes that change the server for everyone: an admin key, or the local opt-in (access.py).
_ADMIN = {"dependencies": [Depends(require_admin)], "responses": _ERRORS}


async def _serving_error(request: Request, exc: ServingError) -> JSONResponse:
    return error_response(exc)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(validation_to_error(exc.errors()))


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """FastAPI's own refusals (unknown route, wrong method) in the project's error body."""
    kinds = {404: NotFound, 405: InvalidRequest}
    err = kinds.get(exc.status_code, InvalidRequest)(f"{request.method} {request.url.path}: {exc.detail}")
    err.status_code = exc.status_code
    return error_response(err)


async def _no_replica(request: Request, exc: DeploymentUnavailableError) -> JSONResponse:
    return error_response(_not_ready())


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(ServingError("internal error; the server log has the details"))


def make_app() -> FastAPI:
    """The FastAPI app: access checks, the body limit, and every error as the JSON error body.
    The routes are `DiffusionIngress`'s methods below, registered on this app."""
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
    _document(fastapi_app, ImagesEditRequest)
    return fastapi_app


def _document(fastapi_app: FastAPI, *models) -> None:
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


app = make_app()


def _not_ready() -> Unavailable:
    return Unavailable("no model replica is ready (still loading and warming up, or being replaced)")


def validation_to_error(errors: list[dict[str, Any]]) -> InvalidRequest:
    """Pydantic's error list -> one 400 naming each field and what it allows."""
    parts, first = [], None
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        name = ".".join(loc) or "body"
        first = first or name
        msg = err.get("msg", "invalid").removeprefix("Value error, ")
        parts.append(f"{name}: {msg}")
    return InvalidRequest("; ".join(parts) or "invalid request", param=first)


def check_limits(req: GenerationParams, limits: Limits, prompts: list[str]) -> None:
    """Bounds that depend on the deployment; static ones are pydantic constraints."""
    for side in ("width", "height"):
        v = getattr(req, side)
        if v is not None and v > limits.max_side:
            raise InvalidRequest(f"{side}: {v} is above the maximum {limits.max_side}", param=side)
    if req.width is not None and req.height is not None and req.width * req.height > limits.max_pixels:
        raise InvalidRequest(
            f"size: {req.width}x{req.height} is {req.width * req.height} pixels, above the maximum "
            f"{limits.max_pixels}",
            param="size",
        )
    if req.num_inference_steps is not None and req.num_inference_steps > limits.max_steps:
        raise InvalidRequest(
            f"num_inference_steps: {req.num_inference_steps} is outside 1..{limits.max_steps}",
            param="num_inference_steps",
        )
    if req.num_images > limits.max_images:
        raise InvalidRequest(f"n (num_images): {req.num_images} is outside 1..{limits.max_images}", param="n")
    if req.guidance_scale is not None and req.guidance_scale > limits.max_guidance_scale:
        raise InvalidRequest(
            f"guidance_scale: {req.guidance_scale} is outside 0..{limits.max_guidance_scale}",
            param="guidance_scale",
        )
    if len(prompts) > limits.max_prompts:
        raise InvalidRequest(
            f"prompts: {len(prompts)} prompts, the maximum is {limits.max_prompts}", param="prompts"
        )
    for key, value in req.extra.items():
        # Custom `timesteps` or `sigmas` set the number of steps as surely as num_inference_steps.
        if isinstance(value, list | tuple) and len(value) > limits.max_steps:
            raise InvalidRequest(
                f"extra.{key}: {len(value)} items, the maximum is {limits.max_steps}", param=f"extra.{key}"
            )
    negative = req.negative_prompt
    if negative is not None and len(negative) > limits.max_prompt_chars:
        raise InvalidRequest(
            f"negative_prompt: {len(negative)} characters, the maximum is {limits.max_prompt_chars}",
            param="negative_prompt",
        )
    for p in prompts:
        if len(p) > limits.max_prompt_chars:
            raise InvalidRequest(
                f"prompt: {len(p)} characters, the maximum is {limits.max_prompt_chars}", param="prompt"
            )


def edit_task(req: GenerationRequest | BatchGenerationRequest, info: ModelDescription) -> str:
    """Which task an image request is for this model: inpainting with a mask, else the model's
    own instruction edit if it is an edit model, else image-to-image."""
    if req.mask is not None:
        if "inpaint" not in info.tasks:
            raise InvalidRequest(f"mask: {info.model} ({info.pipeline}) cannot inpaint", param="mask")
        return "inpaint"
    task = "edit" if "edit" in info.tasks else "img2img"
    if task not in info.tasks:
        raise InvalidRequest(f"image: {info.model} ({info.pipeline}) takes no input image", param="image")
    if task == "edit" and req.strength is not None:
        raise InvalidRequest(
            f"strength: {info.model} edits by instruction and takes no strength", param="strength"
        )
    return task


_FORM_FILES = ("image", "image[]", "mask")
_FORM_JSON = ("extra", "lora")  # fields that are objects: JSON text inside a form


async def read_edit_body(request: Request) -> dict[str, Any]:
    """An edit request's fields from a multipart form or a JSON body."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype in ("multipart/form-data", "application/x-www-form-urlencoded"):
        try:
            form = await request.form(max_files=4, max_fields=64)
        except Exception as e:  # a malformed form: starlette raises several types
            why = type(e).__name__
            raise InvalidRequest(f"body: not a readable multipart form ({why})", param="body") from None
        out: dict[str, Any] = {}
        images = []
        for key, value in form.multi_items():
            data = await value.read() if hasattr(value, "read") else value
            if key in ("image", "image[]"):
                images.append(data)
            elif key in out:
                raise InvalidRequest(f"{key}: given more than once", param=key)
            elif key in _FORM_JSON and isinstance(data, str):
                try:
                    out[key] = json.loads(data)
                except ValueError:
                    raise InvalidRequest(f"{key}: a JSON object in a form field", param=key) from None
            else:
                out[key] = data
        if images:
            out["image"] = images
        return out
    if ctype in ("application/json", ""):
        try:
            body = await request.json()
        except ValueError:
            raise InvalidRequest("body: not valid JSON", param="body") from None
        if not isinstance(body, dict):
            raise InvalidRequest("body: must be a JSON object", param="body")
        return body
    raise InvalidRequest(
        f"body: content-type {ctype!r} is not taken; send multipart/form-data or application/json",
        param="body",
    )


def check_media(req: GenerationParams, info: ModelDescription, limits: Limits) -> None:
    """What the model makes decides the output formats and whether frames and fps mean anything."""
    fmt = req.output_format
    if info.modality == "image":
        for name in ("num_frames", "fps"):
            if getattr(req, name) is not None:
                raise InvalidRequest(f"{name}: {info.model} makes images, not videos", param=name)
        if fmt is not None and fmt not in IMAGE_FORMATS:
            raise InvalidRequest(
                f"output_format: {fmt!r} is a video format; {info.model} makes images "
                f"({', '.join(IMAGE_FORMATS)})",
                param="output_format",
            )
        return
    if fmt is not None and fmt not in VIDEO_FORMATS:
        raise InvalidRequest(
            f"output_format: {info.model} makes videos: {', '.join(VIDEO_FORMATS)}, not {fmt!r}",
            param="output_format",
        )
    n = req.num_frames
    a, b = info.frame_rule or (1, 0)
    if n is not None and (n > limits.max_frames or n < b or (n - b) % a):
        examples = ", ".join(str(a * k + b) for k in (1, 2, 3))
        raise InvalidRequest(
            f"num_frames: {n} does not fit {info.model}, which takes {a}k+{b} frames ({examples}, ...) "
            f"up to {limits.max_frames}",
            param="num_frames",
        )


# What a call raises when its replica died mid-request (crash, ray.kill, node loss).
_REPLICA_GONE = (RayActorError, WorkerCrashedError, NodeDiedError)


def _unwrap(e: BaseException) -> BaseException:
    """A `ServingError` raised in a replica reaches us wrapped in a RayTaskError."""
    if isinstance(e, RayTaskError) and isinstance(e.cause, ServingError):
        return e.cause
    return e


class DiffusionIngress:
    # No `from __future__ import annotations` in this module: FastAPI must see the real
    # body types of the routes of a class-based Serve ingress.

    def __init__(self, replica: DeploymentHandle, config: AppConfig | dict[str, Any]):
        self.cfg = AppConfig.model_validate(config)
        self.replica = replica
        self._model_info: ModelDescription | None = None
        self._rng = random.SystemRandom()
        self.registry = Registry(self.cfg.lora.registry_path)
        self._ready_until = 0.0  # a replica said it was ready: trusted until then
        self._probe: asyncio.Future | None = None
        self._describing: asyncio.Future | None = None
        # Read by access.py's middleware and route dependency through Serve's replica context.
        self.access = AccessPolicy.from_config(self.cfg.auth)
        self.max_body_bytes = self.cfg.limits.max_body_bytes
        self.max_upload_bytes = self.cfg.limits.max_upload_bytes
        # Asynchronous jobs and stored outputs (jobs.py); the runner resumes orphaned jobs.
        self.store = Store(self.cfg.jobs.store)
        self.url_key = self.store.secret("url", self.cfg.jobs.url_secret_env)
        self.jobs = JobRunner(
            self.store,
            self.cfg.jobs,
            lambda request: self.generate_stream(request, restart=True),
            lambda rid: self.abort([rid]),
            self._present,
        )
        try:
            asyncio.get_running_loop()
            self.jobs.start()
        except RuntimeError:  # built outside an event loop (a unit test): started on first use
            pass

    # ------------------------------------------------------------------ readiness

    async def ready(self) -> bool:
        """Whether at least one engine replica has loaded and warmed its model and is healthy.

        A positive answer is trusted for a couple of seconds (and renewed by every result), so
        readiness costs one broadcast per few seconds, not one per request. Replicas too busy to
        answer within the probe's time are alive, so they count as ready.
        """
        if time.monotonic() < self._ready_until:
            return True
        # One probe at a time: a burst of requests after a quiet spell waits for the same one
        # (each probe also takes a request slot on every replica for a moment).
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._probe_replicas())
        return await asyncio.shield(self._probe)

    async def _probe_replicas(self) -> bool:
        try:
            answers = await self.replica.broadcast("ready").results_async(
                timeout_s=self.cfg.ingress.ready_probe_timeout_s, return_exceptions=True
            )
        except DeploymentUnavailableError:
            return False
        except TimeoutError:
            answers = [True]
        if any(a is True for a in answers):
            self._mark_ready()
            return True
        return False

    def _mark_ready(self) -> None:
        self._ready_until = time.monotonic() + 2.0

    async def _ensure_ready(self) -> None:
        if not await self.ready():
            raise _not_ready()

    # ------------------------------------------------------------------ Python API (handle callers)

    async def generate(self, request: GenerationRequest | dict[str, Any]) -> GenerationResult:
        """One prompt. Raises a `ServingError` subclass on any failure."""
        if isinstance(request, dict):
            request = _validated(GenerationRequest, request)
        return await self._submit(request)

    async def generate_batch(self, request: BatchGenerationRequest | dict[str, Any]) -> GenerationResult:
        """Several prompts, one parameter set, one engine call, one merged result."""
        if isinstance(request, dict):
            request = _validated(BatchGenerationRequest, request)
        return await self._submit(request)

    async def models(self) -> ModelList:
        info = await self._describe()
        card = ModelCard(
            id=info.model,
            created=int(time.time()),
            source=info.source,
            family=info.family,
            modalities=[info.modality],
            tasks=info.tasks,
            inputs=info.inputs,
            embeds_shapes=info.embeds_shapes(),
            default_num_frames=info.default_num_frames,
            default_height=info.default_height,
            default_width=info.default_width,
            default_steps=info.default_steps,
            accelerations=info.accelerations,
        )
        return ModelList(data=[card])

    async def generate_stream(
        self,
        request: GenerationRequest | BatchGenerationRequest | dict[str, Any],
        preview_every: int = 0,
        restart: bool = False,
    ) -> AsyncIterator[StepEvent | GenerationResult]:
        """Call with `handle.options(stream=True)`: a `StepEvent` per step, then the result.

        A replica lost mid-stream ends the stream with an error, unless `restart`: then the
        request runs again elsewhere and its steps count from 1 again (jobs use this)."""
        if isinstance(request, dict):
            request = _validated(
                BatchGenerationRequest if "prompts" in request else GenerationRequest, request
            )
        await self._ensure_ready()
        request = await self._prepare(request)
        rid = request.request_id
        ing = self.cfg.ingress
        failures: list[str] = []
        try:
            async with asyncio.timeout(ing.request_timeout_s):
                while len(failures) < ing.max_attempts:
                    gen = (
                        self._replica_for(request)
                        .options(stream=True)
                        .generate_stream.remote(request, preview_every)
                    )
                    started = False
                    try:
                        async for event in gen:
                            started = True
                            if failures and isinstance(event, GenerationResult):
                                event = event.model_copy(update={"attempts": len(failures) + 1})
                            yield event
                        self._mark_ready()
                        return
                    except asyncio.CancelledError:
                        gen.cancel()
                        raise
                    except Exception as e:
                        err = self._call_error(e, rid, failures)
                        # A replica lost before the first event: nothing was sent, so try again.
                        if err is not None or (started and not restart):
                            raise err or Unavailable(
                                "the replica serving this stream died mid-stream", request_id=rid
                            ) from None
                        await _backoff(failures)
        except TimeoutError:
            raise DeadlineExceeded(f"no result within {ing.request_timeout_s:g}s", request_id=rid) from None
        raise _gave_up(failures, rid)

    async def abort(self, request_ids: list[str], owner: str | None = None) -> dict[str, str]:
        """Abort requests by id wherever they are: `aborted`, `finished` or `unknown` per id.
        With `owner`, only that caller's requests (another caller's are `unknown`).

        Aborted callers get an `Aborted` error (HTTP 499); a running request stops at the next
        denoising step, and the others in its pipeline call keep going.
        """
        for rid in request_ids:
            _check_path_id(rid)
        answers = await self._broadcast("abort", list(request_ids), owner)
        out = {}
        for rid in request_ids:
            seen = {a.get(rid) for a in answers}
            out[rid] = next((s for s in ("aborted", "finished") if s in seen), "unknown")
        return out

    async def request_status(self, request_id: str, owner: str | None = None) -> RequestState:
        """Where a request is; with `owner`, only that caller's (another's is a 404 like an
        unknown id)."""
        _check_path_id(request_id)
        states = await self._broadcast("request_status", request_id, owner)
        found = [st for st in states if st is not None]
        if not found:
            raise NotFound(
                f"request_id: no request {request_id!r} is queued, running or recently finished",
                param="request_id",
            )
        order = {"running": 0, "queued": 1, "done": 2, "failed": 3, "aborted": 4}
        return min(found, key=lambda st: order[st.state])

    async def status(self) -> StatusResponse:
        replicas: list[ReplicaStats] = await self._broadcast("stats")
        return StatusResponse(
            model=self.cfg.model.served_name,
            replicas=sorted(replicas, key=lambda r: r.replica_id),
            queue_length=sum(r.queued_images + r.running_images for r in replicas),
        )

    async def _prepare(
        self, request: GenerationRequest | BatchGenerationRequest | PreparedRequest
    ) -> PreparedRequest:
        """Check limits and fill in every default, once: the id and the seed (so a retried
        request makes the same image), the model's size, steps and guidance, and the adapter's
        registered scale and file (404 if it is not registered)."""
        if isinstance(request, PreparedRequest):
            return request
        check_limits(request, self.cfg.limits, request.prompts)
        loras = self._adapters(request)
        info = await self._describe()
        check_media(request, info, self.cfg.limits)
        video = info.modality == "video"
        task, image, mask = "generate", None, None
        if request.image is not None:
            task = edit_task(request, info)
            rgb, m, width, height = await asyncio.to_thread(
                prepare_inputs, request.image, request.mask, request.width, request.height, self.cfg.limits
            )
            request = request.model_copy(update={"width": width, "height": height})
            check_limits(request, self.cfg.limits, request.prompts)  # the size it took from the image
            image, mask = PixelPayload.from_pil(rgb), PixelPayload.from_pil(m) if m is not None else None
        elif request.strength is not None:
            raise InvalidRequest("strength: only an edit (with an image) takes it", param="strength")
        return PreparedRequest.from_request(
            request,
            request_id=_request_id(),
            seed=self._rng.randrange(MAX_SEED),
            height=info.default_height,
            width=info.default_width,
            steps=self.cfg.model.default_steps,
            guidance_scale=self.cfg.model.default_guidance_scale,
            output_format="mp4" if video else "png",
            num_frames=info.default_num_frames if video else None,
            fps=info.default_fps if video else None,
            loras=loras,
            task=task,
            image=image,
            mask=mask,
            acceleration=self.cfg.model.optimizations.step_cache,
        )

    def _adapters(self, request: GenerationRequest | BatchGenerationRequest) -> list[LoraRef]:
        """The request's adapters (`lora` and `loras`), each with its registered file and scale,
        in name order: the same set gives the same image whatever order it was listed in."""
        refs = ([request.lora] if request.lora is not None else []) + list(request.loras)
        names = [r.name for r in refs]
        if len(set(names)) < len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise InvalidRequest(f"loras: adapter {dup!r} is named twice", param="loras")
        most = self.cfg.lora.max_per_request
        if len(refs) > most:
            raise InvalidRequest(f"loras: {len(refs)} adapters, the maximum is {most}", param="loras")
        out = []
        for ref in refs:
            entry = self.registry.get(ref.name)
            scale = ref.scale if ref.scale is not None else entry["scale"]
            out.append(LoraRef(name=ref.name, scale=scale, path=entry["path"]))
        return sorted(out, key=lambda r: r.name)

    def _replica_for(self, request) -> DeploymentHandle:
        """Requests naming adapters go preferably to replicas that hold the first (Serve multiplexing)."""
        if not request.loras:
            return self.replica
        return self.replica.options(multiplexed_model_id=request.loras[0].name)

    # ------------------------------------------------------------------ profiling and collective RPC

    async def start_profile(self, prefix: str = "trace") -> list[Outcome]:
        """Every live replica starts the torch profiler; per-replica outcomes."""
        if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", prefix):
            raise InvalidRequest("prefix: 1-64 letters, digits, '.', '_' or '-'", param="prefix")
        return await self._fan_out("start_profile", prefix)

    async def stop_profile(self) -> list[Outcome]:
        """Every live replica stops its profiler and writes a trace; the reply lists the files."""
        return await self._fan_out("stop_profile")

    async def collective_rpc(
        self, method: str, args: list | None = None, kwargs: dict | None = None, timeout: float | None = None
    ) -> list[Outcome]:
        """Call `method` on every live replica's engine; errors are reported per replica.

        Only methods the engine (or its extension) exports can be called; others get a 400."""
        allowed = (await self._describe()).rpc_methods
        if method not in allowed:
            raise InvalidRequest(
                f"method: {method!r} cannot be called; allowed: {', '.join(allowed)}", param="method"
            )
        return await self._fan_out(
            "collective_rpc", method, list(args or []), dict(kwargs or {}), timeout=timeout
        )

    async def _fan_out(self, name: str, *args, timeout: float | None = None) -> list[Outcome]:
        """Call every live replica; each answers an `Outcome` and never raises, so one
        replica's failure is reported for that replica instead of failing the call."""
        results = await self._broadcast(name, *args, timeout=timeout)
        return sorted(results, key=lambda r: r.replica_id)

    async def _broadcast(self, method: str, *args, timeout: float | None = None) -> list[Any]:
        """Every live replica's answer. A replica that dies meanwhile is left out; an error a
        replica raises on purpose (a `ServingError`) is raised; no replica: 503."""
        try:
            answers = await self.replica.broadcast(method, *args).results_async(
                timeout_s=timeout, return_exceptions=True
            )
        except DeploymentUnavailableError:
            raise _not_ready() from None
        except TimeoutError:
            raise DeadlineExceeded(f"{method}: not every replica answered within {timeout}s") from None
        out, lost = [], []
        for a in answers:
            if not isinstance(a, BaseException):
                out.append(a)
            elif isinstance(cause := _unwrap(a), ServingError) and not isinstance(cause, ReplicaLost):
                raise cause
            else:
                lost.append(a)
        if lost:
            logger.warning("%s: %d replica(s) did not answer: %s", method, len(lost), lost[0])
            if not out:
                raise _not_ready()
        return out

    # ------------------------------------------------------------------ LoRA administration

    async def add_lora(
        self, name: str, path: str, scale: float = 1.0, pinned: bool = False
    ) -> dict[str, Any]:
        """Register an adapter after checking its file and loading it once on a replica."""
        check_name(name)
        lim = self.cfg.lora
        resolved = check_adapter_file(path, lim.allowed_roots, lim.max_file_mb)
        if name in self.registry.all():
            raise InvalidRequest(f"name: an adapter named {name!r} is already registered", param="name")
        await self._ensure_ready()
        try:
            await self.replica.validate_lora.remote(str(resolved))
        except Exception as e:
            err = self._call_error(e, name, []) or _not_ready()
            err.message = err.message.replace(str(resolved), self._shown(str(resolved)))
            raise err from None
        entry = self.registry.add(name, str(resolved), scale)
        if pinned:
            return await self.pin_lora(name, True)
        return self._entry(name, entry)

    async def remove_lora(self, name: str) -> dict[str, Any]:
        """Unregister an adapter and evict it from every replica; later requests for it get 404."""
        entry = self.registry.remove(name)
        evicted = await self._broadcast("evict_lora", name)
        return {**self._entry(name, entry), "evicted_from_replicas": sum(bool(e) for e in evicted)}

    async def pin_lora(self, name: str, pinned: bool = True) -> dict[str, Any]:
        """Pin (load on every replica, never evict) or unpin an adapter."""
        entry = self.registry.pin(name, pinned, max_pinned=self.cfg.lora.max_loaded)
        await self._broadcast("pin_lora", name, entry["path"], pinned)
        return self._entry(name, entry)

    async def list_loras(self) -> dict[str, Any]:
        """The registry (name, path, scale, pinned) and, per replica, the adapters it holds."""
        registry = [self._entry(n, e) for n, e in sorted(self.registry.all().items())]
        replicas = await self._broadcast("loaded_loras")
        return {"adapters": registry, "replicas": sorted(replicas, key=lambda r: r["replica_id"])}

    def _shown(self, path: str) -> str:
        return shown_path(path, self.cfg.lora.allowed_roots)

    def _entry(self, name: str, entry: dict[str, Any]) -> dict[str, Any]:
        """A registry entry as callers see it: its path relative to its adapter root."""
        return {"name": name, **entry, "path": self._shown(entry["path"])}

    async def _submit(
        self, request: GenerationRequest | BatchGenerationRequest | PreparedRequest
    ) -> GenerationResult:
        """Send to a replica; retry when the replica dies under it; bound the whole by a deadline."""
        await self._ensure_ready()
        request = await self._prepare(request)
        rid = request.request_id
        ing = self.cfg.ingress
        failures: list[str] = []
        try:
            async with asyncio.timeout(ing.request_timeout_s):
                while len(failures) < ing.max_attempts:
                    response = self._replica_for(request).generate.remote(request)
                    try:
                        result = await response
                    except asyncio.CancelledError:
                        response.cancel()  # the caller went away, or the deadline passed
                        raise
                    except Exception as e:
                        err = self._call_error(e, rid, failures)
                        if err is not None:
                            raise err from None
                        await _backoff(failures)
                        continue
                    self._mark_ready()
                    return result.model_copy(update={"attempts": len(failures) + 1}) if failures else result
        except TimeoutError:
            raise DeadlineExceeded(f"no result within {ing.request_timeout_s:g}s", request_id=rid) from None
        raise _gave_up(failures, rid)

    def _call_error(self, e: Exception, rid: str, failures: list[str]) -> ServingError | None:
        """What a failed replica call means for its caller: None when the replica died or is
        leaving with the request in it (noted in `failures`: the request may go to another
        replica, and its fixed seed makes the retry give the same image), else the error."""
        cause = _unwrap(e)
        if isinstance(e, _REPLICA_GONE) or isinstance(cause, ReplicaLost):
            failures.append(type(cause).__name__)
            metrics.count_retry(self.cfg.model.served_name)
            logger.warning("request %s: replica lost (%s), attempt %d", rid, e, len(failures))
            return None
        if isinstance(e, BackPressureError):
            metrics.count_rejected(self.cfg.model.served_name, "overloaded")
            return Overloaded(
                "every replica's queue is full; retry later",
                request_id=rid,
                retry_after_s=self.cfg.ingress.retry_after_s,
            )
        if isinstance(e, DeploymentUnavailableError):
            return _not_ready().with_request_id(rid)
        if isinstance(cause, ServingError):
            return cause
        if isinstance(e, RayError):
            return _as_serving_error(e, rid)
        logger.exception("request %s: unexpected error", rid, exc_info=e)
        return ServingError("internal error; the server log has the details", request_id=rid)

    async def _describe(self) -> ModelDescription:
        """The model's description, asked once. A burst of first requests shares one question,
        and it goes by broadcast: a control call must not take (or be refused) a request slot
        of a replica that callers' requests are about to fill."""
        if self._model_info is None:
            if self._describing is None or self._describing.done():
                self._describing = asyncio.ensure_future(self._ask_description())
            self._model_info = await asyncio.shield(self._describing)
        return self._model_info

    async def _ask_description(self) -> ModelDescription:
        await self._ensure_ready()
        return (await self._broadcast("describe"))[0]

    # ------------------------------------------------------------------ HTTP API

    @app.post("/v1/images/generations", response_model=ImagesResponse, responses=_IMAGE_RESPONSES)
    async def images_generations(self, body: ImagesGenerationRequest, http: Request) -> Response:
        return await self._http_generate(body, body.to_generation_request, http, "images.generations")

    @app.post("/v1/images/generations/batch", response_model=ImagesResponse, responses=_IMAGE_RESPONSES)
    async def images_generations_batch(self, body: ImagesBatchRequest, http: Request) -> Response:
        return await self._http_generate(body, body.to_generation_request, http, "images.generations.batch")

    @app.post(
        "/v1/images/edits",
        response_model=ImagesResponse,
        responses=_IMAGE_RESPONSES,
        openapi_extra={"requestBody": {"required": True, "content": {
            kind: {"schema": {"$ref": "#/components/schemas/ImagesEditRequest"}}
            for kind in ("multipart/form-data", "application/json")
        }}},
    )  # fmt: skip
    async def images_edits(self, request: Request) -> Response:
        """OpenAI `images.edit`: an image (and a mask) and a prompt, as a form or as JSON."""
        body = await read_edit_body(request)
        try:
            edit = ImagesEditRequest.model_validate(body)
        except ValueError as e:  # pydantic ValidationError is a ValueError
            raise validation_to_error(e.errors()) from None
        return await self._http_generate(
            edit, edit.to_generation_request, request, "images.edits", "image_edit"
        )

    @app.post("/v1/videos", response_model=ImagesResponse, responses=_IMAGE_RESPONSES)
    async def videos_generations(self, body: VideosGenerationRequest, http: Request) -> Response:
        """A video model's video, answered when it is made (or streamed, like images)."""
        info = await self._describe()
        if info.modality != "video":
            raise InvalidRequest(
                f"model: {info.model} makes images; use POST /v1/images/generations", param="model"
            )
        if body.partial_images is not None:
            raise InvalidRequest(
                "partial_images: OpenAI's image stream is for images; a video streams step events",
                param="partial_images",
            )
        if body.seconds is not None and body.num_frames is None:
            a, b = info.frame_rule or (1, 0)
            fps = body.fps or info.default_fps or 16
            k = max(1, round((body.seconds * fps - b) / a))
            body = body.model_copy(update={"num_frames": a * k + b, "fps": fps})
        return await self._http_generate(body, body.to_generation_request, http, "videos")

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def list_models(self) -> ModelList:
        return await self.models()

    @app.get("/v1/requests/{request_id}", response_model=RequestState, responses=_ERRORS)
    async def get_request(self, request_id: str, http: Request) -> RequestState:
        return await self.request_status(request_id, self._requester(http))

    @app.post("/v1/requests/{request_id}/abort", response_model=AbortResponse, responses=_ERRORS)
    async def abort_request(self, request_id: str, http: Request) -> AbortResponse:
        return await self._abort_one(request_id, http)

    @app.delete("/v1/requests/{request_id}", response_model=AbortResponse, responses=_ERRORS)
    async def delete_request(self, request_id: str, http: Request) -> AbortResponse:
        return await self._abort_one(request_id, http)

    async def _abort_one(self, request_id: str, http: Request) -> AbortResponse:
        """The caller's request aborted; another caller's is left alone and answered `unknown`,
        exactly as an id nobody used."""
        outcome = (await self.abort([request_id], self._requester(http)))[request_id]
        return _abort_response(request_id, outcome)

    @app.post("/v1/loras", **_ADMIN)
    async def http_add_lora(self, body: LoraAdd) -> dict[str, Any]:
        return await self.add_lora(body.name, body.path, body.scale, body.pinned)

    @app.get("/v1/loras", responses=_ERRORS)
    async def http_list_loras(self) -> dict[str, Any]:
        return await self.list_loras()

    @app.delete("/v1/loras/{name}", **_ADMIN)
    async def http_remove_lora(self, name: str) -> dict[str, Any]:
        return await self.remove_lora(name)

    @app.post("/v1/loras/{name}/pin", **_ADMIN)
    async def http_pin_lora(self, name: str, body: LoraPin | None = None) -> dict[str, Any]:
        return await self.pin_lora(name, body.pinned if body is not None else True)

    @app.post("/start_profile", **_ADMIN)
    async def http_start_profile(self, body: ProfileStart | None = None) -> list[Outcome]:
        return await self.start_profile(body.prefix if body else "trace")

    @app.post("/stop_profile", **_ADMIN)
    async def http_stop_profile(self) -> list[Outcome]:
        return await self.stop_profile()

    @app.post("/v1/rpc", **_ADMIN)
    async def http_collective_rpc(self, body: RpcCall) -> list[Outcome]:
        return await self.collective_rpc(body.method, body.args, body.kwargs, body.timeout)

    @app.get("/v1/status", response_model=StatusResponse, responses=_ERRORS)
    async def get_status(self) -> StatusResponse:
        return await self.status()

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def playground(self) -> HTMLResponse:
        """The playground page: static, no data in it, so it needs no key (its calls send one)."""
        return HTMLResponse(_PLAYGROUND)

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health(self) -> dict[str, str]:
        """Readiness: 200 once an engine replica has loaded and warmed its model, 503 while none is."""
        await self._ensure_ready()
        return {"status": "ok"}

    @app.get("/live")
    async def live(self) -> dict[str, str]:
        """Liveness of this ingress: 200 while it runs, whatever the engine replicas do."""
        return {"status": "ok"}

    async def _http_generate(
        self, body, to_request, http: Request, route: str, stream_kind: str = "image_generation"
    ) -> Response:
        served = self.cfg.model.served_name
        if body.model is not None and body.model != served:
            raise NotFound(f"model: {body.model!r} is not served here; available: {served!r}", param="model")
        try:
            request = to_request()
        except ValueError as e:  # pydantic ValidationError is a ValueError
            raise validation_to_error(e.errors()) from None
        if _prefers_async(http):
            return await self._submit_job(body, request, http, route)
        for name in ("webhook", "webhook_events"):
            if getattr(body, name) is not None:
                raise InvalidRequest(
                    f"{name}: only an asynchronous job calls a webhook (send 'Prefer: respond-async')",
                    param=name,
                )
        base = self._base_url(http)
        # Prepared here, once: bad input gets its 400 before a stream opens, and the request
        # is its caller's (only they, or the admin, may read its state or abort it).
        await self._ensure_ready()
        request = (await self._prepare(request)).model_copy(update={"owner": self._caller(http)})
        if body.stream:
            if body.partial_images is not None:
                events = self._openai_sse(request, body, stream_kind)
            else:
                events = self._sse(request, body.response_format, body.preview_every, base)
            return StreamingResponse(
                events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        result = await self._submit(request)
        # Serve's proxy sets the X-Request-Id response header to its own request id, which is
        # ours unless the body chose another one (see _request_id).
        return JSONResponse(_images_response(result, await self._urls(result, body.response_format, base)))

    def _sse(
        self, request: PreparedRequest, response_format: str, preview_every: int, base: str
    ) -> AsyncIterator[str]:
        async def items() -> AsyncIterator[dict[str, Any]]:
            async for item in self.generate_stream(request, preview_every):
                if isinstance(item, StepEvent):
                    yield {"type": "step", **item.model_dump(mode="json", exclude_none=True)}
                else:
                    urls = await self._urls(item, response_format, base)
                    yield {"type": "result", **_images_response(item, urls)}

        return sse.frame(items(), dict, request.request_id)

    # ------------------------------------------------------------------ stored outputs and their links

    def _base_url(self, http: Request) -> str:
        """Where links point: `jobs.public_url`, else the app's own address as the caller sees it."""
        if self.cfg.jobs.public_url:
            return self.cfg.jobs.public_url.rstrip("/")
        return str(http.base_url).rstrip("/")

    def _signed(self, base: str, key: str, name: str) -> str:
        expires = int(time.time() + self.cfg.jobs.url_ttl_s)
        signature = sign(self.url_key, f"{key}/{name}", expires)
        return f"{base}/v1/files/{key}/{name}?expires={expires}&signature={signature}"

    async def _urls(self, result: GenerationResult, response_format: str, base: str) -> list[str] | None:
        """With `response_format: url`, the result's files are stored and signed links returned."""
        if response_format != "url":
            return None
        # A key of the server's choosing: a request id is the caller's, and could name another's job.
        key = f"res_{uuid.uuid4().hex}"
        names = await asyncio.to_thread(self.store.put_outputs, key, result)
        return [self._signed(base, key, name) for name, _ in names]

    def _present(self, job: JobRecord) -> Job:
        """A job as its caller sees it: with fresh links to its outputs."""
        public = job.public()
        for out in public.outputs:
            out.url = self._signed(job.base_url, job.id, out.name)
            out.content_url = f"{job.base_url}/v1/jobs/{job.id}/content/{out.index}"
        return public

    @app.get("/v1/files/{key}/{name}", include_in_schema=True, responses=_ERRORS)
    async def stored_file(self, key: str, name: str, expires: int = 0, signature: str = "") -> Response:
        """A stored output by its signed link (no API key: the signature is the permission)."""
        if not STORED_KEY.fullmatch(key) or not signature_ok(
            self.url_key, f"{key}/{name}", expires, signature
        ):
            raise Forbidden("signature: this link is not valid, or it expired", param="signature")
        found = await asyncio.to_thread(self.store.get_output, key, name)
        if found is None:
            raise NotFound("this file is no longer stored (retention)")
        age = max(0, min(expires - int(time.time()), 3600))
        return Response(found[0], media_type=found[1], headers={"Cache-Control": f"private, max-age={age}"})

    # ------------------------------------------------------------------ asynchronous jobs

    async def _submit_job(self, body, request, http: Request, route: str) -> JSONResponse:
        """`Prefer: respond-async`: check and prepare now (bad input still gets its 400), store
        the job, answer 202 with it; the job runs on without the connection."""
        self.jobs.start()
        if body.stream:
            raise InvalidRequest(
                "stream: an asynchronous job streams from GET /v1/jobs/{id}/events", param="stream"
            )
        hook = None
        if body.webhook is not None:
            webhooks.check_url(body.webhook, self.cfg.jobs.webhook_hosts)
            hook = WebhookDelivery(url=body.webhook, events=body.webhook_events or ["completed"])
        elif body.webhook_events is not None:
            raise InvalidRequest("webhook_events: given without a webhook", param="webhook_events")
        key = http.headers.get("idempotency-key")
        if key is not None and not 1 <= len(key) <= 255:
            raise InvalidRequest("Idempotency-Key: 1-255 characters", param="Idempotency-Key")
        caller = self._caller(http)
        job_id = job_id_for(key, caller)
        digest = body_hash({"route": route, **body.model_dump(mode="json")})
        if key is not None and (existing := await asyncio.to_thread(self.store.load_job, job_id)):
            return self._same_job(existing, digest)
        self._check_job_room(caller)
        with self.jobs.admission(caller):  # counted from the check on (no await between): bursts too
            job = await self._admit_job(request, route, hook, caller, job_id, digest, self._base_url(http))
        if job is None:  # the same key, sent twice at once
            return self._same_job(await asyncio.to_thread(self.store.load_job, job_id), digest)
        # `Prefer: wait=N` (RFC 7240): a job that ends within N seconds is answered ended (200).
        end = time.monotonic() + _prefer_wait(http)
        while not job.finished and (left := end - time.monotonic()) > 0:
            await self.jobs.watch(job_id, left)
            job = self.jobs.jobs.get(job_id) or await asyncio.to_thread(self.store.load_job, job_id) or job
        return self._job_response(job, 200 if job.finished else 202)

    async def _admit_job(
        self, request, route: str, hook, caller: str, job_id: str, digest: str, base_url: str
    ) -> JobRecord | None:
        """Prepare the job's request (bad input still gets its 400) and store and start the job;
        None if a job with its id exists already."""
        await self._ensure_ready()
        prepared = (await self._prepare(request)).model_copy(
            update={"request_id": new_job_request_id(), "owner": caller}
        )
        job = JobRecord(
            id=job_id,
            route=route,
            model=self.cfg.model.served_name,
            state="queued",
            created_at=time.time(),
            request_id=prepared.request_id,
            total_steps=prepared.num_inference_steps,
            output_format=prepared.output_format,
            webhook=hook,
            caller=caller,
            base_url=base_url,
            body_hash=digest,
        )
        return await self.jobs.submit(job, prepared)

    def _check_job_room(self, caller: str) -> None:
        """429 past `jobs.max_queued_per_caller` unfinished jobs of this caller, or
        `jobs.max_queued` of all, on this ingress: a backlog of jobs cannot grow without bound."""
        cfg, retry = self.cfg.jobs, self.cfg.ingress.retry_after_s
        mine, every = self.jobs.unfinished(caller), self.jobs.unfinished()
        if mine >= cfg.max_queued_per_caller:
            raise Overloaded(
                f"jobs: you have {mine} unfinished jobs, the most one caller may have "
                f"(jobs.max_queued_per_caller); retry when one has ended",
                retry_after_s=retry,
            )
        if every >= cfg.max_queued:
            raise Overloaded(
                f"jobs: {every} unfinished jobs, the most this server holds (jobs.max_queued); retry later",
                retry_after_s=retry,
            )

    def _same_job(self, existing: JobRecord, digest: str) -> JSONResponse:
        """An idempotency key sent again: the job it made, if the body is the same."""
        if existing.body_hash != digest:
            raise Conflict(
                "Idempotency-Key: this key was used for another request body", param="Idempotency-Key"
            )
        return self._job_response(existing, 200)

    def _requester(self, http: Request) -> str | None:
        """Whose requests an HTTP caller may see and abort: its own (see `_caller`), or with an
        admin key anyone's (None)."""
        if self.access.is_admin_key(http.headers.get("authorization", "")):
            return None
        return self._caller(http)

    def _caller(self, http: Request) -> str:
        """Whose job it is: a keyed digest of the API key it was sent with ("" without one), so
        records on the store name no key, and `bearer K` and `Bearer K` are one caller."""
        key = self.access.bearer(http.headers.get("authorization", ""))
        return hmac.new(self.url_key, key.encode(), hashlib.sha256).hexdigest()[:32] if key else ""

    def _job_response(self, job: JobRecord, status: int) -> JSONResponse:
        headers = {"Location": f"{job.base_url}/v1/jobs/{job.id}", "Preference-Applied": "respond-async"}
        return JSONResponse(self._present(job).model_dump(mode="json"), status_code=status, headers=headers)

    async def _job(self, job_id: str, http: Request) -> JobRecord:
        """The caller's job (404 for another caller's: its existence is not told)."""
        self.jobs.start()
        if not JOB_ID.fullmatch(job_id):
            raise NotFound(
                f"job_id: no job {job_id[:80]!r}: job ids look like job_<32 hex digits>", param="job_id"
            )
        job = self.jobs.jobs.get(job_id) or await asyncio.to_thread(self.store.load_job, job_id)
        if job is None or job.caller != self._caller(http):
            raise NotFound(
                f"job_id: no job {job_id!r} (finished jobs are kept {self.cfg.jobs.retention_s:g}s)",
                param="job_id",
            )
        return job

    @app.get("/v1/jobs", response_model=JobList, responses=_ERRORS)
    async def list_jobs(self, http: Request, limit: int = 20) -> JobList:
        """The caller's jobs, newest first."""
        if not 1 <= limit <= 1000:
            raise InvalidRequest("limit: 1..1000", param="limit")
        self.jobs.start()
        caller = self._caller(http)
        mine = [j for j in await asyncio.to_thread(self.store.jobs) if j.caller == caller]
        return JobList(data=[self._present(j) for j in mine[:limit]])

    @app.get("/v1/jobs/{job_id}", response_model=Job, responses=_ERRORS)
    async def get_job(self, job_id: str, http: Request) -> Job:
        """A job: queued (with its place in the queue), running (step), done, failed or aborted."""
        job = await self._job(job_id, http)
        public = self._present(job)
        if job.state == "queued":
            try:
                state = await asyncio.wait_for(self.request_status(job.request_id), 2.0)
                public.queue_position = state.queue_position
            except (ServingError, TimeoutError):
                pass
        return public

    @app.get("/v1/jobs/{job_id}/content/{index}", responses=_ERRORS)
    async def job_content(self, job_id: str, index: int, http: Request) -> Response:
        """Output `index` of a finished job, with its content type."""
        job = await self._job(job_id, http)
        if not 0 <= index < len(job.outputs):
            why = f"it has {len(job.outputs)} output(s)" if job.state == "done" else f"it is {job.state}"
            raise NotFound(f"index: job {job_id} has no output {index}: {why}", param="index")
        found = await asyncio.to_thread(self.store.get_output, job.id, job.outputs[index].name)
        if found is None:
            raise NotFound("this file is no longer stored (retention)")
        return Response(found[0], media_type=found[1])

    @app.delete("/v1/jobs/{job_id}", response_model=Job, responses=_ERRORS)
    async def delete_job(self, job_id: str, http: Request) -> Response:
        """Abort an unfinished job (it ends `aborted`); delete a finished one and its outputs."""
        job = await self._job(job_id, http)
        if job.finished:
            await asyncio.to_thread(self.store.delete, job.id)
            return JSONResponse({"id": job.id, "object": "job", "deleted": True})
        return JSONResponse(self._present(await self.jobs.abort(job)).model_dump(mode="json"))

    @app.get("/v1/jobs/{job_id}/events", responses={**_ERRORS, 200: {"content": {"text/event-stream": {}}}})
    async def job_events(self, job_id: str, http: Request) -> StreamingResponse:
        """The job's events as Server-Sent Events with ids: a step event per step, then the job.
        A client that reconnects with `Last-Event-ID` gets the events after that one."""
        job = await self._job(job_id, http)
        last = http.headers.get("last-event-id") or http.query_params.get("last_event_id") or "0"
        if not re.fullmatch(r"[0-9]{1,9}", last):
            raise InvalidRequest(
                "Last-Event-ID: an event id from this stream (a number)", param="Last-Event-ID"
            )

        async def events() -> AsyncIterator[str]:
            sent, current = int(last), job
            started = quiet_since = time.monotonic()
            while True:
                if time.monotonic() - started > _EVENTS_MAX_S:
                    return  # a client following a long job reconnects with Last-Event-ID
                if time.monotonic() - quiet_since > 15:
                    quiet_since = time.monotonic()
                    yield ": keep-alive\n\n"  # a comment: proxies keep the connection open
                if current.step > sent:
                    quiet_since = time.monotonic()
                for step in range(sent + 1, current.step + 1):
                    body = {
                        "type": "step",
                        "job_id": job_id,
                        "step": step,
                        "total_steps": current.total_steps,
                    }
                    yield sse.event(body, event_id=str(step))
                sent = max(sent, current.step)
                if current.finished:
                    final = {"type": "job", **self._present(current).model_dump(mode="json")}
                    yield sse.event(final, event_id=str(current.total_steps + 1))
                    yield sse.DONE
                    return
                await self.jobs.watch(job_id, 0.5)  # a change saved here, or a poll of the store
                current = self.jobs.jobs.get(job_id) or await asyncio.to_thread(self.store.load_job, job_id)
                if current is None:
                    return

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    def _openai_sse(self, request: PreparedRequest, body, kind: str) -> AsyncIterator[str]:
        """OpenAI's image stream, which its SDK parses: `partial_images` previews spread over the
        steps (`<kind>.partial_image`), then one `<kind>.completed` per image."""
        wanted = body.partial_images
        total = request.num_inference_steps
        every = math.ceil(total / (wanted + 1)) if wanted else 0
        quality = body.quality if body.quality in ("low", "medium", "high") else "auto"
        common = {
            "background": "opaque",
            "output_format": request.output_format,
            "quality": quality,
            "size": f"{request.width}x{request.height}",
        }

        async def events() -> AsyncIterator[dict[str, Any]]:
            sent = 0
            async for item in self.generate_stream(request, every):
                if isinstance(item, StepEvent):
                    # The preview of the last step is the image itself: the completed event says it.
                    if item.preview_png is not None and sent < wanted and item.step < item.total_steps:
                        yield {
                            "type": f"{kind}.partial_image",
                            "partial_image_index": sent,
                            "b64_json": base64.b64encode(item.preview_png).decode("ascii"),
                            "created_at": int(time.time()),
                            **common,
                        }
                        sent += 1
                    continue
                for img, seed, idx in zip(item.images, item.seeds, item.prompt_index, strict=True):
                    yield {
                        "type": f"{kind}.completed",
                        "b64_json": base64.b64encode(img).decode("ascii"),
                        "created_at": item.created,
                        "usage": _NO_TOKENS,
                        **common,
                        "seed": seed,
                        "prompt_index": idx,
                        "request_id": item.request_id,
                    }

        return sse.frame(events(), dict, request.request_id)


def _images_response(result: GenerationResult, urls: list[str] | None) -> dict[str, Any]:
    """The OpenAI body of a result: each image as base64, or as a link when `urls` are given."""
    fmt = result.output_format
    data = []
    for i, (img, seed, idx) in enumerate(zip(result.images, result.seeds, result.prompt_index, strict=True)):
        item = {"url": urls[i]} if urls is not None else {"b64_json": base64.b64encode(img).decode("ascii")}
        data.append(ImageData(seed=seed, prompt_index=idx, **item))
    resp = ImagesResponse(
        created=result.created,
        data=data,
        model=result.model,
        request_id=result.request_id,
        output_format=fmt,
        metrics=result.metrics,
        peak_memory_mb=result.peak_memory_mb,
        peak_memory_kind=result.peak_memory_kind,
        latents=result.latents,
        trajectory=result.trajectory,
        attempts=result.attempts,
    )
    return resp.model_dump(mode="json", exclude_none=True)


# OpenAI's completed event counts tokens; a diffusion model has none to count.
_NO_TOKENS = {
    "input_tokens": 0,
    "input_tokens_details": {"image_tokens": 0, "text_tokens": 0},
    "output_tokens": 0,
    "total_tokens": 0,
}

_ABORT_MESSAGES = {
    "aborted": "aborted; its caller gets an 'aborted' error",
    "finished": "already finished; nothing to abort",
    "unknown": "no such request is queued or running; nothing to abort",
}


def _abort_response(request_id: str, outcome: str) -> AbortResponse:
    return AbortResponse(request_id=request_id, result=outcome, message=_ABORT_MESSAGES[outcome])


_EVENTS_MAX_S = 600  # one job event stream; then the client reconnects
JOB_ID = re.compile(r"job_[0-9a-f]{32}")
STORED_KEY = re.compile(r"(job|res)_[0-9a-f]{32}")


def _prefer_wait(http: Request) -> float:
    """The `wait=N` preference in seconds, at most 60 (0 when absent or malformed)."""
    for part in http.headers.get("prefer", "").split(","):
        name, _, value = part.strip().partition("=")
        if name.strip().lower() == "wait" and value.strip().isascii() and value.strip().isdigit():
            return float(min(int(value.strip()[:4]), 60))
    return 0.0


def _prefers_async(http: Request) -> bool:
    prefer = http.headers.get("prefer", "")
    return any(p.strip().lower() == "respond-async" for p in prefer.split(","))


async def _backoff(failures: list[str]) -> None:
    """Before trying another replica: a replica that is leaving answers at once, and until the
    router hears that it is gone, an immediate retry may well pick it again."""
    await asyncio.sleep(min(2.0, 0.2 * 2 ** (len(failures) - 1)))


def _check_path_id(request_id: str) -> None:
    if not REQUEST_ID_PATTERN.match(request_id):
        raise InvalidRequest(
            "request_id: must be 1-128 characters of letters, digits, '.', '_', ':' or '-'",
            param="request_id",
        )


def _gave_up(failures: list[str], request_id: str) -> Unavailable:
    return Unavailable(
        f"the replica serving this request died {len(failures)} time(s) ({', '.join(failures)}); giving up",
        request_id=request_id,
    )


def _as_serving_error(e: RayError, request_id: str | None) -> ServingError:
    cause = _unwrap(e)
    if isinstance(cause, ServingError):
        return cause
    logger.warning("request %s: replica call failed: %s", request_id, e)
    return Unavailable(f"replica unavailable: {type(e).__name__}", request_id=request_id)


def _request_id() -> str:
    """Serve's id of the current request: the client's X-Request-Id header when it sent one.

    Using it makes our id, Serve's access logs and the response header agree.
    """
    rid = serve.context._get_serve_request_context().request_id
    return rid if rid and REQUEST_ID_PATTERN.match(rid) else new_request_id()


def _validated(model, data: dict[str, Any]):
    try:
        return model.model_validate(data)
    except ValueError as e:
        raise validation_to_error(e.errors()) from None


# The class stays importable under its own name, so Ray pickles it by reference and the
# replica imports this module as it is (not a by-value copy of the class).
DiffusionIngressDeployment = serve.deployment(serve.ingress(app)(DiffusionIngress), name="DiffusionIngress")
