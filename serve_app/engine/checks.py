"""Checks of a call before it runs: its task, its `extra` arguments, its prompt embeddings and
its per-call options, against what this model's pipelines take.

Each refusal is a ValueError whose message starts with the request's field.
"""

from __future__ import annotations

import inspect
import math
import re
import typing
from typing import Any

import torch

from serve_app.engine.families import Family
from serve_app.engine.loading import find_denoiser, model_tasks

# Pipeline call arguments the engine sets itself; a request's `extra` may not override them.
RESERVED_EXTRA_KEYS = frozenset(
    {
        "prompt", "prompt_2", "prompt_3", "negative_prompt", "negative_prompt_2", "negative_prompt_3",
        "height", "width", "num_inference_steps", "guidance_scale", "generator", "num_images_per_prompt",
        "output_type", "return_dict", "callback_on_step_end", "callback_on_step_end_tensor_inputs",
        "callback", "callback_steps", "latents", "prompt_embeds", "negative_prompt_embeds",
        "pooled_prompt_embeds", "negative_pooled_prompt_embeds", "image", "mask_image", "strength",
        "num_frames", "num_videos_per_prompt", "_auto_resize", "max_area",
    }
)  # fmt: skip

MAX_EMBED_TOKENS = 1024  # the longest prompt embeddings taken where the length is free


def named_call_args(pipe) -> dict[str, Any]:
    """The pipeline call's own arguments that `extra` may set, each with a validator of its
    annotated type (None where the annotation says nothing checkable)."""
    from pydantic import ConfigDict, TypeAdapter

    params = inspect.signature(pipe.__call__).parameters
    try:
        hints = typing.get_type_hints(type(pipe).__call__)
    except Exception:  # an annotation that does not resolve: names only
        hints = {}
    config = ConfigDict(arbitrary_types_allowed=True, allow_inf_nan=False)
    out = {}
    for name, p in params.items():
        if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) or name in RESERVED_EXTRA_KEYS:
            continue
        try:
            out[name] = TypeAdapter(hints[name], config=config) if name in hints else None
        except Exception:
            out[name] = None
    return out


