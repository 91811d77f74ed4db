"""Serving overhead, in one run: the raw pipeline in-process, the engine, the handle, and HTTP.

    python benchmarks/bench_latency.py                                   # CPU, embedded model
    python benchmarks/bench_latency.py --model builtin:sd15-arch --device cuda --size 512 --steps 20

Each path makes the same single image (same prompt, size, steps, seed) `--iters` times, one
request at a time. It prints p50/p95 per path, the ratio served/raw, and the overhead the
serving layer adds (served p50 minus raw p50) beside the floor of Ray Serve itself, measured
in the same run by an echo deployment. Writes the figures as JSON (`--out`).
"""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def timed(fn, iters: int, warm: int = 2) -> list[float]:
    for _ in range(warm):
        fn()
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def summary(ms: list[float]) -> dict:
    return {
        "p50_ms": round(pct(ms, 50), 2),
        "p95_ms": round(pct(ms, 95), 2),
        "mean_ms": round(statistics.mean(ms), 2),
    }


from common import parser, pct, start_app, stop_app, write_json  # noqa: E402


def main() -> None:
    ap = parser(__doc__, size=64, steps=4)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default="benchmarks/results/latency.json")
    a = ap.parse_args()

    import httpx
    import torch
    from ray import serve

    from serve_app.config import ModelConfig
    from serve_app.engine import CallParams, DiffusionEngine, Row, encode_image
    from serve_app.schemas import GenerationRequest

    model = {"source": a.model, "device": a.device, "default_height": a.size, "default_width": a.size}
    prompt, seed = "a photograph of an astronaut riding a horse", 1234
    res: dict = {"model": a.model, "device": a.device, "size": a.size, "steps": a.steps, "iters": a.iters}

    # Ray and Serve come up first, so that the raw pipeline in this process is timed on the same
    # machine state (Ray's own processes running) as the served paths.
    port = 8765
    args = {
        "model": {**model, "warmup": True},
        "limits": {"max_side": max(2048, a.size), "max_pixels": max(a.size * a.size, 1 << 20)},
        "replica": {"num_gpus": 1 if a.device == "cuda" else 0, "num_cpus": 0},
        "ingress": {"num_cpus": 0},
    }
    handle = start_app(args, a.device, port)

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Echo:
        async def __call__(self, request=None):
            return "ok"

        async def echo(self):
            return "ok"

    echo = serve.run(Echo.bind(), name="echo", route_prefix="/echo")

    # The raw diffusers call and the engine (the same call plus its hooks and PNG encoding), in this
    # process. On GPU the replica holds a second copy of the model; the two never run at once.
    engine = DiffusionEngine(ModelConfig(**model))
    pipe = engine.pipe
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)

    def raw():
        g = [torch.Generator(engine.device).manual_seed(seed)]
        pipe(prompt=[prompt], height=a.size, width=a.size, num_inference_steps=a.steps, generator=g)
        sync()

    params = CallParams(height=a.size, width=a.size, steps=a.steps, guidance_scale=7.5)
    req = GenerationRequest(
        prompt=prompt, seed=seed, height=a.size, width=a.size, num_inference_steps=a.steps
    )
    body = {"prompt": prompt, "seed": seed, "size": f"{a.size}x{a.size}", "num_inference_steps": a.steps}
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as http:

        def post():
            r = http.post("/v1/images/generations", json=body)
            r.raise_for_status()

        fns = {
            "raw_pipeline": raw,
            "engine": lambda: encode_image(engine.run([Row(prompt, None, seed)], params).images[0], "png"),
            "handle": lambda: handle.generate.remote(req).result(),
            "http": post,
        }
        for fn in fns.values():  # warm every path
            fn()
        # Rounds of 5 per path, interleaved, so that drift in the machine's load hits all paths alike.
        paths = {k: [] for k in fns}
        for _ in range(max(1, a.iters // 5)):
            for k, fn in fns.items():
                paths[k] += timed(fn, 5, warm=0)
        paths["echo_handle"] = timed(lambda: echo.echo.remote().result(), 100)
        paths["echo_http"] = timed(lambda: http.get("/echo").raise_for_status(), 100)
    stop_app()

    res["paths"] = {k: summary(v) for k, v in paths.items()}
    raw50 = res["paths"]["raw_pipeline"]["p50_ms"]
    res["ratios_p50"] = {k: round(res["paths"][k]["p50_ms"] / raw50, 3) for k in ("engine", "handle", "http")}
    res["overhead_p50_ms"] = {
        "handle": round(res["paths"]["handle"]["p50_ms"] - raw50, 2),
        "http": round(res["paths"]["http"]["p50_ms"] - raw50, 2),
        "floor_handle": res["paths"]["echo_handle"]["p50_ms"],
        "floor_http": res["paths"]["echo_http"]["p50_ms"],
    }

    print(f"\n{a.model} on {a.device}, {a.size}x{a.size}, {a.steps} steps, {a.iters} requests per path")
    print(f"{'path':<14}{'p50 ms':>10}{'p95 ms':>10}{'p50/raw':>10}")
    for k, v in res["paths"].items():
        ratio = f"{v['p50_ms'] / raw50:.3f}" if not k.startswith("echo") else ""
        print(f"{k:<14}{v['p50_ms']:>10.2f}{v['p95_ms']:>10.2f}{ratio:>10}")
    o = res["overhead_p50_ms"]
    print(f"served minus raw at p50: handle {o['handle']:+.2f} ms (floor {o['floor_handle']:.2f}), "
          f"http {o['http']:+.2f} ms (floor {o['floor_http']:.2f}); goal: floor + 3 ms")  # fmt: skip
    write_json(res, a.out)


if __name__ == "__main__":
    main()
