"""The widgets in real front ends, rendered by headless Chromium.

Debian's ``chromium`` is driven through Playwright's Python API (``executable_path``: no browser
download). Three front ends, each on the simulator:

* ``test_dashboard_and_viewer_in_jupyterlab`` and ``test_dashboard_and_viewer_in_notebook7``
  run the same scenario against a live kernel. Each starts its server (``python -m jupyterlab``
  or ``python -m notebook``: random free port on 127.0.0.1, no token, a temporary root holding
  one notebook, isolated config/settings/runtime dirs), checks from the page's own config that
  it is the front end it claims to be, opens the notebook and runs:

  1. ``%load_ext cudalab`` and ``%cuda_memory dashboard`` (falling back to ``MemoryDashboard()``
     when the magics cannot provide it); the DOM must show the simulated device names and
     numbers, and they must change between two ticks; an allocation made in a later cell must
     reach the dashboard while that cell still runs (the sampler thread pushes);
  2. a 10k-block ``SnapshotViewer``: the segment map must be in the DOM at most
     ``CUDALAB_VIEWER_BUDGET_S`` (1.0) seconds after the cell is started.

* ``test_dashboard_and_viewer_in_html_manager`` is the stand-in for VS Code, which cannot be
  installed here. It is **not VS Code**: it renders the widgets with
  ``@jupyter-widgets/html-manager``, the standard ipywidgets 8 widget manager that VS Code's
  Jupyter extension also builds its webview renderer on, fed the widget state that ipywidgets'
  ``embed`` machinery (``dependency_state`` + ``embed_minimal_html``) takes from a live
  ``MemoryDashboard`` and ``SnapshotViewer`` in this process. Two states, before and after an
  allocation the sampler thread has picked up, must render the device names and the numbers
  the Python side had, and differ by the allocation. What it does not cover: VS Code's own
  webview and kernel messaging (the live comm traffic), so updates reach it as re-rendered
  states, not as pushed messages. The bundle (``dist/embed.js``, normally loaded from a CDN
  that these machines cannot reach) is fetched from the npm registry by ``.ci/browser-deps``
  into ``CUDALAB_HTML_MANAGER_DIR`` (default ``~/.cache/cudalab-test/html-manager-1``) and
  served from 127.0.0.1; every request leaving 127.0.0.1 is refused and fails the test.

Screenshots go to ``test-artifacts/`` at the repository root. Each test skips with the reason
when what it needs is missing: chromium (``CUDALAB_CHROMIUM``, default /usr/bin/chromium),
playwright, jupyterlab, notebook, or the html-manager bundle; ``.ci/run`` installs them.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = os.environ.get("CUDALAB_CHROMIUM", "/usr/bin/chromium")
BUDGET_S = float(os.environ.get("CUDALAB_VIEWER_BUDGET_S", "1.0"))
TIMEOUT_MS = int(os.environ.get("CUDALAB_BROWSER_TIMEOUT_MS", "45000"))
HTML_MANAGER_DIR = pathlib.Path(
    os.environ.get("CUDALAB_HTML_MANAGER_DIR")
    or pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
    / "cudalab-test" / "html-manager-1")


def _requirements(*modules: str) -> None:
    if not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)):
        pytest.skip(f"no chromium at {CHROMIUM} (apt-get install chromium; .ci/browser-deps does)")
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install "
                        "'cudalab[browser]')")
    for mod in modules:
        pytest.importorskip(mod, reason=f"{mod} is not installed (pip install 'cudalab[browser]')")


@contextlib.contextmanager
def _chromium() -> Iterator:
    """A headless Debian chromium (Playwright ``Browser``), closed on exit."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM, headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--enable-precise-memory-info",
                  "--disable-background-networking", "--disable-component-update"])
        try:
            yield browser
        finally:
            browser.close()


def _new_page(browser):
    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    page.set_default_timeout(TIMEOUT_MS)
    return page


def _open_notebook(page, url: str, fe: dict) -> dict:
    """Open the test notebook in front end ``fe`` and wait until its kernel is connected and
    idle (else Shift+Enter only moves the selection); the page's Jupyter config data."""
    page.goto(f"{url}{fe['path']}")
    page.wait_for_selector(".jp-Notebook .jp-Cell .cm-content")
    config = json.loads(page.locator("#jupyter-config-data").text_content())
    assert config.get("appName") == fe["app"], config.get("appName")
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']",
                           state="attached")
    return config


