"""``%cuda_memory``: the caching allocator's state, marks and diffs, the per-cell watch,
history recording, snapshots and the dashboard.

The per-cell watch (``%cuda_memory watch on``) registers ``pre_run_cell``/``post_run_cell``
hooks (IPython does not fire them for silent executions). Before a cell it opens a
:func:`cudalab.memory.peak_scope` and records a timing event on the current stream; after
it, it closes the scope and prints one line. The peak is **scoped**: nobody's
``max_memory_allocated`` is reset, and scopes nest. Nothing polls: no thread is started.
"""

from __future__ import annotations

import html
import re
import shlex
import sys
import time
from typing import Any

from IPython.core.error import UsageError

from cudalab._driver.base import STATUS_NOT_READY as _NOT_READY
from cudalab.magics.result import format_bytes, format_time

__all__ = ["run_cuda_memory", "parse_bytes", "MemoryState"]

_UNIT = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
         "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
         "tb": 1000**4, "tib": 1024**4}
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """``"1048576"``, ``"1MiB"``, ``"64 KiB"``, ``"1.5GB"`` -> bytes (ValueError otherwise)."""
    m = _BYTES_RE.match(str(text))
    if not m or m.group(2).lower() not in _UNIT:
        raise ValueError(f"not a byte count: {text!r} (e.g. 1048576, 1MiB, 64 KiB, 1.5GB)")
    value = float(m.group(1)) * _UNIT[m.group(2).lower()]
    if value < 0:
        raise ValueError(f"byte count must be >= 0, got {text!r}")
    return int(value)


# =============================================================================== parsing
class _Args:
    __slots__ = ("command", "words", "device", "threshold", "max_entries", "context", "stacks")

    def __init__(self) -> None:
        self.command = "summary"
        self.words: list[str] = []
        self.device: str | None = None
        self.threshold: int | None = None
        self.max_entries: int | None = None
        self.context: str | None = None
        self.stacks: str | None = None


_COMMANDS = ("summary", "stats", "diff", "mark", "reset-peaks", "empty-cache", "watch",
             "history", "snapshot", "dashboard")


def _parse(line: str) -> _Args:
    try:
        tokens = shlex.split(line or "")
    except ValueError as exc:
        raise UsageError(f"%cuda_memory: {exc}") from None
    args = _Args()
    i = 0
    positional: list[str] = []
    while i < len(tokens):
        tok = tokens[i]
        name, eq, inline = tok.partition("=")
        if name in ("-d", "--device", "--threshold", "--max-entries", "--context", "--stacks"):
            if eq:
                value = inline
            else:
                i += 1
                if i >= len(tokens):
                    raise UsageError(f"%cuda_memory: option {name} needs a value")
                value = tokens[i]
                # "--threshold 64 KiB": a separate unit word
                if name == "--threshold" and i + 1 < len(tokens) and \
                        tokens[i + 1].lower() in _UNIT and tokens[i + 1] != "":
                    i += 1
                    value += tokens[i]
            if name in ("-d", "--device"):
                args.device = value
            elif name == "--threshold":
                try:
                    args.threshold = parse_bytes(value)
                except ValueError as exc:
                    raise UsageError(f"%cuda_memory: --threshold: {exc}") from None
            elif name == "--max-entries":
                try:
                    args.max_entries = int(value)
                    if args.max_entries < 1:
                        raise ValueError
                except ValueError:
                    raise UsageError(f"%cuda_memory: --max-entries needs a positive integer, "
                                     f"got {value!r}") from None
            elif name == "--context":
                args.context = value
            else:
                args.stacks = value
        elif tok.startswith("-") and len(tok) > 1:
            raise UsageError(f"%cuda_memory: unknown option {tok!r} (see %cuda_memory?)")
        else:
            positional.append(tok)
        i += 1
    if positional:
        cmd = positional[0].lower().replace("_", "-")
        aliases = {"reset-peak": "reset-peaks", "reset_peaks": "reset-peaks",
                   "empty": "empty-cache", "empty_cache": "empty-cache"}
        cmd = aliases.get(cmd, cmd)
        if cmd not in _COMMANDS:
            raise UsageError(f"%cuda_memory: unknown subcommand {positional[0]!r}; use one of "
                             f"{', '.join(_COMMANDS)}")
        args.command = cmd
        args.words = positional[1:]
    return args


