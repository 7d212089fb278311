"""Nothing already on disk is lost: every file cudalab writes replaces its target atomically.

For each writer, a failing write (an unserialisable value, or a serializer that raises half
way, KeyboardInterrupt included) leaves the previous file byte-identical and no temporary
file behind, and an unserialisable value is named in the error.
"""

from __future__ import annotations

import io
import os
import stat

import numpy as np
import pytest

import cudalab
from cudalab import _atomic_write
from cudalab._atomic_write import atomic_write, write_bytes_atomic
from cudalab.memory_tools import export, perfetto, plot, snapshot
from cudalab.memory_tools.synthetic import synthetic_snapshot

OLD = b"the previous content\n" * 10


@pytest.fixture
def target(tmp_path):
    p = tmp_path / "out.bin"
    p.write_bytes(OLD)
    return p


def assert_intact(path) -> None:
    """The old content, and nothing but the target in its directory (no temporary file)."""
    assert path.read_bytes() == OLD
    assert sorted(os.listdir(path.parent)) == [path.name]


class Boom(Exception):
    pass


def _raise_after_write(exc: BaseException):
    def fn(*args, **kwargs):
        f = next((a for a in args if hasattr(a, "write")), kwargs.get("fileobj"))
        if f is not None:
            f.write("partial" if isinstance(f, io.TextIOBase) else b"partial")
        raise exc
    return fn


# --------------------------------------------------------------------------- the helper
@pytest.mark.parametrize("exc", [Boom("half way"), KeyboardInterrupt()])
def test_a_failed_write_leaves_the_old_file_and_no_temporary(target, exc):
    with pytest.raises(type(exc)):
        with atomic_write(target) as f:
            f.write(b"new half")
            raise exc
    assert_intact(target)


def test_a_failed_fsync_leaves_the_old_file(target, monkeypatch):
    def fsync(fd):
        raise KeyboardInterrupt
    monkeypatch.setattr(_atomic_write.os, "fsync", fsync)
    with pytest.raises(KeyboardInterrupt):
        write_bytes_atomic(target, b"new")
    assert_intact(target)


def test_a_successful_write_replaces_and_keeps_permissions(target):
    os.chmod(target, 0o640)
    with atomic_write(target, "w") as f:
        f.write("héllo")
    assert target.read_text(encoding="utf-8") == "héllo"
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o640
    assert os.listdir(target.parent) == [target.name]


def test_a_read_only_target_is_refused_as_open_would(target, monkeypatch):
    os.chmod(target, 0o444)
    if os.access(target, os.W_OK):  # (root may write anything: pretend it may not)
        monkeypatch.setattr(_atomic_write.os, "access", lambda path, mode: False)
    with pytest.raises(PermissionError) as info:
        write_bytes_atomic(target, b"new")
    assert info.value.filename == str(target)
    os.chmod(target, 0o644)
    assert_intact(target)


def test_a_new_file_gets_the_umask_permissions_not_the_temporary_ones(tmp_path):
    mask = os.umask(0o027)
    try:
        write_bytes_atomic(tmp_path / "new.bin", b"x")
    finally:
        os.umask(mask)
    assert stat.S_IMODE(os.stat(tmp_path / "new.bin").st_mode) == 0o640


def test_a_symlink_target_is_followed(tmp_path):
    real = tmp_path / "real.bin"
    real.write_bytes(b"old")
    link = tmp_path / "link.bin"
    link.symlink_to(real)
    write_bytes_atomic(link, b"new")
    assert link.is_symlink() and real.read_bytes() == b"new"


