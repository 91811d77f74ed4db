"""The control plane's bodies and answers: status (`ReplicaStats`, `StatusResponse`), a request's
state and its abort, adapters (`LoraAdd`, `LoraPin`), and the calls made on every replica
(profiling, RPC) with each replica's `Outcome`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from serve_app.schemas.base import _Wire, rules

# Names as the document states them (ECMA-262, which Python's re reads the same; fullmatch them):
# an adapter's (`registries.NAME_PATTERN`), a checkpoint's (`registries.CHECKPOINT_NAME`: not a path,
# so not `.`, `..` or any name starting with a dot), a trace file's prefix.
LORA_NAME_REGEX = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
CHECKPOINT_NAME_REGEX = r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$"
TRACE_PREFIX_REGEX = r"^[A-Za-z0-9._-]{1,64}$"


class ReplicaStats(BaseModel):
    """What one replica reports of itself in `GET /v1/status`."""

    replica_id: str
    node_id: str | None = None
    queued_requests: int
    queued_images: int
    running_requests: int
    running_images: int
    healthy: bool
    health_problem: str | None = None
    rss_mb: float
    batching: dict[str, Any]
    loras_loaded: list[str]
    loras_loaded_mb: float = 0.0
    engine_failures_in_a_row: int
    counts: dict[str, int]
    model: str = ""
    tenants: dict[str, dict[str, int]] = Field(
        default_factory=dict,
        description="Per tenant: queued and running requests and images, images done, queue wait (ms).",
    )
    checkpoints_held: list[str] = Field(
        default_factory=list, description="A pool's registered checkpoints this replica holds."
    )
    ranks: list[dict[str, Any]] = Field(
        default_factory=list,
        description="A parallel replica's ranks (`model.parallel`), rank 0 first: its process id, node, "
        "denoiser calls run split so far and, with ulysses or ring, the tokens its share of the last "
        "call held (the workers' as of the last health check).",
    )
    fast_path: dict[str, Any] | None = Field(
        None,
        description="Under `model.optimizations.speed: max`: the compile mode, the shapes compiled before "
        "traffic (`warmed_shapes`, and the rows each compiled module was warmed at), calls run "
        "compiled and uncompiled, the compile cache's outcome, float8 and the attention backend.",
    )


class ModelStatus(BaseModel):
    """One model's replicas in `GET /v1/status`."""

    model: str
    ready: bool
    replicas: list[ReplicaStats]
    queue_length: int
    error: str | None = None


class TenantStatus(BaseModel):
    """One tenant in `GET /v1/status`: over every replica, and this ingress's quota counts."""

    tenant: str
    weight: float
    queued_requests: int = 0
    running_requests: int = 0
    queued_images: int = 0
    running_images: int = 0
    images_done: int = 0
    queue_wait_ms_mean: float = 0.0
    in_flight: int = Field(0, description="Its requests in flight through this ingress.")
    rejected: dict[str, int] = Field(default_factory=dict, description="Refused by each quota, here.")


class StatusResponse(BaseModel):
    model: str = Field(description="The default model.")
    replicas: list[ReplicaStats] = Field(description="Every model's replicas (each says its model).")
    queue_length: int
    models: list[ModelStatus] = Field(default_factory=list)
    tenants: list[TenantStatus] = Field(
        default_factory=list, description="Every tenant (the admin, an open service) or the caller's own."
    )


class RequestState(_Wire):
    """Where a request is: queued (with position), running (step i of n), done, aborted or failed."""

    request_id: str
    state: Literal["queued", "running", "done", "aborted", "failed"]
    queue_position: int | None = None
    step: int = 0
    total_steps: int = 0
    images: int | None = None
    error: str | None = None
    replica_id: str | None = None


class AbortResponse(BaseModel):
    request_id: str
    result: Literal["aborted", "finished", "unknown"]
    message: str


class LoraAdd(_Wire):
    """Body of `POST /v1/loras`."""

    model_config = ConfigDict(
        json_schema_extra=rules(
            ("path", "a .safetensors file (or a PEFT adapter directory) inside lora.allowed_roots, of at "
             "most lora.max_file_mb, of the model's family"),
            ("name", "not already registered"),
            ("pinned", "at most lora.max_loaded adapters pinned"),
        )
    )  # fmt: skip

    name: str = Field(
        description="1-64 letters, digits, '.', '_' or '-', starting with a letter or digit.",
        json_schema_extra={"pattern": LORA_NAME_REGEX},
    )
    path: str = Field(description="A .safetensors file inside one of the configured lora.allowed_roots.")
    scale: float = Field(1.0, ge=-10, le=10)
    pinned: bool = False
    model: str | None = Field(
        None, max_length=256, description="The model it serves (and no other); default: the default model."
    )


class CheckpointAdd(_Wire):
    """Body of `POST /v1/checkpoints`: a checkpoint a pool serves by name, loaded on demand."""

    model_config = ConfigDict(
        json_schema_extra=rules(
            ("source", "a diffusers directory or a single .safetensors file inside checkpoints.allowed_roots "
             "(or a hub id where checkpoints.allow_hub is on), of the pool's family"),
            ("pool", "a model served as a pool (`multiplex:`); without `pool`, the only one"),
            ("name", "no model's name and not already registered"),
            ("pinned", "at most the pool's multiplex.max_models_per_replica pinned"),
        )
    )  # fmt: skip

    name: str = Field(
        max_length=128,
        description="What requests give as `model`: 1-128 letters, digits, '.', '_' or '-', not starting "
        "with '.' (a name is not a path: never `.` or `..`).",
        json_schema_extra={"pattern": CHECKPOINT_NAME_REGEX},
    )
    source: str = Field(
        max_length=4096,
        description="A diffusers directory (safetensors weights) or a single-file checkpoint (one "
        ".safetensors file, Stable Diffusion 1.x, SDXL or FLUX layout) inside "
        "checkpoints.allowed_roots, or a hub id where checkpoints.allow_hub is on.",
    )
    pool: str | None = Field(None, max_length=256, description="The pool model; default: the only pool.")
    pinned: bool = False


class LoraPin(_Wire):
    pinned: bool = True


class ProfileStart(_Wire):
    prefix: str = Field(
        "trace",
        description="Trace files are named <prefix>-<replica id>-<time>.json.",
        json_schema_extra={"pattern": TRACE_PREFIX_REGEX},
    )


class RpcCall(_Wire):
    """Body of `POST /v1/rpc`: call an engine (or worker extension) method on every replica."""

    model_config = ConfigDict(
        json_schema_extra=rules(("method", "one the engine exports (the 400 lists them)"))
    )

    method: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = Field(None, gt=0)


class Outcome(BaseModel):
    """One replica's answer to a call made on every replica (profiling, RPC)."""

    replica_id: str
    ok: bool
    result: Any = None
    error: str | None = None
