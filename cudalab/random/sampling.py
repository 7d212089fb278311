"""The sampling functions: rand, randn, randint, normal and the in-place uniform_, normal_,
bernoulli_, with torch's kernels, parameter checks and offset accounting.

:func:`_generate` is the one path every function takes: pick the generator's state, reserve
the launch plan's offset increment under the state lock (or inside a graph being captured),
then launch the Philox kernels of :mod:`cudalab._kernels.philox` on the current stream. Its
module-global reads (the default generators, the plan cache, the capturing set, the launch
function) are bound here at import on purpose: it is the host cost measured by
benchmarks/rng.py ("rand(1000)") and must stay one global read each.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from cudalab import _dtypes
from cudalab import array as _array
from cudalab import streams as _streams
from cudalab.random.generator import (
    Generator,
    default_generator,
    default_generator_slots,
    queued_calls,
    seed_calls,
)
from cudalab.random.launch import fill_plan, fill_plans, launch_kernel
from cudalab.random.state import (
    MASK64,
    PhiloxState,
    capturing_states,
    state_lock,
    stream_capturing,
)

__all__ = ["rand", "randn", "randint", "normal", "uniform_", "normal_", "bernoulli_"]


def _state_for(generator: Any, dev: int) -> PhiloxState:
    if generator is None:
        if dev < len(default_generator_slots) and not (queued_calls or seed_calls):
            g = default_generator_slots[dev]
            if g is not None:
                return g.philox_state
        return default_generator(dev).philox_state
    if not isinstance(generator, Generator):
        raise TypeError(f"generator must be a cudalab.Generator, got {type(generator).__name__}")
    if generator.device_index != dev:
        raise ValueError(f"the generator is on cuda:{generator.device_index} but the output is on "
                         f"cuda:{dev}; use a generator of the output's device")
    return generator.philox_state


def _reserve_in_graph(st: PhiloxState, total: int) -> tuple[int, int]:
    """Offsets inside a CUDA graph being captured: (offset, device words pointer)."""
    if not st.capturing:
        raise RuntimeError(
            "random generation on a stream that is being captured into a CUDA graph, with a "
            "generator not in capture mode: register the generator's graph_state with the "
            "graph (register_graph, capture_prologue) before capturing")
    if st.offset_intragraph + total > 0xFFFFFFFF:
        raise RuntimeError("the random offsets reserved inside this CUDA graph exceed 2**32 - 1")
    off = st.offset_intragraph
    st.offset_intragraph = off + total
    return off, st.graph_buffer.ptr


def _generate(arr: _array.DeviceArray, kernel: Any, unroll: int, params: tuple,
              generator: Any, stream: Any = None) -> None:
    """Fill ``arr`` (contiguous, writable) with torch's values for ``kernel`` and ``params``,
    on the current stream of its device, advancing the generator like torch."""
    n = arr.element_count
    if not n:
        return
    dev = arr.device_index
    if generator is None and dev < len(default_generator_slots) and not (queued_calls or seed_calls):
        g = default_generator_slots[dev]
        st = g.philox_state if g is not None else _state_for(None, dev)
    else:
        st = _state_for(generator, dev)
    if stream is None:  # (a new array passes its allocation stream: the current one)
        stream = _current_stream(dev)
    plan = fill_plans.get((dev, n, arr.element_dtype.itemsize, unroll))
    if plan is None:
        plan = fill_plan(dev, n, arr.element_dtype.itemsize, unroll)
    total, steps = plan
    gstate = 0
    with state_lock:
        seed_ = st.seed
        if capturing_states and stream_capturing(stream):
            off, gstate = _reserve_in_graph(st, total)
        else:
            if st.capturing:
                raise RuntimeError("random generation outside graph capture with a generator "
                                   "in capture mode (capture_prologue without "
                                   "capture_epilogue)")
            off = st.offset
            st.offset = (off + total) & MASK64
    ptr = arr.ptr
    if len(steps) == 1:
        byte_off, m, S, K, grid, block = steps[0][1]
        launch_kernel(kernel, dev, stream, grid, block, (ptr, m, S, K, seed_, off, gstate) + params)
        return
    for inc, launch in steps:
        if launch is not None:
            byte_off, m, S, K, grid, block = launch
            launch_kernel(kernel, dev, stream, grid, block,
                    (ptr + byte_off, m, S, K, seed_, off, gstate) + params)
        off = (off + inc) & MASK64


# Bound once (no attribute chain on the generation path): benchmarks/rng.py, rand(1000).
_current_stream = _streams.current_stream



# --------------------------------------------------------------------------- dtypes, args
_FLOAT_TAGS = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64",
               np.dtype(np.float16): "f16"}
_INT_DTYPES = tuple(np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64, np.uint8,
                                          np.uint16, np.uint32, np.uint64))


def _float_tag(dt: np.dtype, what: str) -> str:
    tag = _FLOAT_TAGS.get(dt)
    if tag is None:
        if dt.name == "bfloat16" and dt.itemsize == 2:
            return "bf16"
        raise TypeError(f"{what}: dtype must be a floating type (float16, bfloat16, float32, "
                        f"float64), got {dt}")
    return tag


def _size(size: tuple, what: str) -> Any:
    """``f(2, 3)``, ``f((2, 3))``, ``f([2, 3])``, ``f(5)``, ``f()`` -> a shape DeviceArray
    accepts (it checks the values)."""
    if len(size) == 1:
        size = size[0]
        if size is None:
            raise TypeError(f"{what}: a size is required")
    return size


def _float_out(size: tuple, dtype: Any, device: Any, what: str) -> tuple:
    """(new array, kernel tag) for rand/randn."""
    if dtype is None:
        return _array.DeviceArray(_size(size, what), _F32, device), "f32"
    dt = _dtypes.normalize_dtype(dtype)
    tag = _float_tag(dt, what)
    return _array.DeviceArray(_size(size, what), dt, device), tag


_F32 = np.dtype(np.float32)


def _as_target(array: Any, what: str) -> _array.DeviceArray:
    if not isinstance(array, _array.DeviceArray):
        foreign = _array.foreign_cuda_array(array)
        if foreign is None:
            raise TypeError(f"{what} needs a cudalab.DeviceArray (or a CUDA array of another "
                            f"library), got {type(array).__name__}")
        array = foreign
    _array.require_writable(array, what)
    return array


_kernel_table: dict[str, Any] | None = None


def _kernel(suffix: str) -> Any:
    global _kernel_table
    table = _kernel_table
    if table is None:
        from cudalab._kernels.philox import KERNELS

        table = _kernel_table = KERNELS
    return table[suffix]


def _to_half(x: float) -> np.float16:
    return np.float16(np.float32(x))  # static_cast<Half>(double): via float, like c10


def _to_bf16_float(x: float) -> np.float32:
    from cudalab._kernels.philox import bfloat16_bits_to_float, float_to_bfloat16_bits

    return bfloat16_bits_to_float(float_to_bfloat16_bits(np.array([np.float32(x)])))[0]


_FINFO = {"f32": (float(np.finfo(np.float32).min), float(np.finfo(np.float32).max)),
          "f64": (float(np.finfo(np.float64).min), float(np.finfo(np.float64).max)),
          "f16": (-65504.0, 65504.0),
          "bf16": (-3.3895313892515355e38, 3.3895313892515355e38)}


def _uniform_params(tag: str, low: float, high: float, what: str) -> tuple:
    """torch's uniform_ checks and (range, from, to) as the kernel receives them."""
    low, high = float(low), float(high)
    lo, hi = _FINFO[tag]
    for name, v in (("from", low), ("to", high)):
        if not lo <= v <= hi:
            raise ValueError(f"{what}: {name}={v} is out of bounds for the dtype")
    if not low <= high:
        raise ValueError(f"{what} expects to return a [from, to) range, but found from={low} "
                         f"> to={high}")
    if not high - low <= hi:
        raise ValueError(f"{what} expects to-from <= the dtype's max, but found to={high} and "
                         f"from={low}")
    if tag == "f64":
        return (high - low, low, high)
    f: Any  # float32, float16 or bfloat16-rounded float32 by tag
    t: Any
    if tag == "f32":
        f, t = np.float32(low), np.float32(high)
        return (float(np.float32(t - f)), float(f), float(t))
    if tag == "f16":
        f, t = _to_half(low), _to_half(high)
        rng = np.float16(np.float32(t) - np.float32(f))  # Half - Half returns a Half
        return (float(rng), float(f), float(t))
    f, t = _to_bf16_float(low), _to_bf16_float(high)
    return (float(_to_bf16_float(float(np.float32(t) - np.float32(f)))), float(f), float(t))


