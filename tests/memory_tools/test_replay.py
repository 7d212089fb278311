"""Trace replay and what-if (cudalab.memory_tools.replay, .what_if, .trace_io) and the ``replay`` / ``what-if`` commands.

Every replay runs on a private simulator built by the replay itself; the live workloads here
run on private simulators built by the tests, with the trace logged by the test (not by the
history recorder), so nothing depends on the process's own allocator or on recording.
"""

from __future__ import annotations

import importlib
import json
import os
import pathlib
import pickle
import random
import subprocess
import sys
import warnings

import pytest

import cudalab
from cudalab.allocator.caching import DeviceCachingAllocator
from cudalab.allocator.config import AllocatorConfig, parse_alloc_conf
from cudalab.allocator.registry import native_allocator
from cudalab.memory_tools.progress import ProgressBar
from cudalab.memory_tools.trace_io import TraceError

# by module path: cudalab.memory may export the replay function under the module's name
rp = importlib.import_module("cudalab.memory_tools.replay")
wi = importlib.import_module("cudalab.memory_tools.what_if")

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
ROOT = pathlib.Path(cudalab.__file__).resolve().parent.parent
COLUMNS = ["config", "peak_reserved", "peak_allocated", "ratio", "peak_ratio", "live_ratio",
           "saving_vs_default", "saving_vs_default_pct", "device_mallocs", "retries", "ooms"]


# --------------------------------------------------------------------------- helpers
def private_sim(monkeypatch, memory: str = "16GiB"):
    from cudalab._driver.sim import SimulatorBackend

    with monkeypatch.context() as m:
        m.setenv("CUDALAB_SIMULATOR_DEVICES", "1")
        m.setenv("CUDALAB_SIMULATOR_MEMORY", memory)
        m.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        sim = SimulatorBackend()
    sim.init()
    return sim


def live_workload(alloc, seed: int = 1, steps: int = 1500, streams=(0, 7)):
    """A training-like mix of sizes, lifetimes and two streams, run on ``alloc``; returns
    the trace the test logged itself: (action, addr, size, stream) tuples."""
    rng = random.Random(seed)
    sizes = [300, 512, 4 * KiB, 100 * KiB, 1 * MiB, 1 * MiB + 512, 3 * MiB, 9 * MiB,
             11 * MiB, 25 * MiB, 70 * MiB]
    trace = []
    live: list[tuple[int, int, int]] = []
    for _ in range(steps):
        if live and rng.random() < 0.45:
            ptr, size, stream = live.pop(rng.randrange(len(live)))
            alloc.free(ptr)
            trace.append(("free_requested", ptr, size, stream))
        else:
            size = rng.choice(sizes) + rng.randrange(0, 8) * 512
            stream = rng.choice(streams)
            ptr = alloc.malloc(size, stream)
            trace.append(("alloc", ptr, size, stream))
            live.append((ptr, size, stream))
    return trace


def fragmenting_trace(rounds: int = 12, per_round: int = 4):
    """Large blocks that grow a little every round: a freed segment never fits the next
    round's requests, so the native allocator keeps adding segments; expandable segments
    merge the freed pages and reuse them."""
    trace, addr = [], 1 << 32
    for r in range(rounds):
        size = (12 + 2 * r) * MiB + 4096
        addrs = []
        for _ in range(per_round):
            addr += 1 << 30
            trace.append(("alloc", addr, size, 0))
            addrs.append(addr)
        for a in addrs:
            trace.append(("free_requested", a, size, 0))
    return trace


def torch_style_snapshot(trace, device_count: int = 1, device: int = 0) -> dict:
    """A snapshot dict in torch's schema (ISSUE4.md) whose device trace is ``trace`` plus the
    entries a recorder adds around it (segment_alloc, free_completed, snapshot)."""
    entries = []
    t = 0
    for action, addr, size, stream in trace:
        t += 3
        if action == "alloc":
            entries.append({"action": "segment_alloc", "addr": addr, "size": 2 * MiB,
                            "stream": stream, "time_us": t, "frames": []})
        entries.append({"action": action, "addr": addr, "size": size, "stream": stream,
                        "time_us": t, "frames": [{"filename": "train.py", "line": 10,
                                                  "name": "step"}],
                        "compile_context": "", "user_metadata": ""})
        if action == "free_requested":
            entries.append({"action": "free_completed", "addr": addr, "size": size,
                            "stream": stream, "time_us": t + 1, "frames": [],
                            "compile_context": "", "user_metadata": ""})
    entries.append({"action": "oom", "device_free": 0, "size": 1 << 40, "stream": 0,
                    "time_us": t + 5, "frames": []})
    traces = [[] for _ in range(device_count)]
    traces[device] = entries
    return {"segments": [], "device_traces": traces,
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1},
            "external_annotations": []}


