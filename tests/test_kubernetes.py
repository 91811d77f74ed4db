"""Running on Kubernetes (docs/kubernetes.md), checked without a cluster: the RayService manifest
against KubeRay's own CRD schema, its Serve config against Serve's deploy schema and the
project's validation (and the command that writes it), what the manifest wires (GPUs, keys,
the shared volume, probes), the Dockerfile against the README, and the Grafana dashboard's
queries against the metrics a running app exports."""

from __future__ import annotations

import concurrent.futures
import functools
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import jsonschema
import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from serve_app.config import AppConfig, AuthConfig, JobsConfig
from serve_app.ingress.access import OPEN_ROUTES
from serve_app.tools import kube
from tests.conftest import app_args, deploy, wait_for

ROOT = Path(__file__).resolve().parent.parent
KUBE = ROOT / "deploy" / "kubernetes"
MANIFEST = KUBE / "rayservice.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "diffusion-serve.json"
GUIDE = ROOT / "docs" / "kubernetes.md"
DEPLOYING = ROOT / "docs" / "deploying.md"
SECRET = "diffusion-serve-keys"


def manifest() -> dict:
    return yaml.safe_load(MANIFEST.read_text())


def serve_config() -> dict:
    return yaml.safe_load(manifest()["spec"]["serveConfigV2"])


def app_config() -> AppConfig:
    (app,) = serve_config()["applications"]
    return AppConfig.from_args(app["args"])


def groups(m: dict) -> dict[str, dict]:
    """Each pod group of the cluster by name ("head", then the worker groups')."""
    rc = m["spec"]["rayClusterConfig"]
    return {"head": rc["headGroupSpec"], **{g["groupName"]: g for g in rc["workerGroupSpecs"]}}


def containers(m: dict) -> dict[str, dict]:
    """The Ray container of each group (KubeRay's is the first)."""
    return {name: g["template"]["spec"]["containers"][0] for name, g in groups(m).items()}


# ---------------------------------------------------------------- KubeRay's schema


def crd() -> dict:
    (path,) = (KUBE / "crd").glob("rayservice-kuberay-v*.json")
    data = json.loads(path.read_text())
    assert path.name == f"rayservice-kuberay-{data['source']['tag']}.json"  # the file names its release
    assert data["kind"] == "RayService" and data["version"] == "v1"
    return data["openAPIV3Schema"]


def _strict(schema):
    """The schema as the API server applies it with strict field validation (kubectl's default):
    an object that lists its fields takes no other (Kubernetes refuses an unknown field), unless
    it keeps unknown fields."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if "properties" in out:
        # `properties` maps field names to schemas: its own keys are names, not keywords.
        out["properties"] = {k: _strict(v) for k, v in schema["properties"].items()}
        if "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    return out


def _list_type(validator, kind, instance, schema):
    """Kubernetes' list types: a `map` list has one item per key (ports, env, containers...)."""
    if not isinstance(instance, list):
        return
    if kind == "map":
        keys = schema.get("x-kubernetes-list-map-keys", [])
        seen = [tuple(item.get(k) for k in keys) for item in instance if isinstance(item, dict)]
    elif kind == "set":
        seen = [json.dumps(item, sort_keys=True) for item in instance]
    else:
        return
    for dup in {s for s in seen if seen.count(s) > 1}:
        yield jsonschema.ValidationError(f"{dup} is listed twice in a list of type {kind}")


@functools.cache
def crd_validator():
    cls = jsonschema.validators.extend(jsonschema.Draft7Validator, {"x-kubernetes-list-type": _list_type})
    return cls(_strict(crd()))


def crd_errors(doc: dict) -> list[str]:
    v = crd_validator()
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in v.iter_errors(doc)]


