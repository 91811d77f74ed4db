"""Where weights come from: the allowed roots a file must lie under, a path as callers may see
it, and the checks on a checkpoint's source before it is registered. No torch or diffusers here:
the ingress imports it.

A checkpoint is a diffusers pipeline directory (`model_index.json` and its component folders)
under one of the allowed roots, holding only safetensors weights, a single-file checkpoint there
(one `.safetensors` file in the original Stable Diffusion 1.x, SDXL, SD3 or FLUX layout, or a
`.gguf` FLUX transformer, configured like the pool's own model: `model.pipeline_config`, else
its source), or, where the hub is
allowed, a hub id (`org/name`) that the replica downloads when it loads it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from serve_app.errors import InvalidRequest
from serve_app.formats.layouts import (
    LAYOUTS,
    PICKLE_REASON,
    PICKLE_SUFFIXES,
    SAFETENSORS_SUFFIX,
    FileRefused,
    file_layout,
    is_gguf_name,
)


def resolved_roots(allowed_roots: list[str]) -> list[Path]:
    """The allowed roots as absolute paths, `~` expanded and symlinks followed."""
    return [Path(r).expanduser().resolve() for r in allowed_roots]


def inside(path: Path, roots: list[Path]) -> bool:
    """Whether `path` (resolved) is one of `roots` or lies under one."""
    return any(path == r or r in path.parents for r in roots)


def shown_path(path: str, allowed_roots: list[str]) -> str:
    """`path` as callers may see it: relative to the allowed root that holds it, never the
    server's absolute path (the file name alone if no root holds it any more)."""
    p = Path(path)
    for r in resolved_roots(allowed_roots):
        if r in p.parents:
            return str(p.relative_to(r))
    return p.name


# What huggingface_hub's `validate_repo_id` accepts, in the `org/name` form only: each part
# starts and ends with a letter, digit or '_', at most 96 characters, no '--' or '..'.
_HUB_PART = r"\w(?:[\w.-]{0,94}\w)?"
HUB_ID = re.compile(rf"^{_HUB_PART}/{_HUB_PART}$", re.ASCII)

MAX_WALK_ENTRIES = 10_000  # files and folders looked at in one checkpoint before refusing it
MAX_INDEX_BYTES = 2**20


def _refuse(message: str) -> InvalidRequest:
    return InvalidRequest(f"source: {message}", param="source")


def is_hub_id(source: str) -> bool:
    """Whether `source` has the form of a hub id (`org/name`) diffusers would download."""
    if not HUB_ID.fullmatch(source) or source.endswith(".git"):
        return False
    return ".." not in source and "--" not in source


def _looks_local(source: str) -> bool:
    return source.startswith(("/", "./", "../", "~")) or Path(source).expanduser().exists()


def check_checkpoint_source(source: str, allowed_roots: list[str], allow_hub: bool) -> tuple[str, str]:
    """`(resolved_source, pipeline_class_name)` for a checkpoint that may be registered, else
    InvalidRequest (param "source") saying why, never showing the server's absolute path.

    A local path (absolute, or relative to the working directory) must resolve, symlinks
    followed, inside one of `allowed_roots`, to a diffusers pipeline directory with safetensors
    weights and no pickles, or to a single-file checkpoint of a layout this server knows (its
    class name is the layout's pipeline). A hub id is taken only with `allow_hub`; its class
    name is "" (it is known once loaded)."""
    if not isinstance(source, str) or not source.strip():
        raise _refuse("give a checkpoint directory or file, or a hub id")
    if "\x00" in source:
        raise _refuse("a NUL character is not allowed in a checkpoint source")
    if not _looks_local(source):
        if not is_hub_id(source):
            raise _refuse(f"{source!r} is neither a checkpoint under the checkpoint roots nor a hub id")
        if not allow_hub:
            raise _refuse(
                f"{source!r} is a hub id, and hub checkpoints are not allowed here; "
                "give a directory under the checkpoint roots"
            )
        return source, ""
    if not allowed_roots:
        raise _refuse("no checkpoint roots are configured, so no local checkpoint may be registered")
    raw = Path(source).expanduser()
    resolved = (raw if raw.is_absolute() else Path.cwd() / raw).resolve()
    roots = resolved_roots(allowed_roots)
    if not inside(resolved, roots):
        raise _refuse("the path resolves outside the checkpoint roots")
    shown = shown_path(str(resolved), [str(r) for r in roots])
    if not resolved.exists():
        raise _refuse(f"no checkpoint at {shown!r}")
    if resolved.is_file():
        return str(resolved), _single_file_class(resolved, shown)
    if not resolved.is_dir():
        raise _refuse(f"{shown!r} is neither a diffusers pipeline directory nor a checkpoint file")
    class_name = _pipeline_class(resolved, shown, roots)
    _check_files(resolved, shown, roots)
    return str(resolved), class_name


