"""Every model family the README names, on its embedded twin, at the engine: SDXL, SD3, FLUX, Wan.

The twins are the real diffusers pipelines of each family at toy sizes with seeded random
weights (serve_app/engine/builtin.py). What differs between families is checked here: pooled
embeddings, packed latents (FLUX), video frames (Wan), each family's adapter format. The same
twins go through Serve and HTTP in tests/test_families_serving.py.
"""

from __future__ import annotations

import io
import json

import av
import numpy as np
import pytest
import torch
from PIL import Image

from serve_app.engine import CallParams, DiffusionEngine, Row
from serve_app.engine.engine import find_denoiser, latents_preview
from serve_app.engine.media import encode_output
from serve_app.tools.lora import make_adapter
from tests.conftest import engine_cache

TWINS = ["tiny-sdxl", "tiny-sd3", "tiny-flux", "tiny-wan"]

# What each twin must say of itself: family, modality, width of prompt embeddings, of pooled ones.
EXPECTED = {
    "tiny-sdxl": ("sdxl", "image", 64, 32),
    "tiny-sd3": ("sd3", "image", 64, 64),
    "tiny-flux": ("flux", "image", 32, 32),
    "tiny-wan": ("wan", "video", 32, None),
}


@pytest.fixture(scope="module")
def engines():
    with engine_cache(default_steps=3) as get:
        yield get


def params(e: DiffusionEngine, **kw) -> CallParams:
    return CallParams(
        height=e.default_height, width=e.default_width, steps=3, guidance_scale=4.0, **kw
    )  # fmt: skip


def pixels(item) -> np.ndarray:
    """An image, or a video's frames stacked, as integers."""
    frames = item if isinstance(item, list) else [item]
    return np.stack([np.asarray(f) for f in frames]).astype(int)


@pytest.mark.parametrize("name", TWINS)
def test_the_twin_describes_its_family(engines, name):
    d = engines(name).describe()
    family, modality, embeds_dim, pooled_dim = EXPECTED[name]
    assert (d["family"], d["modality"], d["embeds_dim"], d["pooled_dim"]) == EXPECTED[name]
    assert ("pooled_prompt_embeds" in d["inputs"]) is (pooled_dim is not None)
    if modality == "video":
        assert d["default_num_frames"] == 9 and d["frame_rule"] == [4, 1]


@pytest.mark.parametrize("name", TWINS)
def test_rows_keep_their_seeds_alone_and_in_a_batch(engines, name):
    e = engines(name)
    p = params(e)
    pair = e.run([Row("a red square", None, 1), Row("a blue circle", None, 2)], p)
    alone = e.run([Row("a blue circle", None, 2)], p)
    again = e.run([Row("a blue circle", None, 2)], p)
    assert len(pair.images) == 2
    first = pixels(pair.images[0])
    assert first.shape[1:3] == (e.default_height, e.default_width)
    if e.video:
        assert first.shape[0] == e.default_num_frames
    assert np.array_equal(pixels(alone.images[0]), pixels(again.images[0]))  # same seed, same image
    assert not np.array_equal(first, pixels(pair.images[1]))
    # In a batch of two, the same image (to rounding: a transformer's matmuls round a little
    # differently for a batch of 2 on the CPU; within one level of 255 here).
    diff = np.abs(pixels(alone.images[0]) - pixels(pair.images[1]))
    assert diff.max() <= 2 and diff.mean() < 0.05, (diff.max(), diff.mean())


@pytest.mark.parametrize("name", TWINS)
def test_previews_are_image_shaped_and_abort_stops_the_call(engines, name):
    e = engines(name)
    seen = []

    def hook(i, total, latents):
        seen.append(Image.open(io.BytesIO(latents_preview(latents()))))  # given as a function
        return i == 1  # stop after the second step

    out = e.run([Row("a", None, 1), Row("b", None, 2)], params(e), hook)
    assert out.images == [] and out.interrupted and out.steps_run == 2
    # FLUX's packed sequence is unpacked and Wan's first frame is shown: two previews side by side.
    scale = e.default_height // seen[0].height
    assert scale in (2, 8) and seen[0].width == 2 * e.default_width // scale


