"""Routes that change the server for everyone: adapter registration, pinning and removal, the
profiler, and collective RPC to the replicas' engines. Each needs an admin key (or the local
opt-in); listing the adapters is open to any caller."""

import asyncio
import logging
import re
import uuid
from pathlib import Path
from typing import Any

from fastapi import APIRouter

from serve_app.errors import InvalidRequest, ServingError
from serve_app.formats.lora import check_adapter_file
from serve_app.formats.sources import shown_path
from serve_app.ingress.core import Core, CoreDep
from serve_app.ingress.failures import not_ready
from serve_app.ingress.models import ServedModel
from serve_app.ingress.openapi import ADMIN, ERRORS
from serve_app.registries import PUSHED_DIR, check_name
from serve_app.schemas import LoraAdd, LoraPin, Outcome, ProfileStart, RpcCall
from serve_app.schemas.control import TRACE_PREFIX_REGEX


def _entry(core: Core, name: str, entry: dict[str, Any]) -> dict[str, Any]:
    """A registry entry as callers see it: its path relative to its adapter root."""
    return {"name": name, **entry, "path": shown_path(entry["path"], core.cfg.lora.allowed_roots)}


async def add_lora(
    core: Core, name: str, path: str, scale: float = 1.0, pinned: bool = False, model: str | None = None
) -> dict[str, Any]:
    """Register an adapter for one model (default: the default model) after checking its file
    and loading it once on one of that model's replicas: an adapter made for another family
    is refused there, with the engine's reason."""
    check_name(name)
    lim = core.cfg.lora
    served = core.models.by_name(model)
    # Off the event loop: the file's header is read (its JSON parse holds the thread for as long).
    resolved = await asyncio.to_thread(check_adapter_file, path, lim.allowed_roots, lim.max_file_mb)
    if name in core.registry.all():
        raise InvalidRequest(f"name: an adapter named {name!r} is already registered", param="name")
    await served.ensure_ready()
    try:
        await served.handle.validate_lora.remote(str(resolved))
    except Exception as e:
        err = core.call_error(e, name, [], served.name) or not_ready(served.label)
        err.message = err.message.replace(str(resolved), shown_path(str(resolved), lim.allowed_roots))
        if served.label and err.param == "path":
            err.message += f" (model {served.name!r}, family {(await served.describe()).family})"
        raise err from None
    entry = core.registry.add(name, str(resolved), scale, model=served.name)
    if pinned:
        return await pin_lora(core, name, True)
    return _entry(core, name, entry)


logger = logging.getLogger(__name__)

PUSHED_KEPT = 16  # versions of one pushed adapter kept on disk (queued requests may name older ones)
PUSH_LOAD_S = 300.0  # how long a push waits for every replica to load it (each between two calls)


