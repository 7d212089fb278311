"""torch's type promotion for elementwise kernels: ``promote_types``, ``result_type``, ``can_cast``.

The rules of ``torch.result_type`` (c10/core/ScalarType.cpp and aten's ResultTypeState),
restated over numpy dtypes so the jiterator and the DeviceArray operators agree with torch:

* categories bool < integral < floating < complex;
* operands have a priority: an array with dimensions > a 0-d array > a Python scalar (torch's
  "wrapped number"). The result is the promotion of the highest-priority operands, unless a
  lower-priority operand is of a higher category, which then raises the category: a Python
  float with an int array gives the default float dtype (float32), a Python int with a bool
  array gives int64, a 0-d float64 array with an int32 array gives float64;
* ``uint16``/``uint32``/``uint64`` promote only with themselves, bool and floating types
  (torch refuses the rest).

Imports only numpy; the dtypes are the ones :mod:`cudalab._dtypes` accepts.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "BOOL", "INTEGRAL", "FLOATING", "COMPLEX",
    "category", "promote_types", "result_type", "can_cast", "opmath_dtype", "scalar_dtype",
    "DIMENSIONED", "ZERO_DIM", "WRAPPED",
]

#: Categories, in promotion order.
BOOL, INTEGRAL, FLOATING, COMPLEX = 0, 1, 2, 3
#: Operand priorities for :func:`result_type`.
DIMENSIONED, ZERO_DIM, WRAPPED = 0, 1, 2

_FLOAT32 = np.dtype(np.float32)
_FLOAT64 = np.dtype(np.float64)
_INT64 = np.dtype(np.int64)
_BOOL = np.dtype(np.bool_)
_COMPLEX64 = np.dtype(np.complex64)
_COMPLEX128 = np.dtype(np.complex128)
_BAREBONES_UNSIGNED = frozenset(np.dtype(n) for n in ("uint16", "uint32", "uint64"))
#: torch's names, for error messages.
_TORCH_NAMES = {
    "bool": "Bool", "int8": "Char", "int16": "Short", "int32": "Int", "int64": "Long",
    "uint8": "Byte", "uint16": "UInt16", "uint32": "UInt32", "uint64": "UInt64",
    "float16": "Half", "bfloat16": "BFloat16", "float32": "Float", "float64": "Double",
    "complex64": "ComplexFloat", "complex128": "ComplexDouble",
}


def torch_name(dtype: np.dtype) -> str:
    """torch's ScalarType name of ``dtype`` (``Float`` for float32), for messages."""
    return _TORCH_NAMES.get(dtype.name, dtype.name)


def category(dtype: np.dtype) -> int:
    """:data:`BOOL`, :data:`INTEGRAL`, :data:`FLOATING` or :data:`COMPLEX`."""
    kind = dtype.kind
    if kind == "b":
        return BOOL
    if kind in "iu":
        return INTEGRAL
    if kind == "c":
        return COMPLEX
    return FLOATING  # "f" and ml_dtypes' bfloat16 ("V")


def _is_bfloat16(dtype: np.dtype) -> bool:
    return dtype.name == "bfloat16"


def _float_rank(dtype: np.dtype) -> int:
    return {2: 1, 4: 2, 8: 3}[dtype.itemsize]


def _complex_of(dtype: np.dtype) -> np.dtype:
    """The complex dtype whose parts are ``dtype`` (float16 and bfloat16 -> complex64 here:
    cudalab has no complex32)."""
    return _COMPLEX128 if dtype.itemsize == 8 else _COMPLEX64