def comparable(result: rp.ReplayResult) -> dict:
    d = result.to_dict()
    for key in ("elapsed_s", "entries_per_s"):
        d.pop(key)
    return d


def quiet_replay(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none expected
        return rp.replay(*args, **kwargs)


# --------------------------------------------------------------------------- replay
def test_replay_is_deterministic(monkeypatch):
    a = DeviceCachingAllocator(private_sim(monkeypatch), 0, AllocatorConfig(),
                               stream_resolver=lambda: 0)
    trace = live_workload(a)
    r1 = quiet_replay(trace)
    r2 = quiet_replay(trace)
    assert comparable(r1) == comparable(r2)
    assert r1.entries == len(trace) and r1.replayed == len(trace)
    assert r1.allocs + r1.frees == len(trace) and r1.skipped == {}
    assert r1.peak_reserved >= r1.peak_allocated > 0


@pytest.mark.parametrize("conf", ["", "expandable_segments:True", "max_split_size_mb:64",
                                  "roundup_power2_divisions:4", "backend:cudaMallocAsync"])
def test_replay_equals_live(monkeypatch, conf):
    """Run a workload live through a fresh allocator, log its trace, replay it: the replay
    reports the live allocator's peaks and device allocation count."""
    cfg = parse_alloc_conf(conf) if conf else AllocatorConfig()
    sim = private_sim(monkeypatch, "16GiB")
    if cfg.backend == "cudaMallocAsync":
        from cudalab.allocator.async_allocator import AsyncPoolAllocator

        live = AsyncPoolAllocator(sim, 0, cfg, stream_resolver=lambda: 0)
        side = sim.handle_int(sim.stream_create(0))
        trace = live_workload(live, streams=(0, side))
    else:
        live = native_allocator(sim, 0, cfg, stream_resolver=lambda: 0)
        trace = live_workload(live)
    stats = live.memory_stats()
    r = quiet_replay(trace, conf, device_memory=16 * GiB)
    assert r.peak_reserved == stats["reserved_bytes.all.peak"]
    assert r.peak_allocated == stats["allocated_bytes.all.peak"]
    if cfg.backend == "cudaMallocAsync":
        assert r.num_device_alloc == len(live._pool.chunks)
        assert r.backend == "cudaMallocAsync"
    else:
        assert r.num_device_alloc == stats["num_device_alloc"]
        assert r.num_device_free == stats["num_device_free"]
        assert r.retries == stats["num_alloc_retries"]
        assert r.final_reserved == stats["reserved_bytes.all.current"]
        assert r.final_allocated == stats["allocated_bytes.all.current"]
    assert r.ooms == 0 and r.config == conf
    # and the default device size (chosen by the replay) does not change the answer
    assert quiet_replay(trace, conf).peak_reserved == r.peak_reserved


def test_streams_are_kept_apart():
    trace = [("alloc", 1, 4 * MiB, 0), ("free_requested", 1, 4 * MiB, 0),
             ("alloc", 2, 4 * MiB, 7), ("free_requested", 2, 4 * MiB, 7),
             ("alloc", 3, 4 * MiB, 0)]
    r = quiet_replay(trace)
    assert r.num_device_alloc == 2  # stream 7 cannot reuse stream 0's cached block
    assert r.peak_reserved == 40 * MiB


def test_ratio_and_timeline():
    trace = fragmenting_trace()
    r = quiet_replay(trace)
    idx, res, alc = r.timeline_index, r.timeline_reserved, r.timeline_allocated
    assert len(idx) == len(res) == len(alc) >= 2
    assert list(idx) == sorted(idx) and idx[-1] == len(trace) - 1
    assert res.max() == r.peak_reserved and (alc <= res).all()
    assert r.allocated_at_peak in set(alc.tolist())
    assert r.ratio == pytest.approx(r.peak_reserved / r.allocated_at_peak)
    assert r.ratio > 1.5  # the native allocator keeps the old rounds' segments
    frag = r.fragmentation
    assert frag.shape == res.shape and ((frag >= 0) & (frag <= 1)).all()
    d = r.to_dict()
    json.dumps(d)  # plain values only
    assert d["timeline"]["reserved"][-1] == r.final_reserved
    text = str(r)
    assert "peak reserved" in text and "reserved/allocated at peak" in text
    assert "<table" in r._repr_html_()


def test_expandable_segments_reserve_less_on_a_fragmenting_trace():
    trace = fragmenting_trace()
    native = quiet_replay(trace)
    expandable = quiet_replay(trace, "expandable_segments:True")
    assert expandable.expandable_segments and not native.expandable_segments
    assert expandable.peak_reserved < native.peak_reserved / 2
    assert expandable.peak_allocated == native.peak_allocated
    # max_split_size does not help while the device has room (nothing is released)
    assert quiet_replay(trace, parse_alloc_conf("max_split_size_mb:64")).peak_reserved >= \
        native.peak_reserved


def test_oom_during_replay_is_reported_not_raised():
    trace = [("alloc", 1, 40 * MiB, 0), ("alloc", 2, 40 * MiB, 0),  # 2 does not fit
             ("alloc", 3, 1000, 0), ("free_requested", 2, 40 * MiB, 0),
             ("free_requested", 1, 40 * MiB, 0), ("alloc", 4, 40 * MiB, 0)]
    r = quiet_replay(trace, device_memory=64 * MiB)  # no ReplayWarning: OOMs are results
    assert r.ooms == 1 and r.oom_entries == [(1, 40 * MiB)]
    assert r.skipped == {"free_after_oom": 1}
    assert r.allocs == 4 and r.frees == 1 and r.replayed == 5
    assert r.peak_allocated == 40 * MiB + 1024
    assert r.retries == 1 and r.device_memory == 64 * MiB
    assert "OOMs" in str(r)


def test_auto_device_memory_grows_until_nothing_runs_out():
    trace = [("alloc", i, 5 * GiB, 0) for i in range(6)]  # 30 GiB live at once
    r = quiet_replay(trace)
    assert r.ooms == 0 and r.retries == 0 and r.peak_allocated == 30 * GiB
    assert r.device_memory >= 32 * GiB


def test_skipped_entries_are_counted_in_one_warning():
    trace = [("free_requested", 100, 512, 0), ("free_requested", 101, 512, 0),  # truncated
             ("alloc", 1, 1 * MiB, 0), ("alloc", 1, 1 * MiB, 0),  # still live
             ("free_requested", 1, 1 * MiB, 0), ("free_requested", 1, 1 * MiB, 0),  # double
             ("alloc", 2, 0, 0), ("free_requested", 2, 0, 0),  # not a size
             ("alloc", 3, 2 * MiB, 0), ("free_requested", 3, 2 * MiB, 0)]
    with pytest.warns(rp.ReplayWarning) as record:
        r = rp.replay(trace)
    assert len(record) == 1
    msg = str(record[0].message)
    assert "skipped 6 of 10" in msg and "max_entries" in msg
    assert "2 frees of addresses the trace had not allocated" in msg
    assert "1 allocations of an address that was still live" in msg
    assert "1 second frees" in msg
    assert r.skipped == {"free_before_alloc": 2, "alloc_of_live_address": 1,
                         "double_free": 1, "invalid_size": 2}
    assert r.truncated and r.replayed == 4 and r.allocs == 2 and r.frees == 2
    assert r.final_allocated == 0


def test_dataframe_input_matches_the_list():
    pd = pytest.importorskip("pandas")
    trace = fragmenting_trace(rounds=4)
    rows = [{"time_us": i, "device": 0, "action": a, "addr": addr, "size": s, "stream": st,
             "frame": "x.py:1"} for i, (a, addr, s, st) in enumerate(trace)]
    rows.insert(3, {"time_us": 3, "device": 1, "action": "alloc", "addr": 99, "size": 1 << 40,
                    "stream": 0, "frame": None})  # another device's entry
    rows.insert(5, {"time_us": 5, "device": 0, "action": "segment_alloc", "addr": 5,
                    "size": 20 * MiB, "stream": 0, "frame": None})
    df = pd.DataFrame(rows)
    r_df = quiet_replay(df)
    r_list = quiet_replay(trace)
    assert r_df.peak_reserved == r_list.peak_reserved
    assert r_df.num_device_alloc == r_list.num_device_alloc
    assert r_df.source == "DataFrame" and r_df.ignored == {"segment_alloc": 1}
    assert quiet_replay(df, device=1).peak_allocated == 1 << 40
    with pytest.raises(TraceError, match="lacks column"):
        rp.replay(df.drop(columns=["stream"]))


def test_torch_style_snapshot_dict(monkeypatch):
    a = DeviceCachingAllocator(private_sim(monkeypatch), 0, AllocatorConfig(),
                               stream_resolver=lambda: 0)
    trace = live_workload(a, steps=600)
    snap = torch_style_snapshot(trace)
    r = quiet_replay(snap)
    assert comparable(r)["peak_reserved"] == quiet_replay(trace).peak_reserved
    assert r.entries == len(trace)
    n_alloc = sum(1 for e in trace if e[0] == "alloc")
    assert r.ignored == {"segment_alloc": n_alloc, "free_completed": len(trace) - n_alloc,
                         "oom": 1}
    assert r.reference["recorded_peak_reserved"] == n_alloc * 2 * MiB
    # another device
    snap2 = torch_style_snapshot(trace, device_count=2, device=1)
    assert quiet_replay(snap2, device=1).peak_reserved == r.peak_reserved
    with pytest.raises(TraceError, match="devices with entries: 1"):
        rp.replay(snap2)
    with pytest.raises(TraceError, match="no trace for device 5"):
        rp.replay(snap2, device=5)
    with pytest.raises(TraceError, match="device_traces"):
        rp.replay({"segments": []})


def test_snapshot_pickle_path_and_bad_files(tmp_path):
    trace = fragmenting_trace(rounds=3)
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(torch_style_snapshot(trace), protocol=4))
    r = quiet_replay(path)
    assert r.source == str(path) and r.peak_reserved == quiet_replay(trace).peak_reserved
    assert quiet_replay(str(path)).peak_reserved == r.peak_reserved
    bench = tmp_path / "bench.pkl"  # the allocator benchmark's trace files
    bench.write_bytes(pickle.dumps({"name": "t", "trace": trace, "torch_peak_reserved": 1,
                                    "torch_peak_allocated": 1}, protocol=4))
    rb = quiet_replay(bench)
    assert rb.peak_reserved == r.peak_reserved and rb.reference["torch_peak_reserved"] == 1

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    evil = tmp_path / "evil.pkl"
    evil.write_bytes(pickle.dumps({"segments": [], "device_traces": [[Evil()]]}, protocol=4))
    with pytest.raises(TraceError, match="refus"):
        rp.replay(evil)
    assert not (tmp_path / "pwned").exists()
    junk = tmp_path / "junk.pkl"
    junk.write_bytes(b"not a pickle at all")
    with pytest.raises(TraceError):
        rp.replay(junk)
    with pytest.raises(TraceError, match="cannot read"):
        rp.replay(tmp_path / "missing.pkl")
    with pytest.raises(TraceError):
        rp.replay(42)


