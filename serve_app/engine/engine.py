"""The diffusion engine: one diffusers pipeline, one batch of rows per call. No Ray in here.

A call takes rows (prompt, negative prompt, seed: one image each) that share one set of call
parameters. Every row gets its own `torch.Generator`, so an image depends only on its prompt,
the parameters and its seed, never on what else shared the call. The replica decides which
requests share a call; the engine only runs it and says where the time went.

`DiffusionEngine` composes the parts, each in a module of its own: `loading` (the pipeline and
those derived from it), `checks` (a call's arguments before it runs), `adapters` (LoRA files
in and out of the pipeline) and `runs` (whole and joined calls); `types` holds what goes in and
out. The names they define that callers use are importable from here too.
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image

from serve_app.config import ModelConfig
from serve_app.engine import dora, parallel
from serve_app.engine.adapters import (
    InForce,
    install_adapter,
    loaded_adapters,
    read_adapter,
    remove_adapter,
    row_adapter_sets,
    row_hooks,
)
from serve_app.engine.checks import MAX_EMBED_TOKENS, RESERVED_EXTRA_KEYS, CallChecks
from serve_app.engine.description import describe_engine
from serve_app.engine.families import Family, describe_pipeline
from serve_app.engine.fast import FastPath
from serve_app.engine.joined import JoinedRun
from serve_app.engine.loading import (
    apply_optimizations,
    copy_weights,
    denoiser_name,
    derived_pipelines,
    find_denoiser,
    load_pipeline,
    model_tasks,
    native_size,
    offered_accelerations,
    pin_execution_device,
    prepare_pipeline,
    quantize_denoiser,
    resolve_device,
    resolve_dtype,
    scheduler_class,
)
from serve_app.engine.media import encode_image
from serve_app.engine.rollout import check_rollout
from serve_app.engine.runs import Runner, latents_preview, vae_modes
from serve_app.engine.safety import SafetyChecker
from serve_app.engine.schedulers import Schedulers
from serve_app.engine.step_cache import cached_blocks
from serve_app.engine.text_memo import TextMemo
from serve_app.engine.types import (
    TASKS,
    CallParams,
    EngineOutput,
    InvalidArguments,
    LoraError,
    ModelLoadError,
    Row,
    StepHook,
    exported,
    is_fatal_device_error,
    rpc_methods,
)

__all__ = [
    "MAX_EMBED_TOKENS",
    "RESERVED_EXTRA_KEYS",
    "TASKS",
    "CallParams",
    "DiffusionEngine",
    "EngineOutput",
    "InvalidArguments",
    "JoinedRun",
    "LoraError",
    "ModelLoadError",
    "Row",
    "StepHook",
    "apply_optimizations",
    "denoiser_name",
    "encode_image",
    "engine_class",
    "exported",
    "find_denoiser",
    "is_fatal_device_error",
    "latents_preview",
    "load_pipeline",
    "quantize_denoiser",
    "resolve_device",
    "resolve_dtype",
    "rpc_methods",
    "scheduler_class",
]

logger = logging.getLogger(__name__)


def engine_class(extension: str | None) -> type[DiffusionEngine]:
    """`DiffusionEngine`, or a subclass with the `module:Class` mixin in front of it."""
    if not extension:
        return DiffusionEngine
    module, _, name = extension.partition(":")
    try:
        mixin = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"model.engine_extension: cannot import {extension!r}: {e}") from None
    return type(f"{name}Engine", (mixin, DiffusionEngine), {})


class DiffusionEngine:
    """Owns one pipeline on one device. Not thread-safe: one thread calls it (but `JoinedRun.foresee`).

    Its checks are a `checks.CallChecks` and its calls a `runs.Runner`; what an extension may
    override (`run`, `_row_call`, `warmup`, `self_test`, exported methods) stays here."""

    def __init__(self, cfg: ModelConfig, reuse: dict[str, Any] | None = None):
        """Load `cfg`'s pipeline; `reuse` holds components of another engine to share instead of
        loading them again (`loading.load_pipeline`; what `components()` offers)."""
        self.cfg = cfg
        self.device = resolve_device(cfg)
        self.dtype = resolve_dtype(cfg, self.device)
        if self.device.type == "cpu":
            torch.set_num_threads(cfg.cpu_threads or os.cpu_count() or 1)
        t = time.perf_counter()
        self.pipe = prepare_pipeline(cfg, self.device, self.dtype, reuse)
        self.load_s = time.perf_counter() - t
        self._task_pipes = derived_pipelines(self.pipe)
        if cfg.optimizations.cpu_offload == "none":
            pin_execution_device({id(p): p for p in self._task_pipes.values()}.values())
        denoiser = find_denoiser(self.pipe)
        self.family: Family = describe_pipeline(self.pipe, denoiser)
        self.default_height, self.default_width = native_size(self.pipe, cfg)
        video = self.family.modality == "video"
        self.default_num_frames = (cfg.default_num_frames or self.family.default_frames) if video else None
        self._in_force = InForce(self.pipe)  # the adapters of whole calls
        self.group: parallel.Group | None = None  # the ranks of a parallel replica (`split_across`)
        self.weights_version: int | None = None  # a trainer's weights pushed in; None: as loaded
        self.weights_epoch = 0  # moves as adapters come and go (`_layers_changed`)
        cache_blocks = cached_blocks(denoiser)
        self.accelerations = offered_accelerations(denoiser, cache_blocks, cfg.optimizations)
        self._checks = CallChecks(self.pipe, self._task_pipes, self.family, self.device, self.accelerations)
        self.schedulers = Schedulers(self.pipe.scheduler, self._task_pipes, cfg.served_name)
        self._runner = Runner(
            self.pipe, self._task_pipes, self.family, self.device, self.dtype,
            self.default_num_frames, cache_blocks, self.schedulers,
        )  # fmt: skip
        if cfg.safety is not None:
            self._runner.safety = SafetyChecker(cfg.safety, self.device)
        self.fast: FastPath | None = None  # `speed: max`: the compiled modules (`fast`)
        if cfg.optimizations.speed == "max":
            self.fast = FastPath(self.pipe, denoiser, self.device, self.dtype, cfg)
        logger.info(
            "loaded %s on %s/%s in %.1fs (native %dx%d)",
            cfg.source, self.device, self.dtype, self.load_s, self.default_width, self.default_height,
        )  # fmt: skip
        if cfg.warmup:
            self.warmup()

    # ------------------------------------------------------------------ description

    @property
    def model_name(self) -> str:
        return self.cfg.served_name

    @property
    def video(self) -> bool:
        return self.family.modality == "video"

    @property
    def tasks(self) -> list[str]:
        return model_tasks(self._task_pipes)

    def components(self) -> dict[str, torch.nn.Module]:
        """The loaded modules another engine may share (`DiffusionEngine(cfg, reuse=...)`): the
        pipeline's torch modules but its denoiser, which carries this engine's own state
        (adapters, step-cache hooks, quantization, compilation); none under CPU offload, whose
        hooks move modules per pipeline."""
        if self.pipe is None or self.cfg.optimizations.cpu_offload != "none":
            return {}
        denoiser = denoiser_name(self.pipe)
        return {
            name: module
            for name, module in self.pipe.components.items()
            if isinstance(module, torch.nn.Module) and name != denoiser
        }

    @exported
    def describe(self) -> dict[str, Any]:
        return describe_engine(self)

    # ------------------------------------------------------------------ checks (see `checks`)

    def check_task(self, task: str) -> None:
        """ValueError unless this model does `task`."""
        self._checks.check_task(task)

    def check_extra(self, extra: dict[str, Any], task: str = "generate") -> dict[str, Any]:
        """`extra` checked against the signature of the task's pipeline call: names it does not
        take are refused, and each value must fit the argument's annotated type. Returns the
        values as the pipeline will get them ("0.3" -> 0.3)."""
        return self._checks.check_extra(extra, task)

    def check_embeds(self, embeds: torch.Tensor, pooled: torch.Tensor | None = None, which: str = "") -> None:
        """Refuse embeddings this pipeline cannot take, naming the shapes it wants (and the pooled
        vector, for the families that need one). `which` is "" or "negative_"."""
        self._checks.check_embeds(embeds, pooled, which)

    def takes(self, argument: str, task: str = "generate") -> bool:
        """Whether the task's pipeline call has this argument."""
        return self._checks.takes(argument, task)

    def check_options(
        self, generator_device: str | None, vae_slicing: bool, vae_tiling: bool, acceleration: str = "none"
    ) -> None:
        """Refuse per-call options this engine cannot honour; the message starts with the field."""
        self._checks.check_options(generator_device, vae_slicing, vae_tiling, acceleration)

    def check_sampler(self, sampler: str | None, sigma_schedule: str | None) -> tuple[str | None, str | None]:
        """The canonical (sampler, sigma schedule) of a request, (None, None) for the model's own
        scheduler; ValueError, starting with the field's name, listing what this model offers."""
        return self.schedulers.check(sampler, sigma_schedule)

    def check_rollout(self, sampler: str | None, noise_level: float | None, window, steps: int):
        """A request's rollout (`rollout`) as the engine runs it, and the (sampler, schedule) its
        call takes; ValueError, starting with the field's name."""
        return check_rollout(self.schedulers, sampler, noise_level, window, steps)

    # ------------------------------------------------------------------ LoRA adapters (see `adapters`)

    @exported
    def loaded_loras(self) -> list[str]:
        return loaded_adapters(self.pipe)

    def read_lora(self, path: str) -> dict[str, torch.Tensor]:
        """Read and check an adapter's weights without touching the pipeline: safe on any
        thread. LoraError if unusable."""
        return read_adapter(self.pipe, path)

    def load_lora(self, name: str, path: str, state: dict[str, torch.Tensor] | None = None) -> None:
        """Install adapter `name` into the pipeline from `state` (what `read_lora(path)` gave;
        read here when absent), or raise LoraError. On the engine thread."""
        if state is None:
            state = self.read_lora(path)
        if self.cfg.optimizations.cpu_offload != "none" and dora.split(state)[1]:
            raise LoraError(f"{path}: a DoRA adapter is not loaded with model.optimizations.cpu_offload")
        self._in_force.forget()  # set the adapters again on the next call
        install_adapter(self.pipe, name, path, state)
        self._layers_changed(name)

    def load_denoiser_weights(self, weights: dict[str, torch.Tensor], version: int) -> int:
        """Replace the denoiser's weights named in `weights` (a trainer's, all of them or some),
        in place, and call them `version`: the results of the calls that start from now on say
        so (`weights_version`). On the engine thread, between calls. ValueError naming a misfit."""
        copied = copy_weights(find_denoiser(self.pipe), weights)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.weights_version = version
        return copied

    def unload_lora(self, name: str) -> None:
        self._in_force.forget()
        remove_adapter(self.pipe, name)
        self._layers_changed(name)

    def _layers_changed(self, adapter: str) -> None:
        """After an adapter came or went, the fast path compiles its warmed shapes again (its LoRA
        layers are in the graphs) and text encodings kept for joined seats (`text_memo`) go."""
        self.weights_epoch += 1
        if self.fast is not None:
            self.fast.forget_adapter(adapter)
            self.fast.stale = bool(self.fast.warmed_shapes)  # warmed again at a call's start

    def _apply_lora(self, loras: tuple[tuple[str, float], ...]) -> None:
        """Make exactly these adapters active at their scales (none, or every scale 0: the base
        model, bit for bit; on the fast path, every scale of the others 0)."""
        before = self._in_force.active
        self._in_force.set(loras)
        if self.fast is not None and not self._in_force.hooked and self._in_force.active != before:
            self.fast.hold_adapters(self._in_force.active)  # PEFT's set changed the layers

    def _row_adapters(self, rows: Sequence[Row], params: CallParams):
        """Put each row's adapters in force; returns the undo.

        Rows with one adapter set (the call's `params.loras`, or the same `Row.adapters`) get it
        the usual way. Rows with different sets or scales share the call: the base layers of the
        denoiser and the text encoders run once for the whole batch and each row adds its own
        low-rank deltas (`row_lora`)."""
        sets = row_adapter_sets(rows, params)
        if all(s == sets[0] for s in sets):
            self._apply_lora(sets[0])
            undo, hooked = (lambda: None), self._in_force.hooked
        else:
            self._in_force.forget()  # the row hooks (text encoders' too) replace it for this call
            undo, hooked = row_hooks(self.pipe, sets), True
        # Hooks in the denoiser's graph: on the fast path the call runs uncompiled.
        return undo if self.fast is None or not hooked else self.fast.eager_until(undo)

    # ------------------------------------------------------------------ running (see `runs`)

    def self_test(self) -> None:
        """One short known-good call; raises if the engine cannot run even that."""
        self._short_call(self.default_width, self.default_height, 1)

    def warmup(self) -> None:
        """One short call before traffic; on the fast path, one for every shape it compiles (the
        compile cache read first and written after, `model.optimizations.compile_cache`)."""
        t = time.perf_counter()
        if self.fast is None:
            self._short_call(self.default_width, self.default_height, 1)
        else:
            self.fast.warm(self._short_call, self.cfg, (self.default_width, self.default_height))
        logger.info("warm-up took %.2fs", time.perf_counter() - t)

    def _short_call(self, width: int, height: int, batch: int) -> None:
        task = self.tasks[0]  # "generate"; "edit" for a model that starts from an image
        params = CallParams(
            height=height,
            width=width,
            steps=self.cfg.warmup_steps,
            guidance_scale=self.cfg.default_guidance_scale,
            task=task,
        )
        image = None if task == "generate" else Image.new("RGB", (params.width, params.height), "gray")
        self.run([Row("warm-up", None, i, image=image) for i in range(batch)], params)

    def run(self, rows: Sequence[Row], params: CallParams, step_hook: StepHook | None = None) -> EngineOutput:
        """Run one pipeline call over `rows`; raises whatever the pipeline raises. Among ranks
        (`split_across`) every rank runs it, and stops at the step rank 0's hook stops at."""
        if self.group is not None:
            self.group.begin(len(rows))
            step_hook = parallel.agreeing(self.group, step_hook)
        if self.fast is None:
            return self._runner.whole(rows, params, step_hook, self._row_adapters)
        self.fast.warm_again(self.warmup)
        with self.fast.eager(params.acceleration != "none"):  # a step cache's hooks: uncompiled
            return self._runner.whole(rows, params, step_hook, self._row_adapters)

    def split_across(self, group: parallel.Group) -> None:
        """From now on share each call among the ranks of `group` as `model.parallel` says: the
        guidance's branches (`cfg`) or the tokens (`ulysses`, `ring`); see `parallel`."""
        par = self.cfg.parallel
        try:
            parallel.share(find_denoiser(self.pipe), group, par.cfg, par.ulysses, par.ring)
        except ValueError as e:
            raise ModelLoadError(str(e)) from None
        self.group = group

    def can_pause(self, params: CallParams) -> bool:
        """Whether a call with `params` may be paused at a step boundary for another call, or be
        that other call (`run_paused`): not with a step cache (its hooks on the denoiser follow
        one call's steps and would see the other's), a compiled denoiser or CPU offload."""
        opt = self.cfg.optimizations
        alone = self.group is None  # ranks run the same calls in the same order
        return (
            alone and params.acceleration == "none" and not opt.compile_denoiser and opt.cpu_offload == "none"
        )

    def run_paused(
        self, rows: Sequence[Row], params: CallParams, step_hook: StepHook | None = None
    ) -> EngineOutput:
        """Run one call while another call of this engine is paused in its step hook (preemption).
        The paused call's latents, generators and scheduler stay its own: this one runs on a
        copy of the pipeline with a scheduler of its own. Its caller puts the paused call's
        adapters back in force after it (`restore_adapters`), whatever happened meanwhile."""
        return self._runner.whole(rows, params, step_hook, self._row_adapters, inside=True)

    def restore_adapters(self, rows: Sequence[Row], params: CallParams) -> None:
        """Put the adapter set of a paused whole call over `rows` (one set for all its rows) back
        in force, after a call ran inside it or adapters were loaded or evicted for that call."""
        self._in_force.forget()
        self._apply_lora(row_adapter_sets(rows, params)[0])

    def can_join(self, params: CallParams) -> bool:
        """Whether calls with `params` can run joined (`open_joined`): not with a step cache
        (its state follows one call's steps), a compiled denoiser (every new batch size would
        compile again) or CPU offload (its hooks move the whole denoiser per call)."""
        opt = self.cfg.optimizations
        plain = params.acceleration == "none" and params.rollout is None  # a rollout's record is per call
        alone = self.one_request_calls(params)  # its rows share one prompt's images: not a joined seat's
        ranks = self.group is not None  # a joined run's seats are calls of their own, not mirrored
        return plain and not alone and not ranks and not opt.compile_denoiser and opt.cpu_offload == "none"

    def one_request_calls(self, params: CallParams) -> bool:
        return params.task != "generate" and self.family.image_input != "rows"

    def open_joined(self, params: CallParams, adapters: tuple[tuple[str, float], ...] = ()) -> JoinedRun:
        """Start a joined run of calls with `params` whose rows all have `adapters` (or none);
        rows are added and stepped by the returned `JoinedRun` (see `joining`)."""
        adapters = adapters or params.loras
        if self.fast is not None:
            self.fast.warm_again(self.warmup)
        self._apply_lora(adapters)
        restore = vae_modes(self.pipe, params)
        if self.fast is not None and self._in_force.hooked:  # a DoRA set: its hooks, uncompiled
            restore = self.fast.eager_until(restore)
        self._runner.memory.start()
        memo = self._runner.text_memo = TextMemo(lambda: self.weights_epoch)  # the run's seats' encodings
        return JoinedRun(params, adapters, find_denoiser(self._task_pipes[params.task]), self._row_call,
                         self._apply_lora, restore, self._runner.row_call, memo)  # fmt: skip

    def _row_call(self, rows: Sequence[Row], params: CallParams, step_hook: StepHook | None, stand_in):
        """One seat's own pipeline call in a joined run, with `stand_in` as its denoiser."""
        return self._runner.row_call(rows, params, step_hook, stand_in)

    def close(self) -> None:
        self._runner.close()
        self.pipe = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