def promote_types(a: np.dtype, b: np.dtype) -> np.dtype:
    """torch.promote_types over numpy dtypes.

    Parameters
    ----------
    a, b
        Two supported dtypes.

    Returns
    -------
    numpy.dtype

    Raises
    ------
    TypeError
        One is uint16/uint32/uint64 and the other is an integer type of another width or
        signedness (torch: "Promotion for uint16, uint32, uint64 types is not supported").
    """
    if a == b:
        return a
    ca, cb = category(a), category(b)
    if a in _BAREBONES_UNSIGNED or b in _BAREBONES_UNSIGNED:
        if ca >= FLOATING or cb >= FLOATING:
            return a if ca > cb else b
        if ca == BOOL:
            return b
        if cb == BOOL:
            return a
        raise TypeError(f"Promotion for uint16, uint32, uint64 types is not supported, "
                        f"attempted to promote {torch_name(a)} and {torch_name(b)}")
    if ca != cb:
        hi, lo = (a, b) if ca > cb else (b, a)
        if category(hi) == COMPLEX and category(lo) == FLOATING and lo.itemsize == 8:
            return _COMPLEX128
        return hi
    if ca == INTEGRAL:
        if a.kind == b.kind:
            return a if a.itemsize > b.itemsize else b
        signed, unsigned = (a, b) if a.kind == "i" else (b, a)  # uint8 with a signed type
        if signed.itemsize > unsigned.itemsize:
            return signed
        return np.dtype(np.int16)  # uint8 with int8
    if ca == FLOATING:
        if a.itemsize == b.itemsize:  # float16 with bfloat16
            return _FLOAT32
        return a if _float_rank(a) > _float_rank(b) else b
    return a if a.itemsize > b.itemsize else b  # complex


def scalar_dtype(value: Any) -> np.dtype:
    """The dtype torch gives a Python scalar before the wrapped-number rules: bool, int64,
    float64 or complex128 (numpy scalars keep their own dtype)."""
    if isinstance(value, np.generic):
        return value.dtype
    if isinstance(value, bool):
        return _BOOL
    if isinstance(value, int):
        return _INT64
    if isinstance(value, float):
        return _FLOAT64
    if isinstance(value, complex):
        return _COMPLEX128
    raise TypeError(f"expected a number, got {type(value).__name__}")


def _combine_categories(higher: np.dtype | None, lower: np.dtype | None) -> np.dtype | None:
    if higher is None:
        return lower
    if lower is None:
        return higher
    ch, cl = category(higher), category(lower)
    if ch == COMPLEX:
        return higher
    if cl == COMPLEX:
        return _complex_of(higher) if ch == FLOATING else lower
    if ch == FLOATING:
        return higher
    if ch == BOOL or cl == FLOATING:
        return promote_types(higher, lower)
    return higher


def result_type(operands: list[tuple[np.dtype, int]]) -> np.dtype:
    """torch.result_type of operands given as ``(dtype, priority)`` pairs.

    Parameters
    ----------
    operands
        One ``(dtype, priority)`` per operand; priority is :data:`DIMENSIONED`,
        :data:`ZERO_DIM` or :data:`WRAPPED` (a Python scalar, whose dtype comes from
        :func:`scalar_dtype`).

    Returns
    -------
    numpy.dtype

    Raises
    ------
    ValueError
        ``operands`` is empty.
    """
    if not operands:
        raise ValueError("result_type needs at least one operand")
    results: list[np.dtype | None] = [None, None, None]
    for dtype, priority in operands:
        if priority == WRAPPED:
            c = category(dtype)
            if c == FLOATING:
                dtype = _FLOAT32  # torch's default dtype
            elif c == COMPLEX:
                dtype = _COMPLEX64
        current = results[priority]
        results[priority] = dtype if current is None else promote_types(current, dtype)
    dim, zero, wrapped = results
    out = _combine_categories(dim, _combine_categories(zero, wrapped))
    assert out is not None
    return out


def can_cast(source: np.dtype, target: np.dtype) -> bool:
    """torch.can_cast: no floating -> integral, complex -> non-complex, non-bool -> bool."""
    cs, ct = category(source), category(target)
    if cs == COMPLEX and ct != COMPLEX:
        return False
    if cs == FLOATING and ct < FLOATING:
        return False
    return not (cs != BOOL and ct == BOOL)


def opmath_dtype(dtype: np.dtype) -> np.dtype:
    """The type torch computes in for ``dtype``: float32 for float16 and bfloat16, else itself."""
    if dtype.itemsize == 2 and category(dtype) == FLOATING:
        return _FLOAT32
    return dtype
