"""torch.cuda names a torch user reaches for (issue 22's last section), with torch's semantics.

Each test exercises one name on the simulator (and on a GPU alike): the bf16/tf32 queries,
stream and event ids, external streams, ``check_error``, the host (pinned) memory stats,
``CUDAPluggableAllocator``, ``caching_allocator_enable``, ``_set_allocator_settings``, the
SVG usage plots, user metadata on history entries, the out-of-memory observers and
``DeviceArray.device`` as a device object.
"""

from __future__ import annotations

import ctypes.util
import os
import shutil
import subprocess
import warnings
import xml.etree.ElementTree as ET

import numpy as np
import pytest

import cudalab
import cudalab.memory as cm
from cudalab import devices
from cudalab.allocator import caching_switch, oom_observers, pinned
from cudalab.memory_tools import history, usage_plots
from cudalab.testing import count_calls
from tests.allocator.test_allocator_pluggable import registry  # noqa: F401 - a fixture

MiB = 1 << 20


# --------------------------------------------------------------------------- bf16 / tf32
class _Props:
    def __init__(self, major: int):
        self.major = major
        self.minor = 0


def test_bf16_and_tf32_follow_the_simulated_capability():
    cudalab.init()
    major = cudalab.get_device_capability()[0]
    assert cudalab.is_bf16_supported() is True
    assert cudalab.is_bf16_supported(including_emulation=False) is (major >= 8)
    assert cudalab.is_tf32_supported() is (major >= 8)


def test_bf16_before_ampere_is_emulated_only(monkeypatch):
    cudalab.init()
    monkeypatch.setattr(devices, "get_device_properties", lambda device=None: _Props(7))
    assert cudalab.is_bf16_supported() is True  # torch: emulation counts by default
    assert cudalab.is_bf16_supported(including_emulation=False) is False
    assert cudalab.is_tf32_supported() is False
    monkeypatch.setattr(devices, "get_device_properties", lambda device=None: _Props(8))
    assert cudalab.is_bf16_supported(including_emulation=False) is True
    assert cudalab.is_tf32_supported() is True


def test_bf16_without_cuda_is_false(monkeypatch):
    monkeypatch.setattr(devices, "is_available", lambda: False)
    assert cudalab.is_bf16_supported() is False
    assert cudalab.is_tf32_supported() is False


# --------------------------------------------------------------------------- ids
def test_stream_id_identifies_the_driver_stream():
    s = cudalab.Stream()
    t = cudalab.Stream()
    assert isinstance(s.stream_id, int) and s.stream_id == s.cuda_stream != 0
    assert s.stream_id != t.stream_id
    assert cudalab.ExternalStream(s.cuda_stream).stream_id == s.stream_id  # same stream
    assert cudalab.default_stream().stream_id == 0


def test_event_id_and_device_before_and_after_creation(two_devices):
    e = cudalab.Event()
    assert e.event_id == 0 and e.device is None
    e.record()
    assert e.event_id == e.cuda_event != 0
    assert e.device == cudalab.Device("cuda:0") and str(e.device) == "cuda:0"
    s1 = cudalab.Stream(device=1)
    e1 = cudalab.Event()
    e1.record(s1)
    assert e1.device == cudalab.Device("cuda", 1) and e1.device.index == 1


def test_get_stream_from_external_wraps_without_owning():
    s = cudalab.Stream()
    x = cudalab.get_stream_from_external(s.cuda_stream, 0)
    assert isinstance(x, cudalab.ExternalStream) and x == s and x.device_index == 0
    x.close()  # the wrapper never destroys the stream
    assert s.query() is True
    with pytest.raises(TypeError, match="stream_ptr"):
        cudalab.get_stream_from_external("0x10")


# --------------------------------------------------------------------------- check_error
def test_check_error():
    assert cudalab.check_error(0) is None
    with pytest.raises(cudalab.CudaError) as info:
        cudalab.check_error(1)
    assert info.value.code == 1 and info.value.call == "check_error"
    with pytest.raises(cudalab.OutOfMemoryError):
        cudalab.check_error(2)
    with pytest.raises(TypeError, match="code"):
        cudalab.check_error("1")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- host stats
