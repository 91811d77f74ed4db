"""An interactive image's latency under a flood of long batch calls, against its latency alone.

    python benchmarks/bench_priority.py                       # CPU: the real tiny pipeline, then GPU-shaped
    python benchmarks/bench_priority.py --engines gpu-shaped --step-ms 20 --row-ms 0.75

One replica, driven directly (as Serve would call it; no HTTP): `--flooders` clients send batch
requests (`priority: batch`, `--batch-images` images of `--batch-steps` steps) back to back
while one client sends interactive requests (one image of `--steps` steps) one at a time, at
random moments of the batch calls. Measured for preemption at once (`preempt_after_ms: 0`), at
the configuration's default budget, and off; each is the ratio of the interactive latency's p50
and p95 to its p50 alone (the issue's goal: at most 1.5x). `cpu` is the real tiny pipeline in
whole calls (a fuller call costs more); `gpu-shaped` the `serve_app.testing:GpuShaped` engine
(each step sleeps `step_ms + row_ms * rows`, as on a GPU) with step-level joining, a GPU's
default (a full run parks a batch seat); `gpu-shaped-whole` the same in whole calls (the call
pauses). Writes JSON (`--out`).
"""

from __future__ import annotations

import asyncio
import random
import time
import zlib

from common import parser, pct, write_json


def _replica(engine: str, a, budget_ms):
    from serve_app.replica import DiffusionReplica

    model = {"source": a.model, "device": a.device, "default_height": a.size, "default_width": a.size,
             "default_steps": a.steps, "warmup": False}  # fmt: skip
    if engine.startswith("gpu-shaped"):
        import os

        os.environ["DIFFUSION_SERVE_GPU_SHAPE"] = f"{a.step_ms},{a.row_ms}"
        model["engine_extension"] = "serve_app.testing:GpuShaped"
    return DiffusionReplica(model, _batching(engine, a, budget_ms))


def _batching(engine: str, a, budget_ms) -> dict:
    """Whole calls on the CPU and for `gpu-shaped-whole`; joined runs (a GPU's default) for `gpu-shaped`."""
    joined = engine == "gpu-shaped"
    return {"max_batch_images": a.batch_images, "batch_wait_ms": 0, "preempt_after_ms": budget_ms,
            "step_joining": joined}  # fmt: skip


def _request(rid: str, priority: int, images: int, steps: int, a):
    from serve_app.schemas import GenerationRequest, PreparedRequest

    body = GenerationRequest(prompt=f"a red circle {rid}", num_images=images, num_inference_steps=steps)
    seed = zlib.crc32(rid.encode()) % 10_000
    return PreparedRequest.from_request(
        body, request_id=rid, seed=seed, height=a.size, width=a.size, steps=steps, guidance_scale=7.5,
        priority=priority,
    )  # fmt: skip


async def _latencies(replica, a, flood: bool, tag: str) -> list[float]:
    """Interactive latencies (s), with the flood running or not."""
    stop = asyncio.Event()

    async def flooder(k: int) -> None:
        i = 0
        while not stop.is_set():
            await replica.generate(_request(f"{tag}-f{k}-{i}", 0, a.batch_images, a.batch_steps, a))
            i += 1

    flooders = [asyncio.ensure_future(flooder(k)) for k in range(a.flooders if flood else 0)]
    rng = random.Random(7)
    await asyncio.sleep(0.5 if flood else 0)
    out = []
    for j in range(a.iters + 1):  # the first warms up
        await asyncio.sleep(rng.uniform(0.0, a.spread_s))  # a random moment of a batch call
        t = time.perf_counter()
        await replica.generate(_request(f"{tag}-i{j}", 5, 1, a.steps, a))
        if j:
            out.append(time.perf_counter() - t)
    stop.set()
    await asyncio.gather(*flooders)
    return out


def _run_engine(engine: str, a) -> dict:
    from serve_app.config import BatchingConfig

    default_ms = BatchingConfig().preempt_after_ms
    loop = asyncio.new_event_loop()
    replica = _replica(engine, a, 0.0)
    res: dict = {}
    try:
        alone = loop.run_until_complete(_latencies(replica, a, False, "alone"))
        base = pct(alone, 50)
        res["alone"] = {"p50_ms": round(base * 1e3, 1), "p95_ms": round(pct(alone, 95) * 1e3, 1)}
        for name, budget in (("at_once", 0.0), (f"default_{default_ms:g}ms", default_ms), ("off", None)):
            replica.reconfigure(_batching(engine, a, budget))
            before = replica.stats().counts.get("preemptions", 0)
            xs = loop.run_until_complete(_latencies(replica, a, True, name))
            res[name] = {
                "p50_ms": round(pct(xs, 50) * 1e3, 1),
                "p95_ms": round(pct(xs, 95) * 1e3, 1),
                "p50_vs_alone": round(pct(xs, 50) / base, 2),
                "p95_vs_alone": round(pct(xs, 95) / base, 2),
                "preemptions": replica.stats().counts.get("preemptions", 0) - before,
            }
    finally:
        if replica._loop_task is not None:
            replica._loop_task.cancel()
            loop.run_until_complete(asyncio.gather(replica._loop_task, return_exceptions=True))
        loop.close()
    return res


def main() -> None:
    ap = parser(__doc__, size=64, steps=20)
    engines = ["cpu", "gpu-shaped", "gpu-shaped-whole"]
    ap.add_argument("--engines", nargs="+", default=engines, choices=engines)
    ap.add_argument("--batch-images", type=int, default=4)
    ap.add_argument("--batch-steps", type=int, default=60)
    ap.add_argument("--flooders", type=int, default=3)
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--spread-s", type=float, default=0.3, help="a random pause before each interactive one")
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument("--row-ms", type=float, default=0.75)
    ap.add_argument("--out", default="benchmarks/results/priority.json")
    a = ap.parse_args()
    res = {"model": a.model, "device": a.device, "size": a.size, "steps": a.steps,
           "batch": f"{a.flooders} clients x {a.batch_images} images x {a.batch_steps} steps"}  # fmt: skip
    for engine in a.engines:
        res[engine] = r = _run_engine(engine, a)
        print(f"{engine}: interactive alone p50 {r['alone']['p50_ms']} ms; under {res['batch']}:")
        for name, v in r.items():
            if name != "alone":
                print(f"  {name}: p50 {v['p50_vs_alone']}x, p95 {v['p95_vs_alone']}x alone "
                      f"({v['preemptions']} preemptions)")  # fmt: skip
    print("goal: an interactive image under the flood <= 1.5x alone")
    write_json(res, a.out)


if __name__ == "__main__":
    main()
