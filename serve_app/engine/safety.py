"""The safety checker (`model.safety`): an image classifier every image passes before it is
returned. A transformers image-classification model from a local directory (safetensors only)
scores each image: the summed probability of the labels the config flags (a video: its most
flagged frame). An image whose score reaches the request's threshold (`threshold`, or
`low_threshold` for OpenAI's `moderation: low`) is flagged; with `action: blank` it is replaced
by a black one here, with `refuse` the replica refuses its request. A checker that fails raises
`SafetyCheckError`: the request gets a 503, never an unchecked image.
"""

from __future__ import annotations

from typing import Any

import torch

from serve_app.config import SafetyConfig
from serve_app.engine.types import ModelLoadError


class SafetyCheckError(RuntimeError):
    """The checker could not score a call's images (they are not returned)."""


class SafetyChecker:
    def __init__(self, cfg: SafetyConfig, device: torch.device):
        from transformers import AutoImageProcessor, AutoModelForImageClassification

        self.cfg = cfg
        try:
            self.processor = AutoImageProcessor.from_pretrained(cfg.checker, local_files_only=True)
            model = AutoModelForImageClassification.from_pretrained(
                cfg.checker, local_files_only=True, use_safetensors=True
            )
        except Exception as e:  # transformers raises several types for a missing or bad directory
            raise ModelLoadError(
                f"model.safety.checker: {cfg.checker!r} is no image-classification model with "
                f"safetensors weights ({type(e).__name__})"
            ) from None
        labels = {str(v): int(k) for k, v in model.config.id2label.items()}
        unknown = [label for label in cfg.flagged_labels if label not in labels]
        if unknown:
            raise ModelLoadError(
                f"model.safety.flagged_labels: {unknown} are not the checker's labels ({sorted(labels)})"
            )
        self.flagged_ids = [labels[label] for label in cfg.flagged_labels]
        self.device = device
        self.model = model.eval().to(device)

    def threshold(self, moderation: str | None) -> float:
        return self.cfg.low_threshold if moderation == "low" else self.cfg.threshold

    def scores(self, images: list[Any]) -> list[float]:
        """Each output's score (an image, or a video's frames: the highest)."""
        frames = [im if isinstance(im, list) else [im] for im in images]
        flat = [f.convert("RGB") for fs in frames for f in fs]
        try:
            with torch.no_grad():
                inputs = self.processor(images=flat, return_tensors="pt").to(self.device)
                probs = self.model(**inputs).logits.float().softmax(-1)
                each = probs[:, self.flagged_ids].sum(-1).tolist()
        except Exception as e:  # a checker that cannot score lets nothing through
            raise SafetyCheckError(f"the safety checker failed: {type(e).__name__}") from e
        out, at = [], 0
        for fs in frames:
            out.append(max(each[at : at + len(fs)]))
            at += len(fs)
        return out

    def apply(self, images: list[Any], moderation: str | None) -> tuple[list[Any], list[bool]]:
        """The images as returned (flagged ones black where `action` is blank) and which are flagged."""
        limit = self.threshold(moderation)
        flagged = [s >= limit for s in self.scores(images)]
        if self.cfg.action == "blank":
            images = [_black(im) if f else im for im, f in zip(images, flagged, strict=True)]
        return images, flagged


def _black(im):
    from PIL import Image

    if isinstance(im, list):
        return [_black(f) for f in im]
    return Image.new("RGB", im.size)
