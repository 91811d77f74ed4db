"""A sampler per request: AUTOMATIC1111's names (and the diffusers classes) as schedulers built
from the pipeline's own scheduler config, with Karras, exponential and beta sigma schedules.

The engine on the SD twin (every sampler it offers runs; the same seed and sampler make the
same image, alone, in a batch and joined; other samplers other images), what each family is
offered (flow-matching models their own; a zero-terminal-SNR model only the samplers that keep
it), the names a request may use, the batch keys, a joined call of several samplers in the
replica, and the shared app over HTTP, the handle, the CLI and the playground. Every other
twin runs each of its samplers on each of its tasks in the slow layer.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses

import numpy as np
import pytest
from PIL import Image

from serve_app.engine import CallParams, Row
from serve_app.engine.schedulers import Schedulers
from serve_app.errors import InvalidRequest
from serve_app.ingress.checks import check_sampler
from serve_app.replica import DiffusionReplica
from serve_app.replica.intake import new_job
from serve_app.schemas import GenerationRequest, ModelDescription, PreparedRequest
from serve_app.testing import FakeEngine
from tests.conftest import engine_cache, replica_held, wait_for
from tests.test_replica import run, stop

ROWS = [Row("a red cat", None, 11), Row("a dog", "blurry", 3)]
SD_SAMPLERS = ["Euler", "Euler a", "Heun", "LMS", "DPM2", "DPM2 a", "DPM++ 2M", "DPM++ 2M SDE",
               "DPM++ SDE", "DDIM", "PLMS", "UniPC", "DEIS"]  # fmt: skip


@pytest.fixture(scope="module")
def engines():
    with engine_cache() as get:
        yield get


def call(sampler: str | None = None, schedule: str | None = None, **kw) -> CallParams:
    return CallParams(
        height=32, width=32, steps=4, guidance_scale=4.0, sampler=sampler, sigma_schedule=schedule, **kw
    )


def pixels(im) -> np.ndarray:
    return np.asarray(im).astype(np.int16)


# ---------------------------------------------------------------------- the engine


def test_every_sampler_makes_its_own_image_the_same_for_the_same_seed(engines):
    e = engines("tiny-sd")
    assert [s["name"] for s in e.describe()["samplers"]] == SD_SAMPLERS
    images = {}
    for name in SD_SAMPLERS:
        first, again = (pixels(e.run(ROWS[:1], call(name)).images[0]) for _ in range(2))
        assert np.array_equal(first, again), name  # DPM++ SDE too: its noise is seeded per row
        images[name] = first
    karras = pixels(e.run(ROWS[:1], call("DPM++ 2M", "karras")).images[0])
    distinct = {im.tobytes() for im in [*images.values(), karras]}
    assert len(distinct) == len(SD_SAMPLERS) + 1
    # The model's own scheduler (DDIM here) named or not: the same image.
    assert np.array_equal(pixels(e.run(ROWS[:1], call()).images[0]), images["DDIM"])


@pytest.mark.parametrize("name", ["Euler a", "DPM2 a", "DPM++ 2M SDE", "DPM++ SDE"])
def test_a_noisy_sampler_gives_each_row_its_own_seeds_noise(engines, name):
    """Ancestral and SDE samplers draw noise at every step: from the row's own generator (or,
    for DPM++ SDE's Brownian tree, its own seed), so a row's image is the same alone or in a batch
    (to one grey level: CPU kernels may block a batch of three differently from one), and another
    seed's is another image."""
    e = engines("tiny-sd")
    alone = pixels(e.run(ROWS[1:], call(name)).images[0])
    batched = pixels(e.run(ROWS, call(name)).images[1])
    assert np.abs(alone - batched).max() <= 1
    other_seed = pixels(e.run([dataclasses.replace(ROWS[1], seed=4)], call(name)).images[0])
    assert np.abs(alone - other_seed).max() > 20


