"""ClusterDashboard and ``%cuda_memory cluster`` over 3 rank processes of the simulator."""

from __future__ import annotations

import socket
import threading
import time

import pytest

pytest.importorskip("zmq")
pytest.importorskip("ipywidgets")

from IPython.testing import globalipapp  # noqa: E402
from IPython.utils.capture import capture_output  # noqa: E402

from cudalab.widgets import ClusterDashboard, LanesExplorer, MemoryDashboard  # noqa: E402
from tests.cluster.helpers import Ranks, wait_for  # noqa: E402

MiB = 1 << 20


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    ranks = Ranks(tmp_path_factory.mktemp("dash"), "job-d", 3, mib=16)
    yield ranks
    ranks.close()


def test_a_panel_per_rank_flags_and_peaks(job):
    dash = ClusterDashboard(job.directory, job="job-d", interval=0.1)
    try:
        assert wait_for(lambda: len(dash.panels) == 3, 10), dash.panels
        assert sorted(dash.panels) == [(0, "cudalab"), (1, "cudalab"), (2, "cudalab")]
        panel = dash.panels[2, "cudalab"]
        assert isinstance(panel, MemoryDashboard)  # the single-process rendering, reused
        assert wait_for(lambda: panel.last_samples[0] is not None, 5)
        assert panel.last_samples[0].allocated == 3 * 16 * MiB
        assert panel.simulated  # (its device name says so)
        # the rank holding the most is flagged, in its title and in the peaks table
        assert wait_for(lambda: dash.least is not None and dash.least.rank == 2, 5)
        dash.refresh()
        assert [dash.panels[k, "cudalab"].flag for k in range(3)] == ["", "", "least headroom"]
        html = dash.to_html()
        assert 'data-ranks="3"' in html and "least headroom: <b>rank 2</b>" in html
        assert html.count("<tr data-rank=") == 3 and "48.0 MiB" in html
        # the panels cannot reset a remote rank's peaks nor empty its cache
        bundle = dash._repr_mimebundle_()
        assert bundle["text/html"] == dash.to_html()
        assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == dash.model_id
        with pytest.raises(NotImplementedError, match="rank 2's"):
            panel.source.reset_peaks(0)
        # every rank's snapshot, into the explorer
        snaps = dash.fetch_snapshots()
        assert sorted(snaps) == [0, 1, 2] and all(s["segments"] for s in snaps.values())
        assert "3 snapshot(s) fetched" in dash._status.value  # noqa: SLF001
        # ... one lane per rank on one time axis, labelled with host, rank and GPU
        ex = dash.explorer
        assert isinstance(ex, LanesExplorer) and dash._snapshot_box.children == (ex,)  # noqa: SLF001
        host = socket.gethostname()
        labels = [x.label for x in ex.lanes.lanes]
        assert [x.key for x in ex.lanes.lanes] == [0, 1, 2]
        assert all(label.startswith(f"rank {k} · {host} · cuda:0 (") and "simulated" in label
                   for k, label in enumerate(labels)), labels
        assert not any(x.lost for x in ex.lanes.lanes)
        peaks = [max(t["alloc_max"]) for t in ex.tiles()]
        assert all(peaks[k] >= (k + 1) * 16 * MiB for k in range(3)), peaks
        first, last = ex.lanes.bounds
        assert all(first <= a <= b <= last for a, b in map(ex.lanes.lane_bounds, range(3)))
    finally:
        dash.close()
    assert not dash.running and all(p._closed for p in dash.panels.values())  # noqa: SLF001


def test_a_lost_rank_is_flagged(tmp_path):
    ranks = Ranks(tmp_path, "job-l", 2)
    dash = ClusterDashboard(tmp_path, interval=0.1)
    try:
        assert wait_for(lambda: len(dash.panels) == 2, 10)
        ranks.kill(0)
        assert wait_for(lambda: dash.panels[0, "cudalab"].flag == "lost", 3)
        assert 'data-lost="1"' in dash.to_html() and "lost: 0" in dash.to_html()
        assert dash.panels[1, "cudalab"].flag != "lost"
        # the lost rank keeps its lane, marked lost; the other's trace is there
        snaps = dash.fetch_snapshots()
        assert sorted(snaps) == [1]
        lanes = dash.explorer.lanes.lanes
        assert [x.key for x in lanes] == [0, 1] and [x.lost for x in lanes] == [True, False]
        assert "stopped publishing" in lanes[0].error and lanes[1].entries > 0
        assert "lost: the rank stopped publishing" in dash.explorer._timeline.value  # noqa: SLF001
    finally:
        dash.close()
        ranks.close()


def test_the_magic_opens_it_and_unload_stops_it(job, tmp_path):
    shell = globalipapp.get_ipython()
    shell.run_line_magic("load_ext", "cudalab")
    try:
        with capture_output():
            r = shell.run_cell(f"%cuda_memory cluster {job.directory} job-d")
        assert r.success and isinstance(r.result, ClusterDashboard), r.error_in_exec
        dash = r.result
        assert dash.watch.job == "job-d"
        assert wait_for(lambda: len(dash.panels) == 3, 10)
        for line, message in ((f"%cuda_memory cluster {tmp_path / 'nope'}", "not a directory"),
                              ("%cuda_memory cluster", "the directory the ranks publish"),
                              (f"%cuda_memory cluster {tmp_path} -d 0", "the ranks' own")):
            with capture_output() as cap:
                bad = shell.run_cell(line)
            assert not bad.success and message in str(bad.error_in_exec) + cap.stderr, line
    finally:
        shell.run_line_magic("unload_ext", "cudalab")
    assert wait_for(lambda: not dash.running, 3)
    assert not any(t.name == "cudalab-cluster-dashboard" and t.is_alive()
                   for t in threading.enumerate())
    time.sleep(0)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="interval"):
        ClusterDashboard(tmp_path, interval=0)
