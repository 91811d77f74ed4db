"""Tenants at the ingress: which tenant a request is (its API key's, or the one a handle caller
names), and the tenant's quotas: requests in flight, asynchronous jobs waiting, and rates of
images and image-steps per minute (token buckets holding one minute's worth). Past a quota a
request is a `QuotaExceeded` (429, `code: quota_exceeded`, `param` the limit); a job waits for
its tenant's room instead. Counted per ingress replica. The fair order itself is the replicas'
(`replica/scheduler.py`)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from serve_app import metrics
from serve_app.config import PRIORITIES, Priority, TenantConfig, priority_level
from serve_app.errors import InvalidRequest, QuotaExceeded
from serve_app.schemas import PreparedRequest

DEFAULT = "default"
# A key that is in no tenant is a tenant of its own, named by a digest of the key.
IMPLICIT = re.compile(r"key-[0-9a-f]{16}")


class _Bucket:
    """`per_minute` tokens a minute, holding at most a minute's worth."""

    def __init__(self, per_minute: float):
        self.per_minute = per_minute
        self.tokens = per_minute
        self._at = time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self.tokens = min(self.per_minute, self.tokens + (now - self._at) * self.per_minute / 60)
        self._at = now

    def shortfall_s(self, n: float) -> float:
        """Seconds until `n` tokens are there (0: now); inf if `n` is more than a minute holds."""
        self._refill()
        if n > self.per_minute:
            return math.inf
        return max(0.0, (n - self.tokens) * 60 / self.per_minute)

    def take(self, n: float) -> None:
        self.tokens -= n


@dataclass
class Tenant:
    cfg: TenantConfig
    in_flight: int = 0
    rejected: collections.Counter = field(default_factory=collections.Counter)
    buckets: dict[str, _Bucket] = field(default_factory=dict)
    room: asyncio.Condition | None = None

    @property
    def name(self) -> str:
        return self.cfg.name


