"""The snapshot explorer widget (cudalab.widgets.explorer) and the user-frames-first stacks
of the snapshot viewer."""

from __future__ import annotations

from cudalab.memory_tools.synthetic import synthetic_snapshot
from cudalab.widgets import SnapshotViewer

IPY = [{"filename": "/venv/lib/python3.12/site-packages/IPython/core/interactiveshell.py",
        "line": 3577, "name": "run_code"},
       {"filename": "/venv/lib/python3.12/site-packages/ipykernel/kernelbase.py", "line": 9,
        "name": "dispatch_shell"}]
CELL = {"filename": "/tmp/ipykernel_7/11.py", "line": 2, "name": "<module>"}


def _with_notebook_frames(snap):
    for seg in snap["segments"]:
        for b in seg["blocks"]:
            if b["state"] != "inactive":
                b["frames"] = [CELL, *IPY]
    for e in snap["device_traces"][0]:
        if e["frames"]:
            e["frames"] = [CELL, *IPY]
    return snap


def test_the_viewer_shows_user_frames_first_and_folds_the_kernel_frames():
    snap = _with_notebook_frames(synthetic_snapshot(400))
    v = SnapshotViewer(snap)
    seg = next(s for s in v.segments() if any(b["state"] != "inactive" for b in s["blocks"]))
    block = next(b for b in seg["blocks"] if b["state"] != "inactive")
    v._addr.value = hex(block["address"])
    detail = v._detail.value
    head, _, folded = detail.partition("<details")
    assert "11.py:2" in head and "run_code" not in head
    assert "2 IPython/ipykernel frames folded" in folded and "run_code" in folded
    # the map's tooltips name the user's frame, not IPython's
    assert "run_code" not in v._map.value and "11.py:2" in v._map.value


# --------------------------------------------------------------------------- the explorer
import re  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from cudalab.memory_tools.synthetic import write_synthetic_pickle  # noqa: E402
from cudalab.memory_tools.trace_views import TraceViews  # noqa: E402
from cudalab.widgets import SnapshotExplorer  # noqa: E402
from cudalab.widgets.explorer import parse_query  # noqa: E402


def _attr(html_text, cls, name):
    m = re.search(rf'class="{cls}"[^>]*data-{name}="([^"]*)"', html_text)
    if m is None:
        m = re.search(rf'data-{name}="([^"]*)"[^>]*class="{cls}"', html_text)
    assert m, (cls, name)
    return m.group(1)


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("explorer") / "trace.pickle"
    write_synthetic_pickle(path, 60_000, seed=8)
    return path


def test_the_explorer_reads_a_file_in_a_thread_and_draws_tiles(trace_file, monkeypatch):
    monkeypatch.setattr("cudalab.widgets.explorer.PROGRESS_INTERVAL", 0.0)
    ex = SnapshotExplorer(trace_file, step_bytes=1 << 20).wait(60)
    assert ex.error is None and ex.views is not None
    assert ex.views.index.n == 60_000
    svg = ex._timeline.value
    assert int(_attr(svg, "cudalab-explorer-timeline", "bins")) <= ex.bins
    assert int(_attr(svg, "cudalab-explorer-timeline", "cells")) > 0  # cell markers
    assert "data-rows='60000'" in ex._summary.value or 'data-rows="60000"' in ex._summary.value
    from cudalab.memory_tools.trace_index import scanner_available

    # partial views while reading (the C reader), then the whole trace
    assert ex.tiles_sent >= (2 if scanner_available() else 1)
    assert repr(ex).startswith("SnapshotExplorer(") and "60,000 entries" in repr(ex)
    bundle = ex._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert "cudalab-explorer-timeline" in bundle["text/html"]
    # every view is bounded, whatever the trace's size
    assert ex.bytes_sent / ex.tiles_sent < 5 << 20


