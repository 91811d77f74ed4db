"""LoRA adapters in a pipeline: reading and checking their files (LyCORIS LoHa and LoKr files are
read as the exact LoRA they are, `lycoris`; DoRA's magnitudes are attached to the LoRA's layers,
`dora`), installing and removing them, and putting a set of them in force at given scales, for
a whole call (`InForce`) or per row (`row_hooks`).

Each refusal is a `LoraError` that names the file and says why.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import torch

from serve_app.engine import dora, lycoris
from serve_app.engine.loading import denoiser_name, find_denoiser
from serve_app.engine.row_lora import apply_row_adapters
from serve_app.engine.types import CallParams, LoraError, Row
from serve_app.registries import PUSHED_DIR

# Adapters in force: (name, scale) each, in name order, no scale 0; None for the base model.
ActiveSet = tuple[tuple[str, float], ...] | None


def loaded_adapters(pipe) -> list[str]:
    """The names of the adapters installed in `pipe` (none where it takes none)."""
    if not hasattr(pipe, "get_list_adapters"):
        return []
    return sorted({n for names in pipe.get_list_adapters().values() for n in names})


# The name ending of a LoRA up/B weight in each layout: diffusers' (`.lora.up.`, older text
# encoder files' `.lora_linear_layer.up.`), peft's (`.lora_B.`, maybe with an adapter name) and
# kohya-ss's (`.lora_up.`; diffusers converts its `lora_unet_`/`lora_te_` keys when loading).
_UP_WEIGHT = re.compile(r"(\.lora\.up|\.lora_linear_layer\.up|\.lora_B(\.[^.]+)?|\.lora_up)\.weight$")


def read_adapter(pipe, path: str) -> dict[str, torch.Tensor]:
    """Read and check an adapter's weights (a LoRA safetensors file in the diffusers/peft or the
    kohya-ss layout, or a PEFT adapter directory) without touching the pipeline: safe on any
    thread. LoraError if unusable."""
    from safetensors import SafetensorError

    try:
        state = _adapter_weights(pipe, path)
    except (SafetensorError, OSError, ValueError) as e:
        raise LoraError(f"{path}: not a readable safetensors file or adapter directory ({e})") from None
    if lycoris.is_lycoris(state):
        try:
            state = lycoris.as_lora(state, _conv_shapes(pipe))
        except lycoris.LycorisError as e:
            raise LoraError(f"{path}: {e}") from None
    ups = {k: v for k, v in state.items() if _UP_WEIGHT.search(k)}
    if not ups:
        raise LoraError(f"{path}: no LoRA weights in it (no lora up/B tensors)")
    # A trainer's first version is commonly all zero (the base policy): pushed ones may be.
    if PUSHED_DIR not in Path(path).parts and all(float(v.abs().max()) == 0 for v in ups.values()):
        raise LoraError(f"{path}: every LoRA up/B weight is zero; it would change no layer")
    modules = {_UP_WEIGHT.sub("", k) for k in ups}
    for module, m in dora.split(state)[1].items():
        if module not in modules:
            raise LoraError(f"{path}: {module}: a DoRA magnitude without the module's LoRA weights")
        if not bool(torch.isfinite(m).all()):
            raise LoraError(f"{path}: {module}: its DoRA magnitude is not finite")
    return state


def install_adapter(pipe, name: str, path: str, state: dict[str, torch.Tensor]) -> None:
    """Install adapter `name` into `pipe` from `state` (what `read_adapter` gave for `path`), or
    raise LoraError and leave no part of it installed."""
    if not hasattr(pipe, "load_lora_weights"):  # no LoRA loader in diffusers (HunyuanVideo 1.5)
        raise LoraError(f"{path}: {type(pipe).__name__} takes no LoRA adapters")
    before = loaded_adapters(pipe)
    state, magnitudes = dora.split(state)
    try:
        pipe.load_lora_weights(state, adapter_name=name)
    except Exception as e:  # diffusers/peft raise several types on shape or key mismatch
        remove_adapter(pipe, name)
        if "NoMatching" in type(e).__name__ or "not found in the base model" in str(e):
            raise LoraError(f"{path}: its keys match no layer of {type(pipe).__name__}") from None
        msg = " ".join(str(e).split())
        msg = msg if len(msg) < 300 else msg[:300] + " ..."
        raise LoraError(f"{path}: does not fit {type(pipe).__name__} ({type(e).__name__}: {msg})") from None
    if name not in loaded_adapters(pipe) or loaded_adapters(pipe) == before:
        remove_adapter(pipe, name)
        raise LoraError(f"{path}: its keys match no layer of {type(pipe).__name__}")
    try:
        aliases = {k: f"unet.{m}" for k, m in _original_names(pipe).items()} if magnitudes else {}
        dora.attach(_components(pipe), name, magnitudes, path, aliases)
    except LoraError:
        remove_adapter(pipe, name)
        raise


def remove_adapter(pipe, name: str) -> None:
    """Remove adapter `name` from `pipe`, if it is installed."""
    dora.detach(adapted_modules(pipe), name)
    if name in loaded_adapters(pipe):
        pipe.delete_adapters(name)


class InForce:
    """The adapter set in force in `pipe` for whole calls (one set for every row).

    A set of plain LoRAs is put in force by PEFT (`set_adapters`); a set with a DoRA adapter
    by `row_hooks` with that one set, until another set is asked for. `set` does nothing
    when the set asked for is in force; `forget` makes the next `set` put it in force again
    (after adapters were installed or removed, or rows set their own)."""

    def __init__(self, pipe):
        self.pipe = pipe
        self.active: ActiveSet | tuple[()] = ()  # () unknown, None the base model
        self._undo = None

    def set(self, loras: tuple[tuple[str, float], ...]) -> None:
        """Make exactly these adapters active at their scales, in name order (none, or every
        scale 0: the base model, bit for bit)."""
        want = tuple(sorted((n, s) for n, s in loras if s != 0)) or None
        if want == self.active:
            return
        self.forget()
        if want is None:
            if loaded_adapters(self.pipe):
                self.pipe.disable_lora()
        elif dora.uses_dora(adapted_modules(self.pipe), (n for n, _ in want)):
            self._undo = row_hooks(self.pipe, [want])
        else:
            self.pipe.enable_lora()
            self.pipe.set_adapters([n for n, _ in want], [s for _, s in want])
        self.active = want

    @property
    def hooked(self) -> bool:
        """Whether the set in force is put there by hooks (`row_hooks`: a DoRA adapter in it)."""
        return self._undo is not None

    def forget(self) -> None:
        if self._undo is not None:
            undo, self._undo = self._undo, None
            undo()
        self.active = ()


def row_hooks(pipe, sets: Sequence[tuple[tuple[str, float], ...]]):
    """Make row i of every batch use `sets[i]` in the denoiser and the text encoders (see
    `row_lora`; a batch of any size repeats the sets); returns the undo, which must run."""
    undos: list = []

    def undo_all() -> None:
        for undo in undos:
            undo()

    try:
        for module in adapted_modules(pipe):
            undos.append(apply_row_adapters(module, sets))
    except BaseException:
        undo_all()
        raise
    return undo_all


def adapted_modules(pipe) -> list[torch.nn.Module]:
    """The pipeline's modules adapters may change: its denoiser and text encoders."""
    return list(_components(pipe).values())


