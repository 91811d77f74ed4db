"""Helpers for tests and demos that ship with the package (replicas must be able to import them)."""

from __future__ import annotations

import torch

OOM_MARKER = "[[inject-oom]]"
FAIL_MARKER = "[[inject-failure]]"
FATAL_MARKER = "[[inject-fatal-device-error]]"


class FaultInjection:
    """Engine extension: a prompt that carries a marker makes the engine raise that fault.

    Use with `model.engine_extension: serve_app.testing:FaultInjection`. Only the fault is fake;
    every other request runs the real pipeline.
    """

    def ping(self, value=None):
        """A worker-extension method for collective RPC tests: answers from this engine."""
        return {"pong": value, "model": self.model_name}

    def run(self, rows, params, step_hook=None):
        for row in rows:
            if OOM_MARKER in row.prompt:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (injected)")
            if FAIL_MARKER in row.prompt:
                raise RuntimeError("injected engine failure")
            if FATAL_MARKER in row.prompt:
                raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
        return super().run(rows, params, step_hook)
