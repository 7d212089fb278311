"""Explorer browser benchmark: torch's memory_viz page and cudalab's SnapshotExplorer side by
side in one Chromium, on the same torch-format trace (time to first paint, browser JS heap).

* **memory_viz**: the page ``torch.cuda._memory_viz.trace_plot`` writes (the pickle in base64
  inside the HTML, read by MemoryViz.js's own unpickler, drawn with d3), served from
  127.0.0.1. The page imports MemoryViz.js from GitHub (pytorch/pytorch ``main``; torch's
  wheel does not carry it) and d3 from a CDN, which these machines cannot reach:
  ``--memory-viz-js`` names a copy of MemoryViz.js, d3 5 comes from npm
  (``~/.cache/cudalab-test/d3-5``, what ``npm pack d3@5`` unpacks), and the five CDN imports
  are replaced by the same names read from the d3 bundle (nothing else in the file changes).
  First paint: navigation start to the first polygon of its "Active Memory Timeline".
* **cudalab**: ``tests/widgets/test_browser_explorer.py`` in JupyterLab 4 on the same file
  (``CUDALAB_EXPLORER_BROWSER_TRACE``): first paint is from running the cell to the first
  drawn tile; ``ready`` when the whole index is.

    python benchmarks/explorer_browser.py --memory-viz-js MemoryViz.js [--entries 1150000]

The trace (``--trace``, else ~90 bytes per entry written here as torch writes it: protocol 4,
a new frames list per entry) is what both open.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import functools
import http.server
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
D3 = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") \
    / "cudalab-test" / "d3-5" / "package" / "dist" / "d3.min.js"
CHROMIUM = os.environ.get("CUDALAB_CHROMIUM", "/usr/bin/chromium")

PAGE = """<!DOCTYPE html>
<html><head><meta charset="utf-8"></head>
<body>
<script src="d3.min.js"></script>
<script type="module">
import {add_local_files} from "./MemoryViz.local.js"
const local_files = $SNAPSHOT
add_local_files(local_files, $VIZ_KIND)
</script>
</body></html>
"""

_IMPORTS = re.compile(r"^import .* from \"https://cdn\.skypack\.dev/[^\"]+\";?\s*$", re.M)


def localize(memory_viz_js: str) -> str:
    """MemoryViz.js with its CDN imports (d3 and four d3 modules) read from ``window.d3``."""
    body, n = _IMPORTS.subn("", memory_viz_js)
    if n != 5:
        raise SystemExit(f"expected MemoryViz.js's 5 CDN imports, found {n}: another version?")
    return ("const d3 = window.d3;\n"
            "const {axisLeft, scaleLinear, zoom, zoomIdentity, brushX} = window.d3;\n" + body)


def memory_viz_html(pickle_bytes: bytes) -> str:
    """torch's ``_format_viz``: the pickle padded to a multiple of 3, base64, in the page."""
    pad = (-len(pickle_bytes)) % 3
    data = base64.b64encode(pickle_bytes + b"\0" * pad).decode()
    files = json.dumps([{"name": "snapshot.pickle", "base64": data}])
    return PAGE.replace("$SNAPSHOT", files).replace("$VIZ_KIND", json.dumps("Active Memory Timeline"))


@contextlib.contextmanager
def _serve(directory: pathlib.Path):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(directory)))
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def run_memory_viz(trace: pathlib.Path, js: pathlib.Path, timeout_s: float) -> dict:
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        site = pathlib.Path(tmp)
        (site / "MemoryViz.local.js").write_text(localize(js.read_text()))
        (site / "d3.min.js").write_bytes(D3.read_bytes())
        (site / "index.html").write_text(memory_viz_html(trace.read_bytes()))
        page_mb = (site / "index.html").stat().st_size / 1e6
        with _serve(site) as url, sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
                "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--enable-precise-memory-info"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("crash", lambda *_: errors.append("page crashed"))
            out: dict = {"page_mb": page_mb}
            try:
                page.goto(f"{url}/index.html", timeout=int(timeout_s * 1000))
                page.wait_for_function("document.querySelectorAll('polygon').length > 0",
                                       timeout=int(timeout_s * 1000), polling=200)
                out["first_paint_s"] = page.evaluate("performance.now() / 1000")
                out["polygons"] = page.evaluate("document.querySelectorAll('polygon').length")
                out["js_heap_bytes"] = page.evaluate("performance.memory.usedJSHeapSize")
            except Exception as exc:  # (a timeout or a crashed page is the finding)
                out["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            out["page_errors"] = errors[:3]
            browser.close()
    return out


def run_cudalab(trace: pathlib.Path) -> dict:
    env = dict(os.environ, CUDALAB_SIMULATOR="1", CUDALAB_EXPLORER_BROWSER_TRACE=str(trace),
               CUDALAB_EXPLORER_P95_MS="1000000")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/widgets/test_browser_explorer.py", "-k", "jupyterlab"],
                          cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    path = ROOT / "test-artifacts" / "browser_explorer_timings.json"
    if done.returncode != 0 or not path.exists():
        return {"error": (done.stdout + done.stderr).strip().splitlines()[-1:]}
    return json.loads(path.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--memory-viz-js", type=pathlib.Path, default=None,
                   help="torch's torch/utils/viz/MemoryViz.js (without it: cudalab's side only)")
    p.add_argument("--skip-cudalab", action="store_true")
    p.add_argument("--trace", type=pathlib.Path, default=None)
    p.add_argument("--entries", type=int, default=1_150_000)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.memory_viz_js is not None and not D3.exists():
        raise SystemExit(f"no d3 5 at {D3}: npm pack d3@5 and unpack it there")
    with tempfile.TemporaryDirectory() as tmp:
        trace = args.trace
        if trace is None:
            import pickle

            from cudalab.memory_tools.synthetic import synthetic_snapshot

            snap = synthetic_snapshot(args.entries, cudalab_keys=False)
            snap["device_traces"] = [[dict(e, frames=list(e["frames"])) for e in t]
                                     for t in snap["device_traces"]]
            trace = pathlib.Path(tmp) / "trace.pickle"
            trace.write_bytes(pickle.dumps(snap, protocol=4))
            del snap
        mb = trace.stat().st_size / 1e6
        viz: dict = {"page_mb": 0.0, "page_errors": [], "error": "not run"}
        if args.memory_viz_js is not None:
            t = time.perf_counter()
            viz = run_memory_viz(trace, args.memory_viz_js, args.timeout)
            viz["wall_s"] = time.perf_counter() - t
        ours = {"error": "not run"} if args.skip_cudalab else run_cudalab(trace)
    print(f"side by side, {mb:.0f} MB torch-format trace, headless Chromium")
    print(f"  memory_viz (torch): first paint {viz.get('first_paint_s', 'n/a')} s, JS heap "
          f"{viz.get('js_heap_bytes', 0) / 1e6:.0f} MB, page {viz['page_mb']:.0f} MB"
          f"{'; ' + viz['error'] if 'error' in viz else ''} {viz['page_errors']}")
    print(f"  cudalab explorer (JupyterLab): first paint {ours.get('first_paint_s', 'n/a')} s, "
          f"whole index {ours.get('ready_s', 'n/a')} s, JS heap "
          f"{ours.get('js_heap_bytes', 0) / 1e6:.0f} MB, pan/zoom p95 "
          f"{ours.get('pan_zoom_p95_ms', 'n/a')} ms {ours.get('error', '')}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"trace_mb": mb, "memory_viz": viz,
                                                       "cudalab": ours}, indent=2))


if __name__ == "__main__":
    main()
