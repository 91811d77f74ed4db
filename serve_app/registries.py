"""The registries: which adapters and which checkpoints are registered, by name, and which are
pinned. The ingress changes them (its admin routes); every replica reads them (the pinned ones
it holds, a checkpoint it is asked for), including one that starts later.

Each is a JSON file written atomically under a lock, so it survives a restart of the app and
every replica reads the same state. On several machines, put it on a path they share (a local
path or any fsspec URL). What a registered file is and whether it may be registered is
`serve_app.formats`' business; a registry keeps names, sources and pins.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import time
from collections.abc import Callable
from typing import Any

from serve_app.errors import InvalidRequest, NotFound, ServingError

# Under the first adapter root: where a trainer's pushed adapter versions are kept (ingress/admin.py).
PUSHED_DIR = ".pushed"
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def check_name(name: str) -> str:
    """An adapter's name, or InvalidRequest saying what a name may be."""
    if not NAME_PATTERN.fullmatch(name):
        raise InvalidRequest(
            "name: 1-64 characters of letters, digits, '.', '_' or '-', starting with a letter or digit",
            param="name",
        )
    return name


# A checkpoint's name: it may start with '_' or '-' (an adapter's may not) and is longer.
CHECKPOINT_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$")


def check_checkpoint_name(name: str) -> None:
    if not isinstance(name, str) or not CHECKPOINT_NAME.fullmatch(name):
        raise InvalidRequest(
            "name: 1-128 characters of letters, digits, '.', '_' or '-', not starting with '.' "
            "(no '/', '.' or '..': a name is not a path)",
            param="name",
        )


