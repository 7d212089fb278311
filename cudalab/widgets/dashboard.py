"""``MemoryDashboard``: a live allocator + NVML panel in the notebook (ipywidgets 8).

::

    from cudalab.widgets import MemoryDashboard
    dash = MemoryDashboard()          # every device, a sample every 0.5 s, 600 samples kept
    dash                              # shows it; dash.close() stops it

Per device it shows allocated / reserved / peak against the device's capacity (a bar with
the peak as a tick, NVML's count of everything else on the device in grey), a time series of
allocated, reserved and NVML-used bytes over the last ``window`` samples, utilization,
temperature, power and SM clock, the allocator's allocation counts, OOMs and cudaMalloc
retries, and this process's GPU memory against all processes' (NVML's process list). The
title turns orange at ``warn`` (80 %) and red at ``danger`` (90 %) of capacity.

How it stays cheap and safe:

* one daemon sampler thread per dashboard asks its source
  (:class:`~cudalab.memory_tools.samples.SampleSource`; by default
  :class:`~cudalab.memory_sources.CudalabSource`: ``memory_stats`` and NVML) for a
  :class:`~cudalab.memory_tools.samples.DeviceSample` of each device every
  ``interval`` seconds into ring buffers and pushes widget updates inside ``hold_sync``, at
  most ``max_rate`` pushes per second; it never prints and never uses ``Output`` widgets (both
  misbehave from threads under ipykernel 7); errors show in the status line;
* only values that changed are sent (traitlets drops equal assignments; the chart image is
  re-sent only when its pixels changed): a few hundred bytes of HTML and a palette PNG of
  about 1 KB per device per tick, whatever the window;
* the thread holds only a weak reference to the dashboard and stops on :meth:`close`, on
  :func:`close_all` (which ``%unload_ext cudalab`` calls), at interpreter exit (atexit) and
  when the dashboard is no longer referenced: ipywidgets' own bookkeeping (its registry of
  open widgets, the comm's message callback, the buttons' callbacks) holds it only weakly,
  so a dashboard that was dropped before it was shown is collected, closed, and its thread
  ends. A dashboard that was displayed (``display(d)`` or a cell's result) is held until it
  is closed, as any widget on screen.

A saved or nbconvert'ed notebook shows a static picture: ``_repr_mimebundle_`` adds an
``image/png`` drawn with matplotlib (a dependency of cudalab); without
matplotlib it adds ``text/html`` (a table and the sparkline) instead.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import html
import io
import math
import threading
import time
import weakref
from typing import Any

import ipywidgets as W
import ipywidgets.widgets.widget as _widget_module
import numpy as np

from cudalab import _internal
from cudalab._internal import format_bytes
from cudalab.memory_sources import CudalabSource, SourceUnavailableError, resolve_sources
from cudalab.memory_tools.samples import DeviceSample, SampleSource
from cudalab.widgets.dashboard_chart import draw_chart, nice_max, palette_png
from cudalab.widgets.dashboard_device import DashboardDevice, figures_text, pools_html

__all__ = ["MemoryDashboard", "close_all", "live_dashboards"]

_live: weakref.WeakSet = weakref.WeakSet()
#: Dashboards that were displayed (``display(d)`` or a cell's result), held until closed:
#: one on screen keeps sampling even when no variable names it (``display(Dashboard())``),
#: as any ipywidget shown; one dropped before it was shown is collected.
_shown: set = set()
_THREAD_NAME = "cudalab-dashboard-sampler"
#: Sampling intervals are in (0, MAX_INTERVAL] seconds (one day); shorter than MIN_INTERVAL
#: counts as MIN_INTERVAL.
MIN_INTERVAL, MAX_INTERVAL = 0.02, 86400.0

_ALLOC_C, _RES_C, _OTHER_C = "#1f77b4", "#fdae6b", "#bdbdbd"
_WARN_C, _DANGER_C, _OK_C = "#e6550d", "#d62728", "#31a354"


def live_dashboards() -> list[MemoryDashboard]:
    """The dashboards not yet closed."""
    return [d for d in list(_live) if not d._closed]


def close_all() -> int:
    """Close every live dashboard (stops their sampler threads; ``%unload_ext cudalab`` calls
    this). Returns how many were closed."""
    n = 0
    for d in live_dashboards():
        d.close()
        n += 1
    return n


def _stop_threads_at_exit() -> None:
    """atexit: stop the samplers without touching the comms (the kernel may be gone)."""
    for d in list(_live):
        d._stop_sampler(timeout=0.5)


atexit.register(_stop_threads_at_exit)



def _seconds(value: Any, name: str, low: float = 0.0, high: float = MAX_INTERVAL) -> float:
    """``value`` as a float in (``low``, ``high``]: ValueError (TypeError for a non-number)
    naming ``name`` otherwise. NaN and infinities are refused: a NaN interval made the
    sampler spin, an infinite one killed it with OverflowError."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number of seconds, got {value!r}")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number of seconds, got "
                        f"{type(value).__name__} {_internal.echo(value)}") from None
    if not (math.isfinite(x) and low < x <= high):
        raise ValueError(f"{name} must be in ({low:g}, {high:g}] seconds, got {x!r}")
    return x


