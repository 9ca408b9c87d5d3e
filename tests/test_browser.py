"""The real thing: `hdet-track dashboard` in headless Chromium (Debian's, driven by Playwright).

Skipped only where no Chromium is installed; `.ci/run` installs it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from .servers import free_port

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed")

PAGES = {
    "": "Runs",
    "fanout": "Fan-out",
    "converge": "Converge",
    "controller": "Controller drift",
    "compare": "Compare",
    "export": "Export the discovered schedule",
}

JOB = textwrap.dedent(
    """
    import sys, time, torch, torch.distributed as dist
    from hdet_track import HDETScheduler
    from hdet_track.tracking.mlflow import MLflowTracker
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = HDETScheduler(opt, 0.1, total_steps=int(sys.argv[2]), sync_every=5, auto_lr=True, spread=0.2,
                          track=MLflowTracker(tracking_uri=sys.argv[1], experiment="hdet", run_name=sys.argv[3],
                                              chunk_seconds=0.5))
    for k in range(int(sys.argv[2])):
        opt.step(); sched.step(1.0 / (k + 1))
        time.sleep(float(sys.argv[4]))
    """
)


def start_dashboard(source: str, port: int) -> subprocess.Popen:
    cli = Path(sys.executable).with_name("hdet-track")
    proc = subprocess.Popen(
        [str(cli), "dashboard", source, "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 180  # a loaded machine takes a while to import Streamlit
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    os.killpg(proc.pid, 9)  # the CLI and its Streamlit server
    raise TimeoutError(proc.stdout.read().decode()[-2000:] if proc.stdout else "dashboard did not start")


@pytest.fixture
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


def test_every_page_renders_charts_and_live_steps_appear(tmp_path, browser):
    uri = f"sqlite:///{tmp_path / 'browser.db'}"
    script = tmp_path / "job.py"
    script.write_text(JOB)
    subprocess.run([sys.executable, str(script), uri, "40", "finished", "0"], check=True, timeout=120)
    # open-ended (stopped below): it must still be running when the pages are loaded, however slowly
    live = subprocess.Popen([sys.executable, str(script), uri, "100000", "live", "0.05"], start_new_session=True)
    port = free_port()
    dash = start_dashboard(uri, port)
    try:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        for path, header in PAGES.items():
            page.goto(f"http://127.0.0.1:{port}/{path}")
            page.get_by_role("heading", name=header).wait_for(timeout=30_000)
            if path not in ("", "export"):
                page.locator(".js-plotly-plot").first.wait_for(timeout=30_000)
            page.wait_for_timeout(1000)
            assert page.locator('[data-testid="stException"]').count() == 0, path
            page.screenshot(path=str(tmp_path / f"page-{path or 'runs'}.png"), full_page=True)
        # Live: the selected (newest) run is the running one; its step counter moves by itself.
        page.goto(f"http://127.0.0.1:{port}/fanout")
        caption = page.get_by_text("LIVE: step")
        caption.wait_for(timeout=30_000)
        first = int(caption.inner_text().split("step")[1])
        deadline = time.monotonic() + 30.0  # the page refreshes every 2 s: a loaded machine is slower
        later = first
        while time.monotonic() < deadline and later <= first:
            page.wait_for_timeout(250)
            later = int(page.get_by_text("LIVE: step").inner_text().split("step")[1])
        assert later > first, "a step logged by training did not appear within 30 s"
        page.screenshot(path=str(tmp_path / "live.png"), full_page=True)
    finally:
        os.killpg(live.pid, 9)  # the job and its tracking writer's process
        live.wait()
        os.killpg(dash.pid, 9)


def test_port_in_use_is_a_clear_error(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        cli = Path(sys.executable).with_name("hdet-track")
        proc = subprocess.run(
            [str(cli), "dashboard", f"sqlite:///{tmp_path / 'x.db'}", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 2 and f"127.0.0.1:{port}" in proc.stderr and "--port" in proc.stderr
