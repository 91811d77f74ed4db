"""Single-file checkpoints in the original (A1111/ComfyUI) Stable Diffusion 1.x and SDXL
layouts: each embedded twin written as one file (`python -m serve_app.single_file`) loads back through
diffusers' `from_single_file`, its configs from `model.pipeline_config` (an embedded model's or
a local diffusers directory, nothing downloaded), and makes the twin's images; files that are
cut short, pickles, of another layout or incomplete fail the start naming the file; served
over HTTP as `model.source` and as a pool's checkpoint, where each bad file is a 400 naming
`source` and the replica keeps its id."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from serve_app.config import ModelConfig
from serve_app.engine import CallParams, DiffusionEngine, ModelLoadError, Row
from serve_app.engine.builtin import build_builtin
from serve_app.engine.engine import find_denoiser
from serve_app.formats.layouts import checkpoint_layout
from serve_app.formats.single_file_load import write_configs
from serve_app.formats.single_file_write import write_single_file
from serve_app.tools.single_file import main as write_main
from tests.conftest import app_args, engine_cache, replica_ids
from tests.conftest import deploy as deploy_app

PROMPT = "a red circle"
NEWER = ("tiny-qwen-image", "tiny-z-image", "tiny-flux2", "tiny-ltx")  # families loaded from directories only


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The twins (seed 0, written by the command line) and ones of other weights (seed 1) in
    the original layout, and the bad files: cut short, a pickle under the name, a file of no
    checkpoint layout, headers of the layouts not loaded, ones without a part or half of one,
    a `.ckpt`."""
    root = tmp_path_factory.mktemp("single-file")
    for name in ("tiny-sd", "tiny-sdxl", "tiny-sd3", "tiny-flux"):
        write_main([f"builtin:{name}", str(root / f"{name}.safetensors")])
        write_single_file(build_builtin(name, seed=1), root / f"{name}-1.safetensors")
    good = (root / "tiny-sd.safetensors").read_bytes()
    (root / "cut.safetensors").write_bytes(good[: len(good) // 2])
    torch.save({"weight": torch.zeros(2)}, root / "pickle.safetensors")
    torch.save({"weight": torch.zeros(2)}, root / "old.ckpt")
    save_file(build_builtin("tiny-sd").unet.state_dict(), str(root / "unet-only.safetensors"))
    for twin in NEWER:  # the newer families' denoisers as ComfyUI's files have them, prefixed or not
        state = find_denoiser(build_builtin(twin)).state_dict()
        save_file({k: v.contiguous() for k, v in state.items()}, str(root / f"{twin}.safetensors"))
        save_file({"model.diffusion_model." + k: v.contiguous() for k, v in state.items()},
                  str(root / f"{twin}-comfy.safetensors"))  # fmt: skip
    unet = "model.diffusion_model."
    for name, keys in (  # headers of the other layouts
        ("sd2", [unet + "input_blocks.0.0.weight", "cond_stage_model.model.ln_final.weight"]),
        ("sd3", [unet + "joint_blocks.0.x_block.attn.qkv.weight"]),
    ):
        save_file({k: torch.zeros(1) for k in keys}, str(root / f"{name}.safetensors"))
    state = load_file(str(root / "tiny-sd.safetensors"))
    save_file({k: v for k, v in state.items() if not k.startswith("first_stage_model.")},
              str(root / "no-vae.safetensors"))  # fmt: skip
    save_file({k: v for k, v in state.items() if not k.startswith("first_stage_model.decoder.")},
              str(root / "half-vae.safetensors"))  # fmt: skip
    layer = "cond_stage_model.transformer.text_model.encoder.layers.1."
    save_file(
        {k: v for k, v in state.items() if not k.startswith(layer)}, str(root / "half-text.safetensors")
    )
    xl = load_file(str(root / "tiny-sdxl.safetensors"))
    second = "conditioner.embedders.1.model."
    save_file({k: v for k, v in xl.items() if not k.startswith(second)},
              str(root / "xl-no-text-2.safetensors"))  # fmt: skip
    save_file({k: v for k, v in xl.items() if not k.startswith(second + "transformer.resblocks.1.")},
              str(root / "xl-half-text-2.safetensors"))  # fmt: skip
    sd3 = load_file(str(root / "tiny-sd3.safetensors"))
    save_file({k: v for k, v in sd3.items() if not k.startswith("text_encoders.")},
              str(root / "sd3-no-text.safetensors"))  # fmt: skip  # as sd3_medium.safetensors ships
    t5_block = "text_encoders.t5xxl.transformer.encoder.block.1."
    save_file({k: v for k, v in sd3.items() if not k.startswith(t5_block)},
              str(root / "sd3-half-t5.safetensors"))  # fmt: skip
    save_file({k: v.to(torch.float8_e4m3fn) if k.startswith("text_encoders.t5xxl.") else v
               for k, v in sd3.items()}, str(root / "sd3-t5-fp8.safetensors"))  # fmt: skip
    projection = "text_encoders.clip_l.transformer.text_projection.weight"
    save_file({k: v for k, v in sd3.items() if k != projection}, str(root / "sd3-no-projection.safetensors"))
    flux = load_file(str(root / "tiny-flux.safetensors"))  # BFL's layout: unprefixed
    save_file({"model.diffusion_model." + k: v for k, v in flux.items()}  # ComfyUI's, with its other parts
              | {"vae.decoder.conv_in.weight": torch.zeros(1),
                 "text_encoders.clip_l.logit_scale": torch.zeros(1)},
              str(root / "comfy-flux.safetensors"))  # fmt: skip
    save_file({k: v.to(torch.float8_e4m3fn) for k, v in flux.items()}, str(root / "fp8-flux.safetensors"))
    save_file({k: v for k, v in flux.items() if not k.startswith("single_blocks.")},
              str(root / "flux-no-single.safetensors"))  # fmt: skip
    save_file({"double_blocks.0.img_attn.qkv.weight": torch.zeros(1)}, str(root / "flux-header.safetensors"))
    build_builtin("tiny-flux").save_pretrained(root / "tiny-flux-diffusers", safe_serialization=True)
    build_builtin("tiny-sd").save_pretrained(root / "tiny-sd-diffusers", safe_serialization=True)
    build_builtin("tiny-sd3", seed=1).save_pretrained(root / "tiny-sd3-1-diffusers", safe_serialization=True)
    write_configs(build_builtin("tiny-sd3", device="meta"), root / "tiny-sd3-configs")  # no weights
    return root


@pytest.fixture(scope="module")
def engines():
    with engine_cache() as get:
        yield get


def engine(source, pipeline_config="builtin:tiny-sd", **kw) -> DiffusionEngine:
    cfg = ModelConfig(source=str(source), pipeline_config=pipeline_config, device="cpu", warmup=False, **kw)
    return DiffusionEngine(cfg)


def pixels(e: DiffusionEngine, seed: int = 1) -> np.ndarray:
    params = CallParams(
        height=32, width=32, steps=3, guidance_scale=3.5 if e.describe()["family"] == "flux" else 7.5
    )
    return np.asarray(e.run([Row(PROMPT, None, seed)], params).images[0]).astype(int)


@pytest.mark.parametrize(
    "name, config",
    [("tiny-sd", "builtin:tiny-sd"), ("tiny-sd", "directory"), ("tiny-sdxl", "builtin:tiny-sdxl"),
     ("tiny-sd3", "builtin:tiny-sd3"), ("tiny-flux", "builtin:tiny-flux"), ("tiny-flux", "directory")],
)  # fmt: skip
def test_a_single_file_makes_the_images_of_the_pipeline_it_was_written_from(files, engines, name, config):
    """Its weights come from the file (the seed-1 twin's, whatever the config directory holds)
    and its configs, tokenizers and scheduler from the config: the same images (to one grey
    level). SDXL's two text encoders are as wide as each other here, and SD3's two CLIPs, so
    each is found by its prefix, not by its width. A FLUX file holds the transformer alone, at
    a width diffusers' converter cannot read; the other parts are the config's."""
    layout = {"tiny-sd": "sd1", "tiny-sdxl": "sdxl", "tiny-sd3": "sd3", "tiny-flux": "flux"}[name]
    assert checkpoint_layout(list(load_file(str(files / f"{name}.safetensors")))) == layout
    pipeline_config = str(files / f"{name}-diffusers") if config == "directory" else config
    twin, other = (
        engine(files / f"{name}.safetensors", pipeline_config),
        engine(files / f"{name}-1.safetensors", pipeline_config),
    )
    seed1 = DiffusionEngine(ModelConfig(source=f"builtin:{name}", seed=1, device="cpu", warmup=False))
    try:
        assert twin.model_name == name
        assert twin.describe()["family"] == engines(name).describe()["family"]
        names = ("transformer",) if layout == "flux" else ("unet", "transformer", "vae", "text_encoder",
                                                            "text_encoder_2", "text_encoder_3")  # fmt: skip
        parts = [n for n in names if getattr(seed1.pipe, n, None)]
        assert len(parts) == {"sd1": 3, "sdxl": 4, "sd3": 5, "flux": 1}[layout]
        for part in parts:
            mine, built = getattr(other.pipe, part).state_dict(), getattr(seed1.pipe, part).state_dict()
            assert mine.keys() == built.keys() and all(torch.equal(mine[k], built[k]) for k in mine), part
        # Equal weights (above) make the same image to one grey level: a model loaded from a file
        # may hold its tensors in another memory layout, and CPU kernels round a few ulps apart.
        assert np.abs(pixels(twin) - pixels(engines(name))).max() <= 1
        if layout != "flux":  # (a FLUX file's other parts are the config's, not the seed-1 twin's)
            assert np.abs(pixels(other) - pixels(seed1)).max() <= 1
        assert np.abs(pixels(other) - pixels(twin)).max() > 20  # the file's weights, not the config's
    finally:
        for e in (twin, other, seed1):
            e.close()


@pytest.mark.parametrize("twin", NEWER)
@pytest.mark.parametrize("suffix", ["", "-comfy"])
def test_a_newer_family_s_single_file_is_refused_naming_it(files, twin, suffix):
    """Single files are loaded in the layouts this server converts (SD 1.x, SDXL, SD3, FLUX,
    Wan); a newer family's transformer file, even with its pipeline's configs, fails the start
    naming the file and the layouts that load, not with a half-loaded model."""
    name = f"{twin}{suffix}.safetensors"
    with pytest.raises(ModelLoadError) as e:
        engine(files / name, f"builtin:{twin}")
    text = str(e.value)
    assert name in text and "of no checkpoint layout this server knows" in text, text
    assert "SD 1.x, SDXL, SD3, FLUX, Wan layouts only" in text or "Stable Diffusion 1.x" in text, text


@pytest.mark.parametrize(
    "name, config, message",
    [
        ("cut.safetensors", None, "is cut short"),
        ("pickle.safetensors", None, "holds a pickle"),
        ("unet-only.safetensors", None, "of no checkpoint layout this server knows"),
        (
            "sd2.safetensors",
            None,
            "is a checkpoint in the Stable Diffusion 2.x layout; single files are "
            "loaded in the Stable Diffusion 1.x, SDXL, SD3, FLUX, Wan layouts only",
        ),
        ("sd3.safetensors", "builtin:tiny-sd3", "holds no VAE weights (no first_stage_model.* tensors)"),
        (
            "sd3-half-t5.safetensors",
            "builtin:tiny-sd3",
            "lacks 8 weights of the text_encoder_3 (e.g. encoder.block.1.",
        ),
        ("tiny-sd3.safetensors", "builtin:tiny-sdxl", "describes a StableDiffusionXLPipeline"),
        (
            "flux-no-single.safetensors",
            "builtin:tiny-flux",
            "lacks 14 weights of the transformer (e.g. single_",
        ),
        ("flux-header.safetensors", "builtin:tiny-flux", "lacks 66 weights of the transformer"),
        ("tiny-flux.safetensors", "builtin:tiny-sd", "describes a StableDiffusionPipeline"),
        ("no-vae.safetensors", None, "holds no VAE weights (no first_stage_model.* tensors)"),
        ("half-vae.safetensors", None, "lacks weights of the vae"),
        ("half-text.safetensors", None, "lacks 16 weights of the text_encoder (e.g. encoder.layers.1."),
        ("missing.safetensors", None, "no checkpoint file at"),
        ("tiny-sd.safetensors", "builtin:tiny-sdxl", "describes a StableDiffusionXLPipeline"),
        ("tiny-sdxl.safetensors", "builtin:tiny-sd", "describes a StableDiffusionPipeline"),
        ("xl-no-text-2.safetensors", "builtin:tiny-sdxl", "holds no second text encoder weights"),
        ("xl-half-text-2.safetensors", "builtin:tiny-sdxl", "lacks 16 weights of the text_encoder_2 (e.g. "),
        ("tiny-sd.safetensors", "not-a-pipeline", "is not a local diffusers pipeline directory"),
    ],
)
def test_a_bad_checkpoint_file_fails_the_start_naming_the_file(files, name, config, message):
    with pytest.raises(ModelLoadError) as e:
        engine(files / name, config or "builtin:tiny-sd")
    text = str(e.value)
    assert message in text and (name in text or config in text), text


def test_pickles_and_files_without_configs_are_refused_by_the_config():
    for suffix in (".ckpt", ".pt", ".bin"):
        with pytest.raises(ValidationError, match="pickle checkpoint: loading a pickle runs the code"):
            ModelConfig(source=f"/models/v1-5{suffix}", pipeline_config="builtin:tiny-sd")
    with pytest.raises(ValidationError, match="pipeline_config: the single-file source '/m/a.safetensors'"):
        ModelConfig(source="/m/a.safetensors")
    with pytest.raises(ValidationError, match="unknown builtin model"):
        ModelConfig(source="/m/a.safetensors", pipeline_config="builtin:nope")
    readme = ModelConfig(source="/models/my-sd15-finetune.safetensors", pipeline_config="/models/sd15")
    assert readme.served_name == "my-sd15-finetune"


def png(r) -> np.ndarray:
    assert r.status_code == 200, r.text
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"])))).astype(int)


def test_single_files_are_served_as_the_model_and_as_a_pools_checkpoints(
    files, app_factory, client, tmp_path
):
    """The app's model is the twin's file (its image is the shared app's, which serves the
    twin), its pool takes a checkpoint file (the seed-1 twin's image), and every bad file is a
    400 naming `source` with no server path, the replica keeping its id."""
    prefix = app_factory(
        "single-file",
        model={"source": str(files / "tiny-sd.safetensors"), "pipeline_config": "builtin:tiny-sd"},
        multiplex={"max_models_per_replica": 1},
        checkpoints={"allowed_roots": [str(files)], "registry_path": str(tmp_path / "checkpoints.json")},
    )
    body = {"prompt": PROMPT, "seed": 1, "size": "32x32", "num_inference_steps": 3}
    mine = png(client.post(f"{prefix}/v1/images/generations", json=body))
    assert (mine == png(client.post("/v1/images/generations", json=body))).all()
    assert client.get(f"{prefix}/v1/models").json()["data"][0]["id"] == "tiny-sd"

    before = replica_ids(client, prefix)
    add = client.post(
        f"{prefix}/v1/checkpoints", json={"name": "one", "source": str(files / "tiny-sd-1.safetensors")}
    )
    assert add.status_code == 200, add.text
    assert add.json()["source"] == "tiny-sd-1.safetensors"  # relative to its root
    one = png(client.post(f"{prefix}/v1/images/generations", json={**body, "model": "one"}))
    threads = torch.get_num_threads()  # the replica's one thread, for the same rounding
    seed1 = DiffusionEngine(
        ModelConfig(source="builtin:tiny-sd", seed=1, device="cpu", warmup=False, cpu_threads=1)
    )
    try:
        assert np.abs(one - pixels(seed1)).max() <= 3 and np.abs(one - mine).max() > 20
    finally:
        seed1.close()
        torch.set_num_threads(threads)
    for name, message in [
        ("cut.safetensors", "'cut.safetensors' is cut short"),
        ("pickle.safetensors", "'pickle.safetensors' holds a pickle"),
        ("old.ckpt", "'old.ckpt' is a pickle checkpoint"),
        ("unet-only.safetensors", "'unet-only.safetensors' is of no checkpoint layout"),
        ("sd2.safetensors", "'sd2.safetensors' is a checkpoint in the Stable Diffusion 2.x layout; single"),
        ("no-vae.safetensors", "'no-vae.safetensors' holds no VAE weights"),
        ("tiny-sdxl.safetensors", "a StableDiffusionXLPipeline (sdxl); pool 'tiny-sd' serves sd checkpoints"),
        (
            "half-vae.safetensors",
            "'half-vae.safetensors' lacks weights of the vae",
        ),  # fails on the replica
    ]:
        r = client.post(
            f"{prefix}/v1/checkpoints", json={"name": name.split(".")[0], "source": str(files / name)}
        )
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "source" and message in err["message"], (name, err)
        assert str(files) not in r.text, err
    assert replica_ids(client, prefix) == before
    listed = {c["name"] for c in client.get(f"{prefix}/v1/checkpoints").json()["checkpoints"]}
    assert listed == {"one"}
    assert json.loads((tmp_path / "checkpoints.json").read_text()).keys() == {"one"}


def test_sdxl_sd3_and_flux_single_files_are_served_with_their_twins_images(files, client):
    """An SDXL file, an SD3 file and a FLUX transformer file as three models of one app make
    their twins' images over HTTP, each listed with its family."""
    args = app_args()
    model = {k: v for k, v in args.pop("model").items() if k != "aliases"}  # one model has them
    args["models"] = [
        {
            "model": {
                **model,
                "source": str(files / f"{name}.safetensors"),
                "pipeline_config": f"builtin:{name}",
            }
        }
        for name in ("tiny-sdxl", "tiny-sd3", "tiny-flux")
    ]
    from ray import serve

    prefix = deploy_app("single-file-2", args)
    try:
        listed = client.get(f"{prefix}/v1/models").json()["data"]
        assert sorted((m["id"], m["family"]) for m in listed) == [
            ("tiny-flux", "flux"),
            ("tiny-sd3", "sd3"),
            ("tiny-sdxl", "sdxl"),
        ]
        threads = torch.get_num_threads()
        for name, guidance in (("tiny-sdxl", 5.0), ("tiny-sd3", 7.0), ("tiny-flux", 3.5)):
            body = {"model": name, "prompt": PROMPT, "seed": 1, "size": "32x32", "num_inference_steps": 3}
            served = png(
                client.post(f"{prefix}/v1/images/generations", json={**body, "guidance_scale": guidance})
            )
            twin = DiffusionEngine(
                ModelConfig(source=f"builtin:{name}", device="cpu", warmup=False, cpu_threads=1)
            )
            try:
                params = CallParams(height=32, width=32, steps=3, guidance_scale=guidance)
                built = np.asarray(twin.run([Row(PROMPT, None, 1)], params).images[0]).astype(int)
                assert served.shape == built.shape and np.abs(served - built).max() <= 3, name
            finally:
                twin.close()
                torch.set_num_threads(threads)
    finally:
        serve.delete("single-file-2", _blocking=False)


def test_an_sd3_file_without_text_encoders_takes_the_configs_and_clip_l_pools_unprojected(files, engines):
    """Many SD3 files leave the text encoders out (`sd3_medium.safetensors`): those come with
    `model.pipeline_config` (built from `model.seed`), the rest from the file. A CLIP-L without
    a projection gets the identity, as SD3's reference code pools it; an fp8 T5 is widened."""
    bare = engine(files / "sd3-no-text.safetensors", "builtin:tiny-sd3")
    seed1 = engine(files / "sd3-no-text.safetensors", "builtin:tiny-sd3", seed=1)
    plain = engine(files / "sd3-no-projection.safetensors", "builtin:tiny-sd3")
    directory = engine(files / "sd3-no-text.safetensors", str(files / "tiny-sd3-1-diffusers"))
    fp8 = engine(files / "sd3-t5-fp8.safetensors", "builtin:tiny-sd3")
    try:
        mine, twin_t5 = (
            fp8.pipe.text_encoder_3.state_dict(),
            engines("tiny-sd3").pipe.text_encoder_3.state_dict(),
        )
        assert all(torch.equal(v, twin_t5[k].to(torch.float8_e4m3fn).float()) for k, v in mine.items())
        assert pixels(fp8).shape == (32, 32, 3)
        assert (pixels(bare) == pixels(engines("tiny-sd3"))).all()
        twin = engines("tiny-sd3").pipe
        for part in ("transformer", "vae"):  # the file's, whatever the seed
            assert all(torch.equal(v, twin.components[part].state_dict()[k])
                       for k, v in seed1.pipe.components[part].state_dict().items())  # fmt: skip
        assert np.abs(pixels(seed1) - pixels(bare)).max() > 20  # seed 1's text encoders
        assert (pixels(directory) == pixels(seed1)).all()  # a directory's text encoders: seed 1's too
        projection = plain.pipe.text_encoder.text_projection.weight
        assert torch.equal(projection, torch.eye(projection.shape[0], dtype=projection.dtype))
        assert np.abs(pixels(plain) - pixels(bare)).max() > 0
        with pytest.raises(ModelLoadError, match="holds no text_encoder weights .* has none either"):
            engine(files / "sd3-no-text.safetensors", str(files / "tiny-sd3-configs"))
    finally:
        for e in (bare, seed1, plain, directory, fp8):
            e.close()


def test_a_flux_file_in_comfyuis_layout_or_in_fp8_loads(files, engines):
    """ComfyUI's FLUX files hold the transformer under `model.diffusion_model.` beside parts of
    their own (the config's are used); an fp8 file's weights are widened to the model's dtype."""
    comfy = engine(files / "comfy-flux.safetensors", "builtin:tiny-flux")
    fp8 = engine(files / "fp8-flux.safetensors", "builtin:tiny-flux")
    try:
        assert (pixels(comfy) == pixels(engines("tiny-flux"))).all()
        mine, twin = fp8.pipe.transformer.state_dict(), engines("tiny-flux").pipe.transformer.state_dict()
        assert mine.keys() == twin.keys()
        for k, v in twin.items():
            assert mine[k].dtype == torch.float32 and torch.equal(
                mine[k], v.to(torch.float8_e4m3fn).float()
            ), k
        assert pixels(fp8).shape == (32, 32, 3)
    finally:
        comfy.close()
        fp8.close()


def test_a_pools_checkpoint_file_takes_its_configs_from_the_pools_model(files, tmp_path):
    """A pool of an embedded model (no `pipeline_config` of its own) loads a single-file
    checkpoint with that model's configs; its images are those of the weights in the file."""
    from serve_app.config import CheckpointsConfig, MultiplexSettings
    from serve_app.replica.pool import CheckpointServing

    pool = CheckpointServing()
    pool.cfg = ModelConfig(source="builtin:tiny-sd", device="cpu", warmup=False)
    pool._init_routing()
    settings = CheckpointsConfig(allowed_roots=[str(files)], registry_path=str(tmp_path / "registry.json"))
    pool._init_pool(lambda cfg, reuse: DiffusionEngine(cfg, reuse=reuse), MultiplexSettings(), settings)
    one = pool.checkpoints._load("one", str(files / "tiny-sd-1.safetensors"), {})
    seed1 = DiffusionEngine(ModelConfig(source="builtin:tiny-sd", seed=1, device="cpu", warmup=False))
    try:
        assert one.cfg.pipeline_config == "builtin:tiny-sd" and one.model_name == "one"
        assert (pixels(one) == pixels(seed1)).all()
    finally:
        for e in (one, seed1):
            e.close()
        pool.checkpoints.close()


def test_the_header_check_takes_every_real_file_and_refuses_hostile_headers(tmp_path):
    """A header length whose low bytes read 0x80 0x02 (a pickle's opening) in a real file is
    taken; headers that would overflow, nest without end or give byte ranges that are no
    ranges are refused as what they are, never an internal error."""
    import struct

    from serve_app.formats.layouts import FileRefused, safetensors_keys
    from serve_app.formats.single_file_load import CheckpointRefused, _checked_file

    real = tmp_path / "real.safetensors"
    for k in range(1, 700):  # a header of exactly 640 bytes: it begins 0x80 0x02
        save_file({"w": torch.zeros(1)}, str(real), metadata={"m": "a" * k})
        if real.read_bytes()[:2] == b"\x80\x02":
            break
    assert real.read_bytes()[:2] == b"\x80\x02"
    assert safetensors_keys(real) == ["w"]

    def written(name: str, header: bytes):
        path = tmp_path / name
        path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
        return path

    tensor = '{"t": {"dtype": "F32", "shape": [1], "data_offsets": %s}}'
    for name, header in [
        ("inf", (tensor % "[0, Infinity]").encode()),
        ("negative", (tensor % "[-4, 0]").encode()),
        ("backwards", (tensor % "[4, 0]").encode()),
        ("bools", (tensor % "[false, true]").encode()),
        ("deep", b"[" * 100_000 + b"]" * 100_000),
    ]:
        with pytest.raises(FileRefused, match="is not a safetensors file"):
            safetensors_keys(written(f"{name}.safetensors", header))
    shouting = tmp_path / "REAL.SAFETENSORS"
    shouting.write_bytes(real.read_bytes())
    with pytest.raises(CheckpointRefused, match="name ends in .safetensors"):
        _checked_file(str(shouting))  # diffusers would read it with torch.load


def test_the_flux_converter_agrees_with_diffusers_at_flux1s_width():
    """At FLUX.1's width (3072, the only one diffusers' converter reads) ours gives diffusers'
    names and tensors, and back; the twin's names stand for the full model's (fewer blocks),
    the tensors one column wide but for the rows the widths are read from."""
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    from serve_app.formats.flux_file import flux_from_original, flux_to_original

    width, g = 3072, torch.Generator().manual_seed(0)
    names = flux_to_original(build_builtin("tiny-flux").transformer.state_dict())
    rows = {"linear1": 7 * width, "qkv": 3 * width, "img_in": width}
    original = {
        k: torch.randn(next((n for part, n in rows.items() if part in k), 8), 1, generator=g) for k in names
    }
    ours = flux_from_original(dict(original))
    theirs = convert_flux_transformer_checkpoint_to_diffusers(dict(original))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    back = flux_to_original(ours)
    assert back.keys() == original.keys() and all(torch.equal(back[k], original[k]) for k in back)
