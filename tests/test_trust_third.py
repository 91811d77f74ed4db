"""The third hostile pass (issue 60): each class of request that got a 500 is a 4xx naming its
field on every route it reaches (OpenAI JSON and forms, A1111, jobs), none counts against the
replica's health, and the replica keeps its id through all of them.

The classes: an image-to-image call with no denoising step to run; `<lora:name:w>` tags with
weights or names out of range; values no field takes anywhere in a JSON body (lone surrogates in
keys and values at any depth, NaN, Infinity, numbers past a double); empty schedule lists; and,
behind the checks, any pipeline error the request's own arguments cause (judged by the
replica's self-test). The quota classes are in test_tenants.py, the job claims in
test_job_claims.py.
"""

from __future__ import annotations

import base64
import io

import httpx
import pytest
from PIL import Image

from tests.conftest import APP_NAME, wait_for

GEN, EDIT = "/v1/images/generations", "/v1/images/edits"
A1111_TXT, A1111_IMG = "/sdapi/v1/txt2img", "/sdapi/v1/img2img"
STARTED: dict = {}  # the replica as the first test found it


def _png(size: int = 32) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), (180, 40, 90)).save(buf, format="PNG")
    return buf.getvalue()


PNG = _png()
PNG_B64 = base64.b64encode(PNG).decode()


def replica(client) -> dict:
    return client.get("/v1/status").json()["replicas"][0]


def refused(r: httpx.Response, param: str, status: int = 400) -> str:
    """The project's JSON error naming `param`; its message."""
    assert r.status_code == status, (param, r.status_code, r.text[:400])
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == status, (param, err)
    assert "Traceback" not in r.text and "/root" not in r.text
    return err["message"]


@pytest.fixture(scope="module", autouse=True)
def the_replica_keeps_its_id_and_counts_no_failure(client):
    before = replica(client)
    STARTED.update(before)
    yield
    after = replica(client)
    assert after["replica_id"] == before["replica_id"] and after["healthy"], after
    assert after["engine_failures_in_a_row"] == 0, after
    assert client.post(GEN, json={"prompt": "still serving"}).status_code == 200


# ------------------------------------------------------------------ 1: no denoising step to run


def test_an_edit_with_no_step_to_run_is_a_400_naming_strength_on_every_route(client):
    # SD's pipelines run int(steps × strength) steps: one step at the default 0.8 runs none.
    one_step = {"prompt": "a", "image": PNG_B64, "num_inference_steps": 1}
    msg = refused(client.post(EDIT, json=one_step), "strength")
    assert "0.8 (the default) of 1 steps runs no denoising step" in msg and "at least 2" in msg, msg
    refused(client.post(EDIT, json={**one_step, "num_inference_steps": 3, "strength": 0.01}), "strength")
    mask = base64.b64encode(_png()).decode()
    refused(client.post(EDIT, json={**one_step, "mask": mask, "strength": 0.5}), "strength")  # inpainting
    form = {"prompt": "a", "num_inference_steps": "4", "strength": "0.1"}
    refused(client.post(EDIT, files={"image": ("a.png", PNG, "image/png")}, data=form), "strength")
    a1111 = {"prompt": "a", "init_images": [PNG_B64], "steps": 3, "denoising_strength": 0.2}
    assert "denoising_strength: 0.2 of 3 steps" in refused(
        client.post(A1111_IMG, json=a1111), "denoising_strength"
    )
    job = client.post(EDIT, json=one_step, headers={"Prefer": "respond-async"})
    refused(job, "strength")  # refused at once, not a job that fails later
    # One whole step is enough.
    ok = client.post(EDIT, json={**one_step, "num_inference_steps": 2, "strength": 0.5})
    assert ok.status_code == 200, ok.text[:300]


# ------------------------------------------------------------------ 2: <lora:name:w> tags


