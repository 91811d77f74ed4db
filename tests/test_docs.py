"""Docs that cannot rot: the README and the site in docs/ (mkdocs.yml).

- `mkdocs build --strict` builds the site: a missing page, a broken link or anchor fails it.
- Every shell and Python example of the README and the docs runs against the shared test app,
  in page order, with `http://127.0.0.1:8000` (or `localhost:8000`) rewritten to the app's URL,
  the app name of `serve_config.yaml` to the test app's, and `DIFFUSION_SERVE_URL` set for the
  command-line client. A block that cannot run here (a GPU, a cluster, a server of its own, an
  install) says why in an HTML comment on the line before it: `<!-- not run: needs a GPU -->`.
  In shell blocks `curl` fails on an HTTP error (`--fail-with-body`), as does any command.
- The configuration reference is generated from the pydantic models (docs/hooks.py), and every
  field has a description; the HTTP API page lists every route of the OpenAPI document.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ADAPTER_DIR, APP_NAME

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
# Languages whose blocks are run: shell and Python. Every fenced block names its language.
RUNNERS = {"bash": "shell", "sh": "shell", "shell": "shell", "python": "python"}
NOT_RUN = re.compile(r"<!--\s*not run:(.*?)-->")
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)")
# Shell blocks run under these options; curl fails on HTTP errors unless the block asks for -f itself.
SHELL_PRELUDE = r"""set -euo pipefail
curl() {
  local a
  for a in "$@"; do
    case "$a" in
      --fail | --fail-with-body) command curl "$@"; return ;;
      --*) ;;
      -*f*) command curl "$@"; return ;;
    esac
  done
  command curl --fail-with-body "$@"
}
"""


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    not_run: str | None  # the reason given, if the block is marked

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a markdown page, dedented, with their not-run markers."""
    lines = page.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = len(m["indent"]), m["fence"], m["lang"]
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        code = "\n".join(re.sub(f"^ {{0,{indent}}}", "", line) for line in lines[i + 1 : j])  # dedented
        before = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        marker = NOT_RUN.fullmatch(before)
        out.append(Block(page, i + 1, lang, code + "\n", marker[1].strip() if marker else None))
        i = j + 1
    return out


def runnable(page: Path) -> list[Block]:
    return [b for b in blocks(page) if b.lang in RUNNERS and b.not_run is None]


def rewrite(code: str, base_url: str) -> str:
    """The example as it runs against the test app."""
    code = re.sub(r"(?:https?://)?(?:127\.0\.0\.1|localhost):8000", base_url, code)
    return code.replace('get_app_handle("diffusion")', f'get_app_handle("{APP_NAME}")')


def test_every_block_names_its_language_and_every_marker_gives_a_reason():
    for page in PAGES:
        found = blocks(page)
        for b in found:
            # docs/architecture.md's one unnamed block is its diagram.
            assert b.lang or page.name == "architecture.md", (
                f"{b.where}: a fenced block names its language (```bash, ```python, ```yaml, ```text)"
            )
            assert b.not_run is None or b.not_run, f"{b.where}: a not-run marker says why"
        # A marker stands right before a block: none is left dangling.
        markers = sum(bool(NOT_RUN.fullmatch(line.strip())) for line in page.read_text().splitlines())
        assert markers == sum(b.not_run is not None for b in found), (
            f"{page.name}: a marker not before a block"
        )


def test_the_readme_is_short_and_starts_with_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    shell = [b.code.strip() for b in blocks(ROOT / "README.md") if b.lang == "bash"]
    assert shell[:2] == [
        "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e . && "
        "diffusion-serve serve serve_config.yaml",
        "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e '.[test]' && "
        "python -m pytest",
    ]


def test_the_site_builds_strict(tmp_path):
    """Broken links and anchors, pages missing from the nav or a stale configuration reference
    fail the build."""
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert (tmp_path / "site" / "configuration-reference" / "index.html").exists()


def test_every_page_is_in_the_nav():
    import yaml

    def files(nav) -> list[str]:
        if isinstance(nav, str):
            return [nav]
        items = nav.values() if isinstance(nav, dict) else nav
        return [f for item in items for f in files(item)]

    nav = files(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    assert sorted(nav) == sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))


def _slugs(page: Path) -> set[str]:
    from markdown.extensions.toc import slugify

    text = page.read_text()
    heads = re.findall(r"^#+\s+(.*?)\s*(?:\{#([\w-]+)\})?\s*$", text, re.M)
    return {explicit or slugify(re.sub(r"[`*]", "", title), "-") for title, explicit in heads}


def test_the_readme_links_resolve():
    """The README is not part of the site (mkdocs checks the site's links): its links name files
    of the repository, and anchors headings of the page they point at."""
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert links
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.exists(), link
        if anchor:
            assert anchor in _slugs(target), link


