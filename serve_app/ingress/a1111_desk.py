"""What the AUTOMATIC1111 routes keep per caller: the model it chose (on the job store, so every
ingress replica sharing the store sees it) and its running txt2img/img2img tasks, which
`progress` reports and `interrupt` stops (on the ingress replica that runs them)."""

from __future__ import annotations

import base64
import random
import time
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends

from serve_app.errors import Aborted
from serve_app.ingress.access import servable
from serve_app.jobs import Store
from serve_app.schemas import GenerationResult, PreparedRequest, StepEvent
from serve_app.schemas.a1111 import A1111Progress, A1111ProgressState


def preview_every(steps: int) -> int:
    """Steps between the previews `progress` shows: about ten per image."""
    return max(1, steps // 10)


@dataclass(eq=False)
class Task:
    """One txt2img or img2img call of a caller: its requests (one per iteration) and where it is."""

    caller: str
    request_ids: list[str]
    job: str = "txt2img"
    job_no: int = 0
    step: int = 0
    steps: int = 0
    preview: bytes | None = None
    interrupted: bool = False
    started: float = field(default_factory=time.time)
    timestamp: str = field(default_factory=lambda: time.strftime("%Y%m%d%H%M%S"))


class A1111Desk:
    def __init__(self, store: Store):
        self.store = store
        self._tasks: dict[str, list[Task]] = {}  # by caller, oldest first
        self._rng = random.SystemRandom()

    def random_seed(self) -> int:
        """A seed for `seed: -1`, 32 bits as A1111 draws them (clients keep them in such fields)."""
        return self._rng.randrange(2**32 - 1)

    # ------------------------------------------------------------------ the caller's model

    @staticmethod
    def _setting(caller: str) -> str:
        return f"a1111-model-{caller or 'anonymous'}"

    def chosen(self, caller: str) -> str | None:
        return self.store.get_setting(self._setting(caller))

    def choose(self, caller: str, model: str) -> None:
        self.store.put_setting(self._setting(caller), model)

    # ------------------------------------------------------------------ running, progress, interrupt

    async def run(
        self, core, task: Task, iterations: list[PreparedRequest], every: int
    ) -> list[GenerationResult]:
        """The task's requests one after another, streamed so that `progress` can follow them;
        an interrupt ends it with the results made so far. The caller holds the tenant's place
        for all of them (`Tenants.admit` with `times`)."""
        results: list[GenerationResult] = []
        self._tasks.setdefault(task.caller, []).append(task)
        try:
            for i, request in enumerate(iterations):
                if task.interrupted:
                    break
                task.job_no, task.step, task.steps = i, 0, request.num_inference_steps
                try:
                    async for event in core.stream(request, every, admitted=True):
                        if isinstance(event, StepEvent):
                            task.step, task.steps = event.step, event.total_steps
                            task.preview = event.preview_png or task.preview
                        else:
                            results.append(event)
                except Aborted:
                    if not task.interrupted:  # aborted another way (its id): the caller's 499
                        raise
                    break
        finally:
            mine = self._tasks[task.caller]
            mine.remove(task)
            if not mine:
                del self._tasks[task.caller]
        return results

    async def interrupt(self, core, caller: str) -> None:
        """Stop the caller's running tasks: the request running is aborted (as its owner would
        abort it), and no further iteration starts."""
        from serve_app.ingress.requests import abort

        tasks = self._tasks.get(caller, [])
        for t in tasks:
            t.interrupted = True
        ids = [rid for t in tasks for rid in t.request_ids]
        if ids:
            await abort(core, ids, caller)

    def progress(self, caller: str, skip_image: bool = False) -> A1111Progress:
        """A1111's progress of the caller's oldest running task (nothing running: zeros)."""
        tasks = self._tasks.get(caller)
        if not tasks:
            return A1111Progress()
        t = tasks[0]
        n = len(t.request_ids)
        done = 0.01 + t.job_no / n + (t.step / t.steps / n if t.steps else 0.0)
        elapsed = time.time() - t.started
        state = A1111ProgressState(
            job=f"scripts_{t.job}", job_count=n, job_no=t.job_no, sampling_step=t.step,
            sampling_steps=t.steps, interrupted=t.interrupted, job_timestamp=t.timestamp,
        )  # fmt: skip
        image = base64.b64encode(t.preview).decode("ascii") if t.preview and not skip_image else None
        return A1111Progress(
            progress=min(done, 1.0), eta_relative=max(0.0, elapsed / done - elapsed), state=state,
            current_image=image, current_task=t.request_ids[t.job_no],
        )  # fmt: skip


async def get_desk() -> A1111Desk:
    """Route dependency: the A1111 desk of the ingress this process serves."""
    return servable().a1111


A1111DeskDep = Annotated[A1111Desk, Depends(get_desk)]