def test_host_memory_stats_have_torchs_keys_and_count():
    cudalab.init()
    cudalab.empty_pinned_cache()
    pinned.reset_accumulated_host_memory_stats()
    cudalab.reset_peak_host_memory_stats()  # (max/min survive the accumulated reset, as torch's)
    before = cudalab.host_memory_stats()
    assert set(before) == {f"{s}.{m}" for s in ("allocation", "segment", "allocated_bytes",
                                                 "reserved_bytes")
                           for m in ("current", "peak", "allocated", "freed")} | {
        f"{t}.{m}" for t in ("host_alloc_time", "host_free_time")
        for m in ("total", "max", "min", "count", "avg")} | {"num_host_alloc", "num_host_free"}
    assert list(before) == sorted(before)
    a = cudalab.empty_pinned(1000, np.uint8)  # rounded to 1024
    b = cudalab.empty_pinned(3000, np.uint8)  # 4096
    s = cudalab.host_memory_stats()
    assert s["allocation.current"] == before["allocation.current"] + 2
    assert s["allocated_bytes.current"] == before["allocated_bytes.current"] + 1024 + 4096
    assert s["num_host_alloc"] == 2 and s["segment.allocated"] == 2
    assert s["host_alloc_time.count"] == 2
    assert s["host_alloc_time.total"] >= s["host_alloc_time.max"] >= s["host_alloc_time.min"]
    del a, b
    s = cudalab.host_memory_stats()
    assert s["allocation.current"] == before["allocation.current"]
    assert s["allocation.peak"] >= before["allocation.current"] + 2
    assert s["segment.current"] == before["segment.current"] + 2  # cached, not freed
    cudalab.reset_peak_host_memory_stats()
    s = cudalab.host_memory_stats()
    assert s["allocation.peak"] == s["allocation.current"] and s["host_alloc_time.max"] == 0
    cudalab.empty_pinned_cache()
    s = cudalab.host_memory_stats()
    assert s["num_host_free"] >= 2 and s["host_free_time.count"] >= 2
    assert s["segment.current"] == before["segment.current"]  # both blocks went back
    assert s["reserved_bytes.current"] == before["reserved_bytes.current"]
    nested = cudalab.host_memory_stats_as_nested_dict()
    assert nested["allocation"]["current"] == s["allocation.current"]
    assert list(nested) == ["num_host_alloc", "num_host_free", "allocation", "segment",
                            "allocated_bytes", "reserved_bytes", "host_alloc_time",
                            "host_free_time"]
    cudalab.reset_accumulated_host_memory_stats()
    s = cudalab.host_memory_stats()
    assert s["num_host_alloc"] == s["num_host_free"] == s["host_free_time.count"] == 0


def test_pinned_memory_stats_is_an_alias_with_cudalabs_keys():
    cudalab.init()
    a = cudalab.empty_pinned(10, np.float32)
    alias = cudalab.pinned_memory_stats()
    torch_keys = cudalab.host_memory_stats()
    assert {k: alias[k] for k in torch_keys} == torch_keys
    assert alias["allocated_blocks"] >= 1 and "cached_bytes" in alias
    del a
    assert cm.host_memory_stats is pinned.host_memory_stats


# --------------------------------------------------------------------------- pluggable (.so)
def _libc() -> str:
    path = ctypes.util.find_library("c")
    if path is None:
        pytest.skip("no C library to load")
    return path


def test_cuda_pluggable_allocator_loads_functions_from_a_library(registry):  # noqa: F811
    # libc's malloc(size) / free(ptr) ignore the extra arguments of torch's signatures
    alloc = cudalab.CUDAPluggableAllocator(_libc(), "malloc", "free")
    assert cudalab.CUDAPluggableAllocator is cm.CUDAPluggableAllocator
    assert alloc.allocator() is alloc and "malloc" in repr(alloc)
    cudalab.change_current_allocator(alloc)
    ptr = cm.caching_allocator_alloc(4096)
    assert ptr != 0 and cm.memory_allocated() == 4096
    assert cm.get_allocator_backend() == "pluggable"
    cm.caching_allocator_delete(ptr)
    assert cm.memory_allocated() == 0 and cm.memory_stats()["num_device_free"] == 1
    with pytest.raises(RuntimeError, match="already initialized"):
        cm.change_current_allocator(alloc)


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_cuda_pluggable_allocator_passes_torchs_arguments(registry, tmp_path):  # noqa: F811
    src = tmp_path / "alloc.c"
    src.write_text(
        "#include <stdlib.h>\n#include <sys/types.h>\n"
        "long last[4];\n"
        "void* my_alloc(ssize_t size, int device, void* stream) {\n"
        "  last[0] = size; last[1] = device; last[2] = (long)stream; return malloc(size); }\n"
        "void my_free(void* ptr, ssize_t size, int device, void* stream) {\n"
        "  last[3] = size; free(ptr); }\n")
    so = tmp_path / "liballoc.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    alloc = cm.CUDAPluggableAllocator(so, "my_alloc", "my_free")
    cm.change_current_allocator(alloc)
    s = cudalab.Stream()
    ptr = cm.caching_allocator_alloc(3000, stream=s)
    last = (ctypes.c_long * 4).in_dll(alloc._library, "last")
    assert (last[0], last[1], last[2]) == (3000, 0, s.cuda_stream)
    cm.caching_allocator_delete(ptr)
    assert last[3] == 3000