# =============================================================================== helpers
def _devices():
    from cudalab import devices

    return devices


def _resolve(spec: str | None, init: bool = True) -> int | None:
    """Device index for ``spec`` (None: current). ``init=False`` returns None instead of
    initialising CUDA."""
    devices = _devices()
    if not devices.is_initialized() and not init:
        return None
    from cudalab.errors import CudaUnavailableError

    try:
        devices.init()
    except CudaUnavailableError as exc:
        raise UsageError(f"%cuda_memory: {exc}") from None
    if spec is None:
        return devices.current_device()
    s = spec.strip()
    try:
        return devices._device_index(int(s) if s.isdigit() else s)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"%cuda_memory: bad device {spec!r}: {exc}") from None


def _simulated() -> bool:
    devices = _devices()
    return bool(devices.is_initialized() and devices._backend().simulated)


def _label(d: int) -> str:
    return f"cuda:{d}" + (" (simulated)" if _simulated() else "")


def _show(text: str, html_text: str | None = None) -> None:
    from IPython.display import display

    bundle = {"text/plain": text}
    if html_text is not None:
        bundle["text/html"] = html_text
    display(bundle, raw=True)


# =============================================================================== summary
_ROWS = (
    ("Allocated memory", "allocated_bytes", True),
    ("Active memory", "active_bytes", True),
    ("Requested memory", "requested_bytes", True),
    ("GPU reserved memory", "reserved_bytes", True),
    ("Non-releasable memory", "inactive_split_bytes", True),
    ("Allocations", "allocation", False),
    ("Active allocs", "active", False),
    ("GPU reserved segments", "segment", False),
    ("Non-releasable allocs", "inactive_split", False),
)
_COLS = (("current", "Cur Usage"), ("peak", "Peak Usage"), ("allocated", "Tot Alloc"),
         ("freed", "Tot Freed"))
_POOLS = (("all", ""), ("large_pool", "  from large pool"), ("small_pool", "  from small pool"))


def summary_data(device: int) -> dict[str, Any]:
    """Everything the summary shows, as plain data (also used by the tests)."""
    import cudalab.memory as cm

    stats = cm.memory_stats(device)
    free, total = _devices().mem_get_info(device)
    alloc = stats.get("allocated_bytes.all.current", 0)
    reserved = stats.get("reserved_bytes.all.current", 0)
    return {
        "device": device,
        "stats": stats,
        "allocated": alloc,
        "reserved": reserved,
        "gap": reserved - alloc,
        "num_ooms": stats.get("num_ooms", 0),
        "num_alloc_retries": stats.get("num_alloc_retries", 0),
        "num_sync_all_streams": stats.get("num_sync_all_streams", 0),
        "device_free": free,
        "device_total": total,
        "backend": cm.get_allocator_backend(),
        "simulated": _simulated(),
    }


def _cell(key: str, col: str, stats: dict, is_bytes: bool) -> str:
    v = stats.get(f"{key}.{col}", 0)
    return format_bytes(v) if is_bytes else str(v)


def summary_text(data: dict) -> str:
    st = data["stats"]
    d = data["device"]
    head = (f"cudalab memory summary, {_label(d)} ({data['backend']} allocator) | OOMs: "
            f"{data['num_ooms']} | cudaMalloc retries: {data['num_alloc_retries']}")
    lines = [head, f"{'':<28}" + "".join(f"{title:>12}" for _c, title in _COLS)]
    for title, key, is_bytes in _ROWS:
        for pool, suffix in _POOLS:
            label = title if pool == "all" else suffix
            lines.append(f"{label:<28}" + "".join(
                f"{_cell(f'{key}.{pool}', col, st, is_bytes):>12}" for col, _t in _COLS))
    gap, res = data["gap"], data["reserved"]
    pct = f" ({gap / res:.0%} of reserved)" if res else ""
    lines.append(f"reserved - allocated (cached, fragmentation): {format_bytes(gap)}{pct}")
    free, total = data["device_free"], data["device_total"]
    warn = "   <- less than 10% free" if total and free < 0.1 * total else ""
    lines.append(f"device free / total (driver, all processes): {format_bytes(free)} / "
                 f"{format_bytes(total)}{warn}")
    return "\n".join(lines)