def test_zoom_pan_and_click_ask_for_the_next_tile(trace_file):
    ex = SnapshotExplorer(trace_file, wait=True)
    a, b = ex.window
    ex.command("zoom 0.5 0.5")
    za, zb = ex.window
    assert zb - za == (b - a) // 2 and a <= za < zb <= b
    ex.command("pan 0.25")
    pa, pb = ex.window
    assert pa > za and pb - pa == zb - za
    v = int(_attr(ex._timeline.value, "cudalab-explorer-timeline", "version"))
    ex._cmd.value = "zoom 0.1 0.5 1234567"  # what the page's wheel handler sends
    assert int(_attr(ex._timeline.value, "cudalab-explorer-timeline", "version")) == v + 1
    ex._cmd.value = "click 0.5 1234568"  # a click on the timeline: the moment
    row = ex.moment
    assert row is not None and ex.window[0] <= row < ex.window[1]
    live = ex._live.value
    assert f"data-row='{row}'" in live
    truth = TraceViews(ex.views.index).live_at(row)
    assert f"data-allocated='{truth.allocated}'" in live
    assert "by source line" in live and "by notebook cell" in live and "by stream" in live
    assert "cudalab-segmap" in ex._segmap.value
    ex.command("reset")
    assert ex.window == (a, b)
    ex.command("peak")
    assert ex.views.allocated[ex.moment] == ex.views.allocated[a:b].max()
    ex._cmd.value = "nonsense 1 2"  # malformed commands from the page are ignored
    ex._cmd.value = "zoom x 2"


def test_search_lists_hits_that_jump_to_their_entry(trace_file):
    ex = SnapshotExplorer(trace_file, wait=True)
    ex._search.value = "optim.py"
    res = ex._results.value
    count = int(re.search(r"data-count='(\d+)'", res).group(1))
    assert count == ex.views.search("optim.py").count > 0
    first = int(re.search(r"data-row='(\d+)'", res).group(1))
    assert "cudalab-explorer-hits" in ex._timeline.value
    ex._cmd.value = f"goto {first} 99"
    assert ex.moment == first and ex.window[0] <= first < ex.window[1]
    ex.search("1MiB-2MiB")
    assert "sizes in" in ex._results.value
    ex.search("1 parsec-2")
    assert "not a size" in ex._results.value


def test_parse_query():
    assert parse_query("0x7f00") == {"address": 0x7F00}
    assert parse_query("1MiB-4MiB") == {"size_range": (1 << 20, 4 << 20)}
    assert parse_query(">=64MiB") == {"size_range": (64 << 20, None)}
    assert parse_query("<1KiB") == {"size_range": (None, 1023)}
    assert parse_query("model.py:12") == {"text": "model.py:12"}


def test_diff_mode_draws_the_other_run_and_its_table(tmp_path):
    a, b = tmp_path / "a.pickle", tmp_path / "b.pickle"
    write_synthetic_pickle(a, 8000, seed=1)
    write_synthetic_pickle(b, 8000, seed=2)
    ex = SnapshotExplorer(a, compare=b, wait=True)
    assert ex.diff_result is not None and ex.diff_result.names == ("a.pickle", "b.pickle")
    assert "cudalab-explorer-overlay" in ex._timeline.value
    assert "peak allocated" in ex._diff.value and "by source line" in ex._diff.value


def test_a_bad_file_is_shown_not_raised_from_the_thread(tmp_path):
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(b"\x80\x04cos\nsystem\n.")
    ex = SnapshotExplorer(bad).wait(30)
    assert "refusing to load" in ex.error and "cudalab-explorer-error" in ex._summary.value
    with pytest.raises(Exception, match="refusing to load"):
        SnapshotExplorer(bad, wait=True)


def test_exports_write_what_the_viewer_writes(tmp_path):
    snap = synthetic_snapshot(500)
    ex = SnapshotExplorer(snap)
    p = ex.export("pickle", str(tmp_path / "s.pickle"))
    from cudalab.memory_tools.trace_io import load_snapshot

    assert load_snapshot(p)["device_traces"] == snap["device_traces"]
    assert ex.export("perfetto", str(tmp_path / "s.json")).endswith("s.json")
    with pytest.raises(ValueError, match="unknown export"):
        ex.export("gif")


def test_multi_device_traces_switch_devices(tmp_path):
    snap = synthetic_snapshot(3000, devices=2)
    ex = SnapshotExplorer(snap)
    assert [v for _, v in ex._devices.options] == [0, 1]
    ex._devices.value = 1
    _, a, b = ex.views.device_range(1)
    assert ex.window == (a, b)
    assert np.all(ex.views.index.device[a:b] == 1)


def test_no_source_explores_this_process_history():
    import cudalab
    import cudalab.memory as cm

    cudalab.init()
    with cm.record_history(clear_history=True):
        kept = [cm.caching_allocator_alloc(1 << 20) for _ in range(3)]
        ex = SnapshotExplorer()
    try:
        assert ex.views is not None and ex.views.index.n >= 3
        ex.command("peak")
        assert ex.views.live_at(ex.moment).allocated >= 3 << 20
    finally:
        for p in kept:
            cm.caching_allocator_delete(p)
