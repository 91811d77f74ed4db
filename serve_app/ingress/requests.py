"""Requests by id: where one is (queued, running, recently finished) and aborting it. A caller
sees and aborts only its own; an admin key and handle callers, anyone's."""

from typing import Annotated

from fastapi import APIRouter, Path, Request

from serve_app.errors import NotFound
from serve_app.ingress.checks import check_path_id
from serve_app.ingress.core import Core, CoreDep
from serve_app.ingress.openapi import ERRORS
from serve_app.ingress.present import abort_response
from serve_app.schemas import REQUEST_ID_REGEX, AbortResponse, RequestState

_ORDER = {"running": 0, "queued": 1, "done": 2, "failed": 3, "aborted": 4}
# The form a request id has, in the document; `check_path_id` refuses any other with its 400.
RequestIdPath = Annotated[
    str,
    Path(
        description="1-128 letters, digits, '.', '_', ':' or '-'.",
        json_schema_extra={"pattern": REQUEST_ID_REGEX, "minLength": 1, "maxLength": 128},
    ),
]


async def abort(core: Core, request_ids: list[str], owner: str | None = None) -> dict[str, str]:
    """Abort requests by id wherever they are: `aborted`, `finished` or `unknown` per id.
    With `owner`, only that caller's requests (another caller's are `unknown`)."""
    for rid in request_ids:
        check_path_id(rid)
    answers = await core.broadcast_all("abort", list(request_ids), owner)
    out = {}
    for rid in request_ids:
        seen = {a.get(rid) for a in answers}
        out[rid] = next((s for s in ("aborted", "finished") if s in seen), "unknown")
    return out


async def request_status(core: Core, request_id: str, owner: str | None = None) -> RequestState:
    """Where a request is; with `owner`, only that caller's (another's is a 404 like an
    unknown id)."""
    check_path_id(request_id)
    found = [st for st in await core.broadcast_all("request_status", request_id, owner) if st is not None]
    if not found:
        raise NotFound(
            f"request_id: no request {request_id!r} is queued, running or recently finished",
            param="request_id",
        )
    return min(found, key=lambda st: _ORDER[st.state])


router = APIRouter()


@router.get("/v1/requests/{request_id}", response_model=RequestState, responses=ERRORS)
async def get_request(request_id: RequestIdPath, http: Request, core: CoreDep) -> RequestState:
    return await request_status(core, request_id, core.requester(http))


@router.post("/v1/requests/{request_id}/abort", response_model=AbortResponse, responses=ERRORS)
async def abort_request(request_id: RequestIdPath, http: Request, core: CoreDep) -> AbortResponse:
    return await _abort_one(core, request_id, http)


@router.delete("/v1/requests/{request_id}", response_model=AbortResponse, responses=ERRORS)
async def delete_request(request_id: RequestIdPath, http: Request, core: CoreDep) -> AbortResponse:
    return await _abort_one(core, request_id, http)


async def _abort_one(core: Core, request_id: str, http: Request) -> AbortResponse:
    """The caller's request aborted; another caller's is left alone and answered `unknown`,
    exactly as an id nobody used."""
    outcome = (await abort(core, [request_id], core.requester(http)))[request_id]
    return abort_response(request_id, outcome)
