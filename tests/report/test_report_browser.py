"""report.html in a real headless Chromium: it loads without console errors, shows every image
and lists the planted anomaly."""

import os
import shutil
import subprocess

import numpy as np
import pytest
from PIL import Image
from report_page import PLANTED_MODULE, read_page

from diffusion_debug.report import write_html

TIMEOUT_S = 60
# One worker installs and runs Chromium: two workers of pytest -n 2 would race for apt's lock.
pytestmark = pytest.mark.xdist_group("chromium")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--enable-logging=stderr",
    "--v=0",
]


def _find_chromium():
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found, ""
    if not (hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get")):
        return None, "not root or no apt-get"
    try:
        done = subprocess.run(
            # A fresh machine may still be running its own apt jobs: wait for the lock, not fail on it.
            ["apt-get", "-o", "DPkg::Lock::Timeout=240", "install", "-y", "--no-install-recommends", "chromium"],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return None, f"apt-get install chromium failed: {error}"
    found = shutil.which("chromium")
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
    return found, "" if found else f"apt-get install chromium: {tail[0]}"


@pytest.fixture(scope="module")
def chromium():
    path, reason = _find_chromium()
    if path is None:
        pytest.skip(f"chromium is not installed and could not be installed: {reason}")
    return path


def _run(chromium, profile, *args):
    return subprocess.run(
        [chromium, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, text=True, timeout=TIMEOUT_S
    )


@pytest.fixture(scope="module")
def browsed(chromium, inference_run_dir, tmp_path_factory):
    """Chromium's screenshot and DOM of the planted-Inf inference report."""
    report = write_html(inference_run_dir)
    work = tmp_path_factory.mktemp("chromium")
    url = report.resolve().as_uri()
    screenshot = work / "report.png"
    shot = _run(chromium, work / "profile-shot", f"--screenshot={screenshot}", "--window-size=1280,2400", url)
    dom = _run(chromium, work / "profile-dom", "--dump-dom", url)
    return {"report": report, "screenshot": screenshot, "shot": shot, "dom": dom}


def _console_messages(stderr):
    # Chromium logs console.error() and uncaught exceptions as "INFO:CONSOLE" lines (no "ERROR" in
    # them), so matching on "ERROR" alone misses them; the page has no script, so any console
    # line at all is a problem.
    return [line for line in stderr.splitlines() if "CONSOLE" in line]


def test_console_check_sees_errors(chromium, tmp_path):
    page = tmp_path / "bad.html"
    page.write_text("<script>console.error('boom'); undefinedFunction();</script>", encoding="utf-8")
    done = _run(chromium, tmp_path / "profile", "--dump-dom", page.as_uri())
    messages = _console_messages(done.stderr)
    assert any("boom" in m for m in messages) and any("Uncaught ReferenceError" in m for m in messages)


def test_page_loads_without_console_errors(browsed):
    for name in ("shot", "dom"):
        done = browsed[name]
        assert done.returncode == 0, done.stderr[-2000:]
        assert _console_messages(done.stderr) == []


def test_dom_lists_the_planted_anomaly(browsed):
    page = read_page(browsed["dom"].stdout)
    assert page.section_order[0] == "anomalies"
    assert PLANTED_MODULE in page.section_text["anomalies"]


def test_dom_has_every_image_of_the_file(browsed):
    in_dom = read_page(browsed["dom"].stdout).images
    in_file = read_page(browsed["report"].read_text(encoding="utf-8")).images
    assert len(in_dom) == len(in_file) >= 5
    assert [i.src for i in in_dom] == [i.src for i in in_file]


def test_screenshot_is_not_blank(browsed):
    image = Image.open(browsed["screenshot"])
    assert image.size == (1280, 2400)
    pixels = np.asarray(image.convert("L"), dtype=float)
    assert pixels.var() > 0
    # the red of the error verdict near the top: the page rendered its styles, not raw text
    top = np.asarray(image.convert("RGB"))[:400]
    assert ((top[..., 0] > 240) & (top[..., 1] < 240) & (top[..., 2] < 240)).any()
