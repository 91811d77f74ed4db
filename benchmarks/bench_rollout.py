"""RL rollouts against plain generation, in one run (one engine in this process).

    python benchmarks/bench_rollout.py                                   # builtin:tiny-flux, sde
    python benchmarks/bench_rollout.py --model builtin:tiny-sd           # ddim
    python benchmarks/bench_rollout.py --model builtin:sd15-arch --device cuda --size 512 --steps 20

A group of `--group` seeds of one prompt in one call, with `rollout` (every step stochastic,
log-probs and the trajectory returned) and without (the same call, plain). Prints samples/s of
each and their ratio (the median of `--rounds` calls), and writes JSON (`--out`).
"""

from __future__ import annotations

from common import median_call_s, parser, write_json


def main() -> None:
    ap = parser(__doc__, size=64, steps=8)
    ap.set_defaults(model="builtin:tiny-flux")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/rollout.json")
    a = ap.parse_args()

    from serve_app.config import ModelConfig
    from serve_app.engine import CallParams, DiffusionEngine, Row

    engine = DiffusionEngine(ModelConfig(source=a.model, device=a.device, warmup=False))
    spec, (sampler, _) = engine.check_rollout(None, None, None, a.steps)
    rows = [Row("a red circle on a blue background", None, 100 + k) for k in range(a.group)]
    base = dict(height=a.size, width=a.size, steps=a.steps, guidance_scale=4.0)
    calls = {
        "plain": CallParams(**base),
        "rollout": CallParams(**base, rollout=spec, sampler=sampler, return_trajectory=True),
    }

    secs = {name: median_call_s(engine, rows, p, a.rounds) for name, p in calls.items()}
    per_s = {name: a.group / s for name, s in secs.items()}
    res = {
        "model": a.model, "device": a.device, "size": a.size, "steps": a.steps, "group": a.group,
        "sampler": spec.sampler, "samples_per_s": {k: round(v, 3) for k, v in per_s.items()},
        "rollout_vs_plain": round(per_s["rollout"] / per_s["plain"], 3),
    }  # fmt: skip
    print(f"{a.model}, {a.size} px, {a.steps} steps, a group of {a.group}, rollout sampler {spec.sampler}")
    for name, v in per_s.items():
        print(f"  {name}: {v:.2f} samples/s")
    print(f"  rollout_vs_plain: {res['rollout_vs_plain']} (samples/s)")
    write_json(res, a.out)


if __name__ == "__main__":
    main()
