"""`builtin:shapes`, the model the project trains itself, judged by what its images show.

The checker (`serve_app.shapes.scenes.read_image`, tested on rendered scenes in test_shapes.py) reads
each image's colour, shape, position and background from pixels; these tests ask it whether a
prompt, an adapter, an inpainting mask and a step-cache setting did what they should.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from serve_app.engine import CallParams, Row
from serve_app.engine.builtin import GREEN_LORA
from serve_app.shapes import scenes
from tests.conftest import engine_cache
from tests.test_step_cache import psnr

# Statistics over many 20-step images of the trained model, and a training run.
pytestmark = pytest.mark.slow
GUIDANCE = 4.0  # serve_config.yaml's default for this model
SEEDS = list(range(10))


@pytest.fixture(scope="module")
def engine():
    with engine_cache() as get:
        yield get("shapes")


def params(**kw) -> CallParams:
    return CallParams(height=64, width=64, steps=kw.pop("steps", 20), guidance_scale=GUIDANCE, **kw)


def read_rows(engine, rows: list[Row], **kw) -> list[scenes.Reading]:
    """The checker's reading of each row's image, all rows in one engine call."""
    return [scenes.read_image(im) for im in engine.run(rows, params(**kw)).images]


def readings(engine, prompt: str, seeds=SEEDS, **kw) -> list[scenes.Reading]:
    return read_rows(engine, [Row(prompt, None, s) for s in seeds], **kw)


def test_a_red_circle_is_a_red_circle_in_at_least_9_of_10_seeds(engine):
    """With its background named: left to the model, the background is sometimes one the red
    object is read against as another colour (the previous weights: 7 of 10; docs/shapes-model.md)."""
    got = readings(engine, "a red circle on a blue background")
    hits = [r.colour == "red" and r.shape == "circle" and r.colour_fraction > 0.6 for r in got]
    assert sum(hits) >= 9, got


def test_a_triangle_is_drawn_as_one_in_at_least_7_of_10_seeds(engine):
    """The shape word, on its own colours: weights trained with the plain loss only (the earlier
    recipe's first two cycles, before any aimed at the shape) drew 5 of 10 (docs/shapes-model.md)."""
    got = readings(engine, "a yellow triangle on a black background")
    assert sum(r.shape == "triangle" for r in got) >= 7, got


def test_a_yellow_star_on_black_is_drawn_as_one_in_at_least_8_of_10_seeds(engine):
    """The first prompt of the README and the playground: weights aimed at the shape but not
    on more stars (the earlier recipe before its balancing cycle) drew 2 of 10
    (docs/shapes-model.md)."""
    got = readings(engine, "a yellow star on a black background")
    hits = [(r.colour, r.shape, r.background) == ("yellow", "star", "black") for r in got]
    assert sum(hits) >= 8, got


def test_the_vae_keeps_every_shape_readable(engine):
    """The UNet draws in the VAE's latents, so what a round trip through the VAE blurs away no
    prompt can bring back: on its reconstructions of 200 fresh scenes the checker must still
    read each shape. (The VAE trained 500 steps read 70%, stars 40%.)"""
    from serve_app.shapes.stages import round_trip_reading

    got = round_trip_reading(engine.pipe.vae)
    print("shapes read right after a VAE round trip:", got)
    assert got["all"] >= 0.85 and min(got[s] for s in scenes.SHAPES) >= 0.8, got


def test_the_colour_and_the_background_asked_for_are_drawn(engine):
    """Every colour of the palette, as the object and as the background, 3 seeds each. (The
    shape is not asked: circles, triangles and large stars are learned, squares only now and then,
    docs/shapes-model.md.)"""
    n = len(scenes.COLOURS)
    asked = [(scenes.COLOURS[i], scenes.COLOURS[(i + 5) % n]) for i in range(n)]  # background: another
    rows = [Row(f"a {c} circle on a {bg} background", None, s) for c, bg in asked for s in range(3)]
    got = read_rows(engine, rows)
    want = [pair for pair in asked for _ in range(3)]
    colour = np.mean([r.colour == c for (c, _), r in zip(want, got, strict=True)])
    background = np.mean([r.background == bg for (_, bg), r in zip(want, got, strict=True)])
    print(f"colour {colour:.0%}, background {background:.0%} of {3 * n}")
    assert colour >= 0.8 and background >= 0.95, (colour, background, got)


def test_the_place_asked_for_is_drawn(engine):
    """Each of the 9 places, 2 seeds each, with the same colours: only the place word changes."""
    asked = [(i, s) for i in range(len(scenes.POSITIONS)) for s in range(2)]
    rows = [Row(f"a red circle on a blue background, {scenes.POSITIONS[i]}", None, s) for i, s in asked]
    got = read_rows(engine, rows)
    right = np.mean([r.position == i for (i, _), r in zip(asked, got, strict=True)])
    print(f"place {right:.0%} of {len(asked)}")
    assert right >= 0.8, [(scenes.POSITIONS[i], r) for (i, _), r in zip(asked, got, strict=True)]


def test_the_green_adapter_paints_the_shape_green_at_scale_1_and_not_at_0(engine, tmp_path):
    from serve_app.tools import lora

    lora.main(["green", "--out", str(tmp_path / "green.safetensors")])  # the README's way to get it
    assert (tmp_path / "green.safetensors").read_bytes() == GREEN_LORA.read_bytes()
    engine.load_lora("green", str(tmp_path / "green.safetensors"))
    try:
        prompt = "a red circle on a blue background"
        on = readings(engine, prompt, loras=(("green", 1.0),))
        off = readings(engine, prompt, loras=(("green", 0.0),))
    finally:
        engine.unload_lora("green")
    assert sum(r.colour == "green" for r in on) >= 8, on
    assert sum(r.colour == "red" for r in off) >= 9, off
    assert all(r.background == "blue" for r in on + off)


def round_trip(engine, image: np.ndarray) -> np.ndarray:
    """`image` through the model's VAE and back: what a latent pipeline can keep of it at best."""
    vae = engine.pipe.vae
    x = torch.from_numpy(image).permute(2, 0, 1)[None].float() / 127.5 - 1
    with torch.no_grad():
        y = vae.decode(vae.encode(x).latent_dist.mean).sample[0]
    return ((y.clamp(-1, 1) + 1) * 127.5).round().permute(1, 2, 0).numpy().astype(int)


def test_inpainting_paints_the_prompt_inside_the_mask_and_keeps_the_rest(engine):
    before = scenes.render(scenes.Scene("circle", "red", "blue", 0, "large"))  # top left, on blue
    mask = np.zeros((64, 64), np.uint8)
    mask[32:, 32:] = 255  # the bottom-right quarter, away from the circle
    rows = [Row("a yellow circle on a blue background, bottom right", None, s, image=Image.fromarray(before),
                mask=Image.fromarray(mask)) for s in range(5)]  # fmt: skip
    out = engine.run(rows, params(task="inpaint", strength=1.0))
    inside, outside = mask > 0, mask == 0
    far = np.ones((64, 64), bool)
    far[24:, 24:] = False  # at least 8 pixels from the mask: the VAE's decoder blends the edge
    kept = round_trip(engine, before)
    yellow = scenes.COLOURS.index("yellow")
    for im in out.images:
        after = np.asarray(im).astype(int)
        # Outside the mask: the input as the VAE gives it back (a latent pipeline keeps no more;
        # against 63 levels for an image made afresh).
        drift = np.abs(after - kept).max(-1)[far].mean()
        print(f"inpainting: {drift:.1f} levels from the input's round trip outside the mask")
        assert drift < 25  # measured 19.2-21.0
        seen = scenes.read_image(np.where(inside[..., None], kept, after).astype(np.uint8))
        assert (seen.colour, seen.background, seen.position) == ("red", "blue", 0), seen
        # Inside: the prompt's yellow circle (measured 41-44% of the quarter), nowhere outside.
        painted = (scenes.nearest_colour(after[inside]) == yellow).mean()
        print(f"inpainting: {painted:.0%} of the quarter yellow")
        assert painted > 0.15
        assert (scenes.nearest_colour(after[outside]) == yellow).mean() < 0.01


def test_a_step_cache_keeps_what_the_image_shows(engine):
    """Prompts that name their place, so that the object lies inside one cell of the checker's
    grid: an object across a cell's edge (at this seed, the large blue square the model drew for
    "a blue square on a yellow background") changes its place reading when it moves by a pixel,
    which says nothing of the cache's effect."""
    prompts = ["a red circle on a white background, top left", "a blue square on a yellow background, center",
               "a yellow circle on a blue background, bottom right"]  # fmt: skip
    full = engine.run([Row(p, None, 3) for p in prompts], params())
    for level in ("fast", "faster"):
        cached = engine.run([Row(p, None, 3) for p in prompts], params(acceleration=level))
        for p, a, b in zip(prompts, full.images, cached.images, strict=True):
            db = psnr(a, b)
            print(f"{level} {p!r}: PSNR {db:.1f} dB to the uncached image")
            assert 15 < db < math.inf, (level, p, db)
            ra, rb = scenes.read_image(a), scenes.read_image(b)
            # The shape is left out: squares and stars are mostly blobs, whose reading flips easily.
            for field in ("colour", "background", "position"):
                assert getattr(ra, field) == getattr(rb, field), (level, p, field)


def test_training_is_repeatable_bit_for_bit(tmp_path):
    """Two short runs from the same seed write the same bytes (the full run is the same code
    with more steps)."""
    from serve_app.shapes import train

    def run(out: Path) -> dict[str, str]:
        stages = ("--vae-steps", "--unet-steps", "--shape-steps", "--lora-steps")
        steps = [arg for stage in stages for arg in (stage, "2")]
        train.main(["--out", str(out), "--scenes", "64", "--batch", "4", "--threads", "1", *steps])
        return {
            str(f.relative_to(out)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(out.rglob("*"))
            if f.is_file()
        }

    first, second = run(tmp_path / "a"), run(tmp_path / "b")
    assert first == second
    assert "shapes/unet/diffusion_pytorch_model.safetensors" in first and GREEN_LORA.name in first
