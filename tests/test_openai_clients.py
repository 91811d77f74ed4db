"""OpenAI clients as they really call: `null` for a parameter passed as None, a fixed model name
(`dall-e-2`, `gpt-image-1`) that the operator lists as an alias, and the gpt-image response
fields (`size`, `quality`, `output_format`, `background`, `usage`) read by the official SDK;
`output_compression` and `background` honoured or refused, never ignored."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image
from pydantic import ValidationError

from serve_app.config import AppConfig
from serve_app.schemas import (
    ImagesBatchRequest,
    ImagesEditRequest,
    ImagesGenerationRequest,
    VideosGenerationRequest,
)

GEN = "/v1/images/generations"
PNG_RED = (
    "data:image/png;base64,"
    + base64.b64encode(
        (lambda b: (Image.new("RGB", (32, 32), "red").save(b, format="PNG"), b.getvalue())[1])(io.BytesIO())
    ).decode()
)
REQUIRED = {
    ImagesGenerationRequest: {"prompt": "a"},
    VideosGenerationRequest: {"prompt": "a"},
    ImagesBatchRequest: {"prompts": ["a", "b"]},
    ImagesEditRequest: {"prompt": "a", "image": PNG_RED},
}


@pytest.mark.parametrize("model", list(REQUIRED), ids=lambda m: m.__name__)
def test_null_means_unset_for_every_optional_field(model):
    """Each optional field sent as JSON null gives the same request as the field left out."""
    base = model.model_validate(REQUIRED[model])
    optional = [f.alias or name for name, f in model.model_fields.items() if not f.is_required()]
    assert {"n", "response_format", "quality", "size", "background", "output_compression"} <= set(optional)
    for name in optional:
        assert model.model_validate({**REQUIRED[model], name: None}) == base, name


def test_null_for_a_required_field_is_a_400_naming_it(client):
    r = client.post(GEN, json={"prompt": None})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_every_optional_field_null_at_once_over_http(client):
    names = ("n", "response_format", "quality", "size", "style", "user", "background", "moderation",
             "output_compression", "stream", "partial_images", "model", "seed", "negative_prompt", "extra",
             "lora", "loras", "webhook")  # fmt: skip
    body = dict.fromkeys(names)
    r = client.post(GEN, json={**body, "prompt": "a red circle"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["data"]) == 1 and "b64_json" in out["data"][0]
    nulls = dict.fromkeys(("mask", "n", "size", "input_fidelity", "quality"))
    edit = client.post("/v1/images/edits", json={"prompt": "a boat", "image": PNG_RED, **nulls})
    assert edit.status_code == 200, edit.text


def test_aliases_route_like_the_name_and_are_listed(client):
    listed = client.get("/v1/models").json()["data"][0]
    assert listed["id"] == "tiny-sd" and listed["aliases"] == ["dall-e-2", "dall-e-3", "gpt-image-1"]
    same = {"prompt": "a red circle", "seed": 3}
    by_name = client.post(GEN, json={**same, "model": "tiny-sd"}).json()["data"][0]["b64_json"]
    for alias in ("dall-e-2", "gpt-image-1"):
        r = client.post(GEN, json={**same, "model": alias})
        assert r.status_code == 200 and r.json()["data"][0]["b64_json"] == by_name, r.text
    r = client.post(GEN, json={**same, "model": "dall-e-9"})
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert (
        err["param"] == "model"
        and err["message"] == "model: 'dall-e-9' is not served here; available: 'tiny-sd'"
    )


def test_aliases_are_checked_in_the_config():
    model = {"source": "builtin:tiny-sd"}
    assert AppConfig.from_args({"model": {**model, "aliases": ["dall-e-2"]}}).model.answers_to("dall-e-2")
    for bad, why in ((["tiny-sd"], "own name"), (["a", "a"], "twice"), (["bad name"], "letters")):
        with pytest.raises((ValidationError, ValueError), match=why):
            AppConfig.from_args({"model": {**model, "aliases": bad}})


def test_the_official_client_reads_what_was_served(base_url):
    """The SDK's `ImagesResponse` fields: the real size, the format, the quality served (the
    step-caching level's OpenAI name), an opaque background and zero token counts."""
    from openai import OpenAI

    oai = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    made = oai.images.generate(model="gpt-image-1", prompt="a red circle", size="32x32", n=None,
                               response_format=None)  # fmt: skip
    assert (made.size, made.output_format, made.quality, made.background) == (
        "32x32",
        "png",
        "high",
        "opaque",
    )
    assert made.usage.total_tokens == 0 and made.usage.input_tokens_details.text_tokens == 0
    low = oai.images.generate(model="dall-e-3", prompt="a red circle", size="32x32", quality="low",
                              output_format="jpeg")  # fmt: skip
    assert (low.quality, low.output_format) == ("low", "jpeg")
    events = list(oai.images.generate(model="gpt-image-1", prompt="a red circle", size="32x32", stream=True,
                                      partial_images=0, quality="medium"))  # fmt: skip
    done = [e for e in events if e.type == "image_generation.completed"]
    assert len(done) == 1 and (done[0].quality, done[0].size, done[0].background) == (
        "medium",
        "32x32",
        "opaque",
    )
    assert done[0].usage.total_tokens == 0


