"""The result cache: a hit's latency against a miss's, over HTTP, in one run.

    python benchmarks/bench_result_cache.py                               # CPU, embedded model
    python benchmarks/bench_result_cache.py --model builtin:sd15-arch --device cuda --size 512 --steps 20

`--iters` distinct seeded requests, each sent twice in a row: the first makes its image (a miss),
the second is answered from the ingress's cache (a hit). Prints each one's p50/p95 and the
ratio of the p50s (the issue's goal: a hit at most 0.05x a miss), and writes JSON (`--out`).
"""

from __future__ import annotations

from common import parser, pct, start_app, stop_app, write_json


def main() -> None:
    ap = parser(__doc__, size=64, steps=8)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--out", default="benchmarks/results/result_cache.json")
    a = ap.parse_args()

    import time

    import httpx

    model = {"source": a.model, "device": a.device, "default_height": a.size, "default_width": a.size,
             "default_steps": a.steps}  # fmt: skip
    args = {"model": model, "replica": {"num_cpus": 0}, "ingress": {"num_cpus": 0},
            "result_cache": {"enabled": True}}  # fmt: skip
    start_app(args, a.device, a.port)
    ms: dict[str, list[float]] = {"miss": [], "hit": []}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{a.port}", timeout=600) as client:
            for k in range(a.iters + 1):  # the first pair warms up
                body = {"prompt": "a red circle on a blue background", "seed": 1000 + k}
                for expect in ("miss", "hit"):
                    t = time.perf_counter()
                    r = client.post("/v1/images/generations", json=body)
                    took = (time.perf_counter() - t) * 1e3
                    assert r.status_code == 200 and r.headers.get("x-cache") == expect, (
                        r.status_code,
                        r.text[:200],
                    )
                    if k:
                        ms[expect].append(took)
    finally:
        stop_app()
    res = {"model": a.model, "device": a.device, "size": a.size, "steps": a.steps, "iters": a.iters}
    for kind, xs in ms.items():
        res[kind] = {"p50_ms": round(pct(xs, 50), 2), "p95_ms": round(pct(xs, 95), 2)}
    res["hit_vs_miss_p50"] = round(res["hit"]["p50_ms"] / res["miss"]["p50_ms"], 4)
    print(f"{a.model}, {a.size} px, {a.steps} steps, {a.iters} pairs over HTTP")
    for kind in ("miss", "hit"):
        print(f"  {kind}: p50 {res[kind]['p50_ms']} ms, p95 {res[kind]['p95_ms']} ms")
    print(f"  hit_vs_miss_p50: {res['hit_vs_miss_p50']} (goal <= 0.05)")
    write_json(res, a.out)


if __name__ == "__main__":
    main()
