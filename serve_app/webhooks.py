"""Webhook calls of asynchronous jobs: which targets are allowed, the signed body, one POST.

Each call is a JSON POST of `{"event": ..., "job": {...}}` with the headers
`Webhook-Timestamp` (Unix seconds) and, when a key is configured, `Webhook-Signature:
sha256=<hex>`, the HMAC-SHA256 of `<timestamp>.<body>` under the key, so a receiver can check
both who sent it and that it is fresh.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import re
import socket
import time
from urllib.parse import urlsplit

import aiohttp
from aiohttp.resolver import ThreadedResolver

from serve_app.errors import InvalidRequest
from serve_app.schemas import Job


def check_url(url: str, allowed_hosts: list[str]) -> None:
    """400 unless `url` is http(s) to an allowed host. With no allow-list, any host but one that
    is or looks like a non-public address (a caller must not make the server call inside); the
    call itself then connects to public addresses only (`post`)."""
    try:
        parts = urlsplit(url)
        host = (parts.hostname or "").lower()
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError:
        host, parts = "", None
    if parts is None or parts.scheme not in ("http", "https") or not host:
        raise InvalidRequest("webhook: must be an http:// or https:// URL with a host", param="webhook")
    if allowed_hosts:
        if host not in {h.lower() for h in allowed_hosts}:
            raise InvalidRequest(
                f"webhook: host {host!r} is not among the allowed webhook hosts", param="webhook"
            )
        return
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    # Numbers the resolver reads as addresses (2130706433, 0x7f.1, 0177.0.0.1, 127.1) but
    # ipaddress does not: refused unless they are a plain dotted quad.
    labels = host.rstrip(".").split(".")
    numeric = ip is None and all(re.fullmatch(r"0x[0-9a-f]*|[0-9]+", label) for label in labels)
    internal = host == "localhost" or host.endswith((".localhost", ".internal")) or numeric
    if internal or (ip is not None and (not ip.is_global or ip.is_multicast)):
        raise InvalidRequest(
            f"webhook: {host!r} is not a public address; allow it in jobs.webhook_hosts", param="webhook"
        )


class _PublicOnly(ThreadedResolver):
    """Refuses a name that resolves to any address that is not public, at the moment of the
    call (a name checked at submit time may point elsewhere by then)."""

    async def resolve(self, host, port=0, family=socket.AF_INET):
        found = await super().resolve(host, port, family)
        for item in found:
            address = ipaddress.ip_address(item["host"])
            if not address.is_global or address.is_multicast:
                raise OSError(f"{host} resolves to a non-public address")
        return found


def payload(event: str, job: Job) -> bytes:
    return json.dumps({"event": event, "job": job.model_dump(mode="json")}, separators=(",", ":")).encode()


def signature(key: bytes, timestamp: str, body: bytes) -> str:
    return "sha256=" + hmac.new(key, timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()


async def post(
    url: str, body: bytes, key: bytes, timeout_s: float, public_only: bool = True
) -> tuple[int | None, str | None]:
    """One delivery: (HTTP status, None) or (None, why it failed). Never raises. With
    `public_only` (no allow-list configured) it connects to public addresses only."""
    timestamp = str(int(time.time()))
    headers = {"Content-Type": "application/json", "Webhook-Timestamp": timestamp}
    if key:
        headers["Webhook-Signature"] = signature(key, timestamp, body)
    try:
        connector = aiohttp.TCPConnector(resolver=_PublicOnly()) if public_only else None
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            # No redirects: a redirect could point the call somewhere check_url refused.
            async with session.post(url, data=body, headers=headers, allow_redirects=False) as resp:
                return resp.status, None if resp.status < 300 else f"HTTP {resp.status}"
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"[:200]
