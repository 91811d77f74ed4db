"""Running pipeline calls: a whole call over a batch of rows, and a seat's own call in a joined
run, where the seats share the denoiser at every step (`joined`, `joining`).

Every row gets its own `torch.Generator`, so an image depends only on its prompt, the
parameters and its seed. A call's timings say where its time went: text encoding (up to the
first denoiser call), denoising (up to the end of the last step) and the VAE decode after.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from serve_app.engine import row_steps
from serve_app.engine.families import Family, image_latents
from serve_app.engine.loading import denoiser_name, find_denoiser
from serve_app.engine.media import encode_image
from serve_app.engine.memory import PeakMemory
from serve_app.engine.rollout import RolloutRecord, RolloutScheduler, noise_seed
from serve_app.engine.safety import withhold_flagged
from serve_app.engine.schedulers import CallingScheduler, Schedulers, seed_noise
from serve_app.engine.step_cache import NoCache, step_cache
from serve_app.engine.text_memo import TextMemo
from serve_app.engine.types import CallParams, EngineOutput, InvalidArguments, Row, StepHook


class _StopCall(Exception):
    """Raised from the step callback to leave the pipeline at once (no VAE decode)."""


# What a pipeline raises for arguments it cannot take; with `extra` set, diffusers passes the
# caller's values deep into the call, so these types are taken as the caller's mistake then too.
_ARGUMENT_ERRORS = (ValueError, TypeError, KeyError, IndexError, AssertionError)

# Puts a call's adapters in force for its rows (`DiffusionEngine._row_adapters`); returns the undo.
AdapterSetUp = Callable[[Sequence[Row], CallParams], Callable[[], None]]


def latents_preview(latents: torch.Tensor) -> bytes:
    """A cheap look at (batch, channels, height, width) latents mid-denoise: the first three
    channels, scaled, as one PNG strip.

    No VAE call: it costs microseconds at the latents' resolution (1/8 of the image's side).
    """
    x = latents.detach().float()[:, :3].cpu()
    if x.shape[1] < 3:
        x = x[:, :1].repeat(1, 3, 1, 1)
    lo, hi = x.amin(dim=(1, 2, 3), keepdim=True), x.amax(dim=(1, 2, 3), keepdim=True)
    x = ((x - lo) / (hi - lo).clamp_min(1e-6) * 255).round().to(torch.uint8)
    strip = torch.cat(list(x), dim=2).permute(1, 2, 0).numpy()  # images side by side
    from PIL import Image

    return encode_image(Image.fromarray(strip), "png")


def host_copy(latents: torch.Tensor) -> torch.Tensor:
    """Latents a caller asked for (`return_latents`, `return_trajectory`), copied off the device."""
    return latents.detach().float().cpu()


def vae_modes(pipe, params: CallParams) -> Callable[[], None]:
    """Turn on the VAE modes this call asks for and the model lacks; returns the undo."""
    vae, undo = getattr(pipe, "vae", None), []
    modes = ((params.vae_slicing, "use_slicing", "enable_slicing", "disable_slicing"),
             (params.vae_tiling, "use_tiling", "enable_tiling", "disable_tiling"))  # fmt: skip
    for flag, attr, on, off in modes:
        if flag and not getattr(vae, attr, False) and hasattr(vae, on):
            getattr(vae, on)()
            undo.append(getattr(vae, off))

    def restore() -> None:
        for fn in undo:
            fn()

    return restore


@dataclass
class _CallState:
    t0: float = 0.0
    total: int = 0  # the steps the call runs, as the pipeline counts them once it has begun
    denoise_start: float | None = None
    denoise_end: float | None = None
    steps_run: int = 0
    last_latents: torch.Tensor | None = None
    trajectory: list[torch.Tensor] = field(default_factory=list)
    decoded: list[list[Any]] = field(default_factory=list)
    timesteps: list[float] = field(default_factory=list)
    rollout: RolloutRecord | None = None


class Runner:
    """The pipeline calls of one engine: `pipe` is the loaded pipeline (its denoiser gets a hook
    that marks when denoising starts; `close` removes it) and `task_pipes` the pipeline of each
    task, all sharing its modules. On the engine thread only (but `row_call` for a joined run's
    `foresee`)."""

    def __init__(
        self,
        pipe,
        task_pipes: dict[str, Any],
        family: Family,
        device: torch.device,
        dtype: torch.dtype,
        default_num_frames: int | None,
        cache_blocks: list[str],
        schedulers: Schedulers | None = None,
    ):
        self.pipe = pipe
        self.schedulers = schedulers  # a scheduler per call's sampler; None: the pipeline's own
        self.safety = None  # the engine's safety checker (`safety`), set once it is loaded
        self.text_memo: TextMemo | None = None  # the open joined run's (`text_memo`)
        self.task_pipes = task_pipes
        self.family = family
        self.device = device
        self.dtype = dtype
        self.video = family.modality == "video"
        self.default_num_frames = default_num_frames
        self.cache_blocks = cache_blocks
        # Every argument each task's call takes, reserved ones included (read once, not per call).
        self.accepts = {
            task: frozenset(inspect.signature(p.__call__).parameters) for task, p in task_pipes.items()
        }
        self.memory = PeakMemory(device)
        self._state: _CallState | None = None
        denoiser = find_denoiser(pipe)
        self._denoiser_attr = denoiser_name(pipe)
        self._hook_handle = denoiser.register_forward_pre_hook(self._on_denoiser_call)

    def whole(
        self,
        rows: Sequence[Row],
        params: CallParams,
        step_hook: StepHook | None,
        adapters: AdapterSetUp,
        inside: bool = False,
    ) -> EngineOutput:
        """One pipeline call over `rows`, with their adapters put in force by `adapters`;
        raises whatever the pipeline raises. `inside`: another call is paused in its step hook
        (preemption), so this one keeps its state on a copy of the pipeline and a scheduler of
        its own, and leaves the paused call's record as it found it."""
        if not rows:
            raise ValueError("run() needs at least one row")
        st = _CallState(t0=time.perf_counter())
        pipe = self._scheduled(self.task_pipes[params.task], params, rows, own=inside)
        if params.rollout is not None:
            pipe = self._with_rollout(pipe, params, rows, st)
        with contextlib.ExitStack() as undo:  # the call's set-up, undone whatever happens
            undo.callback(adapters(rows, params))
            undo.callback(vae_modes(self.pipe, params))
            cache = undo.enter_context(
                step_cache(find_denoiser(pipe), pipe, params.acceleration, params.steps, self.cache_blocks)
            )
            paused, self._state = self._state, st
            self.memory.start()
            try:
                return self.call(rows, params, step_hook, pipe, cache, st)
            finally:
                self._state = paused

    def row_call(
        self, rows: Sequence[Row], params: CallParams, step_hook: StepHook | None, stand_in, memo=None
    ) -> EngineOutput:
        """One seat's own pipeline call in a joined run (rows that joined together, one call),
        with `stand_in` as its denoiser, a scheduler of its own (the pipeline keeps a call's
        state on itself: a shallow copy each) and its text encoders seen through the run's
        `text_memo` (or `memo`)."""
        st = _CallState(t0=time.perf_counter())

        def started() -> None:
            if st.denoise_start is None:
                st.denoise_start = time.perf_counter()

        stand_in.on_call = started
        pipe = _seat_pipe(self.task_pipes[params.task], self._denoiser_attr, stand_in,
                          self._scheduler(params, rows), memo or self.text_memo)  # fmt: skip
        return self.call(rows, params, step_hook, pipe, NoCache(), st)

    def _scheduler(self, params: CallParams, rows: Sequence[Row]):
        """The scheduler of the call's sampler, its noise seeded for `rows`; None: the pipeline's."""
        if self.schedulers is None or params.sampler is None:
            return None
        scheduler = self.schedulers.get(params.sampler, params.sigma_schedule)
        seed_noise(scheduler, rows)
        return scheduler

    def _with_rollout(self, pipe, params: CallParams, rows: Sequence[Row], st: _CallState):
        """A shallow copy of `pipe` whose scheduler steps as the call's rollout asks
        (`rollout`), each row's noise from its own generator; its record goes to `st`."""
        device = params.generator_device or self.device
        generators = [torch.Generator(device).manual_seed(noise_seed(r.seed)) for r in rows]
        scheduler = RolloutScheduler(pipe.scheduler, params.rollout, generators)
        pipe = copy.copy(pipe)
        pipe.__dict__["scheduler"] = scheduler
        st.rollout = scheduler.record
        return pipe

    def _scheduled(self, pipe, params: CallParams, rows: Sequence[Row], own: bool = False):
        """`pipe`, or a shallow copy of it whose scheduler is the call's sampler's; `own`: always
        a copy, with a scheduler no other call steps (a deep copy, seeded for `rows`)."""
        if own:
            sampled = self.schedulers is not None and params.sampler is not None
            shared = self.schedulers.get(params.sampler, params.sigma_schedule) if sampled else pipe.scheduler
            scheduler = copy.deepcopy(shared)
            seed_noise(scheduler, rows)
        else:
            scheduler = self._scheduler(params, rows)
        if scheduler is None:
            return pipe
        pipe = copy.copy(pipe)
        pipe.__dict__["scheduler"] = scheduler
        return pipe

    def call(
        self, rows: Sequence[Row], params: CallParams, step_hook: StepHook | None, pipe, cache, st: _CallState
    ) -> EngineOutput:
        """Call `pipe` over `rows` with `cache` as its step cache, keeping time and steps in `st`."""
        st.total = params.steps
        kwargs = self._inputs(rows, params)
        if self.family.guidance:  # else the pipeline's guider component guides
            kwargs["guidance_scale"] = params.guidance_scale
        gen_device = params.generator_device or self.device
        generators = [torch.Generator(gen_device).manual_seed(r.seed) for r in rows]
        on_step_end = self._step_end(params, step_hook, cache, st)
        if "callback_on_step_end" in self.accepts[params.task]:
            kwargs.update(callback_on_step_end=on_step_end, callback_on_step_end_tensor_inputs=["latents"])
        else:  # a pipeline without step callbacks (HunyuanVideo 1.5): its scheduler calls it
            pipe = copy.copy(pipe)
            pipe.__dict__["scheduler"] = CallingScheduler(pipe.scheduler, pipe, on_step_end)
        try:
            out = pipe(
                **kwargs,
                height=params.height,
                width=params.width,
                num_inference_steps=params.steps,
                generator=generators,
                output_type="pil",
                **dict(params.extra),
            )
            made = getattr(out, self.family.output_attr)
            images = [list(v) for v in made] if self.video else list(made)
        except _StopCall:
            images = []
        except _ARGUMENT_ERRORS as e:
            # Checks of the inputs run before the first denoising step and raise ValueError.
            if (st.denoise_start is None and isinstance(e, ValueError)) or params.extra:
                raise InvalidArguments(f"the pipeline refused the arguments: {type(e).__name__}: {e}") from e
            raise
        out = self._output(images, params, st)
        if self.safety is not None and images:  # every image checked before anyone sees it
            out.images, out.flagged = self.safety.apply(images, params.moderation)
            out.refuse_flagged = self.safety.cfg.action == "refuse"
            withhold_flagged(out)
        return out

    def _step_end(self, params: CallParams, step_hook: StepHook | None, cache, st: _CallState):
        """The pipeline's callback at the end of every step: the step hook, the step cache, the
        trajectory and final latents asked for, and the end of denoising."""

        def on_step_end(pipe, i, t, kwargs):
            # An image-to-image call runs only the last `strength` of the schedule.
            st.total = getattr(pipe, "num_timesteps", None) or st.total
            latents = kwargs["latents"]
            st.steps_run = i + 1
            cache.step_done()
            if params.return_trajectory:
                st.trajectory.append(host_copy(latents))
                st.timesteps.append(float(t))
            if params.decode_trajectory:
                st.decoded.append(self._decoded(latents, params))
            last = i + 1 == st.total
            if step_hook is not None and step_hook(i, st.total, lambda: self._viewable(latents, params)):
                raise _StopCall
            if last:
                if params.return_latents:
                    st.last_latents = host_copy(latents)
                self._sync()
                st.denoise_end = time.perf_counter()
            return {}

        return on_step_end

    def _inputs(self, rows: Sequence[Row], params: CallParams) -> dict[str, Any]:
        """The call's arguments that depend on its rows and task, not the shared size and steps."""
        fam = self.family
        accepts = self.accepts[params.task]
        rows, count = _one_prompt(self.pipe, fam, params, rows)
        kwargs = _with_masks(self._text_inputs(rows), accepts)
        if params.task != "generate":
            kwargs.update(self._image_inputs(rows, params, accepts))
        if "max_area" in accepts:  # Kontext scales sizes to it
            kwargs["max_area"] = params.height * params.width
        if fam.count_arg:
            kwargs[fam.count_arg] = count
        if self.video:
            kwargs["num_frames"] = params.num_frames or self.default_num_frames
        return kwargs

    def _text_inputs(self, rows: Sequence[Row]) -> dict[str, Any]:
        """The call's text arguments: prompts, or precomputed embeddings (every row or none)."""
        if rows[0].prompt_embeds is None:
            negatives = [r.negative_prompt for r in rows]
            if not self.family.negative:  # the ingress refuses one for such a model
                return {"prompt": [r.prompt for r in rows]}
            return {
                "prompt": [r.prompt for r in rows],
                "negative_prompt": None
                if all(n is None for n in negatives)
                else [n or "" for n in negatives],
            }
        cast = {"device": self.device, "dtype": self.dtype}
        out = {}
        for name in (
            "prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds", "negative_pooled_prompt_embeds"
        ):  # fmt: skip
            parts = [getattr(r, name) for r in rows]
            if all(p is not None for p in parts):
                out[name] = torch.cat(parts).to(**cast)
        return out

    def _image_inputs(
        self, rows: Sequence[Row], params: CallParams, accepts: frozenset[str]
    ) -> dict[str, Any]:
        kind, first = self.family.image_input, rows[0]
        images = {
            "rows": [r.image for r in rows],
            "one": first.image,
            "references": [first.image, *first.references],
        }
        out: dict[str, Any] = {"image": images[kind]}
        if params.task == "inpaint":
            out["mask_image"] = [r.mask for r in rows]
        if params.strength is not None and "strength" in accepts:
            out["strength"] = params.strength
        if "_auto_resize" in accepts:  # Kontext would resize inputs to ~1 MP; the sizes are ours
            out["_auto_resize"] = False
        return out

    def _output(self, images: list[Any], params: CallParams, st: _CallState) -> EngineOutput:
        """The call's output, timed from `st`; the call has just returned."""
        end = time.perf_counter()
        start = st.denoise_start or st.t0
        denoise_end = st.denoise_end or end
        timings = {
            "text_encode_ms": (start - st.t0) * 1e3,
            "denoise_ms": (denoise_end - start) * 1e3,
            "vae_decode_ms": (end - denoise_end) * 1e3,
            "pipeline_ms": (end - st.t0) * 1e3,
        }
        return EngineOutput(
            images=list(images),
            timings_ms=timings,
            peak_memory_mb=self.memory.stop(),
            memory_kind=self.memory.kind,
            latents=st.last_latents,
            trajectory_latents=st.trajectory if params.return_trajectory else None,
            trajectory_timesteps=st.timesteps if params.return_trajectory else None,
            trajectory_decoded=st.decoded if params.decode_trajectory else None,
            trajectory_start=st.rollout.start if st.rollout else None,
            rollout_steps=list(st.rollout.steps) if st.rollout else None,
            trajectory_log_probs=st.rollout.table() if st.rollout else None,
            steps_run=st.steps_run,
            interrupted=st.steps_run < st.total,
        )

    def _viewable(self, latents: torch.Tensor, params: CallParams) -> torch.Tensor:
        return image_latents(self.pipe, self.family, latents, params.height, params.width)

    def _decoded(self, latents: torch.Tensor, params: CallParams) -> list[Any]:
        """A step's latents decoded as the pipeline decodes its last (an image model's VAE:
        unscaled, shifted, decoded, post-processed): one PIL image per row."""
        vae = self.pipe.vae
        z = self._viewable(latents, params).to(vae.dtype) / vae.config.scaling_factor
        shift = getattr(vae.config, "shift_factor", None)
        with torch.no_grad():
            pixels = vae.decode(z + shift if shift is not None else z, return_dict=False)[0]
        return self.pipe.image_processor.postprocess(pixels, output_type="pil")

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _on_denoiser_call(self, module, args) -> None:
        st = self._state
        if st is not None and st.denoise_start is None:
            self._sync()
            st.denoise_start = time.perf_counter()

    def close(self) -> None:
        """Remove the hook on the denoiser."""
        self._hook_handle.remove()


