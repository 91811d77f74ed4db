"""Step-level joining: a request that arrives while a call runs shares its denoiser from the
next step on, and still gets the image it gets alone.

The engine on the UNet twin (tiny-sd) and a transformer twin (tiny-flux): rows that join at
different steps make their own images, in one batched denoiser call per step. The batch's rules
on a toy denoiser. The replica driven directly (as Serve drives it): a request that arrives
mid-call joins it; abort and failure of one joined request leave the others; requests of
another kind are not passed over.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from serve_app.config import BatchingConfig, ModelConfig
from serve_app.engine import CallParams, DiffusionEngine, Row
from serve_app.engine.joining import StepBatch
from serve_app.errors import Aborted, InvalidRequest
from serve_app.replica import DiffusionReplica
from serve_app.replica.scheduler import Job, Scheduler
from serve_app.schemas import GenerationRequest, PreparedRequest
from tests.conftest import engine_cache
from tests.test_replica import run, stop

ROWS = [Row("a red cat", None, 11), Row("a dog", "blurry", 3), Row("a tree", None, 99)]
STEPS = 5


@pytest.fixture(scope="module")
def engines():
    with engine_cache() as get:
        yield get


def params(e: DiffusionEngine) -> CallParams:
    return CallParams(height=e.default_height, width=e.default_width, steps=STEPS, guidance_scale=4.0)


def pixels(im) -> np.ndarray:
    return np.asarray(im).astype(np.int16)


def close_to(a, b) -> bool:
    """Equal to rounding: a batch of rows rounds a little differently on the CPU (as in
    test_families' batch of two)."""
    d = np.abs(pixels(a) - pixels(b))
    return d.max() <= 2 and d.mean() < 0.05


def run_joined(e: DiffusionEngine, p: CallParams, joins: dict[int, Row], hooks=None):
    """Add each row before the step of its key (0: at the start); step until all have ended."""
    run = e.open_joined(p)
    seats, k = {}, 0
    try:
        while True:
            for i, row in enumerate(joins.values()):
                if list(joins)[i] == k:
                    seats[i] = run.add(row, (hooks or {}).get(i))
            if not run.active and len(seats) == len(joins):
                break
            run.step()
            k += 1
    finally:
        run.close()
    return run, [seats[i] for i in range(len(joins))]


# Rows per denoiser call of one row: the families that run both halves of classifier-free
# guidance in one call; FLUX (guidance distilled) runs one; Wan calls its transformer twice.
CFG_ROWS = {"tiny-sd": 2, "tiny-sdxl": 2, "tiny-sd3": 2, "tiny-flux": 1, "tiny-wan": 1}


@pytest.mark.parametrize("name", list(CFG_ROWS))
def test_rows_that_join_at_different_steps_make_the_images_they_make_alone(engines, name):
    e = engines(name)
    p = dataclasses.replace(params(e), num_frames=e.default_num_frames)
    alone = [e.run([r], p).images[0] for r in ROWS]
    # Row 0 starts; row 1 joins before step 2, row 2 before step 4: 8 steps in all.
    run, seats = run_joined(e, p, {0: ROWS[0], 1: ROWS[1], 3: ROWS[2]})
    for seat, image in zip(seats, alone, strict=True):
        assert seat.error is None
        assert seat.output.steps_run == STEPS and not seat.output.interrupted
        assert close_to(seat.output.images[0], image)
    assert not np.array_equal(pixels(seats[0].output.images[0]), pixels(seats[1].output.images[0]))
    if name == "tiny-wan":  # two calls a step per row (conditional, unconditional), batched too:
        assert run.batch.denoiser_calls < STEPS * len(ROWS)  # alone: 2 * STEPS * len(ROWS)
        return
    # One denoiser call per step for all the rows then running, not one per row and step.
    assert run.batch.denoiser_calls == 3 + STEPS
    assert run.batch.largest == 3 * CFG_ROWS[name]


@pytest.mark.parametrize(("sampler", "batched"), [("Euler", True), ("Euler a", False), ("DPM++ 2M", False)])
def test_seats_step_their_schedulers_together_with_a_per_row_form(engines, monkeypatch, sampler, batched):
    # Euler's step runs once over all seats' rows (`row_steps`); samplers without a per-row form
    # (noise of each row's own generator, a multistep history) step each seat alone. Either
    # way a row makes the image it makes alone.
    from serve_app.engine import row_steps

    calls = []
    real = row_steps.run
    monkeypatch.setattr(row_steps, "run", lambda plans: calls.append(len(plans)) or real(plans))
    e = engines("tiny-sd")
    p = dataclasses.replace(params(e), sampler=sampler)
    alone = [e.run([r], p).images[0] for r in ROWS[:2]]
    _, seats = run_joined(e, p, {0: ROWS[0], 2: ROWS[1]})
    for seat, image in zip(seats, alone, strict=True):
        assert seat.error is None and close_to(seat.output.images[0], image)
    assert calls == ([1, 1] + [2] * (STEPS - 2) + [1, 1] if batched else [])


@pytest.mark.parametrize("name", list(CFG_ROWS))
def test_a_joiner_run_ahead_encodes_nothing_in_its_seat_and_makes_its_image(engines, name, monkeypatch):
    # Every family's call run ahead on another thread reaches its first denoiser call, and
    # its seat then finds its `encode_prompt` result kept.
    e = engines(name)
    p = params(e)
    alone = e.run([ROWS[2]], p).images[0]
    pipe_class = type(e.pipe)
    encode, encoded = pipe_class.encode_prompt, []

    def counted(self, *args, **kwargs):
        encoded.append(threading.current_thread().name)
        return encode(self, *args, **kwargs)

    monkeypatch.setattr(pipe_class, "encode_prompt", counted)
    run = e.open_joined(p)
    try:
        run.add(ROWS[0])
        run.step()
        seen: list[bool] = []
        ahead = threading.Thread(target=lambda: seen.append(run.foresee([ROWS[2]])), name="ahead")
        ahead.start()
        ahead.join()
        seat = run.add(ROWS[2])
        while run.active:
            run.step()
    finally:
        run.close()
    assert seen == [True] and encoded == ["MainThread", "ahead"], encoded
    assert seat.error is None and close_to(seat.output.images[0], alone)


@pytest.mark.parametrize("task", ["img2img", "inpaint"])
def test_edits_join_too(engines, task):
    e = engines("tiny-sd")
    image = Image.new("RGB", (32, 32), (200, 30, 30))
    mask = Image.new("L", (32, 32), 0)
    mask.paste(255, (8, 8, 24, 24))
    p = CallParams(height=32, width=32, steps=6, guidance_scale=5.0, task=task, strength=0.7)
    rows = [dataclasses.replace(r, image=image, mask=mask) for r in ROWS[:2]]
    alone = [e.run([r], p).images[0] for r in rows]
    run, seats = run_joined(e, p, {0: rows[0], 1: rows[1]})
    assert all(close_to(s.output.images[0], a) for s, a in zip(seats, alone, strict=True))
    assert run.batch.denoiser_calls == 5  # 4 steps each (strength 0.7 of 6), one apart


def test_what_cannot_join_runs_in_whole_calls():
    plain = CallParams(height=32, width=32, steps=4, guidance_scale=4.0)
    with engine_cache() as get:
        e = get("tiny-sd")
        assert e.can_join(plain)
        assert not e.can_join(dataclasses.replace(plain, acceleration="fast"))  # a step cache
    # A compiled denoiser and CPU offload (CUDA only: the settings alone, on an engine's place),
    # and a model on several ranks (each call is sent to every rank whole: `model.parallel`).
    for opt, group in (({"compile_denoiser": True}, None), ({"cpu_offload": "model"}, None), ({}, object())):
        cfg = ModelConfig(source="builtin:tiny-sd", optimizations=opt)
        like = SimpleNamespace(cfg=cfg, one_request_calls=lambda p: False, group=group)
        assert not DiffusionEngine.can_join(like, plain) and not DiffusionEngine.can_pause(like, plain)
    assert DiffusionEngine.can_join(
        SimpleNamespace(cfg=cfg, one_request_calls=lambda p: False, group=None), plain
    )


def test_a_row_stopped_by_its_hook_ends_at_once_and_the_others_finish(engines):
    e = engines("tiny-sd")
    p = params(e)
    alone = e.run([ROWS[1]], p).images[0]
    seen = []

    def stop_at_two(i, total, latents):
        seen.append(i)
        return i == 1

    run, (stopped, other) = run_joined(e, p, {0: ROWS[0], 1: ROWS[1]}, hooks={0: stop_at_two})
    assert stopped.error is None and stopped.output.interrupted and stopped.output.images == []
    assert seen == [0, 1]
    assert close_to(other.output.images[0], alone)


def test_a_failed_denoiser_call_fails_its_rows_and_the_engine_goes_on(engines):
    e = engines("tiny-sd")
    p = params(e)
    calls = {"n": 0}

    def fail_third(module, args, kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected denoiser failure")

    handle = e.pipe.unet.register_forward_pre_hook(fail_third, with_kwargs=True)
    try:
        run, seats = run_joined(e, p, {0: ROWS[0], 1: ROWS[1]})
    finally:
        handle.remove()
    assert [str(s.error) for s in seats] == ["injected denoiser failure"] * 2
    assert run.active == 0
    run, (again,) = run_joined(e, p, {0: ROWS[2]})
    assert close_to(again.output.images[0], e.run([ROWS[2]], p).images[0])


def test_a_run_closed_early_ends_its_rows_interrupted(engines):
    e = engines("tiny-sd")
    run = e.open_joined(params(e))
    seats = [run.add(ROWS[0]), run.add(ROWS[1])]
    run.step()
    run.close()
    assert all(s.done and s.output.interrupted and s.output.images == [] for s in seats)


class _Recorder(torch.nn.Module):
    """A toy denoiser: doubles its input and records the batched calls it got."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple] = []

    def forward(self, x, t, scale=1.0):
        self.seen.append((tuple(x.shape), tuple(t.shape), scale))
        return (x * 2 * scale + t.reshape(-1, *[1] * (x.dim() - 1)),)


def test_calls_share_the_denoiser_only_when_they_can():
    net = _Recorder()
    batch = StepBatch(net, lambda: RuntimeError("stopped"))

    def row(shape, t, scale=1.0):
        return lambda d: d(torch.ones(shape), torch.tensor(t), scale=scale)[0]

    seats = [
        batch.add(row((1, 4), 1.0)),
        batch.add(row((2, 4), 5.0)),  # another timestep: per-row timesteps
        batch.add(row((1, 3), 1.0)),  # another shape: a call of its own
        batch.add(row((1, 4), 1.0, scale=0.5)),  # another setting: a call of its own
    ]
    ended = batch.step()
    assert sorted(net.seen) == sorted([((3, 4), (3,), 1.0), ((1, 3), (), 1.0), ((1, 4), (), 0.5)])
    assert len(ended) == 4 and all(s.error is None for s in seats)
    assert torch.equal(seats[0].output, torch.full((1, 4), 3.0))
    assert torch.equal(seats[1].output, torch.full((2, 4), 7.0))
    assert torch.equal(seats[3].output, torch.full((1, 4), 2.0))


def test_seats_take_turns_on_the_driving_thread_each_with_its_own_grad_mode():
    """The seats run in greenlets of the thread that drives the batch (no thread of their own),
    and a seat's grad mode (a pipeline runs under no_grad) neither leaks into the driver nor
    into the next seat: each switch carries it over."""
    net = _Recorder()
    batch = StepBatch(net, lambda: RuntimeError("stopped"))
    seen: list[tuple[str, int, bool]] = []

    def row(name: str, grad: bool):
        def fn(d):
            with torch.set_grad_enabled(grad):
                x = torch.ones(1, 4)
                for _ in range(3):
                    x = d(x, torch.tensor(0.0))[0]
                    seen.append((name, threading.get_ident(), torch.is_grad_enabled()))
                return x

        return fn

    with torch.enable_grad():
        seats = [batch.add(row("off", False)), batch.add(row("on", True))]
        while batch.active:
            batch.step()
            assert torch.is_grad_enabled()  # the driver's own mode after every step
    assert all(s.error is None for s in seats) and torch.equal(seats[0].output, torch.full((1, 4), 8.0))
    assert {(name, grad) for name, _, grad in seen} == {("off", False), ("on", True)}
    assert {ident for _, ident, _ in seen} == {threading.get_ident()}
    assert len(seen) == 6


# ---------------------------------------------------------------------- the replica


@pytest.fixture(scope="module")
def replica():
    model = {"source": "builtin:tiny-sd", "device": "cpu", "default_steps": 8, "warmup": False}
    r = DiffusionReplica(model, {"max_batch_images": 8, "batch_wait_ms": 0, "step_joining": True})
    yield r
    stop(r)


def req(prompt: str, rid: str, seed: int, images: int = 1, steps: int = 8, guidance: float = 7.5):
    return PreparedRequest.from_request(
        GenerationRequest(prompt=prompt, request_id=rid, seed=seed, num_images=images),
        request_id=rid, seed=seed, height=32, width=32, steps=steps, guidance_scale=guidance,
    )  # fmt: skip


async def at_step(r: DiffusionReplica, rid: str, step: int) -> None:
    while (job := r.scheduler.jobs.get(("", rid))) is None or job.step < step:
        await asyncio.sleep(0.002)


def decoded(result) -> list[np.ndarray]:
    return [pixels(Image.open(io.BytesIO(b))) for b in result.images]


def test_a_request_arriving_mid_call_joins_it_and_gets_its_own_images(replica):
    async def go():
        first = asyncio.ensure_future(replica.generate(req("a red cat", "j-a", 1)))
        await at_step(replica, "j-a", 3)
        second = await replica.generate(req("a dog", "j-b", 2, images=2))
        return await first, second

    a, b = run(go())
    assert (b.metrics.batch_requests, b.metrics.batch_images) == (2, 3)
    assert a.metrics.steps == b.metrics.steps == 8
    replica.reconfigure({"step_joining": False})
    try:
        a_alone = run(replica.generate(req("a red cat", "j-a2", 1)))
        b_alone = run(replica.generate(req("a dog", "j-b2", 2, images=2)))
    finally:
        replica.reconfigure({"step_joining": True})
    assert b_alone.metrics.batch_requests == 1
    for got, want in zip(decoded(a) + decoded(b), decoded(a_alone) + decoded(b_alone), strict=True):
        assert np.abs(got - want).max() <= 2
    assert replica.stats().healthy


def test_requests_with_other_steps_and_guidance_join_too(replica):
    # Each request runs its own pipeline call, so only the denoiser's inputs must fit together.
    async def go():
        first = asyncio.ensure_future(replica.generate(req("a red cat", "s-a", 1)))
        await at_step(replica, "s-a", 2)
        short = await replica.generate(req("a dog", "s-b", 2, steps=4, guidance=3.0))
        return await first, short

    a, b = run(go())
    assert b.metrics.batch_requests == 2 and b.metrics.steps == 4 and a.metrics.steps == 8
    replica.reconfigure({"step_joining": False})
    try:
        alone = run(replica.generate(req("a dog", "s-b2", 2, steps=4, guidance=3.0)))
    finally:
        replica.reconfigure({"step_joining": True})
    assert np.abs(decoded(b)[0] - decoded(alone)[0]).max() <= 2


def test_an_adapter_evicted_between_two_steps_still_applies_to_the_whole_call(replica, tmp_path):
    from serve_app.schemas import LoraRef
    from serve_app.tools.lora import make_adapter

    path = make_adapter(str(tmp_path / "style.safetensors"), seed=4, strength=4.0)
    styled = req("a red cat", "l-a", 1).model_copy(
        update={"loras": [LoraRef(name="style", scale=1.0, path=str(path))]}
    )

    async def go():
        task = asyncio.ensure_future(replica.generate(styled))
        await at_step(replica, "l-a", 2)
        assert await replica.evict_lora("style")  # an admin's call, between two steps
        return await task

    joined = run(go())
    replica.reconfigure({"step_joining": False})
    try:
        whole = run(replica.generate(styled.model_copy(update={"request_id": "l-b"})))
        base = run(replica.generate(req("a red cat", "l-c", 1)))
    finally:
        replica.reconfigure({"step_joining": True})
    assert np.abs(decoded(joined)[0] - decoded(whole)[0]).max() <= 2
    assert np.abs(decoded(joined)[0] - decoded(base)[0]).max() > 10  # the adapter did apply


def test_aborting_a_joined_request_leaves_the_other(replica):
    async def go():
        first = asyncio.ensure_future(replica.generate(req("a red cat", "k-a", 1)))
        await at_step(replica, "k-a", 2)
        # Two images with their latents: rows that end apart must not trip the answer's assembly.
        second = asyncio.ensure_future(
            replica.generate(req("a dog", "k-b", 2, images=2).model_copy(update={"return_latents": True}))
        )
        await at_step(replica, "k-b", 2)
        assert replica.abort(["k-b"]) == {"k-b": "aborted"}
        with pytest.raises(Aborted):
            await second
        return await first

    a = run(go())
    assert a.metrics.steps == 8 and len(a.images) == 1
    assert replica.request_status("k-b").state == "aborted"
    stats = replica.stats()
    assert stats.healthy and stats.engine_failures_in_a_row == 0


def test_a_request_the_pipeline_refuses_in_a_joined_run_is_the_callers_error(replica):
    # DDIM takes no custom sigmas: the pipeline raises inside the row's own call. Its `extra`
    # makes it another kind of request: it waits for the running call, then runs joined alone.
    async def go():
        first = asyncio.ensure_future(replica.generate(req("a red cat", "f-a", 1)))
        await at_step(replica, "f-a", 2)
        bad = req("a dog", "f-b", 2).model_copy(update={"extra": {"sigmas": [1.0, 0.5]}})
        with pytest.raises(InvalidRequest) as err:
            await replica.generate(bad)
        return await first, err.value

    a, err = run(go())
    assert err.param == "extra" and "sigmas" in err.message and err.request_id == "f-b"
    assert a.metrics.steps == 8
    stats = replica.stats()
    assert stats.healthy and stats.engine_failures_in_a_row == 0


def test_joiners_never_pass_an_older_request_of_another_kind():
    s = Scheduler(BatchingConfig(max_batch_images=4, step_joining=True))
    loop = asyncio.new_event_loop()

    def job(rid, key, rows=1):
        return Job(rid, [object()] * rows, (key, rid), 4, loop.create_future(), join_key=key)

    for j in (job("a", "k"), job("b", "k", rows=2), job("c", "other"), job("d", "k")):
        s.submit(j)
    taken = s.take_joiners("k", room=2, fits=lambda j: True)
    assert [j.request_id for j in taken] == ["a"]  # "b" does not fit: nothing passes it
    taken = s.take_joiners("k", room=3, fits=lambda j: True)
    assert [j.request_id for j in taken] == ["b"]  # then "c", of another kind, holds "d" back
    assert [j.request_id for j in s.queue] == ["c", "d"]
    assert all(j.state == "running" for j in s.running)
    loop.close()
