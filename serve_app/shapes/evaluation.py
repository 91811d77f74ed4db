"""How good a trained model is: the checker's reading of its images, a sheet of samples, and
its step time against another pipeline's."""

from __future__ import annotations

import collections
import time
from pathlib import Path

import numpy as np
import torch

from serve_app.shapes.scenes import SHAPES, random_scene, read_image


def generate(pipe, prompts: list[str], seeds: list[int], steps: int = 20, guidance: float = 4.0, **kw):
    """Images for (prompt, seed) pairs, as (64, 64, 3) uint8 arrays."""
    out = []
    for p, s in zip(prompts, seeds, strict=True):
        g = torch.Generator().manual_seed(s)
        kw |= {"height": 64, "width": 64, "generator": g}
        im = pipe(p, num_inference_steps=steps, guidance_scale=guidance, **kw)
        out.append(np.asarray(im.images[0]))
    return out


def evaluate(pipe, n: int = 40, guidance: float = 4.0) -> dict[str, dict[str, float]]:
    """The checker's accuracy on the model's images of `n` full prompts each from the training
    distribution and from held-out colour-shape pairs."""
    report = {}
    for name, held in (("train", False), ("held_out", True)):
        rng = np.random.default_rng(777 + held)
        scenes = [random_scene(rng, held_out=held) for _ in range(n)]
        images = generate(pipe, [s.prompt() for s in scenes], list(range(n)), guidance=guidance)
        hits = collections.Counter()
        for s, im in zip(scenes, images, strict=True):
            r = read_image(im)
            got = {"colour": r.colour == s.colour, "shape": r.shape == s.shape}
            got |= {"position": r.position == s.position, "background": r.background == s.background}
            got["all"] = all(got.values())
            hits.update(k for k, v in got.items() if v)
        report[name] = {k: hits[k] / n for k in ("colour", "shape", "position", "background", "all")}
    return report


def sheet(pipe, path: Path, guidance: float = 4.0) -> None:
    """A grid of samples: one row per shape, one prompt per column (seed 0 each), 4x enlarged."""
    rng = np.random.default_rng(5)
    prompts = [random_scene(rng, held_out=col >= 5).prompt() for _ in SHAPES for col in range(6)]
    images = generate(pipe, prompts, [0] * len(prompts), guidance=guidance)
    grid = np.concatenate([np.concatenate(images[r * 6 : r * 6 + 6], 1) for r in range(len(SHAPES))])
    from PIL import Image

    Image.fromarray(grid).resize((grid.shape[1] * 4, grid.shape[0] * 4), Image.NEAREST).save(path)
    print(f"wrote {path}: " + "; ".join(prompts))


def step_time(pipe, other, steps: int = 20, rounds: int = 5) -> tuple[float, float]:
    """Median seconds per denoising step of `pipe` and `other` at 64x64, guidance on, taken in
    alternating rounds so that both see the same machine."""
    times: dict[int, list[float]] = {0: [], 1: []}
    for _ in range(rounds):
        for k, p in enumerate((pipe, other)):
            t0 = time.perf_counter()
            p("a red circle", num_inference_steps=steps, guidance_scale=4.0, height=64, width=64)
            times[k].append((time.perf_counter() - t0) / steps)
    return float(np.median(times[0])), float(np.median(times[1]))
