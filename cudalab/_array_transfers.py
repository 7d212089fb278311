"""Transfers of :class:`cudalab.DeviceArray`: ``cpu``, ``tolist``, ``item``, ``to``, ``zero_``.

A mixin that :class:`~cudalab.DeviceArray` inherits. torch's names and rules, with one
deliberate difference: cudalab has no host tensor type, so ``cpu()`` and ``to("cpu")``
return a **numpy array** (a copy; torch returns a CPU tensor). Every host copy waits for
the array's device work queued so far, as torch's do.

* ``cpu()`` reads strided arrays too (DLPack / CUDA-array-interface imports): it copies
  the span of memory the array covers and lays the elements out in C order on the host.
* ``to("cuda:1")`` copies between devices with ``cuMemcpyPeerAsync`` on the destination's
  current stream, ordered after the source device's current stream and before its later
  work (the driver stages the copy through the host when the devices have no peer access).
* ``to(dtype)`` converts on the device with :meth:`DeviceArray.astype`, the elementwise
  machinery of the jiterator issue.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cudalab import _array_state
from cudalab._array_memory import host_transfer, stream_of
from cudalab._array_state import ArrayState, ArrayT
from cudalab._dtypes import normalize_dtype
from cudalab._internal import device_index
from cudalab.devices import Device

__all__ = ["TransfersMixin"]

_DEVICE_PREFIXES = ("cpu", "cuda")


def _host_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype Python scalars are built from (bfloat16 -> float32: exact, and plain floats)."""
    return np.dtype(np.float32) if dtype.name == "bfloat16" else dtype


class TransfersMixin:
    """Host copies and device moves of a DeviceArray."""

    __slots__ = ()

    def cpu(self: ArrayState) -> np.ndarray:
        """A numpy copy of the array (C-contiguous), waiting for the device work queued so far.

        torch's ``Tensor.cpu()`` returns a CPU tensor; cudalab has none, so this returns a
        numpy array (the same as :meth:`numpy` for a contiguous array). Strided arrays are
        read too.

        Returns
        -------
        numpy.ndarray
            A new array of the same shape and dtype.
        """
        if self.contiguous:
            return self.numpy()
        itemsize = self.itemsize
        lo = hi = 0
        for size, stride in zip(self.dims, self.strides):
            if size == 0:
                return np.empty(self.dims, self.element_dtype)
            step = (size - 1) * stride
            lo, hi = (lo + step, hi) if step < 0 else (lo, hi + step)
        span = np.empty(hi - lo + itemsize, np.uint8)
        stream = self.stream
        if stream.closed:  # the allocation stream was closed: use the current one
            stream = stream_of(self.device_index)
        host = span.__array_interface__["data"][0]
        host_transfer(self.device_index, host, self.ptr + lo, span.nbytes, stream, host,
                      False, "DeviceArray.cpu", span)
        view = np.ndarray(self.dims, self.element_dtype, buffer=span, offset=-lo, strides=self.strides)
        return np.ascontiguousarray(view)

    def tolist(self: ArrayState) -> Any:
        """The elements as (nested) Python lists of Python scalars, as torch's ``tolist``.

        A 0-d array gives a scalar. bfloat16 elements become floats. Waits for the copy.
        """
        host = self.cpu()
        return host.astype(_host_dtype(self.element_dtype), copy=False).tolist()

    def item(self: ArrayState) -> Any:
        """The value of a one-element array as a Python scalar (waits for the copy).

        Raises
        ------
        RuntimeError
            The array does not have exactly one element (torch's message).
        """
        if self.element_count != 1:
            raise RuntimeError(f"a Tensor with {self.element_count} elements cannot be converted to "
                               "Scalar")
        host = self.cpu().reshape(-1)
        return host.astype(_host_dtype(self.element_dtype), copy=False)[0].item()

    # Python scalars of a one-element array, as torch's (and numpy's, CuPy's): each reads
    # the element (a host sync), as item() does.
    def __float__(self: ArrayState) -> float:
        return float(self.item())

    def __int__(self: ArrayState) -> int:
        return int(self.item())

    def __complex__(self: ArrayState) -> complex:
        return complex(self.item())

    def __bool__(self: ArrayState) -> bool:
        if self.element_count != 1:
            amount = "more than one value" if self.element_count else "no values"
            raise RuntimeError(f"Boolean value of Tensor with {amount} is ambiguous")
        return bool(self.item())

    def __index__(self: ArrayState) -> int:
        if self.element_count != 1 or self.element_dtype.kind not in "iu":
            raise TypeError("only integer tensors of a single element can be converted to an "
                            "index")
        return int(self.item())

    def zero_(self: ArrayT) -> ArrayT:
        """Set every element to zero (a memset on the current stream). Returns self."""
        return self.fill_(0)

    def to(self: ArrayState, *args: Any, non_blocking: bool = False, copy: bool = False,
           **kwargs: Any) -> Any:
        """This array on another device and/or with another dtype, as torch's ``Tensor.to``.

        Forms: ``to(device)``, ``to(dtype)``, ``to(device, dtype)``, ``to(other)`` (another
        DeviceArray's device and dtype), and the keywords ``device=`` / ``dtype=``.

        Parameters
        ----------
        device
            ``"cuda:N"``, ``"cuda"``, an int, a :class:`cudalab.Device`, or ``"cpu"``.
        dtype
            A dtype (numpy's, its name, or ``"bfloat16"``); converted with :meth:`astype`.
        non_blocking
            Passed to the copy (see :meth:`copy_`); ignored for ``"cpu"``.
        copy
            Return a new array even when nothing changes.

        Returns
        -------
        DeviceArray or numpy.ndarray
            ``self`` when device and dtype already match (and not ``copy``); a numpy array
            for ``"cpu"`` (cudalab has no host tensor type: see :meth:`cpu`).

        Raises
        ------
        TypeError
            An argument is neither a device nor a dtype, or one is given twice.
        """
        device, dtype = _to_args(self, args, kwargs)
        if device == "cpu":
            host = self.cpu()
            return host if dtype is None else host.astype(normalize_dtype(dtype))
        out = self
        if dtype is not None:
            dt = normalize_dtype(dtype)
            if dt != self.element_dtype:
                out = self.astype(dt)
        if device is not None:
            dev = device_index(device)
            if dev != out.device_index:
                moved = _array_state.output(out.shape, out.dtype, dev, stream_of(dev))
                out = moved.copy_(out, non_blocking=non_blocking)
        if copy and out is self:
            out = _array_state.output(self.dims, self.element_dtype, self.device_index,
                                      stream_of(self.device_index)).copy_(self)
        return out


