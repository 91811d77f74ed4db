"""Step caching (`acceleration`) at the engine, on the UNet twin and the transformer twins.

What caching must do: run the cached blocks on fewer steps (counted, not timed), change the
image only a little, keep a row's image independent of the rows it shares a call with, and
leave nothing behind (the next uncached call is bit-identical to an uncached call before).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from PIL import Image

from serve_app.config import ModelConfig
from serve_app.engine import CallParams, DiffusionEngine, Row
from serve_app.engine.engine import ModelLoadError, find_denoiser
from serve_app.engine.step_cache import LEVELS, cached_blocks
from tests.conftest import engine_cache

STEPS = 10


@pytest.fixture(scope="module")
def engines():
    with engine_cache() as get:
        yield get


def psnr(a, b) -> float:
    mse = float(np.mean((np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


# Which of 10 steps run the cached blocks in full: the first two, then every 2nd (fast) or
# 4th (faster) step, and always the last.
FULL_STEPS = {"none": set(range(STEPS)), "fast": {0, 1, 3, 5, 7, 9}, "faster": {0, 1, 3, 7, 9}}


class BlockRuns:
    """Per denoiser call, whether the first cached block ran in full (its first part only runs
    then)."""

    def __init__(self, engine: DiffusionEngine):
        den = find_denoiser(engine.pipe)
        blocks = cached_blocks(den)
        assert blocks, "nothing to cache"
        self.calls: list[bool] = []
        inner = next(den.get_submodule(blocks[0]).children())
        self._handles = [
            den.register_forward_pre_hook(lambda *_: self.calls.append(False)),
            inner.register_forward_hook(lambda *_: self.calls.__setitem__(-1, True)),
        ]

    def full_steps(self, calls_per_step: int = 1) -> list[set[int]]:
        """For each denoiser call of a step (cond, uncond...), the steps that ran in full."""
        return [
            {i // calls_per_step for i, ran in enumerate(self.calls) if ran and i % calls_per_step == k}
            for k in range(calls_per_step)
        ]

    def close(self) -> None:
        for h in self._handles:
            h.remove()


@pytest.mark.parametrize("name", ["tiny-sd", "tiny-sd3", "tiny-flux"])
def test_cached_blocks_run_on_fewer_steps_and_the_image_stays_close(engines, name):
    e = engines(name)
    assert e.accelerations == LEVELS and e.describe()["accelerations"] == list(LEVELS)
    runs = BlockRuns(e)
    rows = [Row("a red circle", None, 1), Row("a blue square", None, 2)]
    images = {}
    try:
        for level in ("none", "fast", "faster", "none"):
            runs.calls.clear()
            p = CallParams(height=32, width=32, steps=STEPS, guidance_scale=4.0, acceleration=level)
            out = e.run(rows, p)
            images.setdefault(level, []).append(out.images)
            assert runs.full_steps() == [FULL_STEPS[level]], level
            alone = e.run(rows[1:], p).images[0]
            # A row's image does not depend on the rows it shared the call with.
            assert np.abs(np.asarray(alone, int) - np.asarray(out.images[1], int)).max() <= 2, level
    finally:
        runs.close()
    none, again = images["none"]
    for a, b in zip(none, again, strict=True):  # the hooks are gone after a cached call
        assert np.array_equal(np.asarray(a), np.asarray(b))
    for level in ("fast", "faster"):
        for cached, full in zip(images[level][0], none, strict=True):
            db = psnr(cached, full)
            assert 12 < db < math.inf, (level, db)  # changed, and only a little


def test_two_denoiser_calls_a_step_keep_a_cache_each_and_img2img_ends_on_a_full_step(engines):
    """FLUX img2img with a negative prompt (true CFG) calls the transformer twice a step without
    naming the calls; each call keeps its own cache, and the last of the 8 steps that
    strength 0.75 leaves of 10 runs in full."""
    e = engines("tiny-flux")
    image = Image.fromarray((np.random.default_rng(0).random((32, 32, 3)) * 255).astype("uint8"))
    rows = [Row("a red circle", "blue", 1, image=image)]
    runs, out = BlockRuns(e), {}
    try:
        for level in ("none", "fast"):
            runs.calls.clear()
            p = CallParams(height=32, width=32, steps=STEPS, guidance_scale=4.0, task="img2img",
                           strength=0.75, extra=(("true_cfg_scale", 4.0),), acceleration=level)  # fmt: skip
            out[level] = e.run(rows, p).images[0]
            assert len(runs.calls) == 16, len(runs.calls)
            full = set(range(8)) if level == "none" else {0, 1, 3, 5, 7}
            assert runs.full_steps(calls_per_step=2) == [full, full], level
    finally:
        runs.close()
    assert 30 < psnr(out["fast"], out["none"]) < math.inf


def test_a_model_that_cannot_cache_refuses_the_setting_at_start():
    from serve_app.config import Optimizations

    cfg = ModelConfig(
        source="builtin:tiny-sd", device="cpu", warmup=False,
        optimizations=Optimizations(compile_denoiser=True, step_cache="fast"),
    )  # fmt: skip
    with pytest.raises(ModelLoadError, match="model.optimizations.step_cache"):
        DiffusionEngine(cfg)
