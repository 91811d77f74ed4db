"""Stored outputs as signed links: where links point, signing them, storing a result's files
for `response_format: url`, and a job as its caller sees it (with fresh links)."""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import Request

from serve_app.config import JobsConfig
from serve_app.jobs import Store, sign
from serve_app.schemas import GenerationResult, Job, JobRecord


class Links:
    def __init__(self, store: Store, key: bytes, cfg: JobsConfig):
        self.store, self.key, self.cfg = store, key, cfg

    def base_url(self, http: Request) -> str:
        """Where links point: `jobs.public_url`, else the app's own address as the caller sees it."""
        if self.cfg.public_url:
            return self.cfg.public_url.rstrip("/")
        return str(http.base_url).rstrip("/")

    def signed(self, base: str, key: str, name: str) -> str:
        expires = int(time.time() + self.cfg.url_ttl_s)
        signature = sign(self.key, f"{key}/{name}", expires)
        return f"{base}/v1/files/{key}/{name}?expires={expires}&signature={signature}"

    async def urls(self, result: GenerationResult, response_format: str, base: str) -> list[str] | None:
        """With `response_format: url`, the result's files are stored and signed links returned."""
        if response_format != "url":
            return None
        # A key of the server's choosing: a request id is the caller's, and could name another's job.
        key = f"res_{uuid.uuid4().hex}"
        names = await asyncio.to_thread(self.store.put_outputs, key, result)
        return [self.signed(base, key, name) for name, _ in names]

    def present(self, job: JobRecord) -> Job:
        """A job as its caller sees it: with fresh links to its outputs."""
        public = job.public()
        for out in public.outputs:
            out.url = self.signed(job.base_url, job.id, out.name)
            out.content_url = f"{job.base_url}/v1/jobs/{job.id}/content/{out.index}"
        if public.tensors is not None:
            public.tensors.url = self.signed(job.base_url, job.id, public.tensors.name)
            public.tensors.content_url = f"{job.base_url}/v1/jobs/{job.id}/tensors"
        return public
