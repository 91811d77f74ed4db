"""Asynchronous jobs over real HTTP: `Prefer: respond-async`, the job resource, its stored
outputs, idempotency keys, abort, the reconnectable event stream, webhooks to a receiver on
loopback (the loss of a replica and of the ingress under jobs: test_faults.py)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import httpx
import pytest

from serve_app.jobs import Store, sign, signature_ok
from serve_app.schemas import JobRecord
from serve_app.testing import SLOW_MARKER
from tests.conftest import free_port, wait_for

GEN = "/v1/images/generations"
ASYNC = {"Prefer": "respond-async"}


def submit(client, body, path=GEN, headers=None, prefix=""):
    r = client.post(f"{prefix}{path}", json=body, headers={**ASYNC, **(headers or {})})
    assert r.status_code in (200, 202), r.text
    return r


def finished(client, job_id, prefix="", timeout=120, headers=None):
    def done():
        job = client.get(f"{prefix}/v1/jobs/{job_id}", headers=headers or {}).json()
        return job if job["state"] in ("done", "failed", "aborted") else None

    return wait_for(done, timeout, 0.1)


def test_a_job_answers_at_once_and_keeps_its_result(client):
    body = {"prompt": "a boat", "seed": 11, "n": 2, "num_inference_steps": 4}
    r = submit(client, body)
    job = r.json()
    assert r.status_code == 202 and job["object"] == "job" and job["id"].startswith("job_")
    assert job["state"] in ("queued", "running") and r.headers["location"].endswith(f"/v1/jobs/{job['id']}")
    done = finished(client, job["id"])
    assert done["state"] == "done" and done["step"] == done["total_steps"] == 4, done
    assert [o["seed"] for o in done["outputs"]] == [11, 12]
    plain = client.post(GEN, json=body).json()
    # A job runs at `batch` priority unless it asks; a plain request at `interactive` (issue 58).
    assert done["metrics"]["priority"] == 0 and plain["metrics"]["priority"] == 5, (done, plain["metrics"])
    for out, ref in zip(done["outputs"], plain["data"], strict=True):
        content = client.get(out["content_url"])
        assert content.headers["content-type"] == "image/png"
        assert content.content == base64.b64decode(ref["b64_json"])  # the same image as a plain request
        assert httpx.get(out["url"]).content == content.content  # the signed link, without a key
    # A caller naming its request after the job cannot touch the job's stored files.
    hostile = {"prompt": "overwrite", "request_id": job["id"], "response_format": "url"}
    assert client.post(GEN, json=hostile).status_code == 200
    assert client.get(done["outputs"][0]["content_url"]).content == base64.b64decode(
        plain["data"][0]["b64_json"]
    )
    for bad in ("..", "job_..", "job_" + "0" * 32 + "/../x"):
        assert client.get(f"/v1/jobs/{bad}").status_code == 404
    listed = client.get("/v1/jobs", params={"limit": 50}).json()["data"]
    assert job["id"] in [j["id"] for j in listed]
    assert client.get(f"/v1/jobs/{job['id']}/content/2").status_code == 404
    # Another caller (another key) can neither see, read, follow nor delete it.
    other = {"Authorization": "Bearer other"}
    for method, path in [("GET", ""), ("GET", "/content/0"), ("GET", "/events"), ("DELETE", "")]:
        r = client.request(method, f"/v1/jobs/{job['id']}{path}", headers=other)
        assert r.status_code == 404 and r.json()["error"]["param"] == "job_id", (method, path)
    assert client.get(f"/v1/jobs/{job['id']}/events", params={"last_event_id": "²"}).status_code == 400
    # A finished job is deleted with its files.
    assert client.delete(f"/v1/jobs/{job['id']}").json()["deleted"] is True
    assert client.get(f"/v1/jobs/{job['id']}").status_code == 404
    assert httpx.get(done["outputs"][0]["url"]).status_code == 404


def test_prefer_wait_answers_a_quick_job_ended(client):
    quick = client.post(
        GEN, json={"prompt": "q", "num_inference_steps": 2}, headers={"Prefer": "respond-async, wait=60"}
    )
    assert quick.status_code == 200 and quick.json()["state"] == "done" and quick.json()["outputs"], (
        quick.text
    )
    slow = {"prompt": f"s {SLOW_MARKER}", "num_inference_steps": 30}
    t0 = time.monotonic()
    r = client.post(GEN, json=slow, headers={"Prefer": "respond-async, wait=1"})
    assert r.status_code == 202 and r.json()["state"] in ("queued", "running") and time.monotonic() - t0 >= 1
    client.delete(f"/v1/jobs/{r.json()['id']}")


def test_bad_jobs_are_refused_before_they_are_stored(client):
    for body, param in [
        ({"prompt": "a", "num_inference_steps": 999}, "num_inference_steps"),
        ({"prompt": "a", "webhook": "ftp://127.0.0.1/x"}, "webhook"),
        ({"prompt": "a", "webhook": "http://example.com/hook"}, "webhook"),  # not an allowed host
        ({"prompt": "a", "webhook_events": ["completed"]}, "webhook_events"),
        ({"prompt": "a", "stream": True}, "stream"),
    ]:
        r = client.post(GEN, json=body, headers=ASYNC)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    # A webhook without the asynchronous preference is refused too.
    r = client.post(GEN, json={"prompt": "a", "webhook": "http://127.0.0.1:9/x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "webhook"
    assert client.get("/v1/jobs/job_nope").status_code == 404
    assert client.get("/v1/jobs/..%2Fetc").status_code in (400, 404)


def test_an_idempotency_key_makes_the_same_job(client):
    key = {"Idempotency-Key": f"k-{time.time_ns()}"}
    body = {"prompt": "same", "seed": 3, "num_inference_steps": 2}
    a = submit(client, body, headers=key).json()
    b = submit(client, body, headers=key)
    assert b.status_code == 200 and b.json()["id"] == a["id"]
    clash = client.post(GEN, json={**body, "seed": 4}, headers={**ASYNC, **key})
    assert clash.status_code == 409 and clash.json()["error"]["param"] == "Idempotency-Key"
    # The same key from another caller is another job.
    c = submit(client, body, headers={**key, "Authorization": "Bearer someone-else"}).json()
    assert c["id"] != a["id"]
    finished(client, a["id"])


def test_abort_a_running_job_and_its_state_says_so(client):
    job = submit(client, {"prompt": f"long {SLOW_MARKER}", "num_inference_steps": 50}).json()
    wait_for(lambda: client.get(f"/v1/jobs/{job['id']}").json()["step"] >= 2, 60)
    # Another size cannot share its pipeline call: that job waits, and says where in the queue.
    behind = submit(client, {"prompt": "behind", "num_inference_steps": 2, "size": "40x40"}).json()
    # (The 202 comes once the job is stored; it reaches the replica's queue a moment later.)
    waiting = wait_for(
        lambda: (j := client.get(f"/v1/jobs/{behind['id']}").json())["queue_position"] == 0 and j, 30
    )
    assert waiting["state"] == "queued", waiting
    r = client.delete(f"/v1/jobs/{job['id']}")
    assert r.status_code == 200 and r.json()["state"] == "aborted", r.text
    got = client.get(f"/v1/jobs/{job['id']}").json()
    assert got["state"] == "aborted" and got["error"]["type"] == "aborted" and got["step"] < 50
    assert finished(client, behind["id"])["state"] == "done"  # the one behind runs once it is gone


def read_events(base_url, job_id, last_id=None, stop_after_step=None):
    """Events of a job's stream as (id, body); stops early after `stop_after_step`."""
    headers = {"Last-Event-ID": str(last_id)} if last_id is not None else {}
    out, current = [], None
    with httpx.stream("GET", f"{base_url}/v1/jobs/{job_id}/events", headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("id: "):
                current = int(line[4:])
            elif line.startswith("data: ") and line != "data: [DONE]":
                body = json.loads(line[6:])
                out.append((current, body))
                if stop_after_step is not None and body.get("step") == stop_after_step:
                    break
    return out


def test_a_reconnecting_client_gets_the_events_it_missed(client, base_url):
    job = submit(client, {"prompt": f"events {SLOW_MARKER}", "num_inference_steps": 12}).json()
    first = read_events(base_url, job["id"], stop_after_step=3)
    assert [i for i, _ in first] == [1, 2, 3]
    rest = read_events(base_url, job["id"], last_id=3)
    ids = [i for i, _ in rest]
    assert ids == list(range(4, 14)), ids  # steps 4..12, then the job (id 13)
    assert rest[-1][1]["type"] == "job" and rest[-1][1]["state"] == "done"
    again = read_events(base_url, job["id"], last_id=12)  # after the end: only the job
    assert [b["type"] for _, b in again] == ["job"]


class Receiver:
    """A webhook receiver on loopback: records each call; fails the first `fail_first` calls."""

    def __init__(self, fail_first: int = 0):
        self.calls: list[tuple[dict, dict]] = []
        self.fail_first = fail_first
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.calls.append((dict(self.headers), body))
                failing = len(receiver.calls) <= receiver.fail_first
                self.send_response(500 if failing else 204)
                self.end_headers()

            def log_message(self, *a):
                pass

        self.server = HTTPServer(("127.0.0.1", free_port()), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"

    def close(self):
        self.server.shutdown()


def test_webhooks_are_signed_retried_and_their_delivery_shown(client):
    rx = Receiver(fail_first=2)
    try:
        body = {"prompt": "hook", "num_inference_steps": 3, "webhook": rx.url,
                "webhook_events": ["start", "completed"]}  # fmt: skip
        job = submit(client, body).json()
        hooked = wait_for(
            lambda: (j := client.get(f"/v1/jobs/{job['id']}").json())["webhook"]["state"] != "pending" and j,
            60,
        )
        assert hooked["webhook"]["state"] == "delivered", hooked["webhook"]
        events = [json.loads(b)["event"] for _, b in rx.calls]
        # "start" is one try (it may meet a failure); "completed" is retried until delivered.
        assert events[0] == "start" and events.count("completed") == hooked["webhook"]["attempts"]
        assert hooked["webhook"]["attempts"] >= 2 and hooked["webhook"]["last_status"] == 204
        headers, raw = rx.calls[-1]
        stamp = headers["Webhook-Timestamp"]
        mac = hmac.new(b"test-webhook-key", stamp.encode() + b"." + raw, hashlib.sha256).hexdigest()
        assert headers["Webhook-Signature"] == f"sha256={mac}"
        assert json.loads(raw)["job"]["state"] == "done" and json.loads(raw)["job"]["outputs"]
    finally:
        rx.close()
    # A receiver that never answers well: the delivery ends failed after its attempts.
    down = Receiver(fail_first=1000)
    try:
        job = submit(client, {"prompt": "hook", "num_inference_steps": 2, "webhook": down.url}).json()
        hooked = wait_for(
            lambda: (j := client.get(f"/v1/jobs/{job['id']}").json())["webhook"]["state"] != "pending" and j,
            60,
        )
        assert hooked["webhook"]["state"] == "failed" and hooked["webhook"]["attempts"] == 5, hooked[
            "webhook"
        ]
        assert hooked["webhook"]["last_status"] == 500 and len(down.calls) == 5
    finally:
        down.close()


def test_the_store_prunes_by_age_and_size_and_links_are_signed(tmp_path):
    store = Store(str(tmp_path / "s"))
    now = time.time()
    for i, (age, done) in enumerate([(10, True), (5, True), (1, True), (100, False)]):
        job = JobRecord(id=f"job_{i}", route="r", model="m", state="done" if done else "running",
                        created_at=now - age, finished_at=(now - age) if done else None,
                        request_id=f"job_{i}", output_format="png")  # fmt: skip
        store.save_job(job)
        store._write(store._path("objects", job.id, "0.png"), b"x" * 1000)
    assert store.prune(max_age_s=8, max_bytes=1e9, now=now) == ["job_0"]  # too old
    gone = store.prune(max_age_s=1e9, max_bytes=3200, now=now)  # 3 jobs of ~1.3 kB
    assert gone == ["job_1"]  # the oldest finished first; the running one is never pruned
    assert {j.id for j in store.jobs()} == {"job_2", "job_3"}
    key = store.secret("url", "NO_SUCH_VARIABLE_SET")
    assert key == Store(str(tmp_path / "s")).secret("url", "NO_SUCH_VARIABLE_SET")  # shared via the store
    sig = sign(key, "job_2/0.png", int(now) + 60)
    assert signature_ok(key, "job_2/0.png", int(now) + 60, sig)
    assert not signature_ok(key, "job_2/1.png", int(now) + 60, sig)
    assert not signature_ok(key, "job_2/0.png", int(now) - 1, sign(key, "job_2/0.png", int(now) - 1))
    # Any fsspec URL: the same store in memory.
    mem = Store("memory://jobs-test")
    mem.save_job(job)
    assert mem.load_job(job.id) == job and mem.keys() == [job.id]
    assert mem.create_job(job) is False  # exclusive: a second submit of the same id loses


def test_webhook_targets_without_an_allow_list():
    from serve_app.errors import InvalidRequest
    from serve_app.jobs.webhooks import check_url, post

    check_url("https://hooks.example.com/x", [])
    check_url("http://cafe.de/hook", [])  # hex-looking letters are still a name
    for bad in ("http://127.0.0.1/x", "http://localhost:80/", "http://10.1.2.3/", "http://169.254.169.254/",
                "http://[::1]/", "file:///etc/passwd", "http://host:notaport/", "http://2130706433/",
                "http://0x7f000001/", "http://0177.0.0.1/", "http://127.1/", "http://100.64.0.1/",
                "http://[::ffff:127.0.0.1]/", "http://224.0.0.1/"):  # fmt: skip
        with pytest.raises(InvalidRequest, match="webhook"):
            check_url(bad, [])
    # A name that resolves to an internal address is refused when the call is made.
    rx = Receiver()
    try:
        by_name = rx.url.replace("127.0.0.1", "localhost")
        status, error = asyncio.run(post(by_name, b"{}", b"", 5.0, True))
        assert status is None and error and not rx.calls
        assert asyncio.run(post(by_name, b"{}", b"", 5.0, False))[0] == 204  # with an allow-list
    finally:
        rx.close()


def _prepared():
    """A small prepared request, for a runner driven without a replica."""
    from serve_app.schemas import PreparedRequest

    return PreparedRequest(request_id="r", prompts=["a"], height=32, width=32, num_inference_steps=2,
                           guidance_scale=1.0, seed=1, num_images=1, output_format="png",
                           negative_prompt=None)  # fmt: skip


async def _no_abort(_request_id):
    return None


def test_a_job_just_stored_is_not_resumed_before_its_lease_is_written(tmp_path):
    """An ingress stores a new job's record, then its lease: a resume pass in between (of this
    ingress or another) must not take the job for an orphan and run it a second time. A record
    that got no lease within a lease's time is an orphan."""
    from serve_app.config import JobsConfig
    from serve_app.jobs import JobRunner

    store = Store(str(tmp_path / "s"))
    cfg = JobsConfig(store=str(tmp_path / "s"), lease_s=30)
    ran: list[str] = []

    async def stream(request):
        ran.append(request.request_id)
        yield None

    async def scenario():
        # Not started: its own background pass would race the one below.
        runner = JobRunner(store, cfg, stream, _no_abort, lambda job: job)
        prepared = _prepared()
        for job_id, age in (("job_" + "a" * 32, 1.0), ("job_" + "b" * 32, 31.0)):
            job = JobRecord(id=job_id, route="r", model="m", state="queued", created_at=time.time() - age,
                            request_id="r", output_format="png", owner="another")  # fmt: skip
            store.save_request(job_id, prepared)
            assert store.create_job(job)
        await runner._resume_orphans()
        resumed = {job_id: store.load_job(job_id).attempts for job_id in store.keys()}
        if runner._loop_task is not None:
            runner._loop_task.cancel()
        for task in list(runner.tasks.values()):
            task.cancel()
        return resumed

    resumed = asyncio.run(scenario())
    assert resumed == {"job_" + "a" * 32: 1, "job_" + "b" * 32: 2}, resumed  # attempt 1: not taken


def test_a_job_deleted_while_its_result_is_stored_leaves_no_files(tmp_path):
    """A DELETE (or a prune) that removes the record while the runner is still writing the
    result's files: once the runner sees the record gone, the files it wrote go too, rather than
    waiting for retention."""
    from serve_app.config import JobsConfig
    from serve_app.jobs import JobRunner
    from serve_app.schemas import GenerationResult, StageMetrics, StepEvent

    store = Store(str(tmp_path / "s"))
    cfg = JobsConfig(store=str(tmp_path / "s"), lease_s=30)
    job_id = "job_" + "c" * 32
    made = GenerationResult(request_id="r", model="m", images=[b"\x89PNG" + b"\0" * 64], seeds=[1],
                            prompt_index=[0], metrics=StageMetrics(steps=2), peak_memory_mb=0.0)  # fmt: skip

    async def stream(request):
        yield StepEvent(request_id="r", step=1, total_steps=2, elapsed_ms=1.0)
        store.delete(job_id)  # the DELETE lands between the last step and the result
        yield made

    async def scenario():
        runner = JobRunner(store, cfg, stream, _no_abort, lambda job: job)
        prepared = _prepared()
        job = JobRecord(id=job_id, route="r", model="m", state="queued", created_at=time.time(),
                        request_id="r", output_format="png")  # fmt: skip
        assert await runner.submit(job, prepared) is job
        await runner.tasks[job_id]
        if runner._loop_task is not None:
            runner._loop_task.cancel()
        return job

    job = asyncio.run(scenario())
    assert job.outputs, "the result's files were written"
    assert store.load_job(job_id) is None and job_id not in store.keys(), store.keys()


def test_the_event_stream_sends_every_step_when_the_job_ends_while_it_is_sending():
    """The runner changes the very record the stream reads. A job that runs its last steps
    and ends while the stream is sending an earlier step still gets a step event per step,
    then the job (CI once saw `1/4, 2/4`, then the result)."""
    from types import SimpleNamespace

    from serve_app.ingress.jobs import JobDesk

    job = JobRecord(id="job_" + "0" * 32, route="r", model="m", state="running", created_at=time.time(),
                    request_id="r", output_format="png", total_steps=4, step=2)  # fmt: skip

    async def watch(job_id, timeout):
        await asyncio.sleep(0)

    async def current(job_id):
        return job

    desk = SimpleNamespace(runner=SimpleNamespace(watch=watch), current=current,
                           links=SimpleNamespace(present=lambda j: j))  # fmt: skip

    async def follow():
        events = []
        async for chunk in JobDesk.events(desk, job, 0):
            events.append(chunk)
            if len(events) == 1:  # while step 1 is being sent, the job runs to its end
                job.state, job.step = "done", 4
        return events

    events = [json.loads(c[c.index("data: ") + 6 :]) for c in asyncio.run(follow()) if "data: {" in c]
    assert [e["step"] for e in events if e["type"] == "step"] == [1, 2, 3, 4]
    assert events[-1]["type"] == "job" and events[-1]["state"] == "done"
