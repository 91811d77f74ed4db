"""Request lifecycle over real HTTP and handles: abort, cancel on disconnect, progress, status."""

from __future__ import annotations

import base64
import json
import threading
import time
import uuid

import httpx
import numpy as np
import pytest

from serve_app.errors import Aborted
from serve_app.schemas import GenerationRequest, GenerationResult, StepEvent
from tests.conftest import replica_held, wait_for

GEN = "/v1/images/generations"
# A request that runs for many seconds on the tiny model (about half a second per step at 128x128).
LONG = {"prompt": "a long one", "size": "128x128", "num_inference_steps": 40}


def rid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def state(client, request_id: str) -> dict | None:
    r = client.get(f"/v1/requests/{request_id}")
    return r.json() if r.status_code == 200 else None


class Background:
    """An HTTP request in a thread, so that the test can act while it runs."""

    def __init__(self, base_url: str, body: dict, timeout: float = 120):
        self.response: httpx.Response | None = None
        self.error: Exception | None = None
        self.done_at: float | None = None

        def run():
            try:
                self.response = httpx.post(base_url + GEN, json=body, timeout=timeout)
            except Exception as e:
                self.error = e
            self.done_at = time.monotonic()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self, timeout=60):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "request still running"
        return self.response


def test_abort_running_request_frees_the_replica_within_a_step(client, base_url):
    job = rid("long")
    bg = Background(base_url, {**LONG, "request_id": job})
    first = wait_for(lambda: (s := state(client, job)) and s["state"] == "running" and s["step"] >= 1 and s)
    t_first = time.monotonic()
    second = wait_for(lambda: (s := state(client, job)) and s["step"] >= first["step"] + 2 and s)
    step_s = (time.monotonic() - t_first) / (second["step"] - first["step"])

    t = time.monotonic()
    r = client.post(f"/v1/requests/{job}/abort")
    assert r.status_code == 200 and r.json()["result"] == "aborted"
    resp = bg.join()
    waited = bg.done_at - t
    assert resp.status_code == 499, resp.text
    err = resp.json()["error"]
    assert err["type"] == "aborted" and err["request_id"] == job and "aborted" in err["message"]
    assert waited < step_s + 1.0, f"caller waited {waited:.2f}s after abort (one step is {step_s:.2f}s)"

    # The engine stopped stepping: the step count stays where it was, well short of the total.
    final = wait_for(lambda: (s := state(client, job)) and s["state"] == "aborted" and s)
    time.sleep(2 * step_s)
    assert state(client, job)["step"] == final["step"] < LONG["num_inference_steps"]
    # And the device is free: the next request does not wait for the aborted one.
    nxt = client.post(GEN, json={"prompt": "next"}).json()
    assert nxt["metrics"]["queue_ms"] < 1000 * step_s + 500


def test_aborted_queued_request_never_reaches_the_engine(client, base_url):
    running, queued = rid("running"), rid("queued")
    a = Background(base_url, {**LONG, "request_id": running})
    wait_for(lambda: (s := state(client, running)) and s["state"] == "running")
    b = Background(base_url, {**LONG, "num_inference_steps": 39, "request_id": queued})
    s = wait_for(lambda: (s := state(client, queued)) and s["state"] == "queued" and s)
    assert s["queue_position"] == 0 and s["step"] == 0
    status = client.get("/v1/status").json()
    rep = status["replicas"][0]
    assert rep["running_requests"] == 1 and rep["queued_requests"] == 1 and rep["healthy"]
    assert status["queue_length"] == 2

    assert client.delete(f"/v1/requests/{queued}").json()["result"] == "aborted"
    assert b.join().status_code == 499
    assert client.post(f"/v1/requests/{running}/abort").json()["result"] == "aborted"
    assert a.join().status_code == 499
    s = state(client, queued)
    assert s["state"] == "aborted" and s["step"] == 0  # not one step ran


def test_client_disconnect_stops_the_work(client, base_url):
    job = rid("disconnect")
    with pytest.raises(httpx.ReadTimeout):
        # The client gives up after 3 s and closes its connection.
        httpx.post(base_url + GEN, json={**LONG, "request_id": job}, timeout=3)
    s = wait_for(lambda: (s := state(client, job)) and s["state"] == "aborted" and s, timeout=30)
    assert s["step"] < LONG["num_inference_steps"]


def test_handle_cancel_stops_the_work(handle, client):
    job = rid("cancel")
    resp = handle.generate.remote(GenerationRequest(prompt="x", width=128, height=128, num_inference_steps=40,
                                                    request_id=job))  # fmt: skip
    wait_for(lambda: (s := state(client, job)) and s["state"] == "running")
    resp.cancel()
    s = wait_for(lambda: (s := state(client, job)) and s["state"] == "aborted" and s, timeout=30)
    assert s["step"] < 40


