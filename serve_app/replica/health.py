"""Whether a replica can serve, and what a failed pipeline call means.

Callers' requests alone never make a replica unhealthy: a caller's bad arguments and running
out of memory are that caller's answer, and engine failures in a row only make the replica run
a short known-good call (a self-test), which must fail too. A fatal device error, a call that
hangs past its limit or a stopped engine loop do make it unhealthy.

Which failures are the caller's is not decided by a list of exception types: after a call
fails in a way no check foresaw, the engine runs the self-test (the model's defaults). If that
works, the engine is sound and the request's own arguments made the call fail: a 400, not
counted. Only a call that held one request is judged so: a shared call's requests get a 500
(one of them is at fault, which one is not known), not counted either. The verdict is kept a
minute for failures of the same kind (the same exception and message up to its numbers), so a
caller repeating it costs no further self-test, and a self-test that clears a request runs at
most once every `RECHECK_S` (in between, such failures count as before).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import re
import time

import torch

from serve_app.engine import CallParams, InvalidArguments, LoraError, is_fatal_device_error
from serve_app.engine.safety import SafetyCheckError
from serve_app.errors import (
    EngineFailure,
    InvalidRequest,
    OutOfMemory,
    ReplicaLost,
    ServingError,
    Unavailable,
)

logger = logging.getLogger("ray.serve")

_PATH = re.compile(r"(?<![\w.])/(?:[\w.@+-]+/)+[\w.@+-]*")
_NUMBER = re.compile(r"0x[0-9a-fA-F]+|\d+(?:\.\d+)?(?:e[+-]?\d+)?")
VERDICT_S = 60.0  # how long a self-test's verdict stands for failures of the same kind
_VERDICTS = 64  # kinds of failure remembered
RECHECK_S = 10.0  # at most one self-test this often for a kind not judged yet
# A device allocator's failure raised as a plain RuntimeError: out of memory all the same.
_ALLOC_FAILED = re.compile(r"out of memory|ALLOC_FAILED|CUBLAS_STATUS_ALLOC|cudaErrorMemoryAllocation", re.I)


def no_paths(message: str) -> str:
    """An engine's error text for a caller, without the server's file paths in it."""
    return _PATH.sub("<path>", message)


class Health:
    def __init__(self, max_consecutive_failures: int, call_timeout_s: float):
        self.max_failures = max_consecutive_failures
        self.call_timeout_s = call_timeout_s
        self.consecutive_failures = 0
        self.self_tests_passed = 0
        self.fatal: str | None = None  # a device error: this replica is leaving
        self.broken: str | None = None  # failures in a row and a failed self-test
        self.call_started: float | None = None
        self.argument_failures = 0  # calls that failed on their arguments (judged by a self-test)
        self._verdicts: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._rechecked_at = -RECHECK_S

    def classify(
        self, e: Exception, request_id: str, rows: int, params: CallParams, requests: int = 1
    ) -> ServingError:
        """A failed call's error for its callers (`requests` of them shared the call); engine
        failures are counted, a fatal device error marks the replica as leaving."""
        if isinstance(e, LoraError):
            return InvalidRequest(f"lora: {e}", param="lora", request_id=request_id)
        if isinstance(e, SafetyCheckError):  # not the engine's failure: nothing unchecked goes out
            logger.warning("request %s: %s", request_id, e)
            return Unavailable(f"{e}; no image is returned unchecked", request_id=request_id)
        if isinstance(e, InvalidArguments):
            param = e.param or ("extra" if params.extra else None)
            return InvalidRequest(no_paths(str(e)), param=param, request_id=request_id)
        if isinstance(e, torch.OutOfMemoryError) or (
            isinstance(e, RuntimeError) and _ALLOC_FAILED.search(str(e)) and not is_fatal_device_error(e)
        ):
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            logger.warning("request %s ran out of device memory", request_id)
            return OutOfMemory(
                f"out of device memory running {rows} image(s) at {params.width}x{params.height}; "
                "try fewer or smaller images",
                request_id=request_id,
            )
        if requests == 1 and not is_fatal_device_error(e) and self._known_argument_failure(e):
            self.argument_failures += 1
            return self._argument_error(e, request_id, params)
        self.consecutive_failures += 1
        logger.exception("request %s failed in the engine", request_id, exc_info=e)
        if is_fatal_device_error(e):
            # A CUDA error of this kind poisons the context: no later call can succeed here.
            # The requests of this call go to another replica too: the device failed, not they.
            self.fatal = f"fatal device error: {type(e).__name__}: {e}"
            logger.error("replica leaving after request %s: %s", request_id, self.fatal)
            return self.lost(request_id)
        return EngineFailure(f"engine error: {type(e).__name__}: {no_paths(str(e))}", request_id=request_id)

    def recheck(
        self, engine, e: Exception, request_id: str, params: CallParams, requests: int = 1
    ) -> ServingError | None:
        """Engine thread, after `e` failed a call of `requests` requests as an engine failure:
        run the self-test. If the model runs its defaults, the call failed on its arguments and
        the failure is not counted: a lone request's 400, a shared call's 500 (returned). None if
        the self-test fails too, or cleared a request less than `RECHECK_S` ago (the failure stays
        counted)."""
        now = time.monotonic()
        if now - self._rechecked_at < RECHECK_S:  # a caller's failures cost a self-test this often
            return None
        try:
            engine.self_test()
        except Exception as failed:
            logger.warning("the self-test after request %s failed too: %s: %s", request_id,
                           type(failed).__name__, no_paths(str(failed))[:300])  # fmt: skip
            if is_fatal_device_error(failed):
                self.fatal = f"fatal device error: {type(failed).__name__}: {failed}"
            self._verdicts.clear()
            return None
        self._rechecked_at = now
        self.consecutive_failures = max(0, self.consecutive_failures - 1)
        self.argument_failures += 1
        logger.warning(
            "request %s failed on its arguments (the self-test runs): %s: %s",
            request_id, type(e).__name__, no_paths(str(e))[:300],
        )  # fmt: skip
        if requests > 1:
            return EngineFailure(
                f"engine error: a call shared by {requests} requests failed, and the model runs its "
                f"defaults, so one request's arguments are likely at fault: {type(e).__name__}: "
                f"{no_paths(str(e))[:300]}",
                request_id=request_id,
            )
        self._verdicts[_kind(e)] = now
        self._verdicts.move_to_end(_kind(e))
        while len(self._verdicts) > _VERDICTS:
            self._verdicts.popitem(last=False)
        return self._argument_error(e, request_id, params)

    def _known_argument_failure(self, e: Exception) -> bool:
        at = self._verdicts.get(_kind(e))
        return at is not None and time.monotonic() - at < VERDICT_S

    @staticmethod
    def _argument_error(e: Exception, request_id: str, params: CallParams) -> InvalidRequest:
        return InvalidRequest(
            "the pipeline cannot run this request's arguments (the same model runs its defaults): "
            f"{type(e).__name__}: {no_paths(str(e))[:500]}",
            param="extra" if params.extra else None,
            request_id=request_id,
        )

    def lost(self, request_id: str | None = None) -> ReplicaLost:
        return ReplicaLost(f"replica is restarting after a device error: {self.fatal}", request_id=request_id)

    @property
    def needs_self_test(self) -> bool:
        return self.consecutive_failures >= self.max_failures

    def self_test(self, engine) -> None:
        """Engine thread: a known-good call decides whether the failures were the engine's."""
        n = self.consecutive_failures
        try:
            engine.self_test()
        except Exception as e:
            self.broken = f"{n} engine failures in a row, then the self-test failed: {type(e).__name__}: {e}"
            logger.error("replica unhealthy: %s", self.broken)
            return
        logger.warning("%d engine failures in a row, but the self-test call works: still healthy", n)
        self.consecutive_failures = 0
        self.self_tests_passed += 1

    def problem(self, loop_task: asyncio.Task | None) -> str | None:
        """Why this replica cannot serve, or None."""
        if self.fatal:
            return self.fatal
        if self.broken:
            return self.broken
        if loop_task is not None and loop_task.done():
            return (
                f"engine loop stopped: {loop_task.exception() if not loop_task.cancelled() else 'cancelled'}"
            )
        started = self.call_started
        if started is not None and time.monotonic() - started > self.call_timeout_s:
            ran = time.monotonic() - started
            return f"a pipeline call has run for {ran:.0f}s (limit {self.call_timeout_s:g}s)"
        return None


def _kind(e: Exception) -> str:
    """A failure's kind: its type and message with the numbers left out."""
    return f"{type(e).__name__}: {_NUMBER.sub('#', str(e))[:200]}"
