"""CUPTI activity records: the seam's only user of the optional ``cupti-python`` package.

:class:`KernelActivity` collects CUPTI activity records of kernels (``CONCURRENT_KERNEL``:
every library's kernels, not only cudalab's), memory copies (``MEMCPY``) and memsets
(``MEMSET``) between :meth:`~KernelActivity.start` and :meth:`~KernelActivity.stop`,
decoded into plain tuples (:data:`ActivityRecord`). The upper layers reach it through
:func:`cudalab._internal.cupti_kernel_activity`; nothing above ``cudalab._driver`` imports
``cupti``.

* The package is imported lazily, on the first :meth:`~KernelActivity.start`
  (:func:`load`), so importing this module costs nothing.
* When CUPTI cannot be used, :attr:`KernelActivity.note` says why in one clause (the
  package is missing or broken, another profiler holds CUPTI, a version mismatch or a
  permission problem), for the caller to show next to its fallback.
* **Other subscribers.** With drivers before r610 CUPTI has one subscriber per process, and
  its activity API has one pair of buffer callbacks per process: enabling records while
  another tool collects them would steal that tool's records. So :meth:`~KernelActivity.start`
  first checks (:func:`other_collector`) for a profiler injected into the process (Nsight
  Systems/Compute set ``CUDA_INJECTION64_PATH``), for ``torch.profiler`` recording (torch's
  own flag, read only when torch is already imported), and probes the subscriber slot with
  ``cupti.subscribe``. A slot held by torch's kineto while torch.profiler is *not* recording
  is not a conflict: kineto keeps its subscription for the life of the process, and it
  registers its buffer callbacks again each time it starts, so torch.profiler still works
  after a cell that used CUPTI here.
* The buffer callbacks are registered on every start (another tool may have replaced them
  since) and deliver into the list of the one active tracer (:data:`_sink`, None while
  none is active: records delivered then are dropped). :meth:`~KernelActivity.stop`
  flushes every buffer (forced) before disabling the records, so a cell's records never
  reach the next cell's tracer.
* **Clocks.** CUPTI's records are in ns of CLOCK_REALTIME unless a tool registered its own
  timestamp clock: torch's kineto does, the first time torch.profiler starts, with the CPU's
  time-stamp counter (TSC ticks, ~2-3 per ns), and it stays for the process. After a flush
  :meth:`~KernelActivity.stop` finds which clock the records are on (:func:`ns_per_tick`)
  and rescales them to ns, so GPU times stay right after torch.profiler ran.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

__all__ = ["BUFFER_BYTES", "KIND_KERNEL", "KIND_MEMCPY", "KIND_MEMSET", "ActivityRecord",
           "KernelActivity", "demangle", "error_text", "load", "ns_per_tick", "other_collector"]

#: One decoded record: ``(kind, name, device, start_ns, end_ns, stream_id, grid, block,
#: bytes)``; ``kind`` is one of :data:`KIND_KERNEL` / :data:`KIND_MEMCPY` /
#: :data:`KIND_MEMSET`; ``name`` is the kernel's (mangled) symbol, or ``"[memcpy HtoD]"``
#: (the copy's direction) / ``"[memset]"``; ``grid``/``block`` are None and ``bytes`` is 0
#: for kernels; timestamps are CUPTI's (ns).
ActivityRecord = tuple[str, str, int, int, int, int, Any, Any, int]

#: The kinds of :data:`ActivityRecord`.
KIND_KERNEL = "kernel"
KIND_MEMCPY = "memcpy"
KIND_MEMSET = "memset"

#: Bytes of each activity buffer handed to CUPTI (no alignment requirement: 0).
BUFFER_BYTES = 8 << 20

#: ``CUpti_ActivityMemcpyKind`` values -> the direction shown in a memcpy record's name
#: (CUPTI's enum: 1 HtoD, 2 DtoH, 3 HtoA, 4 AtoH, 5 AtoA, 6 AtoD, 7 DtoA, 8 DtoD, 9 HtoH,
#: 10 PtoP).
_COPY_KINDS = {1: "HtoD", 2: "DtoH", 3: "HtoA", 4: "AtoH", 5: "AtoA", 6: "AtoD", 7: "DtoA",
               8: "DtoD", 9: "HtoH", 10: "PtoP"}

#: The active tracer's record list; the buffer-completed callback appends to it. None while
#: no tracer is active (records delivered then are dropped).
_sink: list[ActivityRecord] | None = None
#: ``CUpti_ActivityKind`` value -> our kind, for the kinds enabled (filled by :func:`load`).
_kinds: dict[int, str] = {}

#: Environment variables set by a profiler injected into the process (Nsight Systems and
#: Nsight Compute inject through CUDA_INJECTION64_PATH; nsys also sets its session id).
_INJECTION_VARS = ("CUDA_INJECTION64_PATH", "NSYS_PROFILING_SESSION_ID")


def load() -> tuple[Any, str]:
    """The ``cupti.cupti`` module, or ``(None, why not)``.

    Returns
    -------
    tuple
        ``(module, "")`` when the package imports, else ``(None, reason)``: the package
        is not installed, or it is broken / cannot find libcupti.
    """
    try:
        from cupti import cupti
    except ImportError:
        return None, ("CUPTI is not available (the optional cupti-python package is not "
                      "installed: pip install cupti-python)")
    except Exception as exc:  # a broken install, a missing libcupti
        return None, f"cupti-python could not be loaded ({exc})"
    if not _kinds:
        k = cupti.ActivityKind
        _kinds.update({int(k.CONCURRENT_KERNEL): KIND_KERNEL, int(k.MEMCPY): KIND_MEMCPY,
                       int(k.MEMSET): KIND_MEMSET})
    return cupti, ""


def _buffer_requested() -> tuple[int, int]:
    """CUPTI asks for an activity buffer: (its size, its alignment)."""
    return BUFFER_BYTES, 0


def _buffer_completed(activities: list[Any]) -> None:
    """CUPTI hands back a full (or flushed) buffer: decode its kernel, memcpy and memset
    records into :data:`_sink` (records of other kinds, e.g. left enabled by another tool,
    are skipped)."""
    sink = _sink
    if sink is None:
        return
    kinds = _kinds
    for a in activities:
        kind = kinds.get(getattr(a, "kind", -1))
        if kind is None:
            continue
        try:
            if kind == KIND_KERNEL:
                sink.append((kind, str(a.name), a.device_id, a.start, a.end, a.stream_id,
                             (a.grid_x, a.grid_y, a.grid_z), (a.block_x, a.block_y, a.block_z),
                             0))
            elif kind == KIND_MEMCPY:
                sink.append((kind, f"[memcpy {_COPY_KINDS.get(a.copy_kind, '?')}]", a.device_id,
                             a.start, a.end, a.stream_id, None, None, a.bytes))
            else:
                sink.append((kind, "[memset]", a.device_id, a.start, a.end, a.stream_id,
                             None, None, a.bytes))
        except AttributeError:
            continue  # a record version without the fields read here


#: Mangled symbol -> demangled name (None: not a C++ symbol), filled as names are seen.
_demangled: dict[str, str] = {}
#: ``abi::__cxa_demangle`` from libstdc++ (False: unavailable; None: not looked up yet).
_cxa_demangle: Any = None


def demangle(symbol: str) -> str:
    """The C++ name of a kernel symbol, as ``c++filt`` and torch.profiler print it
    (``_ZN2at6native...`` -> ``void at::native::...``); other names come back unchanged.

    Parameters
    ----------
    symbol : str
        A kernel's symbol from a CUPTI record.

    Returns
    -------
    str
        The demangled name, or ``symbol`` when it is not a mangled C++ name or libstdc++'s
        demangler is not available.
    """
    hit = _demangled.get(symbol)
    if hit is not None:
        return hit
    out = symbol
    if symbol.startswith("_Z"):
        out = _cxa(symbol) or symbol
    _demangled[symbol] = out
    return out


def _cxa(symbol: str) -> str | None:
    """libstdc++'s ``__cxa_demangle`` through ctypes (None when it fails)."""
    global _cxa_demangle
    import ctypes

    if _cxa_demangle is None:
        try:
            lib = ctypes.CDLL("libstdc++.so.6")
            fn = lib.__cxa_demangle
            fn.restype = ctypes.c_void_p
            fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p,
                           ctypes.POINTER(ctypes.c_int)]
            libc = ctypes.CDLL(None)
            libc.free.argtypes = [ctypes.c_void_p]
            _cxa_demangle = (fn, libc.free)
        except (OSError, AttributeError):
            _cxa_demangle = False
    if _cxa_demangle is False:
        return None
    fn, free = _cxa_demangle
    status = ctypes.c_int(0)
    ptr = fn(symbol.encode(), None, None, ctypes.byref(status))
    if not ptr:
        return None
    try:
        return ctypes.string_at(ptr).decode("utf-8", "replace") if status.value == 0 else None
    finally:
        free(ptr)


