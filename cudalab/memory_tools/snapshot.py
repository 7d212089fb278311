"""Memory snapshots in torch's format, and a loader that never runs code from the file.

* :func:`memory_snapshot` — torch's ``memory_snapshot()``: the segments of every device
  (blocks carry the stack of their allocation while history is recorded with a context).
* :func:`_snapshot` — torch's ``torch.cuda.memory._snapshot()`` dict: ``segments``,
  ``device_traces`` (one list of trace entries per device, from the history ring buffers of
  :mod:`cudalab.memory_tools.history`), ``allocator_settings`` (torch's keys) and
  ``external_annotations``. While history is recorded, taking a snapshot appends a
  ``snapshot`` entry to each device's trace (as torch's).
* :func:`_dump_snapshot` / :func:`export_memory_viz` — that dict pickled with protocol 4 and
  plain Python types only (dict, list, tuple, str, int, float, bool, None), which is what
  pytorch.org/memory_viz's own unpickler and ``torch.cuda._memory_viz`` read.
* :func:`load_snapshot` — reads cudalab's and torch's snapshot pickles with a restricted
  unpickler: any reference to a class or function (GLOBAL, STACK_GLOBAL, INST, OBJ, EXT*,
  persistent ids) is refused with :class:`SnapshotLoadError`, so a file from a stranger cannot
  execute code.

Trace entries carry torch's keys plus cudalab's ``device``, ``nvtx_range`` and ``cell``;
torch's own snapshots lack those three, so readers treat them as optional.
"""

from __future__ import annotations

import io
import numbers
import os
import pickle
from typing import Any

from cudalab import devices as _devices
from cudalab.allocator import allocator as _alloc
from cudalab.memory_tools import history as _history
from cudalab.allocator.config import UNLIMITED, AllocatorConfig

__all__ = [
    "PICKLE_PROTOCOL",
    "SnapshotLoadError",
    "_dump_snapshot",
    "_snapshot",
    "allocator_settings",
    "dumps_snapshot",
    "export_memory_viz",
    "load_snapshot",
    "memory_snapshot",
    "to_plain",
]

#: memory_viz's unpickler reads protocols 2 to 4 (newer copies also 5).
PICKLE_PROTOCOL = 4


class SnapshotLoadError(ValueError):
    """A file is not a loadable memory snapshot (refused, truncated, corrupt, wrong content)."""


# --------------------------------------------------------------------------- taking snapshots
def allocator_settings(config: AllocatorConfig | None = None) -> dict:
    """torch's ``allocator_settings`` dict of a snapshot, for ``config`` (default: the
    process's settings)."""
    cfg = config if config is not None else _alloc.allocator_config()
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


def _registry_allocators() -> list:
    return sorted(_alloc._active, key=lambda a: a.device)


def _segments_of(allocators: list, cache: dict) -> tuple[list[dict], dict[int, int]]:
    """Segments of ``allocators`` (sorted by device, then address) with frames filled in
    from the history recorders, and the active bytes per device."""
    out: list[dict] = []
    active: dict[int, int] = {}
    for a in allocators:
        segs = a.segments()
        rec = _history.recorder_of(a)
        if rec is not None and (rec.blocks or rec.segs):
            blocks_fr = rec.blocks
            segs_fr = rec.segs
            to_dicts = _history.frames_to_dicts
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


def memory_snapshot() -> list[dict]:
    """torch's ``memory_snapshot()``: every device's segments, as plain dicts and lists."""
    segs, active = _segments_of(_registry_allocators(), {})
    if _history.is_recording():
        for dev, total in sorted(active.items()):
            _history._record_snapshot(dev, total)
    return segs


def _snapshot(device: Any = None, *, allocators: list | None = None) -> dict:
    """torch's ``torch.cuda.memory._snapshot()`` dict (all devices; ``device`` is accepted
    and ignored, as torch's). ``allocators`` (cudalab extension) takes the segments of the
    given allocators instead of the process's (e.g. private ones over their own backend)."""
    cache: dict = {}
    allocs = _registry_allocators() if allocators is None else list(allocators)
    segments, active = _segments_of(allocs, cache)
    if _history.is_recording():
        for dev, total in sorted(active.items()):
            _history._record_snapshot(dev, total)
    n = _devices._count if _devices._initialized else 0
    for d in _history.devices_with_history():
        n = max(n, d + 1)
    for a in allocs:
        n = max(n, a.device + 1)
    traces = [_history.trace_entries(d, cache) for d in range(n)]
    config = None
    if allocators is not None and allocs and isinstance(getattr(allocs[0], "config", None),
                                                         AllocatorConfig):
        config = allocs[0].config
    return {
        "segments": segments,
        "device_traces": traces,
        "allocator_settings": allocator_settings(config),
        "external_annotations": [],
    }


