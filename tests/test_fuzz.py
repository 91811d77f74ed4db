"""The whole OpenAPI document checked against a live app the way a third-party conformance checker
does it (`schemathesis run <url>/openapi.json --checks all`): schemathesis's own engine, every
phase (examples, coverage's boundary and schema-invalid cases and undeclared methods, fuzzing,
stateful links) and every check it has: no 5xx; every answer as documented (status, content
type, body, headers); schema-valid data accepted and schema-invalid data refused; a 405 with
its `Allow` header; authentication enforced where it is declared; a deleted resource gone. Then
the replica serves with the same id afterwards.

Two passes over one app of its own with small limits (the generated requests stay cheap): with
its admin key, so that the admin routes are reached too, and with no key at all, as the
original run was made.

A schema-valid request may still get a 400 for a rule JSON Schema cannot say (image-to-image's
steps × strength, a frame count a model takes, a sampler the model offers): each operation lists
those in its `x-constraints` extension, and such a 400 is accepted only when its error's `param`
names one of them (`positive_data_acceptance_or_declared_rule`, in place of schemathesis's
`positive_data_acceptance`).
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter

import httpx
import pytest
import schemathesis
from schemathesis.checks import CHECKS, load_all_checks
from schemathesis.config import SchemathesisConfig
from schemathesis.core.failures import Failure
from schemathesis.engine import Status, events, from_schema
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tests.conftest import SESSION_DIR, deployed

pytestmark = pytest.mark.slow  # an app of its own
ADMIN = "fuzz-admin-key"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
MAX_EXAMPLES = 10
STARTED_AS: list[str] = []  # the replica's id when the app came up
OPEN = "^/(health|live)$|^/v1/files/"  # the routes that take no key (access.OPEN_ROUTES)
# Without a key every other route answers 401 whatever the request: a few generated requests
# each show that (documented, and no route ignores its declared auth); the coverage phase's
# hundreds of variants, undeclared methods among them, go to the open routes only.
NO_KEY = {
    "generation": {"max-examples": 3, "deterministic": True},
    "operations": [{"exclude-path-regex": OPEN, "phases": {"coverage": {"enabled": False}}}],
}

load_all_checks()  # every check schemathesis has, as `--checks all`


def declared_rule_params(operation: dict) -> set[str]:
    """The `param`s an operation's `x-constraints` name: the fields a 400 for a schema-valid
    request may blame."""
    return {rule["param"] for rule in operation.get("x-constraints", [])}


def _blamed(response) -> str | None:
    try:
        return json.loads(response.content)["error"]["param"]
    except (ValueError, KeyError, TypeError):
        return None


def _names_a_rule(param: str | None, declared: set[str]) -> bool:
    # `extra` stands for every key of it (`extra.guidance_rescale`).
    return param is not None and any(param == p or param.startswith(p + ".") for p in declared)


@schemathesis.check
def positive_data_acceptance_or_declared_rule(ctx, response, case) -> bool | None:
    """schemathesis's `positive_data_acceptance`, except for a 400 whose `param` names one of
    the operation's declared cross-field rules."""
    try:
        return positive_data_acceptance(ctx, response, case)
    except Failure:
        declared = declared_rule_params(case.operation.definition.raw)
        if response.status_code == 400 and _names_a_rule(_blamed(response), declared):
            return None
        raise


