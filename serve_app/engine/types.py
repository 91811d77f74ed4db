"""What goes in and out of the engine: rows, call parameters, outputs, and the errors it raises.

Plain types only: nothing here loads a model or runs a pipeline, so the replica and the engine
protocol can name them without the implementation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# What a request may ask of a model: text to image (or video), an image remade from an input
# image (`strength` of noise), an inpainting of its masked part, or an instruction edit
# (reference images and a prompt, by a model trained for it such as FLUX.1 Kontext).
TASKS = ("generate", "img2img", "inpaint", "edit")

_FATAL_MARKERS = ("CUDA error", "illegal memory access", "device-side assert", "CUBLAS_STATUS", "NCCL error")


def is_fatal_device_error(e: Exception) -> bool:
    """An error after which no call on this device can succeed (a poisoned CUDA context, or a
    rank of a parallel engine lost: its process group is broken)."""
    accel = getattr(torch, "AcceleratorError", None)
    if isinstance(e, RankLost) or (accel is not None and isinstance(e, accel)):
        return True
    return any(m in str(e) for m in _FATAL_MARKERS)


class RankLost(RuntimeError):
    """A rank of a parallel engine died, hung, or failed a call the others ran."""


class LoraError(ValueError):
    """An adapter file that cannot be used with this model; the message says why."""


class InvalidArguments(ValueError):
    """The pipeline refused this call's arguments: the caller's mistake, not the engine's
    (`param`: the request field at fault, where known)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ModelLoadError(RuntimeError):
    """The configured model cannot be loaded; the message says why and what to change."""


def exported(fn):
    """Mark an engine (or engine extension) method as callable through collective RPC.

    Only marked methods can be called that way: RPC reaches every replica at once, so
    nothing that closes the engine, loads files or changes what other requests get is marked.
    """
    fn.rpc_exported = True
    return fn


def rpc_methods(engine: Any) -> list[str]:
    """The names collective RPC may call on `engine`."""
    cls = type(engine)
    return sorted(n for n in dir(cls) if getattr(getattr(cls, n, None), "rpc_exported", False))


@dataclass(frozen=True)
class Row:
    """One image to make."""

    prompt: str
    negative_prompt: str | None
    seed: int
    prompt_embeds: torch.Tensor | None = None  # (1, tokens, hidden) instead of the prompt's text
    negative_prompt_embeds: torch.Tensor | None = None
    pooled_prompt_embeds: torch.Tensor | None = None  # (1, width), for the families that pool
    negative_pooled_prompt_embeds: torch.Tensor | None = None
    adapters: tuple[tuple[str, float], ...] = ()  # this row's adapters, when rows differ (see run)
    image: Any = None  # the input image (PIL, RGB) of img2img, inpaint and edit rows
    references: tuple[Any, ...] = ()  # more images of the row's prompt (reference-image models)
    mask: Any = None  # inpaint: PIL "L", white where to paint


@dataclass(frozen=True)
class RolloutSpec:
    """A rollout call's sampling (`rollout`): `sampler` one of sde, cps (flow-matching models),
    ddim (the others); `noise_level` its noise (ddim's eta); `window` the steps [start, stop)
    that are stochastic (None: every step)."""

    sampler: str
    noise_level: float
    window: tuple[int, int] | None = None


@dataclass(frozen=True)
class CallParams:
    """What every row of one pipeline call shares."""

    height: int
    width: int
    steps: int
    guidance_scale: float
    extra: tuple[tuple[str, Any], ...] = ()
    loras: tuple[tuple[str, float], ...] = ()  # (adapter name, scale) each; they must be loaded
    return_latents: bool = False
    return_trajectory: bool = False
    decode_trajectory: bool = False  # with the trajectory: the image decoded after every step
    num_frames: int | None = None  # video models only
    task: str = "generate"  # one of TASKS
    strength: float | None = None  # img2img and inpaint: how much of the input is noised away
    generator_device: str | None = None  # where seeded noise is drawn; default the engine's device
    vae_slicing: bool = False  # for this call, whatever the model's setting
    vae_tiling: bool = False
    acceleration: str = "none"  # step caching: one of step_cache.LEVELS
    sampler: str | None = None  # a scheduler of its own (`schedulers`); None: the model's
    sigma_schedule: str | None = None  # with `sampler`: karras, exponential, beta; None: its own
    rollout: RolloutSpec | None = None  # stochastic sampling with log-probs (`rollout`)
    moderation: str | None = None  # the safety checker's threshold: "low" (looser) or the default


