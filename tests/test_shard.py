"""``--shard K/N`` (tests/helpers/shard.py): the shards split the files, together run every
test exactly once, agree between processes, and balance the committed durations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.shard import assign, file_of, load_durations, longest_first, parse_shard

ROOT = Path(__file__).resolve().parents[1]


def test_parse_shard():
    assert parse_shard("1/2") == (1, 2) and parse_shard("3/3") == (3, 3)
    for bad in ("0/2", "3/2", "2", "a/b"):
        with pytest.raises(ValueError):
            parse_shard(bad)


def test_file_of():
    assert file_of("tests/a/test_b.py::test_c[x::y]") == "tests/a/test_b.py"
    assert file_of("tests/a/test_b.py::C::test_d") == "tests/a/test_b.py"


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_assign_places_every_file_once_and_is_stable(n):
    files = [f"tests/test_{i}.py" for i in range(40)]
    durations = {f: float(i % 7 + 1) for i, f in enumerate(files[:30])}  # ten are new
    placed = assign(files, durations, n)
    assert sorted(placed) == sorted(files) and all(0 <= s < n for s in placed.values())
    assert assign(list(reversed(files)), dict(reversed(durations.items())), n) == placed
    # a new file's shard does not depend on the others
    for f in files[30:]:
        assert assign([f], {}, n)[f] == placed[f]


def test_assign_balances_known_durations():
    durations = {"a": 10.0, "b": 9.0, "c": 5.0, "d": 5.0, "e": 1.0}
    placed = assign(list(durations), durations, 2)
    load = [sum(t for f, t in durations.items() if placed[f] == s) for s in range(2)]
    assert sorted(load) == [15.0, 15.0]


def test_longest_first():
    durations = {"a": 1.0, "b": 9.0, "c": 5.0}
    assert longest_first({"a", "b", "c", "new"}, durations) == ["b", "c", "new", "a"]  # new: the median
    assert longest_first(["x", "y"], {}) == ["x", "y"]


def test_the_readme_command_runs_pytest_on_two_workers_by_file():
    """The README's test command (which .ci/run runs, tests/test_docs.py checks) runs pytest
    with pytest-xdist, whole files per worker, and the dev extra brings pytest-xdist."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    pytest_step = next(step for step in readme.split(" && ") if "-m pytest" in step)
    words = pytest_step.split()
    assert words[words.index("-n") + 1] == "2" and words[words.index("--dist") + 1] == "loadfile"
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    dev = pyproject.split("\ndev = [", 1)[1].split("]", 1)[0]
    assert '"pytest-xdist' in dev


def test_the_suite_splits_in_two_balanced_shards():
    """The committed table over today's test files: the two shards' known seconds differ by at
    most the longest file (greedy's bound) and every file has one shard."""
    durations = load_durations()
    assert durations, "tests/durations.json is missing or empty"
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py")}
    placed = assign(files, durations, 2)
    assert set(placed) == files
    load = [sum(durations.get(f, 0.0) for f in files if placed[f] == s) for s in range(2)]
    assert abs(load[0] - load[1]) <= max(durations.get(f, 0.0) for f in files) + 1.0, load


_CONFTEST = """
from tests.helpers.shard import ShardPlugin, add_options

def pytest_addoption(parser):
    add_options(parser)

def pytest_configure(config):
    config.pluginmanager.register(ShardPlugin(config), "cudalab-shard")
"""


def _collect(where: Path, *args: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-p", "no:xdist", "--rootdir", str(where), *args, str(where)],
                         cwd=where, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode in (0, 5), run.stdout + run.stderr
    return [line for line in run.stdout.splitlines() if "::" in line]


def test_shards_run_every_test_exactly_once(tmp_path):
    (tmp_path / "conftest.py").write_text(_CONFTEST)
    for i in range(9):
        body = "".join(f"def test_{j}():\n    pass\n" for j in range(i + 1))
        (tmp_path / f"test_f{i}.py").write_text(body)
    table = tmp_path / "durations.json"
    table.write_text(json.dumps({"seconds": {"test_f0.py": 30.0, "test_f1.py": 20.0, "test_f2.py": 5.0}}))
    everything = _collect(tmp_path)
    assert len(everything) == 45
    for n in (2, 3):
        shards = [_collect(tmp_path, "--shard", f"{k}/{n}", "--shard-durations", str(table))
                  for k in range(1, n + 1)]
        assert sorted(sum(shards, [])) == sorted(everything)  # each test once, none lost
        assert all(shards)
        files = [{file_of(t) for t in shard} for shard in shards]
        assert sum(len(f) for f in files) == 9  # a file is never split
        # the two longest known files are apart
        assert not any({"test_f0.py", "test_f1.py"} <= f for f in files)