def _status_name(mod: Any, exc: BaseException) -> str:
    """The name of a failed CUPTI call's status (``CUptiResult``), "" when it has none."""
    status = getattr(exc, "status", None)
    try:
        return mod.Result(status).name if status is not None else ""
    except Exception:
        return str(status)


def error_text(mod: Any, exc: BaseException) -> str:
    """Why a CUPTI call failed, in one clause for people (``mod`` is ``cupti.cupti``)."""
    name = _status_name(mod, exc)
    if "MULTIPLE_SUBSCRIBERS" in name:
        return ("CUPTI is held by another profiler in this process (Nsight Systems/Compute, "
                "torch.profiler/kineto, ...)")
    if "NOT_INITIALIZED" in name or "INSUFFICIENT_PRIVILEGES" in name:
        return (f"CUPTI could not start ({name}: a CUPTI/driver version mismatch or missing "
                "profiling permission)")
    return f"CUPTI failed ({name or exc})"


#: :func:`_torch_profiler` results: torch is not imported / imported, its profiler not
#: recording / recording.
TORCH_ABSENT, TORCH_IDLE, TORCH_RECORDING = "absent", "idle", "recording"


def _torch_profiler() -> str:
    """Whether torch is imported and its profiler is recording (torch's own flag, set while
    a ``torch.profiler.profile`` records; torch is never imported here)."""
    if "torch" not in sys.modules:
        return TORCH_ABSENT
    prof = sys.modules.get("torch.autograd.profiler")
    return TORCH_RECORDING if getattr(prof, "_is_profiler_enabled", False) else TORCH_IDLE


