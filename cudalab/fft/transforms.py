"""The transforms of ``cudalab.fft``, with torch.fft's signatures and results.

Each call checks its arguments, pads (with zeros) or trims the transformed dimensions to
the sizes asked (``n`` / ``s``), brings them last and contiguous (a copy only when they are
not already), runs one cuFFT plan from the device's plan cache per group of at most three
dimensions (cuFFT's largest rank) on the current stream, and scales the result for ``norm``
as torch does (``"backward"``, the default: the inverse divides by the signal size;
``"forward"``: the forward does; ``"ortho"``: both by its square root). Results are new
C-contiguous arrays (or written into ``out``).

dtypes: float32 / complex64 (single) and float64 / complex128 (double); integer and bool
inputs are taken as float32, as torch; float16 and bfloat16 are refused (cuFFT's half
transforms need power-of-two sizes and a complex-half dtype cudalab has not).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from cudalab import _array_state, _internal, _observe
from cudalab import streams as _streams
from cudalab._array_operators import converting_copy
from cudalab._driver.fft_seam import C2C, C2R, D2Z, FORWARD, INVERSE, R2C, Z2D, Z2Z
from cudalab.array import DeviceArray, zeros
from cudalab.fft.plan_cache import plan_cache

__all__ = ["fft", "fft2", "fftn", "ifft", "ifft2", "ifftn", "irfft", "irfftn", "rfft", "rfftn"]

_NORMS = (None, "backward", "forward", "ortho")
_COMPLEX_OF: dict[np.dtype, np.dtype] = {np.dtype(np.float32): np.dtype(np.complex64),
                                          np.dtype(np.float64): np.dtype(np.complex128)}
_REAL_OF: dict[np.dtype, np.dtype] = {c: r for r, c in _COMPLEX_OF.items()}
_BYTE = np.dtype(np.uint8)
_EXEC_NAMES = {C2C: "cufftExecC2C", Z2Z: "cufftExecZ2Z", R2C: "cufftExecR2C",
               D2Z: "cufftExecD2Z", C2R: "cufftExecC2R", Z2D: "cufftExecZ2D"}


# --------------------------------------------------------------------------- arguments
def _input(x: Any, name: str) -> DeviceArray:
    if not isinstance(x, DeviceArray):
        raise TypeError(f"{name}: input must be a cudalab DeviceArray, got {type(x).__name__}")
    kind = x.element_dtype.kind
    if kind in "biu":
        return x.astype(np.float32)
    if x.element_dtype not in _COMPLEX_OF and x.element_dtype not in _REAL_OF:
        raise TypeError(f"{name}: input has dtype {x.element_dtype}, which cudalab.fft does "
                        f"not support (float32, float64, complex64, complex128; convert with "
                        f".astype('float32'))")
    return x


def _norm(norm: Any, name: str) -> str:
    if norm not in _NORMS or (norm is not None and not isinstance(norm, str)):
        raise ValueError(f"{name}: norm must be 'backward', 'forward', 'ortho' or None, got "
                         f"{norm!r}")
    return "backward" if norm is None else norm


def _dims(x: DeviceArray, s: Any, dim: Any, name: str, default_all: bool) -> tuple[
        tuple[int, ...], tuple[int | None, ...]]:
    """(dimensions, sizes or None each) of an n-dimensional transform, torch's rules."""
    ndim = len(x.dims)
    if s is not None:
        if isinstance(s, (int, np.integer)):
            s = (s,)
        sizes: tuple[int | None, ...] = tuple(
            None if v == -1 else operator.index(v) for v in s)
    else:
        sizes = ()
    if dim is None:
        if s is not None:
            dims = tuple(range(ndim - len(sizes), ndim))
        else:
            dims = tuple(range(ndim)) if default_all else (ndim - 2, ndim - 1)
    else:
        if isinstance(dim, (int, np.integer)):
            dim = (dim,)
        dims = tuple(operator.index(d) for d in dim)
    out = []
    for d in dims:
        if not -ndim <= d < max(ndim, 1) or ndim == 0:
            raise IndexError(f"{name}: Dimension out of range (expected to be in range of "
                             f"[{-max(ndim, 1)}, {max(ndim, 1) - 1}], but got {d})")
        out.append(d % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"{name}: dim must hold unique dimensions, got {tuple(dims)}")
    if s is None:
        sizes = (None,) * len(out)
    elif len(sizes) != len(out):
        raise ValueError(f"{name}: s has {len(sizes)} sizes but dim has {len(out)} "
                         f"dimensions; they must match")
    for v in sizes:
        if v is not None and v < 1:
            raise ValueError(f"{name}: Invalid number of data points ({v}) specified "
                             f"(s / n must be positive)")
    return tuple(out), sizes


