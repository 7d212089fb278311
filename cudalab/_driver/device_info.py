"""What the seam says of one device: :class:`DeviceInfo` (:meth:`Backend.device_info`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["DeviceInfo"]


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """Static properties of one device, read once (torch's ``_CudaDeviceProperties`` fields)."""

    ordinal: int
    name: str
    major: int
    minor: int
    total_memory: int
    multi_processor_count: int
    uuid: str  # "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (NVML's spelling)
    pci_bus_id: str  # "0000:00:06.0"
    pci_domain_id: int
    pci_device_id: int
    l2_cache_size: int
    max_threads_per_multi_processor: int
    max_threads_per_block: int
    warp_size: int
    regs_per_multiprocessor: int
    shared_memory_per_block: int
    shared_memory_per_block_optin: int
    shared_memory_per_multiprocessor: int
    clock_rate: int  # kHz
    memory_clock_rate: int  # kHz
    memory_bus_width: int  # bits
    is_integrated: bool
    is_multi_gpu_board: bool
    unified_addressing: bool
    simulated: bool = False
    #: further driver attributes by name (the real backend's; empty on the simulator)
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
