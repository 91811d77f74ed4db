"""Throughput under concurrent load against the raw pipeline, in one run.

    python benchmarks/bench_throughput.py                                  # CPU, embedded model, 32 and 64 px
    python benchmarks/bench_throughput.py --model builtin:sd15-arch --device cuda --sizes 512 --steps 20

For each size: the raw pipeline in this process at batch 1, 8 and 16 (images/s), then, over
each `--path` (HTTP, and the Python handle), closed-loop clients (1, 2, 4, 8, 16 of them, each
sending single-image requests back to back) against the served app: images/s, p50/p95/p99
latency, the mean batch the requests ran in, and where the CPU went (milliseconds of CPU per
image in the replica, the ingress, Serve's proxy, this client and Ray's other processes, beside
the raw pipeline's CPU per image). Then `--rounds` alternating pairs of (raw batch 1, one
client) and of (raw batch 8, 8 clients), whose median ratios are the headline: on a shared
machine the speed drifts by tens of percent within minutes, and a ratio of two numbers measured
minutes apart measures the drift. Prints the ratios the goals are stated in, whether each goal
of the device is met, and writes JSON plus a PNG chart.

On a CPU the raw pipeline and the replica run the same torch threads with the same OpenMP wait
policy (`OMP_WAIT_POLICY`, printed): set it in both or neither, or the ratios compare two
different pipelines.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

PROMPT = "a photograph of an astronaut riding a horse"

# The goals this benchmark holds the app to, as ratios to the raw pipeline: (ratio, comparison,
# target, where it applies). The GPU ones are stated for builtin:sd15-arch at 512x512, 20 steps,
# fp16; the CPU one for the embedded model.
GOALS = [
    ("lone_latency_vs_raw_bs1_median_of_rounds", "<=", 1.05, "cuda"),
    ("c8_all_done_vs_raw_bs8_call", "<=", 1.2, "cuda"),
    ("c16_throughput_vs_raw_bs16", ">=", 0.9, "cuda"),
    ("lone_latency_vs_raw_bs1_median_of_rounds", "<=", 1.15, "cpu"),
    ("replica_cpu_c1_vs_raw_bs1_median_of_rounds", "<=", 1.10, "cpu"),
    ("c8_throughput_vs_raw_bs8_median_of_rounds", ">=", 0.9, "cpu"),
]


async def closed_loop(
    url: str, clients: int, requests_per_client: int, size: int, steps: int, handle=None
) -> dict:
    """`clients` callers, each sending its next request when the last one is answered."""
    import httpx

    lat: list[float] = []
    batch_sizes: list[int] = []
    errors = 0
    limits = httpx.Limits(max_connections=clients + 4)
    cpu = CpuMeter()
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:

        async def one(body: dict) -> int | None:
            """The batch size the request ran in, or None if it failed."""
            if handle is not None:
                try:
                    fields = {k: v for k, v in body.items() if k != "size"}
                    result = await handle.generate.remote({**fields, "height": size, "width": size})
                except Exception:
                    return None
                return result.metrics.batch_images
            r = await http.post("/v1/images/generations", json=body)
            return r.json()["metrics"]["batch_images"] if r.status_code == 200 else None

        async def client(c: int) -> None:
            nonlocal errors
            for i in range(requests_per_client):
                body = {"prompt": f"{PROMPT} {c}", "seed": c * 1000 + i, "size": f"{size}x{size}",
                        "num_inference_steps": steps}  # fmt: skip
                t = time.perf_counter()
                batch = await one(body)
                if batch is None:
                    errors += 1
                else:
                    batch_sizes.append(batch)
                lat.append((time.perf_counter() - t) * 1e3)

        t0 = time.perf_counter()
        cpu.start()
        await asyncio.gather(*(client(c) for c in range(clients)))
        wall = time.perf_counter() - t0
        cpu_ms = cpu.per_image(len(lat))
    return {
        "clients": clients,
        "requests": len(lat),
        "errors": errors,
        "images_per_s": round(len(lat) / wall, 3),
        "p50_ms": round(pct(lat, 50), 1),
        "p95_ms": round(pct(lat, 95), 1),
        "p99_ms": round(pct(lat, 99), 1),
        "mean_batch_images": round(sum(batch_sizes) / max(1, len(batch_sizes)), 2),
        "cpu_ms_per_image": cpu_ms,
    }


class CpuMeter:
    """CPU time of this machine's processes over an interval, by role, per image served.

    Roles come from the process titles Ray gives its actors. Needs psutil (Ray installs it);
    without it the figures are empty.
    """

    ROLES = (("DiffusionReplica", "replica"), ("DiffusionIngress", "ingress"), ("ProxyActor", "proxy"))

    def __init__(self) -> None:
        self._start: dict[str, float] = {}

    def _sample(self) -> dict[str, float]:
        try:
            import psutil
        except ImportError:
            return {}
        out: dict[str, float] = {}
        me = os.getpid()
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                cmd = " ".join(p.info["cmdline"] or [])
                t = p.cpu_times()
            except (psutil.Error, OSError):
                continue
            if p.info["pid"] == me:
                role = "client"
            else:
                role = next((r for k, r in self.ROLES if k in cmd), None)
                if role is None and "ray" not in cmd:
                    continue  # not ours: other users of the machine
                role = role or "ray_other"
            out[role] = out.get(role, 0.0) + t.user + t.system
        return out

    def start(self) -> None:
        self._start = self._sample()

    def per_image(self, images: int) -> dict[str, float]:
        end = self._sample()
        return {k: round((v - self._start.get(k, 0.0)) * 1e3 / max(1, images), 1) for k, v in end.items()}


def raw_throughput(pipe, device: str, size: int, steps: int, batch: int, min_s: float) -> dict:
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def call():
        gens = [torch.Generator(device).manual_seed(i) for i in range(batch)]
        pipe(prompt=[PROMPT] * batch, height=size, width=size, num_inference_steps=steps, generator=gens)
        sync()

    call()
    n, t0, c0 = 0, time.perf_counter(), time.process_time()
    while n < 2 or time.perf_counter() - t0 < min_s:
        call()
        n += 1
    dt = (time.perf_counter() - t0) / n
    cpu_ms = (time.process_time() - c0) / n / batch * 1e3
    return {
        "batch": batch,
        "s_per_call": round(dt, 4),
        "images_per_s": round(batch / dt, 3),
        "cpu_ms_per_image": round(cpu_ms, 1),
    }


def plot(res: dict, path: Path) -> None:
    """A small line chart (images/s against clients, raw batch levels dashed), drawn with PIL."""
    from PIL import Image, ImageDraw

    w, h, pad = 640, 400, 50
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    top = max(max(r["images_per_s"] for r in s["served"]) for s in res["sizes"])
    top = max(top, *(max(r["images_per_s"] for r in s["raw"]) for s in res["sizes"])) * 1.1
    xs = res["clients"]
    px = lambda i: pad + i * (w - 2 * pad) / max(1, len(xs) - 1)  # noqa: E731
    py = lambda v: h - pad - v / top * (h - 2 * pad)  # noqa: E731
    d.line([(pad, h - pad), (w - pad, h - pad)], fill="black")
    d.line([(pad, pad), (pad, h - pad)], fill="black")
    for i, c in enumerate(xs):
        d.text((px(i) - 4, h - pad + 6), str(c), fill="black")
    for k in range(5):
        v = top * k / 4
        d.text((4, py(v) - 6), f"{v:.1f}", fill="black")
    d.text((w // 2 - 60, h - 20), "concurrent clients", fill="black")
    d.text((pad, 10), f"images/s, {res['model']} on {res['device']} (dashed: raw batch 8/16)", fill="black")
    for si, s in enumerate(res["sizes"]):
        col = colors[si % len(colors)]
        pts = [(px(i), py(r["images_per_s"])) for i, r in enumerate(s["served"])]
        d.line(pts, fill=col, width=2)
        d.text((w - pad - 90, pts[-1][1] - 14), f"{s['size']}px {s['path']}", fill=col)
        for r in s["raw"]:
            if r["batch"] > 1:
                y = py(r["images_per_s"])
                for x in range(pad, w - pad, 12):
                    d.line([(x, y), (x + 6, y)], fill=col)
    img.save(path)


from common import parser, pct, start_app, stop_app  # noqa: E402


def measured_rounds(a, engine, size: int, served) -> list[dict]:
    """`--rounds` pairs of (raw batch 1, one client) and of (raw batch 8, 8 clients), each pair
    back to back: the ratio within a pair is of two numbers measured under the same drift."""
    out = []
    for _ in range(a.rounds):
        r1 = raw_throughput(engine.pipe, engine.device.type, size, a.steps, 1, a.raw_seconds / 2)
        s1 = served(1, a.requests_per_client or 12)
        r8 = raw_throughput(engine.pipe, engine.device.type, size, a.steps, 8, a.raw_seconds / 2)
        s8 = served(8, a.requests_per_client or 6)
        out.append({
            "raw_bs1_ms": round(r1["s_per_call"] * 1e3, 1), "lone_p50_ms": s1["p50_ms"],
            "lone_ratio": round(s1["p50_ms"] / (r1["s_per_call"] * 1e3), 3),
            "raw_bs1_cpu_ms": r1["cpu_ms_per_image"], "replica_cpu_ms": s1["cpu_ms_per_image"].get("replica"),
            "cpu_ratio": ratio(s1["cpu_ms_per_image"].get("replica"), r1["cpu_ms_per_image"]),
            "raw_bs8": r8["images_per_s"], "served_c8": s8["images_per_s"],
            "ratio": round(s8["images_per_s"] / r8["images_per_s"], 3), "mean_batch": s8["mean_batch_images"],
        })  # fmt: skip
        print(f"  {size}px round: {out[-1]}", flush=True)
    return out


def ratio(num: float | None, den: float) -> float | None:
    return round(num / den, 3) if num is not None else None


def path_ratios(raw: list[dict], served: list[dict], rounds: list[dict]) -> dict:
    by = {r["batch"]: r for r in raw}
    sv = {r["clients"]: r for r in served}

    def median(key: str) -> float | None:
        values = [r[key] for r in rounds if r[key] is not None]
        return statistics.median(values) if values else None

    return {
        "lone_latency_vs_raw_bs1": ratio(sv.get(1, {}).get("p50_ms"), by[1]["s_per_call"] * 1e3),
        "lone_latency_vs_raw_bs1_median_of_rounds": median("lone_ratio"),
        "replica_cpu_c1_vs_raw_bs1_median_of_rounds": median("cpu_ratio"),
        "c8_throughput_vs_raw_bs8": ratio(sv.get(8, {}).get("images_per_s"), by[8]["images_per_s"]),
        "c8_throughput_vs_raw_bs8_median_of_rounds": median("ratio"),
        "c8_all_done_vs_raw_bs8_call": ratio(sv.get(8, {}).get("p50_ms"), by[8]["s_per_call"] * 1e3),
        "c16_throughput_vs_raw_bs16": ratio(sv.get(16, {}).get("images_per_s"), by[16]["images_per_s"]),
        "raw_bs8_gain_over_bs1": round(by[8]["images_per_s"] / by[1]["images_per_s"], 3),
    }


def report(a, res: dict, s: dict) -> None:
    print(f"\n{a.model} on {a.device}, {s['size']}x{s['size']}, {a.steps} steps, over {s['path']}, "
          f"batching {res['batching']}, OMP_WAIT_POLICY={res['omp_wait_policy'] or '(unset)'}")  # fmt: skip
    print(
        "raw in-process:  "
        + "  ".join(
            f"bs{r['batch']} {r['images_per_s']:.2f} img/s ({r['cpu_ms_per_image']:.0f} ms CPU/img)"
            for r in s["raw"]
        )
    )
    roles = ["replica", "ingress", "proxy", "client", "ray_other"]
    print(f"{'clients':>8}{'img/s':>9}{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}{'batch':>7}{'errors':>7}"
          "   CPU ms/img: " + " ".join(roles))  # fmt: skip
    for r in s["served"]:
        cpu = r["cpu_ms_per_image"]
        print(f"{r['clients']:>8}{r['images_per_s']:>9.2f}{r['p50_ms']:>9.0f}{r['p95_ms']:>9.0f}"
              f"{r['p99_ms']:>9.0f}{r['mean_batch_images']:>7.1f}{r['errors']:>7}   "
              + " ".join(f"{cpu.get(k, 0):.0f}" for k in roles))  # fmt: skip
    for r in s["rounds"]:
        print(f"round: raw bs1 {r['raw_bs1_ms']:.0f} ms, one client p50 {r['lone_p50_ms']:.0f} ms "
              f"({r['lone_ratio']:.3f}); CPU/img raw {r['raw_bs1_cpu_ms']:.0f}, replica "
              f"{r['replica_cpu_ms'] or 0:.0f} ({r['cpu_ratio']}); raw bs8 {r['raw_bs8']:.2f} img/s, "
              f"8 clients {r['served_c8']:.2f} ({r['ratio']:.3f}, batch {r['mean_batch']:.1f})")  # fmt: skip
    print("ratios: " + ", ".join(f"{k} {v}" for k, v in s["ratios"].items()))
    for key, op, target, device in GOALS:
        if device != a.device:
            continue
        v = s["ratios"].get(key)
        met = (
            "not measured"
            if v is None
            else ("met" if (v <= target if op == "<=" else v >= target) else "NOT met")
        )
        print(f"goal ({device}, {s['path']}): {key} {op} {target}: {v} {met}")


def main() -> None:
    ap = parser(__doc__, size=None, steps=4)
    ap.add_argument("--sizes", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument(
        "--requests-per-client", type=int, default=0, help="default: enough for ~48 requests a level"
    )
    ap.add_argument("--raw-seconds", type=float, default=5.0)
    ap.add_argument(
        "--batch-wait-ms",
        type=float,
        default=None,
        help="default: 150 on cpu (as serve_config.yaml), else batching's default of 50",
    )
    ap.add_argument("--batch-gap-ms", type=float, default=10.0)
    ap.add_argument(
        "--step-joining", choices=["on", "off"], help="default: batching's (on on a GPU, off on a CPU)"
    )
    ap.add_argument("--max-batch", type=int, default=16, help="batching.max_batch_images")
    ap.add_argument("--path", choices=["http", "handle"], nargs="+", default=["http", "handle"])
    ap.add_argument(
        "--direct-ingress",
        action="store_true",
        help="Ray Serve's RAY_SERVE_ENABLE_DIRECT_INGRESS: the ingress replica serves HTTP itself "
        "(no proxy), on the first port of RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT",
    )
    ap.add_argument(
        "--rounds", type=int, default=3, help="alternating (raw, served) pairs at 1 and 8 clients"
    )
    ap.add_argument("--out", default="benchmarks/results/throughput")
    a = ap.parse_args()

    from serve_app.config import ModelConfig
    from serve_app.engine import DiffusionEngine

    top = max(a.sizes)
    model = {"source": a.model, "device": a.device, "default_height": top, "default_width": top}
    port = 8766
    args = {
        "model": model,
        "limits": {"max_side": max(2048, top), "max_pixels": max(top * top, 1 << 20), "max_images": 16},
        "replica": {"num_gpus": 1 if a.device == "cuda" else 0, "num_cpus": 0, "max_ongoing_requests": 64},
        "batching": {
            "max_batch_images": a.max_batch,
            "batch_wait_ms": a.batch_wait_ms
            if a.batch_wait_ms is not None
            else (150 if a.device == "cpu" else 50),
            "batch_gap_ms": a.batch_gap_ms,
        },
        "ingress": {"num_cpus": 0},
    }
    if a.step_joining:
        args["batching"]["step_joining"] = a.step_joining == "on"
    if a.direct_ingress:  # read by Ray's processes, so set before they start
        os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] = "1"
    handle = start_app(args, a.device, port)  # the handle; HTTP is served on `port` too
    if a.direct_ingress:
        port = int(os.environ.get("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", "30000"))
    url = f"http://127.0.0.1:{port}"

    def served_level(size: int, clients: int, per: int, path: str) -> dict:
        # Start once the replica has been idle past its batch window: the first wave would
        # otherwise wait for the previous level's clients to come back (see Scheduler.fill_deadline).
        time.sleep(args["batching"]["batch_wait_ms"] / 1e3 + 0.05)
        return asyncio.run(
            closed_loop(url, clients, per, size, a.steps, handle if path == "handle" else None)
        )

    engine = DiffusionEngine(ModelConfig(**model, warmup=False))
    res: dict = {
        "model": a.model,
        "device": a.device,
        "steps": a.steps,
        "paths": a.path,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
        "direct_ingress": a.direct_ingress,
        "batching": args["batching"],
        "clients": a.clients,
        "sizes": [],
    }
    for size in a.sizes:
        raw = [
            raw_throughput(engine.pipe, engine.device.type, size, a.steps, b, a.raw_seconds)
            for b in (1, 8, 16)
        ]
        for path in a.path:
            served_level(size, 4, 2, path)  # warm the served path at this size
            served = []
            for c in a.clients:
                served.append(served_level(size, c, a.requests_per_client or max(2, 48 // c), path))
                print(f"  {size}px {path} clients={c}: {served[-1]}", flush=True)
            rounds = measured_rounds(a, engine, size, lambda c, n, z=size, p=path: served_level(z, c, n, p))
            res["sizes"].append(
                {"size": size, "path": path, "raw": raw, "served": served, "rounds": rounds,
                 "ratios": path_ratios(raw, served, rounds)}
            )  # fmt: skip
    stop_app()
    for s in res["sizes"]:
        report(a, res, s)

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    plot(res, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
