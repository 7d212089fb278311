"""Memory snapshots in torch's format: taking them and dumping them for memory_viz.

* :func:`memory_snapshot` — torch's ``memory_snapshot()``: the segments of every device
  (blocks carry the stack of their allocation while history is recorded with a context).
* :func:`_snapshot` — torch's ``torch.cuda.memory._snapshot()`` dict: ``segments``,
  ``device_traces`` (one list of trace entries per device, from the history ring buffers of
  :mod:`cudalab.memory_tools.history`), ``allocator_settings`` (torch's keys) and
  ``external_annotations``, and cudalab's ``identity`` (where the snapshot came from: host,
  pid, rank, the current device's index, UUID and name, the cudalab version and the
  allocator, :meth:`cudalab.identity.Identity.to_dict`; torch's readers ignore keys they do
  not know, and cudalab's readers accept snapshots without it). While history is recorded,
  taking a snapshot appends a ``snapshot`` entry to each device's trace (as torch's).
* :func:`_dump_snapshot` / :func:`export_memory_viz` — that dict pickled with protocol 4 and
  plain Python types only (dict, list, tuple, str, int, float, bool, None), which is what
  pytorch.org/memory_viz's own unpickler and ``torch.cuda._memory_viz`` read.

Reading snapshot pickles safely (``load_snapshot``) and the conversion to plain types
(``to_plain``, ``dumps_snapshot``) are in :mod:`cudalab.memory_tools.trace_io`.

Trace entries carry torch's keys plus cudalab's ``device``, ``nvtx_range`` and ``cell``;
torch's own snapshots lack those three, so readers treat them as optional.
"""

from __future__ import annotations

import os
from typing import Any

from cudalab import _internal
from cudalab.allocator import registry as _registry
from cudalab.allocator.base import Allocator
from cudalab.allocator.config import UNLIMITED, AllocatorConfig
from cudalab.allocator.pools import check_pool_id
from cudalab.devices import device_count, get_device_properties
from cudalab.identity import Identity
from cudalab.memory_tools import history as _history
from cudalab.memory_tools import stacks as _stacks
from cudalab.memory_tools.stacks import FrameCache
from cudalab.memory_tools.trace_io import dumps_snapshot

__all__ = [
    "_dump_snapshot",
    "_snapshot",
    "take_snapshot",
    "allocator_settings",
    "export_memory_viz",
    "memory_snapshot",
]

# --------------------------------------------------------------------------- taking snapshots
def allocator_settings(config: AllocatorConfig | None = None) -> dict[str, Any]:
    """torch's ``allocator_settings`` dict of a snapshot, for ``config`` (default: the
    process's settings)."""
    cfg = config if config is not None else _registry.allocator_config()
    ms = cfg.max_split_size
    return {
        "PYTORCH_CUDA_ALLOC_CONF": cfg.text,
        "max_split_size": -1 if ms >= UNLIMITED else int(ms),  # torch: int64(SIZE_MAX)
        "garbage_collection_threshold": float(cfg.garbage_collection_threshold),
        "expandable_segments": bool(cfg.expandable_segments),
        "pinned_num_register_threads": int(cfg.pinned_num_register_threads),
        "release_lock_on_cudamalloc": bool(cfg.release_lock_on_cudamalloc),
        "pinned_use_cuda_host_register": bool(cfg.pinned_use_cuda_host_register),
        "graph_capture_record_stream_reuse": bool(cfg.graph_capture_record_stream_reuse),
        "roundup_power2_divisions": {k: int(v) for k, v in cfg.divisions_dict().items()},
    }


def _registry_allocators() -> list[Allocator]:
    return sorted(_registry.active, key=lambda a: a.device)


def _segments_of(allocators: list[Allocator], cache: FrameCache
                 ) -> tuple[list[dict[str, Any]], dict[int, int]]:
    """Segments of ``allocators`` (sorted by device, then address) with frames filled in
    from the history recorders, and the active bytes per device."""
    out: list[dict[str, Any]] = []
    active: dict[int, int] = {}
    for a in allocators:
        segs = a.segments()
        rec = _history.recorder_of(a)
        if rec is not None and (rec.blocks or rec.segs):
            blocks_fr = rec.blocks
            segs_fr = rec.segs
            to_dicts = _stacks.frames_to_dicts
            for seg in segs:
                fr = segs_fr.get(seg["address"])
                if fr:
                    seg["frames"] = to_dicts(fr, cache)
                for b in seg["blocks"]:
                    if b["state"] != "inactive":
                        fr = blocks_fr.get(b["address"])
                        if fr:
                            b["frames"] = to_dicts(fr, cache)
        active[a.device] = active.get(a.device, 0) + sum(s["active_size"] for s in segs)
        out.extend(segs)
    return out, active


