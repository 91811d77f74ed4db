"""Deployment settings: one pydantic model, validated once when the app is built.

A bad value fails `serve run` / `serve deploy` with a message that names the field,
instead of failing at the first request. Nothing here imports torch or diffusers, so
the ingress can read the same models without loading a model stack.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from serve_app.config.deployments import (  # re-exported: one configuration
    AutoscalingSettings,
    BatchingConfig,
    IngressConfig,
    MultiplexSettings,
    ReplicaConfig,
)
from serve_app.config.optimizations import Acceleration as Acceleration
from serve_app.config.optimizations import Optimizations, check_speed
from serve_app.config.parallel import ParallelConfig, check_parallel
from serve_app.config.services import PRIORITIES as PRIORITIES
from serve_app.config.services import (  # re-exported: one configuration
    AuthConfig,
    CheckpointsConfig,
    JobsConfig,
    LoraConfig,
    ProfilingConfig,
    ResultCacheConfig,
    TenantConfig,
    _Strict,
)
from serve_app.config.services import Priority as Priority
from serve_app.config.services import priority_level as priority_level
from serve_app.formats.layouts import PICKLE_REASON, is_pickle_name, is_single_file

BUILTIN_PREFIX = "builtin:"
# Names accepted after `builtin:`; the builders live in serve_app/engine/builtin.py.
BUILTIN_MODELS = (
    "shapes", "tiny-sd", "tiny-sdxl", "tiny-sd3", "tiny-flux", "tiny-flux-kontext", "tiny-wan",
    "tiny-qwen-image", "tiny-qwen-image-edit", "tiny-z-image", "tiny-flux2-klein", "tiny-flux2",
    "tiny-wan-i2v", "tiny-ltx", "tiny-hunyuan-video", "sd15-arch", "sdxl-arch", "flux-arch", "ltx-arch",
)  # fmt: skip


__all__ = [
    "Optimizations",
    "SafetyConfig",
    "AuthConfig",
    "ResultCacheConfig",
    "AutoscalingSettings",
    "BatchingConfig",
    "CheckpointsConfig",
    "IngressConfig",
    "JobsConfig",
    "LoraConfig",
    "MultiplexSettings",
    "ProfilingConfig",
    "ReplicaConfig",
    "TenantConfig",
]


class SafetyConfig(_Strict):
    """An image classifier every image passes before it is returned (off unless given)."""

    checker: str = Field(
        description="A local directory holding a transformers image-classification model, or diffusers' "
        "`StableDiffusionSafetyChecker` (config.json, safetensors weights, preprocessor_config.json)."
    )
    flagged_labels: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="An image classifier's labels that mark an image as unsafe (at least one; not for "
        "diffusers' checker, which flags its own concepts).",
    )
    threshold: float = Field(
        0.5, gt=0, le=1, description="An image whose flagged labels' probability reaches this is flagged."
    )
    low_threshold: float = Field(
        0.8, gt=0, le=1, description="The threshold of requests with `moderation: low` (looser: higher)."
    )
    margin: float = Field(
        0.0,
        ge=-1,
        le=1,
        description="Diffusers' checker: an image is flagged where its similarity to one of the checker's "
        "concepts exceeds that concept's own threshold by more than this (0: the checker's own verdict).",
    )
    low_margin: float = Field(
        0.02, ge=-1, le=1, description="Diffusers' checker: the margin of requests with `moderation: low`."
    )
    action: Literal["refuse", "blank"] = Field(
        "refuse",
        description="`refuse`: a request with a flagged image gets a 400 `moderation_blocked`; `blank`: "
        "the flagged image is returned black and listed in `flagged`.",
    )


class ModelConfig(_Strict):
    """What the engine loads and how it runs it. Plain data: the engine reads it, Ray does not."""

    source: str = Field(
        "builtin:tiny-sd",
        description="`builtin:<name>`, a local diffusers directory, a Hugging Face hub id, or one "
        "`.safetensors` checkpoint file in the original layout: Stable Diffusion 1.x or SDXL "
        "(A1111/ComfyUI), SD3 (Stability's), or a FLUX transformer (BFL/ComfyUI), which may also be "
        "a `.gguf` file (quantized; its weights stay quantized).",
    )
    pipeline_config: str | None = Field(
        None,
        description="For a single-file `source` (and the single-file checkpoints of this model's pool): "
        "where the pipeline's configs come from, never downloaded: a local diffusers pipeline directory "
        "(model_index.json, component configs, tokenizer, scheduler; its weights are not read, but for a "
        "FLUX transformer file its VAE's and text encoders' are) or "
        "`builtin:<name>`, an embedded model of the same family (e.g. `builtin:tiny-sd`).",
    )
    name: str | None = Field(None, description="Model name served in /v1/models; default from `source`.")
    aliases: list[str] = Field(
        default_factory=list,
        max_length=16,
        description="Other names requests may give for this model in `model` (clients with a fixed "
        "name, e.g. `dall-e-2`, `dall-e-3`, `gpt-image-1`); listed in /v1/models.",
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) of `source`.")
    variant: str | None = Field(None, description="Weights variant for hub/local loads, e.g. `fp16`.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the pipeline runs; `auto`: CUDA when a device is visible, else the CPU."
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="`auto`: float16 on CUDA, float32 on CPU."
    )
    scheduler: str | None = Field(None, description="diffusers scheduler class name to use instead.")
    seed: int = Field(0, description="Seed of the random weights of `builtin:` models.")
    default_height: int | None = Field(
        None,
        ge=8,
        multiple_of=8,
        description="Height of requests that give no size; default: the model's own.",
    )
    default_width: int | None = Field(
        None,
        ge=8,
        multiple_of=8,
        description="Width of requests that give no size; default: the model's own.",
    )
    default_steps: int = Field(20, ge=1, description="Denoising steps of requests that give none.")
    default_guidance_scale: float = Field(7.5, ge=0, description="Guidance scale of requests that give none.")
    default_num_frames: int | None = Field(
        None, ge=1, description="Video models: frames per video; default: the pipeline's own default."
    )
    default_fps: int = Field(16, ge=1, le=120, description="Video models: frames per second of the file.")
    warmup: bool = Field(
        True, description="Run one short call at the default size before the replica reports ready."
    )
    warmup_steps: int = Field(
        2, ge=1, description="Denoising steps of the warm-up call (and of the self-test)."
    )
    warmup_sizes: list[str] = Field(
        default_factory=list,
        max_length=16,
        description="Under `optimizations.speed: max`: the sizes (`WIDTHxHEIGHT`) compiled before traffic; "
        "default: the native size. Other sizes are served too, uncompiled.",
    )
    warmup_batches: list[int] | None = Field(
        None,
        max_length=16,
        description="Under `optimizations.speed: max`: the images per call compiled before traffic; a "
        "call is padded up to the next of them. Default: 1, 2, 4, ... up to batching.max_batch_images.",
    )
    cpu_threads: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads on CPU; default: every core. Ray sets OMP_NUM_THREADS=1 "
        "in actors, which halves the speed of a CPU replica.",
    )
    local_files_only: bool = Field(
        False, description="Never download: load `source` from the local hub cache only."
    )
    safetensors_only: bool = Field(
        False, description="Load safetensors weights only, never pickles (a pool's checkpoints always)."
    )
    optimizations: Optimizations = Field(
        default_factory=Optimizations, description="Optional accelerations, all off by default."
    )
    parallel: ParallelConfig = Field(
        default_factory=ParallelConfig, description="One request across several ranks (off: all 1)."
    )
    safety: SafetyConfig | None = Field(
        None, description="Check every image with a classifier before it is returned (off by default)."
    )
    engine_extension: str | None = Field(
        None,
        description="`module:Class` of a mixin whose methods are mixed into the engine (a worker "
        "extension); serve_app.testing:FaultInjection is the one the tests use to inject faults.",
    )

    @field_validator("warmup_sizes")
    @classmethod
    def _sizes(cls, v: list[str]) -> list[str]:
        for size in v:
            m = re.fullmatch(r"(\d+)x(\d+)", size)
            if not m or any(int(x) < 8 or int(x) % 8 for x in m.groups()):
                raise ValueError(f"{size!r}: WIDTHxHEIGHT, each a multiple of 8")
        return v

    @field_validator("warmup_batches")
    @classmethod
    def _batches(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or any(b < 1 or b > 64 for b in v)):
            raise ValueError("one or more batch sizes, each 1 to 64")
        return sorted(set(v)) if v is not None else None

    @field_validator("engine_extension")
    @classmethod
    def _import_path(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[\w.]+:[\w]+", v):
            raise ValueError("must be an import path 'package.module:ClassName'")
        return v

    @field_validator("source")
    @classmethod
    def _known_builtin(cls, v: str) -> str:
        v = v.strip()
        if not v:
            raise ValueError("must not be empty")
        if v.startswith(BUILTIN_PREFIX) and v[len(BUILTIN_PREFIX) :] not in BUILTIN_MODELS:
            allowed = ", ".join(BUILTIN_PREFIX + n for n in BUILTIN_MODELS)
            raise ValueError(f"unknown builtin model {v!r}; allowed: {allowed}")
        if is_pickle_name(v):
            raise ValueError(f"{v!r} is a pickle checkpoint: {PICKLE_REASON}")
        return v

    @field_validator("pipeline_config")
    @classmethod
    def _known_config(cls, v: str | None) -> str | None:
        if v is not None and v.startswith(BUILTIN_PREFIX) and v[len(BUILTIN_PREFIX) :] not in BUILTIN_MODELS:
            raise ValueError(f"unknown builtin model {v!r}")
        return v

    @field_validator("aliases")
    @classmethod
    def _alias_names(cls, v: list[str]) -> list[str]:
        for alias in v:
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}", alias):
                raise ValueError(f"{alias!r}: 1-128 letters, digits, '.', '_', ':', '/' or '-'")
        if len(set(v)) < len(v):
            raise ValueError("an alias is listed twice")
        return v

    @model_validator(mode="after")
    def _single_file_configs(self):
        if is_single_file(self.source) and self.pipeline_config is None:
            raise ValueError(
                f"pipeline_config: the single-file source {self.source!r} needs the pipeline's configs: "
                "a local diffusers directory or builtin:<name> of its family"
            )
        return self

    @model_validator(mode="after")
    def _aliases_differ(self):
        if self.served_name in self.aliases:
            raise ValueError(f"aliases: {self.served_name!r} is the model's own name")
        return self

    def answers_to(self, name: str) -> bool:
        """Whether a request's `model` names this model: its served name or one of its aliases."""
        return name == self.served_name or name in self.aliases

    @property
    def served_name(self) -> str:
        if self.name:
            return self.name
        src = self.source.rstrip("/")
        if src.startswith(BUILTIN_PREFIX):
            return src[len(BUILTIN_PREFIX) :]
        if is_single_file(src):  # a checkpoint file: its name without the suffix
            return src.rsplit("/", 1)[-1].rsplit(".", 1)[0]
        return src.rsplit("/", 1)[-1] if src.startswith(("/", ".")) else src