def test_rows_of_different_samplers_join_one_run_and_keep_their_images(engines):
    e = engines("tiny-sd")
    rows = [*ROWS, Row("a tree", None, 99)]
    mine = [call("UniPC"), call("DPM++ 2M", "karras"), call("Euler a")]
    alone = [pixels(e.run([row], p).images[0]) for row, p in zip(rows, mine, strict=True)]
    assert e.can_join(mine[0])
    run_ = e.open_joined(mine[0])
    try:
        seats = [run_.add(rows[0], None, mine[0])]
        run_.step()
        seats += [run_.add(row, None, p) for row, p in zip(rows[1:], mine[1:], strict=True)]  # before step 2
        while run_.active:
            run_.step()
    finally:
        run_.close()
    for seat, want in zip(seats, alone, strict=True):
        assert seat.error is None
        assert np.abs(pixels(seat.output.images[0]) - want).max() <= 2
    # UniPC's and DPM++ 2M's rows (integer timesteps, two halves of guidance each) share the
    # denoiser's calls; Euler a's float timesteps make a call of their own within each step.
    assert run_.batch.largest == 4


def test_edits_take_a_sampler_too(engines):
    e = engines("tiny-sd")
    image = Image.new("RGB", (32, 32), (200, 30, 30))
    rows = [dataclasses.replace(ROWS[0], image=image)]
    ddim, euler = (
        pixels(e.run(rows, call(s, task="img2img", strength=0.7)).images[0]) for s in (None, "Euler")
    )
    assert not np.array_equal(ddim, euler)
    assert np.array_equal(euler, pixels(e.run(rows, call("Euler", task="img2img", strength=0.7)).images[0]))


def test_names_a_request_may_use(engines):
    e = engines("tiny-sd")
    assert e.check_sampler("euler A", None) == ("Euler a", None)
    assert e.check_sampler("k_dpmpp_2m", "Karras") == ("DPM++ 2M", "karras")
    assert e.check_sampler("DPM++ 2M Karras", None) == ("DPM++ 2M", "karras")  # A1111's older form
    assert e.check_sampler("EulerAncestralDiscreteScheduler", "automatic") == ("Euler a", None)
    assert e.check_sampler("DDIM", None) == (None, None)  # the model's own
    assert e.check_sampler(None, None) == (None, None)
    with pytest.raises(
        ValueError, match=r"^sampler: 'Euler b' is not offered by tiny-sd; it offers: Euler, "
    ):
        e.check_sampler("Euler b", None)
    with pytest.raises(ValueError, match=r"^sigma_schedule: DDIM takes no other schedule"):
        e.check_sampler("DDIM", "karras")
    with pytest.raises(ValueError, match=r"^sigma_schedule: DDIM takes no other"):
        e.check_sampler(None, "karras")  # a schedule alone is for the model's own sampler
    with pytest.raises(ValueError, match=r"^sigma_schedule: 'polyexponential' is not a sigma schedule"):
        e.check_sampler("Euler", "polyexponential")
    with pytest.raises(ValueError, match=r"^sampler: 'DPM\+\+ 2M Karras' says karras, sigma_schedule"):
        e.check_sampler("DPM++ 2M Karras", "exponential")


def test_a_scheduler_is_built_once_per_sampler_and_schedule_from_the_models_config(engines):
    e = engines("tiny-sd")
    s = e.schedulers
    built = s.get("DPM++ 2M", "karras")
    assert built is s.get("DPM++ 2M", "karras") and built is not s.get("DPM++ 2M", None)
    assert type(built).__name__ == "DPMSolverMultistepScheduler" and built.config.use_karras_sigmas
    for key in ("beta_start", "beta_end", "beta_schedule", "num_train_timesteps", "steps_offset"):
        assert built.config[key] == e.pipe.scheduler.config[key], key
    assert s.get(None, None) is e.pipe.scheduler
    # A model whose own scheduler uses Karras sigmas: "automatic" turns them off.
    from diffusers import EulerDiscreteScheduler

    base = EulerDiscreteScheduler(use_karras_sigmas=True)
    own = Schedulers(base, {}, "m")
    assert own.default == ("Euler", "karras") and own.check("Euler", "karras") == (None, None)
    assert own.check("Euler", None) == ("Euler", None) and not own.get("Euler", None).config.use_karras_sigmas


