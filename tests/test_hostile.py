"""The trust boundary, second pass: two users with keys (A and B) and an admin on `keyed_app`,
trying what hostile users try: webhooks that dial inside, each other's requests and jobs, odd
bytes, and a flood of jobs. The units at the top need no Ray.
"""

from __future__ import annotations

import asyncio
import io
import threading
import time

import httpx
import pytest
from PIL import Image

from serve_app.errors import InvalidRequest
from serve_app.jobs.webhooks import check_url, post
from tests.conftest import ADMIN_KEY, KEYED_JOBS, USER_KEY, USER_KEY_B, wait_for
from tests.test_jobs import Receiver

GEN = "/v1/images/generations"
A, B, ADMIN = ({"Authorization": f"Bearer {k}"} for k in (USER_KEY, USER_KEY_B, ADMIN_KEY))
ASYNC = {"Prefer": "respond-async"}
SLOW = "[[slow]]"  # serve_app.testing.SLOW_MARKER: 0.1 s a step

# Each reaches this machine (or a private network) once the HTTP client has normalised it.
INSIDE = [
    "http://１２７.0.0.1:{port}/",  # fullwidth digits
    "http://127。0。0。1:{port}/",  # ideographic full stops
    "http://127．0．0．1:{port}/",  # fullwidth full stops
    "http://127｡0｡0｡1:{port}/",  # halfwidth ideographic full stops
    "http://⑫⑦.0.0.1:{port}/",  # circled numbers
    "http://𝟏𝟐𝟕.0.0.1:{port}/",  # mathematical bold digits
    "http://①⓪.0.0.1:{port}/",  # 10.0.0.1 in circled numbers
    "http://ｌｏｃａｌｈｏｓｔ:{port}/",  # fullwidth letters
    "http://[::127.0.0.1]:{port}/",  # IPv4-compatible
    "http://[::ffff:127.0.0.1]:{port}/",  # IPv4-mapped
    "http://[::ffff:0:7f00:1]:{port}/",  # IPv4-translated
    "http://[64:ff9b::7f00:1]:{port}/",  # NAT64, well-known prefix
    "http://[64:ff9b::a9fe:a9fe]:{port}/",  # NAT64 of the cloud metadata address
    "http://[64:ff9b:1::a00:1]:{port}/",  # NAT64, local-use prefix
    "http://[2002:7f00:1::1]:{port}/",  # 6to4 of 127.0.0.1
    "http://[2001:0:4136:e378:8000:63bf:80ff:fffe]:{port}/",  # Teredo, client 127.0.0.1
    "http://[2600::5efe:7f00:1]:{port}/",  # ISATAP interface id embedding 127.0.0.1
    "http://[fe80::1%25eth0]:{port}/",  # a zone id
    "http://127.0.0.1.:{port}/",  # a trailing dot
    "http://0x7f.1:{port}/",
    "http://127%2E0.0.1:{port}/",  # a percent-escape in the host
    "http://user:pw@127.0.0.1:{port}/",
    "http://printer.local:{port}/",
]


def png(size: int = 32) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), (200, 30, 30)).save(buf, "PNG")
    return buf.getvalue()


# --------------------------------------------------------------------------- units, no Ray


@pytest.mark.parametrize("url", INSIDE)
def test_webhook_hosts_are_judged_as_the_client_dials_them(url):
    with pytest.raises(InvalidRequest) as e:
        check_url(url.format(port=8199), [])
    assert e.value.param == "webhook"


def test_public_webhook_hosts_and_the_allow_list_after_normalising():
    for url in ("https://hooks.example.com/x", "http://ｅｘａｍｐｌｅ.com/", "http://[2606:4700::1111]/",
                "http://[64:ff9b::808:808]/", "http://bücher.example/hook"):  # fmt: skip
        check_url(url, [])
    # An allow-list names hosts as the client dials them: the fullwidth form is the same host.
    check_url("http://１２７.0.0.1:8199/", ["127.0.0.1"])
    with pytest.raises(InvalidRequest):
        check_url("http://127.0.0.2:8199/", ["127.0.0.1"])