class Limits(_Strict):
    """Bounds on what one request may ask for; checked by the ingress before a replica sees it."""

    max_pixels: int = Field(1024 * 1024, ge=64, description="Upper bound on width * height.")
    max_side: int = Field(2048, ge=8, description="Upper bound on width and on height.")
    max_steps: int = Field(100, ge=1, description="Upper bound on denoising steps (and on lists in `extra`).")
    max_images: int = Field(8, ge=1, description="Upper bound on `n` (images per prompt).")
    max_frames: int = Field(129, ge=1, description="Upper bound on `num_frames` of a video model.")
    max_input_images: int = Field(
        4,
        ge=1,
        le=16,
        description="Upper bound on an edit's images, the reference images of models that take "
        "several (each scaled down to max_pixels and max_side).",
    )
    max_prompts: int = Field(16, ge=1, description="Upper bound on prompts in one batch request.")
    max_prompt_chars: int = Field(4000, ge=1, description="Upper bound on the characters of a prompt.")
    max_guidance_scale: float = Field(50.0, ge=0, description="Upper bound on `guidance_scale`.")
    max_body_bytes: int = Field(
        1024 * 1024, ge=1024, description="HTTP request bodies above this get 413 before they are parsed."
    )
    max_upload_bytes: int = Field(
        16 * 1024 * 1024,
        ge=1024,
        description="The same bound for requests that carry images: edits and videos.",
    )
    max_input_pixels: int = Field(
        4096 * 4096, ge=64, description="Upper bound on an input image's pixels, read from its header."
    )


