"""The ingress deployment: the Serve class that holds what one ingress replica shares (the core,
the jobs desk, the links), and the Python API that handle callers use. HTTP routes live in the
API modules beside this one and reach this object through Serve's replica context."""

from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.config import AppConfig
from serve_app.ingress import admin, checkpoints, ops, requests
from serve_app.ingress.a1111_desk import A1111Desk
from serve_app.ingress.checks import validated
from serve_app.ingress.core import Core
from serve_app.ingress.http import make_app
from serve_app.ingress.jobs import JobDesk
from serve_app.ingress.links import Links
from serve_app.jobs import Store
from serve_app.schemas import (
    BatchGenerationRequest,
    GenerationRequest,
    GenerationResult,
    ModelList,
    Outcome,
    RequestState,
    StatusResponse,
    StepEvent,
)


class DiffusionIngress:
    def __init__(self, replicas: dict[str, DeploymentHandle], config: AppConfig | dict[str, Any]):
        """`replicas`: each model's deployment by its served name (the default first)."""
        self.cfg = AppConfig.model_validate(config)
        # Asynchronous jobs and stored outputs (serve_app.jobs); the runner resumes orphaned jobs.
        self.store = Store(self.cfg.jobs.store)
        key = self.store.secret("url", self.cfg.jobs.url_secret_env)
        self.core = Core(replicas, self.cfg, key)
        self.links = Links(self.store, key, self.cfg.jobs)
        self.desk = JobDesk(self.core, self.store, self.links, lambda rid: self.abort([rid]))
        self.a1111 = A1111Desk(self.store)  # the AUTOMATIC1111 routes' per-caller state
        # Read by access.py's middleware and route dependency through Serve's replica context.
        self.access = self.core.access
        # Bodies are bounded before anyone knows which model they name: by the largest bound.
        self.max_body_bytes = max(s.limits.max_body_bytes for s in self.cfg.served())
        self.max_upload_bytes = max(s.limits.max_upload_bytes for s in self.cfg.served())

    # ------------------------------------------------------------------ the Python API (handle callers)

    async def ready(self, model: str | None = None) -> bool:
        """Whether one replica of `model` (default: the default model) has loaded and warmed it
        and is healthy."""
        return await self.core.ready(model)

    async def generate(
        self, request: GenerationRequest | dict[str, Any], cache: bool = True
    ) -> GenerationResult:
        """One prompt. Raises a `ServingError` subclass on any failure. `cache` False: never
        from the result cache (`result_cache`)."""
        if isinstance(request, dict):
            request = validated(GenerationRequest, request)
        return await self.core.submit(request, cache)

    async def generate_batch(
        self, request: BatchGenerationRequest | dict[str, Any], cache: bool = True
    ) -> GenerationResult:
        """Several prompts, one parameter set, one engine call, one merged result."""
        if isinstance(request, dict):
            request = validated(BatchGenerationRequest, request)
        return await self.core.submit(request, cache)

    async def generate_stream(
        self,
        request: GenerationRequest | BatchGenerationRequest | dict[str, Any],
        preview_every: int = 0,
        restart: bool = False,
    ) -> AsyncIterator[StepEvent | GenerationResult]:
        """Call with `handle.options(stream=True)`: a `StepEvent` per step, then the result.

        A replica lost mid-stream ends the stream with an error, unless `restart`: then the
        request runs again elsewhere and its steps count from 1 again."""
        async for event in self.core.stream(request, preview_every, restart):
            yield event

    async def models(self) -> ModelList:
        return await ops.models(self.core)

    async def status(self) -> StatusResponse:
        return await ops.status(self.core)

    async def abort(self, request_ids: list[str], owner: str | None = None) -> dict[str, str]:
        """Abort requests by id wherever they are: `aborted`, `finished` or `unknown` per id.
        With `owner`, only that caller's requests (another caller's are `unknown`).

        Aborted callers get an `Aborted` error (HTTP 499); a running request stops at the next
        denoising step, and the others in its pipeline call keep going.
        """
        return await requests.abort(self.core, request_ids, owner)

    async def request_status(self, request_id: str, owner: str | None = None) -> RequestState:
        """Where a request is; with `owner`, only that caller's."""
        return await requests.request_status(self.core, request_id, owner)

    async def start_profile(self, prefix: str = "trace") -> list[Outcome]:
        """Every live replica starts the torch profiler; per-replica outcomes."""
        return await admin.start_profile(self.core, prefix)

    async def stop_profile(self) -> list[Outcome]:
        """Every live replica stops its profiler and writes a trace; the reply lists the files."""
        return await self.core.fan_out("stop_profile")

    async def collective_rpc(
        self, method: str, args: list | None = None, kwargs: dict | None = None, timeout: float | None = None
    ) -> list[Outcome]:
        """Call `method` on every live replica's engine (only methods it exports)."""
        return await admin.collective_rpc(self.core, method, args, kwargs, timeout)

    async def add_lora(
        self, name: str, path: str, scale: float = 1.0, pinned: bool = False, model: str | None = None
    ) -> dict[str, Any]:
        """Register an adapter for `model` (default: the default model) after checking its file
        and loading it once on one of that model's replicas."""
        return await admin.add_lora(self.core, name, path, scale, pinned, model)

    async def remove_lora(self, name: str) -> dict[str, Any]:
        return await admin.remove_lora(self.core, name)

    async def push_lora(
        self, name: str, weights: dict[str, Any], scale: float = 1.0, model: str | None = None
    ) -> dict[str, Any]:
        """A trainer's adapter weights (a dict of tensors; a Ray ObjectRef to one is resolved by
        Ray) as the next version of adapter `name` on every replica of `model`. Results made with
        it carry its version (`policy_version`). Handle callers only: there is no HTTP route."""
        return await admin.push_lora(self.core, name, weights, scale, model)

    async def push_weights(
        self, weights: dict[str, Any], version: int, model: str | None = None
    ) -> dict[str, Any]:
        """A trainer's denoiser weights (a dict of tensors by the denoiser's own names, all or
        some) copied into every live replica of `model` between two of its calls, as `version`:
        results made with them say so (`weights_version`). Handle callers only."""
        return await admin.push_weights(self.core, weights, version, model)

    def note_weights(self, model: str, version: int) -> None:
        """`model` runs weights pushed as `version` now (every ingress replica hears it): the
        result cache keys on it."""
        self.core.results.weights[model] = version

    async def pin_lora(self, name: str, pinned: bool = True) -> dict[str, Any]:
        return await admin.pin_lora(self.core, name, pinned)

    async def list_loras(self) -> dict[str, Any]:
        return await admin.list_loras(self.core)

    async def add_checkpoint(
        self, name: str, source: str, pool: str | None = None, pinned: bool = False
    ) -> dict[str, Any]:
        """Register a checkpoint for a pool (`pool`: default the only one) after checking it and
        loading it once on one of the pool's replicas; requests then name it as `model`."""
        return await checkpoints.add_checkpoint(self.core, name, source, pool, pinned)

    async def remove_checkpoint(self, name: str) -> dict[str, Any]:
        return await checkpoints.remove_checkpoint(self.core, name)

    async def pin_checkpoint(self, name: str, pinned: bool = True) -> dict[str, Any]:
        return await checkpoints.pin_checkpoint(self.core, name, pinned)

    async def list_checkpoints(self) -> dict[str, Any]:
        return await checkpoints.list_checkpoints(self.core)


# The class stays importable under its own name, so Ray pickles it by reference and the
# replica imports this module as it is (not a by-value copy of the class).
DiffusionIngressDeployment = serve.deployment(
    serve.ingress(make_app())(DiffusionIngress), name="DiffusionIngress"
)
