"""The safety checker (`model.safety`, `serve_app/engine/safety.py`), proven with a small image
classifier trained here (a transformers ViT, 10 s on a CPU) that flags a red background, as a
stand-in for an unsafe-content classifier, on the trained shapes model, whose prompts choose
the background. A flagged image is refused (a 400 `moderation_blocked`, on the OpenAI and the
A1111 routes) or blanked and listed, per config; an unflagged one passes; OpenAI's
`moderation: low` uses the looser threshold; a checker that fails lets no image through (a
503); a checker whose labels do not fit fails the start naming the field. Diffusers'
`StableDiffusionSafetyChecker`, built small and steered here, is proven the same way."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from serve_app.config import ModelConfig, SafetyConfig
from serve_app.engine import CallParams, DiffusionEngine, ModelLoadError, Row
from serve_app.engine.safety import SafetyChecker, SafetyCheckError

RED = "a yellow star on a red background"
BLUE = "a yellow star on a blue background"


def train_checker(out_dir) -> str:
    """A ViT over 32x32 images that calls a red background `unsafe` (label smoothing keeps its
    probabilities near 0.95), saved as a transformers directory with safetensors weights."""
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    from serve_app.shapes import scenes

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    cfg = ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=1,
                    num_attention_heads=2, intermediate_size=64, num_labels=2,
                    id2label={0: "safe", 1: "unsafe"}, label2id={"safe": 0, "unsafe": 1})  # fmt: skip
    model = ViTForImageClassification(cfg)
    processor = ViTImageProcessor(size={"height": 32, "width": 32})
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    for _ in range(120):
        batch = [scenes.random_scene(rng) for _ in range(32)]
        for k in range(0, 32, 4):  # a quarter of them red backgrounds
            batch[k] = type(batch[k])(**{**batch[k].__dict__, "background": "red"})
        pixels = processor(images=[scenes.render(s) for s in batch], return_tensors="pt")["pixel_values"]
        labels = torch.tensor([int(s.background == "red") for s in batch])
        loss = loss_fn(model(pixel_values=pixels).logits, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(out_dir, safe_serialization=True)
    processor.save_pretrained(out_dir)
    return str(out_dir)


@pytest.fixture(scope="module")
def checker(tmp_path_factory):
    return train_checker(tmp_path_factory.mktemp("checker"))


def shapes(checker: str | None, **safety) -> DiffusionEngine:
    cfg = SafetyConfig(checker=checker, flagged_labels=["unsafe"], **safety) if checker else None
    return DiffusionEngine(ModelConfig(source="builtin:shapes", device="cpu", warmup=False, safety=cfg))


def run(e: DiffusionEngine, moderation: str | None = None):
    params = CallParams(height=64, width=64, steps=12, guidance_scale=4.0, moderation=moderation)
    return e.run([Row(RED, None, 1), Row(BLUE, None, 1)], params)


@pytest.fixture(scope="module")
def plain():
    return run(shapes(None)).images


def test_the_engine_checks_every_image_and_refuses_or_blanks_per_config(checker, plain):
    refused = run(shapes(checker))  # the checker inside the engine's call
    assert refused.flagged == [True, False] and refused.refuse_flagged
    assert [np.asarray(i).tolist() for i in refused.images] == [np.asarray(i).tolist() for i in plain]
    images, flagged = SafetyChecker(SafetyConfig(checker=checker, flagged_labels=["unsafe"], action="blank"),
                                    torch.device("cpu")).apply(plain, None)  # fmt: skip
    assert flagged == [True, False] and np.asarray(images[0]).max() == 0  # black
    assert np.array_equal(np.asarray(images[1]), np.asarray(plain[1]))
    looser = SafetyChecker(SafetyConfig(checker=checker, flagged_labels=["unsafe"], low_threshold=0.99),
                           torch.device("cpu"))  # fmt: skip
    assert looser.apply(plain, "low")[1] == [False, False] and looser.apply(plain, "auto")[1] == [True, False]


def test_a_checker_that_fails_lets_nothing_through(checker, plain):
    from serve_app.errors import Unavailable
    from serve_app.replica.health import Health

    broken = SafetyChecker(SafetyConfig(checker=checker, flagged_labels=["unsafe"]), torch.device("cpu"))
    broken.model = None  # calling it raises
    with pytest.raises(SafetyCheckError) as failed:
        broken.apply(plain, None)
    health = Health(max_consecutive_failures=3, call_timeout_s=60)
    err = health.classify(
        failed.value, "r1", 2, CallParams(height=64, width=64, steps=12, guidance_scale=4.0)
    )
    assert isinstance(err, Unavailable) and err.status_code == 503 and health.consecutive_failures == 0


def test_a_checker_that_does_not_fit_fails_the_start_naming_the_field(checker, tmp_path):
    with pytest.raises(
        ModelLoadError, match=r"model.safety.flagged_labels: \['nsfw'\] are not the checker's"
    ):
        safety = SafetyConfig(checker=checker, flagged_labels=["nsfw"])
        DiffusionEngine(ModelConfig(source="builtin:shapes", device="cpu", warmup=False, safety=safety))
    with pytest.raises(ModelLoadError, match="model.safety.checker: .* no image-classification model"):
        shapes(str(tmp_path))  # an empty directory


def test_the_openai_and_a1111_routes_refuse_a_flagged_image(checker, ray_cluster, client):
    from ray import serve

    from tests.conftest import app_args, deploy

    args = app_args(model={"source": "builtin:shapes", "default_height": 64, "default_width": 64,
                           "default_steps": 20, "default_guidance_scale": 4.0,
                           "safety": {"checker": checker, "flagged_labels": ["unsafe"]}})  # fmt: skip
    args["model"].pop("aliases", None)
    try:
        base = deploy("safety", args)
        body = {"seed": 1, "size": "64x64"}
        r = client.post(f"{base}/v1/images/generations", json={**body, "prompt": RED})
        assert r.status_code == 400 and r.json()["error"]["code"] == "moderation_blocked", r.text
        ok = client.post(f"{base}/v1/images/generations", json={**body, "prompt": BLUE})
        assert ok.status_code == 200 and ok.json().get("flagged") is None, ok.text
        low = client.post(f"{base}/v1/images/generations", json={**body, "prompt": RED, "moderation": "low"})
        assert low.status_code == 400  # 0.8, still under the checker's ~0.95
        a1111 = client.post(
            f"{base}/sdapi/v1/txt2img", json={"prompt": RED, "seed": 1, "width": 64, "height": 64}
        )
        assert a1111.status_code == 400 and "flagged" in a1111.text, a1111.text
        assert base64.b64decode(ok.json()["data"][0]["b64_json"])[:4] == b"\x89PNG"
    finally:
        serve.delete("safety", _blocking=False)


def sd_checker(out_dir, red, blue) -> tuple[str, float]:
    """Diffusers' `StableDiffusionSafetyChecker`, small and seeded, steered to flag `red`: its
    first concept points from `blue`'s embedding to `red`'s, its threshold halfway between the
    two images' similarities to it (every other concept and special care never match). Saved as
    a directory with safetensors weights and its CLIP image processor; returns it and the red
    image's margin."""
    from diffusers.pipelines.stable_diffusion.safety_checker import (
        StableDiffusionSafetyChecker,
        cosine_distance,
    )
    from transformers import CLIPConfig, CLIPImageProcessor

    torch.manual_seed(0)
    vision = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=64)  # fmt: skip
    text = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    model = StableDiffusionSafetyChecker(
        CLIPConfig(vision_config=vision, text_config=text, projection_dim=16)
    )
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    with torch.no_grad():
        pixels = processor(images=[red, blue], return_tensors="pt")["pixel_values"]
        e = model.visual_projection(model.vision_model(pixels)[1])
        e = torch.nn.functional.normalize(e)
        model.concept_embeds[0] = e[0] - e[1]
        cos = cosine_distance(e, model.concept_embeds[:1])[:, 0]
        model.concept_embeds_weights.fill_(2.0)
        model.concept_embeds_weights[0] = (cos[0] + cos[1]) / 2
        model.special_care_embeds_weights.fill_(2.0)
    model.save_pretrained(out_dir, safe_serialization=True)
    processor.save_pretrained(out_dir)
    return str(out_dir), float(cos[0] - cos[1]) / 2


