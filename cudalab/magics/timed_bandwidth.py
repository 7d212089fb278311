"""``%%cuda_timed`` on a cell that runs collectives: algorithm and bus bandwidth.

Every collective cudalab issues (:mod:`cudalab.nccl`, :mod:`cudalab.comm` and its
``Communicator``) tells :data:`cudalab._internal.collective_observers` about itself with a
:class:`~cudalab._internal.CollectiveRecord`. While a cell is timed, a
:class:`CollectiveWatch` listens. When the timed part ran one kind of collective (one
name, size and rank count), ``k`` times per loop, the report adds its bandwidth, as NVIDIA's
nccl-tests defines it (``doc/PERFORMANCE.md``):

* time per collective ``t`` = the GPU time per loop / ``k``;
* algorithm bandwidth = ``S / t``, with ``S`` the record's ``algorithm_bytes`` (all_reduce:
  the array; all_gather and reduce_scatter: the whole gathered array; broadcast, reduce:
  the array);
* bus bandwidth = algorithm bandwidth x the record's ``bus_factor`` (all_reduce 2(n-1)/n,
  all_gather and reduce_scatter (n-1)/n, broadcast and reduce 1), which is comparable with
  the hardware's link speed whatever the rank count.

GB/s are 10^9 bytes per second, as nccl-tests prints them. Cells that run different
collectives get a note instead of a number.
"""

from __future__ import annotations

from typing import Any

from cudalab import _internal

__all__ = ["CollectiveWatch", "bandwidth_line"]

#: A collective's identity for the bandwidth: (name, algorithm bytes, ranks, bus factor).
_Signature = tuple[str, int, int, float]


class CollectiveWatch:
    """Counts the collectives issued while a cell is timed (a collective observer).

    Use as a context manager around the timed code; :meth:`mark` starts the measured
    phase (warm-up and auto-ranging runs before it are not counted).
    """

    def __init__(self) -> None:
        self.counts: dict[_Signature, int] = {}  # signature -> calls since mark(); sums to total
        self.total = 0  # calls since mark(), == sum(counts.values())

    def __call__(self, record: _internal.CollectiveRecord) -> None:
        key = (record.name, record.algorithm_bytes, record.nranks, record.bus_factor)
        self.counts[key] = self.counts.get(key, 0) + 1
        self.total += 1

    def mark(self) -> None:
        """Forget what was counted so far: the measured phase starts now."""
        self.counts = {}
        self.total = 0

    def __enter__(self) -> CollectiveWatch:
        _internal.collective_observers.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            _internal.collective_observers.remove(self)
        except ValueError:  # already removed (e.g. by %unload_ext)
            pass

    def summary(self, seconds_per_loop: float, loops: int) -> dict | None:
        """The bandwidth of the one kind of collective the ``loops`` measured loops ran.

        Parameters
        ----------
        seconds_per_loop
            The GPU time of one loop (the result's median).
        loops
            Loops measured since :meth:`mark` (repeats x loops per repeat).

        Returns
        -------
        dict or None
            None when no collective ran. ``{"note": ...}`` when several kinds ran or the
            calls do not divide evenly into loops. Otherwise ``name``, ``bytes``,
            ``nranks``, ``calls_per_loop``, ``time`` (seconds per collective),
            ``algbw`` and ``busbw`` (GB/s, 10^9 bytes/s) and ``bus_factor``.
        """
        if not self.total:
            return None
        if len(self.counts) > 1:
            names = sorted({key[0] for key in self.counts})
            return {"note": f"several kinds of collective ran ({', '.join(names)}): bandwidth "
                            "is reported for a cell that runs one kind"}
        (name, nbytes, nranks, factor), calls = next(iter(self.counts.items()))
        if loops <= 0 or calls % loops:
            return {"note": f"{calls} {name} calls in {loops} loops: not the same number per "
                            "loop, so no bandwidth"}
        per_loop = calls // loops
        t = seconds_per_loop / per_loop
        if not t > 0:  # NaN (the GPU time could not be read) or 0
            return {"note": f"{name}: no GPU time to compute a bandwidth from"}
        algbw = nbytes / t / 1e9
        return {"name": name, "bytes": nbytes, "nranks": nranks, "calls_per_loop": per_loop,
                "time": t, "algbw": algbw, "busbw": algbw * factor, "bus_factor": factor}


def bandwidth_line(collective: dict, format_time: Any) -> str:
    """The report's line for :meth:`CollectiveWatch.summary`'s dict."""
    if "note" in collective:
        return f"collective: {collective['note']}"
    calls = collective["calls_per_loop"]
    each = f", {calls} per loop" if calls != 1 else ""
    return (f"collective: {collective['name']} of {_internal.format_bytes(collective['bytes'])} "
            f"over {collective['nranks']} rank{'s' if collective['nranks'] != 1 else ''}"
            f"{each}: {format_time(collective['time'])} each, algbw "
            f"{collective['algbw']:.2f} GB/s, busbw {collective['busbw']:.2f} GB/s "
            f"(nccl-tests' definitions, factor {collective['bus_factor']:.3g})")
