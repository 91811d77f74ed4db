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
    # An adapter registered from a file is not replaced by a push, and HTTP has no push route.
    paths = client.get("/openapi.json").json()["paths"]
    assert not [p for p in paths if "push" in p], paths.keys()