def test_the_manifest_is_a_rayservice_by_kuberays_own_schema():
    m = manifest()
    assert m["apiVersion"] == "ray.io/v1" and m["kind"] == "RayService"
    assert re.fullmatch(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?", m["metadata"]["name"])  # a DNS-1035 label
    assert crd_errors(m) == []
    # The schema's CEL rules (x-kubernetes-validations) guard managedBy only, which is not set.
    assert "managedBy" not in m["spec"] and "managedBy" not in m["spec"]["rayClusterConfig"]


@pytest.mark.parametrize(
    "change, says",
    [
        (lambda m: m["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].update(replica=1), "replica"),
        (lambda m: m["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].update(maxReplicas="4"), "'4'"),
        (lambda m: m["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].pop("groupName"), "groupName"),
        (lambda m: containers(m)["gpu"]["resources"]["limits"].update({"nvidia.com/gpu": "one"}), "one"),
        (lambda m: containers(m)["gpu"]["ports"].append({"containerPort": 8000, "name": "x"}), "twice"),
        (lambda m: m["spec"]["upgradeStrategy"].update(kind="NewCluster"), "kind"),
    ],
    ids=["unknown-field", "wrong-type", "missing-required", "bad-quantity", "duplicate-port", "typo"],
)
def test_the_schema_refuses_what_kubernetes_would(change, says):
    m = manifest()
    change(m)
    errors = crd_errors(m)
    assert errors and any(says in e for e in errors), errors


# ---------------------------------------------------------------- the Serve config and its command


def test_the_manifests_serve_config_is_what_the_command_writes_from_a_config_of_configs():
    text = MANIFEST.read_text()
    config, overlay = kube.sources(text)
    assert Path(config).parent.name == "configs" and (ROOT / config).is_file()
    assert overlay == kube.OVERLAY
    written = kube.render(config, overlay)
    assert kube.embedded(text) == written == manifest()["spec"]["serveConfigV2"]  # as YAML reads it
    # The configs/ file's own sections are there as it has them, beside the cluster's.
    (mine,) = yaml.safe_load((ROOT / config).read_text())["applications"]
    (theirs,) = serve_config()["applications"]
    cluster = yaml.safe_load((ROOT / overlay).read_text())["args"]
    for section, values in mine["args"].items():
        if section not in cluster:
            assert theirs["args"][section] == values, section


def test_the_command_checks_and_rewrites_the_manifest(tmp_path, monkeypatch, capsys):
    r = subprocess.run([sys.executable, "-m", "serve_app.kube", "--check"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    monkeypatch.chdir(ROOT)  # the sources are named from the repository's root
    stale = tmp_path / "rayservice.yaml"
    text = MANIFEST.read_text()
    stale.write_text(text.replace("default_steps: 30", "default_steps: 25"))
    assert kube.main(["--check", "--manifest", str(stale)]) == 1 and "stale" in capsys.readouterr().err
    assert kube.main(["--manifest", str(stale)]) == 0
    assert stale.read_text() == text  # only the Serve config changed, the rest as it was
    # Another model: the same manifest around configs/sdxl.yaml, which later runs remake.
    assert kube.main(["--manifest", str(stale), "--config", "configs/sdxl.yaml"]) == 0
    assert kube.sources(stale.read_text())[0] == "configs/sdxl.yaml"
    assert kube.main(["--check", "--manifest", str(stale)]) == 0
    # A cluster setting the project refuses is named, and nothing is written.
    bad = tmp_path / "cluster-args.yaml"
    bad.write_text("args:\n  jobs:\n    retention_s: -1\n")
    before = stale.read_text()
    capsys.readouterr()
    assert kube.main(["--manifest", str(stale), "--config", "configs/sd15.yaml", "--overlay", str(bad)]) == 2
    assert "jobs.retention_s" in capsys.readouterr().err and stale.read_text() == before
    # Per-deployment options (applied in place by Serve) pass through to Serve's schema.
    inplace = tmp_path / "in-place.yaml"
    inplace.write_text(
        "args: {}\ndeployments:\n  - name: DiffusionReplica\n    user_config: {max_batch_images: 4}\n"
    )
    (app,) = yaml.safe_load(kube.render("configs/sd15.yaml", str(inplace)))["applications"]
    assert app["deployments"] == [{"name": "DiffusionReplica", "user_config": {"max_batch_images": 4}}]
    inplace.write_text("args: {}\ndeployments:\n  - name: DiffusionReplica\n    num_replicas: many\n")
    with pytest.raises(kube.KubeError, match="num_replicas"):
        kube.render("configs/sd15.yaml", str(inplace))


def test_the_serve_config_passes_serves_deploy_schema_and_builds_the_app():
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    from serve_app.app import build_app

    cfg = serve_config()
    schema = ServeDeploySchema.model_validate(cfg)
    for app in schema.applications:
        assert app.import_path == "serve_app.app:build_app"
        build_app(app.args)
    broken = {**cfg, "applications": [{**cfg["applications"][0], "import_path": "build_app"}]}
    with pytest.raises(ValidationError, match="import path"):
        ServeDeploySchema.model_validate(broken)


# ---------------------------------------------------------------- what the manifest wires


def test_one_model_replica_per_gpu_pod_and_a_cpu_only_head():
    m, cfg = manifest(), app_config()
    head, gpu = groups(m)["head"], groups(m)["gpu"]
    c = containers(m)
    for where in ("requests", "limits"):
        assert "nvidia.com/gpu" not in c["head"]["resources"][where]
        assert int(c["gpu"]["resources"][where]["nvidia.com/gpu"]) == 1
    assert cfg.replica.num_gpus == 1 and cfg.model.device == "cuda"
    assert float(c["gpu"]["resources"]["limits"]["cpu"]) >= cfg.replica.num_cpus
    scaling = cfg.replica.autoscaling
    assert (gpu["minReplicas"], gpu["maxReplicas"]) == (scaling.min_replicas, scaling.max_replicas)
    assert m["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True
    # The head offers Ray no CPU; the ingress asks for none and for what only the head has.
    assert head["rayStartParams"]["num-cpus"] == "0" and cfg.ingress.num_cpus == 0
    for resource, amount in cfg.ingress.resources.items():
        assert float(head["resources"][resource]) >= amount * cfg.ingress.num_replicas
        assert resource not in gpu.get("resources", {})
    assert "nvidia.com/gpu" in {t["key"] for t in gpu["template"]["spec"]["tolerations"]}
    # A replica on a pod being removed has its graceful shutdown before the kubelet kills it.
    assert gpu["template"]["spec"]["terminationGracePeriodSeconds"] > cfg.replica.graceful_shutdown_timeout_s


def test_keys_come_from_the_secret_into_the_variables_the_app_reads():
    auth, jobs = AuthConfig(), JobsConfig()
    required = {auth.admin_keys_env: "admin-keys", auth.api_keys_env: "api-keys"}
    optional = {jobs.url_secret_env, jobs.webhook_secret_env}
    for name, c in containers(manifest()).items():
        env = {e["name"]: e for e in c["env"]}
        for var, key in required.items():
            ref = env[var]["valueFrom"]["secretKeyRef"]
            assert (ref["name"], ref["key"], ref.get("optional", False)) == (SECRET, key, False), name
        for var in optional:
            assert env[var]["valueFrom"]["secretKeyRef"]["name"] == SECRET, (name, var)
    cfg = app_config()
    assert not cfg.auth.api_keys and not cfg.auth.admin_keys and not cfg.auth.local_admin
    # The guide creates that Secret with those keys.
    line = next(ln for ln in GUIDE.read_text().splitlines() if "kubectl create secret generic" in ln)
    assert f"generic {SECRET}" in line
    assert all(f"--from-literal={key}=" in line for key in required.values()), line


def test_the_store_and_registries_are_on_the_volume_every_pod_mounts():
    m, cfg = manifest(), app_config()
    claims = {}
    for name, g in groups(m).items():
        spec = g["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {v["mountPath"]: v["name"] for v in spec["containers"][0]["volumeMounts"]}
        claims[name] = {p: volumes[v]["persistentVolumeClaim"]["claimName"]
                        for p, v in mounts.items() if "persistentVolumeClaim" in volumes[v]}  # fmt: skip
    (shared,) = {tuple(c.items()) for c in claims.values()}  # the same claim at the same path everywhere
    ((path, claim),) = shared
    pvc = yaml.safe_load((KUBE / "shared-volume.yaml").read_text())
    assert pvc["kind"] == "PersistentVolumeClaim" and pvc["metadata"]["name"] == claim
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    places = [cfg.jobs.store, cfg.lora.registry_path, *cfg.lora.allowed_roots, cfg.checkpoints.registry_path,
              *cfg.checkpoints.allowed_roots, cfg.profiling.trace_dir]  # fmt: skip
    for c in containers(m).values():
        env = {e["name"]: e.get("value") for e in c["env"]}
        places.append(env["HF_HOME"])
    outside = [p for p in places if not p.startswith(path.rstrip("/") + "/")]
    assert not outside, outside


def test_the_worker_probes_are_the_apps_health_routes_and_the_head_keeps_kuberays():
    m, cfg = manifest(), serve_config()
    port = cfg["http_options"]["port"]
    c = containers(m)
    for name in ("head", "gpu"):
        assert {"containerPort": port, "name": "serve"} in c[name]["ports"]
        assert {"containerPort": 8080, "name": "metrics"} in c[name]["ports"]  # KubeRay's metrics port
    gpu = c["gpu"]
    probes = {p: gpu[p]["httpGet"] for p in ("readinessProbe", "livenessProbe", "startupProbe")}
    assert probes["readinessProbe"] == {"path": "/health", "port": port}
    assert probes["livenessProbe"] == probes["startupProbe"] == {"path": "/live", "port": port}
    assert all(("GET", p["path"]) in OPEN_ROUTES for p in probes.values())  # kubelet sends no key
    # KubeRay sends the Serve config once the head is ready: /health there would never pass.
    assert not any(p in c["head"] for p in ("readinessProbe", "livenessProbe", "startupProbe"))
    assert m["spec"]["excludeHeadPodFromServeSvc"] is True
    monitor = yaml.safe_load((KUBE / "podmonitor.yaml").read_text())
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]


def test_every_pod_runs_the_image_of_the_ray_the_project_pins():
    import ray

    m = manifest()
    assert len({c["image"] for c in containers(m).values()}) == 1
    pin = re.search(r'"ray\[serve\]==([\d.]+)"', (ROOT / "pyproject.toml").read_text())[1]
    assert m["spec"]["rayClusterConfig"]["rayVersion"] == pin == ray.__version__


# ---------------------------------------------------------------- the image


def dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) of each line of the Dockerfile, continuations joined."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            op, _, rest = line.strip().partition(" ")
            out.append((op.upper(), " ".join(rest.split())))
    return out


def readme_first_command() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Two commands.*?```bash\n(.*?)\n```", readme, re.S)[1]
    return [part.strip() for part in block.split("&&")]


def test_the_image_installs_as_the_readme_does_on_a_cuda_base_without_weights():
    steps = dockerfile()
    readme = readme_first_command()
    # The install: what comes before the command that starts the service (`diffusion-serve serve`).
    install = readme[: next(i for i, p in enumerate(readme) if p.startswith(("diffusion-serve ", "export ")))]
    assert install[-1].startswith("pip install torch==")
    assert ("RUN", " && ".join(install)) in steps  # the README's install line, as it is
    assert steps[0][0] == "FROM" and steps[0][1].startswith("nvidia/cuda:")
    # Ray reads the proxy guard when it starts: the image runs `serve run` itself, so it sets the
    # variable that `diffusion-serve serve` sets, as docs/deploying.md exports it before `serve run`.
    guard = re.search(
        r"^export (RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=\S+)", DEPLOYING.read_text(), re.M
    )[1]
    env = " ".join(args for op, args in steps if op == "ENV")
    assert guard in env.split()
    # No weights: nothing downloads a model, and only the package and its configs go in.
    runs = " ".join(args for op, args in steps if op == "RUN")
    assert not re.search(r"huggingface|hf download|snapshot_download|from_pretrained|wget http|curl", runs)
    copied = set()
    for op, args in steps:
        if op == "COPY":
            *sources, _ = [a for a in args.split() if not a.startswith("--")]
            copied |= {src.removeprefix("./").rstrip("/") for src in sources}
    ignore = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()]
    allowed = {ln[1:].rstrip("/") for ln in ignore if ln.startswith("!")}
    assert "*" in ignore and copied == allowed  # the image takes what it copies, all else stays out
    user = next(args for op, args in steps if op == "RUN" and "useradd" in args)
    fs_group = {g["template"]["spec"]["securityContext"]["fsGroup"] for g in groups(manifest()).values()}
    assert fs_group == {int(re.search(r"--uid (\d+)", user)[1])}


# ---------------------------------------------------------------- the dashboard


def queries() -> list[tuple[str, str, str]]:
    """(panel, PromQL, legend) of every dashboard query."""
    d = json.loads(DASHBOARD.read_text())
    out = []
    for p in d["panels"]:
        for t in p.get("targets", []):
            out.append((p["title"], t["expr"], t.get("legendFormat", "")))
    return out


def variables() -> list[tuple[str, str]]:
    """(metric, label) of the dashboard's `label_values(...)` variables."""
    d = json.loads(DASHBOARD.read_text())
    found = []
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            found.append(re.fullmatch(r"label_values\((\w+), *(\w+)\)", v["definition"]).groups())
    return found


def exported_labels(text: str) -> dict[str, set[str]]:
    """Each sample name of a Prometheus scrape (`_bucket`, `_total` and all) and its labels."""
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, set()).update(s.labels)
    return out


def _parse(expr: str):
    # Grafana's own variables, as it fills them in.
    return promql_parser.parse(expr.replace("$__rate_interval", "5m").replace("$__interval", "1m"))


def _labels(node, exported: dict[str, set[str]], problems: list[str]) -> set[str]:
    """The labels `node`'s series carry; what it names that is not exported goes to `problems`."""
    p = promql_parser
    if isinstance(node, p.VectorSelector):
        if node.name not in exported:
            problems.append(f"metric {node.name} is not exported")
            return set()
        have = exported[node.name]
        problems += [
            f"{node.name} has no label {m.name}" for m in node.matchers.matchers if m.name not in have
        ]
        return set(have)
    if isinstance(node, p.MatrixSelector):
        return _labels(node.vector_selector, exported, problems)
    if isinstance(node, p.ParenExpr | p.UnaryExpr | p.SubqueryExpr):
        return _labels(node.expr, exported, problems)
    if isinstance(node, p.AggregateExpr):
        inner = _labels(node.expr, exported, problems)
        named = set(node.modifier.labels) if node.modifier else set()
        problems += [f"`{node.op}` by {x}: not a label of what it sums" for x in sorted(named - inner)]
        if node.modifier and node.modifier.type == p.AggModifierType.By:
            return named
        return inner - named
    if isinstance(node, p.BinaryExpr):
        lhs, rhs = _labels(node.lhs, exported, problems), _labels(node.rhs, exported, problems)
        matching = node.modifier.matching if node.modifier else None
        if matching is not None:
            problems += [f"on/ignoring {x}: not a label of both sides" for x in matching.labels
                         if x not in lhs & rhs]  # fmt: skip
        return lhs or rhs
    if isinstance(node, p.Call):
        args = [_labels(a, exported, problems) for a in node.args if not isinstance(a, p.StringLiteral)]
        got = set().union(*args) if args else set()
        if node.func.name == "histogram_quantile":
            if "le" not in got:
                problems.append("histogram_quantile of series without `le`")
            return got - {"le"}
        if node.func.name == "label_replace":
            return got | {node.args[1].val}
        return got
    return set()


def dashboard_problems(expr: str, legend: str, exported: dict[str, set[str]]) -> list[str]:
    problems: list[str] = []
    out = _labels(_parse(expr), exported, problems)
    for x in re.findall(r"{{ *(\w+) *}}", legend):
        if x not in out:
            problems.append(f"legend {{{{{x}}}}}: not a label of the result")
    return problems


def names_in(expr: str) -> set[str]:
    return set(re.findall(r"\bray_\w+", expr))


SNAPSHOT = """\
# TYPE ray_diffusion_requests_total counter
ray_diffusion_requests_total{model="m",outcome="done",WorkerId="w"} 3.0
# TYPE ray_diffusion_stage_latency_ms histogram
ray_diffusion_stage_latency_ms_bucket{le="5.0",model="m",stage="total"} 0.0
ray_diffusion_stage_latency_ms_bucket{le="+Inf",model="m",stage="total"} 1.0
ray_diffusion_stage_latency_ms_sum{model="m",stage="total"} 1.0
ray_diffusion_stage_latency_ms_count{model="m",stage="total"} 1.0
"""


@pytest.mark.parametrize(
    "expr, legend, says",
    [
        ("sum by (model) (rate(ray_diffusion_request_total[5m]))", "", "ray_diffusion_request_total is not"),
        ("sum by (tenant) (rate(ray_diffusion_requests_total[5m]))", "", "by tenant"),
        ('rate(ray_diffusion_requests_total{stage="x"}[5m])', "", "no label stage"),
        (
            "histogram_quantile(0.9, sum by (stage) (rate(ray_diffusion_stage_latency_ms_bucket[5m])))",
            "",
            "`le`",
        ),
        ("sum by (model) (rate(ray_diffusion_requests_total[5m]))", "{{outcome}}", "legend {{outcome}}"),
        ("diffusion_requests_total", "", "diffusion_requests_total is not"),  # without Ray's prefix
    ],
)
def test_the_dashboard_check_finds_a_metric_or_label_that_is_not_exported(expr, legend, says):
    exported = exported_labels(SNAPSHOT)
    assert dashboard_problems('sum by (model, outcome) (rate(ray_diffusion_requests_total[5m]))',
                              "{{model}} {{outcome}}", exported) == []  # fmt: skip
    found = dashboard_problems(expr, legend, exported)
    assert any(says in f for f in found), found


def test_the_dashboard_covers_the_apps_metrics_and_each_query_parses():
    d = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
    named = set()
    for _, expr, _ in queries():
        _parse(expr)
        named |= names_in(expr)
    wanted = {"requests_total", "images_total", "stage_latency_ms_bucket", "queue_length",
              "batch_images_bucket", "rejected_total", "retries_total", "tenant_images_total",
              "tenant_requests", "tenant_queue_wait_ms_bucket", "tenant_quota_rejected_total"}  # fmt: skip
    assert {f"ray_diffusion_{w}" for w in wanted} <= named
    by = " ".join(e for _, e, _ in queries())
    assert "sum by (model" in by and "sum by (tenant" in by and "by (le, stage)" in by


# Shown only after a refusal, a lost replica or an adapter load: checked on an app of their own (below).
AFTER_FAULTS = {"ray_diffusion_rejected_total", "ray_diffusion_retries_total",
                "ray_diffusion_tenant_quota_rejected_total", "ray_diffusion_lora_loads_total"}  # fmt: skip


def scrape() -> dict[str, set[str]]:
    import ray

    port = ray._private.worker.global_worker.node.metrics_export_port
    return exported_labels(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)


def check_dashboard(exported: dict[str, set[str]], only: set[str] | None) -> list[str]:
    problems = []
    for metric, label in variables():
        if only is None or metric in only:
            if label not in exported.get(metric, ()):
                problems.append(f"variable label_values({metric}, {label}): not exported")
    for panel, expr, legend in queries():
        names = names_in(expr)
        if only is None and names & AFTER_FAULTS or only is not None and not names & only:
            continue
        problems += [f"{panel}: {p}" for p in dashboard_problems(expr, legend, exported)]
    return problems


def _wait_for_metrics(names: set[str], keep_busy=None, timeout: float = 90) -> dict[str, set[str]]:
    """A scrape that has every one of `names`. Ray drops a gauge from its export some 20 s after
    it was last set, so `keep_busy()` (a request) runs before each scrape that lacks one."""
    seen: set[str] = set()

    def ready():
        exported = scrape()
        seen.update(exported)
        if names <= exported.keys():
            return exported
        if keep_busy is not None:
            keep_busy()
        return None

    try:
        return wait_for(ready, timeout, 2)
    except AssertionError:
        raise AssertionError(f"never exported: {sorted(names - seen)}") from None


def test_every_dashboard_query_names_metrics_and_labels_a_running_app_exports(client):
    assert client.get("/live").status_code == 200 and client.get("/health").status_code == 200

    def requests():
        for body in ({"prompt": "dashboard", "seed": 1}, {"prompt": "dashboard", "n": 2, "seed": 2}):
            assert client.post("/v1/images/generations", json=body).status_code == 200

    requests()
    wanted = set().union(*(names_in(e) for _, e, _ in queries())) - AFTER_FAULTS
    exported = _wait_for_metrics(wanted, requests)
    assert check_dashboard(exported, None) == []


# ---------------------------------------------------------------- an app of its own: faults, a new version

OPS, OPEN_KEY, CAPPED_KEY, ADMIN_KEY = "k8s-ops", "k8s-open-key", "k8s-capped-key", "k8s-admin-key"


@pytest.fixture(scope="module")
def ops_app(ray_cluster):
    """Two replicas that take one request each (and one more waits), a tenant of one image a
    minute: what it takes to make a 429 of each kind and a retry."""
    from ray import serve

    args = app_args(
        replica={"num_replicas": 2, "max_ongoing_requests": 1, "max_queued_requests": 1},
        batching={"batch_wait_ms": 5},
        ingress={"max_attempts": 5},
        auth={"admin_keys": [ADMIN_KEY]},
        tenants=None,
    )
    args["tenants"] = [{"name": "capped", "api_keys": [CAPPED_KEY], "images_per_minute": 1},
                       {"name": "open", "api_keys": [OPEN_KEY]}]  # fmt: skip
    yield deploy(OPS, args), args
    serve.delete(OPS, _blocking=False)


def _post(base_url: str, prefix: str, key: str, **body) -> httpx.Response:
    return httpx.post(f"{base_url}{prefix}/v1/images/generations", json={"prompt": "ops", **body},
                      headers={"Authorization": f"Bearer {key}"}, timeout=120)  # fmt: skip


@pytest.mark.slow
def test_the_dashboards_refusal_and_retry_queries_name_what_the_app_exports(ops_app, base_url):
    from serve_app.testing import SLOW_MARKER, fault_token_path

    prefix, _ = ops_app
    assert _post(base_url, prefix, CAPPED_KEY).status_code == 200
    r = _post(base_url, prefix, CAPPED_KEY)
    assert r.status_code == 429 and r.json()["error"]["param"] == "images_per_minute", r.text
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        slow = {"prompt": f"ops {SLOW_MARKER}", "num_inference_steps": 6}
        codes = list(
            pool.map(lambda i: _post(base_url, prefix, OPEN_KEY, seed=i, **slow).status_code, range(12))
        )
    assert 429 in codes and 200 in codes, codes
    token = "k8s-dashboard"
    Path(fault_token_path(token)).touch()
    r = httpx.post(f"{base_url}{prefix}/v1/rpc", json={"method": "arm_fatal_once", "args": [token]},
                   headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
    assert _post(base_url, prefix, OPEN_KEY, seed=99).status_code == 200  # served by the other replica
    # An adapter registered, used once (a load on a replica) and removed again.
    from serve_app.tools.lora import make_adapter
    from tests.conftest import ADAPTER_DIR

    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    path = make_adapter(str(ADAPTER_DIR / "k8s-dashboard.safetensors"), seed=61)
    r = httpx.post(f"{base_url}{prefix}/v1/loras", json={"name": "k8s-dashboard", "path": str(path)},
                   headers=admin, timeout=60)  # fmt: skip
    assert r.status_code in (200, 201), r.text
    try:
        used = _post(base_url, prefix, OPEN_KEY, seed=98, loras=[{"name": "k8s-dashboard"}])
        assert used.status_code == 200, used.text
    finally:
        httpx.delete(f"{base_url}{prefix}/v1/loras/k8s-dashboard", headers=admin, timeout=60)
    exported = _wait_for_metrics(AFTER_FAULTS)
    assert check_dashboard(exported, AFTER_FAULTS) == []


def _roll(base_url: str, client: httpx.Client, prefix: str, args: dict, replicas: int) -> tuple[list, int]:
    """Deploy `args` (a new version) under steady traffic, one request after another, until
    `replicas` new replicas serve: each answer's (status, Retry-After), and the fewest model
    replicas Serve had running meanwhile."""
    from ray import serve

    def serving() -> set[str]:
        r = client.get(f"{prefix}/v1/status", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        if r.status_code != 200:
            return set()
        return {x["replica_id"] for x in r.json()["replicas"] if x["healthy"]}

    def running() -> int:
        states = serve.status().applications[OPS].deployments["DiffusionReplica"].replica_states
        return states.get("RUNNING", 0)

    before = serving()
    answers: list = []
    stop = threading.Event()

    def traffic():
        i = 0
        while not stop.is_set():
            r = _post(base_url, prefix, OPEN_KEY, seed=i)
            answers.append((r.status_code, r.headers.get("retry-after")))
            i += 1

    fewest = running()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        sent = pool.submit(traffic)
        wait_for(lambda: len(answers) >= 2, 60)
        deployed = pool.submit(deploy, OPS, args)  # returns once the new version runs
        end = time.monotonic() + 180
        while not (deployed.done() and len(now := serving()) == replicas and not now & before):
            assert time.monotonic() < end, "the new version never took over"
            fewest = min(fewest, running())
            time.sleep(0.1)
        deployed.result()
        n = len(answers)
        wait_for(lambda: len(answers) >= n + 2, 60)  # and the new ones serve
        stop.set()
        sent.result(60)
    return answers, fewest


@pytest.mark.slow
def test_a_new_model_version_rolls_over_two_replicas_without_a_failed_request(ops_app, base_url, client):
    """docs/kubernetes.md: with two replicas, a changed `args` (a new model version) replaces
    them one at a time while the other serves; with one, there is a spell with none running."""
    prefix, args = ops_app
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}

    def healthy() -> int:
        return sum(r["healthy"] for r in client.get(f"{prefix}/v1/status", headers=auth).json()["replicas"])

    wait_for(lambda: healthy() == 2, 120, 1)  # the one the fault test broke is back
    new_weights = {**args, "model": {**args["model"], "seed": 7}}
    answers, fewest = _roll(base_url, client, prefix, new_weights, 2)
    assert answers and {code for code, _ in answers} == {200} and fewest >= 1, (fewest, answers)
    one = {**new_weights, "model": {**args["model"], "seed": 8}}
    one["replica"] = {**args["replica"], "num_replicas": 1}
    answers, fewest = _roll(base_url, client, prefix, one, 1)
    assert fewest == 0  # the old replica left before the new one had loaded
    # A request then waited for the new replica or was told when to come back.
    assert {code for code, _ in answers} <= {200, 503} and all(ra for code, ra in answers if code == 503)


def test_the_guide_names_what_exists():
    """The files, commands and names docs/kubernetes.md points at."""
    guide = GUIDE.read_text()
    for path in re.findall(r"`((?:deploy|configs|docs|tests|serve_app)/[\w./-]+)`", guide):
        assert (ROOT / path).exists(), path
    assert "python -m serve_app.kube" in guide and "--check" in guide
    name = manifest()["metadata"]["name"]
    assert f"svc/{name}-serve-svc" in guide and f"svc/{name}-head-svc" in guide
