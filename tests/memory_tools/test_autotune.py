"""The allocator autotuner (cudalab.memory_tools.autotune) and its parallel replays
(cudalab.memory_tools.replay_workers), on small ragged traces (the full-size figures are in
benchmarks/what_if.py)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest

import cudalab
from cudalab.memory_tools.synthetic import ragged_inference_trace

pd = pytest.importorskip("pandas")
at = importlib.import_module("cudalab.memory_tools.autotune")
rp = importlib.import_module("cudalab.memory_tools.replay")
rw = importlib.import_module("cudalab.memory_tools.replay_workers")

SMALL = {"steps": 40, "layers": 2, "max_batch": 6, "arrival_rate": 1.0, "seed": 5}
SETTINGS = ["expandable_segments:True", "max_split_size_mb:64", "roundup_power2_divisions:4",
            "expandable_segments:True,roundup_power2_divisions:8",
            "expandable_segments:True,per_process_memory_fraction:0.9"]


def _replay(trace, setting, memory):
    """One replay as the autotuner makes it (stopping at the first out-of-memory)."""
    tr = rp.load_trace(trace)
    return rp.replay_planned(tr, rp.plan_replay(tr), setting, memory, None, stop_at_oom=True)


@pytest.fixture(scope="module")
def trace():
    return ragged_inference_trace(**SMALL)


@pytest.fixture(scope="module")
def peak(trace):
    return rp.replay(trace).peak_reserved


@pytest.fixture(scope="module")
def tuned(trace, peak):
    # three capacities: unconstraining, one the defaults fit, one they do not
    return at.autotune(trace, [None, peak + (64 << 20), peak - (8 << 20)],
                       SETTINGS + ["max_split_size_mb:5", "nonsense:1"], workers=1)


def test_grid_is_wide_and_valid():
    grid = at.DEFAULT_SETTINGS
    assert len(grid) >= 50 and len(set(grid)) == len(grid)
    for key in ("expandable_segments", "max_split_size_mb", "roundup_power2_divisions",
                "garbage_collection_threshold", "backend:cudaMallocAsync",
                "per_process_memory_fraction"):
        assert any(key in s for s in grid), key
    for s in grid:
        rp.as_config(s)  # every default setting parses


def test_frame_has_a_row_per_setting_and_capacity(tuned, peak):
    caps = tuned.attrs["capacities"]
    assert caps == [None, peak + (64 << 20), peak - (8 << 20)]
    for column in ("setting", "capacity", "peak_reserved", "peak_allocated",
                   "reserved_over_allocated", "driver_allocs", "retries", "first_oom"):
        assert column in tuned.columns
    n_settings = tuned["setting"].nunique()
    assert n_settings == 1 + len(SETTINGS) + 2  # the defaults, the settings, two refused
    assert len(tuned) == n_settings * len(caps)


def test_refused_settings_are_named(tuned):
    refused = tuned.attrs["refused"]
    assert "max_split_size_mb:5" in refused and "nonsense:1" in refused
    assert "nonsense" in refused["nonsense:1"]
    rows = tuned[tuned["setting"] == "nonsense:1"]
    assert len(rows) == 3 and rows["status"].str.startswith("refused").all()
    # a memory fraction on an unconstraining device is refused there, replayed elsewhere
    capped = tuned[tuned["setting"] == "expandable_segments:True,per_process_memory_fraction:0.9"]
    assert capped["capacity"].isna().sum() == 1
    assert capped[capped["capacity"].isna()]["status"].iloc[0].startswith("refused")
    assert (capped[capped["capacity"].notna()]["rank"] > 0).all()


def test_rows_are_ranked_within_each_capacity(tuned):
    for cap in tuned.attrs["capacities"]:
        part = tuned[at._same_capacity(tuned["capacity"], cap) & (tuned["rank"] > 0)]
        keys = [(r.ooms > 0, r.peak_reserved, r.driver_allocs, r.retries)
                for r in part.itertuples()]
        assert keys == sorted(keys)
        assert list(part["rank"]) == list(range(1, len(part) + 1))


def test_tight_capacity_runs_out_and_says_where(tuned, trace, peak):
    tight = peak - (8 << 20)
    row = tuned[(tuned["setting"] == "default") & (tuned["capacity"] == tight)].iloc[0]
    real = _replay(trace, "", tight)
    assert row["peak_reserved"] == real.peak_reserved
    if real.ooms:
        assert row["status"] == "out of memory"
        assert row["first_oom"] == real.oom_entries[0][0]
        assert row["first_oom_bytes"] == real.oom_entries[0][1]
    else:
        assert real.retries > 0 and row["retries"] == real.retries


def test_derived_rows_equal_real_replays(tuned, trace, peak):
    derived = tuned[tuned["derived"]]
    assert (derived["capacity"] == peak + (64 << 20)).sum() >= 4  # every plain setting fits
    for r in derived.itertuples():
        setting = "" if r.setting == "default" else r.setting
        real = _replay(trace, setting, int(r.capacity))
        assert (real.peak_reserved, real.peak_allocated, real.num_device_alloc,
                real.retries, real.ooms) == (r.peak_reserved, r.peak_allocated,
                                             r.driver_allocs, r.retries, r.ooms)


def test_parallel_equals_serial(trace, peak):
    caps = [None, peak - (8 << 20)]
    serial = at.autotune(trace, caps, SETTINGS[:3], workers=1)
    parallel = at.autotune(trace, caps, SETTINGS[:3], workers=2)
    cols = ["setting", "capacity", "peak_reserved", "peak_allocated", "driver_allocs",
            "retries", "ooms", "first_oom"]
    pd.testing.assert_frame_equal(serial[cols], parallel[cols])


def test_recommendation(tuned, peak):
    rec = tuned.attrs["recommendation"]
    best = tuned[tuned["capacity"].isna() & (tuned["rank"] == 1)].iloc[0]
    assert rec["setting"] == ("" if best["setting"] == "default" else best["setting"])
    if rec["setting"]:
        assert rec["line"] == f"PYTORCH_CUDA_ALLOC_CONF={rec['setting']}"
        cudalab.memory.parse_alloc_conf(rec["setting"])  # pastable
    assert "device" in rec["text"]
    tight = at.recommendation(tuned, peak - (8 << 20))
    assert tight["capacity"] == peak - (8 << 20)
    text = at.format_autotune(tuned)
    assert "recommended:" in text and "refused: nonsense:1" in text


def test_capacity_from_the_trace(trace):
    snap = {"device_traces": [[{"action": a, "addr": addr, "size": n, "stream": s}
                               for a, addr, n, s in trace]],
            "segments": [], "device_memory": [3 << 30]}
    df = at.autotune(snap, settings=["expandable_segments:True"], workers=1)
    assert df.attrs["capacities"] == [3 << 30]
    assert "taken from the trace" in df.attrs["capacity_note"]
    # torch's snapshots: an oom entry's free bytes plus what was reserved then
    torch_like = {"segments": [{"device": 0, "total_size": 40 << 20}], "device_traces": [[
        {"action": "segment_alloc", "addr": 1 << 30, "size": 20 << 20, "stream": 0},
        {"action": "oom", "size": 1 << 30, "device_free": 100 << 20, "stream": 0},
        {"action": "segment_alloc", "addr": 2 << 30, "size": 20 << 20, "stream": 0}]]}
    assert at.trace_capacity(torch_like)[0] == (100 << 20) + (20 << 20)
    assert at.trace_capacity([("alloc", 1, 2, 0)])[0] is None
    plain = at.autotune(trace, settings=["expandable_segments:True"], workers=1)
    assert plain.attrs["capacities"] == [None]
    assert "unconstraining" in plain.attrs["capacity_note"]


def test_snapshot_records_device_memory():
    x = cudalab.empty(1024)
    snap = cudalab.memory._snapshot()
    del x
    total = cudalab.get_device_properties(0).total_memory
    assert snap["device_memory"][0] == total


def test_bad_arguments(trace):
    with pytest.raises(ValueError, match="capacities is empty"):
        at.autotune(trace, [], workers=1)
    with pytest.raises(ValueError, match="capacity"):
        at.autotune(trace, [1024], workers=1)
    with pytest.raises(TypeError, match="capacity"):
        at.autotune(trace, [1.5], workers=1)
    with pytest.raises(ValueError, match="workers"):
        at.autotune(trace, None, ["expandable_segments:True"], workers=0)


def test_workers_environment(monkeypatch):
    monkeypatch.setenv("CUDALAB_REPLAY_WORKERS", "3")
    assert rw.default_workers(10) == 3 and rw.default_workers(2) == 2
    monkeypatch.setenv("CUDALAB_REPLAY_WORKERS", "many")
    with pytest.raises(ValueError, match="CUDALAB_REPLAY_WORKERS"):
        rw.default_workers(4)


def test_memory_facade_exports_autotune():
    assert cudalab.memory.autotune is at.autotune


def test_cli_search(tmp_path, trace):
    import pickle

    path = tmp_path / "t.pickle"
    path.write_bytes(pickle.dumps({"trace": trace}))
    cmd = [sys.executable, "-m", "cudalab", "what-if", "--search", str(path), "--workers", "1",
           "--conf", "expandable_segments:True", "--conf", "bogus:1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "recommended:" in out.stdout and "refused: bogus:1" in out.stdout
    out = subprocess.run(cmd + ["--json", "--capacity", "4GiB"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["capacities"] == [4 << 30] and "bogus:1" in data["refused"]
    assert {r["setting"] for r in data["rows"]} == {"default", "expandable_segments:True",
                                                    "bogus:1"}


def test_idle_max_split_takes_the_rows_of_the_setting_without_it(trace, peak):
    biggest = max(n for a, _, n, _ in trace if a == "alloc")
    assert at._idle_split("max_split_size_mb:4096", biggest) == ""
    assert at._idle_split("roundup_power2_divisions:[256:1,>:8],max_split_size_mb:4096",
                          biggest) == "roundup_power2_divisions:[256:1,>:8]"
    assert at._idle_split("expandable_segments:True,max_split_size_mb:4096", biggest) is None
    assert at._idle_split("max_split_size_mb:21", 1 << 30) is None  # a segment reaches it
    tight = peak - (8 << 20)
    df = at.autotune(trace, [tight], ["max_split_size_mb:4096"], workers=1)
    row = df[df["setting"] == "max_split_size_mb:4096"].iloc[0]
    assert row["derived"]
    real = _replay(trace, "max_split_size_mb:4096", tight)
    assert (real.peak_reserved, real.num_device_alloc, real.retries, real.ooms) == \
        (row["peak_reserved"], row["driver_allocs"], row["retries"], row["ooms"])


def test_default_grid_adds_caps_tuned_to_the_trace(trace):
    cap = 4 << 30
    df = at.autotune(trace, [cap, None], workers=2)
    assert df["setting"].nunique() >= 50 + 1
    plan_live = rp.plan_replay(rp.load_trace(trace)).peak_live
    tuned = df[df["setting"].str.contains("per_process_memory_fraction:0.0")]
    assert len(tuned) and tuned["capacity"].notna().all()  # only on the device given
    for r in tuned.itertuples():
        fraction = float(r.setting.rsplit(":", 1)[1])
        assert any(abs(fraction - k * plan_live / cap) < 2e-4 for k in at.TUNED_CAPS)
        if r.status == "ok":  # a cap above the live peak: reserved stays under it
            assert r.peak_reserved <= fraction * cap + (2 << 20)
    rec = at.recommendation(df, cap)
    best = df[(df["capacity"] == cap) & (df["rank"] == 1)].iloc[0]
    assert rec["peak_reserved"] == best["peak_reserved"]
    if rec["retries"]:
        assert "without a retry the best is" in rec["text"]


def test_start_method_avoids_fork_beside_threads(monkeypatch):
    import sys as _sys
    import threading

    monkeypatch.delenv("CUDALAB_REPLAY_START", raising=False)
    if not _sys.platform.startswith("linux"):
        pytest.skip("fork is chosen on Linux only")
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        assert rw._start_method() in ("forkserver", "spawn")
    finally:
        stop.set()
        t.join()
    monkeypatch.setenv("CUDALAB_REPLAY_START", "no-such-method")
    with pytest.raises(ValueError, match="CUDALAB_REPLAY_START"):
        rw._start_method()


def test_a_cap_never_reached_takes_its_base_rows(trace, peak):
    roomy = 4 << 30
    settings = ["expandable_segments:True", "expandable_segments:True,per_process_memory_fraction:0.99",
                "garbage_collection_threshold:0.8,per_process_memory_fraction:0.99",
                "garbage_collection_threshold:0.8,per_process_memory_fraction:"
                f"{(peak + (1 << 20)) / roomy:.4f}"]  # the threshold acts: replayed
    df = at.autotune(trace, [roomy], settings, workers=1)
    rows = {r.setting: r for r in df.itertuples()}
    assert rows["expandable_segments:True,per_process_memory_fraction:0.99"].derived
    assert rows["garbage_collection_threshold:0.8,per_process_memory_fraction:0.99"].derived
    assert not rows[settings[3]].derived
    for s in settings:
        real = _replay(trace, s, roomy)
        r = rows[s]
        assert (real.peak_reserved, real.num_device_alloc, real.retries, real.ooms) == \
            (r.peak_reserved, r.driver_allocs, r.retries, r.ooms), s
    assert at._cap_base("expandable_segments:True,garbage_collection_threshold:0.6,"
                        "per_process_memory_fraction:0.5") == "expandable_segments:True"


def test_stop_at_oom_ends_the_replay_at_the_first_out_of_memory(trace, peak):
    tight = peak // 2
    full = rp.replay(trace, "", device_memory=tight)
    short = _replay(trace, "", tight)
    assert full.ooms > 1 and short.ooms == 1
    assert short.oom_entries[0] == full.oom_entries[0]
    assert short.peak_reserved <= full.peak_reserved


def test_rounded_sizes_equal_round_size():
    import numpy as np

    from cudalab.allocator.policy import round_size

    rng = np.random.default_rng(7)
    sizes = np.unique(np.concatenate([
        rng.integers(1, 1 << 12, 300), rng.integers(1, 1 << 24, 3000),
        rng.integers(1 << 20, 1 << 36, 3000), 1 << np.arange(0, 40),
        (1 << np.arange(9, 40)) + 1, (1 << np.arange(9, 40)) - 1]))
    for text in ("", "roundup_power2_divisions:2", "roundup_power2_divisions:16",
                 "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]",
                 "roundup_power2_divisions:[1:4,2:8,4:2,>:1]",
                 "expandable_segments:True,roundup_power2_divisions:8"):
        cfg = rp.as_config(text)
        got = at.rounded_sizes(sizes, cfg)
        want = [round_size(int(s), cfg) for s in sizes.tolist()]
        assert got.tolist() == want, text


def test_a_rounding_that_changes_no_block_takes_the_rows_it_equals(trace, peak):
    # the trace's requests are all far below 256 MiB: torch's per-band example rounds
    # none of them, 16 divisions round some
    same = "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]"
    es_same = "expandable_segments:True,roundup_power2_divisions:[256:1,512:2,1024:4,>:8]"
    other = "roundup_power2_divisions:16"
    labels = ["", same, "expandable_segments:True", es_same, other,
              "max_split_size_mb:4096," + same, "backend:cudaMallocAsync"]
    labels = [rp.config_text(rp.as_config(s)) for s in labels]
    tr = rp.load_trace(trace)
    plan = rp.plan_replay(tr)
    alias = at._aliases(labels, plan.action, plan.size)
    assert alias[labels[1]] == "" and alias[labels[3]] == labels[2]
    assert alias[labels[5]] == ""  # an idle max_split_size_mb, then the rounding
    assert labels[4] not in alias and labels[6] not in alias
    tight = peak - (8 << 20)
    df = at.autotune(trace, [None, tight], labels[1:], workers=1)
    for s in (labels[1], labels[3], labels[5]):
        for cap in (None, tight):
            row = df[(df["setting"] == s) & at._same_capacity(df["capacity"], cap)].iloc[0]
            assert row["derived"]
            real = _replay(trace, s, cap)
            assert (real.peak_reserved, real.peak_allocated, real.num_device_alloc,
                    real.retries, real.ooms) == (row["peak_reserved"], row["peak_allocated"],
                                                 row["driver_allocs"], row["retries"],
                                                 row["ooms"]), (s, cap)