class Tenants:
    def __init__(self, configs: list[TenantConfig], digest: Callable[[str], str], retry_after_s: int):
        self._digest, self._retry_after_s = digest, retry_after_s
        self._by_key: dict[str, str] = {}
        self._tenants: dict[str, Tenant] = {}
        for cfg in configs:
            self._tenants[cfg.name] = _tenant(cfg)
            env = os.environ.get(cfg.api_keys_env, "") if cfg.api_keys_env else ""
            for key in [*cfg.api_keys, *(k.strip() for k in env.split(",") if k.strip())]:
                if self._by_key.get(key, cfg.name) != cfg.name:
                    raise ValueError(f"tenants: a key is in tenants {self._by_key[key]!r} and {cfg.name!r}")
                self._by_key[key] = cfg.name
        self._tenants.setdefault(DEFAULT, _tenant(TenantConfig(name=DEFAULT)))

    def keys(self) -> tuple[str, ...]:
        """Every tenant's keys: user keys of the service too."""
        return tuple(self._by_key)

    def of_key(self, key: str) -> str:
        """The tenant of a request sent with an accepted `key` ("": none)."""
        if not key:
            return DEFAULT
        name = self._by_key.get(key)
        if name is None:
            name = "key-" + self._digest(key)[:16]
            self.named(name, implicit=True)
        return name

    def named(self, name: str | None, implicit: bool = False) -> Tenant:
        """The tenant called `name` (None: `default`): a configured one, or a key's own that this
        ingress has met; with `implicit` also one it has not (a stored job's, resumed here).
        Another name is a 400 naming `tenant`."""
        name = name or DEFAULT
        tenant = self._tenants.get(name)
        if tenant is None:
            if not (implicit and IMPLICIT.fullmatch(name)):
                raise InvalidRequest(f"tenant: {name[:64]!r} is not a configured tenant", param="tenant")
            tenant = self._tenants[name] = _tenant(TenantConfig(name=name))
        return tenant

    def priority(self, name: str, asked: Priority | None, default: str = "interactive") -> int:
        """The level a request of tenant `name` runs at: the one it `asked` for (a 400 naming
        `priority` above the tenant's `max_priority`), else `default`, no higher than that."""
        most = self.named(name, implicit=True).cfg.max_priority
        if asked is None:
            return min(PRIORITIES[default], priority_level(most))
        if priority_level(asked) > priority_level(most):
            raise InvalidRequest(
                f"priority: {asked!r} is above the max_priority {most!r} of tenant {name!r}", param="priority"
            )
        return priority_level(asked)

    def visible(self, name: str | None) -> list[str]:
        """The tenants a caller may see: all (None: the admin, an open service) or its own."""
        return sorted(self._tenants) if name is None else [name]

    def state(self, name: str) -> Tenant | None:
        return self._tenants.get(name)

    @contextlib.asynccontextmanager
    async def admit(self, request: PreparedRequest, wait: bool = False, times: int = 1):
        """Hold one of the tenant's in-flight places and take the request's images and
        image-steps from its rates (`times` over: a request run that many times, all judged
        before the first runs); past a quota: `QuotaExceeded`, or with `wait` (jobs) wait."""
        tenant = await self._room(request, wait, times)
        for name, n in _need(request, times).items():
            if name in tenant.buckets:
                tenant.buckets[name].take(n)
        tenant.in_flight += 1
        try:
            yield tenant
        finally:
            tenant.in_flight -= 1
            async with tenant.room:
                tenant.room.notify_all()  # all: a waiter cancelled after a notify loses no wakeup

    async def wait_for_room(self, request: PreparedRequest) -> None:
        """Until the request's tenant has room for it (a job, before it takes a run slot)."""
        await self._room(request, True)

    def check_fits(self, request: PreparedRequest, times: int = 1) -> None:
        """A 400 now for a request (run `times` over) more than a minute of its tenant's rates
        holds: it could never run, so never a 429 (nor a job that would only fail later)."""
        tenant = self.named(request.tenant, implicit=True)
        need = _need(request, times)
        for name, bucket in tenant.buckets.items():
            if need[name] > bucket.per_minute:
                raise InvalidRequest(
                    f"quota: tenant {tenant.name!r} has an {name} of {bucket.per_minute:g}; this request "
                    f"needs {need[name]:g}, more than a minute's",
                    param=name,
                    request_id=request.request_id,
                )

    async def _room(self, request: PreparedRequest, wait: bool, times: int = 1) -> Tenant:
        self.check_fits(request, times)
        tenant = self.named(request.tenant, implicit=True)
        need = _need(request, times)
        while (problem := self._problem(tenant, need)) is not None:
            if not wait:
                tenant.rejected[problem.param] += 1
                metrics.tenant_rejected(tenant.name, problem.param)
                raise problem.with_limits(request.request_id)
            if problem.param == "max_concurrent":
                async with tenant.room:
                    await tenant.room.wait_for(lambda: tenant.in_flight < tenant.cfg.max_concurrent)
            else:
                await asyncio.sleep(min(60.0, problem.wait_s))
        return tenant

    def _problem(self, tenant: Tenant, need: dict[str, float]) -> _Refusal | None:
        cap = tenant.cfg.max_concurrent
        if cap is not None and tenant.in_flight >= cap:
            return _Refusal(
                "max_concurrent",
                f"tenant {tenant.name!r} has {tenant.in_flight} requests in flight, its max_concurrent",
                self._retry_after_s,
                {"x-ratelimit-limit-requests": str(cap), "x-ratelimit-remaining-requests": "0"},
            )
        for name, bucket in tenant.buckets.items():
            wait_s = bucket.shortfall_s(need[name])
            if wait_s > 0:
                what = name.removesuffix("_per_minute").replace("_", "-")
                return _Refusal(
                    name,
                    f"tenant {tenant.name!r} is past its {name} of {bucket.per_minute:g}",
                    max(1, math.ceil(wait_s)),
                    {
                        f"x-ratelimit-limit-{what}": f"{bucket.per_minute:g}",
                        f"x-ratelimit-remaining-{what}": str(max(0, int(bucket.tokens))),
                        f"x-ratelimit-reset-{what}": f"{min(wait_s, 60):.1f}s",
                    },
                    wait_s,
                )
        return None

    def check_queued(self, name: str, queued: int) -> None:
        """A job about to be stored: 429 past the tenant's `max_queued` waiting jobs."""
        tenant = self.named(name, implicit=True)
        cap = tenant.cfg.max_queued
        if cap is not None and queued >= cap:
            tenant.rejected["max_queued"] += 1
            metrics.tenant_rejected(name, "max_queued")
            raise _Refusal(
                "max_queued",
                f"tenant {name!r} has {queued} jobs waiting, its max_queued",
                self._retry_after_s,
                {},
            ).with_limits(None)


@dataclass
class _Refusal:
    param: str
    message: str
    retry_after_s: int
    limits: dict[str, str]
    wait_s: float = 0.0

    def with_limits(self, request_id: str | None) -> QuotaExceeded:
        return QuotaExceeded(
            f"quota: {self.message}; retry in {self.retry_after_s}s",
            param=self.param,
            request_id=request_id,
            retry_after_s=self.retry_after_s,
            limits=self.limits,
        )


def _tenant(cfg: TenantConfig) -> Tenant:
    buckets = {
        name: _Bucket(rate)
        for name in ("images_per_minute", "image_steps_per_minute")
        if (rate := getattr(cfg, name)) is not None
    }
    return Tenant(cfg, buckets=buckets, room=asyncio.Condition())


def _need(request: PreparedRequest, times: int = 1) -> dict[str, float]:
    images = len(request.prompts) * request.num_images * times
    return {"images_per_minute": images, "image_steps_per_minute": images * request.num_inference_steps}
