"""Shared fixtures: one Ray instance and one Serve app for the whole session.

A cold `ray.init` plus `serve.run` costs 10-15 s on the 2-core machines, so every test that
needs the serving stack shares the `app` fixture; tests that need a different deployment
add it with `deployed(...)` or `app_factory`, under its own name and route prefix, and it is
deleted when they are done.
"""

from __future__ import annotations

import contextlib
import copy
import os
import socket
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Serve says in a deployment's status that its replicas wait for resources after this long
# (30 s by default): a placement group that cannot be placed shows in seconds.
os.environ.setdefault("RAY_SERVE_SLOW_STARTUP_WARNING_S", "3")
os.environ.setdefault("RAY_SERVE_SLOW_STARTUP_WARNING_PERIOD_S", "3")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The proxy's X-Request-Id guard, as `diffusion-serve serve` and docs/deploying.md start Ray (the
# documented alias serve_app/proxy.py of serve_app/ingress/proxy.py).
os.environ.setdefault("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", "serve_app.proxy:middlewares")

import httpx  # noqa: E402
import pytest  # noqa: E402

APP_NAME = "diffusion-test"
# Adapter files and registries of this test session live here (an allowed root of the test apps).
SESSION_DIR = Path(tempfile.mkdtemp(prefix="diffusion-serve-tests-"))
ADAPTER_DIR = SESSION_DIR / "adapters"
ADAPTER_DIR.mkdir()

# The configuration the shared test app runs: the embedded model at test-friendly sizes.
TEST_ARGS = {
    "model": {
        "source": "builtin:tiny-sd",
        "device": "cpu",
        "default_height": 32,
        "default_width": 32,
        "default_steps": 3,
        "warmup_steps": 1,
        # The names OpenAI clients send unless told otherwise (test_openai_clients.py).
        "aliases": ["dall-e-2", "dall-e-3", "gpt-image-1"],
        "engine_extension": "serve_app.testing:FaultInjection",
        # One torch thread per replica: with several replicas, the test process and Ray on two
        # cores, more threads only wait on each other (measured: the suite's CPU time 736 s -> 589 s).
        "cpu_threads": 1,
    },
    "limits": {"max_pixels": 128 * 128, "max_side": 128, "max_steps": 50, "max_images": 4, "max_prompts": 6},
    "replica": {"num_replicas": 1, "num_cpus": 0, "health_check_period_s": 2, "health_check_timeout_s": 30},
    # A long batch window and no early start, so that requests sent together by a test share a
    # pipeline call however slowly a loaded machine delivers them.
    "batching": {"max_batch_images": 8, "batch_wait_ms": 100, "batch_gap_ms": 0},
    "ingress": {"num_cpus": 0, "request_timeout_s": 120},
    # The tests call the admin routes from this machine without a key (the local-demo opt-in);
    # test_auth.py checks that without it they are closed.
    "auth": {"local_admin": True},
    "jobs": {"store": str(SESSION_DIR / "store"), "webhook_hosts": ["127.0.0.1"], "lease_s": 3,
             "sweep_interval_s": 0.5, "webhook_secret": "test-webhook-key", "webhook_backoff_s": 0.2},
    "lora": {"registry_path": str(SESSION_DIR / "registry.json"), "allowed_roots": [str(ADAPTER_DIR)],
             "max_loaded": 2, "max_per_request": 2, "max_file_mb": 1},
}  # fmt: skip


def app_args(**overrides: dict) -> dict:
    """TEST_ARGS with the given sections updated (`replica={"num_replicas": 2}`); a section
    given as None is left out (its defaults apply)."""
    args = copy.deepcopy(TEST_ARGS)
    for section, values in overrides.items():
        if values is None:
            args.pop(section, None)
        else:
            args[section] = {**args.get(section, {}), **values}
    return args


def deploy(name: str, args: dict) -> str:
    """Deploy `args` as app `name` at route prefix `/name` beside the shared app."""
    from ray import serve

    from serve_app.app import build_app

    serve.run(build_app(args), name=name, route_prefix=f"/{name}")
    return f"/{name}"


@contextlib.contextmanager
def deployed(name: str, **overrides: dict):
    """An app of its own for a module or a test (yields its route prefix), deleted after."""
    from ray import serve

    try:
        yield deploy(name, app_args(**overrides))
    finally:
        serve.delete(name, _blocking=False)  # its replicas stop while the next test runs