def _seat_pipe(task_pipe, denoiser_attr: str, stand_in, scheduler, memo: TextMemo | None):
    """A shallow copy of `task_pipe` for a seat: `stand_in` as its denoiser, its own copy of
    `scheduler` (None: the pipeline's) and its text encoders seen through `memo`."""
    pipe = copy.copy(task_pipe)
    pipe.__dict__[denoiser_attr] = stand_in
    scheduler = scheduler or pipe.scheduler
    # The schedulers with a per-row form rebind what they change, never change it in place:
    # a shallow copy is their own (a deep copy cost 0.85 ms a seat on tiny-sd).
    own = copy.copy if row_steps.joinable(scheduler) else copy.deepcopy
    pipe.__dict__["scheduler"] = own(scheduler)
    if memo is not None:
        memo.wrap_encoders(pipe)
    stand_in.fit(pipe)
    return pipe


def _with_masks(kwargs: dict[str, Any], accepts: frozenset[str]) -> dict[str, Any]:
    """A caller's embeddings with the attention masks a pipeline wants beside them (LTX-Video's):
    every token of them counts."""
    for name, mask in (("prompt_embeds", "prompt_attention_mask"),
                       ("negative_prompt_embeds", "negative_prompt_attention_mask")):  # fmt: skip
        if name in kwargs and mask in accepts:
            kwargs[mask] = torch.ones(kwargs[name].shape[:2], dtype=torch.long, device=kwargs[name].device)
    return kwargs


def _one_prompt(pipe, family: Family, params: CallParams, rows: Sequence[Row]) -> tuple[Sequence[Row], int]:
    """The rows a call passes its pipeline, and how many outputs it asks of each: all rows, one
    each; or, for an edit of a model whose call takes one prompt's images (`image_input`), the
    first row and every row's output from it."""
    if params.task == "generate" or family.image_input == "rows":
        return rows, 1
    if len({(r.prompt, r.negative_prompt) for r in rows}) > 1:
        raise InvalidArguments(f"{type(pipe).__name__} edits one prompt's images a call")
    return rows[:1], len(rows)
