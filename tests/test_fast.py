"""`model.optimizations.speed: max` (the fast path, serve_app/engine/fast.py) on the CPU, where
inductor compiles too: the images of a UNet twin and a transformer twin against the eager engine's
(same seeds), calls padded up to the warmed batch sizes, an unwarmed size served uncompiled,
adapters swapped with no recompilation, a step cache and per-row adapters served uncompiled with
the compiled graphs intact after them, the compile cache read by another process, the settings
that cannot combine refused; and over HTTP, an application on the fast path through OpenAI's SDK.

"No recompilation" is proven, not timed: the engines run with `miss_stance = "fail_on_recompile"`,
under which a call that misses the compiled graphs raises instead of running eagerly."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from serve_app.config import AppConfig, ModelConfig
from serve_app.engine import CallParams, DiffusionEngine, ModelLoadError, Row
from serve_app.tools.lora import make_adapter
from tests.conftest import ADAPTER_DIR, SESSION_DIR, app_args, deploy

pytestmark = pytest.mark.slow  # compiling on two cores: about a minute per model
SIZE = 32
CACHE = SESSION_DIR / "compiled"
FAST = {"speed": "max", "compile_cache": str(CACHE)}


def engine(source: str, fast: bool, **model) -> DiffusionEngine:
    cfg = dict(source=source, device="cpu", default_height=SIZE, default_width=SIZE, warmup_steps=1)
    if fast:
        cfg.update(optimizations=FAST, warmup_batches=[1, 2])
    e = DiffusionEngine(ModelConfig(**{**cfg, "warmup": fast, **model}))
    if fast:
        e.fast.miss_stance = "fail_on_recompile"  # a missed graph raises: none is compiled again
    return e


@pytest.fixture(scope="module")
def sd():
    pair = engine("builtin:tiny-sd", True), engine("builtin:tiny-sd", False)
    yield pair
    for e in pair:
        e.close()


def images(e: DiffusionEngine, n: int, size: int = SIZE, **params) -> list[np.ndarray]:
    rows = [Row(f"a red circle number {i}", None, 10 + i) for i in range(n)]
    p = CallParams(height=size, width=size, steps=params.pop("steps", 3), **{"guidance_scale": 5.0, **params})
    return [np.asarray(im, dtype=np.float64) for im in e.run(rows, p).images]


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a - b) ** 2).mean())
    return 99.0 if mse == 0 else 10 * np.log10(255**2 / mse)


def calls(e: DiffusionEngine) -> tuple[int, int]:
    return e.fast.compiled_calls, e.fast.eager_calls


def same_images(fast: DiffusionEngine, eager: DiffusionEngine, n: int, **params) -> list[float]:
    out = [psnr(a, b) for a, b in zip(images(fast, n, **params), images(eager, n, **params), strict=True)]
    assert min(out) >= 35, out
    return out


def test_a_unet_serves_compiled_images_within_35_db_of_eager(sd):
    fast, eager = sd
    status = fast.describe()["fast_path"]
    assert status["warmed_shapes"] == [{"width": SIZE, "height": SIZE, "batch": b} for b in (1, 2)]
    assert status["rows"] == {"denoiser": [2, 4], "vae_decoder": [1, 2]}  # guidance doubles the rows
    before = calls(fast)
    same_images(fast, eager, 1)
    same_images(fast, eager, 2)
    compiled, uncompiled = calls(fast)
    assert compiled - before[0] == 2 * (3 + 1) and uncompiled == before[1]  # 3 steps and a decode each


def test_a_call_is_padded_up_to_the_next_warmed_batch(sd):
    fast, eager = sd
    before = calls(fast)
    # Without guidance one image is one row: 3 rows run in the 4-row graph of 2 guided images,
    # and one decode of 3 images is more than any warmed: it alone runs uncompiled.
    same_images(fast, eager, 3, guidance_scale=1.0)
    assert calls(fast) == (before[0] + 3, before[1] + 1)


def test_a_size_that_was_not_warmed_is_served_uncompiled(sd):
    fast, eager = sd
    before = calls(fast)
    same_images(fast, eager, 1, size=48)
    assert calls(fast) == (before[0], before[1] + 4)


def test_a_step_cache_runs_uncompiled_and_leaves_the_graphs_fitting(sd):
    fast, eager = sd
    assert "fast" in fast.describe()["accelerations"]
    before = calls(fast)
    same_images(fast, eager, 1, acceleration="fast", steps=6)
    assert calls(fast) == (before[0], before[1] + 7)
    same_images(fast, eager, 1)  # its hooks gone, the compiled graphs fit again (else: raises)
    assert calls(fast)[0] == before[0] + 4


@pytest.fixture(scope="module")
def adapters():
    paths = {}
    for i, name in enumerate(("fast-a", "fast-b", "fast-c", "fast-d")):
        paths[name] = str(make_adapter(str(ADAPTER_DIR / f"{name}.safetensors"), seed=70 + i, strength=2.0))
    return paths


def test_adapters_in_turn_cause_no_recompilation(adapters):
    import torch._dynamo.utils

    # Adapters loaded before the warm-up: loading before any shape is warmed compiles nothing.
    fast = engine("builtin:tiny-sd", True, warmup=False, warmup_batches=[1])
    eager = engine("builtin:tiny-sd", False)
    try:
        for name in ("fast-a", "fast-b", "fast-c"):
            fast.load_lora(name, adapters[name])
            eager.load_lora(name, adapters[name])
        assert fast.fast.warmed_shapes == []
        fast.warmup()
        graphs = dict(torch._dynamo.utils.counters["stats"])
        before = calls(fast)
        base = images(eager, 1)[0]
        sets = (
            (("fast-a", 1.0),),
            (("fast-b", 0.7),),
            (("fast-c", 1.0),),
            (),
            (("fast-a", 1.0), ("fast-c", 0.5)),
        )
        for loras in sets:
            [mine], [theirs] = images(fast, 1, loras=loras), images(eager, 1, loras=loras)
            # Like the eager engine's image with the same adapters, and unlike the base model's.
            assert psnr(mine, theirs) >= 30 and (not loras or psnr(mine, theirs) > psnr(mine, base) + 6), (
                loras
            )
        assert calls(fast) == (before[0] + 5 * 4, before[1])
        assert dict(torch._dynamo.utils.counters["stats"]) == graphs  # no graph compiled meanwhile

        # Rows with different adapters share a call through hooks: uncompiled, then compiled again.
        rows = [
            Row("a", None, 1, adapters=(("fast-a", 1.0),)),
            Row("b", None, 2, adapters=(("fast-b", 1.0),)),
        ]
        p = CallParams(height=SIZE, width=SIZE, steps=3, guidance_scale=5.0)
        mixed = [np.asarray(i, np.float64) for i in fast.run(rows, p).images]
        reference = [np.asarray(i, np.float64) for i in eager.run(rows, p).images]
        assert min(psnr(a, b) for a, b in zip(mixed, reference, strict=True)) >= 30
        assert calls(fast)[1] == before[1] + 4
        images(fast, 1, loras=(("fast-b", 1.0),))

        # A fourth adapter changes the layers: the next call compiles the warmed shape again first.
        fast.load_lora("fast-d", adapters["fast-d"])
        eager.load_lora("fast-d", adapters["fast-d"])
        assert fast.fast.stale and dict(torch._dynamo.utils.counters["stats"]) == graphs
        loras = (("fast-d", 1.0),)
        assert psnr(images(fast, 1, loras=loras)[0], images(eager, 1, loras=loras)[0]) >= 30
        assert dict(torch._dynamo.utils.counters["stats"]) != graphs and not fast.fast.stale
        fast.unload_lora("fast-a")
        images(fast, 1, loras=(("fast-b", 1.0),))  # compiled again without it (else: raises)
    finally:
        fast.close()
        eager.close()


def test_a_transformer_twin_compiles_its_repeated_blocks():
    import fsspec

    # Its compile cache at a URL: torch's cache artifacts in one file, written after the warm-up.
    url = "memory://compiled/flux"
    fast = engine("builtin:tiny-flux", True, optimizations={"speed": "max", "compile_cache": url})
    eager = engine("builtin:tiny-flux", False)
    try:
        status = fast.describe()["fast_path"]
        assert status["rows"] == {"denoiser": [1, 2], "vae_decoder": [1, 2]}
        assert status["compile_cache"] == "saved"
        [kept] = fsspec.filesystem("memory").ls("/compiled/flux", detail=False)
        assert fsspec.filesystem("memory").size(kept) > 10_000
        fast.fast.load_cache(fast.fast.cache_url)  # what a replica that starts later does first
        assert fast.fast.cache == "hit"
        assert all(b._compiled_call_impl is not None for b in fast.pipe.transformer.transformer_blocks)
        before = calls(fast)
        same_images(fast, eager, 1)
        same_images(fast, eager, 2)
        assert calls(fast) == (before[0] + 2 * 4, before[1])
    finally:
        fast.close()
        eager.close()


CHILD = """
import json, sys, torch._dynamo.utils
from serve_app.config import ModelConfig
from serve_app.engine import DiffusionEngine
e = DiffusionEngine(ModelConfig(source="builtin:tiny-sd", device="cpu", default_height=32, default_width=32,
                                warmup_steps=1, warmup_batches=[1], optimizations=json.loads(sys.argv[1])))
