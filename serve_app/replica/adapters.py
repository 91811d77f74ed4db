"""Which LoRA adapters one replica holds: load on demand, least recently used evicted first,
pinned ones never, within a count (`lora.max_loaded`) and a size (`lora.max_loaded_mb`).

Reading an adapter's file (the slow part: storage, safetensors, the checks) runs on a reader
thread as soon as a request names an adapter the replica lacks (`prefetch`), while the engine
thread goes on with the calls in flight; installing it into the pipeline (`hold`) runs on the
engine thread between calls, and waits for the read only if it has not ended by then."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from serve_app import metrics
from serve_app.engine import LoraError
from serve_app.errors import InvalidRequest
from serve_app.replica.routing import replica_id

logger = logging.getLogger("ray.serve")


def _state_bytes(state: dict) -> int:
    return sum(v.numel() * v.element_size() for v in state.values())


class AdapterResidency:
    def __init__(
        self,
        engine,
        max_loaded: int,
        on_change: Callable[[list[str]], None] | None = None,
        max_bytes: int | None = None,
    ):
        self.engine = engine
        self.max_loaded = max_loaded
        self.max_bytes = max_bytes
        # name -> bytes of its weights, least recently used first
        self._loaded: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._pinned: set[str] = set()
        self._on_change = on_change or (lambda names: None)
        self._lock = threading.Lock()  # `_staged` is filled on the event loop, emptied on the engine thread
        self._staged: collections.OrderedDict[str, tuple[str, Future]] = collections.OrderedDict()
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adapter-reader")
        self.loads = 0
        self.evictions = 0
        self.prefetched = 0  # loads whose file had been read off the engine thread

    @property
    def loaded(self) -> list[str]:
        return list(self._loaded)

    @property
    def pinned(self) -> list[str]:
        return sorted(self._pinned)

    @property
    def loaded_bytes(self) -> int:
        return sum(self._loaded.values())

    def prefetch(self, name: str, path: str) -> None:
        """Start reading `name`'s file on the reader thread unless it is held or being read."""
        with self._lock:
            if name in self._loaded or (name in self._staged and self._staged[name][0] == path):
                return
            self._staged[name] = (path, self._reader.submit(self.engine.read_lora, path))
            while len(self._staged) > 2 * self.max_loaded:  # reads nobody came back for
                self._staged.popitem(last=False)

    def _read(self, name: str, path: str) -> dict:
        with self._lock:
            staged = self._staged.pop(name, None)
        if staged is not None and staged[0] == path:
            self.prefetched += 1
            return staged[1].result()  # re-raises the read's LoraError
        return self.engine.read_lora(path)

    def hold(self, name: str, path: str, pin: bool = False, keep: Iterable[str] = ()) -> None:
        """Make `name` loaded here, evicting least recently used unpinned adapters (never one in
        `keep`: the other adapters of the same call) until it fits."""
        if pin:
            self._pinned.add(name)
        if name in self._loaded:
            self._loaded.move_to_end(name)
            return
        try:
            t = time.perf_counter()
            state = self._read(name, path)
            read_ms = (time.perf_counter() - t) * 1e3
            size = _state_bytes(state)
            if pin and self.max_bytes is not None:
                pinned = sum(self._loaded[n] for n in self._pinned if n in self._loaded)
                if pinned + size > self.max_bytes:
                    raise LoraError(
                        f"pinned adapters would hold {(pinned + size) / 2**20:.3g} MiB on this replica, "
                        f"over lora.max_loaded_mb={self.max_bytes / 2**20:g}; unpin one or raise it"
                    )
            self._make_room(size, {name, *keep})
        except LoraError:
            if pin:
                self._pinned.discard(name)
            raise
        t = time.perf_counter()
        self.engine.load_lora(name, path, state)
        self._loaded[name] = size
        self.loads += 1
        metrics.count_lora_load(self.engine.model_name)
        logger.info(
            "loaded adapter %s (%.3g MiB): read %.0f ms, installed in %.0f ms",
            name,
            size / 2**20,
            read_ms,
            (time.perf_counter() - t) * 1e3,
        )
        self._on_change(self.loaded)

    def _make_room(self, size: int, keep: set[str]) -> None:
        def over() -> bool:
            if len(self._loaded) >= self.max_loaded:
                return True
            return self.max_bytes is not None and self.loaded_bytes + size > self.max_bytes

        while over():
            victim = next((n for n in self._loaded if n not in self._pinned and n not in keep), None)
            if victim is None:
                if len(self._loaded) < self.max_loaded:
                    # Over the size only: the call's adapters are held together even when their
                    # sum passes max_loaded_mb; the next load evicts back under it.
                    return
                raise LoraError(
                    f"all {self.max_loaded} adapter slots of this replica hold pinned adapters "
                    f"({', '.join(self._loaded)}); unpin one or raise lora.max_loaded"
                )
            self._unload(victim)
            self.evictions += 1

    def _unload(self, name: str) -> None:
        self.engine.unload_lora(name)
        del self._loaded[name]

    def unpin(self, name: str) -> None:
        self._pinned.discard(name)

    def drop(self, name: str, versions: bool = True) -> bool:
        """Evict `name` (pinned or not), and with `versions` every pushed version of it
        (`name@v<k>`); False if none was loaded here."""

        def named(n: str) -> bool:
            return n == name or (versions and n.startswith(f"{name}@v"))

        names = [n for n in self._loaded if named(n)]
        self._pinned.discard(name)
        with self._lock:
            for n in [n for n in self._staged if named(n)]:
                del self._staged[n]
        for n in names:
            self._unload(n)
        if names:
            self._on_change(self.loaded)
        return bool(names)

    def check(self, path: str) -> None:
        """Load a candidate file under a scratch name and drop it again; LoraError if unusable."""
        self.engine.load_lora("__candidate__", path)
        self.engine.unload_lora("__candidate__")

    def close(self) -> None:
        self._reader.shutdown(wait=False, cancel_futures=True)