class Run:
    """One schemathesis run of every phase and check against a URL: its failures (operation,
    check, title -> a sample), and what it sent (requests by phase, answers by operation)."""

    def __init__(self, url: str, headers: dict[str, str], **settings):
        config = SchemathesisConfig.from_dict(
            {
                "base-url": url,
                "headers": headers,
                "seed": 60,
                "suppress-health-check": ["all"],
                "request-timeout": 120,
                "continue-on-failure": True,  # every failure of an operation, not only its first
                "generation": {"max-examples": MAX_EXAMPLES, "deterministic": True},
                "checks": {"positive_data_acceptance": {"enabled": False}},
                **settings,
            }
        )
        spec = httpx.get(f"{url}/openapi.json", headers=AUTH, timeout=60).json()  # the deployment's
        self.schema = schemathesis.openapi.from_dict(spec, config=config)
        self.failures: dict[tuple, str] = {}
        self.phases: Counter = Counter()
        self.answers: Counter = Counter()  # (operation, status) -> responses

    def execute(self) -> Run:
        assert "positive_data_acceptance_or_declared_rule" in CHECKS.get_all_names()
        for event in from_schema(self.schema).execute():
            if isinstance(event, events.FatalError):
                raise event.exception
            if isinstance(event, events.NonFatalError):
                self.failures[(event.label, "error", type(event.value).__name__)] = str(event.value)[:500]
            if isinstance(event, events.ScenarioFinished | events.FuzzScenarioFinished):
                self._record(event.recorder, str(getattr(event, "phase", "fuzzing")))
        return self

    def _record(self, recorder, phase: str) -> None:
        self.phases[phase] += len(recorder.interactions)
        for case_id, interaction in recorder.interactions.items():
            if interaction.response is not None and case_id in recorder.cases:
                label = recorder.cases[case_id].value.operation.label
                self.answers[label, interaction.response.status_code] += 1
        for case_id, checks in recorder.checks.items():
            for check in checks:
                if check.status == Status.FAILURE and check.failure_info is not None:
                    failure = check.failure_info.failure
                    key = (failure.operation or recorder.label, check.name, failure.title)
                    self.failures.setdefault(key, _sample(recorder, case_id, failure))

    @property
    def operations(self) -> set[str]:
        return {op for op, _ in self.answers}

    def report(self) -> str:
        return "\n".join(
            f"{op} [{check}] {title}:\n    {s}" for (op, check, title), s in sorted(self.failures.items())
        )


def _sample(recorder, case_id: str, failure) -> str:
    interaction = recorder.interactions.get(case_id)
    if interaction is None:
        return failure.message[:300]
    request, response = interaction.request, interaction.response
    body = (request.body or b"")[:1000]
    answer = (response.content or b"")[:300] if response is not None else b""
    status = response.status_code if response is not None else None
    return (
        f"{failure.message[:200]!r}\n    {request.method} {request.uri} {body!r}\n    -> {status} {answer!r}"
    )


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
        # Finished jobs of the admin's, for the job routes to find (GET /v1/jobs lists them) and
        # the stateful phase to delete.
        prefer = {**AUTH, "Prefer": "respond-async, wait=60"}
        for _ in range(3):
            job = httpx.post(
                f"{url}/v1/images/generations", json={"prompt": "a job"}, headers=prefer, timeout=90
            )
            assert job.status_code == 200 and job.json()["state"] == "done", job.text
        yield url


@pytest.mark.parametrize("who", ["admin", "no key"])
def test_every_check_of_every_operation_passes(fuzz_app, who):
    started = time.monotonic()
    run = Run(fuzz_app, AUTH).execute() if who == "admin" else Run(fuzz_app, {}, **NO_KEY).execute()
    by_check = Counter(check for _, check, _ in run.failures)
    print(
        f"\nfuzz ({who}): {sum(run.phases.values())} requests over {len(run.operations)} operations in "
        f"{time.monotonic() - started:.0f}s ({dict(run.phases)}); failures by check: {dict(by_check)}"
    )
    assert not run.failures, f"{len(run.failures)} failures:\n{run.report()}"
    assert len(run.operations) >= 38, sorted(run.operations)
    if who == "admin":  # the checks of a stored job's answers ran: one was read, and deleted
        assert run.answers["GET /v1/jobs/{job_id}/content/{index}", 200] > 0, run.answers
        assert run.answers["DELETE /v1/jobs/{job_id}", 200] > 0, run.answers


def test_a_checkpoint_name_is_never_a_path(fuzz_app):
    """`.`, `..` and any name starting with a dot are refused, by the document and the server."""
    spec = httpx.get(f"{fuzz_app}/openapi.json", headers=AUTH).json()
    pattern = spec["components"]["schemas"]["CheckpointAdd"]["properties"]["name"]["pattern"]
    for name in (".", "..", "...", ".hidden"):
        assert not re.search(pattern, name), name
        r = httpx.post(f"{fuzz_app}/v1/checkpoints", json={"name": name, "source": "x"}, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == "name", r.text


def test_the_replica_serves_with_the_same_id_after_the_fuzzing(fuzz_app):
    # Runs after the operations above (pytest keeps file order): nothing they sent broke it.
    with httpx.Client(base_url=fuzz_app, headers=AUTH, timeout=60) as c:
        reps = c.get("/v1/status").json()["replicas"]
        assert len(reps) == 1 and reps[0]["healthy"], reps
        assert reps[0]["replica_id"] == STARTED_AS[0]
        assert reps[0]["counts"].get("accepted", 0) > 0, "the fuzzer never reached the replica"
        assert c.post("/v1/images/generations", json={"prompt": "after the fuzz"}).status_code == 200