counts = dict(torch._dynamo.utils.counters["inductor"])
print(json.dumps({"status": e.describe()["fast_path"], "inductor": counts}))
"""


def test_a_new_process_reads_the_compiled_kernels_from_the_cache(tmp_path):
    """Two new machines' processes, one after the other, each with an empty inductor cache of its
    own and the same compile cache: the first compiles and fills it, the second compiles nothing.
    (Processes of their own: a test process's global settings, torchao's among them, enter the
    kernels' cache keys.)"""
    optimizations = json.dumps({"speed": "max", "compile_cache": str(tmp_path / "shared")})

    def start(name: str) -> dict:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / name)}
        run = subprocess.run([sys.executable, "-c", CHILD, optimizations], env=env, capture_output=True,
                             text=True, timeout=600, cwd=os.getcwd())  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        return json.loads(run.stdout.strip().splitlines()[-1])

    first, second = start("first"), start("second")
    assert (
        first["status"]["compile_cache"] == "empty directory" and first["inductor"]["fxgraph_cache_miss"] >= 2
    )
    assert second["status"]["compile_cache"] == "directory"
    assert second["inductor"].get("fxgraph_cache_hit", 0) >= 2, second["inductor"]
    assert second["inductor"].get("fxgraph_cache_miss", 0) == 0, second["inductor"]  # nothing compiled


