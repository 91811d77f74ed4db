"""Checkpoints served by name from a pool: their names, the checks on their sources, their
family and the persisted registry. No torch or diffusers here: the ingress imports it.

A checkpoint is a diffusers pipeline directory (`model_index.json` and its component folders)
under one of the allowed roots, holding only safetensors weights, a single-file checkpoint there
(one `.safetensors` file in the original Stable Diffusion 1.x, SDXL or FLUX layout, configured like the
pool's own model: `model.pipeline_config`, else its source), or, where the hub is allowed, a
hub id (`org/name`) that the replica downloads when it loads it. The registry (name ->
source, pool, family, pinned) is a JSON file written atomically under a lock, as the adapter
registry is (`lora.Registry`): every replica, including one that starts later, reads the same.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from serve_app.errors import InvalidRequest, NotFound
from serve_app.layouts import (
    LAYOUTS,
    PICKLE_REASON,
    PICKLE_SUFFIXES,
    SAFETENSORS_SUFFIX,
    FileRefused,
    file_layout,
)
from serve_app.lora import Registry, shown_path

CHECKPOINT_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$")

# What huggingface_hub's `validate_repo_id` accepts, in the `org/name` form only: each part
# starts and ends with a letter, digit or '_', at most 96 characters, no '--' or '..'.
_HUB_PART = r"\w(?:[\w.-]{0,94}\w)?"
HUB_ID = re.compile(rf"^{_HUB_PART}/{_HUB_PART}$", re.ASCII)

MAX_WALK_ENTRIES = 10_000  # files and folders looked at in one checkpoint before refusing it
MAX_INDEX_BYTES = 2**20


def check_checkpoint_name(name: str) -> None:
    if not isinstance(name, str) or not CHECKPOINT_NAME.fullmatch(name):
        raise InvalidRequest(
            "name: 1-128 characters of letters, digits, '.', '_' or '-', not starting with '.' "
            "(no '/', '.' or '..': a name is not a path)",
            param="name",
        )


def _refuse(message: str) -> InvalidRequest:
    return InvalidRequest(f"source: {message}", param="source")


def is_hub_id(source: str) -> bool:
    """Whether `source` has the form of a hub id (`org/name`) diffusers would download."""
    if not HUB_ID.match(source) or source.endswith(".git"):
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
    roots = [Path(r).expanduser().resolve() for r in allowed_roots]
    if not _inside(resolved, roots):
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
    if path.suffix != SAFETENSORS_SUFFIX:  # diffusers reads any other name (.SAFETENSORS too) as a pickle
        raise _refuse(f"{shown!r} is neither a diffusers pipeline directory nor a .safetensors checkpoint")
    try:
        return LAYOUTS[file_layout(path)][1]
    except FileRefused as e:
        raise _refuse(f"{shown!r} {e}") from None


def _inside(path: Path, roots: list[Path]) -> bool:
    return any(path == r or r in path.parents for r in roots)


def _pipeline_class(directory: Path, shown: str, roots: list[Path]) -> str:
    index = directory / "model_index.json"
    if not index.is_file():
        raise _refuse(f"{shown!r} is not a diffusers pipeline (no model_index.json)")
    if not _inside(index.resolve(), roots):
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
                if target is not path and not _inside(target, roots):
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


# The project's family names (`engine/families.py`) for diffusers pipeline classes, by class
# name prefix, the longest first; plain Stable Diffusion only for its own three pipelines.
_FAMILY_PREFIXES = (
    ("StableDiffusionXL", "sdxl"),
    ("StableDiffusion3", "sd3"),
    ("Flux", "flux"),
    ("Wan", "wan"),
)
_SD_CLASSES = ("StableDiffusionPipeline", "StableDiffusionImg2ImgPipeline", "StableDiffusionInpaintPipeline")


def family_of(pipeline_class_name: str) -> str | None:
    """The family name `engine/families.py` gives pipelines of this class; None if unknown."""
    if pipeline_class_name in _SD_CLASSES:
        return "sd"
    for prefix, family in _FAMILY_PREFIXES:
        if pipeline_class_name.startswith(prefix) and pipeline_class_name.endswith("Pipeline"):
            return family
    return None


class CheckpointRegistry(Registry):
    """Registered checkpoints by name: {source, pool, family, pinned}. Every method re-reads
    the file; `path` is a local path or an fsspec URL, locked and written as `lora.Registry`."""

    what, removal_field = "checkpoint", "name"

    def get(self, name: str) -> dict[str, Any]:
        entry = self.all().get(name)
        if entry is None:
            raise NotFound(f"model: no checkpoint named {name!r} is registered", param="model")
        return entry

    def add(  # type: ignore[override]  # a checkpoint's fields, not an adapter's
        self, name: str, source: str, pool: str, family: str | None
    ) -> dict[str, Any]:
        with self._locked():
            data = self._read()
            if name in data:
                raise InvalidRequest(f"name: a checkpoint named {name!r} is already registered", param="name")
            data[name] = {"source": source, "pool": pool, "family": family, "pinned": False}
            self._write(data)
            return data[name]

    def pin(self, name: str, pinned: bool, max_pinned: int) -> dict[str, Any]:
        """Pin or unpin `name`; at most `max_pinned` pinned checkpoints in its pool (each of the
        pool's replicas holds every pinned one)."""
        with self._locked():
            data = self._read()
            if name not in data:
                raise NotFound(f"name: no checkpoint named {name!r} is registered", param="name")
            pool = data[name]["pool"]
            others = sum(1 for n, e in data.items() if e["pinned"] and e["pool"] == pool and n != name)
            if pinned and others >= max_pinned:
                raise InvalidRequest(
                    f"pinned: {others} checkpoints of pool {pool!r} are pinned already and its replicas "
                    f"hold at most {max_pinned} pinned",
                    param="pinned",
                )
            data[name]["pinned"] = pinned
            self._write(data)
            return data[name]
