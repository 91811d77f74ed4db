"""The Serve options of the two deployments: the diffusion replicas (their count or autoscaling,
resources, health and timeouts), how a replica batches, the ingress, and a pool's multiplexing.
Part of the one configuration (`serve_app.config`); no torch or diffusers here."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from serve_app.config.services import _Strict


class AutoscalingSettings(_Strict):
    """Queue-length autoscaling of the diffusion replicas (serve_app/autoscaling.py)."""

    min_replicas: int = Field(1, ge=0, description="Fewest replicas (the first start runs at least one).")
    max_replicas: int = Field(4, ge=1, description="Most replicas.")
    target_queue_length: float = Field(4.0, gt=0, description="Queued plus running images per replica.")
    upscale_delay_s: float = Field(
        10.0, ge=0, description="How long Serve must want more replicas before it adds them."
    )
    downscale_delay_s: float = Field(
        120.0, ge=0, description="How long Serve must want fewer replicas before it removes them."
    )
    metrics_interval_s: float = Field(
        2.0, gt=0, description="How often each replica reports its queue length."
    )
    look_back_period_s: float = Field(
        10.0, gt=0, description="The window over which Serve averages the reported queue lengths."
    )

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingSettings:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas={self.min_replicas} exceeds max_replicas={self.max_replicas}")
        return self

    def serve_config(self) -> dict[str, Any]:
        return {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "initial_replicas": max(1, self.min_replicas),
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
            "metrics_interval_s": self.metrics_interval_s,
            "look_back_period_s": self.look_back_period_s,
            "policy": {
                "policy_function": "serve_app.autoscaling:QueueLengthPolicy",
                "policy_kwargs": {"target_queue_length": self.target_queue_length},
            },
        }


class ReplicaConfig(_Strict):
    """Serve options of the diffusion replica deployment (one replica per GPU)."""

    num_replicas: int = Field(1, ge=1, description="Fixed replica count; ignored when `autoscaling` is set.")
    autoscaling: AutoscalingSettings | None = Field(
        None, description="Queue-length autoscaling; unset: a fixed `num_replicas`."
    )
    num_gpus: float = Field(0, ge=0, description="1 on a GPU machine: one replica per GPU.")
    num_cpus: float = Field(0, ge=0, description="CPUs Ray reserves for each replica.")
    resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources to place replicas."
    )
    max_ongoing_requests: int = Field(
        16,
        ge=1,
        description="Requests one replica holds at once (queued and running); more wait in Serve's "
        "router, first come.",
    )
    max_queued_requests: int = Field(
        -1,
        ge=-1,
        description="Requests waiting for a replica slot beyond which callers get 429; -1: no bound.",
    )
    engine_call_timeout_s: float = Field(
        900.0, gt=0, description="A pipeline call running longer than this marks the replica unhealthy."
    )
    health_check_period_s: float = Field(10.0, gt=0, description="How often Serve checks a replica's health.")
    health_check_timeout_s: float = Field(
        30.0, gt=0, description="A health check unanswered this long counts as failed."
    )
    graceful_shutdown_timeout_s: float = Field(
        60.0, ge=0, description="How long a leaving replica may finish what it accepted."
    )
    max_constructor_retry_count: int = Field(
        3, ge=1, description="Failed model loads before the deployment is marked failed."
    )
    max_consecutive_failures: int = Field(
        5,
        ge=1,
        description="Engine failures in a row after which the replica runs a self-test call; it reports "
        "itself unhealthy only if that fails too (requests alone never make a replica unhealthy).",
    )
    init_timeout_s: float = Field(
        1800.0, gt=0, description="Model load plus warm-up longer than this fails the replica's start."
    )


class BatchingConfig(_Strict):
    """How a replica gathers queued requests into one pipeline call.

    Sent to the replicas as Serve's `user_config`, which `reconfigure` applies on a live replica.
    (A changed `args:` block in a Serve config is a new app version: Serve restarts every replica.)
    """

    max_batch_images: int = Field(8, ge=1, description="Upper bound on images in one pipeline call.")
    batch_wait_ms: float = Field(
        50.0,
        ge=0,
        description=(
            "How long a call may wait for others to join it: at most this long after its oldest "
            "request arrived, or after the device became free if that was later."
        ),
    )
    batch_gap_ms: float = Field(
        10.0,
        ge=0,
        description=(
            "Stop waiting early once no request has arrived for this long: a lone request waits "
            "this, a burst is gathered whole. 0: always wait the full batch_wait_ms."
        ),
    )
    step_joining: bool | None = Field(
        None,
        description=(
            "Requests that arrive while a call runs join it at its next denoising step instead of "
            "waiting for it to end (continuous batching): the requests that join at one step run "
            "one pipeline call of their own, and all the calls share the denoiser at every step, "
            "rows at different steps included. Requests with a step cache (acceleration), on a "
            "compiled or CPU-offloaded denoiser, of a pool's checkpoints or larger than "
            "max_batch_images run in whole calls. null: on where the model runs on a GPU (a "
            "fuller step costs little more there), whole calls on a CPU; true/false: anywhere."
        ),
    )

    encode_ahead: bool = Field(
        True,
        description=(
            "With step joining: a request handed over to join a running call has its prompts "
            "encoded on a thread of its own while the call's current step is on the device, "
            "instead of on the engine thread between two steps while the device waits."
        ),
    )

    rows_kept_for_others: int = Field(
        1,
        ge=0,
        description=(
            "With step joining and tenants: rows of a running call that one tenant may not take "
            "while another tenant has a request queued or running, or sent one in the last "
            "10 seconds, so that tenant's next request joins at the next step instead of waiting "
            "for the call's rows to free up. 0: a tenant may fill the call. Never more than "
            "max_batch_images - 1."
        ),
    )

    preempt_after_ms: float | None = Field(
        100.0,
        ge=0,
        description=(
            "How long a request may wait behind a running call of a lower priority (`priority`: a "
            "batch job behind which an interactive image waits) before that call pauses at its next "
            "denoising step, the waiting request runs, and the paused call resumes where it stopped "
            "(the same images as unpaused); in a full joined run, seats of lower-priority requests are "
            "parked instead. Calls with a step cache, on a compiled or CPU-offloaded denoiser, or with "
            "different adapters per row are not paused, nor for a request of another pool checkpoint. "
            "null: never."
        ),
    )

    def joins_on(self, device_type: str) -> bool:
        """Whether step joining is on for a model on a device of `device_type` ("cuda", "cpu")."""
        return self.step_joining if self.step_joining is not None else device_type == "cuda"


class IngressConfig(_Strict):
    num_replicas: int = Field(1, ge=1, description="Ingress replicas (HTTP and the Python API).")
    max_attempts: int = Field(
        3,
        ge=1,
        description="Tries of a request whose replica died (generation with a fixed seed is idempotent).",
    )
    retry_after_s: int = Field(2, ge=1, description="`Retry-After` of a 429 answer.")
    num_cpus: float = Field(0, ge=0, description="CPUs Ray reserves for each ingress replica.")
    resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources to place the ingress (e.g. on the head)."
    )
    max_ongoing_requests: int = Field(256, ge=1, description="Requests one ingress replica holds at once.")
    request_timeout_s: float = Field(600.0, gt=0, description="Deadline for one request end to end.")
    ready_probe_timeout_s: float = Field(
        3.0, gt=0, description="How long /health waits for the replicas to say whether they are ready."
    )


class MultiplexSettings(_Strict):
    """A pool: besides its own model, its replicas serve any checkpoint registered for it
    (`POST /v1/checkpoints`), loaded on demand with Serve's model multiplexing."""

    max_models_per_replica: int = Field(
        2, ge=1, le=64, description="Registered checkpoints one replica holds besides its own model; "
        "least recently used evicted first, pinned ones never."
    )  # fmt: skip
