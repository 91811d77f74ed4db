"""The safety checker (`model.safety`): an image classifier every image passes before it is
returned, from a local directory (safetensors only). Two kinds:

- a transformers image-classification model: an image's score is the summed probability of the
  labels the config flags, and it is flagged where that reaches the request's threshold
  (`threshold`, or `low_threshold` for OpenAI's `moderation: low`);
- diffusers' `StableDiffusionSafetyChecker` (the Stable Diffusion pipelines' own): an image's
  score is its largest margin over the checker's concept thresholds, computed as the checker
  computes it, and it is flagged where that exceeds `margin` (`low_margin` for `low`); at
  margin 0 that is the checker's own verdict.

A video counts as its most flagged frame. With `action: blank` a flagged image is replaced by a
black one here, with `refuse` the replica refuses its request. A checker that fails raises
`SafetyCheckError`: the request gets a 503, never an unchecked image.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from serve_app.config import SafetyConfig
from serve_app.engine.types import ModelLoadError


class SafetyCheckError(RuntimeError):
    """The checker could not score a call's images (they are not returned)."""


def _is_diffusers_checker(directory: str) -> bool:
    try:
        config = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return "StableDiffusionSafetyChecker" in (config.get("architectures") or [])


class SafetyChecker:
    def __init__(self, cfg: SafetyConfig, device: torch.device):
        self.cfg = cfg
        self.device = device
        self.concepts = _is_diffusers_checker(cfg.checker)
        if self.concepts:
            self._load_concepts()
        else:
            self._load_classifier()

    def _load_concepts(self) -> None:
        """Diffusers' checker and its CLIP image processor."""
        from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker
        from transformers import CLIPImageProcessor

        try:
            self.processor = CLIPImageProcessor.from_pretrained(self.cfg.checker, local_files_only=True)
            model = StableDiffusionSafetyChecker.from_pretrained(
                self.cfg.checker, local_files_only=True, use_safetensors=True
            )
        except Exception as e:  # a missing processor config or weights
            raise ModelLoadError(
                f"model.safety.checker: {self.cfg.checker!r} is no StableDiffusionSafetyChecker with "
                f"safetensors weights and a preprocessor_config.json ({type(e).__name__})"
            ) from None
        if self.cfg.flagged_labels:
            raise ModelLoadError("model.safety.flagged_labels: diffusers' checker flags its own concepts")
        self.model = model.eval().to(self.device)

    def _load_classifier(self) -> None:
        from transformers import AutoImageProcessor, AutoModelForImageClassification

        cfg = self.cfg
        if not cfg.flagged_labels:
            raise ModelLoadError("model.safety.flagged_labels: an image classifier needs the labels it flags")
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
        self.model = model.eval().to(self.device)

    def threshold(self, moderation: str | None) -> float:
        if self.concepts:
            return self.cfg.low_margin if moderation == "low" else self.cfg.margin
        return self.cfg.low_threshold if moderation == "low" else self.cfg.threshold

    def _score(self, inputs) -> torch.Tensor:
        """Each image's score: the flagged labels' probability, or the largest concept margin."""
        if not self.concepts:
            return self.model(**inputs).logits.float().softmax(-1)[:, self.flagged_ids].sum(-1)
        from diffusers.pipelines.stable_diffusion.safety_checker import cosine_distance

        m = self.model  # StableDiffusionSafetyChecker.forward_onnx's arithmetic, kept as margins
        embeds = m.visual_projection(m.vision_model(inputs["pixel_values"].to(m.dtype))[1]).float()
        special = cosine_distance(embeds, m.special_care_embeds.float()) - m.special_care_embeds_weights
        adjustment = 0.01 * (special > 0).any(dim=1, keepdim=True)
        margins = cosine_distance(embeds, m.concept_embeds.float()) - m.concept_embeds_weights.float()
        return (margins + adjustment).max(dim=1).values

    def scores(self, images: list[Any]) -> list[float]:
        """Each output's score (an image, or a video's frames: the highest)."""
        frames = [im if isinstance(im, list) else [im] for im in images]
        flat = [f.convert("RGB") for fs in frames for f in fs]
        try:
            with torch.no_grad():
                inputs = self.processor(images=flat, return_tensors="pt").to(self.device)
                each = self._score(inputs).tolist()
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
        # a probability flags at the threshold; a margin (diffusers' rule) only above it
        flagged = [s > limit if self.concepts else s >= limit for s in self.scores(images)]
        if self.cfg.action == "blank":
            images = [_black(im) if f else im for im, f in zip(images, flagged, strict=True)]
        return images, flagged


def withhold_flagged(out) -> None:
    """Nothing of a flagged row leaves in another form: its latents, trajectory (latents, start)
    and decoded steps become zeros and black images (its log-probabilities show no pixels)."""
    rows = [i for i, f in enumerate(out.flagged or []) if f]
    if not rows:
        return
    for t in [out.latents, out.trajectory_start, *(out.trajectory_latents or [])]:
        if t is not None:
            t[rows] = 0
    for step in out.trajectory_decoded or []:
        for i in rows:
            step[i] = _black(step[i])


def _black(im):
    from PIL import Image

    if isinstance(im, list):
        return [_black(f) for f in im]
    return Image.new("RGB", im.size)
