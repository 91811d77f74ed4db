"""The limits the code is held to (docs/architecture.md): no module in `serve_app/` over 500
lines, no class over 300, no function over 80; and the import rules between the three places
a request passes through, read from the source (the fresh-interpreter check of what each
module loads at run time is in test_deploy.py)."""

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


def _imports(path: Path) -> set[str]:
    """What a module imports when it loads (an import inside a function waits for its call)."""
    out, todo = set(), list(ast.parse(path.read_text()).body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
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


# What each part of the app may not import (a prefix matches the package and its modules).
FORBIDDEN = {
    "engine": ("ray", "fastapi", "serve_app.ingress", "serve_app.replica", "serve_app.jobs"),
    "ingress": ("serve_app.engine", "serve_app.replica", "torch", "diffusers"),
    "jobs": ("serve_app.ingress", "serve_app.engine", "serve_app.replica", "torch"),
    "schemas": ("serve_app.engine", "serve_app.ingress", "serve_app.replica", "torch", "ray"),
}


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_each_part_imports_only_what_its_rules_allow(part):
    paths = [p for p in MODULES if p.relative_to(ROOT).parts[0].removesuffix(".py") == part]
    assert paths, part
    broken = [
        f"{p.relative_to(ROOT.parent)} imports {name}"
        for p in paths
        for name in sorted(_imports(p))
        if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[part])
    ]
    assert not broken, "\n".join(broken)
