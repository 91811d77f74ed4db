"""Signed links to stored outputs: an HMAC of the path and its expiry time."""

from __future__ import annotations

import hashlib
import hmac
import time


def sign(key: bytes, path: str, expires: int) -> str:
    return hmac.new(key, f"{path}\n{expires}".encode(), hashlib.sha256).hexdigest()


def signature_ok(key: bytes, path: str, expires: int, signature: str, now: float | None = None) -> bool:
    if expires < (now if now is not None else time.time()):
        return False
    # As bytes: compare_digest refuses a str with characters outside ASCII (a caller's `%C3%A9`).
    return hmac.compare_digest(sign(key, path, expires).encode(), signature.encode("utf-8", "replace"))