def test_a_literal_address_is_refused_when_the_call_is_made_too():
    """aiohttp dials an address literal without asking the resolver: `post` judges it itself
    (a record written before this check, or an allow-list removed since, cannot reach inside)."""
    rx = Receiver()
    try:
        port = int(rx.url.rsplit(":", 1)[1].split("/")[0])
        for form in (
            "http://１２７.0.0.1:{port}/",
            "http://[::ffff:127.0.0.1]:{port}/",
            "http://127.0.0.1:{port}/",
        ):
            status, error = asyncio.run(post(form.format(port=port), b"{}", b"", 5.0, True))
            assert status is None and error, (form, status)
        assert not rx.calls, rx.calls
        assert asyncio.run(post(rx.url, b"{}", b"", 5.0, False))[0] == 204  # the allow-list's way
    finally:
        rx.close()


def test_odd_bytes_in_a_link_signature_an_adapter_path_and_a_prompt():
    from serve_app.formats.lora import check_adapter_file
    from serve_app.ingress.checks import validation_to_error
    from serve_app.jobs import signature_ok
    from serve_app.schemas import ImagesGenerationRequest

    assert signature_ok(b"k", "res_x/0.png", int(time.time()) + 60, "\u00e9") is False
    with pytest.raises(InvalidRequest) as e:
        check_adapter_file("a\x00b.safetensors", ["/tmp"], 1)
    assert e.value.param == "path" and "NUL" in e.value.message
    for body, param in (
        ({"prompt": "\ud800"}, "prompt"),
        ({"prompt": "a", "negative_prompt": "x\udfffy"}, "negative_prompt"),
        ({"prompt": "a", "extra": {"eta": "\ud800"}}, "extra"),
        ({"prompt": "a", "user": "\ud83d"}, "user"),
    ):
        with pytest.raises(ValueError) as v:
            ImagesGenerationRequest.model_validate(body)
        err = validation_to_error(v.value.errors())
        assert err.param == param and "Unicode" in err.message, err.message


def test_request_ids_are_per_owner_in_the_replica():
    from serve_app.config import BatchingConfig
    from serve_app.replica.scheduler import Job, Scheduler

    async def run():
        s = Scheduler(BatchingConfig())
        loop = asyncio.get_running_loop()
        a, b = (Job("order-42", [0], "k", 2, loop.create_future(), owner=o) for o in ("a", "b"))
        s.submit(a)
        s.submit(b)  # the same id under another owner: no collision, nothing told
        assert s.abort(["order-42"], "b") == {"order-42": "aborted"}
        assert a.state == "queued" and b.state == "aborted"
        assert s.abort(["order-42"], "c") == {"order-42": "unknown"}
        assert s.find("order-42", "c") == ([], [])
        assert s.abort(["order-42"], None) == {"order-42": "aborted"}  # the admin: anyone's
        assert a.state == "aborted"
        for job in (a, b):
            with pytest.raises(Exception, match="aborted"):
                job.future.result()

    asyncio.run(run())


# --------------------------------------------------------------------------- over HTTP


def _state(client, prefix, rid, headers):
    return client.get(f"{prefix}/v1/requests/{rid}", headers=headers)


