"""The real backend's kernel parameter packs: :class:`CudaKernelArgs` (``cuLaunchKernel``'s
``kernelParams``), what :meth:`CudaBackend.make_args` returns.

Read by :mod:`cudalab._driver.cuda` and, through each pack's :attr:`CudaKernelArgs.native`,
by the C launch of :mod:`cudalab._driver.fastcall`.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from cudalab._driver.kernel_args import KernelArgs

__all__ = ["CudaKernelArgs"]

#: signature code -> (struct format of the 8-byte slot, min, max) (min/max None for floats).
_ARG_KINDS: dict[str, tuple[str, int | None, int | None]] = {
    "p": ("Q", 0, 2**64 - 1),
    "i4": ("i4x", -(2**31), 2**31 - 1),
    "u4": ("I4x", 0, 2**32 - 1),
    "i8": ("q", -(2**63), 2**63 - 1),
    "u8": ("Q", 0, 2**64 - 1),
    "f4": ("f4x", None, None),
    "f8": ("d", None, None),
}
_ARG_DTYPES = {
    "p": np.uint64, "i4": np.int32, "u4": np.uint32, "i8": np.int64,
    "u8": np.uint64, "f4": np.float32, "f8": np.float64,
}
_F4_MAX = float(np.finfo(np.float32).max)


class CudaKernelArgs(KernelArgs):
    """Pre-packed ``void*[]`` kernel parameters for ``cuLaunchKernel``.

    Storage is one 8-byte-aligned slot per parameter in a single numpy buffer (``views[i]`` is
    the parameter's one-element array of its own dtype), plus an ``intp`` array holding the
    slots' addresses; :attr:`address_int` is that array's address, which ``cuLaunchKernel``
    accepts directly as ``kernelParams``. :meth:`set` writes all values with one precompiled
    ``struct.pack``. The driver copies parameter values at launch, so a pack can be
    re-set right after a launch.
    """

    __slots__ = ("signature", "views", "address_int", "native", "_buf", "_mv", "_ptrs", "_struct")

    def __init__(self, signature: Sequence[str]):
        sig = tuple(signature)
        for kind in sig:
            if kind not in _ARG_KINDS:
                raise ValueError(
                    f"unknown kernel parameter type {kind!r}; expected one of "
                    f"{', '.join(_ARG_KINDS)}"
                )
        n = len(sig)
        self.signature = sig
        self._struct = struct.Struct("=" + "".join(_ARG_KINDS[k][0] for k in sig))
        self._buf = np.zeros(max(n, 1), dtype=np.uint64)
        self._mv = self._buf.data.cast("B")[: self._struct.size]
        base = self._buf.ctypes.data
        self.views = tuple(self._buf[i:i + 1].view(_ARG_DTYPES[k])[:1] for i, k in enumerate(sig))
        self._ptrs = np.array([base + 8 * i for i in range(n)], dtype=np.intp)
        # NULL kernelParams for a kernel without parameters.
        self.address_int = int(self._ptrs.ctypes.data) if n else 0
        #: What fastcall.launch_packed reads (fixed for the pack's life): the kernelParams
        #: address, the first slot's address, and one struct code per slot (the first
        #: character of its _ARG_KINDS format, so the two cannot drift).
        self.native = (self.address_int, int(base),
                       "".join(_ARG_KINDS[k][0][0] for k in sig).encode())

    def set(self, *values: Any) -> CudaKernelArgs:
        try:
            # pack() then one copy: atomic (a failed set leaves the pack untouched) and faster
            # than pack_into() on a numpy buffer.
            self._mv[:] = self._struct.pack(*values)
        except (struct.error, OverflowError, TypeError) as exc:
            self._raise_for(values, exc)
        return self

    def _raise_for(self, values: tuple[Any, ...], exc: Exception) -> None:
        """Turn a failed pack into a precise error: ValueError for a wrong argument count or
        a value out of range, TypeError for a value of the wrong kind."""
        sig = self.signature
        if len(values) != len(sig):
            raise ValueError(
                f"kernel takes {len(sig)} argument(s) {sig}, got {len(values)}"
            ) from None
        for i, (kind, value) in enumerate(zip(sig, values)):
            _fmt, lo, hi = _ARG_KINDS[kind]
            if lo is None:
                if isinstance(value, (str, bytes, bytearray)):
                    raise TypeError(
                        f"kernel argument {i} ({kind}) must be a real number, got "
                        f"{type(value).__name__}"
                    ) from None
                try:
                    v = float(value)
                except OverflowError:
                    raise ValueError(
                        f"kernel argument {i} ({kind}) = {value!r} is out of range"
                    ) from None
                except (TypeError, ValueError):
                    raise TypeError(
                        f"kernel argument {i} ({kind}) must be a real number, got "
                        f"{type(value).__name__}"
                    ) from None
                if kind == "f4" and abs(v) > _F4_MAX and abs(v) != float("inf"):
                    raise ValueError(
                        f"kernel argument {i} ({kind}) = {value!r} is out of float32 range"
                    ) from None
            else:
                try:
                    v = value.__index__()
                except (AttributeError, TypeError):
                    raise TypeError(
                        f"kernel argument {i} ({kind}) must be an integer, got "
                        f"{type(value).__name__}"
                    ) from None
                if not lo <= v <= hi:
                    raise ValueError(
                        f"kernel argument {i} ({kind}) = {v} is out of range [{lo}, {hi}]"
                    ) from None
        raise ValueError(f"cannot pack kernel arguments {values!r}: {exc}") from exc

    @property
    def values(self) -> tuple[Any, ...]:
        return self._struct.unpack_from(self._mv, 0)

    def __repr__(self) -> str:
        return f"CudaKernelArgs({self.signature!r}, values={self.values!r})"
