"""Encoding joiners' prompts ahead, while the step in flight is on the device.

A request handed over to join a running call sets its seat up on the engine thread between two
steps, while the device waits; most of that set-up is encoding its prompts. So once requests
are handed over (`batching.encode_ahead`), a thread of its own waits for the engine thread to
be in a step's denoiser call and, while it is, runs the pipeline call of each group of them
that will share a seat (`intake.cohorts`, as the engine thread will group them) up to its first
denoiser call (`JoinedRun.foresee`): their encodings are in the run's text memo when the seat
is set up. Whatever goes wrong there is left to the seat's own call, which says why.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

from serve_app.replica.intake import cohorts, work

logger = logging.getLogger(__name__)


class Foresight:
    """One thread that runs joiners' calls ahead (it ends once the replica's loop, and so its
    executor, is gone). `wait_s`: how long it waits for a device call to run beside."""

    def __init__(self, wait_s: float = 1.0):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="foresee")
        self._wait_s = wait_s
        self.seen = 0  # cohorts run ahead to their first denoiser call

    def ahead(self, joined) -> None:
        """Run ahead the cohorts in `joined`'s inbox (a replica's `_Joined`: what it has handed
        over to its run, not yet taken by the engine thread) not run ahead yet."""
        self._pool.submit(self._drain, joined).add_done_callback(_told)

    def _drain(self, joined) -> None:
        calling = joined.run.device_call
        if joined.closed or not calling.wait(self._wait_s):
            return
        while calling.is_set():  # the engine thread takes the inbox once the call is done
            with joined.lock:
                if joined.closed:
                    return
                inbox = list(joined.inbox)
            groups = {tuple(map(id, c)): c for c in cohorts(inbox)}
            joined.foreseen &= set(groups)  # the cohorts taken since are the engine thread's
            todo = [c for g, c in groups.items() if g not in joined.foreseen]
            if not todo:
                return
            joined.foreseen.add(tuple(map(id, todo[0])))
            rows = [r for job in todo[0] for r in job.rows]
            self.seen += joined.run.foresee(rows, work(todo[0][0]).params)


def _told(done: Future) -> None:
    if (e := done.exception()) is not None:  # a fault of ours: the seats encode for themselves
        logger.warning("encoding ahead failed: %s: %s", type(e).__name__, e)
