"""The step-slowdown measurement of benchmarks/cluster.py (benchmarks/_cluster_windows.py):
the shared window schedule, the windows' time per step, the paired slowdown and its noise
floors, on a fake clock and synthetic data (no timing)."""

from __future__ import annotations

import importlib.util
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location(
        "_cluster_windows", ROOT / "benchmarks" / "_cluster_windows.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("_cluster_windows", module)
    spec.loader.exec_module(module)
    return module


windows = _load()
Schedule = windows.Schedule


class FakeRank:
    """A rank on a fake clock: each step takes ``seconds`` (``seconds * (1 + cost)`` while
    its publisher publishes), and the publisher records when it was toggled."""

    def __init__(self, seconds: float, cost: float = 0.0, start: float = 0.0):
        self.now, self.seconds, self.cost = start, seconds, cost
        self._paused = False
        self.toggles: list[tuple[float, bool]] = []
        self.busy_seconds = 0.0
        self.tick_seconds: list[float] = []

    @property
    def paused(self) -> bool:
        return self._paused

    @paused.setter
    def paused(self, value: bool) -> None:
        if value != self._paused:
            self.toggles.append((self.now, value))
        self._paused = value

    def clock(self) -> float:
        return self.now

    def step(self) -> None:
        publishing = not self._paused
        self.now += self.seconds * (1 + (self.cost if publishing else 0.0))
        if publishing:
            self.busy_seconds += 0.001 * self.seconds
            self.tick_seconds.append(0.001)

    def run(self, schedule):
        return windows.run_windows(self, schedule, self.step, lambda: None, clock=self.clock,
                                   cpu_clock=self.clock)  # (all of its time is CPU)


def test_the_schedule_alternates_and_travels_as_one_line():
    schedule = Schedule(100.0, 0.5, 4)
    states = [schedule.publishing(w) for w in range(schedule.windows)]
    assert states == [True, False, False, True, True, False, False, True]
    assert schedule.bounds(0) == (100.0, 100.5) and schedule.bounds(7) == (103.5, 104.0)
    assert schedule.end == 104.0
    assert Schedule.from_line(schedule.line()) == schedule
    ahead = Schedule.ahead(0.5, 3, lead=2.0, clock=lambda: 10.0)
    assert ahead == Schedule(12.0, 0.5, 3)


@pytest.mark.parametrize("window, pairs", [(0.0, 3), (-1.0, 3), (float("nan"), 3), (0.5, 0),
                                           (0.5, 1.5), (0.5, True)])
def test_a_bad_schedule_is_refused(window, pairs):
    with pytest.raises(ValueError, match="window_seconds|pairs"):
        Schedule.ahead(window, pairs)


def test_a_line_that_is_no_schedule_is_refused():
    with pytest.raises(ValueError, match="not a schedule line"):
        Schedule.from_line("alloc 12")


def test_ranks_of_different_speeds_toggle_at_the_shared_boundaries():
    schedule = Schedule(1.0, 0.5, 3)
    fast, slow = FakeRank(0.001), FakeRank(0.03)
    fast.run(schedule)
    slow.run(schedule)
    # the same toggles, each after its boundary by less than a step, on every rank
    for rank in (fast, slow):
        assert [paused for _, paused in rank.toggles] == [True, False, True, False]
        flips = [w for w in range(1, schedule.windows)
                 if schedule.publishing(w) != schedule.publishing(w - 1)]
        for (when, _), window in zip(rank.toggles, flips):
            assert 0 <= when - schedule.bounds(window)[0] < rank.seconds * 1.001
        assert rank.now >= schedule.end  # (stepped until the last window ended)
        assert rank.paused is False


def test_a_windows_time_per_step_counts_the_straddling_steps_by_their_fraction():
    ends = [0.0 + 0.3 * i for i in range(20)]
    schedule = Schedule(0.4, 1.0, 2)  # (windows start and end inside steps)
    assert windows.window_times(ends, schedule) == pytest.approx([0.3] * 4)
    assert windows.progress(ends, 0.45) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="outside"):
        windows.progress(ends, 99.0)
    with pytest.raises(ValueError, match="lead was too short"):
        windows.window_times([5.0, 5.1, 5.2, 5.3, 5.4, 5.5], Schedule(4.0, 0.5, 1))


