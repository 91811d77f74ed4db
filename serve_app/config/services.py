"""The settings of the services around the models: adapters, checkpoints, keys, profiling and
jobs. Part of the one configuration (`serve_app.config`); no torch or diffusers here."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    WithJsonSchema,
    field_validator,
    model_validator,
)


class _Strict(BaseModel):
    # A bad value is named, never echoed: the settings hold API keys.
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)


class LoraConfig(_Strict):
    """LoRA adapters: where the registry lives, which files may be loaded, how many per replica."""

    registry_path: str = Field(
        "~/.cache/diffusion-serve/loras.json",
        description="The persisted registry (JSON): a local path or any fsspec URL (s3://, gs://, ...); "
        "on several machines, one they all share.",
    )
    allowed_roots: list[str] = Field(
        default_factory=list, description="Directories adapter files must resolve into; empty: no adapters."
    )
    max_file_mb: float = Field(512.0, gt=0, description="Largest adapter file (MB) that may be registered.")

    @field_validator("allowed_roots")
    @classmethod
    def _absolute_roots(cls, v: list[str]) -> list[str]:
        # Resolved where the app is built (`serve run`'s directory), not in each replica's cwd.
        return [str(Path(r).expanduser().resolve()) for r in v]

    max_loaded: int = Field(
        4, ge=1, description="Adapters one replica holds; least recently used evicted first."
    )
    max_loaded_mb: float | None = Field(
        None,
        gt=0,
        description="Size of the adapter weights one replica holds (MiB, as read from their files); "
        "least recently used evicted to stay under it, pinned ones never. None: only max_loaded counts.",
    )
    max_per_request: int = Field(4, ge=1, description="Adapters one request may stack (`loras`).")

    @model_validator(mode="after")
    def _room_for_a_request(self):
        if self.max_per_request > self.max_loaded:
            raise ValueError(
                f"lora.max_per_request={self.max_per_request} exceeds lora.max_loaded={self.max_loaded}: "
                "a replica must hold every adapter of a request at once"
            )
        return self


class AuthConfig(_Strict):
    """API keys. With no user or admin key set, generation is open to everyone (a local service);
    the admin routes (adapters, profiling, RPC) are closed unless an admin key is configured or
    `local_admin` is on.

    Keys come from here or from the environment of the ingress's process (comma-separated):
    `DIFFUSION_API_KEYS` for users, `DIFFUSION_ADMIN_KEYS` for admins. With any key set, every
    route except `/health`, `/live` and the playground page needs `Authorization: Bearer <key>`.
    Handle callers are other Ray apps inside the cluster and are not asked for keys.
    """

    api_keys: list[str] = Field(
        default_factory=list,
        repr=False,
        description="User keys: they may use every route but the admin ones.",
    )
    admin_keys: list[str] = Field(
        default_factory=list, repr=False, description="Admin keys: every route, the admin ones included."
    )
    api_keys_env: str = Field(
        "DIFFUSION_API_KEYS",
        description="Environment variable of the ingress with more user keys (comma-separated).",
    )
    admin_keys_env: str = Field(
        "DIFFUSION_ADMIN_KEYS",
        description="Environment variable of the ingress with more admin keys (comma-separated).",
    )
    local_admin: bool = Field(
        False,
        description="With no admin key configured, let clients connecting from a loopback address "
        "(this machine) use the admin routes without a key. For a local demo only: behind a reverse "
        "proxy on the same machine every client looks local.",
    )


class ProfilingConfig(_Strict):
    trace_dir: str = Field(
        "~/.cache/diffusion-serve/traces", description="Where each replica writes its torch profiler trace."
    )


class JobsConfig(_Strict):
    """Asynchronous jobs and stored outputs: where they live, how long, and their webhooks."""

    store: str = Field(
        "~/.cache/diffusion-serve/store",
        description="Where job records and outputs live: a directory, or any fsspec URL (s3://, "
        "gs://, a shared file system) so that every ingress replica on every node sees them.",
    )
    retention_s: float = Field(
        86400.0, gt=0, description="Finished jobs and stored outputs older than this go."
    )
    max_store_mb: float = Field(
        10240.0, gt=0, description="Above this total, the oldest finished jobs and outputs go first."
    )
    url_ttl_s: float = Field(3600.0, gt=0, description="How long a `response_format: url` link works.")
    url_secret_env: str = Field(
        "DIFFUSION_URL_SECRET",
        description="Environment variable holding the key that signs output URLs; unset: a random key "
        "kept in the store, shared by every ingress that uses it.",
    )
    public_url: str | None = Field(
        None, description="Base of the URLs handed out (behind a proxy); default: the request's own."
    )
    lease_s: float = Field(
        15.0,
        gt=0,
        description="A running job whose ingress has not renewed it this long is resumed by another.",
    )
    sweep_interval_s: float = Field(2.0, gt=0, description="How often an ingress renews, resumes and prunes.")
    max_resumes: int = Field(
        3, ge=0, description="Times a job is taken over after its ingress went away; then it fails."
    )
    webhook_hosts: list[str] = Field(
        default_factory=list,
        description="Hosts webhooks may call; empty: any host except loopback, private and link-local.",
    )
    webhook_secret: str | None = Field(
        None, repr=False, description="The HMAC key that signs webhook calls (or the variable below)."
    )
    webhook_secret_env: str = Field(
        "DIFFUSION_WEBHOOK_SECRET", description="Environment variable with the HMAC key of webhook calls."
    )
    max_queued_per_caller: int = Field(
        16,
        ge=1,
        description="Unfinished jobs one caller (one API key; all callers without a key are one) may "
        "have on one ingress replica; one more is a 429 with Retry-After.",
    )
    max_queued: int = Field(
        64, ge=1, description="Unfinished jobs of all callers on one ingress replica; one more is a 429."
    )
    max_running: int = Field(
        8,
        ge=1,
        description="Jobs one ingress replica has sent to the engine replicas at once; the others wait "
        "in the ingress (state queued), so a backlog of jobs stands before an interactive request "
        "by at most this many.",
    )
    webhook_max_attempts: int = Field(5, ge=1, le=20, description="Tries of a job's completion call.")
    webhook_backoff_s: float = Field(1.0, gt=0, description="First retry delay; doubles each retry.")
    webhook_timeout_s: float = Field(10.0, gt=0, description="How long one webhook call may take.")


class ResultCacheConfig(_Strict):
    """Results kept by the ingress and given again for a repeated request (`docs/operating.md`)."""

    enabled: bool = Field(
        False,
        description="Answer a request with a seed whose every input equals an earlier one's from that "
        "one's stored result (the OpenAI JSON routes and handle calls).",
    )
    max_bytes: int = Field(
        256 * 2**20,
        ge=0,
        description="Bytes of results kept per ingress replica; the least recently used go first.",
    )
    max_entry_bytes: int = Field(
        32 * 2**20, ge=0, description="A larger result (a long video, a trajectory) is not kept."
    )
    shared_across_tenants: bool = Field(
        False, description="Whether one tenant's request may be answered with another tenant's result."
    )


class CheckpointsConfig(_Strict):
    """Where the checkpoint registry of the pools lives and which checkpoints may be registered."""

    registry_path: str = Field(
        "~/.cache/diffusion-serve/checkpoints.json",
        description="The persisted registry (JSON): a local path or any fsspec URL.",
    )
    allowed_roots: list[str] = Field(
        default_factory=list, description="Directories checkpoints must resolve into; empty: none."
    )
    allow_hub: bool = Field(
        False, description="Also accept Hugging Face hub ids (downloaded by the replicas)."
    )

    @field_validator("allowed_roots")
    @classmethod
    def _absolute_roots(cls, v: list[str]) -> list[str]:
        return [str(Path(r).expanduser().resolve()) for r in v]


TENANT_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"

# A request's priority: a name or a level 0-9, higher first. Asynchronous jobs default to
# `batch`, other requests to `interactive`.
PRIORITIES = {"batch": 0, "interactive": 5}


def _priority(value: object) -> str | int:
    if isinstance(value, str) and value in PRIORITIES:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 9:
        return value
    raise ValueError("must be `batch`, `interactive` or a whole number 0-9")


Priority = Annotated[
    str | int,
    PlainValidator(_priority),
    WithJsonSchema({"anyOf": [{"enum": list(PRIORITIES)}, {"type": "integer", "minimum": 0, "maximum": 9}]}),
]


def priority_level(priority: Priority) -> int:
    """The level of a priority given by name or number."""
    return PRIORITIES[priority] if isinstance(priority, str) else priority


class TenantConfig(_Strict):
    """A named group of user keys that shares the service as one: its weight in each replica's
    fair queue, and its quotas (each counted per ingress replica). Requests without a key are
    the tenant `default` (configure one by that name to give it limits); a key in no tenant is
    a tenant of its own, of weight 1 and no quotas."""

    name: str = Field(
        pattern=f"^{TENANT_NAME}$",
        description="1-64 letters, digits, '.', '_' or '-'; `default`: requests without a key.",
    )
    api_keys: list[str] = Field(default_factory=list, repr=False, description="Its user keys.")
    api_keys_env: str | None = Field(
        None, description="Environment variable of the ingress with more of its keys (comma-separated)."
    )
    weight: float = Field(
        1.0, gt=0, le=1000, description="Its share of a replica against other backlogged tenants."
    )
    max_priority: Priority = Field(
        "interactive",
        description="The highest `priority` its requests may ask for (`batch`, `interactive` or 0-9; "
        "higher runs first and may pause a running call of a lower one); above it: 400.",
    )
    max_concurrent: int | None = Field(
        None,
        ge=1,
        le=100_000,
        description="Its requests in flight at once (running jobs included); one more: 429.",
    )
    max_queued: int | None = Field(
        None, ge=0, le=100_000, description="Its asynchronous jobs waiting to run; one more: 429."
    )
    images_per_minute: float | None = Field(None, gt=0, le=1e6, description="A rate of images; past it: 429.")
    image_steps_per_minute: float | None = Field(
        None, gt=0, le=1e9, description="A rate of images times their denoising steps; past it: 429."
    )
