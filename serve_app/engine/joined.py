"""A joined run as the engine hands it out (`DiffusionEngine.open_joined`): seats added between
two steps, stepped together (`joining.StepBatch`), and prompts encoded ahead.

A request that joins a run sets its seat up between two steps, while the device waits: its
pipeline call runs up to its first denoiser call, and most of that is encoding its prompts.
`JoinedRun.foresee` runs that part earlier, on another thread while the device runs the step
in flight (`device_call`), into the run's text memo (`text_memo`); the seat's own call then
finds its encodings there. Its own call still does the rest (its latents, its schedule), so
an image is the same either way.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from serve_app.engine.joining import Seat, StepBatch
from serve_app.engine.runs import _StopCall
from serve_app.engine.text_memo import TextMemo, bare_encoders
from serve_app.engine.types import CallParams, EngineOutput, Row, StepHook


class JoinedRun:
    """Calls that share one `CallParams` run joined (`joining.StepBatch`): a row is added
    between two steps and is its own pipeline call, with its own step hook; `step` runs one
    denoising step of every row and returns the rows that ended. On the engine thread only,
    but for `foresee` and `device_call`.

    `row_call(row, params, step_hook, stand_in)` runs a row's call with `stand_in` as its
    denoiser (the engine's `_row_call`), `apply_adapters(adapters)` puts the run's adapters in
    force, and `restore` undoes the run's set-up when it closes."""

    def __init__(
        self,
        params: CallParams,
        adapters: tuple,
        denoiser: torch.nn.Module,
        row_call: Callable[..., EngineOutput],
        apply_adapters: Callable[[tuple], None],
        restore: Callable[[], None],
        foresee_call: Callable[..., EngineOutput] | None = None,
        memo: TextMemo | None = None,
    ):
        self.params = params
        self.adapters = adapters
        self._row_call = row_call
        self._apply_adapters = apply_adapters
        self._restore = restore
        # `foresee`'s call (`Runner.row_call`: not the extensions' hook, it runs on another
        # thread) into `memo`, the run's text memo.
        self._foresee_call = foresee_call
        self._memo = memo
        self.batch = StepBatch(denoiser, _StopCall)
        self._tokenizers: dict[int, tuple[Any, Any]] = {}  # id: a tokenizer and `foresee`'s copy

    @property
    def active(self) -> int:
        return self.batch.active

    @property
    def stepping(self) -> int:
        """Rows a step runs: the active ones less those of parked seats."""
        return self.batch.stepping

    def park(self, seats) -> None:
        """Leave exactly `seats` out of the next steps (their calls wait where they stand)."""
        for seat in self.batch.seats:
            seat.parked = seat in seats

    def add(
        self, rows: Row | Sequence[Row], step_hook: StepHook | None = None, params: CallParams | None = None
    ) -> Seat:
        """Start `rows` (one row, or rows that join together) as one pipeline call; its `Seat`
        holds its `EngineOutput` (or error) once it has ended. Its own `params` may differ from
        the run's in what one call decides alone (steps, guidance, strength, sampler, the
        outputs asked for); the rest must be the run's. Rows that join at one step in one seat
        cost one call's host work a step instead of one per row."""
        params = params or self.params
        rows = [rows] if isinstance(rows, Row) else list(rows)
        self._apply_adapters(self.adapters)
        return self.batch.add(lambda stand_in: self._row_call(rows, params, step_hook, stand_in), len(rows))

    @property
    def device_call(self) -> threading.Event:
        """Set while the batched denoiser call of a step runs (the engine thread waits on the
        device): the time to `foresee` in."""
        return self.batch.calling

    def foresee(self, rows: Sequence[Row], params: CallParams | None = None) -> bool:
        """From another thread, while the run steps: run `rows`' pipeline call up to its first
        denoiser call, so that their prompts' encodings are in the run's text memo when they
        join (`add`) and their seat's set-up, between two steps, skips them. Nothing else it
        does is kept: its own scheduler (the pipeline's, whatever the sampler: the encodings do
        not depend on it), no step hook, and it stops at the first use of the image decoder
        too (an edit's image encoding). It tokenizes with copies of the pipeline's tokenizers
        (a fast tokenizer keeps its padding settings on itself: the engine thread's calls would
        see them change). False if the call failed before (the seat's own call will fail the
        same way and say why), and for calls with `extra` (a caller's arguments may change what
        the encoders share, as a LoRA scale does), which are not run ahead."""
        params = dataclasses.replace(params or self.params, sampler=None, sigma_schedule=None)
        if params.extra or self._foresee_call is None:
            return False
        try:
            stand_in = _Foresight(self.batch.denoiser, self._tokenizers)
            self._foresee_call(list(rows), params, None, stand_in, memo=self._memo)
        except _Foreseen:
            return True
        except Exception:  # noqa: BLE001 - told by the seat's own call, on the engine thread
            return False
        return False

    def step(self) -> list[Seat]:
        self._apply_adapters(self.adapters)  # in case something between steps changed them
        return self.batch.step()

    def close(self) -> None:
        """Stop the rows still running (they end interrupted) and undo the run's set-up."""
        try:
            self.batch.close()
        finally:
            if self._memo is not None:
                self._memo.close()
            self._restore()


class _Foreseen(Exception):
    """Ends a call run ahead (`JoinedRun.foresee`) where its seat's set-up would end."""


class _NoUse:
    """A module a call run ahead may read (its config, dtype), but any use of it (calling it or
    one of its methods: SDXL's casting its VAE to float32, FLUX's cache context) ends the call:
    it might change what the engine thread shares."""

    def __init__(self, module: torch.nn.Module):
        self._module = module

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        if callable(value):
            raise _Foreseen
        return value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise _Foreseen


class _Foresight(_NoUse):
    """The denoiser a call run ahead sees; `copies` holds the tokenizers' copies it uses, made
    once a run."""

    def __init__(self, module: torch.nn.Module, copies: dict[int, tuple[Any, Any]]):
        super().__init__(module)
        self._copies = copies
        self.on_call: Callable[[], None] | None = None

    def join_steps(self, scheduler) -> None:
        """Its scheduler is never stepped."""

    def fit(self, pipe) -> None:
        """Have `pipe` (the call's own shallow copy) stop at the image decoder too, and
        tokenize with tokenizers of its own, its encoder calls not keyed (`bare_encoders`)."""
        from transformers import PreTrainedTokenizerBase, ProcessorMixin  # not at the app's build

        vae = getattr(pipe, "vae", None)
        if isinstance(vae, torch.nn.Module):
            pipe.__dict__["vae"] = _NoUse(vae)
        for name, value in list(vars(pipe).items()):
            if isinstance(value, PreTrainedTokenizerBase | ProcessorMixin):
                if id(value) not in self._copies:
                    self._copies[id(value)] = (value, copy.deepcopy(value))
                pipe.__dict__[name] = self._copies[id(value)][1]
        bare_encoders(pipe)
