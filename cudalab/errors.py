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


class StreamCaptureError(CudaError):
    """An operation that a CUDA graph capture does not permit (``CUDA_ERROR_STREAM_CAPTURE_*``,
    codes 900-908), or the capture it broke.

    The driver refuses host-synchronising calls (a device, stream or event synchronize or
    query, a copy to pageable host memory) while a stream is being captured, and invalidates
    the capture; the capture must then be ended (``CUDAGraph.capture_end()``, which a
    ``with cudalab.graph(...)`` block always calls) before the next one can begin.

    Parameters
    ----------
    code, name, message, call
        As :class:`CudaError` (the driver's code, name and text, and the driver call).
    operation : str or None, optional
        The cudalab operation that was refused (e.g. ``"cudalab.synchronize()"``); the
        message then names it first.
    """

    def __init__(self, code: int = 900, name: str = "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
                 message: str = "operation not permitted when stream is capturing",
                 call: str | None = None, operation: str | None = None):
        super().__init__(code, name, message, call)
        self.operation = operation
        if operation is not None:
            self.args = (f"{operation} is not allowed while a CUDA graph is being captured "
                         f"({super().__str__()}). The capture is invalidated: end it "
                         "(capture_end(), or leave the `with cudalab.graph(...)` block) and "
                         "capture again without this operation.",)

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else super().__str__()

    def __reduce__(self):
        return (type(self), (self.code, self.name, self.message, self.call, self.operation))

    def for_operation(self, operation: str) -> StreamCaptureError:
        """The same driver error, its message naming the cudalab ``operation`` refused."""
        return StreamCaptureError(self.code, self.name, self.message, self.call, operation)


def name_operation(exc: BaseException, operation: str) -> BaseException:
    """``exc`` with its message naming the cudalab ``operation`` when it is a
    :class:`StreamCaptureError` (raised ``from`` the driver's error), else ``exc`` itself."""
    if isinstance(exc, StreamCaptureError) and exc.operation is None:
        named = exc.for_operation(operation)
        named.__cause__ = exc
        return named
    return exc


class DriverNotFoundError(RuntimeError):
    """No CUDA driver library could be loaded (the normal state of a machine without a GPU)."""


class CudaUnavailableError(RuntimeError):
    """CUDA work was requested but no device is usable (no driver, or no GPU)."""


class NvmlError(RuntimeError):
    """NVML (the management library) is missing or a query failed."""


class NcclError(RuntimeError):
    """NCCL is missing, a communicator cannot be used, or an NCCL call failed.

    ``code`` is the ``ncclResult_t`` value (None when the failure is not NCCL's own, e.g.
    the library could not be loaded), ``name`` its name (``"ncclInvalidArgument"``) and the
    message carries NCCL's own text, so it reads like ``ncclAllReduce: ncclInvalidArgument
    (4): invalid argument (run with NCCL_DEBUG=WARN for details) - <ncclGetLastError>``.
    """

    def __init__(self, message: str, code: int | None = None, name: str = ""):
        super().__init__(message)
        self.code = code
        self.name = name

    def __reduce__(self):
        return (type(self), (self.args[0] if self.args else "", self.code, self.name))


class StreamDeviceError(ValueError, RuntimeError):
    """A stream chosen for work on one device is on another: a ``streams[i]`` of
    :mod:`cudalab.nccl` or the ``stream=`` of a :class:`cudalab.comm.Communicator` operation
    (raised by :func:`cudalab.collective_call.check_stream`, before anything is queued).

    It is a ValueError (a bad argument, as the Communicator's other checks raise) and a
    RuntimeError (as torch.cuda.nccl's checks raise), so code catching either still does.
    """


class AllocatorSettingsError(ValueError, RuntimeError):
    """Allocator settings that do not parse (``CUDALAB_ALLOC_CONF``,
    ``PYTORCH_CUDA_ALLOC_CONF``, ``memory._set_allocator_settings``): the message names the
    option, the bad value and the accepted form, after torch's own words where torch has them.

    It is a ValueError (a bad value) and a RuntimeError (as torch's ``TORCH_CHECK`` in its
    settings parser raises, which torch's tests assert), so code catching either still does.
    """


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel; the message carries the compiler log."""


class CublasError(RuntimeError):
    """cuBLAS is missing, or a cuBLAS call failed (the message names the call and status).

    ``status`` is the ``cublasStatus_t`` value (None when the library could not be loaded).
    """

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class CufftError(RuntimeError):
    """cuFFT is missing (the message names the ``fft`` extra), or a cuFFT call failed (the
    message names the call and its ``cufftResult``).

    ``result`` is the ``cufftResult`` value (None when the library could not be loaded).
    """

    def __init__(self, message: str, result: int | None = None):
        super().__init__(message)
        self.result = result


__all__ = [
    "CudaError",
    "OutOfMemoryError",
    "StreamCaptureError",
    "DriverNotFoundError",
    "CudaUnavailableError",
    "NvmlError",
    "KernelCompileError",
    "NcclError",
    "StreamDeviceError",
    "AllocatorSettingsError",
    "CublasError",
    "CufftError",
]

