"""``%cuda_memory watch`` for torch's and CuPy's allocators: one line per cell and allocator,
beside cudalab's own (:class:`~cudalab.magics.memory_watch.MemoryWatch`).

Each line gives Δallocated, Δreserved, the cell's peak and the GPU time of the library's
own current stream::

    [cudalab watch torch cuda:0] Δallocated +512.0 MiB | Δreserved +1.0 GiB | peak 1.5 GiB (+1.0 GiB in cell) | GPU 12.3 ms | wall 15.1 ms

**How the cell's peak is obtained, without resetting anybody's peak.** torch's
``reset_peak_memory_stats`` is global (the user's ``max_memory_allocated()`` would start
again), so the watch never calls it; it reads torch's counters before and after the cell
(``allocated_bytes.all``: ``current``, ``peak``, and the cumulative ``allocated`` and
``freed``) and derives the peak from them:

* **exact** when torch's peak rose during the cell (the new global peak was reached in the
  cell: it *is* the cell's peak), or when nothing was freed during the cell (``freed`` did
  not move: allocated only grew, so the peak is the end's figure);
* otherwise **a bound**, shown as ``peak ≤ X``: the cell's peak is at most the global peak,
  and at most the start plus every byte allocated during the cell; it is at least the start
  and the end. When the two bounds meet the figure is exact and shown without ``≤``.

A cell that itself resets torch's peaks (``reset_peak_memory_stats``) or its cumulative
counters (``reset_accumulated_memory_stats``) leaves only what was read after the reset: the
figure is then that of the rest of the cell (the latter shows it as a bound).

CuPy's pool keeps no peak: its line's peak is the bound ``≤ max(total at start, total at
end)`` (what the pool held from the driver; exact when it equals the larger of the used
figures at the start and the end). Its Δallocated and Δreserved are the differences of the
pool's ``used_bytes()`` and ``total_bytes()``.

GPU time: a timing event of the library (``torch.cuda.Event``, ``cupy.cuda.Event``) is
recorded on its current stream before the cell and after it (two events per device, made
once); ``watch_sync`` decides whether the watch waits for the end ("GPU running" otherwise).
In ``auto`` a cell that left the library's allocator unchanged prints no line, so its end is
neither recorded nor waited for (its figures say "GPU n/a"). torch's events are recorded only
while torch has initialised CUDA, CuPy's only while its pool holds memory (an event would
create a CUDA context for a CuPy that never ran): "GPU n/a" otherwise.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

from cudalab._internal import format_bytes, format_time

__all__ = ["CellMemory", "CupyCellWatch", "LibraryWatches", "TorchCellWatch", "allocator_changed",
           "cell_peak", "library_line"]


class CellMemory(NamedTuple):
    """One cell's figures for one allocator, as its watch line shows them (exact bytes)."""

    source: str  # "torch" or "cupy"
    device: int  # the device index, >= 0
    allocated_delta: int  # allocated bytes after the cell less before it
    reserved_delta: int  # reserved bytes after the cell less before it
    start_allocated: int  # allocated bytes before the cell, >= 0
    peak: int  # the cell's peak of allocated bytes (a bound when not exact), >= start
    exact: bool  # whether ``peak`` is exact (False: an upper bound)
    gpu: str  # "GPU 1.2 ms", "GPU running" or "GPU n/a"
    wall: float  # the cell's wall time, seconds

    @property
    def changed(self) -> bool:
        """Whether the cell changed this allocator (see :func:`allocator_changed`)."""
        return allocator_changed(self.allocated_delta, self.reserved_delta, self.peak,
                                 self.start_allocated, self.exact)

    def line(self) -> str:
        """The watch line."""
        return library_line(f"{self.source} cuda:{self.device}", self.allocated_delta,
                            self.reserved_delta, self.start_allocated, self.peak, self.exact,
                            self.gpu, self.wall)