@pytest.mark.parametrize(
    "tag",
    ["<lora:x:nan>", "<lora:x:inf>", "<lora:x:-Infinity>", "<lora:x:11>", "<lora:x:1e309>", "<lora:x:>",
     f"<lora:{'n' * 65}>", f"<lora:{'n' * 65}:0.5>"],
)  # fmt: skip
def test_lora_tags_out_of_range_are_400s_naming_the_prompt(client, tag):
    for route, extra in ((A1111_TXT, {}), (A1111_IMG, {"init_images": [PNG_B64]})):
        msg = refused(client.post(route, json={"prompt": f"a cat {tag}", **extra}), "prompt")
        assert msg.startswith("prompt: <lora:"), msg


# ------------------------------------------------------------------ 3: values no field takes


JSON = {"content-type": "application/json"}
ODD_BODIES = [
    (GEN, rb'{"prompt": "a", "extra": {"\ud800": 1}}', "extra.\\ud800"),
    (GEN, rb'{"prompt": "a", "extra": {"x": [{"y": {"\udfff": [1]}}]}}', "extra.x[0].y.\\udfff"),
    (GEN, rb'{"prompt": "a", "lora": {"name": "x", "\udc00": 1}}', "lora.\\udc00"),
    (GEN, rb'{"prompt": "a", "loras": [{"name": "\ud800x"}]}', "loras[0].name"),
    (GEN, rb'{"prompt": "a", "guidance_scale": NaN}', "guidance_scale"),
    (GEN, rb'{"prompt": "a", "extra": {"eta": Infinity}}', "extra.eta"),
    (GEN, rb'{"prompt": "a", "extra": {"eta": -Infinity}}', "extra.eta"),
    (GEN, rb'{"prompt": "a", "seed": 1e400}', "seed"),
    (GEN, rb'{"prompt": "a", "\ud800": 1}', "\\ud800"),
    (A1111_TXT, rb'{"prompt": "a", "override_settings": {"\ud800": 1}}', "override_settings.\\ud800"),
    (A1111_TXT, rb'{"prompt": "a", "cfg_scale": NaN}', "cfg_scale"),
    ("/sdapi/v1/options", rb'{"\ud800": 1}', "\\ud800"),
    ("/sdapi/v1/options", rb'{"sd_model_checkpoint": "\udbff"}', "sd_model_checkpoint"),
    ("/v1/rpc", rb'{"method": "ping", "kwargs": {"\ud800": 1}}', "kwargs.\\ud800"),
    ("/v1/loras", rb'{"name": "a", "path": "a.safetensors", "scale": NaN}', "scale"),
]


@pytest.mark.parametrize("route, body, where", ODD_BODIES, ids=[w for _, _, w in ODD_BODIES])
def test_values_no_field_takes_are_400s_naming_where_they_are(client, route, body, where):
    msg = refused(client.post(route, content=body, headers=JSON), where)
    assert msg.startswith(f"{where}: ")
    msg.encode("utf-8")  # the answer itself is valid text


def test_the_same_in_a_form_and_in_a_job_and_real_text_still_passes(client):
    files = {"image": ("a.png", PNG, "image/png")}
    r = client.post(EDIT, files=files, data={"prompt": "a", "extra": '{"\\ud800": 1}'})
    refused(r, "extra.\\ud800")
    r = client.post(GEN, content=rb'{"prompt": "a", "n": NaN}', headers={**JSON, "Prefer": "respond-async"})
    refused(r, "n")
    # A surrogate pair is a real character (an emoji), and an escaped backslash is text.
    ok = client.post(GEN, content=rb'{"prompt": "a \ud83d\ude00 \\ud800"}', headers=JSON)
    assert ok.status_code == 200, ok.text[:300]


