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

import aiohttp
from aiohttp.resolver import ThreadedResolver
from yarl import URL

from serve_app.errors import InvalidRequest
from serve_app.schemas import Job


def check_url(url: str, allowed_hosts: list[str]) -> None:
    """400 unless `url` is http(s) to an allowed host. With no allow-list, any host but one that
    is or looks like a non-public address (a caller must not make the server call inside); the
    call itself then connects to public addresses only (`post`).

    The host is judged as the HTTP client will connect to it: after the client's own IDNA and
    Unicode normalisation (fullwidth digits, ideographic full stops and circled numbers all
    become ASCII), so what is checked is what is dialled."""
    host = connect_host(url)
    if allowed_hosts:
        if host not in {h.lower().rstrip(".") for h in allowed_hosts}:
            raise InvalidRequest(
                f"webhook: host {host!r} is not among the allowed webhook hosts", param="webhook"
            )
        return
    why = _not_public(host)
    if why:
        raise InvalidRequest(
            f"webhook: {host!r} is not a public address ({why}); allow it in jobs.webhook_hosts",
            param="webhook",
        )


def connect_host(url: str) -> str:
    """The host `post` will connect to, as aiohttp reads it from `url` (yarl's normalised host,
    lower case, without a trailing dot); 400 for a URL it could not call."""
    bad = InvalidRequest("webhook: must be an http:// or https:// URL with a host", param="webhook")
    try:
        parsed = URL(url)
        host = parsed.raw_host or ""
        parsed.port  # noqa: B018 (raises on a bad port)
    except (ValueError, UnicodeError, TypeError):
        raise bad from None
    if parsed.scheme not in ("http", "https") or not host or parsed.user or parsed.password:
        raise bad
    host = host.lower().rstrip(".")
    if not _HOST.fullmatch(host):  # a percent-escape, a zone id, a character no resolver takes
        raise bad
    return host


_HOST = re.compile(r"[a-z0-9._-]+|[0-9a-f:.]+")


def _not_public(host: str) -> str:
    """Why `host` (as `connect_host` gives it) may reach inside; "" for a public one."""
    if host == "localhost" or host.endswith((".localhost", ".internal", ".local")):
        return "a local name"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is None:
        # Numbers the resolver reads as addresses (2130706433, 0x7f.1, 0177.0.0.1, 127.1) but
        # ipaddress does not.
        if all(re.fullmatch(r"0x[0-9a-f]*|[0-9]+", label) for label in host.split(".")):
            return "a number the resolver reads as an address"
        return ""
    return "" if is_public(ip) else "not a global unicast address"


# IPv6 ranges that carry an IPv4 address in their last 32 bits (IPv4-compatible, -mapped,
# -translated, NAT64 well-known and local-use): the address behind them is judged too.
_EMBEDS_V4 = tuple(
    ipaddress.ip_network(n)
    for n in ("::/96", "::ffff:0:0/96", "::ffff:0:0:0/96", "64:ff9b::/96", "64:ff9b:1::/48")
)


def is_public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """A global unicast address, and for IPv6 forms that embed an IPv4 address (mapped,
    compatible, translated, NAT64, 6to4, Teredo, ISATAP) a global embedded one too."""
    if not ip.is_global or ip.is_multicast:
        return False
    if isinstance(ip, ipaddress.IPv4Address):
        return True
    embedded = []
    if any(ip in net for net in _EMBEDS_V4):
        embedded.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    if ip.sixtofour is not None:
        embedded.append(ip.sixtofour)
    if ip.teredo is not None:
        embedded.extend(ip.teredo)
    if (int(ip) >> 32) & 0xFDFFFFFF == 0x00005EFE:  # ISATAP interface id
        embedded.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return all(is_public(v4) for v4 in embedded)


class _PublicOnly(ThreadedResolver):
    """Refuses a name that resolves to any address that is not public, at the moment of the
    call (a name checked at submit time may point elsewhere by then)."""

    async def resolve(self, host, port=0, family=socket.AF_INET):
        found = await super().resolve(host, port, family)
        for item in found:
            if not is_public(ipaddress.ip_address(item["host"])):
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
        if public_only:
            # aiohttp dials an address literal without asking the resolver: judge it here.
            why = _not_public(connect_host(url))
            if why:
                return None, f"refused: {why}"
        connector = aiohttp.TCPConnector(resolver=_PublicOnly()) if public_only else None
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            # No redirects: a redirect could point the call somewhere check_url refused.
            async with session.post(url, data=body, headers=headers, allow_redirects=False) as resp:
                return resp.status, None if resp.status < 300 else f"HTTP {resp.status}"
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"[:200]