@pytest.mark.parametrize("name", TWINS)
def test_return_latents(engines, name):
    e = engines(name)
    out = e.run([Row("a", None, 1), Row("b", None, 2)], params(e, return_latents=True))
    assert out.latents is not None and out.latents.shape[0] == 2 and out.latents.dtype == torch.float32


def own_embeddings(e: DiffusionEngine, prompt: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The embeddings the pipeline makes of `prompt` itself, by each family's own encoder call."""
    pipe = e.pipe
    with torch.no_grad():
        if e.family.name == "sdxl":
            pe, _, pooled, _ = pipe.encode_prompt(prompt, do_classifier_free_guidance=False)
        elif e.family.name == "sd3":
            pe, _, pooled, _ = pipe.encode_prompt(prompt, prompt, prompt, do_classifier_free_guidance=False)
        elif e.family.name == "flux":
            pe, pooled, _ = pipe.encode_prompt(prompt, prompt_2=None)
        else:
            pe, _ = pipe.encode_prompt(prompt, do_classifier_free_guidance=False, max_sequence_length=512)
            pooled = None
    return pe, pooled


@pytest.mark.parametrize("name", TWINS)
def test_prompt_embeds_with_the_pooled_ones_the_family_needs(engines, name):
    e = engines(name)
    pe, pooled = own_embeddings(e, "a green triangle")
    e.check_embeds(pe, pooled)
    p = params(e)
    by_text = e.run([Row("a green triangle", None, 5)], p)
    by_embeds = e.run([Row("label", None, 5, prompt_embeds=pe, pooled_prompt_embeds=pooled)], p)
    assert np.abs(pixels(by_text.images[0]) - pixels(by_embeds.images[0])).max() <= 1

    with pytest.raises(ValueError, match=r"prompt_embeds: shape .* which wants \(1, \d+, \d+\)"):
        e.check_embeds(pe[:, :, :5], pooled)
    if pooled is not None:
        with pytest.raises(ValueError, match=r"pooled_prompt_embeds: got none; .*with pooled_prompt_embeds"):
            e.check_embeds(pe, None)
        with pytest.raises(ValueError, match=r"negative_pooled_prompt_embeds: got shape \(1, 3\)"):
            e.check_embeds(pe, pooled[:, :3], "negative_")
    else:
        with pytest.raises(ValueError, match="pooled_prompt_embeds: WanPipeline takes no pooled"):
            e.check_embeds(pe, torch.zeros(1, 8))


@pytest.mark.parametrize("name", TWINS)
def test_an_adapter_in_the_family_format_changes_the_image(engines, name, tmp_path):
    e = engines(name)
    path = make_adapter(str(tmp_path / f"{name}.safetensors"), seed=3, model=name, strength=3.0)
    p = params(e)
    base = pixels(e.run([Row("a", None, 1)], p).images[0])
    e.load_lora("style", str(path))
    try:
        styled = pixels(e.run([Row("a", None, 1)], params(e, loras=(("style", 1.0),))).images[0])
        off = pixels(e.run([Row("a", None, 1)], params(e, loras=(("style", 0.0),))).images[0])
    finally:
        e.unload_lora("style")
    assert np.abs(styled - base).mean() > 1
    assert np.array_equal(off, base)  # scale 0: the base model, bit for bit


@pytest.mark.parametrize("name", ["tiny-sd", "tiny-flux"])
def test_a_peft_adapter_directory_acts_as_its_file(engines, name, tmp_path):
    """PEFT's layout (adapter_config.json with lora_alpha = 2r, PEFT's key names) loads and
    gives the image of the same adapter as a safetensors file."""
    e = engines(name)
    file = make_adapter(str(tmp_path / "a.safetensors"), seed=4, model=name, strength=3.0)
    folder = make_adapter(str(tmp_path / "a-peft"), seed=4, model=name, strength=3.0, alpha=8)
    assert json.loads((folder / "adapter_config.json").read_text())["lora_alpha"] == 8
    images = []
    for adapter in (file, folder):
        e.load_lora("x", str(adapter))
        try:
            images.append(pixels(e.run([Row("a", None, 2)], params(e, loras=(("x", 1.0),))).images[0]))
        finally:
            e.unload_lora("x")
    base = pixels(e.run([Row("a", None, 2)], params(e)).images[0])
    assert np.abs(images[0] - base).mean() > 1 and np.abs(images[1] - images[0]).max() <= 1


def test_a_video_has_the_frames_asked_for_in_each_format(engines):
    e = engines("tiny-wan")
    out = e.run([Row("a boat", None, 1)], params(e, num_frames=5))
    frames = out.images[0]
    assert len(frames) == 5 and frames[0].size == (32, 32)
    mp4 = encode_output(frames, "mp4", 8)
    with av.open(io.BytesIO(mp4)) as c:
        stream = c.streams.video[0]
        assert stream.codec_context.name == "h264" and stream.average_rate == 8
        decoded = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    assert len(decoded) == 5 and decoded[0].shape == (32, 32, 3)
    for fmt in ("webp", "gif"):
        im = Image.open(io.BytesIO(encode_output(frames, fmt, 8)))
        assert im.format == fmt.upper() and im.n_frames == 5


@pytest.mark.parametrize("name", ["tiny-sd", "tiny-flux"])
def test_rows_with_different_adapters_share_a_call_and_keep_their_images(engines, name, tmp_path):
    """Per-row deltas (`row_lora`): the base layers run once for all rows, each row adds its own
    adapters' delta; rows without one get the base output. Each image matches the image its
    request makes alone to within 3 levels of 255 (the CPU's rounding for another batch)."""
    e = engines(name)
    for n, seed in (("red", 1), ("blue", 2)):
        path = make_adapter(str(tmp_path / f"{n}.safetensors"), seed=seed, model=name, strength=3.0)
        e.load_lora(n, str(path))
    try:
        p = params(e)
        rows = [Row("a", None, 1, adapters=(("red", 1.0),)), Row("b", None, 2, adapters=(("blue", 0.5),)),
                Row("c", None, 3)]  # fmt: skip
        mixed = e.run(rows, p)
        for row, img in zip(rows, mixed.images, strict=True):
            alone = e.run([Row(row.prompt, None, row.seed)], params(e, loras=row.adapters)).images[0]
            assert np.abs(pixels(img) - pixels(alone)).max() <= 3, row.adapters
        assert np.abs(pixels(mixed.images[0]) - pixels(e.run([rows[0]], params(e)).images[0])).max() <= 3
        # One adapter at two scales, a stacked set, and rows of its parts in one call (and a
        # call of sets alone): each row still matches its lone image, and the layers keep no
        # trace of the call after (no hook left, their adapters as they were). (Scales stay
        # moderate: with both strength-3 adapters at 1.0 this random twin amplifies rounding so
        # much that even two rows of the same set in one plain call differ by 44 levels.)
        stacked = (("blue", 0.5), ("red", 0.7))
        for sets in ([(("red", 1.0),), (("red", 0.5),), stacked, (("blue", 0.5),), ()],
                     [stacked, (("blue", 0.4), ("red", 0.6))]):  # fmt: skip
            rows = [Row("a", None, 1, adapters=a) for a in sets]
            for row, img in zip(rows, e.run(rows, p).images, strict=True):
                alone = e.run([Row(row.prompt, None, row.seed)], params(e, loras=row.adapters)).images[0]
                assert np.abs(pixels(img) - pixels(alone)).max() <= 3, row.adapters
        lone = [
            pixels(e.run([Row("a", None, 1, adapters=a)], p).images[0])
            for a in ((("red", 1.0),), (("red", 0.5),), stacked)
        ]
        assert all(np.abs(x - y).max() > 5 for x, y in ((lone[0], lone[1]), (lone[1], lone[2])))
        layers = [m for m in find_denoiser(e.pipe).modules() if hasattr(m, "scaling")]
        assert layers and not any(m._forward_hooks for m in layers)
        assert all(set(m.active_adapters) == {"red", "blue"} for m in layers)  # the last (stacked) call's
    finally:
        e.unload_lora("red")
        e.unload_lora("blue")
