"""Why an allocation did not fit: the byte accounting of a device and the verdict it supports.

:func:`accounting_rows` splits the device's total memory (the driver's ``cuMemGetInfo``
total) into the categories of :data:`CATEGORIES`; the last row, ``unattributed``, is what the
figures do not explain (NVML's and the driver's views disagreeing, or NVML unavailable), so
the rows always sum to the total and the size of that row is the reconciliation error.

:func:`judge` names the cause of an out-of-memory error. With the failed request ``R``, the
memory the failing allocator could still get (``headroom``: the driver's free bytes, or
what its per-process limit leaves) and the shortfall ``R - headroom``, it takes the first of
these that holds (each is a way the request would have fit):

1. ``request_too_large``: ``R`` exceeds the device's total memory.
2. ``fraction_limit``: a per-process memory fraction refused it while the device had room.
3. ``pending_frees``: blocks freed but waiting on other streams cover the shortfall.
4. ``fragmentation``: the allocator's cached free bytes cover the shortfall, but no free
   block of its pool holds ``R``.
5. ``private_pool``: CUDA-graph or ``MemPool`` pools hold at least the shortfall.
6. ``held_by_python``: arrays that only disposable references keep alive (``Out``, ``_``,
   traceback frames) hold at least the shortfall.
7. ``other_process``: other processes use at least the shortfall.
8. ``outside_allocator``: this process uses at least the shortfall outside every allocator
   (beyond the CUDA context's typical size).
9. ``live_arrays``: none of those: the live arrays themselves do not fit.

Without an out-of-memory error (the current state), the verdict names what dominates: the
held-by-Python bytes, fragmentation, private pools, other processes or memory outside the
allocators when one of them is at least a quarter of the used memory, else live arrays.
"""

from __future__ import annotations

from typing import Any

from cudalab._internal import format_bytes
from cudalab.oom.state import CONTEXT_ESTIMATE, AllocatorFigures, DeviceState

__all__ = ["CATEGORIES", "VERDICTS", "Judgement", "accounting_rows", "judge", "outside_bytes"]

#: Every verdict :func:`judge` can give.
VERDICTS: tuple[str, ...] = ("fragmentation", "live_arrays", "held_by_python", "private_pool",
                             "pending_frees", "other_process", "outside_allocator",
                             "request_too_large", "fraction_limit")
#: The accounting's categories, in its order.
CATEGORIES: tuple[str, ...] = ("live", "cached free (small pool)", "cached free (large pool)",
                               "private pools", "pending frees", "CUDA context (estimate)",
                               "this process outside any allocator", "other processes",
                               "free", "unattributed")
#: What each verdict's fix is, in one phrase.
FIXES: dict[str, str] = {
    "request_too_large": "make the request smaller (a smaller batch or shard): no setting "
                         "makes it fit on this device",
    "fraction_limit": "raise or remove set_per_process_memory_fraction (the device has room)",
    "pending_frees": "synchronize the streams that use the freed blocks (or avoid "
                     "record_stream) before allocating",
    "fragmentation": "set expandable_segments:True (or the autotuner's line) in "
                     "PYTORCH_CUDA_ALLOC_CONF / CUDALAB_ALLOC_CONF, or call empty_cache()",
    "private_pool": "release the CUDA graphs or MemPools that hold the memory (del the "
                    "graph, then empty_cache())",
    "held_by_python": "drop the references you no longer need (explanation.referrers"
                      ".release()): Out[...], _, the last traceback",
    "other_process": "stop or shrink the other processes on this GPU (nvidia-smi lists them)",
    "outside_allocator": "find what allocates outside the allocators (NCCL buffers, cuBLAS "
                         "workspaces, a raw cuMemAlloc) and shrink it",
    "live_arrays": "the live arrays do not fit: use less (smaller batch, lower precision, "
                   "activation checkpointing) or a larger device",
}


class Judgement:
    """The verdict, the shortfall and the reasons (one line per check)."""

    __slots__ = ("verdict", "shortfall", "headroom", "reasons")

    def __init__(self, verdict: str, shortfall: int | None, headroom: int | None,
                 reasons: list[str]):
        self.verdict = verdict
        self.shortfall = shortfall
        self.headroom = headroom
        self.reasons = tuple(reasons)


def outside_bytes(state: DeviceState) -> tuple[int | None, int]:
    """(this process's bytes outside every allocator, the CUDA context's share of them):
    NVML's figure for the process less every allocator's reserved bytes (None when NVML does
    not list the process); the context's share is its typical size, 0 on the simulator."""
    if state.process_used is None:
        return None, 0
    outside = max(0, state.process_used - state.reserved)
    context = 0 if state.simulated else min(outside, CONTEXT_ESTIMATE)
    return outside, context