def test_cuda_pluggable_allocator_bad_input():
    with pytest.raises(AttributeError, match="no_such_symbol"):
        cudalab.CUDAPluggableAllocator(_libc(), "no_such_symbol", "free")
    with pytest.raises(TypeError, match="free_fn_name"):
        cudalab.CUDAPluggableAllocator(_libc(), "malloc", None)  # type: ignore[arg-type]
    with pytest.raises(OSError):
        cudalab.CUDAPluggableAllocator("/nonexistent/liballoc.so", "a", "b")


# --------------------------------------------------------------------------- caching on/off
@pytest.fixture
def caching_back_on():
    yield
    caching_switch.set_caching_enabled(True)


def test_caching_allocator_enable_false_goes_to_the_driver(registry, caching_back_on):  # noqa: F811
    cudalab.init()
    cached = cm.caching_allocator_alloc(MiB)  # from the cache, before turning it off
    allocated = cm.memory_allocated()
    cudalab.caching_allocator_enable(False)
    with count_calls(("mem_alloc", "mem_free")) as calls:
        for _ in range(3):
            p = cm.caching_allocator_alloc(MiB)
            cm.caching_allocator_delete(p)
        a = cudalab.empty(1000)
        del a
    assert calls["mem_alloc"] == 4 and calls["mem_free"] == 4  # no caching at all
    assert cm.memory_allocated() == allocated  # torch's uncached path is not counted
    cm.caching_allocator_delete(cached)  # a cached block goes back to the cache
    assert cm.memory_allocated() == allocated - MiB
    kept = cm.caching_allocator_alloc(MiB)  # allocated uncached, freed after turning on
    cudalab.caching_allocator_enable(True)
    with count_calls(("mem_alloc", "mem_free")) as calls:
        for _ in range(3):
            p = cm.caching_allocator_alloc(MiB)
            cm.caching_allocator_delete(p)
        cm.caching_allocator_delete(kept)
    assert calls["mem_alloc"] == 0 and calls["mem_free"] == 1
    assert not isinstance(registry.get_allocator(0), caching_switch._Bypass)  # its own class


def test_caching_allocator_enable_checks_its_argument():
    with pytest.raises(TypeError, match="value"):
        cudalab.caching_allocator_enable(0)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- settings
def test_set_allocator_settings_changes_the_running_allocator(registry):  # noqa: F811
    cudalab.init()
    p = cm.caching_allocator_alloc(MiB)
    assert cm.memory_stats()["max_split_size"] == -1
    cm._set_allocator_settings("max_split_size_mb:128, garbage_collection_threshold:0.5")
    assert cm.memory_stats()["max_split_size"] == 128 * MiB
    cfg = registry.allocator_config()
    assert cfg.garbage_collection_threshold == 0.5 and cfg.text.startswith("max_split")
    a = registry.get_allocator(0)
    assert a._max_split == 128 * MiB and a._split_limited
    cm._set_allocator_settings("roundup_power2_divisions:4")
    cfg = registry.allocator_config()
    # torch's parseArgs resets max_split_size, roundup_power2_divisions and
    # garbage_collection_threshold to their defaults when a string leaves them out
    assert cfg.max_split_size == registry.AllocatorConfig().max_split_size
    assert cfg.garbage_collection_threshold == 0.0 and cfg.roundup_power2_divisions[0] == 4
    with pytest.raises(RuntimeError, match="backend"):
        cm._set_allocator_settings("backend:cudaMallocAsync")
    with pytest.raises(RuntimeError, match="expandable_segments"):
        cm._set_allocator_settings("expandable_segments:True")
    with pytest.raises(ValueError, match="max_split_size_mb"):
        cm._set_allocator_settings("max_split_size_mb:1")
    with pytest.raises(TypeError, match="settings"):
        cm._set_allocator_settings(128)  # type: ignore[arg-type]
    assert registry.allocator_config() == cfg  # failed calls changed nothing
    cm.caching_allocator_delete(p)


