"""What continuous batching can reach at all: a model of a joined run, no serving code.

    python benchmarks/joining_bound.py
    python benchmarks/joining_bound.py --load 0.7 --seat-ms 0 0.15 0.3 0.5 0.7

bench_batching.py's `poisson70_p95_vs_call` asks for a p95 latency under 2.5 times one
batch-1 call at 70% of the batch-16 rate. This asks how low that p95 can go for a joined run
whose step costs `step_ms + image_ms * images` on the device plus `seat_ms` of host work for
each seat (a request that joined alone), with requests arriving at Poisson times, joining at
the next step (or, with `--setup-step`, the step after: their set-up beside a step's call),
at most `max_batch_images` in the run and the rest queued in order. No queueing waits, hops or
text encoding are modelled, so what it prints is a floor for the served figure: measured
`seat_ms` on the 2-core CPU machine is 0.4-0.7 ms (bench_batching's `mean_gap_ms`).
"""

from __future__ import annotations

import argparse
import collections
import random


def simulate(rate_per_s: float, *, cap: int, step_ms: float, image_ms: float, seat_ms: float, steps: int,
             setup_step: bool, seconds: float, seed: int) -> list[float]:  # fmt: skip
    """Each request's latency in ms, from its arrival to the end of its last step."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    while t < seconds * 1e3:
        t += rng.expovariate(rate_per_s / 1e3)
        arrivals.append(t)
    queue: collections.deque[float] = collections.deque()
    run: list[list[float]] = []  # [arrival, steps left]
    now, i, latencies = 0.0, 0, []
    while i < len(arrivals) or queue or run:
        while i < len(arrivals) and arrivals[i] <= now:
            queue.append(arrivals[i])
            i += 1
        if not run and not queue:
            now = arrivals[i]
            continue
        while queue and len(run) < cap:
            run.append([queue.popleft(), steps + (1 if run and setup_step else 0)])
        now += step_ms + (image_ms + seat_ms) * len(run)
        for r in run:
            r[1] -= 1
        latencies += [now - r[0] for r in run if r[1] <= 0]
        run = [r for r in run if r[1] > 0]
    return latencies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--load", type=float, default=0.7, help="rate, of the full-call rate")
    ap.add_argument("--cap", type=int, default=16, help="max_batch_images")
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument("--image-ms", type=float, default=1.5, help="2 rows of 0.75 ms")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seat-ms", type=float, nargs="+", default=[0.0, 0.15, 0.3, 0.5, 0.7])
    ap.add_argument("--seconds", type=float, default=3600.0)
    a = ap.parse_args()
    full = a.cap / (a.steps * (a.step_ms + a.image_ms * a.cap) / 1e3)  # images/s of full calls
    one = a.steps * (a.step_ms + a.image_ms)  # one batch-1 call, ms
    print(f"{a.load:.0%} of {full:.1f} images/s; one batch-1 call {one:.0f} ms; p50 and p95 against it")
    for seat_ms in a.seat_ms:
        row = []
        for setup_step in (False, True):
            lat = sorted(simulate(a.load * full, cap=a.cap, step_ms=a.step_ms, image_ms=a.image_ms,
                                  seat_ms=seat_ms, steps=a.steps, setup_step=setup_step,
                                  seconds=a.seconds, seed=1))  # fmt: skip
            row.append(f"{lat[len(lat) // 2] / one:.2f} / {lat[int(0.95 * len(lat))] / one:.2f}")
        print(f"  host {seat_ms:.2f} ms a seat-step: joining the next step {row[0]}, the one after {row[1]}")


if __name__ == "__main__":
    main()
