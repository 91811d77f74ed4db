"""Step caching (`acceleration`) at the engine, on the UNet twin and the transformer twins.

What caching must do: run the cached blocks on fewer steps (counted, not timed), change the
image only a little, keep a row's image independent of the rows it shares a call with, and
leave nothing behind (the next uncached call is bit-identical to an uncached call before).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from serve_app.config import ModelConfig
from serve_app.engine import CallParams, DiffusionEngine, Row
from serve_app.engine.engine import ModelLoadError, find_denoiser
from serve_app.engine.step_cache import LEVELS, cached_blocks

STEPS = 10


@pytest.fixture(scope="module")
def engines():
    cache: dict[str, DiffusionEngine] = {}

    def get(name: str) -> DiffusionEngine:
        if name not in cache:
            cache[name] = DiffusionEngine(ModelConfig(source=f"builtin:{name}", device="cpu", warmup=False))
        return cache[name]

    yield get
    for e in cache.values():
        e.close()


def psnr(a, b) -> float:
    mse = float(np.mean((np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


@pytest.mark.parametrize("name", ["tiny-sd", "tiny-sd3", "tiny-flux"])
def test_cached_blocks_run_on_fewer_steps_and_the_image_stays_close(engines, name):
    e = engines(name)
    assert e.accelerations == LEVELS and e.describe()["accelerations"] == list(LEVELS)
    den = find_denoiser(e.pipe)
    blocks = cached_blocks(den)
    assert blocks, "nothing to cache"
    # The first part of a cached block runs only when the block runs in full.
    inner = next(den.get_submodule(blocks[0]).children())
    runs: list[int] = []
    handle = inner.register_forward_hook(lambda *_: runs.append(1))
    rows = [Row("a red circle", None, 1), Row("a blue square", None, 2)]
    images, counts = {}, {}
    try:
        for level in ("none", "fast", "faster", "none"):
            runs.clear()
            p = CallParams(height=32, width=32, steps=STEPS, guidance_scale=4.0, acceleration=level)
            out = e.run(rows, p)
            images.setdefault(level, []).append(out.images)
            counts[level] = len(runs)
            alone = e.run(rows[1:], p).images[0]
            # A row's image does not depend on the rows it shared the call with.
            assert np.abs(np.asarray(alone, int) - np.asarray(out.images[1], int)).max() <= 2, level
    finally:
        handle.remove()
    assert counts["none"] > counts["fast"] > counts["faster"] > 0, counts
    none, again = images["none"]
    for a, b in zip(none, again, strict=True):  # the hooks are gone after a cached call
        assert np.array_equal(np.asarray(a), np.asarray(b))
    for level in ("fast", "faster"):
        for cached, full in zip(images[level][0], none, strict=True):
            db = psnr(cached, full)
            assert 12 < db < math.inf, (level, db)  # changed, and only a little


def test_a_model_that_cannot_cache_refuses_the_setting_at_start():
    from serve_app.config import Optimizations

    cfg = ModelConfig(
        source="builtin:tiny-sd", device="cpu", warmup=False,
        optimizations=Optimizations(compile_denoiser=True, step_cache="fast"),
    )  # fmt: skip
    with pytest.raises(ModelLoadError, match="model.optimizations.step_cache"):
        DiffusionEngine(cfg)