def summary_html(data: dict) -> str:
    e = html.escape
    st = data["stats"]
    d = data["device"]
    out = ['<div class="cudalab-memory">',
           f"<b>cudalab memory summary</b>, {e(_label(d))}, {e(data['backend'])} allocator | "
           f"OOMs: {data['num_ooms']} | cudaMalloc retries: {data['num_alloc_retries']}",
           '<table style="border-collapse:collapse;font-family:monospace;font-size:12px">',
           "<tr><th></th>" + "".join(f"<th style='text-align:right'>{e(t)}</th>"
                                     for _c, t in _COLS) + "</tr>"]
    for title, key, is_bytes in _ROWS:
        for pool, suffix in _POOLS:
            label = title if pool == "all" else suffix.strip()
            style = "" if pool == "all" else " style='color:#666;padding-left:1.5em'"
            out.append(f"<tr><td{style}>{e(label)}</td>" + "".join(
                f"<td style='text-align:right'>{e(_cell(f'{key}.{pool}', col, st, is_bytes))}</td>"
                for col, _t in _COLS) + "</tr>")
    out.append("</table>")
    alloc, res, gap = data["allocated"], data["reserved"], data["gap"]
    free, total = data["device_free"], data["device_total"]
    other = max(0, total - free - res)
    if total:
        def seg(nbytes: int, color: str, title: str) -> str:
            w = 100.0 * nbytes / total
            return (f"<div title='{e(title)}' style='width:{w:.3f}%;background:{color};"
                    "height:100%;display:inline-block'></div>")

        out.append("<div style='width:100%;max-width:600px;height:14px;border:1px solid #999;"
                   "font-size:0;white-space:nowrap;margin-top:4px'>"
                   + seg(alloc, "#2563eb", f"allocated {format_bytes(alloc)}")
                   + seg(gap, "#93c5fd", f"cached (reserved - allocated) {format_bytes(gap)}")
                   + seg(other, "#9ca3af", f"used outside this allocator {format_bytes(other)}")
                   + "</div>")
        out.append("<div style='font-size:11px;color:#555'>blue: allocated, light blue: cached "
                   "by the allocator, grey: other device memory in use, white: free</div>")
    pct = f" ({gap / res:.0%} of reserved)" if res else ""
    out.append(f"<div>reserved − allocated (cached, fragmentation): {e(format_bytes(gap))}{pct}</div>")
    color = " style='color:#b91c1c;font-weight:bold'" if total and free < 0.1 * total else ""
    out.append(f"<div{color}>device free / total (driver, all processes): "
               f"{e(format_bytes(free))} / {e(format_bytes(total))}</div></div>")
    return "\n".join(out)


# =============================================================================== diff
_DIFF_KEYS = (
    ("allocated", "allocated_bytes.all.current", True),
    ("reserved", "reserved_bytes.all.current", True),
    ("active", "active_bytes.all.current", True),
    ("requested", "requested_bytes.all.current", True),
    ("non-releasable", "inactive_split_bytes.all.current", True),
    ("allocations (live)", "allocation.all.current", False),
    ("segments", "segment.all.current", False),
    ("bytes allocated (total)", "allocated_bytes.all.allocated", True),
    ("bytes freed (total)", "allocated_bytes.all.freed", True),
    ("allocation calls", "allocation.all.allocated", False),
    ("cudaMalloc calls", "num_device_alloc", False),
    ("cudaFree calls", "num_device_free", False),
    ("cudaMalloc retries", "num_alloc_retries", False),
    ("OOMs", "num_ooms", False),
)


class _Mark:
    __slots__ = ("device", "stats", "scope", "t")

    def __init__(self, device: int, stats: dict, scope: Any):
        self.device = device
        self.stats = stats
        self.scope = scope
        self.t = time.perf_counter()


def diff_data(mark: _Mark) -> dict[str, Any]:
    import cudalab.memory as cm

    now = cm.memory_stats(mark.device)
    rows = []
    for label, key, is_bytes in _DIFF_KEYS:
        a, b = mark.stats.get(key, 0), now.get(key, 0)
        rows.append({"what": label, "key": key, "at_mark": a, "now": b, "delta": b - a,
                     "bytes": is_bytes})
    start = mark.stats.get("allocated_bytes.all.current", 0)
    peak = mark.scope.peak_allocated if mark.scope is not None else None
    return {"device": mark.device, "rows": rows, "peak": peak,
            "peak_above_mark": None if peak is None else peak - start,
            "elapsed": time.perf_counter() - mark.t}