@contextlib.contextmanager
def engine_cache(**model: object):
    """Embedded engines on the CPU by builtin name (`get("tiny-flux")`), each built on first use
    with `model` settings and closed on the way out."""
    from serve_app.config import ModelConfig
    from serve_app.engine import DiffusionEngine

    made: dict = {}

    def get(name: str) -> DiffusionEngine:
        if name not in made:
            made[name] = DiffusionEngine(
                ModelConfig(source=f"builtin:{name}", device="cpu", warmup=False, **model)
            )
        return made[name]

    try:
        yield get
    finally:
        for e in made.values():
            e.close()


def replica_ids(client, prefix: str = "") -> list[str]:
    """The ids of the app's image replicas (`/v1/status`): the same after hostile requests when
    none of them restarted a replica."""
    st = client.get(f"{prefix}/v1/status").json()
    return sorted(r["replica_id"] for m in st["models"] for r in m["replicas"])


def wait_for(pred, timeout: float = 60.0, interval: float = 0.05):
    """Poll `pred` until it returns something truthy; return that, or fail after `timeout` s."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")


@contextlib.contextmanager
def replica_held(client: httpx.Client, prefix: str = "", steps: int = 40):
    """A slow request running on the app's one replica for the body's length, so that requests
    sent meanwhile queue and start together when it ends, however a loaded machine spreads
    their arrivals (past any batch window). Yields `queued()`, the replica's queued requests."""
    from serve_app.testing import SLOW_MARKER

    hold = f"hold-{time.monotonic_ns()}"
    body = {"prompt": f"hold {SLOW_MARKER}", "num_inference_steps": steps, "request_id": hold}
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(client.post, f"{prefix}/v1/images/generations", json=body)

        def running() -> bool:
            r = client.get(f"{prefix}/v1/requests/{hold}")
            return r.status_code == 200 and r.json()["state"] == "running"

        wait_for(running, 60)
        yield lambda: client.get(f"{prefix}/v1/status").json()["replicas"][0]["queued_requests"]
        assert held.result().status_code == 200, held.result().text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The fast layer (`-m "not slow"`) proves each path on the SD twin; the other families' twins,
# parametrized by `name`, run in the slow layer with everything else `.ci/run` runs.
OTHER_FAMILIES = {"tiny-sdxl", "tiny-sd3", "tiny-flux", "tiny-wan", "tiny-flux-kontext"}


def pytest_collection_modifyitems(items):
    for item in items:
        spec = getattr(item, "callspec", None)
        if spec is not None and spec.params.get("name") in OTHER_FAMILIES:
            item.add_marker(pytest.mark.slow)
    # Three groups, file order kept within each: the modules that run in this process alone go
    # first, and while they run the session's cluster and shared app start (`_start_early`);
    # then the modules on that cluster; then the tests of the scenarios with clusters of their
    # own, which have run beside the others (`background_report`).
    on_cluster = {item.module.__name__ for item in items if "ray_cluster" in item.fixturenames}

    def group(item) -> int:
        if item.get_closest_marker("own_cluster"):
            return 2
        return item.module.__name__ in on_cluster

    items.sort(key=group)


# Scenarios that start Ray clusters of their own (the CLI's, several nodes, direct ingress): the
# two cores were a third idle under the tests on the session's cluster, which wait on timers,
# leases and replicas starting. Each scenario module's `background()` runs in one thread from
# the first of those tests on, one scenario after another, and its tests, sorted last, read what
# it reported. (Started with the session instead, they slowed the in-process tests, which keep
# both cores busy: the suite took 615 s against 558-565 s.)
_background_pool = ThreadPoolExecutor(1, thread_name_prefix="scenario")
_background: dict[str, Future] = {}
_background_started = False


def _start_background(items) -> None:
    for item in items:
        scenario = getattr(item.module, "background", None)
        if scenario is not None and item.module.__name__ not in _background:
            _background[item.module.__name__] = _background_pool.submit(scenario)


def pytest_runtest_setup(item):
    global _background_started
    if not _background_started and (
        "ray_cluster" in item.fixturenames or item.get_closest_marker("own_cluster")
    ):
        _background_started = True
        _start_background(item.session.items)


def pytest_sessionfinish(session):
    # Interrupted: the scenarios not started yet are dropped; the running one ends and cleans up.
    _background_pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture
