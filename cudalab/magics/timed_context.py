"""What one ``%%cuda_timed`` run needs around the timer: :class:`TimedContext` (devices,
streams, the event pool, the ``--cold`` L2 flush), NVML readings before and after, and
the warnings and hints computed from them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from IPython.core.error import UsageError

from cudalab import _internal
from cudalab.magics.event_timer import EventPool, EventTimer
from cudalab.magics.timed_options import TimedOptions, parse_devices

__all__ = ["TimedContext", "clock_hints", "stat_warnings", "nvml_context"]


class _FlushBuffers:
    """Per-device L2 flush buffers (:class:`cudalab._internal.ScratchBuffer`: raw driver
    allocations, outside the caching allocator and its statistics)."""

    _SIM_CAP = 4 << 20  # the simulator has no cache: a nominal write keeps tests fast

    def __init__(self) -> None:
        self._bufs: dict[int, _internal.ScratchBuffer] = {}  # device -> its buffer
        self._value = 0  # the byte written by the last flush (each flush writes the next)

    def size_for(self, device: int, factor: float) -> int:
        from cudalab import devices

        l2 = int(devices.get_device_properties(device).L2_cache_size or 0)
        if l2 <= 0:
            l2 = 64 << 20
        return max(1 << 20, int(l2 * factor + 4095) // 4096 * 4096)

    def ensure(self, device: int, nbytes: int) -> int:
        """A buffer of at least ``nbytes`` on ``device``; its size."""
        have = self._bufs.get(device)
        if have is not None and have.nbytes >= nbytes:
            return have.nbytes
        if have is not None:
            del self._bufs[device]
            have.free()
        self._bufs[device] = _internal.ScratchBuffer(device, nbytes)
        return nbytes

    def flush(self, device: int, stream: Any) -> None:
        """Queue a write over ``device``'s buffer on ``stream`` (a new byte every time)."""
        buf = self._bufs[device]
        self._value = (self._value + 1) & 0xFF
        cap = self._SIM_CAP if _internal.backend().simulated else None
        buf.fill_async(self._value, stream, cap)

    def free(self) -> None:
        for buf in self._bufs.values():
            buf.free()
        self._bufs.clear()


# ------------------------------------------------------------------------------- NVML
_REASONS = ((0x4, "SW power cap"), (0x8, "HW slowdown"), (0x20, "SW thermal slowdown"),
            (0x40, "HW thermal slowdown"), (0x80, "HW power brake"), (0x10, "sync boost"))


def _clock_reasons(device: int) -> list[str] | None:
    """Active clock-limiting reasons (NVML clocks-event reasons) on a real GPU, else None."""
    mask = _internal.clock_event_reasons(device)
    if mask is None:
        return None
    return [label for bit, label in _REASONS if mask & bit]


def nvml_context(devs: list[int]) -> dict[int, dict]:
    """SM clock (MHz), temperature (°C), power (mW) and clock-limit reasons per device."""
    from cudalab import nvml

    out: dict[int, dict] = {}
    for d in devs:
        snap: dict[str, Any] = {}
        for key, fn in (("clock_rate", nvml.clock_rate), ("temperature", nvml.temperature),
                        ("power_draw", nvml.power_draw)):
            try:
                snap[key] = fn(d)
            except Exception:
                snap[key] = None
        if all(v is None for v in snap.values()):
            continue
        try:
            snap["simulated"] = bool(nvml.nvml_backend().simulated)
        except Exception:
            snap["simulated"] = False
        snap["reasons"] = _clock_reasons(d)
        out[d] = snap
    return out


def library_streams(devs: list[int], current: dict[int, Any]) -> dict[int, tuple[str, Any]]:
    """Per timed device, the current stream of torch or CuPy where it is not cudalab's
    current stream there: ``{device: (library, ExternalStream)}``. The run times that stream
    instead of cudalab's, so torch's and CuPy's work is timed where it runs (an event on a
    stream with no work of the cell would fire as soon as it is recorded, ahead of the queued
    work: the cell's work must be on the timed stream). torch's first, when torch is imported
    and has initialised CUDA (``torch.cuda.current_stream(d)``), then CuPy's on its current
    device (``cupy.cuda.get_current_stream()``). Read from ``sys.modules`` only; a library
    that cannot say is left out."""
    import sys

    from cudalab.streams import ExternalStream

    found: dict[int, tuple[str, Any]] = {}

    def add(library: str, d: int, handle: Any) -> None:
        if isinstance(handle, int) and handle != current[d].cuda_stream and d not in found:
            found[d] = (library, ExternalStream(handle, d))

    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        if cuda is not None and cuda.is_initialized():
            for d in devs:
                add("torch", d, int(cuda.current_stream(d).cuda_stream))
    except Exception:  # a torch that cannot say: the run times cudalab's stream
        pass
    cupy = sys.modules.get("cupy")
    try:
        if cupy is not None:
            d = int(cupy.cuda.runtime.getDevice())
            if d in current:
                add("cupy", d, int(cupy.cuda.get_current_stream().ptr))
    except Exception:
        pass
    return found