def _run_first_cell(page, ran) -> None:
    """Run the notebook's first cell until ``ran()`` (a wait that raises on its timeout)
    sees it ran: the kernel's websocket may not be ready at "idle", and a Shift+Enter then
    is lost (20 tries)."""
    first = page.locator(".jp-Notebook .jp-Cell").first
    for _ in range(20):
        first.locator(".cm-content").click()
        page.keyboard.press("Shift+Enter")
        try:
            ran()
            return
        except Exception:
            continue


def _data(page, selector: str, attr: str, nth: int = 0) -> int:
    return int(page.locator(selector).nth(nth).get_attribute(f"data-{attr}"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _assert_dashboard_text(page, names: list[str] | None = None) -> str:
    """The device names and numbers every front end must show; returns the dashboard's text."""
    text = page.locator(".cudalab-memory-dashboard").first.inner_text()
    assert "simulated" in text, text
    titles = page.locator(".cudalab-dash-title").all_inner_texts()
    assert titles and all(re.search(r"cuda:\d .*simulated", n) for n in titles), titles
    for i, name in enumerate(names or ()):
        assert f"cuda:{i}" in titles[i] and name in titles[i], (titles, names)
    assert re.search(r"allocated \d+(\.\d)? (B|KiB|MiB|GiB)", text), text
    assert re.search(r"\d+ °C", text) and re.search(r"SM \d+ MHz", text), text
    return text


# --------------------------------------------------------------------------- kernel front ends
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
    "from cudalab.widgets.snapshot_viewer import demo_snapshot\n"
    "snap = demo_snapshot(10_000)\n"
    "print('snapshot ready')",
    # 4: the viewer (timed)
    "v = SnapshotViewer(snap)\n"
    "v",
]

# How each server is started and where it opens a notebook. ``app`` is what the page's
# jupyter-config-data must say, so a test cannot pass on the wrong front end.
FRONT_ENDS = {
    "jupyterlab": {
        "module": "jupyterlab", "app": "JupyterLab", "path": "/lab/tree/dash.ipynb",
        "prefix": "browser", "traits": "LabApp",
        "extra": ["--LabApp.news_url=", "--LabApp.extension_manager=readonly",
                  "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
    },
    "notebook7": {
        "module": "notebook", "app": "Jupyter Notebook", "path": "/notebooks/dash.ipynb",
        "prefix": "browser_notebook7", "traits": "JupyterNotebookApp", "extra": [],
    },
}


def _notebook(cells: list[str] | None = None) -> dict:
    return {
        "cells": [{"cell_type": "code", "execution_count": None, "id": f"cell{i}", "metadata": {},
                   "outputs": [], "source": src} for i, src in enumerate(cells or CELLS)],
        "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python",
                                    "name": "python3"}},
        "nbformat": 4, "nbformat_minor": 5,
    }


@contextlib.contextmanager
def _jupyter_server(kind: str, tmp_path: pathlib.Path, cells: list[str] | None = None
                    ) -> Iterator[str]:
    """Start the ``kind`` server (see FRONT_ENDS) on 127.0.0.1 with ``dash.ipynb`` holding
    ``cells`` (default :data:`CELLS`); yields its URL. Its log is ``tmp_path / "server.log"``."""
    fe = FRONT_ENDS[kind]
    root = tmp_path / "root"
    root.mkdir()
    (root / "dash.ipynb").write_text(json.dumps(_notebook(cells)))
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
    log_path = tmp_path / "server.log"
    log = open(log_path, "w")  # noqa: SIM115 - closed below
    app = fe["traits"]
    cmd = [sys.executable, "-m", fe["module"], "--no-browser", "--allow-root",
           "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
           "--IdentityProvider.token=", "--ServerApp.password=",
           "--ServerApp.disable_check_xsrf=True", f"--ServerApp.root_dir={root}",
           f"--{app}.user_settings_dir={settings}", f"--{app}.workspaces_dir={tmp_path / 'ws'}",
           *fe["extra"]]
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"{fe['module']} exited:\n" + log_path.read_text()[-3000:])
            try:
                with urllib.request.urlopen(f"{url}/api/status", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"{fe['module']} did not start:\n" + log_path.read_text()[-3000:])
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


