"""Routes for operators and probes: the served model, the replicas' status, readiness and
liveness, and the static playground page."""

import time
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from serve_app.ingress.core import Core, CoreDep
from serve_app.ingress.openapi import ERRORS
from serve_app.schemas import ErrorResponse, ModelCard, ModelList, ReplicaStats, StatusResponse

_PLAYGROUND = (Path(__file__).parent.parent / "playground.html").read_text()


async def models(core: Core) -> ModelList:
    info = await core.describe()
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
        aliases=core.cfg.model.aliases,
        default_height=info.default_height,
        default_width=info.default_width,
        default_steps=info.default_steps,
        accelerations=info.accelerations,
    )
    return ModelList(data=[card])


async def status(core: Core) -> StatusResponse:
    replicas: list[ReplicaStats] = await core.broadcast("stats")
    return StatusResponse(
        model=core.cfg.model.served_name,
        replicas=sorted(replicas, key=lambda r: r.replica_id),
        queue_length=sum(r.queued_images + r.running_images for r in replicas),
    )


router = APIRouter()


@router.get("/v1/models", response_model=ModelList, responses=ERRORS)
async def list_models(core: CoreDep) -> ModelList:
    return await models(core)


@router.get("/v1/status", response_model=StatusResponse, responses=ERRORS)
async def get_status(core: CoreDep) -> StatusResponse:
    return await status(core)


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def playground() -> HTMLResponse:
    """The playground page: static, no data in it, so it needs no key (its calls send one)."""
    return HTMLResponse(_PLAYGROUND)


@router.get("/health", responses={503: {"model": ErrorResponse}})
async def health(core: CoreDep) -> dict[str, str]:
    """Readiness: 200 once an engine replica has loaded and warmed its model, 503 while none is."""
    await core.ensure_ready()
    return {"status": "ok"}


@router.get("/live")
async def live() -> dict[str, str]:
    """Liveness of this ingress: 200 while it runs, whatever the engine replicas do."""
    return {"status": "ok"}
