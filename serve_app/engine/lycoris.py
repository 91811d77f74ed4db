"""LyCORIS adapters (LoHa, LoKr) as the exact LoRA they are, in kohya's layout.

A LoHa module changes a weight by `(w1a @ w1b) * (w2a @ w2b) * alpha / r` (a Hadamard product
of two low-rank products), a LoKr module by `kron(w1, w2)` (each factor whole, or a low-rank
product scaled by `alpha / r`). Both are low-rank updates of a known rank, so each is written
here as a LoRA without loss: the Hadamard product of `U1 V1` and `U2 V2` is `U V` with `U`'s
columns the products of `U1`'s and `U2`'s (rank r1 r2), and `kron(A B, C D)` is
`kron(A, C) kron(B, D)`. The LoRA then takes the path every LoRA takes (diffusers' kohya
converter, peft, per-row mixing), at a rank of r1 r2 (LoHa) or rank(w1) rank(w2) (LoKr).
Tucker-decomposed convolutions (`hada_t1`, `lokr_t2`) are refused, naming the module.
"""

from __future__ import annotations

import torch

_LOHA = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
_LOKR = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")
_TUCKER = ("hada_t1", "hada_t2", "lokr_t2")


class LycorisError(ValueError):
    """A LyCORIS module this server cannot write as a LoRA; the message names it."""


def is_lycoris(state: dict[str, torch.Tensor]) -> bool:
    return any(k.rsplit(".", 1)[-1] in _LOHA + _LOKR + _TUCKER for k in state)


def algorithms(state: dict[str, torch.Tensor]) -> list[str]:
    """The LyCORIS algorithms in `state` ("LoHa", "LoKr"), for messages and listings."""
    ends = {k.rsplit(".", 1)[-1] for k in state}
    return [name for name, keys in (("LoHa", _LOHA), ("LoKr", _LOKR)) if ends & set(keys)]


def as_lora(state: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]] | None = None) -> dict:
    """`state` with each LoHa or LoKr module (kohya's `<module>.hada_*` / `<module>.lokr_*` and
    `.alpha`) replaced by the kohya LoRA of the same update (`lora_down`, `lora_up`, `alpha` =
    its rank), or, for a module under PEFT's names (not `lora_...`), by PEFT's LoRA keys
    (`lora_A`, `lora_B`); other keys are kept. `shapes`: the base weight's shape by module name where known,
    so a convolution's LoRA gets its kernel's shape (else a flattened update is read as a linear
    layer's). LycorisError for a module that cannot be written so."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    out = {}
    for key, value in state.items():
        module, _, part = key.rpartition(".")
        if part in _TUCKER:
            raise LycorisError(f"{module}: a Tucker-decomposed convolution ({part}) is not loaded")
        if part in _LOHA + _LOKR or (
            part == "alpha" and any(f"{module}.{p}" in state for p in _LOHA + _LOKR)
        ):
            modules.setdefault(module, {})[part] = value.float()
        else:
            out[key] = value
    for module, parts in modules.items():
        up, down = _loha(module, parts) if "hada_w1_a" in parts else _lokr(module, parts)
        shape = (shapes or {}).get(module)
        if shape is not None and len(shape) == 4:  # a convolution: its kernel on the down side
            down, up = down.reshape(down.shape[0], *shape[1:]), up[:, :, None, None]
        if module.startswith("lora_"):  # kohya's names, and alpha = rank: the update as it is
            out[f"{module}.lora_up.weight"] = up.contiguous()
            out[f"{module}.lora_down.weight"] = down.contiguous()
            out[f"{module}.alpha"] = torch.tensor(float(down.shape[0]))
        else:  # PEFT's (a directory's), which diffusers loads at alpha = rank
            out[f"{module}.lora_B.weight"] = up.contiguous()
            out[f"{module}.lora_A.weight"] = down.contiguous()
    return out


def _loha(module: str, p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    if not all(k in p for k in _LOHA):
        raise LycorisError(f"{module}: a LoHa module needs {', '.join(_LOHA)}")
    w1a, w1b, w2a, w2b = (p[k].flatten(1) if p[k].dim() > 2 else p[k] for k in _LOHA)
    scale = float(p["alpha"]) / w1b.shape[0] if "alpha" in p else 1.0
    up = (w1a[:, :, None] * w2a[:, None, :]).flatten(1) * scale
    down = (w1b[:, None, :] * w2b[None, :, :]).flatten(0, 1)
    return up, down


def _lokr(module: str, p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    factors = []
    for side in ("w1", "w2"):
        whole, a, b = p.get(f"lokr_{side}"), p.get(f"lokr_{side}_a"), p.get(f"lokr_{side}_b")
        if whole is not None:
            whole = whole.flatten(1) if whole.dim() > 2 else whole
            factors.append((whole, torch.eye(whole.shape[1])))  # whole = whole @ I
        elif a is not None and b is not None:
            factors.append((a, b.flatten(1) if b.dim() > 2 else b))
        else:
            raise LycorisError(
                f"{module}: a LoKr module needs lokr_{side} or lokr_{side}_a and lokr_{side}_b"
            )
    decomposed = p.get("lokr_w2_b", p.get("lokr_w1_b"))
    scale = float(p["alpha"]) / decomposed.shape[0] if decomposed is not None and "alpha" in p else 1.0
    (a1, b1), (a2, b2) = factors
    return torch.kron(a1, a2) * scale, torch.kron(b1, b2)
