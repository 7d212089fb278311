"""Synthetic snapshots for tests and benchmarks: self-consistent, in torch's schema."""

from __future__ import annotations

import random
from operator import itemgetter

__all__ = ["synthetic_snapshot"]


_SYN_FILES = ("train.py", "model.py", "layers.py", "optim.py", "data.py")
_SYN_FUNCS = ("forward", "backward", "step", "__call__", "matmul", "attention", "collate")


def synthetic_snapshot(n_entries: int, *, devices: int = 1, streams: tuple[int, ...] = (0, 0x5A1E0),
                        seed: int = 0, cudalab_keys: bool = True, simulated: bool = True,
                        start_us: int = 1_700_000_000_000_000, oom_every: int = 50_000,
                        snapshot_every: int = 20_000) -> dict:
    """A self-consistent snapshot dict in torch's schema with about ``n_entries`` trace
    entries per device (for tests and benchmarks).

    A bump allocator per (stream, pool) carves 512-B-rounded blocks out of 2 MiB small and
    >= 20 MiB large segments; frees are random; an emptied segment is sometimes released;
    ``oom`` and ``snapshot`` entries appear every so often. The final ``segments`` list holds
    the live blocks and the gaps between them. ``cudalab_keys=False`` leaves out the keys
    torch lacks (``device``, ``nvtx_range``, ``cell``, ``"cudalab"``).
    """
    rng = random.Random(seed)
    rnd = rng.random
    stacks = []
    for k in range(40):
        depth = 1 + k % 4
        stacks.append([{"filename": f"/home/user/proj/{_SYN_FILES[(k + j) % 5]}",
                        "line": 10 + 7 * k + j, "name": _SYN_FUNCS[(k * 3 + j) % 7]}
                       for j in range(depth)])
    stacks.append([])  # some entries without frames
    n_stacks = len(stacks)
    ranges = (None, "forward", "backward", "optimizer")
    cells = (None, "cell-1", "cell-2")
    n_streams = len(streams)
    out_traces: list[list[dict]] = []
    out_segments: list[dict] = []
    for d in range(devices):
        trace: list[dict] = []
        add = trace.append
        now = start_us + d * 3
        next_addr = 0x7F0000000000 + (d << 36)
        segs: dict[int, dict] = {}  # address -> segment
        open_seg: dict[tuple[int, bool], dict] = {}
        cached: dict[tuple[int, bool], list] = {}  # emptied segments kept for reuse
        live_addrs: list[int] = []
        live: dict[int, tuple] = {}  # addr -> (requested, size, stream, frames, segment)
        target = 200 + int(rnd() * 800)
        p_snap = 1.0 / snapshot_every if snapshot_every else -1.0
        p_oom = 1.0 / oom_every if oom_every else -1.0

        def entry(action, addr, size, stream, frames):
            if cudalab_keys:
                u = rnd()
                e = {"action": action, "addr": addr, "size": size, "stream": stream,
                     "time_us": now, "frames": frames, "compile_context": "",  # noqa: B023
                     "user_metadata": "", "device": d, "nvtx_range": ranges[int(u * 4)],  # noqa: B023
                     "cell": cells[int(u * 12) % 3]}
            else:
                e = {"action": action, "addr": addr, "size": size, "stream": stream,
                     "time_us": now, "frames": frames, "compile_context": "",  # noqa: B023
                     "user_metadata": ""}
            add(e)  # noqa: B023
            return e

        while len(trace) < n_entries:
            now += 1 + int(rnd() * 20)
            frames = stacks[int(rnd() * n_stacks)]
            r = rnd()
            if r < p_snap:
                entry("snapshot", 0, 0, 0, [])
                continue
            if r > 1.0 - p_oom:
                e = entry("oom", 0, 1 << (30 + int(rnd() * 4)), streams[int(rnd() * n_streams)],
                          frames)
                e["device_free"] = e.pop("addr") + int(rnd() * (1 << 30))
                continue
            if live_addrs and (len(live_addrs) > target or r < 0.45):
                k = int(rnd() * len(live_addrs))
                addr = live_addrs[k]
                live_addrs[k] = live_addrs[-1]
                live_addrs.pop()
                req, size, st, fr, seg = live.pop(addr)
                entry("free_requested", addr, req, st, fr)
                entry("free_completed", addr, req, st, fr)
                seg["live"] -= 1
                if seg["live"] == 0:  # the blocks merge back into one free block
                    seg["used"] = 0
                    if open_seg.get(seg["key"]) is not seg:
                        if rnd() < 0.3:
                            entry("segment_free", seg["address"], seg["total_size"], seg["stream"],
                                  [])
                            del segs[seg["address"]]
                        else:  # cached: reused by a later allocation
                            cached.setdefault(seg["key"], []).append(seg)
                if rnd() < 0.0002:
                    target = 200 + int(rnd() * 800)
                continue
            small = rnd() < 0.7  # log-uniform sizes: 512 B..1 MiB small, 1..64 MiB large
            req = int(2.0 ** (9 + 11 * rnd())) if small else int(2.0 ** (20 + 6 * rnd()))
            size = (req + 511) // 512 * 512
            st = streams[int(rnd() * n_streams)]
            key = (st, small)
            seg = open_seg.get(key)
            if seg is None or seg["used"] + size > seg["total_size"] or seg["address"] not in segs:
                pool = cached.get(key)
                while pool:
                    seg = pool.pop()
                    if seg["address"] in segs and seg["live"] == 0 and seg["total_size"] >= size:
                        open_seg[key] = seg
                        break
                    seg = None
                else:
                    seg = None
            if seg is None:
                total = (2 << 20) if small else max(20 << 20, -(-size // (2 << 20)) * (2 << 20))
                seg = {"address": next_addr, "total_size": total, "used": 0, "live": 0,
                       "stream": st, "key": key}
                next_addr += total + (2 << 20)
                segs[seg["address"]] = seg
                open_seg[key] = seg
                entry("segment_alloc", seg["address"], total, st, frames)
            addr = seg["address"] + seg["used"]
            seg["used"] += size
            seg["live"] += 1
            live[addr] = (req, size, st, frames, seg)
            live_addrs.append(addr)
            entry("alloc", addr, req, st, frames)
        out_traces.append(trace)
        # final segment state: live blocks plus the gaps between them
        by_seg: dict[int, list] = {}
        for addr, (req, size, _st, fr, seg) in live.items():
            by_seg.setdefault(seg["address"], []).append((addr, size, req, fr))
        for base in sorted(segs):
            seg = segs[base]
            blocks = []
            cur = base
            alloc_sz = req_sz = 0
            for addr, size, req, fr in sorted(by_seg.get(base, []), key=itemgetter(0)):
                if addr > cur:
                    blocks.append({"address": cur, "size": addr - cur, "requested_size": 0,
                                   "state": "inactive", "frames": []})
                blocks.append({"address": addr, "size": size, "requested_size": req,
                               "state": "active_allocated", "frames": fr})
                alloc_sz += size
                req_sz += req
                cur = addr + size
            end = base + seg["total_size"]
            if cur < end:
                blocks.append({"address": cur, "size": end - cur, "requested_size": 0,
                               "state": "inactive", "frames": []})
            out_segments.append({
                "device": d, "address": base, "total_size": seg["total_size"],
                "allocated_size": alloc_sz, "active_size": alloc_sz, "requested_size": req_sz,
                "stream": seg["stream"], "segment_type": "small" if seg["key"][1] else "large",
                "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
                "blocks": blocks,
            })
    snap = {"segments": out_segments, "device_traces": out_traces,
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": None, "max_split_size": -1,
                                   "garbage_collection_threshold": 0.0,
                                   "expandable_segments": False, "pinned_num_register_threads": 1,
                                   "release_lock_on_cudamalloc": False,
                                   "pinned_use_host_register": False,
                                   "roundup_power2_divisions": {}},
            "external_annotations": []}
    if cudalab_keys:
        snap["cudalab"] = {"simulated": simulated}
    return snap
