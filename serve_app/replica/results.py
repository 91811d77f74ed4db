"""What a replica sends back: step events while a call runs, and each request's result."""

from __future__ import annotations

import asyncio
import logging
import time

from serve_app import metrics
from serve_app.engine import EngineOutput
from serve_app.engine.engine import latents_preview
from serve_app.errors import ModerationBlocked
from serve_app.replica.intake import work
from serve_app.replica.scheduler import Job
from serve_app.schemas import (
    GenerationResult,
    StageMetrics,
    StepEvent,
    TensorPayload,
    Trajectory,
)

logger = logging.getLogger("ray.serve")


def step_hook(batch: list[Job], loop: asyncio.AbstractEventLoop):
    """Runs on the engine thread after every step: progress, previews, and the stop signal.
    A request nobody streams only counts its step: no event, no preview, and the latents
    (given as a function) are never unpacked for it."""
    t0 = time.perf_counter()

    def hook(i: int, total: int, latents) -> bool:
        start, seen = 0, None
        for job in batch:
            n = len(job.rows)
            job.step = i + 1
            if job.listeners and job.state == "running":
                preview = None
                if job.preview_every and ((i + 1) % job.preview_every == 0 or i + 1 == total):
                    try:  # a preview is a look, never a reason for the request to fail
                        if seen is None:  # once per step, for every job that wants a preview
                            seen = latents() if callable(latents) else latents
                        preview = latents_preview(seen[start : start + n])
                    except Exception as e:
                        logger.warning("no preview at step %d: %s: %s", i + 1, type(e).__name__, e)
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


def check_flagged(job: Job, out: EngineOutput, model: str) -> None:
    """Count the images the safety checker flagged; ModerationBlocked where its action refuses them."""
    if not (out.flagged and any(out.flagged)):
        return
    metrics.count_flagged(model, sum(out.flagged))
    if out.refuse_flagged:
        raise ModerationBlocked(
            f"the safety checker flagged {sum(out.flagged)} of the request's {len(out.flagged)} images; "
            "none is returned",
            request_id=job.request_id,
        )


def build_result(
    job: Job, out: EngineOutput, encoded: list[bytes], encode_ms: float, model: str
) -> GenerationResult:
    """`encoded`: the images, then each decoded step's images (`return_trajectory_decoded`)."""
    request = work(job).request
    images, rest, n = encoded[: len(out.images)], encoded[len(out.images) :], len(job.rows)
    t = out.timings_ms
    stage = StageMetrics(
        queue_ms=(job.started - job.enqueued) * 1e3,
        text_encode_ms=t["text_encode_ms"],
        denoise_ms=t["denoise_ms"],
        vae_decode_ms=t["vae_decode_ms"],
        image_encode_ms=encode_ms,
        total_ms=(time.perf_counter() - job.enqueued) * 1e3,
        batch_images=out.batch_images,
        batch_requests=out.batch_requests,
        pipeline_calls=out.pipeline_calls,
        steps=out.steps_run,
        priority=job.priority,
    )
    trajectory = None
    if out.trajectory_latents is not None:
        trajectory = Trajectory(
            timesteps=out.trajectory_timesteps,
            latents=[TensorPayload.from_tensor(x) for x in out.trajectory_latents],
        )
        if out.trajectory_log_probs is not None:  # a rollout's
            trajectory.start = TensorPayload.from_tensor(out.trajectory_start)
            trajectory.stochastic_steps = out.rollout_steps
            trajectory.log_probs = TensorPayload.from_tensor(out.trajectory_log_probs)
        if out.trajectory_decoded is not None:
            trajectory.decoded = [rest[k : k + n] for k in range(0, len(rest), n)]
    metrics.observe_stages(model, stage.stage_ms())
    return GenerationResult(
        request_id=job.request_id,
        model=model,
        images=images,
        output_format=request.output_format,
        seeds=[r.seed for r in job.rows],
        prompt_index=[i for i in range(len(request.prompts)) for _ in range(request.num_images)],
        metrics=stage,
        peak_memory_mb=out.peak_memory_mb,
        peak_memory_kind=out.memory_kind,
        latents=TensorPayload.from_tensor(out.latents) if out.latents is not None else None,
        trajectory=trajectory,
        flagged=[i for i, f in enumerate(out.flagged) if f] if out.flagged and any(out.flagged) else None,
        policy_version=max((r.version for r in request.loras if r.version is not None), default=None),
        weights_version=job.weights_version,
    )