def test_flow_matching_models_keep_their_shift_in_every_sampler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    base = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.7, max_shift=1.3
    )
    s = Schedulers(base, {}, "m")  # no pipeline hands it sigmas, none noises an input image
    assert [x["name"] for x in s.describe()] == [
        "Euler",
        "UniPC",
        "DPM++ 2M",
    ]  # Heun cannot shift by resolution
    unipc = s.get("UniPC", None)
    assert (
        unipc.config.flow_shift == 3.0 and unipc.config.use_flow_sigmas and unipc.config.use_dynamic_shifting
    )
    assert unipc.config.prediction_type == "flow_prediction"
    assert (
        unipc.config.get("base_shift") == 0.7 and unipc.config.get("max_shift") == 1.3
    )  # the pipeline reads them
    assert (
        Schedulers(FlowMatchEulerDiscreteScheduler(shift=3.0), {}, "m").get("Heun", None).config.shift == 3.0
    )


@pytest.mark.parametrize("name", ["tiny-flux", "tiny-sd3"])
def test_a_flow_model_offers_the_flow_samplers_that_work_for_it(engines, name):
    e = engines(name)
    d = e.describe()
    # Its pipelines pass sigmas of their own and noise input images with `scale_noise`: Euler alone.
    assert (d["sampler_kind"], [s["name"] for s in d["samplers"]], d["default_sampler"]) == (
        "flow",
        ["Euler"],
        "Euler",
    )
    assert d["samplers"][0]["scheduler"] == "FlowMatchEulerDiscreteScheduler"
    assert d["samplers"][0]["sigma_schedules"] == ["karras", "exponential", "beta"]
    with pytest.raises(
        ValueError,
        match=rf"^sampler: 'Euler a' is not offered by {name} \(a flow-matching model\); it offers: Euler$",
    ):
        e.check_sampler("Euler a", None)
    p = CallParams(height=32, width=32, steps=3, guidance_scale=3.0)
    own = pixels(e.run(ROWS[:1], p).images[0])
    karras = pixels(
        e.run(ROWS[:1], dataclasses.replace(p, sampler="Euler", sigma_schedule="karras")).images[0]
    )
    assert not np.array_equal(own, karras)


def test_a_zero_terminal_snr_model_is_offered_only_the_samplers_that_keep_it(engines):
    e = engines("shapes")  # trained with zero terminal SNR, v-prediction
    keep = ["Euler", "Euler a", "DPM++ 2M", "DPM++ 2M SDE", "DDIM", "UniPC"]
    assert [s["name"] for s in e.describe()["samplers"]] == keep
    euler = e.schedulers.get("Euler", None).config
    assert euler.prediction_type == "v_prediction" and euler.rescale_betas_zero_snr
    assert euler.timestep_spacing == "trailing"


def test_a_sampler_whose_library_is_missing_is_not_offered(engines, monkeypatch):
    from serve_app.engine import schedulers

    real = schedulers._class
    monkeypatch.setattr(schedulers, "_class", lambda n: None if n == "LMSDiscreteScheduler" else real(n))
    monkeypatch.setattr(schedulers, "_beta_ok", lambda: False)
    s = Schedulers(engines("tiny-sd").pipe.scheduler, {}, "m")
    names = [x["name"] for x in s.describe()]
    assert "LMS" not in names and "Euler" in names
    assert all("beta" not in x["sigma_schedules"] for x in s.describe())


def test_a_scheduler_the_catalogue_does_not_know_offers_only_itself():
    from diffusers import LCMScheduler

    s = Schedulers(LCMScheduler(), {}, "lcm")
    assert s.describe() == [] and s.default == (None, None) and s.check(None, None) == (None, None)
    with pytest.raises(ValueError, match=r"only its own scheduler"):
        s.check("Euler", None)