class TimedContext:
    """Everything one %cuda_timed run needs from the magics instance and the runtime."""

    def __init__(self, magics: Any, opts: TimedOptions):
        from cudalab import devices, streams
        from cudalab.errors import CudaUnavailableError

        self.magics = magics
        self.opts = opts
        try:
            devices.init()
        except CudaUnavailableError as exc:
            raise UsageError(f"%cuda_timed: {exc}") from None
        self.backend = _internal.backend()
        self.simulated = bool(self.backend.simulated)
        self.devs = parse_devices(opts.device)
        self.streams = {d: streams.current_stream(d) for d in self.devs}
        #: torch's or CuPy's current stream where it is not cudalab's: timed instead
        self.library_streams = library_streams(self.devs, self.streams)
        for d, (_library, stream) in self.library_streams.items():
            self.streams[d] = stream
        if magics._event_pool is None:
            magics._event_pool = EventPool()
        self.pool: EventPool = magics._event_pool
        self.pool_mark = self.pool.mark()
        self.precision = opts.precision or magics.precision
        self.flush_bytes: dict[int, int] = {}
        self.flush: Callable[[], None] | None = None  # runs before each start event (--cold)
        self.warnings: list[str] = []
        self.hints: list[str] = []
        if self.library_streams:
            where = ", ".join(f"{library}'s on cuda:{d} ({stream.cuda_stream:#x})"
                              for d, (library, stream) in sorted(self.library_streams.items()))
            self.hints.append(f"timed on the current stream of {where}, not cudalab's")
        #: the cell's compiled code objects: Ctrl-C is delivered in them at once, while the
        #: magic's own code (these modules) runs with it deferred (see timed.py)
        self.user_codes: list[Any] = []
        if opts.cold:
            self._setup_flush()

    def _setup_flush(self) -> None:
        from cudalab.errors import CudaError

        m = self.magics
        if m._flush is None:
            m._flush = _FlushBuffers()
        fb: _FlushBuffers = m._flush
        try:
            for d in self.devs:
                self.flush_bytes[d] = fb.ensure(d, fb.size_for(d, m.cold_flush_factor))
        except (CudaError, MemoryError) as exc:
            self.warnings.append(f"--cold ignored: the L2 flush buffer could not be allocated ({exc})")
            self.flush_bytes = {}
            return
        pairs = [(d, self.streams[d]) for d in self.devs]
        flush = fb.flush

        def flush_all() -> None:
            for d, s in pairs:
                flush(d, s)

        self.flush = flush_all
        if self.simulated:
            self.hints.append("the simulator has no L2 cache: --cold only exercises the flush path")

    def deliver_interrupts_in(self, *codes: Any) -> None:
        """Ctrl-C is delivered at once in these compiled codes of the cell (until close)."""
        for code in codes:
            if code is not None:
                self.user_codes.append(code)
                _internal.deliver_interrupts_in(code)

    def close(self) -> None:
        """Give the events back to the pool (keeping an enclosing run's); Ctrl-C is deferred
        again in the cell's codes."""
        for code in self.user_codes:
            _internal.stop_delivering_interrupts_in(code)
        self.pool.release(self.pool_mark)
        if not self.pool_mark:
            self.pool.trim()

    def timer(self, capacity: int, side: dict, flush: bool = True,
              shared: bool = True) -> EventTimer:
        return EventTimer(self.devs, self.streams, side, self.pool, capacity,
                           self.flush if flush else None, shared=shared)

    def device_names(self) -> dict[int, str]:
        from cudalab import devices

        return {d: devices.get_device_name(d) for d in self.devs}


def stat_warnings(result: Any, magics: Any, ctx: TimedContext) -> None:
    st = result.stats
    if st["count"] >= 3 and st["median"] > 0:
        ratio = st["iqr"] / st["median"]
        if ratio > magics.iqr_warning:
            ctx.warnings.append(
                f"the IQR is {ratio:.0%} of the median: the times fluctuate (other work on the "
                "GPU, clock changes, host jitter); more repeats (-r) or longer ones (-n) help")
        if st["min"] > 0 and st["max"] > magics.spread_warning * st["min"]:
            ctx.warnings.append(
                f"the slowest repeat took {st['max'] / st['min']:.1f}x the fastest: a first-run "
                "effect (add warm-up with -w) or an intermediate result being cached")
    cst = result.cpu_stats
    if (not ctx.simulated and result.mode == "repeat" and st["count"] and cst["count"]
            and st["median"] < 100e-6 and cst["median"] >= 0.9 * st["median"]):
        ctx.hints.append(
            "the host needs about as long as the GPU per loop: the loop is probably launch-bound "
            "and the GPU time includes idle gaps waiting for launches")


def clock_hints(before: dict, after: dict, magics: Any, ctx: TimedContext) -> None:
    for d in ctx.devs:
        b, a = before.get(d) or {}, after.get(d) or {}
        cb, ca = b.get("clock_rate"), a.get("clock_rate")
        # a simulated clock can't be locked: no advice (the report says the run is simulated)
        simulated = ctx.simulated or b.get("simulated") or a.get("simulated")
        if (cb and ca and not simulated
                and abs(ca - cb) / max(ca, cb) > magics.clock_hint_threshold):
            ctx.hints.append(
                f"cuda:{d}: the SM clock moved {cb} → {ca} MHz during the measurement (ramping "
                "up from idle, or throttling): add warm-up (-w) or lock the clocks "
                "(nvidia-smi -lgc <MHz>, as root)")
        reasons = a.get("reasons")
        if reasons:
            ctx.hints.append(f"cuda:{d}: clocks limited by {', '.join(reasons)}")