class ModelEntry(_Strict):
    """One model of an application that serves several (`models:`); the sections it leaves out
    are the application's."""

    model: ModelConfig = Field(description="What this model loads and how it runs it.")
    limits: Limits | None = Field(None, description="Its own limits; unset: the application's.")
    replica: ReplicaConfig | None = Field(None, description="Its own replicas; unset: the application's.")
    batching: BatchingConfig | None = Field(None, description="Its own batching; unset: the application's.")
    multiplex: MultiplexSettings | None = Field(
        None, description="Make this model a pool of checkpoints served on demand."
    )


class Served(_Strict):
    """One model as it is deployed: its name and every section, resolved."""

    model: ModelConfig
    limits: Limits
    replica: ReplicaConfig
    batching: BatchingConfig
    multiplex: MultiplexSettings | None = None

    @property
    def name(self) -> str:
        return self.model.served_name


class AppConfig(_Strict):
    """The `args` of the Serve application (see serve_config.yaml).

    One model (`model:` with `limits:`, `replica:`, `batching:`), or several (`models:`, a list
    of entries that each hold a `model:` and the sections where they differ)."""

    model: ModelConfig = Field(
        default_factory=ModelConfig, description="The one model, when `models` is not given."
    )
    models: list[ModelEntry] = Field(
        default_factory=list, max_length=32, description="Several models behind one endpoint."
    )
    default_model: str | None = Field(
        None, description="The model of requests that name none; default: the first of `models`."
    )
    limits: Limits = Field(
        default_factory=Limits, description="Bounds on one request (each model's default)."
    )
    replica: ReplicaConfig = Field(
        default_factory=ReplicaConfig,
        description="The diffusion replicas' Serve options (each model's default).",
    )
    batching: BatchingConfig = Field(
        default_factory=BatchingConfig, description="How a replica batches (each model's default)."
    )
    multiplex: MultiplexSettings | None = Field(
        None, description="Make the one model (`model:`) a pool of checkpoints served on demand."
    )
    checkpoints: CheckpointsConfig = Field(
        default_factory=CheckpointsConfig, description="The pools' checkpoint registry."
    )
    tenants: list[TenantConfig] = Field(
        default_factory=list, max_length=1000, description="Who shares the service, and how."
    )
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters.")
    auth: AuthConfig = Field(default_factory=AuthConfig, description="API keys and the admin routes.")
    profiling: ProfilingConfig = Field(default_factory=ProfilingConfig, description="The torch profiler.")
    ingress: IngressConfig = Field(
        default_factory=IngressConfig, description="The ingress deployment's Serve options and retries."
    )
    jobs: JobsConfig = Field(
        default_factory=JobsConfig, description="Asynchronous jobs, stored outputs and webhooks."
    )
    result_cache: ResultCacheConfig = Field(
        default_factory=ResultCacheConfig, description="Results given again for repeated seeded requests."
    )

    @model_validator(mode="after")
    def _models(self) -> AppConfig:
        if self.models and {"model", "multiplex"} & self.model_fields_set:
            raise ValueError("give the models in `models:` or one model in `model:`, not both")
        names: dict[str, str] = {}
        for i, s in enumerate(self.served()):
            where = f"models[{i}]" if self.models else "model"
            _within_limits(s, where)
            for n in (s.name, *s.model.aliases):
                if n in names:
                    raise ValueError(f"{where}: the name {n!r} is taken by model {names[n]!r}")
                names[n] = s.name
        _check_tenants(self.tenants)
        if self.default_model is not None and self.default_model not in names:
            known = ", ".join(names)
            raise ValueError(f"default_model: {self.default_model!r} is none of the models ({known})")
        return self

    def served(self) -> list[Served]:
        """Every model as deployed, the default first."""
        if not self.models:
            one = Served(model=self.model, limits=self.limits, replica=self.replica, batching=self.batching,
                         multiplex=self.multiplex)  # fmt: skip
            return [one]
        out = [
            Served(
                model=e.model,
                limits=e.limits or self.limits,
                replica=e.replica or self.replica,
                batching=e.batching or self.batching,
                multiplex=e.multiplex,
            )
            for e in self.models
        ]
        if self.default_model is not None:
            first = next((s for s in out if s.model.answers_to(self.default_model)), None)
            if first is not None:  # else the validator says so
                out.remove(first)
                out.insert(0, first)
        return out

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> AppConfig:
        return cls.model_validate(args or {})