def diff_text(data: dict) -> str:
    lines = [f"cudalab memory diff since the mark, {_label(data['device'])} "
             f"({format_time(data['elapsed'])} ago)"]
    lines.append(f"{'':<26}{'at mark':>14}{'now':>14}{'change':>14}")
    for r in data["rows"]:
        f = (lambda v, s=False: format_bytes(v, s)) if r["bytes"] else (
            lambda v, s=False: (f"{v:+d}" if s else str(v)))
        lines.append(f"{r['what']:<26}{f(r['at_mark']):>14}{f(r['now']):>14}"
                     f"{f(r['delta'], True):>14}")
    if data["peak"] is not None:
        lines.append(f"peak allocated since the mark: {format_bytes(data['peak'])} "
                     f"({format_bytes(data['peak_above_mark'], True)} above the mark; scoped, "
                     "no peak statistic was reset)")
    return "\n".join(lines)


def diff_html(data: dict) -> str:
    e = html.escape
    out = [f"<div><b>cudalab memory diff</b> since the mark, {e(_label(data['device']))} "
           f"({e(format_time(data['elapsed']))} ago)",
           '<table style="border-collapse:collapse;font-family:monospace;font-size:12px">'
           "<tr><th></th><th>at mark</th><th>now</th><th>change</th></tr>"]
    for r in data["rows"]:
        if r["bytes"]:
            a, b, c = (format_bytes(r["at_mark"]), format_bytes(r["now"]),
                       format_bytes(r["delta"], True))
        else:
            a, b, c = str(r["at_mark"]), str(r["now"]), f"{r['delta']:+d}"
        color = "" if r["delta"] == 0 else (" style='color:#b91c1c'" if r["delta"] > 0
                                            else " style='color:#15803d'")
        out.append(f"<tr><td>{e(r['what'])}</td><td style='text-align:right'>{e(a)}</td>"
                   f"<td style='text-align:right'>{e(b)}</td>"
                   f"<td style='text-align:right'{color}>{e(c)}</td></tr>")
    out.append("</table>")
    if data["peak"] is not None:
        out.append(f"<div>peak allocated since the mark: {e(format_bytes(data['peak']))} "
                   f"({e(format_bytes(data['peak_above_mark'], True))} above the mark)</div>")
    out.append("</div>")
    return "\n".join(out)


# =============================================================================== watch
def _record(ev: Any, stream: Any) -> None:
    """``ev.record(stream)`` by handle when the event exists (a failed record, e.g. another
    context current for the null stream, goes through Event.record, which fixes or raises)."""
    h = ev._handle
    if h is None or ev._rec(h, stream._handle)[0]:
        ev.record(stream)


