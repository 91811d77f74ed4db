"""Rollouts for RL post-training (`serve_app/engine/rollout.py`): stochastic sampling whose every
transition's log-probability is returned. For each sampler (Flow-GRPO's SDE and CPS on the FLUX
twin, DDIM with eta on the SD twin) the returned log-probabilities equal, within 1e-4, what an
independent implementation of the formula computes from the returned trajectory and the
predictions the model handed its scheduler; a group of seeds in one call gives each row what
that seed gives alone; a rollout whose window holds no step is the plain call, exactly."""

from __future__ import annotations

import base64
import json
import math

import numpy as np
import pytest
import torch

from serve_app.config import ModelConfig
from serve_app.engine import CallParams, DiffusionEngine, Row
from serve_app.engine.rollout import RolloutScheduler
from serve_app.engine.types import RolloutSpec

STEPS = 4


@pytest.fixture(scope="module")
def engines():
    made = {m: DiffusionEngine(ModelConfig(source=f"builtin:{m}", device="cpu", warmup=False))
            for m in ("tiny-flux", "tiny-sd")}  # fmt: skip
    yield made
    for e in made.values():
        e.close()


def rollout(e: DiffusionEngine, sampler: str, seeds, noise: float = 0.7, window=None, monkeypatch=None):
    """The call's output and the (prediction, timestep) the scheduler got at each step."""
    spec, (name, _) = e.check_rollout(sampler, noise, window, STEPS)
    seen = []
    if monkeypatch is not None:
        step = RolloutScheduler.step

        def spy(self, model_output, timestep, sample, *a, **kw):
            seen.append((model_output.detach().float().clone(), float(timestep)))
            return step(self, model_output, timestep, sample, *a, **kw)

        monkeypatch.setattr(RolloutScheduler, "step", spy)
    params = CallParams(height=32, width=32, steps=STEPS, guidance_scale=4.0, return_trajectory=True,
                        rollout=spec, sampler=name)  # fmt: skip
    out = e.run([Row("a red circle", None, s) for s in seeds], params)
    return out, seen