def _resize(x: DeviceArray, dims: Sequence[int], sizes: Sequence[int]) -> DeviceArray:
    """``x`` trimmed or zero-padded along ``dims`` to ``sizes`` (a view when only trimmed)."""
    for d, n in zip(dims, sizes):
        if n < x.dims[d]:
            x = x.narrow(d, 0, n)
    target = list(x.dims)
    for d, n in zip(dims, sizes):
        target[d] = n
    if tuple(target) == x.dims:
        return x
    padded = zeros(tuple(target), dtype=x.element_dtype, device=x.device_index)
    region = padded
    for d in range(len(target)):
        if x.dims[d] != target[d]:
            region = region.narrow(d, 0, x.dims[d])
    converting_copy(region, x)  # (copy_ refuses a strided destination; its kernel does not)
    return padded


# --------------------------------------------------------------------------- execution
def _permuted(x: DeviceArray, order: Sequence[int]) -> DeviceArray:
    """A C-contiguous copy of ``x`` with its dimensions in ``order`` (``x`` itself when the
    order is the identity and ``x`` is contiguous)."""
    if list(order) == list(range(len(x.dims))) and x.contiguous:
        return x
    strides = x.strides
    base = x if x.owner is None else x.owner
    view = _array_state.wrap(x.ptr, tuple(x.dims[i] for i in order), x.element_dtype,
                             tuple(strides[i] for i in order), x.device_index, x.stream, base,
                             x.read_only)
    return view.astype(x.element_dtype)


class _Call(NamedTuple):
    """One planned transform of a C-contiguous array: the plan cache's key and the output."""

    key: tuple[Any, ...]  # the plan cache's key (type, sizes, layouts, batch)
    shape: tuple[int, ...]  # the output's shape
    dtype: np.dtype  # the output's dtype
    fft_type: int  # the cufftType
    direction: int  # FORWARD or INVERSE (read for C2C / Z2Z)
    empty: bool  # nothing to transform (an empty batch)


