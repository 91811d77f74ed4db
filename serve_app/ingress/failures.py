"""What a failed replica call means for its caller: every Ray failure becomes one `ServingError`.

A replica that died, or is leaving with the request in it, is a retry (the request's fixed seed
makes the retry give the same image); anything else is the caller's error, never Ray's raw text.
"""

from __future__ import annotations

import asyncio
import logging

from ray.exceptions import NodeDiedError, RayActorError, RayError, RayTaskError, WorkerCrashedError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from serve_app import metrics
from serve_app.errors import Overloaded, ReplicaLost, ServingError, Unavailable

logger = logging.getLogger("ray.serve")

# What a call raises when its replica died mid-request (crash, ray.kill, node loss).
_REPLICA_GONE = (RayActorError, WorkerCrashedError, NodeDiedError)


def not_ready(model: str | None = None) -> Unavailable:
    """503: no replica (of `model`, where the application serves several) is ready."""
    of = f" of model {model!r}" if model else ""
    return Unavailable(f"no model replica{of} is ready (still loading and warming up, or being replaced)")


def unwrap(e: BaseException) -> BaseException:
    """A `ServingError` raised in a replica reaches us wrapped in a RayTaskError."""
    if isinstance(e, RayTaskError) and isinstance(e.cause, ServingError):
        return e.cause
    return e


def is_lost(e: BaseException) -> bool:
    """Whether `e` says the replica went away under the call (rather than the call failing)."""
    return isinstance(e, _REPLICA_GONE) or isinstance(unwrap(e), ReplicaLost)


def call_error(
    e: Exception, rid: str, failures: list[str], model: str, retry_after_s: float
) -> ServingError | None:
    """None when the replica died or is leaving with the request in it (noted in `failures`:
    the request may go to another replica), else the error its caller gets."""
    cause = unwrap(e)
    if is_lost(e):
        failures.append(type(cause).__name__)
        metrics.count_retry(model)
        logger.warning("request %s: replica lost (%s), attempt %d", rid, e, len(failures))
        return None
    if isinstance(e, BackPressureError):
        metrics.count_rejected(model, "overloaded")
        return Overloaded(
            "every replica's queue is full; retry later", request_id=rid, retry_after_s=retry_after_s
        )
    if isinstance(e, DeploymentUnavailableError):
        return not_ready().with_request_id(rid)
    if isinstance(cause, ServingError):
        return cause
    if isinstance(e, RayError):
        logger.warning("request %s: replica call failed: %s", rid, e)
        return Unavailable(f"replica unavailable: {type(e).__name__}", request_id=rid)
    logger.exception("request %s: unexpected error", rid, exc_info=e)
    return ServingError("internal error; the server log has the details", request_id=rid)


def gave_up(failures: list[str], request_id: str) -> Unavailable:
    return Unavailable(
        f"the replica serving this request died {len(failures)} time(s) ({', '.join(failures)}); giving up",
        request_id=request_id,
    )


async def backoff(failures: list[str]) -> None:
    """Before trying another replica: a replica that is leaving answers at once, and until the
    router hears that it is gone, an immediate retry may well pick it again."""
    await asyncio.sleep(min(2.0, 0.2 * 2 ** (len(failures) - 1)))
