"""`diffusion-serve`: a command-line client for a running server (standard library only), and
the command that starts one.

    diffusion-serve serve serve_config.yaml       # serve run serve_config.yaml, the proxy guard set
    diffusion-serve generate "a lighthouse at dawn" -o out.png --steps 30 --seed 1
    diffusion-serve lora add red red.safetensors --scale 0.8 | lora list | lora rm red | lora pin red
    diffusion-serve checkpoints add anime ./ckpts/anime --pool sd15 --pin | checkpoints list | ...
    diffusion-serve status

The server is `--url` (default $DIFFUSION_SERVE_URL or http://127.0.0.1:8000); `--api-key`
(default $DIFFUSION_API_KEY) is sent as a bearer token.

`diffusion-serve serve [CONFIG] [ARGS...]` becomes `serve run CONFIG ARGS...` (CONFIG defaults to
serve_config.yaml) with `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH` set to the proxy guard unless
it is set already: Ray reads it when it starts, and `serve run` starts a local Ray.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import sys
import time
import urllib.error
import urllib.request
from typing import Any


class ClientError(Exception):
    pass


class Client:
    def __init__(self, url: str, api_key: str | None):
        self.url = url.rstrip("/")
        self.api_key = api_key

    def _request(self, method: str, path: str, body: dict | None = None, headers: dict | None = None):
        headers = {
            "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream",
            **(headers or {}),
        }
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            return urllib.request.urlopen(req, timeout=600)
        except urllib.error.HTTPError as e:
            try:
                err = json.loads(e.read())["error"]
                msg = err["message"]
            except Exception:
                msg = e.reason
            raise ClientError(f"server answered {e.code}: {msg}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            reason = getattr(e, "reason", e)
            raise ClientError(
                f"cannot reach the server at {self.url} ({reason}); is it running? "
                "(diffusion-serve serve serve_config.yaml)"
            ) from None

    def json(self, method: str, path: str, body: dict | None = None, headers: dict | None = None) -> Any:
        with self._request(method, path, body, headers) as r:
            return json.loads(r.read())

    def raw(self, path: str) -> bytes:
        with self._request("GET", path) as r:
            return r.read()

    def stream(self, path: str, body: dict | None = None):
        """Yield the JSON events of a Server-Sent Events answer (POST with a body, else GET)."""
        with self._request("POST" if body is not None else "GET", path, body) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: ") :]
                if payload == "[DONE]":
                    return
                yield json.loads(payload)


def _progress(step: int, total: int, started: float) -> None:
    width = 30
    done = int(width * step / total)
    sys.stderr.write(
        f"\r[{'#' * done}{'.' * (width - done)}] {step}/{total} steps  {time.monotonic() - started:5.1f}s"
    )
    sys.stderr.flush()


def _body(a: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": a.prompt, "n": a.n, "stream": True, "output_format": a.format}
    for key, value in (("size", a.size), ("num_inference_steps", a.steps), ("seed", a.seed),
                       ("guidance_scale", a.guidance), ("negative_prompt", a.negative),
                       ("acceleration", a.acceleration), ("sampler", a.sampler),
                       ("sigma_schedule", a.sigma_schedule)):  # fmt: skip
        if value is not None:
            body[key] = value
    loras = []
    for spec in a.lora or []:
        name, _, scale = spec.partition(":")
        try:
            loras.append({"name": name, **({"scale": float(scale)} if scale else {})})
        except ValueError:
            raise ClientError(f"--lora {spec!r}: the scale after ':' must be a number") from None
    if loras:
        body["loras"] = loras
    return body


def _read_file(path: str, what: str) -> str:
    try:
        with open(path, "rb") as f:
            return base64.b64encode(f.read()).decode("ascii")
    except OSError as e:
        raise ClientError(f"cannot read the {what} {path!r}: {e.strerror}") from None


def cmd_generate(c: Client, a: argparse.Namespace) -> None:
    _make(c, a, "/v1/images/generations", _body(a))


def cmd_edit(c: Client, a: argparse.Namespace) -> None:
    body = {**_body(a), "image": _read_file(a.image, "image")}
    if a.mask:
        body["mask"] = _read_file(a.mask, "mask")
    if a.strength is not None:
        body["strength"] = a.strength
    _make(c, a, "/v1/images/edits", body)


def _make(c: Client, a: argparse.Namespace, path: str, body: dict[str, Any]) -> None:
    """Send a generation or an edit as a stream: a progress bar, then the files. With
    `--async`, submit it as a job and print its id (`jobs wait ID` fetches the files later)."""
    if a.async_job:
        job = c.json("POST", path, {**body, "stream": False}, {"Prefer": "respond-async"})
        print(f"{job['id']}  {job['state']}  (diffusion-serve jobs wait {job['id']} -o {a.output})")
        return
    result = _follow(c.stream(path, body), "result", a.quiet)
    if result is None:
        raise ClientError("the server closed the stream without a result")
    for i, item in enumerate(result["data"]):
        path = _output_path(a.output, i, len(result["data"]))
        with open(path, "wb") as f:
            f.write(base64.b64decode(item["b64_json"]))
        print(
            f"{path}  seed {item['seed']}  ({result['request_id']}, {result['metrics']['total_ms']:.0f} ms)"
        )


def _follow(events, final: str, quiet: bool) -> dict[str, Any] | None:
    """Read a stream of step events with a progress bar; the last event of type `final`."""
    started, last = time.monotonic(), None
    for event in events:
        if event["type"] == "step":
            if not quiet:
                _progress(event["step"], event["total_steps"], started)
        elif event["type"] == "error":
            raise ClientError(f"generation failed: {event['error']['message']}")
        elif event["type"] == final:
            last = event
    if not quiet:
        sys.stderr.write("\n")
    return last


def _output_path(output: str, index: int, count: int) -> str:
    """`out.png` for one file; `out-0.png`, `out-1.png`, ... for several."""
    stem, ext = os.path.splitext(output)
    return output if count == 1 else f"{stem}-{index}{ext}"


def _job_line(job: dict[str, Any]) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job["created_at"]))
    progress = f"step {job['step']}/{job['total_steps']}"
    extra = f"  {job['error']['message']}" if job.get("error") else ""
    return f"{job['id']}  {job['state']:<8} {progress:<12} {len(job['outputs'])} output(s)  {when}{extra}"


def _save_outputs(c: Client, job: dict[str, Any], output: str) -> None:
    for out in job["outputs"]:
        path = _output_path(output, out["index"], len(job["outputs"]))
        with open(path, "wb") as f:
            f.write(c.raw(f"/v1/jobs/{job['id']}/content/{out['index']}"))
        print(f"{path}  seed {out['seed']}  ({job['id']})")


def cmd_jobs(c: Client, a: argparse.Namespace) -> None:
    if a.jobs_cmd == "list":
        jobs = c.json("GET", f"/v1/jobs?limit={a.limit}")["data"]
        if not jobs:
            print("no jobs")
        for job in jobs:
            print(_job_line(job))
    elif a.jobs_cmd == "get":
        print(json.dumps(c.json("GET", f"/v1/jobs/{a.id}"), indent=2))
    elif a.jobs_cmd == "rm":
        out = c.json("DELETE", f"/v1/jobs/{a.id}")
        print(f"deleted {a.id}" if out.get("deleted") else f"{a.id}  {out['state']}")
    elif a.jobs_cmd == "wait":
        job = _follow(c.stream(f"/v1/jobs/{a.id}/events"), "job", a.quiet)
        if job is None:
            raise ClientError("the server closed the job's stream before it ended")
        if job["state"] != "done":
            raise ClientError(f"job {a.id} {job['state']}: {(job.get('error') or {}).get('message', '')}")
        _save_outputs(c, job, a.output)


def cmd_lora(c: Client, a: argparse.Namespace) -> None:
    if a.lora_cmd == "add":
        out = c.json("POST", "/v1/loras", {"name": a.name, "path": a.path, "scale": a.scale, "pinned": a.pin})
        print(
            f"added {out['name']} ({out['path']}, scale {out['scale']}{', pinned' if out['pinned'] else ''})"
        )
    elif a.lora_cmd == "list":
        out = c.json("GET", "/v1/loras")
        if not out["adapters"]:
            print("no adapters registered")
        for ad in out["adapters"]:
            held = sum(ad["name"] in r["loaded"] for r in out["replicas"])
            pin = "pinned" if ad["pinned"] else ""
            n = len(out["replicas"])
            print(f"{ad['name']:<20} scale {ad['scale']:<5} {pin:<7} on {held}/{n} replicas  {ad['path']}")
    elif a.lora_cmd == "rm":
        out = c.json("DELETE", f"/v1/loras/{a.name}")
        print(f"removed {a.name} (evicted from {out['evicted_from_replicas']} replicas)")
    elif a.lora_cmd == "pin":
        c.json("POST", f"/v1/loras/{a.name}/pin", {"pinned": not a.unpin})
        print(f"{'unpinned' if a.unpin else 'pinned'} {a.name}")


def cmd_checkpoints(c: Client, a: argparse.Namespace) -> None:
    if a.checkpoints_cmd == "add":
        body: dict[str, Any] = {"name": a.name, "source": a.source, "pinned": a.pin}
        if a.pool is not None:
            body["pool"] = a.pool
        out = c.json("POST", "/v1/checkpoints", body)
        family = out.get("family") or "unknown family"
        pin = ", pinned" if out.get("pinned") else ""
        print(f"added {out['name']} ({out['source']}, pool {out.get('pool')}, {family}{pin})")
    elif a.checkpoints_cmd == "list":
        for line in checkpoint_lines(c.json("GET", "/v1/checkpoints")):
            print(line)
    elif a.checkpoints_cmd == "rm":
        c.json("DELETE", f"/v1/checkpoints/{a.name}")
        print(f"removed {a.name}")
    elif a.checkpoints_cmd == "pin":
        c.json("POST", f"/v1/checkpoints/{a.name}/pin", {"pinned": not a.unpin})
        print(f"{'unpinned' if a.unpin else 'pinned'} {a.name}")


def checkpoint_lines(out: dict[str, Any]) -> list[str]:
    """`checkpoints list`: one line per checkpoint, with the replicas that hold it."""
    if not out["checkpoints"]:
        return ["no checkpoints registered"]
    lines = []
    for ck in out["checkpoints"]:
        holders = [r["replica_id"] for r in out.get("replicas", []) if ck["name"] in r.get("held", [])]
        pin = "pinned" if ck["pinned"] else ""
        held = f"held by {', '.join(holders)}" if holders else "held by no replica"
        family, pool = ck.get("family") or "-", ck.get("pool") or "-"
        lines.append(f"{ck['name']:<20} pool {pool:<12} {family:<6} {pin:<7} {held}  {ck['source']}")
    return lines


def cmd_status(c: Client, a: argparse.Namespace) -> None:
    out = c.json("GET", "/v1/status")
    print(f"model {out['model']}: {len(out['replicas'])} replicas, queue length {out['queue_length']}")
    for r in out["replicas"]:
        health = "healthy" if r["healthy"] else f"UNHEALTHY ({r['health_problem']})"
        queued = f"queued {r['queued_requests']} req / {r['queued_images']} img"
        running = f"running {r['running_requests']} req / {r['running_images']} img"
        print(f"  {r['replica_id']}: {health}; {queued}, {running}; adapters {r['loras_loaded']}")


# Serve's proxy callback: the X-Request-Id guard every Serve proxy installs when Ray starts
# (serve_app/proxy.py), as the Dockerfile and docs/deploying.md set it.
PROXY_GUARD = ("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", "serve_app.proxy:middlewares")
DEFAULT_CONFIG = "serve_config.yaml"


def cmd_serve(a: argparse.Namespace) -> None:
    """Become `serve run CONFIG ARGS...` (the `serve` beside this Python, else the one on PATH),
    with the proxy guard in the environment unless the caller set the variable. CONFIG is the
    first argument unless that is an option; serve_config.yaml by default."""
    config, rest = (
        (a.args[0], a.args[1:]) if a.args and not a.args[0].startswith("-") else (DEFAULT_CONFIG, a.args)
    )
    name, value = PROXY_GUARD
    os.environ.setdefault(name, value)
    serve = shutil.which("serve", path=os.path.dirname(sys.executable)) or shutil.which("serve")
    if serve is None:
        raise ClientError("no `serve` command (Ray Serve's CLI) beside this Python or on PATH")
    sys.stdout.flush()
    try:
        os.execv(serve, [serve, "run", config, *rest])
    except OSError as e:
        raise ClientError(f"cannot run {serve}: {e.strerror}") from None


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="diffusion-serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=os.environ.get("DIFFUSION_SERVE_URL", "http://127.0.0.1:8000"))
    ap.add_argument("--api-key", default=os.environ.get("DIFFUSION_API_KEY"))
    sub = ap.add_subparsers(dest="cmd", required=True)
    # Every argument after `serve` is serve run's, options too (no option is this parser's).
    sv = sub.add_parser("serve", help="serve run [CONFIG] [ARGS...], the proxy guard set", prefix_chars="+",
                        add_help=False)  # fmt: skip
    sv.add_argument("args", nargs="*", metavar="[CONFIG] [ARGS...]", help="CONFIG: serve_config.yaml")
    g = sub.add_parser("generate", help="make an image, with a progress bar")
    e = sub.add_parser("edit", help="edit an image (image-to-image, or inpaint with --mask)")
    e.add_argument("image", help="the image file to edit")
    g.add_argument("prompt")
    e.add_argument("prompt")
    e.add_argument("--mask", help="where to paint: transparent (alpha) or white pixels")
    e.add_argument("--strength", type=float, help="how much to repaint, in (0, 1]")
    for p in (g, e):
        p.add_argument("-o", "--output", default="out.png")
        p.add_argument("--steps", type=int)
        p.add_argument("--seed", type=int)
        p.add_argument("--size", help="WIDTHxHEIGHT (an edit: default the image's)")
        p.add_argument("--guidance", type=float)
        p.add_argument("--negative")
        p.add_argument("-n", type=int, default=1)
        p.add_argument("--format", default="png", choices=["png", "jpeg", "webp"])
        p.add_argument("--lora", action="append", help="NAME or NAME:SCALE; repeat to stack adapters")
        p.add_argument(
            "--acceleration", choices=["none", "fast", "faster"], help="step caching (default: the server's)"
        )
        p.add_argument("--sampler", help="e.g. 'Euler a', 'DPM++ 2M Karras' (GET /v1/models lists them)")
        p.add_argument("--sigma-schedule", help="karras, exponential or beta (default: the sampler's own)")
        p.add_argument("-q", "--quiet", action="store_true")
        p.add_argument(
            "--async", dest="async_job", action="store_true", help="submit as a job, print its id, return"
        )
    jo = sub.add_parser("jobs", help="asynchronous jobs: list, get, wait (and save the files), rm")
    jsub = jo.add_subparsers(dest="jobs_cmd", required=True)
    jsub.add_parser("list").add_argument("--limit", type=int, default=20)
    jsub.add_parser("get").add_argument("id")
    jsub.add_parser("rm", help="abort a job that runs, delete one that ended").add_argument("id")
    jw = jsub.add_parser("wait", help="follow a job with a progress bar, then save its files")
    jw.add_argument("id")
    jw.add_argument("-o", "--output", default="out.png")
    jw.add_argument("-q", "--quiet", action="store_true")
    lo = sub.add_parser("lora", help="manage LoRA adapters")
    lsub = lo.add_subparsers(dest="lora_cmd", required=True)
    add = lsub.add_parser("add")
    add.add_argument("name")
    add.add_argument("path")
    add.add_argument("--scale", type=float, default=1.0)
    add.add_argument("--pin", action="store_true")
    lsub.add_parser("list")
    rm = lsub.add_parser("rm")
    rm.add_argument("name")
    pin = lsub.add_parser("pin")
    pin.add_argument("name")
    pin.add_argument("--unpin", action="store_true")
    ck = sub.add_parser("checkpoints", help="manage the checkpoints served by name from a pool")
    csub = ck.add_subparsers(dest="checkpoints_cmd", required=True)
    cadd = csub.add_parser("add", help="register a checkpoint: a diffusers directory or a hub id")
    cadd.add_argument("name")
    cadd.add_argument("source")
    cadd.add_argument("--pool", help="the pool that serves it (default: the server's)")
    cadd.add_argument("--pin", action="store_true", help="held by every replica of its pool")
    csub.add_parser("list")
    csub.add_parser("rm").add_argument("name")
    cpin = csub.add_parser("pin")
    cpin.add_argument("name")
    cpin.add_argument("--unpin", action="store_true")
    sub.add_parser("status", help="replicas, queues, health")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    c = Client(a.url, a.api_key)
    try:
        if a.cmd == "serve":
            cmd_serve(a)  # this process becomes `serve run`, or ClientError says why not
        commands = {"generate": cmd_generate, "edit": cmd_edit, "lora": cmd_lora, "status": cmd_status}
        {**commands, "jobs": cmd_jobs, "checkpoints": cmd_checkpoints}[a.cmd](c, a)
    except ClientError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