@pytest.mark.parametrize("name", ["tiny-sdxl", "tiny-sd3", "tiny-flux", "tiny-wan", "tiny-flux-kontext"])
def test_every_sampler_a_twin_offers_runs_on_each_of_its_tasks(engines, name):
    e = engines(name)
    d = e.describe()
    offered = {"tiny-sdxl": SD_SAMPLERS, "tiny-sd3": ["Euler"], "tiny-flux": ["Euler"],
               "tiny-wan": ["Euler", "Heun", "UniPC", "DPM++ 2M"],
               "tiny-flux-kontext": ["Euler", "UniPC"]}  # fmt: skip
    assert [s["name"] for s in d["samplers"]] == offered[name]
    image = Image.new("RGB", (e.default_width, e.default_height), (120, 30, 200))
    mask = Image.new("L", image.size, 255)
    # SD3's twin cannot inpaint with any scheduler (its transformer has 4 input channels, diffusers
    # wants 16 or 33): that task is left out for it.
    tasks = [t for t in d["tasks"] if not (name == "tiny-sd3" and t == "inpaint")]
    for s in d["samplers"]:
        for schedule in [None, *s["sigma_schedules"]]:
            for task in tasks:
                row = Row("a red circle", None, 3, image=None if task == "generate" else image,
                          mask=mask if task == "inpaint" else None)  # fmt: skip
                p = CallParams(height=e.default_height, width=e.default_width, steps=2, guidance_scale=2.0,
                               task=task, strength=0.9 if task in ("img2img", "inpaint") else None,
                               num_frames=e.default_num_frames, sampler=s["name"],
                               sigma_schedule=schedule)  # fmt: skip
                out = e.run([row], p)
                assert len(out.images) == 1 and not out.interrupted, (s["name"], schedule, task)


# ---------------------------------------------------------------------- the ingress and the replica


def description(e) -> ModelDescription:
    return ModelDescription.model_validate(e.describe())


def test_the_ingress_refuses_a_sampler_the_models_family_cannot_use(engines):
    info = description(engines("tiny-flux"))
    with pytest.raises(InvalidRequest) as caught:
        check_sampler(GenerationRequest(prompt="a", sampler="DPM++ 2M"), info)
    err = caught.value
    assert (err.status_code, err.param) == (400, "sampler")
    assert (
        err.message
        == "sampler: 'DPM++ 2M' is not offered by tiny-flux (a flow-matching model); it offers: Euler"
    )
    assert check_sampler(GenerationRequest(prompt="a", sampler="k_euler", sigma_schedule="Karras"), info) == (
        "Euler", "karras"
    )  # fmt: skip


def prepared(rid: str, sampler: str | None = None, schedule: str | None = None, steps: int = 4):
    return PreparedRequest.from_request(
        GenerationRequest(prompt="a cat", request_id=rid, seed=1), request_id=rid, seed=1, height=32,
        width=32, steps=steps, guidance_scale=4.0, sampler=(sampler, schedule),
    )  # fmt: skip


def test_requests_with_other_samplers_never_share_a_whole_call_but_may_join(engines):
    e = engines("tiny-sd")
    loop = asyncio.new_event_loop()
    try:
        jobs = {k: new_job(e, prepared(k, *v), loop.create_future())
                for k, v in {"a": ("Euler a", None), "b": ("k_euler_a", None), "c": ("DPM++ 2M", None),
                             "d": ("DDIM", None), "e": (None, None)}.items()}  # fmt: skip
    finally:
        loop.close()
    assert jobs["a"].key == jobs["b"].key != jobs["c"].key
    assert jobs["d"].key == jobs["e"].key  # the model's own sampler, named or not
    assert len({j.join_key for j in jobs.values()}) == 1  # each row of a joined call has its own scheduler
    with pytest.raises(InvalidRequest) as caught:
        new_job(engines("tiny-flux"), prepared("f", "Euler a"), None)
    assert caught.value.param == "sampler" and "tiny-flux (a flow-matching model)" in caught.value.message
    assert new_job(FakeEngine(e.cfg), prepared("g", "Euler"), None).payload.params.sampler == "Euler"


@pytest.fixture(scope="module")
def replica():
    model = {"source": "builtin:tiny-sd", "device": "cpu", "default_steps": 8, "warmup": False}
    r = DiffusionReplica(model, {"max_batch_images": 8, "batch_wait_ms": 0, "step_joining": True})
    yield r
    stop(r)


