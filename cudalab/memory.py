"""Device memory: the caching allocator and torch's ``torch.cuda`` memory API.

Every function takes ``device`` as None (the current device), an int, ``"cuda"``,
``"cuda:N"`` or a :class:`cudalab.Device`, and behaves like its ``torch.cuda`` namesake:
the statistics readers return 0 (or ``{}``) without initialising CUDA when nothing was
ever allocated, ``memory_stats()`` returns exactly torch's 122 keys (sorted),
``memory_summary()`` prints torch's table, and out-of-memory raises
:class:`cudalab.OutOfMemoryError` with torch's message.

Settings come from ``CUDALAB_ALLOC_CONF`` (or torch's ``PYTORCH_ALLOC_CONF`` /
``PYTORCH_CUDA_ALLOC_CONF``), read when the first allocator is created; see
:func:`parse_alloc_conf` for the grammar. The allocator itself is
:class:`~cudalab.allocator.caching.DeviceCachingAllocator`.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from cudalab import _internal, _interrupts, _observe
from cudalab import devices as _devices
from cudalab import streams as _streams
from cudalab.allocator.async_allocator import AsyncPoolAllocator
from cudalab.allocator.base import Allocator, bad_pointer
from cudalab.allocator.caching import DeviceCachingAllocator, compiled_pair
from cudalab.allocator.config import UNLIMITED, AllocatorConfig, parse_alloc_conf
from cudalab.allocator.mem_pool import MemPoolBase, use_mem_pool
from cudalab.allocator.oom_observers import attach_out_of_memory_observer
from cudalab.allocator.pluggable import (
    CUDAPluggableAllocator,
    PluggableAllocator,
    change_current_allocator,
)
from cudalab.allocator.registry import active as _active  # never rebound: bind once (hot)
from cudalab.allocator.registry import (
    allocator_config,
    existing_allocator,
    find_owner,
    get_allocator,
    set_allocator_settings,
    syncs_before_creation,
)
from cudalab.allocator.registry import allocators as _allocators  # (likewise)
from cudalab.allocator.scope import PeakScope, peak_scope
from cudalab.allocator.stats import STAT_KEYS, nested_from_flat, render_memory_summary, zero_stats
from cudalab.allocator.uncached import UncachedAllocator

if TYPE_CHECKING:  # the tooling's names, loaded on first use by __getattr__ (see _LAZY)
    from cudalab.allocator.pinned import (
        host_memory_stats,
        host_memory_stats_as_nested_dict,
        reset_accumulated_host_memory_stats,
        reset_peak_host_memory_stats,
    )
    from cudalab.memory_tools.autotune import autotune
    from cudalab.memory_tools.cupy_history import CupyRecording, record_cupy_history
    from cudalab.memory_tools.export import (
        history_frame,
        segments_frame,
        snapshot_frame,
        stats_frame,
    )
    from cudalab.memory_tools.history import HistoryRecording, record_history
    from cudalab.memory_tools.perfetto import export_perfetto
    from cudalab.memory_tools.plot import plot_segments, plot_timeline
    from cudalab.memory_tools.replay import ReplayResult, ReplayWarning, replay
    from cudalab.memory_tools.snapshot import export_memory_viz
    from cudalab.memory_tools.trace_diff import TraceDiff, diff
    from cudalab.memory_tools.trace_index import TraceIndex, open_trace
    from cudalab.memory_tools.trace_io import SnapshotLoadError, load_snapshot, read_history_csv
    from cudalab.memory_tools.what_if import what_if

__all__ = [
    "autotune",
    "diff",
    "open_trace",
    "TraceDiff",
    "TraceIndex",
    "PeakScope",
    "peak_scope",
    "private_pools",
    "plot_segments",
    "plot_timeline",
    "ReplayResult",
    "ReplayWarning",
    "export_perfetto",
    "history_frame",
    "read_history_csv",
    "replay",
    "segments_frame",
    "snapshot_frame",
    "stats_frame",
    "what_if",
    "Allocator",
    "AllocatorConfig",
    "AsyncPoolAllocator",
    "DeviceCachingAllocator",
    "CupyRecording",
    "HistoryRecording",
    "MemPool",
    "CUDAPluggableAllocator",
    "PluggableAllocator",
    "UncachedAllocator",
    "STAT_KEYS",
    "SnapshotLoadError",
    "caching_allocator_alloc",
    "caching_allocator_delete",
    "caching_allocator_enable",
    "change_current_allocator",
    "empty_cache",
    "export_memory_viz",
    "get_allocator_backend",
    "get_per_process_memory_fraction",
    "host_memory_stats",
    "host_memory_stats_as_nested_dict",
    "load_snapshot",
    "max_memory_allocated",
    "max_memory_cached",
    "max_memory_reserved",
    "mem_get_info",
    "memory_allocated",
    "memory_cached",
    "memory_reserved",
    "memory_snapshot",
    "memory_stats",
    "memory_stats_as_nested_dict",
    "memory_summary",
    "parse_alloc_conf",
    "record_cupy_history",
    "record_history",
    "record_stream",
    "render_memory_summary",
    "reset_accumulated_host_memory_stats",
    "reset_accumulated_memory_stats",
    "reset_max_memory_allocated",
    "reset_max_memory_cached",
    "reset_peak_host_memory_stats",
    "reset_peak_memory_stats",
    "set_per_process_memory_fraction",
    "use_mem_pool",
]


#: This thread's runtime state (``.device``: the current device), bound once: the same
#: object for the life of the process (see :func:`cudalab._internal.thread_state`).
_tls = _internal.thread_state()

# The hot getters below (memory_allocated, memory_stats, caching_allocator_alloc) read the
# initialisation flag ``_devices.initialized`` (caching_allocator_alloc first
# ``_devices.sole_device``) and the registry's per-device list directly:
# their benchmark rows ("memory_allocated" / "memory_stats" and the cache-hit pair in
# benchmarks/allocator.py) allow no extra call. Everything else uses cudalab._internal.


def _reader(device: Any) -> Allocator | None:
    """The allocator whose counters a getter reads; None if CUDA is not initialised (torch
    then reports 0 without initialising it) or nothing was ever allocated there."""
    if not _internal.is_initialized():
        return None
    d = _tls.device if device is None else _internal.device_index(device)
    a = existing_allocator(d)
    if a is None:
        # Nothing allocated yet: the settings are still read, so that a malformed
        # CUDALAB_ALLOC_CONF raises in every reader, as in memory_stats(), and not only in
        # some (parsed once, then cached; the readers' path with an allocator is untouched).
        allocator_config()
        return None
    if a.pending_frees or a.memo_block is not None:
        a.sync_pending()
    return a


# --------------------------------------------------------------------------- getters
def memory_allocated(device: Any = None) -> int:
    """Bytes currently handed out by the allocator (``allocated_bytes.all.current``).

    Parameters
    ----------
    device : int, str, Device or None, optional
        The device (default: the current device).

    Returns
    -------
    int
        The bytes; 0 when CUDA is not initialised (it is not initialised by this call) or
        the device has no allocator yet.

    Raises
    ------
    ValueError
        For a device index out of range.
    """
    if device is None and _devices.initialized:  # the common call, inlined (see above)
        d = _tls.device
        a = _allocators[d] if d < len(_allocators) else None
        if a is None:
            allocator_config()  # a malformed setting raises, as in every reader (see _reader)
            return 0
        if a.pending_frees or a.memo_block is not None:
            a.sync_pending()
    else:
        a = _reader(device)
    if a is None:
        return 0
    st = a.stats
    return st.small.b_alloc + st.large.b_alloc


def max_memory_allocated(device: Any = None) -> int:
    """Peak of :func:`memory_allocated` since the start or the last peak reset.

    Parameters
    ----------
    device : int, str, Device or None, optional
        The device (default: the current device).

    Returns
    -------
    int
        The peak in bytes (``allocated_bytes.all.peak``); 0 before any allocation.
    """
    a = _reader(device)
    return 0 if a is None else a.stats.agg.b_alloc_peak


def memory_reserved(device: Any = None) -> int:
    """Bytes held by the allocator, handed out or cached (``reserved_bytes.all.current``).

    Parameters
    ----------
    device : int, str, Device or None, optional
        The device (default: the current device).

    Returns
    -------
    int
        The bytes; 0 before any allocation.
    """
    a = _reader(device)
    if a is None:
        return 0
    st = a.stats
    return st.small.b_res + st.large.b_res


def max_memory_reserved(device: Any = None) -> int:
    """Peak of :func:`memory_reserved` (``reserved_bytes.all.peak``).

    Parameters
    ----------
    device : int, str, Device or None, optional
        The device (default: the current device).

    Returns
    -------
    int
        The peak in bytes; 0 before any allocation.
    """
    a = _reader(device)
    return 0 if a is None else a.stats.agg.b_res_peak


def memory_cached(device: Any = None) -> int:
    """Deprecated; see :func:`memory_reserved` (warns with FutureWarning, as torch)."""
    warnings.warn("`cudalab.memory_cached` has been renamed to `cudalab.memory_reserved`",
                  FutureWarning, stacklevel=2)
    return memory_reserved(device)


def max_memory_cached(device: Any = None) -> int:
    """Deprecated; see :func:`max_memory_reserved` (warns with FutureWarning, as torch)."""
    warnings.warn("`cudalab.max_memory_cached` has been renamed to `cudalab.max_memory_reserved`",
                  FutureWarning, stacklevel=2)
    return max_memory_reserved(device)


def memory_stats(device: Any = None, extended: bool = False) -> dict[str, int]:
    """torch's ``memory_stats()``: exactly its 122 keys, sorted, all ints.

    Parameters
    ----------
    device : int, str, Device or None, optional
        The device (default: the current device).
    extended : bool, optional
        Add cudalab's extra keys: ``largest_free_block`` (bytes of the biggest cached block),
        ``pending_free_blocks`` (freed blocks waiting for record_stream events) and
        ``outstanding_events``.

    Returns
    -------
    dict of str to int
        The statistics (see :mod:`cudalab.allocator.stats` for what each counts); ``{}``
        when CUDA is not initialised, as torch.

    Raises
    ------
    ValueError
        For a device index out of range.
    """
    if not _devices.initialized:  # (hot: see above)
        return {}
    d = _tls.device if device is None else _internal.device_index(device)
    a = _allocators[d] if d < len(_allocators) else None
    if a is None:
        cfg = allocator_config()
        if cfg.backend == "cudaMallocAsync":  # torch reports max_split_size 0 there
            out = zero_stats(0)
        else:
            out = zero_stats(-1 if cfg.max_split_size >= UNLIMITED else cfg.max_split_size)
        if d < len(syncs_before_creation) and syncs_before_creation[d]:
            out["num_sync_all_streams"] = syncs_before_creation[d]
    else:
        out = a.memory_stats()
    if extended:
        out = dict(out)
        if isinstance(a, DeviceCachingAllocator):
            out["largest_free_block"] = a.largest_free_block()
            out["outstanding_events"] = a.outstanding_events
        else:
            out["largest_free_block"] = out["outstanding_events"] = 0
        out["pending_free_blocks"] = a.stats.current("n_pend") if a is not None else 0
        out = dict(sorted(out.items()))
    return out


def memory_stats_as_nested_dict(device: Any = None) -> dict:
    """torch's ``memory_stats_as_nested_dict()``.

    Parameters
    ----------
    device : int, str, Device or None, optional
        The device (default: the current device).

    Returns
    -------
    dict
        ``{stat: {pool: {metric: value}}}`` plus the scalars, in torch's order; ``{}`` when
        CUDA is not initialised.
    """
    return nested_from_flat(memory_stats(device))


def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
    """torch's ``memory_summary()`` table (header "cudalab CUDA memory summary").

    Parameters
    ----------
    device : int, str, Device or None, optional
        The device (default: the current device). Initialises CUDA.
    abbreviated : bool, optional
        Leave out the per-pool rows.

    Returns
    -------
    str
        The table, byte for byte torch's layout; a simulated device reads
        "N (simulated)".
    """
    d = _internal.device_index(device)
    stats = memory_stats(d)
    return render_memory_summary(stats, d, abbreviated, simulated=_internal.backend().simulated)


def memory_snapshot(mempool_id: Any = None) -> list[dict]:
    """torch's ``memory_snapshot()``: every device's segments, as plain dicts and lists.

    Blocks and segments carry the stack of their allocation (``frames``) while the history
    is recorded with a context (:func:`record_history`); see also :func:`_snapshot`.

    Parameters
    ----------
    mempool_id : tuple of (int, int), optional
        Only the segments of this private pool (a ``MemPool``'s ``id``, a graph's
        ``pool()``; ``(0, 0)``: the default pool). Each segment's ``segment_pool_id`` says
        which pool it belongs to.

    Returns
    -------
    list of dict
        One dict per segment (``device``, ``address``, ``total_size``, ``blocks``, ...),
        sorted by device and address.
    """
    from cudalab.memory_tools.snapshot import memory_snapshot as snapshot_all_devices

    if not _active and _internal.is_initialized():
        allocator_config()  # a malformed setting raises, as in every reader (see _reader)
    # (allowed during a capture, as torch: it reads the allocator's books, queues nothing)
    return snapshot_all_devices(mempool_id)



def private_pools(device: Any = None) -> list[dict]:
    """The private memory pools of ``device`` (a cudalab extension: torch lists none).

    Returns
    -------
    list of dict
        One per pool, by id: ``id``, ``kind`` (``"graph"``: made by a graph capture;
        ``"user"``: graph_pool_handle() or MemPool), ``use_count``, ``segments``,
        ``reserved_bytes``, ``allocated_bytes``, ``freeable`` (use count 0: the next
        ``empty_cache()`` releases its free segments) and ``routed`` (allocations go to it
        now). Empty when CUDA is not initialised.
    """
    a = _reader(device)
    return [] if a is None else a.pools()


class MemPool(MemPoolBase):
    """torch's ``MemPool``: a user-created private pool of the current device.

    Allocations made inside ``with use_mem_pool(pool):`` (by the calling thread) come from
    the pool's own segments, which no other allocation uses; a CUDA graph can share it
    (``pool=pool.id``). The pool lives while this object, an open ``use_mem_pool`` block or
    a graph uses it; after that ``empty_cache()`` gives its free segments back.

    Parameters
    ----------
    allocator : PluggableAllocator, optional
        Where its segments come from (default: the driver).
    use_on_oom : bool, optional
        Search its free blocks when an ordinary allocation runs out of memory.
    no_split : bool, optional
        Never split its blocks.

    Raises
    ------
    TypeError
        A bad argument.
    NotImplementedError
        The device's allocator has no private pools (see ``get_allocator_backend()``).
    """

    def snapshot(self, include_traces: bool = True) -> list[dict]:
        """``memory_snapshot(self.id)``: the pool's segments (``include_traces`` is accepted
        for torch's signature; frames are filled in while history is recorded)."""
        return memory_snapshot(self.id)