@pytest.mark.parametrize(
    ("model", "field"),
    [
        (
            {"optimizations": {"speed": "max", "cpu_offload": "model"}, "device": "cuda"},
            "optimizations.cpu_offload",
        ),
        ({"optimizations": {"speed": "max", "compile_denoiser": True}}, "optimizations.compile_denoiser"),
        ({"optimizations": {"speed": "max"}, "parallel": {"cfg": 2}}, "model.parallel"),
        ({"optimizations": {"speed": "max"}, "warmup": False}, "model.warmup"),
        ({"optimizations": {"compile_cache": "/tmp/x"}}, "compile_cache"),
        ({"optimizations": {"speed": "max", "step_cache": "fast"}}, "optimizations.step_cache"),
        ({"warmup_batches": [1, 2]}, "model.warmup_batches"),
        ({"optimizations": {"speed": "max", "compile_cache": "relative/dir"}}, "compile_cache"),
        ({"warmup_sizes": ["64x60"]}, "warmup_sizes"),
        ({"warmup_batches": [0]}, "warmup_batches"),
    ],
)
def test_what_cannot_combine_is_refused_naming_the_field(model, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        AppConfig.from_args({"model": model})


def test_a_pool_is_refused_on_the_fast_path():
    with pytest.raises(ValueError, match="multiplex: not with optimizations.speed: max"):
        AppConfig.from_args(
            {"model": {"optimizations": {"speed": "max"}}, "multiplex": {"max_models_per_replica": 2}}
        )


def test_float8_activations_are_refused_on_a_cpu():
    with pytest.raises(ModelLoadError, match="quantize.*compute capability 8.9"):
        DiffusionEngine(ModelConfig(device="cpu", warmup=False, optimizations={"quantize": "float8_dynamic"}))


# ---------------------------------------------------------------------- over HTTP

APP = "fastpath"


@pytest.fixture(scope="module")
def served(ray_cluster):
    from ray import serve

    args = app_args(
        model={"optimizations": FAST, "warmup_batches": [1, 2], "default_steps": 3},
        batching={"max_batch_images": 2, "step_joining": True},
        replica={"init_timeout_s": 900},
        jobs={"store": str(SESSION_DIR / "fast-store")},  # its own: the shared app runs none of its jobs
    )
    deploy(APP, args)
    yield f"/{APP}"
    serve.delete(APP, _blocking=False)


def fast_status(client) -> dict:
    [replica] = client.get(f"/{APP}/v1/status").json()["models"][0]["replicas"]
    return replica["fast_path"]


def test_an_application_on_the_fast_path_through_the_official_client(served, client, base_url, sd):
    from openai import OpenAI

    status = fast_status(client)
    assert status["warmed_shapes"] == [{"width": SIZE, "height": SIZE, "batch": b} for b in (1, 2)]
    assert status["compile_cache"] == "directory"  # the in-process engines filled it
    calls_before = (status["compiled_calls"], status["eager_calls"])
    oai = OpenAI(base_url=f"{base_url}/{APP}/v1", api_key="unused", max_retries=0)
    body = {"seed": 10, "guidance_scale": 5.0}
    made = oai.images.generate(model="tiny-sd", prompt="a red circle", size="32x32",
                               response_format="b64_json", extra_body=body)  # fmt: skip
    served_image = np.asarray(
        Image.open(io.BytesIO(base64.b64decode(made.data[0].b64_json))).convert("RGB"), float
    )
    call = CallParams(height=SIZE, width=SIZE, steps=3, guidance_scale=5.0)
    reference = sd[1].run([Row("a red circle", None, 10)], call).images[0]
    assert psnr(served_image, np.asarray(reference, np.float64)) >= 35
    # The first request ran compiled: the shapes were compiled before the replica took traffic.
    status = fast_status(client)
    assert status["compiled_calls"] > calls_before[0] and status["eager_calls"] == 0

    # Served too: a size never warmed (uncompiled), a step cache (`quality: low`), previews.
    odd = oai.images.generate(model="tiny-sd", prompt="a red circle", size="48x48")
    assert Image.open(io.BytesIO(base64.b64decode(odd.data[0].b64_json))).size == (48, 48)
    low = oai.images.generate(model="tiny-sd", prompt="a red circle", size="32x32", quality="low")
    assert low.quality == "low"
    events = list(oai.images.generate(model="tiny-sd", prompt="a red circle", size="32x32", stream=True,
                                      partial_images=2))  # fmt: skip
    assert [e.type for e in events].count("image_generation.partial_image") == 2
    status = fast_status(client)
    assert status["eager_calls"] > 0


def test_a_burst_joins_one_compiled_run(served, client):
    """Two requests at once share a joined run (step joining is on in this app): its denoiser
    calls hold both requests' rows, at their own timesteps, and run compiled."""
    before = fast_status(client)
    for _ in range(3):
        _burst(client)
    after = fast_status(client)
    assert (
        after["compiled_calls"] > before["compiled_calls"] and after["eager_calls"] == before["eager_calls"]
    )


def _burst(client) -> None:
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        bodies = [{"prompt": f"a cat {i}", "size": "32x32", "seed": i} for i in range(2)]
        answers = list(pool.map(lambda b: client.post(f"/{APP}/v1/images/generations", json=b), bodies))
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    assert {
        (a.json()["metrics"]["batch_requests"], a.json()["metrics"]["batch_images"]) for a in answers
    } == {(2, 2)}


def test_a_job_runs_compiled_and_an_abort_stops_one_at_a_step(served, client):
    from serve_app.testing import SLOW_MARKER
    from tests.conftest import wait_for
    from tests.test_jobs import finished, submit

    before = fast_status(client)
    job = submit(client, {"prompt": "a boat", "seed": 3, "size": "32x32"}, prefix=served).json()
    assert finished(client, job["id"], prefix=served)["state"] == "done"
    after = fast_status(client)
    assert (
        after["compiled_calls"] > before["compiled_calls"] and after["eager_calls"] == before["eager_calls"]
    )
    body = {"prompt": f"long {SLOW_MARKER}", "num_inference_steps": 50, "size": "32x32"}
    slow = submit(client, body, prefix=served).json()
    wait_for(lambda: client.get(f"{served}/v1/jobs/{slow['id']}").json()["step"] >= 2, 60)
    r = client.delete(f"{served}/v1/jobs/{slow['id']}")
    assert r.status_code == 200 and r.json()["state"] == "aborted", r.text
    got = client.get(f"{served}/v1/jobs/{slow['id']}").json()
    assert got["state"] == "aborted" and got["step"] < 50
    assert fast_status(client)["eager_calls"] == before["eager_calls"]  # it ran compiled until stopped
