"""The result cache of one ingress replica: a request that chose its seed, whose every input
that changes pixels equals an earlier request's, is answered with that request's stored result.

The key is a digest of the prepared request (every default filled in: model, checkpoint and its
source, size, steps, guidance, sampler and schedule, step caching, extra arguments, the input
image's and mask's pixels, the output format and what else is returned) without what names the
request and not its pixels (its id, its owner, its tenant's weight; its tenant too where the
cache is shared across tenants), and with the identity of each file the request reads: each
adapter's registered entry and its file's size and modification time, and the checkpoint
source's. An adapter registered again under its name (another file, or the same file written
again) so gets other keys; its old entries are never asked for again and age out. Bounded by
bytes, least recently used first; a result larger than `max_entry_bytes` is not kept. No
diffusers or torch here.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from pathlib import Path

from serve_app.config import ResultCacheConfig
from serve_app.schemas import GenerationResult, PreparedRequest, StageMetrics

MAX_FILES = 256  # of a directory (an adapter or checkpoint) whose files key its results
# Fields that name a request or say whose it is, not what it makes.
_NOT_PIXELS = {"request_id", "owner", "tenant_weight", "seed_given", "priority"}


def _file_identity(path: str | None, roots: list[str]) -> list:
    """The size and modification time of `path` (relative: under the first root), or the path
    alone where it is no local file (a hub id)."""
    if not path:
        return []
    p = Path(path)
    if not p.is_absolute() and roots:
        p = Path(roots[0]) / p
    try:
        st = p.stat()
        if p.is_dir():  # a directory's files (and its subdirectories' files), not the directory
            files = sorted(f for f in [*p.iterdir(), *p.glob("*/*")] if f.is_file())[:MAX_FILES]
            return [path, [(str(f.relative_to(p)), f.stat().st_size, f.stat().st_mtime_ns) for f in files]]
    except OSError:
        return [path]
    return [path, st.st_size, st.st_mtime_ns]


def result_bytes(result: GenerationResult) -> int:
    """What a kept result holds: its encoded images and its tensors."""
    n = sum(len(b) for b in result.images)
    tensors = [result.latents] if result.latents is not None else []
    if result.trajectory is not None:
        t = result.trajectory
        tensors += [*t.latents, *(x for x in (t.start, t.log_probs) if x is not None)]
    return n + sum(len(x.data) for x in tensors)


class ResultCache:
    """Kept results by key, least recently used first out; counts hits, misses and bytes."""

    def __init__(self, cfg: ResultCacheConfig, lora_roots: list[str]):
        self.cfg = cfg
        self._roots = list(lora_roots)
        self._kept: OrderedDict[str, tuple[GenerationResult, int]] = OrderedDict()
        # Each model's denoiser weights as a trainer last pushed them (`push_weights`): part of
        # every key, so a push leaves the results made before it behind.
        self.weights: dict[str, int | None] = {}
        self.bytes = 0
        self.hits = self.misses = self.bypasses = 0

    def key(self, request: PreparedRequest) -> str | None:
        """The request's key; None where it is never answered from the cache (the cache is off,
        or the server chose its seed)."""
        if not self.cfg.enabled or not request.seed_given:
            return None
        leave_out = _NOT_PIXELS | ({"tenant"} if self.cfg.shared_across_tenants else set())
        fields = request.model_dump(mode="json", exclude=leave_out)
        files = [_file_identity(ref.path, self._roots) for ref in request.loras]
        files.append(_file_identity(request.checkpoint_source, []))
        blob = json.dumps(
            [fields, files, self.weights.get(request.model)], sort_keys=True, separators=(",", ":")
        )
        return hashlib.sha256(blob.encode()).hexdigest()

    def get(self, key: str, request: PreparedRequest) -> GenerationResult | None:
        """The kept result for `key`, as this request's answer (its id, `metrics.cache` "hit");
        None on a miss (counted)."""
        t0 = time.perf_counter()
        kept = self._kept.get(key)
        if kept is None:
            self.misses += 1
            return None
        self._kept.move_to_end(key)
        self.hits += 1
        result = kept[0]
        metrics = StageMetrics(
            cache="hit", steps=result.metrics.steps, total_ms=(time.perf_counter() - t0) * 1e3
        )
        return result.model_copy(update={"request_id": request.request_id, "metrics": metrics, "attempts": 0})

    def put(self, key: str, result: GenerationResult, model: str) -> GenerationResult:
        """Keep `result` under `key` (unless it is too large, or made with other weights of
        `model` than the last pushed), evicting the least recently used past `max_bytes`;
        returns it marked as a miss."""
        result = result.model_copy(update={"metrics": result.metrics.model_copy(update={"cache": "miss"})})
        size = result_bytes(result)
        if size > min(self.cfg.max_entry_bytes, self.cfg.max_bytes):
            return result
        if result.weights_version != self.weights.get(model):  # a push came while it was made
            return result
        old = self._kept.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        self._kept[key] = (result, size)
        self.bytes += size
        while self.bytes > self.cfg.max_bytes:
            _, (_, gone) = self._kept.popitem(last=False)
            self.bytes -= gone
        return result

    def bypassed(self, result: GenerationResult) -> GenerationResult:
        """`result` of a request that asked not to be served from the cache."""
        self.bypasses += 1
        return result.model_copy(update={"metrics": result.metrics.model_copy(update={"cache": "bypass"})})

    def __len__(self) -> int:
        return len(self._kept)
