"""Adapter file checks, the registry, and the adapter maker, without Ray."""

from __future__ import annotations

import os
import time

import pytest
from safetensors.torch import load_file

from serve_app.errors import Forbidden, InvalidRequest, NotFound
from serve_app.formats.lora import check_adapter_file
from serve_app.registries import Registry, check_name
from serve_app.tools.lora import make_adapter


def test_maker_is_deterministic_and_writes_diffusers_keys(tmp_path):
    a = load_file(str(make_adapter(str(tmp_path / "a.safetensors"), seed=1)))
    b = load_file(str(make_adapter(str(tmp_path / "b.safetensors"), seed=1)))
    c = load_file(str(make_adapter(str(tmp_path / "c.safetensors"), seed=2)))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    assert any((a[k] != c[k]).any() for k in a)
    assert all(k.startswith("unet.") and ".lora." in k for k in a)


def test_path_checks(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    good = make_adapter(str(root / "good.safetensors"), seed=1)
    assert check_adapter_file(str(good), [str(root)], 10) == good.resolve()
    assert check_adapter_file("good.safetensors", [str(root)], 10) == good.resolve()  # relative to the root
    outside = make_adapter(str(tmp_path / "outside.safetensors"), seed=1)
    (root / "link.safetensors").symlink_to(outside)
    (root / "weights.bin").write_bytes(b"\0" * 10)
    (root / "big.safetensors").write_bytes(b"\0" * 3 * 2**20)
    cases = [
        (str(outside), Forbidden, "outside the adapter roots"),
        (str(root / ".." / "outside.safetensors"), Forbidden, "'..'"),
        (str(root / "link.safetensors"), Forbidden, "outside the adapter roots"),
        (str(root / "weights.bin"), InvalidRequest, "only .safetensors"),
        (str(root / "missing.safetensors"), InvalidRequest, "no adapter file"),
        (str(root / "big.safetensors"), InvalidRequest, "above the limit of 1 MB"),
    ]
    for path, err, msg in cases:
        with pytest.raises(err, match=msg.replace(".", r"\.")):
            check_adapter_file(path, [str(root)], 1)
    with pytest.raises(Forbidden, match="no lora.allowed_roots"):
        check_adapter_file(str(good), [], 10)
    # PEFT adapter directories: both files, inside the roots, the weights within the limit.
    folder = make_adapter(str(root / "peft"), seed=1)
    assert check_adapter_file("peft", [str(root)], 10) == folder.resolve()
    (root / "empty").mkdir()
    (root / "escape").mkdir()
    (root / "escape" / "adapter_config.json").write_text("{}")
    (root / "escape" / "adapter_model.safetensors").symlink_to(outside)
    for path, err, msg in [
        ("empty", InvalidRequest, "holds adapter_config.json and adapter_model.safetensors"),
        ("escape", Forbidden, "resolve outside the adapter roots"),
    ]:
        with pytest.raises(err, match=msg):
            check_adapter_file(path, [str(root)], 1)


def test_names():
    assert check_name("red-v1.2") == "red-v1.2"
    for bad in ("", "-x", "a/b", "x" * 65, "a b"):
        with pytest.raises(InvalidRequest):
            check_name(bad)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_registry_persists_and_guards(tmp_path, where):
    """On a local file and on an fsspec URL (memory:// here; s3:// or gs:// the same way)."""
    path = tmp_path / "reg" / "loras.json" if where == "local" else f"memory://{tmp_path}/reg/loras.json"
    r = Registry(str(path))
    r.add("a", "/x/a.safetensors", 0.8)
    r.add("b", "/x/b.safetensors", 1.0)
    with pytest.raises(InvalidRequest, match="already registered"):
        r.add("a", "/x/a.safetensors", 1.0)
    r.pin("a", True, max_pinned=1)
    with pytest.raises(InvalidRequest, match="pinned already"):
        r.pin("b", True, max_pinned=1)
    again = Registry(str(path))  # a restart reads the same state
    assert again.all() == {"a": {"path": "/x/a.safetensors", "scale": 0.8, "pinned": True},
                           "b": {"path": "/x/b.safetensors", "scale": 1.0, "pinned": False}}  # fmt: skip
    again.remove("a")
    with pytest.raises(NotFound):
        r.get("a")
    left = r.fs.ls(os.path.dirname(r.path), detail=False)
    assert not [p for p in left if ".tmp" in p or (where == "memory" and p.endswith(".lock"))], left
    if where == "memory":  # a lock left by a writer that crashed is broken after STALE_LOCK_S
        with r.fs.open(r.lock_path, "wb") as f:
            f.write(str(time.time() - 2 * Registry.STALE_LOCK_S).encode())
        r.add("c", "/x/c.safetensors", 1.0)
        assert "c" in again.all()
