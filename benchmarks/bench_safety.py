"""The safety checker's cost, in one run (one engine in this process).

    python benchmarks/bench_safety.py                               # CPU: shapes, a ViT-B/16-shaped checker
    python benchmarks/bench_safety.py --checker /models/nsfw-vit    # a real checker directory
    python benchmarks/bench_safety.py --model builtin:sd15-arch --device cuda --size 512 --steps 20

A call of `--rows` images with and without `model.safety` (the same engine settings), and the
checker alone on those images. The default checker has ViT-B/16's shape (86M parameters, 224 px
input) with random weights, written to a temporary directory: its time, not its verdicts, is
measured. Prints the checker's milliseconds per image and the call time with it against
without (the median of `--rounds`), and writes JSON (`--out`).
"""

from __future__ import annotations

import tempfile
import time

from common import median_call_s, parser, write_json


def vit_b16_checker(out_dir: str) -> str:
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    cfg = ViTConfig(num_labels=2, id2label={0: "safe", 1: "unsafe"}, label2id={"safe": 0, "unsafe": 1})
    ViTForImageClassification(cfg).save_pretrained(out_dir, safe_serialization=True)
    ViTImageProcessor().save_pretrained(out_dir)
    return out_dir


def main() -> None:
    ap = parser(__doc__, size=64, steps=12)
    ap.set_defaults(model="builtin:shapes")
    ap.add_argument("--checker", default=None, help="a checker directory (default: ViT-B/16-shaped)")
    ap.add_argument("--label", default="unsafe", help="its flagged label")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/safety.json")
    a = ap.parse_args()

    from serve_app.config import ModelConfig, SafetyConfig
    from serve_app.engine import CallParams, DiffusionEngine, Row

    checker = a.checker or vit_b16_checker(tempfile.mkdtemp(prefix="bench-safety-"))
    safety = SafetyConfig(checker=checker, flagged_labels=[a.label], threshold=1.0, low_threshold=1.0)
    params = CallParams(height=a.size, width=a.size, steps=a.steps, guidance_scale=4.0)
    rows = [Row(f"a red circle on a blue background {k}", None, k) for k in range(a.rows)]
    secs, images = {}, None
    for name, cfg in (("without", None), ("with", safety)):
        engine = DiffusionEngine(ModelConfig(source=a.model, device=a.device, warmup=False, safety=cfg))
        secs[name] = median_call_s(engine, rows, params, a.rounds)
        images = engine.run(rows, params).images
        if cfg is not None:
            checker_obj = engine._runner.safety
            t = time.perf_counter()
            for _ in range(a.rounds):
                checker_obj.scores(images)
            per_image_ms = (time.perf_counter() - t) / a.rounds / len(images) * 1e3
        engine.close()
    params_m = sum(p.numel() for p in checker_obj.model.parameters()) / 1e6
    res = {
        "model": a.model, "device": a.device, "size": a.size, "steps": a.steps, "rows": a.rows,
        "checker_params_m": round(params_m, 1), "checker_ms_per_image": round(per_image_ms, 2),
        "call_s": {k: round(v, 4) for k, v in secs.items()},
        "with_vs_without": round(secs["with"] / secs["without"], 3),
    }  # fmt: skip
    print(f"{a.model}, {a.size} px, {a.steps} steps, {a.rows} rows; checker {params_m:.1f}M parameters")
    print(f"  checker: {per_image_ms:.1f} ms per image")
    print(f"  call with the checker vs without: {res['with_vs_without']}")
    write_json(res, a.out)


if __name__ == "__main__":
    main()
