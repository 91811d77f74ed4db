"""The shape-scene checker: it reads which colour and shape dominate an image, and where, from
pixels alone (no learned model). It is the instrument the trained `builtin:shapes` model will be
judged by (docs/shapes-model.md); here it is checked on scenes drawn from the grammar itself."""

from __future__ import annotations

import numpy as np

from serve_app.shapes import scenes


def test_checker_reads_every_scene_of_the_grammar():
    rng = np.random.default_rng(7)
    for i in range(300):
        scene = scenes.random_scene(rng, held_out=i % 4 == 0)
        r = scenes.read_image(scenes.render(scene))
        got = (r.colour, r.shape, r.position, r.background)
        assert got == (scene.colour, scene.shape, scene.position, scene.background), scene
        assert r.colour_fraction > 0.7  # antialiased edges blend into the background


def test_checker_sees_no_shape_in_a_flat_image():
    r = scenes.read_image(np.full((64, 64, 3), scenes.PALETTE["blue"], np.uint8))
    assert (r.shape, r.background, r.area) == ("none", "blue", 0)
