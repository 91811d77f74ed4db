"""Checkpoints on demand, in one run: time to first image of a cold checkpoint vs a hot one, and
the latency of requests for a model the replica holds while another checkpoint loads.

    python benchmarks/bench_models.py                                        # CPU, embedded model
    python benchmarks/bench_models.py --model builtin:sd15-arch --device cuda --size 512 --steps 20

One pool replica (`multiplex: {max_models_per_replica: 1}`) of `--model`. Checkpoints are that
model saved with other denoiser weights (the same text encoder and VAE files, which the pool
shares). Cold: a request naming a registered checkpoint the replica does not hold (the other
one evicted it); hot: the same request again. Under load: a closed loop of requests for the
pool's own model, alone and then while cold checkpoints load one after another, as the ratio
of their median latencies. Goal: hot-model latency during loads <= 2x alone (one pipeline call
of waiting at most on top of its own), and the load in the cold figure, not in the hot one.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from common import parser, pct, start_app, stop_app, write_json  # noqa: E402


def save_checkpoints(model: str, work: Path, names: list[str]) -> None:
    """`model` saved once per name, each with its own denoiser weights, the rest shared."""
    import torch

    from serve_app.config import ModelConfig
    from serve_app.engine.loading import load_pipeline

    for i, name in enumerate(names):
        cfg = ModelConfig(source=model, device="cpu", seed=100 + i)
        pipe = load_pipeline(cfg, torch.device("cpu"), torch.float32)
        pipe.save_pretrained(work / name, safe_serialization=True)
        if i:
            for part in ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "vae"):
                if (work / names[0] / part).is_dir():
                    shutil.rmtree(work / name / part)
                    shutil.copytree(work / names[0] / part, work / name / part)


async def hot_loop(url: str, body: dict, seconds: float, stop: asyncio.Event | None = None) -> list[float]:
    """Latencies (ms) of back-to-back requests for the pool's own model, for `seconds` or until `stop`."""
    import httpx

    out = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end and not (stop and stop.is_set()):
            t = time.perf_counter()
            (await http.post("/v1/images/generations", json=body)).raise_for_status()
            out.append((time.perf_counter() - t) * 1e3)
    return out


async def during_loads(url: str, body: dict, loads: int, names: list[str]) -> tuple[list[float], list[float]]:
    """Hot-model latencies while `loads` cold checkpoint requests run one after another."""
    import httpx

    stop = asyncio.Event()
    cold_ms = []

    async def loader():
        async with httpx.AsyncClient(base_url=url, timeout=600) as http:
            for i in range(loads):
                t = time.perf_counter()
                r = await http.post("/v1/images/generations", json={**body, "model": names[i % 2]})
                r.raise_for_status()
                cold_ms.append((time.perf_counter() - t) * 1e3)
        stop.set()

    hot, _ = await asyncio.gather(hot_loop(url, body, 3600, stop), loader())
    return hot, cold_ms


def main() -> None:
    ap = parser(__doc__, size=64, steps=4)
    ap.add_argument("--loads", type=int, default=6, help="cold checkpoint loads during the hot loop")
    ap.add_argument("--out", default="benchmarks/results/models.json")
    a = ap.parse_args()

    import httpx

    work = Path(tempfile.mkdtemp(prefix="bench-models-"))
    names = ["ckpt-a", "ckpt-b"]
    save_checkpoints(a.model, work, names)
    args = {
        "model": {"source": a.model, "device": a.device, "default_height": a.size, "default_width": a.size,
                  "default_steps": a.steps},
        "multiplex": {"max_models_per_replica": 1},
        "limits": {"max_side": max(2048, a.size), "max_pixels": max(a.size * a.size, 1 << 20)},
        "replica": {"num_gpus": 1 if a.device == "cuda" else 0, "num_cpus": 0},
        "batching": {"batch_wait_ms": 0},
        "checkpoints": {"registry_path": str(work / "checkpoints.json"), "allowed_roots": [str(work)]},
        "ingress": {"num_cpus": 0},
        "auth": {"local_admin": True},  # the benchmark registers checkpoints from this machine
    }  # fmt: skip
    port = 8771
    start_app(args, a.device, port)
    url = f"http://127.0.0.1:{port}"
    http = httpx.Client(base_url=url, timeout=600)
    for name in names:
        http.post("/v1/checkpoints", json={"name": name, "source": str(work / name)}).raise_for_status()
    body = {"prompt": "a lighthouse", "seed": 1}

    cold, hot = [], []
    for i in range(4):  # each holds one: naming the other evicts it, so every first is a load
        name = names[i % 2]
        t = time.perf_counter()
        http.post("/v1/images/generations", json={**body, "model": name}).raise_for_status()
        cold.append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        http.post("/v1/images/generations", json={**body, "model": name}).raise_for_status()
        hot.append((time.perf_counter() - t) * 1e3)
    alone = asyncio.run(hot_loop(url, body, 8.0))
    loaded, cold_during = asyncio.run(during_loads(url, body, a.loads, names))
    held = http.get("/v1/checkpoints").json()["replicas"][0]
    stop_app()

    res = {
        "model": a.model, "device": a.device, "size": a.size, "steps": a.steps,
        "cold_checkpoint_first_image_ms": round(statistics.median(cold), 1),
        "hot_checkpoint_image_ms": round(statistics.median(hot), 1),
        "cold_vs_hot": round(statistics.median(cold) / statistics.median(hot), 2),
        "pool_model_alone_p50_ms": round(statistics.median(alone), 1),
        "pool_model_alone_p95_ms": round(pct(alone, 95), 1),
        "pool_model_during_loads_p50_ms": round(statistics.median(loaded), 1),
        "pool_model_during_loads_p95_ms": round(pct(loaded, 95), 1),
        "during_loads_vs_alone_p50": round(statistics.median(loaded) / statistics.median(alone), 2),
        "during_loads_vs_alone_p95": round(pct(loaded, 95) / pct(alone, 95), 2),
        "cold_loads_during": len(cold_during),
        "replica_loads": held["loads"], "replica_shared_components": held["shared_components"],
    }  # fmt: skip
    print(f"\n{a.model} on {a.device}, {a.size}x{a.size}, {a.steps} steps")
    for k, v in res.items():
        print(f"  {k}: {v}")
    write_json(res, a.out)


if __name__ == "__main__":
    main()
