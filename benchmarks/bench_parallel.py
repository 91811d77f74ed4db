"""One request on two ranks against one rank, in one run (issue 55).

    python benchmarks/bench_parallel.py                  # CPU: the twins, one torch thread a rank
    python benchmarks/bench_parallel.py --size 256 --steps 12 --families sd
    python benchmarks/bench_parallel.py --parallel ulysses --families flux --size 256   # tokens shared
    python benchmarks/bench_parallel.py --device cuda --families sd --model-sd builtin:sd15-arch  # 2 GPUs

One app serves each family twice: as one rank and on two ranks (`parallel.cfg: 2`, or
`parallel.ulysses: 2` with `--parallel ulysses`; a placement group of two bundles). With cfg,
tiny-sd guides in one batched denoiser call a step (each rank runs half the batch) and tiny-flux
with `true_cfg_scale` runs two calls a step (each rank runs one); with ulysses each rank holds
half of the tokens. Interleaved rounds of the same request (one image) to each; prints
the p50 latency of each and one rank's over two ranks'. On the CPU every rank gets one torch
thread, so two ranks use two cores where one rank uses one: the figure is what a second device
buys one request (on 2 cores the gloo exchange each step and the ingress share them); a third
model, one rank of two torch threads, spends the same two cores inside one process.
"""

from __future__ import annotations

import statistics
import time

from common import parser, start_app, stop_app, write_json

BODIES = {
    "sd": {"guidance_scale": 5.0},
    "flux": {"negative_prompt": "blue", "true_cfg_scale": 4.0, "guidance_scale": 3.5},
}


def once(http, a, fam: str, variant: str) -> float:
    """One request to the family's model `variant` (guided for cfg); its latency in ms."""
    extra = BODIES[fam] if a.parallel == "cfg" else {}
    body = {"model": f"{fam}-{variant}", "prompt": "a red circle", "seed": 3, "size": f"{a.size}x{a.size}",
            "num_inference_steps": a.steps, **extra}  # fmt: skip
    t = time.perf_counter()
    http.post("/v1/images/generations", json=body).raise_for_status()
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    ap = parser(__doc__, size=128, steps=8)
    ap.add_argument("--families", default="sd,flux")
    ap.add_argument("--model-sd", default="builtin:tiny-sd")
    ap.add_argument("--model-flux", default="builtin:tiny-flux")
    ap.add_argument("--parallel", default="cfg", choices=["cfg", "ulysses"], help="what the ranks share")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/parallel.json")
    a = ap.parse_args()

    import httpx

    families = a.families.split(",")
    gpu = a.device == "cuda"
    # Per family: one rank of one thread ("1"), two ranks of one thread each ("2"), and on the CPU
    # one rank of two threads ("1x2"): the same two cores spent inside one process.
    variants = {"1": (1, 1), "2": (2, 1)} if gpu else {"1": (1, 1), "2": (2, 1), "1x2": (1, 2)}
    entries = [
        {"model": {"name": f"{fam}-{v}", "source": getattr(a, f"model_{fam}"), "device": a.device,
                   "cpu_threads": None if gpu else threads, "parallel": {a.parallel: world},
                   "warmup_steps": 1}}
        for fam in families
        for v, (world, threads) in variants.items()
    ]  # fmt: skip
    args = {
        "models": entries,
        "replica": {"num_gpus": 1 if gpu else 0, "num_cpus": 0, "init_timeout_s": 900},
        "ingress": {"num_cpus": 0, "request_timeout_s": 900},
        "limits": {"max_side": max(1024, a.size), "max_pixels": max(1024 * 1024, a.size**2)},
    }
    start_app(args, a.device, 8768)
    res = {}
    try:
        with httpx.Client(base_url="http://127.0.0.1:8768", timeout=900) as http:
            for fam in families:
                times: dict[str, list[float]] = {v: [] for v in variants}
                for v in variants:  # warm each
                    once(http, a, fam, v)
                for _ in range(a.rounds):
                    for v in variants:
                        times[v].append(once(http, a, fam, v))
                p50 = {v: statistics.median(t) for v, t in times.items()}
                res[fam] = {f"p50_ms_{v}": round(t, 1) for v, t in p50.items()}
                res[fam]["one_rank_over_two_ranks"] = round(p50["1"] / p50["2"], 2)
                line = f"{fam:5s} one rank {p50['1']:8.1f} ms  two ranks {p50['2']:8.1f} ms"
                line += f"  x{p50['1'] / p50['2']:.2f}"
                if "1x2" in p50:
                    res[fam]["one_rank_two_threads_over_two_ranks"] = round(p50["1x2"] / p50["2"], 2)
                    line += f"  (one rank of two threads {p50['1x2']:8.1f} ms: x{p50['1x2'] / p50['2']:.2f})"
                print(line, flush=True)
    finally:
        stop_app()
    write_json(
        {"device": a.device, "parallel": a.parallel, "size": a.size, "steps": a.steps, "families": res}, a.out
    )


if __name__ == "__main__":
    main()