def _kernel_scenario(kind: str, tmp_path: pathlib.Path) -> None:
    """The live-kernel scenario of the module docstring, in the ``kind`` front end."""
    fe = FRONT_ENDS[kind]
    prefix = fe["prefix"]
    ARTIFACTS.mkdir(exist_ok=True)
    with _jupyter_server(kind, tmp_path) as url, _chromium() as browser:
        page = _new_page(browser)
        try:
            config = _open_notebook(page, url, fe)

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
            text1 = _assert_dashboard_text(page)
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
            dash.screenshot(path=str(ARTIFACTS / f"{prefix}_dashboard.png"))

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
            assert "simulated" in viewer.locator(".cudalab-snap-summary").inner_text()
            viewer.screenshot(path=str(ARTIFACTS / f"{prefix}_snapshot_viewer.png"))
            (ARTIFACTS / f"{prefix}_timings.json").write_text(json.dumps(
                {"front_end": f"{config.get('appName')} {config.get('appVersion')}",
                 "viewer_first_render_s": elapsed, "blocks": blocks, "extension_loaded": loaded}))
            assert elapsed <= BUDGET_S, f"SnapshotViewer first render took {elapsed:.2f} s"
        except Exception:
            page.screenshot(path=str(ARTIFACTS / f"{prefix}_failure.png"))
            shutil.copy(tmp_path / "server.log", ARTIFACTS / f"{prefix}_failure_server.log")
            raise


# (Each test runs its scenario with run_lock.alone(): the budgets time a server, its kernel and
# Chromium together, so no other test runs beside them under the README's pytest-xdist workers.)
def test_dashboard_and_viewer_in_jupyterlab(tmp_path, run_lock):
    _requirements("jupyterlab", "ipykernel")
    with run_lock.alone():
        _kernel_scenario("jupyterlab", tmp_path)


def test_dashboard_and_viewer_in_notebook7(tmp_path, run_lock):
    _requirements("notebook", "ipykernel")
    import notebook

    major = int(notebook.__version__.split(".")[0])
    if major < 7:
        pytest.skip(f"notebook {notebook.__version__} is not Notebook 7 (pip install 'notebook>=7')")
    with run_lock.alone():
        _kernel_scenario("notebook7", tmp_path)


# --------------------------------------------------------------------------- html-manager
def _html_manager() -> tuple[pathlib.Path, str]:
    """The html-manager ``dist`` folder and its version; skips when it is missing or not the
    major version that this ipywidgets' own embed URL asks for."""
    from ipywidgets.embed import DEFAULT_EMBED_SCRIPT_URL

    pkg = HTML_MANAGER_DIR / "package"
    if not (pkg / "dist" / "embed.js").is_file():
        pytest.skip(f"no @jupyter-widgets/html-manager at {pkg} (bash .ci/browser-deps fetches it "
                    "with npm; CUDALAB_HTML_MANAGER_DIR overrides the place)")
    version = json.loads((pkg / "package.json").read_text())["version"]
    want = re.search(r"html-manager@\^?(\d+)", DEFAULT_EMBED_SCRIPT_URL)
    if want and version.split(".")[0] != want.group(1):
        pytest.skip(f"html-manager {version} at {pkg}, but this ipywidgets embeds "
                    f"{DEFAULT_EMBED_SCRIPT_URL}")
    return pkg / "dist", version