def _is_device(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower().startswith(_DEVICE_PREFIXES)
    return isinstance(value, Device) or (type(value) is int)


def _to_args(array: ArrayState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """(device, dtype) of a ``to(...)`` call; ``"cpu"`` for the host, None for unchanged."""
    unknown = set(kwargs) - {"device", "dtype"}
    if unknown:
        raise TypeError(f"to() got unexpected keyword arguments {sorted(unknown)}")
    device, dtype = kwargs.get("device"), kwargs.get("dtype")
    if len(args) > 2:
        raise TypeError(f"to() takes at most 2 positional arguments (device, dtype), got "
                        f"{len(args)}")
    positional_device = positional_dtype = None
    for i, value in enumerate(args):
        if value is None:
            continue
        if isinstance(value, type(array)):
            if len(args) > 1:
                raise TypeError("to(other): no other positional argument may follow the array")
            positional_device, positional_dtype = value.device_index, value.dtype
        elif i == 0 and _is_device(value):
            positional_device = value
        elif isinstance(value, (bool, np.bool_)) or (i == 1 and _is_device(value)):
            raise TypeError(f"to(): {value!r} is neither a device nor a dtype")
        else:
            positional_dtype = value
    if positional_device is not None:
        if device is not None:
            raise TypeError("to() got a device twice (positional and device=)")
        device = positional_device
    if positional_dtype is not None:
        if dtype is not None:
            raise TypeError("to() got a dtype twice (positional and dtype=)")
        dtype = positional_dtype
    if isinstance(device, str) and device.strip().lower() == "cpu":
        device = "cpu"
    return device, dtype
