"""DoRA adapters: a LoRA whose layer's weight is then set to a learned norm per output.

A DoRA module is a LoRA (`B A`, scaled by `k`: the request's scale times `alpha / r`) and a
magnitude vector `m`, one value per output channel: the layer's weight becomes
`m * (W + k B A) / ||W + k B A||`, the norm taken per output over the rest of the weight (as
PEFT computes it; LyCORIS's files at multiplier 1 agree). Per output that is a gain
`g = m / ||W + k B A||` on the layer's output without its bias and on the LoRA's output:
`y = W x + b + (g - 1) W x + g k B A x`. So a DoRA module runs as a LoRA whose B is scaled by
`g`, plus `g - 1` times the base output, which `row_lora` adds per row.

diffusers drops the magnitudes of kohya files as it loads them (its SD converter warns and
filters `dora_scale`), and PEFT would take each DoRA adapter's norm over what the adapters
before it added. So the magnitudes are taken out of the file before diffusers sees it
(`split`), the LoRA part loads as any LoRA does, and the magnitudes are attached to the layers
PEFT made for it (`attach`). Each DoRA adapter is applied against the base weight, whatever
else is in force: stacked adapters do not depend on their order.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from serve_app.engine.types import LoraError

_ATTR = "serve_dora_magnitudes"  # on a PEFT LoRA layer: {adapter name: magnitude (out,)}
_KOHYA = ".dora_scale"  # kohya/LyCORIS files
_PEFT = (".lora_magnitude_vector", ".lora_magnitude_vector.weight")  # PEFT's state dicts

# Each adapted component's key prefixes: kohya's (module path with `_` for `.`) and PEFT's.
_PREFIXES = {
    "unet": ("lora_unet_",),
    "transformer": ("lora_transformer_",),
    "text_encoder": ("lora_te_", "lora_te1_"),
    "text_encoder_2": ("lora_te2_",),
    "text_encoder_3": ("lora_te3_",),
}


def split(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """`state` without its DoRA magnitudes, and the magnitudes by module key (kohya's
    `<module>.dora_scale`, or PEFT's `<module>.lora_magnitude_vector`, the key without that)."""
    rest, magnitudes = {}, {}
    for key, value in state.items():
        if key.endswith(_KOHYA):
            magnitudes[key.removesuffix(_KOHYA)] = value
        elif key.endswith(_PEFT):
            magnitudes[key.removesuffix(".weight").removesuffix(".lora_magnitude_vector")] = value
        else:
            rest[key] = value
    return rest, magnitudes


def attach(
    components: dict[str, torch.nn.Module],
    name: str,
    magnitudes: dict,
    path: str,
    aliases: dict | None = None,
) -> None:
    """Give adapter `name`'s LoRA layers (in `components`, by their pipeline names) their
    magnitudes; `aliases`: more kohya names, to `component.path` (an SDXL UNet's original
    names). LoraError naming the module for one that fits no layer of the adapter or whose base
    weight is quantized (the caller then removes the adapter)."""
    from peft.tuners.lora import LoraLayer

    layers = {}
    for component, module in components.items():
        for mod_path, layer in module.named_modules():
            if isinstance(layer, LoraLayer) and name in layer.lora_A:
                layers[f"{component}.{mod_path}"] = layer
                for prefix in _PREFIXES.get(component, ()):
                    layers[prefix + mod_path.replace(".", "_")] = layer
    for alias, target in (aliases or {}).items():
        if target in layers:
            layers.setdefault(alias, layers[target])
    for key, m in magnitudes.items():
        layer = layers.get(key)
        if layer is None:
            raise LoraError(
                f"{path}: a DoRA magnitude for {key}, a layer this adapter's LoRA weights do not change"
            )
        a, b = layer.lora_A[name], layer.lora_B[name]
        if not (
            isinstance(a, torch.nn.Linear | torch.nn.Conv2d)
            and isinstance(b, torch.nn.Linear | torch.nn.Conv2d)
        ):
            raise LoraError(f"{path}: {key}: DoRA on a {type(a).__name__} layer is not loaded")
        weight = layer.get_base_layer().weight
        if type(weight.data) is not torch.Tensor or weight.is_meta:  # GGUF, torchao: no dense W
            raise LoraError(f"{path}: {key}: DoRA on a quantized or offloaded layer is not loaded")
        out = weight.shape[0]
        peft_key = key.startswith(tuple(f"{c}." for c in components))  # PEFT's: always per output
        if m.numel() != out or (not peft_key and m.shape[0] != out):
            axis = (
                "its input axis (LyCORIS wd_on_output off)"
                if m.shape[0] == 1 and out != 1
                else "no axis of it"
            )
            raise LoraError(
                f"{path}: {key}: a DoRA magnitude of shape {tuple(m.shape)} for a layer of {out} outputs "
                f"normalises over {axis}; only magnitudes per output are loaded"
            )
        mine = layer.__dict__.setdefault(_ATTR, {})
        mine[name] = m.detach().reshape(out).float()


def detach(components: Iterable[torch.nn.Module], name: str) -> None:
    """Forget adapter `name`'s magnitudes (it is being removed)."""
    for module in components:
        for layer in module.modules():
            layer.__dict__.get(_ATTR, {}).pop(name, None)


def uses_dora(components: Iterable[torch.nn.Module], names: Iterable[str]) -> bool:
    """Whether any of the adapters `names` has a DoRA magnitude on a layer of `components`."""
    names = set(names)
    return any(names & layer.__dict__.get(_ATTR, {}).keys() for m in components for layer in m.modules())


def gain(layer, name: str, k: float) -> torch.Tensor | None:
    """`m / ||W + k B A||` per output of `layer` for adapter `name` at LoRA scaling `k`, in
    float32 on the weight's device; None where `name` is a plain LoRA on this layer."""
    m = layer.__dict__.get(_ATTR, {}).get(name)
    if m is None:
        return None
    w = layer.get_base_layer().weight.detach()
    a, b = layer.lora_A[name].weight.detach(), layer.lora_B[name].weight.detach()
    with torch.no_grad():
        delta = (b.flatten(1).float() @ a.flatten(1).float().to(b.device)).reshape(w.shape).to(w.device)
        norm = (w.float() + k * delta).flatten(1).norm(dim=1)
    return m.to(norm.device) / norm
