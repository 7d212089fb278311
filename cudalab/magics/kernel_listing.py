"""``%%cuda_timed --kernels``: which kernels a cell launched and their GPU times.

Two sources: :class:`LaunchTracker`, a launch observer that sees cudalab's own launches
(and which streams and devices they used, for the timer), and :class:`CuptiKernels`, a
consumer of CUPTI activity records (every library's kernels, and the memcpys and memsets),
which it gets through :func:`cudalab._internal.cupti_kernel_activity`;
:func:`kernel_report` picks one. While CUPTI records, the tracker records no per-launch
events (CUPTI's timestamps replace them), so ``--kernels`` costs the cell only CUPTI's own
tracing and one decode per record.

Switches for tests: :attr:`CudaLabMagics.cupti <cudalab.magics.CudaLabMagics.cupti>` = False
forces the fallback (cudalab's own launches) where CUPTI is installed, and
:data:`SIMULATOR_USES_CUPTI` lets a stand-in ``cupti`` module feed the magic on the simulator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cudalab import _internal

if TYPE_CHECKING:
    from cudalab.magics.timed_context import TimedContext
    from cudalab.magics.timed_options import TimedOptions

__all__ = ["SIMULATOR_USES_CUPTI", "CuptiKernels", "LaunchTracker", "cupti_for",
           "kernel_report"]

#: Whether ``--kernels`` asks CUPTI for records on the simulator. False: real CUPTI records
#: nothing there (no GPU work). Tests set it True with a stand-in ``cupti`` module installed
#: (tests/helpers/fake_cupti.py) to run the magic's CUPTI path without a GPU.
SIMULATOR_USES_CUPTI = False


class LaunchTracker:
    """A launch observer: which streams and devices cudalab kernels used, and (``record``)
    an end event after each launch for per-kernel GPU times."""

    def __init__(self, streams: dict[int, Any], record: bool = False, pool: Any = None):
        self.cur = {d: s.cuda_stream for d, s in streams.items()}
        self.side: dict[tuple[int, int], Any] = {}
        self.other_devices: set[int] = set()
        self.new_side = False
        self.record = record
        self.pool = pool
        self.launches: list[tuple] = []

    def __call__(self, name: str, device: int, stream: Any, grid: tuple, block: tuple) -> None:
        cur = self.cur.get(device)
        if cur is None:
            self.other_devices.add(device)
        elif stream.cuda_stream != cur:
            key = (device, stream.cuda_stream)
            if key not in self.side:
                self.side[key] = stream
                self.new_side = True
        if self.record:
            from cudalab.events import Event

            ev = Event(enable_timing=True)
            ev.record(stream)
            self.launches.append((name, device, stream.cuda_stream, grid, block, ev))

    def kernel_table(self, start_events: dict[int, Any]) -> list[dict]:
        """Per (name, device): count and GPU time, each launch timed from the previous marker
        on its stream (the cell's start event on the timed stream, else the previous launch's
        end there; unknown for the first launch on an untimed stream)."""
        prev: dict[tuple[int, int], Any] = {}
        for d, ev in start_events.items():
            prev[(d, self.cur[d])] = ev
        table: dict[tuple[str, int], dict] = {}
        for name, device, sid, grid, block, ev in self.launches:
            key = (device, sid)
            before = prev.get(key)
            t = None
            if before is not None:
                try:
                    t = before.elapsed_time(ev) / 1e3
                except Exception:
                    t = None
            prev[key] = ev
            row = table.setdefault((name, device), {
                "name": name, "device": device, "count": 0, "gpu_time": 0.0,
                "grid": grid, "block": block, "source": "events", "kind": "kernel",
                "bytes": 0, "_unknown": 0})
            row["count"] += 1
            if t is None:
                row["_unknown"] += 1
            else:
                row["gpu_time"] += t
        out = []
        for row in table.values():
            if row.pop("_unknown") == row["count"]:
                row["gpu_time"] = None
            out.append(row)
        return out


def add_launch_observer(obs: Any) -> None:
    """Tell ``obs`` about every runtime kernel launch from now on."""
    _internal.launch_observers.append(obs)


def remove_launch_observer(obs: Any) -> None:
    try:
        _internal.launch_observers.remove(obs)
    except ValueError:
        pass


#: Appended to every reason CUPTI could not be used (the listing falls back to events).
_FALLBACK = "; listing cudalab's own launches only"


class CuptiKernels:
    """CUPTI activity records around a region (every library's kernels, memcpys and
    memsets), as the ``--kernels`` table: the seam's
    :class:`~cudalab._driver.cupti.KernelActivity` collects and decodes the records; this
    aggregates them per (kind, name, device)."""

    def __init__(self) -> None:
        self._act = _internal.cupti_kernel_activity()

    @property
    def records(self) -> list[tuple]:
        """The decoded records: (kind, name, device, start_ns, end_ns, stream, grid, block,
        bytes)."""
        return self._act.records

    @property
    def note(self) -> str:
        """Why CUPTI could not be used, with the fallback named ("" when it could)."""
        why = self._act.note
        return why + _FALLBACK if why else ""

    @property
    def active(self) -> bool:
        return self._act.active

    @property
    def started(self) -> bool:
        return self._act.started

    def start(self) -> bool:
        return self._act.start()

    def stop(self, devices: tuple[int, ...] | list[int] = ()) -> None:
        """Wait for ``devices`` (their work must be done for its records to be complete),
        then flush and disable the records."""
        if self._act.active:
            import cudalab

            for d in devices:
                try:
                    cudalab.synchronize(d)
                except Exception:  # a sticky error: the flush still delivers what finished
                    break
        self._act.stop()

    def kernel_table(self) -> list[dict]:
        """Per (kind, name, device), in order of first appearance: ``name`` (a kernel's C++
        name, demangled as torch.profiler shows it; ``[memcpy HtoD]`` / ``[memset]``),
        ``symbol`` (the kernel's symbol as recorded), ``device``, ``count``, ``gpu_time``
        (seconds, the sum of the records' end - start), ``grid``, ``block``,
        ``source`` ("cupti"), ``kind`` ("kernel", "memcpy", "memset") and ``bytes``."""
        demangle = self._act.demangle
        table: dict[tuple[str, str, int], dict] = {}
        for kind, name, dev, start, end, _sid, grid, block, nbytes in self.records:
            row = table.get((kind, name, dev))
            if row is None:
                row = table[(kind, name, dev)] = {
                    "name": demangle(name), "symbol": name, "device": dev, "count": 0,
                    "gpu_time": 0.0, "grid": grid, "block": block, "source": "cupti",
                    "kind": kind, "bytes": 0}
            row["count"] += 1
            row["gpu_time"] += max(0, end - start) / 1e9
            row["bytes"] += nbytes
        if not self._act.durations_known:  # on a clock another tool set, of unknown rate
            for row in table.values():
                row["gpu_time"] = None
        return list(table.values())


def cupti_for(magics: Any, ctx: TimedContext, opts: TimedOptions) -> tuple[Any, str]:
    """A CUPTI kernel tracer for ``--kernels`` when it may be used, else (None, why not)."""
    if not opts.kernels:
        return None, ""
    if ctx.simulated and not SIMULATOR_USES_CUPTI:
        return None, "CUPTI is not used on the simulator"
    if not magics.cupti:
        return None, "CUPTI is off (CudaLabMagics.cupti = False)"
    return CuptiKernels(), ""


def kernel_report(opts: TimedOptions, tracker: LaunchTracker, cupti: Any, why: str,
                   start_events: dict, gpu_err: Any, per: str = "") -> tuple[list[dict], str]:
    if not opts.kernels:
        return [], ""
    if cupti is not None and cupti.records:
        return cupti.kernel_table(), ("CUPTI activity records: every library's kernels, "
                                      f"memcpys and memsets{per}")
    if cupti is not None and cupti.started and not cupti.note:
        return [], f"CUPTI recorded no kernel{per}"
    if cupti is not None:
        why = cupti.note
    rows = [] if gpu_err is not None else tracker.kernel_table(start_events)
    note = (f"cudalab's own launches{per}; GPU time from events between launches on each "
            "stream (includes any other work queued in between)")
    if why:
        note += f". {why}"
    if not rows:
        note += ". No cudalab kernel was launched"
    return rows, note