# --------------------------------------------------------------------------- resets
def reset_peak_memory_stats(device: Any = None) -> None:
    """Every ``peak`` becomes the current value (torch's ``reset_peak_memory_stats``).

    Open :func:`peak_scope` scopes keep the peak they have seen.

    Parameters
    ----------
    device : int, str, Device or None, optional
        The device (default: the current device).
    """
    a = existing_allocator(_internal.device_index(device))
    if a is not None:
        a.reset_peak_stats()


def reset_accumulated_memory_stats(device: Any = None) -> None:
    """``allocated``/``freed`` and the ``num_*`` counters back to 0.

    Parameters
    ----------
    device : int, str, Device or None, optional
        The device (default: the current device).
    """
    d = _internal.device_index(device)
    a = existing_allocator(d)
    if a is not None:
        a.reset_accumulated_stats()
    elif d < len(syncs_before_creation):
        syncs_before_creation[d] = 0


def reset_max_memory_allocated(device: Any = None) -> None:
    """Deprecated alias of :func:`reset_peak_memory_stats` (resets *all* peaks, as torch)."""
    warnings.warn(
        "cudalab.reset_max_memory_allocated now calls cudalab.reset_peak_memory_stats, "
        "which resets /all/ peak memory stats.", FutureWarning, stacklevel=2)
    reset_peak_memory_stats(device)


