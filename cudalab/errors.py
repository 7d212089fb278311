"""Exceptions raised by cudalab (torch.cuda-compatible names and base classes)."""

from __future__ import annotations


class CudaError(RuntimeError):
    """A CUDA driver call failed.

    Carries the driver's error ``code`` (a ``CUresult`` value), its ``name``
    (e.g. ``"CUDA_ERROR_INVALID_VALUE"``) and its description string, plus the call that
    failed when known, so a message reads like ``cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY
    (2): out of memory``.
    """

    def __init__(self, code: int, name: str = "", message: str = "", call: str | None = None):
        self.code = int(code)
        self.name = name or f"CUDA error {self.code}"
        self.message = message
        self.call = call
        where = f"{call}: " if call else ""
        text = f"{where}{self.name} ({self.code})"
        if message:
            text += f": {message}"
        super().__init__(text)

    def __reduce__(self):
        return (type(self), (self.code, self.name, self.message, self.call))


class OutOfMemoryError(CudaError):
    """Device memory is exhausted (torch.cuda.OutOfMemoryError's counterpart).

    Raised by the driver seam for a failed device allocation (``CUDA_ERROR_OUT_OF_MEMORY``,
    code 2) and by the caching allocator, whose message follows torch's layout.
    """

    def __init__(self, code: int = 2, name: str = "CUDA_ERROR_OUT_OF_MEMORY",
                 message: str = "out of memory", call: str | None = None,
                 text: str | None = None):
        super().__init__(code, name, message, call)
        self.text = text
        if text is not None:
            self.args = (text,)

    def __str__(self) -> str:
        return self.text if self.text is not None else super().__str__()

    def __reduce__(self):
        return (type(self), (self.code, self.name, self.message, self.call, self.text))


class DriverNotFoundError(RuntimeError):
    """No CUDA driver library could be loaded (the normal state of a machine without a GPU)."""


class CudaUnavailableError(RuntimeError):
    """CUDA work was requested but no device is usable (no driver, or no GPU)."""


class NvmlError(RuntimeError):
    """NVML (the management library) is missing or a query failed."""


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel; the message carries the compiler log."""


class CublasError(RuntimeError):
    """cuBLAS is missing, or a cuBLAS call failed (the message names the call and status).

    ``status`` is the ``cublasStatus_t`` value (None when the library could not be loaded).
    """

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status



__all__ = [
    "CudaError",
    "OutOfMemoryError",
    "DriverNotFoundError",
    "CudaUnavailableError",
    "NvmlError",
    "KernelCompileError",
    "CublasError",
]

