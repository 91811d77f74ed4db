"""GGUF checkpoints (llama.cpp's format, as the community publishes quantized FLUX transformers):
the FLUX twin written as GGUF by the project (`python -m serve_app.single_file ... x.gguf`, the
`gguf` package's writer) in Q8_0 and in a 4-bit type loads with its weights kept quantized
(diffusers' GGUF linear layers) and makes images within a stated PSNR of the unquantized twin's,
in-process and over HTTP, as `model.source` and as a pool's checkpoint; a GGUF file cut short,
lying in its header, of a type diffusers cannot read, of another layout or a pickle under the
name fails the start naming the file, or is a 400 naming `source`, the replica keeping its id."""

from __future__ import annotations

import base64
import io

import gguf
import numpy as np
import pytest
import torch
from PIL import Image

from serve_app.config import ModelConfig
from serve_app.engine import CallParams, DiffusionEngine, ModelLoadError, Row
from serve_app.engine.builtin import build_builtin
from serve_app.formats.layouts import GGUF_TYPES, FileRefused, file_layout, gguf_keys
from serve_app.tools.single_file import main as write_main
from tests.conftest import replica_ids

PROMPT = "a red circle"
# Stated bounds: the PSNR (8-bit pixels, 32x32, 3 steps) of each type's image against the
# unquantized twin's. Measured: Q8_0 59 dB (1 grey level at most), Q4_0 43.5 dB.
PSNR_AT_LEAST = {"Q8_0": 50.0, "Q4_0": 35.0}


