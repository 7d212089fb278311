"""cudalab.memory_tools.samples' DeviceSample records and cudalab.memory_sources'
CudalabSource, the source of the memory dashboard (its figures are memory_stats()'s, its
identity says where they came from)."""

from __future__ import annotations

import dataclasses
import math
import os
import time

import pytest

import cudalab
import cudalab.memory as cm
from cudalab.identity import Identity
from cudalab.memory_sources import CudalabSource
from cudalab.memory_tools.samples import (
    ALLOCATOR_FIGURES,
    NVML_FIGURES,
    DeviceSample,
    SampleSource,
)

#: What the dashboard's ``latest`` held before samples were records (kept as to_dict's keys).
DASHBOARD_KEYS = {
    "time", "allocated", "reserved", "peak_allocated", "peak_reserved", "requested",
    "allocations", "allocations_total", "segments", "num_ooms", "num_alloc_retries", "pools",
    "utilization", "memory_utilization", "temperature", "power_draw", "clock_rate", "nvml_used",
    "nvml_total", "process_used", "all_processes_used", "processes",
}


@pytest.fixture
def allocations():
    ptrs: list[int] = []
    yield ptrs
    for p in ptrs:
        cm.caching_allocator_delete(p)


def test_the_figures_are_memory_stats(allocations):
    cudalab.init()
    source = CudalabSource()
    for d in range(cudalab.device_count()):
        with cudalab.device(d):
            allocations += [cm.caching_allocator_alloc(s) for s in (1 << 20, 3 << 20, 5000)]
        cm.caching_allocator_delete(allocations.pop())
        now = time.time()
        s = source.sample(d, now)
        st = cm.memory_stats(d)
        for name, key in ALLOCATOR_FIGURES:
            assert getattr(s, name) == st[key], name
        assert s.allocated == cm.memory_allocated(d) and s.reserved == cm.memory_reserved(d)
        assert s.peak_allocated == cm.max_memory_allocated(d)
        assert list(s.pools) == cm.private_pools(d)
        assert s.capacity == cudalab.get_device_properties(d).total_memory
        assert s.time == now and s.source == "cudalab" == source.name
        assert s.device == d


def test_every_sample_says_where_it_came_from():
    cudalab.init()
    source = CudalabSource()
    for d in range(cudalab.device_count()):
        s = source.sample(d)
        assert s.identity == Identity.current(device=d, allocator="cudalab")
        assert s.identity.pid == os.getpid() and s.identity.allocator == "cudalab"
        assert s.identity.device_uuid == cudalab.get_device_properties(d).nvml_uuid
        assert abs(s.time - time.time()) < 60  # default: now


def test_nvml_figures_on_the_simulator(allocations):
    cudalab.init()
    if not cudalab.get_device_properties(0).simulated:
        pytest.skip("the simulator's NVML figures")
    allocations.append(cm.caching_allocator_alloc(4 << 20))
    s = CudalabSource().sample(0)
    assert s.nvml_error == ""
    assert s.nvml_used is not None and s.nvml_used >= cm.memory_reserved(0)
    assert s.processes is not None and s.processes >= 1 and s.process_used is not None
    assert s.temperature is not None and s.clock_rate is not None


def test_an_unusable_nvml_leaves_every_nvml_figure_none(monkeypatch):
    from cudalab import memory_sources

    def broken(index):
        raise RuntimeError("no NVML here")

    cudalab.init()
    monkeypatch.setattr(memory_sources.cudalab_source._nvml_api, "resolve_device", broken)
    s = CudalabSource().sample(0)
    assert s.nvml_error == "NVML unavailable (RuntimeError)"
    assert all(getattr(s, name) is None for name in NVML_FIGURES)
    assert s.allocated == cm.memory_allocated(0)  # the allocator's figures still read


def test_a_sample_is_a_frozen_slotted_record_and_travels_as_plain_data():
    cudalab.init()
    s = CudalabSource().sample(0)
    assert not hasattr(s, "__dict__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.allocated = 1  # type: ignore[misc]
    d = s.to_dict()
    assert DASHBOARD_KEYS <= set(d)
    assert d["identity"] == s.identity.to_dict() and d["device"] == 0
    assert d["source"] == "cudalab" and d["capacity"] == s.capacity
    assert type(d["pools"]) is list


def test_a_sample_names_its_device_and_a_finite_time():
    ident = Identity(host="h", pid=1, version="0", allocator="x", device=0)
    figures = {name: 0 for name, _ in ALLOCATOR_FIGURES}
    assert DeviceSample(time=1.0, source="x", identity=ident, capacity=0, **figures).device == 0
    with pytest.raises(ValueError, match="names no device"):
        DeviceSample(time=1.0, source="x", identity=dataclasses.replace(ident, device=None),
                     capacity=0, **figures)
    with pytest.raises(ValueError, match="finite"):
        DeviceSample(time=math.nan, source="x", identity=ident, capacity=0, **figures)


def test_the_source_does_what_the_buttons_ask(allocations):
    cudalab.init()
    source: SampleSource = CudalabSource()
    allocations.append(cm.caching_allocator_alloc(8 << 20))
    cm.caching_allocator_delete(allocations.pop())
    assert cm.max_memory_allocated(0) > cm.memory_allocated(0)
    source.reset_peaks(0)
    assert cm.max_memory_allocated(0) == cm.memory_allocated(0)
    source.release_cache()
    assert source.sample(0).reserved == cm.memory_reserved(0)
    snap = source.snapshot()
    assert set(snap) >= {"segments", "device_traces", "identity"}


def test_from_dict_reads_back_what_to_dict_wrote():
    cudalab.init()
    s = CudalabSource().sample(0)
    assert DeviceSample.from_dict(s.to_dict()) == s
    fake = DeviceSample(time=5, source="torch", identity=Identity(
        host="h", pid=2, version="0", allocator="torch", device=3), capacity=10,
        nvml_error="NVML unavailable (x)", **{name: 1 for name, _ in ALLOCATOR_FIGURES})
    assert DeviceSample.from_dict(fake.to_dict()) == fake


@pytest.mark.parametrize("change,message", [
    ({"allocated": "1"}, r"sample\['allocated'\] is '1', expected an int >= 0"),
    ({"allocated": -1}, r"sample\['allocated'\] is -1"),
    ({"reserved": True}, r"sample\['reserved'\] is True"),
    ({"temperature": 1.5}, r"sample\['temperature'\] is 1.5, expected an int >= 0 or None"),
    ({"time": "now"}, r"sample\['time'\] is 'now', expected finite seconds"),
    ({"time": math.inf}, r"sample\['time'\] is inf"),
    ({"source": ""}, r"sample\['source'\] is '', expected a non-empty str"),
    ({"identity": {"host": "h"}}, r"sample\['identity'\] lacks the key 'pid'"),
    ({"device": 7}, r"sample\['device'\] is 7, expected identity\['device'\] \(0\)"),
    ({"pools": [1]}, r"sample\['pools'\] is a list, expected a list of dicts"),
    ({"nvml_error": "gone", "temperature": 40}, "has NVML figures and an nvml_error"),
])
def test_from_dict_rejects_bad_input(change, message):
    cudalab.init()
    d = CudalabSource().sample(0).to_dict()
    d.update(change)
    with pytest.raises(ValueError, match=message):
        DeviceSample.from_dict(d)
    d.pop("capacity")
    with pytest.raises(ValueError):
        DeviceSample.from_dict(d)
    with pytest.raises(ValueError, match="sample is a list, expected a dict"):
        DeviceSample.from_dict([d])
