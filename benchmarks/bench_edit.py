"""The extra cost of an edit over a generation of the same size and steps, in one run.

    python benchmarks/bench_edit.py                                    # CPU, embedded model
    python benchmarks/bench_edit.py --model builtin:sd15-arch --device cuda --size 512 --steps 20

Both go over HTTP to the same app: a generation, and an image-to-image edit at `strength` 1.0
(so that it runs every step too) of a PNG of the same size, sent as a multipart form as the
OpenAI client sends it. The raw diffusers calls (text-to-image and image-to-image) are timed in
this process for reference. Rounds of 5 per path, interleaved, so that drift hits all alike.
Prints p50 per path and the ratios edit/generation, served and raw.
"""

from __future__ import annotations

import io
import os
import statistics
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from common import parser, pct, start_app, stop_app, write_json  # noqa: E402


def main() -> None:
    ap = parser(__doc__, size=64, steps=4)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/results/edit.json")
    a = ap.parse_args()

    import httpx
    import numpy as np
    import torch
    from PIL import Image

    from serve_app.config import ModelConfig
    from serve_app.engine import DiffusionEngine

    port = 8766
    model = {"source": a.model, "device": a.device, "default_height": a.size, "default_width": a.size}
    args = {
        "model": {**model, "warmup": True},
        "limits": {"max_side": max(2048, a.size), "max_pixels": max(a.size * a.size, 1 << 20)},
        "replica": {"num_gpus": 1 if a.device == "cuda" else 0, "num_cpus": 0},
        "ingress": {"num_cpus": 0},
    }
    start_app(args, a.device, port)
    engine = DiffusionEngine(ModelConfig(**model, warmup=False))
    img2img = engine._task_pipes["img2img"]
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)

    rng = np.random.default_rng(0)
    picture = Image.fromarray(rng.integers(0, 255, (a.size, a.size, 3), dtype=np.uint8))
    buf = io.BytesIO()
    picture.save(buf, format="PNG")
    png = buf.getvalue()
    prompt, seed = "a lighthouse at dusk", 7
    common = {"prompt": prompt, "seed": seed, "num_inference_steps": a.steps, "size": f"{a.size}x{a.size}"}

    def gen(g):
        return [torch.Generator(engine.device).manual_seed(seed)]

    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as http:
        fns = {
            "raw_generate": lambda: (engine.pipe(prompt=[prompt], height=a.size, width=a.size,
                                                 num_inference_steps=a.steps, generator=gen(0)), sync()),
            "raw_img2img": lambda: (img2img(prompt=[prompt], image=[picture], strength=1.0,
                                            num_inference_steps=a.steps, generator=gen(0)), sync()),
            "http_generate": lambda: http.post("/v1/images/generations", json=common).raise_for_status(),
            "http_edit": lambda: http.post(
                "/v1/images/edits",
                files={"image": ("in.png", png, "image/png")},
                data={**{k: str(v) for k, v in common.items()}, "strength": "1.0"},
            ).raise_for_status(),
        }  # fmt: skip
        for fn in fns.values():
            fn()
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(max(1, a.iters // 5)):
            for k, fn in fns.items():
                for _ in range(5):
                    t = time.perf_counter()
                    fn()
                    times[k].append((time.perf_counter() - t) * 1e3)
    stop_app()

    p50 = {k: pct(v, 50) for k, v in times.items()}
    res = {
        "model": a.model, "device": a.device, "size": a.size, "steps": a.steps, "iters": a.iters,
        "p50_ms": {k: round(v, 2) for k, v in p50.items()},
        "mean_ms": {k: round(statistics.mean(v), 2) for k, v in times.items()},
        "edit_over_generate_http": round(p50["http_edit"] / p50["http_generate"], 3),
        "edit_over_generate_raw": round(p50["raw_img2img"] / p50["raw_generate"], 3),
        "edit_extra_ms_http": round(p50["http_edit"] - p50["http_generate"], 2),
        "edit_extra_ms_raw": round(p50["raw_img2img"] - p50["raw_generate"], 2),
    }  # fmt: skip
    print(f"\n{a.model} on {a.device}, {a.size}x{a.size}, {a.steps} steps, {a.iters} per path")
    for k, v in res["p50_ms"].items():
        print(f"{k:<16}{v:>10.2f} ms p50")
    print(f"edit / generation: served {res['edit_over_generate_http']:.3f} "
          f"(+{res['edit_extra_ms_http']:.1f} ms), raw diffusers {res['edit_over_generate_raw']:.3f} "
          f"(+{res['edit_extra_ms_raw']:.1f} ms: the VAE encode of the input)")  # fmt: skip
    write_json(res, a.out)


if __name__ == "__main__":
    main()