def _weak_callback(owner: Any, method: str) -> Any:
    """A callback that calls ``owner.<method>`` while ``owner`` lives, without keeping it
    alive (for ipywidgets, which holds its callbacks as long as the widget is open)."""
    ref = weakref.ref(owner)

    def call(*args: Any) -> Any:
        target = ref()
        if target is not None:
            return getattr(target, method)(*args)
        return None

    return call


def _pct(v: int, cap: int) -> float:
    return 100.0 * v / cap if cap else 0.0


def _level(frac: float, warn: float, danger: float) -> str:
    return "danger" if frac >= danger else "warn" if frac >= warn else "ok"


def _device_indices(devices: Any) -> list[int]:
    import cudalab

    if devices is None:
        return list(range(cudalab.device_count()))
    if isinstance(devices, (int, str)) or isinstance(getattr(devices, "index", None), int):
        return [_internal.device_index(devices)]
    return [_internal.device_index(d) for d in devices]


def _given_indices(devices: Any) -> list[int]:
    """A remote source's device indices, as given (ints >= 0; never checked locally)."""
    values = [devices] if isinstance(devices, int) else list(devices or ())
    if not all(type(d) is int and d >= 0 for d in values):
        raise ValueError(f"a remote source's devices are ints >= 0, got {values!r:.60}")
    return values


