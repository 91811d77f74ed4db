"""What the replica needs of an engine. `DiffusionEngine` is the real one (diffusers);
`serve_app.testing.FakeEngine` stands in for it where a test is about the replica, not the model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from serve_app.engine.types import CallParams, EngineOutput, Row, StepHook

if TYPE_CHECKING:
    from serve_app.engine.joined import JoinedRun


class Engine(Protocol):
    model_name: str
    default_height: int
    default_width: int

    def run(self, rows: Sequence[Row], params: CallParams, step_hook: StepHook | None = None) -> EngineOutput:
        """One pipeline call over `rows` that share `params`; raises what the pipeline raises."""

    def can_pause(self, params: CallParams) -> bool:
        """Whether calls with `params` may pause at a step boundary for another call, or be it."""

    def run_paused(
        self, rows: Sequence[Row], params: CallParams, step_hook: StepHook | None = None
    ) -> EngineOutput:
        """One call run from inside the step hook of a paused call (`run`), which then resumes
        unchanged once `restore_adapters` has put its adapters back."""

    def restore_adapters(self, rows: Sequence[Row], params: CallParams) -> None:
        """Put the adapters of a paused whole call over `rows` back in force."""

    def can_join(self, params: CallParams) -> bool:
        """Whether calls with `params` can run joined (`open_joined`); else they run whole."""

    def one_request_calls(self, params: CallParams) -> bool:
        """Whether a call with `params` holds one request's rows only (an edit of a model whose
        call takes one prompt's images: Qwen-Image-Edit's references, Wan's first frame)."""

    def open_joined(self, params: CallParams, adapters: tuple[tuple[str, float], ...] = ()) -> JoinedRun:
        """Start a joined call: rows added between denoising steps, each its own pipeline call
        (`JoinedRun.add`), all sharing the denoiser at every step (`JoinedRun.step`)."""

    def check_extra(self, extra: dict[str, Any], task: str = "generate") -> dict[str, Any]:
        """`extra` as the pipeline will take it, or ValueError naming the argument."""

    def check_embeds(self, embeds: Any, pooled: Any = None, which: str = "") -> None:
        """ValueError, starting with the field's name, unless the pipeline takes these embeddings."""

    def takes(self, argument: str, task: str = "generate") -> bool:
        """Whether the task's pipeline call has this argument."""

    def check_options(
        self, generator_device: str | None, vae_slicing: bool, vae_tiling: bool, acceleration: str = "none"
    ) -> None:
        """ValueError, starting with the field's name, for per-call options it cannot honour."""

    def check_sampler(self, sampler: str | None, sigma_schedule: str | None) -> tuple[str | None, str | None]:
        """The canonical (sampler, sigma schedule), (None, None) for the model's own scheduler;
        ValueError, starting with the field's name, for one this model does not offer."""

    def check_rollout(self, sampler: str | None, noise_level: float | None, window, steps: int) -> tuple:
        """A request's rollout as the engine runs it and the (sampler, schedule) its call takes;
        ValueError, starting with the field's name, for one this model cannot run."""

    def read_lora(self, path: str) -> dict[str, Any]:
        """An adapter's checked weights, read without touching the pipeline (any thread), or
        LoraError saying why not."""

    def load_lora(self, name: str, path: str, state: dict[str, Any] | None = None) -> None:
        """Install an adapter under `name` (from `state`, else read from `path`), or raise
        LoraError saying why not."""

    def unload_lora(self, name: str) -> None: ...

    def load_denoiser_weights(self, weights: dict[str, Any], version: int) -> int:
        """Copy a trainer's denoiser weights in place (ValueError naming a misfit); the calls
        that start after it carry `weights_version`."""

    def self_test(self) -> None:
        """A short known-good call; raises if the engine cannot run even that."""

    def describe(self) -> dict[str, Any]:
        """Model, source, pipeline, default size and steps, and `rpc_methods`."""
