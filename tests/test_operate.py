"""Operating the service: profiling and collective RPC fanned out to every replica."""

from __future__ import annotations

import json
import os

import pytest

from serve_app.config import ProfilingConfig
from serve_app.errors import InvalidRequest


def test_profile_start_stop_writes_a_trace_per_replica(client):
    assert client.post("/stop_profile").json()[0]["ok"] is False  # stop without start: a clear error
    started = client.post("/start_profile", json={"prefix": "unit"}).json()
    assert all(r["ok"] for r in started)
    again = client.post("/start_profile", json={"prefix": "unit"}).json()
    assert not again[0]["ok"] and "already running" in again[0]["error"]
    assert client.post("/v1/images/generations", json={"prompt": "profiled"}).status_code == 200
    stopped = client.post("/stop_profile").json()
    assert all(r["ok"] for r in stopped)
    for r in stopped:
        name = r["result"]["trace"]  # relative to profiling.trace_dir: no server path is shown
        assert not os.path.isabs(name) and name.startswith(f"unit-{r['replica_id']}-"), name
        assert "/root" not in json.dumps(stopped)
        with open(os.path.join(os.path.expanduser(ProfilingConfig().trace_dir), name)) as f:
            assert json.load(f)["traceEvents"]
    assert client.post("/start_profile", json={"prefix": "../evil"}).status_code == 400


def test_collective_rpc_reaches_engine_and_extension_methods(client, handle):
    out = client.post("/v1/rpc", json={"method": "ping", "args": ["hi"]}).json()
    assert out and all(r["ok"] and r["result"] == {"pong": "hi", "model": "tiny-sd"} for r in out)
    out = client.post("/v1/rpc", json={"method": "describe"}).json()
    assert out[0]["result"]["pipeline"] == "StableDiffusionPipeline"
    assert client.post("/v1/images/generations", json={"prompt": "still serving"}).status_code == 200


@pytest.mark.parametrize(
    "method, args",
    [
        ("no_such_method", []),
        ("close", []),  # would leave the replica without a pipeline
        ("load_lora", ["x", "/etc/passwd"]),  # would read a file outside lora.allowed_roots
        ("unload_lora", ["x"]),
        ("run", []),
        ("_sync", []),
        ("__init__", []),
    ],
)
def test_rpc_is_an_allow_list(client, handle, method, args):
    r = client.post("/v1/rpc", json={"method": method, "args": args})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "method" and "describe" in err["message"] and "ping" in err["message"]
    assert "passwd" not in r.text and "root" not in r.text
    with pytest.raises(InvalidRequest):
        handle.collective_rpc.remote(method, args).result()
    assert client.post("/v1/images/generations", json={"prompt": "still serving"}).status_code == 200
