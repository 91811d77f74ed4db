"""`model.optimizations.speed: max` (the fast path) against the eager raw pipeline, in one run.

    python benchmarks/bench_fast.py                                   # CPU, embedded model
    python benchmarks/bench_fast.py --model builtin:sd15-arch --device cuda --size 512 --steps 20 --batch 16
    python benchmarks/bench_fast.py --model builtin:flux-arch --device cuda --size 1024 --steps 4 --batch 1

Every figure is a ratio measured in this run, printed with its goal (issue 54):
- `steps_per_s` at batch 1 and at `--batch`: the fast engine's against the eager engine's (same
  rows, same seeds; PSNR of the fast images against the eager ones);
- `first_call_vs_next`: the fast engine's first call after its warm-up against the next ones
  (the warm-up compiled the shapes before traffic);
- `warm_cached_vs_cold`: the warm-up in a new process that finds the compile cache of this one,
  with an empty inductor cache of its own, against this one's (cold);
- `served_vs_raw_fast`: one HTTP client of an app on the fast path against the raw fast engine
  (skip with --no-http).
On a GPU of compute capability 8.9+ a transformer runs float8 on the fast path (status printed).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from common import parser, start_app, stop_app, write_json


def _engine(a, fast: bool, cache: str | None):
    from serve_app.config import ModelConfig
    from serve_app.engine import DiffusionEngine

    model = {"source": a.model, "device": a.device, "default_height": a.size, "default_width": a.size}
    if fast:
        model.update(
            optimizations={"speed": "max", "compile_cache": cache}, warmup_batches=sorted({1, a.batch})
        )
    return DiffusionEngine(ModelConfig(**model, warmup=fast, warmup_steps=2))


def _psnr(a, b) -> float:
    import numpy as np

    x, y = (np.asarray(i, dtype=np.float64) for i in (a, b))
    mse = float(((x - y) ** 2).mean())
    return 99.0 if mse == 0 else round(10 * float(np.log10(255**2 / mse)), 1)


def _timed(engine, rows, params, rounds: int) -> tuple[float, list]:
    times, images = [], None
    for _ in range(rounds):
        t = time.perf_counter()
        images = engine.run(rows, params).images
        times.append(time.perf_counter() - t)
    return statistics.median(times), images


def main() -> None:
    ap = parser(__doc__, size=64, steps=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-http", action="store_true")
    ap.add_argument("--child-warm", help=argparse_hidden())
    ap.add_argument("--out", default="benchmarks/results/fast.json")
    a = ap.parse_args()
    if a.child_warm:  # the cached start: print this process's warm-up
        print(json.dumps(_engine(a, True, a.child_warm).fast.status()))
        return

    from serve_app.engine import CallParams, Row

    cache = tempfile.mkdtemp(prefix="compiled-")
    t = time.perf_counter()
    fast = _engine(a, True, cache)
    build_s = time.perf_counter() - t
    status = fast.fast.status()
    eager = _engine(a, False, None)
    res: dict = {"model": a.model, "device": a.device, "size": a.size, "steps": a.steps, "fast_path": status}
    params = CallParams(height=a.size, width=a.size, steps=a.steps, guidance_scale=7.5)
    first = None
    for batch in sorted({1, a.batch}):
        rows = [Row(f"a photograph number {i}", None, i) for i in range(batch)]
        if first is None:
            t = time.perf_counter()
            fast.run(rows, params)
            first = time.perf_counter() - t
            next_s, _ = _timed(fast, rows, params, a.rounds)
            res["first_call_vs_next"] = round(first / next_s, 3)
        eager.run(rows, params)
        t_fast, im_fast = _timed(fast, rows, params, a.rounds)
        t_eager, im_eager = _timed(eager, rows, params, a.rounds)
        res[f"batch{batch}"] = {
            "eager_steps_per_s": round(a.steps / t_eager, 2),
            "fast_steps_per_s": round(a.steps / t_fast, 2),
            "fast_vs_eager": round(t_eager / t_fast, 3),
            "psnr_db": min(_psnr(x, y) for x, y in zip(im_fast, im_eager, strict=True)),
        }
    child = subprocess.run(
        [sys.executable, __file__, "--child-warm", cache, "--model", a.model, "--device", a.device,
         "--size", str(a.size), "--batch", str(a.batch)],
        capture_output=True, text=True, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp()},
    )  # fmt: skip
    cached = json.loads(child.stdout.strip().splitlines()[-1]) if child.returncode == 0 else None
    res["warm_cold_s"] = status["warm_s"]
    res["warm_cached_s"] = cached["warm_s"] if cached else None
    res["warm_cached_vs_cold"] = round(cached["warm_s"] / status["warm_s"], 3) if cached else None
    res["build_s"] = round(build_s, 1)
    if not a.no_http:
        res["served_vs_raw_fast"] = _served(a, fast, cache, params)

    print(f"\n{a.model} on {a.device}, {a.size}x{a.size}, {a.steps} steps; fast path: {status['mode']}, "
          f"float8 {status['quantize']}, attention {status['attention_backend']}")  # fmt: skip
    for batch in sorted({1, a.batch}):
        b = res[f"batch{batch}"]
        print(f"batch {batch:>2}: eager {b['eager_steps_per_s']:>8} steps/s  fast {b['fast_steps_per_s']:>8}"
              f" steps/s  fast/eager {b['fast_vs_eager']}x (goal: batch 1 >= 3, batch 16 >= 1.5 on an H200)"
              f"  PSNR {b['psnr_db']} dB (goal >= 35 CPU, 30 fp8)")  # fmt: skip
    print(f"first call / next: {res['first_call_vs_next']} (goal <= 1.5)")
    print(
        f"warm-up cold {res['warm_cold_s']} s, cached {res['warm_cached_s']} s: {res['warm_cached_vs_cold']}"
    )
    if "served_vs_raw_fast" in res:
        print(f"one HTTP client / raw fast path: {res['served_vs_raw_fast']} (goal <= 1.05)")
    write_json(res, a.out)


def _served(a, fast, cache: str, params) -> float:
    """One client's p50 over HTTP on an app on the fast path, against the raw fast engine's."""
    import httpx

    from serve_app.engine import Row

    model = {"source": a.model, "device": a.device, "default_height": a.size, "default_width": a.size,
             "default_steps": a.steps, "default_guidance_scale": 7.5, "warmup_batches": [1],
             "optimizations": {"speed": "max", "compile_cache": cache}}  # fmt: skip
    args = {"model": model, "replica": {"num_gpus": 1 if a.device == "cuda" else 0, "num_cpus": 0},
            "ingress": {"num_cpus": 0}, "batching": {"max_batch_images": 1}}  # fmt: skip
    port = 8771
    start_app(args, a.device, port)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as http:
            body = {"prompt": "a photograph number 0", "seed": 0, "response_format": "b64_json"}
            served, raw = [], []
            http.post("/v1/images/generations", json=body).raise_for_status()
            for _ in range(a.rounds):  # interleaved: drift in the machine's load hits both alike
                t = time.perf_counter()
                http.post("/v1/images/generations", json=body).raise_for_status()
                served.append(time.perf_counter() - t)
                t = time.perf_counter()
                fast.run([Row("a photograph number 0", None, 0)], params)
                raw.append(time.perf_counter() - t)
    finally:
        stop_app()
    return round(statistics.median(served) / statistics.median(raw), 3)


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