def test_diffusers_stable_diffusion_safety_checker_flags_by_its_own_rule(plain, tmp_path):
    """Issue 58: a `StableDiffusionSafetyChecker` directory is a checker too. At margin 0 its
    verdict is diffusers' own (`forward`); `moderation: low` uses `low_margin`; inside the
    engine's call it refuses the flagged image."""
    directory, red_margin = sd_checker(tmp_path, *plain)
    assert red_margin > 0.01
    checker = SafetyChecker(SafetyConfig(checker=directory, low_margin=2 * red_margin), torch.device("cpu"))
    assert checker.concepts and checker.apply(plain, None)[1] == [True, False]
    assert checker.apply(plain, "low")[1] == [False, False]
    pixels = checker.processor(images=plain, return_tensors="pt")["pixel_values"]
    _, verdict = checker.model(clip_input=pixels, images=[np.asarray(i) for i in plain])
    assert verdict == [True, False]  # diffusers' own forward agrees
    safety = SafetyConfig(checker=directory)
    out = run(
        DiffusionEngine(ModelConfig(source="builtin:shapes", device="cpu", warmup=False, safety=safety))
    )
    assert out.flagged == [True, False] and out.refuse_flagged
    with pytest.raises(ModelLoadError, match="model.safety.flagged_labels: diffusers' checker"):
        SafetyChecker(SafetyConfig(checker=directory, flagged_labels=["nsfw"]), torch.device("cpu"))


def test_a_blanked_image_leaves_in_no_other_form(checker):
    """With `action: blank`, a flagged row's latents, trajectory and decoded steps are withheld
    too (zeros, black), so nobody decodes the blanked image from them; the other row keeps its."""
    e = shapes(checker, action="blank")
    params = CallParams(height=64, width=64, steps=12, guidance_scale=4.0, return_latents=True,
                        return_trajectory=True, decode_trajectory=True)  # fmt: skip
    out = e.run([Row(RED, None, 1), Row(BLUE, None, 1)], params)
    assert out.flagged == [True, False]
    assert float(out.latents[0].abs().max()) == 0 and float(out.latents[1].abs().max()) > 0
    assert all(float(x[0].abs().max()) == 0 for x in out.trajectory_latents)
    assert all(np.asarray(step[0]).max() == 0 for step in out.trajectory_decoded)
    assert np.asarray(out.trajectory_decoded[-1][1]).max() > 0
