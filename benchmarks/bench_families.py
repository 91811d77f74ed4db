"""The newer families served against their raw pipelines, in one run (issue 56).

    python benchmarks/bench_families.py                       # CPU, the embedded twins
    python benchmarks/bench_families.py --models qwen-image,ltx --steps 8
    python benchmarks/bench_families.py --models ltx-arch --device cuda --steps 8 --rounds 3  # real shapes

One app serves one twin per family (Qwen-Image, Qwen-Image-Edit-2509 with two reference
images, Z-Image, FLUX.2 [klein] and [dev], Wan 2.2 image-to-video, LTX-Video, HunyuanVideo 1.5), or a
`-arch` model at its real shapes (`ltx-arch`: random weights, no download), each model one
replica. Per family, interleaved rounds of: a request over HTTP (the image routes, the
edit form, `/v1/videos/generations` with `input_reference`), and the same call to the diffusers
pipeline itself in this process (the same twin, size, steps and inputs). Prints p50 of each and
the ratio served / raw: what the serving path adds to one request of the family (HTTP, the
ingress, Serve's hops, PNG or MP4 encoding), on this machine.
"""

from __future__ import annotations

import base64
import io
import os
import statistics
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from common import parser, start_app, stop_app, write_json  # noqa: E402

# One twin per family, served under its name without `tiny-`.
TWINS = ("tiny-qwen-image", "tiny-qwen-image-edit", "tiny-z-image", "tiny-flux2-klein", "tiny-flux2",
         "tiny-wan-i2v", "tiny-ltx", "tiny-hunyuan-video")  # fmt: skip


def _png(im) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def calls(name: str, engine, http, steps: int):
    """(raw, served) callables for one family: the same call both ways."""
    import torch
    from PIL import Image

    info = engine.describe()
    h, w = info["default_height"], info["default_width"]
    refs = [Image.new("RGB", (w, h), c) for c in ("red", "blue")]
    raw_kw = {"prompt": "a boat on a lake", "height": h, "width": w, "num_inference_steps": steps}
    body = {
        "model": name,
        "prompt": "a boat on a lake",
        "seed": 1,
        "num_inference_steps": steps,
        "size": f"{w}x{h}",
    }
    if info["family"] != "hunyuan-video":
        raw_kw["guidance_scale"] = 4.0
    if info["modality"] == "video":
        raw_kw["num_frames"] = body["num_frames"] = info["default_num_frames"]
    if name == "wan-i2v":
        raw_kw["image"] = refs[0]
        body["input_reference"] = base64.b64encode(_png(refs[0])).decode()
    if name == "qwen-image-edit":
        raw_kw["image"] = refs

    def raw():
        engine.pipe(**raw_kw, generator=torch.Generator().manual_seed(1))

    if name == "qwen-image-edit":
        files = [("image[]", ("r.png", _png(im), "image/png")) for im in refs]
        form = {k: str(v) for k, v in body.items() if k != "size"}
        return raw, lambda: http.post("/v1/images/edits", files=files, data=form).raise_for_status()
    route = "/v1/videos/generations" if info["modality"] == "video" else "/v1/images/generations"
    return raw, lambda: http.post(route, json=body).raise_for_status()


def main() -> None:
    ap = parser(__doc__, size=None, steps=4)
    ap.add_argument("--models", default=",".join(t.removeprefix("tiny-") for t in TWINS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/families.json")
    a = ap.parse_args()

    import httpx

    from serve_app.config import ModelConfig
    from serve_app.engine import DiffusionEngine

    names = a.models.split(",")
    port = 8767
    sources = {n: f"builtin:{n}" if n.endswith("-arch") else f"builtin:tiny-{n}" for n in names}
    entries = [{"model": {"name": n, "source": sources[n], "device": a.device}} for n in names]
    args = {
        "models": entries,
        "replica": {"num_gpus": 1 if a.device == "cuda" else 0, "num_cpus": 0},
        "ingress": {"num_cpus": 0},
    }
    start_app(args, a.device, port)
    res = {}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as http:
            for name in names:
                engine = DiffusionEngine(ModelConfig(source=sources[name], device=a.device, warmup=False))
                raw, served = calls(name, engine, http, a.steps)
                raw(), served()  # warm both
                times = {"raw": [], "served": []}
                for _ in range(a.rounds):
                    for key, fn in (("raw", raw), ("served", served)):
                        t = time.perf_counter()
                        fn()
                        times[key].append((time.perf_counter() - t) * 1e3)
                p50 = {k: statistics.median(v) for k, v in times.items()}
                res[name] = {**{f"{k}_p50_ms": round(v, 1) for k, v in p50.items()},
                             "served_over_raw": round(p50["served"] / p50["raw"], 2)}  # fmt: skip
                print(f"{name:16s} raw {p50['raw']:7.1f} ms  served {p50['served']:7.1f} ms  "
                      f"served/raw {p50['served'] / p50['raw']:.2f}x", flush=True)  # fmt: skip
                engine.close()
    finally:
        stop_app()
    write_json({"device": a.device, "steps": a.steps, "families": res}, a.out)


if __name__ == "__main__":
    main()
