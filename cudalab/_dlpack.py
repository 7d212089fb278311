"""DLPack capsules through ctypes: export (``__dlpack__``) and import (``from_dlpack``).

No compiled code: the DLPack C structs are declared with :mod:`ctypes` (and read and written
as flat :mod:`struct` layouts, which is several times faster than field access), and
capsules are made and read with the CPython capsule API from ``ctypes.pythonapi``.

Export. :func:`export_capsule` builds a ``DLManagedTensor`` (capsule name ``"dltensor"``) or,
when the consumer asked for DLPack >= 1.0, a ``DLManagedTensorVersioned``
(``"dltensor_versioned"``). The struct, its shape/strides arrays and a reference to the
exporting object live in :data:`_exports` until the consumer calls the struct's ``deleter``
(exactly once, as the protocol requires); a capsule nobody consumed calls it from its
destructor instead. So the exported memory stays valid for as long as the consumer uses it.

Import. :func:`import_capsule` reads either struct, checks the device and dtype *before*
taking ownership (a rejected capsule stays unconsumed, and its own destructor frees it),
then renames it ``"used_dltensor[_versioned]"`` and returns an :class:`ImportedTensor` that
calls the producer's deleter once, when it is garbage collected.

Versions: the structs follow DLPack 1.x; exports announce version 1.0.
"""

from __future__ import annotations

import ctypes
import struct
import sys
from typing import Any

import numpy as np

__all__ = [
    "kDLCPU",
    "kDLCUDA",
    "kDLCUDAHost",
    "kDLCUDAManaged",
    "DEVICE_TYPE_NAMES",
    "DLPACK_VERSION",
    "ImportedTensor",
    "export_capsule",
    "import_capsule",
    "dtype_to_dl",
    "dl_to_dtype",
    "live_exports",
]

# --------------------------------------------------------------------------- constants
kDLCPU = 1
kDLCUDA = 2
kDLCUDAHost = 3
kDLCUDAManaged = 13

DEVICE_TYPE_NAMES = {
    1: "kDLCPU", 2: "kDLCUDA", 3: "kDLCUDAHost", 4: "kDLOpenCL", 7: "kDLVulkan", 8: "kDLMetal",
    9: "kDLVPI", 10: "kDLROCM", 11: "kDLROCMHost", 12: "kDLExtDev", 13: "kDLCUDAManaged",
    14: "kDLOneAPI", 15: "kDLWebGPU", 16: "kDLHexagon", 17: "kDLMAIA",
}

# DLDataTypeCode
_kDLInt, _kDLUInt, _kDLFloat, _kDLBfloat, _kDLComplex, _kDLBool = 0, 1, 2, 4, 5, 6

#: (major, minor) written into versioned exports.
DLPACK_VERSION = (1, 0)
_FLAG_READ_ONLY = 1 << 0

_NAME = b"dltensor"
_USED_NAME = b"used_dltensor"
_NAME_V = b"dltensor_versioned"
_USED_NAME_V = b"used_dltensor_versioned"


# --------------------------------------------------------------------------- the C structs
class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),  # void (*)(DLManagedTensor*)
    ]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),  # void (*)(DLManagedTensorVersioned*)
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


_DELETER_T = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_CAPSULE_DESTRUCTOR_T = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

# --------------------------------------------------------------------------- capsule API
_api = ctypes.pythonapi

_PyCapsule_New = _api.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, _CAPSULE_DESTRUCTOR_T]

_PyCapsule_GetPointer = _api.PyCapsule_GetPointer
_PyCapsule_GetPointer.restype = ctypes.c_void_p
_PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]

_PyCapsule_SetName = _api.PyCapsule_SetName
_PyCapsule_SetName.restype = ctypes.c_int
_PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]

_PyCapsule_GetName = _api.PyCapsule_GetName
_PyCapsule_GetName.restype = ctypes.c_char_p
_PyCapsule_GetName.argtypes = [ctypes.py_object]

