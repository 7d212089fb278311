"""What-if on a ragged-batch inference workload: the generator, the bounded search, the
explanation and the ``what-if`` command (cudalab.memory_tools.synthetic, .what_if,
.what_if_grid).

The search runs on small traces (a few thousand entries) to stay fast; the numbers of the
full-size trace are in ``benchmarks/what_if.py``.
"""

from __future__ import annotations

import importlib
import os
import pathlib
import pickle
import subprocess
import sys
import warnings
from types import SimpleNamespace

import numpy as np
import pytest

import cudalab
from cudalab.memory_tools import what_if_grid
from cudalab.memory_tools.synthetic import ragged_inference_trace, ragged_inference_workload
from cudalab.memory_tools.trace_io import load_trace

rp = importlib.import_module("cudalab.memory_tools.replay")
wi = importlib.import_module("cudalab.memory_tools.what_if")

ROOT = pathlib.Path(cudalab.__file__).resolve().parent.parent
SMALL = {"steps": 60, "layers": 2, "max_batch": 8, "arrival_rate": 1.0, "seed": 3}


@pytest.fixture(scope="module")
def small_trace():
    return ragged_inference_trace(**SMALL)


@pytest.fixture(scope="module")
def searched(small_trace):
    pytest.importorskip("pandas")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a complete trace: nothing skipped
        return wi.what_if(small_trace)


# --------------------------------------------------------------------------- the generator
def test_ragged_trace_is_deterministic_and_ragged(small_trace):
    assert ragged_inference_trace(**SMALL) == small_trace
    assert ragged_inference_trace(**{**SMALL, "seed": 4}) != small_trace
    allocs = [e for e in small_trace if e[0] == "alloc"]
    frees = [e for e in small_trace if e[0] == "free_requested"]
    assert len(allocs) == len(frees) > 1000  # every allocation is freed by the end
    assert {a[1] for a in allocs} == {f[1] for f in frees}
    assert len({a[2] for a in allocs}) > 100  # ragged: many distinct sizes
    # LIFO-ish activations: a third of the frees release one of the last four live blocks;
    # the others free a KV cache after its grown copy, or a finished request's caches
    live: list[int] = []
    recent = 0
    for action, addr, _, _ in small_trace:
        if action == "alloc":
            live.append(addr)
        else:
            recent += addr in live[-4:]
            live.remove(addr)
    assert 0.3 * len(frees) < recent < 0.9 * len(frees)


