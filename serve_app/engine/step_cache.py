"""Step caching: some denoising steps reuse the denoiser's block outputs instead of running them.

Built on diffusers' TaylorSeer hooks: a cached block runs in full on the first steps and then
once every `interval` steps; on the steps between, its output is extrapolated from the last
full runs (a first-order Taylor step). Which steps run in full depends only on the step index,
never on the data, so a row's image does not depend on the rows it shares a call with.

Levels, from the request's `acceleration` (or OpenAI's `quality`):

* `none`: every step runs every block.
* `fast`: the cached blocks run every second step.
* `faster`: the cached blocks run every fourth step.

The first `warm` steps and the last step always run in full. The cached blocks are the
transformer blocks of a DiT (SD3, FLUX, Wan...) and of a UNet's attention layers (its ResNet
blocks and convolutions always run).
"""

from __future__ import annotations

import contextlib
import re
import typing
from collections.abc import Iterator

import torch
from diffusers.hooks import HookRegistry, TaylorSeerCacheConfig, apply_taylorseer_cache
from diffusers.hooks.hooks import CacheContext, _set_cache_context
from diffusers.hooks.taylorseer_cache import _TAYLORSEER_CACHE_HOOK

from serve_app.config import Acceleration

LEVELS: tuple[str, ...] = typing.get_args(Acceleration)
_INTERVAL = {"fast": 2, "faster": 4}

# Names (re.fullmatch) of the blocks whose outputs are cached: a DiT's blocks, a UNet's
# attention transformers.
_BLOCKS = (
    r"transformer_blocks\.\d+",
    r"single_transformer_blocks\.\d+",
    r"blocks\.\d+",
    # A UNet's transformer blocks inside its attention layers (those layers return 1-tuples,
    # which the hooks' extrapolation would hand back as bare tensors).
    r"(down_blocks\.\d+|up_blocks\.\d+|mid_block)\.attentions\.\d+\.transformer_blocks\.\d+",
)


def cached_blocks(denoiser: torch.nn.Module) -> list[str]:
    """The names of the blocks a step cache would cache in `denoiser` (empty: it cannot).

    A block that returns no text stream (SD3's last joint block: `context_pre_only`) is left
    out: the hooks extrapolate tensors, and its first output is None."""
    return [
        n
        for n, m in denoiser.named_modules()
        if any(re.fullmatch(p, n) for p in _BLOCKS) and not getattr(m, "context_pre_only", False)
    ]


def _warm(steps: int) -> int:
    # Two full runs at least before the first extrapolated step (a first-order step needs two).
    return max(3, steps // 10 + 1)


@contextlib.contextmanager
def step_cache(denoiser: torch.nn.Module, level: str, steps: int) -> Iterator[None]:
    """Cache `denoiser`'s blocks at `level` for one pipeline call of `steps` denoiser calls."""
    if level == "none":
        yield
        return
    if level not in _INTERVAL:
        raise ValueError(f"unknown acceleration level {level!r}; allowed: {', '.join(LEVELS)}")
    config = TaylorSeerCacheConfig(
        cache_interval=_INTERVAL[level],
        disable_cache_before_step=_warm(steps),
        disable_cache_after_step=steps,  # the last call runs in full
        max_order=1,
        taylor_factors_dtype=torch.float32,
        cache_identifiers=[re.escape(n) for n in cached_blocks(denoiser)],
    )
    apply_taylorseer_cache(denoiser, config)
    registry = HookRegistry.check_if_exists_or_initialize(denoiser)
    registry.invalidate_child_registries_cache()
    # Pipelines that name their denoiser calls (FLUX, Wan: "cond", "uncond") set the context
    # themselves for each call; for the others every call of this pipeline call is one context.
    _set_cache_context(denoiser, CacheContext("cond"))
    try:
        yield
    finally:
        _set_cache_context(denoiser, None)
        registry.reset_stateful_hooks(recurse=True)
        registry.remove_hook(_TAYLORSEER_CACHE_HOOK, recurse=True)
        registry.invalidate_child_registries_cache()
