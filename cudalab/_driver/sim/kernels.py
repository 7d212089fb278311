"""Simulated kernels: the registry of their Python implementations, argument packs, launches.

Kernels are Python callables registered by name with :func:`register_kernel`; they are
called as ``impl(sim, grid, block, shared_mem, *args)`` where ``sim`` is the backend (use
``sim.array(ptr, dtype, count)`` to reach device memory). :meth:`SimKernels.module_load`
accepts any image and :meth:`SimKernels.module_function` looks kernels up by name in the
registry. A launch is an operation in the stream's FIFO (:mod:`.streams`); an exception in a
kernel becomes ``CUDA_ERROR_LAUNCH_FAILED``, as a fault in a real kernel would.
"""

from __future__ import annotations

import operator
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

from cudalab._driver.base import KernelArgs
from cudalab._driver.handles import FunctionHandle, ModuleHandle, StreamHandle
from cudalab._driver.sim.core import (
    ACTIVITY_KERNEL,
    SimulatorCore,
    invalid_handle,
    invalid_value,
    now,
)
from cudalab._driver.sim.handles import SimFunction, SimModule, next_handle
from cudalab.errors import CudaError

__all__ = ["register_kernel", "SimKernels"]

# Launch limits of the simulated (H100-like) device.
_MAX_SHARED_OPTIN = 227 << 10
_BLOCK_LIMITS = (1024, 1024, 64)
_GRID_LIMITS = (2**31 - 1, 65535, 65535)


# --------------------------------------------------------------------------- kernel registry
#: Kernel name -> implementation; replaced as a whole by tests that isolate the registry.
_KERNELS: dict[str, Callable[..., None]] = {}
_KERNELS_LOCK = threading.Lock()


def register_kernel(name: str, impl: Callable[..., None] | None = None) -> Any:
    """Register the simulator implementation of kernel ``name``.

    ``impl(sim, grid, block, shared_mem, *args)`` is called when the kernel runs, with
    ``sim`` the :class:`SimulatorBackend` (use ``sim.array(ptr, dtype, count)`` to reach device
    memory) and ``args`` the launch's argument values. Usable directly,
    ``register_kernel("axpy", fn)``, or as a decorator, ``@register_kernel("axpy")``. A later
    registration of the same name replaces the earlier one for modules looked up afterwards.
    """
    if not isinstance(name, str) or not name:
        raise TypeError("register_kernel: the kernel name must be a non-empty str")

    def decorate(fn: Callable[..., None]) -> Callable[..., None]:
        if not callable(fn):
            raise TypeError(f"register_kernel({name!r}): the implementation must be callable")
        with _KERNELS_LOCK:
            _KERNELS[name] = fn
        return fn

    return decorate if impl is None else decorate(impl)



# ------------------------------------------------------------------------ argument packs
_INT_RANGES = {
    "p": (0, 2**64 - 1),
    "i4": (-(2**31), 2**31 - 1),
    "u4": (0, 2**32 - 1),
    "i8": (-(2**63), 2**63 - 1),
    "u8": (0, 2**64 - 1),
}
_FLOAT_TYPES = ("f4", "f8")
_F4 = struct.Struct("<f")


class _SimArgs(KernelArgs):
    """Kernel arguments for the simulator: validated Python numbers."""

    __slots__ = ("signature", "_values")

    def __init__(self, signature: tuple[str, ...]):
        self.signature = signature
        self._values = tuple(0.0 if t in _FLOAT_TYPES else 0 for t in signature)

    def set(self, *values: Any) -> _SimArgs:
        sig = self.signature
        if len(values) != len(sig):
            raise ValueError(
                f"kernel takes {len(sig)} argument(s) ({', '.join(sig) or 'none'}), "
                f"got {len(values)}"
            )
        out = []
        for i, (t, v) in enumerate(zip(sig, values)):
            if t in _FLOAT_TYPES:
                if isinstance(v, (str, bytes, complex)) or not hasattr(v, "__float__"):
                    raise TypeError(f"kernel argument {i} ({t}) must be a real number, "
                                    f"not {type(v).__name__}")
                f = float(v)
                if t == "f4":
                    try:
                        f = _F4.unpack(_F4.pack(f))[0]
                    except OverflowError:
                        raise ValueError(f"kernel argument {i} ({t}) {v!r} is out of range "
                                         "for float32") from None
                out.append(f)
            else:
                try:
                    n = operator.index(v)
                except TypeError:
                    raise TypeError(f"kernel argument {i} ({t}) must be an int, "
                                    f"not {type(v).__name__}") from None
                lo, hi = _INT_RANGES[t]
                if not lo <= n <= hi:
                    raise ValueError(f"kernel argument {i} ({t}) {n} is out of range "
                                     f"[{lo}, {hi}]")
                out.append(n)
        self._values = tuple(out)
        return self

    @property
    def values(self) -> tuple[Any, ...]:
        return self._values

    def __repr__(self) -> str:
        return f"<simulated kernel args {self.signature} = {self._values}>"



