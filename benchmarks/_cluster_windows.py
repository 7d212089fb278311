"""The step-slowdown measurement of ``benchmarks/cluster.py``: aligned wall-clock windows.

Every rank gets the same :class:`Schedule` from the benchmark's process: a start time on the
host's monotonic clock (``time.monotonic()``, ``CLOCK_MONOTONIC`` on Linux: one clock for
every process of the host) and ``2 * pairs`` windows of ``window_seconds`` each. A rank runs
its step continuously from the moment it receives the schedule (a lead-in of about a second
before the start, so that every rank is stepping when the first window opens) until the last
window ends: no rank idles, pauses or stops inside the measured span, so every window sees
the same competition for the CPUs and the GPU(s) on every rank. **Each step ends with a
synchronize** (as a training step ends with its ``loss.item()``), so a step's end time is
when its GPU work finished, and its end is stamped (``time.monotonic()``).

A window's figure is its **time per step**: the window's seconds over the steps completed in
it, counting the steps that straddle its ends by the fraction of their time inside it (the
steps' progress is interpolated linearly between consecutive step ends). No settling margin
is dropped: toggling the publisher is a flag its thread reads at its next tick (nothing to
settle), and a dropped margin would drop the ticks that fall in it, hiding part of the cost.

The publisher is toggled at the window boundaries by the same schedule on every rank (all
ranks publish together, as every rank of a real job does), ``Publisher.paused`` set after
the first step that ends past a boundary (the lateness is reported): windows go on, off,
off, on, on, off, ... so the order inside a pair alternates from pair to pair and a drift of
the machine's speed falls on both sides. The publisher ticks every 0.5 s on its own clock,
so a window of a multiple of 0.5 s holds exactly that many ticks, on or off.

A pair's slowdown is its on window's time per step over its off window's, minus 1; a rank's
figure is the median of its pairs'. The noise floor takes the measured effect out, swaps
each pair's on and off at random (the same pairs on every rank, as the schedule is shared)
and takes the 95th percentile of the statistic over the draws: what the statistic shows on
these windows' noise with no effect.

Nothing here imports cudalab: the step and the synchronize are passed in (the tests run the
maths on synthetic data).
"""

from __future__ import annotations

import array
import bisect
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

#: Seconds between the schedule's sending and its first window: every rank's lead-in.
LEAD_SECONDS = 1.0

#: The publisher's sample interval: a window is a multiple of it.
SAMPLE_INTERVAL = 0.5