async def push_lora(
    core: Core, name: str, weights: dict[str, Any], scale: float = 1.0, model: str | None = None
) -> dict[str, Any]:
    """A trainer's new adapter weights (tensors, as a LoRA state dict in the diffusers/peft or
    kohya layout) as the next version of pushed adapter `name`: written to a file of its own
    under the first adapter root (so replicas that start later load it too), checked on one
    replica, then numbered and registered under the registry's lock (concurrent pushes get
    distinct versions, never reused), then loaded on every replica of the model between two of
    its calls. Handle callers only."""
    check_name(name)
    if "." in name:  # PEFT keeps adapters in module dicts, whose keys hold no '.'
        raise InvalidRequest("name: a pushed adapter's name holds no '.'", param="name")
    lim = core.cfg.lora
    if not lim.allowed_roots:
        raise InvalidRequest(
            "weights: pushed adapters are kept under lora.allowed_roots; none is set", param="weights"
        )
    _check_weights(weights)
    served = core.models.by_name(model)
    await served.ensure_ready()
    if "version" not in core.registry.all().get(name, {"version": 0}):
        raise InvalidRequest(
            f"name: adapter {name!r} is registered from a file; remove it before pushing one", param="name"
        )
    folder = Path(lim.allowed_roots[0]) / PUSHED_DIR / name
    staged = folder / f"incoming-{uuid.uuid4().hex}.safetensors"  # this push's own file
    try:
        await asyncio.to_thread(_write_weights, weights, staged)
        await asyncio.to_thread(check_adapter_file, str(staged), lim.allowed_roots, lim.max_file_mb)
        await served.handle.validate_lora.remote(str(staged))
    except Exception as e:
        staged.unlink(missing_ok=True)
        if isinstance(e, OSError | ValueError | TypeError):  # the weights could not be written
            raise InvalidRequest(
                f"weights: not written as safetensors ({type(e).__name__})", param="weights"
            ) from None
        err = core.call_error(e, name, [], served.name) or not_ready(served.label)
        shown = err.message.removeprefix("path: ").replace(str(staged), f"{name} (pushed)")
        err.param, err.message = "weights", f"weights: {shown}"
        raise err from None

    def claim(last: int) -> tuple[int, str]:  # under the registry's lock
        version = max([last, *_versions(folder)]) + 1  # a removed name's numbers are not reused
        final = folder / f"v{version}.safetensors"
        staged.replace(final)
        return version, str(final)

    try:
        entry = await asyncio.to_thread(core.registry.push, name, scale, served.name, claim)
    finally:
        staged.unlink(missing_ok=True)  # gone once claimed; left only if the registry refused it
    version, path = entry["version"], entry["path"]
    answer = {"name": name, "version": version, "model": served.name}
    try:
        loaded = await served.broadcast("load_pushed_lora", name, version, path, timeout=PUSH_LOAD_S)
        answer["replicas"] = len(loaded)
    except ServingError as e:  # registered: requests load it where they run; say what went wrong
        answer["replicas"], answer["not_loaded"] = 0, e.message
    for old in sorted(_versions(folder))[:-PUSHED_KEPT]:
        (folder / f"v{old}.safetensors").unlink(missing_ok=True)
    return answer


def _check_weights(weights: Any) -> None:
    """A trainer's weights as pushes take them: a non-empty dict of names to torch tensors."""
    import torch

    if (
        not isinstance(weights, dict)
        or not weights
        or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in weights.items())
    ):
        raise InvalidRequest("weights: a non-empty dict of tensor names to torch tensors", param="weights")


def _versions(folder: Path) -> list[int]:
    """The version numbers of the files kept in a pushed adapter's folder."""
    return [
        int(m[1])
        for f in folder.glob("v*.safetensors")
        if (m := re.fullmatch(r"v(\d+)\.safetensors", f.name))
    ]


async def push_weights(
    core: Core, weights: dict[str, Any], version: int, model: str | None = None
) -> dict[str, Any]:
    """Denoiser weights to every live replica of `model`, through the object store (put once,
    read by each replica), as `version`. A replica that starts later loads the configured
    weights (its results carry no `weights_version`)."""
    import ray

    _check_weights(weights)
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise InvalidRequest("version: a whole number, at least 0", param="version")
    served = core.models.by_name(model)
    await served.ensure_ready()
    ref = await asyncio.to_thread(ray.put, weights)
    done = await served.broadcast("load_denoiser_weights", ref, version)
    await _tell_ingresses(core, served.name, version)
    return {"model": served.name, "weights_version": version, "replicas": len(done)}


async def _tell_ingresses(core: Core, model: str, version: int) -> None:
    """Every ingress replica's result cache keys on the new weights (this one's at least)."""
    core.results.weights[model] = version
    try:
        from ray import serve

        ctx = serve.get_replica_context()
        me = serve.get_deployment_handle(ctx.deployment, ctx.app_name)
        await me.broadcast("note_weights", model, version).results_async(timeout_s=30, return_exceptions=True)
    except Exception as e:  # outside Serve (tests of the core): this ingress only
        logger.debug("could not tell the other ingress replicas of new weights: %s", e)


def _write_weights(weights: dict[str, Any], path: Path) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_suffix(".part")
    save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(part))
    part.replace(path)


def _owner(core: Core, name: str) -> ServedModel | None:
    """The model an adapter is for; None if that model is no longer served."""
    return core.models.get(core.adapter_model(core.registry.get(name)))


