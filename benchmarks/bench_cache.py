"""Step caching (`acceleration`): speed and fidelity per level against the uncached image, one run.

    python benchmarks/bench_cache.py                                       # CPU, the twins
    python benchmarks/bench_cache.py --models builtin:flux-arch builtin:sdxl-arch --device cuda \
        --size 512 --steps 20

For each model: one engine; the same seeded batch at every level, levels alternating in rounds
so that drift in the machine's load hits them alike. Prints the median time, the speedup over
`none`, and the PSNR (dB) of each image against the uncached image of the same seed.
"""

from __future__ import annotations

import math
import statistics
import time

import numpy as np
from common import parser, write_json

LEVELS = ("none", "fast", "faster")


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def main() -> None:
    ap = parser(__doc__, size=64, steps=20)
    ap.add_argument(
        "--models", nargs="+", default=["builtin:tiny-sd3", "builtin:tiny-flux", "builtin:tiny-sd"]
    )
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/cache.json")
    a = ap.parse_args()

    from serve_app.config import ModelConfig
    from serve_app.engine import CallParams, DiffusionEngine, Row

    rows = [Row(f"a red circle number {i}", None, i) for i in range(a.batch)]
    res = {"device": a.device, "size": a.size, "steps": a.steps, "batch": a.batch, "models": {}}
    print(f"\nstep caching on {a.device}, batch {a.batch} at {a.size}x{a.size}, {a.steps} steps")
    print(f"{'model':<22}{'level':<8}{'p50 ms':>10}{'speedup':>9}{'PSNR dB (min)':>15}")
    for model in a.models:
        engine = DiffusionEngine(ModelConfig(source=model, device=a.device, warmup=False))
        params = {
            lv: CallParams(height=a.size, width=a.size, steps=a.steps, guidance_scale=4.0, acceleration=lv)
            for lv in LEVELS
        }
        images = {lv: engine.run(rows, p).images for lv, p in params.items()}  # warm, and the images
        times = {lv: [] for lv in LEVELS}
        for _ in range(a.rounds):
            for lv, p in params.items():
                t = time.perf_counter()
                engine.run(rows, p)
                times[lv].append((time.perf_counter() - t) * 1e3)
        base = statistics.median(times["none"])
        out = res["models"][model] = {}
        for lv in LEVELS:
            p50 = statistics.median(times[lv])
            worst = min(
                psnr(np.asarray(x), np.asarray(y)) for x, y in zip(images[lv], images["none"], strict=True)
            )
            out[lv] = {"p50_ms": round(p50, 1), "speedup": round(base / p50, 3), "psnr_db": round(worst, 2)}
            print(f"{model:<22}{lv:<8}{p50:>10.1f}{base / p50:>9.2f}{worst:>15.1f}")
        engine.close()
    write_json(res, a.out)


if __name__ == "__main__":
    main()
