"""The ways in: `serve deploy` of serve_config.yaml against `ray start --head` (docs/deploying.md),
and the README's first command, `diffusion-serve serve serve_config.yaml`, which starts a Ray of
its own.

A second Ray cluster, started by the CLI with its own ports beside the session's, so that
the deployment goes through exactly the path a user takes; `diffusion-serve serve` then starts a
third, as a newcomer's first command does. The scenario runs in a thread beside the session's
other tests (`background_report`, tests/conftest.py); each test raises what stopped its part.
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml
from PIL import Image

from serve_app.shapes.scenes import read_image
from tests.conftest import free_port, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.own_cluster]

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
# The README's first request (seed 1) and the playground's default prompt.
FIRST_PROMPT = "a yellow star on a black background"
GUARD = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"  # set by conftest, as docs/deploying.md does
DEPLOYING = ROOT / "docs" / "deploying.md"


def _wait_for_image(url: str, deadline_s: float, prompt: str = "cli", steps: int | None = 2) -> dict:
    end = time.monotonic() + deadline_s
    last = None
    body = {"prompt": prompt, "seed": 1} | ({"num_inference_steps": steps} if steps else {})
    while time.monotonic() < end:
        try:
            r = httpx.post(url + "/v1/images/generations", json=body, timeout=30)
            if r.status_code == 200:
                return r.json()
            last = f"{r.status_code} {r.text[:200]}"
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(1)
    raise AssertionError(f"no image from {url} within {deadline_s}s: {last}")


@contextlib.contextmanager
def cli_cluster():
    ports = {
        k: free_port() for k in ("gcs", "dash", "agent", "agent_grpc", "metrics", "client", "env", "http")
    }
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token")
    # Its own temp dir: the cluster-address file it writes there must not point a later
    # `serve run` or `ray.init()` at this short-lived cluster. A short path: Ray's socket paths
    # under it must fit a Unix socket's 107 characters (pytest's temp dirs may not).
    temp_dir = tempfile.mkdtemp(prefix="ray-cli-", dir="/tmp")
    head = subprocess.Popen(
        [
            str(BIN / "ray"), "start", "--head", "--block", "--num-cpus=2",
            f"--port={ports['gcs']}", f"--dashboard-port={ports['dash']}", "--dashboard-host=127.0.0.1",
            f"--dashboard-agent-listen-port={ports['agent']}",
            f"--dashboard-agent-grpc-port={ports['agent_grpc']}",
            f"--metrics-export-port={ports['metrics']}", f"--ray-client-server-port={ports['client']}",
            f"--runtime-env-agent-port={ports['env']}",
            f"--temp-dir={temp_dir}",
        ],
        env=env, cwd=temp_dir, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    dash = f"http://127.0.0.1:{ports['dash']}"
    try:
        end = time.monotonic() + 90
        while time.monotonic() < end:
            try:
                if httpx.get(dash + "/api/version", timeout=2).status_code in (200, 401):
                    break
            except httpx.HTTPError:
                time.sleep(1)
        else:
            raise AssertionError("ray start --head did not bring up its dashboard within 90 s")
        cfg = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
        cfg["http_options"] = {"host": "127.0.0.1", "port": ports["http"]}
        config_file = Path(temp_dir) / "serve_config.yaml"
        config_file.write_text(yaml.safe_dump(cfg))
        yield {"env": env, "dash": dash, "gcs": f"127.0.0.1:{ports['gcs']}", "config": config_file,
               "url": f"http://127.0.0.1:{ports['http']}"}  # fmt: skip
    finally:
        # `ray start --block` takes half a minute to stop its processes one by one on SIGTERM;
        # the cluster lives in its own session and temp dir, so killing the whole group is enough.
        with contextlib.suppress(ProcessLookupError):  # (a head that failed to start is gone)
            os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(3)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)
        head.wait(30)
        shutil.rmtree(temp_dir, ignore_errors=True)


def background() -> dict:
    """The CLI's cluster and `serve deploy` on it, then `diffusion-serve serve` on a Ray of its
    own: for each, None or the error that stopped it (its test raises it)."""
    report = {}
    with cli_cluster() as cli:
        for part, run in (("deploy", deploy_then_status_then_shutdown), ("run", serve_run)):
            try:
                run(cli)
                report[part] = None
            except Exception as e:
                report[part] = e
    return report


def _serve(cli, *args, timeout=180):
    return subprocess.run(
        [str(BIN / "serve"), *args], env=cli["env"], capture_output=True, text=True, timeout=timeout
    )


def deploy_then_status_then_shutdown(cli) -> None:
    for _ in range(3):  # a deploy is idempotent: again when the connection dropped, and only then
        r = _serve(cli, "deploy", str(cli["config"]), "-a", cli["dash"])
        if r.returncode == 0 or "RemoteDisconnected" not in r.stderr:
            break
        # The dashboard answers before its agent, which takes the deploy, is up: on a loaded
        # machine it closed the first request's connection (a CI run, 2026-12-05).
        time.sleep(5)
    assert r.returncode == 0, r.stdout + r.stderr
    # The README's first image: with the shipped config's defaults, the star the prompt asks for.
    body = _wait_for_image(cli["url"], 180, prompt=FIRST_PROMPT, steps=None)
    assert body["model"] == "shapes" and len(body["data"]) == 1
    seen = read_image(Image.open(io.BytesIO(base64.b64decode(body["data"][0]["b64_json"]))))
    assert (seen.colour, seen.shape, seen.background) == ("yellow", "star", "black"), seen
    # The proxy guard the README's commands install: Serve's proxy would answer a plain 500.
    r = httpx.get(cli["url"] + "/health", headers={"X-Request-Id": b"\xff"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id", r.text
    status = _serve(cli, "status", "-a", cli["dash"])
    assert status.returncode == 0 and "RUNNING" in status.stdout, status.stdout + status.stderr
    scale_without_reloading(cli)
    r = _serve(cli, "shutdown", "-y", "-a", cli["dash"])
    assert r.returncode == 0, r.stdout + r.stderr


def scale_without_reloading(cli) -> None:
    """The README's way to change the replica count and the batching of a running app: the
    config's `deployments:` section, its `args:` unchanged. The replica that served keeps
    serving (its model is not loaded again) and takes the new batching; a second one starts."""

    def replicas():
        return httpx.get(cli["url"] + "/v1/status", timeout=30).json()["replicas"]

    first = replicas()[0]["replica_id"]
    cfg = yaml.safe_load(cli["config"].read_text())
    batching = {**cfg["applications"][0]["args"]["batching"], "batch_wait_ms": 20}
    cfg["applications"][0]["deployments"] = [
        {"name": "DiffusionReplica", "num_replicas": 2, "user_config": batching}
    ]
    scaled = cli["config"].with_name("scaled.yaml")
    scaled.write_text(yaml.safe_dump(cfg))
    r = _serve(cli, "deploy", str(scaled), "-a", cli["dash"])
    assert r.returncode == 0, r.stdout + r.stderr
    now = wait_for(lambda: got if len(got := replicas()) == 2 else None, 180, 1)
    assert first in {x["replica_id"] for x in now}, (first, now)
    assert all(x["batching"]["batch_wait_ms"] == 20 for x in now), now


def serve_run(cli) -> None:
    """The README's first command, `diffusion-serve serve serve_config.yaml`, in an environment
    without the proxy guard's variable: it becomes `serve run`, which starts a Ray of its own
    (`RAY_ADDRESS=local`: not the session's or the CLI's cluster) whose proxy has the guard."""
    env = {k: v for k, v in os.environ.items() if k not in (GUARD, "RAY_AUTH_MODE")}
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_ADDRESS="local")
    proc = subprocess.Popen(
        [str(BIN / "diffusion-serve"), "serve", str(cli["config"])], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        body = _wait_for_image(cli["url"], 240)
        assert body["model"] == "shapes"
        # The guard `diffusion-serve serve` set: Serve's proxy would answer a plain 500.
        r = httpx.get(cli["url"] + "/health", headers={"X-Request-Id": b"\xff"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id", r.text
        # exec: the process started is `serve run` itself, with the variable in its environment.
        argv = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        assert b"run" in argv and str(cli["config"]).encode() in argv, argv
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
        assert f"{GUARD}=serve_app.proxy:middlewares".encode() in environ
    finally:
        proc.send_signal(signal.SIGTERM)  # a background `serve run` ignores SIGINT
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
        # The Ray it started (its own session): whatever outlived it goes with the group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_serve_deploy_then_status_then_shutdown(background_report):
    if background_report["deploy"] is not None:
        raise background_report["deploy"]


def test_serve_run(background_report):
    if background_report["run"] is not None:
        raise background_report["run"]


def test_the_readme_and_the_playground_start_with_the_first_prompt():
    """The prompt the deploy test reads back is the one a new user's first request sends."""
    readme = (ROOT / "README.md").read_text()
    assert f'{{"prompt": "{FIRST_PROMPT}", "size": "64x64", "seed": 1}}' in readme
    page = (ROOT / "serve_app" / "playground.html").read_text()
    assert f'<textarea id="prompt" required>{FIRST_PROMPT}</textarea>' in page