@pytest.mark.slow
def test_webhooks_to_inside_are_refused_on_generations_and_edits(keyed_app, client):
    rx = Receiver()
    try:
        port = int(rx.url.rsplit(":", 1)[1].split("/")[0])
        for url in INSIDE:
            hook = url.format(port=port)
            r = client.post(keyed_app + GEN, json={"prompt": "a", "webhook": hook}, headers={**A, **ASYNC})
            assert r.status_code == 400 and r.json()["error"]["param"] == "webhook", (hook, r.text)
            r = client.post(
                f"{keyed_app}/v1/images/edits",
                files={"image": ("a.png", png(), "image/png")},
                data={"prompt": "a", "webhook": hook},
                headers={**A, **ASYNC},
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == "webhook", (hook, r.text)
        time.sleep(0.5)
        assert not rx.calls, rx.calls
    finally:
        rx.close()


@pytest.mark.slow
def test_another_callers_requests_and_jobs_are_unknown_to_them(keyed_app, client):
    def send(key, rid, prompt, **more):
        body = {"prompt": prompt, "num_inference_steps": 40, "request_id": rid, **more}
        t = threading.Thread(target=lambda: answers.update({(rid, prompt): post(key, body)}))
        t.start()
        return t

    def post(key, body):
        return httpx.post(client.base_url.join(keyed_app + GEN), json=body, headers=key, timeout=120)

    def state(rid, key):
        return _state(client, keyed_app, rid, key).json().get("state")

    answers: dict = {}
    threads = [send(A, "order-42", f"mine {SLOW}")]
    try:
        wait_for(lambda: state("order-42", A) == "running", 60, 0.1)
        r = _state(client, keyed_app, "order-42", B)
        assert r.status_code == 404 and r.json()["error"]["param"] == "request_id", r.text
        unknown = _state(client, keyed_app, "no-such-id", B).json()["error"]["message"]
        assert r.json()["error"]["message"] == unknown.replace("no-such-id", "order-42")
        for method, path in (("POST", "/v1/requests/order-42/abort"), ("DELETE", "/v1/requests/order-42")):
            r = client.request(method, keyed_app + path, headers=B)
            assert r.status_code == 200 and r.json()["result"] == "unknown", r.text
        # B may use the same id for its own request: ids are per caller, and none collides
        # (another size: it waits behind A's call instead of sharing it).
        threads.append(send(B, "order-42", "theirs", size="40x40", num_inference_steps=2))
        wait_for(lambda: state("order-42", B) == "queued", 60, 0.1)
        assert state("order-42", A) == "running" and state("order-42", ADMIN) == "running"  # the admin: any
        r = client.post(f"{keyed_app}/v1/requests/order-42/abort", headers=A)  # A's own: B's runs on
        assert r.json()["result"] == "aborted", r.text
        # The admin aborts anyone's request.
        threads.append(send(A, "order-43", f"again {SLOW}"))
        wait_for(lambda: state("order-43", A) == "running", 60, 0.1)
        assert (
            client.post(f"{keyed_app}/v1/requests/order-43/abort", headers=ADMIN).json()["result"]
            == "aborted"
        )
    finally:
        for t in threads:
            t.join(120)
    assert answers[("order-42", f"mine {SLOW}")].status_code == 499
    assert answers[("order-42", "theirs")].status_code == 200, answers[("order-42", "theirs")].text
    assert answers[("order-43", f"again {SLOW}")].status_code == 499

    job = client.post(keyed_app + GEN, json={"prompt": f"job {SLOW}", "num_inference_steps": 20},
                      headers={**A, **ASYNC}).json()  # fmt: skip
    rid = job["request_id"]
    wait_for(
        lambda: _state(client, keyed_app, rid, A).status_code == 200, 60, 0.1
    )  # A sees its job's request
    assert client.get(f"{keyed_app}/v1/jobs/{job['id']}", headers=B).status_code == 404
    assert _state(client, keyed_app, rid, B).status_code == 404
    assert client.post(f"{keyed_app}/v1/requests/{rid}/abort", headers=B).json()["result"] == "unknown"
    done = wait_for(
        lambda: j if (j := client.get(f"{keyed_app}/v1/jobs/{job['id']}", headers=A).json())["state"]
        in ("done", "failed", "aborted") else None, 120, 0.2,
    )  # fmt: skip
    assert done["state"] == "done", done


@pytest.mark.slow
def test_odd_bytes_get_a_json_4xx_and_leave_the_replica_alone(keyed_app, client):
    def replica():
        return client.get(f"{keyed_app}/v1/status", headers=A).json()["replicas"][0]

    before = replica()
    as_json = {**A, "content-type": "application/json"}
    link = "/v1/files/res_0123456789abcdef0123456789abcdef/0.png?expires=9999999999&signature=%C3%A9"
    nul, RID = {"name": "nul", "path": "a\x00b.safetensors"}, "X-Request-Id"
    hostile = [
        ("GET", link, {}, 403, "signature"),
        ("POST", GEN, {"content": b'{"prompt": "\\ud800"}', "headers": as_json}, 400, "prompt"),
        ("POST", "/v1/loras", {"json": nul, "headers": ADMIN}, 400, "path"),
        ("GET", "/health", {"headers": {"X-Request-Id": b"\xff"}}, 400, RID),
        ("POST", GEN, {"json": {"prompt": "a"}, "headers": {**A, "X-Request-Id": b"\xff\xfe"}}, 400, RID),
        ("POST", GEN, {"json": {"prompt": "a"}, "headers": {**A, "X-Request-Id": "r" * 20_000}}, 400, RID),
    ]  # fmt: skip
    for method, path, kwargs, status, param in hostile:
        r = client.request(method, keyed_app + path, **kwargs)
        assert r.status_code == status, (path, r.text[:300])
        assert r.json()["error"]["param"] == param, r.text[:300]
        assert len(r.headers.get("x-request-id", "")) <= 128, r.headers.get("x-request-id", "")[:80]
    ok = client.post(keyed_app + GEN, json={"prompt": "a"}, headers={**A, "X-Request-Id": "fine-1"})
    assert ok.status_code == 200 and ok.headers["x-request-id"] == "fine-1"
    after = replica()
    assert after["replica_id"] == before["replica_id"] and after["healthy"]
    assert after["counts"].get("failed", 0) == before["counts"].get("failed", 0), (before, after)


@pytest.mark.slow
def test_a_client_that_goes_away_is_counted_aborted_once(keyed_app, client):
    def aborted():
        return (
            client.get(f"{keyed_app}/v1/status", headers=A).json()["replicas"][0]["counts"].get("aborted", 0)
        )

    before = aborted()
    body = {"prompt": f"leaving {SLOW}", "num_inference_steps": 40, "request_id": "leaving-1"}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(client.base_url.join(keyed_app + GEN), json=body, headers=A, timeout=3.0)  # of 4 s
    wait_for(lambda: _state(client, keyed_app, "leaving-1", A).json().get("state") == "aborted", 30, 0.1)
    time.sleep(0.5)
    assert aborted() == before + 1


@pytest.mark.slow
def test_jobs_are_bounded_and_a_backlog_leaves_room_for_plain_requests(keyed_app, client):
    slow = {"prompt": f"backlog {SLOW}", "num_inference_steps": 50}  # 5 s a call
    per_caller, overall = KEYED_JOBS["max_queued_per_caller"], KEYED_JOBS["max_queued"]
    ids = []
    try:
        for _ in range(per_caller):
            r = client.post(keyed_app + GEN, json=slow, headers={**A, **ASYNC})
            assert r.status_code == 202, r.text
            ids.append((A, r.json()["id"]))
        r = client.post(keyed_app + GEN, json=slow, headers={**A, **ASYNC})
        assert r.status_code == 429 and r.headers["Retry-After"], r.text
        assert "max_queued_per_caller" in r.json()["error"]["message"]
        for _ in range(overall - per_caller):
            r = client.post(keyed_app + GEN, json=slow, headers={**B, **ASYNC})
            assert r.status_code == 202, r.text
            ids.append((B, r.json()["id"]))
        r = client.post(keyed_app + GEN, json=slow, headers={**B, **ASYNC})
        assert r.status_code == 429 and "jobs.max_queued" in r.json()["error"]["message"], r.text
        # Only `max_running` of the jobs are in the replica: a plain request waits behind those
        # alone, and the probes answer.
        assert client.get(f"{keyed_app}/health").status_code == 200
        status = client.get(f"{keyed_app}/v1/status", headers=B).json()
        queued = sum(r["queued_requests"] + r["running_requests"] for r in status["replicas"])
        assert queued <= KEYED_JOBS["max_running"], status
        waiting = [client.get(f"{keyed_app}/v1/jobs/{i}", headers=k).json() for k, i in ids]
        held = [j for j in waiting if j["state"] == "queued" and j["queue_position"] is None]
        assert len(held) >= len(ids) - KEYED_JOBS["max_running"], waiting  # held in the ingress
        plain = client.post(keyed_app + GEN, json={"prompt": "plain", "num_inference_steps": 2}, headers=B)
        assert plain.status_code == 200, plain.text
    finally:
        for key, job_id in ids:
            r = client.delete(f"{keyed_app}/v1/jobs/{job_id}", headers=key)
            assert r.status_code == 200, r.text
    r = client.post(keyed_app + GEN, json=slow | {"num_inference_steps": 2}, headers={**A, **ASYNC})
    assert r.status_code == 202, r.text  # room again once they ended
    client.delete(f"{keyed_app}/v1/jobs/{r.json()['id']}", headers=A)
