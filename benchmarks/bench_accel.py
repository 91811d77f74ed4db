"""The optional accelerations of `model.optimizations`, each against the plain engine, in one run.

    python benchmarks/bench_accel.py                                      # CPU, embedded model
    python benchmarks/bench_accel.py --model builtin:sd15-arch --device cuda --size 512 --steps 20 --batch 8

Each variant builds its own engine in this process and times `engine.run` on the same batch;
variants alternate in rounds so that drift in the machine's load hits them alike.
`compile_denoiser` is timed after its compilation (reported separately).
"""

from __future__ import annotations

import statistics
import time

from common import parser, write_json

VARIANTS = {
    "baseline": {},
    "channels_last": {"channels_last": True},
    "vae_slicing": {"vae_slicing": True},
    "vae_tiling": {"vae_tiling": True},
    "attention_native": {"attention_backend": "native"},
    "compile_denoiser": {"compile_denoiser": True},
    "int8_weight_only": {"quantize": "int8_weight_only"},
    "int8_dynamic": {"quantize": "int8_dynamic"},
}
GPU_VARIANTS = {"float8_weight_only": {"quantize": "float8_weight_only"}}  # with --device cuda


def main() -> None:
    ap = parser(__doc__, size=64, steps=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", nargs="+")
    ap.add_argument("--out", default="benchmarks/results/accel.json")
    a = ap.parse_args()
    variants = {**VARIANTS, **GPU_VARIANTS} if a.device == "cuda" else VARIANTS
    a.variants = a.variants or list(variants)

    from serve_app.config import ModelConfig, Optimizations
    from serve_app.engine import CallParams, DiffusionEngine, Row

    rows = [Row(f"a photograph number {i}", None, i) for i in range(a.batch)]
    params = CallParams(height=a.size, width=a.size, steps=a.steps, guidance_scale=7.5)
    engines, build_s = {}, {}
    for name in a.variants:
        t = time.perf_counter()
        cfg = ModelConfig(source=a.model, device=a.device, optimizations=Optimizations(**variants[name]))
        engines[name] = DiffusionEngine(cfg)
        engines[name].run(rows, params)  # compile / warm at this shape
        build_s[name] = round(time.perf_counter() - t, 2)
    times = {n: [] for n in engines}
    peak = {n: 0.0 for n in engines}
    for _ in range(a.rounds):
        for name, e in engines.items():
            t = time.perf_counter()
            out = e.run(rows, params)
            times[name].append((time.perf_counter() - t) * 1e3)
            peak[name] = max(peak[name], out.peak_memory_mb)
    base = statistics.median(times["baseline"]) if "baseline" in times else None
    res = {
        "model": a.model,
        "device": a.device,
        "size": a.size,
        "steps": a.steps,
        "batch": a.batch,
        "variants": {},
    }
    print(f"\n{a.model} on {a.device}, batch {a.batch} at {a.size}x{a.size}, {a.steps} steps")
    print(f"{'variant':<18}{'p50 ms':>10}{'vs base':>9}{'build+warm s':>14}{'peak MB':>10}")
    for name, ts in times.items():
        p50 = statistics.median(ts)
        ratio = round(base / p50, 3) if base else None
        res["variants"][name] = {
            "p50_ms": round(p50, 1),
            "speedup_vs_baseline": ratio,
            "build_warm_s": build_s[name],
            "peak_memory_mb": round(peak[name], 1),
        }
        print(f"{name:<18}{p50:>10.1f}{ratio:>9}{build_s[name]:>14}{peak[name]:>10.1f}")
    write_json(res, a.out)


if __name__ == "__main__":
    main()