def test_workload_counts_and_bad_arguments():
    sizes: list[int] = []
    counts = ragged_inference_workload(lambda n: sizes.append(n) or n, lambda h: None, **SMALL)
    assert counts["allocations"] == len(sizes) and counts["requests"] >= counts["finished"] > 0
    assert max(sizes) < counts["peak_live_bytes"] <= sum(sizes)
    for bad in ({"steps": 0}, {"layers": 1.5}, {"hidden": True}, {"arrival_rate": 0},
                {"batching": "dynamic"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ragged_inference_workload(lambda n: n, lambda h: None, **bad)


def test_static_batching_runs_padded_batches():
    """Static batching: each batch runs to its end before the next starts; its one K and V
    cache per layer grows by the batch's row count times a token row at every step."""
    kv = 1024 * 2
    sizes: list[int] = []
    counts = ragged_inference_workload(lambda n: sizes.append(n) or n, lambda h: None,
                                       batching="static", steps=150, layers=1, max_batch=8,
                                       max_new_tokens=12, seed=5)
    assert counts["requests"] > 8 and 0 < counts["requests"] - counts["finished"] <= 8
    assert ragged_inference_trace(batching="static", steps=50, seed=5) == \
        ragged_inference_trace(batching="static", steps=50, seed=5)
    assert ragged_inference_trace(batching="static", steps=50, seed=5) != \
        ragged_inference_trace(steps=50, seed=5)
    # a step of a one-layer model makes 16 allocations: x, norm, qkv, K, V, attn, proj, h,
    # norm, up, gate, act, down, out, logits, ids; K grows by rows * kv, 1 <= rows <= 8
    assert len(sizes) == 16 * 150
    k = sizes[3::16]
    assert k == sizes[4::16]  # V is K's size
    growth = [b - a for a, b in zip(k, k[1:]) if 0 < b - a <= 8 * kv]
    assert len(growth) > 100 and all(d % kv == 0 for d in growth)
    assert len(set(growth)) > 1  # batches of several sizes


def test_recorded_trace_is_the_workload(small_trace):
    """The same workload run for real through cudalab's allocator (cudalab.empty) with the
    history recorder on gives a genuine trace with the same requests, which replays to the
    same peaks as the generator's trace."""
    cudalab.empty_cache()
    live: dict[int, object] = {}

    def allocate(nbytes: int) -> int:
        array = cudalab.empty(nbytes, dtype="uint8")
        live[id(array)] = array
        return id(array)

    cudalab.memory._record_memory_history(max_entries=1_000_000)
    try:
        ragged_inference_workload(allocate, lambda h: live.pop(h) is None, **SMALL)  # (no bool() of an array: torch raises for more than one element)
        snapshot = cudalab.memory._snapshot()
    finally:
        cudalab.memory._record_memory_history(None)
    assert not live
    trace = load_trace(snapshot)
    recorded = [int(s) for a, s in zip(trace.action, trace.size) if a == 1]
    assert recorded == [e[2] for e in small_trace if e[0] == "alloc"]
    for conf in ("", "expandable_segments:True"):
        a, b = rp.replay(snapshot, conf), rp.replay(small_trace, conf)
        assert (a.peak_reserved, a.peak_allocated) == (b.peak_reserved, b.peak_allocated)


# --------------------------------------------------------------------------- the search
def test_search_tries_the_settings_users_would(searched):
    labels = set(searched["config"])
    assert set(wi.DEFAULT_WHAT_IF_CONFIGS) - {""} <= labels and "default" in labels
    assert any(c.startswith("expandable_segments:True,max_split_size_mb:") for c in labels)
    assert "expandable_segments:True,roundup_power2_divisions:[256:1,512:2,1024:4,>:8]" in labels
    gc = [c for c in labels if "garbage_collection_threshold" in c]
    assert gc and all("per_process_memory_fraction" in c for c in gc)
    assert any("expandable_segments:True" in c for c in gc)  # combinations with a cap
    assert len(searched) <= what_if_grid.MAX_REPLAYS
    assert searched.attrs["searched"] and searched.attrs["elapsed_s"] > 0


def test_best_row_is_the_minimum(searched):
    fine = searched[searched["ooms"] == 0]
    best = searched.iloc[0]
    assert best["ooms"] == 0 and best["peak_reserved"] == fine["peak_reserved"].min()
    assert list(fine["peak_reserved"]) == sorted(fine["peak_reserved"])
    assert list(searched["ooms"] > 0) == sorted(searched["ooms"] > 0)
    assert best["peak_reserved"] < searched[searched["config"] == "default"].iloc[0]["peak_reserved"]


def test_ratios_match_a_direct_replay(small_trace, searched):
    peak_live = rp.plan_replay(load_trace(small_trace)).peak_live
    assert searched.attrs["peak_live"] == peak_live
    results = searched.attrs["results"]
    picks = {0, 1, len(searched) - 1, int(np.flatnonzero(searched["config"] == "default")[0])}
    for pos in sorted(picks):
        row, r = searched.iloc[pos], results[pos]
        direct = rp.replay(small_trace, row["config"] if row["config"] != "default" else None,
                           device_memory=r.device_memory)
        assert (direct.peak_reserved, direct.peak_allocated, direct.retries, direct.ooms) == (
            row["peak_reserved"], row["peak_allocated"], row["retries"], row["ooms"])
        assert row["peak_ratio"] == pytest.approx(direct.peak_reserved / direct.peak_allocated)
        assert row["live_ratio"] == pytest.approx(direct.peak_reserved / peak_live)
        assert row["ratio"] == pytest.approx(direct.ratio)


def test_breakdown_adds_up_and_is_explained(searched):
    peak_live = searched.attrs["peak_live"]
    for (_, row), b in zip(searched.iterrows(), searched.attrs["breakdown"]):
        if row["ooms"]:
            continue
        assert b["requested"] + b["rounding"] + b["free_cached"] == row["peak_reserved"]
        assert b["requested"] == peak_live and b["rounding"] >= 0 and b["free_cached"] >= 0
        assert b["requested"] + b["rounding"] == row["peak_allocated"]
        assert row["peak_reserved"] / (b["requested"] + b["rounding"]) == pytest.approx(
            row["peak_ratio"])
    text = wi.format_what_if(searched, target=1.10)
    assert "where the reserved peak goes" in text and "expandable segments map pages" in text
    assert "goal <= 1.10" in text and "simulated" in text and "run time" in text
    best = searched.iloc[0]
    reached = (searched["live_ratio"][searched["ooms"] == 0] <= 1.10).any()
    assert ("NOT reached" in text) != reached
    # judged on res/live, never below res/alloc (allocated blocks hold the requested bytes)
    fine = searched[searched["ooms"] == 0]
    assert (fine["live_ratio"] >= fine["peak_ratio"] - 1e-12).all()
    goal = wi.format_what_if(searched, target=0.5)  # unreachable: the closest is named
    closest = fine.loc[fine["live_ratio"].idxmin()]
    assert f"NOT reached on res/live by any setting; closest: {closest['config']} " in goal
    assert f"best: {best['config']}" in text


def test_grid_prunes_and_descends_with_a_fake_replay():
    """The search logic alone: idle max_split values are not combined, the fraction descent
    stops at the first OOM and bisects, fractions below the live bytes are never tried."""
    calls: list[tuple[str, int | None]] = []
    mib = 1 << 20

    def run(text: str, memory: int | None):
        calls.append((text, memory))
        peak, ooms = 1000 * mib, 0
        if "expandable_segments:True" in text:
            peak = 800 * mib
        if "per_process_memory_fraction:" in text:
            fraction = float(text.rsplit(":", 1)[1])
            peak = min(peak, int(fraction * 1000 * mib))
            ooms = int(fraction < 0.72)
        return SimpleNamespace(peak_reserved=peak, num_device_alloc=1, retries=0, ooms=ooms)

    results, cap = what_if_grid.search(run, peak_live=600 * mib)
    texts = [t for t, _ in calls]
    assert cap == 1000 * mib  # a device the defaults exactly fill
    assert len(texts) == len(set(texts)) == len(results) <= what_if_grid.MAX_REPLAYS
    assert texts[:len(what_if_grid.SINGLE_SETTINGS)] == list(what_if_grid.SINGLE_SETTINGS)
    assert "expandable_segments:True,max_split_size_mb:512" in texts  # shown once
    assert not any(t.startswith("max_split_size_mb:") and "," in t for t in texts)
    es = [t for t in texts if t.startswith("expandable_segments:True,garbage")]
    fractions = [float(t.rsplit(":", 1)[1]) for t in es if "threshold:0.8" in t]
    # 0.95 to 0.8 leave room for the 800 MiB the base reserves: skipped (nothing would act)
    assert fractions[:2] == [0.75, 0.7]  # down to the first OOM
    assert fractions[2:] == [0.725, 0.7125]  # then two bisections
    plain = [float(t.rsplit(":", 1)[1]) for t in texts
             if t.startswith("garbage_collection_threshold:0.8")]
    assert plain[:2] == [0.95, 0.9]  # garbage collection acts at 0.8 of 950 MiB < 1000 MiB
    assert "expandable_segments:True,garbage_collection_threshold:0.6," \
           "per_process_memory_fraction:0.725" in texts  # the best cap, other threshold
    assert all(m == cap for t, m in calls if "fraction" in t)
    _, cap = what_if_grid.search(run, peak_live=600 * mib, device_memory=5000 * mib)
    assert cap == 5000 * mib

    calls.clear()
    results, cap = what_if_grid.search(run, peak_live=999 * mib)
    assert not any("fraction" in t for t, _ in calls)  # every fraction < the live bytes
    calls.clear()
    results, cap = what_if_grid.search(run, peak_live=0)  # an empty trace: stage 1 only
    assert [t for t, _ in calls] == list(what_if_grid.SINGLE_SETTINGS)


# --------------------------------------------------------------------------- the command
def test_cli_prints_the_searched_table(tmp_path, small_trace):
    path = tmp_path / "ragged.pickle"
    path.write_bytes(pickle.dumps({"trace": small_trace}, protocol=4))
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDALAB_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONIOENCODING"] = "utf-8"
    res = subprocess.run([sys.executable, "-m", "cudalab", "what-if", str(path), "--target",
                          "1.10"], capture_output=True, text=True, encoding="utf-8", env=env,
                         timeout=600, cwd=str(ROOT))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    header = next(line for line in lines if line.startswith("rank"))
    assert "res/alloc" in header and "res/live" in header
    assert any("expandable_segments:True,garbage_collection_threshold" in line for line in lines)
    assert "goal <= 1.10" in res.stdout and "run time" in res.stdout


def test_empty_trace_searches_single_settings_only():
    pytest.importorskip("pandas")
    df = wi.what_if([])
    assert len(df) == len(what_if_grid.SINGLE_SETTINGS) and df.attrs["peak_live"] == 0
    assert "nothing to measure" in wi.format_what_if(df, target=1.10)


def test_a_large_device_tries_no_cap_and_says_so(small_trace):
    pytest.importorskip("pandas")
    df = wi.what_if(small_trace, device_memory=80 << 30)
    assert not df["config"].str.contains("per_process_memory_fraction").any()
    assert "no per_process_memory_fraction was tried" in df.attrs["note"]
    assert all(r.device_memory == 80 << 30 for r in df.attrs["results"])