@contextlib.contextmanager
def _static_server(directory: pathlib.Path) -> Iterator[str]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(directory)))
    t = threading.Thread(target=httpd.serve_forever, name="html-manager-server", daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        t.join(5)


def _wait(cond, timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_dashboard_and_viewer_in_html_manager(tmp_path, run_lock):
    """VS Code's widget renderer, not VS Code: see the module docstring."""
    _requirements()
    dist, version = _html_manager()
    with run_lock.alone():
        _html_manager_scenario(tmp_path, dist, version)


def _html_manager_scenario(tmp_path: pathlib.Path, dist: pathlib.Path, version: str) -> None:
    from ipywidgets.embed import dependency_state, embed_minimal_html

    import cudalab
    import cudalab.memory as cm
    from cudalab.widgets import MemoryDashboard, SnapshotViewer
    from cudalab.widgets.snapshot_viewer import demo_snapshot

    ARTIFACTS.mkdir(exist_ok=True)
    site = tmp_path / "site"
    site.mkdir()
    (site / "html-manager").symlink_to(dist, target_is_directory=True)
    n_dev = cudalab.device_count()
    assert n_dev >= 1
    names = [cudalab.get_device_name(i) for i in range(n_dev)]
    # max_rate above 1/interval: every tick pushes, so the last sample is what the widgets hold
    dash = MemoryDashboard(interval=0.05, max_rate=100)
    viewer = SnapshotViewer(demo_snapshot(2000))
    buf = None
    try:
        with _static_server(site) as base:
            embed_url = f"{base}/html-manager/embed.js"

            def page_of(name: str, views: list) -> tuple[str, dict]:
                """Embed ``views``' state now; returns the page's URL and the Python-side
                values the page must show."""
                with dash._lock:  # one consistent tick: the sampler waits
                    expect = {"latest": dash.latest, "samples": dash._n}
                    state = dependency_state(views, drop_defaults=True)
                embed_minimal_html(site / name, views=views, state=state, requirejs=False,
                                   embed_url=embed_url, title=f"cudalab {name}")
                return f"{base}/{name}", expect

            _wait(lambda: dash._n >= 2, what="two sampler ticks")
            url_a, before = page_of("before.html", [dash, viewer])
            buf = cm.caching_allocator_alloc(256 << 20)
            want = cm.memory_allocated(0)
            # the sampler thread (not this thread) puts the allocation into the widgets
            _wait(lambda: dash.latest[0]["allocated"] == want and dash._n > before["samples"],
                  what="the sampler to see the allocation")
            url_b, after = page_of("after.html", [dash])
            assert after["latest"][0]["allocated"] - before["latest"][0]["allocated"] == 256 << 20

            with _chromium() as browser:
                page = _new_page(browser)
                errors: list[str] = []
                refused: list[str] = []
                page.on("pageerror", lambda exc: errors.append(str(exc)))
                page.on("console", lambda m: m.type == "error" and errors.append(m.text))

                def only_local(route) -> None:
                    if route.request.url.startswith(base + "/"):
                        route.continue_()
                    else:
                        refused.append(route.request.url)
                        route.abort()

                page.route("**/*", only_local)
                texts = []
                for url, expect, shot in ((url_a, before, "dashboard"), (url_b, after, None)):
                    page.goto(url)
                    # the html-manager's views, not the embedded static HTML, must be there
                    page.wait_for_selector(".cudalab-memory-dashboard .cudalab-dash-mem")
                    assert page.locator(".cudalab-memory-dashboard.widget-vbox").count() == 1
                    texts.append(_assert_dashboard_text(page, names))
                    for i in range(n_dev):
                        assert _data(page, ".cudalab-dash-title", "device", i) == i
                        assert (_data(page, ".cudalab-dash-mem", "allocated", i)
                                == expect["latest"][i]["allocated"])
                        assert (_data(page, ".cudalab-dash-mem", "reserved", i)
                                == expect["latest"][i]["reserved"])
                    assert _data(page, ".cudalab-dash-status", "samples") == expect["samples"]
                    # the chart PNG travels as a binary buffer (base64 in the state): decoded
                    charts = page.evaluate(
                        "() => Array.from(document.querySelectorAll("
                        "'.cudalab-memory-dashboard img')).map(i => [i.complete, i.naturalWidth])")
                    assert len(charts) == n_dev and all(c and w > 0 for c, w in charts), charts
                    if shot:
                        page.locator(".cudalab-memory-dashboard").screenshot(
                            path=str(ARTIFACTS / f"browser_html_manager_{shot}.png"))
                        seg = page.locator("svg.cudalab-segmap")
                        seg.wait_for()
                        assert int(seg.get_attribute("data-blocks")) == viewer.last_render["blocks"]
                        v = page.locator(".cudalab-snapshot-viewer")
                        assert "simulated" in v.locator(".cudalab-snap-summary").inner_text()
                        assert v.locator("svg.cudalab-timeline").count() == 1
                        v.screenshot(path=str(ARTIFACTS / "browser_html_manager_snapshot_viewer.png"))
                assert texts[0] != texts[1]
                assert (_data(page, ".cudalab-dash-mem", "allocated")
                        - before["latest"][0]["allocated"]) == 256 << 20
                assert not refused, f"requests left 127.0.0.1: {refused}"
                assert not errors, errors
                (ARTIFACTS / "browser_html_manager.json").write_text(json.dumps(
                    {"renderer": f"@jupyter-widgets/html-manager {version}",
                     "samples": [before["samples"], after["samples"]]}))
    finally:
        dash.close()
        viewer.close()
        if buf is not None:
            cm.caching_allocator_delete(buf)
            cm.empty_cache()
