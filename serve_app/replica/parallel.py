"""A replica whose model runs on several ranks (`model.parallel`): the replica is rank 0 and
starts one worker actor per further bundle of its placement group; each worker builds the same
engine, all join one `torch.distributed` group, and every call that runs the pipeline or changes
its weights is sent to the workers before rank 0 runs it (`RankedEngine`).

The workers are the replica's own actors: they end with it, and one that dies makes the replica
unhealthy (`check`), so that Serve replaces the whole group.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from serve_app.config import ModelConfig, ReplicaConfig
from serve_app.engine import parallel
from serve_app.engine.types import ModelLoadError, RankLost

logger = logging.getLogger("ray.serve")

# Engine methods that run the pipeline or change what it holds: every rank runs each of them, in
# the same order (the engine thread of rank 0 sends them in its own order).
MIRRORED = frozenset({"run", "self_test", "warmup", "load_lora", "unload_lora", "load_denoiser_weights"})


def bundles(model: ModelConfig, replica: ReplicaConfig) -> list[dict[str, float]]:
    """The placement group a parallel replica asks Serve for: one bundle per rank, the replica's
    own resources in each (bundle 0 holds the replica itself)."""
    one = {"CPU": max(replica.num_cpus, 0.01)}
    if replica.num_gpus:
        one["GPU"] = replica.num_gpus
    return [dict(one) for _ in range(model.parallel.world)]


@ray.remote(num_cpus=0, concurrency_groups={"health": 1})
class RankWorker:
    """Rank k > 0 of a parallel replica: the same engine, joined to rank 0's group. Its calls run
    one at a time on one thread; `ping` has a thread of its own, so that a health check is
    answered during a long call."""

    def __init__(self, factory, cfg: ModelConfig, rank: int, address: str, port: int, timeout_s: float):
        self.engine = factory(cfg)
        self.engine.split_across(parallel.init_group(rank, cfg.parallel.world, address, port, timeout_s,
                                                     self.engine.device))  # fmt: skip

    def call(self, method: str, args: tuple, kwargs: dict) -> None:
        getattr(self.engine, method)(*args, **kwargs)  # rank 0 answers; this one only takes part

    @ray.method(concurrency_group="health")
    def ping(self) -> dict[str, Any]:
        return _rank_info(self.engine)


def ranked_factory(factory: Callable[[ModelConfig], Any], replica: ReplicaConfig) -> Callable:
    """`factory`, for a model of several ranks: starts the workers, builds rank 0's engine, joins
    the group (on the engine thread, as the replica builds any engine)."""

    def build(cfg: ModelConfig) -> RankedEngine:
        world, timeout = cfg.parallel.world, replica.engine_call_timeout_s or 600.0
        pg = get_current_placement_group()
        if pg is None:
            raise ModelLoadError("model.parallel: this replica was started without its placement group")
        address, port = ray.util.get_node_ip_address(), _free_port()
        bundle = bundles(cfg, replica)[0]
        workers = [
            RankWorker.options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
            ).remote(factory, cfg, rank, address, port, timeout)
            for rank in range(1, world)
        ]
        local = factory(cfg)
        local.split_across(parallel.init_group(0, world, address, port, timeout, local.device))
        engine = RankedEngine(local, workers, timeout)
        engine.ranks = ray.get([w.ping.remote() for w in workers], timeout=timeout)
        logger.info("model %s on %d ranks (workers %s)", cfg.served_name, world, engine.ranks)
        return engine

    return build


class RankedEngine:
    """Rank 0's engine, with every mirrored call sent to the other ranks first; everything else
    is the local engine's."""

    def __init__(self, local, workers: list, timeout_s: float):
        self._local, self._workers, self._timeout = local, workers, timeout_s
        self.ranks: list[dict[str, Any]] = []

    def __getattr__(self, name: str):
        attr = getattr(self._local, name)
        if name not in MIRRORED:
            return attr

        def mirrored(*args, **kwargs):
            # The step hook (rows, params, step_hook) is rank 0's alone: the others hear its answer.
            sent = args[:2] if name == "run" else args
            kwargs_sent = {k: v for k, v in kwargs.items() if k != "step_hook"}
            refs = [w.call.remote(name, sent, kwargs_sent) for w in self._workers]
            try:
                out = attr(*args, **kwargs)
            except BaseException as e:  # the others failed the same way, unless one is lost
                if lost := self._lost(refs, failed=True):
                    raise RankLost(lost) from e
                raise
            if lost := self._lost(refs, failed=False):
                raise RankLost(lost)
            return out

        return mirrored

    def _lost(self, refs: list, failed: bool) -> str | None:
        """Why the workers' part of a call leaves the ranks apart, or None: a worker gone or past
        the timeout; or, where rank 0's part succeeded (`failed` False), any worker's failure."""
        done, pending = ray.wait(refs, num_returns=len(refs), timeout=self._timeout)
        if pending:
            return f"{len(pending)} rank(s) did not finish the call within {self._timeout:g}s"
        for ref in done:
            try:
                ray.get(ref)
            except RayActorError as e:
                return f"a rank's process is gone: {type(e).__name__}"
            except Exception as e:
                if not failed:
                    return f"a rank failed a call rank 0 ran: {type(e).__name__}: {str(e)[:200]}"
        return None

    def rank_status(self) -> list[dict[str, Any]]:
        """Each rank's process, node and split calls (the workers' as of the last `check`)."""
        return [_rank_info(self._local), *self.ranks]

    async def check(self, timeout_s: float) -> str | None:
        """Why the ranks cannot serve (one is gone or does not answer), or None."""
        try:
            pings = asyncio.gather(*(w.ping.remote() for w in self._workers))
            self.ranks = await asyncio.wait_for(pings, timeout_s)
        except Exception as e:  # an actor died, or hangs
            return f"a rank of this replica is lost: {type(e).__name__}"
        return None


def _rank_info(engine) -> dict[str, Any]:
    group = engine.group
    return {"rank": group.rank, "pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(),
            "split_calls": group.split_calls, "tokens": group.tokens}  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