def _single_file_class(path: Path, shown: str) -> str:
    """The pipeline class of a single-file checkpoint's layout, read from its header."""
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise _refuse(f"{shown!r} is a pickle checkpoint: {PICKLE_REASON}")
    # diffusers reads any other name (.SAFETENSORS too) as a pickle
    if path.suffix != SAFETENSORS_SUFFIX and not is_gguf_name(path):
        raise _refuse(
            f"{shown!r} is neither a diffusers pipeline directory nor a .safetensors or .gguf checkpoint"
        )
    try:
        return LAYOUTS[file_layout(path)][1]
    except FileRefused as e:
        raise _refuse(f"{shown!r} {e}") from None


def _pipeline_class(directory: Path, shown: str, roots: list[Path]) -> str:
    index = directory / "model_index.json"
    if not index.is_file():
        raise _refuse(f"{shown!r} is not a diffusers pipeline (no model_index.json)")
    if not inside(index.resolve(), roots):
        raise _refuse(f"model_index.json of {shown!r} resolves outside the checkpoint roots")
    if index.stat().st_size > MAX_INDEX_BYTES:
        raise _refuse(f"model_index.json of {shown!r} is larger than 1 MB")
    try:
        data = json.loads(index.read_bytes())
    except (ValueError, OSError):
        raise _refuse(f"model_index.json of {shown!r} is not valid JSON") from None
    class_name = data.get("_class_name") if isinstance(data, dict) else None
    if not isinstance(class_name, str) or not class_name:
        raise _refuse(f"{shown!r} is not a diffusers pipeline (model_index.json has no _class_name)")
    return class_name


def _check_files(directory: Path, shown: str, roots: list[Path]) -> None:
    """Every entry under `directory` (symlinks followed, each visited folder once): inside the
    roots, no pickle-format weights, at least one .safetensors file; at most MAX_WALK_ENTRIES."""
    seen, todo, count, safetensors = {directory}, [(directory, "")], 0, False
    while todo:
        folder, prefix = todo.pop()
        with os.scandir(folder) as entries:
            for entry in entries:
                count += 1
                if count > MAX_WALK_ENTRIES:
                    raise _refuse(f"{shown!r} holds more than {MAX_WALK_ENTRIES} files; not checked")
                rel = prefix + entry.name
                path = Path(entry.path)
                target = path.resolve() if entry.is_symlink() else path
                if target is not path and not inside(target, roots):
                    raise _refuse(f"{rel!r} in {shown!r} resolves outside the checkpoint roots")
                suffixes = (path.suffix.lower(), target.suffix.lower())
                if any(s in PICKLE_SUFFIXES for s in suffixes):
                    raise _refuse(f"pickle file {rel!r} in {shown!r} (only safetensors weights are loaded)")
                if target.is_dir():
                    if target not in seen:
                        seen.add(target)
                        todo.append((target, rel + "/"))
                elif ".safetensors" in suffixes:
                    safetensors = True
    if not safetensors:
        raise _refuse(f"{shown!r} holds no .safetensors weights")