def _normal_params(tag: str, mean: float, std: float, what: str) -> tuple:
    mean, std = float(mean), float(std)
    if not std >= 0.0:
        raise ValueError(f"{what} expects std >= 0.0, but found std {std}")
    if tag == "f64":
        return (std, mean)
    return (float(np.float32(std)), float(np.float32(mean)))


def _scalar_param(value: Any, name: str, what: str) -> float:
    if isinstance(value, _array.DeviceArray) or hasattr(value, "__cuda_array_interface__"):
        raise TypeError(f"{what}: {name} must be a Python number (tensor-valued parameters "
                        "are not supported)")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{what}: {name} must be a real number, got {type(value).__name__}") from None


# --------------------------------------------------------------------------- sampling API
_RAND_PARAMS = {"f32": (1.0, 0.0, 1.0), "f64": (1.0, 0.0, 1.0), "f16": (1.0, 0.0, 1.0),
                "bf16": (1.0, 0.0, 1.0)}
_RANDN_PARAMS = {"f32": (1.0, 0.0), "f64": (1.0, 0.0), "f16": (1.0, 0.0), "bf16": (1.0, 0.0)}
_UNROLL = {"f32": 4, "f16": 4, "bf16": 4, "f64": 2}


def rand(*size: Any, dtype: Any = None, device: Any = None,
         generator: Generator | None = None) -> _array.DeviceArray:
    """Uniform samples in [0, 1): ``torch.rand(*size, dtype=, device="cuda")``.

    float32 (default), float64, float16 and bfloat16 follow torch's ``uniform_`` kernel
    (curand_uniform4, or curand_uniform2_double for float64), so with the same seed and
    offset the result equals torch's bit for bit on the same GPU model.
    """
    arr, tag = _float_out(size, dtype, device, "rand()")
    _generate(arr, _kernel("uniform_" + tag), _UNROLL[tag], _RAND_PARAMS[tag], generator,
              arr.stream)
    return arr


