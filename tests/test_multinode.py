"""Several nodes: replicas spread over nodes, and losing a node loses no request.

A test session's driver is attached to the session's single-node cluster, so the scenario runs
in a child process with its own `ray.cluster_utils.Cluster` (three raylets on this machine: a
head that holds the ingress, two workers that hold one replica each) and reports as JSON, beside
the session's other tests (`background_report`, tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.own_cluster]


def scenario() -> dict:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import httpx
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from serve_app.app import build_app
    from tests.conftest import TEST_ARGS, free_port

    phases = {}
    t_phase = time.monotonic()

    def phase(name: str) -> None:
        nonlocal t_phase
        phases[name] = round(time.monotonic() - t_phase, 1)
        t_phase = time.monotonic()

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "resources": {"ingress": 1}, "include_dashboard": False},
    )
    workers = [cluster.add_node(num_cpus=0, resources={"diffusion": 1}) for _ in range(2)]
    ray.init(address=cluster.address, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    args = {
        **TEST_ARGS,
        "replica": {**TEST_ARGS["replica"], "num_replicas": 2, "resources": {"diffusion": 1},
                    "health_check_period_s": 1},
        "ingress": {**TEST_ARGS["ingress"], "resources": {"ingress": 0.1}, "max_attempts": 4},
    }  # fmt: skip
    phase("cluster")
    serve.run(build_app(args), name="multi", route_prefix="/")
    phase("deploy")
    url = f"http://127.0.0.1:{port}"
    http = httpx.Client(base_url=url, timeout=120)
    before = http.get("/v1/status").json()["replicas"]
    nodes_before = sorted(r["node_id"] for r in before)

    outcomes: list[tuple[int, int]] = []
    stop = threading.Event()

    def client(c: int) -> None:
        with httpx.Client(base_url=url, timeout=120) as h:
            i = 0
            while not stop.is_set():
                body = {"prompt": f"multi {c}", "seed": i, "size": "32x32", "num_inference_steps": 6}
                r = h.post("/v1/images/generations", json=body)
                outcomes.append((r.status_code, r.json().get("attempts", 0) if r.status_code == 200 else 0))
                i += 1

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(3)]
    for t in threads:
        t.start()
    time.sleep(2)
    lost = workers[0].unique_id
    t_remove = time.monotonic()
    cluster.remove_node(workers[0])
    cluster.add_node(num_cpus=0, resources={"diffusion": 1})
    deadline = time.monotonic() + 120
    after = []
    while time.monotonic() < deadline:
        try:
            after = http.get("/v1/status").json()["replicas"]
        except Exception:
            after = []
        if len(after) == 2 and lost not in {r["node_id"] for r in after}:
            break
        time.sleep(1)
    recovered_s = time.monotonic() - t_remove
    phase("traffic_and_recovery")
    time.sleep(1.5)
    stop.set()
    hung = 0
    for t in threads:
        t.join(150)
        hung += t.is_alive()
    phase("clients_done")
    ray.shutdown()  # the cluster goes whole: no need for Serve's own orderly shutdown first
    cluster.shutdown()
    phase("shutdown")
    return {
        "phases_s": phases,
        "nodes_before": nodes_before,
        "nodes_after": sorted(r["node_id"] for r in after),
        "lost_node": lost,
        "recovered_s": round(recovered_s, 1),
        "codes": [c for c, _ in outcomes],
        "retried": sum(1 for c, a in outcomes if c == 200 and a > 1),
        "hung": hung,
    }


def background() -> dict:
    from tests.conftest import child_scenario  # here: run as a script, this file has no `tests`

    return child_scenario(__file__, timeout=600)


def test_replicas_spread_and_survive_node_loss(background_report):
    res = background_report
    codes = res["codes"]
    ok = codes.count(200)
    print(f"\nmulti-node: replicas on {len(set(res['nodes_before']))} nodes; node lost, replicas back on "
          f"2 nodes after {res['recovered_s']}s; {len(codes)} requests, {ok} ok ({res['retried']} retried), "
          f"{len(codes) - ok} errors, {res['hung']} hung; seconds by phase {res['phases_s']}")  # fmt: skip
    assert len(set(res["nodes_before"])) == 2, "the two replicas did not land on two nodes"
    assert res["lost_node"] not in res["nodes_after"] and len(set(res["nodes_after"])) == 2
    assert res["hung"] == 0
    assert set(codes) <= {200, 503}, codes
    assert codes.count(200) >= 0.8 * len(codes) and len(codes) >= 6


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = scenario()
    with open(sys.argv[1], "w") as f:
        json.dump(result, f)
