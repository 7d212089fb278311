"""Live ipywidgets dashboards (MemoryDashboard, SnapshotViewer): issue 7, not yet built."""
