"""LoRA serving cost, in one run: two cached adapters alternating vs one adapter, and first loads.

    python benchmarks/bench_lora.py                                        # CPU, embedded model
    python benchmarks/bench_lora.py --model builtin:sd15-arch --device cuda --size 512 --steps 20

One replica. Closed-loop clients send single-image requests: first all naming adapter A, then
alternating A and B (both already loaded, so the cost measured is switching, and losing the
chance to batch across adapters). Also times the first request with a freshly registered
adapter against a request with a loaded one. Goal: alternating >= 0.9x one adapter.

Then `--tenants` clients (8) three ways in the same run: every client with its own adapter,
all with one shared adapter, and none with an adapter. Requests with different adapters share
pipeline calls (per-row deltas, `serve_app.engine.row_lora`), so goal: distinct >= 0.85x shared.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


async def closed_loop(
    url: str, clients: int, per_client: int, body: dict, adapters: list[str], per_client_adapter: bool = False
) -> float:
    """Images per second; client c's i-th request names adapters[(c + i) % n], or adapters[c]
    with `per_client_adapter`, or none when `adapters` is empty."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=600) as http:

        async def client(c: int) -> None:
            for i in range(per_client):
                extra = {}
                if adapters:
                    k = c if per_client_adapter else c + i
                    name = adapters[k % len(adapters)]
                    extra = {"lora": {"name": name}}
                r = await http.post("/v1/images/generations", json={**body, "seed": i, **extra})
                r.raise_for_status()

        t = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(clients)))
        return clients * per_client / (time.perf_counter() - t)


from common import parser, start_app, stop_app, write_json  # noqa: E402


def main() -> None:
    ap = parser(__doc__, size=64, steps=4)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--per-client", type=int, default=12)
    ap.add_argument("--tenants", type=int, default=8, help="clients, each with its own adapter")
    ap.add_argument("--out", default="benchmarks/results/lora.json")
    a = ap.parse_args()

    import httpx

    from serve_app.tools.lora import make_adapter

    work = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    arch = a.model.removeprefix("builtin:")
    tenants = [f"t{i}" for i in range(a.tenants)]
    for name, seed in (("a", 1), ("b", 2), ("c", 3), *((t, 10 + i) for i, t in enumerate(tenants))):
        make_adapter(str(work / f"{name}.safetensors"), seed=seed, model=arch)
    port = 8769
    args = {
        "model": {"source": a.model, "device": a.device, "default_height": a.size, "default_width": a.size},
        "limits": {"max_side": max(2048, a.size), "max_pixels": max(a.size * a.size, 1 << 20)},
        "replica": {"num_gpus": 1 if a.device == "cuda" else 0, "num_cpus": 0},
        "lora": {
            "registry_path": str(work / "registry.json"),
            "allowed_roots": [str(work)],
            "max_loaded": max(4, a.tenants),
        },
        "ingress": {"num_cpus": 0},
        "auth": {"local_admin": True},  # the benchmark registers adapters from this machine
    }
    start_app(args, a.device, port)
    url = f"http://127.0.0.1:{port}"
    http = httpx.Client(base_url=url, timeout=600)
    for name in ("a", "b"):
        http.post("/v1/loras", json={"name": name, "path": f"{name}.safetensors"}).raise_for_status()
    body = {"prompt": "a lighthouse", "size": f"{a.size}x{a.size}", "num_inference_steps": a.steps}
    for name in ("a", "b"):  # load both on the replica
        http.post("/v1/images/generations", json={**body, "lora": {"name": name}}).raise_for_status()

    one = asyncio.run(closed_loop(url, a.clients, a.per_client, body, ["a"]))
    alt = asyncio.run(closed_loop(url, a.clients, a.per_client, body, ["a", "b"]))

    http.post("/v1/loras", json={"name": "c", "path": "c.safetensors"}).raise_for_status()
    first, warm = [], []
    for i in range(3):
        # Evict c from the replica by removing and re-adding it, so that every "first" is a real load.
        if i:
            http.delete("/v1/loras/c").raise_for_status()
            http.post("/v1/loras", json={"name": "c", "path": "c.safetensors"}).raise_for_status()
        t = time.perf_counter()
        http.post(
            "/v1/images/generations", json={**body, "seed": i, "lora": {"name": "c"}}
        ).raise_for_status()
        first.append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        http.post(
            "/v1/images/generations", json={**body, "seed": i, "lora": {"name": "c"}}
        ).raise_for_status()
        warm.append((time.perf_counter() - t) * 1e3)

    for name in tenants:
        http.post("/v1/loras", json={"name": name, "path": f"{name}.safetensors"}).raise_for_status()
        http.post("/v1/images/generations", json={**body, "lora": {"name": name}}).raise_for_status()
    n = a.tenants
    rates: dict[str, list[float]] = {"distinct": [], "shared": [], "none": []}
    for _ in range(2):  # interleaved rounds: drift hits all three alike
        rates["distinct"].append(asyncio.run(closed_loop(url, n, a.per_client, body, tenants, True)))
        rates["shared"].append(asyncio.run(closed_loop(url, n, a.per_client, body, [tenants[0]], True)))
        rates["none"].append(asyncio.run(closed_loop(url, n, a.per_client, body, [])))
    stop_app()
    distinct, shared, none = (max(rates[k]) for k in ("distinct", "shared", "none"))

    res = {
        "model": a.model, "device": a.device, "size": a.size, "steps": a.steps, "clients": a.clients,
        "one_adapter_images_per_s": round(one, 3),
        "alternating_images_per_s": round(alt, 3),
        "alternating_vs_one": round(alt / one, 3),
        "first_request_with_new_adapter_ms": round(sorted(first)[1], 1),
        "request_with_loaded_adapter_ms": round(sorted(warm)[1], 1),
        "first_load_cost_ms": round(sorted(first)[1] - sorted(warm)[1], 1),
        "tenants": n,
        "distinct_adapters_images_per_s": round(distinct, 3),
        "shared_adapter_images_per_s": round(shared, 3),
        "no_adapter_images_per_s": round(none, 3),
        "distinct_vs_shared": round(distinct / shared, 3),
        "shared_vs_none": round(shared / none, 3),
    }  # fmt: skip
    print(f"\n{a.model} on {a.device}, {a.size}x{a.size}, {a.steps} steps, {a.clients} clients")
    for k, v in res.items():
        print(f"  {k}: {v}")
    write_json(res, a.out)


if __name__ == "__main__":
    main()
