"""Image inputs at the engine: image-to-image, inpainting and an instruction edit (FLUX.1 Kontext
shape), each on pipelines that share the loaded model's modules."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from serve_app.engine import CallParams, DiffusionEngine, Row
from tests.conftest import engine_cache

TASKS = {
    "tiny-sd": ["generate", "img2img", "inpaint"],
    "tiny-sdxl": ["generate", "img2img", "inpaint"],
    "tiny-sd3": ["generate", "img2img", "inpaint"],
    "tiny-flux": ["generate", "img2img", "inpaint"],
    "tiny-flux-kontext": ["generate", "edit"],
    "tiny-wan": ["generate"],
}


@pytest.fixture(scope="module")
def engines():
    with engine_cache(default_steps=3) as get:
        yield get


def picture(size: int = 64, seed: int = 0) -> Image.Image:
    """A smooth test picture: two colour ramps and a disc."""
    y, x = np.mgrid[0:size, 0:size] / size
    rng = np.random.default_rng(seed)
    r, g = x * 255, y * 255
    b = np.where((x - 0.5) ** 2 + (y - 0.5) ** 2 < rng.uniform(0.04, 0.1), 230.0, 40.0)
    return Image.fromarray(np.stack([r, g, b], -1).astype(np.uint8))


def px(im) -> np.ndarray:
    return np.asarray(im).astype(int)


def params(e: DiffusionEngine, **kw) -> CallParams:
    return CallParams(height=64, width=64, steps=kw.pop("steps", 4), guidance_scale=4.0, **kw)


@pytest.mark.parametrize("name", list(TASKS))
def test_each_model_does_the_tasks_its_family_has(engines, name):
    e = engines(name)
    assert e.tasks == TASKS[name]
    assert e.describe()["tasks"] == TASKS[name]
    if "img2img" in TASKS[name]:  # derived pipelines share the model's modules: no second copy
        derived = e._task_pipes["img2img"]
        assert derived is not e.pipe and derived.vae is e.pipe.vae
        assert (getattr(derived, "unet", None) or derived.transformer) is (
            getattr(e.pipe, "unet", None) or e.pipe.transformer
        )
    missing = "edit" if "edit" not in TASKS[name] else "img2img"
    with pytest.raises(ValueError, match=f"cannot do {missing}"):
        e.check_task(missing)


def encoded(e: DiffusionEngine, im: Image.Image) -> torch.Tensor:
    """The input image in the model's latent space, as the pipeline starts from it."""
    pipe = e.pipe
    with torch.no_grad():
        z = pipe.vae.encode(pipe.image_processor.preprocess(im)).latent_dist.mode()
    return (z - (pipe.vae.config.shift_factor or 0)) * pipe.vae.config.scaling_factor


@pytest.mark.parametrize("name", ["tiny-sd", "tiny-flux"])
def test_img2img_runs_the_strength_s_share_of_the_steps_from_the_input(engines, name):
    e = engines(name)
    src = picture(seed=1)
    totals = []
    p = params(e, task="img2img", strength=0.1, steps=20)
    out = e.run([Row("a", None, 1, image=src)], p, lambda i, total, latents: totals.append(total))
    assert totals[-1] == out.steps_run == 2 and not out.interrupted  # 10% of 20 steps
    other = e.run([Row("a", None, 1, image=picture(seed=2))], p)
    assert not np.array_equal(px(out.images[0]), px(other.images[0]))  # the input shapes the output
    # The more strength, the further the result from the input. (In latent space: these
    # random-weight VAEs do not reconstruct an image, so pixels cannot show it; see
    # docs/shapes-model.md for the trained model that will.)
    z, far = encoded(e, src), []
    for strength in (0.05, 0.5, 1.0):
        lat = e.run([Row("a", None, 1, image=src)], params(e, task="img2img", strength=strength, steps=20,
                                                           return_latents=True)).latents  # fmt: skip
        if lat.ndim == 3:  # FLUX's packed sequence
            lat = type(e.pipe)._unpack_latents(lat, 64, 64, e.pipe.vae_scale_factor)
        far.append(float((lat - z).abs().mean()))
    assert far[0] < far[1] < far[2], far


def test_an_edited_image_is_the_same_alone_and_in_a_batch(engines):
    e = engines("tiny-sd")
    p = params(e, task="img2img", strength=0.6)
    a, b = picture(seed=1), picture(seed=2)
    pair = e.run([Row("x", None, 3, image=a), Row("y", None, 4, image=b)], p)
    alone = e.run([Row("y", None, 4, image=b)], p)
    assert np.abs(px(pair.images[1]) - px(alone.images[0])).max() <= 2  # to the CPU's rounding
    assert not np.array_equal(px(pair.images[0]), px(pair.images[1]))


@pytest.mark.parametrize("name", ["tiny-sd", "tiny-sdxl"])
def test_inpainting_changes_the_masked_part_most(engines, name):
    e = engines(name)
    src = picture()
    mask = Image.new("L", (64, 64), 0)
    mask.paste(255, (0, 0, 32, 64))  # paint the left half
    p = params(e, task="inpaint", steps=6, return_latents=True)
    out = e.run([Row("a", None, 1, image=src, mask=mask)], p).latents
    moved = (out - encoded(e, src)).abs().mean(dim=(0, 1, 2))  # per latent column
    left, right = float(moved[:14].mean()), float(moved[18:].mean())
    assert left > 2 * right, (left, right)  # the unmasked half is kept (in latent space)


def test_an_instruction_edit_sees_its_reference_image(engines):
    e = engines("tiny-flux-kontext")
    p = params(e, task="edit", return_latents=True)

    def edit(seed: int) -> torch.Tensor:
        out = e.run([Row("make it red", None, 1, image=picture(seed=seed))], p)
        assert out.images[0].size == (64, 64)  # the size asked for (Kontext would scale to 1 MP)
        return out.latents

    one, same, other = edit(1), edit(1), edit(5)
    # The reference image's tokens take part: another image, other latents (by little, with
    # random weights); the same image, the same latents.
    assert torch.equal(one, same) and float((one - other).abs().mean()) > 1e-5
    # Without an image the same model generates from the prompt alone.
    assert e.run([Row("a red square", None, 1)], params(e)).images[0].size == (64, 64)