def _call(x: DeviceArray, signal: tuple[int, ...], fft_type: int, direction: int,
          out_dtype: np.dtype) -> _Call:
    rank = len(signal)
    batch_shape = x.dims[:-rank]
    in_embed = x.dims[-rank:]
    if fft_type in (R2C, D2Z):
        out_embed = signal[:-1] + (signal[-1] // 2 + 1,)
    else:
        out_embed = signal
    batch = math.prod(batch_shape)
    key = (fft_type, signal, in_embed, 1, math.prod(in_embed), out_embed, 1,
           math.prod(out_embed), batch)
    return _Call(key, batch_shape + out_embed, out_dtype, fft_type, direction,
                 batch == 0 or math.prod(out_embed) == 0)


def _run(x: DeviceArray, call: _Call) -> DeviceArray:
    """Queue ``call`` on ``x`` (C-contiguous, of the shape it was planned for)."""
    device = x.device_index
    stream = _streams.current_stream(device)
    out = _array_state.output(call.shape, call.dtype, device, stream)
    if call.empty:
        return out
    plan, uncached = plan_cache(device).lookup(call.key)
    try:
        work = _array_state.output((plan.work_size,), _BYTE, device, stream) \
            if plan.work_size else None
        _internal.ensure_context(device)
        plan.fft.execute(plan.plan, stream.handle, 0 if work is None else work.ptr,
                         call.fft_type, x.ptr, out.ptr, call.direction)
        if _observe.access_on:  # the stream sanitizer: C2R overwrites its input too
            writes = [(out.ptr, out.byte_count)]
            if work is not None:
                writes.append((work.ptr, work.byte_count))
            if call.fft_type in (C2R, Z2D):
                writes.append((x.ptr, x.byte_count))
            _observe.access_tracker.access(stream, [(x.ptr, x.byte_count)], writes,
                                           _EXEC_NAMES[call.fft_type])
        if _observe.launch_on:
            for observer in tuple(_observe.launch_subscribers):
                observer(_EXEC_NAMES[call.fft_type], device, stream, (1, 1, 1), (1, 1, 1))
    finally:
        if uncached:
            plan.destroy()
    return out


def _execute(x: DeviceArray, signal: tuple[int, ...], fft_type: int, direction: int,
             out_dtype: np.dtype) -> DeviceArray:
    """One plan over the last ``len(signal)`` dimensions of the C-contiguous ``x``; the
    output's last dimensions hold the transform (``signal`` sizes, halved for R2C)."""
    return _run(x, _call(x, signal, fft_type, direction, out_dtype))


def _transform(x: DeviceArray, dims: tuple[int, ...], kind: str, forward: bool,
               last_size: int = 0) -> DeviceArray:
    """The unnormalised transform of ``x`` (already sized) over ``dims``: ``kind`` "c2c",
    "r2c" (the last of ``dims`` halved) or "c2r" (``last_size`` the real length of the
    last of ``dims``)."""
    ndim = len(x.dims)
    rest = [d for d in range(ndim) if d not in dims]
    order = rest + list(dims)
    y = _permuted(x, order)
    double = y.element_dtype in (np.dtype(np.float64), np.dtype(np.complex128))
    count = len(dims)
    # groups of at most 3 dimensions, the last group holding the last dimension
    groups: list[tuple[int, int]] = []  # (first, end) positions among the last `count` dims
    end = count
    while end > 0:
        groups.append((max(0, end - 3), end))
        end = max(0, end - 3)
    if kind == "c2r":
        groups.reverse()  # the complex dimensions first, the real one last
    for first, end in groups:
        rank = end - first
        tail = count - end  # transformed dimensions after this group, moved out of the way
        if tail:
            # bring this group's dimensions last (the tail in front of them)
            nd = len(y.dims)
            order2 = list(range(nd - count + first)) + list(range(nd - tail, nd)) + \
                list(range(nd - count + first, nd - tail))
            y = _permuted(y, order2)
        signal = y.dims[-rank:]
        last_group = end == count
        if kind == "r2c" and last_group:
            fft_type = D2Z if double else R2C
            y = _execute(y, signal, fft_type, FORWARD, _COMPLEX_OF[y.element_dtype])
        elif kind == "c2r" and last_group:
            fft_type = Z2D if double else C2R
            signal = signal[:-1] + (last_size,)
            y = _execute(y.astype(y.element_dtype) if y is x else y, signal, fft_type,
                         INVERSE, _REAL_OF[y.element_dtype])
        else:
            fft_type = Z2Z if double else C2C
            y = _execute(y, signal, fft_type, FORWARD if forward else INVERSE, y.element_dtype)
        if tail:
            nd = len(y.dims)
            back = list(range(nd - count + first)) + list(range(nd - rank, nd)) + \
                list(range(nd - count + first, nd - rank))
            y = _permuted(y, back)
    inverse = [0] * ndim
    for position, d in enumerate(order):
        inverse[d] = position
    return _permuted(y, inverse)


def _factor(norm: str, forward: bool, size: int) -> float | None:
    """The scale torch applies for ``norm`` (None: none)."""
    if norm == "ortho":
        return 1.0 / math.sqrt(size)
    if (norm == "forward") == forward and size != 1:
        return 1.0 / size
    return None


def _scale(y: DeviceArray, norm: str, forward: bool, size: int) -> DeviceArray:
    factor = _factor(norm, forward, size)
    if factor is not None:
        y *= factor
    return y


#: (function, its size / dim / norm arguments, the input's dims, strides and dtype) -> the
#: one plan and scale of a call that needs no copy (a contiguous input of the right dtype,
#: transformed over its last one to three dimensions at their sizes): the plan-cache hit's
#: short path. Emptied when it holds _MAX_FAST entries.
_fast: dict[tuple[Any, ...], tuple[_Call, float | None]] = {}
_MAX_FAST = 1024


def _fast_call(head: tuple[Any, ...], x: Any) -> DeviceArray | None:
    """The transform by the short path, or None when it has no entry for this call."""
    if type(x) is not DeviceArray:
        return None
    try:
        entry = _fast.get((head, x.dims, x.strides_or_none, x.element_dtype))
    except TypeError:  # an unhashable argument (a list for s or dim)
        return None
    if entry is None:
        return None
    y = _run(x, entry[0])
    if entry[1] is not None:
        y *= entry[1]
    return y


def _remember(head: tuple[Any, ...] | None, input: Any, x: DeviceArray, dims: tuple[int, ...],
              signal: tuple[int, ...], fft_type: int, direction: int, out_dtype: np.dtype,
              factor: float | None) -> None:
    """Give the short path this call when it needed no copy (``x`` is ``input``)."""
    ndim = len(x.dims)
    if head is None or x is not input or not x.contiguous or not 1 <= len(dims) <= 3 \
            or dims != tuple(range(ndim - len(dims), ndim)):
        return
    try:
        key = (head, x.dims, x.strides_or_none, x.element_dtype)
        hash(key)
    except TypeError:
        return
    if len(_fast) >= _MAX_FAST:
        _fast.clear()
    _fast[key] = (_call(x, signal, fft_type, direction, out_dtype), factor)


def _finish(y: DeviceArray, out: Any, name: str) -> DeviceArray:
    if out is None:
        return y
    if not isinstance(out, DeviceArray) or out.dims != y.dims or out.element_dtype != y.element_dtype:
        raise ValueError(f"{name}: out must be a {y.element_dtype} DeviceArray of shape "
                         f"{y.dims}")
    return out.copy_(y)


def _c2c(name: str, input: Any, s: Any, dim: Any, norm: Any, out: Any, forward: bool,
         default_all: bool, head: tuple[Any, ...] | None = None) -> DeviceArray:
    x = _input(input, name)
    mode = _norm(norm, name)
    dims, sizes = _dims(x, s, dim, name, default_all)
    if x.element_dtype.kind != "c":
        x = x.astype(_COMPLEX_OF[x.element_dtype])
    n = tuple(x.dims[d] if v is None else v for d, v in zip(dims, sizes))
    x = _resize(x, dims, n)
    y = _transform(x, dims, "c2c", forward) if dims else x.astype(x.element_dtype)
    double = x.element_dtype == np.dtype(np.complex128)
    _remember(head, input, x, dims, n, Z2Z if double else C2C, FORWARD if forward else INVERSE,
              x.element_dtype, _factor(mode, forward, math.prod(n)))
    return _finish(_scale(y, mode, forward, math.prod(n)), out, name)


def _r2c(name: str, input: Any, s: Any, dim: Any, norm: Any, out: Any,
         default_all: bool, head: tuple[Any, ...] | None = None) -> DeviceArray:
    x = _input(input, name)
    if x.element_dtype.kind == "c":
        raise TypeError(f"{name} expects a real input array, but got {x.element_dtype}")
    mode = _norm(norm, name)
    dims, sizes = _dims(x, s, dim, name, default_all)
    if not dims:
        raise ValueError(f"{name}: must transform at least one dimension")
    n = tuple(x.dims[d] if v is None else v for d, v in zip(dims, sizes))
    x = _resize(x, dims, n)
    y = _transform(x, dims, "r2c", True)
    double = x.element_dtype == np.dtype(np.float64)
    _remember(head, input, x, dims, n, D2Z if double else R2C, FORWARD,
              _COMPLEX_OF[x.element_dtype], _factor(mode, True, math.prod(n)))
    return _finish(_scale(y, mode, True, math.prod(n)), out, name)


def _c2r(name: str, input: Any, s: Any, dim: Any, norm: Any, out: Any,
         default_all: bool) -> DeviceArray:
    x = _input(input, name)
    mode = _norm(norm, name)
    dims, sizes = _dims(x, s, dim, name, default_all)
    if not dims:
        raise ValueError(f"{name}: must transform at least one dimension")
    if x.element_dtype.kind != "c":
        x = x.astype(_COMPLEX_OF[x.element_dtype])
    last = sizes[-1] if sizes[-1] is not None else 2 * (x.dims[dims[-1]] - 1)
    if last < 1:
        raise ValueError(f"{name}: Invalid number of data points ({last}) specified")
    n = tuple(x.dims[d] if v is None else v for d, v in zip(dims[:-1], sizes[:-1])) + (last,)
    x = _resize(x, dims, n[:-1] + (last // 2 + 1,))
    y = _transform(x, dims, "c2r", False, last)
    return _finish(_scale(y, mode, False, math.prod(n)), out, name)


# --------------------------------------------------------------------------- torch.fft's API
def fft(input: Any, n: int | None = None, dim: int = -1, norm: str | None = None, *,
        out: Any = None) -> DeviceArray:
    """The 1-D discrete Fourier transform of ``input`` along ``dim`` (torch.fft.fft).

    Parameters
    ----------
    input
        A DeviceArray (real input is converted to complex first).
    n
        The signal length: ``input`` is zero-padded or trimmed to it (default: its length).
    dim
        The dimension to transform (default: the last).
    norm
        ``"backward"`` (default, no scaling), ``"forward"`` (divide by ``n``) or ``"ortho"``.
    out
        An array of the result's shape and dtype to write into.

    Returns
    -------
    DeviceArray
        The complex transform.

    Raises
    ------
    ValueError
        ``n`` < 1, an unknown ``norm``, an ``out`` of the wrong shape or dtype.
    IndexError
        ``dim`` out of range.
    TypeError
        ``input`` is not a DeviceArray or its dtype is not supported.
    cudalab.CufftError
        cuFFT cannot be loaded (the message names the ``fft`` extra) or a call failed.
    """
    head = ("fft", n, dim, norm)
    if out is None:
        y = _fast_call(head, input)
        if y is not None:
            return y
    return _c2c("fft", input, None if n is None else (n,), (dim,), norm, out, True, False, head)


def ifft(input: Any, n: int | None = None, dim: int = -1, norm: str | None = None, *,
         out: Any = None) -> DeviceArray:
    """The 1-D inverse transform (torch.fft.ifft); arguments as :func:`fft` (``"backward"``
    divides by ``n``)."""
    head = ("ifft", n, dim, norm)
    if out is None:
        y = _fast_call(head, input)
        if y is not None:
            return y
    return _c2c("ifft", input, None if n is None else (n,), (dim,), norm, out, False, False, head)


def rfft(input: Any, n: int | None = None, dim: int = -1, norm: str | None = None, *,
         out: Any = None) -> DeviceArray:
    """The 1-D transform of real ``input``: the ``n // 2 + 1`` non-negative frequencies
    (torch.fft.rfft); arguments as :func:`fft`; complex input raises TypeError."""
    head = ("rfft", n, dim, norm)
    if out is None:
        y = _fast_call(head, input)
        if y is not None:
            return y
    return _r2c("rfft", input, None if n is None else (n,), (dim,), norm, out, False, head)


def irfft(input: Any, n: int | None = None, dim: int = -1, norm: str | None = None, *,
          out: Any = None) -> DeviceArray:
    """The inverse of :func:`rfft` (torch.fft.irfft): a real signal of length ``n``
    (default ``2 * (m - 1)`` for ``m`` input frequencies)."""
    return _c2r("irfft", input, None if n is None else (n,), (dim,), norm, out, False)


def fft2(input: Any, s: Sequence[int] | None = None, dim: Sequence[int] = (-2, -1),
         norm: str | None = None, *, out: Any = None) -> DeviceArray:
    """The 2-D transform over ``dim`` (torch.fft.fft2); ``s`` sizes as ``n`` of :func:`fft`."""
    head = ("fft2", s, dim, norm)
    if out is None:
        y = _fast_call(head, input)
        if y is not None:
            return y
    return _c2c("fft2", input, s, dim, norm, out, True, False, head)


def ifft2(input: Any, s: Sequence[int] | None = None, dim: Sequence[int] = (-2, -1),
          norm: str | None = None, *, out: Any = None) -> DeviceArray:
    """The 2-D inverse transform (torch.fft.ifft2)."""
    head = ("ifft2", s, dim, norm)
    if out is None:
        y = _fast_call(head, input)
        if y is not None:
            return y
    return _c2c("ifft2", input, s, dim, norm, out, False, False, head)


def fftn(input: Any, s: Sequence[int] | None = None, dim: Sequence[int] | None = None,
         norm: str | None = None, *, out: Any = None) -> DeviceArray:
    """The n-D transform (torch.fft.fftn): over ``dim``, or the last ``len(s)`` dimensions,
    or all of them."""
    head = ("fftn", s, dim, norm)
    if out is None:
        y = _fast_call(head, input)
        if y is not None:
            return y
    return _c2c("fftn", input, s, dim, norm, out, True, True, head)


def ifftn(input: Any, s: Sequence[int] | None = None, dim: Sequence[int] | None = None,
          norm: str | None = None, *, out: Any = None) -> DeviceArray:
    """The n-D inverse transform (torch.fft.ifftn)."""
    head = ("ifftn", s, dim, norm)
    if out is None:
        y = _fast_call(head, input)
        if y is not None:
            return y
    return _c2c("ifftn", input, s, dim, norm, out, False, True, head)


def rfftn(input: Any, s: Sequence[int] | None = None, dim: Sequence[int] | None = None,
          norm: str | None = None, *, out: Any = None) -> DeviceArray:
    """The n-D transform of real ``input``, the last of ``dim`` halved (torch.fft.rfftn)."""
    head = ("rfftn", s, dim, norm)
    if out is None:
        y = _fast_call(head, input)
        if y is not None:
            return y
    return _r2c("rfftn", input, s, dim, norm, out, True, head)


def irfftn(input: Any, s: Sequence[int] | None = None, dim: Sequence[int] | None = None,
           norm: str | None = None, *, out: Any = None) -> DeviceArray:
    """The inverse of :func:`rfftn` (torch.fft.irfftn)."""
    return _c2r("irfftn", input, s, dim, norm, out, True)