def test_a_request_of_another_sampler_joins_a_running_call_and_gets_its_own_image(replica):
    from tests.test_joining import at_step, decoded

    async def go():
        first = asyncio.ensure_future(replica.generate(prepared("m-a", "Euler a", steps=12)))
        await at_step(replica, "m-a", 2)
        second = await replica.generate(prepared("m-b", "UniPC"))
        return await first, second

    a, b = run(go())
    assert a.metrics.batch_requests == b.metrics.batch_requests == 2
    replica.reconfigure({"step_joining": False})
    try:
        alone = run(replica.generate(prepared("m-b2", "UniPC")))
    finally:
        replica.reconfigure({"step_joining": True})
    assert np.abs(decoded(b)[0] - decoded(alone)[0]).max() <= 2


# ---------------------------------------------------------------------- over HTTP, the handle, the CLI


def image_of(response) -> bytes:
    assert response.status_code == 200, response.text
    return base64.b64decode(response.json()["data"][0]["b64_json"])


def test_models_list_the_samplers_each_model_offers(client):
    card = client.get("/v1/models").json()["data"][0]
    assert card["default_sampler"] == "DDIM" and card["default_sigma_schedule"] is None
    by_name = {s["name"]: s for s in card["samplers"]}
    assert list(by_name) == SD_SAMPLERS
    assert by_name["DPM++ 2M"] == {
        "name": "DPM++ 2M", "scheduler": "DPMSolverMultistepScheduler", "aliases": ["k_dpmpp_2m"],
        "sigma_schedules": ["karras", "exponential", "beta"],
    }  # fmt: skip
    assert by_name["DDIM"]["sigma_schedules"] == []