def cell_peak(start: int, end: int, start_peak: int, end_peak: int, allocated_in_cell: int,
              freed_in_cell: int) -> tuple[int, bool]:
    """The cell's peak of allocated bytes from counters read before and after it.

    Parameters
    ----------
    start, end : int
        Allocated bytes before and after the cell.
    start_peak, end_peak : int
        The allocator's peak (since its last reset) before and after the cell.
    allocated_in_cell, freed_in_cell : int
        Bytes allocated and freed during the cell (differences of the cumulative counters).

    Returns
    -------
    (int, bool)
        The peak and whether it is exact (False: an upper bound; see the module).
    """
    low = max(start, end)
    if allocated_in_cell < 0 or freed_in_cell < 0:  # the cumulative counters were reset
        return max(end_peak, low), False
    if end_peak > start_peak:  # the allocator's peak was reached inside the cell
        return end_peak, True
    if freed_in_cell <= 0:  # only allocations: the end is the highest point
        return end, True
    high = min(end_peak, start + allocated_in_cell) if end_peak >= low else start + allocated_in_cell
    high = max(high, low)
    return high, high == low


def allocator_changed(d_alloc: int, d_res: int, peak: int, start: int, exact: bool) -> bool:
    """Whether a cell changed an allocator: allocated or reserved bytes moved, or an exact
    peak rose above the start (a peak that is only a bound, such as CuPy's cached pool bytes,
    does not say that it did). ``auto`` prints a library's line for such cells only."""
    return bool(d_alloc or d_res or (exact and peak > start))


def library_line(label: str, d_alloc: int, d_res: int, start: int, peak: int, exact: bool,
                 gpu: str, wall: float) -> str:
    """One watch line (the format of cudalab's, with the library in its label)."""
    sign = "" if exact else "≤ "
    return (f"[cudalab watch {label}] Δallocated {format_bytes(d_alloc, signed=True)} | "
            f"Δreserved {format_bytes(d_res, signed=True)} | peak {sign}{format_bytes(peak)} "
            f"({sign}{format_bytes(peak - start, signed=True)} in cell) | {gpu} | "
            f"wall {format_time(wall)}")


def _event_pair(events: dict[int, tuple[Any, Any]], device: int, event: Any,
                **options: Any) -> tuple[Any, Any]:
    """``device``'s (start, end) timing events from ``events``, made with
    ``event(**options)`` the first time."""
    pair = events.get(device)
    if pair is None:
        pair = events[device] = (event(**options), event(**options))
    return pair


def _quiet(threshold: int, d_alloc: int, d_res: int, over: int) -> bool:
    return threshold > 0 and abs(d_alloc) < threshold and abs(d_res) < threshold and \
        over < threshold