def test_bad_config_and_arguments():
    trace = fragmenting_trace(rounds=2)
    with pytest.raises(ValueError, match="unknown option"):
        rp.replay(trace, "no_such_option:1")
    with pytest.raises(ValueError, match="device_memory"):
        rp.replay(trace, device_memory=100)
    with pytest.raises(TypeError):
        rp.replay(trace, 3.5)


def test_progress_callback_and_process_state_untouched():
    from cudalab.allocator import registry as allocator_module

    before = (list(allocator_module.allocators), list(allocator_module.active))
    env = {k: os.environ.get(k) for k in ("CUDALAB_SIMULATOR_DEVICES",
                                          "CUDALAB_SIMULATOR_MEMORY", "CUDA_VISIBLE_DEVICES")}
    calls = []
    trace = fragmenting_trace(rounds=30)
    r = quiet_replay(trace, progress=lambda done, total: calls.append((done, total)))
    assert calls and calls[-1] == (len(trace), len(trace))
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert (list(allocator_module.allocators), list(allocator_module.active)) == before
    assert {k: os.environ.get(k) for k in env} == env
    assert r.entries_per_s > 0


def test_async_backend_on_several_streams():
    trace = [("alloc", 1, 3 * MiB, 0), ("alloc", 2, 5 * MiB, 0x7f00),
             ("free_requested", 1, 3 * MiB, 0), ("alloc", 3, 3 * MiB, 0x7f00),
             ("free_requested", 2, 5 * MiB, 0x7f00), ("free_requested", 3, 3 * MiB, 0x7f00)]
    r = quiet_replay(trace, "backend:cudaMallocAsync")
    assert r.backend == "cudaMallocAsync" and r.ooms == 0
    assert r.peak_allocated == 8 * MiB and r.peak_reserved >= 8 * MiB
    assert r.final_allocated == 0


