"""dtype and shape normalisation shared by device arrays and pinned host arrays.

The one place that decides which dtypes a cudalab array can hold and how a ``shape`` argument
is read, so :mod:`cudalab.array` (device memory) and :mod:`cudalab.allocator.pinned` (page-locked
host memory) accept exactly the same arguments and cannot drift. Imports only numpy (and
``ml_dtypes`` lazily, for bfloat16), so any layer may use it.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Set
from typing import Any

import numpy as np

from cudalab._units import echo

__all__ = ["FLOAT8_NAMES", "SUPPORTED_DTYPES", "default_dtype_of", "normalize_dtype", "normalize_shape", "size_args"]

#: dtypes a DeviceArray can hold (bfloat16 too when ml_dtypes is installed).
SUPPORTED_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(name)
    for name in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                 "uint64", "float16", "float32", "float64", "complex64", "complex128")
)
_SUPPORTED = frozenset(SUPPORTED_DTYPES)
#: dtype arguments already seen (np.float32, "float32", np.dtype(...)) -> their dtype.
#: Invariant: every value is in ``_SUPPORTED`` or is ml_dtypes' bfloat16 or float8 (FLOAT8_NAMES);
#: at most 256 entries.
_DTYPE_CACHE: dict[Any, np.dtype] = {d: d for d in SUPPORTED_DTYPES}
_FLOAT32 = np.dtype(np.float32)
_SUPPORTED_TEXT = ("bool, int8, int16, int32, int64, uint8, uint16, uint32, uint64, float16, "
                   "float32, float64, complex64, complex128, bfloat16, float8_e4m3fn and "
                   "float8_e5m2 (with ml_dtypes)")


#: ml_dtypes' float8 types an array holds (created, copied, broadcast by NCCL; no math).
FLOAT8_NAMES = ("float8_e4m3fn", "float8_e5m2")


def _ml_dtype(name: str) -> np.dtype:
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError(f"dtype {name!r} needs the optional 'ml_dtypes' package "
                        f"(pip install ml_dtypes); numpy has no {name} of its own") from None
    return np.dtype(getattr(ml_dtypes, name))


def _bfloat16() -> np.dtype:
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError("dtype 'bfloat16' needs the optional 'ml_dtypes' package "
                        "(pip install ml_dtypes); numpy has no bfloat16 of its own") from None
    return np.dtype(ml_dtypes.bfloat16)


def normalize_dtype(dtype: Any, default: np.dtype | None = _FLOAT32) -> np.dtype:
    """The numpy dtype a cudalab array of ``dtype`` holds.

    Parameters
    ----------
    dtype
        Anything ``np.dtype`` accepts, or ``"bfloat16"`` / ``"bf16"``; ``None`` means ``default``.
    default
        The dtype for ``dtype=None``; ``None`` makes a dtype required.

    Returns
    -------
    numpy.dtype
        One of :data:`SUPPORTED_DTYPES`, or ml_dtypes' bfloat16.

    Raises
    ------
    TypeError
        The dtype is not supported (object, strings, datetimes, ...), bfloat16 is asked for
        without ml_dtypes installed, or ``dtype`` and ``default`` are both ``None``.
    """
    try:
        dt = _DTYPE_CACHE.get(dtype)
    except TypeError:  # unhashable
        dt = None
    if dt is not None:
        return dt
    if dtype is None:
        if default is None:
            raise TypeError("a dtype is required")
        return default
    if isinstance(dtype, str):
        spelled = dtype.strip().lower()
        if spelled in ("bfloat16", "bf16"):
            return _bfloat16()
        if spelled in FLOAT8_NAMES:
            return _ml_dtype(spelled)
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"unsupported dtype {echo(dtype)}; cudalab arrays support {_SUPPORTED_TEXT}"
                        ) from None
    if dt in _SUPPORTED:
        _remember_dtype(dtype, dt)
        return dt
    if dt.itemsize <= 2 and (dt.name == "bfloat16" or dt.name in FLOAT8_NAMES):
        # ml_dtypes' (numpy has none of its own)
        _remember_dtype(dtype, dt)
        return dt
    raise TypeError(f"unsupported dtype {dt}; cudalab arrays support {_SUPPORTED_TEXT}")


def _remember_dtype(key: Any, dt: np.dtype) -> None:
    try:
        if len(_DTYPE_CACHE) < 256:
            _DTYPE_CACHE[key] = dt
    except TypeError:
        pass


def normalize_shape(shape: Any) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints.

    Parameters
    ----------
    shape
        An int, or a sequence of objects with ``__index__`` (not bools).

    Returns
    -------
    tuple of int

    Raises
    ------
    TypeError
        ``shape`` is neither an int nor a sequence of ints.
    ValueError
        A dimension is negative.
    """
    t = type(shape)
    if t is int:
        if shape >= 0:
            return (shape,)
    elif t is tuple:
        for d in shape:
            if type(d) is not int or d < 0:
                break
        else:
            return shape
    bad = TypeError(f"shape must be an int or a sequence of ints, got {echo(shape)}")
    if hasattr(shape, "__index__"):
        items: tuple = (shape,)
    elif isinstance(shape, (Set, Mapping)):  # unordered, or keys: never a shape (torch agrees)
        raise TypeError(f"shape must be an int or a sequence of ints (a tuple or list), got a "
                        f"{type(shape).__name__}: {echo(shape)}")
    else:
        try:
            items = tuple(shape)
        except TypeError:
            raise bad from None
    if any(isinstance(d, (bool, np.bool_)) or not hasattr(d, "__index__") for d in items):
        raise bad
    dims = tuple(operator.index(d) for d in items)
    for d in dims:
        if d < 0:
            raise ValueError(f"negative dimension {d} in shape {dims}: sizes must be >= 0")
    return dims