# Called after every denoising step with (step index, total steps, latents); returning True
# stops the call at that step, with no images (the hook that abort and progress use). The
# latents come as a function that gives them as (batch, channels, height, width): only a
# preview needs them, and a call that nobody watches never unpacks them. (A hook also takes
# the tensor itself, as an engine extension written for the earlier form passes it.)
StepHook = Callable[[int, int, "Callable[[], torch.Tensor] | torch.Tensor"], bool | None]


@dataclass
class EngineOutput:
    images: list[Any]  # one per row: a PIL image, or a video's PIL frames
    timings_ms: dict[str, float]
    peak_memory_mb: float
    memory_kind: str
    latents: torch.Tensor | None = None
    trajectory_latents: list[torch.Tensor] | None = None
    trajectory_timesteps: list[float] | None = None
    trajectory_decoded: list[list[Any]] | None = None  # per step, each row's decoded PIL image
    # A rollout's: the latents before the first step, the stochastic steps and their
    # log-probabilities per row (rows, len(rollout_steps)).
    trajectory_start: torch.Tensor | None = None
    rollout_steps: list[int] | None = None
    trajectory_log_probs: torch.Tensor | None = None
    steps_run: int = 0
    interrupted: bool = False
    # The safety checker's verdict per row (None: no checker), and whether flagged rows are
    # refused (else they were blanked).
    flagged: list[bool] | None = None
    refuse_flagged: bool = False
    # How the rows ran, filled in by the replica: the largest call, the requests that shared it,
    # and the calls a request larger than one call took.
    batch_images: int = 0
    batch_requests: int = 1
    pipeline_calls: int = 1

    @classmethod
    def concat(cls, parts: Sequence[EngineOutput]) -> EngineOutput:
        """One output from the outputs of consecutive calls over consecutive rows."""
        if len(parts) == 1:
            return parts[0]
        timings: dict[str, float] = {}
        for p in parts:
            for k, v in p.timings_ms.items():
                timings[k] = timings.get(k, 0.0) + v
        latents = [p.latents for p in parts]
        traj = [p.trajectory_latents for p in parts]
        decoded = [p.trajectory_decoded for p in parts]
        return cls(
            images=[im for p in parts for im in p.images],
            timings_ms=timings,
            peak_memory_mb=max(p.peak_memory_mb for p in parts),
            memory_kind=parts[0].memory_kind,
            latents=torch.cat(latents) if all(x is not None for x in latents) else None,
            trajectory_latents=(
                [torch.cat(step) for step in zip(*traj, strict=True)]
                if all(x is not None for x in traj)
                else None
            ),
            trajectory_timesteps=parts[0].trajectory_timesteps,
            trajectory_decoded=(
                [[im for step in steps for im in step] for steps in zip(*decoded, strict=True)]
                if all(x is not None for x in decoded)
                else None
            ),
            trajectory_start=_cat([p.trajectory_start for p in parts]),
            rollout_steps=parts[0].rollout_steps,
            trajectory_log_probs=_cat([p.trajectory_log_probs for p in parts]),
            steps_run=parts[-1].steps_run,
            interrupted=any(p.interrupted for p in parts),
            flagged=[f for p in parts for f in p.flagged]
            if all(p.flagged is not None for p in parts)
            else None,
            refuse_flagged=parts[0].refuse_flagged,
        )

    def slice(self, start: int, stop: int) -> EngineOutput:
        """The part of a batched call's output that belongs to rows [start, stop)."""
        return EngineOutput(
            images=self.images[start:stop],
            timings_ms=dict(self.timings_ms),
            peak_memory_mb=self.peak_memory_mb,
            memory_kind=self.memory_kind,
            latents=self.latents[start:stop] if self.latents is not None else None,
            trajectory_latents=(
                [x[start:stop] for x in self.trajectory_latents]
                if self.trajectory_latents is not None
                else None
            ),
            trajectory_timesteps=self.trajectory_timesteps,
            trajectory_decoded=(
                [step[start:stop] for step in self.trajectory_decoded]
                if self.trajectory_decoded is not None
                else None
            ),
            trajectory_start=_rows(self.trajectory_start, start, stop),
            rollout_steps=self.rollout_steps,
            trajectory_log_probs=_rows(self.trajectory_log_probs, start, stop),
            steps_run=self.steps_run,
            interrupted=self.interrupted,
            flagged=self.flagged[start:stop] if self.flagged is not None else None,
            refuse_flagged=self.refuse_flagged,
            batch_images=self.batch_images,
            batch_requests=self.batch_requests,
            pipeline_calls=self.pipeline_calls,
        )


def _cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    return torch.cat(parts) if parts and all(p is not None for p in parts) else None


def _rows(t: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
    return t[start:stop] if t is not None else None
