"""The state the parts of :class:`cudalab.DeviceArray` share, typed, below all of them.

:class:`DeviceArray <cudalab.array.DeviceArray>` is one class assembled from mixins
(``_array_operators``, ``_array_transfers``, ``_array_reductions``, ``_array_views``). Each
mixin method declares ``self: ArrayState``: the type checker then checks every use of
``self`` there against :class:`ArrayState`, the fields and methods the parts share, and
checks :class:`~cudalab.array.DeviceArray` against it where a mixin method is called.

No part imports :mod:`cudalab.array` (no import cycle): a part that makes a new array calls
:data:`wrap` or :data:`output`, the array type's own constructors, which
:mod:`cudalab.array` hands to :func:`register` when it loads (before any array exists).
Calling ``_array_state.output(...)`` costs what ``type(self)._output(...)`` cost: one
attribute read and the call.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

if TYPE_CHECKING:
    from cudalab.devices import Device
    from cudalab.streams import Stream

__all__ = [
    "ArraySize",
    "ArrayState",
    "ArrayT",
    "NewArray",
    "WrapArray",
    "output",
    "register",
    "require_contiguous",
    "require_writable",
    "wrap",
]


class ArrayState(Protocol):
    """What the parts of a DeviceArray read and call on one another.

    The attributes are :class:`~cudalab.array.DeviceArray`'s fields (plain slots, public for
    speed: read them, never assign them; only the array's constructors do); ``shape``,
    ``dtype``, ``nbytes`` and ``base`` are their read-only user names (a property each:
    cudalab's code reads the fields).
    """

    ptr: int  # device address of the first element; 0 for an empty array
    dims: tuple[int, ...]  # the shape: the dimensions (ints >= 0)
    element_dtype: np.dtype  # the dtype: a supported one (cudalab._dtypes.SUPPORTED_DTYPES)
    strides_or_none: tuple[int, ...] | None  # bytes; None exactly when C-contiguous
    device_index: int  # the device holding the memory (a valid index)
    stream: Stream  # the stream the memory was allocated on (or imported with)
    owner: Any  # the base: what keeps the memory alive, None for an array owning it
    byte_count: int  # nbytes: element_count * element_dtype.itemsize
    element_count: int  # numpy's size: the product of dims
    contiguous: bool  # strides_or_none is None
    read_only: bool  # imported read-only (DLPack): never written

    # The user-facing names of dims, element_dtype, byte_count, owner (read-only)
    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def base(self) -> Any: ...

    @property
    def size(self) -> int: ...

    @property
    def strides(self) -> tuple[int, ...]: ...

    @property
    def ndim(self) -> int: ...

    @property
    def itemsize(self) -> int: ...

    @property
    def device(self) -> Device: ...

    def data_ptr(self) -> int: ...

    def is_contiguous(self) -> bool: ...

    def numpy(self, out: np.ndarray | None = None, non_blocking: bool = False) -> np.ndarray: ...

    def cpu(self) -> np.ndarray: ...

    def item(self) -> Any: ...

    def reshape(self: ArrayT, *shape: Any) -> ArrayT: ...

    def fill_(self: ArrayT, value: Any) -> ArrayT: ...

    def copy_(self: ArrayT, src: Any, non_blocking: bool = False) -> ArrayT: ...

    def astype(self: ArrayT, dtype: Any, copy: bool = True) -> ArrayT: ...

    def to(self, *args: Any, non_blocking: bool = False, copy: bool = False,
           **kwargs: Any) -> Any: ...


#: ``self``'s type in a mixin method that returns an array of its own kind: the method
#: ``def reshape(self: ArrayT, ...) -> ArrayT`` is checked against ArrayState and gives a
#: DeviceArray back to its callers.
ArrayT = TypeVar("ArrayT", bound=ArrayState)


# The constructors' results are typed Any on purpose: an array type, which a mixin method
# returns as its own ``ArrayT`` (a DeviceArray for its callers), not as a bare ArrayState.
class WrapArray(Protocol):
    """``wrap(ptr, shape, dtype, strides, device, stream, base, read_only=False)``: an array
    over memory kept alive by ``base`` (a view, or imported memory); ``strides`` None for
    C-contiguous, checked values throughout."""

    def __call__(self, ptr: int, shape: tuple[int, ...], dtype: np.dtype,
                 strides: tuple[int, ...] | None, device: int, stream: Stream, base: Any,
                 read_only: bool = False) -> Any: ...


class NewArray(Protocol):
    """``output(shape, dtype, device, stream)``: a new C-contiguous array allocated on
    ``stream`` (the device's current stream), none of the arguments checked again."""

    def __call__(self, shape: tuple[int, ...], dtype: np.dtype, device: int,
                 stream: Stream) -> Any: ...


#: The array type's view constructor (``DeviceArray._wrap``), set by :func:`register`.
wrap: WrapArray
#: The array type's allocating constructor (``DeviceArray._output``), set by :func:`register`.
output: NewArray


def register(wrap_function: WrapArray, output_function: NewArray) -> None:
    """Give the parts the array type's constructors (:mod:`cudalab.array`, once, at import)."""
    global wrap, output
    wrap = wrap_function
    output = output_function


def require_contiguous(array: ArrayState, what: str) -> None:
    """Raise ValueError (naming ``what``) unless ``array`` is C-contiguous."""
    if not array.contiguous:
        raise ValueError(f"{what} needs a C-contiguous DeviceArray; this one has shape "
                         f"{array.dims} and strides {array.strides}")


def require_writable(array: ArrayState, what: str) -> None:
    """Raise ValueError (naming ``what``) unless ``array`` may be written as a whole: not
    imported read-only, and C-contiguous."""
    if array.read_only:
        raise ValueError(f"{what}: this DeviceArray was imported read-only (DLPack "
                         "read-only flag) and cannot be written")
    require_contiguous(array, what)


class ArraySize(int):
    """``DeviceArray.size``: the number of elements (an int, numpy's ``size``), callable as
    torch's ``size()`` (the shape) and ``size(dim)`` (one dimension, negative from the end)."""

    shape: tuple[int, ...]  # the array's dimensions (what size() returns)

    def __new__(cls, count: int, shape: tuple[int, ...]) -> ArraySize:
        self = super().__new__(cls, count)
        self.shape = shape  # the array's dimensions (what size() returns)
        return self

    def __call__(self, dim: Any = None) -> Any:
        shape = self.shape
        if dim is None:
            return shape
        dim = operator.index(dim)
        n = len(shape)
        low, high = (-n, n - 1) if n else (-1, 0)
        if not low <= dim <= high:
            raise IndexError(f"Dimension out of range (expected to be in range of [{low}, "
                             f"{high}], but got {dim})")
        return shape[dim] if n else 1

    def __reduce__(self) -> Any:
        return (int, (int(self),))