#: Never a size, though some have ``__index__`` (bools) or name an int type (``np.int32``).
_NOT_SIZES = (bool, np.bool_, str, float, type, np.dtype)


def _is_int(d: Any) -> bool:
    """An int-like size: an int or an ``__index__`` object, not a bool or a dtype."""
    if type(d) is int:
        return True
    if isinstance(d, _NOT_SIZES):
        return False
    return hasattr(type(d), "__index__")


def size_args(what: str, size: tuple, dtype: Any) -> tuple[Any, Any]:
    """The shape and dtype of a creation call ``what(*size, dtype=dtype)``.

    The creation functions take one positional shape fast and call this for anything else.

    Parameters
    ----------
    what
        The function's name, for messages (``"zeros"``).
    size
        The positional arguments: torch's sizes as ints (``2, 3``), or one shape followed by
        a dtype as numpy allows (``(2, 3), np.float32``).
    dtype
        The ``dtype=`` keyword (None when not given).

    Returns
    -------
    tuple
        ``(shape, dtype)``: the shape for :func:`normalize_shape`, the dtype for
        :func:`normalize_dtype`.

    Raises
    ------
    TypeError
        No size, a dtype given twice, or arguments that are neither sizes nor one shape and
        a dtype (``zeros((2, 3), 4)``, ``zeros(2, 3, np.float32)``).
    """
    if len(size) == 2 and dtype is None:  # numpy's empty(shape, dtype), a known dtype: fast
        try:
            dt = _DTYPE_CACHE.get(size[1])
        except TypeError:  # unhashable
            dt = None
        if dt is not None:
            return size[0], dt
    if not size:
        raise TypeError(f"{what}() needs a size: sizes as ints or one tuple, e.g. {what}(2, 3) "
                        f"or {what}((2, 3))")
    for d in size:
        if not _is_int(d):
            break
    else:
        return size, dtype
    expected = "expected sizes as ints or one tuple; pass the dtype as dtype=..."
    if len(size) == 2 and not _is_int(size[1]) and not isinstance(size[1], (tuple, list)):
        # numpy's form, empty(shape, dtype): the second argument must be a dtype.
        if size[1] is None:
            return size[0], dtype
        if dtype is not None:
            raise TypeError(f"{what}() got a dtype twice: {echo(size[1])} after the size and "
                            f"dtype={echo(dtype)}; {expected}")
        try:
            dt = normalize_dtype(size[1], None)
        except TypeError:
            if isinstance(size[1], (str, type, np.dtype)):  # meant as a dtype: say why not
                raise
            raise TypeError(f"{what}() got {size[1]!r} after the size {size[0]!r}, which is "
                            f"neither a size nor a dtype; {expected}") from None
        return size[0], dt
    args = ", ".join(map(repr, size))
    raise TypeError(f"{what}({args}): {expected}")


def default_dtype_of(value: Any) -> np.dtype:
    """torch's dtype for ``full``'s scalar: bool, int64, the default float32, complex64 (numpy
    scalars that are Python numbers too, such as np.float64, count as those)."""
    if isinstance(value, (bool, np.bool_)):
        return np.dtype(np.bool_)
    if isinstance(value, int) and not isinstance(value, np.generic):
        return np.dtype(np.int64)
    if isinstance(value, float):  # (np.float64 is a float)
        return np.dtype(np.float32)
    if isinstance(value, complex):  # (np.complex128 is a complex)
        return np.dtype(np.complex64)
    return np.asarray(value).dtype
