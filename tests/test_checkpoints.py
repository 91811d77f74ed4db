"""Checkpoints served by name: the checks on a source, families, the registry, and which
checkpoints a replica holds (one load per checkpoint, LRU, pins, shared components). No Ray."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from serve_app.config import ModelConfig
from serve_app.engine import CallParams, DiffusionEngine, Row
from serve_app.engine.builtin import build_builtin
from serve_app.errors import InvalidRequest, NotFound
from serve_app.formats import sources
from serve_app.formats.layouts import family_of
from serve_app.formats.sources import check_checkpoint_source
from serve_app.registries import CheckpointRegistry, check_checkpoint_name
from serve_app.replica.checkpoints import CheckpointResidency, _file_digest, component_fingerprints
from serve_app.tools.cli import checkpoint_lines, parser

SMALL = CallParams(height=32, width=32, steps=2, guidance_scale=7.5)


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> Path:
    """A root with two tiny-sd checkpoints, `a` and `b`: b's unet has other weights, its
    text encoder, tokenizer and VAE are a's very files."""
    root = tmp_path_factory.mktemp("ckpt-root")
    for name, seed in (("a", 0), ("b", 1)):
        pipe = build_builtin("tiny-sd", device=torch.device("cpu"), seed=seed)
        pipe.save_pretrained(root / name, safe_serialization=True)
    for part in ("text_encoder", "tokenizer", "vae"):
        shutil.rmtree(root / "b" / part)
        shutil.copytree(root / "a" / part, root / "b" / part)
    return root


def fake_pipeline(path: Path, class_name: str | None = "StableDiffusionPipeline") -> Path:
    """A directory that passes for a pipeline (the checks read no weights)."""
    (path / "unet").mkdir(parents=True)
    index = {"_class_name": class_name} if class_name else {"unet": ["diffusers", "UNet2DConditionModel"]}
    (path / "model_index.json").write_text(json.dumps(index))
    (path / "unet" / "diffusion_pytorch_model.safetensors").write_bytes(b"\0" * 8)
    return path


# ---------------------------------------------------------------- names and sources


def test_checkpoint_names():
    for good in ("anime", "sd-1.5_ft", "A" * 128):
        check_checkpoint_name(good)
    for bad in ("", "org/name", "a b", "A" * 129, "../x", "ü"):
        with pytest.raises(InvalidRequest) as e:
            check_checkpoint_name(bad)
        assert e.value.param == "name"


def test_a_pipeline_directory_under_a_root_is_taken(real, monkeypatch):
    resolved, cls = check_checkpoint_source(str(real / "a"), [str(real)], allow_hub=False)
    assert (resolved, cls) == (str((real / "a").resolve()), "StableDiffusionPipeline")
    monkeypatch.chdir(real)  # relative to the working directory
    assert check_checkpoint_source("b", [str(real)], allow_hub=False)[0] == str((real / "b").resolve())
    assert check_checkpoint_source("./b/", [str(real)], allow_hub=False)[0] == str((real / "b").resolve())


def test_a_hub_id_only_where_the_hub_is_allowed(tmp_path):
    assert check_checkpoint_source("org/some-model.v2", [str(tmp_path)], allow_hub=True) == (
        "org/some-model.v2",
        "",
    )
    for bad in ("org/a--b", "org/x.git", "-org/x", "a/b/c", "org/..x", "name only"):
        with pytest.raises(InvalidRequest) as e:
            check_checkpoint_source(bad, [str(tmp_path)], allow_hub=True)
        assert e.value.param == "source", bad


def _refusal(source: str, roots: list[str], tmp_path: Path, allow_hub: bool = False) -> str:
    with pytest.raises(InvalidRequest) as e:
        check_checkpoint_source(source, roots, allow_hub)
    assert e.value.param == "source"
    assert str(tmp_path) not in e.value.message and str(tmp_path.resolve()) not in e.value.message
    return e.value.message


