"""cudalab.memory_sources: the torch, cupy and process sources beside cudalab's, and
resolve_sources, on small fakes of torch and CuPy put into sys.modules (real torch and CuPy
in tests/memory_tools/test_sources_gpu.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import cudalab
import cudalab.memory as cm
from cudalab.memory_sources import (
    SOURCE_NAMES,
    CudalabSource,
    CupySource,
    ProcessSource,
    SourceUnavailableError,
    TorchSource,
    resolve_sources,
)
from cudalab.memory_tools.samples import ALLOCATOR_FIGURES, DeviceSample
from tests.helpers.fake_allocators import (  # noqa: F401 - fixtures: torch, cupy
    FakeCupy,
    FakeTorch,
    fake_cupy,
    fake_torch,
)


@pytest.fixture
def no_libraries(monkeypatch):
    """A process where neither torch nor CuPy is imported (nor importable)."""
    monkeypatch.setitem(sys.modules, "torch", None)  # None: `import torch` raises ImportError
    monkeypatch.setitem(sys.modules, "cupy", None)


def _figures(sample: DeviceSample) -> dict[str, int]:
    return {name: getattr(sample, name) for name, _ in ALLOCATOR_FIGURES}


def _torch_figures(torch, device=0) -> dict[str, int]:
    flat = torch.cuda.memory_stats(device)
    return {name: flat.get(key, 0) for name, key in ALLOCATOR_FIGURES}


# ------------------------------------------------------------------ torch
def test_torch_figures_are_torch_memory_stats_exactly(torch):
    cudalab.init()
    source = TorchSource(torch)
    ptrs = [torch.cuda.alloc(n) for n in (1000, 3 << 20, 5 << 20)]
    torch.cuda.free(ptrs.pop(1))
    s = source.sample(0, now=123.0)
    assert _figures(s) == _torch_figures(torch)
    assert s.allocated == torch.cuda.memory_allocated(0) > 0
    assert s.peak_allocated == torch.cuda.max_memory_allocated(0) > s.allocated
    assert s.source == "torch" and s.identity.allocator == "torch" and s.time == 123.0
    assert s.capacity == cudalab.get_device_properties(0).total_memory
    assert s.identity.device_uuid == CudalabSource().sample(0).identity.device_uuid
    assert source.reserved(0) == torch.cuda.memory_reserved(0)
    # reading never resets the user's peaks
    assert "reset_peak_memory_stats" not in torch.cuda.calls


def test_torch_flat_memory_stats_only(torch):
    """A torch without memory_stats_as_nested_dict is read through memory_stats()."""
    cudalab.init()
    torch.cuda.alloc(7 << 20)
    torch.cuda.memory_stats_as_nested_dict = None  # (an older torch)
    source = TorchSource(torch)
    assert source.stats(0)["allocated_bytes"]["all"]["current"] == 7 << 20
    assert _figures(source.sample(0)) == _torch_figures(torch)


def test_torch_buttons_act_on_torch(torch):
    cudalab.init()
    source = TorchSource(torch)
    p = torch.cuda.alloc(9 << 20)
    torch.cuda.free(p)
    assert source.sample(0).reserved > 0
    source.release_cache()
    assert source.sample(0).reserved == 0
    source.reset_peaks(0)
    assert torch.cuda.calls == ["empty_cache", "reset_peak_memory_stats"]
    assert source.sample(0).peak_allocated == 0


def test_torch_snapshot_is_torchs_with_an_identity(torch):
    cudalab.init()
    torch.cuda.alloc(1 << 20)
    snap = TorchSource(torch).snapshot()
    assert snap["segments"] == torch.cuda.memory._snapshot()["segments"]
    assert snap["identity"]["allocator"] == "torch"


@pytest.mark.parametrize("kwargs, words", [
    ({"initialized": False}, "torch.cuda.is_initialized() is False"),
    ({"available": False}, "torch.cuda.is_available() is False"),
])
def test_torch_not_ready_says_which(monkeypatch, kwargs, words):
    monkeypatch.setitem(sys.modules, "torch", FakeTorch(**kwargs))
    with pytest.raises(SourceUnavailableError) as info:
        resolve_sources("torch")
    assert info.value.source == "torch" and words in str(info.value)


def test_no_torch_says_so(no_libraries):
    with pytest.raises(SourceUnavailableError, match="this process has no torch"):
        resolve_sources("torch")
    with pytest.raises(SourceUnavailableError, match="this process has no CuPy"):
        resolve_sources("cupy")


def test_torch_going_away_is_an_error_of_the_sample(torch):
    cudalab.init()
    source = TorchSource(torch)
    source.sample(0)
    torch.cuda.initialized = False  # e.g. a forked child
    with pytest.raises(SourceUnavailableError, match="no longer initialised"):
        source.sample(0)


# ------------------------------------------------------------------ cupy
def test_cupy_figures_are_the_pools(cupy):
    cudalab.init()
    source = CupySource(cupy)
    a = cupy.alloc(4_000_000)
    cupy.alloc(4000)
    cupy.free(a)
    s = source.sample(0)
    pool = cupy.get_default_memory_pool()
    assert (s.allocated, s.reserved) == (pool.used_bytes(), pool.total_bytes())
    assert s.reserved > s.allocated > 0
    assert dict(s.extra) == {"free_blocks": pool.n_free_blocks(), "pinned_free_blocks": 2}
    assert s.identity.allocator == "cupy" and "keeps no peaks" in s.note
    # the peaks are the highest figures sampled (CuPy keeps none)
    big = cupy.alloc(8_000_000)
    high = source.sample(0)
    cupy.free(big)
    low = source.sample(0)
    assert low.peak_allocated == high.allocated > low.allocated
    source.reset_peaks(0)
    assert source.sample(0).peak_allocated == low.allocated


def test_cupy_another_device_is_made_current_for_the_read(cupy):
    cudalab.init()
    cupy.alloc(1 << 20, device=1)
    source = CupySource(cupy)
    assert source.pool_figures(1)[0] == 1 << 20 and source.pool_figures(0)[0] == 0
    assert cupy.cuda.runtime.getDevice() == 0  # restored


def test_cupy_backed_by_cudalab_says_so(cupy):
    from cudalab import interop

    cudalab.init()
    source = CupySource(cupy)
    assert "'cudalab' source" not in source.sample(0).note
    cupy.cuda.set_allocator(interop.cupy_allocator)
    s = source.sample(0)
    assert "cudalab's allocator backs CuPy" in s.note and "'cudalab' source" in s.note
    cupy.cuda.set_allocator(lambda n: None)  # RMM, a user's pool
    assert "another allocator" in source.sample(0).note


def test_cupy_without_cuda(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", FakeCupy(available=False))
    with pytest.raises(SourceUnavailableError, match="is_available"):
        resolve_sources("cupy")


def test_cupy_has_no_snapshot(cupy):
    with pytest.raises(SourceUnavailableError, match="keeps no per-block state"):
        CupySource(cupy).snapshot()


# ------------------------------------------------------------------ process and auto
def test_auto_without_libraries_is_cudalab_and_process(no_libraries):
    sources = resolve_sources("auto")
    assert [s.name for s in sources] == ["cudalab", "process"]
    assert sources[1].accounted == sources[:1]


def test_auto_lists_every_allocator_present(torch, cupy):
    cudalab.init()
    sources = resolve_sources("auto")
    assert [s.name for s in sources] == ["cudalab", "torch", "cupy", "process"]
    samples = [s.sample(0, now=5.0) for s in sources]
    assert [s.identity.allocator for s in samples] == ["cudalab", "torch", "cupy", "process"]
    assert len({s.identity.device_uuid for s in samples}) == 1


def test_auto_leaves_out_a_torch_without_cuda_initialised(monkeypatch, cupy):
    monkeypatch.setitem(sys.modules, "torch", FakeTorch(initialized=False))
    assert [s.name for s in resolve_sources("auto")] == ["cudalab", "cupy", "process"]


def test_process_is_nvml_less_every_allocator(torch, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # (a GPU run's earlier tests import CuPy)
    cudalab.init()
    ptr = cm.caching_allocator_alloc(3 << 20)
    try:
        torch.cuda.alloc(1 << 20)
        source = resolve_sources("process")[0]
        assert isinstance(source, ProcessSource)
        assert [s.name for s in source.accounted] == ["cudalab", "torch"]
        s = source.sample(0)
        used = s.process_used
        assert used is not None  # the simulator lists this process
        held = cm.memory_reserved(0) + torch.cuda.memory_reserved(0)
        assert s.reserved == s.allocated == max(used - held, 0)
        assert s.identity.allocator == "process" and "NVML: this process uses" in s.note
        assert s.peak_reserved >= s.reserved
    finally:
        cm.caching_allocator_delete(ptr)


def test_process_without_nvml_says_unknown(monkeypatch):
    from cudalab.memory_sources import cudalab_source

    def broken(index):
        raise RuntimeError("no NVML")

    cudalab.init()
    monkeypatch.setattr(cudalab_source._nvml_api, "resolve_device", broken)
    s = ProcessSource([CudalabSource()]).sample(0)
    assert s.reserved == 0 and "unknown" in s.note and "NVML unavailable" in s.note


def test_process_notes_an_unreadable_allocator(torch):
    cudalab.init()
    t = TorchSource(torch)
    torch.cuda.initialized = False
    s = ProcessSource([t]).sample(0)
    assert "torch (unreadable: SourceUnavailableError)" in s.note


# ------------------------------------------------------------------ resolve_sources
def test_resolve_names_and_objects(no_libraries):
    assert SOURCE_NAMES == ("cudalab", "torch", "cupy", "process", "auto")
    (one,) = resolve_sources(" CUDALAB ")
    assert isinstance(one, CudalabSource)
    assert resolve_sources(one) == (one,)
    assert resolve_sources([one, one]) == (one, one)
    with pytest.raises(ValueError, match="unknown memory source 'tensorflow'; use one of cudalab"):
        resolve_sources("tensorflow")
    with pytest.raises(ValueError, match="empty"):
        resolve_sources([])
    with pytest.raises(TypeError, match="int is not a memory source"):
        resolve_sources([one, 3])
    with pytest.raises(TypeError, match="expected one of"):
        resolve_sources(3.5)


def test_naming_torch_imports_it_when_installed(monkeypatch):
    """resolve_sources('torch') imports torch when it is installed but not imported."""
    import importlib

    fake = FakeTorch(initialized=False)
    monkeypatch.setitem(sys.modules, "torch", None)  # (restored afterwards, whatever was there)
    imported = []

    def fake_import(name, *a, **k):
        imported.append(name)
        sys.modules[name] = fake
        return fake

    monkeypatch.setattr(importlib, "import_module", fake_import)
    with pytest.raises(SourceUnavailableError, match="is_initialized"):
        resolve_sources("torch")
    assert imported == ["torch"] and sys.modules["torch"] is fake


def test_auto_and_import_never_import_torch_or_cupy():
    code = ("import sys, cudalab, cudalab.memory_sources as ms; "
            "ms.resolve_sources('auto'); "
            "from IPython.testing.globalipapp import start_ipython; ip = start_ipython(); "
            "ip.run_line_magic('load_ext', 'cudalab'); "
            "print(sorted(m for m in ('torch', 'cupy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**__import__("os").environ, "CUDALAB_SIMULATOR": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


# ------------------------------------------------------------------ the record's new fields
def test_note_and_extra_travel_and_are_checked(torch):
    cudalab.init()
    s = CupySource(FakeCupy()).sample(0)
    d = s.to_dict()
    assert d["extra"] == {"free_blocks": 0, "pinned_free_blocks": 2} and d["note"] == s.note
    assert DeviceSample.from_dict(d) == s
    old = {k: v for k, v in d.items() if k not in ("note", "extra")}  # an older writer's
    back = DeviceSample.from_dict(old)
    assert back.note == "" and back.extra == ()
    with pytest.raises(ValueError, match=r"sample\['extra'\]\['free_blocks'\] is -1"):
        DeviceSample.from_dict({**d, "extra": {"free_blocks": -1}})
    with pytest.raises(ValueError, match="note"):
        DeviceSample.from_dict({**d, "note": "x" * 513})
    with pytest.raises(ValueError, match="expected \\(name, count\\) pairs"):
        DeviceSample(**{**{f: getattr(s, f) for f in s.__dataclass_fields__},
                        "extra": (("a",),)})


# ------------------------------------------------------------------ source= on the tools
def _torch_trace(torch):
    """A scripted torch workload recorded by the fake's history: allocations and frees."""
    torch.cuda.memory._record_memory_history(max_entries=10_000)
    keep = [torch.cuda.alloc(n) for n in (1 << 20, 3 << 20, 5000)]
    torch.cuda.free(keep.pop(1))
    torch.cuda.alloc(7 << 20)
    return sum(len(t) for t in torch.cuda.traces)


