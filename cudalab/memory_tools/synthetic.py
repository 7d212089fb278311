"""Synthetic traces for tests and benchmarks.

* :func:`synthetic_snapshot`: a self-consistent snapshot dict in torch's schema (random
  training-like traffic), for the snapshot, export and viewer tools.
* :func:`ragged_inference_workload`: a ragged-batch LLM inference workload (long-tailed
  sequence lengths, KV caches grown per request, LIFO activations) driven through any
  allocate/free pair: cudalab's own arrays to record a real trace, or
  :func:`ragged_inference_trace`'s address model for a trace without a device.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable
from operator import itemgetter
from typing import Any

__all__ = ["BATCHING_CONTINUOUS", "BATCHING_STATIC", "SINK_CHUNK", "ragged_inference_trace",
           "ragged_inference_workload", "synthetic_snapshot", "write_synthetic_pickle"]

#: Entries per call of ``synthetic_snapshot``'s ``sink``.
SINK_CHUNK = 65_536


_SYN_FILES = ("train.py", "model.py", "layers.py", "optim.py", "data.py")
_SYN_FUNCS = ("forward", "backward", "step", "__call__", "matmul", "attention", "collate")


def synthetic_snapshot(n_entries: int, *, devices: int = 1, streams: tuple[int, ...] = (0, 0x5A1E0),
                        seed: int = 0, cudalab_keys: bool = True, simulated: bool = True,
                        start_us: int = 1_700_000_000_000_000, oom_every: int = 50_000,
                        snapshot_every: int = 20_000,
                        sink: Callable[[int, list[dict[str, Any]]], Any] | None = None,
                        ) -> dict[str, Any]:
    """A self-consistent snapshot dict in torch's schema with about ``n_entries`` trace
    entries per device (for tests and benchmarks).

    ``sink`` (for traces too large to hold as dicts, see :func:`write_synthetic_pickle`):
    called as ``sink(device, entries)`` with each device's entries in order, in chunks of
    :data:`SINK_CHUNK`, which are then dropped (the snapshot's traces are empty lists).

    A bump allocator per (stream, pool) carves 512-B-rounded blocks out of 2 MiB small and
    >= 20 MiB large segments; frees are random; an emptied segment is sometimes released;
    ``oom`` and ``snapshot`` entries appear every so often. The final ``segments`` list holds
    the live blocks and the gaps between them. ``cudalab_keys=False`` leaves out the keys
    torch lacks (``device``, ``nvtx_range``, ``cell``, ``"cudalab"``).
    """
    rng = random.Random(seed)
    rnd = rng.random
    stacks: list[list[dict[str, Any]]] = []
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
    out_traces: list[list[dict[str, Any]]] = []
    out_segments: list[dict[str, Any]] = []
    for d in range(devices):
        trace: list[dict[str, Any]] = []
        add = trace.append
        flushed = 0
        now = start_us + d * 3
        next_addr = 0x7F0000000000 + (d << 36)
        segs: dict[int, dict[str, Any]] = {}  # address -> segment
        open_seg: dict[tuple[int, bool], dict[str, Any]] = {}
        # emptied segments kept for reuse
        cached: dict[tuple[int, bool], list[dict[str, Any]]] = {}
        live_addrs: list[int] = []
        # addr -> (requested, size, stream, frames, segment)
        live: dict[int, tuple[int, int, int, list[dict[str, Any]], dict[str, Any]]] = {}
        target = 200 + int(rnd() * 800)
        p_snap = 1.0 / snapshot_every if snapshot_every else -1.0
        p_oom = 1.0 / oom_every if oom_every else -1.0

        def entry(action: str, addr: int, size: int, stream: int,
                  frames: list[dict[str, Any]]) -> dict[str, Any]:
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

        seg: dict[str, Any] | None
        while flushed + len(trace) < n_entries:
            if sink is not None and len(trace) >= SINK_CHUNK:
                sink(d, trace[:])
                flushed += len(trace)
                trace.clear()  # (add is trace.append: the same list)
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
        if sink is not None:
            if trace:
                sink(d, trace[:])
            trace = []
        out_traces.append(trace)
        # final segment state: live blocks plus the gaps between them
        by_seg: dict[int, list[tuple[int, int, int, list[dict[str, Any]]]]] = {}
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


def write_synthetic_pickle(path: str | os.PathLike[str], n_entries: int, *,
                           torch_frames: bool = True, **options: Any) -> int:
    """Write :func:`synthetic_snapshot`'s snapshot to ``path`` without holding its entries
    (memory stays at one chunk of :data:`SINK_CHUNK` entries, so a 10M-entry, ~1 GB trace
    fits on a small machine). ``torch_frames``: a new frames list per entry, as torch's own
    pickles have; ``options`` are :func:`synthetic_snapshot`'s. Returns the bytes written.

    The file is a plain-data pickle of protocol 2 (memo indices explicit, so each chunk is
    pickled on its own and spliced in: the chunk's list becomes a DUP of the device's trace
    list, which its APPENDS then fill), with the device traces before the other keys.
    """
    import pickle

    def body(obj: Any) -> bytes:
        data = pickle.dumps(obj, protocol=2)
        assert data[:2] == b"\x80\x02" and data[-1:] == b"."
        return data[2:-1]

    written = 0
    state = {"device": -1}
    with open(path, "wb") as out:

        def emit(data: bytes) -> None:
            nonlocal written
            out.write(data)
            written += len(data)

        def sink(d: int, entries: list[dict[str, Any]]) -> None:
            if torch_frames:
                entries = [dict(e, frames=list(e["frames"])) for e in entries]
            if d != state["device"]:
                if state["device"] >= 0:
                    emit(b"a")  # the previous device's list goes into the outer list
                emit(b"]")  # this device's list, kept on the stack
                state["device"] = d
            chunk = body(entries)
            assert chunk[:1] == b"]"
            emit(b"2" + chunk[1:] + b"0")  # DUP the trace list, fill it, POP the copy

        # {"device_traces": [[...], ...], <the other keys>}
        emit(b"\x80\x02}(X\r\x00\x00\x00device_traces]")
        snap = synthetic_snapshot(n_entries, sink=sink, **options)
        if state["device"] >= 0:
            emit(b"a")
        emit(b"u")  # outer["device_traces"] = the outer list
        rest = body({k: v for k, v in snap.items() if k != "device_traces"})
        assert rest[:1] == b"}"
        emit(rest[1:] + b".")  # (its BINPUT and SETITEMS batches go into the outer dict)
    return written


# ====================================================================== ragged inference
#: Bytes per element of the ragged workload's tensors (fp16/bf16 activations and KV cache).
_ELEMENT_BYTES = 2
#: ``batching`` of :func:`ragged_inference_workload`: requests join and leave at every step.
BATCHING_CONTINUOUS = "continuous"
#: ``batching`` of :func:`ragged_inference_workload`: padded batches run to their end.
BATCHING_STATIC = "static"
#: Bytes per element of the logits (computed in fp32 for sampling, as Hugging Face does).
_LOGIT_BYTES = 4


class _Request:
    """One request of the ragged workload."""

    __slots__ = ("cached", "remaining", "rows", "caches", "prefill")

    def __init__(self, prompt: int, new_tokens: int, rows: int):
        self.rows = rows  # sequences: 1, or a static batch padded to one length
        self.cached = prompt  # tokens per row in the KV cache (after this step's prefill)
        self.remaining = new_tokens  # tokens still to generate (> 0 while active)
        self.caches: list[tuple[Any, Any]] = []  # (K, V) blocks per layer, once prefilled
        self.prefill = True  # admitted in the current step: its prompt is processed now


def ragged_inference_workload(allocate: Callable[[int], Any], free: Callable[[Any], None], *,
                              steps: int = 400, seed: int = 0, layers: int = 4,
                              hidden: int = 4096, kv_dim: int = 1024, vocab: int = 32000,
                              max_batch: int = 16, arrival_rate: float = 0.8,
                              max_prompt: int = 4096, max_new_tokens: int = 1024,
                              batching: str = "continuous") -> dict[str, int]:
    """Drive a ragged-batch LLM inference workload through ``allocate`` / ``free``.

    A decoder without a paged KV cache (Hugging Face's ``DynamicCache`` pattern): requests
    arrive at random, each with a prompt length and a generation length drawn from
    long-tailed (log-normal) distributions. With ``batching="continuous"`` at most
    ``max_batch`` run at a time and a finished request's place is taken at the next step, so
    the batch size and the sequence lengths change at every step; each request owns one K and
    one V tensor per layer. With ``batching="static"`` (offline batch inference) a
    batch of 1 to ``max_batch`` requests (uniformly drawn) is padded to its longest prompt
    and runs until its longest generation ends (``generate()`` on a padded batch), then the
    next batch starts; the batch owns one K and one V tensor per layer. Caches grow by concatenation at every decode step (the next, one token longer
    tensor is allocated before the old one is freed). Each step runs the layers over the
    step's tokens (the prompts admitted in it, one token for every other sequence): hidden
    states, fused QKV, attention output and the MLP's intermediates, of sizes proportional to
    tokens × width, freed in nearly LIFO order, then fp32 logits of the last tokens.
    Finished requests free their caches.

    Parameters
    ----------
    allocate : callable
        ``allocate(nbytes) -> handle``: one device allocation of ``nbytes`` bytes.
    free : callable
        ``free(handle)``: releases an allocation made by ``allocate``.
    steps : int, optional
        Decoding steps (default 400).
    seed : int, optional
        Seed of the workload's own random generator: the same arguments give the same
        sequence of calls.
    layers, hidden, kv_dim, vocab : int, optional
        Model shape: transformer layers, hidden width, K (and V) width per token (grouped
        query attention: 8 KV heads of 128 by default) and vocabulary size.
    max_batch : int, optional
        Most requests decoded together (default 16).
    arrival_rate : float, optional
        Mean requests arriving per step (Poisson; default 0.8; continuous batching only).
    max_prompt, max_new_tokens : int, optional
        Caps of the prompt and generation lengths (defaults 4096 and 1024).
    batching : {"continuous", "static"}, optional
        :data:`BATCHING_CONTINUOUS` (default) or :data:`BATCHING_STATIC` (see above).

    Returns
    -------
    dict
        Counts: ``allocations``, ``requests`` (admitted), ``finished``, ``peak_live_bytes``
        (the peak of bytes requested and not yet freed).

    Raises
    ------
    ValueError
        A size or count is not a positive integer, ``arrival_rate`` is not positive, or
        ``batching`` is neither "continuous" nor "static".
    """
    for name, value in (("steps", steps), ("layers", layers), ("hidden", hidden),
                        ("kv_dim", kv_dim), ("vocab", vocab), ("max_batch", max_batch),
                        ("max_prompt", max_prompt), ("max_new_tokens", max_new_tokens)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not (isinstance(arrival_rate, (int, float)) and 0 < arrival_rate < 1e6):
        raise ValueError(f"arrival_rate must be a positive number, got {arrival_rate!r}")
    if batching not in (BATCHING_CONTINUOUS, BATCHING_STATIC):
        raise ValueError(f"batching must be {BATCHING_CONTINUOUS!r} or {BATCHING_STATIC!r}, "
                         f"got {batching!r}")
    rng = random.Random(seed)
    live = 0
    peak = 0
    n_alloc = 0

    def new(nbytes: int) -> tuple[Any, int]:
        nonlocal live, peak, n_alloc
        handle = allocate(nbytes)
        n_alloc += 1
        live += nbytes
        if live > peak:
            peak = live
        return handle, nbytes

    def drop(block: tuple[Any, int]) -> None:
        nonlocal live
        free(block[0])
        live -= block[1]

    def poisson(mean: float) -> int:  # Knuth: small means only
        limit = math.exp(-mean)
        k, p = 0, rng.random()
        while p > limit:
            k += 1
            p *= rng.random()
        return k

    def draw() -> tuple[int, int]:  # a request: (prompt length, tokens to generate)
        prompt = min(max_prompt, max(8, int(rng.lognormvariate(5.5, 1.0))))
        return prompt, min(max_new_tokens, max(1, int(rng.lognormvariate(4.5, 1.0))))

    kv_token = kv_dim * _ELEMENT_BYTES
    waiting: list[tuple[int, int]] = []
    active: list[_Request] = []
    admitted = finished = 0
    for _ in range(steps):
        if batching == BATCHING_CONTINUOUS:
            for _ in range(poisson(arrival_rate)):
                waiting.append(draw())
        new_requests = []
        if batching == BATCHING_CONTINUOUS:
            while waiting and len(active) < max_batch:
                prompt, gen = waiting.pop(0)
                req = _Request(prompt, gen, 1)
                active.append(req)
                new_requests.append(req)
                admitted += 1
        elif not active:  # static: the next padded batch, once the last is done
            batch = [draw() for _ in range(rng.randint(1, max_batch))]
            req = _Request(max(p for p, _ in batch), max(g for _, g in batch), len(batch))
            active.append(req)
            new_requests.append(req)
            admitted += len(batch)
        if not active:
            continue
        rows = sum(r.rows for r in active)
        tokens = sum(r.rows * r.cached for r in new_requests) + rows - sum(
            r.rows for r in new_requests)
        width = tokens * hidden * _ELEMENT_BYTES
        x = new(width)  # embeddings
        for layer in range(layers):
            norm = new(width)
            qkv = new(tokens * (hidden + 2 * kv_dim) * _ELEMENT_BYTES)
            for r in active:  # the KV cache: written at prefill, grown by torch.cat
                if r.prefill:
                    size = r.rows * r.cached * kv_token
                    r.caches.append((new(size), new(size)))
                else:
                    k_old, v_old = r.caches[layer]
                    k_new = new(r.rows * (r.cached + 1) * kv_token)
                    drop(k_old)
                    v_new = new(r.rows * (r.cached + 1) * kv_token)
                    drop(v_old)
                    r.caches[layer] = (k_new, v_new)
            attn = new(width)
            drop(qkv)
            proj = new(width)
            drop(attn)
            drop(norm)
            h = new(width)  # residual add
            drop(proj)
            norm = new(width)
            up = new(4 * width)
            gate = new(4 * width)
            act = new(4 * width)
            drop(gate)
            drop(up)
            down = new(width)
            drop(act)
            drop(norm)
            out = new(width)  # residual add
            drop(down)
            drop(h)
            drop(x)
            x = out
        logits = new(rows * vocab * _LOGIT_BYTES)
        drop(x)
        ids = new(rows * 8)
        drop(logits)
        still = []
        for r in active:
            if r.prefill:
                r.prefill = False
            else:
                r.cached += 1
            r.remaining -= 1
            if r.remaining <= 0:
                for k, v in r.caches:
                    drop(k)
                    drop(v)
                finished += r.rows
            else:
                still.append(r)
        active = still
        drop(ids)
    for r in active:  # the server drains: every cache is released
        for k, v in r.caches:
            drop(k)
            drop(v)
    return {"allocations": n_alloc, "requests": admitted, "finished": finished,
            "peak_live_bytes": peak}


def ragged_inference_trace(*, stream: int = 0, **workload: Any) -> list[tuple[str, int, int, int]]:
    """The trace of :func:`ragged_inference_workload` as (action, addr, size, stream) tuples.

    Every allocation gets a fresh address (the trace only pairs frees with allocations), so
    the trace is what a recorder would see up to addresses; :mod:`cudalab.memory_tools.replay`
    and :mod:`cudalab.memory_tools.what_if` read it as is.

    Parameters
    ----------
    stream : int, optional
        The stream id written in every entry (default 0).
    **workload
        Arguments of :func:`ragged_inference_workload` (``steps``, ``seed``, ``layers``, ...).

    Returns
    -------
    list of tuple
        ``("alloc" | "free_requested", addr, size, stream)`` in call order.
    """
    trace: list[tuple[str, int, int, int]] = []
    add = trace.append
    next_addr = [0x7F0000000000]

    def allocate(nbytes: int) -> tuple[int, int]:
        addr = next_addr[0]
        next_addr[0] = addr + ((nbytes + 511) & -512)
        add(("alloc", addr, nbytes, stream))
        return addr, nbytes

    def free(handle: tuple[int, int]) -> None:
        add(("free_requested", handle[0], handle[1], stream))

    ragged_inference_workload(allocate, free, **workload)
    return trace