# --------------------------------------------------------------------------- what-if
def test_what_if_ranks_the_default_sweep():
    pytest.importorskip("pandas")
    trace = fragmenting_trace()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        df = wi.what_if(trace)
    assert list(df.columns) == COLUMNS and df.index.name == "rank"
    assert list(df.index) == list(range(1, len(df) + 1))
    labels = set(df["config"])
    assert {"default", *(c for c in wi.DEFAULT_WHAT_IF_CONFIGS if c)} <= labels
    assert any("per_process_memory_fraction" in c for c in labels)  # the search's caps
    assert "device_memory" in df.attrs["note"]
    ok = df[df["ooms"] == 0]
    assert list(ok["peak_reserved"]) == sorted(ok["peak_reserved"])
    default = df[df["config"] == "default"].iloc[0]
    assert default["saving_vs_default"] == 0 and default["saving_vs_default_pct"] == 0
    best = df.iloc[0]
    assert best["config"].startswith("expandable_segments:True") and best["saving_vs_default"] > 0
    assert best["saving_vs_default_pct"] == pytest.approx(
        100 * best["saving_vs_default"] / default["peak_reserved"])
    results = df.attrs["results"]
    assert [r.label for r in results] == list(df["config"])
    assert all(r.peak_reserved == p for r, p in zip(results, df["peak_reserved"]))
    text = wi.format_what_if(df)
    assert "best: expandable_segments:True" in text


