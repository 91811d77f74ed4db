"""What every benchmark script shares: a local Ray with the app on loopback, and the JSON output."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def parser(doc: str, *, size: int | None = 64, steps: int = 4) -> argparse.ArgumentParser:
    """The flags every script takes: which model on which device, at what size and steps."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:tiny-sd")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    if size is not None:
        ap.add_argument("--size", type=int, default=size)
    ap.add_argument("--steps", type=int, default=steps)
    return ap


def pct(xs: list[float], q: float) -> float:
    """The q-th percentile of `xs` (nearest rank)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def median_call_s(engine, rows, params, rounds: int) -> float:
    """The median seconds of `rounds` engine calls over `rows` (after one call to warm up)."""
    import statistics
    import time

    engine.run(rows, params)
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        engine.run(rows, params)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def start_app(args: dict[str, Any], device: str, port: int):
    """A fresh local Ray (never a cluster already running here), Serve on `port`, the app at `/`."""
    import ray
    from ray import serve

    from serve_app.app import build_app

    ray.init(
        address="local", include_dashboard=False, log_to_driver=False, num_gpus=1 if device == "cuda" else 0
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return serve.run(build_app(args), name="bench", route_prefix="/")


def stop_app() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def write_json(res: dict[str, Any], out: str) -> None:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")
