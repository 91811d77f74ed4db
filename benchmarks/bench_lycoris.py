"""LyCORIS and DoRA adapters per row against plain LoRA, in one run (one engine in this process).

    python benchmarks/bench_lycoris.py                       # builtin:tiny-sd on the CPU
    python benchmarks/bench_lycoris.py --model sd15-arch --device cuda --size 512 --steps 20

A call of `--rows` images, each row with its own adapter of one kind (its per-row deltas beside
the shared base layers, `serve_app.engine.row_lora`): plain LoRA of rank r, LoHa of rank r (read
as a LoRA of rank r * r), LoKr (a whole 4x4 factor and a rank-r one: a LoRA of rank 4 r) and
DoRA (a LoRA of rank r and a magnitude per output: its gains are computed once per call), on
the UNet's attention projections, and the same call without adapters. Prints each kind's call
time against LoRA's (the median of `--rounds`), and writes JSON (`--out`).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from common import median_call_s, write_json


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-sd")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/lycoris.json")
    a = ap.parse_args()

    from serve_app.config import ModelConfig
    from serve_app.engine import CallParams, DiffusionEngine, Row
    from serve_app.tools.lora import make_adapter, make_lycoris

    engine = DiffusionEngine(ModelConfig(source=f"builtin:{a.model}", device=a.device, warmup=False))
    params = CallParams(height=a.size, width=a.size, steps=a.steps, guidance_scale=7.5)
    root = Path(tempfile.mkdtemp(prefix="bench-lycoris-"))
    for kind in ("lora", "loha", "lokr", "dora"):
        for k in range(a.rows):
            path = str(root / f"{kind}{k}.safetensors")
            if kind == "lora":
                make_adapter(path, seed=k, rank=a.rank, model=a.model)
            else:
                make_lycoris(path, kind, seed=k, rank=a.rank, model=a.model)
            engine.load_lora(f"{kind}{k}", path)

    def call_s(kind: str | None) -> float:
        rows = [Row(f"a lighthouse {k}", None, k, adapters=((f"{kind}{k}", 1.0),) if kind else ())
                for k in range(a.rows)]  # fmt: skip
        return median_call_s(engine, rows, params, a.rounds)

    secs = {kind or "none": call_s(kind) for kind in ("lora", "loha", "lokr", "dora", None)}
    res = {
        "model": a.model, "device": a.device, "size": a.size, "steps": a.steps,
        "rows": a.rows, "rank": a.rank,
        "call_s": {k: round(v, 4) for k, v in secs.items()},
        "loha_vs_lora": round(secs["loha"] / secs["lora"], 3),
        "lokr_vs_lora": round(secs["lokr"] / secs["lora"], 3),
        "dora_vs_lora": round(secs["dora"] / secs["lora"], 3),
        "lora_vs_none": round(secs["lora"] / secs["none"], 3),
    }  # fmt: skip
    print(f"{a.rows} rows, each its own adapter of rank {a.rank}: {a.model}, {a.size} px, {a.steps} steps")
    for k in ("loha_vs_lora", "lokr_vs_lora", "dora_vs_lora", "lora_vs_none"):
        print(f"  {k}: {res[k]} (call time)")
    write_json(res, a.out)


if __name__ == "__main__":
    main()
