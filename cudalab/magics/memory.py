"""``%cuda_memory``: the caching allocator's state, marks and diffs, the per-cell watch,
history recording, snapshots and the dashboard.

The per-cell watch (``%cuda_memory watch on``) registers ``pre_run_cell``/``post_run_cell``
hooks (IPython does not fire them for silent executions). Before a cell it opens a
:func:`cudalab.memory.peak_scope` and records a timing event on the current stream; after
it, it closes the scope and prints one line. The peak is **scoped**: nobody's
``max_memory_allocated`` is reset, and scopes nest. Nothing polls: no thread is started.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from IPython.core.error import UsageError

from cudalab._internal import echo, format_bytes
from cudalab.magics.memory_args import (
    MemoryArgs,
    device_label,
    devices_module,
    is_simulated,
    parse_memory_args,
    resolve_device,
    resolve_sources,
)
from cudalab.magics.memory_pools import pools_data, pools_html, pools_text
from cudalab.magics.memory_report import (
    MemoryMark,
    diff_data,
    diff_html,
    diff_text,
    summary_data,
    summary_html,
    summary_text,
)
from cudalab.magics.memory_watch import MemoryWatch

__all__ = ["run_cuda_memory", "MemoryState"]


def _show(text: str, html_text: str | None = None) -> None:
    from IPython.display import display

    bundle = {"text/plain": text}
    if html_text is not None:
        bundle["text/html"] = html_text
    display(bundle, raw=True)



def _cannot(what: str, verb: str, path: str, exc: Exception) -> UsageError:
    """A one-line UsageError for a path ``%cuda_memory`` could not write or read."""
    if isinstance(exc, OSError):
        parent = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            reason = "it is a directory"
        elif verb == "write" and not os.path.isdir(parent):
            reason = f"the directory '{parent}' does not exist"
        elif isinstance(exc, FileNotFoundError):
            reason = "no such file"
        else:
            reason = exc.strerror or str(exc)
        return UsageError(f"{what}: cannot {verb} '{path}': {reason}")
    return UsageError(f"{what}: {exc}")


def _path_word(args: MemoryArgs, i: int, usage: str) -> str:
    """``args.words[i]``, a path (a UsageError when it is missing or empty)."""
    if len(args.words) <= i or not args.words[i].strip():
        raise UsageError(usage)
    return args.words[i]


# =============================================================================== state
class MemoryState:
    """What ``%cuda_memory`` keeps between calls: marks, the watch, the history handle."""

    def __init__(self, magics: Any):
        self.magics = magics
        self.marks: dict[int, MemoryMark] = {}
        self.watch: MemoryWatch | None = None
        self.library_watch: Any = None  # LibraryWatches: torch's and CuPy's lines
        self.watch_source: str | None = None  # the --source of the watch that is on
        self.history: Any = None  # HistoryRecording started by the magic
        self.torch_history: Any = None  # TorchHistory: torch's recording, driven by the magic
        self.cupy_history: Any = None  # CupyHistory: the CuPy recording, driven by the magic

    def watch_on(self, device: int | None, threshold: int, source: str = "auto") -> str:
        """Turn the watch on for ``source``: ``cudalab`` (cudalab's line), ``torch`` or
        ``cupy`` (that library's line), ``auto`` (cudalab's, and torch's and CuPy's while
        they are imported)."""
        from cudalab.magics.memory_watch_sources import LibraryWatches

        if self.watch_source == source:  # already on: new threshold and device
            for w in (self.watch, self.library_watch):
                if w is not None:
                    w.threshold, w.device = threshold, device
            return f"cudalab watch: already on; threshold {format_bytes(threshold)}"
        turned = "on"
        if self.watch_source is not None:
            self.watch_off()
            turned = "on again"
        w = lib = None
        if source in ("cudalab", "auto"):
            w = self.watch = MemoryWatch(self.magics, device, threshold)
            self.magics._add_hook("pre_run_cell", w.pre)
        if source != "cudalab":
            names = None if source == "auto" else (source,)
            lib = self.library_watch = LibraryWatches(names, device, threshold, self.magics, w)
            self.magics._add_hook("pre_run_cell", lib.pre)
            # (its post runs first: it tells cudalab's whether a library's line was printed)
            self.magics._add_hook("post_run_cell", lib.post)
        if w is not None:
            self.magics._add_hook("post_run_cell", w.post)
        self.watch_source = source
        where = f"cuda:{device}" if device is not None else "the current device"
        thr = f"changes of at least {format_bytes(threshold)}" if threshold > 0 else "every cell"
        what = {"auto": "cudalab's allocator, and torch's and CuPy's while imported",
                "cudalab": "cudalab's allocator"}.get(source, f"{source}'s allocator")
        return (f"cudalab watch: {turned} for {what} on {where}, reporting {thr} (peaks read, "
                "never reset; no thread)")

    def watch_off(self) -> str:
        w, lib = self.watch, self.library_watch
        if w is None and lib is None:
            return "cudalab watch: already off"
        if w is not None:
            self.magics._remove_hook("pre_run_cell", w.pre)
            self.magics._remove_hook("post_run_cell", w.post)
            w.stop()
        if lib is not None:
            self.magics._remove_hook("pre_run_cell", lib.pre)
            self.magics._remove_hook("post_run_cell", lib.post)
        self.watch = self.library_watch = self.watch_source = None
        return "cudalab watch: off"

    def mark(self, device: int) -> MemoryMark:
        import cudalab.memory as cm

        old = self.marks.pop(device, None)
        if old is not None and old.scope is not None and old.scope.running:
            old.scope.stop()
        scope = cm.peak_scope(device).start()
        m = self.marks[device] = MemoryMark(device, dict(cm.memory_stats(device)), scope)
        return m

    def close(self) -> None:
        if self.watch_source is not None:
            self.watch_off()
        for m in self.marks.values():
            if m.scope is not None and m.scope.running:
                try:
                    m.scope.stop()
                except RuntimeError:
                    pass
        self.marks.clear()
        if self.history is not None:
            try:
                self.history.restore()
            except Exception:
                pass
            self.history = None
        if self.torch_history is not None:
            self.torch_history.close()  # torch's recording, when this magic started it
        if self.cupy_history is not None:
            self.cupy_history.close()  # the CuPy recording, when this magic started it


def _state(magics: Any) -> MemoryState:
    if magics._memory is None:
        magics._memory = MemoryState(magics)
    return magics._memory


# =============================================================================== history
def _history_entries() -> int:
    hist = sys.modules.get("cudalab.memory_tools.history")
    if hist is None:
        return 0
    return sum(len(hist.raw_entries(d)) for d in hist.devices_with_history())


def _settings_text(s: dict | None) -> str:
    if not s:
        return "off"
    n = s.get("max_entries")
    cap = "unbounded" if n is None or n >= 2**62 else f"{n:,}"
    skip = f", skip {', '.join(s['skip_actions'])}" if s.get("skip_actions") else ""
    return (f"enabled={s.get('enabled')}, context={s.get('context')}, stacks={s.get('stacks')}, "
            f"max_entries={cap}{skip}")


def _history_source(args: MemoryArgs) -> str:
    """The allocator ``history`` acts on: ``--source`` (default ``cudalab``: a recording costs
    the recorded allocator time, so only the one named is started; ``auto`` is torch when the
    process runs torch and cudalab's allocator holds nothing, or CuPy while a CuPy recording
    runs). ``process`` has no history (NVML keeps no per-allocation records): a UsageError
    that says so and what to use."""
    from cudalab.memory_tools.libraries import PROCESS_NO_RECORDS, auto_snapshot_source

    name = args.source or "cudalab"
    if name == "auto":
        name = auto_snapshot_source()
    if name == "process":
        raise UsageError(f"%cuda_memory history --source process: {PROCESS_NO_RECORDS}")
    return name


def _history(magics: Any, args: MemoryArgs) -> Any:
    import cudalab.memory as cm
    from cudalab.memory_tools import history as hist

    st = _state(magics)
    sub = args.words[0].lower() if args.words else "status"
    name = _history_source(args)
    if name == "torch":
        if st.torch_history is None:
            from cudalab.magics.memory_torch_history import TorchHistory

            st.torch_history = TorchHistory()
        return st.torch_history.run(sub, args)
    if name == "cupy":
        if st.cupy_history is None:
            from cudalab.magics.memory_cupy_history import CupyHistory

            st.cupy_history = CupyHistory()
        return st.cupy_history.run(sub, args)
    if sub == "start":
        if st.history is not None and hist.is_recording():
            print(f"cudalab history: already recording ({_settings_text(hist.history_settings())})")
            return None
        kwargs = args.record_kwargs()
        try:
            st.history = cm.record_history("all", **kwargs)
        except (ValueError, RuntimeError) as exc:
            raise UsageError(f"%cuda_memory history start: {exc}") from None
        print(f"cudalab history: recording every allocator ({_settings_text(hist.history_settings())}); "
              "'%cuda_memory history stop' keeps what was recorded readable")
        return None
    if sub == "stop":
        if st.history is not None:
            st.history.restore()
            st.history = None
        elif hist.is_recording():
            hist.stop_recording(clear=False)  # started by user code: keep the entries readable
        else:
            print("cudalab history: not recording")
            return None
        print(f"cudalab history: stopped; {_history_entries()} entries kept "
              "('%cuda_memory history save PATH' or 'frame')")
        return None
    if sub == "save":
        path = _path_word(args, 1, "%cuda_memory history save PATH (.pickle for memory_viz, "
                                   ".csv, .parquet, .json for Perfetto)")
        low = path.lower()
        n = _history_entries()
        try:
            if low.endswith(".csv") or low.endswith(".parquet"):
                from cudalab.memory_tools.export import save_frame

                fmt = "csv" if low.endswith(".csv") else "parquet"
                save_frame(cm.history_frame(), path, fmt)  # atomically
                kind = ("CSV (cudalab.memory.read_history_csv reads it back)" if fmt == "csv"
                        else "parquet (pandas.read_parquet reads it back)")
            elif low.endswith(".json") or low.endswith(".json.gz"):
                cm.export_perfetto(path)
                kind = "Perfetto/Chrome trace JSON (open in ui.perfetto.dev)"
            else:
                cm.export_memory_viz(path)
                kind = "torch snapshot pickle (open at https://pytorch.org/memory_viz)"
        except (OSError, ValueError, TypeError, ImportError) as exc:
            raise _cannot("%cuda_memory history save", "write", path, exc) from None
        print(f"cudalab history: wrote {n} entries to {path}: {kind}")
        return None
    if sub == "frame":
        return cm.history_frame(device=None if args.device is None else resolve_device(args.device))
    if sub == "status":
        s = hist.history_settings()
        state = f"recording ({_settings_text(s)})" if s else "not recording"
        print(f"cudalab history: {state}; {_history_entries()} entries held")
        return None
    raise UsageError(f"%cuda_memory history: unknown action {echo(sub)}; use start, stop, save PATH "
                     "or frame")


class SnapshotDict(dict):
    """torch's ``_snapshot()`` dict with a one-line repr (notebooks would print megabytes)."""

    def _summary(self) -> str:
        segs = self.get("segments", [])
        blocks = sum(len(s.get("blocks", [])) for s in segs)
        total = sum(s.get("total_size", 0) for s in segs)
        traces = sum(len(t) for t in self.get("device_traces", []))
        identity = self.get("identity")
        who = identity.get("allocator", "cudalab") if isinstance(identity, dict) else "cudalab"
        return (f"{who} memory snapshot: {len(segs)} segments, {blocks} blocks, "
                f"{format_bytes(total)} reserved, {traces} trace entries")

    def __repr__(self) -> str:
        return f"<{self._summary()}>"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(repr(self))


def _widget_class(name: str, what: str) -> Any:
    """``cudalab.widgets.<name>``, or None after printing why it is not available."""
    import cudalab.widgets as widgets

    try:
        return getattr(widgets, name)
    except (AttributeError, ImportError) as exc:
        missing = getattr(exc, "name", None) or ""
        if isinstance(exc, AttributeError) or missing.startswith("cudalab"):
            print(f"cudalab: the widgets feature is not built yet: '{what}' needs "
                  f"cudalab.widgets.{name} (use '%cuda_memory' or '%cuda_memory watch on' "
                  "meanwhile)")
            return None
        raise UsageError(f"{what}: the widget cannot be loaded ({exc})") from None


def _source_snapshot(args: MemoryArgs, what: str) -> dict:
    """The live snapshot of ``--source`` (default ``auto``: torch's when the process runs
    torch and cudalab's allocator holds nothing, else cudalab's); a UsageError saying why a
    source cannot give one."""
    from cudalab.memory_tools.libraries import SourceUnavailableError, source_snapshot
    from cudalab.memory_tools.snapshot import take_snapshot

    name = args.source or "auto"
    try:
        snap = source_snapshot(name)
    except SourceUnavailableError as exc:
        raise UsageError(f"{what} --source {name}: {exc.reason}") from None
    return take_snapshot() if snap is None else snap


def _snapshot(args: MemoryArgs) -> Any:
    if args.words and args.words[0].lower() == "dict":
        return SnapshotDict(_source_snapshot(args, "%cuda_memory snapshot dict"))
    if args.words and args.words[0].lower() == "view":
        cls = _widget_class("SnapshotViewer", "%cuda_memory snapshot view")
        if cls is None:
            return None
        if len(args.words) < 2:
            return cls(_source_snapshot(args, "%cuda_memory snapshot view"))
        path = _path_word(args, 1, "%cuda_memory snapshot view [PATH]")
        if args.source is not None:
            raise UsageError("%cuda_memory snapshot view PATH: a file is one allocator's "
                             "snapshot already; --source is for the live views")
        try:
            return cls(path)
        except (OSError, ValueError) as exc:  # missing, unreadable, not a snapshot
            raise _cannot("%cuda_memory snapshot view", "read", path, exc) from None
    if args.words:
        from cudalab.magics.memory_torch_history import write_snapshot

        path = _path_word(args, 0, "%cuda_memory snapshot [PATH | dict | view [PATH]]")
        snap = SnapshotDict(_source_snapshot(args, "%cuda_memory snapshot"))
        try:
            write_snapshot(dict(snap), path)
        except (OSError, ValueError, TypeError, ImportError) as exc:
            raise _cannot("%cuda_memory snapshot", "write", path, exc) from None
        print(f"{snap._summary()}; wrote {path} (open it at https://pytorch.org/memory_viz; the "
              "file is read in the browser, not uploaded)")
        return None

    snap = SnapshotDict(_source_snapshot(args, "%cuda_memory snapshot"))
    try:  # the viewer where the widgets can load
        from cudalab.widgets import SnapshotViewer
    except ImportError:
        return snap
    return SnapshotViewer(snap)


def _dashboard(magics: Any, args: MemoryArgs) -> Any:
    cls = _widget_class("MemoryDashboard", "%cuda_memory dashboard")
    if cls is None:
        return None
    kwargs: dict[str, Any] = {"source": resolve_sources(args, "%cuda_memory dashboard")}
    if args.device is not None:
        kwargs["devices"] = resolve_device(args.device)
    dash = cls(**kwargs)
    magics._dashboards.append(dash)
    return dash


# =============================================================================== entry
def _cluster(magics: Any, args: MemoryArgs) -> Any:
    """``%cuda_memory cluster DIRECTORY [JOB]``: the live view of a job's ranks."""
    usage = "%cuda_memory cluster DIRECTORY [JOB]"
    if not args.words or len(args.words) > 2:
        raise UsageError(f"{usage}: the directory the ranks publish into (CUDALAB_CLUSTER), "
                         "and optionally the job")
    if args.device is not None or args.source is not None or args.threshold is not None:
        raise UsageError(f"{usage}: -d, --source and --threshold are the ranks' own")
    directory = _path_word(args, 0, usage)
    if not os.path.isdir(directory):
        raise UsageError(f"{usage}: {echo(directory)} is not a directory (start the ranks "
                         f"with CUDALAB_CLUSTER={directory} first, or call "
                         "cudalab.cluster.serve(directory) in each)")
    cls = _widget_class("ClusterDashboard", "%cuda_memory cluster")
    if cls is None:
        return None
    try:
        dash = cls(directory, job=args.words[1] if len(args.words) > 1 else None)
    except RuntimeError as exc:  # no pyzmq
        raise UsageError(f"%cuda_memory cluster: {exc}") from None
    magics._dashboards.append(dash)
    return dash


def _explore(args: MemoryArgs) -> Any:
    """``%cuda_memory explore [PATH [OTHER]]``: the snapshot explorer of this process's
    history, of a trace file, or of two (the diff mode)."""
    usage = "%cuda_memory explore [PATH [OTHER_PATH]]"
    if len(args.words) > 2:
        raise UsageError(usage)
    cls = _widget_class("SnapshotExplorer", "%cuda_memory explore")
    if cls is None:
        return None
    if not args.words:
        return cls()
    paths = [_path_word(args, i, usage) for i in range(len(args.words))]
    for path in paths:
        if not os.path.isfile(path):
            why = "it is a directory" if os.path.isdir(path) else "no such file"
            # (the whole path, as every %cuda_memory path error gives it: see _cannot)
            raise UsageError(f"%cuda_memory explore: cannot read '{path}': {why}")
    return cls(paths[0], compare=paths[1] if len(paths) > 1 else None)


def run_cuda_memory(magics: Any, line: str) -> Any:
    """The body of ``%cuda_memory`` (see its docstring)."""
    args = parse_memory_args(line)
    cmd = args.command
    if args.source is not None and cmd not in ("watch", "history", "snapshot", "dashboard"):
        raise UsageError(f"%cuda_memory {cmd}: --source is for watch, history, snapshot and "
                         "dashboard (this view reads cudalab's allocator)")
    if cmd == "summary":
        d = resolve_device(args.device, init=args.device is not None)
        if d is None:
            print("cudalab memory: CUDA is not initialised yet, so cudalab has allocated nothing "
                  "(no context was created)")
            return None
        data = summary_data(d)
        _show(summary_text(data), summary_html(data))
        return None
    if cmd == "pools":
        data = pools_data(resolve_device(args.device))
        _show(pools_text(data), pools_html(data))
        return None
    if cmd == "stats":
        import cudalab.memory as cm

        devs = None if args.device is None else [resolve_device(args.device)]
        if devs is None:
            resolve_device(None)
        try:
            frame = cm.stats_frame(devs)
        except ImportError:
            return cm.memory_stats(devs[0] if devs else None)
        frame.attrs["simulated"] = is_simulated()
        if frame.attrs["simulated"]:
            frame.index.name = "device (simulated)"
        return frame
    if cmd == "mark":
        d = resolve_device(args.device)
        m = _state(magics).mark(d)
        print(f"cudalab memory: mark set on {device_label(d)} (allocated "
              f"{format_bytes(m.stats.get('allocated_bytes.all.current', 0))}, reserved "
              f"{format_bytes(m.stats.get('reserved_bytes.all.current', 0))}); "
              "'%cuda_memory diff' shows the changes and the peak since")
        return None
    if cmd == "diff":
        d = resolve_device(args.device)
        marked = _state(magics).marks.get(d)
        if marked is None:
            raise UsageError(f"%cuda_memory diff: no mark on cuda:{d}; run '%cuda_memory mark' "
                             "first")
        data = diff_data(marked)
        _show(diff_text(data), diff_html(data))
        return None
    if cmd == "reset-peaks":
        import cudalab.memory as cm

        d = resolve_device(args.device)
        cm.reset_peak_memory_stats(d)
        print(f"cudalab memory: peak statistics of {device_label(d)} reset (max_memory_allocated is "
              f"now {format_bytes(cm.max_memory_allocated(d))}); scoped peaks (watch, marks) "
              "keep theirs")
        return None
    if cmd == "empty-cache":
        import cudalab.memory as cm

        devices = devices_module()
        if not devices.is_initialized():
            print("cudalab memory: nothing cached (CUDA is not initialised)")
            return None
        n = devices.device_count()
        before = sum(cm.memory_reserved(i) for i in range(n))
        cm.empty_cache()
        after = sum(cm.memory_reserved(i) for i in range(n))
        print(f"cudalab memory: released {format_bytes(before - after)} of cached memory to the "
              f"driver; {format_bytes(after)} still reserved (in use)")
        return None
    if cmd == "watch":
        st = _state(magics)
        word = args.words[0].lower() if args.words else "on"
        if word in ("on", "start"):
            source = args.source or "auto"
            if source != "auto":  # a UsageError when the source cannot be had
                resolve_sources(args, "%cuda_memory watch", ("cudalab", "torch", "cupy", "auto"))
            device = None if args.device is None else resolve_device(args.device)
            thr = magics.watch_threshold if args.threshold is None else args.threshold
            print(st.watch_on(device, thr, source))
        elif word in ("off", "stop"):
            print(st.watch_off())
        else:
            raise UsageError("%cuda_memory watch on|off [--threshold BYTES] [-d DEV]")
        return None
    if cmd == "history":
        return _history(magics, args)
    if cmd == "snapshot":
        return _snapshot(args)
    if cmd == "explore":
        return _explore(args)
    if cmd == "dashboard":
        return _dashboard(magics, args)
    if cmd == "why":
        from cudalab.magics.memory_why import run_why

        return run_why(magics, args.words,
                       None if args.device is None else resolve_device(args.device))
    if cmd == "cluster":
        return _cluster(magics, args)
    raise UsageError(f"%cuda_memory: unknown subcommand {echo(cmd)}")  # pragma: no cover
