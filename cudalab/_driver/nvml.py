"""NVML over ``pynvml`` (the nvidia-ml-py package), behind the :class:`~cudalab._driver.base.Nvml` seam.

``pynvml`` is imported, and ``nvmlInit`` called, on the first query, once per process and
under a lock. Every ``pynvml.NVMLError`` becomes a :class:`cudalab.errors.NvmlError` whose
message says what went wrong in words; the three "NVML cannot be used here at all" cases
(``pynvml`` missing, ``libnvidia-ml.so.1`` missing, kernel driver not loaded) raise the subclass
:class:`NvmlUnavailableError`, whose ``reason`` lets callers answer like torch does.

Devices are addressed by UUID (``nvmlDeviceGetHandleByUUID``), never by index: CUDA ordinals
and NVML indices differ under ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER``.
"""

from __future__ import annotations

import threading
from typing import Any

from cudalab._driver.base import Nvml
from cudalab.errors import NvmlError

# NVML_ERROR_* codes (nvml.h; stable ABI values).
_ERROR_NOT_SUPPORTED = 3
_ERROR_NOT_FOUND = 6
_ERROR_DRIVER_NOT_LOADED = 9
_ERROR_LIBRARY_NOT_FOUND = 12
_ERROR_FUNCTION_NOT_FOUND = 13

# nvmlTemperatureSensors_t / nvmlClockType_t values used below.
_TEMPERATURE_GPU = 0
_CLOCK_SM = 1
# usedGpuMemory when NVML cannot tell (NVML_VALUE_NOT_AVAILABLE as unsigned long long).
_VALUE_NOT_AVAILABLE_ULL = (1 << 64) - 1

PYNVML_MISSING = "pynvml module not found, please install nvidia-ml-py"
LIBRARY_MISSING = (
    "NVML is not available: libnvidia-ml.so.1 could not be loaded "
    "(no NVIDIA driver on this machine)"
)
DRIVER_NOT_LOADED = (
    "NVML is not available: the NVIDIA kernel driver is not loaded "
    "(libnvidia-ml.so.1 was found, but nvmlInit failed with NVML_ERROR_DRIVER_NOT_LOADED)"
)


class NvmlUnavailableError(NvmlError):
    """NVML cannot be used on this machine at all.

    ``reason`` is ``"pynvml"`` (nvidia-ml-py not installed), ``"library"``
    (``libnvidia-ml.so.1`` not found) or ``"driver"`` (kernel driver not loaded).
    """

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.reason))


def translate_error(exc: BaseException, what: str) -> NvmlError:
    """The :class:`NvmlError` for a ``pynvml.NVMLError`` raised while doing ``what``.

    ``what`` names the query in words and the NVML call, e.g.
    ``"power draw (nvmlDeviceGetPowerUsage)"``.
    """
    code = getattr(exc, "value", None)
    if code == _ERROR_LIBRARY_NOT_FOUND:
        return NvmlUnavailableError(LIBRARY_MISSING, "library")
    if code == _ERROR_DRIVER_NOT_LOADED:
        return NvmlUnavailableError(DRIVER_NOT_LOADED, "driver")
    if code == _ERROR_NOT_SUPPORTED:
        return NvmlError(f"{what} is not supported on this device")
    if code == _ERROR_FUNCTION_NOT_FOUND:
        return NvmlError(
            f"{what} is not available: this NVIDIA driver's NVML library lacks the function "
            "(driver older than the query)"
        )
    try:
        text = str(exc)
    except Exception:  # pynvml's __str__ calls into NVML, which may itself fail
        text = type(exc).__name__
    suffix = f" (NVML error {code})" if isinstance(code, int) else ""
    return NvmlError(f"{what} failed: {text}{suffix}")


