"""The simulator backend: :class:`SimulatorBackend`, assembled from its concern mixins.

Each concern lives in its own module (:mod:`.memory`, :mod:`.vmm`, :mod:`.streams`,
:mod:`.events`, :mod:`.kernels`, :mod:`.graphs`) as a mixin over
:class:`~.core.SimulatorCore`; this module adds device identity, contexts, peer access and NVML, and is the class users construct.
"""

from __future__ import annotations

from typing import SupportsInt

from cudalab._driver.base import Blas, DeviceInfo, Fft, Nccl
from cudalab._driver.sim.config import SimulatorConfig
from cudalab._driver.sim.core import invalid_device
from cudalab._driver.sim.events import SimEvents
from cudalab._driver.sim.graphs import SimGraphs
from cudalab._driver.sim.handles import SimEvent, SimFunction, SimModule, SimStream
from cudalab._driver.sim.kernels import SimKernels
from cudalab._driver.sim.memory import SimMemory
from cudalab._driver.sim.nvml import SimulatedNvml
from cudalab._driver.sim.streams import SimStreams
from cudalab._driver.sim.vmm import SimVmm

__all__ = ["SimulatorBackend"]


class SimulatorBackend(SimStreams, SimEvents, SimMemory, SimVmm, SimKernels, SimGraphs):
    """A simulated CUDA driver (see :mod:`cudalab._driver.sim` for the model).

    Parameters
    ----------
    config : SimulatorConfig or None, optional
        Devices, memory per device and visible devices. None (default) reads them from the
        environment with :meth:`SimulatorConfig.from_env`.

    Raises
    ------
    ValueError
        When ``config`` is None and the environment's settings are not understood.

    Notes
    -----
    Besides the :class:`~cudalab._driver.base.Backend` interface it offers, for kernels and
    tests: :meth:`host_view`, :meth:`array`, and the simulator-only test hooks
    :meth:`pause_stream` / :meth:`resume_stream`. Several backends with different configs
    can live side by side (each owns its memory, streams and handles).
    """

    def __init__(self, config: SimulatorConfig | None = None) -> None:
        super().__init__(config)
        self._nvml: SimulatedNvml | None = None  # created on first use
        self._nccl: Nccl | None = None  # created on first use
        self._blas: Blas | None = None  # created on first use
        self._fft: Fft | None = None  # created on first use

    # ------------------------------------------------------------ lifecycle and identity
    def init(self) -> None:
        self._initialized = True

    def driver_version(self) -> int:
        return 13000

    def device_count(self) -> int:
        return len(self._devs)

    def device_info(self, device: int) -> DeviceInfo:
        d = self._device(device, "cuDeviceGetAttribute")
        dev = self._devs[d]
        if dev.info is None:
            phys = dev.physical
            dev.info = DeviceInfo(
                ordinal=d,
                name="cudalab simulated GPU (H100-like)",
                major=9,
                minor=0,
                total_memory=dev.capacity,
                multi_processor_count=132,
                uuid=self.physical_uuids[phys],
                pci_bus_id=f"0000:{0x18 + phys:02x}:00.0",
                pci_domain_id=0,
                pci_device_id=0,
                l2_cache_size=50 << 20,
                max_threads_per_multi_processor=2048,
                max_threads_per_block=1024,
                warp_size=32,
                regs_per_multiprocessor=65536,
                shared_memory_per_block=48 << 10,
                shared_memory_per_block_optin=227 << 10,
                shared_memory_per_multiprocessor=228 << 10,
                clock_rate=1980000,
                memory_clock_rate=2619000,
                memory_bus_width=5120,
                is_integrated=False,
                is_multi_gpu_board=False,
                unified_addressing=True,
                simulated=True,
                extra={"physical_index": phys, "pci_bus": 0x18 + phys,
                       "backend": "cudalab simulator"},
            )
        return dev.info

    def handle_int(self, handle: SupportsInt | None) -> int:
        if isinstance(handle, (SimStream, SimEvent, SimModule, SimFunction)):
            return handle.handle
        return 0 if handle is None else int(handle)

    # ------------------------------------------------------------ contexts
    def set_context(self, device: int) -> None:
        d = self._device(device, "cuCtxSetCurrent")
        self._tls.device = d
        self._devs[d].touched = True

    def synchronize(self, device: int) -> None:
        d = self._device(device, "cuCtxSynchronize")
        if self._captures:
            # it would wait for the device's capturing streams too: refused in every mode
            self._refuse_in_capture("cuCtxSynchronize", device=d)
        dev = self._devs[d]
        for s in [dev.null, *list(dev.streams)]:
            self._sync_stream(s)

    def can_access_peer(self, device: int, peer: int) -> bool:
        d = self._device(device, "cuDeviceCanAccessPeer")
        p = self._device(peer, "cuDeviceCanAccessPeer")
        return d != p

    def enable_peer_access(self, device: int, peer: int) -> None:
        d = self._device(device, "cuCtxEnablePeerAccess")
        p = self._device(peer, "cuCtxEnablePeerAccess")
        if d == p:
            raise invalid_device("cuCtxEnablePeerAccess")
        self._devs[d].touched = True
        self._peers.add((d, p))

    # ------------------------------------------------------------ NVML
    def nvml(self) -> SimulatedNvml:
        if self._nvml is None:
            self._nvml = SimulatedNvml(self)
        return self._nvml

    # ------------------------------------------------------------ NCCL
    def nccl(self) -> Nccl:
        if self._nccl is None:
            from cudalab._driver.sim.nccl import SimulatedNccl

            self._nccl = SimulatedNccl(self)
        return self._nccl

    # ------------------------------------------------------------ cuBLAS and cuFFT
    def blas(self) -> Blas:
        if self._blas is None:
            from cudalab._driver.sim.blas import SimulatedBlas

            self._blas = SimulatedBlas(self)
        return self._blas

    def fft(self) -> Fft:
        if self._fft is None:
            from cudalab._driver.sim.fft import SimulatedFft

            self._fft = SimulatedFft(self)
        return self._fft