def test_every_refusal_is_a_400_on_source_without_the_server_path(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    fake_pipeline(outside / "ck")
    roots = [str(root)]
    outside_roots = "source: the path resolves outside the checkpoint roots"
    assert _refusal(str(outside / "ck"), roots, tmp_path) == outside_roots
    (root / "escape").symlink_to(outside / "ck")
    assert _refusal(str(root / "escape"), roots, tmp_path) == outside_roots
    assert _refusal(str(root / ".." / "outside" / "ck"), roots, tmp_path) == outside_roots
    (root / "file.safetensors").write_bytes(b"x")
    assert "is not a safetensors file" in _refusal(str(root / "file.safetensors"), roots, tmp_path)
    assert "no checkpoint at 'missing'" in _refusal(str(root / "missing"), roots, tmp_path)
    (root / "plain" / "unet").mkdir(parents=True)
    assert "no model_index.json" in _refusal(str(root / "plain"), roots, tmp_path)
    fake_pipeline(root / "nameless", class_name=None)
    assert "no _class_name" in _refusal(str(root / "nameless"), roots, tmp_path)
    (fake_pipeline(root / "blank") / "model_index.json").write_text('{"_class_name": ""}')
    assert "no _class_name" in _refusal(str(root / "blank"), roots, tmp_path)
    (fake_pipeline(root / "broken") / "model_index.json").write_text("{")
    assert "not valid JSON" in _refusal(str(root / "broken"), roots, tmp_path)
    (fake_pipeline(root / "pickled") / "unet" / "diffusion_pytorch_model.bin").write_bytes(b"x")
    msg = _refusal(str(root / "pickled"), roots, tmp_path)
    assert "pickle file 'unet/diffusion_pytorch_model.bin'" in msg and "only safetensors" in msg
    (root / "stash").mkdir()
    (root / "stash" / "w.pt").write_bytes(b"x")
    (fake_pipeline(root / "hidden") / "unet" / "weights").symlink_to(root / "stash" / "w.pt")
    assert "pickle file 'unet/weights'" in _refusal(str(root / "hidden"), roots, tmp_path)
    (outside / "w.safetensors").write_bytes(b"x")
    (fake_pipeline(root / "link-out") / "unet" / "w.safetensors").symlink_to(outside / "w.safetensors")
    assert "'unet/w.safetensors' in 'link-out' resolves outside" in _refusal(
        str(root / "link-out"), roots, tmp_path
    )
    empty = fake_pipeline(root / "empty")
    (empty / "unet" / "diffusion_pytorch_model.safetensors").unlink()
    assert "no .safetensors weights" in _refusal(str(empty), roots, tmp_path)
    assert "hub checkpoints are not allowed" in _refusal("org/model", roots, tmp_path)
    fake_pipeline(root / "fine")
    assert "no checkpoint roots are configured" in _refusal(str(root / "fine"), [], tmp_path)
    check_checkpoint_source(str(root / "fine"), roots, allow_hub=False)  # the same, inside: taken


def test_the_walk_is_bounded(tmp_path, monkeypatch):
    big = fake_pipeline(tmp_path / "big")
    for i in range(20):
        (big / "unet" / f"part{i}.safetensors").write_bytes(b"x")
    check_checkpoint_source(str(big), [str(tmp_path)], allow_hub=False)
    monkeypatch.setattr(sources, "MAX_WALK_ENTRIES", 10)
    assert "more than 10 files" in _refusal(str(big), [str(tmp_path)], tmp_path)


def test_family_of_names_the_families_of_engine_families():
    from serve_app.engine.families import _LABELS

    for cls, label in _LABELS.items():
        assert family_of(cls) == label, cls
    assert family_of("StableDiffusionXLImg2ImgPipeline") == "sdxl"
    assert family_of("StableDiffusion3Img2ImgPipeline") == "sd3"
    assert family_of("StableDiffusionImg2ImgPipeline") == "sd"
    assert family_of("FluxFillPipeline") == "flux" and family_of("WanImageToVideoPipeline") == "wan"
    for unknown in ("KandinskyPipeline", "StableDiffusionUpscalePipeline", "", "FluxTransformer2DModel"):
        assert family_of(unknown) is None, unknown


# ---------------------------------------------------------------- the registry


def test_registry_persists_and_refuses(tmp_path):
    path = str(tmp_path / "state" / "checkpoints.json")
    reg = CheckpointRegistry(path)
    assert reg.all() == {}
    entry = reg.add("anime", "/models/anime", "sd15", "sd")
    assert entry == {"source": "/models/anime", "pool": "sd15", "family": "sd", "pinned": False}
    reg.add("photo", "org/photo", "sd15", None)
    reg.add("big", "/models/big", "sdxl", "sdxl")
    with pytest.raises(InvalidRequest) as e:
        reg.add("anime", "/elsewhere", "sd15", "sd")
    assert e.value.param == "name"
    again = CheckpointRegistry(path)  # another replica, or after a restart
    assert again.get("photo")["source"] == "org/photo" and set(again.all()) == {"anime", "photo", "big"}
    with pytest.raises(NotFound) as e:
        again.get("nope")
    assert e.value.param == "model"
    assert again.pin("anime", True, max_pinned=1)["pinned"]
    assert reg.get("anime")["pinned"]
    with pytest.raises(InvalidRequest) as e:
        reg.pin("photo", True, max_pinned=1)
    assert e.value.param == "pinned"
    assert reg.pin("big", True, max_pinned=1)["pinned"]  # another pool: its own pins
    assert reg.pin("anime", True, max_pinned=1)["pinned"]  # pinned again: still one
    reg.pin("anime", False, max_pinned=1)
    assert reg.pin("photo", True, max_pinned=1)["pinned"]
    assert reg.remove("photo")["source"] == "org/photo"
    with pytest.raises(NotFound) as e:
        reg.remove("photo")
    assert e.value.param == "name"
    with pytest.raises(NotFound):
        reg.pin("photo", True, max_pinned=5)
    assert set(CheckpointRegistry(path).all()) == {"anime", "big"}


# ---------------------------------------------------------------- residency, with a fake loader


class FakeLoader:
    def __init__(self, delay: float = 0.05, fail: set[str] | None = None):
        self.delay, self.fail, self.calls, self.threads = delay, fail or set(), [], set()

    def __call__(self, name: str, source: str, reuse: dict):
        self.calls.append(name)
        self.threads.add(threading.current_thread().name)
        time.sleep(self.delay)
        if name in self.fail:
            self.fail.discard(name)  # fails once
            raise RuntimeError(f"cannot load {name}")
        return object()


def test_concurrent_callers_share_one_load_on_the_loader_thread():
    load, changes = FakeLoader(), []
    res = CheckpointResidency(load, max_held=2, on_change=changes.append)

    async def main():
        return await asyncio.gather(*(res.engine("a", "/a") for _ in range(5)))

    engines = asyncio.run(main())
    assert load.calls == ["a"] and res.loads == 1
    assert all(e is engines[0] for e in engines)
    assert load.threads == {"checkpoint-loader_0"}
    assert asyncio.run(res.engine("a", "/a")) is engines[0] and res.loads == 1
    assert res.held == ["a"] and changes == [["a"]]


def test_lru_eviction_at_max_held_and_pins_are_kept():
    load, changes = FakeLoader(delay=0), []
    res = CheckpointResidency(load, max_held=2, on_change=changes.append)

    async def main():
        await res.pin("p", "/p")
        a = await res.engine("a", "/a")
        await res.engine("b", "/b")  # over max_held: a, the least recently used unpinned, goes
        assert res.held == ["p", "b"] and res.evictions == 1
        await res.engine("c", "/c")  # p is older than b, but pinned
        assert res.held == ["p", "c"] and res.pinned == ["p"]
        assert await res.engine("a", "/a") is not a  # evicted: loaded again
        assert load.calls == ["p", "a", "b", "c", "a"]
        res.unpin("p")
        assert res.held == ["p", "a"]
        await res.engine("p", "/p")  # used: now a is the oldest
        await res.engine("d", "/d")
        assert res.held == ["p", "d"]
        assert res.drop("d") and not res.drop("d") and res.held == ["p"]

    asyncio.run(main())
    assert changes[-1] == ["p"]


def test_pins_are_bounded_by_max_held():
    res = CheckpointResidency(FakeLoader(delay=0), max_held=1)
    asyncio.run(res.pin("a", "/a"))
    with pytest.raises(InvalidRequest) as e:
        asyncio.run(res.pin("b", "/b"))
    assert e.value.param == "pinned" and res.held == ["a"]


def test_a_failed_load_reaches_every_waiter_and_is_tried_again():
    load = FakeLoader(fail={"a"})
    res = CheckpointResidency(load, max_held=2)

    async def main():
        return await asyncio.gather(*(res.engine("a", "/a") for _ in range(3)), return_exceptions=True)

    errors = asyncio.run(main())
    assert all(isinstance(e, RuntimeError) and "cannot load a" in str(e) for e in errors)
    assert load.calls == ["a"] and res.held == [] and res.loads == 0
    assert asyncio.run(res.engine("a", "/a")) is not None
    assert load.calls == ["a", "a"] and res.held == ["a"]
    with pytest.raises(RuntimeError):  # a failed pin does not stay pinned
        load.fail.add("b")
        asyncio.run(res.pin("b", "/b"))
    assert res.pinned == []


def test_a_waiter_going_away_does_not_cancel_the_load_and_a_drop_during_it_holds_nothing():
    load = FakeLoader(delay=0.2)
    res = CheckpointResidency(load, max_held=2)

    async def main():
        impatient = asyncio.create_task(res.engine("a", "/a"))
        patient = asyncio.create_task(res.engine("a", "/a"))
        await asyncio.sleep(0.05)
        impatient.cancel()
        assert await patient is not None and res.held == ["a"]
        dropped = asyncio.create_task(res.engine("b", "/b"))
        await asyncio.sleep(0.05)
        res.drop("b")
        assert await dropped is not None and res.held == ["a"]  # the caller has it, nobody holds it

    asyncio.run(main())
    assert load.calls == ["a", "b"]


def test_a_new_source_under_a_held_name_is_loaded():
    load = FakeLoader(delay=0)
    res = CheckpointResidency(load, max_held=2)
    first = asyncio.run(res.engine("a", "/v1"))
    assert asyncio.run(res.engine("a", "/v2")) is not first and res.held == ["a"]
    assert load.calls == ["a", "a"]


# ---------------------------------------------------------------- shared components, real engines


def test_fingerprints_tell_shared_components_and_each_file_is_hashed_once(real):
    a = component_fingerprints(str(real / "a"))
    b = component_fingerprints(str(real / "b"))
    # The denoiser (each engine's own, and the largest files) and the scheduler are not hashed.
    assert set(a) == set(b) == {"text_encoder", "tokenizer", "vae"}
    assert {k for k in a if a[k] == b[k]} == {"text_encoder", "tokenizer", "vae"}
    hits, misses = _file_digest.cache_info().hits, _file_digest.cache_info().misses
    assert component_fingerprints(str(real / "a")) == a  # every file's digest from the cache
    files = sum(1 for p in (real / "a").rglob("*")
                if p.is_file() and p.parent.name in ("text_encoder", "tokenizer", "vae"))  # fmt: skip
    assert _file_digest.cache_info().hits - hits == files and _file_digest.cache_info().misses == misses
    assert component_fingerprints(str(real / "missing")) == {}


def test_two_finetunes_hold_their_text_encoder_and_vae_once_and_both_draw(real):
    def load(name, source, reuse):
        cfg = ModelConfig(source=source, name=name, device="cpu", dtype="float32", warmup=False)
        return DiffusionEngine(cfg, reuse=reuse)

    res = CheckpointResidency(load, max_held=2)

    async def main():
        return await res.engine("a", str(real / "a")), await res.engine("b", str(real / "b"))

    a, b = asyncio.run(main())
    assert b.pipe.text_encoder is a.pipe.text_encoder and b.pipe.vae is a.pipe.vae
    assert b.pipe.unet is not a.pipe.unet
    ua, ub = a.pipe.unet.state_dict(), b.pipe.unet.state_dict()
    assert not all(torch.equal(ua[k], ub[k]) for k in ua)
    assert res.shared_components == 2 and set(a.components()) == {"text_encoder", "vae"}
    for engine in (a, b):
        out = engine.run([Row("a red cat", None, 3)], SMALL)
        assert out.images[0].size == (32, 32)
    res.close()


# ---------------------------------------------------------------- the command line


def test_checkpoints_command_line():
    a = parser().parse_args(["checkpoints", "add", "anime", "./ck/anime", "--pool", "sd15", "--pin"])
    assert (a.cmd, a.checkpoints_cmd, a.name, a.source, a.pool, a.pin) == (
        "checkpoints", "add", "anime", "./ck/anime", "sd15", True,
    )  # fmt: skip
    a = parser().parse_args(["checkpoints", "pin", "anime", "--unpin"])
    assert (a.checkpoints_cmd, a.name, a.unpin) == ("pin", "anime", True)
    assert parser().parse_args(["checkpoints", "add", "x", "org/x"]).pool is None
    out = {
        "checkpoints": [
            {"name": "anime", "source": "anime", "pool": "sd15", "family": "sd", "pinned": True},
            {"name": "photo", "source": "org/photo", "pool": "sd15", "family": None, "pinned": False},
        ],
        "replicas": [
            {"replica_id": "r1", "model": "sd15", "held": ["anime", "photo"], "pinned": ["anime"]},
            {"replica_id": "r2", "model": "sd15", "held": ["anime"], "pinned": ["anime"]},
        ],
    }
    lines = checkpoint_lines(out)
    assert (
        "anime" in lines[0] and "pinned" in lines[0] and "held by r1, r2" in lines[0] and "sd15" in lines[0]
    )
    assert "photo" in lines[1] and "held by r1" in lines[1] and "pinned" not in lines[1]
    assert checkpoint_lines({"checkpoints": [], "replicas": []}) == ["no checkpoints registered"]
