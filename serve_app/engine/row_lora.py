"""Per-row LoRA deltas: one denoiser call whose rows use different adapter sets.

For the length of a call every LoRA layer of the denoiser runs its base layer once for the whole
batch, and a forward hook adds each row's own low-rank delta. Per layer, every distinct adapter
set of the call becomes one slot of two stacked tensors: its adapters' A matrices stacked along
the rank and their scaled B matrices side by side (one LoRA of the summed rank whose delta is the
sum of theirs), zero-padded to the call's largest rank. Slot 0 is all zeros: rows without
adapters. Each row then gathers its slot, and two batched matrix products (or two grouped
convolutions) give every row its delta at once, whatever the number of distinct sets.

A DoRA adapter (`dora`) enters its slot as a LoRA whose B is scaled by its gain per output,
and the slot adds `gain - 1` times the base output without its bias.

Linear and 2-D convolution layers take that path; any other LoRA layer type adds its rows'
deltas slot by slot through PEFT's own modules (DoRA is not loaded on those).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from serve_app.engine import dora

AdapterSet = tuple[tuple[str, float], ...]  # (name, scale) pairs, sorted


def unit_scaling(layer, name: str) -> float:
    """The scaling of `layer`'s adapter `name` at scale 1 (as PEFT's set_scale computes it)."""
    rank = layer.r[name] ** 0.5 if layer.use_rslora.get(name, False) else layer.r[name]
    return layer.lora_alpha[name] / rank


def apply_row_adapters(denoiser: torch.nn.Module, sets: Sequence[AdapterSet]) -> Callable[[], None]:
    """Make row i of every batch the denoiser sees use `sets[i]` (empty: the base output, bit
    for bit). A batch may hold the rows several times over (the halves of classifier-free
    guidance); the sets repeat with them. Returns the undo, which the caller must run."""
    from peft.tuners.lora import LoraLayer

    distinct = sorted({s for s in sets if s})
    slot = torch.tensor([distinct.index(s) + 1 if s else 0 for s in sets])
    saved, hooks = [], []

    def undo() -> None:
        for h in hooks:
            h.remove()
        for layer, active in saved:
            layer._active_adapter = active

    try:
        for layer in denoiser.modules():
            if not isinstance(layer, LoraLayer):
                continue
            saved.append((layer, layer._active_adapter))
            layer._active_adapter = []  # PEFT runs the base layer alone; the hook adds the rest
            parts = [[(n, sc * unit_scaling(layer, n)) for n, sc in s if n in layer.lora_A] for s in distinct]
            if any(parts):
                hooks.append(layer.register_forward_hook(_delta_hook(layer, parts, slot), with_kwargs=True))
    except BaseException:
        undo()
        raise
    return undo


def _delta_hook(layer, parts: list[list[tuple[str, float]]], slot: torch.Tensor):
    first = next(n for ps in parts for n, _ in ps)
    a_mod, b_mod = layer.lora_A[first], layer.lora_B[first]
    linear = isinstance(a_mod, torch.nn.Linear) and isinstance(b_mod, torch.nn.Linear)
    conv = isinstance(a_mod, torch.nn.Conv2d) and isinstance(b_mod, torch.nn.Conv2d) and b_mod.groups == 1
    if not (linear or conv):
        return _slotwise_hook(layer, parts, slot)
    a, b, gains = _stack(layer, parts)
    base_bias = layer.get_base_layer().bias
    bias = None  # PEFT's lora_bias: B has a bias, scaled with its adapter
    if any(layer.lora_B[n].bias is not None for ps in parts for n, _ in ps):
        bias = b.new_zeros((len(parts) + 1, b.shape[1]))
        with torch.no_grad():
            for j, ps in enumerate(parts, 1):
                for n, k in ps:
                    if layer.lora_B[n].bias is not None:
                        bias[j] += k * layer.lora_B[n].bias
    if linear:  # (slots, in, rank) and (slots, rank, out): x @ A^T @ B^T as two bmm
        a, b = a.transpose(1, 2).contiguous(), b.transpose(1, 2).contiguous()

    def hook(module, args, kwargs, out):
        x = args[0] if args else kwargs["x"]
        rows = slot.repeat(x.shape[0] // len(slot)).to(x.device)
        xa = x.to(a.dtype)
        if linear:
            d = torch.bmm(torch.bmm(xa.reshape(x.shape[0], -1, x.shape[-1]), a[rows]), b[rows])
            if bias is not None:
                d = d + bias[rows][:, None, :]
        else:  # each row its own group: (1, rows*in, H, W) convolved with (rows*rank, in, k, k)
            n = x.shape[0]
            h = F.conv2d(
                xa.reshape(1, -1, *x.shape[2:]),
                a[rows].flatten(0, 1),
                None,
                a_mod.stride,
                a_mod.padding,
                a_mod.dilation,
                n,
            )
            d = F.conv2d(h, b[rows].flatten(0, 1), None, b_mod.stride, b_mod.padding, b_mod.dilation, n)
            if bias is not None:
                d = d + bias[rows].reshape(1, -1, 1, 1)
        d = d.reshape(out.shape)
        if gains is not None:  # DoRA: (gain - 1) times the base output without its bias
            base = out if base_bias is None else out - (base_bias if linear else base_bias.reshape(-1, 1, 1))
            g = gains[rows].to(out.device)
            d = d + (
                g.reshape(len(rows), *[1] * (out.dim() - 2), -1) if linear else g.reshape(*g.shape, 1, 1)
            ) * base.to(d.dtype)
        return out + d.to(out.dtype)

    return hook


def _stack(layer, parts: list[list[tuple[str, float]]]):
    """Slot 0 zeros, slot j the j-th set: A rows stacked, scaled B columns side by side; and,
    where a set has a DoRA adapter here, each slot's summed `gain - 1` per output (else None)."""
    rank = max(sum(layer.r[n] for n, _ in ps) for ps in parts)
    a0 = next(layer.lora_A[n].weight for ps in parts for n, _ in ps)
    b0 = next(layer.lora_B[n].weight for ps in parts for n, _ in ps)
    a = a0.new_zeros((len(parts) + 1, rank, *a0.shape[1:]))
    b = b0.new_zeros((len(parts) + 1, b0.shape[0], rank, *b0.shape[2:]))
    gains = None
    with torch.no_grad():
        for j, ps in enumerate(parts, 1):
            at = 0
            for n, k in ps:
                r = layer.r[n]
                a[j, at : at + r] = layer.lora_A[n].weight
                b[j, :, at : at + r] = k * layer.lora_B[n].weight
                g = dora.gain(layer, n, k)
                if g is not None:
                    gains = b0.new_zeros((len(parts) + 1, b0.shape[0])) if gains is None else gains
                    gains[j] += (g - 1).to(gains)
                    b[j, :, at : at + r] *= g.to(b).reshape(-1, *[1] * (b0.dim() - 1))
                at += r
    return a, b, gains


def _slotwise_hook(layer, parts: list[list[tuple[str, float]]], slot: torch.Tensor):
    """Any other layer type: each slot's rows through PEFT's own A and B modules."""

    def hook(module, args, kwargs, out):
        x = args[0] if args else kwargs["x"]
        rows = slot.repeat(x.shape[0] // len(slot)).to(x.device)
        out = out.clone()
        for j, ps in enumerate(parts, 1):
            mine = rows == j
            if ps and bool(mine.any()):
                xs = x[mine]
                out[mine] += sum(
                    layer.lora_B[n](layer.lora_A[n](xs.to(layer.lora_A[n].weight.dtype))) * k for n, k in ps
                ).to(out.dtype)
        return out

    return hook