def test_what_if_with_configs_and_device_memory():
    pytest.importorskip("pandas")
    trace = fragmenting_trace()
    df = wi.what_if(trace, ["expandable_segments:True"])
    assert list(df["config"]) == ["expandable_segments:True", "default"]
    df = wi.what_if(trace, "max_split_size_mb:128")  # one string is one config
    assert set(df["config"]) == {"default", "max_split_size_mb:128"}
    native_peak = quiet_replay(trace).peak_reserved
    dm = native_peak + 64 * MiB  # a device that the defaults nearly fill
    df = wi.what_if(trace, device_memory=dm)
    assert "note" not in df.attrs and df.attrs["cap_memory"] == dm
    capped = df[df["config"].str.contains("per_process_memory_fraction")]
    assert len(capped) and all(r.device_memory == dm for r in df.attrs["results"])
    for config, peak in zip(capped["config"], capped["peak_reserved"]):
        assert peak <= float(config.rsplit(":", 1)[1]) * dm  # the fraction caps it
    df = wi.what_if(trace, [wi.GC_CONFIG], device_memory=dm)
    gc = df[df["config"] == wi.GC_CONFIG].iloc[0]
    assert gc["peak_reserved"] <= 0.9 * dm
    ooms = list(df["ooms"] > 0)
    assert ooms == sorted(ooms)  # configs that ran out of memory rank last


