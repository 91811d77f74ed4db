"""The OpenAPI document as strict as the server, without a cluster: the patterns it states are the
ones the server checks, a deployment's document carries its limits and keys, each operation its
cross-field rules, a form its own schema; a 405 names the methods of its path, and HEAD is GET
without the body. `test_fuzz.py` checks the whole of it against a live app."""

from __future__ import annotations

import re
import sys

import pytest
from fastapi.testclient import TestClient

from serve_app import registries
from serve_app.config import AppConfig
from serve_app.errors import InvalidRequest
from serve_app.ingress.access import AccessPolicy
from serve_app.ingress.http import make_app
from serve_app.ingress.openapi import for_deployment, operations
from serve_app.schemas import (
    NOT_BLANK,
    REQUEST_ID_PATTERN,
    REQUEST_ID_REGEX,
    DeletedJob,
    ImagesGenerationRequest,
    Job,
)
from serve_app.schemas.control import CHECKPOINT_NAME_REGEX, LORA_NAME_REGEX, TRACE_PREFIX_REGEX
from serve_app.schemas.openai import SIZE_PATTERN, parse_size


@pytest.fixture(scope="module")
def app():
    return make_app()


@pytest.fixture(scope="module")
def doc(app):
    return app.openapi()


def test_a_prompt_the_pattern_takes_is_one_the_server_takes():
    # Every character: blank for str.strip() (the server's check) exactly where the document's
    # pattern finds nothing, in Python's re as in ECMA-262 (the class is spelled in both).
    pattern = re.compile(NOT_BLANK)
    differ = [
        hex(c) for c in range(sys.maxunicode + 1) if bool(chr(c).strip()) != bool(pattern.search(chr(c)))
    ]
    assert not differ
    with pytest.raises(ValueError, match="must not be empty"):
        ImagesGenerationRequest(prompt="\x1c\u3000 ")


def test_the_documented_patterns_are_the_servers():
    assert LORA_NAME_REGEX == registries.NAME_PATTERN.pattern
    assert CHECKPOINT_NAME_REGEX == registries.CHECKPOINT_NAME.pattern
    assert REQUEST_ID_REGEX == REQUEST_ID_PATTERN.pattern
    for name in (".", "..", "...", ".hidden", "a/b", "", "x" * 129):
        assert not re.search(CHECKPOINT_NAME_REGEX, name)
        with pytest.raises(InvalidRequest, match="^name: "):
            registries.check_checkpoint_name(name)
    assert re.search(CHECKPOINT_NAME_REGEX, "sd-1.5_ft") and re.search(TRACE_PREFIX_REGEX, "run.1")
    # `size`: what the pattern takes, parse_size reads (ASCII digits only, as ECMA-262's)
    for size in ("512x768", " 64 X 64 ", "auto"):
        assert re.search(SIZE_PATTERN, size) and (size == "auto" or parse_size(size))
    for size in ("١٢٨x128", "64x", "64×64", "123456x8"):
        assert not re.search(SIZE_PATTERN, size)
        with pytest.raises(ValueError):
            parse_size(size)


def test_each_operation_carries_the_rules_of_its_body(doc):
    rules = {(p, m): {r["param"] for r in op.get("x-constraints", [])} for p, m, op in operations(doc)}
    assert {"strength", "image", "size", "num_frames", "sampler"} <= rules["/v1/images/edits", "post"]
    assert "strength" not in rules["/v1/images/generations", "post"]  # an edit's field: refused there
    assert "strength" not in doc["components"]["schemas"]["ImagesGenerationRequest"]["properties"]
    assert (
        "model" in rules["/v1/videos", "post"] and "denoising_strength" in rules["/sdapi/v1/img2img", "post"]
    )
    assert {"source", "pool"} <= rules["/v1/checkpoints", "post"]
    assert all("422" not in op["responses"] for _, _, op in operations(doc))  # a validation error is a 400
    prompt = doc["components"]["schemas"]["ImagesGenerationRequest"]["properties"]["prompt"]
    assert prompt["minLength"] == 1 and prompt["pattern"] == NOT_BLANK
    assert "prompt" in doc["components"]["schemas"]["Txt2ImgRequest"]["required"]
    eta = doc["components"]["schemas"]["Txt2ImgRequest"]["properties"]["eta"]
    assert eta["enum"] == [None]  # A1111 fields this server does not do: their default only


