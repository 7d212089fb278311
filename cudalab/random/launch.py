"""RNG launch planning: torch's grid and Philox offset increments, and the raw launch.

torch sizes each fill's grid from the SM count and reserves ``4 * iterations`` of Philox
offset per thread (:func:`torch_launch_plan`); tensors that need 64-bit indexing are split in
halves, each with its own reservation. :func:`fill_plan` turns that into cudalab's launches
(cached per shape); :func:`launch_kernel` queues one kernel with a per-thread cached function handle
and argument pack. The values never depend on cudalab's own launch shape
(:func:`_set_launch_tuning`), only on torch's.
"""

from __future__ import annotations

import threading
from typing import Any

from cudalab import _observe
from cudalab import devices as _devices
from cudalab import streams as _streams
from cudalab._driver.base import ClosedHandle
from cudalab._internal import launch_observers as _launch_observers
from cudalab._kernels import kernel as _facility

__all__ = ["torch_launch_plan"]

_INT32_MAX = (1 << 31) - 1
_BLOCK_THREADS = 256  # torch's block size (fixes the grid formula)

_tls = threading.local()  # .cache: (kernel, device) -> (backend, function, args)
fill_plans: dict[tuple, tuple] = {}
_max_blocks: dict[int, int] = {}
#: Launch shape of cudalab's kernels (not torch's: values do not depend on it). Change with
#: :func:`_set_launch_tuning` (benchmarks sweep it).
_block = 256
_k_per_thread = 1
_tpt = 4  # torch threads per CUDA thread: philox.TPT (CL_TPT) of the kernels launched


def _set_launch_tuning(block: int | None = None, k_per_thread: int | None = None,
                       tpt: int | None = None) -> None:
    """Threads per block (32 to 256), Philox iterations per thread, and torch threads per
    CUDA thread (only with kernels built for it: ``philox.variant``) of the launches."""
    global _block, _k_per_thread, _tpt
    if tpt is not None:
        if tpt not in (1, 2, 4):
            raise ValueError("tpt must be 1, 2 or 4")
        _tpt = tpt
    if block is not None:
        if block not in (32, 64, 128, 256):
            raise ValueError("block must be 32, 64, 128 or 256")
        _block = block
    if k_per_thread is not None:
        if k_per_thread < 1:
            raise ValueError("k_per_thread must be >= 1")
        _k_per_thread = k_per_thread
    fill_plans.clear()


def _device_max_blocks(dev: int) -> int:
    mb = _max_blocks.get(dev)
    if mb is None:
        p = _devices.get_device_properties(dev)
        mb = _max_blocks[dev] = max(
            1, p.multi_processor_count * (p.max_threads_per_multi_processor // _BLOCK_THREADS))
    return mb


def torch_launch_plan(n: int, itemsize: int, unroll: int, max_blocks: int) -> list[tuple]:
    """torch's offset reservations for one ``n``-element fill: a list of ``(increment, chunk)``
    in order, ``chunk = (first element, count, S, K)`` or None for the reservation torch makes
    before splitting a tensor that needs 64-bit indexing into halves (each half then
    reserves its own increment, recursively, first half first)."""
    out: list[tuple] = []

    def rec(base: int, m: int) -> None:
        G = min((m + _BLOCK_THREADS - 1) // _BLOCK_THREADS, max_blocks)
        S = _BLOCK_THREADS * G
        K = (m - 1) // (S * unroll) + 1
        inc = K * 4
        if m <= _INT32_MAX and 1 + (m - 1) * itemsize <= _INT32_MAX:
            out.append((inc, (base, m, S, K)))
        else:
            out.append((inc, None))
            half = m // 2
            rec(base, half)
            rec(base + half, m - half)

    if n > 0:
        rec(0, n)
    return out


def fill_plan(dev: int, n: int, itemsize: int, unroll: int) -> tuple:
    """(total increment, steps) for one fill; a step is (increment, launch or None) with
    ``launch = (byte offset, count, S, K, grid, block)``. Cached."""
    key = (dev, n, itemsize, unroll)
    plan = fill_plans.get(key)
    if plan is not None:
        return plan
    steps = []
    for inc, chunk in torch_launch_plan(n, itemsize, unroll, _device_max_blocks(dev)):
        launch = None
        if chunk is not None:
            base, m, S, K = chunk
            quads = S // _tpt
            blk = min(_block, quads)
            gx = -(-quads // blk)
            gy = min(-(-K // _k_per_thread), 65535)
            launch = (base * itemsize, m, S, K, (gx, gy, 1), (blk, 1, 1))
        steps.append((inc, launch))
    plan = (sum(inc for inc, _ in steps), tuple(steps))
    if len(fill_plans) >= 4096:
        fill_plans.clear()
    fill_plans[key] = plan
    return plan


# Near-copy of the tail of cudalab._kernels.kernel.Kernel.launch (its per-thread function
# and argument-pack cache, context switch, launch, CUDA_LAUNCH_BLOCKING synchronise and launch
# observers), kept for speed: the launch-overhead rows "cudalab rand(1000)" and
# "cudalab uniform_(1000)" of benchmarks/rng.py. tests/random/test_launch_copy.py pins the two
# together (same calls in the same order, same closed-stream error): change both or neither.
def launch_kernel(kernel: Any, device: int, stream: _streams.Stream, grid: tuple, block: tuple,
            args: tuple) -> None:
    """Launch with a per-thread cached function handle and argument pack (the values are
    built here, so Kernel.launch's conversions and checks are skipped)."""
    backend = stream.backend
    try:
        cache = _tls.cache
    except AttributeError:
        cache = _tls.cache = {}
    entry = cache.get((kernel, device))
    if entry is None or entry[0] is not backend:
        entry = (backend, kernel.get_function(device, backend), backend.make_args(kernel.signature))
        cache[(kernel, device)] = entry
    handle = stream.handle
    if type(handle) is ClosedHandle:  # (the seam would refuse it too, after the argument set)
        raise handle.error()
    _ensure_context(device)
    backend.launch_values(entry[1], grid, block, 0, handle, entry[2], args)
    if _facility.launch_blocking:
        backend.stream_synchronize(handle)
    if _launch_observers:
        for observer in tuple(_launch_observers):
            observer(kernel.name, device, stream, grid, block)
    if _observe.access_on:  # the stream sanitizer (one flag read while it is off)
        _observe.access_tracker.kernel_launch(kernel, stream, args)


# The RNG launch path reads the runtime's context switch as a module global (no _internal
# wrapper call): benchmarks/rng.py, "rand(1000)" host cost.
_ensure_context = _devices.ensure_context