class AdapterControl:
    """Mixed into the replica: the ingress's adapter calls (check, pin, evict, list, pushed
    versions) and a trainer's denoiser weights."""

    adapters: AdapterResidency

    async def _on_engine(self, fn, *args):
        raise NotImplementedError  # the replica's: run `fn` on the engine thread

    async def validate_lora(self, path: str) -> None:
        """Load a candidate adapter under a scratch name and drop it again; LoraError -> 400."""
        try:
            await self._on_engine(self.adapters.check, path)
        except LoraError as e:
            raise InvalidRequest(f"path: {e}", param="path") from None

    async def pin_lora(self, name: str, path: str, pinned: bool) -> list[str]:
        if pinned:
            try:
                await self._on_engine(self.adapters.hold, name, path, True)
            except LoraError as e:
                raise InvalidRequest(f"pin: {e}", param="name") from None
        else:
            self.adapters.unpin(name)
        return self.adapters.loaded

    async def evict_lora(self, name: str) -> bool:
        return await self._on_engine(self.adapters.drop, name)

    async def load_pushed_lora(self, name: str, version: int, path: str) -> list[str]:
        """Load version `version` of pushed adapter `name` (as `name@v<version>`), between two
        calls, and evict its older versions: calls that started with one finished with it, and
        a queued request for an older version loads that one again. LoraError -> 400."""

        def swap() -> None:
            held = {int(n.rsplit("@v", 1)[1]): n for n in self.adapters.loaded if n.startswith(f"{name}@v")}
            if any(v > version for v in held):  # a later push came first: keep that one
                return
            self.adapters.hold(f"{name}@v{version}", path)
            for old in [n for v, n in held.items() if v < version]:
                self.adapters.drop(old, versions=False)

        try:
            await self._on_engine(swap)
        except LoraError as e:
            raise InvalidRequest(f"weights: {e}", param="weights") from None
        return self.adapters.loaded

    async def load_denoiser_weights(self, weights: dict[str, Any], version: int) -> dict[str, Any]:
        """A trainer's denoiser weights (from the object store) copied in between two calls;
        ValueError (a misfit) -> 400 naming `weights`."""
        try:
            copied = await self._on_engine(self.adapters.engine.load_denoiser_weights, weights, version)
        except ValueError as e:
            raise InvalidRequest(str(e), param="weights") from None
        return {"replica_id": replica_id(), "copied": copied, "weights_version": version}

    def loaded_loras(self) -> dict[str, Any]:
        return {"replica_id": replica_id(), "loaded": self.adapters.loaded, "pinned": self.adapters.pinned}
