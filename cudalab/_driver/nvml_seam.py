"""The management library's seam: :class:`Nvml` (:meth:`Backend.nvml`), implemented by
:class:`cudalab._driver.nvml.RealNvml` and :class:`cudalab._driver.sim.nvml.SimulatedNvml`."""

from __future__ import annotations

import abc

__all__ = ["Nvml"]


class Nvml(abc.ABC):
    """Device management queries (NVML), keyed by the CUDA device's UUID string.

    Every method may raise :class:`cudalab.NvmlError` with a readable message (library
    missing, driver not loaded, query not supported on this device).
    """

    simulated: bool = False

    @abc.abstractmethod
    def device_count(self) -> int:
        """Devices NVML sees (all of them, ignoring CUDA_VISIBLE_DEVICES)."""

    @abc.abstractmethod
    def uuids(self) -> list[str]:
        """UUIDs in NVML index order."""

    @abc.abstractmethod
    def utilization(self, uuid: str) -> tuple[int, int]:
        """(gpu %, memory %) over the last sample period."""

    @abc.abstractmethod
    def memory_info(self, uuid: str) -> tuple[int, int, int]:
        """(total, free, used) bytes for the whole device."""

    @abc.abstractmethod
    def temperature(self, uuid: str) -> int:
        """GPU temperature in degrees C."""

    @abc.abstractmethod
    def power_usage(self, uuid: str) -> int:
        """Power draw in milliwatts."""

    @abc.abstractmethod
    def clock_sm(self, uuid: str) -> int:
        """Current SM clock in MHz."""

    @abc.abstractmethod
    def processes(self, uuid: str) -> list[tuple[int, int | None]]:
        """Compute processes as (pid, used bytes or None when NVML cannot tell)."""

    @abc.abstractmethod
    def clock_event_reasons(self, uuid: str) -> int | None:
        """NVML's clocks-event-reasons bit mask (``nvmlDeviceGetCurrentClocksEventReasons``:
        what limits the device's clocks now, e.g. 0x4 SW power cap, 0x40 HW thermal
        slowdown), or None where there is no such mask to read (the simulator has no clock
        limits; a ``pynvml`` without the call)."""
