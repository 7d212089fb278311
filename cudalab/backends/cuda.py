"""``cudalab.backends.cuda``: torch.backends.cuda's ``matmul`` switches and ``cufft_plan_cache``.

* ``matmul.allow_tf32`` (default False), ``matmul.allow_fp16_reduced_precision_reduction``
  and ``matmul.allow_bf16_reduced_precision_reduction`` (default True),
  ``matmul.allow_fp16_accumulation`` (default False) and ``matmul.fp32_precision``
  (``"ieee"`` or ``"tf32"``, torch 2.9's spelling of the same switch): see
  :mod:`cudalab.matmul_precision` for what each changes in the cuBLAS call.
* ``cufft_plan_cache[device]``: the device's :class:`~cudalab.fft.plan_cache.CuFFTPlanCache`
  (``max_size``, ``size``, ``clear()``); without an index, the current device's.
* ``clear_cublas_workspaces()``: gives the cuBLAS workspaces back to the caching allocator
  (torch's private ``torch._C._cuda_clearCublasWorkspaces``).
"""

from __future__ import annotations

from typing import Any

from cudalab import _internal
from cudalab import devices as _devices
from cudalab._array_matmul import clear_workspaces as clear_cublas_workspaces
from cudalab.fft.plan_cache import CuFFTPlanCache, plan_cache
from cudalab.matmul_precision import SETTINGS, set_float32_matmul_precision

__all__ = ["PlanCacheIndexError", "clear_cublas_workspaces", "cuBLASModule",
           "cuFFTPlanCacheManager", "cufft_plan_cache", "matmul"]


class PlanCacheIndexError(IndexError, RuntimeError):
    """``cufft_plan_cache[i]`` of a device that does not exist: an IndexError, and a
    RuntimeError as torch's."""


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"cudalab.backends.cuda.matmul.{name} must be a bool, got "
                        f"{type(value).__name__}")
    return value


class cuBLASModule:
    """``cudalab.backends.cuda.matmul`` (torch's class name): the matmul switches."""

    __slots__ = ()

    @property
    def allow_tf32(self) -> bool:
        """TF32 tensor cores for float32 matmuls (default False); True unless the float32
        matmul precision is "highest"."""
        return SETTINGS.tf32

    @allow_tf32.setter
    def allow_tf32(self, value: bool) -> None:
        set_float32_matmul_precision("high" if _flag(value, "allow_tf32") else "highest")

    @property
    def fp32_precision(self) -> str:
        """``"tf32"`` when TF32 is allowed, else ``"ieee"`` (torch 2.9's API)."""
        return "tf32" if SETTINGS.tf32 else "ieee"

    @fp32_precision.setter
    def fp32_precision(self, value: str) -> None:
        if value not in ("ieee", "tf32"):
            raise ValueError(f"cudalab.backends.cuda.matmul.fp32_precision must be 'ieee' or "
                             f"'tf32', got {value!r}")
        set_float32_matmul_precision("high" if value == "tf32" else "highest")

    @property
    def allow_fp16_reduced_precision_reduction(self) -> bool:
        """Reduced-precision (split-K) reductions in float16 matmuls (default True)."""
        return SETTINGS.allow_fp16_reduced_precision_reduction

    @allow_fp16_reduced_precision_reduction.setter
    def allow_fp16_reduced_precision_reduction(self, value: bool) -> None:
        SETTINGS.allow_fp16_reduced_precision_reduction = _flag(
            value, "allow_fp16_reduced_precision_reduction")

    @property
    def allow_bf16_reduced_precision_reduction(self) -> bool:
        """Reduced-precision (split-K) reductions in bfloat16 matmuls (default True)."""
        return SETTINGS.allow_bf16_reduced_precision_reduction

    @allow_bf16_reduced_precision_reduction.setter
    def allow_bf16_reduced_precision_reduction(self, value: bool) -> None:
        SETTINGS.allow_bf16_reduced_precision_reduction = _flag(
            value, "allow_bf16_reduced_precision_reduction")

    @property
    def allow_fp16_accumulation(self) -> bool:
        """float16 matmuls accumulate in float16 (``CUBLAS_COMPUTE_16F``; default False)."""
        return SETTINGS.allow_fp16_accumulation

    @allow_fp16_accumulation.setter
    def allow_fp16_accumulation(self, value: bool) -> None:
        SETTINGS.allow_fp16_accumulation = _flag(value, "allow_fp16_accumulation")

    def __setattr__(self, name: str, value: Any) -> None:
        if not isinstance(getattr(type(self), name, None), property):
            raise AttributeError(f"Unknown attribute {name}")
        object.__setattr__(self, name, value)


class cuFFTPlanCacheManager:
    """``cudalab.backends.cuda.cufft_plan_cache`` (torch's class): ``[device]`` gives that
    device's cache; its attributes without an index are the current device's."""

    __slots__ = ()

    def __getitem__(self, device: Any) -> CuFFTPlanCache:
        count = _devices.device_count()
        if type(device) is int and not 0 <= device < count:
            raise PlanCacheIndexError(f"cufft_plan_cache: expected 0 <= device index < "
                                      f"{count}, but got device with index {device}")
        return plan_cache(_internal.device_index(device, optional=False))

    def __len__(self) -> int:
        return _devices.device_count()

    def __getattr__(self, name: str) -> Any:
        return getattr(self[_internal.device_index(None)], name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self[_internal.device_index(None)], name, value)

    def __repr__(self) -> str:
        return "<cudalab.backends.cuda.cufft_plan_cache: one cuFFT plan cache per device>"


#: torch.backends.cuda.matmul.
matmul = cuBLASModule()
#: torch.backends.cuda.cufft_plan_cache.
cufft_plan_cache = cuFFTPlanCacheManager()
