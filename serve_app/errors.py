"""The one error type every failure leaves through.

A `ServingError` carries an HTTP status, an OpenAI-style error type, a message and, where it
applies, the offending field and the request id. The ingress turns it into a JSON error body;
handle callers catch the subclass itself (Ray re-raises it on the caller's side).
"""

from __future__ import annotations


class ServingError(Exception):
    status_code = 500
    error_type = "server_error"

    default_retry_after_s: int | None = None  # sent as `Retry-After` when set

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        request_id: str | None = None,
        retry_after_s: int | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.request_id = request_id
        self._retry_after_s = retry_after_s if retry_after_s is not None else self.default_retry_after_s

    @property
    def retry_after_s(self) -> int | None:
        # Read through an instance attribute: the copy Ray raises on a handle caller's side
        # finds it on the original error, where a class attribute would shadow it.
        return self._retry_after_s

    def __reduce__(self):
        # Keyword-only fields survive the trip through Ray's pickling.
        return (_rebuild, (type(self), self.message, self.param, self.request_id, self.retry_after_s))

    def __str__(self) -> str:
        prefix = f"[{self.request_id}] " if self.request_id else ""
        return prefix + self.message

    def to_body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.status_code,
                "request_id": self.request_id,
            }
        }

    def headers(self) -> dict[str, str] | None:
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else None

    def with_request_id(self, request_id: str | None) -> ServingError:
        """A copy of this error for another request (errors of a shared pipeline call)."""
        return type(self)(
            self.message, param=self.param, request_id=request_id, retry_after_s=self.retry_after_s
        )


def _rebuild(cls, message, param, request_id, retry_after_s=None):
    return cls(message, param=param, request_id=request_id, retry_after_s=retry_after_s)


class InvalidRequest(ServingError):
    status_code = 400
    error_type = "invalid_request_error"


class ModerationBlocked(InvalidRequest):
    """The safety checker flagged an image of the request (`model.safety`, action `refuse`):
    OpenAI's answer, a 400 whose `code` is "moderation_blocked"."""

    error_type = "image_generation_user_error"

    def to_body(self) -> dict:
        body = super().to_body()
        body["error"]["code"] = "moderation_blocked"
        return body


class Unauthorized(ServingError):
    status_code = 401
    error_type = "authentication_error"


class Forbidden(ServingError):
    status_code = 403
    error_type = "forbidden"


class NotFound(ServingError):
    status_code = 404
    error_type = "not_found_error"


class EngineFailure(ServingError):
    """The engine raised while running this request; the replica keeps serving."""

    status_code = 500
    error_type = "engine_error"


class OutOfMemory(ServingError):
    """The device ran out of memory on this request; retrying smaller or later may work."""

    status_code = 503
    error_type = "out_of_memory"


class PayloadTooLarge(ServingError):
    status_code = 413
    error_type = "payload_too_large"


class Aborted(ServingError):
    """The request was aborted (by id, or because its caller went away) before it finished."""

    status_code = 499
    error_type = "aborted"


class Overloaded(ServingError):
    """Every replica's queue is full; retry after `retry_after_s` seconds."""

    status_code = 429
    error_type = "overloaded"
    default_retry_after_s = 2


class QuotaExceeded(Overloaded):
    """The caller's tenant is past one of its quotas (`param` names it); retry after
    `retry_after_s`. Its body's `code` is "quota_exceeded"; `limits` become rate-limit headers."""

    error_type = "rate_limit_error"

    def __init__(self, message: str, *, limits: dict[str, str] | None = None, **kw):
        super().__init__(message, **kw)
        self.limits = limits or {}

    def to_body(self) -> dict:
        body = super().to_body()
        body["error"]["code"] = "quota_exceeded"
        return body

    def headers(self) -> dict[str, str] | None:
        return {**(super().headers() or {}), **self.limits}


class Unavailable(ServingError):
    """No replica can take the request now (none ready, or every try lost its replica)."""

    status_code = 503
    error_type = "unavailable"
    default_retry_after_s = 5


class ReplicaLost(Unavailable):
    """The replica holding the request is going away (a fatal device error); the ingress sends
    the request to another replica, as it does when a replica dies under a request."""


class DeadlineExceeded(ServingError):
    status_code = 504
    error_type = "timeout"


class Conflict(ServingError):
    """The request contradicts the server's state (an idempotency key reused for another body)."""

    status_code = 409
    error_type = "conflict"
