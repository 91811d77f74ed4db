"""The diffusion replica: a Serve deployment (one Ray actor, one GPU) that owns one engine.

Requests wait in a queue. One loop takes the oldest, gathers the queued requests that can
share its pipeline call (same size, steps, guidance, extra arguments, outputs), and runs them
as one batch on the engine thread, so the event loop never blocks on the pipeline. Each
request's rows keep their own seeds, so batching never changes an image. Image encoding runs
on a separate pool in the awaiting request's coroutine, overlapping the next pipeline call.

A request leaves the queue when it is aborted or its caller goes away; a running request that
is aborted gets its answer at once, and the pipeline call stops at the next step when no
request in it still wants its images.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import os
import re
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from ray import serve

from serve_app import metrics
from serve_app.autoscaling import QUEUE_LENGTH_METRIC
from serve_app.config import BatchingConfig, LoraConfig, ModelConfig, ProfilingConfig, ReplicaConfig
from serve_app.engine import (
    CallParams,
    EngineOutput,
    InvalidArguments,
    LoraError,
    ModelLoadError,
    Row,
    encode_image,
    rpc_methods,
)
from serve_app.engine.engine import engine_class, latents_preview
from serve_app.errors import (
    Aborted,
    EngineFailure,
    InvalidRequest,
    OutOfMemory,
    ReplicaLost,
    ServingError,
    Unavailable,
)
from serve_app.lora import Registry
from serve_app.schemas import (
    BatchGenerationRequest,
    GenerationResult,
    RequestState,
    StageMetrics,
    StepEvent,
    TensorPayload,
    Trajectory,
)

logger = logging.getLogger("ray.serve")

_FINISHED_KEPT = 2048  # finished request states remembered for GET /v1/requests/{id}


@dataclass(eq=False)
class _Job:
    request: BatchGenerationRequest
    rows: list[Row]
    params: CallParams
    future: asyncio.Future
    preview_every: int = 0
    enqueued: float = field(default_factory=time.perf_counter)
    started: float | None = None
    state: str = "queued"
    step: int = 0
    total_steps: int = 0  # steps of all its pipeline calls, once it runs
    listeners: list[asyncio.Queue] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.request.request_id or "unnamed"

    @property
    def batch_key(self) -> tuple:
        # SDXL treats an absent negative prompt differently from an empty one: keep them apart.
        embeds = getattr(self.request, "prompt_embeds", None)
        negative = getattr(self.request, "negative_prompt_embeds", None)
        return (self.params, self.request.negative_prompt is None, embeds is None, negative is None)


@dataclass(frozen=True)
class _LastCall:
    key: tuple  # the batch key it ran
    ended: float
    callers: int  # its images plus the images of its kind queued when it ended


class DiffusionReplica:
    def __init__(
        self,
        model: ModelConfig | dict[str, Any],
        batching: BatchingConfig | dict[str, Any] | None = None,
        replica: ReplicaConfig | dict[str, Any] | None = None,
        lora: LoraConfig | dict[str, Any] | None = None,
        profiling: ProfilingConfig | dict[str, Any] | None = None,
    ):
        # Typed settings pass through as they are (validated once, when the app was built).
        self.cfg = ModelConfig.model_validate(model)
        self.lora_cfg = LoraConfig.model_validate(lora or {})
        self.batching = BatchingConfig.model_validate(batching or {})
        self.replica_cfg = ReplicaConfig.model_validate(replica or {})
        self._engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        # Loading and warm-up happen here: a replica takes traffic only once it can serve it,
        # and a model that cannot load fails the deployment with the engine's message.
        # They run on the engine thread, the only thread that ever runs torch: each thread
        # that enters an OpenMP region gets its own pool of spinning workers, and two pools on
        # the same cores made the CPU pipeline 1.8x slower (measured: 391 vs 218 ms).
        self.engine = self._start_engine(self.replica_cfg.init_timeout_s)
        # Image encoding (zlib and numpy release the GIL) runs beside the engine, one task per
        # image: a 512x512 PNG costs 5-20 ms of CPU here (engine._png), and 8 of them one after
        # another would keep the last caller of a batch waiting for the other 7.
        self._cpu_pool = ThreadPoolExecutor(
            max_workers=max(2, min(8, os.cpu_count() or 2)), thread_name_prefix="encode"
        )
        # LoRA adapters held by this replica, least recently used first; pinned ones never leave.
        self._loras: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._pinned: set[str] = set()
        self._queue: collections.deque[_Job] = collections.deque()
        self._jobs: dict[str, _Job] = {}  # queued and running, by request id
        self._finished: collections.OrderedDict[str, dict] = collections.OrderedDict()
        self._running: list[_Job] = []
        self._last_call: _LastCall | None = None  # see _fill_deadline
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._max_failures = self.replica_cfg.max_consecutive_failures
        self._consecutive_failures = 0
        self._counts = collections.Counter()
        self._trace_dir = ProfilingConfig.model_validate(profiling or {}).trace_dir
        self._profiler = None
        self._profile_prefix = ""
        self._call_timeout_s = self.replica_cfg.engine_call_timeout_s
        self._call_started: float | None = None
        self._fatal: str | None = None  # a device error: this replica is leaving
        self._broken: str | None = None  # failures in a row and a failed self-test
        # Converge to the registry before taking traffic: a replica that starts late (autoscaling,
        # a replacement) holds the pinned adapters like the others, without anyone asking.
        for name, entry in Registry(self.lora_cfg.registry_path).all().items():
            if entry.get("pinned"):
                self._engine_thread.submit(self._hold_lora, name, entry["path"], True).result()

    def _start_engine(self, timeout_s: float):
        """Build (load and warm up) the engine on the engine thread, within `timeout_s`."""
        t = time.monotonic()
        future = self._engine_thread.submit(engine_class(self.cfg.engine_extension), self.cfg)
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise ModelLoadError(
                f"model {self.cfg.source!r}: load and warm-up did not finish within "
                f"replica.init_timeout_s={timeout_s:g}s (gave up after {time.monotonic() - t:.1f}s)"
            ) from None

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve `user_config`: batching settings change at run time, without a restart."""
        self.batching = BatchingConfig.model_validate({**self.batching.model_dump(), **(user_config or {})})
        logger.info("batching settings now %s", self.batching.model_dump())

    # ------------------------------------------------------------------ requests

    async def generate(self, request: BatchGenerationRequest) -> GenerationResult:
        """Run one request (one or several prompts) and return its merged result."""
        job = self._submit(request)
        return await self._finish(job)

    async def generate_stream(self, request: BatchGenerationRequest, preview_every: int = 0) -> AsyncIterator:
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

    def _submit(self, request: BatchGenerationRequest, preview_every: int = 0) -> _Job:
        rid = request.request_id or "unnamed"
        if self._fatal:
            raise ReplicaLost(f"replica is restarting after a device error: {self._fatal}", request_id=rid)
        try:
            extra = self.engine.check_extra(request.extra)
        except ValueError as e:
            raise InvalidRequest(str(e), param="extra", request_id=rid) from None
        request = request.model_copy(update={"extra": extra})
        if rid in self._jobs:
            raise InvalidRequest(f"request_id: {rid!r} is already queued or running", param="request_id")
        embeds = _embeds(request)
        for t in embeds:
            if t is not None:
                try:
                    self.engine.check_embeds(t)
                except ValueError as e:
                    raise InvalidRequest(str(e), param="prompt_embeds", request_id=rid) from None
        job = self._make_job(request, preview_every, *embeds)
        self._ensure_loop()
        self._queue.append(job)
        self._jobs[rid] = job
        self._counts["accepted"] += 1
        metrics.set_queue_length(self.engine.model_name, self.queue_length())
        self._wakeup.set()
        return job

    async def _finish(self, job: _Job) -> GenerationResult:
        try:
            output: EngineOutput = await job.future
        except asyncio.CancelledError:
            # The caller went away (HTTP disconnect, DeploymentResponse.cancel()): same as abort.
            self._abort_job(job, "cancelled by the caller")
            raise
        loop = asyncio.get_running_loop()
        t = time.perf_counter()
        fmt = job.request.output_format
        images = await asyncio.gather(
            *(loop.run_in_executor(self._cpu_pool, encode_image, im, fmt) for im in output.images)
        )
        return self._result(job, output, images, (time.perf_counter() - t) * 1e3)

    def _make_job(
        self, request: BatchGenerationRequest, preview_every: int, embeds=None, negative=None
    ) -> _Job:
        seed = request.seed if request.seed is not None else 0
        n = request.num_images
        rows = [
            Row(prompt, request.negative_prompt, seed + k, embeds, negative)
            for prompt in request.prompts
            for k in range(n)
        ]
        params = CallParams(
            height=request.height or self.engine.default_height,
            width=request.width or self.engine.default_width,
            steps=request.num_inference_steps or self.cfg.default_steps,
            guidance_scale=(
                request.guidance_scale
                if request.guidance_scale is not None
                else self.cfg.default_guidance_scale
            ),
            extra=tuple(sorted(request.extra.items())),
            lora=_lora_key(request),
            return_latents=request.return_latents,
            return_trajectory=request.return_trajectory,
        )
        return _Job(request, rows, params, asyncio.get_running_loop().create_future(), preview_every)

    def _result(
        self, job: _Job, out: EngineOutput, images: list[bytes], encode_ms: float
    ) -> GenerationResult:
        req = job.request
        t = out.timings_ms
        stage = StageMetrics(
            queue_ms=(job.started - job.enqueued) * 1e3,
            text_encode_ms=t["text_encode_ms"],
            denoise_ms=t["denoise_ms"],
            vae_decode_ms=t["vae_decode_ms"],
            image_encode_ms=encode_ms,
            total_ms=(time.perf_counter() - job.enqueued) * 1e3,
            batch_images=t["batch_images"],
            batch_requests=t["batch_requests"],
            pipeline_calls=t["pipeline_calls"],
            steps=out.steps_run,
        )
        trajectory = None
        if out.trajectory_latents is not None:
            trajectory = Trajectory(
                timesteps=out.trajectory_timesteps,
                latents=[TensorPayload.from_tensor(x) for x in out.trajectory_latents],
            )
        metrics.observe_stages(
            self.engine.model_name,
            {
                "queue": stage.queue_ms,
                "text_encode": stage.text_encode_ms,
                "denoise": stage.denoise_ms,
                "vae_decode": stage.vae_decode_ms,
                "image_encode": stage.image_encode_ms,
                "total": stage.total_ms,
            },
        )
        return GenerationResult(
            request_id=job.request_id,
            model=self.engine.model_name,
            images=images,
            output_format=req.output_format,
            seeds=[r.seed for r in job.rows],
            prompt_index=[i for i in range(len(req.prompts)) for _ in range(req.num_images)],
            metrics=stage,
            peak_memory_mb=out.peak_memory_mb,
            peak_memory_kind=out.memory_kind,
            latents=TensorPayload.from_tensor(out.latents) if out.latents is not None else None,
            trajectory=trajectory,
        )

    # ------------------------------------------------------------------ abort and status

    def abort(self, request_ids: list[str]) -> dict[str, str]:
        """Abort by id: `aborted`, `finished` (already done, nothing to do) or `unknown`."""
        out = {}
        for rid in request_ids:
            job = self._jobs.get(rid)
            if job is not None:
                self._abort_job(job, "aborted")
                out[rid] = "aborted"
            else:
                out[rid] = "finished" if rid in self._finished else "unknown"
        return out

    def _abort_job(self, job: _Job, why: str) -> None:
        if job.state not in ("queued", "running"):
            return
        was = job.state
        if was == "queued":
            try:
                self._queue.remove(job)
            except ValueError:
                pass
        self._retire(job, "aborted")
        self._counts["aborted"] += 1
        if not job.future.done():
            job.future.set_exception(Aborted(f"request {why} while {was}", request_id=job.request_id))
        logger.info("request %s %s while %s", job.request_id, why, was)

    def _retire(self, job: _Job, state: str, error: str | None = None) -> None:
        metrics.count_request(self.engine.model_name, state, len(job.rows))
        job.state = state
        self._jobs.pop(job.request_id, None)
        self._finished[job.request_id] = {
            "state": state,
            "step": job.step,
            "total_steps": job.total_steps or job.params.steps,
            "error": error,
        }
        while len(self._finished) > _FINISHED_KEPT:
            self._finished.popitem(last=False)

    def request_status(self, request_id: str) -> RequestState | None:
        state = self._request_status(request_id)
        return state.model_copy(update={"replica_id": _replica_id()}) if state else None

    def _request_status(self, request_id: str) -> RequestState | None:
        job = self._jobs.get(request_id)
        if job is not None:
            position = None
            if job.state == "queued":
                position = next((i for i, j in enumerate(self._queue) if j is job), None)
            return RequestState(
                request_id=request_id,
                state=job.state,
                queue_position=position,
                step=job.step,
                total_steps=job.total_steps or job.params.steps,
                images=len(job.rows),
            )
        done = self._finished.get(request_id)
        if done is not None:
            return RequestState(request_id=request_id, **done)
        return None

    # ------------------------------------------------------------------ the engine loop

    def _ensure_loop(self) -> None:
        if self._loop_task is None:
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._engine_loop())

    def _gather(self) -> list[_Job]:
        """The oldest queued job and the queued jobs that can share its pipeline call.

        A job with more images than `max_batch_images` runs alone, in calls of at most that
        many images (see `_run_call`), so no request makes one call larger than the setting.
        """
        head = self._queue[0]
        limit = self.batching.max_batch_images
        batch, images = [head], len(head.rows)
        for job in list(self._queue)[1:]:
            if images >= limit:
                break
            if job.batch_key == head.batch_key and images + len(job.rows) <= limit:
                batch.append(job)
                images += len(job.rows)
        return batch

    def _fill_deadline(self, batch: list[_Job], images: int) -> float:
        """When a call led by `batch[0]` stops waiting for company: `batch_wait_ms` after the head
        arrived, or earlier, `batch_gap_ms` after the newest arrival (the burst is over).

        Callers of the last call coming back are waited for past quiet gaps: when the head is
        of the last call's kind and came within the window after that call ended, and the
        batch is smaller than that call plus what was queued beside it, the call waits up to
        `batch_wait_ms` after the device became free. Clients that send their next request when
        the last one is answered come back one by one, spread by the serving path's own work;
        cutting at the first gap split their waves into smaller and smaller calls (2 CPU cores,
        8 clients: mean batch 5.3 of 8), and once split, the halves never met again.
        """
        head = batch[0]
        window = self.batching.batch_wait_ms / 1e3
        last = self._last_call
        if (
            last is not None
            and head.batch_key == last.key
            and head.enqueued <= last.ended + window
            and images < last.callers
        ):
            return max(head.enqueued, last.ended) + window
        until = head.enqueued + window
        if self.batching.batch_gap_ms > 0:
            until = min(until, self._queue[-1].enqueued + self.batching.batch_gap_ms / 1e3)
        return until

    async def _engine_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch = self._gather()
            # Wait for the batch to fill while requests keep arriving, never longer than the
            # window (see _fill_deadline).
            while (images := sum(len(j.rows) for j in batch)) < self.batching.max_batch_images:
                wait_until = self._fill_deadline(batch, images)
                if time.perf_counter() >= wait_until:
                    break
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), wait_until - time.perf_counter())
                except TimeoutError:
                    pass
                if not self._queue:
                    break
                batch = self._gather()
            if not self._queue:
                continue
            for job in batch:
                self._queue.remove(job)
                job.state, job.started = "running", time.perf_counter()
                calls = -(-len(job.rows) // self.batching.max_batch_images)
                job.total_steps = job.params.steps * calls
            self._running = batch
            rows = [r for j in batch for r in j.rows]
            hook = self._step_hook(batch, loop)
            try:
                self._call_started = time.monotonic()
                out = await loop.run_in_executor(self._engine_thread, self._run_call, batch, rows, hook)
            except Exception as e:  # one call's failure; the loop goes on
                err = self._classify(e, batch)
                for job in batch:
                    if job.state == "running":
                        self._retire(job, "failed", err.message)
                        self._counts["failed"] += 1
                        if not job.future.done():
                            job.future.set_exception(err.with_request_id(job.request_id))
                if self._fatal:
                    self._leave(loop)
                elif self._consecutive_failures >= self._max_failures:
                    await loop.run_in_executor(self._engine_thread, self._self_test)
            else:
                self._consecutive_failures = 0
                self._deliver(batch, out)
            finally:
                self._running = []
                self._call_started = None
                key = batch[0].batch_key
                callers = len(rows) + sum(len(j.rows) for j in self._queue if j.batch_key == key)
                self._last_call = _LastCall(key, time.perf_counter(), callers)
                metrics.set_queue_length(self.engine.model_name, self.queue_length())

    def _run_call(self, batch: list[_Job], rows: list[Row], hook) -> EngineOutput:
        """On the engine thread: load the call's adapter if this replica lacks it, then run the
        rows in pipeline calls of at most `max_batch_images` (one call unless one job is larger)."""
        params = batch[0].params
        if params.lora is not None:
            self._hold_lora(params.lora[0], batch[0].request.lora.path)
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
        out.timings_ms["batch_images"] = max(len(c) for c in chunks)
        out.timings_ms["pipeline_calls"] = len(parts)
        return out

    def _self_test(self) -> None:
        """Engine thread, after `max_consecutive_failures` failed calls in a row: callers'
        requests alone never make a replica unhealthy, so ask the engine to run a known-good
        call; only if that fails too is the engine broken."""
        n = self._consecutive_failures
        try:
            self.engine.self_test()
        except Exception as e:
            self._broken = f"{n} engine failures in a row, then the self-test failed: {type(e).__name__}: {e}"
            logger.error("replica unhealthy: %s", self._broken)
            return
        logger.warning("%d engine failures in a row, but the self-test call works: still healthy", n)
        self._consecutive_failures = 0
        self._counts["self_tests_passed"] += 1

    def _leave(self, loop: asyncio.AbstractEventLoop) -> None:
        """After a fatal device error: hand every queued request back (the ingress sends them to
        another replica) and end this actor, so that Serve replaces it now."""
        for job in list(self._queue):
            self._queue.remove(job)
            self._retire(job, "failed", self._fatal)
            if not job.future.done():
                job.future.set_exception(
                    ReplicaLost(f"replica is restarting after a device error: {self._fatal}",
                                request_id=job.request_id)
                )  # fmt: skip
        if _replica_id() != "local":  # inside Serve; a replica driven by tests stays alive
            loop.call_later(0.1, _exit_actor)  # once the answers above are on their way

    def _deliver(self, batch: list[_Job], out: EngineOutput) -> None:
        start = 0
        for job in batch:
            part = out.slice(start, start + len(job.rows))
            start += len(job.rows)
            part.timings_ms["batch_requests"] = len(batch)
            if job.state != "running":  # aborted during the call: its images are dropped
                continue
            self._retire(job, "done")
            self._counts["done"] += 1
            if not job.future.done():
                job.future.set_result(part)

    def _step_hook(self, batch: list[_Job], loop: asyncio.AbstractEventLoop):
        """Runs on the engine thread after every step: progress, previews, and the stop signal."""
        t0 = time.perf_counter()

        def hook(i: int, total: int, latents: torch.Tensor) -> bool:
            start = 0
            for job in batch:
                n = len(job.rows)
                job.step = i + 1
                if job.listeners and job.state == "running":
                    preview = None
                    if job.preview_every and ((i + 1) % job.preview_every == 0 or i + 1 == total):
                        preview = latents_preview(latents[start : start + n])
                    event = StepEvent(
                        request_id=job.request_id,
                        step=i + 1,
                        total_steps=total,
                        elapsed_ms=(time.perf_counter() - t0) * 1e3,
                        preview_png=preview,
                    )
                    for q in job.listeners:
                        loop.call_soon_threadsafe(q.put_nowait, event)
                start += n
            # Stop the call once no request in it still wants its images.
            return all(job.state != "running" for job in batch)

        return hook

    def _classify(self, e: Exception, batch: list[_Job]) -> ServingError:
        """A failed call's error for its callers. Only failures of the engine count towards the
        self-test; a caller's bad arguments and running out of memory do not."""
        rid = batch[0].request_id
        rows = sum(len(j.rows) for j in batch)
        p = batch[0].params
        if isinstance(e, LoraError):
            return InvalidRequest(f"lora: {e}", param="lora", request_id=rid)
        if isinstance(e, InvalidArguments):
            param = "extra" if p.extra else None
            return InvalidRequest(_no_paths(str(e)), param=param, request_id=rid)
        if isinstance(e, torch.OutOfMemoryError):
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            logger.warning("request %s ran out of device memory", rid)
            return OutOfMemory(
                f"out of device memory running {rows} image(s) at {p.width}x{p.height}; "
                "try fewer or smaller images",
                request_id=rid,
            )
        self._consecutive_failures += 1
        logger.exception("request %s failed in the engine", rid, exc_info=e)
        if _is_fatal_device_error(e):
            # A CUDA error of this kind poisons the context: no later call can succeed here.
            # The requests of this call go to another replica too: the device failed, not they.
            self._fatal = f"fatal device error: {type(e).__name__}: {e}"
            logger.error("replica leaving after request %s: %s", rid, self._fatal)
            return ReplicaLost(f"replica is restarting after a device error: {self._fatal}", request_id=rid)
        return EngineFailure(f"engine error: {type(e).__name__}: {_no_paths(str(e))}", request_id=rid)

    # ------------------------------------------------------------------ LoRA adapters

    def _hold_lora(self, name: str, path: str, pin: bool = False) -> None:
        """Engine thread only: make `name` loaded here (evicting the least recently used)."""
        if pin:
            self._pinned.add(name)
        if name in self._loras:
            self._loras.move_to_end(name)
            return
        while len(self._loras) >= self.lora_cfg.max_loaded:
            victim = next((n for n in self._loras if n not in self._pinned), None)
            if victim is None:
                if pin:
                    self._pinned.discard(name)
                raise LoraError(
                    f"all {self.lora_cfg.max_loaded} adapter slots of this replica hold pinned adapters "
                    f"({', '.join(self._loras)}); unpin one or raise lora.max_loaded"
                )
            self.engine.unload_lora(victim)
            del self._loras[victim]
            self._counts["lora_evictions"] += 1
        t = time.perf_counter()
        self.engine.load_lora(name, path)
        self._loras[name] = path
        self._counts["lora_loads"] += 1
        logger.info("loaded adapter %s from %s in %.0f ms", name, path, (time.perf_counter() - t) * 1e3)
        _report_routing(list(self._loras))

    def _drop_lora(self, name: str) -> bool:
        self._pinned.discard(name)
        if name not in self._loras:
            return False
        self.engine.unload_lora(name)
        del self._loras[name]
        _report_routing(list(self._loras))
        return True

    async def _on_engine(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._engine_thread, fn, *args)

    async def validate_lora(self, path: str) -> None:
        """Load a candidate adapter under a scratch name and drop it again; LoraError -> 400."""

        def check():
            self.engine.load_lora("__candidate__", path)
            self.engine.unload_lora("__candidate__")

        try:
            await self._on_engine(check)
        except LoraError as e:
            raise InvalidRequest(f"path: {e}", param="path") from None

    async def pin_lora(self, name: str, path: str, pinned: bool) -> list[str]:
        if pinned:
            try:
                await self._on_engine(self._hold_lora, name, path, True)
            except LoraError as e:
                raise InvalidRequest(f"pin: {e}", param="name") from None
        else:
            self._pinned.discard(name)
        return list(self._loras)

    async def evict_lora(self, name: str) -> bool:
        return await self._on_engine(self._drop_lora, name)

    def loaded_loras(self) -> dict[str, Any]:
        return {"replica_id": _replica_id(), "loaded": list(self._loras), "pinned": sorted(self._pinned)}

    # ------------------------------------------------------------------ profiling and collective RPC

    async def start_profile(self, prefix: str) -> dict[str, Any]:
        """Start the torch profiler on the engine thread; a second start is an error."""

        async def start():
            if self._profiler is not None:
                raise InvalidRequest("profiling is already running on this replica; stop it first")

            def begin():
                from torch.profiler import ProfilerActivity, profile

                cuda = [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
                prof = profile(activities=[ProfilerActivity.CPU, *cuda], record_shapes=True)
                prof.__enter__()
                return prof

            self._profiler = await self._on_engine(begin)
            self._profile_prefix = prefix
            return {"profiling": True}

        return await _outcome(start())

    async def stop_profile(self) -> dict[str, Any]:
        """Stop the profiler and write its Chrome trace; stopping without a start is an error."""

        async def stop():
            prof, self._profiler = self._profiler, None
            if prof is None:
                raise InvalidRequest("profiling is not running on this replica; start it first")
            name = f"{self._profile_prefix}-{_replica_id()}-{int(time.time())}.json"
            path = os.path.join(os.path.expanduser(self._trace_dir), name)

            def end():
                prof.__exit__(None, None, None)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                prof.export_chrome_trace(path)

            await self._on_engine(end)
            return {"trace": path}

        return await _outcome(stop())

    async def collective_rpc(self, method: str, args: list, kwargs: dict) -> dict[str, Any]:
        """Call an engine method (or its worker extension's) on the engine thread, on this replica."""

        async def call():
            allowed = rpc_methods(self.engine)
            if method not in allowed:
                raise InvalidRequest(
                    f"method: {method!r} cannot be called; the engine exports {', '.join(allowed)}",
                    param="method",
                )
            fn = getattr(self.engine, method)
            return await self._on_engine(lambda: fn(*args, **kwargs))

        return await _outcome(call())

    # ------------------------------------------------------------------ control and health

    def describe(self) -> dict[str, Any]:
        return self.engine.describe()

    def stats(self) -> dict[str, Any]:
        problem = self._health_problem()
        return {
            "replica_id": _replica_id(),
            "node_id": _node_id(),
            "queued_requests": len(self._queue),
            "queued_images": sum(len(j.rows) for j in self._queue),
            "running_requests": len(self._running),
            "running_images": sum(len(j.rows) for j in self._running),
            "healthy": problem is None,
            "health_problem": problem,
            "rss_mb": round(_rss_mb(), 1),
            "batching": self.batching.model_dump(),
            "loras_loaded": list(self._loras),
            "engine_failures_in_a_row": self._consecutive_failures,
            "counts": dict(self._counts),
        }

    def queue_length(self) -> int:
        """Queued plus running images: the load figure for routing and autoscaling."""
        return sum(len(j.rows) for j in self._queue) + sum(len(j.rows) for j in self._running)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve calls this every `metrics_interval_s`; serve_app.autoscaling reads it."""
        n = self.queue_length()
        metrics.set_queue_length(self.engine.model_name, n)
        return {QUEUE_LENGTH_METRIC: float(n)}

    def _health_problem(self) -> str | None:
        if self._fatal:
            return self._fatal
        if self._broken:
            return self._broken
        task = self._loop_task
        if task is not None and task.done():
            return f"engine loop stopped: {task.exception() if not task.cancelled() else 'cancelled'}"
        started = self._call_started
        if started is not None and time.monotonic() - started > self._call_timeout_s:
            ran = time.monotonic() - started
            return f"a pipeline call has run for {ran:.0f}s (limit {self._call_timeout_s:g}s)"
        return None

    def ready(self) -> bool:
        """Loaded, warmed up (the constructor did both) and healthy: the ingress's readiness."""
        return self._health_problem() is None

    async def check_health(self) -> None:
        """Raise when the engine is broken beyond one request, so that Serve replaces us."""
        problem = self._health_problem()
        if problem:
            raise Unavailable(problem)

    def __del__(self):
        for pool in (getattr(self, "_engine_thread", None), getattr(self, "_cpu_pool", None)):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)


_FATAL_MARKERS = ("CUDA error", "illegal memory access", "device-side assert", "CUBLAS_STATUS", "NCCL error")


def _is_fatal_device_error(e: Exception) -> bool:
    accel = getattr(torch, "AcceleratorError", None)
    return (accel is not None and isinstance(e, accel)) or any(m in str(e) for m in _FATAL_MARKERS)


def _node_id() -> str | None:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a Serve replica (the engine tests)
        return "local"


async def _outcome(coro) -> dict[str, Any]:
    """A control call's answer from this replica: its result, or its error, never an exception."""
    try:
        return {"replica_id": _replica_id(), "ok": True, "result": await coro}
    except Exception as e:
        return {
            "replica_id": _replica_id(),
            "ok": False,
            "error": f"{type(e).__name__}: {getattr(e, 'message', e)}",
        }


def _embeds(request) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Prompt embeddings of a handle caller, as (1, tokens, hidden) tensors."""
    out = []
    for name in ("prompt_embeds", "negative_prompt_embeds"):
        payload = getattr(request, name, None)
        t = payload.to_torch() if payload is not None else None
        out.append(t.unsqueeze(0) if t is not None and t.dim() == 2 else t)
    return out[0], out[1]


def _lora_key(request) -> tuple[str, float] | None:
    lora = request.lora
    if lora is None:
        return None
    return (lora.name, float(lora.scale if lora.scale is not None else 1.0))


def _report_routing(model_ids: list[str]) -> None:
    """Tell Serve's router which adapters this replica holds, for multiplexed-id affinity.

    `@serve.multiplexed` does this for models it manages; our cache keeps pinned adapters it
    must never evict, so it reports through the same call itself.
    """
    try:
        from ray.serve._private.common import RequestRoutingInfo
        from ray.serve.context import _get_global_client

        ctx = serve.get_replica_context()
        _get_global_client().record_request_routing_info(
            RequestRoutingInfo(replica_id=ctx.replica_id, multiplexed_model_ids=model_ids)
        )
    except Exception as e:  # outside Serve, or a Serve without this call: routing just loses affinity
        logger.debug("could not report adapters for routing: %s", e)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


_PATH = re.compile(r"(?<![\w.])/(?:[\w.@+-]+/)+[\w.@+-]*")


def _no_paths(message: str) -> str:
    """An engine's error text for a caller, without the server's file paths in it."""
    return _PATH.sub("<path>", message)


def _exit_actor() -> None:
    """End this replica's actor; Serve starts a replacement at once."""
    import ray

    ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


DiffusionReplicaDeployment = serve.deployment(DiffusionReplica, name="DiffusionReplica")