class Registry:
    """Registered adapters by name: {path, scale, pinned}. Every method re-reads the file.

    `path` is a local path or any fsspec URL (`s3://bucket/loras.json`, ...) that several
    machines share. Changes are serialised by a lock: `flock` on a local file, elsewhere a lock
    file created exclusively (one older than `STALE_LOCK_S` is taken to be a crashed writer's).
    """

    STALE_LOCK_S = 30.0

    def __init__(self, path: str):
        import fsspec
        from fsspec.implementations.local import LocalFileSystem

        self.fs, self.path = fsspec.core.url_to_fs(os.path.expanduser(path))
        self.local = isinstance(self.fs, LocalFileSystem)
        self.lock_path = os.path.splitext(self.path)[0] + ".lock"

    @contextlib.contextmanager
    def _locked(self):
        self.fs.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        if self.local:
            with open(self.lock_path, "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                try:
                    yield
                finally:
                    fcntl.flock(lock, fcntl.LOCK_UN)
            return
        deadline = time.monotonic() + 2 * self.STALE_LOCK_S
        while True:
            try:
                with self.fs.open(self.lock_path, "xb") as f:
                    f.write(str(time.time()).encode())
                break
            except FileExistsError:
                try:
                    with self.fs.open(self.lock_path, "rb") as f:
                        taken = float(f.read() or 0)
                except (FileNotFoundError, ValueError):
                    taken = 0.0
                if time.time() - taken > self.STALE_LOCK_S:
                    self.fs.rm(self.lock_path)  # its writer crashed
                elif time.monotonic() > deadline:
                    raise ServingError("the adapter registry stays locked; try again") from None
                else:
                    time.sleep(0.05)
        try:
            yield
        finally:
            self.fs.rm(self.lock_path)

    def _read(self) -> dict[str, dict[str, Any]]:
        try:
            with self.fs.open(self.path, "rb") as f:
                return json.loads(f.read())
        except FileNotFoundError:
            return {}

    def _write(self, data: dict[str, dict[str, Any]]) -> None:
        tmp = f"{self.path}.tmp{os.getpid()}"
        with self.fs.open(tmp, "wb") as f:
            f.write(json.dumps(data, indent=1, sort_keys=True).encode())
        self.fs.mv(tmp, self.path)

    def all(self) -> dict[str, dict[str, Any]]:
        with self._locked():
            return self._read()

    def get(self, name: str) -> dict[str, Any]:
        entry = self.all().get(name)
        if entry is None:
            raise NotFound(f"lora: no adapter named {name!r} is registered", param="lora")
        return entry

    def add(
        self, name: str, path: str, scale: float, pinned: bool = False, model: str | None = None
    ) -> dict[str, Any]:
        """Register `name` (for `model`: the one model it serves, where there are several)."""
        with self._locked():
            data = self._read()
            if name in data:
                raise InvalidRequest(f"name: an adapter named {name!r} is already registered", param="name")
            data[name] = {"path": path, "scale": scale, "pinned": pinned}
            if model is not None:
                data[name]["model"] = model
            self._write(data)
            return data[name]

    def push(
        self, name: str, scale: float, model: str, claim: Callable[[int], tuple[int, str]]
    ) -> dict[str, Any]:
        """Register the next version of pushed adapter `name`: `claim(last version)` (run under
        the lock, so concurrent pushes take turns) gives its number and puts its file in place;
        an adapter registered from a file is not replaced this way."""
        with self._locked():
            data = self._read()
            old = data.get(name)
            if old is not None and "version" not in old:
                raise InvalidRequest(
                    f"name: adapter {name!r} is registered from a file; remove it before pushing one",
                    param="name",
                )
            version, path = claim((old or {}).get("version", 0))
            data[name] = {"path": path, "scale": scale, "pinned": False, "model": model, "version": version}
            self._write(data)
            return data[name]

    # How its messages name an entry, and the field that names it in a removal's message.
    what, removal_field = "adapter", "lora"

    def remove(self, name: str) -> dict[str, Any]:
        with self._locked():
            data = self._read()
            if name not in data:
                raise NotFound(
                    f"{self.removal_field}: no {self.what} named {name!r} is registered", param="name"
                )
            entry = data.pop(name)
            self._write(data)
            return entry

    def pin(self, name: str, pinned: bool, max_pinned: int, default: str | None = None) -> dict[str, Any]:
        """Pin or unpin; at most `max_pinned` pinned adapters per model (`default`: the model of
        entries that name none, registered before there were several)."""
        with self._locked():
            data = self._read()
            if name not in data:
                raise NotFound(f"lora: no adapter named {name!r} is registered", param="name")
            model = data[name].get("model") or default  # a replica holds the pinned adapters of its model
            others = sum(
                1
                for n, e in data.items()
                if e["pinned"] and n != name and (e.get("model") or default) == model
            )
            if pinned and others >= max_pinned:
                raise InvalidRequest(
                    f"pin: {others} adapters are pinned already and a replica holds at most {max_pinned}",
                    param="name",
                )
            data[name]["pinned"] = pinned
            self._write(data)
            return data[name]


class CheckpointRegistry(Registry):
    """Registered checkpoints by name: {source, pool, family, pinned}. Every method re-reads
    the file; `path` is a local path or an fsspec URL, locked and written as `Registry`."""

    what, removal_field = "checkpoint", "name"

    def get(self, name: str) -> dict[str, Any]:
        entry = self.all().get(name)
        if entry is None:
            raise NotFound(f"model: no checkpoint named {name!r} is registered", param="model")
        return entry

    def add(  # type: ignore[override]  # a checkpoint's fields, not an adapter's
        self, name: str, source: str, pool: str, family: str | None
    ) -> dict[str, Any]:
        with self._locked():
            data = self._read()
            if name in data:
                raise InvalidRequest(f"name: a checkpoint named {name!r} is already registered", param="name")
            data[name] = {"source": source, "pool": pool, "family": family, "pinned": False}
            self._write(data)
            return data[name]

    def pin(self, name: str, pinned: bool, max_pinned: int) -> dict[str, Any]:
        """Pin or unpin `name`; at most `max_pinned` pinned checkpoints in its pool (each of the
        pool's replicas holds every pinned one)."""
        with self._locked():
            data = self._read()
            if name not in data:
                raise NotFound(f"name: no checkpoint named {name!r} is registered", param="name")
            pool = data[name]["pool"]
            others = sum(1 for n, e in data.items() if e["pinned"] and e["pool"] == pool and n != name)
            if pinned and others >= max_pinned:
                raise InvalidRequest(
                    f"pinned: {others} checkpoints of pool {pool!r} are pinned already and its replicas "
                    f"hold at most {max_pinned} pinned",
                    param="pinned",
                )
            data[name]["pinned"] = pinned
            self._write(data)
            return data[name]
