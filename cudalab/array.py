"""A small device array: memory from cudalab's caching allocator, with a shape and a dtype.

Not a tensor library: :class:`DeviceArray` holds memory and moves it (host <-> device <->
peer copies, fills, views), and speaks the interchange protocols (``__cuda_array_interface__``
v3 and DLPack) so CuPy, PyTorch, Numba and cuda.core can work on it without copying.

Memory and streams (torch's rules):

* An array's memory comes from :func:`cudalab.memory.caching_allocator_alloc` on the current
  stream of its device; that stream is remembered as :attr:`DeviceArray.stream`. The memory
  goes back to the allocator (stream-ordered: no host sync) when the last reference to the
  array, or to any view of it, disappears. Use :meth:`DeviceArray.record_stream` when other
  streams use the memory.
* ``fill_``, ``copy_`` and the creation functions queue work on the *current* stream of the
  array's device; :meth:`DeviceArray.numpy` copies on the array's own stream and waits for it.
* ``non_blocking=True`` is asynchronous only with page-locked host memory from
  :func:`cudalab.empty_pinned` / :func:`cudalab.pin_memory` (the pinned pool then keeps the
  host buffer from being reused until the copy is done); with ordinary (pageable) numpy
  memory the copy waits, as CUDA effectively does for pageable memory anyway.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from cudalab import _dlpack, _internal, _interrupts, _observe
from cudalab import devices as _devices
from cudalab import streams as _streams
from cudalab._array_matmul import MatmulMixin
from cudalab._array_memory import (
    allocator_of,
    check_host_operand,
    converts_on_device,
    device_copy,
    fill,
    foreign_waits_for,
    host_transfer,
    memory_api,
    null_context,
    release_device_memory,
    scalar_bytes,
    stream_of,
    wait_for_pinned_source,
    waits_for_foreign,
)
from cudalab._array_operators import OperatorsMixin, converting_copy, where
from cudalab._array_reductions import ReductionsMixin
from cudalab._array_state import ArraySize, register, require_contiguous, require_writable
from cudalab._array_transfers import TransfersMixin
from cudalab._array_views import ViewsMixin
from cudalab._dtypes import (
    SUPPORTED_DTYPES,
    default_dtype_of,
    normalize_dtype,
    normalize_shape,
    size_args,
)
from cudalab._kernels.elementwise import check_overlap
from cudalab._kernels.kernel import register_pointer_type

__all__ = [
    "DeviceArray", "empty",
    "zeros",
    "ones",
    "full",
    "empty_like",
    "zeros_like",
    "asarray",
    "from_dlpack",
    "where",
    "SUPPORTED_DTYPES",
]


# DLPack "stream" values with a fixed meaning (CUDA): legacy and per-thread default streams.
_LEGACY_STREAM = 1
_CUDA_DEVICE_TYPES = (_dlpack.kDLCUDA, _dlpack.kDLCUDAManaged)


# Cached: DeviceArray.strides of a contiguous array is read on every view and copy (the
# 1 KiB scatter and gather rows of benchmarks/comm.py); the LRU bounds the memory.
@functools.lru_cache(maxsize=1024)
def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides = []
    acc = itemsize
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


def _is_c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    if 0 in shape:
        return True
    acc = itemsize
    for d, s in zip(reversed(shape), reversed(strides)):
        if d != 1 and s != acc:
            return False
        acc *= d
    return True


# --------------------------------------------------------------------------- the array
class DeviceArray(OperatorsMixin, MatmulMixin, TransfersMixin, ReductionsMixin, ViewsMixin):
    """An n-dimensional array in device memory (C-contiguous unless imported otherwise).

    Operators, transfers (``cpu``, ``to``...), reductions (``sum``...) and views
    (``view``, ``reshape``, ``[]``, ``narrow``) come from the mixins in ``_array_operators``,
    ``_array_transfers``, ``_array_reductions`` and ``_array_views``, each typed against
    :class:`cudalab._array_state.ArrayState` (the fields below).

    ``DeviceArray(shape, dtype=float32, device=None)`` is :func:`cudalab.empty`. The names
    torch and numpy users know are read-only, as torch's: ``shape``, ``dtype``, ``size``
    (numpy's int, also callable as torch's ``size()`` / ``size(dim)``), ``nbytes``, ``base``,
    ``strides`` (bytes), ``device`` (a :class:`cudalab.Device`, ``cuda:N``), ``ndim`` and
    ``itemsize``; assigning one raises AttributeError. The other attributes are plain
    fields, read directly on the hot paths (kernel launches, collectives, the elementwise
    machinery, the random samplers): **read them, never assign them** (only the
    constructors do). ``dims``, ``element_dtype``, ``element_count``, ``byte_count`` and
    ``owner`` are the fields behind ``shape``, ``dtype``, ``size``, ``nbytes`` and ``base``
    (one slot read, for cudalab's hot paths).

    Attributes
    ----------
    ptr : int
        Device address of the first element (0 for an empty array), :meth:`data_ptr`.
    dims : tuple of int
        The shape (``shape`` reads it).
    element_dtype : numpy.dtype
        The dtype (``dtype`` reads it).
    strides_or_none : tuple of int or None
        The strides in bytes when the layout is not C-contiguous, else None (``strides``
        computes them).
    device_index : int
        The index of the device holding the memory.
    stream : Stream
        The stream the memory was allocated on (and :meth:`numpy` copies on).
    owner : object or None
        What keeps a view's (or an imported array's) memory alive; None for an array
        owning its memory (``base`` reads it).
    byte_count, element_count : int
        The number of bytes and of elements (``nbytes`` and ``size`` read them).
    contiguous : bool
        C-contiguous (:meth:`is_contiguous`).
    read_only : bool
        Imported read-only (DLPack's flag): writes are refused.
    """

    __slots__ = ("ptr", "dims", "element_dtype", "strides_or_none", "device_index", "stream",
                 "owner", "byte_count", "element_count", "contiguous", "read_only", "_owns",
                 "_alloc", "_size_view", "__weakref__")

    # The fields (assigned only by the constructors). The names torch and numpy users know
    # (shape, dtype, size, nbytes, base) are read-only properties over them, below: a
    # user's ``a.shape = (3, 2)`` raises AttributeError, as torch's does.
    ptr: int  # device address of the first element; 0 when byte_count is 0
    dims: tuple[int, ...]  # the shape: ints >= 0
    element_dtype: np.dtype  # the dtype: one of SUPPORTED_DTYPES
    strides_or_none: tuple[int, ...] | None  # None exactly when C-contiguous
    device_index: int  # a valid device index
    stream: _streams.Stream  # where the memory was allocated (or imported), never None
    owner: Any  # the base: None exactly for an array owning its memory (then _owns until freed)
    byte_count: int  # nbytes: element_count * element_dtype.itemsize
    element_count: int  # numpy's size: math.prod(dims)
    contiguous: bool  # strides_or_none is None
    read_only: bool  # DLPack's read-only flag; False for arrays cudalab allocated
    _owns: bool  # the block at ptr is ours to free (then _alloc is its allocator)
    _alloc: Any  # the allocator the block came from (set while _owns)
    _size_view: ArraySize  # ``size``, made on its first read (unset until then)

    def __init__(self, shape: Any, dtype: Any = np.float32, device: Any = None):
        self._owns = False
        shape = normalize_shape(shape)
        dt = normalize_dtype(dtype)
        if device is None:
            dev = _devices.current_device()
            stream = _streams.current_stream()
        else:
            # Direct module read, not _internal.device_index(): every new array passes here
            # (benchmarks/rng.py, rand(1000) host cost).
            dev = _devices.device_index(device)
            stream = _streams.current_stream(dev)
        self._init_owned(shape, dt, dev, stream)

    def _init_owned(self, shape: tuple[int, ...], dtype: np.dtype, device: int,
                    stream: Any) -> None:
        """Allocate a new C-contiguous array (the checked arguments of ``__init__``)."""
        size = math.prod(shape)
        nbytes = size * dtype.itemsize
        if nbytes:
            a = self._alloc = allocator_of(device)
            self.ptr = a.malloc(nbytes, stream)
            self._owns = True
            if _observe.access_on:  # the stream sanitizer (one flag read while it is off)
                _observe.access_tracker.allocated(self.ptr, nbytes, stream)
        else:
            self.ptr = 0
        self.dims = shape
        self.element_dtype = dtype
        self.strides_or_none = None  # C-contiguous: computed on demand
        self.device_index = device
        self.stream = stream
        self.owner = None
        self.byte_count = nbytes
        self.element_count = size
        self.contiguous = True
        self.read_only = False

    @classmethod
    def _output(cls, shape: tuple[int, ...], dtype: np.dtype, device: int,
                stream: Any) -> DeviceArray:
        """A new array for a kernel's result, allocated on ``stream`` (the elementwise
        machinery's ``empty``): ``shape`` a tuple of ints, ``dtype`` a supported numpy dtype,
        ``device`` a valid index and ``stream`` its current stream, none of them checked
        again (the "host/call" rows of benchmarks/jiterator.py)."""
        self = object.__new__(cls)
        self._owns = False
        self._init_owned(shape, dtype, device, stream)
        return self

    def __del__(self) -> None:
        # The last reference to an owning array (views hold it in ``_base``) is gone: hand
        # the block back to the allocator, stream-ordered. Never raises.
        try:
            if self._owns:
                self._owns = False
                if _streams.exiting:  # the process is ending: the driver reclaims everything
                    return
                if _observe.access_on:  # the stream sanitizer: the free request
                    _observe.access_tracker.freed(self.ptr, self.stream)
                try:
                    self._alloc.free(self.ptr)
                except ValueError:  # not this allocator's any more (a reset): the registry's
                    release_device_memory(self.ptr)
        except Exception:
            pass

    # ------------------------------------------------------------------ construction
    @classmethod
    def _wrap(cls, ptr: int, shape: tuple[int, ...], dtype: np.dtype,
              strides: tuple[int, ...] | None, device: int, stream: _streams.Stream, base: Any,
              read_only: bool = False) -> DeviceArray:
        """An array over memory kept alive by ``base`` (a view, or imported memory)."""
        self = object.__new__(cls)
        self._owns = False
        itemsize = dtype.itemsize
        size = math.prod(shape)
        if strides is not None and _is_c_contiguous(shape, strides, itemsize):
            strides = None
        self.ptr = ptr
        self.dims = shape
        self.element_dtype = dtype
        self.strides_or_none = strides
        self.device_index = device
        self.stream = stream
        self.owner = base
        self.byte_count = size * itemsize
        self.element_count = size
        self.contiguous = strides is None
        self.read_only = read_only
        return self

    # ------------------------------------------------------------------ attributes
    # The user names of the fields: read-only, one C-level getter each (attrgetter, no
    # Python frame). cudalab's own code reads the fields.
    if TYPE_CHECKING:
        @property
        def shape(self) -> tuple[int, ...]: ...

        @property
        def dtype(self) -> np.dtype: ...

        @property
        def nbytes(self) -> int: ...

        @property
        def base(self) -> Any: ...
    else:
        shape = property(operator.attrgetter("dims"), doc="The dimensions (read-only).")
        dtype = property(operator.attrgetter("element_dtype"),
                         doc="The numpy dtype of the elements (read-only).")
        nbytes = property(operator.attrgetter("byte_count"),
                          doc="The number of bytes of the elements (read-only).")
        base = property(operator.attrgetter("owner"),
                        doc="What keeps a view's memory alive; None for an array owning its "
                            "memory (read-only).")

    @property
    def size(self) -> ArraySize:
        """The number of elements, an int (numpy's ``size``) that torch's ``size()`` and
        ``size(dim)`` can also call (read-only)."""
        try:
            return self._size_view
        except AttributeError:
            view = self._size_view = ArraySize(self.element_count, self.dims)
            return view

    def numel(self) -> int:
        """The number of elements (torch's ``numel()``)."""
        return self.element_count

    @property
    def strides(self) -> tuple[int, ...]:
        """Strides in bytes (numpy's convention)."""
        s = self.strides_or_none
        return _c_strides(self.dims, self.element_dtype.itemsize) if s is None else s

    @property
    def device(self) -> _devices.Device:
        """The device holding the memory, as torch's ``Tensor.device``.

        A :class:`cudalab.Device` that prints as ``cuda:0`` and compares equal to
        ``cudalab.Device("cuda:0")`` (and to the string ``"cuda:0"``), not to the int 0:
        the index is ``device.index`` or :attr:`device_index`.
        """
        return _devices.device_object(self.device_index)

    @property
    def ndim(self) -> int:
        return len(self.dims)

    @property
    def itemsize(self) -> int:
        return self.element_dtype.itemsize

    def data_ptr(self) -> int:
        """Device address of the first element (torch's name)."""
        return self.ptr

    def is_contiguous(self) -> bool:
        """True when the elements are laid out in C order without gaps."""
        return self.contiguous

    def __len__(self) -> int:
        if not self.dims:
            raise TypeError("len() of a 0-d DeviceArray")
        return self.dims[0]

    def __repr__(self) -> str:
        sim = " (simulated)" if _internal.backend().simulated else ""
        return (f"DeviceArray(shape={self.dims}, dtype={self.element_dtype}, "
                f"device='cuda:{self.device_index}{sim}')")

    def __array__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError("implicit conversion of a DeviceArray to a numpy array is not allowed: "
                        "call .numpy() to copy it to the host")

    # ------------------------------------------------------------------ checks
    def _allocation_ptr(self) -> int:
        """Address of the allocator block behind this array (0: not cudalab's memory)."""
        root = self if self.owner is None else self.owner
        if type(root) is DeviceArray and root.owner is None:
            return root.ptr
        return 0

    # ------------------------------------------------------------------ host copies
    def numpy(self, out: np.ndarray | None = None, non_blocking: bool = False) -> np.ndarray:
        """Copy to the host on the array's stream and wait for it; returns a numpy array.

        ``out``: an existing C-contiguous numpy array of the same shape and dtype to copy
        into. With ``non_blocking=True`` and ``out`` from :func:`cudalab.empty_pinned` the copy
        is only queued: synchronise the array's stream (or an event) before reading ``out``.
        """
        require_contiguous(self, "DeviceArray.numpy()")
        if out is None:
            out = np.empty(self.dims, self.element_dtype)
            non_blocking = False
        else:
            check_host_operand(out, self, "DeviceArray.numpy(out=...)", writable=True)
        n = self.byte_count
        if n == 0:
            return out
        stream = self.stream
        if stream.closed:  # the allocation stream was closed: use the current one
            stream = stream_of(self.device_index)
        host = out.__array_interface__["data"][0]
        host_transfer(self.device_index, host, self.ptr, n, stream, host, non_blocking,
                       "DeviceArray.numpy", out)
        return out

    def copy_(self, src: Any, non_blocking: bool = False) -> DeviceArray:
        """Copy ``src`` (numpy array, DeviceArray on any device, or a CUDA array of another
        library) into this array, broadcasting it to this shape and converting it to this
        dtype as torch does (a converting copy runs an elementwise kernel). Returns self.

        Runs on the current stream of this array's device; a source on another device is
        copied as torch copies it, on the source device's current stream, after the work
        queued so far on this array's device's current stream, which then waits for the copy.
        Host sources: waits unless ``non_blocking`` with pinned memory (the module notes; a
        conversion numpy does on the host waits too). Device sources never block the host."""
        require_writable(self, "DeviceArray.copy_()")
        if isinstance(src, DeviceArray):
            return self._copy_from_device(src)
        if not isinstance(src, np.ndarray):
            foreign = foreign_cuda_array(src)
            if foreign is not None:
                return self._copy_from_device(foreign)
            src = np.asarray(src)
        if src.dtype != self.element_dtype or src.shape != self.dims:
            if self.byte_count and converts_on_device(src, self.dims, self.element_dtype):
                # Convert on the device, in stream order (reads a pinned buffer when queued copies did)
                raw = DeviceArray._output(src.shape, src.dtype, self.device_index,
                                          stream_of(self.device_index))
                raw.copy_(src, non_blocking)
                return converting_copy(self, raw)  # casts and broadcasts (torch's copy_)
            wait_for_pinned_source(src, self.device_index)  # converted on the host
            src = np.ascontiguousarray(np.broadcast_to(src.astype(self.element_dtype), self.dims))
        check_host_operand(src, self, "DeviceArray.copy_()", writable=False)
        n = self.byte_count
        if n == 0:
            return self
        host = src.__array_interface__["data"][0]
        host_transfer(self.device_index, self.ptr, host, n, stream_of(self.device_index), host,
                       non_blocking, "DeviceArray.copy_ (host to device)", src)
        return self

    def _copy_from_device(self, src: DeviceArray) -> DeviceArray:
        if (src.ptr == self.ptr and src.device_index == self.device_index and src.dtype == self.element_dtype
                and src.shape == self.dims and src.strides_or_none == self.strides_or_none):
            # the same memory (a[k] += 1 assigns the view to itself), as torch. (_strides is
            # None exactly for C-contiguous layouts, so equal layouts compare equal.)
            return self
        if src.dims != self.dims or src.element_dtype != self.element_dtype or not src.contiguous:
            if src.device_index != self.device_index:  # to this device first, then convert there
                src = src.to(self.device_index) if src.contiguous else src.astype(src.dtype).to(
                    self.device_index)
            return converting_copy(self, src)  # casts and broadcasts (torch's copy_)
        n = self.byte_count
        if n:
            if src.device_index == self.device_index:
                check_overlap(self, (src,))  # (b[1:].copy_(b[:-1]): torch's error)
            device_copy(self.device_index, self.ptr, src.device_index, src.ptr, n)
        return self

    # ------------------------------------------------------------------ device work
    def fill_(self, value: Any) -> DeviceArray:
        """Set every element to ``value`` (converted to the dtype as numpy does). Returns self.

        Eagerly a memset where the pattern allows (D8, D16, D32), else cudalab's fill
        kernels; while a CUDAGraph is being captured, always the fill kernels (a kernel node
        replays far cheaper than a memset node, as torch's fills are kernels); see
        ``_array_memory.fill``. Runs on the current stream.
        """
        # (The checks as two flag reads, the current stream read directly: the "capture,
        # host time per launch (fill_)" row of benchmarks/graphs.py.)
        if self.read_only or not self.contiguous:
            require_writable(self, "DeviceArray.fill_()")
        if isinstance(value, DeviceArray):  # torch takes a 0-d tensor (read here: a host sync)
            if value.ndim:
                raise ValueError(f"fill_ only supports 0-dimension value tensor but got tensor "
                                 f"with {value.ndim} dimensions.")
            value = value.item()
        pattern = scalar_bytes(value, self.element_dtype)
        if self.byte_count:
            fill(self.ptr, pattern, self.element_count, self.device_index,
                 _streams.current_stream(self.device_index))
        return self

    def record_stream(self, stream: Any) -> None:
        """Mark the memory as used by ``stream``: the allocator will not hand it out again
        until the work queued on ``stream`` so far has completed (torch's record_stream).

        A no-op for memory cudalab did not allocate (arrays imported with from_dlpack)."""
        if not isinstance(stream, _streams.Stream):
            raise TypeError(f"record_stream expects a cudalab.Stream, got {stream!r}")
        ptr = self._allocation_ptr()
        if ptr:
            memory_api().record_stream(ptr, stream)

    def __setitem__(self, key: Any, value: Any) -> None:
        """``a[key] = scalar`` fills, ``a[key] = array`` copies (same shape and dtype)."""
        target = self[key]
        if isinstance(value, (int, float, complex, bool, np.generic)):
            target.fill_(value)
            return
        if not isinstance(value, (DeviceArray, np.ndarray)):
            foreign = foreign_cuda_array(value)  # (not ``or``: a DeviceArray has torch's bool())
            value = foreign if foreign is not None else np.asarray(value, dtype=target.dtype)
        if isinstance(value, np.ndarray):
            wait_for_pinned_source(value, target.device_index)  # (numpy converts it at once)
            value = np.ascontiguousarray(
                np.broadcast_to(value.astype(target.dtype, copy=False), target.shape))
        target.copy_(value)

    # ------------------------------------------------------------------ interchange
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """CUDA Array Interface v3; ``stream`` is the current stream of the array's device
        (the consumer waits for it; 1 stands for the legacy default stream)."""
        if self.element_dtype.name == "bfloat16":
            raise AttributeError("a bfloat16 DeviceArray has no __cuda_array_interface__ "
                                 "(the interface has no typestr for it): use DLPack")
        s = stream_of(self.device_index).cuda_stream
        return {
            "shape": self.dims,
            "typestr": self.element_dtype.str,
            "data": (self.ptr, self.read_only),
            "version": 3,
            "strides": self.strides_or_none,
            "stream": s if s else _LEGACY_STREAM,
        }

    def __dlpack_device__(self) -> tuple[int, int]:
        return (_dlpack.kDLCUDA, self.device_index)

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                   copy: Any = None) -> Any:
        """Export as a DLPack capsule (versioned when ``max_version >= (1, 0)``).

        ``stream``: the consumer's stream (an int: 1 legacy default, 2 per-thread default,
        else a stream handle; -1 for no synchronisation; None means the legacy default). The
        consumer's stream is made to wait for this device's current stream.
        """
        if dl_device is not None:
            dl_device = tuple(dl_device)
            if dl_device != (_dlpack.kDLCUDA, self.device_index):
                raise BufferError(f"__dlpack__: cannot export to device {dl_device}; the array "
                                  f"is on (kDLCUDA={_dlpack.kDLCUDA}, {self.device_index})")
        if stream is not None and (isinstance(stream, bool) or not isinstance(stream, int)):
            raise TypeError(f"__dlpack__: stream must be an int or None, got {stream!r}")
        if stream == 0:
            raise ValueError("__dlpack__: stream=0 is ambiguous and not allowed for CUDA by "
                             "the DLPack protocol; use 1 for the legacy default stream")
        src = self
        if copy:
            src = empty(self.dims, dtype=self.element_dtype, device=self.device_index)
            src.copy_(self)
        if stream != -1:
            foreign_waits_for(_LEGACY_STREAM if stream is None else stream,
                               stream_of(self.device_index))
        versioned = max_version is not None and tuple(max_version)[0] >= 1
        if src.read_only and not versioned:
            raise BufferError("__dlpack__: a read-only array can only be exported to a "
                              "consumer that understands DLPack >= 1.0 (max_version)")
        return _dlpack.export_capsule(src, src.ptr, src.shape, src.strides, src.dtype,
                                      _dlpack.kDLCUDA, src.device_index, versioned, src.read_only)


def _is_capsule(obj: Any) -> bool:
    return _dlpack.is_capsule(obj)


def foreign_cuda_array(obj: Any) -> DeviceArray | None:
    """A zero-copy DeviceArray over another library's CUDA array, or None if ``obj`` is not
    one (DLPack with a CUDA device, or ``__cuda_array_interface__``)."""
    dev_fn = getattr(obj, "__dlpack_device__", None)
    if dev_fn is not None and hasattr(obj, "__dlpack__"):
        try:
            dev_type = int(dev_fn()[0])
        except Exception:
            dev_type = None
        if dev_type in _CUDA_DEVICE_TYPES:
            return from_dlpack(obj)
        if dev_type is not None:
            return None
    if hasattr(obj, "__cuda_array_interface__"):
        return _from_cuda_array_interface(obj)
    return None


def _from_cuda_array_interface(obj: Any) -> DeviceArray:
    cai = obj.__cuda_array_interface__
    try:
        shape = tuple(int(d) for d in cai["shape"])
        typestr = cai["typestr"]
        ptr, read_only = cai["data"]
    except (KeyError, TypeError, ValueError) as exc:
        raise TypeError(f"invalid __cuda_array_interface__ on {type(obj).__name__}: {exc}") from None
    if cai.get("mask") is not None:
        raise TypeError("__cuda_array_interface__ with a mask is not supported")
    dtype = normalize_dtype(np.dtype(typestr))
    strides = cai.get("strides")
    strides = None if strides is None else tuple(int(s) for s in strides)
    ptr = int(ptr or 0)
    device = None
    if ptr:
        device = _internal.backend().pointer_device(ptr)
    if device is None:
        device = _devices.current_device()
    ours = stream_of(device)
    foreign = cai.get("stream") if cai.get("version", 0) >= 3 else None
    if foreign is not None:
        if foreign == 0:
            raise ValueError("__cuda_array_interface__: stream 0 is not allowed (v3); "
                             "1 means the legacy default stream")
        waits_for_foreign(ours, int(foreign))
    return DeviceArray._wrap(ptr, shape, dtype, strides, device, ours, obj, bool(read_only))


# Ctrl-C is deferred while an array takes its memory and while its finalizer gives it back
# (cudalab._interrupts): raised in a finalizer, it would be printed as "Exception ignored" and
# lost; raised between malloc and ``_owns = True`` (in _init_owned, which __init__ and
# _output call), the block would never be freed.
_interrupts.guard(DeviceArray.__init__, DeviceArray._init_owned, DeviceArray.__del__)

# The parts of DeviceArray below this module (its mixins) make new arrays with these
# (cudalab._array_state: they never import this module).
register(DeviceArray._wrap, DeviceArray._output)

# Names for cudalab's own modules (not in __all__): foreign_cuda_array (above),
# require_writable (from _array_state) and output_array.
#: ``output_array(shape, dtype, device, stream)``: a new C-contiguous array for a result,
#: allocated on ``stream`` (the device's current stream), the arguments not checked again
#: (``DeviceArray._output``): the elementwise machinery's ``empty``, comm's results.
output_array = DeviceArray._output


# --------------------------------------------------------------------------- creation
# Kernel.launch reads a DeviceArray argument's address directly (its ptr, the first byte of
# the array or view), instead of through __cuda_array_interface__.
register_pointer_type(DeviceArray, operator.attrgetter("ptr"))


def empty(size: Any, *sizes: Any, dtype: Any = None, device: Any = None) -> DeviceArray:
    """Uninitialised array (memory from the caching allocator, current stream).

    Parameters
    ----------
    size, *sizes
        The shape, as torch takes it: ints (``empty(2, 3)``), or one int, tuple or list
        (``empty((2, 3))``, ``empty(5)``). numpy's ``empty(shape, dtype)`` works too.
    dtype
        The element type (a numpy dtype or its name, or ``"bfloat16"``); default float32.
    device
        None (the current device), an int, ``"cuda"``, ``"cuda:N"`` or a Device.

    Returns
    -------
    DeviceArray

    Raises
    ------
    TypeError
        The arguments are neither sizes nor one shape and a dtype (``empty((2, 3), 4)``), or
        the dtype is not supported.
    """
    if not sizes:
        return DeviceArray(size, dtype, device)
    shape, dtype = size_args("empty", (size, *sizes), dtype)
    return DeviceArray(shape, dtype, device)


def zeros(size: Any, *sizes: Any, dtype: Any = None, device: Any = None) -> DeviceArray:
    """Array of zeros (a stream-ordered memset on the current stream).

    Takes the same arguments as :func:`empty`: ``zeros(2, 3)``, ``zeros((2, 3))``,
    ``zeros([2, 3])``, ``zeros(5)``, with ``dtype=`` (default float32) and ``device=``.
    """
    if sizes:
        size, dtype = size_args("zeros", (size, *sizes), dtype)
    a = DeviceArray(size, dtype, device)
    if a.nbytes:
        stream = stream_of(a.device_index)
        if _observe.access_on:  # the stream sanitizer (one flag read while it is off)
            _observe.access_tracker.access(stream, (), ((a.ptr, a.nbytes),), "fill (zeros)")
        null_context(stream)
        stream.backend.memset_d8_async(a.device_index, a.ptr, 0, a.nbytes, stream.handle)
    return a


def ones(size: Any, *sizes: Any, dtype: Any = None, device: Any = None) -> DeviceArray:
    """Array of ones.

    Takes the same arguments as :func:`empty`: ``ones(2, 3)``, ``ones((2, 3))``,
    ``ones([2, 3])``, ``ones(5)``, with ``dtype=`` (default float32) and ``device=``.
    """
    if sizes:
        size, dtype = size_args("ones", (size, *sizes), dtype)
    return DeviceArray(size, dtype, device).fill_(1)


def full(size: Any, fill_value: Any, dtype: Any = None, device: Any = None) -> DeviceArray:
    """Array of ``size`` filled with ``fill_value``, as torch's ``full(size, fill_value)``.

    Parameters
    ----------
    size
        A tuple or list of ints (``full((2, 3), v)``), or one int (``full(5, v)``).
    fill_value
        A Python or numpy scalar.
    dtype, device
        As for :func:`empty`; the dtype defaults to torch's for the value: float32 (torch's
        default dtype) for a float, complex64 for a complex, int64 for an int, bool for a
        bool; a numpy scalar that is not a Python number (``np.float16(1)``) keeps its dtype.

    Raises
    ------
    TypeError
        ``fill_value`` is not a scalar, or the sizes were spread over the arguments
        (``full(2, 3, 7)``: pass ``full((2, 3), 7)``).
    ValueError
        ``fill_value`` cannot be stored in ``dtype``.
    """
    if type(dtype) is int and type(fill_value) is int and type(size) is int:
        raise TypeError(f"full() takes the size as one tuple, then the value: "
                        f"full(({size}, {fill_value}), {dtype}), not full({size}, {fill_value}, "
                        f"{dtype})")
    if not isinstance(fill_value, (int, float, complex, np.generic)) or isinstance(
            fill_value, np.ndarray):
        raise TypeError(f"full: fill_value must be a scalar (a Python or numpy number or "
                        f"bool), got {type(fill_value).__name__}")
    if dtype is None:
        dtype = default_dtype_of(fill_value)
    return DeviceArray(size, dtype, device).fill_(fill_value)


def _like(a: Any, dtype: Any, device: Any) -> tuple[tuple[int, ...], Any, Any]:
    if isinstance(a, DeviceArray):
        return a.shape, a.dtype if dtype is None else dtype, a.device_index if device is None else device
    shape = getattr(a, "shape", None)
    a_dtype = getattr(a, "dtype", None)
    if shape is None or a_dtype is None:
        a = np.asarray(a)
        shape, a_dtype = a.shape, a.dtype
    return tuple(shape), a_dtype if dtype is None else dtype, device


def empty_like(a: Any, dtype: Any = None, device: Any = None) -> DeviceArray:
    """Uninitialised array with ``a``'s shape and dtype (and device, for a DeviceArray)."""
    shape, dt, dev = _like(a, dtype, device)
    return empty(shape, dtype=dt, device=dev)


def zeros_like(a: Any, dtype: Any = None, device: Any = None) -> DeviceArray:
    """Zeros with ``a``'s shape and dtype (and device, for a DeviceArray)."""
    shape, dt, dev = _like(a, dtype, device)
    return zeros(shape, dtype=dt, device=dev)


def asarray(obj: Any, device: Any = None, dtype: Any = None) -> DeviceArray:
    """``obj`` as a DeviceArray.

    A DeviceArray already on ``device`` with ``dtype`` is returned as is, one on another
    device is copied there. CUDA arrays of other libraries (DLPack or
    ``__cuda_array_interface__``) are wrapped without copying. Anything else goes through
    ``numpy.asarray(obj, dtype)`` and is copied to the device (waiting for the copy).
    """
    if not isinstance(obj, (DeviceArray, np.ndarray)):
        foreign = foreign_cuda_array(obj)
        if foreign is not None:
            obj = foreign
    if isinstance(obj, DeviceArray):
        if dtype is not None and normalize_dtype(dtype) != obj.dtype:
            obj = obj.astype(dtype)  # a converting copy on the device
        return obj if device is None else obj.to(device)
    dt = None if dtype is None else normalize_dtype(dtype)
    host = np.asarray(obj, dtype=dt)
    if dt is None:
        normalize_dtype(host.dtype)  # reject object, string, datetime... with a clear error
    if not host.flags.c_contiguous:  # (np.ascontiguousarray would make a 0-d array 1-d)
        host = np.ascontiguousarray(host)
    out = empty(host.shape, dtype=host.dtype, device=device)
    out.copy_(host)
    return out


def from_dlpack(obj: Any) -> DeviceArray:
    """Wrap a CUDA tensor from another library (CuPy, torch, JAX, cudalab...) without copying.

    ``obj`` implements ``__dlpack__``/``__dlpack_device__`` (or is a DLPack capsule). The
    producer is asked to make cudalab's current stream (of the tensor's device) wait for its
    work; the result keeps the producer's memory alive. Non-CUDA tensors raise BufferError.
    """
    if _is_capsule(obj):
        t = _dlpack.import_capsule(obj, _CUDA_DEVICE_TYPES)
        device = _internal.device_index(t.device_id)
        return DeviceArray._wrap(t.data, t.shape, normalize_dtype(t.dtype), t.strides, device,
                                 stream_of(device), t, t.read_only)
    if not hasattr(obj, "__dlpack__"):
        raise TypeError(f"from_dlpack: {type(obj).__name__} does not implement the DLPack "
                        "protocol (__dlpack__ / __dlpack_device__)")
    dev_type, dev_id = (int(x) for x in obj.__dlpack_device__())
    if dev_type not in _CUDA_DEVICE_TYPES:
        name = _dlpack.DEVICE_TYPE_NAMES.get(dev_type, f"device type {dev_type}")
        raise BufferError(
            f"from_dlpack: {type(obj).__name__} lives on {name} (DLPack device type "
            f"{dev_type}), not on a CUDA device; cudalab.from_dlpack imports only CUDA memory "
            "(use cudalab.asarray() to copy host data to the GPU)")
    device = _internal.device_index(dev_id)
    ours = stream_of(device)
    s = ours.cuda_stream or _LEGACY_STREAM
    # The tensor's device is current during the exchange: producers such as torch refuse a
    # stream of another device than the current one.
    with _devices.device(device):
        try:
            capsule = obj.__dlpack__(stream=s, max_version=_dlpack.DLPACK_VERSION)
        except TypeError:  # a producer older than DLPack 1.0 (no max_version keyword)
            capsule = obj.__dlpack__(stream=s)
    t = _dlpack.import_capsule(capsule, _CUDA_DEVICE_TYPES, producer=obj)
    if t.device_id != dev_id:
        raise BufferError(f"from_dlpack: __dlpack_device__ said device {dev_id} but the "
                          f"capsule is on device {t.device_id}")
    return DeviceArray._wrap(t.data, t.shape, normalize_dtype(t.dtype), t.strides, device,
                             ours, t, t.read_only)
