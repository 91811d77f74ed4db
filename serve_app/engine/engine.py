"""The diffusion engine: one diffusers pipeline, one batch of rows per call. No Ray in here.

A call takes rows (prompt, negative prompt, seed: one image each) that share one set of call
parameters. Every row gets its own `torch.Generator`, so an image depends only on its prompt,
the parameters and its seed, never on what else shared the call. The replica decides which
requests share a call; the engine only runs it and says where the time went.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import json
import logging
import os
import time
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from serve_app.config import BUILTIN_PREFIX, ModelConfig
from serve_app.engine.families import Family, describe_pipeline, image_latents
from serve_app.engine.joining import Seat, StepBatch
from serve_app.engine.media import encode_image
from serve_app.engine.row_lora import apply_row_adapters
from serve_app.engine.step_cache import LEVELS, NoCache, cached_blocks, step_cache

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Pipeline call arguments the engine sets itself; a request's `extra` may not override them.
RESERVED_EXTRA_KEYS = frozenset(
    {
        "prompt", "prompt_2", "prompt_3", "negative_prompt", "negative_prompt_2", "negative_prompt_3",
        "height", "width", "num_inference_steps", "guidance_scale", "generator", "num_images_per_prompt",
        "output_type", "return_dict", "callback_on_step_end", "callback_on_step_end_tensor_inputs",
        "callback", "callback_steps", "latents", "prompt_embeds", "negative_prompt_embeds",
        "pooled_prompt_embeds", "negative_pooled_prompt_embeds", "image", "mask_image", "strength",
        "num_frames", "num_videos_per_prompt", "_auto_resize", "max_area",
    }
)  # fmt: skip

# What a request may ask of a model: text to image (or video), an image remade from an input
# image (`strength` of noise), an inpainting of its masked part, or an instruction edit
# (reference images and a prompt, by a model trained for it such as FLUX.1 Kontext).
TASKS = ("generate", "img2img", "inpaint", "edit")

MAX_EMBED_TOKENS = 1024  # the longest prompt embeddings taken where the length is free

_FATAL_MARKERS = ("CUDA error", "illegal memory access", "device-side assert", "CUBLAS_STATUS", "NCCL error")


def is_fatal_device_error(e: Exception) -> bool:
    """An error after which no call on this device can succeed (a poisoned CUDA context)."""
    accel = getattr(torch, "AcceleratorError", None)
    return (accel is not None and isinstance(e, accel)) or any(m in str(e) for m in _FATAL_MARKERS)


class _StopCall(Exception):
    """Raised from the step callback to leave the pipeline at once (no VAE decode)."""


class LoraError(ValueError):
    """An adapter file that cannot be used with this model; the message says why."""


class InvalidArguments(ValueError):
    """The pipeline refused this call's arguments: the caller's mistake, not the engine's."""


# What a pipeline raises for arguments it cannot take; with `extra` set, diffusers passes the
# caller's values deep into the call, so these types are taken as the caller's mistake then too.
_ARGUMENT_ERRORS = (ValueError, TypeError, KeyError, IndexError, AssertionError)


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
    mask: Any = None  # inpaint: PIL "L", white where to paint


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
    num_frames: int | None = None  # video models only
    task: str = "generate"  # one of TASKS
    strength: float | None = None  # img2img and inpaint: how much of the input is noised away
    generator_device: str | None = None  # where seeded noise is drawn; default the engine's device
    vae_slicing: bool = False  # for this call, whatever the model's setting
    vae_tiling: bool = False
    acceleration: str = "none"  # step caching: one of step_cache.LEVELS


# Called after every denoising step with (step index, total steps, latents); returning True
# stops the call at that step, with no images (the hook that abort and progress use).
StepHook = Callable[[int, int, torch.Tensor], bool | None]


@dataclass
class EngineOutput:
    images: list[Any]  # one per row: a PIL image, or a video's PIL frames
    timings_ms: dict[str, float]
    peak_memory_mb: float
    memory_kind: str
    latents: torch.Tensor | None = None
    trajectory_latents: list[torch.Tensor] | None = None
    trajectory_timesteps: list[float] | None = None
    steps_run: int = 0
    interrupted: bool = False
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
            steps_run=parts[-1].steps_run,
            interrupted=any(p.interrupted for p in parts),
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
            steps_run=self.steps_run,
            interrupted=self.interrupted,
            batch_images=self.batch_images,
            batch_requests=self.batch_requests,
            pipeline_calls=self.pipeline_calls,
        )


