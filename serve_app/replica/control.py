"""The replica's control plane: the torch profiler and collective RPC, each called on every
replica at once by the ingress. Results are per replica and never raise (`Outcome`)."""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from serve_app.engine import rpc_methods
from serve_app.errors import InvalidRequest
from serve_app.schemas import Outcome

OnEngine = Callable[..., Awaitable[Any]]  # runs a function on the engine thread


async def outcome(replica_id: str, coro) -> Outcome:
    """A control call's answer from this replica: its result, or its error."""
    try:
        return Outcome(replica_id=replica_id, ok=True, result=await coro)
    except Exception as e:
        return Outcome(
            replica_id=replica_id, ok=False, error=f"{type(e).__name__}: {getattr(e, 'message', e)}"
        )


class Profiler:
    """The torch profiler around the engine thread; a trace per start/stop pair."""

    def __init__(self, trace_dir: str, on_engine: OnEngine):
        self.trace_dir = trace_dir
        self._on_engine = on_engine
        self._prof = None
        self._prefix = ""

    async def start(self, prefix: str) -> dict[str, Any]:
        if self._prof is not None:
            raise InvalidRequest("profiling is already running on this replica; stop it first")

        def begin():
            import torch
            from torch.profiler import ProfilerActivity, profile

            cuda = [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
            prof = profile(activities=[ProfilerActivity.CPU, *cuda], record_shapes=True)
            prof.__enter__()
            return prof

        self._prof = await self._on_engine(begin)
        self._prefix = prefix
        return {"profiling": True}

    async def stop(self, replica_id: str) -> dict[str, Any]:
        prof, self._prof = self._prof, None
        if prof is None:
            raise InvalidRequest("profiling is not running on this replica; start it first")
        name = f"{self._prefix}-{replica_id}-{int(time.time())}.json"
        path = os.path.join(os.path.expanduser(self.trace_dir), name)

        def end():
            prof.__exit__(None, None, None)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            prof.export_chrome_trace(path)

        await self._on_engine(end)
        return {"trace": name}  # relative to profiling.trace_dir: no server path


async def call_exported(engine, on_engine: OnEngine, method: str, args: list, kwargs: dict) -> Any:
    """Call an engine method that the engine (or its extension) exports; others are refused."""
    allowed = rpc_methods(engine)
    if method not in allowed:
        raise InvalidRequest(
            f"method: {method!r} cannot be called; the engine exports {', '.join(allowed)}", param="method"
        )
    fn = getattr(engine, method)
    return await on_engine(lambda: fn(*args, **kwargs))