def test_abort_through_the_handle_raises_aborted(handle, client):
    job = rid("handle-abort")
    resp = handle.generate.remote(GenerationRequest(prompt="x", width=128, height=128, num_inference_steps=40,
                                                    request_id=job))  # fmt: skip
    wait_for(lambda: (s := state(client, job)) and s["state"] == "running")
    assert handle.abort.remote([job]).result() == {job: "aborted"}
    with pytest.raises(Aborted):
        resp.result()


def test_abort_unknown_or_finished_is_a_no_op_that_says_so(client):
    r = client.post("/v1/requests/never-existed/abort")
    assert (
        r.status_code == 200 and r.json()["result"] == "unknown" and "nothing to abort" in r.json()["message"]
    )
    done = rid("done")
    assert client.post(GEN, json={"prompt": "a", "request_id": done}).status_code == 200
    r = client.delete(f"/v1/requests/{done}")
    assert r.json()["result"] == "finished"
    assert state(client, done)["state"] == "done"
    assert client.get("/v1/requests/never-existed").status_code == 404


def test_abort_one_request_of_a_shared_pipeline_call_leaves_the_other(client, base_url):
    keep, drop = rid("keep"), rid("drop")
    body = {"prompt": "shared", "size": "96x96", "num_inference_steps": 12, "seed": 5}
    with replica_held(client) as queued:  # both queue behind it, so they start in one call
        a = Background(base_url, {**body, "request_id": keep})
        b = Background(base_url, {**body, "prompt": "dropped", "request_id": drop})
        wait_for(lambda: queued() == 2, 60)
    wait_for(lambda: (s := state(client, keep)) and s["state"] == "running" and s["step"] >= 1)
    s = state(client, drop)
    if s["state"] != "running":
        pytest.fail(
            f"the two requests did not share a call (second is {s['state']}); batch window too short?"
        )
    client.post(f"/v1/requests/{drop}/abort")
    assert b.join().status_code == 499
    kept = a.join()
    assert kept.status_code == 200, kept.text
    assert kept.json()["metrics"]["batch_requests"] == 2
    assert kept.json()["metrics"]["steps"] == 12
    alone = client.post(GEN, json=body).json()
    assert np.abs(pixels(alone) - pixels(kept.json())).max() <= 1


def pixels(body: dict) -> np.ndarray:
    from io import BytesIO

    from PIL import Image

    return np.asarray(Image.open(BytesIO(base64.b64decode(body["data"][0]["b64_json"])))).astype(np.int16)


def read_sse(response: httpx.Response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_streamed_request_yields_every_step_then_the_same_image(client):
    body = {"prompt": "a streamed cat", "num_inference_steps": 6, "seed": 21, "n": 2}
    with client.stream("POST", GEN, json={**body, "stream": True, "preview_every": 2}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = read_sse(r)
    steps = [e for e in events[:-2]]
    assert [e["type"] for e in steps] == ["step"] * 6
    assert [e["step"] for e in steps] == [1, 2, 3, 4, 5, 6]
    assert all(e["total_steps"] == 6 for e in steps)
    assert [e["elapsed_ms"] for e in steps] == sorted(e["elapsed_ms"] for e in steps)
    assert [("preview_png" in e) for e in steps] == [False, True, False, True, False, True]
    assert base64.b64decode(steps[1]["preview_png"]).startswith(b"\x89PNG")
    final, done = events[-2], events[-1]
    assert final["type"] == "result" and done == "[DONE]"
    plain = client.post(GEN, json=body).json()
    assert [d["b64_json"] for d in final["data"]] == [d["b64_json"] for d in plain["data"]]
    assert final["request_id"] == steps[0]["request_id"]


def test_stream_error_arrives_as_an_error_event(client):
    from serve_app.testing import FAIL_MARKER

    with client.stream("POST", GEN, json={"prompt": FAIL_MARKER, "stream": True}) as r:
        events = read_sse(r)
    assert events[-2]["type"] == "error" and "injected engine failure" in events[-2]["error"]["message"]
    assert events[-1] == "[DONE]"


def test_stream_bad_input_is_a_plain_400(client):
    r = client.post(GEN, json={"prompt": "a", "stream": True, "width": 12})
    assert r.status_code == 400 and r.json()["error"]["param"] == "width"


def test_handle_streaming(handle):
    gen = handle.options(stream=True).generate_stream.remote(
        GenerationRequest(prompt="s", num_inference_steps=4)
    )
    events = list(gen)
    assert [type(e) for e in events] == [StepEvent] * 4 + [GenerationResult]
    assert [e.step for e in events[:4]] == [1, 2, 3, 4]
    assert events[-1].images
