"""The playground page in headless Chromium (Debian's `chromium`, driven by Playwright) on loopback."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


def chromium() -> str:
    """Debian's Chromium: found on the PATH, or installed here (root with apt, as on the
    project's machines and CI), so that the README's test command is the whole set-up."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found or os.geteuid() != 0 or not shutil.which("apt-get"):
        return found
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], env=env, check=False, capture_output=True)
    subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], env=env, check=False, capture_output=True)
    return shutil.which("chromium")


ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip


@pytest.fixture(scope="module")
def page(app):
    executable = chromium()
    if executable is None:
        pytest.fail(
            "no Chromium, and it cannot be installed here: install Debian's chromium "
            "(apt-get install chromium)"
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=ARGS)
        yield browser.new_page()
        browser.close()


def test_generate_shows_progress_and_the_image(page, base_url, client):
    page.goto(base_url + "/")
    page.wait_for_function("document.getElementById('model').textContent.includes('tiny-sd')")
    page.fill("#prompt", "a red fox in the browser")
    page.fill("#steps", "6")
    page.fill("#seed", "5")
    page.click("#generate")
    page.wait_for_function("!document.getElementById('result').hidden", timeout=60_000)
    src = page.get_attribute("#result", "src")
    assert src.startswith("data:image/png;base64,")
    assert page.eval_on_selector("#bar", "b => [b.value, b.max]") == [6, 6]
    assert page.get_attribute("#preview", "src").startswith("data:image/png;base64,")
    assert "seed 5" in page.text_content("#status")
    body = {"prompt": "a red fox in the browser", "num_inference_steps": 6, "seed": 5}
    same = client.post("/v1/images/generations", json=body).json()
    assert src.split(",", 1)[1] == same["data"][0]["b64_json"]
    # The speed menu asks for step caching.
    page.select_option("#acceleration", "faster")
    page.click("#generate")
    page.wait_for_function(f"document.getElementById('result').src !== {src!r}", timeout=60_000)
    fast = client.post("/v1/images/generations", json={**body, "acceleration": "faster"}).json()
    assert page.get_attribute("#result", "src").split(",", 1)[1] == fast["data"][0]["b64_json"]


def test_cancel_aborts_a_long_generation(page, base_url, client):
    page.goto(base_url + "/")
    page.fill("#prompt", "a long one from the browser")
    page.fill("#size", "128x128")
    page.fill("#steps", "40")
    page.click("#generate")
    page.wait_for_function("document.getElementById('bar').value >= 1", timeout=60_000)
    page.click("#cancel")
    page.wait_for_function("document.getElementById('status').textContent === 'aborted'", timeout=30_000)
    assert page.is_hidden("#result")
    assert page.text_content("#error") == ""


def test_edit_an_uploaded_image_with_a_mask(page, base_url, tmp_path):
    from PIL import Image

    src, mask = tmp_path / "photo.png", tmp_path / "mask.png"
    Image.new("RGB", (48, 40), (30, 120, 200)).save(src)
    m = Image.new("RGBA", (48, 40), (0, 0, 0, 255))
    m.paste((0, 0, 0, 0), (0, 0, 24, 40))
    m.save(mask)
    page.goto(base_url + "/")
    page.fill("#prompt", "paint a boat on the left")
    page.fill("#steps", "8")
    page.fill("#size", "")
    page.set_input_files("#image", str(src))
    page.set_input_files("#mask", str(mask))
    page.fill("#strength", "0.5")
    page.click("#generate")
    page.wait_for_function("!document.getElementById('result').hidden", timeout=60_000)
    assert page.eval_on_selector("#bar", "b => [b.value, b.max]") == [4, 4]  # half of 8 steps
    natural = "i => i.decode().then(() => [i.naturalWidth, i.naturalHeight])"
    size = page.eval_on_selector("#result", natural)
    assert size == [48, 40]  # an edit keeps the image's size
    assert page.text_content("#error") == ""
    # Several images are sent as reference images: this model takes one, and the page says so.
    page.set_input_files("#mask", [])
    page.set_input_files("#image", [str(src), str(src)])
    page.click("#generate")
    page.wait_for_function("document.getElementById('error').textContent !== ''", timeout=60_000)
    assert "image: 2 images" in page.text_content("#error") and "takes one" in page.text_content("#error")


def test_submit_a_job_and_see_it_in_recent_jobs(page, base_url, client):
    page.goto(base_url + "/")
    page.fill("#prompt", "a job from the browser")
    page.fill("#steps", "3")
    page.fill("#seed", "9")
    before = [j["id"] for j in client.get("/v1/jobs", params={"limit": 1000}).json()["data"]]
    page.click("#submit-job")
    # Our job is the row that was not there before (other tests' jobs may be listed too).
    job_id = page.wait_for_function(
        """(before) => {
            const rows = [...document.querySelectorAll('#jobs tbody tr')];
            const row = rows.find(r => !before.includes(r.dataset.id));
            const img = row && row.dataset.state === 'done' && row.querySelector('img');
            return img && img.naturalWidth === 32 ? row.dataset.id : null;
        }""",
        arg=before,
        timeout=60_000,
    ).json_value()
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["state"] == "done" and job["outputs"][0]["seed"] == 9
    page.click(f"#jobs tbody tr[data-id={job_id}] button")
    page.wait_for_function(f"!document.querySelector('#jobs tbody tr[data-id={job_id}]')", timeout=10_000)
    assert client.get(f"/v1/jobs/{job_id}").status_code == 404