def test_a_missing_directory_names_the_target(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        write_bytes_atomic(tmp_path / "no" / "such.bin", b"x")
    assert info.value.filename == str(tmp_path / "no" / "such.bin")


def test_the_mode_is_checked(tmp_path):
    with pytest.raises(ValueError, match="mode"):
        with atomic_write(tmp_path / "x", "a"):
            pass


# --------------------------------------------------------------------------- the writers
@pytest.mark.parametrize("bad", [b"bytes", bytearray(b"ba"), {1, 2}, frozenset({3})],
                         ids=["bytes", "bytearray", "set", "frozenset"])
def test_dump_snapshot_names_an_unserialisable_value_and_keeps_the_file(target, monkeypatch,
                                                                       bad):
    snap = {"segments": [], "device_traces": [], "user": {"meta": [1, bad]}}
    monkeypatch.setattr(snapshot, "_snapshot", lambda: snap)
    with pytest.raises(TypeError, match=rf"\['user'\]\['meta'\]\[1\] has type builtins\."
                                        rf"{type(bad).__name__}"):
        snapshot._dump_snapshot(target)
    assert_intact(target)
    with pytest.raises(TypeError, match=type(bad).__name__):
        cudalab.memory.export_memory_viz(target)
    assert_intact(target)


@pytest.mark.parametrize("exc", [Boom("disk full"), KeyboardInterrupt()])
def test_dump_snapshot_interrupted_while_writing_keeps_the_file(target, monkeypatch, exc):
    real = _atomic_write.os.fsync

    def fsync(fd):
        real(fd)
        raise exc
    monkeypatch.setattr(_atomic_write.os, "fsync", fsync)
    with pytest.raises(type(exc)):
        cudalab.memory._dump_snapshot(target)
    assert_intact(target)


@pytest.mark.parametrize("name", ["out.json", "out.json.gz"])
@pytest.mark.parametrize("exc", [Boom("half way"), KeyboardInterrupt()])
def test_export_perfetto_failing_half_way_keeps_the_file(tmp_path, monkeypatch, name, exc):
    target = tmp_path / name
    target.write_bytes(OLD)
    real = perfetto._write_perfetto

    def half(out, *args):
        real(out, *args)  # the whole trace is written, then the serializer fails
        raise exc
    monkeypatch.setattr(perfetto, "_write_perfetto", half)
    with pytest.raises(type(exc)):
        perfetto.export_perfetto(target, synthetic_snapshot(200))
    assert_intact(target)


def test_export_perfetto_still_writes(tmp_path):
    p = perfetto.export_perfetto(tmp_path / "t.json", synthetic_snapshot(200))
    assert os.path.getsize(p) > 100 and os.listdir(tmp_path) == ["t.json"]


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
@pytest.mark.parametrize("bad", [b"cell-1", {"cell"}, bytearray(b"c"), frozenset({"c"})],
                         ids=["bytes", "set", "bytearray", "frozenset"])
def test_save_frame_names_the_value_and_keeps_the_file(tmp_path, fmt, bad):
    pytest.importorskip("pandas")
    target = tmp_path / f"h.{fmt}"
    target.write_bytes(OLD)
    df = export.history_frame(synthetic_snapshot(100))
    df.loc[7, "cell"] = bad
    with pytest.raises(TypeError, match=rf"column 'cell', row 7 holds a builtins\."
                                        rf"{type(bad).__name__}"):
        export.save_frame(df, target)
    assert_intact(target)


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
@pytest.mark.parametrize("exc", [Boom("half way"), KeyboardInterrupt()])
def test_save_frame_failing_half_way_keeps_the_file(tmp_path, monkeypatch, fmt, exc):
    pd = pytest.importorskip("pandas")
    if fmt == "parquet":
        pytest.importorskip("pyarrow")
    target = tmp_path / f"h.{fmt}"
    target.write_bytes(OLD)
    monkeypatch.setattr(pd.DataFrame, f"to_{fmt}", _raise_after_write(exc))
    with pytest.raises(type(exc)):
        export.save_frame(export.history_frame(synthetic_snapshot(100)), target)
    assert_intact(target)


def test_save_frame_round_trips_a_history_csv(tmp_path):
    pytest.importorskip("pandas")
    df = export.history_frame(synthetic_snapshot(300))
    p = export.save_frame(df, tmp_path / "h.csv")
    back = cudalab.memory.read_history_csv(p)
    assert back["size"].tolist() == df["size"].tolist()
    assert back["cell"].tolist() == df["cell"].tolist()
    with pytest.raises(ValueError, match="format"):
        export.save_frame(df, tmp_path / "h.x", "xlsx")


@pytest.mark.parametrize("exc", [Boom("half way"), KeyboardInterrupt()])
def test_save_figure_failing_half_way_keeps_the_file(tmp_path, monkeypatch, exc):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    target = tmp_path / "fig.png"
    target.write_bytes(OLD)
    fig = Figure()
    fig.add_subplot().plot([1, 2, 3])
    monkeypatch.setattr(fig, "savefig", _raise_after_write(exc))
    with pytest.raises(type(exc)):
        plot.save_figure(fig, target)
    assert_intact(target)


def test_save_figure_writes_the_format_of_the_extension(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    fig = Figure()
    fig.add_subplot().plot([1, 2, 3])
    plot.save_figure(fig, tmp_path / "fig.svg")
    assert b"<svg" in (tmp_path / "fig.svg").read_bytes()[:400]
    plot.save_figure(fig, tmp_path / "fig.png")
    assert (tmp_path / "fig.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("exc", [Boom("half way"), KeyboardInterrupt()])
def test_replay_save_plot_failing_half_way_keeps_the_file(tmp_path, monkeypatch, exc):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from cudalab.memory_tools.replay import replay, save_plot

    target = tmp_path / "r.png"
    target.write_bytes(OLD)
    result = replay(synthetic_snapshot(300))
    monkeypatch.setattr(Figure, "savefig", _raise_after_write(exc))
    with pytest.raises(type(exc)):
        save_plot(result, target)
    assert_intact(target)


# --------------------------------------------------------------------------- the viewer
@pytest.fixture
def viewer():
    pytest.importorskip("ipywidgets")
    from cudalab.widgets import SnapshotViewer

    snap = synthetic_snapshot(200)
    return SnapshotViewer(snap), snap


@pytest.mark.parametrize("bad", [b"x", {1}], ids=["bytes", "set"])
def test_viewer_memory_viz_export_names_the_value_and_keeps_the_file(tmp_path, viewer, bad):
    w, snap = viewer
    target = tmp_path / "v.pickle"
    target.write_bytes(OLD)
    snap["user_metadata"] = {"run": bad}
    with pytest.raises(TypeError, match=r"\['user_metadata'\]\['run'\]"):
        w.export_memory_viz(str(target))
    assert_intact(target)


@pytest.mark.parametrize("exc", [Boom("half way"), KeyboardInterrupt()])
def test_viewer_parquet_export_failing_half_way_keeps_the_files(tmp_path, viewer, monkeypatch,
                                                               exc):
    pd = pytest.importorskip("pandas")
    w, _ = viewer
    prefix = tmp_path / "v"
    for name in ("v_blocks.parquet", "v_blocks.csv"):
        (tmp_path / name).write_bytes(OLD)
    monkeypatch.setattr(pd.DataFrame, "to_parquet", _raise_after_write(exc))
    monkeypatch.setattr(pd.DataFrame, "to_csv", _raise_after_write(exc))
    with pytest.raises(type(exc)):
        w.export_parquet(str(prefix))
    for name in ("v_blocks.parquet", "v_blocks.csv"):
        assert (tmp_path / name).read_bytes() == OLD
    assert sorted(os.listdir(tmp_path)) == ["v_blocks.csv", "v_blocks.parquet"]


def test_viewer_perfetto_export_failing_keeps_the_file(tmp_path, viewer, monkeypatch):
    w, _ = viewer
    target = tmp_path / "v.perfetto.json.gz"
    target.write_bytes(OLD)
    monkeypatch.setattr(perfetto, "_write_perfetto", _raise_after_write(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        w.export_perfetto(str(target))
    assert_intact(target)


# --------------------------------------------------------------------------- the magic
@pytest.mark.parametrize("name", ["h.csv", "h.pickle"])
def test_history_save_failing_keeps_the_file(tmp_path, monkeypatch, name):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("IPython")
    from IPython.testing import globalipapp
    from IPython.utils.capture import capture_output

    target = tmp_path / name
    target.write_bytes(OLD)
    monkeypatch.setattr(cudalab.memory, "history_frame",
                        lambda *a, **k: pd.DataFrame({"cell": [b"raw bytes"]}))
    monkeypatch.setattr(snapshot, "_snapshot",
                        lambda: {"segments": [], "device_traces": [], "meta": b"raw bytes"})
    sh = globalipapp.get_ipython()
    cudalab.init()
    sh.run_line_magic("load_ext", "cudalab")
    try:
        with capture_output() as cap:
            r = sh.run_cell(f"%cuda_memory history save {target}")
    finally:
        sh.run_line_magic("unload_ext", "cudalab")
    assert "bytes" in str(r.error_in_exec), cap.stdout
    assert type(r.error_in_exec).__name__ == "UsageError"
    assert_intact(target)


def test_numpy_values_still_export(tmp_path):
    snap = {"segments": [{"address": np.uint64(1 << 40), "total_size": np.int64(512),
                          "blocks": []}], "device_traces": []}
    from cudalab.memory_tools.trace_io import dumps_snapshot

    write_bytes_atomic(tmp_path / "s.pickle", dumps_snapshot(snap))
    got = cudalab.memory.load_snapshot(tmp_path / "s.pickle")
    assert got["segments"][0]["address"] == 1 << 40


@pytest.mark.parametrize("links", [True, False])
def test_create_bytes_atomic_is_exclusive(tmp_path, monkeypatch, links):
    """Exclusive creation: a new file whole, an existing one untouched (FileExistsError),
    no temporary left; where hard links are refused, O_EXCL does the same."""
    import errno

    if not links:
        def no_links(src, dst):
            raise OSError(errno.EPERM, "Operation not permitted")
        monkeypatch.setattr(os, "link", no_links)
    path = tmp_path / "new.bin"
    _atomic_write.create_bytes_atomic(path, b"first")
    assert path.read_bytes() == b"first"
    with pytest.raises(FileExistsError):
        _atomic_write.create_bytes_atomic(path, b"second")
    assert path.read_bytes() == b"first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.bin"]
