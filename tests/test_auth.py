"""API keys over real HTTP: 401 without or with a wrong key, 403 for a user key on admin routes."""

from __future__ import annotations

import pytest

from tests.conftest import ADMIN_KEY as ADMIN
from tests.conftest import USER_KEY as USER

pytestmark = pytest.mark.slow  # the app with keys


@pytest.fixture(scope="module")
def auth_app(keyed_app):
    return keyed_app


def hdr(key):
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize(
    "headers, status",
    [({}, 401), (hdr("wrong"), 401), ({"Authorization": USER}, 401), (hdr(USER), 200), (hdr(ADMIN), 200)],
)
def test_generation_needs_a_valid_key(auth_app, client, headers, status):
    r = client.post(f"{auth_app}/v1/images/generations", json={"prompt": "a"}, headers=headers)
    assert r.status_code == status, r.text
    if status == 401:
        assert r.json()["error"]["type"] == "authentication_error"
        assert r.headers["WWW-Authenticate"] == "Bearer"
        assert USER not in r.text and ADMIN not in r.text and "wrong" not in r.text


def test_every_route_but_health_is_guarded(auth_app, client):
    assert client.get(f"{auth_app}/health").status_code == 200
    for path in ("/v1/models", "/v1/status", "/v1/loras", "/openapi.json", "/v1/requests/x"):
        assert client.get(auth_app + path).status_code == 401, path
    assert client.get(f"{auth_app}/v1/models", headers=hdr(USER)).status_code == 200


def test_admin_routes_need_an_admin_key(auth_app, client):
    body = {"name": "a", "path": "missing.safetensors"}
    for method, path, kw in (
        ("POST", "/v1/loras", {"json": body}),
        ("DELETE", "/v1/loras/a", {}),
        ("POST", "/v1/loras/a/pin", {}),
        ("POST", "/v1/rpc", {"json": {"method": "describe"}}),
        ("POST", "/stop_profile", {}),
    ):
        r = client.request(method, auth_app + path, headers=hdr(USER), **kw)
        assert r.status_code == 403 and "admin key" in r.json()["error"]["message"], (path, r.text)
        r = client.request(method, auth_app + path, headers=hdr(ADMIN), **kw)
        assert r.status_code not in (401, 403), (path, r.text)  # past the guard: the route's own answer
    assert client.get(f"{auth_app}/v1/loras", headers=hdr(USER)).status_code == 200