def reset_max_memory_cached(device: Any = None) -> None:
    """Deprecated alias of :func:`reset_peak_memory_stats` (resets *all* peaks, as torch)."""
    warnings.warn(
        "cudalab.reset_max_memory_cached now calls cudalab.reset_peak_memory_stats, "
        "which resets /all/ peak memory stats.", FutureWarning, stacklevel=2)
    reset_peak_memory_stats(device)


# --------------------------------------------------------------------------- control
# (in cudalab/memory_control.py: re-exported here, their documented home)
from cudalab.memory_control import (  # noqa: E402
    caching_allocator_enable,
    empty_cache,
    get_allocator_backend,
    get_per_process_memory_fraction,
    mem_get_info,
    set_per_process_memory_fraction,
)


def _set_allocator_settings(settings: str) -> None:
    """Change the allocator configuration at run time (torch's
    ``torch.cuda.memory._set_allocator_settings``).

    ``settings`` uses the ``CUDALAB_ALLOC_CONF`` grammar (:func:`parse_alloc_conf`); the keys
    it names change; as in torch, ``max_split_size_mb``, ``roundup_power2_divisions`` and
    ``garbage_collection_threshold`` go back to their defaults when it leaves them out, and
    the other keys keep their values. Existing allocators apply the new size
    rules (``max_split_size_mb``, ``max_non_split_rounding_mb``, ``large_segment_size_mb``,
    ``roundup_power2_divisions``), ``garbage_collection_threshold`` and
    ``per_process_memory_fraction`` from their next allocation; allocators created later
    use the new settings. torch 2.11 deprecates this name in favour of
    ``torch._C._accelerator_setAllocatorSettings``, which cudalab does not have: this is
    cudalab's one entry point, without a warning.

    Parameters
    ----------
    settings : str
        For example ``"max_split_size_mb:128,garbage_collection_threshold:0.6"``.

    Raises
    ------
    TypeError
        When ``settings`` is not a str.
    ValueError
        When it does not parse; nothing changes.
    RuntimeError
        Once an allocator exists, for a change of ``backend`` (as torch) or of
        ``expandable_segments`` (torch applies it to new segments; cudalab fixes it per
        allocator); nothing changes.
    """
    set_allocator_settings(settings)