# Paths of the repository that the pages name in code spans; docs/architecture.md names the
# modules relative to serve_app/ and is checked by tests/test_layout.py's own rules.
REPO_PATH = re.compile(
    r"`((?:serve_app|configs|benchmarks|tests|deploy|docs|examples)/[\w./-]*[\w/])(?:::\w+)?`"
)


def test_the_files_the_pages_name_exist():
    for page in PAGES:
        if page.name == "architecture.md":
            continue
        for path in REPO_PATH.findall(page.read_text()):
            assert (ROOT / path).exists(), f"{page.relative_to(ROOT)} names {path}"


def test_the_configuration_reference_is_generated_and_every_field_described():
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    assert hooks.missing_descriptions() == [], "add description= to these fields in serve_app/config/"
    paths = [p for p, _ in hooks.config_models()]
    assert {"model", "model.optimizations", "models[]", "replica.autoscaling", "tenants[]", "jobs"} <= set(
        paths
    )
    assert hooks.PAGE.read_text() == hooks.config_reference(), "run `python docs/hooks.py`"


def test_the_http_api_page_lists_every_route():
    """Every (method, path) of the OpenAPI document is on the page, and every route the page
    lists is served (the playground, `GET /`, is left out of the document)."""
    from starlette.routing import Match

    from serve_app.ingress.http import make_app

    app = make_app()
    documented = {(m.upper(), path) for path, ops in app.openapi()["paths"].items() for m in ops}
    page = (DOCS / "http-api.md").read_text()
    listed = set(re.findall(r"`(GET|POST|PUT|PATCH|DELETE|HEAD) (/[^`\s?]*)`", page))
    assert documented - listed == set(), "routes missing from docs/http-api.md"

    def served(method: str, path: str) -> bool:  # HEAD is answered wherever GET is (HeadAsGet)
        concrete = re.sub(r"\{\w+\}", "x", path)
        scope = {"type": "http", "method": "GET" if method == "HEAD" else method, "path": concrete,
                 "root_path": "", "headers": [], "query_string": b""}  # fmt: skip
        return any(route.matches(scope)[0] == Match.FULL for route in app.router.routes)

    assert [r for r in sorted(listed) if not served(*r)] == [], (
        "routes on docs/http-api.md that are not served"
    )
    assert listed - documented == {("GET", "/")}


@pytest.fixture(scope="module")
def example_env(base_url, tmp_path_factory):
    """What the examples find: the command-line client pointed at the test app, and an adapter
    named `green` for the test app's model (the docs make builtin:shapes' own, which the test
    app's tiny-sd cannot load)."""
    from serve_app.tools.lora import main as lora_main

    if not (ADAPTER_DIR / "green.safetensors").exists():
        lora_main(["make", "--out", str(ADAPTER_DIR / "green.safetensors")])
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "DIFFUSION_SERVE_URL": base_url,
        "PYTHONPATH": str(ROOT),
    }
    yield env
    import httpx

    httpx.delete(f"{base_url}/v1/loras/green")  # left registered by a failed example


def run_block(block: Block, base_url: str, env: dict, cwd: Path) -> None:
    code = rewrite(block.code, base_url)
    if RUNNERS[block.lang] == "shell":
        # A session of its own, so that a block past its time goes whole, children included.
        proc = subprocess.Popen(
            ["bash", "-c", SHELL_PRELUDE + code], cwd=cwd, env=env, text=True, start_new_session=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            out, err = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        failed = f"{block.where} failed ({proc.returncode}):\n{code}"
        assert proc.returncode == 0, f"{failed}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}"
    else:
        old = Path.cwd()
        os.chdir(cwd)
        try:
            exec(compile(code, block.where, "exec"), {"__name__": "__docs__"})
        except Exception as e:
            raise AssertionError(f"{block.where} failed: {type(e).__name__}: {e}\n{code}") from e
        finally:
            os.chdir(old)


EXAMPLE_PAGES = [p for p in PAGES if runnable(p)]


@pytest.mark.parametrize("page", EXAMPLE_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_examples_run(page, base_url, example_env, tmp_path):
    """A page's runnable blocks, in order, in one working directory (a later block may read the
    file an earlier one wrote)."""
    for block in runnable(page):
        run_block(block, base_url, example_env, tmp_path)


def test_the_examples_that_are_not_run_say_why():
    reasons = {b.where: b.not_run for p in PAGES for b in blocks(p) if b.not_run is not None}
    assert reasons and all(reasons.values())
    ran = sum(len(runnable(p)) for p in PAGES)
    assert ran >= 20, f"only {ran} examples run"
    assert shutil.which("bash")