def test_set_allocator_settings_resets_the_keys_torch_resets(registry):  # noqa: F811
    """torch's test_allocator_settings: after "roundup_power2_divisions:4", the string
    "garbage_collection_threshold:0.5,max_split_size_mb:40" "should have reset the power2
    divisions", so an 84 MiB request takes 84 MiB again (96 MiB with 4 divisions)."""
    cudalab.init()
    nbytes = 84 * MiB
    cm._set_allocator_settings("roundup_power2_divisions:4,release_lock_on_cudamalloc:True")
    cm.empty_cache()
    start = cm.memory_stats()["reserved_bytes.all.current"]
    x = cudalab.empty((nbytes,), dtype=np.uint8)
    assert cm.memory_stats()["reserved_bytes.all.current"] - start == 96 * MiB
    del x
    cm._set_allocator_settings("garbage_collection_threshold:0.5,max_split_size_mb:40")
    cm.empty_cache()
    start = cm.memory_stats()["reserved_bytes.all.current"]
    y = cudalab.empty((nbytes,), dtype=np.uint8)
    assert cm.memory_stats()["reserved_bytes.all.current"] - start == nbytes
    del y
    cfg = registry.allocator_config()
    assert cfg.roundup_power2_divisions == registry.AllocatorConfig().roundup_power2_divisions
    assert cfg.max_split_size == 40 * MiB and cfg.garbage_collection_threshold == 0.5
    assert cfg.release_lock_on_cudamalloc  # torch keeps the keys it does not reset
    cm._set_allocator_settings("")
    cfg = registry.allocator_config()
    assert cfg.max_split_size == registry.AllocatorConfig().max_split_size
    assert cfg.garbage_collection_threshold == 0.0 and cfg.release_lock_on_cudamalloc


def test_set_allocator_settings_before_the_first_allocation(registry):  # noqa: F811
    cm._set_allocator_settings("expandable_segments:True")
    from cudalab.allocator.expandable import ExpandableCachingAllocator

    assert isinstance(registry.get_allocator(0), ExpandableCachingAllocator)


# --------------------------------------------------------------------------- SVG plots
def _svg_texts(path) -> list[str]:
    root = ET.parse(path).getroot()
    return [el.text or "" for el in root.iter() if el.tag.endswith("title")]


def test_save_segment_and_memory_usage_write_svgs(tmp_path):
    cudalab.init()
    with cm.record_history():
        keep = cudalab.empty(300_000, np.uint8)  # this function's frame is on the block
        seg, mem = tmp_path / "seg.svg", tmp_path / "mem.svg"
        cm._save_segment_usage(seg)
        cm._save_memory_usage(str(mem))
    titles = _svg_texts(seg)
    assert any(t.startswith("seg_") for t in titles)
    assert any("test_save_segment_and_memory_usage_write_svgs" in t for t in titles)
    mem_titles = _svg_texts(mem)
    assert any(t.startswith("active_allocated") for t in mem_titles)
    assert not any(t.startswith("seg_") for t in mem_titles)  # segments merged per stream
    assert sorted(os.listdir(tmp_path)) == ["mem.svg", "seg.svg"]  # no temporary file left
    del keep


def test_usage_plot_widths_follow_bytes(tmp_path):
    snap = {"segments": [{"stream": 0, "address": 4096, "blocks": [
        {"size": 3072, "requested_size": 1000, "state": "active_allocated", "frames": []},
        {"size": 1024, "requested_size": 0, "state": "inactive", "frames": []}]}]}
    folded = usage_plots.folded_segments(snap)
    assert folded.splitlines() == [
        "stream_0;seg_4096;active_allocated;<non-python> 1000",
        "stream_0;seg_4096;active_allocated;<gaps> 2072",
        "stream_0;seg_4096;inactive;<non-python> 1024"]
    out = tmp_path / "u.svg"
    cm._save_memory_usage(out, snapshot=snap)
    root = ET.parse(out).getroot()
    widths = {g.find("{http://www.w3.org/2000/svg}title").text.split(" ")[0]:
              float(g.find("{http://www.w3.org/2000/svg}rect").get("width"))
              for g in root.iter("{http://www.w3.org/2000/svg}g")}
    assert widths["active_allocated"] == pytest.approx(3 * widths["inactive"], rel=1e-3)
    with pytest.raises(TypeError, match="snapshot"):
        cm._save_segment_usage(out, snapshot=[1])  # type: ignore[arg-type]
    with pytest.raises(OSError):
        cm._save_segment_usage(tmp_path / "missing" / "x.svg", snapshot=snap)


