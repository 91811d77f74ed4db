"""The diffusion replica: a Serve deployment (one Ray actor, one GPU) that owns one engine.

It wires parts with one job each: `intake.py` turns a request into a queued job; the
`Scheduler` decides which queued requests share a pipeline call and when; the `EngineLoop`
(`loop.py`) runs the calls on the engine thread (the only thread that runs torch) and answers
them; `AdapterResidency` keeps the LoRA adapters this replica holds; the control plane
(`control.py`) answers profiling and RPC. What is left here are the Serve entry points: the
methods Serve and the ingress call by name.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ray import serve

from serve_app import metrics
from serve_app.autoscaling import QUEUE_LENGTH_METRIC
from serve_app.config import (
    BatchingConfig,
    CheckpointsConfig,
    LoraConfig,
    ModelConfig,
    MultiplexSettings,
    ProfilingConfig,
    ReplicaConfig,
)
from serve_app.config.optimizations import warm_batches
from serve_app.engine import Engine, EngineOutput, LoraError, ModelLoadError
from serve_app.engine.engine import engine_class
from serve_app.engine.media import encode_output
from serve_app.errors import Unavailable
from serve_app.registries import Registry
from serve_app.replica.adapters import AdapterControl, AdapterResidency
from serve_app.replica.control import Profiler, call_exported, outcome
from serve_app.replica.health import Health
from serve_app.replica.intake import new_job, work
from serve_app.replica.loop import EngineLoop
from serve_app.replica.parallel import RankedEngine, ranked_factory
from serve_app.replica.pool import CheckpointServing
from serve_app.replica.results import build_result, check_flagged
from serve_app.replica.routing import replica_id as _replica_id
from serve_app.replica.scheduler import Job, Scheduler
from serve_app.schemas import (
    GenerationResult,
    ModelDescription,
    Outcome,
    PreparedRequest,
    ReplicaStats,
    RequestState,
)

logger = logging.getLogger("ray.serve")


class DiffusionReplica(AdapterControl, CheckpointServing):
    def __init__(
        self,
        model: ModelConfig | dict[str, Any],
        batching: BatchingConfig | dict[str, Any] | None = None,
        replica: ReplicaConfig | dict[str, Any] | None = None,
        lora: LoraConfig | dict[str, Any] | None = None,
        profiling: ProfilingConfig | dict[str, Any] | None = None,
        engine_factory: Callable[[ModelConfig], Engine] | None = None,
        multiplex: MultiplexSettings | dict[str, Any] | None = None,
        checkpoints: CheckpointsConfig | dict[str, Any] | None = None,
        default_model: str | None = None,
    ):
        # Typed settings pass through as they are (validated once, when the app was built).
        self.cfg = warm_batches(ModelConfig.model_validate(model), batching)
        self.replica_cfg = ReplicaConfig.model_validate(replica or {})
        lora_cfg = LoraConfig.model_validate(lora or {})
        self._engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        # Loading and warm-up happen here: a replica takes traffic only once it can serve it,
        # and a model that cannot load fails the deployment with the engine's message.
        # They run on the engine thread, the only thread that ever runs torch: each thread
        # that enters an OpenMP region gets its own pool of spinning workers, and two pools on
        # the same cores made the CPU pipeline 1.8x slower (measured: 391 vs 218 ms).
        factory = engine_factory or engine_class(self.cfg.engine_extension)
        build = ranked_factory(factory, self.replica_cfg) if self.cfg.parallel.world > 1 else factory
        self.engine: Engine = self._start_engine(build, self.replica_cfg.init_timeout_s)
        # Image encoding (zlib and numpy release the GIL) runs beside the engine, one task per
        # image: a 512x512 PNG costs 5-20 ms of CPU here (engine._png), and 8 of them one after
        # another would keep the last caller of a batch waiting for the other 7.
        self._cpu_pool = ThreadPoolExecutor(
            max_workers=max(2, min(8, os.cpu_count() or 2)), thread_name_prefix="encode"
        )
        self._init_routing()
        mux = MultiplexSettings.model_validate(multiplex) if multiplex is not None else None
        self._init_pool(factory, mux, CheckpointsConfig.model_validate(checkpoints or {}))
        self.scheduler = Scheduler(
            BatchingConfig.model_validate(batching or {}),
            on_retire=self._on_retire,
            max_adapters=lora_cfg.max_loaded,
        )
        self.adapters = AdapterResidency(
            self.engine,
            lora_cfg.max_loaded,
            on_change=self._adapters_changed,
            max_bytes=None if lora_cfg.max_loaded_mb is None else int(lora_cfg.max_loaded_mb * 2**20),
        )
        self.profiler = Profiler(ProfilingConfig.model_validate(profiling or {}).trace_dir, self._on_engine)
        self.health = Health(
            self.replica_cfg.max_consecutive_failures, self.replica_cfg.engine_call_timeout_s
        )
        self.engine_loop = EngineLoop(
            self.engine, self.scheduler, self.adapters, self.health, self._engine_thread, _leave
        )
        self._loop_task: asyncio.Task | None = None
        self._counts = collections.Counter()
        # Converge to the registry before taking traffic: a replica that starts late (autoscaling,
        # a replacement) holds the pinned adapters like the others, without anyone asking.
        for name, entry in Registry(lora_cfg.registry_path).all().items():
            # An entry that names no model (registered before there were several) is the default's.
            owner = entry.get("model") or default_model or self.cfg.served_name
            if entry.get("pinned") and owner == self.cfg.served_name:
                try:
                    self._engine_thread.submit(self.adapters.hold, name, entry["path"], True).result()
                except LoraError as e:  # a file gone or over the size budget: serve without it
                    logger.warning("pinned adapter %s not held: %s", name, e)
        self._start_pinning()

    def _start_engine(self, factory, timeout_s: float) -> Engine:
        """Build (load and warm up) the engine on the engine thread, within `timeout_s`."""
        t = time.monotonic()
        future = self._engine_thread.submit(factory, self.cfg)
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise ModelLoadError(
                f"model {self.cfg.source!r}: load and warm-up did not finish within "
                f"replica.init_timeout_s={timeout_s:g}s (gave up after {time.monotonic() - t:.1f}s)"
            ) from None

    @property
    def batching(self) -> BatchingConfig:
        return self.scheduler.batching

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve `user_config`: batching settings change at run time, without a restart."""
        self.scheduler.batching = BatchingConfig.model_validate(
            {**self.batching.model_dump(), **(user_config or {})}
        )
        logger.info("batching settings now %s", self.batching.model_dump())

    # ------------------------------------------------------------------ requests

    async def generate(self, request: PreparedRequest) -> GenerationResult:
        """Run one request (one or several prompts) and return its merged result."""
        job = self._submit(request, 0, await self._engine_for(request))
        return await self._finish(job)

    async def generate_stream(self, request: PreparedRequest, preview_every: int = 0) -> AsyncIterator:
        """Yield a `StepEvent` after every denoising step, then the `GenerationResult`."""
        job = self._submit(request, preview_every, await self._engine_for(request))
        events: asyncio.Queue = asyncio.Queue()
        job.listeners.append(events)
        result_task = asyncio.ensure_future(self._finish(job))
        try:
            while True:
                getter = asyncio.ensure_future(events.get())
                done, _ = await asyncio.wait({getter, result_task}, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    yield getter.result()
                    continue
                getter.cancel()
                while not events.empty():
                    yield events.get_nowait()
                yield result_task.result()
                return
        finally:
            if not result_task.done():
                result_task.cancel()

    def _submit(self, request: PreparedRequest, preview_every: int, engine: Engine) -> Job:
        """Queue `request` once its engine (this replica's, or its checkpoint's) takes it, and
        start the engine loop if need be."""
        if self.health.fatal:
            raise self.health.lost(request.request_id)
        job = new_job(engine, request, asyncio.get_running_loop().create_future(), preview_every)
        for ref in request.loras:  # read files the replica lacks while the engine runs its calls
            self.adapters.prefetch(ref.loaded_name, ref.path)
        self.scheduler.submit(job)
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self.engine_loop.run())
        self._counts["accepted"] += 1
        metrics.set_queue_length(self.engine.model_name, self.queue_length())
        self._tenant_load(job.tenant)
        return job

    def _tenant_load(self, tenant: str) -> None:
        s = self.scheduler
        queued = sum(1 for j in s.queue if j.tenant == tenant)
        metrics.tenant_load(
            self.engine.model_name, tenant, queued, sum(1 for j in s.running if j.tenant == tenant)
        )

    async def _finish(self, job: Job) -> GenerationResult:
        try:
            output: EngineOutput = await job.future
        except asyncio.CancelledError:
            # The caller went away (HTTP disconnect, DeploymentResponse.cancel()): same as abort.
            self.scheduler.abort_job(job, "cancelled by the caller")  # counted once, by _on_retire
            raise
        loop = asyncio.get_running_loop()
        t = time.perf_counter()
        request = work(job).request
        check_flagged(job, output, self.engine.model_name)
        fmt = (request.output_format, request.fps, request.output_compression)
        steps = [im for step in output.trajectory_decoded or [] for im in step]  # decoded steps: PNG
        fmts = [fmt] * len(output.images) + [("png", None, None)] * len(steps)
        pairs = zip([*output.images, *steps], fmts, strict=True)
        images = await asyncio.gather(
            *(loop.run_in_executor(self._cpu_pool, encode_output, im, *f) for im, f in pairs)
        )
        name = request.checkpoint or self.engine.model_name
        return build_result(job, output, images, (time.perf_counter() - t) * 1e3, name)

    # ------------------------------------------------------------------ abort and status

    def abort(self, request_ids: list[str], owner: str | None = None) -> dict[str, str]:
        """Abort by id among `owner`'s requests (None: anyone's): `aborted`, `finished`
        (already done, nothing to do) or `unknown`."""
        return _either(self._abort_pending(request_ids, owner), self.scheduler.abort(request_ids, owner))

    def _on_retire(self, job: Job, state: str) -> None:
        metrics.count_request(self.engine.model_name, state, len(job.rows))
        if state == "done" and job.started is not None:
            waited_ms = (job.started - job.enqueued) * 1e3
            metrics.tenant_done(self.engine.model_name, job.tenant, len(job.rows), waited_ms)
            metrics.priority_waited(self.engine.model_name, job.priority, waited_ms)
        self._tenant_load(job.tenant)
        self._counts[state] += 1

    def request_status(self, request_id: str, owner: str | None = None) -> RequestState | None:
        """Where `owner`'s request with this id is (None: anyone's; a running one first)."""
        s = self.scheduler
        if self._pending_state(request_id, owner):  # waiting for its checkpoint to load
            return RequestState(request_id=request_id, state="queued", replica_id=_replica_id())
        jobs, finished = s.find(request_id, owner)
        if jobs:
            job = min(jobs, key=lambda j: j.state != "running")
            position = (
                next((i for i, j in enumerate(s.queue) if j is job), None) if job.state == "queued" else None
            )
            return RequestState(
                request_id=request_id,
                state=job.state,
                queue_position=position,
                step=job.step,
                total_steps=job.total_steps or job.steps,
                images=len(job.rows),
                replica_id=_replica_id(),
            )
        if finished:
            done = finished[-1]
            return RequestState(
                request_id=request_id,
                state=done.state,
                step=done.step,
                total_steps=done.total_steps,
                error=done.error,
                replica_id=_replica_id(),
            )
        return None

    # ------------------------------------------------------------------ LoRA adapters

    async def _on_engine(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._engine_thread, fn, *args)

    # ------------------------------------------------------------------ profiling and collective RPC

    async def start_profile(self, prefix: str) -> Outcome:
        """Start the torch profiler on the engine thread; a second start is an error."""
        return await outcome(_replica_id(), self.profiler.start(prefix))

    async def stop_profile(self) -> Outcome:
        """Stop the profiler and write its Chrome trace; stopping without a start is an error."""
        return await outcome(_replica_id(), self.profiler.stop(_replica_id()))

    async def collective_rpc(self, method: str, args: list, kwargs: dict) -> Outcome:
        """Call an exported engine (or extension) method on the engine thread, on this replica."""
        return await outcome(_replica_id(), call_exported(self.engine, self._on_engine, method, args, kwargs))

    # ------------------------------------------------------------------ control and health

    def describe(self) -> ModelDescription:
        return ModelDescription.model_validate(self.engine.describe())

    def stats(self) -> ReplicaStats:
        s = self.scheduler
        problem = self.health.problem(self._loop_task)
        counts = dict(self._counts)
        counts.update(
            lora_loads=self.adapters.loads,
            lora_evictions=self.adapters.evictions,
            lora_prefetched=self.adapters.prefetched,
            self_tests_passed=self.health.self_tests_passed,
            argument_failures=self.health.argument_failures,
            preemptions=s.preemptions,
        )
        return ReplicaStats(
            replica_id=_replica_id(),
            node_id=_node_id(),
            queued_requests=len(s.queue),
            queued_images=sum(len(j.rows) for j in s.queue),
            running_requests=len(s.running),
            running_images=sum(len(j.rows) for j in s.running),
            healthy=problem is None,
            health_problem=problem,
            rss_mb=round(_rss_mb(), 1),
            batching=self.batching.model_dump(),
            loras_loaded=self.adapters.loaded,
            loras_loaded_mb=round(self.adapters.loaded_bytes / 2**20, 3),
            engine_failures_in_a_row=self.health.consecutive_failures,
            counts=counts,
            model=self.engine.model_name,
            tenants=s.tenants(),
            checkpoints_held=self.checkpoints.held if self.checkpoints is not None else [],
            **_engine_parts(self.engine),
        )

    def queue_length(self) -> int:
        """Queued plus running images: the load figure for routing and autoscaling."""
        return self.scheduler.queue_length()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve calls this every `metrics_interval_s`; serve_app.autoscaling reads it."""
        for tenant in {j.tenant for j in (*self.scheduler.queue, *self.scheduler.running)}:
            self._tenant_load(tenant)  # running ones too: started since their last change
        n = self.queue_length()
        metrics.set_queue_length(self.engine.model_name, n)
        return {QUEUE_LENGTH_METRIC: float(n)}

    def ready(self) -> bool:
        """Loaded, warmed up (the constructor did both) and healthy: the ingress's readiness."""
        return self.health.problem(self._loop_task) is None

    async def check_health(self) -> None:
        """Raise when the engine is broken beyond one request, so that Serve replaces us."""
        problem = self.health.problem(self._loop_task)
        if problem is None and isinstance(self.engine, RankedEngine):
            problem = await self.engine.check(self.replica_cfg.health_check_timeout_s / 2)
        if problem:
            raise Unavailable(problem)
        self._counts["health_checks_passed"] += 1

    def __del__(self):
        for pool in (getattr(self, "_engine_thread", None), getattr(self, "_cpu_pool", None)):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        if getattr(self, "adapters", None) is not None:
            self.adapters.close()