class CallChecks:
    """The checks of one engine's calls: `pipe` is the loaded pipeline, `task_pipes` the
    pipeline of each task, `accelerations` the step-caching levels on offer. The validators of
    each task's call arguments are built once, here."""

    def __init__(
        self,
        pipe,
        task_pipes: dict[str, Any],
        family: Family,
        device: torch.device,
        accelerations: tuple[str, ...],
    ):
        self.pipe = pipe
        self.task_pipes = task_pipes
        self.family = family
        self.device = device
        self.accelerations = accelerations
        self.call_args = {task: named_call_args(p) for task, p in task_pipes.items()}

    def check_task(self, task: str) -> None:
        if task not in self.task_pipes:
            can = ", ".join(model_tasks(self.task_pipes))
            raise ValueError(f"{type(self.pipe).__name__} cannot do {task}; this model does: {can}")

    def check_extra(self, extra: dict[str, Any], task: str = "generate") -> dict[str, Any]:
        """`extra` checked against the signature of the task's pipeline call: names it does not
        take are refused (diffusers would drop them silently), and each value must fit the
        argument's annotated type. Returns the values as the pipeline will get them ("0.3" -> 0.3)."""
        reserved = sorted(RESERVED_EXTRA_KEYS.intersection(extra))
        if reserved:
            raise ValueError(f"extra: may not set {', '.join(reserved)}: use the request's own fields")
        self.check_task(task)
        args, pipe = self.call_args[task], type(self.task_pipes[task]).__name__
        unknown = sorted(set(extra) - set(args))
        if unknown:
            raise ValueError(
                f"extra: {pipe} takes no argument {', '.join(map(repr, unknown))}; "
                f"it takes: {', '.join(sorted(args))}"
            )
        out = {}
        for name, value in extra.items():
            adapter = args[name]
            try:
                out[name] = value if adapter is None else adapter.validate_python(value)
            except Exception as e:
                errors = getattr(e, "errors", lambda: [])()
                why = errors[0]["msg"] if errors else str(e)
                raise ValueError(f"extra.{name}: {why} (got {value!r:.60})") from None
            _check_schedule(name, out[name])
        return out

    def edit_strength(self) -> dict[str, dict[str, Any]]:
        """For each task whose pipeline takes `strength`: its default there and whether it runs
        `int(steps × strength)` denoising steps (SD, SDXL: fewer than one runs none, and the call
        fails) rather than at least one (FLUX, SD3). Read from the pipeline's own code."""
        out = {}
        for task, pipe in self.task_pipes.items():
            param = inspect.signature(pipe.__call__).parameters.get("strength")
            if param is None:
                continue
            try:
                source = inspect.getsource(type(pipe).get_timesteps)
            except (AttributeError, OSError, TypeError):
                source = ""
            whole = re.search(r"int\(\s*num_inference_steps\s*\*\s*strength\s*\)", source) is not None
            default = param.default if isinstance(param.default, int | float) else 1.0
            out[task] = {"default": float(default), "whole_steps": whole}
        return out

    def check_embeds(self, embeds: torch.Tensor, pooled: torch.Tensor | None = None, which: str = "") -> None:
        """Refuse embeddings this pipeline cannot take, naming the shapes it wants. Families whose
        denoiser is also conditioned on a pooled text vector (SDXL, SD3, FLUX) need that too.
        `which` is "" or "negative_": the fields' prefix in the messages."""
        fam, pipe = self.family, type(self.pipe).__name__
        name, pooled_name = f"{which}prompt_embeds", f"{which}pooled_prompt_embeds"
        if fam.embeds_dim is None:
            raise ValueError(f"{name}: {pipe} takes no prompt embeddings")
        tokens = fam.embeds_tokens
        want = f"(1, {tokens if tokens else 'tokens'}, {fam.embeds_dim})"
        if fam.pooled_dim is not None:
            want += f" with pooled_prompt_embeds (1, {fam.pooled_dim})"
        shape = tuple(embeds.shape)
        fits = (
            len(shape) == 3
            and shape[0] == 1
            and shape[2] == fam.embeds_dim
            and (shape[1] == tokens if tokens else 1 <= shape[1] <= MAX_EMBED_TOKENS)
        )
        if not fits:
            raise ValueError(f"{name}: shape {shape} does not fit this model, which wants {want}")
        if fam.pooled_dim is None:
            if pooled is not None:
                raise ValueError(f"{pooled_name}: {pipe} takes no pooled embeddings")
        elif pooled is None or tuple(pooled.shape) != (1, fam.pooled_dim):
            got = "none" if pooled is None else f"shape {tuple(pooled.shape)}"
            raise ValueError(f"{pooled_name}: got {got}; this model wants {want}")

    def takes(self, argument: str, task: str = "generate") -> bool:
        """Whether the task's pipeline call has this argument."""
        return argument in self.call_args.get(task, {})

    def check_options(
        self, generator_device: str | None, vae_slicing: bool, vae_tiling: bool, acceleration: str = "none"
    ) -> None:
        """Refuse per-call options this engine cannot honour; the message starts with the field."""
        here = self.device.type
        if acceleration not in self.accelerations:
            can = ", ".join(self.accelerations)
            raise ValueError(f"acceleration: {type(find_denoiser(self.pipe)).__name__} offers {can}")
        if generator_device not in (None, "cpu", here):
            raise ValueError(f"generator_device: this model runs on {here}; use cpu or {here}")
        vae = getattr(self.pipe, "vae", None)
        for name, flag, method in (("vae_use_slicing", vae_slicing, "enable_slicing"),
                                   ("vae_use_tiling", vae_tiling, "enable_tiling")):  # fmt: skip
            if flag and not hasattr(vae, method):
                raise ValueError(f"{name}: the VAE of {type(self.pipe).__name__} cannot do this")


def _check_schedule(name: str, value: Any) -> None:
    """A custom schedule (`sigmas`, `timesteps`) sets the steps the call runs: it needs at least
    one, each a finite number (a scheduler given none fails deep inside the pipeline)."""
    if not (name.endswith("sigmas") or name.endswith("timesteps")) or value is None:
        return
    if not isinstance(value, list | tuple):
        return  # a tensor or a scheduler's own type: the pipeline's to judge
    if not value:
        raise ValueError(f"extra.{name}: an empty schedule runs no step; give at least one value")
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise ValueError(f"extra.{name}[{i}]: must be a finite number (got {v!r:.30})")