class TorchCellWatch:
    """torch's line (see the module): counters from ``memory_stats_as_nested_dict``."""

    name = "torch"

    def __init__(self, torch: Any, device: int | None, sync: Any):
        self.torch = torch
        self.device = device  # None: torch's current device
        self.sync = sync  # a callable: whether to wait for the end event (watch_sync)
        self.start: tuple[int, int, int, int, int] | None = None
        self.dev = 0
        self.event: Any = None  # the start event recorded by pre, None when not recorded
        #: Per device, the (start, end) timing events, made once and recorded every cell.
        self.events: dict[int, tuple[Any, Any]] = {}

    def _pair(self, device: int) -> tuple[Any, Any]:
        return _event_pair(self.events, device, self.torch.cuda.Event, enable_timing=True)

    def _counters(self, device: int) -> tuple[int, int, int, int, int]:
        cuda = self.torch.cuda
        nested = getattr(cuda, "memory_stats_as_nested_dict", None)
        if nested is not None:
            stats = nested(device)
            a = stats.get("allocated_bytes", {}).get("all", {})
            r = stats.get("reserved_bytes", {}).get("all", {})
            return (a.get("current", 0), r.get("current", 0), a.get("peak", 0),
                    a.get("allocated", 0), a.get("freed", 0))
        flat = cuda.memory_stats(device)
        return tuple(flat.get(k, 0) for k in (  # type: ignore[return-value]
            "allocated_bytes.all.current", "reserved_bytes.all.current",
            "allocated_bytes.all.peak", "allocated_bytes.all.allocated",
            "allocated_bytes.all.freed"))

    def pre(self) -> None:
        cuda = self.torch.cuda
        self.event = None
        if not cuda.is_initialized():
            self.start = None  # torch holds nothing yet: the cell starts from zero
            return
        d = self.dev = self.device if self.device is not None else int(cuda.current_device())
        self.start = self._counters(d)
        try:
            ev = self._pair(d)[0]
            ev.record(cuda.current_stream(d))
            self.event = ev
        except Exception:
            self.event = None

    def post(self, wall: float, threshold: int, idle_figures_only: bool = False
             ) -> CellMemory | None:
        """The cell's figures, None when nothing is to be said (below ``threshold``, or
        torch did no CUDA work); ``idle_figures_only``: a cell that did not change torch's
        allocator (``auto`` prints no line for it) reads no GPU time ("GPU n/a")."""
        cuda = self.torch.cuda
        if not cuda.is_initialized():
            return None  # torch did no CUDA work
        if self.start is None:
            d = self.device if self.device is not None else int(cuda.current_device())
            start = (0, 0, 0, 0, 0)
        else:
            d, start = self.dev, self.start
        end = self._counters(d)
        d_alloc, d_res = end[0] - start[0], end[1] - start[1]
        peak, exact = cell_peak(start[0], end[0], start[2], end[2], end[3] - start[3],
                                end[4] - start[4])
        if _quiet(threshold, d_alloc, d_res, peak - start[0]):
            return None
        gpu = "GPU n/a"
        if self.event is not None and not (
                idle_figures_only and not allocator_changed(d_alloc, d_res, peak, start[0], exact)):
            try:
                stop = self._pair(d)[1]
                stop.record(cuda.current_stream(d))
                if self.sync():
                    stop.synchronize()
                gpu = (f"GPU {format_time(self.event.elapsed_time(stop) / 1e3)}"
                       if stop.query() else "GPU running")
            except Exception:
                gpu = "GPU n/a"
        return CellMemory("torch", d, d_alloc, d_res, start[0], peak, exact, gpu, wall)


class CupyCellWatch:
    """CuPy's line (see the module): the default pool's ``used_bytes`` / ``total_bytes``."""

    name = "cupy"

    def __init__(self, cupy: Any, device: int | None, sync: Any):
        self.cupy = cupy
        self.device = device
        self.sync = sync
        self.start = (0, 0)
        self.dev = 0
        self.event: Any = None  # the start event recorded by pre, None when not recorded
        #: Per device, the (start, end) events, made once and recorded every cell.
        self.events: dict[int, tuple[Any, Any]] = {}

    def _pair(self, device: int) -> tuple[Any, Any]:
        return _event_pair(self.events, device, self.cupy.cuda.Event)

    def _figures(self, device: int) -> tuple[int, int]:
        cupy = self.cupy
        pool = cupy.get_default_memory_pool()
        if cupy.cuda.runtime.getDevice() == device:
            return int(pool.used_bytes()), int(pool.total_bytes())
        with cupy.cuda.Device(device):
            return int(pool.used_bytes()), int(pool.total_bytes())

    def pre(self) -> None:
        cupy = self.cupy
        d = self.dev = self.device if self.device is not None else int(cupy.cuda.runtime.getDevice())
        self.start = self._figures(d)
        self.event = None
        if self.start[1] > 0:  # CuPy has a context: an event costs none
            try:
                # (keyed by CuPy's current device: an Event belongs to the device current
                # when it is made, and is recorded on that device's current stream)
                ev = self._pair(int(cupy.cuda.runtime.getDevice()))[0]
                ev.record(cupy.cuda.get_current_stream())
                self.event = ev
            except Exception:
                self.event = None

    def post(self, wall: float, threshold: int, idle_figures_only: bool = False
             ) -> CellMemory | None:
        """As :meth:`TorchCellWatch.post`, for CuPy's pool."""
        cupy = self.cupy
        d = self.dev
        used, total = self._figures(d)
        (used0, total0) = self.start
        if used == used0 == 0 and total == total0 == 0:
            return None  # CuPy's pool was not used
        d_alloc, d_res = used - used0, total - total0
        peak = max(total0, total, used0, used)
        exact = peak == max(used0, used)
        if _quiet(threshold, d_alloc, d_res, peak - used0):
            return None
        gpu = "GPU n/a"
        if self.event is not None and not (
                idle_figures_only and not allocator_changed(d_alloc, d_res, peak, used0, exact)):
            try:
                stop = self._pair(int(cupy.cuda.runtime.getDevice()))[1]
                stop.record(cupy.cuda.get_current_stream())
                if self.sync():
                    stop.synchronize()
                gpu = (f"GPU {format_time(cupy.cuda.get_elapsed_time(self.event, stop) / 1e3)}"
                       if stop.done else "GPU running")
            except Exception:
                gpu = "GPU n/a"
        return CellMemory("cupy", d, d_alloc, d_res, used0, peak, exact, gpu, wall)


