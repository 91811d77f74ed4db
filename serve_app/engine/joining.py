"""Step-level joining: rows that start at different times share the denoiser at every step.

Each seat (the rows that joined at one step) runs its own, unchanged pipeline call (its own
scheduler, timesteps, generators, text encoding and decode) in a greenlet of its own. What the
seat's pipeline takes for its denoiser is a stand-in: a call to it hands the inputs over and
switches back to the batch. Once every seat is waiting, the batch runs the real denoiser once
over the seats' inputs put together (rows at different timesteps included: timesteps become
per-row) and gives each seat its part of the output. A seat whose scheduler has a per-row
form (`row_steps`: DDIM, Euler, flow matching's Euler) hands its scheduler step over the same way,
and the batch runs it once over every such seat's rows. A new seat joins between two steps: its
greenlet runs up to its first denoiser call and is in the next batched call. A seat leaves as
soon as its own last step and decode are done.

The seats and the batch take turns on the one thread that drives the run, so torch never runs
on two threads at once and the seats' steps stay in a fixed order. A thread per seat was the
first design: handing a step over and back, with the batch's merging, cost 0.07-0.08 ms a
seat-step in process; switching greenlets, 0.03-0.04 ms (resuming threads all at once was
2.3x slower still: they queue on the GIL). Torch's grad mode is thread state that the seats'
pipelines set: each switch carries it over. Nothing here knows a pipeline family: any
denoiser whose output for a row depends only on that row's inputs can be joined this way.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import greenlet
import torch

from serve_app.engine import row_steps

# Arguments that hold no row dimension whatever their first size (FLUX's position ids).
_UNBATCHED = frozenset({"img_ids", "txt_ids"})


class Seat:
    """One pipeline call in the batch (a row, or the rows of requests that joined together):
    its greenlet, its pending denoiser call, and how it ended."""

    def __init__(
        self, fn: Callable[[StandIn], Any], stop: Callable[[], BaseException], denoiser, rows: int = 1
    ):
        self.rows = rows  # the rows its call runs (rows that joined together share a seat)
        self._fn = fn
        self._stop = stop
        self._denoiser = denoiser
        self.call: tuple[tuple, dict] | None = None  # the denoiser call it waits on
        self.scheduler_step: row_steps.RowStep | None = None  # or the scheduler step
        self._answer: tuple[Any, BaseException | None] | None = None
        self.done = False
        # Parked: left out of the steps (its call waits at its denoiser call, its state kept)
        # until unparked, when it goes on where it stopped (preemption of a joined run).
        self.parked = False
        self.output: Any = None
        self.error: BaseException | None = None
        self._grad = torch.is_grad_enabled()  # the seat's grad mode while the batch runs
        self._glet = greenlet.greenlet(self._main)

    def _main(self) -> None:
        try:
            self.output = self._fn(StandIn(self._denoiser, self))
        except BaseException as e:  # handed to whoever reads the seat
            self.error = e
        finally:
            self.done = True

    def resume(self) -> None:
        """From the batch: run the seat until its next denoiser call or its end."""
        batch_grad = torch.is_grad_enabled()
        torch.set_grad_enabled(self._grad)
        try:
            self._glet.switch()
        finally:
            self._grad = torch.is_grad_enabled()
            torch.set_grad_enabled(batch_grad)

    def denoise(self, args: tuple, kwargs: dict) -> Any:
        """In the seat's greenlet: wait for the batched call and return this seat's part."""
        self.call = (args, kwargs)
        return self._wait()

    def step_scheduler(self, planned: row_steps.RowStep) -> Any:
        """In the seat's greenlet: wait for the batched scheduler step; this seat's result."""
        self.scheduler_step = planned
        return self._wait()

    def _wait(self) -> Any:
        self._glet.parent.switch()
        answer, error = self._answer or (None, self._stop())
        self._answer = None
        if error is not None:
            raise error
        return answer

    def answer(self, value: Any = None, error: BaseException | None = None) -> None:
        self.call = self.scheduler_step = None
        self._answer = (value, error)


class StandIn:
    """What a row's pipeline sees as its denoiser: the real module's attributes, but a call
    goes to the batch. `on_call` (set by the engine) runs in the seat at each call."""

    def __init__(self, module: torch.nn.Module, seat: Seat):
        self._module = module
        self._seat = seat
        self.on_call: Callable[[], None] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.on_call is not None:
            self.on_call()
        return self._seat.denoise(args, kwargs)

    def join_steps(self, scheduler) -> None:
        """Have `scheduler` (the seat's own) step in the batch, when it has a per-row form
        (`row_steps`); a call without one steps alone as before."""
        if not row_steps.joinable(scheduler):
            return
        own, seat = scheduler.step, self._seat

        def step(*args: Any, **kwargs: Any) -> Any:
            planned = row_steps.plan(scheduler, args, kwargs)
            return own(*args, **kwargs) if planned is None else seat.step_scheduler(planned)

        scheduler.step = step

    def fit(self, pipe) -> None:
        """Fit `pipe` (the seat's own shallow copy of the pipeline) to the batch."""
        self.join_steps(pipe.scheduler)


class StepBatch:
    """The rows of one joined run. Driven from one thread (the seats' greenlets belong to it):
    `add` rows, `step` until `active` is 0, `close`. `stop` makes the error a row's pipeline
    gets when it is closed early."""

    def __init__(self, denoiser: torch.nn.Module, stop: Callable[[], BaseException]):
        self.denoiser = denoiser
        self._stop = stop
        self.seats: list[Seat] = []
        self.denoiser_calls = 0  # batched calls run
        self.largest = 0  # the most rows in one batched call
        self.calling = threading.Event()  # set while a batched denoiser call runs

    @property
    def active(self) -> int:
        """Rows of the seats still running (parked ones included)."""
        return sum(s.rows for s in self.seats if not s.done)

    @property
    def stepping(self) -> int:
        """Rows of the seats still running that are not parked: those a step runs."""
        return sum(s.rows for s in self.seats if not s.done and not s.parked)

    def add(self, fn: Callable[[StandIn], Any], rows: int = 1) -> Seat:
        """Start a seat of `rows` rows: `fn(stand_in)` runs its pipeline with `stand_in` as the
        denoiser. Returns once the seat waits for its first denoiser call (or has ended)."""
        seat = Seat(fn, self._stop, self.denoiser, rows)
        self.seats.append(seat)
        seat.resume()
        return seat

    def step(self) -> list[Seat]:
        """One denoising step for every waiting row; returns the rows that ended (their last
        step and decode done, or failed) since the last step, and forgets them."""
        waiting = [s for s in self.seats if s.call is not None and not s.parked]
        for group in _groups(waiting):
            self._run(group)
        for seat in waiting:
            seat.resume()
        while stepping := [s for s in self.seats if s.scheduler_step is not None and not s.parked]:
            self._run_scheduler_steps(stepping)
            for seat in stepping:
                seat.resume()
        ended = [s for s in self.seats if s.done]
        self.seats = [s for s in self.seats if not s.done]
        return ended

    def _run(self, group: list[Seat]) -> None:
        calls = [s.call for s in group]
        sizes = [_rows(*c) for c in calls]
        try:
            self.calling.set()
            with torch.no_grad():
                if len(group) == 1:  # alone: exactly the call the pipeline made
                    parts = [self.denoiser(*calls[0][0], **calls[0][1])]
                else:
                    args = tuple(_merge([c[0][i] for c in calls], sizes) for i in range(len(calls[0][0])))
                    kwargs = {k: _merge([c[1][k] for c in calls], sizes, k) for k in calls[0][1]}
                    parts = _split(self.denoiser(*args, **kwargs), sizes)
        except Exception as e:  # every row of the call gets the error inside its own pipeline
            for seat in group:
                seat.answer(error=e)
            return
        finally:
            self.calling.clear()
        self.denoiser_calls += 1
        self.largest = max(self.largest, sum(sizes))
        for seat, part in zip(group, parts, strict=True):
            seat.answer(part)

    def _run_scheduler_steps(self, seats: list[Seat]) -> None:
        groups: dict[tuple, list[Seat]] = {}
        for seat in seats:
            groups.setdefault(seat.scheduler_step.key, []).append(seat)
        for group in groups.values():
            try:
                answers = row_steps.run([s.scheduler_step for s in group])
            except Exception as e:  # every row gets the error inside its own pipeline
                for seat in group:
                    seat.answer(error=e)
                continue
            for seat, value in zip(group, answers, strict=True):
                seat.answer(value)

    def close(self) -> None:
        """End every row still running (its pipeline gets the stop error) and wait for them."""
        for seat in self.seats:
            while not seat.done:
                if seat.call is not None or seat.scheduler_step is not None:
                    seat.answer(error=self._stop())
                seat.resume()
        self.seats = []


# ---------------------------------------------------------------------- putting calls together


def _rows(args: tuple, kwargs: dict) -> int:
    """A denoiser call's rows: the first size of its first tensor that has one (the latents)."""
    named = [v for k, v in kwargs.items() if k not in _UNBATCHED]
    for v in (*args, *named):
        if isinstance(v, torch.Tensor) and v.dim() >= 1:
            return v.shape[0]
    return 1


def _has_rows(t: torch.Tensor, n: int, name: str) -> bool:
    """Whether tensor argument `name` of a call of `n` rows holds one entry per row."""
    return t.dim() >= 1 and t.shape[0] == n and name not in _UNBATCHED


def _layout(value: Any, n: int, name: str = "") -> Any:
    """What must match for two calls to be batched: shapes past the row dimension, dtypes,
    devices, and every value that is not a tensor."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return ("scalar", value.dtype, value.device)
        if _has_rows(value, n, name):
            return ("rows", tuple(value.shape[1:]), value.dtype, value.device)
        return ("same", tuple(value.shape), value.dtype, value.device)
    if isinstance(value, dict):
        return ("dict", tuple((k, _layout(v, n, k)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        if not all(isinstance(v, torch.Tensor | dict | list | tuple) or v is None for v in value):
            # Python values in a list may be one per row (QwenImage's `img_shapes`): a call
            # with such a list runs alone rather than with the wrong list.
            return ("object", id(value))
        return ("seq", type(value), tuple(_layout(v, n, name) for v in value))
    try:
        hash(value)
    except TypeError:
        return ("object", id(value))
    return ("value", type(value), value)


def _same_fixed(a: Any, b: Any, n_a: int, n_b: int, name: str = "") -> bool:
    """Whether the tensors without a row dimension are equal in two calls of one layout."""
    if isinstance(a, torch.Tensor):
        return a.dim() == 0 or _has_rows(a, n_a, name) or torch.equal(a, b)
    if isinstance(a, dict):
        return all(_same_fixed(a[k], b[k], n_a, n_b, k) for k in a)
    if isinstance(a, list | tuple):
        return all(_same_fixed(x, y, n_a, n_b, name) for x, y in zip(a, b, strict=True))
    return True


def _groups(seats: Sequence[Seat]) -> list[list[Seat]]:
    """Waiting rows in groups whose calls can run as one: same layout, same fixed tensors."""
    groups: list[tuple[Any, int, list[Seat]]] = []  # layout, rows of the first call, seats
    for seat in seats:
        args, kwargs = seat.call
        n = _rows(args, kwargs)
        layout = (tuple(_layout(a, n) for a in args), _layout(kwargs, n))
        for key, m, members in groups:
            if key == layout and _same_fixed(members[0].call, seat.call, m, n):
                members.append(seat)
                break
        else:
            groups.append((layout, n, [seat]))
    return [members for _, _, members in groups]


def _merge(values: list[Any], sizes: list[int], name: str = "") -> Any:
    first = values[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            if all(torch.equal(v, first) for v in values[1:]):
                return first
            return torch.cat([v.reshape(1).expand(n) for v, n in zip(values, sizes, strict=True)])
        if _has_rows(first, sizes[0], name):
            return torch.cat(values)
        return first
    if isinstance(first, dict):
        return {k: _merge([v[k] for v in values], sizes, k) for k in first}
    if isinstance(first, list | tuple):
        merged = [_merge([v[i] for v in values], sizes, name) for i in range(len(first))]
        return type(first)(merged)
    return first


def _split(out: Any, sizes: list[int]) -> list[Any]:
    """A batched call's output as each row's part; an output it cannot split raises rather than
    hand every row the whole batch."""
    total = sum(sizes)
    if isinstance(out, torch.Tensor):
        if out.dim() >= 1 and out.shape[0] == total:
            return list(out.split(sizes))
        raise ValueError(f"joined denoiser call: an output of shape {tuple(out.shape)} for {total} rows")
    if dataclasses.is_dataclass(out):  # diffusers' outputs (a dataclass and a dict at once)
        fields = {f.name: _split(getattr(out, f.name), sizes) for f in dataclasses.fields(out)}
        return [type(out)(**{k: v[i] for k, v in fields.items()}) for i in range(len(sizes))]
    if isinstance(out, dict):
        parts = {k: _split(v, sizes) for k, v in out.items()}
        return [type(out)((k, v[i]) for k, v in parts.items()) for i in range(len(sizes))]
    if isinstance(out, tuple | list):
        parts = [_split(o, sizes) for o in out]
        return [type(out)(p[i] for p in parts) for i in range(len(sizes))]
    return [out] * len(sizes)  # None and other values that hold no rows
