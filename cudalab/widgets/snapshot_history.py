"""A snapshot's history for :class:`~cudalab.widgets.SnapshotViewer`'s scrubber: the
active-memory timeline from its ``device_traces``, and the allocator state after any entry,
rebuilt by undoing the later entries from the final snapshot (as memory_viz does), with
checkpoints so scrubbing stays fast."""

from __future__ import annotations

import bisect

import numpy as np

from cudalab.memory_tools.plot import filter_segments, segment_pool
from cudalab.memory_tools.snapshot_check import check_trace_entries

__all__ = ["SnapshotHistory"]

_SMALL_SEGMENT = 2 << 20
_SMALL_REQUEST = 1 << 20


class SnapshotHistory:
    """The snapshot's trace entries in one time order across devices, and the allocator
    state after any entry (the final snapshot with the later entries undone)."""

    CHECKPOINT = 2000

    def __init__(self, snap: dict):
        traces = snap.get("device_traces") or []
        for d, trace in enumerate(traces):  # SnapshotLoadError naming a malformed entry
            check_trace_entries(trace, f"device_traces[{d}]", "snapshot")
        keyed = [(e.get("time_us", 0), d, j) for d, tr in enumerate(traces) for j, e in enumerate(tr)]
        keyed.sort(key=lambda x: x[0])
        self.entries: list[dict] = [traces[d][j] for _, d, j in keyed]
        self.dev = np.array([d for _, d, _ in keyed], np.int64)
        self.n = len(self.entries)
        e = self.entries
        self.time_us = np.array([x[0] for x in keyed], np.int64)
        self.action = [x.get("action", "") for x in e]
        self.size = np.array([x.get("size", 0) for x in e], np.int64)
        self.stream = np.array([x.get("stream", 0) for x in e], dtype=np.float64)  # handles can be > 2^63
        self.segments = snap.get("segments") or []
        self._final_segs, self._final_blocks = self._final_state()
        self._checkpoints: dict[int, tuple[dict, dict]] | None = None

    # ------------------------------------------------------------ timeline
    def totals(self, device: int | None, stream: int | None, pool: str | None
               ) -> tuple[np.ndarray, np.ndarray]:
        """Running allocated and reserved bytes after each entry (lifted so that they never
        dip below 0 and end at the filtered snapshot's values)."""
        act = self.action
        a_delta = np.zeros(self.n, np.int64)
        r_delta = np.zeros(self.n, np.int64)
        size = self.size
        for i, name in enumerate(act):
            if name == "alloc":
                a_delta[i] = size[i]
            elif name == "free_completed":
                a_delta[i] = -size[i]
            elif name in ("segment_alloc", "segment_map"):
                r_delta[i] = size[i]
            elif name in ("segment_free", "segment_unmap"):
                r_delta[i] = -size[i]
        mask = np.ones(self.n, bool)
        if device is not None:
            mask &= self.dev == device
        if stream is not None:
            mask &= self.stream == float(stream)
        # the private pool of each entry (the history tags them: segment_pool_id)
        private = [segment_pool({"segment_pool_id": e["segment_pool_id"]})
                   if e.get("segment_pool_id") else None for e in self.entries]
        if pool in ("small", "large"):
            seg_entry = r_delta != 0
            small = np.where(seg_entry, size == _SMALL_SEGMENT, size <= _SMALL_REQUEST)
            mask &= small if pool == "small" else ~small
            mask &= np.array([p is None for p in private], bool)
        elif pool is not None:  # a graph or user pool: the entries tagged with it
            mask &= np.array([p == pool for p in private], bool)
        alloc = np.cumsum(np.where(mask, a_delta, 0))
        res = np.cumsum(np.where(mask, r_delta, 0))
        segs = filter_segments({"segments": self.segments}, device, stream, pool)
        end_a = sum(b.get("requested_size") or b["size"] for s in segs for b in s.get("blocks") or ()
                    if b.get("state") != "inactive")
        end_r = sum(s.get("total_size", 0) for s in segs)
        for arr, end in ((alloc, end_a), (res, end_r)):
            if arr.size:
                lift = max(0, -int(arr.min()), end - int(arr[-1]))
                arr += lift
        return alloc, res

    # ------------------------------------------------------------ state at an entry
    def _final_state(self) -> tuple[dict, dict]:
        segs: dict = {}
        blocks: dict = {}
        for s in self.segments:
            d = s.get("device", 0)
            segs[(d, s["address"])] = {k: v for k, v in s.items() if k != "blocks"}
            for b in s.get("blocks") or ():
                if b.get("state") != "inactive":
                    blocks[(d, b["address"])] = dict(b, stream=s.get("stream", 0))
        return segs, blocks

    def _undo(self, i: int, segs: dict, blocks: dict) -> None:
        e = self.entries[i]
        act = e.get("action")
        d = int(self.dev[i])
        addr = e.get("addr", 0)
        key = (d, addr)
        if act == "alloc":
            blocks.pop(key, None)
        elif act == "free_requested":
            b = blocks.get(key)
            if b is not None:
                blocks[key] = dict(b, state="active_allocated")
        elif act == "free_completed":
            size = e.get("size", 0)
            blocks[key] = {"address": addr, "size": size, "requested_size": size,
                           "state": "active_pending_free", "stream": e.get("stream", 0),
                           "frames": e.get("frames") or []}
        elif act == "segment_alloc":
            segs.pop(key, None)
        elif act == "segment_free":
            size = e.get("size", 0)
            segs[key] = {"device": d, "address": addr, "total_size": size,
                         "stream": e.get("stream", 0),
                         "segment_type": "small" if size == _SMALL_SEGMENT else "large",
                         "segment_pool_id": tuple(e.get("segment_pool_id") or (0, 0)),
                         "frames": e.get("frames") or []}
        elif act in ("segment_map", "segment_unmap"):  # expandable segments grow/shrink at the end
            size = e.get("size", 0)
            for (sd, sa), s in list(segs.items()):
                if sd == d and sa <= addr <= sa + s["total_size"]:
                    grow = -size if act == "segment_map" else size
                    segs[(sd, sa)] = dict(s, total_size=max(s["total_size"] + grow, 0))
                    break

    def _ensure_checkpoints(self) -> dict[int, tuple[dict, dict]]:
        if self._checkpoints is None:
            cps = {self.n: (self._final_segs, self._final_blocks)}
            segs, blocks = dict(self._final_segs), dict(self._final_blocks)
            for i in range(self.n - 1, -1, -1):
                self._undo(i, segs, blocks)
                if i % self.CHECKPOINT == 0:
                    cps[i] = (dict(segs), dict(blocks))
            self._checkpoints = cps
        return self._checkpoints

    def state_at(self, i: int) -> list[dict]:
        """The segments (blocks included) after the first ``i`` entries."""
        if i >= self.n:
            return self.segments
        cps = self._ensure_checkpoints()
        c = min(k for k in cps if k >= i)
        segs, blocks = dict(cps[c][0]), dict(cps[c][1])
        for j in range(c - 1, i - 1, -1):
            self._undo(j, segs, blocks)
        return _assemble(segs, blocks)


def _assemble(segs: dict, blocks: dict) -> list[dict]:
    """Segment dicts with their blocks (those whose address falls inside them)."""
    by_dev: dict[int, list] = {}
    for (d, a), s in segs.items():
        by_dev.setdefault(d, []).append((a, s))
    out_by_key: dict = {}
    starts: dict[int, list[int]] = {}
    for d, lst in by_dev.items():
        lst.sort(key=lambda x: x[0])
        starts[d] = [a for a, _ in lst]
        for a, s in lst:
            out_by_key[(d, a)] = dict(s, device=d, blocks=[])
    for (d, a), b in blocks.items():
        st = starts.get(d)
        if not st:
            continue
        k = bisect.bisect_right(st, a) - 1
        if k < 0:
            continue
        seg = out_by_key[(d, st[k])]
        if a < st[k] + seg["total_size"]:
            seg["blocks"].append(b)
    for seg in out_by_key.values():
        seg["blocks"].sort(key=lambda b: b["address"])
    return [out_by_key[k] for k in sorted(out_by_key)]

