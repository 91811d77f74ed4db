"""Community LoRA files: the checks on an adapter before it is registered, the kohya-ss (A1111)
layout most shared adapters use, and the writer of diffusers/peft adapters. No torch at import:
the ingress checks adapter files with it.

An adapter is one `.safetensors` file (diffusers', peft's or kohya's key names; diffusers
converts them as it loads them) or a PEFT adapter directory (`adapter_config.json` and
`adapter_model.safetensors`), inside an allowed root (`lora.allowed_roots`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from serve_app.errors import Forbidden, InvalidRequest
from serve_app.formats.layouts import PICKLE_REASON, FileRefused, safetensors_keys
from serve_app.formats.sources import inside, resolved_roots

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
    roots = resolved_roots(allowed_roots)
    if not inside(resolved, roots):
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
        if not all(inside(f, roots) for f in files):  # a symlink inside pointing out
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


def write_adapter(
    out: str | Path,
    state: dict[str, Any],
    prefix: str,
    *,
    rank: int,
    targets: list[str],
    alpha: int | None = None,
    strength: float = 1.0,
    text_encoder: dict[str, Any] | None = None,
) -> Path:
    """Write a denoiser's LoRA weights (peft's state dict of the model under `prefix`, "unet"
    or "transformer") as a diffusers/peft `.safetensors` file, a text encoder's beside them
    (`text_encoder`: under the keys diffusers loads, `text_encoder.` + peft's), or, when `out`
    does not end in `.safetensors`, as a PEFT adapter directory adapting `targets` (`alpha`,
    default `rank`, goes in its config; the weights are stored so that the adapter acts the
    same). Every weight is scaled by `strength`."""
    from diffusers.utils import convert_state_dict_to_diffusers
    from safetensors.torch import save_file

    path = Path(out)
    if path.suffix != ".safetensors" and text_encoder is not None:
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
            "target_modules": sorted(targets),
        }
        (path / PEFT_CONFIG).write_text(json.dumps(config, indent=1))
        return path
    if prefix == "unet" and state:  # UNet adapters are shared in diffusers' key names; others in peft's
        state = convert_state_dict_to_diffusers(state)
    state = {f"{prefix}.{k}": v for k, v in state.items()}
    state.update(text_encoder or {})
    state = {k: (v * strength).contiguous() for k, v in state.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path))
    return path


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
