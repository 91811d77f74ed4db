"""The job store: job records, the prepared requests that make them, and output files, on a
file system every ingress replica shares (a local directory by default, any fsspec URL for a
cluster). Job ids and request digests are made here too.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import secrets
import time
import uuid
from typing import Any

import fsspec

from serve_app.errors import ServingError
from serve_app.formats.tensor_file import SAFETENSORS
from serve_app.schemas import MEDIA_TYPES, GenerationResult, JobRecord, PreparedRequest

JOB_PREFIX = "job_"
TENSORS_FILE = "tensors.safetensors"


def job_id_for(idempotency_key: str | None, caller: str) -> str:
    """A new job id, or with an idempotency key the same id for the same key and caller."""
    if idempotency_key is None:
        return JOB_PREFIX + uuid.uuid4().hex
    digest = hashlib.sha256(f"{caller}\0{idempotency_key}".encode()).hexdigest()
    return JOB_PREFIX + digest[:32]


def body_hash(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


# What a store must do for claims to be exclusive, and the first versions of the bucket file
# systems that do it (pyproject.toml's `s3` and `gcs` extras).
EXCLUSIVE_NEEDS = (
    "the file system must fail a second create of the same key (mode 'xb', FileExistsError); "
    "for S3 use s3fs>=2025.7.0 on a server that honours If-None-Match, for GCS gcsfs>=2024.12.0"
)


class StoreRefused(ServingError, ValueError):
    """`jobs.store` names a file system the jobs cannot be kept on (found when the store opens)."""


class Store:
    """Records and files under one root: `objects/<key>/` per job or stored result, holding
    `job.json` (jobs), `request.json` (jobs), `meta.json` and the outputs `<index>.<format>`.

    Opening a store checks that it creates files exclusively (`check_exclusive`): claims, new
    jobs and the shared signing key rely on it, and a store that cannot is refused."""

    def __init__(self, url: str):
        self.fs, root = fsspec.core.url_to_fs(os.path.expanduser(url))
        self.root = root.rstrip("/")
        self.fs.makedirs(self._path("objects"), exist_ok=True)
        self.check_exclusive()

    def check_exclusive(self) -> None:
        """Create one probe key twice, as a claim does (`_create`): the first create must win and
        the second must lose (FileExistsError), or the store is refused (`StoreRefused`). The
        probe is removed."""
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        where = f"jobs.store ({protocol}:// file system)"  # never the URL: it may hold credentials
        self.fs.makedirs(self._path("probe"), exist_ok=True)
        path = self._path("probe", f"exclusive.{uuid.uuid4().hex}")
        try:
            try:
                first = self._create(path, b"probe")
                second = self._create(path, b"probe")
            except Exception as e:
                raise StoreRefused(
                    f"{where}: an exclusive create raised {type(e).__name__}; {EXCLUSIVE_NEEDS}",
                    param="jobs.store",
                ) from e
            if second:
                raise StoreRefused(
                    f"{where}: a second create of the same probe key succeeded, so two ingresses "
                    f"could both claim one job; {EXCLUSIVE_NEEDS}",
                    param="jobs.store",
                )
            if not first:
                raise StoreRefused(
                    f"{where}: the create of a new probe key failed as if it existed; {EXCLUSIVE_NEEDS}",
                    param="jobs.store",
                )
        finally:
            try:
                self.fs.rm(path)
            except Exception:  # never made, or already gone
                pass

    def _path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def _write(self, path: str, data: bytes) -> None:
        # Write then rename, so a reader on another process never sees half a record.
        tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
        with self.fs.open(tmp, "wb") as f:
            f.write(data)
        self.fs.mv(tmp, path)

    def _create(self, path: str, data: bytes) -> bool:
        """Write `path` only if nothing is there yet (True), else leave it (False): the one
        writer that wins a race is the only one that gets True. The file system's exclusive
        create decides (checked when the store opens); there is no check-then-write fallback,
        which two writers could both win."""
        try:
            with self.fs.open(path, "xb") as f:
                f.write(data)
            return True
        except FileExistsError:
            return False

    def _read(self, path: str) -> bytes | None:
        try:
            with self.fs.open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    # ------------------------------------------------------------------ secrets

    def secret(self, name: str, env: str) -> bytes:
        """A signing key: from the environment variable `env`, else one made once and kept in
        the store (every ingress sharing the store shares it)."""
        if os.environ.get(env):
            return os.environ[env].encode()
        path = self._path(f"{name}.key")
        self._create(path, secrets.token_hex(32).encode())  # the first ingress's key is everyone's
        return self._read(path)

    # ------------------------------------------------------------------ settings

    def put_setting(self, name: str, value: Any) -> None:
        """A small JSON value under `name` (letters, digits, '-', '_'), shared by every ingress
        that uses this store (a caller's chosen model, say); never pruned."""
        self.fs.makedirs(self._path("settings"), exist_ok=True)
        self._write(self._path("settings", f"{name}.json"), json.dumps(value).encode())

    def get_setting(self, name: str) -> Any:
        data = self._read(self._path("settings", f"{name}.json"))
        return json.loads(data) if data is not None else None

    # ------------------------------------------------------------------ jobs

    def save_job(self, job: JobRecord) -> None:
        self.fs.makedirs(self._path("objects", job.id), exist_ok=True)
        self._write(self._path("objects", job.id, "job.json"), job.model_dump_json().encode())

    def create_job(self, job: JobRecord) -> bool:
        """Store a new job; False if a job with its id exists (an idempotency key reused)."""
        self.fs.makedirs(self._path("objects", job.id), exist_ok=True)
        return self._create(self._path("objects", job.id, "job.json"), job.model_dump_json().encode())

    def load_job(self, job_id: str) -> JobRecord | None:
        data = self._read(self._path("objects", job_id, "job.json"))
        return JobRecord.model_validate_json(data) if data is not None else None

    def jobs(self) -> list[JobRecord]:
        out = []
        for key in self.keys():
            if key.startswith(JOB_PREFIX) and (job := self.load_job(key)) is not None:
                out.append(job)
        return sorted(out, key=lambda j: j.created_at, reverse=True)

    def renew(self, job_id: str, owner: str, until: float) -> None:
        """The lease: its owner promises to renew it before `until` (a file of its own, so that
        renewing never rewrites the job's record)."""
        self._write(self._path("objects", job_id, "lease.json"), json.dumps([owner, until]).encode())

    def lease(self, job_id: str) -> tuple[str, float] | None:
        data = self._read(self._path("objects", job_id, "lease.json"))
        return tuple(json.loads(data)) if data is not None else None

    def claim(self, job_id: str, attempt: int, owner: str) -> bool:
        """Take over attempt `attempt` of a job: only one ingress wins it."""
        return self._create(self._path("objects", job_id, f"claim.{attempt}"), owner.encode())

    def save_request(self, job_id: str, request: PreparedRequest) -> None:
        self.fs.makedirs(self._path("objects", job_id), exist_ok=True)
        self._write(self._path("objects", job_id, "request.json"), request.model_dump_json().encode())

    def load_request(self, job_id: str) -> PreparedRequest | None:
        data = self._read(self._path("objects", job_id, "request.json"))
        return PreparedRequest.model_validate_json(data) if data is not None else None

    # ------------------------------------------------------------------ outputs

    def put_outputs(self, key: str, result: GenerationResult) -> list[tuple[str, int]]:
        """Store a result's files under `key`; (file name, size) of each, in order."""
        self.fs.makedirs(self._path("objects", key), exist_ok=True)
        # The date first: retention must never take files being written for an old one.
        meta = {"created": time.time(), "format": result.output_format, "count": len(result.images)}
        self._write(self._path("objects", key, "meta.json"), json.dumps(meta).encode())
        names = []
        for i, data in enumerate(result.images):
            name = f"{i}.{result.output_format}"
            self._write(self._path("objects", key, name), data)
            names.append((name, len(data)))
        return names

    def put_tensors(self, key: str, data: bytes) -> tuple[str, int]:
        """Store a result's tensor file (`formats.tensor_file`) beside its files."""
        self._write(self._path("objects", key, TENSORS_FILE), data)
        return TENSORS_FILE, len(data)

    def get_output(self, key: str, name: str) -> tuple[bytes, str] | None:
        """A stored file and its content type; None if there is none."""
        if name == TENSORS_FILE:
            data = self._read(self._path("objects", key, name))
            return (data, SAFETENSORS) if data is not None else None
        stem, _, fmt = name.partition(".")
        if not stem.isdigit() or fmt not in MEDIA_TYPES:
            return None
        data = self._read(self._path("objects", key, name))
        return (data, MEDIA_TYPES[fmt]) if data is not None else None

    # ------------------------------------------------------------------ retention

    def keys(self) -> list[str]:
        try:
            return [
                posixpath.basename(p.rstrip("/")) for p in self.fs.ls(self._path("objects"), detail=False)
            ]
        except FileNotFoundError:
            return []

    def delete(self, key: str) -> None:
        try:
            self.fs.rm(self._path("objects", key), recursive=True)
        except FileNotFoundError:
            pass

    def usage(self) -> list[tuple[str, float, int, bool]]:
        """(key, created, bytes, finished) of everything stored."""
        out = []
        for key in self.keys():
            files = self.fs.find(self._path("objects", key), detail=True)
            size = sum(int(info.get("size") or 0) for info in files.values())
            job = self.load_job(key) if key.startswith(JOB_PREFIX) else None
            if job is not None:
                out.append((key, job.finished_at or job.created_at, size, job.finished))
                continue
            meta = self._read(self._path("objects", key, "meta.json"))
            # No date yet: just created (or a job's record still being written); keep it.
            created = json.loads(meta)["created"] if meta else time.time()
            out.append((key, created, size, meta is not None or not key.startswith(JOB_PREFIX)))
        return out

    def prune(self, max_age_s: float, max_bytes: float, now: float | None = None) -> list[str]:
        """Delete finished things older than `max_age_s`, then the oldest finished ones until
        the total is under `max_bytes`. Unfinished jobs are never deleted. Returns the keys."""
        now = now if now is not None else time.time()
        items = sorted(self.usage(), key=lambda it: it[1])
        gone = [k for k, created, _, done in items if done and now - created > max_age_s]
        total = sum(size for k, _, size, _ in items if k not in gone)
        for key, _, size, done in items:
            if total <= max_bytes:
                break
            if done and key not in gone:
                gone.append(key)
                total -= size
        for key in gone:
            self.delete(key)
        return gone