def _attach_out_of_memory_observer(observer: Any) -> None:
    """Call ``observer(device, alloc, device_allocated, device_free)`` before every
    out-of-memory error of the native allocators (torch's private function of the same
    name).

    ``alloc`` is the size the allocator asked the driver for, ``device_allocated`` the
    per-process limit when a memory fraction is set (else the device's total memory) and
    ``device_free`` the driver's free memory. An observer that raises does not hide the
    :class:`cudalab.OutOfMemoryError`: its exception becomes a RuntimeWarning. See
    :mod:`cudalab.allocator.oom_observers`.

    Parameters
    ----------
    observer : callable
        Called with four ints.

    Raises
    ------
    TypeError
        When ``observer`` is not callable.
    """
    attach_out_of_memory_observer(observer)


# --------------------------------------------------------------------------- raw allocation
def caching_allocator_alloc(size: int, device: Any = None, stream: Any = None) -> int:
    """Allocate ``size`` bytes from the caching allocator (torch's function of the same name).

    Parameters
    ----------
    size : int
        Bytes.
    device : int, str, Device or None, optional
        The device (default: the current device).
    stream : Stream or int, optional
        A :class:`cudalab.Stream` or an int stream handle (default: the current stream of
        ``device``).

    Returns
    -------
    int
        The device pointer (0 for ``size == 0``, like torch); release it with
        :func:`caching_allocator_delete`.

    Raises
    ------
    cudalab.OutOfMemoryError
        When the memory cannot be had, with torch's message.
    """
    if device is None and _devices.sole_device:  # (hot: see above) one device: d is 0
        d = 0  # (a threading.local read costs ~40 ns: spared where it can only say 0)
    elif device is None and _devices.initialized:
        d = _tls.device  # malloc resolves stream=None to this thread's current one
    else:
        d = _internal.device_index(device)
    try:
        a = _allocators[d]  # (d >= 0: the current device, or a checked index)
    except IndexError:
        a = None
    if a is None:
        a = get_allocator(d)
    ptr = a.malloc(size, stream)
    if _observe.access_on:  # the stream sanitizer (one flag read while it is off)
        if stream is None or isinstance(stream, int):
            stream = _streams.current_stream(d) if not stream else _streams.ExternalStream(stream, d)
        _observe.access_tracker.allocated(ptr, size, stream)
    return ptr