def accounting_rows(state: DeviceState) -> list[dict[str, Any]]:
    """The accounting of ``state`` as rows (category, source, bytes, detail), summing to the
    driver's total (see the module documentation)."""
    rows: list[dict[str, Any]] = []

    def add(category: str, source: str, nbytes: int, detail: str = "") -> None:
        rows.append({"category": category, "source": source, "bytes": int(nbytes),
                     "detail": detail})

    for a in state.allocators:
        add("live", a.source, a.live, "live blocks outside private pools")
        add("cached free (small pool)", a.source, a.free_small,
            f"largest free block {format_bytes(a.largest_small)}" if a.free_small else "")
        add("cached free (large pool)", a.source, a.free_large,
            f"largest free block {format_bytes(a.largest_large)}" if a.free_large and
            a.largest_large else a.note)
        add("private pools", a.source, a.private,
            "CUDA graphs and MemPools (live and free inside)" if a.private else "")
        add("pending frees", a.source, a.pending,
            "freed, waiting on other streams" if a.pending else "")
    outside, context = outside_bytes(state)
    if outside is not None:
        add("CUDA context (estimate)", "process", context,
            "typical size with lazy loading; NVML cannot tell it apart" if context else
            ("the simulator has no context" if state.simulated else ""))
        add("this process outside any allocator", "process", outside - context,
            "NVML's figure for this process less every allocator's reserved bytes")
    if state.other_processes is not None:
        add("other processes", "NVML", state.other_processes, "every other process (NVML)")
    add("free", "driver", state.free, "free on the device (cuMemGetInfo)")
    rest = state.total - sum(r["bytes"] for r in rows)
    why = ("what the figures above do not explain (NVML and the driver disagree by this much)"
           if outside is not None and state.other_processes is not None else
           f"NVML does not list this process ({state.nvml_error or 'no figure'}): the context, "
           "memory outside the allocators and other processes are all here")
    add("unattributed", "driver", rest, why)
    return rows


def _failing(state: DeviceState, source: str | None) -> AllocatorFigures | None:
    if source is not None:
        got = state.allocator(source)
        if got is not None:
            return got
    if not state.allocators:
        return None
    return max(state.allocators, key=lambda a: a.reserved)


def judge(state: DeviceState, request: int | None, source: str | None, limit: int | None,
          held_by_python: int) -> Judgement:
    """The verdict for ``state`` (see the module documentation).

    Parameters
    ----------
    state : DeviceState
        The device at the out-of-memory error (or now).
    request : int or None
        Bytes the failed allocation asked the driver for; None without an error.
    source : str or None
        The allocator that failed ("cudalab", "torch", "cupy").
    limit : int or None
        Its per-process limit in bytes, when a fraction is set.
    held_by_python : int
        Bytes of arrays that only disposable references keep alive.
    """
    a = _failing(state, source)
    reserved = a.reserved if a is not None else 0
    if limit is None and a is not None:
        limit = a.limit
    pending = sum(x.pending for x in state.allocators)
    private = sum(x.private for x in state.allocators)
    outside, context = outside_bytes(state)
    beyond = None if outside is None else outside - context
    reasons: list[str] = []
    fb = format_bytes
    if request is None:
        used = max(1, state.total - state.free)
        cached = sum(x.free_small + x.free_large for x in state.allocators)
        shares = [("held_by_python", held_by_python), ("fragmentation", cached),
                  ("private_pool", private), ("pending_frees", pending),
                  ("other_process", state.other_processes or 0),
                  ("outside_allocator", beyond or 0)]
        name, nbytes = max(shares, key=lambda s: s[1])
        verdict = name if nbytes >= used / 4 else "live_arrays"
        reasons.append(f"no out-of-memory error: {fb(used)} of {fb(state.total)} used; the "
                       f"largest share besides live arrays is {name} ({fb(nbytes)})")
        return Judgement(verdict, None, state.free, reasons)
    headroom = state.free
    if limit is not None:
        headroom = min(headroom, max(0, limit - reserved))
    shortfall = max(0, request - headroom)
    reasons.append(f"the request needed {fb(request)}; the allocator could still get "
                   f"{fb(headroom)} ({'under its limit of ' + fb(limit) if limit is not None else 'free on the device'}): "
                   f"{fb(shortfall)} short")
    largest = 0
    cached = 0
    if a is not None:
        small = request <= (1 << 20)
        largest = a.largest_small if small else a.largest_large
        cached = a.free_small + a.free_large
    checks: list[tuple[str, bool, str]] = [
        ("request_too_large", request > state.total,
         f"request {fb(request)} vs device total {fb(state.total)}"),
        ("fraction_limit", limit is not None and request > max(0, limit - reserved)
         and state.free >= request,
         f"limit {fb(limit) if limit is not None else 'none'}, device free {fb(state.free)}"),
        ("pending_frees", pending > 0 and pending >= shortfall,
         f"pending frees {fb(pending)}"),
        ("fragmentation", cached > 0 and cached >= shortfall and largest < request,
         f"cached free {fb(cached)}, largest free block {fb(largest)}"),
        ("private_pool", private > 0 and private >= shortfall, f"private pools {fb(private)}"),
        ("held_by_python", held_by_python > 0 and held_by_python >= shortfall,
         f"held only by disposable references {fb(held_by_python)}"),
        ("other_process", bool(state.other_processes) and
         (state.other_processes or 0) >= shortfall,
         f"other processes {fb(state.other_processes) if state.other_processes is not None else 'unknown'}"),
        ("outside_allocator", beyond is not None and beyond > 0 and beyond >= shortfall,
         f"outside the allocators {fb(beyond) if beyond is not None else 'unknown'} (beyond a "
         f"context of {fb(context)})"),
    ]
    verdict = "live_arrays"
    for name, holds, text in checks:
        reasons.append(f"{name}: {'yes' if holds else 'no'} ({text})")
        if holds and verdict == "live_arrays":
            verdict = name
    return Judgement(verdict, shortfall, headroom, reasons)