async def remove_lora(core: Core, name: str) -> dict[str, Any]:
    """Unregister an adapter and evict it from its model's replicas; later requests for it get 404."""
    served = _owner(core, name)
    entry = core.registry.remove(name)
    evicted = await served.broadcast("evict_lora", name) if served is not None else []
    return {**_entry(core, name, entry), "evicted_from_replicas": sum(bool(e) for e in evicted)}


async def pin_lora(core: Core, name: str, pinned: bool = True) -> dict[str, Any]:
    """Pin (load on every replica of its model, never evict) or unpin an adapter."""
    served = _owner(core, name)
    if served is None:
        raise InvalidRequest(
            f"name: adapter {name!r} is for a model no longer served; remove it", param="name"
        )
    if "version" in core.registry.get(name):
        raise InvalidRequest(
            f"name: adapter {name!r} is pushed: each version is loaded on every replica as it comes",
            param="name",
        )
    entry = core.registry.pin(
        name, pinned, max_pinned=core.cfg.lora.max_loaded, default=core.models.default.name
    )
    await served.broadcast("pin_lora", name, entry["path"], pinned)
    return _entry(core, name, entry)


async def list_loras(core: Core) -> dict[str, Any]:
    """The registry (name, model, path, scale, pinned) and, per replica, the adapters it holds."""
    registry = [
        {**_entry(core, n, e), "model": core.adapter_model(e)} for n, e in sorted(core.registry.all().items())
    ]
    replicas = await core.broadcast_all("loaded_loras")
    return {"adapters": registry, "replicas": sorted(replicas, key=lambda r: r["replica_id"])}


async def start_profile(core: Core, prefix: str = "trace") -> list[Outcome]:
    """Every live replica starts the torch profiler; per-replica outcomes."""
    if not re.fullmatch(TRACE_PREFIX_REGEX, prefix):  # the document's pattern
        raise InvalidRequest("prefix: 1-64 letters, digits, '.', '_' or '-'", param="prefix")
    return await core.fan_out("start_profile", prefix)


async def collective_rpc(
    core: Core,
    method: str,
    args: list | None = None,
    kwargs: dict | None = None,
    timeout: float | None = None,
) -> list[Outcome]:
    """Call `method` on every live replica's engine; errors are reported per replica.

    Only methods the engine (or its extension) exports can be called; others get a 400."""
    allowed = (await core.describe()).rpc_methods
    if method not in allowed:
        raise InvalidRequest(
            f"method: {method!r} cannot be called; allowed: {', '.join(allowed)}", param="method"
        )
    return await core.fan_out("collective_rpc", method, list(args or []), dict(kwargs or {}), timeout=timeout)


router = APIRouter()


@router.post("/v1/loras", **ADMIN)
async def http_add_lora(body: LoraAdd, core: CoreDep) -> dict[str, Any]:
    return await add_lora(core, body.name, body.path, body.scale, body.pinned, body.model)


@router.get("/v1/loras", responses=ERRORS)
async def http_list_loras(core: CoreDep) -> dict[str, Any]:
    return await list_loras(core)


@router.delete("/v1/loras/{name}", **ADMIN)
async def http_remove_lora(name: str, core: CoreDep) -> dict[str, Any]:
    return await remove_lora(core, name)


@router.post("/v1/loras/{name}/pin", **ADMIN)
async def http_pin_lora(name: str, core: CoreDep, body: LoraPin | None = None) -> dict[str, Any]:
    return await pin_lora(core, name, body.pinned if body is not None else True)


@router.post("/start_profile", **ADMIN)
async def http_start_profile(core: CoreDep, body: ProfileStart | None = None) -> list[Outcome]:
    return await start_profile(core, body.prefix if body else "trace")


@router.post("/stop_profile", **ADMIN)
async def http_stop_profile(core: CoreDep) -> list[Outcome]:
    """Every live replica stops its profiler and writes a trace; the reply lists the files."""
    return await core.fan_out("stop_profile")


@router.post("/v1/rpc", **ADMIN)
async def http_collective_rpc(body: RpcCall, core: CoreDep) -> list[Outcome]:
    return await collective_rpc(core, body.method, body.args, body.kwargs, body.timeout)