# --------------------------------------------------------------------------- metadata
def test_memory_metadata_is_recorded_on_entries():
    cudalab.init()
    try:
        with cm.record_history(context=None, clear_history=True):
            a = cudalab.empty(1000)
            del a
            cm._set_memory_metadata("step 1")
            assert cm._get_memory_metadata() == "step 1"
            for _ in range(5):  # memo pairs, logged compactly, carry it too
                b = cudalab.empty(2000)
                del b
            cm._set_memory_metadata("")
            c = cudalab.empty(3000)
            del c
            entries = cm._snapshot()["device_traces"][0]
            raw = history.raw_entries(0)
        by_size = {}
        for e in entries:
            if e["action"] == "alloc":
                by_size.setdefault(e["size"], set()).add(e["user_metadata"])
        assert by_size[1000 * 4] == {""} and by_size[2000 * 4] == {"step 1"}
        assert by_size[3000 * 4] == {""}
        assert sum(1 for e in entries if e["action"] == "alloc" and e["size"] == 8000) == 5
        plain = [e for e in raw if e[2] == 3000 * 4]
        assert plain and all(len(e) == len(history.FIELDS) for e in plain)  # nothing added
    finally:
        cm._set_memory_metadata("")
    with pytest.raises(TypeError, match="metadata"):
        cm._set_memory_metadata(1)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- OOM observers
@pytest.fixture
def observers():
    saved = list(oom_observers.observers)
    yield oom_observers.observers
    oom_observers.observers[:] = saved


def test_oom_observer_sees_torchs_arguments_before_the_error(registry, observers):  # noqa: F811
    cudalab.init()
    seen = []
    cm._attach_out_of_memory_observer(lambda *args: seen.append((args, cm.memory_allocated())))
    cm.set_per_process_memory_fraction(0.01)
    total = cudalab.mem_get_info()[1]
    with pytest.raises(cudalab.OutOfMemoryError):
        cm.caching_allocator_alloc(total // 10)
    assert len(seen) == 1
    (device, alloc, device_allocated, device_free), allocated = seen[0]
    assert device == 0 and alloc >= total // 10
    assert device_allocated == int(0.01 * total)  # the per-process limit
    assert 0 < device_free <= total and allocated == 0  # statistics readable: lock not held


def test_oom_observer_that_raises_does_not_hide_the_oom(registry, observers):  # noqa: F811
    cudalab.init()
    calls = []

    def bad(*args):
        raise ValueError("observer bug")

    cm._attach_out_of_memory_observer(bad)
    cm._attach_out_of_memory_observer(lambda *args: calls.append(args))
    cm.set_per_process_memory_fraction(0.001)
    total = cudalab.mem_get_info()[1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(cudalab.OutOfMemoryError):
            cm.caching_allocator_alloc(total // 100)
    assert len(calls) == 1  # the observers after it still ran
    assert any("observer bug" in str(w.message) for w in caught)
    with pytest.raises(TypeError, match="observer"):
        cm._attach_out_of_memory_observer(42)


# --------------------------------------------------------------------------- array.device
def test_device_array_device_is_a_device_object(two_devices):
    a = cudalab.empty(4)
    assert isinstance(a.device, cudalab.Device)
    assert a.device == cudalab.Device("cuda:0") and str(a.device) == "cuda:0"
    assert a.device.index == 0 and a.device.type == "cuda" and a.device_index == 0
    assert a.device != 0 and hash(a.device) == hash(cudalab.Device("cuda", 0))
    b = cudalab.empty(4, device=1)
    assert b.device == cudalab.Device("cuda:1") and b.device_index == 1
    assert b.to(a.device).device == a.device  # accepted wherever a device is
    with cudalab.device_of(b):
        assert cudalab.current_device() == 1


def test_oom_observer_runs_for_the_uncached_allocator(backend, observers):
    from cudalab.allocator.uncached import UncachedAllocator

    seen = []
    cm._attach_out_of_memory_observer(lambda *args: seen.append(args))
    a = UncachedAllocator(backend, 0)
    a.set_memory_fraction(0.001)
    total = backend.mem_get_info(0)[1]
    with pytest.raises(cudalab.OutOfMemoryError):
        a.malloc(total // 100)
    assert seen and seen[0][:3] == (0, total // 100, int(0.001 * total))