def memory_snapshot(mempool_id: Any = None) -> list[dict[str, Any]]:
    """torch's ``memory_snapshot(mempool_id=None)``: every device's segments, as plain dicts
    and lists; with ``mempool_id``, only the segments of that private pool (each segment's
    ``segment_pool_id``; ``(0, 0)`` is the default pool)."""
    if mempool_id is not None:
        mempool_id = tuple(mempool_id) if isinstance(mempool_id, (tuple, list)) else mempool_id
        if mempool_id != (0, 0):
            mempool_id = check_pool_id(mempool_id, "mempool_id")
    segs, active = _segments_of(_registry_allocators(), {})
    if _history.is_recording():
        for dev, total in sorted(active.items()):
            _history.record_snapshot(dev, total)
    if mempool_id is not None:
        segs = [s for s in segs if s.get("segment_pool_id", (0, 0)) == mempool_id]
    return segs


def take_snapshot(device: Any = None, *, allocators: list[Allocator] | None = None
                  ) -> dict[str, Any]:
    """torch's ``torch.cuda.memory._snapshot()`` dict (all devices; ``device`` is accepted
    and ignored, as torch's). ``allocators`` (cudalab extension) takes the segments of the
    given allocators instead of the process's (e.g. private ones over their own backend)."""
    cache: FrameCache = {}
    allocs = _registry_allocators() if allocators is None else list(allocators)
    segments, active = _segments_of(allocs, cache)
    n = device_count() if _internal.is_initialized() else 0
    for d in _history.devices_with_history():
        n = max(n, d + 1)
    for a in allocs:
        n = max(n, a.device + 1)
    traces = [_history.trace_entries(d, cache) for d in range(n)]
    # As torch: each device's trace is read first, then the snapshot entry is recorded, so
    # the snapshot's own trace ends with the last allocator event, not with itself.
    if _history.is_recording():
        for dev, total in sorted(active.items()):
            _history.record_snapshot(dev, total)
    config = None
    if allocators is not None and allocs and isinstance(getattr(allocs[0], "config", None),
                                                         AllocatorConfig):
        config = allocs[0].config
    return {
        "segments": segments,
        "device_traces": traces,
        "allocator_settings": allocator_settings(config),
        "external_annotations": [],
        "identity": Identity.current(allocator="cudalab").to_dict(),
        # cudalab's: each device's total memory (what the autotuner models), [] before CUDA
        "device_memory": [int(get_device_properties(d).total_memory)
                          for d in range(device_count() if _internal.is_initialized() else 0)],
    }


#: torch's name for :func:`take_snapshot` (``torch.cuda.memory._snapshot``), which
#: :mod:`cudalab.memory` re-exports; the same function object, so the two cannot drift.
_snapshot = take_snapshot


# --------------------------------------------------------------------------- writing
def _dump_snapshot(filename: str | os.PathLike[str] = "dump_snapshot.pickle") -> None:
    """torch's ``_dump_snapshot``: pickle :func:`_snapshot` to ``filename`` (protocol 4),
    for https://pytorch.org/memory_viz and ``torch.cuda._memory_viz``.

    The file is replaced atomically (:func:`cudalab._internal.atomic_write`): when pickling
    or writing fails, a file that was there before is left intact.

    Raises
    ------
    TypeError
        The snapshot holds a value that is not plain data (the message says where).
    OSError
        The file cannot be written.
    """
    _internal.write_bytes_atomic(filename, dumps_snapshot(_snapshot()))


def export_memory_viz(path: str | os.PathLike[str] = "memory_snapshot.pickle") -> str:
    """:func:`_dump_snapshot` under a friendlier name; returns the path written. Open the
    file at https://pytorch.org/memory_viz (it is read in the browser, not uploaded)."""
    _dump_snapshot(path)
    return os.fspath(path)