def _within_limits(s: Served, where: str) -> None:
    m, lim = s.model, s.limits
    for side in ("default_height", "default_width"):
        v = getattr(m, side)
        if v is not None and v > lim.max_side:
            raise ValueError(f"{where}.{side}={v} exceeds limits.max_side={lim.max_side}")
    if m.default_steps > lim.max_steps:
        raise ValueError(f"{where}.default_steps={m.default_steps} exceeds limits.max_steps={lim.max_steps}")
    if m.device == "cpu" and m.dtype == "float16":
        raise ValueError(f"{where}.dtype=float16 is not supported on CPU; use float32 or bfloat16")
    if m.device == "cpu" and m.optimizations.cpu_offload != "none":
        raise ValueError(f"{where}.optimizations.cpu_offload needs model.device cuda")
    check_speed(m, s.multiplex is not None, where)
    if m.parallel.world > 1:
        check_parallel(m, where)
        if s.multiplex is not None:
            raise ValueError(f"{where}.parallel: a pool (multiplex) runs on one rank; give it parallel.cfg 1")
        if m.optimizations.cpu_offload != "none":
            raise ValueError(
                f"{where}.parallel: not with optimizations.cpu_offload (each rank holds its model)"
            )


def _check_tenants(tenants: list[TenantConfig]) -> None:
    """Names unique, and no key in two tenants (the message names the tenants, never the key)."""
    owner: dict[str, str] = {}
    for i, t in enumerate(tenants):
        if t.name in [u.name for u in tenants[:i]]:
            raise ValueError(f"tenants[{i}].name: {t.name!r} is named twice")
        for key in t.api_keys:
            if key in owner and owner[key] != t.name:
                raise ValueError(f"tenants[{i}].api_keys: a key is in tenants {owner[key]!r} and {t.name!r}")
            owner[key] = t.name