# The destructor receives a PyObject* of a capsule being deallocated: take it as a raw
# pointer (converting it to a py_object would resurrect it), through separate prototypes.
_raw_IsValid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", _api))
_raw_GetPointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", _api))

_CapsuleType = type(_PyCapsule_New(1, None, _CAPSULE_DESTRUCTOR_T()))  # types.CapsuleType


def is_capsule(obj: Any) -> bool:
    return type(obj) is _CapsuleType


# --------------------------------------------------------------------------- dtypes
_DTYPE_TO_DL: dict[np.dtype, tuple[int, int]] = {}
for _dt, _code in (
    ("bool", _kDLBool), ("int8", _kDLInt), ("int16", _kDLInt), ("int32", _kDLInt),
    ("int64", _kDLInt), ("uint8", _kDLUInt), ("uint16", _kDLUInt), ("uint32", _kDLUInt),
    ("uint64", _kDLUInt), ("float16", _kDLFloat), ("float32", _kDLFloat),
    ("float64", _kDLFloat), ("complex64", _kDLComplex), ("complex128", _kDLComplex),
):
    _d = np.dtype(_dt)
    _DTYPE_TO_DL[_d] = (_code, 8 * _d.itemsize)
_DL_TO_DTYPE = {v: k for k, v in _DTYPE_TO_DL.items()}
_CODE_NAMES = {0: "int", 1: "uint", 2: "float", 3: "opaque handle", 4: "bfloat", 5: "complex",
               6: "bool"}


def dtype_to_dl(dtype: np.dtype) -> tuple[int, int]:
    """(DLDataTypeCode, bits) of a numpy dtype (bfloat16 from ml_dtypes included)."""
    dl = _DTYPE_TO_DL.get(dtype)
    if dl is not None:
        return dl
    if dtype.name == "bfloat16" and dtype.itemsize == 2:
        return (_kDLBfloat, 16)
    raise BufferError(f"dtype {dtype} has no DLPack equivalent")


def dl_to_dtype(code: int, bits: int, lanes: int) -> np.dtype:
    """The numpy dtype of a DLDataType, or BufferError naming what is unsupported."""
    if lanes != 1:
        raise BufferError(f"from_dlpack: vector dtypes (lanes={lanes}) are not supported")
    dt = _DL_TO_DTYPE.get((code, bits))
    if dt is not None:
        return dt
    if code == _kDLBool and bits == 8:
        return np.dtype(bool)
    if code == _kDLBfloat and bits == 16:
        try:
            import ml_dtypes
        except ImportError:
            raise BufferError("from_dlpack: the tensor is bfloat16, which needs the optional "
                              "'ml_dtypes' package (pip install ml_dtypes)") from None
        return np.dtype(ml_dtypes.bfloat16)
    name = _CODE_NAMES.get(code, f"type code {code}")
    raise BufferError(f"from_dlpack: unsupported DLPack dtype {name}{bits} "
                      "(cudalab supports bool, int8-64, uint8-64, float16/32/64, "
                      "complex64/128 and bfloat16)")


# --------------------------------------------------------------------------- export
class _Export:
    """Everything one exported struct points to, kept alive until its deleter runs."""

    __slots__ = ("buffer", "owner")

    def __init__(self, buffer, owner):
        self.buffer = buffer  # the struct followed by its shape and strides arrays
        self.owner = owner


#: Live exports by address of their DLManagedTensor[Versioned].
_exports: dict[int, _Export] = {}
#: Number of times an export's deleter ran (tests check "exactly once").
deleter_calls = 0


def _release(address: int) -> None:
    global deleter_calls
    if _exports.pop(address, None) is not None:
        deleter_calls += 1


def _deleter(address):  # called by the consumer, through ctypes (the GIL is taken for us)
    try:
        _release(address)
    except BaseException:  # never let an exception escape into C
        pass


def _capsule_destructor(capsule):
    # An unconsumed capsule still owns its struct: call the deleter; a consumed one (renamed
    # "used_...") belongs to the consumer, who calls the deleter itself.
    try:
        for name in (_NAME, _NAME_V):
            if _raw_IsValid(capsule, name):
                address = _raw_GetPointer(capsule, name)
                if address:
                    _release(address)
                return
    except BaseException:
        pass


