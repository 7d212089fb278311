"""Live notebook views of the allocator (plain ipywidgets 8; tested in a real browser in
JupyterLab 4 and Notebook 7, and with @jupyter-widgets/html-manager, the renderer VS Code's
Jupyter extension builds on: see docs/widgets.md).

* :class:`MemoryDashboard` — per device allocated / reserved / peak against capacity, a live
  time series, NVML utilization / temperature / power / SM clock, allocation counts, OOMs
  and retries, this process against all processes, and pause / reset-peaks / empty-cache /
  take-snapshot controls (also ``%cuda_memory dashboard``);
* :class:`SnapshotViewer` — a snapshot's segment map (blocks coloured by state), block
  details, device / stream / pool filters, an active-memory timeline with a scrubber to see
  the allocator state at any entry, and parquet / memory_viz / Perfetto exports (also
  ``%cuda_memory snapshot``);
* :class:`SnapshotExplorer` — a trace of any size (1 GB opens in seconds): a tiled timeline
  with cell markers, the live set at a clicked moment (by source line, stack, stream, pool,
  cell; the segment map then), search, and the diff of two runs;
* :class:`ClusterDashboard` — every rank of a job publishing with :mod:`cudalab.cluster`:
  a live panel per rank (the dashboard's rendering of its samples), the rank with the least
  headroom flagged, lost ranks, per-rank peaks, every rank's snapshot on a click, one lane
  per rank (also ``%cuda_memory cluster <directory>``);
* :class:`LanesExplorer` — several traces (every rank of a job) as stacked lanes on one time
  axis, with the explorer's zoom, pan and live set at a clicked moment;
* :func:`close_all` — stop and close every live dashboard (``%unload_ext cudalab`` calls it);
* :func:`demo_snapshot` — a synthetic snapshot of any size, to try the viewer with.

The names load lazily: ``import cudalab`` (and ``import cudalab.widgets``) does not import
ipywidgets; the first use of ``MemoryDashboard`` or ``SnapshotViewer`` does. See
``docs/widgets.md``.
"""

from __future__ import annotations

import sys

from cudalab.lazy_names import lazy_names

__all__ = ["ClusterDashboard", "LanesExplorer", "MemoryDashboard", "SnapshotExplorer",
           "SnapshotViewer", "close_all",
           "demo_snapshot",
           "live_dashboards"]

_LAZY = {
    "ClusterDashboard": "cudalab.widgets.cluster_dashboard",
    "LanesExplorer": "cudalab.widgets.explorer_lanes",
    "MemoryDashboard": "cudalab.widgets.dashboard",
    "SnapshotViewer": "cudalab.widgets.snapshot_viewer",
    "SnapshotExplorer": "cudalab.widgets.explorer",
    "demo_snapshot": "cudalab.widgets.snapshot_viewer",
}


def close_all() -> int:
    """Close every live :class:`MemoryDashboard` and :class:`ClusterDashboard` and stop
    their threads; returns how many were closed. Costs nothing (and imports nothing) when no
    dashboard was ever made."""
    n = 0
    cluster = sys.modules.get("cudalab.widgets.cluster_dashboard")
    if cluster is not None:
        n += cluster.close_all()
    mod = sys.modules.get("cudalab.widgets.dashboard")
    return n if mod is None else n + mod.close_all()


def live_dashboards() -> list:
    """The dashboards not yet closed ([] when none was ever made)."""
    mod = sys.modules.get("cudalab.widgets.dashboard")
    return [] if mod is None else mod.live_dashboards()


__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())
