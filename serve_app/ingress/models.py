"""The models behind the endpoint, as the ingress sees them: one `ServedModel` per model
deployment (its handle, readiness, description and fan-out), and `Models`, which finds the one
a request names: by name, by alias, or as a checkpoint registered for a pool."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from serve_app.config import AppConfig, Served
from serve_app.errors import DeadlineExceeded, InvalidRequest, NotFound, ReplicaLost, ServingError
from serve_app.ingress.failures import not_ready, unwrap
from serve_app.registries import CheckpointRegistry
from serve_app.schemas import CHECKPOINT_ID, ModelDescription

logger = logging.getLogger("ray.serve")


class ServedModel:
    """One model deployment: readiness (trusted a couple of seconds once a replica said it),
    its description (asked once), and calls to every replica."""

    def __init__(self, spec: Served, handle: DeploymentHandle, probe_timeout_s: float):
        self.spec, self.handle, self.name = spec, handle, spec.name
        self._probe_timeout_s = probe_timeout_s
        self._info: ModelDescription | None = None
        self._ready_until = 0.0
        self._probe: asyncio.Future | None = None
        self._describing: asyncio.Future | None = None
        self.label: str | None = None  # the name in 503s, where the application serves several

    @property
    def is_pool(self) -> bool:
        return self.spec.multiplex is not None

    async def ready(self) -> bool:
        """Whether one of this model's replicas has loaded and warmed it and is healthy. One
        probe at a time: a burst after a quiet spell waits for the same one. Replicas too busy
        to answer within the probe's time are alive, so they count as ready."""
        if time.monotonic() < self._ready_until:
            return True
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._probe_replicas())
        return await asyncio.shield(self._probe)

    async def _probe_replicas(self) -> bool:
        try:
            answers = await self.handle.broadcast("ready").results_async(
                timeout_s=self._probe_timeout_s, return_exceptions=True
            )
        except DeploymentUnavailableError:
            return False
        except TimeoutError:
            answers = [True]
        if any(a is True for a in answers):
            self.mark_ready()
            return True
        return False

    def mark_ready(self) -> None:
        self._ready_until = time.monotonic() + 2.0

    async def ensure_ready(self) -> None:
        if not await self.ready():
            raise not_ready(self.label)

    async def describe(self) -> ModelDescription:
        """The model's description, asked once, by broadcast: a control call must not take (or
        be refused) a request slot of a replica that callers' requests are about to fill."""
        if self._info is None:
            if self._describing is None or self._describing.done():
                self._describing = asyncio.ensure_future(self._ask_description())
            self._info = await asyncio.shield(self._describing)
        return self._info

    async def _ask_description(self) -> ModelDescription:
        await self.ensure_ready()
        return (await self.broadcast("describe"))[0]

    async def broadcast(self, method: str, *args, timeout: float | None = None) -> list[Any]:
        """Every live replica's answer. A replica that dies meanwhile is left out; an error a
        replica raises on purpose (a `ServingError`) is raised; no replica: 503."""
        try:
            answers = await self.handle.broadcast(method, *args).results_async(
                timeout_s=timeout, return_exceptions=True
            )
        except DeploymentUnavailableError:
            raise not_ready(self.label) from None
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
            logger.warning(
                "%s: %d replica(s) of %s did not answer: %s", method, len(lost), self.name, lost[0]
            )
            if not out:
                raise not_ready(self.label)
        return out

    def replica_for(self, request) -> DeploymentHandle:
        """A pool's checkpoint requests go preferably to replicas that hold the checkpoint, other
        requests naming adapters to replicas that hold the first (Serve's multiplexing)."""
        if request.checkpoint:
            return self.handle.options(multiplexed_model_id=CHECKPOINT_ID + request.checkpoint)
        if not request.loras:
            return self.handle
        return self.handle.options(multiplexed_model_id=request.loras[0].loaded_name)


class Models:
    """Every model of the application, the default first, and the pools' checkpoint registry."""

    def __init__(self, cfg: AppConfig, handles: dict[str, DeploymentHandle]):
        timeout = cfg.ingress.ready_probe_timeout_s
        self.all = [ServedModel(s, handles[s.name], timeout) for s in cfg.served()]
        self.default = self.all[0]
        if len(self.all) > 1:
            for m in self.all:
                m.label = m.name
        self.checkpoints = CheckpointRegistry(cfg.checkpoints.registry_path)

    def __iter__(self):
        return iter(self.all)

    def names(self) -> list[str]:
        return [m.name for m in self.all]

    def get(self, name: str) -> ServedModel | None:
        """The model served under exactly this name; None if none is (a model since removed)."""
        return next((m for m in self.all if m.name == name), None)

    def find(self, name: str | None) -> tuple[ServedModel, str | None, str | None]:
        """The model a request names (None: the default), and the registered checkpoint and its
        source when the name is one of a pool's; else a 404 that lists what is served."""
        if name is None:
            return self.default, None, None
        for m in self.all:
            if m.spec.model.answers_to(name):
                return m, None, None
        pools = {m.name: m for m in self.all if m.is_pool}
        if pools and len(name) <= 128:  # no pools: no registry read on the request path
            entry = self.checkpoints.all().get(name)
            if entry is not None and entry.get("pool") in pools:
                return pools[entry["pool"]], name, entry["source"]
        shown = name if len(name) <= 64 else name[:64] + "..."
        raise NotFound(
            f"model: {shown!r} is not served here; available: {', '.join(map(repr, self.available()))}",
            param="model",
        )

    def available(self) -> list[str]:
        """The models' names (their aliases are in /v1/models), then the pools' checkpoints."""
        out = [m.name for m in self.all]
        pools = {m.name for m in self.all if m.is_pool}
        if not pools:
            return out
        out += sorted(n for n, e in self.checkpoints.all().items() if e.get("pool") in pools)
        return out

    def pool(self, name: str | None) -> ServedModel:
        """The pool a checkpoint is registered for: the one named, or the only one."""
        pools = [m for m in self.all if m.is_pool]
        if name is None:
            if len(pools) != 1:
                which = "no model is a pool (multiplex:)" if not pools else "there are several; name one"
                raise InvalidRequest(f"pool: {which}", param="pool")
            return pools[0]
        for m in pools:
            if m.spec.model.answers_to(name):
                return m
        raise InvalidRequest(
            f"pool: {name[:64]!r} is not a pool; pools: {', '.join(m.name for m in pools) or 'none'}",
            param="pool",
        )

    def by_name(self, name: str | None, field: str = "model") -> ServedModel:
        """A deployed model by name or alias (not a checkpoint); None: the default."""
        if name is None:
            return self.default
        for m in self.all:
            if m.spec.model.answers_to(name):
                return m
        raise NotFound(
            f"{field}: {name[:64]!r} is not served here; models: {', '.join(self.names())}", param=field
        )
