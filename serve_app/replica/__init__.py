"""The diffusion replica (one Ray actor, one GPU), by role:

* `deployment.py`: the Serve deployment; wires the parts below and holds the Serve entry points.
* `intake.py`: a request checked against the engine and made a queued job (its rows, its call).
* `loop.py`: the engine loop: runs each batch as one call or a joined one and answers it.
* `scheduler.py`: the queue: which requests share a pipeline call and when (no Ray, no torch).
* `adapters.py`: which LoRA adapters this replica holds (load, LRU eviction, pins).
* `health.py`: whether the replica can serve, and what a failed pipeline call means.
* `results.py`: step events and results sent back to the ingress.
* `control.py`: profiling and collective RPC, answered per replica.
* `routing.py`: tells Serve's router which adapters this replica holds.
"""

from serve_app.replica.deployment import DiffusionReplica, DiffusionReplicaDeployment

__all__ = ["DiffusionReplica", "DiffusionReplicaDeployment"]