def _noop_callback(*_args: Any) -> None:
    """The callback of the subscriber-slot probe (never enabled, so never called)."""


def other_collector(mod: Any) -> str:
    """Why another tool's CUPTI records must not be taken over now ("" when none is
    collecting): an injected profiler (Nsight), torch.profiler recording, or an unknown
    holder of CUPTI's subscriber slot (``mod`` is ``cupti.cupti``).

    Parameters
    ----------
    mod : module
        ``cupti.cupti``.

    Returns
    -------
    str
        One clause for people, or "" when CUPTI's records are free to use.
    """
    injected = [v for v in _INJECTION_VARS if os.environ.get(v)]
    if injected:
        return (f"a profiler injected into this process collects CUPTI's records ({injected[0]} "
                "is set: Nsight Systems/Compute)")
    torch_state = _torch_profiler()
    if torch_state == TORCH_RECORDING:
        return ("torch.profiler is recording in this process and CUPTI's activity records are "
                "its; run the cell outside the profiler to list every library's kernels")
    try:
        sub = mod.subscribe(_noop_callback, None)
    except Exception as exc:
        if "MULTIPLE_SUBSCRIBERS" in _status_name(mod, exc) and torch_state == TORCH_IDLE:
            return ""  # torch's kineto keeps the slot after its profiler stopped: not collecting
        return error_text(mod, exc)
    try:
        mod.unsubscribe(sub)
    except Exception:
        pass
    return ""


#: A record's end this close to a clock's "now" (in that clock's units, after the work was
#: waited for) is taken to be on that clock: a minute in ns, or in ticks of up to 10 GHz.
_NEAR_NS = 60 * 10**9
_NEAR_TICKS = 60 * 10**10
#: Seconds over which a foreign clock is calibrated against ``time.perf_counter_ns`` (once
#: per clock and process).
CALIBRATION_S = 0.02
#: Clock name -> ns per tick, measured once (:func:`_calibrate`).
_calibrated: dict[str, float] = {}


def _clock_readers(mod: Any) -> list[tuple[str, Any]]:
    """The clocks CUPTI's records may be on besides CLOCK_REALTIME: torch's approximate
    clock (the TSC that kineto registers with CUPTI; read only when torch is imported) and
    CUPTI's own ``get_timestamp``."""
    readers = []
    prof = getattr(sys.modules.get("torch._C"), "_profiler", None)
    approx = getattr(prof, "_get_approximate_time", None)
    if approx is not None:
        readers.append(("torch approximate clock", approx))
    if hasattr(mod, "get_timestamp"):
        readers.append(("cupti.get_timestamp", mod.get_timestamp))
    return readers


