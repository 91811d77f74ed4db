"""`python -m serve_app.check`: a model checked before it is deployed, as a user runs it."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import av
import pytest
from PIL import Image


def run_check(*args: str) -> subprocess.CompletedProcess:
    """As a user runs it: a process of its own."""
    return subprocess.run(
        [sys.executable, "-m", "serve_app.check", *args], capture_output=True, text=True, timeout=300
    )


def check_here(capsys, *args: str) -> tuple[int, str, str]:
    """The same command in this process (saves the seconds of a new interpreter)."""
    from serve_app.tools.check import main

    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_check_reports_a_generation_at_the_native_size(tmp_path, capsys):
    out = tmp_path / "flux.png"
    flux = ("--model", "builtin:tiny-flux", "--steps", "2", "--device", "cpu")
    code, stdout, stderr = check_here(capsys, *flux, "--out", str(out), "--json")
    assert code == 0, stderr
    report = json.loads(stdout)
    assert report["family"] == "flux" and report["size"] == "64x64" and report["steps"] == 2
    assert report["load_s"] > 0 and report["step_ms"] > 0 and report["peak_memory_kind"] == "cpu_rss"
    assert Image.open(out).size == (64, 64)
    again = tmp_path / "again.png"
    check_here(capsys, *flux, "--out", str(again))
    assert again.read_bytes() == out.read_bytes()  # a fixed seed: the same image every time


@pytest.mark.slow
def test_check_writes_a_video_model_s_video(tmp_path):
    out = tmp_path / "boat.mp4"
    p = run_check("--model", "builtin:tiny-wan", "--steps", "2", "--device", "cpu", "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert "modality" in p.stdout and "video" in p.stdout
    with av.open(io.BytesIO(out.read_bytes())) as c:
        assert sum(1 for _ in c.decode(video=0)) == 9


def test_check_of_a_model_that_cannot_load_says_why(tmp_path, capsys):
    code, _, stderr = check_here(capsys, "--model", str(tmp_path), "--device", "cpu")
    assert code == 2 and "has no model_index.json; not a diffusers pipeline" in stderr
    assert "Traceback" not in stderr
