"""``--shard K/N``: run a deterministic share of the suite (``bash .ci/gpu-run --shard 1/2``).

The unit is a test file: every test of a file runs in the same shard, so module-scoped fixtures
and the files' own ordering assumptions stay as they are. Files are placed by
:func:`assign`:

* a file listed in ``tests/durations.json`` (seconds per file, measured) is placed greedily,
  longest first, on the shard with the least time so far (ties: the lowest shard);
* a file missing from the table (a new one) goes to the shard a stable hash of its path names
  (``sha256``, not Python's salted ``hash``) and counts there with the table's median time.

Under pytest-xdist (the README's ``-n 2 --dist loadfile``) each worker also orders the files
longest first by the same table (:func:`longest_first`), so the long ones start early.

The assignment depends only on the table and the set of files collected, so every process
that collects the same files (each pytest-xdist worker, each shard's machine) agrees, and the
N shards together run every collected test exactly once (``tests/test_shard.py`` checks both).

``--shard-durations-out PATH`` writes the seconds each file took in this run (setup, call and
teardown of its tests, summed) with its test count, as JSON; a file whose tests all skipped is
left out. Refresh the table from the GPU shards' files (entries of the old table that the new
files lack are kept) with::

    python -m tests.helpers.shard merge tests/durations.json gpu-out/durations_shard*.json > new.json
    mv new.json tests/durations.json
"""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import pytest

__all__ = ["DURATIONS", "ShardPlugin", "add_options", "assign", "file_of", "load_durations",
           "longest_first", "parse_shard"]

#: The committed table: ``{"seconds": {"tests/x/test_y.py": 12.3, ...}}``.
DURATIONS = Path(__file__).resolve().parents[1] / "durations.json"


def parse_shard(text: str) -> tuple[int, int]:
    """``"K/N"`` as ``(K, N)``, 1 <= K <= N; :class:`ValueError` otherwise."""
    k_text, sep, n_text = text.partition("/")
    if not sep:
        raise ValueError(f"--shard wants K/N (for example 1/2), not {text!r}")
    k, n = int(k_text), int(n_text)
    if not 1 <= k <= n:
        raise ValueError(f"--shard {text}: K must be between 1 and N")
    return k, n


def file_of(nodeid: str) -> str:
    """The test file of a node id (``tests/a/test_b.py::test_c[1]`` -> ``tests/a/test_b.py``)."""
    return nodeid.split("::", 1)[0]