class RealNvml(Nvml):
    """NVML of the installed NVIDIA driver. One instance per process is enough (and cheaper)."""

    simulated = False

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pynvml: Any = None
        self._init_failure: NvmlError | None = None
        self._handles: dict[str, Any] = {}
        self._uuids: list[str] | None = None

    # ------------------------------------------------------------------ plumbing
    def _lib(self) -> Any:
        """The initialised ``pynvml`` module (imports and ``nvmlInit`` once, thread-safe)."""
        lib = self._pynvml
        if lib is not None:
            return lib
        with self._lock:
            if self._pynvml is None:
                if self._init_failure is None:
                    self._init_failure = self._initialise()
                failure = self._init_failure
                if failure is not None:
                    # A fresh exception each time: re-raising one instance grows its traceback.
                    raise _copy_error(failure)
            return self._pynvml

    def _initialise(self) -> NvmlError | None:
        """Import pynvml and call nvmlInit; the error to raise forever after, or None."""
        try:
            import pynvml
        except ImportError:
            return NvmlUnavailableError(PYNVML_MISSING, "pynvml")
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            return translate_error(exc, "NVML initialisation (nvmlInit)")
        self._pynvml = pynvml
        return None

    def _call(self, what: str, fn: str, *args: Any) -> Any:
        lib = self._lib()
        try:
            return getattr(lib, fn)(*args)
        except lib.NVMLError as exc:
            raise translate_error(exc, what) from None

    def _handle(self, uuid: str) -> Any:
        handle = self._handles.get(uuid)
        if handle is not None:
            return handle
        lib = self._lib()
        try:
            handle = lib.nvmlDeviceGetHandleByUUID(uuid)
        except lib.NVMLError as exc:
            if getattr(exc, "value", None) == _ERROR_NOT_FOUND:
                raise NvmlError(f"NVML has no device with UUID {uuid!r}") from None
            raise translate_error(exc, f"device lookup by UUID {uuid!r} "
                                       "(nvmlDeviceGetHandleByUUID)") from None
        self._handles[uuid] = handle
        return handle

    # ------------------------------------------------------------------ Nvml
    def device_count(self) -> int:
        return int(self._call("device count (nvmlDeviceGetCount)", "nvmlDeviceGetCount"))

    def uuids(self) -> list[str]:
        uuids = self._uuids
        if uuids is None:
            uuids = []
            for index in range(self.device_count()):
                handle = self._call("device lookup by index (nvmlDeviceGetHandleByIndex)",
                                    "nvmlDeviceGetHandleByIndex", index)
                uuid = self._call("device UUID (nvmlDeviceGetUUID)", "nvmlDeviceGetUUID", handle)
                if isinstance(uuid, bytes):
                    uuid = uuid.decode()
                self._handles.setdefault(uuid, handle)
                uuids.append(uuid)
            self._uuids = uuids
        return list(uuids)

    def utilization(self, uuid: str) -> tuple[int, int]:
        rates = self._call("utilization (nvmlDeviceGetUtilizationRates)",
                           "nvmlDeviceGetUtilizationRates", self._handle(uuid))
        return int(rates.gpu), int(rates.memory)

    def memory_info(self, uuid: str) -> tuple[int, int, int]:
        info = self._call("memory info (nvmlDeviceGetMemoryInfo)", "nvmlDeviceGetMemoryInfo",
                          self._handle(uuid))
        return int(info.total), int(info.free), int(info.used)

    def temperature(self, uuid: str) -> int:
        return int(self._call("temperature (nvmlDeviceGetTemperature)",
                              "nvmlDeviceGetTemperature", self._handle(uuid), _TEMPERATURE_GPU))

    def power_usage(self, uuid: str) -> int:
        return int(self._call("power draw (nvmlDeviceGetPowerUsage)", "nvmlDeviceGetPowerUsage",
                              self._handle(uuid)))

    def clock_sm(self, uuid: str) -> int:
        return int(self._call("SM clock (nvmlDeviceGetClockInfo)", "nvmlDeviceGetClockInfo",
                              self._handle(uuid), _CLOCK_SM))

    def processes(self, uuid: str) -> list[tuple[int, int | None]]:
        procs = self._call("compute process list (nvmlDeviceGetComputeRunningProcesses)",
                           "nvmlDeviceGetComputeRunningProcesses", self._handle(uuid))
        out: list[tuple[int, int | None]] = []
        for proc in procs:
            used = getattr(proc, "usedGpuMemory", None)
            if used is not None:
                used = int(used)
                if used == _VALUE_NOT_AVAILABLE_ULL or used < 0:
                    used = None
            out.append((int(proc.pid), used))
        return out

    def clock_event_reasons(self, uuid: str) -> int | None:
        lib = self._lib()
        if not hasattr(lib, "nvmlDeviceGetCurrentClocksEventReasons"):  # older nvidia-ml-py
            return None
        return int(self._call("clock event reasons (nvmlDeviceGetCurrentClocksEventReasons)",
                              "nvmlDeviceGetCurrentClocksEventReasons", self._handle(uuid)))


def _copy_error(err: NvmlError) -> NvmlError:
    if isinstance(err, NvmlUnavailableError):
        return NvmlUnavailableError(str(err), err.reason)
    return NvmlError(str(err))

