"""The widgets in a real browser: JupyterLab on localhost, driven by headless Chromium.

Starts ``jupyter lab`` (random free port on 127.0.0.1, no token, a temporary root holding
one notebook, isolated config/settings/runtime dirs), opens the notebook in Debian's
``chromium`` through Playwright's Python API (``executable_path``: no browser download), and
runs, on the simulator:

1. ``%load_ext cudalab`` and ``%cuda_memory dashboard`` (falling back to
   ``MemoryDashboard()`` when the magics cannot provide it); the DOM must show the simulated
   device names and numbers, and they must change between two ticks; an allocation made in
   a later cell must reach the dashboard while the kernel is idle (the sampler thread pushes);
2. a 10k-block ``SnapshotViewer``: the segment map must be in the DOM at most
   ``CUDALAB_VIEWER_BUDGET_S`` (1.0) seconds after the cell is started.

Screenshots go to ``test-artifacts/`` at the repository root. Skips with the reason when
chromium (``CUDALAB_CHROMIUM``, default /usr/bin/chromium), playwright or jupyterlab is
missing; ``.ci/run`` installs them.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = os.environ.get("CUDALAB_CHROMIUM", "/usr/bin/chromium")
BUDGET_S = float(os.environ.get("CUDALAB_VIEWER_BUDGET_S", "1.0"))


def _requirements() -> None:
    if not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)):
        pytest.skip(f"no chromium at {CHROMIUM} (apt-get install chromium; .ci/run does)")
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install "
                        "'cudalab[browser]')")
    pytest.importorskip("jupyterlab", reason="jupyterlab is not installed (pip install "
                        "'cudalab[browser]')")
    pytest.importorskip("ipykernel", reason="ipykernel is not installed")


CELLS = [
    # 0: the extension (may be missing while the magics are being built)
    "import time, cudalab, cudalab.memory as cm\n"
    "try:\n"
    "    get_ipython().run_line_magic('load_ext', 'cudalab')\n"
    "    LOADED = 'cuda_memory' in get_ipython().magics_manager.magics['line']\n"
    "except Exception as exc:\n"
    "    LOADED = False\n"
    "print('extension loaded' if LOADED else 'extension not loaded')",
    # 1: the dashboard
    "d = None\n"
    "if LOADED:\n"
    "    try:\n"
    "        d = get_ipython().run_line_magic('cuda_memory', 'dashboard')\n"
    "    except Exception as exc:\n"
    "        print('magic failed:', exc)\n"
    "if d is None:\n"
    "    from cudalab.widgets import MemoryDashboard\n"
    "    d = MemoryDashboard()\n"
    "d.interval = 0.25\n"
    "d",
    # 2: allocations the dashboard must show while this cell still runs
    "bufs = []\n"
    "for _ in range(3):\n"
    "    bufs.append(cm.caching_allocator_alloc(256 << 20))\n"
    "    time.sleep(1.0)\n"
    "print('allocated', cm.memory_allocated(0))",
    # 3: a 10k-block snapshot (not timed)
    "from cudalab.widgets import SnapshotViewer\n"
    "from cudalab.widgets.snapshot_viewer import _demo_snapshot\n"
    "snap = _demo_snapshot(10_000)\n"
    "print('snapshot ready')",
    # 4: the viewer (timed)
    "v = SnapshotViewer(snap)\n"
    "v",
]


def _notebook() -> dict:
    return {
        "cells": [{"cell_type": "code", "execution_count": None, "id": f"cell{i}", "metadata": {},
                   "outputs": [], "source": src} for i, src in enumerate(CELLS)],
        "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python",
                                    "name": "python3"}},
        "nbformat": 4, "nbformat_minor": 5,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab(tmp_path):
    _requirements()
    root = tmp_path / "root"
    root.mkdir()
    (root / "dash.ipynb").write_text(json.dumps(_notebook()))
    settings = tmp_path / "settings"
    for ext, name, value in (
        ("@jupyterlab/notebook-extension", "tracker", {"windowingMode": "none"}),
        ("@jupyterlab/apputils-extension", "notification",
         {"fetchNews": "false", "checkForUpdates": False}),
    ):
        (settings / ext).mkdir(parents=True, exist_ok=True)
        (settings / ext / f"{name}.jupyterlab-settings").write_text(json.dumps(value))
    port = _free_port()
    env = dict(os.environ, CUDALAB_SIMULATOR="1", JUPYTER_CONFIG_DIR=str(tmp_path / "cfg"),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "rt"), PYTHONPATH=os.pathsep.join(
                   [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    log = open(tmp_path / "lab.log", "w")  # noqa: SIM115 - closed below
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
           "--IdentityProvider.token=", "--ServerApp.password=",
           "--ServerApp.disable_check_xsrf=True", f"--ServerApp.root_dir={root}",
           f"--LabApp.user_settings_dir={settings}",
           f"--LabApp.workspaces_dir={tmp_path / 'ws'}",
           "--LabApp.news_url=", "--LabApp.extension_manager=readonly",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail("jupyter lab exited:\n" + (tmp_path / "lab.log").read_text()[-3000:])
            try:
                with urllib.request.urlopen(f"{url}/api/status", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("jupyter lab did not start:\n" + (tmp_path / "lab.log").read_text()[-3000:])
            time.sleep(0.3)
        yield url, tmp_path
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


def _data(page, selector: str, attr: str, nth: int = 0) -> int:
    return int(page.locator(selector).nth(nth).get_attribute(f"data-{attr}"))


def test_dashboard_and_viewer_in_jupyterlab(lab):
    from playwright.sync_api import sync_playwright

    url, tmp = lab
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.set_default_timeout(int(os.environ.get("CUDALAB_BROWSER_TIMEOUT_MS", "45000")))
            page.goto(f"{url}/lab/tree/dash.ipynb")
            page.wait_for_selector(".jp-Notebook .jp-Cell .cm-content")
            # the kernel must be connected and idle, or Shift+Enter only moves the selection
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']",
                                   state="attached")

            def run_cell(wait_text: str | None = None) -> None:
                page.keyboard.press("Shift+Enter")
                if wait_text:
                    page.wait_for_selector(f".jp-OutputArea-output:has-text('{wait_text}')")

            # "idle" shows before the kernel's websocket is ready, and a cell run before that
            # is not executed: run the first cell until its prompt shows it ran
            first = page.locator(".jp-Notebook .jp-Cell").first
            for _ in range(20):
                first.locator(".cm-content").click()
                run_cell()
                try:
                    page.wait_for_function(
                        "document.querySelector('.jp-Notebook .jp-Cell .jp-InputPrompt')"
                        ".innerText.match(/\\[[0-9*]+\\]/) !== null", timeout=3000)
                    break
                except Exception:
                    continue
            page.wait_for_selector(".jp-OutputArea-output:has-text('extension')")
            loaded = page.locator(".jp-OutputArea-output:has-text('extension loaded')").count() > 0
            run_cell()  # the dashboard
            page.wait_for_selector(".cudalab-memory-dashboard .cudalab-dash-mem")
            dash = page.locator(".cudalab-memory-dashboard")
            text1 = dash.inner_text()
            assert "simulated" in text1, text1
            names = page.locator(".cudalab-dash-title").all_inner_texts()
            assert names and all(re.search(r"cuda:\d .*simulated", n) for n in names), names
            assert re.search(r"allocated \d+(\.\d)? (B|KiB|MiB|GiB)", text1), text1
            assert re.search(r"\d+ °C", text1) and re.search(r"SM \d+ MHz", text1), text1
            # two ticks apart: the sample counter and the clock move (pushed by the thread)
            s1 = _data(page, ".cudalab-dash-status", "samples")
            page.wait_for_function(
                f"Number(document.querySelector('.cudalab-dash-status').dataset.samples) >= {s1 + 2}",
                timeout=15_000)
            text2 = dash.inner_text()
            assert text2 != text1
            # allocations made by a running cell show up before the cell ends (the thread
            # pushes while the kernel's main thread is busy)
            a1 = _data(page, ".cudalab-dash-mem", "allocated")
            run_cell()
            page.wait_for_function(
                f"Number(document.querySelector('.cudalab-dash-mem').dataset.allocated) >= {a1 + (512 << 20)}",
                timeout=15_000)
            alloc_out = page.locator(".jp-Notebook .jp-Cell").nth(2).locator(".jp-OutputArea-output")
            assert alloc_out.count() == 0, "the dashboard only moved after the cell had finished"
            alloc_out.filter(has_text="allocated").wait_for()
            page.wait_for_function(
                f"Number(document.querySelector('.cudalab-dash-mem').dataset.allocated) >= {a1 + (768 << 20)}",
                timeout=15_000)
            assert "768" in dash.inner_text() or "GiB" in dash.inner_text()
            dash.screenshot(path=str(ARTIFACTS / "browser_dashboard.png"))

            run_cell("snapshot ready")
            # time from starting the viewer cell to its segment map in the DOM
            page.evaluate("""() => {
                window.__segmap = null;
                new MutationObserver((_, obs) => {
                    if (document.querySelector('svg.cudalab-segmap')) {
                        window.__segmap = performance.now(); obs.disconnect();
                    }
                }).observe(document.body, {childList: true, subtree: true});
                window.__t0 = performance.now();
            }""")
            run_cell()
            page.wait_for_function("window.__segmap !== null", timeout=30_000)
            elapsed = page.evaluate("(window.__segmap - window.__t0) / 1000")
            blocks = _data(page, "svg.cudalab-segmap", "blocks")
            assert blocks >= 10_000
            viewer = page.locator(".cudalab-snapshot-viewer")
            viewer.screenshot(path=str(ARTIFACTS / "browser_snapshot_viewer.png"))
            (ARTIFACTS / "browser_timings.json").write_text(json.dumps(
                {"viewer_first_render_s": elapsed, "blocks": blocks, "extension_loaded": loaded}))
            assert elapsed <= BUDGET_S, f"SnapshotViewer first render took {elapsed:.2f} s"
        except Exception:
            for pg in browser.contexts[0].pages if browser.contexts else ():
                pg.screenshot(path=str(ARTIFACTS / "browser_failure.png"))
            shutil.copy(tmp / "lab.log", ARTIFACTS / "browser_failure_lab.log")
            raise
        finally:
            browser.close()