def test_history_frame_of_torch_has_a_row_per_trace_entry(torch):
    from cudalab.memory import history_frame

    cudalab.init()
    n = _torch_trace(torch)
    df = history_frame(source="torch")
    assert len(df) == n > 0
    assert list(df["action"].astype(str)) == [e["action"] for e in torch.cuda.traces[0]]
    assert df.attrs["identity"]["allocator"] == "torch"
    assert (df["name"] == "train_step").all()
    with pytest.raises(ValueError, match="not both"):
        history_frame({"segments": []}, source="torch")
    with pytest.raises(SourceUnavailableError, match="keeps no per-block state nor trace"):
        history_frame(source="cupy")


def test_history_frame_auto_is_torch_only_when_cudalab_holds_nothing(torch, monkeypatch):
    """auto's snapshot is torch's when cudalab's allocators (every device's, as the
    registry lists them) hold nothing, else cudalab's."""
    from cudalab.allocator import registry
    from cudalab.memory import history_frame
    from cudalab.memory_tools.libraries import auto_snapshot_source

    cudalab.init()
    _torch_trace(torch)

    class Holding:
        def __init__(self, reserved):
            self.reserved = reserved

        def memory_stats(self):
            return {"reserved_bytes.all.current": self.reserved}

    monkeypatch.setattr(registry, "active", [Holding(0), Holding(0)])
    assert auto_snapshot_source() == "torch"
    assert history_frame(source="auto").attrs["identity"]["allocator"] == "torch"
    monkeypatch.setattr(registry, "active", [Holding(0), Holding(2 << 20)])  # one device holds
    assert auto_snapshot_source() == "cudalab"
    torch.cuda.initialized = False  # torch not ready: cudalab's, whatever cudalab holds
    monkeypatch.setattr(registry, "active", [])
    assert auto_snapshot_source() == "cudalab"