def row_adapter_sets(rows: Sequence[Row], params: CallParams) -> list[tuple[tuple[str, float], ...]]:
    """Each row's adapters (its own `Row.adapters`, else the call's `params.loras`), in name
    order and without those at scale 0."""
    return [tuple(sorted((n, sc) for n, sc in r.adapters or params.loras if sc != 0)) for r in rows]


def _components(pipe) -> dict[str, torch.nn.Module]:
    names = [denoiser_name(pipe), "text_encoder", "text_encoder_2", "text_encoder_3"]
    return {n: m for n in names if isinstance(m := getattr(pipe, n, None), torch.nn.Module)}


def _original_names(pipe) -> dict[str, str]:
    """A UNet's modules by the kohya names SDXL files give them (the original UNet's, as
    `lora_unet_input_blocks_4_0_in_layers_2`), to their diffusers paths; empty for others."""
    from serve_app.formats.single_file_write import UNET, unet_to_original

    unet = getattr(pipe, "unet", None)
    layers = getattr(unet, "config", {}).get("layers_per_block") if unet is not None else None
    if not isinstance(layers, int):
        return {}
    # Every name: the original numbering depends on them all.
    names = [n.replace(".base_layer", "") for n, _ in list(unet.named_parameters()) if "lora_" not in n]
    out = {}
    for name, key in zip(names, unet_to_original(dict.fromkeys(names), layers), strict=True):
        module = name.rsplit(".", 1)[0]
        out["lora_unet_" + key.removeprefix(UNET).rsplit(".", 1)[0].replace(".", "_")] = module
    return out


