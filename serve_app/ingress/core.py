"""What every route shares: readiness, the model's description, turning a request into a
`PreparedRequest`, sending it to a replica (one retry loop for calls and streams), fan-out to
every replica, and whose request it is. No FastAPI routes here and no diffusers or torch."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import random
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import Depends, Request
from ray import serve
from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponse

from serve_app.access import AccessPolicy, servable
from serve_app.config import AppConfig
from serve_app.errors import DeadlineExceeded, InvalidRequest, ReplicaLost, ServingError, Unavailable
from serve_app.ingress.checks import check_limits, check_media, edit_task, validated
from serve_app.ingress.failures import backoff, call_error, gave_up, not_ready, unwrap
from serve_app.inputs import prepare_inputs
from serve_app.lora import Registry
from serve_app.schemas import (
    MAX_SEED,
    REQUEST_ID_PATTERN,
    BatchGenerationRequest,
    GenerationRequest,
    GenerationResult,
    LoraRef,
    ModelDescription,
    PixelPayload,
    PreparedRequest,
    StepEvent,
    new_request_id,
)

logger = logging.getLogger("ray.serve")

AnyRequest = GenerationRequest | BatchGenerationRequest | PreparedRequest | dict[str, Any]


class Core:
    def __init__(self, replica: DeploymentHandle, cfg: AppConfig, caller_key: bytes):
        self.cfg = cfg
        self.replica = replica
        self.registry = Registry(cfg.lora.registry_path)
        # Read by access.py's middleware and route dependency through Serve's replica context.
        self.access = AccessPolicy.from_config(cfg.auth)
        self._caller_key = caller_key
        self._rng = random.SystemRandom()
        self._model_info: ModelDescription | None = None
        self._ready_until = 0.0  # a replica said it was ready: trusted until then
        self._probe: asyncio.Future | None = None
        self._describing: asyncio.Future | None = None

    # ------------------------------------------------------------------ readiness and description

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

    async def ensure_ready(self) -> None:
        if not await self.ready():
            raise not_ready()

    async def describe(self) -> ModelDescription:
        """The model's description, asked once. A burst of first requests shares one question,
        and it goes by broadcast: a control call must not take (or be refused) a request slot
        of a replica that callers' requests are about to fill."""
        if self._model_info is None:
            if self._describing is None or self._describing.done():
                self._describing = asyncio.ensure_future(self._ask_description())
            self._model_info = await asyncio.shield(self._describing)
        return self._model_info

    async def _ask_description(self) -> ModelDescription:
        await self.ensure_ready()
        return (await self.broadcast("describe"))[0]

    # ------------------------------------------------------------------ a request's one preparation

    async def prepare(self, request: AnyRequest) -> PreparedRequest:
        """Check limits and fill in every default, once: the id and the seed (so a retried
        request makes the same image), the model's size, steps and guidance, and the adapter's
        registered scale and file (404 if it is not registered). 503 first while no replica is ready."""
        if isinstance(request, dict):
            kind = BatchGenerationRequest if "prompts" in request else GenerationRequest
            request = validated(kind, request)
        await self.ensure_ready()
        if isinstance(request, PreparedRequest):
            return request
        limits, model = self.cfg.limits, self.cfg.model
        check_limits(request, limits, request.prompts)
        loras = self._adapters(request)
        info = await self.describe()
        check_media(request, info, limits)
        video = info.modality == "video"
        task, image, mask = "generate", None, None
        if request.image is not None:
            task = edit_task(request, info)
            rgb, m, width, height = await asyncio.to_thread(
                prepare_inputs, request.image, request.mask, request.width, request.height, limits
            )
            request = request.model_copy(update={"width": width, "height": height})
            check_limits(request, limits, request.prompts)  # the size it took from the image
            image, mask = PixelPayload.from_pil(rgb), PixelPayload.from_pil(m) if m is not None else None
        elif request.strength is not None:
            raise InvalidRequest("strength: only an edit (with an image) takes it", param="strength")
        return PreparedRequest.from_request(
            request,
            request_id=_request_id(),
            seed=self._rng.randrange(MAX_SEED),
            height=info.default_height,
            width=info.default_width,
            steps=model.default_steps,
            guidance_scale=model.default_guidance_scale,
            output_format="mp4" if video else "png",
            num_frames=info.default_num_frames if video else None,
            fps=info.default_fps if video else None,
            loras=loras,
            task=task,
            image=image,
            mask=mask,
            acceleration=model.optimizations.step_cache,
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

    # ------------------------------------------------------------------ to a replica and back

    async def submit(self, request: AnyRequest) -> GenerationResult:
        """One call to a replica for the whole result."""
        prepared = await self.prepare(request)
        results = [r async for r in self._attempts(prepared, lambda h: h.generate.remote(prepared), False)]
        return results[-1]

    async def stream(
        self, request: AnyRequest, preview_every: int = 0, restart: bool = False
    ) -> AsyncIterator[StepEvent | GenerationResult]:
        """A `StepEvent` per step, then the result. A replica lost mid-stream ends the stream
        with an error, unless `restart`: then the request runs again elsewhere and its steps
        count from 1 again (jobs use this)."""
        prepared = await self.prepare(request)

        def start(handle: DeploymentHandle):
            return handle.options(stream=True).generate_stream.remote(prepared, preview_every)

        async for event in self._attempts(prepared, start, restart):
            yield event

    async def _attempts(self, request: PreparedRequest, start, restart: bool):
        """The one retry loop: send, and when the replica dies under the request (before its
        first event, or anywhere with `restart`) send again elsewhere; the whole bounded by the
        deadline. The request's fixed seed makes a retry give the same image."""
        rid, ing = request.request_id, self.cfg.ingress
        failures: list[str] = []
        try:
            async with asyncio.timeout(ing.request_timeout_s):
                while len(failures) < ing.max_attempts:
                    call, started = start(self.replica_for(request)), False
                    try:
                        async for event in _events(call):
                            started = True
                            if isinstance(event, GenerationResult):
                                self._mark_ready()
                                if failures:
                                    event = event.model_copy(update={"attempts": len(failures) + 1})
                            yield event
                        return
                    except asyncio.CancelledError:
                        call.cancel()  # the caller went away, or the deadline passed
                        raise
                    except Exception as e:
                        err = self.call_error(e, rid, failures)
                        if err is not None or (started and not restart):
                            raise err or Unavailable(
                                "the replica serving this stream died mid-stream", request_id=rid
                            ) from None
                        await backoff(failures)
        except TimeoutError:
            raise DeadlineExceeded(f"no result within {ing.request_timeout_s:g}s", request_id=rid) from None
        raise gave_up(failures, rid)

    def replica_for(self, request) -> DeploymentHandle:
        """Requests naming adapters go preferably to replicas that hold the first (Serve multiplexing)."""
        if not request.loras:
            return self.replica
        return self.replica.options(multiplexed_model_id=request.loras[0].name)

    def call_error(self, e: Exception, rid: str, failures: list[str]) -> ServingError | None:
        return call_error(e, rid, failures, self.cfg.model.served_name, self.cfg.ingress.retry_after_s)

    async def broadcast(self, method: str, *args, timeout: float | None = None) -> list[Any]:
        """Every live replica's answer. A replica that dies meanwhile is left out; an error a
        replica raises on purpose (a `ServingError`) is raised; no replica: 503."""
        try:
            answers = await self.replica.broadcast(method, *args).results_async(
                timeout_s=timeout, return_exceptions=True
            )
        except DeploymentUnavailableError:
            raise not_ready() from None
        except TimeoutError:
            raise DeadlineExceeded(f"{method}: not every replica answered within {timeout}s") from None
        out, lost = [], []
        for a in answers:
            if not isinstance(a, BaseException):
                out.append(a)
            elif isinstance(cause := unwrap(a), ServingError) and not isinstance(cause, ReplicaLost):
                raise cause
            else:
                lost.append(a)
        if lost:
            logger.warning("%s: %d replica(s) did not answer: %s", method, len(lost), lost[0])
            if not out:
                raise not_ready()
        return out

    async def fan_out(self, name: str, *args, timeout: float | None = None) -> list[Any]:
        """Call every live replica; each answers an `Outcome` and never raises, so one
        replica's failure is reported for that replica instead of failing the call."""
        results = await self.broadcast(name, *args, timeout=timeout)
        return sorted(results, key=lambda r: r.replica_id)

    # ------------------------------------------------------------------ whose request it is

    def caller(self, http: Request) -> str:
        """Whose request or job it is: a keyed digest of the API key it was sent with ("" without
        one), so records on the store name no key, and `bearer K` and `Bearer K` are one caller."""
        key = self.access.bearer(http.headers.get("authorization", ""))
        return hmac.new(self._caller_key, key.encode(), hashlib.sha256).hexdigest()[:32] if key else ""

    def requester(self, http: Request) -> str | None:
        """Whose requests an HTTP caller may see and abort: its own (see `caller`), or with an
        admin key anyone's (None)."""
        if self.access.is_admin_key(http.headers.get("authorization", "")):
            return None
        return self.caller(http)


async def _events(call):
    """A unary call's one answer, or a stream's events."""
    if isinstance(call, DeploymentResponse):
        yield await call
    else:
        async for event in call:
            yield event


def _request_id() -> str:
    """Serve's id of the current request: the client's X-Request-Id header when it sent one
    (the proxy's guard refused any other form). Our id, Serve's access logs and the response
    header agree."""
    rid = serve.context._get_serve_request_context().request_id
    return rid if rid and REQUEST_ID_PATTERN.match(rid) else new_request_id()


async def get_core() -> Core:
    """Route dependency: the core of the ingress this process serves (Serve's replica context)."""
    return servable().core


CoreDep = Annotated[Core, Depends(get_core)]
