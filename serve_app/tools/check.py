"""Check a model before deploying it: load it, make one image (or video) at its native size with
a fixed seed, and report the load time, the time per denoising step and the peak memory.

    python -m serve_app.check --model stabilityai/stable-diffusion-xl-base-1.0
    python -m serve_app.check --model /models/flux-schnell --steps 4 --guidance-scale 0
    python -m serve_app.check --model builtin:tiny-wan --out boat.mp4

No Ray: the engine alone, as a replica would run it. Exit status 0 when the model made its
output, 2 when it cannot be loaded or run (the message says why).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def check(args: argparse.Namespace) -> dict:
    from serve_app.config import ModelConfig
    from serve_app.engine import CallParams, DiffusionEngine, Row
    from serve_app.engine.media import encode_output

    cfg = ModelConfig(
        source=args.model,
        device=args.device,
        dtype=args.dtype,
        default_height=args.height,
        default_width=args.width,
        default_steps=args.steps,
        default_guidance_scale=args.guidance_scale,
        local_files_only=args.local_files_only,
        warmup=False,
    )
    t0 = time.perf_counter()
    engine = DiffusionEngine(cfg)
    load_s = time.perf_counter() - t0
    params = CallParams(
        height=engine.default_height,
        width=engine.default_width,
        steps=cfg.default_steps,
        guidance_scale=cfg.default_guidance_scale,
    )
    t = time.perf_counter()
    out = engine.run([Row(args.prompt, None, args.seed)], params)
    run_s = time.perf_counter() - t
    video = engine.video
    fmt = "mp4" if video else "png"
    path = Path(args.out or f"check.{fmt}")
    fmt = path.suffix.lstrip(".").lower().replace("jpg", "jpeg") or fmt
    path.write_bytes(encode_output(out.images[0], fmt, cfg.default_fps))
    d = engine.describe()
    timings = out.timings_ms
    return {
        "model": args.model,
        "pipeline": d["pipeline"],
        "family": d["family"],
        "modality": d["modality"],
        "device": d["device"],
        "dtype": d["dtype"],
        "size": f"{params.width}x{params.height}",
        "frames": len(out.images[0]) if video else None,
        "steps": params.steps,
        "seed": args.seed,
        "load_s": round(load_s, 3),
        "run_s": round(run_s, 3),
        "step_ms": round(timings["denoise_ms"] / max(1, out.steps_run), 2),
        "text_encode_ms": round(timings["text_encode_ms"], 2),
        "vae_decode_ms": round(timings["vae_decode_ms"], 2),
        "peak_memory_mb": round(out.peak_memory_mb, 1),
        "peak_memory_kind": out.memory_kind,
        "output": str(path),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serve_app.check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="builtin:<name>, a local diffusers directory or a hub id")
    ap.add_argument("--prompt", default="a lighthouse on a cliff at dusk, photograph")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--guidance-scale", type=float, default=7.5)
    ap.add_argument("--height", type=int, default=None, help="default: the model's native size")
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default="auto")
    ap.add_argument("--local-files-only", action="store_true", help="never download")
    ap.add_argument("--out", help="where to write the output (default: check.png, or check.mp4 for video)")
    ap.add_argument("--json", action="store_true", help="print the report as one JSON object")
    args = ap.parse_args(argv)
    try:
        report = check(args)
    except Exception as e:  # load and run failures alike: say what and why, no traceback
        print(f"check failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report))
    else:
        width = max(len(k) for k in report)
        for k, v in report.items():
            if v is not None:
                print(f"{k:<{width}}  {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
