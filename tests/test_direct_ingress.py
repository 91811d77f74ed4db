"""The app under Ray Serve's direct ingress (`RAY_SERVE_ENABLE_DIRECT_INGRESS=1`): no proxy, the
ingress replica serves HTTP itself. Ray reads the flag when its processes start, so the scenario
runs in a child process with a Ray instance of its own and reports as JSON, beside the session's
other tests (`background_report`, tests/conftest.py)."""

from __future__ import annotations

import json
import os
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.own_cluster]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def scenario() -> dict:
    from tests.conftest import TEST_ARGS, free_port

    http_port, grpc_port = free_port(), free_port()
    os.environ.update(
        RAY_USAGE_STATS_ENABLED="0",
        RAY_SERVE_ENABLE_DIRECT_INGRESS="1",
        RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT=str(http_port),
        RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT=str(http_port + 1),
        RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT=str(grpc_port),
        RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT=str(grpc_port + 1),
    )
    import httpx
    import ray
    from ray import serve

    from serve_app.app import build_app

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.run(build_app(TEST_ARGS), name="direct", route_prefix="/")
        url = f"http://127.0.0.1:{http_port}"  # the ingress replica's own port: no proxy between
        gen = url + "/v1/images/generations"
        with httpx.Client(timeout=120) as http:
            image = http.post(gen, json={"prompt": "direct", "seed": 1, "acceleration": "fast"})
            bad = http.post(gen, json={"prompt": "direct", "num_inference_steps": 0})
            with http.stream("POST", gen, json={"prompt": "direct", "stream": True}) as r:
                events = [line for line in r.iter_lines() if line.startswith("data:")]
            models = http.get(url + "/v1/models")
        return {
            "image": [image.status_code, len(image.json().get("data", []))],
            "bad": [bad.status_code, bad.json()["error"]["param"]],
            "events": [len(events), events[-1] if events else ""],
            "models": [models.status_code, models.json()["data"][0]["id"]],
        }
    finally:
        ray.shutdown()


def background() -> dict:
    from tests.conftest import child_scenario  # here: run as a script, this file has no `tests`

    return child_scenario(__file__, timeout=300)


def test_the_app_serves_without_a_proxy_under_direct_ingress(background_report):
    res = background_report
    assert res["image"] == [200, 1], res
    assert res["bad"] == [400, "num_inference_steps"], res
    assert res["events"][0] >= 3 and res["events"][1] == "data: [DONE]", res  # steps, result, end
    assert res["models"] == [200, "tiny-sd"], res


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    result = scenario()
    with open(sys.argv[1], "w") as f:
        json.dump(result, f)
