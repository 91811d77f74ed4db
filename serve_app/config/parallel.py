"""`model.parallel`: one request on several ranks, and which degrees can run together."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from serve_app.config.services import _Strict


class ParallelConfig(_Strict):
    """One request on several processes (one GPU each on CUDA): the replica holds a placement
    group of that many bundles and one worker per bundle after its own."""

    cfg: Literal[1, 2] = Field(
        1,
        description="2: classifier-free guidance parallel; the conditional and unconditional halves of "
        "each guided denoiser call run on two ranks (gloo on CPU, NCCL on CUDA) and are gathered.",
    )
    ulysses: int = Field(
        1,
        ge=1,
        le=8,
        description="Sequence parallel (Ulysses, diffusers' context parallelism) over this many ranks: "
        "each holds a part of the image or video tokens, attention swaps heads for tokens (all-to-all). "
        "Transformers with a context-parallel plan only; must divide the attention heads.",
    )
    ring: int = Field(
        1,
        ge=1,
        le=8,
        description="Ring attention over this many ranks (diffusers' context parallelism): needs an "
        "attention op that returns its log-sum-exp, so CUDA with a bf16/fp16 model and "
        "`optimizations.attention_backend` `_native_cudnn`, `_native_flash` or `flash`.",
    )

    @property
    def world(self) -> int:
        return self.cfg * self.ulysses * self.ring


# Attention backends that return the log-sum-exp ring attention merges partial results with.
RING_BACKENDS = ("_native_cudnn", "_native_flash", "flash")


def check_parallel(m: Any, where: str) -> None:
    """The degrees of `model.parallel` (of the `ModelConfig` `m`) that can run together, on its
    device and dtype."""
    par = m.parallel
    if par.world > 8:
        raise ValueError(f"{where}.parallel: {par.world} ranks; at most 8 (one node)")
    if par.ring > 1:
        if m.device == "cpu":
            raise ValueError(
                f"{where}.parallel.ring: ring attention needs an attention op that returns its log-sum-exp, "
                "and the CPU has none (use ulysses)"
            )
        if m.optimizations.attention_backend not in RING_BACKENDS or m.dtype == "float32":
            raise ValueError(
                f"{where}.parallel.ring: needs model.optimizations.attention_backend one of "
                f"{', '.join(RING_BACKENDS)} and a half-precision model.dtype (not float32)"
            )
