"""The SnapshotViewer's parquet export, for real: written with pyarrow (``cudalab[parquet]``
brings it), read back with ``pandas.read_parquet``, compared with the frames it was made from;
and, without a parquet engine, the CSV fallback that must say so (a RuntimeWarning naming the
extra, and the note on the export line) instead of changing format silently."""

from __future__ import annotations

import sys
import warnings

import pytest

import cudalab.memory as cm

pd = pytest.importorskip("pandas", reason="pandas is not installed (pip install 'cudalab[parquet]')")
pytest.importorskip("ipywidgets")

from cudalab.memory_tools.export import history_frame, snapshot_frame  # noqa: E402
from cudalab.widgets.snapshot_viewer import SnapshotViewer, demo_snapshot  # noqa: E402


def _need_pyarrow() -> None:
    pytest.importorskip("pyarrow", reason="pyarrow is not installed (pip install 'cudalab[parquet]')")


def _same_values(back, df) -> None:
    assert list(back.columns) == list(df.columns)
    assert len(back) == len(df)
    for col in df.columns:
        got = [None if pd.isna(v) else v for v in back[col]]
        want = [None if pd.isna(v) else v for v in df[col]]
        assert got == want, col
        if df[col].dtype != object:  # typed columns keep their dtype through parquet
            assert back[col].dtype == df[col].dtype, (col, back[col].dtype, df[col].dtype)


def test_viewer_parquet_button_writes_parquet_and_reads_back(tmp_path):
    _need_pyarrow()
    snap = demo_snapshot(500)
    v = SnapshotViewer(snap, prefix=str(tmp_path / "snap"))
    try:
        v._btn_parquet.click()
        status = v._export_status.value
        assert status.startswith("wrote") and "CSV" not in status, status
        assert sorted(p.name for p in tmp_path.iterdir()) == ["snap_blocks.parquet",
                                                              "snap_history.parquet"]
        with open(tmp_path / "snap_blocks.parquet", "rb") as f:
            assert f.read(4) == b"PAR1"  # a parquet file, not CSV under another name
        blocks = pd.read_parquet(tmp_path / "snap_blocks.parquet")
        _same_values(blocks, snapshot_frame(snap))
        assert len(blocks) == v.last_render["blocks"]
        assert set(blocks["state"]) <= {"active_allocated", "active_pending_free", "inactive"}
        history = pd.read_parquet(tmp_path / "snap_history.parquet")
        _same_values(history, history_frame(snap))
        assert len(history) == sum(len(t) for t in snap["device_traces"])
    finally:
        v.close()


def test_live_allocator_parquet_export_round_trip(tmp_path):
    """The viewer on the live allocator (snapshot=None): the blocks this test allocated are in
    the parquet file, with their sizes, as allocated blocks."""
    _need_pyarrow()
    sizes = [3 << 20, 5 << 20, 700 << 10]
    ptrs = [cm.caching_allocator_alloc(n) for n in sizes]
    try:
        v = SnapshotViewer()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)  # no CSV fallback here
                paths = v.export_parquet(str(tmp_path / "live"))
        finally:
            v.close()
        assert paths[0] == str(tmp_path / "live_blocks.parquet")
        assert all(p.endswith(".parquet") for p in paths)
        blocks = pd.read_parquet(paths[0])
        import os

        assert blocks.attrs["identity"]["pid"] == os.getpid()  # where the file came from
        live = blocks[blocks["state"] == "active_allocated"].set_index("address")
        for p, n in zip(ptrs, sizes):
            assert p in live.index, hex(p)
            assert live.loc[p, "requested_size"] == n
            assert live.loc[p, "size"] >= n
    finally:
        for p in ptrs:
            cm.caching_allocator_delete(p)


def test_parquet_export_without_engine_warns_and_names_the_extra(tmp_path, monkeypatch):
    # no pyarrow and no fastparquet, as pandas sees it: importing either fails
    for mod in ("pyarrow.parquet", "fastparquet"):
        monkeypatch.setitem(sys.modules, mod, None)
    with pytest.raises(ImportError):  # the premise: pandas really has no engine now
        pd.DataFrame({"a": [1]}).to_parquet(tmp_path / "probe.parquet")
    snap = demo_snapshot(200)
    v = SnapshotViewer(snap, prefix=str(tmp_path / "snap"))
    try:
        with pytest.warns(RuntimeWarning, match=r"wrote CSV instead.*cudalab\[parquet\].*pyarrow"):
            paths = v.export_parquet(str(tmp_path / "m"))
        assert paths == [str(tmp_path / "m_blocks.csv"), str(tmp_path / "m_history.csv")]
        back = pd.read_csv(paths[0])
        assert back["address"].tolist() == snapshot_frame(snap)["address"].tolist()
        # the button puts the same note on the export line
        v._btn_parquet.click()
        status = v._export_status.value
        assert "snap_blocks.csv" in status and "wrote CSV instead" in status, status
        assert "cudalab[parquet]" in status, status
    finally:
        v.close()
