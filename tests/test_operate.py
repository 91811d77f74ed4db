"""Operating the service: profiling and collective RPC fanned out to every replica."""

from __future__ import annotations

import json
import os


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
        path = r["result"]["trace"]
        assert os.path.basename(path).startswith(f"unit-{r['replica_id']}-")
        with open(path) as f:
            assert json.load(f)["traceEvents"]
    assert client.post("/start_profile", json={"prefix": "../evil"}).status_code == 400


def test_collective_rpc_reaches_engine_and_extension_methods(client, handle):
    out = client.post("/v1/rpc", json={"method": "ping", "args": ["hi"]}).json()
    assert out and all(r["ok"] and r["result"] == {"pong": "hi", "model": "tiny-sd"} for r in out)
    out = client.post("/v1/rpc", json={"method": "describe"}).json()
    assert out[0]["result"]["pipeline"] == "StableDiffusionPipeline"
    bad = client.post("/v1/rpc", json={"method": "no_such_method"}).json()
    assert not bad[0]["ok"] and "no public method 'no_such_method'" in bad[0]["error"]
    private = handle.collective_rpc.remote("_sync").result()
    assert not private[0]["ok"]
    assert client.post("/v1/images/generations", json={"prompt": "still serving"}).status_code == 200