def load_durations(path: Path = DURATIONS) -> dict[str, float]:
    """The table's seconds per file; empty when the file is missing."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    return {str(k): float(v) for k, v in data["seconds"].items()}


def _stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def assign(files: list[str] | set[str], durations: dict[str, float], n: int) -> dict[str, int]:
    """The shard (0-based, ``< n``) of each file.

    Parameters
    ----------
    files
        The test files to place (their order does not matter).
    durations
        Seconds per file; files absent from it are placed by a stable hash of their path.
    n
        The number of shards.

    Returns
    -------
    dict[str, int]
        Every file of ``files``, each with exactly one shard.
    """
    unique = sorted(set(files))
    known = [f for f in unique if f in durations]
    default = statistics.median(durations.values()) if durations else 1.0
    load = [0.0] * n
    out: dict[str, int] = {}
    for f in unique:
        if f not in durations:
            out[f] = _stable_hash(f) % n
            load[out[f]] += default
    for f in sorted(known, key=lambda f: (-durations[f], f)):
        shard = min(range(n), key=lambda i: (load[i], i))
        out[f] = shard
        load[shard] += durations[f]
    return out


def longest_first(files: list[str] | set[str], durations: dict[str, float]) -> list[str]:
    """``files`` ordered by their time in ``durations``, longest first (a new file counts
    with the table's median; ties by path)."""
    default = statistics.median(durations.values()) if durations else 1.0
    return sorted(set(files), key=lambda f: (-durations.get(f, default), f))


class ShardPlugin:
    """Deselects the tests of other shards; records per-file durations when asked."""

    def __init__(self, config: pytest.Config) -> None:
        shard = config.getoption("shard")
        self.shard = parse_shard(shard) if shard else None  # (K, N) or None: run everything
        self.out = config.getoption("shard_durations_out")  # path to write, or None
        self.seconds: defaultdict[str, float] = defaultdict(float)  # file -> seconds this run
        self.tests: defaultdict[str, int] = defaultdict(int)  # file -> tests run (their call phase)
        self.is_worker = hasattr(config, "workerinput")  # a pytest-xdist worker writes nothing

    def pytest_report_header(self, config: pytest.Config) -> str | None:
        if self.shard is None:
            return None
        return f"shard {self.shard[0]}/{self.shard[1]} (tests/helpers/shard.py; files by tests/durations.json)"

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        table = config.getoption("shard_durations")
        durations = load_durations(Path(table) if table else DURATIONS)
        if self.shard is not None:
            k, n = self.shard
            placed = assign({file_of(item.nodeid) for item in items}, durations, n)
            keep = [item for item in items if placed[file_of(item.nodeid)] == k - 1]
            dropped = [item for item in items if placed[file_of(item.nodeid)] != k - 1]
            if dropped:
                config.hook.pytest_deselected(items=dropped)
            items[:] = keep
        if self.is_worker:
            # pytest-xdist (``-n 2 --dist loadfile``) hands out files in collection order:
            # longest first, so that no long file starts last and leaves one worker alone at
            # the end. (Every worker sorts alike: their collections must match.)
            rank = {f: i for i, f in enumerate(longest_first({file_of(i.nodeid) for i in items}, durations))}
            items.sort(key=lambda item: rank[file_of(item.nodeid)])  # stable: a file keeps its order

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if self.out is None:
            return
        self.seconds[file_of(report.nodeid)] += report.duration
        if report.when == "call":
            self.tests[file_of(report.nodeid)] += 1

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.out is None or self.is_worker:
            return
        files = sorted(f for f in self.seconds if self.tests[f])  # not a file whose tests all skipped
        Path(self.out).write_text(json.dumps(
            {"seconds": {f: round(self.seconds[f], 2) for f in files},
             "tests": {f: self.tests[f] for f in files}}, indent=1) + "\n")


def add_options(parser: pytest.Parser) -> None:
    """The options, for ``tests/conftest.py``'s ``pytest_addoption``."""
    group = parser.getgroup("shard", "run a share of the suite (tests/helpers/shard.py)")
    group.addoption("--shard", default=None, metavar="K/N",
                    help="run only the K-th of N deterministic shares of the test files")
    group.addoption("--shard-durations", default=None, metavar="PATH",
                    help="the seconds-per-file table that places the files (default tests/durations.json)")
    group.addoption("--shard-durations-out", default=None, metavar="PATH",
                    help="write the seconds each test file took (JSON) to PATH")


ABOUT = ("seconds per test file (setup, call and teardown summed), for --shard's placement and "
         "pytest-xdist's order (tests/helpers/shard.py); refresh from a run's --shard-durations-out "
         "files: python -m tests.helpers.shard merge tests/durations.json FILE... > new.json")


def merge(paths: list[str]) -> dict[str, object]:
    """One table from several ``--shard-durations-out`` files (later files win per file)."""
    seconds: dict[str, float] = {}
    for path in paths:
        seconds.update(json.loads(Path(path).read_text())["seconds"])
    return {"about": ABOUT, "seconds": dict(sorted(seconds.items()))}


if __name__ == "__main__":  # python -m tests.helpers.shard merge OLD.json NEW.json... > new.json
    if len(sys.argv) < 3 or sys.argv[1] != "merge":
        sys.exit("usage: python -m tests.helpers.shard merge tests/durations.json NEW.json... > new.json")
    print(json.dumps(merge(sys.argv[2:]), indent=1))
