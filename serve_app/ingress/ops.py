"""Routes for operators and probes: the served model, the replicas' status, readiness and
liveness, and the static playground page."""

import asyncio
import time
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from serve_app.errors import ServingError, Unavailable
from serve_app.ingress.core import Core, CoreDep
from serve_app.ingress.models import ServedModel
from serve_app.ingress.openapi import ERRORS
from serve_app.schemas import (
    ErrorResponse,
    ModelCard,
    ModelDescription,
    ModelList,
    ModelStatus,
    ReplicaStats,
    StatusResponse,
    TenantStatus,
)

_PLAYGROUND = (Path(__file__).parent.parent / "playground.html").read_text()


async def models(core: Core) -> ModelList:
    """Every model, then every checkpoint registered for a pool (described as its pool). A model
    whose replicas are not ready yet is listed with `ready: false` and what its config says."""
    infos = await asyncio.gather(*(m.describe() for m in core.models), return_exceptions=True)
    if all(isinstance(i, BaseException) for i in infos):
        raise infos[0]
    now, cards = int(time.time()), {}
    for m, info in zip(core.models, infos, strict=True):
        if isinstance(info, Unavailable):
            cards[m.name] = _loading_card(m, now)
        elif isinstance(info, BaseException):
            raise info
        else:
            cards[m.name] = _card(info, m.spec.model.aliases, now)
    out = list(cards.values())
    pools = any(m.is_pool for m in core.models)
    for name, entry in sorted(core.models.checkpoints.all().items() if pools else []):
        pool = cards.get(entry.get("pool"))
        if pool is not None and pool.ready:
            extra = {"id": name, "source": name, "family": entry.get("family") or pool.family,
                     "denoiser_bytes": None, "denoiser_weights": []}  # known once loaded  # fmt: skip
            out.append(pool.model_copy(update={**extra, "aliases": [], "pool": pool.id}))
    return ModelList(data=out)


def _card(info: ModelDescription, aliases: list[str], now: int) -> ModelCard:
    return ModelCard(
        id=info.model,
        created=now,
        source=info.source,
        family=info.family,
        modalities=[info.modality],
        tasks=info.tasks,
        inputs=info.inputs,
        reference_images=info.reference_images,
        embeds_shapes=info.embeds_shapes(),
        default_num_frames=info.default_num_frames,
        aliases=aliases,
        default_height=info.default_height,
        default_width=info.default_width,
        default_steps=info.default_steps,
        accelerations=info.accelerations,
        samplers=info.samplers,
        default_sampler=info.default_sampler,
        default_sigma_schedule=info.default_sigma_schedule,
        denoiser_bytes=info.denoiser_bytes,
        denoiser_weights=info.denoiser_weights,
    )


def _loading_card(m: ServedModel, now: int) -> ModelCard:
    cfg = m.spec.model
    return ModelCard(
        id=m.name,
        created=now,
        source=cfg.source,
        family="",
        modalities=[],
        tasks=[],
        inputs=[],
        aliases=cfg.aliases,
        default_height=cfg.default_height or 0,
        default_width=cfg.default_width or 0,
        default_steps=cfg.default_steps,
        ready=False,
    )


async def status(core: Core, tenant: str | None = None) -> StatusResponse:
    """Each model's replicas (a model none of whose replicas answers says why instead), and
    the tenants: every one, or with `tenant` that one only."""
    answers = await asyncio.gather(*(m.broadcast("stats") for m in core.models), return_exceptions=True)
    per_model = []
    for m, a in zip(core.models, answers, strict=True):
        if isinstance(a, BaseException) and not isinstance(a, ServingError):
            raise a
        replicas = [] if isinstance(a, BaseException) else sorted(a, key=lambda r: r.replica_id)
        queue = sum(r.queued_images + r.running_images for r in replicas)
        error = a.message if isinstance(a, ServingError) else None
        ready = any(r.healthy for r in replicas)
        per_model.append(
            ModelStatus(model=m.name, ready=ready, replicas=replicas, queue_length=queue, error=error)
        )
    if all(not s.replicas for s in per_model):
        raise answers[0]
    every = [r for s in per_model for r in s.replicas]
    tenants = _tenants(core, every, tenant)
    if tenant is not None:  # a user key: no other tenant's name or figures anywhere
        for r in every:
            r.tenants = {k: v for k, v in r.tenants.items() if k == tenant}
    return StatusResponse(
        model=core.models.default.name,
        replicas=every,
        queue_length=sum(s.queue_length for s in per_model),
        models=per_model,
        tenants=tenants,
    )


def _tenants(core: Core, replicas: list[ReplicaStats], only: str | None) -> list[TenantStatus]:
    names = set(core.tenants.visible(only))
    if only is None:
        names.update(t for r in replicas for t in r.tenants)
    out = []
    for name in sorted(names):
        own = core.tenants.state(name)
        parts = [r.tenants[name] for r in replicas if name in r.tenants]
        total = {k: sum(p.get(k, 0) for p in parts) for k in ("queued_requests", "running_requests",
                 "queued_images", "running_images", "images_done", "started", "queue_wait_ms")}  # fmt: skip
        out.append(
            TenantStatus(
                tenant=name,
                weight=own.cfg.weight if own else 1.0,
                **{k: v for k, v in total.items() if k not in ("started", "queue_wait_ms")},
                queue_wait_ms_mean=round(total["queue_wait_ms"] / total["started"], 1)
                if total["started"]
                else 0.0,
                in_flight=own.in_flight if own else 0,
                rejected=dict(own.rejected) if own else {},
            )
        )
    return out


router = APIRouter()


@router.get("/v1/models", response_model=ModelList, responses=ERRORS)
async def list_models(core: CoreDep) -> ModelList:
    return await models(core)


@router.get("/v1/status", response_model=StatusResponse, responses=ERRORS)
async def get_status(core: CoreDep, http: Request) -> StatusResponse:
    """The replicas of every model; the tenants: all for the admin (and on a service without
    keys), a user key's own otherwise."""
    mine = None if core.requester(http) is None or not core.access.keys_required else core.tenant_of(http)
    return await status(core, mine)


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def playground() -> HTMLResponse:
    """The playground page: static, no data in it, so it needs no key (its calls send one)."""
    return HTMLResponse(_PLAYGROUND)


@router.get("/health", responses={code: {"model": ErrorResponse} for code in (400, 404, 503)})
async def health(core: CoreDep, model: str | None = None) -> dict[str, str]:
    """Readiness: 200 once a replica of the default model (or of `?model=`, a model's name or
    alias) has loaded and warmed it, 503 while none has; 404 naming the models for another name."""
    await core.ensure_ready(model)
    return {"status": "ok"}


@router.get("/live")
async def live() -> dict[str, str]:
    """Liveness of this ingress: 200 while it runs, whatever the engine replicas do."""
    return {"status": "ok"}
