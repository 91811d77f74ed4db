"""The `diffusion-serve` console script against the shared app, as a user runs it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from PIL import Image

from tests.conftest import free_port

EXE = shutil.which("diffusion-serve", path=str(Path(sys.executable).parent)) or "diffusion-serve"


def run(*args, url):
    return subprocess.run([EXE, "--url", url, *args], capture_output=True, text=True, timeout=120)


def test_generate_with_progress_bar_writes_the_image(base_url, tmp_path):
    out = tmp_path / "cat.png"
    r = run(
        "generate", "a cat", "-o", str(out), "--steps", "5", "--seed", "3", "--size", "48x32", url=base_url
    )
    assert r.returncode == 0, r.stderr
    assert "5/5 steps" in r.stderr and "seed 3" in r.stdout
    assert Image.open(out).size == (48, 32)
    r = run("generate", "two", "-o", str(tmp_path / "two.png"), "-n", "2", "-q", url=base_url)
    assert r.returncode == 0 and (tmp_path / "two-0.png").exists() and (tmp_path / "two-1.png").exists()


def test_acceleration_from_the_command_line(base_url, tmp_path):
    import base64

    import httpx

    out = tmp_path / "fast.png"
    r = run("generate", "a fast cat", "--steps", "8", "--seed", "4", "--acceleration", "fast", "-o", str(out),
            "-q", url=base_url)  # fmt: skip
    assert r.returncode == 0, r.stderr
    body = {"prompt": "a fast cat", "num_inference_steps": 8, "seed": 4}
    fast = httpx.post(f"{base_url}/v1/images/generations", json={**body, "acceleration": "fast"}, timeout=60)
    plain = httpx.post(f"{base_url}/v1/images/generations", json=body, timeout=60)
    assert out.read_bytes() == base64.b64decode(fast.json()["data"][0]["b64_json"])
    assert out.read_bytes() != base64.b64decode(plain.json()["data"][0]["b64_json"])


def test_async_jobs_from_the_command_line(base_url, tmp_path):
    out = tmp_path / "job.png"
    r = run("generate", "a job", "--async", "--steps", "4", "--seed", "8", "-o", str(out), url=base_url)
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.split()[0]
    assert job_id.startswith("job_") and "jobs wait" in r.stdout
    r = run("jobs", "wait", job_id, "-o", str(out), url=base_url)
    assert r.returncode == 0 and "4/4 steps" in r.stderr and f"seed 8  ({job_id})" in r.stdout, r.stderr
    assert Image.open(out).size == (32, 32)
    listed = run("jobs", "list", "--limit", "100", url=base_url)
    assert f"{job_id}  done" in listed.stdout
    assert '"state": "done"' in run("jobs", "get", job_id, url=base_url).stdout
    assert f"deleted {job_id}" in run("jobs", "rm", job_id, url=base_url).stdout
    gone = run("jobs", "get", job_id, url=base_url)
    assert gone.returncode == 1 and "server answered 404" in gone.stderr


def test_edit_and_inpaint_an_image_file(base_url, tmp_path):
    src, mask = tmp_path / "in.png", tmp_path / "mask.png"
    Image.new("RGB", (48, 40), (200, 30, 30)).save(src)
    m = Image.new("RGBA", (48, 40), (0, 0, 0, 255))
    m.paste((0, 0, 0, 0), (0, 0, 24, 40))
    m.save(mask)
    out = tmp_path / "edited.png"
    r = run("edit", str(src), "blue", "-o", str(out), "--steps", "4", "--strength", "0.5", url=base_url)
    assert r.returncode == 0, r.stderr
    assert "2/2 steps" in r.stderr and Image.open(out).size == (48, 40)  # half of 4 steps, its size
    inpainted = tmp_path / "inpaint.png"
    r = run("edit", str(src), "a cat", "--mask", str(mask), "-o", str(inpainted), "-q", url=base_url)
    assert r.returncode == 0, r.stderr
    r = run("edit", str(tmp_path / "missing.png"), "x", url=base_url)
    assert r.returncode == 1 and "cannot read the image" in r.stderr and "Traceback" not in r.stderr


def test_stacked_adapters_from_the_command_line(base_url, tmp_path):
    from serve_app.tools.lora import make_adapter
    from tests.conftest import ADAPTER_DIR

    for name, seed in (("cli-a", 21), ("cli-b", 22)):
        path = make_adapter(str(ADAPTER_DIR / f"{name}.safetensors"), seed=seed)
        assert run("lora", "add", name, str(path), url=base_url).returncode == 0
    try:
        outs = []
        for loras in (["cli-a:0.7", "cli-b"], ["cli-b", "cli-a:0.7"]):
            out = tmp_path / f"{len(outs)}.png"
            args = [x for spec in loras for x in ("--lora", spec)]
            r = run("generate", "x", "--seed", "4", "-o", str(out), "-q", *args, url=base_url)
            assert r.returncode == 0, r.stderr
            outs.append(out.read_bytes())
        assert outs[0] == outs[1]  # the order they are listed in does not matter
        r = run("generate", "x", "--lora", "cli-a:lots", "-o", str(tmp_path / "bad.png"), url=base_url)
        assert r.returncode == 1 and "must be a number" in r.stderr
    finally:
        for name in ("cli-a", "cli-b"):
            run("lora", "rm", name, url=base_url)


def test_status_and_lora_list(base_url):
    r = run("status", url=base_url)
    assert r.returncode == 0 and "healthy" in r.stdout and "model tiny-sd" in r.stdout
    r = run("lora", "list", url=base_url)
    assert r.returncode == 0, r.stderr


def test_clear_messages_on_errors(base_url, tmp_path):
    r = run("generate", "x", "--size", "13x13", "-o", str(tmp_path / "x.png"), url=base_url)
    assert r.returncode == 1 and "server answered 400" in r.stderr and "multiple of 8" in r.stderr
    r = run("lora", "rm", "no-such", url=base_url)
    assert r.returncode == 1 and "404" in r.stderr
    down = f"http://127.0.0.1:{free_port()}"
    r = run("status", url=down)
    assert r.returncode == 1 and "cannot reach the server" in r.stderr and "Traceback" not in r.stderr