# --------------------------------------------------------------------------- plain types
class _NotPlain(TypeError):
    def __init__(self, value: Any):
        self.value = value
        self.path: list[str] = []
        super().__init__()

    def __str__(self) -> str:
        where = "".join(reversed(self.path)) or "the top level"
        return (f"snapshot value at {where} has type {type(self.value).__module__}."
                f"{type(self.value).__qualname__} ({self.value!r:.60}); a snapshot may hold "
                "only dict, list, tuple, str, int, float, bool and None")


def _scalar(x: Any) -> Any:
    """A plain scalar for ``x`` (numpy scalars, int/str subclasses) or raise _NotPlain."""
    if isinstance(x, bool):
        return bool(x)
    if type(x).__module__ == "numpy" and hasattr(x, "item"):  # numpy scalars
        v = x.item()
        if type(v) in (int, float, bool, str):
            return v
        raise _NotPlain(x)
    if isinstance(x, numbers.Integral):
        return int(x)
    if isinstance(x, numbers.Real):
        return float(x)
    if isinstance(x, str):
        return str(x)
    raise _NotPlain(x)


_SCALARS = frozenset({str, int, float, bool, type(None)})


def to_plain(obj: Any) -> Any:
    """``obj`` with only dict/list/tuple/str/int/float/bool/None inside: numpy numbers and
    subclasses of int/float/str/bool are converted (containers are copied only where
    something changed; shared sub-objects stay shared); anything else raises TypeError
    naming where it is."""
    memo: dict[int, Any] = {}
    scalars = _SCALARS

    def walk(x: Any) -> Any:
        t = type(x)
        if t in scalars:
            return x
        if t is not dict and t is not list and t is not tuple:
            return _scalar(x)
        got = memo.get(id(x))
        if got is not None:
            return got[1]
        out = x
        if t is dict:
            new = None
            for i, (k, v) in enumerate(x.items()):
                if type(k) in scalars and type(v) in scalars:
                    if new is not None:
                        new.append((k, v))
                    continue
                try:
                    nk = walk(k)
                    nv = walk(v)
                except _NotPlain as e:
                    e.path.append(f"[{k!r}]")
                    raise
                if new is None and (nk is not k or nv is not v):
                    new = list(x.items())[:i]
                if new is not None:
                    new.append((nk, nv))
            if new is not None:
                out = dict(new)
        else:
            new = None
            for i, v in enumerate(x):
                if type(v) in scalars:
                    if new is not None:
                        new.append(v)
                    continue
                try:
                    nv = walk(v)
                except _NotPlain as e:
                    e.path.append(f"[{i}]")
                    raise
                if new is None and nv is not v:
                    new = list(x[:i])
                if new is not None:
                    new.append(nv)
            if new is not None:
                out = new if t is list else tuple(new)
        memo[id(x)] = (x, out)
        return out

    return walk(obj)


def dumps_snapshot(snapshot: dict) -> bytes:
    """``snapshot`` pickled for memory_viz (plain types, protocol 4); any snapshot-like
    dict, checked and converted by :func:`to_plain` first."""
    return pickle.dumps(to_plain(snapshot), protocol=PICKLE_PROTOCOL)


class _PlainPickler(pickle.Pickler):
    """Pickles the exact builtin types as usual; the C pickler consults
    ``reducer_override`` for nothing else, so plain data costs no check at all."""

    def reducer_override(self, obj: Any) -> Any:
        raise _NotPlain(obj)


def _dumps_own(snapshot: dict) -> bytes:
    """Pickle a snapshot cudalab built (dicts, lists, tuples, str, int, float, bool, None by
    construction): straight away, converting with :func:`to_plain` only if something else
    (a numpy integer from a pluggable allocator, say) turns up."""
    buf = io.BytesIO()
    try:
        _PlainPickler(buf, protocol=PICKLE_PROTOCOL).dump(snapshot)
    except _NotPlain:
        return dumps_snapshot(snapshot)
    return buf.getvalue()


