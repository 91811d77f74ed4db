"""Which checkpoints one pool replica holds as engines: loaded on demand, least recently used
evicted first, pinned ones never, at most `max_held`.

Loading an engine (storage, safetensors, moving weights to the device) runs on a loader thread
of its own, never on the event loop nor on the engine thread, and one checkpoint is loaded
once however many requests wait for it. Checkpoints that share components (fine-tunes of one
base keep its text encoders and VAE) hold them once: a component whose files match one a held
engine loaded is handed to the new engine instead of being loaded again.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from serve_app.errors import InvalidRequest

if TYPE_CHECKING:
    from serve_app.engine.protocol import Engine

logger = logging.getLogger("ray.serve")

_CHUNK = 1 << 20


@functools.lru_cache(maxsize=8192)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    """sha256 of one file's contents; cached while its size and modification time stay."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _folder_digest(folder: Path, kind: Any) -> str:
    """sha256 over a component folder's class (from model_index.json), its files' names
    relative to it and their contents."""
    h = hashlib.sha256(json.dumps(kind).encode())
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        st = path.stat()
        h.update(str(path.relative_to(folder)).encode() + b"\0")
        h.update(_file_digest(str(path.resolve()), st.st_size, st.st_mtime_ns).encode())
    return h.hexdigest()


_NEVER_SHARED = ("unet", "transformer", "prior", "scheduler")


def component_fingerprints(directory: str) -> dict[str, str]:
    """Component name -> fingerprint, for each component folder model_index.json names (unet,
    vae, text_encoder, tokenizer, ...): equal fingerprints, identical components. {} for what
    is not a pipeline directory (a hub id, a builtin model)."""
    root = Path(directory)
    try:
        index = json.loads((root / "model_index.json").read_bytes())
    except (OSError, ValueError):
        return {}
    out = {}
    for name, kind in index.items():
        if name.startswith("_") or not (isinstance(kind, list) and kind and kind[-1]):
            continue
        if name in _NEVER_SHARED:  # each engine's own (and the largest files: not hashed)
            continue
        if (root / name).is_dir():
            out[name] = _folder_digest(root / name, kind)
    return out


@dataclass
class _Held:
    source: str
    engine: Any
    fingerprints: dict[str, str] = field(default_factory=dict)


