"""Abort latency: from `POST /v1/requests/{id}/abort` to the device being free again.

    python benchmarks/bench_abort.py                                       # CPU, embedded model
    python benchmarks/bench_abort.py --model builtin:sd15-arch --device cuda --size 512 --steps 50

For each trial a long request starts; once it has run a few steps the script aborts it and
measures (a) until the aborted caller has its answer and (b) until a one-step probe request,
sent together with the abort, has finished: the device is free when the probe could run.
Both are printed next to the time of one denoising step, measured in the same run.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import statistics
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from common import parser, start_app, stop_app, write_json  # noqa: E402


def main() -> None:
    ap = parser(__doc__, size=128, steps=50)
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--out", default="benchmarks/results/abort.json")
    a = ap.parse_args()

    import httpx

    port = 8768
    model = {"source": a.model, "device": a.device, "default_height": a.size, "default_width": a.size}
    args = {
        "model": model,
        "limits": {
            "max_side": max(2048, a.size),
            "max_pixels": max(a.size * a.size, 1 << 20),
            "max_steps": 1000,
        },
        "replica": {"num_gpus": 1 if a.device == "cuda" else 0, "num_cpus": 0},
        "batching": {"batch_wait_ms": 0},
        "ingress": {"num_cpus": 0},
    }
    start_app(args, a.device, port)
    url = f"http://127.0.0.1:{port}"
    http = httpx.Client(base_url=url, timeout=600)
    body = {"prompt": "long", "size": f"{a.size}x{a.size}", "num_inference_steps": a.steps}
    # The probe differs in steps, so it never shares the long request's pipeline call.
    probe = {"prompt": "probe", "size": f"{a.size}x{a.size}", "num_inference_steps": 1}
    http.post("/v1/images/generations", json={**body, "num_inference_steps": 2})

    step_ms, caller_ms, free_ms = [], [], []
    for trial in range(a.trials):
        rid = f"abort-{trial}-{time.time_ns()}"
        pool = cf.ThreadPoolExecutor(2)
        long_call = pool.submit(http_post, url, {**body, "request_id": rid})
        first = None
        while True:
            s = http.get(f"/v1/requests/{rid}")
            st = s.json() if s.status_code == 200 else {}
            if st.get("step", 0) >= 1 and first is None:
                first = (time.perf_counter(), st["step"])
            if first and st.get("step", 0) >= first[1] + 3:
                step_ms.append((time.perf_counter() - first[0]) * 1e3 / (st["step"] - first[1]))
                break
            time.sleep(0.005)
        t0 = time.perf_counter()
        probe_call = pool.submit(lambda: (http_post(url, probe), time.perf_counter())[1])
        http.post(f"/v1/requests/{rid}/abort")
        aborted = long_call.result()
        caller_ms.append((time.perf_counter() - t0) * 1e3)
        free_ms.append((probe_call.result() - t0) * 1e3)
        pool.shutdown()
        assert aborted.status_code == 499, aborted.text
    stop_app()

    med = statistics.median
    res = {
        "model": a.model, "device": a.device, "size": a.size, "steps": a.steps, "trials": a.trials,
        "step_ms_p50": round(med(step_ms), 1),
        "abort_to_caller_answer_ms_p50": round(med(caller_ms), 1),
        "abort_to_device_free_ms_p50": round(med(free_ms), 1),
        "abort_to_device_free_ms_max": round(max(free_ms), 1),
    }  # fmt: skip
    print(f"\n{a.model} on {a.device}, {a.size}x{a.size}, {a.trials} trials")
    print(f"one denoising step:            p50 {res['step_ms_p50']:8.1f} ms")
    print(f"abort -> aborted caller answer: p50 {res['abort_to_caller_answer_ms_p50']:8.1f} ms")
    print(f"abort -> probe done (free):     p50 {res['abort_to_device_free_ms_p50']:8.1f} ms, "
          f"max {res['abort_to_device_free_ms_max']:.1f} ms (with the probe's own 1-step run)")  # fmt: skip
    write_json(res, a.out)


def http_post(url: str, body: dict):
    import httpx

    return httpx.post(url + "/v1/images/generations", json=body, timeout=600)


if __name__ == "__main__":
    main()