def _dump_snapshot(filename: str | os.PathLike = "dump_snapshot.pickle") -> None:
    """torch's ``_dump_snapshot``: pickle :func:`_snapshot` to ``filename`` (protocol 4),
    for https://pytorch.org/memory_viz and ``torch.cuda._memory_viz``."""
    data = _dumps_own(_snapshot())
    with open(filename, "wb") as f:
        f.write(data)


def export_memory_viz(path: str | os.PathLike = "memory_snapshot.pickle") -> str:
    """:func:`_dump_snapshot` under a friendlier name; returns the path written. Open the
    file at https://pytorch.org/memory_viz (it is read in the browser, not uploaded)."""
    _dump_snapshot(path)
    return os.fspath(path)


# --------------------------------------------------------------------------- loading
class _RestrictedUnpickler(pickle.Unpickler):
    """Builds only what pickle opcodes build by themselves: no classes, no functions."""

    def __init__(self, file: Any, what: str):
        super().__init__(file)
        self._what = what

    def find_class(self, module: str, name: str) -> Any:
        raise SnapshotLoadError(
            f"refusing to load {self._what}: the pickle references {module}.{name}; "
            "snapshots contain only plain data")

    def persistent_load(self, pid: Any) -> Any:
        raise SnapshotLoadError(
            f"refusing to load {self._what}: the pickle uses a persistent id ({pid!r:.60}); "
            "snapshots contain only plain data")


def _read(path_or_file: Any) -> tuple[bytes, str]:
    if hasattr(path_or_file, "read"):
        name = getattr(path_or_file, "name", None)
        what = f"snapshot {name!r}" if isinstance(name, str) else "the snapshot file object"
        data = path_or_file.read()
        if isinstance(data, str):
            raise SnapshotLoadError(f"cannot read {what}: open the file in binary mode ('rb')")
        return bytes(data), what
    if isinstance(path_or_file, (str, bytes, os.PathLike)):
        what = f"snapshot {os.fsdecode(path_or_file)!r}"
        with open(path_or_file, "rb") as f:
            return f.read(), what
    raise TypeError("load_snapshot() takes a path or a binary file object, got "
                    f"{type(path_or_file).__name__}")


def load_snapshot(path_or_file: Any) -> dict:
    """Read a memory snapshot pickle (cudalab's ``_dump_snapshot`` or torch's) safely.

    The unpickler refuses every reference to a class or function, so loading a file from a
    stranger cannot run code; such a file raises :class:`SnapshotLoadError` (a ValueError),
    as do truncated or corrupt files and pickles that are not snapshots. A pickled
    ``memory_snapshot()`` list of segments is accepted and wrapped into the dict form.
    Missing ``device_traces`` is filled with ``[]``.
    """
    data, what = _read(path_or_file)
    if not data:
        raise SnapshotLoadError(f"cannot read {what}: the file is empty")
    try:
        obj = _RestrictedUnpickler(io.BytesIO(data), what).load()
    except SnapshotLoadError:
        raise
    except RecursionError:
        raise SnapshotLoadError(f"cannot read {what}: nested too deeply") from None
    except Exception as exc:  # noqa: BLE001 - every unpickling failure means the same here
        raise SnapshotLoadError(
            f"cannot read {what}: truncated or corrupt pickle ({type(exc).__name__}: {exc})"
        ) from exc
    if isinstance(obj, list) and all(isinstance(s, dict) and "blocks" in s for s in obj):
        obj = {"segments": obj, "device_traces": []}
    if not isinstance(obj, dict) or not isinstance(obj.get("segments"), list):
        got = f"a dict with keys {sorted(map(str, obj))[:8]}" if isinstance(obj, dict) \
            else f"a {type(obj).__name__}"
        raise SnapshotLoadError(
            f"{what} is not a memory snapshot: expected a dict with a 'segments' list (as "
            f"written by cudalab.memory._dump_snapshot or torch.cuda.memory._dump_snapshot), "
            f"got {got}")
    traces = obj.setdefault("device_traces", [])
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise SnapshotLoadError(f"{what} is not a memory snapshot: 'device_traces' must be a "
                                "list of lists of trace entries")
    return obj
