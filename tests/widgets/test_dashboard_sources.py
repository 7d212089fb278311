"""The dashboard and the snapshot viewer over torch's and CuPy's allocators (fakes in
sys.modules, tests/helpers/fake_allocators.py): a panel per device and source, each labelled;
a source that goes away is said in its panel, never raised; the viewer of torch's snapshot."""

from __future__ import annotations

import sys

import pytest

import cudalab
from cudalab.memory_sources import SourceUnavailableError
from tests.helpers.fake_allocators import (  # noqa: F401 - fixtures: torch, cupy
    FakeCupy,
    FakeTorch,
    fake_cupy,
    fake_torch,
)

W = pytest.importorskip("ipywidgets")

from cudalab.widgets import SnapshotViewer, close_all  # noqa: E402
from cudalab.widgets.dashboard import MemoryDashboard  # noqa: E402


@pytest.fixture(autouse=True)
def _close():
    yield
    close_all()


def test_auto_dashboard_has_a_labelled_panel_per_source(torch, cupy):
    import cudalab.memory as cm

    cudalab.init()
    cm.caching_allocator_delete(cm.caching_allocator_alloc(1 << 20))  # (NVML lists us)
    torch.cuda.alloc(5 << 20)
    cupy.alloc(3 << 20)
    d = MemoryDashboard(devices=0, source="auto", start=False)
    assert [s.name for s in d.sources] == ["cudalab", "torch", "cupy", "process"]
    titles = [p["title"].value for p in d._panels]
    assert [t.split('data-source="')[1].split('"')[0] for t in titles] == \
        ["cudalab", "torch", "cupy", "process"]
    assert all('class="cudalab-dash-source"' in t for t in titles)
    samples = d.by_source
    assert samples[("torch", 0)].allocated == torch.cuda.memory_allocated(0)
    assert samples[("cupy", 0)].allocated == cupy.get_default_memory_pool().used_bytes()
    assert d.last_samples[0] is samples[("cudalab", 0)]  # (keyed by device: the first source)
    assert "keeps no peaks" in d._panels[2]["counts"].value  # CuPy's note is shown
    assert "NVML: this process uses" in d._panels[3]["counts"].value
    assert d.history(0, source="torch")["allocated"][-1] == torch.cuda.memory_allocated(0)
    assert "[torch]" in d._text()
    pytest.importorskip("matplotlib")
    assert d.to_png().startswith(b"\x89PNG")  # the static picture, a panel per source


def test_torch_dashboard_buttons_act_on_torch(torch):
    cudalab.init()
    torch.cuda.free(torch.cuda.alloc(9 << 20))
    d = MemoryDashboard(devices=0, source="torch", start=False)
    assert d.source.name == "torch" and d.latest[0]["reserved"] == torch.cuda.memory_reserved(0)
    d._on_empty()
    assert "empty_cache" in torch.cuda.calls and d.latest[0]["reserved"] == 0
    d._on_reset()
    assert "reset_peak_memory_stats" in torch.cuda.calls
    torch.cuda.alloc(1 << 20)
    snap = d._on_snapshot()
    assert snap["identity"]["allocator"] == "torch" and d.snapshots[-1] is snap
    assert isinstance(d._viewer, SnapshotViewer)


def test_snapshot_button_prefers_torch_and_skips_cupy(torch, cupy):
    cudalab.init()
    torch.cuda.alloc(1 << 20)
    d = MemoryDashboard(devices=0, source=_sources("cupy", "torch"), start=False)
    assert d._on_snapshot()["identity"]["allocator"] == "torch"
    only_cupy = MemoryDashboard(devices=0, source="cupy", start=False)
    assert only_cupy._on_snapshot() is None and "no source here keeps a snapshot" in \
        only_cupy._status_html()
    assert "history start --source cupy" in only_cupy._status_html()  # how to get one


def test_snapshot_button_of_a_cupy_recording(cupy, monkeypatch):
    from cudalab.memory import record_cupy_history
    from cudalab.memory_tools import cupy_history

    monkeypatch.setattr(cupy_history, "_current", None)
    cudalab.init()
    d = MemoryDashboard(devices=0, source="cupy", start=False)
    with record_cupy_history(cupy) as rec:
        cupy.alloc(3 << 20)
        snap = d._on_snapshot()
    assert snap["identity"]["allocator"] == "cupy" and d.snapshots[-1] is snap
    assert snap["device_traces"][0] == rec.snapshot()["device_traces"][0]
    assert isinstance(d._viewer, SnapshotViewer)


def _sources(*names):
    from cudalab.memory_sources import resolve_sources

    return [resolve_sources(n)[0] for n in names]


def test_a_source_that_goes_away_is_said_in_its_panel(torch, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # (no CuPy in this process)
    cudalab.init()
    d = MemoryDashboard(devices=0, source="auto", start=False)
    torch.cuda.initialized = False  # torch's CUDA gone (a forked child, a reset)
    d._tick()  # what the sampler thread runs: must not raise
    (torch_panel,) = [p for p in d._panels if 'data-source="torch"' in p["title"].value]
    d.refresh()
    assert "no longer initialised" in torch_panel["title"].value
    assert "SourceUnavailableError" in d._status_html()
    cudalab_panel = d._panels[0]
    assert "cudalab-dash-source-error" not in cudalab_panel["title"].value  # the others sample


def test_sampler_thread_survives_a_source_going_away(torch):
    import time

    cudalab.init()
    d = MemoryDashboard(devices=0, source="torch", interval=0.02)
    torch.cuda.initialized = False
    n = d._n
    deadline = time.monotonic() + 5
    while d._n < n + 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert d.running and d._n >= n + 3
    d.close()


def test_dashboard_source_errors():
    with pytest.raises(ValueError, match="unknown memory source 'nope'"):
        MemoryDashboard(source="nope", start=False)


def test_viewer_of_torchs_snapshot(torch):
    cudalab.init()
    torch.cuda.memory._record_memory_history()
    torch.cuda.alloc(3 << 20)
    v = SnapshotViewer(source="torch")
    assert v.snapshot["identity"]["allocator"] == "torch"
    assert len(v.snapshot["segments"]) == 1 and v.history is not None
    assert v.history.n == len(torch.cuda.traces[0]) == 2  # segment_alloc, alloc
    with pytest.raises(ValueError, match="not both"):
        SnapshotViewer({"segments": []}, source="torch")
    v.close()


def test_viewer_of_a_source_without_snapshots(cupy, monkeypatch):
    from cudalab.memory_tools import cupy_history

    monkeypatch.setattr(cupy_history, "_current", None)
    with pytest.raises(SourceUnavailableError, match="start a recording first"):
        SnapshotViewer(source="cupy")
    with pytest.raises(SourceUnavailableError, match="NVML keeps no per-allocation records"):
        SnapshotViewer(source="process")
