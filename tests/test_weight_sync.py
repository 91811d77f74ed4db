"""Issue 57: weight sync from a trainer. A LoRA pushed by handle as tensors (a dict, or a Ray
ObjectRef to one through the object store) becomes the next version of its adapter on every
replica; the next results use it and carry its `policy_version`; over HTTP there is no route
that pushes weights."""

from __future__ import annotations

import base64

import pytest

from serve_app.errors import InvalidRequest

NAME = "policy-sync"


def test_a_lora_pushed_by_handle_changes_the_next_results_and_bumps_policy_version(handle, client, tmp_path):
    import ray
    import torch
    from safetensors.torch import load_file

    from serve_app.tools.lora import make_adapter

    files = [make_adapter(str(tmp_path / f"w{k}.safetensors"), seed=k, strength=2.0) for k in (1, 2)]
    weights = [load_file(f) for f in files]
    plain = {"prompt": "a red circle", "seed": 5, "num_inference_steps": 3}
    body = {**plain, "lora": {"name": NAME}}
    base = handle.generate.remote(plain).result()
    assert base.policy_version is None
    try:
        first = handle.push_lora.remote(NAME, weights[0]).result()
        assert first["version"] == 1 and first["replicas"] >= 1
        one = handle.generate.remote(body).result()
        assert one.policy_version == 1 and one.images[0] != base.images[0]
        second = handle.push_lora.remote(NAME, ray.put(weights[1])).result()  # through the object store
        assert second["version"] == 2
        two = handle.generate.remote(body).result()
        assert two.policy_version == 2 and two.images[0] != one.images[0]
        over_http = client.post("/v1/images/generations", json=body).json()
        assert over_http["policy_version"] == 2
        assert base64.b64decode(over_http["data"][0]["b64_json"]) == two.images[0]
        # Each replica holds the newest version only; pinning a pushed adapter is refused.
        for replica in handle.list_loras.remote().result()["replicas"]:
            held = [n for n in replica["loaded"] if n.startswith(NAME)]
            assert held in ([], [f"{NAME}@v2"]), held
        assert client.post(f"/v1/loras/{NAME}/pin").status_code == 400
        # Weights that are no adapter are refused naming the field; the version stays.
        for bad in ({"x": 1}, {}, {"x": torch.zeros(2)}):  # no tensors; none; no LoRA weights
            with pytest.raises(InvalidRequest) as e:
                handle.push_lora.remote(NAME, bad).result()
            assert e.value.param == "weights"
        assert handle.generate.remote(body).result().policy_version == 2
    finally:
        handle.remove_lora.remote(NAME).result()
    # Removed and pushed again: a new number (a version names one set of weights for ever).
    try:
        assert handle.push_lora.remote(NAME, weights[0]).result()["version"] == 3
    finally:
        handle.remove_lora.remote(NAME).result()
    # An adapter registered from a file is not replaced by a push, and HTTP has no push route.
    from tests.conftest import ADAPTER_DIR

    make_adapter(str(ADAPTER_DIR / "sync-file.safetensors"), seed=9)
    handle.add_lora.remote("sync-file", "sync-file.safetensors").result()
    try:
        with pytest.raises(InvalidRequest) as e:
            handle.push_lora.remote("sync-file", weights[0]).result()
        assert e.value.param == "name"
    finally:
        handle.remove_lora.remote("sync-file").result()
    paths = client.get("/openapi.json").json()["paths"]
    assert not [p for p in paths if "push" in p], paths.keys()


def test_denoiser_weights_pushed_by_handle_change_the_next_results_until_put_back(handle):
    """Full weight sync: a trainer's denoiser weights (here two of them, by the denoiser's own
    names) go to every replica through the object store, between two calls; the next results
    change and say `weights_version`; misfits are 400s naming `weights`; the weights put back
    make the first image again."""
    import torch

    from serve_app.config import ModelConfig
    from serve_app.engine import DiffusionEngine
    from serve_app.engine.loading import find_denoiser

    local = DiffusionEngine(ModelConfig(source="builtin:tiny-sd", device="cpu", warmup=False))
    own = find_denoiser(local.pipe).state_dict()  # the served twin's own weights (seeded)
    original = {k: own[k].clone() for k in ("conv_out.weight", "conv_out.bias")}
    plain = {"prompt": "a red circle", "seed": 5, "num_inference_steps": 3}
    before = handle.generate.remote(plain).result()
    try:
        pushed = handle.push_weights.remote({k: v * 0.5 for k, v in original.items()}, 1).result()
        assert pushed["weights_version"] == 1 and pushed["replicas"] >= 1
        after = handle.generate.remote(plain).result()
        assert after.weights_version == 1 and after.images[0] != before.images[0]
        for bad in ({"conv_out.weight": torch.zeros(1)}, {"no.such.weight": torch.zeros(1)}, {"x": 1}):
            with pytest.raises(InvalidRequest) as e:
                handle.push_weights.remote(bad, 2).result()
            assert e.value.param == "weights"
    finally:
        handle.push_weights.remote(original, 0).result()
    again = handle.generate.remote(plain).result()
    assert again.weights_version == 0 and again.images[0] == before.images[0]