def latents_preview(latents: torch.Tensor) -> bytes:
    """A cheap look at (batch, channels, height, width) latents mid-denoise: the first three
    channels, scaled, as one PNG strip.

    No VAE call: it costs microseconds at the latents' resolution (1/8 of the image's side).
    """
    x = latents.detach().float()[:, :3].cpu()
    if x.shape[1] < 3:
        x = x[:, :1].repeat(1, 3, 1, 1)
    lo, hi = x.amin(dim=(1, 2, 3), keepdim=True), x.amax(dim=(1, 2, 3), keepdim=True)
    x = ((x - lo) / (hi - lo).clamp_min(1e-6) * 255).round().to(torch.uint8)
    strip = torch.cat(list(x), dim=2).permute(1, 2, 0).numpy()  # images side by side
    from PIL import Image

    return encode_image(Image.fromarray(strip), "png")


@dataclass
class _CallState:
    t0: float = 0.0
    denoise_start: float | None = None
    denoise_end: float | None = None
    steps_run: int = 0
    last_latents: torch.Tensor | None = None
    trajectory: list[torch.Tensor] = field(default_factory=list)
    timesteps: list[float] = field(default_factory=list)


def resolve_device(cfg: ModelConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("model.device is 'cuda' but no CUDA device is visible to this replica")
    return torch.device(cfg.device)


def resolve_dtype(cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    return _DTYPES[cfg.dtype]


def load_pipeline(cfg: ModelConfig, device: torch.device, dtype: torch.dtype):
    """Load from `builtin:<name>`, a local diffusers directory, or a hub id."""
    src = cfg.source
    if src.startswith(BUILTIN_PREFIX):
        from serve_app.engine.builtin import build_builtin

        pipe = build_builtin(src[len(BUILTIN_PREFIX) :], device=device, seed=cfg.seed)
        return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)

    from diffusers import DiffusionPipeline

    looks_local = src.startswith(("/", "./", "../", "~")) or Path(src).expanduser().exists()
    if looks_local:
        path = Path(src).expanduser()
        if not path.is_dir():
            raise ModelLoadError(f"model.source: {src!r} is not a directory")
        if not (path / "model_index.json").is_file():
            raise ModelLoadError(f"model.source: {src!r} has no model_index.json; not a diffusers pipeline")
        src = str(path)
    try:
        pipe = DiffusionPipeline.from_pretrained(
            src,
            dtype=dtype,
            revision=cfg.revision,
            variant=cfg.variant,
            local_files_only=cfg.local_files_only,
        )
    except Exception as e:  # diffusers raises many types here; all mean "cannot load"
        raise ModelLoadError(f"model.source: cannot load {src!r}: {type(e).__name__}: {e}") from e
    return pipe.to(device)


def scheduler_class(name: str):
    """The diffusers scheduler class called `name`; ValueError if there is none."""
    import diffusers

    cls = getattr(diffusers, name, None)
    if not (inspect.isclass(cls) and issubclass(cls, diffusers.SchedulerMixin)):
        raise ValueError(
            f"model.scheduler: {name!r} is not a diffusers scheduler class (e.g. 'EulerDiscreteScheduler')"
        )
    return cls


def denoiser_name(pipe) -> str:
    """The pipeline's name for the module its denoising loop calls every step."""
    for name in ("unet", "transformer", "prior"):
        if isinstance(getattr(pipe, name, None), torch.nn.Module):
            return name
    raise ModelLoadError(f"{type(pipe).__name__} has no unet or transformer")


def find_denoiser(pipe) -> torch.nn.Module:
    """The module the denoising loop calls every step: a UNet or a transformer."""
    return getattr(pipe, denoiser_name(pipe))


def apply_optimizations(pipe, opt, device: torch.device) -> None:
    """The accelerations named in `model.optimizations`; each refuses clearly when it cannot apply."""
    denoiser = find_denoiser(pipe)
    if opt.channels_last:
        for mod in (denoiser, getattr(pipe, "vae", None)):
            if mod is not None:
                mod.to(memory_format=torch.channels_last)
    if opt.vae_slicing:
        pipe.vae.enable_slicing()
    if opt.vae_tiling:
        pipe.vae.enable_tiling()
    if opt.attention_backend:
        if not hasattr(denoiser, "set_attention_backend"):
            raise ModelLoadError(
                "model.optimizations.attention_backend: this denoiser cannot switch backends"
            )
        try:
            denoiser.set_attention_backend(opt.attention_backend)
        except Exception as e:
            raise ModelLoadError(f"model.optimizations.attention_backend: {e}") from None
    if opt.quantize != "none":
        quantize_denoiser(denoiser, opt.quantize, device)
    if opt.cpu_offload == "model":
        pipe.enable_model_cpu_offload(device=device)
    elif opt.cpu_offload == "sequential":
        pipe.enable_sequential_cpu_offload(device=device)
    if opt.compile_denoiser:
        denoiser.compile()  # in place: hooks registered on the module keep working


# torchao's configurations for `model.optimizations.quantize`.
_QUANTIZERS = {
    "int8_weight_only": "Int8WeightOnlyConfig",
    "int8_dynamic": "Int8DynamicActivationInt8WeightConfig",
    "float8_weight_only": "Float8WeightOnlyConfig",
}


def quantize_denoiser(denoiser: torch.nn.Module, kind: str, device: torch.device) -> None:
    """Quantize the denoiser's linear layers in place with torchao (weights converted once)."""
    field = "model.optimizations.quantize"
    if kind.startswith("float8") and (
        device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9)
    ):
        raise ModelLoadError(f"{field}: {kind} needs a CUDA GPU of compute capability 8.9 or newer")
    try:
        import torchao.quantization as tq
    except ImportError:
        raise ModelLoadError(f"{field}: {kind} needs torchao (pip install torchao)") from None
    try:
        tq.quantize_(denoiser, getattr(tq, _QUANTIZERS[kind])())
    except Exception as e:
        raise ModelLoadError(f"{field}: torchao could not quantize this denoiser: {e}") from None


