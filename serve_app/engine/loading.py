"""Loading a model: the device and dtype, the pipeline, its scheduler and optimizations, and the
pipelines derived from it for the other tasks.

Every refusal is a `ModelLoadError` that names the setting to change.
"""

from __future__ import annotations

import functools
import inspect
import tempfile
from pathlib import Path
from typing import Any

import torch

from serve_app.config import BUILTIN_PREFIX, ModelConfig
from serve_app.engine.step_cache import LEVELS
from serve_app.engine.types import TASKS, ModelLoadError
from serve_app.formats.layouts import is_single_file

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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


def prepare_pipeline(
    cfg: ModelConfig, device: torch.device, dtype: torch.dtype, reuse: dict[str, Any] | None = None
):
    """The configured pipeline, ready to call: loaded (with the `reuse` components, see
    `load_pipeline`), with the configured scheduler, no progress bar and the configured
    optimizations."""
    pipe = load_pipeline(cfg, device, dtype, reuse)
    if cfg.scheduler:
        pipe.scheduler = scheduler_class(cfg.scheduler).from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    apply_optimizations(pipe, cfg.optimizations, device)
    return pipe


def load_pipeline(
    cfg: ModelConfig, device: torch.device, dtype: torch.dtype, reuse: dict[str, Any] | None = None
):
    """Load from `builtin:<name>`, a local diffusers directory, a hub id, or a single-file
    checkpoint (`load_checkpoint_file`).

    `reuse` (component name -> an already loaded module, e.g. another checkpoint's identical
    text encoder) is passed to diffusers instead of loading those components again: the new
    pipeline holds the very same objects. A builtin source ignores it."""
    src = cfg.source
    if src.startswith(BUILTIN_PREFIX):
        from serve_app.engine.builtin import build_builtin

        pipe = build_builtin(src[len(BUILTIN_PREFIX) :], device=device, seed=cfg.seed)
        return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)

    if is_single_file(src):
        return load_checkpoint_file(cfg, dtype, reuse).to(device)

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
            **({"use_safetensors": True} if cfg.safetensors_only else {}),
            **(reuse or {}),
        )
    except Exception as e:  # diffusers raises many types here; all mean "cannot load"
        raise ModelLoadError(f"model.source: cannot load {src!r}: {type(e).__name__}: {e}") from e
    return pipe.to(device)


def load_checkpoint_file(cfg: ModelConfig, dtype: torch.dtype, reuse: dict[str, Any] | None = None):
    """A single-file checkpoint's pipeline on the CPU (`formats.single_file_load`), the parts
    and configs the file lacks from `model.pipeline_config`: an embedded model's, built here, or
    a local directory's."""
    from serve_app.engine.builtin import add_grid_positions, build_builtin
    from serve_app.formats.single_file_load import CheckpointRefused, Embedded, load_single_file

    try:
        pipe = load_single_file(cfg, dtype, Embedded(build_builtin, builtin_configs), reuse)
    except CheckpointRefused as e:
        raise ModelLoadError(str(e)) from e.__cause__
    if cfg.pipeline_config == BUILTIN_PREFIX + "shapes":
        add_grid_positions(pipe.unet)  # the trained model's positions are part of its code
    return pipe


@functools.lru_cache(maxsize=8)
def builtin_configs(name: str) -> Path:
    """A directory with the configs of `builtin:<name>` (no weights), written once per process;
    the trained model's own directory for `shapes`."""
    from serve_app.engine.builtin import SHAPES_DIR, build_builtin
    from serve_app.formats.single_file_load import write_configs

    if name == "shapes":
        return SHAPES_DIR
    pipe = build_builtin(name, device="meta")  # the shapes without the memory
    out = Path(tempfile.mkdtemp(prefix=f"diffusion-serve-{name}-configs-"))
    write_configs(pipe, out)
    return out


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


def weights_held(denoiser: torch.nn.Module) -> dict[str, Any]:
    """What the denoiser's weights hold on its device: their bytes (quantized ones as stored)
    and the types they are held in (`float16`, `Q8_0` for a GGUF file's, ...)."""
    held: dict[str, int] = {}
    for p in denoiser.parameters():
        kind = getattr(getattr(p, "quant_type", None), "name", None) or str(p.dtype).removeprefix("torch.")
        parts = [p]
        if hasattr(p, "__tensor_flatten__"):  # a tensor subclass (torchao's Int8Tensor): what it holds
            kind = type(p).__name__
            parts = [getattr(p, name) for name in p.__tensor_flatten__()[0]]
        held[kind] = held.get(kind, 0) + sum(t.numel() * t.element_size() for t in parts)
    return {
        "denoiser_bytes": sum(held.values()),
        "denoiser_weights": sorted(held, key=held.get, reverse=True),
    }


def copy_weights(denoiser: torch.nn.Module, weights: dict[str, torch.Tensor]) -> int:
    """Copy `weights` (names of the denoiser's own state dict, as diffusers saves it) into the
    denoiser's parameters and buffers in place, in their dtype and on their device; a name an
    adapter wrapped (`to_q.weight` -> `to_q.base_layer.weight`) reaches the base layer. Every
    name and shape is checked before anything is copied: ValueError naming the first misfit.
    Returns the tensors copied."""
    own = denoiser.state_dict(keep_vars=True)
    targets = {}
    for name, value in weights.items():
        target = name if name in own else name.rsplit(".", 1)[0] + ".base_layer." + name.rsplit(".", 1)[-1]
        if target not in own:
            raise ValueError(f"weights: {name!r} is no weight of the denoiser")
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(own[target].shape):
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"weights: {name!r} is {shape}, the denoiser's is {tuple(own[target].shape)}")
        if type(own[target]) not in (torch.Tensor, torch.nn.Parameter):
            raise ValueError(
                f"weights: {name!r} is quantized here ({type(own[target]).__name__}); not replaced"
            )
        targets[target] = value
    with torch.no_grad():
        for target, value in targets.items():
            own[target].copy_(value.to(own[target].device, own[target].dtype))
    return len(targets)


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
    "float8_dynamic": "Float8DynamicActivationFloat8WeightConfig",
}


