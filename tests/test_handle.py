"""The Python API: other Ray apps call the ingress through `serve.get_app_handle`."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from serve_app.errors import InvalidRequest, ServingError
from serve_app.schemas import BatchGenerationRequest, GenerationRequest, GenerationResult, ModelList
from serve_app.testing import FAIL_MARKER


def test_generate_returns_a_typed_result(handle):
    res = handle.generate.remote(
        GenerationRequest(prompt="a red cat", seed=9, num_images=2, width=40)
    ).result()
    assert isinstance(res, GenerationResult)
    assert res.seeds == [9, 10] and res.prompt_index == [0, 0]
    assert [im.size for im in res.pil_images()] == [(40, 32), (40, 32)]
    assert res.request_id and res.model == "tiny-sd" and res.final_output_type == "image"
    assert res.metrics.batch_images == 2


def test_handle_and_http_give_the_same_image(handle, client):
    res = handle.generate.remote(GenerationRequest(prompt="same everywhere", seed=77)).result()
    body = client.post("/v1/images/generations", json={"prompt": "same everywhere", "seed": 77}).json()
    assert base64.b64decode(body["data"][0]["b64_json"]) == res.images[0]


def test_generate_batch_and_dict_input(handle):
    req = BatchGenerationRequest(prompts=["a", "b"], seed=1, num_images=1, return_latents=True)
    res = handle.generate_batch.remote(req).result()
    assert res.prompt_index == [0, 1] and len(res.images) == 2
    assert res.latents.to_numpy().shape == (2, 4, 16, 16)
    again = handle.generate_batch.remote({"prompts": ["a", "b"], "seed": 1}).result()
    assert again.images == res.images


def test_trajectory_tensors(handle):
    res = handle.generate.remote(
        GenerationRequest(prompt="a", return_trajectory=True, num_inference_steps=5)
    ).result()
    t = res.trajectory
    assert len(t.timesteps) == 5 and len(t.latents) == 5
    assert t.latents[0].to_torch().shape == (1, 4, 16, 16)
    assert not np.array_equal(t.latents[0].to_numpy(), t.latents[-1].to_numpy())


def test_models(handle):
    models = handle.models.remote().result()
    assert isinstance(models, ModelList) and models.data[0].id == "tiny-sd"


def test_bad_input_raises_a_typed_error(handle):
    with pytest.raises(InvalidRequest, match="width: 512 is above the maximum 128") as info:
        handle.generate.remote(GenerationRequest(prompt="a", width=512)).result()
    assert info.value.param == "width" and info.value.status_code == 400
    with pytest.raises(InvalidRequest, match="prompt: must not be empty"):
        handle.generate.remote({"prompt": ""}).result()
    assert handle.generate.remote(GenerationRequest(prompt="still serving")).result().images


def test_engine_failure_raises_a_typed_error_with_the_request_id(handle):
    with pytest.raises(ServingError) as info:
        handle.generate.remote(GenerationRequest(prompt=FAIL_MARKER, request_id="py-fail")).result()
    assert info.value.status_code == 500 and info.value.request_id == "py-fail"
    assert handle.generate.remote(GenerationRequest(prompt="still serving")).result().images


def test_prompt_embeds_instead_of_text(handle):
    import torch

    from serve_app.engine.builtin import build_builtin
    from serve_app.errors import InvalidRequest
    from serve_app.schemas import TensorPayload

    pipe = build_builtin("tiny-sd")  # the same seeded weights as the served model
    with torch.no_grad():
        embeds, _ = pipe.encode_prompt("a red cat", "cpu", 1, False)
    by_text = handle.generate.remote(GenerationRequest(prompt="a red cat", seed=8)).result()
    by_embeds = handle.generate.remote(
        GenerationRequest(prompt_embeds=TensorPayload.from_tensor(embeds), seed=8)
    ).result()
    a, b = (np.asarray(r.pil_images()[0]).astype(int) for r in (by_text, by_embeds))
    assert np.abs(a - b).max() <= 1
    with pytest.raises(
        InvalidRequest, match=r"shape \(1, 5, 32\) does not fit this model, which wants \(1, 77, 32\)"
    ):
        handle.generate.remote(
            GenerationRequest(prompt_embeds=TensorPayload.from_tensor(embeds[:, :5]))
        ).result()
    with pytest.raises(ValueError, match="must not be empty"):
        GenerationRequest(prompt="")
