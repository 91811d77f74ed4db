"""The diffusion replica: a Serve deployment (one Ray actor, one GPU) that owns one engine.

It wires parts with one job each: the `Scheduler` decides which queued requests share a
pipeline call and when; the engine thread runs the call (the only thread that runs torch);
`AdapterResidency` keeps the LoRA adapters this replica holds; the control plane
(`control.py`) answers profiling and RPC. What is left here is the request path (submit, run,
answer), health, and the Serve entry points.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from ray import serve

from serve_app import metrics
from serve_app.autoscaling import QUEUE_LENGTH_METRIC
from serve_app.config import BatchingConfig, LoraConfig, ModelConfig, ProfilingConfig, ReplicaConfig
from serve_app.engine import (
    CallParams,
    Engine,
    EngineOutput,
    LoraError,
    ModelLoadError,
    Row,
)
from serve_app.engine.engine import engine_class
from serve_app.engine.media import encode_output
from serve_app.errors import (
    EngineFailure,
    InvalidRequest,
    ServingError,
    Unavailable,
)
from serve_app.lora import Registry
from serve_app.replica.adapters import AdapterResidency
from serve_app.replica.control import Profiler, call_exported, outcome
from serve_app.replica.health import Health
from serve_app.replica.results import build_result, joined_output, row_hooks, step_hook
from serve_app.replica.routing import report_adapters
from serve_app.replica.scheduler import Job, Scheduler
from serve_app.schemas import (
    EMBEDS_FIELDS,
    GenerationResult,
    ModelDescription,
    Outcome,
    PreparedRequest,
    ReplicaStats,
    RequestState,
)

logger = logging.getLogger("ray.serve")


class DiffusionReplica:
    def __init__(
        self,
        model: ModelConfig | dict[str, Any],
        batching: BatchingConfig | dict[str, Any] | None = None,
        replica: ReplicaConfig | dict[str, Any] | None = None,
        lora: LoraConfig | dict[str, Any] | None = None,
        profiling: ProfilingConfig | dict[str, Any] | None = None,
        engine_factory: Callable[[ModelConfig], Engine] | None = None,
    ):
        # Typed settings pass through as they are (validated once, when the app was built).
        self.cfg = ModelConfig.model_validate(model)
        self.replica_cfg = ReplicaConfig.model_validate(replica or {})
        lora_cfg = LoraConfig.model_validate(lora or {})
        self._engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        # Loading and warm-up happen here: a replica takes traffic only once it can serve it,
        # and a model that cannot load fails the deployment with the engine's message.
        # They run on the engine thread, the only thread that ever runs torch: each thread
        # that enters an OpenMP region gets its own pool of spinning workers, and two pools on
        # the same cores made the CPU pipeline 1.8x slower (measured: 391 vs 218 ms).
        factory = engine_factory or engine_class(self.cfg.engine_extension)
        self.engine: Engine = self._start_engine(factory, self.replica_cfg.init_timeout_s)
        # Image encoding (zlib and numpy release the GIL) runs beside the engine, one task per
        # image: a 512x512 PNG costs 5-20 ms of CPU here (engine._png), and 8 of them one after
        # another would keep the last caller of a batch waiting for the other 7.
        self._cpu_pool = ThreadPoolExecutor(
            max_workers=max(2, min(8, os.cpu_count() or 2)), thread_name_prefix="encode"
        )
        self.scheduler = Scheduler(
            BatchingConfig.model_validate(batching or {}),
            on_retire=self._on_retire,
            max_adapters=lora_cfg.max_loaded,
        )
        self.adapters = AdapterResidency(
            self.engine,
            lora_cfg.max_loaded,
            on_change=report_adapters,
            max_bytes=None if lora_cfg.max_loaded_mb is None else int(lora_cfg.max_loaded_mb * 2**20),
        )
        self.profiler = Profiler(ProfilingConfig.model_validate(profiling or {}).trace_dir, self._on_engine)
        self.health = Health(
            self.replica_cfg.max_consecutive_failures, self.replica_cfg.engine_call_timeout_s
        )
        self._loop_task: asyncio.Task | None = None
        self._counts = collections.Counter()
        # Converge to the registry before taking traffic: a replica that starts late (autoscaling,
        # a replacement) holds the pinned adapters like the others, without anyone asking.
        for name, entry in Registry(lora_cfg.registry_path).all().items():
            if entry.get("pinned"):
                try:
                    self._engine_thread.submit(self.adapters.hold, name, entry["path"], True).result()
                except LoraError as e:  # a file gone or over the size budget: serve without it
                    logger.warning("pinned adapter %s not held: %s", name, e)

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
        job = self._submit(request)
        return await self._finish(job)

    async def generate_stream(self, request: PreparedRequest, preview_every: int = 0) -> AsyncIterator:
        """Yield a `StepEvent` after every denoising step, then the `GenerationResult`."""
        job = self._submit(request, preview_every)
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

    def _submit(self, request: PreparedRequest, preview_every: int = 0) -> Job:
        rid = request.request_id
        if self.health.fatal:
            raise self.health.lost(rid)
        try:
            extra = self.engine.check_extra(request.extra, request.task)
        except ValueError as e:
            raise InvalidRequest(str(e), param="extra", request_id=rid) from None
        if request.true_cfg_scale is not None:  # vLLM-Omni's field, for the pipelines that have it
            if not self.engine.takes("true_cfg_scale", request.task):
                raise InvalidRequest(
                    "true_cfg_scale: this model has no true classifier-free guidance; use guidance_scale",
                    param="true_cfg_scale",
                    request_id=rid,
                )
            extra["true_cfg_scale"] = request.true_cfg_scale
        try:
            r = request
            self.engine.check_options(r.generator_device, r.vae_use_slicing, r.vae_use_tiling, r.acceleration)
        except ValueError as e:  # the message starts with the field's name
            raise InvalidRequest(str(e), param=str(e).split(":")[0], request_id=rid) from None
        embeds = _embeds(request)
        try:
            for which in ("", "negative_"):
                if embeds[f"{which}prompt_embeds"] is not None:
                    self.engine.check_embeds(
                        embeds[f"{which}prompt_embeds"], embeds[f"{which}pooled_prompt_embeds"], which
                    )
        except ValueError as e:  # the message starts with the field's name
            raise InvalidRequest(str(e), param=str(e).split(":")[0], request_id=rid) from None
        image = request.image.to_pil() if request.image is not None else None
        mask = request.mask.to_pil() if request.mask is not None else None
        rows = [
            Row(prompt, request.negative_prompt, request.seed + k, **embeds, image=image, mask=mask)
            for prompt in request.prompts
            for k in range(request.num_images)
        ]
        params = CallParams(
            height=request.height,
            width=request.width,
            steps=request.num_inference_steps,
            guidance_scale=request.guidance_scale,
            extra=tuple(sorted(extra.items())),
            loras=tuple((r.name, r.scale) for r in request.loras),
            return_latents=request.return_latents,
            return_trajectory=request.return_trajectory,
            num_frames=request.num_frames,
            task=request.task,
            strength=request.strength,
            generator_device=request.generator_device,
            vae_slicing=request.vae_use_slicing,
            vae_tiling=request.vae_use_tiling,
            acceleration=request.acceleration,
        )
        # SDXL treats an absent negative prompt differently from an empty one: keep them apart.
        if request.loras:  # on the rows, not in the key: may share a call with other adapters
            adapters = tuple((r.name, r.scale) for r in request.loras)
            params = dataclasses.replace(params, loras=())
            rows = [dataclasses.replace(r, adapters=adapters) for r in rows]
        kinds = (request.negative_prompt is None, *(t is None for t in embeds.values()))
        key = (params, *kinds)
        # A joined call runs each request's own pipeline call: steps, guidance, strength and
        # the outputs asked for may differ between the requests that share its denoiser.
        own = dict(steps=0, guidance_scale=0.0, strength=None, return_latents=False, return_trajectory=False)
        join_key = (dataclasses.replace(params, **own), *kinds)
        job = Job(
            request_id=rid,
            rows=rows,
            key=key,
            steps=params.steps,
            future=asyncio.get_running_loop().create_future(),
            payload=(request, params),
            preview_every=preview_every,
            adapters=tuple(r.name for r in request.loras),
            join_key=join_key,
            owner=request.owner,
        )
        for ref in request.loras:  # read files the replica lacks while the engine runs its calls
            self.adapters.prefetch(ref.name, ref.path)
        self.scheduler.submit(job)
        self._ensure_loop()
        self._counts["accepted"] += 1
        metrics.set_queue_length(self.engine.model_name, self.queue_length())
        return job

    async def _finish(self, job: Job) -> GenerationResult:
        try:
            output: EngineOutput = await job.future
        except asyncio.CancelledError:
            # The caller went away (HTTP disconnect, DeploymentResponse.cancel()): same as abort.
            self.scheduler.abort_job(job, "cancelled by the caller")  # counted once, by _on_retire
            raise
        loop = asyncio.get_running_loop()
        t = time.perf_counter()
        request: PreparedRequest = job.payload[0]
        images = await asyncio.gather(
            *(
                loop.run_in_executor(self._cpu_pool, encode_output, im, request.output_format, request.fps)
                for im in output.images
            )
        )
        return build_result(job, output, images, (time.perf_counter() - t) * 1e3, self.engine.model_name)

    # ------------------------------------------------------------------ abort and status

    def abort(self, request_ids: list[str], owner: str | None = None) -> dict[str, str]:
        """Abort by id among `owner`'s requests (None: anyone's): `aborted`, `finished`
        (already done, nothing to do) or `unknown`."""
        return self.scheduler.abort(request_ids, owner)

    def _on_retire(self, job: Job, state: str) -> None:
        metrics.count_request(self.engine.model_name, state, len(job.rows))
        self._counts[state] += 1

    def request_status(self, request_id: str, owner: str | None = None) -> RequestState | None:
        """Where `owner`'s request with this id is (None: anyone's; a running one first)."""
        s = self.scheduler
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

    # ------------------------------------------------------------------ the engine loop

    def _ensure_loop(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._engine_loop())

    async def _engine_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self.scheduler.next_batch()
            if self._joins(batch):
                await self._run_joined(batch, loop)
                continue
            rows = [r for j in batch for r in j.rows]
            hook = step_hook(batch, loop)
            try:
                self.health.call_started = time.monotonic()
                out = await loop.run_in_executor(self._engine_thread, self._run_call, batch, rows, hook)
            except Exception as e:  # one call's failure; the loop goes on
                err = self.health.classify(e, batch[0].request_id, len(rows), batch[0].payload[1])
                for job in batch:
                    if job.state == "running":
                        self.scheduler.fail(job, err)
                if self.health.fatal:
                    self._leave(loop)
                elif self.health.needs_self_test:
                    await loop.run_in_executor(self._engine_thread, self.health.self_test, self.engine)
            else:
                self.health.consecutive_failures = 0
                self._deliver(batch, out)
            finally:
                self.health.call_started = None
                self.scheduler.call_ended(batch)
                metrics.set_queue_length(self.engine.model_name, self.queue_length())

    def _hold_adapters(self, batch: list[Job]) -> None:
        """On the engine thread: load the adapters of the call's requests this replica lacks.
        The scheduler puts at most max_loaded in a call, and none of them is evicted to make
        room for another."""
        refs = [ref for job in batch for ref in job.payload[0].loras]
        names = {ref.name for ref in refs}
        for ref in refs:
            self.adapters.hold(ref.name, ref.path, keep=names)

    def _run_call(self, batch: list[Job], rows: list[Row], hook) -> EngineOutput:
        """On the engine thread: load the call's adapters if this replica lacks them, then run
        the rows in pipeline calls of at most `max_batch_images` (one call unless one job is
        larger)."""
        request, params = batch[0].payload
        self._hold_adapters(batch)
        size = self.batching.max_batch_images
        chunks = [rows[k : k + size] for k in range(0, len(rows), size)]
        parts = []
        for k, chunk in enumerate(chunks):
            offset = k * params.steps  # progress counts on across the calls of one request
            part = self.engine.run(chunk, params, lambda i, n, x, o=offset: hook(o + i, n * len(chunks), x))
            metrics.observe_batch(self.engine.model_name, len(chunk))
            parts.append(part)
            if part.interrupted:
                break
        out = EngineOutput.concat(parts)
        out.batch_images = max(len(c) for c in chunks)
        out.pipeline_calls = len(parts)
        return out

    # ------------------------------------------------------------------ step-level joining

    def _joins(self, batch: list[Job]) -> bool:
        """Whether `batch` runs joined: the setting is on, the engine can join its calls, and
        its rows fit one call and share one adapter set (joiners must have the same)."""
        rows = [r for j in batch for r in j.rows]
        return (
            self.batching.step_joining
            and len(rows) <= self.batching.max_batch_images
            and all(r.adapters == rows[0].adapters for r in rows)
            and self.engine.can_join(batch[0].payload[1])
        )

    async def _run_joined(self, batch: list[Job], loop: asyncio.AbstractEventLoop) -> None:
        """Run `batch` as a joined call: between two denoising steps, queued requests of the
        same kind join it (up to `max_batch_images` rows), and each request is answered as soon
        as its own rows are done."""
        params, adapters = batch[0].payload[1], batch[0].rows[0].adapters
        members: dict[int, _Member] = {}  # by id(job): request ids are unique per owner only
        joining, run = batch, None
        self.health.call_started = time.monotonic()
        on_engine = functools.partial(loop.run_in_executor, self._engine_thread)
        # What requests still running at the end get: they lost their call (the loop stopped,
        # a fatal error) and their rows ended unfinished, or the call failed as a whole.
        lost: ServingError = EngineFailure("engine error: the call stopped before this request was done")
        try:
            run = await on_engine(self._open_joined, batch, params, adapters)
            while True:
                await on_engine(self._joined_step, run, batch, joining, members, loop)
                joining = []
                self.health.call_started = time.monotonic()
                self._settle(members, params)
                if not run.active or self.health.fatal:
                    break
                room = self.batching.max_batch_images - run.active
                joining = self.scheduler.take_joiners(
                    batch[0].join_key, room, lambda j: all(r.adapters == adapters for r in j.rows)
                )
        except Exception as e:  # the run could not start or go on (an adapter failed to load)
            lost = self.health.classify(e, batch[0].request_id, len(batch[0].rows), params)
        finally:
            if run is not None:
                await on_engine(run.close)
            for job in [*batch, *joining, *(m.job for m in members.values())]:
                if job.state == "running":
                    self.scheduler.fail(job, lost)
            self.health.call_started = None
            self.scheduler.call_ended(batch)
            metrics.set_queue_length(self.engine.model_name, self.queue_length())
        if self.health.fatal:
            self._leave(loop)
        elif self.health.needs_self_test:
            await loop.run_in_executor(self._engine_thread, self.health.self_test, self.engine)

    def _open_joined(self, batch: list[Job], params: CallParams, adapters):
        self._hold_adapters(batch)
        return self.engine.open_joined(params, tuple(sorted((n, s) for n, s in adapters if s != 0)))

    def _joined_step(self, run, batch: list[Job], joining: list[Job], members: dict, loop) -> None:
        """On the engine thread: add the joining requests' rows, then run one step of all. The
        run's adapters are held again first: an admin call between two steps may have evicted
        or switched them (the run puts its own set back in force at every step)."""
        self._hold_adapters(batch)
        for job in joining:
            m = members[id(job)] = _Member(job)
            hooks = row_hooks(job, loop)
            m.seats = [run.add(row, hook, job.payload[1]) for row, hook in zip(job.rows, hooks, strict=True)]
        metrics.observe_batch(self.engine.model_name, run.active)
        for m in members.values():
            m.images = max(m.images, run.active)
            m.requests = max(m.requests, len(members))
        run.step()

    def _settle(self, members: dict[str, _Member], params: CallParams) -> None:
        """Answer each request of a joined call whose rows have all ended. One failed denoiser
        call fails every request in it with one error, counted once."""
        errors: dict[int, ServingError] = {}
        for key, m in list(members.items()):
            if not all(seat.done for seat in m.seats):
                continue
            del members[key]
            job = m.job
            self.scheduler.left(job)
            if job.state != "running":  # aborted during the call: its images are dropped
                continue
            error = next((seat.error for seat in m.seats if seat.error is not None), None)
            if error is not None:
                if id(error) not in errors:
                    errors[id(error)] = self.health.classify(error, job.request_id, len(job.rows), params)
                self.scheduler.fail(job, errors[id(error)])
                continue
            self.health.consecutive_failures = 0
            out = joined_output([seat.output for seat in m.seats])
            out.batch_images, out.batch_requests = m.images, m.requests
            self.scheduler.retire(job, "done")
            if not job.future.done():
                job.future.set_result(out)

    def _deliver(self, batch: list[Job], out: EngineOutput) -> None:
        start = 0
        for job in batch:
            part = out.slice(start, start + len(job.rows))
            start += len(job.rows)
            part.batch_requests = len(batch)
            if job.state != "running":  # aborted during the call: its images are dropped
                continue
            self.scheduler.retire(job, "done")
            if not job.future.done():
                job.future.set_result(part)

    def _leave(self, loop: asyncio.AbstractEventLoop) -> None:
        """After a fatal device error: hand every queued request back (the ingress sends them to
        another replica) and end this actor, so that Serve replaces it now."""
        for job in list(self.scheduler.queue):
            self.scheduler.fail(job, self.health.lost())
        if _replica_id() != "local":  # inside Serve; a replica driven by tests stays alive
            loop.call_later(0.1, _exit_actor)  # once the answers above are on their way

    # ------------------------------------------------------------------ LoRA adapters

    async def _on_engine(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._engine_thread, fn, *args)

    async def validate_lora(self, path: str) -> None:
        """Load a candidate adapter under a scratch name and drop it again; LoraError -> 400."""
        try:
            await self._on_engine(self.adapters.check, path)
        except LoraError as e:
            raise InvalidRequest(f"path: {e}", param="path") from None

    async def pin_lora(self, name: str, path: str, pinned: bool) -> list[str]:
        if pinned:
            try:
                await self._on_engine(self.adapters.hold, name, path, True)
            except LoraError as e:
                raise InvalidRequest(f"pin: {e}", param="name") from None
        else:
            self.adapters.unpin(name)
        return self.adapters.loaded

    async def evict_lora(self, name: str) -> bool:
        return await self._on_engine(self.adapters.drop, name)

    def loaded_loras(self) -> dict[str, Any]:
        return {"replica_id": _replica_id(), "loaded": self.adapters.loaded, "pinned": self.adapters.pinned}

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
        )

    def queue_length(self) -> int:
        """Queued plus running images: the load figure for routing and autoscaling."""
        return self.scheduler.queue_length()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve calls this every `metrics_interval_s`; serve_app.autoscaling reads it."""
        n = self.queue_length()
        metrics.set_queue_length(self.engine.model_name, n)
        return {QUEUE_LENGTH_METRIC: float(n)}

    def ready(self) -> bool:
        """Loaded, warmed up (the constructor did both) and healthy: the ingress's readiness."""
        return self.health.problem(self._loop_task) is None

    async def check_health(self) -> None:
        """Raise when the engine is broken beyond one request, so that Serve replaces us."""
        problem = self.health.problem(self._loop_task)
        if problem:
            raise Unavailable(problem)
        self._counts["health_checks_passed"] += 1

    def __del__(self):
        for pool in (getattr(self, "_engine_thread", None), getattr(self, "_cpu_pool", None)):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        if getattr(self, "adapters", None) is not None:
            self.adapters.close()


@dataclasses.dataclass(eq=False)
class _Member:
    """A request in a joined call: its rows' seats and the most rows and requests it ran with."""

    job: Job
    seats: list = dataclasses.field(default_factory=list)
    images: int = 0
    requests: int = 0


def _node_id() -> str | None:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a Serve replica (tests that drive the replica directly)
        return "local"


def _embeds(request: PreparedRequest) -> dict[str, torch.Tensor | None]:
    """Prompt embeddings of a handle caller by field: (1, tokens, hidden) and pooled (1, width)."""
    out = {}
    for name in EMBEDS_FIELDS:
        payload = getattr(request, name)
        t = payload.to_torch() if payload is not None else None
        unbatched = 1 if "pooled" in name else 2
        out[name] = t.unsqueeze(0) if t is not None and t.dim() == unbatched else t
    return out


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _exit_actor() -> None:
    """End this replica's actor; Serve starts a replacement at its next health check."""
    import ray

    ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


DiffusionReplicaDeployment = serve.deployment(DiffusionReplica, name="DiffusionReplica")