_DELETER = _DELETER_T(_deleter)
_DELETER_ADDRESS = ctypes.cast(_DELETER, ctypes.c_void_p).value
_DESTRUCTOR = _CAPSULE_DESTRUCTOR_T(_capsule_destructor)


def live_exports() -> int:
    """Exported capsules whose deleter has not run yet."""
    return len(_exports)


# The structs as flat little-endian layouts (64-bit platforms: pointers are 8 bytes). Checked
# against the ctypes declarations above at import time.
_TENSOR = "QiiiBBHQQQ"  # data, device_type, device_id, ndim, code, bits, lanes, shape, strides, byte_offset
_MANAGED = struct.Struct("<" + _TENSOR + "QQ")  # DLTensor, manager_ctx, deleter
_VERSIONED = struct.Struct("<IIQQQ" + _TENSOR)  # version, manager_ctx, deleter, flags, DLTensor
assert _MANAGED.size == ctypes.sizeof(DLManagedTensor)
assert _VERSIONED.size == ctypes.sizeof(DLManagedTensorVersioned)
_layouts: dict[tuple[bool, int], struct.Struct] = {}


def _layout(versioned: bool, ndim: int) -> struct.Struct:
    key = (versioned, ndim)
    lay = _layouts.get(key)
    if lay is None:
        head = _VERSIONED if versioned else _MANAGED
        lay = _layouts[key] = struct.Struct(f"{head.format}{ndim}q{ndim}q")
    return lay


