"""Preemption at a step boundary: a request of a higher priority that has waited past
`batching.preempt_after_ms` behind a running whole call runs inside that call's step hook, on
the engine thread, while the call is paused between two steps; then the call goes on.

The paused call loses nothing: its latents, generators and scheduler live on in its own pipeline
call, which is only waiting for its hook to return, and the engine runs the other call on a copy
of the pipeline with a scheduler of its own and puts the paused call's adapters back after it
(`Engine.run_paused`). So a paused call makes the same images as one never paused, and nothing
is computed twice. One level only: the call that runs inside is not paused itself.

The event loop decides (the scheduler is its own); the engine thread runs. A job handed over
after the call's last step runs next, as a call of its own.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from serve_app import metrics
from serve_app.replica.intake import work
from serve_app.replica.results import step_hook
from serve_app.replica.scheduler import Job

if TYPE_CHECKING:
    from serve_app.replica.loop import EngineLoop

_POLL_S = (0.005, 0.05)  # how often the queue is looked at while a call runs: at most, at least


class Pause:
    """A running whole call's chance to be paused: `watch` (on the event loop) hands the jobs
    that preempt it over; `hook` (the call's step hook, on the engine thread) runs them at the
    call's next step boundary."""

    def __init__(self, owner: EngineLoop, batch: list[Job], wait_s: float, loop: asyncio.AbstractEventLoop):
        self._owner, self._batch, self._wait_s, self._loop = owner, batch, wait_s, loop
        self._engine = work(batch[0]).engine or owner.engine
        self._rows = [r for j in batch for r in j.rows]
        self._adapters = {name for j in batch for name in j.adapters}
        self._handed: list[Job] = []
        self._lock = threading.Lock()

    @staticmethod
    def for_call(owner: EngineLoop, batch: list[Job], loop: asyncio.AbstractEventLoop) -> Pause | None:
        """A `Pause` for a whole call of `batch`, or None where it may not pause: preemption is
        off, the engine cannot pause its calls, or its rows have different adapters (row hooks
        on the shared denoiser that the other call would run through)."""
        after = owner.batching.preempt_after_ms
        rows = [r for j in batch for r in j.rows]
        engine = work(batch[0]).engine or owner.engine
        if after is None or not engine.can_pause(work(batch[0]).params):
            return None
        if any(r.adapters != rows[0].adapters for r in rows):
            return None
        return Pause(owner, batch, after / 1e3, loop)

    def _may_run(self, job: Job) -> bool:
        """Whether `job` may run inside the paused call: on its engine, a call that may pause,
        and adapters that fit the replica beside the paused call's and the pinned ones (else it
        would be refused for want of room that waiting gives it)."""
        same = (work(job).engine or self._owner.engine) is self._engine
        held = self._adapters | set(job.adapters) | set(self._owner.adapters.pinned)
        fits = not job.adapters or len(held) <= self._owner.adapters.max_loaded
        return same and fits and self._engine.can_pause(work(job).params)

    async def watch(self) -> None:
        """On the event loop, until cancelled (the call ended): hand over the jobs that preempt
        the call, one batch at a time."""
        scheduler = self._owner.scheduler
        poll = min(max(self._wait_s / 10, _POLL_S[0]), _POLL_S[1])
        while True:
            await asyncio.sleep(poll)
            with self._lock:
                if self._handed:
                    continue
            jobs = scheduler.preempting(self._wait_s, self._may_run)
            if jobs:
                metrics.count_preemption(self._engine.model_name)
                with self._lock:
                    self._handed = jobs

    def left(self) -> list[Job]:
        """After the call: the jobs handed over that it ended before running (they run next)."""
        with self._lock:
            jobs, self._handed = self._handed, []
        return jobs

    def hook(self, inner: Callable[[int, int, object], bool]) -> Callable[[int, int, object], bool]:
        """The call's step hook `inner`, and between two steps the jobs handed over."""

        def paused(i: int, total: int, latents) -> bool:
            stop = inner(i, total, latents)
            if not stop and i + 1 < total:
                jobs = self.left()
                if jobs:
                    self._run(jobs)
            return stop

        return paused

    def _run(self, jobs: list[Job]) -> None:
        """On the engine thread, the call paused: run `jobs` and answer them on the event loop."""
        owner, loop = self._owner, self._loop
        rows = [r for j in jobs for r in j.rows]
        owner.health.call_started = time.monotonic()
        try:
            out = owner.run_call(jobs, rows, step_hook(jobs, loop), paused=self._batch)
        except Exception as e:  # its own requests' failure; the paused call goes on
            err = owner.health.classify(e, jobs[0].request_id, len(rows), work(jobs[0]).params, len(jobs))
            loop.call_soon_threadsafe(self._settle, jobs, None, err)
        else:
            loop.call_soon_threadsafe(self._settle, jobs, out, None)
        finally:
            owner.health.call_started = time.monotonic()
            # The paused call's adapters, whatever was loaded, evicted or put in force meanwhile;
            # if that fails, the paused call fails (it raises inside its step hook).
            self._engine.restore_adapters(self._rows, work(self._batch[0]).params)

    def _settle(self, jobs: list[Job], out, err) -> None:
        scheduler = self._owner.scheduler
        for job in jobs:
            scheduler.left(job)
        if err is not None:
            for job in jobs:
                if job.state == "running":
                    scheduler.fail(job, err)
            return
        self._owner.health.consecutive_failures = 0
        self._owner.deliver(jobs, out)


# ---------------------------------------------------------------------- joined runs


def between_steps(owner: EngineLoop, joined, can_join: Callable[[Job], bool]) -> int:
    """Preemption in a joined run, on the event loop between two steps (with the run's lock
    held): unpark the parked seats there is room for again (oldest first), unless the queue's
    head is of a higher priority and could join: it keeps the room; then, if that head has
    waited `preempt_after_ms` and finds no room, park seats whose requests are all of a lower
    priority, lowest first, until it fits. A parked seat leaves the steps where it stands (its
    pipeline call waits at its denoiser call) and its rows leave `joined.admitted`; unparked, it
    goes on where it stopped. Returns the room left for joiners.

    The head must be able to join the run (`can_join`: its kind and adapters) and fit its
    tenant's share; a request of another kind is not helped by parking and waits for the run to
    drain (it stops taking joiners once such a request is first in the queue)."""
    scheduler, limit = owner.scheduler, owner.batching.max_batch_images
    room = limit - joined.admitted.total()
    head = scheduler.queue[0] if scheduler.queue else None
    share = scheduler.share(head.tenant) if head is not None else 0
    if head is not None and not (can_join(head) and len(head.rows) <= min(share, limit)):
        head = None
    priorities = _seat_priorities(joined)
    for seat, rows in list(joined.parked.items()):
        if rows.total() > room or (head is not None and head.priority > priorities.get(seat, 0)):
            break
        del joined.parked[seat]
        joined.admitted.update(rows)
        room -= rows.total()
    after = owner.batching.preempt_after_ms
    if head is None or after is None or len(head.rows) <= room:
        return room
    if time.perf_counter() - head.enqueued < after / 1e3:
        return room
    lower = sorted(
        (p, i, seat) for i, (seat, p) in enumerate(priorities.items())
        if p < head.priority and seat not in joined.parked and not seat.done
    )  # fmt: skip
    chosen, freed = [], collections.Counter()
    held = joined.admitted[head.tenant] + len(head.rows)  # the head's tenant's rows with it in
    for _, _, seat in lower:
        if room + freed.total() >= len(head.rows) and held - freed[head.tenant] <= share:
            break
        rows = collections.Counter()
        for m in joined.members.values():
            if m.seat is seat:
                rows[m.job.tenant] += len(m.job.rows)
        chosen.append((seat, rows))
        freed.update(rows)
    if room + freed.total() < len(head.rows) or held - freed[head.tenant] > share:
        return room
    for seat, rows in chosen:
        joined.parked[seat] = rows
        joined.admitted.subtract(rows)
    scheduler.preemptions += 1
    metrics.count_preemption(owner.engine.model_name)
    return room + freed.total()


def _seat_priorities(joined) -> dict:
    """Each seat of the run's requests: the highest priority among them."""
    out: dict = {}
    for m in joined.members.values():
        out[m.seat] = max(out.get(m.seat, 0), m.job.priority)
    return out
