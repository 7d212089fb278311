"""The lanes explorer (every rank's snapshot on one time axis) in JupyterLab 4, driven by
headless Chromium through Playwright, with a live kernel on the simulator (the harness of
``tests/widgets/test_browser.py``: its server, browser and skips).

Four lanes (three ranks' snapshots and one rank that did not answer) are shown; then the
mouse works as in the single-trace explorer: the wheel over a lane zooms every lane (a new
SVG from the kernel, its window narrower), a drag pans them, a click on a lane shows that
lane's live set at that moment, the peak button picks the highest peak of any lane, and the
lost lane says why it is empty.
"""

from __future__ import annotations

import shutil

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

CELLS = [
    "from tests.cluster.helpers import T0, rank_snapshot\n"
    "from cudalab.widgets import LanesExplorer\n"
    "snaps = {f'rank {r} · node7 · cuda:0': rank_snapshot(r, T0 + 3000 * r, 200) for r in range(3)}\n"
    "ex = LanesExplorer(snaps, errors={'rank 3 · node7': 'did not answer'}, width=700)\n"
    "ex",
]


def _window(page) -> tuple[int, float, float]:
    svg = page.locator("svg.cudalab-lanes-timeline").first
    return (int(svg.get_attribute("data-version")), float(svg.get_attribute("data-start")),
            float(svg.get_attribute("data-stop")))


def test_lanes_in_jupyterlab(tmp_path, run_lock):
    _requirements("jupyterlab", "ipykernel")
    fe = FRONT_ENDS["jupyterlab"]
    ARTIFACTS.mkdir(exist_ok=True)
    with run_lock.alone(), _jupyter_server("jupyterlab", tmp_path, CELLS) as url, \
            _chromium() as browser:
        page = _new_page(browser)
        try:
            _open_notebook(page, url, fe)
            _run_first_cell(page, lambda: page.wait_for_selector("svg.cudalab-lanes-timeline",
                                                                 timeout=5000))
            svg = page.locator("svg.cudalab-lanes-timeline").first
            assert svg.get_attribute("data-lanes") == "4"
            labels = page.locator("g.cudalab-lanes-lane").evaluate_all(
                "gs => gs.map(g => g.dataset.label)")
            assert labels == [f"rank {r} · node7 · cuda:0" for r in range(3)] + ["rank 3 · node7"]
            assert "lost: did not answer" in page.locator("g.cudalab-lanes-lost").text_content()
            version, a, b = _window(page)
            areas = page.locator("rect.cudalab-explorer-hit-area")
            assert areas.count() == 3  # (the lost lane has none)
            box = areas.nth(0).bounding_box()
            cx, cy = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
            # the wheel over rank 0's lane zooms every lane in
            page.mouse.move(cx, cy)
            page.mouse.wheel(0, -120)
            page.wait_for_function(
                "Number(document.querySelector('svg.cudalab-lanes-timeline').dataset.version)"
                f" > {version}")
            version, za, zb = _window(page)
            assert a <= za < zb <= b and (zb - za) < 0.8 * (b - a), (a, b, za, zb)
            # a drag on rank 2's lane pans them (to later times: dragged to the left)
            box2 = areas.nth(2).bounding_box()
            y2 = box2["y"] + box2["height"] / 2
            page.mouse.move(cx, y2)
            page.mouse.down()
            page.mouse.move(cx - box2["width"] / 10, y2, steps=3)
            page.mouse.up()
            page.wait_for_function(
                "Number(document.querySelector('svg.cudalab-lanes-timeline').dataset.version)"
                f" > {version}")
            _, pa, pb = _window(page)
            assert pa > za and abs((pb - pa) - (zb - za)) < 1e-3 * (zb - za), (za, zb, pa, pb)
            # a click on rank 1's lane: its live set then, the moment drawn across the lanes
            box1 = areas.nth(1).bounding_box()
            page.mouse.click(box1["x"] + box1["width"] * 0.5, box1["y"] + box1["height"] / 2)
            page.wait_for_selector(".cudalab-lanes-moment[data-lane='1']")
            moment = page.locator(".cudalab-explorer-live-panel").inner_text()
            assert "rank 1 · node7" in moment, moment
            page.wait_for_selector("svg.cudalab-lanes-timeline line.cudalab-explorer-moment",
                                   state="attached")
            # the peak button: the highest peak of any lane (rank 2 holds 3 MiB blocks)
            page.locator(".cudalab-lanes-peak").first.click()
            page.wait_for_selector(".cudalab-lanes-moment[data-lane='2']")
            assert "rank 2 · node7" in page.locator(".cudalab-explorer-live-panel").inner_text()
            page.locator(".cudalab-explorer-lanes").first.screenshot(
                path=str(ARTIFACTS / "browser_lanes.png"))
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "browser_lanes_failure.png"))
            shutil.copy(tmp_path / "server.log", ARTIFACTS / "browser_lanes_failure_server.log")
            raise
