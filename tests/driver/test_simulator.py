"""The simulator backend (:mod:`cudalab._driver.sim`).

Every test builds its own :class:`SimulatorBackend` from a :class:`SimulatorConfig` (read
from a mapping with :meth:`SimulatorConfig.from_env`, never from ``os.environ`` unless the
test is about that), so nothing here depends on (or disturbs) the process-wide backend the
other tests use.
"""

from __future__ import annotations

import collections
import ctypes
import gc
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from cudalab._driver import base
from cudalab._driver.sim import (
    DEVICE_STRIDE,
    FAKE_BASE,
    SimulatedNvml,
    SimulatorBackend,
    SimulatorConfig,
    parse_visible_devices,
    register_kernel,
)
from cudalab._driver.sim.config import device_uuid
from cudalab.errors import CudaError, NvmlError, OutOfMemoryError

GiB = 1 << 30
MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]


def expect_cuda_error(code, name, fn, *args, call=None, message=None):
    with pytest.raises(CudaError) as info:
        fn(*args)
    err = info.value
    assert err.code == code and err.name == name, str(err)
    if call is not None:
        assert err.call == call
    if message is not None:
        assert err.message == message
    return err


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _strict_overcommit() -> bool:
    try:
        with open("/proc/sys/vm/overcommit_memory") as f:
            return f.read().strip() == "2"
    except OSError:
        return False


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
needs_noreserve = pytest.mark.skipif(
    _strict_overcommit(), reason="vm.overcommit_memory=2 ignores MAP_NORESERVE")


# ============================================================================ configuration
def test_class_shape_and_defaults(make):
    assert issubclass(SimulatorBackend, base.Backend)
    assert SimulatorBackend.name == "simulator" and SimulatorBackend.simulated is True
    b = make()
    b.init()  # idempotent
    assert b.device_count() == 2
    assert b.device_info(0).total_memory == 16 * GiB
    assert b.driver_version() == 13000
    assert "simulat" in repr(b).lower()


@pytest.mark.parametrize("value, expected", [("1", 1), (" 3 ", 3), ("8", 8), ("", 2)])
def test_device_count_env(make, value, expected):
    assert make(devices=value).device_count() == expected


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5", "65", "2 devices", "0x2"])
def test_device_count_env_malformed(make, value):
    with pytest.raises(ValueError, match="CUDALAB_SIMULATOR_DEVICES") as info:
        make(devices=value)
    assert "whole number" in str(info.value)