# --------------------------------------------------------------------------- the widget
class MemoryDashboard(W.VBox):
    """A live memory dashboard for ``devices`` (None: every device).

    ``interval``: seconds between samples, in (0, 86400] (less than 0.02 counts as 0.02; it
    can be changed while running); ``window``: samples kept per device (the time series spans
    ``window * interval`` seconds); ``max_rate``: widget pushes per second at most, in
    (0, 1000] (less than 0.1 counts as 0.1; samples in between still land in the ring
    buffers); ``warn``/``danger``:
    fractions of capacity (reserved, or NVML's used when larger) that colour the panel;
    ``fallback``: add the static PNG/HTML picture to the display bundle; ``start``: start
    the sampler thread now (else call :meth:`start`); ``source``: where the samples come
    from and what the buttons do: a :class:`~cudalab.memory_tools.samples.SampleSource`,
    several, or a name of :func:`cudalab.memory_sources.resolve_sources` (``"torch"``,
    ``"cupy"``, ``"process"``, ``"auto"``: every allocator present and the process's
    remainder, a panel per device and source, each labelled); default: cudalab's allocator
    and NVML, :class:`~cudalab.memory_sources.CudalabSource`. The dashboard renders the
    sources' samples only: it never reads an allocator or NVML. A source that fails (torch
    gone from the process, ...) is reported in its panel and the status line; the others
    keep sampling.

    Attributes: :attr:`samples` (per device, the ring buffers as numpy arrays via
    :meth:`history`), :attr:`latest` (per device, the last sample's values, as
    :meth:`DeviceSample.to_dict`), :attr:`last_samples` (per device, the last
    :class:`~cudalab.memory_tools.samples.DeviceSample`), :attr:`snapshots` (what the
    "Take snapshot" button took).

    Raises ValueError for an ``interval`` or ``max_rate`` that is NaN, infinite or outside its
    range (TypeError for one that is not a number), here and when set later.

    The dashboard lives as long as something outside ipywidgets references it (see the
    module's doc): drop every reference and it is closed and its sampler thread ends.
    """

    def __init__(self, devices: Any = None, interval: float = 0.5, window: int = 600, *,
                 max_rate: float = 10.0, warn: float = 0.8, danger: float = 0.9,
                 fallback: bool = True, start: bool = True, chart_size: tuple[int, int] = (300, 64),
                 source: SampleSource | str | Any = None):
        # What close() reads, set first: ipywidgets' __del__ calls close() even on a
        # dashboard whose construction failed.
        self._closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._viewer: Any = None
        interval = _seconds(interval, "MemoryDashboard interval")  # (before any widget opens)
        max_rate = _seconds(max_rate, "MemoryDashboard max_rate", high=1000.0)
        super().__init__()
        self._hold_weakly()
        self.interval = interval
        self.window = max(int(window), 2)
        self.max_rate = max_rate
        self.warn, self.danger = float(warn), float(danger)
        self.fallback = bool(fallback)
        self.chart_size = (int(chart_size[0]), int(chart_size[1]))
        #: seconds between redraws of the time-series image (numbers update every push);
        #: None: max(interval, 0.5)
        self.chart_interval: float | None = None
        self.snapshots: list[dict] = []
        self._paused = False
        self._lock = threading.RLock()
        self._n = 0
        self._last_push = 0.0
        self._error = ""
        self._note = ""
        self._note_time = self._error_time = 0.0
        #: The sources read, in panel order (``resolve_sources(source)``); ``source`` is the
        #: first (the only one unless several were asked for).
        self.sources: tuple[SampleSource, ...] = (
            (CudalabSource(),) if source is None else resolve_sources(source))
        self.source: SampleSource = self.sources[0]
        # A source of another process (``remote``: a rank of cudalab.cluster) names its own
        # devices: its indices are taken as given and it says whether it is simulated.
        remote = all(getattr(src, "remote", False) for src in self.sources)
        indices = _given_indices(devices) if remote else _device_indices(devices)
        self._devices = [DashboardDevice(d, self.window, src) for d in indices
                         for src in self.sources]
        simulated = False
        if self._devices:
            simulated = bool(getattr(self.source, "simulated", False) if remote
                             else _internal.backend().simulated)
        self.simulated = simulated

        self._pause = W.ToggleButton(value=False, description="Pause", icon="pause",
                                     tooltip="pause/resume sampling",
                                     layout=W.Layout(width="auto"))
        self._reset = W.Button(description="Reset peaks", icon="undo",
                               tooltip="reset_peak_memory_stats() on these devices (global: "
                                       "every reader's max_memory_allocated)",
                               layout=W.Layout(width="auto"))
        self._empty = W.Button(description="Empty cache", icon="trash",
                               tooltip="empty_cache(): release cached, unused memory",
                               layout=W.Layout(width="auto"))
        self._snap = W.Button(description="Take snapshot", icon="camera",
                              tooltip="take a memory snapshot (cudalab.memory._snapshot()) "
                                      "and open it below",
                              layout=W.Layout(width="auto"))
        # Weak callbacks: the buttons live in ipywidgets' registry as long as they are open,
        # and must not keep the dashboard alive through them.
        self._pause.observe(_weak_callback(self, "_on_pause"), "value")
        self._reset.on_click(_weak_callback(self, "_on_reset"))
        self._empty.on_click(_weak_callback(self, "_on_empty"))
        self._snap.on_click(_weak_callback(self, "_on_snapshot"))
        self._status = W.HTML()
        self._snapshot_box = W.VBox()
        legend = W.HTML(
            '<span style="font-size:11px">'
            f'<span style="color:{_ALLOC_C}">&#9632;</span> allocated '
            f'<span style="color:#e6550d">&#9632;</span> reserved '
            '<span style="color:#8c8c8c">&#9632;</span> NVML used '
            '<span style="color:#d62728">&#8943;</span> capacity</span>')
        self._panels: list[dict[str, W.Widget]] = []
        rows: list[W.Widget] = [W.HBox([self._pause, self._reset, self._empty, self._snap,
                                        self._status],
                                       layout=W.Layout(align_items="center", flex_flow="row wrap"))]
        for _ in self._devices:
            p = {"title": W.HTML(), "chart": W.Image(format="png", width=self.chart_size[0],
                                                      height=self.chart_size[1]),
                 "scale": W.HTML(), "mem": W.HTML(layout=W.Layout(width="100%")),
                 "nvml": W.HTML(), "counts": W.HTML(), "pools": W.HTML(), "procs": W.HTML()}
            self._panels.append(p)
            left = W.VBox([p["chart"], W.HBox([p["scale"], legend])],
                          layout=W.Layout(flex="0 0 auto"))
            right = W.VBox([p["mem"], p["nvml"], p["counts"], p["pools"], p["procs"]],
                           layout=W.Layout(flex="1 1 320px", min_width="260px",
                                           padding="0 0 0 10px"))
            rows.append(W.VBox([p["title"], W.HBox([left, right],
                                                  layout=W.Layout(flex_flow="row wrap"))],
                               layout=W.Layout(border="1px solid var(--jp-border-color2, #ddd)",
                                               padding="4px 8px", margin="4px 0")))
        if not self._devices:
            rows.append(W.HTML("<i>No CUDA device is visible: nothing to show.</i>"))
        rows.append(self._snapshot_box)
        self.children = tuple(rows)
        self.add_class("cudalab-memory-dashboard")
        _live.add(self)
        if self._devices:
            self.refresh()  # a first sample, so the first display already shows numbers
        if start and self._devices:
            self.start()

    # ----------------------------------------------------------------- lifecycle
    @property
    def interval(self) -> float:
        """Seconds between samples, in (0, 86400] (read by the sampler at each tick)."""
        return self._interval

    @interval.setter
    def interval(self, value: float) -> None:
        self._interval = max(_seconds(value, "MemoryDashboard interval"), MIN_INTERVAL)

    @property
    def max_rate(self) -> float:
        """Widget pushes per second at most, in (0, 1000]."""
        return self._max_rate

    @max_rate.setter
    def max_rate(self, value: float) -> None:
        self._max_rate = max(_seconds(value, "MemoryDashboard max_rate", high=1000.0), 0.1)

    def _hold_weakly(self) -> None:
        """Make ipywidgets' hold on this (just opened) widget weak.

        ipywidgets keeps every open widget in its registry (``_instances``) and in its
        comm's message callback until it is closed, so a dashboard nobody references would
        live, and sample, forever. The comm now reaches it through a weak callback and the
        registry forgets it (its children stay there: they hold no strong reference back);
        when it is collected, ipywidgets' ``__del__`` closes it, and :meth:`close` its
        children. The price: the frontend cannot ask for the dashboard's state again after
        a page reload (run its cell again). Without the registry (another ipywidgets) the
        dashboard is held as before, until closed.
        """
        comm = self.comm
        if comm is None:
            return
        comm.on_msg(_weak_callback(self, "_handle_msg"))
        registry = getattr(_widget_module, "_instances", None)
        if isinstance(registry, dict) and registry.get(self.model_id) is self:
            del registry[self.model_id]

    def start(self) -> None:
        """Start the sampler thread (no-op if it runs or the dashboard is closed)."""
        if self._closed or (self._thread is not None and self._thread.is_alive()):
            return
        self._stop.clear()
        t = threading.Thread(target=_sampler, args=(weakref.ref(self), self._stop),
                             name=_THREAD_NAME, daemon=True)
        self._thread = t
        t.start()
        with self._lock:
            self._status.value = self._status_html()

    def _stop_sampler(self, timeout: float = 2.0) -> None:
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
        if t is not None and not t.is_alive():
            self._thread = None

    @property
    def running(self) -> bool:
        """Whether the sampler thread is alive."""
        t = self._thread
        return t is not None and t.is_alive()

    def close(self) -> None:
        """Stop the sampler thread and close every widget of the dashboard (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop_sampler()
        _live.discard(self)
        _shown.discard(self)
        if self._viewer is not None:
            with contextlib.suppress(Exception):
                self._viewer.close()
        for w in _descendants(self):
            with contextlib.suppress(Exception):
                w.close()
        super().close()

    # ----------------------------------------------------------------- sampling
    def refresh(self) -> None:
        """Take a sample now and push it to the widgets (what every tick does)."""
        with self._lock:
            if self._closed:
                return
            self._sample()
            self._push()

    def _tick(self) -> None:
        """One sampler-thread tick: sample; push when the rate cap allows."""
        with self._lock:
            if self._closed or self._paused:
                return
            self._sample()
            if time.monotonic() - self._last_push >= 1.0 / self.max_rate - 1e-3:
                self._push(force_chart=False)

    def _sample(self) -> None:
        now = time.time()
        for dev in self._devices:
            try:
                dev.sample(now)
                dev.error = ""
            except Exception as exc:  # a source that went away: said in its panel
                dev.error = f"{type(exc).__name__}: {exc}"
                self._set_error(exc)
        self._n += 1

    @property
    def latest(self) -> dict[int, dict[str, Any]]:
        """Per device index, the values of the last sample (bytes, %, °C, mW, MHz, counts;
        :meth:`DeviceSample.to_dict`)."""
        return {dev.index: {} if dev.last is None else dev.last.to_dict()
                for dev in reversed(self._devices)}  # (the first source's, with several)

    @property
    def last_samples(self) -> dict[int, DeviceSample | None]:
        """Per device index, the last :class:`~cudalab.memory_tools.samples.DeviceSample`
        (None before the first) of the first source (see :attr:`by_source` for all)."""
        return {dev.index: dev.last for dev in reversed(self._devices)}

    @property
    def by_source(self) -> dict[tuple[str, int], DeviceSample | None]:
        """Per ``(source name, device index)``, the last sample (None before the first)."""
        return {(dev.source.name, dev.index): dev.last for dev in self._devices}

    def history(self, device: int | None = None, source: str | None = None
                ) -> dict[str, np.ndarray]:
        """The ring buffers of ``device`` (default: the first) and ``source`` (a source's
        name; default: the first): time (s since the epoch), allocated, reserved, nvml_used
        (bytes) as numpy arrays."""
        dev = next(d for d in self._devices if (device is None or d.index == device)
                   and (source is None or d.source.name == source))
        return {"time": np.fromiter(dev.t, np.float64, len(dev.t)),
                "allocated": np.fromiter(dev.allocated, np.int64, len(dev.allocated)),
                "reserved": np.fromiter(dev.reserved, np.int64, len(dev.reserved)),
                "nvml_used": np.fromiter(dev.nvml_used, np.int64, len(dev.nvml_used))}

    # ----------------------------------------------------------------- rendering
    def _push(self, force_chart: bool = True) -> None:
        """Assign the new values; each widget sends one message (hold_sync) and only if a
        value changed."""
        self._last_push = time.monotonic()
        updates: list[tuple[W.Widget, dict[str, Any]]] = []
        for dev, p in zip(self._devices, self._panels):
            try:
                updates += self._device_updates(dev, p, force_chart)
            except Exception as exc:  # never raise (or print) from the sampler thread
                self._set_error(exc)
        updates.append((self._status, {"value": self._status_html()}))
        changed = []
        for w, values in updates:
            diff = {k: v for k, v in values.items() if getattr(w, k) != v}
            if diff:
                changed.append((w, diff))
        with contextlib.ExitStack() as stack:
            for w, _ in changed:
                stack.enter_context(w.hold_sync())
            for w, values in changed:
                for k, v in values.items():
                    setattr(w, k, v)

    def _device_updates(self, dev: DashboardDevice, p: dict[str, W.Widget], force_chart: bool) -> list:
        s = dev.last
        if s is None:  # (no sample yet: the first one failed)
            return []
        cap = s.capacity
        used = s.nvml_used
        frac = max(s.reserved, used or 0) / cap if cap else 0.0
        level = _level(frac, self.warn, self.danger)
        out: list = [(p["title"], {"value": self._title_html(dev, level, frac)}),
                     (p["mem"], {"value": self._mem_html(s, cap, level)}),
                     (p["nvml"], {"value": self._nvml_html(dev, s)}),
                     (p["counts"], {"value": self._counts_html(s)}),
                     (p["pools"], {"value": pools_html(list(s.pools))}),
                     (p["procs"], {"value": self._procs_html(dev, s)})]
        now = time.monotonic()
        every = max(self.interval, 0.5) if self.chart_interval is None else self.chart_interval
        if force_chart or now - dev.chart_time >= every - 1e-3:
            dev.chart_time = now
            arrays = dev.arrays()
            top = max((float(a.max()) for a in arrays.values() if a.size), default=0.0)
            dev.ymax = nice_max(top * 1.05)
            w, h = self.chart_size
            png = palette_png(draw_chart(arrays, self.window, dev.ymax, cap, w, h))
            if png != dev.last_png:
                dev.last_png = png
                out.append((p["chart"], {"value": png}))
        ymax = dev.ymax
        span = self.window * self.interval
        span_txt = f"{span / 60:.0f} min" if span >= 120 else f"{span:.0f} s"
        out.append((p["scale"], {"value": f'<span style="font-size:11px;color:#777">0&ndash;'
                                          f'{format_bytes(ymax)}, last {span_txt}&nbsp;</span>'}))
        return out

    def _title_html(self, dev: DashboardDevice, level: str, frac: float) -> str:
        badge = ""
        if level != "ok":
            color = _DANGER_C if level == "danger" else _WARN_C
            word = "near capacity" if level == "danger" else "high"
            badge = (f' <span style="background:{color};color:#fff;padding:0 5px;border-radius:3px">'
                     f'{100 * frac:.0f}% used: {word}</span>')
        label = ""
        if len(self.sources) > 1 or dev.source.name != "cudalab":
            label = (f' &middot; <span class="cudalab-dash-source">'
                     f'{html.escape(dev.source.name)}</span>')
        if dev.error:
            badge += (f' <span style="color:{_DANGER_C}" class="cudalab-dash-source-error">'
                      f'{html.escape(dev.error[:200])}</span>')
        return (f'<div class="cudalab-dash-title" data-device="{dev.index}" '
                f'data-source="{html.escape(dev.source.name)}">'
                f'<b>cuda:{dev.index}</b> {html.escape(dev.name)}{label} &middot; '
                f'{format_bytes(dev.capacity)}{badge}</div>')

    def _mem_html(self, s: DeviceSample, cap: int, level: str) -> str:
        a, r, pk = s.allocated, s.reserved, s.peak_allocated
        other = max((s.nvml_used or 0) - r, 0)
        pa, pr, po, pp = (_pct(a, cap), _pct(r - a, cap), _pct(other, cap), _pct(pk, cap))
        border = {"ok": "#bbb", "warn": _WARN_C, "danger": _DANGER_C}[level]
        bar = (f'<div style="display:flex;height:12px;border:1px solid {border};position:relative;'
               f'background:var(--jp-layout-color2,#f4f4f4)">'
               f'<div style="width:{pa:.2f}%;background:{_ALLOC_C}"></div>'
               f'<div style="width:{pr:.2f}%;background:{_RES_C}"></div>'
               f'<div style="width:{po:.2f}%;background:{_OTHER_C}"></div>'
               f'<div style="position:absolute;left:{min(pp, 100):.2f}%;top:-2px;bottom:-2px;'
               f'width:2px;background:#000" title="peak allocated"></div></div>')
        return (f'<div class="cudalab-dash-mem" data-allocated="{a}" data-reserved="{r}" '
                f'data-peak="{pk}" data-capacity="{cap}">{bar}'
                f'allocated <b>{format_bytes(a)}</b> &middot; reserved <b>{format_bytes(r)}</b> &middot; '
                f'peak <b>{format_bytes(pk)}</b> &middot; {_pct(r, cap):.1f}% of {format_bytes(cap)}</div>')

    def _nvml_html(self, dev: DashboardDevice, s: DeviceSample) -> str:
        if s.nvml_error:
            return f'<span style="color:#777">{html.escape(s.nvml_error)}</span>'

        def v(x: Any, fmt: str) -> str:
            return "n/a" if x is None else fmt.format(x)

        return (f'<div class="cudalab-dash-nvml">util <b>{v(s.utilization, "{}%")}</b> '
                f'&middot; mem util {v(s.memory_utilization, "{}%")} &middot; '
                f'<b>{v(s.temperature, "{} &deg;C")}</b> &middot; '
                f'<b>{v(None if s.power_draw is None else s.power_draw / 1000, "{:.0f} W")}'
                f'</b> &middot; SM <b>{v(s.clock_rate, "{} MHz")}</b></div>')

    def _counts_html(self, s: DeviceSample) -> str:
        ooms, retries = s.num_ooms, s.num_alloc_retries
        note = (f'<div class="cudalab-dash-note" style="color:#777;font-size:11px">'
                f'{html.escape(s.note)}</div>' if s.note else "")
        red = f' style="color:{_DANGER_C}"'
        return (f'<div class="cudalab-dash-counts" data-ooms="{ooms}" data-retries="{retries}" '
                f'data-allocations="{s.allocations}">allocations <b>{s.allocations:,}</b> '
                f'live / {s.allocations_total:,} total &middot; segments {s.segments:,} '
                f'&middot; <span{red if ooms else ""}>OOMs <b>{ooms}</b></span> &middot; '
                f'<span{red if retries else ""}>retries <b>{retries}</b></span>'
                f'{note}</div>')

    def _procs_html(self, dev: DashboardDevice, s: DeviceSample) -> str:
        if s.nvml_error or s.processes is None:
            return ""
        mine = s.process_used
        mine_txt = "n/a" if mine is None else format_bytes(mine)
        return (f'<div class="cudalab-dash-procs">this process <b>{mine_txt}</b> &middot; '
                f'all {s.processes} process{"es" if s.processes != 1 else ""} '
                f'<b>{format_bytes(s.all_processes_used or 0)}</b> &middot; NVML used '
                f'{format_bytes(s.nvml_used or 0)}</div>')

    def _status_html(self) -> str:
        if self._paused:
            state = '<span style="color:#777">&#10074;&#10074; paused</span>'
        elif self.running:
            state = f'<span style="color:{_OK_C}">&#9679; live</span>'
        else:
            state = '<span style="color:#777">&#9675; stopped</span>'
        now = time.monotonic()  # notes and errors stay in the status line for 15 s
        extra = f" &middot; {self._note}" if self._note and now - self._note_time < 15 else ""
        if self._error and now - self._error_time < 15:
            extra += f' &middot; <span style="color:{_DANGER_C}">{html.escape(self._error)}</span>'
        sim = " &middot; simulated" if self.simulated else ""
        return (f'<span class="cudalab-dash-status" data-samples="{self._n}" '
                f'style="margin-left:6px">{state} every '
                f'{self.interval:g} s &middot; sample {self._n} &middot; '
                f'{time.strftime("%H:%M:%S")}{sim}{extra}</span>')

    def _set_note(self, text: str) -> None:
        self._note, self._note_time = text, time.monotonic()

    def _set_error(self, exc: BaseException) -> None:
        self._error, self._error_time = f"{type(exc).__name__}: {exc}", time.monotonic()

    # ----------------------------------------------------------------- controls
    def _on_pause(self, change: dict) -> None:
        self._paused = bool(change["new"])
        self._pause.description = "Resume" if self._paused else "Pause"
        self._pause.icon = "play" if self._paused else "pause"
        with self._lock:
            self._status.value = self._status_html()

    def _on_reset(self, _: Any = None) -> None:
        for dev in self._devices:
            try:
                dev.source.reset_peaks(dev.index)
            except Exception as exc:  # (a button's callback: said, never raised)
                self._set_error(exc)
        self._set_note("peaks reset")
        self.refresh()

    def _reserved(self) -> int:
        return sum(d.last.reserved for d in self._devices if d.last is not None)

    def _on_empty(self, _: Any = None) -> None:
        before = self._reserved()
        for source in self.sources:
            try:
                source.release_cache()
            except Exception as exc:
                self._set_error(exc)
        self.refresh()
        after = self._reserved()
        self._set_note(f"empty_cache released {format_bytes(max(before - after, 0))}")
        self.refresh()

    def _on_snapshot(self, _: Any = None) -> dict | None:
        from cudalab.widgets.snapshot_viewer import SnapshotViewer

        # torch's when it is watched, else the first source that keeps per-block state
        order = sorted(self.sources, key=lambda src: src.name != "torch")
        snap = None
        why = []
        for source in order:
            try:
                snap = source.snapshot()
                break
            except SourceUnavailableError as exc:  # (CuPy's before a recording: says how)
                why.append(f"{source.name}: {exc.reason}")
                continue
            except Exception as exc:  # (a button's callback: said, never raised)
                self._set_error(exc)
                return None
        if snap is None:
            self._set_note("no source here keeps a snapshot" + (f" ({'; '.join(why)})"
                                                                 if why else ""))
            return None
        self.snapshots.append(snap)
        if self._viewer is not None:
            with contextlib.suppress(Exception):
                self._viewer.close()
        self._viewer = SnapshotViewer(snap)
        self._snapshot_box.children = (self._viewer,)
        n_blocks = sum(len(s.get("blocks") or ()) for s in snap["segments"])
        self._set_note(f"snapshot {len(self.snapshots)}: {len(snap['segments'])} segments, "
                       f"{n_blocks} blocks (dashboard.snapshots[{len(self.snapshots) - 1}])")
        self.refresh()
        return snap

    # ----------------------------------------------------------------- static fallback
    def _text(self) -> str:
        if not self._devices:
            return "MemoryDashboard(no CUDA device)"
        parts = []
        for dev in self._devices:
            label = f" [{dev.source.name}]" if len(self.sources) > 1 else ""
            parts.append(f"cuda:{dev.index} {dev.name}{label}: {figures_text(dev)}")
        return "MemoryDashboard(" + "; ".join(parts) + ")"

    def to_png(self, dpi: int = 80) -> bytes:
        """A matplotlib picture of the dashboard now (needs matplotlib)."""
        from cudalab.memory_tools.plot import byte_scale, load_matplotlib

        Figure, FigureCanvasAgg = load_matplotlib()
        n = max(len(self._devices), 1)
        fig = Figure(figsize=(8.0, 2.3 * n), dpi=dpi, layout="constrained")
        FigureCanvasAgg(fig)
        for i, dev in enumerate(self._devices):
            ax = fig.add_subplot(n, 1, i + 1)
            h = self.history(dev.index)
            t = h["time"] - (h["time"][-1] if h["time"].size else 0.0)
            peak = max(int(h["reserved"].max(initial=0)), int(h["nvml_used"].max(initial=0)),
                       int(h["allocated"].max(initial=0)), 1)
            div, unit = byte_scale(peak)
            ax.fill_between(t, h["reserved"] / div, step="post", color="#fdd0a2", lw=0)
            ax.fill_between(t, h["allocated"] / div, step="post", color="#c6dbef", lw=0)
            ax.step(t, h["reserved"] / div, where="post", color="#e6550d", lw=1, label="reserved")
            ax.step(t, h["allocated"] / div, where="post", color=_ALLOC_C, lw=1.2,
                    label="allocated")
            if dev.has_nvml:
                ax.step(t, h["nvml_used"] / div, where="post", color="#8c8c8c", lw=1,
                        label="NVML used")
            ax.set_ylim(0, peak / div * 1.15)
            ax.set_ylabel(unit)
            ax.grid(True, alpha=0.3)
            ax.legend(loc="upper left", fontsize=7, frameon=False, ncols=3)
            s = dev.last
            nv = ""
            if s is not None and s.utilization is not None:
                nv = (f"\nutil {s.utilization}%, {s.temperature} °C, "
                      f"{(s.power_draw or 0) / 1000:.0f} W, SM {s.clock_rate} MHz")
            label = f" [{dev.source.name}]" if len(self.sources) > 1 else ""
            ax.set_title(f"cuda:{dev.index} {dev.name}{label} — {figures_text(dev)}{nv}",
                         fontsize=8, loc="left")
            if i == n - 1:
                ax.set_xlabel("seconds before the picture was taken")
        if not self._devices:
            fig.text(0.5, 0.5, "no CUDA device", ha="center")
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        return buf.getvalue()

    def to_html(self) -> str:
        """A static HTML picture: the values now and the sparkline (no matplotlib needed)."""
        rows = []
        w, h = self.chart_size
        for dev, p in zip(self._devices, self._panels):
            png = dev.last_png or palette_png(np.zeros((h, w), np.uint8))
            b64 = base64.b64encode(png).decode("ascii")
            rows.append(f'<div style="margin:4px 0">{p["title"].value}'
                        f'<div style="display:flex;gap:10px"><img src="data:image/png;base64,{b64}"'
                        f' width="{w}" height="{h}"/><div style="min-width:260px">'
                        f'{p["mem"].value}{p["nvml"].value}{p["counts"].value}{p["pools"].value}'
                        f'{p["procs"].value}'
                        f'</div></div></div>')
        if not rows:
            rows.append("<i>No CUDA device is visible.</i>")
        return ('<div class="cudalab-dash-static" style="font-size:12px">'
                '<div style="color:#777">cudalab MemoryDashboard (static picture; run the cell '
                'for the live view)</div>' + "".join(rows) + "</div>")

    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        data = super()._repr_mimebundle_(**kwargs) or {}
        if isinstance(data, tuple):  # (data, metadata) form
            data = data[0]
        data = dict(data)
        if not self._closed:
            _shown.add(self)  # on screen: held until closed (see _shown)
        data["text/plain"] = self._text()
        if self.fallback and not self._closed:
            try:
                data["image/png"] = base64.b64encode(self.to_png()).decode("ascii")
            except ImportError:
                data["text/html"] = self.to_html()
            except Exception:  # a broken matplotlib must not break the live display
                data["text/html"] = self.to_html()
        return data


def _descendants(w: W.Widget) -> list[W.Widget]:
    """The widgets under ``w``: its children, theirs, and every one's layout and style
    (widgets too, with a comm each: left open, they would outlive the dashboard)."""
    out = []
    for c in getattr(w, "children", ()) or ():
        out.extend(_descendants(c))
        out.append(c)
    for name in ("layout", "style"):
        part = getattr(w, name, None)
        if isinstance(part, W.Widget):
            out.append(part)
    return out


def _sampler(ref: weakref.ref, stop: threading.Event) -> None:
    """The sampler thread: a tick every ``dashboard.interval`` s (read each time, so it can
    be changed while running) until ``stop`` or the dashboard is gone. Never prints: errors
    land in the dashboard's status line."""
    due = time.monotonic()
    while True:
        d = ref()
        if d is None or d._closed:
            return
        interval = d.interval
        # (Never a busy loop nor an overflow, even if the attribute was bypassed: a NaN
        # fails the first test.)
        if not interval >= MIN_INTERVAL:
            interval = MIN_INTERVAL
        elif interval > MAX_INTERVAL:
            interval = MAX_INTERVAL
        del d
        now = time.monotonic()
        due = max(due + interval, now + interval / 4)  # a fixed rate, without bursts after a stall
        if stop.wait(due - now):
            return
        d = ref()
        if d is None or d._closed:
            return
        try:
            d._tick()
        except Exception as exc:  # noqa: BLE001 - reported in the widget, not printed
            d._set_error(exc)
        del d

