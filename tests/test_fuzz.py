"""The whole OpenAPI spec driven by schemathesis against a live app: no 5xx, every answer as
documented, and the replica serves with the same id afterwards.

A bounded run (a few examples per operation) on its own app with small limits, so that the
generated requests stay cheap; its admin key lets the fuzzer reach the admin routes too.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.conftest import SESSION_DIR, deployed

pytestmark = pytest.mark.slow  # an app of its own
ADMIN = "fuzz-admin-key"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
STARTED_AS: list[str] = []  # the replica's id when the app came up


@pytest.fixture(scope="module")
def fuzz_app(ray_cluster):
    with deployed(
        "fuzz",
        model={"default_height": 16, "default_width": 16, "default_steps": 2, "engine_extension": None},
        limits={"max_pixels": 32 * 32, "max_side": 32, "max_steps": 3, "max_images": 2, "max_prompts": 2},
        auth={"admin_keys": [ADMIN], "local_admin": False},
        profiling={"trace_dir": str(SESSION_DIR / "fuzz-traces")},
        lora={"registry_path": str(SESSION_DIR / "fuzz-registry.json")},
    ) as prefix:
        url = ray_cluster + prefix
        STARTED_AS.append(httpx.get(f"{url}/v1/status", headers=AUTH).json()["replicas"][0]["replica_id"])
        yield url


@pytest.fixture(scope="module")
def api_schema(fuzz_app):
    spec = httpx.get(f"{fuzz_app}/openapi.json", headers=AUTH).json()
    return schemathesis.openapi.from_dict(spec)


CHECKS = [
    schemathesis.checks.not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


def test_every_operation_answers_as_documented(fuzz_app, api_schema):
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 15, [op.label for op in operations]
    calls = 0
    for op in operations:

        @settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        @given(case=op.as_strategy())
        def fuzz(case):
            nonlocal calls
            calls += 1
            case.call_and_validate(base_url=fuzz_app, headers=AUTH, checks=CHECKS)

        fuzz()
    print(f"\nfuzz: {calls} requests over {len(operations)} operations, all as documented")


def test_the_replica_serves_with_the_same_id_after_the_fuzzing(fuzz_app):
    # Runs after the operations above (pytest keeps file order): nothing they sent broke it.
    with httpx.Client(base_url=fuzz_app, headers=AUTH, timeout=60) as c:
        reps = c.get("/v1/status").json()["replicas"]
        assert len(reps) == 1 and reps[0]["healthy"], reps
        assert reps[0]["replica_id"] == STARTED_AS[0]
        assert reps[0]["counts"].get("accepted", 0) > 0, "the fuzzer never reached the replica"
        assert c.post("/v1/images/generations", json={"prompt": "after the fuzz"}).status_code == 200