class _Watch:
    """pre/post_run_cell hooks printing one line per cell (see the module documentation).

    Per cell: ``pre`` opens a :class:`~cudalab.allocator.scope.PeakScope` and records the
    device's start event on its current stream (one driver call); ``post`` closes the scope
    and, only when a line is printed, records the end event and reads ``elapsed_time``,
    waiting for the end first only when it is not reached yet (``watch_sync``; "GPU
    running" otherwise): three driver calls per printed line (five when it waits), one per
    cell under the threshold. With no threshold (every cell prints) the end event is
    recorded first and the line built before the GPU time is read, so the GPU's latency
    from record to completion overlaps that work. The memory part of the line is reused
    while a cell leaves the numbers as the last one did. No dict, list or DataFrame is
    built.
    """

    def __init__(self, magics: Any, device: int | None, threshold: int):
        self.magics = magics
        self.device = device  # None: the current device at each cell start
        self.threshold = threshold
        self.scope: Any = None
        self.events: dict[int, tuple[Any, Any]] = {}  # device -> (start, end), made once
        self.ev_started: Any = None  # the (start, end) pair whose start this cell recorded
        self.t0 = 0.0
        self.dev = 0
        self.last_line: str | None = None
        self._sim: str | None = None  # ", simulated" or "", once CUDA is initialised
        from cudalab import devices, streams
        from cudalab.events import Event
        from cudalab.allocator.scope import PeakScope

        self._devices = devices
        self._current_stream = streams.current_stream
        self._head_key: tuple | None = None  # the last line's memory part, reused while equal
        self._head = ""
        self._Event = Event
        self._PeakScope = PeakScope
        self._scopes: dict[int, Any] = {}  # one PeakScope per device, restarted every cell

    def pre(self, info: Any = None) -> None:
        if getattr(info, "silent", False):
            return
        scope = self.scope
        if scope is not None and scope.running:  # a nested or repeated pre
            try:
                scope.stop()
            except RuntimeError:
                pass
        devices = self._devices
        init = devices._initialized
        d = self.device if self.device is not None else (devices._tls.device if init else 0)
        self.dev = d
        if init:
            scope = self._scopes.get(d)
            if scope is None:
                scope = self._scopes[d] = self._PeakScope(d)
            self.scope = scope.start()
        else:
            self.scope = self._PeakScope(None).start()
        self.ev_started = None
        if init:
            try:
                pair = self.events.get(d)
                if pair is None:
                    ev = self._Event
                    pair = self.events[d] = (ev(enable_timing=True), ev(enable_timing=True))
                _record(pair[0], self._current_stream(d))
                self.ev_started = pair
            except Exception:
                self.ev_started = None
        self.t0 = time.perf_counter()

    def post(self, result: Any = None) -> None:
        scope = self.scope
        if scope is None or not scope.running:
            return
        info = getattr(result, "info", None)
        if getattr(info, "silent", False):
            return
        wall = time.perf_counter() - self.t0
        thr = self.threshold
        pair = self.ev_started
        gpu_text = "GPU n/a" if self._devices._initialized else "no CUDA context"
        ended = False
        if pair is not None and thr <= 0:
            # Every cell prints: record the end now, so that the GPU reaches it while the
            # line below is built (the wait for it is then mostly over).
            ended = self._end(pair)
            if not ended:
                pair = None
        scope.stop()
        self.scope = None
        start_alloc = scope.start_allocated
        d_alloc = scope.end_allocated - start_alloc
        d_res = scope.end_reserved - scope.start_reserved
        peak = scope.peak_allocated
        over = peak - start_alloc
        if thr > 0 and abs(d_alloc) < thr and abs(d_res) < thr and over < thr:
            self.last_line = None  # nothing printed: no end event, no wait
            return
        key = (scope.device, d_alloc, d_res, peak, over)
        if key == self._head_key and self._sim is not None:
            head = self._head  # a cell that left memory as the last one did
        else:
            sim = self._sim
            if sim is None:
                sim = ", simulated" if _simulated() else ""
                if self._devices._initialized:
                    self._sim = sim  # the backend never changes once CUDA is initialised
            head = self._head = (
                f"[cudalab watch cuda:{scope.device}{sim}] Δallocated {format_bytes(d_alloc, True)}"
                f" | Δreserved {format_bytes(d_res, True)} | peak {format_bytes(peak)}"
                f" ({format_bytes(over, True)} in cell) | ")
            self._head_key = key
        tail = f" | wall {format_time(wall)}"
        if pair is not None and (ended or self._end(pair)):
            try:
                ms = self._gpu_ms(*pair)
                gpu_text = "GPU running" if ms is None else f"GPU {format_time(ms / 1e3)}"
            except Exception:
                gpu_text = "GPU n/a"
        line = self.last_line = head + gpu_text + tail
        sys.stdout.write(line + "\n")  # one write (print makes two)

    def _gpu_ms(self, start: Any, end: Any) -> float | None:
        """The cell's GPU milliseconds: elapsed time is read first (by handle), and only if
        the end event is not reached yet is it waited for (``watch_sync``; None without)
        and read again, so a cell whose GPU work is over costs one driver call here. A
        failed status is read again through ``Event.elapsed_time``, which raises the
        driver's error."""
        fast = self._devices._fast.event_elapsed_time
        r = fast(start._handle, end._handle)
        if r[0]:
            if r[0] != _NOT_READY:
                return start.elapsed_time(end)
            if not self.magics.watch_sync:
                return None
            end.synchronize()
            r = fast(start._handle, end._handle)
            if r[0]:
                return start.elapsed_time(end)
        return r[1]

    def _end(self, pair: tuple[Any, Any]) -> bool:
        """Record the cell's end event on the current stream (False if that failed)."""
        try:
            _record(pair[1], self._current_stream(self.dev))
            return True
        except Exception:
            return False

    def stop(self) -> None:
        if self.scope is not None and self.scope.running:
            try:
                self.scope.stop()
            except RuntimeError:
                pass
        self.scope = None