class _PeakMemory:
    """Peak device memory on CUDA; on CPU the growth of the process's peak RSS during the call."""

    def __init__(self, device: torch.device):
        self.device = device
        self.kind = "cuda" if device.type == "cuda" else "cpu_rss"
        self._base = 0

    def start(self) -> None:
        if self.kind == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:  # Linux: writing 5 resets VmHWM (the peak RSS) to the current RSS
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        self._base = _proc_status_kb("VmRSS")

    def stop(self) -> float:
        if self.kind == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        return max(0, _proc_status_kb("VmHWM") - self._base) / 1024


def _proc_status_kb(key: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class JoinedRun:
    """Calls that share one `CallParams` run joined (`joining.StepBatch`): a row is added
    between two steps and is its own pipeline call, with its own step hook; `step` runs one
    denoising step of every row and returns the rows that ended. On the engine thread only."""

    def __init__(
        self, engine: DiffusionEngine, params: CallParams, adapters: tuple, restore: Callable[[], None]
    ):
        self._engine = engine
        self.params = params
        self.adapters = adapters
        self._restore = restore
        self.batch = StepBatch(find_denoiser(engine._task_pipes[params.task]), _StopCall)

    @property
    def active(self) -> int:
        return self.batch.active

    def add(self, row: Row, step_hook: StepHook | None = None, params: CallParams | None = None) -> Seat:
        """Start `row`; its `Seat` holds its `EngineOutput` (or error) once it has ended. Its
        own `params` may differ from the run's in what one row's call decides alone (steps,
        guidance, strength, the outputs asked for); the rest must be the run's."""
        params = params or self.params
        self._engine._apply_lora(self.adapters)
        return self.batch.add(lambda stand_in: self._engine._row_call(row, params, step_hook, stand_in))

    def step(self) -> list[Seat]:
        self._engine._apply_lora(self.adapters)  # in case something between steps changed them
        return self.batch.step()

    def close(self) -> None:
        """Stop the rows still running (they end interrupted) and undo the run's set-up."""
        try:
            self.batch.close()
        finally:
            self._restore()


def engine_class(extension: str | None) -> type[DiffusionEngine]:
    """`DiffusionEngine`, or a subclass with the `module:Class` mixin in front of it."""
    if not extension:
        return DiffusionEngine
    module, _, name = extension.partition(":")
    try:
        mixin = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"model.engine_extension: cannot import {extension!r}: {e}") from None
    return type(f"{name}Engine", (mixin, DiffusionEngine), {})


