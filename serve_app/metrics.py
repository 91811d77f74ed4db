"""Prometheus metrics through Ray's metrics API (exported by each node's metrics agent).

Ray prefixes every name with `ray_`, so `diffusion_images_total` is scraped as
`ray_diffusion_images_total`. The objects are made once per process, on first use.
"""

from __future__ import annotations

from functools import cache

_MS_BUCKETS = [5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000]
_BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64]


@cache
def _m():
    from ray.util import metrics

    return {
        "requests": metrics.Counter(
            "diffusion_requests_total", "Generation requests by outcome.", tag_keys=("model", "outcome")
        ),
        "images": metrics.Counter(
            "diffusion_images_total", "Images by outcome.", tag_keys=("model", "outcome")
        ),
        "stage_ms": metrics.Histogram(
            "diffusion_stage_latency_ms",
            "Time per request in each stage (queue, text_encode, denoise, vae_decode, image_encode, total).",
            boundaries=_MS_BUCKETS,
            tag_keys=("model", "stage"),
        ),
        "batch_images": metrics.Histogram(
            "diffusion_batch_images",
            "Images per pipeline call.",
            boundaries=_BATCH_BUCKETS,
            tag_keys=("model",),
        ),
        "queue_length": metrics.Gauge(
            "diffusion_queue_length", "Queued plus running images on a replica.", tag_keys=("model",)
        ),
        "cache": metrics.Counter(
            "diffusion_result_cache_total",
            "Requests the result cache could answer, by outcome (hit, miss, bypass).",
            tag_keys=("model", "outcome"),
        ),
        "cache_bytes": metrics.Gauge(
            "diffusion_result_cache_bytes", "Bytes of results an ingress replica keeps.", tag_keys=()
        ),
        "flagged": metrics.Counter(
            "diffusion_safety_flagged_total", "Images the safety checker flagged.", tag_keys=("model",)
        ),
        "retries": metrics.Counter(
            "diffusion_retries_total", "Requests sent again because their replica died.", tag_keys=("model",)
        ),
        "lora_loads": metrics.Counter(
            "diffusion_lora_loads_total",
            "Adapters loaded onto a replica (one loaded again after an eviction counts again).",
            tag_keys=("model",),
        ),
        "tenant_images": metrics.Counter(
            "diffusion_tenant_images_total", "Images made, by tenant.", tag_keys=("model", "tenant")
        ),
        "tenant_requests": metrics.Gauge(
            "diffusion_tenant_requests",
            "A tenant's requests on a replica, by state (queued, running).",
            tag_keys=("model", "tenant", "state"),
        ),
        "tenant_wait_ms": metrics.Histogram(
            "diffusion_tenant_queue_wait_ms",
            "Time a tenant's requests waited in a replica's queue.",
            boundaries=_MS_BUCKETS,
            tag_keys=("model", "tenant"),
        ),
        "preemptions": metrics.Counter(
            "diffusion_preemptions_total",
            "Calls paused at a step boundary for requests of a higher priority.",
            tag_keys=("model",),
        ),
        "priority_wait_ms": metrics.Histogram(
            "diffusion_priority_queue_wait_ms",
            "Time requests waited in a replica's queue, by priority level (0-9).",
            boundaries=_MS_BUCKETS,
            tag_keys=("model", "priority"),
        ),
        "tenant_rejected": metrics.Counter(
            "diffusion_tenant_quota_rejected_total",
            "Requests refused by a tenant quota, by the limit.",
            tag_keys=("tenant", "limit"),
        ),
        "rejected": metrics.Counter(
            "diffusion_rejected_total",
            "Requests refused before a replica ran them.",
            tag_keys=("model", "reason"),
        ),
    }


def count_request(model: str, outcome: str, images: int) -> None:
    m = _m()
    m["requests"].inc(1, {"model": model, "outcome": outcome})
    m["images"].inc(images, {"model": model, "outcome": outcome})


def observe_stages(model: str, stages_ms: dict[str, float]) -> None:
    h = _m()["stage_ms"]
    for stage, ms in stages_ms.items():
        h.observe(ms, {"model": model, "stage": stage})


def observe_batch(model: str, images: int) -> None:
    _m()["batch_images"].observe(images, {"model": model})


def set_queue_length(model: str, n: int) -> None:
    _m()["queue_length"].set(n, {"model": model})


def count_lora_load(model: str) -> None:
    _m()["lora_loads"].inc(1, {"model": model})


def count_cache(model: str, outcome: str, kept_bytes: int) -> None:
    m = _m()
    m["cache"].inc(tags={"model": model, "outcome": outcome})
    m["cache_bytes"].set(kept_bytes)


def count_flagged(model: str, images: int) -> None:
    _m()["flagged"].inc(images, tags={"model": model})


def count_retry(model: str) -> None:
    _m()["retries"].inc(1, {"model": model})


def count_rejected(model: str, reason: str) -> None:
    _m()["rejected"].inc(1, {"model": model, "reason": reason})


def tenant_load(model: str, tenant: str, queued: int, running: int) -> None:
    g = _m()["tenant_requests"]
    g.set(queued, {"model": model, "tenant": tenant, "state": "queued"})
    g.set(running, {"model": model, "tenant": tenant, "state": "running"})


def tenant_done(model: str, tenant: str, images: int, wait_ms: float) -> None:
    m = _m()
    m["tenant_images"].inc(images, {"model": model, "tenant": tenant})
    m["tenant_wait_ms"].observe(wait_ms, {"model": model, "tenant": tenant})


def count_preemption(model: str) -> None:
    _m()["preemptions"].inc(1, {"model": model})


def priority_waited(model: str, priority: int, wait_ms: float) -> None:
    _m()["priority_wait_ms"].observe(wait_ms, {"model": model, "priority": str(priority)})


def tenant_rejected(tenant: str, limit: str) -> None:
    _m()["tenant_rejected"].inc(1, {"tenant": tenant, "limit": limit})