def _dims(value: Any, limits: tuple[int, int, int], what: str, call: str) -> tuple[int, int, int]:
    try:
        dims = tuple(operator.index(v) for v in value)
    except TypeError:
        raise invalid_value(call, f"{what} must be three ints, got {value!r}") from None
    if len(dims) != 3:
        raise invalid_value(call, f"{what} must be three ints, got {value!r}")
    for v, hi in zip(dims, limits):
        if not 1 <= v <= hi:
            raise invalid_value(call, f"{what} {dims} is outside the limits (1..{limits})")
    return dims  # type: ignore[return-value]  # three ints: checked just above



# ------------------------------------------------------------------------------ the concern
class SimKernels(SimulatorCore):
    """Modules, kernel lookup, argument packs and launches of the simulator backend."""

    def module_load(self, device: int, image: bytes) -> ModuleHandle:
        """Accept any image (a CUBIN for a real GPU, PTX or source text); kernels are looked
        up by name in the simulator's registry (:func:`register_kernel`)."""
        call = "cuModuleLoadData"
        d = self._device(device, call)
        if isinstance(image, str):
            size = len(image.encode())
        elif isinstance(image, (bytes, bytearray, memoryview)):
            size = memoryview(image).nbytes
        else:
            raise invalid_value(call, "the module image must be bytes")
        if size == 0:
            raise CudaError(200, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid",
                            call=call)
        self._devs[d].touched = True
        return ModuleHandle(SimModule(self, d, next_handle(), size))

    def module_unload(self, module: ModuleHandle) -> None:
        self._module(module, "cuModuleUnload").unloaded = True

    def module_function(self, module: ModuleHandle, name: str) -> FunctionHandle:
        call = "cuModuleGetFunction"
        m = self._module(module, call)
        impl = _KERNELS.get(name)
        if impl is None:
            raise CudaError(500, "CUDA_ERROR_NOT_FOUND",
                            f"no simulator implementation registered for kernel {name!r}",
                            call=call)
        return FunctionHandle(SimFunction(m, name, impl, next_handle()))

    def make_args(self, signature: Sequence[str]) -> KernelArgs:
        sig = tuple(signature)
        for t in sig:
            if t not in _INT_RANGES and t not in _FLOAT_TYPES:
                raise ValueError(f"unknown kernel parameter type {t!r}; use one of "
                                 "'p', 'i4', 'u4', 'i8', 'u8', 'f4', 'f8'")
        return _SimArgs(sig)

    def launch(
        self,
        function: FunctionHandle,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_mem: int,
        stream: StreamHandle,
        args: KernelArgs,
    ) -> None:
        call = "cuLaunchKernel"
        if not isinstance(function, SimFunction) or function.module.backend is not self:
            raise invalid_handle(call, "not a kernel of this simulator")
        if function.module.unloaded:
            raise invalid_handle(call, "the kernel's module was unloaded")
        s = self.stream_of(stream, call)
        if s.device != function.module.device:
            raise invalid_handle(call, "the kernel's module is loaded on another device")
        g = _dims(grid, _GRID_LIMITS, "grid", call)
        b = _dims(block, _BLOCK_LIMITS, "block", call)
        if b[0] * b[1] * b[2] > 1024:
            raise invalid_value(call, f"block {b} has more than 1024 threads")
        smem = operator.index(shared_mem)
        if not 0 <= smem <= _MAX_SHARED_OPTIN:
            raise invalid_value(call, f"shared_mem {smem} is outside [0, {_MAX_SHARED_OPTIN}]")
        if not isinstance(args, _SimArgs):
            raise TypeError("launch: args must come from this backend's make_args()")
        self._devs[s.device].touched = True
        self.submit(s, self._kernel_op,
                     (function, g, b, smem, args.values, self._devs[s.device].physical))

    # ================================================================ internals
    def _module(self, module: ModuleHandle, call: str) -> SimModule:
        if type(module) is SimModule and module.backend is self and not module.unloaded:
            return module
        raise invalid_handle(call, f"{module!r} is not a loaded module of this simulator")

    # -- operations (run in stream order)
    def _kernel_op(self, fn: SimFunction, grid: tuple[int, int, int], block: tuple[int, int, int], smem: int,
                   values: tuple[Any, ...], phys: int) -> None:
        t0 = now()
        try:
            fn.impl(self, grid, block, smem, *values)
        except CudaError:
            raise
        except Exception as exc:
            raise CudaError(
                719, "CUDA_ERROR_LAUNCH_FAILED",
                f"unspecified launch failure (simulated kernel {fn.name!r} raised "
                f"{type(exc).__name__}: {exc})", call="cuLaunchKernel") from exc
        finally:
            self.activity[phys].append((t0, now(), ACTIVITY_KERNEL))
