"""The simulator backend: a CUDA driver made of host memory, host clocks and numpy kernels.

Chosen only explicitly (``CUDALAB_SIMULATOR=1`` or :func:`cudalab.use_simulator`); every
device it shows says "simulated". It exists so that cudalab's upper layers (allocator,
streams, events, magics, widgets) can be developed and tested on machines without a GPU,
and so that tests can create situations a real GPU makes hard to arrange (work that is
deliberately "not yet complete", a device that runs out of memory at a chosen size).

Configuration is a :class:`SimulatorConfig` (device count, memory per device, visible
devices): ``SimulatorBackend(SimulatorConfig(device_count=1, memory=64 << 20))``, or
``SimulatorBackend()`` to read ``CUDALAB_SIMULATOR_DEVICES``, ``CUDALAB_SIMULATOR_MEMORY``
and ``CUDA_VISIBLE_DEVICES`` with :meth:`SimulatorConfig.from_env` (the only reader of
those variables).

Modules, one concept each:

==============  ============================================================================
``config``      :class:`SimulatorConfig`, its environment reader, ``CUDA_VISIBLE_DEVICES``
                parsing and the simulated devices' UUIDs
``handles``     stream, event, wait, module and kernel handle objects (state only)
``heap``        the fake address layout; device heaps, pool caches, VMM records
``core``        :class:`~.core.SimulatorCore`: shared state, validation, error helpers
``memory``      device and pinned host memory, copies, fills, address translation
``vmm``         virtual memory (reserve/create/map) and stream-ordered pools
``streams``     stream FIFOs, the pump that runs them, pause/resume test hooks
``events``      events, timing and IPC event handles
``kernels``     :func:`register_kernel` registry, argument packs, module load and launch
``graphs``      stream capture (recording instead of running), graphs and their replay
``nvml``        :class:`SimulatedNvml`, values derived from the simulator's state
``backend``     :class:`SimulatorBackend`, assembled from the concern mixins above
==============  ============================================================================

Model in brief (details in each module's documentation): device pointers are fake addresses
``0xA000_0000_0000 + ordinal * 2**40 + offset`` backed by lazily committed host mappings;
each stream is a FIFO that normally runs at once in the caller's thread; events read
``time.perf_counter_ns``; kernels are Python callables registered by name and called as
``impl(sim, grid, block, shared_mem, *args)``.
"""

from __future__ import annotations

from cudalab._driver.sim.backend import SimulatorBackend
from cudalab._driver.sim.config import MAX_DEVICES, SimulatorConfig, parse_visible_devices
from cudalab._driver.sim.heap import DEVICE_STRIDE, FAKE_BASE
from cudalab._driver.sim.kernels import register_kernel
from cudalab._driver.sim.nvml import SimulatedNvml

__all__ = [
    "SimulatorBackend",
    "SimulatorConfig",
    "SimulatedNvml",
    "register_kernel",
    "parse_visible_devices",
    "FAKE_BASE",
    "DEVICE_STRIDE",
    "MAX_DEVICES",
]