def randn(*size: Any, dtype: Any = None, device: Any = None,
          generator: Generator | None = None) -> _array.DeviceArray:
    """Standard normal samples: ``torch.randn(*size, dtype=, device="cuda")``.

    torch's ``normal_`` kernel: curand's Box-Muller (``curand_normal4``; float64:
    ``curand_normal2_double``), bit-exact with torch on the same GPU model. The simulator
    computes log/sin/cos with numpy: its normals match the GPU's to a few ulps only.
    """
    arr, tag = _float_out(size, dtype, device, "randn()")
    _generate(arr, _kernel("normal_" + tag), _UNROLL[tag], _RANDN_PARAMS[tag], generator,
              arr.stream)
    return arr


def normal(mean: float = 0.0, std: float = 1.0, size: Any = None, *, dtype: Any = None,
           device: Any = None, generator: Generator | None = None) -> _array.DeviceArray:
    """Normal samples with scalar ``mean`` and ``std``: ``torch.normal(mean, std, size)``
    (same kernel as :func:`randn`, ``value * std + mean`` in float32 for the 2-byte types and
    float32, float64 for float64). Tensor-valued mean/std are not supported."""
    mean = _scalar_param(mean, "mean", "normal()")
    std = _scalar_param(std, "std", "normal()")
    if size is None:
        raise TypeError("normal(): a size is required with scalar mean and std")
    shape = size
    dt = _dtypes.normalize_dtype(dtype, _F32)
    tag = _float_tag(dt, "normal()")
    params = _normal_params(tag, mean, std, "normal()")
    arr = _array.DeviceArray(shape, dt, device)
    _generate(arr, _kernel("normal_" + tag), _UNROLL[tag], params, generator)
    return arr


def uniform_(array: Any, from_: float = 0.0, to: float = 1.0, *,
             generator: Generator | None = None) -> Any:
    """Fill ``array`` with uniform samples in ``[from_, to)`` (``Tensor.uniform_``), in place on
    the current stream; returns ``array``. Floating dtypes; bit-exact with torch."""
    target = _as_target(array, "uniform_()")
    tag = _float_tag(target.dtype, "uniform_()")
    params = _uniform_params(tag, _scalar_param(from_, "from", "uniform_()"),
                             _scalar_param(to, "to", "uniform_()"), "uniform_()")
    _generate(target, _kernel("uniform_" + tag), _UNROLL[tag], params, generator)
    return array


