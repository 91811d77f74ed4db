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

from serve_app.checkpoints import CheckpointRegistry
from serve_app.config import CheckpointsConfig, ModelConfig, MultiplexSettings
from serve_app.engine import Engine, ModelLoadError
from serve_app.errors import InvalidRequest
from serve_app.replica.checkpoints import CheckpointResidency
from serve_app.replica.routing import report_adapters
from serve_app.schemas import CHECKPOINT_ID, PreparedRequest

logger = logging.getLogger("ray.serve")


class CheckpointServing:
    """Mixed into the replica: the pool's residency, the routing ids and the control calls."""

    engine: Engine
    cfg: ModelConfig

    def _init_routing(self) -> None:
        self._adapter_ids: list[str] = []
        self.checkpoints: CheckpointResidency | None = None

    def _adapters_changed(self, names: list[str]) -> None:
        self._adapter_ids = list(names)
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
            cfg = base.model_copy(update={"source": source, "name": name, "aliases": [], "warmup": False})
            return factory(cfg, reuse=reuse)

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
        if getattr(self, "_pinned_at_start", None):
            try:
                asyncio.get_running_loop().create_task(self._pin_at_start())
            except RuntimeError:  # built outside an event loop (a test): pinned on first use
                pass

    async def _pin_at_start(self) -> None:
        for name, source in getattr(self, "_pinned_at_start", []):
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
        try:
            return await self.checkpoints.engine(request.checkpoint, request.checkpoint_source)
        except ModelLoadError as e:
            raise InvalidRequest(
                f"model: checkpoint {request.checkpoint!r} cannot be loaded: {_no_paths(e)}",
                param="model",
                request_id=request.request_id,
            ) from None

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
        from serve_app.replica.deployment import _replica_id

        r = self.checkpoints
        return {
            "replica_id": _replica_id(),
            "model": self.cfg.served_name,
            "held": r.held if r is not None else [],
            "pinned": r.pinned if r is not None else [],
            "loads": r.loads if r is not None else 0,
            "evictions": r.evictions if r is not None else 0,
            "shared_components": r.shared_components if r is not None else 0,
        }


def _no_paths(e: Exception) -> str:
    """A load error without the server's paths: only the last part of each is kept."""
    import re

    return re.sub(r"(/[^\s'\":]+)+/([^\s'\"/:]+)", r"\2", str(e))
