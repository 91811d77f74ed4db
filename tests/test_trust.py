"""The trust boundary over real HTTP: hostile callers, the admin routes, readiness.

HTTP callers are untrusted: nothing they send may make a replica unhealthy, restart it, reach
files or leak server paths, and every answer is the project's JSON error, never Ray's text.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from ray import serve

from serve_app.ingress.access import ADMIN_CLOSED, AccessPolicy
from serve_app.testing import FAIL_MARKER, OOM_MARKER
from tests.conftest import SESSION_DIR, app_args, deploy, wait_for

GEN = "/v1/images/generations"
ADMIN_ROUTES = (
    ("POST", "/v1/loras", {"json": {"name": "a", "path": "a.safetensors"}}),
    ("DELETE", "/v1/loras/a", {}),
    ("POST", "/v1/loras/a/pin", {}),
    ("POST", "/v1/rpc", {"json": {"method": "describe"}}),
    ("POST", "/start_profile", {}),
    ("POST", "/stop_profile", {}),
)


def replica_state(client, prefix: str = "") -> dict:
    return client.get(f"{prefix}/v1/status").json()["replicas"][0]


JSON = {"content-type": "application/json"}
# What hostile or careless callers send: (request kwargs, expected status). None: any 4xx.
HOSTILE = [
    ({"json": {"prompt": "a", "extra": {"eta": "abc"}}}, 400),
    ({"json": {"prompt": "a", "extra": {"eta": [1, 2]}}}, 400),
    ({"json": {"prompt": "a", "extra": {"guidance_rescale": "high"}}}, 400),
    ({"json": {"prompt": "a", "extra": {"sigmas": [1.0, 0.5]}}}, 400),  # the pipeline refuses it
    ({"json": {"prompt": "a", "extra": {"timesteps": [999, 500, -3]}}}, 400),
    ({"json": {"prompt": "a", "extra": {"eta": None}}}, 400),
    ({"json": {"prompt": "a", "extra": {"timesteps": list(range(1000, 0, -1))}}}, 400),  # 1000 steps
    ({"json": {"prompt": "a", "extra": {"clip_skip": 99}}}, 400),
    ({"json": {"prompt": "a", "extra": {"output_type": "latent"}}}, 400),
    ({"json": {"prompt": "a", "width": 12}}, 400),
    ({"json": {"prompt": "a", "n": 10_000}}, 400),
    ({"json": {"prompt": "a", "acceleration": ["fast"]}}, 400),
    ({"json": {"prompt": "a", "quality": 3}}, 400),
    # refused by the pipeline with the step cache installed: the cache must come off again
    ({"json": {"prompt": "a", "acceleration": "faster", "extra": {"sigmas": [1.0, 0.5]}}}, 400),
    ({"json": {"prompt": f"x {FAIL_MARKER}"}}, 500),  # the engine fails on it: counted, self-tested
    ({"json": {"prompt": f"x {OOM_MARKER}"}}, 503),
    ({"content": b"{not json", "headers": JSON}, 400),
    ({"content": b"\xff\xfe\x00garbage", "headers": JSON}, 400),
    ({"content": b'{"prompt": "' + b"a" * (2 * 2**20) + b'"}', "headers": JSON}, 413),
]  # fmt: skip


def test_fifty_hostile_requests_leave_the_replica_serving_with_the_same_id(client):
    before = replica_state(client)
    seen: dict[int, int] = {}
    for i in range(50):
        kwargs, status = HOSTILE[i % len(HOSTILE)]
        r = client.post(GEN, **kwargs)
        assert r.status_code == status, (kwargs.get("json"), r.text[:300])
        err = r.json()["error"]  # always the project's JSON error
        assert err["message"] and err["code"] == status
        assert "Traceback" not in r.text and str(SESSION_DIR) not in r.text and "/root" not in r.text
        seen[status] = seen.get(status, 0) + 1
    # Two of Serve's health checks (every 2 s in the test app) pass after them.
    checks = replica_state(client)["counts"].get("health_checks_passed", 0)
    wait_for(lambda: replica_state(client)["counts"].get("health_checks_passed", 0) >= checks + 2, 30, 0.2)
    after = replica_state(client)
    assert after["replica_id"] == before["replica_id"] and after["healthy"], after
    assert client.post(GEN, json={"prompt": "still serving"}).status_code == 200
    passed = after["counts"].get("self_tests_passed", 0)
    print(f"\nhostile requests: {sum(seen.values())} sent, answers by status {sorted(seen.items())}; "
          f"replica {after['replica_id']} kept, self-tests passed: {passed}")  # fmt: skip


def test_a_chunked_body_over_the_limit_is_413(client):
    def chunks():
        for _ in range(40):
            yield b"x" * 65536

    r = client.post(GEN, content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "payload_too_large"


def test_request_ids_in_paths_are_checked_and_not_echoed(client):
    for method, path in (
        ("GET", "/v1/requests/"),
        ("POST", "/v1/requests/{}/abort"),
        ("DELETE", "/v1/requests/"),
    ):
        url = path.format("a" * 5000) if "{}" in path else path + "a" * 5000
        r = client.request(method, url)
        assert r.status_code == 400 and r.json()["error"]["param"] == "request_id", (method, r.text[:200])
        assert "aaaaaaaaaa" not in r.text


def test_unknown_routes_and_methods_get_the_json_error(client):
    r = client.get("/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = client.put(GEN, json={"prompt": "a"})
    assert r.status_code == 405 and "error" in r.json()


@pytest.mark.parametrize(
    "policy, auth, host, allowed",
    [
        (AccessPolicy(), "", "127.0.0.1", False),  # the default: closed, even from this machine
        (AccessPolicy(local_admin=True), "", "127.0.0.1", True),
        (AccessPolicy(local_admin=True), "", "::1", True),
        (AccessPolicy(local_admin=True), "", "10.1.2.3", False),  # from the network: closed
        (AccessPolicy(local_admin=True), "", None, False),
        (AccessPolicy(local_admin=True, admin_keys=("k",)), "", "127.0.0.1", False),  # keys win
        (AccessPolicy(admin_keys=("k",)), "Bearer k", "10.1.2.3", True),
        (AccessPolicy(admin_keys=("k",), user_keys=("u",)), "Bearer u", "127.0.0.1", False),
    ],
)
def test_admin_policy(policy, auth, host, allowed):
    assert (policy.check_admin(auth, host) is None) is allowed


# ----------------------------------------------------------------------------- a fresh app


@pytest.fixture(scope="module")
def fresh_app(ray_cluster):
    """An app with the default auth settings; its ingress answers seconds before its replica
    has imported, loaded and warmed up its model (measured 3 s against 9-16 s)."""
    # No keys and no local opt-in: what `serve run serve_config.yaml` gives.
    args = app_args(auth=None)
    name = "fresh"
    seen: list[tuple[str, int, dict, dict]] = []
    stop = threading.Event()
    base = ray_cluster + f"/{name}"

    def poll():
        # Until the ingress answers at all, Serve's proxy owns the route: only our answers count.
        with httpx.Client(base_url=base, timeout=30) as c:
            while not stop.is_set():
                for path in ("/live", "/health", "/v1/status", "/v1/loras", "/v1/models"):
                    try:
                        r = c.get(path)
                    except httpx.HTTPError:
                        continue
                    body = (
                        r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
                    )
                    seen.append((path, r.status_code, body, dict(r.headers)))
                time.sleep(0.1)

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    deploy(name, args)
    yield f"/{name}", seen, stop
    stop.set()
    t.join(30)
    serve.delete(name, _blocking=False)


@pytest.mark.slow
def test_health_is_503_until_a_replica_is_ready_then_everything_works_at_once(fresh_app, client):
    prefix, seen, stop = fresh_app
    with httpx.Client(base_url=str(client.base_url) + prefix, timeout=60) as c:
        deadline = time.monotonic() + 60
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline
        # The first 200 from /health: status, adapters and a generation work at once.
        assert c.get("/v1/status").status_code == 200
        assert c.get("/v1/loras").status_code == 200
        assert c.post(GEN, json={"prompt": "ready"}).status_code == 200
    stop.set()
    ours = [s for s in seen if s[0] == "/live" and s[1] == 200]
    assert ours, "the ingress never answered while the replica loaded"
    first_live = seen.index(ours[0])
    not_ready = [s for s in seen[first_live:] if s[1] != 200]
    assert any(p == "/health" for p, *_ in not_ready), "no 503 from /health while the replica loaded"
    for path, status, body, headers in not_ready:
        assert path != "/live", "liveness failed while the ingress lived"
        assert status == 503 and body["error"]["type"] == "unavailable", (path, status, body)
        assert "failed to deploy" not in str(body) and headers.get("retry-after") == "5", (path, headers)


@pytest.mark.slow
def test_admin_routes_are_closed_to_anonymous_callers_by_default(fresh_app, client):
    prefix = fresh_app[0]
    for method, path, kw in ADMIN_ROUTES:
        r = client.request(method, prefix + path, **kw)
        assert r.status_code == 403, (path, r.text)
        assert r.json()["error"]["message"] == ADMIN_CLOSED
    assert client.get(f"{prefix}/v1/loras").status_code == 200  # reading is not administration