def gaussian(x, mean, std) -> torch.Tensor:
    lp = -((x - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    return lp.flatten(1).mean(1)


def flow_reference(sampler: str, x, v, s: float, s_next: float, s_second: float, noise: float):
    """The trainer's side: Flow-GRPO's SDE or CPS transition, from its formulas."""
    if sampler == "sde":
        a = noise * math.sqrt(s / (1 - (s_second if s == 1.0 else s)))
        dt = s_next - s
        return x * (1 + a * a * dt / (2 * s)) + v * (1 + a * a * (1 - s) / (2 * s)) * dt, a * math.sqrt(-dt)
    std = s_next * math.sin(noise * math.pi / 2)
    return (1 - s_next) * (x - s * v) + math.sqrt(s_next**2 - std**2) * (x + (1 - s) * v), std


@pytest.mark.parametrize("sampler", ["sde", "cps"])
def test_flow_log_probs_match_the_formula_from_the_trajectory(engines, sampler, monkeypatch):
    out, seen = rollout(engines["tiny-flux"], sampler, [3, 4], monkeypatch=monkeypatch)
    states = [out.trajectory_start, *out.trajectory_latents]
    sig = [t / 1000 for t in out.trajectory_timesteps] + [0.0]
    want_steps = list(range(STEPS)) if sampler == "sde" else list(range(STEPS - 1))  # cps: last std 0
    assert out.rollout_steps == want_steps and out.trajectory_log_probs.shape == (2, len(want_steps))
    for k, i in enumerate(out.rollout_steps):
        mean, std = flow_reference(sampler, states[i], seen[i][0], sig[i], sig[i + 1], sig[1], 0.7)
        want = gaussian(states[i + 1], mean, std)
        assert torch.allclose(out.trajectory_log_probs[:, k], want, atol=1e-4), (
            i,
            out.trajectory_log_probs[:, k],
            want,
        )
    assert out.trajectory_log_probs.dtype == torch.float32 and torch.isfinite(out.trajectory_log_probs).all()


def test_ddim_log_probs_match_the_formula_from_the_trajectory(engines, monkeypatch):
    e = engines["tiny-sd"]
    out, seen = rollout(e, "ddim", [5, 6], noise=1.0, monkeypatch=monkeypatch)
    states = [out.trajectory_start, *out.trajectory_latents]
    ac = e.pipe.scheduler.alphas_cumprod.double()
    assert out.rollout_steps == list(range(STEPS))
    for k, (eps, t) in enumerate(seen):
        t = int(t)
        prev = t - 1000 // STEPS
        a_t, a_prev = float(ac[t]), float(ac[prev]) if prev >= 0 else float(ac[0])
        x = states[k]
        x0 = (x - math.sqrt(1 - a_t) * eps) / math.sqrt(a_t)
        std = math.sqrt((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev))
        mean = math.sqrt(a_prev) * x0 + math.sqrt(1 - a_prev - std**2) * eps
        want = gaussian(states[k + 1], mean, std)
        assert torch.allclose(out.trajectory_log_probs[:, k], want, atol=1e-4), (
            k,
            out.trajectory_log_probs[:, k],
            want,
        )


def test_a_group_gives_each_seed_what_it_gives_alone(engines):
    e = engines["tiny-flux"]
    group, _ = rollout(e, "sde", [11, 12, 13])
    for row, seed in enumerate([11, 12, 13]):
        alone, _ = rollout(e, "sde", [seed])
        assert torch.allclose(group.trajectory_log_probs[row], alone.trajectory_log_probs[0], atol=1e-4)
        assert torch.allclose(group.trajectory_latents[-1][row], alone.trajectory_latents[-1][0], atol=1e-4)
    others = group.trajectory_log_probs
    assert not torch.allclose(others[0], others[1])  # each row its own noise


def test_a_rollout_without_stochastic_steps_is_the_plain_call(engines):
    for model, sampler in (("tiny-flux", "sde"), ("tiny-sd", "ddim")):
        e = engines[model]
        out, _ = rollout(e, sampler, [7], window=(0, 0))
        plain = e.run(
            [Row("a red circle", None, 7)], CallParams(height=32, width=32, steps=STEPS, guidance_scale=4.0)
        )
        assert out.rollout_steps == [] and out.trajectory_log_probs.shape == (1, 0)
        assert np.array_equal(np.asarray(out.images[0]), np.asarray(plain.images[0])), model
        noisy, _ = rollout(e, sampler, [7], window=(1, 3))
        assert noisy.rollout_steps == [1, 2]
        assert not np.array_equal(np.asarray(noisy.images[0]), np.asarray(plain.images[0])), model


def test_a_schedule_that_is_no_flow_step_is_refused(engines):
    from serve_app.engine import InvalidArguments

    e = engines["tiny-flux"]
    spec, (name, _) = e.check_rollout("sde", 0.7, None, 3)
    params = CallParams(height=32, width=32, steps=3, guidance_scale=4.0, rollout=spec, sampler=name,
                        extra=(("sigmas", [0.5, 0.8, 0.9]),))  # fmt: skip
    with pytest.raises(InvalidArguments, match="rollout: the schedule's sigmas"):
        e.run([Row("a red circle", None, 1)], params)


def test_a_rollout_the_model_cannot_run_is_refused_naming_the_field(engines):
    cases = [
        ("tiny-flux", ("ddim", 0.5, None), "rollout.sampler: .* takes sde or cps, not 'ddim'"),
        ("tiny-sd", ("sde", 0.5, None), "rollout.sampler: .* takes ddim, not 'sde'"),
        ("tiny-sd", ("ddim", 1.5, None), r"rollout.noise_level: 1.5 is not in \[0.01, 1\]"),
        (
            "tiny-flux",
            ("sde", 0.7, (2, 9)),
            r"rollout.window: \[2, 9\] is not \[start, stop\] within \[0, 4\]",
        ),
        ("tiny-flux", ("euler", 0.7, None), "rollout.sampler: 'euler' is not one of sde, cps, ddim"),
    ]
    for model, (sampler, noise, window), message in cases:
        with pytest.raises(ValueError, match=message):
            engines[model].check_rollout(sampler, noise, window, STEPS)
    assert RolloutSpec("sde", 0.7) == engines["tiny-flux"].check_rollout(None, 0.7, None, STEPS)[0]


def test_a_rollout_over_http_returns_a_group_s_log_probs_and_refuses_a_bad_one(client):
    """`rollout` on `POST /v1/images/generations` (tiny-sd: ddim): `n` seeds in one call, the
    trajectory with its start, the stochastic steps and a (n, steps) float32 table; a sampler
    the model cannot run is a 400 naming `rollout.sampler`."""
    from serve_app.schemas import TensorPayload
    from tests.conftest import replica_ids

    before = replica_ids(client)
    body = {"prompt": "a red circle", "seed": 5, "n": 3, "size": "32x32", "num_inference_steps": 3}
    r = client.post("/v1/images/generations", json={**body, "rollout": {"window": [1, 3]}})
    assert r.status_code == 200, r.text
    traj = r.json()["trajectory"]
    table = TensorPayload(**traj["log_probs"]).to_torch()
    assert traj["stochastic_steps"] == [1, 2] and table.shape == (3, 2) and torch.isfinite(table).all()
    assert TensorPayload(**traj["start"]).shape[0] == 3 and len(traj["latents"]) == 3
    assert r.json()["metrics"]["batch_images"] == 3  # the group in one call
    bad = client.post("/v1/images/generations", json={**body, "rollout": {"sampler": "sde"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "rollout.sampler", bad.text
    both = client.post("/v1/images/generations", json={**body, "rollout": {}, "sigma_schedule": "karras"})
    assert both.status_code == 400 and both.json()["error"]["param"] == "sigma_schedule", both.text
    odd = client.post("/v1/images/generations", json={**body, "rollout": {"noise_level": 0}})
    assert odd.status_code in (400, 422) and "rollout" in odd.text, odd.text
    assert replica_ids(client) == before  # the refusals left the replica as it was


@pytest.mark.parametrize("model", ["tiny-flux", "tiny-sd"])
def test_the_decoded_trajectory_is_each_step_decoded_and_ends_in_the_image(engines, model):
    """The original's `trajectory_decoded`: every step's latents decoded as the pipeline decodes
    its last (FLUX's packed latents unpacked and shifted), so the last step is the image."""
    params = CallParams(height=32, width=32, steps=STEPS, guidance_scale=4.0, return_trajectory=True,
                        decode_trajectory=True)  # fmt: skip
    out = engines[model].run([Row("a red circle", None, 1), Row("a blue square", None, 2)], params)
    assert len(out.trajectory_decoded) == STEPS and all(len(step) == 2 for step in out.trajectory_decoded)
    for i in range(2):
        assert np.array_equal(np.asarray(out.trajectory_decoded[-1][i]), np.asarray(out.images[i]))
        assert not np.array_equal(np.asarray(out.trajectory_decoded[0][i]), np.asarray(out.images[i]))
    part = out.slice(1, 2)  # each request gets its own rows of every step
    assert all(len(step) == 1 for step in part.trajectory_decoded)
    assert np.array_equal(np.asarray(part.trajectory_decoded[-1][0]), np.asarray(out.images[1]))


def test_the_decoded_trajectory_over_http_is_png_per_step_and_image(client):
    body = {"prompt": "a red circle", "seed": 5, "n": 2, "size": "32x32", "num_inference_steps": 3,
            "return_trajectory_decoded": True}  # fmt: skip
    r = client.post("/v1/images/generations", json=body)
    assert r.status_code == 200, r.text
    decoded = r.json()["trajectory"]["decoded"]
    assert len(decoded) == 3 and all(len(step) == 2 for step in decoded)
    assert [decoded[-1][i] for i in range(2)] == [d["b64_json"] for d in r.json()["data"]]


def test_handle_callers_get_the_tensors_as_raw_bytes_not_base64(handle):
    """A handle caller's result travels pickled through Ray's object store: its tensors are the
    raw bytes of the tensor (no base64 text), and `to_torch()` gives the tensor back."""
    body = {"prompt": "a red circle", "seed": 5, "num_images": 2, "num_inference_steps": 3, "rollout": {}}
    r = handle.generate.remote(body).result()
    table = r.trajectory.log_probs
    assert isinstance(table.data, bytes) and len(table.data) == 2 * 3 * 4  # float32, as is
    assert table.to_torch().shape == (2, 3) and table.to_torch().dtype == torch.float32
    step = r.trajectory.latents[0]
    assert len(step.data) == step.to_torch().numel() * step.to_torch().element_size()


def test_http_callers_get_the_tensors_as_a_safetensors_or_npz_file_and_as_a_job_s_file(client):
    """`Accept: application/vnd.safetensors` (or `application/x-npz`) answers one file: every
    tensor as itself (no base64 JSON), the images as their bytes, the rest as JSON metadata; a
    job that asked for a rollout keeps the same file (`tensors`, GET /v1/jobs/{id}/tensors)."""
    import io

    import httpx
    from safetensors.numpy import load

    from serve_app.formats.tensor_file import read_metadata
    from serve_app.schemas import TensorPayload
    from tests.test_jobs import finished

    body = {"prompt": "a red circle", "seed": 7, "n": 2, "size": "32x32", "num_inference_steps": 3,
            "rollout": {}, "return_latents": True}  # fmt: skip
    plain = client.post("/v1/images/generations", json=body)
    assert plain.status_code == 200, plain.text
    r = client.post("/v1/images/generations", json=body, headers={"Accept": "application/vnd.safetensors"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/vnd.safetensors", r.text
    assert r.headers["content-disposition"].endswith('.safetensors"')
    tensors, meta = load(r.content), json.loads(read_metadata(r.content)["response"])
    want = plain.json()["trajectory"]
    assert np.array_equal(tensors["trajectory.log_probs"], TensorPayload(**want["log_probs"]).to_numpy())
    assert tensors["trajectory.latents"].shape[:2] == (3, 2) and tensors["trajectory.log_probs"].shape == (
        2,
        3,
    )
    assert np.array_equal(tensors["trajectory.start"], TensorPayload(**want["start"]).to_numpy())
    assert tensors["trajectory.timesteps"].tolist() == want["timesteps"] and "latents" in tensors
    assert [tensors[f"images.{i}"].tobytes() for i in range(2)] == [
        base64.b64decode(d["b64_json"]) for d in plain.json()["data"]
    ]
    assert meta["seeds"] == [7, 8] and "trajectory" not in meta and "images" not in meta, meta
    npz = client.post("/v1/images/generations", json=body, headers={"Accept": "application/x-npz"})
    with np.load(io.BytesIO(npz.content), allow_pickle=False) as f:
        assert np.array_equal(f["trajectory.log_probs"], tensors["trajectory.log_probs"])
        assert json.loads(str(f["response"]))["seeds"] == [7, 8]
    streamed = client.post("/v1/images/generations", json={**body, "stream": True},
                           headers={"Accept": "application/vnd.safetensors"})  # fmt: skip
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "Accept", streamed.text

    job = client.post("/v1/images/generations", json=body, headers={"Prefer": "respond-async"}).json()
    done = finished(client, job["id"])
    assert done["state"] == "done" and done["tensors"]["content_url"].endswith("/tensors"), done
    stored = client.get(done["tensors"]["content_url"])
    assert stored.headers["content-type"] == "application/vnd.safetensors"
    assert np.array_equal(load(stored.content)["trajectory.log_probs"], tensors["trajectory.log_probs"])
    assert httpx.get(done["tensors"]["url"]).content == stored.content  # the signed link, without a key
    as_npz = client.get(done["tensors"]["content_url"], headers={"Accept": "application/x-npz"})
    with np.load(io.BytesIO(as_npz.content), allow_pickle=False) as f:
        assert np.array_equal(f["images.0"], tensors["images.0"])
    other = client.get(done["tensors"]["content_url"], headers={"Authorization": "Bearer other"})
    assert other.status_code == 404  # another caller's key cannot read it
    plain_job = client.post("/v1/images/generations", json={"prompt": "a red circle", "size": "32x32"},
                            headers={"Prefer": "respond-async"}).json()  # fmt: skip
    assert finished(client, plain_job["id"]).get("tensors") is None
    none = client.get(f"/v1/jobs/{plain_job['id']}/tensors")
    assert none.status_code == 404 and none.json()["error"]["param"] == "job_id", none.text
