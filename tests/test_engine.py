"""The engine alone: real diffusers pipelines, no Ray."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from serve_app.config import ModelConfig
from serve_app.engine import CallParams, DiffusionEngine, ModelLoadError, Row, encode_image
from serve_app.engine.builtin import build_builtin

SMALL = CallParams(height=32, width=32, steps=3, guidance_scale=7.5)


@pytest.fixture(scope="module")
def engine():
    return DiffusionEngine(ModelConfig(source="builtin:tiny-sd", device="cpu", warmup=False))


def pixels(im) -> np.ndarray:
    return np.asarray(im).astype(np.int16)


def test_tiny_builds_fast_and_deterministically():
    build_builtin("tiny-sd")  # imports diffusers/transformers once
    t = time.perf_counter()
    a = build_builtin("tiny-sd", seed=0)
    elapsed = time.perf_counter() - t
    b = build_builtin("tiny-sd", seed=0)
    c = build_builtin("tiny-sd", seed=1)
    assert elapsed < 1.0, f"builtin:tiny-sd took {elapsed:.2f}s to build"
    sa, sb, sc = a.unet.state_dict(), b.unet.state_dict(), c.unet.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


@pytest.mark.parametrize(
    "name, unet_params_m",
    [("sd15-arch", 859.5), ("sdxl-arch", 2567.5)],
)
def test_full_size_presets_have_the_real_shapes(name, unet_params_m):
    pipe = build_builtin(name, device="meta")
    n = sum(p.numel() for p in pipe.unet.parameters()) / 1e6
    assert n == pytest.approx(unet_params_m, abs=0.5)
    assert pipe.vae.config.latent_channels == 4
    assert pipe.text_encoder.config.hidden_size == 768  # CLIP ViT-L


def test_flux_preset_has_the_real_shapes():
    pipe = build_builtin("flux-arch", device="meta")
    millions = [sum(p.numel() for p in m.parameters()) / 1e6 for m in (pipe.transformer, pipe.text_encoder_2)]
    assert millions == [pytest.approx(11901.4, abs=0.5), pytest.approx(4762.3, abs=0.5)]  # FLUX.1, T5-XXL
    assert pipe.vae.config.latent_channels == 16 and pipe.transformer.config.guidance_embeds


def test_ltx_preset_has_the_real_shapes():
    pipe = build_builtin("ltx-arch", device="meta")
    millions = [sum(p.numel() for p in m.parameters()) / 1e6 for m in (pipe.transformer, pipe.text_encoder)]
    assert millions[1] == pytest.approx(4762.3, abs=0.5)  # T5-XXL
    assert millions[0] == pytest.approx(1923.4, abs=0.5)  # LTX-Video 0.9's 2B transformer
    assert pipe.vae.config.latent_channels == 128 and pipe.vae_temporal_compression_ratio == 8


def test_same_seed_same_image_and_different_seed_differs(engine):
    a = engine.run([Row("a red cat", None, 5)], SMALL).images[0]
    b = engine.run([Row("a red cat", None, 5)], SMALL).images[0]
    c = engine.run([Row("a red cat", None, 6)], SMALL).images[0]
    assert encode_image(a, "png") == encode_image(b, "png")
    assert np.abs(pixels(a) - pixels(c)).max() > 10


def test_image_alone_equals_image_in_batch(engine):
    alone = engine.run([Row("a red cat", None, 11)], SMALL).images[0]
    batch = engine.run(
        [Row("a blue dog", "blurry", 3), Row("a red cat", None, 11), Row("a tree", None, 99)], SMALL
    ).images
    # CPU kernels may block a batch differently: allow one grey level of rounding difference.
    assert np.abs(pixels(alone) - pixels(batch[1])).max() <= 1
    assert np.abs(pixels(batch[0]) - pixels(batch[1])).max() > 10


def test_timings_latents_and_trajectory(engine):
    params = CallParams(
        height=32, width=48, steps=4, guidance_scale=5.0, return_latents=True, return_trajectory=True
    )
    out = engine.run([Row("a", None, 1), Row("b", None, 2)], params)
    assert [im.size for im in out.images] == [(48, 32), (48, 32)]
    for key in ("text_encode_ms", "denoise_ms", "vae_decode_ms", "pipeline_ms"):
        assert out.timings_ms[key] > 0, key
    t = out.timings_ms
    assert t["text_encode_ms"] + t["denoise_ms"] + t["vae_decode_ms"] == pytest.approx(
        t["pipeline_ms"], rel=1e-6
    )
    scale = engine.pipe.vae_scale_factor
    assert tuple(out.latents.shape) == (2, 4, 32 // scale, 48 // scale)
    assert len(out.trajectory_latents) == 4 and len(out.trajectory_timesteps) == 4
    assert torch.equal(out.trajectory_latents[-1], out.latents)
    assert out.trajectory_timesteps == sorted(out.trajectory_timesteps, reverse=True)
    assert out.steps_run == 4 and not out.interrupted
    assert out.memory_kind == "cpu_rss" and out.peak_memory_mb >= 0


def test_step_hook_sees_every_step_and_can_stop(engine):
    seen = []
    out = engine.run(
        [Row("a", None, 1)], CallParams(32, 32, 6, 7.5), step_hook=lambda i, n, lat: seen.append(i)
    )
    assert seen == list(range(6))
    stopped = engine.run([Row("a", None, 1)], CallParams(32, 32, 6, 7.5), step_hook=lambda i, n, lat: i == 1)
    assert stopped.steps_run == 2 and stopped.interrupted and out.steps_run == 6


def test_extra_goes_to_the_pipeline_and_unknown_keys_are_refused(engine):
    base = engine.run([Row("a", None, 1)], SMALL).images[0]
    rescaled = engine.run([Row("a", None, 1)], CallParams(32, 32, 3, 7.5, extra=(("guidance_rescale", 0.7),)))
    assert np.abs(pixels(base) - pixels(rescaled.images[0])).max() > 0
    engine.check_extra({"eta": 0.5, "guidance_rescale": 0.7})
    with pytest.raises(ValueError, match="takes no argument 'bogus'"):
        engine.check_extra({"bogus": 1})


@pytest.mark.parametrize("fmt, magic", [("png", b"\x89PNG"), ("jpeg", b"\xff\xd8\xff"), ("webp", b"RIFF")])
def test_encode_formats(engine, fmt, magic):
    im = engine.run([Row("a", None, 1)], SMALL).images[0]
    assert encode_image(im, fmt).startswith(magic)


@pytest.mark.parametrize("mode, channels", [("RGB", 3), ("RGBA", 4), ("L", 1), ("P", 1)])
def test_png_decodes_to_the_same_pixels(mode, channels):
    import io

    from PIL import Image

    rng = np.random.default_rng(7)
    # Noise and a ramp: every filter difference wraps around modulo 256 somewhere.
    noise = rng.integers(0, 256, (37, 23, channels), dtype=np.uint8)
    ramp = np.broadcast_to(np.arange(23, dtype=np.uint8)[None, :, None] * 11, (37, 23, channels))
    for arr in (noise, ramp):
        im = Image.fromarray(
            arr.squeeze(-1) if channels == 1 else np.ascontiguousarray(arr), "L" if mode == "P" else mode
        )
        if mode == "P":
            im = im.quantize(16)
        back = Image.open(io.BytesIO(encode_image(im, "png")))
        assert (back.mode, back.size) == (im.mode, im.size)
        assert np.array_equal(np.asarray(back), np.asarray(im))


def test_scheduler_override_by_class_name():
    e = DiffusionEngine(ModelConfig(scheduler="EulerDiscreteScheduler", warmup=False))
    assert type(e.pipe.scheduler).__name__ == "EulerDiscreteScheduler"
    assert len(e.run([Row("a", None, 1)], SMALL).images) == 1
    with pytest.raises(ValueError, match="not a diffusers scheduler class"):
        DiffusionEngine(ModelConfig(scheduler="NoSuchScheduler", warmup=False))


def test_loads_a_local_diffusers_directory(engine, tmp_path):
    engine.pipe.save_pretrained(tmp_path / "tiny")
    local = DiffusionEngine(ModelConfig(source=str(tmp_path / "tiny"), device="cpu", warmup=False))
    a = engine.run([Row("a red cat", None, 4)], SMALL).images[0]
    b = local.run([Row("a red cat", None, 4)], SMALL).images[0]
    assert np.abs(pixels(a) - pixels(b)).max() <= 1
    assert local.describe()["model"] == "tiny"


@pytest.mark.parametrize(
    "source, message",
    [
        ("/nonexistent/model/dir", "is not a directory"),
        ("tests", "has no model_index.json"),
        ("someone/model-that-is-not-cached", "cannot load"),
    ],
)
def test_unloadable_models_fail_with_a_clear_message(source, message):
    t = time.perf_counter()
    with pytest.raises(ModelLoadError, match=message):
        DiffusionEngine(ModelConfig(source=source, warmup=False))
    assert time.perf_counter() - t < 30


@pytest.mark.parametrize(
    "opts",
    [{"channels_last": True}, {"vae_slicing": True}, {"vae_tiling": True}, {"attention_backend": "native"}],
)
def test_optimizations_keep_the_image(engine, opts):
    from serve_app.config import Optimizations

    fast = DiffusionEngine(ModelConfig(device="cpu", warmup=False, optimizations=Optimizations(**opts)))
    rows = [Row("a red cat", None, 4), Row("a dog", None, 5)]
    a, b = engine.run(rows, SMALL).images, fast.run(rows, SMALL).images
    for x, y in zip(a, b, strict=True):
        assert np.abs(pixels(x) - pixels(y)).max() <= 2, opts


def test_bad_optimizations_are_refused():
    from pydantic import ValidationError

    from serve_app.config import AppConfig, Optimizations

    with pytest.raises(ModelLoadError, match="attention_backend"):
        DiffusionEngine(
            ModelConfig(warmup=False, optimizations=Optimizations(attention_backend="no-such-backend"))
        )
    with pytest.raises(ValidationError, match="cpu_offload needs model.device cuda"):
        AppConfig.from_args({"model": {"device": "cpu", "optimizations": {"cpu_offload": "model"}}})


def test_a_call_finds_its_device_without_walking_the_modules(engine, monkeypatch):
    """diffusers' `_execution_device` walks every module of every component at each call; the
    engine's pipelines answer it from the device found once at load (no CPU offloading here),
    and a pipeline that was not pinned still walks."""
    from diffusers import DiffusionPipeline

    walked = []
    real = torch.nn.Module.modules

    def counting(self):
        walked.append(type(self).__name__)
        return real(self)

    monkeypatch.setattr(torch.nn.Module, "modules", counting)
    assert engine.pipe._execution_device == engine.device
    out = engine.run([Row("a red circle", None, 1)], SMALL)
    assert out.images and walked == []
    other = DiffusionPipeline.__new__(type(engine.pipe))
    other.__dict__.update({k: v for k, v in engine.pipe.__dict__.items() if k != "_pinned_execution_device"})
    assert other._execution_device == engine.device and walked
