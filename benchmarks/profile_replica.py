"""Where a lone request's time and CPU go on the replica's side, stage by stage, against the raw
pipeline in the same process and the same run (no Ray: the replica class is called directly).

    python benchmarks/profile_replica.py                         # builtin:tiny-sd, CPU, 64 px, 4 steps
    python benchmarks/profile_replica.py --model builtin:sd15-arch --device cuda --size 512 --steps 20

Each round runs, back to back and in this order, a raw pipeline call at batch 1 (as
bench_throughput's raw figure), the engine's own call of the same request (`Engine.run`, no
step hook), the same with the replica's step hook, and the replica's whole `generate` (queue,
engine-thread hop, call, image encoding, result building); then the wire: the request and the
result pickled and read back, as Ray sends them between processes. The median over rounds of
each, in milliseconds of wall time and of this process's CPU, is printed as a table with the
ratios to raw, then the stages of `generate` as its own metrics report them. Served over Ray,
the replica process adds Serve's own request handling on top (see bench_throughput's CPU per
image by process).
"""

from __future__ import annotations

import asyncio
import os
import pickle
import statistics
import sys
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
sys.path.insert(0, os.path.dirname(__file__))

from common import parser  # noqa: E402

PROMPT = "a photograph of an astronaut riding a horse"


class Meter:
    """Wall and process CPU time of what runs inside `with`, kept by name."""

    def __init__(self) -> None:
        self.wall: dict[str, list[float]] = {}
        self.cpu: dict[str, list[float]] = {}

    def measure(self, name: str):
        meter = self

        class _Span:
            def __enter__(self):
                self.t, self.c = time.perf_counter(), time.process_time()

            def __exit__(self, *exc):
                meter.wall.setdefault(name, []).append((time.perf_counter() - self.t) * 1e3)
                meter.cpu.setdefault(name, []).append((time.process_time() - self.c) * 1e3)

        return _Span()

    def median(self, name: str) -> tuple[float, float]:
        return statistics.median(self.wall[name]), statistics.median(self.cpu[name])


def request_metrics(model: str, result) -> None:
    """The metric records one lone request makes on the replica, as it makes them."""
    from serve_app import metrics

    metrics.set_queue_length(model, 1)
    metrics.tenant_load(model, "default", 1, 0)
    metrics.observe_batch(model, 1)
    metrics.set_queue_length(model, 0)
    metrics.count_request(model, "done", 1)
    metrics.tenant_done(model, "default", 1, result.metrics.queue_ms)
    metrics.observe_stages(model, result.metrics.stage_ms())


def main() -> None:
    ap = parser(__doc__, size=64, steps=4)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument(
        "--idle-ms", type=float, default=30.0, help="pause between calls, as a client's round trip"
    )
    ap.add_argument("--batch-wait-ms", type=float, default=150.0, help="as serve_config.yaml on CPU")
    ap.add_argument("--batch-gap-ms", type=float, default=10.0, help="a lone request waits this long")
    ap.add_argument("--no-metrics", action="store_true", help="skip the metrics stage (starts Ray)")
    a = ap.parse_args()
    if not a.no_metrics:  # Ray's metrics record for real only in a Ray worker or driver
        import ray

        ray.init(address="local", include_dashboard=False, log_to_driver=False, num_cpus=1)

    import torch

    from serve_app.replica import DiffusionReplica
    from serve_app.replica.intake import new_job, work
    from serve_app.replica.results import step_hook
    from serve_app.schemas import GenerationRequest, PreparedRequest

    model = {"source": a.model, "device": a.device, "default_height": a.size, "default_width": a.size,
             "default_steps": a.steps, "warmup": False}  # fmt: skip
    batching = {"max_batch_images": 8, "batch_wait_ms": a.batch_wait_ms, "batch_gap_ms": a.batch_gap_ms}
    replica = DiffusionReplica(model, batching)
    engine = replica.engine
    pipe = engine.pipe
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    loop = asyncio.new_event_loop()
    m = Meter()

    def prepared(seed: int) -> PreparedRequest:
        body = GenerationRequest(prompt=PROMPT, seed=seed)
        return PreparedRequest.from_request(
            body, request_id=f"r{seed}", seed=seed, height=a.size, width=a.size, steps=a.steps,
            guidance_scale=7.5,
        )  # fmt: skip

    def raw(seed: int) -> None:
        gen = [torch.Generator(engine.device).manual_seed(seed)]
        pipe(prompt=[PROMPT], height=a.size, width=a.size, num_inference_steps=a.steps, generator=gen)
        sync()

    def engine_call(seed: int, hooked: bool) -> None:
        job = new_job(engine, prepared(seed), loop.create_future())
        job.state = "running"  # as the scheduler marks it (a job no longer running stops its call)
        hook = step_hook([job], loop) if hooked else None
        engine.run(job.rows, work(job).params, hook)
        sync()

    def idle() -> None:
        time.sleep(a.idle_ms / 1e3)

    stages: dict[str, list[float]] = {}
    for k in range(a.rounds + 1):
        warm = k == 0  # the first round warms every path and is not counted
        for name, fn in (
            ("raw pipeline", lambda k=k: raw(k)),
            ("Engine.run", lambda k=k: engine_call(k, False)),
            ("Engine.run + step hook", lambda k=k: engine_call(k, True)),
            ("replica generate", lambda k=k: loop.run_until_complete(replica.generate(prepared(k)))),
        ):
            idle()
            with m.measure("_warm" if warm else name):
                out = fn()
            if name == "replica generate" and not warm:
                for stage, ms in out.metrics.stage_ms().items():
                    stages.setdefault(stage, []).append(ms)
                result = out
        idle()
        with m.measure("_warm" if warm else "idle (CPU while nothing runs)"):
            idle()
        if not warm and not a.no_metrics:
            with m.measure("metrics: a request's records"):
                request_metrics(engine.model_name, result)
        if not warm:
            with m.measure("wire: request + result pickled and read"):
                pickle.loads(pickle.dumps(prepared(k), protocol=5))
                pickle.loads(pickle.dumps(result, protocol=5))
    if replica._loop_task is not None:
        replica._loop_task.cancel()
        loop.run_until_complete(asyncio.gather(replica._loop_task, return_exceptions=True))

    raw_wall, raw_cpu = m.median("raw pipeline")
    print(
        f"\n{a.model} on {a.device}, {a.size}x{a.size}, {a.steps} steps, batch 1, median of {a.rounds} rounds"
        f"\nbatching {batching}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}"
    )
    print(f"{'':44}{'wall ms':>9}{'x raw':>7}{'CPU ms':>9}{'x raw':>7}")
    for name in [n for n in m.wall if n != "_warm"]:
        wall, cpu = m.median(name)
        ratios = (
            (f"{wall / raw_wall:>7.3f}", f"{cpu / raw_cpu:>7.3f}") if "pipeline" not in name else ("", "")
        )
        print(f"{name:44}{wall:>9.2f}{ratios[0]:>7}{cpu:>9.2f}{ratios[1]:>7}")
    print("\nreplica generate, its own stages (median ms):")
    for stage, values in stages.items():
        print(f"  {stage:20}{statistics.median(values):>9.1f}")


if __name__ == "__main__":
    main()