@pytest.mark.parametrize("value, expected", [
    ("1073741824", GiB),
    ("1GiB", GiB),
    ("1 gib", GiB),
    ("1.5GiB", 3 * GiB // 2),
    ("512MiB", 512 * MiB),
    ("8GB", 8 * 10**9),
    ("64mb", 64 * 10**6),
    ("2048KiB", 2 * MiB),
    ("1tib", 1 << 40),
    ("3000000B", 3 * 10**6),
    (".5GiB", GiB // 2),
    ("", 16 * GiB),
    # cudalab._units.parse_size's table (one parser for every size cudalab reads):
    ("1g", GiB),
    ("16G", 16 * GiB),
    ("512m", 512 * MiB),
    ("1.5GB", 15 * 10**8),
    ("1e9", 10**9),
])
def test_memory_env(make, value, expected):
    b = make(devices=1, memory=value)
    assert b.device_info(0).total_memory == expected
    assert b.mem_get_info(0) == (expected, expected)


def test_memory_env_1g_is_a_gibibyte():
    # The bug of issue 17: "1g" was rejected here while other inputs read it as 2**30.
    assert SimulatorConfig.from_env({"CUDALAB_SIMULATOR_MEMORY": "1g"}).memory == 2**30


@pytest.mark.parametrize("value", ["lots", "16 GiBs", "1.2.3GiB", "-1GiB", "GiB", "0",
                                   "100B", "2TiB", "1024k1"])
def test_memory_env_malformed(make, value):
    with pytest.raises(ValueError, match="CUDALAB_SIMULATOR_MEMORY") as info:
        make(memory=value)
    assert "e.g." in str(info.value) and "16GiB" in str(info.value)


# ============================================================================ SimulatorConfig
def test_config_defaults_and_from_env_mapping(monkeypatch):
    cfg = SimulatorConfig()
    assert (cfg.device_count, cfg.memory, cfg.visible_devices) == (2, 16 * GiB, None)
    assert SimulatorConfig.from_env({}) == cfg
    env = {"CUDALAB_SIMULATOR_DEVICES": "3", "CUDALAB_SIMULATOR_MEMORY": "512MiB",
           "CUDA_VISIBLE_DEVICES": "2,0"}
    monkeypatch.setenv("CUDALAB_SIMULATOR_DEVICES", "5")  # a given mapping ignores os.environ
    got = SimulatorConfig.from_env(env)
    assert got == SimulatorConfig(device_count=3, memory=512 * MiB, visible_devices="2,0")
    assert got.visible() == [2, 0] and cfg.visible() == [0, 1]
    assert SimulatorConfig.from_env().device_count == 5  # None reads os.environ
    with pytest.raises(AttributeError):  # frozen
        cfg.memory = 1  # type: ignore[misc]


def test_backend_without_config_reads_the_environment(monkeypatch):
    monkeypatch.setenv("CUDALAB_SIMULATOR_DEVICES", "3")
    monkeypatch.setenv("CUDALAB_SIMULATOR_MEMORY", "64MiB")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    b = SimulatorBackend()
    assert b.config == SimulatorConfig(3, 64 * MiB, "1")
    assert b.device_count() == 1 and b.device_info(0).total_memory == 64 * MiB


@pytest.mark.parametrize("kwargs, error, text", [
    ({"device_count": 0}, ValueError, "device_count=0 is out of range"),
    ({"device_count": 65}, ValueError, "from 1 to 64"),
    ({"device_count": 2.0}, TypeError, "device_count must be an int"),
    ({"device_count": True}, TypeError, "device_count must be an int"),
    ({"memory": (1 << 20) - 1}, ValueError, "between 1MiB"),
    ({"memory": (1 << 40) + 1}, ValueError, "1TiB"),
    ({"memory": "1g"}, TypeError, "memory must be an int"),
    ({"visible_devices": 0}, TypeError, "visible_devices must be a str"),
])
def test_config_validation(kwargs, error, text):
    with pytest.raises(error, match="SimulatorConfig") as info:
        SimulatorConfig(**kwargs)
    assert text in str(info.value)


def test_config_bounds_are_accepted():
    assert SimulatorConfig(device_count=64, memory=1 << 40).memory == 1 << 40
    assert SimulatorConfig(device_count=1, memory=1 << 20).device_count == 1


def test_backend_rejects_a_non_config():
    with pytest.raises(TypeError, match="SimulatorConfig"):
        SimulatorBackend({"device_count": 1})  # type: ignore[arg-type]


def test_two_backends_with_different_configs_side_by_side():
    small = SimulatorBackend(SimulatorConfig(device_count=1, memory=8 * MiB))
    big = SimulatorBackend(SimulatorConfig(device_count=3, memory=64 * MiB, visible_devices="2"))
    small.init()
    big.init()
    assert (small.device_count(), big.device_count()) == (1, 1)
    assert small.mem_get_info(0) == (8 * MiB, 8 * MiB)
    assert big.device_info(0).uuid == device_uuid(2) and big.nvml().device_count() == 3
    p = big.mem_alloc(0, 16 * MiB)  # more than the small one holds
    with pytest.raises(OutOfMemoryError):
        small.mem_alloc(0, 16 * MiB)
    q = small.mem_alloc(0, 4 * MiB)
    big.memset_d8(0, p, 7, 16)
    small.memset_d8(0, q, 9, 16)
    assert bytes(big.host_view(p, 4)) == b"\x07" * 4 and bytes(small.host_view(q, 4)) == b"\x09" * 4
    assert big.mem_get_info(0)[0] == 48 * MiB and small.mem_get_info(0)[0] == 4 * MiB
    with pytest.raises(CudaError):  # one backend's handles are foreign to the other
        small.stream_query(big.stream_create(0))
    big.mem_free(0, p)
    small.mem_free(0, q)


# ============================================================================ CUDA_VISIBLE_DEVICES
@pytest.mark.parametrize("value, count, expected", [
    ("1", 3, [1]),
    ("1,0", 3, [1, 0]),
    ("0,0", 3, []),
    ("2,-1,0", 3, [2]),
    ("", 3, []),
    ("0, 1", 3, [0, 1]),
    ("1gpu2,2ampere", 3, [1, 2]),      # strtoul: trailing text ignored
    ("0, 1, 2, -1, 3", 4, [0, 1, 2]),  # a negative entry ends the list
    ("0, 1, 2, 1", 4, []),             # a duplicate empties it
    ("2, +3, -0, 5", 6, [2, 3, 0, 5]),
    ("one,two,3,4", 5, []),
    ("4,3,two,one", 5, [4, 3]),
    ("0,5,1", 3, [0]),                 # stops at the first device that does not exist
    ("7", 3, []),
    ("MIG-abc", 3, []),
])
def test_parse_visible_devices(value, count, expected):
    assert parse_visible_devices(value, count) == expected


def test_parse_visible_devices_uuids():
    uuids = [device_uuid(i) for i in range(3)]
    assert len(set(uuids)) == 3
    assert parse_visible_devices(uuids[1], 3) == [1]
    assert parse_visible_devices(f"{uuids[2]},{uuids[0]}", 3) == [2, 0]
    # Unique prefixes are enough; an ambiguous or unknown one stops the list.
    prefixes = []
    for u in uuids:
        n = 5
        while sum(v.startswith(u[:n]) for v in uuids) > 1:
            n += 1
        prefixes.append(u[:n])
    assert parse_visible_devices(",".join(prefixes[::-1]), 3) == [2, 1, 0]
    assert parse_visible_devices("GPU-", 3) == []
    assert parse_visible_devices(f"{uuids[0]},GPU-zzzz,{uuids[1]}", 3) == [0]
    assert parse_visible_devices(f"{uuids[0]},{uuids[0]}", 3) == []
    assert parse_visible_devices(uuids[0].upper().replace("GPU-", "GPU-"), 3) == [0]


def test_visible_devices_remap_the_backend(make):
    b = make(devices=3, memory="1GiB", visible="2,0")
    assert b.device_count() == 2
    info = b.device_info(0)
    assert info.uuid == device_uuid(2) and info.pci_bus_id == "0000:1a:00.0"
    assert b.device_info(1).uuid == device_uuid(0)
    expect_cuda_error(101, "CUDA_ERROR_INVALID_DEVICE", b.mem_alloc, 2, 512)
    nvml = b.nvml()
    assert nvml.device_count() == 3  # NVML ignores CUDA_VISIBLE_DEVICES
    assert nvml.uuids() == [device_uuid(i) for i in range(3)]
    b.mem_alloc(0, 10 * MiB)
    assert nvml.memory_info(device_uuid(2))[2] == 10 * MiB
    assert nvml.memory_info(device_uuid(1))[2] == 0
    assert nvml.processes(device_uuid(1)) == []


def test_visible_devices_empty_means_no_device(make):
    b = make(visible="")
    assert b.device_count() == 0
    expect_cuda_error(100, "CUDA_ERROR_NO_DEVICE", b.device_info, 0)
    assert b.nvml().device_count() == 2


# ============================================================================ memory
@linux_only
@needs_noreserve
def test_lazy_commit_15_gib_costs_nothing(make):
    b = make()  # 2 x 16 GiB, more than this machine may have
    before = rss_bytes()
    p0 = b.mem_alloc(0, 15 * GiB)
    p1 = b.mem_alloc(1, 15 * GiB)
    grown = rss_bytes() - before
    assert grown < 64 * MiB, grown
    assert b.mem_get_info(0) == (GiB, 16 * GiB)
    # Touch only the ends: still cheap, and the memory is really there.
    b.memset_d8(0, p0 + 15 * GiB - 4096, 0xAB, 4096)
    assert bytes(b.host_view(p0 + 15 * GiB - 2, 2)) == b"\xab\xab"
    assert rss_bytes() - before < 64 * MiB
    b.mem_free(0, p0)
    b.mem_free(1, p1)
    assert b.mem_get_info(0) == (16 * GiB, 16 * GiB)


@linux_only
def test_large_free_returns_memory_to_the_os(make):
    b = make(devices=1, memory="1GiB")
    p = b.mem_alloc(0, 256 * MiB)
    before = rss_bytes()
    b.memset_d8(0, p, 1, 256 * MiB)
    assert rss_bytes() - before > 200 * MiB
    b.mem_free(0, p)
    assert rss_bytes() - before < 32 * MiB
    # Freed memory reads back as zeros after reuse (fresh pages).
    q = b.mem_alloc(0, 256 * MiB)
    assert q == p and not b.array(q, np.uint8, 256 * MiB)[:: 1 << 20].any()


def test_out_of_memory_error_and_recovery(b):
    p = b.mem_alloc(0, 48 * MiB)
    err = expect_cuda_error(2, "CUDA_ERROR_OUT_OF_MEMORY", b.mem_alloc, 0, 32 * MiB,
                            call="cuMemAlloc", message="out of memory")
    assert isinstance(err, OutOfMemoryError)
    assert str(err) == "cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY (2): out of memory"
    err = expect_cuda_error(2, "CUDA_ERROR_OUT_OF_MEMORY", b.mem_alloc_async, 0, 32 * MiB,
                            b.null_stream(0), call="cuMemAllocAsync")
    assert isinstance(err, OutOfMemoryError)
    assert b.mem_get_info(0) == (16 * MiB, 64 * MiB)
    with pytest.raises(OutOfMemoryError):
        b.mem_alloc(0, 65 * MiB)  # more than the device
    b.mem_free(0, p)
    q = b.mem_alloc(0, 64 * MiB)  # the whole device
    assert b.mem_get_info(0) == (0, 64 * MiB)
    b.mem_free(0, q)
    assert b.mem_alloc(0, 0) == 0  # empty allocations are the null pointer
    b.mem_free(0, 0)


def test_alignment_and_rounding(b):
    small = [b.mem_alloc(0, n) for n in (1, 511, 512, 513, 4097)]
    assert all(p % 512 == 0 for p in small)
    assert b.mem_get_info(0)[0] == 64 * MiB - (512 + 512 + 512 + 1024 + 4608)
    big = b.mem_alloc(0, 2 * MiB + 1)
    assert big % (2 * MiB) == 0
    assert all(FAKE_BASE <= p < FAKE_BASE + DEVICE_STRIDE for p in small + [big])
    other = b.mem_alloc(1, 1000)
    assert FAKE_BASE + DEVICE_STRIDE <= other < FAKE_BASE + 2 * DEVICE_STRIDE
    assert other < 2**53  # exact as a JSON/JS number
    assert b.pointer_device(small[0]) == 0 and b.pointer_device(other) == 1
    assert b.pointer_device(small[0] + 100) == 0
    arr = np.zeros(4)
    assert b.pointer_device(arr.ctypes.data) is None and b.pointer_device(0) is None
    b.mem_free(1, other)
    assert b.pointer_device(other) is None  # freed


def test_coalescing_reuses_neighbouring_holes(b):
    a = b.mem_alloc(0, 16 * MiB)
    m = b.mem_alloc(0, 16 * MiB)
    c = b.mem_alloc(0, 16 * MiB)
    d = b.mem_alloc(0, 16 * MiB)  # device full
    with pytest.raises(OutOfMemoryError):
        b.mem_alloc(0, 512)
    b.mem_free(0, m)
    b.mem_free(0, a)
    big = b.mem_alloc(0, 32 * MiB)  # fits only in the merged a+m hole
    assert big == a
    b.mem_free(0, c)
    b.mem_free(0, big)
    b.mem_free(0, d)
    whole = b.mem_alloc(0, 64 * MiB)
    assert whole == a
    b.mem_free(0, whole)
    dev = b._devs[0]
    assert dev.free_offs == [0] and dev.free_size == {0: 64 * MiB} and dev.used == 0
    assert dev.free_by_size == [(64 * MiB, 0)]


def test_best_fit_prefers_the_smallest_hole(b):
    a = b.mem_alloc(0, 8 * MiB)
    sep1 = b.mem_alloc(0, 512)
    small = b.mem_alloc(0, 1 * MiB)
    sep2 = b.mem_alloc(0, 512)
    b.mem_free(0, a)
    b.mem_free(0, small)
    assert b.mem_alloc(0, 1 * MiB) == small  # the 1 MiB hole, not the first (8 MiB) one
    assert b.mem_alloc(0, 4 * MiB) == a
    for p in (sep1, sep2):
        b.mem_free(0, p)


def test_double_free_and_foreign_pointers_leave_state_intact(b):
    p = b.mem_alloc(0, 4096)
    q = b.mem_alloc(0, 4096)
    b.memset_d8(0, q, 7, 4096)
    b.mem_free(0, p)
    info = b.mem_get_info(0)
    host = np.zeros(16, dtype=np.uint8)
    for bad in (p, q + 512, host.ctypes.data, FAKE_BASE + 60 * MiB, 12345):
        expect_cuda_error(1, "CUDA_ERROR_INVALID_VALUE", b.mem_free, 0, bad,
                          call="cuMemFree", message="invalid argument")
    expect_cuda_error(1, "CUDA_ERROR_INVALID_VALUE", b.mem_free_async, 0, p, b.null_stream(0),
                      call="cuMemFreeAsync")
    assert b.mem_get_info(0) == info
    assert (b.array(q, np.uint8, 4096) == 7).all()
    b.mem_free(0, q)
    assert b.mem_get_info(0) == (64 * MiB, 64 * MiB)


def test_copies_round_trip(b):
    n = 1 << 16
    src = np.arange(n, dtype=np.float32)
    d0 = b.mem_alloc(0, src.nbytes)
    d0b = b.mem_alloc(0, src.nbytes)
    d1 = b.mem_alloc(1, src.nbytes)
    b.memcpy(0, d0, src.ctypes.data, src.nbytes)  # H2D
    b.memcpy(0, d0b, d0, src.nbytes)  # D2D
    s = b.stream_create(0)
    b.memcpy_peer_async(d1, 1, d0b, 0, src.nbytes, s)  # peer
    b.stream_synchronize(s)
    out = np.empty_like(src)
    b.memcpy(1, out.ctypes.data, d1, src.nbytes)  # D2H
    assert np.array_equal(out, src)
    np.testing.assert_array_equal(b.array(d1, np.float32, n), src)
    # Unified addressing: a plain memcpy between devices works too.
    b.memset_d8(1, d1, 0, src.nbytes)
    b.memcpy(0, d1, d0, src.nbytes)
    assert np.array_equal(b.array(d1, np.float32, n), src)
    # Peer copies check that the pointers belong to the named devices.
    expect_cuda_error(1, "CUDA_ERROR_INVALID_VALUE", b.memcpy_peer_async,
                      d1, 0, d0, 0, 16, s, call="cuMemcpyPeerAsync")
    b.stream_destroy(s)


def test_pinned_memory_and_async_copies(b):
    n = 3 * 4096 + 100
    h = b.host_alloc(n)
    assert h % 4096 == 0 and b.pointer_device(h) is None
    view = np.frombuffer(b.host_view(h, n), dtype=np.uint8)
    view[:] = np.arange(n) % 251
    d = b.mem_alloc(0, n)
    s = b.stream_create(0)
    b.memcpy_async(0, d, h, n, s)
    h2 = b.host_alloc(n)
    b.memcpy_async(0, h2, d, n, s)
    b.stream_synchronize(s)
    assert bytes(b.host_view(h2, n)) == bytes(view)
    # A range running past the end of a pinned buffer is refused.
    expect_cuda_error(1, "CUDA_ERROR_INVALID_VALUE", b.memcpy, 0, d, h + n - 10, 20)
    del view
    b.host_free(h)
    b.host_free(h2)
    expect_cuda_error(1, "CUDA_ERROR_INVALID_VALUE", b.host_free, h, call="cuMemFreeHost")
    b.host_free(0)
    assert b.host_alloc(0) == 0


def test_memset_d16(b):
    p = b.mem_alloc(0, 1024)  # (the simulator's allocations are whole 512 B units)
    b.memset_d8(0, p, 0, 1024)
    s = b.stream_create(0)
    b.memset_d16_async(0, p + 2, 0x3C00, 5, s)  # 2-byte aligned, not 4
    b.memset_d16_async(0, p + 20, -1, 1, s)
    b.stream_synchronize(s)
    assert list(b.array(p, np.uint16, 12)) == [0, *[0x3C00] * 5, 0, 0, 0, 0, 0xFFFF, 0]
    expect_cuda_error(1, "CUDA_ERROR_INVALID_VALUE", b.memset_d16_async, 0, p + 1, 1, 4, s)
    expect_cuda_error(1, "CUDA_ERROR_INVALID_VALUE", b.memset_d16_async, 0, p + 1022, 1, 2, s)
    with pytest.raises(ValueError):
        b.memset_d16_async(0, p, 1 << 16, 1, s)


def test_memset_d8_and_d32(b):
    p = b.mem_alloc(0, 4096)
    b.memset_d8(0, p, 0x5A, 4096)
    assert (b.array(p, np.uint8, 4096) == 0x5A).all()
    s = b.stream_create(0)
    b.memset_d8_async(0, p + 1, 0xFF, 10, s)
    b.memset_d32_async(0, p + 64, 0xDEADBEEF, 7, s)
    b.memset_d32_async(0, p + 128, -1, 1, s)
    b.stream_synchronize(s)
    a = b.array(p, np.uint8, 4096)
    assert a[0] == 0x5A and (a[1:11] == 0xFF).all() and a[11] == 0x5A
    assert (b.array(p + 64, np.uint32, 7) == 0xDEADBEEF).all()
    assert a[64 + 28] == 0x5A
    assert b.array(p + 128, np.uint32, 1)[0] == 0xFFFFFFFF
    expect_cuda_error(1, "CUDA_ERROR_INVALID_VALUE", b.memset_d32_async, 0, p + 2, 1, 4, s)
    expect_cuda_error(1, "CUDA_ERROR_INVALID_VALUE", b.memset_d32_async, 0, p + 4092, 1, 2, s)
    with pytest.raises(ValueError):
        b.memset_d8(0, p, 256, 1)


def test_bounds_errors_never_crash(b):
    p = b.mem_alloc(0, 1000)  # 1024 usable after rounding
    host = np.zeros(4096, dtype=np.uint8)
    h = host.ctypes.data
    b.memcpy(0, p, h, 1024)  # inside the rounded allocation
    bad = [
        (p, h, 1025),                   # past the end of the allocation
        (p + 1024, h, 1),               # just after it
        (FAKE_BASE + 32 * MiB, h, 16),  # never allocated
        (FAKE_BASE + 5 * DEVICE_STRIDE, h, 16),  # a device that does not exist
        (h, 0, 16),                     # NULL
        (h, 8, 16),                     # the zero page
        (h, 0xFFFF_8000_0000_0000, 16),  # kernel space
        (h, 0x7FFF_FFFF_FFF0, 32),      # runs off the user address space
    ]
    for dst, src, n in bad:
        expect_cuda_error(1, "CUDA_ERROR_INVALID_VALUE", b.memcpy, 0, dst, src, n,
                          call="cuMemcpy")
        expect_cuda_error(1, "CUDA_ERROR_INVALID_VALUE", b.memcpy, 0, src, dst, n)
    q = b.mem_alloc(0, 512)
    b.mem_free(0, q)
    expect_cuda_error(1, "CUDA_ERROR_INVALID_VALUE", b.memcpy, 0, h, q, 16)  # freed
    expect_cuda_error(1, "CUDA_ERROR_INVALID_VALUE", b.memset_d8, 0, q, 0, 16)
    expect_cuda_error(1, "CUDA_ERROR_INVALID_VALUE", b.host_view, p + 1000, 100)
    with pytest.raises(CudaError):
        b.array(p, np.float64, 129)
    assert len(b.host_view(p, 0)) == 0 and b.array(p, np.float32, 0).shape == (0,)
    b.memcpy(0, 0, 0, 0)  # zero bytes: nothing to check


def test_peer_access(b):
    assert b.can_access_peer(0, 1) and b.can_access_peer(1, 0)
    assert not b.can_access_peer(0, 0)
    b.enable_peer_access(0, 1)
    b.enable_peer_access(0, 1)  # twice is fine
    expect_cuda_error(101, "CUDA_ERROR_INVALID_DEVICE", b.enable_peer_access, 0, 0)
    expect_cuda_error(101, "CUDA_ERROR_INVALID_DEVICE", b.can_access_peer, 0, 2)


# ============================================================================ streams
def test_null_stream_priorities_and_handles(b):
    n0, n1 = b.null_stream(0), b.null_stream(1)
    assert n0 is b.null_stream(0) and n0 is not n1
    assert b.handle_int(n0) == 0 == b.handle_int(n1) and b.handle_int(None) == 0
    assert b.stream_priority_range(0) == (0, -5)
    hi = b.stream_create(0, base.STREAM_NON_BLOCKING, -100)
    lo = b.stream_create(0, base.STREAM_DEFAULT, 100)
    mid = b.stream_create(0, priority=-3)
    assert (b.stream_priority(hi), b.stream_priority(lo), b.stream_priority(mid)) == (-5, 0, -3)
    handles = {b.handle_int(s) for s in (hi, lo, mid)}
    assert len(handles) == 3 and 0 not in handles and all(h < 2**53 for h in handles)
    assert b.stream_from_int(0, b.handle_int(hi)) is hi
    assert b.stream_from_int(1, 0) is n1 and b.stream_from_int(1, 1) is n1
    pts = b.stream_from_int(0, 2)
    assert b.handle_int(pts) == 2 and pts is b.stream_from_int(0, 2)
    assert b.stream_is_capturing(hi) is False
    b.stream_destroy(hi)
    expect_cuda_error(400, "CUDA_ERROR_INVALID_HANDLE", b.stream_destroy, hi)
    expect_cuda_error(400, "CUDA_ERROR_INVALID_HANDLE", b.stream_query, hi)
    expect_cuda_error(400, "CUDA_ERROR_INVALID_HANDLE", b.stream_destroy, n0)
    expect_cuda_error(400, "CUDA_ERROR_INVALID_HANDLE", b.stream_from_int, 0, 0x1234)
    expect_cuda_error(400, "CUDA_ERROR_INVALID_HANDLE", b.stream_query, object())
    expect_cuda_error(1, "CUDA_ERROR_INVALID_VALUE", b.stream_create, 0, 7)
    # Raw 0 means the current context's null stream (needs set_context first).
    expect_cuda_error(201, "CUDA_ERROR_INVALID_CONTEXT", b.stream_query, 0)
    b.set_context(1)
    assert b.stream_query(0) is True


def test_paused_stream_runs_in_order_on_resume(b):
    p = b.mem_alloc(0, 4096)
    h = np.zeros(4, dtype=np.uint8)
    s = b.stream_create(0)
    e = b.event_create(0)
    b.pause_stream(s)
    b.memset_d8_async(0, p, 1, 4, s)
    b.memset_d8_async(0, p, 2, 4, s)
    b.memcpy_async(0, h.ctypes.data, p, 4, s)
    b.memset_d8_async(0, p, 3, 4, s)
    b.event_record(e, s)
    assert not b.stream_query(s) and not b.event_query(e)
    assert (h == 0).all() and (b.array(p, np.uint8, 4) == 0).all()
    with pytest.raises(RuntimeError, match="pause"):
        b.stream_synchronize(s)
    with pytest.raises(RuntimeError, match="pause"):
        b.event_synchronize(e)
    with pytest.raises(RuntimeError, match="pause"):
        b.synchronize(0)
    b.resume_stream(s)
    assert b.stream_query(s) and b.event_query(e)
    assert (h == 2).all() and (b.array(p, np.uint8, 4) == 3).all()
    b.stream_synchronize(s)
    b.event_synchronize(e)
    b.synchronize(0)


def test_stream_ordered_free(b):
    s = b.stream_create(0)
    p = b.mem_alloc_async(0, 8 * MiB, s)
    b.pause_stream(s)
    b.mem_free_async(0, p, s)
    assert b.mem_get_info(0)[0] == 56 * MiB  # not yet freed
    b.memset_d8(0, p, 1, 16)  # still usable until the stream reaches the free
    expect_cuda_error(1, "CUDA_ERROR_INVALID_VALUE", b.mem_free_async, 0, p, s)
    expect_cuda_error(1, "CUDA_ERROR_INVALID_VALUE", b.mem_free, 0, p, call="cuMemFree")
    b.resume_stream(s)
    assert b.mem_get_info(0)[0] == 64 * MiB
    b.mem_free_async(0, 0, s)  # null pointer: nothing


def test_stream_wait_event_cross_stream(b):
    p = b.mem_alloc(0, 64)
    out = np.zeros(64, dtype=np.uint8)
    producer = b.stream_create(0)
    consumer = b.stream_create(0)
    other = b.stream_create(0)
    e = b.event_create(0)
    b.pause_stream(producer)
    b.memset_d8_async(0, p, 42, 64, producer)
    b.event_record(e, producer)
    b.stream_wait_event(consumer, e)
    b.memcpy_async(0, out.ctypes.data, p, 64, consumer)
    b.memset_d8_async(0, p + 32, 9, 1, other)  # unrelated stream: runs at once
    assert b.array(p, np.uint8, 64)[32] == 9
    assert not b.stream_query(consumer) and (out == 0).all()
    with pytest.raises(RuntimeError, match="waits for an event"):
        b.stream_synchronize(consumer)
    b.resume_stream(producer)  # drains the producer, then the consumer
    assert b.stream_query(consumer) and (out == 42).all()
    # Waiting on a completed or never-recorded event adds no dependency.
    b.stream_wait_event(consumer, e)
    b.stream_wait_event(consumer, b.event_create(0))
    assert b.stream_query(consumer)


def test_cross_device_wait(b):
    p1 = b.mem_alloc(1, 16)
    out = np.zeros(16, dtype=np.uint8)
    s0, s1 = b.stream_create(0), b.stream_create(1)
    e = b.event_create(1)
    b.pause_stream(s1)
    b.memset_d8_async(1, p1, 5, 16, s1)
    b.event_record(e, s1)
    b.stream_wait_event(s0, e)
    b.memcpy_async(0, out.ctypes.data, p1, 16, s0)
    assert not b.stream_query(s0)
    b.resume_stream(s1)
    b.stream_synchronize(s0)
    assert (out == 5).all()


def test_legacy_default_stream_semantics(b):
    blocking = b.stream_create(0, base.STREAM_DEFAULT)
    nonblocking = b.stream_create(0, base.STREAM_NON_BLOCKING)
    null = b.null_stream(0)
    p = b.mem_alloc(0, 16)
    b.pause_stream(blocking)
    b.memset_d8_async(0, p, 1, 16, blocking)
    # Work on the null stream waits for the blocking stream...
    b.memset_d8_async(0, p, 2, 16, null)
    assert not b.stream_query(null) and b.array(p, np.uint8, 1)[0] == 0
    # ...but not non-blocking streams; they run at once.
    b.memset_d8_async(0, p + 8, 3, 1, nonblocking)
    assert b.stream_query(nonblocking)
    assert b.array(p, np.uint8, 16)[8] == 3
    with pytest.raises(RuntimeError, match="pause"):
        b.memcpy(0, p, p + 8, 1)  # synchronous copies order on the null stream: refused
    b.resume_stream(blocking)
    assert b.stream_query(null)
    assert (b.array(p, np.uint8, 16) == 2).all()  # blocking's 1, then the null stream's 2
    # ...and blocking streams wait for earlier null-stream work.
    b.pause_stream(null)
    b.memset_d8_async(0, p, 4, 16, null)
    b.memset_d8_async(0, p, 5, 16, blocking)
    b.memset_d8_async(0, p + 15, 6, 1, nonblocking)
    assert not b.stream_query(blocking) and b.array(p, np.uint8, 16)[0] == 2
    b.resume_stream(null)
    assert b.stream_query(blocking)
    assert (b.array(p, np.uint8, 16) == 5).all()
    b.memcpy(0, p, p + 8, 1)  # nothing pending: runs at once


def test_destroyed_paused_stream_still_drains(b):
    p = b.mem_alloc(0, 16)
    s = b.stream_create(0)
    b.pause_stream(s)
    b.memset_d8_async(0, p, 6, 16, s)
    b.stream_destroy(s)
    expect_cuda_error(400, "CUDA_ERROR_INVALID_HANDLE", b.stream_query, s)
    b.resume_stream(s)
    assert (b.array(p, np.uint8, 16) == 6).all()
    with pytest.raises(CudaError):
        b.resume_stream(s)  # nothing left: an ordinary destroyed handle again


# ============================================================================ events
def test_event_timing(b):
    s = b.stream_create(0)
    start = b.event_create(0, base.EVENT_DEFAULT)
    end = b.event_create(0, base.EVENT_DEFAULT)
    assert b.event_query(start)  # never recorded
    expect_cuda_error(400, "CUDA_ERROR_INVALID_HANDLE", b.event_elapsed_time, start, end)
    b.event_record(start, s)
    time.sleep(0.02)
    b.event_record(end, s)
    ms = b.event_elapsed_time(start, end)
    assert isinstance(ms, float) and 15.0 <= ms < 2000.0
    # The clock is read when the stream reaches the event, not at record time.
    b.pause_stream(s)
    b.event_record(start, s)
    expect_cuda_error(600, "CUDA_ERROR_NOT_READY", b.event_elapsed_time, start, end,
                      call="cuEventElapsedTime")
    time.sleep(0.02)
    b.event_record(end, s)
    b.resume_stream(s)
    assert 0.0 <= b.event_elapsed_time(start, end) < 15.0
    no_timing = b.event_create(0)  # EVENT_DISABLE_TIMING by default
    b.event_record(no_timing, s)
    expect_cuda_error(400, "CUDA_ERROR_INVALID_HANDLE", b.event_elapsed_time, start, no_timing)
    b.event_destroy(no_timing)
    expect_cuda_error(400, "CUDA_ERROR_INVALID_HANDLE", b.event_destroy, no_timing)
    expect_cuda_error(400, "CUDA_ERROR_INVALID_HANDLE", b.event_query, no_timing)
    other_device = b.stream_create(1)
    expect_cuda_error(400, "CUDA_ERROR_INVALID_HANDLE", b.event_record, start, other_device)
    expect_cuda_error(1, "CUDA_ERROR_INVALID_VALUE", b.event_create, 0, 64)


def test_rerecorded_event_follows_the_latest_record(b):
    s, t = b.stream_create(0), b.stream_create(0)
    e = b.event_create(0)
    b.event_record(e, s)
    assert b.event_query(e)
    b.pause_stream(t)
    b.event_record(e, t)
    assert not b.event_query(e)
    b.resume_stream(t)
    assert b.event_query(e)


def test_ipc_event_handles(b):
    flags = base.EVENT_INTERPROCESS | base.EVENT_DISABLE_TIMING
    expect_cuda_error(1, "CUDA_ERROR_INVALID_VALUE", b.event_create, 0, base.EVENT_INTERPROCESS)
    plain = b.event_create(0)
    expect_cuda_error(1, "CUDA_ERROR_INVALID_VALUE", b.ipc_event_handle, plain,
                      call="cuIpcGetEventHandle")
    e = b.event_create(0, flags)
    h = b.ipc_event_handle(e)
    assert isinstance(h, bytes) and len(h) == base.IPC_HANDLE_SIZE
    assert h.startswith(b"CLSIMEVT") and h == b.ipc_event_handle(e)
    # Opened in the exporting process, the handle follows the original event.
    s = b.stream_create(0)
    b.pause_stream(s)
    b.event_record(e, s)
    opened = b.ipc_open_event(0, h)
    assert not b.event_query(opened)
    b.resume_stream(s)
    assert b.event_query(opened)
    assert b.ipc_event_handle(opened) == h
    b.event_destroy(opened)
    assert b.event_query(e)
    # Garbage and malformed handles.
    expect_cuda_error(1, "CUDA_ERROR_INVALID_VALUE", b.ipc_open_event, 0, os.urandom(64),
                      call="cuIpcOpenEventHandle")
    expect_cuda_error(1, "CUDA_ERROR_INVALID_VALUE", b.ipc_open_event, 0, bytes(64))
    with pytest.raises(ValueError):
        b.ipc_open_event(0, h[:32])
    with pytest.raises(TypeError):
        b.ipc_open_event(0, "text")


def test_ipc_event_opened_in_another_process_is_complete(b):
    e = b.event_create(0, base.EVENT_INTERPROCESS | base.EVENT_DISABLE_TIMING)
    s = b.stream_create(0)
    b.pause_stream(s)
    b.event_record(e, s)  # pending here; the other process cannot see our queue
    code = textwrap.dedent(f"""
        from cudalab._driver.sim import SimulatorBackend
        b = SimulatorBackend()
        ev = b.ipc_open_event(0, bytes.fromhex({b.ipc_event_handle(e).hex()!r}))
        b.event_synchronize(ev)
        b.stream_wait_event(b.null_stream(0), ev)
        print("opened", b.event_query(ev))
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=str(ROOT), timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "opened True"
    b.resume_stream(s)


# ============================================================================ kernels
def test_kernel_registry_and_launch(b, kernels):
    @register_kernel("sim_test_axpy")
    def axpy(sim, grid, block, shared_mem, a, x, y, n):
        assert isinstance(sim, SimulatorBackend)
        assert grid[0] * block[0] >= n
        sim.array(y, np.float32, n)[:] += a * sim.array(x, np.float32, n)

    assert kernels["sim_test_axpy"] is axpy
    n = 1000
    x = b.mem_alloc(0, 4 * n)
    y = b.mem_alloc(0, 4 * n)
    b.array(x, np.float32, n)[:] = np.arange(n)
    b.array(y, np.float32, n)[:] = 1.0
    mod = b.module_load(0, b"\x7fELF not really a cubin")
    b.module_load(0, 'extern "C" __global__ void k() {}')  # source text is accepted too
    fn = b.module_function(mod, "sim_test_axpy")
    args = b.make_args(("f4", "p", "p", "i4")).set(2.0, x, y, n)
    s = b.stream_create(0)
    b.launch(fn, (4, 1, 1), (256, 1, 1), 0, s, args)
    np.testing.assert_allclose(b.array(y, np.float32, n), 1.0 + 2.0 * np.arange(n))
    # Queued launches see the argument values of their launch, not later ones.
    b.pause_stream(s)
    b.launch(fn, (4, 1, 1), (256, 1, 1), 0, s, args)
    args.set(100.0, x, y, n)
    np.testing.assert_allclose(b.array(y, np.float32, n), 1.0 + 2.0 * np.arange(n))
    b.resume_stream(s)
    np.testing.assert_allclose(b.array(y, np.float32, n), 1.0 + 4.0 * np.arange(n))
    # Direct registration (not as a decorator) works as well.
    register_kernel("sim_test_noop", lambda sim, g, b_, smem: None)
    b.launch(b.module_function(mod, "sim_test_noop"), (1, 1, 1), (1, 1, 1), 0, s,
             b.make_args(()))
    err = expect_cuda_error(500, "CUDA_ERROR_NOT_FOUND", b.module_function, mod, "missing_k")
    assert err.message == "no simulator implementation registered for kernel 'missing_k'"
    b.module_unload(mod)
    expect_cuda_error(400, "CUDA_ERROR_INVALID_HANDLE", b.module_unload, mod)
    expect_cuda_error(400, "CUDA_ERROR_INVALID_HANDLE", b.launch, fn, (1, 1, 1), (1, 1, 1), 0, s,
                      args)


def test_launch_validation_and_failures(b, kernels):
    calls = []
    register_kernel("sim_test_record", lambda sim, g, bl, smem, *a: calls.append((g, bl, a)))

    @register_kernel("sim_test_fails")
    def fails(sim, grid, block, shared_mem, ptr):
        sim.array(ptr, np.float64, 1 << 20)  # far past the allocation

    mod = b.module_load(0, b"image")
    fn = b.module_function(mod, "sim_test_record")
    s = b.stream_create(0)
    args = b.make_args(("u8",)).set(7)
    for grid, block, smem in [((0, 1, 1), (1, 1, 1), 0), ((1, 1, 1), (1025, 1, 1), 0),
                              ((1, 1, 1), (32, 32, 2), 0), ((1, 1, 1), (1, 1, 65), 0),
                              ((1, 1, 1), (1, 1), 0), ((1, 1, 1), (1, 1, 1), 1 << 20),
                              ((1, 65536, 1), (1, 1, 1), 0)]:
        expect_cuda_error(1, "CUDA_ERROR_INVALID_VALUE", b.launch, fn, grid, block, smem, s, args,
                          call="cuLaunchKernel")
    assert calls == []
    b.launch(fn, (2, 3, 4), (32, 32, 1), 48 << 10, s, args)
    assert calls == [((2, 3, 4), (32, 32, 1), (7,))]
    expect_cuda_error(400, "CUDA_ERROR_INVALID_HANDLE", b.launch, fn, (1, 1, 1), (1, 1, 1), 0,
                      b.stream_create(1), args)  # module loaded on device 0
    p = b.mem_alloc(0, 64)
    bad = b.module_function(mod, "sim_test_fails")
    err = expect_cuda_error(1, "CUDA_ERROR_INVALID_VALUE", b.launch, bad, (1, 1, 1), (1, 1, 1),
                            0, s, b.make_args(("p",)).set(p))
    assert "live simulated allocation" in err.message

    @register_kernel("sim_test_raises")
    def raises(sim, grid, block, shared_mem):
        raise ZeroDivisionError("boom")

    err = expect_cuda_error(719, "CUDA_ERROR_LAUNCH_FAILED", b.launch,
                            b.module_function(mod, "sim_test_raises"), (1, 1, 1), (1, 1, 1), 0,
                            s, b.make_args(()))
    assert "boom" in err.message and isinstance(err.__cause__, ZeroDivisionError)
    assert b.stream_query(s)  # the stream is usable afterwards
    with pytest.raises(TypeError):
        register_kernel("", lambda *a: None)
    with pytest.raises(TypeError):
        register_kernel("x", 42)


def test_kernel_args_validation(b):
    args = b.make_args(("p", "i4", "u4", "i8", "u8", "f4", "f8"))
    assert args.signature == ("p", "i4", "u4", "i8", "u8", "f4", "f8")
    assert args.values == (0, 0, 0, 0, 0, 0.0, 0.0)
    vals = (2**64 - 1, -(2**31), 2**32 - 1, -(2**63), 2**64 - 1, 0.1, 0.1)
    got = args.set(*vals).values
    assert got[:5] == vals[:5] and got[6] == 0.1
    assert got[5] == float(np.float32(0.1))  # rounded like a packed float
    args.set(np.uint64(5), np.int32(-1), True, 3, 4, np.float32(1.5), 2)
    assert args.values[0] == 5 and args.values[6] == 2.0
    with pytest.raises(ValueError):
        args.set(1, 2)
    for i, bad in enumerate([-1, 2**31, -1, 2**63, 2**64]):
        row = [0, 0, 0, 0, 0, 0.0, 0.0]
        row[i] = bad
        with pytest.raises(ValueError):
            args.set(*row)
    with pytest.raises(ValueError):
        args.set(0, 0, 0, 0, 0, 1e39, 0.0)  # beyond float32
    args.set(0, 0, 0, 0, 0, float("inf"), float("nan"))
    with pytest.raises(TypeError):
        args.set(0, 1.5, 0, 0, 0, 0.0, 0.0)
    with pytest.raises(TypeError):
        args.set(None, 0, 0, 0, 0, 0.0, 0.0)
    with pytest.raises(TypeError):
        args.set(0, 0, 0, 0, 0, "1.0", 0.0)
    with pytest.raises(ValueError):
        b.make_args(("p", "i2"))
    assert b.make_args(()).set().values == ()


# ============================================================================ device info, NVML
def test_device_info_is_an_h100(make):
    b = make(devices=3, memory="80GiB")
    infos = [b.device_info(i) for i in range(3)]
    info = infos[1]
    assert "simulated" in info.name and info.simulated is True
    assert (info.major, info.minor) == (9, 0) and info.ordinal == 1
    assert info.total_memory == 80 * GiB and info.multi_processor_count == 132
    assert info.max_threads_per_multi_processor == 2048 and info.max_threads_per_block == 1024
    assert info.warp_size == 32 and info.l2_cache_size == 50 * MiB
    assert info.regs_per_multiprocessor == 65536
    assert info.shared_memory_per_block == 48 << 10
    assert info.shared_memory_per_block_optin == 227 << 10
    assert info.shared_memory_per_multiprocessor == 228 << 10
    assert info.clock_rate == 1980000 and info.memory_clock_rate == 2619000
    assert info.memory_bus_width == 5120 and info.unified_addressing
    assert not info.is_integrated and not info.is_multi_gpu_board
    assert [i.pci_bus_id for i in infos] == ["0000:18:00.0", "0000:19:00.0", "0000:1a:00.0"]
    uuids = [i.uuid for i in infos]
    assert len(set(uuids)) == 3
    import re
    assert all(re.fullmatch(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", u)
               for u in uuids)
    assert uuids == [make(devices=3).device_info(i).uuid for i in range(3)]  # deterministic
    assert b.device_info(1) is info
    expect_cuda_error(101, "CUDA_ERROR_INVALID_DEVICE", b.device_info, 3)
    expect_cuda_error(101, "CUDA_ERROR_INVALID_DEVICE", b.device_info, -1)


def test_nvml_values(b, kernels):
    nvml = b.nvml()
    assert isinstance(nvml, SimulatedNvml) and nvml.simulated and nvml is b.nvml()
    assert "simulated" in repr(nvml)
    u0, u1 = nvml.uuids()
    assert [u0, u1] == [b.device_info(0).uuid, b.device_info(1).uuid]
    # Untouched and idle.
    assert nvml.memory_info(u0) == (64 * MiB, 64 * MiB, 0)
    assert nvml.processes(u0) == [] and nvml.utilization(u0) == (0, 0)
    assert nvml.temperature(u0) == 35 and nvml.power_usage(u0) == 70000
    assert nvml.clock_sm(u0) == 345
    p = b.mem_alloc(0, 1000)  # 1024 after rounding; no context overhead in the simulator
    total, free, used = nvml.memory_info(u0)
    assert total == 64 * MiB and used == 1024 and free == total - 1024
    assert free == total - used
    assert nvml.processes(u0) == [(os.getpid(), used)]

    @register_kernel("sim_test_busy")
    def busy(sim, grid, block, shared_mem, ms):
        time.sleep(ms / 1000)

    fn = b.module_function(b.module_load(1, b"x"), "sim_test_busy")
    b.launch(fn, (1, 1, 1), (1, 1, 1), 0, b.stream_create(1), b.make_args(("u4",)).set(300))
    gpu, mem = nvml.utilization(u1)
    assert 20 <= gpu <= 100 and 0 < mem <= 100
    assert nvml.clock_sm(u1) == 1980
    assert 35 < nvml.temperature(u1) <= 60
    assert 70000 < nvml.power_usage(u1) <= 700000
    assert nvml.utilization(u0)[0] == 0  # copies only on device 0 so far
    with pytest.raises(NvmlError):
        nvml.memory_info("GPU-00000000-0000-0000-0000-000000000000")
    b.mem_free(0, p)


def test_nvml_busy_percent_is_the_share_of_the_last_second(monkeypatch):
    """The utilisation sums the last second of the activity log (bisected, C-level sums):
    the same figures as a plain loop over every entry, on random logs."""
    from cudalab._driver.sim import nvml as sim_nvml
    from cudalab._driver.sim.core import ACTIVITY_COPY, ACTIVITY_KERNEL

    now_ns = 10**18
    monkeypatch.setattr(sim_nvml, "now", lambda: now_ns)

    def plain(log):
        lo = now_ns - 10**9
        kern = copy = 0
        kinds = set()
        for t0, t1, kind in log:
            if t1 >= lo:
                kinds.add(kind)
                if kind == ACTIVITY_KERNEL:
                    kern += t1 - max(t0, lo)
                else:
                    copy += t1 - max(t0, lo)

        def pct(ns, active):
            return max(1, min(100, round(ns / 1e7))) if active else 0

        return (pct(kern, ACTIVITY_KERNEL in kinds),
                pct(copy + kern / 2, bool(kinds)))

    rng = random.Random(5)
    seen = set()
    for _ in range(200):
        t, log = now_ns - 3 * 10**9, []
        for _ in range(rng.randrange(0, 3000)):
            t0 = t + rng.randrange(0, 2_000_000)
            t = t0 + rng.randrange(0, 20_000_000)  # (some span the second's start)
            if t > now_ns:
                break
            log.append((t0, t, rng.choice((ACTIVITY_KERNEL, ACTIVITY_COPY))))
        got = sim_nvml.busy_percent(collections.deque(log, maxlen=4096))
        assert got == plain(log[-4096:]), len(log)
        seen.add(got)
    assert len(seen) > 20  # (the logs covered many figures, idle included)
    assert (0, 0) in seen


def test_nvml_memory_on_a_large_device(make):
    b = make(devices=1, memory="16GiB")
    nvml = b.nvml()
    (u,) = nvml.uuids()
    b.mem_alloc(0, GiB)
    total, free, used = nvml.memory_info(u)
    assert (total, used) == (16 * GiB, GiB) and free == total - used
    assert b.mem_get_info(0) == (15 * GiB, 16 * GiB)


# ============================================================================ threads
def test_concurrent_alloc_free_keeps_counters_consistent(make):
    b = make(devices=2, memory="256MiB")
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        mine = []
        try:
            for _ in range(300):
                if mine and rng.random() < 0.45:
                    d, p, n, tag = mine.pop(rng.randrange(len(mine)))
                    assert (b.array(p, np.uint8, n) == tag).all(), "allocation overlapped"
                    b.mem_free(d, p)
                else:
                    d = rng.randrange(2)
                    n = rng.choice([1, 512, 3000, 1 << 16, 3 << 20])
                    try:
                        p = b.mem_alloc(d, n)
                    except OutOfMemoryError:
                        continue
                    tag = seed % 250 + 1
                    b.memset_d8(d, p, tag, n)
                    mine.append((d, p, n, tag))
            for d, p, n, tag in mine:
                assert (b.array(p, np.uint8, n) == tag).all(), "allocation overlapped"
                b.mem_free(d, p)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for d in range(2):
        assert b.mem_get_info(d) == (256 * MiB, 256 * MiB)
        dev = b._devs[d]
        assert dev.used == 0 and dev.alloc_offs == [] and dev.free_offs == [0]
        assert dev.free_by_size == [(256 * MiB, 0)]


def test_concurrent_streams_and_events(b):
    errors = []

    def worker(i):
        try:
            s = b.stream_create(i % 2)
            e = b.event_create(i % 2, base.EVENT_DEFAULT)
            p = b.mem_alloc(i % 2, 4096)
            out = np.zeros(4096, dtype=np.uint8)
            for k in range(100):
                b.memset_d8_async(i % 2, p, k, 4096, s)
                b.memcpy_async(i % 2, out.ctypes.data, p, 4096, s)
                b.event_record(e, s)
                b.event_synchronize(e)
                assert (out == k).all()
            b.stream_synchronize(s)
            b.mem_free(i % 2, p)
            b.stream_destroy(s)
            b.event_destroy(e)
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_free_reentering_during_a_bookkeeping_update_is_deferred(b):
    """A finalizer that frees while this thread is mid-update must neither deadlock nor
    corrupt the free lists: the free is applied when the update ends."""
    p = b.mem_alloc(0, 4096)
    with b._mem_lock:
        b._mem_busy = True  # as if a GC finalizer interrupted _alloc/_free here
        try:
            b.mem_free(0, p)  # re-entrant: deferred, returns at once
        finally:
            b._mem_busy = False
    assert b.mem_get_info(0)[0] == 64 * MiB - 4096
    q = b.mem_alloc(0, 512)  # the next update applies the deferred free
    assert b.mem_get_info(0)[0] == 64 * MiB - 512
    b.mem_free(0, q)


def test_kernels_may_call_back_into_the_simulator(b, kernels):
    @register_kernel("sim_test_reentrant")
    def reentrant(sim, grid, block, shared_mem, ptr):
        tmp = sim.mem_alloc(0, 64)
        sim.memset_d8(0, tmp, 9, 64)
        sim.memcpy(0, ptr, tmp, 64)
        sim.mem_free(0, tmp)
        gc.collect()

    p = b.mem_alloc(0, 64)
    fn = b.module_function(b.module_load(0, b"x"), "sim_test_reentrant")
    s = b.stream_create(0)
    b.launch(fn, (1, 1, 1), (1, 1, 1), 0, s, b.make_args(("p",)).set(p))
    assert (b.array(p, np.uint8, 64) == 9).all()
    b.pause_stream(s)
    b.memset_d8_async(0, p, 0, 64, s)
    b.launch(fn, (1, 1, 1), (1, 1, 1), 0, s, b.make_args(("p",)).set(p))
    b.resume_stream(s)
    assert (b.array(p, np.uint8, 64) == 9).all()
    assert b.mem_get_info(0)[0] == 64 * MiB - 512


def test_host_view_is_writable_and_shared(b):
    p = b.mem_alloc(0, 16)
    v = b.host_view(p, 16)
    v[:4] = b"abcd"
    assert bytes(b.host_view(p, 4)) == b"abcd"
    a = b.array(p, np.uint32, 4)
    a[1] = 0x01020304
    assert bytes(v[4:8]) == (0x01020304).to_bytes(4, "little")
    host = ctypes.create_string_buffer(b"xyz", 8)
    assert bytes(b.host_view(ctypes.addressof(host), 3)) == b"xyz"


# ============================================================================ IPC memory handles
def test_ipc_mem_handle_of_an_allocation(b):
    p = b.mem_alloc(0, 3 * MiB)
    q = b.mem_alloc(1, 4096)
    h = b.ipc_mem_handle(p)
    assert isinstance(h, bytes) and len(h) == base.IPC_HANDLE_SIZE
    assert b.ipc_mem_handle(p) == h  # deterministic
    assert b.ipc_mem_handle(p + 512) == b.ipc_mem_handle(p + 3 * MiB - 1) == h  # like the driver
    assert b.ipc_mem_handle(q) != h
    other = b.mem_alloc(0, 4096)
    assert b.ipc_mem_handle(other) not in (h, b.ipc_mem_handle(q))
    b.mem_free(0, p)
    expect_cuda_error(1, "CUDA_ERROR_INVALID_VALUE", b.ipc_mem_handle, p,
                      call="cuIpcGetMemHandle")  # freed


def test_ipc_mem_handle_refuses_memory_it_cannot_share(b):
    p = b.mem_alloc(0, 1 * MiB)
    s = b.stream_create(0)
    pool = b.pool_create(0)
    pooled = b.pool_alloc_async(pool, 4096, s)
    va = b.vmm_reserve(0, 2 * MiB)
    phys = b.vmm_create(0, 2 * MiB)
    b.vmm_map(0, va, 2 * MiB, phys)
    host = b.host_alloc(4096)
    for ptr in (p + 1 * MiB, pooled, pooled + 512, va, host, 0, FAKE_BASE + 5 * DEVICE_STRIDE):
        expect_cuda_error(1, "CUDA_ERROR_INVALID_VALUE", b.ipc_mem_handle, ptr,
                          call="cuIpcGetMemHandle")
    b.vmm_unmap(va, 2 * MiB)
    b.vmm_release(phys)
    b.vmm_free_address(va, 2 * MiB)
    b.mem_free_async(0, pooled, s)
    b.stream_synchronize(s)
    b.pool_destroy(pool)
    b.host_free(host)
    b.mem_free(0, p)