@pytest.mark.parametrize("cost", [0.0, 0.01, 0.05])
def test_a_real_cost_shows_as_its_share_of_a_step(cost):
    schedule = Schedule(0.5, 0.5, 6)
    figures = windows.rank_figures({"rank": 3, **FakeRank(0.002, cost).run(schedule)})
    assert figures["slowdown"] == pytest.approx(cost, abs=0.002)
    assert figures["rank"] == 3 and len(figures["ratios"]) == 6
    assert figures["share"] == pytest.approx(0.001 / (1 + cost), rel=0.05)
    assert figures["cpu_share"] == pytest.approx(0.001 / (1 + cost), rel=0.05)
    assert windows.pooled([figures]) == pytest.approx(cost, abs=0.002)


def test_the_figures_of_pairs():
    figures = windows.rank_figures({"rank": 0, "pairs": [(1.1, 1.0), (1.0, 1.0), (0.9, 1.0)],
                                    "busy": 0.03, "ticks": [], "on_seconds": 3.0})
    assert figures["slowdown"] == pytest.approx(0.0)
    assert figures["ratios"] == pytest.approx([-0.1, 0.0, 0.1])
    assert figures["share"] == pytest.approx(0.01)
    # pooled: every off window's steps over every on window's (2 s/step on: half the steps)
    assert windows.pooled([{"pairs": [(2.0, 1.0)]}, {"pairs": [(1.0, 1.0)]}]) == \
        pytest.approx(2 / 1.5 - 1)
    with pytest.raises(ValueError, match="no pairs"):
        windows.rank_figures({"rank": 1, "pairs": [], "busy": 0.0, "ticks": []})


def test_the_noise_floor_of_noiseless_pairs_is_zero_whatever_their_effect():
    for effect in (1.0, 1.1):
        floors = windows.noise_floors([{"pairs": [(effect * 2.0, 2.0)] * 5}] * 3, draws=50)
        assert floors == pytest.approx({"worst": 0.0, "median": 0.0, "pooled": 0.0}, abs=1e-12)


def test_one_noisy_pair_swaps_to_either_side():
    # two pairs, about +-10 %: their median about 0, and swapped at random the two show
    # {+-10 %, +-1/1.1 - 1}: the 95th percentile of their median is +10 %
    floors = windows.noise_floors([{"pairs": [(1.1, 1.0), (1.0, 1.1)]}], draws=400)
    median = statistics.median([0.1, 1 / 1.1 - 1])
    assert floors["worst"] == pytest.approx(0.1 - median, rel=0.05)


def _ranks(rng, effect, noise=0.02, pairs=40, ranks=8):
    return [{"rank": r, "busy": 0, "ticks": [],
             "pairs": [((1 + effect) * rng.gauss(1, noise), rng.gauss(1, noise))
                       for _ in range(pairs)]} for r in range(ranks)]


def test_the_noise_floor_bounds_noise_and_not_an_effect():
    noise = [windows.rank_figures(d) for d in _ranks(random.Random(1), 0.0)]
    floors = windows.noise_floors(noise, draws=300)
    assert 0 < floors["pooled"] < floors["worst"]
    assert max(r["slowdown"] for r in noise) < floors["worst"] * 1.5
    # a real 5 % shows on every rank above the floor, and the floor is the noise's alone:
    # the same noise with the effect gives the same floors
    effect = [windows.rank_figures(d) for d in _ranks(random.Random(1), 0.05)]
    assert min(r["slowdown"] for r in effect) > floors["worst"]
    assert windows.pooled(effect) > floors["pooled"] and abs(windows.pooled(noise)) < 0.01
    assert windows.noise_floors(effect, draws=300) == pytest.approx(floors, rel=1e-9)
    # and more pairs, a lower floor
    many = [windows.rank_figures(d) for d in _ranks(random.Random(1), 0.0, pairs=400)]
    assert windows.noise_floors(many, draws=300)["worst"] < floors["worst"] / 2


def test_the_noise_floor_wants_ranks_sharing_one_schedule():
    with pytest.raises(ValueError, match="pair counts differ"):
        windows.noise_floors([{"pairs": [(1.0, 1.0)]}, {"pairs": [(1.0, 1.0)] * 2}])
    with pytest.raises(ValueError, match="no ranks"):
        windows.noise_floors([])


def test_the_benchmark_refuses_a_window_that_is_no_multiple_of_the_sample_interval():
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cluster.py"),
                          "--block-seconds", "0.75"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "multiple of 0.5" in run.stderr
