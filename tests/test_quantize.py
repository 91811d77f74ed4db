"""Quantized weights (`model.optimizations.quantize`, torchao) on CPU: the denoiser's linear
layers hold int8 weights, the engine generates images close to the unquantized ones, and
adapters still apply (their low-rank path runs beside the quantized base layer)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from serve_app.config import ModelConfig, Optimizations
from serve_app.engine import CallParams, DiffusionEngine, Row
from serve_app.engine.engine import ModelLoadError, find_denoiser
from serve_app.tools.lora import make_adapter


def engine(name: str, quantize: str = "none") -> DiffusionEngine:
    opt = Optimizations(quantize=quantize)
    return DiffusionEngine(
        ModelConfig(source=f"builtin:{name}", device="cpu", warmup=False, optimizations=opt)
    )


def images(e: DiffusionEngine, **kw) -> list[np.ndarray]:
    p = CallParams(height=32, width=32, steps=4, guidance_scale=4.0, **kw)
    out = e.run([Row("a red circle", None, 1), Row("a blue square", None, 2)], p)
    return [np.asarray(im, dtype=np.int16) for im in out.images]


@pytest.mark.parametrize("name", ["tiny-sd", "tiny-flux"])
@pytest.mark.parametrize("kind", ["int8_weight_only", "int8_dynamic"])
def test_int8_weights_generate_close_images_and_take_adapters(name, kind, tmp_path):
    plain, quant = engine(name), engine(name, kind)
    linears = [m for m in find_denoiser(quant.pipe).modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m.weight) is not torch.nn.Parameter for m in linears), "not quantized"
    assert all(type(m.weight) is torch.nn.Parameter for m in find_denoiser(plain.pipe).modules()
               if isinstance(m, torch.nn.Linear))  # fmt: skip
    held, full = quant.describe(), plain.describe()  # /v1/models' figures: what the device holds
    assert "Int8Tensor" in held["denoiser_weights"] and held["denoiser_bytes"] < full["denoiser_bytes"]
    base, q = images(plain), images(quant)
    for a, b in zip(base, q, strict=True):
        diff = np.abs(a - b)
        assert diff.mean() < 1 and diff.max() < 20, (diff.mean(), diff.max())
    path = make_adapter(str(tmp_path / "a.safetensors"), seed=4, model=name, strength=2.0)
    for e in (plain, quant):
        e.load_lora("a", str(path))
    with_plain, with_quant = images(plain, loras=(("a", 1.0),)), images(quant, loras=(("a", 1.0),))
    for b, a, aq in zip(base, with_plain, with_quant, strict=True):
        assert np.abs(a - b).mean() > 2  # the adapter changes the image...
        assert np.abs(aq - a).mean() < 1  # ...and the same way on the quantized weights


def test_float8_on_cpu_and_unknown_kinds_are_refused():
    with pytest.raises(ModelLoadError, match="model.optimizations.quantize: float8_weight_only needs a CUDA"):
        engine("tiny-sd", "float8_weight_only")
    with pytest.raises(ValueError, match="quantize"):
        Optimizations(quantize="int3")