def test_the_readme_and_the_deploy_guide_start_ray_with_the_proxy_guard():
    """The README's first command is `diffusion-serve serve`, which sets the guard the tests set
    (serve_app/proxy.py); docs/deploying.md exports it before `ray start --head`."""
    from serve_app.tools.cli import PROXY_GUARD

    readme = (ROOT / "README.md").read_text()
    assert PROXY_GUARD == (GUARD, os.environ[GUARD]) == (GUARD, "serve_app.proxy:middlewares")
    first = re.search(r"```bash\n(.*?)\n```", readme, re.S)[1]
    assert first == (
        "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e . && "
        "diffusion-serve serve serve_config.yaml"
    )
    guard = f"export {GUARD}={os.environ[GUARD]}"
    deploying = DEPLOYING.read_text()
    assert f"{guard}   # see" in deploying.split("ray start --head")[0].rsplit("```bash", 1)[1]


def test_diffusion_serve_serve_execs_serve_run_with_the_guard(monkeypatch):
    """`diffusion-serve serve [CONFIG] [ARGS...]` becomes `serve run CONFIG ARGS...` (CONFIG is
    serve_config.yaml unless the first argument is one), the `serve` beside this Python, with
    the guard in its environment unless the variable is set already."""
    from serve_app.tools import cli

    class Execd(Exception):
        pass

    ran = []

    def execv(path, argv):
        ran.append((path, argv[1:], os.environ.get(GUARD)))
        raise Execd

    monkeypatch.setattr(cli.os, "execv", execv)
    for args, mine, expected in [
        ([], None, ["run", "serve_config.yaml"]),
        (
            ["x.yaml", "--address", "local", "-a", "b"],
            None,
            ["run", "x.yaml", "--address", "local", "-a", "b"],
        ),
        (["--non-blocking"], "my.guard:m", ["run", "serve_config.yaml", "--non-blocking"]),
    ]:
        if mine:
            monkeypatch.setenv(GUARD, mine)
        else:
            monkeypatch.delenv(GUARD, raising=False)
        with pytest.raises(Execd):
            cli.main(["serve", *args])
        assert ran.pop() == (str(BIN / "serve"), expected, mine or "serve_app.proxy:middlewares")
