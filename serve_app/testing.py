"""Helpers for tests and demos that ship with the package (replicas must be able to import them)."""

from __future__ import annotations

import os
import re
import tempfile

import torch

from serve_app.engine import exported

OOM_MARKER = "[[inject-oom]]"
FAIL_MARKER = "[[inject-failure]]"
FATAL_MARKER = "[[inject-fatal-device-error]]"
FATAL_ERROR = "CUDA error: an illegal memory access was encountered (injected)"


class FaultInjection:
    """Engine extension: a prompt that carries a marker makes the engine raise that fault.

    Use with `model.engine_extension: serve_app.testing:FaultInjection`. Only the fault is fake;
    every other request runs the real pipeline. Faults of the engine itself (not of a request)
    are armed through collective RPC.
    """

    _broken: bool = False
    _fatal_token: str | None = None

    @exported
    def ping(self, value=None):
        """A worker-extension method for collective RPC tests: answers from this engine."""
        return {"pong": value, "model": self.model_name}

    @exported
    def set_broken(self, broken: bool = True) -> bool:
        """Every call fails from now on (a broken engine, unlike a bad request), or works again."""
        self._broken = bool(broken)
        return self._broken

    @exported
    def arm_fatal_once(self, token: str) -> None:
        """The first engine that claims the token file `fault_token_path(token)` (by deleting it)
        raises a fatal device error on its next call: broadcast to every replica, one breaks."""
        self._fatal_token = fault_token_path(token)

    def run(self, rows, params, step_hook=None):
        if self._broken:
            raise RuntimeError("injected broken engine")
        if self._fatal_token is not None:
            token, self._fatal_token = self._fatal_token, None
            try:
                os.remove(token)
            except OSError:
                pass  # another replica claimed it
            else:
                raise RuntimeError(FATAL_ERROR)
        for row in rows:
            if OOM_MARKER in row.prompt:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (injected)")
            if FAIL_MARKER in row.prompt:
                raise RuntimeError("injected engine failure")
            if FATAL_MARKER in row.prompt:
                raise RuntimeError(FATAL_ERROR)
        return super().run(rows, params, step_hook)


def fault_token_path(token: str) -> str:
    """Where the token file of `arm_fatal_once` lives (only there: RPC arguments name no paths)."""
    if not re.fullmatch(r"[A-Za-z0-9-]{1,64}", token):
        raise ValueError("token: 1-64 letters, digits or '-'")
    return os.path.join(tempfile.gettempdir(), f"diffusion-serve-fault-{token}")
