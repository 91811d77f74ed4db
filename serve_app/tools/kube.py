"""`python -m serve_app.kube`: write the Serve config of the KubeRay manifest from a `configs/` file.

The RayService manifest (deploy/kubernetes/rayservice.yaml) carries its Serve config as the text
of `spec.serveConfigV2`. That text is made here, never by hand: a config of `configs/` with the
cluster's settings (deploy/kubernetes/cluster-args.yaml: the shared store and registries, where
the ingress runs) merged into each application's `args`, validated as `serve run` would, and
written into the manifest in place (the rest of the file, comments included, is left as it is).
Its first line names its sources, so a later run without `--config` remakes it from the same.

    python -m serve_app.kube                              # remake it from the sources it names
    python -m serve_app.kube --config configs/sdxl.yaml   # serve another model
    python -m serve_app.kube --check                      # exit 1 if the manifest is stale
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path
from typing import Any

import yaml

MANIFEST = "deploy/kubernetes/rayservice.yaml"
OVERLAY = "deploy/kubernetes/cluster-args.yaml"
_KEY = re.compile(r"^(?P<indent> *)serveConfigV2: \|\n$")
_SOURCES = re.compile(r"^# sources: (?P<config>\S+) \+ (?P<overlay>\S+)$", re.M)


class KubeError(Exception):
    pass


def merge(base: Any, over: Any) -> Any:
    """`over` merged into `base`: a mapping key by key, anything else replaces."""
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for k, v in over.items():
            out[k] = merge(base.get(k), v)
        return out
    return copy.deepcopy(over)


def render(config: str, overlay: str) -> str:
    """The Serve config text of the manifest: `config` with `overlay`'s `args` merged into every
    application's args (and its `deployments`, if any, as every application's). Refused, with a
    KubeError naming the field, unless it passes Serve's own schema and every application's args
    the project's validation."""
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    from serve_app.config import AppConfig

    serve_cfg = _load(config)
    extra = _load(overlay)
    unknown = set(extra) - {"args", "deployments"}
    if unknown:
        raise KubeError(
            f"{overlay}: only `args:` and `deployments:` go there, not {', '.join(sorted(unknown))}"
        )
    apps = serve_cfg.get("applications") or []
    if not apps:
        raise KubeError(f"{config}: no `applications:`")
    for app in apps:
        app["args"] = merge(app.get("args") or {}, extra.get("args") or {})
        if "deployments" in extra:  # Serve's per-deployment options: applied in place
            app["deployments"] = copy.deepcopy(extra["deployments"])
        try:
            AppConfig.from_args(app["args"])
        except ValidationError as e:
            raise KubeError(f"application {app.get('name')!r}: {e}") from None
    try:
        ServeDeploySchema.model_validate(serve_cfg)
    except ValidationError as e:
        raise KubeError(f"{config}: not a Serve config: {e}") from None
    header = (
        "# Written by `python -m serve_app.kube`: edit these two files and run it again.\n"
        f"# sources: {config} + {overlay}\n"
    )
    return header + yaml.safe_dump(serve_cfg, sort_keys=False, default_flow_style=False, width=100)


def _load(path: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise KubeError(f"cannot read {path}: {e.strerror}") from None
    if not isinstance(data, dict):
        raise KubeError(f"{path}: not a YAML mapping")
    return data


def _block(lines: list[str], manifest: str) -> tuple[int, int, str]:
    """Where the `serveConfigV2: |` block's lines are (start, end) and their indentation."""
    keys = [i for i, line in enumerate(lines) if _KEY.match(line)]
    if len(keys) != 1:
        raise KubeError(f"{manifest}: needs exactly one `serveConfigV2: |` line, found {len(keys)}")
    start = keys[0] + 1
    indent = " " * (len(_KEY.match(lines[keys[0]])["indent"]) + 2)
    end = start
    while end < len(lines) and (lines[end].startswith(indent) or not lines[end].strip()):
        end += 1
    while end > start and not lines[end - 1].strip():  # blank lines after the block stay outside
        end -= 1
    return start, end, indent


def embedded(manifest_text: str, manifest: str = MANIFEST) -> str:
    """The Serve config text the manifest carries now."""
    lines = manifest_text.splitlines(keepends=True)
    start, end, indent = _block(lines, manifest)
    return "".join(line[len(indent) :] if line.strip() else line.lstrip(" ") for line in lines[start:end])


def replace(manifest_text: str, serve_config: str, manifest: str = MANIFEST) -> str:
    """The manifest with its `serveConfigV2` block holding `serve_config`."""
    lines = manifest_text.splitlines(keepends=True)
    start, end, indent = _block(lines, manifest)
    body = [indent + line if line.strip() else "\n" for line in serve_config.splitlines(keepends=True)]
    return "".join(lines[:start] + body + lines[end:])


def sources(manifest_text: str, manifest: str = MANIFEST) -> tuple[str, str]:
    """The config and overlay the manifest's Serve config was written from."""
    found = _SOURCES.search(embedded(manifest_text, manifest))
    if found is None:
        raise KubeError(f"{manifest}: its Serve config names no sources; give --config")
    return found["config"], found["overlay"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serve_app.kube", description=__doc__.split("\n\n")[0])
    ap.add_argument("--manifest", default=MANIFEST, help=f"the RayService manifest (default {MANIFEST})")
    ap.add_argument("--config", help="a Serve config of configs/ (default: the one the manifest names)")
    ap.add_argument("--overlay", help=f"the cluster's settings (default: the manifest's, else {OVERLAY})")
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if the manifest is stale")
    a = ap.parse_args(argv)
    try:
        text = Path(a.manifest).read_text()
        named = sources(text, a.manifest) if a.config is None else (a.config, a.overlay or OVERLAY)
        config, overlay = a.config or named[0], a.overlay or named[1]
        new = replace(text, render(config, overlay), a.manifest)
    except OSError as e:
        print(f"error: cannot read {a.manifest}: {e.strerror}", file=sys.stderr)
        return 2
    except KubeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if new == text:
        print(f"{a.manifest}: up to date with {config} + {overlay}")
        return 0
    if a.check:
        print(f"{a.manifest} is stale: run `python -m serve_app.kube` to write it again", file=sys.stderr)
        return 1
    Path(a.manifest).write_text(new)
    print(f"{a.manifest}: Serve config written from {config} + {overlay}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
