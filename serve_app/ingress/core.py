"""What every route shares: readiness, the model's description, turning a request into a
`PreparedRequest`, sending it to a replica (one retry loop for calls and streams), fan-out to
every replica, and whose request it is. No FastAPI routes here and no diffusers or torch."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import logging
import random
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import Depends, Request
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponse

from serve_app.config import AppConfig
from serve_app.errors import DeadlineExceeded, InvalidRequest, ServingError, Unavailable
from serve_app.ingress.access import AccessPolicy, servable
from serve_app.ingress.checks import (
    DECODED_FAMILIES,
    check_edit_steps,
    check_inputs,
    check_limits,
    check_media,
    check_sampler,
    edit_task,
    validated,
)
from serve_app.ingress.failures import backoff, call_error, gave_up, not_ready
from serve_app.ingress.inputs import open_references, prepare_inputs
from serve_app.ingress.models import Models, ServedModel
from serve_app.ingress.result_cache import ResultCache
from serve_app.ingress.tenants import Tenants
from serve_app.metrics import count_cache
from serve_app.registries import Registry
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
    def __init__(self, replicas: dict[str, DeploymentHandle], cfg: AppConfig, caller_key: bytes):
        self.cfg = cfg
        self.models = Models(cfg, replicas)
        self.registry = Registry(cfg.lora.registry_path)
        # Read by access.py's middleware and route dependency through Serve's replica context.
        self._caller_key = caller_key
        self.tenants = Tenants(cfg.tenants, self._digest, cfg.ingress.retry_after_s)
        policy = AccessPolicy.from_config(cfg.auth)
        self.access = dataclasses.replace(policy, user_keys=policy.user_keys + self.tenants.keys())
        self._rng = random.SystemRandom()
        self.results = ResultCache(cfg.result_cache, cfg.lora.allowed_roots)

    # ------------------------------------------------------------------ readiness and description

    async def ready(self, model: str | None = None) -> bool:
        """Whether one replica of `model` (default: the default model) has loaded and warmed it
        and is healthy; a positive answer is trusted for a couple of seconds."""
        return await self.models.by_name(model).ready()

    async def ensure_ready(self, model: str | None = None) -> None:
        await self.models.by_name(model).ensure_ready()

    async def describe(self, model: str | None = None) -> ModelDescription:
        """What the model (default: the default model) says of itself, asked once."""
        return await self.models.by_name(model).describe()

    # ------------------------------------------------------------------ a request's one preparation

    async def prepare(self, request: AnyRequest) -> PreparedRequest:
        """Check limits and fill in every default, once: the model it goes to (404 if none is
        called so), the id and the seed (so a retried request makes the same image), the model's
        size, steps and guidance, and the adapters' registered scales and files (404 if one is
        not registered). 503 first while none of that model's replicas is ready."""
        if isinstance(request, dict):
            kind = BatchGenerationRequest if "prompts" in request else GenerationRequest
            request = validated(kind, request)
        if isinstance(request, PreparedRequest):
            await self.target(request).ensure_ready()
            update = {
                "tenant_weight": self.tenants.named(request.tenant, implicit=True).cfg.weight,
                "priority": self.tenants.priority(  # the default, if the caller left it
                    request.tenant, request.priority if "priority" in request.model_fields_set else None
                ),
            }
            if request.checkpoint is not None:  # its source as registered now, never the caller's
                update["checkpoint_source"] = self.models.find(request.checkpoint)[2]
            return request.model_copy(update=update)
        served, checkpoint, source = self.models.find(request.model)
        tenant = self.tenants.named(request.tenant)
        await served.ensure_ready()
        limits, model = served.spec.limits, served.spec.model
        check_limits(request, limits, request.prompts)
        loras = self._adapters(request, served, checkpoint)
        info = await served.describe()
        check_media(request, info, limits)
        sampler = check_sampler(request, info)
        video = info.modality == "video"
        if request.return_trajectory_decoded and (video or info.family not in DECODED_FAMILIES):
            raise InvalidRequest(
                "return_trajectory_decoded: an SD, SDXL, SD3 or FLUX.1 model's (a video's and the newer "
                "families' steps are not decoded)",
                param="return_trajectory_decoded",
            )
        check_inputs(request, info, limits)
        task, image, mask, refs = "generate", None, None, []
        if request.image is not None:
            task = edit_task(request, info)
            rgb, m, width, height = await asyncio.to_thread(
                prepare_inputs, request.image, request.mask, request.width, request.height, limits
            )
            request = request.model_copy(update={"width": width, "height": height})
            check_limits(request, limits, request.prompts)  # the size it took from the image
            image, mask = PixelPayload.from_pil(rgb), PixelPayload.from_pil(m) if m is not None else None
            refs = await asyncio.to_thread(open_references, request.references, limits)
        elif request.strength is not None:
            raise InvalidRequest("strength: only an edit (with an image) takes it", param="strength")
        prepared = PreparedRequest.from_request(
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
            references=[PixelPayload.from_pil(r) for r in refs],
            acceleration=model.optimizations.step_cache,
            sampler=sampler,
            model=served.name,
            checkpoint=checkpoint,
            checkpoint_source=source,
            tenant=tenant.name,
            tenant_weight=tenant.cfg.weight,
            priority=self.tenants.priority(tenant.name, request.priority),
        )
        check_edit_steps(prepared, info)
        return prepared

    def target(self, request: PreparedRequest) -> ServedModel:
        """The deployment a prepared request goes to (a handle caller's with no model: the default)."""
        return self.models.by_name(request.model or None)

    def _adapters(
        self, request: GenerationRequest | BatchGenerationRequest, served: ServedModel, checkpoint: str | None
    ) -> list[LoraRef]:
        """The request's adapters (`lora` and `loras`), each with its registered file and scale,
        in name order: the same set gives the same image whatever order it was listed in. Each
        must be registered for the model the request goes to."""
        refs = ([request.lora] if request.lora is not None else []) + list(request.loras)
        names = [r.name for r in refs]
        if len(set(names)) < len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise InvalidRequest(f"loras: adapter {dup!r} is named twice", param="loras")
        most = self.cfg.lora.max_per_request
        if len(refs) > most:
            raise InvalidRequest(f"loras: {len(refs)} adapters, the maximum is {most}", param="loras")
        if refs and checkpoint is not None:
            raise InvalidRequest(
                f"loras: adapters run on the pool's own model {served.name!r}, not on its checkpoint "
                f"{checkpoint!r}",
                param="loras",
            )
        out = []
        for ref in refs:
            entry = self.registry.get(ref.name)
            owner = self.adapter_model(entry)
            if owner != served.name:
                raise InvalidRequest(
                    f"loras: adapter {ref.name!r} is registered for model {owner!r}, not {served.name!r}",
                    param="loras",
                )
            scale = ref.scale if ref.scale is not None else entry["scale"]
            out.append(LoraRef(name=ref.name, scale=scale, path=entry["path"], version=entry.get("version")))
        return sorted(out, key=lambda r: r.name)

    def adapter_model(self, entry: dict[str, Any]) -> str:
        """The model an adapter is registered for (entries from before several models: the default)."""
        return entry.get("model") or self.models.default.name

    # ------------------------------------------------------------------ to a replica and back

    async def submit(self, request: AnyRequest, cache: bool = True) -> GenerationResult:
        """One call to a replica for the whole result, within its tenant's quotas; or, for a
        request the result cache has seen (`result_cache`), the kept result. `cache` False (the
        caller's `Cache-Control: no-cache`) makes it anew, and keeps that."""
        prepared = await self.prepare(request)
        # Off the event loop: the key hashes the input image and stats the files read.
        key = await asyncio.to_thread(self.results.key, prepared) if self.results.cfg.enabled else None
        if key is not None and cache:
            hit = self.results.get(key, prepared)
            count_cache(prepared.model, "hit" if hit else "miss", self.results.bytes)
            if hit is not None:
                return hit
        async with self.tenants.admit(prepared):
            results = [
                r async for r in self._attempts(prepared, lambda h: h.generate.remote(prepared), False)
            ]
        if key is None:
            return results[-1]
        result = self.results.put(key, results[-1], prepared.model)
        if not cache:
            result = self.results.bypassed(result)
            count_cache(prepared.model, "bypass", self.results.bytes)
        return result

    async def stream(
        self, request: AnyRequest, preview_every: int = 0, restart: bool = False, admitted: bool = False
    ) -> AsyncIterator[StepEvent | GenerationResult]:
        """A `StepEvent` per step, then the result, within its tenant's quotas. A replica lost
        mid-stream ends the stream with an error, unless `restart`: then the request runs again
        elsewhere and its steps count from 1 again, and past a quota it waits for room instead
        of failing (jobs use this)."""
        prepared = await self.prepare(request)

        def start(handle: DeploymentHandle):
            return handle.options(stream=True).generate_stream.remote(prepared, preview_every)

        # `admitted`: the caller holds the tenant's place (an HTTP stream: its 429 comes first)
        place = contextlib.nullcontext() if admitted else self.tenants.admit(prepared, wait=restart)
        async with place:
            async for event in self._attempts(prepared, start, restart):
                yield event

    async def _attempts(self, request: PreparedRequest, start, restart: bool):
        """The one retry loop: send, and when the replica dies under the request (before its
        first event, or anywhere with `restart`) send again elsewhere; the whole bounded by the
        deadline. The request's fixed seed makes a retry give the same image."""
        rid, ing, served = request.request_id, self.cfg.ingress, self.target(request)
        failures: list[str] = []
        try:
            async with asyncio.timeout(ing.request_timeout_s):
                while len(failures) < ing.max_attempts:
                    call, started = start(served.replica_for(request)), False
                    try:
                        async for event in _events(call):
                            started = True
                            if isinstance(event, GenerationResult):
                                served.mark_ready()
                                if failures:
                                    event = event.model_copy(update={"attempts": len(failures) + 1})
                            yield event
                        return
                    except asyncio.CancelledError:
                        call.cancel()  # the caller went away, or the deadline passed
                        raise
                    except Exception as e:
                        err = self.call_error(e, rid, failures, served.name)
                        if err is not None or (started and not restart):
                            raise err or Unavailable(
                                "the replica serving this stream died mid-stream", request_id=rid
                            ) from None
                        await backoff(failures)
        except TimeoutError:
            raise DeadlineExceeded(f"no result within {ing.request_timeout_s:g}s", request_id=rid) from None
        raise gave_up(failures, rid)

    def call_error(
        self, e: Exception, rid: str, failures: list[str], model: str | None = None
    ) -> ServingError | None:
        name = model or self.models.default.name
        return call_error(e, rid, failures, name, self.cfg.ingress.retry_after_s)

    async def broadcast(self, method: str, *args, timeout: float | None = None, model: str | None = None):
        """Every live replica's answer, of one model (default: the default model)."""
        return await self.models.by_name(model).broadcast(method, *args, timeout=timeout)

    async def broadcast_all(self, method: str, *args, timeout: float | None = None) -> list[Any]:
        """Every live replica's answer, of every model; a model with no live replica is left out
        (503 only when no model has one). Errors a replica raises on purpose are raised."""
        answers = await asyncio.gather(
            *(m.broadcast(method, *args, timeout=timeout) for m in self.models), return_exceptions=True
        )
        out, down = [], []
        for m, a in zip(self.models, answers, strict=True):
            if isinstance(a, Unavailable):
                down.append(m.name)
            elif isinstance(a, BaseException):
                raise a
            else:
                out += a
        if down and not out:
            raise not_ready()
        return out

    async def fan_out(self, name: str, *args, timeout: float | None = None) -> list[Any]:
        """Call every live replica of every model; each answers an `Outcome` and never raises,
        so one replica's failure is reported for that replica instead of failing the call."""
        results = await self.broadcast_all(name, *args, timeout=timeout)
        return sorted(results, key=lambda r: r.replica_id)

    # ------------------------------------------------------------------ whose request it is

    def caller(self, http: Request) -> str:
        """Whose request or job it is: a keyed digest of the API key it was sent with ("" without
        one), so records on the store name no key, and `bearer K` and `Bearer K` are one caller."""
        key = self.access.bearer(http.headers.get("authorization", ""))
        return self._digest(key) if key else ""

    def _digest(self, key: str) -> str:
        return hmac.new(self._caller_key, key.encode(), hashlib.sha256).hexdigest()[:32]

    def tenant_of(self, http: Request) -> str:
        """The tenant of an HTTP request: its API key's; on a service without keys, `default`
        whatever the request sends (a made-up key is no tenant of its own)."""
        if not self.access.keys_required:
            return self.tenants.of_key("")
        return self.tenants.of_key(self.access.bearer(http.headers.get("authorization", "")))

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
    return rid if rid and REQUEST_ID_PATTERN.fullmatch(rid) else new_request_id()


async def get_core() -> Core:
    """Route dependency: the core of the ingress this process serves (Serve's replica context)."""
    return servable().core


CoreDep = Annotated[Core, Depends(get_core)]