def test_a_sampler_over_http(client):
    body = {"prompt": "a sampled fox", "seed": 5, "num_inference_steps": 4}
    euler_a = image_of(client.post("/v1/images/generations", json={**body, "sampler": "Euler a"}))
    assert image_of(client.post("/v1/images/generations", json={**body, "sampler": "k_euler_a"})) == euler_a
    karras = client.post(
        "/v1/images/generations", json={**body, "sampler": "DPM++ 2M", "sigma_schedule": "Karras"}
    )
    assert image_of(karras) != euler_a
    assert image_of(
        client.post("/v1/images/generations", json={**body, "sampler": "DPM++ 2M Karras"})
    ) == image_of(karras)
    assert image_of(client.post("/v1/images/generations", json=body)) == image_of(
        client.post("/v1/images/generations", json={**body, "sampler": "DDIM"})
    )  # fmt: skip
    bad = client.post("/v1/images/generations", json={**body, "sampler": "Euler z"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampler"
    assert "it offers: Euler, Euler a, Heun, LMS" in bad.json()["error"]["message"]
    bad = client.post("/v1/images/generations", json={**body, "sampler": "DDIM", "sigma_schedule": "karras"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "sigma_schedule"
    bad = client.post("/v1/images/generations", json={**body, "sampler": "Euler", "sigma_schedule": "cosine"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "sigma_schedule"
    assert "karras, exponential, beta" in bad.json()["error"]["message"]


def test_an_edit_and_the_batch_route_take_a_sampler(client):
    import io

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (30, 200, 90)).save(buf, "PNG")
    edit = {"prompt": "a green field", "image": base64.b64encode(buf.getvalue()).decode(), "seed": 2,
            "num_inference_steps": 4, "strength": 0.8}  # fmt: skip
    heun = image_of(client.post("/v1/images/edits", json={**edit, "sampler": "Heun"}))
    assert heun != image_of(client.post("/v1/images/edits", json=edit))
    assert image_of(client.post("/v1/images/edits", json={**edit, "sampler": "heun"})) == heun
    bad = client.post("/v1/images/edits", json={**edit, "sampler": "nope"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampler"
    batch = client.post(
        "/v1/images/generations/batch", json={"prompts": ["a", "b"], "seed": 1, "sampler": "LMS"}
    )
    assert batch.status_code == 200 and len(batch.json()["data"]) == 2


def test_requests_of_other_samplers_sent_together_run_in_calls_of_their_own(client):
    from concurrent.futures import ThreadPoolExecutor

    def send(sampler):
        body = {"prompt": f"together {sampler}", "seed": 3, "num_inference_steps": 3, "sampler": sampler}
        return client.post("/v1/images/generations", json=body).json()["metrics"]["batch_requests"]

    with replica_held(client) as queued, ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(send, s) for s in ["Euler", "Euler", "DPM2"]]
        wait_for(lambda: queued() == 3, 60)
    counts = [f.result() for f in futures]
    assert counts == [2, 2, 1]


def test_a_job_runs_its_sampler(client):
    body = {
        "prompt": "a job fox",
        "seed": 12,
        "num_inference_steps": 3,
        "sampler": "UniPC",
        "sigma_schedule": "beta",
    }
    r = client.post("/v1/images/generations", json=body, headers={"Prefer": "respond-async, wait=60"})
    assert r.status_code == 200 and r.json()["state"] == "done", r.text
    stored = client.get(r.json()["outputs"][0]["content_url"]).content
    assert stored == image_of(client.post("/v1/images/generations", json=body))
    assert stored != image_of(client.post("/v1/images/generations", json={**body, "sigma_schedule": None}))
    bad = client.post(
        "/v1/images/generations", json={**body, "sampler": "Euler z"}, headers={"Prefer": "respond-async"}
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampler"  # before the job is stored


def test_the_handle_takes_a_sampler(handle, client):
    body = {"prompt": "a handled owl", "seed": 9, "num_inference_steps": 3, "sampler": "DPM++ SDE"}
    result = handle.generate.remote(GenerationRequest(**body)).result()
    assert result.images[0] == image_of(client.post("/v1/images/generations", json=body))


def test_the_cli_takes_a_sampler(base_url, client, tmp_path):
    from tests.test_client_cli import run as cli

    out = tmp_path / "s.png"
    r = cli("generate", "a cli cat", "--steps", "4", "--seed", "6", "--sampler", "DPM++ 2M",
            "--sigma-schedule", "exponential", "-o", str(out), "-q", url=base_url)  # fmt: skip
    assert r.returncode == 0, r.stderr
    body = {"prompt": "a cli cat", "num_inference_steps": 4, "seed": 6, "sampler": "DPM++ 2M",
            "sigma_schedule": "exponential"}  # fmt: skip
    assert out.read_bytes() == image_of(client.post("/v1/images/generations", json=body))
    r = cli("generate", "x", "--sampler", "Euler q", "-o", str(out), url=base_url)
    assert r.returncode == 1 and "sampler: 'Euler q' is not offered" in r.stderr


def test_the_playground_lists_the_models_samplers_and_sends_the_one_chosen(app, base_url, client):
    from tests.test_playground import ARGS, chromium

    executable = chromium()
    if executable is None:
        pytest.fail("no Chromium, and it cannot be installed here: install Debian's chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=ARGS)
        try:
            page = browser.new_page()
            page.goto(base_url + "/")
            page.wait_for_function("document.getElementById('sampler').options.length > 1")
            options = page.eval_on_selector_all("#sampler option", "os => os.map(o => o.value)")
            assert options[:3] == ["", "Euler", "Euler Karras"] and "DPM++ 2M Exponential" in options
            assert "DDIM Karras" not in options
            page.fill("#prompt", "a browser sampler")
            page.fill("#steps", "4")
            page.fill("#seed", "7")
            page.select_option("#sampler", "DPM++ 2M Karras")
            page.click("#generate")
            page.wait_for_function("!document.getElementById('result').hidden", timeout=60_000)
            src = page.get_attribute("#result", "src").split(",", 1)[1]
        finally:
            browser.close()
    body = {"prompt": "a browser sampler", "num_inference_steps": 4, "seed": 7, "guidance_scale": 7.5,
            "sampler": "DPM++ 2M", "sigma_schedule": "karras"}  # fmt: skip
    assert base64.b64decode(src) == image_of(client.post("/v1/images/generations", json=body))