def test_output_compression_sets_the_lossy_quality_and_png_stays_lossless(client):
    def size(fmt, compression):
        body = {"prompt": "a red circle", "seed": 4, "output_format": fmt, "output_compression": compression}
        r = client.post(GEN, json=body)
        assert r.status_code == 200, r.text
        return len(base64.b64decode(r.json()["data"][0]["b64_json"]))

    for fmt in ("jpeg", "webp"):
        assert size(fmt, 5) < size(fmt, 95), fmt
    assert size("png", 5) == size("png", 95)  # lossless: the same bytes
    r = client.post(GEN, json={"prompt": "a", "output_compression": 101})
    assert r.status_code == 400 and r.json()["error"]["param"] == "output_compression", r.text


def test_a_transparent_background_is_refused_by_name(client):
    r = client.post(GEN, json={"prompt": "a red circle", "background": "transparent"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "background" and "opaque" in r.json()["error"]["message"]
    ok = client.post(GEN, json={"prompt": "a red circle", "background": "opaque"})
    assert ok.status_code == 200 and ok.json()["background"] == "opaque", ok.text


def _png(size=(64, 64)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, "blue").save(buf, format="PNG")
    return buf.getvalue()


def _image_of(answer) -> Image.Image:
    assert answer.status_code == 200, answer.text
    return Image.open(io.BytesIO(base64.b64decode(answer.json()["data"][0]["b64_json"])))


# Request bodies as the clients build them (read from their sources: Open WebUI's
# backend/open_webui/routers/images.py, LiteLLM's OpenAI image configs, LibreChat's
# OpenAIImageTools.js); only `size`, which each lets its operator set, is one these test limits take.
CLIENT_BODIES = {
    "open-webui": {"model": "dall-e-2", "prompt": "a red circle", "n": 1, "size": "64x64",
                   "response_format": "b64_json"},
    "open-webui gpt-image": {"model": "gpt-image-1", "prompt": "a red circle", "n": 1, "size": "64x64"},
    "litellm": {"model": "tiny-sd", "prompt": "a red circle", "n": 1, "response_format": "b64_json",
                "size": "64x64", "seed": 42},
    "librechat gpt-image": {"model": "gpt-image-1", "prompt": "a red circle", "n": 1, "background": "auto",
                            "output_format": "png", "quality": "auto", "size": "auto"},
    "openai-python, None passed": {"model": None, "prompt": "a red circle", "n": None, "quality": None,
                                   "response_format": None, "size": None, "style": None},
}  # fmt: skip


@pytest.mark.parametrize("client_name", list(CLIENT_BODIES))
def test_generation_bodies_as_clients_send_them(client, client_name):
    body = CLIENT_BODIES[client_name]
    image = _image_of(client.post(GEN, json=body))
    want = (
        tuple(int(x) for x in body["size"].split("x")) if body.get("size") not in (None, "auto") else (32, 32)
    )
    assert image.size == want, (client_name, image.size)


# Edits as multipart forms: Open WebUI sends one file as `image` (and `n` only when set),
# LiteLLM and LibreChat send `image[]` even for one file; every value is a string.
CLIENT_EDITS = {
    "open-webui": ({"model": "dall-e-2", "prompt": "a boat", "size": "64x64", "response_format": "b64_json"},
                   "image"),
    "litellm": ({"model": "tiny-sd", "prompt": "a boat", "n": "1", "size": "64x64",
                 "response_format": "b64_json"}, "image[]"),
    "librechat gpt-image": ({"model": "gpt-image-1", "prompt": "a boat", "quality": "auto", "size": "auto"},
                            "image[]"),
}  # fmt: skip


@pytest.mark.parametrize("client_name", list(CLIENT_EDITS))
def test_edit_forms_as_clients_send_them(client, client_name):
    fields, file_field = CLIENT_EDITS[client_name]
    files = [(file_field, ("0b5e.png", _png(), "image/png"))]
    image = _image_of(client.post("/v1/images/edits", data=fields, files=files))
    assert image.size == (64, 64), (client_name, image.size)
