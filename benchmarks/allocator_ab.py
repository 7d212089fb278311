"""Allocator benchmark of two checkouts side by side: before/after tables for a change.

Runs ``allocator.latency`` (benchmarks/allocator.py: the cache-hit pairs and the stats
getters) in fresh processes that alternate between a BEFORE checkout and this one (the
order flips every round, so drift of the host does not favour either), and prints the
median of each row with the ratio after / before. On a GPU host torch's and CuPy's rows
run too; their code is the same on both sides, so how much they move shows the host's
noise.

    python benchmarks/allocator_ab.py BEFORE_DIR [--rounds N]
    (BEFORE_DIR: e.g. ``git worktree add /tmp/before <commit>``, or ``git archive``)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODE = ("import json, sys; sys.path.insert(0, 'benchmarks'); sys.path.insert(1, '.'); "
        "import allocator as A; print('JSON' + json.dumps(A.latency(20000, 5, {sim})))")


def _one(tree: str, sim: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=tree + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", CODE.format(sim=sim)], cwd=tree, env=env,
                          capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("JSON")]
    if not lines:
        raise RuntimeError(f"the benchmark failed in {tree}:\n{proc.stderr[-3000:]}")
    return json.loads(lines[0][4:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", help="the checkout to compare with (its root folder)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not os.path.isfile(os.path.join(args.before, "benchmarks", "allocator.py")):
        parser.error(f"{args.before} has no benchmarks/allocator.py")
    sim = os.environ.get("CUDALAB_SIMULATOR") == "1"
    trees = [("before", os.path.abspath(args.before)), ("after", HERE)]
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for i in range(args.rounds):
        for name, tree in trees if i % 2 == 0 else trees[::-1]:
            runs[name].append(_one(tree, sim))
    print(f"{'row (us, medians of ' + str(args.rounds) + ' processes)':<62} {'before':>9} "
          f"{'after':>9} {'ratio':>6}")
    for section, rows in runs["after"][0].items():
        for row in rows:
            before = [r[section][row] for r in runs["before"] if row in r.get(section, {})]
            if not before:
                continue
            b = statistics.median(before)
            a = statistics.median(r[section][row] for r in runs["after"])
            print(f"{section + ' ' + row:<62} {b:9.3f} {a:9.3f} {a / b:6.2f}")


if __name__ == "__main__":
    main()