# --------------------------------------------------------------------------- CLI
def run_cli(*args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDALAB_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONIOENCODING"] = "utf-8"
    return subprocess.run([sys.executable, "-m", "cudalab", *map(str, args)],
                          capture_output=True, text=True, encoding="utf-8", env=env,
                          timeout=300, cwd=str(ROOT))


@pytest.fixture
def snapshot_file(tmp_path):
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps(torch_style_snapshot(fragmenting_trace()), protocol=4))
    return path


def test_cli_replay(snapshot_file):
    res = run_cli("replay", snapshot_file, "--conf", "expandable_segments:True")
    assert res.returncode == 0, res.stderr
    assert "peak reserved" in res.stdout and "expandable_segments:True" in res.stdout
    assert "Traceback" not in res.stderr
    res = run_cli("replay", snapshot_file, "--json", "--device-memory", "40GiB")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["device_memory"] == 40 * GiB and data["peak_reserved"] > 0
    assert data["config"] == "" and data["timeline"]["index"]


def test_cli_what_if(snapshot_file):
    res = run_cli("what-if", snapshot_file)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert any(line.startswith("rank") and "peak reserved" in line for line in lines)
    assert "best: expandable_segments:True" in res.stdout
    res = run_cli("what-if", snapshot_file, "--conf", "max_split_size_mb:128", "--conf",
                  "expandable_segments:True", "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert [row["config"] for row in data["ranking"]] == [
        "expandable_segments:True", "default", "max_split_size_mb:128"]
    assert data["ranking"][0]["rank"] == 1 and set(COLUMNS) <= set(data["ranking"][0])


@pytest.mark.parametrize("args, needle", [
    (["replay", "{missing}"], "cannot read"),
    (["what-if", "{junk}"], "cannot"),
    (["replay", "{evil}"], "refus"),
    (["replay", "{snap}", "--conf", "bogus:1"], "unknown option"),
    (["replay", "{snap}", "--device", "3"], "no trace for device 3"),
    (["replay", "{snap}", "--device-memory", "lots"], "cannot read the size"),
    (["replay", "{snap}", "--plot", "{tmp}/plot.pdf"], ".png or .svg"),
])
def test_cli_errors_are_one_line(tmp_path, snapshot_file, args, needle):
    junk = tmp_path / "junk.pkl"
    junk.write_bytes(b"\x80\x04garbage")
    evil = tmp_path / "evil.pkl"
    evil.write_bytes(b"cos\nsystem\n(S'true'\ntR.")
    values = {"missing": tmp_path / "missing.pkl", "junk": junk, "evil": evil,
              "snap": snapshot_file, "tmp": tmp_path}
    res = run_cli(*[a.format(**values) for a in args])
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], res.stderr
    assert lines[0].startswith(f"cudalab {args[0]}: error:")


def test_cli_plot(snapshot_file, tmp_path):
    out = tmp_path / "plot.svg"
    res = run_cli("what-if", snapshot_file, "--conf", "expandable_segments:True", "--plot", out)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert res.returncode == 2
        assert "install matplotlib to save plots" in res.stderr
        assert not out.exists()
    else:
        assert res.returncode == 0, res.stderr
        assert out.exists() and out.read_text().lstrip().startswith("<?xml")


def test_cli_warns_about_skipped_entries(tmp_path):
    trace = [("free_requested", 5, 512, 0), *fragmenting_trace(rounds=2)]
    path = tmp_path / "t.pickle"
    path.write_bytes(pickle.dumps(torch_style_snapshot(trace), protocol=4))
    res = run_cli("replay", path)
    assert res.returncode == 0, res.stderr
    assert "cudalab replay: warning: replay of" in res.stderr and "skipped 1 of" in res.stderr
    assert "truncated" in res.stdout



# --------------------------------------------------------------------------- GPU
TORCH_WORKLOAD = r"""
import sys, torch
from torch import nn
torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
layer = nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True)
model = nn.TransformerEncoder(layer, 3).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
for step in range(4):
    x = torch.randn(8 + 4 * (step % 3), 192, 256, device="cuda")
    model(x).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
torch.cuda.synchronize()
torch.cuda.memory._dump_snapshot(sys.argv[1])
print(torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated())
"""


