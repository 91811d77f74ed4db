"""Step-level joining against whole-call batching under open-loop Poisson arrivals, in one run.

    python benchmarks/bench_joining.py                        # CPU, embedded model, 64 px, 20 steps
    python benchmarks/bench_joining.py --model builtin:sd15-arch --device cuda --size 512 --steps 20

One replica driven in this process (the scheduling under test lives in the replica; Serve's
hops add the same to both modes). First the raw pipeline at batch `--batch` (the reference the
ratios are stated in) and the replica's capacity: images/s with whole-call batching when
`3 x batch` requests arrive at once. Then, at 50%, 70% and 90% of that capacity, the same seeded
Poisson arrival times sent to whole-call batching and to step-level joining: p50 and p95
latency (arrival to answer), throughput, and the mean number of requests each ran with.
Prints the goal (p95 at 70% load <= 0.6x whole-call, throughput not lower) and writes JSON.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time

from common import parser, pct, write_json

from serve_app.replica import DiffusionReplica
from serve_app.schemas import GenerationRequest, PreparedRequest

PROMPT = "a red circle on a blue background"


def prepared(rid: str, seed: int, args) -> PreparedRequest:
    return PreparedRequest.from_request(
        GenerationRequest(prompt=PROMPT, request_id=rid, seed=seed),
        request_id=rid,
        seed=seed,
        height=args.size,
        width=args.size,
        steps=args.steps,
        guidance_scale=7.5,
    )


def raw_images_per_s(replica: DiffusionReplica, args) -> float:
    """The pipeline alone, one call of `--batch` images (after one call to warm up)."""
    from serve_app.engine import CallParams, Row

    engine = replica.engine
    params = CallParams(height=args.size, width=args.size, steps=args.steps, guidance_scale=7.5)
    rows = [Row(PROMPT, None, k) for k in range(args.batch)]
    engine.run(rows, params)
    t = time.perf_counter()
    engine.run(rows, params)
    return args.batch / (time.perf_counter() - t)


async def send(replica: DiffusionReplica, arrivals: list[float], args, tag: str) -> dict:
    """Send one request at each arrival time (seconds from now); latencies and throughput."""
    t0 = time.perf_counter()
    lat, together = [], []

    async def one(k: int, at: float) -> None:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        sent = time.perf_counter()
        result = await replica.generate(prepared(f"{tag}-{k}", k, args))
        lat.append(time.perf_counter() - sent)
        together.append(result.metrics.batch_requests)

    await asyncio.gather(*(one(k, at) for k, at in enumerate(arrivals)))
    span = time.perf_counter() - t0
    return {
        "p50_s": pct(lat, 50),
        "p95_s": pct(lat, 95),
        "images_per_s": len(arrivals) / span,
        "mean_requests_together": statistics.mean(together),
    }


async def main_async(args) -> dict:
    replica = DiffusionReplica(
        {"source": args.model, "device": args.device, "default_height": args.size,
         "default_width": args.size, "default_steps": args.steps},
        {"max_batch_images": args.batch},
    )  # fmt: skip
    raw = raw_images_per_s(replica, args)
    replica.reconfigure({"step_joining": False})
    burst = await send(replica, [0.0] * (3 * args.batch), args, "capacity")
    capacity = burst["images_per_s"]
    print(f"raw pipeline batch {args.batch}: {raw:.2f} images/s; replica capacity: {capacity:.2f} images/s")
    res = {"raw_images_per_s": raw, "capacity_images_per_s": capacity, "loads": {}}
    print(f"{'load':>5} {'mode':>7} {'p50 s':>7} {'p95 s':>7} {'img/s':>7} {'together':>8}")
    for load in args.loads:
        rng = random.Random(args.seed + int(load * 100))
        rate = load * capacity
        arrivals, t = [], 0.0
        for _ in range(args.requests):
            t += rng.expovariate(rate)
            arrivals.append(t)
        row = {}
        for mode in ("static", "joined"):
            replica.reconfigure({"step_joining": mode == "joined"})
            row[mode] = await send(replica, arrivals, args, f"{mode}-{load}")
            r = row[mode]
            print(f"{load:>5.0%} {mode:>7} {r['p50_s']:>7.2f} {r['p95_s']:>7.2f} "
                  f"{r['images_per_s']:>7.2f} {r['mean_requests_together']:>8.2f}")  # fmt: skip
        row["p95_joined_vs_static"] = row["joined"]["p95_s"] / row["static"]["p95_s"]
        row["p50_joined_vs_static"] = row["joined"]["p50_s"] / row["static"]["p50_s"]
        row["throughput_joined_vs_static"] = row["joined"]["images_per_s"] / row["static"]["images_per_s"]
        res["loads"][f"{load:g}"] = row
        p50, p95 = row["p50_joined_vs_static"], row["p95_joined_vs_static"]
        print(f"      joined/static: p50 {p50:.2f}, p95 {p95:.2f}, "
              f"throughput {row['throughput_joined_vs_static']:.2f}")  # fmt: skip
    at70 = res["loads"].get("0.7")
    if at70 is not None:
        met = at70["p95_joined_vs_static"] <= 0.6 and at70["throughput_joined_vs_static"] >= 0.95
        print(f"goal at 70% load: p95 <= 0.6x static and throughput not lower: {'met' if met else 'MISSED'}")
        res["goal_met"] = met
    res["settings"] = vars(args)
    return res


def main() -> None:
    ap = parser(__doc__, size=64, steps=20)
    ap.add_argument("--batch", type=int, default=8, help="max_batch_images, and the raw reference batch")
    ap.add_argument("--requests", type=int, default=40, help="arrivals per load and mode")
    ap.add_argument("--loads", type=float, nargs="+", default=[0.5, 0.7, 0.9])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/joining.json")
    args = ap.parse_args()
    write_json(asyncio.run(main_async(args)), args.out)


if __name__ == "__main__":
    main()
