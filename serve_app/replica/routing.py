"""Adapter affinity: tell Serve's router which adapters this replica holds.

`@serve.multiplexed` reports the models it manages itself; our residency keeps pinned adapters
that it must never evict, so it reports through the same call. That call needs
`RequestRoutingInfo`, which Serve does not export: this module is the only place that imports
it, and tests/test_routing.py fails loudly if Ray moves or changes it.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("ray.serve")


def routing_info_class():
    """Serve's private record of a replica's routing facts (multiplexed model ids)."""
    from ray.serve._private.common import RequestRoutingInfo

    return RequestRoutingInfo


def report_adapters(model_ids: list[str]) -> None:
    """Requests naming one of `model_ids` go preferably to this replica."""
    try:
        from ray import serve
        from ray.serve.context import _get_global_client

        ctx = serve.get_replica_context()
        info = routing_info_class()(replica_id=ctx.replica_id, multiplexed_model_ids=model_ids)
        _get_global_client().record_request_routing_info(info)
    except Exception as e:  # outside Serve: routing just loses affinity
        logger.debug("could not report adapters for routing: %s", e)


def replica_id() -> str:
    """This replica's id in Serve ("local" outside Serve: tests that drive a replica directly)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:
        return "local"
