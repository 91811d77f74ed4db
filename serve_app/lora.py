"""LoRA adapters: the persisted registry, the checks on adapter files, and a maker for tests.

The registry is the source of truth for which adapters exist and which are pinned. It is a
JSON file written atomically under a lock, so it survives a restart of the app and every
replica, including one that starts later, reads the same state. On several machines, put it
on a path they share.

    python -m serve_app.lora make --out adapters/red.safetensors --seed 1   # an adapter for builtin:tiny-sd
    python -m serve_app.lora green --out adapters/green.safetensors       # builtin:shapes' trained one
    python -m serve_app.lora kohya adapters/red.safetensors --out adapters/red-kohya.safetensors --alpha 2
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import fcntl
import functools
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from serve_app.errors import Forbidden, InvalidRequest, NotFound, ServingError
from serve_app.layouts import PICKLE_REASON, FileRefused, safetensors_keys

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def check_name(name: str) -> str:
    if not NAME_PATTERN.fullmatch(name):
        raise InvalidRequest(
            "name: 1-64 characters of letters, digits, '.', '_' or '-', starting with a letter or digit",
            param="name",
        )
    return name


# PEFT's adapter directory: its config and its weights, by these names.
PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def check_adapter_file(path: str, allowed_roots: list[str], max_file_mb: float) -> Path:
    """Resolve `path` (symlinks followed) and refuse it unless it is a `.safetensors` file or a
    PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`), inside an
    allowed root, and no larger than `max_file_mb`."""
    if not allowed_roots:
        raise Forbidden(
            "path: no lora.allowed_roots are configured, so no adapter file may be loaded", param="path"
        )
    if "\x00" in path:  # the file system would refuse it with a 500
        raise InvalidRequest("path: a NUL character is not allowed in adapter paths", param="path")
    raw = Path(path).expanduser()
    if not raw.is_absolute():
        raw = Path(allowed_roots[0]).expanduser() / raw
    if ".." in raw.parts:
        raise Forbidden("path: '..' is not allowed in adapter paths", param="path")
    resolved = raw.resolve()
    roots = [Path(r).expanduser().resolve() for r in allowed_roots]

    def inside(p: Path) -> bool:
        return any(p == r or r in p.parents for r in roots)

    if not inside(resolved):
        raise Forbidden(
            f"path: {path!r} resolves outside the adapter roots (lora.allowed_roots)", param="path"
        )
    if resolved.is_dir():
        files = [(resolved / name).resolve() for name in (PEFT_CONFIG, PEFT_WEIGHTS)]
        if not all(f.is_file() for f in files):
            raise InvalidRequest(
                f"path: an adapter directory holds {PEFT_CONFIG} and {PEFT_WEIGHTS} (PEFT's layout)",
                param="path",
            )
        if not all(inside(f) for f in files):  # a symlink inside pointing out
            raise Forbidden(f"path: files of {path!r} resolve outside the adapter roots", param="path")
        _check_size(files[1], max_file_mb)
        if files[0].stat().st_size > 2**20:
            raise InvalidRequest(f"path: {PEFT_CONFIG} is larger than 1 MB", param="path")
        _check_header(files[1], f"{path}/{PEFT_WEIGHTS}")
        return resolved
    if resolved.suffix != ".safetensors":
        raise InvalidRequest(
            f"path: only .safetensors adapter files are loaded: {PICKLE_REASON}", param="path"
        )
    if not resolved.is_file():
        raise InvalidRequest(f"path: no adapter file at {path!r}", param="path")
    _check_size(resolved, max_file_mb)
    _check_header(resolved, path)
    return resolved


def _check_header(file: Path, shown: str) -> None:
    """Refuse a file that is no safetensors file (a pickle under that name) or is cut short."""
    try:
        safetensors_keys(file)
    except FileRefused as e:
        raise InvalidRequest(f"path: not a readable safetensors file: {shown!r} {e}", param="path") from None


def _check_size(path: Path, max_file_mb: float) -> None:
    size_mb = path.stat().st_size / 2**20
    if size_mb > max_file_mb:
        raise InvalidRequest(f"path: {size_mb:.1f} MB is above the limit of {max_file_mb:g} MB", param="path")


def shown_path(path: str, allowed_roots: list[str]) -> str:
    """`path` as callers may see it: relative to the adapter root that holds it, never the
    server's absolute path (the file name alone if no root holds it any more)."""
    p = Path(path)
    for root in allowed_roots:
        r = Path(root).expanduser().resolve()
        if r in p.parents:
            return str(p.relative_to(r))
    return p.name


class Registry:
    """Registered adapters by name: {path, scale, pinned}. Every method re-reads the file.

    `path` is a local path or any fsspec URL (`s3://bucket/loras.json`, ...) that several
    machines share. Changes are serialised by a lock: `flock` on a local file, elsewhere a lock
    file created exclusively (one older than `STALE_LOCK_S` is taken to be a crashed writer's).
    """

    STALE_LOCK_S = 30.0

    def __init__(self, path: str):
        import fsspec
        from fsspec.implementations.local import LocalFileSystem

        self.fs, self.path = fsspec.core.url_to_fs(os.path.expanduser(path))
        self.local = isinstance(self.fs, LocalFileSystem)
        self.lock_path = os.path.splitext(self.path)[0] + ".lock"

    @contextlib.contextmanager
    def _locked(self):
        self.fs.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        if self.local:
            with open(self.lock_path, "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                try:
                    yield
                finally:
                    fcntl.flock(lock, fcntl.LOCK_UN)
            return
        deadline = time.monotonic() + 2 * self.STALE_LOCK_S
        while True:
            try:
                with self.fs.open(self.lock_path, "xb") as f:
                    f.write(str(time.time()).encode())
                break
            except FileExistsError:
                try:
                    with self.fs.open(self.lock_path, "rb") as f:
                        taken = float(f.read() or 0)
                except (FileNotFoundError, ValueError):
                    taken = 0.0
                if time.time() - taken > self.STALE_LOCK_S:
                    self.fs.rm(self.lock_path)  # its writer crashed
                elif time.monotonic() > deadline:
                    raise ServingError("the adapter registry stays locked; try again") from None
                else:
                    time.sleep(0.05)
        try:
            yield
        finally:
            self.fs.rm(self.lock_path)

    def _read(self) -> dict[str, dict[str, Any]]:
        try:
            with self.fs.open(self.path, "rb") as f:
                return json.loads(f.read())
        except FileNotFoundError:
            return {}

    def _write(self, data: dict[str, dict[str, Any]]) -> None:
        tmp = f"{self.path}.tmp{os.getpid()}"
        with self.fs.open(tmp, "wb") as f:
            f.write(json.dumps(data, indent=1, sort_keys=True).encode())
        self.fs.mv(tmp, self.path)

    def all(self) -> dict[str, dict[str, Any]]:
        with self._locked():
            return self._read()

    def get(self, name: str) -> dict[str, Any]:
        entry = self.all().get(name)
        if entry is None:
            raise NotFound(f"lora: no adapter named {name!r} is registered", param="lora")
        return entry

    def add(
        self, name: str, path: str, scale: float, pinned: bool = False, model: str | None = None
    ) -> dict[str, Any]:
        """Register `name` (for `model`: the one model it serves, where there are several)."""
        with self._locked():
            data = self._read()
            if name in data:
                raise InvalidRequest(f"name: an adapter named {name!r} is already registered", param="name")
            data[name] = {"path": path, "scale": scale, "pinned": pinned}
            if model is not None:
                data[name]["model"] = model
            self._write(data)
            return data[name]

    # How its messages name an entry, and the field that names it in a removal's message.
    what, removal_field = "adapter", "lora"

    def remove(self, name: str) -> dict[str, Any]:
        with self._locked():
            data = self._read()
            if name not in data:
                raise NotFound(
                    f"{self.removal_field}: no {self.what} named {name!r} is registered", param="name"
                )
            entry = data.pop(name)
            self._write(data)
            return entry

    def pin(self, name: str, pinned: bool, max_pinned: int, default: str | None = None) -> dict[str, Any]:
        """Pin or unpin; at most `max_pinned` pinned adapters per model (`default`: the model of
        entries that name none, registered before there were several)."""
        with self._locked():
            data = self._read()
            if name not in data:
                raise NotFound(f"lora: no adapter named {name!r} is registered", param="name")
            model = data[name].get("model") or default  # a replica holds the pinned adapters of its model
            others = sum(
                1
                for n, e in data.items()
                if e["pinned"] and n != name and (e.get("model") or default) == model
            )
            if pinned and others >= max_pinned:
                raise InvalidRequest(
                    f"pin: {others} adapters are pinned already and a replica holds at most {max_pinned}",
                    param="name",
                )
            data[name]["pinned"] = pinned
            self._write(data)
            return data[name]


def make_adapter(
    out: str,
    seed: int = 0,
    rank: int = 4,
    model: str = "tiny-sd",
    strength: float = 1.0,
    alpha: int | None = None,
    denoiser: bool = True,
    text_encoder: bool = False,
) -> Path:
    """Write a LoRA adapter for `builtin:<model>` in the diffusers/peft safetensors format, or,
    when `out` does not end in `.safetensors`, as a PEFT adapter directory (`alpha`, default
    `rank`, goes in its config; the weights are stored so that the adapter acts the same).
    It adapts the denoiser's attention, and with `text_encoder` the text encoder's (a file only).

    Same arguments, same file: the weights are drawn from `seed`.
    """
    import torch
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft import LoraConfig, get_peft_model_state_dict
    from safetensors.torch import save_file

    prefix, base = _base_denoiser(model)
    encoder = copy.deepcopy(_base_pipe(model).text_encoder) if text_encoder else None
    torch.manual_seed(seed)
    cfg = LoraConfig(
        r=rank, lora_alpha=rank, init_lora_weights=False, target_modules=["to_q", "to_k", "to_v", "to_out.0"]
    )
    state = {}
    if denoiser:
        base.add_adapter(cfg, adapter_name="make")
        try:
            state = get_peft_model_state_dict(base, adapter_name="make")
        finally:
            base.delete_adapters("make")
    path = Path(out)
    if path.suffix != ".safetensors" and text_encoder:
        raise ValueError("a text encoder adapter is written as a .safetensors file")
    if path.suffix != ".safetensors":  # PEFT's directory: its key names, the factor alpha/r apart
        path.mkdir(parents=True, exist_ok=True)
        factor = rank / (alpha or rank)
        keys = {
            f"base_model.model.{k}": (v * strength * (factor if "lora_B" in k else 1.0)).contiguous()
            for k, v in state.items()
        }
        save_file(keys, str(path / PEFT_WEIGHTS))
        config = {
            "peft_type": "LORA",
            "r": rank,
            "lora_alpha": alpha or rank,
            "target_modules": sorted(cfg.target_modules),
        }
        (path / PEFT_CONFIG).write_text(json.dumps(config, indent=1))
        return path
    if prefix == "unet" and state:  # UNet adapters are shared in diffusers' key names; others in peft's
        state = convert_state_dict_to_diffusers(state)
    state = {f"{prefix}.{k}": v for k, v in state.items()}
    if encoder is not None:
        state.update(_text_encoder_lora(encoder, rank))
    state = {k: (v * strength).contiguous() for k, v in state.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path))
    return path


def _text_encoder_lora(encoder, rank: int) -> dict[str, Any]:
    """Random LoRA weights (drawn from torch's generator as it stands) for the attention of
    `encoder` (a copy: they are put in it), under the keys diffusers loads (`text_encoder.` +
    peft's)."""
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    cfg = LoraConfig(r=rank, lora_alpha=rank, init_lora_weights=False,
                     target_modules=["q_proj", "k_proj", "v_proj", "out_proj"])  # fmt: skip
    inject_adapter_in_model(cfg, encoder, adapter_name="make")
    return {
        f"text_encoder.{k}": v for k, v in get_peft_model_state_dict(encoder, adapter_name="make").items()
    }


# kohya-ss's (A1111's) key prefix of each part an adapter changes.
KOHYA_PREFIXES = {"unet": "lora_unet_", "text_encoder": "lora_te_", "text_encoder_2": "lora_te2_"}
_DOWN_UP = ((".lora.down.weight", "down"), (".lora.up.weight", "up"), (".lora_A.weight", "down"),
            (".lora_B.weight", "up"), (".lora_linear_layer.down.weight", "down"),
            (".lora_linear_layer.up.weight", "up"))  # fmt: skip


def to_kohya(state: dict[str, Any], alpha: float | None = None) -> dict[str, Any]:
    """A diffusers/peft LoRA state dict (UNet and text encoders) in the kohya-ss layout that
    A1111 and most shared adapters use: `lora_unet_<module>` / `lora_te_text_model_<module>`
    with `.` as `_`, `.lora_down.weight`, `.lora_up.weight` and an `.alpha` per module. kohya
    scales a module by alpha / rank, so with `alpha` the up weights are stored times
    rank / alpha: the adapter acts the same."""
    import torch

    out = {}
    for key, value in state.items():
        part, _, rest = key.partition(".")
        suffix, kind = next(((s, k) for s, k in _DOWN_UP if rest.endswith(s)), ("", ""))
        if part not in KOHYA_PREFIXES or not suffix:
            raise ValueError(f"{key}: not a UNet or text encoder LoRA weight in the diffusers or peft layout")
        module = rest[: -len(suffix)]
        if part.startswith("text_encoder") and not module.startswith("text_model."):
            module = "text_model." + module  # the name kohya's files carry (transformers<5 kept it)
        name = KOHYA_PREFIXES[part] + module.replace(".", "_")
        rank = value.shape[0] if kind == "down" else value.shape[1]
        a = float(alpha if alpha is not None else rank)
        out[f"{name}.lora_{kind}.weight"] = (value * (rank / a) if kind == "up" else value).contiguous()
        out[f"{name}.alpha"] = torch.tensor(a)
    return out


@functools.lru_cache(maxsize=2)
def _base_pipe(model: str):
    """The pipeline adapters are shaped for, built once per process (a full-size one takes a while)."""
    from serve_app.engine.builtin import build_builtin

    return build_builtin(model, seed=0)


def _base_denoiser(model: str):
    """The denoiser adapters are shaped for, with its key prefix ("unet" or "transformer")."""
    pipe = _base_pipe(model)
    unet = getattr(pipe, "unet", None)
    return ("unet", unet) if unet is not None else ("transformer", pipe.transformer)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m serve_app.lora", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make", help="write a deterministic adapter for a builtin model")
    mk.add_argument("--out", required=True)
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--rank", type=int, default=4)
    mk.add_argument("--model", default="tiny-sd")
    green = sub.add_parser("green", help="copy builtin:shapes' trained adapter (paints shapes green)")
    green.add_argument("--out", required=True)
    ko = sub.add_parser("kohya", help="rewrite a diffusers/peft adapter file in the kohya (A1111) layout")
    ko.add_argument("source")
    ko.add_argument("--out", required=True)
    ko.add_argument("--alpha", type=float, default=None, help="alpha of every module (default: its rank)")
    a = ap.parse_args(argv)
    if a.cmd == "kohya":
        from safetensors.torch import load_file, save_file

        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        save_file(to_kohya(load_file(a.source), a.alpha), a.out)
        print(a.out)
        return
    if a.cmd == "green":
        from serve_app.engine.builtin import GREEN_LORA

        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        print(shutil.copyfile(GREEN_LORA, a.out))
        return
    print(make_adapter(a.out, seed=a.seed, rank=a.rank, model=a.model))


if __name__ == "__main__":
    main()
