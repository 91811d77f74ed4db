"""The general guard of issue 60: walk every operation of the app's own OpenAPI document and give
each field its body describes, at every depth the document describes, each kind of odd value.

- Values no field takes (a lone surrogate in a value or in a key, NaN, Infinity, a number past
  a double): a 400 whose `param` names the place, on every route, admin ones included (they
  are refused before any route runs, so they change nothing).
- Values that do little or nothing (zero, the smallest double, an empty or a huge list, an
  empty string), on the image routes: an answer as the document says (a result, or a 4xx in
  the project's JSON error), never a 5xx.
- Odd query and path values on every route: never a 5xx.

The replica keeps its id and counts no engine failure through all of it. Fields are found from
the document, so a field added later is walked without a change here.
"""

from __future__ import annotations

import base64
import io
import itertools
import json
from typing import Any

import pytest
from PIL import Image

pytestmark = pytest.mark.slow  # a few hundred requests


def _png() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (30, 140, 200)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


PNG = _png()
# Bodies that work on the shared app (one short step where steps are asked); the other
# operations' bodies are made from their schemas' required fields.
BASES: dict[str, dict[str, Any]] = {
    "/v1/images/generations": {"prompt": "a", "num_inference_steps": 1},
    "/v1/images/generations/batch": {"prompts": ["a"], "num_inference_steps": 1},
    "/v1/images/edits": {"prompt": "a", "image": PNG, "num_inference_steps": 2, "strength": 0.5},
    "/v1/videos": {"prompt": "a"},
    "/v1/videos/generations": {"prompt": "a"},
    "/sdapi/v1/txt2img": {"prompt": "a", "steps": 1},
    "/sdapi/v1/img2img": {"prompt": "a", "init_images": [PNG], "steps": 2, "denoising_strength": 0.5},
}
IMAGE_ROUTES = set(BASES)

# Raw JSON spellings of values no field takes, and what the place must be named.
ODD_VALUES = ['"\\ud800"', '"a\\udfffb"', "NaN", "Infinity", "-Infinity", "1e400"]
ODD_KEY = '{"\\udc00": 1}'
LITTLE = {"number": [0, 5e-324], "integer": [0, -1], "array": [[], "HUGE"], "string": [""]}
ODD_QUERY = ["NaN", "Infinity", "-0", "1e400", "%ED%A0%80", "%00", "a" * 3000]


def _resolve(spec: dict, schema: dict) -> dict:
    while "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]]
    return schema


def _variants(spec: dict, schema: dict) -> list[dict]:
    """The non-null alternatives of a schema (anyOf/oneOf), each resolved."""
    schema = _resolve(spec, schema)
    alts = schema.get("anyOf") or schema.get("oneOf") or [schema]
    out = [_resolve(spec, a) for a in alts]
    return [a for a in out if a.get("type") != "null"] or out


def _fields(spec: dict, schema: dict, at: tuple = (), depth: int = 2):
    """(path, type) of every property the schema describes, nested objects' too."""
    for alt in _variants(spec, schema):
        for name, sub in alt.get("properties", {}).items():
            for v in _variants(spec, sub):
                kind = v.get("type") or ("object" if "properties" in v else "any")
                yield (*at, name), kind
                if kind == "object" and depth > 1 and v.get("properties"):
                    yield from _fields(spec, v, (*at, name), depth - 1)


def _sample(spec: dict, schema: dict) -> Any:
    v = _variants(spec, schema)[0]
    if "default" in v and v["default"] is not None:
        return v["default"]
    if "enum" in v:
        return v["enum"][0]
    kind = v.get("type")
    if kind == "integer":
        return max(v.get("minimum", 1), 1)
    if kind == "number":
        return max(v.get("minimum", 1.0), v.get("exclusiveMinimum", 0) + 0.5)
    if kind == "boolean":
        return False
    if kind == "array":
        return []
    if kind == "object" or "properties" in v:
        return {k: _sample(spec, s) for k, s in v.get("properties", {}).items() if k in v.get("required", ())}
    return "a" * max(1, v.get("minLength", 1))


