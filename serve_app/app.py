"""The application builder: what `import_path: serve_app.app:build_app` in a Serve config points at.

`args` are validated here, once, by `AppConfig`; a bad config fails `serve run` / `serve deploy`
with a message that names the field, before any replica starts.
"""

from __future__ import annotations

import re
from typing import Any

from ray.serve import Application

from serve_app.config import AppConfig, Served
from serve_app.engine.engine import engine_class, scheduler_class
from serve_app.ingress.deployment import DiffusionIngressDeployment
from serve_app.replica import DiffusionReplicaDeployment
from serve_app.replica.parallel import bundles


def build_app(args: dict[str, Any] | AppConfig | None = None) -> Application:
    cfg = args if isinstance(args, AppConfig) else AppConfig.from_args(args)
    served = cfg.served()
    replicas = {s.name: _replica_app(s, cfg, deployment_name(s, len(served)), served[0].name) for s in served}
    ing = cfg.ingress
    return DiffusionIngressDeployment.options(
        num_replicas=ing.num_replicas,
        ray_actor_options={"num_cpus": ing.num_cpus, "resources": ing.resources},
        max_ongoing_requests=ing.max_ongoing_requests,
        # An ingress replica being replaced (redeploy, scale-down) keeps answering what it holds:
        # no accepted request outlives its deadline, so draining that long loses none.
        graceful_shutdown_timeout_s=ing.request_timeout_s,
    ).bind(replicas, cfg)


def deployment_name(s: Served, models: int) -> str:
    """`DiffusionReplica` for an application of one model; else one deployment per model,
    named after it (Serve's names take no '/' or '#')."""
    if models == 1:
        return "DiffusionReplica"
    return "DiffusionReplica-" + re.sub(r"[^A-Za-z0-9._-]", "_", s.name)


def _replica_app(s: Served, cfg: AppConfig, name: str, default_model: str) -> Application:
    if s.model.scheduler:
        scheduler_class(s.model.scheduler)
    if s.model.engine_extension:
        engine_class(s.model.engine_extension)
    r = s.replica
    scaling = {"num_replicas": r.num_replicas}
    if r.autoscaling is not None:
        scaling = {"num_replicas": "auto", "autoscaling_config": r.autoscaling.serve_config()}
    if s.model.parallel.world > 1:  # one bundle per rank, on one node; the replica sits in the first
        scaling["placement_group_bundles"] = bundles(s.model, r)
        scaling["placement_group_strategy"] = "STRICT_PACK"
    return DiffusionReplicaDeployment.options(
        name=name,
        **scaling,
        ray_actor_options={"num_gpus": r.num_gpus, "num_cpus": r.num_cpus, "resources": r.resources},
        max_ongoing_requests=r.max_ongoing_requests,
        max_queued_requests=r.max_queued_requests,
        health_check_period_s=r.health_check_period_s,
        health_check_timeout_s=r.health_check_timeout_s,
        graceful_shutdown_timeout_s=r.graceful_shutdown_timeout_s,
        max_constructor_retry_count=r.max_constructor_retry_count,
        user_config=s.batching.model_dump(),
    ).bind(  # batching: user_config
        s.model,
        replica=r,
        lora=cfg.lora,
        profiling=cfg.profiling,
        multiplex=s.multiplex,
        checkpoints=cfg.checkpoints,
        default_model=default_model,
    )