def test_a_form_has_no_null_and_no_list_but_of_files(doc):
    form = doc["components"]["schemas"]["ImagesEditRequestForm"]["properties"]
    assert "null" not in str(form) and "loras" not in form and form["image"]["items"]["format"] == "binary"
    assert form["background"]["enum"] == ["opaque", "auto"]
    body = doc["paths"]["/v1/images/edits"]["post"]["requestBody"]["content"]
    assert body["multipart/form-data"]["schema"]["$ref"].endswith("/ImagesEditRequestForm")


def test_a_deployments_document_has_its_limits_and_keys(doc):
    import copy

    cfg = AppConfig.model_validate(
        {"limits": {"max_side": 64, "max_steps": 30, "max_prompt_chars": 99}, "auth": {"api_keys": ["k"]}}
    )
    mine = copy.deepcopy(doc)
    for_deployment(mine, cfg, AccessPolicy.from_config(cfg.auth))
    props = mine["components"]["schemas"]["ImagesBatchRequest"]["properties"]
    assert (
        props["width"]["anyOf"][0]["maximum"] == 64
        and props["num_inference_steps"]["anyOf"][0]["maximum"] == 30
    )
    assert props["prompts"]["items"]["maxLength"] == 99
    assert mine["components"]["schemas"]["Txt2ImgRequest"]["properties"]["steps"]["anyOf"][0]["maximum"] == 30
    form = mine["components"]["schemas"]["ImagesEditRequestForm"]["properties"]  # the edit's form too
    assert form["num_inference_steps"]["maximum"] == 30 and form["n"]["maximum"] == cfg.limits.max_images
    security = {(p, m): op.get("security") for p, m, op in operations(mine)}
    assert security["/v1/images/generations", "post"] and security["/v1/loras", "post"]
    assert not security["/health", "get"] and not security["/live", "get"]
    assert not security["/v1/files/{key}/{name}", "get"]  # the signature is the permission
    assert set(mine["components"]["securitySchemes"]) == {"apiKey", "basic"}
    open_service = copy.deepcopy(doc)
    for_deployment(open_service, AppConfig(), AccessPolicy())
    assert "securitySchemes" not in open_service["components"]


def test_a_405_names_every_method_of_its_path(app):
    c = TestClient(app)
    r = c.put("/v1/jobs/job_x")  # GET and DELETE are two routes of one path
    assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET, HEAD"
    assert r.json()["error"]["code"] == 405  # the project's error body
    assert c.request("TRACE", "/live").headers["allow"] == "GET, HEAD"
    assert c.options("/v1/images/generations").headers["allow"] == "POST"
    # A route's own path is that resource for every method: no templated route takes it over.
    for method in ("GET", "DELETE", "HEAD"):
        r = c.request(method, "/v1/videos/generations")
        assert r.status_code == 405 and r.headers["allow"] == "POST", (method, r.status_code, r.text)


def test_head_is_get_without_the_body(app):
    c = TestClient(app)
    get, head = c.get("/live"), c.head("/live")
    assert head.status_code == get.status_code == 200 and head.content == b""
    assert head.headers["content-length"] == get.headers["content-length"]
    assert c.head("/v1/rpc").status_code == 405  # no GET there, so no HEAD either


def test_a_deleted_job_is_a_job():
    fields = set(Job.model_json_schema()["required"])
    assert fields <= set(DeletedJob.model_json_schema()["required"]) | {"route"}
    assert "route" in fields
