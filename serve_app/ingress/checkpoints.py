"""The checkpoint registry's routes: register a checkpoint for a pool (checked like an adapter:
inside the allowed roots, safetensors only, a diffusers pipeline of the pool's family, then
loaded once on one of the pool's replicas), list, pin and remove. Changing it needs an admin
key; listing it is open to any caller."""

import asyncio
from typing import Any

from fastapi import APIRouter

from serve_app.errors import InvalidRequest
from serve_app.formats.layouts import family_of
from serve_app.formats.sources import check_checkpoint_source, shown_path
from serve_app.ingress.core import Core, CoreDep
from serve_app.ingress.failures import not_ready
from serve_app.ingress.models import ServedModel
from serve_app.ingress.openapi import ADMIN, ERRORS
from serve_app.registries import check_checkpoint_name
from serve_app.schemas import CHECKPOINT_ID, CheckpointAdd, LoraPin


def _entry(core: Core, name: str, entry: dict[str, Any]) -> dict[str, Any]:
    """A registry entry as callers see it: a local source relative to its root."""
    roots = core.cfg.checkpoints.allowed_roots
    source = entry["source"]
    shown = shown_path(source, roots) if source.startswith("/") else source
    return {"name": name, **entry, "source": shown}


async def add_checkpoint(
    core: Core, name: str, source: str, pool: str | None = None, pinned: bool = False
) -> dict[str, Any]:
    """Register `name` for a pool; the first request that names it runs on the replica that
    loaded it here."""
    check_checkpoint_name(name)
    models = core.models
    if any(m.spec.model.answers_to(name) for m in models):
        raise InvalidRequest(f"name: {name!r} is a model's name already", param="name")
    served = models.pool(pool)
    settings = core.cfg.checkpoints
    # Off the event loop: a single file's header (up to 100 MB of JSON) takes seconds to read.
    resolved, cls = await asyncio.to_thread(
        check_checkpoint_source, source, settings.allowed_roots, settings.allow_hub
    )
    if name in models.checkpoints.all():
        raise InvalidRequest(f"name: a checkpoint named {name!r} is already registered", param="name")
    await served.ensure_ready()
    family = (await served.describe()).family
    if cls and (family_of(cls) or cls) != family:
        raise InvalidRequest(
            f"source: a {cls} ({family_of(cls) or 'unknown family'}); pool {served.name!r} serves "
            f"{family} checkpoints",
            param="source",
        )
    await _load_once(core, served, name, resolved)
    entry = models.checkpoints.add(name, resolved, served.name, family)
    if pinned:
        return await pin_checkpoint(core, name, True)
    return _entry(core, name, entry)


async def _load_once(core: Core, served: ServedModel, name: str, resolved: str) -> None:
    """Load it on one of the pool's replicas (the one requests for it will go to)."""
    handle = served.handle.options(multiplexed_model_id=CHECKPOINT_ID + name)
    try:
        description = await handle.validate_checkpoint.remote(name, resolved)
    except Exception as e:
        err = core.call_error(e, name, [], served.name) or not_ready(served.label)
        err.message = err.message.replace(resolved, shown_path(resolved, core.cfg.checkpoints.allowed_roots))
        raise err from None
    family = (await served.describe()).family
    if description.get("family") != family:  # a hub checkpoint: its family is known once loaded
        await served.broadcast("drop_checkpoint", name)
        raise InvalidRequest(
            f"source: a {description.get('family')} pipeline; pool {served.name!r} serves {family}",
            param="source",
        )


async def remove_checkpoint(core: Core, name: str) -> dict[str, Any]:
    """Unregister a checkpoint and drop it from its pool's replicas; later requests get 404."""
    entry = core.models.checkpoints.remove(name)
    pool = core.models.get(entry["pool"])  # None: a pool since removed
    dropped = await pool.broadcast("drop_checkpoint", name) if pool is not None else []
    return {**_entry(core, name, entry), "dropped_from_replicas": sum(bool(d) for d in dropped)}


async def pin_checkpoint(core: Core, name: str, pinned: bool = True) -> dict[str, Any]:
    """Pin (load on every replica of its pool, never evict) or unpin a checkpoint."""
    registry = core.models.checkpoints
    served = core.models.by_name(registry.get(name)["pool"], field="name")
    most = served.spec.multiplex.max_models_per_replica if served.spec.multiplex else 0
    entry = registry.pin(name, pinned, max_pinned=most)
    await served.broadcast("pin_checkpoint", name, entry["source"], pinned)
    return _entry(core, name, entry)


async def list_checkpoints(core: Core) -> dict[str, Any]:
    """The registry and, per replica of each pool, the checkpoints it holds."""
    registry = [_entry(core, n, e) for n, e in sorted(core.models.checkpoints.all().items())]
    replicas = []
    for m in core.models:
        if m.is_pool:
            replicas += await m.broadcast("held_checkpoints")
    return {"checkpoints": registry, "replicas": sorted(replicas, key=lambda r: r["replica_id"])}


router = APIRouter()


@router.post("/v1/checkpoints", **ADMIN)
async def http_add_checkpoint(body: CheckpointAdd, core: CoreDep) -> dict[str, Any]:
    return await add_checkpoint(core, body.name, body.source, body.pool, body.pinned)


@router.get("/v1/checkpoints", responses=ERRORS)
async def http_list_checkpoints(core: CoreDep) -> dict[str, Any]:
    return await list_checkpoints(core)


@router.delete("/v1/checkpoints/{name}", **ADMIN)
async def http_remove_checkpoint(name: str, core: CoreDep) -> dict[str, Any]:
    return await remove_checkpoint(core, name)


@router.post("/v1/checkpoints/{name}/pin", **ADMIN)
async def http_pin_checkpoint(name: str, core: CoreDep, body: LoraPin | None = None) -> dict[str, Any]:
    return await pin_checkpoint(core, name, body.pinned if body is not None else True)