def test_what_if_replays_the_live_torch_trace(torch):
    from cudalab.memory_tools.what_if import what_if

    cudalab.init()
    _torch_trace(torch)
    df = what_if(source="torch", configs=["expandable_segments:True"])
    assert df.attrs["allocator"] == "torch"
    assert set(df["config"]) == {"default", "expandable_segments:True"}
    assert df["peak_allocated"].max() >= (1 << 20) + (7 << 20)
    with pytest.raises(ValueError, match="not both"):
        what_if({"segments": []}, source="torch")
    with pytest.raises(ValueError, match="needs a trace, or source="):
        what_if()


def test_what_if_source_cudalab_is_its_recorded_history():
    from cudalab.memory_tools.what_if import what_if

    cudalab.init()
    with cm.record_history("all"):
        ptr = cm.caching_allocator_alloc(3 << 20)
        cm.caching_allocator_delete(ptr)
        df = what_if(source="cudalab", configs=[])
    assert df.attrs["allocator"] == "cudalab" and df["peak_allocated"].iloc[0] >= 3 << 20


def test_cli_what_if_source_checks_the_files_allocator(torch, tmp_path, capsys):
    from cudalab import cli
    from cudalab.memory_tools.trace_io import dumps_snapshot

    cudalab.init()
    _torch_trace(torch)
    theirs = tmp_path / "torch.pickle"  # torch's own dump: no identity
    theirs.write_bytes(dumps_snapshot(torch.cuda.memory._snapshot()))
    ours = tmp_path / "ours.pickle"
    ours.write_bytes(dumps_snapshot({**torch.cuda.memory._snapshot(),
                                     "identity": {**TorchSource(torch).snapshot()["identity"],
                                                  "allocator": "cudalab"}}))
    assert cli.main(["what-if", str(theirs), "--source", "torch", "--conf",
                     "expandable_segments:True"]) == 0
    assert "expandable_segments:True" in capsys.readouterr().out
    assert cli.main(["what-if", str(ours), "--source", "torch"]) == 2
    err = capsys.readouterr().err
    assert "is cudalab's trace (its identity says so), not torch's (--source torch)" in err
    assert cli.main(["what-if", str(theirs), "--source", "cudalab"]) == 2
    assert "is torch's trace" in capsys.readouterr().err
