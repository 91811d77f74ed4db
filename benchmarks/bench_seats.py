"""A joined run's host work, in process: what each seat costs the engine thread.

    python benchmarks/bench_seats.py
    python benchmarks/bench_seats.py --seats 1 4 16 --out /tmp/seats.json

In a joined run the device waits while the engine thread does each seat's own work: its step
(guidance, its scheduler, the hand-overs) and, when it joins, its set-up (prompt encoding, its
scheduler). This drives `serve_app.testing:GpuShaped` with a free device (0 ms a call) on the
embedded tiny-sd, so all the time measured is host time, and compares in the same run:

- `seat_step_ms` at each number of seats, and `seat_step_vs_own_scheduler_steps`: a seat-step
  with the seats' scheduler steps run once over all rows (`engine/row_steps.py`) against each
  seat stepping its own scheduler (lower is better);
- `setup_ms` (a seat of one row joining, distinct prompts) and `setup_vs_no_text_memo`: with the
  run's text memo (`engine/text_memo.py`) against without.

Absolute times are this machine's; the ratios are what the cuts bought. Writes JSON (`--out`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

os.environ["DIFFUSION_SERVE_GPU_SHAPE"] = "0,0"  # the device free: every millisecond is the host's

from common import write_json  # noqa: E402


@contextlib.contextmanager
def without(what: str):
    """The run as it was without one of the cuts: "row_steps" or "text_memo"."""
    from serve_app.engine import row_steps, text_memo

    target, name, plain = {
        "row_steps": (row_steps, "joinable", lambda scheduler: False),
        "text_memo": (text_memo.TextMemo, "output", lambda self, key, run: run()),
    }[what]
    saved = getattr(target, name)
    setattr(target, name, plain)
    try:
        yield
    finally:
        setattr(target, name, saved)


def seat_step_ms(engine, params, seats: int, rounds: int) -> float:
    """Host ms a seat-step: `seats` rows that joined one at a time, stepped to the end (best of
    `rounds`)."""
    from serve_app.engine import Row

    best = float("inf")
    for _ in range(rounds):
        run = engine.open_joined(params)
        for i in range(seats):
            run.add(Row(f"a lighthouse {i}", None, i))
        t, n = time.perf_counter(), 0
        while run.active:
            run.step()
            n += 1
        best = min(best, (time.perf_counter() - t) / n / seats * 1e3)
        run.close()
    return best


def setup_ms(engine, params, joins: int) -> float:
    """Host ms a seat of one row takes to join (median; distinct prompts, the first 3 left out)."""
    from serve_app.engine import Row

    run = engine.open_joined(params)
    times = []
    for k in range(joins + 3):
        t = time.perf_counter()
        run.add(Row(f"a lighthouse number {k} by the sea at {time.perf_counter()}", None, k))
        times.append((time.perf_counter() - t) * 1e3)
    run.close()
    return statistics.median(times[3:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seats", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--joins", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/results/seats.json")
    a = ap.parse_args()

    from serve_app.config import ModelConfig
    from serve_app.engine import CallParams
    from serve_app.engine.engine import engine_class

    ext = "serve_app.testing:GpuShaped"
    cfg = ModelConfig(source="builtin:tiny-sd", engine_extension=ext, warmup=False, default_height=64,
                      default_width=64)  # fmt: skip
    engine = engine_class(ext)(cfg)
    params = CallParams(height=64, width=64, steps=a.steps, guidance_scale=7.5)
    out: dict = {"seat_step_ms": {}, "seat_step_vs_own_scheduler_steps": {}}
    for n in a.seats:
        batched = seat_step_ms(engine, params, n, a.rounds)
        with without("row_steps"):
            alone = seat_step_ms(engine, params, n, a.rounds)
        out["seat_step_ms"][n] = round(batched, 4)
        out["seat_step_vs_own_scheduler_steps"][n] = round(batched / alone, 3)
        print(f"{n:3d} seats: {batched:.3f} ms a seat-step; {batched / alone:.3f}x own scheduler steps")
    memo = setup_ms(engine, params, a.joins)
    with without("text_memo"):
        none = setup_ms(engine, params, a.joins)
    out["setup_ms"] = round(memo, 3)
    out["setup_vs_no_text_memo"] = round(memo / none, 3)
    print(f"a seat's set-up: {memo:.2f} ms; {memo / none:.3f}x without the text memo ({none:.2f} ms)")
    engine.close()
    write_json(out, a.out)


if __name__ == "__main__":
    main()