# =============================================================================== state
class MemoryState:
    """What ``%cuda_memory`` keeps between calls: marks, the watch, the history handle."""

    def __init__(self, magics: Any):
        self.magics = magics
        self.marks: dict[int, _Mark] = {}
        self.watch: _Watch | None = None
        self.history: Any = None  # HistoryRecording started by the magic

    def watch_on(self, device: int | None, threshold: int) -> str:
        if self.watch is not None:
            self.watch.threshold = threshold
            self.watch.device = device
            return f"cudalab watch: already on; threshold {format_bytes(threshold)}"
        w = _Watch(self.magics, device, threshold)
        self.magics._add_hook("pre_run_cell", w.pre)
        self.magics._add_hook("post_run_cell", w.post)
        self.watch = w
        where = f"cuda:{device}" if device is not None else "the current device"
        thr = f"changes of at least {format_bytes(threshold)}" if threshold > 0 else "every cell"
        return f"cudalab watch: on for {where}, reporting {thr} (scoped peaks; no thread)"

    def watch_off(self) -> str:
        w = self.watch
        if w is None:
            return "cudalab watch: already off"
        self.magics._remove_hook("pre_run_cell", w.pre)
        self.magics._remove_hook("post_run_cell", w.post)
        w.stop()
        self.watch = None
        return "cudalab watch: off"

    def mark(self, device: int) -> _Mark:
        import cudalab.memory as cm

        old = self.marks.pop(device, None)
        if old is not None and old.scope is not None and old.scope.running:
            old.scope.stop()
        scope = cm.peak_scope(device).start()
        m = self.marks[device] = _Mark(device, dict(cm.memory_stats(device)), scope)
        return m

    def close(self) -> None:
        if self.watch is not None:
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


def _history(magics: Any, args: _Args) -> Any:
    import cudalab.memory as cm
    from cudalab.memory_tools import history as hist

    st = _state(magics)
    sub = args.words[0].lower() if args.words else "status"
    if sub == "start":
        if st.history is not None and hist.is_recording():
            print(f"cudalab history: already recording ({_settings_text(hist.history_settings())})")
            return None
        kwargs: dict[str, Any] = {}
        if args.max_entries is not None:
            kwargs["max_entries"] = args.max_entries
        for key in ("context", "stacks"):
            value = getattr(args, key)
            if value is not None:
                kwargs[key] = None if value.lower() == "none" else value
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
            hist._stop(clear=False)  # started by user code: stop, keep the entries readable
        else:
            print("cudalab history: not recording")
            return None
        print(f"cudalab history: stopped; {_history_entries()} entries kept "
              "('%cuda_memory history save PATH' or 'frame')")
        return None
    if sub == "save":
        if len(args.words) < 2:
            raise UsageError("%cuda_memory history save PATH (.pickle for memory_viz, .csv, "
                             ".json for Perfetto)")
        path = args.words[1]
        low = path.lower()
        n = _history_entries()
        if low.endswith(".csv"):
            cm.history_frame().to_csv(path, index=False)
            kind = "CSV (cudalab.memory.read_history_csv reads it back)"
        elif low.endswith(".json") or low.endswith(".json.gz"):
            cm.export_perfetto(path)
            kind = "Perfetto/Chrome trace JSON (open in ui.perfetto.dev)"
        else:
            cm._dump_snapshot(path)
            kind = "torch snapshot pickle (open at https://pytorch.org/memory_viz)"
        print(f"cudalab history: wrote {n} entries to {path}: {kind}")
        return None
    if sub == "frame":
        return cm.history_frame(device=None if args.device is None else _resolve(args.device))
    if sub == "status":
        s = hist.history_settings()
        state = f"recording ({_settings_text(s)})" if s else "not recording"
        print(f"cudalab history: {state}; {_history_entries()} entries held")
        return None
    raise UsageError(f"%cuda_memory history: unknown action {sub!r}; use start, stop, save PATH "
                     "or frame")


