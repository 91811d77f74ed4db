"""Which LoRA adapters one replica holds: load on demand, least recently used evicted first,
pinned ones never. Runs on the engine thread (loading and unloading touch the pipeline)."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable

from serve_app.engine import LoraError

logger = logging.getLogger("ray.serve")


class AdapterResidency:
    def __init__(self, engine, max_loaded: int, on_change: Callable[[list[str]], None] | None = None):
        self.engine = engine
        self.max_loaded = max_loaded
        self._loaded: collections.OrderedDict[str, str] = collections.OrderedDict()  # LRU first
        self._pinned: set[str] = set()
        self._on_change = on_change or (lambda names: None)
        self.loads = 0
        self.evictions = 0

    @property
    def loaded(self) -> list[str]:
        return list(self._loaded)

    @property
    def pinned(self) -> list[str]:
        return sorted(self._pinned)

    def hold(self, name: str, path: str, pin: bool = False) -> None:
        """Make `name` loaded here, evicting the least recently used unpinned adapter if full."""
        if pin:
            self._pinned.add(name)
        if name in self._loaded:
            self._loaded.move_to_end(name)
            return
        while len(self._loaded) >= self.max_loaded:
            victim = next((n for n in self._loaded if n not in self._pinned), None)
            if victim is None:
                if pin:
                    self._pinned.discard(name)
                raise LoraError(
                    f"all {self.max_loaded} adapter slots of this replica hold pinned adapters "
                    f"({', '.join(self._loaded)}); unpin one or raise lora.max_loaded"
                )
            self.engine.unload_lora(victim)
            del self._loaded[victim]
            self.evictions += 1
        t = time.perf_counter()
        self.engine.load_lora(name, path)
        self._loaded[name] = path
        self.loads += 1
        logger.info("loaded adapter %s in %.0f ms", name, (time.perf_counter() - t) * 1e3)
        self._on_change(self.loaded)

    def unpin(self, name: str) -> None:
        self._pinned.discard(name)

    def drop(self, name: str) -> bool:
        """Evict `name` (pinned or not); False if it was not loaded here."""
        self._pinned.discard(name)
        if name not in self._loaded:
            return False
        self.engine.unload_lora(name)
        del self._loaded[name]
        self._on_change(self.loaded)
        return True

    def check(self, path: str) -> None:
        """Load a candidate file under a scratch name and drop it again; LoraError if unusable."""
        self.engine.load_lora("__candidate__", path)
        self.engine.unload_lora("__candidate__")