def test_the_same_values_in_any_spelling_the_parser_reads_are_refused(client):
    """Python's parser reads more than the check once looked at: UTF-16 and UTF-32 bodies,
    surrogates encoded as bytes, any `application/*+json`, a long run of digits."""
    utf16 = '{"prompt": "a", "guidance_scale": NaN}'.encode("utf-16")
    refused(client.post(GEN, content=utf16, headers=JSON), "body")
    refused(client.post(GEN, content=b'{"prompt": "a\xed\xa0\x80"}', headers=JSON), "body")
    merge = {"content-type": "application/merge-patch+json"}
    refused(client.post(GEN, content=rb'{"prompt": "a", "extra": {"eta": NaN}}', headers=merge), "extra.eta")
    digits = b'{"prompt": "a", "extra": {"eta": 1' + b"0" * 400 + b".0}}"
    refused(client.post(GEN, content=digits, headers=JSON), "extra.eta")


# ------------------------------------------------------------------ 4: empty schedules


@pytest.mark.parametrize("extra", [{"sigmas": []}, {"timesteps": []}, {"sigmas": [1.0, "x"]}])
def test_empty_or_odd_schedules_are_400s_naming_the_argument(client, extra):
    name = next(iter(extra))
    msg = refused(client.post(GEN, json={"prompt": "a", "extra": extra}), "extra")
    assert msg.startswith(f"extra.{name}"), msg


# ------------------------------------------------------------------ behind every check


def test_a_pipeline_error_the_arguments_cause_is_a_400_judged_by_the_self_test(client):
    """A request that passed every check but fails in the pipeline (here: an edit with no step
    to run, sent to the replica past the ingress's check): the replica runs its self-test, the
    model runs its defaults, so the request's arguments are at fault: a 400, not counted."""
    from ray import serve

    from serve_app.errors import InvalidRequest
    from serve_app.schemas import PixelPayload, PreparedRequest

    image = PixelPayload.from_pil(Image.open(io.BytesIO(PNG)).convert("RGB"))
    request = PreparedRequest(
        request_id="past-the-checks", prompts=["a"], negative_prompt=None, height=32, width=32,
        num_inference_steps=1, guidance_scale=5.0, seed=1, num_images=1, output_format="png",
        task="img2img", strength=0.5, image=image, model="tiny-sd",
    )  # fmt: skip
    before = replica(client)["counts"].get("argument_failures", 0)
    handle = serve.get_deployment_handle("DiffusionReplica", APP_NAME)
    for i in range(3):  # the second and third reuse the first's verdict
        with pytest.raises(InvalidRequest) as e:
            handle.generate.remote(request.model_copy(update={"request_id": f"past-{i}"})).result()
        assert e.value.status_code == 400 and "runs its defaults" in e.value.message, e.value.message
    state = replica(client)
    assert state["counts"]["argument_failures"] == before + 3
    assert state["engine_failures_in_a_row"] == 0 and state["healthy"]


# ------------------------------------------------------------------ smaller ones


@pytest.mark.parametrize("name", [".", "..", "...", ".hidden", "a\n", "a/b"])
def test_checkpoint_names_that_read_as_paths_are_refused(client, name):
    r = client.post("/v1/checkpoints", json={"name": name, "source": "whatever.safetensors"})
    refused(r, "name")


def test_head_on_a_signed_link_works_without_a_key_like_get(keyed_app, base_url):
    from tests.conftest import USER_KEY

    url = base_url + keyed_app
    auth = {"Authorization": f"Bearer {USER_KEY}"}
    sent = httpx.post(
        f"{url}{GEN}", json={"prompt": "a link"}, headers={**auth, "Prefer": "respond-async"}, timeout=120
    )
    assert sent.status_code == 202, sent.text[:300]

    def done():
        job = httpx.get(f"{url}/v1/jobs/{sent.json()['id']}", headers=auth).json()
        return job if job["state"] in ("done", "failed", "aborted") else None

    job = wait_for(done, 60, 0.1)
    assert job["state"] == "done", job
    link = job["outputs"][0]["url"]
    got, head = httpx.get(link), httpx.head(link)
    assert got.status_code == 200 and head.status_code == 200, (got.text[:200], head.text[:200])
    assert head.headers["content-length"] == str(len(got.content)) and head.content == b""
    assert httpx.head(link.replace("signature=", "signature=0")).status_code == 403
