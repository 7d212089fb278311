"""What-if's bounded search: the allocator settings a user would try, in three stages.

:func:`search` drives one replay per setting through a ``run(config, device_memory)``
callable (what :func:`cudalab.memory_tools.what_if.what_if` passes) and decides, from the
results so far, what to try next. The grid is small and pruned, so its cost is a few dozen
replays at most (:data:`MAX_REPLAYS`):

1. **Single settings** (:data:`SINGLE_SETTINGS`): the native defaults, expandable segments,
   ``max_split_size_mb`` 64/128/256/512, ``roundup_power2_divisions`` uniform (4) and per
   size band (torch's ``[256:1,512:2,1024:4,>:8]``), and ``backend:cudaMallocAsync``.
2. **Combinations**: ``expandable_segments:True`` with each ``roundup_power2_divisions``
   setting and with each of the two best ``max_split_size_mb`` values of stage 1 (ties go to
   the larger, least intrusive value), and the best ``max_split_size_mb`` with each rounding
   without expandable segments. A ``max_split_size_mb`` value that changed nothing alone
   (the limit never mattered on this trace) is not combined; if none mattered,
   ``expandable_segments:True,max_split_size_mb:512`` is still tried once.
3. **Memory caps**: ``garbage_collection_threshold`` acts only under a
   ``per_process_memory_fraction`` (torch's rule), so it is tried with one, on top of the best
   expandable and the best non-expandable setting of stages 1-2. The fraction is of the
   modelled device (:func:`cap_device_memory`: the real device's memory when known, else a
   device that the defaults exactly fill), tried from 0.95 downwards in steps of 0.05; the
   descent stops at the first setting that runs out of memory and bisects twice between it
   and the last fraction that fit; fractions that leave less than the trace's peak of live
   bytes are never tried (they must run out), nor those under which neither the cap nor
   garbage collection would act (the replay would repeat the base's). The best fraction found is tried once more
   with a lower threshold (0.6).

Under a cap the allocator frees its cache and retries (``retries``) instead of reserving
more; every retry synchronises the device, so a row that reaches its peak through retries
pays for it in time: the table shows them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = [
    "BISECTIONS",
    "FRACTIONS",
    "GC_THRESHOLDS",
    "MAX_REPLAYS",
    "MAX_SPLIT_MB",
    "ROUNDUP_SETTINGS",
    "SINGLE_SETTINGS",
    "cap_device_memory",
    "search",
]

#: ``max_split_size_mb`` values of stage 1.
MAX_SPLIT_MB: tuple[int, ...] = (64, 128, 256, 512)
#: ``roundup_power2_divisions`` settings: uniform, and per size band in torch's syntax
#: (1 division below 256 MiB, 2 up to 512 MiB, 4 up to 1 GiB, 8 above).
ROUNDUP_SETTINGS: tuple[str, ...] = ("roundup_power2_divisions:4",
                                     "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
#: Stage 1: the native defaults first, then each setting alone.
SINGLE_SETTINGS: tuple[str, ...] = (
    "",
    "expandable_segments:True",
    *(f"max_split_size_mb:{mb}" for mb in MAX_SPLIT_MB),
    *ROUNDUP_SETTINGS,
    "backend:cudaMallocAsync",
)
#: Memory fractions of stage 3, tried in this order (the descent stops at the first OOM).
FRACTIONS: tuple[float, ...] = (0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5)
#: ``garbage_collection_threshold`` values of stage 3: the first with every fraction, the
#: second once, with the best fraction.
GC_THRESHOLDS: tuple[float, ...] = (0.8, 0.6)
#: Bisection steps between the last fraction that fit and the first that ran out of memory.
BISECTIONS = 2
#: The most replays :func:`search` makes (stage 1, stage 2, two descents with their
#: bisections, and the second threshold).
MAX_REPLAYS = (len(SINGLE_SETTINGS) + 3 * (1 + len(ROUNDUP_SETTINGS)) - 1 + len(ROUNDUP_SETTINGS)
               + 2 * (len(FRACTIONS) + BISECTIONS) + 1)

_ES = "expandable_segments:True"
_MAX_SPLIT = "max_split_size_mb:"


def cap_device_memory(device_memory: int | None, default_peak_reserved: int) -> int:
    """The device that stage 3's memory fractions are fractions of.

    Parameters
    ----------
    device_memory : int or None
        The real device's memory in bytes, when the user gave it.
    default_peak_reserved : int
        Peak reserved bytes of the native defaults on the trace.

    Returns
    -------
    int
        ``device_memory`` when given, else ``default_peak_reserved`` rounded up to a MiB (at
        least 1 MiB): a device the defaults exactly fill, where capping is what a user
        under memory pressure would try.
    """
    if device_memory is not None:
        return int(device_memory)
    mib = 1 << 20
    return max(mib, -(-int(default_peak_reserved) // mib) * mib)


def _join(*parts: str) -> str:
    return ",".join(p for p in parts if p)


def _key(result: Any) -> tuple[bool, int]:
    return (result.ooms > 0, result.peak_reserved)


def search(run: Callable[[str, int | None], Any], *, peak_live: int,
           device_memory: int | None = None) -> tuple[list[Any], int]:
    """Run the bounded grid (see the module documentation).

    Parameters
    ----------
    run : callable
        ``run(config_text, device_memory) -> ReplayResult``: one replay of the trace with
        those settings on a device of ``device_memory`` bytes (None: the replay's own
        unconstraining device).
    peak_live : int
        The trace's peak of live requested bytes (:attr:`ReplayPlan.peak_live`): fractions
        that leave less than this are never tried.
    device_memory : int, optional
        The real device's memory: every replay runs on it, and the memory fractions are of
        it.

    Returns
    -------
    (list of ReplayResult, int)
        One result per setting tried, in the order tried (the defaults first), and the
        memory of the device that stage 3's fractions refer to.
    """
    results: dict[str, Any] = {}

    def attempt(text: str, memory: int | None = device_memory) -> Any:
        if text not in results:
            results[text] = run(text, memory)
        return results[text]

    # stage 1: each setting alone
    for text in SINGLE_SETTINGS:
        attempt(text)
    default = results[""]
    if peak_live <= 0:  # nothing is ever live: no combination or cap can differ
        return list(results.values()), cap_device_memory(device_memory, default.peak_reserved)

    # stage 2: combinations. A max_split_size_mb value that changed nothing alone (same peak,
    # same device allocations: the limit never mattered on this trace) is not combined.
    def same(a: Any, b: Any) -> bool:
        return (a.peak_reserved, a.num_device_alloc, a.retries, a.ooms) == \
            (b.peak_reserved, b.num_device_alloc, b.retries, b.ooms)

    useful = [mb for mb in MAX_SPLIT_MB if not same(results[f"{_MAX_SPLIT}{mb}"], default)]
    splits = sorted(useful, key=lambda mb: (_key(results[f"{_MAX_SPLIT}{mb}"]), -mb))
    best_splits = [f"{_MAX_SPLIT}{mb}" for mb in splits[:2]]
    for split in ["", *best_splits]:
        for rounding in ["", *ROUNDUP_SETTINGS]:
            attempt(_join(_ES, split, rounding))
    if not best_splits:  # the pair users try first, shown once even where the limit is idle
        attempt(_join(_ES, f"{_MAX_SPLIT}{max(MAX_SPLIT_MB)}"))
    if best_splits:
        for rounding in ROUNDUP_SETTINGS:
            attempt(_join(best_splits[0], rounding))

    # stage 3: garbage collection under a memory fraction, on the best native settings;
    # the fraction descends in FRACTIONS' steps to the first out-of-memory, then is bisected
    # twice between the last fraction that fit and the first that did not.
    cap = cap_device_memory(device_memory, default.peak_reserved)
    native = [t for t in results if "cudaMallocAsync" not in t]
    best_es = min((t for t in native if _ES in t), key=lambda t: _key(results[t]))
    best_plain = min((t for t in native if _ES not in t), key=lambda t: _key(results[t]))
    best_capped: tuple[tuple[bool, int], str, float] | None = None

    def capped(base: str, fraction: float, threshold: float = GC_THRESHOLDS[0]) -> Any:
        nonlocal best_capped
        r = attempt(_join(base, f"garbage_collection_threshold:{threshold:g}",
                          f"per_process_memory_fraction:{fraction:g}"), cap)
        if not r.ooms and (best_capped is None or _key(r) < best_capped[0]):
            best_capped = (_key(r), base, fraction)
        return r

    for base in (best_es, best_plain):
        fits: float | None = None
        # Where neither the cap nor garbage collection can act (GC never frees expandable
        # blocks), the replay would repeat the base's: such fractions are skipped.
        reach = 1.0 if _ES in base else GC_THRESHOLDS[0]
        for fraction in FRACTIONS:
            if fraction * cap < peak_live:
                break  # less than the live bytes: it must run out of memory
            if reach * fraction * cap >= results[base].peak_reserved:
                continue
            if capped(base, fraction).ooms:
                if fits is not None:
                    fails = fraction
                    for _ in range(BISECTIONS):
                        middle = round((fits + fails) / 2, 4)
                        if capped(base, middle).ooms:
                            fails = middle
                        else:
                            fits = middle
                break
            fits = fraction
    if best_capped is not None:
        _, base, fraction = best_capped
        capped(base, fraction, GC_THRESHOLDS[1])
    return list(results.values()), cap