def background_report(request):
    """What this module's `background()` returned (it raised: the same error here)."""
    _start_background([request.node])
    return _background[request.module.__name__].result(timeout=900)


def child_scenario(script: str, timeout: float) -> dict:
    """Run `script` (a test module whose `__main__` writes its scenario's report as JSON to the
    file named by its argument) in a child process; the report."""
    import json
    import subprocess
    import sys

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        proc = subprocess.run(
            [sys.executable, script, str(out)], cwd=Path(__file__).parent.parent,
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
        return json.loads(out.read_text())


@pytest.fixture(scope="session")
def ray_cluster():
    import ray
    from ray import serve

    ray.init(
        address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False
    )
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    # The session's cluster goes whole: Serve's orderly shutdown of every app first took 5-7 s.
    ray.shutdown()


def _deploy_shared_app() -> None:
    """Start deploying the shared app (once) without waiting for it."""
    from ray import serve
    from ray.serve.api import RunTarget

    from serve_app.app import build_app

    if APP_NAME not in serve.status().applications:
        serve.run_many(
            [RunTarget(build_app(TEST_ARGS), name=APP_NAME, route_prefix="/")],
            wait_for_ingress_deployment_creation=False,
            wait_for_applications_running=False,
        )


@pytest.fixture(scope="session", autouse=True)
def _start_early(request):
    """When the session needs the shared app, start the cluster and the app at its first test:
    the in-process tests sorted before the app's users run while its replica starts (about
    10 s, most of it the replica's imports)."""
    if any("app" in item.fixturenames for item in request.session.items):
        request.getfixturevalue("ray_cluster")
        _deploy_shared_app()


@pytest.fixture(scope="session")
def app(ray_cluster):
    """The shared app, running; its base URL."""
    from ray import serve

    _deploy_shared_app()

    def running():
        st = serve.status().applications[APP_NAME]
        if st.status == "DEPLOY_FAILED":
            pytest.fail(f"the shared test app failed to start: {st.message} {st.deployments}")
        return st.status == "RUNNING"

    wait_for(running, 180, 0.2)
    return ray_cluster


# What to do after a test (its node id): session fixtures free what only earlier tests use.
_AFTER: dict[str, Callable[[], object]] = {}


def pytest_runtest_teardown(item, nextitem):
    if (action := _AFTER.pop(item.nodeid, None)) is not None:
        action()


# The keys of `keyed_app`: two users and an admin.
USER_KEY, USER_KEY_B, ADMIN_KEY = "user-key-8f3a", "user-key-b7e2", "admin-key-1c9d"
# Its jobs: no webhook allow-list (webhooks reach public addresses only, as in serve_config.yaml)
# and small bounds on unfinished and dispatched jobs.
KEYED_JOBS = {"webhook_hosts": [], "max_queued_per_caller": 3, "max_queued": 5, "max_running": 2}


@pytest.fixture(scope="session")
def keyed_app(request, ray_cluster):
    """An app that needs API keys, with a short batch window (the shared app waits 100 ms to
    batch test requests): test_auth checks its keys, test_soak sends it mixed traffic,
    test_hostile has two users try each other's requests and jobs. One app for all, since
    every app started costs about 10 s; deleted after the last test that uses it. Its route
    prefix."""
    from ray import serve

    name = "keyed"
    users = [item for item in request.session.items if "keyed_app" in item.fixturenames]
    _AFTER[users[-1].nodeid] = lambda: serve.delete(name, _blocking=False)
    return deploy(
        name,
        app_args(
            auth={"api_keys": [USER_KEY, USER_KEY_B], "admin_keys": [ADMIN_KEY]},
            batching={"batch_wait_ms": 5},
            jobs=KEYED_JOBS,
        ),
    )


@pytest.fixture
def app_factory(ray_cluster):
    """`make(name, **overrides)` deploys an app for one test; all are deleted after it."""
    from ray import serve

    names = []

    def make(name, **overrides):
        names.append(name)
        return deploy(name, app_args(**overrides))

    yield make
    for n in names:
        serve.delete(n, _blocking=False)


@pytest.fixture(scope="session")
def base_url(app) -> str:
    return app


@pytest.fixture(scope="session")
def client(base_url):
    with httpx.Client(base_url=base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def handle(app):
    from ray import serve

    return serve.get_app_handle(APP_NAME)
