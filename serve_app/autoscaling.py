"""Queue-length autoscaling: the role the coordinator heartbeat's `queue_length` played.

Each replica reports its queue length (queued plus running images) through Serve's
`record_autoscaling_stats`; this policy asks for enough replicas that each holds about
`target_queue_length` images. Serve's wrapper applies min/max replicas and the up/down delays.
Images, not requests, are the unit: one request for 8 images loads a GPU like 8 requests for one.
"""

from __future__ import annotations

import math
from typing import Any

QUEUE_LENGTH_METRIC = "queue_length"


class QueueLengthPolicy:
    def __init__(self, target_queue_length: float = 4.0):
        if target_queue_length <= 0:
            raise ValueError("target_queue_length must be > 0")
        self.target = float(target_queue_length)

    def __call__(self, ctx) -> tuple[int, dict[str, Any]]:
        per_replica = (ctx.aggregated_metrics or {}).get(QUEUE_LENGTH_METRIC) or {}
        if not per_replica:
            # No replica has reported its queue yet (starting up): keep what there is. Serve's
            # own request count would hide a broken metric, and it counts requests, not images.
            return ctx.current_num_replicas, {"total_queue_length": None}
        total = float(sum(per_replica.values()))
        desired = math.ceil(total / self.target) if total > 0 else 0
        return desired, {"total_queue_length": total}