class LibraryWatches:
    """The torch and CuPy lines of a watch: ``names`` fixed (``("torch",)``: a line every
    cell, as cudalab's own watch), or None to follow the libraries present (``auto``: a
    library imported later joins at its next cell; ``sys.modules`` is read, never imported
    from). In ``auto`` a library's line is printed for a cell that changed its figures only,
    and cudalab's own line is left out of a cell where a library's was printed and cudalab's
    allocator did not change (its ``post`` hook runs after this one's): a cell that changed
    nothing prints cudalab's line, as before torch or CuPy were imported."""

    def __init__(self, names: tuple[str, ...] | None, device: int | None, threshold: int,
                 magics: Any, cudalab_watch: Any = None):
        self.names = names
        self.device = device
        self.threshold = threshold
        self.magics = magics
        self.cudalab_watch = cudalab_watch  # auto: told to stay quiet while idle
        self.watches: dict[str, Any] = {}
        #: The last cell's figures per library (None for a cell that printed no line).
        self.last: dict[str, CellMemory | None] = {}
        self.t0 = 0.0

    def _sync(self) -> bool:
        return bool(self.magics.watch_sync)

    def _refresh(self) -> None:
        wanted = self.names if self.names is not None else ("torch", "cupy")
        for name in wanted:
            if name in self.watches:
                continue
            module = sys.modules.get(name)
            if module is None:
                continue
            cls = TorchCellWatch if name == "torch" else CupyCellWatch
            self.watches[name] = cls(module, self.device, self._sync)

    def pre(self, info: Any = None) -> None:
        if getattr(info, "silent", False):
            return
        import time

        self._refresh()
        for w in self.watches.values():
            w.device = self.device
            try:
                w.pre()
            except Exception:  # never raise into the user's cell
                w.start = None
        self.t0 = time.perf_counter()

    def post(self, result: Any = None) -> None:
        if getattr(getattr(result, "info", None), "silent", False):
            return
        import time

        wall = time.perf_counter() - self.t0
        printed = False
        for w in self.watches.values():
            try:
                auto = self.names is None
                cell = self.last[w.name] = w.post(wall, self.threshold, idle_figures_only=auto)
                line = None if cell is None else cell.line()
                if cell is not None and auto and not cell.changed:
                    line = None  # auto: this library's allocator did not change
            except Exception as exc:  # a library that went away: said, never raised
                self.last[w.name] = None
                line = f"[cudalab watch {w.name}] not readable: {type(exc).__name__}: {exc}"
            if line is not None:
                sys.stdout.write(line + "\n")
                printed = True
        if self.cudalab_watch is not None:
            self.cudalab_watch.idle_quiet = printed