def _conv_shapes(pipe) -> dict[str, tuple[int, ...]]:
    """The weight shapes of the denoiser's convolutions by their kohya names (`lora_unet_` and the
    module's path with `_` for `.`; for a UNet, under its diffusers names as SD 1.x files have
    them and under the original UNet's as SDXL files have them) and by PEFT's (`unet.` and the
    path), so a LyCORIS update of one becomes a convolution's LoRA."""
    kohya = "lora_unet_" if denoiser_name(pipe) == "unet" else "lora_transformer_"
    out, convs = {}, {}
    for name, m in find_denoiser(pipe).named_modules():
        if isinstance(m, torch.nn.Conv2d):
            name = name.removesuffix(".base_layer")  # a layer with adapters holds it so
            out[kohya + name.replace(".", "_")] = out[f"{denoiser_name(pipe)}.{name}"] = tuple(m.weight.shape)
            convs[name] = tuple(m.weight.shape)
    out.update({key: convs[module] for key, module in _original_names(pipe).items() if module in convs})
    return out


def _adapter_weights(pipe, path: str) -> dict[str, torch.Tensor]:
    """An adapter's weights under the pipeline's key names. A PEFT directory's keys lose
    PEFT's `base_model.model.` and gain the denoiser's prefix, and its `lora_alpha / r` is
    folded into the B weights (diffusers loads a plain state dict at alpha = r). A PEFT LoHa
    directory's modules get its `alpha` (`lycoris` scales by alpha / r, as PEFT does); a PEFT
    LoKr's `alpha / r` is folded into its first factor (PEFT scales every LoKr module so, where
    LyCORIS's files scale only decomposed ones)."""
    from safetensors.torch import load_file

    folder = Path(path)
    if not folder.is_dir():
        return load_file(path)
    config = json.loads((folder / "adapter_config.json").read_text())
    kind = config.get("peft_type", "LORA")
    if kind not in ("LORA", "LOHA", "LOKR") or (config.get("use_dora") and kind != "LORA"):
        raise LoraError(f"{path}: a {kind} adapter; LoRA (DoRA too), LoHa and LoKr are loaded")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise LoraError(f"{path}: per-layer ranks or alphas (rank_pattern, alpha_pattern) are not loaded")
    r = config.get("r")
    if not isinstance(r, int) or r < 1:
        raise LoraError(f"{path}: adapter_config.json has no rank r")
    factor = float(config.get("lora_alpha" if kind == "LORA" else "alpha", r)) / r
    prefix = "unet" if getattr(pipe, "unet", None) is not None else "transformer"
    out = {}
    for key, value in load_file(str(folder / "adapter_model.safetensors")).items():
        key = key.removeprefix("base_model.model.")
        key = key if key.startswith(f"{prefix}.") else f"{prefix}.{key}"
        part = key.rsplit(".", 1)[-1]
        if kind == "LORA" and "lora_B" in key and factor != 1.0:
            value = value * factor
        elif kind == "LOKR" and part in ("lokr_w1", "lokr_w1_a"):
            value = value * factor
        elif kind == "LOHA" and part == "hada_w1_a":
            out[key.rsplit(".", 1)[0] + ".alpha"] = torch.tensor(factor * r)
        out[key] = value
    return out