class DiffusionEngine:
    """Owns one pipeline on one device. Not thread-safe: the replica calls it from one thread."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.device = resolve_device(cfg)
        self.dtype = resolve_dtype(cfg, self.device)
        if self.device.type == "cpu":
            torch.set_num_threads(cfg.cpu_threads or os.cpu_count() or 1)
        t = time.perf_counter()
        self.pipe = load_pipeline(cfg, self.device, self.dtype)
        if cfg.scheduler:
            self.pipe.scheduler = scheduler_class(cfg.scheduler).from_config(self.pipe.scheduler.config)
        self.pipe.set_progress_bar_config(disable=True)
        apply_optimizations(self.pipe, cfg.optimizations, self.device)
        self.load_s = time.perf_counter() - t
        self._task_pipes = self._derived_pipelines()
        self._call_args = {task: self._named_call_args(p) for task, p in self._task_pipes.items()}
        # Every argument each task's call takes, reserved ones included (read once, not per call).
        self._accepts = {
            task: frozenset(inspect.signature(p.__call__).parameters) for task, p in self._task_pipes.items()
        }
        self.family: Family = describe_pipeline(self.pipe, find_denoiser(self.pipe))
        self.default_height, self.default_width = self._native_size()
        video = self.family.modality == "video"
        self.default_num_frames = (cfg.default_num_frames or self.family.default_frames) if video else None
        self._state: _CallState | None = None
        self._active_lora: tuple | None = None
        denoiser = find_denoiser(self.pipe)
        self._denoiser_attr = denoiser_name(self.pipe)
        self._hook_handle = denoiser.register_forward_pre_hook(self._on_denoiser_call)
        # Step caching needs blocks to cache, and a denoiser torch.compile has not frozen.
        self._cache_blocks = cached_blocks(denoiser)
        cacheable = self._cache_blocks and not cfg.optimizations.compile_denoiser
        self.accelerations: tuple[str, ...] = LEVELS if cacheable else ("none",)
        if cfg.optimizations.step_cache not in self.accelerations:
            raise ModelLoadError(
                f"model.optimizations.step_cache: {type(denoiser).__name__} has no blocks "
                "to cache"
                + (" (or is compiled: compile_denoiser)" if cfg.optimizations.compile_denoiser else "")
            )
        self._memory = _PeakMemory(self.device)
        logger.info(
            "loaded %s on %s/%s in %.1fs (native %dx%d)",
            cfg.source, self.device, self.dtype, self.load_s, self.default_width, self.default_height,
        )  # fmt: skip
        if cfg.warmup:
            self.warmup()

    # ------------------------------------------------------------------ description

    @property
    def model_name(self) -> str:
        return self.cfg.served_name

    @property
    def video(self) -> bool:
        return self.family.modality == "video"

    @exported
    def describe(self) -> dict[str, Any]:
        fam = self.family
        return {
            "model": self.model_name,
            "source": self.cfg.source,
            "pipeline": type(self.pipe).__name__,
            "family": fam.name,
            "modality": fam.modality,
            "tasks": self.tasks,
            "inputs": fam.inputs()
            + (["image"] if {"img2img", "edit"} & set(self.tasks) else [])
            + (["mask"] if "inpaint" in self.tasks else []),
            "embeds_dim": fam.embeds_dim,
            "embeds_tokens": fam.embeds_tokens,
            "pooled_dim": fam.pooled_dim,
            "default_num_frames": self.default_num_frames,
            "default_fps": self.cfg.default_fps if self.video else None,
            "frame_rule": list(fam.frame_rule) if fam.frame_rule else None,
            "scheduler": type(self.pipe.scheduler).__name__,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "default_height": self.default_height,
            "default_width": self.default_width,
            "default_steps": self.cfg.default_steps,
            "default_guidance_scale": self.cfg.default_guidance_scale,
            "accelerations": list(self.accelerations),
            "load_s": round(self.load_s, 3),
            "rpc_methods": rpc_methods(self),
        }

    def _native_size(self) -> tuple[int, int]:
        """The configured size, else the model's: what an embedded twin says, the pipeline
        call's own defaults (video pipelines have them), or its sample size times the VAE's scale."""
        h, w = getattr(self.pipe, "native_size", (None, None))
        if h is None:
            params = inspect.signature(self.pipe.__call__).parameters
            h, w = (getattr(params.get(k), "default", None) for k in ("height", "width"))
        if not (isinstance(h, int) and isinstance(w, int)):
            scale = getattr(self.pipe, "vae_scale_factor", 8)
            sample = getattr(self.pipe, "default_sample_size", None)
            if sample is None:
                sample = getattr(getattr(self.pipe, "unet", None), "config", {}).get("sample_size", 64)
            if isinstance(sample, list | tuple):
                sample = sample[0]
            h = w = int(sample) * int(scale)
        return self.cfg.default_height or h, self.cfg.default_width or w

    @property
    def tasks(self) -> list[str]:
        return [t for t in TASKS if t in self._task_pipes]

    def _derived_pipelines(self) -> dict[str, Any]:
        """The pipeline of each task this model can do, all sharing the loaded modules (diffusers'
        `from_pipe`: no second copy of any weight). A pipeline that takes an image itself (an
        instruction-edit model) does its edits; others get image-to-image and inpainting."""
        from diffusers import AutoPipelineForImage2Image, AutoPipelineForInpainting

        out = {"generate": self.pipe}
        if "image" in inspect.signature(self.pipe.__call__).parameters:
            out["edit"] = self.pipe
        for task, auto in (("img2img", AutoPipelineForImage2Image), ("inpaint", AutoPipelineForInpainting)):
            if task == "img2img" and "edit" in out:
                continue
            unet = getattr(self.pipe, "unet", None)
            if task == "inpaint" and unet is not None and unet.config.in_channels not in (4, 9):
                continue  # diffusers' UNet inpainting takes 4 latent channels (or 9 with the mask)
            try:
                derived = auto.from_pipe(self.pipe)
            except Exception:  # no such pipeline for this family in diffusers
                continue
            if "image" not in inspect.signature(derived.__call__).parameters:  # e.g. video-to-video
                continue
            derived.set_progress_bar_config(disable=True)
            out[task] = derived
        return out

    def _named_call_args(self, pipe) -> dict[str, Any]:
        """The pipeline call's own arguments that `extra` may set, each with a validator of its
        annotated type (None where the annotation says nothing checkable)."""
        from pydantic import ConfigDict, TypeAdapter

        params = inspect.signature(pipe.__call__).parameters
        try:
            hints = typing.get_type_hints(type(pipe).__call__)
        except Exception:  # an annotation that does not resolve: names only
            hints = {}
        config = ConfigDict(arbitrary_types_allowed=True, allow_inf_nan=False)
        out = {}
        for name, p in params.items():
            if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) or name in RESERVED_EXTRA_KEYS:
                continue
            try:
                out[name] = TypeAdapter(hints[name], config=config) if name in hints else None
            except Exception:
                out[name] = None
        return out

    def _text_inputs(self, rows: Sequence[Row]) -> dict[str, Any]:
        """The call's text arguments: prompts, or precomputed embeddings (every row or none)."""
        if rows[0].prompt_embeds is None:
            negatives = [r.negative_prompt for r in rows]
            return {
                "prompt": [r.prompt for r in rows],
                "negative_prompt": None
                if all(n is None for n in negatives)
                else [n or "" for n in negatives],
            }
        cast = {"device": self.device, "dtype": self.dtype}
        out = {}
        for name in (
            "prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds", "negative_pooled_prompt_embeds"
        ):  # fmt: skip
            parts = [getattr(r, name) for r in rows]
            if all(p is not None for p in parts):
                out[name] = torch.cat(parts).to(**cast)
        return out

    def check_embeds(self, embeds: torch.Tensor, pooled: torch.Tensor | None = None, which: str = "") -> None:
        """Refuse embeddings this pipeline cannot take, naming the shapes it wants. Families whose
        denoiser is also conditioned on a pooled text vector (SDXL, SD3, FLUX) need that too.
        `which` is "" or "negative_": the fields' prefix in the messages."""
        fam, pipe = self.family, type(self.pipe).__name__
        name, pooled_name = f"{which}prompt_embeds", f"{which}pooled_prompt_embeds"
        if fam.embeds_dim is None:
            raise ValueError(f"{name}: {pipe} takes no prompt embeddings")
        tokens = fam.embeds_tokens
        want = f"(1, {tokens if tokens else 'tokens'}, {fam.embeds_dim})"
        if fam.pooled_dim is not None:
            want += f" with pooled_prompt_embeds (1, {fam.pooled_dim})"
        shape = tuple(embeds.shape)
        fits = (
            len(shape) == 3
            and shape[0] == 1
            and shape[2] == fam.embeds_dim
            and (shape[1] == tokens if tokens else 1 <= shape[1] <= MAX_EMBED_TOKENS)
        )
        if not fits:
            raise ValueError(f"{name}: shape {shape} does not fit this model, which wants {want}")
        if fam.pooled_dim is None:
            if pooled is not None:
                raise ValueError(f"{pooled_name}: {pipe} takes no pooled embeddings")
        elif pooled is None or tuple(pooled.shape) != (1, fam.pooled_dim):
            got = "none" if pooled is None else f"shape {tuple(pooled.shape)}"
            raise ValueError(f"{pooled_name}: got {got}; this model wants {want}")

    def takes(self, argument: str, task: str = "generate") -> bool:
        """Whether the task's pipeline call has this argument."""
        return argument in self._call_args.get(task, {})

    def check_options(
        self, generator_device: str | None, vae_slicing: bool, vae_tiling: bool, acceleration: str = "none"
    ) -> None:
        """Refuse per-call options this engine cannot honour; the message starts with the field."""
        here = self.device.type
        if acceleration not in self.accelerations:
            can = ", ".join(self.accelerations)
            raise ValueError(f"acceleration: {type(find_denoiser(self.pipe)).__name__} offers {can}")
        if generator_device not in (None, "cpu", here):
            raise ValueError(f"generator_device: this model runs on {here}; use cpu or {here}")
        vae = getattr(self.pipe, "vae", None)
        for name, flag, method in (("vae_use_slicing", vae_slicing, "enable_slicing"),
                                   ("vae_use_tiling", vae_tiling, "enable_tiling")):  # fmt: skip
            if flag and not hasattr(vae, method):
                raise ValueError(f"{name}: the VAE of {type(self.pipe).__name__} cannot do this")

    def _vae_modes(self, params: CallParams):
        """Turn on the VAE modes this call asks for and the model lacks; returns the undo."""
        vae, undo = getattr(self.pipe, "vae", None), []
        modes = ((params.vae_slicing, "use_slicing", "enable_slicing", "disable_slicing"),
                 (params.vae_tiling, "use_tiling", "enable_tiling", "disable_tiling"))  # fmt: skip
        for flag, attr, on, off in modes:
            if flag and not getattr(vae, attr, False) and hasattr(vae, on):
                getattr(vae, on)()
                undo.append(getattr(vae, off))

        def restore() -> None:
            for fn in undo:
                fn()

        return restore

    def check_task(self, task: str) -> None:
        if task not in self._task_pipes:
            can = ", ".join(self.tasks)
            raise ValueError(f"{type(self.pipe).__name__} cannot do {task}; this model does: {can}")

    def check_extra(self, extra: dict[str, Any], task: str = "generate") -> dict[str, Any]:
        """`extra` checked against the signature of the task's pipeline call: names it does not
        take are refused (diffusers would drop them silently), and each value must fit the
        argument's annotated type. Returns the values as the pipeline will get them ("0.3" -> 0.3)."""
        reserved = sorted(RESERVED_EXTRA_KEYS.intersection(extra))
        if reserved:
            raise ValueError(f"extra: may not set {', '.join(reserved)}: use the request's own fields")
        self.check_task(task)
        args, pipe = self._call_args[task], type(self._task_pipes[task]).__name__
        unknown = sorted(set(extra) - set(args))
        if unknown:
            raise ValueError(
                f"extra: {pipe} takes no argument {', '.join(map(repr, unknown))}; "
                f"it takes: {', '.join(sorted(args))}"
            )
        out = {}
        for name, value in extra.items():
            adapter = args[name]
            if adapter is None:
                out[name] = value
                continue
            try:
                out[name] = adapter.validate_python(value)
            except Exception as e:
                errors = getattr(e, "errors", lambda: [])()
                why = errors[0]["msg"] if errors else str(e)
                raise ValueError(f"extra.{name}: {why} (got {value!r:.60})") from None
        return out

    # ------------------------------------------------------------------ LoRA adapters

    @exported
    def loaded_loras(self) -> list[str]:
        return sorted({n for names in self.pipe.get_list_adapters().values() for n in names})

    def read_lora(self, path: str) -> dict[str, torch.Tensor]:
        """Read and check an adapter's weights (a diffusers/peft LoRA safetensors file, or a PEFT
        adapter directory) without touching the pipeline: safe on any thread. LoraError if
        unusable."""
        from safetensors import SafetensorError

        try:
            state = self._read_adapter(path)
        except (SafetensorError, OSError, ValueError) as e:
            raise LoraError(f"{path}: not a readable safetensors file or adapter directory ({e})") from None
        ups = [v for k, v in state.items() if "lora" in k and ("up" in k or "lora_B" in k)]
        if not ups:
            raise LoraError(f"{path}: no LoRA weights in it (no lora up/B tensors)")
        if all(float(v.abs().max()) == 0 for v in ups):
            raise LoraError(f"{path}: every LoRA up/B weight is zero; it would change no layer")
        return state

    def load_lora(self, name: str, path: str, state: dict[str, torch.Tensor] | None = None) -> None:
        """Install adapter `name` into the pipeline from `state` (what `read_lora(path)` gave;
        read here when absent), or raise LoraError. On the engine thread."""
        if state is None:
            state = self.read_lora(path)
        before = self.loaded_loras()
        try:
            self.pipe.load_lora_weights(state, adapter_name=name)
        except Exception as e:  # diffusers/peft raise several types on shape or key mismatch
            self._drop_adapter(name)
            if "NoMatching" in type(e).__name__ or "not found in the base model" in str(e):
                raise LoraError(f"{path}: its keys match no layer of {type(self.pipe).__name__}") from None
            msg = " ".join(str(e).split())
            msg = msg if len(msg) < 300 else msg[:300] + " ..."
            pipe = type(self.pipe).__name__
            raise LoraError(f"{path}: does not fit {pipe} ({type(e).__name__}: {msg})") from None
        if name not in self.loaded_loras() or self.loaded_loras() == before:
            self._drop_adapter(name)
            raise LoraError(f"{path}: its keys match no layer of {type(self.pipe).__name__}")
        self._active_lora = ()  # force set_adapters on the next call

    def unload_lora(self, name: str) -> None:
        self._drop_adapter(name)
        self._active_lora = ()

    def _read_adapter(self, path: str) -> dict[str, torch.Tensor]:
        """An adapter's weights under the pipeline's key names. A PEFT directory's keys lose
        PEFT's `base_model.model.` and gain the denoiser's prefix, and its `lora_alpha / r` is
        folded into the B weights (diffusers loads a plain state dict at alpha = r)."""
        from safetensors.torch import load_file

        folder = Path(path)
        if not folder.is_dir():
            return load_file(path)
        config = json.loads((folder / "adapter_config.json").read_text())
        if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora"):
            raise LoraError(
                f"{path}: a {config.get('peft_type')} adapter (or DoRA); only plain LoRA is loaded"
            )
        if config.get("rank_pattern") or config.get("alpha_pattern"):
            raise LoraError(f"{path}: per-layer ranks or alphas (rank_pattern, alpha_pattern) are not loaded")
        r = config.get("r")
        if not isinstance(r, int) or r < 1:
            raise LoraError(f"{path}: adapter_config.json has no rank r")
        factor = float(config.get("lora_alpha", r)) / r
        prefix = "unet" if getattr(self.pipe, "unet", None) is not None else "transformer"
        out = {}
        for key, value in load_file(str(folder / "adapter_model.safetensors")).items():
            key = key.removeprefix("base_model.model.")
            if "lora_B" in key and factor != 1.0:
                value = value * factor
            out[key if key.startswith(f"{prefix}.") else f"{prefix}.{key}"] = value
        return out

    def _drop_adapter(self, name: str) -> None:
        if name in self.loaded_loras():
            self.pipe.delete_adapters(name)

    def _row_adapters(self, rows: Sequence[Row], params: CallParams):
        """Put each row's adapters in force; returns the undo.

        Rows with one adapter set (the call's `params.loras`, or the same `Row.adapters`) get it
        the usual way. Rows with different sets or scales share the call: the base layers run
        once for the whole batch and each row adds its own low-rank deltas (`row_lora`)."""
        sets = [tuple(sorted((n, sc) for n, sc in r.adapters or params.loras if sc != 0)) for r in rows]
        if all(s == sets[0] for s in sets):
            self._apply_lora(sets[0])
            return lambda: None
        return apply_row_adapters(find_denoiser(self.pipe), sets)

    def _apply_lora(self, loras: tuple[tuple[str, float], ...]) -> None:
        """Make exactly these adapters active at their scales, in name order (none, or every
        scale 0: the base model, bit for bit)."""
        want = tuple(sorted((n, s) for n, s in loras if s != 0)) or None
        if want == self._active_lora:
            return
        if want is None:
            if self.loaded_loras():
                self.pipe.disable_lora()
        else:
            self.pipe.enable_lora()
            self.pipe.set_adapters([n for n, _ in want], [s for _, s in want])
        self._active_lora = want

    # ------------------------------------------------------------------ running

    def self_test(self) -> None:
        """One short known-good call; raises if the engine cannot run even that."""
        self.warmup()

    def warmup(self) -> None:
        t = time.perf_counter()
        params = CallParams(
            height=self.default_height,
            width=self.default_width,
            steps=self.cfg.warmup_steps,
            guidance_scale=self.cfg.default_guidance_scale,
        )
        self.run([Row("warm-up", None, 0)], params)
        logger.info("warm-up took %.2fs", time.perf_counter() - t)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _on_denoiser_call(self, module, args) -> None:
        st = self._state
        if st is not None and st.denoise_start is None:
            self._sync()
            st.denoise_start = time.perf_counter()

    def run(self, rows: Sequence[Row], params: CallParams, step_hook: StepHook | None = None) -> EngineOutput:
        """Run one pipeline call over `rows`; raises whatever the pipeline raises."""
        if not rows:
            raise ValueError("run() needs at least one row")
        st = _CallState(t0=time.perf_counter())
        pipe = self._task_pipes[params.task]
        with contextlib.ExitStack() as undo:  # the call's set-up, undone whatever happens
            undo.callback(self._row_adapters(rows, params))
            undo.callback(self._vae_modes(params))
            cache = undo.enter_context(
                step_cache(find_denoiser(pipe), pipe, params.acceleration, params.steps, self._cache_blocks)
            )
            self._state = st
            self._memory.start()
            try:
                return self._call(rows, params, step_hook, pipe, cache, st)
            finally:
                self._state = None

    def can_join(self, params: CallParams) -> bool:
        """Whether calls with `params` can run joined (`open_joined`): not with a step cache
        (its state follows one call's steps), a compiled denoiser (every new batch size would
        compile again) or CPU offload (its hooks move the whole denoiser per call)."""
        opt = self.cfg.optimizations
        return params.acceleration == "none" and not opt.compile_denoiser and opt.cpu_offload == "none"

    def open_joined(self, params: CallParams, adapters: tuple[tuple[str, float], ...] = ()) -> JoinedRun:
        """Start a joined run of calls with `params` whose rows all have `adapters` (or none);
        rows are added and stepped by the returned `JoinedRun` (see `joining`)."""
        adapters = adapters or params.loras
        self._apply_lora(adapters)
        restore = self._vae_modes(params)
        self._memory.start()
        return JoinedRun(self, params, adapters, restore)

    def _row_call(self, row: Row, params: CallParams, step_hook: StepHook | None, stand_in) -> EngineOutput:
        """One row's own pipeline call in a joined run, with `stand_in` as its denoiser and a
        scheduler of its own (the pipeline keeps a call's state on itself: a shallow copy each)."""
        st = _CallState(t0=time.perf_counter())

        def started() -> None:
            if st.denoise_start is None:
                st.denoise_start = time.perf_counter()

        stand_in.on_call = started
        pipe = copy.copy(self._task_pipes[params.task])
        pipe.__dict__[self._denoiser_attr] = stand_in
        pipe.__dict__["scheduler"] = copy.deepcopy(pipe.scheduler)
        return self._call([row], params, step_hook, pipe, NoCache(), st)

    def _call(
        self, rows: Sequence[Row], params: CallParams, step_hook: StepHook | None, pipe, cache, st: _CallState
    ) -> EngineOutput:
        total = params.steps

        def on_step_end(pipe, i, t, kwargs):
            # An image-to-image call runs only the last `strength` of the schedule.
            nonlocal total
            total = getattr(pipe, "num_timesteps", None) or total
            latents = kwargs["latents"]
            st.steps_run = i + 1
            cache.step_done()
            if params.return_trajectory:
                st.trajectory.append(latents.detach().float().cpu())
                st.timesteps.append(float(t))
            last = i + 1 == total
            if step_hook is not None and step_hook(i, total, self._viewable(latents, params)):
                raise _StopCall
            if last:
                if params.return_latents:
                    st.last_latents = latents.detach().float().cpu()
                self._sync()
                st.denoise_end = time.perf_counter()
            return {}

        fam = self.family
        accepts = self._accepts[params.task]
        kwargs = self._text_inputs(rows)
        if params.task != "generate":
            kwargs.update(self._image_inputs(rows, params, accepts))
        if "max_area" in accepts:  # Kontext scales sizes to it
            kwargs["max_area"] = params.height * params.width
        if fam.count_arg:
            kwargs[fam.count_arg] = 1
        if self.video:
            kwargs["num_frames"] = params.num_frames or self.default_num_frames
        gen_device = params.generator_device or self.device
        generators = [torch.Generator(gen_device).manual_seed(r.seed) for r in rows]
        try:
            out = pipe(
                **kwargs,
                height=params.height,
                width=params.width,
                num_inference_steps=params.steps,
                guidance_scale=params.guidance_scale,
                generator=generators,
                output_type="pil",
                callback_on_step_end=on_step_end,
                callback_on_step_end_tensor_inputs=["latents"],
                **dict(params.extra),
            )
            made = getattr(out, fam.output_attr)
            images = [list(v) for v in made] if self.video else list(made)
        except _StopCall:
            images = []
        except _ARGUMENT_ERRORS as e:
            # Checks of the inputs run before the first denoising step and raise ValueError.
            if (st.denoise_start is None and isinstance(e, ValueError)) or params.extra:
                raise InvalidArguments(f"the pipeline refused the arguments: {type(e).__name__}: {e}") from e
            raise
        end = time.perf_counter()
        start = st.denoise_start or st.t0
        denoise_end = st.denoise_end or end
        timings = {
            "text_encode_ms": (start - st.t0) * 1e3,
            "denoise_ms": (denoise_end - start) * 1e3,
            "vae_decode_ms": (end - denoise_end) * 1e3,
            "pipeline_ms": (end - st.t0) * 1e3,
        }
        return EngineOutput(
            images=list(images),
            timings_ms=timings,
            peak_memory_mb=self._memory.stop(),
            memory_kind=self._memory.kind,
            latents=st.last_latents,
            trajectory_latents=st.trajectory if params.return_trajectory else None,
            trajectory_timesteps=st.timesteps if params.return_trajectory else None,
            steps_run=st.steps_run,
            interrupted=st.steps_run < total,
        )

    @staticmethod
    def _image_inputs(rows: Sequence[Row], params: CallParams, accepts: frozenset[str]) -> dict[str, Any]:
        out: dict[str, Any] = {"image": [r.image for r in rows]}
        if params.task == "inpaint":
            out["mask_image"] = [r.mask for r in rows]
        if params.strength is not None and "strength" in accepts:
            out["strength"] = params.strength
        if "_auto_resize" in accepts:  # Kontext would resize inputs to ~1 MP; the sizes are ours
            out["_auto_resize"] = False
        return out

    def _viewable(self, latents: torch.Tensor, params: CallParams) -> torch.Tensor:
        return image_latents(self.pipe, self.family, latents, params.height, params.width)

    def close(self) -> None:
        self._hook_handle.remove()
        self.pipe = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