class SnapshotDict(dict):
    """torch's ``_snapshot()`` dict with a one-line repr (notebooks would print megabytes)."""

    def _summary(self) -> str:
        segs = self.get("segments", [])
        blocks = sum(len(s.get("blocks", [])) for s in segs)
        total = sum(s.get("total_size", 0) for s in segs)
        traces = sum(len(t) for t in self.get("device_traces", []))
        return (f"cudalab memory snapshot: {len(segs)} segments, {blocks} blocks, "
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


def _snapshot(args: _Args) -> Any:
    import cudalab.memory as cm

    if args.words and args.words[0].lower() == "dict":
        return SnapshotDict(cm._snapshot())
    if args.words and args.words[0].lower() == "view":
        cls = _widget_class("SnapshotViewer", "%cuda_memory snapshot view")
        if cls is None:
            return None
        return cls(args.words[1] if len(args.words) > 1 else None)
    if args.words:
        path = args.words[0]
        cm.export_memory_viz(path)
        snap = SnapshotDict(cm._snapshot())
        print(f"{snap._summary()}; wrote {path} (open it at https://pytorch.org/memory_viz; the "
              "file is read in the browser, not uploaded)")
        return None
    snap = SnapshotDict(cm._snapshot())
    try:  # the viewer where the widgets can load (issue 7: "%cuda_memory snapshot")
        from cudalab.widgets import SnapshotViewer
    except ImportError:
        return snap
    return SnapshotViewer(snap)


def _dashboard(magics: Any, args: _Args) -> Any:
    cls = _widget_class("MemoryDashboard", "%cuda_memory dashboard")
    if cls is None:
        return None
    kwargs: dict[str, Any] = {}
    if args.device is not None:
        kwargs["devices"] = _resolve(args.device)
    dash = cls(**kwargs)
    magics._dashboards.append(dash)
    return dash


# =============================================================================== entry
def run_cuda_memory(magics: Any, line: str) -> Any:
    """The body of ``%cuda_memory`` (see its docstring)."""
    args = _parse(line)
    cmd = args.command
    if cmd == "summary":
        d = _resolve(args.device, init=args.device is not None)
        if d is None:
            print("cudalab memory: CUDA is not initialised yet, so cudalab has allocated nothing "
                  "(no context was created)")
            return None
        data = summary_data(d)
        _show(summary_text(data), summary_html(data))
        return None
    if cmd == "stats":
        import cudalab.memory as cm

        devs = None if args.device is None else [_resolve(args.device)]
        if devs is None:
            _resolve(None)
        try:
            frame = cm.stats_frame(devs)
        except ImportError:
            return cm.memory_stats(devs[0] if devs else None)
        frame.attrs["simulated"] = _simulated()
        if frame.attrs["simulated"]:
            frame.index.name = "device (simulated)"
        return frame
    if cmd == "mark":
        d = _resolve(args.device)
        m = _state(magics).mark(d)
        print(f"cudalab memory: mark set on {_label(d)} (allocated "
              f"{format_bytes(m.stats.get('allocated_bytes.all.current', 0))}, reserved "
              f"{format_bytes(m.stats.get('reserved_bytes.all.current', 0))}); "
              "'%cuda_memory diff' shows the changes and the peak since")
        return None
    if cmd == "diff":
        d = _resolve(args.device)
        m = _state(magics).marks.get(d)
        if m is None:
            raise UsageError(f"%cuda_memory diff: no mark on cuda:{d}; run '%cuda_memory mark' "
                             "first")
        data = diff_data(m)
        _show(diff_text(data), diff_html(data))
        return None
    if cmd == "reset-peaks":
        import cudalab.memory as cm

        d = _resolve(args.device)
        cm.reset_peak_memory_stats(d)
        print(f"cudalab memory: peak statistics of {_label(d)} reset (max_memory_allocated is "
              f"now {format_bytes(cm.max_memory_allocated(d))}); scoped peaks (watch, marks) "
              "keep theirs")
        return None
    if cmd == "empty-cache":
        import cudalab.memory as cm

        devices = _devices()
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
            device = None if args.device is None else _resolve(args.device)
            thr = magics.watch_threshold if args.threshold is None else args.threshold
            print(st.watch_on(device, thr))
        elif word in ("off", "stop"):
            print(st.watch_off())
        else:
            raise UsageError("%cuda_memory watch on|off [--threshold BYTES] [-d DEV]")
        return None
    if cmd == "history":
        return _history(magics, args)
    if cmd == "snapshot":
        return _snapshot(args)
    if cmd == "dashboard":
        return _dashboard(magics, args)
    raise UsageError(f"%cuda_memory: unknown subcommand {cmd!r}")  # pragma: no cover