def quantize_denoiser(denoiser: torch.nn.Module, kind: str, device: torch.device) -> None:
    """Quantize the denoiser's linear layers in place with torchao (weights converted once)."""
    field = "model.optimizations.quantize"
    if any(hasattr(p, "quant_type") for p in denoiser.parameters()):
        raise ModelLoadError(f"{field}: the denoiser of a GGUF file is quantized already; leave it 'none'")
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


def offered_accelerations(denoiser: torch.nn.Module, cache_blocks: list[str], opt) -> tuple[str, ...]:
    """The step-caching levels calls may ask for (`step_cache.LEVELS`, or only "none"), given
    the denoiser's `cache_blocks`; ModelLoadError if `model.optimizations.step_cache` is not
    one of them."""
    # Step caching needs blocks to cache, and a denoiser torch.compile has not frozen.
    cacheable = cache_blocks and not opt.compile_denoiser
    levels: tuple[str, ...] = LEVELS if cacheable else ("none",)
    if opt.step_cache not in levels:
        raise ModelLoadError(
            f"model.optimizations.step_cache: {type(denoiser).__name__} has no blocks "
            "to cache" + (" (or is compiled: compile_denoiser)" if opt.compile_denoiser else "")
        )
    return levels


# Pipelines whose signature says `image` is optional but whose call needs one.
_NEEDS_IMAGE = ("QwenImageEditPipeline", "QwenImageEditPlusPipeline")


def pin_execution_device(pipes) -> None:
    """Answer each pipeline's `_execution_device` from a value found once. diffusers' property
    walks every module of every component at each call, looking for offloading hooks: 2.8 ms
    a call on the tiny twin, more on a real model, and a joined run pays it for every seat.
    Only for a pipeline whose modules stay where they are (no CPU offloading)."""
    from diffusers import DiffusionPipeline

    walk = DiffusionPipeline.__dict__["_execution_device"]
    if not getattr(walk.fget, "pins", False):

        def execution_device(self):
            pinned = self.__dict__.get("_pinned_execution_device")
            return pinned if pinned is not None else walk.fget(self)

        execution_device.pins = True
        DiffusionPipeline._execution_device = property(execution_device, doc=walk.__doc__)
    for pipe in pipes:
        pipe.__dict__.pop("_pinned_execution_device", None)
        pipe.__dict__["_pinned_execution_device"] = pipe._execution_device


def derived_pipelines(pipe) -> dict[str, Any]:
    """The pipeline of each task this model can do, all sharing the loaded modules (diffusers'
    `from_pipe`: no second copy of any weight). A pipeline that takes an image itself (an
    instruction-edit model) does its edits; others get image-to-image and inpainting."""
    from diffusers import AutoPipelineForImage2Image, AutoPipelineForInpainting

    image = inspect.signature(pipe.__call__).parameters.get("image")
    needs = any(c.__name__ in _NEEDS_IMAGE for c in type(pipe).__mro__)
    if image is not None and (needs or image.default is inspect.Parameter.empty):
        return {"edit": pipe}  # it starts from an image (Wan's image-to-video): nothing else
    out = {"generate": pipe}
    if image is not None:
        out["edit"] = pipe
    for task, auto in (("img2img", AutoPipelineForImage2Image), ("inpaint", AutoPipelineForInpainting)):
        if task == "img2img" and "edit" in out:
            continue
        unet = getattr(pipe, "unet", None)
        if task == "inpaint" and unet is not None and unet.config.in_channels not in (4, 9):
            continue  # diffusers' UNet inpainting takes 4 latent channels (or 9 with the mask)
        try:
            derived = auto.from_pipe(pipe)
        except Exception:  # no such pipeline for this family in diffusers
            continue
        if "image" not in inspect.signature(derived.__call__).parameters:  # e.g. video-to-video
            continue
        derived.set_progress_bar_config(disable=True)
        out[task] = derived
    return out


def model_tasks(task_pipes: dict[str, Any]) -> list[str]:
    """The tasks that have a pipeline in `task_pipes`, in the order of TASKS."""
    return [t for t in TASKS if t in task_pipes]


def native_size(pipe, cfg: ModelConfig) -> tuple[int, int]:
    """The configured size, else the model's: what an embedded twin says, the pipeline
    call's own defaults (video pipelines have them), or its sample size times the VAE's scale."""
    h, w = getattr(pipe, "native_size", (None, None))
    if h is None:
        params = inspect.signature(pipe.__call__).parameters
        h, w = (getattr(params.get(k), "default", None) for k in ("height", "width"))
    if not (isinstance(h, int) and isinstance(w, int)):
        scale = getattr(pipe, "vae_scale_factor", 8)
        sample = getattr(pipe, "default_sample_size", None)
        if sample is None:
            sample = getattr(getattr(pipe, "unet", None), "config", {}).get("sample_size", 64)
        if isinstance(sample, list | tuple):
            sample = sample[0]
        h = w = int(sample) * int(scale)
    return cfg.default_height or h, cfg.default_width or w