def normal_(array: Any, mean: float = 0.0, std: float = 1.0, *,
            generator: Generator | None = None) -> Any:
    """Fill ``array`` with normal samples (``Tensor.normal_``) in place; returns ``array``."""
    target = _as_target(array, "normal_()")
    tag = _float_tag(target.dtype, "normal_()")
    params = _normal_params(tag, _scalar_param(mean, "mean", "normal_()"),
                            _scalar_param(std, "std", "normal_()"), "normal_()")
    _generate(target, _kernel("normal_" + tag), _UNROLL[tag], params, generator)
    return array


_BERNOULLI_ONE = {"float32": ("u32", 0x3F800000), "float16": ("u16", 0x3C00),
                  "bfloat16": ("u16", 0x3F80), "bool": ("u8", 1)}


def bernoulli_(array: Any, p: float = 0.5, *, generator: Generator | None = None) -> Any:
    """Set each element to 1 with probability ``p``, else 0 (``Tensor.bernoulli_(p)`` with a
    float ``p``), in place; returns ``array``. Any real, integer or bool dtype; the same
    kernel and offsets as torch (uniform float < p; float64 uses double uniforms).
    Tensor-valued ``p`` is not supported."""
    target = _as_target(array, "bernoulli_()")
    p = _scalar_param(p, "p", "bernoulli_()")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"bernoulli_ expects p to be in [0, 1], but got p={p}")
    dt = target.dtype
    if dt == np.float64:
        suffix, one, params = "bernoulli_f64", 0x3FF0000000000000, (p,)
        unroll = 2
    else:
        entry = _BERNOULLI_ONE.get(dt.name)
        if entry is None:
            if dt not in _INT_DTYPES:
                raise TypeError(f"bernoulli_(): unsupported dtype {dt}")
            entry = (f"u{8 * dt.itemsize}", 1)
        suffix, one = "bernoulli_" + entry[0], entry[1]
        params = (float(np.float32(p)),)
        unroll = 4
    _generate(target, _kernel(suffix), unroll, params + (one,), generator)
    return array


def randint(low: int, high: int | None = None, size: Any = None, *, dtype: Any = np.int64,
            device: Any = None, generator: Generator | None = None) -> _array.DeviceArray:
    """Integers uniform in [low, high): ``torch.randint(low, high, size)`` (or
    ``randint(high, size)``). Integer dtypes (default int64). torch's ``random_(from, to)``
    kernel: ``bits % range + low`` with 32-bit draws when ``range < 2**28``, else 64-bit draws
    (two per Philox block), so the values equal torch's bit for bit."""
    if size is None:
        if high is None:
            raise TypeError("randint(): a size is required: randint(high, size) or "
                            "randint(low, high, size)")
        low, high, size = 0, low, high
    elif high is None:  # randint(high, size=...)
        low, high = 0, low
    try:
        lo, hi = operator.index(low), operator.index(high)
    except TypeError:
        raise TypeError("randint(): low and high must be integers") from None
    shape = size
    dt = _dtypes.normalize_dtype(dtype, np.dtype(np.int64))
    if dt not in _INT_DTYPES:
        raise TypeError(f"randint(): dtype must be an integer type, got {dt}")
    for name, v in (("low", lo), ("high", hi)):
        if not -(1 << 63) <= v <= (1 << 63) - 1:
            raise ValueError(f"randint(): {name}={v} does not fit in int64")
    if not lo < hi:
        raise ValueError(f"random_ expects 'from' to be less than 'to', but got from={lo} >= "
                         f"to={hi}")
    if dt == np.uint64:
        tmin, tmax = 0, (1 << 63) - 1
    else:
        info = np.iinfo(dt)
        tmin, tmax = int(info.min), int(info.max)
    if not tmin <= lo <= tmax:
        raise ValueError(f"randint(): from={lo} is out of bounds for {dt}")
    if not tmin <= hi - 1 <= tmax:
        raise ValueError(f"randint(): to - 1={hi - 1} is out of bounds for {dt}")
    rng = (hi - lo) & MASK64
    width = 8 * dt.itemsize
    if rng >= 1 << 28:
        suffix, unroll = f"randint64_u{width}", 2
    else:
        suffix, unroll = f"randint32_u{width}", 4
    arr = _array.DeviceArray(shape, dt, device)
    _generate(arr, _kernel(suffix), unroll, (rng, lo & MASK64), generator)
    return arr