def _write(path, tensors: dict, raw: dict | None = None) -> None:
    w = gguf.GGUFWriter(str(path), arch="flux")
    for name, data in tensors.items():
        w.add_tensor(name, data)
    for name, (data, kind) in (raw or {}).items():
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The FLUX twin (seed 0) in Q8_0 and Q4_0, the seed-1 twin's transformer in Q8_0 and
    unquantized, and the bad files."""
    root = tmp_path_factory.mktemp("gguf")
    for quant in PSNR_AT_LEAST:
        write_main(["builtin:tiny-flux", str(root / f"flux-{quant}.gguf"), "--quant", quant])
    from serve_app.formats.single_file_write import write_gguf, write_single_file

    seed1 = build_builtin("tiny-flux", seed=1)  # its transformer; a FLUX file's other parts are the configs'
    write_gguf(seed1, root / "flux-1.gguf")
    write_single_file(seed1, root / "flux-1.safetensors")
    good = (root / "flux-Q8_0.gguf").read_bytes()
    (root / "cut.gguf").write_bytes(good[: len(good) // 2])
    (root / "header-cut.gguf").write_bytes(good[:200])
    lying = bytearray(good)
    lying[8:16] = (2**40).to_bytes(8, "little")  # a tensor count no file has
    (root / "lying.gguf").write_bytes(bytes(lying))
    (root / "magic.gguf").write_bytes(b"GGUX" + good[4:])
    # One field, an array longer than the file (of bytes), or claiming 2**63 items (of strings).
    field = (1).to_bytes(8, "little") + b"a" + (9).to_bytes(4, "little")
    for name, kind, count in (("array", 0, 50_000), ("strings", 8, 2**63)):
        head = b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (1).to_bytes(8, "little")
        (root / f"{name}.gguf").write_bytes(
            head + field + kind.to_bytes(4, "little") + count.to_bytes(8, "little")
        )
    torch.save({"weight": torch.zeros(2)}, root / "pickle.gguf")
    iq2 = gguf.GGMLQuantizationType.IQ2_XXS  # one gguf reads and diffusers does not
    _write(root / "iq2.gguf", {"img_in.weight": np.zeros((32, 16), np.float32)},
           {"double_blocks.0.img_attn.qkv.weight": (np.zeros((96, 66), np.uint8), iq2)})  # fmt: skip
    zeros = np.zeros((4, 4), np.float32)
    _write(root / "sd.gguf", {"model.diffusion_model.input_blocks.0.0.weight": zeros,
                              "cond_stage_model.transformer.x.weight": zeros})  # fmt: skip
    _write(
        root / "half.gguf",
        {
            "img_in.weight": np.zeros((32, 16), np.float32),
            "double_blocks.0.img_attn.qkv.weight": np.zeros((96, 32), np.float32),
        },
    )
    return root


def engine(source, **kw) -> DiffusionEngine:
    cfg = ModelConfig(
        source=str(source), pipeline_config="builtin:tiny-flux", device="cpu", warmup=False, **kw
    )
    return DiffusionEngine(cfg)


def pixels(e: DiffusionEngine, seed: int = 1) -> np.ndarray:
    params = CallParams(height=32, width=32, steps=3, guidance_scale=3.5)
    return np.asarray(e.run([Row(PROMPT, None, seed)], params).images[0]).astype(float)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a - b) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)


def test_gguf_types_are_the_ones_diffusers_reads():
    from diffusers.quantizers.gguf.utils import SUPPORTED_GGUF_QUANT_TYPES

    assert set(GGUF_TYPES) == {t.name for t in SUPPORTED_GGUF_QUANT_TYPES} | {"F32", "F16"}


def test_a_gguf_twin_keeps_its_weights_quantized_and_makes_the_twins_image(files):
    twin = DiffusionEngine(ModelConfig(source="builtin:tiny-flux", device="cpu", warmup=False))
    try:
        want, full = pixels(twin), twin.describe()["denoiser_bytes"]
    finally:
        twin.close()
    for quant, bound in PSNR_AT_LEAST.items():
        e = engine(files / f"flux-{quant}.gguf")
        try:
            held = e.describe()
            assert held["denoiser_weights"][0] == quant and held["denoiser_bytes"] < 0.35 * full, held
            assert type(e.pipe.transformer.transformer_blocks[0].attn.to_q).__name__ == "GGUFLinear"
            got = psnr(pixels(e), want)
            assert bound <= got < float("inf"), (quant, got)  # close, and not the float weights
        finally:
            e.close()
    with pytest.raises(ModelLoadError, match="model.optimizations.quantize: the denoiser of a GGUF file"):
        engine(files / "flux-Q8_0.gguf", optimizations={"quantize": "int8_weight_only"})


BAD = [
    ("cut.gguf", "is cut short: tensor"),
    ("header-cut.gguf", "is cut short: its header needs more than the 200 bytes"),
    ("lying.gguf", "its header claims 1099511627776 tensors"),
    ("magic.gguf", "is not a GGUF file"),
    ("array.gguf", "is cut short: its header needs more than the 49 bytes"),
    ("strings.gguf", "its fields hold over 100000 items"),
    ("pickle.gguf", "holds a pickle"),
    ("iq2.gguf", "in GGUF type IQ2_XXS, which diffusers cannot read"),
    ("sd.gguf", "GGUF files are loaded as FLUX, Wan transformers only"),
]


@pytest.mark.parametrize("name, message", BAD)
def test_a_bad_gguf_file_is_refused_naming_why(files, name, message):
    with pytest.raises(FileRefused, match=message):
        file_layout(files / name)  # the ingress's check: the header read in a child process
    with pytest.raises(ModelLoadError, match=f"model.source: '.*{name}' .*{message}"):
        engine(files / name)


def test_a_gguf_file_lacking_weights_fails_the_start_naming_them(files):
    assert gguf_keys(files / "half.gguf") == ["img_in.weight", "double_blocks.0.img_attn.qkv.weight"]
    with pytest.raises(ModelLoadError, match=r"half.gguf' lacks \d+ weights of the transformer"):
        engine(files / "half.gguf")


# Wan's twin: its narrow layers (24 wide) stay F32, the 32-wide ones are quantized. Measured over
# 5 frames of 32x32, 3 steps: Q8_0 81.5 dB, Q4_0 60.1 dB against the unquantized twin's video.
WAN_PSNR_AT_LEAST = {"Q8_0": 70.0, "Q4_0": 50.0}


def test_a_wan_transformer_file_and_its_gguf_twins_make_the_twins_video(tmp_path):
    """Wan's transformer alone in Wan-AI's layout (`blocks.N.self_attn.q`, `head.head`), as a
    safetensors file (the same video, exactly) and as GGUF in Q8_0 and Q4_0 (quantized layers
    kept so, within the stated PSNR), with the rest of the pipeline from `builtin:tiny-wan`."""
    params = CallParams(height=32, width=32, steps=3, guidance_scale=5.0, num_frames=5)

    def frames(e: DiffusionEngine) -> np.ndarray:
        try:
            return np.stack(
                [np.asarray(f).astype(float) for f in e.run([Row(PROMPT, None, 1)], params).images[0]]
            )
        finally:
            e.close()

    want = frames(DiffusionEngine(ModelConfig(source="builtin:tiny-wan", device="cpu", warmup=False)))
    for name in ("wan.safetensors", *(f"wan-{q}.gguf" for q in WAN_PSNR_AT_LEAST)):
        quant = name.removesuffix(".gguf").split("-")[-1]
        write_main(
            ["builtin:tiny-wan", str(tmp_path / name), *(["--quant", quant] if "gguf" in name else [])]
        )
        assert file_layout(tmp_path / name) == "wan"
    cfg = dict(pipeline_config="builtin:tiny-wan", device="cpu", warmup=False)
    from safetensors.torch import load_file, save_file

    original = load_file(str(tmp_path / "wan.safetensors"))
    prefixed = {f"model.diffusion_model.{k}": v for k, v in original.items()}
    save_file(prefixed, str(tmp_path / "wan-comfy.safetensors"))  # ComfyUI's repackaging
    for name in ("wan.safetensors", "wan-comfy.safetensors"):
        source = str(tmp_path / name)
        assert psnr(frames(DiffusionEngine(ModelConfig(source=source, **cfg))), want) == float("inf"), name
    for quant, bound in WAN_PSNR_AT_LEAST.items():
        e = DiffusionEngine(ModelConfig(source=str(tmp_path / f"wan-{quant}.gguf"), **cfg))
        assert e.describe()["denoiser_weights"] == ["float32", quant]
        assert type(e.pipe.transformer.blocks[0].ffn.net[2]).__name__ == "GGUFLinear"
        assert bound <= psnr(frames(e), want) < float("inf"), quant


def png(r) -> np.ndarray:
    assert r.status_code == 200, r.text
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"])))).astype(float)


def test_gguf_files_are_served_as_the_model_and_as_a_pools_checkpoints(files, app_factory, client, tmp_path):
    prefix = app_factory(
        "gguf",
        model={"source": str(files / "flux-Q4_0.gguf"), "pipeline_config": "builtin:tiny-flux"},
        multiplex={"max_models_per_replica": 1},
        checkpoints={"allowed_roots": [str(files)], "registry_path": str(tmp_path / "checkpoints.json")},
    )
    card = client.get(f"{prefix}/v1/models").json()["data"][0]
    assert card["id"] == "flux-Q4_0" and card["family"] == "flux"
    assert card["denoiser_weights"][0] == "Q4_0" and card["denoiser_bytes"] > 0
    body = {"prompt": PROMPT, "seed": 1, "size": "32x32", "num_inference_steps": 3, "guidance_scale": 3.5}
    served = png(client.post(f"{prefix}/v1/images/generations", json=body))
    threads = torch.get_num_threads()
    twins = [  # the twin, and the seed-1 transformer around the pool's configs, unquantized
        DiffusionEngine(ModelConfig(source="builtin:tiny-flux", device="cpu", warmup=False, cpu_threads=1)),
        engine(files / "flux-1.safetensors", cpu_threads=1),
    ]
    try:
        want, want_1 = (pixels(t) for t in twins)
    finally:
        for t in twins:
            t.close()
        torch.set_num_threads(threads)
    assert psnr(served, want) >= PSNR_AT_LEAST["Q4_0"]

    before = replica_ids(client, prefix)
    add = client.post(f"{prefix}/v1/checkpoints", json={"name": "one", "source": str(files / "flux-1.gguf")})
    assert add.status_code == 200, add.text
    one = png(client.post(f"{prefix}/v1/images/generations", json={**body, "model": "one"}))
    assert psnr(one, want_1) >= PSNR_AT_LEAST["Q8_0"] and psnr(one, want) < 30
    for name, message in [*BAD, ("half.gguf", "lacks")]:
        r = client.post(
            f"{prefix}/v1/checkpoints", json={"name": name.split(".")[0], "source": str(files / name)}
        )
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "source" and message in err["message"], (name, err)
        assert str(files) not in r.text, err
    assert replica_ids(client, prefix) == before
