"""cudalab: a torch.cuda-style CUDA runtime without PyTorch, and a Jupyter toolkit over it.

``import cudalab`` is cheap: it creates no CUDA context and imports neither the driver
bindings nor numpy; those load on first use. Set ``CUDALAB_SIMULATOR=1`` (or call
:func:`use_simulator` first) to run on simulated devices without a GPU.
"""

from __future__ import annotations

import importlib
import os as _os
from typing import Any

from cudalab import _interrupts, _observe
from cudalab.devices import (
    Device,
    DeviceProperties,
    can_device_access_peer,
    check_error,
    current_device,
    device,
    device_count,
    device_of,
    get_arch_list,
    get_device_capability,
    get_device_name,
    get_device_properties,
    get_gencode_flags,
    init,
    ipc_collect,
    is_available,
    is_bf16_supported,
    is_initialized,
    is_tf32_supported,
    mem_get_info,
    set_device,
    synchronize,
    use_simulator,
)
from cudalab.errors import (
    CublasError,
    CudaError,
    CudaUnavailableError,
    CufftError,
    DriverNotFoundError,
    KernelCompileError,
    NcclError,
    NvmlError,
    OutOfMemoryError,
    StreamCaptureError,
)
from cudalab.events import Event
from cudalab.streams import (
    ExternalStream,
    Stream,
    StreamContext,
    current_stream,
    default_stream,
    get_stream_from_external,
    set_stream,
    stream,
)
from cudalab.sync_debug import get_sync_debug_mode, set_sync_debug_mode

__version__ = "0.1.0"

# Ctrl-C is deferred while cudalab's modules are imported (first use loads them lazily) and
# across its critical sections: a half-finished import is never left bound (cudalab._interrupts).
_interrupts.guard_imports([_os.path.join(__path__[0], "")])
_interrupts.guard(*_observe.MUTATORS)  # a bus list never changes without its flag
_interrupts.install()

# Public names that live in heavier modules, loaded on first access.
_LAZY: dict[str, str] = {
    # memory API (torch.cuda top-level names)
    **{
        name: "cudalab.memory"
        for name in (
            "memory_allocated", "max_memory_allocated", "reset_max_memory_allocated",
            "memory_reserved", "max_memory_reserved", "memory_cached", "max_memory_cached",
            "reset_max_memory_cached", "reset_peak_memory_stats", "reset_accumulated_memory_stats",
            "memory_stats", "memory_stats_as_nested_dict", "memory_summary", "empty_cache",
            "set_per_process_memory_fraction", "get_per_process_memory_fraction",
            "caching_allocator_alloc", "caching_allocator_delete", "get_allocator_backend",
            "memory_snapshot", "caching_allocator_enable", "CUDAPluggableAllocator",
            "change_current_allocator",
        )
    },
    # CUDA graphs (torch.cuda.graphs)
    **{name: "cudalab.graphs" for name in ("CUDAGraph", "graph", "is_current_stream_capturing",
                                           "make_graphed_callables")},
    # private memory pools (torch.cuda.MemPool / use_mem_pool / graph_pool_handle)
    **{name: "cudalab.memory" for name in ("MemPool", "use_mem_pool")},
    "graph_pool_handle": "cudalab.allocator.pools",
    # device arrays and pinned memory
    **{
        name: "cudalab.array"
        for name in ("DeviceArray", "empty", "zeros", "ones", "full", "empty_like", "zeros_like",
                     "asarray", "from_dlpack", "where")
    },
    **{name: "cudalab.memory" for name in ("record_history", "load_snapshot", "export_memory_viz")},
    **{name: "cudalab.allocator.pinned" for name in (
        "empty_pinned", "pin_memory", "is_pinned", "pinned_memory_stats", "empty_pinned_cache",
        "host_memory_stats", "host_memory_stats_as_nested_dict", "reset_peak_host_memory_stats",
        "reset_accumulated_host_memory_stats")},
    # random numbers (torch.cuda's RNG API, bit-exact generation)
    **{
        name: "cudalab.random"
        for name in ("manual_seed", "manual_seed_all", "seed", "seed_all", "initial_seed",
                     "get_rng_state", "get_rng_state_all", "set_rng_state", "set_rng_state_all",
                     "Generator", "rand", "randn", "randint", "normal", "uniform_", "normal_",
                     "bernoulli_")
    },
    "current_blas_handle": "cudalab.blas",
    # matmul over cuBLAS and its precision settings (torch.matmul, torch.*_float32_matmul_precision)
    "matmul": "cudalab._array_matmul",
    **{name: "cudalab.matmul_precision" for name in ("set_float32_matmul_precision",
                                                    "get_float32_matmul_precision")},
    # NVML (torch units)
    **{
        name: "cudalab.nvml"
        for name in ("utilization", "memory_usage", "temperature", "power_draw", "clock_rate",
                     "list_gpu_processes", "device_memory_used")
    },
}
_SUBMODULES = {"blas", "fft", "backends", "memory", "nvtx", "nvml", "kernels", "array", "widgets",
               "magics", "cli", "random", "interop", "jiterator", "sanitizer", "graphs", "comm",
               "nccl", "cluster"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"cudalab.{name}")
    raise AttributeError(f"module 'cudalab' has no attribute {name!r}")


_interrupts.guard(__getattr__)

# CUDALAB_SANITIZER=1 (or warn / collect): the stream sanitizer from the start (imported
# only then: without it `import cudalab` does not load it).
if _os.environ.get("CUDALAB_SANITIZER", "") not in ("", "0"):
    importlib.import_module("cudalab.sanitizer").enable_from_env()

# CUDALAB_CLUSTER=<directory>: this process publishes its memory there for a notebook to
# watch (cudalab.cluster.serve; pyzmq and the publisher load only then).
if _os.environ.get("CUDALAB_CLUSTER", "").strip():
    importlib.import_module("cudalab.cluster.publisher").serve_from_env()


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext cudalab``: register the magics (see :mod:`cudalab.magics`)."""
    importlib.import_module("cudalab.magics").load_ipython_extension(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext cudalab``: remove hooks and stop cudalab's background threads."""
    importlib.import_module("cudalab.magics").unload_ipython_extension(ipython)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | _SUBMODULES)


__all__ = [
    "CublasError", "CudaError", "CufftError", "CudaUnavailableError", "Device", "DeviceProperties",
    "DriverNotFoundError", "Event", "ExternalStream", "KernelCompileError", "NcclError", "NvmlError", "OutOfMemoryError", "Stream",
    "StreamCaptureError",
    "StreamContext", "can_device_access_peer", "check_error", "current_device",
    "current_stream", "default_stream", "device", "device_count", "device_of", "get_arch_list",
    "get_device_capability", "get_device_name", "get_device_properties", "get_gencode_flags",
    "get_stream_from_external", "get_sync_debug_mode", "init", "ipc_collect", "is_available",
    "is_bf16_supported", "is_initialized", "is_tf32_supported",
    "mem_get_info", "set_device", "set_stream", "set_sync_debug_mode", "stream", "synchronize",
    "use_simulator", *sorted(_LAZY),
]