def caching_allocator_delete(mem_ptr: int) -> None:
    """Free memory from :func:`caching_allocator_alloc` (0 is ignored, like torch).

    Parameters
    ----------
    mem_ptr : int
        The pointer.

    Raises
    ------
    ValueError
        When ``mem_ptr`` is not live in any of cudalab's allocators (double free, foreign
        pointer); nothing changes.
    TypeError
        When it is not an int.
    """
    if _observe.access_on:  # the stream sanitizer: the free request (its allocation stream
        _observe.access_tracker.freed(mem_ptr)  # is the one seen at caching_allocator_alloc)
    # The first allocator made (usually the only one) without a loop, whose iterator is
    # an object made and dropped per call (hot: the cache-hit pair of benchmarks/allocator.py)
    if _active and mem_ptr in (a := _active[0]).live:
        a.free(mem_ptr)
        return
    for a in _active[1:]:
        if mem_ptr in a.live:
            a.free(mem_ptr)
            return
    if mem_ptr == 0 and type(mem_ptr) is int:
        return
    owner = find_owner(mem_ptr) if type(mem_ptr) is int else None
    if owner is not None:  # allocated while caching was off (caching_allocator_enable)
        owner.free(mem_ptr)
        return
    raise bad_pointer(mem_ptr)


#: The Python pair: the whole of it where the C twins are not built, else their fallback for
#: everything but the pair memo's pure hit (cudalab/allocator/_pair.c; the rows
#: "cudalab caching_allocator_alloc+delete" of benchmarks/allocator.py and "allocator hit
#: pair" of benchmarks/house_ab.py; tests/allocator/test_pair_c.py runs both).
python_caching_allocator_alloc = caching_allocator_alloc
python_caching_allocator_delete = caching_allocator_delete
_twins = compiled_pair(caching_allocator_alloc, caching_allocator_delete, _allocators, _active,
                       vars(_devices), vars(_observe), _streams.custom_stream_tokens, __name__)
