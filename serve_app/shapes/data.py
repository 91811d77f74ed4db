"""The training data: scenes of the grammar with their images, the prompts that describe them
with parts left out, and the text encoder's and the VAE's encodings of both."""

from __future__ import annotations

import numpy as np
import torch

from serve_app.shapes.model import MAX_TOKENS
from serve_app.shapes.scenes import Scene, random_scene, render


def _prompt(scene: Scene, rng: np.random.Generator, name_small: bool = False) -> str:
    """The scene's prompt with parts left out at random, so short prompts leave choices open.
    `name_small`: a small object's prompt always says so (a prompt without a size then means
    a large object)."""
    if rng.random() < 0.1:
        return ""  # the unconditional prompt of classifier-free guidance
    parts = _parts(rng)
    if name_small and scene.size == "small":
        parts["size"] = True
    return scene.prompt(**parts)


def _parts(rng: np.random.Generator) -> dict[str, bool]:
    """Which optional parts a training prompt names: background and place 80%, size 50%."""
    return {"background": rng.random() > 0.2, "position": rng.random() > 0.2, "size": rng.random() > 0.5}


def make_scenes(n: int, rng: np.random.Generator, keep: dict[str, float] | None = None
                ) -> tuple[list[Scene], torch.Tensor]:  # fmt: skip
    """`n` training scenes (held-out colour-shape pairs never among them) and their images in
    [-1, 1], (n, 3, 64, 64). `keep`: the share of the grammar's scenes of each shape that are
    kept (default 1), to draw some shapes more often."""
    scenes = []
    while len(scenes) < n:
        scene = random_scene(rng)
        if keep is None or rng.random() < keep.get(scene.shape, 1.0):
            scenes.append(scene)
    pixels = np.stack([render(s) for s in scenes])
    return scenes, torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 127.5 - 1


def _object_weight(images: torch.Tensor, extra: float = 7.0) -> torch.Tensor:
    """Per-pixel loss weight: the object's pixels (far from the corner's colour) count 1 + `extra` times."""
    corner = images[:, :, :1, :1]
    far = (images - corner).abs().sum(1, keepdim=True) > 0.2
    return 1 + extra * far.float()


def _encode_prompts(pipe, prompts: list[str]) -> torch.Tensor:
    ids = pipe.tokenizer(
        prompts, padding="max_length", max_length=MAX_TOKENS, truncation=True, return_tensors="pt"
    ).input_ids
    return pipe.text_encoder(ids)[0]


@torch.no_grad()
def encode_latents(pipe, images: torch.Tensor) -> torch.Tensor:
    """The images' latent means, scaled by the VAE's scaling factor."""
    out = [pipe.vae.encode(images[i : i + 256]).latent_dist.mean for i in range(0, len(images), 256)]
    return torch.cat(out) * pipe.vae.config.scaling_factor
