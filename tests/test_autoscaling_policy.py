"""The queue-length policy alone (a pure function of what the replicas report)."""

from __future__ import annotations

from types import SimpleNamespace

from serve_app.autoscaling import QUEUE_LENGTH_METRIC, QueueLengthPolicy


def ctx(per_replica: dict | None, current: int = 2, requests: float = 50):
    metrics = {QUEUE_LENGTH_METRIC: per_replica} if per_replica is not None else {}
    return SimpleNamespace(
        aggregated_metrics=metrics, current_num_replicas=current, total_num_requests=requests
    )


def test_replicas_follow_the_reported_queue_length():
    policy = QueueLengthPolicy(target_queue_length=4)
    assert policy(ctx({"r1": 9.0, "r2": 3.0}))[0] == 3  # 12 images / 4
    assert policy(ctx({"r1": 0.0, "r2": 0.0}))[0] == 0
    assert policy(ctx({"r1": 1.0}))[0] == 1


def test_without_the_metric_nothing_moves():
    # Serve's own request count (50 here) must not stand in for a metric that is missing:
    # a broken metric would then go unnoticed, and requests are not images.
    assert QueueLengthPolicy(4)(ctx(None, current=2))[0] == 2
    assert QueueLengthPolicy(4)(ctx({}, current=3))[0] == 3