@pytest.mark.gpu
def test_torch_snapshot_replays_within_two_percent(tmp_path):
    """A snapshot torch recorded (in a fresh process, history on from the start) replays
    with the defaults to torch's own peak reserved memory within 2 %."""
    pytest.importorskip("torch")
    path = tmp_path / "torch_snapshot.pickle"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CUDALAB_", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))}
    res = subprocess.run([sys.executable, "-c", TORCH_WORKLOAD, str(path)], capture_output=True,
                         text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr
    torch_reserved, torch_allocated = map(int, res.stdout.split()[-2:])
    r = rp.replay(path)
    assert r.skipped == {} and r.ooms == 0
    assert abs(r.peak_reserved - torch_reserved) <= 0.02 * torch_reserved, (r, torch_reserved)
    assert r.peak_allocated == pytest.approx(torch_allocated, rel=0.005)
    assert r.reference["recorded_peak_reserved"] == torch_reserved
    df = wi.what_if(path)
    assert set(wi.DEFAULT_WHAT_IF_CONFIGS) - {""} <= set(df["config"])
    assert len(df) <= wi.MAX_REPLAYS


def test_empty_and_degenerate_traces():
    r = quiet_replay([])
    assert r.entries == 0 and r.peak_reserved == 0 and r.ratio == 0.0
    assert len(r.timeline_index) == 0
    with pytest.warns(rp.ReplayWarning):
        r = rp.replay([("alloc", 1, -5, 0), ("free_requested", 1, -5, 0)])
    assert r.replayed == 0 and r.skipped == {"invalid_size": 2}
    # addresses that are not int64 still pair up by equality
    r = quiet_replay([("alloc", "a", 4096, 0), ("alloc", 1 << 70, 4096, 0),
                      ("free_requested", "a", 4096, 0), ("free_requested", 1 << 70, 4096, 0)])
    assert r.frees == 2 and r.final_allocated == 0


def test_configs_built_in_code_are_labelled():
    from dataclasses import replace

    cfg = replace(AllocatorConfig(), expandable_segments=True, max_split_size=128 * MiB)
    r = quiet_replay(fragmenting_trace(rounds=3), cfg)
    assert r.config == "max_split_size_mb:128,expandable_segments:True"
    assert parse_alloc_conf(r.config).expandable_segments
    pytest.importorskip("pandas")
    df = wi.what_if(fragmenting_trace(rounds=3), [cfg, AllocatorConfig()])
    assert sorted(df["config"]) == ["default", r.config]


def test_text_progress_bar():
    import io

    out = io.StringIO()
    bar = ProgressBar("default", stream=out, delay=0.0)
    bar(10, 100)
    bar(100, 100)
    bar.close()
    text = out.getvalue()
    assert "100.0% 100/100 entries  default" in text and text.endswith("\n")
    assert "\x1b" not in text  # plain text


def test_replay_places_segments_at_their_traced_addresses():
    """torch's best fit breaks ties by address: the replay reuses the traced addresses while
    the segment sequence matches, and fresh, non-overlapping ones after."""
    from cudalab.memory_tools.replay import _simulator, _TraceAddresses

    MiB = 1 << 20
    hi, lo = 0x7F00_0000_0000, 0x7E00_0000_0000
    sim = _simulator(1 << 30)
    b = _TraceAddresses(sim, [(hi, 2 * MiB), (lo, 20 * MiB), (hi, 2 * MiB)])
    assert b.mem_alloc(0, 2 * MiB) == hi
    assert b.mem_alloc(0, 20 * MiB) == lo
    # the third traced segment reuses `hi`, which is still live here: a fresh address instead
    c = b.mem_alloc(0, 2 * MiB)
    assert c > hi + 2 * MiB and b.faithful == 2
    d = b.mem_alloc(0, 4 * MiB)  # past the trace: fresh, above everything
    assert d >= c + 2 * MiB
    used = sim.mem_get_info(0)
    for p in (hi, lo, c, d):
        b.mem_free(0, p)
    assert sim.mem_get_info(0)[0] == used[0] + 28 * MiB
    with pytest.raises(KeyError):
        b.mem_free(0, hi)  # unknown address: the allocator never does this