def _node_id() -> str | None:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _leave(loop: asyncio.AbstractEventLoop) -> None:
    """After a fatal device error: end this actor, so that Serve replaces it now."""
    if _replica_id() != "local":  # inside Serve; a replica driven by tests stays alive
        loop.call_later(0.1, _exit_actor)  # once the answers to its requests are on their way


def _exit_actor() -> None:
    """End this replica's actor; Serve starts a replacement at its next health check."""
    import ray

    ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


DiffusionReplicaDeployment = serve.deployment(DiffusionReplica, name="DiffusionReplica")


def _either(*answers: dict[str, str]) -> dict[str, str]:
    """Each id's abort outcome from wherever it was found (a request waiting for its
    checkpoint is `aborted` there and `unknown` to the scheduler)."""
    rank = {"aborted": 2, "finished": 1}
    ids = {rid for answer in answers for rid in answer}
    return {rid: max((a.get(rid, "unknown") for a in answers), key=lambda s: rank.get(s, 0)) for rid in ids}


def _engine_parts(engine) -> dict[str, Any]:
    """What a replica's stats say of its engine's ranks (`model.parallel`) and fast path."""
    fast = getattr(engine, "fast", None)
    return {
        "ranks": engine.rank_status() if isinstance(engine, RankedEngine) else [],
        "fast_path": fast.status() if fast is not None else None,
    }
