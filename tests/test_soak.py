"""A bounded soak: four hundred small requests, mixed sizes, some aborted, some invalid."""

from __future__ import annotations

import concurrent.futures as cf
import random
import threading
import time

import httpx
import pytest

from tests.conftest import USER_KEY

pytestmark = pytest.mark.slow

TOTAL = 400
CLIENTS = 8
KEY = {"Authorization": f"Bearer {USER_KEY}"}


def test_soak_mixed_traffic_no_unexpected_errors_and_flat_memory(keyed_app, base_url):
    """On the app with keys and a short batch window (conftest's `keyed_app`)."""
    base_url = base_url + keyed_app
    client = httpx.Client(base_url=base_url, headers=KEY, timeout=60)
    for side in (8, 16, 24, 32):
        warm = {"prompt": "warm", "size": f"{side}x{side}", "num_inference_steps": 1}
        assert client.post("/v1/images/generations", json=warm).status_code == 200
    rss = [client.get("/v1/status").json()["replicas"][0]["rss_mb"]]
    unexpected: list[tuple] = []
    counts = {"ok": 0, "invalid": 0, "aborted": 0, "abort_too_late": 0}
    lock = threading.Lock()
    todo = iter(range(TOTAL))
    half = threading.Event()

    def worker(c: int) -> None:
        rng = random.Random(c)
        with httpx.Client(base_url=base_url, headers=KEY, timeout=60) as http:
            for i in todo:
                kind = rng.choices(["ok", "invalid", "abort"], weights=[88, 6, 6])[0]
                side = rng.choice([8, 16, 24, 32])
                steps, n = rng.choice([1, 2]), rng.choice([1, 1, 2])
                body = {
                    "prompt": f"soak {i}",
                    "size": f"{side}x{side}",
                    "num_inference_steps": steps,
                    "seed": i,
                    "n": n,
                }
                if kind == "invalid":
                    body["size"] = f"{side + 3}x{side}"
                    r = http.post("/v1/images/generations", json=body)
                    ok = r.status_code == 400 and r.json()["error"]["param"] == "size"  # the field it sent
                    key = "invalid"
                elif kind == "abort":
                    rid = f"soak-{i}"
                    body.update(request_id=rid, num_inference_steps=30, size="32x32")
                    with cf.ThreadPoolExecutor(1) as pool:
                        fut = pool.submit(http_post, base_url, body)
                        time.sleep(rng.uniform(0.0, 0.3))
                        http.post(f"/v1/requests/{rid}/abort")
                        r = fut.result(60)
                    ok = r is not None and r.status_code in (200, 499)
                    key = "aborted" if r is not None and r.status_code == 499 else "abort_too_late"
                else:
                    r = http.post("/v1/images/generations", json=body)
                    ok = r.status_code == 200 and len(r.json()["data"]) == body["n"]
                    key = "ok"
                with lock:
                    if i == TOTAL // 2:
                        half.set()
                    if ok:
                        counts[key] += 1
                    else:
                        unexpected.append(
                            (kind, getattr(r, "status_code", None), getattr(r, "text", "")[:200])
                        )

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, args=(c,), daemon=True) for c in range(CLIENTS)]
    for t in threads:
        t.start()
    half.wait(600)
    rss.append(client.get("/v1/status").json()["replicas"][0]["rss_mb"])
    for t in threads:
        t.join(900)
        assert not t.is_alive(), "a soak client hung"
    elapsed = time.monotonic() - t0
    rss.append(client.get("/v1/status").json()["replicas"][0]["rss_mb"])
    print(f"\nsoak: {TOTAL} requests in {elapsed:.0f}s ({TOTAL / elapsed:.0f}/s): {counts}; "
          f"{len(unexpected)} unexpected; replica RSS start/half/end "
          f"{rss[0]:.0f}/{rss[1]:.0f}/{rss[2]:.0f} MB")  # fmt: skip
    assert not unexpected, unexpected[:5]
    assert sum(counts.values()) == TOTAL
    # Flat: the first half may warm allocator caches up; the second half must not keep growing.
    assert rss[2] - rss[0] < 150, f"replica RSS grew {rss[2] - rss[0]:.0f} MB"
    assert rss[2] - rss[1] < 50, f"replica RSS grew {rss[2] - rss[1]:.0f} MB in the second half"


def http_post(base_url: str, body: dict) -> httpx.Response:
    return httpx.post(base_url + "/v1/images/generations", json=body, headers=KEY, timeout=60)