if _twins is not None:
    caching_allocator_alloc, caching_allocator_delete = _twins  # type: ignore[assignment]


def record_stream(ptr: int, stream: Any) -> None:
    """Mark allocator memory ``ptr`` as used on ``stream`` (torch's ``Tensor.record_stream``).

    When ``ptr`` is freed, its block is reused only after the work queued on ``stream`` up
    to that moment has finished; no host synchronisation happens on the free path.

    Parameters
    ----------
    ptr : int
        A live pointer from cudalab's allocator.
    stream : Stream or int
        The stream (an int is taken as a stream handle of ``ptr``'s device).

    Raises
    ------
    ValueError
        When ``ptr`` is not live in any of cudalab's allocators.
    """
    a = find_owner(ptr)
    if a is None:
        raise bad_pointer(ptr)
    if isinstance(stream, int) and not isinstance(stream, bool):
        stream = _streams.ExternalStream(stream, device=a.device)
    a.record_stream(ptr, stream)
    if _observe.access_on:  # the stream sanitizer: the allocator now waits for ``stream``
        _observe.access_tracker.stream_recorded(ptr, stream)


_TOOLING = "cudalab.memory_tools."
_LAZY = {
    # The tooling that observes the allocator (cudalab.memory_tools), loaded on first use:
    # the allocator runtime never imports it (an import-linter contract), this facade
    # re-exports its public names as torch.cuda.memory does torch.cuda._memory_viz's.
    **{name: _TOOLING + "export" for name in (
        "history_frame", "segments_frame", "snapshot_frame", "stats_frame")},
    "export_perfetto": _TOOLING + "perfetto",
    "autotune": _TOOLING + "autotune",
    # a layer above (it reads every allocator, NVML and Python's objects), loaded on first use
    **{name: "cudalab.oom" for name in ("explain_oom", "OOMExplanation")},
    **{name: _TOOLING + "history" for name in (
        "HistoryRecording", "record_history", "_record_memory_history")},
    **{name: _TOOLING + "plot" for name in ("plot_segments", "plot_timeline")},
    **{name: _TOOLING + "replay" for name in ("ReplayResult", "ReplayWarning", "replay")},
    "what_if": _TOOLING + "what_if",
    **{name: _TOOLING + "cupy_history" for name in ("CupyRecording", "record_cupy_history")},
    **{name: _TOOLING + "trace_diff" for name in ("diff", "TraceDiff")},
    **{name: _TOOLING + "trace_index" for name in ("open_trace", "TraceIndex")},
    **{name: _TOOLING + "snapshot" for name in ("export_memory_viz", "_dump_snapshot", "_snapshot")},
    **{name: _TOOLING + "trace_io" for name in (
        "SnapshotLoadError", "load_snapshot", "read_history_csv")},
    # interop shims and the pinned host pool, loaded on demand
    "cupy_allocator": "cudalab.interop",
    "CudalabNumbaMemoryManager": "cudalab.interop",
    **{name: "cudalab.allocator.pinned" for name in (
        "pinned_memory_stats", "empty_pinned_cache", "host_memory_stats",
        "host_memory_stats_as_nested_dict", "reset_peak_host_memory_stats",
        "reset_accumulated_host_memory_stats")},
    # torch's private names for the SVG plots and user metadata on trace entries
    **{name: _TOOLING + "usage_plots" for name in ("_save_segment_usage", "_save_memory_usage")},
    **{name: _TOOLING + "history" for name in ("_set_memory_metadata", "_get_memory_metadata")},
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'cudalab.memory' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


_interrupts.guard(__getattr__)  # Ctrl-C waits for the lazy import (see cudalab._interrupts)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
