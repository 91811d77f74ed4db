"""A pool replica's checkpoints: besides its own model, a replica of a pool (`multiplex:`)
serves the checkpoints registered for it, each its own engine, held by `CheckpointResidency`
(least recently used evicted, pinned ones kept). A request names one by `checkpoint`; its
engine is loaded on the residency's loader thread while the engine thread goes on with the
calls of the models it holds. The ids Serve's router sees are the adapters and the
checkpoints held (`checkpoint:<name>`), so requests go where their checkpoint is."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from serve_app.config import CheckpointsConfig, ModelConfig, MultiplexSettings
from serve_app.engine import Engine, ModelLoadError
from serve_app.errors import Aborted, InvalidRequest
from serve_app.formats.sources import check_checkpoint_source
from serve_app.registries import CheckpointRegistry
from serve_app.replica.checkpoints import CheckpointResidency
from serve_app.replica.routing import replica_id, report_adapters
from serve_app.schemas import CHECKPOINT_ID, PreparedRequest

logger = logging.getLogger("ray.serve")


class CheckpointServing:
    """Mixed into the replica: the pool's residency, the routing ids and the control calls."""

    engine: Engine
    cfg: ModelConfig

    def _init_routing(self) -> None:
        self._adapter_ids: list[str] = []
        self.checkpoints: CheckpointResidency | None = None
        self._pending: dict[tuple[str, str], asyncio.Task] = {}  # requests whose checkpoint loads
        self._pinned_at_start: list[tuple[str, str]] = []
        try:  # Serve builds the replica on its event loop; the report is made there
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None

    def _adapters_changed(self, names: list[str]) -> None:
        """From the engine thread (adapter loads): report on the event loop, which owns the
        checkpoints' list."""
        self._adapter_ids = list(names)
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._report_routing)
        else:
            self._report_routing()

    def _report_routing(self) -> None:
        held = self.checkpoints.held if self.checkpoints is not None else []
        report_adapters(self._adapter_ids + [CHECKPOINT_ID + n for n in held])

    def _init_pool(self, factory, multiplex: MultiplexSettings | None, settings: CheckpointsConfig) -> None:
        """With `multiplex`, hold registered checkpoints; the pinned ones of this pool load now,
        before the replica takes traffic (as pinned adapters do)."""
        if multiplex is None:
            return
        base = self.cfg

        def load(name: str, source: str, reuse: dict) -> Engine:
            # Checked again here, where it is loaded: files may have changed since it was registered.
            try:
                source, _ = check_checkpoint_source(source, settings.allowed_roots, settings.allow_hub)
            except InvalidRequest as e:
                raise ModelLoadError(e.message.removeprefix("source: ")) from None
            own = {"source": source, "name": name, "aliases": [], "warmup": False, "revision": None,
                   "variant": None, "safetensors_only": True,
                   # a single file's configs: the pool's own, else its model's layout
                   "pipeline_config": base.pipeline_config or base.source}  # fmt: skip
            return factory(base.model_copy(update=own), reuse=reuse)

        self.checkpoints = CheckpointResidency(
            load, multiplex.max_models_per_replica, on_change=lambda names: self._report_routing()
        )
        self._pinned_at_start = [
            (n, e["source"])
            for n, e in CheckpointRegistry(settings.registry_path).all().items()
            if e.get("pinned") and e.get("pool") == base.served_name
        ]

    def _start_pinning(self) -> None:
        """The pinned checkpoints load on the loader thread as soon as the replica runs (Serve
        builds it on its event loop's thread, which no constructor can wait on)."""
        if self._pinned_at_start:
            try:
                asyncio.get_running_loop().create_task(self._pin_at_start())
            except RuntimeError:  # built outside an event loop (a test): pinned on first use
                pass

    async def _pin_at_start(self) -> None:
        for name, source in self._pinned_at_start:
            try:
                await self.checkpoints.pin(name, source)
            except Exception as e:  # a checkpoint gone: serve without it
                logger.warning("pinned checkpoint %s not held: %s", name, e)
        self._pinned_at_start = []

    async def _engine_for(self, request: PreparedRequest) -> Engine:
        """The engine a request runs on: this replica's own, or its checkpoint's (loaded now if
        this replica lacks it; a checkpoint that cannot load is the caller's 400)."""
        if request.checkpoint is None:
            return self.engine
        if self.checkpoints is None:
            raise InvalidRequest(
                f"model: {request.checkpoint!r} is a checkpoint; this model is not a pool",
                param="model",
                request_id=request.request_id,
            )
        ident = (request.owner, request.request_id)
        task = asyncio.ensure_future(self.checkpoints.engine(request.checkpoint, request.checkpoint_source))
        self._pending[ident] = task  # abort and status see it while its checkpoint loads
        try:
            return await task
        except asyncio.CancelledError:
            if task.cancelled() and not asyncio.current_task().cancelling():
                raise Aborted(
                    "request aborted while its checkpoint loaded", request_id=request.request_id
                ) from None
            raise
        except ModelLoadError as e:
            raise InvalidRequest(
                f"model: checkpoint {request.checkpoint!r} cannot be loaded: {_no_paths(e)}",
                param="model",
                request_id=request.request_id,
            ) from None
        finally:
            self._pending.pop(ident, None)

    def _abort_pending(self, request_ids: list[str], owner: str | None) -> dict[str, str]:
        """Abort requests still waiting for their checkpoint's engine (not queued yet)."""
        out = {}
        for (who, rid), task in list(self._pending.items()):
            if rid in request_ids and (owner is None or who == owner):
                task.cancel()  # the load goes on for the others; this request ends `Aborted`
                out[rid] = "aborted"
        return out

    def _pending_state(self, request_id: str, owner: str | None) -> bool:
        return any(rid == request_id and (owner is None or who == owner) for who, rid in self._pending)

    # ------------------------------------------------------------------ control calls (the ingress's)

    def _residency(self) -> CheckpointResidency:
        if self.checkpoints is None:
            raise InvalidRequest("pool: this model is not a pool (multiplex:)", param="pool")
        return self.checkpoints

    async def validate_checkpoint(self, name: str, source: str) -> dict[str, Any]:
        """Load a checkpoint about to be registered (it stays held here, ready for its first
        request); one that cannot load is a 400 naming `source`."""
        try:
            engine = await self._residency().engine(name, source)
        except ModelLoadError as e:
            raise InvalidRequest(f"source: cannot load it: {_no_paths(e)}", param="source") from None
        return engine.describe()

    async def pin_checkpoint(self, name: str, source: str, pinned: bool) -> list[str]:
        residency = self._residency()
        if pinned:
            try:
                await residency.pin(name, source)
            except ModelLoadError as e:
                raise InvalidRequest(f"pinned: cannot load it: {_no_paths(e)}", param="pinned") from None
        else:
            residency.unpin(name)
        return residency.held

    async def drop_checkpoint(self, name: str) -> bool:
        return self.checkpoints.drop(name) if self.checkpoints is not None else False

    def held_checkpoints(self) -> dict[str, Any]:
        r = self.checkpoints
        return {
            "replica_id": replica_id(),
            "model": self.cfg.served_name,
            "held": r.held if r is not None else [],
            "pinned": r.pinned if r is not None else [],
            "loads": r.loads if r is not None else 0,
            "evictions": r.evictions if r is not None else 0,
            "shared_components": r.shared_components if r is not None else 0,
        }


def _no_paths(e: Exception) -> str:
    """A load error without the server's paths: each absolute path (up to a quote or the end of
    a line) is cut to its last part."""
    import re

    return re.sub(r"/[^'\"\n]*/([^'\"\n/]+)", r"\1", str(e))
