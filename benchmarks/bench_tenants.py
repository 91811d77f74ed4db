"""Fair sharing between tenants, in one run: a lone request's latency under another tenant's
flood, and what the fair queue costs in throughput.

    python benchmarks/bench_tenants.py                                       # CPU, embedded model
    python benchmarks/bench_tenants.py --model builtin:sd15-arch --device cuda --size 512 --steps 20

One replica, two tenants by API key. Tenant A keeps `--flood` requests in flight (24); tenant
B sends one request at a time. Printed: B's median latency under A's flood over B's median
latency alone (goal: at most 2x; first-come order makes it wait for A's whole backlog), and the
images per second of A and B together under the flood over A's alone (goal: at least 0.95x).
The same flood with B's key in A's tenant (one tenant: first come, as before tenants) is the
baseline. On CPU a call's time grows with its rows, so B's image, which shares an 8-row call,
takes a batch-8 call's time: `--batch` shows how the ratio follows the call size.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from common import parser, start_app, stop_app, write_json  # noqa: E402

KEY_A, KEY_B, KEY_B_IN_A = "bench-tenant-a", "bench-tenant-b", "bench-tenant-b-in-a"


async def run(url: str, body: dict, flood: int, lone: bool, seconds: float, b_key: str = KEY_B) -> dict:
    """A's `flood` closed-loop clients (0: none) and, with `lone`, B's one client, for `seconds`;
    B sends `b_key` (KEY_B_IN_A: as a member of A's tenant, which is first-come order)."""
    import httpx

    done = {"a": 0, "b": 0}
    b_ms: list[float] = []
    end = time.perf_counter() + seconds

    async def client(http, key: str, who: str) -> None:
        while time.perf_counter() < end:
            t = time.perf_counter()
            auth = {"Authorization": f"Bearer {key}"}
            r = await http.post("/v1/images/generations", json=body, headers=auth)
            r.raise_for_status()
            done[who] += 1
            if who == "b":
                b_ms.append((time.perf_counter() - t) * 1e3)

    limits = httpx.Limits(max_connections=flood + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        t = time.perf_counter()
        jobs = [client(http, KEY_A, "a") for _ in range(flood)] + ([client(http, b_key, "b")] if lone else [])
        await asyncio.gather(*jobs)
        wall = time.perf_counter() - t
    return {"images_per_s": (done["a"] + done["b"]) / wall, "b_ms": b_ms}


def main() -> None:
    ap = parser(__doc__, size=64, steps=4)
    ap.add_argument("--flood", type=int, default=24)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--batch", type=int, default=8, help="batching.max_batch_images")
    ap.add_argument("--out", default="benchmarks/results/tenants.json")
    a = ap.parse_args()

    args = {
        "model": {"source": a.model, "device": a.device, "default_height": a.size, "default_width": a.size,
                  "default_steps": a.steps},
        "limits": {"max_side": max(2048, a.size), "max_pixels": max(a.size * a.size, 1 << 20)},
        "replica": {"num_gpus": 1 if a.device == "cuda" else 0, "num_cpus": 0, "max_ongoing_requests": 64},
        "ingress": {"num_cpus": 0},
        "batching": {"max_batch_images": a.batch},
        "tenants": [{"name": "a", "api_keys": [KEY_A, KEY_B_IN_A]}, {"name": "b", "api_keys": [KEY_B]}],
    }  # fmt: skip
    port = 8773
    start_app(args, a.device, port)
    url = f"http://127.0.0.1:{port}"
    body = {"prompt": "a lighthouse"}
    asyncio.run(run(url, body, 0, True, 3.0))  # warm
    alone_b = asyncio.run(run(url, body, 0, True, a.seconds / 2))
    alone_a = asyncio.run(run(url, body, a.flood, False, a.seconds))
    both = asyncio.run(run(url, body, a.flood, True, a.seconds))
    fifo = asyncio.run(run(url, body, a.flood, True, a.seconds, KEY_B_IN_A))  # one tenant: first come
    stop_app()

    b_alone, b_flood = statistics.median(alone_b["b_ms"]), statistics.median(both["b_ms"])
    b_fifo = statistics.median(fifo["b_ms"])
    res = {
        "model": a.model, "device": a.device, "size": a.size, "steps": a.steps, "flood": a.flood,
        "max_batch_images": a.batch,
        "b_alone_p50_ms": round(b_alone, 1),
        "b_under_flood_p50_ms": round(b_flood, 1),
        "b_under_flood_vs_alone": round(b_flood / b_alone, 2),
        "b_requests_under_flood": len(both["b_ms"]),
        "b_in_a_tenant_under_flood_p50_ms": round(b_fifo, 1),
        "b_first_come_vs_alone": round(b_fifo / b_alone, 2),
        "fair_vs_first_come": round(b_flood / b_fifo, 3),
        "a_alone_images_per_s": round(alone_a["images_per_s"], 3),
        "a_and_b_images_per_s": round(both["images_per_s"], 3),
        "throughput_vs_a_alone": round(both["images_per_s"] / alone_a["images_per_s"], 3),
    }  # fmt: skip
    print(f"\n{a.model} on {a.device}, {a.size}x{a.size}, {a.steps} steps, A floods with {a.flood}")
    for k, v in res.items():
        print(f"  {k}: {v}")
    write_json(res, a.out)


if __name__ == "__main__":
    main()