def _operations(spec: dict):
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            yield path, method.upper(), op


def _json_schema(op: dict) -> dict | None:
    return op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")


def _concrete(path: str) -> str:
    return path.replace("{", "odd-").replace("}", "")


def _with(body: dict, place: tuple, raw: str) -> bytes:
    """`body` as JSON text with the value at `place` spelled `raw` (nested objects made)."""
    marker = "@@ODD@@"
    doc = json.loads(json.dumps(body))
    node = doc
    for key in place[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[place[-1]] = marker
    return json.dumps(doc).replace(f'"{marker}"', raw).encode()


def _dotted(place: tuple) -> str:
    return ".".join(place)


@pytest.fixture(scope="module")
def spec(client) -> dict:
    return client.get("/openapi.json").json()


@pytest.fixture(scope="module", autouse=True)
def same_replica(client):
    before = client.get("/v1/status").json()["replicas"][0]
    yield
    after = client.get("/v1/status").json()["replicas"][0]
    assert after["replica_id"] == before["replica_id"] and after["healthy"], after
    assert after["engine_failures_in_a_row"] == 0, after


def _json_error(r) -> dict:
    assert r.headers["content-type"].startswith("application/json"), (r.status_code, r.text[:200])
    return r.json()["error"]


def test_values_no_field_takes_are_400s_naming_the_place_on_every_route(client, spec):
    sent = 0
    bodies = [(p, m, op) for p, m, op in _operations(spec) if _json_schema(op) is not None]
    assert len(bodies) >= 12, [p for p, _, _ in bodies]
    for path, method, op in bodies:
        schema = _json_schema(op)
        base = BASES.get(path) or _sample(spec, schema)
        cases = [(place, raw) for place, _ in _fields(spec, schema) for raw in [*ODD_VALUES, ODD_KEY]]
        cases.append((("\udc00",), "1"))  # a key no field has, that is no text either, at the top
        for place, raw in cases:
            r = client.request(method, _concrete(path), content=_with(base, place, raw),
                               headers={"content-type": "application/json"})  # fmt: skip
            sent += 1
            where = _dotted(place).encode("utf-8", "backslashreplace").decode()
            where += ".\\udc00" if raw == ODD_KEY else ""
            assert r.status_code == 400, (method, path, place, raw, r.text[:300])
            assert _json_error(r)["param"] == where, (method, path, raw, r.text[:300])
    print(f"\nodd values: {sent} requests over {len(bodies)} operations with bodies, each a 400 naming where")


def test_values_that_do_little_get_a_documented_answer_on_the_image_routes(client, spec):
    answers: dict[int, int] = {}
    for path, method, op in _operations(spec):
        if path not in IMAGE_ROUTES or (schema := _json_schema(op)) is None:
            continue
        base = BASES[path]
        for place, kind in _fields(spec, schema, depth=1):
            for value in LITTLE.get(kind, []):
                if value == "HUGE":
                    value = [0] * 10_000
                body = {**base, place[0]: value}
                r = client.request(method, path, json=body)
                answers[r.status_code] = answers.get(r.status_code, 0) + 1
                assert r.status_code < 500, (path, place, str(value)[:40], r.text[:300])
                if r.status_code >= 400:
                    assert _json_error(r)["message"], (path, place)
    assert answers.get(200, 0) > 0 and sum(v for k, v in answers.items() if k >= 400) > 0, answers
    print(f"\nlittle values: answers by status {sorted(answers.items())}")


def test_odd_query_and_path_values_never_get_a_5xx(client, spec):
    sent = 0
    for path, method, op in _operations(spec):
        params = [p for p in op.get("parameters", []) if p["in"] in ("query", "path")]
        for p, odd in itertools.product(params, ODD_QUERY):
            url = _concrete(path)
            if p["in"] == "path":
                url = url.replace(f"odd-{p['name']}", odd)
            else:
                url += f"?{p['name']}={odd}"
            r = client.request(method, url)
            sent += 1
            assert r.status_code < 500, (method, url[:120], r.text[:300])
    assert sent > 50
    print(f"\nodd query and path values: {sent} requests, no 5xx")
