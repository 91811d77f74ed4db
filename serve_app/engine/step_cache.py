"""Step caching: some denoising steps reuse the denoiser's block outputs instead of running them.

Built on diffusers' TaylorSeer hooks: a cached block runs in full on the first steps and then
once every `interval` steps; on the steps between, its output is extrapolated from the last
full runs (a first-order Taylor step). Which steps run in full depends only on the step index,
never on the data, so a row's image does not depend on the rows it shares a call with.

Levels, from the request's `acceleration` (or OpenAI's `quality`):

* `none`: every step runs every block.
* `fast`: the cached blocks run every second step.
* `faster`: the cached blocks run every fourth step.

The first steps (two, or a tenth of a schedule of 30 steps or more) and the last step always
run in full. The cached blocks are the transformer blocks of a DiT (SD3, FLUX, Wan...) and of a
UNet's attention layers (its ResNet blocks and convolutions always run).
"""

from __future__ import annotations

import contextlib
import re
import typing
from collections.abc import Iterator

import torch

from serve_app.config import Acceleration

# diffusers' hooks are imported where they are used: importing them pulls in diffusers, peft,
# transformers and torch's compiler (about 6 s), which building an app (`serve run`, the
# controller's build of `serve deploy`) does not need.

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
    # The hooks count steps from 0 and run steps 0..warm-1 in full: two at least, since a
    # first-order extrapolation needs two full runs (a tenth of the steps on long schedules).
    return max(2, steps // 10)


class StepCache:
    """One pipeline call's cache. Its hooks keep one state per denoiser call of a step (call 0,
    call 1...), so that a pipeline calling the denoiser twice a step (a negative prompt run
    apart, a second-order scheduler) never extrapolates one call from the other's outputs.
    The engine calls `step_done` at the end of every denoising step."""

    def __init__(self, denoiser: torch.nn.Module, pipe, hooks: list):
        self._pipe, self._hooks = pipe, hooks
        self._call = 0
        self._sized = False
        self._handle = denoiser.register_forward_pre_hook(self._before_call)

    def _before_call(self, module, args) -> None:
        if not self._sized:  # the pipeline knows its step count now (img2img runs fewer)
            steps = getattr(self._pipe, "num_timesteps", None)
            if steps:
                for hook in self._hooks:
                    hook.disable_cache_after_step = int(steps) - 1  # the last step runs in full
            self._sized = True
        from diffusers.hooks.hooks import CacheContext

        context = CacheContext(f"call{self._call}")
        for hook in self._hooks:  # over the context a pipeline may have set for this call
            hook.state_manager.set_context(context)
        self._call += 1

    def step_done(self) -> None:
        self._call = 0

    def close(self) -> None:
        self._handle.remove()
        for hook in self._hooks:
            hook.state_manager.set_context(None)


class NoCache:
    def step_done(self) -> None:
        pass


@contextlib.contextmanager
def step_cache(
    denoiser: torch.nn.Module, pipe, level: str, steps: int, blocks: list[str]
) -> Iterator[StepCache | NoCache]:
    """Cache `blocks` of `denoiser` (from `cached_blocks`) at `level` for one call of `pipe` of
    `steps` steps; everything is removed on the way out, whatever happened."""
    if level == "none":
        yield NoCache()
        return
    if level not in _INTERVAL:
        raise ValueError(f"unknown acceleration level {level!r}; allowed: {', '.join(LEVELS)}")
    from diffusers.hooks import HookRegistry, TaylorSeerCacheConfig, apply_taylorseer_cache
    from diffusers.hooks.taylorseer_cache import _TAYLORSEER_CACHE_HOOK

    config = TaylorSeerCacheConfig(
        cache_interval=_INTERVAL[level],
        disable_cache_before_step=_warm(steps),
        disable_cache_after_step=steps - 1,  # corrected from the pipeline's count at its first call
        max_order=1,
        taylor_factors_dtype=torch.float32,
        cache_identifiers=["|".join(re.escape(n) for n in blocks)],  # one match per module name
    )
    registry = HookRegistry.check_if_exists_or_initialize(denoiser)
    cache = None
    try:
        apply_taylorseer_cache(denoiser, config)
        registry.invalidate_child_registries_cache()
        hooks = [denoiser.get_submodule(n)._diffusers_hook.get_hook(_TAYLORSEER_CACHE_HOOK) for n in blocks]
        cache = StepCache(denoiser, pipe, hooks)
        yield cache
    finally:
        if cache is not None:
            cache.close()
        registry.reset_stateful_hooks(recurse=True)
        registry.remove_hook(_TAYLORSEER_CACHE_HOOK, recurse=True)  # also a half-done install's
        registry.invalidate_child_registries_cache()
        for name in blocks:  # the hooks' registries leave the class's forward set on each block:
            block = denoiser.get_submodule(name)  # gone, a compiled denoiser's graphs fit again
            own = block.__dict__.get("forward")
            if own is not None and getattr(own, "__func__", None) is type(block).forward:
                del block.__dict__["forward"]
