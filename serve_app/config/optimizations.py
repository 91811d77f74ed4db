"""`model.optimizations`: the accelerations of one model. Part of the one configuration
(`serve_app.config`); no torch or diffusers here."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from serve_app.config.services import _Strict

# Step caching levels, from none to the most steps served from the cache (engine/step_cache.py).
Acceleration = Literal["none", "fast", "faster"]
CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]


class Optimizations(_Strict):
    """Accelerations, off by default: `speed: max` turns on the fast path (`engine/fast.py`);
    the others are single switches. `benchmarks/bench_accel.py` measures each."""

    speed: Literal["off", "max"] = Field(
        "off",
        description="`max`: the fastest path the model and device allow, warmed before traffic: the "
        "denoiser compiled (a UNet whole, in channels-last; a transformer's repeated blocks), on CUDA "
        "with CUDA graphs and the inductor settings of the fast recipes (`compile_mode`); the image "
        "decoder compiled; calls padded up to the warmed batch sizes (`model.warmup_sizes`, "
        "`model.warmup_batches`); "
        "on a GPU of compute capability 8.9+ a transformer's linear layers in float8 (torchao; unless "
        "`quantize` is set, `none` included) and the "
        "fastest attention backend installed. Adapters are swapped without recompiling.",
    )
    compile_mode: CompileMode | None = Field(
        None,
        description="torch.compile's mode under `speed: max`; default: `reduce-overhead` (CUDA graphs) on "
        "CUDA, `default` on the CPU. `max-autotune` also tunes each kernel: minutes more per shape, "
        "paid once with a `compile_cache`.",
    )
    compile_cache: str | None = Field(
        None,
        description="Under `speed: max`: where compiled kernels are kept (a directory or an fsspec URL, "
        "e.g. s3://bucket/compiled), shared by replicas: a replica that finds its model's there "
        "starts without compiling them again.",
    )
    channels_last: bool = Field(False, description="UNet and VAE in channels-last memory format.")
    vae_slicing: bool = Field(False, description="Decode a batch one image at a time (less peak memory).")
    vae_tiling: bool = Field(False, description="Decode in tiles (large images in less memory).")
    attention_backend: str | None = Field(
        None, description="diffusers attention backend of the denoiser, e.g. 'native', 'flash', 'sage'."
    )
    compile_denoiser: bool = Field(
        False, description="torch.compile the UNet/transformer (slow first calls; `speed: max` does more)."
    )
    cpu_offload: Literal["none", "model", "sequential"] = Field(
        "none", description="Keep idle submodules on the CPU (CUDA only): fits large models in less memory."
    )
    quantize: Literal["none", "int8_weight_only", "int8_dynamic", "float8_weight_only", "float8_dynamic"] = (
        Field(
            "none",
            description="Quantize the denoiser's linear layers with torchao (`pip install torchao`): int8 "
            "weights (int8_dynamic: int8 activations too), or float8 weights (float8_dynamic: activations "
            "too; CUDA, compute capability 8.9+).",
        )
    )
    step_cache: Acceleration = Field(
        "none",
        description="The `acceleration` of requests that name none: `fast`/`faster` serve some steps' "
        "block outputs from a cache (diffusers' TaylorSeer hooks).",
    )

    @field_validator("compile_cache")
    @classmethod
    def _cache_place(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"(/|~|[a-z][a-z0-9+.-]*://)\S*", v):
            raise ValueError("an absolute directory or an fsspec URL (scheme://...)")
        return v


def check_speed(model, pooled: bool, where: str) -> None:
    """Refuse, naming the field, what `speed: max` cannot combine with (ValueError)."""
    opt = model.optimizations
    if opt.speed != "max":
        fields = {
            "optimizations.compile_mode": opt.compile_mode,
            "optimizations.compile_cache": opt.compile_cache,
            "warmup_sizes": model.warmup_sizes,
            "warmup_batches": model.warmup_batches,
        }
        for field, value in fields.items():
            if value:
                raise ValueError(f"{where}.{field}: applies under optimizations.speed: max only")
        return
    clash = {  # the field as the message names it: why it cannot be
        f"{where}.optimizations.cpu_offload": opt.cpu_offload != "none"
        and "the fast path keeps the model on its device",
        f"{where}.optimizations.compile_denoiser": opt.compile_denoiser
        and "speed: max compiles the denoiser already",
        f"{where}.parallel": model.parallel.world > 1 and "a model on several ranks runs uncompiled",
        f"{where}.warmup": not model.warmup and "the fast path compiles in the warm-up, before traffic",
        f"{where}.optimizations.step_cache": opt.step_cache != "none"
        and "every request that names no acceleration would run uncompiled",
        "multiplex": pooled and "a pool's checkpoints run uncompiled",
    }
    for field, why in clash.items():
        if why:
            raise ValueError(f"{field}: not with optimizations.speed: max ({why})")


def warm_batches(model, batching):
    """`model` with its `warmup_batches` filled in under `speed: max`: 1, 2, 4, ... up to the
    `max_batch_images` of `batching` (a BatchingConfig or its dict), and that; else `model`."""
    if model.optimizations.speed != "max" or model.warmup_batches is not None:
        return model
    from serve_app.config.deployments import BatchingConfig

    max_batch_images = BatchingConfig.model_validate(batching or {}).max_batch_images
    sizes = {1 << i for i in range(max_batch_images.bit_length()) if 1 << i <= max_batch_images}
    return model.model_copy(update={"warmup_batches": sorted(sizes | {max_batch_images})})
