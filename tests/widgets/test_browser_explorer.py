"""The snapshot explorer in real front ends (JupyterLab 4, Notebook 7), driven by headless
Chromium through Playwright, with a live kernel on the simulator (the harness of
``tests/widgets/test_browser.py``: its servers, browser and skips).

A torch-format trace of ``CUDALAB_EXPLORER_BROWSER_ENTRIES`` entries (default 300,000) is
written in the kernel, then ``SnapshotExplorer(path)`` is shown and the page is timed:

* first paint: from starting the cell to a drawn timeline (bins > 0);
* pan and zoom: the mouse wheel and drags on the timeline, each answered by the kernel
  with a new tile (the SVG's ``data-version`` changes): p95 from the browser event (the
  wheel, or the mouse button released at the end of a drag) to the new tile in the DOM, over
  24 operations, must be at most ``CUDALAB_EXPLORER_P95_MS`` (100); a round over it is
  measured once more (a shared machine's hiccup), and the better round counts;
* bytes received on the kernel's websocket per view at most 5 MB, the page's JS heap at
  most 300 MB;
* a click on the timeline shows the live set at that moment; a search lists hits, and a
  click on one jumps to its entry.

The figures go to ``test-artifacts/<front end>_explorer_timings.json``, with screenshots.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import statistics

import pytest

from tests.widgets.test_browser import (
    ARTIFACTS,
    FRONT_ENDS,
    _chromium,
    _jupyter_server,
    _new_page,
    _open_notebook,
    _requirements,
    _run_first_cell,
)

ENTRIES = int(os.environ.get("CUDALAB_EXPLORER_BROWSER_ENTRIES", "300000"))
#: A trace file to open instead of writing one (benchmarks/explorer_browser.py's side by side).
TRACE = os.environ.get("CUDALAB_EXPLORER_BROWSER_TRACE")
P95_MS = float(os.environ.get("CUDALAB_EXPLORER_P95_MS", "100"))
MAX_VIEW_BYTES = 5 << 20
MAX_HEAP = 300 << 20

CELLS = [
    ("from cudalab.memory_tools.synthetic import write_synthetic_pickle\n"
     f"n = write_synthetic_pickle('trace.pickle', {ENTRIES}, seed=0)\n"
     "print('trace ready', n)") if not TRACE else
    (f"import os\nos.symlink({TRACE!r}, 'trace.pickle')\nprint('trace ready')"),
    "from cudalab.widgets import SnapshotExplorer\n"
    "ex = SnapshotExplorer('trace.pickle')\n"
    "ex",
]

_OBSERVE = """() => {
    window.__tiles = [];
    window.__events = [];
    const seen = new Set();
    new MutationObserver(() => {
        const svg = document.querySelector('svg.cudalab-explorer-timeline');
        if (!svg) return;
        const v = svg.dataset.version;
        if (!seen.has(v)) { seen.add(v); window.__tiles.push([performance.now(), Number(v),
                                                            Number(svg.dataset.bins)]); }
    }).observe(document.body, {childList: true, subtree: true, attributes: true});
    for (const kind of ['wheel', 'mouseup']) {
        document.addEventListener(kind, () => window.__events.push(performance.now()),
                                  {capture: true});
    }
    window.__t0 = performance.now();
}"""


def _scenario(kind: str, tmp_path: pathlib.Path) -> None:
    fe = FRONT_ENDS[kind]
    prefix = fe["prefix"]
    ARTIFACTS.mkdir(exist_ok=True)
    with _jupyter_server(kind, tmp_path, CELLS) as url, _chromium() as browser:
        page = _new_page(browser)
        frames: list[int] = []
        page.on("websocket", lambda ws: ws.on(
            "framereceived", lambda data: frames.append(len(data) if data else 0)))
        try:
            config = _open_notebook(page, url, fe)
            _run_first_cell(page, lambda: page.wait_for_function(
                "document.querySelector('.jp-Notebook .jp-Cell .jp-InputPrompt')"
                ".innerText.match(/\\[[0-9*]+\\]/) !== null", timeout=3000))
            page.wait_for_selector(".jp-OutputArea-output:has-text('trace ready')",
                                   timeout=180_000)
            page.evaluate(_OBSERVE)
            page.keyboard.press("Shift+Enter")  # the explorer
            page.wait_for_function(
                "window.__tiles.some(t => t[2] > 0)", timeout=60_000)
            first_paint = page.evaluate(
                "(window.__tiles.find(t => t[2] > 0)[0] - window.__t0) / 1000")
            page.wait_for_selector(".cudalab-explorer-ready", timeout=300_000)
            ready = page.evaluate("(performance.now() - window.__t0) / 1000")
            area = page.locator("rect.cudalab-explorer-hit-area")
            box = area.bounding_box()
            cx, cy = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
            page.mouse.move(cx, cy)
            def one_round() -> tuple[list[float], list[int]]:
                latencies, view_bytes = [], []
                for i in range(24):
                    n_tiles = page.evaluate("window.__tiles.length")
                    n_events = page.evaluate("window.__events.length")
                    frames.clear()
                    if i % 3 == 2:  # a drag: pan by a tenth of the view
                        page.mouse.move(cx, cy)
                        page.mouse.down()
                        page.mouse.move(cx - box["width"] / 10, cy, steps=2)
                        page.mouse.up()
                        page.mouse.move(cx, cy)
                    else:  # the wheel: zoom in, then out
                        page.mouse.wheel(0, -120 if i % 3 == 0 else 120)
                    page.wait_for_function(f"window.__tiles.length > {n_tiles}", timeout=20_000)
                    latencies.append(page.evaluate(
                        f"window.__tiles[{n_tiles}][0] - window.__events[{n_events}]"))
                    page.wait_for_timeout(60)
                    view_bytes.append(sum(frames))
                return latencies, view_bytes

            def p95_of(values: list[float]) -> float:
                return sorted(values)[int(0.95 * (len(values) - 1))]

            latencies, view_bytes = one_round()
            rounds = [p95_of(latencies)]
            if rounds[0] > P95_MS:  # a second round: a busy machine's hiccup is not the widget
                latencies, view_bytes = one_round()
                rounds.append(p95_of(latencies))
            heap = page.evaluate("performance.memory ? performance.memory.usedJSHeapSize : 0")
            # a moment: click the middle of the timeline
            page.mouse.click(cx, cy)
            page.wait_for_selector(".cudalab-explorer-live-head")
            live = page.locator(".cudalab-explorer-live-head").inner_text()
            assert "allocated" in live and "moment: entry" in live, live
            page.wait_for_selector(".cudalab-explorer-segmap")
            # search, then jump to the first hit
            query = page.locator(".cudalab-explorer-query input")
            query.fill("optim.py")
            query.press("Enter")
            page.wait_for_selector(".cudalab-explorer-goto")
            hit = page.locator(".cudalab-explorer-goto").first
            row = hit.get_attribute("data-row")
            hit.click()
            page.wait_for_selector(f".cudalab-explorer-live-head[data-row='{row}']")
            page.locator(".cudalab-explorer").first.screenshot(
                path=str(ARTIFACTS / f"{prefix}_explorer.png"))
            p95 = min(rounds)
            result = {"front_end": f"{config.get('appName')} {config.get('appVersion')}",
                      "entries": ENTRIES, "trace": TRACE, "first_paint_s": first_paint, "ready_s": ready,
                      "pan_zoom_ms": latencies, "pan_zoom_p50_ms": statistics.median(latencies),
                      "pan_zoom_p95_ms": p95, "p95_rounds_ms": rounds,
                      "max_view_bytes": max(view_bytes),
                      "js_heap_bytes": heap}
            (ARTIFACTS / f"{prefix}_explorer_timings.json").write_text(json.dumps(result))
            assert max(view_bytes) <= MAX_VIEW_BYTES, view_bytes
            assert heap <= MAX_HEAP, heap
            assert p95 <= P95_MS, f"pan/zoom p95 {p95:.0f} ms (all: {latencies})"
        except Exception:
            page.screenshot(path=str(ARTIFACTS / f"{prefix}_explorer_failure.png"))
            shutil.copy(tmp_path / "server.log",
                        ARTIFACTS / f"{prefix}_explorer_failure_server.log")
            raise


def test_explorer_in_jupyterlab(tmp_path, run_lock):
    _requirements("jupyterlab", "ipykernel")
    with run_lock.alone():
        _scenario("jupyterlab", tmp_path)


def test_explorer_in_notebook7(tmp_path, run_lock):
    _requirements("notebook", "ipykernel")
    import notebook

    if int(notebook.__version__.split(".")[0]) < 7:
        pytest.skip(f"notebook {notebook.__version__} is not Notebook 7")
    with run_lock.alone():
        _scenario("notebook7", tmp_path)