class Schedule(NamedTuple):
    """The windows every rank times, the same on every rank."""

    start: float  # time.monotonic() of the first window's start (the host's one clock)
    window_seconds: float  # > 0: every window's length (a multiple of SAMPLE_INTERVAL)
    pairs: int  # >= 1: the windows are 2 * pairs, one publishing and one paused per pair

    @classmethod
    def ahead(cls, window_seconds: float, pairs: int, lead: float = LEAD_SECONDS,
              clock: Callable[[], float] = time.monotonic) -> Schedule:
        """The schedule whose first window starts ``lead`` seconds from now."""
        if not (window_seconds > 0 and math.isfinite(window_seconds)):
            raise ValueError(f"window_seconds is {window_seconds!r}, expected seconds > 0")
        if isinstance(pairs, bool) or not isinstance(pairs, int) or pairs < 1:
            raise ValueError(f"pairs is {pairs!r}, expected an int >= 1")
        return cls(clock() + lead, float(window_seconds), pairs)

    @property
    def windows(self) -> int:
        return 2 * self.pairs

    @property
    def end(self) -> float:
        return self.start + self.windows * self.window_seconds

    def bounds(self, window: int) -> tuple[float, float]:
        """Window ``window``'s start and end."""
        return (self.start + window * self.window_seconds,
                self.start + (window + 1) * self.window_seconds)

    def publishing(self, window: int) -> bool:
        """Whether the publisher publishes in window ``window``: on, off in even pairs, off,
        on in odd ones."""
        return (window % 2 == 0) == ((window // 2) % 2 == 0)

    def line(self) -> str:
        """The schedule as one line of text (what the benchmark writes to each rank)."""
        return f"schedule {self.start!r} {self.window_seconds!r} {self.pairs}"

    @classmethod
    def from_line(cls, line: str) -> Schedule:
        words = line.split()
        if len(words) != 4 or words[0] != "schedule":
            raise ValueError(f"not a schedule line: {line[:80]!r}")
        return cls(float(words[1]), float(words[2]), int(words[3]))


def progress(ends: Sequence[float], when: float) -> float:
    """Steps completed at ``when``: ``ends`` holds the loop's start then each step's end
    (increasing); a step in progress counts the fraction of its time already spent."""
    if not ends or when < ends[0] or when > ends[-1]:
        raise ValueError(f"{when!r} is outside the stamped span")
    i = bisect.bisect_right(ends, when) - 1
    if i >= len(ends) - 1:
        return float(len(ends) - 1)
    return i + (when - ends[i]) / (ends[i + 1] - ends[i])


def window_times(ends: Sequence[float], schedule: Schedule) -> list[float]:
    """Each window's time per step from the stamped step ends (a window that began before
    the first stamp is measured from it)."""
    out = []
    for window in range(schedule.windows):
        start, end = schedule.bounds(window)
        start = max(start, ends[0])
        if end <= start:
            raise ValueError(f"window {window} ended before this rank began stepping "
                             "(the schedule's lead was too short)")
        out.append((end - start) / (progress(ends, end) - progress(ends, start)))
    return out


def run_windows(publisher: Any, schedule: Schedule, step: Callable[[], None],
                synchronize: Callable[[], None],
                clock: Callable[[], float] = time.monotonic,
                cpu_clock: Callable[[], float] = time.process_time) -> dict[str, Any]:
    """Step continuously from now until ``schedule`` ends, toggling ``publisher.paused`` at
    its window boundaries: the windows' times per step, paired (on, off), the publisher's CPU
    while on and the process's, its ticks' CPU times, the steps and how late the toggles
    came."""
    ends = array.array("d", [clock()])
    boundary, window, late = schedule.start, -1, 0.0
    busy0 = ticks0 = cpu_on = cpu_mark = 0.0
    while True:
        step()
        synchronize()
        now = clock()
        ends.append(now)
        if now < boundary:
            continue
        cpu = cpu_clock()
        if window < 0:
            busy0, ticks0 = publisher.busy_seconds, len(publisher.tick_seconds)
        elif schedule.publishing(window):
            cpu_on += cpu - cpu_mark
        cpu_mark = cpu
        window = int((now - schedule.start) // schedule.window_seconds)
        if window >= schedule.windows:
            break
        publisher.paused = not schedule.publishing(window)
        start, boundary = schedule.bounds(window)
        late = max(late, now - start)
    publisher.paused = False
    times = window_times(ends, schedule)
    pairs = []
    for pair in range(schedule.pairs):
        a, b = 2 * pair, 2 * pair + 1
        on, off = (a, b) if schedule.publishing(a) else (b, a)
        pairs.append((times[on], times[off]))
    return {"pairs": pairs, "busy": publisher.busy_seconds - busy0,
            "ticks": list(publisher.tick_seconds)[int(ticks0):],
            "on_seconds": schedule.pairs * schedule.window_seconds, "cpu_on": cpu_on,
            "steps": len(ends) - 1, "late": late,
            "steps_per_window": statistics.median(schedule.window_seconds / t for t in times)}


# ----------------------------------------------------------------------------- the figures
def rank_figures(data: dict[str, Any]) -> dict[str, Any]:
    """One rank's slowdown figures from its pairs: each pair's on/off - 1, their median (the
    rank's slowdown), their interquartile range, and its publisher's CPU."""
    pairs = [tuple(p) for p in data["pairs"]]
    if not pairs:
        raise ValueError(f"rank {data.get('rank')}: no pairs")
    ratios = sorted(on / off - 1 for on, off in pairs)
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    on_seconds = data.get("on_seconds") or sum(on for on, _ in pairs)
    return {"rank": data["rank"], "pairs": pairs, "ratios": ratios,
            "slowdown": statistics.median(ratios), "iqr": q[2] - q[0],
            "share": data["busy"] / on_seconds, "ticks": data["ticks"],
            # (the publisher's CPU over the whole process's while on: what it takes from the
            # step where the rank's CPU time, not the GPU, bounds it)
            "cpu_share": data["busy"] / data["cpu_on"] if data.get("cpu_on") else None,
            "first_tick": data.get("first_tick"), "late": data.get("late", 0.0),
            "steps_per_window": data.get("steps_per_window")}


def pooled(per_rank: list[dict[str, Any]]) -> float:
    """All ranks' windows pooled: the steps completed in every off window over those in
    every on window, minus 1 (the windows are equally long)."""
    on = sum(1 / t for r in per_rank for t, _ in r["pairs"])
    off = sum(1 / t for r in per_rank for _, t in r["pairs"])
    return off / on - 1


def noise_floors(per_rank: list[dict[str, Any]], draws: int = 2000,
                 seed: int = 0) -> dict[str, float]:
    """The 95th percentile of each statistic (``worst``: the worst rank's median of pairs;
    ``median``: the median of ranks'; ``pooled``) when the pairs' on and off windows are
    swapped at random, pair by pair (the same pairs on every rank: they share the
    schedule), after the measured effect is taken out (each rank's on windows divided by 1 +
    its median, for the pooled figure by 1 + the pooled figure): how large each comes out
    from the windows' noise alone, whether or not there is an effect (without taking it out,
    a real cost c would swap to about +-c and make the floor about c)."""
    if not per_rank:
        raise ValueError("no ranks")
    count = len(per_rank[0]["pairs"])
    if any(len(r["pairs"]) != count for r in per_rank):
        raise ValueError("the ranks' pair counts differ (they share one schedule)")
    rng = random.Random(seed)
    kept = []
    for r in per_rank:
        effect = 1 + statistics.median(on / off - 1 for on, off in r["pairs"])
        kept.append([(on / effect / off - 1, off * effect / on - 1) for on, off in r["pairs"]])
    effect = 1 + pooled(per_rank)
    rates = [[(effect / on, 1 / off) for on, off in r["pairs"]] for r in per_rank]
    got: dict[str, list[float]] = {"worst": [], "median": [], "pooled": []}
    for _ in range(draws):
        swap = [rng.random() < 0.5 for _ in range(count)]
        medians = [statistics.median([p[s] for p, s in zip(rank, swap)]) for rank in kept]
        got["worst"].append(max(medians))
        got["median"].append(statistics.median(medians))
        on = sum(p[s] for rank in rates for p, s in zip(rank, swap))
        off = sum(p[1 - s] for rank in rates for p, s in zip(rank, swap))
        got["pooled"].append(off / on - 1)
    return {name: sorted(values)[int(0.95 * (draws - 1))] for name, values in got.items()}


def rank_table(per_rank: list[dict[str, Any]]) -> list[str]:
    """The per-rank lines of the slowdown: each rank's paired median, the spread of its
    pairs, its steps per window, and its publisher's CPU per sample."""
    lines = [f"{'rank':>4} {'pairs':>5} {'slowdown %':>10} {'IQR of pairs %':>14} "
             f"{'min..max of pairs %':>21} {'steps/window':>12} {'pub. CPU/sample us':>18} "
             f"{'pub. CPU/step %':>15}"]
    for r in sorted(per_rank, key=lambda r: r["rank"]):
        ticks = r["ticks"]
        cpu = f"{1e6 * statistics.median(ticks):.0f}" if ticks else "-"
        steps = r.get("steps_per_window")
        lines.append(f"{r['rank']:>4} {len(r['ratios']):>5} {100 * r['slowdown']:>+10.2f} "
                     f"{100 * r['iqr']:>14.2f} "
                     f"{100 * r['ratios'][0]:>+9.1f}..{100 * r['ratios'][-1]:<+10.1f} "
                     f"{'-' if steps is None else f'{steps:.0f}':>12} "
                     f"{cpu:>18} {100 * r['share']:>15.3f}")
    return lines
