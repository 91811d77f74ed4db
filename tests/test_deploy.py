"""Building and deploying: config validation at build time, model load failures, presets."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from serve_app.app import build_app
from serve_app.config import AppConfig
from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parent.parent
CONFIG_FILES = [ROOT / "serve_config.yaml", *sorted((ROOT / "configs").glob("*.yaml"))]


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_every_shipped_config_builds(path):
    cfg = yaml.safe_load(path.read_text())
    (app_cfg,) = cfg["applications"]
    assert app_cfg["import_path"] == "serve_app.app:build_app"
    parsed = AppConfig.from_args(app_cfg["args"])
    build_app(app_cfg["args"])
    if path.name == "local-demo.yaml":
        assert parsed.model.source == "builtin:shapes" and parsed.auth.local_admin
    elif path.name == "multi-model-demo.yaml":
        served = parsed.served()
        assert [s.model.source for s in served] == ["builtin:shapes", "builtin:tiny-sdxl"]
        assert served[1].multiplex is not None and served[1].batching.max_batch_images == 4
        assert all(s.replica.num_gpus == 0 and s.model.device == "cpu" for s in served)
        assert parsed.auth.local_admin
    elif path.parent.name == "configs":
        assert parsed.replica.num_gpus == 1 and parsed.model.device == "cuda"
    else:
        assert parsed.model.source == "builtin:shapes" and parsed.replica.num_gpus == 0
    # Anonymous administration only ever on a host bound to loopback.
    if parsed.auth.local_admin:
        assert cfg["http_options"]["host"] in ("127.0.0.1", "::1", "localhost"), path.name
    else:
        assert not parsed.auth.admin_keys and not parsed.auth.api_keys  # no key ships in a config


DEMOS = ("local-demo.yaml", "multi-model-demo.yaml")  # CPU demos of the embedded models


def test_presets_cover_the_model_families():
    sources = {AppConfig.from_args(yaml.safe_load(p.read_text())["applications"][0]["args"]).model.source
               for p in CONFIG_FILES[1:] if p.name not in DEMOS}  # fmt: skip
    for family in (
        "stable-diffusion-v1-5",
        "stable-diffusion-xl",
        "stable-diffusion-3",
        "FLUX",
        "Wan",
        "Qwen-Image",
        "Qwen-Image-Edit",
        "Z-Image",
        "FLUX.2-klein",
        "FLUX.2-dev",
        "Wan2.2-I2V",
        "LTX-Video",
        "HunyuanVideo-1.5",
        "builtin:sd15-arch",
        "builtin:sdxl-arch",
        "builtin:flux-arch",
    ):
        assert any(family in s for s in sources), family


# Which family a GPU config's model belongs to, by its source.
_FAMILY_OF_SOURCE = [("stable-diffusion-v1-5", "sd"), ("sd15-arch", "sd"), ("stable-diffusion-xl", "sdxl"),
                     ("sdxl-arch", "sdxl"), ("stable-diffusion-3", "sd3"), ("FLUX.2", "flux2"),
                     ("FLUX", "flux"), ("flux-arch", "flux"), ("Wan", "wan"), ("Qwen-Image", "qwen-image"),
                     ("Z-Image", "z-image"), ("LTX", "ltx"),
                     ("HunyuanVideo-1.5", "hunyuan-video")]  # fmt: skip


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_each_config_names_the_twin_ci_runs_for_its_family(path):
    from serve_app.engine.builtin import build_builtin
    from serve_app.engine.engine import find_denoiser
    from serve_app.engine.families import describe_pipeline
    from tests.test_families import TWINS
    from tests.test_new_families import MODELS

    NEW_TWINS = list(MODELS.values())

    text = path.read_text()
    served = AppConfig.from_args(yaml.safe_load(text)["applications"][0]["args"]).served()
    source = served[0].model.source
    if all(s.model.source.startswith("builtin:") and "arch" not in s.model.source for s in served):
        return  # embedded models CI runs themselves
    twin = re.search(r"^# CI twin: builtin:([\w-]+)", text, re.M)
    assert twin, f"{path.name} does not name its CI twin"
    assert twin.group(1) in [*TWINS, "tiny-sd", *NEW_TWINS]
    family = next(f for key, f in _FAMILY_OF_SOURCE if key in source)
    pipe = build_builtin(twin.group(1))
    assert describe_pipeline(pipe, find_denoiser(pipe)).name == family


@pytest.mark.parametrize(
    "args, message",
    [
        ({"model": {"source": "builtin:nope"}}, "unknown builtin model 'builtin:nope'"),
        ({"model": {"dtype": "fp8"}}, "model.dtype"),
        ({"model": {"scheduler": "NotAScheduler"}}, "model.scheduler: 'NotAScheduler' is not a diffusers"),
        ({"model": {"engine_extension": "no colon"}}, "model.engine_extension"),
        ({"model": {"engine_extension": "serve_app.nope:X"}}, "cannot import"),
        ({"model": {"device": "cpu", "dtype": "float16"}}, "float16 is not supported on CPU"),
        ({"model": {"default_steps": 500}}, "exceeds limits.max_steps"),
        ({"limits": {"max_steps": 0}}, "limits.max_steps"),
        ({"replica": {"num_replicas": 0}}, "replica.num_replicas"),
        ({"replica": {"typo": 1}}, "replica.typo"),
        ({"model": {"parallel": {"cfg": 4}}}, "model.parallel.cfg"),
        ({"model": {"parallel": {"ulysses": 16}}}, "model.parallel.ulysses"),
        (
            {"model": {"device": "cpu", "parallel": {"ring": 2}}},
            "model.parallel.ring: ring attention needs an",
        ),
        (
            {"model": {"device": "cuda", "parallel": {"ring": 2}}},
            "model.parallel.ring: needs model.optimizations",
        ),
        ({"model": {"parallel": {"ulysses": 4, "ring": 4}}}, "model.parallel: 16 ranks; at most 8"),
        (
            {"model": {"device": "cuda", "parallel": {"cfg": 2}, "optimizations": {"cpu_offload": "model"}}},
            "model.parallel: not with optimizations.cpu_offload",
        ),
        (
            {"model": {"parallel": {"cfg": 2}}, "multiplex": {}},
            "model.parallel: a pool (multiplex) runs on one rank",
        ),
    ],
)
def test_bad_config_fails_at_build_time(args, message):
    with pytest.raises((ValidationError, ValueError)) as info:
        build_app(args)
    assert message in str(info.value)


@pytest.mark.slow
def test_a_model_that_cannot_load_and_a_start_past_its_deadline_fail_fast_with_their_reasons(ray_cluster):
    """Two broken apps at once (each failed start costs a replica process about 10 s): one names
    a model that is not there, one warms up for longer than its `init_timeout_s`."""
    from ray import serve
    from ray.serve.api import RunTarget

    missing = {
        "model": {"source": "/nonexistent/diffusers-model", "device": "cpu"},
        "replica": {"num_cpus": 0, "max_constructor_retry_count": 1},
        "ingress": {"num_cpus": 0},
    }
    late = {
        "model": {"source": "builtin:tiny-sd", "device": "cpu", "default_height": 128, "default_width": 128,
                  "warmup_steps": 30},
        "replica": {"num_cpus": 0, "max_constructor_retry_count": 1, "init_timeout_s": 0.5},
        "ingress": {"num_cpus": 0},
    }  # fmt: skip
    t = time.perf_counter()
    serve.run_many(  # not waited for: its replica starts while the other's does
        [RunTarget(build_app(late), name="late", route_prefix="/late")],
        wait_for_ingress_deployment_creation=False,
        wait_for_applications_running=False,
    )
    try:
        with pytest.raises(RuntimeError) as info:
            serve.run(build_app(missing), name="broken", route_prefix="/broken")
        elapsed = time.perf_counter() - t
        assert "broken" in str(info.value)
        status = serve.status().applications["broken"]
        assert status.status == "DEPLOY_FAILED"
        assert "is not a directory" in status.deployments["DiffusionReplica"].message
        assert elapsed < 60, f"took {elapsed:.0f}s to fail"
        late_status = wait_for(
            lambda: (a := serve.status().applications["late"]).status == "DEPLOY_FAILED" and a, 60
        )
        message = late_status.deployments["DiffusionReplica"].message
        assert "'builtin:tiny-sd'" in message and "replica.init_timeout_s=0.5s" in message, message
    finally:
        serve.delete("broken", _blocking=False)
        serve.delete("late", _blocking=False)


@pytest.mark.slow
def test_the_import_rules_hold_in_fresh_interpreters():
    """docs/architecture.md's rules, each module imported alone: the engine without Ray or the
    wire schema, the ingress and the wire schema without the engine or torch, weight files
    without the engine, the proxy guard and the console client light, and the app's build (what
    `serve run` and `serve deploy`'s build task import) without diffusers, which the replica
    imports when it loads its pipeline (about 6 s saved on every build)."""
    import subprocess
    import sys

    forbidden = {
        "serve_app.engine": ["ray", "serve_app.schemas"],
        "serve_app.ingress.deployment": ["serve_app.engine", "torch", "diffusers"],
        "serve_app.schemas": ["serve_app.engine", "torch", "ray"],
        "serve_app.app": ["diffusers", "transformers", "peft"],
        # weight files: the ingress checks them without torch, the engine loads them without Ray
        "serve_app.formats.lora": ["torch", "serve_app.engine", "ray"],
        "serve_app.formats.sources": ["torch", "serve_app.engine", "ray"],
        "serve_app.formats.single_file_load": ["serve_app.engine", "ray", "diffusers"],
        # every Serve proxy imports the guard when it starts; the console client is stdlib only
        "serve_app.proxy": ["fastapi", "pydantic", "torch"],
        "serve_app.tools.cli": ["serve_app.errors", "pydantic", "torch", "ray"],
    }
    procs = {
        module: subprocess.Popen(
            [sys.executable, "-c", f"import sys, {module}; print(*sorted(sys.modules), sep='\\n')"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )  # fmt: skip
        for module in forbidden
    }
    for module, proc in procs.items():
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, module
        loaded = set(out.split())
        assert module in loaded
        assert not loaded.intersection(forbidden[module]), (module, loaded.intersection(forbidden[module]))
