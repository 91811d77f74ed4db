"""The layout the code is held to (docs/architecture.md): no module in `serve_app/` over 500
lines, no class over 300, no function over 80; the entries of the package's top level (each
decided, aliases only re-exporting); and the import rules between its parts, read from the
source (the fresh-interpreter check of what each module loads at run time is in test_deploy.py)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "serve_app"
MODULES = sorted(ROOT.rglob("*.py"))
LIMITS = {"module": 500, "class": 300, "function": 80}


def _sizes(path: Path):
    source = path.read_text()
    yield "module", path.stem, source.count("\n")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            yield "class", node.name, node.end_lineno - node.lineno + 1
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield "function", node.name, node.end_lineno - node.lineno + 1


def _imports(path: Path, lazy: bool = False) -> set[str]:
    """What a module imports when it loads (an import inside a function waits for its call),
    and with `lazy` inside its functions too."""
    out, todo = set(), list(ast.parse(path.read_text()).body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not lazy:
            continue
        todo.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


def test_no_module_class_or_function_is_over_its_limit():
    over = [
        f"{path.relative_to(ROOT.parent)}: {kind} {name} is {lines} lines (limit {LIMITS[kind]})"
        for path in MODULES
        for kind, name, lines in _sizes(path)
        if lines > LIMITS[kind]
    ]
    assert not over, "\n".join(over)


def test_the_limits_are_measured():
    """The measure itself: a long function in a small module counts as long."""
    body = "\n".join(f"    x{i} = {i}" for i in range(90))
    probe = ROOT.parent / "tests" / "_layout_probe.py"
    probe.write_text(f"def long():\n{body}\n")
    try:
        assert ("function", "long", 91) in set(_sizes(probe))
    finally:
        probe.unlink()


# The top level of serve_app/, each entry and why it is there (docs/architecture.md names them
# all). A new loose module needs a decision: a line here, or a place in a package.
TOP_LEVEL = {
    "app": "build_app: the Serve application (serve_app.app:build_app)",
    "config": "every deployment setting, read by all three places",
    "errors": "ServingError and its subclasses, raised everywhere",
    "schemas": "the wire format between processes",
    "ingress": "HTTP and the Python API: routes, core, access, the proxy guard, edit inputs",
    "replica": "the Serve deployment of one GPU: intake, scheduler, loop, adapters, health",
    "engine": "one diffusers pipeline, no Ray",
    "jobs": "jobs, their store and webhooks",
    "formats": "weight files: layouts, single-file checkpoints, LoRA files, source checks",
    "registries": "the adapter and checkpoint registries: the ingress writes them, every replica reads them",
    "media_types": "the output formats and their media types: the schema and the engine share them",
    "sampling": "the sampler catalog: the ingress checks names, the engine builds schedulers",
    "metrics": "Prometheus metrics of the ingress and the replicas",
    "autoscaling": "Serve's autoscaling policy, imported by the controller by path: light on purpose",
    "testing": "FaultInjection and FakeEngine, named by configs (serve_app.testing:FaultInjection)",
    "tools": "the operator's tools: the CLI, the pre-deploy check, the KubeRay manifest, adapter files",
    "shapes": "builtin:shapes' scenes, checker and trainer",
}
# Aliases: documented entry points whose code moved, each re-exporting from its target.
ALIASES = {
    "proxy": "serve_app.ingress.proxy",  # ..._PROXY_CALLBACK_IMPORT_PATH=serve_app.proxy:middlewares
    "kube": "serve_app.tools.kube",  # python -m serve_app.kube
    "check": "serve_app.tools.check",  # python -m serve_app.check
    "lora": "serve_app.tools.lora",  # python -m serve_app.lora
    "single_file": "serve_app.tools.single_file",  # python -m serve_app.single_file
    "train_tiny": "serve_app.shapes.train",  # python -m serve_app.train_tiny
}


def test_the_top_level_holds_only_what_was_decided():
    found = {p.stem for p in ROOT.glob("*.py") if p.stem != "__init__"}
    found |= {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert found == set(TOP_LEVEL) | set(ALIASES), (
        f"new: {sorted(found - set(TOP_LEVEL) - set(ALIASES))}, gone: {sorted(set(TOP_LEVEL) - found)}"
    )
    architecture = (ROOT.parent / "docs" / "architecture.md").read_text()
    unnamed = [
        n for n in [*TOP_LEVEL, *ALIASES] if f"`{n}.py`" not in architecture and f"`{n}/`" not in architecture
    ]
    assert not unnamed, f"docs/architecture.md does not name {unnamed}"


@pytest.mark.parametrize("name", sorted(ALIASES))
def test_an_alias_only_re_exports_its_target(name):
    """A few lines: a docstring that says it is an alias, imports from its target (and `sys`),
    and for a `python -m` command, `main` run as the target runs it."""
    path = ROOT / f"{name}.py"
    tree = ast.parse(path.read_text())
    assert ast.get_docstring(tree).startswith("Alias: ")
    assert _imports(path, lazy=True) - {"sys"} == {ALIASES[name]}
    assert path.read_text().count("\n") <= 15
    names = {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
    target = ROOT.parent.joinpath(*ALIASES[name].split(".")).with_suffix(".py")
    defined = {n.name for n in ast.parse(target.read_text()).body if isinstance(n, ast.FunctionDef)}
    assert names and names <= defined, (names, defined)
    if name != "proxy":
        assert names == {"main"} and 'if __name__ == "__main__":' in path.read_text()


# What each part of the app may not import when it loads (a prefix matches the package and its
# modules).
FORBIDDEN = {
    "engine": (
        "ray",
        "fastapi",
        "serve_app.ingress",
        "serve_app.replica",
        "serve_app.jobs",
        "serve_app.schemas",
    ),
    "ingress": ("serve_app.engine", "serve_app.replica", "torch", "diffusers"),
    "jobs": ("serve_app.ingress", "serve_app.engine", "serve_app.replica", "torch"),
    "schemas": ("serve_app.engine", "serve_app.ingress", "serve_app.replica", "torch", "ray"),
    "registries": ("serve_app.engine", "serve_app.ingress", "serve_app.replica", "torch", "ray"),
    "media_types": ("serve_app",),
}
# What a part never imports, not even inside a function.
NEVER = {
    # Weight files: the engine loads them through formats, the ingress checks them with it.
    "formats": ("serve_app.engine", "serve_app.replica", "serve_app.ingress", "serve_app.tools", "ray"),
}
# Outside the request path: nothing that serves imports these, not even inside a function.
OPERATORS_ONLY = ("serve_app.tools", "serve_app.shapes")


def _part(path: Path) -> str:
    return path.relative_to(ROOT).parts[0].removesuffix(".py")


def _broken(rules: dict[str, tuple[str, ...]], lazy: bool) -> dict[str, list[str]]:
    return {
        part: [
            f"{p.relative_to(ROOT.parent)} imports {name}"
            for p in MODULES
            if _part(p) == part
            for name in sorted(_imports(p, lazy))
            if any(name == f or name.startswith(f + ".") for f in rules[part])
        ]
        for part in rules
    }


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_each_part_imports_only_what_its_rules_allow(part):
    assert [p for p in MODULES if _part(p) == part], part
    broken = _broken(FORBIDDEN, lazy=False)[part]
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("part", sorted(NEVER))
def test_a_part_never_imports_what_it_must_not_even_lazily(part):
    assert [p for p in MODULES if _part(p) == part], part
    broken = _broken(NEVER, lazy=True)[part]
    assert not broken, "\n".join(broken)


def test_the_operators_tools_are_imported_by_nothing_that_serves():
    """tools/ and shapes/ are imported by each other and by the aliases of their commands only."""
    outside = {"tools", "shapes", *ALIASES}
    broken = [
        f"{p.relative_to(ROOT.parent)} imports {name}"
        for p in MODULES
        if _part(p) not in outside
        for name in sorted(_imports(p, lazy=True))
        if any(name == f or name.startswith(f + ".") for f in OPERATORS_ONLY)
    ]
    assert not broken, "\n".join(broken)


def test_the_import_rules_are_read():
    """The reader itself: an import inside a function counts only when asked for (lazy), and a
    relative import is no escape (none is used)."""
    probe = ROOT.parent / "tests" / "_layout_probe.py"
    probe.write_text("import json\nfrom a.b import c\n\n\ndef f():\n    import serve_app.engine\n")
    try:
        assert _imports(probe) == {"json", "a.b"}
        assert _imports(probe, lazy=True) == {"json", "a.b", "serve_app.engine"}
    finally:
        probe.unlink()
    relative = [p for p in MODULES for n in ast.walk(ast.parse(p.read_text()))
                if isinstance(n, ast.ImportFrom) and n.level]  # fmt: skip
    assert not relative, relative