def _calibrate(name: str, reader: Any) -> float:
    """ns per tick of ``reader`` against ``time.perf_counter_ns`` over :data:`CALIBRATION_S`
    (cached per clock; 1.0 when within 0.1 % of it)."""
    hit = _calibrated.get(name)
    if hit is not None:
        return hit
    clock = time.perf_counter_ns
    a0, r0, b0 = clock(), int(reader()), clock()
    time.sleep(CALIBRATION_S)
    a1, r1, b1 = clock(), int(reader()), clock()
    scale = ((a1 + b1) - (a0 + b0)) / 2 / max(1, r1 - r0)
    if abs(scale - 1.0) < 1e-3:
        scale = 1.0
    _calibrated[name] = scale
    return scale


def ns_per_tick(mod: Any, last_end: int) -> tuple[float | None, str]:
    """Which clock CUPTI's records are on, from the latest record's end ``last_end`` (taken
    after the work finished): ``(ns per tick, clock name)``; ``(None, "")`` when it is none
    of the known clocks.

    Parameters
    ----------
    mod : module
        ``cupti.cupti``.
    last_end : int
        The largest ``end`` timestamp of the records just flushed.

    Returns
    -------
    tuple
        ``(1.0, "CLOCK_REALTIME")`` for CUPTI's default clock; a calibrated factor for
        another tool's clock (kineto's TSC); ``(None, "")`` when unknown.
    """
    if abs(time.time_ns() - last_end) < _NEAR_NS:
        return 1.0, "CLOCK_REALTIME"
    for name, reader in _clock_readers(mod):
        try:
            now = int(reader())
        except Exception:
            continue
        if -_NEAR_TICKS < now - last_end < _NEAR_TICKS:
            return _calibrate(name, reader), name
    return None, ""


class KernelActivity:
    """Kernel, memcpy and memset activity records around a region (every library's work).

    One tracer is active at a time in a process (CUPTI delivers into one list).
    """

    def __init__(self) -> None:
        #: The decoded records (:data:`ActivityRecord`), appended while active and at stop.
        self.records: list[ActivityRecord] = []
        #: Why CUPTI could not be used ("" while nothing went wrong).
        self.note = ""
        #: True between a successful :meth:`start` and :meth:`stop`.
        self.active = False
        #: True once :meth:`start` succeeded (stays True after :meth:`stop`).
        self.started = False
        #: The clock the records were on (:func:`ns_per_tick`; their times are in ns of it
        #: after :meth:`stop`), and whether their durations are known (False: an unknown
        #: clock, set by another tool).
        self.clock = ""
        self.durations_known = True
        self._mod: Any = None

    #: The C++ name of a kernel symbol (:func:`demangle`), for the layers above.
    demangle = staticmethod(demangle)

    def start(self) -> bool:
        """Enable the activity records; False (and :attr:`note` set) when CUPTI cannot be
        used, or another tool is collecting its records (see :func:`other_collector`)."""
        global _sink
        if _sink is not None:
            self.note = "another CUPTI tracer of cudalab is active"
            return False
        mod, why = load()
        if mod is None:
            self.note = why
            return False
        why = other_collector(mod)
        if why:
            self.note = why
            return False
        enabled = []
        try:
            # again on every start: another tool (kineto) may have registered its own since
            mod.activity_register_callbacks(_buffer_requested, _buffer_completed)
            _sink = self.records
            for kind in _kinds:
                mod.activity_enable(kind)
                enabled.append(kind)
        except Exception as exc:
            _sink = None
            for kind in enabled:
                try:
                    mod.activity_disable(kind)
                except Exception:
                    pass
            self.note = error_text(mod, exc)
            return False
        self._mod = mod
        self.active = self.started = True
        return True

    def stop(self) -> None:
        """Flush the buffers into :attr:`records` and disable the records (no-op if not
        active); a failed flush sets :attr:`note`."""
        global _sink
        if not self.active:
            return
        mod = self._mod
        try:
            mod.activity_flush_all(1)  # CUPTI_ACTIVITY_FLAG_FLUSH_FORCED: incomplete buffers too
        except Exception as exc:
            self.note = error_text(mod, exc)
        finally:
            for kind in _kinds:
                try:
                    mod.activity_disable(kind)
                except Exception:
                    pass
            _sink = None
            self.active = False
        if self.records:
            self._to_ns(mod)

    def _to_ns(self, mod: Any) -> None:
        """Put the records' timestamps in ns (see :func:`ns_per_tick`)."""
        scale, self.clock = ns_per_tick(mod, max(r[4] for r in self.records))
        if scale is None:
            self.durations_known = False
            return
        if scale != 1.0:
            base = self.records[0][3]
            self.records[:] = [(k, n, d, base + round((s - base) * scale),
                                base + round((e - base) * scale), sid, g, b, nb)
                               for k, n, d, s, e, sid, g, b, nb in self.records]