class CheckpointResidency:
    """The engines of one replica, by checkpoint name. Its methods are called on the replica's
    event loop; only loads run elsewhere (the loader thread)."""

    def __init__(
        self,
        load: Callable[[str, str, dict], Engine],
        max_held: int,
        on_change: Callable[[list[str]], None] | None = None,
    ):
        if max_held < 1:
            raise ValueError("max_held: a replica holds at least one checkpoint")
        self._load = load
        self.max_held = max_held
        self._on_change = on_change or (lambda names: None)
        self._held: collections.OrderedDict[str, _Held] = collections.OrderedDict()  # LRU first
        self._pinned: set[str] = set()
        self._loading: dict[str, tuple[str, asyncio.Future]] = {}
        self._dropped: set[str] = set()  # dropped while loading: not held when the load ends
        self._tasks: set[asyncio.Task] = set()
        self._loader = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="checkpoint-loader", initializer=_lower_priority
        )
        self._counts_lock = threading.Lock()
        self.loads = 0
        self.evictions = 0
        self.shared_components = 0  # modules handed to a new engine instead of loaded

    @property
    def held(self) -> list[str]:
        """Held checkpoints, least recently used first."""
        return list(self._held)

    @property
    def pinned(self) -> list[str]:
        return sorted(self._pinned)

    async def engine(self, name: str, source: str) -> Engine:
        """`name`'s engine: the held one (now the most recently used), else loaded, once for all
        the callers that wait for it; a failed load raises its error to each and is forgotten."""
        held = self._held.get(name)
        if held is not None and held.source == source:
            self._held.move_to_end(name)
            return held.engine
        self._dropped.discard(name)  # asked for again after a drop: held once loaded
        loading = self._loading.get(name)
        if loading is None or loading[0] != source:
            loading = (source, asyncio.get_running_loop().create_future())
            self._loading[name] = loading
            task = asyncio.create_task(self._load_into(name, source, loading[1]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        # shielded: a waiter that goes away does not cancel the load the others wait for
        return await asyncio.shield(loading[1])

    async def _load_into(self, name: str, source: str, done: asyncio.Future) -> None:
        # What it may share is taken now; then room is made, so that a replica holds at most
        # `max_held` engines while the new one loads (calls in flight keep theirs).
        others = [(_components(h.engine), h.fingerprints) for n, h in self._held.items() if n != name]
        self._make_room(name)
        current = True
        try:
            engine, fingerprints = await asyncio.get_running_loop().run_in_executor(
                self._loader, self._build, name, source, others
            )
        except Exception as e:  # every waiter gets the loader's error; nothing is kept
            done.set_exception(e)
            done.exception()  # retrieved: no "never retrieved" warning when no waiter is left
            return
        except asyncio.CancelledError:
            done.cancel()
            raise
        finally:
            current = self._loading.get(name, (None, None))[1] is done
            if current:
                del self._loading[name]
        if current and name not in self._dropped:
            self._held[name] = _Held(source, engine, fingerprints)
            self._held.move_to_end(name)
            self._evict()
            self._on_change(self.held)
        if current:
            self._dropped.discard(name)
        done.set_result(engine)

    def _build(self, name: str, source: str, others: list[tuple[Any, dict[str, str]]]):
        """On the loader thread: the components of held engines this checkpoint shares, then
        its engine."""
        t = time.perf_counter()
        fingerprints = component_fingerprints(source) if os.path.isdir(source) else {}
        offered: dict[str, Any] = {}  # fingerprint -> a held engine's module
        for modules, prints in others:
            for comp, module in modules.items():
                if comp in prints:
                    offered.setdefault(prints[comp], module)
        reuse = {comp: offered[fp] for comp, fp in fingerprints.items() if fp in offered}
        engine = self._load(name, source, reuse)
        with self._counts_lock:
            self.loads += 1
            self.shared_components += len(reuse)
        logger.info(
            "loaded checkpoint %s in %.1fs%s", name, time.perf_counter() - t,
            f" (sharing {', '.join(sorted(reuse))})" if reuse else "",
        )  # fmt: skip
        return engine, fingerprints

    def _make_room(self, name: str) -> None:
        """Before `name` loads: drop least recently used unpinned engines until it fits."""
        evicted = False
        while len([n for n in self._held if n != name]) >= self.max_held:
            victim = next((n for n in self._held if n not in self._pinned and n != name), None)
            if victim is None:
                break
            del self._held[victim]
            self.evictions += 1
            evicted = True
            logger.info("evicted checkpoint %s to make room for %s", victim, name)
        if evicted:
            self._on_change(self.held)

    def _evict(self) -> None:
        """Drop least recently used unpinned engines until at most `max_held` are held (calls
        in flight keep theirs until they end)."""
        while len(self._held) > self.max_held:
            victim = next((n for n in self._held if n not in self._pinned), None)
            if victim is None:
                return
            del self._held[victim]
            self.evictions += 1
            logger.info("evicted checkpoint %s", victim)

    async def pin(self, name: str, source: str) -> Engine:
        """Hold `name` (loaded if needed) and never evict it until `unpin` or `drop`."""
        if name not in self._pinned and len(self._pinned) >= self.max_held:
            raise InvalidRequest(
                f"pinned: {len(self._pinned)} checkpoints are pinned on this replica, which holds at most "
                f"{self.max_held}; unpin one first",
                param="pinned",
            )
        fresh = name not in self._pinned
        self._pinned.add(name)
        try:
            engine = await self.engine(name, source)
        except BaseException:
            if fresh:
                self._pinned.discard(name)
            raise
        self._on_change(self.held)
        return engine

    def unpin(self, name: str) -> None:
        if name in self._pinned:
            self._pinned.discard(name)
            self._evict()
            self._on_change(self.held)

    def drop(self, name: str) -> bool:
        """Forget `name` (pinned or not, and a load of it in flight); False if it was not held."""
        self._pinned.discard(name)
        if name in self._loading:
            self._dropped.add(name)
        if self._held.pop(name, None) is None:
            return False
        self._on_change(self.held)
        return True

    def close(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)
        self._held.clear()


def _components(engine) -> dict[str, Any]:
    components = getattr(engine, "components", None)
    return components() if callable(components) else {}


def _lower_priority() -> None:
    """The loader thread yields the cores to the engine thread (Linux: a thread's own nice value):
    a load may take longer, the calls of the models held must not."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):  # not Linux, or not allowed: load at the same priority
        pass