def export_capsule(
    owner: Any,
    data: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    dtype: np.dtype,
    device_type: int,
    device_id: int,
    versioned: bool,
    read_only: bool = False,
) -> Any:
    """A DLPack capsule over ``data``; ``owner`` stays referenced until the deleter runs.

    ``strides`` are in bytes (multiples of the item size); DLPack's are in elements.
    """
    code, bits = dtype_to_dl(dtype)
    itemsize = dtype.itemsize
    ndim = len(shape)
    lay = _layout(versioned, ndim)
    buf = ctypes.create_string_buffer(lay.size)
    address = ctypes.addressof(buf)
    head = _VERSIONED.size if versioned else _MANAGED.size
    shape_ptr = address + head if ndim else 0
    strides_ptr = shape_ptr + 8 * ndim if ndim else 0
    tensor = (data, device_type, device_id, ndim, code, bits, 1, shape_ptr, strides_ptr, 0)
    elems = [st // itemsize for st in strides]
    if versioned:
        flags = _FLAG_READ_ONLY if read_only else 0
        lay.pack_into(buf, 0, *DLPACK_VERSION, address, _DELETER_ADDRESS, flags, *tensor,
                      *shape, *elems)
    else:
        lay.pack_into(buf, 0, *tensor, address, _DELETER_ADDRESS, *shape, *elems)
    _exports[address] = _Export(buf, owner)
    try:
        return _PyCapsule_New(address, _NAME_V if versioned else _NAME, _DESTRUCTOR)
    except BaseException:
        _exports.pop(address, None)
        raise


# --------------------------------------------------------------------------- import
def _call_deleter(deleter: int, address: int) -> None:
    if _exiting():
        return
    try:
        if deleter == _DELETER_ADDRESS:
            _release(address)  # our own export: skip the C round trip
        else:
            _DELETER_T(deleter)(address)
    except BaseException:
        pass


def _exiting() -> bool:
    return sys.is_finalizing()


class ImportedTensor:
    """A consumed DLPack tensor: its layout, and ownership of the producer's memory.

    The producer's deleter runs once, when this object is garbage collected (or at
    :meth:`release`). ``producer`` is kept referenced as well, as the protocol suggests.
    """

    __slots__ = ("data", "shape", "strides", "dtype", "device_type", "device_id", "read_only",
                 "producer", "_deleter", "_address", "__weakref__")

    def __init__(self, data, shape, strides, dtype, device_type, device_id, read_only,
                 producer, deleter, address):
        self._deleter = 0
        self.data = data
        self.shape = shape
        self.strides = strides  # bytes, or None for C-contiguous
        self.dtype = dtype
        self.device_type = device_type
        self.device_id = device_id
        self.read_only = read_only
        self.producer = producer
        self._address = address
        self._deleter = deleter

    def release(self) -> None:
        """Call the producer's deleter now (at most once; later calls do nothing)."""
        deleter, self._deleter = self._deleter, 0
        if deleter:
            _call_deleter(deleter, self._address)

    def __del__(self) -> None:
        try:
            self.release()
        except BaseException:
            pass


_KINDS = {_NAME_V: (_NAME_V, _USED_NAME_V), _NAME: (_NAME, _USED_NAME)}


def import_capsule(capsule: Any, accept_device_types: tuple[int, ...], producer: Any = None,
                   what: str = "from_dlpack") -> ImportedTensor:
    """Consume ``capsule`` after checking it; raise BufferError (capsule untouched) if not usable."""
    if not is_capsule(capsule):
        raise TypeError(f"{what}: expected a DLPack capsule, got {type(capsule).__name__}")
    capsule_name = _PyCapsule_GetName(capsule)
    kind = _KINDS.get(capsule_name)
    if kind is None:
        if capsule_name in (_USED_NAME, _USED_NAME_V):
            raise BufferError(f"{what}: this DLPack capsule was already consumed (a capsule "
                              "can be imported only once)")
        raise BufferError(f"{what}: not a DLPack capsule (capsule name {capsule_name!r})")
    name, used_name = kind
    address = _PyCapsule_GetPointer(capsule, name)
    if name == _NAME_V:
        (major, minor, _ctx, deleter, flags, data, dev_type, dev_id, ndim, code, bits, lanes,
         shape_ptr, strides_ptr, offset) = _VERSIONED.unpack(
             ctypes.string_at(address, _VERSIONED.size))
        if major > DLPACK_VERSION[0]:
            raise BufferError(f"{what}: DLPack version {major}.{minor} is newer than the "
                              f"supported {DLPACK_VERSION[0]}.x")
        read_only = bool(flags & _FLAG_READ_ONLY)
    else:
        (data, dev_type, dev_id, ndim, code, bits, lanes, shape_ptr, strides_ptr, offset, _ctx,
         deleter) = _MANAGED.unpack(ctypes.string_at(address, _MANAGED.size))
        read_only = False
    if dev_type not in accept_device_types:
        dev_name = DEVICE_TYPE_NAMES.get(dev_type, f"device type {dev_type}")
        raise BufferError(
            f"{what}: the tensor lives on {dev_name} (DLPack device type {dev_type}), not on a "
            "CUDA device; cudalab imports only CUDA device memory without copying "
            "(use cudalab.asarray() to copy host data to the GPU)")
    dtype = dl_to_dtype(code, bits, lanes)
    if ndim < 0 or (ndim and not shape_ptr):
        raise BufferError(f"{what}: invalid DLTensor (ndim {ndim}, shape pointer 0x{shape_ptr:x})")
    shape = struct.unpack(f"<{ndim}q", ctypes.string_at(shape_ptr, 8 * ndim)) if ndim else ()
    if any(d < 0 for d in shape):
        raise BufferError(f"{what}: invalid shape {shape}")
    strides = None
    if ndim and strides_ptr:
        itemsize = dtype.itemsize
        strides = tuple(x * itemsize for x in
                        struct.unpack(f"<{ndim}q", ctypes.string_at(strides_ptr, 8 * ndim)))
    data = data + offset
    if _PyCapsule_SetName(capsule, used_name) != 0:  # pragma: no cover - cannot fail here
        raise BufferError(f"{what}: could not mark the capsule as consumed")
    return ImportedTensor(data, shape, strides, dtype, dev_type, dev_id, read_only, producer,
                          deleter, address)
